"""det_gemm's FP32 "ieee" tile kernel on register micro-tiles (variant "fma"), written in Gluon for sm_90.

``det_gemm_fma_kernel`` computes ``C[R, C] = A[R, L] @ B[L, C]`` on FP32 operands with FP32 fused multiply-adds on
the CUDA cores, as the Triton tile kernels' FMA dot does, but with the layouts chosen here instead of by Triton:
- the accumulator: a BlockedLayout in which each thread owns a MICRO_M x MICRO_N block of the tile (8x16 to 4x4:
  configs.fma_micro_tile), lanes 4 x 8 per warp, WARPS_M x (num_warps / WARPS_M) warps. Per k a thread reads
  MICRO_M values of A and MICRO_N of B for MICRO_M x MICRO_N fused multiply-adds;
- the operands: the FMA dot's operand layouts of that accumulator (DotOperandLayout: every k of a slice in the
  thread's registers), read from shared memory 16 bytes at a time (LDS.128) along the operand's contiguous dim;
- shared memory: a ring of STAGES [BLOCK_M, BLOCK_K] and [BLOCK_K, BLOCK_N] tiles filled by TMA in each operand's
  storage order (A_M_MAJOR: dB's a.T; B_K_MAJOR: nn.Linear's weight.t()), with the NVMMA 128-byte swizzle. The
  thread's MICRO_N columns are placed so that those 16-byte reads are free of bank conflicts: on an N-major B in runs
  of 4 adjacent columns (the eight lanes of a read cover 128 contiguous bytes; runs of 8 would span 256 and take two
  wavefronts), on a K-major B one per repetition of the layout along N (adjacent columns of a K-major tile share
  their swizzle phase, so eight lanes reading them would hit the same banks).
TMA fills out-of-bounds box elements with zeros, as the pointer kernel's masked loads do. One program per output
tile in det_gemm's grouped order; the ring is refilled one slot behind the slot being read, after a CTA barrier
(every warp has finished reading that slot) and a proxy fence (the TMA write follows the generic reads).

Bits: ``gl.dot_fma`` lowers as the Triton tile kernels' ``tl.dot(a, b, acc, input_precision="ieee")`` does (the
FMA dot: per output element ``acc = fma(a[k], b[k], acc)`` for k ascending over the dot's K), and each BLOCK_K step
runs its slices of at most K_SLICE k's in ascending order into the one accumulator, which starts at +0.0
(``gl.zeros``). So
every output element is the chain k = 0, 1, ..., L - 1 of fused multiply-adds from +0.0 that the tile kernels and
the small-M kernel (kernels/det_gemm/gemv.py) compute: the same bits whatever the tile, micro-tile, warps, stages or
layouts. Padding past L adds fma(0, 0, acc) = acc (an accumulator that starts at +0.0 is never -0.0). No split-K, no
atomics, no other contraction (the sm_90 compile has FFMA and no FMUL or FADD: tools/gemm_sass.py).

Gluon has no interpreter path: this kernel runs on sm_90 only, and det_gemm refuses an "fma" config on any other
backend, for operands other than FP32 "ieee", and for seg_len segments (one accumulator), by name. The launch:
kernels/det_gemm/launch.py; its configs: kernels/det_gemm/configs.py (``fma_micro_tile``, ``fma_candidates``: the
tiles, the micro-tile each implies and the shared-memory limit, checked when a config is made).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from detkit.kernels.det_gemm.configs import FMA_LANES
from detkit.kernels.det_gemm.names import _launch_metadata

# k's per gl.dot_fma call at most: one 128-byte swizzle row of FP32, so a slice of a K-major slot never starts inside
# a swizzle row. A slice's operand registers are its k's per row of A and per column of B.
K_SLICE = gl.constexpr(32)
LANES_M = gl.constexpr(FMA_LANES[0])
LANES_N = gl.constexpr(FMA_LANES[1])
VEC_N = 4  # adjacent output columns per run of a thread's (N-major B): 16 bytes of FP32


def fma_options(num_warps: int) -> dict:
    """The kernel's compile options: its warps, and "ieee" as the dots' input precision. ``gl.dot_fma`` takes the
    module's default precision (Triton's is "tf32"), which the FMA lowering does not read today; naming "ieee" keeps
    the dot an FP32 one should a lowering ever honour it."""
    return {"num_warps": num_warps, "default_dot_input_precision": "ieee"}


def fma_descriptor(tensor, shape, strides, box) -> TensorDescriptor:
    """A TMA descriptor over an FP32 operand (shape, strides and box as launch._descriptor_layout decided them) with
    the NVMMA shared layout of its box."""
    return TensorDescriptor(tensor, shape, strides, box, gl.NVMMASharedLayout.get_default_for(box, gl.float32))


@gluon.constexpr_function
def acc_layout(micro_m, micro_n, warps_m, warps, b_k_major):
    """The accumulator's layout: MICRO_M x MICRO_N outputs per thread, its columns in runs of VEC_N adjacent ones (an
    N-major B: one 16-byte read per run and k, the eight lanes of a read covering 128 contiguous bytes) or, on a
    K-major B, one column per repetition of the layout along N (interleaved: each column's k's are one 16-byte read)."""
    cols = 1 if b_k_major else min(micro_n, VEC_N)
    return gl.BlockedLayout([micro_m, cols], [LANES_M, LANES_N], [warps_m, warps // warps_m], [1, 0])


@gluon.jit
def _tile(R, C, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """This program's output tile (row, col offsets) in det_gemm's grouped order (kernels.tile_of_program)."""
    pid = gl.program_id(0)
    num_pid_m = gl.cdiv(R, BLOCK_M)
    num_pid_n = gl.cdiv(C, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = gl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@gluon.jit
def _load_step(a_desc, b_desc, a_slot, b_slot, bar, off_m, off_n, k,
               A_M_MAJOR: gl.constexpr, B_K_MAJOR: gl.constexpr):
    """TMA loads of one BLOCK_K step of A and B (each in its storage order) into one ring slot, completing ``bar``."""
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    if A_M_MAJOR:
        tma.async_copy_global_to_shared(a_desc, [k, off_m], bar, a_slot)  # [BLOCK_K, BLOCK_M]
    else:
        tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_slot)  # [BLOCK_M, BLOCK_K]
    if B_K_MAJOR:
        tma.async_copy_global_to_shared(b_desc, [off_n, k], bar, b_slot)  # [BLOCK_N, BLOCK_K]
    else:
        tma.async_copy_global_to_shared(b_desc, [k, off_n], bar, b_slot)  # [BLOCK_K, BLOCK_N]


@gluon.jit
def _operand_slice(slot, kk, SLICE: gl.constexpr, K_FIRST: gl.constexpr, DIM_K: gl.constexpr):
    """k's kk .. kk + SLICE - 1 of a ring slot as the dot's [rows, SLICE] (A) or [SLICE, cols] (B) view: ``DIM_K`` is
    the slot's k dim in storage; ``K_FIRST`` whether the view has k first (B) or last (A)."""
    part = slot
    if SLICE < slot.shape[DIM_K]:
        part = slot.slice(kk, SLICE, dim=DIM_K)
    if (DIM_K == 0) != K_FIRST:
        part = part.permute((1, 0))
    return part


@gluon.jit(launch_metadata=_launch_metadata)
def det_gemm_fma_kernel(
    a_desc, b_desc, c_ptr, twin_ptr,  # TMA descriptors over A and B in their storage order (A_M_MAJOR, B_K_MAJOR)
    R, C, L,  # C[R, C] = A[R, L] @ B[L, C]
    stride_cr, stride_cc,
    op_id,  # 0 fwd, 1 dA, 2 dB: names the launch only
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    STAGES: gl.constexpr,
    MICRO_M: gl.constexpr, MICRO_N: gl.constexpr, WARPS_M: gl.constexpr,  # configs.fma_micro_tile
    TWIN: gl.constexpr,
    A_M_MAJOR: gl.constexpr,  # A stored as [L, R] (dB's a.T): box [BLOCK_K, BLOCK_M]
    B_K_MAJOR: gl.constexpr,  # B stored as [C, L] (fwd on nn.Linear's weight.t()): box [BLOCK_N, BLOCK_K]
    PRECISION: gl.constexpr,  # "ieee" (names the launch: FP32 operands, IEEE products)
):
    SLICE: gl.constexpr = min(BLOCK_K, K_SLICE)
    layout: gl.constexpr = acc_layout(MICRO_M, MICRO_N, WARPS_M, gl.num_warps(), B_K_MAJOR)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=layout, k_width=0)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=layout, k_width=0)
    a_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    off_m, off_n = _tile(R, C, BLOCK_M, BLOCK_N, GROUP_M)
    k_steps = gl.cdiv(L, BLOCK_K)
    for i in gl.static_range(STAGES - 1):  # the ring's first STAGES - 1 steps in flight before the loop
        if i < k_steps:
            _load_step(a_desc, b_desc, a_ring.index(i), b_ring.index(i), ready.index(i), off_m, off_n, i * BLOCK_K,
                       A_M_MAJOR, B_K_MAJOR)

    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
    for ks in range(k_steps):
        # Refill the slot read in the previous step with step ks + STAGES - 1, once every warp has read it.
        gl.thread_barrier()
        fence_async_shared()
        nxt = ks + STAGES - 1
        if nxt < k_steps:
            s = nxt % STAGES
            _load_step(a_desc, b_desc, a_ring.index(s), b_ring.index(s), ready.index(s), off_m, off_n, nxt * BLOCK_K,
                       A_M_MAJOR, B_K_MAJOR)
        slot = ks % STAGES
        mbarrier.wait(ready.index(slot), (ks // STAGES) & 1)
        a_slot = a_ring.index(slot)
        b_slot = b_ring.index(slot)
        for kk in gl.static_range(0, BLOCK_K, SLICE):  # ascending k into the one accumulator
            a = _operand_slice(a_slot, kk, SLICE, False, 0 if A_M_MAJOR else 1).load(a_layout)  # [BLOCK_M, SLICE]
            b = _operand_slice(b_slot, kk, SLICE, True, 1 if B_K_MAJOR else 0).load(b_layout)  # [SLICE, BLOCK_N]
            acc = gl.dot_fma(a, b, acc)

    offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    # 64-bit offsets: C may hold more than 2**31 - 1 elements (an lm_head's logits)
    offs = gl.expand_dims(offs_m.to(gl.int64), 1) * stride_cr + gl.expand_dims(offs_n.to(gl.int64), 0) * stride_cc
    mask = gl.expand_dims(offs_m < R, 1) & gl.expand_dims(offs_n < C, 0)
    gl.store(c_ptr + offs, acc, mask=mask)
    if TWIN:
        gl.store(twin_ptr + offs, acc, mask=mask)
