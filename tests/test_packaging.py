"""The installed distribution: one import name, ``detkit``.

Builds the wheel from a copy of the package folders, installs it into a fresh virtual environment
and checks what lands on sys.path: ``detkit`` and its dist-info only, no top-level ``kernels``,
``toolkit``, ``audits`` or ``bench``; the public API, ``python -m detkit`` and the ``detkit``
console script work from the installed copy (not from this checkout).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What pyproject.toml packages (its package-dir map) plus the files the build reads.
PACKAGE_FOLDERS = ("detkit", "kernels", "mode", "toolkit", "audits", "bench")
BUILD_FILES = ("pyproject.toml", "README.md", "LICENSE")
GENERIC_NAMES = ("kernels", "mode", "toolkit", "audits", "bench")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_FILES:
        shutil.copy2(ROOT / name, src / name)
    for name in PACKAGE_FOLDERS:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True, timeout=300)
    wheels = list(out.glob("detkit-*.whl"))
    if len(wheels) != 1:
        raise AssertionError(f"expected one detkit wheel in {out}, found {[w.name for w in wheels]}")
    return wheels[0]


def test_wheel_has_one_top_level_name(wheel):
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/", 1)[0] for name in zf.namelist()}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == {"detkit"}, f"top-level entries of {wheel.name}: {sorted(tops)}"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    for part in GENERIC_NAMES:  # each repository folder lands inside the one package
        assert f"detkit/{part}/__init__.py" in names, f"detkit/{part}/ missing from {wheel.name}"


def test_wheel_states_the_license_and_carries_its_text(wheel):
    """Apache-2.0, as pyproject.toml states it (``license = {text = ...}``, the form setuptools >= 69 reads);
    the LICENSE file travels in the dist-info."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
        fields = zf.read(metadata).decode().split("\n\n", 1)[0].splitlines()
        [license_file] = [n for n in names if n.endswith("LICENSE") and ".dist-info/" in n]
        text = zf.read(license_file).decode()
    assert "License: Apache-2.0" in fields
    assert text == (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text


def test_installed_wheel_in_a_fresh_venv(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    # Install with this interpreter's pip into the fresh venv's site-packages (the fresh venv has no pip).
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(purelib),
                    str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    installed = {p.name for p in purelib.iterdir() if not p.name.startswith(("_", "."))}
    assert {n for n in installed if not n.endswith(".dist-info") and n != "bin"} == {"detkit"}, sorted(installed)
    # The dependencies (torch, click, ...) come from this environment's site-packages as a plain path
    # entry: its .pth files (among them this checkout's editable install) are not processed.
    (purelib / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    probe = ("import importlib.util as u, pathlib, sys, detkit, detkit.kernels.det_gemm.launch as dg; "
             "from detkit import det_gemm_fwd, batch_invariant_mode, moe_mlp_fp8; "
             f"print(pathlib.Path(detkit.__file__).parent); print(pathlib.Path(dg.__file__).parent.parent); "
             f"print([n for n in {GENERIC_NAMES!r} if u.find_spec(n) is not None])")
    proc = subprocess.run([str(py), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    pkg_dir, kernels_parent, generic = proc.stdout.strip().splitlines()
    assert Path(pkg_dir) == purelib / "detkit"
    assert Path(kernels_parent) == purelib / "detkit" / "kernels"  # det_gemm is a family sub-package
    assert generic == "[]", f"generic top-level names importable from the installed wheel: {generic}"
    # python -m detkit, and the console script as installers generate it (entry point detkit = ...:main).
    script = ("import sys; from importlib.metadata import entry_points; "
              "(ep,) = [e for e in entry_points(group='console_scripts') if e.name == 'detkit']; "
              "sys.argv = ['detkit', '--help']; ep.load()()")
    for cmd in ([str(py), "-m", "detkit", "--help"], [str(py), "-c", script]):
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "audit" in proc.stdout and "bench" in proc.stdout, (cmd, proc.stderr)
