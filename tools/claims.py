"""The claims table in README.md and reports/INDEX.md, generated from the committed reports.

    python -m tools.claims            # rewrite both from reports/
    python -m tools.claims --check    # exit 1 when README.md's table or reports/INDEX.md differs

Every number in the table is read from a committed report file (report.json, rows.json, a rows
.jsonl) by a small function below, and every "met" is a rule applied to that number, so a count or a
ratio cannot drift from the run it names. Which run backs which claim is the SOURCES map: pointing a
claim at a newer run is a one-line edit there, then `python -m tools.claims`.

reports/INDEX.md has one line per report folder: its dates and device (from the reports' meta), and
the runs kept in the tree with the command (from the reports' meta) and the commit whose files ran
(from the folder README's "Kept in the tree" list, checked against the commit a report declares).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BEGIN = "<!-- claims:begin -->"
END = "<!-- claims:end -->"

# Which committed run backs each claim (paths under reports/). To move a claim to a newer run, change
# its line here and run `python -m tools.claims`.
SOURCES = {
    "gemm_audit": "2026-12-02-h200-s15/call1/audit-gemm-tp2/report.json",
    "gemm_audit_zoo": "2026-12-02-h200-s15/call2/audit-gemm-zoo/report.json",
    "gemm_bench": "2026-12-01-h200/call3/bench/gemm.jsonl",
    "gemm_tp2": "2026-12-01-h200-s14/call4/tp2/report.json",
    "gemm_zoo": "2026-12-01-h200-s14/call4/zoo/report.json",
    "tp_group": "2026-11-29-h200x2/tp-group/report.json",
    "cp_group": "2026-11-29-h200x2/cp-group/report.json",
    "nccl_sweep": "2026-11-29-h200x2/nccl-sweep/sweep.json",
    "comm": "2026-11-29-h200x2/comm/comm.jsonl",
    "inv_tp": "2026-11-29-h200x2/inv-tp/report.json",
    "inv_cp": "2026-11-29-h200x2/inv-cp/report.json",
    "mlp_tp": "2026-11-29-h200x2/mlp-tp/mlp.jsonl",
    "mlp_cp": "2026-11-29-h200x2/mlp-cp/mlp.jsonl",
    "moe_audit": "2026-12-02-h200-s18/call4/moe-bits/audit-moe/report.json",  # suites moe and moe-fp8 in one report
    "moe_sweep": "2026-12-01-h200-s12/call5/moe-sweep/rows.json",
    "moe_fp8_bench": "2026-12-01-h200-s12/call3/bench-moe-fp8/fp8_rows.json",
    "moe_bench": "2026-12-02-h200-s18/call3/bench/report.json",
    "moe_bench_bf16": "2026-12-02-h200-s18/call4/bench/report.json",  # the same layer code again, BF16 only
    # The same BF16 layer code a third time (that run's FP8 rows had a dgrad tile that was not kept).
    "moe_bench_bf16_third": "2026-12-02-h200-s18/call5/bench/report.json",
    # ... and twice more in s19 (its FP8 rows: a reverted dgrad tile, then the quantizers of 46237ca).
    "moe_bench_bf16_s19": "2026-12-02-h200-s19/call5/bench/report.json",
    "moe_bench_bf16_s19_again": "2026-12-02-h200-s19/call7/bench/report.json",
    # s20: the same BF16 layer code three more times; call 7's FP8 rows are the landed code (weight quantizer of
    # 2ee8cc3), call 3's and call 6's FP8 rows the quantizer before it.
    "moe_bench_s20": "2026-12-02-h200-s20/call7/bench/report.json",
    "moe_bench_bf16_s20": "2026-12-02-h200-s20/call3/moe-bench/moe/report.json",
    "moe_bench_bf16_s20_again": "2026-12-02-h200-s20/call6/bench/report.json",
    # s21: the same kernels launched through launch plans (a host-path change).
    "moe_bench_s21": "2026-12-02-h200-s21/call2/bench/report.json",
    # s22: the FP8 column-wise quantizer in Gluon and the dgrad's paired E4M3 conversion (call 2: the landed FP8 code);
    # call 6: the same BF16 code again (its FP8 rows: expert-ordered A rows for up and dgrad, not kept).
    "moe_bench_s22": "2026-12-02-h200-s22/call2/bench/report.json",
    "moe_bench_bf16_s22": "2026-12-02-h200-s22/call6/bench/report.json",
    # s23: the token-major scale pass (BF16 backward); its FP8 rows are the s22 FP8 code against that BF16 layer.
    "moe_bench_s23": "2026-12-02-h200-s23/call3/bench/report.json",
    "moe_bench_30b16k_s23": "2026-12-02-h200-s23/call3/bench-30b16k/report.json",
    # ... and the landed s23 layer: the FP8 column-wise quantizer visiting the experts' blocks side by side.
    "moe_bench_s23_landed": "2026-12-02-h200-s23/call5/bench/report.json",
    # s24: the same layer code as s23's landed run (only comments changed): every GPU preset, and the full sweep
    # (E 8/32/64/128, K 2/4/8, T 2048/8192/16384) one width per report.
    "moe_bench_s24": "2026-12-03-h200-s24/call1/bench/report.json",
    "moe_bench_sweep_s24_3072": "2026-12-03-h200-s24/call1/sweep-3072/report.json",
    "moe_bench_sweep_s24_2048": "2026-12-03-h200-s24/call1/sweep-2048/report.json",
    # The Qwen3-30B-A3B T=16384 sweep point, twice (the same layer code as the two above).
    "moe_bench_30b16k": "2026-12-02-h200-s18/call3/bench-30b16k/report.json",
    "moe_bench_30b16k_again": "2026-12-02-h200-s18/call4/bench-30b16k/report.json",
    # The sweep on the s19 layer (its Qwen3-30B-A3B T=16384 point is the BF16 code of the 30b16k runs above).
    "moe_bench_sweep": "2026-12-02-h200-s20/call3/moe-bench/moe-sweep/report.json",
    # The sweep on the layer with launch plans (s21; the same kernels as s20's).
    "moe_bench_sweep_s21": "2026-12-02-h200-s21/call3/moe-sweep/report.json",
    # The sweep on the landed s22 layer.
    "moe_bench_sweep_s22": "2026-12-02-h200-s22/call7/moe-sweep/report.json",
    "model_audit": "2026-12-01-h200-s14/call4/model-audit/report.json",
    "model_bench": "2026-12-07-h100-s32/call3/qwen3-L2/report.json",
    "model_audit_moe": "2026-12-02-h200-s16/call6/moe-model/model-audit/report.json",
    "model_audit_moe_fp8": "2026-12-02-h200-s16/call7/moe-model-fp8/model-audit-fp8/report.json",
    # The FP8 model audit with the captured decode step on static FP8 weights (s24, fp8_graph_weights="static").
    "model_audit_moe_fp8_static": "2026-12-03-h200-s24/call5/model-audit-fp8-static/report.json",
    "moe_block_bench": "2026-12-02-h200-s16/call5/moe-block/bench-block/report.json",
    "attn_audit": "2026-12-01-h200-s13/call4/attn-audit/report.json",
    "attn_bench": "2026-12-07-h100-s32/call2/attn-bench/report.json",
}


class ClaimError(Exception):
    """A report is missing, malformed, or inconsistent with itself."""


@dataclass(frozen=True)
class Measured:
    value: Any  # what the claim's rule judges
    text: str  # what the table shows


@dataclass(frozen=True)
class Claim:
    claim: str
    target: str
    sources: tuple[str, ...]  # keys of SOURCES, passed to `measure` in this order
    measure: Callable[..., Measured]
    met: Callable[[Any], bool]


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def load(path: Path) -> Any:
    """A .json file, or a .jsonl file as a list of its rows."""
    if not path.is_file():
        raise ClaimError(f"{path}: no such report file")
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ClaimError(f"{path}: not valid JSON ({exc})") from exc


def human_report(reports: Path, rel: str) -> str:
    """The file a reader should open for a source: the run's markdown report beside it, else the source."""
    src = reports / rel
    stem = src.stem.removesuffix("_rows")
    for name in ("report.md", f"{stem}.md", f"{stem}_report.md"):
        if (src.parent / name).is_file():
            return str(Path(rel).parent / name)
    return rel


# ---------------------------------------------------------------------------------------------
# Measures: one small function per kind of evidence
# ---------------------------------------------------------------------------------------------
def _span(values: list[float], fmt: str, unit: str = "") -> str:
    lo, hi = min(values), max(values)
    if format(lo, fmt) == format(hi, fmt):
        return f"{lo:{fmt}}{unit}"
    return f"{lo:{fmt}}-{hi:{fmt}}{unit}"


def audit_counts(report: dict, suite: str | None = None) -> tuple[int, int]:
    """Passed and failed checks of an audit report.json, of one suite when ``suite`` is given (a report of
    several suites counts each apart); its summary must agree with its rows."""
    summary = [s for s in report["summary"] if suite is None or s["suite"] == suite]
    rows = [r for r in report["rows"] if suite is None or r["suite"] == suite]
    if not rows:
        raise ClaimError(f"no rows of suite {suite!r} (the report holds {sorted({r['suite'] for r in report['rows']})})")
    passed = sum(s["passed"] for s in summary)
    failed = sum(s["failed"] for s in summary)
    rows_passed = sum(1 for r in rows if r["passed"])
    if (passed, failed) != (rows_passed, len(rows) - rows_passed):
        raise ClaimError(f"summary says {passed} passed, {failed} failed; rows say {rows_passed} passed, "
                         f"{len(rows) - rows_passed} failed")
    return passed, failed


def audit(report: dict) -> Measured:
    passed, failed = audit_counts(report)
    return Measured((passed, failed), f"{passed} passed, {failed} failed")


def audits_named(*names: str) -> Callable[..., Measured]:
    """The checks of several audit reports, one ``name`` each (in SOURCES order): summed, and shown per report."""
    def measure(*reports: dict) -> Measured:
        counts = [audit_counts(r) for r in reports]
        text = "; ".join(f"{name} {p} passed, {f} failed" for name, (p, f) in zip(names, counts))
        return Measured((sum(p for p, _ in counts), sum(f for _, f in counts)), text)
    return measure


def moe_block_speedups(report: dict) -> Measured:
    """bench moe's speedup_vs_hf of transformers' block under the mode (hf_detkit) against its own block (hf), every
    (preset, measure, timing) row: the lowest, and how many are faster."""
    rows = [r for r in report["rows"] if r.get("impl") == "hf_detkit" and "speedup_vs_hf" in r]
    if not rows:
        raise ClaimError("no hf_detkit rows with speedup_vs_hf")
    for r in rows:
        if abs(r["hf_median_us"] / r["median_us"] - r["speedup_vs_hf"]) > 1e-6 * r["speedup_vs_hf"]:
            raise ClaimError(f"{r['name']}: speedup_vs_hf disagrees with its medians")
    values = [r["speedup_vs_hf"] for r in rows]
    faster = sum(v > 1 for v in values)
    worst = min(rows, key=lambda r: r["speedup_vs_hf"])
    text = (f"{_span(values, '.2f', 'x')}; faster in {faster} of {len(rows)} (preset, fwd or fwd+bwd, eager or "
            f"graph); lowest {worst['preset']} {worst['measure']} ({worst['timing']})")
    return Measured((faster, len(rows)), text)


def audit_suite(suite: str) -> Callable[[dict], Measured]:
    """The checks of one suite of an audit report that ran several (``--suite moe --suite moe-fp8``)."""
    def measure(report: dict) -> Measured:
        passed, failed = audit_counts(report, suite)
        return Measured((passed, failed), f"{passed} passed, {failed} failed (suite {suite})")
    return measure


def all_pass(value: tuple[int, int]) -> bool:
    passed, failed = value
    return passed > 0 and failed == 0


def gemm_vs_nosplitk(limit: float) -> Callable[[list[dict]], Measured]:
    def measure(rows: list[dict]) -> Measured:
        ratios = [r["ratio_vs_cublaslt_nosplitk"] for r in rows]
        over = sum(1 for x in ratios if x > limit)
        return Measured(max(ratios), f"worst {max(ratios):.2f}x; {over} of {len(ratios)} rows above {limit:.2f}x")
    return measure


def nccl_sweep(sweep: dict) -> Measured:
    inputs = {name for per_setting in sweep["results"].values() for name in per_setting}
    ok = bool(sweep["all_settings_agree"] and sweep["all_equal_v1_oracle"] and not sweep["failures"])
    text = (f"{len(sweep['results'])} settings x {len(inputs)} inputs: "
            + ("one digest per input, each equal to the oracle" if ok else f"{len(sweep['failures'])} failures"))
    return Measured(ok, text)


def comm_vs_raw(rows: list[dict]) -> Measured:
    per_op: dict[str, list[float]] = {}
    for r in rows:
        if r["target_applies"]:
            per_op.setdefault(r["impl"], []).append(r["ratio_vs_raw"])
    if not per_op:
        raise ClaimError("no bench comm rows at the target sizes")
    worst = max(max(v) for v in per_op.values())
    medians = [statistics.median(v) for v in per_op.values()]
    return Measured(worst, f"worst {worst:.3f}x; median {_span(medians, '.3f', 'x')} per operator")


def invariance(inv_tp: dict, inv_cp: dict) -> Measured:
    entries = [e for rep in (inv_tp, inv_cp) for e in rep["meta"]["invariance_drift_table"]
               if e["mode"] == "fp32_invariant"]
    if not entries:
        raise ClaimError("no fp32_invariant entries in the invariance drift tables")
    mismatched = sum(e["mismatched_bytes"] for e in entries)
    (p_tp, f_tp), (p_cp, f_cp) = audit_counts(inv_tp), audit_counts(inv_cp)
    pairs = sorted({e["pair"] for e in entries})
    text = (f"{mismatched} mismatched bytes in {len(entries)} tensors ({'; '.join(pairs)}); "
            f"audits {p_tp} + {p_cp} passed, {f_tp + f_cp} failed")
    return Measured((mismatched, f_tp + f_cp), text)


def mlp_ratio(field: str) -> Callable[..., Measured]:
    def measure(*sources: list[dict]) -> Measured:
        values = [r[field] for rows in sources for r in rows if r.get(field) is not None]
        if not values:
            raise ClaimError(f"no bench mlp rows carry {field}")
        return Measured(max(values), f"{_span(values, '.2f', 'x')} over {len(values)} (config, M)")
    return measure


def moe_sweep_target(preset: str, tokens: int, kind: str) -> Callable[[dict], Measured]:
    """One entry of bench moe_sweep's targets list: kind "MFU" (of 989 TFLOP/s) or "speedup" (vs torch)."""
    def measure(sweep: dict) -> Measured:
        hits = [t for t in sweep["targets"]
                if t["preset"] == preset and t["T"] == tokens and t["target"].startswith(kind)]
        if len(hits) != 1:
            raise ClaimError(f"{len(hits)} moe_sweep targets match {kind} at {preset} T={tokens}")
        value = hits[0]["value"]
        return Measured(value, f"{value:.1%}" if kind == "MFU" else f"{value:.2f}x")
    return measure


def moe_bench_verdicts(target: str) -> Callable[..., Measured]:
    """bench moe's verdicts of one target (meta.derived.verdicts; the cases it ran, eager and CUDA graph), over one
    run or several of the same code: the lowest value, and how many (case, timing, run) met the target's minimum."""
    def measure(*reports: dict) -> Measured:
        hits = [v for report in reports for v in (_derived(report, "verdicts") or [])
                if v["target"] == target and v["value"] is not None]
        if not hits:
            raise ClaimError(f"no bench moe verdicts of {target!r} with a value")
        for v in hits:
            if (v["value"] >= v["minimum"]) != (v["verdict"] == "PASS"):
                raise ClaimError(f"verdict {v['verdict']} disagrees with value {v['value']} at {v['case']}")
        worst = min(hits, key=lambda v: v["value"])
        passed = sum(v["verdict"] == "PASS" for v in hits)
        fmt = ".1%" if worst["minimum"] < 1 else ".3f"
        suffix = "" if worst["minimum"] < 1 else "x"
        runs = f", {len(reports)} runs" if len(reports) > 1 else ""
        text = (f"{_span([v['value'] for v in hits], fmt, suffix)}; met by {passed} of {len(hits)} "
                f"(case, eager/graph{runs}); lowest {worst['case']} ({worst['timing']})")
        return Measured((passed, len(hits)), text)
    return measure


FP8_GATE = (0.997, 0.076)  # cosine >= 0.997 and relative RMSE < 7.6% against FP64, every output


def fp8_gate(bench: dict) -> Measured:
    cases = [r for r in bench["rows"] if r.get("measure") == "fwd_bwd" and "wgrad_bf16" in r]
    if not cases:
        raise ClaimError("no validated fwd_bwd rows in the FP8 bench")
    checks = [r[mode] for r in cases for mode in ("wgrad_bf16", "wgrad_fp8")]
    precision = [p for c in checks for p in c["precision"].values()]
    cos = min(p["cosine_fp64"] for p in precision)
    rmse = max(p["rel_rmse_fp64"] for p in precision)
    passed = sum(1 for c in checks if c["gate_passed"])
    text = (f"{passed} of {len(checks)} passed ({len(cases)} cases x 2 weight-gradient modes); "
            f"worst cosine {cos:.4f}, relative RMSE {rmse:.2%}")
    return Measured((passed == len(checks), cos, rmse), text)


def fp8_gate_met(value: tuple[bool, float, float]) -> bool:
    all_passed, cos, rmse = value
    return all_passed and cos >= FP8_GATE[0] and rmse < FP8_GATE[1]


# bench gemm's targets (detkit / cuBLAS), as bench/gemm.py states them: the host and eager ratio on every row;
# per (op, K, N, layout), the GPU-time (CUDA-graph) median over M >= 1024 and over M <= 256, and the worst row.
GEMM_HOST_MAX, GEMM_EAGER_MAX = 1.2, 1.10
GEMM_GRAPH = {"large_m": (1024, 1.05), "small_m": (256, 1.25), "worst": 1.5}


def _derived(report: dict, key: str) -> dict | None:
    return ((report.get("meta") or {}).get("derived") or {}).get(key)


def gemm_per_row(timing: str, limit: float) -> Callable[[dict], Measured]:
    """bench gemm's ``ratio_<timing>`` (host: Python time per call; eager: back-to-back time per call) on every
    row; the run's own count (meta.derived) must agree."""
    def measure(report: dict) -> Measured:
        key = f"ratio_{timing}"
        rows = [r for r in report["rows"] if key in r]
        if not rows:
            raise ClaimError(f"no bench gemm rows carry {key}")
        within = sum(1 for r in rows if r[key] <= limit)
        worst = max(rows, key=lambda r: r[key])
        derived = _derived(report, timing)
        if derived and (derived["met"], derived["rows"]) != (within, len(rows)):
            raise ClaimError(f"meta.derived.{timing} says {derived['met']} of {derived['rows']} rows within "
                             f"{limit}x; the rows say {within} of {len(rows)}")
        text = f"within on {within} of {len(rows)} rows, worst {worst[key]:.2f}x (M={worst['M']})"
        if timing == "host":  # a call's host time hardly depends on M: the spans say what a call costs
            det = [r["detkit_host_median_us"] for r in rows]
            ref = [r["cublas_host_median_us"] for r in rows]
            text = f"{_span(det, '.0f', ' µs')} vs {_span(ref, '.0f', ' µs')}; {text}"
        return Measured(within == len(rows), text)
    return measure


def gemm_graph_groups(rows: list[dict]) -> dict[tuple, bool]:
    """Per (op, K, N, layout): whether its GPU-time ratios meet GEMM_GRAPH."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "ratio_graph" in r:
            groups.setdefault((r["op"], r["K"], r["N"], r["layout"]), []).append(r)
    if not groups:
        raise ClaimError("no bench gemm rows carry ratio_graph")
    met = {}
    for key, sel in groups.items():
        ok = max(r["ratio_graph"] for r in sel) <= GEMM_GRAPH["worst"]
        for m_limit, target, pick in ((*GEMM_GRAPH["large_m"], lambda m, lim: m >= lim),
                                      (*GEMM_GRAPH["small_m"], lambda m, lim: m <= lim)):
            ratios = [r["ratio_graph"] for r in sel if pick(r["M"], m_limit)]
            ok = ok and (not ratios or statistics.median(ratios) <= target)
        met[key] = ok
    return met


def gemm_graph_targets(report: dict) -> Measured:
    met = gemm_graph_groups(report["rows"])
    n_met = sum(met.values())
    derived = _derived(report, "graph")
    if derived and (derived["met"], derived["groups"]) != (n_met, len(met)):
        raise ClaimError(f"meta.derived.graph says {derived['met']} of {derived['groups']} met; "
                         f"the rows say {n_met} of {len(met)}")
    ratios = [r["ratio_graph"] for r in report["rows"] if "ratio_graph" in r]
    worst = max(report["rows"], key=lambda r: r.get("ratio_graph", 0.0))
    text = (f"met by {n_met} of {len(met)} (op, K, N) over {len(ratios)} rows; worst row {worst['ratio_graph']:.2f}x "
            f"({worst['op']} M={worst['M']} N={worst['N']} K={worst['K']})")
    return Measured((n_met, len(met)), text)


def gemm_graph_targets_of(layers: str):
    """gemm_graph_targets over the rows of one model's layers (a zoo report's rows name the layers of their shape)."""
    def measure(report: dict) -> Measured:
        rows = [r for r in report["rows"] if any(layer.startswith(layers + " ") for layer in r.get("layers") or ())]
        if not rows:
            raise ClaimError(f"no rows of {layers!r} layers")
        return gemm_graph_targets({"rows": rows, "meta": {}})
    return measure


def model_audit(report: dict) -> Measured:
    """The model audit's counts, and what its decode_vs_trainer rows compared in detkit mode (rows whose
    ``details`` say ``informational`` record default mode's drift, and in reports from before `detkit bench model`
    the speed ratios: they pass by design)."""
    passed, failed = audit_counts(report)
    informational = sum(1 for r in report["rows"] if (r.get("details") or {}).get("informational"))
    decode = [r for r in report["rows"] if r["check"] == "decode_vs_trainer"]
    if not decode:
        raise ClaimError("no decode_vs_trainer rows")
    compared = sum(r["details"]["elements"] for r in decode)
    differing = sum(r["details"]["mismatches"] for r in decode)
    kinds = "default mode's drift, speed" if any(r["check"] == "speed" for r in report["rows"]) else \
        "default mode's drift"
    text = (f"{passed} passed, {failed} failed ({informational} informational: {kinds}); "
            f"KV-cache decode vs trainer: {differing} of {compared} log-probs differ")
    return Measured((passed, failed, differing, all(r["passed"] for r in decode)), text)


def model_audit_met(value: tuple[int, int, int, bool]) -> bool:
    passed, failed, differing, decode_passed = value
    return passed > 0 and failed == 0 and differing == 0 and decode_passed


# detkit mode's speed targets (detkit-mode time / default-mode time), in the order the claim lists them.
MODE_SPEED_TARGETS = {"prefill": 1.05, "decode_eager": 1.15, "decode_cuda_graph": 1.05, "forward_backward": 1.05}


def model_speed_fields(report: dict) -> list[tuple[str, dict]]:
    """(row name, fields) of every speed row of a report: a `detkit bench model` report's rows hold their fields
    themselves; a model-audit report from before that bench holds them in the ``details`` of its ``speed`` rows."""
    if (report.get("meta") or {}).get("command") == "bench model":
        return [(r["name"], r) for r in report["rows"]]
    return [(r["name"], r["details"]) for r in report["rows"] if r["check"] == "speed"]


def model_speeds(report: dict) -> Measured:
    """The model's speed rows (``model_speed_fields``), one per MODE_SPEED_TARGETS case; each recorded target must
    be the claim's, and a bench row must have passed (its detkit-mode calls ran on detkit's kernels)."""
    fields = model_speed_fields(report)
    ratios = []
    for case, target in MODE_SPEED_TARGETS.items():
        hits = [f for name, f in fields if name == f"speed {case} detkit / default"]
        if len(hits) != 1:
            raise ClaimError(f"{len(hits)} speed rows for {case!r}")
        if hits[0].get("passed") is False:
            raise ClaimError(f"the {case} row failed ({hits[0].get('failure')}); its time is not a result")
        if hits[0]["target"] != target:
            raise ClaimError(f"the report's {case} target is {hits[0]['target']}, the claim's {target}")
        ratios.append(hits[0]["ratio"])
    met = sum(1 for x, t in zip(ratios, MODE_SPEED_TARGETS.values()) if x <= t)
    text = "; ".join(f"{x:.2f}x" for x in ratios) + f" (within {met} of {len(ratios)})"
    return Measured(met == len(ratios), text)


def attention_vs_sdpa(mode: str, target: float) -> Callable[[dict], Measured]:
    """bench attention's CUDA-graph time ratio, detkit / SDPA flash, on every case of one mode; every case
    validated against SDPA before timing."""
    def measure(report: dict) -> Measured:
        rows = [r for r in report["rows"] if r["mode"] == mode]
        if not rows:
            raise ClaimError(f"no bench attention rows of mode {mode!r}")
        if any(r["target"] != target for r in rows):
            raise ClaimError(f"the report's {mode} target is {sorted({r['target'] for r in rows})}, the claim's {target}")
        if not all(r["validated"] for r in rows):
            raise ClaimError(f"{mode}: a case failed validation; its time is not a result")
        ratios = [r["ratio_graph"] for r in rows]
        within = sum(1 for x in ratios if x <= target)
        worst = max(rows, key=lambda r: r["ratio_graph"])
        text = (f"within on {within} of {len(rows)} cases; median {statistics.median(ratios):.2f}x, worst "
                f"{worst['ratio_graph']:.2f}x (B={worst['batch']}, Skv={worst['seq_k']})")
        return Measured(max(ratios), text)
    return measure


# ---------------------------------------------------------------------------------------------
# The claims
# ---------------------------------------------------------------------------------------------
CLAIMS = [
    Claim("det_gemm audit on an H200: batch invariance, determinism (repeats, fresh process), contract; "
          "Qwen3-8B TP=2 shapes, fwd/dA/dB, both weight layouts",
          "every check passes", ("gemm_audit",), audit, all_pass),
    Claim("det_gemm audit at the shape zoo's (K, N) (nn.Linear layout; M 1-4096): the same checks, and every config "
          "the table can pick gives the same bits",
          "every check passes", ("gemm_audit_zoo",), audit, all_pass),
    Claim("det_gemm host time per call vs torch.matmul (cached launch plans, the launcher's C entry point), Qwen3-8B "
          "TP=2 layers, M 1-16384, every (op, shape, M) row",
          "≤ 1.2x", ("gemm_tp2",), gemm_per_row("host", GEMM_HOST_MAX), bool),
    Claim("det_gemm eager (back-to-back) time vs torch.matmul, the same rows",
          "≤ 1.10x", ("gemm_tp2",), gemm_per_row("eager", GEMM_EAGER_MAX), bool),
    Claim("det_gemm GPU time (CUDA graph) vs cuBLAS, Qwen3-8B TP=2 layers (q, k, v, o, gate, up, down, lm_head), per "
          "(op, shape): median over M ≥ 1024, median over M ≤ 256, worst row",
          "≤ 1.05x, ≤ 1.25x, ≤ 1.5x for every (op, shape)", ("gemm_zoo",), gemm_graph_targets_of("Qwen3-8B tp2"),
          lambda v: v[0] == v[1]),
    Claim("det_gemm GPU time vs cuBLAS, shape zoo (every linear layer of Qwen3-8B at TP 1-8, Qwen3-32B and "
          "Llama-3.1-70B at TP 8, Qwen3-30B-A3B attention; M 1-16384): the same targets per (op, K, N)",
          "every (op, K, N)", ("gemm_zoo",), gemm_graph_targets, lambda v: v[0] == v[1]),
    Claim("det_gemm vs cuBLASLt without split-K, every (op, shape, layout, M) row",
          "≤ 1.10x", ("gemm_bench",), gemm_vs_nosplitk(1.10), lambda v: v <= 1.10),
    Claim("TP operators on one TP group of two H200s (NCCL): bitwise vs shard references, contract, "
          "repeatability, collective counts",
          "every check passes", ("tp_group",), audit, all_pass),
    Claim("dW operators on one CP group of two H200s (NCCL): the same checks, CP offsets and rebuild",
          "every check passes", ("cp_group",), audit, all_pass),
    Claim("Two-rank BF16 all_reduce bits across NCCL algorithms (default, Ring Simple/LL/LL128, Tree)",
          "one digest per input, equal to (p0 + p1) rounded once", ("nccl_sweep",), nccl_sweep, bool),
    Claim("Each operator's collective vs a raw NCCL all_reduce, ≥ 8 MiB, two H200s",
          "≤ 1.05x", ("comm",), comm_vs_raw, lambda v: v <= 1.05),
    Claim("fp32_invariant mode: TP=1 vs TP=2 and CP=1 vs CP=2 bit for bit (y, dX, dW_gate, dW_up, dW_down), "
          "two H200s",
          "0 mismatched bytes", ("inv_tp", "inv_cp"), invariance, lambda v: v == (0, 0)),
    Claim("Composed Qwen3 MLP fwd+bwd, default mode vs cuBLAS + NCCL",
          "≤ 1.10x", ("mlp_tp", "mlp_cp"), mlp_ratio("default_vs_baseline_total"), lambda v: v <= 1.10),
    Claim("Composed Qwen3 MLP fwd+bwd, fp32_invariant vs default mode",
          "≤ 1.15x", ("mlp_tp", "mlp_cp"), mlp_ratio("invariant_vs_default_total"), lambda v: v <= 1.15),
    Claim("MoE BF16 audit on an H200: repeats, fresh process, batch invariance, stage bounds, end to end, "
          "precision, main_grad, edges, rejects",
          "every check passes", ("moe_audit",), audit_suite("moe"), all_pass),
    Claim("MoE BF16 fwd+bwd vs torch._grouped_mm, reference shape T=8192",
          "≥ 1.3x", ("moe_sweep",), moe_sweep_target("reference", 8192, "speedup"), lambda v: v >= 1.3),
    Claim("MoE BF16 fwd+bwd vs torch._grouped_mm, Qwen3-30B-A3B T=16384",
          "≥ 1.3x", ("moe_sweep",), moe_sweep_target("qwen3-30b-a3b", 16384, "speedup"), lambda v: v >= 1.3),
    Claim("MoE FP8 audit on an H200: the BF16 checks plus quantizers, emulation, quantization risk, weight cache",
          "every check passes", ("moe_audit",), audit_suite("moe-fp8"), all_pass),
    Claim("MoE FP8 precision gate vs FP64: out, dX, dscores, dW1, dW2",
          "cosine ≥ 0.997, relative RMSE < 7.6%", ("moe_fp8_bench",), fp8_gate, fp8_gate_met),
    Claim("MoE FP8 fwd+bwd speed-up over the BF16 detkit layer timed in the same run, reference shape",
          "≥ 1.4x", ("moe_bench_s23_landed", "moe_bench_s24"), moe_bench_verdicts("fp8_reference"),
          lambda v: v[0] == v[1]),
    Claim("MoE FP8 / BF16 fwd+bwd, every GPU preset (reference, Qwen3-30B-A3B, Qwen3-235B-A22B, OLMoE, "
          "Mixtral-8x7B: H and I multiples of 128)",
          "≥ 1.2x", ("moe_bench_s24",), moe_bench_verdicts("fp8_presets"), lambda v: v[0] == v[1]),
    Claim("MoE FP8 / BF16 fwd+bwd, sweep points with T ≥ 8192 (H x I 3072x1536 and 2048x768, E 8, 32, 64, 128, "
          "K 2, 4, 8)", "≥ 1.2x", ("moe_bench_sweep_s24_3072", "moe_bench_sweep_s24_2048"),
          moe_bench_verdicts("fp8_sweep"), lambda v: v[0] == v[1]),
    Claim("MoE BF16 fwd+bwd MFU (of 989 TFLOP/s), reference shape, `detkit bench moe`",
          "≥ 60%", ("moe_bench", "moe_bench_bf16", "moe_bench_bf16_third", "moe_bench_bf16_s19",
                    "moe_bench_bf16_s19_again", "moe_bench_bf16_s20", "moe_bench_bf16_s20_again", "moe_bench_s20",
                    "moe_bench_s21", "moe_bench_s22", "moe_bench_bf16_s22", "moe_bench_s23",
                    "moe_bench_s23_landed", "moe_bench_s24", "moe_bench_sweep_s24_3072"),
          moe_bench_verdicts("bf16_mfu_reference"),
          lambda v: v[0] == v[1]),
    Claim("MoE BF16 fwd+bwd MFU, Qwen3-30B-A3B widths T=16384 (sweep point)",
          "≥ 50%", ("moe_bench_30b16k", "moe_bench_30b16k_again", "moe_bench_sweep", "moe_bench_sweep_s21",
                    "moe_bench_sweep_s22", "moe_bench_30b16k_s23", "moe_bench_sweep_s24_2048"),
          moe_bench_verdicts("bf16_mfu_qwen3_30b_a3b_16k"),
          lambda v: v[0] == v[1]),
    Claim("detkit mode (`detkit.batch_invariant_mode()`), transformers Qwen3 (8B widths, 2 layers, random init) "
          "on an H200: rollout ≡ trainer bitwise, KV-cache decode (24 steps, alone and in a batch) vs one trainer "
          "forward; batch sizes, left/right padding, inference vs training forward, gradient repeats, every op routed",
          "every check passes; 0 log-probs differ", ("model_audit",), model_audit, model_audit_met),
    Claim("detkit mode, transformers Qwen3-MoE (Qwen3-30B-A3B widths: 128 experts, top-8; 2 layers, random init) on "
          "an H200, BF16 and FP8 experts: rollout ≡ trainer, KV-cache decode ≡ trainer, batch sizes, padding, "
          "backward repeats bitwise, every expert call on detkit's MoE layer",
          "every check passes", ("model_audit_moe", "model_audit_moe_fp8"), audits_named("BF16", "FP8"), all_pass),
    Claim("transformers' Qwen3-MoE block under detkit mode vs transformers' own block (grouped_mm experts), "
          "fwd and fwd+bwd, eager and CUDA graph, reference shape and Qwen3-30B-A3B widths, T=8192",
          "faster (> 1x)", ("moe_block_bench",), moe_block_speedups, lambda v: v[0] == v[1]),
    Claim("detkit mode speed, detkit / default mode (SDPA flash, memory-efficient where flash cannot take the call), "
          "the same model (Qwen3 8B widths, 2 layers, H100): prefill (batch 4 x 512 tokens); decode step eager; "
          "decode step under a CUDA graph (batch 8, 1024-token cache); forward+backward (4 x 512)",
          "≤ 1.05x; 1.15x; 1.05x; 1.05x", ("model_bench",), model_speeds, bool),
    Claim("detkit mode speed with FP8 experts, transformers Qwen3-MoE (Qwen3-30B-A3B widths, 2 layers), the captured "
          "decode step on static FP8 weights (`fp8_graph_weights=\"static\"`): the same four cases",
          "≤ 1.05x; 1.15x; 1.05x; 1.05x", ("model_audit_moe_fp8_static",), model_speeds, bool),
    Claim("Attention audit on an H200: decode ≡ prefill ≡ chunked prefill, batch size and position, padding, "
          "varlen, bitwise; repeats, fresh process; FP64 bound",
          "every check passes", ("attn_audit",), audit, all_pass),
    Claim("Attention vs SDPA flash, CUDA-graph time, Qwen3-8B heads (32 q, 8 kv, D=128): prefill, every case",
          "≤ 1.10x", ("attn_bench",), attention_vs_sdpa("prefill", 1.10), lambda v: v <= 1.10),
    Claim("Attention vs SDPA flash: decode step, every case (batch 1-64, cache 1k-32k tokens)",
          "≤ 1.20x", ("attn_bench",), attention_vs_sdpa("decode", 1.20), lambda v: v <= 1.20),
    Claim("Attention vs SDPA flash: forward+backward, every case",
          "≤ 1.20x", ("attn_bench",), attention_vs_sdpa("fwd_bwd", 1.20), lambda v: v <= 1.20),
]


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def claims_table(reports: Path, link_prefix: str = "reports/") -> str:
    """The markdown table, one row per claim (rows are joined by hand, unpadded, so that each claim is
    one line of README.md and a changed claim is a one-line diff)."""
    loaded = {key: load(reports / rel) for key, rel in SOURCES.items()}
    lines = ["| claim | target | measured | met | report |", "|---|---|---|---|---|"]
    for c in CLAIMS:
        try:
            m = c.measure(*(loaded[k] for k in c.sources))
        except (KeyError, TypeError, ValueError) as exc:
            raise ClaimError(f"claim {c.claim!r}: {', '.join(SOURCES[k] for k in c.sources)} "
                             f"lacks what the claim reads ({type(exc).__name__}: {exc})") from exc
        except ClaimError as exc:
            raise ClaimError(f"claim {c.claim!r}: {', '.join(SOURCES[k] for k in c.sources)}: {exc}") from exc
        links = ", ".join(f"[{Path(SOURCES[k]).parent}]({link_prefix}{human_report(reports, SOURCES[k])})"
                          for k in c.sources)
        met = "yes" if c.met(m.value) else "**no**"
        lines.append(f"| {_cell(c.claim)} | {_cell(c.target)} | {_cell(m.text)} | {met} | {links} |")
    return "\n".join(lines) + "\n"


def readme_block(reports: Path) -> str:
    return (f"{BEGIN}\n<!-- generated by `python -m tools.claims` from the reports it links; do not edit -->\n"
            f"{claims_table(reports)}{END}")


def replace_block(readme: str, block: str) -> str:
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise ClaimError(f"README must hold exactly one {BEGIN} ... {END} block")
    return readme[:readme.index(BEGIN)] + block + readme[readme.index(END) + len(END):]


# ---------------------------------------------------------------------------------------------
# reports/INDEX.md
# ---------------------------------------------------------------------------------------------
KEPT = re.compile(r"^- `([^`]+)` at `([0-9a-f]{7,40})`(?::\s*([^\n]*))?", re.M)
DECLARED = re.compile(r"DETKIT_GIT_COMMIT says ([0-9a-f]{7,40})")
MD_COMMAND = re.compile(r"^- command_line: (.+)$", re.M)
MD_COMMIT = re.compile(r"^\| git_commit\s*\| ([^|]+?)\s*\|", re.M)
REMOVED = re.compile(r"^- `([^`]+)` in `([0-9a-f]{7,40})`", re.M)


def kept_runs(readme: str) -> list[tuple[str, str, str]]:
    """The (run folder, commit, what it holds) of each line of a report README's "Kept in the tree" section:
    ``- `run/` at `commit`: what it holds`` (the description runs to the end of its line)."""
    section = readme.split("## Kept in the tree", 1)
    if len(section) != 2:
        return []
    return KEPT.findall(section[1].split("\n## ", 1)[0])


def removed_runs(readme: str) -> list[tuple[str, str]]:
    """The (run folder, commit) of each line of a report README's "Removed from the tree" section:
    ``- `run/` in `commit` ...``, the commit being the last that held the run."""
    section = readme.split("## Removed from the tree", 1)
    if len(section) != 2:
        return []
    return REMOVED.findall(section[1].split("\n## ", 1)[0])


def run_meta(run: Path) -> list[dict]:
    """The meta of every report in a run folder: JSON files with a "meta" object, and markdown reports
    (bench rows written as .jsonl carry their meta only in the .md beside them)."""
    metas = []
    for f in sorted(run.rglob("*.json")):
        try:
            doc = json.loads(f.read_text())
        except json.JSONDecodeError as exc:
            raise ClaimError(f"{f}: not valid JSON ({exc})") from exc
        if isinstance(doc, dict) and isinstance(doc.get("meta"), dict) and "command_line" in doc["meta"]:
            metas.append(doc["meta"])
    if not metas:
        for f in sorted(run.glob("*.md")):
            text = f.read_text()
            if cmd := MD_COMMAND.search(text):
                commit = MD_COMMIT.search(text)
                metas.append({"command_line": cmd.group(1).strip(),
                              "env_summary": {"git_commit": commit.group(1) if commit else ""}})
    return metas


def short_command(command_line: str) -> str:
    """A report's recorded command without the GPU host's paths and the output folder."""
    words = command_line.split()
    if words and words[0].endswith(("toolkit/__main__.py", "detkit/__main__.py")):
        words = ["detkit"] + words[1:]
    elif words and (tool := re.search(r"(?:^|/)tools/(\w+)\.py$", words[0])):  # tools run as `python -m tools.X`
        words = ["python", "-m", f"tools.{tool.group(1)}"] + words[1:]
    elif words and words[0].endswith(".py"):
        words = [re.sub(r"^.*?/(bench|toolkit|audits|tools)/", r"\1/", words[0])] + words[1:]
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w == "--out":
            skip = True
        elif w != "--no-progress":
            out.append(w)
    return " ".join(out)


def _recorded_commits(meta: dict) -> tuple[set[str], set[str]]:
    """(declared, recorded) commits in a meta: DETKIT_GIT_COMMIT, and what the tree's .git said."""
    blob = json.dumps({k: meta.get(k) for k in ("env", "env_summary", "commit")})
    declared = set(DECLARED.findall(blob))
    recorded = set(re.findall(r'"(?:git_commit|commit)": "([0-9a-f]{7,40})', blob))
    return declared, recorded


def _device(metas: list[dict]) -> str:
    best = (0, "")
    for m in metas:
        summary = m.get("env_summary") or {}
        gpus = (m.get("env") or {}).get("gpus") or {}
        names = [d.get("name", "") for d in gpus.get("devices", [])]
        count = summary.get("gpu_count") or gpus.get("visible_count") or (1 if m.get("device_name") else 0)
        name = summary.get("gpu_name") or (names[0] if names else m.get("device_name", ""))
        if count and name and count > best[0]:
            best = (count, name)
    return f"{best[0]}x {best[1]}" if best[0] else "not recorded"


def index_markdown(reports: Path) -> str:
    rows, removed = [], []
    for folder in sorted(p for p in reports.iterdir() if p.is_dir()):
        readme = folder / "README.md"
        if not readme.is_file():
            raise ClaimError(f"{folder}: a report folder needs a README.md (device, versions, commands)")
        for run, commit in removed_runs(readme.read_text()):
            if (folder / run).exists():
                raise ClaimError(f"{readme}: {run} is listed as removed but is in the tree")
            removed.append(f"- `{folder.name}/{run}` at `{commit}`")
        runs = kept_runs(readme.read_text())
        if not runs:
            raise ClaimError(f"{readme}: no \"## Kept in the tree\" list (- `run/` at `commit`)")
        all_metas, cells, dates = [], [], set()
        for run, commit, holds in runs:
            path = folder / run
            if not path.exists():
                raise ClaimError(f"{readme}: kept run {run} is not in the tree")
            metas = run_meta(path) if path.is_dir() else []
            all_metas += metas
            declared, recorded = set(), set()
            for m in metas:
                d, r = _recorded_commits(m)
                declared |= d
                recorded |= r
                if m.get("date"):
                    dates.add(str(m["date"])[:10])
            if any(not commit.startswith(d) and not d.startswith(commit) for d in declared):
                raise ClaimError(f"{readme}: {run} is listed at {commit} but its report declares "
                                 f"{', '.join(sorted(declared))}")
            note = ""
            stale = sorted(r[:7] for r in recorded if not (r.startswith(commit) or commit.startswith(r)))
            if stale and not declared:
                note = f" (the report's .git said {', '.join(stale)})"
            cmds = sorted({short_command(m["command_line"]) for m in metas})
            cmd = f": {'; '.join(f'`{c}`' for c in cmds)}" if cmds else ""
            holds = re.sub(r"\s*\(.*$", "", holds).strip()  # the line's first clause, without its remarks
            cells.append(f"`{run}`{f' ({holds})' if holds else ''} at `{commit}`{note}{cmd}")
        date = ", ".join(sorted(dates)) or folder.name[:10]
        rows.append(f"| [{folder.name}]({folder.name}/README.md) | {date} | {_device(all_metas)} | "
                    + "<br>".join(_cell(c) for c in cells) + " |")
    return ("# Reports\n\n"
            "Hardware runs behind the claims in the README, one folder per GPU session, each with a README\n"
            "naming the device, the versions, the commit whose files ran and the exact commands. A folder keeps\n"
            "only the runs a claim or a document cites; older runs and the scripts they used are in the git\n"
            "history: the runs that left first are all in the tree of commit d00a2d7, later ones are listed below.\n\n"
            "Generated by `python -m tools.claims` (`--check` in the tests); do not edit.\n\n"
            "| folder | date | device | runs kept: folder (what it holds) at commit: command |\n|---|---|---|---|\n"
            + "\n".join(rows) + "\n"
            + ("\n## Removed runs\n\n"
               "Each at the last commit that held it (`git show <commit>:reports/<path>`); its folder's README says why it\n"
               "left the tree.\n\n" + "\n".join(removed) + "\n" if removed else ""))


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def _diff(old: str, new: str, name: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"{name} (committed)",
                                        f"{name} (from the reports)"))


def problems(reports: Path, readme: Path) -> list[str]:
    """What differs between the committed README table / INDEX.md and what the reports give."""
    out = []
    text = readme.read_text()
    want = replace_block(text, readme_block(reports))
    if want != text:
        out.append(_diff(text, want, str(readme)))
    index = reports / "INDEX.md"
    have = index.read_text() if index.is_file() else ""
    want_index = index_markdown(reports)
    if have != want_index:
        out.append(_diff(have, want_index, str(index)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.claims", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when README.md or INDEX.md differs")
    ap.add_argument("--reports", type=Path, default=REPO / "reports", help="the reports folder (default: reports/)")
    ap.add_argument("--readme", type=Path, default=REPO / "README.md", help="the README holding the table")
    args = ap.parse_args(argv)
    try:
        if args.check:
            found = problems(args.reports, args.readme)
            for p in found:
                print(p, end="" if p.endswith("\n") else "\n")
            if found:
                print("claims: out of date with the reports; run `python -m tools.claims`", file=sys.stderr)
            return 1 if found else 0
        args.readme.write_text(replace_block(args.readme.read_text(), readme_block(args.reports)))
        (args.reports / "INDEX.md").write_text(index_markdown(args.reports))
        return 0
    except ClaimError as exc:
        print(f"claims: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
