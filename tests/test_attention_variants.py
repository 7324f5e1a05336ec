"""Attention variants (issue #48, part 1): sliding windows, against the FP64 oracle (the derived bound) and the
pure-torch reference; the invariance rule bit for bit under a window (decode vs prefill vs chunked prefill, batch
size and position, left and right padding, a sliding-window cache that dropped keys, packed vs padded); backward
within its bound and repeatable; the refusals. CPU shapes are tiny (the interpreter's 16-key tiles, so windows of
1, 5, 16, 17 keys cross and straddle tile edges); GPU tests at real shapes are marked ``gpu``."""

import pytest
import torch

from detkit.kernels.attention import (
    attention, attention_bwd_bound, attention_fwd_bound, attention_ref, attention_varlen, attention_varlen_ref,
)
from detkit.kernels.attention.configs import select_configs
from detkit.toolkit.contract import check_bound, compare_bits
from detkit.toolkit.fixtures import bf16_randn
from tests.conftest import backend_of
from tests.test_attention import _i32, _qkv


def _bits(x, y, what=""):
    result = compare_bits(x.contiguous(), y.contiguous())
    assert result.equal, (what, result)


def _block_n(device, head_dim):
    return select_configs(backend_of(device), head_dim).fwd.block_n


def _grads(q, k, v, do, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attention(*leaves, **kwargs).backward(do)
    return [t.grad for t in leaves]


# ---- sliding window ------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [1, 5, 16, 17, 100])  # one key; inside a tile; a tile; across tiles; > seq
def test_window_forward_within_bound_and_matches_reference(window, device):
    q, k, v = _qkv(2, 4, 2, 40, 40, 64, 41, device, q_scale=2.0)
    kv_start = _i32([0, 3], device)
    o = attention(q, k, v, kv_start=kv_start, window=window)
    o_star, bound = attention_fwd_bound(q, k, v, kv_start=kv_start, window=window, block_n=_block_n(device, 64))
    result = check_bound(o, o_star, bound)
    assert result.passed, result
    assert check_bound(attention_ref(q, k, v, kv_start=kv_start, window=window), o_star, bound).passed
    if window >= 40:  # a window wider than the sequence is no window: the same bits as without one
        _bits(o, attention(q, k, v, kv_start=kv_start))


def test_window_bound_rejects_a_window_off_by_one(device):
    q, k, v = _qkv(1, 4, 2, 24, 24, 64, 43, device, q_scale=2.0)
    o_star, bound = attention_fwd_bound(q, k, v, window=6)
    assert check_bound(attention_ref(q, k, v, window=6), o_star, bound).passed
    for wrong in (5, 7):
        assert not check_bound(attention_ref(q, k, v, window=wrong), o_star, bound).passed, wrong


@pytest.mark.parametrize("window", [5, 17])
def test_window_decode_prefill_chunked_batch_and_padding_give_the_same_bits(window, device):
    seq = 37
    q, k, v = _qkv(2, 4, 2, seq, seq, 64, 47, device)
    prefill = attention(q, k, v, window=window)
    for i in (0, 4, 15, 16, 17, 22, seq - 1):  # decode steps against the full cache
        _bits(attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], window=window), prefill[:, :, i:i + 1],
              f"decode {i}")
    for chunk in (3, 16, 20):
        parts = [attention(q[:, :, s:s + chunk], k[:, :, :s + chunk], v[:, :, :s + chunk], window=window)
                 for s in range(0, seq, chunk)]
        _bits(torch.cat(parts, dim=2), prefill, f"chunk {chunk}")
    _bits(attention(q[1:], k[1:], v[1:], window=window), prefill[1:], "batch 1")  # batch size and position
    # Left padding of 5 (rollout) and right padding of 4 (trainer): the same bits on the valid rows.
    pad = lambda t, n, left: torch.cat([torch.zeros_like(t[:, :, :n]), t] if left else [t, torch.zeros_like(t[:, :, :n])], 2)  # noqa: E731
    left = attention(*(pad(t, 5, True) for t in (q, k, v)), kv_start=_i32([5, 5], device), window=window)
    _bits(left[:, :, 5:], prefill, "left padding")
    right = attention(*(pad(t, 4, False) for t in (q, k, v)), window=window)
    _bits(right[:, :, :seq], prefill, "right padding")
    # A static cache (tail unfilled) read by a decode step.
    cap = 48
    ks = torch.full((2, 2, cap, 64), float("nan"), dtype=torch.bfloat16, device=device)
    vs = ks.clone()
    ks[:, :, :seq], vs[:, :, :seq] = k, v
    _bits(attention(q[:, :, 30:31], ks, vs, kv_end=_i32([31, 31], device), window=window), prefill[:, :, 30:31],
          "static cache")


def test_window_sliding_cache_with_dropped_keys_gives_the_prefill_bits(device):
    # transformers' sliding-window cache keeps the last window - 1 keys: a decode step sees window keys whose first
    # row is not the sequence's first key. kv_start = -(dropped keys) keeps the tiles anchored at the sequence's
    # start, so the step's bits are the prefill's. Left padding of 3 in sequence 1: its anchor is 3 - dropped.
    window, seq, pad = 6, 40, 3
    q, k, v = _qkv(2, 4, 2, seq, seq, 64, 53, device)
    kv_start = _i32([0, pad], device)
    prefill = attention(q, k, v, kv_start=kv_start, window=window)
    for i in (window, 16, 17, 31, seq - 1):
        first = i - window + 1  # the cache holds keys first..i
        step = attention(q[:, :, i:i + 1], k[:, :, first:i + 1], v[:, :, first:i + 1], window=window,
                         kv_start=kv_start - first)
        _bits(step, prefill[:, :, i:i + 1], f"step {i}")
    # A chunk of 5 queries after a cache of window - 1 keys (chunked prefill with a sliding cache).
    first = 20 - window + 1
    chunk = attention(q[:, :, 20:25], k[:, :, first:25], v[:, :, first:25], window=window, kv_start=kv_start - first)
    _bits(chunk, prefill[:, :, 20:25], "chunk")
    # A dropped key inside some query's window is refused in-band: that sequence's outputs are NaN.
    o = attention(q[:, :, 20:21], k[:, :, 18:21], v[:, :, 18:21], window=window, kv_start=_i32([-18, 0], device))
    assert torch.isnan(o[0]).all() and torch.isfinite(o[1]).all()


def test_window_varlen_matches_padded(device):
    window = 7
    q, k, v = _qkv(1, 4, 2, 30, 30, 64, 59, device)
    lens = [30, 11]
    packed = [torch.cat([t[0, :, :n].transpose(0, 1) for n in lens]) for t in (q, k, v)]
    cu = _i32([0, 30, 41], device)
    out = attention_varlen(*packed, cu, cu, 30, 30, window=window)
    alone = attention(q, k, v, window=window)
    _bits(out[:30], alone[0].transpose(0, 1), "sequence 0")
    _bits(out[30:], attention(q[:, :, :11], k[:, :, :11], v[:, :, :11], window=window)[0].transpose(0, 1), "seq 1")
    assert (out.float() - attention_varlen_ref(*packed, cu, cu, window=window).float()).abs().max() <= 2 ** -6


@pytest.mark.parametrize("window", [5, 17])
def test_window_backward_within_bound_repeatable_and_batch_invariant(window, device):
    q, k, v = _qkv(1, 4, 2, 36, 36, 64, 61, device)
    do = bf16_randn(q.shape, 67, device)
    grads = _grads(q, k, v, do, window=window)
    bounds = attention_bwd_bound(q, k, v, do, window=window)
    for name, grad in zip(("dq", "dk", "dv"), grads):
        result = check_bound(grad, *bounds[name])
        assert result.passed, (name, result)
    for first, again in zip(grads, _grads(q, k, v, do, window=window)):
        _bits(first, again, "repeat")
    # Beside another sequence, and packed with it: the same gradient bits (left padding shifts the query tiles
    # that dk, dv sum over, so it is not a claim for the backward, with or without a window).
    q2, k2, v2 = _qkv(1, 4, 2, 36, 36, 64, 71, device)
    do2 = bf16_randn(q.shape, 73, device)
    both = _grads(*(torch.cat(p) for p in ((q2, q), (k2, k), (v2, v), (do2, do))), window=window)
    for name, first, again in zip(("dq", "dk", "dv"), grads, both):
        _bits(again[1:], first, name)
    leaves = [torch.cat(p).transpose(1, 2).reshape(72, -1, 64).clone().requires_grad_()
              for p in ((q2, q), (k2, k), (v2, v))]
    cu = _i32([0, 36, 72], device)
    attention_varlen(*leaves, cu, cu, 36, 36, window=window).backward(
        torch.cat((do2, do)).transpose(1, 2).reshape(72, 4, 64))
    for name, leaf, first in zip(("dq", "dk", "dv"), leaves, grads):
        _bits(leaf.grad[36:], first[0].transpose(0, 1), f"packed {name}")


def test_window_refusals(device):
    q, k, v = _qkv(1, 4, 2, 8, 8, 64, 3, device)
    for bad in (0, -3, True, 2.5, 2**40):
        with pytest.raises(ValueError) as info:
            attention(q, k, v, window=bad)
        assert f"window {bad!r} is not supported" in str(info.value) and "\n" not in str(info.value)
    # Without a window a negative kv_start is still a bad bound (NaN outputs), never a read before key 0.
    o = attention(q, k, v, kv_start=_i32([-2], device))
    assert torch.isnan(o).all()


# ---- sliding window through the SDPA and transformers adapters ------------------------------------------
def _sliding_mask(padding, q_len, kv_len, kv_offset, window):
    """The 4-D boolean mask transformers builds for sdpa with a sliding window (masking_utils: kv <= q, kv > q -
    window, the 2-D padding mask), query and key positions absolute: keys kv_offset.., queries the last q_len."""
    q_pos = kv_offset + kv_len - q_len + torch.arange(q_len, device=padding.device)
    kv_pos = kv_offset + torch.arange(kv_len, device=padding.device)
    causal = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] > q_pos[:, None] - window)
    return (causal[None] & padding[:, kv_pos][:, None, :])[:, None]


class _Attn(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def test_sdpa_and_hf_adapters_with_a_sliding_window_mask(device):
    from detkit.kernels.attention import hf_attention_forward, sdpa, tag_mask_anchor
    from detkit.kernels.attention.sdpa import mask_anchor

    window, seq = 6, 30
    q, k, v = _qkv(2, 4, 2, seq, seq, 64, 79, device)
    padding = torch.ones(2, seq, dtype=torch.bool, device=device)
    padding[1, :4] = False  # left padding of 4
    kv_start = _i32([0, 4], device)
    prefill = attention(q, k, v, kv_start=kv_start, window=window, scale=0.125)
    mask = _sliding_mask(padding, seq, seq, 0, window)
    _bits(sdpa(q, k, v, mask, enable_gqa=True, scale=0.125, window=window), prefill, "sdpa prefill")
    out, _ = hf_attention_forward(_Attn(), q, k, v, mask, scaling=0.125, sliding_window=window)
    _bits(out.transpose(1, 2), prefill, "hf prefill")
    # The valid rows match F.sdpa (FP64) within the bound's reach.
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), attn_mask=mask,
        scale=0.125)
    assert (prefill[0].double() - expected[0]).abs().max() <= 2 ** -6
    assert (prefill[1, :, 4:].double() - expected[1, :, 4:]).abs().max() <= 2 ** -6
    # A decode step past the window with transformers' sliding cache (the last window - 1 keys + the new one): its
    # mask hides each sequence's first key. Untagged it is refused by name; tagged (what detkit's mask function
    # does, from the 2-D padding mask and the cache's kv_offset) it gives the prefill's bits.
    i = 20
    first = i - window + 1
    step_mask = _sliding_mask(padding, 1, window, first, window)
    with pytest.raises(NotImplementedError, match="hides a sequence's first key"):
        hf_attention_forward(_Attn(), q[:, :, i:i + 1], k[:, :, first:i + 1], v[:, :, first:i + 1], step_mask,
                             scaling=0.125, sliding_window=window)
    tag_mask_anchor(step_mask, padding, first, 2)
    assert mask_anchor(step_mask).tolist() == [-first, 4 - first]
    out, _ = hf_attention_forward(_Attn(), q[:, :, i:i + 1], k[:, :, first:i + 1], v[:, :, first:i + 1], step_mask,
                                  scaling=0.125, sliding_window=window)
    _bits(out.transpose(1, 2), prefill[:, :, i:i + 1], "hf decode with a sliding cache")
    # A full cache (nothing dropped) whose window hides the first key is refused the same way untagged.
    full_mask = _sliding_mask(padding, 1, i + 1, 0, window)
    with pytest.raises(NotImplementedError, match="hides a sequence's first key"):
        sdpa(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], full_mask, enable_gqa=True, scale=0.125,
             window=window)
    # A mask of another window than the call's is not causal + padding + window.
    with pytest.raises(ValueError, match="sliding window 5"):
        sdpa(q, k, v, mask, enable_gqa=True, scale=0.125, window=5)
    with pytest.raises(ValueError, match="is not causal \\+ padding"):
        sdpa(q, k, v, mask, enable_gqa=True, scale=0.125)  # no window: a sliding mask is refused
    with pytest.raises(NotImplementedError, match="sliding_window 0 is not supported"):
        hf_attention_forward(_Attn(), q, k, v, mask, sliding_window=0)


# ---- logit softcapping and attention sinks ---------------------------------------------------------------
SINKS = [0.5, -1.0, 2.0, 0.0]


def _sinks(device, dtype=torch.bfloat16):
    return torch.tensor(SINKS, dtype=dtype, device=device)


@pytest.mark.parametrize("variant", ["softcap", "sinks", "softcap+sinks+window"])
def test_softcap_and_sinks_forward_backward_within_bound(variant, device):
    q, k, v = _qkv(2, 4, 2, 24, 24, 64, 83, device, q_scale=4.0)  # large logits: the cap and the sinks matter
    do = bf16_randn(q.shape, 89, device)
    kv_start = _i32([0, 5], device)
    kwargs = {"kv_start": kv_start}
    if "softcap" in variant:
        kwargs["softcap"] = 5.0
    if "window" in variant:
        kwargs["window"] = 7
    sinks = _sinks(device) if "sinks" in variant else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.clone().requires_grad_()
    o = attention(*leaves, sinks=sink_leaf, **kwargs)
    o.backward(do)
    o_star, bound = attention_fwd_bound(q, k, v, sinks=sinks, block_n=_block_n(device, 64), **kwargs)
    result = check_bound(o, o_star, bound)
    assert result.passed, result
    assert check_bound(attention_ref(q, k, v, sinks=sinks, **kwargs), o_star, bound).passed
    bounds = attention_bwd_bound(q, k, v, do, sinks=sinks, **kwargs)
    grads = dict(zip(("dq", "dk", "dv"), (t.grad for t in leaves)))
    if sinks is not None:
        grads["dsinks"] = sink_leaf.grad
        assert sink_leaf.grad.dtype == torch.bfloat16
    for name, grad in grads.items():
        result = check_bound(grad, *bounds[name])
        assert result.passed, (name, result)


def test_softcap_and_sink_bounds_reject_a_wrong_cap_and_a_missing_sink(device):
    q, k, v = _qkv(1, 4, 2, 20, 20, 64, 97, device, q_scale=4.0)
    o_star, bound = attention_fwd_bound(q, k, v, softcap=5.0)
    assert check_bound(attention_ref(q, k, v, softcap=5.0), o_star, bound).passed
    assert not check_bound(attention_ref(q, k, v, softcap=6.0), o_star, bound).passed
    assert not check_bound(attention_ref(q, k, v), o_star, bound).passed
    sinks = _sinks(device)
    o_star, bound = attention_fwd_bound(q, k, v, sinks=sinks)
    assert check_bound(attention_ref(q, k, v, sinks=sinks), o_star, bound).passed
    assert not check_bound(attention_ref(q, k, v), o_star, bound).passed
    assert not check_bound(attention_ref(q, k, v, sinks=sinks.roll(1)), o_star, bound).passed


def test_softcap_and_sinks_decode_prefill_chunked_batch_padding_bitwise(device):
    seq = 34
    q, k, v = _qkv(2, 4, 2, seq, seq, 64, 101, device, q_scale=2.0)
    kw = {"softcap": 5.0, "sinks": _sinks(device, torch.float32), "window": 9}
    for name, extra in (("softcap", {"softcap": 5.0}), ("sinks", {"sinks": kw["sinks"]}), ("all", kw)):
        prefill = attention(q, k, v, **extra)
        for i in (0, 8, 15, 16, 33):
            _bits(attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], **extra), prefill[:, :, i:i + 1],
                  f"{name} decode {i}")
        parts = [attention(q[:, :, s:s + 13], k[:, :, :s + 13], v[:, :, :s + 13], **extra) for s in range(0, seq, 13)]
        _bits(torch.cat(parts, 2), prefill, f"{name} chunks")
        _bits(attention(q[1:], k[1:], v[1:], **extra), prefill[1:], f"{name} batch")
        padded = attention(*(torch.cat([torch.zeros_like(t[:, :, :3]), t], 2) for t in (q, k, v)),
                           kv_start=_i32([3, 3], device), **extra)
        _bits(padded[:, :, 3:], prefill, f"{name} left padding")
        if "sinks" in extra:  # rows that see no key give exact zeros (the sink takes all the weight)
            assert torch.all(padded[:, :, :3] == 0)


def test_softcap_and_sinks_refusals(device):
    q, k, v = _qkv(1, 4, 2, 8, 8, 64, 3, device)
    cases = [
        (lambda: attention(q, k, v, softcap=0.0), ValueError, "softcap 0.0 is not supported"),
        (lambda: attention(q, k, v, softcap=float("inf")), ValueError, "softcap inf is not supported"),
        (lambda: attention(q, k, v, sinks=[0.0] * 4), TypeError, "sinks must be a torch.Tensor or None"),
        (lambda: attention(q, k, v, sinks=_sinks(device)[:2]), ValueError, "sinks must be a bfloat16 or float32 "
         "tensor of shape (4,)"),
        (lambda: attention(q, k, v, sinks=_sinks(device, torch.float16)), ValueError, "got torch.float16"),
        (lambda: attention(q, k, v, sinks=torch.zeros(8, device=device)[::2]), ValueError, "sinks must be contiguous"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc) as info:
            call()
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


# ---- head_dim 256 (Gemma-2/3) ------------------------------------------------------------------------------
def test_head_dim_256_with_softcap_and_window_within_bound_and_bitwise(device):
    q, k, v = _qkv(1, 4, 2, 20, 20, 256, 103, device, q_scale=2.0)
    do = bf16_randn(q.shape, 107, device)
    kw = {"softcap": 5.0, "window": 6}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = attention(*leaves, **kw)
    o.backward(do)
    result = check_bound(o, *attention_fwd_bound(q, k, v, block_n=_block_n(device, 256), **kw))
    assert result.passed, result
    bounds = attention_bwd_bound(q, k, v, do, **kw)
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        result = check_bound(leaf.grad, *bounds[name])
        assert result.passed, (name, result)
    for i in (0, 5, 6, 15, 16, 19):
        _bits(attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], **kw), o[:, :, i:i + 1], f"decode {i}")


# ---- GPU: real shapes ---------------------------------------------------------------------------------
# (Hq, Hkv, D, variant kwargs): Mistral-7B's heads with a sliding window; Gemma-2-9B's (head_dim 256, softcap 50,
# sliding layers of 4096 keys, here 300 so the tests cross it); gpt-oss-20b's (64 on 8 heads of 64, sinks, sliding
# layers of 128 keys).
GPU_MODELS = {
    "mistral": (32, 8, 128, {"window": 300}),
    "gemma2": (16, 8, 256, {"window": 300, "softcap": 50.0}),
    "gpt-oss": (64, 8, 64, {"window": 128, "sinks": True}),
}


def _gpu_kwargs(spec, heads_q, device):
    kw = dict(spec)
    if kw.get("sinks"):
        kw["sinks"] = torch.linspace(-2.0, 3.0, heads_q, device=device).to(torch.bfloat16)
    return kw


def _sub_kwargs(kw, heads):
    """The kwargs for the first ``heads`` query heads (sinks are per head)."""
    return {**kw, "sinks": kw["sinks"][:heads]} if "sinks" in kw else kw


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(GPU_MODELS))
def test_gpu_variants_decode_prefill_chunked_padding_bitwise_and_bound(model, device):
    heads_q, heads_kv, head_dim, spec = GPU_MODELS[model]
    window = spec["window"]
    batch, seq = 2, 1100
    q, k, v = _qkv(batch, heads_q, heads_kv, seq, seq, head_dim, 5, device)
    kw = _gpu_kwargs(spec, heads_q, device)
    prefill = attention(q, k, v, **kw)
    for i in (0, 63, 64, 127, 128, 129, window - 1, window, window + 1, 700, seq - 1):
        _bits(attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], **kw), prefill[:, :, i:i + 1],
              f"decode {i}")
        first = max(i - window + 1, 0)  # transformers' sliding-window cache: the last window - 1 keys + the new one
        start = torch.full((batch,), -first, dtype=torch.int32, device=device)
        _bits(attention(q[:, :, i:i + 1], k[:, :, first:i + 1], v[:, :, first:i + 1], kv_start=start, **kw),
              prefill[:, :, i:i + 1], f"sliding cache {i}")
    for chunk in (96, 256, 512):
        parts = [attention(q[:, :, s:s + chunk], k[:, :, :s + chunk], v[:, :, :s + chunk], **kw)
                 for s in range(0, seq, chunk)]
        _bits(torch.cat(parts, 2), prefill, f"chunk {chunk}")
    _bits(attention(q[1:], k[1:], v[1:], **kw), prefill[1:], "batch")
    pad = 37
    left = attention(*(torch.cat([torch.zeros_like(t[:, :, :pad]), t], 2) for t in (q, k, v)),
                     kv_start=_i32([pad, pad], device), **kw)
    _bits(left[:, :, pad:], prefill, "left padding")
    group = heads_q // heads_kv
    sub = _sub_kwargs(kw, group)
    o_star, bound = attention_fwd_bound(q[:1, :group, -300:], k[:1, :1], v[:1, :1], block_n=_block_n(device, head_dim),
                                        **sub)
    result = check_bound(prefill[:1, :group, -300:], o_star, bound)
    assert result.passed, result


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(GPU_MODELS))
def test_gpu_variants_backward_within_bound_and_repeatable(model, device):
    heads_q, heads_kv, head_dim, spec = GPU_MODELS[model]
    q, k, v = _qkv(1, heads_q, heads_kv, 640, 640, head_dim, 25, device)
    do = bf16_randn(q.shape, 29, device)
    kw = _gpu_kwargs(spec, heads_q, device)

    def grads(q, k, v, do, kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        sinks = kw["sinks"].clone().requires_grad_() if "sinks" in kw else None
        attention(*leaves, **{**kw, **({"sinks": sinks} if sinks is not None else {})}).backward(do)
        return [t.grad for t in leaves] + ([sinks.grad] if sinks is not None else [])

    first = grads(q, k, v, do, kw)
    for a, b in zip(first, grads(q, k, v, do, kw)):
        _bits(a, b, "repeat")
    group = heads_q // heads_kv
    cfg = select_configs("cuda_sm90", head_dim)
    sub = _sub_kwargs(kw, group)
    bounds = attention_bwd_bound(q[:, :group], k[:, :1], v[:, :1], do[:, :group], block_n=cfg.dq.block_n,
                                 block_m=cfg.dkdv.block_m, **sub)
    names = ["dq", "dk", "dv"] + (["dsinks"] if "sinks" in kw else [])
    for name, grad in zip(names, grads(q[:, :group], k[:, :1], v[:, :1], do[:, :group], sub)):
        result = check_bound(grad, *bounds[name])
        assert result.passed, (name, result)


@pytest.mark.gpu
def test_gpu_window_matches_sdpa_with_a_sliding_mask(device):
    q, k, v = _qkv(2, 32, 8, 1024, 1024, 128, 35, device)
    window = 256
    ours = attention(q, k, v, window=window)
    i = torch.arange(1024, device=device)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert (ours.float() - theirs.float()).abs().max() <= 2 ** -5


def test_a_mask_the_kernels_do_not_cover_is_refused_by_name_and_falls_back_in_transformers_route(device):
    """A bidirectional block inside a sliding mask (Gemma-3's image tokens): a ValueError for a direct call and a
    NotImplementedError for transformers' route (which then runs transformers' own function, counted)."""
    from detkit.kernels.attention import hf_attention_forward

    q, k, v = _qkv(1, 4, 2, 12, 12, 64, 109, device)
    mask = _sliding_mask(torch.ones(1, 12, dtype=torch.bool, device=device), 12, 12, 0, 6)
    mask[..., 3:6, 3:6] = True  # three tokens that see each other both ways
    with pytest.raises(ValueError, match="is not causal \\+ padding \\+ sliding window 6"):
        hf_attention_forward(_Attn(), q, k, v, mask, sliding_window=6)
    with pytest.raises(NotImplementedError, match="is not causal \\+ padding"):
        hf_attention_forward(_Attn(), q, k, v, mask, sliding_window=6)


def test_varlen_with_softcap_sinks_and_window_matches_padded(device):
    q, k, v = _qkv(2, 4, 2, 18, 18, 64, 113, device, q_scale=2.0)
    kw = {"softcap": 5.0, "sinks": _sinks(device), "window": 5}
    padded = attention(q, k, v, **kw)
    packed = [t.transpose(1, 2).reshape(36, t.shape[1], 64) for t in (q, k, v)]
    cu = _i32([0, 18, 36], device)
    out = attention_varlen(*packed, cu, cu, 18, 18, **kw)
    _bits(out, padded.transpose(1, 2).reshape(36, 4, 64), "packed")
    ref = attention_varlen_ref(*packed, cu, cu, **kw)
    assert (out.float() - ref.float()).abs().max() <= 2 ** -6
