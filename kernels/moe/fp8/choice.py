"""Which layer a shape asked to run in FP8 gets: the FP8 layer where it was measured faster than the BF16 layer at
every T >= 2048, else the BF16 layer. A pure function of the layer's shape (H, I, E, K), the backend and the weight
gradients' mode; never of T, of the routing or of a timing taken at run time, so the same model runs the same layer
at every batch size (a token's bits cannot change with its batch) and in the rollout engine and the trainer alike.

The rule: FP8 where the shape is at least as favourable to FP8 as a shape measured faster at every T >= 2048, in
each of three quantities that move the FP8 / BF16 time ratio one way:

    K / E      rows per expert per token: the GEMMs (T*K*H*I) against the weight quantization (E*H*I, whatever T is)
    H * I      one expert's weights: the GEMMs' width (larger tiles, a larger share of tensor-core time)
    K * H * I  routed work per token: the GPU's work against the host path's fixed cost of a call

The measured shapes (``FP8_FASTER_SHAPES``) are the minimal ones: every other shape measured faster is at least as
favourable as one of them. An unmeasured shape gets BF16 unless it dominates a measured one; it never gets FP8 by
interpolation. The evidence and the points that decided the table: docs/moe_fp8.md ("Which layer runs: FP8 where
it pays"); ``python -m tools.fp8_choice_fit REPORT.json ...`` refits it from ``detkit bench moe --sweep`` reports.

The timed layer quantizes its weights in every call (the bench's ``fp8`` rows): a cached quantization
(``Fp8WeightCache`` hit) only makes FP8 faster, so a shape given FP8 here stays at least as fast with it. The
interpreter takes sm_90's table (its wall time says nothing about speed), so CI runs the choice a GPU makes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from detkit.kernels.backend import BACKENDS, CUDA_SM90, TRITON_INTERPRETER
from detkit.kernels.moe.checks import check_wgrad_mode
from detkit.kernels.moe.configs import DEFAULT_WGRAD

FP8_CHOICE_TABLE_VERSION = "2026-12-06.1"
MIN_T = 2048  # the claim covers T >= MIN_T; the ratio mostly rises with T, so a shape needs MIN_T measured


@dataclass(frozen=True)
class MeasuredShape:
    """A shape where the FP8 layer's forward+backward was faster than the BF16 layer's at every T >= MIN_T measured,
    eager and as a CUDA graph, with the worst ratio and where it was."""

    hidden: int
    inter: int
    experts: int
    top_k: int
    worst: float  # the lowest BF16 median / FP8 median over the measured T and both timings
    worst_at: str
    evidence: str

    def dominated_by(self, hidden: int, inter: int, experts: int, top_k: int) -> list[str]:
        """The quantities in which (hidden, inter, experts, top_k) is less favourable than this shape (empty: it is at
        least as favourable in all three). Integer cross-multiplication: exact."""
        shortfalls = []
        if top_k * self.experts < self.top_k * experts:
            shortfalls.append(f"K/E {top_k}/{experts} < {self.top_k}/{self.experts}")
        if hidden * inter < self.hidden * self.inter:
            shortfalls.append(f"H*I {hidden}*{inter} < {self.hidden}*{self.inter}")
        if top_k * hidden * inter < self.top_k * self.hidden * self.inter:
            shortfalls.append(f"K*H*I {top_k}*{hidden}*{inter} < {self.top_k}*{self.hidden}*{self.inter}")
        return shortfalls

    def label(self) -> str:
        return f"H={self.hidden}, I={self.inter}, E={self.experts}, K={self.top_k}"


S24_SWEEP_3072 = "reports/2026-12-03-h200-s24/call1/sweep-3072 (H200, T 2048/8192/16384)"

# (backend, wgrad) -> the minimal shapes measured faster. sm_90 with FP8 weight gradients: of the 24 swept shapes
# (E 8/32/64/128 x K 2/4/8 x H*I 3072*1536, 2048*768), FP8 held >= 1.0x at every T only at 3072x1536 with E=8 and
# K=4 or 8; E=8, K=8 dominates E=8, K=4, so one shape decides. FP8 with BF16 weight gradients was not swept: BF16.
_SM90_FP8_WGRAD = (MeasuredShape(3072, 1536, 8, 4, 1.008, "T=2048 eager", S24_SWEEP_3072),)
FP8_FASTER_SHAPES: dict[tuple[str, str], tuple[MeasuredShape, ...]] = {
    (CUDA_SM90, "fp8"): _SM90_FP8_WGRAD,
    (CUDA_SM90, "bf16"): (),
    (TRITON_INTERPRETER, "fp8"): _SM90_FP8_WGRAD,
    (TRITON_INTERPRETER, "bf16"): (),
}


@dataclass(frozen=True)
class Fp8Choice:
    """The layer a shape asked to run in FP8 gets ("fp8" or "bf16") and why, in one line."""

    layer: str
    reason: str


def _check_dim(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1; got {value}")


@functools.lru_cache(maxsize=256, typed=True)  # typed: True is refused, 1 is not
def fp8_choice(hidden: int, inter: int, experts: int, top_k: int, backend: str,
               wgrad: str = DEFAULT_WGRAD) -> Fp8Choice:
    """The layer for an FP8 request at hidden H, expert intermediate I, E experts, top-K routing on ``backend`` with
    weight gradients ``wgrad`` (module docstring). Takes no T: the choice cannot depend on the batch."""
    for name, value in (("hidden", hidden), ("inter", inter), ("experts", experts), ("top_k", top_k)):
        _check_dim(name, value)
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not supported; supported: {', '.join(map(repr, BACKENDS))}")
    check_wgrad_mode(wgrad)
    measured = FP8_FASTER_SHAPES[(backend, wgrad)]
    if not measured:
        return Fp8Choice("bf16", f"FP8 with wgrad={wgrad!r} was not measured faster on {backend} at any shape")
    shortfalls = [m.dominated_by(hidden, inter, experts, top_k) for m in measured]
    for m, short in zip(measured, shortfalls):
        if not short:
            return Fp8Choice("fp8", f"at least as favourable as {m.label()} (FP8 faster at every T >= {MIN_T}; "
                                    f"worst {m.worst:.3f}x at {m.worst_at})")
    nearest = min(range(len(measured)), key=lambda j: len(shortfalls[j]))
    return Fp8Choice("bf16", f"{', '.join(shortfalls[nearest])} (FP8 is faster at every T >= {MIN_T} "
                             f"from {measured[nearest].label()})")


__all__ = ["FP8_CHOICE_TABLE_VERSION", "FP8_FASTER_SHAPES", "Fp8Choice", "MIN_T", "MeasuredShape", "fp8_choice"]
