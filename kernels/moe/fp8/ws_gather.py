"""The FP8 MoE grouped GEMM with gathered A rows (up, dgrad) as a warp-specialized sm_90 Gluon kernel, with its
launcher: ``moe_fp8_ws_gather_kernel``. The A rows x_q[gather[p]] or dout_q[gather[p]] arrive by cp.async from a
4-warp producer (Hopper's TMA cannot gather rows; kernels/moe/gluon_blocks.py gather_producer), the weight tile by TMA;
the consumers run the K-block pipeline of kernels/moe/fp8/ws.py (``fp8_tile_acc``) and then
moe_fp8_grouped_gemm_kernel's epilogues, operation for operation:

    EPI_FP8_SWIGLU         gu rounded to BF16, h = silu(g) * u from those BF16 values, rounded once; both TMA-stored
                           (h is quantized afterwards by the row-wise pass)
    EPI_FP8_DSWIGLU_QUANT  (DSCORE) the dscore partials from the unscaled accumulator and the forward's h; dh = s * acc,
                           dg and du from the saved gu; dgu rounded once to BF16 and TMA-stored as int32 pairs; dgu
                           quantized 1x128 from those stored BF16 values (dgu_q as int16 pairs, its scales by pointer)

The two consumer warpgroups share each tile's rows (cooperative). The kernel also has a ping-pong form (PINGPONG: the
warpgroups take whole tiles in turn) that the launcher does not run. Gluon has no interpreter path: sm_90 only.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from detkit.kernels.backend import PlannedKernel, ensure_cuda_context
from detkit.kernels.det_gemm.launch import device_sms
from detkit.kernels.det_gemm.ws import CONSUMER_WARPS, check_shared_bytes, consumers, max_regs, store_part
from detkit.kernels.moe.common import DS_GROUP, EPI_FP8_SWIGLU, fp8_grouped_launch_name
from detkit.kernels.moe.fp8.ws import QBLOCK_WS, fp8_tile_acc, kb_group
from detkit.kernels.moe.gluon_blocks import (
    GATHER_CONSUMER_REGS, GATHER_PRODUCER_REGS, GATHER_PRODUCER_WARPS, bf16_pair_bits, bf16_pair_values,
    check_ws_backend, e4m3_pow2_scale, e4m3x2, gather_producer, live_tile_offsets, live_tiles, nvmma_descriptor,
)


@gluon.jit
def _swiglu_consumer(a_ring, b_ring, ready, free, turn, gu_smem, gu_desc, h_smem, h_desc, as_ptr, bs_ptr, gather_ptr,
                     route_ptr, tile_expert_ptr, num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse,
                     stride_bsl, stride_bsc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr,
                     KB_GROUP: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, PART: gl.constexpr,
                     GROUP_M: gl.constexpr):
    """The up-projection's consumer warpgroup: the grouped consumer's K loop over gathered rows (their scales read
    through the gather index too), then the SwiGLU epilogue of moe_fp8_grouped_gemm_kernel (EPI_FP8_SWIGLU): gu rounded to
    BF16, h = silu(g) * u from those BF16 values in FP32, rounded once; both stored by TMA. Its tiles: ``_turn``."""
    PARTS: gl.constexpr = 1 if PINGPONG else CONSUMERS  # warpgroups sharing one tile
    ROWS: gl.constexpr = BLOCK_M // PARTS
    P0: gl.constexpr = 0 if PINGPONG else PART  # this warpgroup's part of its tiles
    count = 0
    i = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        mine, blocks = _turn(t, i, route_ptr, num_tiles, num_n, L, BLOCK_M, BLOCK_N, a_ring.type.shape[2], PINGPONG,
                             PART, GROUP_M)
        if mine:
            _wait_turn(turn, i, PINGPONG, PART)
            acc, _, off_m, off_n, rows, live = fp8_tile_acc(
                t, a_ring, b_ring, ready, free, count, as_ptr, bs_ptr, gather_ptr, route_ptr, tile_expert_ptr,
                num_tiles, num_n, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M, BLOCK_N,
                SEGMENT, KB_GROUP, PARTS, P0, True, GROUP_M)
            _pass_turn(turn, PINGPONG, PART)
            # Padding rows (they read token 0) store zeros.
            gu = gl.where(live[:, None], acc, 0.0).to(gl.bfloat16)
            g, u = gl.split(gl.reshape(gu.to(gl.float32), [ROWS, BLOCK_N // 2, 2]))
            h = ((g * (1.0 / (1.0 + gl.exp(-g)))) * u).to(gl.bfloat16)
            row = off_m + P0 * ROWS
            store_part(gu_smem, gu_desc, gu, row, off_n, PART)
            store_part(h_smem, h_desc, h, row, off_n // 2, PART)
        count += blocks
        i += 1
    tma.store_wait(0)


@gluon.jit
def _turn(t, i, route_ptr, num_tiles, num_n, L, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, QB: gl.constexpr,
          PINGPONG: gl.constexpr, PART: gl.constexpr, GROUP_M: gl.constexpr):
    """Whose tile t (the program's i-th) is, and how many ring slots it takes. Cooperative: every consumer's, each
    taking its rows of it. PINGPONG: the warpgroups take the program's tiles in turn (tile i is warpgroup i % 2's), so
    one's epilogue runs while the other's MMAs do; each counts the other's slots to find its own in the ring. A tile
    whose first row is padding takes none (the producer loads nothing for it)."""
    off_m, _ = live_tile_offsets(t, num_tiles, num_n, BLOCK_M, BLOCK_N, GROUP_M)
    blocks = gl.where(gl.load(route_ptr + off_m) >= 0, L // QB, 0)
    return ((i % 2) == PART) if PINGPONG else True, blocks


@gluon.jit
def _wait_turn(turn, i, PINGPONG: gl.constexpr, PART: gl.constexpr):
    """PINGPONG: before its K loop of the program's i-th tile, a warpgroup waits until the other has finished the K
    loop of the tile before (``turn.index(PART)``; warpgroup 0's first tile waits on nothing: a fresh barrier counts
    as having completed the phase before phase 0). The K loops alternate, so a warpgroup never waits on a ring slot
    more than one fill ahead of the producer (a wait matches a phase's parity only)."""
    if PINGPONG:
        mbarrier.wait(turn.index(PART), ((i // 2) & 1) ^ (1 - PART))


@gluon.jit
def _pass_turn(turn, PINGPONG: gl.constexpr, PART: gl.constexpr):
    """PINGPONG: after its K loop, a warpgroup hands the tensor cores to the other (its epilogue runs meanwhile)."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - PART), count=1)


@gluon.jit
def _dscore_partials(x, ds_ptr, row0, off_n, C):
    """moe_fp8.fp8_dscore_partials's sums of x = acc * h [ROWS, BLOCK_N] (the accumulator layout): the same
    reshapes, permutation and pairwise splits, so the same order; the 16 values of a partial are the ones one thread
    holds (columns 8j + 2q + b of a 64-column chunk for its lane's q), so nothing moves between threads. The store
    offsets go through the same splits (each keeps its first half: the values of a group share one offset)."""
    ROWS: gl.constexpr = x.type.shape[0]
    BLOCK_N: gl.constexpr = x.type.shape[1]
    NCH: gl.constexpr = BLOCK_N // 64
    x = gl.permute(gl.reshape(x, [ROWS, NCH, 8, 4, 2]), [0, 1, 3, 2, 4])  # [rows, chunk, q, j, b]
    lo, hi = gl.split(x)  # b
    lo, hi = gl.split(gl.reshape(lo + hi, [ROWS, NCH, 4, 4, 2]))  # j = 2m, 2m + 1
    lo, hi = gl.split(gl.reshape(lo + hi, [ROWS, NCH, 4, 2, 2]))
    lo, hi = gl.split(lo + hi)
    layout: gl.constexpr = lo.type.layout  # [rows, chunk, q]
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    c = gl.arange(0, NCH, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    offs = ((row0 + r) * (C // DS_GROUP) + (off_n // 16))[:, None, None] + (c * 4)[None, :, None] + q[None, None, :]
    gl.store(ds_ptr + offs, lo + hi)


@gluon.jit
def _dswiglu_consumer(a_ring, b_ring, ready, free, turn, dgu_smem, dgu_desc, q_smem, q_desc, as_ptr, bs_ptr,
                      gather_ptr, route_ptr, tile_expert_ptr, score_ptr, gu_ptr, qs_ptr, h_ptr, ds_ptr, num_tiles,
                      num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, stride_gm, stride_qsm,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr, KB_GROUP: gl.constexpr,
                      CONSUMERS: gl.constexpr, DSCORE: gl.constexpr, PINGPONG: gl.constexpr, PART: gl.constexpr,
                      GROUP_M: gl.constexpr):
    """The dgrad's consumer warpgroup: dh = s * (dout_q[gather] @ W2q^T) over BLOCK_N = 64 or 128 columns of I,
    then moe_fp8_grouped_gemm_kernel's EPI_FP8_DSWIGLU_QUANT: (DSCORE) the dscore partials from the unscaled accumulator and the
    forward's h (``_dscore_partials``); dg, du from the saved gu (its (g, u) pairs read as one int32 each), dgu
    rounded once to BF16 and stored (TMA, as int32 pairs), then quantized 1 x 128 from the stored BF16 values (64 dh
    columns = 128 dgu columns = one scale block per row): dgu_q (e4m3 pairs, TMA-stored as int16) and its scales. Its
    tiles: ``_turn``."""
    PARTS: gl.constexpr = 1 if PINGPONG else CONSUMERS  # warpgroups sharing one tile
    P0: gl.constexpr = 0 if PINGPONG else PART  # this warpgroup's part of its tiles
    count = 0
    i = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        mine, blocks = _turn(t, i, route_ptr, num_tiles, num_n, L, BLOCK_M, BLOCK_N, a_ring.type.shape[2], PINGPONG,
                             PART, GROUP_M)
        if mine:
            _dswiglu_tile(t, a_ring, b_ring, ready, free, turn, i, dgu_smem, dgu_desc, q_smem, q_desc, as_ptr, bs_ptr,
                          gather_ptr, route_ptr, tile_expert_ptr, score_ptr, gu_ptr, qs_ptr, h_ptr, ds_ptr, count,
                          num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, stride_gm,
                          stride_qsm, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP, PARTS, DSCORE, PINGPONG, P0, PART, GROUP_M)
        count += blocks
        i += 1
    tma.store_wait(0)


@gluon.jit
def _dswiglu_tile(t, a_ring, b_ring, ready, free, turn, i, dgu_smem, dgu_desc, q_smem, q_desc, as_ptr, bs_ptr,
                  gather_ptr, route_ptr, tile_expert_ptr, score_ptr, gu_ptr, qs_ptr, h_ptr, ds_ptr, count, num_tiles,
                  num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, stride_gm, stride_qsm,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr, KB_GROUP: gl.constexpr,
                  PARTS: gl.constexpr, DSCORE: gl.constexpr, PINGPONG: gl.constexpr, P0: gl.constexpr,
                  BUF: gl.constexpr, GROUP_M: gl.constexpr):
    """One dgrad tile of ``_dswiglu_consumer``: rows [P0 * BLOCK_M / PARTS, +BLOCK_M / PARTS) of tile t from ring slot
    ``count`` on, its outputs through store-buffer part BUF."""
    ROWS: gl.constexpr = BLOCK_M // PARTS
    _wait_turn(turn, i, PINGPONG, BUF)
    acc, _, off_m, off_n, rows, live = fp8_tile_acc(
        t, a_ring, b_ring, ready, free, count, as_ptr, bs_ptr, gather_ptr, route_ptr, tile_expert_ptr, num_tiles, num_n,
        L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP, PARTS,
        P0, True, GROUP_M)
    _pass_turn(turn, PINGPONG, BUF)
    # Columns of dh: (g, u) column pairs of gu and dgu; padding rows (they read token 0) as the Triton kernel's: +0.
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))
    acc = gl.where(live[:, None], acc, 0.0)
    row = off_m + P0 * ROWS
    if DSCORE:  # first: the h tile and the products are dead before gu is loaded
        _dscore_partials(acc * gl.load(h_ptr + rows[:, None] * C + cols[None, :]).to(gl.float32), ds_ptr, row,
                         off_n, C)
    g, u = bf16_pair_values(gl.load(gu_ptr + rows[:, None] * stride_gm + cols[None, :]))
    s = 1.0 / (1.0 + gl.exp(-g))
    silu = g * s
    dh = acc * gl.load(score_ptr + rows)[:, None]
    # The operation order of kernels/parallel/swiglu.py (as dswiglu_epilogue).
    pair = bf16_pair_bits((dh * u) * (s + silu * (1.0 - s)), dh * silu)
    store_part(dgu_smem, dgu_desc, pair, row, off_n, BUF)
    dg, du = bf16_pair_values(pair)  # the stored BF16 dgu, as the row-wise quantizer would read it
    mag = gl.maximum(gl.abs(dg), gl.abs(du))
    block = off_n // 64  # the scale block of the tile's first 64 dh columns
    if BLOCK_N == 64:
        scale, inv = e4m3_pow2_scale(gl.max(mag, axis=1))
        inv_cols = inv[:, None]
        gl.store(qs_ptr + rows * stride_qsm + block, scale)
    else:  # two scale blocks per row: each half's amax by masking the other (magnitudes are >= 0)
        first = ((cols - off_n) < 64)[None, :]
        scale0, inv0 = e4m3_pow2_scale(gl.max(gl.where(first, mag, 0.0), axis=1))
        scale1, inv1 = e4m3_pow2_scale(gl.max(gl.where(first, 0.0, mag), axis=1))
        inv_cols = gl.where(first, inv0[:, None], inv1[:, None])
        gl.store(qs_ptr + rows * stride_qsm + block, scale0)
        gl.store(qs_ptr + rows * stride_qsm + block + 1, scale1)
    q = e4m3x2(dg * inv_cols, du * inv_cols)
    store_part(q_smem, q_desc, q, row, off_n, BUF)


@gluon.jit(launch_metadata=fp8_grouped_launch_name)
def moe_fp8_ws_gather_kernel(
    a_ptr,  # x_q [T, H] (up) or dout_q [T, H] (dgrad) e4m3, rows read through the gather index
    b_desc,  # TMA descriptor over the K-major weight as [E * C, L] (box [BLOCK_N, 128])
    gu_desc, h_desc,  # up: TMA descriptors over gu [P, 2I], h [P, I] BF16, boxes [BLOCK_M / CONSUMERS, BLOCK_N or /2];
    # dgrad: over dgu as int32 (g, u) pairs and dgu_q as int16 pairs, [P, I] each, box [BLOCK_M / CONSUMERS, BLOCK_N]
    as_ptr, bs_ptr, gather_ptr, route_ptr, tile_expert_ptr, gate_ptr,
    score_ptr, gu_ptr, qs_ptr,  # dgrad: scores, gu as int32 pairs, dgu_q's scales
    h_ptr, ds_ptr,  # dgrad with DSCORE: the forward's h [P, I] BF16 and the dscore partials [P, I / DS_GROUP] FP32
    P, C, L,  # C[p, :C] = sum_kb (A_q[gather[p], kb] @ B_q[e][kb, :C]) * scales, then the epilogue
    stride_am, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, stride_gm, stride_qsm,
    op_id,  # names the launch only
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SEGMENT: gl.constexpr,
    KB_GROUP: gl.constexpr, CONSUMERS: gl.constexpr,
    EPILOGUE: gl.constexpr,  # EPI_FP8_SWIGLU (3): up, h quantized by the row-wise pass; EPI_FP8_DSWIGLU_QUANT (2): dgrad
    GROUP_M: gl.constexpr,  # the tile order (kernels/moe/tile_order.py): row tiles per band
    DSCORE: gl.constexpr = False,  # dgrad: the dscore partials too
    PINGPONG: gl.constexpr = False,  # launched False (cooperative); True: warpgroups take whole tiles in turn (``_turn``)
):
    QB: gl.constexpr = b_desc.block_type.shape[1]
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, QB], gl.float8e4nv)
    a_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, QB], a_layout)
    b_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # The weight's expect-tx arrival and one cp.async arrival per producer thread (128).
        mbarrier.init(ready.index(i), count=1 + GATHER_PRODUCER_WARPS * 32)
        mbarrier.init(free.index(i), count=1 if PINGPONG else CONSUMERS)  # a slot's readers
    num_n = C // BLOCK_N
    num_tiles = live_tiles(gate_ptr, P, num_n, BLOCK_M)
    BUF_ROWS: gl.constexpr = CONSUMERS * BLOCK_M if PINGPONG else BLOCK_M  # one store buffer part per warpgroup
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # PINGPONG: whose K loop is next
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    if EPILOGUE == 3:
        gu_smem = gl.allocate_shared_memory(gl.bfloat16, [BUF_ROWS, BLOCK_N], gu_desc.layout)
        h_smem = gl.allocate_shared_memory(gl.bfloat16, [BUF_ROWS, BLOCK_N // 2], h_desc.layout)
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_swiglu_consumer, (a_ring, b_ring, ready, free, turn, gu_smem, gu_desc, h_smem, h_desc, as_ptr, bs_ptr,
                                    gather_ptr, route_ptr, tile_expert_ptr, num_tiles, num_n, C, L, stride_asm,
                                    stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP,
                                    CONSUMERS, PINGPONG, 0, GROUP_M)),
                (_swiglu_consumer, (a_ring, b_ring, ready, free, turn, gu_smem, gu_desc, h_smem, h_desc, as_ptr, bs_ptr,
                                    gather_ptr, route_ptr, tile_expert_ptr, num_tiles, num_n, C, L, stride_asm,
                                    stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP,
                                    CONSUMERS, PINGPONG, 1, GROUP_M)),
                (gather_producer, (a_ptr, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr, tile_expert_ptr,
                                   num_tiles, num_n, C, L, stride_am, BLOCK_M, BLOCK_N, SEGMENT, GROUP_M)),
            ], [CONSUMER_WARPS, GATHER_PRODUCER_WARPS], [GATHER_CONSUMER_REGS, GATHER_PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_swiglu_consumer, (a_ring, b_ring, ready, free, turn, gu_smem, gu_desc, h_smem, h_desc, as_ptr, bs_ptr,
                                    gather_ptr, route_ptr, tile_expert_ptr, num_tiles, num_n, C, L, stride_asm,
                                    stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP,
                                    CONSUMERS, PINGPONG, 0, GROUP_M)),
                (gather_producer, (a_ptr, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr, tile_expert_ptr,
                                   num_tiles, num_n, C, L, stride_am, BLOCK_M, BLOCK_N, SEGMENT, GROUP_M)),
            ], [GATHER_PRODUCER_WARPS], [GATHER_PRODUCER_REGS])
    else:
        dgu_smem = gl.allocate_shared_memory(gl.int32, [BUF_ROWS, BLOCK_N], gu_desc.layout)
        q_smem = gl.allocate_shared_memory(gl.int16, [BUF_ROWS, BLOCK_N], h_desc.layout)
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_dswiglu_consumer, (a_ring, b_ring, ready, free, turn, dgu_smem, gu_desc, q_smem, h_desc, as_ptr,
                                     bs_ptr, gather_ptr, route_ptr, tile_expert_ptr, score_ptr, gu_ptr, qs_ptr, h_ptr,
                                     ds_ptr, num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl,
                                     stride_bsc, stride_gm, stride_qsm, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP, CONSUMERS,
                                     DSCORE, PINGPONG, 0, GROUP_M)),
                (_dswiglu_consumer, (a_ring, b_ring, ready, free, turn, dgu_smem, gu_desc, q_smem, h_desc, as_ptr,
                                     bs_ptr, gather_ptr, route_ptr, tile_expert_ptr, score_ptr, gu_ptr, qs_ptr, h_ptr,
                                     ds_ptr, num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl,
                                     stride_bsc, stride_gm, stride_qsm, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP, CONSUMERS,
                                     DSCORE, PINGPONG, 1, GROUP_M)),
                (gather_producer, (a_ptr, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr, tile_expert_ptr,
                                   num_tiles, num_n, C, L, stride_am, BLOCK_M, BLOCK_N, SEGMENT, GROUP_M)),
            ], [CONSUMER_WARPS, GATHER_PRODUCER_WARPS], [GATHER_CONSUMER_REGS, GATHER_PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_dswiglu_consumer, (a_ring, b_ring, ready, free, turn, dgu_smem, gu_desc, q_smem, h_desc, as_ptr,
                                     bs_ptr, gather_ptr, route_ptr, tile_expert_ptr, score_ptr, gu_ptr, qs_ptr, h_ptr,
                                     ds_ptr, num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl,
                                     stride_bsc, stride_gm, stride_qsm, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP, CONSUMERS,
                                     DSCORE, PINGPONG, 0, GROUP_M)),
                (gather_producer, (a_ptr, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr, tile_expert_ptr,
                                   num_tiles, num_n, C, L, stride_am, BLOCK_M, BLOCK_N, SEGMENT, GROUP_M)),
            ], [GATHER_PRODUCER_WARPS], [GATHER_PRODUCER_REGS])


_moe_fp8_ws_gather_kernel_planned = PlannedKernel(moe_fp8_ws_gather_kernel)


def launch_fp8_ws_gather(op_id: int, stage: str, config, epilogue: int, a_q: torch.Tensor, a_s: torch.Tensor,
                         b: torch.Tensor, b_s: torch.Tensor, outputs: dict[str, torch.Tensor], gather: torch.Tensor,
                         route: torch.Tensor, tile_expert: torch.Tensor, gate: torch.Tensor, padded_rows: int,
                         segment: int, backend: str) -> None:
    """A gathered-A grouped GEMM of a_q [T, L] rows and the K-major weight b [E, C, L] with its epilogue:
    EPI_FP8_SWIGLU, the up-projection (outputs gu [P, 2I], h [P, I] BF16; h quantized by the row-wise pass);
    EPI_FP8_DSWIGLU_QUANT, dgrad + dSwiGLU (outputs score, gu in; dgu, dgu_q, dgu_s out; with "h" and "ds_part"
    [P, I / DS_GROUP], the dscore partials too). The consumer warpgroups share each tile's rows (cooperative).
    Refuses, naming the value, what this kernel does not cover, then a backend other than sm_90 (before any work)."""
    e, n_cols, reduced = b.shape
    # up: 128 interleaved (g, u) columns; dgrad: 64 or 128 columns of dh = one or two 1x128 blocks of dgu.
    want_n = (QBLOCK_WS,) if epilogue == EPI_FP8_SWIGLU else (QBLOCK_WS // 2, QBLOCK_WS)
    if config.block_k != QBLOCK_WS or config.block_n not in want_n:
        raise ValueError(f"{stage}: variant 'ws' runs BLOCK_K {QBLOCK_WS} and BLOCK_N in {want_n} here; got BLOCK_K "
                         f"{config.block_k}, BLOCK_N {config.block_n}")
    if n_cols % config.block_n or reduced % QBLOCK_WS:
        raise ValueError(f"{stage}: variant 'ws' needs C {n_cols} a multiple of {config.block_n} and L {reduced} of "
                         f"{QBLOCK_WS}")
    # Shared memory: the ring (one e4m3 A and B block per stage) and the epilogue's store buffers (up: gu and h
    # BF16; dgrad: dgu as int32 pairs and dgu_q as int16 pairs).
    ring = config.num_stages * (config.block_m + config.block_n) * QBLOCK_WS
    part_rows = config.block_m // consumers(config.num_warps)
    store = consumers(config.num_warps) * part_rows * config.block_n * (3 if epilogue == EPI_FP8_SWIGLU else 6)
    check_shared_bytes(stage, config, ring, store, "the epilogue")
    if (not b.is_contiguous() or not all(t.is_contiguous() for t in outputs.values()) or a_q.stride(1) != 1
            or a_q.stride(0) % 16 or a_q.data_ptr() % 16):
        raise ValueError(f"{stage}: variant 'ws' needs the activation row-major with 16-byte aligned rows (cp.async), "
                         f"the K-major weight and the outputs contiguous; got strides {a_q.stride()} and {b.stride()}")
    check_ws_backend(stage, backend)
    if padded_rows == 0:
        return
    ensure_cuda_context(a_q.device)  # the descriptors encode on this thread (autograd's backward has its own)
    if epilogue == EPI_FP8_SWIGLU:
        gu, h = outputs["gu"], outputs["h"]
        descs = (nvmma_descriptor(gu, [part_rows, config.block_n], gl.bfloat16),
                 nvmma_descriptor(h, [part_rows, config.block_n // 2], gl.bfloat16))
        score = gu_bits = q_s = h_in = ds_part = a_s  # unused by this epilogue
    else:
        score, q_s, gu_bits = outputs["score"], outputs["dgu_s"], outputs["gu"].view(torch.int32)
        # The dscore partials need both h and ds_part; without them the kernel reads neither (placeholders).
        h_in, ds_part = (outputs["h"], outputs["ds_part"]) if "ds_part" in outputs else (q_s, q_s)
        descs = (nvmma_descriptor(outputs["dgu"].view(torch.int32), [part_rows, config.block_n], gl.int32),
                 nvmma_descriptor(outputs["dgu_q"].view(torch.int16), [part_rows, config.block_n], gl.int16))
    tiles = (padded_rows // config.block_m) * (n_cols // config.block_n)
    _moe_fp8_ws_gather_kernel_planned[(min(tiles, device_sms(a_q.device)),)](
        a_q, nvmma_descriptor(b.reshape(e * n_cols, reduced), [config.block_n, QBLOCK_WS]), *descs,
        a_s, b_s, gather, route, tile_expert, gate, score, gu_bits, q_s, h_in, ds_part,
        padded_rows, n_cols, reduced,
        a_q.stride(0), a_s.stride(0), a_s.stride(1), b_s.stride(0), b_s.stride(1), b_s.stride(2),
        gu_bits.stride(0), q_s.stride(0),
        op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, STAGES=config.num_stages, SEGMENT=segment,
        KB_GROUP=kb_group(reduced // QBLOCK_WS), CONSUMERS=consumers(config.num_warps), EPILOGUE=epilogue,
        DSCORE="ds_part" in outputs, GROUP_M=config.group_m, num_warps=4, maxnreg=max_regs(config.num_warps),
    )
