"""detkit mode on FP32 and FP16 GEMMs and on means whose leading dims do not view as one row dim.

FP32 mm / addmm / bmm / baddbmm run on det_gemm's FP32 path (counted as "det_gemm_<op> fp32 <precision>", the
precision read from torch's own CUDA matmul setting at the call), forward and backward, with the bits of the det_gemm
call they name; FP16 ones likewise ("det_gemm_<op> fp16"); torch.mm rows keep their bits for M=1 and M=32 with a
transposed weight (Thinking Machines' batch-invariance test, FP32, BF16, FP16); a tiny Llama with an FP32 lm_head runs
with nothing unrouted under strict; other dtypes (FP64) are refused by name. ``mean.dim`` over the last dim of a
transposed [B, H, S, D] tensor (Gemma-3's q/k norms) runs on the row mean with the bits of the contiguous case. CPU
tensors under the Triton interpreter (conftest); CUDA sm_90 with DETKIT_TEST_DEVICE=cuda."""

from __future__ import annotations

import pytest
import torch

import detkit
from detkit.kernels.det_gemm.launch import det_gemm_da, det_gemm_db, det_gemm_fwd
from detkit.kernels.reductions import row_mean, row_mean_ref
from detkit.mode import gemm as mode_gemm
from detkit.toolkit.contract import U_FP32, check_bound, compare_bits, gamma, gemm_bound_fp32

F64_REASON = "dtype float64 (det_gemm takes bfloat16, float16 or float32 operands, one dtype)"


def assert_bits(got, want, what=""):
    result = compare_bits(got, want)
    assert result.equal, f"{what}: {result}"


def f32_randn(shape, seed, device, scale=1.0) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(device)


def counts() -> dict:
    return detkit.mode_counters().as_dict()


@pytest.fixture(autouse=True)
def _fresh_counters():
    detkit.reset_mode_counters()
    yield
    assert not detkit.is_batch_invariant_mode_enabled(), "a test left the mode entered"


@pytest.fixture
def tf32_matmuls():
    """torch's FP32 CUDA matmuls allowed TF32 for the test (``set_float32_matmul_precision("high")``), restored."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(before)


# ---- GEMMs --------------------------------------------------------------------------------------
def test_fp32_linear_forward_and_backward_run_the_named_fp32_ops(device):
    torch.manual_seed(3)
    layer = torch.nn.Linear(48, 40, bias=False).to(device)
    x = f32_randn((7, 48), 1, device).requires_grad_()
    with detkit.batch_invariant_mode(strict=True):
        y = layer(x)
        y.backward(f32_randn((7, 40), 2, device))
    w = layer.weight.detach()
    assert_bits(y, det_gemm_fwd(x.detach(), w.t()), "forward")
    g = f32_randn((7, 40), 2, device)
    assert_bits(x.grad, det_gemm_da(g, w.t()), "grad_input")
    assert_bits(layer.weight.grad, det_gemm_db(g, x.detach()), "grad_weight")
    assert counts() == {"routed": {"mm -> det_gemm_fwd fp32 ieee": 1, "mm -> det_gemm_da fp32 ieee": 1,
                                   "mm -> det_gemm_db fp32 ieee": 1}, "not_routed": {}}


def test_fp16_linear_forward_and_backward_run_the_named_fp16_ops(device):
    torch.manual_seed(4)
    layer = torch.nn.Linear(48, 40).to(device=device, dtype=torch.float16)
    x = f32_randn((7, 48), 3, device).half().requires_grad_()
    g = f32_randn((7, 40), 4, device).half()
    with detkit.batch_invariant_mode(strict=True):
        y = layer(x)
        y.backward(g)
    w = layer.weight.detach()
    assert_bits(y, det_gemm_fwd(x.detach(), w.t()) + layer.bias.detach(), "forward: FP16 product, then + bias")
    assert_bits(x.grad, det_gemm_da(g, w.t()), "grad_input")
    assert_bits(layer.weight.grad, det_gemm_db(g, x.detach()), "grad_weight")
    assert counts()["routed"] == {"addmm -> det_gemm_fwd fp16": 1, "mm -> det_gemm_da fp16": 1,
                                  "mm -> det_gemm_db fp16": 1}
    assert counts()["not_routed"] == {}


def test_fp32_matmul_is_within_the_fp32_contract(device):
    a, b = f32_randn((9, 200), 3, device), f32_randn((200, 24), 4, device)
    with detkit.batch_invariant_mode(strict=True):
        c = a @ b
    c_star = a.double().cpu() @ b.double().cpu()
    abs_ab = a.double().abs().cpu() @ b.double().abs().cpu()
    assert check_bound(c.cpu(), c_star, gemm_bound_fp32(c_star, abs_ab, 200)).passed


def test_fp32_addmm_bmm_baddbmm(device):
    a, w, bias = f32_randn((6, 32), 5, device), f32_randn((16, 32), 6, device), f32_randn((16,), 7, device)
    a3, b3 = f32_randn((3, 5, 32), 8, device), f32_randn((3, 32, 4), 9, device)
    bias3 = f32_randn((3, 5, 4), 10, device)
    with detkit.batch_invariant_mode(strict=True):
        lin = torch.addmm(bias, a, w.t())
        bmm = torch.bmm(a3, b3)
        baddbmm = torch.baddbmm(bias3, a3, b3)
    assert_bits(lin, det_gemm_fwd(a, w.t()) + bias, "addmm: the FP32 product, then + bias in FP32")
    want = torch.stack([det_gemm_da(x, y.t()) for x, y in zip(a3, b3)])
    assert_bits(bmm, want, "bmm: one det_gemm per element")
    assert_bits(baddbmm, want + bias3, "baddbmm")
    assert counts()["routed"] == {"addmm -> det_gemm_fwd fp32 ieee": 1, "bmm -> det_gemm_da fp32 ieee": 1,
                                  "baddbmm -> det_gemm_da fp32 ieee": 1}


def test_torch_tf32_setting_gives_tf32_products_counted_by_name(device, tf32_matmuls):
    a, w = f32_randn((5, 64), 11, device), f32_randn((24, 64), 12, device)
    assert mode_gemm.fp32_products() == "tf32"
    with detkit.batch_invariant_mode(strict=True):
        got = a @ w.t()
    assert_bits(got, det_gemm_fwd(a, w.t(), "tf32"), "tf32 products")
    assert compare_bits(got, det_gemm_fwd(a, w.t(), "ieee")).mismatches > 0, "tf32 must not be the ieee result"
    assert counts()["routed"] == {"mm -> det_gemm_fwd fp32 tf32": 1}


def test_the_precision_is_read_per_call_not_per_signature(device):
    a, w = f32_randn((5, 64), 13, device), f32_randn((24, 64), 14, device)
    before = torch.get_float32_matmul_precision()
    with detkit.batch_invariant_mode(strict=True):
        ieee = a @ w.t()
        torch.set_float32_matmul_precision("high")
        try:
            tf32 = a @ w.t()
        finally:
            torch.set_float32_matmul_precision(before)
        again = a @ w.t()
    assert_bits(ieee, again, "ieee before and after")
    assert_bits(tf32, det_gemm_fwd(a, w.t(), "tf32"), "tf32 in between")
    assert counts()["routed"] == {"mm -> det_gemm_fwd fp32 ieee": 2, "mm -> det_gemm_fwd fp32 tf32": 1}


def test_thinking_machines_batch_invariance_fp32(device):
    """Their test_batch_invariance.py: torch.mm of the first row alone vs in a batch of 32, transposed weight, FP32
    (and BF16): bitwise equal under the mode."""
    b_size, d = 32, 96
    for dtype, scale in ((torch.float32, 100.0), (torch.bfloat16, 100.0), (torch.float16, 1.0)):  # FP16: no inf
        a = torch.linspace(-scale, scale, b_size * d, device=device).reshape(b_size, d).to(dtype)
        b = torch.linspace(-scale, scale, d * d, device=device).reshape(d, d).to(dtype)
        with detkit.batch_invariant_mode(strict=True):
            out1 = torch.mm(a[:1], b.t())
            out2 = torch.mm(a, b.t())[:1]
        assert_bits(out1, out2, f"M=1 vs M=32, {dtype}")


def test_other_dtypes_are_refused_by_name(device):
    a = f32_randn((4, 8), 15, device).double()
    with detkit.batch_invariant_mode():
        a @ a.t()
    assert counts()["not_routed"] == {f"mm: {F64_REASON}": 1}
    with pytest.raises(detkit.ModeNotRoutedError, match=r"^batch_invariant_mode\(strict=True\): mm cannot run on a "
                                                          r"detkit kernel: dtype float64 \(det_gemm takes"), \
            detkit.batch_invariant_mode(strict=True):
        a @ a.t()
    with pytest.raises(detkit.ModeNotRoutedError, match=r"dtype bfloat16/float32"), \
            detkit.batch_invariant_mode(strict=True):
        torch.mm(a.float(), a.t().bfloat16())


def test_a_tiny_llama_with_an_fp32_lm_head_runs_with_nothing_unrouted(device):
    """A BF16 Llama whose lm_head is FP32 (its input cast up, as RL trainers do for the log-probs): forward and
    backward under strict, the lm_head's three GEMMs on the FP32 path; a row's log-probs keep their bits in a batch."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=128, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=64, vocab_size=256, num_hidden_layers=1,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.lm_head.float()
    model.lm_head.register_forward_pre_hook(lambda module, args: (args[0].float(),))
    ids = torch.randint(3, 256, (3, 6), generator=torch.Generator().manual_seed(1)).to(device)

    def logprobs(batch):
        logits = model(input_ids=batch).logits
        assert logits.dtype == torch.float32
        return torch.log_softmax(logits, -1).gather(-1, batch[..., None])[..., 0]

    with detkit.batch_invariant_mode(strict=True):
        lp = logprobs(ids)
        lp.sum().backward()
        with torch.no_grad():
            alone = logprobs(ids[1:2])
    assert_bits(alone, lp[1:2].detach(), "a sequence alone vs in a batch of 3")
    routed = counts()["routed"]
    assert counts()["not_routed"] == {}
    assert routed["mm -> det_gemm_fwd fp32 ieee"] == 2
    assert routed["mm -> det_gemm_da fp32 ieee"] == 1 and routed["mm -> det_gemm_db fp32 ieee"] == 1


# ---- mean.dim over leading dims that do not view as one -----------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mean_over_a_transposed_tensor_has_the_contiguous_bits(device, dtype):
    """Gemma-3's q/k norms: RMSNorm's mean over the last dim of a [B, H, S, D] transpose of [B, S, H, D] (its leading
    dims do not view as one row dim) runs on the row mean, each row with the bits it has in a contiguous tensor,
    the output laid out as torch's."""
    x = f32_randn((2, 5, 3, 40), 16, device).to(dtype).transpose(1, 2)  # [2, 3, 5, 40], strides (600, 40, 120, 1)
    with pytest.raises(RuntimeError):
        x.view(-1, 40)
    with detkit.batch_invariant_mode(strict=True):
        got = x.pow(2).mean(-1, keepdim=True)
        flat = x.mean(-1)
    want = row_mean(x.pow(2).contiguous().view(-1, 40)).view(2, 3, 5, 1)
    assert_bits(got, want, "keepdim: transposed vs contiguous")
    assert_bits(flat, row_mean(x.contiguous().view(-1, 40)).view(2, 3, 5), "no keepdim")
    assert got.stride() == x.pow(2).mean(-1, keepdim=True).stride() and got.dtype == dtype
    ref = row_mean_ref(x.cpu())
    u_out = 2.0**-8 if dtype == torch.bfloat16 else U_FP32
    bound = (gamma(40) * x.double().abs().sum(-1).cpu() / 40 + U_FP32 * ref.abs()) * (1 + u_out) + u_out * ref.abs()
    assert check_bound(flat.cpu(), ref, bound).passed
    assert counts() == {"routed": {"mean.dim -> row_mean": 2}, "not_routed": {}}


def test_mean_rows_keep_their_bits_in_any_leading_layout(device):
    """Three leading stride groups (a permuted 4-D tensor) and a sliced one: each row's bits are those of the same
    row in a contiguous copy."""
    base = f32_randn((3, 4, 5, 24), 17, device)
    for x in (base.permute(2, 0, 1, 3), base[:, 1:3].transpose(0, 1), base[..., :16]):
        with detkit.batch_invariant_mode(strict=True):
            got = x.mean(-1)
        assert_bits(got, row_mean(x.contiguous().view(-1, x.shape[-1])).view(x.shape[:-1]),
                    f"shape {tuple(x.shape)} strides {x.stride()}")


def test_mean_over_four_stride_groups_is_refused_by_name(device):
    x = f32_randn((2, 3, 4, 5, 8), 18, device).permute(3, 1, 0, 2, 4)
    with detkit.batch_invariant_mode():
        got = x.mean(-1)
    assert_bits(got, x.mean(-1), "on torch")
    (reason,) = counts()["not_routed"]
    assert reason.startswith("mean.dim: leading dims (5, 3, 2, 4) with strides") and "form 4 stride groups" in reason


# ---- torch.compile ---------------------------------------------------------------------------------
def test_a_compiled_fp32_linear_chain_has_the_eager_bits(device):
    """Inductor's graph runs FP32 GEMMs on detkit::mode_* ops: forward and backward with the eager mode's bits, the
    same FP32 route names."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.Linear(64, 32, bias=False)).to(device)
    x, dy = f32_randn((2, 9, 48), 19, device), f32_randn((2, 9, 32), 20, device)

    def run(fn):
        xx = x.clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        y = fn(xx)
        y.backward(dy)
        # the bias gradient is a sum over the batch rows, Inductor's own reduction in the graph (docs/mode.md: not
        # overridden), so it is left out of the comparison
        return [y.detach(), xx.grad, model[0].weight.grad, model[1].weight.grad]

    with detkit.batch_invariant_mode(strict=True):
        eager = run(model)
        compiled_model = torch.compile(model)
        run(compiled_model)  # compiles: Inductor may call the ops while it builds the graph (it does on CUDA)
        detkit.reset_mode_counters()
        compiled = run(compiled_model)
    for i, (got, want) in enumerate(zip(compiled, eager)):
        assert_bits(got, want, f"tensor {i}")
    routed = counts()["routed"]
    assert routed.get("addmm -> det_gemm_fwd fp32 ieee") == 1 and routed.get("mm -> det_gemm_fwd fp32 ieee") == 1
    assert counts()["not_routed"] == {}
    torch._dynamo.reset()


# ---- Gemma-3: its norms' means over transposed q / k ---------------------------------------------
def _gemma3(device, layer_types):
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(hidden_size=128, intermediate_size=128, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=64, vocab_size=256,
                                           num_hidden_layers=len(layer_types), max_position_embeddings=64,
                                           sliding_window=4, layer_types=layer_types)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.Gemma3ForCausalLM(config).to(torch.bfloat16)


def test_gemma3_log_probs_are_fully_routed_and_batch_invariant(device):
    """A tiny Gemma-3 with full-attention layers: forward and backward under strict (its q/k norms' means over
    [B, H, S, D] transposes included), a sequence's log-probs bitwise alone and in a batch of 3. A sliding-window
    layer is routed too (detkit's attention takes the window)."""
    model = _gemma3(device, ["full_attention"])
    ids = torch.randint(3, 256, (3, 6), generator=torch.Generator().manual_seed(2)).to(device)
    with detkit.batch_invariant_mode(strict=True):
        lp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
        lp.sum().backward()
        with torch.no_grad():
            alone = torch.log_softmax(model(input_ids=ids[1:2]).logits.float(), -1)
    assert_bits(alone, lp[1:2].detach(), "a sequence alone vs in a batch of 3")
    assert counts()["not_routed"] == {}
    # per forward: the layer's input, q, k, post-attention, pre- and post-feedforward norms, then the final norm; the
    # forward with grad on runs Gemma's RMSNorm ops, the one under no_grad the fused kernel (the same bits: above)
    assert counts()["routed"]["mean.dim -> row_mean"] == 7
    assert counts()["routed"]["rms_norm (transformers) -> fused_rms_norm"] == 7
    detkit.reset_mode_counters()
    sliding = _gemma3(device, ["sliding_attention"])
    with detkit.batch_invariant_mode(strict=True), torch.no_grad():
        sliding(input_ids=ids)
    assert counts()["not_routed"] == {}
    assert sum(n for name, n in counts()["routed"].items() if name.startswith("attention")) == 1
