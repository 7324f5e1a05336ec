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
