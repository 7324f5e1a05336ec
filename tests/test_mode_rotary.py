"""The fused rotary embedding (kernels/rotary/rope.py) and the mode's rotary route (mode/rotary.py): the kernel gives
the bits and output strides of transformers' ``apply_rotary_pos_emb`` for BF16 and FP32, transposed q/k, cos shared
or per sequence (so the route is speed only); refusals name the operand; the mode swaps the matching modules'
function only while entered, uses the kernel only where no gradient is needed, and a model's logits are the same bits
either way. On the CPU (interpreter) and, DETKIT_TEST_DEVICE=cuda, on the GPU."""

from __future__ import annotations

import pytest
import torch

import detkit
from detkit.kernels.rotary import apply_rotary_pos_emb_ref, output_strides, rope_launcher, rope_reason
from detkit.mode import rotary as mode_rotary
from tests.conftest import assert_bits_equal

CASES = [  # (batch, q heads, k heads, positions, head dim, cos batch)
    (2, 4, 2, 5, 16, 2),
    (1, 8, 2, 1, 128, 1),  # a decode step at Qwen3's head dim
    (3, 2, 2, 7, 64, 3),
    (2, 4, 4, 3, 24, 1),  # a half that is not a power of two
]


def operands(case, dtype, device, seed=0):
    b, hq, hk, s, d, cb = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=g).to(dtype).transpose(1, 2)  # transformers' view of the projection
    k = torch.randn(b, s, hk, d, generator=g).to(dtype).transpose(1, 2)
    positions = (torch.arange(s)[None] + torch.arange(cb)[:, None] * 3).float()
    angles = positions[..., None] * torch.rand(d // 2, generator=g)
    emb = torch.cat((angles, angles), -1)
    return [t.to(device) for t in (q, k, emb.cos().to(dtype), emb.sin().to(dtype))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rope_has_the_bits_and_strides_of_transformers_function(device, dtype):
    for i, case in enumerate(CASES):
        q, k, cos, sin = operands(case, dtype, device, seed=i)
        assert rope_reason(q, k, cos, sin) is None
        got = rope_launcher(q, k, cos, sin, output_strides(q, k, cos, apply_rotary_pos_emb_ref))(q, k, cos, sin)
        want = apply_rotary_pos_emb_ref(q, k, cos, sin)
        for g, w, name in zip(got, want, ("q", "k")):
            assert_bits_equal(g, w, f"{name} {case} {dtype}")
            assert g.stride() == w.stride(), f"{name} {case}: strides {g.stride()} vs {w.stride()}"
        ref = apply_rotary_pos_emb_ref(*(t.double() for t in (q, k, cos, sin)))
        for g, r in zip(got, ref):
            assert torch.allclose(g.double(), r, rtol=2 ** -6, atol=2 ** -6), f"{case}: far from FP64"


def test_fused_rope_refuses_by_name(device):
    q, k, cos, sin = operands(CASES[0], torch.bfloat16, device)
    assert "dtypes" in rope_reason(q, k, cos.float(), sin)
    assert "shapes" in rope_reason(q[..., :15], k[..., :15], cos[..., :15], sin[..., :15])  # odd head dim
    assert "shapes" in rope_reason(q, k[:1], cos, sin)
    assert "not contiguous" in rope_reason(q, k, cos.transpose(1, 2).contiguous().transpose(1, 2), sin)
    with pytest.raises(ValueError, match=r"rope does not take dtypes"):
        rope_launcher(q, k, cos.float(), sin, ((), ()))


def test_the_route_matches_transformers_llama_function_only():
    pytest.importorskip("transformers")
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3 import modeling_qwen3

    for module in (modeling_llama, modeling_qwen3, modeling_gemma3):
        assert mode_rotary.matches(module.apply_rotary_pos_emb), module.__name__

    def other(q, k, cos, sin, unsqueeze_dim=1):  # same names, the halves the other way round
        return (q * cos) - (rotate_half(q) * sin), (k * cos) - (rotate_half(k) * sin)
    rotate_half = modeling_llama.rotate_half
    assert not mode_rotary.matches(other)


def test_the_mode_runs_rope_fused_without_grad_with_the_same_logits(device):
    pytest.importorskip("transformers")
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3 import modeling_qwen3

    own = modeling_qwen3.apply_rotary_pos_emb
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=96)
    model = Qwen3ForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(1)).to(device)
    with detkit.batch_invariant_mode():
        assert modeling_qwen3 in mode_rotary.installed_modules()
        detkit.reset_mode_counters()
        with torch.no_grad():
            rollout = model(ids).logits
        fused_counts = detkit.mode_counters().as_dict()["routed"]
        detkit.reset_mode_counters()
        trainer = model(ids).logits
        own_counts = detkit.mode_counters().as_dict()["routed"]
        with torch.no_grad(), mode_rotary.suspended():
            suspended = model(ids).logits
    assert fused_counts["rotary (transformers) -> fused_rope"] == 2
    assert "rotary (transformers) -> fused_rope" not in own_counts
    assert_bits_equal(rollout, trainer.detach(), "logits, fused rope vs transformers' function")
    assert_bits_equal(suspended, rollout, "logits, route suspended")
    assert modeling_qwen3.apply_rotary_pos_emb is own, "the module's function is restored on exit"
