"""The MoE expert MLP kernels against FP64 stage oracles (the derived bounds of audits/moe.py), the
BF16 PyTorch gold, and their own bits: determinism, batch invariance, config independence on the
interpreter, main_grad accumulation, layouts, and every refusal. Tiny shapes (the interpreter is
slow); runs on the GPU too with DETKIT_TEST_DEVICE=cuda."""

from dataclasses import replace

import pytest
import torch

from detkit.audits.moe import (
    E2E_REL_L2_GATE, GOLD_MIN_COSINE, GOLD_SLACK, GRAD_NAMES, MoeCase, make_inputs, precision_stats,
    rejection_cases, run_layer, stage_checks,
)
from detkit.kernels.moe.layer import (
    MOE_CONFIGS, deinterleave_gate_up, interleave_gate_up, moe_down, moe_mlp_fwd, moe_mlp_ref, moe_scale_rows,
    moe_up_swiglu, moe_wgrad_w2,
)
import detkit.kernels.moe.layer as km
from detkit.kernels.det_gemm.launch import GemmConfig
from detkit.kernels.moe.common import EPI_SWIGLU
from detkit.kernels.moe.configs import check_grouped_config, check_moe_variant
from detkit.kernels.moe.launch import _grouped
from detkit.kernels.moe.routing import SEGMENT_ALIGN, build_routing, launch_routing, max_padded_rows
from detkit.toolkit.contract import compare_bits
from tests.conftest import backend_of
from tests.moe_helpers import (
    assert_forward_batch_invariant, assert_rejected, assert_stages, compile_sm90_offline, forbid_kernels,
    run_on_parameters,
)

H, I, E, K = 32, 48, 4, 2


def _case(routing="random", t=64, k=K, e=E, h=H, i=I, seed=3):
    return MoeCase(t, h, i, e, k, routing, seed)


def _assert_stages(inp):
    assert assert_stages(stage_checks, inp)["composed_dx_equal"]


@pytest.mark.parametrize("case", [
    _case("random"),
    _case("masked", seed=4),
    _case("counts:0,1,127,128,129", t=385, k=1, e=5, h=16, i=16, seed=5),
    _case("one_expert", t=20, seed=6),
    _case("random", t=1, seed=7),
], ids=lambda c: c.routing.split(":")[0] + f"-T{c.t}")
def test_every_stage_within_derived_bound(case, device):
    _assert_stages(make_inputs(case, device))


def test_bound_catches_a_layout_bug(device):
    # Split-half weights read as interleaved: a plausible bug. The layer must fail the end-to-end gate
    # against the reference with the intended (interleaved) semantics.
    inp = make_inputs(_case(t=16), device)
    split = deinterleave_gate_up(inp["w1"])
    out = moe_mlp_fwd(inp["x"], split, inp["w2"], inp["topk_ids"], inp["scores"])[0]
    ref = moe_mlp_ref(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])["out"]
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel > 8 * E2E_REL_L2_GATE, rel  # far beyond BF16 noise (which is ~2**-8.5)


def test_end_to_end_and_precision_vs_bf16_gold(device):
    inp = make_inputs(_case("masked", t=32, seed=8), device)
    got = run_layer(inp)
    for name, st in precision_stats(got, inp).items():
        assert st["rel_l2_fp64"] <= E2E_REL_L2_GATE, (name, st)
        assert st["cosine_vs_gold"] >= GOLD_MIN_COSINE, (name, st)
        assert st["rel_l2_fp64"] <= GOLD_SLACK * st["gold_rel_l2_fp64"] + 2.0**-12, (name, st)


def test_repeat_bitwise_and_autograd_equals_functional(device):
    inp = make_inputs(_case(t=24, seed=9), device)
    a, b = run_layer(inp), run_layer(inp)
    for name in GRAD_NAMES:
        res = compare_bits(a[name], b[name])
        assert res.equal, (name, res)
    out, _ = moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])
    assert compare_bits(out, a["out"]).equal


def test_forward_batch_invariance_per_token(device):
    case = _case(t=24, seed=10)
    assert_forward_batch_invariant(moe_mlp_fwd, make_inputs(case, device), case, 10)


def test_interpreter_bits_do_not_depend_on_tile_config(device):
    if device.type != "cpu":
        pytest.skip("interpreter property: sequential accumulation makes every config give the same bits")
    inp = make_inputs(_case(t=32, seed=11), device)
    r = build_routing(inp["topk_ids"], inp["scores"], E)
    backend = "triton_interpreter"
    gu_a, h_a = moe_up_swiglu(inp["x"], inp["w1"], r, backend)
    gu_b, h_b = moe_up_swiglu(inp["x"], inp["w1"], r, backend, config=MOE_CONFIGS["cuda_sm90"]["up"])
    assert compare_bits(gu_a, gu_b).equal and compare_bits(h_a, h_b).equal
    y_a = moe_down(h_a, inp["w2"], r, backend)
    down = MOE_CONFIGS["cuda_sm90"]["down"]  # the Gluon "ws" kernel has no interpreter path: its tile by TMA
    y_b = moe_down(h_a, inp["w2"], r, backend, config=replace(down, variant="tma") if down.variant == "ws" else down)
    assert compare_bits(y_a, y_b).equal


@pytest.mark.parametrize("layout", ["contiguous", "linear_views"])
def test_tma_weight_variant_gives_the_pointer_kernel_bits(layout, device):
    # The weight through a rank-3 TMA descriptor (zero fill past each expert's extents): every grouped
    # stage, both storage orders of B, K and N tails (H = 40, I = 24 are not multiples of the tiles).
    from dataclasses import replace

    from detkit.kernels.moe.layer import moe_dgrad_dswiglu, moe_dx_route

    inp = make_inputs(_case("masked", t=24, h=40, i=24, seed=16), device)
    w1, w2 = inp["w1"], inp["w2"]
    if layout == "linear_views":  # nn.Linear-style stacks passed as transposed views
        w1 = w1.transpose(1, 2).contiguous().transpose(1, 2)
        w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    r = build_routing(inp["topk_ids"], inp["scores"], w1.shape[0])
    backend = backend_of(device)
    ptr = GemmConfig(64, 32, 16, 1, 4, 2)
    tma = replace(ptr, variant="tma")
    gu_a, h_a = moe_up_swiglu(inp["x"], w1, r, backend, config=ptr)
    gu_b, h_b = moe_up_swiglu(inp["x"], w1, r, backend, config=tma)
    assert compare_bits(gu_a, gu_b).equal and compare_bits(h_a, h_b).equal
    assert compare_bits(moe_down(h_a, w2, r, backend, config=ptr), moe_down(h_a, w2, r, backend, config=tma)).equal
    dgu_a = moe_dgrad_dswiglu(inp["dout"], w2, gu_a, r, backend, config=ptr)
    assert compare_bits(dgu_a, moe_dgrad_dswiglu(inp["dout"], w2, gu_a, r, backend, config=tma)).equal
    assert compare_bits(moe_dx_route(dgu_a, w1, r, backend, config=ptr),
                        moe_dx_route(dgu_a, w1, r, backend, config=tma)).equal


def test_fused_dscores_keep_the_dgrad_bits_and_equal_dout_dot_y(device):
    # dscores from the dgrad accumulator and the saved h: dgu's bits unchanged, y no longer kept, and the
    # same quantity as dout . y within FP32 noise. I = 96: a full and a partial chunk.
    inp = make_inputs(_case("masked", t=24, h=40, i=96, seed=18), device)
    r = build_routing(inp["topk_ids"], inp["scores"], E)
    backend = backend_of(device)
    gu, h = moe_up_swiglu(inp["x"], inp["w1"], r, backend)
    dgu_fused, part = km.moe_dgrad_dswiglu_dscore(inp["dout"], inp["w2"], gu, h, r, backend)
    assert compare_bits(dgu_fused, km.moe_dgrad_dswiglu(inp["dout"], inp["w2"], gu, r, backend)).equal
    assert part.shape == (r.padded_rows, 2)
    ds = km.moe_dscores_from_partials(part, r, backend)
    # y = h @ W2[e] per expert-sorted row in FP64 (the layer's own y is rounded to BF16)
    row_expert = r.tile_expert.long().repeat_interleave(SEGMENT_ALIGN)
    y = torch.einsum("pi,pih->ph", h.double(), inp["w2"].double()[row_expert])
    rr = r.route_row.long()
    ds_y = torch.where(rr >= 0, (inp["dout"].double()[:, None, :] * y[rr.clamp(min=0)]).sum(2), 0.0).float()
    assert bool((ds[inp["topk_ids"] < 0] == 0).all()) and bool((ds != 0).any())
    torch.testing.assert_close(ds, ds_y, rtol=1e-4, atol=1e-4 * float(ds_y.abs().max()))
    assert not hasattr(moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])[1], "y")


def test_interpreter_dscore_partials_do_not_depend_on_the_dgrad_tile(device):
    if device.type != "cpu":
        pytest.skip("interpreter property: fixed 64-column chunks summed the same way whatever the tile")
    inp = make_inputs(_case(t=16, i=128, seed=19), device)
    r = build_routing(inp["topk_ids"], inp["scores"], E)
    gu, h = moe_up_swiglu(inp["x"], inp["w1"], r, "triton_interpreter")
    parts = [km.moe_dgrad_dswiglu_dscore(inp["dout"], inp["w2"], gu, h, r, "triton_interpreter", config=c)[1]
             for c in (GemmConfig(64, 64, 16, 1, 4, 1), GemmConfig(128, 128, 32, 1, 4, 1))]
    assert compare_bits(parts[0], parts[1]).equal


def test_fused_dscores_refuse_a_foreign_h_or_a_tile_off_the_chunks(device):
    inp = make_inputs(_case(t=8, i=128, seed=20), device)
    r = build_routing(inp["topk_ids"], inp["scores"], E)
    backend = backend_of(device)
    gu, h = moe_up_swiglu(inp["x"], inp["w1"], r, backend)
    with pytest.raises(ValueError, match=r"h must be the forward's contiguous bf16 \[P, I\]"):
        km.moe_dgrad_dswiglu_dscore(inp["dout"], inp["w2"], gu, h.t().contiguous().t(), r, backend)
    with pytest.raises(ValueError, match="BLOCK_N a multiple of 64; got 32"):
        km.moe_dgrad_dswiglu_dscore(inp["dout"], inp["w2"], gu, h, r, backend, config=GemmConfig(64, 32, 16, 1, 4, 1))


def test_tma_weight_variant_refuses_a_weight_it_cannot_address(device):
    inp = make_inputs(_case(t=8, h=40, i=24, seed=17), device)
    w1 = torch.zeros((E, 40, 2 * 24 + 1), dtype=torch.bfloat16, device=device)[..., :48]  # 97-element rows
    r = build_routing(inp["topk_ids"], inp["scores"], E)
    backend = backend_of(device)
    with pytest.raises(ValueError, match="variant 'tma' cannot describe the weight"):
        moe_up_swiglu(inp["x"], w1, r, backend, config=GemmConfig(64, 32, 16, 1, 4, 2, variant="tma"))


def test_scaled_rows_are_one_rounding_of_the_fp32_product(device):
    # dW2's B operand, formed before its GEMM: bf16(s * dout[token]) per expert-sorted row.
    inp = make_inputs(_case("masked", t=20, seed=15), device)
    routing = build_routing(inp["topk_ids"], inp["scores"], inp["w1"].shape[0])
    dout = inp["dout"]
    backend = backend_of(device)
    dy = moe_scale_rows(dout, routing, backend)
    # The kernel's formula in torch: FP32 product (IEEE, rounded once), then RTNE to BF16.
    want = (dout[routing.gather_token.long()].float() * routing.row_score[:, None]).to(torch.bfloat16)
    padding = routing.sorted_route < 0
    want[padding] = 0.0  # +0, whatever the row of token 0 (which padding rows name) holds
    assert dy.shape == (routing.padded_rows, dout.shape[1]) and dy.dtype == torch.bfloat16
    assert torch.equal(dy.view(torch.int16), want.view(torch.int16))
    assert padding.any()  # padding rows exist: formed as zeros
    dout_inf = dout.clone()
    dout_inf[0] = float("inf")  # 0 * Inf would be NaN in a padding row
    assert (moe_scale_rows(dout_inf, routing, backend)[padding].view(torch.int16) == 0).all()
    # The same pass's copy of dout's rows in expert order (dgrad's A by TMA): the rows exactly, padding rows +0.
    dy_too, copy = moe_scale_rows(dout_inf, routing, backend, sorted_copy=True)
    want_copy = dout_inf[routing.gather_token.long()]
    want_copy[padding] = 0.0
    assert torch.equal(copy.view(torch.int16), want_copy.view(torch.int16))
    assert torch.equal(dy_too.view(torch.int16), moe_scale_rows(dout_inf, routing, backend).view(torch.int16))
    # dW2 on a dy formed elsewhere: the same bits as forming it itself; a dy of another shape is refused by name.
    h = torch.randn((routing.padded_rows, inp["w2"].shape[1])).to(device=dout.device, dtype=torch.bfloat16)
    want_dw2 = moe_wgrad_w2(h, dout, routing, backend)
    assert compare_bits(moe_wgrad_w2(h, dout, routing, backend, dy=dy), want_dw2).equal
    with pytest.raises(ValueError, match=r"dy must be moe_scale_rows' bf16"):
        moe_wgrad_w2(h, dout, routing, backend, dy=dy[:-1])


def test_scaled_rows_over_the_routing_bound_have_the_exact_routings_bits(device):
    # The backward forms dy and dout's copy over the routing's bound (no host read): the token-major pass writes each
    # routed row and zeroes each padding row below the real P; with tiles that divide neither T nor H, the same bits
    # as over the exact routing.
    inp = make_inputs(_case("counts:3,0,130,1", t=134, k=1, e=4, seed=23), device)
    pending = launch_routing(inp["topk_ids"], inp["scores"], 4)
    exact, bound = pending.finish(), pending.bound
    p = exact.padded_rows
    assert p < bound.padded_rows
    backend = backend_of(device)
    want_dy = (inp["dout"][exact.gather_token.long()].float() * exact.row_score[:, None]).to(torch.bfloat16)
    want_copy = inp["dout"][exact.gather_token.long()]
    padding = exact.sorted_route < 0
    want_dy[padding], want_copy[padding] = 0.0, 0.0
    assert padding.any()
    dy, copy = moe_scale_rows(inp["dout"], bound, backend, sorted_copy=True,
                              config=GemmConfig(16, 32, 16, 1, 4, 1))  # 134 tokens, 40 columns: tails
    assert torch.equal(dy[:p].view(torch.int16), want_dy.view(torch.int16))
    assert torch.equal(copy[:p].view(torch.int16), want_copy.view(torch.int16))


def test_dgrad_on_expert_ordered_dout_has_the_gathered_bits(device):
    # The backward hands dgrad dout's rows in expert order (read by TMA on sm_90) instead of the gather index: the same
    # A values in the same K order, so dgu and the dscore partials keep their bits: on the table's kernel and on the
    # Triton tiles (pointer and TMA weight loads).
    from detkit.kernels.moe.layer import moe_dgrad_dswiglu_dscore
    inp = make_inputs(_case("masked", t=40, seed=21), device)
    e = inp["w1"].shape[0]
    routing = build_routing(inp["topk_ids"], inp["scores"], e)
    backend = backend_of(device)
    _, saved = moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])
    gu, h = saved.gu[:routing.padded_rows], saved.h[:routing.padded_rows]
    _, sorted_dout = moe_scale_rows(inp["dout"], routing, backend, sorted_copy=True)
    want = moe_dgrad_dswiglu_dscore(inp["dout"], inp["w2"], gu, h, routing, backend)
    for config in (None, GemmConfig(128, 64, 32, 1, 4, 2, "ptr"), GemmConfig(128, 64, 32, 1, 4, 2, "tma")):
        got = moe_dgrad_dswiglu_dscore(inp["dout"], inp["w2"], gu, h, routing, backend, config=config,
                                       sorted_dout=sorted_dout)
        for g, w in zip(got, want):
            assert compare_bits(g, w).equal, config
    with pytest.raises(ValueError, match="sorted_dout must be dout's rows in expert order"):
        moe_dgrad_dswiglu_dscore(inp["dout"], inp["w2"], gu, h, routing, backend, sorted_dout=sorted_dout[:-128])


def test_main_grad_accumulates_fp32_exactly(device):
    inp = make_inputs(_case(t=16, seed=12), device)
    base = run_layer(inp)
    zero = (torch.zeros(inp["w1"].shape, device=device), torch.zeros(inp["w2"].shape, device=device))
    assert run_layer(inp, main_grads=zero)["dw1"] is None
    gen = torch.Generator().manual_seed(1)
    start = (torch.randn(inp["w1"].shape, generator=gen).to(device), torch.randn(inp["w2"].shape, generator=gen).to(device))
    acc = tuple(s.clone() for s in start)
    got = run_layer(inp, main_grads=acc)
    assert got["dw1"] is None and got["dw2"] is None
    for i, name in enumerate(("dw1", "dw2")):
        # From zero the buffer holds the FP32 accumulator itself: the BF16 dW is its one RTNE rounding.
        assert compare_bits(zero[i].to(torch.bfloat16), base[name]).equal, name
        # Into a non-zero buffer: exactly main_grad + dW, one FP32 add per element.
        assert compare_bits(acc[i], start[i] + zero[i]).equal, name
    assert torch.equal(zero[0][1:].abs().sum(dim=(1, 2)) > 0, torch.tensor(build_routing(
        inp["topk_ids"], inp["scores"], E).counts[1:], device=device) > 0)


def test_linear_style_weight_views_and_converters(device):
    inp = make_inputs(_case(t=16, seed=13), device)
    split = deinterleave_gate_up(inp["w1"])
    assert torch.equal(interleave_gate_up(split), inp["w1"])
    assert torch.equal(split[..., :I], inp["w1"][..., 0::2]) and torch.equal(split[..., I:], inp["w1"][..., 1::2])
    # nn.Linear stacks: fc1 [E, 2I, H] split-half rows, fc2 [E, H, I]; passed as strided views.
    fc1 = split.transpose(1, 2).contiguous()
    fc2 = inp["w2"].transpose(1, 2).contiguous()
    w1_view = interleave_gate_up(fc1, dim=1).transpose(1, 2)
    w2_view = fc2.transpose(1, 2)
    assert not w1_view.is_contiguous() and not w2_view.is_contiguous()
    want = run_layer(inp)
    got = run_layer({**inp, "w1": w1_view, "w2": w2_view})
    for name in GRAD_NAMES:
        assert compare_bits(got[name], want[name]).equal, name


def _split_views_case(routing: str, device: torch.device) -> dict:
    """On the GPU at widths the sm_90 table's tiles divide, so the layer's own layout takes the ws and TMA kernels and
    the split views their fallbacks."""
    cuda = device.type == "cuda"
    return make_inputs(_case(routing, t=96 if cuda else 40, h=256 if cuda else H, i=128 if cuda else I, seed=21),
                       device)


@pytest.mark.parametrize("routing", ["random", "masked"])
def test_split_gate_up_views_give_the_interleaved_copy_bits_and_grads_in_the_parameters_layout(routing, device):
    inp = _split_views_case(routing, device)
    want, got = (run_on_parameters(km.moe_mlp, inp, split) for split in (False, True))
    for name in want:
        assert compare_bits(got[name], want[name]).equal, name
    # dW1 and dW2 were written in the parameters' own layouts: autograd kept them as .grad without a layout copy.
    assert got["d_gate_up_proj"].is_contiguous() and got["d_down_proj"].is_contiguous()
    assert not want["d_gate_up_proj"].is_contiguous()  # the layer's own layout is another one


def test_split_gate_up_views_accumulate_main_grads_with_the_interleaved_copy_bits(device):
    inp = _split_views_case("random", device)
    want, got = (run_on_parameters(km.moe_mlp, inp, split, main_grads=True) for split in (False, True))
    for name in want:
        assert compare_bits(got[name], want[name]).equal, name


def test_split_copy_puts_interleaved_columns_into_split_halves_exactly(device):
    # The copy after the ws weight gradient (sm_90): dW1 of interleaved columns into gate_up_proj's layout.
    from detkit.kernels.moe.launch import split_copy

    src = torch.randn(3, 72, 2 * 40, device=device).to(torch.bfloat16)  # R, C not multiples of the copy's tile
    dst = torch.empty(3, 2 * 40, 72, dtype=torch.bfloat16, device=device).transpose(1, 2)
    split_copy(src, dst, backend_of(device))
    assert torch.equal(dst, deinterleave_gate_up(src))


def test_split_layout_audit_row_passes_and_fails_on_one_changed_bit(device):
    from types import SimpleNamespace

    from detkit.audits.moe import run_layer, split_layout_row

    inp = make_inputs(_case(t=16, seed=41), device)
    want = run_layer(inp)
    ctx = SimpleNamespace(backend=backend_of(device))
    row = split_layout_row("moe", ctx, km.moe_mlp, inp, want, "case")
    assert row.passed and row.check == "split_layout" and row.details["grads_in_the_views_layouts"]
    changed = want["dx"].clone()
    changed.view(torch.int16).view(-1)[0] ^= 1  # one bit of one element
    assert not split_layout_row("moe", ctx, km.moe_mlp, inp, {**want, "dx": changed}, "case").passed


def test_split_gate_up_views_refuse_an_explicit_config_that_cannot_read_them(device):
    from detkit.kernels.moe.launch import moe_dx_route

    inp = _split_views_case("random", device)
    r = build_routing(inp["topk_ids"], inp["scores"], E)
    w1 = deinterleave_gate_up(inp["w1"])  # split halves
    dgu = torch.zeros((r.padded_rows, w1.shape[2]), dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=r"dx: variant 'tma' cannot read split gate/up halves along the reduced dim"):
        moe_dx_route(dgu, w1, r, backend_of(device), config=GemmConfig(64, 32, 16, 1, 4, 2, "tma"), gate_up="split")


def test_all_routes_masked_gives_zeros(device):
    inp = make_inputs(_case(t=5, seed=14), device)
    inp["topk_ids"] = torch.full_like(inp["topk_ids"], -1)
    got = run_layer(inp)
    for name in GRAD_NAMES:
        assert (got[name] == 0).all() and not torch.signbit(got[name]).any(), name


@pytest.mark.parametrize("index", range(len(rejection_cases(make_inputs(_case(t=8), "cpu")))))
def test_rejects_before_any_work(index, device):
    inp = make_inputs(_case(t=8), device)
    label, exc_type, change = rejection_cases(inp)[index]
    assert_rejected(moe_mlp_fwd, inp, change, exc_type)


@pytest.fixture
def no_kernel_queued(monkeypatch):
    """The layer's first kernel (the routing) and, in a backward, its first GEMM fail the test."""
    forbid_kernels(monkeypatch, km, "launch_checked_routing", "moe_dgrad_dswiglu_dscore")


@pytest.mark.parametrize(("kwargs", "exc_type", "match"), [
    ({"main_grads": 1}, TypeError, r"main_grads must be a pair \(main_grad_w1, main_grad_w2\) or None; got int"),
    ({"main_grads": (None, None, None)}, TypeError, "main_grads must be a pair .* got tuple"),
    ({"main_grads": ("a", "b")}, TypeError, "main_grad_w1 must be a float32 tensor; got str"),
    ({"main_grads": "wrong"}, TypeError, "main_grads must be a pair .* got str"),
    ({"gate_up": "halves"}, ValueError, r"gate_up 'halves' is not supported; supported: \('interleaved', 'split'\)"),
], ids=["int", "triple", "strings", "str", "gate_up"])
def test_moe_mlp_refuses_a_bad_main_grads_before_any_kernel(kwargs, exc_type, match, device, no_kernel_queued):
    inp = make_inputs(_case(t=8), device)
    with pytest.raises(exc_type, match=match):
        km.moe_mlp(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"], **kwargs)


def test_moe_mlp_fwd_refuses_a_stage_range_that_is_not_callable(device, no_kernel_queued):
    inp = make_inputs(_case(t=8), device)
    with pytest.raises(TypeError, match=r"stage_range must be a callable \(stage name -> context manager\) or None; "
                                        "got str"):
        moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"], stage_range="nvtx")


@pytest.mark.parametrize(("kwargs", "exc_type", "match"), [
    ({"main_grads": 1}, TypeError, "main_grads must be a pair .* got int"),
    ({"main_grads": (torch.zeros(3), torch.zeros(3))}, ValueError, r"main_grad_w1 must match its weight's shape"),
    ({"stage_range": 5}, TypeError, "stage_range must be a callable .* got int"),
], ids=["main_grads-int", "main_grads-shape", "stage_range"])
def test_moe_mlp_bwd_refuses_bad_keywords_before_any_kernel(kwargs, exc_type, match, device, monkeypatch):
    inp = make_inputs(_case(t=8), device)
    _, saved = moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])
    forbid_kernels(monkeypatch, km, "moe_dgrad_dswiglu_dscore")
    with pytest.raises(exc_type, match=match):
        km.moe_mlp_bwd(inp["dout"], saved, **kwargs)
    with pytest.raises(TypeError, match="saved must be the MoeSaved of moe_mlp_fwd; got dict"):
        km.moe_mlp_bwd(inp["dout"], {"x": inp["x"]})


@pytest.mark.parametrize("name", ["x", "w1", "w2", "topk_ids", "scores"])
def test_inputs_whose_storage_does_not_cover_the_view_are_refused(name, device, no_kernel_queued):
    # A freed storage (resize_(0)) under an intact view: the kernels would read outside it.
    inp = make_inputs(_case(t=8), device)
    inp[name] = inp[name].clone()
    inp[name].untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=rf"{name} \(shape .*\) reaches byte \d+ of a storage that holds 0 bytes; "
                                         "supported: views inside their storage"):
        km.moe_mlp(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])


def test_a_main_grad_or_dout_whose_storage_does_not_cover_the_view_is_refused(device, monkeypatch):
    inp = make_inputs(_case(t=8), device)
    _, saved = moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])
    forbid_kernels(monkeypatch, km, "moe_dgrad_dswiglu_dscore")
    shrunk = torch.zeros(inp["w1"].shape, device=device)
    shrunk.untyped_storage().resize_(4 * 10)
    with pytest.raises(ValueError, match=r"main_grad_w1 \(shape .*\) reaches byte \d+ of a storage that holds 40 bytes"):
        km.moe_mlp_bwd(inp["dout"], saved, main_grads=(shrunk, torch.zeros(inp["w2"].shape, device=device)))
    dout = inp["dout"].clone()
    dout.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=r"dout \(shape .*\) reaches byte \d+ of a storage that holds 0 bytes"):
        km.moe_mlp_bwd(dout, saved)


def test_fresh_process_gives_the_same_bits(device):
    from detkit.audits.moe import case_digests, fresh_process_digests

    case = _case(t=8, k=1, e=2, h=16, i=16, seed=15)
    assert fresh_process_digests([case], device)[case.name] == case_digests(case, device)


# Compiles every kernel variant for sm_90 without a GPU (Triton's bundled ptxas), with the
# specialisation a real launch gets (16-divisible pointers and sizes, unit inner strides): catches
# GPU-only compile errors in CI and checks the GEMMs use wgmma and a pipelined (cp.async) K loop.
_SM90_COMPILE = r'''
import json, sys, triton
from tools.gemm_sass import cuobjdump_bytes, stack_bytes
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import detkit.kernels.moe.kernels as km
from detkit.kernels.moe.common import DS_CHUNK
from detkit.kernels.moe.configs import MOE_CONFIGS
from detkit.kernels.moe.launch import triton_tile
target = GPUTarget("cuda", 90, 32)
cfgs = {k: triton_tile(v) for k, v in MOE_CONFIGS["cuda_sm90"].items()}  # the Triton tiles of the table's picks
def build(fn, ptrs, consts, unit):
    consts = {**consts, **{n: 1 for n in unit}}
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    div = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
           if n not in consts and n not in ("op_id", "K") and not sig[n].startswith("tensordesc")}  # multiples of 16
    cfg = consts.pop("cfg", None)
    opts = {"num_warps": cfg.num_warps if cfg else 4, "num_stages": cfg.num_stages if cfg else 1}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=div), target=target, options=opts)
    ptx = k.asm["ptx"]
    return {"wgmma": ptx.count("wgmma.mma_async"), "cp_async": ptx.count("cp.async"),
            "tma": ptx.count("cp.async.bulk.tensor"), "shared": k.metadata.shared,
            "stack": stack_bytes(cuobjdump_bytes("--dump-resource-usage", k.asm["cubin"], sys.argv[1]))}
out = {}
g = km.moe_grouped_gemm_kernel
for stage, epi, gather, c_t in (("up", 1, True, "*bf16"), ("down", 0, False, "*fp32"), ("dgrad", 2, True, "*bf16"), ("dx", 0, False, "*fp32")):
    c = cfgs[stage]
    ptrs = {"a_ptr": "*bf16", "a_rows_ptr": "*i32", "b_ptr": "*bf16", "c_ptr": c_t, "aux_ptr": "*bf16",
            "h_ptr": "*bf16", "ds_ptr": "*fp32", "route_ptr": "*i32", "score_ptr": "*fp32", "tile_expert_ptr": "*i32",
            "gate_ptr": "*i32"}
    out[stage] = build(g, ptrs, {"cfg": c, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k,
                       "STEP_K": c.block_k, "SEGMENT": 128, "GATHER_A": gather, "EPILOGUE": epi, "INTERPRETED": False,
                       "DSCORE": stage == "dgrad", "DS_CHUNK": DS_CHUNK, "B_SPLIT": 0, "GROUP_M": 8},
                       ("stride_al", "stride_bl" if stage in ("dgrad", "dx") else "stride_bc", "stride_cc", "stride_xc"))
t = km.moe_grouped_gemm_tma_kernel
# GROUP_M: the grouped tile order at 1 (row-major) and 8 (bands of row tiles)
for name, stage, epi, gather, c_t, k_major, split, group_m in (("up_tma", "up", 1, True, "*bf16", False, False, 8),
                                                               ("up_tma_kmajor", "up", 1, True, "*bf16", True, False, 1),
                                                               ("up_tma_split", "up", 1, True, "*bf16", True, True, 8),
                                                               ("dgrad_tma", "dgrad", 2, True, "*bf16", True, False, 8),
                                                               ("dx_tma", "dx", 0, False, "*fp32", True, False, 1)):
    c = cfgs[stage]
    width = c.block_n // 2 if split else c.block_n
    box = [1, width, c.block_k] if k_major else [1, c.block_k, width]
    ptrs = {"a_ptr": "*bf16", "a_rows_ptr": "*i32", "b_desc": f"tensordesc<bf16{box}>", "c_ptr": c_t,
            "aux_ptr": "*bf16", "h_ptr": "*bf16", "ds_ptr": "*fp32", "route_ptr": "*i32", "score_ptr": "*fp32",
            "tile_expert_ptr": "*i32", "gate_ptr": "*i32"}
    out[name] = build(t, ptrs, {"cfg": c, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k,
                      "STEP_K": c.block_k, "SEGMENT": 128, "GATHER_A": gather, "EPILOGUE": epi, "INTERPRETED": False,
                      "B_K_MAJOR": k_major, "DSCORE": stage == "dgrad", "DS_CHUNK": DS_CHUNK, "B_SPLIT_HALVES": split,
                      "GROUP_M": group_m},
                      ("stride_al", "stride_cc", "stride_xc"))
w, c = km.moe_wgrad_kernel, cfgs["wgrad"]
for name, ga, acc, split, group_m in (("wgrad_w1", True, False, False, 8), ("wgrad_w2", False, False, False, 1),
                                      ("wgrad_main_grad", True, True, False, 8), ("wgrad_w1_split", True, False, True, 1)):
    ptrs = {"a_ptr": "*bf16", "b_ptr": "*bf16", "rows_ptr": "*i32", "score_ptr": "*fp32",
            "dw_ptr": "*fp32" if acc else "*bf16", "offsets_ptr": "*i32", "counts_ptr": "*i32",
            "gate_ptr": "*i32"}
    out[name] = build(w, ptrs, {"cfg": c, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k,
                      "STEP_K": c.block_k, "GATHER_A": ga, "ACCUMULATE": acc, "INTERPRETED": False, "SPLIT_C": split,
                      "GROUP_M": group_m},
                      ("stride_ar", "stride_bc", "stride_wr" if split else "stride_wc"))
c = cfgs["combine"]
for copy in (False, True):
    out[f"scale_rows_{copy}"] = build(km.moe_scale_rows_kernel, {"src_ptr": "*bf16", "route_row_ptr": "*i32",
                                      "row_score_ptr": "*fp32", "route_ptr": "*i32", "gate_ptr": "*i32", "out_ptr": "*bf16",
                                      "copy_ptr": "*bf16"}, {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "PAD_ROWS": 128,
                                      "COPY": copy, "INTERPRETED": False}, ("stride_sn", "stride_rk", "stride_on", "stride_cn"))
for scaled in (True, False):
    out[f"combine_{scaled}"] = build(km.moe_combine_kernel, {"src_ptr": "*fp32", "route_row_ptr": "*i32", "score_ptr": "*fp32", "gate_ptr": "*i32",
                                     "out_ptr": "*bf16"}, {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "SCALED": scaled,
                                     "INTERPRETED": False}, ("stride_sn", "stride_on"))
c = cfgs["dscore"]
out["dscore_sum"] = build(km.moe_dscore_sum_kernel, {"part_ptr": "*fp32", "route_row_ptr": "*i32", "gate_ptr": "*i32",
                                                    "ds_ptr": "*fp32"},
                          {"BLOCK_M": c.block_m, "NCH_POW2": 32}, ("stride_rk", "stride_sk"))
import detkit.kernels.moe.routing as kr
blocks = {"BLOCK": kr.ROUTE_BLOCK, "EXPERT_BLOCK": kr.EXPERT_BLOCK}
out["route_hist"] = build(kr.moe_route_hist_kernel, {"ids_ptr": "*i32", "score_ptr": "*fp32", "hist_ptr": "*i32"},
                          blocks, ("stride_ik", "stride_sk"))
out["route_scan"] = build(kr.moe_route_scan_kernel, {"hist_ptr": "*i32", "prefix_ptr": "*i32", "meta_ptr": "*i32"},
                          {"BLOCK_W": 32, "BLOCK_C": 64}, ())
out["route_scatter"] = build(kr.moe_route_scatter_kernel, {n: "*fp32" if n in ("score_ptr", "row_score_ptr") else "*i32"
                             for n in kr.moe_route_scatter_kernel.arg_names if n.endswith("_ptr")},
                             {**blocks, "ROWS": kr.ROW_BLOCK, "SEGMENT": kr.SEGMENT_ALIGN, "NUM_CHECKS": kr.NUM_CHECKS},
                             ("stride_ik", "stride_sk"))
print(json.dumps(out))
'''


def test_kernels_compile_for_sm90_offline(tmp_path):
    report = compile_sm90_offline(_SM90_COMPILE, tmp_path, str(tmp_path))
    for stage in ("up", "down", "dgrad", "dx", "wgrad_w1", "wgrad_w2", "wgrad_main_grad", "wgrad_w1_split"):
        assert report[stage]["wgmma"] > 0, (stage, report[stage])
    for stage in ("up", "down", "dgrad", "dx"):
        assert report[stage]["cp_async"] > 0, (stage, report[stage])  # the K loop is software-pipelined
    for stage in ("up_tma", "up_tma_kmajor", "up_tma_split", "dgrad_tma", "dx_tma"):  # weight tiles by TMA, into wgmma
        assert report[stage]["tma"] > 0 and report[stage]["wgmma"] > 0, (stage, report[stage])
    for stage in ("dgrad", "dgrad_tma"):  # with the fused dscore partials: no register spills
        assert report[stage]["stack"] == 0, (stage, report[stage])
    assert {"route_hist", "route_scan", "route_scatter"} <= set(report)  # the routing kernels compile too


def test_up_gemm_queued_before_the_read_is_gated_by_the_routing(device):
    # The forward queues the up GEMM over the largest possible P before the host reads the counts.
    # Rows below P: the same bits as over the exact routing; rows from P on, and every row of a batch
    # the checks refuse: not written at all (the sentinel stays).
    backend = backend_of(device)
    inp = make_inputs(_case("counts:3,0,130,1", t=134, k=1, e=4, seed=21), device)
    pending = launch_routing(inp["topk_ids"], inp["scores"], 4)
    exact = pending.finish()
    bound = pending.bound
    p, p_max = exact.padded_rows, bound.padded_rows
    assert p == 4 * 128 and p_max == max_padded_rows(134, 4) == 5 * 128 and bound.gate.tolist() == [p, 0, 0, 0]
    want_gu, want_h = moe_up_swiglu(inp["x"], inp["w1"], exact, backend)
    two_i, hidden = inp["w1"].shape[2], inp["w1"].shape[1]

    def up_over(routing):
        gu = torch.full((p_max, two_i), float("nan"), dtype=torch.bfloat16, device=device)
        h = torch.full((p_max, two_i // 2), float("nan"), dtype=torch.bfloat16, device=device)
        _grouped(0, "up", inp["x"], True, inp["w1"], gu, h, routing, two_i, hidden, EPI_SWIGLU, backend, None)
        return gu, h

    gu, h = up_over(bound)
    assert torch.equal(gu[:p], want_gu) and torch.equal(h[:p], want_h)
    assert gu[p:].isnan().all() and h[p:].isnan().all()
    refused = bound.gate.clone()
    refused[2] = 1  # one duplicate id flagged by the routing kernels
    gu, h = up_over(replace(bound, gate=refused))
    assert gu.isnan().all() and h.isnan().all()


def test_table_tma_pick_falls_back_to_the_same_tile_when_tma_cannot_address_the_weight():
    w = torch.zeros((2, 256, 256), dtype=torch.bfloat16)
    table = km.select_moe_config("up", "cuda_sm90")
    assert table.variant == "tma"
    assert km.table_moe_config("up", "cuda_sm90", w) == table
    assert km.table_moe_config("up", "cuda_sm90", w.transpose(1, 2)) == table  # K-major: TMA too
    odd = w[:, :, ::2]  # no unit-stride dim: TMA cannot describe it
    assert km.table_moe_config("up", "cuda_sm90", odd) == replace(table, variant="ptr")
    with pytest.raises(ValueError, match="variant 'tma' cannot describe the weight"):
        km.weight_descriptor(odd, table.block_n, table.block_k)


def test_table_ws_pick_falls_back_to_the_same_tile_when_the_ws_kernel_cannot_address_the_weight():
    table = km.select_moe_config("down", "cuda_sm90")
    assert table.variant == "ws"
    w = torch.zeros((2, 256, 256), dtype=torch.bfloat16)  # [E, L, C]
    assert km.table_moe_config("down", "cuda_sm90", w) == table
    assert km.table_moe_config("down", "cuda_sm90", w.transpose(1, 2)) == table  # K-major storage
    narrow = torch.zeros((2, 256, 192), dtype=torch.bfloat16)  # C = 192: BLOCK_N 128 does not divide it
    assert km.table_moe_config("down", "cuda_sm90", narrow) == replace(table, variant="tma")
    sliced = torch.zeros((4, 256, 256), dtype=torch.bfloat16)[::2]  # experts not flattenable into TMA rows
    assert km.ws_weight_rows(sliced) is None
    assert km.table_moe_config("down", "cuda_sm90", sliced) == replace(table, variant="tma")
    odd = w[:, :, ::2]  # no unit-stride dim: TMA cannot describe it at all
    assert km.table_moe_config("down", "cuda_sm90", odd) == replace(table, variant="ptr")
    # dgrad's 12-warp tile (an epilogue warpgroup beside two MMA ones) falls back on the Triton tile of 8 warps.
    dgrad = km.select_moe_config("dgrad", "cuda_sm90")
    assert (dgrad.variant, dgrad.num_warps) == ("ws", 12)
    assert km.table_moe_config("dgrad", "cuda_sm90", sliced) == replace(dgrad, variant="tma", num_warps=8)


@pytest.mark.gpu
def test_tma_stage_runs_on_a_thread_without_a_cuda_context(device):
    # Autograd runs the backward on its own worker thread; Triton encodes a TMA descriptor before its
    # launcher binds a context there, so the launch must bind one first (kernels.backend.ensure_cuda_context).
    import threading

    inp = make_inputs(_case(t=16, seed=13), device)
    r = build_routing(inp["topk_ids"], inp["scores"], E)
    backend = "cuda_sm90"
    tma = km.triton_tile(km.select_moe_config("dgrad", backend))
    gu, _ = moe_up_swiglu(inp["x"], inp["w1"], r, backend)
    want = km.moe_dgrad_dswiglu(inp["dout"], inp["w2"], gu, r, backend, config=tma)
    got, errors = [], []

    def worker():
        try:
            got.append(km.moe_dgrad_dswiglu(inp["dout"], inp["w2"], gu, r, backend, config=tma))
        except Exception as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors, errors
    assert compare_bits(got[0], want).equal


def test_moe_kernels_refuse_det_gemms_three_sub_tile_variant():
    wide = GemmConfig(128, 192, 64, 8, 8, 4, "tma3")
    with pytest.raises(ValueError, match=r"up: variant 'tma3' is not supported by the MoE kernels; supported: \('ptr', 'tma'\)"):
        check_grouped_config("up", wide)
    with pytest.raises(ValueError, match=r"wgrad: variant 'tma3' is not supported by the MoE kernels"):
        check_moe_variant("wgrad", wide)
    with pytest.raises(ValueError, match=r"wgrad: variant 'ws' is not supported by the MoE kernels"):
        check_moe_variant("wgrad", GemmConfig(128, 128, 64, 8, 8, 4, "ws"))


def test_layer_stage_names_are_built_once_per_shape_and_read_only():
    from detkit.kernels.moe.common import FP8_LAYER_STAGES, LAYER_STAGES, layer_stage_names, stage_name

    x, w1 = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(4, 32, 96, dtype=torch.bfloat16)
    names = layer_stage_names(x, w1, 2)
    assert list(names) == list(LAYER_STAGES)
    assert names["down"] == stage_name("moe_down", T=64, H=32, I=48, E=4, K=2)
    assert layer_stage_names(x, w1, 2) is names  # the same shape: the names are not formatted again
    fp8 = layer_stage_names(x, w1, 2, FP8_LAYER_STAGES, "fp8")
    assert fp8["down"] == stage_name("moe_down", "fp8", T=64, H=32, I=48, E=4, K=2)
    assert layer_stage_names(x, w1, 1)["down"] == stage_name("moe_down", T=64, H=32, I=48, E=4, K=1)
    with pytest.raises(TypeError):  # shared between calls, so nobody may change them
        names["down"] = "other"
