"""Triton building blocks of the MoE grouped GEMMs, shared by the BF16 kernels (kernels/moe/kernels.py) and the FP8
kernels (kernels/moe/fp8/kernels.py): the FP32 MMA step of both backends (the BF16 rounding is det_gemm's
``to_bf16``), the routing gate that lets a GEMM be queued before the host has read the routing, the tile a program
owns over expert-sorted rows (in the grouped order of kernels/moe/tile_order.py), and the epilogues (C stored
rounded once, SwiGLU, dSwiGLU) both precisions apply to their FP32 accumulator.

On the Triton interpreter (CPU): exact FP32 products added one at a time in ascending order (``tl.dot`` on BF16 is
broken there) and FP32 -> BF16 rounding in integer arithmetic (``fp32_to_bf16_rtne``; the interpreter's cast
truncates), as det_gemm does."""

from __future__ import annotations

import triton
import triton.language as tl

from detkit.kernels.det_gemm.kernels import to_bf16
from detkit.kernels.moe.tile_order import tile_order_tl


@triton.jit
def mma_step(acc, a, b, STEP_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc [M, N] += a [M, STEP_K] @ b [STEP_K, N] with FP32 accumulation, ascending over STEP_K.

    Interpreted: exact products added one at a time (cumsum is sequential there), as det_gemm does."""
    if INTERPRETED:
        offs = tl.arange(0, STEP_K)
        prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]  # [M, STEP_K, N]
        prod = tl.where((offs == 0)[None, :, None], prod + acc[:, None, :], prod)
        acc = tl.sum(tl.where((offs == STEP_K - 1)[None, :, None], tl.cumsum(prod, axis=1), 0.0), axis=1)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _sigmoid(g):
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def program_tile(P, C, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program's tile of a grouped GEMM over P expert-sorted rows (the grid's bound) and C
    columns, in the grouped order (kernels/moe/tile_order.py): which program owns a tile, never the tile's math."""
    return tile_order_tl(tl.program_id(axis=0), tl.cdiv(P, BLOCK_M), tl.cdiv(C, BLOCK_N), GROUP_M)


@triton.jit
def tile_is_live(gate_ptr, pid_m, BLOCK_M: tl.constexpr):
    """False for a tile at or past the routing's P, and for every tile of a batch the routing checks
    refused (gate: P, then the validation counts). A GEMM queued before the host has read the counts
    runs over the largest possible P; these tiles do nothing, not even a store."""
    return (pid_m * BLOCK_M < tl.load(gate_ptr)) & (refusals(gate_ptr) == 0)


@triton.jit
def refusals(gate_ptr):
    """The routing kernels' validation counts summed (gate: P, then the counts): non-zero for a refused batch."""
    return tl.load(gate_ptr + 1) + tl.load(gate_ptr + 2) + tl.load(gate_ptr + 3)


@triton.jit
def poisoned(v, gate_ptr):
    """``v``, or NaN everywhere when the batch was refused: a refused batch's outputs (the combine's out and dX, the
    dscores, the weight gradients) are NaN, never a silent wrong value (docs/moe.md)."""
    return tl.where(refusals(gate_ptr) > 0, float("nan"), v)


@triton.jit
def dim_offsets(offs, stride, stride_odd, SPLIT: tl.constexpr):
    """Offsets of the indices ``offs`` along a dim of ``stride``; SPLIT: the dim holds gate/up pairs as split halves
    [gate (I) | up (I)] read as interleaved pairs, index n = 2 j + half at j * stride + half * stride_odd (= I
    stride)."""
    if SPLIT:
        return (offs // 2) * stride + (offs % 2) * stride_odd
    return offs * stride


@triton.jit
def store_wgrad_tile(dw_ptr, acc, expert, count, gate_ptr, offs_r, offs_c, r_ok, c_ok, stride_we, stride_wr, stride_wc,
                     stride_wc_odd, ACCUMULATE: tl.constexpr, INTERPRETED: tl.constexpr, SPLIT_C: tl.constexpr):
    """A weight-gradient tile of dW[expert] (BF16 and FP8 Triton kernels): BF16, or ACCUMULATE: main_grad += acc in
    FP32, untouched for an expert without rows; NaN (stored, or added) for a refused batch. SPLIT_C: dW's columns are
    split gate/up halves (``dim_offsets``)."""
    w_ptrs = (dw_ptr + expert * stride_we + offs_r[:, None] * stride_wr
              + dim_offsets(offs_c, stride_wc, stride_wc_odd, SPLIT_C)[None, :])
    w_mask = r_ok[:, None] & c_ok[None, :]
    acc = poisoned(acc, gate_ptr)
    if ACCUMULATE:
        w_mask = w_mask & ((count > 0) | (refusals(gate_ptr) > 0))
        tl.store(w_ptrs, tl.load(w_ptrs, mask=w_mask, other=0.0) + acc, mask=w_mask)
    else:
        tl.store(w_ptrs, to_bf16(acc, INTERPRETED), mask=w_mask)


@triton.jit
def grouped_tile(pid_m, pid_n, C, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEGMENT: tl.constexpr,
                 tile_expert_ptr, route_ptr, a_rows_ptr, GATHER_A: tl.constexpr):
    """Tile (pid_m, pid_n) of a grouped GEMM over expert-sorted rows: ``(expert, offs_m, offs_n, row_ok, col_ok,
    a_rows)``. A tile belongs to one expert because BLOCK_M divides SEGMENT; padding rows are ``row_ok`` False."""
    expert = tl.load(tile_expert_ptr + (pid_m * BLOCK_M) // SEGMENT)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # always < P: BLOCK_M divides SEGMENT
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = tl.load(route_ptr + offs_m) >= 0  # padding rows read nothing and stay zero
    col_ok = offs_n < C
    if GATHER_A:
        a_rows = tl.load(a_rows_ptr + offs_m)  # token row of each expert-sorted row
    else:
        a_rows = offs_m
    return expert, offs_m, offs_n, row_ok, col_ok, a_rows


@triton.jit
def store_c_tile(c_ptr, acc, offs_m, offs_n, col_ok, stride_cm, stride_cc, INTERPRETED: tl.constexpr):
    """EPI_PLAIN (y of the down-projection, the per-route dX): the FP32 tile rounded once to BF16 when C is BF16,
    else stored as is."""
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cc  # [BLOCK_M, BLOCK_N]
    if c_ptr.dtype.element_ty == tl.bfloat16:
        acc = to_bf16(acc, INTERPRETED)
    tl.store(c_ptrs, acc, mask=(offs_m[:, None] >= 0) & col_ok[None, :])


@triton.jit
def swiglu_epilogue(acc, c_ptr, h_ptr, offs_m, offs_n, col_ok, pid_n, C, stride_cm, stride_cc, stride_hm, stride_hc,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    """The SwiGLU epilogue: gu rounded to BF16 (saved for the backward), h = silu(g) * u from those BF16
    values in FP32, rounded once and stored. Returns ``(h, offs_h, h_ok)`` for a fused consumer."""
    gu = to_bf16(acc, INTERPRETED)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cc  # [BLOCK_M, BLOCK_N]
    tl.store(c_ptrs, gu, mask=(offs_m[:, None] >= 0) & col_ok[None, :])
    g, u = tl.split(tl.reshape(gu.to(tl.float32), (BLOCK_M, BLOCK_N // 2, 2)))  # [BLOCK_M, BLOCK_N/2] each
    h = to_bf16((g * _sigmoid(g)) * u, INTERPRETED)
    offs_h = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    h_ok = (offs_m[:, None] >= 0) & (offs_h < C // 2)[None, :]
    tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_h[None, :] * stride_hc, h, mask=h_ok)
    return h, offs_h, h_ok


@triton.jit
def dswiglu_epilogue(acc, score_ptr, gu_ptr, c_ptr, offs_m, pid_n, C, stride_gm, stride_gc, stride_cm, stride_cc,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    """The dSwiGLU epilogue: dh = s * acc in FP32, then dg, du from the saved gu, rounded once to BF16 and
    stored interleaved. Returns ``(dgu, offs_j, j_ok)`` for a fused consumer."""
    score = tl.load(score_ptr + offs_m)  # [BLOCK_M] FP32, 0 on padding rows
    dh = acc * score[:, None]
    offs_j = pid_n * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
    j_ok = (offs_m[:, None] >= 0) & (offs_j < 2 * C)[None, :]
    gu_ptrs = gu_ptr + offs_m[:, None] * stride_gm + offs_j[None, :] * stride_gc  # [BLOCK_M, 2*BLOCK_N]
    gu = tl.load(gu_ptrs, mask=j_ok, other=0.0).to(tl.float32)
    g, u = tl.split(tl.reshape(gu, (BLOCK_M, BLOCK_N, 2)))
    s = _sigmoid(g)
    silu = g * s
    # The operation order of kernels/parallel/swiglu.py, so the dense and MoE paths share one formula.
    dg = (dh * u) * (s + silu * (1.0 - s))
    du = dh * silu
    dgu = to_bf16(tl.reshape(tl.join(dg, du), (BLOCK_M, 2 * BLOCK_N)), INTERPRETED)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_j[None, :] * stride_cc, dgu, mask=j_ok)
    return dgu, offs_j, j_ok
