"""The BF16 MoE expert MLP's Triton kernels (the math: kernels/moe/layer.py). Rows are expert-sorted and 128-padded by
kernels/moe/routing.py; P is the padded row count.

    moe_grouped_gemm_kernel      one program per (BLOCK_M-row tile of one expert, N tile): C[p] = A[row(p)] @ B[e]
                                 over the reduced L, then the epilogue (EPI_* of kernels/moe/common.py):
                                   up     x[gather] @ W1[e] -> gu [P, 2I] and h [P, I] in BF16 (SwiGLU)
                                   down   h @ W2[e] -> y [P, H], the FP32 accumulator rounded once to BF16
                                   dgrad  dout[gather] @ W2[e].T -> dh = s * acc, dgu [P, 2I] BF16 (dSwiGLU), and,
                                          fused, the dscore partials ds_part[p, c] = sum over the DS_CHUNK columns j
                                          of chunk c of (dout[t] @ W2[e].T)[j] * h[p, j] (FP32)
                                   dx     dgu @ W1[e].T -> dx_route [P, H], rounded once to BF16
    moe_grouped_gemm_tma_kernel  the same tiles, K steps and epilogues with the weight tile loaded by TMA
    moe_split_copy_kernel        a weight gradient of interleaved columns copied into a split-halves layout
    moe_wgrad_kernel             one program per (expert, dW tile): dW[e] = A[rows of e]^T B[rows of e] over the
                                 expert's rows in ascending order; BF16 out, or main_grad += it in FP32
    moe_scale_rows_kernel        dy [P, H] = bf16(s * dout[gather]) (dW2's B operand), padding rows +0; with COPY
                                 also dout[gather] itself (dgrad's A operand, read by TMA); token-major: each
                                 dout row read once and written to its K rows
    moe_combine_kernel           out[t] = bf16(sum over k ascending of s_k * y[route_row[t, k]]) in FP32 (and the
                                 unscaled dX gather-sum)
    moe_dscore_sum_kernel        ds[t, k] = the row's dscore partials summed (a fixed tree)

Every kernel runs over the routing's bound (the largest P it can have; the host never reads the real one): a grouped
GEMM program first reads the routing's gate (P and the validation counts) and does nothing past P or for a refused
batch; the weight gradients read the expert counts on the device; the combines, the dscore sum and the weight
gradients write NaN for a refused batch (``poisoned``).

Determinism rests on the det_gemm rules: no split-K, no atomics, one program owns each output tile and reduces
all of its reduced dimension in a fixed ascending order that depends on the shapes alone (H or I for the grouped
GEMMs, K for the combines, the expert's row count for dW); the config's GROUP_M (the grouped tile order of the
grouped GEMMs and the weight gradients, kernels/moe/tile_order.py) decides only which program owns a tile. Batch
invariance (forward, per token): a token's rows are never reduced with other tokens' rows, and the pinned tile
configs do not depend on T or on the routing.
Interpreter bits (kernels/moe/triton_blocks.py) differ from tensor-core bits; each backend is audited on its own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from detkit.kernels.moe.common import combine_launch_name, grouped_launch_name, scale_rows_launch_name, wgrad_launch_name
from detkit.kernels.moe.tile_order import tile_order_tl
from detkit.kernels.moe.triton_blocks import (
    dim_offsets, dswiglu_epilogue, grouped_tile, mma_step, poisoned, program_tile, store_c_tile, store_wgrad_tile,
    swiglu_epilogue, tile_is_live, to_bf16,
)


@triton.jit
def dscore_partials(acc, h_ptr, ds_ptr, offs_m, pid_n, C, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DS_CHUNK: tl.constexpr):
    """ds_part[p, c] = sum over the DS_CHUNK columns j of chunk c of acc[p, j] * h[p, j] in FP32 (acc: the
    unscaled dout @ W2[e].T of the dgrad tile; h: the saved BF16 activation [P, C]; ds_part [P, cdiv(C,
    DS_CHUNK)]; both contiguous). Chunks of a fixed width, so the partials do not depend on BLOCK_N."""
    NCH: tl.constexpr = BLOCK_N // DS_CHUNK
    offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = offs_m[:, None] >= 0
    h = tl.load(h_ptr + offs_m[:, None] * C + offs_j[None, :], mask=rows_ok & (offs_j < C)[None, :], other=0.0)
    part = tl.sum(tl.reshape(acc * h.to(tl.float32), (BLOCK_M, NCH, DS_CHUNK)), axis=2)  # [BLOCK_M, NCH]
    offs_c = pid_n * NCH + tl.arange(0, NCH)
    n_chunks = tl.cdiv(C, DS_CHUNK)
    tl.store(ds_ptr + offs_m[:, None] * n_chunks + offs_c[None, :], part, mask=rows_ok & (offs_c < n_chunks)[None, :])


@triton.jit
def grouped_epilogue(acc, c_ptr, aux_ptr, score_ptr, h_ptr, ds_ptr, offs_m, offs_n, col_ok, pid_n, C, stride_cm,
                     stride_cc, stride_xm, stride_xc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     EPILOGUE: tl.constexpr, DSCORE: tl.constexpr, DS_CHUNK: tl.constexpr, INTERPRETED: tl.constexpr):
    """The BF16 grouped kernels' epilogue (both load paths share it); DSCORE (dgrad only): the dscore
    partials from the same accumulator."""
    if EPILOGUE == 0:  # C's dtype (y of the down-projection, the per-route dX)
        store_c_tile(c_ptr, acc, offs_m, offs_n, col_ok, stride_cm, stride_cc, INTERPRETED)
    elif EPILOGUE == 1:  # SwiGLU: gu and h in BF16
        swiglu_epilogue(acc, c_ptr, aux_ptr, offs_m, offs_n, col_ok, pid_n, C, stride_cm, stride_cc, stride_xm,
                        stride_xc, BLOCK_M, BLOCK_N, INTERPRETED)
    else:  # dSwiGLU: dgu interleaved, BF16
        if DSCORE:  # first: its h tile and products are dead before the dSwiGLU loads gu (no spills on sm_90)
            dscore_partials(acc, h_ptr, ds_ptr, offs_m, pid_n, C, BLOCK_M, BLOCK_N, DS_CHUNK)
        dswiglu_epilogue(acc, score_ptr, aux_ptr, c_ptr, offs_m, pid_n, C, stride_xm, stride_xc, stride_cm,
                         stride_cc, BLOCK_M, BLOCK_N, INTERPRETED)


@triton.jit(launch_metadata=grouped_launch_name)
def moe_grouped_gemm_kernel(
    a_ptr, a_rows_ptr, b_ptr, c_ptr, aux_ptr, h_ptr, ds_ptr,  # h, ds: the dscore partials (DSCORE)
    route_ptr, score_ptr, tile_expert_ptr, gate_ptr,
    P, C, L,  # C[p, :] = A[row(p), :L] @ B[expert(p)][:L, :C]; P padded rows of the grid (multiple of SEGMENT)
    stride_am, stride_al,
    stride_be, stride_bl, stride_bc, stride_b_odd,  # stride_b_odd: B_SPLIT's half offset (dim_offsets)
    stride_cm, stride_cc,
    stride_xm, stride_xc,  # aux: h out [P, C/2] (SWIGLU) or gu in [P, 2C] (DSWIGLU)
    op_id,  # names the launch only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEP_K: tl.constexpr,
    SEGMENT: tl.constexpr, GATHER_A: tl.constexpr, EPILOGUE: tl.constexpr, INTERPRETED: tl.constexpr,
    DSCORE: tl.constexpr, DS_CHUNK: tl.constexpr,
    B_SPLIT: tl.constexpr,  # 0, or which of B's dims holds split gate/up halves: 1 = L (dX), 2 = C (up)
    GROUP_M: tl.constexpr,  # the tile order (kernels/moe/tile_order.py): row tiles per band
):
    pid_m, pid_n = program_tile(P, C, BLOCK_M, BLOCK_N, GROUP_M)
    if tile_is_live(gate_ptr, pid_m, BLOCK_M):
        expert, offs_m, offs_n, row_ok, col_ok, a_rows = grouped_tile(
            pid_m, pid_n, C, BLOCK_M, BLOCK_N, SEGMENT, tile_expert_ptr, route_ptr, a_rows_ptr, GATHER_A)
        offs_k = tl.arange(0, STEP_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_al  # [BLOCK_M, STEP_K]
        b_cols = b_ptr + expert * stride_be + dim_offsets(offs_n, stride_bc, stride_b_odd, B_SPLIT == 2)[None, :]

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if tl.sum(row_ok.to(tl.int32), axis=0) > 0:  # a block of padding only does no work
            for k0 in range(0, L, BLOCK_K):
                for kk in tl.static_range(0, BLOCK_K, STEP_K):
                    k_ok = (k0 + kk + offs_k) < L
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, STEP_K]
                    b_ptrs = b_cols + dim_offsets(k0 + kk + offs_k, stride_bl, stride_b_odd, B_SPLIT == 1)[:, None]
                    b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [STEP_K, BLOCK_N]
                    acc = mma_step(acc, a, b, STEP_K, INTERPRETED)
                    a_ptrs += STEP_K * stride_al

        grouped_epilogue(acc, c_ptr, aux_ptr, score_ptr, h_ptr, ds_ptr, offs_m, offs_n, col_ok, pid_n, C, stride_cm,
                         stride_cc, stride_xm, stride_xc, BLOCK_M, BLOCK_N, EPILOGUE, DSCORE, DS_CHUNK, INTERPRETED)


@triton.jit
def weight_box(b_desc, expert, off_n, k, WIDTH: tl.constexpr, STEP_K: tl.constexpr, B_K_MAJOR: tl.constexpr):
    """The [STEP_K, WIDTH] weight tile at (k, off_n) of the expert, by TMA (zero fill past the storage's extents)."""
    if B_K_MAJOR:
        b = tl.trans(b_desc.load([expert, off_n, k]).reshape(WIDTH, STEP_K))
    else:
        b = b_desc.load([expert, k, off_n]).reshape(STEP_K, WIDTH)
    return b


@triton.jit(launch_metadata=grouped_launch_name)
def moe_grouped_gemm_tma_kernel(
    a_ptr, a_rows_ptr, b_desc, c_ptr, aux_ptr, h_ptr, ds_ptr,
    route_ptr, score_ptr, tile_expert_ptr, gate_ptr,
    P, C, L,  # as moe_grouped_gemm_kernel; B through a rank-3 TMA descriptor over the weight's storage
    stride_am, stride_al,
    stride_cm, stride_cc,
    stride_xm, stride_xc,
    op_id,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEP_K: tl.constexpr,
    SEGMENT: tl.constexpr, GATHER_A: tl.constexpr, EPILOGUE: tl.constexpr, INTERPRETED: tl.constexpr,
    B_K_MAJOR: tl.constexpr,  # storage [E, C, L] (e.g. W2[e].T for dgrad): box [1, BLOCK_N, STEP_K]
    DSCORE: tl.constexpr, DS_CHUNK: tl.constexpr,
    B_SPLIT_HALVES: tl.constexpr,  # C is gate/up pairs kept as split halves: two half-width boxes (up only)
    GROUP_M: tl.constexpr,
):
    """moe_grouped_gemm_kernel with the expert's weight tile loaded by TMA (zero fill past the
    expert's own extents, so no other expert's rows leak in): the same tiles, the same ascending K
    steps and epilogues; the gathered activation rows stay pointer loads."""
    pid_m, pid_n = program_tile(P, C, BLOCK_M, BLOCK_N, GROUP_M)
    if tile_is_live(gate_ptr, pid_m, BLOCK_M):
        expert, offs_m, offs_n, row_ok, col_ok, a_rows = grouped_tile(
            pid_m, pid_n, C, BLOCK_M, BLOCK_N, SEGMENT, tile_expert_ptr, route_ptr, a_rows_ptr, GATHER_A)
        off_n = pid_n * BLOCK_N
        offs_k = tl.arange(0, STEP_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_al  # [BLOCK_M, STEP_K]

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=tl.float32)
        if tl.sum(row_ok.to(tl.int32), axis=0) > 0:  # a block of padding only does no work
            for k0 in range(0, L, BLOCK_K):
                for kk in tl.static_range(0, BLOCK_K, STEP_K):
                    k = k0 + kk
                    k_ok = (k + offs_k) < L
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, STEP_K]
                    if B_SPLIT_HALVES:  # the gate and up columns of this tile's pairs, one MMA each
                        b_gate = weight_box(b_desc, expert, off_n // 2, k, BLOCK_N // 2, STEP_K, B_K_MAJOR)
                        b_up = weight_box(b_desc, expert, C // 2 + off_n // 2, k, BLOCK_N // 2, STEP_K, B_K_MAJOR)
                        acc_gate = mma_step(acc_gate, a, b_gate, STEP_K, INTERPRETED)
                        acc_up = mma_step(acc_up, a, b_up, STEP_K, INTERPRETED)
                    else:
                        b = weight_box(b_desc, expert, off_n, k, BLOCK_N, STEP_K, B_K_MAJOR)
                        acc = mma_step(acc, a, b, STEP_K, INTERPRETED)
                    a_ptrs += STEP_K * stride_al
            if B_SPLIT_HALVES:  # the interleaved tile: a column's value does not depend on its place in the MMA
                acc = tl.reshape(tl.join(acc_gate, acc_up), (BLOCK_M, BLOCK_N))

        grouped_epilogue(acc, c_ptr, aux_ptr, score_ptr, h_ptr, ds_ptr, offs_m, offs_n, col_ok, pid_n, C, stride_cm,
                         stride_cc, stride_xm, stride_xc, BLOCK_M, BLOCK_N, EPILOGUE, DSCORE, DS_CHUNK, INTERPRETED)


@triton.jit(launch_metadata=wgrad_launch_name)
def moe_wgrad_kernel(
    a_ptr, b_ptr, rows_ptr, score_ptr, dw_ptr,
    offsets_ptr, counts_ptr, gate_ptr,
    R, C,  # dW[e] [R, C] = sum over e's rows p (ascending) of A[arow(p), :R]^T B[brow(p), :C]
    stride_am, stride_ar,
    stride_bm, stride_bc,
    stride_we, stride_wr, stride_wc, stride_wc_odd,  # stride_wc_odd: SPLIT_C's half offset (dim_offsets)
    op_id,  # names the launch only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEP_K: tl.constexpr,
    GATHER_A: tl.constexpr, ACCUMULATE: tl.constexpr, SPLIT_C: tl.constexpr,
    INTERPRETED: tl.constexpr,
    GROUP_M: tl.constexpr,  # each dW[e]'s tiles in the grouped order (bands of GROUP_M row tiles), expert by expert
):
    pid = tl.program_id(axis=0)
    num_pid_r = tl.cdiv(R, BLOCK_M)
    num_pid_c = tl.cdiv(C, BLOCK_N)
    expert = pid // (num_pid_r * num_pid_c)
    pid_r, pid_c = tile_order_tl(pid % (num_pid_r * num_pid_c), num_pid_r, num_pid_c, GROUP_M)
    start = tl.load(offsets_ptr + expert)
    count = tl.load(counts_ptr + expert)

    offs_r = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, STEP_K)
    r_ok = offs_r < R
    c_ok = offs_c < C
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, count, BLOCK_K):  # the expert's rows, ascending: a function of count alone
        for kk in tl.static_range(0, BLOCK_K, STEP_K):
            p_ok = (k0 + kk + offs_k) < count
            p = start + k0 + kk + offs_k
            if GATHER_A:
                a_rows = tl.load(rows_ptr + p, mask=p_ok, other=0)
            else:
                a_rows = p
            a_ptrs = a_ptr + a_rows[None, :] * stride_am + offs_r[:, None] * stride_ar  # [BLOCK_M, STEP_K]
            a = tl.load(a_ptrs, mask=r_ok[:, None] & p_ok[None, :], other=0.0)
            b_ptrs = b_ptr + p[:, None] * stride_bm + offs_c[None, :] * stride_bc  # [STEP_K, BLOCK_N]
            b = tl.load(b_ptrs, mask=p_ok[:, None] & c_ok[None, :], other=0.0)
            acc = mma_step(acc, a, b, STEP_K, INTERPRETED)

    store_wgrad_tile(dw_ptr, acc, expert, count, gate_ptr, offs_r, offs_c, r_ok, c_ok, stride_we, stride_wr, stride_wc,
                     stride_wc_odd, ACCUMULATE, INTERPRETED, SPLIT_C)


@triton.jit
def moe_split_copy_kernel(
    src_ptr, dst_ptr,
    R, C,  # dst[e][r, c] = src[e][r, c] for the [E, R, C] views; dst's C holds gate/up pairs as split halves
    stride_se, stride_sr, stride_sc, stride_de, stride_dr, stride_dc, stride_dc_odd,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """A weight gradient computed with interleaved columns, copied into the weight's split-halves layout (any strides;
    the compiler stages the tile through shared memory when dst is contiguous along R). Exact: a copy."""
    pid = tl.program_id(axis=0)
    num_r = tl.cdiv(R, BLOCK_R)
    num_c = tl.cdiv(C, BLOCK_C)
    expert = pid // (num_r * num_c)
    offs_r = ((pid // num_c) % num_r) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = (pid % num_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r < R)[:, None] & (offs_c < C)[None, :]
    v = tl.load(src_ptr + expert * stride_se + offs_r[:, None] * stride_sr + offs_c[None, :] * stride_sc, mask=mask)
    tl.store(dst_ptr + expert * stride_de + offs_r[:, None] * stride_dr
             + dim_offsets(offs_c, stride_dc, stride_dc_odd, True)[None, :], v, mask=mask)


@triton.jit(launch_metadata=scale_rows_launch_name)
def moe_scale_rows_kernel(
    src_ptr, route_row_ptr, row_score_ptr, route_ptr, gate_ptr, out_ptr, copy_ptr,
    T, N, K, P,  # out[route_row[t, k], :N] = bf16(row_score[that row] * src[t, :N]), one rounding of the FP32 product
    stride_sm, stride_sn, stride_rt, stride_rk, stride_om, stride_on, stride_cm, stride_cn,
    TOKEN_PROGRAMS,  # cdiv(T, BLOCK_M) * cdiv(N, BLOCK_N) programs scatter token rows; the rest zero padding rows
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAD_ROWS: tl.constexpr,  # expert-sorted rows per padding program (all N columns)
    COPY: tl.constexpr,  # copy[route_row[t, k], :N] = src[t, :N] too (padding rows 0)
    INTERPRETED: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    limit = tl.minimum(P, tl.load(gate_ptr))  # rows past the routing's P: not read by the weight gradients
    cols = tl.arange(0, BLOCK_N)
    if pid < TOKEN_PROGRAMS:
        # Token-major: each token row is read once and written to its K expert-sorted rows (a row-major pass would
        # read it K times, from DRAM once the rows of one expert outgrow L2).
        num_pid_n = tl.cdiv(N, BLOCK_N)
        offs_t = (pid // num_pid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (pid % num_pid_n) * BLOCK_N + cols
        t_ok = offs_t < T
        n_ok = offs_n < N
        x = tl.load(src_ptr + offs_t[:, None] * stride_sm + offs_n[None, :] * stride_sn,
                    mask=t_ok[:, None] & n_ok[None, :], other=0.0)
        for k in range(0, K):
            rows = tl.load(route_row_ptr + offs_t * stride_rt + k * stride_rk, mask=t_ok, other=-1)
            ok = (rows >= 0) & (rows < limit)  # a masked route has no row
            s = tl.load(row_score_ptr + rows, mask=ok, other=0.0)
            mask = ok[:, None] & n_ok[None, :]
            tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on,
                     to_bf16(x.to(tl.float32) * s[:, None], INTERPRETED), mask=mask)
            if COPY:
                tl.store(copy_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn, x, mask=mask)
    else:
        # A padding row is +0 exactly (not 0 * some token's row, which may hold an Inf): a weight gradient that reads
        # whole row blocks (kernels/moe/ws.py) then adds only zeros for it.
        offs_m = (pid - TOKEN_PROGRAMS) * PAD_ROWS + tl.arange(0, PAD_ROWS)
        m_ok = offs_m < limit
        pad = m_ok & (tl.load(route_ptr + offs_m, mask=m_ok, other=0) < 0)
        if tl.max(pad.to(tl.int32), axis=0) > 0:
            zero = tl.zeros((PAD_ROWS, BLOCK_N), dtype=out_ptr.dtype.element_ty)
            for n0 in range(0, N, BLOCK_N):
                offs_n = n0 + cols
                mask = pad[:, None] & (offs_n < N)[None, :]
                tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, zero, mask=mask)
                if COPY:
                    tl.store(copy_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, zero, mask=mask)


@triton.jit(launch_metadata=combine_launch_name)
def moe_combine_kernel(
    src_ptr, route_row_ptr, score_ptr, gate_ptr, out_ptr,
    T, N, K,  # out[t, :N] = bf16(sum_{k ascending, route valid} w[t, k] * src[route_row[t, k], :N])
    stride_sm, stride_sn, stride_rt, stride_rk, stride_st, stride_sk, stride_ot, stride_on,
    op_id,  # names the launch only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr, INTERPRETED: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_t = pid // num_pid_n
    pid_n = pid % num_pid_n
    offs_t = pid_t * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = offs_t < T
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K):
        rows = tl.load(route_row_ptr + offs_t * stride_rt + k * stride_rk, mask=t_ok, other=-1)
        ok = rows >= 0
        # [BLOCK_M, BLOCK_N]: BF16 rows, exact in FP32
        v = tl.load(src_ptr + rows[:, None] * stride_sm + offs_n[None, :] * stride_sn,
                    mask=ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        if SCALED:
            w = tl.load(score_ptr + offs_t * stride_st + k * stride_sk, mask=ok, other=0.0).to(tl.float32)
            v = w[:, None] * v
        acc = tl.where(ok[:, None], acc + v, acc)  # a masked route contributes nothing, not even +0
    out_ptrs = out_ptr + offs_t[:, None] * stride_ot + offs_n[None, :] * stride_on
    tl.store(out_ptrs, to_bf16(poisoned(acc, gate_ptr), INTERPRETED), mask=t_ok[:, None] & n_ok[None, :])


@triton.jit
def moe_dscore_sum_kernel(
    part_ptr, route_row_ptr, gate_ptr, ds_ptr,
    T, K, NCH,  # ds[t, k] = sum_c part[route_row[t, k], c] (FP32, a fixed tree over NCH), 0 when masked
    stride_rt, stride_rk, stride_st, stride_sk,
    BLOCK_M: tl.constexpr, NCH_POW2: tl.constexpr,
):
    pid_t = tl.program_id(axis=0)
    offs_t = pid_t * BLOCK_M + tl.arange(0, BLOCK_M)
    t_ok = offs_t < T
    offs_c = tl.arange(0, NCH_POW2)
    for k in range(0, K):
        rows = tl.load(route_row_ptr + offs_t * stride_rt + k * stride_rk, mask=t_ok, other=-1)
        part = tl.load(part_ptr + rows[:, None] * NCH + offs_c[None, :],
                       mask=(rows >= 0)[:, None] & (offs_c < NCH)[None, :], other=0.0)  # [BLOCK_M, NCH_POW2]
        tl.store(ds_ptr + offs_t * stride_st + k * stride_sk, poisoned(tl.sum(part, axis=1), gate_ptr), mask=t_ok)
