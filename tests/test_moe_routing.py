"""MoE routing metadata against a plain-Python loop reference, at awkward segment sizes, and every
refusal. Pure torch: no kernels run here."""

import pytest
import torch

from kernels.moe_routing import SEGMENT_ALIGN, build_routing, build_routing_ref


def _ids(t, e, k, seed, masked=0.0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.argsort(torch.rand(t, e, generator=gen), dim=1)[:, :k]
    if masked:
        ids = torch.where(torch.rand(t, k, generator=gen) < masked, -1, ids)
    return ids.to(torch.int32)


def _counts_ids(counts, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return ids[torch.randperm(ids.numel(), generator=gen)].reshape(-1, 1).to(torch.int32)


def _scores(ids, seed):
    return torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) + 0.1


CASES = {
    "random": lambda: (_ids(64, 4, 2, 1), 4),
    "masked": lambda: (_ids(64, 4, 2, 2, masked=0.3), 4),
    "all_masked": lambda: (torch.full((5, 2), -1, dtype=torch.int32), 3),
    "one_expert": lambda: (torch.stack([torch.zeros(50, dtype=torch.int32), 1 + _ids(50, 3, 1, 3)[:, 0]], 1), 4),
    "counts_0_1_127_128_129": lambda: (_counts_ids([0, 1, 127, 128, 129], 4), 5),
    "t1": lambda: (torch.tensor([[2, 0]], dtype=torch.int32), 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_loop_reference(case):
    ids, experts = CASES[case]()
    scores = _scores(ids, 9)
    r = build_routing(ids, scores, experts)
    ref = build_routing_ref(ids, scores, experts)
    assert r.gather_token.tolist() == ref["gather_token"]
    assert r.sorted_route.tolist() == ref["sorted_route"]
    assert r.row_score.tolist() == ref["row_score"]
    assert r.route_row.tolist() == ref["route_row"]
    assert r.expert_counts.tolist() == ref["expert_counts"] == list(r.counts)
    assert r.expert_offsets.tolist() == ref["expert_offsets"]
    assert r.tile_expert.tolist() == ref["tile_expert"]
    assert all(dt == torch.int32 for dt in (r.gather_token.dtype, r.sorted_route.dtype, r.route_row.dtype))


def test_segment_sizes_around_alignment():
    counts = [0, 1, 127, 128, 129]
    r = build_routing(_counts_ids(counts, 4), _scores(_counts_ids(counts, 4), 1), 5)
    assert r.expert_offsets.tolist() == [0, 0, 128, 256, 384, 640]
    assert r.tile_expert.tolist() == [1, 2, 3, 4, 4]
    assert r.padded_rows % SEGMENT_ALIGN == 0 and r.num_tiles == 5
    pad = r.sorted_route < 0
    assert int(pad.sum()) == 640 - 385
    assert (r.gather_token[pad] == 0).all() and (r.row_score[pad] == 0).all()


def test_gather_points_into_original_rows_in_stable_order():
    ids = _ids(40, 4, 3, 5, masked=0.2)
    scores = _scores(ids, 6)
    r = build_routing(ids, scores, 4)
    rows = r.sorted_route >= 0
    route = r.sorted_route[rows].long()
    assert (r.gather_token[rows].long() == route // 3).all()
    assert (r.row_score[rows] == scores.reshape(-1)[route]).all()
    experts = torch.repeat_interleave(r.tile_expert.long(), SEGMENT_ALIGN)[rows]
    assert (ids.reshape(-1)[route].long() == experts).all()
    for e in range(4):  # stable: ascending route index inside each expert
        mine = route[experts == e]
        assert (mine[1:] > mine[:-1]).all()
    # route_row is the inverse map; masked routes have none
    rr = r.route_row.reshape(-1).long()
    assert ((rr >= 0) == (ids.reshape(-1) >= 0)).all()
    assert (r.sorted_route.long()[rr[rr >= 0]] == torch.arange(rr.numel())[rr >= 0]).all()


def test_deterministic():
    ids = _ids(64, 8, 3, 7, masked=0.1)
    a, b = build_routing(ids, _scores(ids, 1), 8), build_routing(ids, _scores(ids, 1), 8)
    for name in ("gather_token", "sorted_route", "row_score", "route_row", "expert_offsets", "tile_expert"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_duplicate_ids_name_the_row():
    ids = _ids(10, 4, 2, 8)
    ids[6] = torch.tensor([3, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"row 6 routes to expert\(s\) \[3\] more than once"):
        build_routing(ids, _scores(ids, 1), 4)
    ids[6] = torch.tensor([-1, -1], dtype=torch.int32)  # two masked routes are not duplicates
    build_routing(ids, _scores(ids, 1), 4)


@pytest.mark.parametrize("ids, scores, experts, exc, match", [
    (torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2), 4, TypeError, "int32"),
    (torch.zeros(4, 1, dtype=torch.int32), torch.ones(4, 1, dtype=torch.float16), 4, TypeError, "scores has dtype"),
    (torch.zeros(4, dtype=torch.int32), torch.ones(4), 4, ValueError, r"\[T, K\]"),
    (torch.zeros(4, 1, dtype=torch.int32), torch.ones(4, 2), 4, ValueError, "scores shape"),
    (torch.full((4, 1), 4, dtype=torch.int32), torch.ones(4, 1), 4, ValueError, "out of range"),
    (torch.full((4, 1), -2, dtype=torch.int32), torch.ones(4, 1), 4, ValueError, "out of range"),
    (torch.zeros(4, 1, dtype=torch.int32), torch.full((4, 1), float("inf")), 4, ValueError, "NaN or Inf"),
    (torch.zeros(0, 1, dtype=torch.int32), torch.ones(0, 1), 4, ValueError, "T, K >= 1"),
])
def test_rejects(ids, scores, experts, exc, match):
    with pytest.raises(exc, match=match):
        build_routing(ids, scores, experts)
