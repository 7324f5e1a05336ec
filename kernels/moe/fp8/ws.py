"""Warp-specialized sm_90 kernels of the FP8 MoE GEMMs (MoE FP8 variant "ws"), written in Gluon, with their
launchers: ``moe_fp8_ws_kernel``, down and dX (A = h_q, dgu_q: expert-sorted rows, by TMA; BF16 out by TMA store);
``moe_fp8_wgrad_ws_kernel``, the FP8 weight gradient (each block's scale rows staged in shared memory); and the K-block
pipeline both share with the gathered up and dgrad kernel (kernels/moe/fp8/ws_gather.py).

Why: the per-128-K promotion ``acc += blk * (a_s * b_s)`` needs the block's MMAs finished before its FMAs, and
Triton 3.6 waits for every outstanding wgmma after a dot whose result is not a loop-carried accumulator, so in
``moe_fp8_grouped_gemm_kernel`` a program's tensor-core work stops during each promotion. Here the consumer
issues block kb+1's wgmma before it waits for block kb's (two block accumulators in flight), so a promotion
runs while the next block's MMAs do; a producer streams both operand tiles into a ring, and the grid is
persistent (one program per SM), so the ring fills for the next tile during a tile's store. Program p takes the live
tiles p, p + programs, ... in the grouped order of the config's GROUP_M (kernels/moe/tile_order.py).

The math is the Triton kernels', operation for operation: per output tile, K blocks of 128 in ascending order,
each one zero-initialised wgmma chain over the block (4 x k32 on e4m3), then ``acc + blk * (a_s * b_s)`` in
FP32 (the scales are powers of two: the product is exact). A tile of padding rows only (segments are padded
to 128 rows, so a tile is all padding once its first row is) loads nothing, and padding rows store zeros, as
the Triton kernel's masked loads give. Gluon has no interpreter path: sm_90 only (the launchers refuse any other
backend by name, after the checks of the config itself).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from detkit.kernels.backend import PlannedKernel, ensure_cuda_context
from detkit.kernels.det_gemm.launch import device_sms
from detkit.kernels.det_gemm.ws import (
    CONSUMER_REGS, CONSUMER_WARPS, PRODUCER_REGS, PRODUCER_WARPS, check_shared_bytes, consumers, max_regs, store_part,
)
from detkit.kernels.moe.common import fp8_grouped_launch_name, fp8_wgrad_launch_name
from detkit.kernels.moe.gluon_blocks import (
    check_ws_backend, live_tile_offsets, live_tiles, nvmma_descriptor, refused_batch, store_wgrad_part, wgrad_tile,
)

QBLOCK_WS = 128  # the FP8 scale block along K: one ring slot holds one block of both operands


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
    these generic-proxy reads (without the fence, main_grad runs of the 128x128 tile differ from the Triton kernel's
    from run to run on the H200)."""
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
    every wgmma (C7514); unrolled past 3 blocks the registers run out and it does the same (C7512).
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
def fp8_tile_acc(t, a_ring, b_ring, ready, free, count, as_ptr, bs_ptr, gather_ptr, route_ptr, tile_expert_ptr,
                 num_tiles, num_n, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr, KB_GROUP: gl.constexpr, CONSUMERS: gl.constexpr,
                 PART: gl.constexpr, GATHER: gl.constexpr, GROUP_M: gl.constexpr):
    """One grouped-GEMM tile of this consumer part, before its epilogue: (acc, the next ring count, the tile's
    first row, first column, this part's rows and whether each is a routed row). A tile of padding only reads
    nothing; GATHER: the A rows (and their scales) are gather[row] (padding rows read token 0), loaded by cp.async."""
    QB: gl.constexpr = a_ring.type.shape[2]
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    off_m, off_n = live_tile_offsets(t, num_tiles, num_n, BLOCK_M, BLOCK_N, GROUP_M)
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
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr, GROUP_M: gl.constexpr):
    """The grouped GEMM's loads: every K block of each live tile (a tile whose first row is padding is padding only)."""
    QB: gl.constexpr = a_ring.type.shape[2]
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = live_tile_offsets(t, num_tiles, num_n, BLOCK_M, BLOCK_N, GROUP_M)
        if gl.load(route_ptr + off_m) >= 0:
            b_row = gl.load(tile_expert_ptr + off_m // SEGMENT) * C + off_n
            count = _load_blocks(a_desc, b_desc, a_ring, b_ring, ready, free, count, off_m, b_row, 0, L // QB)


@gluon.jit
def _consumer(a_ring, b_ring, ready, free, c_smem, c_desc, as_ptr, bs_ptr, route_ptr, tile_expert_ptr, num_tiles,
              num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr, KB_GROUP: gl.constexpr,
              CONSUMERS: gl.constexpr, PART: gl.constexpr, GROUP_M: gl.constexpr):
    """The grouped GEMM's consumer warpgroup: rows [PART * BLOCK_M / CONSUMERS, +BLOCK_M / CONSUMERS) of every tile."""
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        acc, count, off_m, off_n, rows, live = fp8_tile_acc(
            t, a_ring, b_ring, ready, free, count, as_ptr, bs_ptr, route_ptr, route_ptr, tile_expert_ptr, num_tiles,
            num_n, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP,
            CONSUMERS, PART, False, GROUP_M)
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


@gluon.jit(launch_metadata=fp8_grouped_launch_name)
def moe_fp8_ws_kernel(
    a_desc, b_desc,  # TMA descriptors: A_q [P, L] (box [BLOCK_M, 128]), B_q K-major as [E * C, L] (box [BLOCK_N, 128])
    c_desc,  # TMA descriptor over the output [P, C] (BF16, or FP32), box [BLOCK_M / CONSUMERS, BLOCK_N]
    as_ptr, bs_ptr, route_ptr, tile_expert_ptr, gate_ptr,
    P, C, L,  # C[p, :C] = sum_kb (A_q[p, kb] @ B_q[e][kb, :C]) * a_s[p, kb] * b_s[e][kb, :]
    stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc,
    op_id,  # names the launch only
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SEGMENT: gl.constexpr,
    KB_GROUP: gl.constexpr,  # K blocks per unrolled group of the consumers' loop; divides L / 128
    CONSUMERS: gl.constexpr,  # consumer warpgroups, each its own partition and BLOCK_M / CONSUMERS rows: 1 or 2
    GROUP_M: gl.constexpr,  # the tile order (kernels/moe/tile_order.py): row tiles per band
):
    a_ring, b_ring, ready, free, c_smem = _allocate(a_desc, b_desc, c_desc, c_desc.dtype, STAGES, CONSUMERS)
    num_n = C // BLOCK_N
    num_tiles = live_tiles(gate_ptr, P, num_n, BLOCK_M)  # none past the routing's P, none for a refused batch
    if CONSUMERS == 2:  # cooperative: the two warpgroups split each tile's rows and sync only through the ring
        gl.warp_specialize([
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, as_ptr, bs_ptr, route_ptr, tile_expert_ptr,
                         num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M,
                         BLOCK_N, SEGMENT, KB_GROUP, CONSUMERS, 0, GROUP_M)),
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, as_ptr, bs_ptr, route_ptr, tile_expert_ptr,
                         num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M,
                         BLOCK_N, SEGMENT, KB_GROUP, CONSUMERS, 1, GROUP_M)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, route_ptr, tile_expert_ptr, num_tiles, num_n, C,
                         L, BLOCK_M, BLOCK_N, SEGMENT, GROUP_M)),
        ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, as_ptr, bs_ptr, route_ptr, tile_expert_ptr,
                         num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M,
                         BLOCK_N, SEGMENT, KB_GROUP, CONSUMERS, 0, GROUP_M)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, route_ptr, tile_expert_ptr, num_tiles, num_n, C,
                         L, BLOCK_M, BLOCK_N, SEGMENT, GROUP_M)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


@gluon.jit
def _wgrad_producer(a_desc, b_desc, a_ring, b_ring, ready, free, scales, offsets_ptr, counts_ptr, num_tiles, num_r,
                    num_c, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """The weight gradient's loads: the expert's 128-row blocks of A_q [R, P] and B_q [C, P] (P is the K dim) and
    each block's scale rows (``scales``: their descriptors and rings)."""
    QB: gl.constexpr = a_ring.type.shape[2]
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        expert, pid_r, pid_c, start, routed = wgrad_tile(t, num_r, num_c, offsets_ptr, counts_ptr, GROUP_M)
        count = _load_blocks(a_desc, b_desc, a_ring, b_ring, ready, free, count, pid_r * BLOCK_M, pid_c * BLOCK_N,
                             start, gl.cdiv(routed, QB), scales)


@gluon.jit
def _wgrad_consumer(a_ring, b_ring, ready, free, scale_rings, c_smem, c_desc, dw_ptr, offsets_ptr, counts_ptr,
                    gate_ptr, num_tiles, num_r, num_c, R, stride_we, stride_wr, stride_wc, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, KB_GROUP: gl.constexpr, ACCUMULATE: gl.constexpr, CONSUMERS: gl.constexpr,
                    PART: gl.constexpr, GROUP_M: gl.constexpr):
    """The weight gradient's consumer warpgroup: rows [PART * BLOCK_M / CONSUMERS, +BLOCK_M / CONSUMERS) of dW[e]'s
    tile, its scales read from the ring at each promotion; BF16 out by TMA store, or main_grad += it in FP32 (an
    expert without rows leaves main_grad untouched)."""
    QB: gl.constexpr = a_ring.type.shape[2]
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    count = 0
    refused = refused_batch(gate_ptr)
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        expert, pid_r, pid_c, start, routed = wgrad_tile(t, num_r, num_c, offsets_ptr, counts_ptr, GROUP_M)
        acc, count = _k_blocks(a_ring, b_ring, ready, free, count, gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout),
                               gl.cdiv(routed, QB), None, None, 0, 0, KB_GROUP, True, PART,
                               scale_rings=scale_rings)
        store_wgrad_part(c_smem, c_desc, dw_ptr, acc, expert, routed, refused, R, pid_r * BLOCK_M + PART * ROWS,
                         pid_c * BLOCK_N, stride_we, stride_wr, stride_wc, ACCUMULATE, PART)
    tma.store_wait(0)


@gluon.jit(launch_metadata=fp8_wgrad_launch_name)
def moe_fp8_wgrad_ws_kernel(
    a_desc, b_desc,  # TMA descriptors: A_q [R, P] (box [BLOCK_M, 128]), B_q [C, P] (box [BLOCK_N, 128]), P contiguous
    as_desc, bs_desc,  # TMA descriptors over the scales' storage [P/128, R] and [P/128, C] (boxes [1, BLOCK_M | N])
    c_desc,  # TMA descriptor over the BF16 dW as [E * R, C], box [BLOCK_M / CONSUMERS, BLOCK_N] (unused: ACCUMULATE)
    dw_ptr,  # main_grad [E, R, C] FP32 (ACCUMULATE)
    offsets_ptr, counts_ptr, gate_ptr,
    R, C, num_experts,  # dW[e] [R, C] = sum over e's 128-row blocks kb (ascending) of A_q[:, kb] B_q[:, kb]^T s
    stride_we, stride_wr, stride_wc,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KB_GROUP: gl.constexpr,
    ACCUMULATE: gl.constexpr, CONSUMERS: gl.constexpr,
    GROUP_M: gl.constexpr,  # each dW[e]'s tiles in the grouped order (bands of GROUP_M row tiles), expert by expert
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
                               counts_ptr, gate_ptr, num_tiles, num_r, num_c, R, stride_we, stride_wr, stride_wc, BLOCK_M,
                               BLOCK_N, KB_GROUP, ACCUMULATE, CONSUMERS, 0, GROUP_M)),
            (_wgrad_consumer, (a_ring, b_ring, ready, free, scale_rings, c_smem, c_desc, dw_ptr, offsets_ptr,
                               counts_ptr, gate_ptr, num_tiles, num_r, num_c, R, stride_we, stride_wr, stride_wc, BLOCK_M,
                               BLOCK_N, KB_GROUP, ACCUMULATE, CONSUMERS, 1, GROUP_M)),
            (_wgrad_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, scales, offsets_ptr, counts_ptr,
                               num_tiles, num_r, num_c, BLOCK_M, BLOCK_N, GROUP_M)),
        ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_wgrad_consumer, (a_ring, b_ring, ready, free, scale_rings, c_smem, c_desc, dw_ptr, offsets_ptr,
                               counts_ptr, gate_ptr, num_tiles, num_r, num_c, R, stride_we, stride_wr, stride_wc, BLOCK_M,
                               BLOCK_N, KB_GROUP, ACCUMULATE, CONSUMERS, 0, GROUP_M)),
            (_wgrad_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, scales, offsets_ptr, counts_ptr,
                               num_tiles, num_r, num_c, BLOCK_M, BLOCK_N, GROUP_M)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


def kb_group(num_kb: int) -> int:
    """The consumers' unrolled group of K blocks: the largest of 3, 2, 1 dividing ``num_kb``. Compiled for sm_90,
    groups of 2 and 3 keep every accumulator in registers; 4 spilled at 128x128 and ptxas serialized the MMAs."""
    return next(g for g in (3, 2, 1) if num_kb % g == 0)


_SCALE_ROW_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def scale_row_descriptor(scales: torch.Tensor, block: int) -> TensorDescriptor:
    """A TMA descriptor over FP32 scales [blocks, columns] (row-major) reading boxes of one row x ``block`` columns
    into unswizzled shared memory (a row is wider than any swizzle span)."""
    return TensorDescriptor(scales, list(scales.shape), list(scales.stride()), [1, block], _SCALE_ROW_LAYOUT)


_moe_fp8_ws_kernel_planned = PlannedKernel(moe_fp8_ws_kernel)


def launch_fp8_ws(op_id: int, stage: str, config, a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor,
                  b_s: torch.Tensor, c: torch.Tensor, route: torch.Tensor, tile_expert: torch.Tensor, gate: torch.Tensor,
                  padded_rows: int,
                  segment: int, backend: str) -> None:
    """c [P, C] (c's dtype: BF16, or FP32) = the FP8 grouped GEMM of A_q [P, L] and the K-major weight b [E, C, L];
    refuses, naming the value, what this kernel does not cover, then a backend other than sm_90 (before any work)."""
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
    check_ws_backend(stage, backend)
    if padded_rows == 0:
        return
    ensure_cuda_context(a.device)  # the descriptors encode on this thread (autograd's backward has its own)
    a_desc = nvmma_descriptor(a[:padded_rows], [config.block_m, QBLOCK_WS])
    b_desc = nvmma_descriptor(b.reshape(e * n_cols, reduced), [config.block_n, QBLOCK_WS])
    c_desc = nvmma_descriptor(c, [config.block_m // consumers(config.num_warps), config.block_n],
                              {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[c.dtype])
    tiles = (padded_rows // config.block_m) * (n_cols // config.block_n)
    _moe_fp8_ws_kernel_planned[(min(tiles, device_sms(a.device)),)](
        a_desc, b_desc, c_desc, a_s, b_s, route, tile_expert, gate,
        padded_rows, n_cols, reduced,
        a_s.stride(0), a_s.stride(1), b_s.stride(0), b_s.stride(1), b_s.stride(2),
        op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, STAGES=config.num_stages, SEGMENT=segment,
        KB_GROUP=kb_group(reduced // QBLOCK_WS), CONSUMERS=consumers(config.num_warps), GROUP_M=config.group_m,
        num_warps=4, maxnreg=max_regs(config.num_warps),  # num_warps: the default partition (one consumer warpgroup)
    )


_moe_fp8_wgrad_ws_kernel_planned = PlannedKernel(moe_fp8_wgrad_ws_kernel)


def launch_fp8_wgrad_ws(config, a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
                        out: torch.Tensor, accumulate: bool, offsets: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor,
                        num_experts: int, backend: str) -> None:
    """dW[e] [R, C] (BF16 into ``out``, or ``out`` += it in FP32 when ``accumulate``) from the column-wise FP8
    operands a_q [R, P], b_q [C, P] (P > 0); refuses, naming the value, what this kernel does not cover, then a backend
    other than sm_90 (before any work)."""
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
    check_ws_backend("wgrad", backend)
    ensure_cuda_context(a_q.device)  # the descriptors encode on this thread (autograd's backward has its own)
    part_rows = config.block_m // consumers(config.num_warps)
    # The BF16 dW as [E * R, C] for the TMA store; accumulating into main_grad stores through pointers (the kernel
    # still takes a descriptor: one over a tile-sized scratch).
    store = torch.empty((part_rows, config.block_n), dtype=torch.bfloat16, device=out.device) if accumulate else \
        out.reshape(-1, c)
    c_desc = nvmma_descriptor(store, [part_rows, config.block_n], gl.bfloat16)
    tiles = num_experts * (r // config.block_m) * (c // config.block_n)
    _moe_fp8_wgrad_ws_kernel_planned[(min(tiles, device_sms(a_q.device)),)](
        nvmma_descriptor(a_q, [config.block_m, QBLOCK_WS]), nvmma_descriptor(b_q, [config.block_n, QBLOCK_WS]),
        scale_row_descriptor(a_s.t(), config.block_m), scale_row_descriptor(b_s.t(), config.block_n),
        c_desc, out, offsets, counts, gate,
        r, c, num_experts,
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, STAGES=config.num_stages, KB_GROUP=3,
        ACCUMULATE=accumulate, CONSUMERS=consumers(config.num_warps), GROUP_M=config.group_m,
        num_warps=4, maxnreg=max_regs(config.num_warps),
    )
