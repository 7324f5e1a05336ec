"""A fused RMSNorm forward with the bits of transformers' RMSNorm under detkit mode: one launch where the module's
own forward runs eight (the FP32 copy, the square, the row mean, ``+ eps``, ``rsqrt``, the product, the cast and the
weight's product), which is most of a decode step's host time in eager mode.

Math (``rms_norm_kernel``), per row of ``H`` elements, each step what the module's op does and rounds:
- the mean of the squares exactly as ``row_mean`` forms it over ``x.float().pow(2)``: FP32 squares (one rounding
  each: the kernel compiles without FP contraction, so no square is fused into the running sum), added into the
  ``BLOCK_H``-wide accumulator chunk by chunk, summed by ``pairwise_row_sum``, divided by ``H``;
- ``normed = x * rsqrt(mean + eps)`` in FP32;
- then the style's last op (``STYLES``): "llama" ``weight * normed.to(x.dtype)`` (the product of two values of x's
  dtype, formed in FP32 and rounded once, as torch's elementwise kernels do), "weight_first"
  ``(weight * normed).to(x.dtype)`` (OLMo-2, gpt-oss), "one_plus_weight" ``(normed * (1 + weight.float()))
  .to(x.dtype)`` (Gemma).
So where torch's ``rsqrt`` and the kernel's agree (the same MUFU instruction on sm_90; on the CPU both correctly
rounded), the output equals the module's forward under the mode bit for bit; tests check it on the interpreter and
on the GPU. Rows are independent and their operations do not depend on the row count: batch-invariant.

Rows need not view as one row dim: up to three leading dims (a 4-D input, e.g. Gemma-3's q/k norms over a [B, H, S,
D] transpose) are addressed through their own strides, for the input and the output each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detkit.kernels.backend import TRITON_INTERPRETER, DirectLaunch, resolve_backend_of_devices
from detkit.kernels.det_gemm.kernels import to_bf16
from detkit.kernels.reductions.row_mean import block_h, lead_dims, pairwise_row_sum

STYLES = ("llama", "weight_first", "one_plus_weight")
DTYPES = (torch.float32, torch.bfloat16)
MAX_DIMS = 4  # three leading dims and the normalized one


@triton.jit
def _round_to(y, OUT_BF16: tl.constexpr, INTERPRETED: tl.constexpr):
    """FP32 -> the output dtype, nearest-even (BF16) or as is (FP32)."""
    if OUT_BF16:
        out = to_bf16(y, INTERPRETED)
    else:
        out = y
    return out


@triton.jit
def _row_offsets(rows, D1, D2, s0, s1, s2, ONE_STRIDE: tl.constexpr):
    """Each row's first element: row r is (r // (D1 * D2), (r // D2) % D1, r % D2) of the leading dims, or r * s0
    when they view as one row dim."""
    r64 = rows.to(tl.int64)
    if ONE_STRIDE:
        return r64 * s0
    return (r64 // (D1 * D2)) * s0 + ((r64 // D2) % D1) * s1 + (r64 % D2) * s2


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, R, H, D1, D2, sx0, sx1, sx2, so0, so1, so2, eps,
                    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, LOG2_BLOCK_H: tl.constexpr, STYLE: tl.constexpr,
                    X_BF16: tl.constexpr, INTERPRETED: tl.constexpr, ONE_STRIDE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_mask = rows < R
    x_rows = _row_offsets(rows, D1, D2, sx0, sx1, sx2, ONE_STRIDE)
    out_rows = _row_offsets(rows, D1, D2, so0, so1, so2, ONE_STRIDE)
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = row_mask[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += x * x
    mean = pairwise_row_sum(acc, LOG2_BLOCK_H) / H  # row_mean's value, bit for bit
    inv = tl.rsqrt(mean + eps)[:, None]
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = row_mask[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
        normed = x * inv
        if STYLE == 0:  # llama: weight * normed.to(x.dtype), one rounding of the FP32 product
            y = w * _round_to(normed, X_BF16, INTERPRETED).to(tl.float32)
        elif STYLE == 1:  # weight_first: (weight * normed).to(x.dtype)
            y = w * normed
        else:  # one_plus_weight: (normed * (1 + weight.float())).to(x.dtype)
            y = normed * (1.0 + w)
        tl.store(out_ptr + out_rows[:, None] + cols[None, :], _round_to(y, X_BF16, INTERPRETED), mask=mask)


def rms_norm_reason(x: torch.Tensor, weight: torch.Tensor, style: str) -> str | None:
    """None when ``rms_norm`` takes (x, weight, style); else why not (one line)."""
    if style not in STYLES:
        return f"style {style!r} (supported: {', '.join(STYLES)})"
    if x.dtype not in DTYPES:
        return f"input dtype {x.dtype} (supported: {DTYPES})"
    if weight.dtype not in DTYPES or (style == "llama" and weight.dtype != x.dtype):
        return (f"weight dtype {weight.dtype} with input dtype {x.dtype} (supported: {DTYPES}, the input's for "
                "style 'llama')")
    if not 1 <= x.dim() <= MAX_DIMS or x.numel() == 0:
        return f"input shape {tuple(x.shape)} (supported: 1 to {MAX_DIMS} dims, not empty)"
    if x.stride(-1) != 1:
        return f"input strides {x.stride()} (supported: a contiguous last dim)"
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or weight.stride(0) != 1:
        return f"weight shape {tuple(weight.shape)} (supported: [{x.shape[-1]}], contiguous)"
    if weight.device != x.device:
        return f"weight on {weight.device}, input on {x.device}"
    return None


def _lead(t: torch.Tensor) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The leading dims of t as three (sizes, strides), size-1 dims in front."""
    pad = 1 + MAX_DIMS - t.dim()
    sizes = (1,) * pad + tuple(t.shape[:-1])
    strides = (0,) * pad + tuple(t.stride()[:-1])
    return sizes[-3:], strides[-3:]


def _one_stride(t: torch.Tensor) -> int | None:
    """The one row stride of t's leading dims, where they view as one row dim (``lead_dims``: one group); else
    None."""
    groups = lead_dims(tuple(t.shape), t.stride())
    return groups[0][1] if len(groups) == 1 else None


def rms_norm_launcher(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str):
    """``launch(x, weight) -> out`` for tensors of x's and weight's signature (dtype, device, shape, strides), whose
    ``rms_norm_reason`` is None (checked by the caller): out is new, with x's strides where x is dense (as
    ``torch.empty_like``, and the module's elementwise ops, give it)."""
    backend = resolve_backend_of_devices(rms_norm_kernel, {"x": x.device})
    interpreted = backend == TRITON_INTERPRETER
    h = x.shape[-1]
    rows = x.numel() // h
    block_r = 16 if interpreted else 1
    grid = (triton.cdiv(rows, block_r),)
    out_example = torch.empty_like(x)  # strides only: the launch allocates its own
    (_, d1, d2), x_strides = _lead(x)
    _, out_strides = _lead(out_example)
    x_one, out_one = _one_stride(x), _one_stride(out_example)
    one = x_one is not None and out_one is not None
    if one:
        x_strides, out_strides = (x_one, 0, 0), (out_one, 0, 0)
    chunk = block_h(h)
    values = dict(R=rows, H=h, D1=d1, D2=d2, sx0=x_strides[0], sx1=x_strides[1], sx2=x_strides[2],
                  so0=out_strides[0], so1=out_strides[1], so2=out_strides[2], eps=float(eps), BLOCK_R=block_r,
                  BLOCK_H=chunk, LOG2_BLOCK_H=chunk.bit_length() - 1, STYLE=STYLES.index(style),
                  X_BF16=x.dtype == torch.bfloat16, INTERPRETED=interpreted, ONE_STRIDE=one)
    shape, stride, dtype, device = tuple(x.shape), out_example.stride(), x.dtype, x.device
    if interpreted:
        def launch(x, weight):
            out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            rms_norm_kernel[grid](x, weight, out, **values, num_warps=4)
            return out
        return launch
    names = list(rms_norm_kernel.arg_names)
    template = [values.get(name) for name in names]
    i_x, i_w, i_out = names.index("x_ptr"), names.index("w_ptr"), names.index("out_ptr")
    # No FP contraction: each square is rounded before it joins the sum, as the module's pow does. Triton
    # specializes pointers on 16-byte alignment: one launch per (x, weight) alignment (out is always aligned).
    options = {"num_warps": 4, "enable_fp_fusion": False}
    launches = {}

    def launch(x, weight):
        out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        args = template.copy()
        args[i_x], args[i_w], args[i_out] = x, weight, out
        key = (x.data_ptr() & 15 == 0, weight.data_ptr() & 15 == 0)
        run = launches.get(key)
        if run is None:
            run = launches[key] = DirectLaunch(rms_norm_kernel, grid, options, device)
        run(args)
        return out
    return launch


MAX_PLANS = 1024  # launch plans remembered; past it the table starts over
_PLANS: dict[tuple, object] = {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str = "llama") -> torch.Tensor:
    """transformers' RMSNorm forward of ``style`` over the last dim of ``x`` (1-4 dims, last dim contiguous) with
    ``weight`` [H]: a new tensor of x's shape and dtype. The checks run once per signature."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"x and weight must be torch.Tensors; got {type(x).__name__}, {type(weight).__name__}")
    key = (style, float(eps), x.dtype, weight.dtype, x.device, weight.device, x.shape, x.stride(), weight.shape,
           weight.stride())
    launch = _PLANS.get(key)
    if launch is None:
        reason = rms_norm_reason(x, weight, style)
        if reason is not None:
            raise ValueError(f"rms_norm does not take {reason}")
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        launch = _PLANS[key] = rms_norm_launcher(x, weight, eps, style)
    return launch(x, weight)
