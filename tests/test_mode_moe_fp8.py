"""mode/moe.py with ``batch_invariant_mode(moe_experts="fp8")``: where FP8 is slower (kernels/moe/fp8/choice.py:
the tiny shapes here, Qwen3-30B-A3B widths) the BF16 layer runs, with its bits, counted as such, the same layer at
every T, and "detkit_fp8" chooses alike; with ``fp8_shapes="all"`` transformers' Qwen3-MoE experts run on detkit's FP8
layer (``moe_mlp_fp8``), bit for bit what a direct call on the converted weights gives, forward and backward,
gradients in transformers' layout; a model's log-probs keep their bits alone and in a batch; the mode's FP8 weight
cache is keyed on the parameters and invalidated by an in-place update; a bad ``moe_experts`` or ``fp8_shapes`` is
refused before the mode is entered, and a block the FP8 layer does not cover is counted (transformers' own experts)
or raised, never run on the BF16 layer. CPU under the Triton interpreter (conftest); the `gpu`-marked tests with
DETKIT_TEST_DEVICE=cuda on an H200."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the optional extra detkit[models]")

import detkit  # noqa: E402
from detkit.mode import experts as mode_experts  # noqa: E402
from detkit.mode import moe as mode_moe
from detkit.mode import state as mode_state  # noqa: E402
from detkit.kernels.moe.layer import deinterleave_gate_up, interleave_gate_up  # noqa: E402
from detkit.kernels.moe.fp8.layer import moe_mlp_fp8  # noqa: E402
from detkit.toolkit.contract import compare_bits, cosine, rel_l2  # noqa: E402
from detkit.toolkit.moe_gate import GATE_MAX_REL_RMSE, GATE_MIN_COSINE  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from tests.conftest import assert_bits_equal  # noqa: E402
from tests.mode_moe_helpers import grouped_mm_on_detkit, qwen3_30b_a3b_block  # noqa: E402

# The smallest config the FP8 layer takes: H and I multiples of 128.
TINY_128 = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_experts=4,
                num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                vocab_size=128, norm_topk_prob=True, max_position_embeddings=256, router_aux_loss_coef=0.01)
EXPERTS = mode_moe.EXPERTS_OP
FP8_ROUTE = f"{EXPERTS} -> {mode_moe.EXPERTS_KERNEL_FP8}"
BF16_ROUTE = f"{EXPERTS} -> {mode_moe.EXPERTS_KERNEL}"


@pytest.fixture(autouse=True)
def _fresh_state():
    detkit.reset_mode_counters()
    cache = mode_moe.fp8_weight_cache()
    cache.clear()
    cache.hits = cache.misses = 0
    yield
    assert not detkit.is_batch_invariant_mode_enabled(), "a test left the mode entered"
    assert not mode_moe.installed() and not mode_experts.installed(), "the MoE routes outlived the mode"
    assert mode_state.STATE.experts_stack == [] and mode_state.STATE.graph_weights_stack == []
    assert mode_state.STATE.shapes_stack == []


def tiny_model(device, seed=0, **overrides):
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_128, **overrides})).to(torch.bfloat16)
    return model.eval()


def routed() -> dict[str, int]:
    return detkit.mode_counters().as_dict()["routed"]


def routing_inputs(device, t=10, seed=1, hidden=128, sentinel=True):
    """x [t, H], ids [t, 2] over 4 experts (with ``sentinel``, one route on transformers' expert-parallel sentinel
    id E = 4), weights [t, 2]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(t)])
    if sentinel:
        ids[3, 1] = 4
    weights = torch.rand(t, 2, generator=gen).to(device=device, dtype=torch.bfloat16)
    return x, ids.to(device), weights


# The kernel counted for an FP8 request the choice gives to the BF16 layer at TINY_128's experts (H = I = 128, E = 4,
# K = 2): K/E = 2/4 meets the measured 4/8, the two size bounds of kernels/moe/fp8/choice.py fall short.
AS_BF16 = ("detkit.moe_mlp (fp8 -> bf16, FP8 slower at H=128, I=128, E=4, K=2: H*I 128*128 < 3072*1536, "
           "K*H*I 2*128*128 < 4*3072*1536 (FP8 is faster at every T >= 2048 from H=3072, I=1536, E=8, K=4))")
AS_BF16_ROUTE = f"{EXPERTS} -> {AS_BF16}"


def direct_fp8(experts, x, ids, weights):
    """moe_mlp_fp8 on transformers' weights converted by hand (fresh quantization), with leaves for the gradients:
    (out, w1 leaf [E, H, 2I], w2 leaf [E, I, H]; leaves that require grad while grad is enabled)."""
    grad = torch.is_grad_enabled()
    w1 = interleave_gate_up(experts.gate_up_proj.detach(), dim=1).transpose(1, 2).requires_grad_(grad)
    w2 = experts.down_proj.detach().transpose(1, 2).requires_grad_(grad)
    layer_ids = torch.where(ids >= experts.num_experts, -1, ids).to(torch.int32)
    return moe_mlp_fp8(x, w1, w2, layer_ids, weights, weight_cache=None), w1, w2


# ---------------------------------------------------------------------------------------------
# Choosing the precision
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arg, bad, exc, supported", [
    ("moe_experts", "fp16", ValueError, "'bf16', 'fp8'"), ("moe_experts", "FP8", ValueError, "'bf16', 'fp8'"),
    ("moe_experts", "", ValueError, "'bf16', 'fp8'"), ("moe_experts", 8, TypeError, None),
    ("fp8_graph_weights", "cached", ValueError, "'quantize', 'static'"),
    ("fp8_graph_weights", "Static", ValueError, "'quantize', 'static'"), ("fp8_graph_weights", 1, TypeError, None),
    ("fp8_shapes", "measured", ValueError, "'faster', 'all'"), ("fp8_shapes", "ALL", ValueError, "'faster', 'all'"),
    ("fp8_shapes", True, TypeError, None),
])
def test_an_unsupported_mode_choice_is_refused_before_the_mode_is_entered(arg, bad, exc, supported):
    with pytest.raises(exc, match=arg) as info:
        detkit.batch_invariant_mode(**{arg: bad})
    assert "\n" not in str(info.value)
    if exc is ValueError:
        assert str(info.value) == f"{arg} {bad!r} is not supported; supported: {supported} (None: the enclosing entry's)"
    with pytest.raises(exc, match=arg):
        detkit.enable_batch_invariant_mode(**{arg: bad})
    assert not detkit.is_batch_invariant_mode_enabled() and not mode_moe.installed() and not mode_experts.installed()
    assert mode_state.STATE.strict_stack == [] and mode_state.STATE.experts_stack == []
    assert mode_state.STATE.graph_weights_stack == [] and mode_state.STATE.shapes_stack == []


def test_the_innermost_explicit_choice_holds_and_none_keeps_the_enclosing_one(device):
    experts = tiny_model(device, seed=2).model.layers[0].mlp.experts
    x, ids, weights = routing_inputs(device, t=4, seed=3)

    def kernels_of(**kw):
        before = detkit.mode_counters()
        with detkit.batch_invariant_mode(**kw):
            experts(x, ids, weights)
        return {k[1] for k in (detkit.mode_counters() - before).routed if k[0] == EXPERTS}

    as_bf16 = {AS_BF16}  # the tiny shape: FP8 is slower, the BF16 layer runs
    with torch.no_grad():
        assert kernels_of() == {mode_moe.EXPERTS_KERNEL}  # the default: BF16
        with detkit.batch_invariant_mode(moe_experts="fp8", fp8_shapes="all"):
            assert kernels_of() == {mode_moe.EXPERTS_KERNEL_FP8}  # None: the enclosing entry's
            assert kernels_of(moe_experts="bf16") == {mode_moe.EXPERTS_KERNEL}
            assert kernels_of(strict=True) == {mode_moe.EXPERTS_KERNEL_FP8}  # back to FP8 after the inner exit
            assert kernels_of(fp8_shapes="faster") == as_bf16
            assert kernels_of() == {mode_moe.EXPERTS_KERNEL_FP8}
        with detkit.batch_invariant_mode(moe_experts="fp8"):
            assert kernels_of() == as_bf16  # fp8_shapes: "faster" by default
            assert kernels_of(fp8_shapes="all") == {mode_moe.EXPERTS_KERNEL_FP8}


# ---------------------------------------------------------------------------------------------
# FP8 where it pays: the BF16 layer at a shape where FP8 is slower (kernels/moe/fp8/choice.py)
# ---------------------------------------------------------------------------------------------
def test_where_fp8_is_slower_the_bf16_layer_runs_with_its_bits_forward_and_backward(device):
    """moe_experts="fp8" at TINY_128's shape, which the choice gives to BF16: the output and every gradient are
    bitwise those of moe_experts="bf16", the call is counted under the name that says so, nothing is quantized."""
    experts = tiny_model(device, seed=40).model.layers[0].mlp.experts
    x, ids, weights = routing_inputs(device, t=12, seed=41)
    dout = (torch.randn(12, 128, generator=torch.Generator().manual_seed(42)) * 0.5).to(device=device,
                                                                                        dtype=torch.bfloat16)

    def run(**kw):
        xg, sg = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        experts.zero_grad(set_to_none=True)
        with detkit.batch_invariant_mode(strict=True, **kw):
            out = experts(xg, ids, sg)
            out.backward(dout)
        return {"out": out.detach(), "dx": xg.grad, "d routing weights": sg.grad,
                "d gate_up_proj": experts.gate_up_proj.grad, "d down_proj": experts.down_proj.grad}

    got = run(moe_experts="fp8")
    assert routed() == {AS_BF16_ROUTE: 1}
    want = run(moe_experts="bf16")
    assert routed() == {AS_BF16_ROUTE: 1, BF16_ROUTE: 1}
    for name, tensor in got.items():
        assert_bits_equal(tensor, want[name], f"fp8 request given to BF16 vs the BF16 layer: {name}")
    assert mode_moe.fp8_weight_cache().misses == 0  # the FP8 layer never ran


def test_the_choice_reads_no_t(device):
    """One shape, one layer: T = 1 and 7 through the route, and the choice the route asks for at T = 1, 7 and 4096
    (views of one token: nothing of size T is made), all the same."""
    experts = tiny_model(device, seed=43).model.layers[0].mlp.experts
    with torch.no_grad(), detkit.batch_invariant_mode(strict=True, moe_experts="fp8"):
        for t in (1, 7):
            experts(*routing_inputs(device, t=t, seed=44, sentinel=False))
    assert routed() == {AS_BF16_ROUTE: 2}
    x, ids, _ = routing_inputs(device, t=1, seed=45, sentinel=False)
    choices = {mode_moe.fp8_choice(experts, x.expand(t, -1), ids.expand(t, -1)) for t in (1, 7, 4096)}
    assert len(choices) == 1 and choices.pop().layer == "bf16"


def test_detkit_fp8_experts_choose_alike_and_the_mode_can_force_fp8(device):
    """experts_implementation="detkit_fp8" outside the mode: the same choice (the BF16 layer's bits, counted so);
    inside an entry with fp8_shapes="all", the FP8 layer (a direct moe_mlp_fp8 call's bits)."""
    mode_experts.register_transformers_experts()
    experts = tiny_model(device, seed=46).model.layers[0].mlp.experts
    x, ids, weights = routing_inputs(device, seed=47)
    with torch.no_grad():
        with detkit.batch_invariant_mode(strict=True):
            want = experts(x, ids, weights)
        experts.config._experts_implementation = "detkit_fp8"
        got = experts(x, ids, weights)
        with detkit.batch_invariant_mode(fp8_shapes="all"):
            forced = experts(x, ids, weights)
        assert_bits_equal(forced, direct_fp8(experts, x, ids, weights)[0], "detkit_fp8 with fp8_shapes='all'")
    assert_bits_equal(got, want, "detkit_fp8 given to BF16 vs the mode's BF16 layer")
    assert routed() == {BF16_ROUTE: 1, AS_BF16_ROUTE: 1, FP8_ROUTE: 1}


# ---------------------------------------------------------------------------------------------
# Forward and backward against a direct call
# ---------------------------------------------------------------------------------------------
def test_fp8_experts_are_counted_and_bitwise_a_direct_moe_mlp_fp8_call(device):
    experts = tiny_model(device, seed=4).model.layers[0].mlp.experts
    x, ids, weights = routing_inputs(device, seed=5)
    with torch.no_grad():
        with detkit.batch_invariant_mode(strict=True, moe_experts="fp8", fp8_shapes="all"):
            got = experts(x, ids, weights)
        want = direct_fp8(experts, x, ids, weights)[0]
    assert_bits_equal(got, want, "mode (FP8) vs moe_mlp_fp8 on the converted weights")
    assert routed() == {FP8_ROUTE: 1}
    assert detkit.mode_counters().not_routed == {}


def test_gradients_reach_transformers_parameters_and_equal_a_direct_call(device):
    """x, routing weights, gate_up_proj [E, 2I, H] and down_proj [E, H, I]: the gradients of the mode's FP8 route
    are bitwise those of moe_mlp_fp8 on the converted weights, in transformers' layout. The first call runs under
    inference_mode (a rollout) and fills the cache that the training call then uses."""
    experts = tiny_model(device, seed=6).model.layers[0].mlp.experts
    x, ids, weights = routing_inputs(device, t=12, seed=7)
    dout = (torch.randn(12, 128, generator=torch.Generator().manual_seed(8)) * 0.5).to(device=device,
                                                                                       dtype=torch.bfloat16)
    with detkit.batch_invariant_mode(strict=True, moe_experts="fp8", fp8_shapes="all"):
        with torch.inference_mode():
            rollout = experts(x, ids, weights)
        xg, sg = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        out = experts(xg, ids, sg)
        out.backward(dout)
    assert mode_moe.fp8_weight_cache().hits == 2 and mode_moe.fp8_weight_cache().misses == 2
    assert_bits_equal(out, rollout, "training forward vs inference forward")
    xd, sd = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    want, w1, w2 = direct_fp8(experts, xd, ids, sd)
    want.backward(dout)
    assert_bits_equal(out.detach(), want.detach(), "out")
    assert_bits_equal(xg.grad, xd.grad, "dx")
    assert_bits_equal(sg.grad, sd.grad, "d routing weights")
    for param, grad, name in ((experts.gate_up_proj, deinterleave_gate_up(w1.grad.transpose(1, 2), dim=1), "gate_up"),
                              (experts.down_proj, w2.grad.transpose(1, 2), "down")):
        assert param.grad.shape == param.shape and param.grad.stride() == param.stride(), name
        assert_bits_equal(param.grad, grad, f"d {name}_proj")
    assert routed() == {FP8_ROUTE: 2}


def test_a_models_log_probs_keep_their_bits_alone_and_in_a_batch_with_fp8_experts(device):
    model = tiny_model(device, seed=9)
    seqs = torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(10)).to(device)

    def logprobs(ids):
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]

    with torch.inference_mode(), detkit.batch_invariant_mode(strict=True, moe_experts="fp8", fp8_shapes="all"):
        alone = logprobs(seqs[1:2])
        batch = logprobs(seqs)
    assert_bits_equal(batch[1:2], alone, "log-probs alone vs in a batch of 3")
    assert routed()[FP8_ROUTE] == 2 and BF16_ROUTE not in routed()


# ---------------------------------------------------------------------------------------------
# The weight cache
# ---------------------------------------------------------------------------------------------
def test_a_weight_update_invalidates_the_fp8_weights_and_changes_the_output(device):
    """Repeat: hits, same bits. optimizer.step (in place on both parameters): both miss, the slots are replaced, the
    output changes and equals a fresh quantization of the new weights. An in-place update of down_proj alone: only
    its slot misses."""
    experts = tiny_model(device, seed=11).model.layers[0].mlp.experts
    x, ids, weights = routing_inputs(device, seed=12)
    cache = mode_moe.fp8_weight_cache()

    def run():
        with torch.no_grad(), detkit.batch_invariant_mode(strict=True, moe_experts="fp8", fp8_shapes="all"):
            return experts(x, ids, weights)

    first, again = run(), run()
    assert (cache.misses, cache.hits, len(cache)) == (2, 2, 2)
    assert_bits_equal(again, first, "repeat")
    gen = torch.Generator().manual_seed(13)
    for p in (experts.gate_up_proj, experts.down_proj):
        p.grad = (torch.randn(p.shape, generator=gen) * 0.02).to(device=device, dtype=p.dtype)
    torch.optim.SGD([experts.gate_up_proj, experts.down_proj], lr=1.0).step()
    stepped = run()
    assert (cache.misses, cache.hits, len(cache)) == (4, 2, 2)
    assert not compare_bits(stepped, first).equal, "the output did not change after the optimizer step"
    with torch.no_grad():
        assert_bits_equal(stepped, direct_fp8(experts, x, ids, weights)[0], "after the step vs a fresh quantization")
        experts.down_proj.mul_(2)
    doubled = run()
    assert (cache.misses, cache.hits, len(cache)) == (5, 3, 2)
    with torch.no_grad():
        assert_bits_equal(doubled, direct_fp8(experts, x, ids, weights)[0], "after down_proj *= 2")


def test_inference_tensor_weights_are_quantized_on_every_call(device):
    """Parameters made under inference_mode have no version counter: nothing is cached for them."""
    with torch.inference_mode():
        experts = tiny_model(device, seed=14).model.layers[0].mlp.experts
        x, ids, weights = routing_inputs(device, seed=15)
        with detkit.batch_invariant_mode(strict=True, moe_experts="fp8", fp8_shapes="all"):
            got = [experts(x, ids, weights) for _ in range(2)]
        want = direct_fp8(experts, x, ids, weights)[0]
    assert len(mode_moe.fp8_weight_cache()) == 0 and mode_moe.fp8_weight_cache().misses == 4
    for out in got:
        assert_bits_equal(out, want, "inference-tensor weights")


def test_the_cache_refuses_a_bad_capacity():
    from detkit.kernels.moe.fp8.layer import Fp8WeightCache

    with pytest.raises(ValueError, match="capacity must be a positive int; got 0"):
        Fp8WeightCache(capacity=0)


def test_static_slots_are_handed_out_current_and_refreshed_in_place(device):
    """get_for_graph: refused before the weights were quantized (no warm-up), then the slot's own buffers; after an
    in-place update the slot is stale and refused until refresh(), which re-quantizes it into the same buffers (the
    bits of a fresh quantization) and drops a stale slot no graph reads."""
    from detkit.kernels.moe.fp8.quant import quantize_weight
    from detkit.kernels.moe.fp8.layer import Fp8WeightCache

    experts = tiny_model(device, seed=30).model.layers[0].mlp.experts
    cache = Fp8WeightCache()
    w1, w2 = experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2)
    with pytest.raises(RuntimeError, match=r"weight are not quantized: run the block once outside the graph"):
        cache.get_for_graph(w1, source=experts.gate_up_proj, gate_up="split")
    fw1 = cache.get(w1, source=experts.gate_up_proj, gate_up="split")
    cache.get(w2, source=experts.down_proj)
    assert cache.get_for_graph(w1, source=experts.gate_up_proj, gate_up="split") is fw1
    with pytest.raises(ValueError, match=r"need w \(4, 128, 256\) to be a view of its source"):
        cache.get_for_graph(w1.contiguous(), source=experts.gate_up_proj, gate_up="split")
    addresses = [t.data_ptr() for t in (fw1.q, fw1.q_t, fw1.scale)]
    with torch.no_grad():
        experts.gate_up_proj.mul_(0.5)
        experts.down_proj.mul_(2)
    assert cache.stale() == 1  # only the static slot counts
    with pytest.raises(RuntimeError, match="quantized at an older version"):
        cache.get_for_graph(w1, source=experts.gate_up_proj, gate_up="split")
    assert cache.refresh() == 1 and cache.stale() == 0 and len(cache) == 1  # w2's stale slot is dropped
    assert [t.data_ptr() for t in (fw1.q, fw1.q_t, fw1.scale)] == addresses
    want = quantize_weight(w1.detach(), split_pairs=True)
    for name in ("q", "q_t", "scale"):
        assert torch.equal(getattr(fw1, name).view(torch.uint8), getattr(want, name).view(torch.uint8)), name
    assert cache.get_for_graph(w1, source=experts.gate_up_proj, gate_up="split") is fw1
    with torch.no_grad():  # a lookup that misses on a static slot re-quantizes it in place too
        experts.gate_up_proj.mul_(2)
    assert cache.get(w1, source=experts.gate_up_proj, gate_up="split") is fw1 and cache.stale() == 0
    # A miss through a copy of the same layout keeps the view refresh() re-quantizes from.
    with torch.no_grad():
        experts.gate_up_proj.mul_(0.5)
        copy = torch.empty_strided(w1.shape, w1.stride(), dtype=w1.dtype, device=w1.device).copy_(w1)
        assert cache.get(copy, source=experts.gate_up_proj, gate_up="split") is fw1
        experts.gate_up_proj.mul_(2)
    assert cache.stale() == 1 and cache.refresh() == 1 and cache.stale() == 0
    want = quantize_weight(w1.detach(), split_pairs=True)
    assert torch.equal(fw1.q.view(torch.uint8), want.q.view(torch.uint8))


def test_a_captured_call_reads_the_static_weights_only_when_asked(device, monkeypatch):
    """The mode's FP8 experts while a CUDA graph is captured (simulated: the capture check answers True): by default
    the weights are quantized in the call (the cache is not read); with fp8_graph_weights="static" the cache's
    buffers are read (no quantization, the same bits as eager), after a warm-up call only."""
    experts = tiny_model(device, seed=31).model.layers[0].mlp.experts
    x, ids, weights = routing_inputs(device, seed=32)
    cache = mode_moe.fp8_weight_cache()
    monkeypatch.setattr(mode_moe, "_capturing", lambda t: True)
    with torch.no_grad(), detkit.batch_invariant_mode(strict=True, moe_experts="fp8", fp8_shapes="all"):
        quantized = experts(x, ids, weights)
        assert (cache.misses, cache.hits, len(cache)) == (0, 0, 0)
        with detkit.batch_invariant_mode(fp8_graph_weights="static"):
            with pytest.raises(RuntimeError, match="run the block once outside the graph"):
                experts(x, ids, weights)
            monkeypatch.setattr(mode_moe, "_capturing", lambda t: False)
            eager = experts(x, ids, weights)  # the warm-up fills the slots
            monkeypatch.setattr(mode_moe, "_capturing", lambda t: True)
            static = experts(x, ids, weights)
        assert (cache.misses, cache.hits, cache.stale()) == (2, 2, 0)
    assert_bits_equal(static, eager, "static weights vs eager")
    assert_bits_equal(quantized, eager, "quantized in the call vs eager")
    with torch.no_grad():
        experts.down_proj.mul_(2)
    assert cache.stale() == 1 and detkit.refresh_fp8_weights() == 1 and cache.stale() == 0


# ---------------------------------------------------------------------------------------------
# What the FP8 layer does not cover
# ---------------------------------------------------------------------------------------------
def test_a_block_the_fp8_layer_does_not_cover_runs_transformers_experts_counted_or_raises(device, monkeypatch):
    """H = 64, I = 32: not multiples of 128. Not strict: transformers' own experts (not detkit's BF16 layer; their
    grouped GEMMs on the mode's grouped GEMM route), counted with the reason; strict: ModeNotRoutedError before any
    work."""
    experts = tiny_model(device, seed=16, hidden_size=64, moe_intermediate_size=32,
                         num_experts=4).model.layers[0].mlp.experts
    x, ids, weights = routing_inputs(device, seed=17, hidden=64, sentinel=False)
    reason = "FP8 experts need H and I multiples of 128; got H = 64, I = 32 (moe_experts='fp8')"
    with torch.no_grad():
        with monkeypatch.context() as patch:
            grouped_mm_on_detkit(patch)
            want = experts(x, ids, weights)  # transformers' own implementation, grouped GEMMs on detkit's kernel
        with detkit.batch_invariant_mode(moe_experts="fp8"):
            got = experts(x, ids, weights)
        assert_bits_equal(got, want, "not routed: transformers' own experts")
        counters = detkit.mode_counters().as_dict()
        assert counters["not_routed"] == {f"{EXPERTS}: {reason}": 1}
        # what transformers' experts ran on: the mode's grouped GEMM route, nothing else
        assert counters["routed"] == {"_grouped_mm -> detkit.grouped_mm": 2}
        with pytest.raises(detkit.ModeNotRoutedError, match="multiples of 128"), \
                detkit.batch_invariant_mode(strict=True, moe_experts="fp8"):
            experts(x, ids, weights)
    assert mode_moe.fp8_weight_cache().misses == 0  # nothing was quantized


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_a_captured_fp8_block_reads_the_weights_of_each_replay(device):
    """While a CUDA graph is captured the mode quantizes the weights inside the graph (no cache): a replay after an
    in-place weight update gives the new weights' output."""
    experts = tiny_model(device, seed=18, hidden_size=256, moe_intermediate_size=256,
                         num_experts=8).model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(19)
    x = torch.randn(64, 256, generator=gen).to(device=device, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(64)]).to(device)
    weights = torch.rand(64, 2, generator=gen).to(device=device, dtype=torch.bfloat16)
    with torch.inference_mode(), detkit.batch_invariant_mode(strict=True, moe_experts="fp8", fp8_shapes="all"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            experts(x, ids, weights)  # warm-up: compiles, allocates the error flags
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = experts(x, ids, weights)
        graph.replay()
        before = captured.clone()
        experts.down_proj.mul_(2)
        experts.gate_up_proj.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        eager = experts(x, ids, weights)
    assert not compare_bits(captured, before).equal
    assert_bits_equal(captured, eager, "replay after the update vs eager")


@pytest.mark.gpu
def test_a_graph_captured_on_static_fp8_weights_reads_them_until_refreshed(device):
    """fp8_graph_weights="static": the graph reads the weights the warm-up quantized (no quantization in the graph):
    a replay gives eager's bits; after an in-place update it still reads the old weights (the documented contract)
    until refresh_fp8_weights() re-quantizes both in place, and then gives eager's bits on the new weights."""
    experts = tiny_model(device, seed=21, hidden_size=256, moe_intermediate_size=256,
                         num_experts=8).model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(16, 256, generator=gen).to(device=device, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(16)]).to(device)
    weights = torch.rand(16, 2, generator=gen).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad(), detkit.batch_invariant_mode(strict=True, moe_experts="fp8", fp8_shapes="all",
                                                      fp8_graph_weights="static"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager = experts(x, ids, weights)  # warm-up: quantizes the weights into the cache
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = experts(x, ids, weights)
        graph.replay()
        assert_bits_equal(captured, eager, "replay vs eager")
        experts.down_proj.mul_(2)
        experts.gate_up_proj.mul_(0.5)
        graph.replay()
        assert_bits_equal(captured, eager, "replay before refresh: the old weights")
        assert detkit.refresh_fp8_weights() == 2
        graph.replay()
        torch.cuda.synchronize()
        updated = experts(x, ids, weights)
    assert not compare_bits(updated, eager).equal
    assert_bits_equal(captured, updated, "replay after refresh vs eager on the new weights")


@pytest.mark.gpu
def test_fp8_block_at_qwen3_30b_a3b_widths(device):
    """One Qwen3-30B-A3B-width block with FP8 experts: a token's output alone vs in 2048 tokens bitwise, the
    backward bitwise across two runs, and output and gradients within the FP8 precision gate of BF16 experts."""
    block = qwen3_30b_a3b_block(device, seed=20)
    x = torch.randn(1, 2048, 2048, device=device).to(torch.bfloat16)
    dout = torch.randn_like(x)
    from detkit.toolkit.models import moe_block_grads

    with detkit.batch_invariant_mode(strict=True, moe_experts="fp8", fp8_shapes="all"):
        with torch.no_grad():
            full = block(x)
            for t in (0, 777, 2047):
                assert_bits_equal(block(x[:, t:t + 1]), full[:, t:t + 1], f"token {t}")
    runs = [moe_block_grads(block, x, dout, "fp8") for _ in range(2)]
    for name in runs[0][0]:
        assert_bits_equal(runs[1][0][name], runs[0][0][name], name)
    bf16 = moe_block_grads(block, x, dout, "bf16")
    assert torch.equal(bf16[1], runs[0][1])
    for name, got in runs[0][0].items():
        want = bf16[0][name]
        assert cosine(got, want) >= GATE_MIN_COSINE and rel_l2(got, want) < GATE_MAX_REL_RMSE, name
    assert routed()[FP8_ROUTE] > 0


@pytest.mark.gpu
def test_fp8_requests_pick_the_layer_by_shape_on_the_gpu(device):
    """Qwen3-30B-A3B widths (FP8 0.72-1.10x over T, below 1.0x at T=2048): moe_experts="fp8" runs the BF16 layer,
    bitwise moe_experts="bf16", counted with the bounds it misses; the reference widths (H=3072, I=1536, E=8, K=8;
    FP8 1.09-1.32x): the FP8 layer, within the FP8 precision gate of the BF16 layer."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe

    def fp8_then_bf16(block, hidden: int):
        x = torch.randn(1, 64, hidden, device=device).to(torch.bfloat16)
        with torch.no_grad():
            with detkit.batch_invariant_mode(strict=True, moe_experts="fp8"):
                fp8 = block(x)
            with detkit.batch_invariant_mode(strict=True):
                return fp8, block(x)

    got, want = fp8_then_bf16(qwen3_30b_a3b_block(device, seed=50), 2048)
    assert_bits_equal(got, want, "Qwen3-30B-A3B widths: fp8 request vs the BF16 layer")
    as_bf16 = (f"{EXPERTS} -> detkit.moe_mlp (fp8 -> bf16, FP8 slower at H=2048, I=768, E=128, K=8: K/E 8/128 < 4/8, "
               "H*I 2048*768 < 3072*1536, K*H*I 8*2048*768 < 4*3072*1536 (FP8 is faster at every T >= 2048 from "
               "H=3072, I=1536, E=8, K=4))")
    assert {k for k in routed() if k.startswith(EXPERTS)} == {as_bf16, BF16_ROUTE}

    detkit.reset_mode_counters()
    config = Qwen3MoeConfig(hidden_size=3072, moe_intermediate_size=1536, num_experts=8, num_experts_per_tok=8,
                            norm_topk_prob=True)
    torch.manual_seed(51)
    with torch.device(device):
        block = hf_moe.Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    fp8, bf16 = fp8_then_bf16(block, 3072)
    assert {k for k in routed() if k.startswith(EXPERTS)} == {FP8_ROUTE, BF16_ROUTE}
    assert cosine(fp8, bf16) >= GATE_MIN_COSINE and rel_l2(fp8, bf16) < GATE_MAX_REL_RMSE
