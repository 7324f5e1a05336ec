"""Attention for transformers' continuous batching (``model.generate_batch``, the paged KV cache of
``transformers.generation.continuous_batching``) on detkit's packed-sequence kernel.

What transformers hands the attention function on that path (both API shapes below): the query of every request
in the step packed into one row, ``query [1, Hq, Tq, D]``; the 4-D mask it builds for SDPA (block-diagonal,
causal per request); and keyword arguments ``cu_seq_lens_q`` (int32 [n + 1]: request n's queries are rows
``cu_seq_lens_q[n]..cu_seq_lens_q[n + 1]``), ``cu_seq_lens_k``, ``max_length_q`` / ``max_length_k`` (5.17:
``max_seqlen_q`` / ``max_seqlen_k``), ``read_index`` / ``write_index`` (one int64 index tensor per cache allocator:
the cache rows each token is written to, and the rows read back for the attention, request by request, in token
order) and ``block_table`` (None unless the decode fast path is on, which transformers enables only for its
flash-attention implementations). Two shapes of that API exist:

- 5.24 ("the model updates the cache"): the attention layer calls ``cache.update(k, v, layer_idx, kwargs=...)``
  before the attention function; with no block table that writes the new K/V and returns every request's keys,
  cached and new, gathered by ``read_index`` in order: ``key [1, Hkv, Tk, D]``, and it narrows ``cu_seq_lens_k``
  (a dict by layer type before) to the layer's tensor. The model's attention implementation stays "sdpa" (or
  "paged|eager" or a flash one; continuous batching refuses any other name).
- 5.17 ("the attention function updates the cache"): continuous batching switches the model to
  ``"paged|<implementation>"`` and passes ``cache=`` to the attention function, which calls
  ``cache.update(key_states=, value_states=, layer_idx=, read_index=, write_index=)`` itself and gets the gathered
  keys ``[Tk, Hkv, D]``.

``paged_attention_forward`` takes either shape (told apart by ``cache`` in the keyword arguments and the signature
of its ``update``; a third shape is refused by name with the installed version) and runs
``detkit.kernels.attention.attention_varlen`` on the packed queries and the gathered keys with the cumulative
lengths: every request's queries see exactly its own keys, in its own order, whatever other requests share the
step, and the kernel's per-token bits equal its padded layout's (docs/attention.md), the layout a request run alone
with a DynamicCache uses under the mode. A cached prefix (transformers' prefix sharing: a request whose full pages
are already in the cache prefills only the rest) is the same call with fewer queries than keys.

Sliding-window layers (``sliding_window`` W in the keyword arguments, or the layer's own): transformers' paged
sliding cache (5.17 and 5.24 alike: a ring buffer of W slots per request) returns, for a request at position p0
with q new tokens, its min(p0, W - 1) most recent cached keys then the q new ones, in token order, and
``cu_seq_lens_k`` counts those (5.17: its "sliding_attention" entry). The keys before them are dropped, so the
kernel runs with ``window=W`` and each request's ``kv_start`` = cached - p0 (<= 0, the first key's place before the
gathered ones: ``attention_varlen``'s anchor), p0 read from ``position_ids`` at the request's first query: its key
tiles and splits stay anchored at the sequence's first token, as the trainer's forward over the whole sequence
anchors them, and its bits are that forward's. A step where a request's cached keys are fewer than W - 1 while
keys were dropped, more than its position, or ``position_ids`` are missing is refused by name with the installed
version (not what either version passes).

Refused by name (NotImplementedError, one line): a block table (the decode fast path: the keys are not gathered;
transformers disables it for sliding-window models), a sliding-window step that cannot be anchored (above),
dropout, position_bias.

The mode routes this on its own ("sdpa" calls that carry the continuous-batching keyword arguments, 5.24, and
``"paged|sdpa"``, 5.17: mode/attention.py); ``"paged|detkit"`` is registered for a model built with
``attn_implementation="detkit"`` (5.17 prefixes it so).
"""

from __future__ import annotations

import inspect

import torch

from detkit.kernels.attention.host_values import host_values, remember_values

CB_OP = "attention (transformers continuous batching)"
# The keyword arguments that mark a call from transformers' continuous batching (a packed trainer batch passes
# cu_seq_lens_q too, but never the cache's read/write indices).
CB_MARKERS = ("cu_seq_lens_q", "write_index")


def is_continuous_batching_call(kwargs: dict) -> bool:
    """True for an attention call made by transformers' continuous batching (its keyword arguments)."""
    return all(name in kwargs for name in CB_MARKERS)


def _transformers_version() -> str:
    try:
        import transformers
    except ImportError:  # pragma: no cover - only called on transformers' path
        return "not installed"
    return transformers.__version__


def _refuse(what: str) -> NotImplementedError:
    return NotImplementedError(f"detkit paged attention: {what}")


def _update_takes_indices(cache) -> bool:
    """True when ``cache.update`` is 5.17's (read_index=, write_index=: the attention function updates the cache)."""
    try:
        params = inspect.signature(cache.update).parameters
    except (TypeError, ValueError):
        return False
    return "read_index" in params and "write_index" in params


def _per_layer(value, window: int | None, name: str):
    """``value`` or, for a dict by layer type (transformers' per-attention-type lengths), this layer's entry."""
    if not isinstance(value, dict):
        return value
    layer_type = "sliding_attention" if window is not None else "full_attention"
    if layer_type not in value:
        raise _refuse(f"{name} has no entry for {layer_type!r} (has {sorted(value)})")
    return value[layer_type]


def _cu(value, name: str, device: torch.device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() < 2:
        what = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise _refuse(f"{name} {what} is not supported (needs an integer tensor [n + 1])")
    return value.to(device=device, dtype=torch.int32).contiguous()


def _window(module, kwargs: dict) -> int | None:
    """The layer's sliding window: the keyword argument (as the trainer's forward reads it), else the layer's own."""
    window = kwargs.get("sliding_window")
    if window is None:
        window = getattr(module, "sliding_window", None)
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise _refuse(f"sliding_window {window!r} is not supported (needs an int >= 1, or None)")
    return window


def _anchors(positions, window: int, bounds_q: list[int], bounds_k: list[int], device: torch.device
             ) -> torch.Tensor | None:
    """Each request's ``kv_start`` (int32 [n]) for a sliding-window layer: cached - p0, p0 the position of its first
    query (``position_ids``), cached its keys before the new ones; None where no request's keys were dropped. The
    positions are read on the host once a step (``host_values``: every sliding-window layer gets the same tensor)."""
    if (not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.dim() not in (1, 2)
            or (positions.dim() == 2 and positions.shape[0] != 1) or positions.numel() < bounds_q[-1]):
        what = (f"{positions.dtype} {tuple(positions.shape)}" if isinstance(positions, torch.Tensor)
                else type(positions).__name__)
        raise _refuse(f"sliding_window {window}: position_ids {what} from transformers {_transformers_version()} are "
                      f"not supported (needs integer positions [1, Tq], Tq >= {bounds_q[-1]}: each request's first "
                      "query's position anchors its key tiles)")
    requests = [n for n in range(len(bounds_q) - 1) if bounds_q[n + 1] > bounds_q[n]]
    if not requests:
        return None
    flat = host_values(positions)[0]  # one host read per step: every sliding layer gets this tensor
    firsts = [flat[bounds_q[n]] for n in requests]
    starts = [0] * (len(bounds_q) - 1)
    for n, p0 in zip(requests, firsts):
        cached = (bounds_k[n + 1] - bounds_k[n]) - (bounds_q[n + 1] - bounds_q[n])
        dropped = p0 - cached
        if dropped < 0 or (dropped > 0 and cached < window - 1):
            raise _refuse(f"sliding_window {window}: request {n} (first query at position {p0}) has {cached} cached "
                          f"keys before its queries in transformers {_transformers_version()}'s paged cache; "
                          f"supported: all {p0}, or at least the window's {window - 1}")
        starts[n] = -dropped
    if not any(starts):
        return None
    return remember_values(torch.tensor(starts, dtype=torch.int32, device=device), starts)  # varlen's check reads none


def paged_attention_forward(varlen, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-function signature on the continuous-batching path (see the module docstring), run on
    ``varlen`` (``detkit.kernels.attention.attention_varlen``, passed in by mode/attention.py) -> (``[1, Tq, Hq, D]``,
    None). Query rows past ``cu_seq_lens_q[-1]`` (padding) come back as zeros."""
    if dropout:
        raise _refuse(f"dropout {dropout} is not supported (needs 0.0)")
    if kwargs.get("position_bias") is not None:
        raise _refuse("position_bias is not supported")
    if kwargs.get("block_table") is not None:
        raise _refuse("a block_table (transformers' decode fast path) is not supported; supported: the index-based "
                      "cache (block_table None: continuous_batching_config max_blocks_per_request=0)")
    window = _window(module, kwargs)
    if not isinstance(query, torch.Tensor) or query.dim() != 4 or query.shape[0] != 1:
        what = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise _refuse(f"query {what} is not supported (needs the packed [1, Hq, Tq, D])")
    cache = kwargs.get("cache")
    if cache is not None:  # 5.17: the attention function writes and gathers the cache
        if not _update_takes_indices(cache):
            raise _refuse(f"{type(cache).__name__}.update of transformers {_transformers_version()} is not "
                          "supported; supported: update(key_states, value_states, layer_idx, read_index, "
                          "write_index) (5.17) or the model calling update(..., kwargs=) before attention (5.24)")
        for name in ("read_index", "write_index"):
            if name not in kwargs:
                raise _refuse(f"{name} missing from the keyword arguments (transformers {_transformers_version()})")
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                  read_index=kwargs["read_index"], write_index=kwargs["write_index"])
        if key.dim() == 4:  # a later 5.x returning [1, Hkv, Tk, D]
            key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)
    else:  # 5.24: the model's cache.update gathered [1, Hkv, Tk, D]
        if not isinstance(key, torch.Tensor) or key.dim() != 4 or key.shape[0] != 1:
            what = tuple(key.shape) if isinstance(key, torch.Tensor) else type(key).__name__
            raise _refuse(f"key {what} is not supported (needs the gathered [1, Hkv, Tk, D] of transformers "
                          f"{_transformers_version()}'s index-based cache update)")
        key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)
    cu_q = _cu(kwargs.get("cu_seq_lens_q"), "cu_seq_lens_q", query.device)
    cu_k = _cu(_per_layer(kwargs.get("cu_seq_lens_k"), window, "cu_seq_lens_k"), "cu_seq_lens_k", query.device)
    # One host read for the step's first layer; the later layers get the same tensors, remembered (host_values).
    bounds_q, bounds_k = host_values(cu_q, cu_k)
    real_q, real_k = bounds_q[-1], bounds_k[-1]
    total_q = query.shape[2]
    if real_q > total_q or real_k > key.shape[0]:
        raise _refuse(f"cu_seq_lens_q/k end at {real_q}/{real_k}, past the {total_q} queries / {key.shape[0]} keys")
    max_q = max(b - a for a, b in zip(bounds_q, bounds_q[1:]))
    max_k = max(b - a for a, b in zip(bounds_k, bounds_k[1:]))
    anchors = None if window is None else _anchors(kwargs.get("position_ids"), window, bounds_q, bounds_k,
                                                     query.device)
    q = query[0, :, :real_q].transpose(0, 1)  # [Tq, Hq, D], head dim contiguous
    out = varlen(
        q, key[:real_k], value[:real_k], cu_q, cu_k, max(max_q, 1), max(max_k, 1), scale=scaling, window=window,
        kv_start=anchors, softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux", kwargs.get("sinks")))
    if real_q < total_q:  # padding queries (static shapes): zeros, never read
        out = torch.cat([out, out.new_zeros((total_q - real_q, *out.shape[1:]))])
    return out.unsqueeze(0), None
