"""``detkit bench mlp`` on the CPU: one process (TP1CP1) and 2 gloo ranks holding one TP group
(torchrun, ``DETKIT_TPCP_WORLD=0,1``: TP1CP1 and TP2CP1) at the tiny dims write rows.jsonl, report.json
and report.md, one row per (config, implementation, mode), every one validated against the FP64 MLP before timing,
with medians / p20 / p80, the two ratios and their targets, and one NVTX range per row name on both
ranks. The torch baseline's validation fails on a wrong weight order. Not a hardware result: the
NCCL paths (``-m multigpu``, ``-m gpu``) are written and skipped here."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from detkit.bench import mlp
from detkit.kernels.parallel.mlp import mlp_bounds, mlp_ref_fp64
from detkit.toolkit import cli
from detkit.toolkit.layout import layout_for_preset
from tests.bench_helpers import bench_ctx, one_process, read_rows, torchrun_env
from tests.torchrun import run_two_ranks
from detkit.toolkit.nvtx_ranges import parse_injection_log, verify_nvtx_log

ROUNDS = 2  # the median of two samples is their mean: total == fwd + bwd exactly (checked)
M, B, S, H, I = 12, 2, 6, 64, 96  # the tiny preset
IMPLS = [("torch", "bf16"), ("detkit", "bf16"), ("detkit", "fp32_invariant")]


def test_names_formulas_and_shapes():
    assert mlp.row_name("TP2CP1", "detkit", "fp32_invariant", 4096, 4096, 12288) == \
        "mlp TP2CP1 detkit fp32_invariant [M=4096, H=4096, I=12288] fwd+bwd"
    # Per-rank FLOPs: fwd = Gate|Up 4*M*H*I + Down 2*M*I*H; bwd = dHidden 2 + dX 4 + dW_gate_up 4 + dW_down 2.
    assert mlp.flops("fwd", 7, 3, 5) == 6 * 7 * 3 * 5 and mlp.flops("bwd", 7, 3, 5) == 12 * 7 * 3 * 5
    assert mlp.flops("total", 7, 3, 5) == mlp.flops("fwd", 7, 3, 5) + mlp.flops("bwd", 7, 3, 5)
    assert mlp.shapes(False) == [(4096, 4096), (16384, 4096)] and mlp.shapes(True) == [(12, 6)]
    layout = mlp.layout_for_tokens(layout_for_preset("qwen3-8b-tp2", (0, 2)), 16384, 4096)
    assert (layout.batch, layout.seq_len, layout.m_local, layout.world) == (4, 4096, 8192, (0, 2))
    with pytest.raises(ValueError, match="M must be B\\*S"):
        mlp.shapes(True, (13,))
    assert mlp.configs(None) == [(1, 1)]


def test_modes_and_configs_are_the_kernels_and_the_audits():
    """Named in the plug-in so that the CLI imports no kernel; they must stay those of their sources."""
    from detkit.audits.invariance import CONFIGS
    from detkit.kernels.parallel.invariant import BF16, FP32_INVARIANT, MODES

    assert (mlp.BF16, mlp.FP32_INVARIANT, mlp.MODES, mlp.CONFIGS) == (BF16, FP32_INVARIANT, MODES, CONFIGS)


@pytest.mark.parametrize("env, held", [
    ({}, [(1, 1)]),
    (torchrun_env(2, DETKIT_TPCP_WORLD="0,1"), [(1, 1), (2, 1)]),
    (torchrun_env(2, DETKIT_TPCP_WORLD="0,2"), [(1, 1), (1, 2)]),
    (torchrun_env(4), [(1, 1), (2, 1), (1, 2), (2, 2)]),
])
def test_cases_follow_the_world_of_the_launch(env, held):
    ctx = bench_ctx()
    got = mlp.cases(ctx, environ=env)
    assert [(c.tp, c.cp, c.impl, c.mode) for c in got] == [(tp, cp, i, m) for tp, cp in held for i, m in IMPLS]
    assert [c.name for c in got] == [mlp.row_name(f"TP{tp}CP{cp}", i, m, M, H, I) for tp, cp in held for i, m in IMPLS]
    assert {(c.m, c.seq_len, c.iters, c.warmup) for c in got} == {(M, S, 1, 0)}
    with pytest.raises(ValueError, match="cannot hold the TP=2 x CP=2 layout"):
        mlp.cases(ctx, environ=torchrun_env(3))


def test_usage_errors_before_any_work(tmp_path, monkeypatch):
    one_process(monkeypatch)
    for args, message in ((["--tokens", "13"], "M must be B*S"), (["--rounds", "0"], "--rounds must be >= 1; got 0"),
                          (["--iters", "0"], "--iters must be >= 1"), (["--warmup", "-1"], "--warmup must be >= 0")):
        result = CliRunner().invoke(cli.main, ["bench", "mlp", "--device", "cpu", "--out", str(tmp_path / "o"), *args])
        assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "o").exists()


def test_validation_catches_a_wrong_baseline(monkeypatch):
    """The baseline's check is real: Gate and Up swapped in its weights fail it (detkit's contract is
    exercised by tests/test_mlp.py)."""
    from detkit.toolkit.shard_refs import make_fixtures

    layout = layout_for_preset("tiny")
    fx = make_fixtures(layout, 1234, "cpu").tensors
    args = [fx[n] for n in ("x", "w_gate", "w_up", "w_down", "d_out")]
    ref = mlp_ref_fp64(*args)
    bounds = mlp_bounds(*args, ref)
    monkeypatch.setattr(mlp, "IMPLS", (("torch", "bf16"),))
    good = mlp.validate(mlp.build_cases(None, layout, fx, 1, 1)[0], ref, bounds)
    assert good["passed"] and good["rel_l2_max"] <= mlp.BASELINE_REL_L2
    swapped = {**fx, "w_gate": fx["w_up"], "w_up": fx["w_gate"]}
    bad = mlp.validate(mlp.build_cases(None, layout, swapped, 1, 1)[0], ref, bounds)
    assert not bad["passed"] and bad["rel_l2_max"] > mlp.BASELINE_REL_L2 and not bad["contract_passed"]


def _check_rows(rows: list[dict], configs: list[str], world_size: int, pg_backend: str | None) -> None:
    assert [(r["config"], r["impl"], r["mode"]) for r in rows] == [(c, i, m) for c in configs for i, m in IMPLS]
    by = {(r["config"], r["impl"], r["mode"]): r for r in rows}
    for r in rows:
        tp = r["tp"]
        assert r["name"] == mlp.row_name(r["config"], r["impl"], r["mode"], M, H, I)
        assert (r["M"], r["B"], r["S"], r["M_local"], r["H"], r["I"], r["I_local"]) == (M, B, S, M, H, I, I // tp)
        assert r["world_size"] == world_size and r["pg_backend"] == pg_backend
        assert r["backend"] == "triton_interpreter" and r["hardware_result"] is False and "interpreter" in r["clock"]
        # Validated against FP64 on every rank before timing.
        assert r["validated"] is True and r["timed"] is True
        assert r["validated_layout_ranks"] == list(range(world_size))
        if r["impl"] == "detkit":
            assert r["contract_passed"] is True and r["contract_violations"] == 0
            assert 0 < r["contract_worst_ratio"] <= 1
        else:
            assert 0 < r["rel_l2_max"] <= mlp.BASELINE_REL_L2
        assert r["samples"] == ROUNDS and r["rounds"] == ROUNDS and r["iters"] == 1
        for phase in mlp.PHASES:
            assert 0 < r[f"{phase}_p20_us"] <= r[f"{phase}_median_us"] <= r[f"{phase}_p80_us"], (r["name"], phase)
            assert r[f"{phase}_tflops_per_rank"] is None  # no TFLOP/s from the interpreter
        # A sample's total is fwd + bwd of the same steps, each phase the slowest rank's (so the total is at
        # most the sum, and equal to it in one process); the median of two samples is their mean.
        fwd_plus_bwd = r["fwd_median_us"] + r["bwd_median_us"]
        if world_size == 1:
            assert r["total_median_us"] == pytest.approx(fwd_plus_bwd)
        else:
            assert r["total_median_us"] <= fwd_plus_bwd * (1 + 1e-9)
    for c in configs:
        base, dflt, inv = (by[(c, i, m)] for i, m in IMPLS)
        for phase in mlp.PHASES:
            assert dflt[f"default_vs_baseline_{phase}"] == pytest.approx(
                dflt[f"{phase}_median_us"] / base[f"{phase}_median_us"])
            assert inv[f"invariant_vs_default_{phase}"] == pytest.approx(
                inv[f"{phase}_median_us"] / dflt[f"{phase}_median_us"])
            assert base[f"default_vs_baseline_{phase}"] is None and inv[f"default_vs_baseline_{phase}"] is None
        assert dflt["target"] == "default_vs_baseline_total <= 1.1"
        assert dflt["within_target"] == (dflt["default_vs_baseline_total"] <= 1.10)
        assert inv["target"] == "invariant_vs_default_total <= 1.15"
        assert inv["within_target"] == (inv["invariant_vs_default_total"] <= 1.15)
        assert base["target"] is None and base["within_target"] is None


def _check_files(out: Path, rows: list[dict], configs: list[str]) -> str:
    assert json.loads((out / "report.json").read_text())["rows"] == rows
    md = (out / "report.md").read_text()
    assert "NOT a hardware result" in md and "## Environment" in md and "## Targets" in md
    targets = md.split("## Targets", 1)[1].split("## NOT COVERED", 1)[0]
    assert all(re.search(rf"\|\s+{M} \| {c}\s+\|", targets) for c in configs), targets  # a line per (M, config)
    assert "## NOT COVERED" in md and "inter-node groups: one host" in md and "**PASS**" in md
    assert not (out / "mlp_time.png").exists()  # no plot of interpreter wall time
    return md


def test_one_process_tp1cp1(tmp_path, monkeypatch):
    one_process(monkeypatch)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli.main, ["bench", "mlp", "--device", "cpu", "--out", str(out), "--rounds",
                                           str(ROUNDS), "--json"])
    assert result.exit_code == 0, result.output
    rows = read_rows(out)
    _check_rows(rows, ["TP1CP1"], 1, None)
    md = _check_files(out, rows, ["TP1CP1"])
    assert "['TP2CP1', 'TP1CP2', 'TP2CP2']: their TP/CP groups are not held by this world (one process)" in md
    printed = json.loads(result.stdout[result.stdout.index("{"):])
    assert printed["rows"] == rows and printed["meta"]["world"] == "one process"


def test_a_failed_validation_is_not_timed_and_exits_1(tmp_path, monkeypatch):
    one_process(monkeypatch)
    monkeypatch.setattr(mlp, "IMPLS", (("torch", "bf16"),))  # the cheap implementation only
    monkeypatch.setattr(mlp, "BASELINE_REL_L2", 0.0)  # no BF16 result is that close to FP64
    result = CliRunner().invoke(cli.main, ["bench", "mlp", "--device", "cpu", "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert (f"FAILED {mlp.row_name('TP1CP1', 'torch', 'bf16', M, H, I)}: validation failed before timing "
            "(not timed)") in result.output
    (row,) = read_rows(tmp_path)
    assert row["passed"] is row["validated"] is row["timed"] is False and row["validated_layout_ranks"] == []
    assert row["samples"] == 0 and row["total_median_us"] is None


def _torchrun(out: Path, nvtx_log: Path | None, device: str, world: str, extra: list[str], timeout: float):
    return run_two_ranks(["bench", "mlp", "--device", device, "--out", str(out), *extra], device, nvtx_log,
                         timeout, {"DETKIT_TPCP_WORLD": world})


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlp")
    log = tmp / "nvtx.%p.log" if shutil.which(os.environ.get("CC", "gcc")) else None
    proc = _torchrun(tmp / "out", log, "cpu", "0,1", ["--rounds", str(ROUNDS)], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return tmp, proc


def test_two_rank_gloo_tp_group(two_rank_run):
    tmp, proc = two_rank_run
    out = tmp / "out"
    rows = read_rows(out)
    _check_rows(rows, ["TP1CP1", "TP2CP1"], 2, "gloo")
    assert all(r["layout_ranks"] == [0, 1] for r in rows)
    md = _check_files(out, rows, ["TP1CP1", "TP2CP1"])
    assert "['TP1CP2', 'TP2CP2']: their TP/CP groups are not held by this world ([0, 1])" in md
    assert "pg_backend: gloo" in md and "world_size: 2" in md
    assert proc.stdout.count("# detkit bench mlp report") == 1  # rank 0 reports
    # Beside the report only the ranks' heartbeats (toolkit.dist's stuck-rank watch), no per-rank rows.
    assert sorted(p.name for p in out.iterdir()) == ["ranks", "report.json", "report.md", "rows.jsonl"]
    assert sorted(p.name for p in (out / "ranks").iterdir()) == ["alive-rank0.json", "alive-rank1.json"]


def test_each_row_is_an_nvtx_range_on_both_ranks(two_rank_run):
    tmp, _ = two_rank_run
    logs = sorted(tmp.glob("nvtx.*.log"))
    if not logs:
        pytest.skip("gcc not found: no NVTX injection library")
    names = [r["name"] for r in read_rows(tmp / "out")]
    ranked = [log for log in logs if any(e.message in names for e in parse_injection_log(log))]
    assert len(ranked) == 2, logs
    nesting = [("bench mlp", n) for n in names] + [(n, s) for n in names for s in ("fwd", "bwd")]
    for log in ranked:
        problems = verify_nvtx_log(log, ["bench mlp", *names], nesting=nesting)
        assert problems == [], "\n".join(problems)
        # Each row's range opens once around its validation and once per round around a sample.
        pushes = [e for e in parse_injection_log(log) if e.kind == "push"]
        stages = {(a.message, b.message) for a, b in zip(pushes, pushes[1:]) if b.depth == a.depth + 1}
        for name in names:
            assert {(name, "validate"), (name, "time")} <= stages, name
            assert sum(e.message == name for e in pushes) == 1 + ROUNDS, name


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
def test_one_gpu_qwen3_8b(tmp_path, monkeypatch):
    one_process(monkeypatch)
    result = CliRunner().invoke(cli.main, ["bench", "mlp", "--device", "cuda", "--out", str(tmp_path), "--tokens",
                                           "4096", "--rounds", "3"])
    assert result.exit_code == 0, result.output
    rows = read_rows(tmp_path)
    assert [r["config"] for r in rows] == ["TP1CP1"] * 3 and all(r["validated"] and r["timed"] for r in rows)
    assert all(r["hardware_result"] and r["total_tflops_per_rank"] > 0 for r in rows)
    assert (tmp_path / "mlp_time.png").is_file()


@pytest.mark.multigpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs of one host with NCCL")
@pytest.mark.parametrize(("world", "config"), [("0,1", "TP2CP1"), ("0,2", "TP1CP2")])
def test_nccl_two_gpus(tmp_path, world, config):
    proc = _torchrun(tmp_path, None, "cuda", world, ["--tokens", "4096", "--rounds", "3"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = read_rows(tmp_path)
    assert {r["config"] for r in rows} == {"TP1CP1", config} and {r["pg_backend"] for r in rows} == {"nccl"}
    assert all(r["validated"] and r["timed"] and r["hardware_result"] for r in rows)
    assert (tmp_path / "mlp_time.png").is_file()
