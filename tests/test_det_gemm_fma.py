"""det_gemm's Gluon FMA-dot variant for FP32 "ieee" operands (``GemmConfig(..., variant="fma")``,
kernels/det_gemm/fma.py).

On the GPU (DETKIT_TEST_DEVICE=cuda, sm_90): every candidate (configs.fma_candidates) gives the bits of the pinned
Triton FP32 tile for fwd, dA and dB on both weight layouts with partial tiles and a partial last K step, and the twin
store; at M = 1..33 each row has the bits the table's pick gives it at that M (the small-M kernel up to 16 rows, the
tile above) and at M = 33: batch invariance across the table's switch. The lm_head shapes' bits: the bench
(tools/gpu/fp32_fma.sh). Everywhere: the config rules, the refusals
(one line each, before any work), the launch's parameters (its sm_90 plan recorded on CPU tensors), the table's
fallback to the pointer twin where the Gluon kernel cannot run, and an offline sm_90 compile: fused multiply-adds
only (no FMUL / FADD, no wgmma or mma.sync), at least 4 FFMA per shared-memory load, no spills."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from detkit.kernels.backend import CUDA_SM90, TRITON_INTERPRETER
from detkit.kernels.det_gemm.configs import (
    CONFIG_TABLE_FP32, FMA_MICRO, GemmConfig, all_configs, fma_candidates, fma_micro_tile, fma_ring_bytes, fma_twin,
)
from detkit.kernels.det_gemm.launch import LAUNCHERS, _table_pick, clear_launch_plans
from tests.test_det_gemm_fp32 import assert_bits, operands

# A small tile for the CPU tests (the interpreter runs its pointer twin): 64x64 on 4 warps, 8x4 outputs per thread.
SMALL_FMA = GemmConfig(64, 64, 32, 8, 4, 3, "fma")


@pytest.fixture
def fresh_plans():
    clear_launch_plans()
    yield
    clear_launch_plans()


# ---- config rules ------------------------------------------------------------------------------------------------
def test_fma_config_rules_and_micro_tiles():
    assert [fma_micro_tile(c.block_m, c.block_n, c.num_warps) for c in fma_candidates()] == [
        (8, 16, 4), (8, 16, 4), (8, 8, 4), (8, 8, 4), (8, 4, 4),  # 128-row tiles
        (8, 8, 2), (8, 16, 2), (8, 16, 2), (8, 8, 2)]  # 64-row tiles: two warps along M
    assert fma_micro_tile(64, 64, 4) == (8, 4, 2) and fma_micro_tile(64, 64, 8) == (4, 4, 4)
    assert all(c.variant == "fma" and c.label().endswith("_fma") for c in fma_candidates())
    assert fma_ring_bytes(GemmConfig(128, 128, 32, 8, 8, 3, "fma")) == 3 * 256 * 32 * 4
    assert set(FMA_MICRO.values()) == {(8, 16), (8, 8), (8, 4), (4, 4)}
    with pytest.raises(ValueError, match=r"needs block_m x block_n / \(32 x num_warps\) in \[16, 32, 64, 128\] .* "
                                         r"got 256x256 on 8 warps"):
        GemmConfig(256, 256, 32, 8, 8, 1, "fma")  # 256 outputs per thread: more than the registers hold
    with pytest.raises(ValueError, match=r"variant 'fma' cannot tile 256x16 with 4x4 per thread, 4x8 lanes per warp "
                                         r"and 8 warps"):
        GemmConfig(256, 16, 32, 8, 8, 3, "fma")
    with pytest.raises(ValueError, match=r"variant 'fma' needs block_m a power of two <= 256 \(one TMA box dim\); got "
                                         r"96"):
        GemmConfig(96, 128, 32, 8, 8, 3, "fma")
    with pytest.raises(ValueError, match=r"variant 'fma' needs 262144 bytes of shared memory for 8 stages .* use fewer "
                                         r"stages"):
        GemmConfig(128, 128, 32, 8, 8, 8, "fma")
    assert fma_twin(SMALL_FMA) == replace(SMALL_FMA, variant="ptr") and fma_twin(replace(SMALL_FMA, variant="tma")) \
        == replace(SMALL_FMA, variant="tma")


# ---- refusals --------------------------------------------------------------------------------------------------
def test_fma_refuses_other_operands_the_interpreter_segments_and_untma_able_operands(device, fresh_plans):
    x, y = operands("fwd", 20, 40, 64, device)
    with pytest.raises(ValueError, match=r"variant 'fma' \(the Gluon FMA-dot kernel\) takes FP32 operands with "
                                         r"precision 'ieee' only; got torch.float32, precision 'tf32': use a 'ptr'"):
        LAUNCHERS["fwd"](x, y, config=SMALL_FMA, precision="tf32")
    with pytest.raises(ValueError, match=r"takes FP32 operands with precision 'ieee' only; got torch.bfloat16: use"):
        LAUNCHERS["fwd"](x.bfloat16(), y.bfloat16(), config=SMALL_FMA)
    if device.type == "cpu":
        with pytest.raises(ValueError, match=r"variant 'fma' is a Gluon kernel for sm_90 and has no "
                                             r"'triton_interpreter' path; use a 'ptr' config"):
            LAUNCHERS["fwd"](x, y, config=SMALL_FMA)
        return
    with pytest.raises(ValueError, match=r"variant 'fma' keeps one FP32 accumulator \(no seg_len segments\)"):
        LAUNCHERS["fwd"](x, y, config=SMALL_FMA, seg_len=32)
    x30, y30 = operands("fwd", 20, 40, 30, device)  # 120-byte rows: not 16-byte aligned, TMA cannot describe them
    with pytest.raises(ValueError, match=r"variant 'fma' cannot describe a \(shape \(20, 30\), strides \(30, 1\)"):
        LAUNCHERS["fwd"](x30, y30, config=SMALL_FMA)


# ---- the launch's parameters and the table's fallback ---------------------------------------------------------
@pytest.mark.parametrize("op,layout,a_m_major,b_k_major", [
    ("fwd", "linear", False, True), ("fwd", "kn", False, False), ("da", "linear", False, False),
    ("da", "kn", False, True), ("db", "kn", True, False)])
def test_a_cuda_plan_of_the_fma_kernel_passes_its_parameters(op, layout, a_m_major, b_k_major, monkeypatch,
                                                             fresh_plans):
    """The sm_90 launch path, its launcher recorded instead of run (CPU tensors): one program per tile, the config's
    warps, the micro-tile of fma_micro_tile, each operand's storage order and TMA descriptors over it with the box of
    its storage order and the NVMMA 128-byte swizzle (BLOCK_K 32 FP32 = 128-byte rows), the launch named as every
    FP32 "ieee" launch."""
    import detkit.kernels.det_gemm.launch as dg
    from detkit.kernels.det_gemm.fma import det_gemm_fma_kernel

    calls = []

    class Recorder:
        def __init__(self, kernel, grid, options, device, dynamic):
            self.kernel, self.grid, self.options, self.ready = kernel, grid, options, False

        def __call__(self, args):
            calls.append((self.kernel, self.grid, self.options, dict(zip(self.kernel.arg_names, args))))

    monkeypatch.setattr(dg, "DirectLaunch", Recorder)
    monkeypatch.setattr(dg, "resolve_backend_of_devices", lambda fn, devices: CUDA_SM90)
    monkeypatch.setattr(dg, "ensure_thread_cuda_context", lambda device: None)
    config = GemmConfig(128, 128, 32, 8, 8, 3, "fma")
    x, y = operands(op, 300, 264, 200, torch.device("cpu"), layout)
    _, launch = LAUNCHERS[op](x, y, config=config)
    ((kernel, grid, options, args),) = calls
    rows, cols = {"fwd": (300, 264), "da": (300, 200), "db": (200, 264)}[op]
    assert kernel is det_gemm_fma_kernel and launch.config == config and launch.backend == CUDA_SM90
    assert launch.name == f"det_gemm_{op} [M=300, N=264, K=200] fp32 ieee"
    assert grid == (-(-rows // 128) * -(-cols // 128),)
    assert options == {"num_warps": 8, "default_dot_input_precision": "ieee"}
    assert (args["R"], args["C"], args["stride_cr"], args["stride_cc"]) == (rows, cols, cols, 1)
    assert (args["MICRO_M"], args["MICRO_N"], args["WARPS_M"], args["STAGES"]) == (8, 8, 4, 3)
    assert (args["A_M_MAJOR"], args["B_K_MAJOR"], args["PRECISION"], args["TWIN"]) == (a_m_major, b_k_major, "ieee",
                                                                                        False)
    a_box = [32, 128] if a_m_major else [128, 32]
    b_box = [128, 32] if b_k_major else [32, 128]
    for desc, box in ((args["a_desc"], a_box), (args["b_desc"], b_box)):
        assert list(desc.block_shape) == box and desc.layout.swizzle_byte_width == 128, desc
        assert desc.layout.element_bitwidth == 32 and desc.strides[-1] == 1


def test_a_table_pick_of_fma_runs_as_its_pointer_twin_where_gluon_cannot(device, monkeypatch, fresh_plans):
    """Where the table pins an "fma" tile, the interpreter, seg_len segments, TF32 products and operands TMA cannot
    describe run the pointer kernel with the same tile (same bits), and the cross-config audit lists that
    twin off sm_90: the pick never reaches the Gluon kernel where it would be refused."""
    monkeypatch.setitem(CONFIG_TABLE_FP32, "fwd", ((2**31, SMALL_FMA),))
    twin = fma_twin(SMALL_FMA)
    assert all_configs("fwd", CUDA_SM90, torch.float32) == [SMALL_FMA]
    assert all_configs("fwd", TRITON_INTERPRETER, torch.float32) == [twin]
    aligned = (((20, 64), (64, 1), 0), ((64, 40), (1, 64), 0))
    unaligned = (((20, 30), (30, 1), 0), ((30, 40), (1, 30), 0))  # 120-byte rows
    pick = _table_pick
    assert pick("fwd", 20, 20, 40, aligned, device, CUDA_SM90, False, torch.float32, "ieee") == SMALL_FMA
    assert pick("fwd", 20, 20, 40, aligned, device, CUDA_SM90, True, torch.float32, "ieee") == twin
    assert pick("fwd", 20, 20, 40, aligned, device, TRITON_INTERPRETER, False, torch.float32, "ieee") == twin
    assert pick("fwd", 20, 20, 40, unaligned, device, CUDA_SM90, False, torch.float32, "ieee") == twin
    if device.type == "cpu":
        x, y = operands("fwd", 20, 40, 72, device)
        got, record = LAUNCHERS["fwd"](x, y)
        assert record.config == twin
        assert_bits(got, LAUNCHERS["fwd"](x, y, config=GemmConfig(64, 64, 32, 8, 4, 3))[0], "the pick's pointer twin")


# ---- offline sm_90 compile ---------------------------------------------------------------------------------------
_FMA_SCRIPT = """
import glob, json, re, tempfile
from tools.gemm_sass import CASES, build
from detkit.kernels.det_gemm.configs import fma_candidates
rows = []
for i, config in enumerate(fma_candidates()):
    # K-major A and B (fwd on nn.Linear's weight.t()) for every candidate; M-major A and N-major B (dB) for the first
    for case in (c for c in CASES if c.name == "fwd_weight_t" or (i == 0 and c.name == "db_a_dc")):
        d = tempfile.mkdtemp()
        row = build(case, "fma", d, config=config, precision="ieee")
        ttgir = open(glob.glob(d + "/*.ttgir")[0]).read()
        # each tt.addptr's offset element type (the epilogue's stores): "..., tensor<128x128xi64, #blocked> loc(...)"
        row["addptr_offsets"] = sorted({re.search(r", (?:tensor<[0-9x]+)?(i\\d+)(?:, #\\w+>)? loc", line).group(1)
                                        for line in ttgir.splitlines() if "tt.addptr" in line})
        rows.append(row)
print(json.dumps(rows))
"""


def test_fma_candidates_compile_for_sm90_offline_to_ffma_only_without_spills(tmp_path):
    """Each candidate on K-major A and B (fwd on nn.Linear's weight.t()), and the first on an M-major A with an N-major
    B (dB): the four operand orders det_gemm gives the kernel (tools/gemm_sass.py --variants fma compiles every
    candidate on every op and layout). Every product a fused multiply-add (FFMA; no FMUL or FADD that a split
    multiply-add would need), no tensor-core instruction, TMA loads, no register spills, and at least 4 FFMA per
    shared-memory load (8x16 outputs per thread: 128 / 6, 8x8: 16, 8x4: 32 / 3): BLOCK_M x BLOCK_N x BLOCK_K / threads
    FFMA per BLOCK_K step. The shared memory is the ring fma_ring_bytes counts; the stores' offsets are 64-bit."""
    from tests.moe_helpers import compile_sm90_offline

    rows = compile_sm90_offline(_FMA_SCRIPT, tmp_path)
    by_label = {c.label(): c for c in fma_candidates()}
    assert len(rows) == len(by_label) + 1 and {r["op"] for r in rows} == {"fwd", "db"}
    for r in rows:
        config = by_label[r["config"]]
        micro_m, micro_n, _ = fma_micro_tile(config.block_m, config.block_n, config.num_warps)
        assert r["FFMA"] == micro_m * micro_n * config.block_k, r
        assert r["FMUL"] == 0 and r["FADD"] == 0 and r["HGMMA"] == 0 and r["HMMA"] == 0, r
        assert r["dot_precisions"] == ["ieee"], r
        assert r["UTMALDG"] > 0 and r["LDGSTS"] == 0 and r["stack_bytes"] == 0, r
        assert r["ffma_per_lds"] >= 4, r
        assert r["addptr_offsets"] == ["i64"], r  # the logits of an lm_head may hold more than 2**31 - 1 elements
        ring = fma_ring_bytes(config)
        assert ring <= r["shared_bytes"] <= ring + 1024, r


# ---- GPU ---------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("op,layout", [("fwd", "linear"), ("fwd", "kn"), ("da", "linear"), ("da", "kn"),
                                       ("db", "kn")])
def test_gpu_fma_candidates_have_the_pinned_tiles_bits(op, layout):
    """At M = 300 (N 264, K 200: partial tiles in both output dims and a partial last K step of 32; 16-byte-aligned
    rows for TMA) the table's pick (fwd: an "fma" tile) and every candidate give the bits of the pick's tile on the
    pointer kernel (its FMA dot: the same chain per output), and so does the twin store; repeats are bitwise."""
    device = torch.device("cuda")
    x, y = operands(op, 300, 264, 200, device, layout)
    pick, record = LAUNCHERS[op](x, y)
    want, pointer = LAUNCHERS[op](x, y, config=fma_twin(record.config))
    assert pointer.config.variant == "ptr", pointer.config
    assert_bits(pick, want, f"{op} {layout} the table's pick {record.config.label()}")
    for config in fma_candidates():
        got, launch = LAUNCHERS[op](x, y, config=config)
        assert launch.config == config and launch.name == record.name
        assert_bits(got, want, f"{op} {layout} {config.label()}")
        assert_bits(LAUNCHERS[op](x, y, config=config)[0], want, f"{op} {layout} {config.label()} repeat")
    twin = torch.full_like(want, float("nan"))
    got, _ = LAUNCHERS[op](x, y, config=fma_candidates()[0], twin_out=twin)
    assert_bits(got, want, "with a twin")
    assert_bits(twin, want, "the twin")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fwd", "da"])
def test_gpu_fma_rows_have_their_bits_at_every_m_from_1_to_33(op):
    """Batch invariance across the table's switch: for M = 1..33 (nn.Linear's weight, N 520, K 264: partial tiles
    and K steps) each candidate's rows equal the table's pick at that M (the small-M kernel up to 16 rows, above it
    the FMA kernel's tile for fwd and the Triton tile for dA) and the pick's rows at M = 33, which equal its tile's
    on the pointer kernel."""
    device = torch.device("cuda")
    x, y = operands(op, 33, 520, 264, device)
    full, record = LAUNCHERS[op](x, y)
    assert_bits(full, LAUNCHERS[op](x, y, config=fma_twin(record.config))[0], f"{op} the pick's pointer twin")
    for m in range(1, 34):
        pick, _ = LAUNCHERS[op](x[:m], y)
        assert_bits(pick, full[:m], f"{op} table pick at M={m}")
        for config in fma_candidates():
            got, _ = LAUNCHERS[op](x[:m], y, config=config)
            assert_bits(got, pick, f"{op} M={m} {config.label()}")
