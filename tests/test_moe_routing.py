"""MoE routing metadata against a plain-Python loop reference, at awkward segment sizes, and every
refusal; the fused build (Triton kernels, interpreter on CPU) bit for bit against the pure-torch
build, with forced small tiles so several chunks, row blocks and expert steps run. Inputs are made
on the CPU and moved to the test device (DETKIT_TEST_DEVICE) where the builds run."""

import pytest
import torch

from detkit.kernels.moe import routing as moe_routing
from detkit.kernels.moe.routing import SEGMENT_ALIGN, build_routing_ref
from tests.conftest import TEST_DEVICE

DEV = torch.device(TEST_DEVICE)


def _on_device(fn):
    """``fn(ids, scores, experts, ...)`` with ids and scores on the test device (as is on the CPU)."""
    def run(ids, scores, experts, *args):
        return fn(ids.to(DEV), scores.to(DEV), experts, *args)
    return run


build_routing = _on_device(moe_routing.build_routing)
build_routing_torch = _on_device(moe_routing.build_routing_torch)
check_topk = _on_device(moe_routing.check_topk)
_build_routing_fused = _on_device(moe_routing._build_routing_fused)


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
    ids = _ids(40, 4, 3, 5, masked=0.2).to(DEV)
    scores = _scores(ids.cpu(), 6).to(DEV)
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
    assert (r.sorted_route.long()[rr[rr >= 0]] == torch.arange(rr.numel(), device=DEV)[rr >= 0]).all()


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


FIELDS = ("gather_token", "sorted_route", "row_score", "route_row", "expert_counts", "expert_offsets", "tile_expert")
# (routes per program, padded rows per program, experts per step); None = the backend's defaults
TILES = {"default": (None, None, None), "small": (16, 256, 32)}

FUSED_CASES = dict(CASES, **{
    "all_on_one_expert": lambda: (torch.full((70, 3), -1, dtype=torch.int32).index_fill_(
        1, torch.tensor([1]), 2), 4),
    "k1": lambda: (_ids(45, 6, 1, 10, masked=0.1), 6),
    "e1": lambda: (torch.where(torch.rand(33, 1, generator=torch.Generator().manual_seed(11)) < 0.3, -1, 0)
                   .to(torch.int32), 1),
    "e128_small_t": lambda: (_ids(6, 128, 8, 12, masked=0.1), 128),
    "e40_k5": lambda: (_ids(37, 40, 5, 13, masked=0.2), 40),  # T*K = 185: no multiple of any block
    "chunk_boundary": lambda: (_ids(67, 5, 3, 14), 5),  # 201 routes: rows straddle 16-route chunks
})


def _assert_same(a, b):
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
    assert a.counts == b.counts and all(type(c) is int for c in a.counts)
    assert (a.num_tokens, a.top_k, a.num_experts) == (b.num_tokens, b.top_k, b.num_experts)


@pytest.mark.parametrize("tiles", sorted(TILES))
@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_fused_matches_torch_build(case, tiles):
    ids, experts = FUSED_CASES[case]()
    block, rows, expert_block = TILES[tiles]
    for scores in (_scores(ids, 3), _scores(ids, 3).to(torch.bfloat16)):
        fused = _build_routing_fused(ids, scores, experts, block, rows, expert_block)
        _assert_same(fused, build_routing_torch(ids, scores, experts))


def test_fused_segment_sizes_several_chunks_and_row_blocks():
    counts = [0, 1, 127, 128, 129, 0, 300]
    ids = _counts_ids(counts, 15)
    scores = _scores(ids, 2)
    ref = build_routing_torch(ids, scores, len(counts))
    for tiles in ((64, 128, 16), (128, 256, 16), (1024, 512, 16)):
        _assert_same(_build_routing_fused(ids, scores, len(counts), *tiles), ref)
    assert build_routing(ids, scores, len(counts)).counts == tuple(counts)


def test_fused_strided_inputs_and_special_scores():
    base = _ids(24, 6, 4, 16, masked=0.2)
    ids = base.to(DEV).t().contiguous().t()  # column-major [T, K]
    scores = _scores(base, 4).to(DEV).repeat(1, 2)[:, ::2]  # strided columns (.to keeps views on DEV)
    scores[0, 0], scores[1, 1], scores[2, 2] = -0.0, 1e-40, -3.5  # sign of zero and subnormals kept
    _assert_same(_build_routing_fused(ids, scores, 6, 16, 128, 16), build_routing_torch(ids, scores, 6))


def test_one_host_read(monkeypatch):
    """The build reads the device once (the counts and the validation counts together)."""
    ids = _ids(40, 8, 3, 17, masked=0.1)
    scores = _scores(ids, 5)
    reads = []
    tolist, item = torch.Tensor.tolist, torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append("tolist") or tolist(self))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append("item") or item(self))
    build_routing(ids, scores, 8)
    assert reads == ["tolist"]


def _check_topk_error(ids, scores, experts):
    with pytest.raises(Exception) as info:
        check_topk(ids, scores, experts)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("tiles", [(16, 128, 16), (None, None, None)])
def test_fused_refusals_match_check_topk(tiles):
    ids = _ids(30, 5, 3, 18)
    scores = _scores(ids, 6)
    bad_cases = []
    dup = ids.clone()
    dup[5] = torch.tensor([4, 1, 4], dtype=torch.int32)  # routes 15..17 straddle a 16-route chunk
    dup[20] = torch.tensor([2, 2, -1], dtype=torch.int32)
    bad_cases.append((dup, scores))
    oob = dup.clone()
    oob[25, 2] = 5  # out of range wins over the duplicates
    bad_cases.append((oob, scores))
    nan = scores.clone()
    nan[29, 2] = float("nan")
    bad_cases.append((ids, nan))
    inf = scores.to(torch.bfloat16)
    inf[0, 0] = float("-inf")
    bad_cases.append((ids, inf))
    for bad_ids, bad_scores in bad_cases:
        exc, msg = _check_topk_error(bad_ids, bad_scores, 5)
        with pytest.raises(exc) as info:
            _build_routing_fused(bad_ids, bad_scores, 5, *tiles)
        assert str(info.value) == msg


def test_refuses_32bit_overflow_before_work():
    ids = torch.zeros(1, 1, dtype=torch.int32, device=DEV).expand(2**20, 2**11)  # 2**31 routes, stride 0
    with pytest.raises(ValueError, match="32-bit index arithmetic"):
        build_routing(ids, torch.ones(1, 1, device=DEV).expand(2**20, 2**11), 4)


def test_launch_then_finish_gate_and_bound():
    # launch_routing queues the kernels over the largest possible P; the gate carries P and the checks;
    # finish() cuts the same buffers at P.
    ids = _ids(50, 6, 3, 23, masked=0.1)
    scores = _scores(ids, 6)
    pending = _on_device(moe_routing.launch_routing)(ids, scores, 6)
    exact = pending.finish()
    _assert_same(exact, build_routing_torch(ids, scores, 6))
    bound = pending.bound
    assert bound.padded_rows == moe_routing.max_padded_rows(150, 6) >= exact.padded_rows and bound.counts == ()
    assert bound.gate.tolist() == [exact.padded_rows, 0, 0, 0] and exact.gate.tolist() == bound.gate.tolist()
    assert exact.gather_token.data_ptr() == bound.gather_token.data_ptr()


def test_refused_batch_is_flagged_in_the_gate_before_the_read():
    ids = _ids(20, 5, 3, 24)
    ids[7, 2] = ids[7, 0]  # a duplicate id in row 7
    pending = _on_device(moe_routing.launch_routing)(ids, _scores(ids, 7), 5)
    assert pending.bound.gate.tolist()[1:] == [0, 1, 0]  # (out of range, duplicates, non-finite)
    with pytest.raises(ValueError, match="row 7 routes to expert"):
        pending.finish()
