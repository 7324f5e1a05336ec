"""gpt-oss's clamped SwiGLU kernels (kernels/grouped/gates.py) against their torch reference and transformers' own
``_apply_gate`` (in FP64): forward and backward, values beyond the clamp limits on both sides, rows alone equal to
rows in a batch bit for bit, and refusals."""

from __future__ import annotations

import pytest
import torch

from detkit.kernels.grouped.gates import clamped_swiglu, clamped_swiglu_bwd, clamped_swiglu_fwd
from detkit.kernels.grouped.reference import clamped_swiglu_bwd_ref, clamped_swiglu_ref
from detkit.toolkit.contract import bf16_ordinal

ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's swiglu_alpha and swiglu_limit


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in BF16 units in the last place between two BF16 tensors of finite values."""
    return int((bf16_ordinal(a) - bf16_ordinal(b)).abs().max())


def _inputs(rows, cols, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2 * cols, generator=gen) * 6).to(torch.bfloat16)  # many values past +-7 on both sides
    x[0, :4] = torch.tensor([LIMIT, LIMIT, -LIMIT, -LIMIT])  # the bounds themselves
    dout = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    return x.to(device), dout.to(device)


def _transformers_gate_fp64(x: torch.Tensor, dout: torch.Tensor):
    """transformers' GptOssExperts._apply_gate in FP64 (its code, run on a stub holding alpha and limit)."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

    class Stub:
        alpha, limit = ALPHA, LIMIT

    xd = x.double().cpu().requires_grad_(True)
    out = gpt_oss.GptOssExperts._apply_gate(Stub(), xd)
    (dx,) = torch.autograd.grad(out, xd, dout.double().cpu())
    return out.detach(), dx


def test_forward_and_backward_match_the_reference_and_transformers(device):
    x, dout = _inputs(37, 150, device)
    out, dx = clamped_swiglu_fwd(x, ALPHA, LIMIT), clamped_swiglu_bwd(x, dout, ALPHA, LIMIT)
    assert out.dtype == dx.dtype == torch.bfloat16 and out.shape == (37, 150) and dx.shape == (37, 300)
    # FP32 math rounded once on both sides; exp differs between the kernel and torch in its last FP32 bits only.
    assert _ulps(out, clamped_swiglu_ref(x, ALPHA, LIMIT)) <= 1
    assert _ulps(dx, clamped_swiglu_bwd_ref(x, dout, ALPHA, LIMIT)) <= 1
    # transformers' own gate in FP64: within one BF16 rounding (and FP32 arithmetic) of the exact value.
    out64, dx64 = _transformers_gate_fp64(x, dout)
    for ours, exact in ((out, out64), (dx, dx64)):
        err = (ours.double().cpu() - exact).abs()
        assert bool((err <= exact.abs() * 2.0**-8 * 1.01 + 1e-30 + exact.abs().max() * 2.0**-20).all())
    # Outside the clamp limits the gradient is zero where torch's clamp gives zero.
    assert bool((dx[:, 0::2][x[:, 0::2] > LIMIT] == 0).all())
    assert bool((dx[:, 1::2][x[:, 1::2].abs() > LIMIT] == 0).all())


def test_autograd_and_rows_alone_equal_rows_in_a_batch(device):
    x, dout = _inputs(24, 64, device, seed=3)
    leaf = x.clone().requires_grad_(True)
    out = clamped_swiglu(leaf, ALPHA, LIMIT)
    (dx,) = torch.autograd.grad(out, leaf, dout)
    assert torch.equal(out, clamped_swiglu_fwd(x, ALPHA, LIMIT))
    assert torch.equal(dx, clamped_swiglu_bwd(x, dout, ALPHA, LIMIT))
    for r in (0, 5, 23):  # one row alone: the same bits as in the batch
        assert torch.equal(clamped_swiglu_fwd(x[r:r + 1], ALPHA, LIMIT), out[r:r + 1])
        assert torch.equal(clamped_swiglu_bwd(x[r:r + 1], dout[r:r + 1], ALPHA, LIMIT), dx[r:r + 1])
    empty = clamped_swiglu_fwd(x[:0], ALPHA, LIMIT)
    assert empty.shape == (0, 64)


def test_refusals_name_the_value(device):
    x, dout = _inputs(4, 8, device)
    with pytest.raises(ValueError, match="bfloat16 \\[R, 2I\\]"):
        clamped_swiglu_fwd(x.float(), ALPHA, LIMIT)
    with pytest.raises(ValueError, match="bfloat16 \\[R, 2I\\]"):
        clamped_swiglu_fwd(x[:, :15], ALPHA, LIMIT)
    with pytest.raises(ValueError, match="last dim contiguous"):
        clamped_swiglu_fwd(x.t().contiguous().t(), ALPHA, LIMIT)
    with pytest.raises(ValueError, match="limit must be a real number; got 'x'"):
        clamped_swiglu_fwd(x, ALPHA, "x")
    with pytest.raises(ValueError, match="dout must be bfloat16 \\[4, 8\\]"):
        clamped_swiglu_bwd(x, dout[:, :7], ALPHA, LIMIT)


def test_the_mode_fuses_gpt_oss_own_gate_only(device):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    from detkit.mode.experts import _fused_gate

    config = transformers.GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=2, num_experts_per_tok=1)
    module = m.GptOssExperts(config)
    gate = _fused_gate(module)
    assert gate is not None
    x, _ = _inputs(5, 8, device)
    assert torch.equal(gate(x), clamped_swiglu_fwd(x, module.alpha, module.limit))

    class OwnGate(m.GptOssExperts):
        def _apply_gate(self, gate_up):
            return super()._apply_gate(gate_up) * 2

    assert _fused_gate(OwnGate(config)) is None  # a subclass's own gate runs as its own code
    module.limit = "7"
    assert _fused_gate(module) is None


def test_add_expert_bias_equals_torch_bit_for_bit(device):
    gen = torch.Generator().manual_seed(7)
    out = torch.randn(29, 70, generator=gen).to(torch.bfloat16).to(device)
    bias = torch.randn(5, 70, generator=gen).to(torch.bfloat16).to(device)
    ids = torch.randint(0, 5, (29,), generator=gen).to(device)
    expected = out.clone().add_(bias[ids])
    from detkit.kernels.grouped.gates import add_expert_bias

    got = out.clone()
    assert add_expert_bias(got, bias, ids.int()) is got and torch.equal(got, expected)
    with pytest.raises(ValueError, match="bias must be a bfloat16 \\[E, 70\\]"):
        add_expert_bias(out.clone(), bias[:, :69], ids)
    with pytest.raises(ValueError, match="ids must be an integer \\[29\\]"):
        add_expert_bias(out.clone(), bias, ids[:28])
