"""The index sum (kernels/reductions/index_sum.py): an embedding's weight gradient, each id's rows in ascending order
from zero in FP32, added to ``out`` once. Against the pure-torch reference bitwise (random rows), against the exact
sum (rows whose sums are representable), run to run, and shard by shard as the DP route uses it."""

from __future__ import annotations

import pytest
import torch

from detkit.kernels.reductions import index_sum, index_sum_ref
from detkit.toolkit.fixtures import bf16_randn
from tests.conftest import assert_bits_equal


def _ids(count: int, vocab: int, seed: int, device) -> torch.Tensor:
    """Ids with repeats (a small vocabulary drawn often) so most ids have several rows."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count,), generator=g).to(device)


@pytest.mark.parametrize("count,d,vocab", [(1, 8, 5), (7, 33, 4), (129, 64, 11), (40, 100, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_index_sum_equals_the_reference_bitwise(device, count, d, vocab, dtype):
    rows = bf16_randn((count, d), 1, device).to(dtype)
    ids = _ids(count, vocab, 2, device)
    start = torch.randn((vocab, d), generator=torch.Generator().manual_seed(3)).to(device)
    want = index_sum_ref(rows, ids, start)
    got = index_sum(rows, ids, start.clone())
    assert_bits_equal(got, want, f"index_sum [R={count}, D={d}, V={vocab}] vs reference")
    assert_bits_equal(index_sum(rows, ids, start.clone()), got, "index_sum run to run")


def test_index_sum_is_the_exact_sum_of_representable_rows(device):
    """Rows of small integers times 2^-4: every partial sum is exact in FP32, so any wrong or missing row shows."""
    count, d, vocab = 57, 24, 6
    g = torch.Generator().manual_seed(4)
    rows = (torch.randint(-64, 65, (count, d), generator=g).float() / 16).to(torch.bfloat16).to(device)
    ids = _ids(count, vocab, 5, device)
    want = torch.zeros((vocab, d), dtype=torch.float64).index_add_(0, ids.cpu(), rows.cpu().double())
    got = index_sum(rows, ids, torch.zeros((vocab, d), dtype=torch.float32, device=device))
    assert_bits_equal(got.cpu(), want.float(), "index_sum vs the exact FP64 index_add")


def test_index_sum_skips_the_padding_id_and_leaves_absent_ids(device):
    rows = bf16_randn((9, 16), 6, device)
    ids = torch.tensor([0, 2, 2, 5, 0, 2, 5, 5, 1], device=device)
    start = torch.full((7, 16), -0.0, device=device)  # -0.0 where no id adds: kept as is
    got = index_sum(rows, ids, start.clone(), skip=2)
    assert_bits_equal(got, index_sum_ref(rows, ids, start, skip=2), "index_sum with skip vs reference")
    assert torch.signbit(got[[2, 3, 4, 6]]).all()  # skipped and absent ids: out untouched (-0.0 kept)


def test_index_sum_shard_by_shard_is_the_rank_order_sum(device):
    """The DP route's one-process side: each shard's sum from zero, added into one out in shard order, equals
    partials formed apart (as the ranks do) and added in rank order from zero, whatever ids each shard holds."""
    rows = bf16_randn((30, 40), 7, device)
    ids = _ids(30, 9, 8, device)
    shards = [slice(0, 10), slice(10, 20), slice(20, 30)]
    one = torch.zeros((9, 40), device=device)
    for s in shards:
        index_sum(rows[s], ids[s], one)
    partials = [index_sum(rows[s], ids[s], torch.zeros((9, 40), device=device)) for s in shards]
    ranks = torch.zeros((9, 40), device=device)
    for p in partials:
        ranks += p
    assert_bits_equal(one, ranks, "shard-by-shard index_sum vs rank-order sum of partials")


def test_index_sum_refuses_by_name(device):
    rows = bf16_randn((4, 8), 9, device)
    ids = torch.tensor([0, 1, 2, 7], device=device)
    out = torch.zeros((5, 8), device=device)
    with pytest.raises(ValueError, match=r"ids range over \[0, 7\]; supported: \[0, V\) = \[0, 5\)"):
        index_sum(rows, ids, out)
    with pytest.raises(TypeError, match="out has dtype torch.bfloat16"):
        index_sum(rows, ids.clamp(max=4), out.bfloat16())
    with pytest.raises(TypeError, match="ids has dtype torch.float32"):
        index_sum(rows, ids.float(), out)
    with pytest.raises(ValueError, match=r"rows must be \[R, D\] with a contiguous last dim"):
        index_sum(rows.t(), ids, out)


@pytest.mark.gpu
def test_gpu_index_sum_at_qwen3_8b_widths():
    """One DP rank's embedding gradient at Qwen3-8B widths (vocab 151936, hidden 4096, 2 x 2048 tokens), ids with a
    heavy head (a tenth of the rows on id 0, as padding or a frequent token) and repeats: bitwise the reference,
    and two shards into one buffer equal to their partials added in rank order."""
    device = torch.device("cuda")
    vocab, d, count = 151936, 4096, 4096
    rows = bf16_randn((count, d), 10, device)
    ids = _ids(count, 2000, 11, device)
    ids[::10] = 0
    zeros = torch.zeros((vocab, d), dtype=torch.float32, device=device)
    got = index_sum(rows, ids, zeros.clone())
    assert_bits_equal(got, index_sum_ref(rows, ids, zeros), "index_sum at 8B widths vs reference")
    half = count // 2
    one = index_sum(rows[half:], ids[half:], index_sum(rows[:half], ids[:half], zeros.clone()))
    p1 = index_sum(rows[half:], ids[half:], zeros.clone())
    p0 = index_sum(rows[:half], ids[:half], zeros.clone())
    assert_bits_equal(one, p0 + p1, "two shards into one buffer vs the partials added")
