"""mode/grouped.py: inside ``batch_invariant_mode`` every BF16 ``torch._grouped_mm`` / ``F.grouped_mm`` call of the
forms transformers' "grouped_mm" experts and their backward make runs on detkit.kernels.grouped -- the forward and
grad_input (2-D x 3-D with offsets) on ``grouped_mm``, grad_weight (2-D x 2-D, offsets along the reduced dim) on
``grouped_wgrad`` -- with those kernels' bits; a token's expert output keeps its bits whatever the batch; 3-D x 3-D
runs on det_gemm; what is not routed is counted with its reason or, under strict, raised naming the value; and
a tiny transformers Mixtral runs its experts on detkit (mode/experts.py). CPU under the Triton
interpreter (conftest); everything with DETKIT_TEST_DEVICE=cuda on an H100/H200, plus the `gpu`-marked tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import detkit
from detkit.kernels.bounds import gemm_bound
from detkit.kernels.det_gemm.launch import det_gemm_fwd
from detkit.kernels.grouped import (
    grouped_mm, grouped_mm_ref, grouped_mm_sequential, grouped_wgrad, grouped_wgrad_sequential,
)
from detkit.toolkit.contract import check_bound
from detkit.toolkit.fixtures import bf16_randn

from tests.conftest import assert_bits_equal

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped GEMM")
OP = "_grouped_mm"


@pytest.fixture(autouse=True)
def _fresh_counters():
    detkit.reset_mode_counters()
    yield
    assert not detkit.is_batch_invariant_mode_enabled(), "a test left the mode entered"


def counters() -> dict:
    return detkit.mode_counters().as_dict()


def offsets(sizes, device) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


def expert_weights(e, k, n, seed, layout, device):
    """transformers' two layouts: ``is_transposed=False`` keeps [E, N, K] and passes ``w.transpose(-2, -1)``;
    ``is_transposed=True`` keeps [E, K, N] and passes it as is."""
    if layout == "transposed":
        w = bf16_randn((e, n, k), seed, device, scale=k**-0.5)
        return w, lambda w: w.transpose(-2, -1)
    return bf16_randn((e, k, n), seed, device, scale=k**-0.5), lambda w: w


@pytest.mark.parametrize("layout", ["transposed", "kn"])
def test_forward_and_backward_run_detkits_grouped_kernels(device, layout):
    """One grouped linear forward and backward: the forward and grad_input on grouped_mm, grad_weight on
    grouped_wgrad, each with those kernels' bits (and, under the interpreter, the sequential reference's)."""
    sizes = (5, 0, 14, 3)
    m, k, n = sum(sizes) + 2, 16, 24  # two rows past the last offset (transformers' expert-parallel sentinels)
    w, view = expert_weights(len(sizes), k, n, 1, layout, device)
    w.requires_grad_(True)
    x = bf16_randn((m, k), 2, device).requires_grad_(True)
    dy = bf16_randn((m, n), 3, device)
    offs = offsets(sizes, device)
    with detkit.batch_invariant_mode(strict=True):
        y = F.grouped_mm(x, view(w), offs=offs)
        y.backward(dy)
    assert counters()["routed"] == {f"{OP} -> detkit.grouped_mm": 2, f"{OP} -> detkit.grouped_wgrad": 1}
    wd, xd = view(w.detach()), x.detach()
    assert_bits_equal(y.detach(), grouped_mm(xd, wd, offs), "forward")
    assert_bits_equal(x.grad, grouped_mm(dy, wd.transpose(-2, -1), offs), "grad_input")
    assert_bits_equal(view(w.grad), grouped_wgrad(dy.t(), xd, offs).transpose(-2, -1), "grad_weight")
    if device.type == "cpu":
        assert_bits_equal(y.detach(), grouped_mm_sequential(xd, wd, offs), "forward vs the sequential reference")
        assert_bits_equal(view(w.grad), grouped_wgrad_sequential(dy.t(), xd, offs).transpose(-2, -1),
                          "grad_weight vs the sequential reference")
    star = grouped_mm_ref(xd.cpu(), wd.cpu(), offs.cpu())
    result = check_bound(y.detach().cpu(), star, gemm_bound(star, grouped_mm_ref(xd.cpu().abs(), wd.cpu().abs(),
                                                                                   offs.cpu()), k))
    assert result.passed, result


def test_a_tokens_expert_output_keeps_its_bits_whatever_the_batch(device):
    """A token routed to expert 2, alone, then among 30 other routes with different counts for every expert."""
    k, n = 32, 16
    w, view = expert_weights(4, k, n, 4, "transposed", device)
    token = bf16_randn((1, k), 5, device)
    others = bf16_randn((30, k), 6, device)
    with detkit.batch_invariant_mode(strict=True):
        alone = F.grouped_mm(token, view(w), offs=offsets([0, 0, 1, 0], device))
        batch = F.grouped_mm(torch.cat([others[:19], token, others[19:]]), view(w), offs=offsets([7, 12, 5, 7], device))
    assert_bits_equal(batch[19:20], alone, "a token alone vs at row 3 of its expert's 5 in a batch of 31")


def test_batched_3d_form_is_one_det_gemm_per_group(device):
    a, b = bf16_randn((3, 5, 16), 7, device), bf16_randn((3, 24, 16), 8, device).transpose(-2, -1)
    with detkit.batch_invariant_mode(strict=True):
        out = torch._grouped_mm(a, b)
    for g in range(3):
        assert_bits_equal(out[g], det_gemm_fwd(a[g], b[g]), f"group {g}")
    assert counters()["routed"] == {f"{OP} -> det_gemm_fwd": 1}


def _unsupported(device):
    x, w = bf16_randn((8, 16), 9, device), bf16_randn((2, 16, 8), 10, device)
    offs = offsets([3, 5], device)
    return {
        "fp32": ((x.float(), w.float()), {"offs": offs}, "dtype float32"),
        "3-D x 2-D": ((x.view(2, 4, 16), w[0]), {"offs": offs}, "3-D x 2-D operands"),
        "offs int64": ((x, w), {"offs": offs.long()}, "offs dtype int64"),
        "no offs": ((x, w), {}, "offs is None"),
    }


@pytest.mark.parametrize("case", ["fp32", "3-D x 2-D", "offs int64", "no offs"])
def test_what_is_not_routed_runs_on_torch_counted_or_raises_under_strict(device, case):
    """Unrouted calls run torch's CompositeExplicitAutograd kernel (the override hides torch's CUDA kernel while the
    mode is entered): the same result, or the same refusal, as that kernel outside the mode."""
    from detkit.mode.aten import torch_grouped_mm

    args, kwargs, reason = _unsupported(device)[case]
    try:
        want, error = torch_grouped_mm(*args, **kwargs), None
    except RuntimeError as exc:  # torch refuses some of these itself: the mode must raise the same
        want, error = None, type(exc)
    with detkit.batch_invariant_mode():
        if error is None:
            assert_bits_equal(torch._grouped_mm(*args, **kwargs), want, f"{case}: torch's result")
        else:
            with pytest.raises(error):
                torch._grouped_mm(*args, **kwargs)
    (counted, calls), = counters()["not_routed"].items()
    assert counted.startswith(f"{OP}: {reason}") and calls == 1, counters()
    with pytest.raises(detkit.ModeNotRoutedError, match=f"{OP} cannot run on a detkit kernel: {reason}"), \
            detkit.batch_invariant_mode(strict=True):
        torch._grouped_mm(*args, **kwargs)


@pytest.mark.parametrize("kwargs, reason", [({"out_dtype": torch.float32}, "out_dtype float32"),
                                            ({"bias": "bias"}, "bias")])
def test_bias_and_out_dtype_are_refused_by_name(device, kwargs, reason):
    x, w = bf16_randn((8, 16), 11, device), bf16_randn((2, 16, 8), 12, device)
    if "bias" in kwargs:
        kwargs = {"bias": bf16_randn((2, 8), 13, device)}
    with pytest.raises(detkit.ModeNotRoutedError, match=f"{OP} cannot run on a detkit kernel: {reason}"), \
            detkit.batch_invariant_mode(strict=True):
        torch._grouped_mm(x, w, offs=offsets([3, 5], device), **kwargs)


def test_outside_the_mode_torch_runs_unseen(device):
    x, w = bf16_randn((8, 16), 14, device), bf16_randn((2, 16, 8), 15, device)
    offs = offsets([3, 5], device)
    with detkit.batch_invariant_mode():
        pass
    want = torch._grouped_mm(x, w, offs=offs)
    assert counters() == {"routed": {}, "not_routed": {}}
    assert_bits_equal(want[:8], torch._grouped_mm(x, w, offs=offs)[:8], "torch's kernel, twice")


# ---------------------------------------------------------------------------------------------
# A transformers MoE model whose experts run transformers' "grouped_mm" implementation (Mixtral)
# ---------------------------------------------------------------------------------------------
TINY = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=64, vocab_size=128, max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2)


def tiny_mixtral(device, seed: int = 0):
    transformers = pytest.importorskip("transformers", reason="transformers is the optional extra detkit[models]")
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**TINY)).to(torch.bfloat16)
    assert model.config._experts_implementation == "grouped_mm"
    return model.eval()


EXPERTS = "moe experts (transformers)"
# Inside the mode the model's experts run on detkit.mode.experts (tests/test_mode_experts.py): Mixtral's layout on the
# fused MoE layer. Its grouped GEMMs reach the aten route only when the experts run transformers' own implementation
# (expert parallelism: tests/test_mode_moe.py).
EXPERTS_KERNEL = "detkit.moe_mlp"


def experts_calls() -> int:
    routed = counters()["routed"]
    assert not any(k.startswith(OP) for k in [*routed, *counters()["not_routed"]]), counters()
    return routed[f"{EXPERTS} -> {EXPERTS_KERNEL}"]


def logprobs(model, ids, **kwargs):
    logits = model(input_ids=ids, use_cache=False, **kwargs).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


# gpt-oss's model-level runs (strict, log-probs alone vs in a batch, the backward repeating) are the family matrix's
# (tests/test_model_families.py: its every check on a tiny gpt-oss) and tests/test_mode_attention_variants.py's; its
# experts module's backward and batch invariance are tests/test_mode_experts.py's. Mixtral runs here.
def test_a_moe_models_log_probs_keep_their_bits_alone_and_in_a_batch(device):
    """Strict: nothing runs on torch (the experts on detkit's kernels); a sequence's log-probs alone and at position 1
    of a batch of 3 are bitwise equal."""
    model = tiny_mixtral(device, seed=1)
    seqs = torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.inference_mode(), detkit.batch_invariant_mode(strict=True):
        alone = logprobs(model, seqs[1:2])
        batch = logprobs(model, seqs)
    assert_bits_equal(batch[1:2], alone, "log-probs alone vs in a batch of 3")
    assert experts_calls() == 4  # 2 layers x 2 forwards
    assert counters()["not_routed"] == {}


def test_mixtral_padded_batch_prefill_and_decode_route_every_grouped_gemm(device):
    """The audit's path on a tiny Mixtral: a left-padded batch forward, then prefill + 3 KV-cache decode steps; every
    experts call routed, and the last decode step's log-probs equal the trainer's forward over the same tokens."""
    from transformers import DynamicCache

    model = tiny_mixtral(device, seed=3)
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(4)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.inference_mode(), detkit.batch_invariant_mode():
        model(input_ids=ids, attention_mask=mask)
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids[:1], past_key_values=cache, use_cache=True)
        tokens = ids[:1]
        for _ in range(3):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], 1)
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        trainer = model(input_ids=tokens, use_cache=False).logits[:, -1]
    assert_bits_equal(out.logits[:, -1], trainer, "last decode step vs the trainer's forward")
    assert experts_calls() == 2 * 6  # 2 layers x 6 forwards
    assert not any(k.startswith(EXPERTS) for k in counters()["not_routed"]), counters()


def test_a_moe_models_backward_runs_its_experts_on_detkit_and_repeats(device):
    """Training step: the experts' forward and backward run on detkit's kernels, and every parameter gradient
    repeats bitwise."""
    model = tiny_mixtral(device, seed=5)
    model.train()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(6)).to(device)

    def grads():
        model.zero_grad(set_to_none=True)
        with detkit.batch_invariant_mode():
            model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    first, second = grads(), grads()
    for name, g in first.items():
        assert_bits_equal(second[name], g, f"{name}.grad, two runs")
    assert experts_calls() == 2 * 2  # 2 runs x 2 layers
    assert not any(k.startswith(EXPERTS) for k in counters()["not_routed"]), counters()


# ---------------------------------------------------------------------------------------------
# The reductions transformers' experts and routers do around the grouped GEMMs, left on torch: measured here
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("h", [2048, 2880, 4096])
def test_torchs_combine_sum_keeps_a_tokens_bits_at_any_batch(device, k, h):
    """transformers' combine, ``weighted_out.view(T, K, H).sum(dim=1)`` in BF16, is left on torch: a token's row
    must have the same bits at T = 1 and inside batches of 7, 64 and 4096 tokens (torch's reduction over a non-last
    dim picks its block shape from K and the output count; this checks that the order per output stays put)."""
    rows = bf16_randn((4096, k, h), 20 + k, device)
    want = {t: rows[t:t + 1].sum(dim=1) for t in (0, 3, 4095)}
    for batch in (7, 64, 4096):
        got = rows[:batch].sum(dim=1)
        for t, w in want.items():
            if t < batch:
                assert_bits_equal(got[t:t + 1], w, f"K={k} H={h}: token {t} alone vs in a batch of {batch}")


@pytest.mark.gpu
@pytest.mark.parametrize("k", [2, 4, 8])
def test_torchs_router_normalisation_keeps_a_tokens_bits_at_any_batch(device, k):
    """Mixtral's / gpt-oss's ``w / w.sum(dim=-1, keepdim=True)`` over the top-k weights (FP32 and BF16), left on torch:
    a token's normalised weights alone vs in batches of 7, 64 and 8192 tokens."""
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.rand(8192, k, generator=torch.Generator().manual_seed(k)).to(device=device, dtype=dtype)
        alone = w[5:6] / w[5:6].sum(dim=-1, keepdim=True)
        for batch in (7, 64, 8192):
            got = w[:batch] / w[:batch].sum(dim=-1, keepdim=True)
            assert_bits_equal(got[5:6], alone, f"K={k} {dtype}: token 5 alone vs in a batch of {batch}")
