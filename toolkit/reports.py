"""Report outputs: the markdown and plots of audit and benchmark reports.

Every file is written atomically (temp file + rename), so a reader never sees half a report.
Formats and where each file goes: docs/reports.md.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from detkit.toolkit.provenance import format_config_tables, format_source
from detkit.toolkit.records import INTERPRETER_BANNER, Row, summarize

DRIFT_PLOT = "drift_hist.png"
INCOMPLETE_BANNER = "# INCOMPLETE report"  # report.md's first line when a run stopped before its end
MAX_FAILED_ROWS_MD = 100  # report.md lists at most this many failed rows; rows.jsonl has them all
_DETAIL_CHARS = 160


def save_figure(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    tmp = path.with_suffix(".png.tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------
# Audit report.md
# ---------------------------------------------------------------------------------------------
def env_block(summary: dict) -> list[str]:
    """The short environment block: env_summary's fields, one table row each."""
    return ["## Environment", "", tabulate([[k, v] for k, v in summary.items()], headers=["field", "value"],
                                           tablefmt="github"),
            "", "(full capture: `meta.env` in report.json; `detkit env` prints the same)", ""]


def provenance_lines(meta: dict) -> list[str]:
    """The config tables that ran and the source state, one line each (``toolkit.provenance``)."""
    lines = []
    if isinstance(meta.get("config_tables"), list):
        lines.append(f"- config tables: {format_config_tables(meta['config_tables'])}")
    if isinstance(meta.get("source"), dict):
        lines.append(f"- source: {format_source(meta['source'])}")
    return lines


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= _DETAIL_CHARS else text[:_DETAIL_CHARS - 3] + "..."


def _failed_table(rows: Sequence[Row]) -> list[dict]:
    out = []
    for r in rows[:MAX_FAILED_ROWS_MD]:
        details = {k: v for k, v in r.details.items() if k != "fp64_hist"}
        out.append({"suite": r.suite, "check": r.check, "name": r.name, "details": _short(details)})
    return out


def drift_op(row: Row) -> str:
    """The op a contract row belongs to: ``contract det_gemm_fwd [M=..] ..`` -> ``det_gemm_fwd``."""
    name = row.name.removeprefix("contract ")
    return name.split(" [", 1)[0]


def drift_rows(rows: Iterable[Row]) -> list[Row]:
    """Rows that carry per-element drift against the FP64 oracle (the gemm_contract rows)."""
    return [r for r in rows if "fp64_ulp_max" in r.details]


def drift_summary(rows: Iterable[Row]) -> list[dict]:
    """Per op: cases, worst bound ratio, worst ULP / relative error against FP64 over the elements where they
    mean something (``toolkit.contract.drift_stats``: the reference outside its own error bound of zero), the
    elements left out of them (``near_zero``), worst relative L2 error (all elements), ULP-0 fraction."""
    by_op: dict[str, list[Row]] = {}
    for r in drift_rows(rows):
        by_op.setdefault(drift_op(r), []).append(r)
    table = []
    for op, sel in by_op.items():
        d = [r.details for r in sel]
        table.append({
            "op": op, "cases": len(sel), "failed": sum(not r.passed for r in sel),
            "worst_bound_ratio": max(x.get("worst_ratio", 0.0) for x in d),
            "ulp_max": max(x["fp64_ulp_max"] for x in d),
            "ulp_p99_max": max(x.get("fp64_ulp_p99", 0.0) for x in d),
            "rel_max": max(x.get("fp64_rel_max", 0.0) for x in d),
            "near_zero": sum(int(x.get("fp64_near_zero", 0)) for x in d),
            "rel_l2_max": max(x.get("fp64_rel_l2", 0.0) for x in d),
            "ulp0_fraction_min": min(x.get("fp64_ulp0_fraction", 1.0) for x in d),
        })
    return table


def histogram_by_op(rows: Iterable[Row], kind: str) -> dict[str, dict[str, int]]:
    """Sum the ``fp64_hist[kind]`` counts of the contract rows per op (bins in row order)."""
    out: dict[str, dict[str, int]] = {}
    for r in drift_rows(rows):
        hist = r.details.get("fp64_hist", {}).get(kind)
        if not hist:
            continue
        acc = out.setdefault(drift_op(r), {})
        for label, count in hist.items():
            acc[label] = acc.get(label, 0) + int(count)
    return out


def _distributed_block(meta: dict) -> list[str]:
    dist = meta.get("distributed")
    if not isinstance(dist, dict):
        return []
    lines = ["## Distributed run", ""]
    for key in ("world_size", "source", "pg_backend", "timeout_s", "hosts", "inter_node", "rows_per_rank"):
        if key in dist:
            lines.append(f"- {key}: {dist[key]}")
    versions = dist.get("versions")
    if isinstance(versions, dict):
        lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if not dist.get("inter_node", True):
        lines.append("- one host: this run covers no inter-node group")
    lines.append("")
    if isinstance(meta.get("groups"), dict):
        lines += ["### Groups", ""]
        lines += [f"- {axis.upper()}: {groups if groups else 'none held by this world'}"
                  for axis, groups in meta["groups"].items()] + [""]
    rank_map = meta.get("rank_map")
    if isinstance(rank_map, list) and rank_map:
        cols = ["rank", "layout_rank", "cp", "tp", "hostname", "node_rank", "local_rank", "device", "pg_backend",
                "gpu", "pci_bus_id"]
        table = [{c: rec.get(c) for c in cols if c in rec} for rec in rank_map]
        lines += ["### Rank map", "", tabulate(table, headers="keys", tablefmt="github"), ""]
    layout = meta.get("tp_cp_layout")
    if isinstance(layout, dict):
        scalars = {k: v for k, v in layout.items() if not isinstance(v, (dict, list))}
        if scalars:
            lines += ["### TP/CP layout", ""] + [f"- {k}: {v}" for k, v in scalars.items()] + [""]
    return lines


def render_audit_markdown(meta: dict, rows: Sequence[Row]) -> str:
    """report.md: verdict, environment, suites, distributed layout, per-check summary, failed rows,
    drift per op, coverage, plots. Every row (passed or not) stays in report.json / rows.jsonl."""
    failed = [r for r in rows if not r.passed]
    status = meta.get("status") or ("PASSED" if rows and not failed else "FAILED")
    reason = meta.get("status_reason")
    lines = [f"{INCOMPLETE_BANNER}: {reason}", ""] if status == "INCOMPLETE" else []
    lines += [f"# detkit {meta['command']} report", ""]
    if meta.get("backend") == "triton_interpreter":
        lines += [f"> **{INTERPRETER_BANNER}**", ""]
    lines += [f"**{status}**" + (f": {reason}" if reason and status != "INCOMPLETE" else ""), "",
              f"{len(rows) - len(failed)} passed, {len(failed)} failed" + ("" if rows else " (no rows were produced)")
              + (": only the rows finished before the run stopped" if status == "INCOMPLETE" else ""), ""]
    lines += [f"- {key}: {meta[key]}" for key in ("date", "backend", "hardware_result", "preset", "device_name",
                                                   "seed", "command_line") if key in meta]
    lines += provenance_lines(meta)
    selection = meta.get("suite_selection")
    if isinstance(selection, dict):
        lines.append(f"- suites: {', '.join(selection.get('resolved', []))} "
                     f"(requested: {', '.join(selection.get('requested', []))})")
        lines += [f"  - {why}" for why in selection.get("reasons", [])]
    if isinstance(meta.get("suite_seconds"), dict) and meta["suite_seconds"]:
        lines.append("- seconds per plug-in: " + ", ".join(f"{k} {v:g}" for k, v in meta["suite_seconds"].items()))
    lines.append("")
    if isinstance(meta.get("env_summary"), dict):
        lines += env_block(meta["env_summary"])
    lines += _distributed_block(meta)
    lines += ["## Summary per check", "", tabulate(summarize(list(rows)), headers="keys", tablefmt="github"), ""]
    if failed:
        lines += [f"## Failed rows ({len(failed)})", "", tabulate(_failed_table(failed), headers="keys",
                                                                  tablefmt="github"), ""]
        if len(failed) > MAX_FAILED_ROWS_MD:
            lines += [f"... {len(failed) - MAX_FAILED_ROWS_MD} more failed rows in rows.jsonl / report.json", ""]
    drift = drift_summary(rows)
    if drift:
        lines += ["## Drift against the FP64 oracle (contract rows)", "",
                  "worst_bound_ratio: error / derived bound (<= 1 passes), every element. ULP: distance in BF16 "
                  "units to the oracle rounded to BF16 (0 = correctly rounded); rel: |c - c*| / |c*|. Both are taken "
                  "over the elements whose oracle lies outside its own error bound of zero (|c*| > bound): where "
                  "cancellation leaves |c*| <= bound, a result anywhere in the bound passes, and its relative and "
                  "ULP distances (which grow without limit as c* nears 0) say nothing. near_zero counts the "
                  "elements left out; rel_l2 (||c - c*|| / ||c*||) and the bound ratio cover every element.", "",
                  tabulate(drift, headers="keys", tablefmt="github", floatfmt=".4g"), ""]
    for key in ("covered", "not_covered"):
        if meta.get(key):
            lines += [f"## {key.replace('_', ' ').upper()}", ""] + [f"- {item}" for item in meta[key]] + [""]
    for plot in meta.get("plots", []):
        lines += [f"![{plot}]({plot})", ""]
    lines += ["All rows, passed and failed, with every detail: `report.json` (`rows`) and `rows.jsonl`.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Benchmark report.md
# ---------------------------------------------------------------------------------------------
def render_bench_markdown(meta: dict, rows: Sequence[dict], body: str) -> str:
    """report.md of a benchmark: verdict, run identity, provenance, environment, the bench's own body
    (``summarize``), failed rows, not-covered list and plots. Every row stays in report.json / rows.jsonl."""
    failed = [r for r in rows if not r.get("passed")]
    lines = [f"# detkit {meta['command']} report", ""]
    if meta.get("backend") == "triton_interpreter":
        lines += [f"> **{INTERPRETER_BANNER}**", ""]
    interrupted = meta.get("interrupted_after_rows")
    verdict = "PASS" if rows and not failed and interrupted is None else "FAIL"
    lines += [f"**{verdict}**: {len(rows) - len(failed)} row(s) passed, {len(failed)} failed"
              + ("" if rows else " (no rows were produced)")
              + ("" if interrupted is None else f"; INTERRUPTED after {interrupted} of {meta.get('cases')} case(s)"),
              ""]
    lines += [f"- {key}: {meta[key]}" for key in ("date", "backend", "hardware_result", "preset", "presets",
                                                   "device_name", "seed", "rounds") if key in meta]
    if "command_line" in meta:
        lines.append(f"- command_line: `{meta['command_line']}`")
    lines += provenance_lines(meta)
    for src in meta.get("merged_from", []):
        source = src.get("source") or {}
        lines.append(f"- merged from {src['dir']}: `{src.get('command_line')}` ({src.get('date')}, "
                     f"{src.get('device_name')}, source {format_source(source) if source else 'not recorded'})")
    lines.append("")
    if isinstance(meta.get("env_summary"), dict):
        lines += env_block(meta["env_summary"])
    lines += [body.rstrip(), ""]
    if failed:
        shown = [{"name": r["name"], "failure": _short(r.get("failure", "passed is false"))}
                 for r in failed[:MAX_FAILED_ROWS_MD]]
        lines += [f"## Failed rows ({len(failed)})", "", tabulate(shown, headers="keys", tablefmt="github"), ""]
        if len(failed) > MAX_FAILED_ROWS_MD:
            lines += [f"... {len(failed) - MAX_FAILED_ROWS_MD} more failed rows in rows.jsonl / report.json", ""]
    if meta.get("not_covered"):
        lines += ["## NOT COVERED", ""] + [f"- {item}" for item in meta["not_covered"]] + [""]
    for plot in meta.get("plots", []):
        lines += [f"![{plot}]({plot})", ""]
    lines += ["All rows, passed and failed, with every field: `report.json` (`rows`) and `rows.jsonl`.", ""]
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict], cols: Sequence[str]) -> str:
    """A GitHub table of the columns some row has, one line per row; floats to 4 significant digits,
    missing cells empty."""
    cols = [c for c in cols if any(c in r for r in rows)]
    return tabulate([[r.get(c) for c in cols] for r in rows], headers=cols, tablefmt="github", floatfmt=".4g",
                    missingval="")


# ---------------------------------------------------------------------------------------------
# Audit plots
# ---------------------------------------------------------------------------------------------
def write_audit_plots(out_dir: Path, rows: Sequence[Row]) -> list[Path]:
    """The PNGs the rows support, written next to report.md; returns their paths."""
    paths = []
    ulp, rel = histogram_by_op(rows, "ulp"), histogram_by_op(rows, "rel")
    if ulp or rel:
        path = Path(out_dir) / DRIFT_PLOT
        plot_drift_histogram(ulp, rel, path)
        paths.append(path)
    return paths


def plot_drift_histogram(ulp: dict[str, dict[str, int]], rel: dict[str, dict[str, int]], path: Path) -> None:
    """Two panels: the ULP-distance and relative-error distributions per op, as the fraction of
    elements in each bin (summed over every contract case of the op)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, hists, title in ((axes[0], ulp, "BF16 ULP distance to FP64 oracle"),
                             (axes[1], rel, "relative error vs FP64 oracle")):
        ops = list(hists)
        if not ops:
            ax.set_visible(False)
            continue
        labels = list(dict.fromkeys(label for h in hists.values() for label in h))
        width = 0.8 / len(ops)
        for i, op in enumerate(ops):
            total = sum(hists[op].values()) or 1
            ax.bar([j + i * width for j in range(len(labels))],
                   [hists[op].get(label, 0) / total for label in labels], width=width, label=op)
        ax.set_xticks([j + width * (len(ops) - 1) / 2 for j in range(len(labels))])
        ax.set_xticklabels(labels, rotation=30, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("fraction of elements")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.suptitle("det_gemm drift per op (all contract cases)", fontsize=10)
    save_figure(fig, path)
    plt.close(fig)


def style_log2_axes(ax, title: str, xlabel: str, ylabel: str) -> None:
    """The look every detkit plot shares: log2 x axis, light grid, small legend."""
    ax.set_xscale("log", base=2)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
