"""detkit mode's RMSNorm route: transformers' RMSNorm classes run their forward as one fused kernel
(detkit.kernels.reductions.rms_norm) where no gradient is needed, with the bits of their own forward under the mode.

Why: the module's forward is eight ops (FP32 copy, square, row mean, ``+ eps``, ``rsqrt``, product, cast, weight
product), and in an eager decode step each op's host path costs more than its kernel; a Qwen3 layer runs four norms.
The fused kernel gives the same bits as those ops under the mode (its mean is the mode's row mean, its other steps
round where the ops do), so which of the two runs never changes a result: the route is speed only. It is taken where
the call needs no autograd graph (rollouts: ``torch.no_grad`` / ``inference_mode``, or no input requiring a
gradient), outside torch.compile's tracing (a compiled graph traces the class's own forward), and where the kernel
takes the operands (``rms_norm_reason``); elsewhere the class's own forward runs, its mean on the mode's route.

Which classes: every RMSNorm class of an imported transformers model module whose forward is, bytecode for bytecode,
one of the forwards below (``STYLE_FORWARDS``: Llama's, which most families copy; OLMo-2's and gpt-oss's weight
first; Gemma's ``1 + weight``); a class with any other forward keeps it. Modules imported after the mode's outermost
entry are found at the next one. The class forwards are swapped on entry and restored on exit, as the Qwen3-MoE
router's is (``moe``); a module given its own forward (``parallel.prepare``'s norms) keeps it.
"""

from __future__ import annotations

import sys

import torch

from detkit.mode import gemm as mode_gemm
from detkit.mode.bytecode import code_key, new_model_modules, suspension
from detkit.mode import state as mode_state

NORM_OP = "rms_norm (transformers)"
NORM_KERNEL = "fused_rms_norm"
PLAIN = (torch.Tensor, torch.nn.Parameter)  # the tensor types the kernel's launch takes as they are


# transformers' RMSNorm forwards, op for op (their bytecode identifies a class's math; the names are theirs).
def _llama_forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


def _weight_first_forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)


def _gemma_norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _gemma_forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)


# style -> (forward, the helper methods it calls, the attribute holding eps)
STYLE_FORWARDS = {
    "llama": (_llama_forward, {}, "variance_epsilon"),
    "weight_first": (_weight_first_forward, {}, "variance_epsilon"),
    "one_plus_weight": (_gemma_forward, {"_norm": _gemma_norm}, "eps"),
}


_STYLE_KEYS = {style: (code_key(fwd), {name: code_key(fn) for name, fn in helpers.items()})
               for style, (fwd, helpers, _) in STYLE_FORWARDS.items()}


def style_of(cls: type) -> str | None:
    """The style whose forward (and helpers) ``cls`` runs, or None."""
    forward = cls.__dict__.get("forward")
    if forward is None or not issubclass(cls, torch.nn.Module):
        return None
    key = code_key(forward)
    for style, (forward_key, helper_keys) in _STYLE_KEYS.items():
        if key == forward_key and all(code_key(getattr(cls, name, None)) == want
                                      for name, want in helper_keys.items()):
            return style
    return None


_scanned: set[str] = set()
_classes: dict[type, str] = {}  # RMSNorm class -> style, over every scanned module
_saved: dict[type, object] = {}  # class -> its own forward, while installed


def _scan() -> None:
    """Find the matching classes of transformers model modules not scanned yet."""
    for name, module in new_model_modules(_scanned):
        for obj in list(vars(module).values()):
            if isinstance(obj, type) and obj.__module__ == name and obj.__name__.endswith("RMSNorm"):
                style = style_of(obj)
                if style is not None:
                    _classes[obj] = style


def _route_for(cls: type, style: str, own_forward):
    eps_name = STYLE_FORWARDS[style][2]

    def forward(self, hidden_states):
        # type(self) is cls: a subclass that inherits this forward but overrides a helper runs its own math.
        if type(self) is cls and not torch.compiler.is_compiling() and mode_state.active():
            out = fused(hidden_states, self.weight, getattr(self, eps_name), style)
            if out is not None:
                return out
        return own_forward(self, hidden_states)
    forward.__name__ = forward.__qualname__ = f"{cls.__name__}.forward (detkit route)"
    return forward


_PLANS = mode_gemm._PLANS  # the mode's plan table (one per signature, all routes; cleared with the others)


def fused(x: torch.Tensor, weight: torch.Tensor, eps, style: str) -> torch.Tensor | None:
    """The fused kernel's output, counted, or None where the class's own forward must run (a gradient is needed, a
    tensor subclass, or operands the kernel does not take: then the module's ops run, their mean on the mode's
    route)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    if type(x) is not torch.Tensor or type(weight) not in PLAIN:  # DTensor, FakeTensor, ...: their own dispatch
        return None
    key = (NORM_OP, style, eps, x.dtype, weight.dtype, x.device, weight.device, x.shape, x.stride(), weight.shape,
           weight.stride())
    plan = _PLANS.get(key)
    if plan is None:
        plan = mode_gemm._remember(key, _plan(x, weight, eps, style))
    return plan(x, weight)


def _plan(x: torch.Tensor, weight: torch.Tensor, eps, style: str):
    from detkit.kernels.reductions.rms_norm import rms_norm_launcher, rms_norm_reason

    if not isinstance(eps, float) or mode_gemm.device_reason(x.device) is not None \
            or rms_norm_reason(x, weight, style) is not None:
        return _own_forward_plan
    return mode_state.counted_launch(rms_norm_launcher(x, weight, eps, style), NORM_OP, NORM_KERNEL)


def _own_forward_plan(x, weight):
    return None


def install() -> None:
    """Swap the forward of every matching RMSNorm class of the imported transformers model modules."""
    if "transformers" not in sys.modules:
        return
    _scan()
    for cls, style in _classes.items():
        if cls not in _saved:
            _saved[cls] = cls.__dict__["forward"]
            cls.forward = _route_for(cls, style, _saved[cls])


def uninstall() -> None:
    for cls, own in _saved.items():
        cls.forward = own
    _saved.clear()


def suspended():
    """The classes' own forwards while inside, inside an entered mode (a measurement's baseline: the route is speed
    only); swapped again after."""
    return suspension(_saved, install, uninstall)


def installed_classes() -> dict[type, str]:
    """The classes whose forward the mode has swapped, with their style."""
    return {cls: _classes[cls] for cls in _saved}
