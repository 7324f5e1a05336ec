"""The batch-invariant mode's process-wide state: how deep it is entered, whether it is strict, and the
counters of what it routed and what it did not, and the precision of the MoE experts it routes.

Every routing point (the aten overrides, the compiled-graph ops, the attention routes) asks
``active()`` and reports each call with ``routed(op, kernel)`` or ``not_routed(op, reason)``. A call
that is not routed is never silent: it is counted with its reason, and under ``strict`` it raises
``ModeNotRoutedError`` before any work. No torch state lives here, so importing it costs nothing.
The eager per-call paths (``mode_gemm``'s plans) add to ``STATE.routed`` under ``STATE.lock`` themselves, with
the ``(op, kernel)`` key made once per plan: the same count, without a call and a key per GEMM.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field


# The MoE experts' precision (``batch_invariant_mode(moe_experts=...)``): the layer the mode runs transformers'
# Qwen3-MoE experts on. None on an entry keeps the enclosing entry's choice; the outermost default is the first.
MOE_EXPERTS = ("bf16", "fp8")


def check_moe_experts(value) -> None:
    """Refuses anything but None or one of ``MOE_EXPERTS`` (one line, before the mode is entered)."""
    check_choice("moe_experts", value, MOE_EXPERTS)


# How the FP8 experts get their weights inside a CUDA graph being captured (``batch_invariant_mode(
# fp8_graph_weights=...)``): "quantize" (the default) quantizes them in the graph, so every replay reads the weights
# as they are then; "static" reads the mode's cached quantized weights, which ``refresh_fp8_weights()`` must
# re-quantize after a weight update before a replay. None on an entry keeps the enclosing entry's choice.
FP8_GRAPH_WEIGHTS = ("quantize", "static")

# Where moe_experts="fp8" runs the FP8 layer (``batch_invariant_mode(fp8_shapes=...)``): "faster" (the default) at the
# shapes where it was measured faster than the BF16 layer (kernels/moe/fp8/choice.py; the BF16 layer elsewhere, counted
# as such), "all" at every shape it takes (its numerics whatever the speed). None keeps the enclosing entry's choice.
FP8_SHAPES = ("faster", "all")


def check_choice(name: str, value, supported: tuple[str, ...]) -> None:
    """Refuses anything but None or one of ``supported`` (one line, before the mode is entered)."""
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {supported}, or None; got {type(value).__name__}")
    if value not in supported:
        raise ValueError(f"{name} {value!r} is not supported; supported: {', '.join(map(repr, supported))} "
                         "(None: the enclosing entry's)")


class ModeNotRoutedError(RuntimeError):
    """A call inside a strict batch-invariant mode that detkit cannot run on its own kernels."""


@dataclass
class _State:
    depth: int = 0
    strict_stack: list[bool] = field(default_factory=list)
    experts_stack: list[str | None] = field(default_factory=list)  # each entry's moe_experts
    graph_weights_stack: list[str | None] = field(default_factory=list)  # each entry's fp8_graph_weights
    shapes_stack: list[str | None] = field(default_factory=list)  # each entry's fp8_shapes
    routed: Counter = field(default_factory=Counter)  # (op, kernel) -> calls
    not_routed: Counter = field(default_factory=Counter)  # (op, reason) -> calls
    lock: threading.Lock = field(default_factory=threading.Lock)


STATE = _State()


def active() -> bool:
    """True while the mode is entered anywhere in the process (autograd's worker threads included)."""
    return STATE.depth > 0


def strict() -> bool:
    """True when any enclosing entry asked for ``strict``."""
    return any(STATE.strict_stack)


def moe_experts() -> str:
    """The innermost entry's explicit ``moe_experts``, else the default ("bf16")."""
    return next((v for v in reversed(STATE.experts_stack) if v is not None), MOE_EXPERTS[0])


def fp8_graph_weights() -> str:
    """The innermost entry's explicit ``fp8_graph_weights``, else the default ("quantize")."""
    return next((v for v in reversed(STATE.graph_weights_stack) if v is not None), FP8_GRAPH_WEIGHTS[0])


def fp8_shapes() -> str:
    """The innermost entry's explicit ``fp8_shapes``, else the default ("faster")."""
    return next((v for v in reversed(STATE.shapes_stack) if v is not None), FP8_SHAPES[0])


def routed(op: str, kernel: str, calls: int = 1) -> None:
    with STATE.lock:
        STATE.routed[(op, kernel)] += calls


def counted_launch(launch, op: str, kernel: str):
    """``launch`` counted as routed to ``kernel`` at each call: a plan's per-call path, its key made once."""
    counted = (op, kernel)

    def plan(*args):
        out = launch(*args)
        with STATE.lock:
            STATE.routed[counted] += 1
        return out
    return plan


def not_routed(op: str, reason: str) -> None:
    """Count a call that runs on torch's kernel; under ``strict``, raise instead (before any work)."""
    if strict():
        raise ModeNotRoutedError(f"batch_invariant_mode(strict=True): {op} cannot run on a detkit kernel: {reason}")
    with STATE.lock:
        STATE.not_routed[(op, reason)] += 1


@dataclass(frozen=True)
class ModeCounters:
    """A snapshot of the counters: ``routed[(op, kernel)]`` and ``not_routed[(op, reason)]`` call counts."""

    routed: dict[tuple[str, str], int]
    not_routed: dict[tuple[str, str], int]

    def as_dict(self) -> dict:
        """JSON-friendly: ``{"routed": {"op -> kernel": n}, "not_routed": {"op: reason": n}}``."""
        return {"routed": {f"{op} -> {kernel}": n for (op, kernel), n in sorted(self.routed.items())},
                "not_routed": {f"{op}: {reason}": n for (op, reason), n in sorted(self.not_routed.items())}}

    def routed_ops(self) -> set[str]:
        return {op for op, _ in self.routed}

    def not_routed_ops(self) -> set[str]:
        return {op for op, _ in self.not_routed}

    def __sub__(self, before: "ModeCounters") -> "ModeCounters":
        """The calls counted since ``before`` was taken."""
        def diff(now: dict, then: dict) -> dict:
            return {k: n - then.get(k, 0) for k, n in now.items() if n - then.get(k, 0)}
        return ModeCounters(diff(self.routed, before.routed), diff(self.not_routed, before.not_routed))


def counters() -> ModeCounters:
    with STATE.lock:
        return ModeCounters(dict(STATE.routed), dict(STATE.not_routed))


def reset_counters() -> None:
    with STATE.lock:
        STATE.routed.clear()
        STATE.not_routed.clear()
