"""``detkit bench moe-sweep`` (bench/moe_sweep.py) on the CPU: the skewed routing law, the performance-model
fit on synthetic data with known parameters, the kernel breakdown, the target verdicts, every refusal, and
the whole sweep at the tiny preset (uniform at two T, skewed at one: three cases, the most 2 CPU cores run
in about 30 s) run as two CLI processes in parallel under the NVTX injection library and merged into one
report (``--merge``). Interpreter timings are plumbing, not hardware results; the report's hardware path
is checked on rows shaped as a GPU run writes them (TFLOP/s, MFU, peak memory, fits, targets)."""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from click.testing import CliRunner

from detkit.bench import moe_sweep as ms
from detkit.bench.moe_common import INTERPRETER_LABEL, VALIDATE_REL_L2
from detkit.toolkit.presets import MOE_GPU_PRESETS as GPU_PRESETS
from detkit.toolkit.presets import MOE_PRESETS as PRESETS
from detkit.kernels.moe.layer import stage_name
from detkit.toolkit import cli, nvtx_ranges
from detkit.toolkit.nvtx_ranges import injection_env, verify_nvtx_log
from detkit.toolkit.records import INTERPRETER_BANNER
from tests.bench_helpers import bench_ctx as _ctx

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENS = {"uniform": (16, 32), "skewed": (16,)}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# Skewed routing
# ---------------------------------------------------------------------------------------------
def _inclusion_probability(p: np.ndarray) -> np.ndarray:
    """P(expert e among 2 draws without replacement, each proportional to p): p_e + sum_j p_j p_e/(1-p_j)."""
    out = p.copy()
    for j in range(len(p)):
        mask = np.arange(len(p)) != j
        out[mask] += p[j] * p[mask] / (1.0 - p[j])
    return out


def test_zipf_popularity_follows_the_documented_law():
    p = ms.zipf_popularity(6, seed=3).numpy()
    law = (np.arange(1, 7, dtype=np.float64) ** -ms.ZIPF_EXPONENT)
    np.testing.assert_allclose(np.sort(p)[::-1], law / law.sum(), rtol=1e-12)
    assert not np.array_equal(ms.zipf_popularity(32, 0).numpy(), ms.zipf_popularity(32, 1).numpy())


def test_skewed_ids_distinct_deterministic_and_skewed():
    t, e, k = 20000, 4, 2
    ids = ms.skewed_topk_ids(t, e, k, seed=5)
    assert ids.dtype == torch.int32 and ids.shape == (t, k)
    assert int(ids.min()) >= 0 and int(ids.max()) < e
    assert bool((ids[:, 0] != ids[:, 1]).all()), "ids of a row must be distinct"
    assert torch.equal(ids, ms.skewed_topk_ids(t, e, k, seed=5)), "same seed, same routing"
    assert not torch.equal(ids, ms.skewed_topk_ids(t, e, k, seed=6))
    # Per-expert rows against the exact inclusion probabilities: each count is a sum of T Bernoullis,
    # so 6 standard deviations never fail by chance (p ~ 1e-9) but a wrong law is far outside.
    expect = _inclusion_probability(ms.zipf_popularity(e, seed=5).numpy())
    counts = torch.bincount(ids.reshape(-1).long(), minlength=e).numpy()
    sigma = np.sqrt(t * expect * (1 - expect))
    assert (np.abs(counts - t * expect) <= 6 * sigma).all(), (counts, t * expect)
    stats = ms.routing_stats(ids, e)
    assert stats["imbalance"] == pytest.approx(expect.max() / expect.mean(), rel=0.02)
    uniform = ms.routing_stats(ms.make_case_inputs(ms.dataclasses.replace(PRESETS["tiny"], t=t), "uniform",
                                                   torch.device("cpu"), 5)["topk_ids"], e)
    assert stats["imbalance"] > 1.25 > 1.05 > uniform["imbalance"], (stats, uniform)


def test_skewed_with_k_equal_e_routes_every_token_to_every_expert():
    ids = ms.skewed_topk_ids(64, 8, 8, seed=0)  # the reference shape's E = K = 8
    assert torch.equal(ids.sort(dim=1).values, torch.arange(8, dtype=torch.int32).expand(64, 8))
    assert ms.routing_stats(ids, 8)["imbalance"] == 1.0
    with pytest.raises(ValueError, match="K <= E"):
        ms.skewed_topk_ids(4, 2, 3, seed=0)


# ---------------------------------------------------------------------------------------------
# Performance model
# ---------------------------------------------------------------------------------------------
TRUE = {"eta": 0.62, "a": 3.0e-13, "b": 4.0e-11, "c": 25e-6}


def _synthetic(presets=GPU_PRESETS, noise=0.0, seed=0) -> list[dict]:
    rng = np.random.default_rng(seed)
    cases = []
    for name in presets:
        p = PRESETS[name]
        for t in ms.SWEEP_TOKENS:
            row = {"name": f"{name} T={t}", "T": t, "H": p.h, "I": p.i, "E": p.e, "K": p.k,
                   "flops": 18.0 * t * p.k * p.h * p.i}
            secs = (row["flops"] / (989e12 * TRUE["eta"]) + TRUE["a"] * t * p.k * max(p.h, 2 * p.i)
                    + TRUE["b"] * p.e * t * p.k + TRUE["c"])
            row["median_us"] = secs * 1e6 * (1.0 + noise * rng.standard_normal())
            cases.append(row)
    return cases


def test_fit_recovers_known_parameters():
    fit = ms.fit_perf_model(_synthetic())
    assert fit["rank"] == 4 and fit["cases"] == 25 and not fit["exactly_determined"]
    assert fit["eta"] == pytest.approx(TRUE["eta"], rel=1e-6)
    assert fit["a_s_per_elem"] == pytest.approx(TRUE["a"], rel=1e-6)
    assert fit["b_s_per_route_expert"] == pytest.approx(TRUE["b"], rel=1e-6)
    assert fit["c_s"] == pytest.approx(TRUE["c"], rel=1e-6)
    assert fit["r2"] > 1 - 1e-12
    assert max(abs(r["rel_residual"]) for r in fit["residuals"]) < 1e-8


def test_fit_on_noisy_data_has_r2_below_one():
    cases = _synthetic(noise=0.03, seed=1)
    fit = ms.fit_perf_model(cases)
    assert 0.9 < fit["r2"] < 1.0
    assert fit["eta"] == pytest.approx(TRUE["eta"], rel=0.2)
    res = np.array([r["residual_us"] for r in fit["residuals"]])
    measured = np.array([c["median_us"] for c in cases])
    # Least squares with an intercept: residuals sum to zero and R^2 = 1 - SS_res / SS_tot.
    assert abs(res.sum()) < 1e-6 * measured.sum()
    assert fit["r2"] == pytest.approx(1 - (res ** 2).sum() / ((measured - measured.mean()) ** 2).sum(), rel=1e-9)


def test_fit_refuses_too_few_or_indistinguishable_cases():
    with pytest.raises(ValueError, match="got 3 case\\(s\\), need at least 4"):
        ms.fit_perf_model(_synthetic()[:3])
    # Two presets: every feature is a per-preset multiple of T, so only 3 directions (+ intercept).
    with pytest.raises(ValueError, match="feature rank 3 < 4"):
        ms.fit_perf_model(_synthetic(presets=("reference", "qwen3-30b-a3b")))
    bad = _synthetic()
    bad[0]["median_us"] = 0.0
    with pytest.raises(ValueError, match="positive finite times"):
        ms.fit_perf_model(bad)


# ---------------------------------------------------------------------------------------------
# Breakdown and targets
# ---------------------------------------------------------------------------------------------
def test_kernel_breakdown_counts_calls_and_shares():
    a = torch.randn(96, 96)

    def fn():
        return [a @ a for _ in range(3)] + [a.sum()]

    fn()  # warm, as run_case's calls are
    rows = ms.kernel_breakdown(fn, torch.device("cpu"), "breakdown probe")
    by = {r["kernel"]: r for r in rows}
    assert by["aten::mm"]["calls"] == 3 and by["aten::sum"]["calls"] == 1
    assert sum(r["share"] for r in rows) == pytest.approx(1.0, abs=1e-9)
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    assert all(x["total_us"] >= y["total_us"] for x, y in zip(rows, rows[1:]))


def test_cuda_breakdown_counts_kernels_once():
    """The CUDA branch on stand-in events (no GPU here): CPU ops and the GPU copies of record_function
    ranges (user annotations spanning their kernels) are left out; kernel intervals are summed."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(name, device, us, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(elapsed_us=lambda: us), self_cpu_time_total=us)

    kernel = "moe_grouped_gemm_kernel"
    events = [ev("aten::mm", DeviceType.CPU, 50.0), ev("moe_up_swiglu [..] bf16", DeviceType.CUDA, 300.0, True),
              ev(kernel, DeviceType.CUDA, 120.0), ev(kernel, DeviceType.CUDA, 180.0),
              ev("Memset (Device)", DeviceType.CUDA, 100.0)]
    rows = ms.aggregate_events(events, cuda=True)
    assert [(r["kernel"], r["calls"], r["total_us"], r["share"]) for r in rows] == [
        (kernel, 2, 300.0, 0.75), ("Memset (Device)", 1, 100.0, 0.25)]
    assert [r["kernel"] for r in ms.aggregate_events(events, cuda=False)] == ["aten::mm"]


def _target_row(preset, t, **fields):
    return {"preset": preset, "T": t, "routing": "uniform", "impl": "detkit", "measure": "fwd_bwd",
            "validated": True, **fields}


def test_target_verdicts_compare_against_the_thresholds():
    rows = [_target_row("reference", 8192, mfu_datasheet=0.56, speedup_vs_baseline=1.29),
            {**_target_row("reference", 8192, mfu_datasheet=0.9), "routing": "skewed"}]
    got = {v["target"]: v for v in ms.target_verdicts(rows, hardware_result=True)}
    labels = [t.label for t in ms.TARGETS]
    assert got[labels[0]]["verdict"] == "PASS" and got[labels[0]]["value"] == 0.56
    assert got[labels[2]]["verdict"] == "FAIL" and got[labels[2]]["value"] == 1.29
    assert got[labels[1]]["verdict"].startswith("NOT RUN") and got[labels[3]]["verdict"].startswith("NOT RUN")
    failed = [{**_target_row("qwen3-30b-a3b", 16384), "validated": False, "passed": False}]
    assert ms.target_verdicts(failed, True)[1]["verdict"] == "FAIL (validation failed)"
    assert all(v["verdict"].startswith("not evaluated (interpreter") for v in ms.target_verdicts(rows, False))


# ---------------------------------------------------------------------------------------------
# Refusals before any work
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("presets, tokens, routings, message", [
    (["tiny"], [0], ["uniform"], "T=\\[0\\] not supported"),
    (["tiny"], [16, -3], ["uniform"], "T=\\[-3\\] not supported"),
    (["tiny"], [16.0], ["uniform"], "T=\\[16.0\\] not supported"),
    (["nope"], [16], ["uniform"], "preset\\(s\\) \\['nope'\\] not known; known: "),
    (["tiny"], [16], ["zipf"], "routing\\(s\\) \\['zipf'\\] not known; supported: \\('uniform', 'skewed'\\)"),
    (["tiny"], [16, 16], ["uniform"], "T values repeat"),
    (["mixtral-8x7b"], [2**20], ["uniform"], "beyond the kernels' 32-bit offsets"),
])
def test_bad_selection_refused_by_cases(presets, tokens, routings, message):
    with pytest.raises(ValueError, match=message):
        ms.cases(_ctx(presets), tokens=tokens, routings=routings)


def test_cases_defaults_and_names():
    got = ms.cases(_ctx(), tokens=(), routings=())
    p = PRESETS["tiny"]
    assert [c.name for c in got] == [ms.row_name(ms.dataclasses.replace(p, t=t), r, m, i) for t in ms.CPU_TOKENS
                                     for r in ms.ROUTINGS for m in ms.MEASURES for i in ms.IMPLS]
    quick = ms.cases(_ctx(interpreted=False), quick=True)
    assert {(c.preset, c.t) for c in quick} == {(n, t) for n in ms.QUICK_PRESETS for t in ms.QUICK_TOKENS}
    with pytest.raises(ValueError, match="--quick is a GPU run"):
        ms.cases(_ctx(), quick=True)


@pytest.mark.parametrize("exponent", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_zipf_exponent_refused(exponent):
    with pytest.raises(ValueError, match="zipf exponent .* not supported; it must be a finite number > 0"):
        ms.check_selection(["tiny"], [16], ["skewed"], exponent)


def test_cli_usage_errors_write_nothing(tmp_path, monkeypatch):
    out = tmp_path / "o"
    for args, message in ((["--tokens", "0"], "T=[0] not supported"), (["--preset", "nope"], "not known"),
                          (["--routing", "zipf"], "'zipf' is not one of"), (["--quick"], "--quick is a GPU run"),
                          (["--zipf-exponent", "0"], "zipf exponent 0.0 not supported"),
                          (["--rounds", "0"], "--rounds must be >= 1; got 0")):
        result = CliRunner().invoke(cli.main, ["bench", "moe-sweep", "--device", "cpu", "--out", str(out), *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# The sweep end to end: two CLI processes (uniform / skewed) in parallel, then merged
# ---------------------------------------------------------------------------------------------
def _cmd(out: Path, routing: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "detkit", "bench", "moe-sweep", "--device", "cpu", "--out", str(out), "--preset",
            "tiny", *(a for t in TOKENS[routing] for a in ("--tokens", str(t))), "--routing", routing, "--rounds", "1",
            *extra]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        pytest.skip("gcc not found: cannot build the NVTX injection library")
    tmp = tmp_path_factory.mktemp("moe_sweep")
    lib = nvtx_ranges.build_injection_library(tmp / "nvtx_build")
    env = {k: v for k, v in os.environ.items() if k not in ("NVTX_INJECTION64_PATH", "DETKIT_NVTX_LOG")}
    env.update({"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)})
    # Two cases and no profile in one process, one case and the profile in the other: balanced.
    runs = {"uniform": _cmd(tmp / "uniform", "uniform", "--no-profile"), "skewed": _cmd(tmp / "skewed", "skewed")}
    procs = {name: subprocess.Popen(cmd, cwd=REPO_ROOT, env={**env, **injection_env(lib, tmp / f"{name}.log")},
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, cmd in runs.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} sweep failed (rc={proc.returncode}):\n{err[-4000:]}"
    merged = tmp / "merged"
    result = CliRunner().invoke(cli.main, ["bench", "moe-sweep", "--merge", str(tmp / "uniform"), "--merge",
                                           str(tmp / "skewed"), "--out", str(merged)])
    assert result.exit_code == 0, result.output
    return {"tmp": tmp, "runs": runs, "merged": merged, "results": json.loads((merged / "report.json").read_text())}


def test_sweep_rows_complete_validated_and_consistent(sweep):
    rows = sweep["results"]["rows"]
    p = PRESETS["tiny"]
    expect = [ms.row_name(ms.dataclasses.replace(p, t=t), routing, measure, impl)
              for routing in ms.ROUTINGS for t in TOKENS[routing] for measure in ms.MEASURES for impl in ms.IMPLS]
    assert sorted(r["name"] for r in rows) == sorted(expect)
    jsonl = [json.loads(line) for name in ("uniform", "skewed")
             for line in (sweep["tmp"] / name / "rows.jsonl").read_text().splitlines()]
    assert jsonl == rows  # the merged report holds every row of its runs, as they wrote them
    by = {(r["T"], r["routing"], r["measure"], r["impl"]): r for r in rows}
    for r in rows:
        assert r["passed"] and r["validated"] and r["repeat_bitwise_equal"], r["name"]
        assert r["baseline_bwd_only_rel_l2"] <= VALIDATE_REL_L2
        assert r["hardware_result"] is False and r["backend"] == "triton_interpreter"
        assert r["note"] == INTERPRETER_LABEL
        assert not any(k in r for k in ("tflops", "mfu_datasheet", "mfu_measured")), r["name"]
        assert r["flops"] == {"fwd": 6, "bwd": 12, "fwd_bwd": 18}[r["measure"]] * r["T"] * p.k * p.h * p.i  # documented
        assert r["p20_us"] <= r["median_us"] <= r["p80_us"] and r["samples"] >= 1
        if r["measure"] == "fwd_bwd":
            assert r["peak_memory_bytes"] == ms.NOT_ON_CPU
        if r["impl"] == "detkit":
            base = by[(r["T"], r["routing"], r["measure"], "baseline")]
            assert math.isfinite(r["ratio_vs_baseline"]) and r["ratio_vs_baseline"] > 0
            assert r["ratio_vs_baseline"] == pytest.approx(r["median_us"] / base["median_us"], rel=1e-12)
            assert r["speedup_vs_baseline"] == pytest.approx(1 / r["ratio_vs_baseline"], rel=1e-12)
        # The routing statistics the rows carry are those of the case's regenerated inputs.
        inp = ms.make_case_inputs(ms.dataclasses.replace(p, t=r["T"]), r["routing"], torch.device("cpu"), r["seed"])
        assert {k: r[k] for k in ms.routing_stats(inp["topk_ids"], p.e)} == ms.routing_stats(inp["topk_ids"], p.e)
        assert (r["zipf_exponent"] == ms.ZIPF_EXPONENT) == (r["routing"] == "skewed")


def test_sweep_nvtx_ranges_are_the_row_names(sweep):
    rows = sweep["results"]["rows"]
    for routing in ("uniform", "skewed"):
        sel = [r for r in rows if r["routing"] == routing]
        t = TOKENS[routing][0]
        stage = stage_name("moe_up_swiglu", T=t, H=32, I=48, E=4, K=2)
        parent = ms.row_name(ms.dataclasses.replace(PRESETS["tiny"], t=t), routing, "fwd", "detkit")
        problems = verify_nvtx_log(sweep["tmp"] / f"{routing}.log", [r["name"] for r in sel],
                                   nesting=[(parent, stage)])
        assert not problems, problems[:10]


def test_sweep_report_files_and_labels(sweep):
    merged, results = sweep["merged"], sweep["results"]
    for name in ("rows.jsonl", "report.json", "report.md", "mfu_vs_T_tiny.png"):
        assert (merged / name).is_file(), name
    assert (merged / "mfu_vs_T_tiny.png").read_bytes()[:8] == PNG_MAGIC
    report = (merged / "report.md").read_text()
    assert INTERPRETER_BANNER in report and "interpreter wall time, not a hardware result" in report
    assert "MFU" not in report.split("## Forward + backward")[1].split("## Performance model")[0]
    derived = results["meta"]["derived"]
    for v in derived["targets"]:
        assert v["verdict"] == "not evaluated (interpreter, not a hardware result)" and v["verdict"] in report
    # Each source run records its exact command line and its sources, and the merged report lists them.
    sources = results["meta"]["merged_from"]
    assert [shlex.split(s["command_line"])[1:] for s in sources] == [cmd[3:] for cmd in sweep["runs"].values()]
    assert all(s["command_line"] in report and s["source"]["digest"].startswith("sha256:") for s in sources)
    assert results["meta"]["config_tables"] == json.loads((sweep["tmp"] / "uniform" / "report.json").read_text())[
        "meta"]["config_tables"]
    single = (sweep["tmp"] / "uniform" / "report.md").read_text()
    assert f"`{sources[0]['command_line']}`" in single and "## Environment" in single
    assert (sweep["tmp"] / "skewed" / "mfu_vs_T_tiny.png").read_bytes()[:8] == PNG_MAGIC
    assert "## Per-kernel time" in (sweep["tmp"] / "skewed" / "report.md").read_text()
    assert "## Per-kernel time" not in single


def test_sweep_fits_refused_with_reasons_and_breakdown_shares(sweep):
    fits = {(f["measure"], f["routing"]): f for f in sweep["results"]["meta"]["derived"]["fits"]}
    assert set(fits) == {(m, r) for m in ("fwd_bwd", "fwd") for r in ("uniform", "skewed", "all")}
    for (measure, routing), fit in fits.items():  # 2, 1 and 3 cases: fewer than the 4 parameters
        n = len(TOKENS[routing]) if routing != "all" else sum(map(len, TOKENS.values()))
        assert f"got {n} case(s), need at least 4" in fit["error"] and "eta" not in fit, (measure, routing)
    profiled = [r for r in sweep["results"]["rows"] if "breakdown" in r]
    # Only the skewed run profiled (no uniform case in it; the uniform one ran --no-profile), at its largest T,
    # one fwd_bwd call per implementation.
    t = max(TOKENS["skewed"])
    assert {(r["T"], r["routing"], r["measure"], r["impl"]) for r in profiled} == {
        (t, "skewed", "fwd_bwd", i) for i in ms.IMPLS}
    for r in profiled:
        assert sum(b["share"] for b in r["breakdown"]) == pytest.approx(1.0, abs=1e-9)
        assert all(b["activity"] == "cpu" for b in r["breakdown"])
    detkit = {b["kernel"] for r in profiled if r["impl"] == "detkit" for b in r["breakdown"]}
    assert stage_name("moe_wgrad", T=t, H=32, I=48, E=4, K=2) in detkit  # the stage ranges


def _hardware_rows() -> list[dict]:
    """Rows shaped as a GPU run writes them, timed by the model with TRUE parameters (detkit) and
    1.4x slower (baseline): the report's hardware path, which only a GPU run reaches otherwise."""
    rows = []
    for case in _synthetic(presets=("reference", "qwen3-30b-a3b", "olmoe")):
        preset = case["name"].split(" T=")[0]
        p = ms.dataclasses.replace(PRESETS[preset], t=case["T"])
        for routing in ms.ROUTINGS:
            for measure in ms.MEASURES:
                flops = p.flops(measure)
                det_us = case["median_us"] * flops / case["flops"] if measure != "fwd_bwd" else case["median_us"]
                for impl, us in (("detkit", det_us), ("baseline", 1.4 * det_us)):
                    tflops = flops / (us * 1e-6) / 1e12
                    row = {"name": ms.row_name(p, routing, measure, impl), "preset": preset, "T": p.t, "H": p.h,
                           "I": p.i, "E": p.e, "K": p.k, "routing": routing, "measure": measure, "impl": impl,
                           "flops": flops, "median_us": us, "p20_us": us, "p80_us": us, "samples": 5,
                           "validated": True, "hardware_result": True, "tflops": tflops,
                           "mfu_datasheet": tflops / 989.0, "mfu_measured": tflops / 800.0,
                           "peak_memory_bytes": 2**30, "imbalance": 1.0, "passed": True}
                    if impl == "detkit":
                        row.update({"ratio_vs_baseline": 1 / 1.4, "speedup_vs_baseline": 1.4})
                    rows.append(row)
    return rows


def test_hardware_report_path_fits_targets_and_plots(tmp_path):
    rows = _hardware_rows()
    meta = {"hardware_result": True, "measured_ceiling_tflops": 800.0}
    derived = ms.derive(rows, meta)
    fit = next(f for f in derived["fits"] if (f["measure"], f["routing"]) == ("fwd_bwd", "uniform"))
    assert fit["cases"] == 15 and fit["eta"] == pytest.approx(TRUE["eta"], rel=1e-6) and fit["r2"] > 1 - 1e-12
    by = {(r["preset"], r["T"], r["routing"], r["measure"], r["impl"]): r for r in rows}
    for v in derived["targets"]:
        got = by[(v["preset"], v["T"], "uniform", "fwd_bwd", "detkit")]
        field = "mfu_datasheet" if "MFU" in v["target"] else "speedup_vs_baseline"
        assert v["value"] == got[field] and v["verdict"] == ("PASS" if got[field] >= v["minimum"] else "FAIL")
    report = ms.summarize(rows, {**meta, "derived": derived})
    assert "detkit_mfu_989" in report and "detkit_mfu_ceiling" in report and "not a hardware result" not in report
    assert "NOT RUN" not in report and "baseline_peak_MiB" in report
    paths = ms.plots(tmp_path, rows)
    assert [p.name for p in paths] == [f"mfu_vs_T_{p}.png" for p in ("reference", "qwen3-30b-a3b", "olmoe")]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in paths)
