"""s20 calls 5 and 6: the FP8 weight quantizer (DRAM-bound: read W BF16 once, write q and q_t) against variants: the landed
kernel (one 128x128 block per program, 8 warps) at 4 and 16 warps, and a two-pass kernel (the block's amax over
SUB-row slices, then the slices re-read from L2, quantized and stored) at SUB 16/32/64 on 4 and 8 warps: fewer
registers per program, more programs per SM, more loads in flight. Bits of each against the landed kernel (random
weights with a zero block, a NaN and an infinity); times interleaved; bytes moved / time."""
import functools, json, sys
from pathlib import Path
import torch
import triton
import triton.language as tl
from detkit.toolkit.timing import time_interleaved
from detkit.kernels.fp8_quant import (FP8_DTYPE, QBLOCK, fp8_quant_weight_kernel, pow2_scale, quantize_weight,
                                      to_e4m3)


@triton.jit
def wq_two_pass(w_ptr, q_ptr, qt_ptr, s_ptr, R, C, stride_we, stride_wr, stride_wc, stride_qe, stride_qr, stride_qc,
                stride_te, stride_tc, stride_tr, stride_se, stride_sr, stride_sc, QBLOCK: tl.constexpr,
                SUB: tl.constexpr):
    pid = tl.program_id(axis=0)
    num_r = R // QBLOCK
    num_c = C // QBLOCK
    expert = pid // (num_r * num_c)
    pid_r = (pid % (num_r * num_c)) // num_c
    pid_c = pid % num_c
    offs_c = pid_c * QBLOCK + tl.arange(0, QBLOCK)
    base = w_ptr + expert * stride_we + offs_c[None, :] * stride_wc
    amax = tl.max(tl.max(tl.abs(tl.load(base + (pid_r * QBLOCK + tl.arange(0, SUB))[:, None] * stride_wr)
                                .to(tl.float32)), axis=1), axis=0)
    for r0 in tl.static_range(SUB, QBLOCK, SUB):
        offs_r = pid_r * QBLOCK + r0 + tl.arange(0, SUB)
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(tl.load(base + offs_r[:, None] * stride_wr).to(tl.float32)),
                                              axis=1), axis=0))
    scale, inv = pow2_scale(amax)
    for r0 in tl.static_range(0, QBLOCK, SUB):
        offs_r = pid_r * QBLOCK + r0 + tl.arange(0, SUB)
        q = to_e4m3(tl.load(base + offs_r[:, None] * stride_wr).to(tl.float32) * inv, False, EXPLICIT_CLAMP=True)
        tl.store(q_ptr + expert * stride_qe + offs_r[:, None] * stride_qr + offs_c[None, :] * stride_qc, q)
        tl.store(qt_ptr + expert * stride_te + offs_r[:, None] * stride_tr + offs_c[None, :] * stride_tc, q)
    tl.store(s_ptr + expert * stride_se + pid_r * stride_sr + pid_c * stride_sc, scale)


@triton.jit
def wq_narrow_max(w_ptr, q_ptr, qt_ptr, s_ptr, R, C, stride_we, stride_wr, stride_wc, stride_qe, stride_qr,
                  stride_qc, stride_te, stride_tc, stride_tr, stride_se, stride_sr, stride_sc, QBLOCK: tl.constexpr):
    """The landed kernel with the block held in its input dtype (the amax of BF16 values is exact in BF16): half the
    registers, so more programs per SM."""
    pid = tl.program_id(axis=0)
    num_r = R // QBLOCK
    num_c = C // QBLOCK
    expert = pid // (num_r * num_c)
    pid_r = (pid % (num_r * num_c)) // num_c
    pid_c = pid % num_c
    offs_r = pid_r * QBLOCK + tl.arange(0, QBLOCK)
    offs_c = pid_c * QBLOCK + tl.arange(0, QBLOCK)
    w = tl.load(w_ptr + expert * stride_we + offs_r[:, None] * stride_wr + offs_c[None, :] * stride_wc)
    scale, inv = pow2_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0).to(tl.float32))
    q = to_e4m3(w.to(tl.float32) * inv, False, EXPLICIT_CLAMP=True)
    tl.store(q_ptr + expert * stride_qe + offs_r[:, None] * stride_qr + offs_c[None, :] * stride_qc, q)
    tl.store(qt_ptr + expert * stride_te + offs_r[:, None] * stride_tr + offs_c[None, :] * stride_tc, q)
    tl.store(s_ptr + expert * stride_se + pid_r * stride_sr + pid_c * stride_sc, scale)


def narrow_max(w, warps):
    e, r, c = w.shape
    q = torch.empty((e, r, c), dtype=FP8_DTYPE, device=w.device)
    qt = torch.empty((e, c, r), dtype=FP8_DTYPE, device=w.device)
    s = torch.empty((e, r // QBLOCK, c // QBLOCK), dtype=torch.float32, device=w.device)
    wq_narrow_max[(e * (r // QBLOCK) * (c // QBLOCK),)](
        w, q, qt, s, r, c, *w.stride(), *q.stride(), *qt.stride(), *s.stride(), QBLOCK=QBLOCK, num_warps=warps)
    return q, qt, s


def landed(w, warps):
    e, r, c = w.shape
    q = torch.empty((e, r, c), dtype=FP8_DTYPE, device=w.device)
    qt = torch.empty((e, c, r), dtype=FP8_DTYPE, device=w.device)
    s = torch.empty((e, r // QBLOCK, c // QBLOCK), dtype=torch.float32, device=w.device)
    fp8_quant_weight_kernel[(e * (r // QBLOCK) * (c // QBLOCK),)](
        w, q, qt, s, r, c, *w.stride(), c // 2 * w.stride(2), *q.stride(), *qt.stride(), *s.stride(),
        QBLOCK=QBLOCK, INTERPRETED=False, SPLIT_C=False, num_warps=warps)
    return q, qt, s


def two_pass(w, sub, warps):
    e, r, c = w.shape
    q = torch.empty((e, r, c), dtype=FP8_DTYPE, device=w.device)
    qt = torch.empty((e, c, r), dtype=FP8_DTYPE, device=w.device)
    s = torch.empty((e, r // QBLOCK, c // QBLOCK), dtype=torch.float32, device=w.device)
    wq_two_pass[(e * (r // QBLOCK) * (c // QBLOCK),)](
        w, q, qt, s, r, c, *w.stride(), *q.stride(), *qt.stride(), *s.stride(), QBLOCK=QBLOCK, SUB=sub,
        num_warps=warps)
    return q, qt, s


out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
CALL = int(sys.argv[2]) if len(sys.argv) > 2 else 5  # 5: warps and two-pass; 6: the narrow-dtype amax
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(7)
res = {}
for name, e, h, i in (("reference", 8, 3072, 1536), ("qwen3-30b-a3b", 128, 2048, 768), ("E128-3072x1536", 128, 3072, 1536)
                      )[:3 if CALL == 5 else 2]:
    ws = {"w1": (torch.randn((e, h, 2 * i), generator=gen, device=dev) * 0.02).to(torch.bfloat16),
          "w2": (torch.randn((e, i, h), generator=gen, device=dev) * 0.02).to(torch.bfloat16)}
    ws["w1"][0, :128, :128] = 0  # a zero block
    ws["w1"][0, 200, 300] = float("nan")
    ws["w2"][1, 5, 7] = float("inf")
    ws["w2"][2, 130, 140] = 3.0e38
    variants = {"landed_w8": functools.partial(landed, warps=8), "landed_w4": functools.partial(landed, warps=4)}
    if CALL == 5:
        variants["landed_w16"] = functools.partial(landed, warps=16)
        for sub in (16, 32, 64):
            for warps in (4, 8):
                variants[f"two_pass_sub{sub}_w{warps}"] = functools.partial(two_pass, sub=sub, warps=warps)
    else:
        variants["landed_w2"] = functools.partial(landed, warps=2)
        for warps in (2, 4, 8):
            variants[f"narrow_max_w{warps}"] = functools.partial(narrow_max, warps=warps)
    row = {}
    for wname, w in ws.items():
        base = landed(w, 8)
        ref = quantize_weight(w)
        row[f"{wname}_landed_equals_quantize_weight"] = all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == FP8_DTYPE else torch.equal(a, b)
            for a, b in zip(base, (ref.q, ref.q_t, ref.scale)))
        for vname, fn in variants.items():
            got = fn(w)
            row[f"{wname}_{vname}_bits_equal"] = all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == FP8_DTYPE else torch.equal(a, b)
                for a, b in zip(got, base))
        t = time_interleaved({v: functools.partial(fn, w) for v, fn in variants.items()}, dev, rounds=5)
        nbytes = w.numel() * 4  # BF16 read + two E4M3 writes
        row.update({f"{wname}_{k}": {"median_us": v.median_us, "p20_us": v.p20_us, "p80_us": v.p80_us,
                                     "sm_clock_mhz": v.sm_clock_mhz, "tb_per_s": nbytes / v.median_us / 1e6}
                    for k, v in t.items()})
    res[name] = row
    print(name, json.dumps({k: (round(v["median_us"], 1), round(v["tb_per_s"], 2)) if isinstance(v, dict) else v
                            for k, v in row.items()}, indent=1), flush=True)
(out / "exp.json").write_text(json.dumps(res, indent=1))
