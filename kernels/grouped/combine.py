"""The grouped path's token <-> route traffic in one pass each (detkit/mode/experts.py): the top-k combine of the
experts' outputs back into token order, its backward, and the backward of the gather that fed the experts.

Routes are the T x K (token, slot) pairs, stored sorted by expert; ``inverse[t, k]`` is the sorted row of route
(t, k) (a permutation: every row belongs to one route). In FP32, ascending k, each product and each sum rounded on its
own (no fused multiply-add: the launches pass ``enable_fp_fusion=False``), which is what torch's elementwise ops compute
in the unfused form of the same math (``fixed_order_combine`` and ``GatherRoutes``), so the bits are those:

    combine          out[t, :] = bf16(((w[t, 0] * y[i0]) + w[t, 1] * y[i1]) + ...)      i_k = inverse[t, k]
    combine backward dy[i_k, :] = bf16(w[t, k] * dout[t, :])
                     dw[t, k] = sum_h dout[t, h] * y[i_k, h]  (FP32; BLOCK_H-wide chunks in ascending order, each
                                chunk's products summed by one fixed tree: a function of H alone)
    gather backward  dx[t, :] = bf16((d[i0] + d[i1]) + ...)

Each token's outputs depend on its own K rows alone: batch-invariant and run-to-run deterministic (no atomics; each
sorted row is written by the one token that owns it). The pure-torch references are ``reference.route_combine_ref``,
``reference.route_combine_bwd_ref`` and ``reference.route_sum_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detkit.kernels.backend import TRITON_INTERPRETER, PlannedKernel, resolve_backend_of_devices
from detkit.kernels.det_gemm.kernels import to_bf16

BLOCK_T = 4  # tokens per program
BLOCK_H = 256  # hidden columns per step
INTERPRETER_BLOCK_H = 32
OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


@triton.jit
def route_combine_kernel(y_ptr, inverse_ptr, w_ptr, out_ptr, T, H, stride_y, stride_i, stride_w, stride_o,
                         K: tl.constexpr, SCALED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                         INTERPRETED: tl.constexpr):
    """out[t] = bf16(sum_{k ascending} (w[t, k] *) y[inverse[t, k]]); SCALED False: the gather's backward."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < T
    ok = t_ok[:, None] & (h < H)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(inverse_ptr + t.to(tl.int64) * stride_i + k, mask=t_ok, other=0).to(tl.int64)
        v = tl.load(y_ptr + row[:, None] * stride_y + h[None, :], mask=ok, other=0.0).to(tl.float32)
        if SCALED:
            v = tl.load(w_ptr + t.to(tl.int64) * stride_w + k, mask=t_ok, other=0.0).to(tl.float32)[:, None] * v
        if k == 0:
            acc = v
        else:
            acc = acc + v
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_o + h[None, :], to_bf16(acc, INTERPRETED), mask=ok)


@triton.jit
def route_combine_bwd_kernel(dout_ptr, y_ptr, inverse_ptr, w_ptr, dy_ptr, dw_ptr, T, H, stride_d, stride_y, stride_i,
                             stride_w, stride_dy, stride_dw, K: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_H: tl.constexpr, INTERPRETED: tl.constexpr):
    """Per program BLOCK_T tokens over all of H: dy rows (one rounding) and dw (FP32, chunks ascending)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t64 = t.to(tl.int64)
    for k in tl.static_range(K):
        row = tl.load(inverse_ptr + t64 * stride_i + k, mask=t_ok, other=0).to(tl.int64)
        w = tl.load(w_ptr + t64 * stride_w + k, mask=t_ok, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_T], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            ok = t_ok[:, None] & (h < H)[None, :]
            d = tl.load(dout_ptr + t64[:, None] * stride_d + h[None, :], mask=ok, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + row[:, None] * stride_y + h[None, :], mask=ok, other=0.0).to(tl.float32)
            tl.store(dy_ptr + row[:, None] * stride_dy + h[None, :], to_bf16(w[:, None] * d, INTERPRETED), mask=ok)
            dw = dw + tl.sum(d * y, axis=1)
        tl.store(dw_ptr + t64 * stride_dw + k, dw, mask=t_ok)


_COMBINE = PlannedKernel(route_combine_kernel)
_COMBINE_BWD = PlannedKernel(route_combine_bwd_kernel)


def _blocks(device: torch.device) -> tuple[bool, int]:
    interpreted = resolve_backend_of_devices(route_combine_kernel, {"y": device}) == TRITON_INTERPRETER
    return interpreted, INTERPRETER_BLOCK_H if interpreted else BLOCK_H


def _check(y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor | None) -> None:
    if y.dtype != torch.bfloat16 or y.dim() != 2 or y.stride(1) != 1:
        raise ValueError(f"y must be a bfloat16 [S, H] tensor with a contiguous last dim; got {y.dtype} "
                         f"{tuple(y.shape)} strides {y.stride()}")
    if inverse.dtype not in (torch.int32, torch.int64) or inverse.dim() != 2 or inverse.stride(1) != 1 \
            or inverse.numel() != y.shape[0] or inverse.device != y.device:
        raise ValueError(f"inverse must be an integer [T, K] tensor (T * K = {y.shape[0]} rows of y) with a "
                         f"contiguous last dim on {y.device}; got {inverse.dtype} {tuple(inverse.shape)} on "
                         f"{inverse.device}")
    if weights is not None and (weights.shape != inverse.shape or weights.device != y.device
                                or weights.dtype not in (torch.bfloat16, torch.float32) or weights.stride(1) != 1):
        raise ValueError(f"weights must be a bfloat16 or float32 {tuple(inverse.shape)} tensor with a contiguous last "
                         f"dim on {y.device}; got {weights.dtype} {tuple(weights.shape)} on {weights.device}")


def _combine(y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    _check(y, inverse, weights)
    tokens, top_k = inverse.shape
    hidden = y.shape[1]
    out = torch.empty((tokens, hidden), dtype=torch.bfloat16, device=y.device)
    if tokens and hidden:
        interpreted, block_h = _blocks(y.device)
        w = weights if weights is not None else inverse  # never read unscaled
        _COMBINE[(triton.cdiv(tokens, BLOCK_T), triton.cdiv(hidden, block_h))](
            y, inverse, w, out, tokens, hidden, y.stride(0), inverse.stride(0), w.stride(0), out.stride(0), K=top_k,
            SCALED=weights is not None, BLOCK_T=BLOCK_T, BLOCK_H=block_h, INTERPRETED=interpreted, **OPTIONS)
    return out


def route_sum(d: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """dx [T, H] bf16 = bf16(sum_{k ascending} d[inverse[t, k]]) (FP32): the backward of gathering token rows into
    their routes' sorted rows."""
    return _combine(d, inverse, None)


def route_combine_bwd(dout: torch.Tensor, y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy [S, H] bf16 in y's sorted rows, dw [T, K] in weights' dtype) of ``route_combine`` (the module docstring)."""
    _check(y, inverse, weights)
    tokens, top_k = inverse.shape
    hidden = y.shape[1]
    if dout.dtype != torch.bfloat16 or tuple(dout.shape) != (tokens, hidden) or dout.device != y.device:
        raise ValueError(f"dout must be bfloat16 [{tokens}, {hidden}] on {y.device}; got {dout.dtype} "
                         f"{tuple(dout.shape)} on {dout.device}")
    dout = dout if dout.stride(1) == 1 else dout.contiguous()
    dy = torch.empty_like(y, memory_format=torch.contiguous_format)
    dw = torch.empty((tokens, top_k), dtype=torch.float32, device=y.device)
    if tokens and hidden:
        interpreted, block_h = _blocks(y.device)
        _COMBINE_BWD[(triton.cdiv(tokens, BLOCK_T),)](
            dout, y, inverse, weights, dy, dw, tokens, hidden, dout.stride(0), y.stride(0), inverse.stride(0),
            weights.stride(0), dy.stride(0), dw.stride(0), K=top_k, BLOCK_T=BLOCK_T, BLOCK_H=block_h,
            INTERPRETED=interpreted, **OPTIONS)
    elif tokens:
        dw.zero_()
    return dy, dw.to(weights.dtype)


class RouteCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, inverse, weights):
        ctx.save_for_backward(y, inverse, weights)
        return _combine(y, inverse, weights)

    @staticmethod
    def backward(ctx, dout):
        y, inverse, weights = ctx.saved_tensors
        dy, dw = route_combine_bwd(dout, y, inverse, weights)
        return dy, None, dw


def route_combine(y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out [T, H] bf16 = bf16(sum_{k ascending} w[t, k] * y[inverse[t, k]]) (FP32), with autograd (y, weights)."""
    return RouteCombine.apply(y, inverse, weights)
