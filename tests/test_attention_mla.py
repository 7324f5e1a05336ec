"""MLA (issue #48): a value head dim Dv other than the query/key head dim Dqk (DeepSeek-V3: qk 192 = nope 128 + rope
64, v 128; its tiny preset qk 64, v 32), and one head dim between the kernel's, on the tiles of one head dim D: the
inference forward reads q, k, v in place with masked loads, the autograd path runs copies zero-padded to D
(launch.mixed_head_dims); the two give the same bits (issue #48 / #50: a decode step no longer copies its cache).
Against the FP64 oracle computed unpadded (the derived bound, with Dqk in the QK dots and Dv in the PV and dP dots)
and the pure-torch reference; masked = padded bit for bit on both forward grids; the invariance rule bit for bit
(decode vs prefill vs chunked prefill, batch, left and right padding, a static cache, packed vs padded, both forward
grids); backward within its bound, repeatable and batch-invariant; the adapters; the refusals. CPU shapes are tiny
(the interpreter's 16-key tiles; 16-key splits for rows of up to 32 keys, 32-key splits beyond); the GPU tests at
DeepSeek-V3's head dims are marked ``gpu``."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import detkit.kernels.attention.launch as attention_launch
from detkit.kernels.attention import (
    attention, attention_bwd_bound, attention_fwd_bound, attention_ref, attention_varlen, attention_varlen_ref,
    hf_attention_forward, sdpa, sdpa_unsupported_reason,
)
from detkit.kernels.attention.configs import select_configs
from detkit.kernels.attention.launch import kernel_head_dim
from detkit.toolkit.contract import check_bound, compare_bits
from detkit.toolkit.fixtures import bf16_randn
from tests.conftest import backend_of
from tests.test_attention import _i32


def _bits(x, y, what=""):
    result = compare_bits(x.contiguous(), y.contiguous())
    assert result.equal, (what, result)


def _mla(batch, heads_q, heads_kv, seq_q, seq_k, dqk, dv, seed, device, q_scale=1.0):
    return (bf16_randn((batch, heads_q, seq_q, dqk), seed, device, scale=q_scale),
            bf16_randn((batch, heads_kv, seq_k, dqk), seed + 1, device),
            bf16_randn((batch, heads_kv, seq_k, dv), seed + 2, device))


def _block_n(device, dqk, dv):
    return select_configs(backend_of(device), kernel_head_dim(dqk, dv)).fwd.block_n


def _paths(device, dqk, dv):
    """The table's configs for the kernel head dim forced onto each forward path: one pass, and the split grid +
    combine pass."""
    base = select_configs(backend_of(device), kernel_head_dim(dqk, dv))
    return {"one_pass": dataclasses.replace(base, split_grid_below=0),
            "split_grid": dataclasses.replace(base, split_grid_below=2**62, eager_split_grid_min_keys=0)}


def _padded(q, k, v, **kw):
    """The padded path's forward: copies zero-padded to the kernel head dim through the native kernel, the output's
    first Dv columns."""
    dim = kernel_head_dim(q.shape[-1], v.shape[-1])
    return attention(*(F.pad(t, (0, dim - t.shape[-1])) for t in (q, k, v)), **kw)[..., :v.shape[-1]]


def _in_wider(t, extra):
    """``t`` as the leading columns of a tensor ``extra`` columns wider whose other columns are NaN: a load past
    t's head dim would read NaN."""
    wide = torch.full((*t.shape[:-1], t.shape[-1] + extra), float("nan"), dtype=t.dtype, device=t.device)
    wide[..., :t.shape[-1]] = t
    return wide[..., :t.shape[-1]]


def _no_padded_copy(*args, **kwargs):
    raise AssertionError("the inference forward made zero-padded copies (mixed_head_dims)")


def test_kernel_head_dim_is_the_smallest_supported_one_that_holds_both():
    assert [kernel_head_dim(*d) for d in ((192, 128), (64, 32), (32, 64), (48, 16), (96, 64), (128, 256), (1, 2))] \
        == [256, 64, 64, 64, 128, 256, 64]
    assert [kernel_head_dim(d, d) for d in (64, 128, 256)] == [64, 128, 256]  # one head dim: no padding
    assert [kernel_head_dim(d, d) for d in (96, 80, 8, 200)] == [128, 128, 64, 256]  # one head dim, padded
    with pytest.raises(ValueError, match=r"^head_dim 320 is not supported; supported: head dims of 1 to 256 "):
        kernel_head_dim(320, 320)
    with pytest.raises(ValueError, match=r"^query/key head dim 192 with value head dim 288 is not supported"):
        kernel_head_dim(192, 288)


# ---- numerics -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dqk,dv", [
    (64, 32),  # the tiny DeepSeek-V3 preset: only v padded
    (32, 64),  # q and k padded, v not
    (48, 16),  # all three padded
    (24, 24),  # one head dim between the kernel's (as Phi-3-mini's 96): all three padded
])
def test_forward_within_bound_and_matches_reference(dqk, dv, device):
    q, k, v = _mla(2, 4, 2, 40, 40, dqk, dv, 131, device, q_scale=2.0)
    kv_start = _i32([0, 3], device)
    o = attention(q, k, v, kv_start=kv_start)
    assert o.shape == (2, 4, 40, dv)
    o_star, bound = attention_fwd_bound(q, k, v, kv_start=kv_start, block_n=_block_n(device, dqk, dv))
    result = check_bound(o, o_star, bound)
    assert result.passed, result
    assert check_bound(attention_ref(q, k, v, kv_start=kv_start), o_star, bound).passed
    # The default scale is 1/sqrt(Dqk); an explicit one (transformers' ``scaling``) is used as given.
    _bits(attention(q, k, v, kv_start=kv_start, scale=1 / math.sqrt(dqk)), o, "explicit 1/sqrt(Dqk)")
    o_scaled = attention(q, k, v, kv_start=kv_start, scale=0.3)
    assert check_bound(o_scaled, *attention_fwd_bound(q, k, v, kv_start=kv_start, scale=0.3)).passed


def test_bound_rejects_the_padded_head_dims_scale(device):
    """1/sqrt(D) for D = 64 where Dqk = 32: the bound of the right scale fails it (the padding must not change the
    scale)."""
    q, k, v = _mla(1, 4, 2, 24, 24, 32, 64, 137, device, q_scale=2.0)
    o_star, bound = attention_fwd_bound(q, k, v)
    assert check_bound(attention(q, k, v), o_star, bound).passed
    assert not check_bound(attention(q, k, v, scale=1 / math.sqrt(64)), o_star, bound).passed


def test_backward_within_bound_repeatable_and_batch_invariant(device):
    dqk, dv = 64, 32
    q, k, v = _mla(2, 4, 2, 24, 24, dqk, dv, 139, device, q_scale=2.0)
    do = bf16_randn((2, 4, 24, dv), 149, device)
    kv_start = _i32([0, 5], device)

    def grads(q, k, v, do, **kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves, **kw).backward(do)
        return [t.grad for t in leaves]

    first = grads(q, k, v, do, kv_start=kv_start)
    assert [tuple(g.shape) for g in first] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
    bounds = attention_bwd_bound(q, k, v, do, kv_start=kv_start)
    for name, grad in zip(("dq", "dk", "dv"), first):
        result = check_bound(grad, *bounds[name])
        assert result.passed, (name, result)
    for name, a, b in zip(("dq", "dk", "dv"), first, grads(q, k, v, do, kv_start=kv_start)):
        _bits(a, b, f"repeat {name}")
    for name, a, b in zip(("dq", "dk", "dv"), first, grads(q[1:], k[1:], v[1:], do[1:], kv_start=kv_start[1:])):
        _bits(a[1:], b, f"batch {name}")


# ---- masked loads = padded copies ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["one_pass", "split_grid"])
@pytest.mark.parametrize("dqk,dv", [
    (64, 32),  # only v's columns masked
    (48, 16),  # every head dim masked
    (24, 24),  # one head dim between the kernel's (as Phi-3-mini's 96)
])
def test_masked_forward_gives_the_padded_forward_bits(dqk, dv, path, device, monkeypatch):
    """The inference forward reads q, k, v in place (views into NaN-padded tensors: a column read past the head
    dim would show) and stores o [B, Sq, Hq, Dv]; its prefill and decode steps give the bits of the padded path's
    prefill (zero-padded copies on the native kernel), which the trainer's autograd forward runs."""
    seq = 37  # three 16-key tiles; rows to key extent 32 in 16-key splits, later rows in 32-key splits
    q, k, v = _mla(2, 4, 2, seq, seq, dqk, dv, 171, device, q_scale=2.0)
    kv_start = _i32([0, 3], device)
    configs = _paths(device, dqk, dv)[path]
    padded = _padded(q, k, v, kv_start=kv_start, scale=1 / math.sqrt(dqk), configs=configs)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    _bits(attention(*leaves, kv_start=kv_start, configs=configs).detach(), padded, "trainer (autograd, padded)")
    monkeypatch.setattr(attention_launch, "mixed_head_dims", _no_padded_copy)
    qw, kw, vw = (_in_wider(t, 8) for t in (q, k, v))
    prefill = attention(qw, kw, vw, kv_start=kv_start, configs=configs)
    assert prefill.shape == (2, 4, seq, dv) and prefill.transpose(1, 2).is_contiguous()
    _bits(prefill, padded, "prefill")
    for i in (5, 31, 32, seq - 1):  # from sequence 1's first key; both sides of the 32-key bound
        step = attention(qw[:, :, i:i + 1], kw[:, :, :i + 1], vw[:, :, :i + 1], kv_start=kv_start, configs=configs)
        _bits(step, padded[:, :, i:i + 1], f"decode {i}")


# ---- the invariance rule through the masked head dims ----------------------------------------------------------
def test_decode_prefill_chunked_batch_padding_and_packing_give_the_same_bits(device):
    """Inference calls (no autograd): the masked forward on every path."""
    seq, dqk, dv = 37, 64, 32  # 37 keys: three 16-key tiles; 16-key splits to key extent 32, 32-key splits beyond
    q, k, v = _mla(2, 4, 2, seq, seq, dqk, dv, 151, device)
    prefill = attention(q, k, v)
    for path, configs in _paths(device, dqk, dv).items():
        for i in (0, 15, 16, 32, seq - 1):
            _bits(attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], configs=configs),
                  prefill[:, :, i:i + 1], f"{path} decode {i}")
    parts = [attention(q[:, :, s:s + 10], k[:, :, :s + 10], v[:, :, :s + 10]) for s in range(0, seq, 10)]
    _bits(torch.cat(parts, 2), prefill, "chunks of 10")
    _bits(attention(q[1:], k[1:], v[1:]), prefill[1:], "batch 1")
    left = attention(*(torch.cat([torch.zeros_like(t[:, :, :5]), t], 2) for t in (q, k, v)),
                     kv_start=_i32([5, 5], device))
    _bits(left[:, :, 5:], prefill, "left padding")
    right = attention(*(torch.cat([t, torch.zeros_like(t[:, :, :4])], 2) for t in (q, k, v)))
    _bits(right[:, :, :seq], prefill, "right padding")
    # A static cache (unfilled tail of NaN) read by a decode step.
    ks = torch.full((2, 2, 48, dqk), float("nan"), dtype=torch.bfloat16, device=device)
    vs = torch.full((2, 2, 48, dv), float("nan"), dtype=torch.bfloat16, device=device)
    ks[:, :, :seq], vs[:, :, :seq] = k, v
    i = 20
    _bits(attention(q[:, :, i:i + 1], ks, vs, kv_end=_i32([i + 1, i + 1], device)), prefill[:, :, i:i + 1],
          "static cache")
    # Packed: the second sequence's last 9 queries after its first 28 keys, beside the first sequence whole.
    packed_q = torch.cat([q[0].transpose(0, 1), q[1, :, 28:].transpose(0, 1)])
    packed_k, packed_v = (torch.cat([t[0].transpose(0, 1), t[1].transpose(0, 1)]) for t in (k, v))
    cu_q, cu_k = _i32([0, seq, seq + 9], device), _i32([0, seq, 2 * seq], device)
    out = attention_varlen(packed_q, packed_k, packed_v, cu_q, cu_k, seq, seq)
    assert out.shape == (seq + 9, 4, dv)
    _bits(out[:seq], prefill[0].transpose(0, 1), "packed 0")
    _bits(out[seq:], prefill[1, :, 28:].transpose(0, 1), "packed 1")
    ref = attention_varlen_ref(packed_q, packed_k, packed_v, cu_q, cu_k)
    assert (out.float() - ref.float()).abs().max() <= 2 ** -6


# ---- the adapters ---------------------------------------------------------------------------------------------
def test_sdpa_and_hf_adapters_run_mixed_head_dims(device):
    class Attn(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2

    seq, dqk, dv, scale = 20, 64, 32, 0.17
    q, k, v = _mla(2, 4, 2, seq, seq, dqk, dv, 157, device)
    i = torch.arange(seq, device=device)
    padding = torch.ones(2, seq, dtype=torch.bool, device=device)
    padding[1, :6] = False  # left padding of 6
    mask = ((i[None, :] <= i[:, None])[None] & padding[:, None, :])[:, None]  # transformers' boolean SDPA mask
    assert sdpa_unsupported_reason(q, k, v, mask, scale=scale, enable_gqa=True) is None
    prefill = attention(q, k, v, kv_start=_i32([0, 6], device), scale=scale)
    _bits(sdpa(q, k, v, mask, scale=scale, enable_gqa=True), prefill, "sdpa")
    _bits(sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True)[0], prefill[0], "sdpa is_causal")
    out, weights = hf_attention_forward(Attn(), q, k, v, mask, scaling=scale)
    assert weights is None and out.shape == (2, seq, 4, dv)
    _bits(out.transpose(1, 2), prefill, "hf prefill")
    out, _ = hf_attention_forward(Attn(), q[:, :, -1:], k, v, mask[:, :, -1:], scaling=scale)
    _bits(out.transpose(1, 2), prefill[:, :, -1:], "hf decode")
    # The valid rows match torch's SDPA in FP64 (which takes Dv != Dqk) within the bound's reach.
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), attn_mask=mask,
        scale=scale)
    assert (prefill[0].double() - expected[0]).abs().max() <= 2 ** -6
    assert (prefill[1, :, 6:].double() - expected[1, :, 6:]).abs().max() <= 2 ** -6


# ---- fail closed --------------------------------------------------------------------------------------------
def test_refusals_name_the_head_dims(device):
    q, k = (bf16_randn((1, h, 8, 320), s, device) for h, s in ((4, 1), (2, 2)))
    v = bf16_randn((1, 2, 8, 128), 3, device)
    q64, k64, v32 = q[..., :64], k[..., :64], v[..., :32]
    cases = [
        (lambda: attention(q, k, v), "query/key head dim 320 with value head dim 128 is not supported"),
        (lambda: attention(q[..., :128], k[..., :128], bf16_randn((1, 2, 8, 288), 4, device)),
         "query/key head dim 128 with value head dim 288 is not supported"),
        (lambda: attention(q, k, bf16_randn((1, 2, 8, 320), 5, device)), "head_dim 320 is not supported"),
        (lambda: attention(q64, k64, v32[:, :, :7]), "must have the same shape [B, Hkv, Skv] before the head dim"),
        (lambda: attention(q64, k[..., :32], v32), "does not match q"),
        (lambda: attention_varlen(q64[0].transpose(0, 1), k64[0].transpose(0, 1), v32[0, :1].transpose(0, 1),
                                  _i32([0, 8], device), _i32([0, 8], device), 8, 8), "must be [Tk, Hkv, D] and"),
        (lambda: attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                  _i32([0, 8], device), _i32([0, 8], device), 8, 8), "head dim 320 with value"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    reason = sdpa_unsupported_reason(q, k, v, is_causal=True, enable_gqa=True)
    assert reason == "query/key head_dim 320 with value head_dim 128", reason
    assert "differ before the head dim" in sdpa_unsupported_reason(q64, k64, v32[:, :, :7], is_causal=True,
                                                                     enable_gqa=True)

    class Attn(torch.nn.Module):
        is_causal = True

    with pytest.raises(NotImplementedError, match="query/key head_dim 320 with value head_dim 128"):
        hf_attention_forward(Attn(), q, k, v, None)


# ---- GPU: DeepSeek-V3's head dims -------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_deepseek_v3_head_dims_decode_prefill_bitwise_and_bound(device):
    """DeepSeek-V3's attention heads (MHA, qk 192 = 128 + 64, v 128, padded to 256), all 128, and a few hundred
    keys: decode, chunked prefill, batch and left padding give the prefill's bits; forward and backward within the
    bound (a head subset: the oracle is dense FP64)."""
    heads, dqk, dv, batch, seq = 128, 192, 128, 2, 600
    scale = dqk ** -0.5 * 1.3  # a yarn mscale-like factor: the caller's scale, not 1/sqrt(256)
    q, k, v = _mla(batch, heads, heads, seq, seq, dqk, dv, 163, device)
    prefill = attention(q, k, v, scale=scale)
    for i in (0, 31, 32, 63, 64, 255, 256, 511, 512, 513, seq - 1):
        _bits(attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], scale=scale), prefill[:, :, i:i + 1],
              f"decode {i}")
    # The split grid (one program per split, then the combine pass), as a CUDA graph or a long cache runs it.
    split_grid = dataclasses.replace(select_configs("cuda_sm90", kernel_head_dim(dqk, dv)), split_grid_below=2**62,
                                     eager_split_grid_min_keys=0)
    for i in (511, 512, seq - 1):
        _bits(attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], scale=scale, configs=split_grid),
              prefill[:, :, i:i + 1], f"split-grid decode {i}")
    for chunk in (96, 256):
        parts = [attention(q[:, :, s:s + chunk], k[:, :, :s + chunk], v[:, :, :s + chunk], scale=scale)
                 for s in range(0, seq, chunk)]
        _bits(torch.cat(parts, 2), prefill, f"chunk {chunk}")
    _bits(attention(q[1:], k[1:], v[1:], scale=scale), prefill[1:], "batch")
    pad = 37
    left = attention(*(torch.cat([torch.zeros_like(t[:, :, :pad]), t], 2) for t in (q, k, v)),
                     kv_start=_i32([pad, pad], device), scale=scale)
    _bits(left[:, :, pad:], prefill, "left padding")
    o_star, bound = attention_fwd_bound(q[:1, :4], k[:1, :4], v[:1, :4], scale=scale,
                                        block_n=_block_n(device, dqk, dv))
    result = check_bound(prefill[:1, :4], o_star, bound)
    assert result.passed, result
    sub = [t[:1, :4, :256].clone() for t in (q, k, v)]
    do = bf16_randn((1, 4, 256, dv), 167, device)
    leaves = [t.clone().requires_grad_() for t in sub]
    attention(*leaves, scale=scale).backward(do)
    cfg = select_configs("cuda_sm90", kernel_head_dim(dqk, dv))
    bounds = attention_bwd_bound(*sub, do, scale=scale, block_n=cfg.dq.block_n, block_m=cfg.dkdv.block_m)
    for name, leaf in zip(("dq", "dk", "dv"), leaves):
        result = check_bound(leaf.grad, *bounds[name])
        assert result.passed, (name, result)


@pytest.mark.gpu
def test_gpu_deepseek_v3_masked_decode_gives_the_padded_decode_bits(device, monkeypatch):
    """DeepSeek-V3's head dims (qk 192, v 128 on the 256 tiles), 128 heads: the inference forward reads q, k, v in
    place (no padded copy) and gives the bits of the zero-padded copies on the native kernel, in decode steps on
    both grids, captured in a CUDA graph (the split grid, as a captured decode step runs it) and in a prefill."""
    heads, dqk, dv, batch, seq = 128, 192, 128, 2, 1100  # 5 splits of 256 keys
    scale = dqk ** -0.5 * 1.3
    q, k, v = _mla(batch, heads, heads, seq, seq, dqk, dv, 173, device)
    padded_prefill = _padded(q, k, v, scale=scale)
    monkeypatch.setattr(attention_launch, "mixed_head_dims", _no_padded_copy)
    prefill = attention(q, k, v, scale=scale)
    assert prefill.transpose(1, 2).is_contiguous()
    _bits(prefill, padded_prefill, "prefill")
    for path, configs in {"default": None, **_paths(device, dqk, dv)}.items():
        for i in (0, 511, 512, 1023, 1024, seq - 1):
            step = [t[:, :, :i + 1] for t in (k, v)]
            masked = attention(q[:, :, i:i + 1], *step, scale=scale, configs=configs)
            _bits(masked, _padded(q[:, :, i:i + 1], *step, scale=scale, configs=configs), f"{path} decode {i}")
            _bits(masked, padded_prefill[:, :, i:i + 1], f"{path} decode {i} vs prefill")
    # Captured, a small grid runs the split grid (its build compiled by the forced path above, not during capture).
    i = seq - 1
    static = [q[:, :, i:i + 1].clone(), k[:, :, :i + 1].clone(), v[:, :, :i + 1].clone()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention(*static, scale=scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention(*static, scale=scale)
    graph.replay()
    torch.cuda.synchronize()
    _bits(captured, padded_prefill[:, :, i:i + 1], "captured decode")
