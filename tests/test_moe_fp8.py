"""The FP8 MoE expert MLP against its references: every stage within the derived block-scaled bound of an
FP64 oracle of its own dequantized operands, the quantizers and the fused epilogue quantizations bit for
bit, the whole layer against the plain-torch FP8 recipe (moe_mlp_fp8_ref), determinism, per-token batch
invariance, the weight cache's invalidation, main_grad, refusals, the precision gate, and the sm_90
compile (wgmma on e4m3). Tiny shapes on the interpreter (H = I = 128: one FP8 block); the `gpu` tests
run the gate at a moderately large shape with DETKIT_TEST_DEVICE=cuda."""

from dataclasses import replace
from functools import partial

import pytest
import torch

from detkit.audits.moe_fp8 import (
    EMULATION_REL_L2, GATE_MAX_REL_RMSE, GATE_MIN_COSINE, GATE_SHAPE, bf16_path_layer, fp8_rejection_cases,
    fp8_stage_checks, gate_passed, make_inputs, precision_stats, run_layer, weight_cache_checks,
)
from detkit.audits.moe import GRAD_NAMES, MoeCase
from detkit.kernels.det_gemm.launch import GemmConfig
import detkit.kernels.moe.fp8.layer as kf
from detkit.kernels.moe.fp8.quant import QBLOCK, dequantize_rowwise, quantize_rowwise, quantize_rowwise_ref, quantize_weight
from detkit.kernels.moe.common import EPI_FP8_SWIGLU, EPI_FP8_SWIGLU_QUANT
from detkit.kernels.moe.fp8.layer import (
    MOE_FP8_CONFIGS, Fp8WeightCache, moe_fp8_dgrad, moe_fp8_dgrad_dswiglu, moe_fp8_down, moe_fp8_risk,
    moe_fp8_up_swiglu, moe_mlp_fp8, moe_mlp_fp8_bwd, moe_mlp_fp8_fwd, moe_mlp_fp8_ref, select_moe_fp8_config,
)
from detkit.kernels.moe.fp8.launch import _grouped
from detkit.kernels.moe.layer import deinterleave_gate_up, moe_mlp_ref
from detkit.kernels.moe.routing import build_routing, launch_routing
from detkit.toolkit.contract import compare_bits, rel_l2
from tests.conftest import backend_of
from tests.moe_helpers import (
    FP8_TRITON_TILES, assert_forward_batch_invariant, assert_rejected, assert_stages, compile_sm90_offline,
    fp8_stage_runs, forbid_kernels, layer_args, run_on_parameters,
)

H, I, E, K = 128, 128, 3, 2


def _case(routing="random", t=24, k=K, e=E, h=H, i=I, seed=3):
    return MoeCase(t, h, i, e, k, routing, seed)


def emulation_limit(device: torch.device) -> float:
    """The emulation bound of the backend that ran on ``device`` (FP32 accumulation on the interpreter)."""
    return EMULATION_REL_L2[backend_of(device)]


@pytest.fixture(scope="module")
def base():
    """One input set, run twice (forward + backward); shared by the tests that only read it."""
    from tests.conftest import TEST_DEVICE

    inp = make_inputs(_case(), torch.device(TEST_DEVICE))
    return inp, run_layer(inp), run_layer(inp)


def _assert_stages(inp):
    extra = assert_stages(fp8_stage_checks, inp)
    assert all(extra["quantizers_bitwise"].values()), extra


@pytest.mark.parametrize("case", [_case("masked", t=16, seed=4), _case("random", t=1, seed=7)],
                         ids=lambda c: f"{c.routing}-T{c.t}")
def test_every_stage_within_derived_bound(case, device):
    _assert_stages(make_inputs(case, device))


def test_repeat_bitwise_and_equals_the_fp8_recipe_reference(base):
    inp, first, second = base
    for name in GRAD_NAMES:
        res = compare_bits(first[name], second[name])
        assert res.equal, (name, res)
    ref = moe_mlp_fp8_ref(*layer_args(inp), inp["dout"])
    for name in GRAD_NAMES:
        assert rel_l2(first[name], ref[name]) <= emulation_limit(first[name].device), name


def test_block_scales_are_applied_per_row_block_and_weight_block(device):
    # Blocks whose magnitudes differ by up to 2**9 (x) and 2**8 (w1): a scale read from the wrong row, K block or N block
    # (or a missing promotion) is off by powers of two, far outside EMULATION_REL_L2.
    case = _case(t=8, h=2 * QBLOCK, seed=21)
    inp = make_inputs(case, device)
    gen = torch.Generator().manual_seed(22)
    x_mag = 2.0 ** torch.randint(-6, 4, (case.t, 2), generator=gen).float().repeat_interleave(QBLOCK, 1)
    w1_mag = 2.0 ** torch.randint(-6, 3, (E, 2, 2), generator=gen).float()
    w1_mag = w1_mag.repeat_interleave(QBLOCK, 1).repeat_interleave(QBLOCK, 2)
    inp["x"] = (inp["x"].float() * x_mag.to(device)).bfloat16()
    inp["w1"] = (inp["w1"].float() * w1_mag.to(device)).bfloat16()
    got = run_layer(inp)
    ref = moe_mlp_fp8_ref(*layer_args(inp), inp["dout"])
    for name in GRAD_NAMES:
        assert rel_l2(got[name], ref[name]) <= emulation_limit(got[name].device), name


def test_forward_batch_invariance_per_token(device):
    case = _case(t=16, seed=10)
    inp = make_inputs(case, device)
    cache = Fp8WeightCache()  # every variant shares the weights: quantize them once
    assert_forward_batch_invariant(partial(moe_mlp_fp8_fwd, weight_cache=cache), inp, case, 10)


def test_interpreter_bits_do_not_depend_on_tile_config(device):
    if device.type != "cpu":
        pytest.skip("interpreter property: sequential accumulation makes every config give the same bits")
    inp = make_inputs(_case(t=16, seed=11), device)
    r = build_routing(inp["topk_ids"], inp["scores"], E)

    x_q, x_s = quantize_rowwise(inp["x"])
    w1f, w2f = quantize_weight(inp["w1"]), quantize_weight(inp["w2"])
    b = "triton_interpreter"
    up_a = moe_fp8_up_swiglu(x_q, x_s, w1f, r, b)
    up_b = moe_fp8_up_swiglu(x_q, x_s, w1f, r, b, config=GemmConfig(32, 2 * QBLOCK, 32, 1, 4, 1))
    for a, c in zip(up_a, up_b):
        assert compare_bits(a, c).equal
    y_a = moe_fp8_down(up_a[2], up_a[3], w2f, r, b)
    y_b = moe_fp8_down(up_a[2], up_a[3], w2f, r, b, config=GemmConfig(64, 64, 64, 1, 4, 1))
    assert compare_bits(y_a, y_b).equal


def test_dscore_partials_sum_in_a_fixed_order_whatever_the_tile(device):
    # The FP8 dgrad's dscore partials: groups of 16 columns summed in the order the reshapes and splits fix, so two
    # tiles (64 and 128 columns wide, different warps) give the same bits on every backend; their per-row sum is
    # (dout_q @ W2q^T) . h of the FP64 oracle; padding rows' partials are zero.
    inp = make_inputs(_case(t=24, h=256, i=256, seed=14), device)
    r = build_routing(inp["topk_ids"], inp["scores"], E)
    b = backend_of(device)
    x_q, x_s = quantize_rowwise(inp["x"])
    d_q, d_s = quantize_rowwise(inp["dout"])
    w1f, w2f = quantize_weight(inp["w1"]), quantize_weight(inp["w2"])
    gu, h = moe_fp8_up_swiglu(x_q, x_s, w1f, r, b)[:2]
    parts = [moe_fp8_dgrad(d_q, d_s, w2f, gu, r, b, config=c, h=h)[3]
             for c in (GemmConfig(128, 64, 128, 1, 4, 2), GemmConfig(64, 128, 128, 1, 8, 2))]
    assert parts[0].shape == (r.padded_rows, 256 // 16)
    assert compare_bits(parts[0], parts[1]).equal
    valid = r.sorted_route[: r.padded_rows] >= 0
    assert bool((parts[0][~valid] == 0).all())
    tok = r.gather_token[: r.padded_rows].long()
    exp = r.tile_expert.long().repeat_interleave(QBLOCK)[: r.padded_rows]  # 128-row segments
    w2_d, d_d = w2f.dequantize().double(), dequantize_rowwise(d_q, d_s).double()
    want, want_abs = (torch.zeros(r.padded_rows, dtype=torch.float64, device=device) for _ in range(2))
    for e in range(E):
        m = valid & (exp == e)
        want[m] = ((d_d[tok[m]] @ w2_d[e].t()) * h[m].double()).sum(1)
        want_abs[m] = ((d_d[tok[m]].abs() @ w2_d[e].abs().t()) * h[m].double().abs()).sum(1)
    # Within the accumulation's error relative to sum |dh| |h| (FP32 on the interpreter; the FP8 wgmma's ~14-bit
    # block accumulation on the GPU): a partial from a wrong column, scale or row is off by O(1).
    tol = 1e-5 if b == "triton_interpreter" else 2.0**-6
    assert bool(((parts[0].double().sum(1) - want).abs() <= tol * want_abs).all())
    with pytest.raises(ValueError, match="h must be the forward's contiguous"):
        moe_fp8_dgrad(d_q, d_s, w2f, gu, r, b, h=h[:, :128])


def test_tma_weight_tile_gives_the_pointer_kernels_bits(device):
    # The variant changes the weight's load path only (same tile, same K order): same bits on every backend,
    # including a 256-wide down tile whose upper half lies past C = H = 128 (TMA zero fill vs masked load).
    inp = make_inputs(_case(t=16, seed=13), device)
    r = build_routing(inp["topk_ids"], inp["scores"], E)
    b = backend_of(device)
    runs = fp8_stage_runs(inp, r, b)[0]
    # (The pinned "ws" tiles run here as the Triton kernel's tile; 3 stages keep the wide tile within shared memory.)
    down = select_moe_fp8_config("down", b)
    wide_down = replace(down, block_n=2 * QBLOCK, num_stages=min(down.num_stages, 3))
    for stage, config in [*((st, select_moe_fp8_config(st, b)) for st in runs), ("down", wide_down)]:
        ptr_out = runs[stage](replace(config, variant="ptr"))
        tma_out = runs[stage](replace(config, variant="tma"))
        for name, (p, t) in enumerate(zip(ptr_out, tma_out)):
            assert compare_bits(p, t).equal, (stage, config, name)


def test_up_gemm_queued_before_the_read_is_gated_by_the_routing(device):
    # The FP8 forward queues its up GEMM over the largest possible P before the host reads the counts (the pinned
    # tile: the Gluon kernel on sm_90, the Triton kernel on the interpreter). Rows below P: the exact routing's
    # bits; rows from P on, and every row of a batch the checks refuse: not written at all (the sentinel stays).
    backend = backend_of(device)
    inp = make_inputs(_case("counts:3,0,130,1", t=134, k=1, e=4, seed=21), device)
    pending = launch_routing(inp["topk_ids"], inp["scores"], 4)
    exact, bound = pending.finish(), pending.bound
    p, p_max = exact.padded_rows, bound.padded_rows
    assert p == 4 * 128 and p_max == 5 * 128 and bound.gate.tolist() == [p, 0, 0, 0]
    x_q, x_s = quantize_rowwise(inp["x"])
    w1f = quantize_weight(inp["w1"])
    want_gu, want_h = moe_fp8_up_swiglu(x_q, x_s, w1f, exact, backend)[:2]
    config = select_moe_fp8_config("up", backend)
    fused = config.block_n == 2 * QBLOCK
    two_i = w1f.q.shape[2]

    def up_over(routing):
        gu, h = (torch.full((p_max, n), float("nan"), dtype=torch.bfloat16, device=device) for n in (two_i, two_i // 2))
        h_q = torch.empty((p_max, two_i // 2), dtype=torch.float8_e4m3fn, device=device) if fused else None
        h_s = torch.empty((p_max, two_i // 2 // QBLOCK), dtype=torch.float32, device=device) if fused else None
        _grouped(0, "up", x_q, x_s, True, w1f.q_t, w1f.scale, gu, h, h_q, h_s, routing,
                 EPI_FP8_SWIGLU_QUANT if fused else EPI_FP8_SWIGLU, backend, config)
        return gu, h

    gu, h = up_over(bound)
    assert compare_bits(gu[:p], want_gu).equal and compare_bits(h[:p], want_h).equal
    assert gu[p:].isnan().all() and h[p:].isnan().all()
    refused = bound.gate.clone()
    refused[2] = 1  # one duplicate id flagged by the routing kernels
    gu, h = up_over(replace(bound, gate=refused))
    assert gu.isnan().all() and h.isnan().all()


def test_dgrad_with_two_scale_blocks_per_row_quantizes_like_the_reference(device):
    # A 128-column dh tile: its dgu row holds two 1x128 blocks, each quantized as quantize_rowwise does.
    inp = make_inputs(_case(t=16, i=256, seed=14), device)
    r = build_routing(inp["topk_ids"], inp["scores"], E)

    b = backend_of(device)
    x_q, x_s = quantize_rowwise(inp["x"])
    dout_q, dout_s = quantize_rowwise(inp["x"].flip(0))
    w1f, w2f = quantize_weight(inp["w1"]), quantize_weight(inp["w2"])
    gu = moe_fp8_up_swiglu(x_q, x_s, w1f, r, b)[0]
    pinned = select_moe_fp8_config("dgrad", b)  # on sm_90 the Gluon kernel: its two-block epilogue
    wide = moe_fp8_dgrad_dswiglu(dout_q, dout_s, w2f, gu, r, b, config=replace(pinned, block_n=QBLOCK))
    q_ref, s_ref = quantize_rowwise_ref(wide[0])
    assert compare_bits(wide[1], q_ref).equal and compare_bits(wide[2], s_ref).equal
    if device.type == "cpu":  # the interpreter's sequential accumulation: the pinned tile's bits too
        for got, want in zip(wide, moe_fp8_dgrad_dswiglu(dout_q, dout_s, w2f, gu, r, b)):
            assert compare_bits(got, want).equal
    with pytest.raises(ValueError, match=r"needs BLOCK_N in \(64, 128\); got 32"):
        moe_fp8_dgrad_dswiglu(dout_q, dout_s, w2f, gu, r, b, config=replace(pinned, block_n=32))


def test_up_tile_narrower_than_a_quant_block_quantizes_h_in_a_row_wise_pass(device):
    # A 128-column up tile holds 64 h columns, half a 1x128 block: h_q, h_s come from the row-wise quantizer
    # over the stored h, which is the fused epilogue's definition (quantize_rowwise(h)): the same values.
    inp = make_inputs(_case(t=16, i=256, seed=15), device)
    r = build_routing(inp["topk_ids"], inp["scores"], E)

    b = backend_of(device)
    x_q, x_s = quantize_rowwise(inp["x"])
    w1f = quantize_weight(inp["w1"])
    pinned = select_moe_fp8_config("up", b)
    for variant in ("ptr", "tma"):
        narrow = moe_fp8_up_swiglu(x_q, x_s, w1f, r, b, config=replace(pinned, block_n=QBLOCK, variant=variant))
        q_ref, s_ref = quantize_rowwise_ref(narrow[1])
        assert compare_bits(narrow[2], q_ref).equal and compare_bits(narrow[3], s_ref).equal
        if device.type == "cpu":  # the interpreter's sequential accumulation: the pinned tile's bits too
            for got, want in zip(narrow, moe_fp8_up_swiglu(x_q, x_s, w1f, r, b)):
                assert compare_bits(got, want).equal
    masked = build_routing(torch.full_like(inp["topk_ids"], -1), inp["scores"], E)  # no routed row: P = 0
    empty = moe_fp8_up_swiglu(x_q, x_s, w1f, masked, b, config=replace(pinned, block_n=QBLOCK))
    assert [tuple(t.shape) for t in empty] == [(0, 512), (0, 256), (0, 256), (0, 2)]


def test_weight_cache_hit_and_invalidated_by_optimizer_step(device):
    checks = weight_cache_checks(make_inputs(_case(t=4, seed=12), device))
    assert all(checks.values()), checks


def test_main_grad_accumulates_fp32(base):
    inp, first, _ = base
    zero = tuple(torch.zeros(inp[n].shape, device=inp[n].device) for n in ("w1", "w2"))
    got = run_layer(inp, main_grads=zero)
    assert got["dw1"] is None and got["dw2"] is None
    for i, name in enumerate(("dw1", "dw2")):  # the FP32 accumulator's one RTNE rounding is the BF16 dW
        assert compare_bits(zero[i].to(torch.bfloat16), first[name]).equal, name


def test_bf16_weight_gradients_match_the_recipe_and_accumulate(base):
    # The mode beside the default (wgrad="fp8", which the base run and the tests above cover).
    inp, first, _ = base
    got = run_layer(inp, wgrad="bf16")
    ref = moe_mlp_fp8_ref(*layer_args(inp), inp["dout"], wgrad="bf16")
    for name in GRAD_NAMES:
        assert rel_l2(got[name], ref[name]) <= emulation_limit(got[name].device), name
    for name in ("out", "dx", "dscores"):  # the weight-gradient mode changes nothing else
        assert compare_bits(got[name], first[name]).equal, name
    assert not compare_bits(got["dw1"], first["dw1"]).equal  # the two modes differ where they should
    zero = tuple(torch.zeros(inp[n].shape, device=inp[n].device) for n in ("w1", "w2"))
    assert run_layer(inp, main_grads=zero, wgrad="bf16")["dw1"] is None
    for i, name in enumerate(("dw1", "dw2")):
        assert compare_bits(zero[i].to(torch.bfloat16), got[name]).equal, name
    with pytest.raises(ValueError, match="wgrad"):
        run_layer(inp, wgrad="fp16")


def test_fp8_wgrad_tma_variant_gives_the_pointer_kernels_bits(device):
    # The TMA variant loads both column-wise operands by descriptor and requests each 128-row block's scales
    # one block ahead: the same products in the same order, so the same bits, including experts of two and
    # three 128-row blocks (T=200, K=2 over 3 experts) and the FP32 main_grad accumulation.
    from detkit.kernels.moe.fp8.layer import FP8_WGRAD_CONFIGS, moe_fp8_quant_colwise, moe_fp8_wgrad

    inp = make_inputs(_case(t=200, seed=16), device)
    r = build_routing(inp["topk_ids"], inp["scores"], E)
    assert int(r.expert_counts.max()) > 128
    b = backend_of(device)
    xq, xs = moe_fp8_quant_colwise(inp["x"], r, b, gather=True, scale=False)
    yq, ys = moe_fp8_quant_colwise(inp["x"].flip(1), r, b, gather=True, scale=True)
    # The Triton kernel's tile on sm_90 (the pinned one is the Gluon kernel's).
    ptr = replace(FP8_TRITON_TILES["wgrad"] if b == "cuda_sm90" else FP8_WGRAD_CONFIGS[b], variant="ptr")
    for config in (replace(ptr, variant="tma"), replace(ptr, block_m=64, block_n=128, num_warps=4, variant="tma")):
        same = compare_bits(moe_fp8_wgrad(xq, xs, yq, ys, r, b, config=config),
                            moe_fp8_wgrad(xq, xs, yq, ys, r, b, config=ptr))
        assert same.equal, (config, same.as_row())
        acc_ptr, acc_tma = (torch.ones((E, H, H), device=device) for _ in range(2))
        moe_fp8_wgrad(xq, xs, yq, ys, r, b, acc_ptr, config=ptr)
        moe_fp8_wgrad(xq, xs, yq, ys, r, b, acc_tma, config=config)
        assert compare_bits(acc_tma, acc_ptr).equal, config
    odd = torch.empty((xq.shape[0], xq.shape[1] + 8), dtype=xq.dtype, device=device)[:, 8:]  # base 8 bytes off
    odd.copy_(xq)
    with pytest.raises(ValueError, match=r"variant 'tma' cannot describe a_q .*data_ptr % 16 = 8"):
        moe_fp8_wgrad(odd, xs, yq, ys, r, b, config=replace(ptr, variant="tma"))
    with pytest.raises(ValueError, match=r"quant_colwise: block_m must be the scale block 128 .* got 64"):
        moe_fp8_quant_colwise(inp["x"], r, b, gather=True, scale=False, config=GemmConfig(64, 64, 16, 1, 4, 1))
    masked = build_routing(torch.full_like(inp["topk_ids"], -1), inp["scores"], E)  # no routed row: P = 0
    xq0, xs0 = moe_fp8_quant_colwise(inp["x"], masked, b, gather=True, scale=False)
    for config in (ptr, replace(ptr, variant="tma")):
        assert moe_fp8_wgrad(xq0, xs0, xq0, xs0, masked, b, config=config).eq(0).all(), config
        acc = torch.ones((E, H, H), device=device)
        assert moe_fp8_wgrad(xq0, xs0, xq0, xs0, masked, b, acc, config=config) is None
        assert acc.eq(1).all(), config


def test_quant_risk_monitor_reports_every_quantized_tensor(base):
    inp, _, _ = base
    _, saved = moe_mlp_fp8_fwd(*layer_args(inp), weight_cache=None)
    risk = moe_fp8_risk(saved, inp["dout"])
    assert set(risk) == {"x", "w1", "w2", "h", "dout", "dgu"}
    for name, st in risk.items():
        assert 0 <= st["flushed_fraction"] < 0.01, (name, st)  # Gaussian data: almost nothing flushes
        assert 0 <= st["log2_group_over_block_amax_p95"] <= st["log2_group_over_block_amax_max"] < 8, (name, st)


def test_precision_gate_of_the_fp8_recipe(device):
    # The kernels equal moe_mlp_fp8_ref (tests above); the recipe passes the precision gate against FP64 at
    # a shape with enough values for a stable RMSE (CPU torch, a few seconds; the audit adds the BF16 gold).
    t, h, i, e, k = GATE_SHAPE
    inp = make_inputs(MoeCase(t, h, i, e, k, "random", 30), torch.device("cpu"))
    args = (*layer_args(inp), inp["dout"])
    oracle = moe_mlp_ref(*args)
    for wgrad in ("bf16", "fp8"):
        stats = precision_stats(moe_mlp_fp8_ref(*args, wgrad=wgrad), inp, oracle=oracle)
        for name, st in stats.items():
            assert gate_passed(st), (wgrad, name, st)
            assert st["rel_rmse_fp64"] > 2.0**-5, (wgrad, name, st)  # not vacuous: E4M3-level, not BF16's 2**-8


def test_the_default_weight_gradients_are_the_fp8_ones(base):
    # A backward without ``wgrad`` runs the FP8 weight-gradient GEMMs: the same bits as wgrad="fp8", not the BF16 ones.
    inp, _, _ = base
    _, saved = moe_mlp_fp8_fwd(*layer_args(inp), weight_cache=None)
    default = moe_mlp_fp8_bwd(inp["dout"], saved)
    fp8 = moe_mlp_fp8_bwd(inp["dout"], saved, wgrad="fp8")
    bf16 = moe_mlp_fp8_bwd(inp["dout"], saved, wgrad="bf16")
    assert compare_bits(default.dw1, fp8.dw1).equal and compare_bits(default.dw2, fp8.dw2).equal
    assert not compare_bits(default.dw1, bf16.dw1).equal


@pytest.fixture
def no_kernel_queued(monkeypatch):
    """The FP8 layer's first kernel (the routing) and, in a backward, its first (dout's quantization) fail the test."""
    forbid_kernels(monkeypatch, kf, "launch_checked_routing", "quantize_rowwise")


@pytest.mark.parametrize(("kwargs", "exc_type", "match"), [
    ({"weight_cache": "lru"}, TypeError, "weight_cache must be an Fp8WeightCache or None; got str"),
    ({"wgrad": 3}, TypeError, r"wgrad must be a str, one of \('bf16', 'fp8'\); got int"),
    ({"wgrad": "fp16"}, ValueError, r"wgrad 'fp16' is not supported; supported: \('bf16', 'fp8'\)"),
    ({"main_grads": 1}, TypeError, r"main_grads must be a pair \(main_grad_w1, main_grad_w2\) or None; got int"),
], ids=["weight_cache", "wgrad-int", "wgrad-str", "main_grads"])
def test_moe_mlp_fp8_refuses_bad_keywords_before_any_kernel(kwargs, exc_type, match, device, no_kernel_queued):
    inp = make_inputs(_case(t=8), device)
    with pytest.raises(exc_type, match=match):
        moe_mlp_fp8(*layer_args(inp), **kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"weight_cache": {}}, "weight_cache must be an Fp8WeightCache or None; got dict"),
    ({"stage_range": "nvtx"}, "stage_range must be a callable .* got str"),
], ids=["weight_cache", "stage_range"])
def test_moe_mlp_fp8_fwd_refuses_bad_keywords_before_any_kernel(kwargs, match, device, no_kernel_queued):
    inp = make_inputs(_case(t=8), device)
    with pytest.raises(TypeError, match=match):
        moe_mlp_fp8_fwd(*layer_args(inp), **kwargs)


@pytest.mark.parametrize(("kwargs", "exc_type", "match"), [
    ({"wgrad": None}, TypeError, "wgrad must be a str"),
    ({"main_grads": [1, 2]}, TypeError, "main_grad_w1 must be a float32 tensor; got int"),
    ({"stage_range": 1}, TypeError, "stage_range must be a callable"),
], ids=["wgrad", "main_grads", "stage_range"])
def test_moe_mlp_fp8_bwd_refuses_bad_keywords_before_any_kernel(kwargs, exc_type, match, device, monkeypatch):
    inp = make_inputs(_case(t=8), device)
    _, saved = moe_mlp_fp8_fwd(*layer_args(inp), weight_cache=None)
    forbid_kernels(monkeypatch, kf, "quantize_rowwise")
    with pytest.raises(exc_type, match=match):
        moe_mlp_fp8_bwd(inp["dout"], saved, **kwargs)
    with pytest.raises(TypeError, match="saved must be the MoeFp8Saved of moe_mlp_fp8_fwd; got tuple"):
        moe_mlp_fp8_bwd(inp["dout"], (saved,))


def test_fp8_inputs_whose_storage_does_not_cover_the_view_are_refused(device, no_kernel_queued):
    inp = make_inputs(_case(t=8), device)
    w2 = inp["w2"].clone()
    w2.untyped_storage().resize_(2 * 100)
    with pytest.raises(ValueError, match=r"w2 \(shape .*\) reaches byte \d+ of a storage that holds 200 bytes"):
        moe_mlp_fp8(inp["x"], inp["w1"], w2, inp["topk_ids"], inp["scores"], weight_cache=None)


@pytest.mark.parametrize("index", range(len(fp8_rejection_cases(make_inputs(_case(t=8), "cpu")))))
def test_rejects_before_any_work(index, device):
    inp = make_inputs(_case(t=8), device)
    label, exc_type, change = fp8_rejection_cases(inp)[index]
    assert_rejected(partial(moe_mlp_fp8_fwd, weight_cache=None), inp, change, exc_type)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2048, 1024, 768, 16, 4), (4096, 2048, 768, 32, 8)])
@pytest.mark.parametrize("wgrad", ["bf16", "fp8"])
def test_precision_gate_on_gpu(shape, wgrad, device):
    t, h, i, e, k = shape
    inp = make_inputs(MoeCase(t, h, i, e, k, "random", 31), device)
    stats = precision_stats(run_layer(inp, wgrad=wgrad), inp, bf16_path_layer(inp))
    for name, st in stats.items():
        assert st["cosine_fp64"] >= GATE_MIN_COSINE and st["rel_rmse_fp64"] < GATE_MAX_REL_RMSE, (name, st)
        assert gate_passed(st), (name, st)


@pytest.mark.gpu
def test_every_stage_within_derived_bound_on_gpu(device):
    _assert_stages(make_inputs(MoeCase(512, 1024, 768, 8, 4, "masked", 32), device))


# Compiles the FP8 kernels for sm_90 without a GPU (Triton's bundled ptxas) with the specialisation a
# real launch gets: checks every GEMM lowers to wgmma on e4m3 operands (both K-major; QGMMA in the SASS)
# with a pipelined (cp.async) K loop and no register spills, and that the E4M3 conversions use the RTNE
# saturating cvt.
_SM90_COMPILE = r'''
import itertools, json, re, sys, triton
from tools.gemm_sass import cuobjdump_bytes, stack_bytes
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import detkit.kernels.moe.fp8.quant as fq
import detkit.kernels.moe.fp8.kernels as kf
from detkit.kernels.det_gemm.launch import GemmConfig
from detkit.kernels.moe.fp8.configs import MOE_FP8_CONFIGS, QUANT_COLWISE_CONFIGS
target = GPUTarget("cuda", 90, 32)
from tests.moe_helpers import FP8_TRITON_TILES
def sass_counts(cubin):
    """QGMMA (FP8 wgmma) in the SASS and the stack frame (register spills), from Triton's bundled cuobjdump."""
    sass = cuobjdump_bytes("--dump-sass", cubin, sys.argv[1])
    return {"qgmma": len(re.findall(r"\bQGMMA", sass)),
            "stack": stack_bytes(cuobjdump_bytes("--dump-resource-usage", cubin, sys.argv[1]))}
def k_loop(ttgir):
    """The K loop (the scf.for around the first wgmma, to its scf.yield): are the FP32 scale loads issued
    before the wgmma (their latency hidden behind it), and how many layout conversions run per block."""
    lines = ttgir.splitlines()
    dot = next((i for i, line in enumerate(lines) if "warp_group_dot " in line), None)
    if dot is None:  # the quantizers: no K loop
        return {}
    start = max(i for i in range(dot) if "scf.for" in lines[i])
    end = next(i for i in range(dot, len(lines)) if "scf.yield" in lines[i])
    scale_loads = [i for i in range(start, end) if "tt.load" in lines[i] and "ptr<f32>" in lines[i]]
    return {"scales_before_mma": bool(scale_loads) and max(scale_loads) < dot,
            "loop_converts": sum("convert_layout" in lines[i] for i in range(start, end))}
def build(fn, ptrs, consts, unit, warps, stages):
    consts = {**consts, **{n: 1 for n in unit}}
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    div = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
           if n not in consts and n != "op_id" and not sig[n].startswith("tensordesc")}  # model sizes: multiples of 16
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=div), target=target,
                       options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    return {**k_loop(k.asm["ttgir"]), "wgmma_e4m3": len(re.findall(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx)),
            "cp_async": ptx.count("cp.async"), "tma_loads": ptx.count("cp.async.bulk.tensor"), "cvt_e4m3": ptx.count("cvt.rn.satfinite.e4m3x2.f32"),
            "shared": k.metadata.shared, **sass_counts(k.asm["cubin"])}
out = {}
ptrs = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "a_rows_ptr": "*i32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32",
        "c_ptr": "*bf16", "aux_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32",
        "route_ptr": "*i32", "score_ptr": "*fp32", "tile_expert_ptr": "*i32", "gate_ptr": "*i32", "h_ptr": "*bf16",
        "ds_ptr": "*fp32"}
for (stage, epi, gather, c_t), tma in itertools.product(
        (("up", 1, True, "*bf16"), ("down", 0, False, "*fp32"), ("dgrad", 2, True, "*bf16"), ("dx", 0, False, "*fp32")),
        (False, True)):  # the Triton tile with the weight through pointers and through TMA
    c = MOE_FP8_CONFIGS["cuda_sm90"][stage]
    if c.variant == "ws":  # the Gluon kernel (tests/test_moe_fp8_ws.py): the Triton tile it replaced
        c = FP8_TRITON_TILES[stage]
    if stage == "up" and c.block_n != 256:  # h quantized by the row-wise pass, not in the epilogue
        epi = 3
    b_t = f"tensordesc<fp8e4nv[1, {c.block_n}, {c.block_k}]>" if tma else "*fp8e4nv"
    out[stage + ("_tma" if tma else "_ptr")] = build(
        kf.moe_fp8_grouped_gemm_kernel, {**ptrs, "b_ptr": b_t, "c_ptr": c_t}, {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "STEP_K": c.block_k,
        "QBLOCK": 128, "SEGMENT": 128, "GATHER_A": gather, "EPILOGUE": epi, "INTERPRETED": False, "B_TMA": tma,
        "DSCORE": epi == 2,  # the layer's dgrad writes the dscore partials
        "GROUP_M": 8 if tma else 1},  # the grouped tile order (bands of 8 row tiles) and the row-major one
        ("stride_al", "stride_bl", "stride_cc", "stride_xc", "stride_qc"), c.num_warps, c.num_stages)
# Tiles beside the pinned ones: dgrad with two 1x128 dgu blocks per row in the epilogue (a tune candidate) and
# an 8-warp dgrad tile (the loop properties without the 4-warp tile's register pressure); the up tile that quantizes h
# in its epilogue.
for name, c, epi in (("dgrad_two_blocks", GemmConfig(64, 128, 128, 1, 8, 4), 2),
                     ("dgrad_w8", GemmConfig(128, 64, 128, 1, 8, 4), 2), ("up_fused", GemmConfig(64, 256, 128, 1, 8, 3), 1)):
    out[name] = build(
        kf.moe_fp8_grouped_gemm_kernel, {**ptrs, "b_ptr": "*fp8e4nv", "c_ptr": "*bf16"}, {"BLOCK_M": c.block_m,
        "BLOCK_N": c.block_n, "STEP_K": c.block_k, "QBLOCK": 128, "SEGMENT": 128, "GATHER_A": True, "EPILOGUE": epi,
        "INTERPRETED": False, "B_TMA": False, "DSCORE": epi == 2, "GROUP_M": 8}, ("stride_al", "stride_bl", "stride_cc",
        "stride_xc", "stride_qc"),
        c.num_warps, c.num_stages)
c = GemmConfig(64, 128, 128, 1, 4, 3)  # the Triton kernel's sm_90 tile (tests/moe_helpers.py FP8_TRITON_TILES)
for acc, tma in ((False, False), (True, False), (False, True)):  # pointer operands; TMA ones (scale prefetch)
    a_t, b_t = ((f"tensordesc<fp8e4nv[{rows}, {c.block_k}]>" if tma else "*fp8e4nv") for rows in (c.block_m, c.block_n))
    out["wgrad_tma" if tma else f"wgrad_{acc}"] = build(
        kf.moe_fp8_wgrad_kernel, {"a_ptr": a_t, "as_ptr": "*fp32", "b_ptr": b_t, "bs_ptr": "*fp32",
        "dw_ptr": "*fp32" if acc else "*bf16", "offsets_ptr": "*i32", "counts_ptr": "*i32", "gate_ptr": "*i32"},
        {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "STEP_K": c.block_k, "QBLOCK": 128, "ACCUMULATE": acc,
         "INTERPRETED": False, "TMA": tma, "GROUP_M": 8 if acc or tma else 1}, ("stride_ap", "stride_bp", "stride_wc"),
        c.num_warps, c.num_stages)
out["quant_colwise"] = build(kf.moe_fp8_quant_colwise_kernel, {"src_ptr": "*bf16", "rows_ptr": "*i32", "route_ptr": "*i32",
                             "score_ptr": "*fp32", "gate_ptr": "*i32", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32"},
                             {"BLOCK_N": QUANT_COLWISE_CONFIGS["cuda_sm90"].block_n, "QBLOCK": 128, "GATHER": True, "SCALE": True,
                              "INTERPRETED": False}, ("stride_sn", "stride_qp"), 4, 1)
out["quant_rowwise"] = build(fq.fp8_quant_rowwise_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                             "limit_ptr": "*i32"}, {"BLOCK_M": 32, "LIMITED": True, "QBLOCK": 128, "INTERPRETED": False}, ("stride_xn", "stride_qn"), 4, 1)
out["quant_weight"] = build(fq.fp8_quant_weight_kernel, {"w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv",
                            "s_ptr": "*fp32"}, {"QBLOCK": 128, "INTERPRETED": False, "SPLIT_C": False},
                            ("stride_wc", "stride_qc", "stride_tr"), 8, 1)
out["quant_weight_split"] = build(fq.fp8_quant_weight_kernel, {"w_ptr": "*bf16", "q_ptr": "*fp8e4nv",
                                  "qt_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, {"QBLOCK": 128, "INTERPRETED": False,
                                  "SPLIT_C": True}, ("stride_wr", "stride_qc", "stride_tr"), 8, 1)
print(json.dumps(out))
'''


# The 4-warp Triton FP8 dgrad tile (FP8_TRITON_TILES) spills 272 bytes and converts one layout per K block (sm_90,
# Triton 3.6) and is still faster on the H200 than the 8-warp tile that has neither; "dgrad_w8" keeps the strict
# check of the loop.
MEASURED_PRESSURE = {"dgrad_tma": (272, 1)}


def test_kernels_compile_for_sm90_offline(tmp_path):
    report = compile_sm90_offline(_SM90_COMPILE, tmp_path, str(tmp_path))
    # The Triton tiles of the four stages (those pinned, else the tile the Gluon kernel was tuned against: the "ws"
    # kernels are compiled by tests/test_moe_fp8_ws.py).
    pinned = {name.rsplit("_", 1)[0]: name for name in report if name.endswith("_tma") and name != "wgrad_tma"}
    assert set(pinned) == {"up", "down", "dgrad", "dx"}, sorted(report)
    for name in (*pinned.values(), "wgrad_False", "wgrad_True", "dgrad_w8"):
        stack, converts = MEASURED_PRESSURE.get(name, (0, 0))
        assert report[name]["wgmma_e4m3"] > 0 and report[name]["qgmma"] > 0, (name, report[name])
        assert report[name]["stack"] <= stack, (name, report[name])  # register spills
        assert report[name]["cp_async"] > 0, (name, report[name])  # the K loop is software-pipelined
        assert report[name]["shared"] <= 227 * 1024, (name, report[name])  # sm_90's per-block limit
        if name.startswith(("up", "down", "dgrad", "dx")):  # the per-block promotion does not wait on a global load
            assert report[name]["scales_before_mma"] and report[name]["loop_converts"] <= converts, (name, report[name])
    for stage in pinned:
        tma, ptr = report[stage + "_tma"], report[stage + "_ptr"]  # FP8 wgmma fed by TMA or by cp.async
        assert tma["qgmma"] > 0 and tma["tma_loads"] > 0 and ptr["qgmma"] > 0 and ptr["tma_loads"] == 0, (stage, tma, ptr)
    # The FP8 wgrad's TMA variant (a tune candidate): both operands by TMA, each block's scales requested before
    # its MMAs, no spills at the pinned 128x128 8-warp tile (the pointer kernel spilled with that prefetch).
    wt = report["wgrad_tma"]
    assert wt["qgmma"] > 0 and wt["tma_loads"] > 0 and wt["stack"] == 0 and wt["scales_before_mma"], wt
    two = report["dgrad_two_blocks"]
    assert two["qgmma"] > 0 and two["stack"] == 0 and two["cvt_e4m3"] > 0, two
    for name in ("up_fused", pinned["dgrad"], "quant_rowwise", "quant_weight", "quant_colwise"):  # fused, standalone
        assert report[name]["cvt_e4m3"] > 0, (name, report[name])
    assert report["up_fused"]["qgmma"] > 0 and report["up_fused"]["stack"] == 0, report["up_fused"]
    assert set(MOE_FP8_CONFIGS["cuda_sm90"]) == {"up", "down", "dgrad", "dx"}


# ---------------------------------------------------------------------------------------------
# transformers' layout read in place (gate_up="split")
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("wgrad", ["fp8", "bf16"])
def test_split_gate_up_views_give_the_interleaved_copy_bits(wgrad, device):
    # The weight quantizer reads the split halves in the interleaved order, so every FP8 operand is the same; dW1 comes
    # back in gate_up_proj's layout and dW2 in down_proj's (by the swapped-operand weight gradient).
    inp = make_inputs(_case("masked", seed=31), device)
    want, got = (run_on_parameters(kf.moe_mlp_fp8, inp, split, weight_cache=None, wgrad=wgrad)
                 for split in (False, True))
    for name in want:
        assert compare_bits(got[name], want[name]).equal, name
    assert got["d_gate_up_proj"].is_contiguous() and got["d_down_proj"].is_contiguous()


def test_split_gate_up_views_accumulate_main_grads_with_the_interleaved_copy_bits(device):
    inp = make_inputs(_case(seed=32), device)
    want, got = (run_on_parameters(kf.moe_mlp_fp8, inp, split, main_grads=True, weight_cache=None)
                 for split in (False, True))
    for name in want:
        assert compare_bits(got[name], want[name]).equal, name


def test_quantize_weight_reads_split_halves_as_the_interleaved_copy(device):
    w1 = make_inputs(_case(seed=33), device)["w1"]
    split = deinterleave_gate_up(w1).transpose(1, 2).contiguous().transpose(1, 2)  # gate_up_proj's storage
    want, got = quantize_weight(w1), quantize_weight(split, split_pairs=True)
    for name in ("q", "q_t", "scale"):
        assert torch.equal(getattr(got, name).float(), getattr(want, name).float()), name


def test_weight_cache_keys_the_gate_up_layout(device):
    w1 = make_inputs(_case(seed=34), device)["w1"]
    cache = kf.Fp8WeightCache()
    interleaved = cache.get(w1)
    split = cache.get(w1, gate_up="split")  # the same tensor read as split halves: another slot, other values
    assert len(cache) == 2 and cache.misses == 2
    assert not torch.equal(split.q.float(), interleaved.q.float())
    assert cache.get(w1, gate_up="split") is split and cache.hits == 1
