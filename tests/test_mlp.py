"""kernels/parallel/mlp.py: the complete Qwen3 MLP as a torch.autograd.Function / nn.Module (TP=1, CP=1, one
process) against the pure-torch FP64 reference within the MLP contract (``mlp_bounds``,
docs/invariance.md "MLP contract"), in both modes; the contract catches a wrong weight order; the
module is deterministic and fails closed. The TP=2 / CP=2 configs run in tests/test_invariance.py."""

from __future__ import annotations

import pytest
import torch

from detkit.kernels.parallel.invariant import MODES
from detkit.kernels.parallel.mlp import DetQwen3MLP, MlpPlan, mlp_bounds, mlp_ref_fp64, shard_weights, split_gate_up
from detkit.toolkit.contract import check_bound, compare_bits
from detkit.toolkit.layout import TINY, TpCpLayout, layout_for_preset
from detkit.toolkit.shard_refs import make_fixtures

SEED = 1234
TENSORS = ("y", "dx", "dw_gate", "dw_up", "dw_down")


def run_mlp(layout, mode, device, swap=False):
    t = make_fixtures(layout, SEED, device).tensors
    plan = MlpPlan(layout, mode=mode)
    w_gate, w_up = (t["w_up"], t["w_gate"]) if swap else (t["w_gate"], t["w_up"])
    module = DetQwen3MLP.from_global(w_gate, w_up, t["w_down"], plan)
    x = t["x"].detach().clone().requires_grad_(True)
    y = module(x)
    y.backward(t["d_out"])
    dw_gate, dw_up = split_gate_up(module.w_gate_up.grad, plan)
    out = {"y": y.detach(), "dx": x.grad, "dw_gate": dw_gate, "dw_up": dw_up, "dw_down": module.w_down.grad}
    return out, t


@pytest.mark.parametrize(("layout", "mode"), [(layout_for_preset("tiny"), m) for m in MODES]
                         + [(TpCpLayout(TINY, 1, 14), "fp32_invariant")], ids=[*MODES, "B1_S14-fp32_invariant"])
def test_autograd_within_the_fp64_contract(device, mode, layout):
    out, t = run_mlp(layout, mode, device)
    args = [t[n].cpu() for n in ("x", "w_gate", "w_up", "w_down", "d_out")]
    ref = mlp_ref_fp64(*args)
    bounds = mlp_bounds(*args, ref)
    for name in TENSORS:
        assert out[name].dtype == torch.bfloat16 and out[name].shape == ref[name].shape, name
        result = check_bound(out[name].cpu(), ref[name], bounds[name])
        assert result.passed, f"{name}: {result}"


def test_the_contract_catches_swapped_gate_and_up(device):
    layout = layout_for_preset("tiny")
    out, t = run_mlp(layout, "fp32_invariant", device, swap=True)
    args = [t[n].cpu() for n in ("x", "w_gate", "w_up", "w_down", "d_out")]
    bounds = mlp_bounds(*args)
    ref = mlp_ref_fp64(*args)
    assert not check_bound(out["y"].cpu(), ref["y"], bounds["y"]).passed


def test_repeatable(device):
    layout = layout_for_preset("tiny")
    first, t = run_mlp(layout, "fp32_invariant", device)
    second, _ = run_mlp(layout, "fp32_invariant", device)
    for name in TENSORS:
        assert compare_bits(first[name], second[name]).equal, name


def test_gate_up_buffer_layout():
    """Rows [gate I_0; up I_0; gate I_1; up I_1] at TP=1; [gate I_t; up I_t] at TP=2; split back."""
    layout = layout_for_preset("tiny")
    i, h, i_l = layout.model.intermediate_size, layout.model.hidden_size, layout.i_local
    w_gate = torch.arange(i * h, dtype=torch.float32).reshape(i, h).to(torch.bfloat16)
    w_up = -w_gate
    w_down = torch.zeros(h, i, dtype=torch.bfloat16)
    plan = MlpPlan(layout)
    gu, _ = shard_weights(w_gate, w_up, w_down, plan)
    assert torch.equal(gu[:i_l], w_gate[:i_l]) and torch.equal(gu[i_l:2 * i_l], w_up[:i_l])
    assert torch.equal(gu[2 * i_l:3 * i_l], w_gate[i_l:])
    g, u = split_gate_up(gu, plan)
    assert torch.equal(g, w_gate) and torch.equal(u, w_up)


def test_fails_closed_on_shapes(device):
    layout = layout_for_preset("tiny")
    t = make_fixtures(layout, SEED, device).tensors
    module = DetQwen3MLP.from_global(t["w_gate"], t["w_up"], t["w_down"], MlpPlan(layout))
    with pytest.raises(ValueError, match=r"mlp TP1CP1: x has shape \(6, 64\); the plan's local shapes"):
        module(layout.shard_rows(t["x"], 0))
    with pytest.raises(TypeError, match="x has dtype torch.float32"):
        module(t["x"].float())


def test_tp2_plan_refuses_an_uninitialised_group_before_any_work(device):
    import torch.distributed as dist

    from detkit.kernels.parallel import operators as parallel
    from detkit.toolkit.layout import AxisGroup

    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this pytest process")
    layout = layout_for_preset("tiny")
    t = make_fixtures(layout, SEED, device).tensors
    plan = MlpPlan(layout, tp=2, tp_rank=1, tp_group=AxisGroup(layout, "tp", (0, 1)), mode="fp32_invariant")
    module = DetQwen3MLP.from_global(t["w_gate"], t["w_up"], t["w_down"], plan)
    before = parallel.operator_calls()
    with pytest.raises(RuntimeError, match="mlp_fwd: the default process group is not initialised"):
        module(t["x"])
    assert parallel.operator_calls() == before
