"""Ablation of the fused FP8 dgrad epilogue (commit f648f02's kernel with DEBUG knobs): what makes it slow."""
import json, os, sys
import torch
from bench.moe import PRESETS, make_inputs
from kernels.det_gemm import GemmConfig
from kernels.fp8_quant import quantize_rowwise, quantize_weight
from kernels.moe_fp8 import moe_fp8_dgrad, moe_fp8_up_swiglu
from kernels.moe_routing import build_routing
from triton.testing import do_bench

dev, b = torch.device("cuda"), "cuda_sm90"
p = PRESETS["reference"]
inp = make_inputs(p, dev, 0)
r = build_routing(inp["topk_ids"], inp["scores"], p.e)
x_q, x_s = quantize_rowwise(inp["x"]); d_q, d_s = quantize_rowwise(inp["dout"])
w1f, w2f = quantize_weight(inp["w1"]), quantize_weight(inp["w2"])
gu, h = moe_fp8_up_swiglu(x_q, x_s, w1f, r, b)[:2]
C = lambda bn, st: GemmConfig(128, bn, 128, 1, 8, st, "ws")
variants = [("base s4", C(128, 4), False, False, 0), ("base s3", C(128, 3), False, False, 0),
            ("ds s3", C(128, 3), True, False, 0), ("col s4", C(128, 4), False, True, 0),
            ("col s4 no-exchange", C(128, 4), False, True, 1), ("col s4 no-qt-store", C(128, 4), False, True, 2),
            ("col s4 no-scale-store", C(128, 4), False, True, 4), ("col s4 no-max no-exchange", C(128, 4), False, True, 9),
            ("col s4 none", C(128, 4), False, True, 15), ("col s4 convert-store", C(128, 4), False, True, 18),
            ("col 128x64 s6", C(64, 6), False, True, 0), ("base 128x64 s6", C(64, 6), False, False, 0)]
rows = []
for name, cfg, ds, col, dbg in variants:
    os.environ["DGRAD_DEBUG"] = str(dbg)
    fn = lambda: moe_fp8_dgrad(d_q, d_s, w2f, gu, r, b, h=h if ds else None, colwise=col, config=cfg)
    fn(); torch.cuda.synchronize()
    ms = sorted(do_bench(fn, warmup=5, rep=200, return_mode="all"))
    rows.append({"variant": name, "debug": dbg, "median_us": 1000 * ms[len(ms) // 2], "p20_us": 1000 * ms[len(ms) // 5],
                 "p80_us": 1000 * ms[4 * len(ms) // 5]})
    print(json.dumps(rows[-1]), flush=True)
if len(sys.argv) > 1:
    json.dump(rows, open(sys.argv[1], "w"), indent=1)
