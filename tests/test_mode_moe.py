"""mode/moe.py: inside ``batch_invariant_mode`` transformers' Qwen3-MoE block runs its experts on detkit's MoE
layer and its router with a fixed-order top-k sum. The block's output and gradients obey the MoE layer's end-to-end
gate against an FP64 oracle of the block (and are no worse than transformers' own block against the same oracle), a
real Qwen3MoeForCausalLM's log-probs keep their bits alone and in a batch, parameters and state dict are untouched,
the router logits and the load-balancing loss are the ones transformers computes, masked routes stay masked, and what
the layer does not cover is counted or, under strict, raised. CPU under the Triton interpreter (conftest); the
`gpu`-marked tests and everything else with DETKIT_TEST_DEVICE=cuda on an H200."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the optional extra detkit[models]")

import detkit  # noqa: E402
from detkit.toolkit.models import BLOCK_TENSORS, block_grads  # noqa: E402
from detkit.audits.moe import E2E_REL_L2_GATE, GOLD_SLACK  # noqa: E402
from detkit.mode import experts as mode_experts  # noqa: E402
from detkit.mode import moe as mode_moe  # noqa: E402
from detkit.kernels.det_gemm.launch import det_gemm_fwd  # noqa: E402
from detkit.kernels.moe.layer import deinterleave_gate_up, interleave_gate_up, moe_mlp  # noqa: E402
from detkit.toolkit.contract import check_bound, gemm_bound, rel_l2  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe  # noqa: E402

from tests.conftest import assert_bits_equal  # noqa: E402
from tests.mode_moe_helpers import grouped_mm_on_detkit, qwen3_30b_a3b_block  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=128,
            norm_topk_prob=True, max_position_embeddings=256, router_aux_loss_coef=0.01)
# The floor under which a relative error counts as exact (audits/moe.py's precision check uses the same).
REL_FLOOR = 2.0**-12
EXPERTS = "moe experts (transformers)"


@pytest.fixture(autouse=True)
def _fresh_counters():
    detkit.reset_mode_counters()
    yield
    assert not detkit.is_batch_invariant_mode_enabled(), "a test left the mode entered"
    assert not mode_moe.installed() and not mode_experts.installed(), "the MoE routes outlived the mode"


def tiny_model(device, seed=0, **overrides):
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{**TINY, **overrides})
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    return model.eval()


def routed(counters=None) -> dict[str, int]:
    return (counters or detkit.mode_counters()).as_dict()["routed"]


# ---------------------------------------------------------------------------------------------
# The FP64 oracle of transformers' block, for a given routing (each implementation against the oracle of the
# experts it chose: the selection is discrete, and BF16 logits may tie).
# ---------------------------------------------------------------------------------------------
def block_oracle(block, x: torch.Tensor, ids: torch.Tensor, dout: torch.Tensor) -> dict[str, torch.Tensor]:
    """out and the gradients (x, router weight, gate_up_proj, down_proj) in FP64 with the top-k ids fixed."""
    f64 = torch.float64
    leaves = [t.detach().to(f64).requires_grad_(True) for t in
              (x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj)]
    x64, w_gate, gate_up, down = leaves
    h = x64.reshape(-1, x.shape[-1])
    probs = torch.softmax(h @ w_gate.t(), dim=-1)
    top = probs.gather(1, ids)
    if block.gate.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    gu = torch.einsum("th,tkjh->tkj", h, gate_up[ids])  # [T, K, 2I], rows [gate; up]
    g, u = gu.chunk(2, dim=-1)
    y = torch.einsum("tkj,tkhj->tkh", torch.nn.functional.silu(g) * u, down[ids])
    out = (top[..., None] * y).sum(1).reshape(x.shape)
    out.backward(dout.to(f64))
    return dict(zip(BLOCK_TENSORS, (out.detach(), *(t.grad for t in leaves))))


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------
def test_gate_up_becomes_the_layers_interleaved_w1_and_its_gradient_returns_in_transformers_layout(device):
    gate_up = torch.randn(3, 8, 5, device=device).to(torch.bfloat16).requires_grad_(True)  # [E, 2I, H]
    w1 = mode_moe.gate_up_as_w1(gate_up)
    assert w1.shape == (3, 5, 8)
    assert_bits_equal(w1, interleave_gate_up(gate_up.detach(), dim=1).transpose(1, 2), "w1")
    dw1 = torch.randn(3, 5, 8, device=device).to(torch.bfloat16)
    w1.backward(dw1)
    assert_bits_equal(gate_up.grad, deinterleave_gate_up(dw1.transpose(1, 2), dim=1), "gradient in [E, 2I, H]")
    down = torch.randn(3, 5, 4, device=device)
    assert mode_moe.down_as_w2(down).data_ptr() == down.data_ptr()  # a view, no copy
    ids = torch.tensor([[0, 2], [3, 1]], device=device)
    assert mode_moe.route_ids(ids, 3).tolist() == [[0, 2], [-1, 1]]


def test_fixed_order_sum_adds_in_ascending_k(device):
    values = torch.tensor([[1.0, 2.0**-24, 2.0**-24, 2.0**-24]], device=device)
    # ((1 + u) + u) + u rounds to 1 at each step in FP32; any other order that adds the small terms first does not.
    assert mode_moe.fixed_order_sum(values).item() == 1.0
    assert values.flip(1).sum().item() != 1.0


def test_block_output_and_gradients_obey_the_layer_gate_against_an_fp64_oracle(device):
    model = tiny_model(device, seed=1)
    block = model.model.layers[0].mlp
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 13, 64, generator=gen).to(device=device, dtype=torch.bfloat16)
    dout = (torch.randn(2, 13, 64, generator=gen) * 0.5).to(device=device, dtype=torch.bfloat16)
    hf, hf_ids = block_grads(block, x, dout)
    with detkit.batch_invariant_mode(strict=True):
        dk, dk_ids = block_grads(block, x, dout)
    assert routed()[f"{EXPERTS} -> detkit.moe_mlp"] == 1
    hf_oracle = block_oracle(block, x, hf_ids, dout)
    dk_oracle = hf_oracle if torch.equal(hf_ids, dk_ids) else block_oracle(block, x, dk_ids, dout)
    for name in BLOCK_TENSORS:
        got, theirs = rel_l2(dk[name], dk_oracle[name]), rel_l2(hf[name], hf_oracle[name])
        assert got <= E2E_REL_L2_GATE, f"{name}: relative L2 {got:.3g} vs FP64 > gate {E2E_REL_L2_GATE:.3g}"
        assert got <= GOLD_SLACK * theirs + REL_FLOOR, f"{name}: detkit {got:.3g} vs transformers' own {theirs:.3g}"
        assert dk[name].shape == hf[name].shape and dk[name].stride() == hf[name].stride()


def test_a_models_log_probs_keep_their_bits_alone_and_in_a_batch(device):
    """A real Qwen3MoeForCausalLM: a sequence's log-probs alone and at position 1 of a batch of 3, bitwise; every
    MoE block runs on the layer (strict: nothing on torch)."""
    model = tiny_model(device, seed=3)
    gen = torch.Generator().manual_seed(4)
    seqs = torch.randint(0, 128, (3, 9), generator=gen).to(device)

    def logprobs(ids):
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]

    with torch.inference_mode(), detkit.batch_invariant_mode(strict=True):
        alone = logprobs(seqs[1:2])
        batch = logprobs(seqs)
    assert_bits_equal(batch[1:2], alone, "log-probs alone vs in a batch of 3")
    counts = routed()
    assert counts[f"{EXPERTS} -> detkit.moe_mlp"] == 4  # 2 layers x 2 forwards
    assert counts[f"{mode_moe.ROUTER_OP} -> {mode_moe.ROUTER_KERNEL}"] == 4


def test_parameters_and_state_dict_are_untouched(device):
    model = tiny_model(device, seed=5)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = {n: p for n, p in model.named_parameters()}
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(6)).to(device)
    with detkit.batch_invariant_mode():
        model(input_ids=ids, labels=ids).loss.backward()
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert after[key].shape == value.shape and after[key].stride() == value.stride(), key
        assert_bits_equal(after[key], value, key)
    assert {n: p for n, p in model.named_parameters()} == params
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.grad.shape == experts.gate_up_proj.shape  # [E, 2I, H], transformers' layout
    from transformers.integrations.moe import ExpertsInterface

    assert mode_experts.experts_route not in ExpertsInterface._global_mapping.values()  # restored on exit
    assert hf_moe.Qwen3MoeTopKRouter.forward is not mode_moe.router_route


def test_router_logits_and_aux_loss_are_the_ones_transformers_computes(device):
    model = tiny_model(device, seed=7)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(8)).to(device)
    gate_inputs = []
    handle = model.model.layers[0].mlp.gate.register_forward_hook(lambda m, args, out: gate_inputs.append(args[0]))
    try:
        with torch.no_grad():
            default = model(input_ids=ids, output_router_logits=True)
            with detkit.batch_invariant_mode():
                out = model(input_ids=ids, output_router_logits=True, labels=ids)
                plain = model(input_ids=ids, labels=ids)
    finally:
        handle.remove()
    num_experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    # The aux loss is transformers' own function of the recorded logits, added to the loss with its coefficient.
    assert len(out.router_logits) == 2
    with torch.no_grad(), detkit.batch_invariant_mode():  # as the model computed it: its mean runs in the mode
        want = hf_moe.load_balancing_loss_func(out.router_logits, num_experts, top_k)
    assert_bits_equal(out.aux_loss, want, "aux loss")
    assert_bits_equal(out.loss, plain.loss + model.config.router_aux_loss_coef * want, "loss + aux")
    # The recorded logits are the routed linear's: det_gemm of the router's input, within the GEMM bound of FP64.
    h = gate_inputs[1].reshape(-1, 64)
    w_gate = model.model.layers[0].mlp.gate.weight.detach()
    assert_bits_equal(out.router_logits[0], det_gemm_fwd(h, w_gate.t()), "router logits")
    star = h.double() @ w_gate.double().t()
    bound = gemm_bound(star, h.double().abs() @ w_gate.double().abs().t(), 64)
    assert check_bound(out.router_logits[0].double(), star, bound).passed
    # Against default mode: with the same top-k choice, the loss differs only through the logits' rounding: each
    # probability within a factor exp(+-2m) for m = max |logit difference|, and so the loss.
    for a, b in zip(out.router_logits, default.router_logits):
        chosen = [x.float().softmax(-1).topk(top_k).indices.sort(-1).values for x in (a, b)]  # the set: ties may swap
        assert torch.equal(*chosen)
    m = max(float((a.double() - b.double()).abs().max()) for a, b in zip(out.router_logits, default.router_logits))
    assert abs(float(out.aux_loss) / float(default.aux_loss) - 1) <= math.expm1(2 * m) + 1e-6


def test_masked_routes_stay_masked(device):
    """Route ids >= E (transformers' expert-parallel sentinel) contribute nothing: the layer with -1 there."""
    experts = tiny_model(device, seed=9).model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(6, 64, generator=gen).to(device=device, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 8], [1, 2], [8, 8], [3, 4], [8, 5], [7, 6]], device=device)
    weights = torch.rand(6, 2, generator=gen).to(device=device, dtype=torch.bfloat16).masked_fill(ids == 8, 0)
    with torch.no_grad():
        with detkit.batch_invariant_mode(strict=True):
            got = experts(x, ids, weights)
        want = moe_mlp(x, interleave_gate_up(experts.gate_up_proj, dim=1).transpose(1, 2),
                       experts.down_proj.transpose(1, 2), torch.where(ids == 8, -1, ids).to(torch.int32), weights)
    assert_bits_equal(got, want, "sentinel routes masked")
    assert bool((got[2] == 0).all())


def test_what_the_layer_does_not_cover_is_counted_or_raised(device, monkeypatch):
    block = tiny_model(device, seed=11).model.layers[0].mlp
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(12)).to(device=device, dtype=torch.bfloat16)
    block.experts._is_expert_parallel = True
    with torch.no_grad():
        with monkeypatch.context() as patch:
            grouped_mm_on_detkit(patch)
            want = block(x)  # transformers' own implementation, its grouped GEMMs on detkit's grouped kernel
        with detkit.batch_invariant_mode():
            got = block(x)
        assert_bits_equal(got, want, "not routed: transformers' own block")
        reason = "Qwen3MoeExperts._is_expert_parallel = True (supported: False)"
        not_routed = detkit.mode_counters().as_dict()["not_routed"]
        assert not_routed == {f"{EXPERTS}: {reason}": 1}
        # what transformers' experts ran on: the mode's grouped GEMM route (CPU and GPU run transformers' grouped_mm)
        assert {k: v for k, v in routed().items() if k.startswith("_grouped_mm")} == {
            "_grouped_mm -> detkit.grouped_mm": 2}
        with pytest.raises(detkit.ModeNotRoutedError, match="expert_parallel"), \
                detkit.batch_invariant_mode(strict=True):
            block(x)
        block.experts._is_expert_parallel = False
        experts32 = block.experts.float()
        hidden = x.reshape(-1, 64).float()
        ids = torch.tensor([[0, 1]] * 4, device=device)
        weights = torch.full((4, 2), 0.5, device=device)
        with detkit.batch_invariant_mode():
            experts32(hidden, ids, weights)
    assert detkit.mode_counters().as_dict()["not_routed"][f"{EXPERTS}: dtype float32"] == 1


def test_a_block_compiled_before_the_mode_runs_the_routes_inside_it(device):
    """torch.compile: the routes run as graph breaks, so a block compiled outside the mode reaches detkit's layer
    inside it, with the eager routes' bits."""
    block = tiny_model(device, seed=15).model.layers[0].mlp
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(16)).to(device=device, dtype=torch.bfloat16)
    compiled = torch.compile(block)
    with torch.no_grad():
        compiled(x)
        with detkit.batch_invariant_mode(strict=True):
            got = compiled(x)
            want = block(x)
    assert_bits_equal(got, want, "compiled vs eager inside the mode")
    assert routed()[f"{EXPERTS} -> detkit.moe_mlp"] == 2


@pytest.mark.gpu
def test_router_choice_is_batch_invariant_at_qwen3_30b_a3b_widths(device):
    """128 experts, top-8, hidden 2048, BF16 logits (ties are common): a token's ids and scores alone and inside
    4096 tokens, bitwise (softmax and topk are row-wise on CUDA; the normalisation sum has a fixed order)."""
    config = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                            norm_topk_prob=True)
    torch.manual_seed(13)
    with torch.device(device):
        router = hf_moe.Qwen3MoeTopKRouter(config).to(torch.bfloat16)
    torch.nn.init.normal_(router.weight, std=0.02)
    x = torch.randn(4096, 2048, device=device).to(torch.bfloat16)
    with torch.no_grad(), detkit.batch_invariant_mode(strict=True):
        logits, scores, ids = router(x)
        for rows in (slice(0, 1), slice(100, 101), slice(4095, 4096), slice(7, 40)):
            one_logits, one_scores, one_ids = router(x[rows])
            assert_bits_equal(one_logits, logits[rows], f"logits {rows}")
            assert_bits_equal(one_scores, scores[rows], f"scores {rows}")
            assert torch.equal(one_ids, ids[rows]), f"ids {rows}"


@pytest.mark.gpu
def test_block_tokens_and_gradients_repeat_at_qwen3_30b_a3b_widths(device):
    """One Qwen3-30B-A3B-width block (BF16): a token's output alone vs in 2048 tokens bitwise, and the backward
    (dx and every weight gradient) bitwise across two runs."""
    block = qwen3_30b_a3b_block(device, seed=14)
    x = torch.randn(1, 2048, 2048, device=device).to(torch.bfloat16)
    dout = torch.randn_like(x)
    with detkit.batch_invariant_mode(strict=True):
        with torch.no_grad():
            full = block(x)
            for t in (0, 777, 2047):
                assert_bits_equal(block(x[:, t:t + 1]), full[:, t:t + 1], f"token {t}")
        runs = [block_grads(block, x, dout)[0] for _ in range(2)]
    for name in runs[0]:
        assert_bits_equal(runs[1][name], runs[0][name], name)
