"""toolkit/provenance.py: the config tables of the loaded kernel modules, and the source files of a run checked
against git, in throwaway repositories made with the real git: a clean checkout, a dirty one (changed,
untracked and deleted files listed), a tree copied with a stale .git (dirty, never clean), a tree with no .git
(DETKIT_GIT_COMMIT recorded as unverified) and the installed layout (the same digest as the checkout)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from detkit.toolkit import provenance as pv

REPO = Path(__file__).resolve().parents[1]
FILES = {
    "kernels/__init__.py": "", "kernels/gemm.py": "TABLE = 1\n", "kernels/sub/deep.py": "X = 2\n",
    "toolkit/__init__.py": "", "toolkit/cli.py": "def main():\n    pass\n", "audits/__init__.py": "",
    "bench/__init__.py": "", "bench/moe.py": "NAME = 'moe'\n", "detkit/__init__.py": "", "detkit/__main__.py": "",
    "detkit/data/skipped.py": "# not a detkit/ top-level module\n", "README.md": "# outside the package\n",
}

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


def _tree(root: Path, files: dict[str, str] = FILES) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _repo(root: Path) -> tuple[Path, str]:
    _tree(root)
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return root, _git(root, "rev-parse", "HEAD")


def _manifest_digest(root: Path, paths: list[str]) -> str:
    """The documented digest, recomputed here the way sha256sum would list the files."""
    logical = {("detkit/" + p if not p.startswith("detkit/") else p): root / p for p in paths}
    lines = "".join(f"{hashlib.sha256(logical[p].read_bytes()).hexdigest()}  {p}\n" for p in sorted(logical))
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


PACKAGE_PY = ["kernels/__init__.py", "kernels/gemm.py", "kernels/sub/deep.py", "toolkit/__init__.py", "toolkit/cli.py",
              "audits/__init__.py", "bench/__init__.py", "bench/moe.py", "detkit/__init__.py", "detkit/__main__.py"]


def test_clean_checkout(tmp_path):
    root, head = _repo(tmp_path / "repo")
    state = pv.source_state(root, environ={})
    assert state["status"] == "clean" and state["git_commit"] == head and state["dirty_files"] == []
    assert state["files"] == len(PACKAGE_PY)  # README.md and detkit/data/ are not package sources
    assert state["digest"] == state["head_digest"] == _manifest_digest(root, PACKAGE_PY)


def test_dirty_checkout_lists_changed_untracked_and_deleted_files(tmp_path):
    root, head = _repo(tmp_path / "repo")
    clean_digest = pv.source_state(root, environ={})["digest"]
    (root / "kernels" / "gemm.py").write_text("TABLE = 2\n")
    (root / "bench" / "new.py").write_text("")
    (root / "toolkit" / "cli.py").unlink()
    (root / "README.md").write_text("changed outside the package: not listed\n")
    state = pv.source_state(root, environ={})
    assert state["status"] == "dirty" and state["git_commit"] == head
    assert state["dirty_files"] == ["bench/new.py", "kernels/gemm.py", "toolkit/cli.py"]
    assert state["digest"] != clean_digest and state["head_digest"] == clean_digest
    assert "dirty: bench/new.py, kernels/gemm.py, toolkit/cli.py" in pv.format_source(state)


def test_copied_tree_with_a_stale_git_is_dirty_not_clean(tmp_path):
    """A tree at a later commit copied with the .git of an earlier one: its files differ from that HEAD."""
    root, old = _repo(tmp_path / "repo")
    stale_git = tmp_path / "stale.git"
    shutil.copytree(root / ".git", stale_git)
    (root / "kernels" / "gemm.py").write_text("TABLE = 3\n")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns(".git"))
    shutil.copytree(stale_git, copy / ".git")
    state = pv.source_state(copy, environ={pv.COMMIT_ENV: _git(root, "rev-parse", "HEAD")})
    assert state["git_commit"] == old and state["status"] == "dirty"
    assert state["dirty_files"] == ["kernels/gemm.py"] and state["digest"] != state["head_digest"]
    assert state["declared_commit_matches_head"] is False  # the image's declared commit is not the stale HEAD
    assert state["digest"] == pv.source_state(root, environ={})["digest"]  # the digest names the files that ran


def test_no_git_records_the_declared_commit_as_unverified(tmp_path):
    root, head = _repo(tmp_path / "repo")
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns(".git"))
    state = pv.source_state(copy, environ={pv.COMMIT_ENV: head})
    assert state["status"] == "unverified" and state["git_commit"] == head
    assert state["commit_source"] == pv.COMMIT_ENV and "is declared, not checked" in state["reason"]
    assert state["digest"] == pv.source_state(root, environ={})["digest"]  # matched to the tree by content
    unknown = pv.source_state(copy, environ={})
    assert unknown["status"] == "unknown" and unknown["git_commit"] is None and "is not set" in unknown["reason"]


def test_a_folder_inside_another_repository_is_not_taken_for_its_checkout(tmp_path):
    outer, _ = _repo(tmp_path / "outer")
    inner = _tree(outer / "site" / "detkit", {k.removeprefix("detkit/"): v for k, v in FILES.items()})
    state = pv.source_state(inner, environ={})
    assert state["status"] == "unknown" and "not a git checkout's root" in state["reason"]


def test_installed_layout_has_the_checkout_digest(tmp_path):
    checkout = _tree(tmp_path / "checkout")
    installed = _tree(tmp_path / "site" / "detkit",
                      {(k.removeprefix("detkit/") if k.startswith("detkit/") else k): v for k, v in FILES.items()})
    files = pv.package_files(installed)
    assert sorted(files) == sorted(pv.package_files(checkout)) == sorted(
        p if p.startswith("detkit/") else "detkit/" + p for p in PACKAGE_PY)
    assert pv.tree_digest(installed) == pv.tree_digest(checkout)


def test_this_checkout_is_recorded():
    state = pv.source_state()
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", state["digest"]) and state["files"] > 20
    if (REPO / ".git").exists():
        assert state["git_commit"] == _git(REPO, "rev-parse", "HEAD")
        assert state["status"] in ("clean", "dirty")


# ---------------------------------------------------------------------------------------------- config tables
def test_config_tables_come_from_the_loaded_kernel_modules():
    modules = {
        "detkit.kernels.det_gemm.launch": SimpleNamespace(CONFIG_TABLE_VERSION="g.1"),
        "detkit.kernels.moe.layer": SimpleNamespace(MOE_CONFIG_TABLE_VERSION="m.7"),
        "detkit.kernels.moe.ws": SimpleNamespace(MOE_CONFIG_TABLE_VERSION="m.7"),  # a re-export: listed once
        "detkit.audits.moe": SimpleNamespace(MOE_FP8_CONFIG_TABLE_VERSION="not a kernel module"),
        "detkit.kernels.moe.fp8.layer": None,  # a failed import leaves None in sys.modules
    }
    assert pv.config_tables(modules) == [{"name": "det_gemm", "version": "g.1", "module": "detkit.kernels.det_gemm.launch"},
                                         {"name": "moe_bf16", "version": "m.7", "module": "detkit.kernels.moe.layer"}]
    clash = {**modules, "detkit.kernels.moe_tables": SimpleNamespace(MOE_CONFIG_TABLE_VERSION="m.8")}
    moe = [t for t in pv.config_tables(clash) if t["name"] == "moe_bf16"]
    assert [(t["version"], t.get("conflict")) for t in moe] == [("m.7", True), ("m.8", True)]
    assert pv.format_config_tables(pv.config_tables(modules)) == "det_gemm g.1, moe_bf16 m.7"


def test_every_config_table_of_the_kernels_is_named():
    """A new pinned table must be recorded in reports: each ``*CONFIG_TABLE_VERSION = ...`` defined in
    kernels/ is in CONFIG_TABLES."""
    defined = {m.group(1) for path in (REPO / "kernels").rglob("*.py")
               for m in re.finditer(r"^([A-Z0-9_]*CONFIG_TABLE_VERSION)\s*[:=]", path.read_text(), re.M)}
    assert defined and defined <= {attr for _, attr in pv.CONFIG_TABLES}, defined


def test_the_tables_of_a_run_are_those_it_imported(tmp_path):
    """In a fresh process: nothing loaded, nothing listed; importing the FP8 MoE kernels lists its table and the
    BF16 one it builds on, with the versions the modules define."""
    script = ("import json, sys\nfrom detkit.toolkit.provenance import config_tables\nbefore = config_tables()\n"
              "import detkit.kernels.moe.fp8.layer as f, detkit.kernels.moe.layer as m\n"
              "print(json.dumps([before, config_tables(), m.MOE_CONFIG_TABLE_VERSION, f.MOE_FP8_CONFIG_TABLE_VERSION]))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after, bf16, fp8 = json.loads(proc.stdout.strip().splitlines()[-1])
    assert before == []
    got = {t["name"]: t["version"] for t in after}
    assert got["moe_bf16"] == bf16 and got["moe_fp8"] == fp8
