"""Block-scaled FP8 (E4M3) quantization for Hopper: row-wise 1x128, column-wise 128x1 and 128x128 weight blocks.

Math, for a block B of 128 values (a row slice, a column slice, or a 128x128 weight tile):
    amax  = max |v| over B                               (exact: a max, no rounding)
    scale = 2**k, the smallest power of two with amax / 2**k <= 448 (E4M3's largest finite value);
            k = 0 for an all-zero block, and k is clamped to [-126, 126] so 2**k and 2**-k are normal FP32
    q     = e4m3_rtne(clamp(v * 2**-k, -448, 448))       (NaN stays NaN)
    dequantized value = q * scale                        (exact: a power-of-two product)

Why power-of-two scales: v * 2**-k and q * 2**k are exact in FP32, so the only rounding is the one to
E4M3, the promotion ``acc += dot * (a_scale * b_scale)`` in the GEMMs adds no rounding of its own, and
the result does not depend on how a backend divides (GPU ``/`` is not correctly rounded by default).
The cost against an FP32 scale amax/448 is at most one binade of headroom: the block's largest value
lands in [224, 448] instead of exactly 448, so at most one more binade of small values goes subnormal.

Rounding: round-to-nearest-even with saturation to +-448 (the semantics of sm_90's
``cvt.rn.satfinite.e4m3x2.f32``; +-Inf saturate). The Triton interpreter's own FP32 -> float8e4nv cast
is wrong (ties round up, out-of-range values wrap), so on the interpreter ``to_e4m3`` rounds in integer
arithmetic; on the GPU it clamps and uses the hardware conversion. Both equal ``e4m3_ref`` bit for bit.

Determinism and batch invariance: every block is quantized from its own values only; a row's FP8
values and scales do not depend on any other row (row-wise) or on the batch size. No reductions across
programs, no atomics.

Layouts (Hopper's FP8 wgmma wants both operands K-major, i.e. the reduced dim contiguous):
    quantize_rowwise(x [M, N])  -> q [M, N] row-major, scale [M, N/128]       (K = N for the consumer)
    quantize_colwise(x [M, N])  -> q_t [N, M] row-major, scale [N, M/128]     (K = M: a weight-gradient GEMM)
    quantize_weight(w [E, R, C]) -> q [E, R, C], q_t [E, C, R], scale [E, R/128, C/128]
        the same FP8 values in both orientations, so either R or C can be the K-major reduced dim.
Every size that is blocked must be a multiple of 128 (the SM90 recipe's block); inputs are BF16 or
FP32 with any non-negative strides (no copies).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from detkit.kernels.backend import MAX_INT32_OFFSET, TRITON_INTERPRETER, PlannedKernel, resolve_backend

E4M3_MAX = 448.0
QBLOCK = 128  # the SM90 recipe: 1x128 activation blocks, 128x128 weight blocks, promotion every 128 K
FP8_DTYPE = torch.float8_e4m3fn
SCALE_K_MIN, SCALE_K_MAX = -126, 126
QUANT_INPUT_DTYPES = (torch.bfloat16, torch.float32)
# Rows per program of the row-wise quantizer (the interpreter's cost is per op: few large programs).
QUANT_BLOCK_M = {"cuda_sm90": 32, "triton_interpreter": 128}


# ---------------------------------------------------------------------------------------------
# Device helpers (used by the quantizers here and by the fused GEMM epilogues of kernels/moe/fp8/layer.py)
# ---------------------------------------------------------------------------------------------
@triton.jit
def fp32_to_e4m3_rtne(x):
    """FP32 -> E4M3 (float8e4nv) nearest-even with saturation to +-448, in integer arithmetic."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.where(x != x, 0.0, tl.minimum(tl.abs(x), 448.0))  # NaN is re-inserted below
    abits = a.to(tl.uint32, bitcast=True)
    # Normal range (a >= 2**-6): drop 20 of FP32's 23 mantissa bits, nearest-even; the carry may bump
    # the exponent, which is the right code. FP32 exponent 127 - 7 rebiases to E4M3's 7.
    r = abits + 0x7FFFF + ((abits >> 20) & 1)
    normal = (r >> 20) - (120 << 3)
    # Subnormal range: multiples of 2**-9; adding 2**23 rounds a*2**9 (< 8) to an integer, nearest-even.
    # A result of 8 is the code of 2**-6, the smallest normal: the encoding continues seamlessly.
    sub = (((a * 512.0) + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(a >= 0.015625, normal, sub)
    code = tl.where(x != x, 0x7F, code) | sign
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def to_e4m3(x, INTERPRETED: tl.constexpr, EXPLICIT_CLAMP: tl.constexpr = False):
    if INTERPRETED:
        y = fp32_to_e4m3_rtne(x)
    elif EXPLICIT_CLAMP:  # the same codes; the weight quantizer is faster this way on the H200 (docs/decisions.md)
        y = tl.where(x != x, x, tl.minimum(tl.maximum(x, -448.0), 448.0)).to(tl.float8e4nv)
    else:
        # cvt.rn.satfinite.e4m3x2.f32 on sm_90: nearest-even, NaN kept, anything past +-448 (infinities too)
        # saturated to +-448: e4m3_ref's clamp is the conversion's own (tests/test_fp8_quant.py, every code)
        y = x.to(tl.float8e4nv)
    return y


@triton.jit
def pow2_scale(amax):
    """(scale, 1/scale) as FP32 powers of two: the smallest 2**k with amax / 2**k <= 448 (1 for amax 0)."""
    bits = amax.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # 448 = 1.75 * 2**8
    k = tl.where(amax > 0, k, 0)
    k = tl.minimum(tl.maximum(k, -126), 126)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def quantize_rows(v, INTERPRETED: tl.constexpr):
    """v [BLOCK_M, QBLOCK] FP32 -> (q [BLOCK_M, QBLOCK] E4M3, scale [BLOCK_M]): one block per row."""
    scale, inv = pow2_scale(tl.max(tl.abs(v), axis=1))
    return to_e4m3(v * inv[:, None], INTERPRETED), scale


@triton.jit
def quantize_row_blocks(v, NB: tl.constexpr, QBLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    """v [BLOCK_M, NB * QBLOCK] FP32 -> (q [BLOCK_M, NB * QBLOCK] E4M3, scale [BLOCK_M, NB]): NB blocks of 1 x
    QBLOCK per row, each quantized as ``quantize_rows`` does (an exact max: the same values for any NB)."""
    BLOCK_M: tl.constexpr = v.shape[0]
    blocks = tl.reshape(v, (BLOCK_M, NB, QBLOCK))
    scale, inv = pow2_scale(tl.max(tl.abs(blocks), axis=2))
    q = to_e4m3(blocks * inv[:, :, None], INTERPRETED)
    return tl.reshape(q, (BLOCK_M, NB * QBLOCK)), scale


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
def _rowwise_meta(grid, metadata, args):
    return {"name": f"fp8_quant_rowwise [M={args['M']}, N={args['N']}] e4m3"}


def _weight_meta(grid, metadata, args):
    return {"name": f"fp8_quant_weight [R={args['R']}, C={args['C']}] e4m3"}


@triton.jit(launch_metadata=_rowwise_meta)
def fp8_quant_rowwise_kernel(
    x_ptr, q_ptr, s_ptr, limit_ptr,
    M, N,  # q[m, n] = e4m3(x[m, n] / s[m, n // QBLOCK]); N a multiple of QBLOCK
    stride_xm, stride_xn, stride_qm, stride_qn, stride_sm, stride_sn,
    BLOCK_M: tl.constexpr, QBLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
    LIMITED: tl.constexpr = False,  # only the rows below the int32 at limit_ptr (read on the device)
):
    pid = tl.program_id(axis=0)
    num_pid_n = N // QBLOCK
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * QBLOCK + tl.arange(0, QBLOCK)
    rows = M
    if LIMITED:
        rows = tl.minimum(M, tl.load(limit_ptr))
    m_ok = offs_m < rows
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_n[None, :] * stride_xn,
                mask=m_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_M, QBLOCK]
    q, scale = quantize_rows(x, INTERPRETED)
    tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_n[None, :] * stride_qn, q, mask=m_ok[:, None])
    tl.store(s_ptr + offs_m * stride_sm + pid_n * stride_sn, scale, mask=m_ok)


@triton.jit(launch_metadata=_weight_meta)
def fp8_quant_weight_kernel(
    w_ptr, q_ptr, qt_ptr, s_ptr,
    R, C,  # per expert: q[e, r, c] = qt[e, c, r] = e4m3(w[e, r, c] / s[e, r // QBLOCK, c // QBLOCK])
    stride_we, stride_wr, stride_wc, stride_wc_odd,
    stride_qe, stride_qr, stride_qc,
    stride_te, stride_tc, stride_tr,
    stride_se, stride_sr, stride_sc,
    QBLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
    SPLIT_C: tl.constexpr,  # w's columns are gate/up pairs held as split halves: column 2j + h at j + h * (C / 2)
):
    pid = tl.program_id(axis=0)
    num_r = R // QBLOCK
    num_c = C // QBLOCK
    expert = pid // (num_r * num_c)
    pid_r = (pid % (num_r * num_c)) // num_c
    pid_c = pid % num_c
    offs_r = pid_r * QBLOCK + tl.arange(0, QBLOCK)
    offs_c = pid_c * QBLOCK + tl.arange(0, QBLOCK)
    if SPLIT_C:
        w_cols = (offs_c // 2) * stride_wc + (offs_c % 2) * stride_wc_odd
    else:
        w_cols = offs_c * stride_wc
    # The block stays in its input dtype until it is scaled: its amax is exact there, and a BF16 block's half of
    # FP32's registers lets more programs share an SM (more loads in flight in this DRAM-bound pass).
    w = tl.load(w_ptr + expert * stride_we + offs_r[:, None] * stride_wr + w_cols[None, :])
    scale, inv = pow2_scale(tl.max(tl.max(tl.abs(w), axis=1), axis=0).to(tl.float32))
    q = to_e4m3(w.to(tl.float32) * inv, INTERPRETED, EXPLICIT_CLAMP=True)
    tl.store(q_ptr + expert * stride_qe + offs_r[:, None] * stride_qr + offs_c[None, :] * stride_qc, q)
    tl.store(qt_ptr + expert * stride_te + offs_r[:, None] * stride_tr + offs_c[None, :] * stride_tc, q)
    tl.store(s_ptr + expert * stride_se + pid_r * stride_sr + pid_c * stride_sc, scale)


# ---------------------------------------------------------------------------------------------
# Checks and launch wrappers: check, allocate, launch.
# ---------------------------------------------------------------------------------------------
def _check_quant_input(name: str, t: torch.Tensor, dims: int, blocked: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype not in QUANT_INPUT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {QUANT_INPUT_DTYPES}")
    if t.dim() != dims or min(t.shape) < 1:
        raise ValueError(f"{name} must be {dims}-D with every dim >= 1; got shape {tuple(t.shape)}")
    for d in blocked:
        if t.shape[d] % QBLOCK:
            raise ValueError(f"{name} dim {d} has size {t.shape[d]} (shape {tuple(t.shape)}); supported: "
                             f"multiples of the FP8 block {QBLOCK}")
    if any(s < 0 for s in t.stride()):
        raise ValueError(f"{name} has negative strides {t.stride()}; supported: non-negative strides")
    furthest = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    if furthest > MAX_INT32_OFFSET or t.numel() > MAX_INT32_OFFSET:
        raise ValueError(f"{name} (shape {tuple(t.shape)}, strides {t.stride()}) exceeds 32-bit kernel offsets")


_fp8_quant_rowwise_kernel_planned = PlannedKernel(fp8_quant_rowwise_kernel)


def quantize_rowwise(x: torch.Tensor, row_limit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, N] (bf16/fp32, any strides) -> q [M, N] e4m3 row-major, scale [M, N/128] fp32 (powers of two).

    ``row_limit``: an int32 tensor on x's device whose first element bounds the rows quantized, read on the device
    (no host read): rows from it on are left unset (the MoE layer's rows past its routing's P)."""
    _check_quant_input("x", x, 2, (1,))
    if row_limit is not None and (not isinstance(row_limit, torch.Tensor) or row_limit.dtype != torch.int32
                                  or row_limit.numel() < 1 or row_limit.device != x.device):
        raise ValueError(f"row_limit must be an int32 tensor of at least one element on {x.device}; got "
                         f"{getattr(row_limit, 'dtype', type(row_limit).__name__)}")
    backend = resolve_backend(fp8_quant_rowwise_kernel, {"x": x})
    m, n = x.shape
    q = torch.empty((m, n), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, n // QBLOCK), dtype=torch.float32, device=x.device)
    block_m = QUANT_BLOCK_M[backend]
    grid = (triton.cdiv(m, block_m) * (n // QBLOCK),)
    _fp8_quant_rowwise_kernel_planned[grid](
        x, q, s, row_limit if row_limit is not None else s, m, n,
        x.stride(0), x.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
        BLOCK_M=block_m, QBLOCK=QBLOCK, INTERPRETED=backend == TRITON_INTERPRETER, LIMITED=row_limit is not None,
        num_warps=4,
    )
    return q, s


def quantize_colwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, N] -> q_t [N, M] e4m3 row-major (128x1 blocks down each column of x), scale [N, M/128].

    The layout a GEMM reducing over M wants (K-major); it is the row-wise quantizer on the view x.t()."""
    _check_quant_input("x", x, 2, (0,))
    return quantize_rowwise(x.t())


@dataclass(frozen=True)
class Fp8Weight:
    """A weight stack W [E, R, C] quantized in 128x128 blocks, in both K-major orientations."""

    q: torch.Tensor  # [E, R, C] e4m3 row-major: K-major when C is the reduced dim
    q_t: torch.Tensor  # [E, C, R] e4m3 row-major: K-major when R is the reduced dim
    scale: torch.Tensor  # [E, R/128, C/128] fp32 powers of two

    def dequantize(self) -> torch.Tensor:
        """[E, R, C] fp32 = q * scale (exact)."""
        s = self.scale.repeat_interleave(QBLOCK, 1).repeat_interleave(QBLOCK, 2)
        return self.q.float() * s


_fp8_quant_weight_kernel_planned = PlannedKernel(fp8_quant_weight_kernel)


def quantize_weight(w: torch.Tensor, split_pairs: bool = False, out: Fp8Weight | None = None) -> Fp8Weight:
    """w [E, R, C] (bf16/fp32, any strides; R, C multiples of 128) -> Fp8Weight. ``split_pairs``: w's columns are
    gate/up pairs held as split halves ([gate (C/2) | up (C/2)]), quantized as their interleaved order (column
    2j + h read at j + h * C/2): the Fp8Weight of the interleaved copy, without the copy. ``out``: an Fp8Weight of
    w's shape on w's device, overwritten in place and returned (its buffers keep their addresses)."""
    _check_quant_input("w", w, 3, (1, 2))
    backend = resolve_backend(fp8_quant_weight_kernel, {"w": w})
    e, r, c = w.shape
    want = {"q": ((e, r, c), FP8_DTYPE), "q_t": ((e, c, r), FP8_DTYPE),
            "scale": ((e, r // QBLOCK, c // QBLOCK), torch.float32)}
    if out is not None:
        for name, (shape, dtype) in want.items():
            t = getattr(out, name)
            if tuple(t.shape) != shape or t.dtype != dtype or t.device != w.device or not t.is_contiguous():
                raise ValueError(f"out.{name} must be a contiguous {dtype} {shape} on {w.device}; got {t.dtype} "
                                 f"{tuple(t.shape)} on {t.device}, contiguous={t.is_contiguous()}")
    else:
        out = Fp8Weight(*(torch.empty(shape, dtype=dtype, device=w.device) for shape, dtype in want.values()))
    q, q_t, s = out.q, out.q_t, out.scale
    _fp8_quant_weight_kernel_planned[(e * (r // QBLOCK) * (c // QBLOCK),)](
        w, q, q_t, s, r, c, *w.stride(), c // 2 * w.stride(2), *q.stride(), *q_t.stride(), *s.stride(),
        QBLOCK=QBLOCK, INTERPRETED=backend == TRITON_INTERPRETER, SPLIT_C=split_pairs, num_warps=8,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Pure-torch references (every test and audit compares the kernels with these)
# ---------------------------------------------------------------------------------------------
def e4m3_ref(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> E4M3 nearest-even, saturating to +-448 (torch's cast is RTNE but maps overflow to NaN)."""
    v = v.float()
    return torch.where(torch.isnan(v), v, v.clamp(-E4M3_MAX, E4M3_MAX)).to(FP8_DTYPE)


def pow2_scale_ref(amax: torch.Tensor) -> torch.Tensor:
    """The power-of-two scale of each block amax (FP32), as ``pow2_scale``."""
    bits = amax.float().view(torch.int32)
    k = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    k = torch.where(amax > 0, k, torch.zeros_like(k)).clamp(SCALE_K_MIN, SCALE_K_MAX)
    return ((k + 127) << 23).view(torch.float32)


def quantize_rowwise_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = x.shape
    blocks = x.float().reshape(m, n // QBLOCK, QBLOCK)
    s = pow2_scale_ref(blocks.abs().amax(dim=2))
    return e4m3_ref(blocks * (1.0 / s)[:, :, None]).reshape(m, n), s


def quantize_colwise_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_rowwise_ref(x.t())
    return q.contiguous(), s


def quantize_weight_ref(w: torch.Tensor) -> Fp8Weight:
    e, r, c = w.shape
    blocks = w.float().reshape(e, r // QBLOCK, QBLOCK, c // QBLOCK, QBLOCK)
    s = pow2_scale_ref(blocks.abs().amax(dim=(2, 4)))
    q = e4m3_ref(blocks * (1.0 / s)[:, :, None, :, None]).reshape(e, r, c)
    return Fp8Weight(q, q.transpose(1, 2).contiguous(), s)


def dequantize_rowwise(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[M, N] fp32 = q * scale of its 1x128 block (exact)."""
    return q.float() * s.repeat_interleave(QBLOCK, 1)


# ---------------------------------------------------------------------------------------------
# Quantization-risk monitor (reported with every FP8 run)
# ---------------------------------------------------------------------------------------------
def quant_risk(x: torch.Tensor, q: torch.Tensor, block_amax: torch.Tensor, group_amax: torch.Tensor) -> dict:
    """Per tensor: log2(block amax / the amax of its row or matrix) (p95 and max of its magnitude, i.e.
    how many binades a coarser scale would lose), and the fraction of non-zero values flushed to zero."""
    live = (block_amax > 0) & (group_amax > 0)
    ratio = group_amax.double()[live] / block_amax.double()[live]
    binades = torch.log2(ratio) if ratio.numel() else torch.zeros(1, dtype=torch.float64)
    nonzero = x != 0
    flushed = nonzero & (q.float() == 0)
    n_nonzero = int(nonzero.sum())
    return {
        "log2_group_over_block_amax_p95": float(torch.quantile(binades.cpu(), 0.95)),
        "log2_group_over_block_amax_max": float(binades.max()),
        "flushed_fraction": int(flushed.sum()) / n_nonzero if n_nonzero else 0.0,
        "elements": x.numel(),
    }


def quant_risk_rowwise(x: torch.Tensor) -> dict:
    """``quant_risk`` of x [M, N] under 1x128 row blocks (block amax over the row's amax)."""
    q, _ = quantize_rowwise_ref(x)
    m, n = x.shape
    block_amax = x.float().abs().reshape(m, n // QBLOCK, QBLOCK).amax(dim=2)
    return quant_risk(x, q, block_amax, block_amax.amax(dim=1, keepdim=True).expand_as(block_amax))


def quant_risk_weight(w: torch.Tensor) -> dict:
    """``quant_risk`` of w [E, R, C] under 128x128 blocks (block amax over the expert matrix's amax)."""
    e, r, c = w.shape
    ref = quantize_weight_ref(w)
    block_amax = w.float().abs().reshape(e, r // QBLOCK, QBLOCK, c // QBLOCK, QBLOCK).amax(dim=(2, 4))
    group = block_amax.amax(dim=(1, 2), keepdim=True).expand_as(block_amax)
    return quant_risk(w, ref.q, block_amax, group)
