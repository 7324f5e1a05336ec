"""fp32_invariant mode (kernels/parallel/invariant.py, docs/invariance.md): the TP=1 / CP=1 segmented kernels
against two-shard FP32 sums, bit for bit, in one process; the modes failing closed; and the
'invariance' suite on 4 gloo ranks (torchrun, interpreter, tiny layout) through the CLI. On 2 GPUs
(``multigpu``): TP1CP1 vs TP2CP1 (world 0,1) and TP1CP1 vs TP1CP2 (world 0,2) at Qwen3-8B shapes.

Why the equalities must hold (docs/invariance.md, "The argument"): a TP/CP rank's FP32 partial is
``fl32`` of its shard's accumulation; the FP32 all-reduce of two operands is ``fl32(p0 + p1)``; the
segmented kernel forms ``(0 + seg0) + seg1`` with each segment accumulated exactly like the shard
(same pinned config, same order, same operands), i.e. the same single rounding.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from detkit.kernels.parallel import operators as parallel
from detkit.kernels.det_gemm.launch import det_gemm_da_launch, det_gemm_db_launch, det_gemm_fwd_launch
from detkit.kernels.parallel.invariant import (
    FP32_INVARIANT, MODES, check_mode, cp1_db, cp_padded_rows, cp_shard_major, invariant_config, layout_config,
    tp1_da, tp1_fwd,
)
from detkit.kernels.parallel.mlp import MlpPlan
from detkit.toolkit.contract import compare_bits
from detkit.toolkit.fixtures import bf16_randn
from tests.conftest import assert_bits_equal, two_cuda_gpus
from tests.torchrun import run_ranks
from detkit.toolkit.layout import CP_SIZE, TINY, AxisGroup, TpCpLayout, layout_for_preset

CPU_TIMEOUT_S = 240
GPU_TIMEOUT_S = 900

TINY_LAYOUT = layout_for_preset("tiny")  # B=2, S=6: M_local 6 (CP shards padded to BLOCK_K), I/2 = 48
ALIGNED_LAYOUT = TpCpLayout(TINY, 3, 32)  # B=3, S=32: M_local 48, a multiple of BLOCK_K (no padding)


def two_shard_sum(p0: torch.Tensor, p1: torch.Tensor) -> torch.Tensor:
    """What the FP32 all-reduce of two ranks returns, then the one BF16 rounding."""
    assert p0.dtype == p1.dtype == torch.float32
    return (p0 + p1).to(torch.bfloat16)


# ------------------------------------------------------------------------------ TP: Down forward
@pytest.mark.parametrize("m", [1, 7, 129])
def test_down_fwd_tp1_segments_equal_two_tp_shards(device, m):
    layout = TINY_LAYOUT
    i, i_l, h = layout.model.intermediate_size, layout.i_local, layout.model.hidden_size
    hidden = bf16_randn((m, i), 1, device)
    w_down = bf16_randn((h, i), 2, device, scale=i**-0.5).t()  # b [K, N] = nn.Linear weight.t()
    config = layout_config("fwd", layout)
    shards = [det_gemm_fwd_launch(hidden[:, layout.i_shard(t)], w_down[layout.i_shard(t)], config=config,
                                  out_dtype=torch.float32)[0] for t in range(2)]
    tp2 = two_shard_sum(*shards)
    assert_bits_equal(tp1_fwd(hidden, w_down, layout, FP32_INVARIANT), tp2, "TP=1 seg_len=I/2 vs TP=2 FP32 sum")
    # already before the BF16 rounding: the kernel's (0 + seg0) + seg1 is the all-reduce's fl32(p0 + p1)
    seg = det_gemm_fwd_launch(hidden, w_down, config=config, seg_len=i_l, out_dtype=torch.float32)[0]
    assert_bits_equal(seg, shards[0] + shards[1], "FP32 segments vs FP32 sum of the shards")
    # the segments are what makes it equal: one FP32 accumulation over all of I rounds differently
    whole = det_gemm_fwd_launch(hidden, w_down, config=config, out_dtype=torch.float32)[0]
    if m == 129:
        assert compare_bits(whole, shards[0] + shards[1]).mismatches > 0
    assert i_l % config.block_k == 0


# ------------------------------------------------------------------------------ TP: Gate|Up dX
@pytest.mark.parametrize("m", [1, 12])
def test_gate_up_dx_tp1_segments_equal_two_tp_shards(device, m):
    """Columns [gate I_0 | up I_0 | gate I_1 | up I_1]: a TP rank reduces its [gate | up] 2*I/2 in one
    FP32 accumulation; TP=1 runs the four blocks with seg_len = 2*I/2."""
    layout = TINY_LAYOUT
    i_l, h = layout.i_local, layout.model.hidden_size
    d_gu = bf16_randn((m, 4 * i_l), 3, device)
    w_gu = bf16_randn((4 * i_l, h), 4, device, scale=h**-0.5).t()  # b [K=H, N=4*I_l]
    config = layout_config("da", layout)
    shards = [det_gemm_da_launch(d_gu[:, 2 * i_l * t:2 * i_l * (t + 1)], w_gu[:, 2 * i_l * t:2 * i_l * (t + 1)],
                                 config=config, out_dtype=torch.float32)[0] for t in range(2)]
    assert_bits_equal(tp1_da(d_gu, w_gu, 2 * i_l, layout, FP32_INVARIANT), two_shard_sum(*shards), "Gate|Up dX")


# ------------------------------------------------------------------------------ CP: dW over permuted rows
@pytest.mark.parametrize("layout", [TINY_LAYOUT, ALIGNED_LAYOUT], ids=["padded_B2_S6", "aligned_B3_S32"])
def test_dw_cp1_shard_major_rows_equal_two_cp_shards(device, layout):
    """A CP shard of B > 1 sequences is B blocks of rows, not one range: CP=1 regroups the rows
    CP-shard-major (zero-padded to BLOCK_K) and reduces them as two segments."""
    k, n = layout.model.hidden_size, 2 * layout.i_local
    a = bf16_randn((layout.m, k), 5, device)
    dc = bf16_randn((layout.m, n), 6, device, scale=layout.m**-0.5)
    config = layout_config("db", layout)
    locals_ = [det_gemm_db_launch(layout.shard_rows(a, c), layout.shard_rows(dc, c), config=config,
                                  out_dtype=torch.float32)[0] for c in range(CP_SIZE)]
    cp2 = two_shard_sum(*locals_)
    assert_bits_equal(cp1_db(a, dc, layout, FP32_INVARIANT), cp2, "CP=1 shard-major segments vs CP=2 FP32 sum")
    # the global row order as one FP32 accumulation is a different order: it differs before rounding
    plain = det_gemm_db_launch(a, dc, config=config, out_dtype=torch.float32)[0]
    assert compare_bits(plain, locals_[0] + locals_[1]).mismatches > 0


def test_cp_shard_major_rows(device):
    layout = TINY_LAYOUT
    rows = torch.arange(layout.m, dtype=torch.float32, device=device)[:, None].to(torch.bfloat16) + 1
    pad = cp_padded_rows(layout, 16)
    got = cp_shard_major(rows, layout, 16)
    assert got.shape == (CP_SIZE * pad, 1) and pad == 16
    for c in range(CP_SIZE):
        assert_bits_equal(got[c * pad:c * pad + layout.m_local], layout.shard_rows(rows, c), f"shard {c}")
        assert not got[c * pad + layout.m_local:(c + 1) * pad].any()
    assert layout.global_rows(0).tolist() == [0, 1, 2, 6, 7, 8]  # B=2: not one contiguous range


def test_bf16_mode_at_tp1_is_the_plain_det_gemm(device):
    layout = TINY_LAYOUT
    hidden = bf16_randn((7, layout.model.intermediate_size), 7, device)
    w = bf16_randn((layout.model.intermediate_size, layout.model.hidden_size), 8, device)
    assert_bits_equal(tp1_fwd(hidden, w, layout), det_gemm_fwd_launch(hidden, w)[0], "v1 TP=1")


# ------------------------------------------------------------------------------ modes and configs
@pytest.mark.parametrize("mode", ["fp32", "BF16", None, "fp32-invariant"])
def test_unknown_modes_fail_closed(mode):
    with pytest.raises(ValueError, match=r"mode .* is not supported; supported: \('bf16', 'fp32_invariant'\)"):
        check_mode(mode)


def test_operators_refuse_an_unknown_mode_before_any_work():
    """The mode is checked first: even without a process group the error is about the mode."""
    layout = TINY_LAYOUT
    shapes = layout.local_shapes()
    z = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    before = parallel.collective_counts()
    for call in (lambda: parallel.row_parallel_fwd(z["hidden"], z["w_down"], AxisGroup(layout, "tp", (0, 1)), mode="x"),
                 lambda: parallel.column_parallel_dx(z["d_gate"], z["w_gate"], AxisGroup(layout, "tp", (0, 1)),
                                                     mode="fp16"),
                 lambda: parallel.replicated_dw(z["x"], z["d_gate"], AxisGroup(layout, "cp", (0, 2)), mode=""),
                 lambda: parallel.row_parallel_dhidden(z["d_out"], z["w_down"], mode="fp64")):
        with pytest.raises(ValueError, match="is not supported; supported"):
            call()
    with pytest.raises(ValueError, match="needs layout="):
        parallel.row_parallel_dhidden(z["d_out"], z["w_down"], mode=FP32_INVARIANT)
    assert parallel.collective_counts() == before


def test_invariant_config_follows_the_shard_width():
    assert invariant_config("fwd", 6144).block_k == 64  # Qwen3-8B I/2
    assert invariant_config("db", 48).block_k == 16  # tiny I/2
    with pytest.raises(ValueError, match="not a multiple of any invariant BLOCK_K"):
        invariant_config("fwd", 40)
    with pytest.raises(ValueError, match="op 'dq' is not supported"):
        invariant_config("dq", 64)


def test_mlp_plan_fails_closed():
    layout = TINY_LAYOUT
    with pytest.raises(ValueError, match=r"tp=3; supported: \(1, 2\)"):
        MlpPlan(layout, tp=3)
    with pytest.raises(ValueError, match="TP=2 needs a tp_group"):
        MlpPlan(layout, tp=2, tp_rank=1)
    with pytest.raises(ValueError, match="is not supported"):
        MlpPlan(layout, mode="fast")
    with pytest.raises(TypeError, match="tp_group must be a TP"):
        MlpPlan(layout, tp=2, tp_group=AxisGroup(layout, "cp", (0, 2)))


# ------------------------------------------------------------------------------ the suite on 4 gloo ranks
def audit_under_torchrun(out: Path, nproc: int, device: str, timeout: float, **extra) -> subprocess.CompletedProcess:
    return run_ranks(["-m", "detkit", "audit", "--device", device, "--suite", "invariance", "--out", str(out)],
                     nproc, device, timeout, env_extra=extra)


@pytest.fixture(scope="module")
def four_rank_report(tmp_path_factory):
    from tests.test_container_build import skip_where_the_main_job_runs

    skip_where_the_main_job_runs("starts these 4 ranks and checks their report with check_4_rank_invariance")
    out = tmp_path_factory.mktemp("invariance_4")
    proc = audit_under_torchrun(out, 4, "cpu", CPU_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((out / "report.json").read_text())


def check_4_rank_invariance(report: dict) -> None:
    """The invariance suite's rows and drift table in the report of a 4-rank gloo run on the CPU: its own launch
    here, or the ranks the README main job's --suite all starts (with the tp-cp suite beside it)."""
    rows = [r for r in report["rows"] if r["suite"] == "invariance"]
    assert rows and all(r["passed"] for r in rows)
    assert {r["details"]["rank"] for r in rows} == {0, 1, 2, 3}
    bitwise = [r for r in rows if r["check"] == "invariant_bitwise"]
    # 6 pairs of 4 configs x 5 tensors on each of 4 ranks, 0 mismatched bytes everywhere
    assert len(bitwise) == 6 * 5 * 4 and all(r["details"]["mismatched_bytes"] == 0 for r in bitwise)
    assert {r["details"]["tensor"] for r in bitwise} == {"y", "dx", "dw_gate", "dw_up", "dw_down"}
    operators = [r for r in rows if r["check"] == "operator_invariant"]
    assert sorted(r["details"]["operator"] for r in operators) == sorted(
        ["row_parallel_fwd", "column_parallel_dx", "replicated_dw"] * 4)
    assert all(r["details"]["mismatched_bytes"] == 0 for r in operators)
    contract = [r for r in rows if r["check"] == "contract"]
    assert len(contract) == len(MODES) * 4 * 5 * 4
    expected = {"TP1CP1": 0, "TP2CP1": 2, "TP1CP2": 2, "TP2CP2": 4}
    for r in rows:
        if r["check"] == "collectives":
            assert r["details"]["expected_all_reduce"] == expected[r["details"]["config"]]
    meta = report["meta"]
    table = {(e["mode"], e["tensor"], e["pair"]): e for e in meta["invariance_drift_table"]}
    assert len(table) == len(MODES) * 5 * 6
    for (mode, tensor, pair), e in table.items():
        assert e["elements"] == (TINY_LAYOUT.m * 64 if tensor in ("y", "dx") else 96 * 64)
        if mode == FP32_INVARIANT:
            assert e["mismatched_bytes"] == 0 and e["ulp_max"] == 0
    # v1 is not parallelism-invariant: TP splits change y and dX, CP splits change dW
    assert table[("bf16", "y", "TP1CP1 vs TP2CP1")]["mismatches"] > 0
    assert table[("bf16", "dw_down", "TP1CP1 vs TP1CP2")]["mismatches"] > 0
    assert table[("bf16", "y", "TP1CP1 vs TP1CP2")]["mismatches"] == 0  # CP does not split y's reduction
    e = table[("bf16", "dx", "TP1CP1 vs TP2CP1")]
    assert e["ulp_max"] >= e["ulp_p99"] > 0 and e["rel_max"] >= e["rel_p99"] > 0
    not_covered = " | ".join(meta["not_covered"])
    assert "not a hardware result" in not_covered and "Qwen3-8B shapes: this run used tiny" in not_covered
    assert "invariance of the bf16 (v1) mode: not claimed" in not_covered


def test_4_rank_invariance_suite(four_rank_report):
    check_4_rank_invariance(four_rank_report)


# ------------------------------------------------------------------------------ 2 GPUs, NCCL, Qwen3-8B shapes
@pytest.mark.multigpu
@pytest.mark.skipif(not two_cuda_gpus(), reason="needs 2 CUDA GPUs of one host with NCCL (H200 pair)")
@pytest.mark.parametrize(("world", "pair"), [("0,1", "TP1CP1 vs TP2CP1"), ("0,2", "TP1CP1 vs TP1CP2")])
def test_nccl_2_gpu_invariance_qwen3_shapes(tmp_path, world, pair):
    proc = audit_under_torchrun(tmp_path, 2, "cuda", GPU_TIMEOUT_S, DETKIT_TPCP_WORLD=world)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert all(r["passed"] for r in report["rows"])
    meta = report["meta"]
    assert meta["backend"] == "cuda_sm90" and meta["distributed"]["pg_backend"] == "nccl"
    assert meta["covered"][0].startswith("layout qwen3-8b")
    assert meta["invariance_configs"] == ["TP1CP1", pair.split(" vs ")[1]]
    entries = [e for e in meta["invariance_drift_table"] if e["pair"] == pair]
    assert {e["mode"] for e in entries} == set(MODES) and len(entries) == 2 * 5
    assert all(e["mismatched_bytes"] == 0 for e in entries if e["mode"] == FP32_INVARIANT)
