"""det_gemm's warp-specialized Gluon variant (``GemmConfig(..., variant="ws")``, kernels/det_gemm/ws.py).

On the GPU (DETKIT_TEST_DEVICE=cuda): the same bits as the TMA kernel with the same tile, for fwd/dA/dB on
both weight layouts, ragged edges, BF16/FP32 outputs and the twin store, and a persistent grid that wraps
(more tiles than SMs, so the ring's phases carry over tile boundaries), through both epilogues (TMA store, and
registers for output rows TMA cannot address). Everywhere: the config rules, the epilogue rule, the refusals
(no interpreter path, no segmented form), and an offline sm_90 compile showing the producer's TMA loads,
wgmma, the register hand-off between the warp roles, the TMA-store epilogue where it fits, and no spills."""

from dataclasses import replace

import pytest
import torch

from detkit.kernels.det_gemm.launch import LAUNCHERS, GemmConfig
from detkit.kernels.det_gemm.ws import WS_SHARED_BYTES, ws_tma_store
from tests.test_det_gemm import _operands
from detkit.toolkit.contract import compare_bits
from detkit.toolkit.fixtures import bf16_randn, weight_kn

WS_TILES = (GemmConfig(128, 128, 64, 8, 8, 4, "ws"), GemmConfig(64, 64, 64, 1, 4, 3, "ws"))


def _same_bits(got, want):
    result = compare_bits(got, want)
    assert result.equal, result.as_row()


def test_ws_config_rules():
    with pytest.raises(ValueError, match=r"variant 'ws' needs 4, 8 or 12 warps .* num_warps 2"):
        GemmConfig(128, 128, 64, 8, 2, 4, "ws")
    with pytest.raises(ValueError, match=r"block_m a multiple of 64 rows; .* block_m 96"):
        GemmConfig(96, 128, 64, 8, 8, 4, "ws")
    GemmConfig(64, 128, 64, 8, 8, 4, "ws")  # valid: the MoE FP8 gathered kernel's ping-pong (det_gemm refuses it)
    with pytest.raises(ValueError, match=r"variant 'ws' needs block_n a power of two <= 256 .* got 192"):
        GemmConfig(128, 192, 64, 8, 8, 4, "ws")
    assert GemmConfig(128, 256, 64, 8, 8, 4, "ws").label() == "BM128_BN256_BK64_G8_w8_s4_ws"


def test_ws_refuses_the_interpreter_and_segments_by_name(device):
    a, b = bf16_randn((64, 128), 1, device), weight_kn(128, 64, 2, "kn", device)
    if device.type == "cpu":
        with pytest.raises(ValueError, match=r"variant 'ws' is a Gluon kernel for sm_90 and has no 'triton_interpreter'"):
            LAUNCHERS["fwd"](a, b, config=WS_TILES[0])
    else:
        with pytest.raises(ValueError, match=r"variant 'ws' keeps one FP32 accumulator \(no seg_len segments\)"):
            LAUNCHERS["fwd"](a, b, config=WS_TILES[0], seg_len=64)
        with pytest.raises(ValueError, match=r"64 rows of a tile: block_m 128 per 8 warps; got block_m 64"):
            LAUNCHERS["fwd"](a, b, config=GemmConfig(64, 128, 64, 8, 8, 4, "ws"))  # two warpgroups of 32 rows


@pytest.mark.parametrize("op", ["fwd", "da", "db"])
@pytest.mark.parametrize("layout", ["kn", "linear"])
@pytest.mark.parametrize("m", [1, 129, 300])
def test_ws_bits_equal_tma_kernel(op, layout, m, device):
    if device.type != "cuda":
        pytest.skip("the Gluon kernel runs on sm_90 only")
    n, k = 264, 200  # ragged against every tile; 16-byte-aligned rows for TMA
    x, y = _operands(op, m, n, k, layout, device)
    for config in WS_TILES:
        for out_dtype in (torch.bfloat16, torch.float32):
            want, want_launch = LAUNCHERS[op](x, y, config=replace(config, variant="tma"), out_dtype=out_dtype)
            got, launch = LAUNCHERS[op](x, y, config=config, out_dtype=out_dtype)
            assert launch.config == config and launch.name == want_launch.name
            _same_bits(got, want)


def test_ws_persistent_grid_wraps_and_twin_store(device):
    if device.type != "cuda":
        pytest.skip("the Gluon kernel runs on sm_90 only")
    # 64x64 tiles of a 2048 x 1024 output: 512 tiles on at most 132 programs, 4 K steps per tile on a
    # 3-slot ring, so every program crosses tile boundaries mid-ring.
    a, b = bf16_randn((2048, 256), 3, device), weight_kn(256, 1024, 4, "linear", device)
    config = WS_TILES[1]
    want = LAUNCHERS["fwd"](a, b, config=replace(config, variant="tma"))[0]
    twin = torch.full_like(want, float("nan"))
    got = LAUNCHERS["fwd"](a, b, config=config, twin_out=twin)[0]
    _same_bits(got, want)
    _same_bits(twin, want)
    for _ in range(3):  # repeatable run to run
        _same_bits(LAUNCHERS["fwd"](a, b, config=config)[0], want)


def test_ws_epilogue_stores_by_tma_when_rows_align_and_the_buffer_fits():
    # 128x128x64, 6 stages: a 192 KiB ring + the 32 KiB BF16 tile buffer fit; the FP32 one (64 KiB) does not.
    assert ws_tma_store(128, 128, 64, 6, 6144, 2) and not ws_tma_store(128, 128, 64, 6, 6144, 4)
    assert not ws_tma_store(128, 128, 64, 4, 6140, 2)  # rows 12280 bytes apart: not 16-byte aligned
    assert ws_tma_store(128, 128, 64, 4, 6140, 4)  # 24560 bytes: aligned
    assert not ws_tma_store(128, 256, 64, 4, 6144, 2)  # 192 KiB ring + 64 KiB buffer
    assert WS_SHARED_BYTES < 227 * 1024


def test_ws_register_epilogue_for_rows_tma_cannot_address(device):
    if device.type != "cuda":
        pytest.skip("the Gluon kernel runs on sm_90 only")
    n, k = 262, 200  # C's rows 524 (BF16) / 1048 (FP32) bytes apart; B = weight.t() keeps its 400-byte rows
    x, y = _operands("fwd", 300, n, k, "linear", device)
    for config in WS_TILES:
        for out_dtype in (torch.bfloat16, torch.float32):
            assert not ws_tma_store(config.block_m, config.block_n, config.block_k, config.num_stages, n,
                                    out_dtype.itemsize)
            want = LAUNCHERS["fwd"](x, y, config=replace(config, variant="tma"), out_dtype=out_dtype)[0]
            twin = torch.full_like(want, float("nan"))
            _same_bits(LAUNCHERS["fwd"](x, y, config=config, out_dtype=out_dtype, twin_out=twin)[0], want)
            _same_bits(twin, want)


_WS_SCRIPT = """
import dataclasses, json, tempfile
from tools.gemm_sass import CASES, build
from detkit.kernels.det_gemm.launch import GemmConfig
config = GemmConfig(128, 256, 64, 8, 8, 4, "ws")
rows = [build(case, "ws", tempfile.mkdtemp(), config=config) for case in CASES]
# The TMA-store epilogue: 128x128x64 with 6 stages (BF16 out, and with the twin), not for FP32 out (no room) or for
# output rows that are not 16-byte aligned.
deep = GemmConfig(128, 128, 64, 8, 8, 6, "ws")
rows += [build(CASES[0], "ws", tempfile.mkdtemp(), config=deep, **flags)
         for flags in ({}, {"twin": True}, {"out_fp32": True})]
rows.append(build(dataclasses.replace(CASES[0], cols=6140), "ws", tempfile.mkdtemp(), config=deep))
print(json.dumps(rows))
"""


def test_ws_kernel_compiles_for_sm90_offline_to_tma_wgmma_and_register_handoff(tmp_path):
    from tests.moe_helpers import compile_sm90_offline

    rows = compile_sm90_offline(_WS_SCRIPT, tmp_path)
    assert len(rows) == 9
    for r in rows:
        # TMA loads (producer), wgmma on 64-row halves (two consumer warpgroups), setmaxnreg (the roles' register
        # split), no cp.async, no mma.sync, no spills.
        assert r["UTMALDG"] > 0 and r["HGMMA"] > 0 and r["USETMAXREG"] > 0, r
        assert r["LDGSTS"] == 0 and r["HMMA"] == 0 and r["stack_bytes"] == 0, r
        assert r["shared_bytes"] < 227 * 1024, r
    for r in rows[:5]:  # 4 slots of 128x64 + 64x256 BF16 tiles; no room for the 64 KiB tile buffer: register stores
        assert r["UTMASTG"] == 0 and 4 * (128 * 64 + 64 * 256) * 2 <= r["shared_bytes"] < 4 * 49152 + 1024, r
    plain, twin, fp32, unaligned = rows[5:]
    ring = 6 * (128 * 64 + 64 * 128) * 2
    # Each consumer stores its half by TMA (the twin: twice) from the 32 KiB buffer beside the ring.
    assert plain["UTMASTG"] == 2 and twin["UTMASTG"] == 4, (plain, twin)
    assert ring + 128 * 128 * 2 <= plain["shared_bytes"] <= ring + 128 * 128 * 2 + 1024, plain
    for r in (fp32, unaligned):  # register stores; the buffer compiled away
        assert r["UTMASTG"] == 0 and ring <= r["shared_bytes"] <= ring + 1024, r
