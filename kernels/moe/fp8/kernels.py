"""The FP8 MoE expert MLP's Triton kernels (the recipe: kernels/moe/fp8/layer.py): block-scaled FP8 (E4M3) grouped GEMMs
with per-128-K promotion, the column-wise quantizer of the weight-gradient operands, and the FP8 weight gradient.

Block-scaled GEMM with per-128-K promotion (one output tile, one program):
    acc = 0 (FP32)
    for kb ascending over L / 128:
        blk = sum over the block's 128 K of a_q[m, k] * b_q[k, n]        FP8 products, FP32 accumulation
        acc = acc + blk * (a_scale[m, kb] * b_scale[kb, n // 128])         exact scaling (powers of two)
Hopper's FP8 wgmma accumulates with reduced precision inside one instruction chain; ending the chain
every 128 K and adding into the FP32 acc bounds that error to one block (DeepSeek-V3's promotion).

    moe_fp8_grouped_gemm_kernel   C[p] = the block-scaled A_q[row(p)] @ B_q[e] over L, then the epilogue (EPI_PLAIN,
                                  EPI_FP8_* of kernels/moe/common.py): y / dx_route in BF16; gu, h (and h quantized
                                  1x128 when the tile is 256 interleaved columns wide); dgu and dgu quantized 1x128,
                                  with the dscore partials (fp8_dscore_partials)
    moe_fp8_quant_colwise_kernel  expert-sorted rows quantized in 128x1 blocks down the columns, stored K-major
    moe_fp8_wgrad_kernel          dW[e] from column-wise FP8 operands, promotion every 128 rows

Every FP8 operand is K-major (the reduced dim contiguous), as Hopper's FP8 wgmma requires; the kernel loads a
[BLOCK_N, BLOCK_K] weight tile (through pointers, or a TMA descriptor: the same values) and transposes it. Each K
block's scales are loaded one block ahead, before its MMAs. On the Triton interpreter: exact FP32 products added one
at a time (``mma_step``; products of two E4M3 values are exact in FP32) and E4M3 rounding in integer arithmetic
(kernels/moe/fp8/quant.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from detkit.kernels.moe.fp8.quant import quantize_row_blocks, quantize_rows
from detkit.kernels.moe.common import (
    DS_GROUP, colwise_quant_launch_name, fp8_grouped_launch_name, fp8_wgrad_launch_name,
)
from detkit.kernels.moe.tile_order import tile_order_tl
from detkit.kernels.moe.triton_blocks import (
    dswiglu_epilogue, grouped_tile, mma_step, program_tile, store_c_tile, store_wgrad_tile, swiglu_epilogue,
    tile_is_live, to_bf16,
)


@triton.jit(launch_metadata=fp8_grouped_launch_name)
def moe_fp8_grouped_gemm_kernel(
    a_ptr, as_ptr, a_rows_ptr, b_ptr, bs_ptr, c_ptr, aux_ptr, q_ptr, qs_ptr,
    route_ptr, score_ptr, tile_expert_ptr, gate_ptr,
    h_ptr, ds_ptr,  # dgrad with DSCORE: the forward's h [P, C] BF16, the dscore partials [P, C / DS_GROUP] FP32
    P, C, L,  # C[p, :C] = sum_kb (A_q[row(p), kb] @ B_q[e][kb, :C]) * a_s[row(p), kb] * b_s[e][kb, :]
    stride_am, stride_al, stride_asm, stride_asl,
    stride_be, stride_bc, stride_bl,  # B_q stored [E, C, L]: K-major
    stride_bse, stride_bsl, stride_bsc,  # B scales [E, L/QBLOCK, C/QBLOCK]
    stride_cm, stride_cc,
    stride_xm, stride_xc,  # aux: h out [P, C/2] (SWIGLU) or gu in [P, 2C] (DSWIGLU)
    stride_qm, stride_qc, stride_qsm, stride_qsc,  # fused FP8 output and its 1x128 scales
    op_id,  # names the launch only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP_K: tl.constexpr, QBLOCK: tl.constexpr,
    SEGMENT: tl.constexpr, GATHER_A: tl.constexpr, EPILOGUE: tl.constexpr, INTERPRETED: tl.constexpr,
    B_TMA: tl.constexpr,  # b_ptr is a rank-3 TMA descriptor over B_q [E, C, L], box [1, BLOCK_N, STEP_K]
    GROUP_M: tl.constexpr,  # the tile order (kernels/moe/tile_order.py): row tiles per band
    DSCORE: tl.constexpr = False,
):
    # A tile at or past the routing's P (the up GEMM is queued over the largest P before the host has read it) or of
    # a refused batch does nothing.
    pid_m, pid_n = program_tile(P, C, BLOCK_M, BLOCK_N, GROUP_M)
    if tile_is_live(gate_ptr, pid_m, BLOCK_M):
        expert, offs_m, offs_n, row_ok, col_ok, a_rows = grouped_tile(
            pid_m, pid_n, C, BLOCK_M, BLOCK_N, SEGMENT, tile_expert_ptr, route_ptr, a_rows_ptr, GATHER_A)
        offs_k = tl.arange(0, STEP_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_al  # [BLOCK_M, STEP_K]
        if not B_TMA:
            b_ptrs = b_ptr + expert * stride_be + offs_n[:, None] * stride_bc + offs_k[None, :] * stride_bl
        as_ptrs = as_ptr + a_rows * stride_asm  # [BLOCK_M]
        col0 = pid_n * BLOCK_N
        bs_tile = bs_ptr + expert * stride_bse + (col0 // QBLOCK) * stride_bsc  # the tile's first 128-column block

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if tl.sum(row_ok.to(tl.int32), axis=0) > 0:  # a block of padding only does no work
            num_kb = L // QBLOCK
            a_s, b_s = _block_scales(as_ptrs, bs_tile, 0, True, row_ok, col0, C, stride_asl, stride_bsl, stride_bsc,
                                     BLOCK_N, QBLOCK)
            for kb in range(0, num_kb):  # ascending K blocks: a function of L alone
                # The next block's scales are requested before this block's MMAs, so their global-load latency
                # hides behind them (loaded after the MMA wait, the load would stall every block).
                a_s_next, b_s_next = _block_scales(as_ptrs, bs_tile, kb + 1, kb + 1 < num_kb, row_ok, col0, C,
                                                   stride_asl, stride_bsl, stride_bsc, BLOCK_N, QBLOCK)
                blk = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for kk in tl.static_range(0, QBLOCK, STEP_K):
                    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, STEP_K] e4m3
                    if B_TMA:  # zero fill past C and past the expert: the same values as the masked load
                        b = b_ptr.load([expert, col0, kb * QBLOCK + kk]).reshape(BLOCK_N, STEP_K)
                    else:
                        b = tl.load(b_ptrs, mask=col_ok[:, None], other=0.0)  # [BLOCK_N, STEP_K] e4m3
                        b_ptrs += STEP_K * stride_bl
                    blk = mma_step(blk, a, tl.trans(b), STEP_K, INTERPRETED)
                    a_ptrs += STEP_K * stride_al
                acc += blk * (a_s[:, None] * b_s)  # exact scaling: powers of two
                a_s, b_s = a_s_next, b_s_next

        if EPILOGUE == 0:  # EPI_PLAIN: BF16 out, rounded once (y of the down-projection, the per-route dX)
            store_c_tile(c_ptr, acc, offs_m, offs_n, col_ok, stride_cm, stride_cc, INTERPRETED)
        elif EPILOGUE == 1 or EPILOGUE == 3:  # EPI_FP8_SWIGLU_QUANT, EPI_FP8_SWIGLU: gu, h in BF16 (saved)
            h, offs_h, h_ok = swiglu_epilogue(acc, c_ptr, aux_ptr, offs_m, offs_n, col_ok, pid_n, C, stride_cm, stride_cc,
                                              stride_xm, stride_xc, BLOCK_M, BLOCK_N, INTERPRETED)
            if EPILOGUE == 1:  # and h quantized 1x128 for the down-projection (the tile's h is one block per row)
                hq, hs = quantize_rows(h.to(tl.float32), INTERPRETED)  # from the stored BF16 h
                tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_h[None, :] * stride_qc, hq, mask=h_ok)
                tl.store(qs_ptr + offs_m * stride_qsm + pid_n * stride_qsc, hs)
        else:  # EPI_FP8_DSWIGLU_QUANT: dgu in BF16 (as the BF16 path), then quantized 1x128 for the dX GEMM
            if DSCORE:  # first, from the unscaled accumulator (0 on padding rows: masked loads) and h
                fp8_dscore_partials(acc, h_ptr, ds_ptr, offs_m, pid_n, C, BLOCK_M, BLOCK_N)
            dgu, offs_j, j_ok = dswiglu_epilogue(acc, score_ptr, aux_ptr, c_ptr, offs_m, pid_n, C, stride_xm, stride_xc,
                                                 stride_cm, stride_cc, BLOCK_M, BLOCK_N, INTERPRETED)
            NB: tl.constexpr = 2 * BLOCK_N // QBLOCK  # 1x128 blocks per dgu row of the tile
            dq, ds = quantize_row_blocks(dgu.to(tl.float32), NB, QBLOCK, INTERPRETED)  # from the stored BF16 dgu
            tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_j[None, :] * stride_qc, dq, mask=j_ok)
            offs_b = pid_n * NB + tl.arange(0, NB)
            tl.store(qs_ptr + offs_m[:, None] * stride_qsm + offs_b[None, :] * stride_qsc, ds,
                     mask=(offs_b < 2 * C // QBLOCK)[None, :])


@triton.jit
def _block_scales(as_ptrs, bs_tile, kb, present, row_ok, col0, C, stride_asl, stride_bsl, stride_bsc,
                  BLOCK_N: tl.constexpr, QBLOCK: tl.constexpr):
    """K block kb's scales (zeros where ``present`` is False): a_s [BLOCK_M] per row, and the weight's for the
    tile's columns, one value per 128 columns — a scalar when BLOCK_N <= QBLOCK, else [1, 2 * QBLOCK] from two
    scalars. Scalar loads need no per-block layout conversion, which a [BLOCK_N] vector load did."""
    a_s = tl.load(as_ptrs + kb * stride_asl, mask=row_ok & present, other=0.0)
    b_row = bs_tile + kb * stride_bsl
    b_s = tl.load(b_row, mask=present, other=0.0)
    if BLOCK_N > QBLOCK:  # two column blocks (the fused-quantization up tile); the second may lie past C
        b_hi = tl.load(b_row + stride_bsc, mask=present & (col0 + QBLOCK < C), other=0.0)
        b_s = tl.where(tl.arange(0, BLOCK_N) < QBLOCK, b_s, b_hi)[None, :]
    return a_s, b_s


@triton.jit
def fp8_dscore_partials(acc, h_ptr, ds_ptr, offs_m, pid_n, C, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The FP8 dgrad's dscore partials (DS_GROUP, kernels/moe/common.py): x = acc * h with acc the tile's unscaled
    dout_q @ W2q^T (0 on padding rows) and h the forward's [P, C] BF16; per row, partial 4c + q = the pairwise sum,
    adjacent first, of x at columns 64c + 8j + 2q + b over (j, b) in ascending order (j < 8, b < 2). ds_part is
    [P, C / DS_GROUP], 4 per 64 columns. The order is fixed by the reshapes and splits, not by a layout."""
    NCH: tl.constexpr = BLOCK_N // 64
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.load(h_ptr + offs_m[:, None] * C + offs_n[None, :], mask=(offs_m[:, None] >= 0) & (offs_n < C)[None, :],
                other=0.0)
    x = tl.permute(tl.reshape(acc * h.to(tl.float32), (BLOCK_M, NCH, 8, 4, 2)), (0, 1, 3, 2, 4))  # [M, c, q, j, b]
    lo, hi = tl.split(x)  # b
    lo, hi = tl.split(tl.reshape(lo + hi, (BLOCK_M, NCH, 4, 4, 2)))  # j = 2m, 2m + 1
    lo, hi = tl.split(tl.reshape(lo + hi, (BLOCK_M, NCH, 4, 2, 2)))
    lo, hi = tl.split(lo + hi)
    part = tl.reshape(lo + hi, (BLOCK_M, NCH * 4))
    offs_c = pid_n * (NCH * 4) + tl.arange(0, NCH * 4)
    tl.store(ds_ptr + offs_m[:, None] * (C // DS_GROUP) + offs_c[None, :], part)


@triton.jit(launch_metadata=colwise_quant_launch_name)
def moe_fp8_quant_colwise_kernel(
    src_ptr, rows_ptr, route_ptr, score_ptr, gate_ptr, q_ptr, qs_ptr,
    P, N,  # q[n, p] = e4m3(v[p, n] / s[n, p // QBLOCK]), v[p, :] = src[row(p), :] (* score[p]); 0 on padding
    stride_sm, stride_sn, stride_qn, stride_qp, stride_sn_s, stride_sp_s,
    BLOCK_N: tl.constexpr, QBLOCK: tl.constexpr, GATHER: tl.constexpr, SCALE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_p = pid // num_pid_n
    pid_n = pid % num_pid_n
    if pid_p * QBLOCK < tl.load(gate_ptr):  # a block past the routing's P: not read by the weight gradients
        offs_p = pid_p * QBLOCK + tl.arange(0, QBLOCK)  # one 128-row block: inside one expert segment
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        row_ok = tl.load(route_ptr + offs_p) >= 0
        if GATHER:
            rows = tl.load(rows_ptr + offs_p)
        else:
            rows = offs_p
        v = tl.load(src_ptr + rows[:, None] * stride_sm + offs_n[None, :] * stride_sn,
                    mask=row_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)  # [QBLOCK, BLOCK_N]
        if SCALE:  # dy = s * dout[token] in FP32 (one rounding), quantized directly
            v = v * tl.load(score_ptr + offs_p)[:, None]
        q, scale = quantize_rows(tl.trans(v), INTERPRETED)  # [BLOCK_N, QBLOCK]: 128x1 blocks down the columns
        tl.store(q_ptr + offs_n[:, None] * stride_qn + offs_p[None, :] * stride_qp, q, mask=n_ok[:, None])
        tl.store(qs_ptr + offs_n * stride_sn_s + pid_p * stride_sp_s, scale, mask=n_ok)


@triton.jit(launch_metadata=fp8_wgrad_launch_name)
def moe_fp8_wgrad_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, dw_ptr, offsets_ptr, counts_ptr, gate_ptr,
    R, C,  # dW[e] [R, C] = sum over e's 128-row blocks kb (ascending) of (A_q[:, kb] @ B_q[:, kb]^T) * scales
    stride_ar, stride_ap, stride_asr, stride_asp,  # A_q [R, P] (K = P contiguous), scales [R, P/QBLOCK]
    stride_bc, stride_bp, stride_bsc, stride_bsp,  # B_q [C, P], scales [C, P/QBLOCK]
    stride_we, stride_wr, stride_wc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP_K: tl.constexpr, QBLOCK: tl.constexpr,
    ACCUMULATE: tl.constexpr, INTERPRETED: tl.constexpr,
    TMA: tl.constexpr,  # a_ptr, b_ptr are TMA descriptors over A_q, B_q (boxes [BLOCK_M | BLOCK_N, STEP_K])
    GROUP_M: tl.constexpr,  # each dW[e]'s tiles in the grouped order (bands of GROUP_M row tiles), expert by expert
):
    pid = tl.program_id(axis=0)
    num_pid_r = tl.cdiv(R, BLOCK_M)
    num_pid_c = tl.cdiv(C, BLOCK_N)
    expert = pid // (num_pid_r * num_pid_c)
    pid_r, pid_c = tile_order_tl(pid % (num_pid_r * num_pid_c), num_pid_r, num_pid_c, GROUP_M)
    # Segments are 128-aligned: telling the compiler lets it prove 16-byte-aligned rows for cp.async.
    start = tl.multiple_of(tl.load(offsets_ptr + expert), QBLOCK)
    count = tl.load(counts_ptr + expert)
    offs_r = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, STEP_K)
    r_ok = offs_r < R
    c_ok = offs_c < C
    as_ptrs = as_ptr + offs_r * stride_asr + (start // QBLOCK) * stride_asp  # [BLOCK_M]
    bs_ptrs = bs_ptr + offs_c * stride_bsc + (start // QBLOCK) * stride_bsp  # [BLOCK_N]
    if TMA:  # the next block's scales are requested before this block's MMAs (the grouped kernel's order)
        a_s = tl.load(as_ptrs, mask=r_ok & (count > 0), other=0.0)
        b_s = tl.load(bs_ptrs, mask=c_ok & (count > 0), other=0.0)
    else:
        a_ptrs = a_ptr + offs_r[:, None] * stride_ar + (start + offs_k)[None, :] * stride_ap  # [BLOCK_M, STEP_K]
        b_ptrs = b_ptr + offs_c[:, None] * stride_bc + (start + offs_k)[None, :] * stride_bp  # [BLOCK_N, STEP_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for p0 in range(0, count, QBLOCK):  # the expert's 128-row blocks, ascending: a function of count alone
        if TMA:
            more = p0 + QBLOCK < count
            a_s_next = tl.load(as_ptrs + stride_asp, mask=r_ok & more, other=0.0)
            b_s_next = tl.load(bs_ptrs + stride_bsp, mask=c_ok & more, other=0.0)
        blk = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in tl.static_range(0, QBLOCK, STEP_K):
            if TMA:  # zero fill past R and C: the same values as the masked loads
                a = a_ptr.load([pid_r * BLOCK_M, start + p0 + kk])
                b = b_ptr.load([pid_c * BLOCK_N, start + p0 + kk])
            else:
                a = tl.load(a_ptrs, mask=r_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=c_ok[:, None], other=0.0)
                a_ptrs += STEP_K * stride_ap
                b_ptrs += STEP_K * stride_bp
            blk = mma_step(blk, a, tl.trans(b), STEP_K, INTERPRETED)  # [BLOCK_M, STEP_K] @ [STEP_K, BLOCK_N]
        if not TMA:
            # Loaded after the MMA wait: an exposed latency per block, but requesting them a block ahead spills
            # registers in the pointer variant (8 warps, sm_90); the TMA variant prefetches.
            a_s = tl.load(as_ptrs, mask=r_ok, other=0.0)
            b_s = tl.load(bs_ptrs, mask=c_ok, other=0.0)
        acc += blk * (a_s[:, None] * b_s[None, :])  # exact scaling: powers of two
        if TMA:
            a_s, b_s = a_s_next, b_s_next
        as_ptrs += stride_asp
        bs_ptrs += stride_bsp
    store_wgrad_tile(dw_ptr, acc, expert, count, gate_ptr, offs_r, offs_c, r_ok, c_ok, stride_we, stride_wr, stride_wc,
                     stride_wc, ACCUMULATE, INTERPRETED, False)
