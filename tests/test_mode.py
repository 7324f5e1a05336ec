"""mode/switch.py, eager path: inside ``batch_invariant_mode`` every BF16 mm / addmm / bmm / baddbmm runs on
det_gemm (the route read from the layout), forward and backward, with the bits of the det_gemm op it names;
rows keep their bits whatever the batch; the last-dim mean runs on the fixed-order row mean; what is not routed
is counted with its reason or, under strict, raises; the mode is re-entrant, a decorator, and leaves torch
untouched outside. CPU tensors under the Triton interpreter (conftest), CUDA sm_90 with DETKIT_TEST_DEVICE=cuda."""

from __future__ import annotations

import pytest
import torch

import detkit
from detkit.mode import aten as mode_aten
from detkit.mode import state as mode_state
from detkit.kernels.det_gemm.launch import det_gemm_da, det_gemm_db, det_gemm_fwd
from detkit.kernels.reductions import row_mean, row_mean_ref
from detkit.toolkit.contract import U_BF16, U_FP32, check_bound, compare_bits, gamma, gemm_bound
from detkit.toolkit.fixtures import bf16_randn


# a dtype det_gemm does not take
F64_REASON = "dtype float64 (det_gemm takes bfloat16, float16 or float32 operands, one dtype)"


def assert_bits(got, want, what=""):
    result = compare_bits(got, want)
    assert result.equal, f"{what}: {result}"


@pytest.fixture(autouse=True)
def _fresh_counters():
    detkit.reset_mode_counters()
    yield
    assert not detkit.is_batch_invariant_mode_enabled(), "a test left the mode entered"


def linear(device, k=48, n=40, bias=False, seed=1):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(k, n, bias=bias).to(device=device, dtype=torch.bfloat16)
    return layer


def routed(counters) -> dict[str, int]:
    return counters.as_dict()["routed"]


def test_linear_forward_and_backward_run_the_named_det_gemm_ops(device):
    layer = linear(device)
    x = bf16_randn((2, 7, 48), 3, device).requires_grad_(True)
    dy = bf16_randn((2, 7, 40), 4, device)
    with detkit.batch_invariant_mode():
        y = layer(x)
        y.backward(dy)
    assert routed(detkit.mode_counters()) == {"mm -> det_gemm_fwd": 1, "mm -> det_gemm_da": 1, "mm -> det_gemm_db": 1}
    x2, dy2, w = x.detach().reshape(14, 48), dy.reshape(14, 40), layer.weight.detach()
    assert_bits(y.detach().reshape(14, 40), det_gemm_fwd(x2, w.t()), "forward")
    assert_bits(x.grad.reshape(14, 48), det_gemm_da(dy2, w.t()), "grad_input")
    assert_bits(layer.weight.grad, det_gemm_db(dy2, x2), "grad_weight")


def test_linear_with_bias_is_addmm_plus_bias_in_bf16(device):
    layer = linear(device, bias=True)
    x = bf16_randn((9, 48), 5, device)
    with detkit.batch_invariant_mode():
        y = layer(x)
    assert routed(detkit.mode_counters()) == {"addmm -> det_gemm_fwd": 1}
    assert_bits(y.detach(), det_gemm_fwd(x, layer.weight.detach().t()) + layer.bias.detach(), "addmm")


def test_matmul_is_within_the_gemm_contract(device):
    """torch.matmul and @ reach the same route; the result obeys det_gemm's FP64 bound (toolkit.contract)."""
    a = bf16_randn((33, 64), 6, device)
    b = bf16_randn((64, 24), 7, device, scale=0.125)
    with detkit.batch_invariant_mode():
        out = a @ b
        out2 = torch.matmul(a, b)
    assert_bits(out2, out, "matmul vs @")
    star = a.double().cpu() @ b.double().cpu()
    bound = gemm_bound(star, a.double().abs().cpu() @ b.double().abs().cpu(), 64)
    assert check_bound(out.cpu(), star, bound).passed
    assert routed(detkit.mode_counters()) == {"mm -> det_gemm_da": 2}


@pytest.mark.parametrize("m", [1, 7, 33])
def test_rows_keep_their_bits_whatever_the_batch(device, m):
    """Row i of a Linear's output: the same bits in a batch of m rows, of 64, and at the batch's end."""
    layer = linear(device, k=96, n=72)
    x = bf16_randn((64, 96), 8, device)
    with detkit.batch_invariant_mode():
        full = layer(x)
        head = layer(x[:m])
        tail = layer(x[64 - m:])
    assert_bits(head, full[:m], "head rows")
    assert_bits(tail, full[64 - m:], "tail rows")


def test_bmm_and_baddbmm_are_one_det_gemm_per_element(device):
    a = bf16_randn((3, 9, 32), 9, device)
    b = bf16_randn((3, 32, 20), 10, device)
    bias = bf16_randn((3, 9, 20), 11, device)
    with detkit.batch_invariant_mode():
        out = torch.bmm(a, b)
        alone = torch.bmm(a[1:2], b[1:2])
        badd = torch.baddbmm(bias, a, b)
        four_d = a.view(1, 3, 9, 32) @ b.view(1, 3, 32, 20)
    for i in range(3):
        assert_bits(out[i], det_gemm_da(a[i], b[i].t()), f"bmm element {i}")
    assert_bits(alone[0], out[1], "element alone vs in the batch")
    assert_bits(badd, out + bias, "baddbmm")
    assert_bits(four_d[0], out, "4-D matmul")
    assert routed(detkit.mode_counters()) == {"bmm -> det_gemm_da": 3, "baddbmm -> det_gemm_da": 1}


def test_addmm_beta_zero_ignores_the_input_and_other_scalars_are_refused(device):
    a = bf16_randn((5, 16), 12, device)
    b = bf16_randn((16, 8), 13, device)
    bias = torch.full((8,), float("nan"), dtype=torch.bfloat16, device=device)
    with detkit.batch_invariant_mode():
        zero = torch.addmm(bias, a, b, beta=0)
        half = torch.addmm(bias.nan_to_num(0.0), a, b, beta=0.5)
    assert_bits(zero, det_gemm_da(a, b.t()), "beta 0")
    assert_bits(half, torch.addmm(bias.nan_to_num(0.0), a, b, beta=0.5), "refused: torch's kernel")
    counters = detkit.mode_counters().as_dict()
    assert counters["routed"] == {"addmm -> det_gemm_da": 1}
    assert counters["not_routed"] == {"addmm: beta=0.5, alpha=1 (supported: alpha 1, beta 0 or 1)": 1}
    with pytest.raises(detkit.ModeNotRoutedError, match="beta=0.5"), detkit.batch_invariant_mode(strict=True):
        torch.addmm(bias, a, b, beta=0.5)


def test_other_dtypes_run_on_torch_and_are_counted(device):
    a = torch.randn(6, 10, device=device).double()
    b = torch.randn(10, 4, device=device).double()
    want = a @ b
    with detkit.batch_invariant_mode():
        got = a @ b
        torch.mv(a, b[:, 0])
    assert_bits(got, want, "float64 mm on torch")
    assert detkit.mode_counters().as_dict()["not_routed"] == {f"mm: {F64_REASON}": 1,
                                                              "mv: no detkit route for this op": 1}
    with pytest.raises(detkit.ModeNotRoutedError, match="dtype float64"), detkit.batch_invariant_mode(strict=True):
        a @ b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_over_one_element_are_exact_in_any_dtype(device, dtype):
    # A rotary embedding's inv_freq [B, D/2, 1] @ positions [B, 1, S] in FP32: one product per element, no order.
    inv_freq = torch.rand(3, 8, 1, device=device).to(dtype)
    positions = torch.arange(5, device=device, dtype=torch.float32).expand(3, 1, 5).to(dtype)
    a, b = torch.randn(7, 1, device=device).to(dtype), torch.randn(1, 4, device=device).to(dtype)
    want_bmm, want_mm = torch.bmm(inv_freq, positions), a @ b
    with detkit.batch_invariant_mode(strict=True):
        got_bmm, got_mm = torch.bmm(inv_freq, positions), a @ b
    assert_bits(got_bmm, want_bmm, f"{dtype} bmm with K=1")
    assert_bits(got_mm, want_mm, f"{dtype} mm with K=1")
    assert routed(detkit.mode_counters()) == {"bmm -> exact (K=1)": 1, "mm -> exact (K=1)": 1}


def test_empty_operands_are_exact_zeros(device):
    a = torch.empty(4, 0, dtype=torch.bfloat16, device=device)
    b = torch.empty(0, 3, dtype=torch.bfloat16, device=device)
    with detkit.batch_invariant_mode(strict=True):
        out = a @ b
    assert out.shape == (4, 3) and bool((out == 0).all())
    assert routed(detkit.mode_counters()) == {"mm -> exact (empty)": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_mean_is_within_its_bound_and_batch_invariant(device, dtype):
    """Sum of H terms in FP32 (gamma(H) * sum|x| against FP64), one division, then the output rounding."""
    x = bf16_randn((37, 300), 14, device).to(dtype)
    out = row_mean(x)
    ref = row_mean_ref(x.cpu())
    u_out = U_BF16 if dtype == torch.bfloat16 else U_FP32
    bound = (gamma(300) * x.double().abs().sum(-1).cpu() / 300 + U_FP32 * ref.abs()) * (1 + u_out) + u_out * ref.abs()
    assert check_bound(out.cpu(), ref, bound).passed
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(36, 37)):
        assert_bits(row_mean(x[rows]), out[rows], f"rows {rows}")


def test_mean_over_the_last_dim_is_routed_others_counted(device):
    x = bf16_randn((4, 6, 32), 15, device).float()
    with detkit.batch_invariant_mode():
        last = x.pow(2).mean(-1, keepdim=True)
        first = x.mean(0)
    assert_bits(last.reshape(-1), row_mean(x.pow(2).reshape(-1, 32)), "mean(-1)")
    assert last.shape == (4, 6, 1)
    assert_bits(first, x.mean(0), "mean(0) on torch")
    counters = detkit.mode_counters().as_dict()
    assert counters["routed"] == {"mean.dim -> row_mean": 1}
    assert counters["not_routed"] == {"mean.dim: reduces dims [0] of a 3-D tensor (supported: the last dim only)": 1}


def test_reentrant_decorator_and_strict_scope(device):
    a = torch.randn(3, 3, device=device).double()

    @detkit.batch_invariant_mode()
    def inner_product():
        assert detkit.is_batch_invariant_mode_enabled()
        return a @ a

    with detkit.batch_invariant_mode():
        with detkit.batch_invariant_mode(strict=True):
            assert mode_state.strict()
            with pytest.raises(detkit.ModeNotRoutedError):
                a @ a
        assert not mode_state.strict()
        inner_product()
        assert detkit.is_batch_invariant_mode_enabled() and mode_aten.installed()
    assert not mode_aten.installed()
    before = detkit.mode_counters()
    a @ a
    inner_product()
    a @ a  # outside again: torch's kernel, nothing counted
    assert (detkit.mode_counters() - before).as_dict()["not_routed"] == {f"mm: {F64_REASON}": 1}


def test_enable_disable_functions_pair_and_refuse_misuse():
    detkit.enable_batch_invariant_mode()
    detkit.enable_batch_invariant_mode(strict=True)
    assert mode_state.STATE.depth == 2 and mode_state.strict()
    detkit.disable_batch_invariant_mode()
    detkit.disable_batch_invariant_mode()
    with pytest.raises(RuntimeError, match="not enabled"):
        detkit.disable_batch_invariant_mode()
    with pytest.raises(TypeError, match="strict must be a bool"):
        detkit.batch_invariant_mode(strict="yes")


def test_outside_the_mode_torch_runs_unseen(device):
    a = bf16_randn((8, 16), 16, device)
    b = bf16_randn((16, 8), 17, device)
    with detkit.batch_invariant_mode():
        pass
    a @ b
    assert detkit.mode_counters().routed == {} and detkit.mode_counters().not_routed == {}


def _mode_frames(fn) -> list[str]:
    """The Python frames of the mode's own modules (mode/*.py) that one call of ``fn`` enters (not the Triton
    kernels' bodies, which the interpreter runs as Python)."""
    import sys

    frames = []

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and "/kernels/mode_" in code.co_filename.replace("\\", "/") and not code.co_name.endswith(
                "_kernel"):
            frames.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return frames


# The per-call path of a routed op, once its signature's plan exists: the aten override, the op's plan lookup, the
# plan (addmm: the bias step around the GEMM's plan; bmm: one frame per element and the loop's), then the kernel's
# own entry point. The routing checks run once per signature, so a repeated call never re-enters them; a frame
# more here is host time on every GEMM of an eager decode step.
FRAME_BOUNDS = {"mm fwd": 3, "mm dA": 3, "mm dB": 3, "addmm": 4, "bmm (3 elements)": 8, "mean.dim": 4}


def test_a_repeated_routed_call_takes_a_bounded_number_of_mode_frames(device):
    w, x, g = bf16_randn((16, 32), 18, device), bf16_randn((4, 32), 19, device), bf16_randn((4, 16), 20, device)
    bias = bf16_randn((16,), 21, device)
    a3, b3 = bf16_randn((3, 4, 8), 22, device), bf16_randn((3, 8, 5), 23, device)
    r = bf16_randn((2, 3, 32), 24, device).float()
    calls = {"mm fwd": lambda: x @ w.t(), "mm dA": lambda: g @ w, "mm dB": lambda: g.t() @ x,
             "addmm": lambda: torch.addmm(bias, x, w.t()), "bmm (3 elements)": lambda: torch.bmm(a3, b3),
             "mean.dim": lambda: r.mean(-1, keepdim=True)}
    with detkit.batch_invariant_mode(strict=True):
        for name, fn in calls.items():
            fn()  # the signature's first call builds its plan
            frames = _mode_frames(fn)
            assert len(frames) <= FRAME_BOUNDS[name], f"{name}: {len(frames)} mode frames per call: {frames}"
    assert routed(detkit.mode_counters()) == {
        "mm -> det_gemm_fwd": 2, "mm -> det_gemm_da": 2, "mm -> det_gemm_db": 2, "addmm -> det_gemm_fwd": 2,
        "bmm -> det_gemm_da": 2, "mean.dim -> row_mean": 2}


def test_decisions_are_per_signature_and_strict_is_per_call(device):
    """One shape, two layouts: two routes; a refused signature is counted on every call and raises once strict."""
    w = bf16_randn((24, 24), 25, device)
    x = bf16_randn((5, 24), 26, device)
    f64 = x.double()
    with detkit.batch_invariant_mode():
        fwd, da = x @ w.t(), x @ w
        for _ in range(3):
            f64 @ f64.t()
        with pytest.raises(detkit.ModeNotRoutedError, match="dtype float64"), detkit.batch_invariant_mode(strict=True):
            f64 @ f64.t()
        f64 @ f64.t()
    assert_bits(fwd, det_gemm_fwd(x, w.t()), "transposed weight: fwd")
    assert_bits(da, det_gemm_da(x, w.t()), "row-major weight: dA")
    counters = detkit.mode_counters().as_dict()
    assert counters["routed"] == {"mm -> det_gemm_fwd": 1, "mm -> det_gemm_da": 1}
    assert counters["not_routed"] == {f"mm: {F64_REASON}": 4}
