"""The host copies of length tensors (kernels/attention/host_values.py): read once while the tensor is alive and
unwritten, read again after any in-place write, never trusted for inference tensors; and the attention's checks on
top of them still refuse lengths or a block table written bad in place after an earlier call passed."""

from __future__ import annotations

import gc

import pytest
import torch

from detkit.kernels.attention import attention_paged, attention_varlen
from detkit.kernels.attention.host_values import forget, host_reads, host_values, read_every_time, remember_values
from tests.attention_helpers import cu_seqlens, i32
from tests.conftest import assert_bits_equal
from tests.test_attention_paged import _make


@pytest.fixture(autouse=True)
def _fresh():
    forget()
    yield
    forget()


def test_a_tensor_is_read_once_until_it_is_written_in_place(device):
    storage = i32([0, 3, 5, 9, 0, 0], device)
    cu = storage[:4]  # a view, as transformers slices its step buffer
    reads = host_reads()
    assert host_values(cu) == ([0, 3, 5, 9],) and host_reads() == reads + 1
    assert host_values(cu) == ([0, 3, 5, 9],) and host_reads() == reads + 1
    storage[1:3] = i32([2, 4], device)  # written through the base: the view's version moves too
    assert host_values(cu) == ([0, 2, 4, 9],) and host_reads() == reads + 2
    cu.copy_(i32([0, 1, 1, 1], device))
    assert host_values(cu) == ([0, 1, 1, 1],) and host_reads() == reads + 3


def test_tensors_not_remembered_are_read_together_in_one_read(device):
    cu_q, cu_k = i32([0, 1, 2], device), i32([0, 7, 19], device)
    positions = torch.arange(5, 10, device=device).unsqueeze(0)  # int64 [1, 5]
    host_values(cu_q)
    reads = host_reads()
    assert host_values(cu_q, cu_k, positions) == ([0, 1, 2], [0, 7, 19], [5, 6, 7, 8, 9])
    assert host_reads() == reads + 1
    assert host_values(cu_k, positions) == ([0, 7, 19], [5, 6, 7, 8, 9]) and host_reads() == reads + 1


def test_a_new_tensor_is_read_even_with_the_same_values_and_a_returned_list_is_a_copy(device):
    cu = i32([0, 4], device)
    values = host_values(cu)[0]
    values.append(99)  # the caller's list: the remembered one is unchanged
    assert host_values(cu) == ([0, 4],)
    del cu
    gc.collect()
    reads = host_reads()
    assert host_values(i32([0, 6], device)) == ([0, 6],) and host_reads() == reads + 1


def test_inference_tensors_are_read_every_time_and_remember_values_seeds_without_a_read(device):
    with torch.inference_mode():
        cu = i32([0, 2, 3], device)
    reads = host_reads()
    host_values(cu)
    host_values(cu)
    assert host_reads() == reads + 2  # no version counter: an in-place write would not be seen
    starts = remember_values(i32([0, -3], device), [0, -3])
    assert host_values(starts) == ([0, -3],) and host_reads() == reads + 2


def test_varlen_bits_with_remembered_lengths_and_a_rewrite_in_place_is_checked_again(device):
    """Two calls on the same length tensors (the second reads nothing) give the same bits; the same tensors rewritten
    in place to other lengths give the bits of fresh tensors of those lengths, and written bad they are refused."""
    from detkit.toolkit.fixtures import bf16_randn

    q = bf16_randn((12, 4, 64), 1, device)
    k = bf16_randn((12, 2, 64), 2, device)
    v = bf16_randn((12, 2, 64), 3, device)
    cu_q, cu_k = cu_seqlens([5, 7], device), cu_seqlens([5, 7], device)
    first = attention_varlen(q, k, v, cu_q, cu_k, 7, 7)
    reads = host_reads()
    assert_bits_equal(attention_varlen(q, k, v, cu_q, cu_k, 7, 7), first, "remembered lengths")
    assert host_reads() == reads
    cu_q.copy_(cu_seqlens([9, 3], device))
    cu_k.copy_(cu_seqlens([9, 3], device))
    want = attention_varlen(q, k, v, cu_seqlens([9, 3], device), cu_seqlens([9, 3], device), 9, 9)
    assert_bits_equal(attention_varlen(q, k, v, cu_q, cu_k, 9, 9), want, "lengths rewritten in place")
    cu_k[1] = 13  # past the 12 packed keys
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0"):
        attention_varlen(q, k, v, cu_q, cu_k, 13, 13)


def test_a_block_table_checked_once_is_checked_again_when_written_or_read_further(device):
    paged = _make([1, 1], [9, 6], 4, device)
    first = paged.paged()
    assert_bits_equal(paged.paged(), first, "the table remembered as checked")
    column = paged.lens_k[0] // 4  # sequence 0's last page entry
    good = int(paged.block_table[0, column])
    paged.block_table[0, column] = paged.k_cache.shape[0]  # one past the storage, written in place
    with pytest.raises(ValueError, match=r"block_table\[0, 2\]"):
        paged.paged()
    paged.block_table[0, column] = good
    assert_bits_equal(paged.paged(), first, "the table written back")
    # sequence 1 now needs a page its table row pads with -1: the same table, unwritten, is checked for the new need
    paged.cu_k.copy_(cu_seqlens([9, 9], device))
    with pytest.raises(ValueError, match=r"block_table\[1, 2\] = -1"):
        attention_paged(paged.q, paged.k_cache, paged.v_cache, paged.block_table, paged.cu_q, paged.cu_k, 1, 9)


def test_read_every_time_reads_every_call_and_remembers_nothing(device):
    cu = i32([0, 5], device)
    reads = host_reads()
    with read_every_time():
        host_values(cu)
        host_values(cu)
    assert host_reads() == reads + 2
    host_values(cu)  # nothing was remembered inside: read now, then remembered
    host_values(cu)
    assert host_reads() == reads + 3


def test_tensors_on_two_devices_are_read_once_a_device(device):
    on_cpu, on_device = i32([0, 1], torch.device("cpu")), i32([0, 2, 5], device)
    reads = host_reads()
    assert host_values(on_device, on_cpu) == ([0, 2, 5], [0, 1])
    assert host_reads() == reads + (1 if device.type == "cpu" else 2)


def test_a_mask_checked_once_is_checked_again_when_written_in_place(device):
    """sdpa's mask check is remembered per mask tensor (TensorMemo): the same mask again gives the same bits, and the
    mask rewritten in place to a pattern that is not causal + padding is refused, not served from the memo."""
    from detkit.kernels.attention.sdpa import MaskNotCovered, sdpa
    from detkit.toolkit.fixtures import bf16_randn

    q = bf16_randn((2, 4, 5, 64), 1, device)
    k, v = bf16_randn((2, 2, 5, 64), 2, device), bf16_randn((2, 2, 5, 64), 3, device)
    mask = torch.ones(5, 5, dtype=torch.bool, device=device).tril().expand(2, 1, 5, 5).clone()
    mask[0, :, :, :2] = False  # sequence 0 left-padded by two keys
    first = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    assert_bits_equal(sdpa(q, k, v, attn_mask=mask, enable_gqa=True), first, "the mask remembered as checked")
    mask[1, 0, 0, 4] = True  # query 0 of sequence 1 now sees a future key
    with pytest.raises(MaskNotCovered, match="is not causal"):
        sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
