"""Attention launch wrappers (check, allocate, launch) and the autograd function: ``attention`` for padded batches
(prefill, chunked prefill, KV-cache decode), ``attention_varlen`` for packed sequences, ``attention_paged`` for
packed queries over a paged KV cache (forward only), and ``mixed_head_dims``, which runs head dims the tiles do not
have (MLA's value head dim other than its query/key head dim, Phi-3-mini's 96) zero-padded under autograd; without
autograd the forward reads them in place (masked loads). The kernels, their math and the invariance rule are in
kernels.py; the tiles in configs.py."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from detkit.kernels.attention.configs import HEAD_DIMS, AttnConfigs, cdiv, fwd_heads, heads_per_tile, select_configs
from detkit.kernels.attention.kernels import (
    LOG2E, attention_bwd_delta_kernel, attention_bwd_dkdv_kernel, attention_bwd_dq_kernel, attention_fwd_combine_kernel,
    attention_fwd_kernel,
)
from detkit.kernels.attention.host_values import TensorMemo, host_values
from detkit.kernels.attention.names import case_name
from detkit.kernels.backend import (
    CUDA_SM90, MAX_INT32_OFFSET, TRITON_INTERPRETER, PlannedKernel, ensure_thread_cuda_context, resolve_backend,
)


class Sequences(NamedTuple):
    """How the rows of q and k form sequences. Padded: q [B, Hq, Sq, D], k/v [B, Hkv, Skv, D] and per-sequence
    bounds kv_start / kv_end (int32 [B] or None). Varlen: q [Tq, Hq, D], k/v [Tk, Hkv, D] and cu_seqlens; ``anchored``
    (varlen, windowed): bound1 is a view of ``anchored_cu_seqlens_k`` (each sequence's kv_start stored before it).
    A NamedTuple (immutable like a frozen dataclass, a quarter of its construction cost): built on every call."""
    varlen: bool
    batch: int
    seq_q: int  # Sq, or max_seqlen_q
    seq_k: int  # Skv, or max_seqlen_k
    bound0: torch.Tensor | None  # kv_start, or cu_seqlens_q
    bound1: torch.Tensor | None  # kv_end, or cu_seqlens_k
    window: int | None = None  # sliding window: a query at position p sees keys (p - window, p]
    # Paged (with varlen): k/v are page storages [P, page_size, Hkv, D]; key n of sequence b sits in page
    # block_table[b, n // page_size] (int32 [B, max_pages]), at row n % page_size.
    block_table: torch.Tensor | None = None
    page_size: int = 0
    anchored: bool = False

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def padding(self) -> bool:
        """Keys outside every sequence's [kv_start, kv_end) may exist (their gradients must be zero-filled)."""
        return not self.varlen and (self.bound0 is not None or self.bound1 is not None)


class AttentionLaunch(NamedTuple):
    """What ran: the backend, the tiles, the launch's dims and name and whether the forward ran its split grid (one
    program per query tile and split, then the combine pass)."""
    backend: str
    configs: AttnConfigs
    dims: tuple[int, ...]  # (B, Hq, Hkv, Sq, Skv, D) of the launch's name
    split_grid: bool = False

    @property
    def name(self) -> str:
        """The launch's name (``names.case_name``), formatted when asked for (most calls never read it)."""
        return case_name("fwd", *self.dims)


def _scale_of(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale {scale!r} is not supported; supported: a finite float > 0, or None (1/sqrt(head_dim))")
    return float(scale)


class Logits(NamedTuple):
    """What the scores go through besides the scale: ``softcap`` (z = softcap * tanh(z / softcap), Gemma-2) and
    ``sinks`` ([Hq] per-head logits joined to each row's softmax denominator, gpt-oss's learned sinks)."""
    softcap: float | None = None
    sinks: torch.Tensor | None = None


PLAIN_LOGITS = Logits()


def _softcap_of(softcap) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap {softcap!r} is not supported; supported: a finite float > 0, or None")
    return float(softcap)


def _check_sinks(sinks, heads_q: int, device: torch.device) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor or None; got {type(sinks).__name__}")
    if sinks.dtype not in (torch.bfloat16, torch.float32) or tuple(sinks.shape) != (heads_q,) or sinks.device != device:
        raise ValueError(f"sinks must be a bfloat16 or float32 tensor of shape ({heads_q},) (one logit per query head) "
                         f"on {device}; got {sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")
    if not sinks.is_contiguous():
        raise ValueError(f"sinks must be contiguous; got strides {sinks.stride()}")


def _window_of(window) -> int | None:
    if window is None:
        return None
    # At most 2**30: the kernels add the window to 32-bit key positions (a key tile's last query, n + window).
    if isinstance(window, bool) or not isinstance(window, int) or window < 1 or window > 2**30:
        raise ValueError(f"window {window!r} is not supported; supported: an int in [1, 2**30] (a query at position p "
                         "sees keys (p - window, p]), or None")
    return window


def _check_tensor(name: str, t, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: torch.bfloat16")
    shape, strides = tuple(t.shape), t.stride()  # read once: this runs on every decode step's host path
    if len(shape) != dim:
        raise ValueError(f"{name} must be {dim}-D; got shape {shape}")
    if 0 in shape:
        raise ValueError(f"{name} has an empty dimension (shape {shape}); supported: every dim >= 1")
    if strides[-1] != 1:
        raise ValueError(f"{name} has stride {strides[-1]} on its head dim (shape {shape}, strides {strides}); "
                         "supported: a contiguous head dim (stride 1)")
    if min(strides) < 0:
        raise ValueError(f"{name} has negative strides {strides}; supported: non-negative strides")
    # The kernels offset whole sequences in 64 bits and index within one in 32 bits.
    furthest = sum((size - 1) * stride for size, stride in zip(shape[1:], strides[1:]))
    if furthest > MAX_INT32_OFFSET:
        raise ValueError(f"{name} (shape {shape}, strides {strides}) spans element offset {furthest} within one "
                         "sequence; supported: below 2**31 (32-bit indexing within a sequence)")


def _check_bounds_tensor(name: str, t, batch: int, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None; got {type(t).__name__}")
    if t.dtype != torch.int32 or tuple(t.shape) != (batch,) or t.device != device:
        raise ValueError(f"{name} must be an int32 tensor of shape ({batch},) on {device}; got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; got strides {t.stride()}")


def kernel_head_dim(head_dim_qk: int, head_dim_v: int) -> int:
    """The head dim D the kernels run for a query/key head dim and a value head dim: the common one when it is in
    HEAD_DIMS; otherwise (MLA's two head dims, DeepSeek-V3's qk 192 and v 128; one head dim between HEAD_DIMS', as
    Phi-3-mini's 96) the smallest of HEAD_DIMS at least as wide as both: the forward reads the narrower head dims
    masked on its tiles, the autograd path zero-pads to it (``mixed_head_dims``). A ValueError (one line) above the
    widest."""
    if head_dim_qk == head_dim_v and head_dim_qk in HEAD_DIMS:
        return head_dim_qk
    widest = max(head_dim_qk, head_dim_v)
    if widest > HEAD_DIMS[-1] or min(head_dim_qk, head_dim_v) < 1:
        what = (f"head_dim {head_dim_qk}" if head_dim_qk == head_dim_v else
                f"query/key head dim {head_dim_qk} with value head dim {head_dim_v}")
        raise ValueError(f"{what} is not supported; supported: head dims of 1 to {HEAD_DIMS[-1]} ({HEAD_DIMS} as they "
                         "are, others zero-padded to the next of those)")
    return next(d for d in HEAD_DIMS if d >= widest)


# ---------------------------------------------------------------------------------------------
# Signature caches: a check that reads only what a tensor's signature holds (type, shape, strides, dtype, device) is
# run once per signature, never on tensor values. The layers of one forward share their layer kind's signature (a
# growing KV cache changes it once per step, not per layer), so all but the first layer's checks cost a key and a
# lookup. check_padded remembers accepted signatures only (a refusal raises on every call); sdpa_unsupported_reason
# remembers its answer, a reason too (returned, and so counted or raised, on every call).
# ---------------------------------------------------------------------------------------------
MAX_SIGNATURES = 256  # a bound so that a growing cache or a sweep over shapes cannot grow it


def tensor_signature(t) -> tuple | None:
    """What the host-side checks read of ``t``: (type, shape, strides, dtype, device); None for None. Raises
    AttributeError / TypeError / RuntimeError for what has none (not a tensor, a sparse tensor's strides)."""
    if t is None:
        return None
    return type(t), t.shape, t.stride(), t.dtype, t.device


def signature_of(*tensors) -> tuple | None:
    """The signatures of ``tensors`` as one key, or None where one has none (the caller then checks uncached, and
    its check names the problem)."""
    try:
        return tuple(map(tensor_signature, tensors))
    except (AttributeError, TypeError, RuntimeError):
        return None


def remember(cache: dict, key, value) -> None:
    """``cache[key] = value``, the oldest entry dropped first once ``MAX_SIGNATURES`` are held."""
    if len(cache) >= MAX_SIGNATURES:
        cache.pop(next(iter(cache)), None)
    cache[key] = value


_checked_padded: dict = {}  # signature_of(q, k, v, kv_start, kv_end) -> check_padded's result


def check_padded(q, k, v, kv_start=None, kv_end=None) -> tuple[int, int, int, int, int, int]:
    """Refuse what the padded layout does not support; returns (B, Hq, Hkv, Sq, Skv, D), D the query/key head dim
    (v's may differ: ``kernel_head_dim``). Reads signatures only: run once per accepted signature."""
    key = signature_of(q, k, v, kv_start, kv_end)
    dims = _checked_padded.get(key) if key is not None else None
    if dims is None:
        dims = _check_padded(q, k, v, kv_start, kv_end)
        if key is not None:
            remember(_checked_padded, key, dims)
    return dims


def _check_padded(q, k, v, kv_start, kv_end) -> tuple[int, int, int, int, int, int]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 4)
    batch, heads_q, seq_q, head_dim = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape [B, Hkv, Skv] before "
                         "the head dim")
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}: need k [B, Hkv, Skv, D] with q's "
                         "B and D")
    kernel_head_dim(head_dim, v.shape[3])
    heads_kv, seq_k = k.shape[1], k.shape[2]
    if heads_q % heads_kv:
        raise ValueError(f"query heads {heads_q} are not a multiple of key/value heads {heads_kv} (GQA needs "
                         "Hq % Hkv == 0)")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    _check_bounds_tensor("kv_start", kv_start, batch, q.device)
    _check_bounds_tensor("kv_end", kv_end, batch, q.device)
    return batch, heads_q, heads_kv, seq_q, seq_k, head_dim


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple[int, int, int, int]:
    """Refuse what the packed layout does not support; reads cu_seqlens on the host (one sync, or none: remembered
    per tensor by ``host_values``). Returns
    (n sequences, Hq, Hkv, D), D the query/key head dim (v's may differ: ``kernel_head_dim``)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 3)
    total_q, heads_q, head_dim = q.shape
    if k.shape[:2] != v.shape[:2] or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [Tk, Hkv, D] and [Tk, Hkv, Dv] with "
                         f"q's D {head_dim}")
    kernel_head_dim(head_dim, v.shape[2])
    total_k, heads_kv = k.shape[0], k.shape[1]
    if heads_q % heads_kv:
        raise ValueError(f"query heads {heads_q} are not a multiple of key/value heads {heads_kv} (GQA needs "
                         "Hq % Hkv == 0)")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    _check_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, total_k, q.device)
    return cu_seqlens_q.numel() - 1, heads_q, heads_kv, head_dim


def anchored_cu_seqlens_k(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, kv_start, window: int | None
                          ) -> torch.Tensor:
    """Packed sequences whose first keys a sliding-window cache dropped (checked cu_seqlens): ``kv_start`` (int32 [n],
    each <= 0: sequence n's first key lies -kv_start[n] keys before its first row of k) checked on the host (one
    sync), and the buffer the kernels read it from: [kv_start reversed, cu_seqlens_k], returned as the view at
    cu_seqlens_k (the kernels read sequence b's anchor at cu_seqlens_k[-1 - b]: no extra kernel argument). A
    negative kv_start needs a window that reaches no dropped key: the sequence's first query sees keys from
    k_len - q_len - window + 1 on, which must be >= 0 (its first row)."""
    n = cu_seqlens_k.numel() - 1
    if not isinstance(kv_start, torch.Tensor):
        raise TypeError(f"kv_start must be a torch.Tensor or None; got {type(kv_start).__name__}")
    if (kv_start.dtype != torch.int32 or tuple(kv_start.shape) != (n,) or kv_start.device != cu_seqlens_k.device
            or not kv_start.is_contiguous()):
        raise ValueError(f"kv_start must be a contiguous int32 tensor of shape ({n},) (one per sequence) on "
                         f"{cu_seqlens_k.device}; got {kv_start.dtype} {tuple(kv_start.shape)} on {kv_start.device}")
    if window is None:
        raise ValueError("kv_start needs a window: without one every query sees its sequence's first key, which "
                         "must then be in k; supported: kv_start with window=, or kv_start None")
    starts, cu_q, cu_k = host_values(kv_start, cu_seqlens_q, cu_seqlens_k)
    for b, start in enumerate(starts):
        q_len, k_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if start > 0 or start < -2**30:
            raise ValueError(f"kv_start[{b}] = {start} is not supported; supported: an int in [-2**30, 0] (the first "
                             "key lies -kv_start keys before the sequence's first row of k)")
        if start < 0 and q_len and k_len - q_len - window + 1 < 0:
            raise ValueError(f"kv_start[{b}] = {start}: sequence {b}'s first query (key position {k_len - q_len} of "
                             f"its {k_len} keys) sees {window - 1} keys before it, past its first row, into the "
                             f"dropped keys; supported: k_len - q_len >= window - 1 ({window - 1}) where kv_start < 0")
    return torch.cat([kv_start.flip(0), cu_seqlens_k])[n:]


def _check_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q: int, total_k: int | None,
                   device: torch.device) -> list[int]:
    """Check the cumulative lengths on the host (one sync, none where ``host_values`` remembers them): they start at
    0, never decrease and end at the packed length (``total_k`` None: any end, the keys of a paged cache);
    max_seqlen_q / _k cover the longest sequence. Returns the key count of each sequence."""
    named = (("cu_seqlens_q", cu_seqlens_q, total_q), ("cu_seqlens_k", cu_seqlens_k, total_k))
    for name, cu, _ in named:
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(cu).__name__}")
        if (cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2 or cu.device != device
                or not cu.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous int32 tensor [n + 1] (n >= 1) on {device}; got "
                             f"{cu.dtype} {tuple(cu.shape)} on {cu.device}")
    lens = {}
    for (name, cu, total), values in zip(named, host_values(cu_seqlens_q, cu_seqlens_k)):
        steps = [b - a for a, b in zip(values, values[1:])]
        if values[0] != 0 or min(steps) < 0 or (total is not None and values[-1] != total):
            end = "" if total is None else f" and end at the packed length {total}"
            raise ValueError(f"{name} must start at 0{',' if end else ' and'} never decrease{end}; got "
                             f"{values[:8]}{'...' if len(values) > 8 else ''}")
        lens[name] = steps
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q ({cu_seqlens_q.numel()}) and cu_seqlens_k ({cu_seqlens_k.numel()}) must "
                         "describe the same number of sequences")
    for name, value, need in (("max_seqlen_q", max_seqlen_q, max(lens["cu_seqlens_q"])),
                              ("max_seqlen_k", max_seqlen_k, max(lens["cu_seqlens_k"]))):
        if isinstance(value, bool) or not isinstance(value, int) or value < max(need, 1):
            raise ValueError(f"{name} {value!r} is not supported; supported: an int >= the longest sequence "
                             f"({need}) and >= 1")
    return lens["cu_seqlens_k"]


_CHECKED_TABLES = TensorMemo()  # block tables whose needed entries were found inside the storage


def check_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                window=None) -> Sequences:
    """Refuse what the paged layout does not support and return its ``Sequences``. Reads cu_seqlens on the host
    and checks, on the table's device, that every page id a sequence needs lies in the storage (one more sync):
    host syncs, so not under CUDA-graph capture (refused by name). Both are remembered per tensor
    (``host_values``): the layers of a step that share the lengths and the table wait once."""
    _check_tensor("q", q, 3)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t, 4)  # a page's span (all dims but the first) in 32 bits: pages are offset in 64
    total_q, heads_q, head_dim = q.shape
    if k_cache.shape[1] != v_cache.shape[1]:
        raise ValueError(f"k_cache pages hold {k_cache.shape[1]} keys and v_cache pages {v_cache.shape[1]}; "
                         "supported: one page size, k_cache and v_cache [P, page_size, Hkv, D]")
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         f"[P, page_size, Hkv, D] with q's D {head_dim} (v_cache's D may differ: MLA)")
    kernel_head_dim(head_dim, v_cache.shape[3])
    # One head dim: one row offset per key serves both (a register each); MLA's v_cache has its own strides.
    if head_dim == v_cache.shape[3] and k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache strides {k_cache.stride()} and v_cache strides {v_cache.stride()} differ; "
                         "supported: one layout for both (as transformers' and flash's paged caches) when their "
                         "head dims agree")
    num_pages, page_size, heads_kv = k_cache.shape[:3]
    if heads_q % heads_kv:
        raise ValueError(f"query heads {heads_q} are not a multiple of key/value heads {heads_kv} (GQA needs "
                         "Hq % Hkv == 0)")
    if len({q.device, k_cache.device, v_cache.device}) != 1:
        raise ValueError(f"q, k_cache, v_cache must be on one device; got {q.device}, {k_cache.device}, "
                         f"{v_cache.device}")
    if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise NotImplementedError("attention_paged under CUDA-graph capture is not supported: its checks read "
                                  "cu_seqlens and the block table on the host; supported: eager calls")
    for name, t in (("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    n = cu_seqlens_q.numel() - 1
    if (block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != n
            or block_table.device != q.device or block_table.shape[1] < 1):
        raise ValueError(f"block_table must be an int32 tensor [n sequences ({n}), max_pages >= 1] on {q.device}; "
                         f"got {block_table.dtype} {tuple(block_table.shape)} on {block_table.device}")
    if block_table.stride(1) != 1 or block_table.stride(0) < block_table.shape[1]:
        raise ValueError(f"block_table has strides {block_table.stride()}; supported: rows contiguous (stride 1 "
                         "along the pages), any row stride >= the row length")
    lens = _check_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, None, q.device)
    max_pages = block_table.shape[1]
    pages = [cdiv(n_k, page_size) for n_k in lens]
    b = next((b for b, need in enumerate(pages) if need > max_pages), None)
    if b is not None:
        raise ValueError(f"block_table has {max_pages} pages per sequence; sequence {b} has {lens[b]} keys, needing "
                         f"{pages[b]} pages of {page_size}; supported: a table as wide as the longest sequence's "
                         "pages")
    checked = (tuple(pages), num_pages)  # what the table was found to fit: unwritten, it fits again (no sync)
    if _CHECKED_TABLES.get(block_table, key=checked) is None:
        needed = (torch.arange(max_pages, device=q.device)[None, :]
                  < torch.tensor(pages, dtype=torch.int32, device=q.device)[:, None])
        outside = needed & ((block_table < 0) | (block_table >= num_pages))
        if bool(outside.any()):
            b, i = (int(x) for x in outside.nonzero()[0])
            raise ValueError(f"block_table[{b}, {i}] = {int(block_table[b, i])} is not a page of k_cache/v_cache; "
                             f"supported: page ids in [0, {num_pages}) for the {pages[b]} pages sequence {b}'s "
                             f"{lens[b]} keys use")
        _CHECKED_TABLES.put(block_table, True, key=checked)
    return Sequences(True, n, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, _window_of(window),
                     block_table, page_size)


def _strides3(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, sequence) strides of a [B, H, S, D] tensor, or (0, head, token) of a [T, H, D] one."""
    stride = t.stride()  # one call: each stride(i) is a call of its own
    if varlen:
        return 0, stride[1], stride[0]
    return stride[0], stride[1], stride[2]


def _kv_strides(t: torch.Tensor, seqs: Sequences) -> tuple[int, int, int]:
    """k's or v's strides as the forward takes them: ``_strides3``, or of a page storage [P, page_size, H, D]
    (page, head, row within the page)."""
    if seqs.block_table is not None:
        stride = t.stride()
        return stride[0], stride[2], stride[1]
    return _strides3(t, seqs.varlen)


def _lse_strides(seqs: Sequences, heads_q: int, rows: int) -> tuple[int, int]:
    return (0, rows) if seqs.varlen else (heads_q * rows, rows)


def _window_arg(seqs: Sequences) -> int:
    return 0 if seqs.window is None else seqs.window


def _logit_args(logits: Logits, scale: float) -> tuple[float, float]:
    """(qk_scale, tanh_scale): the multiplier into log2 units and, with a softcap c, the tanh's argument scale."""
    if logits.softcap is None:
        return scale * LOG2E, 0.0
    return logits.softcap * LOG2E, scale / logits.softcap


def _bound_args(seqs: Sequences, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dummy = q  # never read: HAS_KV_START / HAS_KV_END are off
    return (seqs.bound0 if seqs.bound0 is not None else dummy, seqs.bound1 if seqs.bound1 is not None else dummy)


def extent_bound(seqs: Sequences) -> int | None:
    """The largest key extent e (keys from a sequence's first key through a row's causal end) a row of the call can
    have, known on the host: Skv (or max_seqlen_k), since the first key is k's first row or later; None where the
    first key may lie before k's first row (a sliding-window cache's negative kv_start, on the device: allowed only
    with a window of at most Skv keys, which no query's window may reach past k's first row)."""
    may_drop = seqs.window is not None and seqs.window <= seqs.seq_k
    if may_drop and (seqs.anchored or (not seqs.varlen and seqs.bound0 is not None)):
        return None
    return seqs.seq_k


def launch_split(configs: AttnConfigs, seqs: Sequences) -> int:
    """The largest split any row of the call can have: the tier of ``extent_bound`` (the last tier's where the host
    knows none). The split grid cuts its programs' key ranges at its edges, which are split edges of every row (each
    tier's split a multiple of the smaller ones'), so each row's split lies in one program."""
    return _split_plan(configs.split_tiers, seqs.seq_k, seqs.window, extent_bound(seqs), 1)[0]


def tile_splits(configs: AttnConfigs, seqs: Sequences, block_q: int) -> int:
    """How many launch splits (``launch_split``) one query tile (``block_q`` query positions) can touch: the split
    grid's programs per tile, before grouping. Without a window its keys start at the sequence's first key, a split
    boundary, and number at most Skv; with one they span at most window + block_q - 1 keys (and no more than Skv)
    from anywhere in a split."""
    return _split_plan(configs.split_tiers, seqs.seq_k, seqs.window, extent_bound(seqs), min(block_q, seqs.seq_q))[1]


def split_slots(configs: AttnConfigs, seqs: Sequences) -> int:
    """The split grid's partial slots per row: the most splits a row of the call can have. A row of tier (E, S) has
    e <= min(E, extent_bound) keys from its first key, so at most ceil(e / S) splits, and under a window its visible
    keys span at most min(window, Skv) from anywhere in a split: at most ceil((span - 1) / S) + 1. The most over the
    tiers a row of the call can reach."""
    return _split_plan(configs.split_tiers, seqs.seq_k, seqs.window, extent_bound(seqs), 1)[2]


@functools.lru_cache(maxsize=MAX_SIGNATURES)
def _split_plan(tiers: tuple, seq_k: int, window: int | None, bound: int | None, queries: int
                ) -> tuple[int, int, int]:
    """(``launch_split``, ``tile_splits``, ``split_slots``) of a call whose rows have key extents up to ``bound`` (None:
    any) and whose query tiles hold ``queries`` positions; cached (a decode step's layers share one call shape)."""
    launch = tiers[-1][1] if bound is None else next(s for top, s in tiers if top is None or bound <= top)
    if window is None:
        per_tile = cdiv(seq_k, launch)
        span = None
    else:
        per_tile = cdiv(min(seq_k, window + queries - 1) - 1, launch) + 1
        span = min(window, seq_k)  # the most keys a row sees
    most, below = 0, 0
    for top, split in tiers:
        if bound is not None and bound <= below:
            break  # no row of the call reaches this tier
        limits = [cdiv(e, split) for e in (top, bound) if e is not None]
        if span is not None:
            limits.append(cdiv(span - 1, split) + 1)
        most = max(most, min(limits))
        below = top
    return launch, per_tile, most


def split_group(configs: AttnConfigs, slots: int, programs_per_split: int) -> int:
    """Consecutive launch splits (``tile_splits`` of them per query tile) per program of the split grid: one per
    program unless ``split_grid_programs`` asks for fewer, longer programs (a batch-1 step at 32k keys: 32 splits of
    1024 keys x 8 KV heads). Speed only: each row's partials are stored on their own whatever the grouping."""
    if not configs.split_grid_programs:
        return 1
    groups = min(slots, max(1, configs.split_grid_programs // programs_per_split))
    return cdiv(slots, groups)


def uses_split_grid(configs: AttnConfigs, seqs: Sequences, heads_q: int, heads_kv: int, capturing: bool) -> bool:
    """Whether the forward runs its split grid (one program per query tile and split, then the combine pass): when
    a query tile can touch more than one split and the one-pass grid has fewer than ``split_grid_below`` programs,
    and -- outside CUDA-graph capture (``capturing``) -- the keys number at least ``eager_split_grid_min_keys``. A
    speed choice only: both grids give the same bits."""
    if not capturing and seqs.seq_k < configs.eager_split_grid_min_keys:
        return False
    heads = fwd_heads(configs, heads_q // heads_kv, heads_kv, seqs.batch, seqs.seq_q)
    return _small_grid(configs, seqs, heads_q, heads_kv, heads, configs.fwd.block_m // heads)


def _small_grid(configs: AttnConfigs, seqs: Sequences, heads_q: int, heads_kv: int, heads: int, block_q: int) -> bool:
    """``uses_split_grid`` under capture: a query tile touches more than one split and the grid is small."""
    programs = heads_kv * (heads_q // heads_kv // heads) * cdiv(seqs.seq_q, block_q) * seqs.batch
    return programs < configs.split_grid_below and tile_splits(configs, seqs, block_q) > 1


# ---------------------------------------------------------------------------------------------
# Launch plans: each kernel launched through PlannedKernel (kernels/backend.py) on a GPU, with every argument in
# the kernel's parameter order; what a call's launch depends on beyond its shapes is worked out once per
# (backend, head dims, heads, tiles, variant flags) and cached.
# ---------------------------------------------------------------------------------------------
PLANNED = {name: PlannedKernel(kernel) for name, kernel in (
    ("fwd", attention_fwd_kernel), ("combine", attention_fwd_combine_kernel), ("delta", attention_bwd_delta_kernel),
    ("dkdv", attention_bwd_dkdv_kernel), ("dq", attention_bwd_dq_kernel))}
# Cached launch statics: one per model layer kind (head dims, heads, variant flags) and tile set, in practice a few.
MAX_STATICS = 256


def _launch(name: str, grid: tuple[int, int, int], args: list, options: dict, plans: bool) -> None:
    """``kernel[grid](*args, **options)`` for the kernel ``name``: through its launch plan (``plans``; Triton's own
    launch under the interpreter), or Triton's own launch (``plans=False``: tools and tests comparing the two)."""
    planned = PLANNED[name]
    if plans:
        planned.launch(grid, args, options)
    else:
        planned.kernel[grid](*args, **options)


def _constexprs(name: str, values: dict) -> tuple:
    """The kernel's constexpr arguments in its parameter order (they are its last parameters)."""
    names = PLANNED[name].names
    tail = names[len(names) - len(values):]
    if set(tail) != set(values):
        raise TypeError(f"attention kernel {name!r}: constexprs {sorted(values)} are not its last parameters {tail}")
    return tuple(values[n] for n in tail)


class _FwdStatic(NamedTuple):
    """What a forward launch depends on beyond the call's shapes and tensors."""
    head_dim: int
    configs: AttnConfigs
    heads: int  # query heads per tile; 0: per call (configs.split_heads_below)
    options: dict  # launch options of the forward kernel
    tails: dict  # (heads, split grid) -> the forward's constexprs; (heads, "combine") -> the combine pass's


@functools.lru_cache(maxsize=MAX_STATICS)
def _fwd_static(backend: str, dim_qk: int, dim_v: int, heads_q: int, heads_kv: int, configs: AttnConfigs | None,
                flags: tuple, softcap: bool, sinks: bool, page_size: int) -> _FwdStatic:
    head_dim = kernel_head_dim(dim_qk, dim_v)
    configs = configs or select_configs(backend, head_dim)
    cfg = configs.fwd
    heads = 0 if configs.split_heads_below else heads_per_tile(heads_q // heads_kv, cfg.block_m)
    stages = configs.paged_stages if flags[5] else cfg.num_stages  # flags[5]: PAGED (_seq_flags)
    return _FwdStatic(head_dim, configs, heads, {"num_warps": cfg.num_warps, "num_stages": stages}, {})


def _fwd_tail(static: _FwdStatic, heads: int, what, dim_qk: int, dim_v: int, flags: tuple, softcap: bool,
              sinks: bool, page_size: int, prefetch: bool = False) -> tuple:
    """The constexprs of the forward (``what``: whether it runs the split grid; ``prefetch``: whether a paged launch
    reads its table entries a tile ahead) or of its combine pass (``what == "combine"``), built once per static,
    heads and those choices."""
    key = (heads, what, prefetch)
    tail = static.tails.get(key)
    if tail is None:
        varlen, has_start, has_end, interpreted, windowed, paged = flags
        cfg = static.configs.fwd
        common = {"HEAD_DIM": static.head_dim, "DIM_V": dim_v, "BLOCK_M": cfg.block_m, "HEADS": heads,
                  "VARLEN": varlen, "HAS_KV_START": has_start, "HAS_KV_END": has_end, "INTERPRETED": interpreted,
                  "WINDOWED": windowed, "HAS_SINKS": sinks}
        common.update(split_constexprs(static.configs.split_tiers))
        if what == "combine":
            tail = _constexprs("combine", {**common, "BLOCK_M": combine_rows(heads)})
        else:
            pages = tile_pages(static.configs.paged_tile_page and paged and not has_start, cfg.block_n, page_size)
            # Speed only: the first tile's entries read early where no window moves a program's first tile.
            early = bool(pages) and static.configs.paged_early_pages and not windowed
            prefetch = bool(pages) and prefetch
            tail = _constexprs("fwd", {**common, "DIM_QK": dim_qk, "BLOCK_N": cfg.block_n, "SOFTCAP": softcap,
                                       "SPLIT_GRID": what, "PAGED": paged, "PAGE_SIZE": page_size,
                                       "TILE_PAGES": pages, "EARLY_PAGES": early, "PREFETCH_PAGES": prefetch})
        static.tails[key] = tail
    return tail


def tile_pages(enabled: bool, block_n: int, page_size: int) -> int:
    """The paged forward's table entries a key tile (its TILE_PAGES; speed only, the same rows are read): where
    ``enabled`` (``AttnConfigs.paged_tile_page``), 1 where a page holds whole key tiles, block_n / page_size where a
    tile holds whole pages; otherwise 0, one entry a key."""
    if not enabled:
        return 0
    if page_size % block_n == 0:
        return 1
    return block_n // page_size if block_n % page_size == 0 else 0


def split_constexprs(tiers: tuple[tuple[int | None, int], ...]) -> dict:
    """The kernels' split constexprs (SPLIT_E0, SPLIT_E1, SPLIT_N0..N2) of a checked tier table
    (``AttnConfigs.split_tiers``, up to three tiers): a table of fewer tiers repeats its last split (and bound, which
    then chooses between equal splits)."""
    bounds = [b for b, _ in tiers[:-1]] or [0]
    splits = [s for _, s in tiers]
    bounds += bounds[-1:] * (2 - len(bounds))
    splits += splits[-1:] * (3 - len(splits))
    return {"SPLIT_E0": bounds[0], "SPLIT_E1": bounds[1], "SPLIT_N0": splits[0], "SPLIT_N1": splits[1],
            "SPLIT_N2": splits[2]}


def _seq_flags(seqs: Sequences, interpreted: bool) -> tuple:
    """(VARLEN, HAS_KV_START, HAS_KV_END, INTERPRETED, WINDOWED, PAGED): a call's variant flags."""
    varlen = seqs.varlen
    return (varlen, (seqs.bound0 is not None and not varlen) or seqs.anchored, seqs.bound1 is not None and not varlen,
            interpreted, seqs.window is not None, seqs.block_table is not None)


def clear_launch_plans() -> None:
    """Forget the attention kernels' launch plans and cached statics (rebuilt on the next calls): for tools and tests
    that change the config table."""
    _fwd_static.cache_clear()
    _bwd_static.cache_clear()
    for planned in PLANNED.values():
        planned.plans.clear()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def attention_fwd_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: Sequences, scale: float,
                         configs: AttnConfigs | None = None, logits: Logits = PLAIN_LOGITS, plans: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor, AttentionLaunch]:
    """Run the forward on checked inputs: (o, lse, launch). o has q's logical shape with v's head dim Dv, stored
    [B, Sq, Hq, Dv] (or [Tq, Hq, Dv]) so transformers' [B, Sq, Hq, Dv] output is a free transpose; lse [B, Hq, Sq]
    (or [Hq, Tq]) FP32. Head dims the tiles do not have run on D = ``kernel_head_dim(Dqk, Dv)``'s tiles, read in
    place by masked loads: the bits of the same call on copies zero-padded to D (kernels.py). A small grid (a decode
    step at small batch) runs one program per (query tile, split) and a combine pass; any other one program per
    query tile over all its splits: the same bits (kernels.py). ``plans=False``: Triton's own launch instead of the
    launch plans (the same compiled kernels and arguments; tools and tests compare the two)."""
    backend = resolve_backend(attention_fwd_kernel, {"q": q, "k": k, "v": v})
    interpreted = backend == TRITON_INTERPRETER
    dim_qk, dim_v = q.shape[-1], v.shape[-1]
    varlen, batch, seq_q, seq_k = seqs.varlen, seqs.batch, seqs.seq_q, seqs.seq_k
    paged = seqs.block_table is not None
    heads_q, heads_kv = q.shape[1], k.shape[-2 if paged else 1]  # [B, H, S, D] and [T, H, D] alike
    softcap, sinks = logits
    flags = _seq_flags(seqs, interpreted)
    page_size = max(seqs.page_size, 1)
    static = _fwd_static(backend, dim_qk, dim_v, heads_q, heads_kv, configs, flags, softcap is not None,
                         sinks is not None, page_size)
    configs = static.configs
    heads = static.heads or fwd_heads(configs, heads_q // heads_kv, heads_kv, batch, seq_q)
    block_q = configs.fwd.block_m // heads
    device = q.device
    if varlen:
        rows = q.shape[0]
        o = torch.empty((rows, heads_q, dim_v), dtype=q.dtype, device=device)
        lse = torch.empty((heads_q, rows), dtype=torch.float32, device=device)
        lse_strides = (0, rows)
    else:
        rows = q.shape[2]
        # [B, Hq, Sq, Dv] stored [B, Sq, Hq, Dv]: one allocation with those strides (a transposed empty costs a call)
        o = torch.empty_strided((batch, heads_q, rows, dim_v), (rows * heads_q * dim_v, dim_v, heads_q * dim_v, 1),
                                dtype=q.dtype, device=device)
        lse = torch.empty((batch, heads_q, rows), dtype=torch.float32, device=device)
        lse_strides = (heads_q * rows, rows)
    if not interpreted:
        ensure_thread_cuda_context(device)
    head_programs = heads_kv * (heads_q // heads_kv // heads)
    # The eager-keys bound is checked last: reading the capture state costs host time a decode step would pay.
    split_grid = (_small_grid(configs, seqs, heads_q, heads_kv, heads, block_q)
                  and (seq_k >= configs.eager_split_grid_min_keys or (not interpreted and _capturing(device))))
    ws_rows = lse.numel()
    if split_grid:
        # Programs cut the keys at the launch split's edges; each row's partials go to its own slots (split_slots).
        launch, programs_per_tile, slots = _split_plan(configs.split_tiers, seq_k, seqs.window, extent_bound(seqs),
                                                       min(block_q, seq_q))
        tiles = launch // configs.fwd.block_n
        # The partials in one buffer: acc [slots, rows, Dv], then m and l [slots, rows] (FP32), each part starting
        # on 16 bytes so that every call specialises the pointers alike (one binary whatever the batch).
        n = slots * ws_rows
        n16 = cdiv(n, 4) * 4
        n_acc = cdiv(n * dim_v, 4) * 4
        ws = torch.empty(n_acc + 2 * n16, dtype=torch.float32, device=device)
        ws_acc, ws_m, ws_l = ws.split_with_sizes([n_acc, n16, n16])  # Tensor.split's Python wrapper costs a call
    else:
        tiles, programs_per_tile, slots, ws_acc, ws_m, ws_l = 1, 1, 1, lse, lse, lse  # never read or written
    # Paged K/V groups splits only where its table entry says so (configs.paged_grouped). Speed only: the partials
    # are the same either way.
    group = (split_group(configs, programs_per_tile, head_programs * cdiv(seq_q, block_q) * batch)
             if split_grid and (configs.paged_grouped or not paged) else 1)
    qk_scale, tanh_scale = _logit_args(logits, scale)
    sinks_arg = sinks if sinks is not None else q  # never read without HAS_SINKS
    table = seqs.block_table if paged else lse  # never read without PAGED
    window = _window_arg(seqs)
    bound0, bound1 = _bound_args(seqs, q)
    o_strides = _strides3(o, varlen)
    tails = static.tails
    grid = (head_programs * cdiv(programs_per_tile, group), cdiv(seq_q, block_q), batch)
    # Speed only (the same entries): a paged launch of few programs reads each tile's table entries a tile ahead.
    prefetch = paged and (configs.paged_prefetch_pages or grid[0] * grid[1] * grid[2] < configs.paged_prefetch_below)
    tail = tails.get((heads, split_grid, prefetch)) or _fwd_tail(static, heads, split_grid, dim_qk, dim_v, flags,
                                                                  softcap is not None, sinks is not None, page_size,
                                                                  prefetch)
    _launch("fwd", grid, [
        q, k, v, o, lse, bound0, bound1, table, ws_m, ws_l, ws_acc,
        *_strides3(q, varlen), *_kv_strides(k, seqs), *_kv_strides(v, seqs), *o_strides, *lse_strides,
        table.stride(0) if paged else 0, batch, heads_q, heads_kv, seq_q, seq_k,
        qk_scale, window, tanh_scale, sinks_arg, slots, ws_rows, group, tiles, *tail], static.options, plans)
    if split_grid:
        tail = tails.get((heads, "combine", False)) or _fwd_tail(static, heads, "combine", dim_qk, dim_v, flags,
                                                                 softcap is not None, sinks is not None, page_size)
        _launch("combine", (head_programs, cdiv(seq_q, combine_rows(heads) // heads), batch), [
            o, lse, bound0, bound1, ws_m, ws_l, ws_acc, sinks_arg, *o_strides, *lse_strides,
            batch, heads_q, heads_kv, seq_q, seq_k, window, slots, ws_rows, *tail], COMBINE_OPTIONS, plans)
    return o, lse, AttentionLaunch(backend, configs, (batch, heads_q, heads_kv, seq_q, seq_k, static.head_dim),
                                   split_grid)


# The combine pass: rows per program (at least one position of the tile's heads), and its warps. It holds five
# [rows, D] FP32 tiles (the folded state and four prefetched partials; D = 256: 80 registers a thread at 4 warps);
# no MMA. 16 rows, not the forward's 64: a decode step's tile has one position, so the rest are masked lanes.
COMBINE_ROWS = 16
COMBINE_WARPS = 4
COMBINE_OPTIONS = {"num_warps": COMBINE_WARPS}


def combine_rows(heads: int) -> int:
    """Rows per program of the combine pass: COMBINE_ROWS, or one position of ``heads`` query heads if more."""
    return max(COMBINE_ROWS, heads)


DELTA_BLOCK = 64


class _BwdStatic(NamedTuple):
    """What a backward launch depends on beyond the call's shapes and tensors: per kernel (delta, dkdv, dq) its
    heads per tile (dkdv, dq), its constexprs and its launch options."""
    configs: AttnConfigs
    heads: tuple[int, int]  # dkdv's, dq's
    tails: tuple[tuple, tuple, tuple]
    options: tuple[dict, dict, dict]


@functools.lru_cache(maxsize=MAX_STATICS)
def _bwd_static(backend: str, head_dim: int, heads_q: int, heads_kv: int, configs: AttnConfigs | None, flags: tuple,
                softcap: bool) -> _BwdStatic:
    configs = configs or select_configs(backend, head_dim)
    group = heads_q // heads_kv
    varlen, has_start, has_end, interpreted, windowed, _ = flags
    common = {"HEAD_DIM": head_dim, "VARLEN": varlen, "HAS_KV_START": has_start, "HAS_KV_END": has_end,
              "INTERPRETED": interpreted, "WINDOWED": windowed, "SOFTCAP": softcap}
    heads, tails, options = [], [_constexprs("delta", {"HEAD_DIM": head_dim, "BLOCK": DELTA_BLOCK})], [{}]
    for name in ("dkdv", "dq"):
        cfg = getattr(configs, name)
        h = heads_per_tile(group, cfg.block_m)
        heads.append(h)
        tails.append(_constexprs(name, {**common, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "HEADS": h}))
        options.append({"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    return _BwdStatic(configs, tuple(heads), tuple(tails), tuple(options))


def attention_bwd_launch(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                         lse: torch.Tensor, seqs: Sequences, scale: float, configs: AttnConfigs | None = None,
                         logits: Logits = PLAIN_LOGITS, plans: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dq, dk, dv, dsinks) for the saved forward (o, lse). Keys outside every sequence's window get exact zeros.
    The kernels need nothing for the sinks (lse includes them); dsinks (None without sinks) =
    -sum over rows of p_sink * delta, in torch: rows are reduced in an order fixed by the shapes. ``plans`` as for
    ``attention_fwd_launch``."""
    backend = resolve_backend(attention_fwd_kernel, {"q": q, "k": k, "v": v, "do": do})
    interpreted = backend == TRITON_INTERPRETER
    if do.stride(-1) != 1:  # autograd may hand an expanded gradient (e.g. of a sum): the kernels index D densely
        do = do.contiguous()
    varlen = seqs.varlen
    head_dim = q.shape[-1]
    heads_q, heads_kv = q.shape[1], k.shape[1]
    group = heads_q // heads_kv
    rows = q.shape[0] if varlen else q.shape[2]
    batch = 1 if varlen else seqs.batch
    static = _bwd_static(backend, head_dim, heads_q, heads_kv, configs, _seq_flags(seqs, interpreted),
                         logits.softcap is not None)
    configs = static.configs
    if not interpreted:
        ensure_thread_cuda_context(q.device)
    lse_strides = _lse_strides(seqs, heads_q, rows)
    delta = torch.empty_like(lse)
    _launch("delta", (cdiv(rows, DELTA_BLOCK), heads_q, batch), [
        o, do, delta, *_strides3(o, varlen), *_strides3(do, varlen), *lse_strides, rows, *static.tails[0]],
        static.options[0], plans)
    dq = torch.empty_like(q)
    alloc = torch.zeros_like if seqs.padding else torch.empty_like
    dk = alloc(k)
    dv = alloc(dk)  # dk's strides: the kernel stores both through one set
    common = (*_strides3(q, varlen), *_strides3(k, varlen), *_strides3(v, varlen), *_strides3(do, varlen),
              *lse_strides)
    qk_scale, tanh_scale = _logit_args(logits, scale)
    bound0, bound1 = _bound_args(seqs, q)
    sizes = (seqs.batch, heads_q, heads_kv, seqs.seq_q, seqs.seq_k, qk_scale, scale, _window_arg(seqs), tanh_scale)
    heads_dq = static.heads[1]
    # Windowed, the key tiles may be anchored before key 0 (a negative kv_start): one more tile covers the tensor.
    key_tiles = cdiv(seqs.seq_k, configs.dkdv.block_n) + (seqs.window is not None)
    _launch("dkdv", (heads_kv, key_tiles, seqs.batch), [
        q, k, v, do, lse, delta, dk, dv, bound0, bound1, *common, *_strides3(dk, varlen), *sizes, *static.tails[1]],
        static.options[1], plans)
    _launch("dq", (heads_kv * (group // heads_dq), cdiv(seqs.seq_q, configs.dq.block_m // heads_dq), seqs.batch), [
        q, k, v, do, lse, delta, dq, bound0, bound1, *common, *_strides3(dq, varlen), *sizes, *static.tails[2]],
        static.options[2], plans)
    dsinks = None
    if logits.sinks is not None:
        # p_sink = 2^(s log2(e) - lse), s log2(e) rounded as the forward rounds it; lse [B, Hq, Sq] or [Hq, Tq].
        sink = (logits.sinks.float() * LOG2E).view(-1, 1)
        weighted = torch.exp2(sink - lse) * delta
        dsinks = -(weighted.sum(-1) if varlen else weighted.sum(-1).sum(0))
        dsinks = dsinks.to(logits.sinks.dtype)
    return dq, dk, dv, dsinks


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, seqs: Sequences, scale: float, softcap: float | None,
                configs: AttnConfigs | None):
        logits = Logits(softcap, sinks)
        o, lse, _ = attention_fwd_launch(q, k, v, seqs, scale, configs, logits)
        ctx.save_for_backward(q, k, v, o, lse, sinks)
        ctx.seqs, ctx.scale, ctx.softcap, ctx.configs = seqs, scale, softcap, configs
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = attention_bwd_launch(do, q, k, v, o, lse, ctx.seqs, ctx.scale, ctx.configs,
                                                  Logits(ctx.softcap, sinks))
        return dq, dk, dv, dsinks, None, None, None, None


def _run(q, k, v, seqs: Sequences, scale: float, configs: AttnConfigs | None, logits: Logits = PLAIN_LOGITS
         ) -> torch.Tensor:
    """Autograd (the trainer): the autograd function, on zero-padded copies for head dims the tiles do not have
    (``mixed_head_dims``). Otherwise (inference: decode, prefill, packed) the forward alone, which reads such head
    dims in place with masked loads: the same bits as the padded copies (kernels.py)."""
    sinks = logits.sinks
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        if v.shape[-1] != q.shape[-1] or q.shape[-1] not in HEAD_DIMS:
            return mixed_head_dims(q, k, v, seqs, scale, configs, logits)
        return _AttentionFunction.apply(q, k, v, sinks, seqs, scale, logits.softcap, configs)
    return attention_fwd_launch(q, k, v, seqs, scale, configs, logits)[0]


def mixed_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: Sequences, scale: float,
                    configs: AttnConfigs | None = None, logits: Logits = PLAIN_LOGITS) -> torch.Tensor:
    """Head dims the tiles do not have (checked inputs: a value head dim Dv other than the query/key head dim Dqk,
    MLA's, or one head dim between HEAD_DIMS', Phi-3-mini's 96) zero-padded, the path autograd takes (the backward
    kernels take one head dim): q, k and v padded along the head dim to D = ``kernel_head_dim(Dqk, Dv)``, the output
    sliced back to Dv. A zero product adds exactly (x + 0 = x, truncated or not), so the logits are the unpadded
    dot's terms plus exact zeros and the padded output columns are exact zeros; ``scale`` is the caller's
    (1/sqrt(Dqk) by default, never 1/sqrt(D)). The forward without autograd reads the same head dims in place with
    masked loads on D's tiles, whose zeros are these copies' (kernels.py): the two give the same bits, so the
    invariance rule holds across them as for D. Autograd runs through the pad (its backward a slice) and the slice
    (its backward a zero pad): no reduction is added. Costs: the padded copies of q, k and v on every call (and
    what the backward saves), D/Dqk the QK work and D/Dv the PV work."""
    dim = kernel_head_dim(q.shape[-1], v.shape[-1])
    q, k, v_padded = (t if t.shape[-1] == dim else F.pad(t, (0, dim - t.shape[-1])) for t in (q, k, v))
    return _run(q, k, v_padded, seqs, scale, configs, logits)[..., :v.shape[-1]]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
              kv_start: torch.Tensor | None = None, kv_end: torch.Tensor | None = None, window: int | None = None,
              softcap: float | None = None, sinks: torch.Tensor | None = None,
              configs: AttnConfigs | None = None) -> torch.Tensor:
    """Causal GQA attention: q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv] (BF16, head dim contiguous) ->
    [B, Hq, Sq, Dv] (stored [B, Sq, Hq, Dv]). Dv = D runs as it is (D in HEAD_DIMS); another Dv (MLA), or a D between
    HEAD_DIMS', runs on kernel_head_dim(D, Dv)'s tiles: read in place by masked loads, or under autograd zero-padded
    (``mixed_head_dims``; the output then a slice of one stored [B, Sq, Hq, kernel_head_dim(D, Dv)]), with the same
    bits. Query i sits at key position kv_end - Sq + i (kv_end = Skv when None) and sees keys kv_start..its own position
    (kv_start int32 [B], the first valid key: left padding; None = 0). ``kv_end`` (int32 [B], one past each sequence's
    last key: a static cache's filled length) is an extension; queries of padded positions give finite values nobody
    should read. Autograd gives dq, dk, dv (no atomics). ``window``: a sliding window, query at position p sees keys (p
    - window, p] (positions in key indices, so decode and prefill agree); with it ``kv_start`` may be negative: the
    sequence's first key lies -kv_start keys before k's first row (dropped by a sliding-window cache; the key tiles stay
    anchored there), allowed while no query's window reaches a dropped key (NaN outputs otherwise). ``softcap``: logits
    z = softcap * tanh(z / softcap) (Gemma-2). ``sinks`` ([Hq], BF16 or FP32, gpt-oss's ``s_aux``): a per-head logit
    joined to each row's softmax denominator (no value); autograd gives its gradient. ``configs``: tiles other than the
    pinned table's (tests and sweeps)."""
    batch, heads_q, _, seq_q, seq_k, head_dim = check_padded(q, k, v, kv_start, kv_end)
    _check_sinks(sinks, heads_q, q.device)
    seqs = Sequences(False, batch, seq_q, seq_k, kv_start, kv_end, _window_of(window))
    return _run(q, k, v, seqs, _scale_of(scale, head_dim), configs, Logits(_softcap_of(softcap), sinks))


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, scale: float | None = None,
                     window: int | None = None, kv_start: torch.Tensor | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None, configs: AttnConfigs | None = None) -> torch.Tensor:
    """Packed sequences: q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] -> [Tq, Hq, Dv]; sequence n is rows
    cu_seqlens_q[n]..cu_seqlens_q[n+1] of q and cu_seqlens_k[n]..cu_seqlens_k[n+1] of k, its queries the last of its
    keys (causal, bottom-right). The same bits per token as the padded layout. cu_seqlens are read on the host (checked;
    one sync, none for tensors already read and unwritten since: ``host_values``). ``window`` as for ``attention``, per
    sequence; with it ``kv_start`` (int32 [n], each <= 0, or None) as the padded layout's negative kv_start: sequence
    n's first key lies -kv_start[n] keys before its first row of k (dropped by a sliding-window cache; its key tiles and
    splits stay anchored there, so its bits equal the padded layout's over the whole sequence), allowed where no query's
    window reaches a dropped key (checked on the host: ``anchored_cu_seqlens_k``). ``softcap``, ``sinks`` and Dv as for
    ``attention``."""
    n, heads_q, _, head_dim = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_sinks(sinks, heads_q, q.device)
    window = _window_of(window)
    anchored = kv_start is not None
    if anchored:
        cu_seqlens_k = anchored_cu_seqlens_k(cu_seqlens_q, cu_seqlens_k, kv_start, window)
    seqs = Sequences(True, n, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, window, anchored=anchored)
    return _run(q, k, v, seqs, _scale_of(scale, head_dim), configs, Logits(_softcap_of(softcap), sinks))


def attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                    scale: float | None = None, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, configs: AttnConfigs | None = None) -> torch.Tensor:
    """Packed queries over a paged KV cache, forward only (inference): q [Tq, Hq, D] as ``attention_varlen``'s (sequence
    n's queries are rows cu_seqlens_q[n]..cu_seqlens_q[n + 1], the last of its keys); k_cache, v_cache [P, page_size,
    Hkv, D] page storages (transformers' paged cache and flash's layout; any strides, the same for both, with the head
    dim contiguous; v_cache's head dim Dv may differ, MLA's, each then with its own strides); block_table int32 [n,
    max_pages]: sequence n's key j sits in page block_table[n, j // page_size], row j % page_size; it has cu_seqlens_k[n
    + 1] - cu_seqlens_k[n] keys (cu_seqlens_k counts keys, not storage rows). Table entries past a sequence's pages are
    never read (transformers pads them with -1). -> [Tq, Hq, Dv]. Head dims the tiles do not have are read in place
    (masked loads), as ``attention_varlen``'s forward reads them. The bits equal ``attention_varlen``'s on the same keys
    gathered into a contiguous packing, for any page size and page placement. Checks read cu_seqlens and the block
    table's needed entries on the host (syncs; refused under CUDA-graph capture): page ids outside [0, P), a table too
    narrow for a sequence's keys, mismatched page sizes, and everything ``attention_varlen`` checks. ``window``,
    ``softcap``, ``sinks`` as for ``attention``. No autograd (a paged cache is inference only): inputs that require grad
    are refused while grad is enabled."""
    _check_tensor("q", q, 3)
    _check_sinks(sinks, q.shape[1], q.device)
    logits, scale = Logits(_softcap_of(softcap), sinks), _scale_of(scale, q.shape[-1])
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (q, k_cache, v_cache, sinks)):
        raise NotImplementedError("attention_paged has no backward (a paged KV cache is inference only); supported: "
                                  "inputs that do not require grad, or a call under torch.no_grad()")
    seqs = check_paged(q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       window)
    return attention_fwd_launch(q, k_cache, v_cache, seqs, scale, configs, logits)[0]


SUPPORTED_BACKENDS = (CUDA_SM90, TRITON_INTERPRETER)
