"""Error bounds of the numerical contract (derivation: docs/contract.md): what a detkit GEMM or TP/CP-reduced
tensor may differ by from an FP64 oracle of the same BF16 inputs. The operators' references (kernels/parallel/mlp.py,
kernels/parallel/swiglu.py) compose them; the harness (toolkit/contract.py) checks results against them.

A detkit GEMM computes c = bf16(fl32(sum_k a_k * b_k)) from BF16 inputs. Against the exact product
c* of the same BF16 inputs (an FP64 oracle), every element must satisfy

    |c - c*| <= U_BF16 * |c*| + (1 + U_BF16) * gamma(K) * (|A| @ |B|) + ETA_BF16

where gamma(K) = K*U_FP32 / (1 - K*U_FP32) and U_FP32 = 2**-23 (not 2**-24) so truncating
tensor-core adds are covered. ETA_BF16 covers rounding into BF16's subnormal range. The FP64 oracle's
own error, gamma(K) in FP64 units, is added so the bound is a bound against the true product.

A TP/CP-reduced tensor r = bf16(fl32(p0 + p1)), p_i = bf16(fl32(partial_i)), obeys ``reduced_bound``.
"""

from __future__ import annotations

import torch

U_BF16 = 2.0**-8
U_FP32 = 2.0**-23
U_FP64 = 2.0**-53
ETA_BF16 = 2.0**-134  # half the spacing of BF16 subnormals (2**-133)


def gamma(n: int, unit: float = U_FP32) -> float:
    """Higham's gamma_n = n*u / (1 - n*u): the relative error bound of an n-term recursive sum."""
    if n < 0:
        raise ValueError(f"gamma needs n >= 0; got {n}")
    if n * unit >= 1.0:
        raise ValueError(f"gamma({n}) is undefined for unit {unit}: n*u = {n * unit} >= 1")
    return n * unit / (1.0 - n * unit)


# FP16 operands: products exact in FP32 (two 11-bit significands), FP32 accumulation, one FP16 rounding.
U_FP16 = 2.0**-11
ETA_FP16 = 2.0**-25  # half the spacing of FP16 subnormals (2**-24)


def gemm_bound(c_star: torch.Tensor, abs_ab: torch.Tensor, k: int, unit: float = U_BF16,
               eta: float = ETA_BF16) -> torch.Tensor:
    """Per-element bound for one FP32-accumulated GEMM over ``k`` terms with one BF16 rounding (``unit``, ``eta``:
    U_FP16, ETA_FP16 for an FP16 rounding). Results beyond the output's range (FP16: 65504) are not covered: they
    overflow to inf, which the check fails."""
    oracle_err = gamma(k, U_FP64) * abs_ab
    return unit * c_star.abs() + (1.0 + unit) * gamma(k) * abs_ab + eta + oracle_err


# FP32 operands (docs/contract.md, "FP32 operands"): c = fl32(sum_k p_k) with p_k the product at the call's
# precision. "ieee": the exact product (a fused multiply-add on the GPU) or the product rounded to FP32 (the
# interpreter): K + 1 roundings per term at most, so gamma(K + 1). "tf32": each operand first loses its low 13
# significand bits (rounded, or dropped by the tensor cores: relative error below 2**-10 either way), so each
# product is off by (1 + U_TF32)**2 - 1 relative before the FP32 sum. No final rounding: the output is the FP32
# accumulator. ETA_FP32 per rounding covers results in FP32's subnormal range.
U_TF32 = 2.0**-10
ETA_FP32 = 2.0**-150  # half the spacing of FP32 subnormals (2**-149)
FP32_PRECISIONS = ("ieee", "tf32")


def gemm_bound_fp32(c_star: torch.Tensor, abs_ab: torch.Tensor, k: int, precision: str = "ieee") -> torch.Tensor:
    """Per-element bound for one GEMM of FP32 operands over ``k`` terms, FP32 accumulation and output, products at
    ``precision`` ("ieee" or "tf32"); ``c_star`` (unused beyond its shape: no output rounding) and ``abs_ab`` =
    |A| @ |B| from the FP64 oracle."""
    if precision not in FP32_PRECISIONS:
        raise ValueError(f"precision {precision!r} is not supported; supported: {FP32_PRECISIONS}")
    u_in = U_TF32 if precision == "tf32" else 0.0
    inputs = (1.0 + u_in) ** 2
    oracle_err = gamma(k, U_FP64) * abs_ab
    bound = ((inputs - 1.0) + inputs * gamma(k + 1)) * abs_ab + 2 * (k + 1) * ETA_FP32 + oracle_err
    return bound.expand(c_star.shape)


# Rounding p0 + p1 to FP32 and then to BF16: (1 + U_FP32)(1 + U_BF16) - 1.
U_REDUCE = U_BF16 + U_FP32 * (1.0 + U_BF16)


def reduced_bound(c_star: torch.Tensor, partial_abs_sum: torch.Tensor, abs_ab: torch.Tensor,
                  k_local: int) -> torch.Tensor:
    """Bound for r = bf16(fl32(p0 + p1)) with p_i = bf16(fl32(partial_i)), each over ``k_local`` terms.

    ``partial_abs_sum`` = |p0*| + |p1*| (exact partials), ``abs_ab`` = |A| @ |B| over the full K.
    Each partial contributes U_BF16*|p_i*| + (1+U_BF16)*gamma(k_local)*(|A_i||B_i|); the final two
    roundings add U_REDUCE relative to the rounded sum (docs/contract.md).
    """
    partial_err = U_BF16 * partial_abs_sum + (1.0 + U_BF16) * gamma(k_local) * abs_ab + 2 * ETA_BF16
    oracle_err = gamma(2 * k_local, U_FP64) * abs_ab
    return U_REDUCE * c_star.abs() + (1.0 + U_REDUCE) * partial_err + ETA_BF16 + oracle_err
