"""gpt-oss's clamped SwiGLU on interleaved gate/up columns, forward and backward, each one elementwise Triton pass:
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
from detkit.kernels.det_gemm.launch import fp32_to_bf16_rtne

BLOCK_R = 16
BLOCK_C = 128
INTERPRETER_BLOCKS = (8, 32)


@triton.jit
def _bf16(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        return fp32_to_bf16_rtne(x)
    return x.to(tl.bfloat16)


@triton.jit
def clamped_swiglu_fwd_kernel(x_ptr, out_ptr, rows, cols, stride_x, stride_o, alpha, limit,
                              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < rows)[:, None] & (c < cols)[None, :]
    x_row = x_ptr + r.to(tl.int64)[:, None] * stride_x
    gate = tl.load(x_row + 2 * c[None, :], mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_row + 2 * c[None, :] + 1, mask=ok, other=0.0).to(tl.float32)
    g = tl.minimum(gate, limit)
    u = tl.minimum(tl.maximum(up, -limit), limit)
    s = 1.0 / (1.0 + tl.exp(-(alpha * g)))
    out = (u + 1.0) * (g * s)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + c[None, :], _bf16(out, INTERPRETED), mask=ok)


@triton.jit
def clamped_swiglu_bwd_kernel(x_ptr, dout_ptr, dx_ptr, rows, cols, stride_x, stride_d, stride_dx, alpha, limit,
                              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < rows)[:, None] & (c < cols)[None, :]
    x_row = x_ptr + r.to(tl.int64)[:, None] * stride_x
    gate = tl.load(x_row + 2 * c[None, :], mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_row + 2 * c[None, :] + 1, mask=ok, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + r.to(tl.int64)[:, None] * stride_d + c[None, :], mask=ok, other=0.0).to(tl.float32)
    g = tl.minimum(gate, limit)
    u = tl.minimum(tl.maximum(up, -limit), limit)
    s = 1.0 / (1.0 + tl.exp(-(alpha * g)))
    dgate = tl.where(gate <= limit, dout * (u + 1.0) * s * (1.0 + alpha * g * (1.0 - s)), 0.0)
    dup = tl.where((up >= -limit) & (up <= limit), dout * (g * s), 0.0)
    dx_row = dx_ptr + r.to(tl.int64)[:, None] * stride_dx
    tl.store(dx_row + 2 * c[None, :], _bf16(dgate, INTERPRETED), mask=ok)
    tl.store(dx_row + 2 * c[None, :] + 1, _bf16(dup, INTERPRETED), mask=ok)


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
