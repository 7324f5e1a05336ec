"""det_gemm's warp-specialized sm_90 kernel (variant "ws"), written in Gluon.

One producer warp streams A and B tiles into a shared-memory ring by TMA; one or two consumer warpgroups,
each its own partition with its own share of the tile's rows, issue asynchronous wgmma on each ring slot as
soon as it lands and hand it back when the MMA that read it has finished (a slot is free once every consumer
has handed it back). The grid is persistent (one program per SM, tiles in det_gemm's grouped order), so
the producer fills the ring for the next tile while the consumers store the current one.

The math is det_gemm_tma_kernel's: per output tile, BLOCK_K-wide K steps in ascending order, each one
wgmma chain accumulating into the same FP32 registers, one BF16 rounding (or FP32) at the end. Neither the
tile shape nor the warp roles change a product or the order of the additions, so the bits equal every
other det_gemm config's (checked on the H200: tests/test_det_gemm_ws.py, the cross-config audit).

Gluon has no interpreter path: this kernel runs on sm_90 only, and ``det_gemm`` refuses a "ws" config on
any other backend by name.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from detkit.kernels.det_gemm.names import _launch_metadata

# Partitions: each consumer warpgroup (4 warps) is its own partition, the default one and, for a second, a
# worker; the producer is one warp (allocated as a warpgroup). Registers after the hand-off (setmaxnreg): 40
# for the producer, CONSUMER_REGS for a worker consumer; the default consumer gets the rest of the launch's cap.
CONSUMER_WARPS = gl.constexpr(4)
CONSUMER_REGS = gl.constexpr(232)
PRODUCER_REGS = gl.constexpr(40)
PRODUCER_WARPS = gl.constexpr(1)


def consumers(num_warps: int) -> int:
    """Consumer warpgroups of a config with ``num_warps`` consumer warps (4 or 8)."""
    return num_warps // 4


def max_regs(num_warps: int) -> int:
    """Launch register cap per thread: the CTA's warpgroups (one per consumer, one for the producer) share the
    SM's 64K registers (one CTA per SM)."""
    return min(255, (65536 // ((consumers(num_warps) + 1) * 128)) // 8 * 8)


SM90_SHARED_BYTES = 227 * 1024  # the per-block limit (opt-in) on sm_90
GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}  # the dtypes the ws epilogues store


def check_shared_bytes(stage: str, config, ring: int, store: int, store_what: str) -> None:
    """Refuses, naming the bytes, a ws config whose operand ring (``ring`` bytes over its stages) and epilogue
    buffers (``store`` bytes: ``store_what``) exceed sm_90's per-block shared memory, before any work."""
    if ring + store > SM90_SHARED_BYTES:
        raise ValueError(f"{stage}: variant 'ws' {config.label()} needs {ring + store} bytes of shared memory "
                         f"({ring} for {config.num_stages} stages, {store} for {store_what}); sm_90 has "
                         f"{SM90_SHARED_BYTES} per block: use fewer stages")
# The epilogue's tile buffer shares the block's shared memory with the operand ring (less the mbarriers and
# alignment).
WS_SHARED_BYTES = SM90_SHARED_BYTES - 1024


def ws_tma_store(block_m: int, block_n: int, block_k: int, stages: int, cols: int, out_bytes: int) -> bool:
    """Whether the ws epilogue stores by TMA: C's rows (``cols`` elements of ``out_bytes``) start 16-byte aligned,
    as TMA needs, and the tile buffer fits beside the ring. Else it stores from registers; both store the same
    values, so the choice never changes a bit."""
    ring = stages * (block_m + block_n) * block_k * 2
    return cols * out_bytes % 16 == 0 and ring + block_m * block_n * out_bytes <= WS_SHARED_BYTES


def operand_layout(block: list[int]) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def ws_descriptor(tensor, shape, strides, box) -> TensorDescriptor:
    """A TMA descriptor over ``tensor`` (shape, strides and box as det_gemm.tma_descriptor decided them; BF16
    operands, or the BF16 / FP32 output) with the NVMMA shared layout of its box."""
    layout = gl.NVMMASharedLayout.get_default_for(box, GL_DTYPES[tensor.dtype])
    return TensorDescriptor(tensor, shape, strides, box, layout)


@gluon.jit
def store_part(c_smem, c_desc, acc, row, col, PART: gl.constexpr, twin_desc=None):
    """This part's tile rows through its slice of the shared buffer and a TMA store at [row, col] (and the same
    bytes to ``twin_desc``'s tensor); the slice is reused once the previous tile's stores have read it, and the
    stores run while the next tile's MMAs do. TMA clips a tile at the tensor's edges."""
    ROWS: gl.constexpr = acc.type.shape[0]
    c_part = c_smem.slice(PART * ROWS, ROWS, dim=0)
    tma.store_wait(0)
    c_part.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [row, col], c_part)
    if twin_desc is not None:
        tma.async_copy_shared_to_global(twin_desc, [row, col], c_part)


@gluon.jit
def _tile(t, R, C, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """Output tile ``t`` in det_gemm's grouped order (tile_of_program with program id t)."""
    num_pid_m = gl.cdiv(R, BLOCK_M)
    num_pid_n = gl.cdiv(C, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = t // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = gl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((t % num_pid_in_group) % group_size_m)
    pid_n = (t % num_pid_in_group) // group_size_m
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@gluon.jit
def _producer(a_desc, b_desc, a_ring, b_ring, ready, free, R, C, L,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
              A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr):
    """TMA loads into the ring: slot s is refilled once the consumers have released it."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    num_tiles = gl.cdiv(R, BLOCK_M) * gl.cdiv(C, BLOCK_N)
    k_steps = gl.cdiv(L, BLOCK_K)
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile(t, R, C, BLOCK_M, BLOCK_N, GROUP_M)
        for ks in range(k_steps):
            slot = count % STAGES
            # A fresh barrier counts as having completed the phase before phase 0: the first pass waits on nothing.
            mbarrier.wait(free.index(slot), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            k = ks * BLOCK_K
            if A_M_MAJOR:
                tma.async_copy_global_to_shared(a_desc, [k, off_m], bar, a_ring.index(slot))
            else:
                tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_ring.index(slot))
            if B_K_MAJOR:
                tma.async_copy_global_to_shared(b_desc, [off_n, k], bar, b_ring.index(slot))
            else:
                tma.async_copy_global_to_shared(b_desc, [k, off_n], bar, b_ring.index(slot))
            count += 1


@gluon.jit
def _consumer(a_ring, b_ring, ready, free, c_smem, c_desc, twin_desc, c_ptr, twin_ptr, R, C, L, stride_cr, stride_cc,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
              A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr, OUT_FP32: gl.constexpr, TWIN: gl.constexpr,
              TMA_STORE: gl.constexpr, CONSUMERS: gl.constexpr, PART: gl.constexpr):
    """One consumer warpgroup: rows [PART * BLOCK_M / CONSUMERS, +BLOCK_M / CONSUMERS) of every tile. Async wgmma
    over the ring, at most one MMA in flight behind the newest; a slot goes back to the producer once every
    consumer has arrived on it; then the epilogue (TMA_STORE: by TMA store from shared memory)."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_tiles = gl.cdiv(R, BLOCK_M) * gl.cdiv(C, BLOCK_N)
    k_steps = gl.cdiv(L, BLOCK_K)
    count = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile(t, R, C, BLOCK_M, BLOCK_N, GROUP_M)
        acc = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
        for ks in range(k_steps):
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            if A_M_MAJOR:  # stored [BLOCK_K, BLOCK_M]: this part's columns, read transposed
                a = a_ring.index(slot).slice(PART * ROWS, ROWS, dim=1).permute((1, 0))
            else:
                a = a_ring.index(slot).slice(PART * ROWS, ROWS, dim=0)
            b = b_ring.index(slot)
            if B_K_MAJOR:
                b = b.permute((1, 0))
            acc = warpgroup_mma(a, b, acc, is_async=True)
            # The MMA before this one has finished reading its slot: hand that slot back.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(free.index((count + STAGES - 1) % STAGES), count=1, pred=ks > 0)
            count += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(free.index((count + STAGES - 1) % STAGES), count=1)

        if OUT_FP32:
            out = acc
        else:
            out = acc.to(gl.bfloat16)
        if TMA_STORE:  # through shared memory: whole 128-byte lines, overlapped with the next tile's MMAs
            if TWIN:
                store_part(c_smem, c_desc, out, off_m + PART * ROWS, off_n, PART, twin_desc)
            else:
                store_part(c_smem, c_desc, out, off_m + PART * ROWS, off_n, PART)
        else:  # from the accumulator's registers (a row stride TMA cannot take, or no room for the buffer)
            offs_m = off_m + PART * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
            offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            # 64-bit offsets: C may hold more than 2**31 - 1 elements
            offs = (gl.expand_dims(offs_m.to(gl.int64), 1) * stride_cr
                    + gl.expand_dims(offs_n.to(gl.int64), 0) * stride_cc)
            mask = gl.expand_dims(offs_m < R, 1) & gl.expand_dims(offs_n < C, 0)
            gl.store(c_ptr + offs, out, mask=mask)
            if TWIN:
                gl.store(twin_ptr + offs, out, mask=mask)
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit(launch_metadata=_launch_metadata)
def det_gemm_ws_kernel(
    a_desc, b_desc, c_ptr, twin_ptr,  # TMA descriptors over A and B in their storage order (A_M_MAJOR, B_K_MAJOR)
    c_desc, twin_desc,  # TMA_STORE: over C and the twin, box [BLOCK_M / CONSUMERS, BLOCK_N] (else any valid ones)
    R, C, L,  # C[R, C] = A[R, L] @ B[L, C]
    stride_cr, stride_cc,
    op_id,  # 0 fwd, 1 dA, 2 dB: names the launch only
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    STAGES: gl.constexpr, OUT_FP32: gl.constexpr, TWIN: gl.constexpr,
    A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr,
    CONSUMERS: gl.constexpr,  # consumer warpgroups, each its own partition: 1 or 2
    TMA_STORE: gl.constexpr,  # the epilogue through a shared tile buffer and TMA stores (ws_tma_store)
):
    a_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    # Compiled away when TMA_STORE is off (nothing reads it).
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=CONSUMERS)
    if CONSUMERS == 2:  # cooperative: the two warpgroups split each tile's rows and sync only through the ring
        gl.warp_specialize([
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, twin_desc, c_ptr, twin_ptr, R, C, L, stride_cr,
                         stride_cc, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, A_M_MAJOR, B_K_MAJOR, OUT_FP32, TWIN,
                         TMA_STORE, CONSUMERS, 0)),
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, twin_desc, c_ptr, twin_ptr, R, C, L, stride_cr,
                         stride_cc, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, A_M_MAJOR, B_K_MAJOR, OUT_FP32, TWIN,
                         TMA_STORE, CONSUMERS, 1)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, R, C, L, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                         A_M_MAJOR, B_K_MAJOR)),
        ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (a_ring, b_ring, ready, free, c_smem, c_desc, twin_desc, c_ptr, twin_ptr, R, C, L, stride_cr,
                         stride_cc, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, A_M_MAJOR, B_K_MAJOR, OUT_FP32, TWIN,
                         TMA_STORE, CONSUMERS, 0)),
            (_producer, (a_desc, b_desc, a_ring, b_ring, ready, free, R, C, L, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                         A_M_MAJOR, B_K_MAJOR)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])
