"""The numerical contract and the raw-bit comparators. Derivation: docs/contract.md.

A detkit GEMM computes c = bf16(fl32(sum_k a_k * b_k)) from BF16 inputs. Against the exact product
c* of the same BF16 inputs (an FP64 oracle), every element must satisfy

    |c - c*| <= U_BF16 * |c*| + (1 + U_BF16) * gamma(K) * (|A| @ |B|) + ETA_BF16

where gamma(K) = K*U_FP32 / (1 - K*U_FP32) and U_FP32 = 2**-23 (not 2**-24) so truncating
tensor-core adds are covered. ETA_BF16 covers rounding into BF16's subnormal range. The FP64 oracle's
own error, gamma(K) in FP64 units, is added so the bound is a bound against the true product.

A TP/CP-reduced tensor r = bf16(fl32(p0 + p1)), p_i = bf16(fl32(partial_i)), obeys
``reduced_bound`` (docs/contract.md derives it).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

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


def gemm_bound(c_star: torch.Tensor, abs_ab: torch.Tensor, k: int) -> torch.Tensor:
    """Per-element bound for one FP32-accumulated GEMM over ``k`` terms with one BF16 rounding."""
    oracle_err = gamma(k, U_FP64) * abs_ab
    return U_BF16 * c_star.abs() + (1.0 + U_BF16) * gamma(k) * abs_ab + ETA_BF16 + oracle_err


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


@dataclass(frozen=True)
class ContractResult:
    passed: bool
    elements: int
    violations: int
    nonfinite: int
    first_violation: tuple[int, ...] | None
    worst_ratio: float  # max |c - c*| / bound; <= 1 passes

    def as_row(self) -> dict:
        return asdict(self)


def _first_index(mask: torch.Tensor) -> tuple[int, ...] | None:
    flat = mask.reshape(-1).nonzero()
    if flat.numel() == 0:
        return None
    return tuple(int(i) for i in torch.unravel_index(flat[0, 0], mask.shape))


def check_bound(c: torch.Tensor, c_star: torch.Tensor, bound: torch.Tensor) -> ContractResult:
    """Every element of ``c`` within ``bound`` of the FP64 oracle ``c_star``; NaN/Inf fail."""
    if c.shape != c_star.shape or c.shape != bound.shape:
        raise ValueError(f"shapes differ: c {tuple(c.shape)}, c* {tuple(c_star.shape)}, bound {tuple(bound.shape)}")
    c64 = c.to(device=c_star.device, dtype=torch.float64)
    nonfinite = ~torch.isfinite(c64)
    err = (c64 - c_star).abs()
    bad = nonfinite | (err > bound)
    ratio = torch.where(nonfinite, torch.full_like(err, float("inf")), err / bound)
    violations = int(bad.sum())
    return ContractResult(
        passed=violations == 0,
        elements=c.numel(),
        violations=violations,
        nonfinite=int(nonfinite.sum()),
        first_violation=_first_index(bad),
        worst_ratio=float(ratio.max()) if c.numel() else 0.0,
    )


# ---------------------------------------------------------------------------------------------
# Drift statistics (reported beside the pass/fail bound)
# ---------------------------------------------------------------------------------------------
def bf16_ordinal(x: torch.Tensor) -> torch.Tensor:
    """Map BF16 bit patterns onto integers whose difference is the ULP distance (+0 and -0 map to 0)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"bf16_ordinal needs bfloat16; got {x.dtype}")
    bits = x.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def _quantile(x: torch.Tensor, q: float) -> float:
    flat = x.reshape(-1)
    if flat.numel() == 0:
        return 0.0
    k = max(1, min(flat.numel(), int(round(q * flat.numel()))))
    return float(flat.kthvalue(k).values)


def drift_stats(c: torch.Tensor, oracle: torch.Tensor, prefix: str) -> dict[str, float]:
    """max/p95/p99 absolute and relative error, relative L2 and BF16 ULP distance of ``c`` vs ``oracle``."""
    ref = oracle.to(torch.float64)
    c64 = c.to(device=ref.device, dtype=torch.float64)
    err = (c64 - ref).abs()
    nonzero = ref != 0
    rel = err[nonzero] / ref.abs()[nonzero]
    ulp = (bf16_ordinal(c.to(ref.device)) - bf16_ordinal(ref.to(torch.bfloat16))).abs().double()
    norm = float(torch.linalg.vector_norm(ref))
    return {
        f"{prefix}_abs_max": float(err.max()),
        f"{prefix}_abs_p95": _quantile(err, 0.95),
        f"{prefix}_abs_p99": _quantile(err, 0.99),
        f"{prefix}_rel_max": float(rel.max()) if rel.numel() else 0.0,
        f"{prefix}_rel_p95": _quantile(rel, 0.95),
        f"{prefix}_rel_p99": _quantile(rel, 0.99),
        f"{prefix}_rel_l2": float(torch.linalg.vector_norm(c64 - ref)) / norm if norm else 0.0,
        f"{prefix}_ulp_max": float(ulp.max()),
        f"{prefix}_ulp_p99": _quantile(ulp, 0.99),
        f"{prefix}_ulp0_fraction": float((ulp == 0).double().mean()),
    }


# ---------------------------------------------------------------------------------------------
# Raw-bit comparison
# ---------------------------------------------------------------------------------------------
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class BitwiseResult:
    equal: bool
    elements: int
    mismatches: int
    nan_count: int
    first_mismatch: tuple[int, ...] | None

    def as_row(self) -> dict:
        return asdict(self)


def raw_bits(x: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as signed integers of the same width (+0 and -0 differ)."""
    if not x.dtype.is_floating_point:
        raise TypeError(f"raw_bits compares floating-point tensors; got {x.dtype}")
    return x.contiguous().view(_INT_VIEW[x.element_size()])


def compare_bits(x: torch.Tensor, y: torch.Tensor) -> BitwiseResult:
    """Compare raw bits. A NaN in either tensor is an error (not equal), whatever its bits."""
    if x.shape != y.shape or x.dtype != y.dtype:
        raise ValueError(f"cannot compare {x.dtype}{tuple(x.shape)} with {y.dtype}{tuple(y.shape)}")
    y = y.to(x.device)
    nan = torch.isnan(x) | torch.isnan(y)
    diff = (raw_bits(x) != raw_bits(y)) | nan
    mismatches = int(diff.sum())
    return BitwiseResult(
        equal=mismatches == 0,
        elements=x.numel(),
        mismatches=mismatches,
        nan_count=int(nan.sum()),
        first_mismatch=_first_index(diff),
    )


def digest(x: torch.Tensor) -> str:
    """SHA-256 of the tensor's raw bytes, dtype and shape: one hash per result, comparable across processes."""
    h = hashlib.sha256(f"{x.dtype}:{tuple(x.shape)}:".encode())
    h.update(raw_bits(x).cpu().numpy().tobytes())
    return h.hexdigest()
