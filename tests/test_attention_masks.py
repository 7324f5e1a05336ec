"""The mask -> key windows kernels (kernels/attention/masks.py) against their pure-torch reference
(``reference.mask_key_windows``): the same kv_start and kv_end, and the same verdicts, for the masks transformers
builds (causal, padding left and right, a static cache's unfilled tail, sliding windows with and without dropped keys,
anchors, heads and batch broadcast, boolean and additive) and for masks that are not causal + padding (a hole, a
non-causal row, a wrong window, a NaN, a value that is neither 0 nor the lowest)."""

from __future__ import annotations

import pytest
import torch

from detkit.kernels.attention.masks import MaskAnchor, anchor_tensor, mask_key_windows_device
from detkit.kernels.attention.reference import mask_key_windows


def _mask(first, q_len, kv_len, kv_offset, window=None, heads=1, tail=0):
    """[B, heads, q_len, kv_len + tail] bool: keys at absolute positions kv_offset.., queries the last q_len of the
    first kv_len keys; sequence b sees keys from ``first[b]`` (absolute) on; ``tail`` unfilled keys after the cache's
    end (a static cache); with ``window`` a query at p sees keys > p - window."""
    q_pos = kv_offset + kv_len - q_len + torch.arange(q_len)
    kv_pos = kv_offset + torch.arange(kv_len + tail)
    seen = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] < kv_offset + kv_len)
    if window is not None:
        seen &= kv_pos[None, :] > q_pos[:, None] - window
    valid = kv_pos[None, :] >= torch.tensor(first)[:, None]
    return (seen[None] & valid[:, None, :])[:, None].expand(-1, heads, -1, -1).contiguous()


def _additive(mask, dtype, lowest=True):
    fill = torch.finfo(dtype).min if lowest else float("-inf")
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, fill)


def _compare(mask, batch, seq_q, seq_k, device, window=None, anchor=None):
    mask = mask.to(device)
    anchor = None if anchor is None else torch.tensor(anchor, dtype=torch.int32, device=device)
    ref_start, ref_end, ok, hidden = mask_key_windows(mask, batch, seq_q, seq_k, window, anchor)
    kv_start, kv_end, flags = mask_key_windows_device(mask, batch, seq_q, seq_k, window, anchor)
    fine, covered = flags.tolist()
    assert kv_start.dtype == kv_end.dtype == torch.int32 and kv_start.shape == kv_end.shape == (batch,)
    assert kv_start.is_contiguous() and kv_end.is_contiguous()
    assert covered == int(bool(ok)), (covered, bool(ok))
    assert fine == int(bool(ok) and not bool(hidden)), (fine, bool(ok), bool(hidden))
    if bool(ok):
        assert kv_start.tolist() == ref_start.tolist() and kv_end.tolist() == ref_end.tolist()
    return kv_start.tolist(), kv_end.tolist(), fine, covered


CASES = [
    # (name, first per sequence, q_len, kv_len, kv_offset, window, heads, tail)
    ("prefill, no padding", [0, 0], 12, 12, 0, None, 1, 0),
    ("prefill, left padding", [0, 5, 11], 12, 12, 0, None, 1, 0),
    ("decode, left padding", [0, 3, 9], 1, 40, 0, None, 1, 0),
    ("chunk on a cache", [2, 0], 5, 30, 0, None, 1, 0),
    ("static cache tail", [0, 4], 1, 14, 0, None, 1, 10),
    ("heads in the mask", [0, 6], 7, 7, 0, None, 3, 0),
    ("window prefill", [0, 4], 20, 20, 0, 6, 1, 0),
    ("window decode, nothing hidden", [0, 2], 1, 5, 0, 8, 1, 0),
    ("window decode past the window", [0, 2], 1, 21, 0, 6, 1, 0),
    ("sliding cache, keys dropped", [0, 4], 1, 6, 15, 6, 1, 0),
    ("window chunk", [1, 0], 4, 33, 0, 9, 1, 0),
    ("long decode row (several key tiles)", [0, 1000, 5000], 1, 9000, 0, None, 1, 0),
    ("long rows (several row blocks)", [0, 7], 40, 70, 0, 16, 2, 0),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_device_windows_equal_the_reference_on_valid_masks(case, device):
    _, first, q_len, kv_len, kv_offset, window, heads, tail = case
    batch = len(first)
    mask = _mask(first, q_len, kv_len, kv_offset, window, heads, tail)
    seq_k = kv_len + tail
    _, _, fine, covered = _compare(mask, batch, q_len, seq_k, device, window)
    assert covered == 1
    # The additive forms (the dtype's lowest, -inf) read the same.
    for dtype in (torch.float32, torch.bfloat16):
        assert _compare(_additive(mask, dtype), batch, q_len, seq_k, device, window)[3] == 1
    assert _compare(_additive(mask, torch.float32, lowest=False), batch, q_len, seq_k, device, window)[3] == 1
    if window is not None:
        # Anchored (the first key of each sequence in the key tensor's indices, maybe negative): never hidden.
        anchor = [f - kv_offset for f in first]
        start, _, fine, covered = _compare(mask, batch, q_len, seq_k, device, window, anchor)
        assert fine == covered == 1 and start == anchor


def test_hidden_first_keys_are_flagged_as_the_reference_does(device):
    # Past the window, the first key is hidden from every row: covered, not fine (without an anchor).
    mask = _mask([0, 2], 1, 21, 0, 6)
    _, _, fine, covered = _compare(mask, 2, 1, 21, device, 6)
    assert (fine, covered) == (0, 1)


def test_broadcast_masks_and_fewer_dims(device):
    mask = _mask([3], 6, 10, 0)  # [1, 1, 6, 10], broadcast over a batch of 4
    start, end, fine, _ = _compare(mask, 4, 6, 10, device)
    assert fine == 1 and start == [3] * 4 and end == [10] * 4
    assert _compare(mask[0], 4, 6, 10, device)[2] == 1  # [1, 6, 10]
    assert _compare(mask[0, 0], 4, 6, 10, device)[2] == 1  # [6, 10]
    # A broadcast mask with per-sequence anchors: each sequence gets its own start.
    win = _mask([0], 1, 6, 15, 6)
    start, _, fine, _ = _compare(win, 3, 1, 6, device, 6, [-15, -11, -12])
    assert fine == 1 and start == [-15, -11, -12]


def test_empty_sequences_and_empty_rows(device):
    mask = _mask([0, 0], 4, 8, 0)
    mask[1] = False  # a sequence that sees nothing
    start, end, fine, covered = _compare(mask, 2, 4, 8, device)
    assert covered == 1 and start[1] == 8 and end[1] == 8


BROKEN = {
    "a hole": lambda m: m.index_put_((torch.tensor(1), torch.tensor(0), torch.tensor(7), torch.tensor(5)),
                                     torch.tensor(False)),
    "a future key": lambda m: m.index_put_((torch.tensor(0), torch.tensor(0), torch.tensor(2), torch.tensor(11)),
                                           torch.tensor(True)),
    "a padded key": lambda m: m.index_put_((torch.tensor(1), torch.tensor(0), torch.tensor(11), torch.tensor(1)),
                                           torch.tensor(True)),
    "one head differs": lambda m: m.index_put_((torch.tensor(0), torch.tensor(1), torch.tensor(3), torch.tensor(0)),
                                               torch.tensor(False)),
}


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_masks_that_are_not_causal_plus_padding_are_refused_as_the_reference_does(what, device):
    mask = BROKEN[what](_mask([0, 4], 12, 12, 0, heads=2))
    assert _compare(mask, 2, 12, 12, device)[3] == 0
    assert _compare(_additive(mask, torch.float32), 2, 12, 12, device)[3] == 0


def test_a_wrong_window_and_bad_values_are_refused(device):
    mask = _mask([0, 4], 20, 20, 0, 6)
    assert _compare(mask, 2, 20, 20, device, 5)[3] == 0  # another window than the mask's
    assert _compare(mask, 2, 20, 20, device)[3] == 0  # a window where none was asked
    additive = _additive(_mask([0, 4], 12, 12, 0), torch.float32)
    for value in (float("nan"), -1.0, 3.0):
        broken = additive.clone()
        broken[0, 0, 0, 5] = value
        assert _compare(broken, 2, 12, 12, device)[3] == 0, value


@pytest.mark.parametrize("padding_dtype", [torch.bool, torch.int64, None])
def test_a_padding_row_anchor_equals_the_anchor_tensor(padding_dtype, device):
    # What tag_mask_anchor records without device work (MaskAnchor: the 2-D padding mask and kv_offset), read by the
    # kernel, against the same anchor computed in torch: left padding, a row with no valid position, a broadcast row.
    window, kv_offset = 6, 15
    mask = _mask([0, 4, 0], 1, 6, kv_offset, window)  # a decode step on a sliding cache that dropped 15 keys
    if padding_dtype is None:
        records = [MaskAnchor(None, kv_offset, 3)]
    else:
        padding = torch.ones(3, kv_offset + 6, dtype=padding_dtype)
        padding[1, :4] = 0
        padding[2] = 0  # no valid position: position 0, as the torch form says
        records = [MaskAnchor(padding.to(device), kv_offset, 3), MaskAnchor(padding[1:2].to(device), kv_offset, 3)]
    for record in records:
        expected = anchor_tensor(record.padding, record.kv_offset, 3, device)
        ref = mask_key_windows(mask.to(device), 3, 1, 6, window, expected)
        kv_start, kv_end, flags = mask_key_windows_device(mask.to(device), 3, 1, 6, window, record)
        assert flags.tolist() == [int(bool(ref[2])), int(bool(ref[2]))]
        assert kv_start.tolist() == ref[0].tolist() == expected.tolist()
        assert kv_end.tolist() == ref[1].tolist()
