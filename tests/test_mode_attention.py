"""mode/attention.py: inside ``batch_invariant_mode`` F.scaled_dot_product_attention and transformers'
"sdpa" attention reach ``detkit.kernels.attention`` (its interface: ATTENTION_API) when it covers the call, are
counted with the reason (or raise under strict) when it does not or while the module is absent, and everything
is restored on exit; "detkit" is a transformers attention implementation.

The wiring is tested with a stand-in module that implements the interface with plain torch SDPA (installed in
sys.modules by the tests only). The tests at the end use the real kernel and run once it is in the tree."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

import detkit
from detkit.mode import attention as mode_attention
from detkit.toolkit.contract import compare_bits
from detkit.toolkit.fixtures import bf16_randn

TORCH_SDPA = torch._C._nn.scaled_dot_product_attention


def _plain_attention(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """Plain torch SDPA after repeating KV heads (what the stand-in computes)."""
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    return TORCH_SDPA(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def standin_module(calls: list, hf_error: str | None = None) -> types.ModuleType:
    module = types.ModuleType(mode_attention.ATTENTION_MODULE)

    def sdpa_unsupported_reason(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                enable_gqa=False):
        if query.dtype != torch.bfloat16:
            return f"dtype {query.dtype}"
        if dropout_p:
            return f"dropout_p {dropout_p}"
        if attn_mask is None and not is_causal and query.shape[-2] > 1:
            return "not causal"
        return None

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append(("sdpa", tuple(query.shape)))
        return _plain_attention(query, key, value, attn_mask, is_causal, scale)

    def sdpa_accepted(query, key, value, attn_mask=None, scale=None):
        # An accepted call without a mask is causal over q_len == kv_len keys, or one decode query over all of them.
        return sdpa(query, key, value, attn_mask, is_causal=attn_mask is None and query.shape[-2] > 1, scale=scale)

    def hf_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        calls.append(("hf", tuple(query.shape), None if attention_mask is None else tuple(attention_mask.shape)))
        if hf_error is not None:
            raise NotImplementedError(hf_error)
        causal = attention_mask is None and query.shape[2] > 1
        out = _plain_attention(query, key, value, attention_mask, causal, scaling)
        return out.transpose(1, 2).contiguous(), None

    module.HEAD_DIMS = (64, 128, 256)
    module.sdpa_unsupported_reason = sdpa_unsupported_reason
    module.sdpa = sdpa
    module.sdpa_accepted = sdpa_accepted
    module.hf_attention_forward = hf_attention_forward
    return module


@pytest.fixture
def calls():
    return []


@pytest.fixture
def standin(monkeypatch, calls):
    monkeypatch.setitem(sys.modules, mode_attention.ATTENTION_MODULE, standin_module(calls))
    return calls


@pytest.fixture(autouse=True)
def _fresh():
    detkit.reset_mode_counters()
    yield
    assert not detkit.is_batch_invariant_mode_enabled()
    assert F.scaled_dot_product_attention is mode_attention._ORIGINAL_SDPA


def qkv(device, sq=6, skv=6, dtype=torch.bfloat16):
    return (bf16_randn((2, 4, sq, 64), 1, device).to(dtype), bf16_randn((2, 2, skv, 64), 2, device).to(dtype),
            bf16_randn((2, 2, skv, 64), 3, device).to(dtype))


def counts():
    return detkit.mode_counters().as_dict()


def test_supported_sdpa_calls_run_the_kernel(device, standin):
    q, k, v = qkv(device)
    with detkit.batch_invariant_mode():
        assert F.scaled_dot_product_attention is mode_attention.sdpa_route
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert standin == [("sdpa", (2, 4, 6, 64))]
    assert compare_bits(out, _plain_attention(q, k, v, is_causal=True)).equal
    assert counts() == {"routed": {"sdpa -> detkit.attention": 1}, "not_routed": {}}


def test_a_value_head_dim_other_than_the_querys_is_counted_as_the_padded_kernel(device, standin):
    """MLA's calls (value head dim 32 with query/key 64) are counted under their own kernel name, through the sdpa
    route and transformers' route alike, as is a call with one head dim between the kernel's (32, as Phi-3-mini's
    96); a call with one of the kernel's head dims keeps the plain name."""
    q, k, v = qkv(device)
    v = v[..., :32]
    padded = "detkit.attention (qk head dim 64, v 32: zero-padded)"

    class Attn(torch.nn.Module):
        is_causal = True

    with detkit.batch_invariant_mode():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        mode_attention.transformers_sdpa_route(Attn(), q, k, v, None)
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        narrow = F.scaled_dot_product_attention(q[..., :32], k[..., :32], v, is_causal=True, enable_gqa=True)
    assert compare_bits(out, _plain_attention(q, k, v, is_causal=True)).equal
    assert compare_bits(narrow, _plain_attention(q[..., :32], k[..., :32], v, is_causal=True)).equal
    # (the stand-in's torch SDPA runs its math backend for Dv != D on the CPU: its bmm calls are counted too)
    attention = {key: n for key, n in counts()["routed"].items() if "attention" in key}
    assert attention == {f"sdpa -> {padded}": 1, f"attention (transformers) -> {padded}": 1,
                         "sdpa -> detkit.attention": 1, "sdpa -> detkit.attention (head dim 32: zero-padded)": 1}
    assert counts()["not_routed"] == {}


def test_unsupported_sdpa_calls_run_on_torch_counted_or_raise_under_strict(device, standin):
    q, k, v = qkv(device, dtype=torch.float32)
    with detkit.batch_invariant_mode():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert standin == []
    assert compare_bits(out, TORCH_SDPA(q, k, v, is_causal=True, enable_gqa=True)).equal
    not_routed = counts()["not_routed"]
    assert not_routed.pop("sdpa: dtype torch.float32") == 1
    # torch's fallback may itself run GEMMs (its math backend on CUDA): counted as what they are, FP32.
    assert all(key.endswith("dtype float32") for key in not_routed), not_routed
    with pytest.raises(detkit.ModeNotRoutedError, match="dtype torch.float32"), \
            detkit.batch_invariant_mode(strict=True):
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_a_mask_broadcast_over_queries_is_not_routed(device, standin):
    """transformers' packed-GQA decode call: the query heads in the query-length dim, one mask row for all."""
    q, k, v = qkv(device, sq=2, skv=6)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool, device=device)
    with detkit.batch_invariant_mode():
        F.scaled_dot_product_attention(q[:, :2], k, v, attn_mask=mask)
    assert standin == []
    (reason,) = counts()["not_routed"]
    assert reason.startswith("sdpa: attn_mask has 1 row(s) for 2 queries")


def test_without_the_attention_module_every_call_is_counted(device, monkeypatch):
    monkeypatch.setitem(sys.modules, mode_attention.ATTENTION_MODULE, None)
    q, k, v = qkv(device)
    with detkit.batch_invariant_mode():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert compare_bits(out, TORCH_SDPA(q, k, v, is_causal=True, enable_gqa=True)).equal
    assert counts()["not_routed"] == {f"sdpa: {mode_attention.NO_KERNEL}": 1}


def test_outside_the_mode_sdpa_is_torch_and_uncounted(device, standin):
    q, k, v = qkv(device)
    with detkit.batch_invariant_mode():
        pass
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert standin == [] and counts() == {"routed": {}, "not_routed": {}}


# ---------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers", reason="transformers is the optional extra detkit[models]")


def tiny_model(device, attn="sdpa"):
    from detkit.toolkit.models import QWEN3_TINY

    config = transformers.Qwen3Config(**dict(QWEN3_TINY, num_hidden_layers=1))
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                             attn_implementation=attn).eval()


def prefill_and_decode(model, ids, mask=None):
    from detkit.toolkit.models import cache_kwarg

    cache = transformers.DynamicCache(config=model.config)
    kw = {cache_kwarg(model): cache, "use_cache": True}
    with torch.inference_mode():
        first = model(input_ids=ids, attention_mask=mask, **kw).logits
        step_mask = None if mask is None else torch.cat([mask, mask.new_ones(len(ids), 1)], 1)
        second = model(input_ids=ids[:, -1:], attention_mask=step_mask, **kw).logits
    return first, second


def test_a_transformers_model_uses_the_kernel_for_prefill_and_decode(device, standin):
    from transformers.modeling_utils import AttentionInterface

    model = tiny_model(device)
    ids = torch.randint(3, 256, (2, 5), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: the decode step gets a 4-D mask (transformers' packed-GQA case for SDPA)
    original = AttentionInterface._global_mapping["sdpa"]
    with detkit.batch_invariant_mode():
        prefill_and_decode(model, ids, mask)
    assert AttentionInterface._global_mapping["sdpa"] is original
    # query [B, Hq, Sq, D] as transformers hands it to its attention function: never packed.
    assert [c[:2] for c in standin] == [("hf", (2, 4, 5, 64)), ("hf", (2, 4, 1, 64))]
    assert standin[1][2] == (2, 1, 1, 6)
    assert counts()["routed"]["attention (transformers) -> detkit.attention"] == 2
    assert counts()["not_routed"] == {}


def test_what_the_kernel_refuses_falls_back_counted_once(device, monkeypatch, calls):
    monkeypatch.setitem(sys.modules, mode_attention.ATTENTION_MODULE, standin_module(calls, "softcap is not covered"))
    model = tiny_model(device)
    ids = torch.randint(3, 256, (1, 4), generator=torch.Generator().manual_seed(1)).to(device)
    with detkit.batch_invariant_mode(), torch.inference_mode():
        model(input_ids=ids, use_cache=False)
    assert counts()["not_routed"] == {"attention (transformers): softcap is not covered": 1}
    with pytest.raises(detkit.ModeNotRoutedError, match="softcap"), detkit.batch_invariant_mode(strict=True), \
            torch.inference_mode():
        model(input_ids=ids, use_cache=False)


def test_attn_implementation_detkit_runs_the_kernel_and_never_torch(device, monkeypatch, calls):
    mode_attention.register_transformers_attention()
    model = tiny_model(device, attn="detkit")
    ids = torch.randint(3, 256, (1, 4), generator=torch.Generator().manual_seed(2)).to(device)
    monkeypatch.setitem(sys.modules, mode_attention.ATTENTION_MODULE, standin_module(calls))
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False)
    assert calls == [("hf", (1, 4, 4, 64), None)]
    monkeypatch.setitem(sys.modules, mode_attention.ATTENTION_MODULE, None)
    with pytest.raises(NotImplementedError, match="no detkit attention kernel"), torch.inference_mode():
        model(input_ids=ids, use_cache=False)


# ---------------------------------------------------------------------------------------------
# The real kernel: these run once detkit.kernels.attention is in the tree.
# ---------------------------------------------------------------------------------------------
def _real_attention():
    module = mode_attention.attention_module()
    if module is None:
        pytest.skip("detkit.kernels.attention is not in this tree yet (the audit reports decode_vs_trainer FAILED)")
    return module


def test_real_kernel_decode_equals_trainer_bitwise(device):
    _real_attention()
    from detkit.audits.model import CPU_PLAN, Audit

    model = tiny_model(device)
    audit = Audit(model, device, CPU_PLAN, seed=1234)
    with detkit.batch_invariant_mode(strict=True):
        results = audit.decode_vs_trainer(locate=False)
    for cmp in results:
        assert cmp.equal, cmp.details()
    assert counts()["routed"]["attention (transformers) -> detkit.attention"] > 0


def test_real_kernel_sdpa_route_is_batch_invariant(device):
    _real_attention()
    q, k, v = qkv(device, sq=7, skv=7)
    with detkit.batch_invariant_mode(strict=True):
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        one = F.scaled_dot_product_attention(q[1:], k[1:], v[1:], is_causal=True, enable_gqa=True)
    assert compare_bits(one, full[1:]).equal
