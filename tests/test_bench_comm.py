"""``detkit bench comm`` on the CPU: 2 ranks (torchrun, gloo) at tiny sizes write JSONL, CSV and
markdown rows with sane fields, validated against the v1 oracle, timed through the operators' own
collective path, with one NVTX range per row name. Not a hardware result; the NCCL path needs
2 GPUs (``-m multigpu``)."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from detkit.bench import comm
from detkit.toolkit import cli
from tests.torchrun import run_two_ranks
from detkit.toolkit.nvtx_ranges import parse_injection_log, verify_nvtx_log

M_VALUES = (1, 6)
N = 8
ROUNDS, ITERS = 3, 2
IMPLS = ("raw", "row_parallel_fwd", "column_parallel_dx", "replicated_dw")


def test_formulas_and_names():
    assert comm.bus_factor(2) == 1.0 and comm.bus_factor(8) == 1.75  # nccl-tests all_reduce: 2(n-1)/n
    assert comm.row_name("row_parallel_fwd", 1024, 4096) == "row_parallel_fwd all_reduce [M=1024, N=4096] bf16"
    assert comm.sizes(False) == [(m, 4096) for m in (1, 64, 1024, 4096, 8192, 16384)]
    assert comm.OPERATORS == {"row_parallel_fwd": "tp", "column_parallel_dx": "tp", "replicated_dw": "cp"}


def test_refused_outside_a_two_rank_launch(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    result = CliRunner().invoke(cli.main, ["bench", "comm", "--device", "cpu", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "needs 2 ranks: torchrun --nproc-per-node 2" in result.output
    assert not (tmp_path / "o").exists()


def _run_two_ranks(out: Path, nvtx_log: Path | None, device: str = "cpu", timeout: float = 240):
    args = ["bench", "comm", "--device", device, "--out", str(out), "--rounds", str(ROUNDS), "--iters", str(ITERS)]
    if device == "cpu":
        args += [a for m in M_VALUES for a in ("--m-local", str(m))] + ["--n-cols", str(N)]
    return run_two_ranks(args, device, nvtx_log, timeout)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("comm")
    log = tmp / "nvtx.%p.log" if shutil.which(os.environ.get("CC", "gcc")) else None
    proc = _run_two_ranks(tmp / "out", log)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return tmp, proc


def test_two_rank_gloo_rows_are_sane(cpu_run):
    tmp, proc = cpu_run
    out = tmp / "out"
    rows = [json.loads(line) for line in (out / "comm.jsonl").read_text().splitlines()]
    assert [(r["impl"], r["M"]) for r in rows] == [(i, m) for m in M_VALUES for i in IMPLS]
    for r in rows:
        assert r["name"] == comm.row_name(r["impl"], r["M"], N)
        assert r["N"] == N and r["bytes"] == r["M"] * N * 2 and r["dtype"] == "bf16"
        assert r["world_size"] == 2 and r["pg_backend"] == "gloo" and r["group_ranks"] == [0, 1]
        assert r["validated"] is True and r["mismatches"] == 0  # == (p0.float() + p1.float()).bfloat16()
        assert r["samples"] == ROUNDS and r["iters"] == ITERS
        assert 0 < r["p20_us"] <= r["median_us"] <= r["p80_us"]
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["median_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])  # 2 ranks: 2(n-1)/n = 1
        assert r["ratio_vs_raw"] == pytest.approx(r["median_us"] / r["raw_median_us"])
        assert r["target_applies"] is False and r["within_target"] is None  # tiny sizes: < 8 MiB
        if r["impl"] == "raw":
            assert r["axis"] is None and r["ratio_vs_raw"] == 1.0
        else:
            assert r["axis"] == comm.OPERATORS[r["impl"]]
            assert r["operator_path_calls"] == ROUNDS * ITERS and r["operator_path_ok"] is True
            assert "detkit.kernels.parallel._reduce" in r["timed"]
    with open(out / "comm.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [t["name"] for t in table] == [r["name"] for r in rows] and "busbw_GBps" in table[0]
    md = (out / "comm.md").read_text()
    assert "NOT a hardware result" in md and "pg_backend: gloo" in md and "busbw_GBps" in md
    assert "## Environment" in md
    assert proc.stdout.count("# detkit bench comm") == 1  # rank 0 reports


def test_each_row_is_an_nvtx_range_on_both_ranks(cpu_run):
    tmp, _ = cpu_run
    logs = sorted(tmp.glob("nvtx.*.log"))
    if not logs:
        pytest.skip("gcc not found: no NVTX injection library")
    names = [json.loads(line)["name"] for line in (tmp / "out" / "comm.jsonl").read_text().splitlines()]
    ranked = [log for log in logs if any(e.message in names for e in parse_injection_log(log))]
    assert len(ranked) == 2, logs  # one log per rank (the torchrun agent logs nothing of ours)
    for log in ranked:
        problems = verify_nvtx_log(log, ["bench comm", *names], nesting=[("bench comm", n) for n in names])
        assert problems == [], "\n".join(problems)
        # Each row's range opens once around its validation and once per round around its timing.
        pushes = [e for e in parse_injection_log(log) if e.kind == "push"]
        stages = {(a.message, b.message) for a, b in zip(pushes, pushes[1:]) if b.depth == a.depth + 1}
        counts = {n: sum(e.message == n for e in pushes) for n in names}
        for name in names:
            assert {(name, "validate"), (name, "time")} <= stages, name
            assert counts[name] == 1 + ROUNDS, (name, counts[name])


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.multigpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs of one host with NCCL")
def test_nccl_two_gpus(tmp_path):
    proc = _run_two_ranks(tmp_path, None, device="cuda", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (tmp_path / "comm.jsonl").read_text().splitlines()]
    assert {r["pg_backend"] for r in rows} == {"nccl"} and all(r["validated"] for r in rows)
    assert {r["M"] for r in rows} == set(comm.M_VALUES) and {r["N"] for r in rows} == {4096}
    assert (tmp_path / "comm_busbw.png").is_file()
