"""detkit's batch-invariant mode: one switch that puts a PyTorch model -- forward and backward, eager
and compiled -- on detkit's kernels.

    with detkit.batch_invariant_mode():          # or @detkit.batch_invariant_mode()
        logits = model(input_ids).logits         # every BF16 mm/addmm/bmm on det_gemm
        loss.backward()                          # grad_input / grad_weight GEMMs too

What it routes while entered (process-wide, every thread; docs/mode.md):
- aten mm / addmm / bmm / baddbmm on BF16 tensors (CUDA sm_90, or CPU under TRITON_INTERPRET=1) ->
  det_gemm, by operand layout to fwd / dA / dB (``gemm``); so nn.Linear, F.linear,
  torch.matmul and ``@``, forward and backward.
- aten _grouped_mm (torch._grouped_mm, F.grouped_mm: transformers' "grouped_mm" MoE experts, forward and
  backward) -> detkit.kernels.grouped (``grouped``).
- aten mean.dim over the last dim (RMSNorm's variance) -> a fixed-order row mean
  (``reductions``, on
  detkit.kernels.reductions: torch's CUDA reduction changes its order with the row count).
- compiled graphs: an Inductor post-grad pass puts the same ops on detkit's custom ops
  (``compile``), whose kernels and configs are chosen at run time from the actual shapes.
- attention: F.scaled_dot_product_attention and transformers' "sdpa" attention go to
  ``detkit.kernels.attention`` when it covers the call (``attention``); "detkit" is registered
  as a transformers attention implementation.
- transformers' experts classes (every class its ``use_experts_implementation`` decorator built, through its
  ExpertsInterface, ``experts``): detkit's fused MoE layer -- ``moe_mlp`` (BF16, the default) or, with
  ``moe_experts="fp8"``, ``moe_mlp_fp8`` -- where it covers the layout, else (BF16) the GEMMs on detkit's grouped
  kernels with the gate elementwise; "detkit" and "detkit_fp8" are registered as experts implementations. The
  Qwen3-MoE router's top-k normalisation in a fixed order (``moe``). Parameters and state dicts unchanged.
- transformers' RMSNorm classes (those whose forward is Llama's, OLMo-2's or Gemma's, op for op): one fused kernel
  with the bits of their own forward under the mode, where no gradient is needed (``norms``; speed only); likewise
  their Llama-form ``apply_rotary_pos_emb`` (``rotary``).

Everything it does not route is counted with the reason (``mode_counters()``); with
``strict=True`` such a call raises ``ModeNotRoutedError`` instead. Never a silent fallback.

Re-entrant: a depth counter; the outermost entry installs the overrides, the matching exit removes
them (so outside the mode torch runs untouched). ``strict`` holds while any enclosing entry asked for it;
``moe_experts``, ``fp8_graph_weights`` and ``fp8_shapes`` are the innermost entry's explicit choices (None keeps the
enclosing one; "bf16", "quantize" and "faster" outermost).
Backward passes must run inside the mode too (they call the same aten ops).
"""

from __future__ import annotations

import contextlib
import logging
import threading

from detkit.mode import state as mode_state
from detkit.mode.state import (
    FP8_GRAPH_WEIGHTS, FP8_SHAPES, MOE_EXPERTS, ModeCounters, ModeNotRoutedError, check_choice, check_moe_experts,
)

__all__ = [
    "FP8_GRAPH_WEIGHTS", "FP8_SHAPES", "MOE_EXPERTS", "ModeCounters", "ModeNotRoutedError", "batch_invariant_mode",
    "disable_batch_invariant_mode", "enable_batch_invariant_mode", "is_batch_invariant_mode_enabled", "mode_counters",
    "refresh_fp8_weights", "reset_mode_counters",
]

log = logging.getLogger(__name__)
_TRANSITION = threading.RLock()


def _install() -> None:
    from detkit.mode import aten as mode_aten
    from detkit.mode import attention as mode_attention
    from detkit.mode import compile as mode_compile
    from detkit.mode import experts as mode_experts
    from detkit.mode import moe as mode_moe
    from detkit.mode import norms as mode_norms
    from detkit.mode import rotary as mode_rotary

    mode_aten.install()
    mode_compile.install()
    mode_attention.install()
    mode_moe.install()
    mode_experts.install()
    mode_norms.install()
    mode_rotary.install()


def _uninstall() -> None:
    from detkit.mode import aten as mode_aten
    from detkit.mode import attention as mode_attention
    from detkit.mode import compile as mode_compile
    from detkit.mode import experts as mode_experts
    from detkit.mode import moe as mode_moe
    from detkit.mode import norms as mode_norms
    from detkit.mode import rotary as mode_rotary

    mode_rotary.uninstall()
    mode_norms.uninstall()
    mode_experts.uninstall()
    mode_moe.uninstall()
    mode_attention.uninstall()
    mode_compile.uninstall()
    mode_aten.uninstall()


def _check_args(strict, moe_experts, fp8_graph_weights, fp8_shapes) -> None:
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool; got {type(strict).__name__}")
    check_moe_experts(moe_experts)
    check_choice("fp8_graph_weights", fp8_graph_weights, FP8_GRAPH_WEIGHTS)
    check_choice("fp8_shapes", fp8_shapes, FP8_SHAPES)


def enable_batch_invariant_mode(strict: bool = False, moe_experts: str | None = None,
                                fp8_graph_weights: str | None = None, fp8_shapes: str | None = None) -> None:
    """Enter the mode (process-wide); pair each call with ``disable_batch_invariant_mode()``. ``moe_experts``:
    "bf16" or "fp8"; ``fp8_graph_weights``: "quantize" or "static"; ``fp8_shapes``: "faster" or "all" (see
    ``batch_invariant_mode``)."""
    _check_args(strict, moe_experts, fp8_graph_weights, fp8_shapes)
    with _TRANSITION:
        if mode_state.STATE.depth == 0:
            _install()
        mode_state.STATE.strict_stack.append(strict)
        mode_state.STATE.experts_stack.append(moe_experts)
        mode_state.STATE.graph_weights_stack.append(fp8_graph_weights)
        mode_state.STATE.shapes_stack.append(fp8_shapes)
        mode_state.STATE.depth += 1


def disable_batch_invariant_mode() -> None:
    """Leave the innermost entry; the outermost exit restores torch's kernels."""
    with _TRANSITION:
        if mode_state.STATE.depth == 0:
            raise RuntimeError("disable_batch_invariant_mode() called while the mode is not enabled")
        mode_state.STATE.depth -= 1
        mode_state.STATE.strict_stack.pop()
        mode_state.STATE.experts_stack.pop()
        mode_state.STATE.graph_weights_stack.pop()
        mode_state.STATE.shapes_stack.pop()
        if mode_state.STATE.depth == 0:
            _uninstall()


def is_batch_invariant_mode_enabled() -> bool:
    return mode_state.active()


class batch_invariant_mode(contextlib.ContextDecorator):
    """Context manager and decorator for the batch-invariant mode; re-entrant (see the module docstring).

    ``strict=True``: a call the mode cannot run on detkit's kernels raises ``ModeNotRoutedError``
    (before any work) instead of running on torch's kernel and being counted.

    ``moe_experts``: the layer transformers' Qwen3-MoE experts run on -- "bf16" (``moe_mlp``, the default) or
    "fp8" (``moe_mlp_fp8``: block-scaled E4M3, H and I multiples of 128; a block that does not meet that runs
    transformers' own experts, counted, or raises under strict -- never the BF16 layer instead; where FP8 is slower,
    the BF16 layer by ``fp8_shapes``). None keeps the
    enclosing entry's choice. Anything else: ValueError before the mode is entered.

    ``fp8_graph_weights``: how FP8 experts get their quantized weights while a CUDA graph is captured --
    "quantize" (the default: quantized inside the graph, so every replay reads the weights as they are then) or
    "static" (the graph reads the weights the mode quantized outside it, which a warm-up call must have done; after
    a weight update call ``refresh_fp8_weights()`` before the next replay, which otherwise reads the old weights).
    None keeps the enclosing entry's choice.

    ``fp8_shapes``: where ``moe_experts="fp8"`` runs the FP8 layer -- "faster" (the default: at the shapes (H, I, E, K)
    where it was measured faster than the BF16 layer at every T >= 2048, kernels/moe/fp8/choice.py; elsewhere the BF16
    layer, counted as ``detkit.moe_mlp (fp8 -> bf16, ...)``; the choice reads no T, so a model runs one layer at every
    batch size) or "all" (the FP8 layer at every shape it takes). None keeps the enclosing entry's choice."""

    def __init__(self, strict: bool = False, moe_experts: str | None = None, fp8_graph_weights: str | None = None,
                 fp8_shapes: str | None = None):
        _check_args(strict, moe_experts, fp8_graph_weights, fp8_shapes)
        self.strict = strict
        self.moe_experts = moe_experts
        self.fp8_graph_weights = fp8_graph_weights
        self.fp8_shapes = fp8_shapes

    def __enter__(self) -> "batch_invariant_mode":
        enable_batch_invariant_mode(self.strict, self.moe_experts, self.fp8_graph_weights, self.fp8_shapes)
        return self

    def __exit__(self, *exc) -> bool:
        disable_batch_invariant_mode()
        return False


def refresh_fp8_weights() -> int:
    """Re-quantize, in place, the mode's FP8 expert weights that CUDA graphs captured with
    ``fp8_graph_weights="static"`` read and whose parameters changed since (an optimizer step, load_state_dict);
    returns how many. Call after each weight update, before replaying those graphs."""
    from detkit.mode import moe as mode_moe

    return mode_moe.fp8_weight_cache().refresh()


def mode_counters() -> ModeCounters:
    """Calls routed per (op, kernel) and not routed per (op, reason) since the last reset."""
    return mode_state.counters()


def reset_mode_counters() -> None:
    mode_state.reset_counters()
