"""The container's host audit: one ``detkit audit`` of DETKIT_SUITE (default all) on DETKIT_DEVICE; an unknown
suite is refused before the device, a cuda run without a GPU before any work; SIGINT reaches the audit, which
writes its report marked INCOMPLETE, and the host audit prints its path and status."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from detkit.toolkit.host_audit import main, plan, report_line

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_the_default_is_one_audit_of_every_suite_on_any_gpu_count(gpus):
    step = plan(gpus, Path("/r"))
    assert step.name == "cuda"
    assert step.argv[1:] == ("-m", "detkit", "audit", "--device", "cuda", "--suite", "all", "--no-progress",
                             "--out", "/r/cuda")


def test_cpu_plan_is_one_interpreter_audit_of_the_requested_suites():
    step = plan(0, Path("/r"), device="cpu")
    assert step.argv[1:] == ("-m", "detkit", "audit", "--device", "cpu", "--suite", "all", "--no-progress",
                             "--out", "/r/cpu")
    step = plan(0, Path("/r"), device="cpu", suites=("gemm_contract", "tp-cp-refs"))
    assert step.argv[6:10] == ("--suite", "gemm_contract", "--suite", "tp-cp-refs")


def test_no_gpu_is_refused():
    with pytest.raises(RuntimeError, match="no CUDA GPU is visible"):
        plan(0, Path("/r"))


def test_an_unknown_suite_is_refused_before_the_device():
    with pytest.raises(ValueError, match=r"suite\(s\) \['nosuch'\] not known; known: \['auto', 'all'"):
        plan(0, Path("/r"), suites=("nosuch",))
    with pytest.raises(ValueError, match="device 'tpu' is not supported"):
        plan(1, Path("/r"), device="tpu")


def test_dry_run_prints_the_command(capsys, monkeypatch):
    monkeypatch.delenv("DETKIT_SUITE", raising=False)
    monkeypatch.delenv("DETKIT_DEVICE", raising=False)
    assert main(["--gpus", "2", "--dry-run", "--out", "/r"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[cuda] ") and "--device cuda --suite all --no-progress --out /r/host-audit-" in out


def test_env_knobs_choose_device_and_suites(capsys, monkeypatch):
    monkeypatch.setenv("DETKIT_DEVICE", "cpu")
    monkeypatch.setenv("DETKIT_SUITE", "gemm_contract, tp-cp")
    assert main(["--dry-run", "--out", "/r"]) == 0
    out = capsys.readouterr().out
    assert "[cpu]" in out and "--device cpu --suite gemm_contract --suite tp-cp --no-progress --out /r/host-audit-" in out


def test_no_gpu_on_cuda_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("DETKIT_DEVICE", raising=False)
    monkeypatch.delenv("DETKIT_SUITE", raising=False)
    assert main(["--gpus", "0", "--out", "/r"]) == 2
    assert capsys.readouterr().err.startswith("host audit: error: no CUDA GPU is visible")


def test_unknown_suite_on_a_host_without_gpu_names_the_suite(capsys, monkeypatch):
    monkeypatch.delenv("DETKIT_DEVICE", raising=False)
    monkeypatch.setenv("DETKIT_SUITE", "nosuch")
    assert main(["--gpus", "0", "--out", "/r"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("host audit: error: suite(s) ['nosuch'] not known; known: ['auto', 'all'")


def test_report_line_reads_the_status_or_says_there_is_none(tmp_path):
    assert report_line(tmp_path, 1) == f"{tmp_path / 'report.md'}: not written (exit status 1; see the output above)"
    (tmp_path / "report.json").write_text(json.dumps({"meta": {"status": "FAILED"}}))
    assert report_line(tmp_path, 1) == f"{tmp_path / 'report.md'} (FAILED)"


def test_sigint_reaches_the_audit_which_writes_an_incomplete_report(tmp_path):
    """SIGINT to the host audit (a Ctrl-C at the terminal, or docker passing it to the container's PID 1) is
    passed on to the audit in its own process group, which writes report.json/report.md marked INCOMPLETE
    with the rows it finished; both exit with 130."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "DETKIT_SUITE")}
    env.update(DETKIT_DEVICE="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "detkit.toolkit.host_audit", "--suite", "gemm_contract",
                             "--out", str(tmp_path)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    try:
        rows_file = None
        while time.monotonic() < deadline and proc.poll() is None:
            found = list(tmp_path.glob("host-audit-*/cpu/rows.jsonl"))
            if found and found[0].read_bytes().count(b"\n") >= 2:
                rows_file = found[0]
                break
            time.sleep(0.05)
        assert rows_file is not None and proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    report = json.loads((rows_file.parent / "report.json").read_text())
    meta = report["meta"]
    assert meta["status"] == "INCOMPLETE", meta.get("status_reason")
    assert meta["status_reason"].startswith("interrupted by SIGINT in gemm_contract after ")
    streamed = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert report["rows"] == streamed and len(streamed) >= 2
    assert (rows_file.parent / "report.md").read_text().startswith("# INCOMPLETE report: interrupted by SIGINT")
    assert "host audit: SIGINT: passed on to the audit" in stderr
    assert f"\nhost audit: report: {rows_file.parent / 'report.md'} (INCOMPLETE)\n" in stdout
