"""tools/moe_tune.py on the CPU (Triton interpreter; timings are plumbing, not hardware results): the
sweep times every candidate beside the pinned config on the layer's own intermediates, records a
refused config as an error row, and the per-stage pick is the lowest geometric-mean time ratio."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import tools.moe_tune as mt
from detkit.kernels.det_gemm.launch import GemmConfig


def test_sweep_times_candidates_beside_the_pinned_config(monkeypatch):
    odd = GemmConfig(64, 33, 32, 1, 4, 1)  # odd BLOCK_N: up refuses it (gate/up pairs)
    small = GemmConfig(64, 32, 32, 1, 4, 1)
    monkeypatch.setattr(mt, "GROUPED", [small, odd])
    monkeypatch.setattr(mt, "GROUPED_WS", [])  # Gluon: no interpreter path (refused by name, tests/test_moe_ws.py)
    monkeypatch.setattr(mt, "RASTER_GROUP_MS", ())  # the sm_90 picks in the grouped order: GPU sweeps
    monkeypatch.setattr(mt, "WGRAD", [GemmConfig(32, 32, 32, 1, 4, 1)])
    rows = mt.sweep(["tiny"], ["up", "wgrad_w2"], torch.device("cpu"), rounds=1)
    errors = [r for r in rows if "error" in r]
    assert [(r["stage"], r["config"]) for r in errors] == [("up", odd.label())]
    assert "must be even" in errors[0]["error"]
    timed = [r for r in rows if "median_us" in r]
    assert {(r["stage"], r["is_pinned"]) for r in timed} == {("up", True), ("up", False), ("wgrad_w2", True),
                                                             ("wgrad_w2", False)}
    # The interpreter accumulates sequentially: every tile config gives the pinned bits.
    assert all(r["bits_equal_pinned"] for r in timed)
    assert all(r["median_us"] > 0 and r["p20_us"] <= r["median_us"] <= r["p80_us"] for r in timed)
    summary = mt.best_per_stage(rows)
    assert [s["stage"] for s in summary] == ["up", "wgrad_w2"]
    for s in summary:
        sel = {r["config"]: r["median_us"] for r in timed if r["stage"] == s["stage"]}
        assert s["best"] == min(sel, key=sel.get)
        assert s["best_time_vs_pinned"] == pytest.approx(min(sel.values()) / sel[s["pinned"]])


def test_best_per_stage_uses_the_geometric_mean_over_presets_and_needs_every_preset():
    def row(preset, config, us, pinned=False):
        return {"preset": preset, "stage": "down", "config": config, "pinned": "P", "is_pinned": pinned,
                "median_us": us, "tflops": 1.0 / us}

    rows = [row("a", "P", 100, True), row("b", "P", 100, True), row("a", "X", 20), row("b", "X", 180),
            row("a", "Y", 90), row("b", "Y", 90), row("a", "Z", 10)]  # Z ran at one preset only
    (s,) = mt.best_per_stage(rows)
    # Time ratios to the pinned config: X 0.2 and 1.8 (geometric mean 0.6, arithmetic 1.0), Y 0.9 at both:
    # the geometric mean picks X, an arithmetic mean would pick Y; Z is left out (not timed at b).
    assert s["best"] == "X" and s["best_time_vs_pinned"] == pytest.approx(0.6)


def test_unknown_stage_is_refused():
    with pytest.raises(ValueError, match="stage 'gate' not known"):
        mt.candidates("gate")


def test_fp8_stages_sweep_the_fp8_table(monkeypatch):
    from detkit.kernels.moe.fp8.layer import select_moe_fp8_config

    other = GemmConfig(128, 128, 64, 1, 4, 1)  # BLOCK_K 64 divides the 128-K scale block
    other_tma = GemmConfig(128, 128, 64, 1, 4, 1, variant="tma")  # the weight tile through TMA
    monkeypatch.setattr(mt, "FP8_GROUPED", [other, other_tma])
    monkeypatch.setattr(mt, "RASTER_GROUP_MS", ())
    rows = mt.sweep(["tiny-fp8"], ["fp8_down"], torch.device("cpu"), rounds=1)
    assert [r["config"] for r in rows] == [select_moe_fp8_config("down", "triton_interpreter").label(), other.label(),
                                           other_tma.label()]
    assert all(r["bits_equal_pinned"] and r["stage"] == "fp8_down" for r in rows)


@pytest.mark.parametrize("stages, candidates, pinned_table, other", [
    # the FP8 weight gradients: both column-wise operands by TMA, scales one block ahead
    (("fp8_wgrad_w1", "fp8_wgrad_w2"), "FP8_WGRAD", "FP8_WGRAD_CONFIGS", GemmConfig(128, 128, 128, 1, 4, 1, variant="tma")),
    # the column-wise quantizer: a quarter of the interpreter's pinned 256-column tile
    (("fp8_colq_x", "fp8_colq_dgu"), "FP8_COLQ", "QUANT_COLWISE_CONFIGS", GemmConfig(128, 64, 16, 1, 4, 1)),
])
def test_fp8_wgrad_and_colq_stages_sweep_their_own_tables(monkeypatch, stages, candidates, pinned_table, other):
    import detkit.kernels.moe.fp8.layer as kf

    monkeypatch.setattr(mt, candidates, [other])
    rows = mt.sweep(["tiny-fp8"], list(stages), torch.device("cpu"), rounds=1)
    pinned = getattr(kf, pinned_table)["triton_interpreter"].label()
    assert [(r["stage"], r["config"]) for r in rows] == [(s, c) for s in stages for c in (pinned, other.label())]
    assert all(r["bits_equal_pinned"] and r["median_us"] > 0 for r in rows)


def test_config_labels_parse_back_to_their_configs_and_bad_labels_are_refused():
    every = mt.GROUPED + mt.GROUPED_WS + mt.WGRAD + mt.FP8_GROUPED + mt.FP8_UP + mt.FP8_DGRAD + mt.FP8_WGRAD
    every += [c for stage in ("dx", "fp8_up") for c in mt.raster_candidates(stage, mt.RASTER_GROUP_MS)]
    assert all(mt.parse_config(c.label()) == c for c in every)
    with pytest.raises(mt.argparse.ArgumentTypeError, match="'BM128_BN256' is not a GemmConfig label"):
        mt.parse_config("BM128_BN256")


def test_only_the_given_configs_are_timed_beside_the_pinned_one(monkeypatch):
    small = GemmConfig(64, 32, 32, 1, 4, 1)
    monkeypatch.setattr(mt, "GROUPED", [GemmConfig(32, 32, 32, 1, 4, 1)])  # not timed: --config replaces the list
    rows = mt.sweep(["tiny"], ["up"], torch.device("cpu"), rounds=1, only=[small])
    assert sorted((r["config"], r["is_pinned"]) for r in rows) == sorted(
        [(mt.pinned("up", "triton_interpreter").label(), True), (small.label(), False)])


@pytest.mark.parametrize("stage", ["up", "down", "dgrad", "dx", "fp8_up", "fp8_down", "fp8_dgrad", "fp8_dx"])
def test_grouped_stages_sweep_their_sm90_pick_in_the_grouped_tile_order(stage):
    pick = mt.pinned(stage, "cuda_sm90")
    assert pick.group_m == 1  # the table's order until a GPU sweep pins another
    got = [c for c in mt.candidates(stage) if replace(c, group_m=1) == pick and c.group_m != 1]
    assert sorted(c.group_m for c in got) == [4, 8, 16]


def test_weight_gradients_sweep_no_grouped_order_candidates():
    for stage in ("wgrad_w1", "fp8_wgrad_w1", "fp8_colq_x"):
        assert all(c.group_m == 1 for c in mt.candidates(stage)), stage


def test_group_m_sweeps_the_pinned_tile_in_each_order_and_logs_each_stage(tmp_path):
    # --group-m: the pinned tile of each stage with each GROUP_M (the same bits on every backend), rows appended to
    # the log as each stage finishes.
    log = tmp_path / "rows.jsonl"
    rows = mt.sweep(["tiny"], ["down", "wgrad_w2"], torch.device("cpu"), rounds=1, group_ms=[1, 2, 3], log=log)
    for stage in ("down", "wgrad_w2"):
        pick = mt.pinned(stage, "triton_interpreter")
        want = [replace(pick, group_m=g).label() for g in (1, 2, 3)]
        assert [r["config"] for r in rows if r["stage"] == stage] == want, stage
    assert all(r["bits_equal_pinned"] and r["median_us"] > 0 for r in rows)
    assert [json.loads(line) for line in log.read_text().splitlines()] == rows


def test_group_m_must_be_positive(tmp_path):
    with pytest.raises(SystemExit):
        mt.main(["--device", "cpu", "--preset", "tiny", "--stages", "down", "--group-m", "0", "--out", str(tmp_path)])
