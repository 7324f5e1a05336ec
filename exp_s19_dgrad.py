"""s19 call 4: the FP8 dgrad (with the dscore partials, as the layer runs it) on the 8-warp 128x128 tile (table
2026-11-30.14) against the 12-warp tiles with an epilogue warpgroup (128x128 4 stages: table 2026-12-02.2; 128x64 6
stages), bits compared with the Triton tile on every output. Usage: python exp_s19_dgrad.py OUT"""
import json, sys
from pathlib import Path
import torch
from bench.moe_common import make_inputs
from detkit.kernels.det_gemm import GemmConfig
from detkit.toolkit.presets import MOE_PRESETS
from detkit.toolkit.timing import time_interleaved
from detkit.kernels.fp8_quant import quantize_rowwise, quantize_weight
from detkit.kernels.moe import moe_mlp_fwd
from detkit.kernels.moe_fp8 import moe_fp8_dgrad, moe_fp8_up_swiglu
from detkit.kernels.moe_routing import build_routing

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
tiles = {"w8_128x128_s4": GemmConfig(128, 128, 128, 1, 8, 4, "ws"), "w12_128x128_s4": GemmConfig(128, 128, 128, 1, 12, 4, "ws"),
         "w12_128x64_s6": GemmConfig(128, 64, 128, 1, 12, 6, "ws"), "triton": GemmConfig(128, 64, 128, 1, 4, 4, "tma")}
res = {}
for preset in ("reference", "qwen3-30b-a3b"):
    p = MOE_PRESETS[preset]
    inp = make_inputs(p, dev, 1234)
    x, w1, w2, ids, scores, dout = (inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout"))
    r = build_routing(ids, scores, p.e)
    b = "cuda_sm90"
    (x_q, x_s), (dout_q, dout_s) = quantize_rowwise(x), quantize_rowwise(dout)
    w1f, w2f = quantize_weight(w1), quantize_weight(w2)
    gu, h = moe_fp8_up_swiglu(x_q, x_s, w1f, r, b)[:2]
    runs = {name: (lambda c=c: moe_fp8_dgrad(dout_q, dout_s, w2f, gu, r, b, config=c, h=h)) for name, c in tiles.items()}
    ref = runs["triton"]()
    rows = r.padded_rows
    bits = {}
    for name, fn in runs.items():
        o = fn()
        bits[name] = all(torch.equal(a[:rows].view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a[:rows], b_[:rows].view(torch.uint8) if b_.dtype == torch.float8_e4m3fn else b_[:rows])
                         for a, b_ in zip(o, ref))
    t = time_interleaved({k: v for k, v in runs.items() if k != "triton"}, dev, rounds=3)
    res[preset] = {"bits_equal_triton": bits, **{k: {"median_us": v.median_us, "p20_us": v.p20_us, "p80_us": v.p80_us,
                                                     "sm_clock_mhz": v.sm_clock_mhz} for k, v in t.items()}}
    print(preset, json.dumps(res[preset], indent=1), flush=True)
(out / "dgrad.json").write_text(json.dumps(res, indent=1))
