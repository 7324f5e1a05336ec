"""The numerical contract's checks and the raw-bit comparators. Derivation: docs/contract.md.

The bounds themselves (``gemm_bound``, ``reduced_bound`` and the unit roundoffs) are what the operators'
references compose, so they live with the kernels in kernels/bounds.py; they are re-exported here beside the
checks that apply them (``check_bound``), the drift statistics and the bitwise comparison.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch

from detkit.kernels.bounds import (  # noqa: F401 (re-exported)
    ETA_BF16, ETA_FP16, ETA_FP32, U_BF16, U_FP16, U_FP32, U_FP64, U_REDUCE, U_TF32, gamma, gemm_bound, gemm_bound_fp32,
    reduced_bound,
)


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


def _quantiles(x: torch.Tensor, *qs: float) -> list[float]:
    """The ``q``-quantiles of ``x`` (the k-th smallest element, k = round(q * n)), from one sort: on CUDA a
    device-wide sort, where ``kthvalue`` selects with a single block per slice (seconds at 10**8 elements)."""
    flat = x.reshape(-1)
    if flat.numel() == 0:
        return [0.0 for _ in qs]
    ordered = torch.sort(flat).values
    return [float(ordered[max(1, min(flat.numel(), int(round(q * flat.numel())))) - 1]) for q in qs]


def rel_l2(got: torch.Tensor, ref: torch.Tensor, *, dtype: torch.dtype = torch.float64) -> float:
    """The relative L2 error ||got - ref||_2 / ||ref||_2 over all elements, both taken to ``dtype`` on ref's device.

    ``dtype`` float64 (the default) makes the norms exact enough for any gate in detkit; float32 halves the memory of
    the copies for tensors too large to copy to FP64 on the device (the norms are then rounded to FP32). A
    non-finite element in ``got`` gives inf (a NaN would compare false against every gate, silently passing a
    ``>`` check). When ``ref`` is all zeros there is nothing to be relative to: the result is the absolute error
    ||got||_2 (0 for got == ref). The same number as the relative RMSE, sqrt(mean (got - ref)^2) / sqrt(mean ref^2).
    """
    ref = ref.to(dtype)
    got = got.to(device=ref.device, dtype=dtype)
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    err = float(torch.linalg.vector_norm(got - ref))
    norm = float(torch.linalg.vector_norm(ref))
    return err / norm if norm else err


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The cosine of the angle between ``a`` and ``b`` flattened, in FP64 on a's device; 1 when both are all zeros,
    0 when only one is."""
    a, b = a.to(torch.float64).flatten(), b.to(device=a.device, dtype=torch.float64).flatten()
    na, nb = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b))
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(a @ b) / (na * nb)


def drift_stats(c: torch.Tensor, oracle: torch.Tensor, prefix: str,
                bound: torch.Tensor | None = None) -> dict[str, float]:
    """max/p95/p99 absolute and relative error, relative L2 and BF16 ULP distance of ``c`` vs ``oracle``.

    Relative error and ULP distance are taken over the elements where they mean something: with ``bound``
    (the contract's per-element error bound), those whose oracle lies outside its bound of zero,
    |c*| > bound; without it, those with c* != 0. Where |c*| <= bound, cancellation has left the exact
    result within its own error bound of zero: any value in the bound passes (a sign flip included), and
    its relative error and ULP distance grow without limit as c* nears 0 (one bounded error on a 1e-19
    reference reads as 1e14 relative and tens of thousands of ULP). ``{prefix}_near_zero`` counts the
    elements left out; absolute error and relative L2 cover every element."""
    ref = oracle.to(torch.float64)
    c64 = c.to(device=ref.device, dtype=torch.float64)
    err = (c64 - ref).abs()
    if bound is None:
        defined = ref != 0
    else:
        if bound.shape != ref.shape:
            raise ValueError(f"bound {tuple(bound.shape)} does not match the oracle {tuple(ref.shape)}")
        defined = ref.abs() > bound.to(device=ref.device, dtype=torch.float64)
    rel = err[defined] / ref.abs()[defined]
    ulp = (bf16_ordinal(c.to(ref.device)) - bf16_ordinal(ref.to(torch.bfloat16))).abs().double()[defined]
    abs_p95, abs_p99 = _quantiles(err, 0.95, 0.99)
    rel_p95, rel_p99 = _quantiles(rel, 0.95, 0.99)
    return {
        f"{prefix}_abs_max": float(err.max()) if err.numel() else 0.0,
        f"{prefix}_abs_p95": abs_p95,
        f"{prefix}_abs_p99": abs_p99,
        f"{prefix}_rel_max": float(rel.max()) if rel.numel() else 0.0,
        f"{prefix}_rel_p95": rel_p95,
        f"{prefix}_rel_p99": rel_p99,
        f"{prefix}_rel_l2": rel_l2(c64, ref),
        f"{prefix}_ulp_max": float(ulp.max()) if ulp.numel() else 0.0,
        f"{prefix}_ulp_p99": _quantiles(ulp, 0.99)[0],
        f"{prefix}_ulp0_fraction": float((ulp == 0).double().mean()) if ulp.numel() else 1.0,
        f"{prefix}_near_zero": int(ref.numel() - int(defined.sum())),
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
