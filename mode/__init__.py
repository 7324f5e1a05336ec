"""detkit mode: one switch (``batch_invariant_mode``) that puts a PyTorch / transformers model on detkit's kernels.

An integration layer above every kernel family: it imports detkit.kernels, and nothing in detkit.kernels imports
it. Inside, one module per route family and the switch with its state:
- ``switch``: enter / exit, re-entrancy, the public calls below;
- ``state``: the process-wide state, counters and the strict refusal;
- ``aten``: the aten overrides that dispatch mm / addmm / bmm / baddbmm / mean.dim / _grouped_mm to the routes;
- ``gemm``: the GEMM route (operand layout -> det_gemm fwd / dA / dB, launch plans, refusal reasons);
- ``grouped``: the grouped GEMM route (``_grouped_mm`` -> detkit.kernels.grouped);
- ``reductions``: the mean.dim route onto detkit.kernels.reductions;
- ``norms``: transformers' RMSNorm forwards as one fused kernel where no gradient is needed (speed only: the bits of
  their own forward under the mode);
- ``rotary``: transformers' ``apply_rotary_pos_emb`` as one fused kernel where no gradient is needed (speed only);
- ``bytecode``: what ``norms`` and ``rotary`` share (which transformers functions compute what detkit's copies of
  them compute; the model modules imported since; suspending their swaps);
- ``attention``: torch SDPA and transformers' attention onto detkit.kernels.attention;
- ``moe``: the Qwen3-MoE router route and the fused-layer math (detkit.kernels.moe) of transformers' experts;
- ``experts``: every transformers experts class (its ExpertsInterface: "detkit", "detkit_fp8") onto the fused layer
  or detkit.kernels.grouped;
- ``paged_attention``: transformers' continuous batching (its paged KV cache) onto the packed-sequence kernel;
- ``compile``: the Inductor graph pass that puts compiled graphs on the same routes.
- ``parallel``: a TP / DP model's Linear and RMSNorm reductions on parallelism-invariant routes (``prepare``,
  ``reduce_gradients``; docs/mode_parallel.md).
docs/mode.md says what is routed and why.
"""

from detkit.mode.state import ModeCounters, ModeNotRoutedError
from detkit.mode.switch import (
    batch_invariant_mode, disable_batch_invariant_mode, enable_batch_invariant_mode, is_batch_invariant_mode_enabled,
    mode_counters, refresh_fp8_weights, reset_mode_counters,
)

__all__ = ["batch_invariant_mode", "enable_batch_invariant_mode", "disable_batch_invariant_mode",
           "is_batch_invariant_mode_enabled", "mode_counters", "reset_mode_counters", "refresh_fp8_weights",
           "ModeCounters", "ModeNotRoutedError"]
