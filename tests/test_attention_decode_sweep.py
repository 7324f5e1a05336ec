"""tools/attention_decode_sweep.py on the CPU (Triton interpreter, tiny shapes; its timings are plumbing, not hardware
results): the sweep's output structure, its bits column (equal for the interpreter's candidates, and able to say
"differ"), an error cell for a candidate that fails, the summary and the pick, the candidate grid and the warm-up's
paths. The GPU run is tools/gpu/attention_decode_sweep.sh."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import replace

import pytest
import torch

import tools.attention_decode_sweep as ds


@pytest.fixture
def cpu_only(device):
    if device.type != "cpu":
        pytest.skip("the CPU plumbing; the GPU run is tools/gpu/attention_decode_sweep.sh")


def test_tiny_sweep_writes_every_candidates_cases_bits_and_report(cpu_only, tmp_path, monkeypatch):
    real_call = ds.detkit_call

    def failing_paged(case, inp, configs=None):  # one candidate fails at one case: an error cell, not a crash
        if case.mode == "paged_decode" and configs.split_tiers == ((None, 16),):
            raise RuntimeError("injected launch failure")
        return real_call(case, inp, configs)

    monkeypatch.setattr(ds, "detkit_call", failing_paged)
    code = ds.main(["sweep", "--device", "cpu", "--tiny", "--out", str(tmp_path), "--limit", "2", "--rounds", "1",
                    "--replays", "1", "--finalists", "1"])
    assert code == 0
    doc = json.loads((tmp_path / "decode_sweep.json").read_text())
    assert doc["meta"]["backend"] == "triton_interpreter" and "NOT a hardware result" in doc["meta"]["label"]
    assert doc["meta"]["candidates"] == doc["meta"]["candidates_timed"] == 2 and doc["meta"]["stopped"] is None
    pinned, other = doc["candidates"]
    assert pinned["pinned"] and pinned["candidate"] == ("BM16_BN16_w4_s1 split32:16/64:32/64 heads<0 grid<8 "
                                                        "programs~2 paged s1te")
    assert other["candidate"] == "BM16_BN16_w4_s1 split16 heads<0 grid<8 programs~2 paged s1te" and not other["pinned"]
    labels = [c.label for c in ds.cases(ds.TINY_SHAPES, 64)]
    assert labels == ["decode B1 K24", "decode B2 K40", "prefill B1 S24", "paged B2 K40"]
    info = doc["meta"]["cases"]["64"]
    assert list(info) == [*labels, "fwd_bwd B1 S16"] and info["paged B2 K40"]["page_size"] == 16
    assert all(i["graph_sets"] == 1 and i["sdpa_gqa"] in ("native", "expanded") for i in info.values())
    for row in (pinned, other):
        # The interpreter's candidates keep the invariance: every decode step, the paged step and the chunked
        # prefill have their prefill's bits; the steps ran both grids (1 and 2+ splits).
        assert row["bits_ok"] and row["bit_mismatches"] == 0 and row["bit_elements"] > 0, row
        assert row["decode_grids"] == ["one_pass", "split"] and row["head_dim"] == 64
    # One key tile a split for every row folds differently from the tiers: pinning it would bump the table version.
    assert pinned["same_bits_as_pinned"] is True and other["same_bits_as_pinned"] is False
    for label in labels:
        cell = pinned["cases"][label]
        assert 0 < cell["p20_us"] <= cell["us"] <= cell["p80_us"] and cell["sdpa_us"] > 0
        assert cell["ratio"] == pytest.approx(cell["us"] / cell["sdpa_us"], rel=1e-3, abs=5e-5)  # rounded to 4 places
    assert other["cases"]["paged B2 K40"] == {"error": "RuntimeError: injected launch failure"}
    assert all("ratio" in other["cases"][lbl] for lbl in labels[:3])
    assert pinned["complete"] and not other["complete"] and not other["eligible"]
    decode = [pinned["cases"][lbl]["ratio"] for lbl in labels[:2]]
    assert pinned["worst_decode_ratio"] == max(decode)
    assert pinned["geomean_ratio"] == pytest.approx(
        math.exp(sum(math.log(pinned["cases"][lbl]["ratio"]) for lbl in labels) / 4))
    # The one finalist (the complete candidate with equal bits) was timed at fwd+bwd; the other was not.
    assert pinned["worst_fwd_bwd_ratio"] == pinned["cases"]["fwd_bwd B1 S16"]["ratio"] > 0
    assert other["worst_fwd_bwd_ratio"] is None and "fwd_bwd B1 S16" not in other["cases"]
    eligible = [r for r in doc["candidates"] if r["eligible"]]
    assert doc["best"]["64"] == (min(eligible, key=lambda r: r["worst_decode_ratio"])["candidate"] if eligible else None)
    text = (tmp_path / "decode_sweep.md").read_text()
    assert "NOT a hardware result" in text and "## head_dim 64" in text and "### Finalists at fwd+bwd" in text
    table = [line for line in text.split("### All candidates")[1].splitlines() if line.startswith("| BM16")]
    assert len(table) == 2 and "(pinned)" in table[0] + table[1]
    split16 = next(line for line in table if "split16" in line).split("|")
    assert [c.strip() for c in split16[2:5]] == ["ok", "no", "no: untimed case"]
    assert "err" in [c.strip() for c in split16]
    assert "injected launch failure" in text


def test_bits_check_reports_a_decode_that_differs_from_its_prefill(cpu_only, monkeypatch):
    import detkit.kernels.attention as attn

    real = attn.attention

    def decode_on_other_splits(q, k, v, **kw):  # decode steps fold 16-key splits, the prefill the tiers' ones
        if q.shape[2] == 1:
            kw["configs"] = replace(kw["configs"], split_tiers=((None, 16),))
        return real(q, k, v, **kw)

    monkeypatch.setattr(attn, "attention", decode_on_other_splits)
    from detkit.kernels.attention.configs import select_configs

    shapes = ds.TINY_SHAPES
    pinned = select_configs("triton_interpreter", 64)
    grid = ds.tiny_grid(pinned)
    inputs = ds.bits_inputs(shapes, 64, ds.bits_keys(shapes, grid), torch.device("cpu"))
    row, _ = ds.bits_check(ds.Candidate(64, pinned, pinned=True), inputs, None, shapes)
    assert not row["bits_ok"] and row["bit_mismatches"] > 0, row
    assert row["first_mismatch"].startswith("decode at ")


def _row(label: str, ratios: dict, bits_ok: bool = True) -> dict:
    return {"head_dim": 128, "candidate": label, "pinned": False, "bits_ok": bits_ok,
            "cases": {k: {"ratio": v} for k, v in ratios.items()}}


def test_summary_and_best_pick_the_lowest_worst_decode_with_prefill_and_bits():
    case_list = ds.cases(ds.GPU_SHAPES, 128) + ds.cases(ds.GPU_SHAPES, 128, ("fwd_bwd",))
    kinds = {c.label: c.kind for c in case_list}
    assert sum(k == "decode" for k in kinds.values()) == 9 and sum(k == "paged" for k in kinds.values()) == 5
    assert [lbl for lbl, k in kinds.items() if k == "prefill"] == ["prefill B1 S4096", "prefill B8 S1024"]

    def ratios(decode: float, prefill: float, paged: float = 1.0) -> dict:
        out = {lbl: {"decode": decode, "prefill": prefill, "paged": paged}[k] for lbl, k in kinds.items()
               if k != "fwd_bwd"}
        out["decode B1 K32768"] = decode + 0.3  # the worst decode case
        return out

    rows = [_row("A", ratios(1.0, 1.0)), _row("B", ratios(0.8, 1.11)),  # B: faster decode, prefill over 1.10
            _row("C", ratios(0.9, 1.05)), _row("D", ratios(0.5, 0.5), bits_ok=False),
            _row("E", {k: v for k, v in ratios(0.5, 0.5, 0.5).items() if k != "paged B8 K32768"}),  # one not timed
            _row("F", ratios(0.9, 1.0, paged=0.5))]
    for r in rows:
        r.update(ds.summarize(r, case_list))
    by = {r["candidate"]: r for r in rows}
    assert by["C"]["worst_decode_ratio"] == pytest.approx(1.2) and by["C"]["worst_prefill_ratio"] == 1.05
    assert by["A"]["geomean_ratio"] == pytest.approx(1.3 ** (1 / 16))
    assert [r["candidate"] for r in rows if r["eligible"]] == ["A", "C", "F"]
    assert not by["E"]["complete"] and by["E"]["worst_paged_ratio"] == 0.5
    # C and F tie on the worst decode ratio; F's paged cases give it the lower geometric mean.
    assert ds.best(rows)["candidate"] == "F"
    assert ds._why_not(by["B"]) == "no: prefill > 1.1" and ds._why_not(by["D"]) == "no: bits"
    assert ds._why_not(by["E"]) == "no: untimed case"
    assert ds.best([by["B"], by["D"]]) is None


def test_gpu_grid_candidates_and_warm_paths():
    from detkit.kernels.attention.configs import select_configs

    pinned = select_configs("cuda_sm90", 128)
    grid = ds.gpu_grid(128, 132, pinned)
    assert grid.split_heads_below == (0, 264) and grid.split_grid_below == (pinned.split_grid_below, 528)
    cands = ds.candidates(128, "cuda_sm90", grid, spread=True)
    assert cands != ds.candidates(128, "cuda_sm90", grid) and cands == ds.candidates(128, "cuda_sm90", grid, True)
    # 3 split tables x 2 BLOCK_M x 2 BLOCK_N x 2 warp counts x 3 stage counts x 2 x 2 thresholds; the pinned entry is
    # one; then the pinned entry with one split a program, second.
    assert len(cands) == 289 and len({c.label for c in cands}) == 289
    assert cands[0].pinned and cands[0].configs == pinned and not any(c.pinned for c in cands[1:])
    assert cands[1].configs == dataclasses.replace(pinned, split_grid_programs=0)
    assert all(c.configs.dkdv == pinned.dkdv and c.configs.dq == pinned.dq for c in cands)
    tables = (pinned.split_tiers, ((2048, 256), (8192, 512), (None, 1024)), ((4096, 256), (16384, 512), (None, 2048)))
    assert {(c.configs.fwd.block_m, c.configs.split_tiers) for c in cands} == {(m, s) for m in (64, 128)
                                                                                for s in tables}
    assert len(ds.candidates(256, "cuda_sm90", ds.gpu_grid(256, 132, select_configs("cuda_sm90", 256)))) == 145
    jobs = ds.warm_jobs([128], sms=132)
    tiles = {(cands[i].configs.fwd, cands[i].configs.split_tiers) for _, i, _ in jobs if i >= 0}
    assert len(tiles) == 72 and len(jobs) == 72 * len(ds.WARM_PATHS) + 1 and jobs[-1] == (128, -1, "fwd_bwd")


@pytest.mark.parametrize("path", ["one_pass_h4", "split_h1", "paged_split_h4"])
def test_warm_runs_the_path_it_names(cpu_only, monkeypatch, path):
    from detkit.kernels.attention import launch
    from detkit.kernels.attention.configs import fwd_heads

    seen = []
    real = launch.attention_fwd_launch

    def spy(q, k, v, seqs, scale, configs=None, logits=None):
        o, lse, ran = real(q, k, v, seqs, scale, configs, logits or launch.Logits())
        seen.append((ran.split_grid, seqs.paged, fwd_heads(configs, 4, 1, seqs.batch, seqs.seq_q)))
        return o, lse, ran

    monkeypatch.setattr(launch, "attention_fwd_launch", spy)
    ds.warm_one((64, 0, path), torch.device("cpu"), tiny=True)
    assert seen == [("split" in path, path.startswith("paged"), 1 if path.endswith("h1") else 4)]


def test_cli_refuses_what_it_does_not_run(tmp_path, capsys):
    for argv in (["sweep", "--device", "cpu", "--out", str(tmp_path)],  # the interpreter only at tiny shapes
                 ["sweep", "--device", "cpu", "--tiny", "--out", str(tmp_path), "--rounds", "0"]):
        with pytest.raises(SystemExit) as exc:
            ds.main(argv)
        assert exc.value.code == 2
    assert "--rounds and --replays must be >= 1" in capsys.readouterr().err


def test_grid_override_replaces_the_named_fields_and_refuses_others(monkeypatch):
    import argparse

    from detkit.kernels.attention.configs import select_configs
    from tools import attention_decode_sweep as sweep

    pinned = select_configs("cuda_sm90", 128)
    tables = (((None, 256),), ((2048, 256), (16384, 512), (None, 1024)))
    text = "split_tiers=256,2048:256/16384:512/1024"
    assert sweep.parse_grid_override(text) == ("split_tiers", tables)
    assert sweep.grid_override_text("split_tiers", tables) == text  # as handed to the warm workers
    assert sweep.grid_override_text("num_warps", (4, 8)) == "num_warps=4,8"
    monkeypatch.setattr(sweep, "GRID_OVERRIDES", {"split_tiers": tables, "num_warps": (4,)})
    grid = sweep.gpu_grid(128, 132, pinned)
    assert grid.split_tiers == tables and grid.num_warps == (4,)
    assert grid.block_n == sweep._gpu_grid(128, 132, pinned).block_n  # the other fields as the grid has them
    assert sweep.bits_keys(sweep.GPU_SHAPES, grid) == 16384 + 1024 + 300  # past the largest bound by a split
    # The paged forward's speed fields: the pinned values unless overridden; each override value one candidate.
    assert grid.paged_num_stages == (pinned.paged_num_stages,) and grid.paged_grouped == (0,)
    assert grid.paged_tile_page == (int(pinned.paged_tile_page),)
    one = {f: (getattr(pinned.fwd, f),) for f in ("block_m", "block_n", "num_warps", "num_stages")}
    monkeypatch.setattr(sweep, "GRID_OVERRIDES", {
        "split_tiers": (pinned.split_tiers,), **one, "split_heads_below": (0,),
        "split_grid_below": (pinned.split_grid_below,), "paged_num_stages": (3, 5), "paged_grouped": (0, 1)})
    cands = sweep.candidates(128, "cuda_sm90", sweep.gpu_grid(128, 132, pinned))
    assert [(c.configs.paged_num_stages, c.configs.paged_grouped) for c in cands] == [
        (0, False), (0, False), (3, False), (3, True), (5, False), (5, True)]  # pinned, pinned ungrouped, the grid
    assert cands[0].label.endswith(" paged s3te") and cands[3].label.endswith(" paged s3gte")
    monkeypatch.setattr(sweep, "GRID_OVERRIDES", {
        "split_tiers": (pinned.split_tiers,), **one, "split_heads_below": (0,),
        "split_grid_below": (pinned.split_grid_below,), "paged_tile_page": (0, 1)})
    cands = sweep.candidates(128, "cuda_sm90", sweep.gpu_grid(128, 132, pinned))
    assert [c.configs.paged_tile_page for c in cands] == [True, True, False]  # the table reads one entry a page
    assert cands[2].label.endswith(" paged s3e") and cands[2].as_row()["paged_tile_page"] is False
    monkeypatch.setattr(sweep, "GRID_OVERRIDES", {
        "split_tiers": (pinned.split_tiers,), **one, "split_heads_below": (0,),
        "split_grid_below": (pinned.split_grid_below,), "paged_prefetch_pages": (0, 1)})
    cands = sweep.candidates(128, "cuda_sm90", sweep.gpu_grid(128, 132, pinned))
    assert [c.configs.paged_prefetch_pages for c in cands] == [False, False, True]  # off in the table
    assert cands[2].label.endswith(" paged s3tep") and cands[2].as_row()["paged_prefetch_pages"] is True
    assert sweep.bits_keys(sweep.TINY_SHAPES, sweep.tiny_grid(select_configs("triton_interpreter", 64))) == 69
    positions = sweep.bits_positions(pinned, 17708)
    assert {2047, 2048, 16383, 16384, 255, 256, 1023, 1024, 17707} <= set(positions)  # each tier's edges and bound
    for bad in ("split=256", "split_tiers=", "split_tiers=a,b", "split_tiers=2048:256", "split_n=256",
                "num_warps=2048:256/512", "ungrouped=1"):
        with pytest.raises(argparse.ArgumentTypeError, match="--grid"):
            sweep.parse_grid_override(bad)
