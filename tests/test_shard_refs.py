"""toolkit/shard_refs.py on the tiny layout (Triton interpreter): the references themselves, and the
checks the tp-cp-refs suite runs, including that they fail on a wrong reduction."""

from __future__ import annotations

import os

import pytest
import torch

from detkit.kernels.det_gemm.launch import det_gemm_fwd
from detkit.toolkit.contract import compare_bits
from detkit.toolkit.layout import CP_SIZE, TpCpLayout, layout_for_preset
from detkit.toolkit.shard_refs import (
    SPECS, check_all, check_spec, local_inputs, local_result, make_fixtures, operand, oracle,
    oracle_is_exact, reduce_v1, reduced_result,
)

SEED = 1234
# tests/conftest.py: cpu (Triton interpreter, the default) or cuda (DETKIT_TEST_DEVICE=cuda)
DEVICE = torch.device(os.environ.get("DETKIT_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="module")
def layout() -> TpCpLayout:
    return layout_for_preset("tiny")


@pytest.fixture(scope="module")
def all_checks(layout):
    return list(check_all(layout, SEED, DEVICE))


def test_every_reference_check_passes(all_checks):
    failed = [(c.check, c.name, c.details) for c in all_checks if not c.passed]
    assert not failed


def test_reference_checks_cover_every_spec_and_kind(all_checks):
    names = " ".join(c.name for c in all_checks)
    for spec in SPECS:
        for kind in ("randn", "exact"):
            assert f"{spec} [" in names and f" {kind}" in names
    checks = {c.check for c in all_checks}
    assert {"tp1_equal", "contract", "v1_order_free", "contract_partial", "contract_reduced", "exact_oracle",
            "exact_oracle_partial", "exact_oracle_reduced", "token_order", "token_roundtrip"} <= checks


def test_fixtures_are_seeded_and_independent(layout):
    a = make_fixtures(layout, SEED)
    b = make_fixtures(layout, SEED)
    c = make_fixtures(layout, SEED + 1)
    for name, t in a.tensors.items():
        assert compare_bits(t, b.tensors[name]).equal
        assert not torch.equal(t, c.tensors[name])
    assert not torch.equal(a.tensors["d_gate"], a.tensors["d_up"])


def test_local_inputs_have_the_configured_shapes(layout):
    fx = make_fixtures(layout, SEED)
    shapes = layout.local_shapes()
    for r in range(4):
        loc = local_inputs(fx, r)
        for name, want in shapes.items():
            assert tuple(loc[name].shape) == want, (r, name)
    # nn.Linear storage: the local weight is the .t() view of a contiguous [out, in] shard
    w = local_inputs(fx, 1)["w_gate"]
    assert w.t().is_contiguous() and torch.equal(w, fx.weight_kn("w_gate")[:, layout.i_shard(1)])
    w = local_inputs(fx, 1)["w_down"]
    assert w.t().is_contiguous() and torch.equal(w, fx.weight_kn("w_down")[layout.i_shard(1)])


def test_gate_shards_concatenate_to_the_tp1_result(layout):
    fx = make_fixtures(layout, SEED, DEVICE)
    spec = SPECS["gate_fwd"]
    full = det_gemm_fwd(operand(fx, "x", None, None), fx.weight_kn("w_gate"))
    for cp in range(CP_SIZE):
        shards = [local_result(spec, fx, layout.layout_rank(cp, tp))[0] for tp in range(2)]
        want = full.index_select(0, layout.global_rows(cp, DEVICE))
        assert compare_bits(torch.cat(shards, dim=1), want).equal


def test_reduce_v1_is_one_fp32_add_and_one_rounding():
    # 1 + 2**-8 is not a BF16 value: the FP32 sum is exact, the BF16 rounding goes to even (1.0)
    p0 = torch.tensor([1.0, 3.0, -0.0, 2.0**-8], dtype=torch.bfloat16)
    p1 = torch.tensor([2.0**-8, -3.0, -0.0, 1.0], dtype=torch.bfloat16)
    got = reduce_v1(p0, p1)
    assert got.tolist() == [1.0, 0.0, -0.0, 1.0]
    assert compare_bits(got, reduce_v1(p1, p0)).equal
    assert torch.signbit(got[2]) and not torch.signbit(got[1])
    with pytest.raises(TypeError, match="p1 has dtype torch.float32"):
        reduce_v1(p0, p1.float())
    with pytest.raises(ValueError, match="partial shapes differ"):
        reduce_v1(p0, p1[:2])


def test_exact_fixtures_make_the_oracle_exact(layout):
    fx = make_fixtures(layout, SEED, kind="exact")
    values = torch.cat([t.flatten().float() for t in fx.tensors.values()]).unique()
    assert set(values.tolist()) <= {-1.0, 0.0, 1.0}
    for spec in SPECS.values():
        c_star, _ = oracle(spec, *spec.region_operands(fx, 0))
        assert oracle_is_exact(c_star), spec.name
        assert c_star.abs().max() > 0


def test_exact_reduced_equals_the_fp64_oracle(layout):
    fx = make_fixtures(layout, SEED, DEVICE, kind="exact")
    for name in ("down_fwd", "gate_dx", "up_dx", "gate_dw", "up_dw", "down_dw"):
        spec = SPECS[name]
        reduced, _ = reduced_result(spec, fx, 3)
        c_star, _ = oracle(spec, *spec.region_operands(fx, 3))
        assert compare_bits(reduced, c_star.to(torch.bfloat16)).equal, name


def test_dw_reduces_over_the_whole_sequence(layout):
    """The two CP partials of dW sum to the dW of all M rows (the region oracle un-shards M)."""
    fx = make_fixtures(layout, SEED, kind="exact")
    spec = SPECS["down_dw"]
    x, y = spec.region_operands(fx, 1)
    assert x.shape[0] == layout.m and y.shape[0] == layout.m


def test_checks_fail_on_a_wrong_reduction(layout, monkeypatch):
    """A reduction that is off by one must fail the exact checks: the checks can fail."""
    import detkit.toolkit.shard_refs as refs

    def wrong(p0, p1):
        return (p0.float() + p1.float() + 1.0).bfloat16()  # off by one everywhere

    monkeypatch.setattr(refs, "reduce_v1", wrong)
    fx = make_fixtures(layout, SEED, DEVICE, kind="exact")
    results = list(check_spec(SPECS["down_fwd"], fx))
    assert any(not r.passed for r in results if r.check == "exact_oracle_reduced")


def test_checks_fail_on_a_wrong_weight_shard(layout, monkeypatch):
    """TP rank 1 cutting TP rank 0's Gate columns must fail the TP=1 comparison."""
    import detkit.toolkit.shard_refs as refs

    real = refs.operand

    def wrong_shard(fx, name, cp, tp):
        return real(fx, name, cp, 0 if (name == "w_gate" and tp == 1) else tp)

    monkeypatch.setattr(refs, "operand", wrong_shard)
    fx = make_fixtures(layout, SEED, DEVICE)
    results = [r for r in check_spec(SPECS["gate_fwd"], fx) if r.check == "tp1_equal"]
    assert [r.details["tp"] for r in results if not r.passed] == [1, 1]


def test_make_fixtures_refuses_unknown_kind(layout):
    with pytest.raises(ValueError, match="fixture kind 'ones' is not supported"):
        make_fixtures(layout, SEED, kind="ones")
