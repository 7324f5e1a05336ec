"""det_gemm against its FP64 oracle (the contract bound), its invariances at awkward shapes, and every
fail-closed path. Runs on the interpreter in CI and on the GPU with DETKIT_TEST_DEVICE=cuda."""

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from detkit.audits.gemm_contract import oracle
from detkit.kernels.det_gemm.launch import (
    CONFIG_TABLE, LAUNCHERS, ByWidth, FewestWaves, GemmConfig, OneWave, all_configs, clear_launch_plans, ctas_per_sm, det_gemm_da,
    det_gemm_db, det_gemm_fwd, det_gemm_fwd_launch, entry_configs, operand_ring_bytes, output_tiles, select_config,
)
from detkit.kernels.backend import check_bf16_matrix
from detkit.toolkit.contract import check_bound, compare_bits, gemm_bound
from detkit.toolkit.fixtures import bf16_randn, weight_kn

OPS = {"fwd": det_gemm_fwd, "da": det_gemm_da, "db": det_gemm_db}


def _operands(op, m, n, k, layout, device):
    w = weight_kn(k, n, 7, layout, device)
    if op == "fwd":
        return bf16_randn((m, k), 1, device), w
    if op == "da":
        return bf16_randn((m, n), 2, device), w
    return bf16_randn((m, k), 1, device), bf16_randn((m, n), 2, device)


@pytest.mark.parametrize("op", ["fwd", "da", "db"])
@pytest.mark.parametrize("m", [1, 7, 129])
@pytest.mark.parametrize("layout", ["kn", "linear"])
def test_within_contract_bound(op, m, layout, device):
    n, k = 40, 56
    x, y = _operands(op, m, n, k, layout, device)
    c = OPS[op](x, y)
    c_star, abs_ab = oracle(op, x, y)
    reduced = {"fwd": k, "da": n, "db": m}[op]
    result = check_bound(c, c_star, gemm_bound(c_star, abs_ab, reduced))
    assert result.passed, result
    assert c.dtype == torch.bfloat16 and c.shape == c_star.shape


def test_rounding_is_nearest_even_of_fp32_accumulator(device):
    a, b = bf16_randn((33, 48), 3, device), bf16_randn((48, 24), 4, device)
    c = det_gemm_fwd(a, b)
    acc = det_gemm_fwd_launch(a, b, out_dtype=torch.float32)[0]
    assert compare_bits(c, acc.to(torch.bfloat16)).equal


def test_segmented_reduction_equals_sum_of_fp32_partials(device):
    # The hook a parallelism-invariant mode uses: segments at shard boundaries reproduce p0 + p1.
    a, b = bf16_randn((20, 128), 5, device), bf16_randn((128, 24), 6, device)
    config = GemmConfig(16, 64, 64, 1, 4, 4)
    seg = det_gemm_fwd_launch(a, b, config=config, seg_len=64, out_dtype=torch.float32)[0]
    p0 = det_gemm_fwd_launch(a[:, :64], b[:64], config=config, out_dtype=torch.float32)[0]
    p1 = det_gemm_fwd_launch(a[:, 64:], b[64:], config=config, out_dtype=torch.float32)[0]
    assert compare_bits(seg, p0 + p1).equal


def test_config_table_is_pinned_and_covers_every_size():
    assert set(CONFIG_TABLE) == {"fwd", "da", "db"}
    for op, entries in CONFIG_TABLE.items():
        assert [bound for bound, _ in entries] == sorted(bound for bound, _ in entries)
        assert entries[-1][0] >= 2**31 - 1
        first = entries[0][1].wide if isinstance(entries[0][1], ByWidth) else entries[0][1]
        assert select_config(op, 1) == entry_configs(first)[0]  # no output width: the wide outputs' first choice
        picks = {c for _, e in entries for c in entry_configs(e)}
        assert picks <= set(all_configs(op))  # the audit runs every pick


def test_one_wave_picks_the_first_config_whose_grid_is_resident_at_once():
    deep, shallow = GemmConfig(64, 128, 64, 8, 4, 6, "tma"), GemmConfig(64, 128, 64, 8, 4, 4, "tma")
    assert operand_ring_bytes(deep) == 6 * (64 * 64 + 64 * 128) * 2 == 147456
    assert (ctas_per_sm(deep), ctas_per_sm(shallow)) == (1, 2)  # 144 KiB vs 96 KiB of 228 KiB per SM
    rule = OneWave((deep, shallow))
    # M=256 on 132 SMs: 4 x 32 = 128 tiles fit one wave of the deep ring; 4 x 48 = 192 need the 2-per-SM one.
    assert output_tiles(deep, 256, 4096) == 128 and rule.pick(256, 4096, 132) == deep
    assert output_tiles(deep, 256, 6144) == 192 and rule.pick(256, 6144, 132) == shallow
    assert rule.pick(256, 16384, 132) == deep  # 512 tiles: neither fits one wave, so the first
    # The table's (128, 256] entry: the same tile on an 8-stage ring (192 KiB, still one CTA per
    # SM), then a 64x192 "tma3" tile (4 x 32 = 128 tiles at 6144 wide), then the 2-per-SM ring.
    deeper = GemmConfig(64, 128, 64, 8, 4, 8, "tma")
    assert ctas_per_sm(deeper) == 1
    assert select_config("fwd", 256) == deeper  # no output width: the first choice
    wide3 = GemmConfig(64, 192, 64, 8, 4, 6, "tma3")
    assert select_config("fwd", 256, cols=4096) == deeper and select_config("fwd", 256, cols=6144) == wide3
    assert select_config("fwd", 256, cols=6144, sms=200) == deeper
    assert select_config("fwd", 256, cols=6144, tma3=False) == shallow  # operands TMA cannot address
    assert select_config("fwd", 384, cols=6144) == GemmConfig(128, 192, 64, 8, 8, 4, "tma3")  # 3 x 32 tiles
    with pytest.raises(ValueError, match=r"OneWave needs one or more GemmConfig; got \(\)"):
        OneWave(())
    with pytest.raises(ValueError, match=r"OneWave.max_ctas_per_sm must be a positive int or None; got 0"):
        OneWave((deep,), max_ctas_per_sm=0)
    with pytest.raises(ValueError, match=r"OneWave needs a config that is not 'tma3' .*\['BM64_BN192_BK64_G8_w4_s6_tma3'\]"):
        OneWave((wide3,))


def test_narrow_outputs_take_narrow_tiles_below_m_256():
    narrow16, square64 = GemmConfig(64, 16, 128, 1, 4, 6, "tma"), GemmConfig(64, 64, 128, 1, 4, 6, "tma")
    for op in ("fwd", "da"):
        assert select_config(op, 1, cols=128) == narrow16 and select_config(op, 16, cols=1024) == square64
        assert select_config(op, 1, cols=4096) == GemmConfig(16, 32, 128, 1, 4, 6)  # wide: the one-wave rule
        assert select_config(op, 64, cols=2048) == narrow16 and select_config(op, 128, cols=2048) == square64
        assert select_config(op, 256, cols=2048) == GemmConfig(128, 32, 128, 1, 4, 5, "tma")
    # An lm_head at M 128 / 256: no tile fits one wave; the large tile reads the activations the fewest times.
    assert select_config("fwd", 128, cols=151936) == GemmConfig(128, 128, 64, 8, 8, 6, "tma")
    assert select_config("fwd", 256, cols=151936) == GemmConfig(128, 256, 64, 8, 8, 3, "ws")  # the fewest waves
    assert select_config("fwd", 256, cols=18992) == GemmConfig(128, 128, 64, 8, 8, 5, "ws")  # 150 wide tiles: 2 waves
    with pytest.raises(ValueError, match="ByWidth needs increasing"):
        ByWidth(((1024, narrow16), (512, square64)), square64)
    with pytest.raises(ValueError, match="OneWave.many must be a GemmConfig with a pointer twin"):
        OneWave((square64,), many=GemmConfig(64, 192, 64, 8, 4, 6, "tma3"))


def test_fewest_waves_counts_waves_times_tile_area_over_rate():
    wide, ws128 = GemmConfig(128, 256, 64, 8, 8, 3, "ws"), GemmConfig(128, 128, 64, 8, 8, 5, "ws")
    sq64 = GemmConfig(64, 64, 128, 1, 4, 6, "tma")
    rule = FewestWaves(((wide, 1.0), (ws128, 0.9), (sq64, 0.3)))
    # N=1536, M=4096: 32 x 6 = 192 wide tiles are 2 waves on 132 SMs (cost 2 x 32768); 384 128x128 tiles 3 (3 x 16384
    # / 0.9).
    assert rule.cost(wide, 1.0, 4096, 1536, 132) == 2 * 32768 and rule.cost(ws128, 1.0, 4096, 1536, 132) == 3 * 16384
    assert rule.pick(4096, 1536, 132) == ws128
    assert rule.pick(4096, 6144, 132) == wide  # 6 vs 12 waves of half the area at a lower rate
    assert rule.pick(4096, 128, 132) == sq64  # 128 tiles of 64x64: one wave at rate 0.3 beats 128x128's 32 tiles
    assert select_config("fwd", 4096, cols=128) == sq64 and select_config("db", 4096, cols=128, rows=4096) == sq64
    assert select_config("db", 16384, cols=512, rows=4096) == ws128
    with pytest.raises(ValueError, match=r"FewestWaves needs \(GemmConfig, rate in \(0, 1\]\) pairs"):
        FewestWaves(((wide, 1.5),))


def test_one_wave_capped_at_one_cta_per_sm_at_the_smallest_m():
    narrow, wide = GemmConfig(16, 32, 128, 1, 4, 6), GemmConfig(16, 64, 128, 1, 4, 6)
    assert ctas_per_sm(narrow) == 3  # a 72 KiB ring: shared memory alone would allow three
    # M=8 on 132 SMs: a 4096-wide output is 128 narrow tiles (one wave at one per SM); 6144 wide is 192.
    assert select_config("da", 8, cols=4096) == narrow and select_config("da", 8, cols=6144) == wide
    assert select_config("fwd", 8, cols=6144) == wide  # the cap decides: uncapped, 192 <= 3 x 132
    assert OneWave((narrow, wide)).pick(8, 6144, 132) == narrow
    m32_narrow, m32_wide = GemmConfig(64, 32, 128, 1, 4, 4), GemmConfig(64, 64, 128, 1, 4, 4)
    assert select_config("fwd", 32, cols=4096) == m32_narrow and select_config("fwd", 32, cols=6144) == m32_wide


@pytest.fixture
def fresh_plans():
    """Launch plans read the device's SMs once per call signature: a test that patches them starts and ends with
    no plans (so none picked on patched SMs outlives it)."""
    clear_launch_plans()
    yield clear_launch_plans
    clear_launch_plans()


def test_launch_picks_by_the_output_width_on_the_device_sms(device, monkeypatch, fresh_plans):
    import detkit.kernels.det_gemm.launch as dg

    # M=130 in the (128, 256] bucket. A narrow output (128 columns) takes the 64x16 tile whatever the SMs. A wide one
    # (2056 columns, past the bucket's narrow widths) takes the one-wave rule: 51 tiles of 64x128 or 33 of 64x192. On
    # 51 SMs the 8-stage 64x128 ring (1 CTA per SM) holds them in one wave; on 33 only the 64x192 "tma3" tile does;
    # on 26 neither does, and the 4-stage 64x128 ring (2 CTAs per SM) does. Each launch runs the table's pick for
    # its exact call (output rows and cols on the patched SMs); every pick gives the same bits.
    k = 48
    a = bf16_randn((130, k), 1, device)
    narrow, wide = bf16_randn((k, 128), 2, device), bf16_randn((k, 2056), 3, device)
    cases = ((narrow, 2, GemmConfig(64, 16, 128, 1, 4, 6, "tma")), (narrow, 51, GemmConfig(64, 16, 128, 1, 4, 6, "tma")),
             (wide, 26, GemmConfig(64, 128, 64, 8, 4, 4, "tma")), (wide, 33, GemmConfig(64, 192, 64, 8, 4, 6, "tma3")),
             (wide, 51, GemmConfig(64, 128, 64, 8, 4, 8, "tma")))
    outs = {}
    for b, sms, want in cases:
        monkeypatch.setattr(dg, "device_sms", lambda dev, sms=sms: sms)
        fresh_plans()  # a plan of this signature picked on other SMs would be reused
        out, launch = det_gemm_fwd_launch(a, b)
        assert launch.config == select_config("fwd", 130, cols=b.shape[1], rows=130, sms=sms) == want
        if b.shape[1] in outs:
            assert compare_bits(out, outs[b.shape[1]]).equal
        outs[b.shape[1]] = out
        c_star, abs_ab = oracle("fwd", a, b)
        assert check_bound(out, c_star, gemm_bound(c_star, abs_ab, k)).passed


# ---- fail closed -----------------------------------------------------------------------------
def test_rejects_non_bf16(device):
    a = torch.zeros(4, 8, dtype=torch.float64, device=device)
    b = torch.zeros(8, 4, dtype=torch.bfloat16, device=device)
    with pytest.raises(TypeError, match=r"a has dtype torch.float64; supported: torch.bfloat16"):
        det_gemm_fwd(a, b)


def test_rejects_non_2d(device):
    a = torch.zeros(2, 4, 8, dtype=torch.bfloat16, device=device)
    b = torch.zeros(8, 4, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=r"a must be 2-D; got shape \(2, 4, 8\)"):
        det_gemm_fwd(a, b)


@pytest.mark.parametrize("op,shapes,message", [
    ("fwd", ((4, 8), (9, 4)), r"a.shape\[1\]=8 != b.shape\[0\]=9"),
    ("da", ((4, 5), (8, 6)), r"dc.shape\[1\]=5 != b.shape\[1\]=6"),
    ("db", ((4, 8), (5, 6)), r"a.shape\[0\]=4 != dc.shape\[0\]=5"),
])
def test_rejects_mismatched_inner_dims(op, shapes, message, device):
    x = torch.zeros(shapes[0], dtype=torch.bfloat16, device=device)
    y = torch.zeros(shapes[1], dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=message):
        OPS[op](x, y)


def test_rejects_empty_dims(device):
    a = torch.zeros(0, 8, dtype=torch.bfloat16, device=device)
    b = torch.zeros(8, 4, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=r"a has an empty dimension \(shape \(0, 8\)\)"):
        det_gemm_fwd(a, b)


def test_rejects_mixed_devices(device):
    a = torch.zeros(4, 8, dtype=torch.bfloat16, device=device)
    b = torch.zeros(8, 4, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        det_gemm_fwd(a, b)


def test_rejects_32bit_offset_overflow():
    huge = torch.empty((2**16, 2**16), dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=r"spans element offset 4294967295; supported: offsets below 2\*\*31"):
        check_bf16_matrix("a", huge)


def test_rejects_bad_segment_and_out_dtype(device):
    a, b = bf16_randn((4, 64), 1, device), bf16_randn((64, 8), 2, device)
    config = GemmConfig(16, 64, 64, 1, 4, 4)
    with pytest.raises(ValueError, match="seg_len 48 is not a multiple of the config's BLOCK_K 64"):
        det_gemm_fwd_launch(a, b, config=config, seg_len=48)
    with pytest.raises(TypeError, match="out_dtype torch.float16 is not supported"):
        det_gemm_fwd_launch(a, b, out_dtype=torch.float16)


def test_rejects_bad_config():
    with pytest.raises(ValueError, match="block_k must be a multiple of 16"):
        GemmConfig(16, 64, 24, 1, 4, 4)
    with pytest.raises(ValueError, match=r"op 'dx' is not supported"):
        select_config("dx", 1)


def test_cpu_tensors_without_interpreter_fail_closed(tmp_path):
    code = ("import torch\nfrom detkit.kernels.det_gemm.launch import det_gemm_fwd\n"
            "a = torch.zeros(4, 8, dtype=torch.bfloat16)\n"
            "det_gemm_fwd(a, torch.zeros(8, 4, dtype=torch.bfloat16))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0
    assert "NotImplementedError: CPU tensors are supported only under the Triton interpreter" in proc.stderr


@pytest.mark.gpu
def test_gpu_backend_is_cuda_sm90():
    a = bf16_randn((16, 64), 1, "cuda")
    _, launch = det_gemm_fwd_launch(a, bf16_randn((64, 32), 2, "cuda"))
    assert launch.backend == "cuda_sm90"


@pytest.mark.parametrize("variant", ["ptr", "tma"])
@pytest.mark.parametrize("op", ["fwd", "da", "db"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_twin_out_holds_the_same_bits_and_changes_nothing(variant, op, out_dtype, device):
    # The TP/CP operators reduce the twin in place and return the output as the untouched partial.
    x, y = _operands(op, 9, 40, 56, "linear" if op != "db" else "kn", device)
    config = GemmConfig(16, 32, 32, 1, 4, 2, variant=variant)
    plain, _ = LAUNCHERS[op](x, y, config=config, out_dtype=out_dtype)
    twin = torch.full_like(plain, float("nan"))
    out, _ = LAUNCHERS[op](x, y, config=config, out_dtype=out_dtype, twin_out=twin)
    assert compare_bits(out, plain).equal and compare_bits(twin, plain).equal
    assert out.data_ptr() != twin.data_ptr()


def test_rejects_a_bad_twin_before_any_work(device):
    a, b = bf16_randn((4, 64), 1, device), bf16_randn((64, 8), 2, device)
    bad = {
        "shape": torch.empty((4, 9), dtype=torch.bfloat16, device=device),
        "dtype": torch.empty((4, 8), dtype=torch.float32, device=device),
        "strides": torch.empty((8, 4), dtype=torch.bfloat16, device=device).t(),
    }
    for what, twin in bad.items():
        with pytest.raises(ValueError, match=r"twin_out must be a contiguous torch.bfloat16 tensor of shape \(4, 8\)"):
            det_gemm_fwd_launch(a, b, twin_out=twin)
    with pytest.raises(TypeError, match="twin_out must be a torch.Tensor or None; got list"):
        det_gemm_fwd_launch(a, b, twin_out=[])


# ---- fail closed: what a new user may pass ------------------------------------------------------------
def test_rejects_a_config_of_the_wrong_type(device):
    a, b = bf16_randn((4, 64), 1, device), bf16_randn((64, 8), 2, device)
    with pytest.raises(TypeError, match=r"config must be a GemmConfig or None \(the table's pick\); got str 'fast'"):
        det_gemm_fwd_launch(a, b, config="fast")
    with pytest.raises(TypeError, match=r"config must be a GemmConfig or None .*; got dict \{'block_m': 64\}"):
        LAUNCHERS["db"](a.t().contiguous().t(), bf16_randn((4, 8), 3, device), config={"block_m": 64})


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize("which", [0, 1])
def test_rejects_sparse_layouts_by_name(layout, which, device):
    dense = [torch.zeros(4, 8, dtype=torch.bfloat16, device=device),
             torch.zeros(8, 4, dtype=torch.bfloat16, device=device)]
    dense[which] = dense[which].to_sparse() if layout == "coo" else dense[which].to_sparse_csr()
    name, kind = ("a", "b")[which], {"coo": "torch.sparse_coo", "csr": "torch.sparse_csr"}[layout]
    for call in (lambda: det_gemm_fwd(*dense), lambda: det_gemm_fwd_launch(*dense)):
        with pytest.raises(TypeError, match=rf"{name} has layout {kind}; supported: torch.strided \(dense tensors\)"):
            call()


@pytest.mark.parametrize("op", ["fwd", "da", "db"])
def test_rejects_a_view_past_the_end_of_its_storage(op, device):
    # As torch.matmul refuses a tensor whose storage was freed, a view reaching past its storage is refused before
    # any work, on every call (the plan of the signature is cached after the first call; the storage is not).
    x, y = _operands(op, 9, 40, 56, "linear", device)
    want = LAUNCHERS[op](x, y)[0]
    name = {"fwd": "a", "da": "dc", "db": "a"}[op]
    x.untyped_storage().resize_(0)
    shape = rf"\(shape \({x.shape[0]}, {x.shape[1]}\), strides \({x.stride(0)}, 1\), storage offset 0\)"
    with pytest.raises(ValueError, match=rf"{name} {shape} reaches byte {2 * x.numel()} of a storage that holds 0 "
                                         r"bytes; supported: views inside their storage"):
        LAUNCHERS[op](x, y)
    x.untyped_storage().resize_(2 * x.numel() - 2)  # one element short
    with pytest.raises(ValueError, match=rf"reaches byte {2 * x.numel()} of a storage that holds {2 * x.numel() - 2} "):
        OPS[op](x, y)
    x.untyped_storage().resize_(2 * x.numel())
    x.zero_()
    assert want.shape == LAUNCHERS[op](x, y)[0].shape  # whole again: accepted


def test_rejects_a_twin_past_the_end_of_its_storage(device):
    a, b = bf16_randn((4, 64), 1, device), bf16_randn((64, 8), 2, device)
    twin = torch.empty((4, 8), dtype=torch.bfloat16, device=device)
    det_gemm_fwd_launch(a, b, twin_out=twin)
    twin.untyped_storage().resize_(32)
    with pytest.raises(ValueError, match=r"twin_out \(shape \(4, 8\), .* reaches byte 64 of a storage that holds 32"):
        det_gemm_fwd_launch(a, b, twin_out=twin)


def test_rejects_dims_of_2_30_and_more_before_anything_else():
    # Element offsets are 64-bit, tile indices and TMA coordinates 32-bit: a dim of 2**30 is refused by name.
    a = torch.empty((2**30, 8), dtype=torch.bfloat16, device="meta")
    b = torch.empty((8, 16), dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=r"a has shape \(1073741824, 8\); supported: every dim below 2\*\*30"):
        det_gemm_fwd(a, b)


def test_operand_check_has_no_32bit_offset_limit():
    # An lm_head's logits at M 16384 (16384 x 151936 = 2.49e9 elements) are an operand of dA and dB: accepted (the
    # kernels compute 64-bit offsets); the same tensor is refused by the 32-bit check other kernels use.
    import detkit.kernels.det_gemm.launch as dg

    dc = dg._Operand("dc", torch.Tensor, (16384, 151936), (151936, 1), torch.bfloat16, torch.strided,
                     torch.device("cuda"), 0)
    assert dg._check_operand(dc) == 16384 * 151936
    with pytest.raises(ValueError, match=r"spans element offset 2489319423; supported: offsets below 2\*\*31"):
        check_bf16_matrix("dc", torch.empty((16384, 151936), dtype=torch.bfloat16, device="meta"))


# ---- the host path: one plan per call signature -----------------------------------------------------------
def test_a_plan_is_built_once_per_signature_and_reused(device, fresh_plans):
    import detkit.kernels.det_gemm.launch as dg

    a, b = bf16_randn((9, 64), 1, device), weight_kn(64, 40, 2, "linear", device)
    first = det_gemm_fwd_launch(a, b)
    info = dg.launch_plans_info()
    assert (info.misses, info.hits) == (1, 0)
    second = det_gemm_fwd_launch(a.clone(), b)  # new storage, same signature: the same plan
    assert compare_bits(det_gemm_fwd(a, b), first[0]).equal  # the plain call shares the plan too
    info = dg.launch_plans_info()
    assert (info.misses, info.hits) == (1, 2) and second[1] is first[1]
    assert compare_bits(second[0], first[0]).equal


def test_the_plan_key_holds_the_base_alignment(device, fresh_plans):
    # Same shape and strides, base 2 bytes past a 16-byte boundary: TMA cannot address it, so another plan
    # (the pointer kernel with the same tile) and the same bits.
    base = bf16_randn((600 * 64 + 8,), 1, device)
    aligned, shifted = base[:600 * 64].view(600, 64), base[1:600 * 64 + 1].view(600, 64)
    b = weight_kn(64, 40, 2, "linear", device)
    got, launch = det_gemm_fwd_launch(aligned, b)
    got_shifted, launch_shifted = det_gemm_fwd_launch(shifted, b)
    assert launch.config.variant == "tma" and launch_shifted.config == replace(launch.config, variant="ptr")
    assert compare_bits(got_shifted, det_gemm_fwd_launch(shifted.clone(), b)[0]).equal
    assert compare_bits(got, det_gemm_fwd_launch(aligned.clone(), b, config=launch_shifted.config)[0]).equal


def test_the_plan_cache_is_bounded(device, fresh_plans):
    import detkit.kernels.det_gemm.launch as dg

    b = torch.zeros((8, 16), dtype=torch.bfloat16, device=device)
    for m in range(1, dg.MAX_PLANS + 11):  # plans only: no launch
        dg._lookup("fwd", torch.zeros((m, 8), dtype=torch.bfloat16, device=device), b, None, None, torch.bfloat16,
                   None)
    info = dg.launch_plans_info()
    assert info.maxsize == dg.MAX_PLANS and info.currsize == dg.MAX_PLANS and info.misses == dg.MAX_PLANS + 10


_ADDPTR_SCRIPT = """
import json, re, sys, tempfile, glob
from dataclasses import replace
from tools.gemm_sass import CASES, build
from detkit.kernels.det_gemm.launch import GemmConfig
out = {}
for cfg in (GemmConfig(16, 64, 128, 1, 4, 6), GemmConfig(64, 64, 128, 1, 4, 6, "tma"),
            GemmConfig(64, 192, 64, 8, 4, 6, "tma3"), GemmConfig(128, 256, 64, 8, 8, 3, "ws")):
    for case in (CASES[0], CASES[1], CASES[4]):
        d = tempfile.mkdtemp()
        build(replace(case, cols=6140), cfg.variant, d, config=cfg)  # 6140: the ws epilogue from registers
        ttgir = open(glob.glob(d + "/*.ttgir")[0]).read()
        # each tt.addptr's offset element type: "..., tensor<16x128xi64, #blocked> loc(...)" or "..., i64 loc(...)"
        out[f"{case.name} {cfg.label()}"] = [re.search(r", (?:tensor<[0-9x]+)?(i\\d+)(?:, #\\w+>)? loc", line).group(1)
                                             for line in ttgir.splitlines() if "tt.addptr" in line]
print(json.dumps(out))
"""


def test_every_variant_computes_64bit_element_offsets(tmp_path):
    # An lm_head's dA/dB operand or logits (16384 x 151936) hold more than 2**31 - 1 elements: every pointer the
    # kernels form (operand loads of the pointer kernel, the stores of the Triton kernels, the ws register
    # epilogue) adds a 64-bit offset. Checked on the sm_90 compiles' TTGIR (no GPU needed).
    from tests.moe_helpers import compile_sm90_offline

    offsets = compile_sm90_offline(_ADDPTR_SCRIPT, tmp_path)
    assert len(offsets) == 12
    for case, types in offsets.items():
        assert types and set(types) == {"i64"}, (case, types)


@pytest.mark.parametrize("config", [GemmConfig(16, 32, 128, 1, 4, 6), GemmConfig(64, 64, 128, 1, 4, 6, "tma"),
                                    GemmConfig(64, 192, 64, 8, 4, 6, "tma3"), GemmConfig(128, 256, 64, 8, 8, 3, "ws")],
                         ids=lambda c: c.label())
@pytest.mark.parametrize("op", ["fwd", "da", "db"])
def test_a_cuda_plan_passes_every_kernel_parameter_to_its_launches(op, config, monkeypatch, fresh_plans):
    # The sm_90 launch path, its launcher recorded instead of run (CPU tensors): the first call hands Triton real
    # descriptors, later ones HostDescriptors of the same shapes and strides; every parameter has its value.
    import detkit.kernels.det_gemm.launch as dg
    from detkit.kernels.backend import HostDescriptor

    calls = []

    class Recorder:
        def __init__(self, kernel, grid, options, device, dynamic):
            self.kernel, self.grid, self.options, self.ready = kernel, grid, options, False
            self.dynamic = [kernel.arg_names[i] for i in dynamic]

        def __call__(self, args):
            calls.append((self.kernel, self.grid, self.options, self.ready, dict(zip(self.kernel.arg_names, args))))
            tensors = [n for n, a in zip(self.kernel.arg_names, args) if isinstance(a, torch.Tensor) or hasattr(a, "base")]
            assert sorted(self.dynamic) == sorted(tensors)  # every per-call tensor or descriptor is a dynamic slot
            self.ready = True

    monkeypatch.setattr(dg, "DirectLaunch", Recorder)
    monkeypatch.setattr(dg, "resolve_backend_of_devices", lambda fn, devices: "cuda_sm90")
    monkeypatch.setattr(dg, "ensure_thread_cuda_context", lambda device: None)
    x, y = _operands(op, 300, 264, 200, "linear", "cpu")
    a_view, b_view = {"fwd": (x, y), "da": (x, y.t()), "db": (x.t(), y)}[op]
    twin = torch.empty((a_view.shape[0], b_view.shape[1]), dtype=torch.float32)
    out, launch = LAUNCHERS[op](x, y, config=config, out_dtype=torch.float32, twin_out=twin)
    LAUNCHERS[op](x, y, config=config, out_dtype=torch.float32, twin_out=twin)
    assert launch.backend == "cuda_sm90" and launch.config == config and len(calls) == 2
    (kernel, grid, options, ready1, first), (kernel2, grid2, _, ready2, second) = calls
    rows, reduced, cols = a_view.shape[0], a_view.shape[1], b_view.shape[1]
    tiles = -(-rows // config.block_m) * -(-cols // config.block_n)
    assert not ready1 and ready2 and kernel is kernel2 and grid == grid2
    assert grid == ((min(tiles, dg.device_sms(x.device)),) if config.variant == "ws" else (tiles,))
    assert None not in first.values() and list(first) == list(kernel.arg_names)
    assert (first["R"], first["C"], first["L"], first["op_id"]) == (rows, cols, reduced, ("fwd", "da", "db").index(op))
    assert (first["stride_cr"], first["stride_cc"], first["OUT_FP32"], first["TWIN"]) == (cols, 1, True, True)
    assert first["twin_ptr"] is twin and first["c_ptr"].shape == (rows, cols)
    assert (first["BLOCK_M"], first["BLOCK_N"], first["BLOCK_K"], first["GROUP_M"]) == (
        config.block_m, config.block_n, config.block_k, config.group_m)
    if config.variant == "ptr":
        assert options == {"num_warps": config.num_warps, "num_stages": config.num_stages}
        assert first["a_ptr"].data_ptr() == a_view.data_ptr() and first["b_ptr"].data_ptr() == b_view.data_ptr()
        assert (first["stride_ar"], first["stride_al"], first["stride_bl"], first["stride_bc"]) == (*a_view.stride(),
                                                                                                      *b_view.stride())
        assert first["B_K_MAJOR"] == (b_view.stride(0) == 1) and first["seg_len"] == reduced
        return
    assert first["A_M_MAJOR"] == (a_view.stride(0) == 1) and first["B_K_MAJOR"] == (b_view.stride(0) == 1)
    for name, base in (("a_desc", x), ("b_desc", y)):
        real, host = first[name], second[name]
        assert not isinstance(real, HostDescriptor) and isinstance(host, HostDescriptor)
        assert real.base is base and host.base is base and host.padding == "zero"
        assert (list(host.shape), list(host.strides)) == (list(real.shape), list(real.strides))
        assert real.strides[-1] == 1 and real.shape[-1] == (base.shape[1] if base.stride(1) == 1 else base.shape[0])
    if config.variant == "ws":
        assert options["num_warps"] == 4 and first["STAGES"] == config.num_stages and first["CONSUMERS"] == 2
        assert first["TMA_STORE"] is False  # an FP32 128x256 tile buffer does not fit beside the ring
    else:
        assert options == {"num_warps": config.num_warps, "num_stages": config.num_stages}
        assert first["STEP_K"] == config.block_k and first["INTERPRETED"] is False and first["seg_len"] == reduced


# ---- on the GPU: direct launches, and 64-bit offsets at an lm_head ------------------------------------------------
DIRECT_CONFIGS = (GemmConfig(16, 32, 128, 1, 4, 6), GemmConfig(64, 64, 128, 1, 4, 6, "tma"),
                  GemmConfig(64, 192, 64, 8, 4, 6, "tma3"), GemmConfig(128, 256, 64, 8, 8, 3, "ws"))


def _other_values(t: torch.Tensor) -> torch.Tensor:
    """Another tensor of ``t``'s signature (shape, strides, alignment): new values, same plan."""
    out = t.clone()
    out.copy_(torch.randn(t.shape, dtype=torch.float32, device=t.device))
    assert out.stride() == t.stride()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("config", DIRECT_CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize("op", ["fwd", "da", "db"])
def test_gpu_direct_launches_give_the_bits_of_tritons_own_launch(op, config, fresh_plans):
    # A plan's first call is Triton's kernel[grid](...); its later calls go straight to the compiled kernel's
    # launcher. A later call on new operands gives the bits a first call gives on them (BF16 out; for fwd also FP32
    # out with a twin: for ws the register epilogue).
    x1, y1 = _operands(op, 300, 264, 200, "linear", "cuda")
    x2, y2 = _other_values(x1), _other_values(y1)
    modes = ((torch.bfloat16, False), (torch.float32, True)) if op == "fwd" else ((torch.bfloat16, False),)
    for out_dtype, with_twin in modes:
        def call(x, y):
            rows, cols = {"fwd": (300, 264), "da": (300, 200), "db": (200, 264)}[op]
            twin = torch.full((rows, cols), float("nan"), dtype=out_dtype, device="cuda") if with_twin else None
            out, launch = LAUNCHERS[op](x, y, config=config, out_dtype=out_dtype, twin_out=twin)
            assert launch.config == config
            return out, twin

        fresh_plans()
        call(x1, y1)  # Triton's launch: compiles, and the plan keeps the compiled kernel
        got, got_twin = call(x2, y2)  # direct
        fresh_plans()
        want, want_twin = call(x2, y2)  # Triton's launch again
        assert compare_bits(got, want).equal
        if with_twin:
            assert compare_bits(got_twin, want).equal and compare_bits(want_twin, want).equal


@pytest.mark.gpu
def test_gpu_direct_launch_is_captured_by_cuda_graphs_and_names_itself_to_launch_hooks(fresh_plans):
    from triton import knobs

    from detkit.kernels.det_gemm.launch import case_name

    a, w = bf16_randn((256, 512), 1, "cuda"), weight_kn(512, 1024, 2, "linear", "cuda")
    det_gemm_fwd(a, w)  # the plan and its compiled kernel
    names = []

    def hook(metadata):
        names.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        det_gemm_fwd(a, w)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert names == [case_name("fwd", 256, 1024, 512)]
    # Captured on the capturing stream: replays recompute from the static input's new values.
    static = a.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        det_gemm_fwd(static, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = det_gemm_fwd(static, w)
    static.copy_(_other_values(a))
    graph.replay()
    torch.cuda.synchronize()
    assert compare_bits(out, det_gemm_fwd(static, w)).equal


@pytest.mark.gpu
def test_gpu_tma_launch_from_a_new_thread(fresh_plans):
    # A thread that has made no CUDA call yet (as autograd's backward worker): the TMA descriptors are encoded
    # with the device's context made current first.
    import threading

    a, w = bf16_randn((600, 64), 1, "cuda"), weight_kn(64, 40, 2, "linear", "cuda")
    want, launch = det_gemm_fwd_launch(a, w)
    assert launch.config.variant == "tma"
    got = {}
    thread = threading.Thread(target=lambda: got.update(out=det_gemm_fwd(a, w)))
    thread.start()
    thread.join()
    assert compare_bits(got["out"], want).equal


LM_HEAD = (16384, 151936, 4096)  # M, N (Qwen3's vocabulary), K: the logits hold 2.49e9 elements, above 2**31 - 1


def _lm_head_configs(op: str) -> list:
    from detkit.kernels.det_gemm.launch import ws_twin

    pick = select_config(op, LM_HEAD[0])
    return [None, ws_twin(pick), replace(pick, variant="ptr")]


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fwd", "da"])
def test_gpu_lm_head_beyond_2_31_elements_matches_small_batches_on_every_variant(op, fresh_plans):
    # fwd writes, dA reads, a [16384, 151936] tensor: its last rows lie beyond 32-bit element offsets. Their bits
    # equal those of a call on just those rows (batch invariance), on the ws (TMA store), TMA and pointer kernels.
    from detkit.toolkit.fixtures import GemmCase, operands

    m, n, k = LM_HEAD
    x, y = operands(GemmCase(op, m, n, k, "linear", 3), torch.device("cuda"))
    rows = 256
    head, tail = LAUNCHERS[op](x[:rows], y)[0], LAUNCHERS[op](x[-rows:], y)[0]
    for config in _lm_head_configs(op):
        out, launch = LAUNCHERS[op](x, y, config=config)
        assert config is None or launch.config == config
        assert compare_bits(out[:rows], head).equal and compare_bits(out[-rows:], tail).equal, launch.config
        del out
    if op == "fwd":  # the ws register epilogue (its FP32 tile buffer does not fit beside the ring)
        out32 = LAUNCHERS[op](x, y, out_dtype=torch.float32)[0]
        tail32 = LAUNCHERS[op](x[-rows:], y, out_dtype=torch.float32)[0]
        assert compare_bits(out32[-rows:], tail32).equal


@pytest.mark.gpu
def test_gpu_db_reads_an_lm_head_gradient_beyond_2_31_elements(fresh_plans):
    # dB's dc [16384, 151936]: every output column sums rows beyond 32-bit offsets; the last columns are within the
    # contract bound of the FP64 oracle on every variant, and the variants agree bit for bit.
    from detkit.toolkit.fixtures import GemmCase, operands
    from detkit.bench.gemm import validate

    m, n, k = LM_HEAD
    a, dc = operands(GemmCase("db", m, n, k, "kn", 3), torch.device("cuda"))
    first = None
    for config in _lm_head_configs("db"):
        out, launch = LAUNCHERS["db"](a, dc, config=config)
        passed, worst = validate("db", a, dc[:, -2048:], out[:, -2048:])
        assert passed, (launch.config, worst)
        if first is None:
            first = out
        else:
            assert compare_bits(out, first).equal, launch.config
