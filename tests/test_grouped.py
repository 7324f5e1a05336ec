"""kernels/grouped: the grouped GEMM (2-D x 3-D with offsets) and the grouped weight gradient (2-D x 2-D, offsets
along the reduced dim). Under the interpreter both equal the sequential reference bit for bit (exact products added
one at a time in ascending order, one rounding); on every backend they obey the GEMM contract's bound against FP64, a
row keeps its bits whatever the other groups and its own group hold, empty groups and rows past the last offset are
exact zeros, and bad inputs are refused in one line naming the value. CPU under the Triton interpreter (conftest);
everything with DETKIT_TEST_DEVICE=cuda on an H100/H200, plus the `gpu`-marked tests at MoE widths."""

from __future__ import annotations

import pytest
import torch

from detkit.kernels.bounds import gemm_bound
from detkit.kernels.grouped import (
    grouped_mm, grouped_mm_ref, grouped_mm_sequential, grouped_wgrad, grouped_wgrad_ref, grouped_wgrad_sequential,
)
from detkit.kernels.grouped.configs import CONFIG_TABLE, GroupedConfig
from detkit.toolkit.contract import check_bound
from detkit.toolkit.fixtures import bf16_randn

from tests.conftest import assert_bits_equal


def offsets(sizes, device) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


def weights(g, k, n, seed, layout, device):
    """[G, K, N] as a contiguous stack, or transformers' ``w.transpose(-2, -1)`` of an [G, N, K] stack."""
    if layout == "kn":
        return bf16_randn((g, k, n), seed, device, scale=k**-0.5)
    return bf16_randn((g, n, k), seed, device, scale=k**-0.5).transpose(-2, -1)


def assert_within_bound(got, a, b, offs, k):
    star = grouped_mm_ref(a.cpu(), b.cpu(), offs.cpu())
    abs_ab = grouped_mm_ref(a.cpu().abs(), b.cpu().abs(), offs.cpu())
    result = check_bound(got.cpu(), star, gemm_bound(star, abs_ab, k))
    assert result.passed, result


# Group sizes with an empty group, a group of one row, groups across tile edges, and rows past the last offset.
SIZES = [(5, 0, 15, 13), (1, 30), (0, 0, 7)]


@pytest.mark.parametrize("layout", ["kn", "transposed"])
@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_mm_is_the_sequential_reference_and_within_the_bound(device, layout, sizes):
    m = sum(sizes) + 3  # three rows no group owns: written 0
    k, n = 24, 40
    a = bf16_randn((m, k), 1, device)
    b = weights(len(sizes), k, n, 2, layout, device)
    offs = offsets(sizes, device)
    out = grouped_mm(a, b, offs)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert_within_bound(out, a, b, offs, k)
    assert_bits_equal(out[sum(sizes):], torch.zeros(3, n, dtype=torch.bfloat16, device=device), "rows past offs[-1]")
    if device.type == "cpu":
        assert_bits_equal(out, grouped_mm_sequential(a, b, offs), "interpreter vs the sequential reference")


def test_a_rows_bits_do_not_depend_on_the_other_rows(device):
    """Token rows of group 1 alone, then with more rows in their group and different sizes elsewhere, at other
    positions (so in other tiles and tile slots): the same bits."""
    k, n = 40, 24
    b = weights(3, k, n, 3, "transposed", device)
    rows = bf16_randn((6, k), 4, device)
    alone = grouped_mm(rows, b, offsets([0, 6, 0], device))
    others = bf16_randn((50, k), 5, device)
    a = torch.cat([others[:17], others[17:20], rows, others[20:31], others[31:]])
    crowded = grouped_mm(a, b, offsets([17, 3 + 6 + 11, 19], device))
    assert_bits_equal(crowded[20:26], alone, "a group's rows alone vs among others")


def test_the_config_changes_no_bit_under_the_interpreter(device):
    if device.type != "cpu":
        pytest.skip("the GPU's bits per config are checked by tools/gpu/grouped_mm.sh's sweep")
    a, b = bf16_randn((29, 33), 6, device), weights(2, 33, 20, 7, "kn", device)
    offs = offsets([12, 15], device)
    other = GroupedConfig(block_m=32, block_n=16, block_k=32, num_warps=4, num_stages=1)
    assert_bits_equal(grouped_mm(a, b, offs, config=other), grouped_mm(a, b, offs), "two configs")


@pytest.mark.parametrize("sizes", [(5, 0, 15, 13), (0, 0, 7), (31,)])
def test_grouped_wgrad_reduces_each_group_in_order(device, sizes):
    """dy.T (a transposed view, as autograd passes it) times x, per group of rows; empty groups are exact zeros."""
    r = sum(sizes) + 2  # rows past the last offset: in no group's sum
    dy, x = bf16_randn((r, 24), 8, device), bf16_randn((r, 40), 9, device)
    offs = offsets(sizes, device)
    out = grouped_wgrad(dy.t(), x, offs)
    assert out.shape == (len(sizes), 24, 40)
    star = grouped_wgrad_ref(dy.t().cpu(), x.cpu(), offs.cpu())
    abs_ab = grouped_wgrad_ref(dy.t().cpu().abs(), x.cpu().abs(), offs.cpu())
    result = check_bound(out.cpu(), star, gemm_bound(star, abs_ab, max(max(sizes), 1)))
    assert result.passed, result
    for g, size in enumerate(sizes):
        if size == 0:
            assert_bits_equal(out[g], torch.zeros_like(out[g]), f"empty group {g}")
    if device.type == "cpu":
        assert_bits_equal(out, grouped_wgrad_sequential(dy.t(), x, offs), "interpreter vs the sequential reference")


def test_a_groups_weight_gradient_depends_on_its_rows_alone(device):
    """The same group's rows at another position, with other groups around them: the same bits (the order starts at
    the group's first row, wherever it lies)."""
    dy, x = bf16_randn((21, 16), 10, device), bf16_randn((21, 32), 11, device)
    alone = grouped_wgrad(dy.t(), x, offsets([21], device))
    pad_dy, pad_x = bf16_randn((9, 16), 12, device), bf16_randn((9, 32), 13, device)
    dy2, x2 = torch.cat([pad_dy[:5], dy, pad_dy[5:]]), torch.cat([pad_x[:5], x, pad_x[5:]])
    moved = grouped_wgrad(dy2.t(), x2, offsets([5, 21, 4], device))
    assert_bits_equal(moved[1], alone[0], "a group's weight gradient alone vs between others")


def _bad(device):
    a, b = bf16_randn((8, 16), 1, device), bf16_randn((2, 16, 8), 2, device)
    return a, b, offsets([3, 5], device)


@pytest.mark.parametrize("case, error, message", [
    ("a_fp32", TypeError, "a has dtype torch.float32; supported: torch.bfloat16"),
    ("b_2d", ValueError, r"b must be 3-D; got shape \(16, 8\)"),
    ("k_mismatch", ValueError, "must share K"),
    ("offs_int64", TypeError, "offs has dtype torch.int64; supported: torch.int32"),
    ("offs_length", ValueError, r"one offset per group \(2\); got shape \(3,\)"),
])
def test_grouped_mm_refuses_in_one_line_naming_the_value(device, case, error, message):
    a, b, offs = _bad(device)
    args = {"a_fp32": (a.float(), b, offs), "b_2d": (a, b[0], offs), "k_mismatch": (a[:, :8], b, offs),
            "offs_int64": (a, b, offs.long()), "offs_length": (a, b, offsets([1, 2, 3], device))}[case]
    with pytest.raises(error, match=message):
        grouped_mm(*args)


@pytest.mark.parametrize("ends, bad", [((5, 3), r"offs\[1\] = 3 after 5"), ((5, 9), r"offs\[1\] = 9 after 5"),
                                        ((-1, 2), r"offs\[0\] = -1 after 0")])
def test_invalid_offsets_are_refused_on_the_host_for_cpu_offsets(device, ends, bad):
    """Decreasing, past the 8 rows, negative: refused before any launch (CPU offsets are read on the host)."""
    if device.type != "cpu":
        pytest.skip("CPU offsets run under the interpreter only; on the GPU see the NaN test below")
    a, b = bf16_randn((8, 16), 1), bf16_randn((2, 16, 8), 2)
    offs = torch.tensor(ends, dtype=torch.int32)
    with pytest.raises(ValueError, match=bad):
        grouped_mm(a, b, offs)
    with pytest.raises(ValueError, match=bad):
        grouped_wgrad(a.t(), a, offs)


@pytest.mark.gpu
def test_invalid_offsets_on_the_gpu_give_nan_everywhere_without_a_host_read(device):
    a, b = bf16_randn((64, 32), 1, device), bf16_randn((2, 32, 16), 2, device)
    offs = torch.tensor([40, 30], dtype=torch.int32, device=device)
    assert torch.isnan(grouped_mm(a, b, offs)).all()
    assert torch.isnan(grouped_wgrad(a.t(), a, offs)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("e, h, i", [(8, 4096, 14336), (128, 2048, 768)])
def test_moe_widths_on_the_gpu_bound_invariance_and_graph_capture(device, e, h, i):
    """At MoE widths: within the bound, a token's row alone vs in a crowded grouping, weight gradient repeats, and
    the launches capture in a CUDA graph (no host read) and replay with the same bits."""
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(0, 64, (e,), generator=gen).tolist()
    m = sum(sizes)
    x = bf16_randn((m, h), 1, device)
    w = weights(e, h, i, 2, "transposed", device)
    offs = offsets(sizes, device)
    out = grouped_mm(x, w, offs)
    g = next(j for j, s in enumerate(sizes) if s > 3)
    start = sum(sizes[:g])
    assert_within_bound(out[start:start + sizes[g]], x[start:start + sizes[g]], w[g:g + 1],
                        offsets([sizes[g]], "cpu"), h)
    alone = grouped_mm(x[start + 1:start + 2], w, offsets([0] * g + [1] + [0] * (e - g - 1), device))
    assert_bits_equal(out[start + 1:start + 2], alone, "a token's row alone vs among its expert's tokens")
    dy = bf16_randn((m, i), 3, device)
    wg = grouped_wgrad(dy.t(), x, offs)
    assert_bits_equal(grouped_wgrad(dy.t(), x, offs), wg, "weight gradient repeat")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grouped_mm(x, w, offs)
    graph.replay()
    assert_bits_equal(captured, out, "graph replay vs eager")


def test_the_table_holds_both_ops_on_both_backends():
    assert {op for op, _, _ in CONFIG_TABLE} == {"mm", "wgrad"}
    assert {backend for _, backend, _ in CONFIG_TABLE} == {"cuda_sm90", "triton_interpreter"}
    assert all((op, backend, "*") in CONFIG_TABLE for op, backend, _ in CONFIG_TABLE)  # every layout has a config
