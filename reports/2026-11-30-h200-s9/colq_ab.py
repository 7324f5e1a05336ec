"""The FP8 column-wise quantizer (wgrad="fp8": x[gather], dgu, h, s * dout[gather], each [P, N] -> K-major e4m3
[N, P] with 128x1 scales) in two forms, both copied below, timed in interleaved rounds
(toolkit.timing.time_interleaved) with every output checked bit-equal to the first: "fp32 transpose" (the FP32 tile
transposed, then quantized along its rows: kernels.moe_fp8.moe_fp8_quant_colwise_kernel's form) and "e4m3 transpose"
(quantized down the columns in the load's layout, then the 1-byte tile transposed), at several tiles (columns per
program, warps). Run from the repository root on the GPU:
    python reports/2026-11-30-h200-s9/colq_ab.py [rounds] [out.json]
"""

import json
import sys

import torch
import triton
import triton.language as tl

import kernels.moe_fp8 as kf
from bench.moe import PRESETS, make_inputs
from kernels.fp8_quant import QBLOCK, pow2_scale, quantize_rows, quantize_rowwise, quantize_weight, to_e4m3
from kernels.moe_routing import build_routing
from toolkit.contract import compare_bits
from toolkit.timing import time_interleaved


@triton.jit
def colwise_kernel(src_ptr, rows_ptr, route_ptr, score_ptr, q_ptr, qs_ptr, P, N, stride_sm, stride_sn,
                                  stride_qn, stride_qp, stride_sn_s, stride_sp_s, BLOCK_N: tl.constexpr,
                                  QBLOCK: tl.constexpr, GATHER: tl.constexpr, SCALE: tl.constexpr,
                                  QUANT_FIRST: tl.constexpr):
    pid = tl.program_id(axis=0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_p = pid // num_pid_n
    pid_n = pid % num_pid_n
    offs_p = pid_p * QBLOCK + tl.arange(0, QBLOCK)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    row_ok = tl.load(route_ptr + offs_p) >= 0
    rows = tl.load(rows_ptr + offs_p) if GATHER else offs_p
    v = tl.load(src_ptr + rows[:, None] * stride_sm + offs_n[None, :] * stride_sn,
                mask=row_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    if SCALE:
        v = v * tl.load(score_ptr + offs_p)[:, None]
    if QUANT_FIRST:  # "e4m3 transpose"
        scale, inv = pow2_scale(tl.max(tl.abs(v), axis=0))
        q = tl.trans(to_e4m3(v * inv[None, :], False))
    else:  # "fp32 transpose"
        q, scale = quantize_rows(tl.trans(v), False)
    tl.store(q_ptr + offs_n[:, None] * stride_qn + offs_p[None, :] * stride_qp, q, mask=n_ok[:, None])
    tl.store(qs_ptr + offs_n * stride_sn_s + pid_p * stride_sp_s, scale, mask=n_ok)


def colwise(src, routing, gather, scale, quant_first, block_n, warps):
    p, n = routing.padded_rows, src.shape[1]
    q = torch.empty((n, p), dtype=torch.float8_e4m3fn, device=src.device)
    s = torch.empty((p // QBLOCK, n), dtype=torch.float32, device=src.device).t()
    colwise_kernel[(routing.num_tiles * triton.cdiv(n, block_n),)](
        src, routing.gather_token, routing.sorted_route, routing.row_score, q, s, p, n,
        src.stride(0), src.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
        BLOCK_N=block_n, QBLOCK=QBLOCK, GATHER=gather, SCALE=scale, QUANT_FIRST=quant_first, num_warps=warps)
    return q, s


VARIANTS = {"fp32 transpose 128 cols w4": (False, 128, 4), "fp32 transpose 64 cols w2": (False, 64, 2),
            "e4m3 transpose 128 cols w4": (True, 128, 4), "e4m3 transpose 64 cols w2": (True, 64, 2),
            "e4m3 transpose 128 cols w2": (True, 128, 2), "e4m3 transpose 32 cols w2": (True, 32, 2),
            "e4m3 transpose 64 cols w1": (True, 64, 1), "e4m3 transpose 32 cols w1": (True, 32, 1)}


def main(rounds: int, out_path: str | None) -> None:
    dev, b = torch.device("cuda"), "cuda_sm90"
    rows = []
    for name in ("reference", "reference-16k"):
        p = PRESETS[name]
        inp = make_inputs(p, dev, 0)
        r = build_routing(inp["topk_ids"], inp["scores"], p.e)
        x_q, x_s = quantize_rowwise(inp["x"])
        d_q, d_s = quantize_rowwise(inp["dout"])
        w1f, w2f = quantize_weight(inp["w1"]), quantize_weight(inp["w2"])
        gu, h = kf.moe_fp8_up_swiglu(x_q, x_s, w1f, r, b)[:2]
        dgu = kf.moe_fp8_dgrad(d_q, d_s, w2f, gu, r, b, h=h)[0]
        operands = {"x": (inp["x"], True, False), "dgu": (dgu, False, False), "h": (h, False, False),
                    "dy": (inp["dout"], True, True)}
        for op, (src, gather, scale) in operands.items():
            fns = {k: (lambda v=v: colwise(src, r, gather, scale, *v)) for k, v in VARIANTS.items()}
            outs = {k: fn() for k, fn in fns.items()}
            first = outs["fp32 transpose 128 cols w4"]
            equal = {k: all(compare_bits(a, c).equal for a, c in zip(o, first)) for k, o in outs.items()}
            del outs, first
            nbytes = src.shape[1] * r.padded_rows * 3  # the BF16 rows read, the e4m3 written (scales aside)
            for k, tm in time_interleaved(fns, dev, rounds=rounds).items():
                rows.append({"preset": name, "T": p.t, "operand": op, "variant": k, "bits_equal": equal[k],
                             "tb_per_s": nbytes / tm.median_us / 1e6,
                             **{f: getattr(tm, f) for f in ("median_us", "p20_us", "p80_us", "sm_clock_mhz")}})
                print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    if out_path:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, sys.argv[2] if len(sys.argv) > 2 else None)
