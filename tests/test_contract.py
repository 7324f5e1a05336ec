"""The contract must pass the real kernel and catch realistic bugs; the comparators must see raw bits."""

import math

import pytest
import torch

from detkit.audits.gemm_contract import oracle
from detkit.kernels.det_gemm.launch import det_gemm_fwd
from detkit.toolkit.contract import (
    U_BF16, bf16_ordinal, check_bound, compare_bits, digest, drift_stats, gamma, gemm_bound, reduced_bound, rel_l2,
)
from detkit.toolkit.fixtures import bf16_randn

M, K, N = 64, 96, 48


@pytest.fixture
def operands(device):
    return bf16_randn((M, K), 11, device), bf16_randn((K, N), 12, device, scale=K**-0.5)


def _check(c, a, b):
    c_star, abs_ab = oracle("fwd", a, b)
    return check_bound(c, c_star, gemm_bound(c_star, abs_ab, K))


def test_correct_kernel_passes(operands):
    a, b = operands
    result = _check(det_gemm_fwd(a, b), a, b)
    assert result.passed and result.violations == 0 and result.worst_ratio <= 1.0


def test_catches_dropped_k_tile(operands):
    a, b = operands
    dropped = (a[:, :-16].float() @ b[:-16].float()).to(torch.bfloat16)  # the last 16-wide K tile lost
    result = _check(dropped, a, b)
    assert not result.passed and result.violations > 0.5 * M * N


def test_catches_transposed_operand(device):
    a, b = bf16_randn((M, K), 11, device), bf16_randn((K, K), 13, device, scale=K**-0.5)
    wrong = (a.float() @ b.float().t()).to(torch.bfloat16)
    c_star, abs_ab = oracle("fwd", a, b)
    assert not check_bound(wrong, c_star, gemm_bound(c_star, abs_ab, K)).passed


def test_catches_fp16_accumulator(operands):
    a, b = operands
    acc = torch.zeros(M, N, dtype=torch.float16, device=a.device)
    for k0 in range(0, K, 16):  # a kernel that rounds its accumulator to FP16 after every K tile
        acc = (acc.float() + a[:, k0:k0 + 16].float() @ b[k0:k0 + 16].float()).half()
    result = _check(acc.to(torch.bfloat16), a, b)
    assert not result.passed, result


def test_catches_one_ulp_truncation_bias(operands):
    # Truncating instead of rounding the final BF16 (the Triton interpreter's own cast does this).
    a, b = operands
    acc = (a.float() @ b.float())
    truncated = (acc.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert not _check(truncated, a, b).passed


def test_nan_and_inf_fail(operands):
    a, b = operands
    c = det_gemm_fwd(a, b).clone()
    c[3, 4] = float("nan")
    c[5, 6] = float("inf")
    result = _check(c, a, b)
    assert not result.passed and result.nonfinite == 2 and result.first_violation == (3, 4)


def test_gamma_and_bounds_are_monotone():
    assert gamma(0) == 0.0
    assert math.isclose(gamma(4096), 4096 * 2**-23 / (1 - 4096 * 2**-23))
    with pytest.raises(ValueError, match="undefined"):
        gamma(2**23)
    c_star = torch.tensor([1.0, -2.0], dtype=torch.float64)
    abs_ab = torch.tensor([3.0, 3.0], dtype=torch.float64)
    single = gemm_bound(c_star, abs_ab, 6144)
    reduced = reduced_bound(c_star, abs_ab, abs_ab, 6144)
    assert torch.all(reduced > single) and torch.all(single >= U_BF16 * c_star.abs())


def test_reduced_bound_holds_for_two_bf16_partials(device):
    a, b = bf16_randn((M, 2 * K), 21, device), bf16_randn((2 * K, N), 22, device, scale=K**-0.5)
    p = [det_gemm_fwd(a[:, i * K:(i + 1) * K], b[i * K:(i + 1) * K]) for i in range(2)]
    r = (p[0].float() + p[1].float()).to(torch.bfloat16)
    c_star, abs_ab = oracle("fwd", a, b)
    p_abs = sum(oracle("fwd", a[:, i * K:(i + 1) * K], b[i * K:(i + 1) * K])[0].abs() for i in range(2))
    assert check_bound(r, c_star, reduced_bound(c_star, p_abs, abs_ab, K)).passed
    # and the single-GEMM bound is too tight for the double rounding somewhere: the bounds differ for a reason
    assert not torch.equal(reduced_bound(c_star, p_abs, abs_ab, K), gemm_bound(c_star, abs_ab, 2 * K))


def test_compare_bits_distinguishes_signed_zero_and_reports_first_index():
    x = torch.tensor([[1.0, 0.0], [2.0, 3.0]], dtype=torch.bfloat16)
    y = torch.tensor([[1.0, -0.0], [2.0, 4.0]], dtype=torch.bfloat16)
    result = compare_bits(x, y)
    assert not result.equal and result.mismatches == 2 and result.first_mismatch == (0, 1)
    assert compare_bits(x, x.clone()).equal


def test_compare_bits_treats_nan_as_error():
    x = torch.tensor([float("nan"), 1.0], dtype=torch.float32)
    result = compare_bits(x, x.clone())
    assert not result.equal and result.nan_count == 1 and result.first_mismatch == (0,)


def test_compare_bits_rejects_mismatched_tensors():
    with pytest.raises(ValueError, match="cannot compare"):
        compare_bits(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16))


def test_ulp_distance_and_drift_stats():
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    next_up = torch.tensor([1.0078125], dtype=torch.bfloat16)  # 1 + 2**-7: one BF16 ULP above 1
    assert int(bf16_ordinal(next_up) - bf16_ordinal(one)) == 1
    assert int(bf16_ordinal(torch.tensor([-0.0], dtype=torch.bfloat16))) == 0
    stats = drift_stats(next_up, torch.tensor([1.0], dtype=torch.float64), "fp64")
    assert stats["fp64_ulp_max"] == 1.0 and stats["fp64_abs_max"] == 2**-7 and stats["fp64_ulp0_fraction"] == 0.0


def test_digest_sees_every_bit():
    x = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    y = torch.tensor([-0.0, 1.0], dtype=torch.bfloat16)
    assert digest(x) == digest(x.clone()) and digest(x) != digest(y)


def test_rel_l2_is_the_norm_of_the_error_over_the_norm_of_the_reference():
    ref = torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=torch.float64)  # ||ref|| = 5
    got = torch.tensor([[3.0, 0.5], [1.0, 4.0]], dtype=torch.bfloat16)  # error (0.5, 1): ||err||^2 = 1.25
    assert rel_l2(got, ref) == math.sqrt(1.25) / 5
    assert rel_l2(got, ref, dtype=torch.float32) == pytest.approx(math.sqrt(1.25) / 5, rel=2**-22)
    assert rel_l2(ref, ref) == 0.0
    # Nothing to be relative to: the absolute error.
    assert rel_l2(torch.tensor([3.0, 4.0]), torch.zeros(2)) == 5.0
    # A non-finite result fails every gate as inf (a NaN would compare false with the gate instead).
    for bad in (float("nan"), float("inf")):
        assert rel_l2(torch.tensor([1.0, bad]), torch.tensor([1.0, 1.0])) == float("inf")
    assert drift_stats(got, ref, "x")["x_rel_l2"] == rel_l2(got, ref)


def test_the_harness_applies_the_kernels_bounds_not_a_copy():
    import detkit.kernels.bounds as bounds
    import detkit.kernels.parallel.swiglu as swiglu
    import detkit.toolkit.contract as contract

    for name in ("ETA_BF16", "U_BF16", "U_FP32", "U_FP64", "U_REDUCE", "gamma", "gemm_bound", "reduced_bound"):
        assert getattr(contract, name) is getattr(bounds, name), name
    assert swiglu.U_FP32 is bounds.U_FP32 and swiglu.U_BF16 is bounds.U_BF16 and swiglu.ETA_BF16 is bounds.ETA_BF16


def test_drift_quantiles_are_the_kth_smallest_elements():
    x = torch.randn(10_001, dtype=torch.float64)
    stats = drift_stats(x.to(torch.bfloat16), torch.zeros_like(x), "z")  # err = |c|
    err = x.to(torch.bfloat16).double().abs()
    for q, key in ((0.95, "z_abs_p95"), (0.99, "z_abs_p99")):
        assert stats[key] == float(err.kthvalue(round(q * err.numel())).values)


def test_relative_and_ulp_drift_leave_out_references_within_their_bound_of_zero():
    # Element 0: well away from zero, one BF16 ULP off (1 + 2**-7 for 1). Element 1: the exact result 1e-19 lies
    # inside its own bound of zero (cancellation), and the kernel's 2**-10 passes that bound; relative to 1e-19 it
    # would read as ~1e16 and as thousands of ULP, which says nothing about the kernel.
    ref = torch.tensor([1.0, 1e-19], dtype=torch.float64)
    got = torch.tensor([1.0078125, 2.0**-10], dtype=torch.bfloat16)
    bound = torch.tensor([2.0**-6, 2.0**-8], dtype=torch.float64)
    assert check_bound(got, ref, bound).passed
    unbounded = drift_stats(got, ref, "x")
    assert unbounded["x_rel_max"] > 1e15 and unbounded["x_ulp_max"] > 1e3 and unbounded["x_near_zero"] == 0
    stats = drift_stats(got, ref, "x", bound)
    assert stats["x_near_zero"] == 1
    assert stats["x_rel_max"] == 2**-7 and stats["x_ulp_max"] == 1.0 and stats["x_ulp0_fraction"] == 0.0
    # Absolute error and relative L2 still cover every element.
    assert stats["x_abs_max"] == 2**-7 and stats["x_rel_l2"] == unbounded["x_rel_l2"]
    with pytest.raises(ValueError, match=r"bound \(1,\) does not match the oracle \(2,\)"):
        drift_stats(got, ref, "x", bound[:1])


def test_with_every_reference_near_zero_the_relative_columns_are_empty_not_wrong():
    ref = torch.zeros(4, dtype=torch.float64)
    stats = drift_stats(torch.zeros(4, dtype=torch.bfloat16), ref, "z", torch.full((4,), 1e-3, dtype=torch.float64))
    assert stats["z_near_zero"] == 4 and stats["z_rel_max"] == 0.0 and stats["z_ulp_max"] == 0.0
