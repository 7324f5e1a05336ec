"""The batch-invariant mode's experts routing: every experts class transformers' ``use_experts_implementation``
decorator built, on detkit's kernels, through transformers' own extension point (its ``ExpertsInterface``).

The decorator replaces an experts class's ``forward`` with a dispatch on ``self.config._experts_implementation``
("eager", "grouped_mm", "batched_mm", ... or None for a module built outside a model) through the interface's
mapping. ``register_transformers_experts()`` registers two implementations there:

- ``"detkit"`` (``detkit_experts``): BF16. detkit's fused MoE layer (``moe_mlp``: gather, up + gate, down, combine,
  forward and backward) where it computes the class's math, else the class's GEMMs on detkit's grouped kernels with
  its gate elementwise (``grouped_experts_forward``); anything else raises NotImplementedError, never torch.
- ``"detkit_fp8"`` (``detkit_fp8_experts``): the FP8 layer (``moe_mlp_fp8``, H and I multiples of 128) where the
  fused layer covers the class; anything else raises. Like ``moe_experts="fp8"``, the BF16 fused layer at the shapes
  where FP8 is slower (``detkit.mode.moe.fp8_choice``; the mode's ``fp8_shapes``, "faster" outside the mode).

A model built with ``experts_implementation="detkit"`` uses them in or out of the mode. While the mode is entered
every other name of the mapping, "eager" and None included, dispatches to ``experts_route`` (the entries are saved
and put back on exit; "eager" and None, which transformers dispatches to the class's own forward without a mapping
entry, get one on the first entry, ``own_forward``, which stays: a function compiled before the mode then sees the
swap; the modules, their parameters and state dicts are untouched): the mode's ``moe_experts``
("bf16" / "fp8") picks the precision, and a call neither path covers runs the implementation the config asked for,
counted with its reason (its GEMMs then reach the mode's aten routes) or, under strict, raises
``ModeNotRoutedError``. "detkit" and "detkit_fp8" are left as registered: an explicit choice wins. Subclasses of the
interface with their own mapping (transformers' FP8ExpertsInterface: pre-quantized checkpoints) dispatch to a
counted refusal (``_refusal_route``) while the mode is entered, never silently to their kernels.

What runs where (the decorator's layout flags and the class's gate decide; the tensors' dtype and device too):

    fused layer    has_gate, is_concatenated, no bias, no post-expert norm, the default ``_apply_gate`` with a SiLU
                   ``act_fn`` (silu(gate) * up on the [gate | up] halves), either ``is_transposed``: w1, w2 are views of
                   gate_up_proj, down_proj ([E, 2I, H] -> .transpose(1, 2), or [E, H, 2I] as is), read in place with
                   ``gate_up="split"``; no copy. Qwen3-MoE, Mixtral, DeepSeek-V3 / Kimi, GLM-4-MoE.
    grouped path   any other layout (BF16 only): a bias, ``is_concatenated=False``, ``has_gate=False`` (``act_fn`` on
                   up_proj), a custom ``_apply_gate`` (gpt-oss's clamped gate), another activation, a post-expert
                   norm. Counted with the reason the fused layer does not take it.
    transformers'  expert parallelism (``_is_expert_parallel``, refused by name), a dtype other than BF16, a device
                   detkit does not run on, hidden states that are not [T, H]; with moe_experts="fp8" also any layout
                   the fused layer does not take and H or I not multiples of 128 (never the other precision instead).

The grouped path (``grouped_experts_forward``): the routes sorted by expert (a stable sort), each expert's rows
``offs`` delimited (a searchsorted of the sorted ids: exact, no atomics), up = grouped_mm(x rows, W_up) (+ the
expert's bias, elementwise in BF16 as transformers adds it), ``_apply_gate`` / ``act_fn`` (elementwise; gpt-oss's
own ``_apply_gate`` as one kernel each way, ``kernels/grouped/gates.py``), down =
grouped_mm(h, W_down) (+ bias), the optional post-expert norm (row-wise), back to token order, and the combine
``out[t] = bf16(sum_{k ascending} w[t, k] * y[t, k])`` in FP32 (``fixed_order_combine``'s operations as one kernel
each way, kernels/grouped/combine.py).
A token's output depends on its row, its experts' weights and K alone (grouped_mm's per-row bits do not depend on
the group sizes), so it is batch-invariant. Backward: grad_input on grouped_mm, grad_weight and the bias gradient on
grouped_wgrad (ascending rows of each expert), the gather's gradient summed over k in ascending order: run-to-run
deterministic, no atomics. The custom gate's and the norm's backward are torch's elementwise / row-wise autograd.

Under torch.compile the route runs as a graph break (eagerly, with the same kernels and counting).
"""

from __future__ import annotations

import sys

import torch

from detkit.mode import gemm as mode_gemm
from detkit.mode import moe as mode_moe
from detkit.mode import state as mode_state

OP = mode_moe.EXPERTS_OP  # "moe experts (transformers)"
NAMES = {"bf16": "detkit", "fp8": "detkit_fp8"}  # the mode's moe_experts -> the implementation registered for it
GROUPED_KERNEL = "detkit.grouped_mm, gate elementwise"
_SWAPPED_OUT = object()  # a key the mapping does not hold

_saved: dict = {}  # interface class -> the mapping's entries the routes replaced: key -> function


# ---------------------------------------------------------------------------------------------
# What each path covers
# ---------------------------------------------------------------------------------------------
def _default_apply_gate():
    from transformers.integrations.moe import _default_apply_gate as gate

    return gate


def _is_silu(act) -> bool:
    if isinstance(act, torch.nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # a transformers version without it maps "silu" to nn.SiLU
        return False
    return isinstance(act, SiLUActivation)


_FLAGS = ("has_gate", "is_concatenated", "has_bias", "has_post_expert_norm", "is_transposed")
_layouts: dict[tuple, str | None] = {}  # (class, its _apply_gate, act_fn's type, flags) -> layout_reason


def layout_reason(module) -> str | None:
    """None when the fused layer computes what ``module`` computes (its layout flags and gate); else why not, one
    line: the grouped path's reason. Decided once per class, gate, activation type and flags."""
    key = (type(module), getattr(type(module), "_apply_gate", None), type(getattr(module, "act_fn", None)),
           *(getattr(module, flag, None) for flag in _FLAGS))
    if key not in _layouts:
        _layouts[key] = _layout_reason(module)
    return _layouts[key]


def _layout_reason(module) -> str | None:
    name = type(module).__name__
    for flag, value in (("has_gate", True), ("is_concatenated", True), ("has_bias", False),
                        ("has_post_expert_norm", False)):
        if getattr(module, flag, value) != value:
            return f"{name}.{flag} = {getattr(module, flag)} (fused layer: {value})"
    if getattr(type(module), "_apply_gate", None) is not _default_apply_gate():
        return f"{name} overrides _apply_gate (fused layer: silu(gate) * up)"
    act = getattr(module, "act_fn", None)
    if not _is_silu(act):
        return f"activation {type(act).__name__} (fused layer: SiLU, the layer's SwiGLU)"
    return None


def _weights(module) -> tuple[torch.Tensor, ...]:
    names = ("gate_up_proj" if getattr(module, "has_gate", True) else "up_proj", "down_proj")
    if getattr(module, "has_bias", False):
        names += (f"{names[0]}_bias", "down_proj_bias")
    return tuple(getattr(module, n) for n in names)


def unsupported_reason(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       experts: str = "bf16") -> str | None:
    """None when detkit runs this call at precision ``experts`` ("bf16": the fused layer or the grouped path; "fp8":
    the fused FP8 layer); else why not, one line."""
    if getattr(module, "_is_expert_parallel", False):
        return f"{type(module).__name__}._is_expert_parallel = True (supported: False)"
    if hidden_states.dim() != 2:
        return f"hidden_states has shape {tuple(hidden_states.shape)} (supported: [T, H])"
    if top_k_index.dim() != 2 or top_k_weights.shape != top_k_index.shape:
        return (f"routing tensors of shapes {tuple(top_k_index.shape)}, {tuple(top_k_weights.shape)} "
                "(supported: [T, K] each)")
    if top_k_weights.dtype not in (torch.bfloat16, torch.float32):
        return f"routing weights dtype {str(top_k_weights.dtype).removeprefix('torch.')}"
    if hidden_states.dtype != torch.bfloat16:  # the MoE layers and the grouped kernels take BF16
        return f"dtype {str(hidden_states.dtype).removeprefix('torch.')}"
    reason = mode_gemm.operands_reason(hidden_states, *_weights(module))
    if reason is not None:
        return reason
    if top_k_index.device != hidden_states.device or top_k_weights.device != hidden_states.device:
        return "routing tensors on another device than hidden_states"
    if experts == "fp8":
        layout = layout_reason(module)
        if layout is not None:
            return f"{layout}; the FP8 layer is fused only (moe_experts='fp8')"
        hidden, inter = hidden_states.shape[1], module.down_proj.shape[1 if module.is_transposed else 2]
        if hidden % mode_moe.FP8_BLOCK or inter % mode_moe.FP8_BLOCK:
            return (f"FP8 experts need H and I multiples of {mode_moe.FP8_BLOCK}; got H = {hidden}, I = {inter} "
                    "(moe_experts='fp8')")
    return None


# ---------------------------------------------------------------------------------------------
# The grouped path: the class's GEMMs on detkit's grouped kernels, its gate elementwise
# ---------------------------------------------------------------------------------------------
class GroupedLinear(torch.autograd.Function):
    """(x [S, K] rows sorted by expert, w, offs [E] int32, bias [E, N] or None, ids [S] sorted, transposed) ->
    [S, N] bf16: x @ W[e] (+ bias[e]) per expert's rows; w is [E, K, N] when ``transposed`` else [E, N, K]
    (transformers' ``is_transposed``). Forward and grad_input on ``grouped_mm``; grad_weight and the bias gradient
    on ``grouped_wgrad`` (each expert's rows in ascending order, FP32, one rounding), in the parameters' layouts."""

    @staticmethod
    def forward(ctx, x, w, offs, bias, ids, transposed):
        from detkit.kernels.grouped import grouped_mm

        out = grouped_mm(x, w if transposed else w.transpose(-2, -1), offs)
        if bias is not None:  # BF16 + BF16, one rounding: transformers' ``out.add_(bias)``, in one pass
            from detkit.kernels.grouped.gates import add_expert_bias

            out = add_expert_bias(out, bias, ids)
        ctx.save_for_backward(x, w, offs)
        ctx.transposed, ctx.has_bias = transposed, bias is not None
        return out

    @staticmethod
    def backward(ctx, dout):
        from detkit.kernels.grouped import grouped_mm, grouped_wgrad

        x, w, offs = ctx.saved_tensors
        dx = grouped_mm(dout, w.transpose(-2, -1) if ctx.transposed else w, offs)
        # dW[e] = x_e^T dout_e ([K, N]) or dout_e^T x_e ([N, K]): w's own layout, no copy
        dw = grouped_wgrad(x.t(), dout, offs) if ctx.transposed else grouped_wgrad(dout.t(), x, offs)
        dbias = None
        if ctx.has_bias:
            ones = torch.ones(1, dout.shape[0], dtype=dout.dtype, device=dout.device)
            dbias = grouped_wgrad(ones, dout, offs).squeeze(1)  # [E, N]: each expert's rows summed, ascending
        return dx, dw, None, dbias, None, None


class GatherRoutes(torch.autograd.Function):
    """(hidden [T, H], token [S] of each sorted route, inverse [T, K]: route (t, k)'s sorted position) -> [S, H]
    hidden[token]. Backward: dhidden[t] = bf16(sum_{k ascending} dgathered[inverse[t, k]]) in FP32 (no scatter, no
    atomics; kernels/grouped/combine.py's ``route_sum``, one pass)."""

    @staticmethod
    def forward(ctx, hidden, token, inverse):
        ctx.save_for_backward(inverse)
        return hidden[token]

    @staticmethod
    def backward(ctx, dgathered):
        from detkit.kernels.grouped.combine import route_sum

        (inverse,) = ctx.saved_tensors
        return route_sum(dgathered.contiguous(), inverse), None, None


def fixed_order_combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T, K, H] bf16 (token order), weights [T, K] -> [T, H] bf16: bf16(sum_{k ascending} w[t, k] * y[t, k])
    in FP32, elementwise multiplies and adds: a token's bits depend on its own K terms alone. The grouped path runs
    the same operations as one kernel each way (kernels/grouped/combine.py, equal bits); this form is the yardstick."""
    w = weights.float()
    total = w[:, :1] * y[:, 0].float()
    for k in range(1, y.shape[1]):
        total = total + w[:, k:k + 1] * y[:, k].float()
    return total.to(y.dtype)


GPT_OSS_MODULE = "transformers.models.gpt_oss.modeling_gpt_oss"


def _fused_gate(module):
    """gpt-oss's gate as one elementwise kernel each way (kernels/grouped/gates.py, with the module's alpha and limit)
    when the class's ``_apply_gate`` is transformers' ``GptOssExperts._apply_gate`` itself; else None (the class's own
    gate runs, as torch ops)."""
    gpt_oss = sys.modules.get(GPT_OSS_MODULE)  # imported already whenever a GptOssExperts exists
    experts = getattr(gpt_oss, "GptOssExperts", None)
    if experts is None or getattr(type(module), "_apply_gate", None) is not experts._apply_gate:
        return None
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in (alpha, limit)):
        return None
    from detkit.kernels.grouped.gates import clamped_swiglu

    return lambda h: clamped_swiglu(h, alpha, limit)


def grouped_experts_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts of any decorated class on detkit's grouped kernels (see the module docstring): hidden [T, H] bf16,
    ids [T, K] (ids >= E contribute nothing), weights [T, K] -> [T, H] bf16."""
    num_tokens, top_k = top_k_index.shape
    experts = module.num_experts
    # Route ids >= E (the expert-parallel sentinel of a transformers without ``_is_expert_parallel``) sort to the tail,
    # past offs[E - 1]: grouped_mm writes their rows 0, and their weights are 0 (no host read).
    top_k_weights = top_k_weights.masked_fill(top_k_index >= experts, 0)
    sorted_ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    # offs[e] = routes with id <= e: exact integer counts, no atomics (a histogram's CUDA kernel adds with atomics)
    offs = torch.searchsorted(sorted_ids, torch.arange(experts, device=sorted_ids.device), right=True)
    offs = offs.to(torch.int32)
    sorted_ids = sorted_ids.clamp(max=experts - 1)  # the bias gather stays in bounds for the sentinels' rows
    inverse = inverse.view(num_tokens, top_k)  # the sorted row of route (t, k)
    x = GatherRoutes.apply(hidden_states, perm // top_k, inverse)
    transposed = bool(getattr(module, "is_transposed", False))
    has_gate, has_bias = getattr(module, "has_gate", True), getattr(module, "has_bias", False)
    up = module.gate_up_proj if has_gate else module.up_proj
    up_bias = (module.gate_up_proj_bias if has_gate else module.up_proj_bias) if has_bias else None
    h = GroupedLinear.apply(x, up, offs, up_bias, sorted_ids, transposed)
    fused_gate = _fused_gate(module) if has_gate else None
    if fused_gate is not None:
        h = fused_gate(h)
    else:
        h = module._apply_gate(h) if has_gate else module.act_fn(h)
    down_bias = module.down_proj_bias if has_bias else None
    y = GroupedLinear.apply(h.to(hidden_states.dtype), module.down_proj, offs, down_bias, sorted_ids, transposed)
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y)
    from detkit.kernels.grouped.combine import route_combine

    # back to token order, weighted and summed over k ascending: fixed_order_combine's bits in one pass each way
    return route_combine(y.contiguous(), inverse, top_k_weights.contiguous())


# ---------------------------------------------------------------------------------------------
# The implementations registered with transformers, and the mode's route
# ---------------------------------------------------------------------------------------------
def _run(module, hidden_states, top_k_index, top_k_weights, experts: str) -> tuple[torch.Tensor, str]:
    """(out, counted kernel) on the path that covers the call (the caller checked ``unsupported_reason``)."""
    if hidden_states.shape[0] == 0:  # no tokens: the sum of no terms
        return torch.zeros_like(hidden_states), mode_gemm.EMPTY
    if experts == "fp8":
        if mode_state.fp8_shapes() == "faster":
            choice = mode_moe.fp8_choice(module, hidden_states, top_k_index)
            if choice.layer == "bf16":  # FP8 measured slower at this shape: the BF16 layer, its bits, counted so
                return (mode_moe.experts_forward(module, hidden_states, top_k_index, top_k_weights),
                        mode_moe.fp8_as_bf16_kernel(module, hidden_states, top_k_index, choice.reason))
        return (mode_moe.experts_forward_fp8(module, hidden_states, top_k_index, top_k_weights),
                mode_moe.EXPERTS_KERNEL_FP8)
    layout = layout_reason(module)
    if layout is None:
        return mode_moe.experts_forward(module, hidden_states, top_k_index, top_k_weights), mode_moe.EXPERTS_KERNEL
    return (grouped_experts_forward(module, hidden_states, top_k_index, top_k_weights),
            f"{GROUPED_KERNEL} ({layout})")


def _implementation(experts: str):
    @torch._dynamo.disable
    def forward(self, hidden_states, top_k_index, top_k_weights):
        reason = unsupported_reason(self, hidden_states, top_k_index, top_k_weights, experts)
        if reason is not None:
            raise NotImplementedError(f"experts_implementation={NAMES[experts]!r}: {reason}")
        out, kernel = _run(self, hidden_states, top_k_index, top_k_weights, experts)
        mode_state.routed(OP, kernel)
        return out

    forward.__name__ = forward.__qualname__ = f"{NAMES[experts]}_experts"
    forward.__doc__ = (f"The {NAMES[experts]!r} experts implementation for transformers ({experts.upper()}): "
                       "detkit's kernels or NotImplementedError, never torch's.")
    return forward


detkit_experts = _implementation("bf16")
detkit_fp8_experts = _implementation("fp8")


def own_forward(self, *args, **kwargs):
    """What the decorator dispatches "eager" and None to outside the mode: the class's own forward. Put in the
    interfaces' mappings on the mode's first entry and left there, so that a function compiled before the mode, whose
    dispatch dynamo guards on the mapping entry it read, sees the swap (dynamo does not re-check a key that was
    absent when it traced)."""
    return type(self).forward.__wrapped__(self, *args, **kwargs)  # functools.wraps of the decorator


def _requested(module, interface=None):
    """The implementation the module's config asked for, as the decorator would have dispatched it outside the
    mode: the saved entry of ``interface``'s mapping (ExpertsInterface by default), or the class's own forward
    ("eager", None)."""
    name = getattr(module.config, "_experts_implementation", None)
    saved = _saved.get(interface or _experts_interface(), {}).get(name, _SWAPPED_OUT)
    if saved is not _SWAPPED_OUT:
        return saved
    return type(module).forward.__wrapped__  # functools.wraps of the decorator: the class's own forward


@torch._dynamo.disable
def experts_route(self, hidden_states, top_k_index, top_k_weights):
    """Every decorated experts class's implementation while the mode is entered (see the module docstring)."""
    if not mode_state.active():
        return _requested(self)(self, hidden_states, top_k_index, top_k_weights)
    experts = mode_state.moe_experts()
    reason = unsupported_reason(self, hidden_states, top_k_index, top_k_weights, experts)
    if reason is not None:
        mode_state.not_routed(OP, reason)
        return _requested(self)(self, hidden_states, top_k_index, top_k_weights)
    out, kernel = _run(self, hidden_states, top_k_index, top_k_weights, experts)
    mode_state.routed(OP, kernel)
    return out


def _refusal_route(interface: type):
    """The route of an ExpertsInterface subclass with its own mapping (transformers' FP8ExpertsInterface: classes of
    pre-quantized checkpoints, their weights FP8 with scales): counted as not routed, or raised under strict, then
    the implementation the config asked for -- never silent."""
    @torch._dynamo.disable
    def route(self, *args, **kwargs):
        if mode_state.active():
            mode_state.not_routed(OP, f"{type(self).__name__} dispatches through {interface.__name__} (pre-quantized "
                                      "expert weights: no detkit kernel takes them)")
        return _requested(self, interface)(self, *args, **kwargs)

    route.detkit_route = True
    return route


def _experts_interface():
    from transformers.integrations.moe import ExpertsInterface

    return ExpertsInterface


def _interfaces(root: type) -> list[type]:
    """``root`` and every subclass that holds its own mapping (imported so far)."""
    found, stack = [], [root]
    while stack:
        cls = stack.pop()
        if "_global_mapping" in vars(cls):
            found.append(cls)
        stack.extend(cls.__subclasses__())
    return found


def register_transformers_experts() -> None:
    """Register ``"detkit"`` (BF16) and ``"detkit_fp8"`` with transformers' ExpertsInterface (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAMES["bf16"], detkit_experts)
    ExpertsInterface.register(NAMES["fp8"], detkit_fp8_experts)


def install() -> None:
    """Register detkit's implementations and dispatch every other name of the ExpertsInterface mapping (and "eager",
    None) to ``experts_route``; the mappings of its subclasses to a counted refusal (only when transformers is
    imported: a model can only be built after it is)."""
    if "transformers" not in sys.modules or _saved:
        return
    try:
        root = _experts_interface()
    except ImportError:  # a transformers without the experts interface has no decorated class to route
        return
    register_transformers_experts()
    for interface in _interfaces(root):
        route = experts_route if interface is root else _refusal_route(interface)
        mapping, saved = interface._global_mapping, _saved.setdefault(interface, {})
        for key in ("eager", None):
            mapping.setdefault(key, own_forward)
        for key in list(mapping):
            if (interface is root and key in NAMES.values()) or key in saved:
                continue
            saved[key] = mapping[key]
            mapping[key] = route


def uninstall() -> None:
    for interface, saved in _saved.items():
        mapping = interface._global_mapping
        for key, function in saved.items():
            mapping[key] = function
    _saved.clear()


def installed() -> bool:
    return bool(_saved)
