"""transformers models with sliding windows (Mistral, Gemma-3), softcapping (Gemma-2) and sinks (gpt-oss) under
detkit mode and with attn_implementation="detkit": the rollout (left-padded prefill + token-by-token decode with
transformers' cache, whose sliding-window layers drop keys) gives the trainer's logits bit for bit (one forward over
each sequence alone, unpadded), every attention call on the kernel. Tiny random configs on the CPU interpreter (the kernels' 16-key tiles; a window of 4 or 6 keys, so the
decode steps run past it)."""

from __future__ import annotations

import pytest
import torch

import detkit
from detkit.audits.model import positions_from_mask
from detkit.toolkit.models import cache_kwarg
from detkit.mode import attention as mode_attention
from detkit.toolkit.contract import compare_bits

transformers = pytest.importorskip("transformers", reason="transformers is the optional extra detkit[models]")

TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            vocab_size=256, max_position_embeddings=512)


def _mistral(device, attn, window=4, layers=1):
    config = transformers.MistralConfig(**TINY, num_hidden_layers=layers, sliding_window=window)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                             attn_implementation=attn).eval()


def _rollout_vs_trainer(model, device, width=9, gen=5, pads=(0, 3)):
    """Teacher-forced: sequence b has width - pads[b] prompt tokens (left-padded to ``width``) and ``gen`` more.
    The rollout's logits (prefill, then one token per step with the cache) against one forward over each unpadded
    sequence alone, at the same tokens: [B, gen, V] each."""
    seqs = torch.randint(3, 256, (len(pads), width + gen), generator=torch.Generator().manual_seed(7)).to(device)
    ids = torch.zeros(len(pads), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for b, pad in enumerate(pads):
        ids[b, pad:] = seqs[b, :width - pad]
        mask[b, pad:] = 1
    cache = transformers.DynamicCache(config=model.config)
    kw = {cache_kwarg(model): cache, "use_cache": True}
    with torch.inference_mode():
        steps = [model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask), **kw).logits[:, -1]]
        for t in range(gen - 1):
            nxt = torch.stack([seqs[b, width - pad + t] for b, pad in enumerate(pads)])[:, None]
            mask = torch.cat([mask, mask.new_ones(len(pads), 1)], 1)
            steps.append(model(input_ids=nxt, attention_mask=mask, position_ids=positions_from_mask(mask)[:, -1:],
                               **kw).logits[:, -1])
        trainer = [model(input_ids=seqs[b:b + 1, :width - pad + gen - 1], use_cache=False).logits[0, width - pad - 1:]
                   for b, pad in enumerate(pads)]
    return torch.stack(steps, 1), torch.stack(trainer)


def _gemma3(device, attn):
    config = transformers.Gemma3TextConfig(**TINY, num_hidden_layers=2, sliding_window=4, query_pre_attn_scalar=64,
                                           layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                             attn_implementation=attn).eval()


@pytest.mark.parametrize("model_name,attn", [("mistral", "sdpa"), ("mistral", "detkit"), ("gemma3", "sdpa")])
def test_sliding_window_rollout_equals_trainer_bitwise_every_call_routed(model_name, attn, device):
    """Mistral (every layer sliding) and Gemma-3 (sliding and global layers mixed) through transformers' "sdpa"
    under the mode (their calls were refused before: "sliding_window is not supported"), and Mistral on "detkit"."""
    if attn == "detkit":
        mode_attention.register_transformers_attention()
    model = _mistral(device, attn) if model_name == "mistral" else _gemma3(device, attn)
    detkit.reset_mode_counters()
    # Gemma-3's norms take a mean the mode does not route yet (counted): strict only where everything is routed.
    with detkit.batch_invariant_mode(strict=model_name == "mistral"):
        rollout, trainer = _rollout_vs_trainer(model, device)
    result = compare_bits(rollout, trainer)
    assert result.equal, result
    counters = detkit.mode_counters().as_dict()
    assert counters["routed"]["attention (transformers) -> detkit.attention"] > 0
    assert not [key for key in counters["not_routed"] if key.startswith(("attention", "sdpa"))], counters


def _gemma2(device):
    config = transformers.Gemma2Config(**TINY, num_hidden_layers=2, sliding_window=4, attn_logit_softcapping=5.0,
                                       query_pre_attn_scalar=64)
    assert config.layer_types == ["sliding_attention", "full_attention"]  # local and global layers mixed
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                             attn_implementation="detkit").eval()


def test_detkit_attention_implementation_for_models_without_sdpa(device):
    """Gemma-2 (softcap, sliding and global layers) does not support transformers' sdpa: it runs on
    attn_implementation="detkit", every attention call on the kernel, and the rollout gives the trainer's logits bit
    for bit. (gpt-oss, the other such model, runs every check of the family matrix in tests/test_model_families.py;
    its sinks against its own eager attention are the next test's.)"""
    mode_attention.register_transformers_attention()
    model = _gemma2(device)
    detkit.reset_mode_counters()
    with detkit.batch_invariant_mode():
        rollout, trainer = _rollout_vs_trainer(model, device)
    counters = detkit.mode_counters().as_dict()
    assert counters["routed"]["attention (transformers) -> detkit.attention"] > 0
    assert not [key for key in counters["not_routed"] if key.startswith(("attention", "sdpa"))], counters
    result = compare_bits(rollout, trainer)
    assert result.equal, (result, counters["not_routed"])


def test_detkit_attention_matches_the_models_own_eager_attention(device):
    """The kernel computes what Gemma-2's and gpt-oss's own eager attention functions compute (softcap; sinks; a
    sliding-window + padding mask), on the valid rows within BF16 noise; without the cap or the sinks it would not
    (the tolerance tells them apart): a semantic check against transformers' code, not only our reference."""
    from detkit.kernels.attention import hf_attention_forward
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.gpt_oss import modeling_gpt_oss

    from tests.test_attention_variants import _qkv, _sliding_mask

    class Module(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2
        training = False

    module = Module()
    module.sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=device).to(torch.bfloat16)
    q, k, v = _qkv(2, 4, 2, 20, 20, 64, 5, device, q_scale=4.0)
    padding = torch.ones(2, 20, dtype=torch.bool, device=device)
    padding[1, :3] = False
    mask = _sliding_mask(padding, 20, 20, 0, 6)
    additive = torch.zeros(mask.shape, dtype=torch.bfloat16, device=device).masked_fill(~mask, -torch.inf)
    cases = {
        "gemma2 softcap": (modeling_gemma2.eager_attention_forward, {"softcap": 2.0}, {"softcap": 2.0}),
        "gpt-oss sinks": (modeling_gpt_oss.eager_attention_forward, {}, {"s_aux": module.sinks}),
    }
    for name, (eager, eager_kw, ours_kw) in cases.items():
        theirs, _ = eager(module, q.float(), k.float(), v.float(), additive.float(), scaling=0.125, **eager_kw)
        ours, _ = hf_attention_forward(module, q, k, v, mask, scaling=0.125, sliding_window=6, **ours_kw)
        plain, _ = hf_attention_forward(module, q, k, v, mask, scaling=0.125, sliding_window=6)
        for rows in ((0, slice(None)), (1, slice(3, None))):
            assert (ours[rows].float() - theirs[rows]).abs().max() <= 2 ** -6, name
            assert (plain[rows].float() - theirs[rows]).abs().max() > 2 ** -4, name
