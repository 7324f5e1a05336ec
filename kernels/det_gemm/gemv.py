"""det_gemm's small-M kernel for FP32 "ieee" operands: ``det_gemm_gemv_kernel``, ``C[R, C] = A[R, L] @ B[L, C]`` with
every output element one fused multiply-add chain over L in ascending order from +0.0, written as explicit FMAs
instead of a ``tl.dot``. The launch: kernels/det_gemm/launch.py; its configs: kernels/det_gemm/configs.py
(variants "gemv_row", "gemv_vec", "gemv_tile").

Why it exists: at M <= 16 (an FP32 lm_head at decode) the tile kernels' FMA dot runs a 16-row tile (16x the FMAs of
one row) whose operands pass through shared memory, and reads the weight at a fraction of the DRAM rate. Here a
program owns BLOCK_M rows (a power of two >= the batch at small M) and BLOCK_N output columns, streams its columns
of B once from DRAM, and each thread keeps its outputs' accumulators in registers.

Bits: Triton lowers ``tl.dot(a, b, acc, input_precision="ieee")`` on FP32 operands to, per output element,
``acc = fma(a[k], b[k], acc)`` for k ascending over the dot's K (FMADotUtility), and the tile kernels chain their
K steps through ``acc`` from ``tl.zeros``. This kernel runs the same chain per element, so its bits equal every
tile config's, whatever BLOCK_M, BLOCK_N, BLOCK_K or the loads: a row at M = 1 has the bits it has at M = 17 on the
tile kernels (batch invariance across the table's switch). Masked-off k (past L) add fma(0, 0, acc) = acc: an
accumulator that starts at +0.0 is never -0.0 under round-to-nearest, so the padding changes no bit, as the tile
kernels' zero-padded K does not. Segmented reductions (``seg_len``) add the finished segment to the total at each
boundary, as ``segment_boundary`` does for the tile kernels.

In the interpreter each step is ``acc + a * b`` (the product rounded to FP32, then the sum): the model of the tile
kernels' ``mac_step_fp32`` there, so the CPU tests compare this kernel's bits with theirs.

The loads (``LOADS``: the GemmConfig variant without its "gemv_" prefix), the same math:
- "row": per k, B's row k (one [1, BLOCK_N] load) and A's column k (one element per row). Coalesced when B's columns
  are contiguous; on a K-major B (nn.Linear's ``weight.t()``) each k touches BLOCK_N cache lines that the next k's
  loads hit again in L1.
- "vec": per 4 k's, A as [BLOCK_M, 4] (16 bytes per row) and, on a K-major B, B as [BLOCK_N, 4] (16 bytes per
  column), each split into its 4 columns in registers; on other B layouts B's rows one k at a time, as "row".
- "tile": per BLOCK_K step, A as [BLOCK_M, BLOCK_K] and B as one tile in its storage order ([BLOCK_N, BLOCK_K]
  K-major, else [BLOCK_K, BLOCK_N] transposed in registers), split into columns in registers.
Columns come out of a [rows, W] block by even / odd ``tl.split`` (``column``), which keeps the block's register
order, so its load can be vectorized along the contiguous dim. ``NUM_STAGES`` > 1 asks Triton to pipeline the
loop's loads through shared memory (``tl.range(num_stages=...)``); 1 leaves them to the unrolled step.
"""

from __future__ import annotations

import triton
import triton.language as tl

from detkit.kernels.det_gemm.kernels import segment_boundary, store_tile, tile_of_program
from detkit.kernels.det_gemm.names import _launch_metadata

VEC = tl.constexpr(4)  # k's per "vec" load: 16 bytes of FP32


@triton.jit
def fma_row(acc, a, b, INTERPRETED: tl.constexpr):
    """``acc + a (x) b`` for one k: a [BLOCK_M] (A's column k), b [BLOCK_N] or [1, BLOCK_N] (B's row k), acc
    [BLOCK_M, BLOCK_N]. On the GPU one fused multiply-add per element (the step of Triton's FMA dot); in the
    interpreter the product rounded to FP32, then added (the tile kernels' interpreter step)."""
    a2 = tl.broadcast_to(a[:, None], acc.shape)
    b2 = tl.broadcast_to(b if len(b.shape) == 2 else b[None, :], acc.shape)
    if INTERPRETED:
        out = acc + a2 * b2
    else:
        out = tl.fma(a2, b2, acc)
    return out


@triton.jit
def a_column(a_ptrs, stride_al, k, L, row_ok, EVEN_L: tl.constexpr):
    """A's column k [BLOCK_M] (zeros past L)."""
    mask = row_ok if EVEN_L else row_ok & (k < L)
    return tl.load(a_ptrs + tl.cast(k, tl.int64) * stride_al, mask=mask, other=0.0)


@triton.jit
def b_row(b_ptrs, stride_bl, k, L, col_ok, EVEN_L: tl.constexpr):
    """B's row k as [1, BLOCK_N] (zeros past L): loaded in 2-D, so the load takes the accumulator's layout and no
    per-k layout conversion runs on the GPU."""
    mask = col_ok if EVEN_L else col_ok & (k < L)
    return tl.load(b_ptrs[None, :] + tl.cast(k, tl.int64) * stride_bl, mask=mask[None, :], other=0.0)


@triton.jit
def load_k_major(ptrs, stride_l, k0, L, ok, WIDTH: tl.constexpr, EVEN_L: tl.constexpr):
    """[len(ptrs), WIDTH]: k0 .. k0 + WIDTH - 1 of each row of an operand whose reduced dim has stride ``stride_l``
    (zeros past L)."""
    offs_k = k0 + tl.arange(0, WIDTH)
    mask = ok[:, None] if EVEN_L else ok[:, None] & (offs_k < L)[None, :]
    return tl.load(ptrs[:, None] + offs_k.to(tl.int64)[None, :] * stride_l, mask=mask, other=0.0)


@triton.jit
def column(x, j: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """Column j [ROWS] of x [ROWS, WIDTH], by even / odd splits along the last dim (split takes a last dim of 2):
    the columns stay in x's register order, so a load of x along its contiguous dim can be vectorized."""
    if WIDTH == 1:
        out = tl.reshape(x, (ROWS,))
    else:
        even, odd = tl.split(tl.reshape(x, (ROWS, WIDTH // 2, 2)))  # columns 0, 2, ... and 1, 3, ...
        if j % 2 == 0:
            out = column(even, j // 2, ROWS, WIDTH // 2)
        else:
            out = column(odd, j // 2, ROWS, WIDTH // 2)
    return out


@triton.jit
def chain(acc, xa, xb, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr,
          INTERPRETED: tl.constexpr):
    """The chain over WIDTH consecutive k's in ascending order: xa [BLOCK_M, WIDTH] (A's columns), xb
    [BLOCK_N, WIDTH] (B's rows)."""
    for j in tl.static_range(WIDTH):
        acc = fma_row(acc, column(xa, j, BLOCK_M, WIDTH), column(xb, j, BLOCK_N, WIDTH), INTERPRETED)
    return acc


@triton.jit
def gemv_step(acc, a_ptrs, b_ptrs, k0, L, stride_al, stride_bl, row_ok, col_ok,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOADS: tl.constexpr,
              B_K_MAJOR: tl.constexpr, INTERPRETED: tl.constexpr, EVEN_L: tl.constexpr):
    """One BLOCK_K step of the chain: k0 .. k0 + BLOCK_K - 1 into ``acc`` in ascending k. ``a_ptrs`` [BLOCK_M] and
    ``b_ptrs`` [BLOCK_N] point at A's column 0 and B's row 0."""
    if LOADS == "tile":
        xa = load_k_major(a_ptrs, stride_al, k0, L, row_ok, BLOCK_K, EVEN_L)  # [BLOCK_M, BLOCK_K]
        if B_K_MAJOR:
            xb = load_k_major(b_ptrs, stride_bl, k0, L, col_ok, BLOCK_K, EVEN_L)  # [BLOCK_N, BLOCK_K]
        else:  # B's rows, loaded along its contiguous columns, then transposed in registers
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = col_ok[None, :] if EVEN_L else col_ok[None, :] & (offs_k < L)[:, None]
            xb = tl.trans(tl.load(b_ptrs[None, :] + offs_k.to(tl.int64)[:, None] * stride_bl, mask=mask,
                                  other=0.0))  # [BLOCK_K, BLOCK_N] -> [BLOCK_N, BLOCK_K]
        acc = chain(acc, xa, xb, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRETED)
    elif LOADS == "vec":
        for kk in tl.static_range(0, BLOCK_K, VEC):
            xa = load_k_major(a_ptrs, stride_al, k0 + kk, L, row_ok, VEC, EVEN_L)  # [BLOCK_M, VEC]
            if B_K_MAJOR:
                xb = load_k_major(b_ptrs, stride_bl, k0 + kk, L, col_ok, VEC, EVEN_L)  # [BLOCK_N, VEC]
                acc = chain(acc, xa, xb, BLOCK_M, BLOCK_N, VEC, INTERPRETED)
            else:  # B's rows one k at a time (coalesced), A's columns split from the [BLOCK_M, VEC] load
                for j in tl.static_range(VEC):
                    b = b_row(b_ptrs, stride_bl, k0 + kk + j, L, col_ok, EVEN_L)
                    acc = fma_row(acc, column(xa, j, BLOCK_M, VEC), b, INTERPRETED)
    else:
        for kk in tl.static_range(BLOCK_K):
            k = k0 + kk
            acc = fma_row(acc, a_column(a_ptrs, stride_al, k, L, row_ok, EVEN_L),
                          b_row(b_ptrs, stride_bl, k, L, col_ok, EVEN_L), INTERPRETED)
    return acc


@triton.jit(launch_metadata=_launch_metadata)
def det_gemm_gemv_kernel(
    a_ptr, b_ptr, c_ptr, twin_ptr,
    R, C, L,  # C[R, C] = A[R, L] @ B[L, C]
    stride_ar, stride_al,
    stride_bl, stride_bc,
    stride_cr, stride_cc,
    seg_len,  # reduced elements per FP32 segment (== L for one segment); multiple of BLOCK_K
    op_id,  # 0 fwd, 1 dA, 2 dB: names the launch only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # > 1: the loop's loads pipelined through shared memory
    INTERPRETED: tl.constexpr, SEGMENTED: tl.constexpr, TWIN: tl.constexpr,
    LOADS: tl.constexpr,  # "row", "vec" or "tile" (module docstring)
    B_K_MAJOR: tl.constexpr,  # B's reduced dim is contiguous (fwd on nn.Linear's weight.t())
    EVEN_L: tl.constexpr,  # L % BLOCK_K == 0: no k masks
    PRECISION: tl.constexpr,  # "ieee" (names the launch: FP32 operands, IEEE products)
):
    pid_m, pid_n = tile_of_program(R, C, BLOCK_M, BLOCK_N, GROUP_M)
    offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_bn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_am < R
    col_ok = offs_bn < C
    # 64-bit element offsets (an lm_head's weight holds more than 2**31 - 1 elements)
    a_ptrs = a_ptr + offs_am.to(tl.int64) * stride_ar  # [BLOCK_M], A's column 0
    b_ptrs = b_ptr + offs_bn.to(tl.int64) * stride_bc  # [BLOCK_N], B's row 0

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    seg_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, L, BLOCK_K, num_stages=NUM_STAGES):
        acc, seg_acc = segment_boundary(acc, seg_acc, k0, seg_len, SEGMENTED)
        if SEGMENTED:
            seg_acc = gemv_step(seg_acc, a_ptrs, b_ptrs, k0, L, stride_al, stride_bl, row_ok, col_ok, BLOCK_M,
                                BLOCK_N, BLOCK_K, LOADS, B_K_MAJOR, INTERPRETED, EVEN_L)
        else:
            acc = gemv_step(acc, a_ptrs, b_ptrs, k0, L, stride_al, stride_bl, row_ok, col_ok, BLOCK_M, BLOCK_N,
                            BLOCK_K, LOADS, B_K_MAJOR, INTERPRETED, EVEN_L)
    if SEGMENTED:
        acc += seg_acc
    store_tile(c_ptr, twin_ptr, acc, offs_am, offs_bn, R, C, stride_cr, stride_cc, INTERPRETED, True, TWIN, False)
