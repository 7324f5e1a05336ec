"""``detkit bench moe`` (bench/moe.py, its FP8 half bench/moe_fp8.py) on the CPU: the case lists and their
refusals, the FP8 crossover model and targets on synthetic points, and one BF16 run at the tiny preset under
the NVTX injection library: every row validated, timed, written, and a range of its own name inside
``bench moe``. Interpreter times are plumbing, not hardware results; the FP8 layer runs on the GPU
(tools/gpu/bench_smoke.sh) and its kernels in tests/test_moe_fp8.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from detkit.bench import moe, moe_fp8
from detkit.bench.moe_common import VALIDATE_REL_L2
from detkit.toolkit.presets import MOE_GPU_PRESETS as GPU_PRESETS
from detkit.toolkit.presets import MOE_PRESETS as PRESETS
from detkit.toolkit import nvtx_ranges
from detkit.toolkit.nvtx_ranges import injection_env, parse_injection_log, verify_nvtx_log
from tests.bench_helpers import bench_ctx as _ctx
from tests.bench_helpers import read_rows

REPO = Path(__file__).resolve().parents[1]


def test_bf16_cases():
    label = PRESETS["tiny"].label
    got = moe.cases(_ctx())
    assert [c.name for c in got] == [f"{label} fwd", f"{label} fwd_bwd", *(f"{label} stage {s}" for s in moe.STAGES)]
    assert {c.group for c in got} == {"tiny"}
    gpu = moe.cases(_ctx(interpreted=False), no_stages=True)
    assert [c.name for c in gpu] == [f"{PRESETS[p].label} {m}" for p in GPU_PRESETS for m in ("fwd", "fwd_bwd")]
    for flags in ({"no_fp64": True}, {"no_crossover": True}):
        with pytest.raises(ValueError, match="apply to --fp8 only"):
            moe.cases(_ctx(), **flags)


def test_fp8_cases():
    from detkit.kernels.fp8_quant import QBLOCK

    fits = [n for n, p in PRESETS.items() if p.h % QBLOCK == 0 and p.i % QBLOCK == 0]
    assert moe_fp8.fp8_presets() == fits and "tiny" not in fits and "tiny-fp8" in fits
    label = moe_fp8.fp8_label(PRESETS["tiny-fp8"])
    got = moe.cases(_ctx(), fp8=True)
    crossover = [f"{moe_fp8.fp8_label(moe_fp8.crossover_preset(True, t))} crossover fwd_bwd"
                 for t in moe_fp8.CPU_CROSSOVER_TOKENS]
    assert [c.name for c in got] == [f"{label} fwd", f"{label} fwd_bwd",
                                     *(f"{label} stage {s}" for s in moe_fp8.STAGES), *crossover]
    assert "] fp8 fwd" in got[0].name and len({c.group for c in got}) == 1 + len(crossover)
    gpu = moe.cases(_ctx(interpreted=False), fp8=True, no_stages=True, no_crossover=True)
    assert [c.preset for c in gpu][::2] == [*moe_fp8.TARGET_PRESETS, *(p for p in GPU_PRESETS if p in fits)]
    with pytest.raises(ValueError, match=rf"\['tiny'\] cannot run the FP8 path \(H and I must be multiples of {QBLOCK}"):
        moe.cases(_ctx(["tiny"]), fp8=True)


def test_crossover_model():
    assert moe_fp8.fit_line([1, 2, 3], [5.0, 7.0, 9.0]) == pytest.approx((3.0, 2.0))
    with pytest.raises(ValueError, match="two distinct T"):
        moe_fp8.fit_line([4, 4], [1.0, 2.0])
    # BF16 10 + 2T, FP8 30 + T (microseconds): the lines cross at T = 20; FP8 wins from T = 32 on.
    pts = [{"T": t, "validated": True, "bf16_median_us": 10.0 + 2 * t, "fp8_cold_median_us": 30.0 + t}
           for t in (8, 16, 32, 64)]
    got = moe_fp8.crossover(pts)
    assert got["crossover_T_fit"] == pytest.approx(20.0) and got["crossover_T_measured"] == 32
    never = [{**p, "fp8_cold_median_us": 30.0 + 3 * p["T"]} for p in pts]
    assert moe_fp8.crossover(never)["crossover_T_fit"] is None and moe_fp8.crossover(never)["crossover_T_measured"] is None
    assert "error" in moe_fp8.crossover(pts[:1])
    rows = [{**p, "measure": moe_fp8.CROSSOVER, "wgrad_bf16_validated": False} for p in pts]
    assert moe_fp8.crossover_summary(rows, hardware_result=False) == {"note": "interpreter: no crossover from CPU wall time"}
    assert moe_fp8.crossover_summary(rows, True)["wgrad_fp8"]["crossover_T_measured"] == 32


def test_fp8_targets_need_the_speedup_and_the_gate():
    def row(preset, speedup, gate=True):
        mode = {"gate_passed": gate}
        return {"measure": "fwd_bwd", "preset": preset, "T": PRESETS[preset].t, "speedup_fp8_cold": speedup,
                "wgrad_fp8": mode, "wgrad_bf16": {"gate_passed": True}}

    got = moe_fp8.targets([row("reference", 1.45), row("reference-16k", 1.45, gate=False), row("olmoe", 2.0)])
    assert [(t["preset"], t["met_wgrad_fp8"]) for t in got] == [("reference", True), ("reference-16k", False)]
    assert moe_fp8.targets([row("reference", 1.39)])[0]["met_wgrad_fp8"] is False


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_moe")
    env = {k: v for k, v in os.environ.items() if k not in ("NVTX_INJECTION64_PATH", "DETKIT_NVTX_LOG")}
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    log = None
    if shutil.which(os.environ.get("CC", "gcc")):
        log = tmp / "nvtx.log"
        env.update(injection_env(nvtx_ranges.build_injection_library(tmp / "lib"), log))
    cmd = [sys.executable, "-m", "detkit", "bench", "moe", "--device", "cpu", "--no-stages", "--rounds", "1",
           "--out", str(tmp / "out")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp, log


def test_bf16_rows_validated_timed_and_reported(bf16_run):
    tmp, _ = bf16_run
    out = tmp / "out"
    rows = read_rows(out)
    assert [r["name"] for r in rows] == [c.name for c in moe.cases(_ctx(), no_stages=True)]
    p = PRESETS["tiny"]
    for r in rows:
        assert r["passed"] is r["validated"] is r["repeat_bitwise_equal"] is True
        assert max(v for k, v in r.items() if k.startswith("rel_l2_vs_baseline_")) <= VALIDATE_REL_L2
        assert r["flops"] == {"fwd": 6, "fwd_bwd": 18}[r["measure"]] * p.t * p.k * p.h * p.i  # documented formulas
        assert r["ratio_vs_baseline"] == pytest.approx(r["detkit_median_us"] / r["baseline_median_us"])
        assert r["hardware_result"] is False and "detkit_tflops" not in r and "detkit_mfu" not in r
        assert r["routed_rows"] == p.t * p.k and r["padded_rows"] % 128 == 0
    report = json.loads((out / "report.json").read_text())
    assert report["rows"] == rows and report["meta"]["presets"] == ["tiny"]
    assert {t["name"] for t in report["meta"]["config_tables"]} >= {"det_gemm", "moe_bf16"}
    assert "moe_fp8" not in {t["name"] for t in report["meta"]["config_tables"]}  # the FP8 kernels never loaded
    md = (out / "report.md").read_text()
    assert "**PASS**: 2 row(s) passed" in md and "## BF16 MoE layer" in md and "moe_bf16 " in md


def test_bf16_rows_are_nvtx_ranges(bf16_run):
    tmp, log = bf16_run
    if log is None:
        pytest.skip("gcc not found: no NVTX injection library")
    rows = read_rows(tmp / "out")
    names = [r["name"] for r in rows]
    timed = [f"{r['name']} | {impl}" for r in rows for impl in ("detkit", r["baseline"])]
    nesting = [("bench moe", n) for n in names] + [(n, f"{n} | detkit") for n in names]
    assert verify_nvtx_log(log, ["bench moe", *names, *timed], nesting=nesting) == []
    pushes = [e for e in parse_injection_log(log) if e.kind == "push"]
    assert [e.depth for e in pushes if e.message == "bench moe"] == [1]
