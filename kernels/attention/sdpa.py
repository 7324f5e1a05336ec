"""The attention kernels behind ``torch.nn.functional.scaled_dot_product_attention`` and transformers' attention
interface: the cases with the kernels' semantics are run on them, everything else is refused by name.

Covered (F.scaled_dot_product_attention semantics, BF16, head_dim 64, 128 or 256 -- or other head dims, a value
head dim other than the query/key head dim among them, each at most 256, on the next of those's tiles (MLA; read
masked, or zero-padded under autograd: launch.mixed_head_dims) -- [B, H, S, D] with a contiguous head dim,
dropout 0, GQA with enable_gqa):
- ``is_causal=True`` with no mask and q_len == kv_len;
- no mask and q_len == 1 (a decode step: one query sees every key);
- a boolean or additive ``attn_mask`` (broadcastable [B|1, H|1, Sq, Skv]) that is causal + per-sequence padding,
  as transformers builds it: sequence b sees a window of keys [start_b, end_b] (left and right padding, a static
  cache's unfilled tail), its query i the keys start_b..min(o_b + i, end_b) for one offset o_b. Rows of queries at
  padded positions (all-masked rows, or rows clipped at end_b) are computed as finite values that nobody should
  read (SDPA gives NaN or other values there).

The mask's values are checked on the device against the structure it must have, once per mask tensor (a forward
passes one mask object to every layer): outside CUDA-graph capture one host sync raises a ValueError naming the
problem; under capture a device-side assert (torch._assert_async) fails the run instead of a silent result.
``sdpa_unsupported_reason`` is host-only: it never reads tensor values.
"""

from __future__ import annotations

import math

import torch

from detkit.kernels.attention.host_values import TensorMemo
from detkit.kernels.attention.kernels import attention_fwd_kernel
from detkit.kernels.attention.launch import attention, kernel_head_dim, remember, signature_of
from detkit.kernels.attention.masks import MaskAnchor, anchor_tensor, mask_key_windows_device
from detkit.kernels.backend import resolve_backend


_PLAIN_FLAGS = (type(None), bool, int, float)  # flag types a key holds as they are (hashable, compared by value)
_reasons: dict = {}  # (signature_of(query, key, value, attn_mask), flags) -> sdpa_unsupported_reason's result


def sdpa_unsupported_reason(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False) -> str | None:
    """None when ``sdpa`` runs this F.scaled_dot_product_attention call with the same semantics, else a short
    reason. Host-side only (shapes, dtypes, devices, strides, flags): never reads tensor values, so the answer is
    remembered per signature of the tensors and flags (launch.signature_of)."""
    flags = (dropout_p, is_causal, scale, enable_gqa)
    types = tuple(map(type, flags))  # in the key: 1 and True hash alike, and a reason names the value as given
    signature = signature_of(query, key, value, attn_mask)
    if signature is None or any(t not in _PLAIN_FLAGS for t in types):
        return _unsupported_reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    cache_key = (signature, flags, types)
    reason = _reasons.get(cache_key, _reasons)
    if reason is _reasons:
        reason = _unsupported_reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        remember(_reasons, cache_key, reason)
    return reason


def _unsupported_reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> str | None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype != torch.bfloat16:
            return f"dtype {t.dtype}"
        if t.dim() != 4:
            return f"{name} has {t.dim()} dims (supported: [B, H, S, D])"
    try:
        resolve_backend(attention_fwd_kernel, {"query": query, "key": key, "value": value})
    except (NotImplementedError, ValueError) as exc:
        return f"device: {str(exc).split(';')[0]}"
    batch, heads_q, seq_q, head_dim = query.shape
    try:
        kernel_head_dim(head_dim, value.shape[3])
    except ValueError:
        return (f"head_dim {head_dim}" if head_dim == value.shape[3]
                else f"query/key head_dim {head_dim} with value head_dim {value.shape[3]}")
    if key.shape[:3] != value.shape[:3]:
        return f"key {tuple(key.shape)} and value {tuple(value.shape)} differ before the head dim"
    if key.shape[0] != batch or key.shape[3] != head_dim:
        return f"key {tuple(key.shape)} does not match query {tuple(query.shape)} (batch broadcast or head_dim)"
    heads_kv, seq_k = key.shape[1], key.shape[2]
    if heads_q != heads_kv and not enable_gqa:
        return f"query heads {heads_q} != key heads {heads_kv} without enable_gqa"
    if heads_q % heads_kv:
        return f"query heads {heads_q} not a multiple of key heads {heads_kv}"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.stride(-1) != 1:
            return f"{name} head dim not contiguous (stride {t.stride(-1)})"
        if 0 in t.shape:
            return f"{name} is empty"
    if dropout_p != 0.0:
        return f"dropout_p {dropout_p}"
    if scale is not None and (not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0):
        return f"scale {scale!r}"
    if attn_mask is None:
        if is_causal and seq_q != seq_k:
            return f"is_causal with q_len {seq_q} != kv_len {seq_k} (top-left causal)"
        if not is_causal and seq_q != 1:
            return f"not causal (is_causal=False, no attn_mask, q_len {seq_q})"
        return None
    if not isinstance(attn_mask, torch.Tensor):
        return f"attn_mask of type {type(attn_mask).__name__}"
    if is_causal:
        return "attn_mask together with is_causal=True"
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        return f"attn_mask dtype {attn_mask.dtype}"
    if attn_mask.device != query.device:
        return f"attn_mask on {attn_mask.device}, query on {query.device}"
    if attn_mask.dim() not in (2, 3, 4) or tuple(attn_mask.shape[-2:]) != (seq_q, seq_k):
        return f"attn_mask shape {tuple(attn_mask.shape)} (supported: [B|1, H|1, {seq_q}, {seq_k}])"
    lead = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape[:-2])
    if lead[0] not in (1, batch) or lead[1] not in (1, heads_q):
        return f"attn_mask shape {tuple(attn_mask.shape)} does not broadcast to [{batch}, {heads_q}, {seq_q}, {seq_k}]"
    return None


# ---------------------------------------------------------------------------------------------
# Mask -> per-sequence key windows
# ---------------------------------------------------------------------------------------------
class MaskNotCovered(ValueError, NotImplementedError):
    """A mask whose values are not causal + padding (+ the call's window): a ValueError for a direct call (the
    values are wrong for what was asked), a NotImplementedError for transformers' attention route, which then runs
    transformers' own function, counted (e.g. Gemma-3's bidirectional image-token masks, packed-sequence masks)."""


MASK_ANCHOR_ATTR = "detkit_kv_start"  # on a mask tensor: each sequence's first key, in key indices (tag_mask_anchor)


def tag_mask_anchor(mask, padding_mask: torch.Tensor | None, kv_offset, batch: int) -> None:
    """Record on ``mask`` (a tensor transformers built for one forward) each sequence's first valid key in the key
    tensor's indices: the first True of the 2-D ``padding_mask`` [B, seen + q_len] (absolute positions; None: 0)
    minus ``kv_offset`` (the absolute position of key 0; a sliding-window cache that dropped keys makes it > 0, and
    the result negative). A sliding window can hide the first key from every row of the mask itself; this keeps
    the key tiles anchored where a prefill anchors them. No host sync; no device work when the padding mask is 2-D on
    the mask's device and kv_offset an int (``MaskAnchor``, read when the mask is used), else computed here (int32
    [B])."""
    if not isinstance(mask, torch.Tensor):
        return
    if isinstance(kv_offset, int) and not isinstance(kv_offset, bool) and (
            padding_mask is None or (isinstance(padding_mask, torch.Tensor) and padding_mask.dim() == 2
                                     and padding_mask.shape[0] in (1, batch) and padding_mask.device == mask.device)):
        setattr(mask, MASK_ANCHOR_ATTR, MaskAnchor(padding_mask, kv_offset, batch))
        return
    setattr(mask, MASK_ANCHOR_ATTR, anchor_tensor(padding_mask, kv_offset, batch, mask.device))


def mask_anchor(mask: torch.Tensor) -> torch.Tensor | None:
    """The anchor ``tag_mask_anchor`` recorded on ``mask`` as an int32 [B] tensor (None: untagged)."""
    anchor = getattr(mask, MASK_ANCHOR_ATTR, None)
    if isinstance(anchor, MaskAnchor):
        return anchor_tensor(anchor.padding, anchor.kv_offset, anchor.batch, mask.device)
    return anchor


# Masks found causal + padding (+ window), with their key windows, while unwritten: transformers passes one mask
# tensor to every layer of a forward.
_CHECKED_MASKS = TensorMemo(capacity=4)


def checked_windows(attn_mask: torch.Tensor, batch: int, seq_q: int, seq_k: int, window: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.mask_key_windows`` run on the device (masks.py: two launches) with the check enforced: a
    ValueError (one host sync, once per mask tensor and version), or a device-side assert on every call, without a
    sync, under CUDA-graph capture and for inference tensors (they have no version counter, so an in-place change
    could not be told from a cache hit). A sliding-window mask whose
    sequences' first keys it hides (and that carries no anchor, ``tag_mask_anchor``) is refused with a
    NotImplementedError: the key tiles could not be anchored where a prefill anchors them."""
    device_assert = attn_mask.is_cuda and (torch.cuda.is_current_stream_capturing() or attn_mask.is_inference())
    key = (batch, seq_q, seq_k, window, id(getattr(attn_mask, MASK_ANCHOR_ATTR, None)))
    if not device_assert:
        hit = _CHECKED_MASKS.get(attn_mask, key=key)  # never for inference tensors: no version counter
        if hit is not None:
            return hit
    anchor = getattr(attn_mask, MASK_ANCHOR_ATTR, None) if window is not None else None
    kv_start, kv_end, flags = mask_key_windows_device(attn_mask, batch, seq_q, seq_k, window, anchor)
    if device_assert:
        torch._assert_async(flags[:1], "detkit attention: attn_mask is not causal + padding (+ window), or its window "
                            "hides a sequence's first key")
        return kv_start, kv_end
    fine, ok = flags.tolist()  # one host sync
    hidden = ok and not fine
    if not ok:
        raise MaskNotCovered(f"attn_mask (shape {tuple(attn_mask.shape)}, dtype {attn_mask.dtype}) is not causal + "
                         "padding" + (f" + sliding window {window}" if window is not None else "") + ": supported are "
                         "masks where each sequence sees one window of keys and query i its window up to its own "
                         "position, with masked values False, -inf or the dtype's minimum")
    if hidden:
        raise NotImplementedError(f"sliding window {window}: the mask hides a sequence's first key from every query "
                                  "(a decode step past the window) and carries no anchor; build it with detkit's mask "
                                  "function (the 'detkit' mask interface, or the mode's) to anchor the key tiles")
    _CHECKED_MASKS.put(attn_mask, (kv_start, kv_end), key=key)
    return kv_start, kv_end


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
         window: int | None = None):
    """F.scaled_dot_product_attention on the detkit kernels for the cases ``sdpa_unsupported_reason`` accepts
    (NotImplementedError naming the reason otherwise). Returns [B, Hq, Sq, Dv] (stored [B, Sq, Hq, Dv]; with a
    value head dim Dv other than the query/key head dim, a slice of the padded output, as ``attention``).
    ``window`` (an extension): a sliding window, the mask then causal + padding + that window."""
    reason = sdpa_unsupported_reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if reason is not None:
        raise NotImplementedError(f"detkit attention does not cover this scaled_dot_product_attention call: {reason}")
    return sdpa_accepted(query, key, value, attn_mask, scale, window=window)


def sdpa_accepted(query, key, value, attn_mask=None, scale=None, *, window: int | None = None):
    """``sdpa`` for a call its caller has already had ``sdpa_unsupported_reason`` accept (None) with these tensors,
    mask and scale (the mode's SDPA route asks first, to count a refusal before any work): the SDPA-semantics check
    is not repeated; the mask's values and the kernels' own layout checks run as in ``sdpa``."""
    return _run_checked(query, key, value, attn_mask, scale, window)


def _run_checked(query, key, value, attn_mask, scale, window=None, softcap=None, sinks=None):
    """An accepted call: the mask (if any) as per-sequence key windows, then the kernels."""
    if attn_mask is None:
        return attention(query, key, value, scale=scale, window=window, softcap=softcap, sinks=sinks)
    kv_start, kv_end = checked_windows(attn_mask, query.shape[0], query.shape[2], key.shape[2], window)
    return attention(query, key, value, scale=scale, kv_start=kv_start, kv_end=kv_end, window=window,
                     softcap=softcap, sinks=sinks)


def hf_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' AttentionInterface signature (as transformers.integrations.sdpa_attention.sdpa_attention_forward):
    query [B, Hq, Sq, D], key [B, Hkv, Skv, D], value [B, Hkv, Skv, Dv] (not repeated; Dv other than D for MLA), the
    4-D mask transformers builds for SDPA (or None) -> ([B, Sq, Hq, Dv], None). ``sliding_window`` (as transformers
    passes it: a query at position p sees keys > p - sliding_window) runs on the kernels' window; the mask is then
    causal + padding + that window, and a mask that hides a sequence's first key needs the anchor
    ``tag_mask_anchor`` records. ``softcap`` (Gemma-2) and ``s_aux`` / ``sinks`` (gpt-oss's per-head sinks, [Hq])
    run on the kernels' softcap and sinks. ``scaling`` is passed on as the kernels' scale (for MLA: DeepSeek-V3's,
    from the query/key head dim). Refuses by name what it does not cover."""
    if dropout:
        raise NotImplementedError(f"detkit attention: dropout {dropout} is not supported (needs 0.0)")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("detkit attention: position_bias is not supported")
    window = kwargs.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise NotImplementedError(f"detkit attention: sliding_window {window!r} is not supported (needs an int >= 1)")
    softcap = kwargs.get("softcap")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise NotImplementedError(f"detkit attention: softcap {softcap!r} is not supported (needs a finite float > 0)")
    if kwargs.get("s_aux") is not None and kwargs.get("sinks") is not None:
        raise NotImplementedError("detkit attention: both s_aux and sinks given (they name the same thing)")
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dtype not in (torch.bfloat16, torch.float32)
                              or tuple(sinks.shape) != (query.shape[1],) or sinks.device != query.device):
        what = (f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}" if isinstance(sinks, torch.Tensor)
                else type(sinks).__name__)
        raise NotImplementedError(f"detkit attention: sinks (s_aux) {what} are not supported (needs a bfloat16 or "
                                  f"float32 tensor [{query.shape[1]}] on {query.device})")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if not is_causal:
        raise NotImplementedError(f"detkit attention: non-causal attention is not supported "
                                  f"({type(module).__name__}.is_causal is False)")
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise NotImplementedError(f"detkit attention: attention_mask of type {type(attention_mask).__name__} is not "
                                  "supported (needs a tensor mask as transformers builds it for sdpa, or None)")
    seq_q = query.shape[2]
    if attention_mask is None and seq_q > 1 and key.shape[2] > seq_q:
        # transformers leaves the mask out only when the cache was empty (its SDPA path then runs is_causal, which
        # aligns top-left, over the first q_len keys): do the same.
        key, value = key[:, :, :seq_q], value[:, :, :seq_q]
    causal = attention_mask is None and seq_q > 1
    reason = sdpa_unsupported_reason(query, key, value, attention_mask, 0.0, causal, scaling, True)
    if reason is not None:
        raise NotImplementedError(f"detkit attention does not cover this call of {type(module).__name__}: {reason}")
    out = _run_checked(query, key, value, attention_mask, scaling, window, softcap,
                       None if sinks is None else sinks.contiguous())
    return out.transpose(1, 2), None
