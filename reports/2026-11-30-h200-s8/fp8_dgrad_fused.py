"""The FP8 layer's dgrad with the dscore partials and dgu's column-wise quantization fused into its Gluon epilogue,
against what it replaces (the dgrad of FP8 table 2026-11-30.11 followed by the column-wise pass over the stored BF16
dgu; the dscores were then a separate dout . y kernel), per tile and ring depth, timed in interleaved rounds
(toolkit.timing.time_interleaved) at the same clocks; every fused variant's outputs checked bit-equal to the first's
and its column-wise dgu to the pass over the stored dgu. Run from the repository root on the GPU:
    python reports/2026-11-30-h200-s8/fp8_dgrad_fused.py [rounds] [out.json]
"""

import json
import sys

import torch

from bench.moe import PRESETS, make_inputs
from kernels.det_gemm import GemmConfig
from kernels.fp8_quant import quantize_rowwise, quantize_weight
from kernels.moe_fp8 import moe_fp8_dgrad, moe_fp8_quant_colwise, moe_fp8_up_swiglu
from kernels.moe_routing import build_routing
from toolkit.contract import compare_bits
from toolkit.timing import time_interleaved

TABLE11 = GemmConfig(128, 128, 128, 1, 8, 4, "ws")
FUSED = {"128x128 s3": GemmConfig(128, 128, 128, 1, 8, 3, "ws"), "128x128 s4": GemmConfig(128, 128, 128, 1, 8, 4, "ws"),
         "128x64 s5": GemmConfig(128, 64, 128, 1, 8, 5, "ws"), "128x64 s6": GemmConfig(128, 64, 128, 1, 8, 6, "ws")}


def main(rounds: int, out_path: str | None) -> None:
    dev, b = torch.device("cuda"), "cuda_sm90"
    rows = []
    for name in ("reference", "reference-16k", "qwen3-30b-a3b"):
        p = PRESETS[name]
        inp = make_inputs(p, dev, 0)
        r = build_routing(inp["topk_ids"], inp["scores"], p.e)
        x_q, x_s = quantize_rowwise(inp["x"])
        d_q, d_s = quantize_rowwise(inp["dout"])
        w1f, w2f = quantize_weight(inp["w1"]), quantize_weight(inp["w2"])
        gu, h = moe_fp8_up_swiglu(x_q, x_s, w1f, r, b)[:2]

        def before():
            d = moe_fp8_dgrad(d_q, d_s, w2f, gu, r, b, config=TABLE11)
            return d, moe_fp8_quant_colwise(d.dgu, r, b, gather=False, scale=False)

        fns = {"table .11 dgrad + colwise pass": before,
               "dscore, BF16 dgu 128x128 s3 (wgrad bf16)": lambda: moe_fp8_dgrad(d_q, d_s, w2f, gu, r, b, h=h,
                                                                                 config=FUSED["128x128 s3"])}
        for label, c in FUSED.items():
            fns[f"fused {label}"] = lambda c=c: moe_fp8_dgrad(d_q, d_s, w2f, gu, r, b, h=h, colwise=True, config=c)
        results = {k: fn() for k, fn in fns.items()}
        first = results["fused 128x128 s3"]
        col_ref = results["table .11 dgrad + colwise pass"][1]
        equal = {}
        for k, d in results.items():
            if k.startswith("fused"):
                equal[k] = all(compare_bits(a, c).equal for a, c in (
                    (d.dgu_q, first.dgu_q), (d.dgu_s, first.dgu_s), (d.ds_part, first.ds_part),
                    (d.dgu_col[0], col_ref[0]), (d.dgu_col[1], col_ref[1])))
        timings = time_interleaved(fns, dev, rounds=rounds)
        for k, tm in timings.items():
            rows.append({"preset": name, "T": p.t, "variant": k, "bits_equal": equal.get(k),
                         **{f: getattr(tm, f) for f in ("median_us", "p20_us", "p80_us", "sm_clock_mhz")}})
            print(json.dumps(rows[-1]), flush=True)
        del results, first
        torch.cuda.empty_cache()
    if out_path:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, sys.argv[2] if len(sys.argv) > 2 else None)
