"""The fused RMSNorm (kernels/reductions/rms_norm.py) and the mode's RMSNorm route (mode/norms.py): the kernel gives
the bits of transformers' RMSNorm ops under the mode for every style, dtype and layout (so the route is speed only),
is batch-invariant and refuses what it does not take by name; the mode swaps exactly the classes whose forward is one
of the styles, uses the kernel only where no gradient is needed, and a model's logits are the same bits with and
without it. On the CPU (interpreter) and, DETKIT_TEST_DEVICE=cuda, on the GPU (where the kernel's rsqrt must agree
with torch's)."""

from __future__ import annotations

import pytest
import torch

import detkit
from detkit.kernels.reductions.rms_norm import STYLES, rms_norm
from detkit.mode import norms as mode_norms
from tests.conftest import assert_bits_equal

EPS = 1e-6
LAYOUTS = [  # (shape, permutation applied to a contiguous tensor of that shape, or "narrow")
    ((5, 7, 40), None),
    ((3, 1000), None),
    ((2, 3, 2 * 1024 + 17), None),  # three column chunks, the last one partial
    ((2, 6, 3, 16), (0, 2, 1, 3)),  # a [B, H, S, D] transpose (Gemma-3's q/k norms): rows not one row dim
    ((4, 64), None),
    ((5, 7, 64), "narrow"),  # the first 40 columns of each row (a q/k/v split's view): rows 64 apart, not dense
]


def own_ops(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str) -> torch.Tensor:
    """The RMSNorm ops transformers' classes of ``style`` run (the route's reference; under the mode their mean runs
    on the row mean)."""
    if style == "one_plus_weight":
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * (1.0 + weight.float())).type_as(x)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype) if style == "llama" else (weight * h).to(x.dtype)


def inputs(shape, perm, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    x = (x[..., :40] if perm == "narrow" else x.permute(*perm) if perm else x).to(device)
    w = (torch.randn(x.shape[-1], generator=g) * 0.5 + 1).to(dtype).to(device)
    return x, w


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rms_norm_has_the_bits_of_the_modules_ops_under_the_mode(device, style, dtype):
    for i, (shape, perm) in enumerate(LAYOUTS):
        x, w = inputs(shape, perm, dtype, device, seed=i)
        with detkit.batch_invariant_mode():
            want = own_ops(x, w, EPS, style)
            got = rms_norm(x, w, EPS, style)
        assert_bits_equal(got, want, f"{style} {dtype} {shape} {perm}")
        assert got.stride() == want.stride(), f"{shape} {perm}: strides {got.stride()} vs {want.stride()}"
        ref = own_ops(x.double(), w.double(), EPS, style)  # FP64: within a few roundings of the output dtype
        tol = 2 ** -6 if dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(got.double(), ref, rtol=tol, atol=tol), f"{style} {dtype} {shape}: far from FP64"


def test_fused_rms_norm_is_batch_invariant(device):
    x, w = inputs((33, 4096), None, torch.bfloat16, device, seed=5)
    full = rms_norm(x, w, EPS)
    for rows in (slice(0, 1), slice(7, 8), slice(3, 20)):
        assert_bits_equal(rms_norm(x[rows], w, EPS), full[rows], f"rows {rows}")


def test_fused_rms_norm_refuses_by_name(device):
    x, w = inputs((4, 64), None, torch.bfloat16, device)
    cases = [((x, w, EPS, "layer"), "style 'layer'"),
             ((x.half(), w, EPS), "input dtype torch.float16"),
             ((x, w.float(), EPS, "llama"), "weight dtype torch.float32 with input dtype torch.bfloat16"),
             ((x.t(), w[:4], EPS), "input strides"),
             ((x, w[:32], EPS), "weight shape (32,)"),
             ((x.reshape(1, 1, 1, 4, 64), w, EPS), "input shape (1, 1, 1, 4, 64)")]
    for args, words in cases:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            rms_norm(*args)


def test_the_styles_match_transformers_classes():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.llama import modeling_llama
    from transformers.models.olmo2 import modeling_olmo2
    from transformers.models.qwen3 import modeling_qwen3

    assert transformers.__version__
    want = {modeling_llama.LlamaRMSNorm: "llama", modeling_qwen3.Qwen3RMSNorm: "llama",
            modeling_olmo2.Olmo2RMSNorm: "weight_first", modeling_gpt_oss.GptOssRMSNorm: "weight_first",
            modeling_gemma3.Gemma3RMSNorm: "one_plus_weight"}
    for cls, style in want.items():
        assert mode_norms.style_of(cls) == style, cls.__name__

    class OtherNorm(torch.nn.Module):  # same names, another op: not a style
        def forward(self, hidden_states):
            return self.weight * hidden_states

    class HelperOverride(modeling_gemma3.Gemma3RMSNorm):  # Gemma's forward, another _norm
        def _norm(self, x):
            return x

    assert mode_norms.style_of(OtherNorm) is None
    assert mode_norms.style_of(HelperOverride) is None


def _tiny_qwen3(device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=96)
    return Qwen3ForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def test_the_mode_runs_rms_norms_fused_without_grad_with_the_same_logits(device):
    pytest.importorskip("transformers")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    own = Qwen3RMSNorm.forward
    model = _tiny_qwen3(device)
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(1)).to(device)
    with detkit.batch_invariant_mode():
        assert mode_norms.installed_classes()[Qwen3RMSNorm] == "llama"
        detkit.reset_mode_counters()
        with torch.no_grad():
            rollout = model(ids).logits
        fused_counts = detkit.mode_counters().as_dict()["routed"]
        detkit.reset_mode_counters()
        trainer = model(ids).logits  # grad on: the class's own ops
        own_counts = detkit.mode_counters().as_dict()["routed"]
        with torch.no_grad(), mode_norms.suspended():
            suspended = model(ids).logits
    # 2 layers x (input, post-attention, q, k) + the final norm
    assert fused_counts["rms_norm (transformers) -> fused_rms_norm"] == 9
    assert "mean.dim -> row_mean" not in fused_counts
    assert own_counts["mean.dim -> row_mean"] == 9 and "rms_norm (transformers) -> fused_rms_norm" not in own_counts
    assert_bits_equal(rollout, trainer.detach(), "logits, fused norms vs the class's ops")
    assert_bits_equal(suspended, rollout, "logits, route suspended")
    assert Qwen3RMSNorm.forward is own, "the class's forward is restored on exit"


def test_subclasses_and_tensor_subclasses_keep_their_own_forward(device):
    pytest.importorskip("transformers")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    class Scaled(Qwen3RMSNorm):  # inherits the swapped forward; not one of the matched classes
        pass

    norm = Scaled(64).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=torch.bfloat16)
    with detkit.batch_invariant_mode(), torch.no_grad():
        detkit.reset_mode_counters()
        norm(x)
        counts = detkit.mode_counters().as_dict()["routed"]
        plain = Qwen3RMSNorm(64).to(device=device, dtype=torch.bfloat16)
        detkit.reset_mode_counters()

        class Traced(torch.Tensor):  # a tensor subclass (DTensor, FakeTensor) keeps the class's own ops
            pass
        plain(x.as_subclass(Traced))
        subclass_counts = detkit.mode_counters().as_dict()["routed"]
    assert counts == {"mean.dim -> row_mean": 1}
    assert "rms_norm (transformers) -> fused_rms_norm" not in subclass_counts
