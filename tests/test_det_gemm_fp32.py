"""det_gemm on FP32 operands: fwd / dA / dB within the FP32 contract bound against an FP64 oracle ("ieee" and "tf32"
products), batch invariance and determinism, every FP32 config giving the same bits, the interpreter's defined
order (FP32 products added one at a time in ascending k), the precision in the plan key and the launch's name, and
the refusals. FP16 operands: the BF16 path's math with one FP16 rounding (the bound with FP16's unit, the rounding
nearest-even of the FP32 result, batch invariance). The BF16 path is tests/test_det_gemm.py's. CPU tensors run under
the Triton interpreter (conftest); the `gpu` tests run with DETKIT_TEST_DEVICE=cuda on an sm_90 GPU."""

from __future__ import annotations

import pytest
import torch

from detkit.kernels.backend import CUDA_SM90, TRITON_INTERPRETER
from detkit.kernels.det_gemm.configs import (
    CONFIG_TABLE_FP32, GEMV_NARROW_COLS, GEMV_VARIANTS, all_configs, gemv_band, gemv_candidates,
    select_config, ws_twin,
)
from detkit.kernels.det_gemm.launch import (
    TF32_DA_TRANSPOSED_MIN_ROWS, TF32_DB_TRANSPOSED_MIN_ROWS, GemmConfig, clear_launch_plans, det_gemm_da,
    det_gemm_da_launch, det_gemm_db, det_gemm_db_launch, det_gemm_fwd, det_gemm_fwd_launch, launch_plans_info,
)
from detkit.toolkit.contract import ETA_FP16, U_FP16, check_bound, compare_bits, gemm_bound, gemm_bound_fp32

OPS = {"fwd": det_gemm_fwd, "da": det_gemm_da, "db": det_gemm_db}
LAUNCHERS = {"fwd": det_gemm_fwd_launch, "da": det_gemm_da_launch, "db": det_gemm_db_launch}


def f32_randn(shape, seed, device, scale=1.0) -> torch.Tensor:
    """Seeded FP32 normals drawn on the CPU (the same bits on every device), full 24-bit significands."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(device)


def operands(op, m, n, k, device, layout="linear"):
    """(x, y) of ``op`` at (M, N, K); the weight [K, N] as nn.Linear's ``weight.t()`` or contiguous."""
    w = f32_randn((n, k), 7, device, k**-0.5).t() if layout == "linear" else f32_randn((k, n), 7, device, k**-0.5)
    if op == "fwd":
        return f32_randn((m, k), 1, device), w
    if op == "da":
        return f32_randn((m, n), 2, device), w
    return f32_randn((m, k), 1, device), f32_randn((m, n), 2, device)


def oracle(op, x, y):
    """(c*, |A| @ |B|) in FP64 for ``op``."""
    x64, y64 = x.double().cpu(), y.double().cpu()
    if op == "fwd":
        return x64 @ y64, x64.abs() @ y64.abs()
    if op == "da":
        return x64 @ y64.t(), x64.abs() @ y64.abs().t()
    return x64.t() @ y64, x64.abs().t() @ y64.abs()


def assert_bits(got, want, what):
    result = compare_bits(got, want)
    assert result.equal, f"{what}: {result}"


@pytest.fixture
def fresh_plans():
    clear_launch_plans()
    yield
    clear_launch_plans()


# ---- the contract ----------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["fwd", "da", "db"])
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_within_the_fp32_contract_bound(op, m, precision, device):
    n, k = 40, 56
    x, y = operands(op, m, n, k, device)
    c = OPS[op](x, y, precision)
    c_star, abs_ab = oracle(op, x, y)
    reduced = {"fwd": k, "da": n, "db": m}[op]
    result = check_bound(c.cpu(), c_star, gemm_bound_fp32(c_star, abs_ab, reduced, precision))
    assert result.passed, result
    assert c.dtype == torch.float32 and c.shape == c_star.shape


def test_the_fp32_bound_fails_a_bf16_rounded_or_tf32_result(device):
    """The bound can fail: "ieee" must be tighter than TF32 operands or a BF16-rounded output (the errors a wrong
    precision or a stray rounding would make)."""
    x, y = operands("fwd", 16, 48, 256, device)
    c_star, abs_ab = oracle("fwd", x, y)
    bound = gemm_bound_fp32(c_star, abs_ab, 256, "ieee")
    as_bf16 = det_gemm_fwd(x, y).bfloat16().float()
    assert not check_bound(as_bf16.cpu(), c_star, bound).passed
    tf32 = det_gemm_fwd(x, y, "tf32")
    assert not check_bound(tf32.cpu(), c_star, bound).passed
    assert check_bound(tf32.cpu(), c_star, gemm_bound_fp32(c_star, abs_ab, 256, "tf32")).passed


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_interpreter_adds_fp32_products_one_at_a_time_in_ascending_k(precision, device):
    """The interpreter's defined semantics: each product rounded to FP32 (TF32 operands first: low 13 significand
    bits rounded off, ties away from zero), added to the FP32 accumulator in ascending k. A sequential torch loop
    computes exactly that."""
    if device.type != "cpu":
        pytest.skip("the interpreter's order (CPU runs); the GPU's is Triton's dot")
    x, y = operands("fwd", 5, 24, 80, device)
    c = det_gemm_fwd(x, y, precision)

    def tf32(t):  # sign-magnitude: adding half a TF32 ulp to the bits rounds the magnitude, ties away from zero
        return ((t.contiguous().view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)

    a, b = (tf32(x), tf32(y)) if precision == "tf32" else (x, y)
    want = torch.zeros(5, 24)
    for kk in range(80):
        want = want + a[:, kk:kk + 1] * b[kk:kk + 1, :]
    assert_bits(c, want, f"ascending FP32 sum ({precision})")


# ---- batch invariance and determinism -------------------------------------------------------
@pytest.mark.parametrize("op", ["fwd", "da"])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_a_row_keeps_its_bits_whatever_the_batch_and_padding(op, precision, device):
    n, k = 48, 72
    x, y = operands(op, 33, n, k, device)
    full = OPS[op](x, y, precision)
    for m in (1, 7, 33):
        assert_bits(OPS[op](x[:m], y, precision), full[:m], f"{op} M={m}")
    padded = torch.cat([x[3:4], torch.zeros(40, x.shape[1], device=device)])
    assert_bits(OPS[op](padded, y, precision)[:1], full[3:4], f"{op} row 3 with 40 zero rows")
    assert_bits(OPS[op](x[5:6], y, precision), full[5:6], f"{op} row 5 alone")


def test_db_zero_rows_add_exact_zeros_and_repeats_are_bitwise(device):
    x, dc = operands("db", 9, 24, 40, device)
    want = det_gemm_db(x, dc)
    padded = det_gemm_db(torch.cat([x, torch.zeros(7, 40, device=device)]),
                         torch.cat([dc, torch.zeros(7, 24, device=device)]))
    assert_bits(padded, want, "dB with zero rows appended")
    for op in OPS:
        x, y = operands(op, 7, 24, 40, device)
        assert_bits(OPS[op](x, y), OPS[op](x, y), f"{op} repeat")


@pytest.mark.parametrize("op", ["fwd", "da", "db"])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_every_config_of_the_fp32_table_gives_the_same_bits(op, precision, device):
    """Every config the FP32 (or TF32) table can pick (and a TMA tile) reduces in the same ascending K order with one
    accumulator: the same bits (on the GPU too: the gpu test below). The small-M kernel's configs run the rows of
    their band (BLOCK_M rows: one program row, as the table uses them; more rows cost the interpreter time only)."""
    x, y = operands(op, 20, 40, 72, device, layout="kn")
    want, _ = LAUNCHERS[op](x, y, precision=precision)
    backend = CUDA_SM90 if device.type == "cuda" else TRITON_INTERPRETER  # off sm_90 an "fma" pick runs its twin
    configs = all_configs(op, backend, dtype=torch.float32, precision=precision)
    for config in configs + [GemmConfig(64, 32, 32, 1, 4, 3, "tma")]:
        rows = config.block_m if config.variant in GEMV_VARIANTS else len(x)
        got, record = LAUNCHERS[op](x[:rows], y[:rows] if op == "db" else y, config=config, precision=precision)
        assert record.config == config
        assert_bits(got, want[:rows] if op != "db" else want, f"{op} {config.label()}")


@pytest.mark.parametrize("layout", ["linear", "kn"])
def test_tf32_backward_as_forward_products_has_the_direct_kernels_bits(layout, device):
    """"tf32" dA at M >= TF32_DA_TRANSPOSED_MIN_ROWS and dB at M >= TF32_DB_TRANSPOSED_MIN_ROWS run as forward
    products (the strided operand as the MMA's A): each gives the direct kernel's bits (the launchers keep it),
    contiguous, in the op's shape; a row of dA at M 3 (direct) keeps its bits at M 1030 (forward product): batch
    invariance across the switch. The reduced dims (N 40, M 1030) end in partial K steps."""
    m = TF32_DA_TRANSPOSED_MIN_ROWS + 6
    dc, w = operands("da", m, 40, 24, device, layout)
    got = det_gemm_da(dc, w, "tf32")
    want, _ = det_gemm_da_launch(dc, w, precision="tf32")
    assert got.shape == want.shape == (m, 24) and got.is_contiguous()
    assert_bits(got, want, f"dA {layout} M={m}")
    assert_bits(det_gemm_da(dc[:3], w, "tf32"), got[:3], f"dA {layout} M=3 against M={m}")
    for rows in (5, TF32_DB_TRANSPOSED_MIN_ROWS + 3):  # direct, then a forward product
        a, dc = operands("db", rows, 40, 24, device)
        got = det_gemm_db(a, dc, "tf32")
        want, _ = det_gemm_db_launch(a, dc, precision="tf32")
        assert got.shape == want.shape == (24, 40) and got.is_contiguous()
        assert_bits(got, want, f"dB M={rows}")
    with pytest.raises(ValueError, match="empty dimension"):  # refused by the direct kernel, naming its operand
        det_gemm_db(a[:0], dc[:0], "tf32")


# ---- the small-M kernel (kernels/det_gemm/gemv.py): the tile path's bits --------------------------------------
@pytest.mark.parametrize("op", ["fwd", "da"])
@pytest.mark.parametrize("layout", ["linear", "kn"])
def test_small_m_rows_have_the_tile_paths_bits(op, layout, device):
    """The table's M <= 16 picks (one block_m per band) give each row the bits the tile path gives
    it at M = 24: batch invariance across the table's switch, on both weight layouts. The reduced dim (K for fwd, N for
    dA) is 72 or 40: a partial last step of BLOCK_K 64, so its masked k's are exercised."""
    x, y = operands(op, 24, 40, 72, device, layout)
    full, record = LAUNCHERS[op](x, y)
    assert record.config.variant in ("ptr", "fma"), record.config  # a tile kernel at M = 24 (fwd: "fma" on sm_90)
    for m in (1, 2, 3, 7, 16):
        got, record = LAUNCHERS[op](x[:m], y)
        assert record.config.block_m == gemv_band(m), record.config
        assert_bits(got, full[:m], f"{op} {layout} M={m} {record.config.label()}")


@pytest.mark.parametrize("layout", ["linear", "kn"])
@pytest.mark.parametrize("cols", [4096, 151936], ids=["narrow", "wide"])
def test_every_small_m_candidate_has_the_tile_paths_bits(layout, cols, device):
    """Each variant ("gemv_row", "gemv_vec", "gemv_tile") and every other candidate a GPU run times, for both width
    classes' tiles (here on a 40-wide output: partial column blocks), gives the tile path's bits at M = 5 (a block of
    8 rows, 3 masked)."""
    x, y = operands("fwd", 24, 40, 72, device, layout)
    full, _ = det_gemm_fwd_launch(x, y)
    candidates = gemv_candidates(5, cols)
    assert {c.variant for c in candidates} == {*GEMV_VARIANTS, "ptr"}
    for config in candidates:
        got, record = det_gemm_fwd_launch(x[:5], y, config=config)
        assert record.config == config
        assert_bits(got, full[:5], f"{layout} {config.label()}")


def test_small_m_kernel_segments_and_twin_as_the_tile_path(device):
    """With seg_len (FP32 segments of the reduction, added in order) and a twin output, the small-M kernel gives the
    tile path's bits; the segmented result differs from the unsegmented one here, so a kernel that ignored the
    segments would fail."""
    x, y = operands("fwd", 24, 40, 128, device)
    want, _ = det_gemm_fwd_launch(x, y, seg_len=64)
    assert not compare_bits(want, det_gemm_fwd(x, y)).equal
    for config in (gemv_candidates(3, 4096)[0], gemv_candidates(3, 151936)[0]):  # "gemv_vec", "gemv_tile"
        twin = torch.empty(3, 40, device=device)
        got, _ = det_gemm_fwd_launch(x[:3], y, config=config, seg_len=64, twin_out=twin)
        assert_bits(got, want[:3], f"segmented {config.label()}")
        assert_bits(twin, got, f"twin {config.label()}")


def test_small_m_kernel_refuses_what_its_fma_chain_does_not_compute(device):
    x, y = operands("fwd", 4, 8, 16, device)
    gemv = GemmConfig(4, 32, 16, 1, 1, 1, "gemv_vec")
    with pytest.raises(ValueError, match=r"variant 'gemv_vec' \(explicit FP32 fused multiply-adds\) takes FP32 "
                                         r"operands with precision 'ieee' only; got torch.float32, precision 'tf32'"):
        det_gemm_fwd_launch(x, y, config=gemv, precision="tf32")
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(ValueError, match=rf"takes FP32 operands with precision 'ieee' only; got {dtype}: use a"):
            det_gemm_fwd_launch(x.to(dtype), y.to(dtype), config=gemv)
    with pytest.raises(ValueError, match=r"variant 'gemv_row' needs block_n a power of two \(a Triton block\); got 48"):
        GemmConfig(4, 48, 16, 1, 1, 1, "gemv_row")
    with pytest.raises(ValueError, match=r"seg_len 24 is not a multiple of the config's BLOCK_K 16"):
        det_gemm_fwd_launch(x, y, config=gemv, seg_len=24)
    for rows in (0, 17, 2.0):
        with pytest.raises(ValueError, match=rf"rows must be an int in 1..16 \(the small-M kernel's bands\); got"):
            gemv_band(rows)


@pytest.mark.parametrize("layout", ["linear", "kn"])
def test_a_cuda_plan_of_the_small_m_kernel_passes_its_parameters(layout, monkeypatch, fresh_plans):
    """The sm_90 launch path, its launcher recorded instead of run (CPU tensors): the small-M kernel gets the table's
    tile, the loads of its variant, B's layout, the even-L flag and the pipeline depth."""
    import detkit.kernels.det_gemm.launch as dg
    from detkit.kernels.det_gemm.gemv import det_gemm_gemv_kernel

    calls = []

    class Recorder:
        def __init__(self, kernel, grid, options, device, dynamic):
            self.kernel, self.grid, self.options = kernel, grid, options

        def __call__(self, args):
            calls.append((self.kernel, self.grid, self.options, dict(zip(self.kernel.arg_names, args))))

    monkeypatch.setattr(dg, "DirectLaunch", Recorder)
    monkeypatch.setattr(dg, "resolve_backend_of_devices", lambda fn, devices: "cuda_sm90")
    x, y = operands("fwd", 3, 40, 72, torch.device("cpu"), layout)
    _, launch = det_gemm_fwd_launch(x, y)
    ((kernel, grid, options, args),) = calls
    pick = select_config("fwd", 3, cols=40, dtype=torch.float32)
    assert kernel is det_gemm_gemv_kernel and launch.config == pick and launch.backend == "cuda_sm90"
    assert grid == (-(-40 // pick.block_n),) and options == {"num_warps": 1, "num_stages": 4}
    assert (args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"], args["NUM_STAGES"]) == (4, 16, 64, 4)
    assert (args["LOADS"], args["PRECISION"], args["INTERPRETED"], args["EVEN_L"]) == ("vec", "ieee", False, False)
    assert args["B_K_MAJOR"] == (layout == "linear") and (args["R"], args["C"], args["L"]) == (3, 40, 72)
    assert (args["stride_bl"], args["stride_bc"]) == y.stride() and args["b_ptr"] is y and args["a_ptr"] is x


# ---- the table, the plan key, names --------------------------------------------------------------
def test_fp32_table_is_pinned_covering_every_size_with_the_small_m_kernel_up_to_16_rows():
    """"ieee" at M <= 16 (fwd, dA): BLOCK_M the batch rounded up to a power of two, by output width, on the small-M
    kernel or the FMA dot's pointer tile; above, BLOCK_K 32 tiles: the Gluon FMA kernel's for fwd (64-row tiles up to
    64 rows, narrow outputs on 128x64 up to 256), the pointer kernel's for dA. dB (M is its reduced dim) keeps its tile
    at every M. TF32: TMA tiles for fwd above 64 rows and dA at 65-256."""
    for op, entries in CONFIG_TABLE_FP32.items():
        assert entries[-1][0] >= 2**31 - 1
        for config in all_configs(op, dtype=torch.float32):
            assert config.variant not in GEMV_VARIANTS or (op != "db" and config.block_m <= 16), config
            kernel = ("ptr", "fma") if op == "fwd" else ("ptr",)
            assert config.variant in GEMV_VARIANTS or (config.variant in kernel and config.block_k == 32), config
    for op in ("fwd", "da"):
        for m in range(1, 18):
            for cols in (256, 4096, GEMV_NARROW_COLS, GEMV_NARROW_COLS + 1, 151936):
                pick = select_config(op, m, cols=cols, dtype=torch.float32)
                if m > 16:
                    want = GemmConfig(64, 64, 32, 8, 4, 3)
                    if op == "fwd":
                        narrow = cols <= GEMV_NARROW_COLS  # 17 rows: the band up to 64
                        want = (GemmConfig(128, 64, 32, 8, 8, 4, "fma") if narrow
                                else GemmConfig(64, 128, 32, 8, 4, 3, "fma"))
                    assert pick == want, (op, m, cols)
                    continue
                assert pick.block_m == gemv_band(m) >= m > pick.block_m // 2, (m, pick)
                assert pick == gemv_candidates(m, cols, op)[0]
                # 1-4 rows of an lm_head's output on the small-M kernel's weight tiles (the H100 run's fastest)
                if op == "fwd" and m <= 4 and cols > GEMV_NARROW_COLS:
                    assert pick.variant == "gemv_tile" and pick.block_n == 128, (m, pick)
    assert select_config("db", 1, cols=151936, dtype=torch.float32) == GemmConfig(128, 128, 32, 8, 8, 3)
    assert select_config("fwd", 4096, cols=151936, dtype=torch.float32) == GemmConfig(128, 128, 32, 8, 4, 3, "fma")
    assert select_config("da", 4096, cols=151936, dtype=torch.float32) == GemmConfig(128, 128, 32, 8, 8, 3)
    # TF32: 64 rows or more at every M, one MMA instruction kind (wgmma) for every launch
    for op in CONFIG_TABLE_FP32:
        assert all(c.block_m >= 64 for c in all_configs(op, dtype=torch.float32, precision="tf32"))
    tf32_tiny = select_config("fwd", 1, cols=151936, dtype=torch.float32, precision="tf32")
    assert tf32_tiny == GemmConfig(64, 64, 32, 8, 4, 3)
    for op, m, want in (("fwd", 65, GemmConfig(128, 256, 32, 8, 8, 4, "tma")),
                        ("fwd", 4096, GemmConfig(128, 256, 32, 8, 8, 3, "tma")),
                        ("da", 128, GemmConfig(64, 64, 32, 8, 4, 4, "tma")),
                        ("da", 4096, GemmConfig(128, 128, 32, 8, 8, 3))):
        assert select_config(op, m, cols=151936, dtype=torch.float32, precision="tf32") == want, (op, m)
    assert select_config("fwd", 128, cols=151936, dtype=torch.float32) == GemmConfig(128, 128, 32, 8, 8, 3, "fma")
    assert select_config("fwd", 4096, cols=4096, dtype=torch.float16) == select_config("fwd", 4096, cols=4096)
    with pytest.raises(TypeError, match="no config table for torch.float64"):
        select_config("fwd", 1, dtype=torch.float64)


def test_the_precision_keys_the_plan_and_names_the_launch(device, fresh_plans):
    x, y = operands("fwd", 4, 24, 32, device)
    ieee, rec_ieee = det_gemm_fwd_launch(x, y)
    tf32, rec_tf32 = det_gemm_fwd_launch(x, y, precision="tf32")
    assert rec_ieee.name == "det_gemm_fwd [M=4, N=24, K=32] fp32 ieee"
    assert rec_tf32.name == "det_gemm_fwd [M=4, N=24, K=32] fp32 tf32"
    assert launch_plans_info().currsize == 2
    assert_bits(det_gemm_fwd(x, y, "ieee"), ieee, "explicit ieee = the default")
    assert_bits(det_gemm_fwd(x, y, "tf32"), tf32, "tf32 again")
    _, rec_bf16 = det_gemm_fwd_launch(x.bfloat16(), y.bfloat16())
    assert rec_bf16.name.endswith("] bf16")


# ---- refusals, one line each, before any work -------------------------------------------------
def test_refuses_other_dtypes_mixed_dtypes_and_bad_options_by_name(device):
    x, y = operands("fwd", 4, 8, 16, device)
    with pytest.raises(TypeError, match=r"a has dtype torch.float64; supported: torch.bfloat16, torch.float16, "
                                        r"torch.float32"):
        det_gemm_fwd(x.double(), y.double())
    with pytest.raises(TypeError, match=r"a has dtype torch.float32 and b torch.bfloat16; supported: both"):
        det_gemm_fwd(x, y.bfloat16())
    with pytest.raises(ValueError, match=r"precision 'tf16' is not supported; supported: None, 'ieee', 'tf32'"):
        det_gemm_fwd_launch(x, y, precision="tf16")
    with pytest.raises(ValueError, match=r"precision 'tf32' applies to FP32 operands"):
        det_gemm_fwd(x.bfloat16(), y.bfloat16(), "tf32")
    with pytest.raises(TypeError, match=r"out_dtype torch.bfloat16 with FP32 operands is not supported"):
        det_gemm_fwd_launch(x, y, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"variant 'ws' \(the Gluon kernel\) takes BF16 operands only"):
        det_gemm_fwd_launch(x, y, config=GemmConfig(128, 256, 64, 8, 8, 3, "ws"))
    with pytest.raises(ValueError, match=r"variant 'ws' \(the Gluon kernel\) takes BF16 operands only"):
        det_gemm_fwd_launch(x.half(), y.half(), config=GemmConfig(128, 256, 64, 8, 8, 3, "ws"))
    with pytest.raises(TypeError, match=r"out_dtype torch.bfloat16 is not supported with torch.float16 operands"):
        det_gemm_fwd_launch(x.half(), y.half(), out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"precision 'ieee' applies to FP32 operands; FP16 products are exact"):
        det_gemm_fwd(x.half(), y.half(), "ieee")


def test_refuses_an_fp32_view_past_the_end_of_its_storage(device):
    """The storage check counts 4-byte elements for FP32 operands."""
    x, y = operands("fwd", 4, 8, 16, device)
    base = torch.zeros(64, device=device)
    view = base.as_strided((4, 16), (16, 1))
    det_gemm_fwd(view, y)  # fits exactly
    base.untyped_storage().resize_(63 * 4)
    with pytest.raises(ValueError, match=r"a \(shape \(4, 16\).*reaches byte 256 of a storage that holds 252 bytes"):
        det_gemm_fwd(view, y)


# ---- FP16 operands ------------------------------------------------------------------------------
def f16_operands(op, m, n, k, device):
    return tuple(t.half() for t in operands(op, m, n, k, device))


@pytest.mark.parametrize("op", ["fwd", "da", "db"])
@pytest.mark.parametrize("m", [1, 7, 33])
def test_fp16_within_its_bound_and_one_nearest_even_rounding(op, m, device):
    """Exact FP16 products, FP32 accumulation, one FP16 rounding: within the contract's bound with FP16's unit, and
    bit for bit the FP32-output launch's result rounded to FP16 by torch (nearest-even)."""
    n, k = 40, 56
    x, y = f16_operands(op, m, n, k, device)
    c = OPS[op](x, y)
    c32, record = LAUNCHERS[op](x, y, out_dtype=torch.float32)
    assert c.dtype == torch.float16 and record.name.endswith("] fp16")
    assert_bits(c, c32.half(), "one FP16 rounding of the FP32 accumulator")
    c_star, abs_ab = oracle(op, x, y)
    reduced = {"fwd": k, "da": n, "db": m}[op]
    result = check_bound(c.cpu(), c_star, gemm_bound(c_star, abs_ab, reduced, U_FP16, ETA_FP16))
    assert result.passed, result


def test_fp16_rows_are_batch_invariant_and_configs_agree(device):
    x, y = f16_operands("fwd", 33, 48, 72, device)
    full = det_gemm_fwd(x, y)
    for m in (1, 7):
        assert_bits(det_gemm_fwd(x[:m], y), full[:m], f"fp16 M={m}")
    padded = torch.cat([x[3:4], torch.zeros(40, 72, dtype=torch.float16, device=device)])
    assert_bits(det_gemm_fwd(padded, y)[:1], full[3:4], "fp16 row 3 with 40 zero rows")
    for config in {ws_twin(c) for c in all_configs("fwd", dtype=torch.float16)[:6]}:
        got, _ = det_gemm_fwd_launch(x, y, config=config)
        assert_bits(got, full, f"fp16 {config.label()}")


def test_fp16_output_overflows_to_inf_as_torch_rounds(device):
    """Results past FP16's range round to inf (nearest-even), as torch's cast does: no clamp, no wrap."""
    x = torch.full((2, 16), 200.0).half()
    w = torch.full((16, 3), 30.0).half()
    got = det_gemm_fwd(x.to(device), w.to(device)).cpu()
    assert torch.isinf(got).all() and (got > 0).all()


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fwd", "da", "db"])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_gpu_fp32_contract_invariance_and_configs(op, precision):
    """On the H100/H200: the bound, rows alone vs in a batch of 4096 (fwd, dA), repeats, and every FP32 config
    (pointer, the small-M kernel's on its band's rows, and a TMA twin) giving the table pick's bits, at an
    lm_head-like width."""
    device = torch.device("cuda")
    n, k = 1536, 4096
    x, y = operands(op, 512, n, k, device)
    c = OPS[op](x, y, precision)
    c_star, abs_ab = oracle(op, x, y)
    reduced = {"fwd": k, "da": n, "db": 512}[op]
    result = check_bound(c.cpu(), c_star, gemm_bound_fp32(c_star, abs_ab, reduced, precision))
    assert result.passed, result
    assert_bits(OPS[op](x, y, precision), c, "repeat")
    if op != "db":
        for m in (1, 7, 33, 129):
            assert_bits(OPS[op](x[:m], y, precision), c[:m], f"M={m}")
        big = torch.cat([x, f32_randn((4096 - 512, x.shape[1]), 9, device)])
        assert_bits(OPS[op](big, y, precision)[:512], c, "M=4096")
    want, _ = LAUNCHERS[op](x, y, precision=precision)
    configs = all_configs(op, dtype=torch.float32, precision=precision)
    for config in configs + [GemmConfig(128, 128, 32, 8, 8, 3, "tma")]:
        rows = config.block_m if config.variant in GEMV_VARIANTS else len(x)  # the small-M kernel: its band's rows
        got, _ = LAUNCHERS[op](x[:rows], y if op != "db" else y[:rows], precision=precision, config=config)
        assert_bits(got, want[:rows] if op != "db" else want, f"{op} {precision} {config.label()}")


@pytest.mark.gpu
def test_gpu_fp32_lm_head_rows_are_batch_invariant_at_vocab_width():
    """An FP32 lm_head (K 4096, N 151936): row i's logits alone, in a batch of 32 and of 1024, the same bits."""
    device = torch.device("cuda")
    x, w = f32_randn((1024, 4096), 1, device), f32_randn((151936, 4096), 2, device, 4096**-0.5)
    full = det_gemm_fwd(x, w.t())
    for m in (1, 32):
        assert_bits(det_gemm_fwd(x[:m], w.t()), full[:m], f"M={m}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fwd", "da", "db"])
def test_gpu_fp16_bound_invariance_and_every_config(op):
    """FP16 on the H100/H200: the bound, one rounding of the FP32 result, rows alone vs in a batch, and every config
    of the table (its "ws" picks as their TMA twins) giving the same bits."""
    device = torch.device("cuda")
    n, k = 1536, 4096
    x, y = f16_operands(op, 512, n, k, device)
    c = OPS[op](x, y)
    c32, _ = LAUNCHERS[op](x, y, out_dtype=torch.float32)
    assert_bits(c, c32.half(), "one FP16 rounding")
    c_star, abs_ab = oracle(op, x, y)
    reduced = {"fwd": k, "da": n, "db": 512}[op]
    assert check_bound(c.cpu(), c_star, gemm_bound(c_star, abs_ab, reduced, U_FP16, ETA_FP16)).passed
    if op != "db":
        for m in (1, 7, 33, 129):
            assert_bits(OPS[op](x[:m], y), c[:m], f"M={m}")
    for config in all_configs(op, dtype=torch.float16):
        got, _ = LAUNCHERS[op](x, y, config=config)
        assert_bits(got, c, f"{op} fp16 {config.label()}")


_LM_HEAD: dict = {}


def lm_head_operands(op: str, layout: str, rows: int = 64):
    """(x, y) of ``op`` on the GPU at an lm_head (K 4096, N 151936); the weight (2.5 GB) drawn once per layout."""
    device = torch.device("cuda")
    if _LM_HEAD.get("layout") != layout:
        _LM_HEAD.clear()
        _LM_HEAD.update(layout=layout, w=operands("fwd", 1, 151936, 4096, device, layout)[1])
    x = f32_randn((rows, 4096), 1, device) if op == "fwd" else f32_randn((rows, 151936), 2, device)
    return x, _LM_HEAD["w"]


@pytest.mark.gpu
@pytest.mark.parametrize("layout,op", [("linear", "fwd"), ("linear", "da"), ("kn", "fwd"), ("kn", "da")])
def test_gpu_small_m_kernel_has_the_tile_bits_at_lm_head_width(layout, op):
    """sm_90 at an lm_head (K 4096, N 151936; dA: the 4096-wide input gradient, reduced over 151936): at M 1, 2, 7
    and 16 the table's pick (the small-M kernel) and every candidate of its band (each variant, other tiles and
    pipeline depths) give the rows of M = 64 on the tile path bit for bit: Triton's FMA dot and the explicit FMAs run
    the same chain. Row 0 at M = 1 within the FP32 bound of the FP64 oracle."""
    x, y = lm_head_operands(op, layout)
    full, record = LAUNCHERS[op](x, y)
    # the reference rows on a 64-row tile: the Gluon FMA kernel's for fwd, the pointer kernel's for dA
    assert record.config.variant == ("fma" if op == "fwd" else "ptr") and record.config.block_m == 64, record.config
    for m in (1, 2, 7, 16):
        got, record = LAUNCHERS[op](x[:m], y)
        candidates = gemv_candidates(m, full.shape[1], op)
        assert record.config == candidates[0] and record.config.block_m == gemv_band(m)
        assert_bits(got, full[:m], f"{op} {layout} M={m} table pick {record.config.label()}")
        for config in candidates[1:]:
            got, _ = LAUNCHERS[op](x[:m], y, config=config)
            assert_bits(got, full[:m], f"{op} {layout} M={m} {config.label()}")
    row = LAUNCHERS[op](x[:1], y)[0]
    x64, y64 = x[:1].double(), (y if op == "fwd" else y.t()).double()
    c_star, abs_ab = x64 @ y64, x64.abs() @ y64.abs()
    result = check_bound(row.double(), c_star, gemm_bound_fp32(c_star, abs_ab, x.shape[1], "ieee"))
    assert result.passed, result
