"""detkit mode's rotary route: transformers' ``apply_rotary_pos_emb`` as one fused kernel (detkit.kernels.rotary)
where no gradient is needed, with the bits of the function's own ops.

Why: the function is ten elementwise launches for q and k (products, the half rotation's negation and concatenation,
sums), in an eager decode step mostly host time, once per layer. The kernel rounds where the ops round, so its outputs
equal theirs bit for bit (and get the strides the ops give them): the route is speed only, taken where the call needs
no autograd graph, outside torch.compile's tracing, with ``unsqueeze_dim`` 1 and operands the kernel takes
(``rope_reason``); elsewhere the function itself runs.

Which functions: the ``apply_rotary_pos_emb`` bound in each imported transformers model module whose code is Llama's
(``detkit.kernels.rotary.reference``, which most families copy) and whose ``rotate_half`` is Llama's too, bytecode for
bytecode; a module binds its own name, so each module's binding is swapped on the mode's outermost entry and restored
on exit. Other rotary forms (interleaved, partial) keep their function.
"""

from __future__ import annotations

import torch

from detkit.kernels.rotary import reference
from detkit.mode import gemm as mode_gemm
from detkit.mode import state as mode_state
from detkit.mode.bytecode import code_key, new_model_modules, suspension

ROPE_OP = "rotary (transformers)"
ROPE_KERNEL = "fused_rope"
FUNCTION = "apply_rotary_pos_emb"

_APPLY_KEY = code_key(reference.apply_rotary_pos_emb_ref)
_ROTATE_KEY = code_key(reference.rotate_half)


def matches(fn) -> bool:
    """Whether ``fn`` is transformers' Llama ``apply_rotary_pos_emb`` over Llama's ``rotate_half``, op for op."""
    rotate = getattr(fn, "__globals__", {}).get("rotate_half")
    return code_key(fn) == _APPLY_KEY and rotate is not None and code_key(rotate) == _ROTATE_KEY


_scanned: set[str] = set()
_modules: dict[object, object] = {}  # model module -> its own apply_rotary_pos_emb (a match)
_saved: dict[object, object] = {}  # model module -> its own function, while installed


def _scan() -> None:
    for _, module in new_model_modules(_scanned):
        fn = vars(module).get(FUNCTION)
        if fn is not None and matches(fn):
            _modules[module] = fn


def _route_for(own):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim == 1 and not torch.compiler.is_compiling() and mode_state.active():
            out = fused(q, k, cos, sin, own)
            if out is not None:
                return out
        return own(q, k, cos, sin, unsqueeze_dim)
    apply_rotary_pos_emb.__qualname__ = f"{FUNCTION} (detkit route)"
    return apply_rotary_pos_emb


_PLANS = mode_gemm._PLANS  # the mode's plan table (one per signature, all routes; cleared with the others)


def fused(q, k, cos, sin, own) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fused kernel's (q_embed, k_embed), counted, or None where ``own`` must run (a gradient is needed, a
    tensor subclass, or operands the kernel does not take)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad):
        return None
    if not (type(q) is type(k) is type(cos) is type(sin) is torch.Tensor):  # subclasses: their own dispatch
        return None
    key = (ROPE_OP, own, q.dtype, q.device, q.shape, q.stride(), k.shape, k.stride(), cos.dtype, cos.shape, cos.stride(),
           sin.dtype, sin.shape, sin.stride(), k.dtype, k.device, cos.device, sin.device)
    plan = _PLANS.get(key)
    if plan is None:
        plan = mode_gemm._remember(key, _plan(q, k, cos, sin, own))
    return plan(q, k, cos, sin)


def _plan(q, k, cos, sin, own):
    from detkit.kernels.rotary import output_strides, rope_launcher, rope_reason

    if mode_gemm.device_reason(q.device) is not None or rope_reason(q, k, cos, sin) is not None:
        return _own_function_plan
    return mode_state.counted_launch(rope_launcher(q, k, cos, sin, output_strides(q, k, cos, own)), ROPE_OP,
                                     ROPE_KERNEL)


def _own_function_plan(q, k, cos, sin):
    return None


def install() -> None:
    """Swap ``apply_rotary_pos_emb`` in every matching imported transformers model module."""
    import sys

    if "transformers" not in sys.modules:
        return
    _scan()
    for module, own in _modules.items():
        if module not in _saved and vars(module).get(FUNCTION) is own:
            _saved[module] = own
            setattr(module, FUNCTION, _route_for(own))


def uninstall() -> None:
    for module, own in _saved.items():
        setattr(module, FUNCTION, own)
    _saved.clear()


def suspended():
    """The modules' own functions while inside, inside an entered mode (a measurement's baseline: the route is speed
    only); swapped again after."""
    return suspension(_saved, install, uninstall)


def installed_modules() -> list:
    """The model modules whose ``apply_rotary_pos_emb`` the mode has swapped."""
    return list(_saved)
