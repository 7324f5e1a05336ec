"""s19 call 3: FP8 dX with and without the one-block lookahead (KB_GROUP 1), BF16 dgrad with and without the dscore
partials; times only (the bits are the GPU tests')."""
import json, sys
from pathlib import Path
import torch
from bench.moe_common import make_inputs
from detkit.toolkit.presets import MOE_PRESETS
from detkit.toolkit.timing import time_interleaved
import detkit.kernels.moe_fp8_ws as ws
from detkit.kernels.fp8_quant import quantize_rowwise, quantize_weight
from detkit.kernels.moe import moe_dgrad_dswiglu, moe_dgrad_dswiglu_dscore, moe_mlp_fwd, moe_scale_rows
from detkit.kernels.moe_fp8 import moe_fp8_dgrad_dswiglu, moe_fp8_dx_route
from detkit.kernels.moe_routing import build_routing

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
res = {}
for preset in ("reference", "qwen3-30b-a3b"):
    p = MOE_PRESETS[preset]
    inp = make_inputs(p, dev, 1234)
    x, w1, w2, ids, scores, dout = (inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout"))
    r = build_routing(ids, scores, p.e)
    _, saved = moe_mlp_fwd(x, w1, w2, ids, scores)
    b = saved.backend
    dout_q, dout_s = quantize_rowwise(dout)
    w1f, w2f = quantize_weight(w1), quantize_weight(w2)
    _, dgu_q, dgu_s = moe_fp8_dgrad_dswiglu(dout_q, dout_s, w2f, saved.gu, r, b)
    orig = ws.kb_group
    def dx_group1():
        ws.kb_group = lambda n: 1
        try:
            return moe_fp8_dx_route(dgu_q, dgu_s, w1f, r, b)
        finally:
            ws.kb_group = orig
    a, c = dx_group1(), moe_fp8_dx_route(dgu_q, dgu_s, w1f, r, b)
    same = bool(torch.equal(a.view(torch.int16), c.view(torch.int16)))
    _, sorted_dout = moe_scale_rows(dout, r, b, sorted_copy=True)
    fns = {
        "fp8_dx": lambda: moe_fp8_dx_route(dgu_q, dgu_s, w1f, r, b),
        "fp8_dx_kbgroup1": dx_group1,
        "bf16_dgrad_dscore": lambda: moe_dgrad_dswiglu_dscore(dout, w2, saved.gu, saved.h, r, b, sorted_dout=sorted_dout),
        "bf16_dgrad_no_dscore": lambda: moe_dgrad_dswiglu(dout, w2, saved.gu, r, b, sorted_dout=sorted_dout),
    }
    t = time_interleaved(fns, dev, rounds=3)
    res[preset] = {"fp8_dx_kbgroup1_bits_equal": same,
                   **{k: {"median_us": v.median_us, "p20_us": v.p20_us, "p80_us": v.p80_us, "sm_clock_mhz": v.sm_clock_mhz}
                      for k, v in t.items()}}
    print(preset, json.dumps(res[preset], indent=1), flush=True)
(out / "exp.json").write_text(json.dumps(res, indent=1))
