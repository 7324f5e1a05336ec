"""``detkit bench comm`` on the CPU: 2 ranks (torchrun, gloo) at tiny sizes; rank 0 writes rows.jsonl,
report.json and report.md with sane fields, every collective validated against the v1 oracle and timed
through the operators' own collective path, the twin-store cost rows with their bits checked, one NVTX
range per row name on both ranks. Not a hardware result; the NCCL path needs 2 GPUs (``-m multigpu``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from detkit.bench import comm
from detkit.toolkit import cli
from tests.bench_helpers import bench_ctx, one_process, read_rows, torchrun_env
from tests.torchrun import run_two_ranks
from detkit.toolkit.nvtx_ranges import parse_injection_log, verify_nvtx_log

M_VALUES = (1, 6)
N = 8
ROUNDS, ITERS = 3, 2
IMPLS = ("raw", "row_parallel_fwd", "column_parallel_dx", "replicated_dw")


def test_formulas_and_names():
    assert comm.bus_factor(2) == 1.0 and comm.bus_factor(8) == 1.75  # nccl-tests all_reduce: 2(n-1)/n
    assert comm.row_name("row_parallel_fwd", 1024, 4096) == "row_parallel_fwd all_reduce [M=1024, N=4096] bf16"
    assert comm.twin_row_name("replicated_dw", 64) == "replicated_dw twin_store [M=64] bf16"


def test_cases_and_refusals():
    ranks = torchrun_env(2)
    ctx = bench_ctx()
    got = comm.cases(ctx, m_values=(1, 6), n_cols=8, environ=ranks)
    collectives = [(c.impl, c.m, c.n) for c in got if c.kind == comm.COLLECTIVE]
    assert collectives == [(i, m, 8) for m in (1, 6) for i in IMPLS]
    assert [c.name for c in got if c.kind == comm.TWIN_STORE] == [
        comm.twin_row_name(op, m) for m in (1, 6) for op in IMPLS[1:]]
    assert {(c.iters, c.warmup) for c in got} == {(2, 5)}  # the interpreter's default iters
    for kwargs, env, message in (({"m_values": (0,)}, ranks, "M and N must be >= 1"),
                                 ({"iters": 0}, ranks, "--iters must be >= 1"),
                                 ({"warmup": -1}, ranks, "--warmup must be >= 0"),
                                 ({}, {}, "needs 2 ranks: torchrun --nproc-per-node 2"),
                                 ({}, torchrun_env(4), "runs on 4 ranks")):
        with pytest.raises(ValueError, match=message):
            comm.cases(ctx, environ=env, **kwargs)
    with pytest.raises(ValueError, match="takes no --preset"):
        comm.cases(bench_ctx(["tiny"]), environ=ranks)


def test_refused_outside_a_two_rank_launch(tmp_path, monkeypatch):
    one_process(monkeypatch)
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
    all_rows = read_rows(out)
    assert json.loads((out / "report.json").read_text())["rows"] == all_rows
    rows = [r for r in all_rows if r["kind"] == comm.COLLECTIVE]
    assert [(r["impl"], r["M"]) for r in rows] == [(i, m) for m in M_VALUES for i in IMPLS]
    for r in rows:
        assert r["passed"] is True
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
            assert "detkit.kernels.parallel.operators._reduce" in r["timed"]
    twins = [r for r in all_rows if r["kind"] == comm.TWIN_STORE]
    assert [(r["operator"], r["M"]) for r in twins] == [(op, m) for m in M_VALUES for op in IMPLS[1:]]
    for r in twins:  # the GEMM's twin copy costs something, but changes no bit
        assert r["passed"] is True and r["bits_equal"] is True and r["rank"] == 0
        assert r["twin_cost_ratio"] == pytest.approx(r["twin_median_us"] / r["plain_median_us"])
    md = (out / "report.md").read_text()
    assert "NOT a hardware result" in md and "pg_backend: gloo" in md and "busbw_GBps" in md
    assert "## Environment" in md and "## Twin store" in md and "**PASS**" in md
    assert proc.stdout.count("# detkit bench comm report") == 1  # rank 0 reports


def test_each_row_is_an_nvtx_range_on_both_ranks(cpu_run):
    tmp, _ = cpu_run
    logs = sorted(tmp.glob("nvtx.*.log"))
    if not logs:
        pytest.skip("gcc not found: no NVTX injection library")
    names = [r["name"] for r in read_rows(tmp / "out") if r["kind"] == comm.COLLECTIVE]
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
    rows = [r for r in read_rows(tmp_path) if r["kind"] == comm.COLLECTIVE]
    assert {r["pg_backend"] for r in rows} == {"nccl"} and all(r["validated"] for r in rows)
    assert {r["M"] for r in rows} == set(comm.M_VALUES) and {r["N"] for r in rows} == {4096}
    assert (tmp_path / "comm_busbw.png").is_file()
