"""det_gemm's TMA variant (``GemmConfig(..., variant="tma")``, det_gemm_tma_kernel): the same bits as the
pointer kernel with the same config (both weight layouts, fwd/dA/dB, segmented and FP32 output), every
fail-closed path, the config rules, the tune sweep's handling of a refused candidate, and an offline
sm_90 compile showing TMA loads (UTMALDG) feeding wgmma (HGMMA). Runs on the interpreter in CI (Triton
3.6's interpreter executes tensor descriptors) and compiled on the GPU with DETKIT_TEST_DEVICE=cuda."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from detkit.kernels.det_gemm.launch import (
    CONFIG_TABLE, LAUNCHERS, ByWidth, FewestWaves, GemmConfig, OneWave, all_configs, entry_configs, operand_ring_bytes,
    select_config, ws_twin,
)
from detkit.toolkit.contract import compare_bits
from tests.test_det_gemm import _operands, fresh_plans  # noqa: F401,F811 (a fixture)
from detkit.toolkit.fixtures import bf16_randn, weight_kn


def _tma(config: GemmConfig) -> GemmConfig:
    return replace(config, variant="tma")


def _assert_same_bits(got, want):
    result = compare_bits(got, want)
    assert result.equal, result.as_row()


# A small config (several tiles, masked K tail: 56 and 40 are not multiples of 32) and the table's large-M
# pick (one tile; in the interpreter its BLOCK_K runs as STEP_K sub-steps, so that path is covered too).
@pytest.mark.parametrize("op", ["fwd", "da", "db"])
@pytest.mark.parametrize("layout", ["kn", "linear"])
@pytest.mark.parametrize("m", [1, 7, 129])
def test_tma_bits_equal_pointer_kernel(op, layout, m, device):
    n, k = 40, 56
    x, y = _operands(op, m, n, k, layout, device)
    for config in (GemmConfig(16, 32, 32, 1, 4, 2), replace(select_config(op, 4096), variant="ptr")):
        for out_dtype in (torch.bfloat16, torch.float32):
            ptr, ptr_launch = LAUNCHERS[op](x, y, config=config, out_dtype=out_dtype)
            tma, tma_launch = LAUNCHERS[op](x, y, config=_tma(config), out_dtype=out_dtype)
            assert tma_launch.config.variant == "tma" and tma_launch.name == ptr_launch.name
            assert tma_launch.backend == ptr_launch.backend
            _assert_same_bits(tma, ptr)


def test_tma_segmented_equals_pointer_kernel_and_partials(device):
    # Three 64-element segments over K=160 (the last one partial) with BLOCK_K 32.
    a, b = bf16_randn((20, 160), 5, device), weight_kn(160, 24, 6, "linear", device)
    config = GemmConfig(16, 32, 32, 1, 4, 2, variant="tma")
    seg = LAUNCHERS["fwd"](a, b, config=config, seg_len=64, out_dtype=torch.float32)[0]
    ptr = LAUNCHERS["fwd"](a, b, config=replace(config, variant="ptr"), seg_len=64, out_dtype=torch.float32)[0]
    _assert_same_bits(seg, ptr)
    parts = [LAUNCHERS["fwd"](a[:, i:i + 64], b[i:i + 64], config=config, out_dtype=torch.float32)[0]
             for i in (0, 64, 128)]
    _assert_same_bits(seg, (parts[0] + parts[1]) + parts[2])


# ---- "tma3": three power-of-two sub-tiles per tile (e.g. 192 columns), a tune candidate ----------------
# Tiles narrower and wider than the output (n 40: one tile column, the last sub-tiles masked; n 104: three
# tile columns of 48), a masked K tail, and the same bits as the pointer kernel at another tile.
@pytest.mark.parametrize("op", ["fwd", "da", "db"])
@pytest.mark.parametrize("layout", ["kn", "linear"])
@pytest.mark.parametrize("m,n", [(1, 40), (129, 104)])
def test_tma3_bits_equal_pointer_kernel(op, layout, m, n, device):
    x, y = _operands(op, m, n, 56, layout, device)
    ptr_config = GemmConfig(16, 32, 32, 1, 4, 2)
    for config in (GemmConfig(16, 48, 32, 1, 4, 2, "tma3"), GemmConfig(32, 96, 64, 1, 4, 2, "tma3")):
        for out_dtype in (torch.bfloat16, torch.float32):
            ptr, ptr_launch = LAUNCHERS[op](x, y, config=ptr_config, out_dtype=out_dtype)
            got, launch = LAUNCHERS[op](x, y, config=config, out_dtype=out_dtype)
            assert launch.config == config and launch.name == ptr_launch.name
            _assert_same_bits(got, ptr)


def test_tma3_segmented_and_twin_equal_pointer_kernel(device):
    a, b = bf16_randn((20, 160), 5, device), weight_kn(160, 104, 6, "linear", device)
    config = GemmConfig(16, 48, 32, 1, 4, 2, "tma3")
    ptr = LAUNCHERS["fwd"](a, b, config=GemmConfig(16, 32, 32, 1, 4, 2), seg_len=64, out_dtype=torch.float32)[0]
    twin = torch.full_like(ptr, float("nan"))
    seg = LAUNCHERS["fwd"](a, b, config=config, seg_len=64, out_dtype=torch.float32, twin_out=twin)[0]
    _assert_same_bits(seg, ptr)
    _assert_same_bits(twin, ptr)


def test_tma3_config_rules():
    wide = GemmConfig(128, 192, 64, 8, 8, 4, "tma3")
    assert wide.box_n == 64 and wide.label().endswith("_tma3") and GemmConfig(128, 192, 64, 8, 8, 4).box_n == 192
    assert operand_ring_bytes(wide) == 4 * (128 * 64 + 64 * 192) * 2


# ---- fail closed: an operand TMA cannot address is refused, naming it; never a silent fallback --------
def _unaligned_base(rows, cols, device):
    """A row-major [rows, cols] view starting 2 bytes past a 16-byte boundary."""
    return bf16_randn((rows * cols + 1,), 3, device)[1:].view(rows, cols)


@pytest.mark.parametrize("op,make,name,detail", [
    # K = 60: a's row stride is 120 bytes, not a multiple of 16
    ("fwd", lambda d: (bf16_randn((4, 60), 1, d), bf16_randn((60, 16), 2, d)), "a",
     r"shape \(4, 60\), strides \(60, 1\)"),
    # no dim with stride 1
    ("fwd", lambda d: (bf16_randn((4, 64), 1, d), bf16_randn((64, 32), 2, d)[:, ::2]), "b",
     r"shape \(64, 16\), strides \(32, 2\)"),
    ("fwd", lambda d: (_unaligned_base(4, 64, d), bf16_randn((64, 16), 2, d)), "a", r"data_ptr % 16 = 2"),
    # dA on an nn.Linear weight.t() with K = 60: the [N, K] weight's row stride is 120 bytes
    ("da", lambda d: (bf16_randn((4, 16), 1, d), bf16_randn((16, 60), 2, d).t()), "b",
     r"shape \(60, 16\), strides \(1, 60\)"),
    ("db", lambda d: (bf16_randn((4, 64), 1, d), _unaligned_base(4, 16, d)), "dc", r"data_ptr % 16 = 2"),
])
def test_tma_refuses_operands_it_cannot_address(op, make, name, detail, device):
    x, y = make(device)
    config = GemmConfig(16, 32, 32, 1, 4, 2, variant="tma")
    with pytest.raises(ValueError, match=rf"variant 'tma' cannot describe {name} \(.*{detail}"):
        LAUNCHERS[op](x, y, config=config)
    LAUNCHERS[op](x, y, config=replace(config, variant="ptr"))  # the pointer kernel takes the same operands


def test_tma_refusal_message_says_what_is_needed(device):
    a, b = bf16_randn((4, 60), 1, device), bf16_randn((60, 16), 2, device)
    with pytest.raises(ValueError, match=r"TMA needs one dim with stride 1, the other stride a multiple of 8 "
                                         r"elements \(16 bytes\) and a 16-byte-aligned base; use a 'ptr' config"):
        LAUNCHERS["fwd"](a, b, config=GemmConfig(16, 32, 32, 1, 4, 2, variant="tma"))


def test_variant_field_defaults_to_ptr_and_table_pins_tma_only_where_measured():
    assert GemmConfig(128, 128, 64, 8, 8, 3) == GemmConfig(128, 128, 64, 8, 8, 3, "ptr")
    assert GemmConfig(128, 128, 64, 8, 8, 3).label() == "BM128_BN128_BK64_G8_w8_s3"
    assert GemmConfig(128, 128, 64, 8, 8, 3, "tma").label() == "BM128_BN128_BK64_G8_w8_s3_tma"
    assert GemmConfig(128, 128, 64, 8, 8, 3, "tma") != GemmConfig(128, 128, 64, 8, 8, 3)

    def holding(variant):
        return [(op, rows) for op, entries in CONFIG_TABLE.items() for rows, e in entries
                if any(c.variant == variant for c in entry_configs(e))]

    # Pointer tiles only where the H200 sweeps measured them ahead: the one-wave tiles of wide outputs at M <= 32
    # (fwd, dA), where the weight stream is the work, and dB's short reductions (M <= 64). Everything else is TMA.
    assert holding("ptr") == [("fwd", 16), ("fwd", 32), ("da", 16), ("da", 32), ("db", 64)]
    # TMA tiles: the narrow-output tiles (64x16, 64x64, 128x32) of every fwd/dA bucket up to M 256, the one-wave
    # tiles of wide outputs at M 33-256, and the large-M fewest-waves entry (64x128, 64x64, 64x16) of all three ops.
    assert holding("tma") == [("fwd", 16), ("fwd", 32), ("fwd", 64), ("fwd", 128), ("fwd", 256), ("fwd", 2**31),
                              ("da", 16), ("da", 32), ("da", 64), ("da", 128), ("da", 256), ("da", 2**31),
                              ("db", 2**31)]
    # The Gluon "ws" tiles (128x256, 128x128) are in the fewest-waves entry (M > 256; dB M > 64), which fwd/dA at
    # M 129-256 also take for an output no tile fits in one wave (an lm_head).
    assert holding("ws") == [("fwd", 256), ("fwd", 2**31), ("da", 256), ("da", 2**31), ("db", 2**31)]
    # "tma3" (64x192, 128x192): the one-wave tile of wide outputs at M 129-256 and a fewest-waves candidate, so the
    # same entries as "ws".
    assert holding("tma3") == holding("ws")
    # Only TMA-kernel tiles (no pointer or Gluon tile): fwd/dA at M 33-128, narrow and wide outputs alike.
    assert [(op, rows) for op, entries in CONFIG_TABLE.items() for rows, e in entries
            if all(c.variant in ("tma", "tma3") for c in entry_configs(e))] == [("fwd", 64), ("fwd", 128),
                                                                                ("da", 64), ("da", 128)]

    # A "tma3" tile has no pointer twin, so it is never a pick without an alternative: never an entry of its own
    # or a ByWidth width class, only a choice of a OneWave or FewestWaves that also holds a tile with a pointer
    # twin (the pick where TMA cannot address an operand).
    def leaves(entry):
        if isinstance(entry, ByWidth):
            return [leaf for _, e in entry.narrow + ((None, entry.wide),) for leaf in leaves(e)]
        if isinstance(entry, OneWave) and entry.many is not None:
            return [entry] + leaves(entry.many)
        return [entry]

    for entries in CONFIG_TABLE.values():
        for _, e in entries:
            for leaf in leaves(e):
                if isinstance(leaf, GemmConfig):
                    assert leaf.variant != "tma3", leaf
                else:
                    assert isinstance(leaf, (OneWave, FewestWaves)) and leaf.choices(tma3=False), leaf


@pytest.mark.parametrize("layout", ["kn", "linear"])
def test_da_pick_is_the_same_for_both_weight_layouts_with_the_same_bits(layout, device, monkeypatch, fresh_plans):
    import detkit.kernels.det_gemm.launch as dg

    # dA above M 256, output 1100 x 64 (K) on 12 SMs: the fewest-waves pick is the ws 128x128 tile (9 tiles, one
    # wave; 64x64 takes two), for a [K, N] weight (B K-major) and nn.Linear's weight.t() alike; it runs as the Gluon
    # kernel on sm_90 and as its TMA twin under the interpreter.
    m, n, k, sms = 1100, 48, 64, 12
    monkeypatch.setattr(dg, "device_sms", lambda dev: sms)
    dc, b = bf16_randn((m, n), 7, device), weight_kn(k, n, 8, layout, device)
    out, launch = LAUNCHERS["da"](dc, b)
    pick = select_config("da", m, cols=k, rows=m, sms=sms)
    assert pick == GemmConfig(128, 128, 64, 8, 8, 5, "ws")
    assert launch.config == (pick if device.type == "cuda" else ws_twin(pick))
    backend = "cuda_sm90" if device.type == "cuda" else "triton_interpreter"
    for other in all_configs("da", backend):  # every config the table can pick there: the same bits
        _assert_same_bits(out, LAUNCHERS["da"](dc, b, config=other)[0])


def test_a_ws_pick_runs_as_its_triton_twin_where_the_gluon_kernel_cannot(device, monkeypatch, fresh_plans):
    import detkit.kernels.det_gemm.launch as dg

    # M 1100, 40 output columns on 12 SMs: the fewest-waves pick is the ws 128x128 tile (9 tiles, one wave). Under
    # the interpreter and for seg_len segments it runs as the TMA kernel with the same tile; with an operand TMA
    # cannot address (K = 7: 14-byte rows), as the pointer kernel.
    m, n, sms = 1100, 40, 12
    monkeypatch.setattr(dg, "device_sms", lambda dev: sms)
    ws = select_config("fwd", m, cols=n, rows=m, sms=sms)
    assert ws == GemmConfig(128, 128, 64, 8, 8, 5, "ws")
    a, b = bf16_randn((m, 128), 1, device), weight_kn(128, n, 2, "linear", device)
    out, launch = LAUNCHERS["fwd"](a, b)
    assert launch.config == (ws if device.type == "cuda" else ws_twin(ws))
    seg, seg_launch = LAUNCHERS["fwd"](a, b, seg_len=64, out_dtype=torch.float32)
    assert seg_launch.config == replace(ws, variant="tma")
    a7, b7 = bf16_randn((m, 7), 3, device), weight_kn(7, n, 4, "linear", device)
    out7, launch7 = LAUNCHERS["fwd"](a7, b7)
    assert launch7.config == replace(ws, variant="ptr")
    _assert_same_bits(out, LAUNCHERS["fwd"](a, b, config=replace(ws, variant="ptr"))[0])
    _assert_same_bits(out7, LAUNCHERS["fwd"](a7, b7, config=GemmConfig(16, 32, 32, 1, 4, 2))[0])


@pytest.mark.parametrize("layout", ["kn", "linear"])
def test_table_pick_is_tma_where_addressable_else_the_same_tile_as_ptr(layout, device):
    import detkit.kernels.det_gemm.launch as dg

    # M 600, 40 output columns: the fewest-waves pick is the 64x16 TMA tile (30 tiles, one wave).
    m, n = 600, 40
    pick = select_config("fwd", m, cols=n, rows=m, sms=dg.device_sms(device))
    a, b = bf16_randn((m, 56), 1, device), weight_kn(56, n, 2, layout, device)
    out, launch = LAUNCHERS["fwd"](a, b)
    assert launch.config == pick and launch.config.variant == "tma"
    # K = 7: a row of A is 14 bytes, no TMA descriptor can describe it; same tile, pointer kernel.
    a7, b7 = bf16_randn((m, 7), 3, device), weight_kn(7, n, 4, layout, device)
    out7, launch7 = LAUNCHERS["fwd"](a7, b7)
    assert launch7.config == replace(pick, variant="ptr")
    ptr, _ = LAUNCHERS["fwd"](a, b, config=replace(launch.config, variant="ptr"))
    _assert_same_bits(out, ptr)
    _assert_same_bits(out7, LAUNCHERS["fwd"](a7, b7, config=launch7.config)[0])


@pytest.mark.parametrize("layout", ["kn", "linear"])
@pytest.mark.parametrize("m,n,sms,tma3,fallback", [
    # The one-wave entry of wide outputs at M 129-256: on 33 SMs the 64x192 "tma3" tile is 33 tiles (one wave), the
    # 8-stage 64x128 ones 51; without tma3, the 2-per-SM 64x128 (51 <= 33 x 2).
    (130, 2112, 33, GemmConfig(64, 192, 64, 8, 4, 6, "tma3"), GemmConfig(64, 128, 64, 8, 4, 4, "tma")),
    # The fewest-waves entry above M 256: on 3 SMs the 128x192 "tma3" tile is 3 tiles (one wave, cost 24576 / 0.8);
    # without tma3, the ws 128x256 (3 tiles, 32768 / 1.0; 128x128 takes two waves).
    (300, 192, 3, GemmConfig(128, 192, 64, 8, 8, 4, "tma3"), GemmConfig(128, 256, 64, 8, 8, 3, "ws")),
])
def test_table_tma3_pick_gives_way_to_a_tile_with_a_pointer_twin_where_tma_cannot_address(
        layout, m, n, sms, tma3, fallback, device, monkeypatch, fresh_plans):
    import detkit.kernels.det_gemm.launch as dg

    # K = 16: TMA addresses both operands, the "tma3" pick runs. K = 7 (14-byte rows): no TMA descriptor, so the
    # entry's pick among its tiles with a pointer twin, as the pointer kernel. Same bits either way.
    monkeypatch.setattr(dg, "device_sms", lambda dev: sms)
    assert select_config("fwd", m, cols=n, rows=m, sms=sms) == tma3
    assert select_config("fwd", m, cols=n, rows=m, sms=sms, tma3=False) == fallback
    for k, want in ((16, tma3), (7, replace(fallback, variant="ptr"))):
        a, b = bf16_randn((m, k), 1, device), weight_kn(k, n, 2, layout, device)
        out, launch = LAUNCHERS["fwd"](a, b)
        assert launch.config == want
        _assert_same_bits(out, LAUNCHERS["fwd"](a, b, config=GemmConfig(64, 64, 32, 1, 4, 2))[0])


@pytest.mark.parametrize("tile,variant,match", [
    ((128, 128, 64), "wgmma", r"GemmConfig.variant 'wgmma' is not supported; supported: \('ptr', 'tma', 'tma3', 'ws', "
                              r"'fma', 'gemv_row', 'gemv_vec', 'gemv_tile'\)"),
    ((64, 512, 64), "tma", r"variant 'tma' needs block_n a power of two <= 256 .*; got 512"),
    ((48, 64, 64), "tma", r"variant 'tma' needs block_m a power of two <= 256 .*; got 48"),
    ((128, 128, 64), "tma3", r"variant 'tma3' needs block_n three sub-tiles wide .*; got 128"),
    ((128, 120, 64), "tma3", r"variant 'tma3' needs block_n / 3 a power of two <= 256 .*; got 40"),
    ((128, 24, 64), "tma3", r"variant 'tma3' needs block_n / 3 >= 16 .*; got 8"),
])
def test_rejects_bad_variant_and_tma_box(tile, variant, match):
    with pytest.raises(ValueError, match=match):
        GemmConfig(*tile, 8, 8, 3, variant)


def test_tune_sweep_records_a_refused_candidate(device, monkeypatch):
    import tools.gemm_tune as tune

    tma, ptr = GemmConfig(16, 32, 32, 1, 4, 2, variant="tma"), GemmConfig(16, 32, 32, 1, 4, 2)
    monkeypatch.setattr(tune, "candidates", lambda op, m, variants: [c for c in (tma, ptr) if c.variant in variants])
    # K = 60: TMA cannot describe a [M, 60] activation (120-byte rows), so the tma candidate is refused.
    rows = tune.sweep(["fwd"], [7], ((60, 40),), ["kn"], rounds=1, device=device)
    by_config = {r["config"]: r for r in rows}
    assert "variant 'tma' cannot describe a" in by_config[tma.label()]["error"]
    assert by_config[ptr.label()]["bits_equal_table"] and by_config[ptr.label()]["median_us"] > 0
    assert sum(r.get("is_table", False) for r in rows) == 1
    (summary,) = tune.ab_summary(rows)  # the A/B line: no tma entry, since the only tma candidate was refused
    assert summary["table_tflops"] > 0 and "best_ptr" in summary and "best_tma" not in summary


# ---- compile for sm_90 without a GPU ---------------------------------------------------------------
def test_tma_kernel_compiles_for_sm90_offline_with_utmaldg_and_hgmma(tmp_path):
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"Triton's NVIDIA backend is not installed: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    cmd = [sys.executable, "-m", "tools.gemm_sass", "--out", str(tmp_path / "sass"), "--variants", "tma",
           "--cases", "fwd_weight_t", "da_weight_kn", "db_a_dc", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert set(rows) == {"fwd_weight_t_tma", "da_weight_kn_tma", "db_a_dc_tma"}
    for case, r in rows.items():
        # TMA loads feed wgmma; no cp.async left and no fallback to mma.sync.
        assert r["UTMALDG"] > 0 and r["HGMMA"] > 0, (case, r)
        assert r["LDGSTS"] == 0 and r["HMMA"] == 0, (case, r)
        assert r["shared_bytes"] <= 227 * 1024, (case, r)  # sm_90's per-block shared-memory limit


def test_db_candidates_follow_m_and_the_table_keys_db_by_m(device):
    import tools.gemm_tune as tune

    assert tune.candidates("db", 16) == tune.DB_SMALL_M  # the warp-specialized tiles only from M = 128
    assert tune.candidates("db", 4096) == tune.LARGE + tune.LARGE_TMA + tune.WS
    assert tune.candidates("db", 4096, variants=("ptr", "tma")) == tune.LARGE + tune.LARGE_TMA
    assert tune.candidates("fwd", 16) == tune.SMALL + tune.SMALL_TMA
    mid = tune.candidates("da", 512)
    assert set(tune.MID + tune.MID_TMA + tune.SMALL_TMA + tune.DEEP_MID + tune.WS) <= set(mid)
    assert len(set(mid)) == len(mid)  # none timed twice
    # dB's launch picks its config by M (its reduced dim), not by its output rows K.
    a, dc = bf16_randn((9, 56), 1, device), bf16_randn((9, 40), 2, device)
    assert LAUNCHERS["db"](a, dc)[1].config == select_config("db", 9)


_RING_SCRIPT = """
import json, sys, tempfile
from tools.gemm_sass import CASES, build
from detkit.kernels.det_gemm.launch import all_configs
case = next(c for c in CASES if c.name == "fwd_weight_t")
configs = {c for op in ("fwd", "da") for c in all_configs(op) if c.variant == "tma"}
print(json.dumps([build(case, "tma", tempfile.mkdtemp(), config=c) for c in sorted(configs, key=str)]))
"""


def test_one_wave_residency_matches_the_sm90_compiles_shared_memory(tmp_path):
    # The one-wave rule counts CTAs per SM from operand_ring_bytes; the compiled kernels must agree.
    import detkit.kernels.det_gemm.launch as dg
    from tests.moe_helpers import compile_sm90_offline

    rows = compile_sm90_offline(_RING_SCRIPT, tmp_path)
    by_label = {c.label(): c for op in ("fwd", "da") for c in all_configs(op)}
    assert len(rows) == 7, [r["config"] for r in rows]
    for r in rows:
        config = by_label[r["config"]]
        ring = operand_ring_bytes(config)
        assert ring <= r["shared_bytes"] <= ring + dg.SMEM_BARRIER_SLACK, (r["config"], r["shared_bytes"], ring)
        compiled = dg.SMEM_PER_SM // (r["shared_bytes"] + dg.SMEM_RESERVED_PER_CTA)
        assert compiled == dg.ctas_per_sm(config), (r["config"], compiled)


_TMA3_SCRIPT = """
import json, tempfile
from tools.gemm_sass import CASES, build
from detkit.kernels.det_gemm.launch import all_configs
configs = sorted({c for op in ("fwd", "da") for c in all_configs(op) if c.variant == "tma3"}, key=str)
rows = [build(case, "tma3", tempfile.mkdtemp(), config=c) for c in configs for case in CASES
        if case.name in ("fwd_weight_t", "fwd_weight_kn", "da_weight_t")]
print(json.dumps(rows))
"""


def test_tma3_kernel_compiles_for_sm90_offline_to_tma_and_wgmma_without_spills(tmp_path):
    # The table's three-sub-tile tiles: TMA loads into wgmma, no cp.async or mma.sync, no register
    # spills, and the shared memory operand_ring_bytes counts (so the one-wave rule can rank them).
    import detkit.kernels.det_gemm.launch as dg
    from tests.moe_helpers import compile_sm90_offline

    rows = compile_sm90_offline(_TMA3_SCRIPT, tmp_path)
    table3 = {c.label(): c for op in ("fwd", "da") for c in all_configs(op) if c.variant == "tma3"}
    assert len(table3) == 2 and len(rows) == 6
    for r in rows:
        assert r["UTMALDG"] > 0 and r["HGMMA"] > 0 and r["LDGSTS"] == 0 and r["HMMA"] == 0, r
        assert r["stack_bytes"] == 0, r
        config = table3[r["config"]]
        ring = operand_ring_bytes(config)
        assert ring <= r["shared_bytes"] <= ring + dg.SMEM_BARRIER_SLACK, (r["config"], r["shared_bytes"], ring)
        compiled = dg.SMEM_PER_SM // (r["shared_bytes"] + dg.SMEM_RESERVED_PER_CTA)
        assert compiled == dg.ctas_per_sm(config) == 1, (r["config"], compiled)
