"""mode/experts.py: "detkit" and "detkit_fp8" in transformers' ExpertsInterface, and the mode dispatching every experts
class transformers' ``use_experts_implementation`` decorator built to them. For each family (Qwen3-MoE, Mixtral,
gpt-oss, DeepSeek-V3, GLM-4-MoE) and each layout flag (transposed, bias, no gate, a custom ``_apply_gate``, another
activation, a post-expert norm; synthetic classes decorated here): the output and the gradients obey the MoE layer's
end-to-end gate against an FP64 reference of the class's math and are no worse than transformers' own "grouped_mm"
against the same reference; a token's output alone equals its row in a batch, bitwise; the backward repeats bitwise;
the counters name the path (and the reason the fused layer did not take it); refusals are one line, strict raises;
the interface's mapping is restored on exit. CPU under the Triton interpreter (conftest); everything with
DETKIT_TEST_DEVICE=cuda on an H100/H200."""

from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the optional extra detkit[models]")
moe_integration = pytest.importorskip("transformers.integrations.moe", reason="this transformers has no experts "
                                      "interface")

import detkit  # noqa: E402
from detkit.audits.moe import E2E_REL_L2_GATE, GOLD_SLACK  # noqa: E402
from detkit.kernels.moe.layer import moe_mlp  # noqa: E402
from detkit.mode import experts as mode_experts  # noqa: E402
from detkit.toolkit.contract import cosine, rel_l2  # noqa: E402
from detkit.toolkit.moe_gate import GATE_MAX_REL_RMSE, GATE_MIN_COSINE  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402

from tests.conftest import assert_bits_equal  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped GEMM "
                                "(transformers' grouped_mm, the comparison)")

EXPERTS = "moe experts (transformers)"
FUSED = "detkit.moe_mlp"
GROUPED = "detkit.grouped_mm, gate elementwise"
REL_FLOOR = 2.0**-12  # a relative error under this counts as exact (audits/moe.py's precision floor)
H, I, E, K = 64, 32, 4, 2


@pytest.fixture(autouse=True)
def _fresh_counters():
    detkit.reset_mode_counters()
    yield
    assert not detkit.is_batch_invariant_mode_enabled(), "a test left the mode entered"
    assert not mode_experts.installed(), "the experts route outlived the mode"
    assert mode_experts.experts_route not in moe_integration.ExpertsInterface._global_mapping.values()


# ---------------------------------------------------------------------------------------------
# The experts classes: transformers' families, and synthetic classes for the layout flags no family here uses
# ---------------------------------------------------------------------------------------------
class _Norm(torch.nn.Module):
    """A post-expert RMSNorm (FP32 statistics, the input's dtype out)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))

    def forward(self, y):
        normed = y.float() * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * normed.to(y.dtype)


def synthetic(flags: dict, custom_gate: bool = False):
    """An experts class decorated with ``flags``, parameters in transformers' layouts for them."""
    gated, transposed = flags.get("has_gate", True), flags.get("is_transposed", False)

    class Experts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
            up = 2 * inter if gated else inter
            name = "gate_up_proj" if gated else "up_proj"
            setattr(self, name, torch.nn.Parameter(torch.empty((self.num_experts, hidden, up) if transposed else
                                                                (self.num_experts, up, hidden))))
            self.down_proj = torch.nn.Parameter(torch.empty((self.num_experts, inter, hidden) if transposed else
                                                            (self.num_experts, hidden, inter)))
            if flags.get("has_bias"):
                setattr(self, f"{name}_bias", torch.nn.Parameter(torch.empty(self.num_experts, up)))
                self.down_proj_bias = torch.nn.Parameter(torch.empty(self.num_experts, hidden))
            if flags.get("has_post_expert_norm"):
                self.post_expert_norm = _Norm(hidden)
            self.act_fn = ACT2FN[config.hidden_act]

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError("the synthetic class has no eager forward")

    if custom_gate:
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.gelu(gate, approximate="tanh") * up
        Experts._apply_gate = _apply_gate
    accepted = inspect.signature(moe_integration.use_experts_implementation).parameters
    missing = [flag for flag in flags if flag not in accepted]
    if missing:
        pytest.skip(f"transformers {transformers.__version__}'s use_experts_implementation has no {missing}")
    return moe_integration.use_experts_implementation(Experts, **flags)


def family(kind: str):
    """(experts class, config) of a transformers family at tiny widths (H = 64, I = 32, E = 4, K = 2)."""
    if kind == "qwen3_moe":
        from transformers.models.qwen3_moe import modeling_qwen3_moe as m
        return m.Qwen3MoeExperts, transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                                              num_experts_per_tok=K)
    if kind == "mixtral":
        from transformers.models.mixtral import modeling_mixtral as m
        return m.MixtralExperts, transformers.MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                                            num_experts_per_tok=K)
    if kind == "gpt_oss":
        from transformers.models.gpt_oss import modeling_gpt_oss as m
        return m.GptOssExperts, transformers.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                                          num_experts_per_tok=K)
    if kind == "deepseek_v3":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
        return m.DeepseekV3Experts, transformers.DeepseekV3Config(hidden_size=H, moe_intermediate_size=I,
                                                                  n_routed_experts=E, num_experts_per_tok=K)
    if kind == "glm4_moe":
        from transformers.models.glm4_moe import modeling_glm4_moe as m
        return m.Glm4MoeExperts, transformers.Glm4MoeConfig(hidden_size=H, moe_intermediate_size=I,
                                                            n_routed_experts=E, num_experts_per_tok=K)
    config = transformers.MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
                                        hidden_act="gelu" if kind == "gelu" else "silu")
    flags = {"transposed": dict(is_transposed=True), "bias": dict(has_bias=True), "no_gate": dict(has_gate=False),
             "post_norm": dict(has_post_expert_norm=True), "gelu": {}, "custom_gate": {},
             "interleaved_flag": dict(is_concatenated=False)}[kind]
    return synthetic(flags, custom_gate=kind == "custom_gate"), config


# case -> the kernel counted: the fused layer, or the grouped path with the reason the fused layer did not take it
CASES = {
    "qwen3_moe": FUSED,
    "mixtral": FUSED,
    "deepseek_v3": FUSED,
    "glm4_moe": FUSED,
    "transposed": FUSED,
    "gpt_oss": f"{GROUPED} (GptOssExperts.is_concatenated = False (fused layer: True))",
    "bias": f"{GROUPED} (Experts.has_bias = True (fused layer: False))",
    "no_gate": f"{GROUPED} (Experts.has_gate = False (fused layer: True))",
    "post_norm": f"{GROUPED} (Experts.has_post_expert_norm = True (fused layer: False))",
    "gelu": f"{GROUPED} (activation GELUActivation (fused layer: SiLU, the layer's SwiGLU))",
    "custom_gate": f"{GROUPED} (Experts overrides _apply_gate (fused layer: silu(gate) * up))",
    "interleaved_flag": f"{GROUPED} (Experts.is_concatenated = False (fused layer: True))",
}


def build(kind: str, device, seed: int, implementation: str = "grouped_mm"):
    cls, config = family(kind)
    config._experts_implementation = implementation
    torch.manual_seed(seed)
    with torch.device(device):
        module = cls(config).to(torch.bfloat16)
    for name, p in module.named_parameters():
        torch.nn.init.normal_(p, mean=1.0 if name.endswith("norm.weight") else 0.0, std=0.1)
    return module


def routing(device, seed: int, tokens: int = 7):
    """x [T, H] bf16, ids [T, K] (distinct per row: a top-k), weights [T, K] bf16, dout [T, H] bf16."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).to(device=device, dtype=torch.bfloat16)
    ids = torch.rand(tokens, E, generator=gen).topk(K, dim=-1).indices.to(device)
    weights = torch.rand(tokens, K, generator=gen).to(device=device, dtype=torch.bfloat16)
    dout = (torch.randn(tokens, H, generator=gen) * 0.5).to(device=device, dtype=torch.bfloat16)
    return x, ids, weights, dout


def reference(module, x, ids, weights, dout) -> dict[str, torch.Tensor]:
    """The class's math in FP64 (its own ``_apply_gate`` / ``act_fn`` on FP64 tensors): out and the gradients of x and
    of every parameter for ``dout``."""
    leaves = {n: p.detach().double().requires_grad_(True) for n, p in module.named_parameters()}
    x64 = x.detach().double().requires_grad_(True)
    gated, transposed = getattr(module, "has_gate", True), getattr(module, "is_transposed", False)
    has_bias = getattr(module, "has_bias", False)
    up = leaves["gate_up_proj" if gated else "up_proj"][ids]  # [T, K, ., .]
    gu = torch.einsum("th,tkhn->tkn" if transposed else "th,tknh->tkn", x64, up)
    if has_bias:
        gu = gu + leaves["gate_up_proj_bias" if gated else "up_proj_bias"][ids]
    h = module._apply_gate(gu) if gated else module.act_fn(gu)
    y = torch.einsum("tkn,tknh->tkh" if transposed else "tkn,tkhn->tkh", h, leaves["down_proj"][ids])
    if has_bias:
        y = y + leaves["down_proj_bias"][ids]
    if getattr(module, "has_post_expert_norm", False):  # a flag transformers 5.17 does not have
        y = leaves["post_expert_norm.weight"] * y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
    out = (weights.double()[..., None] * y).sum(1)
    out.backward(dout.double())
    return {"out": out.detach(), "x": x64.grad, **{n: t.grad for n, t in leaves.items()}}


def run(module, x, ids, weights, dout) -> dict[str, torch.Tensor]:
    """out and the gradients of x and every parameter (module's own implementation dispatch)."""
    module.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_(True)
    out = module(leaf, ids, weights)
    out.backward(dout)
    return {"out": out.detach(), "x": leaf.grad, **{n: p.grad for n, p in module.named_parameters()}}


# ---------------------------------------------------------------------------------------------
# Every family and layout flag
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(CASES))
def test_each_family_and_layout_against_fp64_and_transformers_own(device, kind):
    """Strict: the counted path is the expected one; out and every gradient within the end-to-end gate of the FP64
    reference and no worse than transformers' "grouped_mm" (GOLD_SLACK, audits/moe.py); the gradients keep the
    parameters' layouts."""
    module = build(kind, device, seed=1)
    # 64 tokens (about 32 rows per expert): with a handful, which BF16 run lands nearer FP64 in a bias gradient (a
    # sum of 3-4 rounded rows) is a coin toss, not the kernels' accuracy.
    x, ids, weights, dout = routing(device, seed=2, tokens=64)
    want = reference(module, x, ids, weights, dout)
    theirs = run(module, x, ids, weights, dout)  # transformers' grouped_mm, outside the mode
    with detkit.batch_invariant_mode(strict=True):
        ours = run(module, x, ids, weights, dout)
    assert detkit.mode_counters().as_dict()["routed"].get(f"{EXPERTS} -> {CASES[kind]}") == 1, \
        detkit.mode_counters().as_dict()
    assert not any(k.startswith("_grouped_mm") for k in detkit.mode_counters().as_dict()["routed"])
    for name, ref in want.items():
        got, base = rel_l2(ours[name], ref), rel_l2(theirs[name], ref)
        assert got <= E2E_REL_L2_GATE, f"{kind} {name}: relative L2 {got:.3g} vs FP64 > gate {E2E_REL_L2_GATE:.3g}"
        assert got <= GOLD_SLACK * base + REL_FLOOR, f"{kind} {name}: detkit {got:.3g} vs transformers' {base:.3g}"
        assert ours[name].shape == theirs[name].shape and ours[name].stride() == theirs[name].stride(), name


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss", "no_gate", "post_norm"])
def test_a_tokens_output_alone_equals_its_row_in_a_batch_and_the_backward_repeats(device, kind):
    """Bitwise: each of 3 tokens alone vs its row in a batch of 7; two backward passes give the same bits."""
    module = build(kind, device, seed=3)
    x, ids, weights, dout = routing(device, seed=4)
    with detkit.batch_invariant_mode(strict=True):
        with torch.no_grad():
            batch = module(x, ids, weights)
            for t in (0, 3, 6):
                alone = module(x[t:t + 1], ids[t:t + 1], weights[t:t + 1])
                assert_bits_equal(batch[t:t + 1], alone, f"{kind}: token {t} alone vs in a batch of 7")
        first, second = run(module, x, ids, weights, dout), run(module, x, ids, weights, dout)
    for name, g in first.items():
        assert_bits_equal(second[name], g, f"{kind}: {name}, two backward passes")


def test_the_combine_adds_the_k_terms_in_ascending_order(device):
    """fixed_order_combine: ((w0 y0 + w1 y1) + w2 y2) in FP32, one BF16 rounding, on values whose sums round
    differently in another order (2**24 + 1 - 2**24 is 0 in FP32 left to right, 1 right to left)."""
    y = torch.tensor([[[2.0**24], [1.0], [-2.0**24]]], device=device).to(torch.bfloat16)  # [T=1, K=3, H=1]
    ones = torch.ones(1, 3, device=device)
    assert float(mode_experts.fixed_order_combine(y, ones)) == 0.0
    assert float(mode_experts.fixed_order_combine(y.flip(1), ones)) == 1.0


# ---------------------------------------------------------------------------------------------
# The interface: registration, dispatch of every name while entered, restore on exit
# ---------------------------------------------------------------------------------------------
def test_detkit_is_registered_and_runs_outside_the_mode_with_the_modes_bits(device):
    """``experts_implementation="detkit"`` runs detkit's path outside the mode (counted), with the bits the mode
    gives the same module built with "eager" or with no implementation (None: a module outside a model)."""
    mode_experts.register_transformers_experts()
    mapping = moe_integration.ExpertsInterface._global_mapping
    assert mapping["detkit"] is mode_experts.detkit_experts and mapping["detkit_fp8"] is mode_experts.detkit_fp8_experts
    x, ids, weights, _ = routing(device, seed=6)
    for kind in ("mixtral", "gpt_oss"):
        module = build(kind, device, seed=5, implementation="detkit")
        with torch.no_grad():
            outside = module(x, ids, weights)
            for requested in ("eager", None, "batched_mm"):
                module.config._experts_implementation = requested
                with detkit.batch_invariant_mode(strict=True):
                    assert_bits_equal(module(x, ids, weights), outside, f"{kind}: {requested!r} in the mode")
    routed = detkit.mode_counters().as_dict()["routed"]
    assert routed[f"{EXPERTS} -> {FUSED}"] == 4 and routed[f"{EXPERTS} -> {CASES['gpt_oss']}"] == 4
    # "eager" and None keep the class's own forward outside the mode (the entry the mode's first entry added)
    assert mapping["eager"] is mapping[None] is mode_experts.own_forward
    with pytest.raises(NotImplementedError, match="no eager forward"):  # the synthetic class's own forward
        build("bias", device, seed=5, implementation="eager")(x, ids, weights)


def test_a_model_built_with_detkit_runs_its_experts_on_detkit(device):
    """A tiny Mixtral ``from_config(..., experts_implementation="detkit")``: transformers accepts the name and every
    experts call is counted on the fused layer, outside the mode."""
    mode_experts.register_transformers_experts()
    config = transformers.MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=32, vocab_size=64)
    with torch.device(device):
        model = transformers.MixtralForCausalLM._from_config(config, experts_implementation="detkit",
                                                            torch_dtype=torch.bfloat16)
    assert model.config._experts_implementation == "detkit"
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]], device=device))
    assert detkit.mode_counters().as_dict()["routed"] == {f"{EXPERTS} -> {FUSED}": 2}


# ---------------------------------------------------------------------------------------------
# Refusals: counted, raised under strict, one line
# ---------------------------------------------------------------------------------------------
def _one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message, message
    return message


def test_expert_parallelism_is_refused_by_name(device, monkeypatch):
    """Not strict: transformers' requested implementation runs (its grouped GEMMs on the mode's grouped route),
    counted with the reason; strict: ModeNotRoutedError; "detkit": NotImplementedError."""
    module = build("mixtral", device, seed=7)
    module._is_expert_parallel = True
    x, ids, weights, _ = routing(device, seed=8)
    reason = "MixtralExperts._is_expert_parallel = True (supported: False)"
    with torch.no_grad():
        with detkit.batch_invariant_mode():
            module(x, ids, weights)
        counters = detkit.mode_counters().as_dict()
        assert counters["not_routed"] == {f"{EXPERTS}: {reason}": 1}
        assert counters["routed"] == {"_grouped_mm -> detkit.grouped_mm": 2}
        with pytest.raises(detkit.ModeNotRoutedError) as strict, detkit.batch_invariant_mode(strict=True):
            module(x, ids, weights)
        assert reason in _one_line(strict)
        module.config._experts_implementation = "detkit"
        mode_experts.register_transformers_experts()
        with pytest.raises(NotImplementedError) as refused:
            module(x, ids, weights)
        assert _one_line(refused) == f"experts_implementation='detkit': {reason}"


def test_fp8_experts_refuse_what_the_fused_fp8_layer_does_not_take(device):
    """moe_experts="fp8": a layout only the BF16 grouped path takes, or H, I not multiples of 128, is refused (counted,
    never run at the other precision); "detkit_fp8" raises."""
    x, ids, weights, _ = routing(device, seed=10)
    for kind, reason in (
            ("gpt_oss", "GptOssExperts.is_concatenated = False (fused layer: True); the FP8 layer is fused only "
                        "(moe_experts='fp8')"),
            ("mixtral", "FP8 experts need H and I multiples of 128; got H = 64, I = 32 (moe_experts='fp8')")):
        module = build(kind, device, seed=9)
        detkit.reset_mode_counters()
        with torch.no_grad():
            with detkit.batch_invariant_mode(moe_experts="fp8"):
                module(x, ids, weights)
            assert detkit.mode_counters().as_dict()["not_routed"] == {f"{EXPERTS}: {reason}": 1}
            with pytest.raises(detkit.ModeNotRoutedError) as strict, \
                    detkit.batch_invariant_mode(strict=True, moe_experts="fp8"):
                module(x, ids, weights)
            assert reason in _one_line(strict)


def test_float32_experts_are_counted_and_run_transformers_own(device):
    module = build("mixtral", device, seed=11).float()
    x, ids, weights, _ = routing(device, seed=12)
    with torch.no_grad():
        want = module(x.float(), ids, weights.float())
        with detkit.batch_invariant_mode():
            got = module(x.float(), ids, weights.float())
    assert detkit.mode_counters().as_dict()["not_routed"][f"{EXPERTS}: dtype float32"] == 1
    assert got.dtype == torch.float32 and rel_l2(got, want) <= REL_FLOOR


# ---------------------------------------------------------------------------------------------
# FP8: a transposed class on the fused FP8 layer (H = I = 128, the layer's block)
# ---------------------------------------------------------------------------------------------
def test_a_transposed_class_runs_the_fp8_layer_on_its_parameters_in_place(device):
    """is_transposed: gate_up_proj [E, H, 2I] and down_proj [E, I, H] are the layer's w1, w2 as they are; the mode's
    FP8 experts equal a direct ``moe_mlp_fp8`` call on them, bitwise."""
    from detkit.kernels.moe.fp8.layer import moe_mlp_fp8

    cls = synthetic(dict(is_transposed=True))
    config = transformers.MixtralConfig(hidden_size=128, intermediate_size=128, num_local_experts=E,
                                        num_experts_per_tok=K)
    torch.manual_seed(13)
    with torch.device(device):
        module = cls(config).to(torch.bfloat16)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.05)
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(5, 128, generator=gen).to(device=device, dtype=torch.bfloat16)
    ids = torch.rand(5, E, generator=gen).topk(K, dim=-1).indices.to(device)
    weights = torch.rand(5, K, generator=gen).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        with detkit.batch_invariant_mode(strict=True, moe_experts="fp8", fp8_shapes="all"):  # FP8 at any shape
            got = module(x, ids, weights)
        want = moe_mlp_fp8(x, module.gate_up_proj, module.down_proj, ids.to(torch.int32), weights, gate_up="split")
        bf16 = moe_mlp(x, module.gate_up_proj, module.down_proj, ids.to(torch.int32), weights, gate_up="split")
    assert_bits_equal(got, want, "the mode's FP8 experts vs moe_mlp_fp8 on the parameters")
    assert detkit.mode_counters().as_dict()["routed"] == {f"{EXPERTS} -> detkit.moe_mlp_fp8": 1}
    # the FP8 precision gate against the BF16 path (docs/moe_fp8.md): a wrong layout would be far outside it
    assert cosine(got, bf16) >= GATE_MIN_COSINE and rel_l2(got, bf16) < GATE_MAX_REL_RMSE


def test_sentinel_routes_contribute_nothing_on_the_grouped_path(device):
    """Route ids >= E (transformers' expert-parallel sentinel; refused by name where the class has
    ``_is_expert_parallel``, masked where it has not) contribute nothing: the output equals the same routes with
    that slot's weight 0, and a token whose routes are all sentinels gets zeros (0 * y: either sign)."""
    module = build("gpt_oss", device, seed=15)
    x, ids, weights, _ = routing(device, seed=16, tokens=4)
    ids[1, 1] = E
    ids[2] = E
    valid = torch.where(ids >= E, 0, ids)
    with torch.no_grad(), detkit.batch_invariant_mode(strict=True):
        got = module(x, ids, weights)
        want = module(x, valid, weights.masked_fill(ids >= E, 0))
    keep = [0, 1, 3]
    assert_bits_equal(got[keep], want[keep], "sentinel routes vs weight-0 routes")
    assert bool((got[2] == 0).all()) and bool((want[2] == 0).all())


# ---------------------------------------------------------------------------------------------
# Whole tiny models of the families no other test file builds
# ---------------------------------------------------------------------------------------------
MODEL_TINY = dict(hidden_size=H, intermediate_size=64, moe_intermediate_size=I, n_routed_experts=E,
                  num_experts_per_tok=K, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  vocab_size=128, max_position_embeddings=128, first_k_dense_replace=0, n_shared_experts=1,
                  n_group=1, topk_group=1)


def tiny_family_model(kind: str, device):
    if kind == "deepseek_v3":  # MLA at tiny widths: q/k heads 16 + 16, v 16
        config = transformers.DeepseekV3Config(**MODEL_TINY, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=16,
                                               qk_nope_head_dim=16, v_head_dim=16)
        model_cls = transformers.DeepseekV3ForCausalLM
    else:
        config = transformers.Glm4MoeConfig(**MODEL_TINY, head_dim=32)
        model_cls = transformers.Glm4MoeForCausalLM
    torch.manual_seed(17)
    with torch.device(device):
        model = model_cls._from_config(config, attn_implementation="eager").to(torch.bfloat16)
    with torch.no_grad():  # spread the routing (the correction bias starts at 0; the router weights are small)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model.eval()


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_a_family_models_log_probs_keep_their_bits_alone_and_in_a_batch(device, kind):
    """Every experts call on the fused layer (2 layers x 2 forwards); a sequence's log-probs alone and at position 1
    of a batch of 3 are bitwise equal. Not strict: these models' routers and shared experts run as transformers wrote
    them (their linears on the mode's GEMM route)."""
    model = tiny_family_model(kind, device)
    seqs = torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(18)).to(device)

    def logprobs(ids):
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]

    with torch.inference_mode(), detkit.batch_invariant_mode():
        alone = logprobs(seqs[1:2])
        batch = logprobs(seqs)
    assert_bits_equal(batch[1:2], alone, f"{kind}: log-probs alone vs in a batch of 3")
    counters = detkit.mode_counters().as_dict()
    assert counters["routed"][f"{EXPERTS} -> {FUSED}"] == 4, counters
    assert not any(k.startswith(EXPERTS) for k in counters["not_routed"]), counters


def test_pre_quantized_experts_classes_are_counted_never_silent(device):
    """A class dispatching through transformers' FP8ExpertsInterface (pre-quantized checkpoints) is not routed:
    counted with the reason and run as its config asked, or raised under strict; its mapping is restored on exit."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8", reason="no FP8 experts interface")
    interface = fp8.FP8ExpertsInterface

    class Experts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = config.num_local_experts

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states * 2

    cls = moe_integration.use_experts_implementation(Experts, experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS)
    config = transformers.MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    config._experts_implementation = "eager"
    module = cls(config)
    x, ids, weights, _ = routing(device, seed=19)
    before = dict(interface._global_mapping)
    reason = ("Experts dispatches through FP8ExpertsInterface (pre-quantized expert weights: no detkit kernel takes "
              "them)")
    with detkit.batch_invariant_mode():
        assert_bits_equal(module(x, ids, weights), x * 2, "the class's own eager forward")
    assert detkit.mode_counters().as_dict()["not_routed"] == {f"{EXPERTS}: {reason}": 1}
    with pytest.raises(detkit.ModeNotRoutedError) as strict, detkit.batch_invariant_mode(strict=True):
        module(x, ids, weights)
    assert reason in _one_line(strict)
    assert interface._global_mapping == before


def test_an_experts_module_compiled_before_the_mode_reaches_the_route_inside_it(device):
    """torch.compile of a gpt-oss experts module built with "eager": outside the mode its own forward is traced;
    inside, the interface's swapped entry is seen (the compiled dispatch re-guards on the entry it read: "eager" has
    one, ``own_forward``, since the mode's first entry) and the route runs as a graph break with the eager route's
    bits. Run after other tests too: with no "eager" entry dynamo kept the eager forward inside the mode."""
    module = build("gpt_oss", device, seed=20, implementation="eager")
    x, ids, weights, _ = routing(device, seed=21)
    compiled = torch.compile(module)
    with torch.no_grad():
        compiled(x, ids, weights)
        with detkit.batch_invariant_mode(strict=True):
            got = compiled(x, ids, weights)
            want = module(x, ids, weights)
    assert_bits_equal(got, want, "compiled vs eager inside the mode")
    assert detkit.mode_counters().as_dict()["routed"][f"{EXPERTS} -> {CASES['gpt_oss']}"] == 2
