"""``detkit bench moe`` (bench/moe.py with bench/moe_fp8.py and bench/moe_hf.py) on the CPU: the case lists and their
refusals, the crossover model and the verdicts on synthetic rows, one run at the tiny-all preset with the sweep under
the NVTX injection library (every implementation, eager and graph, ratios from the same run's medians, the sweep's
crossover, no verdicts), and a perturbed implementation failing its own rows. Interpreter times are plumbing, not
hardware results; tools/gpu/moe_bench.sh runs the bench on an H200."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from detkit.bench import moe, moe_fp8
from detkit.bench.moe_common import VALIDATE_REL_L2, torch_moe_fwd
from detkit.toolkit import nvtx_ranges
from detkit.toolkit.nvtx_ranges import injection_env, parse_injection_log, verify_nvtx_log
from detkit.toolkit.presets import MOE_GPU_PRESETS as GPU_PRESETS
from detkit.toolkit.presets import MOE_PRESETS as PRESETS
from tests.bench_helpers import bench_ctx as _ctx
from tests.bench_helpers import read_rows

REPO = Path(__file__).resolve().parents[1]
LAYER = [(m, tm, impl) for m in moe.MEASURES for tm in moe.TIMINGS for impl in moe.DEFAULT_IMPLS]


def test_cases_per_preset_measure_timing_and_implementation():
    p = PRESETS["tiny-all"]
    got = moe.cases(_ctx())
    stages = ([f"{p.label} stage {s}" for s in moe.STAGES]
              + [f"{moe_fp8.fp8_label(p)} stage {s}" for s in moe_fp8.STAGES])
    assert [c.name for c in got] == [moe.case_name(p, *key) for key in LAYER] + stages
    assert [(c.measure, c.timing, c.impl) for c in got[:len(LAYER)]] == LAYER
    assert {c.group for c in got} == {"tiny-all"}
    gpu = moe.cases(_ctx(interpreted=False), no_stages=True)
    assert [c.preset for c in gpu][::len(LAYER)] == list(GPU_PRESETS)
    # The FP8 variants bring the cold FP8 layer (their reference); bf16 always runs; the order is IMPLS'.
    only = moe.cases(_ctx(), impls=("fp8_warm", "grouped_mm"), measures=("fwd",), no_stages=True)
    assert [c.impl for c in only] == ["bf16", "fp8", "fp8_warm", "grouped_mm"] * 2
    # FP8 at a preset whose widths do not fit: its cases stay (their rows say why), its stages go.
    tiny = moe.cases(_ctx(["tiny"]))
    assert "fp8" in {c.impl for c in tiny} and not any("] fp8 stage" in c.name for c in tiny)


def test_sweep_points_and_refusals():
    full = moe.make_plan(_ctx(interpreted=False), sweep=True)
    pairs = [(e, k) for e in moe.SWEEP_EXPERTS for k in moe.SWEEP_TOPK if k <= e]
    assert len(full.points) == len(moe.SWEEP_WIDTHS) * len(pairs) * len(moe.SWEEP_TOKENS) == 72
    assert full.presets == ()  # --sweep alone: no presets
    reduced = moe.cases(_ctx(["reference"], interpreted=False), sweep=True, sweep_widths=("2048x768",),
                        sweep_experts=(128,), sweep_topk=(8,), sweep_tokens=(16384, 2048), no_stages=True)
    sweep = [c for c in reduced if c.name.startswith("sweep ")]
    assert [c.t for c in sweep] == [2048] * 4 + [16384] * 4 and {c.impl for c in sweep} == {"bf16", "fp8"}
    assert {c.measure for c in sweep} == {"fwd_bwd"} and reduced[0].preset == "reference"
    point = moe.sweep_point(2048, 768, 128, 8, 16384)
    assert moe.preset_of(point.name) == (point, True) and moe.preset_of("reference") == (PRESETS["reference"], False)
    refusals = [({"sweep_tokens": (8192,)}, "only with --sweep"),
                ({"sweep": True, "sweep_widths": ("2048",)}, "write HxI"),
                ({"sweep": True, "sweep_widths": ("2048x700",)}, "multiples of 128"),
                ({"sweep": True, "sweep_experts": (2,), "sweep_topk": (4,)}, "no sweep point has K <= E"),
                ({"sweep": True, "sweep_tokens": (8192, 8192)}, "repeat"),
                ({"sweep": True, "sweep_tokens": (2**20,)}, "32-bit offsets"),
                ({"impls": ("fp8", "fp8")}, "repeat")]
    for options, message in refusals:
        with pytest.raises(ValueError, match=message):
            moe.cases(_ctx(interpreted=False), **options)


def test_crossover_model():
    assert moe_fp8.fit_line([1, 2, 3], [5.0, 7.0, 9.0]) == pytest.approx((3.0, 2.0))
    with pytest.raises(ValueError, match="two distinct T"):
        moe_fp8.fit_line([4, 4], [1.0, 2.0])
    # BF16 10 + 2T, FP8 30 + T (microseconds): the lines cross at T = 20; FP8 wins from T = 32 on.
    pts = [{"T": t, "validated": True, "bf16_median_us": 10.0 + 2 * t, "fp8_median_us": 30.0 + t}
           for t in (8, 16, 32, 64)]
    got = moe_fp8.crossover(pts)
    assert got["crossover_T_fit"] == pytest.approx(20.0) and got["crossover_T_measured"] == 32
    never = [{**p, "fp8_median_us": 30.0 + 3 * p["T"]} for p in pts]
    assert moe_fp8.crossover(never)["crossover_T_fit"] is None
    assert moe_fp8.crossover(never)["crossover_T_measured"] is None
    assert "error" in moe_fp8.crossover(pts[:1])


def _row(shape, impl, timing, value_field=None, value=None, sweep=False, preset=None, **extra):
    t, h, i, e, k = shape
    row = {"name": f"{shape} {impl} {timing}", "preset": preset or "x", "sweep": sweep, "T": t, "H": h, "I": i,
           "E": e, "K": k, "measure": "fwd_bwd", "timing": timing, "impl": impl, "passed": True, "validated": True,
           **extra}
    if value_field:
        row[value_field] = value
    return row


def test_verdicts_pass_fail_and_not_run():
    ref, q16 = moe.REFERENCE_SHAPE, moe.QWEN3_30B_16K_SHAPE
    rows = [_row(ref, "fp8", "eager", "speedup_vs_bf16", 1.45, preset="reference"),
            _row(ref, "fp8", "graph", "speedup_vs_bf16", 1.39, preset="reference"),
            _row(ref, "bf16", "eager", "mfu_bf16_peak", 0.61, preset="reference"),
            _row(ref, "bf16", "graph", graph_error="capture failed: x", preset="reference"),
            _row(q16, "bf16", "eager", "mfu_bf16_peak", 0.49, sweep=True),
            _row(q16, "fp8", "eager", "speedup_vs_bf16", 1.25, sweep=True),
            _row(q16, "fp8", "graph", passed=False, validated=False, failure="gate", sweep=True)]
    got = {(v["target"], v["timing"], v["case"]): v["verdict"] for v in moe.verdicts(rows)}
    assert got[("fp8_reference", "eager", "reference shape")] == "PASS"
    assert got[("fp8_reference", "graph", "reference shape")] == "FAIL"
    assert got[("fp8_presets", "eager", "preset reference")] == "PASS"
    assert got[("fp8_presets", "eager", "preset olmoe")] == "NOT RUN"
    assert got[("bf16_mfu_reference", "eager", "reference shape")] == "PASS"
    assert got[("bf16_mfu_reference", "graph", "reference shape")].startswith("NOT MEASURED (capture failed")
    assert got[("bf16_mfu_qwen3_30b_a3b_16k", "eager", "Qwen3-30B-A3B, T=16384")] == "FAIL"
    sweep_case = "sweep H=2048 I=768 E=128 K=8 T=16384"
    assert got[("fp8_sweep", "eager", sweep_case)] == "PASS"
    assert got[("fp8_sweep", "graph", sweep_case)].startswith("FAIL (row failed: gate")
    assert "verdicts" in moe.derive(rows, {"hardware_result": True})
    assert "verdicts" not in moe.derive(rows, {"hardware_result": False})


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One interpreter run: the tiny-all preset (every implementation) and the CPU sweep, with NVTX logged."""
    tmp = tmp_path_factory.mktemp("bench_moe")
    env = {k: v for k, v in os.environ.items() if k not in ("NVTX_INJECTION64_PATH", "DETKIT_NVTX_LOG")}
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    log = None
    if shutil.which(os.environ.get("CC", "gcc")):
        log = tmp / "nvtx.log"
        env.update(injection_env(nvtx_ranges.build_injection_library(tmp / "lib"), log))
    cmd = [sys.executable, "-m", "detkit", "bench", "moe", "--device", "cpu", "--no-stages", "--rounds", "1",
           "--sweep", "--preset", "tiny-all", "--out", str(tmp / "out")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp / "out", log


def test_every_implementation_eager_and_graph_with_same_run_ratios(cpu_run):
    out, _ = cpu_run
    rows = read_rows(out)
    report = json.loads((out / "report.json").read_text())
    assert report["rows"] == rows
    p = PRESETS["tiny-all"]
    preset_rows = [r for r in rows if not r["sweep"]]
    assert [(r["measure"], r["timing"], r["impl"]) for r in preset_rows] == LAYER
    by = {(r["measure"], r["timing"], r["impl"]): r for r in preset_rows}
    for (measure, timing, impl), r in by.items():
        assert r["passed"] is r["validated"] is True, r.get("failure")
        assert r["flops"] == {"fwd": 6, "fwd_bwd": 18}[measure] * p.t * p.k * p.h * p.i  # documented formulas
        assert r["hardware_result"] is False and "tflops" not in r and "mfu_bf16_peak" not in r
        if impl == "grouped_mm" and timing == "graph":
            # The baseline reads the routing back (its sort's length): the capture stand-in refuses it by name, the
            # row says so and still passes (only detkit's layers must capture).
            assert "median_us" not in r and "reads device data on the host" in r["graph_error"]
            continue
        assert r["median_us"] > 0 and "graph_error" not in r
        bf16 = by[(measure, timing, "bf16")]["median_us"]
        if impl != "bf16":  # the ratio is the quotient of the same run's medians
            assert r["bf16_median_us"] == bf16 and r["speedup_vs_bf16"] == pytest.approx(bf16 / r["median_us"])
    swap = by[("fwd_bwd", "eager", "hf_detkit")]
    assert swap["speedup_vs_hf"] == pytest.approx(by[("fwd_bwd", "eager", "hf")]["median_us"] / swap["median_us"])
    for impl in ("bf16", "grouped_mm"):  # against the FP64 oracle
        v = by[("fwd", "eager", impl)]["validation"]
        assert max(x for k, x in v.items() if k.startswith("rel_l2_fp64_")) <= VALIDATE_REL_L2
    assert by[("fwd", "eager", "bf16")]["validation"]["repeat_bitwise_equal"] is True
    fp8 = by[("fwd_bwd", "eager", "fp8")]["validation"]
    assert fp8["gate_passed"] and fp8["repeat_bitwise_equal"] and fp8["gate_vs"] == ["fp64", "bf16_path"]
    for impl in moe.HF_IMPLS:
        v = by[("fwd", "eager", impl)]
        assert v["hf_experts_implementation"] == "grouped_mm" and v["scope"].startswith("block")
        assert max(x for k, x in v["validation"].items() if k.startswith("rel_l2_fp64_")) <= VALIDATE_REL_L2
    routed = by[("fwd", "eager", "hf_detkit")]["validation"]["mode_counters"]["routed"]
    assert routed["moe experts (transformers) -> detkit.moe_mlp"] >= 1  # the mode's block is on detkit's layer
    md = (out / "report.md").read_text()
    assert "**PASS**" in md and "## Side by side" in md and "capture failed (cpu stand-in)" in md


def test_sweep_points_carry_their_crossover_and_no_verdicts_on_the_interpreter(cpu_run):
    out, _ = cpu_run
    rows = read_rows(out)
    sweep = [r for r in rows if r["sweep"]]
    cpu = moe.CPU_SWEEP
    assert sorted({r["T"] for r in sweep}) == sorted(cpu["tokens"]) and len(sweep) == 4 * len(cpu["tokens"])
    for r in sweep:
        assert r["passed"] and r["median_us"] > 0 and r["measure"] == "fwd_bwd"
        if r["impl"] == "fp8":
            assert r["speedup_vs_bf16"] == pytest.approx(r["bf16_median_us"] / r["median_us"])
            assert r["validation"]["gate_vs"] == ["bf16_path"]
    meta = json.loads((out / "report.json").read_text())["meta"]
    derived = meta["derived"]
    assert "verdicts" not in derived and "no verdicts" in derived["note"] and "triton_interpreter" in meta["note"]
    assert [(s["timing"], [pt["T"] for pt in s["points"]]) for s in derived["sweep"]] == \
        [(tm, sorted(cpu["tokens"])) for tm in moe.TIMINGS]
    for s in derived["sweep"]:
        assert {"crossover_T_fit", "crossover_T_measured", "fp8_slower_at_T"} <= set(s)
        for pt in s["points"]:
            assert pt["speedup_fp8"] == pytest.approx(pt["bf16_median_us"] / pt["fp8_median_us"])
    assert "Not evaluated" in (out / "report.md").read_text()


def test_timed_rows_are_nvtx_ranges(cpu_run):
    out, log = cpu_run
    if log is None:
        pytest.skip("gcc not found: no NVTX injection library")
    names = [r["name"] for r in read_rows(out) if "median_us" in r]
    assert verify_nvtx_log(log, ["bench moe", *names], nesting=[("bench moe", n) for n in names]) == []
    pushes = [e for e in parse_injection_log(log) if e.kind == "push"]
    assert [e.depth for e in pushes if e.message == "bench moe"] == [1]


def test_a_perturbed_implementation_fails_its_own_rows(monkeypatch):
    """The baseline with its output scaled by 1.25 misses the FP64 oracle: its rows fail and are not timed, the BF16
    layer's rows pass and are timed; FP8 at the tiny preset (H, I not multiples of 128) is skipped with the reason."""
    from detkit.toolkit.benches import bench_context

    monkeypatch.setattr(moe, "torch_moe_fwd", lambda *a, **kw: torch_moe_fwd(*a, **kw) * 1.25)
    ctx = bench_context(moe, "cpu", ["tiny"], 1234, None, 1)
    options = {"impls": ("fp8", "grouped_mm"), "measures": ("fwd",), "no_stages": True}
    rows = list(moe.run(ctx, moe.cases(ctx, **options), **options))
    impls = ("bf16", "fp8", "grouped_mm")
    assert [(r["timing"], r["impl"]) for r in rows] == [(tm, i) for tm in moe.TIMINGS for i in impls]
    for r in rows:
        if r["impl"] == "grouped_mm":
            assert r["passed"] is r["validated"] is False and "median_us" not in r
            assert r["failure"].startswith("validation failed, not timed: grouped_mm")
            assert r["validation"]["rel_l2_fp64_out"] == pytest.approx(0.25, rel=0.05)
        elif r["impl"] == "fp8":
            assert r["passed"] and "multiples of 128" in r["skipped"] and "median_us" not in r
        else:
            assert r["passed"] and r["validated"] and r["median_us"] > 0
