"""The BF16 dgrad + dSwiGLU (+ dscore partials) Gluon kernel with its epilogue operands loaded three ways
(kernels/moe_ws.py _dgrad_consumer's PREFETCH 0, 1, 2; 128x128x64 tile, 4 or 3 stages): each variant's dgu and
partials against the Triton tile's bits (rows below P), and their times interleaved (toolkit.timing.time_interleaved). Run from the repository root:

    python reports/2026-12-02-h200-s17/scripts/dgrad_prefetch.py OUT_DIR
"""
import json
import sys
from pathlib import Path

import torch

from detkit.bench.moe_common import make_inputs
from detkit.kernels import moe_ws
from detkit.kernels.backend import CUDA_SM90
from detkit.kernels.det_gemm import GemmConfig
from detkit.kernels.moe import moe_dgrad_dswiglu_dscore, moe_mlp_fwd
from detkit.kernels.moe_routing import build_routing
from detkit.toolkit.presets import MOE_PRESETS, MoePreset
from detkit.toolkit.timing import time_interleaved

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
rows = []
TRITON_TILE = GemmConfig(128, 128, 64, 1, 8, 4, "tma")
VARIANTS = {"pf0_s4": (0, 4), "pf1_s4": (1, 4), "pf2_s4": (2, 4), "pf2_s3": (2, 3)}  # (PREFETCH, stages)
cases = [MOE_PRESETS["reference"], MOE_PRESETS["qwen3-30b-a3b"], MoePreset("qwen3-30b-a3b-16k", 16384, 2048, 768, 128, 8)]
for p in cases:
    inp = make_inputs(p, dev)
    routing = build_routing(inp["topk_ids"], inp["scores"], p.e)
    _, saved = moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])
    backend = CUDA_SM90

    def run(v, config=None):
        moe_ws.DGRAD_PREFETCH = v
        return moe_dgrad_dswiglu_dscore(inp["dout"], inp["w2"], saved.gu, saved.h, routing, backend, config=config)

    rows_p = routing.padded_rows  # the saved gu has the routing bound's rows; dgu and ds_part past P are unset

    def cut(outs):
        return [o[:rows_p].contiguous().view(torch.int16 if o.dtype == torch.bfloat16 else torch.int32) for o in outs]

    ref = [t.clone() for t in cut(run(0, TRITON_TILE))]  # the Triton tile: the bits the ws kernel must give
    fns, checks = {}, {}
    for name, (v, stages) in VARIANTS.items():
        cfg = GemmConfig(128, 128, 64, 1, 8, stages, "ws")
        got, again = cut(run(v, cfg)), cut(run(v, cfg))
        checks[name] = {"bits_equal_triton_tile": all(torch.equal(a, b) for a, b in zip(ref, got)),
                        "repeat_bitwise": all(torch.equal(a, b) for a, b in zip(got, again)),
                        "differing_elements": [int((a != b).sum()) for a, b in zip(ref, got)]}
        fns[name] = lambda v=v, cfg=cfg: run(v, cfg)
    timings = time_interleaved(fns, dev, rounds=5)
    flops = 2 * p.t * p.k * p.h * p.i
    base = timings["pf0_s4"].median_us
    for name, (v, stages) in VARIANTS.items():
        tm = timings[name]
        row = {"case": p.name, "T": p.t, "H": p.h, "I": p.i, "E": p.e, "K": p.k, "variant": name, "prefetch": v,
               "stages": stages, "median_us": tm.median_us, "p20_us": tm.p20_us, "p80_us": tm.p80_us,
               "sm_clock_mhz": tm.sm_clock_mhz, "tflops": flops / tm.median_us / 1e6, **checks[name],
               "speedup_vs_pf0_s4": base / tm.median_us}
        rows.append(row)
        print(json.dumps(row), flush=True)
    del inp, saved, routing
    torch.cuda.empty_cache()
moe_ws.DGRAD_PREFETCH = 2
(out / "dgrad_prefetch.json").write_text(json.dumps(rows, indent=1))
