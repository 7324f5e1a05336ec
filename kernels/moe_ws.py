"""Warp-specialized sm_90 kernel of the BF16 MoE grouped GEMMs whose A rows are expert-sorted (down, dX) and
whose output is FP32 (MoE variant "ws"), written in Gluon.

Why: the Triton grouped kernel writes its FP32 tile (y of the down-projection, dX per route: 800 MB each at the
reference shape) from registers while nothing else runs in its program. Here the grid is persistent (one
program per SM), one producer warp streams A and B tiles into a shared-memory ring by TMA, two consumer
warpgroups (64 rows each) issue asynchronous wgmma as each slot lands, and the tile leaves through shared memory
and a TMA store that runs while the next tile's MMAs do (what took the FP8 kernel of the same stages from 854 to
997 TFLOP/s).

The math is moe_grouped_gemm_tma_kernel's: per output tile, BLOCK_K-wide K steps in ascending order, one wgmma
chain accumulating into the same FP32 registers (k16 instructions in ascending order, as tl.dot issues them), the
tile stored unrounded; padding rows store zeros and a tile whose first row is padding loads nothing. Every tile
past the routing's P (the gate) is skipped, so the kernel also runs over a PendingRouting's bound.

Gluon has no interpreter path: sm_90 only; kernels.moe refuses a "ws" config on any other backend by name.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.det_gemm_ws import (
    CONSUMER_REGS, CONSUMER_WARPS, PRODUCER_REGS, PRODUCER_WARPS, consumers, max_regs, store_part,
)
from kernels.moe import SEGMENT_ALIGN, grouped_launch_name, ws_weight_rows
from kernels.moe_fp8_ws import SM90_SHARED_BYTES, live_tiles

SEGMENT = gl.constexpr(SEGMENT_ALIGN)  # an expert's rows start on a multiple of this (kernels/moe_routing.py)


@gluon.jit
def _producer(a_desc, b_desc, a_ring, b_ring, ready, free, route_ptr, tile_expert_ptr, num_tiles, C, L,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, B_K_MAJOR: gl.constexpr):
    """TMA loads of every K step of each live tile into the ring; a slot is refilled once every consumer has
    released it. The weight is [E * C, L] (K-major) or [E * L, C]: an expert's rows start at e * C or e * L."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    BLOCK_K: gl.constexpr = a_ring.type.shape[2]
    num_n = C // BLOCK_N
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m = (t // num_n) * BLOCK_M
        off_n = (t % num_n) * BLOCK_N
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
def _consumer(a_ring, b_ring, ready, free, c_smem, c_desc, route_ptr, num_tiles, C, L, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, B_K_MAJOR: gl.constexpr, CONSUMERS: gl.constexpr, PART: gl.constexpr):
    """One consumer warpgroup: rows [PART * BLOCK_M / CONSUMERS, +BLOCK_M / CONSUMERS) of every tile; async wgmma
    over the ring with at most one MMA in flight behind the newest, each slot handed back once the MMA that read it
    has finished; then the FP32 tile (padding rows zero) through shared memory and a TMA store."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    BLOCK_K: gl.constexpr = a_ring.type.shape[2]
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_n = C // BLOCK_N
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m = (t // num_n) * BLOCK_M
        off_n = (t % num_n) * BLOCK_N
        rows = off_m + PART * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
        acc = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
        if gl.load(route_ptr + off_m) >= 0:
            for ks in range(L // BLOCK_K):
                slot = count % STAGES
                mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
                b = b_ring.index(slot)
                if B_K_MAJOR:
                    b = b.permute((1, 0))
                acc = warpgroup_mma(a_ring.index(slot).slice(PART * ROWS, ROWS, dim=0), b, acc, is_async=True)
                # The MMA before this one has finished reading its slot: hand that slot back.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                mbarrier.arrive(free.index((count + STAGES - 1) % STAGES), count=1, pred=ks > 0)
                count += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(free.index((count + STAGES - 1) % STAGES), count=1)
        live = gl.load(route_ptr + rows) >= 0
        store_part(c_smem, c_desc, gl.where(live[:, None], acc, 0.0), off_m + PART * ROWS, off_n, PART)
    tma.store_wait(0)


@gluon.jit(launch_metadata=grouped_launch_name)
def moe_ws_kernel(
    a_desc,  # TMA descriptor over the expert-sorted A [P, L] BF16, box [BLOCK_M, BLOCK_K]
    b_desc,  # over the weight's storage as [E * C, L] (B_K_MAJOR, box [BLOCK_N, BLOCK_K]) or [E * L, C] ([BLOCK_K, BLOCK_N])
    c_desc,  # over the FP32 output [P, C], box [BLOCK_M / CONSUMERS, BLOCK_N]
    route_ptr, tile_expert_ptr, gate_ptr,
    P, C, L,  # C[p, :] = A[p, :L] @ B[expert(p)][:L, :C]
    op_id,  # names the launch only
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, B_K_MAJOR: gl.constexpr,
    CONSUMERS: gl.constexpr,  # consumer warpgroups, each its own partition: 1 or 2
):
    a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], c_desc.layout)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=CONSUMERS)
    num_tiles = live_tiles(gate_ptr, P, C // BLOCK_N, BLOCK_M)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, route_ptr, num_tiles, C, L, BLOCK_M, BLOCK_N,
                         B_K_MAJOR, CONSUMERS, 0)),
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, route_ptr, num_tiles, C, L, BLOCK_M, BLOCK_N,
                         B_K_MAJOR, CONSUMERS, 1)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, route_ptr, tile_expert_ptr, num_tiles, C, L,
                         BLOCK_M, BLOCK_N, B_K_MAJOR)),
        ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, route_ptr, num_tiles, C, L, BLOCK_M, BLOCK_N,
                         B_K_MAJOR, CONSUMERS, 0)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, route_ptr, tile_expert_ptr, num_tiles, C, L,
                         BLOCK_M, BLOCK_N, B_K_MAJOR)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


def _descriptor(tensor: torch.Tensor, box: list[int], dtype) -> TensorDescriptor:
    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), box,
                            gl.NVMMASharedLayout.get_default_for(box, dtype))


def launch_moe_ws(op_id: int, stage: str, config, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                  routing, sms: int) -> None:
    """c [P, C] FP32 = the grouped GEMM of the expert-sorted a [P, L] and the ``[E, L, C]`` weight view b (its
    storage [E, L, C] or K-major [E, C, L]); refuses, naming the value, what this kernel does not cover (before
    any work)."""
    _, reduced, n_cols = b.shape
    if config.block_m != 64 * consumers(config.num_warps) or config.num_warps not in (4, 8):
        raise ValueError(f"{stage}: variant 'ws' gives each consumer warpgroup (4 warps) 64 rows: BLOCK_M 64 with 4 "
                         f"warps or 128 with 8; got BLOCK_M {config.block_m}, {config.num_warps} warps")
    if reduced % config.block_k or n_cols % config.block_n or config.block_k % 16 or config.block_n % 16:
        raise ValueError(f"{stage}: variant 'ws' needs BLOCK_K {config.block_k} dividing L {reduced} and BLOCK_N "
                         f"{config.block_n} dividing C {n_cols} (a weight tile never crosses an expert), both multiples "
                         "of 16")
    store, k_major = ws_weight_rows(b) or (None, False)
    if (store is None or a.stride(1) != 1 or not c.is_contiguous()
            or any(t.stride(0) * t.element_size() % 16 or t.data_ptr() % 16 for t in (a, store))):
        raise ValueError(f"{stage}: variant 'ws' needs the weight stored [E, L, C] or [E, C, L] with 16-byte aligned "
                         f"rows, A row-major with 16-byte aligned rows and the output contiguous; got weight strides "
                         f"{b.stride()}, A strides {a.stride()}, output strides {c.stride()}")
    ring = config.num_stages * (config.block_m + config.block_n) * config.block_k * 2
    if ring + config.block_m * config.block_n * 4 > SM90_SHARED_BYTES:
        raise ValueError(f"{stage}: variant 'ws' {config.label()} needs {ring + config.block_m * config.block_n * 4} "
                         f"bytes of shared memory; sm_90 has {SM90_SHARED_BYTES} per block: use fewer stages")
    p = routing.padded_rows
    b_box = [config.block_n, config.block_k] if k_major else [config.block_k, config.block_n]
    part_rows = config.block_m // consumers(config.num_warps)
    tiles = (p // config.block_m) * (n_cols // config.block_n)
    moe_ws_kernel[(min(tiles, sms),)](
        _descriptor(a[:p], [config.block_m, config.block_k], gl.bfloat16), _descriptor(store, b_box, gl.bfloat16),
        _descriptor(c, [part_rows, config.block_n], gl.float32),
        routing.sorted_route, routing.tile_expert, routing.gate,
        p, n_cols, reduced,
        op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, STAGES=config.num_stages, B_K_MAJOR=k_major,
        CONSUMERS=consumers(config.num_warps),
        num_warps=4, maxnreg=max_regs(config.num_warps),  # num_warps: the default partition (one consumer warpgroup)
    )
