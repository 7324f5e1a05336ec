"""det_gemm's Triton kernels and the tile math they share (the math, the K order and the interpreter's emulation:
kernels/det_gemm/launch.py's docstring): ``det_gemm_kernel`` (pointer loads), ``det_gemm_tma_kernel`` (TMA descriptors)
and ``det_gemm_tma3_kernel`` (TMA, a tile three sub-tiles wide). ``fp32_to_bf16_rtne`` and ``mac_step`` are shared
with other kernels (attention, SwiGLU, the MoE blocks, the invariant reductions). The launch: kernels/det_gemm/launch.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from detkit.kernels.det_gemm.names import _launch_metadata

# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------
@triton.jit
def fp32_to_bf16_rtne(x):
    """Round FP32 to BF16, nearest-even, in integer arithmetic. The interpreter's own cast truncates;
    on the GPU this equals cvt.rn.bf16.f32 for every non-NaN input (NaN stays a quiet NaN)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (((bits >> 16) & 1) + 0x7FFF)
    out = (bits >> 16).to(tl.uint16)
    out = tl.where(x != x, 0x7FC0, out).to(tl.uint16)
    return out.to(tl.bfloat16, bitcast=True)


@triton.jit
def to_bf16(x, INTERPRETED: tl.constexpr):
    """FP32 -> BF16, round to nearest even on both backends (the hardware cast on the GPU)."""
    if INTERPRETED:
        y = fp32_to_bf16_rtne(x)
    else:
        y = x.to(tl.bfloat16)
    return y


@triton.jit
def tile_of_program(R, C, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program's output tile. Grouped tile order for L2 reuse: it changes which
    program owns a tile, never the tile's math."""
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(R, BLOCK_M)
    num_pid_n = tl.cdiv(C, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def mac_step(acc, a, b, offs_k, STEP_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """``acc + a @ b`` for one reduction step (a [BLOCK_M, STEP_K], b [STEP_K, BLOCK_N]): one tl.dot on
    the GPU. In the interpreter, exact BF16 products added one at a time in ascending order (cumsum is
    sequential there); numpy's matmul would pick its order from the tile shape."""
    if INTERPRETED:
        prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]  # [BLOCK_M, STEP_K, BLOCK_N]
        first = (offs_k == 0)[None, :, None]
        last = (offs_k == STEP_K - 1)[None, :, None]
        prod = tl.where(first, prod + acc[:, None, :], prod)
        out = tl.sum(tl.where(last, tl.cumsum(prod, axis=1), 0.0), axis=1)
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def to_tf32(x):
    """FP32 -> TF32 (10 stored significand bits), round to nearest with ties away from zero (cvt.rna.tf32.f32), in
    integer arithmetic; the result is an FP32 value with its low 13 bits zero. NaN and Inf stay as they are. The
    interpreter's model of a TF32 tensor-core operand (the hardware may instead drop the low bits: the contract's
    TF32 bound covers both)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def mac_step_fp32(acc, a, b, offs_k, STEP_K: tl.constexpr, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b`` for one reduction step of FP32 operands. On the GPU one tl.dot with ``input_precision``
    PRECISION: "ieee" (FP32 fused multiply-adds in ascending k, no tensor cores) or "tf32" (tensor cores on TF32
    operands). In the interpreter, as ``mac_step``: each product rounded to FP32 (after rounding both operands to
    TF32 for "tf32"), then added to the accumulator one at a time in ascending k, an order that depends on k alone."""
    if INTERPRETED:
        if PRECISION == "tf32":
            a = to_tf32(a)
            b = to_tf32(b)
        out = mac_step(acc, a, b, offs_k, STEP_K, INTERPRETED)
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


@triton.jit
def segment_boundary(acc, seg_acc, k0, seg_len, SEGMENTED: tl.constexpr):
    """At the start of each FP32 segment after the first, the finished segment joins the total
    (ascending order) and the next one starts from zero."""
    if SEGMENTED:
        if (k0 % seg_len == 0) and (k0 > 0):
            acc += seg_acc
            seg_acc = tl.zeros_like(seg_acc)
    return acc, seg_acc


@triton.jit
def mac(acc, a, b, offs_k, STEP_K: tl.constexpr, INTERPRETED: tl.constexpr, PRECISION: tl.constexpr):
    """One K step: FP32 operands at their PRECISION ("ieee", "tf32"), or BF16 / FP16 operands ("bf16", "fp16"),
    whose products are exact in FP32 (8- or 11-bit significands)."""
    if PRECISION == "ieee":
        out = mac_step_fp32(acc, a, b, offs_k, STEP_K, INTERPRETED, PRECISION)
    elif PRECISION == "tf32":
        out = mac_step_fp32(acc, a, b, offs_k, STEP_K, INTERPRETED, PRECISION)
    else:
        out = mac_step(acc, a, b, offs_k, STEP_K, INTERPRETED)
    return out


@triton.jit
def accumulate(acc, seg_acc, a, b, offs_k, STEP_K: tl.constexpr, INTERPRETED: tl.constexpr,
               SEGMENTED: tl.constexpr, PRECISION: tl.constexpr):
    """One K step into the running segment (segmented) or the total."""
    if SEGMENTED:
        seg_acc = mac(seg_acc, a, b, offs_k, STEP_K, INTERPRETED, PRECISION)
    else:
        acc = mac(acc, a, b, offs_k, STEP_K, INTERPRETED, PRECISION)
    return acc, seg_acc


@triton.jit
def store_tile(c_ptr, twin_ptr, acc, offs_am, offs_bn, R, C, stride_cr, stride_cc,
               INTERPRETED: tl.constexpr, OUT_FP32: tl.constexpr, TWIN: tl.constexpr, OUT_FP16: tl.constexpr):
    """The epilogue: FP32 as is, or one BF16 or FP16 rounding (nearest-even; the FP16 cast rounds so on both
    backends, the interpreter's BF16 cast does not) of the FP32 accumulator. With
    TWIN the same bits also go to ``twin_ptr`` (same shape and strides): the TP/CP operators reduce
    that copy in place and keep the partial, without a separate copy kernel before the collective."""
    # 64-bit offsets: the output may hold more than 2**31 - 1 elements (an lm_head's logits at M 16384)
    c_offs = offs_am.to(tl.int64)[:, None] * stride_cr + offs_bn.to(tl.int64)[None, :] * stride_cc  # [BLOCK_M, BLOCK_N]
    c_mask = (offs_am < R)[:, None] & (offs_bn < C)[None, :]
    if OUT_FP32:
        out = acc
    elif OUT_FP16:
        out = acc.to(tl.float16)
    elif INTERPRETED:
        out = fp32_to_bf16_rtne(acc)
    else:
        out = acc.to(tl.bfloat16)
    tl.store(c_ptr + c_offs, out, mask=c_mask)
    if TWIN:
        tl.store(twin_ptr + c_offs, out, mask=c_mask)


@triton.jit(launch_metadata=_launch_metadata)
def det_gemm_kernel(
    a_ptr, b_ptr, c_ptr, twin_ptr,
    R, C, L,  # C[R, C] = A[R, L] @ B[L, C]
    stride_ar, stride_al,
    stride_bl, stride_bc,
    stride_cr, stride_cc,
    seg_len,  # reduced elements per FP32 segment (== L for one segment); multiple of BLOCK_K
    op_id,  # 0 fwd, 1 dA, 2 dB: names the launch only (a runtime arg, so the three share one binary)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STEP_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRETED: tl.constexpr, SEGMENTED: tl.constexpr, OUT_FP32: tl.constexpr, TWIN: tl.constexpr,
    PRECISION: tl.constexpr,  # "bf16", "fp16" (exact products) or, for FP32 operands, "ieee" / "tf32" (mac)
    OUT_FP16: tl.constexpr,  # an FP16 output (FP16 operands): one FP16 rounding
    B_K_MAJOR: tl.constexpr,  # B's reduced dim is contiguous (e.g. fwd on nn.Linear's weight.t())
):
    pid_m, pid_n = tile_of_program(R, C, BLOCK_M, BLOCK_N, GROUP_M)
    offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_bn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, STEP_K)
    # 64-bit element offsets (an operand may hold more than 2**31 - 1 elements); masks stay 32-bit.
    rows64, cols64, ks64 = offs_am.to(tl.int64), offs_bn.to(tl.int64), offs_k.to(tl.int64)
    a_ptrs = a_ptr + rows64[:, None] * stride_ar + ks64[None, :] * stride_al  # [BLOCK_M, STEP_K]
    if B_K_MAJOR:
        # Load B in its storage order and transpose in registers: the MMA sees the same [STEP_K, BLOCK_N]
        # operand, but the copy runs along contiguous memory and wgmma reads B K-major from shared memory.
        b_ptrs = b_ptr + cols64[:, None] * stride_bc + ks64[None, :] * stride_bl  # [BLOCK_N, STEP_K]
    else:
        b_ptrs = b_ptr + ks64[:, None] * stride_bl + cols64[None, :] * stride_bc  # [STEP_K, BLOCK_N]
    a_step = tl.cast(stride_al, tl.int64) * STEP_K
    b_step = tl.cast(stride_bl, tl.int64) * STEP_K
    row_ok = offs_am < R
    col_ok = offs_bn < C

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    seg_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        acc, seg_acc = segment_boundary(acc, seg_acc, k0, seg_len, SEGMENTED)
        for kk in tl.static_range(0, BLOCK_K, STEP_K):
            k_ok = (k0 + kk + offs_k) < L
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, STEP_K]
            if B_K_MAJOR:
                b = tl.trans(tl.load(b_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0))  # [STEP_K, BLOCK_N]
            else:
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [STEP_K, BLOCK_N]
            a_ptrs += a_step
            b_ptrs += b_step
            acc, seg_acc = accumulate(acc, seg_acc, a, b, offs_k, STEP_K, INTERPRETED, SEGMENTED, PRECISION)
    if SEGMENTED:
        acc += seg_acc
    store_tile(c_ptr, twin_ptr, acc, offs_am, offs_bn, R, C, stride_cr, stride_cc,
               INTERPRETED, OUT_FP32, TWIN, OUT_FP16)


@triton.jit
def tma_tile(desc, row, col, TRANSPOSED: tl.constexpr):
    """The tile at (row, col) of an operand's logical view, from a TMA descriptor over its storage: the
    view itself, or its transpose (storage [cols, rows]: dB's a.T, or a K-major B such as nn.Linear's
    weight.t(), which wgmma then reads from shared memory as its K-major operand: no shuffle)."""
    if TRANSPOSED:
        tile = tl.trans(desc.load([col, row]))
    else:
        tile = desc.load([row, col])
    return tile


@triton.jit(launch_metadata=_launch_metadata)
def det_gemm_tma_kernel(
    a_desc, b_desc, c_ptr, twin_ptr,  # TMA descriptors over A and B in their storage order (see A_M_MAJOR, B_K_MAJOR)
    R, C, L,  # C[R, C] = A[R, L] @ B[L, C]
    stride_cr, stride_cc,
    seg_len,  # reduced elements per FP32 segment (== L for one segment); multiple of BLOCK_K
    op_id,  # 0 fwd, 1 dA, 2 dB: names the launch only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STEP_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRETED: tl.constexpr, SEGMENTED: tl.constexpr, OUT_FP32: tl.constexpr, TWIN: tl.constexpr,
    PRECISION: tl.constexpr,  # "bf16", "fp16" (exact products) or, for FP32 operands, "ieee" / "tf32" (mac)
    OUT_FP16: tl.constexpr,  # an FP16 output (FP16 operands): one FP16 rounding
    A_M_MAJOR: tl.constexpr,  # A stored as [L, R] (its row dim contiguous, e.g. dB's a.T): box [STEP_K, BLOCK_M]
    B_K_MAJOR: tl.constexpr,  # B stored as [C, L] (e.g. fwd on nn.Linear's weight.t()): box [BLOCK_N, STEP_K]
):
    """det_gemm_kernel's tile math with TMA loads: the same tile order, K order, steps and epilogue.
    TMA fills out-of-bounds box elements with zeros, as the pointer kernel's masked loads do."""
    pid_m, pid_n = tile_of_program(R, C, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_k = tl.arange(0, STEP_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    seg_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        acc, seg_acc = segment_boundary(acc, seg_acc, k0, seg_len, SEGMENTED)
        for kk in tl.static_range(0, BLOCK_K, STEP_K):
            k = k0 + kk
            a = tma_tile(a_desc, off_m, k, A_M_MAJOR)  # [BLOCK_M, STEP_K]
            b = tma_tile(b_desc, k, off_n, B_K_MAJOR)  # [STEP_K, BLOCK_N]
            acc, seg_acc = accumulate(acc, seg_acc, a, b, offs_k, STEP_K, INTERPRETED, SEGMENTED, PRECISION)
    if SEGMENTED:
        acc += seg_acc
    offs_am = off_m + tl.arange(0, BLOCK_M)
    offs_bn = off_n + tl.arange(0, BLOCK_N)
    store_tile(c_ptr, twin_ptr, acc, offs_am, offs_bn, R, C, stride_cr, stride_cc,
               INTERPRETED, OUT_FP32, TWIN, OUT_FP16)


@triton.jit(launch_metadata=_launch_metadata)
def det_gemm_tma3_kernel(
    a_desc, b_desc, c_ptr, twin_ptr,  # as det_gemm_tma_kernel; b_desc's box is one sub-tile, BLOCK_N / 3 wide
    R, C, L,
    stride_cr, stride_cc,
    seg_len,
    op_id,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STEP_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRETED: tl.constexpr, SEGMENTED: tl.constexpr, OUT_FP32: tl.constexpr, TWIN: tl.constexpr,
    PRECISION: tl.constexpr,  # "bf16", "fp16" (exact products) or, for FP32 operands, "ieee" / "tf32" (mac)
    OUT_FP16: tl.constexpr,  # an FP16 output (FP16 operands): one FP16 rounding
    A_M_MAJOR: tl.constexpr, B_K_MAJOR: tl.constexpr,
):
    """det_gemm_tma_kernel with a tile three power-of-two sub-tiles wide (BLOCK_N = 3 x SUB_N, e.g. 192):
    a width Triton's power-of-two blocks cannot hold in one tensor, which fills 132 SMs where powers of two
    do not (a 6144-wide output is 32 tile columns of 192, against 48 of 128 or 24 of 256). Each K step loads
    A once and feeds three MMAs, one per sub-tile accumulator; every output element still sums its K in the
    same ascending steps, so the bits equal every other config's (checked as for any config)."""
    SUB_N: tl.constexpr = BLOCK_N // 3
    pid_m, pid_n = tile_of_program(R, C, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_k = tl.arange(0, STEP_K)

    acc0 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    seg0 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    seg1 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    seg2 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        acc0, seg0 = segment_boundary(acc0, seg0, k0, seg_len, SEGMENTED)
        acc1, seg1 = segment_boundary(acc1, seg1, k0, seg_len, SEGMENTED)
        acc2, seg2 = segment_boundary(acc2, seg2, k0, seg_len, SEGMENTED)
        for kk in tl.static_range(0, BLOCK_K, STEP_K):
            k = k0 + kk
            a = tma_tile(a_desc, off_m, k, A_M_MAJOR)  # one A tile feeds the three sub-tiles' MMAs
            b = tma_tile(b_desc, k, off_n, B_K_MAJOR)  # [STEP_K, SUB_N]
            acc0, seg0 = accumulate(acc0, seg0, a, b, offs_k, STEP_K, INTERPRETED, SEGMENTED, PRECISION)
            b = tma_tile(b_desc, k, off_n + SUB_N, B_K_MAJOR)
            acc1, seg1 = accumulate(acc1, seg1, a, b, offs_k, STEP_K, INTERPRETED, SEGMENTED, PRECISION)
            b = tma_tile(b_desc, k, off_n + 2 * SUB_N, B_K_MAJOR)
            acc2, seg2 = accumulate(acc2, seg2, a, b, offs_k, STEP_K, INTERPRETED, SEGMENTED, PRECISION)
    if SEGMENTED:
        acc0 += seg0
        acc1 += seg1
        acc2 += seg2
    offs_am = off_m + tl.arange(0, BLOCK_M)
    offs_bn = off_n + tl.arange(0, SUB_N)  # the first sub-tile's columns; the others are SUB_N further each
    store_tile(c_ptr, twin_ptr, acc0, offs_am, offs_bn, R, C, stride_cr, stride_cc,
               INTERPRETED, OUT_FP32, TWIN, OUT_FP16)
    offs_bn += SUB_N
    store_tile(c_ptr, twin_ptr, acc1, offs_am, offs_bn, R, C, stride_cr, stride_cc,
               INTERPRETED, OUT_FP32, TWIN, OUT_FP16)
    offs_bn += SUB_N
    store_tile(c_ptr, twin_ptr, acc2, offs_am, offs_bn, R, C, stride_cr, stride_cc,
               INTERPRETED, OUT_FP32, TWIN, OUT_FP16)
