"""The FP8 MoE warp-specialized Gluon kernels (kernels/moe/fp8/ws.py, kernels/moe/fp8/ws_gather.py, variant "ws"):
the Triton kernel's bits on the H200 for down and dX, the gathered up and dgrad and the weight gradient, including
padding-only tiles and an expert with no rows; refusals by name everywhere (the host-side ones on every backend); and
an offline sm_90 compile (no GPU) showing TMA loads, FP8 wgmma with one MMA group in flight behind the newest, the
register hand-off, no spills and no MMA serialization by ptxas."""

from dataclasses import replace

import pytest
import torch

from detkit.audits.moe import MoeCase
from detkit.audits.moe_fp8 import make_inputs
from detkit.kernels.det_gemm.launch import GemmConfig
from detkit.kernels.moe.fp8.layer import moe_fp8_quant_colwise, moe_fp8_wgrad, select_moe_fp8_config
from detkit.kernels.moe.fp8.quant import quantize_colwise_ref
from detkit.kernels.moe.routing import build_routing, launch_routing
from tests.conftest import backend_of
from tests.moe_helpers import (
    FP8_TRITON_TILES, assert_ws_refused_off_sm90, compile_sm90_offline, fp8_stage_runs, skewed_ids,
)
from detkit.toolkit.contract import compare_bits

WS_CONFIGS = [GemmConfig(128, 128, 128, 1, 8, 5, "ws"), GemmConfig(64, 128, 128, 1, 4, 6, "ws"),
              GemmConfig(128, 64, 128, 1, 8, 8, "ws")]
GATHERED_WS_CONFIGS = {
    "up": [GemmConfig(128, 128, 128, 1, 8, 4, "ws"), GemmConfig(64, 128, 128, 1, 4, 6, "ws")],
    "dgrad": [GemmConfig(128, 64, 128, 1, 8, 6, "ws"), GemmConfig(64, 64, 128, 1, 4, 8, "ws"),
              GemmConfig(128, 128, 128, 1, 8, 4, "ws")],
}
WGRAD_WS_CONFIGS = [GemmConfig(128, 64, 128, 1, 8, 6, "ws"), GemmConfig(128, 128, 128, 1, 8, 4, "ws"),
                    GemmConfig(128, 128, 128, 1, 8, 5, "ws")]


def _operands(device, t=24, h=128, i=128, e=3, k=2, seed=5):
    inp = make_inputs(MoeCase(t, h, i, e, k, "random", seed), device)
    if t > 64:  # expert 0 gets no rows, expert 1 a single one: a padding-only 64-row tile and an almost empty one
        inp["topk_ids"] = skewed_ids(t, e, k, seed).to(device)
    r = build_routing(inp["topk_ids"], inp["scores"], e)
    b = backend_of(device)
    stages, saved = fp8_stage_runs(inp, r, b)
    col = {name: moe_fp8_quant_colwise(src, r, b, gather=gather, scale=scale) for name, src, gather, scale in
           (("x", inp["x"], True, False), ("dgu", saved["dgu"], False, False), ("h", saved["h"], False, False),
            ("dy", inp["x"].flip(0), True, True))}
    runs = {"down": lambda c: stages["down"](c)[0], "dx": lambda c: stages["dx"](c)[0],
            "wgrad_w1": lambda c, mg=None: moe_fp8_wgrad(*col["x"], *col["dgu"], r, b, main_grad=mg, config=c),
            "wgrad_w2": lambda c, mg=None: moe_fp8_wgrad(*col["h"], *col["dy"], r, b, main_grad=mg, config=c)}
    gathered = {"up": stages["up"], "dgrad": stages["dgrad"]}
    return runs, gathered, r


def test_ws_refuses_other_backends_and_stages_by_name(device):
    # The config checks run before the backend's (sm_90 only), so all of them run on the interpreter too.
    runs, gathered, _ = _operands(device)
    ws = WS_CONFIGS[0]
    assert_ws_refused_off_sm90(runs, ws, device)
    assert_ws_refused_off_sm90(gathered, GATHERED_WS_CONFIGS["dgrad"][2], device)  # 4 stages: dgrad's buffers fit
    with pytest.raises(ValueError, match="one 128-row scale block per ring slot"):
        runs["wgrad_w1"](GemmConfig(128, 64, 64, 1, 8, 6, "ws"))
    with pytest.raises(ValueError, match="variant 'ws' covers down, dX, the up-projection"):
        gathered["up"](replace(ws, block_n=256))  # the tile that quantizes h in its epilogue
    with pytest.raises(ValueError, match=r"runs BLOCK_K 128 and BLOCK_N in \(128,\) here; got BLOCK_K 128, BLOCK_N 64"):
        gathered["up"](replace(ws, block_n=64))
    with pytest.raises(ValueError, match="needs 294912 bytes of shared memory"):  # 6 stages + 96 KB of store buffers
        gathered["dgrad"](GemmConfig(128, 128, 128, 1, 8, 6, "ws"))
    with pytest.raises(ValueError, match="needs 235520 bytes of shared memory"):  # 6 stages + the BF16 store tile
        runs["wgrad_w1"](GemmConfig(128, 128, 128, 1, 8, 6, "ws"))
    with pytest.raises(ValueError, match="64 rows"):
        runs["down"](GemmConfig(128, 128, 128, 1, 4, 4, "ws"))
    for stage in ("up", "dgrad"):  # BLOCK_M 64 with 8 warps: the kernel's ping-pong form, which is not launched
        with pytest.raises(ValueError, match="BLOCK_M 64 with 4 warps or 128 with 8; got BLOCK_M 64, 8 warps"):
            gathered[stage](GemmConfig(64, 128, 128, 1, 8, 5, "ws"))
    with pytest.raises(ValueError, match="one 128-K scale block per ring slot"):
        runs["down"](replace(ws, block_k=64))


COLWISE_WS = GemmConfig(128, 128, 16, 1, 4, 1, "ws")  # the Gluon column-wise quantizer's tile
COLWISE_TRITON = GemmConfig(128, 64, 16, 1, 2, 1)  # a Triton tile on sm_90: the reference of the Gluon kernel's bits


def _colwise_sources(device, t=300, h=512, e=5, k=2, seed=13):
    """A batch whose x holds NaN, +-inf, values near FP32's and BF16's extremes, subnormals and an all-zero column
    block (the amax and scale corner cases), with its routing; experts of 0 and 1 rows (padding-only blocks)."""
    inp = make_inputs(MoeCase(t, h, h, e, k, "random", seed), device)
    inp["topk_ids"] = skewed_ids(t, e, k, seed).to(device)
    x = inp["x"].clone()
    x[:, :128] = 0  # every block of these columns: amax 0, scale 1
    x[3, 130], x[5, 131], x[7, 132] = float("nan"), float("inf"), float("-inf")
    x[9, 133], x[11, 134] = 3.0e38, -1.0e-40
    x[:, 256:384] *= 1e-38  # blocks whose scale clamps at 2**-126
    return x, build_routing(inp["topk_ids"], inp["scores"], e)


def test_colwise_ws_config_is_refused_off_sm90_and_checked_by_name(device):
    # The Gluon quantizer's own checks run first (on every backend); then, off sm_90, the backend's refusal.
    x, r = _colwise_sources(device)
    b = backend_of(device)
    with pytest.raises(ValueError, match=r"block_n a power of two and a multiple of 32 columns per warp \(128 for 4 "
                                         r"warps\); got 64"):
        moe_fp8_quant_colwise(x, r, b, gather=True, scale=False, config=replace(COLWISE_WS, block_n=64))
    with pytest.raises(ValueError, match="N a multiple of block_n 256; got N=384"):
        moe_fp8_quant_colwise(x[:, :384].contiguous(), r, b, gather=True, scale=False,
                              config=replace(COLWISE_WS, block_n=256))
    if b != "cuda_sm90":
        with pytest.raises(ValueError, match="quant_colwise: variant 'ws' is a Gluon kernel for sm_90"):
            moe_fp8_quant_colwise(x, r, b, gather=True, scale=False, config=COLWISE_WS)


@pytest.mark.gpu
@pytest.mark.parametrize(("gather", "scale"), [(True, False), (False, False), (True, True)])
def test_colwise_ws_gives_the_triton_kernels_bits(gather, scale, device):
    # Every code and scale of the Gluon quantizer equals the Triton kernel's, NaN, infinities and the scale's clamp
    # included; and, on the same input without its NaN (torch's amax propagates NaN, the kernels' maximum skips it),
    # the pure-torch reference's. Padding rows quantize to 0.
    x, r = _colwise_sources(device)
    b = backend_of(device)
    # Not gathered (dgu, h): the source is already [P, N] in expert order.
    src = x if gather else x.repeat(-(-r.padded_rows // x.shape[0]), 1)[: r.padded_rows]
    got = moe_fp8_quant_colwise(src, r, b, gather=gather, scale=scale, config=COLWISE_WS)
    ref = moe_fp8_quant_colwise(src, r, b, gather=gather, scale=scale, config=COLWISE_TRITON)
    # The codes as bytes: compare_bits counts every NaN as a mismatch, and the NaN inputs must give NaN codes.
    assert torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8)), (gather, scale)
    assert compare_bits(got[1], ref[1]).equal, (gather, scale)
    assert bool(got[0][130].float().isnan().any())  # the NaN input's column keeps a NaN code
    assert bool((got[0][:, r.sorted_route < 0].view(torch.uint8) == 0).all())
    clean = torch.where(src.isnan(), 0.0, src)
    v = torch.where((r.sorted_route >= 0)[:, None], (clean[r.gather_token.long()] if gather else clean).float(), 0.0)
    if scale:
        v = v * r.row_score[:, None]
    q_ref, s_ref = quantize_colwise_ref(v)
    q, s_ = moe_fp8_quant_colwise(clean, r, b, gather=gather, scale=scale, config=COLWISE_WS)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and compare_bits(s_, s_ref).equal


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [5, 64])
def test_colwise_ws_over_the_routing_bound_gives_the_exact_routings_bits(experts, device):
    # The layer quantizes over the routing's bound (no host read); gathering, the Gluon kernel visits the experts'
    # blocks side by side, its grid sized from the bound and its block order from the real P on the device. Skewed
    # routings (empty experts, padding-only blocks): every block below P once, the exact routing's codes and scales.
    t, h, k = 300, 512, 2
    inp = make_inputs(MoeCase(t, h, h, experts, k, "random", 19), device)
    ids = skewed_ids(t, experts, k, 19).to(device)
    pending = launch_routing(ids, inp["scores"], experts)
    exact, bound = pending.finish(), pending.bound
    p = exact.padded_rows
    assert p < bound.padded_rows
    b = backend_of(device)
    for scale in (False, True):
        got_q, got_s = moe_fp8_quant_colwise(inp["x"], bound, b, gather=True, scale=scale, config=COLWISE_WS)
        want_q, want_s = moe_fp8_quant_colwise(inp["x"], exact, b, gather=True, scale=scale, config=COLWISE_TRITON)
        assert torch.equal(got_q[:, :p].view(torch.uint8), want_q.view(torch.uint8)), scale
        assert compare_bits(got_s[:, : p // 128], want_s).equal, scale


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(300, 512, 384, 5, 2), (2048, 1024, 768, 16, 4)])
def test_ws_gives_the_triton_kernels_bits(shape, device):
    t, h, i, e, k = shape
    runs, _, r = _operands(device, t, h, i, e, k, seed=11)
    assert int(r.counts[0]) == 0 and int(r.counts[1]) == 1
    for stage in ("down", "dx"):
        run = runs[stage]
        ref = run(FP8_TRITON_TILES[stage])
        for config in [*WS_CONFIGS, select_moe_fp8_config(stage, backend_of(device))]:
            out = run(config)
            assert compare_bits(out, ref).equal, (stage, config.label())
            assert compare_bits(run(config), out).equal, (stage, config.label())  # repeat
        pad = r.sorted_route < 0
        assert bool((ref[pad] == 0).all()), stage


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(300, 512, 384, 5, 2), (2048, 1024, 768, 16, 4)])
@pytest.mark.parametrize(("stage", "names"), [("up", ("gu", "h", "h_q", "h_s")),
                                             ("dgrad", ("dgu", "dgu_q", "dgu_s", "ds_part"))])
def test_ws_gathered_stages_give_the_triton_kernels_bits(stage, names, shape, device):
    # The gathered-A form (cp.async producer) with the up-projection's SwiGLU epilogue (gu, h by TMA store; h_q, h_s
    # by the row-wise pass) and dgrad's dSwiGLU + 1x128 quantization + dscore partials (summed in the order the
    # reshapes and splits fix): every output equals the Triton tile's, and the padding rows (which read token 0) are
    # zero.
    t, h, i, e, k = shape
    _, gathered, r = _operands(device, t, h, i, e, k, seed=11)
    ref = gathered[stage](FP8_TRITON_TILES[stage])
    for config in [*GATHERED_WS_CONFIGS[stage], select_moe_fp8_config(stage, backend_of(device))]:
        out = gathered[stage](config)
        for name, a, b in zip(names, out, ref):
            assert compare_bits(a, b).equal, (name, config.label())
    pad = r.sorted_route[: r.padded_rows] < 0
    assert bool((ref[0][pad] == 0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(300, 512, 384, 5, 2), (2048, 1024, 768, 16, 4)])
def test_ws_weight_gradient_gives_the_triton_kernels_bits(shape, device):
    # Experts of 0 and 1 rows and of 2-5 scale blocks (groups of 3 and the one-at-a-time remainder); BF16 out, and
    # main_grad += dW in FP32 (an expert without rows leaves its slice untouched).
    t, h, i, e, k = shape
    runs, _, r = _operands(device, t, h, i, e, k, seed=11)
    triton_tile = FP8_TRITON_TILES["wgrad"]
    for stage in ("wgrad_w1", "wgrad_w2"):
        run = runs[stage]
        ref = run(triton_tile)
        assert bool((ref[0] == 0).all()), stage
        for config in WGRAD_WS_CONFIGS:  # the pinned tile among them
            out = run(config)
            assert compare_bits(out, ref).equal, (stage, config.label())
            base = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2)).to(device)
            mg_ref, mg = base.clone(), base.clone()
            run(triton_tile, mg_ref)
            run(config, mg)
            assert compare_bits(mg, mg_ref).equal and compare_bits(mg[0], base[0]).equal, (stage, config.label())


_COMPILE = r'''
import json
from triton.experimental.gluon import language as gl
from tools.gemm_sass import gluon_desc_type, gluon_sm90_report
from detkit.kernels.det_gemm.ws import consumers, max_regs
from detkit.kernels.moe.fp8.ws import moe_fp8_wgrad_ws_kernel, moe_fp8_ws_kernel
from detkit.kernels.moe.fp8.ws_gather import moe_fp8_ws_gather_kernel
from detkit.kernels.moe.fp8.colwise_sm90 import moe_fp8_quant_colwise_sm90_kernel
out = {}
box = lambda rows, cols=128, dt=gl.float8e4nv: gluon_desc_type(rows, cols, dt)
scale_box = lambda cols: f"tensordesc<fp32[1, {cols}],{gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)!r}>"
grouped = [(moe_fp8_ws_kernel, f"grouped_{bm}x{bn}_g{group_m}", bm, bn, warps,
            {"a_desc": box(bm), "b_desc": box(bn), "c_desc": box(bm // consumers(warps), bn, gl.bfloat16), "as_ptr": "*fp32",
             "bs_ptr": "*fp32", "route_ptr": "*i32", "tile_expert_ptr": "*i32", "gate_ptr": "*i32"},
            {"BLOCK_M": bm, "BLOCK_N": bn, "STAGES": stages, "SEGMENT": 128, "KB_GROUP": 3, "CONSUMERS": consumers(warps),
             "stride_asl": 1, "GROUP_M": group_m})  # the tile order: row-major (1) or bands of 8 row tiles
           for bm, bn, warps, stages, group_m in [(128, 128, 8, 5, 1), (64, 128, 4, 6, 8), (128, 64, 8, 8, 8),
                                                  (128, 128, 8, 5, 8)]]
wgrad = [(moe_fp8_wgrad_ws_kernel, f"wgrad_{bm}x{bn}_acc{int(acc)}", bm, bn, warps,
          {"a_desc": box(bm), "b_desc": box(bn), "as_desc": scale_box(bm), "bs_desc": scale_box(bn),
           "c_desc": box(bm // consumers(warps), bn, gl.bfloat16), "dw_ptr": "*fp32", "offsets_ptr": "*i32",
           "counts_ptr": "*i32", "gate_ptr": "*i32"},
          {"BLOCK_M": bm, "BLOCK_N": bn, "STAGES": stages, "KB_GROUP": 3, "ACCUMULATE": acc, "CONSUMERS": consumers(warps),
           "stride_wc": 1, "GROUP_M": 1 if acc else 8}) for bm, bn, warps, stages, acc in [(128, 128, 8, 5, False),
                                                                                            (128, 128, 8, 5, True)]]
part = lambda bm, warps: bm // consumers(warps)  # a consumer's rows per tile
# PINGPONG: the launcher leaves it at its default, False (a constexpr; unset here it would be a runtime argument).
up = [(moe_fp8_ws_gather_kernel, f"up_{bm}x{bn}_w{warps}_g{group_m}", bm, bn, warps,
       {"a_ptr": "*fp8e4nv", "b_desc": box(bn), "gu_desc": box(part(bm, warps), bn, gl.bfloat16),
        "h_desc": box(part(bm, warps), bn // 2, gl.bfloat16), "as_ptr": "*fp32", "bs_ptr": "*fp32",
        "gather_ptr": "*i32", "route_ptr": "*i32", "tile_expert_ptr": "*i32", "gate_ptr": "*i32", "score_ptr": "*fp32",
        "gu_ptr": "*i32",
        "qs_ptr": "*fp32"},
       {"BLOCK_M": bm, "BLOCK_N": bn, "STAGES": stages, "SEGMENT": 128, "KB_GROUP": 3, "CONSUMERS": consumers(warps),
        "EPILOGUE": 3, "stride_asl": 1, "PINGPONG": False, "GROUP_M": group_m})
      for bm, bn, warps, stages, group_m in [(128, 128, 8, 4, 1), (64, 128, 4, 6, 8), (128, 128, 8, 4, 8)]]
dgrad = [(moe_fp8_ws_gather_kernel, f"dgrad_{bm}x{bn}_w{warps}" + "_ds" * ds, bm, bn, warps,
          {"a_ptr": "*fp8e4nv", "b_desc": box(bn), "gu_desc": box(part(bm, warps), bn, gl.int32),
           "h_desc": box(part(bm, warps), bn, gl.int16), "as_ptr": "*fp32", "bs_ptr": "*fp32",
           "gather_ptr": "*i32", "route_ptr": "*i32", "tile_expert_ptr": "*i32", "gate_ptr": "*i32", "score_ptr": "*fp32",
           "gu_ptr": "*i32", "qs_ptr": "*fp32", "h_ptr": "*bf16", "ds_ptr": "*fp32"},
          {"BLOCK_M": bm, "BLOCK_N": bn, "STAGES": stages, "SEGMENT": 128, "KB_GROUP": 3, "CONSUMERS": consumers(warps),
           "EPILOGUE": 2, "stride_asl": 1, "DSCORE": ds, "PINGPONG": False, "GROUP_M": group_m})
         for bm, bn, warps, stages, ds, group_m in [(128, 64, 8, 6, False, 1), (64, 64, 4, 8, False, 8),
                                                    (128, 128, 8, 4, False, 1), (128, 128, 8, 4, True, 8),
                                                    (64, 64, 4, 8, True, 1)]]
for fn, name, bm, bn, warps, ptrs, consts in grouped + wgrad + up + dgrad:
    out[name] = gluon_sm90_report(fn, ptrs, consts, max_regs(warps))
col_ptrs = {"src_ptr": "*bf16", "rows_ptr": "*i32", "route_ptr": "*i32", "score_ptr": "*fp32", "gate_ptr": "*i32",
            "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32"}
for gather, scale in ((True, True), (False, False)):  # the unit strides the layer's operands have
    out[f"colwise_{int(gather)}{int(scale)}"] = gluon_sm90_report(
        moe_fp8_quant_colwise_sm90_kernel, col_ptrs, {"BLOCK_N": 128, "GATHER": gather, "SCALE": scale, "stride_sn": 1,
        "stride_qp": 1, "stride_sn_s": 1}, 255)
print(json.dumps(out))
'''


def test_ws_kernel_compiles_for_sm90_offline(tmp_path):
    report = compile_sm90_offline(_COMPILE, tmp_path)
    for name in [n for n in report if n.startswith("colwise")]:
        # The column-wise quantizer: 16-byte loads along the rows and 16-byte stores down the columns, the change of
        # layout between them moving no data (no shared memory), and no spills.
        r = report.pop(name)
        assert r["ldg128"] > 0 and r["stg128"] > 0 and r["shared_ld_st"] == 0 and r["stack"] == 0, (name, r)
    for name, r in report.items():
        # FP8 wgmma fed by TMA (the weight; A too, but for the up-projection's gathered rows: cp.async), setmaxnreg
        # (the roles' register split), no spills, and a wait that leaves one MMA group in flight (the next block's,
        # while this one is promoted).
        assert r["qgmma"] > 0 and r["tma"] > 0 and r["setmaxnreg"] > 0, (name, r)
        assert (r["ldgsts"] > 0) == name.startswith(("up", "dgrad")), (name, r)
        # The grouped epilogues go out through shared memory and TMA stores (dgrad's dgu and dgu_q included).
        assert r["tma_store"] > 0 or name.startswith("wgrad"), (name, r)
        assert r["stack"] == 0 and r["wait1"] > 0, (name, r)
        # ptxas -v reports no "wgmma.mma_async instructions are serialized" (C7512/C7514): the MMAs pipeline.
        assert not r["serialized"], (name, r)
