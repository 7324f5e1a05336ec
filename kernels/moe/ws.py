"""Warp-specialized sm_90 kernels of the BF16 MoE grouped GEMMs (MoE variant "ws"), written in Gluon, with their
launchers: ``moe_ws_kernel`` for the stages whose A rows are expert-sorted (down, dX), ``moe_ws_gather_kernel`` for
up + SwiGLU and dgrad + dSwiGLU (+ the dscore partials), whose A rows are gathered, and ``moe_ws_wgrad_kernel`` for
the weight gradients.

Why: the Triton grouped kernel (kernels/moe/kernels.py) writes its output tile (y of the down-projection, dX per route:
400 MB each at the reference shape) from registers while nothing else runs in its program. Here the grid is
persistent (one program per SM), one producer warp streams A and B tiles into a shared-memory ring by TMA, two consumer
warpgroups (64 rows each) issue asynchronous wgmma as each slot lands, and the tile leaves through shared memory and a
TMA store that runs while the next tile's MMAs do. Program p takes the live tiles p, p + programs, ... in the grouped
order of the config's GROUP_M (kernels/moe/tile_order.py; every partition maps a tile index the same way).

The math is moe_grouped_gemm_tma_kernel's: per output tile, BLOCK_K-wide K steps in ascending order, one wgmma
chain accumulating into the same FP32 registers (k16 instructions in ascending order, as tl.dot issues them), the
tile stored in the output's dtype (BF16: rounded once to nearest even, as the Triton epilogue); padding rows store
zeros and a tile whose first row is padding loads nothing. Every tile past the routing's P (the gate) is skipped, so
the kernel also runs over a PendingRouting's bound.

The gathered kernel's A rows (x or dout at gather[p]) arrive by cp.async from a 4-warp producer
(kernels/moe/gluon_blocks.py gather_producer, shared with the FP8 up and dgrad), or by TMA when the caller has copied
them into expert order (GATHER_A False: the layer's backward hands dgrad dout's rows so; on the H200, ncu put the
cp.async-fed dgrad at 52-58% SM throughput against 87% for dX, whose A comes by TMA). Its epilogues are the Triton
kernel's, operation for operation: SwiGLU (gu, then h from the BF16 gu); dSwiGLU with DSCORE, the dscore partials from
the unscaled accumulator and the saved h in fixed 64-column chunks, dh = s * acc, dg and du from the saved gu (its tile
loaded by TMA into the dgu store buffer while the MMAs run) in kernels/parallel/swiglu.py's order, dgu rounded once to BF16 and
stored by TMA (as int32 (g, u) pairs) while the next tile's MMAs run. That epilogue is heavy enough that dgrad's pinned
tile runs it on a warpgroup of its own (EPI_WARPGROUP, 12 warps): the two MMA warpgroups hand their FP32 accumulators
over through the store buffer and go on to the next tile's MMAs while it runs (the same operations and layouts, so the
same bits).

``moe_ws_wgrad_kernel`` is the weight gradient dW[e] = A[rows of e]^T B[rows of e] (dW1: x[gather] and dgu, dW2: h and
dy), moe_wgrad_kernel's math: per dW tile, the expert's rows in ascending BLOCK_K steps, one wgmma chain into FP32
registers. The last step's rows past the routed count (inside the expert's padded segment) add exact zeros, as the
Triton kernel's masked loads do: x's rows there are zero-filled by the copy; h's are zeros from the up epilogue, and
B's are finite zeros (dgu from the dgrad epilogue's zeroed rows, dy stored +0 by moe_scale_rows). Both operands have
the output dims contiguous: each consumer's 64 columns of A land in a ring buffer of their own, read transposed by
wgmma (MN-major, which BF16 wgmma supports).

Gluon has no interpreter path: the launchers refuse a "ws" config on any other backend by name, after the checks
of the config itself (so those run on every backend).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from detkit.kernels.backend import PlannedKernel, ensure_cuda_context
from detkit.kernels.det_gemm.launch import device_sms, operand_ring_bytes
from detkit.kernels.det_gemm.ws import (
    CONSUMER_REGS, CONSUMER_WARPS, GL_DTYPES, PRODUCER_REGS, PRODUCER_WARPS, check_shared_bytes, consumers, max_regs,
    store_part,
)
from detkit.kernels.moe.common import DS_CHUNK, EPI_SWIGLU, grouped_launch_name, wgrad_launch_name
from detkit.kernels.moe.gluon_blocks import (
    GATHER_CONSUMER_REGS, GATHER_PRODUCER_REGS, GATHER_PRODUCER_WARPS, bf16_pair_bits, bf16_pair_values,
    check_ws_backend, gather_producer, live_tile_offsets, live_tiles, nvmma_descriptor, refused_batch, store_wgrad_part,
    wgrad_tile,
)
from detkit.kernels.moe.operands import ws_weight_rows, ws_wgrad_addresses
from detkit.kernels.moe.routing import SEGMENT_ALIGN

SEGMENT = gl.constexpr(SEGMENT_ALIGN)  # an expert's rows start on a multiple of this (kernels/moe/routing.py)
# dgrad with an epilogue warpgroup: the MMA warpgroups hold only their accumulators (64 FP32 registers per thread).
HANDOFF_MMA_REGS = gl.constexpr(112)


@gluon.jit
def _producer(a_desc, b_desc, a_ring, b_ring, ready, free, route_ptr, tile_expert_ptr, num_tiles, C, L,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, B_K_MAJOR: gl.constexpr, GROUP_M: gl.constexpr):
    """TMA loads of every K step of each live tile into the ring; a slot is refilled once every consumer has
    released it. The weight is [E * C, L] (K-major) or [E * L, C]: an expert's rows start at e * C or e * L."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    BLOCK_K: gl.constexpr = a_ring.type.shape[2]
    num_n = C // BLOCK_N
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = live_tile_offsets(t, num_tiles, num_n, BLOCK_M, BLOCK_N, GROUP_M)
        if gl.load(route_ptr + off_m) >= 0:
            expert = gl.load(tile_expert_ptr + off_m // SEGMENT)
            for ks in range(L // BLOCK_K):
                slot = count % STAGES
                # A fresh barrier counts as having completed the phase before phase 0: the first pass waits on nothing.
                mbarrier.wait(free.index(slot), ((count // STAGES) & 1) ^ 1)
                bar = ready.index(slot)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [off_m, ks * BLOCK_K], bar, a_ring.index(slot))
                if B_K_MAJOR:
                    tma.async_copy_global_to_shared(b_desc, [expert * C + off_n, ks * BLOCK_K], bar, b_ring.index(slot))
                else:
                    tma.async_copy_global_to_shared(b_desc, [expert * L + ks * BLOCK_K, off_n], bar, b_ring.index(slot))
                count += 1


@gluon.jit
def _gathered_kernel_producer(a_ptr, a_desc, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr,
                              tile_expert_ptr, num_tiles, num_n, C, L, stride_am, BLOCK_M: gl.constexpr,
                              BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr, B_K_MAJOR: gl.constexpr,
                              GATHER_A: gl.constexpr, GROUP_M: gl.constexpr):
    """moe_ws_gather_kernel's loads (a 4-warp partition): A rows a[gather[p]] by cp.async (gather_producer), or, when
    the caller has copied them into expert order (GATHER_A False), row p of A by TMA (_producer)."""
    if GATHER_A:
        gather_producer(a_ptr, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr, tile_expert_ptr, num_tiles,
                        num_n, C, L, stride_am, BLOCK_M, BLOCK_N, SEGMENT, GROUP_M, B_K_MAJOR)
    else:
        _producer(a_desc, b_desc, a_ring, b_ring, ready, free, route_ptr, tile_expert_ptr, num_tiles, C, L, BLOCK_M,
                  BLOCK_N, B_K_MAJOR, GROUP_M)


@gluon.constexpr_function
def _acc_layout(BLOCK_N):
    """A consumer warpgroup's accumulator layout: 64 rows, BF16 wgmma of [16, BLOCK_N, 16] (the Triton kernel's)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1], instr_shape=[16, BLOCK_N, 16])


@gluon.constexpr_function
def _chunk_layout(NCH):
    """The layout the Triton dgrad kernel sums its dscore chunks in (its sm_90 TTGIR: 8 consecutive columns per
    thread, 8 lanes across a 64-column chunk): the same in-thread order and lane tree, so the same bits."""
    return gl.BlockedLayout([1, 1, 8], [32 // (8 * NCH), NCH, 8], [CONSUMER_WARPS, 1, 1], [2, 1, 0])


@gluon.jit
def _k_steps(a_ring, b_ring, ready, free, count, acc, steps, B_K_MAJOR: gl.constexpr, PART: gl.constexpr,
             FENCE: gl.constexpr, A_MN_MAJOR: gl.constexpr = False, side_desc=None, side_bar=None, side_smem=None,
             side_row=0, side_col=0):
    """acc + this part's rows of ``steps`` K steps of one live tile (ascending) from the ring, from slot ``count`` on:
    async wgmma with at most one MMA in flight behind the newest, each slot handed back once the MMA that read it has
    finished. FENCE: the A tile was written by cp.async (generic proxy), which wgmma (async proxy) may read only
    after a proxy fence. A_MN_MAJOR (the weight gradient): each part's A tile is its own ring buffer [BLOCK_K, ROWS]
    (slot * parts + part) with the output rows contiguous, read transposed by wgmma. ``side_desc``: halfway through
    the steps, once the previous tile's TMA store has read ``side_smem``, a TMA load of ``side_desc`` at
    [side_row, side_col] into it, arriving on ``side_bar`` (the epilogue's operand lands while the MMAs run).
    Returns (acc, the next count)."""
    STAGES: gl.constexpr = ready.type.shape[0]
    ROWS: gl.constexpr = acc.type.shape[0]
    for ks in range(steps):
        slot = count % STAGES
        mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
        if FENCE:
            fence_async_shared()
        b = b_ring.index(slot)
        if B_K_MAJOR:
            b = b.permute((1, 0))
        if A_MN_MAJOR:
            a = a_ring.index(slot * (a_ring.type.shape[0] // STAGES) + PART).permute((1, 0))
        else:
            a = a_ring.index(slot).slice(PART * ROWS, ROWS, dim=0)
        acc = warpgroup_mma(a, b, acc, is_async=True)
        if side_desc is not None:
            if ks == steps // 2:
                _side_load(side_desc, side_bar, side_smem, side_row, side_col)
        # The MMA before this one has finished reading its slot: hand that slot back.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(free.index((count + STAGES - 1) % STAGES), count=1, pred=ks > 0)
        count += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(free.index((count + STAGES - 1) % STAGES), count=1)
    return acc, count


@gluon.jit
def _side_load(desc, bar, smem, row, col):
    """A TMA load of desc's box at [row, col] into smem, arriving on bar, once the TMA stores issued before it have
    read smem."""
    tma.store_wait(0)
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], bar, smem)


@gluon.jit
def _tile_acc(t, a_ring, b_ring, ready, free, count, route_ptr, num_tiles, num_n, L, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, B_K_MAJOR: gl.constexpr, CONSUMERS: gl.constexpr, PART: gl.constexpr,
              FENCE: gl.constexpr, GROUP_M: gl.constexpr):
    """Tile t's accumulator for this consumer's rows [PART * BLOCK_M / CONSUMERS, +BLOCK_M / CONSUMERS), zero on
    padding rows (a tile whose first row is padding is padding only and loads nothing): (acc, the next ring count,
    the part's first row, its rows, the tile's first column)."""
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    acc_layout: gl.constexpr = _acc_layout(BLOCK_N)
    off_m, off_n = live_tile_offsets(t, num_tiles, num_n, BLOCK_M, BLOCK_N, GROUP_M)
    row = off_m + PART * ROWS
    rows = row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
    BLOCK_K: gl.constexpr = a_ring.type.shape[2]
    acc = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
    if gl.load(route_ptr + off_m) >= 0:
        acc, count = _k_steps(a_ring, b_ring, ready, free, count, acc, L // BLOCK_K, B_K_MAJOR, PART, FENCE)
    acc = gl.where((gl.load(route_ptr + rows) >= 0)[:, None], acc, 0.0)
    return acc, count, row, rows, off_n


@gluon.jit
def _consumer(a_ring, b_ring, ready, free, c_smem, c_desc, route_ptr, num_tiles, C, L, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, B_K_MAJOR: gl.constexpr, CONSUMERS: gl.constexpr, PART: gl.constexpr,
              GROUP_M: gl.constexpr):
    """One consumer warpgroup of down / dX: its rows of every tile, then the tile in the output's dtype (padding rows
    zero) through shared memory and a TMA store."""
    num_n = C // BLOCK_N
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        acc, count, row, rows, off_n = _tile_acc(t, a_ring, b_ring, ready, free, count, route_ptr, num_tiles, num_n, L,
                                                 BLOCK_M, BLOCK_N, B_K_MAJOR, CONSUMERS, PART, False, GROUP_M)
        store_part(c_smem, c_desc, acc, row, off_n, PART)
    tma.store_wait(0)


@gluon.jit
def _up_consumer(a_ring, b_ring, ready, free, gu_smem, gu_desc, h_smem, h_desc, route_ptr, num_tiles, C, L,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, B_K_MAJOR: gl.constexpr, CONSUMERS: gl.constexpr,
                 PART: gl.constexpr, FENCE: gl.constexpr, GROUP_M: gl.constexpr):
    """One consumer warpgroup of up: acc = x[gather] @ W1[e] over BLOCK_N interleaved (g, u) columns for this part's
    rows (padding rows, which read token 0, zeroed), then grouped_epilogue's EPILOGUE 1: gu rounded to BF16, h =
    silu(g) * u from those BF16 values in FP32, rounded once; both TMA-stored."""
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    num_n = C // BLOCK_N
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        acc, count, row, rows, off_n = _tile_acc(t, a_ring, b_ring, ready, free, count, route_ptr, num_tiles, num_n, L,
                                                 BLOCK_M, BLOCK_N, B_K_MAJOR, CONSUMERS, PART, FENCE, GROUP_M)
        gu = acc.to(gl.bfloat16)
        g, u = gl.split(gl.reshape(gu.to(gl.float32), [ROWS, BLOCK_N // 2, 2]))
        h = ((g * (1.0 / (1.0 + gl.exp(-g)))) * u).to(gl.bfloat16)
        store_part(gu_smem, gu_desc, gu, row, off_n, PART)
        store_part(h_smem, h_desc, h, row, off_n // 2, PART)
    tma.store_wait(0)


@gluon.jit
def _dgrad_consumer(a_ring, b_ring, ready, free, dgu_smem, dgu_desc, gu_desc, gu_bars, route_ptr, score_ptr, h_ptr,
                    ds_ptr, num_tiles, C, L, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, B_K_MAJOR: gl.constexpr,
                    CONSUMERS: gl.constexpr, PART: gl.constexpr, DSCORE: gl.constexpr, DS_CHUNK: gl.constexpr,
                    FENCE: gl.constexpr, GROUP_M: gl.constexpr):
    """One consumer warpgroup of dgrad: acc = dout[gather] @ W2[e]^T over BLOCK_N columns of dh for this part's rows
    (padding rows, which read token 0, zeroed), then grouped_epilogue's EPILOGUE 2: (DSCORE) ds_part[p, c] = the sum
    over chunk c's DS_CHUNK columns of acc * h, then dh = s * acc, dg and du from the saved gu (each (g, u) pair read
    as one int32), rounded once to BF16 and TMA-stored as int32 pairs. The epilogue's operands arrive during the MMAs:
    the scores and h loaded into registers before them, gu's tile by TMA into this part's dgu store buffer halfway
    through them (dgu is then written over it)."""
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    BLOCK_K: gl.constexpr = a_ring.type.shape[2]
    acc_layout: gl.constexpr = _acc_layout(BLOCK_N)
    dgu_part = dgu_smem.slice(PART * ROWS, ROWS, dim=0)
    gu_bar = gu_bars.index(PART)
    num_n = C // BLOCK_N
    count = 0
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = live_tile_offsets(t, num_tiles, num_n, BLOCK_M, BLOCK_N, GROUP_M)
        row = off_m + PART * ROWS
        rows = row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        routed = gl.load(route_ptr + rows) >= 0
        score = gl.load(score_ptr + rows)
        if DSCORE:
            h = gl.load(h_ptr + rows[:, None] * C + cols[None, :])
        acc = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
        if gl.load(route_ptr + off_m) >= 0:
            acc, count = _k_steps(a_ring, b_ring, ready, free, count, acc, L // BLOCK_K, B_K_MAJOR, PART, FENCE,
                                  False, gu_desc, gu_bar, dgu_part, row, off_n)
        else:  # a padding-only tile: no MMAs to hide the load behind
            _side_load(gu_desc, gu_bar, dgu_part, row, off_n)
        acc = gl.where(routed[:, None], acc, 0.0)
        if DSCORE:  # first, as the Triton epilogue
            _dscore_partials(acc, h, ds_ptr, row, off_n, C, DS_CHUNK)
        mbarrier.wait(gu_bar, it & 1)
        store_part(dgu_smem, dgu_desc, _dswiglu_bits(acc, score, dgu_part.load(acc_layout)), row, off_n, PART)
        it += 1
    tma.store_wait(0)


@gluon.jit
def _dscore_partials(acc, h, ds_ptr, row, off_n, C, DS_CHUNK: gl.constexpr):
    """ds_part[p, c] for this part's rows: the sum over chunk c's DS_CHUNK columns of acc * h, in the Triton dgrad
    kernel's order (_chunk_layout)."""
    ROWS: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    chunked = gl.convert_layout(gl.reshape(acc * h.to(gl.float32), [ROWS, BLOCK_N // DS_CHUNK, DS_CHUNK]),
                                _chunk_layout(BLOCK_N // DS_CHUNK))
    part = gl.sum(chunked, axis=2)
    p_layout: gl.constexpr = part.type.layout
    p_rows = row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, p_layout))
    chunks = off_n // DS_CHUNK + gl.arange(0, BLOCK_N // DS_CHUNK, layout=gl.SliceLayout(0, p_layout))
    gl.store(ds_ptr + p_rows[:, None] * (C // DS_CHUNK) + chunks[None, :], part)


@gluon.jit
def _dswiglu_bits(acc, score, gu_bits):
    """dgu as int32 (g, u) pairs from the unscaled accumulator: dh = s * acc, then dg and du from the saved gu's
    pairs in the operation order of kernels/parallel/swiglu.py (as dswiglu_epilogue), each rounded once to BF16."""
    g, u = bf16_pair_values(gu_bits)
    dh = acc * score[:, None]
    s = 1.0 / (1.0 + gl.exp(-g))
    silu = g * s
    return bf16_pair_bits((dh * u) * (s + silu * (1.0 - s)), dh * silu)


@gluon.jit
def _handoff_consumer(a_ring, b_ring, ready, free, acc_smem, acc_ready, acc_free, route_ptr, num_tiles, C, L,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, B_K_MAJOR: gl.constexpr, PART: gl.constexpr,
                      FENCE: gl.constexpr, GROUP_M: gl.constexpr):
    """One MMA warpgroup of dgrad with an epilogue warpgroup of its own (EPI_WARPGROUP): its 64 rows of every
    tile's FP32 accumulator (padding rows zero) into its part of the shared hand-off buffer, once the epilogue's
    store of the previous tile has read that part; then straight on to the next tile's MMAs."""
    ROWS: gl.constexpr = BLOCK_M // 2
    part = acc_smem.slice(PART * ROWS, ROWS, dim=0)
    num_n = C // BLOCK_N
    count = 0
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        acc, count, _, _, _ = _tile_acc(t, a_ring, b_ring, ready, free, count, route_ptr, num_tiles, num_n, L, BLOCK_M,
                                        BLOCK_N, B_K_MAJOR, 2, PART, FENCE, GROUP_M)
        # A fresh barrier counts as having completed the phase before phase 0: the first tile waits on nothing.
        mbarrier.wait(acc_free.index(PART), (it & 1) ^ 1)
        part.store(acc)
        mbarrier.arrive(acc_ready.index(PART), count=1)
        it += 1


@gluon.jit
def _dgrad_epilogue(acc_smem, dgu_smem, acc_ready, acc_free, dgu_desc, gu_ptr, score_ptr, h_ptr, ds_ptr, num_tiles, C,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DSCORE: gl.constexpr, DS_CHUNK: gl.constexpr,
                    GROUP_M: gl.constexpr):
    """dgrad's epilogue warpgroup (EPI_WARPGROUP): for each tile, each MMA warpgroup's 64 rows in turn from the
    hand-off buffer, the epilogue of _dgrad_consumer (the same operations in the same layout, so the same bits;
    gu, h and the scores loaded while the MMAs run), dgu written over those rows of the buffer (``dgu_smem``: the
    same bytes as int32) and TMA-stored; the parts are handed back once the stores have read them."""
    ROWS: gl.constexpr = BLOCK_M // 2
    acc_layout: gl.constexpr = _acc_layout(BLOCK_N)
    num_n = C // BLOCK_N
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = live_tile_offsets(t, num_tiles, num_n, BLOCK_M, BLOCK_N, GROUP_M)
        for PART in gl.static_range(2):
            row = off_m + PART * ROWS
            rows = row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
            # The tile's columns offset per row, not a [BLOCK_N] column vector kept across both parts: with the grouped
            # order's index math beside it, that vector spilled (sm_90, gathered rows with the dscore partials).
            offs = (rows * C + off_n)[:, None] + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))[None, :]
            score = gl.load(score_ptr + rows)
            gu_bits = gl.load(gu_ptr + offs)
            if DSCORE:
                h = gl.load(h_ptr + offs)
            mbarrier.wait(acc_ready.index(PART), it & 1)
            acc = acc_smem.slice(PART * ROWS, ROWS, dim=0).load(acc_layout)
            gl.thread_barrier()  # every thread has read the accumulator before dgu is written over it
            if DSCORE:  # first, as the Triton epilogue
                _dscore_partials(acc, h, ds_ptr, row, off_n, C, DS_CHUNK)
            dgu_part = dgu_smem.slice(PART * ROWS, ROWS, dim=0)
            dgu_part.store(_dswiglu_bits(acc, score, gu_bits))
            fence_async_shared()
            tma.async_copy_shared_to_global(dgu_desc, [row, off_n], dgu_part)
        tma.store_wait(0)
        for PART in gl.static_range(2):
            mbarrier.arrive(acc_free.index(PART), count=1)
        it += 1


@gluon.jit(launch_metadata=grouped_launch_name)
def moe_ws_kernel(
    a_desc,  # TMA descriptor over the expert-sorted A [P, L] BF16, box [BLOCK_M, BLOCK_K]
    b_desc,  # over the weight's storage as [E * C, L] (B_K_MAJOR, box [BLOCK_N, BLOCK_K]) or [E * L, C] ([BLOCK_K, BLOCK_N])
    c_desc,  # over the output [P, C] (BF16 / FP32), box [BLOCK_M / CONSUMERS, BLOCK_N]
    route_ptr, tile_expert_ptr, gate_ptr,
    P, C, L,  # C[p, :] = A[p, :L] @ B[expert(p)][:L, :C]
    op_id,  # names the launch only
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, B_K_MAJOR: gl.constexpr,
    CONSUMERS: gl.constexpr,  # consumer warpgroups, each its own partition: 1 or 2
    GROUP_M: gl.constexpr,  # the tile order (kernels/moe/tile_order.py): row tiles per band
):
    a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=CONSUMERS)
    num_tiles = live_tiles(gate_ptr, P, C // BLOCK_N, BLOCK_M)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, route_ptr, num_tiles, C, L, BLOCK_M, BLOCK_N,
                         B_K_MAJOR, CONSUMERS, 0, GROUP_M)),
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, route_ptr, num_tiles, C, L, BLOCK_M, BLOCK_N,
                         B_K_MAJOR, CONSUMERS, 1, GROUP_M)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, route_ptr, tile_expert_ptr, num_tiles, C, L,
                         BLOCK_M, BLOCK_N, B_K_MAJOR, GROUP_M)),
        ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, route_ptr, num_tiles, C, L, BLOCK_M, BLOCK_N,
                         B_K_MAJOR, CONSUMERS, 0, GROUP_M)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, route_ptr, tile_expert_ptr, num_tiles, C, L,
                         BLOCK_M, BLOCK_N, B_K_MAJOR, GROUP_M)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


@gluon.jit(launch_metadata=grouped_launch_name)
def moe_ws_gather_kernel(
    a_ptr,  # x (up) or dout (dgrad) [T, L] BF16, rows read through the gather index (cp.async)
    a_desc,  # GATHER_A False: over those rows copied into expert order [P, L], box [BLOCK_M, BLOCK_K] (else unused)
    b_desc,  # over the weight's storage as [E * C, L] (B_K_MAJOR, box [BLOCK_N, BLOCK_K]) or [E * L, C]
    out_desc,  # up: over gu [P, C] BF16; dgrad: over dgu [P, 2C] as int32 (g, u) pairs [P, C];
    # box [BLOCK_M / CONSUMERS, BLOCK_N]
    h_desc,  # up: over h [P, C / 2] BF16, box [BLOCK_M / CONSUMERS, BLOCK_N / 2]; dgrad: over the forward's gu
    # [P, 2C] as int32 pairs [P, C], box [BLOCK_M / CONSUMERS, BLOCK_N]
    gather_ptr, route_ptr, score_ptr, tile_expert_ptr, gate_ptr,
    h_ptr, ds_ptr,  # dgrad with DSCORE: the forward's h [P, C] BF16 and the partials ds_part [P, C / DS_CHUNK] FP32
    gu_ptr,  # dgrad with EPI_WARPGROUP: the forward's gu as int32 (g, u) pairs [P, C]
    P, C, L,  # acc[p, :C] = A[gather[p], :L] @ B[expert(p)][:L, :C], then the epilogue
    stride_am,
    op_id,  # names the launch only
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, SEGMENT: gl.constexpr,
    CONSUMERS: gl.constexpr, B_K_MAJOR: gl.constexpr,
    EPILOGUE: gl.constexpr,  # 1: SwiGLU (up); 2: dSwiGLU (dgrad)
    DSCORE: gl.constexpr, DS_CHUNK: gl.constexpr,
    GATHER_A: gl.constexpr,  # A rows through the gather index (cp.async), or already in expert order (TMA)
    EPI_WARPGROUP: gl.constexpr,  # dgrad: an epilogue warpgroup beside the 2 MMA ones (their tiles' epilogues overlap
    # the next tile's MMAs), or the MMA warpgroups run their epilogues
    GROUP_M: gl.constexpr,  # the tile order (kernels/moe/tile_order.py): row tiles per band
):
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    out_smem = gl.allocate_shared_memory(out_desc.dtype, [BLOCK_M, BLOCK_N], out_desc.layout)
    for i in gl.static_range(STAGES):
        # The TMA expect-tx arrival and, gathering, one cp.async arrival per producer thread.
        mbarrier.init(ready.index(i), count=1 + (GATHER_PRODUCER_WARPS * 32 if GATHER_A else 0))
        mbarrier.init(free.index(i), count=CONSUMERS)
    num_n = C // BLOCK_N
    num_tiles = live_tiles(gate_ptr, P, num_n, BLOCK_M)
    if EPILOGUE == 1:
        h_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N // 2], h_desc.layout)
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_up_consumer, (a_ring, b_ring, ready, free, out_smem, out_desc, h_smem, h_desc, route_ptr, num_tiles, C,
                                L, BLOCK_M, BLOCK_N, B_K_MAJOR, CONSUMERS, 0, GATHER_A, GROUP_M)),
                (_up_consumer, (a_ring, b_ring, ready, free, out_smem, out_desc, h_smem, h_desc, route_ptr, num_tiles, C,
                                L, BLOCK_M, BLOCK_N, B_K_MAJOR, CONSUMERS, 1, GATHER_A, GROUP_M)),
                (_gathered_kernel_producer, (a_ptr, a_desc, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr,
                                             tile_expert_ptr, num_tiles, num_n, C, L, stride_am, BLOCK_M, BLOCK_N,
                                             SEGMENT, B_K_MAJOR, GATHER_A, GROUP_M)),
            ], [CONSUMER_WARPS, GATHER_PRODUCER_WARPS], [GATHER_CONSUMER_REGS, GATHER_PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_up_consumer, (a_ring, b_ring, ready, free, out_smem, out_desc, h_smem, h_desc, route_ptr, num_tiles, C,
                                L, BLOCK_M, BLOCK_N, B_K_MAJOR, CONSUMERS, 0, GATHER_A, GROUP_M)),
                (_gathered_kernel_producer, (a_ptr, a_desc, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr,
                                             tile_expert_ptr, num_tiles, num_n, C, L, stride_am, BLOCK_M, BLOCK_N,
                                             SEGMENT, B_K_MAJOR, GATHER_A, GROUP_M)),
            ], [GATHER_PRODUCER_WARPS], [GATHER_PRODUCER_REGS])
    elif EPI_WARPGROUP:
        acc_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        acc_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(acc_ready.index(i), count=1)
            mbarrier.init(acc_free.index(i), count=1)
        # The hand-off buffer: the accumulator (FP32) in, dgu (int32 pairs, the same 32-bit swizzle) out.
        acc_smem = out_smem._reinterpret(gl.float32, [BLOCK_M, BLOCK_N], out_desc.layout)
        gl.warp_specialize([
            (_dgrad_epilogue, (acc_smem, out_smem, acc_ready, acc_free, out_desc, gu_ptr, score_ptr, h_ptr, ds_ptr,
                               num_tiles, C, BLOCK_M, BLOCK_N, DSCORE, DS_CHUNK, GROUP_M)),
            (_handoff_consumer, (a_ring, b_ring, ready, free, acc_smem, acc_ready, acc_free, route_ptr, num_tiles, C, L,
                                 BLOCK_M, BLOCK_N, B_K_MAJOR, 0, GATHER_A, GROUP_M)),
            (_handoff_consumer, (a_ring, b_ring, ready, free, acc_smem, acc_ready, acc_free, route_ptr, num_tiles, C, L,
                                 BLOCK_M, BLOCK_N, B_K_MAJOR, 1, GATHER_A, GROUP_M)),
            (_gathered_kernel_producer, (a_ptr, a_desc, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr,
                                         tile_expert_ptr, num_tiles, num_n, C, L, stride_am, BLOCK_M, BLOCK_N,
                                         SEGMENT, B_K_MAJOR, GATHER_A, GROUP_M)),
        ], [CONSUMER_WARPS, CONSUMER_WARPS, GATHER_PRODUCER_WARPS if GATHER_A else PRODUCER_WARPS],
            [HANDOFF_MMA_REGS, HANDOFF_MMA_REGS, GATHER_PRODUCER_REGS if GATHER_A else PRODUCER_REGS])
    else:
        gu_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(gu_bars.index(i), count=1)
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_dgrad_consumer, (a_ring, b_ring, ready, free, out_smem, out_desc, h_desc, gu_bars, route_ptr,
                                   score_ptr, h_ptr, ds_ptr, num_tiles, C, L, BLOCK_M, BLOCK_N, B_K_MAJOR, CONSUMERS, 0,
                                   DSCORE, DS_CHUNK, GATHER_A, GROUP_M)),
                (_dgrad_consumer, (a_ring, b_ring, ready, free, out_smem, out_desc, h_desc, gu_bars, route_ptr,
                                   score_ptr, h_ptr, ds_ptr, num_tiles, C, L, BLOCK_M, BLOCK_N, B_K_MAJOR, CONSUMERS, 1,
                                   DSCORE, DS_CHUNK, GATHER_A, GROUP_M)),
                (_gathered_kernel_producer, (a_ptr, a_desc, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr,
                                             tile_expert_ptr, num_tiles, num_n, C, L, stride_am, BLOCK_M, BLOCK_N,
                                             SEGMENT, B_K_MAJOR, GATHER_A, GROUP_M)),
            ], [CONSUMER_WARPS, GATHER_PRODUCER_WARPS], [GATHER_CONSUMER_REGS, GATHER_PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_dgrad_consumer, (a_ring, b_ring, ready, free, out_smem, out_desc, h_desc, gu_bars, route_ptr,
                                   score_ptr, h_ptr, ds_ptr, num_tiles, C, L, BLOCK_M, BLOCK_N, B_K_MAJOR, CONSUMERS, 0,
                                   DSCORE, DS_CHUNK, GATHER_A, GROUP_M)),
                (_gathered_kernel_producer, (a_ptr, a_desc, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr,
                                             tile_expert_ptr, num_tiles, num_n, C, L, stride_am, BLOCK_M, BLOCK_N,
                                             SEGMENT, B_K_MAJOR, GATHER_A, GROUP_M)),
            ], [GATHER_PRODUCER_WARPS], [GATHER_PRODUCER_REGS])


@gluon.jit
def _wgrad_producer(a_desc, b_desc, a_ring, b_ring, ready, free, offsets_ptr, counts_ptr, num_tiles, num_r, num_c,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """The weight gradient's TMA loads (dW2: h and dy), per K step of BLOCK_K expert rows (ascending, up to the step
    holding the last routed row; the step stays inside the expert's 128-padded segment, whose padding rows of h
    and dy are zeros): each consumer's BLOCK_K x 64 slice of the A rows into its own ring buffer, and the B rows'
    BLOCK_N columns."""
    STAGES: gl.constexpr = ready.type.shape[0]
    PARTS: gl.constexpr = a_ring.type.shape[0] // STAGES
    BLOCK_K: gl.constexpr = a_ring.type.shape[1]
    ROWS: gl.constexpr = a_ring.type.shape[2]
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        expert, pid_r, pid_c, start, routed = wgrad_tile(t, num_r, num_c, offsets_ptr, counts_ptr, GROUP_M)
        for ks in range(gl.cdiv(routed, BLOCK_K)):
            slot = count % STAGES
            # A fresh barrier counts as having completed the phase before phase 0: the first pass waits on nothing.
            mbarrier.wait(free.index(slot), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            row = start + ks * BLOCK_K
            mbarrier.expect(bar, PARTS * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            for part in gl.static_range(PARTS):
                tma.async_copy_global_to_shared(a_desc, [row, pid_r * BLOCK_M + part * ROWS], bar,
                                                a_ring.index(slot * PARTS + part))
            tma.async_copy_global_to_shared(b_desc, [row, pid_c * BLOCK_N], bar, b_ring.index(slot))
            count += 1


@gluon.jit
def _wgrad_gather_producer(a_ptr, b_desc, a_ring, b_ring, ready, free, gather_ptr, offsets_ptr, counts_ptr, num_tiles,
                           num_r, num_c, stride_am, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           GROUP_M: gl.constexpr):
    """dW1's loads (a 4-warp partition): the K steps of _wgrad_producer with the A rows x[gather[p]] copied by
    16-byte cp.async, rows past the routed count zero-filled (the Triton kernel's mask: x of token 0, which padding
    rows name, never enters a product), and dgu's rows by TMA. Each step's row indices are loaded one step ahead,
    so their latency hides behind the wait for a free slot."""
    STAGES: gl.constexpr = ready.type.shape[0]
    PARTS: gl.constexpr = a_ring.type.shape[0] // STAGES
    BLOCK_K: gl.constexpr = a_ring.type.shape[1]
    ROWS: gl.constexpr = a_ring.type.shape[2]
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [GATHER_PRODUCER_WARPS, 1], [1, 0])
    k_offs = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, rows_layout))
    cols = gl.arange(0, ROWS, layout=gl.SliceLayout(0, rows_layout))
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        expert, pid_r, pid_c, start, routed = wgrad_tile(t, num_r, num_c, offsets_ptr, counts_ptr, GROUP_M)
        a_cols = a_ptr + (pid_r * BLOCK_M + cols)[None, :]
        tokens = gl.load(gather_ptr + start + k_offs, mask=k_offs < routed, other=0)
        for ks in range(gl.cdiv(routed, BLOCK_K)):
            k = ks * BLOCK_K + k_offs
            upcoming = gl.load(gather_ptr + start + k + BLOCK_K, mask=k + BLOCK_K < routed, other=0)
            slot = count % STAGES
            mbarrier.wait(free.index(slot), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(b_desc, [start + ks * BLOCK_K, pid_c * BLOCK_N], bar, b_ring.index(slot))
            ptrs = a_cols + tokens[:, None].to(gl.int64) * stride_am
            for part in gl.static_range(PARTS):
                async_copy.async_copy_global_to_shared(a_ring.index(slot * PARTS + part), ptrs + part * ROWS,
                                                       mask=(k < routed)[:, None])
            async_copy.mbarrier_arrive(bar, increment_count=False)
            tokens = upcoming
            count += 1


@gluon.jit
def _wgrad_consumer(a_ring, b_ring, ready, free, c_smem, c_desc, dw_ptr, offsets_ptr, counts_ptr, gate_ptr, num_tiles,
                    num_r, num_c, R, stride_we, stride_wr, stride_wc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    ACCUMULATE: gl.constexpr, CONSUMERS: gl.constexpr, PART: gl.constexpr, FENCE: gl.constexpr,
                    GROUP_M: gl.constexpr):
    """One consumer warpgroup of a BF16 weight gradient: rows [PART * 64, +64) of dW[e]'s tile over the expert's rows
    (ascending K steps, one wgmma chain, A read transposed from its ring buffer); BF16 out by TMA store, or
    main_grad += it in FP32 (an expert without rows leaves main_grad untouched and stores a zero tile otherwise)."""
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    BLOCK_K: gl.constexpr = a_ring.type.shape[1]
    count = 0
    refused = refused_batch(gate_ptr)
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        expert, pid_r, pid_c, start, routed = wgrad_tile(t, num_r, num_c, offsets_ptr, counts_ptr, GROUP_M)
        acc = gl.zeros([ROWS, BLOCK_N], gl.float32, _acc_layout(BLOCK_N))
        if routed > 0:
            acc, count = _k_steps(a_ring, b_ring, ready, free, count, acc, gl.cdiv(routed, BLOCK_K), False, PART, FENCE,
                                  True)
        store_wgrad_part(c_smem, c_desc, dw_ptr, acc, expert, routed, refused, R, pid_r * BLOCK_M + PART * ROWS,
                         pid_c * BLOCK_N, stride_we, stride_wr, stride_wc, ACCUMULATE, PART)
    tma.store_wait(0)


@gluon.jit(launch_metadata=wgrad_launch_name)
def moe_ws_wgrad_kernel(
    a_desc,  # TMA descriptor over A [rows, R] (dW2: h), box [BLOCK_K, 64] (GATHER_A: unused, any valid one)
    a_ptr,  # GATHER_A: x [T, R] BF16, rows read through the gather index (cp.async)
    b_desc,  # over B [P, C] (dgu, dy), box [BLOCK_K, BLOCK_N]
    c_desc,  # over the BF16 dW as [E * R, C], box [64, BLOCK_N] (ACCUMULATE: unused, any valid one)
    dw_ptr,  # ACCUMULATE: main_grad [E, R, C] FP32
    gather_ptr, offsets_ptr, counts_ptr, gate_ptr,
    R, C, num_experts,  # dW[e] [R, C] = sum over e's rows p (ascending) of A[arow(p), :R]^T B[p, :C]
    stride_am, stride_we, stride_wr, stride_wc,
    op_id,  # names the launch only
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr, GATHER_A: gl.constexpr, ACCUMULATE: gl.constexpr,
    GROUP_M: gl.constexpr,  # each dW[e]'s tiles in the grouped order (bands of GROUP_M row tiles), expert by expert
):
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, ROWS], gl.bfloat16)
    a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES * CONSUMERS, BLOCK_K, ROWS], a_layout)
    b_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], c_desc.layout)
    for i in gl.static_range(STAGES):
        # The TMA expect-tx arrival, and with GATHER_A one cp.async arrival per producer thread.
        mbarrier.init(ready.index(i), count=1 + (GATHER_PRODUCER_WARPS * 32 if GATHER_A else 0))
        mbarrier.init(free.index(i), count=CONSUMERS)
    num_r = R // BLOCK_M
    num_c = C // BLOCK_N
    num_tiles = num_experts * num_r * num_c
    # GATHER_A: the 4-warp cp.async producer, whose copies the consumers fence before wgmma reads them.
    if GATHER_A:
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_wgrad_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, dw_ptr, offsets_ptr, counts_ptr,
                                   gate_ptr, num_tiles, num_r, num_c, R, stride_we, stride_wr, stride_wc, BLOCK_M,
                                   BLOCK_N, ACCUMULATE, CONSUMERS, 0, True, GROUP_M)),
                (_wgrad_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, dw_ptr, offsets_ptr, counts_ptr,
                                   gate_ptr, num_tiles, num_r, num_c, R, stride_we, stride_wr, stride_wc, BLOCK_M,
                                   BLOCK_N, ACCUMULATE, CONSUMERS, 1, True, GROUP_M)),
                (_wgrad_gather_producer, (a_ptr, b_desc, a_ring, b_ring, ready, free, gather_ptr, offsets_ptr,
                                          counts_ptr, num_tiles, num_r, num_c, stride_am, BLOCK_M, BLOCK_N, GROUP_M)),
            ], [CONSUMER_WARPS, GATHER_PRODUCER_WARPS], [GATHER_CONSUMER_REGS, GATHER_PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_wgrad_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, dw_ptr, offsets_ptr, counts_ptr,
                                   gate_ptr, num_tiles, num_r, num_c, R, stride_we, stride_wr, stride_wc, BLOCK_M,
                                   BLOCK_N, ACCUMULATE, CONSUMERS, 0, True, GROUP_M)),
                (_wgrad_gather_producer, (a_ptr, b_desc, a_ring, b_ring, ready, free, gather_ptr, offsets_ptr,
                                          counts_ptr, num_tiles, num_r, num_c, stride_am, BLOCK_M, BLOCK_N, GROUP_M)),
            ], [GATHER_PRODUCER_WARPS], [GATHER_PRODUCER_REGS])
    else:
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_wgrad_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, dw_ptr, offsets_ptr, counts_ptr,
                                   gate_ptr, num_tiles, num_r, num_c, R, stride_we, stride_wr, stride_wc, BLOCK_M,
                                   BLOCK_N, ACCUMULATE, CONSUMERS, 0, False, GROUP_M)),
                (_wgrad_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, dw_ptr, offsets_ptr, counts_ptr,
                                   gate_ptr, num_tiles, num_r, num_c, R, stride_we, stride_wr, stride_wc, BLOCK_M,
                                   BLOCK_N, ACCUMULATE, CONSUMERS, 1, False, GROUP_M)),
                (_wgrad_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, offsets_ptr, counts_ptr, num_tiles,
                                   num_r, num_c, BLOCK_M, BLOCK_N, GROUP_M)),
            ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_wgrad_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, dw_ptr, offsets_ptr, counts_ptr,
                                   gate_ptr, num_tiles, num_r, num_c, R, stride_we, stride_wr, stride_wc, BLOCK_M,
                                   BLOCK_N, ACCUMULATE, CONSUMERS, 0, False, GROUP_M)),
                (_wgrad_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, offsets_ptr, counts_ptr, num_tiles,
                                   num_r, num_c, BLOCK_M, BLOCK_N, GROUP_M)),
            ], [PRODUCER_WARPS], [PRODUCER_REGS])


def epilogue_warpgroup(config) -> bool:
    """Whether a dgrad ws config runs its epilogue on a warpgroup of its own (12 warps: two MMA warpgroups of 64 rows
    each hand their accumulators over through shared memory and go on to the next tile's MMAs)."""
    return config.num_warps == 12


def mma_warpgroups(config) -> int:
    """The config's MMA (consumer) warpgroups, 64 rows of the tile each."""
    return 2 if epilogue_warpgroup(config) else consumers(config.num_warps)


def _check_consumer_rows(stage: str, config, epilogue_group: bool = False) -> None:
    """Refuses a tile whose rows are not 64 per MMA warpgroup (4 warps each), naming it; ``epilogue_group``: the
    kernel also takes 12 warps (an epilogue warpgroup beside two MMA ones)."""
    warps = (4, 8, 12) if epilogue_group else (4, 8)
    if config.num_warps not in warps or config.block_m != 64 * mma_warpgroups(config):
        also = " or 128 with 12 (an epilogue warpgroup beside two MMA ones)" if epilogue_group else ""
        raise ValueError(f"{stage}: variant 'ws' gives each consumer warpgroup (4 warps) 64 rows: BLOCK_M 64 with 4 "
                         f"warps or 128 with 8{also}; got BLOCK_M {config.block_m}, {config.num_warps} warps")


def _check_tile(stage: str, config, reduced: int, n_cols: int, store_bytes: int, epilogue_group: bool = False) -> None:
    """Refuses, naming the value, a tile the ws kernels cannot run on L = ``reduced``, C = ``n_cols`` with an epilogue
    buffer of ``store_bytes`` (``epilogue_group``: 12 warps taken, see _check_consumer_rows)."""
    _check_consumer_rows(stage, config, epilogue_group)
    if reduced % config.block_k or n_cols % config.block_n or config.block_k % 16 or config.block_n % 16:
        raise ValueError(f"{stage}: variant 'ws' needs BLOCK_K {config.block_k} dividing L {reduced} and BLOCK_N "
                         f"{config.block_n} dividing C {n_cols} (a weight tile never crosses an expert), both multiples "
                         "of 16")
    check_shared_bytes(stage, config, operand_ring_bytes(config), store_bytes, "the epilogue's buffers")


_moe_ws_kernel_planned = PlannedKernel(moe_ws_kernel)


def launch_moe_ws(op_id: int, stage: str, config, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                  routing, backend: str) -> None:
    """c [P, C] (BF16) = the grouped GEMM of the expert-sorted a [P, L] and the ``[E, L, C]`` weight view b (its
    storage [E, L, C] or K-major [E, C, L]); refuses, naming the value, what this kernel does not cover, then a
    backend other than sm_90 (before any work)."""
    _, reduced, n_cols = b.shape
    if c.dtype not in GL_DTYPES:
        raise ValueError(f"{stage}: variant 'ws' writes {tuple(GL_DTYPES)}; got an output of {c.dtype}")
    _check_tile(stage, config, reduced, n_cols, config.block_m * config.block_n * c.element_size())
    store, k_major = ws_weight_rows(b) or (None, False)
    if (store is None or a.stride(1) != 1 or not c.is_contiguous()
            or any(t.stride(0) * t.element_size() % 16 or t.data_ptr() % 16 for t in (a, store))):
        raise ValueError(f"{stage}: variant 'ws' needs the weight stored [E, L, C] or [E, C, L] with 16-byte aligned "
                         f"rows, A row-major with 16-byte aligned rows and the output contiguous; got weight strides "
                         f"{b.stride()}, A strides {a.stride()}, output strides {c.stride()}")
    check_ws_backend(stage, backend)
    p = routing.padded_rows
    if p == 0:
        return
    ensure_cuda_context(a.device)  # the descriptors encode on this thread (autograd's backward has its own)
    b_box = [config.block_n, config.block_k] if k_major else [config.block_k, config.block_n]
    part_rows = config.block_m // consumers(config.num_warps)
    tiles = (p // config.block_m) * (n_cols // config.block_n)
    _moe_ws_kernel_planned[(min(tiles, device_sms(a.device)),)](
        nvmma_descriptor(a[:p], [config.block_m, config.block_k], gl.bfloat16),
        nvmma_descriptor(store, b_box, gl.bfloat16),
        nvmma_descriptor(c, [part_rows, config.block_n], GL_DTYPES[c.dtype]),
        routing.sorted_route, routing.tile_expert, routing.gate,
        p, n_cols, reduced,
        op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, STAGES=config.num_stages, B_K_MAJOR=k_major,
        CONSUMERS=consumers(config.num_warps), GROUP_M=config.group_m,
        num_warps=4, maxnreg=max_regs(config.num_warps),  # num_warps: the default partition (one consumer warpgroup)
    )


def gather_store_bytes(config, epilogue: int, dscore: bool) -> int:
    """Shared memory of the gathered kernel besides its ring: up, the gu and h tiles' store buffers (BF16); dgrad, the
    dgu tile's (int32 pairs) and, with the dscore partials, the layout-conversion scratch for the chunk sums of each
    warpgroup running the epilogue (8 KiB: the offline sm_90 compile's shared size at BLOCK_N 64 and 128,
    tests/test_moe_ws.py)."""
    if epilogue == EPI_SWIGLU:
        return config.block_m * config.block_n * 3
    dscore_groups = 1 if epilogue_warpgroup(config) else consumers(config.num_warps)
    return config.block_m * config.block_n * 4 + (dscore_groups * 8192 if dscore else 0)


_moe_ws_gather_kernel_planned = PlannedKernel(moe_ws_gather_kernel)


def launch_moe_ws_gather(op_id: int, stage: str, config, epilogue: int, a: torch.Tensor, b: torch.Tensor,
                         out: torch.Tensor, aux: torch.Tensor, routing,
                         dscore: tuple[torch.Tensor, torch.Tensor] | None, backend: str, gather: bool = True) -> None:
    """The grouped GEMM of a[gather] [P, L] (BF16; ``gather`` False: ``a`` holds those rows in expert order, [P, L],
    read by TMA) and the ``[E, L, C]`` weight view b with its epilogue:
    EPI_SWIGLU (up), out = gu [P, C], aux = h [P, C/2] written; EPI_DSWIGLU (dgrad), out = dgu [P, 2C] written from
    aux = the saved gu and dh = s * acc, and ``dscore = (h, ds_part)`` adds the partials. Refuses, naming the value,
    what this kernel does not cover, then a backend other than sm_90 (before any work)."""
    _, reduced, n_cols = b.shape
    if epilogue_warpgroup(config) and epilogue == EPI_SWIGLU:
        raise ValueError(f"{stage}: an epilogue warpgroup (12 warps) is dgrad's only; up takes 4 or 8 warps")
    _check_tile(stage, config, reduced, n_cols, gather_store_bytes(config, epilogue, dscore is not None), True)
    if config.block_k % 64 or (dscore is not None and config.block_n % DS_CHUNK):
        raise ValueError(f"{stage}: variant 'ws' copies 64 BF16 columns per pass of its gathered rows and sums the "
                         f"dscore partials over {DS_CHUNK} columns: BLOCK_K a multiple of 64 and BLOCK_N of {DS_CHUNK}; "
                         f"got BLOCK_K {config.block_k}, BLOCK_N {config.block_n}")
    store, k_major = ws_weight_rows(b) or (None, False)
    tensors = (out, aux) + (dscore or ())
    if (store is None or a.stride(1) != 1 or a.stride(0) * 2 % 16 or a.data_ptr() % 16 or store.stride(0) * 2 % 16
            or not all(t.is_contiguous() for t in tensors)):
        raise ValueError(f"{stage}: variant 'ws' needs the weight stored [E, L, C] or [E, C, L] with 16-byte aligned "
                         f"rows, the activation row-major with 16-byte aligned rows (cp.async) and its other tensors "
                         f"contiguous; got weight view strides {b.stride()}, activation strides {a.stride()}")
    p = routing.padded_rows
    if not gather and a.shape[0] < p:
        raise ValueError(f"{stage}: the expert-ordered activation has {a.shape[0]} rows; the routing has {p}")
    check_ws_backend(stage, backend)
    if p == 0:
        return
    ensure_cuda_context(a.device)  # the descriptors encode on this thread (autograd's backward has its own)
    part_rows = config.block_m // mma_warpgroups(config)
    b_box = [config.block_n, config.block_k] if k_major else [config.block_k, config.block_n]
    if epilogue == EPI_SWIGLU:
        descs = (nvmma_descriptor(out, [part_rows, config.block_n], gl.bfloat16),
                 nvmma_descriptor(aux, [part_rows, config.block_n // 2], gl.bfloat16))
        h = ds_part = out  # unused by this epilogue
    else:
        descs = (nvmma_descriptor(out.view(torch.int32), [part_rows, config.block_n], gl.int32),
                 nvmma_descriptor(aux.view(torch.int32), [part_rows, config.block_n], gl.int32))
        h, ds_part = dscore if dscore is not None else (out, out)  # unused without DSCORE
    b_desc = nvmma_descriptor(store, b_box, gl.bfloat16)
    # Gathering, the kernel reads A through pointers and never touches a_desc: any valid descriptor.
    a_desc = b_desc if gather else nvmma_descriptor(a[:p], [config.block_m, config.block_k], gl.bfloat16)
    tiles = (p // config.block_m) * (n_cols // config.block_n)
    _moe_ws_gather_kernel_planned[(min(tiles, device_sms(a.device)),)](
        a, a_desc, b_desc, *descs,
        routing.gather_token, routing.sorted_route, routing.row_score, routing.tile_expert, routing.gate,
        h, ds_part, aux.view(torch.int32) if epilogue != EPI_SWIGLU else out,
        p, n_cols, reduced,
        a.stride(0),
        op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, STAGES=config.num_stages,
        SEGMENT=SEGMENT_ALIGN, CONSUMERS=mma_warpgroups(config), B_K_MAJOR=k_major, EPILOGUE=epilogue,
        DSCORE=dscore is not None, DS_CHUNK=DS_CHUNK, GATHER_A=gather, EPI_WARPGROUP=epilogue_warpgroup(config),
        GROUP_M=config.group_m,
        # num_warps: the default partition (a consumer warpgroup, or the epilogue warpgroup)
        num_warps=4, maxnreg=max_regs(config.num_warps),
    )


_moe_ws_wgrad_kernel_planned = PlannedKernel(moe_ws_wgrad_kernel)


def launch_moe_ws_wgrad(op_id: int, config, a: torch.Tensor, gather_a: bool, b: torch.Tensor, out: torch.Tensor,
                        accumulate: bool, routing, backend: str) -> None:
    """dW[e] [R, C] = the expert's rows of A [.., R] (x[gather] when ``gather_a``, else expert-sorted h) transposed
    times those of B [P, C], into the BF16 ``out`` [E, R, C], or ``out`` += it in FP32 when ``accumulate``; refuses,
    naming the value, what this kernel does not cover, then a backend other than sm_90 (before any work)."""
    _, r, c = out.shape
    _check_consumer_rows("wgrad", config)
    parts = consumers(config.num_warps)
    if r % config.block_m or c % config.block_n or config.block_n % 16:
        raise ValueError(f"wgrad: variant 'ws' needs BLOCK_M {config.block_m} dividing R {r} and BLOCK_N "
                         f"{config.block_n} (a multiple of 16) dividing C {c}")
    if SEGMENT_ALIGN % config.block_k or config.block_k % 16:
        raise ValueError(f"wgrad: variant 'ws' steps through an expert's {SEGMENT_ALIGN}-padded rows BLOCK_K at a time: "
                         f"BLOCK_K a multiple of 16 dividing {SEGMENT_ALIGN}; got {config.block_k}")
    # The BF16 store buffer is allocated with main_grad too.
    check_shared_bytes("wgrad", config, operand_ring_bytes(config), config.block_m * config.block_n * 2,
                       "the BF16 store buffer")
    if not ws_wgrad_addresses(a, b, out):
        raise ValueError(f"wgrad: variant 'ws' needs A and B row-major with 16-byte aligned rows (TMA, cp.async) and "
                         f"dW contiguous; got strides {a.stride()}, {b.stride()}, {out.stride()}")
    check_ws_backend("wgrad", backend)
    if routing.padded_rows == 0:  # no routed row anywhere: dW is zero, main_grad untouched
        if not accumulate:
            out.zero_()
        return
    ensure_cuda_context(a.device)  # the descriptors encode on this thread (autograd's backward has its own)
    # The BF16 dW as [E * R, C] for the TMA store; with main_grad the kernel stores through pointers (its
    # descriptor is one over a tile-sized scratch).
    store_t = torch.empty((64, config.block_n), dtype=torch.bfloat16, device=out.device) if accumulate else \
        out.reshape(-1, c)
    tiles = routing.num_experts * (r // config.block_m) * (c // config.block_n)
    _moe_ws_wgrad_kernel_planned[(min(tiles, device_sms(a.device)),)](
        nvmma_descriptor(a, [config.block_k, 64], gl.bfloat16), a,
        nvmma_descriptor(b, [config.block_k, config.block_n], gl.bfloat16),
        nvmma_descriptor(store_t, [64, config.block_n], gl.bfloat16), out,
        routing.gather_token, routing.expert_offsets, routing.expert_counts, routing.gate,
        r, c, routing.num_experts,
        a.stride(0), out.stride(0), out.stride(1), out.stride(2),
        op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, STAGES=config.num_stages,
        CONSUMERS=parts, GATHER_A=gather_a, ACCUMULATE=accumulate, GROUP_M=config.group_m,
        num_warps=4, maxnreg=max_regs(config.num_warps),  # num_warps: the default partition (one consumer warpgroup)
    )
