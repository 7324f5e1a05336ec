"""The container's host audit picks the runs that fit the GPU count and fails closed without a GPU."""

import sys
from pathlib import Path

import pytest

from detkit.toolkit.host_audit import main, plan


def _names(gpus):
    return [s.name for s in plan(gpus, Path("/r"))]


def test_plan_by_gpu_count():
    assert _names(1) == ["gemm"]
    assert _names(2) == _names(3) == ["gemm", "tp-cp-tp-group", "tp-cp-cp-group"]
    assert _names(8) == ["gemm", "tp-cp-4rank"]


def test_two_gpu_runs_hold_one_tp_and_one_cp_group_under_torchrun():
    steps = plan(2, Path("/r"))[1:]
    assert [dict(s.env)["DETKIT_TPCP_WORLD"] for s in steps] == ["0,1", "0,2"]
    for step in steps:
        assert step.argv[:3] == (sys.executable, "-m", "torch.distributed.run")
        assert "--nproc-per-node=2" in step.argv and step.argv[-1].endswith(step.name)


def test_no_gpu_is_refused():
    with pytest.raises(RuntimeError, match="no CUDA GPU is visible"):
        plan(0, Path("/r"))


def test_dry_run_prints_the_plan(capsys):
    assert main(["--gpus", "2", "--dry-run", "--out", "/r"]) == 0
    out = capsys.readouterr().out
    assert "[gemm]" in out and "DETKIT_TPCP_WORLD=0,2" in out and "--suite tp-cp" in out


def test_cpu_plan_is_one_interpreter_audit_of_the_requested_suites():
    [step] = plan(0, Path("/r"), device="cpu")
    assert step.argv[1:] == ("-m", "detkit", "audit", "--device", "cpu", "--suite", "all", "--out", "/r/cpu")
    [step] = plan(0, Path("/r"), device="cpu", suites=("gemm_contract", "tp-cp-refs"))
    assert step.argv[6:10] == ("--suite", "gemm_contract", "--suite", "tp-cp-refs")


def test_suite_knob_replaces_gemm_on_cuda_and_bad_device_is_refused():
    assert plan(1, Path("/r"), suites=("gemm_contract",))[0].argv[4:8] == ("--device", "cuda", "--suite",
                                                                           "gemm_contract")
    with pytest.raises(ValueError, match="device 'tpu' is not supported"):
        plan(1, Path("/r"), device="tpu")


def test_env_knobs_choose_device_and_suites(capsys, monkeypatch):
    monkeypatch.setenv("DETKIT_DEVICE", "cpu")
    monkeypatch.setenv("DETKIT_SUITE", "gemm_contract, tp-cp")
    assert main(["--dry-run", "--out", "/r"]) == 0
    out = capsys.readouterr().out
    assert "[cpu]" in out and "--device cpu --suite gemm_contract --suite tp-cp --out /r/host-audit-" in out


def test_no_gpu_on_cuda_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("DETKIT_DEVICE", raising=False)
    assert main(["--gpus", "0", "--out", "/r"]) == 2
    assert capsys.readouterr().err.startswith("host audit: error: no CUDA GPU is visible")
