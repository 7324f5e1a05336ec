"""The BF16 MoE warp-specialized Gluon kernels (kernels/moe/ws.py, variant "ws": down and dX, the gathered up and
dgrad, the weight gradients): the Triton tiles' bits on the H200 for both weight layouts (down: [E, I, H]; dX: the
K-major view of W1), including a padding-only tile and an expert with no rows, and for the weight gradients with BF16
out or FP32 main_grad accumulation and Inf in the token row padding rows name; refusals by name everywhere (the
host-side ones on every backend); and an offline sm_90 compile (no GPU) showing TMA loads and stores, BF16 wgmma, the
register hand-off, no spills and no MMA serialization by ptxas."""

from dataclasses import replace

import pytest
import torch

from detkit.audits.moe import MoeCase, make_inputs
from detkit.kernels.det_gemm.launch import GemmConfig
from detkit.kernels.moe.layer import (
    moe_dgrad_dswiglu, moe_dgrad_dswiglu_dscore, moe_down, moe_dx_route, moe_up_swiglu, moe_wgrad_w1, moe_wgrad_w2,
)
from detkit.kernels.moe.common import EPI_DSWIGLU
from detkit.kernels.moe.routing import build_routing
from detkit.kernels.moe.ws import launch_moe_ws_gather
from tests.conftest import backend_of
from tests.moe_helpers import assert_ws_refused_off_sm90, compile_sm90_offline, skewed_ids
from detkit.toolkit.contract import compare_bits

# Triton tiles of the ws stages: the reference for the ws kernels' bits.
TRITON_TILES = {"down": GemmConfig(128, 128, 64, 1, 8, 3, "tma"), "dx": GemmConfig(128, 128, 64, 1, 8, 3, "tma"),
                "dgrad": GemmConfig(128, 128, 64, 1, 8, 4, "tma"), "dgrad_plain": GemmConfig(128, 128, 64, 1, 8, 4, "tma"),
                "up": GemmConfig(128, 128, 64, 1, 8, 3, "tma"), "up_kmajor": GemmConfig(128, 128, 64, 1, 8, 3, "tma"),
                **{s: GemmConfig(128, 128, 64, 1, 4, 3) for s in ("wgrad_w1", "wgrad_w2", "wgrad_w1_acc", "wgrad_w2_acc")}}
WS_GATHER_CONFIGS = [GemmConfig(128, 128, 64, 1, 8, 4, "ws"), GemmConfig(128, 128, 64, 1, 8, 3, "ws"),
                    GemmConfig(64, 128, 64, 1, 4, 6, "ws"), GemmConfig(128, 64, 64, 1, 8, 6, "ws")]
WS_CONFIGS = [GemmConfig(128, 128, 64, 1, 8, 4, "ws"), GemmConfig(128, 128, 64, 1, 8, 5, "ws"),
              GemmConfig(64, 128, 64, 1, 4, 6, "ws"), GemmConfig(128, 64, 64, 1, 8, 6, "ws"),
              GemmConfig(128, 256, 64, 1, 8, 3, "ws")]
# 12 warps: dgrad's epilogue on a warpgroup of its own beside the two MMA warpgroups.
WS_DGRAD_CONFIGS = WS_GATHER_CONFIGS + [GemmConfig(128, 128, 64, 1, 12, 4, "ws"), GemmConfig(128, 64, 64, 1, 12, 6, "ws")]
WS_WGRAD_CONFIGS = [GemmConfig(128, 128, 64, 1, 8, 4, "ws"), GemmConfig(128, 128, 32, 1, 8, 6, "ws"),
                    GemmConfig(64, 128, 64, 1, 4, 6, "ws"), GemmConfig(128, 256, 64, 1, 8, 3, "ws")]


def _ws_configs(stage: str) -> list[GemmConfig]:
    if stage in ("down", "dx"):
        return WS_CONFIGS
    if stage.startswith("dgrad"):
        return WS_DGRAD_CONFIGS
    return WS_WGRAD_CONFIGS if stage.startswith("wgrad") else WS_GATHER_CONFIGS


def _runs(device, t=24, h=128, i=128, e=3, k=2, seed=5, poison_token0=False):
    """Every ws stage of one routed batch as a function of the config returning a tuple of outputs, the routing and
    the inputs. poison_token0: token 0 routed nowhere and Inf in its rows of x and dout (the rows padding rows name)."""
    inp = make_inputs(MoeCase(t, h, i, e, k, "random", seed), device)
    if t > 64:  # expert 0 gets no rows, expert 1 a single one: a padding-only tile and an almost empty one
        inp["topk_ids"] = skewed_ids(t, e, k, seed).to(device)
    if poison_token0:
        inp["topk_ids"][0] = -1
        inp["topk_ids"][1, 0] = 1  # expert 1 keeps its single row
        inp["x"][0] = float("inf")
        inp["dout"][0] = float("inf")
    r = build_routing(inp["topk_ids"], inp["scores"], e)
    b = backend_of(device)
    gu, hid = moe_up_swiglu(inp["x"], inp["w1"], r, b)
    # The weights' other storage order (nn.Linear stacks as views): W1 K-major, W2 with H innermost for dgrad.
    w1_kmajor = inp["w1"].transpose(1, 2).contiguous().transpose(1, 2)
    w2_rows = inp["w2"].transpose(1, 2).contiguous().transpose(1, 2)
    dgu = moe_dgrad_dswiglu(inp["dout"], inp["w2"], gu, r, b)
    # main_grad's starting values: random, so an add to the wrong element or a skipped expert shows.
    gen = torch.Generator().manual_seed(seed)
    g1 = torch.randn(inp["w1"].shape, generator=gen).to(device)
    g2 = torch.randn(inp["w2"].shape, generator=gen).to(device)
    return {"down": lambda c: (moe_down(hid, inp["w2"], r, b, config=c),),
            "dx": lambda c: (moe_dx_route(gu, inp["w1"], r, b, config=c),),
            "dgrad": lambda c: moe_dgrad_dswiglu_dscore(inp["dout"], inp["w2"], gu, hid, r, b, config=c),
            "dgrad_plain": lambda c: (moe_dgrad_dswiglu(inp["dout"], w2_rows, gu, r, b, config=c),),
            "up": lambda c: moe_up_swiglu(inp["x"], inp["w1"], r, b, config=c),
            "up_kmajor": lambda c: moe_up_swiglu(inp["x"], w1_kmajor, r, b, config=c),
            "wgrad_w1": lambda c: (moe_wgrad_w1(inp["x"], dgu, r, b, config=c),),
            "wgrad_w2": lambda c: (moe_wgrad_w2(hid, inp["dout"], r, b, config=c),),
            "wgrad_w1_acc": lambda c: (_accumulated(moe_wgrad_w1, g1, inp["x"], dgu, r, b, c),),
            "wgrad_w2_acc": lambda c: (_accumulated(moe_wgrad_w2, g2, hid, inp["dout"], r, b, c),)}, r, inp


def _accumulated(wgrad, start, a, b_op, routing, backend, config):
    """main_grad after ``wgrad`` added its FP32 dW into a copy of ``start``."""
    main_grad = start.clone()
    assert wgrad(a, b_op, routing, backend, main_grad=main_grad, config=config) is None
    return main_grad


def test_ws_refuses_other_backends_and_stages_by_name(device):
    # The config checks run before the backend's (sm_90 only), so all of them run on the interpreter too.
    runs, r, inp = _runs(device)
    b = backend_of(device)
    assert_ws_refused_off_sm90(runs, WS_CONFIGS[0], device)
    with pytest.raises(ValueError, match="64 rows"):
        runs["down"](GemmConfig(128, 128, 64, 1, 4, 4, "ws"))
    with pytest.raises(ValueError, match="needs 262144 bytes of shared memory"):  # 7 stages + the BF16 tile buffer
        runs["down"](GemmConfig(128, 128, 64, 1, 8, 7, "ws"))
    with pytest.raises(ValueError, match="dividing C 128"):  # down's C is H = 128
        runs["down"](GemmConfig(128, 256, 64, 1, 8, 2, "ws"))
    with pytest.raises(ValueError, match="BLOCK_K a multiple of 64"):  # the cp.async pass: 64 BF16 columns
        runs["dgrad"](GemmConfig(128, 128, 32, 1, 8, 4, "ws"))
    with pytest.raises(ValueError, match="needs 245760 bytes of shared memory"):  # 6 stages + gu and h buffers
        runs["up"](GemmConfig(128, 128, 64, 1, 8, 6, "ws"))
    with pytest.raises(ValueError, match="an epilogue warpgroup \\(12 warps\\) is dgrad's only"):
        runs["up"](GemmConfig(128, 128, 64, 1, 12, 4, "ws"))
    with pytest.raises(ValueError, match=r"down: .* 128 with 8; got BLOCK_M 128, 12 warps"):
        runs["down"](GemmConfig(128, 128, 64, 1, 12, 4, "ws"))
    with pytest.raises(ValueError, match=r"dgrad: .* or 128 with 12 .*; got BLOCK_M 64, 12 warps"):
        runs["dgrad"](GemmConfig(64, 128, 64, 1, 12, 4, "ws"))
    # 5 stages + the hand-off buffer + the epilogue warpgroup's dscore scratch
    with pytest.raises(ValueError, match="needs 237568 bytes of shared memory"):
        runs["dgrad"](GemmConfig(128, 128, 64, 1, 12, 5, "ws"))
    x_odd_rows = torch.zeros((inp["x"].shape[0], inp["x"].shape[1] + 1), dtype=inp["x"].dtype, device=device)
    x_odd_rows = x_odd_rows[:, :-1].copy_(inp["x"])  # rows 2 * 129 bytes apart: cp.async needs 16-byte alignment
    with pytest.raises(ValueError, match="activation row-major"):
        moe_up_swiglu(x_odd_rows, inp["w1"], r, b, config=GemmConfig(128, 64, 64, 1, 8, 4, "ws"))
    # dgrad's A in expert order (read by TMA) must hold every padded row of the routing.
    gu, _ = moe_up_swiglu(inp["x"], inp["w1"], r, b)
    with pytest.raises(ValueError, match=f"dgrad: the expert-ordered activation has 1 rows; the routing has {r.padded_rows}"):
        launch_moe_ws_gather(2, "dgrad", WS_GATHER_CONFIGS[0], EPI_DSWIGLU, inp["dout"][:1], inp["w2"].transpose(1, 2),
                             torch.empty_like(gu), gu, r, None, b, gather=False)
    # The weight gradients' own limits.
    with pytest.raises(ValueError, match="wgrad: variant 'ws' gives each consumer warpgroup .* 64 rows"):
        runs["wgrad_w1"](GemmConfig(128, 128, 64, 1, 4, 4, "ws"))
    with pytest.raises(ValueError, match="needs 262144 bytes of shared memory"):  # 7 stages + the BF16 tile buffer
        runs["wgrad_w2_acc"](GemmConfig(128, 128, 64, 1, 8, 7, "ws"))
    with pytest.raises(ValueError, match="dividing C 128"):  # dW2's C is H = 128
        runs["wgrad_w2"](GemmConfig(128, 256, 64, 1, 8, 2, "ws"))
    with pytest.raises(ValueError, match="BLOCK_K a multiple of 16 dividing 128"):
        runs["wgrad_w1"](GemmConfig(128, 128, 256, 1, 8, 2, "ws"))  # a TMA box, but past a padded segment
    with pytest.raises(ValueError, match="A and B row-major"):
        moe_wgrad_w1(x_odd_rows, torch.zeros((r.padded_rows, 256), dtype=torch.bfloat16, device=device), r, b,
                     config=WS_WGRAD_CONFIGS[0])


def test_a_ws_wgrad_pick_takes_the_triton_tile_for_operands_it_cannot_address(device, monkeypatch):
    # The table's weight-gradient pick (when it is "ws") runs on the same tile in Triton where TMA / cp.async cannot
    # read x (rows not 16-byte aligned) or main_grad is not contiguous: the same K order, so the same bits; an
    # addressable batch goes to the Gluon kernel, which the interpreter refuses by name.
    if device.type != "cpu":
        pytest.skip("checked where the Gluon kernel is refused; on the GPU the bit tests cover both paths")
    from detkit.kernels.moe.layer import MOE_CONFIGS

    b = backend_of(device)
    inp = make_inputs(MoeCase(24, 128, 128, 3, 2, "random", 5), device)
    r = build_routing(inp["topk_ids"], inp["scores"], 3)
    dgu = torch.randn((r.padded_rows, 256), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = moe_wgrad_w1(inp["x"], dgu, r, b)
    want_fp32 = torch.zeros((3, 128, 256))
    moe_wgrad_w1(inp["x"], dgu, r, b, main_grad=want_fp32)
    monkeypatch.setitem(MOE_CONFIGS[b], "wgrad", WS_WGRAD_CONFIGS[0])
    x_odd_rows = torch.zeros((24, 129), dtype=torch.bfloat16)[:, :-1].copy_(inp["x"])
    assert compare_bits(moe_wgrad_w1(x_odd_rows, dgu, r, b), want).equal
    main_grad = torch.zeros((3, 256, 128)).transpose(1, 2)  # [E, H, 2I] view, not contiguous
    assert moe_wgrad_w1(inp["x"], dgu, r, b, main_grad=main_grad) is None
    assert compare_bits(main_grad, want_fp32).equal
    with pytest.raises(ValueError, match="variant 'ws' is a Gluon kernel for sm_90"):
        moe_wgrad_w1(inp["x"], dgu, r, b)
    # A tile that does not divide dW (dW2 [E, I, H] = [3, 128, 128] under a 256-wide tile): the same tile in Triton.
    h, dout = dgu[:, :128].contiguous(), torch.randn((24, 128), generator=torch.Generator().manual_seed(3)).to(dgu.dtype)
    want_w2 = moe_wgrad_w2(h, dout, r, b, config=replace(WS_WGRAD_CONFIGS[3], variant="ptr"))
    monkeypatch.setitem(MOE_CONFIGS[b], "wgrad", WS_WGRAD_CONFIGS[3])
    assert compare_bits(moe_wgrad_w2(h, dout, r, b), want_w2).equal


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(300, 512, 384, 5, 2), (2048, 1024, 768, 16, 4)])
def test_ws_gives_the_triton_tiles_bits(shape, device):
    t, h, i, e, k = shape
    runs, r, _ = _runs(device, t, h, i, e, k, seed=11)
    assert int(r.counts[0]) == 0 and int(r.counts[1]) == 1
    for stage, run in runs.items():
        ref = run(TRITON_TILES[stage])
        for config in _ws_configs(stage):
            out = run(config)
            for j, (o, want) in enumerate(zip(out, ref)):
                assert compare_bits(o, want).equal, (stage, j, config.label())
                assert compare_bits(run(config)[j], o).equal, (stage, j, config.label())  # repeat
        if not stage.startswith("wgrad"):
            assert bool((ref[0][r.sorted_route < 0] == 0).all()), stage


@pytest.mark.gpu
def test_ws_wgrad_padding_rows_add_nothing(device):
    # Token 0 routed nowhere and Inf in its rows of x and dout: padding rows name token 0, so a weight gradient that
    # multiplied its rows (or 0 * them) would turn finite sums into NaN. The Triton kernel masks them.
    runs, r, _ = _runs(device, 300, 256, 128, 5, 2, seed=13, poison_token0=True)
    assert int(r.counts[0]) == 0 and int(r.counts[1]) == 1
    for stage in ("wgrad_w1", "wgrad_w2", "wgrad_w1_acc", "wgrad_w2_acc"):
        ref = runs[stage](TRITON_TILES[stage])[0]
        assert bool(torch.isfinite(ref).all()), stage
        for config in WS_WGRAD_CONFIGS[:3]:
            assert compare_bits(runs[stage](config)[0], ref).equal, (stage, config.label())


_COMPILE = r'''
import json
from triton.experimental.gluon import language as gl
from tools.gemm_sass import gluon_desc_type, gluon_sm90_report
from detkit.kernels.det_gemm.ws import consumers, max_regs
from detkit.kernels.det_gemm.launch import GemmConfig
from detkit.kernels.moe.ws import (
    epilogue_warpgroup, gather_store_bytes, mma_warpgroups, moe_ws_gather_kernel, moe_ws_kernel, moe_ws_wgrad_kernel,
)
out = {}
box = lambda rows, cols, dt=gl.bfloat16: gluon_desc_type(rows, cols, dt)
# GROUP_M: each kernel's first case in the row-major tile order, the others in bands of 8 row tiles.
group_m = lambda i: 1 if i == 0 else 8
for i, (bm, bn, bk, warps, stages, k_major, c_dt) in enumerate([
        (128, 128, 64, 8, 4, False, gl.bfloat16), (128, 128, 64, 8, 5, True, gl.bfloat16),
        (64, 128, 64, 4, 6, False, gl.bfloat16), (128, 256, 64, 8, 3, False, gl.bfloat16),
        (128, 256, 32, 8, 6, True, gl.bfloat16), (128, 128, 64, 8, 4, False, gl.float32)]):
    types = {"a_desc": box(bm, bk), "b_desc": box(bn, bk) if k_major else box(bk, bn),
             "c_desc": box(bm // consumers(warps), bn, c_dt), "route_ptr": "*i32", "tile_expert_ptr": "*i32",
             "gate_ptr": "*i32"}
    consts = {"BLOCK_M": bm, "BLOCK_N": bn, "STAGES": stages, "B_K_MAJOR": k_major, "CONSUMERS": consumers(warps),
              "GROUP_M": group_m(i)}
    r = gluon_sm90_report(moe_ws_kernel, types, consts, max_regs(warps))
    r["budget"] = stages * (bm + bn) * bk * 2 + bm * bn * (4 if c_dt == gl.float32 else 2)  # what the launcher checks
    out[f"plain_{bm}x{bn}x{bk}_s{stages}_kmajor{int(k_major)}_{c_dt}"] = r
for i, (epi, bm, bn, bk, warps, stages, k_major, dscore, gather) in enumerate([
        (2, 128, 128, 64, 8, 4, True, True, True), (2, 128, 128, 64, 8, 4, True, False, True),
        (2, 64, 128, 64, 4, 6, False, True, True), (2, 128, 64, 64, 8, 6, True, True, True),
        (2, 128, 128, 64, 8, 4, True, True, False), (2, 64, 128, 64, 4, 6, False, True, False),
        (1, 128, 128, 64, 8, 4, False, False, True), (1, 128, 128, 64, 8, 5, True, False, True),
        (1, 128, 256, 64, 8, 2, False, False, True), (1, 128, 128, 64, 8, 4, False, False, False),
        (2, 128, 128, 64, 12, 4, True, True, False), (2, 128, 128, 64, 12, 4, True, True, True),
        (2, 128, 64, 64, 12, 6, False, False, False)]):
    cfg = GemmConfig(bm, bn, bk, 1, warps, stages, "ws")
    rows = bm // mma_warpgroups(cfg)
    out_box = box(rows, bn, gl.int32 if epi == 2 else gl.bfloat16)
    types = {"a_ptr": "*bf16", "a_desc": box(bm, bk), "b_desc": box(bn, bk) if k_major else box(bk, bn), "out_desc": out_box,
             "h_desc": box(rows, bn // 2) if epi == 1 else out_box, "gather_ptr": "*i32",
             "route_ptr": "*i32", "score_ptr": "*fp32", "tile_expert_ptr": "*i32", "gate_ptr": "*i32",
             "h_ptr": "*bf16", "ds_ptr": "*fp32", "gu_ptr": "*i32"}
    consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "STAGES": stages, "SEGMENT": 128,
              "CONSUMERS": mma_warpgroups(cfg), "B_K_MAJOR": k_major, "EPILOGUE": epi, "DSCORE": dscore, "DS_CHUNK": 64,
              "GATHER_A": gather, "EPI_WARPGROUP": epilogue_warpgroup(cfg), "GROUP_M": group_m(i)}
    r = gluon_sm90_report(moe_ws_gather_kernel, types, consts, max_regs(warps))
    r["budget"] = stages * (bm + bn) * bk * 2 + gather_store_bytes(cfg, epi, dscore)  # what the launcher checks
    out[f"{'dgrad' if epi == 2 else 'up'}_{bm}x{bn}x{bk}_s{stages}_w{warps}_kmajor{int(k_major)}_ds{int(dscore)}_gather{int(gather)}"] = r
for i, (bm, bn, bk, warps, stages, gather, acc) in enumerate([
        (128, 128, 64, 8, 4, True, False), (128, 128, 64, 8, 4, False, False), (128, 128, 64, 8, 4, True, True),
        (64, 128, 64, 4, 6, False, True), (128, 256, 64, 8, 3, True, False)]):
    types = {"a_desc": box(bk, 64), "a_ptr": "*bf16", "b_desc": box(bk, bn), "c_desc": box(64, bn),
             "dw_ptr": "*fp32" if acc else "*bf16", "gather_ptr": "*i32", "offsets_ptr": "*i32", "counts_ptr": "*i32",
             "gate_ptr": "*i32"}
    consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "STAGES": stages, "CONSUMERS": consumers(warps),
              "GATHER_A": gather, "ACCUMULATE": acc, "GROUP_M": group_m(i)}
    r = gluon_sm90_report(moe_ws_wgrad_kernel, types, consts, max_regs(warps))
    r["budget"] = stages * (bm + bn) * bk * 2 + bm * bn * 2  # what the launcher checks
    out[f"wgrad_{bm}x{bn}x{bk}_s{stages}_gather{int(gather)}_acc{int(acc)}"] = r
print(json.dumps(out))
'''


def test_ws_kernel_compiles_for_sm90_offline(tmp_path):
    report = compile_sm90_offline(_COMPILE, tmp_path)
    assert len(report) == 24, report
    for name, r in report.items():
        # BF16 wgmma fed by TMA, the tile out by TMA store (main_grad: pointer adds), setmaxnreg (the roles' register
        # split), no spills, one MMA left in flight behind the newest, and no "wgmma.mma_async instructions are
        # serialized" from ptxas.
        stores = not name.endswith("_acc1")
        assert r["hgmma"] > 0 and r["tma"] > 0 and (r["tma_store"] > 0) == stores and r["setmaxnreg"] > 0, (name, r)
        assert r["stack"] == 0 and r["wait1"] > 0 and not r["serialized"], (name, r)
        assert r["shared"] <= 227 * 1024, (name, r)
        if "gather1" in name:  # gathered rows by cp.async
            assert r["ldgsts"] > 0, (name, r)
        elif name.startswith(("up", "dgrad")):  # rows in expert order: A by TMA, no cp.async
            assert r["ldgsts"] == 0, (name, r)
        if name.startswith(("plain", "up", "dgrad")) or (name.startswith("wgrad") and stores):  # the launcher's budget
            assert r["budget"] <= r["shared"] <= r["budget"] + 1024, (name, r)
        elif name.startswith("wgrad"):  # main_grad: the store buffer the launcher counts is compiled away
            assert r["shared"] <= r["budget"], (name, r)
