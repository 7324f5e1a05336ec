"""Config sweep for the MoE grouped GEMMs (kernels/moe/layer.py MOE_CONFIGS): time candidate tile configs per
stage at the preset shapes and say which config each stage's time is best with. Not autotuning: a
human reads the output, pins entries in MOE_CONFIGS (bumping MOE_CONFIG_TABLE_VERSION), and the MoE
audit then re-checks the pinned table (its bits are the table's, so a new pin is a new bits version).

    python -m tools.moe_tune --device cuda --preset reference qwen3-30b-a3b --out results/moe-tune   # checkout root

Each stage is timed alone on the same inputs the layer would give it (routing, saved gu/h, dgu from
the pinned path), every candidate interleaved with the pinned one in ``rounds`` rounds
(toolkit.timing.time_interleaved: L2-flushed do_bench samples). A candidate that fails to compile or
is refused (shared memory, a TMA box) is an error row, never fatal. Each row also says whether the
candidate's output has the pinned config's bits (on tensor cores a different BLOCK_K or warp layout
may change the FP32 summation inside an MMA, which is why the table is versioned).
The fp8_ stages sweep kernels/moe/fp8/layer.py's grouped GEMMs (MOE_FP8_CONFIGS) on operands quantized once.
Formulas: TFLOP/s = stage FLOPs / median time; stage FLOPs per T*K*H*I: up 4, down 2, dgrad 2, dx 4,
wgrad_w1 4, wgrad_w2 2 (the same split as ``detkit bench moe``'s stage rows; the same for the fp8_ stages).
Candidates are passed to the stages' launchers as ``config=`` arguments; no table is changed. ``--group-m 4 8 16``
times each stage's pinned tile in the grouped tile order (kernels/moe/tile_order.py) instead of the candidate list:
the same bits, another L2 reuse. Each stage's rows are appended to OUT/rows.jsonl as soon as they are timed (what a
run stopped at a time limit keeps); OUT/rows.json and OUT/report.md are written at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from detkit.bench.moe_common import make_inputs
from detkit.toolkit.presets import MOE_PRESETS as PRESETS
from detkit.toolkit.reports import markdown_table
from detkit.kernels.backend import CUDA_SM90
from detkit.kernels.det_gemm.launch import GemmConfig

# Grouped stages: BLOCK_M must divide the 128-row segment; dgrad's BLOCK_N counts dh columns (its
# epilogue tile is 2*BLOCK_N wide), up's counts interleaved gate/up columns (h gets BLOCK_N/2).
GROUPED = [GemmConfig(*c) for c in [
    (128, 128, 64, 1, 8, 3), (128, 128, 64, 1, 8, 4), (128, 128, 64, 1, 4, 4), (128, 256, 64, 1, 8, 3),
    (128, 64, 64, 1, 4, 4), (64, 128, 64, 1, 4, 4), (64, 256, 64, 1, 8, 3), (128, 128, 128, 1, 8, 2),
]] + [GemmConfig(*c, variant="tma") for c in [
    (128, 128, 64, 1, 8, 3), (128, 128, 64, 1, 8, 4), (128, 256, 64, 1, 8, 3), (128, 64, 64, 1, 4, 4),
    (128, 128, 64, 1, 4, 3), (128, 128, 64, 1, 8, 2), (128, 256, 64, 1, 8, 2), (64, 128, 64, 1, 4, 3),
]]
# Every grouped stage also on the warp-specialized Gluon kernels (kernels/moe/ws.py): persistent, a TMA producer warp
# (up, dgrad: a 4-warp cp.async producer of the gathered rows), one or two 64-row consumer warpgroups, the tile out
# by TMA store from a 32-64 KiB buffer (so 5 stages at most for 128x128x64; dgrad's dscore sums need 16 KiB more).
# 128x256 (the tile det_gemm and the weight gradients run with TMA-store epilogues): up on 2 stages beside its
# 96 KiB of gu and h buffers; down and dX (BF16 y / dx_route: a 64 KiB buffer) on 3 stages of BLOCK_K 64 or 6 of 32
# (208 KiB), or 2 / 4 (160 KiB) (offline sm_90 compile, no spills); dgrad's does not fit, nor up's 3-stage one (the
# launcher refuses them by name).
GROUPED_WS = [GemmConfig(*c, variant="ws") for c in [
    (128, 128, 64, 1, 8, 4), (128, 128, 64, 1, 8, 5), (64, 128, 64, 1, 4, 6), (128, 64, 64, 1, 8, 6),
    (128, 256, 64, 1, 8, 2), (128, 256, 32, 1, 8, 4), (128, 256, 64, 1, 8, 3), (128, 256, 32, 1, 8, 6),
]]
# Weight gradients: BLOCK_M x BLOCK_N tile of dW[e], BLOCK_K routed rows per reduction step.
WGRAD = [GemmConfig(*c) for c in [
    (128, 128, 64, 1, 8, 3), (128, 128, 64, 1, 8, 4), (128, 256, 64, 1, 8, 3), (256, 128, 64, 1, 8, 3),
    (128, 128, 32, 1, 4, 4), (128, 128, 128, 1, 8, 3), (64, 256, 64, 1, 8, 3), (128, 128, 64, 1, 4, 3),
    (128, 128, 64, 1, 4, 2), (128, 128, 32, 1, 4, 3), (128, 64, 64, 1, 4, 3), (64, 128, 64, 1, 4, 3),
]]
# The Gluon weight gradient (kernels/moe/ws.py moe_ws_wgrad_kernel): persistent, TMA producer warp (dW1: a 4-warp
# cp.async producer of the gathered x rows), one or two consumer warpgroups of 64 dW rows, the BF16 tile out by TMA
# store from a 32-64 KiB buffer.
WGRAD += [GemmConfig(*c, variant="ws") for c in [
    (128, 128, 64, 1, 8, 4), (128, 128, 64, 1, 8, 5), (128, 128, 64, 1, 8, 6), (64, 128, 64, 1, 4, 6),
    (128, 256, 64, 1, 8, 3), (64, 256, 64, 1, 4, 4),
]]
# FP8 grouped stages (kernels/moe/fp8/layer.py MOE_FP8_CONFIGS): BLOCK_K divides the 128-K scale block; up's
# BLOCK_N is 256 and dgrad's 64 or 128 (the fused 1x128 quantization); up to 96 KiB of operands per stage
# count leaves room for two programs per SM, which overlap one's promotion FMAs with the other's MMAs.
# "tma": the same tile with the weight loaded by TMA (won down, dgrad and dX on the H200 with 4 warps).
FP8_GROUPED = [GemmConfig(*c) for c in [
    (128, 128, 128, 1, 8, 4), (128, 128, 128, 1, 8, 3), (128, 128, 128, 1, 4, 3), (128, 128, 128, 1, 8, 2),
    (64, 128, 128, 1, 4, 4), (128, 256, 128, 1, 8, 2), (128, 128, 64, 1, 8, 4),
]] + [GemmConfig(*c, variant="tma") for c in [
    (128, 128, 128, 1, 8, 4), (128, 128, 128, 1, 8, 3), (128, 128, 128, 1, 4, 3), (64, 128, 128, 1, 4, 4),
    (64, 128, 128, 1, 4, 3), (64, 128, 128, 1, 4, 2),
]]
# "ws": the warp-specialized Gluon kernel of down and dX (kernels/moe/fp8/ws.py): persistent, TMA producer warp,
# one or two 64-row consumer warpgroups promoting block kb while block kb+1's MMAs run, the BF16 tile
# stored by TMA from a 16-32 KiB buffer (6 stages fit for 128x128). BLOCK_K is the 128-K block.
FP8_GROUPED += [GemmConfig(*c, variant="ws") for c in [
    (128, 128, 128, 1, 8, 4), (128, 128, 128, 1, 8, 5), (128, 128, 128, 1, 8, 6), (64, 128, 128, 1, 4, 6),
    (128, 64, 128, 1, 8, 6), (128, 64, 128, 1, 8, 8),
]]
# up: BLOCK_N 256 quantizes h in the epilogue (one 1x128 block per row); 128 leaves it to the row-wise pass over
# the stored h (same values), which frees the tile: the 4-warp 64x128 TMA tile won down and dX.
FP8_UP = [GemmConfig(*c) for c in [
    (64, 256, 128, 1, 8, 3), (64, 256, 128, 1, 8, 2), (64, 256, 128, 1, 4, 2), (128, 256, 128, 1, 8, 2),
    (128, 256, 64, 1, 8, 3), (64, 256, 64, 1, 4, 4), (64, 128, 128, 1, 4, 4),
]] + [GemmConfig(*c, variant="tma") for c in [
    (64, 256, 128, 1, 8, 3), (64, 256, 128, 1, 8, 2), (128, 256, 128, 1, 8, 2),
    (64, 128, 128, 1, 4, 4), (64, 128, 128, 1, 4, 3), (128, 128, 128, 1, 8, 4), (128, 128, 128, 1, 8, 3),
    (128, 128, 128, 1, 4, 3),
]]
# The Gluon kernel (kernels/moe/fp8/ws.py) with the gathered rows by cp.async from a 4-warp producer.
FP8_UP += [GemmConfig(*c, variant="ws") for c in [(128, 128, 128, 1, 8, 4), (128, 128, 128, 1, 8, 5),
                                                  (64, 128, 128, 1, 4, 6)]]
# dgrad: BLOCK_N 64 (one 1x128 dgu block per row) or 128 (two; 64 rows: 128x128 with 8 warps spills on sm_90).
FP8_DGRAD = [GemmConfig(*c) for c in [
    (128, 64, 128, 1, 8, 4), (128, 64, 128, 1, 8, 3), (128, 64, 128, 1, 4, 4), (64, 64, 128, 1, 4, 4),
    (128, 64, 64, 1, 8, 6), (64, 128, 128, 1, 8, 3), (64, 128, 128, 1, 8, 4),
]] + [GemmConfig(*c, variant="tma") for c in [
    (128, 64, 128, 1, 8, 4), (128, 64, 128, 1, 4, 4), (64, 64, 128, 1, 4, 4), (64, 128, 128, 1, 8, 4),
    (128, 64, 128, 1, 4, 3), (128, 64, 128, 1, 4, 2), (64, 64, 128, 1, 4, 3), (64, 128, 128, 1, 4, 3),
]]
# The Gluon kernel (kernels/moe/fp8/ws.py): gathered rows by cp.async, the dSwiGLU + 1x128 quantization epilogue
# (dgu and dgu_q out by TMA stores); 128x128 (two consumer warpgroups of 64 rows, two dgu scale blocks per row)
# fits without spills there, and with its 96 KB of store buffers in shared memory at most 4 stages.
FP8_DGRAD += [GemmConfig(*c, variant="ws") for c in [(128, 64, 128, 1, 8, 6), (128, 64, 128, 1, 8, 7),
                                                     (64, 64, 128, 1, 4, 8), (128, 128, 128, 1, 8, 4),
                                                     (128, 128, 128, 1, 8, 3)]]
# The FP8 weight gradients (wgrad="fp8", kernels/moe/fp8/layer.py FP8_WGRAD_CONFIGS: the pinned tile, always timed) on the
# column-wise operands: Triton TMA tiles, whose kernel also requests each 128-row block's scales one block ahead.
# 64x128 with 4 warps ran 3x faster than the 128x128 8-warp tiles on the H200; these are its neighbours.
FP8_WGRAD = [GemmConfig(*c, variant="tma") for c in [
    (128, 128, 128, 1, 8, 4), (64, 128, 128, 1, 4, 4), (64, 128, 128, 1, 4, 2), (128, 64, 128, 1, 4, 3),
    (64, 64, 128, 1, 4, 3), (64, 64, 128, 1, 4, 4), (64, 256, 128, 1, 8, 3), (64, 256, 128, 1, 4, 3),
    (128, 128, 128, 1, 4, 3), (64, 128, 64, 1, 4, 4), (64, 128, 128, 1, 4, 3),
]]
# The Gluon kernel (kernels/moe/fp8/ws.py): persistent, TMA producer warp, promotion of block kb while kb+1's MMAs
# run, each block's scale rows staged in shared memory beside its operand tiles (so 128x128 compiles without spills).
FP8_WGRAD += [GemmConfig(*c, variant="ws") for c in [
    (128, 64, 128, 1, 8, 6), (128, 128, 128, 1, 8, 4), (128, 128, 128, 1, 8, 5), (64, 128, 128, 1, 4, 8),
]]
# The column-wise quantizer of wgrad="fp8" (kernels/moe/fp8/layer.py QUANT_COLWISE_CONFIGS): 128 rows x block_n columns
# per program (block_k, group_m, stages unused). Timed on a gathered operand (x) and a plain one (dgu).
FP8_COLQ = [GemmConfig(128, n, 16, 1, w, 1) for n, w in [(64, 4), (64, 2), (128, 4), (128, 8), (256, 4), (256, 8),
                                                         (32, 4)]]
# The grouped tile order (kernels/moe/tile_order.py): each grouped stage's sm_90 table tile in bands of GROUP_M row
# tiles, so the tiles in flight share each weight tile in L2 (up at Mixtral-8x7B: 224 column tiles, so row-major
# tiles in flight cover one or two row tiles and re-read W1 from HBM for each). It decides which program runs a tile,
# never a tile's bits.
RASTER_GROUP_MS = (4, 8, 16)
STAGE_KEY = {"up": "up", "down": "down", "dgrad": "dgrad", "dx": "dx", "wgrad_w1": "wgrad", "wgrad_w2": "wgrad",
             "fp8_up": "up", "fp8_down": "down", "fp8_dgrad": "dgrad", "fp8_dx": "dx",
             "fp8_wgrad_w1": "wgrad", "fp8_wgrad_w2": "wgrad", "fp8_colq_x": "colq", "fp8_colq_dgu": "colq"}
STAGE_FLOPS = {"up": 4.0, "down": 2.0, "dgrad": 2.0, "dx": 4.0, "wgrad_w1": 4.0, "wgrad_w2": 2.0,
               "fp8_up": 4.0, "fp8_down": 2.0, "fp8_dgrad": 2.0, "fp8_dx": 4.0, "fp8_wgrad_w1": 4.0, "fp8_wgrad_w2": 2.0,
               "fp8_colq_x": 0.0, "fp8_colq_dgu": 0.0}  # the quantizer: no FLOPs, times only
BF16_STAGES = ("up", "down", "dgrad", "dx", "wgrad_w1", "wgrad_w2")


def candidates(stage: str) -> list[GemmConfig]:
    if stage not in STAGE_KEY:
        raise ValueError(f"stage {stage!r} not known; known: {tuple(STAGE_KEY)}")
    key = STAGE_KEY[stage]
    if stage.startswith("fp8_"):
        if key in ("wgrad", "colq"):
            return {"wgrad": FP8_WGRAD, "colq": FP8_COLQ}[key]
        return {"up": FP8_UP, "dgrad": FP8_DGRAD}.get(key, FP8_GROUPED) + raster_candidates(stage, RASTER_GROUP_MS)
    if key == "wgrad":
        return WGRAD
    return GROUPED + GROUPED_WS + raster_candidates(stage, RASTER_GROUP_MS)


def raster_candidates(stage: str, group_ms, backend: str = CUDA_SM90) -> list[GemmConfig]:
    """The table's tile of ``stage`` (``backend``'s) in the grouped tile order, one config per GROUP_M of
    ``group_ms`` (the pinned GROUP_M left out: the pinned config is always timed)."""
    pick = pinned(stage, backend)
    return [replace(pick, group_m=g) for g in group_ms if g != pick.group_m]


def pinned(stage: str, backend: str) -> GemmConfig:
    """The table's config for ``stage`` (MOE_FP8_CONFIGS / FP8_WGRAD_CONFIGS for the fp8_ stages, else
    MOE_CONFIGS)."""
    from detkit.kernels.moe.layer import select_moe_config
    from detkit.kernels.moe.fp8.layer import FP8_WGRAD_CONFIGS, QUANT_COLWISE_CONFIGS, select_moe_fp8_config

    if stage.startswith("fp8_wgrad"):
        return FP8_WGRAD_CONFIGS[backend]
    if stage.startswith("fp8_colq"):
        return QUANT_COLWISE_CONFIGS[backend]
    select = select_moe_fp8_config if stage.startswith("fp8_") else select_moe_config
    return select(STAGE_KEY[stage], backend)


def stage_fns(preset: str, device: torch.device, stages, seed: int = 0) -> tuple[dict[str, Callable], str]:
    """stage -> fn(config) -> output tensor, on the preset's inputs (the pinned path's intermediates)."""
    from detkit.kernels.moe.fp8.quant import quantize_rowwise, quantize_weight
    from detkit.kernels.moe.layer import (
        moe_dgrad_dswiglu, moe_dgrad_dswiglu_dscore, moe_down, moe_dx_route, moe_mlp_fwd, moe_up_swiglu,
        moe_wgrad_w1, moe_wgrad_w2,
    )
    from detkit.kernels.moe.fp8.layer import (
        moe_fp8_dgrad_dswiglu, moe_fp8_down, moe_fp8_dx_route, moe_fp8_quant_colwise, moe_fp8_up_swiglu, moe_fp8_wgrad,
    )
    from detkit.kernels.moe.routing import build_routing

    p = PRESETS[preset]
    inp = make_inputs(p, device, seed)
    x, w1, w2, ids, scores, dout = (inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout"))
    routing = build_routing(ids, scores, p.e)
    _, saved = moe_mlp_fwd(x, w1, w2, ids, scores)
    b = saved.backend
    dgu = moe_dgrad_dswiglu(dout, w2, saved.gu, routing, b)
    fns = {
        "up": lambda c: moe_up_swiglu(x, w1, routing, b, config=c)[1],
        "down": lambda c: moe_down(saved.h, w2, routing, b, config=c),
        # the layer's dgrad: dSwiGLU and the fused dscore partials (bits compared on dgu)
        "dgrad": lambda c: moe_dgrad_dswiglu_dscore(dout, w2, saved.gu, saved.h, routing, b, config=c)[0],
        "dx": lambda c: moe_dx_route(dgu, w1, routing, b, config=c),
        "wgrad_w1": lambda c: moe_wgrad_w1(x, dgu, routing, b, config=c),
        "wgrad_w2": lambda c: moe_wgrad_w2(saved.h, dout, routing, b, config=c),
    }
    if any(s.startswith("fp8_") for s in stages):  # the FP8 path's operands, quantized once
        (x_q, x_s), (dout_q, dout_s) = quantize_rowwise(x), quantize_rowwise(dout)
        w1f, w2f = quantize_weight(w1), quantize_weight(w2)
        _, h, h_q, h_s = moe_fp8_up_swiglu(x_q, x_s, w1f, routing, b)
        dgu8, dgu_q, dgu_s = moe_fp8_dgrad_dswiglu(dout_q, dout_s, w2f, saved.gu, routing, b)
        fns.update({  # the column-wise quantizer on a gathered operand and a plain one (bits compared on q)
            "fp8_colq_x": lambda c: moe_fp8_quant_colwise(x, routing, b, gather=True, scale=False, config=c)[0],
            "fp8_colq_dgu": lambda c: moe_fp8_quant_colwise(dgu8, routing, b, gather=False, scale=False, config=c)[0],
        })
        if any(s.startswith("fp8_wgrad") for s in stages):  # the column-wise operands of wgrad="fp8"
            col = {name: moe_fp8_quant_colwise(src, routing, b, gather=gather, scale=scale) for name, src, gather, scale
                   in (("x", x, True, False), ("dgu", dgu8, False, False), ("h", h, False, False),
                       ("dy", dout, True, True))}
            fns.update({
                "fp8_wgrad_w1": lambda c: moe_fp8_wgrad(*col["x"], *col["dgu"], routing, b, config=c),
                "fp8_wgrad_w2": lambda c: moe_fp8_wgrad(*col["h"], *col["dy"], routing, b, config=c),
            })
        fns.update({
            "fp8_up": lambda c: moe_fp8_up_swiglu(x_q, x_s, w1f, routing, b, config=c)[2],
            "fp8_down": lambda c: moe_fp8_down(h_q, h_s, w2f, routing, b, config=c),
            "fp8_dgrad": lambda c: moe_fp8_dgrad_dswiglu(dout_q, dout_s, w2f, saved.gu, routing, b, config=c)[1],
            "fp8_dx": lambda c: moe_fp8_dx_route(dgu_q, dgu_s, w1f, routing, b, config=c),
        })
    return fns, b


def parse_config(label: str) -> GemmConfig:
    """A config from its ``GemmConfig.label()`` (``BM128_BN256_BK64_G1_w16_s3_tma``), or a one-line error."""
    m = re.fullmatch(r"BM(\d+)_BN(\d+)_BK(\d+)_G(\d+)_w(\d+)_s(\d+)(?:_(tma|ws))?", label)
    if m is None:
        raise argparse.ArgumentTypeError(f"config {label!r} is not a GemmConfig label; expected e.g. "
                                         "BM128_BN256_BK64_G1_w16_s3_tma (variant ptr, tma or ws)")
    *ints, variant = m.groups()
    return GemmConfig(*map(int, ints), variant=variant or "ptr")


def sweep(presets: list[str], stages: list[str], device: torch.device, rounds: int,
          only: list[GemmConfig] | None = None, group_ms: list[int] | None = None,
          log: Path | None = None) -> list[dict]:
    """Rows per (preset, stage, config): timing and bits vs the pinned config, or the error. ``only``: these
    configs instead of the stage's candidate list (the pinned one is always timed); ``group_ms``: instead (or
    besides ``only``), the pinned tile of each stage with each of these GROUP_M (``raster_candidates``). ``log``: each
    stage's rows appended there as JSON lines once timed, so a run stopped early keeps the stages it finished."""
    from detkit.kernels.moe.layer import MOE_CONFIG_TABLE_VERSION
    from detkit.kernels.moe.fp8.layer import MOE_FP8_CONFIG_TABLE_VERSION
    from detkit.toolkit.contract import compare_bits
    from detkit.toolkit.timing import time_interleaved

    rows = []
    for preset in presets:
        p = PRESETS[preset]
        fns, backend = stage_fns(preset, device, stages)
        for stage in stages:
            fn = fns[stage]
            pick = pinned(stage, backend)
            configs = candidates(stage) if only is None and group_ms is None else (
                list(only or []) + raster_candidates(stage, group_ms or [], backend))
            stage_rows = []
            version = MOE_FP8_CONFIG_TABLE_VERSION if stage.startswith("fp8_") else MOE_CONFIG_TABLE_VERSION
            ids = {"preset": preset, "T": p.t, "H": p.h, "I": p.i, "E": p.e, "K": p.k, "stage": stage,
                   "pinned": pick.label(), "table_version": version}
            ref = fn(pick).clone()
            timed = {pick.label(): pick}
            same = {pick.label(): True}
            for cfg in configs:
                if cfg == pick or cfg.label() in timed:
                    continue
                try:
                    out = fn(cfg)
                except Exception as exc:  # compile failure or refused config: recorded, not fatal
                    stage_rows.append({**ids, "config": cfg.label(), "variant": cfg.variant, "error": repr(exc)[:300]})
                    print(f"{preset} {stage}: {cfg.label()} error {repr(exc)[:120]}", flush=True)
                    continue
                same[cfg.label()] = compare_bits(out, ref).equal
                timed[cfg.label()] = cfg
                del out
            del ref
            timings = time_interleaved({lbl: (lambda c=cfg: fn(c)) for lbl, cfg in timed.items()}, device,
                                       rounds=rounds, rep_ms=20)
            flops = STAGE_FLOPS[stage] * p.t * p.k * p.h * p.i
            case = [{**ids, "config": lbl, "variant": timed[lbl].variant, "is_pinned": lbl == pick.label(),
                     "median_us": t.median_us, "p20_us": t.p20_us, "p80_us": t.p80_us,
                     "tflops": flops / (t.median_us * 1e-6) / 1e12, "bits_equal_pinned": same[lbl]}
                    for lbl, t in timings.items()]
            stage_rows += case
            rows += stage_rows
            if log is not None:
                with log.open("a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in stage_rows)
            for r in case:
                print(f"{preset} {stage}: {r['config']} {r['tflops']:.0f} TFLOP/s, {r['median_us']:.0f} us, bits "
                      f"{'equal' if r['bits_equal_pinned'] else 'DIFFER'}", flush=True)
            best = min(case, key=lambda r: r["median_us"])
            table = next(r for r in case if r["is_pinned"])
            print(f"{preset} {stage}: best {best['config']} {best['tflops']:.0f} TFLOP/s; pinned "
                  f"{table['config']} {table['tflops']:.0f} TFLOP/s", flush=True)
    return rows


def best_per_stage(rows: list[dict]) -> list[dict]:
    """Per stage: the config with the lowest geometric-mean time ratio to the pinned one over the
    presets swept (only configs that ran at every preset), and that ratio."""
    out = []
    timed = [r for r in rows if "median_us" in r]
    for stage in dict.fromkeys(r["stage"] for r in timed):
        sel = [r for r in timed if r["stage"] == stage]
        presets = sorted({r["preset"] for r in sel})
        pinned = {r["preset"]: r["median_us"] for r in sel if r["is_pinned"]}
        ratios: dict[str, list[float]] = {}
        for r in sel:
            ratios.setdefault(r["config"], []).append(r["median_us"] / pinned[r["preset"]])
        full = {c: math.exp(sum(map(math.log, v)) / len(v)) for c, v in ratios.items() if len(v) == len(presets)}
        best = min(full, key=full.get)
        out.append({"stage": stage, "presets": presets, "pinned": sel[0]["pinned"], "best": best,
                    "best_time_vs_pinned": full[best],
                    "best_tflops": {r["preset"]: r["tflops"] for r in sel if r["config"] == best},
                    "pinned_tflops": {r["preset"]: r["tflops"] for r in sel if r["is_pinned"]}})
    return out


def report(rows: list[dict], summary: list[dict], meta: dict) -> str:
    lines = ["# detkit MoE config sweep", ""] + [f"- {k}: {v}" for k, v in meta.items()] + ["", "## Best per stage", ""]
    lines += [markdown_table(summary, ("stage", "pinned", "best", "best_time_vs_pinned", "pinned_tflops",
                                       "best_tflops"))]
    lines += ["", "## All rows", ""]
    lines += [markdown_table(rows, ("preset", "stage", "config", "median_us", "p20_us", "p80_us", "tflops",
                                    "bits_equal_pinned", "error"))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.moe_tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--preset", nargs="+", default=["reference", "qwen3-30b-a3b"], choices=sorted(PRESETS))
    parser.add_argument("--stages", nargs="+", default=list(BF16_STAGES), choices=list(STAGE_KEY),
                        help="BF16 stages by default; fp8_up, fp8_down, fp8_dgrad, fp8_dx, fp8_wgrad_w1, "
                             "fp8_wgrad_w2, fp8_colq_x, fp8_colq_dgu for the FP8 path")
    parser.add_argument("--config", type=parse_config, action="append", default=None,
                        help="time only this config (a GemmConfig label) beside the pinned one; repeatable")
    parser.add_argument("--group-m", type=int, nargs="+", default=None, metavar="G",
                        help="time the pinned tile of each stage with these GROUP_M (the grouped tile order) beside "
                             "it, instead of the candidate list (with --config: besides those)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA GPU; use --device cpu (interpreter, not hardware)")
    if args.group_m is not None and min(args.group_m) < 1:
        parser.error(f"--group-m takes positive ints; got {args.group_m}")
    device = torch.device(args.device)
    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "rows.jsonl"
    log.unlink(missing_ok=True)
    rows = sweep(args.preset, args.stages, device, args.rounds, args.config, args.group_m, log)
    summary = best_per_stage(rows)
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter, "
            "not a hardware result)", "torch": torch.__version__, "triton": __import__("triton").__version__,
            "seconds": round(time.time() - start, 1)}
    (args.out / "rows.json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1) + "\n")
    text = report(rows, summary, meta)
    (args.out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
