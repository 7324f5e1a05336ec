"""The batch-invariant mode's attention routing: SDPA calls and transformers' attention onto
``detkit.kernels.attention`` (its interface: q [B, Hq, Sq, D], causal, the Sq queries the last Sq
key positions, padding as transformers builds it; one reduction order over the keys for prefill,
chunked prefill and decode alike).

Two routes, both installed on the mode's entry and removed on its exit:

- ``torch.nn.functional.scaled_dot_product_attention`` is replaced by ``sdpa_route`` (process-wide,
  for every caller that looks the function up at call time, as transformers does). A call goes to
  ``attention.sdpa_accepted`` (``attention.sdpa`` without its check asked again) when
  ``attention.sdpa_unsupported_reason(...)`` is None and the mask, if any, has one row per query;
  otherwise it runs on torch's SDPA and is counted with the reason (strict raises).
  Why a Python-level route and not aten overrides of SDPA's backend ops: the backend ops take no
  padding mask (flash), return backend-specific state (logsumexp, RNG offsets) their backward ops
  consume, and are chosen inside a composite op; detkit's ``sdpa`` carries its own autograd.
- transformers' "sdpa" attention function is replaced by ``transformers_sdpa_route``, which calls
  ``attention.hf_attention_forward`` (same arguments: q [B, Hq, Sq, D] before transformers' GQA
  packing, the 4-D boolean mask or None) and falls back to transformers' own function, counted, when
  that raises NotImplementedError for what it does not cover. For a single decode query with a
  padding mask transformers' SDPA path packs the query heads into the query-length dim
  (``pack_gqa``); the causal-position rule of detkit's kernel does not hold for such a packed call,
  which is why transformers models are routed one level up, at the attention function.

transformers' continuous batching (``generate_batch``, the paged KV cache): an "sdpa" call carrying the cache's
keyword arguments (5.24) and a "paged|sdpa" call (5.17) go to ``paged_attention.paged_attention_forward`` (the packed
kernel, ``attention_varlen``), counted as "attention (transformers continuous batching)"; what it refuses runs on
transformers' function, counted. Every other implementation in transformers' AttentionInterface (flash, flex,
"paged|eager") is wrapped while the mode is entered: its calls are counted as not routed (strict raises).

A call whose value head dim differs from its query/key head dim (DeepSeek-V3's MLA), or whose one head dim lies
between the kernel's (Phi-3-mini's 96), runs on the next kernel head dim's tiles, zero-padded in effect (read in
place by masked loads; on padded copies under autograd: ``launch.mixed_head_dims``) and is counted under its own
kernel name (``_kernel``: "detkit.attention (qk head dim 192, v 128: zero-padded)", "detkit.attention
(head dim 96: zero-padded)"), so the counters show which calls paid the padding.

``register_transformers_attention()`` also registers ``"detkit"`` with transformers'
AttentionInterface (and its mask interface, with SDPA's boolean mask), so a model can be built with
``attn_implementation="detkit"`` and use the kernel in or out of the mode; that name never falls back. It registers
``"paged|detkit"`` too (5.17's continuous-batching name for it).

Under torch.compile both routes run as graph breaks (``torch._dynamo.disable``): the attention call
runs eagerly, with the same kernel, autograd and counting as in eager mode.

``detkit.kernels.attention`` is imported when first needed; until it exists in the tree every
attention call is counted as not routed ("no detkit attention kernel"), never silently.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading

import torch
import torch.nn.functional as F

from detkit.mode import paged_attention
from detkit.mode import state as mode_state

ATTENTION_MODULE = "detkit.kernels.attention"
NO_KERNEL = "no detkit attention kernel (detkit.kernels.attention is not in this tree)"
SDPA_OP = "sdpa"
HF_OP = "attention (transformers)"
KERNEL = "detkit.attention"
CB_OP = paged_attention.CB_OP
KERNEL_VARLEN = "detkit.attention_varlen"
PAGED_SDPA = "paged|sdpa"  # transformers 5.17's continuous-batching name for a model built with "sdpa"
# The implementations the mode routes; every other one in transformers' AttentionInterface (flash attention, flex,
# "paged|eager") is wrapped while the mode is entered so that a call is counted as not routed (strict raises):
# transformers' continuous batching switches an "sdpa" model to flash attention on its own when flash-attn is
# installed (auto_switch_to_flash), which would otherwise leave the mode unseen.
ROUTED_IMPLEMENTATIONS = ("sdpa", "detkit", "paged|detkit", PAGED_SDPA)

_ORIGINAL_SDPA = F.scaled_dot_product_attention
_local = threading.local()
_saved_hf_sdpa = None
_saved_hf_sdpa_mask = None
_saved_hf_paged_sdpa = None
_saved_unrouted: dict = {}  # name -> transformers' function, for the implementations wrapped by _unrouted


def attention_module():
    """``detkit.kernels.attention``, or None while it does not exist (any other import error propagates)."""
    module = sys.modules.get(ATTENTION_MODULE)  # the per-call path: imported already
    if module is not None:
        return module
    try:
        return importlib.import_module(ATTENTION_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name in (ATTENTION_MODULE, "detkit.kernels"):
            return None
        raise


_resolved: tuple = (None, {})  # (module, {name: function}): the interface functions of the module last seen


def _function(module, name: str):
    """``getattr(module, name)``, remembered while ``module`` stays the attention module (its names resolve through
    a module ``__getattr__``, an import lookup per access otherwise)."""
    global _resolved
    seen, functions = _resolved
    if seen is not module:
        _resolved = seen, functions = module, {}
    function = functions.get(name)
    if function is None:
        function = functions[name] = getattr(module, name)
    return function


def _kernel(name: str, query, value) -> str:
    """The kernel a call is counted under: ``name``, or for head dims the kernel runs zero-padded (a value head dim
    other than the query's, MLA; one head dim between the kernel's, Phi-3-mini's 96) ``name`` with the head dims."""
    if not isinstance(query, torch.Tensor) or not isinstance(value, torch.Tensor) or not query.dim() or not value.dim():
        return name
    attention = attention_module()
    return _kernel_name(name, query.shape[-1], value.shape[-1], None if attention is None else attention.HEAD_DIMS)


@functools.lru_cache(maxsize=64)
def _kernel_name(name: str, dim_qk: int, dim_v: int, head_dims: tuple | None) -> str:
    """``_kernel``'s name for these head dims (a few per model: formatted once)."""
    if dim_qk == dim_v and (head_dims is None or dim_qk in head_dims):
        return name
    if dim_qk == dim_v:
        return f"{name} (head dim {dim_qk}: zero-padded)"
    return f"{name} (qk head dim {dim_qk}, v {dim_v}: zero-padded)"


def _mask_reason(query: torch.Tensor, attn_mask) -> str | None:
    if attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] != query.shape[-2]:
        return (f"attn_mask has {attn_mask.shape[-2]} row(s) for {query.shape[-2]} queries (a mask broadcast over "
                "queries is not causal + padding)")
    return None


@torch._dynamo.disable
def sdpa_route(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention while the mode is entered (see the module docstring)."""
    if not mode_state.active() or getattr(_local, "passthrough", False):
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
    module = attention_module()
    if module is None:
        reason = NO_KERNEL
    else:
        reason = _function(module, "sdpa_unsupported_reason")(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
        reason = reason or _mask_reason(query, attn_mask)
    if reason is not None:
        mode_state.not_routed(SDPA_OP, reason)
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
    # Accepted just above: the kernel runs without asking sdpa_unsupported_reason again.
    out = _function(module, "sdpa_accepted")(query, key, value, attn_mask, scale)
    mode_state.routed(SDPA_OP, _kernel(KERNEL, query, value))
    return out


def _original_hf_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _kernel_or_fallback(op: str, kernel: str, call, fallback, args: tuple, kwargs: dict):
    """``call(attention module)`` counted as ``op -> kernel``; where there is no kernel or it refuses the call
    (NotImplementedError), ``fallback(*args, **kwargs)`` counted once as not routed (strict raises before it runs)."""
    attention = attention_module()
    reason = NO_KERNEL
    if attention is not None:
        try:
            out = call(attention)
        except NotImplementedError as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        else:
            mode_state.routed(op, kernel)
            return out
    mode_state.not_routed(op, reason)
    _local.passthrough = True  # counted once, here: its SDPA call is not counted again
    try:
        return fallback(*args, **kwargs)
    finally:
        _local.passthrough = False


def _paged_call(attention, module, query, key, value, attention_mask, kwargs):
    """One continuous-batching call on detkit's packed kernel (mode/paged_attention.py), uncounted."""
    return paged_attention.paged_attention_forward(_function(attention, "attention_varlen"), module, query, key, value,
                                                   attention_mask, **kwargs)


def _continuous_batching_route(fallback, module, query, key, value, attention_mask, kwargs):
    """A continuous-batching call (transformers' paged cache) under the mode: detkit's packed kernel, or, for what
    it refuses, ``fallback``."""
    def call(attention):
        return _paged_call(attention, module, query, key, value, attention_mask, kwargs)
    return _kernel_or_fallback(CB_OP, _kernel(KERNEL_VARLEN, query, value), call, fallback,
                               (module, query, key, value, attention_mask), kwargs)


@torch._dynamo.disable
def transformers_sdpa_route(module, query, key, value, attention_mask, **kwargs):
    """transformers' "sdpa" attention function while the mode is entered."""
    fallback = _saved_hf_sdpa or _original_hf_sdpa()
    if not mode_state.active():
        return fallback(module, query, key, value, attention_mask, **kwargs)
    if paged_attention.is_continuous_batching_call(kwargs):  # 5.24's continuous batching keeps "sdpa"
        return _continuous_batching_route(fallback, module, query, key, value, attention_mask, kwargs)

    def call(attention):
        return _function(attention, "hf_attention_forward")(module, query, key, value, attention_mask, **kwargs)
    return _kernel_or_fallback(HF_OP, _kernel(KERNEL, query, value), call, fallback,
                               (module, query, key, value, attention_mask), kwargs)


@torch._dynamo.disable
def transformers_paged_sdpa_route(module, query, key, value, attention_mask, **kwargs):
    """transformers 5.17's "paged|sdpa" attention function while the mode is entered (it updates the paged cache
    itself, from the ``cache`` keyword argument)."""
    fallback = _saved_hf_paged_sdpa
    if not mode_state.active() or not paged_attention.is_continuous_batching_call(kwargs):
        return fallback(module, query, key, value, attention_mask, **kwargs)
    return _continuous_batching_route(fallback, module, query, key, value, attention_mask, kwargs)


def _unrouted(name: str, function):
    """transformers' attention implementation ``name`` while the mode is entered: counted as not routed, then run."""
    reason = (f"attn_implementation {name!r} is not routed (routed: {', '.join(map(repr, ROUTED_IMPLEMENTATIONS))}; "
              "continuous batching: auto_switch_to_flash=False)")

    def route(module, query, key, value, attention_mask, **kwargs):
        if mode_state.active():
            mode_state.not_routed(HF_OP, reason)
        return function(module, query, key, value, attention_mask, **kwargs)

    route.detkit_unrouted = function
    return route


@torch._dynamo.disable
def detkit_attention(module, query, key, value, attention_mask, **kwargs):
    """The "detkit" attention implementation for transformers: detkit's kernel or an error, never torch's."""
    attention = attention_module()
    if attention is None:
        raise NotImplementedError(f"attn_implementation='detkit': {NO_KERNEL}")
    if paged_attention.is_continuous_batching_call(kwargs):
        out = _paged_call(attention, module, query, key, value, attention_mask, kwargs)
        mode_state.routed(CB_OP, _kernel(KERNEL_VARLEN, query, value))
        return out
    out = _function(attention, "hf_attention_forward")(module, query, key, value, attention_mask, **kwargs)
    mode_state.routed(HF_OP, _kernel(KERNEL, query, value))
    return out


def _tagged_mask(builder):
    """transformers' mask builder ``builder`` (its mask-interface signature, keyword arguments), the mask it returns
    tagged with each sequence's first key in the key tensor's indices (``tag_mask_anchor``): under a sliding window
    a decode step's mask hides it, and the kernel anchors its key tiles there. The mask's values are unchanged."""
    def mask_with_anchor(*args, **kwargs):
        mask = builder(*args, **kwargs)
        attention = attention_module()
        tag = getattr(attention, "tag_mask_anchor", None) if attention is not None else None
        # Keyword arguments only, as transformers calls its mask interface; a call this wrapper cannot read (another
        # transformers version's signature) leaves the mask untagged, and a sliding mask that needs the tag is then
        # refused by name, never guessed.
        if tag is not None and isinstance(mask, torch.Tensor) and not args and "batch_size" in kwargs:
            tag(mask, kwargs.get("attention_mask"), kwargs.get("kv_offset", 0), kwargs["batch_size"])
        return mask

    mask_with_anchor.detkit_builder = builder
    return mask_with_anchor


def register_transformers_attention() -> None:
    """Register ``"detkit"`` with transformers' attention and mask interfaces (idempotent): the mask is SDPA's
    boolean mask, tagged with each sequence's first key."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register("detkit", detkit_attention)
    AttentionMaskInterface.register("detkit", _tagged_mask(sdpa_mask))
    # transformers 5.17's continuous batching runs a model built with "detkit" as "paged|detkit"
    AttentionInterface.register("paged|detkit", detkit_attention)
    AttentionMaskInterface.register("paged|detkit", _tagged_mask(sdpa_mask))


def install() -> None:
    global _saved_hf_sdpa, _saved_hf_sdpa_mask, _saved_hf_paged_sdpa
    F.scaled_dot_product_attention = sdpa_route
    if "transformers" in sys.modules:  # a model can only be built after transformers is imported
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface

        register_transformers_attention()
        mapping = AttentionInterface._global_mapping
        if mapping.get("sdpa") is not transformers_sdpa_route:
            _saved_hf_sdpa = mapping.get("sdpa")
            mapping["sdpa"] = transformers_sdpa_route
        if mapping.get(PAGED_SDPA) not in (None, transformers_paged_sdpa_route):  # transformers 5.17
            _saved_hf_paged_sdpa = mapping[PAGED_SDPA]
            mapping[PAGED_SDPA] = transformers_paged_sdpa_route
        for name, function in list(mapping.items()):
            if name not in ROUTED_IMPLEMENTATIONS and not hasattr(function, "detkit_unrouted"):
                _saved_unrouted[name] = function
                mapping[name] = _unrouted(name, function)
        masks = AttentionMaskInterface._global_mapping
        if masks.get("sdpa") is not None and not hasattr(masks["sdpa"], "detkit_builder"):
            _saved_hf_sdpa_mask = masks["sdpa"]
            masks["sdpa"] = _tagged_mask(_saved_hf_sdpa_mask)


def uninstall() -> None:
    global _saved_hf_sdpa, _saved_hf_sdpa_mask, _saved_hf_paged_sdpa
    F.scaled_dot_product_attention = _ORIGINAL_SDPA
    if _saved_hf_sdpa is not None:
        from transformers.modeling_utils import AttentionInterface

        AttentionInterface._global_mapping["sdpa"] = _saved_hf_sdpa
        _saved_hf_sdpa = None
    if _saved_hf_paged_sdpa is not None:
        from transformers.modeling_utils import AttentionInterface

        AttentionInterface._global_mapping[PAGED_SDPA] = _saved_hf_paged_sdpa
        _saved_hf_paged_sdpa = None
    if _saved_unrouted:
        from transformers.modeling_utils import AttentionInterface

        mapping = AttentionInterface._global_mapping
        for name, function in _saved_unrouted.items():
            if hasattr(mapping.get(name), "detkit_unrouted"):  # left alone if re-registered meanwhile
                mapping[name] = function
        _saved_unrouted.clear()
    if _saved_hf_sdpa_mask is not None:
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface._global_mapping["sdpa"] = _saved_hf_sdpa_mask
        _saved_hf_sdpa_mask = None
