"""The grouped GEMM family's Triton kernels (the math and the determinism claim: kernels/grouped/launch.py).

``grouped_mm_kernel``: ``C[rows of g] = A[rows of g] @ B[g]`` for groups of consecutive rows delimited by an offsets
tensor (torch._grouped_mm's 2-D x 3-D form: an MoE block's expert GEMMs and their input gradient).
``grouped_wgrad_kernel``: ``C[g] = A[:, cols of g] @ B[rows of g]`` (the 2-D x 2-D form, offsets along the reduced
dim: the experts' weight gradient).
``grouped_mm_tma_kernel`` / ``grouped_wgrad_tma_kernel``: the same tiles, K steps and epilogues with the operands
loaded by TMA (host descriptors over each operand's storage order; variant "tma" of kernels/grouped/configs.py), so
the same bits as the pointer kernels.

Both read the offsets on the device, so no launch waits on a host read: the grid is sized for the bound of any
grouping and each program finds its group itself. Both use det_gemm's tile math (``mac_step``: one ``tl.dot`` per step
on the GPU, exact products added one at a time in the interpreter; ``to_bf16``: one nearest-even rounding).
"""

from __future__ import annotations

import triton
import triton.language as tl

from detkit.kernels.det_gemm.kernels import mac_step, tile_of_program, to_bf16
from detkit.kernels.grouped.names import (
    _mm_launch_metadata, _mm_tma_launch_metadata, _wgrad_launch_metadata, _wgrad_tma_launch_metadata,
)


@triton.jit
def group_bounds(offs_ptr, G, total, G_POW2: tl.constexpr):
    """First and past-the-end rows [G_POW2] of groups 0..G-1 (group g ends at ``offs[g]``), of the tail group G
    (rows past the last offset: no group's, written as zeros) and of empty groups past it; and whether the offsets
    are valid (non-decreasing, within [0, total]). Every program loads the whole vector: no host read, no other
    program's work."""
    g = tl.arange(0, G_POW2)
    ends = tl.load(offs_ptr + g, mask=g < G, other=0)
    ends = tl.where(g < G, ends, total)
    prev = tl.load(offs_ptr + g - 1, mask=(g >= 1) & (g <= G), other=0)
    starts = tl.where(g == 0, 0, tl.where(g <= G, prev, total))
    ok = tl.sum(tl.where(ends < starts, 1, 0), axis=0) == 0
    return g, starts, ends, ok


@triton.jit
def pick(g, values, which):
    """``values[which]`` as a scalar (a masked sum over a small vector)."""
    return tl.sum(tl.where(g == which, values, 0), axis=0)


@triton.jit
def group_tile(offs_ptr, pid_t, M, G, BLOCK_M: tl.constexpr, G_POW2: tl.constexpr):
    """Row tile ``pid_t`` of the grouping (each group's rows cut into BLOCK_M tiles from its first row, groups in
    order, then the tail): its group, its first row, which of its BLOCK_M rows are the group's own (the rows it may
    store; none past the bound's real tiles, where group > G and start == end == M), and whether the offsets are
    valid."""
    g, starts, ends, ok = group_bounds(offs_ptr, G, M, G_POW2)
    tiles = tl.cdiv(ends - starts, BLOCK_M)  # [G_POW2]
    last = tl.cumsum(tiles, axis=0)  # inclusive prefix: the tile index each group's tiles end before
    group = tl.sum(tl.where(last <= pid_t, 1, 0), axis=0)  # groups wholly before this tile
    row0 = pick(g, starts, group) + (pid_t - pick(g, last - tiles, group)) * BLOCK_M
    offs_am = row0 + tl.arange(0, BLOCK_M)
    return group, row0, offs_am < pick(g, ends, group), ok


@triton.jit(launch_metadata=_mm_launch_metadata)
def grouped_mm_kernel(
    a_ptr, b_ptr, c_ptr, offs_ptr,
    M, N, K, G,  # C[M, N] = A[M, K] @ B[g][K, N] for the rows of group g; rows past offs[G-1] are written 0
    stride_am, stride_ak,
    stride_bg, stride_bk, stride_bn,
    stride_cm, stride_cn,
    TILES,  # row tiles the grid covers: the bound of any grouping, ceil(M / BLOCK_M) + G + 1
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    G_POW2: tl.constexpr,
    B_K_MAJOR: tl.constexpr,  # B's reduced dim is contiguous (transformers' weight.transpose(-2, -1))
    INTERPRETED: tl.constexpr,
):
    """Program (t, n) owns the t-th row tile of the grouping (each group's rows cut into BLOCK_M tiles from its first
    row, groups in order, then the tail) and output columns n*BLOCK_N... A row is reduced over K in ascending steps
    of BLOCK_K, the same steps whatever its group holds: a row's bits depend on its values, its group's matrix and
    K, never on the other rows (batch invariance). Invalid offsets: every row NaN (fail closed without a host read).
    Programs take (t, n) in det_gemm's grouped order (GROUP_M row tiles share the column tiles in flight, for L2
    reuse of both operands): which program owns a tile, never the tile's math.
    """
    pid_t, pid_n = tile_of_program(TILES * BLOCK_M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_bn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_bn < N
    cols64 = offs_bn.to(tl.int64)
    group, row0, row_ok, ok = group_tile(offs_ptr, pid_t, M, G, BLOCK_M, G_POW2)
    if ok:
        offs_am = row0 + tl.arange(0, BLOCK_M)
        rows64 = offs_am.to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        ks64 = offs_k.to(tl.int64)
        a_ptrs = a_ptr + rows64[:, None] * stride_am + ks64[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
        b_base = b_ptr + group.to(tl.int64) * stride_bg
        if B_K_MAJOR:
            b_ptrs = b_base + cols64[:, None] * stride_bn + ks64[None, :] * stride_bk  # [BLOCK_N, BLOCK_K]
        else:
            b_ptrs = b_base + ks64[:, None] * stride_bk + cols64[None, :] * stride_bn  # [BLOCK_K, BLOCK_N]
        a_step = tl.cast(stride_ak, tl.int64) * BLOCK_K
        b_step = tl.cast(stride_bk, tl.int64) * BLOCK_K
        k_len = tl.where(group < G, K, 0)  # the tail and the programs past it reduce nothing: exact zeros
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_len, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            if B_K_MAJOR:
                b = tl.trans(tl.load(b_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0))  # [BLOCK_K, BLOCK_N]
            else:
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = mac_step(acc, a, b, offs_k, BLOCK_K, INTERPRETED)
            a_ptrs += a_step
            b_ptrs += b_step
    else:
        offs_am = pid_t * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_am < M
        rows64 = offs_am.to(tl.int64)
        acc = tl.full((BLOCK_M, BLOCK_N), float("nan"), tl.float32)
    c_ptrs = c_ptr + rows64[:, None] * stride_cm + cols64[None, :] * stride_cn  # [BLOCK_M, BLOCK_N]
    tl.store(c_ptrs, to_bf16(acc, INTERPRETED), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def wgrad_rows_step(acc, a_ptr, b_ptr, ps64, qs64, p_ok, q_ok, stride_ap, stride_ar, stride_br, stride_bq, start, count,
                    k0, offs_k, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """One weight-gradient K step by pointer loads: the group's rows start + k0 ... (+ BLOCK_K), those past its
    ``count`` rows loaded as exact zeros (the next group's rows add nothing)."""
    k_ok = (k0 + offs_k) < count
    rows64 = (start + k0 + offs_k).to(tl.int64)
    a = tl.load(a_ptr + ps64[:, None] * stride_ap + rows64[None, :] * stride_ar,
                mask=p_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
    b = tl.load(b_ptr + rows64[:, None] * stride_br + qs64[None, :] * stride_bq,
                mask=k_ok[:, None] & q_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
    return mac_step(acc, a, b, offs_k, BLOCK_K, INTERPRETED)


@triton.jit(launch_metadata=_wgrad_launch_metadata)
def grouped_wgrad_kernel(
    a_ptr, b_ptr, c_ptr, offs_ptr,
    P, Q, R, G,  # C[g][P, Q] = A[P, rows of g] @ B[rows of g, Q]; the R reduced rows split by offs
    stride_ap, stride_ar,
    stride_br, stride_bq,
    stride_cg, stride_cp, stride_cq,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, G_POW2: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program (tile, g) owns one [BLOCK_M, BLOCK_N] tile of group g's output and reduces over exactly the group's
    rows, in ascending steps of BLOCK_K rows from its first row: the order is a function of the group's row count
    alone (no split, no atomics). An empty group is exact zeros; invalid offsets give NaN."""
    num_n = tl.cdiv(Q, BLOCK_N)
    num_tiles = tl.cdiv(P, BLOCK_M) * num_n
    group = tl.program_id(axis=0) // num_tiles  # a 1-D grid, groups outermost: a group's tiles run together
    pid = tl.program_id(axis=0) % num_tiles
    offs_p = (pid // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_q = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    p_ok = offs_p < P
    q_ok = offs_q < Q
    ps64, qs64 = offs_p.to(tl.int64), offs_q.to(tl.int64)
    g, starts, ends, ok = group_bounds(offs_ptr, G, R, G_POW2)
    start = pick(g, starts, group)
    count = tl.where(ok, pick(g, ends, group) - start, 0)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, count, BLOCK_K):  # the group's rows, ascending
        acc = wgrad_rows_step(acc, a_ptr, b_ptr, ps64, qs64, p_ok, q_ok, stride_ap, stride_ar, stride_br, stride_bq,
                              start, count, k0, offs_k, BLOCK_K, INTERPRETED)
    acc = tl.where(ok, acc, float("nan"))
    c_ptrs = c_ptr + group.to(tl.int64) * stride_cg + ps64[:, None] * stride_cp + qs64[None, :] * stride_cq
    tl.store(c_ptrs, to_bf16(acc, INTERPRETED), mask=p_ok[:, None] & q_ok[None, :])


@triton.jit
def weight_tile(b_desc, group, k, off_n, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, B_K_MAJOR: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile at (k, off_n) of B[group] from a rank-3 descriptor over B's storage: [G, K, N]
    (box [1, BLOCK_K, BLOCK_N]) or, B_K_MAJOR, [G, N, K] (box [1, BLOCK_N, BLOCK_K], transposed in shared memory,
    which wgmma reads as its K-major operand). TMA zero-fills past the descriptor's K and N: a step past K adds exact
    zeros and no other group's matrix leaks in."""
    if B_K_MAJOR:
        b = tl.trans(b_desc.load([group, off_n, k]).reshape(BLOCK_N, BLOCK_K))
    else:
        b = b_desc.load([group, k, off_n]).reshape(BLOCK_K, BLOCK_N)
    return b


@triton.jit(launch_metadata=_mm_tma_launch_metadata)
def grouped_mm_tma_kernel(
    a_desc, b_desc, c_ptr, offs_ptr,  # A: a rank-2 descriptor over [M, K], row-major; B: rank-3 (weight_tile)
    M, N, K, G,  # as grouped_mm_kernel
    stride_cm, stride_cn,
    TILES,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    G_POW2: tl.constexpr,
    B_K_MAJOR: tl.constexpr,  # B stored [G, N, K] (transformers' weight.transpose(-2, -1))
    INTERPRETED: tl.constexpr,
):
    """grouped_mm_kernel with TMA loads: the same program order, row tiles, ascending K steps of BLOCK_K (one dot
    each) and epilogue, so the same bits. A tile's box of A starts at its first row and runs BLOCK_M rows: rows past
    the group's end are the next groups' rows (TMA's zeros past M). They are harmless: an output row's accumulator
    depends on its own A row only, and the store is masked to the group's rows, so no other group's row is written.
    The tail group (rows past offs[G-1]) and the programs past the real tiles load nothing and store zeros."""
    pid_t, pid_n = tile_of_program(TILES * BLOCK_M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_n = pid_n * BLOCK_N
    offs_bn = off_n + tl.arange(0, BLOCK_N)
    col_ok = offs_bn < N
    cols64 = offs_bn.to(tl.int64)
    group, row0, row_ok, ok = group_tile(offs_ptr, pid_t, M, G, BLOCK_M, G_POW2)
    if ok:
        offs_am = row0 + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        k_len = tl.where(group < G, K, 0)  # the tail and the programs past it reduce nothing: exact zeros
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_len, BLOCK_K):
            a = a_desc.load([row0, k0])  # [BLOCK_M, BLOCK_K]
            b = weight_tile(b_desc, group, k0, off_n, BLOCK_K, BLOCK_N, B_K_MAJOR)  # [BLOCK_K, BLOCK_N]
            acc = mac_step(acc, a, b, offs_k, BLOCK_K, INTERPRETED)
    else:
        offs_am = pid_t * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_am < M
        acc = tl.full((BLOCK_M, BLOCK_N), float("nan"), tl.float32)
    rows64 = offs_am.to(tl.int64)
    c_ptrs = c_ptr + rows64[:, None] * stride_cm + cols64[None, :] * stride_cn  # [BLOCK_M, BLOCK_N]
    tl.store(c_ptrs, to_bf16(acc, INTERPRETED), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(launch_metadata=_wgrad_tma_launch_metadata)
def grouped_wgrad_tma_kernel(
    a_desc, b_desc,  # rank-2 descriptors over A's storage [R, P] (A = grad.T) and B [R, Q], row-major
    a_ptr, b_ptr, c_ptr, offs_ptr,  # a_ptr, b_ptr: the same operands, for a group's last, partial step
    P, Q, R, G,  # as grouped_wgrad_kernel
    stride_ap, stride_ar,
    stride_br, stride_bq,
    stride_cg, stride_cp, stride_cq,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, G_POW2: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """grouped_wgrad_kernel with TMA loads for every step wholly inside the group, and the group's last, partial
    step (its row count mod BLOCK_K) through masked pointer loads: rows past the group's end are the next group's
    rows, which must add exact zeros, and TMA zero-fills only past the tensor's extents. The same steps in the same
    order as the pointer kernel, the same zeros in the partial step: the same bits. Both descriptors have the
    reduced rows as their outer dim (a box may start at any row; its offset along the contiguous dim is a multiple of
    BLOCK_M or BLOCK_N): A is read as autograd passes it, grad.T, whose storage is [R, P]."""
    num_n = tl.cdiv(Q, BLOCK_N)
    num_tiles = tl.cdiv(P, BLOCK_M) * num_n
    group = tl.program_id(axis=0) // num_tiles
    pid = tl.program_id(axis=0) % num_tiles
    off_p = (pid // num_n) * BLOCK_M
    off_q = (pid % num_n) * BLOCK_N
    offs_p = off_p + tl.arange(0, BLOCK_M)
    offs_q = off_q + tl.arange(0, BLOCK_N)
    p_ok = offs_p < P
    q_ok = offs_q < Q
    ps64, qs64 = offs_p.to(tl.int64), offs_q.to(tl.int64)
    g, starts, ends, ok = group_bounds(offs_ptr, G, R, G_POW2)
    start = pick(g, starts, group)
    count = tl.where(ok, pick(g, ends, group) - start, 0)
    full = count - count % BLOCK_K  # rows in steps wholly inside the group
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, full, BLOCK_K):  # the group's rows, ascending
        a = tl.trans(a_desc.load([start + k0, off_p]))  # [BLOCK_M, BLOCK_K]: an M-major operand in shared memory
        b = b_desc.load([start + k0, off_q])  # [BLOCK_K, BLOCK_N]
        acc = mac_step(acc, a, b, offs_k, BLOCK_K, INTERPRETED)
    if full < count:
        acc = wgrad_rows_step(acc, a_ptr, b_ptr, ps64, qs64, p_ok, q_ok, stride_ap, stride_ar, stride_br, stride_bq,
                              start, count, full, offs_k, BLOCK_K, INTERPRETED)
    acc = tl.where(ok, acc, float("nan"))
    c_ptrs = c_ptr + group.to(tl.int64) * stride_cg + ps64[:, None] * stride_cp + qs64[None, :] * stride_cq
    tl.store(c_ptrs, to_bf16(acc, INTERPRETED), mask=p_ok[:, None] & q_ok[None, :])
