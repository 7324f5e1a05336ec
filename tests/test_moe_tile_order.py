"""The grouped (GROUP_M) tile order of the MoE GEMMs (kernels/moe/tile_order.py).

The index math, enumerated in Python: ``grouped_tile_order`` is the one function the Triton and the Gluon kernels
compile, and its walk is the banded one (GROUP_M row tiles per column tile, the last band shorter), a permutation of
every tile; a persistent grid's programs (the Gluon kernels' loop over ``live_tiles``) visit every live tile exactly
once and nothing past the routing's P; the weight gradients' expert-by-expert order covers every (expert, dW tile).

On the interpreter, every BF16 and FP8 stage (the grouped GEMMs through pointers and TMA, the weight gradients, FP32
main_grad accumulation) with GROUP_M 2, 3, 4 and 8 gives GROUP_M 1's bits, on a routing with an empty expert, an
expert of one row, uneven counts (one over a segment), masked routes and padding rows, with every output allocated
as NaN (an element a kernel skipped stays NaN); the whole layer with the grouped order is within every stage's
derived FP64 bound. The `gpu` tests do the same for the sm_90 picks (the Gluon kernels) at a larger shape."""

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from detkit.audits.moe import MoeCase, make_inputs, stage_checks
from detkit.audits.moe_fp8 import fp8_stage_checks
from detkit.kernels.det_gemm.launch import GemmConfig
from detkit.kernels.moe.configs import MOE_CONFIGS
from detkit.kernels.moe.fp8.configs import FP8_WGRAD_CONFIGS, MOE_FP8_CONFIGS
from detkit.kernels.moe.fp8.launch import moe_fp8_quant_colwise, moe_fp8_wgrad
from detkit.kernels.moe.launch import (
    moe_dgrad_dswiglu, moe_dgrad_dswiglu_dscore, moe_down, moe_dx_route, moe_scale_rows, moe_up_swiglu,
    moe_wgrad_w1, moe_wgrad_w2,
)
from detkit.kernels.moe.routing import build_routing, launch_routing
from detkit.kernels.moe.tile_order import grouped_tile_order, tile_order_gl, tile_order_tl
from detkit.toolkit.contract import compare_bits
from tests.conftest import TEST_DEVICE, backend_of
from tests.moe_helpers import assert_stages, fp8_stage_runs

ROOT = Path(__file__).resolve().parent.parent
GROUP_MS = (2, 3, 4, 8)
SM90_GROUP_MS = (4, 8, 16)  # the orders the sm_90 table may pick


# ---------------------------------------------------------------------------------------------
# Which order the table picks
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["up", "down", "dgrad", "dx"])
def test_the_grouped_order_is_picked_for_expert_slabs_larger_than_l2(stage):
    from detkit.kernels.backend import CUDA_SM90
    from detkit.kernels.moe.configs import GROUPED_ORDER, GROUPED_ORDER_MIN_SLAB_BYTES, grouped_order
    from detkit.kernels.moe.launch import table_moe_config

    small = torch.empty(2, 1024, 1024, dtype=torch.bfloat16)  # 2 MiB a slab: row-major
    large = torch.empty(2, 4096, 4096, dtype=torch.bfloat16)  # 32 MiB a slab: the bound itself
    assert 4096 * 4096 * 2 == GROUPED_ORDER_MIN_SLAB_BYTES
    assert table_moe_config(stage, CUDA_SM90, small).group_m == 1
    picked = table_moe_config(stage, CUDA_SM90, large)
    assert picked.group_m == GROUPED_ORDER[CUDA_SM90][stage] > 1
    assert replace(picked, group_m=1) == replace(MOE_CONFIGS[CUDA_SM90][stage], variant=picked.variant)
    assert grouped_order(stage, CUDA_SM90, GROUPED_ORDER_MIN_SLAB_BYTES - 1) == 1
    assert grouped_order("wgrad", CUDA_SM90, 2**40) == 1  # not measured: the table's order


# ---------------------------------------------------------------------------------------------
# The index math (plain Python: the function the kernels compile)
# ---------------------------------------------------------------------------------------------
def banded_walk(num_m: int, num_n: int, group_m: int) -> list[tuple[int, int]]:
    """The grouped order written out: band after band of group_m row tiles (the last one what is left), in each
    band every column tile in turn, for each the band's row tiles in turn."""
    return [(m, n) for first in range(0, num_m, group_m) for n in range(num_n)
            for m in range(first, min(first + group_m, num_m))]


def test_the_kernels_compile_the_tested_function():
    assert tile_order_tl.fn is grouped_tile_order and tile_order_gl.fn is grouped_tile_order


@pytest.mark.parametrize(("num_m", "num_n"), [(1, 1), (1, 7), (7, 1), (5, 3), (16, 5), (13, 224)])
@pytest.mark.parametrize("group_m", [1, *GROUP_MS, 16])
def test_grouped_order_is_the_banded_walk_over_every_tile_once(num_m, num_n, group_m):
    got = [grouped_tile_order(t, num_m, num_n, group_m) for t in range(num_m * num_n)]
    assert got == banded_walk(num_m, num_n, group_m)
    assert sorted(got) == [(m, n) for m in range(num_m) for n in range(num_n)]
    if group_m == 1:  # row-major, N fastest: the order before GROUP_M
        assert got == [(t // num_n, t % num_n) for t in range(num_m * num_n)]


@pytest.mark.parametrize("programs", [1, 3, 132])
@pytest.mark.parametrize("group_m", [1, 3, 8, 16])
def test_persistent_programs_visit_every_live_tile_once(programs, group_m):
    # The Gluon kernels' loop (gluon_blocks.live_tiles, live_tile_offsets): program p takes t = p, p + programs, ...
    # below num_tiles = (live rows / BLOCK_M) * num_n and maps t over the live row tiles; a grid over the routing's
    # bound (here 768 rows) stops at the real P, and a refused batch (no live rows) visits nothing.
    block_m, num_n = 64, 7
    for live_rows in (0, 128, 640, 768):
        num_tiles = live_rows // block_m * num_n
        seen = [grouped_tile_order(t, num_tiles // num_n, num_n, group_m)
                for p in range(programs) for t in range(p, num_tiles, programs)]
        assert sorted(seen) == [(m, n) for m in range(live_rows // block_m) for n in range(num_n)], live_rows


@pytest.mark.parametrize("group_m", [1, 3, 8])
def test_weight_gradient_order_covers_every_expert_tile_once(group_m):
    # moe_wgrad_kernel, moe_fp8_wgrad_kernel, gluon_blocks.wgrad_tile: expert t // per_expert, then the grouped order
    # over that dW[e]'s num_r x num_c tiles.
    experts, num_r, num_c = 3, 5, 4
    per_expert = num_r * num_c
    seen = [(t // per_expert, *grouped_tile_order(t % per_expert, num_r, num_c, group_m))
            for t in range(experts * per_expert)]
    assert seen == [(e, *tile) for e in range(experts) for tile in banded_walk(num_r, num_c, group_m)]


def test_every_persistent_partition_maps_tiles_through_the_grouped_order():
    # The producer, consumers and epilogue of a Gluon kernel must agree on each tile t: none computes its own
    # row-major (t // num_n, t % num_n) any longer; they all call live_tile_offsets (or wgrad_tile).
    for rel in ("kernels/moe/ws.py", "kernels/moe/gluon_blocks.py", "kernels/moe/fp8/ws.py",
                "kernels/moe/fp8/ws_gather.py"):
        src = (ROOT / rel).read_text()
        assert not re.search(r"\bt\s*(//|%)\s*num_n\b", src), rel
        assert not re.search(r"\brem\s*(//|%)\s*num_c\b", src), rel


# ---------------------------------------------------------------------------------------------
# The kernels: the same bits whatever GROUP_M, every element written
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def nan_outputs(monkeypatch):
    """torch.empty / empty_like fill floating-point tensors with NaN while the test runs: an output element no
    kernel writes stays NaN, so it fails every bound and every comparison with a written (finite) value."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(empty_like(*a, **k)))


def uneven_inputs(h: int, i: int, device: torch.device, seed: int = 7) -> dict[str, torch.Tensor]:
    """T = 100 tokens, K = 2 of E = 5 experts: expert 0 empty, expert 1 one row, experts 2-4 drawn 6 : 3 : 1 (about
    80, 65 and 30 rows), ~10% of routes masked: P = 512 expert-sorted rows, most of them padding."""
    t, e, k = 100, 5, 2
    inp = make_inputs(MoeCase(t, h, i, e, k, "random", seed), device)
    gen = torch.Generator().manual_seed(seed)
    weights = torch.tensor([0.0, 0.0, 6.0, 3.0, 1.0])
    ids = torch.stack([torch.multinomial(weights, k, generator=gen) for _ in range(t)]).to(torch.int32)
    ids[torch.rand(t, k, generator=gen) < 0.1] = -1
    ids[0, 0] = 1
    inp["topk_ids"] = ids.to(device)
    return inp


def assert_same_bits_for_every_group_m(run, base: GemmConfig, what: str, group_ms=GROUP_MS) -> None:
    """``run(config)`` -> a tuple of outputs: with ``base`` every element written (finite), and the same bits with
    each GROUP_M of ``group_ms``."""
    want = run(base)
    for i, out in enumerate(want):
        assert bool(torch.isfinite(out.float()).all()), (what, i, "an element was not written")
    for group_m in group_ms:
        for i, (got, ref) in enumerate(zip(run(replace(base, group_m=group_m)), want)):
            res = compare_bits(got, ref)
            assert res.equal, (what, group_m, i, res)


# BF16 at H = 64, I = 128: P = 512 expert-sorted rows (16 row tiles of 32), several column tiles per stage. up and
# down run the pointer kernel, dgrad and dX the TMA one.
H, I = 64, 128
BF16_TILES = {
    "up": GemmConfig(32, 64, 64, 1, 4, 1),  # 4 column tiles of 2I
    "down": GemmConfig(32, 16, 64, 1, 4, 1),  # 4 of H
    "dgrad": GemmConfig(32, 64, 64, 1, 4, 1, "tma"),  # 2 of I (the fused dscore partials: BLOCK_N 64)
    "dx": GemmConfig(32, 16, 64, 1, 4, 1, "tma"),  # 4 of H
    "wgrad": GemmConfig(32, 32, 64, 1, 4, 1),  # per expert, dW1 2 x 8 tiles, dW2 4 x 2
}


def bf16_runs(inp: dict, device: torch.device) -> dict:
    """Every BF16 GEMM stage on one routed batch as a function of the config returning a tuple of outputs."""
    b = backend_of(device)
    x, w1, w2, dout = inp["x"], inp["w1"], inp["w2"], inp["dout"]
    r = build_routing(inp["topk_ids"], inp["scores"], w1.shape[0])
    gu, hid = moe_up_swiglu(x, w1, r, b)
    dgu = moe_dgrad_dswiglu(dout, w2, gu, r, b)
    _, sorted_dout = moe_scale_rows(dout, r, b, sorted_copy=True)
    start = torch.randn(w2.shape, generator=torch.Generator().manual_seed(5)).to(device)

    def accumulated(config):
        main_grad = start.clone()  # random: an add to a wrong element or into the empty expert shows
        assert moe_wgrad_w2(hid, dout, r, b, main_grad=main_grad, config=config) is None
        return (main_grad,)

    return {
        "up": lambda c: moe_up_swiglu(x, w1, r, b, config=c),
        "down": lambda c: (moe_down(hid, w2, r, b, config=c),),
        "dgrad": lambda c: moe_dgrad_dswiglu_dscore(dout, w2, gu, hid, r, b, config=c),
        "dgrad_sorted": lambda c: moe_dgrad_dswiglu_dscore(dout, w2, gu, hid, r, b, config=c, sorted_dout=sorted_dout),
        "dx": lambda c: (moe_dx_route(dgu, w1, r, b, config=c),),
        "wgrad_w1": lambda c: (moe_wgrad_w1(x, dgu, r, b, config=c),),
        "wgrad_w2_acc": accumulated,
    }


def test_the_test_routing_has_the_awkward_cases(device):
    inp = uneven_inputs(H, I, device)
    r = build_routing(inp["topk_ids"], inp["scores"], 5)
    counts = r.expert_counts.tolist()
    assert counts[0] == 0 and counts[1] == 1 and min(counts[2:]) > 1 and len(set(counts[2:])) == 3, counts
    assert r.padded_rows // BF16_TILES["up"].block_m > max(GROUP_MS), r.padded_rows  # more row tiles than a band
    assert bool((inp["topk_ids"] < 0).any()) and bool((r.sorted_route < 0).any())  # masked routes, padding rows


@pytest.fixture(scope="module")
def bf16_stages():
    """bf16_runs on the uneven routing, built once (its intermediates come from the table's tiles)."""
    device = torch.device(TEST_DEVICE)
    return bf16_runs(uneven_inputs(H, I, device), device)


@pytest.mark.parametrize("stage", ["up", "down", "dgrad", "dgrad_sorted", "dx", "wgrad_w1", "wgrad_w2_acc"])
def test_bf16_stages_give_the_same_bits_in_every_tile_order(stage, bf16_stages, nan_outputs):
    key = "wgrad" if stage.startswith("wgrad") else stage.removesuffix("_sorted")
    assert_same_bits_for_every_group_m(bf16_stages[stage], BF16_TILES[key], stage)


def test_bf16_layer_in_the_grouped_order_is_within_every_stage_bound(device, nan_outputs, monkeypatch):
    # The layer's table picks replaced by the small tiles in the grouped order: every stage (up, SwiGLU, down, the
    # combine, dgrad, the dscores, dX, both weight gradients) within its derived bound of the FP64 oracle, padding
    # rows zero.
    table = MOE_CONFIGS[backend_of(device)]
    for stage, config in BF16_TILES.items():
        monkeypatch.setitem(table, stage, replace(config, group_m=3))
    assert assert_stages(stage_checks, uneven_inputs(H, I, device))["composed_dx_equal"]


def test_up_over_the_routing_bound_in_the_grouped_order_skips_the_tiles_past_p(device, nan_outputs):
    # The up GEMM queued before the host reads the counts runs over the largest P: with the grouped order its tiles
    # past the real P (whose bands mix live and dead row tiles) still store nothing, and the rows below P have the
    # exact routing's bits.
    b = backend_of(device)
    inp = uneven_inputs(H, I, device)
    pending = launch_routing(inp["topk_ids"], inp["scores"], 5)
    exact = pending.finish()
    p, p_max = exact.padded_rows, pending.bound.padded_rows
    assert p_max > p
    want = moe_up_swiglu(inp["x"], inp["w1"], exact, b, config=BF16_TILES["up"])
    for group_m in (3, 8):
        got = moe_up_swiglu(inp["x"], inp["w1"], pending.bound, b, config=replace(BF16_TILES["up"], group_m=group_m))
        for g, w in zip(got, want):
            assert compare_bits(g[:p], w).equal and bool(g[p:].isnan().all()), group_m


# FP8 at H = I = 128 (one scale block): the Triton kernels, up with h quantized by the row-wise pass.
FP8_H = FP8_I = 128
FP8_TILES = {
    "up": GemmConfig(32, 64, 128, 1, 4, 1),  # 4 column tiles of 2I
    "down": GemmConfig(32, 32, 128, 1, 4, 1),  # 4 of H
    "dgrad": GemmConfig(32, 64, 128, 1, 4, 1, "tma"),  # 2 of I (one dgu scale block per row)
    "dx": GemmConfig(32, 32, 128, 1, 4, 1, "tma"),  # 4 of H
}
FP8_WGRAD_TILE = GemmConfig(32, 64, 128, 1, 4, 1)  # per expert, dW1 4 x 4 tiles


def fp8_runs(inp: dict, device: torch.device) -> dict:
    b = backend_of(device)
    r = build_routing(inp["topk_ids"], inp["scores"], inp["w1"].shape[0])
    runs, mid = fp8_stage_runs(inp, r, b)
    xq = moe_fp8_quant_colwise(inp["x"], r, b, gather=True, scale=False)
    gq = moe_fp8_quant_colwise(mid["dgu"], r, b, gather=False, scale=False)
    start = torch.randn(inp["w1"].shape, generator=torch.Generator().manual_seed(6)).to(device)

    def accumulated(config):
        main_grad = start.clone()
        assert moe_fp8_wgrad(*xq, *gq, r, b, main_grad=main_grad, config=config) is None
        return (main_grad,)

    runs["wgrad"] = lambda c: (moe_fp8_wgrad(*xq, *gq, r, b, config=c),)
    runs["wgrad_acc"] = accumulated
    return runs


@pytest.fixture(scope="module")
def fp8_stages():
    device = torch.device(TEST_DEVICE)
    return fp8_runs(uneven_inputs(FP8_H, FP8_I, device), device)


# (FP32 main_grad accumulation takes the same tile order as the BF16 store: the BF16 weight gradient's covers it.)
@pytest.mark.parametrize("stage", ["up", "down", "dgrad", "dx", "wgrad"])
def test_fp8_stages_give_the_same_bits_in_every_tile_order(stage, fp8_stages, nan_outputs):
    base = FP8_WGRAD_TILE if stage.startswith("wgrad") else FP8_TILES[stage]
    assert_same_bits_for_every_group_m(fp8_stages[stage], base, stage)


def test_fp8_layer_in_the_grouped_order_is_within_every_stage_bound(device, nan_outputs, monkeypatch):
    backend = backend_of(device)
    for stage, config in FP8_TILES.items():
        monkeypatch.setitem(MOE_FP8_CONFIGS[backend], stage, replace(config, group_m=3))
    monkeypatch.setitem(FP8_WGRAD_CONFIGS, backend, replace(FP8_WGRAD_TILE, group_m=3))
    extra = assert_stages(fp8_stage_checks, uneven_inputs(FP8_H, FP8_I, device))
    assert all(extra["quantizers_bitwise"].values()), extra


# ---------------------------------------------------------------------------------------------
# The sm_90 picks (the Gluon kernels) on the GPU
# ---------------------------------------------------------------------------------------------
GPU_SHAPE = (2048, 1024, 768, 16, 4)  # T, H, I, E, K: ~512 rows per expert, 4-8 column tiles


def gpu_inputs(device: torch.device) -> dict:
    t, h, i, e, k = GPU_SHAPE
    inp = make_inputs(MoeCase(t, h, i, e, k, "random", 9), device)
    ids = inp["topk_ids"].clone()
    ids[ids == 0] = -1  # expert 0 empty
    inp["topk_ids"] = ids
    return inp


@pytest.mark.gpu
@pytest.mark.parametrize("stage", ["up", "down", "dgrad", "dgrad_sorted", "dx", "wgrad_w1", "wgrad_w2_acc"])
def test_sm90_bf16_picks_give_the_same_bits_in_every_tile_order(stage, device, nan_outputs):
    key = "wgrad" if stage.startswith("wgrad") else stage.removesuffix("_sorted")
    runs = bf16_runs(gpu_inputs(device), device)
    assert_same_bits_for_every_group_m(runs[stage], MOE_CONFIGS["cuda_sm90"][key], stage, SM90_GROUP_MS)


@pytest.mark.gpu
@pytest.mark.parametrize("stage", ["up", "down", "dgrad", "dx", "wgrad", "wgrad_acc"])
def test_sm90_fp8_picks_give_the_same_bits_in_every_tile_order(stage, device, nan_outputs):
    base = FP8_WGRAD_CONFIGS["cuda_sm90"] if stage.startswith("wgrad") else MOE_FP8_CONFIGS["cuda_sm90"][stage]
    runs = fp8_runs(gpu_inputs(device), device)
    assert_same_bits_for_every_group_m(runs[stage], base, stage, SM90_GROUP_MS)
