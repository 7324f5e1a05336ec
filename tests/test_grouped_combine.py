"""The grouped path's route combine kernels (kernels/grouped/combine.py) against their torch references: the combine
and the gather's backward bit for bit (the same FP32 operations in the same order), the combine's backward dy bit for
bit and dw within the FP32 summation bound of an FP64 sum; a token alone equal to the token in a batch, bit for bit;
refusals."""

from __future__ import annotations

import pytest
import torch

from detkit.kernels.bounds import gamma
from detkit.kernels.grouped.combine import route_combine, route_combine_bwd, route_sum
from detkit.kernels.grouped.reference import route_combine_bwd_ref, route_combine_ref, route_sum_ref


def _case(tokens, top_k, hidden, device, seed=0, weights_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    inverse = torch.randperm(tokens * top_k, generator=gen).view(tokens, top_k)  # sorted row of each route
    y = torch.randn(tokens * top_k, hidden, generator=gen).to(torch.bfloat16)
    weights = torch.rand(tokens, top_k, generator=gen).to(weights_dtype)
    dout = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    return y.to(device), inverse.to(device), weights.to(device), dout.to(device)


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_combine_and_route_sum_equal_the_reference_bit_for_bit(weights_dtype, device):
    y, inverse, weights, _ = _case(13, 4, 300, device, weights_dtype=weights_dtype)
    out = route_combine(y, inverse, weights)
    assert out.dtype == torch.bfloat16 and out.shape == (13, 300)
    assert torch.equal(out, route_combine_ref(y, inverse, weights))
    assert torch.equal(route_sum(y, inverse.int()), route_sum_ref(y, inverse))
    # The mode's unfused form of the same math (its former combine) gives the same bits.
    from detkit.mode.experts import fixed_order_combine

    assert torch.equal(out, fixed_order_combine(y[inverse].view(13, 4, 300), weights))


def test_combine_backward_dy_bitwise_and_dw_within_the_fp32_bound(device):
    y, inverse, weights, dout = _case(11, 3, 530, device, seed=1)
    dy, dw = route_combine_bwd(dout, y, inverse, weights)
    dy_ref, dw_ref = route_combine_bwd_ref(dout, y, inverse, weights)
    assert torch.equal(dy, dy_ref) and dw.dtype == torch.float32
    magnitude = (dout.double()[:, None, :] * y[inverse].double()).abs().sum(-1)
    assert bool(((dw.double() - dw_ref.double()).abs() <= gamma(530) * magnitude + 2 * 2.0**-24 * dw_ref.abs()).all())
    # Through autograd: the same gradients, and those of the unfused torch form within the same bound.
    yl, wl = y.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    dy2, dw2 = torch.autograd.grad(route_combine(yl, inverse, wl), (yl, wl), dout)
    assert torch.equal(dy2, dy) and torch.equal(dw2, dw)
    from detkit.mode.experts import fixed_order_combine

    yt, wt = y.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    dy3, dw3 = torch.autograd.grad(fixed_order_combine(yt[inverse], wt), (yt, wt), dout)
    assert torch.equal(dy3, dy)
    assert bool(((dw3.double() - dw.double()).abs() <= 2 * gamma(530) * magnitude).all())


def test_a_token_alone_gives_the_bits_it_gets_in_a_batch(device):
    y, inverse, weights, dout = _case(9, 2, 200, device, seed=2)
    out = route_combine(y, inverse, weights)
    dy, dw = route_combine_bwd(dout, y, inverse, weights)
    dsum = route_sum(y, inverse)
    for t in (0, 4, 8):
        rows = inverse[t:t + 1].reshape(-1)
        alone_inverse = torch.arange(2, device=device).view(1, 2)
        alone_y = y[rows]
        assert torch.equal(route_combine(alone_y, alone_inverse, weights[t:t + 1]), out[t:t + 1])
        assert torch.equal(route_sum(alone_y, alone_inverse), dsum[t:t + 1])
        dy_t, dw_t = route_combine_bwd(dout[t:t + 1], alone_y, alone_inverse, weights[t:t + 1])
        assert torch.equal(dy_t, dy[rows]) and torch.equal(dw_t, dw[t:t + 1])


def test_refusals_name_the_value(device):
    y, inverse, weights, dout = _case(4, 2, 16, device)
    with pytest.raises(ValueError, match="y must be a bfloat16"):
        route_combine(y.float(), inverse, weights)
    with pytest.raises(ValueError, match="T \\* K = 8 rows of y"):
        route_combine(y, inverse[:3], weights[:3])
    with pytest.raises(ValueError, match="weights must be a bfloat16 or float32 \\(4, 2\\)"):
        route_combine(y, inverse, weights.double())
    with pytest.raises(ValueError, match="dout must be bfloat16 \\[4, 16\\]"):
        route_combine_bwd(dout[:, :8], y, inverse, weights)
