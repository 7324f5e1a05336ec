"""The attention kernels behind ``torch.nn.functional.scaled_dot_product_attention`` and transformers' attention
interface: the cases with the kernels' semantics are run on them, everything else is refused by name.

Covered (F.scaled_dot_product_attention semantics, BF16, head_dim 64 or 128, [B, H, S, D] with a contiguous head
dim, dropout 0, GQA with enable_gqa):
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
import weakref

import torch

from detkit.kernels.attention.configs import HEAD_DIMS
from detkit.kernels.attention.kernels import attention_fwd_kernel
from detkit.kernels.attention.launch import attention
from detkit.kernels.backend import resolve_backend


def sdpa_unsupported_reason(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False) -> str | None:
    """None when ``sdpa`` runs this F.scaled_dot_product_attention call with the same semantics, else a short
    reason. Host-side only (shapes, dtypes, devices, strides, flags): never reads tensor values."""
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
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim}"
    if key.shape != value.shape:
        return f"key {tuple(key.shape)} and value {tuple(value.shape)} differ"
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
def mask_windows(attn_mask: torch.Tensor, batch: int, seq_q: int, seq_k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_start int32 [B], kv_end int32 [B], ok bool scalar), all on the mask's device, no host sync. ``ok``: the
    mask is exactly causal + one padding window per sequence (rows of padded queries excepted as described in the
    module docstring); then its valid rows see exactly what ``attention(kv_start=, kv_end=)`` gives them."""
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if mask.dtype == torch.bool:
        visible, values_ok = mask, torch.ones((), dtype=torch.bool, device=mask.device)
    else:
        visible = mask == 0
        values_ok = (visible | (mask <= torch.finfo(mask.dtype).min)).all()
    j = torch.arange(seq_k, device=mask.device)
    i = torch.arange(seq_q, device=mask.device)
    # Per row: its first and last visible key; per sequence (over heads and rows): the window and the offset o
    # with row i's last visible key o + i (clipped rows of right padding have less; empty rows none).
    first = torch.where(visible, j, seq_k).amin(-1)  # [B|1, H|1, Sq]
    last = torch.where(visible, j, -1).amax(-1)
    nonempty = last >= 0
    start = first.amin(-1).amin(-1)  # [B|1]
    end = last.amax(-1).amax(-1)
    offset = torch.where(nonempty, last - i, torch.iinfo(torch.int64).min).amax(-1).amax(-1)
    any_visible = end >= 0
    start = torch.where(any_visible, start, seq_k)
    offset = torch.where(any_visible, offset, seq_k - seq_q)
    kv_end = offset + seq_q
    hi = torch.minimum(offset[:, None] + i, end[:, None])  # [B|1, Sq]
    expected = (j >= start[:, None, None, None]) & (j <= hi[:, None, :, None])
    ok = values_ok & (visible == expected).all() & ((kv_end <= seq_k) & (kv_end >= start)).all()
    kv_start = start.to(torch.int32).expand(batch).contiguous()
    kv_end = kv_end.clamp(0, seq_k).to(torch.int32).expand(batch).contiguous()
    return kv_start, kv_end, ok


_MASK_CACHE_SIZE = 4
_mask_cache: dict[int, tuple] = {}  # id(mask) -> (weakref, key, kv_start, kv_end)


def _mask_key(mask: torch.Tensor, batch: int, seq_q: int, seq_k: int) -> tuple:
    return (mask._version, mask.data_ptr(), tuple(mask.shape), mask.stride(), mask.dtype, batch, seq_q, seq_k)


def checked_windows(attn_mask: torch.Tensor, batch: int, seq_q: int, seq_k: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask_windows`` with the check enforced: a ValueError (one host sync, once per mask tensor and version), or
    a device-side assert on every call, without a sync, under CUDA-graph capture and for inference tensors (they
    have no version counter, so an in-place change could not be told from a cache hit)."""
    device_assert = attn_mask.is_cuda and (torch.cuda.is_current_stream_capturing() or attn_mask.is_inference())
    if not device_assert and not attn_mask.is_inference():
        hit = _mask_cache.get(id(attn_mask))
        if hit is not None and hit[0]() is attn_mask and hit[1] == _mask_key(attn_mask, batch, seq_q, seq_k):
            return hit[2], hit[3]
    kv_start, kv_end, ok = mask_windows(attn_mask, batch, seq_q, seq_k)
    if device_assert:
        torch._assert_async(ok, "detkit attention: attn_mask is not causal + padding")
        return kv_start, kv_end
    if not bool(ok):  # one host sync
        raise ValueError(f"attn_mask (shape {tuple(attn_mask.shape)}, dtype {attn_mask.dtype}) is not causal + "
                         "padding: supported are masks where each sequence sees one window of keys and query i its "
                         "window up to its own position, with masked values False, -inf or the dtype's minimum")
    if attn_mask.is_inference():
        return kv_start, kv_end
    if len(_mask_cache) >= _MASK_CACHE_SIZE:
        _mask_cache.pop(next(iter(_mask_cache)))
    _mask_cache[id(attn_mask)] = (weakref.ref(attn_mask), _mask_key(attn_mask, batch, seq_q, seq_k), kv_start, kv_end)
    return kv_start, kv_end


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention on the detkit kernels for the cases ``sdpa_unsupported_reason`` accepts
    (NotImplementedError naming the reason otherwise). Returns [B, Hq, Sq, D] (stored [B, Sq, Hq, D])."""
    reason = sdpa_unsupported_reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if reason is not None:
        raise NotImplementedError(f"detkit attention does not cover this scaled_dot_product_attention call: {reason}")
    return _run_checked(query, key, value, attn_mask, scale)


def _run_checked(query, key, value, attn_mask, scale):
    """An accepted call: the mask (if any) as per-sequence key windows, then the kernels."""
    if attn_mask is None:
        return attention(query, key, value, scale=scale)
    kv_start, kv_end = checked_windows(attn_mask, query.shape[0], query.shape[2], key.shape[2])
    return attention(query, key, value, scale=scale, kv_start=kv_start, kv_end=kv_end)


def hf_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' AttentionInterface signature (as transformers.integrations.sdpa_attention.sdpa_attention_forward):
    query [B, Hq, Sq, D], key/value [B, Hkv, Skv, D] (not repeated), the 4-D mask transformers builds for SDPA (or
    None) -> ([B, Sq, Hq, D], None). Refuses by name what it does not cover."""
    if dropout:
        raise NotImplementedError(f"detkit attention: dropout {dropout} is not supported (needs 0.0)")
    for name in ("sliding_window", "softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"detkit attention: {name} is not supported (got {kwargs[name]!r})")
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
    out = _run_checked(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2), None
