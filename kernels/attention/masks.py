"""A transformers attention mask read as per-sequence key windows on the device, in two launches: what
``sdpa.checked_windows`` runs for every mask it has not seen (for every call under CUDA-graph capture and in inference
mode). The pure-torch reference is ``reference.mask_key_windows``; the outputs are equal
(tests/test_attention_masks.py).

Why kernels: the reference's per-row firsts and lasts, its reductions and its comparison with the expected mask are
about thirty-five torch operations; a decode step of a model whose attention gets a mask (a sliding window, or a
padded batch) paid them on every layer, in host time in eager use and in GPU launches in a graph.

The check without comparing the mask to a built one: a row's visible keys equal the interval [lo, hi] exactly when
their count is hi - lo + 1 and (count 0, or the first is lo and the last is hi). So one pass over the mask keeps four
numbers a row (``mask_row_stats_kernel``: first and last visible key, their count, whether a masked value is neither
-inf nor the dtype's lowest), and one program (``mask_windows_kernel``) reduces them per sequence (start, end, offset,
first nonempty row, as the reference) and checks each row's four numbers against its expected interval.

Outputs, one int32 buffer: kv_start [B], kv_end [B] (each at a 16-byte boundary), then two flags: ``fine`` (1 when the
mask is causal + padding (+ window) and, without an anchor, no window hides a sequence's first key) and ``covered``
(1 when the mask's values are causal + padding (+ window), whatever the anchor).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from detkit.kernels.backend import PlannedKernel, resolve_backend_of_devices

# per mask row: first visible key (seq_k if none), last (-1 if none), their count, a bad masked value (0 / 1)
STATS = tl.constexpr(4)
TILE = 4096  # mask elements a program reads at once (rows x keys)
REDUCE_ROWS = 1024  # row stats the window program reads at once
NONE = tl.constexpr(-2147483647)  # "no row": the offset's start value (int32)


@triton.jit
def mask_row_stats_kernel(mask_ptr, stats_ptr, rows, seq_q, seq_k, stride_b, stride_h, stride_q, stride_k, lowest,
                          IS_BOOL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row block, mask batch): the four numbers of rows [BLOCK_R] (row r: head r // seq_q, query r % seq_q)."""
    mb = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_in = r < rows
    h = r // seq_q
    i = r % seq_q
    base = mask_ptr + mb.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + i.to(tl.int64) * stride_q
    first = tl.full([BLOCK_R], 0, tl.int32) + seq_k
    last = tl.full([BLOCK_R], -1, tl.int32)
    count = tl.zeros([BLOCK_R], dtype=tl.int32)
    bad = tl.zeros([BLOCK_R], dtype=tl.int32)
    for k0 in range(0, seq_k, BLOCK_K):
        j = k0 + tl.arange(0, BLOCK_K)
        inside = row_in[:, None] & (j < seq_k)[None, :]
        m = tl.load(base[:, None] + j.to(tl.int64)[None, :] * stride_k, mask=inside, other=0)
        if IS_BOOL:
            visible = (m != 0) & inside
        else:
            value = m.to(tl.float32)
            visible = (value == 0.0) & inside
            # a masked value is -inf or at most the dtype's lowest (what transformers and torch write); NaN is neither
            bad = tl.maximum(bad, tl.max((inside & (value != 0.0) & ~(value <= lowest)).to(tl.int32), axis=1))
        first = tl.minimum(first, tl.min(tl.where(visible, j[None, :], seq_k), axis=1))
        last = tl.maximum(last, tl.max(tl.where(visible, j[None, :], -1), axis=1))
        count += tl.sum(visible.to(tl.int32), axis=1)
    out = stats_ptr + (mb.to(tl.int64) * rows + r) * STATS
    tl.store(out, first, mask=row_in)
    tl.store(out + 1, last, mask=row_in)
    tl.store(out + 2, count, mask=row_in)
    tl.store(out + 3, bad, mask=row_in)


@triton.jit
def mask_windows_kernel(stats_ptr, anchor_ptr, out_ptr, batch, mask_batch, rows, seq_q, seq_k, window, end_at, flags_at,
                        pad_batch, pad_len, stride_pad_b, stride_pad_s, kv_offset,
                        WINDOWED: tl.constexpr, ANCHOR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program: per sequence b (mask batch b % mask_batch) its window and check, from the row stats. ``ANCHOR``:
    0 none (read off the mask), 1 an int32 [B] tensor at anchor_ptr, 2 a ``MaskAnchor``'s padding rows at anchor_ptr
    (row b % pad_batch, pad_len positions; pad_len 0: no padding mask) and kv_offset."""
    fine = tl.full([], 1, tl.int32)
    covered = tl.full([], 1, tl.int32)
    for b in range(0, batch):
        base = stats_ptr + (b % mask_batch).to(tl.int64) * rows * STATS
        start = tl.full([], 0, tl.int32) + seq_k
        end = tl.full([], -1, tl.int32)
        offset = tl.full([], NONE, tl.int32)
        first_row = tl.full([], 0, tl.int32) + seq_q
        bad = tl.full([], 0, tl.int32)
        for r0 in range(0, rows, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            row_in = r < rows
            first = tl.load(base + r * STATS, mask=row_in, other=seq_k)
            last = tl.load(base + r * STATS + 1, mask=row_in, other=-1)
            i = r % seq_q
            nonempty = last >= 0
            start = tl.minimum(start, tl.min(first, axis=0))
            end = tl.maximum(end, tl.max(last, axis=0))
            offset = tl.maximum(offset, tl.max(tl.where(nonempty, last - i, NONE), axis=0))
            first_row = tl.minimum(first_row, tl.min(tl.where(nonempty, i, seq_q), axis=0))
            bad = tl.maximum(bad, tl.max(tl.load(base + r * STATS + 3, mask=row_in, other=0), axis=0))
        any_visible = end >= 0
        start = tl.where(any_visible, start, seq_k)
        offset = tl.where(any_visible, offset, seq_k - seq_q)
        hidden = tl.full([], 0, tl.int32) != 0
        if ANCHOR == 1:
            start = tl.where(any_visible, tl.load(anchor_ptr + b), seq_k)
        elif ANCHOR == 2:
            # the first nonzero of the sequence's padding row (none: position 0), minus the cache's offset
            row = anchor_ptr + (b % pad_batch).to(tl.int64) * stride_pad_b
            first_valid = tl.full([], 0, tl.int32) + pad_len
            for s0 in range(0, pad_len, BLOCK_S):
                s = s0 + tl.arange(0, BLOCK_S)
                valid = tl.load(row + s.to(tl.int64) * stride_pad_s, mask=s < pad_len, other=0) != 0
                first_valid = tl.minimum(first_valid, tl.min(tl.where(valid, s, pad_len), axis=0))
            first_valid = tl.where(first_valid == pad_len, 0, first_valid)
            start = tl.where(any_visible, first_valid - kv_offset, seq_k)
        elif WINDOWED:
            # The first nonempty row sees keys from its window's edge on: the sequence's first key may lie before it.
            hidden = any_visible & (offset + first_row - window + 1 >= start)
        kv_end = offset + seq_q
        rows_ok = (bad == 0) & (kv_end <= seq_k) & (kv_end >= start)
        for r0 in range(0, rows, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            row_in = r < rows
            first = tl.load(base + r * STATS, mask=row_in, other=0)
            last = tl.load(base + r * STATS + 1, mask=row_in, other=-1)
            count = tl.load(base + r * STATS + 2, mask=row_in, other=0)
            i = r % seq_q
            hi = tl.minimum(offset + i, end)
            lo = tl.zeros([BLOCK_R], dtype=tl.int32) + start
            if WINDOWED:
                lo = tl.maximum(lo, offset + i - window + 1)
            lo = tl.maximum(lo, 0)
            expected = tl.maximum(hi - lo + 1, 0)
            row_ok = (count == expected) & ((count == 0) | ((first == lo) & (last == hi)))
            rows_ok = rows_ok & (tl.min((row_ok | ~row_in).to(tl.int32), axis=0) == 1)
        tl.store(out_ptr + b, start)
        tl.store(out_ptr + end_at + b, tl.minimum(tl.maximum(kv_end, 0), seq_k))
        covered = covered & rows_ok.to(tl.int32)
        fine = fine & (rows_ok & ~hidden).to(tl.int32)
    tl.store(out_ptr + flags_at, fine)
    tl.store(out_ptr + flags_at + 1, covered)


class MaskAnchor(NamedTuple):
    """What ``tag_mask_anchor`` records on a mask: each sequence's first key is the first nonzero of its row of
    ``padding`` (a 2-D mask [B|1, seen + q_len] on the mask's device, absolute positions; None, or a row with none:
    position 0) minus ``kv_offset``. Read on the device by ``mask_windows_kernel`` when the mask is used, so a mask
    no sliding window reads costs nothing."""
    padding: torch.Tensor | None
    kv_offset: int
    batch: int


def anchor_tensor(padding_mask: torch.Tensor | None, kv_offset, batch: int, device: torch.device) -> torch.Tensor:
    """int32 [B] each sequence's first key in the key tensor's indices (``tag_mask_anchor``), in torch."""
    if padding_mask is None:
        first = torch.zeros(batch, dtype=torch.int64, device=device)
    else:
        valid = padding_mask.to(device=device).bool()
        first = torch.where(valid.any(-1), valid.to(torch.int8).argmax(-1), 0).to(torch.int64)
        first = first.expand(batch) if first.shape[0] == 1 else first
    if isinstance(kv_offset, torch.Tensor):
        kv_offset = kv_offset.to(device=device, dtype=torch.int64)
    return (first - kv_offset).to(torch.int32).contiguous()


_ROW_STATS = PlannedKernel(mask_row_stats_kernel)
_WINDOWS = PlannedKernel(mask_windows_kernel)
_OPTIONS = {"num_warps": 4}
_ONE_WARP = {"num_warps": 1}


def _aligned(n: int) -> int:
    return (n + 3) // 4 * 4  # int32 elements to a 16-byte boundary


def mask_key_windows_device(attn_mask: torch.Tensor, batch: int, seq_q: int, seq_k: int, window: int | None = None,
                            anchor: torch.Tensor | MaskAnchor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_start int32 [B], kv_end int32 [B], flags int32 [2]: fine, covered) of ``attn_mask`` (bool or floating,
    [B|1, H|1, seq_q, seq_k] or fewer leading dims), on its device, no host sync: ``reference.mask_key_windows``'s
    kv_start and kv_end, its ``ok`` as ``covered`` and ``ok & ~hidden`` as ``fine``. ``anchor``: int32 [B] on the mask's
    device, or a ``MaskAnchor`` (``sdpa.tag_mask_anchor``). The caller has checked the mask's shape and dtype."""
    lead = (1,) * (4 - attn_mask.dim())
    mask = attn_mask if not lead else attn_mask.reshape(lead + tuple(attn_mask.shape))
    device = mask.device
    resolve_backend_of_devices(mask_row_stats_kernel, {"attn_mask": device})  # raises on a device without one
    mask_batch, mask_heads = mask.shape[0], mask.shape[1]
    rows = mask_heads * seq_q
    is_bool = mask.dtype == torch.bool
    lowest = 0.0 if is_bool else float(torch.finfo(mask.dtype).min)
    if is_bool:
        mask = mask.view(torch.uint8)  # the same bytes, read as bytes
    block_r = min(triton.next_power_of_2(rows), 16)
    block_k = min(triton.next_power_of_2(seq_k), TILE // block_r)
    stats = torch.empty(mask_batch * rows * STATS, dtype=torch.int32, device=device)
    end_at = _aligned(batch)
    out = torch.empty(2 * end_at + 4, dtype=torch.int32, device=device)
    strides = [mask.stride(0) if mask_batch > 1 else 0, mask.stride(1) if mask_heads > 1 else 0, mask.stride(2),
               mask.stride(3)]
    _ROW_STATS[(triton.cdiv(rows, block_r), mask_batch)](
        mask, stats, rows, seq_q, seq_k, *strides, lowest, IS_BOOL=is_bool, BLOCK_R=block_r, BLOCK_K=block_k,
        **_OPTIONS)
    pad = (0, 0, 0, 0, 0)  # pad_batch, pad_len, strides, kv_offset
    if anchor is None:
        kind, anchor_arg = 0, out
    elif isinstance(anchor, MaskAnchor):
        padding = anchor.padding
        if padding is None:
            kind, anchor_arg, pad = 2, out, (1, 0, 0, 0, anchor.kv_offset)
        else:
            anchor_arg = padding.view(torch.uint8) if padding.dtype == torch.bool else padding
            kind, pad = 2, (padding.shape[0], padding.shape[1], padding.stride(0), padding.stride(1), anchor.kv_offset)
    else:
        kind, anchor_arg = 1, anchor
    _WINDOWS[(1,)](
        stats, anchor_arg, out, batch, mask_batch, rows, seq_q, seq_k, window if window is not None else 0, end_at,
        2 * end_at, *pad, WINDOWED=window is not None, ANCHOR=kind,
        BLOCK_R=min(triton.next_power_of_2(rows), REDUCE_ROWS),
        BLOCK_S=min(triton.next_power_of_2(max(pad[1], 1)), REDUCE_ROWS), **_ONE_WARP)
    kv_start, _, kv_end, _, flags, _ = out.split_with_sizes([batch, end_at - batch, batch, end_at - batch, 2, 2])
    return kv_start, kv_end, flags
