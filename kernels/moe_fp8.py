"""Deterministic block-scaled FP8 (E4M3) MoE expert MLP (SwiGLU) for Hopper: forward and backward.

The same layer, routing and conventions as kernels/moe.py (w1 [E, H, 2I] gate/up interleaved,
w2 [E, I, H], 128-row expert segments from kernels/moe_routing.py); the four data GEMMs run on FP8
operands with the SM90 recipe (kernels/fp8_quant.py): activations in 1x128 blocks along the reduced
dim, weights in 128x128 blocks, power-of-two FP32 scales.

Block-scaled GEMM with per-128-K promotion (one output tile, one program):
    acc = 0 (FP32)
    for kb ascending over L / 128:
        blk = sum over the block's 128 K of a_q[m, k] * b_q[k, n]        FP8 products, FP32 accumulation
        acc = acc + blk * (a_scale[m, kb] * b_scale[kb, n // 128])         exact scaling (powers of two)
Hopper's FP8 wgmma accumulates with reduced precision inside one instruction chain; ending the chain
every 128 K and adding into the FP32 acc bounds that error to one block (DeepSeek-V3's promotion).

Stages (P = padded expert-sorted rows):
    quant   x [T, H] -> x_q, x_s (1x128 along H); dout likewise in the backward   (fp8_quant_rowwise)
    up      gu [P, 2I] bf16 = x_q[gather] @ W1q[e]; epilogue: h = silu(g) * u -> h [P, I] bf16 and
            h_q / h_s = quantize_rowwise(h) (1x128 along I, the down-projection's K): fused when the tile
            is 256 interleaved columns wide, else a row-wise pass over the stored h (the same bits)
    down    y [P, H] bf16 = h_q @ W2q[e] (FP32 accumulation, rounded once)
    combine out = bf16(sum_k s_k y_k) in FP32            (kernels.moe.moe_combine, as the BF16 layer's)
    dgrad   dh = s * (dout_q[gather] @ W2q[e]^T) fp32; dg, du from the saved gu -> dgu [P, 2I] bf16 and,
            fused, dgu_q / dgu_s = quantize_rowwise(dgu) (1x128 along 2I, dX's K), and the dscore partials:
            (dout_q[gather] @ W2q[e]^T) * h summed in fixed groups of 16 columns (fp8_dscore_partials)
    dx      dx_route [P, H] bf16 = dgu_q @ W1q[e]^T, then the ascending-k gather-sum in FP32 (kernels.moe)
    wgrad   wgrad="fp8" (default): x[gather], dgu, h and dy = s * dout[gather] quantized 128x1 down the rows
            (moe_fp8_quant_colwise, transposed to K-major), then the weight gradient per expert with promotion
            every 128 rows (moe_fp8_wgrad_ws_kernel on sm_90, moe_fp8_wgrad_kernel elsewhere);
            wgrad="bf16": kernels.moe.moe_wgrad_w1(x, dgu), moe_wgrad_w2(h, dout)
            (docs/moe_fp8.md: which is the default and why)
    dscore  the partials summed per route in a fixed order (kernels.moe.moe_dscores_from_partials); y is not kept
The fused quantizations read the BF16 values that are stored beside them, so h_q == quantize_rowwise(h)
and dgu_q == quantize_rowwise(dgu) bit for bit (tested): one definition, one reference.

Layouts: every FP8 operand is K-major (the reduced dim contiguous), as Hopper's FP8 wgmma requires.
Activations are row-major with K last. A weight is quantized once into both orientations
(``Fp8Weight.q`` [E, R, C] and ``q_t`` [E, C, R], the same FP8 values): the forward reads W1q_t
[E, 2I, H] and W2q_t [E, H, I], the backward W2q [E, I, H] and W1q [E, H, 2I]; the kernel loads a
[BLOCK_N, BLOCK_K] tile (through pointers, or a TMA descriptor with ``variant="tma"``: the same values)
and transposes it (tl.trans). Each K block's scales are loaded one block ahead, before its MMAs.
``Fp8WeightCache`` keeps the
quantized weights keyed on (data_ptr, _version, shape, stride, dtype, device): an in-place optimizer
step bumps _version and so invalidates the entry.

Determinism: no split-K, no atomics, each output tile owned by one program, K blocks in ascending
order, configs pinned per backend (no autotune). Batch invariance (forward, per token): quantization
is per row, rows are never reduced together, and nothing depends on T or the routing.

On the Triton interpreter: exact FP32 products added one at a time (``kernels.moe.mma_step``; products of
two E4M3 values are exact in FP32) and E4M3 rounding in integer arithmetic (kernels/fp8_quant.py).
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from detkit.kernels.backend import CUDA_SM90, TRITON_INTERPRETER, ensure_cuda_context
from detkit.kernels.det_gemm import GemmConfig, device_sms, interpreter_step_k, tma_descriptor
from detkit.kernels.fp8_quant import (
    FP8_DTYPE, QBLOCK, Fp8Weight, dequantize_rowwise, quant_risk_rowwise, quant_risk_weight, quantize_colwise_ref,
    quantize_row_blocks, quantize_rowwise, quantize_rowwise_ref, quantize_rows, quantize_weight, quantize_weight_ref,
)
from detkit.kernels.moe import (
    MoeGrads, check_dout, check_grouped_config, check_main_grads, check_moe_inputs, check_moe_variant,
    dswiglu_epilogue, grouped_tile, launch_checked_routing, layer_stage_names, mma_step, moe_combine,
    moe_dscores_from_partials, moe_gather_sum, moe_wgrad_w1, moe_wgrad_w2, pinned_stage_config,
    store_c_tile, swiglu_epilogue, tile_is_live, to_bf16, weight_descriptor,
)
from detkit.kernels.moe_fp8_ws import (
    DS_GROUP, fp8_stage_name, grouped_launch_metadata, launch_fp8_wgrad_ws, launch_fp8_ws, launch_fp8_ws_gather,
    wgrad_launch_metadata,
)
from detkit.kernels.moe_routing import SEGMENT_ALIGN, MoeRouting

# ---------------------------------------------------------------------------------------------
# Pinned config tables (no autotune). block_k is the K step of one tl.dot; it must divide QBLOCK.
# up: BLOCK_N = 2 * QBLOCK interleaved columns quantizes h in the epilogue (one 1x128 block per row); a
# narrower tile leaves it to the row-wise pass over the stored h (same values);
# dgrad: BLOCK_N = QBLOCK / 2 or QBLOCK columns of dh, so a tile's dgu (2 * BLOCK_N) is one or two blocks per row.
# The sm_90 entries are compile-checked (wgmma on e4m3, shared memory, no spills) and timed on an H200
# (bench/moe_tune.py; comments below).
# ---------------------------------------------------------------------------------------------
MOE_FP8_CONFIG_TABLE_VERSION = "2026-11-30.14"
FP8_STAGES = ("up", "down", "dgrad", "dx")

MOE_FP8_CONFIGS: dict[str, dict[str, GemmConfig]] = {
    CUDA_SM90: {
        # 128 interleaved columns (64 of h: h quantized by the row-wise pass), TMA weight tile, 4 warps: 1590 µs
        # against 1975 for the fused 64x256 8-warp tile (the pass included; reports/2026-11-30-h200/fp8-up).
        # Table .9: up on the Gluon kernel with the gathered A (4-warp cp.async producer, two consumer warpgroups,
        # SwiGLU epilogue through shared memory + TMA store; h quantized by the row-wise pass): 1335 vs 1588 µs at the
        # reference shape, 656 vs 593 at Qwen3-30B-A3B (reports/2026-11-30-h200/fp8-table9, bit-equal).
        "up": GemmConfig(128, 128, 128, 1, 8, 4, "ws"),
        # H200 sweep reports/2026-11-29-h200-table7/moe-tune-fp8 (reference shape, every candidate bit-equal):
        # TMA weight tiles with 4 warps, 704 / 475 / 831 TFLOP/s against 620 / 367 / 745 for the
        # 8-warp pointer picks they replace (the 4-warp dgrad spills 272 bytes on sm_90 and is still faster).
        # down and dX then on 3 stages instead of 4 (reports/2026-11-30-h200/fp8-down-dx, same bits):
        # 807 vs 652 and 840 vs 812 TFLOP/s.
        # Table .7: down and dX on the warp-specialized Gluon kernel (kernels/moe_fp8_ws.py: promotion of block kb
        # while kb+1's MMAs run, persistent, TMA store), 128x128 with two consumer warpgroups, 5 stages: down 997 vs
        # 768, dX 1101 vs 831 TFLOP/s at the reference shape, 644 vs 557 and 827 vs 724 at Qwen3-30B-A3B
        # (reports/2026-11-30-h200/fp8-ws, every candidate bit-equal to the Triton tile).
        "down": GemmConfig(128, 128, 128, 1, 8, 5, "ws"),
        # Table .9: dgrad+dSwiGLU+1x128 quantization on the Gluon kernel (gathered dy, 128x64, 6 stages): 1161 vs
        # 1294 µs at the reference shape, 609 vs 634 at Qwen3-30B-A3B (same report, bit-equal). Table .10: 128 columns
        # of dh (two dgu scale blocks per row), 972 vs 1159 and 472 vs 611 µs (reports/2026-11-30-h200/fp8-table10).
        # Table .11: dgu and dgu_q out through shared memory and TMA stores, 4 stages (the store buffers take 96 KB).
        "dgrad": GemmConfig(128, QBLOCK, 128, 1, 8, 4, "ws"),
        "dx": GemmConfig(128, 128, 128, 1, 8, 5, "ws"),
    },
    TRITON_INTERPRETER: {  # few large programs: the interpreter's cost is per op
        "up": GemmConfig(128, 2 * QBLOCK, 128, 1, 4, 1),
        "down": GemmConfig(128, 128, 128, 1, 4, 1),
        "dgrad": GemmConfig(128, QBLOCK // 2, 128, 1, 4, 1),
        "dx": GemmConfig(128, 128, 128, 1, 4, 1),
    },
}

# The weight gradients run on kernels/moe.py's BF16 wgrad kernel: its own pinned table on the GPU; on the
# interpreter one large tile per expert (the bits do not depend on the tile there: sequential
# accumulation over the expert's rows) keeps CPU runs short.
WGRAD_CONFIGS: dict[str, GemmConfig | None] = {CUDA_SM90: None, TRITON_INTERPRETER: GemmConfig(128, 256, 32, 1, 4, 1)}

# The FP8 weight gradient (wgrad="fp8"): BLOCK_M x BLOCK_N of dW per program, STEP_K rows per dot; the
# column-wise quantizer: QUANT_COLWISE_CONFIGS below.
FP8_WGRAD_CONFIGS: dict[str, GemmConfig] = {
    # Both operands by TMA, 4 warps, 3 stages: 624 TFLOP/s at the reference shape for dW1 and dW2 against ~205 for
    # table .4's 128x128 8-warp pointer tile (reports/2026-11-30-h200/fp8-wgrad-tma, every candidate bit-equal).
    # The Gluon kernel (variant "ws", 128x64, 8 warps, 6 stages) gives the same bits and ran at 467-469 against 620
    # TFLOP/s (table ".8", tried and not kept: reports/2026-11-30-h200/fp8-wgrad-ws); its per-column scales are
    # strided loads (the column-wise scales are stored [columns, P/128]). Table .13: the Gluon kernel with each K
    # block's scale rows staged in shared memory by TMA, 128x128, 8 warps, 5 stages: 838-840 TFLOP/s against 768-775
    # for the Triton tile above at the reference shape, same bits (reports/2026-11-30-h200-s9).
    CUDA_SM90: GemmConfig(128, 128, 128, 1, 8, 5, "ws"),
    TRITON_INTERPRETER: GemmConfig(128, 256, 128, 1, 4, 1),
}
# The column-wise quantizer's tile: block_m = QBLOCK rows (one scale block) x block_n columns, num_warps
# (block_k, group_m, num_stages unused: no K loop).
QUANT_COLWISE_CONFIGS: dict[str, GemmConfig] = {
    # 128 columns, 4 warps: x (gathered) 221 vs 231 us, dgu 222 vs 240 us for the 64-column tile at the reference
    # shape (reports/2026-11-30-h200/fp8-table5/moe-tune, same bits); 8 warps and 256 columns were slower. Table
    # .13: 64 columns, 2 warps: x 192 vs 217 us, dgu 191 vs 219 (T=16384: 378 vs 425, 374 vs 425;
    # reports/2026-11-30-h200-s9/call1/moe-tune).
    CUDA_SM90: GemmConfig(QBLOCK, 64, 16, 1, 2, 1),
    TRITON_INTERPRETER: GemmConfig(QBLOCK, 256, 16, 1, 4, 1),
}
WGRAD_MODES = ("bf16", "fp8")
# The rule: the weight-gradient GEMMs that pass the precision gate faster. Both pass; the FP8 ones are faster
# in the layer (docs/moe_fp8.md: measured, with the precision each gives).
DEFAULT_WGRAD = "fp8"
OTHER_WGRAD = next(m for m in WGRAD_MODES if m != DEFAULT_WGRAD)  # the mode the bench and the audit run beside it

# EPI_PLAIN: the accumulator rounded once to C's dtype (BF16: y, dx_route)
EPI_PLAIN, EPI_SWIGLU_QUANT, EPI_DSWIGLU_QUANT, EPI_SWIGLU = 0, 1, 2, 3


def select_moe_fp8_config(stage: str, backend: str) -> GemmConfig:
    return pinned_stage_config(MOE_FP8_CONFIGS, stage, backend, what="FP8 MoE")


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------
@triton.jit(launch_metadata=grouped_launch_metadata)
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
    DSCORE: tl.constexpr = False,
):
    # A tile at or past the routing's P (the up GEMM is queued over the largest P before the host has read it) or of
    # a refused batch does nothing.
    if tile_is_live(gate_ptr, C, BLOCK_N, BLOCK_M):
        pid_n, expert, offs_m, offs_n, row_ok, col_ok, a_rows = grouped_tile(
            C, BLOCK_M, BLOCK_N, SEGMENT, tile_expert_ptr, route_ptr, a_rows_ptr, GATHER_A)
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
                # hides behind them (loaded after the MMA wait, it stalled every block: sm_90 TTGIR).
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

        if EPILOGUE == 0:  # BF16 out, rounded once (y of the down-projection, the per-route dX)
            store_c_tile(c_ptr, acc, offs_m, offs_n, col_ok, stride_cm, stride_cc, INTERPRETED)
        elif EPILOGUE == 1 or EPILOGUE == 3:  # SwiGLU: gu, h in BF16 (saved)
            h, offs_h, h_ok = swiglu_epilogue(acc, c_ptr, aux_ptr, offs_m, offs_n, col_ok, pid_n, C, stride_cm, stride_cc,
                                              stride_xm, stride_xc, BLOCK_M, BLOCK_N, INTERPRETED)
            if EPILOGUE == 1:  # and h quantized 1x128 for the down-projection (the tile's h is one block per row)
                hq, hs = quantize_rows(h.to(tl.float32), INTERPRETED)  # from the stored BF16 h
                tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_h[None, :] * stride_qc, hq, mask=h_ok)
                tl.store(qs_ptr + offs_m * stride_qsm + pid_n * stride_qsc, hs)
        else:  # dSwiGLU: dgu in BF16 (as the BF16 path), then quantized 1x128 for the dX GEMM
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
    """The FP8 dgrad's dscore partials (kernels/moe_fp8_ws.py DS_GROUP): x = acc * h with acc the tile's unscaled
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


def _colq_meta(grid, metadata, args):
    return {"name": fp8_stage_name("moe_fp8_quant_colwise", P=args["P"], N=args["N"])}


@triton.jit(launch_metadata=_colq_meta)
def moe_fp8_quant_colwise_kernel(
    src_ptr, rows_ptr, route_ptr, score_ptr, q_ptr, qs_ptr,
    P, N,  # q[n, p] = e4m3(v[p, n] / s[n, p // QBLOCK]), v[p, :] = src[row(p), :] (* score[p]); 0 on padding
    stride_sm, stride_sn, stride_qn, stride_qp, stride_sn_s, stride_sp_s,
    BLOCK_N: tl.constexpr, QBLOCK: tl.constexpr, GATHER: tl.constexpr, SCALE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_p = pid // num_pid_n
    pid_n = pid % num_pid_n
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
    # (Quantizing in the load's layout and transposing the e4m3 tile instead gave the same bits in the same time on
    # the H200: reports/2026-11-30-h200-s9/colq_ab.py.)
    q, scale = quantize_rows(tl.trans(v), INTERPRETED)  # [BLOCK_N, QBLOCK]: 128x1 blocks down the columns
    tl.store(q_ptr + offs_n[:, None] * stride_qn + offs_p[None, :] * stride_qp, q, mask=n_ok[:, None])
    tl.store(qs_ptr + offs_n * stride_sn_s + pid_p * stride_sp_s, scale, mask=n_ok)


@triton.jit(launch_metadata=wgrad_launch_metadata)
def moe_fp8_wgrad_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, dw_ptr, offsets_ptr, counts_ptr,
    R, C,  # dW[e] [R, C] = sum over e's 128-row blocks kb (ascending) of (A_q[:, kb] @ B_q[:, kb]^T) * scales
    stride_ar, stride_ap, stride_asr, stride_asp,  # A_q [R, P] (K = P contiguous), scales [R, P/QBLOCK]
    stride_bc, stride_bp, stride_bsc, stride_bsp,  # B_q [C, P], scales [C, P/QBLOCK]
    stride_we, stride_wr, stride_wc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP_K: tl.constexpr, QBLOCK: tl.constexpr,
    ACCUMULATE: tl.constexpr, INTERPRETED: tl.constexpr,
    TMA: tl.constexpr,  # a_ptr, b_ptr are TMA descriptors over A_q, B_q (boxes [BLOCK_M | BLOCK_N, STEP_K])
):
    pid = tl.program_id(axis=0)
    num_pid_r = tl.cdiv(R, BLOCK_M)
    num_pid_c = tl.cdiv(C, BLOCK_N)
    expert = pid // (num_pid_r * num_pid_c)
    rem = pid % (num_pid_r * num_pid_c)
    pid_r = rem // num_pid_c
    pid_c = rem % num_pid_c
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
            # Loaded after the MMA wait (an exposed latency per block; the prefetch spilled 24 bytes here with
            # 8 warps on sm_90): the pointer variant as first measured on the H200.
            a_s = tl.load(as_ptrs, mask=r_ok, other=0.0)
            b_s = tl.load(bs_ptrs, mask=c_ok, other=0.0)
        acc += blk * (a_s[:, None] * b_s[None, :])  # exact scaling: powers of two
        if TMA:
            a_s, b_s = a_s_next, b_s_next
        as_ptrs += stride_asp
        bs_ptrs += stride_bsp
    w_ptrs = dw_ptr + expert * stride_we + offs_r[:, None] * stride_wr + offs_c[None, :] * stride_wc
    w_mask = r_ok[:, None] & c_ok[None, :]
    if ACCUMULATE:  # main_grad += dW in FP32; an expert without rows leaves it untouched
        w_mask = w_mask & (count > 0)
        tl.store(w_ptrs, tl.load(w_ptrs, mask=w_mask, other=0.0) + acc, mask=w_mask)
    else:
        tl.store(w_ptrs, to_bf16(acc, INTERPRETED), mask=w_mask)


# ---------------------------------------------------------------------------------------------
# Input checks (all before any work) and the weight cache
# ---------------------------------------------------------------------------------------------
def check_moe_fp8_inputs(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                         scores: torch.Tensor) -> str:
    """The BF16 path's checks, plus the FP8 block: H and I multiples of 128. Returns the backend."""
    backend = check_moe_inputs(x, w1, w2, topk_ids, scores)
    hidden, inter = x.shape[1], w2.shape[1]
    if hidden % QBLOCK or inter % QBLOCK:
        raise ValueError(f"the FP8 path needs H and I multiples of {QBLOCK} (1x128 / 128x128 blocks); "
                         f"got H = {hidden}, I = {inter}")
    return backend


def check_wgrad_mode(wgrad: str) -> None:
    if wgrad not in WGRAD_MODES:
        raise ValueError(f"wgrad {wgrad!r} is not supported; supported: {WGRAD_MODES}")


class Fp8WeightCache:
    """Quantized weights, valid for (data_ptr, _version, shape, stride, dtype, device). An in-place update
    through autograd-visible ops (optimizer.step, ``w.add_`` under no_grad) bumps ``_version``: the next
    lookup misses and re-quantizes into the same slot (one slot per weight, so stale versions never pile
    up); least recently used slots beyond ``capacity`` are dropped (size it to 2 x the MoE layers of a
    model). Writes through ``w.data`` bypass the version counter: call ``clear()`` after those. A slot
    holds a reference to its tensor, so its memory (and data_ptr) cannot be reused by another tensor."""

    def __init__(self, capacity: int = 128):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int; got {capacity!r}")
        self.capacity = capacity
        self._slots: OrderedDict[tuple, tuple[torch.Tensor, int, Fp8Weight]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def slot(w: torch.Tensor) -> tuple:
        return (w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, str(w.device))

    def get(self, w: torch.Tensor) -> Fp8Weight:
        slot = self.slot(w)
        entry = self._slots.get(slot)
        if entry is not None and entry[1] == w._version:
            self._slots.move_to_end(slot)
            self.hits += 1
            return entry[2]
        self.misses += 1
        with torch.no_grad():
            fw = quantize_weight(w.detach())
        self._slots[slot] = (w, w._version, fw)
        self._slots.move_to_end(slot)
        while len(self._slots) > self.capacity:
            self._slots.popitem(last=False)
        return fw

    def clear(self) -> None:
        self._slots.clear()

    def __len__(self) -> int:
        return len(self._slots)


WEIGHT_CACHE = Fp8WeightCache()


# ---------------------------------------------------------------------------------------------
# Launch wrappers: check, allocate, launch.
# ---------------------------------------------------------------------------------------------
def _grouped(op_id: int, stage: str, a: torch.Tensor, a_s: torch.Tensor, gather: bool, b: torch.Tensor,
             b_s: torch.Tensor, c: torch.Tensor, aux: torch.Tensor | None, q: torch.Tensor | None,
             q_s: torch.Tensor | None, routing: MoeRouting, epilogue: int, backend: str,
             config: GemmConfig | None, dscore: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """b: [E, C, L] K-major FP8 view; b_s: [E, L/128, C/128] view (strides kept); ``dscore = (h, ds_part)`` (dgrad):
    the dscore partials [P, C / DS_GROUP] are written too, from the forward's h [P, C]."""
    config = config or select_moe_fp8_config(stage, backend)
    if config.variant == "ws":
        _check_ws(stage, config, gather, epilogue, backend)
    else:
        check_grouped_config(stage, config)
    if QBLOCK % config.block_k:
        raise ValueError(f"{stage}: BLOCK_K {config.block_k} must divide the FP8 block {QBLOCK}")
    if QBLOCK % config.block_n and config.block_n != 2 * QBLOCK:  # a tile spans one or two weight-scale blocks
        raise ValueError(f"{stage}: BLOCK_N {config.block_n} must divide the FP8 block {QBLOCK} or be {2 * QBLOCK}")
    want_n = {EPI_SWIGLU_QUANT: (2 * QBLOCK,), EPI_DSWIGLU_QUANT: (QBLOCK // 2, QBLOCK)}.get(epilogue)
    if want_n is not None and config.block_n not in want_n:
        raise ValueError(f"{stage}: the fused 1x{QBLOCK} quantization needs BLOCK_N in {want_n}; got {config.block_n}")
    if dscore is not None and config.block_n % 64:
        raise ValueError(f"{stage}: the dscore partials sum 64-column chunks: BLOCK_N must be a multiple of 64; got "
                         f"{config.block_n}")
    p = routing.padded_rows
    if p == 0:
        return
    if config.variant == "ws":  # the Gluon kernels (their descriptors encode on this thread, as TMA's do)
        ensure_cuda_context(a.device)
        if gather:
            outputs = ({"gu": c, "h": aux} if epilogue == EPI_SWIGLU else
                       {"score": routing.row_score, "gu": aux, "dgu": c, "dgu_q": q, "dgu_s": q_s})
            if dscore is not None:
                outputs["h"], outputs["ds_part"] = dscore
            launch_fp8_ws_gather(op_id, stage, config, epilogue, a, a_s, b, b_s, outputs, routing.gather_token,
                                 routing.sorted_route, routing.tile_expert, routing.gate, p, SEGMENT_ALIGN,
                                 device_sms(a.device))
        else:
            launch_fp8_ws(op_id, stage, config, a, a_s, b, b_s, c, routing.sorted_route, routing.tile_expert, p,
                          SEGMENT_ALIGN, device_sms(a.device))
        return
    n_cols, reduced = b.shape[1], b.shape[2]
    aux_t = aux if aux is not None else c
    q_t = q if q is not None else a
    qs_t = q_s if q_s is not None else a_s
    interpreted = backend == TRITON_INTERPRETER
    step_k = interpreter_step_k(config) if interpreted else config.block_k
    b_arg = b
    if config.variant == "tma":  # FP8 weights are always K-major and 16-byte aligned: TMA can address them
        b_arg, k_major = weight_descriptor(b.transpose(1, 2), config.block_n, step_k)
        if not k_major:
            raise ValueError(f"{stage}: variant 'tma' needs the K-major FP8 weight [E, C, L]; got strides {b.stride()}")
    grid = (triton.cdiv(p, config.block_m) * triton.cdiv(n_cols, config.block_n),)
    moe_fp8_grouped_gemm_kernel[grid](
        a, a_s, routing.gather_token, b_arg, b_s, c, aux_t, q_t, qs_t,
        routing.sorted_route, routing.row_score, routing.tile_expert, routing.gate,
        *(dscore if dscore is not None else (c, c)),
        p, n_cols, reduced,
        a.stride(0), a.stride(1), a_s.stride(0), a_s.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        b_s.stride(0), b_s.stride(1), b_s.stride(2),
        c.stride(0), c.stride(1),
        aux_t.stride(0), aux_t.stride(1),
        q_t.stride(0), q_t.stride(1), qs_t.stride(0), qs_t.stride(1),
        op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        STEP_K=step_k, QBLOCK=QBLOCK, SEGMENT=SEGMENT_ALIGN, GATHER_A=gather, EPILOGUE=epilogue,
        INTERPRETED=interpreted, B_TMA=config.variant == "tma", DSCORE=dscore is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def _check_ws(stage: str, config: GemmConfig, gather: bool, epilogue: int, backend: str) -> None:
    """Variant "ws" (kernels/moe_fp8_ws.py): the Gluon kernels, sm_90 only, for the stages they cover."""
    if backend != CUDA_SM90:
        raise ValueError(f"{stage}: variant 'ws' is a Gluon kernel for sm_90 and has no {backend!r} path; use a "
                         "'ptr' or 'tma' config there")
    if (gather, epilogue) not in ((False, EPI_PLAIN), (True, EPI_SWIGLU), (True, EPI_DSWIGLU_QUANT)):
        raise ValueError(f"{stage}: variant 'ws' covers down, dX, the up-projection with h quantized by the row-wise "
                         "pass (BLOCK_N 128), dgrad (BLOCK_N 64 or 128) and the FP8 weight gradient; use a 'ptr' or 'tma' "
                         "config for the fused up tile")
    # Two warpgroups on 128-row tiles (64 rows each), one on 64-row tiles, or (the gathered kernel) two taking 64-row
    # tiles in turn: ping-pong, BLOCK_M 64 with 8 warps.
    ping_pong = gather and (config.block_m, config.num_warps) == (64, 8)
    if config.block_m != 64 * (config.num_warps // 4) and not ping_pong:
        raise ValueError(f"{stage}: variant 'ws' gives each consumer warpgroup (4 warps) 64 rows: BLOCK_M 64 with 4 "
                         f"warps or 128 with 8 (or, up and dgrad, 64 with 8: ping-pong); got BLOCK_M {config.block_m}, "
                         f"{config.num_warps} warps")


def moe_fp8_up_swiglu(x_q: torch.Tensor, x_s: torch.Tensor, w1f: Fp8Weight, routing: MoeRouting, backend: str,
                      config: GemmConfig | None = None):
    """gu [P, 2I] bf16 = x_q[gather] @ W1q[e]; h [P, I] bf16 = silu(g) * u; h_q [P, I] e4m3, h_s [P, I/128].

    h_q, h_s = quantize_rowwise(h) either way: fused into the epilogue when the tile is 2 x 128 interleaved
    columns wide (its h is one 1x128 block per row), else by the row-wise quantizer over the stored h."""
    gu, h, h_q, h_s = _up_gemm(x_q, x_s, w1f, routing, backend, config)
    return (gu, h, *_quantized_h(h, h_q, h_s))


def _up_gemm(x_q: torch.Tensor, x_s: torch.Tensor, w1f: Fp8Weight, routing: MoeRouting, backend: str,
             config: GemmConfig | None = None):
    """The up GEMM of ``moe_fp8_up_swiglu`` over ``routing`` (an exact one, or a PendingRouting's bound: the
    kernels then skip every tile past the P on the device): gu, h, and h_q, h_s when the tile quantizes h in its
    epilogue (else None: ``_quantized_h``)."""
    config = config or select_moe_fp8_config("up", backend)
    p, two_i = routing.padded_rows, w1f.q.shape[2]
    dev = x_q.device
    gu = torch.empty((p, two_i), dtype=torch.bfloat16, device=dev)
    h = torch.empty((p, two_i // 2), dtype=torch.bfloat16, device=dev)
    h_q = h_s = None
    fused = config.block_n == 2 * QBLOCK
    if fused:
        h_q = torch.empty((p, two_i // 2), dtype=FP8_DTYPE, device=dev)
        h_s = torch.empty((p, two_i // 2 // QBLOCK), dtype=torch.float32, device=dev)
    _grouped(0, "up", x_q, x_s, True, w1f.q_t, w1f.scale, gu, h, h_q, h_s, routing,
             EPI_SWIGLU_QUANT if fused else EPI_SWIGLU, backend, config)
    return gu, h, h_q, h_s


def _quantized_h(h: torch.Tensor, h_q: torch.Tensor | None, h_s: torch.Tensor | None):
    """h_q, h_s: the up epilogue's, else the row-wise pass over the stored h (empty at P = 0: the pass refuses an
    empty h)."""
    if h_q is not None:
        return h_q, h_s
    if h.shape[0] == 0:
        return (torch.empty(h.shape, dtype=FP8_DTYPE, device=h.device),
                torch.empty((0, h.shape[1] // QBLOCK), dtype=torch.float32, device=h.device))
    return quantize_rowwise(h)


def moe_fp8_down(h_q: torch.Tensor, h_s: torch.Tensor, w2f: Fp8Weight, routing: MoeRouting, backend: str,
                 config: GemmConfig | None = None) -> torch.Tensor:
    """y [P, H] bf16 = h_q @ W2q[e] (FP32 accumulation, rounded once; the combine sums in FP32 and rounds again:
    half the bytes of an FP32 y to write and to read back)."""
    y = torch.empty((routing.padded_rows, w2f.q.shape[2]), dtype=torch.bfloat16, device=h_q.device)
    _grouped(1, "down", h_q, h_s, False, w2f.q_t, w2f.scale, y, None, None, None, routing, EPI_PLAIN, backend, config)
    return y


def moe_fp8_dgrad(dout_q: torch.Tensor, dout_s: torch.Tensor, w2f: Fp8Weight, gu: torch.Tensor, routing: MoeRouting,
                  backend: str, config: GemmConfig | None = None, h: torch.Tensor | None = None):
    """dgu [P, 2I] bf16: dSwiGLU of dh = s * (dout_q[gather] @ W2q[e]^T); dgu_q e4m3, dgu_s [P, 2I/128]; with the
    forward's ``h`` [P, I], from the same accumulator the dscore partials ds_part [P, I/16] FP32
    (``fp8_dscore_partials``: (dout_q[gather] @ W2q[e]^T) * h in fixed groups of 16 columns), else None."""
    p, two_i = gu.shape
    if h is not None and (h.shape != (p, two_i // 2) or not h.is_contiguous()):
        raise ValueError(f"dgrad: h must be the forward's contiguous [P, I] = [{p}, {two_i // 2}]; got "
                         f"{tuple(h.shape)} with strides {h.stride()}")
    dgu = torch.empty_like(gu)
    dgu_q = torch.empty((p, two_i), dtype=FP8_DTYPE, device=gu.device)
    dgu_s = torch.empty((p, two_i // QBLOCK), dtype=torch.float32, device=gu.device)
    ds_part = None if h is None else torch.empty((p, two_i // 2 // DS_GROUP.value), dtype=torch.float32,
                                                 device=gu.device)
    # B = W2[e]^T [K=H, N=I]: K-major storage is W2q itself [E, I, H]; its scales seen as [E, H/128, I/128].
    _grouped(2, "dgrad", dout_q, dout_s, True, w2f.q, w2f.scale.transpose(1, 2), dgu, gu, dgu_q, dgu_s, routing,
             EPI_DSWIGLU_QUANT, backend, config, None if h is None else (h, ds_part))
    return dgu, dgu_q, dgu_s, ds_part


def moe_fp8_dgrad_dswiglu(dout_q: torch.Tensor, dout_s: torch.Tensor, w2f: Fp8Weight, gu: torch.Tensor,
                          routing: MoeRouting, backend: str, config: GemmConfig | None = None):
    """``moe_fp8_dgrad`` without the dscore partials: (dgu, dgu_q, dgu_s)."""
    return moe_fp8_dgrad(dout_q, dout_s, w2f, gu, routing, backend, config)[:3]


def moe_fp8_dx_route(dgu_q: torch.Tensor, dgu_s: torch.Tensor, w1f: Fp8Weight, routing: MoeRouting, backend: str,
                     config: GemmConfig | None = None) -> torch.Tensor:
    """dx_route [P, H] bf16 = dgu_q @ W1q[e]^T (FP32 accumulation, rounded once; the gather-sum sums in FP32)."""
    dxr = torch.empty((routing.padded_rows, w1f.q.shape[1]), dtype=torch.bfloat16, device=dgu_q.device)
    _grouped(3, "dx", dgu_q, dgu_s, False, w1f.q, w1f.scale.transpose(1, 2), dxr, None, None, None, routing,
             EPI_PLAIN, backend, config)
    return dxr


def moe_fp8_quant_colwise(src: torch.Tensor, routing: MoeRouting, backend: str, gather: bool,
                          scale: bool, config: GemmConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-wise (128x1) quantization of the expert-sorted rows v [P, N] (v[p] = src[gather_token[p]] when
    ``gather``, times row_score[p] when ``scale``): q_t [N, P] e4m3 (K-major for a GEMM over the rows),
    scales [N, P/128] (stored [P/128, N]: a 128-row block's scales of consecutive columns are adjacent, as the
    weight gradients read them). A 128-row block never straddles two experts (128-aligned segments)."""
    p, n = routing.padded_rows, src.shape[1]
    q = torch.empty((n, p), dtype=FP8_DTYPE, device=src.device)
    s = torch.empty((p // QBLOCK, n), dtype=torch.float32, device=src.device).t()
    if p == 0:
        return q, s
    config = config or QUANT_COLWISE_CONFIGS[backend]
    if config.block_m != QBLOCK:
        raise ValueError(f"quant_colwise: block_m must be the scale block {QBLOCK} (one scale per column per "
                         f"program); got {config.block_m}")
    cols = config.block_n
    moe_fp8_quant_colwise_kernel[(routing.num_tiles * triton.cdiv(n, cols),)](
        src, routing.gather_token, routing.sorted_route, routing.row_score, q, s, p, n,
        src.stride(0), src.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
        BLOCK_N=cols, QBLOCK=QBLOCK, GATHER=gather, SCALE=scale, INTERPRETED=backend == TRITON_INTERPRETER,
        num_warps=config.num_warps,
    )
    return q, s


def moe_fp8_wgrad(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
                  routing: MoeRouting, backend: str, main_grad: torch.Tensor | None = None,
                  config: GemmConfig | None = None) -> torch.Tensor | None:
    """dW[e] [R, C] = sum over e's rows of A^T B from column-wise FP8 operands a_q [R, P], b_q [C, P]
    (scales [R, P/128], [C, P/128]), per-128-row promotion; BF16, or main_grad += it in FP32 (None)."""
    config = config or FP8_WGRAD_CONFIGS[backend]
    if config.variant == "ws":
        _check_ws("wgrad", config, False, EPI_PLAIN, backend)
    else:
        check_moe_variant("wgrad", config)
    if QBLOCK % config.block_k:
        raise ValueError(f"wgrad: BLOCK_K {config.block_k} must divide the FP8 block {QBLOCK}")
    experts, (r, c) = routing.num_experts, (a_q.shape[0], b_q.shape[0])
    interpreted = backend == TRITON_INTERPRETER
    step_k = interpreter_step_k(config) if interpreted else config.block_k
    if a_q.shape[1] == 0:  # no routed rows (T = 0): dW = 0, and TMA cannot describe an empty operand
        return None if main_grad is not None else torch.zeros((experts, r, c), dtype=torch.bfloat16, device=a_q.device)
    out = main_grad if main_grad is not None else torch.empty((experts, r, c), dtype=torch.bfloat16, device=a_q.device)
    if config.variant == "ws":
        ensure_cuda_context(a_q.device)
        launch_fp8_wgrad_ws(config, a_q, a_s, b_q, b_s, out, main_grad is not None, routing.expert_offsets,
                            routing.expert_counts, experts, device_sms(a_q.device))
        return None if main_grad is not None else out
    a_arg, b_arg = a_q, b_q
    if config.variant == "tma":  # the column-wise quantizer's [rows, P] outputs; anything else is refused by name
        (a_arg, a_t), (b_arg, b_t) = (tma_descriptor(name, t, t, (blk, step_k)) for name, t, blk in
                                      (("a_q", a_q, config.block_m), ("b_q", b_q, config.block_n)))
        if a_t or b_t:  # the kernel reads [rows, STEP_K] boxes: rows-major storage only
            raise ValueError(f"wgrad: variant 'tma' needs a_q and b_q with unit-stride rows; got strides "
                             f"{a_q.stride()} and {b_q.stride()}; use a 'ptr' config")
        if a_q.is_cuda:
            ensure_cuda_context(a_q.device)
    grid = (experts * triton.cdiv(r, config.block_m) * triton.cdiv(c, config.block_n),)
    moe_fp8_wgrad_kernel[grid](
        a_arg, a_s, b_arg, b_s, out, routing.expert_offsets, routing.expert_counts, r, c,
        a_q.stride(0), a_q.stride(1), a_s.stride(0), a_s.stride(1),
        b_q.stride(0), b_q.stride(1), b_s.stride(0), b_s.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, STEP_K=step_k, QBLOCK=QBLOCK,
        ACCUMULATE=main_grad is not None, INTERPRETED=interpreted, TMA=config.variant == "tma",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return None if main_grad is not None else out


def moe_fp8_wgrads(x: torch.Tensor, h: torch.Tensor, dgu: torch.Tensor, dout: torch.Tensor, routing: MoeRouting,
                   backend: str, main_grads=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dW1 = x[gather]^T dgu and dW2 = h^T (s * dout[gather]) with every operand quantized 128x1 along the rows."""
    mg1, mg2 = main_grads if main_grads is not None else (None, None)
    xq, xs = moe_fp8_quant_colwise(x, routing, backend, gather=True, scale=False)
    gq, gs = moe_fp8_quant_colwise(dgu, routing, backend, gather=False, scale=False)
    dw1 = moe_fp8_wgrad(xq, xs, gq, gs, routing, backend, mg1)
    hq, hs = moe_fp8_quant_colwise(h, routing, backend, gather=False, scale=False)
    yq, ys = moe_fp8_quant_colwise(dout, routing, backend, gather=True, scale=True)
    dw2 = moe_fp8_wgrad(hq, hs, yq, ys, routing, backend, mg2)
    return dw1, dw2


# ---------------------------------------------------------------------------------------------
# Whole-layer forward / backward and the autograd Function
# ---------------------------------------------------------------------------------------------
@dataclass
class MoeFp8Saved:
    """What the backward needs: gu, h bf16 (h for dW2; the dscores come from the dgrad's accumulator and gu, so y is
    not kept); the FP8 weights used."""

    backend: str
    routing: MoeRouting
    x: torch.Tensor  # [T, H] bf16 (the BF16 dW1)
    w1: torch.Tensor
    w2: torch.Tensor
    w1f: Fp8Weight
    w2f: Fp8Weight
    scores: torch.Tensor  # [T, K]
    gu: torch.Tensor  # [P, 2I] bf16 interleaved
    h: torch.Tensor  # [P, I] bf16
    h_q: torch.Tensor  # [P, I] e4m3 and its scales [P, I/128]: the down-projection's operand (audits)
    h_s: torch.Tensor


FP8_LAYER_STAGES = ("routing", "quant_x", "weights", "up_swiglu", "down", "combine", "quant_dout", "dgrad_dswiglu",
                    "dx", "wgrad", "dscores")


def _names(x: torch.Tensor, w1: torch.Tensor, k: int) -> dict[str, str]:
    return layer_stage_names(x, w1, k, FP8_LAYER_STAGES, "fp8")


def moe_mlp_fp8_fwd(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                    scores: torch.Tensor, *, stage_range=None,
                    weight_cache: Fp8WeightCache | None = WEIGHT_CACHE) -> tuple[torch.Tensor, MoeFp8Saved]:
    """out [T, H] bf16 and the saved state for ``moe_mlp_fp8_bwd``. Inputs as ``kernels.moe.moe_mlp_fwd``
    (BF16 x and weights), with H and I multiples of 128. ``weight_cache=None`` quantizes the weights
    on every call."""
    backend = check_moe_fp8_inputs(x, w1, w2, topk_ids, scores)
    rng = stage_range or (lambda name: nullcontext())
    names = _names(x, w1, topk_ids.shape[1])
    with rng(names["routing"]):
        pending = launch_checked_routing(x, w1, topk_ids, scores)
    with rng(names["weights"]):
        w1f = weight_cache.get(w1) if weight_cache is not None else quantize_weight(w1)
        w2f = weight_cache.get(w2) if weight_cache is not None else quantize_weight(w2)
    with rng(names["quant_x"]):
        x_q, x_s = quantize_rowwise(x)
    with rng(names["up_swiglu"]):  # queued before the counts are read: over the largest P, gated on the device
        gu, h, h_q, h_s = _up_gemm(x_q, x_s, w1f, pending.bound, backend)
    with rng(names["routing"]):
        routing = pending.finish()  # refuses a bad batch; the up GEMM computed nothing from it
        p = routing.padded_rows
        gu, h = gu[:p], h[:p]
        h_q, h_s = (None, None) if h_q is None else (h_q[:p], h_s[:p])
    with rng(names["up_swiglu"]):
        h_q, h_s = _quantized_h(h, h_q, h_s)
    with rng(names["down"]):
        y = moe_fp8_down(h_q, h_s, w2f, routing, backend)
    with rng(names["combine"]):
        out = moe_combine(y, routing, scores, backend)
    return out, MoeFp8Saved(backend, routing, x, w1, w2, w1f, w2f, scores, gu, h, h_q, h_s)


def moe_mlp_fp8_bwd(dout: torch.Tensor, saved: MoeFp8Saved, *, main_grads=None, stage_range=None,
                    wgrad: str = DEFAULT_WGRAD) -> MoeGrads:
    """Gradients of ``moe_mlp_fp8_fwd`` for dout [T, H] bf16: dX through FP8 data GEMMs, dW1/dW2 by the
    ``wgrad`` mode ("fp8", the default: 128x1 column-wise FP8 operands; "bf16": kernels.moe's kernel) as BF16 or
    FP32 accumulation into ``main_grads``, dscores = (dout_q[t] @ W2q[e]^T) . h from the dgrad's accumulator."""
    check_wgrad_mode(wgrad)
    check_dout(dout, saved.x)
    check_main_grads(main_grads, saved.w1, saved.w2)
    rng = stage_range or (lambda name: nullcontext())
    names = _names(saved.x, saved.w1, saved.routing.top_k)
    backend, routing = saved.backend, saved.routing
    with rng(names["quant_dout"]):
        dout_q, dout_s = quantize_rowwise(dout)
    with rng(names["dgrad_dswiglu"]):
        dgu, dgu_q, dgu_s, ds_part = moe_fp8_dgrad(dout_q, dout_s, saved.w2f, saved.gu, routing, backend, h=saved.h)
    with rng(names["dx"]):
        dx = moe_gather_sum(moe_fp8_dx_route(dgu_q, dgu_s, saved.w1f, routing, backend), routing, backend)
    with rng(names["wgrad"]):
        if wgrad == "fp8":
            dw1, dw2 = moe_fp8_wgrads(saved.x, saved.h, dgu, dout, routing, backend, main_grads)
        else:
            mg1, mg2 = main_grads if main_grads is not None else (None, None)
            dw1 = moe_wgrad_w1(saved.x, dgu, routing, backend, mg1, config=WGRAD_CONFIGS[backend])
            dw2 = moe_wgrad_w2(saved.h, dout, routing, backend, mg2, config=WGRAD_CONFIGS[backend])
    with rng(names["dscores"]):
        ds = moe_dscores_from_partials(ds_part, routing, backend).to(saved.scores.dtype)
    return MoeGrads(dx, dw1, dw2, ds)


class MoeMlpFp8Function(torch.autograd.Function):
    """autograd wrapper: (x, w1, w2, topk_ids, scores, main_grad_w1, main_grad_w2, weight_cache, wgrad) -> out."""

    @staticmethod
    def forward(ctx, x, w1, w2, topk_ids, scores, main_grad_w1=None, main_grad_w2=None, weight_cache=WEIGHT_CACHE,
                wgrad=DEFAULT_WGRAD):
        main_grads = None if main_grad_w1 is None and main_grad_w2 is None else (main_grad_w1, main_grad_w2)
        check_main_grads(main_grads, w1, w2)
        check_wgrad_mode(wgrad)
        ctx.wgrad = wgrad
        out, saved = moe_mlp_fp8_fwd(x, w1, w2, topk_ids, scores, weight_cache=weight_cache)
        ctx.saved = saved
        ctx.main_grads = main_grads
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = moe_mlp_fp8_bwd(dout, ctx.saved, main_grads=ctx.main_grads, wgrad=ctx.wgrad)
        ctx.saved = None
        return grads.dx, grads.dw1, grads.dw2, None, grads.dscores, None, None, None, None


def moe_mlp_fp8(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, scores: torch.Tensor,
                main_grads: tuple[torch.Tensor, torch.Tensor] | None = None,
                weight_cache: Fp8WeightCache | None = WEIGHT_CACHE, wgrad: str = DEFAULT_WGRAD) -> torch.Tensor:
    """Differentiable deterministic FP8 MoE expert MLP (the BF16 path's API, ``kernels.moe.moe_mlp``);
    ``wgrad`` picks the weight-gradient GEMMs: "fp8" (default: it passes the precision gate and is faster,
    docs/moe_fp8.md) or "bf16"."""
    mg1, mg2 = main_grads if main_grads is not None else (None, None)
    return MoeMlpFp8Function.apply(x, w1, w2, topk_ids, scores, mg1, mg2, weight_cache, wgrad)


# ---------------------------------------------------------------------------------------------
# Quantization-risk monitor and the pure-torch reference
# ---------------------------------------------------------------------------------------------
def moe_fp8_risk(saved: MoeFp8Saved, dout: torch.Tensor | None = None) -> dict[str, dict]:
    """The quantization-risk statistics (kernels.fp8_quant.quant_risk) of every quantized tensor of a run:
    x, w1, w2, h (valid rows) and, with ``dout``, dout and dgu."""
    valid = (saved.routing.sorted_route >= 0).nonzero().squeeze(1)
    risk = {"x": quant_risk_rowwise(saved.x), "w1": quant_risk_weight(saved.w1), "w2": quant_risk_weight(saved.w2),
            "h": quant_risk_rowwise(saved.h[valid])}
    if dout is not None:
        dout_q, dout_s = quantize_rowwise(dout)
        dgu = moe_fp8_dgrad_dswiglu(dout_q, dout_s, saved.w2f, saved.gu, saved.routing, saved.backend)[0]
        risk["dout"] = quant_risk_rowwise(dout)
        risk["dgu"] = quant_risk_rowwise(dgu[valid])
    return risk


def _colwise_dequantized(v: torch.Tensor) -> torch.Tensor:
    """v [n, N] quantized in 128x1 blocks down its columns (rows zero-padded to a multiple of 128, as an
    expert's segment is), dequantized: [n, N] fp32."""
    pad = -v.shape[0] % QBLOCK
    q, s = quantize_colwise_ref(torch.cat([v.float(), v.new_zeros(pad, v.shape[1], dtype=torch.float32)]))
    return dequantize_rowwise(q, s).t()[:v.shape[0]]


def moe_mlp_fp8_ref(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                    scores: torch.Tensor, dout: torch.Tensor | None = None,
                    wgrad: str = DEFAULT_WGRAD) -> dict[str, torch.Tensor]:
    """The FP8 recipe in plain torch: the same quantizers (references), every GEMM and activation in FP64
    on the dequantized operands, BF16 roundings where the kernels round (gu, h, y, out, dgu, dx_route, dx, dW), and
    h / dgu quantized from their BF16 values. It differs from the kernels only by FP32 accumulation and
    the activation's exp, which can move a BF16 rounding (and then an E4M3 one) by one unit."""
    check_wgrad_mode(wgrad)
    f64, bf16 = torch.float64, torch.bfloat16
    xq, xs = quantize_rowwise_ref(x)
    x_d = dequantize_rowwise(xq, xs).to(f64)
    w1_d = quantize_weight_ref(w1).dequantize().to(f64)
    w2_d = quantize_weight_ref(w2).dequantize().to(f64)
    t_count, k_count = topk_ids.shape
    hidden = x.shape[1]
    out = torch.zeros(t_count, hidden, dtype=f64, device=x.device)
    ys, saved = torch.zeros(t_count, k_count, hidden, dtype=f64, device=x.device), {}
    for e in range(w1.shape[0]):
        tok, kk = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = (x_d[tok] @ w1_d[e]).to(bf16)
        g, u = gu[:, 0::2].to(f64), gu[:, 1::2].to(f64)
        h = (torch.nn.functional.silu(g) * u).to(bf16)
        hq, hs = quantize_rowwise_ref(h)
        ys[tok, kk] = (dequantize_rowwise(hq, hs).to(f64) @ w2_d[e]).to(bf16).to(f64)  # y rounded, as the down GEMM
        saved[e] = (tok, kk, gu, h)
    s64 = scores.to(f64)
    for k in range(k_count):  # ascending k, as the combine
        out += s64[:, k, None] * ys[:, k]
    result = {"out": out.to(bf16)}
    if dout is None:
        return result
    dq, ds_ = quantize_rowwise_ref(dout)
    dout_d = dequantize_rowwise(dq, ds_).to(f64)
    dx = torch.zeros(t_count, hidden, dtype=f64, device=x.device)
    dw1 = torch.zeros(w1.shape, dtype=f64, device=x.device)
    dw2 = torch.zeros(w2.shape, dtype=f64, device=x.device)
    dscores = torch.zeros(t_count, k_count, dtype=f64, device=x.device)  # 0 for masked routes
    for e, (tok, kk, gu, h) in saved.items():
        s = s64[tok, kk][:, None]
        dh_raw = dout_d[tok] @ w2_d[e].t()
        dscores[tok, kk] = (dh_raw * h.to(f64)).sum(1)  # (dout_q @ W2q^T) . h, as the dgrad's fused partials
        dh = s * dh_raw
        g, u = gu[:, 0::2].to(f64), gu[:, 1::2].to(f64)
        sig = torch.sigmoid(g)
        dgu = torch.stack((dh * u * sig * (1 + g * (1 - sig)), dh * g * sig), dim=2).flatten(1).to(bf16)
        gq, gs = quantize_rowwise_ref(dgu)
        dx.index_add_(0, tok, (dequantize_rowwise(gq, gs).to(f64) @ w1_d[e].t()).to(bf16).to(f64))  # dx_route rounded
        if wgrad == "fp8":  # every operand 128x1 along the expert's rows; dy = s * dout in FP32
            dy = scores.float()[tok, kk][:, None] * dout[tok].float()
            dw1[e] = _colwise_dequantized(x[tok]).to(f64).t() @ _colwise_dequantized(dgu).to(f64)
            dw2[e] = _colwise_dequantized(h).to(f64).t() @ _colwise_dequantized(dy).to(f64)
        else:
            dw1[e] = x[tok].to(f64).t() @ dgu.to(f64)
            dw2[e] = h.to(f64).t() @ (s.float() * dout[tok].float()).to(bf16).to(f64)
    result.update({"dx": dx.to(bf16), "dw1": dw1.to(bf16), "dw2": dw2.to(bf16), "dscores": dscores.to(scores.dtype)})
    return result
