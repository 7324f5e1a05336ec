"""Gluon building blocks shared by the BF16 (kernels/moe/ws.py) and FP8 (kernels/moe/fp8/ws.py,
kernels/moe/fp8/ws_gather.py, kernels/moe/fp8/colwise_sm90.py) MoE kernels: the routing gate of a persistent grouped
grid and its tile order, the weight-gradient tile order and its store (BF16 by TMA, or FP32 main_grad accumulation), the gathered-A
producer (cp.async rows through the gather index, the weight by TMA), BF16 (g, u) pairs packed as int32, the E4M3
scale and conversion of the FP8 kernels' quantizations, and the host's TMA descriptor with its NVMMA shared layout.
Gluon has no interpreter path: sm_90 only."""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from detkit.kernels.backend import CUDA_SM90
from detkit.kernels.det_gemm.ws import store_part
from detkit.kernels.moe.tile_order import tile_order_gl


# The gathered-A producer: one warpgroup issuing 16-byte cp.async copies (8 per thread for a 128x128 e4m3 tile).
# Registers after the hand-off: 2 x 128 x 232 + 128 x 48 = 64K (at 224 per consumer thread ptxas spills and
# serializes the wgmma; the producer's copies fit in 48).
GATHER_PRODUCER_WARPS = gl.constexpr(4)
GATHER_PRODUCER_REGS = gl.constexpr(48)
GATHER_CONSUMER_REGS = gl.constexpr(232)


@gluon.jit
def live_tiles(gate_ptr, P, num_n, BLOCK_M: gl.constexpr):
    """Tiles of a persistent grouped grid that hold routed rows, from the routing's gate (as the Triton kernels'
    tile_is_live): up to its P (a GEMM queued over the largest P before the host has read the counts stops at the
    real one), none for a batch its validation counts refuse."""
    return (gl.where(refused_batch(gate_ptr), 0, gl.minimum(gl.load(gate_ptr), P)) // BLOCK_M) * num_n


@gluon.jit
def live_tile_offsets(t, num_tiles, num_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(first row, first column) of tile t of a persistent grouped grid of ``num_tiles`` = live_tiles(...) tiles, in
    the grouped order over its live row tiles (kernels/moe/tile_order.py): every partition of a kernel maps t the
    same way, so the producer's loads, the consumers' MMAs and the epilogue's stores agree on each tile."""
    pid_m, pid_n = tile_order_gl(t, num_tiles // num_n, num_n, GROUP_M)
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@gluon.jit
def refused_batch(gate_ptr):
    """Whether the routing's validation counts (gate[1:]) refused the batch (as the Triton kernels' refusals)."""
    return (gl.load(gate_ptr + 1) + gl.load(gate_ptr + 2) + gl.load(gate_ptr + 3)) > 0


@gluon.jit
def wgrad_tile(t, num_r, num_c, offsets_ptr, counts_ptr, GROUP_M: gl.constexpr):
    """Weight-gradient tile t: (expert, pid_r, pid_c, the expert's first padded row, its routed rows); experts in
    turn, each dW[e]'s tiles in the grouped order (kernels/moe/tile_order.py)."""
    per_expert = num_r * num_c
    expert = t // per_expert
    pid_r, pid_c = tile_order_gl(t % per_expert, num_r, num_c, GROUP_M)
    return expert, pid_r, pid_c, gl.load(offsets_ptr + expert), gl.load(counts_ptr + expert)


@gluon.jit
def store_wgrad_part(c_smem, c_desc, dw_ptr, acc, expert, routed, refused, R, row, col, stride_we, stride_wr,
                     stride_wc, ACCUMULATE: gl.constexpr, PART: gl.constexpr):
    """A weight gradient's part of dW[expert][row:+ROWS, col:+BLOCK_N] (BF16 and FP8 kernels): BF16 by TMA store into
    dW as [E * R, C], or ACCUMULATE: main_grad += acc in FP32 through pointers, untouched for an expert without
    rows; NaN (stored, or added) for a ``refused`` batch (as the Triton kernels' store_wgrad_tile)."""
    if refused:
        acc = gl.full(acc.type.shape, float("nan"), gl.float32, acc.type.layout)
    if ACCUMULATE:
        if (routed > 0) | refused:
            layout: gl.constexpr = acc.type.layout
            rows = row + gl.arange(0, acc.type.shape[0], layout=gl.SliceLayout(1, layout))
            cols = col + gl.arange(0, acc.type.shape[1], layout=gl.SliceLayout(0, layout))
            ptrs = dw_ptr + expert * stride_we + rows[:, None] * stride_wr + cols[None, :] * stride_wc
            gl.store(ptrs, gl.load(ptrs) + acc)
    else:
        store_part(c_smem, c_desc, acc, expert * R + row, col, PART)


@gluon.jit
def gather_producer(a_ptr, b_desc, a_ring, b_ring, ready, free, gather_ptr, route_ptr, tile_expert_ptr, num_tiles,
                    num_n, C, L, stride_am, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SEGMENT: gl.constexpr,
                    GROUP_M: gl.constexpr, B_K_MAJOR: gl.constexpr = True):
    """A gathered grouped GEMM's loads (a 4-warp partition; the FP8 and BF16 up and dgrad): the A rows a[gather[p]] by 16-byte cp.async (Hopper's TMA cannot gather rows), each thread's
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
        off_m, off_n = live_tile_offsets(t, num_tiles, num_n, BLOCK_M, BLOCK_N, GROUP_M)
        if gl.load(route_ptr + off_m) >= 0:
            expert = gl.load(tile_expert_ptr + off_m // SEGMENT)
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
def e4m3_pow2_scale(amax):
    """detkit.kernels.moe.fp8.quant.pow2_scale written again in Gluon (which cannot call a Triton function): (scale,
    1/scale), the smallest power of two 2**k with amax / 2**k <= 448 (1 for amax 0)."""
    bits = amax.to(gl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(gl.int32)  # 448 = 1.75 * 2**8
    k = gl.where(amax > 0, k, 0)
    k = gl.minimum(gl.maximum(k, -126), 126)
    return ((k + 127) << 23).to(gl.float32, bitcast=True), ((127 - k) << 23).to(gl.float32, bitcast=True)


# detkit.kernels.moe.fp8.quant.to_e4m3 on sm_90: the instruction Triton's FP32 -> E4M3 conversion compiles to (nearest
# even, saturating to +-448, NaN kept), issued once per pair of values; its first source lands in the high byte.
E4M3X2 = gl.constexpr("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;")


@gluon.jit
def e4m3x2(lo, hi):
    """Two FP32 tensors as one int16 of E4M3 codes per element, lo's in the low byte (one conversion per pair)."""
    return gl.inline_asm_elementwise(E4M3X2, "=h,f,f", [lo, hi], dtype=gl.int16, is_pure=True, pack=1)


@gluon.jit
def e4m3_codes(x):
    """An FP32 tensor's E4M3 codes as int8, each two consecutive registers of a thread converted together (so a
    layout whose registers run along the stored dim gives byte pairs already in memory order)."""
    return gl.inline_asm_elementwise(E4M3X2, "=h,r,r", [x], dtype=gl.int8, is_pure=True, pack=2)


@gluon.jit
def bf16_pair_bits(lo, hi):
    """Two FP32 tensors rounded to BF16 and packed as one int32 per element (lo in the low half): an interleaved
    (g, u) column pair of a BF16 matrix, as its int32 view stores it."""
    lo_bits = lo.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    hi_bits = hi.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32)
    return lo_bits | (hi_bits << 16)


@gluon.jit
def bf16_pair_values(bits):
    """The two BF16 values of each packed int32 (low half first) as FP32 (exact)."""
    return (bits << 16).to(gl.float32, bitcast=True), (bits & -65536).to(gl.float32, bitcast=True)


@functools.lru_cache(maxsize=None)
def nvmma_layout(box: tuple[int, ...], dtype) -> gl.NVMMASharedLayout:
    """The NVMMA shared layout of a ``box`` of ``dtype``, built once (an immutable value; building it is most of a
    descriptor's host time)."""
    return gl.NVMMASharedLayout.get_default_for(list(box), dtype)


def nvmma_descriptor(tensor: torch.Tensor, box: list[int], dtype=gl.float8e4nv) -> TensorDescriptor:
    """A TMA descriptor over the row-major matrix ``tensor`` of ``dtype`` (e4m3 by default: the FP8 operands; the BF16
    operands and the epilogues' BF16, FP32 and packed-int outputs pass theirs) with its NVMMA shared layout."""
    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), box, nvmma_layout(tuple(box), dtype))


def check_ws_backend(stage: str, backend: str) -> None:
    """Refuses a "ws" config off sm_90 by name (Gluon has no interpreter path). The ws launchers call it after their
    own checks, so the host-side refusals of a config run, and are tested, on every backend."""
    if backend != CUDA_SM90:
        raise ValueError(f"{stage}: variant 'ws' is a Gluon kernel for sm_90 and has no {backend!r} path; use a "
                         "'ptr' or 'tma' config there")
