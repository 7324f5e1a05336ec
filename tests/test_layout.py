"""kernels/parallel/layout.py: the TP=2 x CP=2 rank mapping, groups, shard offsets and CP token order; toolkit/layout.py:
the shape presets on it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from detkit.kernels.parallel.layout import FULL_WORLD, QWEN3_8B, TINY, AxisGroup, ModelDims, TpCpLayout
from detkit.toolkit.layout import layout_for_preset


def test_rank_mapping_is_cp_times_two_plus_tp():
    assert [TpCpLayout.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in range(4):
        assert TpCpLayout.layout_rank(*TpCpLayout.coords(r)) == r


def test_groups_match_design():
    layout = layout_for_preset("qwen3-8b-tp2")
    assert layout.tp_groups == ((0, 1), (2, 3))
    assert layout.cp_groups == ((0, 2), (1, 3))
    assert [layout.group_of("tp", r) for r in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [layout.group_of("cp", r) for r in range(4)] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    # a CP group joins the same TP lane on both CP ranks
    for g in layout.cp_groups:
        assert len({layout.coords(r)[1] for r in g}) == 1


def test_qwen3_shapes_and_offsets():
    layout = layout_for_preset("qwen3-8b-tp2")
    assert layout.model == QWEN3_8B and layout.model.production
    assert (layout.m_local, layout.i_local) == (layout.batch * layout.seq_len // 2, 6144)
    assert layout.i_shard(0) == slice(0, 6144) and layout.i_shard(1) == slice(6144, 12288)
    shapes = layout.local_shapes()
    ml = layout.m_local
    assert shapes["x"] == (ml, 4096) and shapes["hidden"] == (ml, 6144)
    assert shapes["w_gate"] == (4096, 6144) and shapes["w_down"] == (6144, 4096)


def test_tiny_is_labelled_and_only_tiny_names_are_accepted():
    assert "TEST-ONLY" in TINY.label and not TINY.production
    assert "TEST-ONLY" not in QWEN3_8B.label
    with pytest.raises(ValueError, match="hidden 4096, intermediate 12288; got hidden 4096, intermediate 8192"):
        ModelDims("qwen3-8b", 4096, 8192)
    with pytest.raises(ValueError, match="model name 'llama' is not supported"):
        ModelDims("llama", 64, 96)
    with pytest.raises(ValueError, match="intermediate_size 95 is not divisible by TP=2"):
        ModelDims("tiny", 64, 95)
    with pytest.raises(ValueError, match="hidden_size must be a positive int; got 0"):
        ModelDims("tiny", 0, 96)


@pytest.mark.parametrize(("batch", "seq_len", "match"), [
    (0, 6, "batch must be a positive int; got 0"),
    (2, 7, "seq_len 7 cannot be split into 2 equal CP shards"),
    (2, 0, "seq_len 0 cannot be split"),
])
def test_layout_refuses_bad_dims(batch, seq_len, match):
    with pytest.raises(ValueError, match=match):
        TpCpLayout(TINY, batch, seq_len)


def test_layout_is_frozen():
    layout = layout_for_preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.batch = 3


@pytest.mark.parametrize("world", [(0, 1, 2, 3), (0, 1), (2, 3), (0, 2), (1, 3)])
def test_supported_worlds(world):
    layout = TpCpLayout(TINY, 2, 6, world)
    assert layout.world_size == len(world)
    for p, r in enumerate(world):
        assert layout.layout_rank_of_process(p) == r and layout.process_rank(r) == p


@pytest.mark.parametrize("world", [(0,), (1, 0), (0, 3), (0, 1, 2), (0, 1, 2, 3, 4), (3, 2, 1, 0)])
def test_unsupported_worlds(world):
    with pytest.raises(ValueError, match=r"world .* is not supported"):
        TpCpLayout(TINY, 2, 6, world)


def test_groups_present_in_a_subset_world():
    tp_only = TpCpLayout(TINY, 2, 6, (0, 1))
    assert tp_only.groups_present("tp") == ((0, 1),) and tp_only.groups_present("cp") == ()
    cp_only = TpCpLayout(TINY, 2, 6, (0, 2))
    assert cp_only.groups_present("cp") == ((0, 2),) and cp_only.groups_present("tp") == ()
    assert cp_only.process_ranks_of((0, 2)) == (0, 1)
    with pytest.raises(ValueError, match="layout rank 1 is not held by any process"):
        cp_only.process_rank(1)


@pytest.mark.parametrize(("batch", "seq_len"), [(1, 2), (2, 6), (3, 10), (1, 4096)])
def test_cp_token_order(batch, seq_len):
    layout = TpCpLayout(TINY, batch, seq_len)
    s_local = seq_len // 2
    for cp in range(2):
        rows = layout.global_rows(cp)
        assert rows.shape == (layout.m_local,)
        expected = [b * seq_len + cp * s_local + j for b in range(batch) for j in range(s_local)]
        assert rows.tolist() == expected
    both = torch.cat([layout.global_rows(0), layout.global_rows(1)])
    assert torch.equal(torch.sort(both).values, torch.arange(layout.m))


def test_cp_shard_is_not_one_contiguous_block():
    layout = TpCpLayout(TINY, 2, 6)
    assert layout.global_rows(0).tolist() == [0, 1, 2, 6, 7, 8]
    assert layout.global_rows(1).tolist() == [3, 4, 5, 9, 10, 11]


def test_shard_unshard_roundtrip_bitwise():
    layout = TpCpLayout(TINY, 3, 10)
    x = torch.randn(layout.m, 5).to(torch.bfloat16)
    x[0, 0] = -0.0
    shards = [layout.shard_rows(x, cp) for cp in range(2)]
    assert torch.equal(layout.unshard_rows(shards).view(torch.int16), x.view(torch.int16))
    with pytest.raises(ValueError, match="needs a global tensor of 30 rows"):
        layout.shard_rows(x[:-1], 0)
    with pytest.raises(ValueError, match="needs 2 shards"):
        layout.unshard_rows(shards[:1])
    with pytest.raises(ValueError, match="shard 1 is"):
        layout.unshard_rows([shards[0], shards[1][:-1]])


def test_axis_group_validation():
    layout = layout_for_preset("tiny")
    handle = AxisGroup(layout, "tp", (2, 3))
    assert handle.label == "TP[2, 3]" and handle.process_ranks == (2, 3)
    with pytest.raises(ValueError, match=r"\(0, 1\) is not a CP group"):
        AxisGroup(layout, "cp", (0, 1))
    with pytest.raises(ValueError, match="axis 'dp'"):
        AxisGroup(layout, "dp", (0, 1))
    with pytest.raises(ValueError, match="is not held by world"):
        AxisGroup(TpCpLayout(TINY, 2, 6, (0, 2)), "tp", (0, 1))
    with pytest.raises(TypeError, match="must be a TpCpLayout"):
        AxisGroup("layout", "tp", (0, 1))


def test_presets():
    assert layout_for_preset("tiny").model == TINY
    assert layout_for_preset("tiny", (0, 2)).world == (0, 2)
    assert layout_for_preset("qwen3-8b-tp2").world == FULL_WORLD
    with pytest.raises(ValueError, match="preset 'huge' has no TP/CP layout"):
        layout_for_preset("huge")


def test_describe_is_json_ready():
    import json

    d = layout_for_preset("tiny").describe()
    assert json.loads(json.dumps(d)) == d
    assert d["tp_groups"] == [[0, 1], [2, 3]] and d["cp_groups"] == [[0, 2], [1, 3]]
    assert d["i_shards"] == [[0, 48], [48, 96]]


def test_the_harness_uses_the_kernels_layout_not_a_copy():
    import detkit.kernels.parallel.layout as kernels_layout
    import detkit.toolkit.layout as toolkit_layout

    for name in ("AXES", "CP_SIZE", "FULL_WORLD", "QWEN3_8B", "TINY", "TP_SIZE", "AxisGroup", "ModelDims", "TpCpLayout"):
        assert getattr(toolkit_layout, name) is getattr(kernels_layout, name), name
    assert isinstance(layout_for_preset("tiny"), kernels_layout.TpCpLayout)
