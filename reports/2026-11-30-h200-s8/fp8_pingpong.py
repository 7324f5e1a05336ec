"""The FP8 gathered Gluon kernels (up, dgrad) with their two consumer warpgroups taking 64-row tiles in turn
(ping-pong: one's epilogue runs while the other's MMAs do) against the cooperative 128-row tiles of FP8 table
2026-11-30.11: each stage alone, and the layer's forward+backward (default wgrad="fp8") with each table beside the
BF16 layer, timed in interleaved rounds (toolkit.timing.time_interleaved) at the same clocks; every variant's outputs
checked bit-equal to the cooperative tile's. Run from the repository root on the GPU:
    python reports/2026-11-30-h200-s8/fp8_pingpong.py [rounds] [out.json]
"""

import json
import sys

import torch

import kernels.moe_fp8 as kf
from bench.moe import PRESETS, make_inputs
from kernels.det_gemm import GemmConfig
from kernels.fp8_quant import quantize_rowwise, quantize_weight
from kernels.moe import moe_mlp_bwd, moe_mlp_fwd
from kernels.moe_routing import build_routing
from toolkit.contract import compare_bits
from toolkit.timing import time_interleaved

WS = lambda bm, bn, w, st: GemmConfig(bm, bn, 128, 1, w, st, "ws")  # noqa: E731
STAGES = {"up": {"coop 128x128 s4": WS(128, 128, 8, 4), "pp 64x128 s7": WS(64, 128, 8, 7)},
          "dgrad": {"coop 128x128 s4": WS(128, 128, 8, 4), "pp 64x128 s5": WS(64, 128, 8, 5),
                    "pp 64x64 s6": WS(64, 64, 8, 6)}}
TABLES = {"table .11": {}, "pp up + dgrad": {"up": WS(64, 128, 8, 7), "dgrad": WS(64, 128, 8, 5)}}


def with_table(stages, fn):
    def run():
        table = kf.MOE_FP8_CONFIGS["cuda_sm90"]
        kept = dict(table)
        table.update(stages)
        try:
            return fn()
        finally:
            table.clear()
            table.update(kept)
    return run


def main(rounds: int, out_path: str | None) -> None:
    dev, b = torch.device("cuda"), "cuda_sm90"
    rows = []
    for name in ("reference", "reference-16k"):
        p = PRESETS[name]
        inp = make_inputs(p, dev, 0)
        args = [inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores")]
        r = build_routing(inp["topk_ids"], inp["scores"], p.e)
        x_q, x_s = quantize_rowwise(inp["x"])
        d_q, d_s = quantize_rowwise(inp["dout"])
        w1f, w2f = quantize_weight(inp["w1"]), quantize_weight(inp["w2"])
        gu, h = kf.moe_fp8_up_swiglu(x_q, x_s, w1f, r, b)[:2]
        runs = {"up": lambda c: kf.moe_fp8_up_swiglu(x_q, x_s, w1f, r, b, config=c),
                "dgrad": lambda c: kf.moe_fp8_dgrad(d_q, d_s, w2f, gu, r, b, config=c, h=h)}
        for stage, configs in STAGES.items():
            outs = {k: runs[stage](c) for k, c in configs.items()}
            first = outs["coop 128x128 s4"]
            equal = {k: all(compare_bits(a, c).equal for a, c in zip(o, first)) for k, o in outs.items()}
            del outs, first
            fns = {k: (lambda c=c: runs[stage](c)) for k, c in configs.items()}
            for k, tm in time_interleaved(fns, dev, rounds=rounds).items():
                rows.append({"preset": name, "T": p.t, "stage": stage, "variant": k, "bits_equal": equal[k],
                             **{f: getattr(tm, f) for f in ("median_us", "p20_us", "p80_us", "sm_clock_mhz")}})
                print(json.dumps(rows[-1]), flush=True)

        def fp8():
            out, saved = kf.moe_mlp_fp8_fwd(*args, weight_cache=None)
            g = kf.moe_mlp_fp8_bwd(inp["dout"], saved)
            return (out, g.dx, g.dw1, g.dw2, g.dscores)

        def bf16():
            out, saved = moe_mlp_fwd(*args)
            g = moe_mlp_bwd(inp["dout"], saved)
            return (out, g.dx, g.dw1, g.dw2, g.dscores)

        fns = {"bf16 layer": bf16, **{f"fp8 {k}": with_table(v, fp8) for k, v in TABLES.items()}}
        outs = {k: fn() for k, fn in fns.items() if k != "bf16 layer"}
        first = outs["fp8 table .11"]
        equal = {k: all(compare_bits(a, c).equal for a, c in zip(o, first)) for k, o in outs.items()}
        del outs, first
        timings = time_interleaved(fns, dev, rounds=rounds)
        for k, tm in timings.items():
            rows.append({"preset": name, "T": p.t, "stage": "fwd_bwd", "variant": k, "bits_equal": equal.get(k),
                         "speedup_vs_bf16": timings["bf16 layer"].median_us / tm.median_us,
                         **{f: getattr(tm, f) for f in ("median_us", "p20_us", "p80_us", "sm_clock_mhz")}})
            print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    if out_path:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, sys.argv[2] if len(sys.argv) > 2 else None)
