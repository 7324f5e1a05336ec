"""The batch-invariant mode's MoE routing: transformers' Qwen3-MoE router, and the fused-layer math every decorated
experts class with the fused layout runs on (``detkit.mode.experts`` routes the experts classes).

transformers' block (``Qwen3MoeSparseMoeBlock``) is ``experts(x, *gate(x)[1:])`` over the tokens [T, H]:

    gate (Qwen3MoeTopKRouter):  logits = x @ W_gate.T  (BF16, [T, E])
                                probs  = softmax(logits) in FP32;  top, ids = topk(probs, K)  (row-wise)
                                top   /= top.sum(-1)  when config.norm_topk_prob;  scores = bf16(top)
    experts (Qwen3MoeExperts):  gate_up_proj [E, 2I, H] (rows [gate; up], split halves), down_proj [E, H, I]
                                out[t] = sum_k scores[t, k] * down(silu(gate) * up)  for expert ids[t, k]

While the mode is entered the router's ``forward`` is replaced (a class attribute; the module, its parameters and
state dict are untouched), so every Qwen3-MoE model in the process is covered and the module calls -- and the
forward hooks on them, which transformers' ``output_router_logits`` recorder uses -- happen as before:

- the router (``router_route``): the same ops, with the top-k normalisation summed in a fixed order
  (ascending k, elementwise adds) instead of torch's row reduction, whose order may depend on the number of
  rows on CUDA (the reduction config is picked from the output count). The linear is an aten mm the mode
  already routes to det_gemm; softmax over the last dim and topk are row-wise in torch (one row per
  warp/block, a launch shape from the row length; topk's ties go to the lower index in the row), so a
  token's ids and scores do not depend on the batch. Counted as ``moe router (transformers)``.
- the experts: ``detkit.mode.experts`` (transformers' ExpertsInterface) runs them, like every decorated experts
  class, with ``experts_forward`` here -- ``detkit.kernels.moe.layer.moe_mlp`` (BF16, the default) -- or, with the
  mode's ``moe_experts="fp8"``, ``experts_forward_fp8`` (``detkit.kernels.moe.fp8.layer.moe_mlp_fp8``; forward and
  backward, the layer's own autograd), both with w1 = gate_up_proj viewed as [E, H, 2I] with ``gate_up="split"`` and
  w2 = down_proj viewed as [E, I, H] (``layer_weights``; a class that stores them transposed passes them as they
  are): no copy; the layers read the split halves as interleaved pairs (the same bits as on an interleaved copy; FP8:
  the weight quantizer reads them so) and write dW1, dW2 in the parameters' own layouts, so autograd keeps them as
  .grad without a copy. Route ids >= E (transformers' expert-parallel sentinel) are masked (-1). Counted as
  ``moe experts (transformers) -> detkit.moe_mlp`` or ``-> detkit.moe_mlp_fp8``.
- FP8 where it pays: with the mode's ``fp8_shapes="faster"`` (the default) ``moe_experts="fp8"`` runs the FP8 layer
  only where ``fp8_choice`` (``detkit.kernels.moe.fp8.choice``: the layer's H, I, E, K and the backend, never T or
  the routing) says it was measured faster than the BF16 layer; elsewhere ``experts_forward`` (the BF16 layer's
  bits), counted as ``-> detkit.moe_mlp (fp8 -> bf16, FP8 slower at H=.., I=.., E=.., K=..: why)``.
  ``fp8_shapes="all"`` runs the FP8 layer at every shape it takes.
- FP8 weights: the layer quantizes w1 and w2 in 128x128 blocks. The mode keeps its own ``fp8_weight_cache()``
  (sized for a model's MoE layers, apart from the layer's default cache), keyed on the parameters themselves
  (gate_up_proj, down_proj) and valid for their ``_version``: an optimizer step (in place) invalidates the entry, and the next call re-quantizes from the
  new values. While a CUDA graph is being captured the weights are quantized inside the graph (no cache), so a
  replay after a weight update reads the new weights; with ``batch_invariant_mode(fp8_graph_weights="static")`` the
  graph reads the cache's buffers instead (a warm-up call must have filled them), and ``refresh_fp8_weights()``
  re-quantizes them in place after an update, before the next replay.

Under torch.compile the routes run as graph breaks (eagerly, with the same kernels and counting).
transformers' load-balancing loss is computed outside the block from the recorded router logits, as
transformers does. Other families' routers run as transformers wrote them (their linears on the mode's aten routes).
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from detkit.mode import state as mode_state

EXPERTS_OP = "moe experts (transformers)"
ROUTER_OP = "moe router (transformers)"
EXPERTS_KERNEL = "detkit.moe_mlp"
EXPERTS_KERNEL_FP8 = "detkit.moe_mlp_fp8"
EXPERTS_KERNELS = {"bf16": EXPERTS_KERNEL, "fp8": EXPERTS_KERNEL_FP8}  # the mode's moe_experts -> counted kernel
EXPERTS_KERNEL_FP8_AS_BF16 = "detkit.moe_mlp (fp8 -> bf16, FP8 slower at {shape}: {why})"  # fp8_shapes="faster"
FP8_BLOCK = 128  # the FP8 layer's quantization block: H and I must be multiples of it
ROUTER_KERNEL = "row-wise softmax/top-k, fixed-order top-k sum"
QWEN3_MOE_MODULE = "transformers.models.qwen3_moe.modeling_qwen3_moe"

_saved: dict[str, object] = {}  # "router" -> the class's forward before install


# ---------------------------------------------------------------------------------------------
# The math (usable on its own; the routes below add the mode's checks and counting)
# ---------------------------------------------------------------------------------------------
def gate_up_as_w1(gate_up_proj: torch.Tensor) -> torch.Tensor:
    """transformers' gate_up_proj [E, 2I, H] (rows [gate; up]) -> the layer's w1 [E, H, 2I], gate/up interleaved
    (column 2j = gate_j, 2j+1 = up_j): ``interleave_gate_up(gate_up_proj, dim=1).transpose(1, 2)``. One copy,
    differentiable (the gradient comes back in gate_up_proj's layout)."""
    experts, two_i, hidden = gate_up_proj.shape
    pairs = gate_up_proj.view(experts, 2, two_i // 2, hidden).transpose(1, 2)  # [E, I, 2, H]
    return pairs.reshape(experts, two_i, hidden).transpose(1, 2)


def down_as_w2(down_proj: torch.Tensor) -> torch.Tensor:
    """transformers' down_proj [E, H, I] -> the layer's w2 [E, I, H] (a view)."""
    return down_proj.transpose(1, 2)


def layer_weights(module) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1 [E, H, 2I], w2 [E, I, H]): views of a decorated experts class's gate_up_proj and down_proj in the layer's
    convention, no copy -- ``.transpose(1, 2)`` of transformers' [E, 2I, H], [E, H, I], or the parameters themselves
    when the class stores them transposed (``is_transposed``: [E, H, 2I], [E, I, H]). w1's columns are [gate | up]
    (``gate_up="split"``)."""
    if getattr(module, "is_transposed", False):
        return module.gate_up_proj, module.down_proj
    return module.gate_up_proj.transpose(1, 2), down_as_w2(module.down_proj)


def route_ids(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """transformers' expert ids [T, K] (int64; ids >= E are expert-parallel sentinels) -> int32, -1 masked."""
    ids = top_k_index.to(torch.int32)
    return ids.masked_fill(ids >= num_experts, -1)


def experts_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """A decorated experts class's forward on ``moe_mlp`` (the fused layout: ``detkit.mode.experts.layout_reason``
    None): hidden [T, H] bf16, ids [T, K], weights [T, K] -> [T, H] bf16."""
    from detkit.kernels.moe.layer import moe_mlp

    ids = route_ids(top_k_index, module.num_experts)
    w1, w2 = layer_weights(module)
    return moe_mlp(hidden_states, w1, w2, ids, top_k_weights, gate_up="split")


def fixed_order_sum(values: torch.Tensor) -> torch.Tensor:
    """values [T, K] -> [T, 1]: ((v0 + v1) + v2) + ..., elementwise adds, so a row's bits depend on its K values
    alone."""
    total = values[:, :1]
    for k in range(1, values.shape[1]):
        total = total + values[:, k:k + 1]
    return total


def router_forward(module, hidden_states: torch.Tensor):
    """Qwen3MoeTopKRouter.forward with the top-k normalisation in a fixed order: (logits, scores, ids)."""
    hidden_states = hidden_states.reshape(-1, module.hidden_dim)
    router_logits = F.linear(hidden_states, module.weight)  # [T, E]
    router_probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    top, ids = torch.topk(router_probs, module.top_k, dim=-1)  # [T, K]
    if module.norm_topk_prob:
        top = top / fixed_order_sum(top)
    return router_logits, top.to(router_logits.dtype), ids


# ---------------------------------------------------------------------------------------------
# FP8 experts: the same w1, w2 and ids on moe_mlp_fp8, with the weights cached per parameter
# ---------------------------------------------------------------------------------------------
@functools.cache
def fp8_weight_cache():
    """The FP8 experts' quantized weights: an ``Fp8WeightCache`` whose slots are keyed on the parameters
    (gate_up_proj, down_proj; w1, w2 are views made on every call) and valid for their ``_version``; 256 slots,
    two per MoE layer. Built on first use (importing the FP8 layer imports its kernels)."""
    from detkit.kernels.moe.fp8.layer import Fp8WeightCache

    return Fp8WeightCache(capacity=256)


@functools.cache
def _call_weights_class() -> type:
    """``CallWeights(cache, sources)``: the ``weight_cache`` of one ``moe_mlp_fp8`` call. The layer's lookup of
    w1 or w2 (the tensors it was given, by identity) answers from ``cache``'s slot of the parameter each was made
    from, where the layer asks: after its input checks."""
    from detkit.kernels.moe.fp8.layer import Fp8WeightCache

    class CallWeights(Fp8WeightCache):
        def __init__(self, cache: Fp8WeightCache, sources: tuple[tuple[torch.Tensor, torch.Tensor, str], ...],
                     for_graph: bool = False):
            super().__init__(capacity=len(sources))
            self.cache, self.sources = cache, sources
            # For a graph: every weight's static slot taken now, so a missing one refuses the call before any work.
            self.static = [cache.get_for_graph(w, source=p, gate_up=g) for w, p, g in sources] if for_graph else None

        def get(self, w, source=None, gate_up="interleaved"):
            for i, (weight, parameter, _) in enumerate(self.sources):
                if w is weight:
                    return self.static[i] if self.static is not None else self.cache.get(w, parameter, gate_up)
            raise RuntimeError("the FP8 layer asked for a weight this call did not hand it")

    return CallWeights


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def experts_forward_fp8(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        cached: bool = True) -> torch.Tensor:
    """A decorated experts class's forward on ``moe_mlp_fp8`` (the same w1, w2 and ids as ``experts_forward``; H and I
    multiples of 128): hidden [T, H] bf16 -> [T, H] bf16. The weights come from ``fp8_weight_cache()``;
    ``cached=False`` quantizes them in the call. While a CUDA graph is captured: quantized in the graph, or with
    ``fp8_graph_weights="static"`` the cache's buffers, which must hold the current weights (a warm-up call)."""
    from detkit.kernels.moe.fp8.layer import moe_mlp_fp8

    ids = route_ids(top_k_index, module.num_experts)
    w1, w2 = layer_weights(module)
    sources = ((w1, module.gate_up_proj, "split"), (w2, module.down_proj, "interleaved"))
    weight_cache = None
    if not _capturing(hidden_states):
        if cached:
            weight_cache = _call_weights_class()(fp8_weight_cache(), sources)
    elif mode_state.fp8_graph_weights() == "static":
        weight_cache = _call_weights_class()(fp8_weight_cache(), sources, for_graph=True)
    return moe_mlp_fp8(hidden_states, w1, w2, ids, top_k_weights, weight_cache=weight_cache, gate_up="split")


def fp8_layer_shape(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> tuple[int, int, int, int]:
    """(H, I, E, K) of a decorated experts class's call: K is the routing tensor's width (the model's top-k)."""
    inter = module.down_proj.shape[1 if getattr(module, "is_transposed", False) else 2]
    return hidden_states.shape[1], inter, module.num_experts, top_k_index.shape[1]


def fp8_choice(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor):
    """The layer ``moe_experts="fp8"`` runs a decorated experts class on with ``fp8_shapes="faster"``: the
    ``Fp8Choice`` of its (H, I, E, K) and backend, for a call the route has checked (H and I multiples of 128, a
    device detkit runs on). Never T: a model runs one layer at every batch size, so a sequence's bits do not change
    with its batch."""
    from detkit.kernels.backend import CUDA_SM90, TRITON_INTERPRETER
    from detkit.kernels.moe.fp8.choice import fp8_choice as choice_of_shape

    backend = CUDA_SM90 if hidden_states.is_cuda else TRITON_INTERPRETER  # the device check passed: one of the two
    return choice_of_shape(*fp8_layer_shape(module, hidden_states, top_k_index), backend)


def fp8_as_bf16_kernel(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, reason: str) -> str:
    """The counted kernel of an FP8 request the choice gave to the BF16 layer: which shape and why."""
    h, i, e, k = fp8_layer_shape(module, hidden_states, top_k_index)
    return EXPERTS_KERNEL_FP8_AS_BF16.format(shape=f"H={h}, I={i}, E={e}, K={k}", why=reason)


# ---------------------------------------------------------------------------------------------
# The router route (a class forward while the mode is entered)
# ---------------------------------------------------------------------------------------------
@torch._dynamo.disable
def router_route(self, hidden_states):
    """Qwen3MoeTopKRouter.forward while the mode is entered."""
    if not mode_state.active():
        return _saved["router"](self, hidden_states)
    out = router_forward(self, hidden_states)
    mode_state.routed(ROUTER_OP, ROUTER_KERNEL)
    return out


def install() -> None:
    """Replace the Qwen3-MoE router's forward (only when transformers is imported: a model can only be built after
    it is; importing its Qwen3-MoE module is then cheap). The experts are routed by ``detkit.mode.experts``."""
    if "transformers" not in sys.modules or _saved:
        return
    import importlib

    module = importlib.import_module(QWEN3_MOE_MODULE)
    _saved["router"] = module.Qwen3MoeTopKRouter.forward
    module.Qwen3MoeTopKRouter.forward = router_route


def uninstall() -> None:
    if not _saved:
        return
    module = sys.modules[QWEN3_MOE_MODULE]
    module.Qwen3MoeTopKRouter.forward = _saved["router"]
    _saved.clear()


def installed() -> bool:
    return bool(_saved)
