"""Tile configs of the BF16 layer's memory-bound passes (moe_scale_rows with the sorted copy, moe_combine,
moe_gather_sum: element-wise in their tiles, so every config gives the same bits) and of dgrad on dout's rows in expert
order (the ws kernel reading A by TMA), each candidate against the pinned config's bits and timed interleaved with it.
Run from the repository root:

    python reports/2026-12-02-h200-s17/scripts/stage_configs.py OUT_DIR
"""
import json
import sys
from pathlib import Path

import torch

from detkit.bench.moe_common import make_inputs
from detkit.kernels.backend import CUDA_SM90
from detkit.kernels.det_gemm import GemmConfig
from detkit.kernels.moe import (
    moe_combine, moe_dgrad_dswiglu_dscore, moe_down, moe_dx_route, moe_gather_sum, moe_mlp_fwd, moe_scale_rows,
)
from detkit.kernels.moe_routing import build_routing
from detkit.toolkit.presets import MOE_PRESETS, MoePreset
from detkit.toolkit.timing import time_interleaved

out_dir = Path(sys.argv[1])
out_dir.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
ELEMENTWISE = [GemmConfig(bm, bn, 16, 1, w, 1) for bm, bn, w in [
    (16, 256, 4), (32, 256, 4), (16, 512, 4), (32, 512, 8), (64, 256, 8), (8, 512, 4), (32, 128, 4), (64, 128, 4),
    (16, 1024, 8)]]  # the first: the pinned "combine" entry
DGRAD = [GemmConfig(128, 128, 64, 1, 8, 4, "ws"), GemmConfig(128, 128, 32, 1, 8, 8, "ws"),
         GemmConfig(128, 64, 64, 1, 8, 6, "ws"), GemmConfig(128, 128, 64, 1, 8, 3, "ws")]  # the first: pinned
rows = []
for p in [MOE_PRESETS["reference"], MoePreset("qwen3-30b-a3b-16k", 16384, 2048, 768, 128, 8)]:
    inp = make_inputs(p, dev)
    routing = build_routing(inp["topk_ids"], inp["scores"], p.e)
    _, saved = moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])
    gu, h = saved.gu[:routing.padded_rows], saved.h[:routing.padded_rows]
    y = moe_down(h, inp["w2"], routing, CUDA_SM90)
    dy, sorted_dout = moe_scale_rows(inp["dout"], routing, CUDA_SM90, sorted_copy=True)
    dgu, _ = moe_dgrad_dswiglu_dscore(inp["dout"], inp["w2"], gu, h, routing, CUDA_SM90, sorted_dout=sorted_dout)
    dxr = moe_dx_route(dgu, inp["w1"], routing, CUDA_SM90)
    stages = {
        "scale_rows_copy": (ELEMENTWISE, lambda c: moe_scale_rows(inp["dout"], routing, CUDA_SM90, c, sorted_copy=True)),
        "combine": (ELEMENTWISE, lambda c: (moe_combine(y, routing, inp["scores"], CUDA_SM90, c),)),
        "gather_sum": (ELEMENTWISE, lambda c: (moe_gather_sum(dxr, routing, CUDA_SM90, c),)),
        "dgrad_sorted": (DGRAD, lambda c: moe_dgrad_dswiglu_dscore(inp["dout"], inp["w2"], gu, h, routing, CUDA_SM90,
                                                                   config=c, sorted_dout=sorted_dout)),
    }
    for stage, (configs, run) in stages.items():
        want = [t.clone() for t in run(configs[0])]
        fns, bits = {}, {}
        for c in configs:
            try:
                got = run(c)
                bits[c.label()] = all(torch.equal(a, b) for a, b in zip(want, got))
                fns[c.label()] = lambda c=c: run(c)
            except Exception as exc:  # noqa: BLE001 - a refused or failing candidate is a row, not the end
                rows.append({"case": p.name, "stage": stage, "config": c.label(), "error": str(exc)[:300]})
        timings = time_interleaved(fns, dev, rounds=3)
        base = timings[configs[0].label()].median_us
        for label, tm in timings.items():
            row = {"case": p.name, "stage": stage, "config": label, "pinned": label == configs[0].label(),
                   "median_us": tm.median_us, "p20_us": tm.p20_us, "p80_us": tm.p80_us, "sm_clock_mhz": tm.sm_clock_mhz,
                   "bits_equal_pinned": bits[label], "speedup_vs_pinned": base / tm.median_us}
            rows.append(row)
            print(json.dumps(row), flush=True)
    del inp, saved, routing, y, dy, sorted_dout, dgu, dxr
    torch.cuda.empty_cache()
(out_dir / "stage_configs.json").write_text(json.dumps(rows, indent=1))
