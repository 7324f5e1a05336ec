"""Split-KV in the attention forward (issue #50, parts 1 and 5): each row's keys cut into splits from its sequence's
first key, of a size set by the row's own key extent (keys from the first key through its causal end: a pinned step
function, ``split_tiers``), each split reduced on its own and the row's splits folded in ascending order. Its bits do
not depend on the path: one pass (one program per query tile over all its tiles, each row folding its splits as they
end) or the split grid (one program per query tile and run of splits, then the combine pass), for decode, prefill
and chunked prefill at any batch, position, padding and batch neighbour, with windows, softcaps and sinks, also where
the rows of one tile have different split sizes. Against the pure-torch split reference (bit for bit where the
exponentials are exact, each row at its own tier) and the FP64 bound. CPU shapes are tiny: the interpreter's splits
are 1, 2 and 4 of its 16-key tiles up to 32 keys, up to 64 and beyond, so 70 keys cross both bounds."""

import dataclasses

import pytest
import torch
import triton

from detkit.kernels.attention import (
    AttnConfigs, attention, attention_bwd_bound, attention_fwd_bound, attention_split_ref, attention_varlen,
    attention_varlen_ref,
)
from detkit.kernels.attention.configs import (
    ATTENTION_CONFIG_TABLE_VERSION, CONFIG_TABLE, INTERPRETER_SPLIT_TIERS, SPLIT_TIERS, parse_tiers, select_configs,
    split_of, tiers_label,
)
from detkit.kernels.attention.launch import (
    Sequences, attention_fwd_launch, launch_split, split_constexprs, split_group, split_slots, tile_splits,
)
from detkit.toolkit.contract import check_bound, compare_bits
from detkit.toolkit.fixtures import bf16_randn
from tests.conftest import backend_of
from tests.test_attention import _i32, _qkv

SINKS = [0.5, -1.0, 2.0, 0.0]


def _bits(x, y, what=""):
    result = compare_bits(x.contiguous(), y.contiguous())
    assert result.equal, (what, result)


def _paths(device, head_dim=64):
    """The table's configs forced onto each forward path: one pass, and the split grid + combine pass (its programs
    grouping splits as the table says: on the interpreter, a decode step's programs take two or more splits)."""
    base = select_configs(backend_of(device), head_dim)
    return {"one_pass": dataclasses.replace(base, split_grid_below=0),
            "split_grid": dataclasses.replace(base, split_grid_below=2**62, eager_split_grid_min_keys=0)}


def _grouping_extremes(paths: dict) -> dict:
    """The split grid with one split a program, and with every split of a query tile in one program."""
    split = paths["split_grid"]
    return {"split_grid_ungrouped": dataclasses.replace(split, split_grid_programs=0),
            "split_grid_one_group": dataclasses.replace(split, split_grid_programs=1)}


def _variant(name, device):
    return {"plain": {}, "window": {"window": 21},
            "all": {"window": 37, "softcap": 5.0, "sinks": torch.tensor(SINKS, dtype=torch.bfloat16, device=device)},
            }[name]


# ---- the table ------------------------------------------------------------------------------------------
def test_split_tiers_are_pinned_per_backend_and_checked():
    assert SPLIT_TIERS == ((2048, 256), (16384, 512), (None, 1024))
    assert INTERPRETER_SPLIT_TIERS == ((32, 16), (64, 32), (None, 64))
    assert all(c.split_tiers == SPLIT_TIERS for c in CONFIG_TABLE["cuda_sm90"].values())
    assert all(c.split_tiers == INTERPRETER_SPLIT_TIERS for c in CONFIG_TABLE["triton_interpreter"].values())
    assert all(s % c.fwd.block_n == 0 for table in CONFIG_TABLE.values() for c in table.values()
               for _, s in c.split_tiers)
    assert ATTENTION_CONFIG_TABLE_VERSION == "2026-12-08.1"
    base = select_configs("triton_interpreter", 64)
    # Each tier's split up to its bound (the row's key extent e: keys from the first key through its causal end).
    assert [base.split_of(e) for e in (-3, 1, 32, 33, 64, 65, 10**9)] == [16, 16, 16, 32, 32, 64, 64]
    gpu = select_configs("cuda_sm90", 128)
    assert [gpu.split_of(e) for e in (1, 2048, 2049, 16384, 16385, 32768)] == [256, 256, 512, 512, 1024, 1024]
    assert base.smallest_split == 16 and gpu.smallest_split == 256 and split_of(((None, 128),), 5) == 128
    bad_tables = [
        (), ((None, 48),), ((None, 8),), ((None, 0),),  # empty; not a power of two; below a key tile; zero
        ((64, 16),),  # the last tier must be open-ended
        ((None, 16), (64, 32)),  # an open-ended tier before another
        ((64, 32), (None, 16)),  # splits not ascending
        ((64, 16), (32, 32), (None, 64)),  # bounds not ascending
        ((40, 16), (None, 32)),  # a bound not a multiple of the next split
        ((32, 16), (64, 32), (128, 64), (None, 128)),  # more tiers than the kernels take
        [(None, 16)], ((None, 16, 2),), ((32.0, 16), (None, 32)), ((True, 16), (None, 32)),
    ]
    for bad in bad_tables:
        with pytest.raises(ValueError, match="AttnConfigs.split_tiers .* is not supported; supported: 1 to 3") as info:
            dataclasses.replace(base, split_tiers=bad)
        assert "\n" not in str(info.value) and repr(bad) in str(info.value)
    with pytest.raises(ValueError, match="split_grid_below must be an int >= 0; got -1"):
        dataclasses.replace(base, split_grid_below=-1)
    with pytest.raises(ValueError, match="split_grid_programs must be an int >= 0; got -2"):
        dataclasses.replace(base, split_grid_programs=-2)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match=f"paged_num_stages must be an int >= 0; got {bad!r}"):
            dataclasses.replace(base, paged_num_stages=bad)
    with pytest.raises(ValueError, match="paged_grouped must be a bool; got 1"):
        dataclasses.replace(base, paged_grouped=1)
    with pytest.raises(ValueError, match="paged_tile_page must be a bool; got 1"):
        dataclasses.replace(base, paged_tile_page=1)
    with pytest.raises(ValueError, match="paged_early_pages must be a bool; got 1"):
        dataclasses.replace(base, paged_early_pages=1)
    assert "tile-page prefetch<132)" in dataclasses.replace(gpu, paged_early_pages=False).label()
    with pytest.raises(ValueError, match="paged_prefetch_below must be an int >= 0; got -1"):
        dataclasses.replace(base, paged_prefetch_below=-1)
    # The paged forward's stages: speed only, the forward's unless the entry sets them (its label says them), and its
    # table entries a key tile (one a page on both backends' entries).
    assert "paged s3 tile-page early prefetch<132)" in gpu.label()
    assert "paged s1 tile-page early prefetch<4)" in base.label()
    assert "paged s5 grouped)" in dataclasses.replace(gpu, paged_num_stages=5, paged_grouped=True,
                                                      paged_tile_page=False, paged_early_pages=False).label()
    assert isinstance(base, AttnConfigs) and "kv-split 32:16/64:32/64" in base.label()
    # The text form (the decode sweep's --grid), both ways; refused one line.
    for tiers in (SPLIT_TIERS, INTERPRETER_SPLIT_TIERS, ((None, 512),), ((2048, 256), (None, 1024))):
        assert parse_tiers(tiers_label(tiers)) == tiers
    assert tiers_label(SPLIT_TIERS) == "2048:256/16384:512/1024"
    for text in ("", "256:", "2048:256", "a:256/512", "2048:256:1/512", "2048/512"):
        with pytest.raises(ValueError, match="are not supported; supported: BOUND:SPLIT"):
            parse_tiers(text)
    # The kernels' constexprs: fewer tiers repeat the last split.
    assert split_constexprs(SPLIT_TIERS) == {"SPLIT_E0": 2048, "SPLIT_E1": 16384, "SPLIT_N0": 256, "SPLIT_N1": 512,
                                             "SPLIT_N2": 1024}
    assert split_constexprs(((64, 32), (None, 64))) == {"SPLIT_E0": 64, "SPLIT_E1": 64, "SPLIT_N0": 32,
                                                        "SPLIT_N1": 64, "SPLIT_N2": 64}
    assert set(split_constexprs(((None, 256),)).values()) - {0} == {256}


def _row_split_count(tiers, anchor: int, pos: int, window) -> int:
    """The kernels' split count of one row (kernels._row_splits), in Python."""
    e = pos - anchor + 1
    if e <= 0:
        return 0
    split = split_of(tiers, e)
    first = max(pos - window + 1 - anchor, 0) // split if window else 0
    return (e - 1) // split - first + 1


def test_split_slots_bound_every_rows_splits_and_the_launch_split_every_rows_split():
    # Exhaustive over small calls: every row a call can hold (any anchor the host cannot see, any position) has at most
    # split_slots splits and a split no larger than launch_split; the bound is reached. The anchor is >= 0 unless a
    # window lets a sliding cache drop keys (then kv_start < 0, with the window past no dropped key).
    tiers = INTERPRETER_SPLIT_TIERS
    cfg = dataclasses.replace(select_configs("triton_interpreter", 64), split_tiers=tiers)
    dummy = torch.zeros(1, dtype=torch.int32)
    for seq_k in (1, 16, 17, 32, 33, 45, 64, 65, 70, 100):
        for window in (None, 1, 5, 21, 37, 64, 1000):
            seqs = Sequences(False, 1, 1, seq_k, dummy, None, window)
            anchors = range(-150 if window else 0, seq_k)
            counts, splits = [], []
            for anchor in anchors:
                for pos in range(max(anchor, 0), seq_k):
                    if anchor < 0 and pos - window + 1 < 0:
                        continue  # the kernels refuse a window that reaches a dropped key
                    counts.append(_row_split_count(tiers, anchor, pos, window))
                    splits.append(split_of(tiers, pos - anchor + 1))
            assert max(counts) == split_slots(cfg, seqs), (seq_k, window)
            assert max(splits) <= launch_split(cfg, seqs), (seq_k, window)
            if window is None or window > seq_k:  # no key can be dropped: the anchor is k's first row or later
                assert launch_split(cfg, seqs) == split_of(tiers, seq_k), (seq_k, window)
    # Without kv_start (or not windowed) the anchor is k's first row: e <= Skv picks the launch split.
    plain = Sequences(False, 1, 1, 70, None, None)
    assert (launch_split(cfg, plain), split_slots(cfg, plain), tile_splits(cfg, plain, 16)) == (64, 2, 2)
    short = plain._replace(seq_k=30)
    assert (launch_split(cfg, short), split_slots(cfg, short), tile_splits(cfg, short, 16)) == (16, 2, 2)
    # A window's keys start anywhere in a launch split: one query's 21 keys touch at most 2 splits of 64 keys, the 64 +
    # 15 of 16 queries (capped by the 70 keys) at most 3. Where kv_start may be negative (a sliding cache: a window of
    # at most Skv keys) the launch split is the last tier's.
    assert tile_splits(cfg, plain._replace(window=21), 16) == 2
    assert tile_splits(cfg, plain._replace(seq_q=16, window=64), 16) == 3
    assert tile_splits(cfg, plain._replace(window=1), 16) == 1
    assert launch_split(cfg, short._replace(window=8, bound0=dummy)) == 64
    assert launch_split(cfg, short._replace(window=8)) == 16
    assert launch_split(cfg, Sequences(True, 2, 1, 30, dummy, dummy, 8, anchored=True)) == 64
    # sm_90: batch-1 decode programs of 256 keys at 1k keys, runs of 1024-key splits at 32k.
    gpu = select_configs("cuda_sm90", 128)
    for keys, split, slots in ((1024, 256, 4), (8192, 512, 16), (32768, 1024, 32)):
        step = Sequences(False, 1, 1, keys, None, None)
        assert (launch_split(gpu, step), split_slots(gpu, step), tile_splits(gpu, step, 16)) == (split, slots, slots)
    assert split_group(gpu, 4, 8) == 1 and split_group(gpu, 32, 8) == 2  # 32 programs at 1k, 128 at 32k


def test_split_group_aims_at_the_tables_programs_and_covers_every_slot():
    cfg = select_configs("cuda_sm90", 128)  # about 128 programs
    assert split_group(dataclasses.replace(cfg, split_grid_programs=0), 64, 8) == 1  # one split a program
    assert split_group(cfg, 64, 8) == 4  # 64 launch splits x 8 KV heads: 16 groups of 4 splits -> 128 programs
    assert split_group(cfg, 2, 8) == 1  # 2 splits, 16 programs
    assert split_group(cfg, 64, 64) == 32  # batch 8: 2 groups
    assert split_group(cfg, 5, 1000) == 5  # more programs per split than aimed at: one group
    for slots in range(1, 40):
        for per_split in (1, 3, 8, 64):
            group = split_group(cfg, slots, per_split)
            assert 1 <= group <= slots and (triton.cdiv(slots, group) - 1) * group < slots  # no empty group


# ---- the bits do not depend on the path -----------------------------------------------------------------
@pytest.mark.parametrize("variant", ["plain", "all"])  # all: window + softcap + BF16 sinks (a window alone: in it)
def test_decode_prefill_chunked_give_the_same_bits_on_both_paths_across_splits(variant, device):
    # 70 keys, 5 key tiles: rows up to key extent 32 in 16-key splits, up to 64 in 32-key splits, beyond in 64-key
    # splits. Sequence 1's splits start at key 5: its tiers' bounds fall at keys 36 and 68, inside prefill tiles of 8
    # positions (two heads of a group per 16-row tile), whose rows then fold at different split ends.
    seq = 70
    q, k, v = _qkv(2, 4, 2, seq, seq, 64, 7, device, q_scale=2.0)
    kw = _variant(variant, device)
    paths = _paths(device)
    kv_start = _i32([0, 5], device)
    prefill = attention(q, k, v, kv_start=kv_start, configs=paths["one_pass"], **kw)
    _bits(attention(q, k, v, kv_start=kv_start, configs=paths["split_grid"], **kw), prefill, "prefill, split grid")
    for name, cfg in paths.items():
        # Decode at each tier's last and next row (31, 32 and 63, 64; 36, 37 and 68, 69 for sequence 1), inside
        # splits and at the end (from sequence 1's first key: kv_start <= kv_end); a batch's two rows in different
        # tiers at 32, 64 and 68.
        for i in (31, 32, 37, 63, 64, 68, 69) if variant == "plain" else (5, 32, 37, 64, 69):
            step = attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], kv_start=kv_start, configs=cfg, **kw)
            _bits(step, prefill[:, :, i:i + 1], f"{name} decode {i}")
        for chunk in (9,) if variant == "plain" else (33,):
            parts = [attention(q[:, :, s:s + chunk], k[:, :, :s + chunk], v[:, :, :s + chunk], kv_start=kv_start,
                               configs=cfg, **kw) for s in range(0, seq, chunk)]
            _bits(torch.cat(parts, 2), prefill, f"{name} chunks of {chunk}")
        # Batch position and size: sequence 1 alone (its own kv_start) and the batch reversed.
        _bits(attention(q[1:], k[1:], v[1:], kv_start=kv_start[1:], configs=cfg, **kw), prefill[1:], f"{name} alone")
        _bits(attention(q.flip(0), k.flip(0), v.flip(0), kv_start=kv_start.flip(0), configs=cfg, **kw),
              prefill.flip(0), f"{name} reversed batch")
    # The split grid's grouping extremes (a speed choice): decode steps at and across split edges, and a chunk.
    for name, cfg in _grouping_extremes(paths).items():
        for i in (31, 37, 69):
            step = attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], kv_start=kv_start, configs=cfg, **kw)
            _bits(step, prefill[:, :, i:i + 1], f"{name} decode {i}")
        _bits(attention(q[:, :, 33:], k, v, kv_start=kv_start, configs=cfg, **kw), prefill[:, :, 33:],
              f"{name} a 37-query chunk")


def test_padding_static_cache_and_packing_give_the_same_bits_on_both_paths(device):
    seq, pad = 45, 7
    q, k, v = _qkv(1, 4, 2, seq, seq, 64, 17, device)
    paths = _paths(device)
    alone = attention(q, k, v, configs=paths["one_pass"])
    other = _qkv(1, 4, 2, seq + pad, seq + pad, 64, 19, device)
    left = [torch.cat([o, torch.cat([torch.zeros_like(t[:, :, :pad]), t], 2)]) for o, t in zip(other, (q, k, v))]
    cap = seq + 11  # a static cache: allocated for 56 keys, filled to kv_end, the tail NaN
    k_static = torch.full((1, 2, cap, 64), float("nan"), dtype=torch.bfloat16, device=device)
    v_static = k_static.clone()
    k_static[:, :, :seq], v_static[:, :, :seq] = k, v
    for name, cfg in paths.items():
        _bits(attention(*left, kv_start=_i32([0, pad], device), configs=cfg)[1:, :, pad:], alone, f"{name} left pad")
        for i in (pad, 31, 32, seq - 1):
            step = attention(q[:, :, i:i + 1], k_static, v_static, kv_end=_i32([i + 1], device), configs=cfg)
            _bits(step, alone[:, :, i:i + 1], f"{name} static cache {i}")
        lens = [seq, 33]  # a 45-key sequence, then a 12-query chunk after a 21-key cache of a second one
        q2, k2, v2 = _qkv(1, 4, 2, 12, 33, 64, 23, device)
        second = attention(q2, k2, v2, configs=paths["one_pass"])
        packed = attention_varlen(torch.cat([q[0].transpose(0, 1), q2[0].transpose(0, 1)]),
                                  torch.cat([k[0].transpose(0, 1), k2[0].transpose(0, 1)]),
                                  torch.cat([v[0].transpose(0, 1), v2[0].transpose(0, 1)]),
                                  _i32([0, seq, seq + 12], device), _i32([0, seq, seq + lens[1]], device), seq,
                                  max(lens), configs=cfg)
        _bits(packed[:seq], alone[0].transpose(0, 1), f"{name} packed 0")
        _bits(packed[seq:], second[0].transpose(0, 1), f"{name} packed 1")


def test_sliding_cache_with_dropped_keys_gives_the_prefill_bits_on_both_paths(device):
    # A sliding-window cache keeps the last window - 1 keys: kv_start is negative (the anchor lies before k's first
    # row), and the splits stay anchored there.
    seq, window = 80, 37
    q, k, v = _qkv(1, 4, 2, seq, seq, 64, 29, device)
    prefill = attention(q, k, v, window=window, configs=_paths(device)["one_pass"])
    for name, cfg in _paths(device).items():
        for i in (window, 63, 64, 70, seq - 1):
            kept = i + 1 - (window - 1) - 1  # first kept key: the window's lowest at query i
            step = attention(q[:, :, i:i + 1], k[:, :, kept:i + 1], v[:, :, kept:i + 1], window=window,
                             kv_start=_i32([-kept], device), configs=cfg)
            _bits(step, prefill[:, :, i:i + 1], f"{name} sliding cache {i}")


def _packed_sliding_steps(q, k, v, window, steps):
    """Steps of a sliding-window cache packed into one varlen call: ``steps`` (batch row, first query, queries);
    each keeps the window - 1 keys before its first query (all of them near the start) and gets kv_start = -(keys
    dropped). -> (q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, kv_start)."""
    parts_q, parts_k, parts_v, cu_q, cu_k, starts = [], [], [], [0], [0], []
    for b, first_q, n in steps:
        kept = max(first_q - (window - 1), 0)
        parts_q.append(q[b, :, first_q:first_q + n].transpose(0, 1))
        parts_k.append(k[b, :, kept:first_q + n].transpose(0, 1))
        parts_v.append(v[b, :, kept:first_q + n].transpose(0, 1))
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + first_q + n - kept)
        starts.append(-kept)
    device = q.device
    lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    return (torch.cat(parts_q), torch.cat(parts_k), torch.cat(parts_v), _i32(cu_q, device), _i32(cu_k, device),
            max(lens_q), max(lens_k), _i32(starts, device))


def test_packed_sliding_cache_steps_give_the_prefill_bits_on_both_paths(device):
    # transformers' paged sliding cache (continuous batching) hands packed requests their last window - 1 cached
    # keys and the new ones: attention_varlen's kv_start anchors each one's tiles and splits at its sequence's first
    # key, so every request gets the prefill's bits: decodes past the window, a chunk after a full window, a prefill
    # with nothing dropped. Without the anchors the tiles start at the kept keys and the bits differ.
    seq, window = 80, 37
    q, k, v = _qkv(2, 4, 2, seq, seq, 64, 37, device)
    prefill = attention(q, k, v, window=window, configs=_paths(device)["one_pass"])
    steps = [(0, 63, 1), (1, 40, 8), (1, 0, 10), (0, seq - 1, 1), (1, 64, 3)]
    *packed, kv_start = _packed_sliding_steps(q, k, v, window, steps)
    for name, cfg in _paths(device).items():
        out = attention_varlen(*packed, window=window, kv_start=kv_start, configs=cfg)
        row = 0
        for b, first_q, n in steps:
            want = prefill[b, :, first_q:first_q + n].transpose(0, 1)
            _bits(out[row:row + n], want, f"{name} step {b, first_q, n}")
            row += n
    # Without its anchor a step's window falls into other key tiles (the kept keys' first row is not a tile edge of
    # the sequence; on sm_90's 64-key tiles one tile instead of two) and its bits differ from the prefill's.
    step = max(_paths(device)["one_pass"].fwd.block_n, window) + 5
    *alone, kv_start = _packed_sliding_steps(q, k, v, window, [(0, step, 1)])
    assert int(kv_start[0]) < 0
    _bits(attention_varlen(*alone, window=window, kv_start=kv_start), prefill[0, :, step:step + 1].transpose(0, 1),
          "the step anchored")
    assert not compare_bits(attention_varlen(*alone, window=window),
                            prefill[0, :, step:step + 1].transpose(0, 1)).equal, "the step unanchored"
    # The backward through the anchors: the padded layout's gradients with the same (negative) kv_start.
    do = bf16_randn((8, 4, 64), 41, device)
    qs, ks, vs, cu_q, cu_k, max_q, max_k, starts = _packed_sliding_steps(q, k, v, window, [(1, 40, 8)])
    packed_leaves = [t.clone().requires_grad_() for t in (qs, ks, vs)]
    attention_varlen(*packed_leaves, cu_q, cu_k, max_q, max_k, window=window, kv_start=starts).backward(do)
    padded_leaves = [t[None].transpose(1, 2).clone().requires_grad_() for t in (qs, ks, vs)]
    attention(*padded_leaves, window=window, kv_start=starts).backward(do[None].transpose(1, 2))
    for name, a, b in zip(("dq", "dk", "dv"), packed_leaves, padded_leaves):
        _bits(a.grad, b.grad[0].transpose(0, 1), f"packed vs padded {name}")


def test_packed_kv_start_refusals(device):
    q, k, v = _qkv(1, 4, 2, 8, 8, 64, 3, device)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    cu = _i32([0, 4, 8], device)
    cases = [
        (dict(kv_start=_i32([0, -1], device)), "kv_start needs a window"),
        (dict(window=3, kv_start=_i32([1, 0], device)), r"kv_start\[0\] = 1 is not supported"),
        (dict(window=3, kv_start=_i32([0], device)), r"kv_start must be a contiguous int32 tensor of shape \(2,\)"),
        (dict(window=3, kv_start=torch.tensor([0, -1], device=device)), "kv_start must be a contiguous int32"),
        # 4 queries on their own 4 keys: the first query's window of 3 reaches the 2 keys before it, dropped.
        (dict(window=3, kv_start=_i32([0, -5], device)), r"kv_start\[1\] = -5: sequence 1's first query"),
    ]
    for kwargs, match in cases:
        with pytest.raises((ValueError, TypeError), match=match) as info:
            attention_varlen(*packed, cu, cu, 4, 4, **kwargs)
        assert "\n" not in str(info.value)
    # Nothing visible dropped is accepted: 2 cached keys before 1 query, window 3; the padded layout's bits, within
    # the FP64 bound, and the reference takes the same anchor.
    cu_q, cu_k = _i32([0, 1], device), _i32([0, 3], device)
    args = (packed[0][:1], packed[1][:3], packed[2][:3], cu_q, cu_k, 1, 3)
    out = attention_varlen(*args, window=3, kv_start=_i32([-9], device))
    padded = (q[:, :, :1], k[:, :, :3], v[:, :, :3])
    _bits(out, attention(*padded, window=3, kv_start=_i32([-9], device))[0].transpose(0, 1), "padded")
    o_star, bound = attention_fwd_bound(*padded, window=3, kv_start=_i32([-9], device))
    assert check_bound(out.transpose(0, 1)[None], o_star, bound).passed
    ref = attention_varlen_ref(*args, window=3, kv_start=_i32([-9], device))
    assert check_bound(ref.transpose(0, 1)[None], o_star, bound).passed


def test_the_default_path_choice_runs_both_kernels(device):
    # The table's default: a small grid (a decode step over more than one split) runs the split grid, a larger one (a
    # prefill of 4 sequences: 264 programs on sm_90 at 1030 keys, 40 on the interpreter at 38) the one pass; an eager
    # decode step with fewer keys than eager_split_grid_min_keys (2048 on sm_90, 0 on the interpreter) the one pass.
    table = select_configs(backend_of(device), 64)
    seq = 1030 if device.type == "cuda" else 2 * table.smallest_split + 6
    q, k, v = _qkv(4, 4, 2, seq, seq, 64, 31, device)
    step = Sequences(False, 1, 1, seq, None, None)
    for min_keys, split in ((0, True), (seq, True), (seq + 1, False)):
        cfg = dataclasses.replace(table, eager_split_grid_min_keys=min_keys)
        _, _, launch = attention_fwd_launch(q[:1, :, -1:], k[:1], v[:1], step, 0.125, cfg)
        assert launch.split_grid == split, (min_keys, launch)
    _, _, launch = attention_fwd_launch(q[:1, :, -1:], k[:1], v[:1], step, 0.125)
    assert launch.split_grid == (seq >= table.eager_split_grid_min_keys)
    _, _, launch = attention_fwd_launch(q, k, v, Sequences(False, 4, seq, seq, None, None), 0.125)
    assert not launch.split_grid


# ---- the split reference and the bound ------------------------------------------------------------------
def _absorbing_values(shape, device):
    """v whose FP32 sums depend on how the keys are grouped: ones, with +-2^24 at a few keys (2^24 + 1 rounds back to
    2^24), so summing a split's ones before or after a +-2^24 gives different outputs."""
    v = torch.ones(shape, dtype=torch.float32, device=device)
    d = torch.arange(shape[-1], device=device)
    v[:, :, 0, :] = 2.0**24
    v[:, :, 2, d % 3 == 0] = -(2.0**24)
    v[:, :, 40, d % 2 == 0] = -(2.0**24)
    v[:, :, 45, d % 5 == 1] = 2.0**24
    v[:, :, 66, d % 7 == 2] = -(2.0**24)
    return v.to(torch.bfloat16)


@pytest.mark.parametrize("extra", [{}, {"window": 29}, {"softcap": 3.0}])
def test_split_reference_gives_the_kernel_bits_where_exponentials_are_exact(extra, device):
    # q = 0: every logit is 0, every weight exp2(0) = 1 and every rescale factor is selected as 1, so the outputs are
    # FP32 sums of v in the kernels' order divided by a count: the split reference must give the kernel's bits, on
    # both paths, and a reference with other splits must not (the values make the grouping visible).
    if device.type != "cpu":
        pytest.skip("a statement about the interpreter's exact-order dots (tensor cores add in another order)")
    seq = 70
    _, k, _ = _qkv(2, 4, 2, seq, seq, 64, 37, device)
    q = torch.zeros((2, 4, seq, 64), dtype=torch.bfloat16, device=device)
    v = _absorbing_values(k.shape, device)
    kv_start = _i32([0, 3], device)
    cfg = select_configs(backend_of(device), 64)
    want = attention_split_ref(q, k, v, split_tiers=cfg.split_tiers, block_n=cfg.fwd.block_n, kv_start=kv_start,
                               **extra)
    for name, paths_cfg in _paths(device).items():
        _bits(attention(q, k, v, kv_start=kv_start, configs=paths_cfg, **extra), want, name)
        step = attention(q[:, :, -1:], k, v, kv_start=kv_start, configs=paths_cfg, **extra)
        _bits(step, want[:, :, -1:], f"{name} decode")
    one_split = attention_split_ref(q, k, v, split_tiers=((None, 256),), block_n=cfg.fwd.block_n, kv_start=kv_start,
                                    **extra)
    assert not compare_bits(one_split, want).equal
    unanchored = attention_split_ref(q, k, v, split_tiers=cfg.split_tiers, block_n=cfg.fwd.block_n, **extra)
    assert not compare_bits(unanchored[1:, :, 3:], want[1:, :, 3:]).equal  # splits counted from key 0, not kv_start


def _tier_values(shape, device):
    """v of ones with +-2^24 at keys (5 j + 3 d) % 17 == 0 (sign by the parity of j + d): each split's FP32 sum
    absorbs the ones after a 2^24 until a -2^24 cancels it, so a row's output shows where its splits are cut (on the
    interpreter's tables, for rows of every tier: checked against each single split size)."""
    j = torch.arange(shape[2], device=device)[:, None]
    d = torch.arange(shape[3], device=device)[None, :]
    sign = torch.where((j + d) % 2 == 0, 1.0, -1.0)
    v = torch.where((j * 5 + d * 3) % 17 == 0, sign * 2.0**24, torch.ones((), device=device))
    return v.expand(shape).to(torch.bfloat16)


def test_each_row_folds_the_splits_of_its_own_tier_as_the_reference_does(device):
    # q = 0 (exact weights): a row's output is its keys' FP32 sums in the kernels' grouping. Every row's bits, in a
    # prefill whose tiles hold rows of two tiers and in decode steps on both sides of each bound, equal the split
    # reference's at the table's tiers; on the rows of each tier they equal a reference with that tier's split for
    # every row, and differ from one with another tier's split.
    if device.type != "cpu":
        pytest.skip("a statement about the interpreter's exact-order dots (tensor cores add in another order)")
    seq = 70
    _, k, _ = _qkv(2, 4, 2, seq, seq, 64, 67, device)
    q = torch.zeros((2, 4, seq, 64), dtype=torch.bfloat16, device=device)
    v = _tier_values(k.shape, device)
    kv_start = _i32([0, 3], device)  # sequence 1's bounds at keys 34 / 35 and 66 / 67, inside 8-position tiles
    cfg = select_configs("triton_interpreter", 64)
    want = attention_split_ref(q, k, v, split_tiers=cfg.split_tiers, block_n=cfg.fwd.block_n, kv_start=kv_start)
    for name, paths_cfg in _paths(device).items():
        _bits(attention(q, k, v, kv_start=kv_start, configs=paths_cfg), want, f"{name} prefill")
    for i in (31, 35, 64):  # sequence 0 at e = 32 | 33 | 65 beside sequence 1 at e = 29 | 33 | 62
        step = attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], kv_start=kv_start,
                         configs=_paths(device)["split_grid"])
        _bits(step, want[:, :, i:i + 1], f"decode {i}")
    extent = torch.stack([torch.arange(seq) + 1, torch.arange(seq) - 2]).to(device)  # [B, Sq]: position - first + 1
    below = 0
    for bound, split in cfg.split_tiers:
        rows = (extent > below) & (extent <= (bound or seq))
        for other in {s for _, s in cfg.split_tiers}:
            fixed = attention_split_ref(q, k, v, split_tiers=((None, other),), block_n=cfg.fwd.block_n,
                                        kv_start=kv_start)
            same = (fixed.view(torch.int16) == want.view(torch.int16)).all(-1).all(1)  # [B, Sq]
            assert bool(same[rows].all()) == (other == split), (bound, split, other)
        below = bound


@pytest.mark.parametrize("path", ["one_pass", "split_grid"])
def test_a_rows_bits_do_not_depend_on_its_neighbours_tier(path, device):
    # Packed calls: a sequence's rows (a 4-query chunk in the first tier, then one whose 8 queries straddle the 64-key
    # bound) beside a neighbour of 10, 40 or 70 keys (the first, second or last tier): the call's longest sequence,
    # and so the split grid's launch split, its programs and its slots, change with the neighbour; the rows' bits do
    # not, and equal the sequence alone.
    cfg = _paths(device)[path]
    q, k, v = (t[0].transpose(0, 1) for t in _qkv(1, 4, 2, 70, 70, 64, 71, device, q_scale=2.0))
    nq, nk, nv = (t[0].transpose(0, 1) for t in _qkv(1, 4, 2, 70, 70, 64, 73, device, q_scale=2.0))
    for keys, queries in ((20, 4), (70, 8)):
        rows = slice(keys - queries, keys)
        alone = attention_varlen(q[rows], k[:keys], v[:keys], _i32([0, queries], device), _i32([0, keys], device),
                                 queries, keys, configs=cfg)
        for n in (10, 40, 70):
            both = attention_varlen(torch.cat([nq[n - 2:n], q[rows]]), torch.cat([nk[:n], k[:keys]]),
                                    torch.cat([nv[:n], v[:keys]]), _i32([0, 2, 2 + queries], device),
                                    _i32([0, n, n + keys], device), queries, max(n, keys), configs=cfg)
            _bits(both[2:], alone, f"{keys} keys beside {n}")


def test_a_row_that_sees_one_split_gets_the_unsplit_bits(device):
    # The fold takes a row's first split as it is (selected), so a row whose keys lie in one split has the bits of
    # a kernel without splits (one split >= every length); rows that see more splits are folded (other bits, shown
    # with values that make the grouping visible).
    if device.type != "cpu":
        pytest.skip("the interpreter's table (16-key splits up to 32 keys); the GPU tests cross 256-key splits")
    seq = 70
    q, k, _ = _qkv(2, 4, 2, seq, seq, 64, 61, device, q_scale=2.0)
    v = _absorbing_values(k.shape, device)
    kv_start = _i32([0, 3], device)
    first = select_configs("triton_interpreter", 64).smallest_split
    for name, cfg in _paths(device).items():
        unsplit = dataclasses.replace(cfg, split_tiers=((None, 256),))
        for zeros in (False, True):  # random logits; all logits 0 (exact weights: the folds' sums are visible)
            qq = torch.zeros_like(q) if zeros else q
            split, whole = (attention(qq, k, v, kv_start=kv_start, configs=c) for c in (cfg, unsplit))
            # Sequence 0's rows 0..15 and sequence 1's rows 3..18 see keys of their first (16-key) split only.
            _bits(split[0, :, :first], whole[0, :, :first], f"{name} one split, sequence 0")
            _bits(split[1, :, :first + 3], whole[1, :, :first + 3], f"{name} one split, sequence 1")
            if zeros:
                assert not compare_bits(split[:, :, 40:], whole[:, :, 40:]).equal, name


@pytest.mark.parametrize("variant", ["plain", "all"])  # all: window + softcap + BF16 sinks
def test_kernel_and_split_reference_within_the_fp64_bound_forward_and_backward(variant, device):
    seq = 70
    q, k, v = _qkv(2, 4, 2, seq, seq, 64, 41, device, q_scale=3.0)
    do = bf16_randn(q.shape, 43, device)
    kw = {"kv_start": _i32([0, 6], device), **_variant(variant, device)}
    cfg = select_configs(backend_of(device), 64)
    o_star, bound = attention_fwd_bound(q, k, v, block_n=cfg.fwd.block_n, split_n=cfg.smallest_split, **kw)
    ref = attention_split_ref(q, k, v, split_tiers=cfg.split_tiers, block_n=cfg.fwd.block_n, **kw)
    assert check_bound(ref, o_star, bound).passed
    bounds = attention_bwd_bound(q, k, v, do, block_n=min(cfg.fwd.block_n, cfg.dq.block_n), block_m=cfg.dkdv.block_m,
                                 split_n=cfg.smallest_split, **kw)
    sinks = kw.pop("sinks", None)
    for name, paths_cfg in _paths(device).items():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        sink_leaf = None if sinks is None else sinks.clone().requires_grad_()
        o = attention(*leaves, sinks=sink_leaf, configs=paths_cfg, **kw)
        result = check_bound(o, o_star, bound)
        assert result.passed, (name, result)
        o.backward(do)
        grads = dict(zip(("dq", "dk", "dv"), (t.grad for t in leaves)))
        if sink_leaf is not None:
            grads["dsinks"] = sink_leaf.grad
        for key, grad in grads.items():
            result = check_bound(grad, *bounds[key])
            assert result.passed, (name, key, result)
        # The backward reads only o and lse: both paths give the same gradients, bit for bit.
        if name == "one_pass":
            first = grads
        else:
            for key, grad in grads.items():
                _bits(grad, first[key], f"{key} on both paths")


def test_backward_across_splits_repeats_and_does_not_depend_on_the_batch(device):
    q, k, v = _qkv(2, 4, 2, 50, 50, 64, 47, device)
    do = bf16_randn(q.shape, 53, device)
    kv_start = _i32([0, 9], device)

    def grads(rows):
        leaves = [t[rows].clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves, kv_start=kv_start[rows], window=40).backward(do[rows])
        return [t.grad for t in leaves]

    first = grads(slice(0, 2))
    for a, b in zip(first, grads(slice(0, 2))):
        _bits(a, b, "repeat")
    for a, b in zip(first, grads(slice(1, 2))):
        _bits(a[1:], b, "sequence 1 alone")


# ---- GPU: the pinned split tiers at real shapes ---------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", "all"])
def test_gpu_both_paths_decode_prefill_chunked_bitwise_across_the_first_tier_bound(variant, device):
    # 2700 keys: rows to key extent 2048 in 256-key splits, later ones in 512-key splits; sequence 1 (kv_start 300)
    # crosses the bound at key 2348, inside a 16-position tile, beside sequence 0's rows of the other tier.
    batch, seq = 2, 2700
    q, k, v = _qkv(batch, 32, 8, seq, seq, 128, 59, device)
    kw = {"kv_start": _i32([0, 300], device)}
    if variant == "all":
        kw.update(window=700, softcap=30.0, sinks=torch.linspace(-1, 1, 32, device=device))
    paths = _paths(device, 128)
    paths.update(_grouping_extremes(paths))
    prefill = attention(q, k, v, configs=paths["one_pass"], **kw)
    _bits(attention(q, k, v, configs=paths["split_grid"], **kw), prefill, "prefill, split grid")
    for name, cfg in paths.items():
        for i in (300, 555, 556, 811, 812, 2047, 2048, 2347, 2348, 2559, 2560, seq - 1):
            step = attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], configs=cfg, **kw)
            _bits(step, prefill[:, :, i:i + 1], f"{name} decode {i}")
        parts = [attention(q[:, :, s:s + 300], k[:, :, :s + 300], v[:, :, :s + 300], configs=cfg, **kw)
                 for s in range(0, seq, 300)]
        _bits(torch.cat(parts, 2), prefill, f"{name} chunks")
        _bits(attention(q[1:], k[1:], v[1:], configs=cfg, **{**kw, "kv_start": kw["kv_start"][1:]}), prefill[1:],
              f"{name} alone")
    o_star, bound = attention_fwd_bound(q[:, :, -64:], k, v, kv_start=kw["kv_start"], window=kw.get("window"),
                                        softcap=kw.get("softcap"), sinks=kw.get("sinks"),
                                        block_n=select_configs("cuda_sm90", 128).fwd.block_n,
                                        split_n=select_configs("cuda_sm90", 128).smallest_split)
    assert check_bound(prefill[:, :, -64:], o_star, bound).passed


@pytest.mark.gpu
def test_gpu_decode_and_a_chunk_across_the_last_tier_bound_give_the_prefill_bits(device):
    # 17500 keys: rows to key extent 16384 in 512-key splits, later ones in 1024-key splits. A batch of two (sequence
    # 1 from key 700: its bound at key 17083) prefilled once; decode steps on both sides of each sequence's bound (a
    # step's two rows then in different tiers) and a 1400-query chunk across both bounds, on both grids, against the
    # prefill's rows.
    batch, seq = 2, 17500
    q, k, v = _qkv(batch, 32, 8, seq, seq, 128, 61, device)
    kw = {"kv_start": _i32([0, 700], device)}
    paths = _paths(device, 128)
    prefill = attention(q, k, v, configs=paths["one_pass"], **kw)
    for name, cfg in paths.items():
        for i in (16383, 16384, 17083, 17084, seq - 1):
            step = attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], configs=cfg, **kw)
            _bits(step, prefill[:, :, i:i + 1], f"{name} decode {i}")
        chunk = attention(q[:, :, 16000:17400], k[:, :, :17400], v[:, :, :17400], configs=cfg, **kw)
        _bits(chunk, prefill[:, :, 16000:17400], f"{name} chunk")
