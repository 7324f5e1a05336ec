"""The FP8 MoE grouped GEMM with an FP32 output (down-projection y, per-route dX) as a warp-specialized sm_90
kernel (MoE FP8 variant "ws"), written in Gluon.

Why: the per-128-K promotion ``acc += blk * (a_s * b_s)`` needs the block's MMAs finished before its FMAs, and
Triton 3.6 waits for every outstanding wgmma after a dot whose result is not a loop-carried accumulator, so in
``moe_fp8_grouped_gemm_kernel`` a program's tensor-core work stops during each promotion. Here the consumer
issues block kb+1's wgmma before it waits for block kb's (two block accumulators in flight), so a promotion
runs while the next block's MMAs do; one producer warp streams both operand tiles by TMA into a ring, and the
grid is persistent (one program per SM), so the ring fills for the next tile during a tile's store.

The math is the Triton kernel's, operation for operation: per output tile, K blocks of 128 in ascending order,
each one zero-initialised wgmma chain over the block (4 x k32 on e4m3), then ``acc + blk * (a_s * b_s)`` in
FP32 (the scales are powers of two: the product is exact, so a fused multiply-add rounds the same way). A tile
of padding rows only (segments are padded to 128 rows, so a tile is all padding once its first row is) loads
nothing and stores zeros, and padding rows store zeros, as the Triton kernel's masked loads give.

Only operands TMA can address: A [P, L] e4m3 row-major (h_q, dgu_q: expert-sorted, no gather), B the K-major
weight [E, C, L] contiguous, C a multiple of BLOCK_N. Gluon has no interpreter path: sm_90 only.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.det_gemm_ws import CONSUMER_REGS, CONSUMER_WARPS, PRODUCER_REGS, PRODUCER_WARPS, consumers, max_regs
from kernels.moe import stage_name

QBLOCK_WS = 128  # the FP8 scale block along K: one ring slot holds one block of both operands
GROUPED_OPS = ("moe_fp8_up_swiglu", "moe_fp8_down", "moe_fp8_dgrad_dswiglu", "moe_fp8_dx_route")


def fp8_stage_name(op: str, **dims: int) -> str:
    """The one name shared by a launch, its NVTX range and its report row."""
    return stage_name(op, "fp8", **dims)


def grouped_launch_metadata(grid, metadata, args):
    """Launch name and FLOPs of an FP8 grouped GEMM (Triton or Gluon): C[P, C] over the reduced L."""
    p, c, l = args["P"], args["C"], args["L"]
    return {"name": fp8_stage_name(GROUPED_OPS[args["op_id"]], P=p, N=c, K=l), "flops": 2.0 * p * c * l}


@gluon.jit
def _producer(a_desc, b_desc, a_ring, b_ring, ready, free, route_ptr, tile_expert_ptr, num_tiles, num_n, C, L,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr):
    """TMA loads of each live tile's K blocks into the ring; slot s is refilled once every consumer released it."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    QB: gl.constexpr = a_ring.type.shape[2]
    num_kb = L // QB
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m = (t // num_n) * BLOCK_M
        if gl.load(route_ptr + off_m) >= 0:  # a tile whose first row is padding is padding only: no loads
            b_row = gl.load(tile_expert_ptr + off_m // SEGMENT) * C + (t % num_n) * BLOCK_N
            for kb in range(num_kb):
                slot = count % STAGES
                # A fresh barrier counts as having completed the phase before phase 0: the first pass waits on nothing.
                mbarrier.wait(free.index(slot), ((count // STAGES) & 1) ^ 1)
                bar = ready.index(slot)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [off_m, kb * QB], bar, a_ring.index(slot))
                tma.async_copy_global_to_shared(b_desc, [b_row, kb * QB], bar, b_ring.index(slot))
                count += 1


@gluon.jit
def _issue(a_ring, b_ring, ready, count, blk, PART: gl.constexpr, ROWS: gl.constexpr):
    """Wait for ring slot ``count``'s tiles and issue its 128-K block's MMAs (zero-initialised) into ``blk``'s registers."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    slot = count % STAGES
    mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
    return warpgroup_mma(a_ring.index(slot).slice(PART * ROWS, ROWS, dim=0), b_ring.index(slot).permute((1, 0)), blk,
                         use_acc=False, is_async=True)


@gluon.jit
def _block_scale(as_rows, bs_tile, kb, stride_asl, stride_bsl):
    """K block kb's scale per row of the part: a_s[row, kb] * b_s[e, kb, the tile's 128 columns] (exact)."""
    return gl.load(as_rows + kb * stride_asl)[:, None] * gl.load(bs_tile + kb * stride_bsl)


@gluon.jit
def _retire(blk, acc, scale, free, count, PENDING: gl.constexpr):
    """Wait until PENDING MMA groups remain (ring slot ``count``'s is done), hand that slot back, promote."""
    STAGES: gl.constexpr = free.type.shape[0]
    blk = warpgroup_mma_wait(num_outstanding=PENDING, deps=(blk, ))
    mbarrier.arrive(free.index(count % STAGES), count=1)
    return blk, acc + blk * scale


@gluon.jit
def _consumer(a_ring, b_ring, ready, free, c_smem, c_desc, as_ptr, bs_ptr, route_ptr, tile_expert_ptr, num_tiles,
              num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr, KB_GROUP: gl.constexpr,
              CONSUMERS: gl.constexpr, PART: gl.constexpr):
    """One consumer warpgroup: rows [PART * BLOCK_M / CONSUMERS, +BLOCK_M / CONSUMERS) of every tile."""
    QB: gl.constexpr = a_ring.type.shape[2]
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m = (t // num_n) * BLOCK_M
        off_n = (t % num_n) * BLOCK_N
        rows = off_m + PART * ROWS + gl.arange(0, ROWS, layout=row_layout)
        acc = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
        if gl.load(route_ptr + off_m) >= 0:
            as_rows = as_ptr + rows * stride_asm
            bs_tile = bs_ptr + gl.load(tile_expert_ptr + off_m // SEGMENT) * stride_bse + (off_n // QB) * stride_bsc
            # K blocks in groups of KB_GROUP (unrolled): per block kb >= 1 of a group, issue kb's MMAs, then retire
            # kb-1 (wait until only kb's are in flight, hand its slot back, promote it) while kb's run. Every block
            # gets fresh accumulator registers and nothing is in flight across the loop's back edge: an in-flight
            # accumulator carried by a loop is copied there, and ptxas then serializes every wgmma (C7514); unrolled
            # past 3 blocks the registers ran out and it did the same (C7512).
            for g in range(0, L // QB, KB_GROUP):
                prev = _issue(a_ring, b_ring, ready, count, gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout), PART,
                              ROWS)
                s_prev = _block_scale(as_rows, bs_tile, g, stride_asl, stride_bsl)
                for i in gl.static_range(1, KB_GROUP):
                    cur = _issue(a_ring, b_ring, ready, count + i, gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout),
                                 PART, ROWS)
                    s_cur = _block_scale(as_rows, bs_tile, g + i, stride_asl, stride_bsl)
                    acc = _retire(prev, acc, s_prev, free, count + i - 1, 1)[1]
                    prev = cur
                    s_prev = s_cur
                acc = _retire(prev, acc, s_prev, free, count + KB_GROUP - 1, 0)[1]
                count += KB_GROUP
        live = gl.load(route_ptr + rows) >= 0  # padding rows store zeros
        acc = gl.where(live[:, None], acc, 0.0)
        # Epilogue through shared memory and a TMA store: this part's slice of the tile buffer, reused once the
        # previous tile's store has read it; the store runs while the next tile's MMAs do.
        c_part = c_smem.slice(PART * ROWS, ROWS, dim=0)
        tma.store_wait(0)
        c_part.store(acc)
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m + PART * ROWS, off_n], c_part)
    tma.store_wait(0)


@gluon.jit(launch_metadata=grouped_launch_metadata)
def moe_fp8_ws_kernel(
    a_desc, b_desc,  # TMA descriptors: A_q [P, L] (box [BLOCK_M, 128]), B_q K-major as [E * C, L] (box [BLOCK_N, 128])
    c_desc,  # TMA descriptor over the FP32 output [P, C], box [BLOCK_M / CONSUMERS, BLOCK_N]
    as_ptr, bs_ptr, route_ptr, tile_expert_ptr,
    P, C, L,  # C[p, :C] = sum_kb (A_q[p, kb] @ B_q[e][kb, :C]) * a_s[p, kb] * b_s[e][kb, :]
    stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc,
    op_id,  # names the launch only
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SEGMENT: gl.constexpr,
    KB_GROUP: gl.constexpr,  # K blocks per unrolled group of the consumers' loop; divides L / 128
    CONSUMERS: gl.constexpr,  # consumer warpgroups, each its own partition and BLOCK_M / CONSUMERS rows: 1 or 2
):
    a_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], c_desc.layout)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=CONSUMERS)
    num_n = C // BLOCK_N
    num_tiles = (P // BLOCK_M) * num_n
    if CONSUMERS == 2:  # cooperative: the two warpgroups split each tile's rows and sync only through the ring
        gl.warp_specialize([
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, as_ptr, bs_ptr, route_ptr, tile_expert_ptr,
                         num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP, CONSUMERS, 0)),
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, as_ptr, bs_ptr, route_ptr, tile_expert_ptr,
                         num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP, CONSUMERS, 1)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, route_ptr, tile_expert_ptr, num_tiles, num_n, C,
                         L, BLOCK_M, BLOCK_N, SEGMENT)),
        ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, as_ptr, bs_ptr, route_ptr, tile_expert_ptr,
                         num_tiles, num_n, C, L, stride_asm, stride_asl, stride_bse, stride_bsl, stride_bsc, BLOCK_M, BLOCK_N, SEGMENT, KB_GROUP, CONSUMERS, 0)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, route_ptr, tile_expert_ptr, num_tiles, num_n, C,
                         L, BLOCK_M, BLOCK_N, SEGMENT)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


def kb_group(num_kb: int) -> int:
    """The consumers' unrolled group of K blocks: the largest of 3, 2, 1 dividing ``num_kb``. Compiled for sm_90,
    groups of 2 and 3 keep every accumulator in registers; 4 spilled at 128x128 and ptxas serialized the MMAs."""
    return next(g for g in (3, 2, 1) if num_kb % g == 0)


def fp8_ws_descriptor(tensor: torch.Tensor, box: list[int], dtype=gl.float8e4nv) -> TensorDescriptor:
    """A TMA descriptor over the row-major matrix ``tensor`` (e4m3, or FP32 for the output) with its NVMMA shared
    layout."""
    layout = gl.NVMMASharedLayout.get_default_for(box, dtype)
    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), box, layout)


def launch_fp8_ws(op_id: int, stage: str, config, a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor,
                  b_s: torch.Tensor, c: torch.Tensor, route: torch.Tensor, tile_expert: torch.Tensor, padded_rows: int,
                  segment: int, sms: int) -> None:
    """c [P, C] fp32 = the FP8 grouped GEMM of A_q [P, L] and the K-major weight b [E, C, L]; refuses, naming the
    value, what this kernel does not cover (before any work)."""
    e, n_cols, reduced = b.shape
    if config.block_k != QBLOCK_WS:
        raise ValueError(f"{stage}: variant 'ws' runs one {QBLOCK_WS}-K scale block per ring slot; got BLOCK_K "
                         f"{config.block_k}")
    if config.block_n > QBLOCK_WS or n_cols % config.block_n:
        raise ValueError(f"{stage}: variant 'ws' needs BLOCK_N <= {QBLOCK_WS} dividing the output width {n_cols}; "
                         f"got BLOCK_N {config.block_n}")
    if not b.is_contiguous() or not c.is_contiguous() or a.stride(1) != 1 or a.stride(0) % 16 or a.data_ptr() % 16:
        raise ValueError(f"{stage}: variant 'ws' needs A row-major with 16-byte aligned rows and the K-major weight "
                         f"[E, C, L] and the output contiguous; got A strides {a.stride()}, weight strides {b.stride()}, output "
                         f"strides {c.stride()}")
    if reduced % QBLOCK_WS:
        raise ValueError(f"{stage}: the reduced dim {reduced} must be a multiple of {QBLOCK_WS}")
    a_desc = fp8_ws_descriptor(a[:padded_rows], [config.block_m, QBLOCK_WS])
    b_desc = fp8_ws_descriptor(b.reshape(e * n_cols, reduced), [config.block_n, QBLOCK_WS])
    c_desc = fp8_ws_descriptor(c, [config.block_m // consumers(config.num_warps), config.block_n], gl.float32)
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
