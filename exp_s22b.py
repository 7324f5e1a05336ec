"""One-off H200 experiment (session 22): what the FP8 up and dgrad GEMMs would gain from expert-ordered A rows by
TMA. Times, interleaved: the landed gathered up (SwiGLU epilogue) and dgrad (dSwiGLU, quantization, dscore
partials); the same GEMMs as the down kernel (TMA A rows, plain BF16 epilogue) on A copied into expert order; the
copy itself. Usage: python exp_s22b.py OUT_DIR"""

import json
import statistics
import sys
from pathlib import Path

import torch

from detkit.bench.moe_common import MoePreset, make_inputs
from detkit.kernels.fp8_quant import Fp8Weight, quantize_rowwise, quantize_weight
from detkit.kernels.moe_fp8 import moe_fp8_dgrad, moe_fp8_down, moe_fp8_up_gemm
from detkit.kernels.moe_routing import build_routing

SHAPES = {"reference": (8192, 3072, 1536, 8, 8), "qwen3-30b-a3b": (8192, 2048, 768, 128, 8)}
B = "cuda_sm90"


def timed(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset, (t, h, i, e, k) in SHAPES.items():
        inp = make_inputs(MoePreset(preset, t, h, i, e, k), torch.device("cuda"), seed=1)
        r = build_routing(inp["topk_ids"], inp["scores"], e)
        w1f, w2f = quantize_weight(inp["w1"]), quantize_weight(inp["w2"])
        w2f_t = Fp8Weight(w2f.q_t, w2f.q, w2f.scale.transpose(1, 2))  # dh = dout @ W2^T as a down-shaped GEMM
        x_q, x_s = quantize_rowwise(inp["x"])
        d_q, d_s = quantize_rowwise(inp["dout"])
        g = r.gather_token.long()
        gu, hh, _, _ = moe_fp8_up_gemm(x_q, x_s, w1f, r, B)
        fns = {
            "up_gathered": lambda: moe_fp8_up_gemm(x_q, x_s, w1f, r, B),
            "up_tma_plain": lambda: moe_fp8_down(xs_q, xs_s, w1f, r, B),
            "dgrad_gathered": lambda: moe_fp8_dgrad(d_q, d_s, w2f, gu, r, B, h=hh),
            "dgrad_tma_plain": lambda: moe_fp8_down(ds_q, ds_s, w2f_t, r, B),
            "copy_x_q": lambda: (x_q.index_select(0, g), x_s.index_select(0, g)),
        }
        xs_q, xs_s = fns["copy_x_q"]()
        ds_q, ds_s = d_q.index_select(0, g), d_s.index_select(0, g)
        times = {n: [] for n in fns}
        for _ in range(3):
            for f in fns.values():
                f()
        for _ in range(12):
            for n, f in fns.items():
                times[n].append(timed(f))
        row = {"preset": preset, "P": r.padded_rows}
        for n, ts in times.items():
            q = statistics.quantiles(ts, n=5)
            row[n] = {"median_us": round(statistics.median(ts), 1), "p20": round(q[0], 1), "p80": round(q[3], 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out / "tma_a.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
