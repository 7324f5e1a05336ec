"""Batch-invariant row reductions for the batch-invariant mode: the mean over the last dim (RMSNorm's
variance, ``x.pow(2).mean(-1, keepdim=True)``).

Why this one: torch's CUDA reduction picks its thread-block shape from the number of outputs as well
as the row length (``setReduceConfig``: block height grows with the row count up to 16, the block
width shrinks to match, and few outputs may split a row across blocks), so the order in which a
row's elements are added -- and its bits -- change between a decode step of one token (one row per
sequence) and the trainer's forward over thousands of rows. torch's CUDA softmax and log_softmax over
the last dim run one row per block or warp with a launch shape chosen from the row length alone,
so they are batch-invariant and the mode leaves them on torch (docs/mode.md).

Math (``row_mean_kernel``): each program owns ``BLOCK_R`` rows; for every row it adds the FP32 values
of ``BLOCK_H``-wide column chunks into a ``[BLOCK_R, BLOCK_H]`` FP32 accumulator in ascending chunk
order, then sums the accumulator's columns (one fixed tree for a given ``BLOCK_H``) and divides by
``H``; BF16 results are rounded once, to nearest-even. ``BLOCK_H`` is a function of ``H`` alone and
``BLOCK_R`` is a constant, so a row's operations do not depend on how many rows there are or where
it sits: batch-invariant and run-to-run deterministic. On the GPU ``BLOCK_R`` is 1 (no row ever
shares a program, so no layout question about which row slot it lands in); under the interpreter it
is 16 (numpy sums each row of the tile on its own) to keep CPU runs short.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detkit.kernels.backend import TRITON_INTERPRETER, resolve_backend
from detkit.kernels.det_gemm import fp32_to_bf16_rtne

MAX_BLOCK_H = 1024
DTYPES = (torch.float32, torch.bfloat16)


def block_h(h: int) -> int:
    """The column chunk for rows of ``h`` elements (a function of h only)."""
    return min(MAX_BLOCK_H, triton.next_power_of_2(h))


@triton.jit
def row_mean_kernel(x_ptr, out_ptr, R, H, stride_xr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                    OUT_BF16: tl.constexpr, INTERPRETED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_mask = rows < R
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)  # [BLOCK_H]
        offs = rows[:, None].to(tl.int64) * stride_xr + cols[None, :]  # [BLOCK_R, BLOCK_H]
        x = tl.load(x_ptr + offs, mask=row_mask[:, None] & (cols < H)[None, :], other=0.0)
        acc += x.to(tl.float32)
    mean = tl.sum(acc, axis=1) / H  # [BLOCK_R]
    if OUT_BF16:
        if INTERPRETED:
            out = fp32_to_bf16_rtne(mean)
        else:
            out = mean.to(tl.bfloat16)
    else:
        out = mean
    tl.store(out_ptr + rows, out, mask=row_mask)


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean of each row of ``x`` [R, H] (last dim contiguous) -> [R], in x's dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; supported: {DTYPES}")
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] < 1 or x.stride(1) != 1:
        raise ValueError(f"x must be a non-empty [R, H] tensor with a contiguous last dim; got shape "
                         f"{tuple(x.shape)}, strides {x.stride()}")
    backend = resolve_backend(row_mean_kernel, {"x": x})
    interpreted = backend == TRITON_INTERPRETER
    rows, h = x.shape
    block_r = 16 if interpreted else 1
    out = torch.empty(rows, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, block_r),)
    row_mean_kernel[grid](x, out, rows, h, x.stride(0), BLOCK_R=block_r, BLOCK_H=block_h(h),
                          OUT_BF16=x.dtype == torch.bfloat16, INTERPRETED=interpreted, num_warps=4)
    return out


def row_mean_ref(x: torch.Tensor) -> torch.Tensor:
    """FP64 mean of each row (the reference for tests)."""
    return x.double().mean(dim=-1)


def last_dim_reason(x: torch.Tensor, dim, keepdim: bool, dtype) -> str | None:
    """None when ``x.mean(dim, keepdim, dtype=dtype)`` is a mean over the last dim that ``row_mean`` runs."""
    if x.dtype not in DTYPES:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if dtype is not None and dtype != x.dtype:
        return f"output dtype {dtype} differs from the input's {x.dtype}"
    dims = [dim] if isinstance(dim, int) else list(dim or [])
    if x.dim() == 0 or [d % x.dim() for d in dims] != [x.dim() - 1]:
        return f"reduces dims {dims} of a {x.dim()}-D tensor (supported: the last dim only)"
    if x.numel() == 0:
        return "empty tensor"
    if x.stride(-1) != 1:
        return "last dim not contiguous"
    return None
