"""A fused rotary position embedding with the bits of transformers' ``apply_rotary_pos_emb``: one launch for q and k
where the function runs ten (per tensor: the product with cos, the half rotation's negation and concatenation, the
product with sin, the sum), most of which is host time in an eager decode step.

Math (``rope_kernel``), per row of ``D`` elements of q or k (x1 its first half, x2 its second, c and s the row's cos
and sin): ``out[:D/2] = x1 * c[:D/2] + (-x2) * s[:D/2]`` and ``out[D/2:] = x2 * c[D/2:] + x1 * s[D/2:]``, each
product and the sum rounded to the tensors' dtype as torch's elementwise ops round them (formed in FP32, one rounding
each; the kernel compiles without FP contraction, so no product is fused into the sum). Elementwise and row by row:
batch-invariant, the same bits on every layout, and equal to the function's output bit for bit (tests on the
interpreter and on the GPU).

Layout: q [B, Hq, S, D] and k [B, Hk, S, D] with a contiguous last dim and any other strides (transformers passes a
transpose of the projections' [B, S, H, D]); cos and sin [B or 1, S, D] (before the function's unsqueeze). Each output
is allocated with the strides torch's ops give it (``output_strides``: the function run once on meta tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detkit.kernels.backend import TRITON_INTERPRETER, DirectLaunch, resolve_backend_of_devices
from detkit.kernels.det_gemm.kernels import to_bf16

DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _rounded(v, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
    """An FP32 value rounded to the tensors' dtype (nearest even), as FP32."""
    if BF16:
        out = to_bf16(v, INTERPRETED).to(tl.float32)
    else:
        out = v
    return out


@triton.jit
def _rope_rows(x_ptr, o_ptr, cos_ptr, sin_ptr, rows, R, H, S, sx0, sx1, sx2, so0, so1, so2, sc0, sc2, ss0, ss2,
               HALF: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr, INTERPRETED: tl.constexpr):
    r64 = rows.to(tl.int64)
    b, h, s = r64 // (H * S), (r64 // S) % H, r64 % S
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < HALF)[None, :]
    x_row = (b * sx0 + h * sx1 + s * sx2)[:, None] + cols[None, :]
    c_row = (b * sc0 + s * sc2)[:, None] + cols[None, :]
    s_row = (b * ss0 + s * ss2)[:, None] + cols[None, :]
    x1 = tl.load(x_ptr + x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + c_row, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + c_row + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + s_row, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + s_row + HALF, mask=mask, other=0.0).to(tl.float32)
    lo = _rounded(_rounded(x1 * c1, BF16, INTERPRETED) + _rounded(-x2 * s1, BF16, INTERPRETED), BF16, INTERPRETED)
    hi = _rounded(_rounded(x2 * c2, BF16, INTERPRETED) + _rounded(x1 * s2, BF16, INTERPRETED), BF16, INTERPRETED)
    o_row = (b * so0 + h * so1 + s * so2)[:, None] + cols[None, :]
    tl.store(o_ptr + o_row, lo.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + o_row + HALF, hi.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, RQ, RK, HQ, HK, S,
                sq0, sq1, sq2, sk0, sk1, sk2, sqo0, sqo1, sqo2, sko0, sko1, sko2, sc0, sc2, ss0, ss2,
                HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
                INTERPRETED: tl.constexpr):
    pid = tl.program_id(0)
    q_programs = tl.cdiv(RQ, BLOCK_R)
    if pid < q_programs:
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        _rope_rows(q_ptr, qo_ptr, cos_ptr, sin_ptr, rows, RQ, HQ, S, sq0, sq1, sq2, sqo0, sqo1, sqo2, sc0, sc2, ss0,
                   ss2, HALF, BLOCK_D, BF16, INTERPRETED)
    else:
        rows = (pid - q_programs) * BLOCK_R + tl.arange(0, BLOCK_R)
        _rope_rows(k_ptr, ko_ptr, cos_ptr, sin_ptr, rows, RK, HK, S, sk0, sk1, sk2, sko0, sko1, sko2, sc0, sc2, ss0,
                   ss2, HALF, BLOCK_D, BF16, INTERPRETED)


def rope_reason(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """None when ``rope`` takes the operands; else why not (one line)."""
    tensors = {"q": q, "k": k, "cos": cos, "sin": sin}
    if len({t.dtype for t in tensors.values()}) != 1 or q.dtype not in DTYPES:
        return f"dtypes {[str(t.dtype) for t in tensors.values()]} (supported: one of {DTYPES} for all four)"
    if len({t.device for t in tensors.values()}) != 1:
        return f"devices {[str(t.device) for t in tensors.values()]} (supported: one device)"
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return (f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)} "
                "(supported: q, k [B, H, S, D]; cos, sin [B or 1, S, D])")
    b, _, s, d = q.shape
    if k.shape[0] != b or k.shape[2:] != (s, d) or cos.shape[1:] != (s, d) or cos.shape[0] not in (1, b) \
            or d % 2 or q.numel() == 0 or k.numel() == 0:
        return (f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} (supported: one batch, "
                "sequence and even head dim; cos batch 1 or q's)")
    if any(t.stride(-1) != 1 for t in tensors.values()):
        return "a last dim not contiguous"
    return None


def output_strides(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, apply) -> tuple[tuple, tuple]:
    """The strides torch's ops give ``apply(q, k, cos, sin)``'s outputs (``apply``: the function being replaced),
    read from one run on meta tensors of the operands' shapes and strides."""
    def meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    q_out, k_out = apply(meta(q), meta(k), meta(cos), meta(cos))
    return q_out.stride(), k_out.stride()


def rope_launcher(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  strides: tuple[tuple, tuple]):
    """``launch(q, k, cos, sin) -> (q_embed, k_embed)`` for operands of this signature, the outputs allocated with
    ``strides``; operands ``rope_reason`` refuses raise a one-line ValueError here, before any work."""
    reason = rope_reason(q, k, cos, sin)
    if reason is not None:
        raise ValueError(f"rope does not take {reason}")
    backend = resolve_backend_of_devices(rope_kernel, {"q": q.device})
    interpreted = backend == TRITON_INTERPRETER
    b, hq, s, d = q.shape
    hk = k.shape[1]
    half = d // 2
    block_r = 16
    rq, rk = b * hq * s, b * hk * s
    grid = (triton.cdiv(rq, block_r) + triton.cdiv(rk, block_r),)
    (sqo, sko), device, dtype = strides, q.device, q.dtype
    cos_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    sin_b = 0 if sin.shape[0] == 1 else sin.stride(0)
    values = dict(RQ=rq, RK=rk, HQ=hq, HK=hk, S=s, sq0=q.stride(0), sq1=q.stride(1), sq2=q.stride(2),
                  sk0=k.stride(0), sk1=k.stride(1), sk2=k.stride(2), sqo0=sqo[0], sqo1=sqo[1], sqo2=sqo[2],
                  sko0=sko[0], sko1=sko[1], sko2=sko[2], sc0=cos_b, sc2=cos.stride(1), ss0=sin_b, ss2=sin.stride(1),
                  HALF=half, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(half), BF16=dtype == torch.bfloat16,
                  INTERPRETED=interpreted)
    q_shape, k_shape = tuple(q.shape), tuple(k.shape)

    def outputs():
        return (torch.empty_strided(q_shape, sqo, dtype=dtype, device=device),
                torch.empty_strided(k_shape, sko, dtype=dtype, device=device))
    if interpreted:
        def launch(q, k, cos, sin):
            q_out, k_out = outputs()
            rope_kernel[grid](q, k, cos, sin, q_out, k_out, **values, num_warps=4)
            return q_out, k_out
        return launch
    names = list(rope_kernel.arg_names)
    template = [values.get(name) for name in names]
    slots = [names.index(n) for n in ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "qo_ptr", "ko_ptr")]
    options = {"num_warps": 4, "enable_fp_fusion": False}  # each product rounded before the sum, as torch's ops
    launches = {}

    def launch(q, k, cos, sin):
        q_out, k_out = outputs()
        args = template.copy()
        for slot, t in zip(slots, (q, k, cos, sin, q_out, k_out)):
            args[slot] = t
        key = tuple(t.data_ptr() & 15 == 0 for t in (q, k, cos, sin))  # Triton specializes on 16-byte alignment
        run = launches.get(key)
        if run is None:
            run = launches[key] = DirectLaunch(rope_kernel, grid, options, device)
        run(args)
        return q_out, k_out
    return launch
