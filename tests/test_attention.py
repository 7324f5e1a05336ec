"""detkit attention against its FP64 oracle (the derived bound) and its pure-torch reference; the invariance rule
bit for bit (decode vs prefill vs chunked prefill, batch size, batch position, left/right padding, a static
cache, packed vs padded sequences); backward within its bound and repeatable; every fail-closed path. Runs on the
interpreter in CI (tiny shapes, the interpreter's small tiles) and at real shapes on the GPU with
DETKIT_TEST_DEVICE=cuda."""

import dataclasses
import math

import pytest
import torch

from detkit.kernels.attention import (
    HEAD_DIMS, AttnConfig, attention, attention_bwd_bound, attention_fwd_bound, attention_ref, attention_varlen,
    attention_varlen_ref, hf_attention_forward, sdpa, sdpa_unsupported_reason,
)
from detkit.kernels.attention.configs import CONFIG_TABLE, heads_per_tile, select_configs
from detkit.kernels.attention.reference import mask_windows
from detkit.toolkit.contract import check_bound, compare_bits
from detkit.toolkit.fixtures import bf16_randn
from tests.conftest import backend_of


def _qkv(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, seed, device, q_scale=1.0):
    return (bf16_randn((batch, heads_q, seq_q, head_dim), seed, device, scale=q_scale),
            bf16_randn((batch, heads_kv, seq_k, head_dim), seed + 1, device),
            bf16_randn((batch, heads_kv, seq_k, head_dim), seed + 2, device))


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _bits(x, y):
    result = compare_bits(x.contiguous(), y.contiguous())
    assert result.equal, result
    return result


def _block_n(device, head_dim):
    return select_configs(backend_of(device), head_dim).fwd.block_n


# ---- numerics ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads_q,heads_kv,seq,head_dim,q_scale", [
    (4, 2, 40, 64, 1.0),  # GQA 2, several key and query tiles, a partial last tile
    (2, 2, 33, 64, 1.0),  # MHA
    (4, 1, 20, 128, 1.0),  # GQA 4 (MQA), head_dim 128
    (4, 2, 24, 64, 4.0),  # large logits: a peaked softmax, running-max rescales
])
def test_forward_within_contract_bound(heads_q, heads_kv, seq, head_dim, q_scale, device):
    q, k, v = _qkv(2, heads_q, heads_kv, seq, seq, head_dim, 11, device, q_scale)
    kv_start = _i32([0, 3], device)
    o = attention(q, k, v, kv_start=kv_start)
    assert o.shape == q.shape and o.dtype == torch.bfloat16
    o_star, bound = attention_fwd_bound(q, k, v, kv_start=kv_start, block_n=_block_n(device, head_dim))
    result = check_bound(o, o_star, bound)
    assert result.passed, result
    # The pure-torch reference (FP32 softmax, one BF16 rounding) obeys the same bound.
    assert check_bound(attention_ref(q, k, v, kv_start=kv_start), o_star, bound).passed


@pytest.mark.parametrize("heads_q,heads_kv", [(6, 2), (32, 1)])  # a group of 3; a group wider than the tile
def test_awkward_group_sizes_forward_backward_and_decode(heads_q, heads_kv, device):
    q, k, v = _qkv(2, heads_q, heads_kv, 20, 20, 64, 13, device)
    do = bf16_randn(q.shape, 17, device)
    kv_start = _i32([0, 4], device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = attention(*leaves, kv_start=kv_start)
    o.backward(do)
    assert check_bound(o, *attention_fwd_bound(q, k, v, kv_start=kv_start)).passed
    bounds = attention_bwd_bound(q, k, v, do, kv_start=kv_start)
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        assert check_bound(leaf.grad, *bounds[name]).passed, name
    for i in (4, 7, 16, 19):  # decode steps after sequence 1's left padding of 4
        _bits(attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], kv_start=kv_start), o[:, :, i:i + 1])


def test_more_queries_than_keys_gives_zeros_for_queries_before_the_first_key(device):
    q, k, v = _qkv(1, 4, 2, 10, 6, 64, 19, device)
    o = attention(q, k, v)
    assert torch.all(o[:, :, :4] == 0)
    _bits(o[:, :, 4:], attention(q[:, :, 4:], k, v))
    assert (o.float() - attention_ref(q, k, v).float()).abs().max() <= 2 ** -6


def test_bound_rejects_a_wrong_mask_and_a_wrong_scale(device):
    # The bound is tight enough to fail realistic bugs: one key too many, a scale without its square root.
    q, k, v = _qkv(1, 4, 2, 24, 24, 64, 5, device, q_scale=2.0)
    o_star, bound = attention_fwd_bound(q, k, v, kv_start=_i32([4], device))
    assert check_bound(attention_ref(q, k, v, kv_start=_i32([4], device)), o_star, bound).passed
    assert not check_bound(attention_ref(q, k, v, kv_start=_i32([3], device)), o_star, bound).passed
    assert not check_bound(attention_ref(q, k, v, scale=1 / 64, kv_start=_i32([4], device)), o_star, bound).passed


def test_scale_argument_and_rows_that_see_no_key(device):
    q, k, v = _qkv(1, 2, 2, 16, 16, 64, 7, device)
    o = attention(q, k, v, scale=0.3)
    o_star, bound = attention_fwd_bound(q, k, v, scale=0.3)
    assert check_bound(o, o_star, bound).passed
    # Left padding of 6: the queries at padded positions 0..5 see no key and give exact zeros (finite).
    o = attention(q, k, v, kv_start=_i32([6], device))
    assert torch.all(o[:, :, :6] == 0)


def test_bad_sequence_bounds_give_nan_not_out_of_bounds_reads(device):
    q, k, v = _qkv(2, 2, 2, 8, 16, 64, 9, device)
    o = attention(q, k, v, kv_start=_i32([0, 9], device), kv_end=_i32([16, 5], device))  # 9 > 5 in sequence 1
    assert torch.isnan(o[1]).all() and torch.isfinite(o[0]).all()
    _bits(o[0], attention(q[:1], k[:1], v[:1])[0])


# ---- the invariance rule, bit for bit -----------------------------------------------------------------
def test_decode_prefill_and_chunked_prefill_give_the_same_bits_per_token(device):
    batch, seq = 2, 40
    q, k, v = _qkv(batch, 4, 2, seq, seq, 64, 21, device)
    prefill = attention(q, k, v)
    # Decode: one query against the cache of its prefix, at tile boundaries (16 keys), the interpreter's split tiers'
    # bound (32 keys), inside tiles and at the end.
    for i in sorted({*range(0, seq, 3), 15, 16, 17, 31, 32, 33, seq - 1}):
        _bits(attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1]), prefill[:, :, i:i + 1])
    # Chunked prefill: chunks of several sizes against the growing cache.
    for chunk in (2, 7, 16, 23, 39):
        parts = [attention(q[:, :, s:s + chunk], k[:, :, :s + chunk], v[:, :, :s + chunk])
                 for s in range(0, seq, chunk)]
        _bits(torch.cat(parts, dim=2), prefill)


def test_batch_size_and_position_do_not_change_bits(device):
    q, k, v = _qkv(3, 4, 2, 24, 24, 64, 31, device)
    full = attention(q, k, v)
    for b in range(3):
        _bits(attention(q[b:b + 1], k[b:b + 1], v[b:b + 1]), full[b:b + 1])
    perm = [2, 0, 1]
    _bits(attention(q[perm], k[perm], v[perm]), full[perm])


def test_left_and_right_padding_do_not_change_bits(device):
    seq, pad = 24, 5
    q, k, v = _qkv(1, 4, 2, seq, seq, 64, 41, device)
    alone = attention(q, k, v)
    other = _qkv(1, 4, 2, seq + pad, seq + pad, 64, 43, device)
    # Left padding: the sequence shifted right by `pad` in a batch with a longer one; kv_start = pad.
    qp, kp, vp = (torch.cat([o, torch.cat([torch.zeros_like(t[:, :, :pad]), t], dim=2)])
                  for o, t in zip(other, (q, k, v)))
    left = attention(qp, kp, vp, kv_start=_i32([0, pad], device))
    _bits(left[1:, :, pad:], alone)
    _bits(left[:1], attention(*other))
    # Right padding: zeros after the sequence; its queries' bits are unchanged (padded queries are not read).
    qr, kr, vr = (torch.cat([o, torch.cat([t, torch.zeros_like(t[:, :, :pad])], dim=2)])
                  for o, t in zip(other, (q, k, v)))
    right = attention(qr, kr, vr)
    _bits(right[1:, :, :seq], alone)


def test_static_cache_decode_equals_dynamic_cache_decode(device):
    # A static cache: keys allocated for 32 positions, filled to kv_end; the tail holds garbage (NaN).
    q, k, v = _qkv(2, 4, 2, 20, 20, 64, 51, device)
    prefill = attention(q, k, v)
    cap = 32
    k_static = torch.full((2, 2, cap, 64), float("nan"), dtype=torch.bfloat16, device=device)
    v_static = k_static.clone()
    k_static[:, :, :20], v_static[:, :, :20] = k, v
    for i in (0, 9, 16, 19):
        out = attention(q[:, :, i:i + 1], k_static, v_static, kv_end=_i32([i + 1, i + 1], device))
        _bits(out, prefill[:, :, i:i + 1])


def test_packed_sequences_give_the_padded_bits(device):
    lens_k, lens_q = [17, 33, 5], [17, 9, 5]  # sequence 1 is a chunk of 9 queries after a 24-key cache
    seqs = [_qkv(1, 4, 2, lq, lk, 64, 60 + i, device) for i, (lq, lk) in enumerate(zip(lens_q, lens_k))]
    q = torch.cat([s[0][0].transpose(0, 1) for s in seqs])  # [Tq, Hq, D]
    k = torch.cat([s[1][0].transpose(0, 1) for s in seqs])
    v = torch.cat([s[2][0].transpose(0, 1) for s in seqs])
    cu_q = _i32([0, *torch.tensor(lens_q).cumsum(0).tolist()], device)
    cu_k = _i32([0, *torch.tensor(lens_k).cumsum(0).tolist()], device)
    packed = attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    for i, (qs, ks, vs) in enumerate(seqs):
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        _bits(packed[rows], attention(qs, ks, vs)[0].transpose(0, 1))
    ref = attention_varlen_ref(q, k, v, cu_q, cu_k)
    assert (packed.float() - ref.float()).abs().max() <= 2 ** -5  # a few BF16 ulps of O(1) values


# ---- backward -----------------------------------------------------------------------------------------
def _grads(q, k, v, do, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attention(*leaves, **kwargs).backward(do)
    return [t.grad for t in leaves]


def test_backward_within_bound_and_repeatable(device):
    q, k, v = _qkv(2, 4, 2, 24, 24, 64, 71, device)
    do = bf16_randn(q.shape, 74, device)
    kv_start = _i32([0, 5], device)
    grads = _grads(q, k, v, do, kv_start=kv_start)
    cfg = select_configs(backend_of(device), 64)
    bounds = attention_bwd_bound(q, k, v, do, kv_start=kv_start, block_n=min(cfg.dq.block_n, cfg.fwd.block_n),
                                 block_m=cfg.dkdv.block_m)
    for name, grad in zip(("dq", "dk", "dv"), grads):
        star, bound = bounds[name]
        result = check_bound(grad, star, bound)
        assert result.passed, (name, result)
    # Keys before kv_start get exact zeros; a second run repeats every bit.
    assert torch.all(grads[1][1, :, :5] == 0) and torch.all(grads[2][1, :, :5] == 0)
    for first, again in zip(grads, _grads(q, k, v, do, kv_start=kv_start)):
        _bits(first, again)


def test_backward_bound_rejects_a_missing_head_sum(device):
    # dk of a GQA group sums the group's query heads; dropping one head's share must fail the bound.
    q, k, v = _qkv(1, 4, 2, 16, 16, 64, 75, device)
    do = bf16_randn(q.shape, 76, device)
    _, dk, _ = _grads(q, k, v, do)
    star, bound = attention_bwd_bound(q, k, v, do)["dk"]
    assert check_bound(dk, star, bound).passed
    partial = attention_bwd_bound(q[:, ::2], k, v, do[:, ::2])["dk"][0]  # one head of each group
    assert not check_bound(partial.to(torch.bfloat16), star, bound).passed


def test_backward_of_a_sequence_does_not_depend_on_its_batch_or_packing(device):
    seq = 20
    q, k, v = _qkv(2, 4, 2, seq, seq, 64, 81, device)
    do = bf16_randn(q.shape, 84, device)
    both = _grads(q, k, v, do)
    alone = _grads(q[1:], k[1:], v[1:], do[1:])
    for g_both, g_alone in zip(both, alone):
        _bits(g_both[1:], g_alone)
    # The same two sequences packed: same gradients bit for bit.
    leaves = [t.transpose(1, 2).reshape(2 * seq, t.shape[1], 64).clone().requires_grad_() for t in (q, k, v)]
    cu = _i32([0, seq, 2 * seq], device)
    attention_varlen(*leaves, cu, cu, seq, seq).backward(do.transpose(1, 2).reshape(2 * seq, 4, 64))
    for leaf, g_both in zip(leaves, both):
        _bits(leaf.grad, g_both.transpose(1, 2).reshape(2 * seq, g_both.shape[1], 64))


# ---- SDPA and transformers adapters -------------------------------------------------------------------
def _padding_mask(kind, lengths, seq, device):
    """The 4-D boolean mask transformers builds for sdpa: causal and a 2-D padding mask."""
    i = torch.arange(seq, device=device)
    pad = torch.zeros(len(lengths), seq, dtype=torch.bool, device=device)
    for b, n in enumerate(lengths):
        if kind == "left":
            pad[b, seq - n:] = True
        else:
            pad[b, :n] = True
    return ((i[None, :, None] >= i[None, None, :]) & pad[:, None, :])[:, None]


@pytest.mark.parametrize("kind", ["left", "right"])
def test_sdpa_with_a_padding_mask_matches_f_sdpa_on_valid_rows(kind, device):
    lengths, seq = [24, 19, 7], 24
    q, k, v = _qkv(3, 4, 2, seq, seq, 64, 91, device)
    mask = _padding_mask(kind, lengths, seq, device)
    assert sdpa_unsupported_reason(q, k, v, mask, enable_gqa=True) is None
    o = sdpa(q, k, v, mask, enable_gqa=True)
    kv_start, kv_end, ok = mask_windows(mask, 3, seq, seq)
    assert bool(ok)
    o_star, bound = attention_fwd_bound(q, k, v, kv_start=kv_start, kv_end=kv_end, block_n=_block_n(device, 64))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), attn_mask=mask)
    for b, n in enumerate(lengths):
        rows = slice(seq - n, seq) if kind == "left" else slice(0, n)
        assert check_bound(o[b, :, rows], o_star[b, :, rows], bound[b, :, rows]).passed
        assert torch.allclose(o_star[b, :, rows], expected[b, :, rows], atol=1e-12)
    # A static cache's decode mask (one query, the cache filled to position 13 of 24) gives the decode bits.
    static = torch.zeros(3, 1, 1, seq, dtype=torch.bool, device=device)
    static[:, :, :, :14] = True
    _bits(sdpa(q[:, :, 13:14], k, v, static, enable_gqa=True),
          attention(q[:, :, 13:14], k[:, :, :14], v[:, :, :14]))
    # The additive form of the same mask (transformers' eager mask) gives the same bits.
    lowest = torch.finfo(torch.float32).min
    additive = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_fill(~mask, lowest)
    _bits(sdpa(q, k, v, additive, enable_gqa=True), o)


def test_sdpa_is_causal_and_decode_forms(device):
    q, k, v = _qkv(1, 4, 2, 16, 16, 64, 95, device)
    _bits(sdpa(q, k, v, is_causal=True, enable_gqa=True), attention(q, k, v))
    _bits(sdpa(q[:, :, -1:], k, v, enable_gqa=True), attention(q, k, v)[:, :, -1:])


def test_hf_attention_forward_matches_transformers_sdpa_forward(device):
    transformers_sdpa = pytest.importorskip("transformers.integrations.sdpa_attention")

    class Attn(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2

    q, k, v = _qkv(3, 4, 2, 20, 20, 64, 97, device)
    lengths = [20, 13, 4]
    mask = _padding_mask("left", lengths, 20, device)
    ours, weights = hf_attention_forward(Attn(), q, k, v, mask, scaling=0.125)
    theirs, _ = transformers_sdpa.sdpa_attention_forward(Attn(), q.double(), k.double(), v.double(), mask,
                                                         scaling=0.125)
    assert weights is None and ours.shape == theirs.shape == (3, 20, 4, 64) and ours.is_contiguous()
    for b, n in enumerate(lengths):
        assert (ours[b, 20 - n:].double() - theirs[b, 20 - n:]).abs().max() <= 2 ** -6
    # Decode with a KV cache, no padding: transformers passes no mask.
    out, _ = hf_attention_forward(Attn(), q[:1, :, -1:], k[:1], v[:1], None, scaling=0.125)
    _bits(out.transpose(1, 2), attention(q[:1], k[:1], v[:1], scale=0.125)[:, :, -1:])
    # An empty static cache's prefill (no mask, keys longer than queries): the first q_len keys, as transformers.
    out, _ = hf_attention_forward(Attn(), q[:1, :, :8], k[:1], v[:1], None, scaling=0.125)
    _bits(out.transpose(1, 2), attention(q[:1, :, :8], k[:1, :, :8], v[:1, :, :8], scale=0.125))


# ---- fail closed --------------------------------------------------------------------------------------
def test_attention_refuses_unsupported_inputs_with_one_line_messages(device):
    q, k, v = _qkv(2, 4, 2, 8, 8, 64, 1, device)
    wide = _qkv(1, 4, 2, 8, 8, 320, 2, device)  # above the widest tiles (head dims up to 256 run on them)
    cases = [
        (lambda: attention(q.float(), k, v), TypeError, "q has dtype torch.float32; supported: torch.bfloat16"),
        (lambda: attention(*wide), ValueError, "head_dim 320 is not supported"),
        (lambda: attention(q[:, :3], k, v), ValueError, "query heads 3 are not a multiple of key/value heads 2"),
        (lambda: attention(q, k.transpose(2, 3), v), ValueError, "k has stride 64 on its head dim"),
        (lambda: attention(q, k, v[:1]), ValueError, "must have the same shape"),
        (lambda: attention(q, k, v, scale=-1.0), ValueError, "scale -1.0 is not supported"),
        (lambda: attention(q, k, v, kv_start=torch.zeros(2, dtype=torch.int64, device=device)), ValueError,
         "kv_start must be an int32 tensor of shape (2,)"),
        (lambda: attention(q, k, v, kv_end=_i32([1, 2, 3], device)), ValueError, "kv_end must be an int32 tensor"),
        (lambda: attention(q[0], k, v), ValueError, "q must be 4-D"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc, match=".*") as info:
            call()
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_varlen_refuses_bad_cu_seqlens(device):
    q, k, v = (bf16_randn((10, h, 64), s, device) for h, s in ((4, 1), (2, 2), (2, 3)))
    good = _i32([0, 4, 10], device)
    cases = [
        (_i32([0, 6, 4], device), 6, "never decrease"),
        (_i32([0, 4, 9], device), 6, "end at the packed length 10"),
        (good.long(), 6, "must be a contiguous int32 tensor"),
        (good, 5, "max_seqlen_q 5 is not supported"),
    ]
    for cu_q, max_q, message in cases:
        with pytest.raises((ValueError, TypeError)) as info:
            attention_varlen(q, k, v, cu_q, good, max_q, 6)
        assert message in str(info.value), str(info.value)


def test_sdpa_reasons_and_refusals(device):
    q, k, v = _qkv(1, 4, 2, 8, 8, 64, 3, device)
    wide = _qkv(1, 4, 2, 8, 8, 320, 4, device)  # above the widest tiles (head dims up to 256 run on them)
    mask = _padding_mask("left", [8], 8, device)
    reasons = {
        "dtype torch.float32": sdpa_unsupported_reason(q.float(), k.float(), v.float(), enable_gqa=True,
                                                       is_causal=True),
        "head_dim 320": sdpa_unsupported_reason(*wide, is_causal=True, enable_gqa=True),
        "dropout_p 0.1": sdpa_unsupported_reason(q, k, v, dropout_p=0.1, is_causal=True, enable_gqa=True),
        "without enable_gqa": sdpa_unsupported_reason(q, k, v, is_causal=True),
        "top-left causal": sdpa_unsupported_reason(q[:, :, :4], k, v, is_causal=True, enable_gqa=True),
        "not causal": sdpa_unsupported_reason(q, k, v, enable_gqa=True),
        "attn_mask together with is_causal": sdpa_unsupported_reason(q, k, v, mask, is_causal=True, enable_gqa=True),
        "attn_mask dtype torch.int64": sdpa_unsupported_reason(q, k, v, mask.long(), enable_gqa=True),
        "attn_mask shape": sdpa_unsupported_reason(q, k, v, mask[..., :4], enable_gqa=True),
        "has 3 dims": sdpa_unsupported_reason(q[0], k[0], v[0], is_causal=True, enable_gqa=True),
    }
    for expected, reason in reasons.items():
        assert reason is not None and expected in reason and "\n" not in reason, (expected, reason)
    with pytest.raises(NotImplementedError, match="dropout_p 0.1"):
        sdpa(q, k, v, dropout_p=0.1, is_causal=True, enable_gqa=True)
    # Values are checked where they are read: a mask that is not causal + padding is refused.
    for bad in (mask.clone().fill_(True), mask.transpose(-1, -2)):
        with pytest.raises(ValueError, match="is not causal \\+ padding"):
            sdpa(q, k, v, bad, enable_gqa=True)
    bias = torch.zeros(mask.shape, device=device).masked_fill(~mask, -1e4)  # a finite bias is not a mask
    with pytest.raises(ValueError, match="is not causal \\+ padding"):
        sdpa(q, k, v, bias, enable_gqa=True)


def test_hf_attention_forward_refuses_what_it_does_not_cover(device):
    class Attn(torch.nn.Module):
        is_causal = True

    class Encoder(torch.nn.Module):
        is_causal = False

    q, k, v = _qkv(1, 4, 2, 8, 8, 64, 3, device)
    cases = [
        (lambda: hf_attention_forward(Attn(), q, k, v, None, sliding_window=0), "sliding_window 0 is not supported"),
        (lambda: hf_attention_forward(Attn(), q, k, v, None, softcap=-1.0), "softcap -1.0 is not supported"),
        (lambda: hf_attention_forward(Attn(), q, k, v, None, dropout=0.1), "dropout 0.1 is not supported"),
        (lambda: hf_attention_forward(Encoder(), q, k, v, None), "non-causal attention is not supported"),
        (lambda: hf_attention_forward(Attn(), q.float(), k.float(), v.float(), None), "dtype torch.float32"),
    ]
    for call, message in cases:
        with pytest.raises(NotImplementedError) as info:
            call()
        assert message in str(info.value), str(info.value)


# ---- the pinned tables --------------------------------------------------------------------------------
def test_config_table_is_pinned_per_head_dim_and_heads_pack_whole_groups():
    for backend, table in CONFIG_TABLE.items():
        assert set(table) == set(HEAD_DIMS), backend
    assert heads_per_tile(4, 128) == 4 and heads_per_tile(6, 16) == 6 and heads_per_tile(64, 16) == 16
    assert heads_per_tile(3, 64) == 3 and heads_per_tile(1, 64) == 1
    with pytest.raises(ValueError, match="head_dim 96 is not supported"):
        select_configs("cuda_sm90", 96)
    with pytest.raises(ValueError, match="power of two >= 16"):
        AttnConfig(48, 64, 4, 2)


def test_explicit_tiles_keep_the_bits_of_the_key_tile(device):
    # Only the key tile (and the instruction path) decides a row's bits: another BLOCK_M packing more or fewer
    # query positions per tile gives the same bits; the pinned table still never varies it by call.
    if device.type != "cpu":
        pytest.skip("a statement about the interpreter's exact-product dots")
    q, k, v = _qkv(1, 4, 2, 24, 24, 64, 99, device)
    base = select_configs("triton_interpreter", 64)
    wide = dataclasses.replace(base, fwd=AttnConfig(32, base.fwd.block_n, 4, 1))
    _bits(attention(q, k, v, configs=wide), attention(q, k, v))


def test_split_heads_option_keeps_the_bits(device):
    # The speed option: a small grid takes one query head per program; a row's bits must not change.
    q, k, v = _qkv(2, 4, 2, 24, 24, 64, 101, device)
    base = select_configs(backend_of(device), 64)
    split = dataclasses.replace(base, split_heads_below=10**6)
    prefill = attention(q, k, v)
    for i in (0, 15, 16, 23):
        _bits(attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], configs=split), prefill[:, :, i:i + 1])
    _bits(attention(q, k, v, configs=split), prefill)


# ---- GPU: real shapes ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 64])
def test_gpu_decode_prefill_chunked_bitwise_at_qwen3_shapes(head_dim, device):
    batch, seq = 2, 1100
    q, k, v = _qkv(batch, 32, 8, seq, seq, head_dim, 5, device)
    prefill = attention(q, k, v)
    for i in (0, 63, 64, 127, 128, 129, 700, seq - 1):
        _bits(attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1]), prefill[:, :, i:i + 1])
    for chunk in (96, 256, 512):
        parts = [attention(q[:, :, s:s + chunk], k[:, :, :s + chunk], v[:, :, :s + chunk])
                 for s in range(0, seq, chunk)]
        _bits(torch.cat(parts, 2), prefill)
    _bits(attention(q[1:], k[1:], v[1:]), prefill[1:])
    o_star, bound = attention_fwd_bound(q[:1, :8], k[:1, :2], v[:1, :2], block_n=_block_n(device, head_dim))
    assert check_bound(prefill[:1, :8], o_star, bound).passed


@pytest.mark.gpu
def test_gpu_padding_static_cache_and_varlen_bitwise(device):
    seq, pad = 777, 100
    q, k, v = _qkv(1, 32, 8, seq, seq, 128, 15, device)
    alone = attention(q, k, v)
    zeros = lambda t: torch.zeros_like(t[:, :, :pad])  # noqa: E731
    left = attention(*(torch.cat([zeros(t), t], 2) for t in (q, k, v)), kv_start=_i32([pad], device))
    _bits(left[:, :, pad:], alone)
    right = attention(*(torch.cat([t, zeros(t)], 2) for t in (q, k, v)))
    _bits(right[:, :, :seq], alone)
    cap = 1024
    ks = torch.full((1, 8, cap, 128), float("nan"), dtype=torch.bfloat16, device=device)
    vs = ks.clone()
    ks[:, :, :seq], vs[:, :, :seq] = k, v
    for i in (0, 500, seq - 1):
        _bits(attention(q[:, :, i:i + 1], ks, vs, kv_end=_i32([i + 1], device)), alone[:, :, i:i + 1])
    packed = attention_varlen(*(t[0].transpose(0, 1).repeat(2, 1, 1) for t in (q, k, v)),
                              _i32([0, seq, 2 * seq], device), _i32([0, seq, 2 * seq], device), seq, seq)
    _bits(packed[seq:], alone[0].transpose(0, 1))


@pytest.mark.gpu
def test_gpu_backward_within_bound_and_repeatable(device):
    q, k, v = _qkv(1, 32, 8, 640, 640, 128, 25, device)
    do = bf16_randn(q.shape, 29, device)
    grads = _grads(q, k, v, do)
    for first, again in zip(grads, _grads(q, k, v, do)):
        _bits(first, again)
    cfg = select_configs("cuda_sm90", 128)
    bounds = attention_bwd_bound(q[:, :8], k[:, :2], v[:, :2], do[:, :8], block_n=cfg.dq.block_n,
                                 block_m=cfg.dkdv.block_m)
    sub = _grads(q[:, :8], k[:, :2], v[:, :2], do[:, :8])
    for name, grad in zip(("dq", "dk", "dv"), sub):
        assert check_bound(grad, *bounds[name]).passed, name


@pytest.mark.gpu
def test_gpu_sdpa_matches_flash_sdpa_within_bound(device):
    q, k, v = _qkv(2, 32, 8, 1024, 1024, 128, 35, device)
    ours = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    o_star, bound = attention_fwd_bound(q[:, :4], k[:, :1], v[:, :1], block_n=_block_n(device, 128))
    assert check_bound(ours[:, :4], o_star, bound).passed
    flash = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                             is_causal=True)
    assert (ours.float() - flash.float()).abs().max() <= 2 ** -5
    assert math.isfinite(float(ours.float().abs().max()))


# ---- compile for sm_90 without a GPU ------------------------------------------------------------------
_SM90_SCRIPT = """
import json
from tools.attention_sass import compile_sm90
from detkit.kernels.attention.configs import CONFIG_TABLE
from detkit.kernels.attention.launch import COMBINE_WARPS
rows = [compile_sm90(kernel, getattr(cfgs, kernel), d) for d, cfgs in CONFIG_TABLE["cuda_sm90"].items()
        for kernel in ("fwd", "dkdv", "dq")]
rows += [compile_sm90("fwd", cfgs.fwd, d, split_grid=True) for d, cfgs in CONFIG_TABLE["cuda_sm90"].items()]
rows += [compile_sm90("fwd_combine", cfgs.fwd, d, sinks=True, num_warps=COMBINE_WARPS)
         for d, cfgs in CONFIG_TABLE["cuda_sm90"].items()]
rows += [compile_sm90("fwd", cfgs.fwd, d, page_size=16) for d, cfgs in CONFIG_TABLE["cuda_sm90"].items()]
rows += [compile_sm90("fwd", CONFIG_TABLE["cuda_sm90"][128].fwd, 128, split_grid=True, page_size=16)]
# Head dims read masked on wider tiles: MLA's (DeepSeek-V3: qk 192, v 128 on 256) and Phi-3-mini's 96 on 128.
for d, qk, v in ((256, 192, 128), (128, 96, 96)):
    cfg = CONFIG_TABLE["cuda_sm90"][d].fwd
    rows += [compile_sm90("fwd", cfg, d, dim_qk=qk, dim_v=v), compile_sm90("fwd", cfg, d, dim_qk=qk, dim_v=v,
             split_grid=True), compile_sm90("fwd_combine", cfg, d, sinks=True, num_warps=COMBINE_WARPS, dim_qk=qk,
             dim_v=v), compile_sm90("fwd", cfg, d, dim_qk=qk, dim_v=v, page_size=16)]
print(json.dumps(rows))
"""


def test_pinned_sm90_tiles_compile_offline_to_wgmma_without_spills(tmp_path):
    from tests.moe_helpers import compile_sm90_offline

    rows = compile_sm90_offline(_SM90_SCRIPT, tmp_path)
    # fwd (one pass), dkdv, dq, fwd (split grid), and the combine pass per head dim; the paged forward (one pass per
    # head dim, and the split grid at 128); the masked head dims' forward (one pass, split grid, combine, paged)
    assert len(rows) == 6 * len(CONFIG_TABLE["cuda_sm90"]) + 1 + 2 * 4
    assert {r["variant"] for r in rows if "qk" in r["variant"]} == {
        f"{extra}qk{qk}v{v}" for qk, v in ((192, 128), (96, 96)) for extra in ("", "split_grid+", "sinks+", "paged16+")}
    for r in rows:
        if r["kernel"] == "fwd_combine":  # no MMA: it folds FP32 partials
            assert r["HGMMA"] == 0 and r["HMMA"] == 0 and r["stack_bytes"] == 0, r
            continue
        # wgmma, no mma.sync fallback (the paged build must run the contiguous build's MMAs to give its bits)
        assert r["HGMMA"] > 0 and r["HMMA"] == 0, r
        # No register spills, except head_dim 256's dk/dv, where every wgmma tile spills (configs.py), and the
        # paged one-pass forward at 128 (8 bytes with Triton 3.6: the per-key page offsets), native or with 96
        # masked (the same 8 bytes): bounded here.
        allowed = {(256, "dkdv", ""): 256, (128, "fwd", "paged16"): 8, (128, "fwd", "paged16+qk96v96"): 8}
        assert r["stack_bytes"] <= allowed.get((r["head_dim"], r["kernel"], r["variant"]), 0), r
        assert r["shared_bytes"] <= 227 * 1024, r  # sm_90's per-block shared-memory limit
