"""Elementwise steps of the grouped path (detkit/mode/experts.py), one Triton pass each.

``add_expert_bias``: out[r, :] += bias[ids[r], :] in place, BF16 + BF16 rounded once (torch's ``out.add_(bias[ids])``,
bit for bit, without materialising the gathered [R, N] bias).

gpt-oss's clamped SwiGLU on interleaved gate/up columns, forward and backward, each one elementwise Triton pass:
what the grouped path (detkit/mode/experts.py) runs between the two grouped GEMMs of a ``GptOssExperts`` in place of
transformers' ``_apply_gate`` (six elementwise torch ops forward, and autograd's backward of each, with two strided
slices whose backward allocates zeros of the full width).

Math, per row r and column c of the output (gate = x[r, 2c], up = x[r, 2c + 1], BF16 in, FP32 throughout, one BF16
rounding of each output):

    g = min(gate, limit), u = clamp(up, -limit, limit), s = sigmoid(alpha * g)
    out[r, c] = (u + 1) * g * s
    dgate = dout * (u + 1) * s * (1 + alpha * g * (1 - s))    where gate <= limit, else 0
    dup   = dout * g * s                                      where -limit <= up <= limit, else 0

(torch's clamp passes the gradient where the input lies in [min, max], bounds included.) transformers rounds each
intermediate to BF16; here nothing is rounded until the output, so the result is at least as close to the exact
function. Every element depends on its own inputs alone: batch-invariant and run-to-run deterministic by construction.
The pure-torch reference is ``reference.clamped_swiglu_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detkit.kernels.backend import TRITON_INTERPRETER, PlannedKernel, resolve_backend_of_devices
from detkit.kernels.det_gemm.kernels import to_bf16

BLOCK_R = 16
BLOCK_C = 128
INTERPRETER_BLOCKS = (8, 32)


@triton.jit
def _load_pairs(x_ptr, r, stride_x, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(gate, up) FP32 [BLOCK_R, BLOCK_C] of rows r, pairs from column tile program_id(1): one contiguous load of
    2 * BLOCK_C columns per row, split in registers."""
    cc = tl.program_id(1) * 2 * BLOCK_C + tl.arange(0, 2 * BLOCK_C)
    x = tl.load(x_ptr + r.to(tl.int64)[:, None] * stride_x + cc[None, :],
                mask=(r < rows)[:, None] & (cc < 2 * cols)[None, :], other=0.0).to(tl.float32)
    return tl.split(tl.reshape(x, [BLOCK_R, BLOCK_C, 2]))


@triton.jit
def clamped_swiglu_fwd_kernel(x_ptr, out_ptr, rows, cols, stride_x, stride_o, alpha, limit,
                              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < rows)[:, None] & (c < cols)[None, :]
    gate, up = _load_pairs(x_ptr, r, stride_x, rows, cols, BLOCK_R, BLOCK_C)
    g = tl.minimum(gate, limit)
    u = tl.minimum(tl.maximum(up, -limit), limit)
    s = 1.0 / (1.0 + tl.exp(-(alpha * g)))
    out = (u + 1.0) * (g * s)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + c[None, :], to_bf16(out, INTERPRETED), mask=ok)


@triton.jit
def clamped_swiglu_bwd_kernel(x_ptr, dout_ptr, dx_ptr, rows, cols, stride_x, stride_d, stride_dx, alpha, limit,
                              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < rows)[:, None] & (c < cols)[None, :]
    gate, up = _load_pairs(x_ptr, r, stride_x, rows, cols, BLOCK_R, BLOCK_C)
    dout = tl.load(dout_ptr + r.to(tl.int64)[:, None] * stride_d + c[None, :], mask=ok, other=0.0).to(tl.float32)
    g = tl.minimum(gate, limit)
    u = tl.minimum(tl.maximum(up, -limit), limit)
    s = 1.0 / (1.0 + tl.exp(-(alpha * g)))
    dgate = tl.where(gate <= limit, dout * (u + 1.0) * s * (1.0 + alpha * g * (1.0 - s)), 0.0)
    dup = tl.where((up >= -limit) & (up <= limit), dout * (g * s), 0.0)
    # the pairs interleaved back in registers: one contiguous store of 2 * BLOCK_C columns per row
    pairs = tl.reshape(tl.join(to_bf16(dgate, INTERPRETED), to_bf16(dup, INTERPRETED)), [BLOCK_R, 2 * BLOCK_C])
    cc = tl.program_id(1) * 2 * BLOCK_C + tl.arange(0, 2 * BLOCK_C)
    tl.store(dx_ptr + r.to(tl.int64)[:, None] * stride_dx + cc[None, :], pairs,
             mask=(r < rows)[:, None] & (cc < 2 * cols)[None, :])


@triton.jit
def add_expert_bias_kernel(out_ptr, bias_ptr, ids_ptr, rows, cols, stride_o, stride_b,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok = r < rows
    ok = r_ok[:, None] & (c < cols)[None, :]
    expert = tl.load(ids_ptr + r, mask=r_ok, other=0).to(tl.int64)
    at = out_ptr + r.to(tl.int64)[:, None] * stride_o + c[None, :]
    total = tl.load(at, mask=ok, other=0.0).to(tl.float32) + tl.load(
        bias_ptr + expert[:, None] * stride_b + c[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(at, to_bf16(total, INTERPRETED), mask=ok)


_BIAS = PlannedKernel(add_expert_bias_kernel)
_FWD = PlannedKernel(clamped_swiglu_fwd_kernel)
_BWD = PlannedKernel(clamped_swiglu_bwd_kernel)


def _check(x: torch.Tensor, alpha, limit) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % 2:
        what = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"clamped_swiglu takes a bfloat16 [R, 2I] tensor of interleaved gate/up columns; got {what}")
    if x.stride(1) != 1:
        raise ValueError(f"clamped_swiglu needs x's last dim contiguous; got strides {x.stride()}")
    for name, value in (("alpha", alpha), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value == value:
            raise ValueError(f"clamped_swiglu's {name} must be a real number; got {value!r}")


def _grid_blocks(backend: str) -> tuple[int, int]:
    return INTERPRETER_BLOCKS if backend == TRITON_INTERPRETER else (BLOCK_R, BLOCK_C)


def clamped_swiglu_fwd(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[R, 2I] bf16 interleaved gate/up -> [R, I] bf16 (the module docstring's ``out``)."""
    _check(x, alpha, limit)
    backend = resolve_backend_of_devices(clamped_swiglu_fwd_kernel, {"x": x.device})
    rows, cols = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, cols), dtype=torch.bfloat16, device=x.device)
    if rows and cols:
        block_r, block_c = _grid_blocks(backend)
        _FWD[(triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))](
            x, out, rows, cols, x.stride(0), out.stride(0), float(alpha), float(limit), BLOCK_R=block_r,
            BLOCK_C=block_c, INTERPRETED=backend == TRITON_INTERPRETER, num_warps=4)
    return out


def clamped_swiglu_bwd(x: torch.Tensor, dout: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """dx [R, 2I] bf16 (interleaved dgate/dup) from x [R, 2I] and dout [R, I] (the module docstring)."""
    _check(x, alpha, limit)
    rows, cols = x.shape[0], x.shape[1] // 2
    if dout.dtype != torch.bfloat16 or tuple(dout.shape) != (rows, cols) or dout.device != x.device:
        raise ValueError(f"clamped_swiglu's dout must be bfloat16 [{rows}, {cols}] on {x.device}; got {dout.dtype} "
                         f"{tuple(dout.shape)} on {dout.device}")
    dout = dout if dout.stride(1) == 1 else dout.contiguous()
    backend = resolve_backend_of_devices(clamped_swiglu_bwd_kernel, {"x": x.device})
    dx = torch.empty((rows, 2 * cols), dtype=torch.bfloat16, device=x.device)
    if rows and cols:
        block_r, block_c = _grid_blocks(backend)
        _BWD[(triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))](
            x, dout, dx, rows, cols, x.stride(0), dout.stride(0), dx.stride(0), float(alpha), float(limit),
            BLOCK_R=block_r, BLOCK_C=block_c, INTERPRETED=backend == TRITON_INTERPRETER, num_warps=4)
    return dx


def add_expert_bias(out: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """out [R, N] bf16 += bias [E, N] bf16 at each row's expert ``ids`` [R] (in range), in place; returns out."""
    if out.dtype != torch.bfloat16 or out.dim() != 2 or out.stride(1) != 1:
        raise ValueError(f"out must be a bfloat16 [R, N] tensor with a contiguous last dim; got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    rows, cols = out.shape
    if bias.dtype != torch.bfloat16 or bias.dim() != 2 or bias.shape[1] != cols or bias.stride(1) != 1 \
            or bias.device != out.device:
        raise ValueError(f"bias must be a bfloat16 [E, {cols}] tensor with a contiguous last dim on {out.device}; got "
                         f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")
    if ids.dtype not in (torch.int32, torch.int64) or tuple(ids.shape) != (rows,) or ids.device != out.device:
        raise ValueError(f"ids must be an integer [{rows}] tensor on {out.device}; got {ids.dtype} "
                         f"{tuple(ids.shape)} on {ids.device}")
    ids = ids if ids.stride(0) == 1 else ids.contiguous()
    backend = resolve_backend_of_devices(add_expert_bias_kernel, {"out": out.device})
    if rows and cols:
        block_r, block_c = _grid_blocks(backend)
        _BIAS[(triton.cdiv(rows, block_r), triton.cdiv(cols, block_c))](
            out, bias, ids, rows, cols, out.stride(0), bias.stride(0), BLOCK_R=block_r, BLOCK_C=block_c,
            INTERPRETED=backend == TRITON_INTERPRETER, num_warps=4)
    return out


class ClampedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha, limit):
        ctx.save_for_backward(x)
        ctx.alpha, ctx.limit = alpha, limit
        return clamped_swiglu_fwd(x, alpha, limit)

    @staticmethod
    def backward(ctx, dout):
        (x,) = ctx.saved_tensors
        return clamped_swiglu_bwd(x, dout, ctx.alpha, ctx.limit), None, None


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's ``_apply_gate`` on x [R, 2I] bf16 (interleaved gate/up) -> [R, I] bf16, with autograd."""
    return ClampedSwiGLU.apply(x, alpha, limit)
