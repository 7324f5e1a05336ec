"""Where the BF16 dgrad + dSwiGLU kernel's time goes at the reference shape (T=8192, H=3072, I=1536, E=8, K=8), against
the dX kernel (the same 128x128x64 ws tile and K=3072, no gathered rows, a plain epilogue). Run from the repository root:

    python reports/2026-12-02-h200-s17/scripts/dgrad_profile.py time OUT_DIR   # dgrad with and without the dscore
                                                                               # partials, dX: interleaved times
    ncu --clock-control none ... python reports/2026-12-02-h200-s17/scripts/dgrad_profile.py once   # one launch each
"""
import json
import sys
from pathlib import Path

import torch

from detkit.bench.moe_common import make_inputs
from detkit.kernels.backend import CUDA_SM90
from detkit.kernels.moe import moe_dgrad_dswiglu, moe_dgrad_dswiglu_dscore, moe_dx_route, moe_mlp_fwd
from detkit.kernels.moe_routing import build_routing
from detkit.toolkit.presets import MOE_PRESETS
from detkit.toolkit.timing import time_interleaved

dev = torch.device("cuda")
p = MOE_PRESETS["reference"]
inp = make_inputs(p, dev)
routing = build_routing(inp["topk_ids"], inp["scores"], p.e)
_, saved = moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])
dgu = moe_dgrad_dswiglu(inp["dout"], inp["w2"], saved.gu, routing, CUDA_SM90)
fns = {
    "dgrad_dscore": lambda: moe_dgrad_dswiglu_dscore(inp["dout"], inp["w2"], saved.gu, saved.h, routing, CUDA_SM90),
    "dgrad_plain": lambda: moe_dgrad_dswiglu(inp["dout"], inp["w2"], saved.gu, routing, CUDA_SM90),
    "dx": lambda: moe_dx_route(dgu, inp["w1"], routing, CUDA_SM90),
}
torch.cuda.synchronize()
if sys.argv[1] == "once":
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
else:
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    timings = time_interleaved(fns, dev, rounds=5)
    flops = 2 * p.t * p.k * p.h * p.i
    rows = [{"stage": n, "median_us": t.median_us, "p20_us": t.p20_us, "p80_us": t.p80_us, "sm_clock_mhz": t.sm_clock_mhz,
             "tflops": flops * (2 if n == "dx" else 1) / t.median_us / 1e6} for n, t in timings.items()]
    for r in rows:
        print(json.dumps(r))
    (out / "dgrad_profile.json").write_text(json.dumps(rows, indent=1))
