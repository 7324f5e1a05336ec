"""Warp-specialized sm_90 kernels of the FP8 MoE GEMMs (MoE FP8 variant "ws"), written in Gluon.

Why: the per-128-K promotion ``acc += blk * (a_s * b_s)`` needs the block's MMAs finished before its FMAs, and
Triton 3.6 waits for every outstanding wgmma after a dot whose result is not a loop-carried accumulator, so in
``moe_fp8_grouped_gemm_kernel`` a program's tensor-core work stops during each promotion. Here the consumer
issues block kb+1's wgmma before it waits for block kb's (two block accumulators in flight), so a promotion
runs while the next block's MMAs do; a producer streams both operand tiles into a ring, and the grid is
persistent (one program per SM), so the ring fills for the next tile during a tile's store.

The math is the Triton kernels', operation for operation: per output tile, K blocks of 128 in ascending order,
each one zero-initialised wgmma chain over the block (4 x k32 on e4m3), then ``acc + blk * (a_s * b_s)`` in
FP32 (the scales are powers of two: the product is exact). A tile of padding rows only (segments are padded
to 128 rows, so a tile is all padding once its first row is) loads nothing, and padding rows store zeros, as
the Triton kernel's masked loads give.

Kernels: ``moe_fp8_ws_kernel``, down and dX (A = h_q, dgu_q: expert-sorted rows, by TMA; BF16 out by TMA store;
pinned on sm_90); ``moe_fp8_wgrad_ws_kernel``, the FP8 weight gradient (each block's scale rows staged in shared
memory; pinned on sm_90 since FP8 table .13); ``moe_fp8_ws_gather_kernel``, up and dgrad+dSwiGLU (A rows gathered
by cp.async, their epilogues; pinned on sm_90 since table .9). Gluon has no interpreter path: sm_90 only.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from detkit.kernels.det_gemm_ws import (
    CONSUMER_REGS, CONSUMER_WARPS, PRODUCER_REGS, PRODUCER_WARPS, check_shared_bytes, consumers, max_regs, store_part,
)
from detkit.kernels.moe import stage_name

QBLOCK_WS = 128  # the FP8 scale block along K: one ring slot holds one block of both operands
# The gathered-A producer: one warpgroup issuing 16-byte cp.async copies (8 per thread for a 128x128 e4m3 tile).
# Registers after the hand-off: 2 x 128 x 232 + 128 x 48 = 64K (with 224 for the consumers ptxas spilled and
# serialized their wgmma; the producer's copies fit in 48).
GATHER_PRODUCER_WARPS = gl.constexpr(4)
GATHER_PRODUCER_REGS = gl.constexpr(48)
GATHER_CONSUMER_REGS = gl.constexpr(232)
# The FP8 dgrad's dscore partials: per row, one per 16 dh columns (64-column chunk c, q < 4: the columns
# 64c + 8j + 2q + b one thread of the sm_90 accumulator layout holds), so the epilogue sums them without moving data
# between threads.
DS_GROUP = gl.constexpr(16)
GROUPED_OPS = ("moe_fp8_up_swiglu", "moe_fp8_down", "moe_fp8_dgrad_dswiglu", "moe_fp8_dx_route")


def fp8_stage_name(op: str, **dims: int) -> str:
    """The one name shared by a launch, its NVTX range and its report row."""
    return stage_name(op, "fp8", **dims)


def grouped_launch_metadata(grid, metadata, args):
    """Launch name and FLOPs of an FP8 grouped GEMM (Triton or Gluon): C[P, C] over the reduced L."""
    p, c, l = args["P"], args["C"], args["L"]
    return {"name": fp8_stage_name(GROUPED_OPS[args["op_id"]], P=p, N=c, K=l), "flops": 2.0 * p * c * l}


@gluon.jit
def live_tiles(gate_ptr, P, num_n, BLOCK_M: gl.constexpr):
    """Tiles of a persistent grouped grid that hold routed rows, from the routing's gate (kernels/moe.py
    tile_is_live): up to its P (a GEMM queued over the largest P before the host has read the counts stops at the
    real one), none for a batch its validation counts refuse."""
    refused = gl.load(gate_ptr + 1) + gl.load(gate_ptr + 2) + gl.load(gate_ptr + 3)
    return (gl.where(refused == 0, gl.minimum(gl.load(gate_ptr), P), 0) // BLOCK_M) * num_n


@gluon.jit
def _load_blocks(a_desc, b_desc, a_ring, b_ring, ready, free, count, a_row, b_row, k0, num_kb, scales=None):
    """TMA loads of K blocks [k0 + kb * 128, +128) for kb < num_kb, A rows from a_row, B rows from b_row, into the
    ring from slot ``count`` on; a slot is refilled once every consumer has released it. Returns the next count.
    ``scales`` (the weight gradient's, else None): (as_desc, bs_desc, as_ring, bs_ring), each block's scale rows
    [k0 / 128 + kb, a_row | b_row, +BLOCK) loaded into the same slot of their own rings, on the same barrier."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    QB: gl.constexpr = a_ring.type.shape[2]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes + (
        0 if scales is None else scales[0].block_type.nbytes + scales[1].block_type.nbytes)
    for kb in range(num_kb):
        slot = count % STAGES
        # A fresh barrier counts as having completed the phase before phase 0: the first pass waits on nothing.
        mbarrier.wait(free.index(slot), ((count // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, nbytes)
        tma.async_copy_global_to_shared(a_desc, [a_row, k0 + kb * QB], bar, a_ring.index(slot))
        tma.async_copy_global_to_shared(b_desc, [b_row, k0 + kb * QB], bar, b_ring.index(slot))
        if scales is not None:
            tma.async_copy_global_to_shared(scales[0], [k0 // QB + kb, a_row], bar, scales[2].index(slot))
            tma.async_copy_global_to_shared(scales[1], [k0 // QB + kb, b_row], bar, scales[3].index(slot))
        count += 1
    return count


@gluon.jit
def _issue(a_ring, b_ring, ready, count, blk, PART: gl.constexpr, ROWS: gl.constexpr, FENCE: gl.constexpr):
    """Wait for ring slot ``count``'s tiles and issue its 128-K block's MMAs (zero-initialised) into ``blk``'s
    registers. FENCE: the A tile was written by cp.async (generic proxy), which wgmma (async proxy) may read only
    after a proxy fence."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    slot = count % STAGES
    mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
    if FENCE:
        fence_async_shared()
    return warpgroup_mma(a_ring.index(slot).slice(PART * ROWS, ROWS, dim=0), b_ring.index(slot).permute((1, 0)), blk,
                         use_acc=False, is_async=True)


@gluon.jit
def _block_scale(a_scales, b_scales, kb, stride_a, stride_b):
    """The grouped GEMM's K block kb scales (powers of two), loaded one block ahead: a [ROWS, 1] per row of the part
    and b, the weight block's one value for the tile's 128 columns (the weight gradient's per-column scales come
    from shared memory instead: ``_smem_scale``). Kept apart: their product is formed only at the promotion."""
    b = gl.load(b_scales + kb * stride_b)
    return gl.load(a_scales + kb * stride_a)[:, None], b


@gluon.jit
def _smem_scale(scale_rings, count, PART: gl.constexpr, blk):
    """Ring slot ``count``'s scales, staged in shared memory by the producer (the weight gradient's): a [ROWS, 1]
    for this part's rows, b [1, BLOCK_N] per column. Read at the promotion, so no block's per-column scales stay in
    registers while the next block's MMAs run."""
    STAGES: gl.constexpr = scale_rings[0].type.shape[0]
    ROWS: gl.constexpr = blk.type.shape[0]
    layout: gl.constexpr = blk.type.layout
    slot = count % STAGES
    BLOCK_N: gl.constexpr = scale_rings[1].type.shape[2]
    a_rows: gl.constexpr = scale_rings[0].type.shape[2]
    a = scale_rings[0].index(slot).reshape([a_rows]).slice(PART * ROWS, ROWS).load(gl.SliceLayout(1, layout))
    b = scale_rings[1].index(slot).reshape([BLOCK_N]).load(gl.SliceLayout(0, layout))
    return a[:, None], b[None, :]


@gluon.jit
def _retire(blk, acc, scale, free, count, PENDING: gl.constexpr, PART: gl.constexpr = 0, scale_rings=None):
    """Wait until PENDING MMA groups remain (ring slot ``count``'s is done), hand that slot back, promote:
    acc + blk * (a_s * b_s), the Triton kernel's operation order (the product of the scales is exact).
    ``scale_rings``: the scales are read from the slot's shared memory (``_smem_scale``) and used before the slot is
    handed back, behind a proxy fence: the producer's next TMA write to the slot (async proxy) must not overtake
    these generic-proxy reads (without it, main_grad runs of the 128x128 tile differed from the Triton kernel's in
    10 of 20 repeats on the H200; none of 20 with it, reports/2026-11-30-h200-s9)."""
    STAGES: gl.constexpr = free.type.shape[0]
    blk = warpgroup_mma_wait(num_outstanding=PENDING, deps=(blk, ))
    if scale_rings is not None:
        scale = _smem_scale(scale_rings, count, PART, blk)
        acc = acc + blk * (scale[0] * scale[1])
        fence_async_shared()
        mbarrier.arrive(free.index(count % STAGES), count=1)
    else:
        mbarrier.arrive(free.index(count % STAGES), count=1)
        acc = acc + blk * (scale[0] * scale[1])
    return blk, acc


@gluon.jit
def _k_blocks(a_ring, b_ring, ready, free, count, acc, num_kb, a_scales, b_scales, stride_a, stride_b,
              KB_GROUP: gl.constexpr, TAIL: gl.constexpr, PART: gl.constexpr,
              FENCE: gl.constexpr = False, scale_rings=None):
    """acc + sum over K blocks kb < num_kb (ascending) of blk_kb * scale_kb, blk_kb the zero-initialised MMA chain of
    ring slot count + kb. Returns (acc, the next count).

    Blocks in groups of KB_GROUP (unrolled), then (TAIL) any remainder one at a time: per block of a group after
    its first, issue its MMAs, then retire the one before (wait until only the new one is in flight, hand its slot
    back, promote it) while the new one's run. Every block gets fresh accumulator registers and nothing is in flight
    across a loop's back edge: an in-flight accumulator carried by a loop is copied there, and ptxas then serializes
    every wgmma (C7514); unrolled past 3 blocks the registers ran out and it did the same (C7512).
    ``scale_rings``: the scales come from the ring's shared memory at each promotion (a_scales, b_scales unused)."""
    ROWS: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    layout: gl.constexpr = acc.type.layout
    full = num_kb - num_kb % KB_GROUP
    for g in range(0, full, KB_GROUP):
        prev = _issue(a_ring, b_ring, ready, count, gl.zeros([ROWS, BLOCK_N], gl.float32, layout), PART, ROWS,
                      FENCE)
        s_prev = _block_scale(a_scales, b_scales, g, stride_a, stride_b) if scale_rings is None else None
        for i in gl.static_range(1, KB_GROUP):
            cur = _issue(a_ring, b_ring, ready, count + i, gl.zeros([ROWS, BLOCK_N], gl.float32, layout), PART,
                         ROWS, FENCE)
            s_cur = _block_scale(a_scales, b_scales, g + i, stride_a, stride_b) if scale_rings is None \
                else None
            acc = _retire(prev, acc, s_prev, free, count + i - 1, 1, PART, scale_rings)[1]
            prev = cur
            s_prev = s_cur
        acc = _retire(prev, acc, s_prev, free, count + KB_GROUP - 1, 0, PART, scale_rings)[1]
        count += KB_GROUP
    if TAIL:  # (its code costs registers: without it the 128x128 tile compiles without spills)
        for kb in range(full, num_kb):
            blk = _issue(a_ring, b_ring, ready, count, gl.zeros([ROWS, BLOCK_N], gl.float32, layout), PART, ROWS,
                         FENCE)
            scale = _block_scale(a_scales, b_scales, kb, stride_a, stride_b) if scale_rings is None \
                else None
            acc = _retire(blk, acc, scale, free, count, 0, PART, scale_rings)[1]
            count += 1
    return acc, count


@gluon.jit
def _grouped_tile(t, a_ring, b_ring, ready, free, count, as_ptr, bs_ptr, gather_ptr, route_ptr, tile_expert_ptr, num_n,
                  L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr, KB_GROUP: gl.constexpr, CONSUMERS: gl.constexpr,
                  PART: gl.constexpr, GATHER: gl.constexpr):
    """One grouped-GEMM tile of this consumer part, before its epilogue: (acc, the next ring count, the tile's
    first row, first column, this part's rows and whether each is a routed row). A tile of padding only reads
    nothing; GATHER: the A rows (and their scales) are gather[row] (padding rows read token 0), loaded by cp.async."""
    QB: gl.constexpr = a_ring.type.shape[2]
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    off_m = (t // num_n) * BLOCK_M
    off_n = (t % num_n) * BLOCK_N
    rows = off_m + PART * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
    acc = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
    if gl.load(route_ptr + off_m) >= 0:
        bs_tile = bs_ptr + gl.load(tile_expert_ptr + off_m // SEGMENT) * stride_bse + (off_n // QB) * stride_bsc
        if GATHER:
            a_rows = gl.load(gather_ptr + rows)
        else:
            a_rows = rows
        acc, count = _k_blocks(a_ring, b_ring, ready, free, count, acc, L // QB, as_ptr + a_rows * stride_asm,
                               bs_tile, stride_asl, stride_bsl, KB_GROUP, False, PART, GATHER)
    return acc, count, off_m, off_n, rows, gl.load(route_ptr + rows) >= 0


@gluon.jit
def _producer(a_desc, b_desc, a_ring, b_ring, ready, free, route_ptr, tile_expert_ptr, num_tiles, num_n, C, L,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr):
    """The grouped GEMM's loads: every K block of each live tile (a tile whose first row is padding is padding only)."""
    QB: gl.constexpr = a_ring.type.shape[2]
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m = (t // num_n) * BLOCK_M
        if gl.load(route_ptr + off_m) >= 0:
            b_row = gl.load(tile_expert_ptr + off_m // SEGMENT) * C + (t % num_n) * BLOCK_N
            count = _load_blocks(a_desc, b_desc, a_ring, b_ring, ready, free, count, off_m, b_row, 0, L // QB)


@gluon.jit
def _consumer(a_ring, b_ring, ready, free, c_smem, c_desc, as_ptr, bs_ptr, route_ptr, tile_expert_ptr, num_tiles,
              num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr, KB_GROUP: gl.constexpr,
              CONSUMERS: gl.constexpr, PART: gl.constexpr):
    """The grouped GEMM's consumer warpgroup: rows [PART * BLOCK_M / CONSUMERS, +BLOCK_M / CONSUMERS) of every tile."""
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        acc, count, off_m, off_n, rows, live = _grouped_tile(
            t, a_ring, b_ring, ready, free, count, as_ptr, bs_ptr, route_ptr, route_ptr, tile_expert_ptr, num_n, L,
            stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP, CONSUMERS,
            PART, False)
        # Padding rows store zeros.
        store_part(c_smem, c_desc, gl.where(live[:, None], acc, 0.0), off_m + PART * ROWS, off_n, PART)
    tma.store_wait(0)


@gluon.jit
def _allocate(a_desc, b_desc, c_desc, c_dtype: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """Shared memory of both kernels: the operand ring (STAGES x one A and one B tile), its ready barriers (the
    producer's TMA bytes landed) and free barriers (every consumer released the slot), and the output tile buffer."""
    a_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_smem = gl.allocate_shared_memory(c_dtype, [CONSUMERS * c_desc.block_type.shape[0], c_desc.block_type.shape[1]],
                                       c_desc.layout)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=CONSUMERS)
    return a_ring, b_ring, ready, free, c_smem


@gluon.jit(launch_metadata=grouped_launch_metadata)
def moe_fp8_ws_kernel(
    a_desc, b_desc,  # TMA descriptors: A_q [P, L] (box [BLOCK_M, 128]), B_q K-major as [E * C, L] (box [BLOCK_N, 128])
    c_desc,  # TMA descriptor over the output [P, C] (BF16, or FP32), box [BLOCK_M / CONSUMERS, BLOCK_N]
    as_ptr, bs_ptr, route_ptr, tile_expert_ptr,
    P, C, L,  # C[p, :C] = sum_kb (A_q[p, kb] @ B_q[e][kb, :C]) * a_s[p, kb] * b_s[e][kb, :]
    stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc,
    op_id,  # names the launch only
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SEGMENT: gl.constexpr,
    KB_GROUP: gl.constexpr,  # K blocks per unrolled group of the consumers' loop; divides L / 128
    CONSUMERS: gl.constexpr,  # consumer warpgroups, each its own partition and BLOCK_M / CONSUMERS rows: 1 or 2
):
    a_ring, b_ring, ready, free, c_smem = _allocate(a_desc, b_desc, c_desc, c_desc.dtype, STAGES, CONSUMERS)
    num_n = C // BLOCK_N
    num_tiles = (P // BLOCK_M) * num_n
    if CONSUMERS == 2:  # cooperative: the two warpgroups split each tile's rows and sync only through the ring
        gl.warp_specialize([
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, as_ptr, bs_ptr, route_ptr, tile_expert_ptr,
                         num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M,
                         BLOCK_N, SEGMENT, KB_GROUP, CONSUMERS, 0)),
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, as_ptr, bs_ptr, route_ptr, tile_expert_ptr,
                         num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M,
                         BLOCK_N, SEGMENT, KB_GROUP, CONSUMERS, 1)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, route_ptr, tile_expert_ptr, num_tiles, num_n, C,
                         L, BLOCK_M, BLOCK_N, SEGMENT)),
        ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, as_ptr, bs_ptr, route_ptr, tile_expert_ptr,
                         num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M,
                         BLOCK_N, SEGMENT, KB_GROUP, CONSUMERS, 0)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, route_ptr, tile_expert_ptr, num_tiles, num_n, C,
                         L, BLOCK_M, BLOCK_N, SEGMENT)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


def wgrad_launch_metadata(grid, metadata, args):
    """Launch name of an FP8 weight-gradient kernel (Triton or Gluon)."""
    return {"name": fp8_stage_name("moe_fp8_wgrad", R=args["R"], C=args["C"])}


@gluon.jit
def wgrad_tile(t, num_r, num_c, offsets_ptr, counts_ptr):
    """Weight-gradient tile t: (expert, pid_r, pid_c, the expert's first padded row, its routed rows)."""
    per_expert = num_r * num_c
    expert = t // per_expert
    rem = t % per_expert
    return expert, rem // num_c, rem % num_c, gl.load(offsets_ptr + expert), gl.load(counts_ptr + expert)


@gluon.jit
def store_wgrad_part(c_smem, c_desc, dw_ptr, acc, expert, routed, R, row, col, stride_we, stride_wr, stride_wc,
                     ACCUMULATE: gl.constexpr, PART: gl.constexpr):
    """A weight gradient's part of dW[expert][row:+ROWS, col:+BLOCK_N] (BF16 and FP8 kernels): BF16 by TMA store into
    dW as [E * R, C], or ACCUMULATE: main_grad += acc in FP32 through pointers, untouched for an expert without
    rows."""
    if ACCUMULATE:
        if routed > 0:
            layout: gl.constexpr = acc.type.layout
            rows = row + gl.arange(0, acc.type.shape[0], layout=gl.SliceLayout(1, layout))
            cols = col + gl.arange(0, acc.type.shape[1], layout=gl.SliceLayout(0, layout))
            ptrs = dw_ptr + expert * stride_we + rows[:, None] * stride_wr + cols[None, :] * stride_wc
            gl.store(ptrs, gl.load(ptrs) + acc)
    else:
        store_part(c_smem, c_desc, acc, expert * R + row, col, PART)


@gluon.jit
def _wgrad_producer(a_desc, b_desc, a_ring, b_ring, ready, free, scales, offsets_ptr, counts_ptr, num_tiles, num_r,
                    num_c, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The weight gradient's loads: the expert's 128-row blocks of A_q [R, P] and B_q [C, P] (P is the K dim) and
    each block's scale rows (``scales``: their descriptors and rings)."""
    QB: gl.constexpr = a_ring.type.shape[2]
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        expert, pid_r, pid_c, start, routed = wgrad_tile(t, num_r, num_c, offsets_ptr, counts_ptr)
        count = _load_blocks(a_desc, b_desc, a_ring, b_ring, ready, free, count, pid_r * BLOCK_M, pid_c * BLOCK_N,
                             start, gl.cdiv(routed, QB), scales)


@gluon.jit
def _wgrad_consumer(a_ring, b_ring, ready, free, scale_rings, c_smem, c_desc, dw_ptr, offsets_ptr, counts_ptr,
                    num_tiles, num_r, num_c, R, stride_we, stride_wr, stride_wc, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, KB_GROUP: gl.constexpr, ACCUMULATE: gl.constexpr, CONSUMERS: gl.constexpr,
                    PART: gl.constexpr):
    """The weight gradient's consumer warpgroup: rows [PART * BLOCK_M / CONSUMERS, +BLOCK_M / CONSUMERS) of dW[e]'s
    tile, its scales read from the ring at each promotion; BF16 out by TMA store, or main_grad += it in FP32 (an
    expert without rows leaves main_grad untouched)."""
    QB: gl.constexpr = a_ring.type.shape[2]
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        expert, pid_r, pid_c, start, routed = wgrad_tile(t, num_r, num_c, offsets_ptr, counts_ptr)
        acc, count = _k_blocks(a_ring, b_ring, ready, free, count, gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout),
                               gl.cdiv(routed, QB), None, None, 0, 0, KB_GROUP, True, PART,
                               scale_rings=scale_rings)
        store_wgrad_part(c_smem, c_desc, dw_ptr, acc, expert, routed, R, pid_r * BLOCK_M + PART * ROWS,
                         pid_c * BLOCK_N, stride_we, stride_wr, stride_wc, ACCUMULATE, PART)
    tma.store_wait(0)


@gluon.jit(launch_metadata=wgrad_launch_metadata)
def moe_fp8_wgrad_ws_kernel(
    a_desc, b_desc,  # TMA descriptors: A_q [R, P] (box [BLOCK_M, 128]), B_q [C, P] (box [BLOCK_N, 128]), P contiguous
    as_desc, bs_desc,  # TMA descriptors over the scales' storage [P/128, R] and [P/128, C] (boxes [1, BLOCK_M | N])
    c_desc,  # TMA descriptor over the BF16 dW as [E * R, C], box [BLOCK_M / CONSUMERS, BLOCK_N] (unused: ACCUMULATE)
    dw_ptr,  # main_grad [E, R, C] FP32 (ACCUMULATE)
    offsets_ptr, counts_ptr,
    R, C, num_experts,  # dW[e] [R, C] = sum over e's 128-row blocks kb (ascending) of A_q[:, kb] B_q[:, kb]^T s
    stride_we, stride_wr, stride_wc,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KB_GROUP: gl.constexpr,
    ACCUMULATE: gl.constexpr, CONSUMERS: gl.constexpr,
):
    a_ring, b_ring, ready, free, c_smem = _allocate(a_desc, b_desc, c_desc, gl.bfloat16, STAGES, CONSUMERS)
    # Each ring slot's scale rows beside its operand tiles (one TMA barrier for all four).
    as_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + as_desc.block_type.shape, as_desc.layout)
    bs_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + bs_desc.block_type.shape, bs_desc.layout)
    num_r = R // BLOCK_M
    num_c = C // BLOCK_N
    num_tiles = num_experts * num_r * num_c
    scale_rings = (as_ring, bs_ring)
    scales = (as_desc, bs_desc, as_ring, bs_ring)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_wgrad_consumer, (a_ring, b_ring, ready, free, scale_rings, c_smem, c_desc, dw_ptr, offsets_ptr,
                               counts_ptr, num_tiles, num_r, num_c, R, stride_we, stride_wr, stride_wc, BLOCK_M,
                               BLOCK_N, KB_GROUP, ACCUMULATE, CONSUMERS, 0)),
            (_wgrad_consumer, (a_ring, b_ring, ready, free, scale_rings, c_smem, c_desc, dw_ptr, offsets_ptr,
                               counts_ptr, num_tiles, num_r, num_c, R, stride_we, stride_wr, stride_wc, BLOCK_M,
                               BLOCK_N, KB_GROUP, ACCUMULATE, CONSUMERS, 1)),
            (_wgrad_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, scales, offsets_ptr, counts_ptr,
                               num_tiles, num_r, num_c, BLOCK_M, BLOCK_N)),
        ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_wgrad_consumer, (a_ring, b_ring, ready, free, scale_rings, c_smem, c_desc, dw_ptr, offsets_ptr,
                               counts_ptr, num_tiles, num_r, num_c, R, stride_we, stride_wr, stride_wc, BLOCK_M,
                               BLOCK_N, KB_GROUP, ACCUMULATE, CONSUMERS, 0)),
            (_wgrad_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, scales, offsets_ptr, counts_ptr,
                               num_tiles, num_r, num_c, BLOCK_M, BLOCK_N)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


@gluon.jit
def _gather_producer(a_ptr, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr, tile_expert_ptr, num_tiles,
                     num_n, C, L, stride_am, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr,
                     B_K_MAJOR: gl.constexpr = True):
    """A gathered grouped GEMM's loads (a 4-warp partition; FP8 up and dgrad, and the BF16 up and dgrad of
    kernels/moe_ws.py): the A rows a[gather[p]] by 16-byte cp.async (Hopper's TMA cannot gather rows), each thread's
    copies arriving on the slot's ready barrier when they land, and the weight tile by TMA from its storage as
    [E * C, L] (B_K_MAJOR) or [E * L, C]. A padding row reads token 0 (the routing's gather index there); the
    consumer zeroes those rows. One pass of the copies covers 16 rows x 8 copies of 16 bytes: 128 e4m3 or 64 BF16
    columns, so a ring slot's K width must be a multiple of that."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    QB: gl.constexpr = a_ring.type.shape[2]
    VEC: gl.constexpr = 128 // a_ring.dtype.primitive_bitwidth  # elements per 16-byte copy
    rows_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [4, 8], [4, 1], [1, 0])
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m = (t // num_n) * BLOCK_M
        if gl.load(route_ptr + off_m) >= 0:
            expert = gl.load(tile_expert_ptr + off_m // SEGMENT)
            off_n = (t % num_n) * BLOCK_N
            tokens = gl.load(gather_ptr + off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rows_layout)))
            a_rows = a_ptr + tokens[:, None].to(gl.int64) * stride_am + \
                gl.arange(0, QB, layout=gl.SliceLayout(0, rows_layout))[None, :]
            for kb in range(L // QB):
                slot = count % STAGES
                mbarrier.wait(free.index(slot), ((count // STAGES) & 1) ^ 1)
                bar = ready.index(slot)
                mbarrier.expect(bar, b_desc.block_type.nbytes)
                if B_K_MAJOR:
                    tma.async_copy_global_to_shared(b_desc, [expert * C + off_n, kb * QB], bar, b_ring.index(slot))
                else:
                    tma.async_copy_global_to_shared(b_desc, [expert * L + kb * QB, off_n], bar, b_ring.index(slot))
                async_copy.async_copy_global_to_shared(a_ring.index(slot), a_rows + kb * QB)
                async_copy.mbarrier_arrive(bar, increment_count=False)
                count += 1


@gluon.jit
def _swiglu_consumer(a_ring, b_ring, ready, free, turn, gu_smem, gu_desc, h_smem, h_desc, as_ptr, bs_ptr, gather_ptr,
                     route_ptr, tile_expert_ptr, num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse,
                     stride_bsl, stride_bsc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr,
                     KB_GROUP: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr, PART: gl.constexpr):
    """The up-projection's consumer warpgroup: the grouped consumer's K loop over gathered rows (their scales read
    through the gather index too), then the SwiGLU epilogue of moe_fp8_grouped_gemm_kernel (EPI 3): gu rounded to
    BF16, h = silu(g) * u from those BF16 values in FP32, rounded once; both stored by TMA. Its tiles: ``_turn``."""
    PARTS: gl.constexpr = 1 if PINGPONG else CONSUMERS  # warpgroups sharing one tile
    ROWS: gl.constexpr = BLOCK_M // PARTS
    P0: gl.constexpr = 0 if PINGPONG else PART  # this warpgroup's part of its tiles
    count = 0
    i = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        mine, blocks = _turn(t, i, route_ptr, num_n, L, BLOCK_M, a_ring.type.shape[2], PINGPONG, PART)
        if mine:
            _wait_turn(turn, i, PINGPONG, PART)
            acc, _, off_m, off_n, rows, live = _grouped_tile(
                t, a_ring, b_ring, ready, free, count, as_ptr, bs_ptr, gather_ptr, route_ptr, tile_expert_ptr, num_n, L,
                stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP, PARTS,
                P0, True)
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
def _turn(t, i, route_ptr, num_n, L, BLOCK_M: gl.constexpr, QB: gl.constexpr, PINGPONG: gl.constexpr,
          PART: gl.constexpr):
    """Whose tile t (the program's i-th) is, and how many ring slots it takes. Cooperative: every consumer's, each
    taking its rows of it. PINGPONG: the warpgroups take the program's tiles in turn (tile i is warpgroup i % 2's), so
    one's epilogue runs while the other's MMAs do; each counts the other's slots to find its own in the ring. A tile
    whose first row is padding takes none (the producer loads nothing for it)."""
    blocks = gl.where(gl.load(route_ptr + (t // num_n) * BLOCK_M) >= 0, L // QB, 0)
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
def _bf16_pair_bits(lo, hi):
    """Two FP32 tensors rounded to BF16 and packed as one int32 per element (lo in the low half): an interleaved
    (g, u) column pair of a BF16 matrix, as its int32 view stores it."""
    lo_bits = lo.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    hi_bits = hi.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32)
    return lo_bits | (hi_bits << 16)


@gluon.jit
def _bf16_pair_values(bits):
    """The two BF16 values of each packed int32 (low half first) as FP32 (exact)."""
    return (bits << 16).to(gl.float32, bitcast=True), (bits & -65536).to(gl.float32, bitcast=True)


@gluon.jit
def _e4m3_pow2(amax):
    """detkit.kernels.fp8_quant.pow2_scale written again in Gluon (which cannot call a Triton function): (scale, 1/scale),
    the smallest power of two 2**k with amax / 2**k <= 448."""
    bits = amax.to(gl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(gl.int32)  # 448 = 1.75 * 2**8
    k = gl.where(amax > 0, k, 0)
    k = gl.minimum(gl.maximum(k, -126), 126)
    return ((k + 127) << 23).to(gl.float32, bitcast=True), ((127 - k) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _e4m3_bits(x):
    """detkit.kernels.fp8_quant.to_e4m3 on sm_90 (saturate to +-448, NaN kept, cvt.rn.satfinite), as uint8 bits in int32."""
    q = gl.where(x != x, x, gl.minimum(gl.maximum(x, -448.0), 448.0)).to(gl.float8e4nv)
    return q.to(gl.int8, bitcast=True).to(gl.int32) & 0xFF


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
                      CONSUMERS: gl.constexpr, DSCORE: gl.constexpr, PINGPONG: gl.constexpr, PART: gl.constexpr):
    """The dgrad's consumer warpgroup: dh = s * (dout_q[gather] @ W2q^T) over BLOCK_N = 64 or 128 columns of I,
    then moe_fp8_grouped_gemm_kernel's EPI 2: (DSCORE) the dscore partials from the unscaled accumulator and the
    forward's h (``_dscore_partials``); dg, du from the saved gu (its (g, u) pairs read as one int32 each), dgu
    rounded once to BF16 and stored (TMA, as int32 pairs), then quantized 1 x 128 from the stored BF16 values (64 dh
    columns = 128 dgu columns = one scale block per row): dgu_q (e4m3 pairs, TMA-stored as int16) and its scales. Its
    tiles: ``_turn``."""
    PARTS: gl.constexpr = 1 if PINGPONG else CONSUMERS  # warpgroups sharing one tile
    P0: gl.constexpr = 0 if PINGPONG else PART  # this warpgroup's part of its tiles
    count = 0
    i = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        mine, blocks = _turn(t, i, route_ptr, num_n, L, BLOCK_M, a_ring.type.shape[2], PINGPONG, PART)
        if mine:
            _dswiglu_tile(t, a_ring, b_ring, ready, free, turn, i, dgu_smem, dgu_desc, q_smem, q_desc, as_ptr, bs_ptr,
                          gather_ptr, route_ptr, tile_expert_ptr, score_ptr, gu_ptr, qs_ptr, h_ptr, ds_ptr, count, num_n,
                          C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, stride_gm, stride_qsm,
                          BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP, PARTS, DSCORE, PINGPONG, P0, PART)
        count += blocks
        i += 1
    tma.store_wait(0)


@gluon.jit
def _dswiglu_tile(t, a_ring, b_ring, ready, free, turn, i, dgu_smem, dgu_desc, q_smem, q_desc, as_ptr, bs_ptr,
                  gather_ptr, route_ptr, tile_expert_ptr, score_ptr, gu_ptr, qs_ptr, h_ptr, ds_ptr, count, num_n, C, L,
                  stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, stride_gm, stride_qsm,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr, KB_GROUP: gl.constexpr,
                  PARTS: gl.constexpr, DSCORE: gl.constexpr, PINGPONG: gl.constexpr, P0: gl.constexpr,
                  BUF: gl.constexpr):
    """One dgrad tile of ``_dswiglu_consumer``: rows [P0 * BLOCK_M / PARTS, +BLOCK_M / PARTS) of tile t from ring slot
    ``count`` on, its outputs through store-buffer part BUF."""
    ROWS: gl.constexpr = BLOCK_M // PARTS
    _wait_turn(turn, i, PINGPONG, BUF)
    acc, _, off_m, off_n, rows, live = _grouped_tile(
        t, a_ring, b_ring, ready, free, count, as_ptr, bs_ptr, gather_ptr, route_ptr, tile_expert_ptr, num_n, L,
        stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP, PARTS,
        P0, True)
    _pass_turn(turn, PINGPONG, BUF)
    # Columns of dh: (g, u) column pairs of gu and dgu; padding rows (they read token 0) as the Triton kernel's: +0.
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))
    acc = gl.where(live[:, None], acc, 0.0)
    row = off_m + P0 * ROWS
    if DSCORE:  # first: the h tile and the products are dead before gu is loaded
        _dscore_partials(acc * gl.load(h_ptr + rows[:, None] * C + cols[None, :]).to(gl.float32), ds_ptr, row,
                         off_n, C)
    g, u = _bf16_pair_values(gl.load(gu_ptr + rows[:, None] * stride_gm + cols[None, :]))
    s = 1.0 / (1.0 + gl.exp(-g))
    silu = g * s
    dh = acc * gl.load(score_ptr + rows)[:, None]
    # The operation order of kernels/swiglu.py (as dswiglu_epilogue).
    pair = _bf16_pair_bits((dh * u) * (s + silu * (1.0 - s)), dh * silu)
    store_part(dgu_smem, dgu_desc, pair, row, off_n, BUF)
    dg, du = _bf16_pair_values(pair)  # the stored BF16 dgu, as the row-wise quantizer would read it
    mag = gl.maximum(gl.abs(dg), gl.abs(du))
    block = off_n // 64  # the scale block of the tile's first 64 dh columns
    if BLOCK_N == 64:
        scale, inv = _e4m3_pow2(gl.max(mag, axis=1))
        inv_cols = inv[:, None]
        gl.store(qs_ptr + rows * stride_qsm + block, scale)
    else:  # two scale blocks per row: each half's amax by masking the other (magnitudes are >= 0)
        first = ((cols - off_n) < 64)[None, :]
        scale0, inv0 = _e4m3_pow2(gl.max(gl.where(first, mag, 0.0), axis=1))
        scale1, inv1 = _e4m3_pow2(gl.max(gl.where(first, 0.0, mag), axis=1))
        inv_cols = gl.where(first, inv0[:, None], inv1[:, None])
        gl.store(qs_ptr + rows * stride_qsm + block, scale0)
        gl.store(qs_ptr + rows * stride_qsm + block + 1, scale1)
    q = _e4m3_bits(dg * inv_cols) | (_e4m3_bits(du * inv_cols) << 8)
    store_part(q_smem, q_desc, q, row, off_n, BUF)


@gluon.jit(launch_metadata=grouped_launch_metadata)
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
    EPILOGUE: gl.constexpr,  # 3: SwiGLU (up, h quantized by the row-wise pass); 2: dSwiGLU + 1x128 quantization (dgrad)
    DSCORE: gl.constexpr = False,  # dgrad: the dscore partials too
    PINGPONG: gl.constexpr = False,  # the two consumer warpgroups take whole BLOCK_M-row tiles in turn (``_turn``)
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
                                    CONSUMERS, PINGPONG, 0)),
                (_swiglu_consumer, (a_ring, b_ring, ready, free, turn, gu_smem, gu_desc, h_smem, h_desc, as_ptr, bs_ptr,
                                    gather_ptr, route_ptr, tile_expert_ptr, num_tiles, num_n, C, L, stride_asm,
                                    stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP,
                                    CONSUMERS, PINGPONG, 1)),
                (_gather_producer, (a_ptr, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr, tile_expert_ptr,
                                    num_tiles, num_n, C, L, stride_am, BLOCK_M, BLOCK_N, SEGMENT)),
            ], [CONSUMER_WARPS, GATHER_PRODUCER_WARPS], [GATHER_CONSUMER_REGS, GATHER_PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_swiglu_consumer, (a_ring, b_ring, ready, free, turn, gu_smem, gu_desc, h_smem, h_desc, as_ptr, bs_ptr,
                                    gather_ptr, route_ptr, tile_expert_ptr, num_tiles, num_n, C, L, stride_asm,
                                    stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP,
                                    CONSUMERS, PINGPONG, 0)),
                (_gather_producer, (a_ptr, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr, tile_expert_ptr,
                                    num_tiles, num_n, C, L, stride_am, BLOCK_M, BLOCK_N, SEGMENT)),
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
                                     DSCORE, PINGPONG, 0)),
                (_dswiglu_consumer, (a_ring, b_ring, ready, free, turn, dgu_smem, gu_desc, q_smem, h_desc, as_ptr,
                                     bs_ptr, gather_ptr, route_ptr, tile_expert_ptr, score_ptr, gu_ptr, qs_ptr, h_ptr,
                                     ds_ptr, num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl,
                                     stride_bsc, stride_gm, stride_qsm, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP, CONSUMERS,
                                     DSCORE, PINGPONG, 1)),
                (_gather_producer, (a_ptr, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr, tile_expert_ptr,
                                    num_tiles, num_n, C, L, stride_am, BLOCK_M, BLOCK_N, SEGMENT)),
            ], [CONSUMER_WARPS, GATHER_PRODUCER_WARPS], [GATHER_CONSUMER_REGS, GATHER_PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_dswiglu_consumer, (a_ring, b_ring, ready, free, turn, dgu_smem, gu_desc, q_smem, h_desc, as_ptr,
                                     bs_ptr, gather_ptr, route_ptr, tile_expert_ptr, score_ptr, gu_ptr, qs_ptr, h_ptr,
                                     ds_ptr, num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl,
                                     stride_bsc, stride_gm, stride_qsm, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP, CONSUMERS,
                                     DSCORE, PINGPONG, 0)),
                (_gather_producer, (a_ptr, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr, tile_expert_ptr,
                                    num_tiles, num_n, C, L, stride_am, BLOCK_M, BLOCK_N, SEGMENT)),
            ], [GATHER_PRODUCER_WARPS], [GATHER_PRODUCER_REGS])


def kb_group(num_kb: int) -> int:
    """The consumers' unrolled group of K blocks: the largest of 3, 2, 1 dividing ``num_kb``. Compiled for sm_90,
    groups of 2 and 3 keep every accumulator in registers; 4 spilled at 128x128 and ptxas serialized the MMAs."""
    return next(g for g in (3, 2, 1) if num_kb % g == 0)


def fp8_ws_descriptor(tensor: torch.Tensor, box: list[int], dtype=gl.float8e4nv) -> TensorDescriptor:
    """A TMA descriptor over the row-major matrix ``tensor`` of ``dtype`` (e4m3 by default; the epilogues' BF16,
    FP32 and packed-int outputs, and the BF16 kernels of kernels/moe_ws.py, pass theirs) with its NVMMA shared
    layout."""
    layout = gl.NVMMASharedLayout.get_default_for(box, dtype)
    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), box, layout)


def scale_row_descriptor(scales: torch.Tensor, block: int) -> TensorDescriptor:
    """A TMA descriptor over FP32 scales [blocks, columns] (row-major) reading boxes of one row x ``block`` columns
    into unswizzled shared memory (a row is wider than any swizzle span)."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(scales, list(scales.shape), list(scales.stride()), [1, block], layout)


def launch_fp8_ws(op_id: int, stage: str, config, a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor,
                  b_s: torch.Tensor, c: torch.Tensor, route: torch.Tensor, tile_expert: torch.Tensor, padded_rows: int,
                  segment: int, sms: int) -> None:
    """c [P, C] (c's dtype: BF16, or FP32) = the FP8 grouped GEMM of A_q [P, L] and the K-major weight b [E, C, L];
    refuses, naming the value, what this kernel does not cover (before any work)."""
    e, n_cols, reduced = b.shape
    if config.block_k != QBLOCK_WS:
        raise ValueError(f"{stage}: variant 'ws' runs one {QBLOCK_WS}-K scale block per ring slot; got BLOCK_K "
                         f"{config.block_k}")
    if config.block_n > QBLOCK_WS or n_cols % config.block_n:
        raise ValueError(f"{stage}: variant 'ws' needs BLOCK_N <= {QBLOCK_WS} dividing the output width {n_cols}; "
                         f"got BLOCK_N {config.block_n}")
    if not b.is_contiguous() or not c.is_contiguous() or a.stride(1) != 1 or a.stride(0) % 16 or a.data_ptr() % 16:
        raise ValueError(f"{stage}: variant 'ws' needs A row-major with 16-byte aligned rows and the K-major weight "
                         f"[E, C, L] and the output contiguous; got A strides {a.stride()}, weight strides "
                         f"{b.stride()}, output strides {c.stride()}")
    if reduced % QBLOCK_WS:
        raise ValueError(f"{stage}: the reduced dim {reduced} must be a multiple of {QBLOCK_WS}")
    a_desc = fp8_ws_descriptor(a[:padded_rows], [config.block_m, QBLOCK_WS])
    b_desc = fp8_ws_descriptor(b.reshape(e * n_cols, reduced), [config.block_n, QBLOCK_WS])
    c_desc = fp8_ws_descriptor(c, [config.block_m // consumers(config.num_warps), config.block_n],
                               {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[c.dtype])
    tiles = (padded_rows // config.block_m) * (n_cols // config.block_n)
    moe_fp8_ws_kernel[(min(tiles, sms),)](
        a_desc, b_desc, c_desc, a_s, b_s, route, tile_expert,
        padded_rows, n_cols, reduced,
        a_s.stride(0), a_s.stride(1), b_s.stride(0), b_s.stride(1), b_s.stride(2),
        op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, STAGES=config.num_stages, SEGMENT=segment,
        KB_GROUP=kb_group(reduced // QBLOCK_WS), CONSUMERS=consumers(config.num_warps),
        num_warps=4, maxnreg=max_regs(config.num_warps),  # num_warps: the default partition (one consumer warpgroup)
    )


def launch_fp8_wgrad_ws(config, a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
                        out: torch.Tensor, accumulate: bool, offsets: torch.Tensor, counts: torch.Tensor,
                        num_experts: int, sms: int) -> None:
    """dW[e] [R, C] (BF16 into ``out``, or ``out`` += it in FP32 when ``accumulate``) from the column-wise FP8
    operands a_q [R, P], b_q [C, P]; refuses, naming the value, what this kernel does not cover (before any work)."""
    r, c = a_q.shape[0], b_q.shape[0]
    if config.block_k != QBLOCK_WS:
        raise ValueError(f"wgrad: variant 'ws' runs one {QBLOCK_WS}-row scale block per ring slot; got BLOCK_K "
                         f"{config.block_k}")
    if r % config.block_m or c % config.block_n:
        raise ValueError(f"wgrad: variant 'ws' needs BLOCK_M {config.block_m} dividing R {r} and BLOCK_N "
                         f"{config.block_n} dividing C {c}")
    if any(t.stride(1) != 1 or t.stride(0) % 16 or t.data_ptr() % 16 for t in (a_q, b_q)) or not out.is_contiguous():
        raise ValueError(f"wgrad: variant 'ws' needs a_q, b_q row-major with 16-byte aligned rows and dW contiguous; "
                         f"got strides {a_q.stride()}, {b_q.stride()}, {out.stride()}")
    # The scales [rows, P/128] are read through their storage [P/128, rows] (moe_fp8_quant_colwise's), one TMA row
    # [1, BLOCK] per K block.
    if any(t.stride(0) != 1 or t.stride(1) % 4 or t.data_ptr() % 16 for t in (a_s, b_s)):
        raise ValueError(f"wgrad: variant 'ws' needs the scales stored [P/128, rows] with 16-byte aligned rows (a "
                         f"[rows, P/128] view of it); got strides {a_s.stride()}, {b_s.stride()}")
    ring = config.num_stages * (config.block_m + config.block_n) * (QBLOCK_WS + 4)  # operand tiles + FP32 scale rows
    # The BF16 store buffer is allocated with main_grad too.
    check_shared_bytes("wgrad", config, ring, config.block_m * config.block_n * 2, "the BF16 store buffer")
    part_rows = config.block_m // consumers(config.num_warps)
    # The BF16 dW as [E * R, C] for the TMA store; accumulating into main_grad stores through pointers (the kernel
    # still takes a descriptor: one over a tile-sized scratch).
    store = torch.empty((part_rows, config.block_n), dtype=torch.bfloat16, device=out.device) if accumulate else \
        out.reshape(-1, c)
    c_desc = fp8_ws_descriptor(store, [part_rows, config.block_n], gl.bfloat16)
    tiles = num_experts * (r // config.block_m) * (c // config.block_n)
    moe_fp8_wgrad_ws_kernel[(min(tiles, sms),)](
        fp8_ws_descriptor(a_q, [config.block_m, QBLOCK_WS]), fp8_ws_descriptor(b_q, [config.block_n, QBLOCK_WS]),
        scale_row_descriptor(a_s.t(), config.block_m), scale_row_descriptor(b_s.t(), config.block_n),
        c_desc, out, offsets, counts,
        r, c, num_experts,
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, STAGES=config.num_stages, KB_GROUP=3,
        ACCUMULATE=accumulate, CONSUMERS=consumers(config.num_warps),
        num_warps=4, maxnreg=max_regs(config.num_warps),
    )


def launch_fp8_ws_gather(op_id: int, stage: str, config, epilogue: int, a_q: torch.Tensor, a_s: torch.Tensor,
                         b: torch.Tensor, b_s: torch.Tensor, outputs: dict[str, torch.Tensor], gather: torch.Tensor,
                         route: torch.Tensor, tile_expert: torch.Tensor, gate: torch.Tensor, padded_rows: int,
                         segment: int, sms: int) -> None:
    """A gathered-A grouped GEMM of a_q [T, L] rows and the K-major weight b [E, C, L] with its epilogue: 3, the
    up-projection (outputs gu [P, 2I], h [P, I] BF16; h quantized by the row-wise pass); 2, dgrad + dSwiGLU (outputs
    score, gu in; dgu, dgu_q, dgu_s out; with "h" and "ds_part" [P, I / DS_GROUP], the dscore partials too). BLOCK_M
    64 with 8 warps: the two consumer warpgroups take 64-row tiles in turn (ping-pong) instead of sharing 128-row ones.
    Refuses, naming the value, what this kernel does not cover (before any work)."""
    e, n_cols, reduced = b.shape
    pingpong = config.block_m == 64 and consumers(config.num_warps) == 2
    # up: 128 interleaved (g, u) columns; dgrad: 64 or 128 columns of dh = one or two 1x128 blocks of dgu.
    want_n = (QBLOCK_WS,) if epilogue == 3 else (QBLOCK_WS // 2, QBLOCK_WS)
    if config.block_k != QBLOCK_WS or config.block_n not in want_n:
        raise ValueError(f"{stage}: variant 'ws' runs BLOCK_K {QBLOCK_WS} and BLOCK_N in {want_n} here; got BLOCK_K "
                         f"{config.block_k}, BLOCK_N {config.block_n}")
    if n_cols % config.block_n or reduced % QBLOCK_WS:
        raise ValueError(f"{stage}: variant 'ws' needs C {n_cols} a multiple of {config.block_n} and L {reduced} of "
                         f"{QBLOCK_WS}")
    # Shared memory: the ring (one e4m3 A and B block per stage) and the epilogue's store buffers (up: gu and h
    # BF16; dgrad: dgu as int32 pairs and dgu_q as int16 pairs).
    ring = config.num_stages * (config.block_m + config.block_n) * QBLOCK_WS
    part_rows = config.block_m if pingpong else config.block_m // consumers(config.num_warps)
    store = consumers(config.num_warps) * part_rows * config.block_n * (3 if epilogue == 3 else 6)
    check_shared_bytes(stage, config, ring, store, "the epilogue")
    if (not b.is_contiguous() or not all(t.is_contiguous() for t in outputs.values()) or a_q.stride(1) != 1
            or a_q.stride(0) % 16 or a_q.data_ptr() % 16):
        raise ValueError(f"{stage}: variant 'ws' needs the activation row-major with 16-byte aligned rows (cp.async), "
                         f"the K-major weight and the outputs contiguous; got strides {a_q.stride()} and {b.stride()}")
    if epilogue == 3:
        gu, h = outputs["gu"], outputs["h"]
        descs = (fp8_ws_descriptor(gu, [part_rows, config.block_n], gl.bfloat16),
                 fp8_ws_descriptor(h, [part_rows, config.block_n // 2], gl.bfloat16))
        score = gu_bits = q_s = h_in = ds_part = a_s  # unused by this epilogue
    else:
        score, q_s, gu_bits = outputs["score"], outputs["dgu_s"], outputs["gu"].view(torch.int32)
        # The dscore partials need both h and ds_part; without them the kernel reads neither (placeholders).
        h_in, ds_part = (outputs["h"], outputs["ds_part"]) if "ds_part" in outputs else (q_s, q_s)
        descs = (fp8_ws_descriptor(outputs["dgu"].view(torch.int32), [part_rows, config.block_n], gl.int32),
                 fp8_ws_descriptor(outputs["dgu_q"].view(torch.int16), [part_rows, config.block_n], gl.int16))
    tiles = (padded_rows // config.block_m) * (n_cols // config.block_n)
    moe_fp8_ws_gather_kernel[(min(tiles, sms),)](
        a_q, fp8_ws_descriptor(b.reshape(e * n_cols, reduced), [config.block_n, QBLOCK_WS]), *descs,
        a_s, b_s, gather, route, tile_expert, gate, score, gu_bits, q_s, h_in, ds_part,
        padded_rows, n_cols, reduced,
        a_q.stride(0), a_s.stride(0), a_s.stride(1), b_s.stride(0), b_s.stride(1), b_s.stride(2),
        gu_bits.stride(0), q_s.stride(0),
        op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, STAGES=config.num_stages, SEGMENT=segment,
        KB_GROUP=kb_group(reduced // QBLOCK_WS), CONSUMERS=consumers(config.num_warps), EPILOGUE=epilogue,
        DSCORE="ds_part" in outputs, PINGPONG=pingpong, num_warps=4, maxnreg=max_regs(config.num_warps),
    )
