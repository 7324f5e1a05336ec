"""Refit the FP8-or-BF16 table of kernels/moe/fp8/choice.py from ``detkit bench moe`` reports, and check the pinned
table against them.

Per (backend, wgrad, H, I, E, K), from the forward+backward rows of the FP8 layer with weights quantized in the call
(impl ``fp8``, wgrad the row's ``default_wgrad``; ``fp8_wgrad_bf16``, wgrad "bf16"; ``fp8_warm`` is not what the
rule decides), hardware rows only, T >= MIN_T: the ratio speedup_vs_bf16 = BF16 median / FP8 median per (T, timing).
A shape's verdict:

    bf16       some ratio < 1.0, or some row failed (the bench did not time it: nothing says FP8 is faster)
    fp8        every ratio >= 1.0, with T = MIN_T measured eager and as a CUDA graph (the ratio mostly rises with
               T: a shape is not decided without its smallest T)
    undecided  no ratio < 1.0, but T = MIN_T not measured in both timings (a preset timed at T = 8192 only)

The fitted table holds the minimal fp8 shapes (none at least as favourable as another, ``MeasuredShape.dominated_by``).
A bf16 shape at least as favourable as an fp8 one contradicts the monotone rule: listed as a conflict. Each shape
also gets the pinned table's pick; the pick is UNSAFE where it is fp8 on a bf16 verdict.

    python -m tools.fp8_choice_fit reports/2026-12-03-h200-s24/call1/sweep-3072/report.json \\
        reports/2026-12-03-h200-s24/call1/sweep-2048/report.json reports/2026-12-03-h200-s24/call1/bench/report.json

Exit status 1 on an UNSAFE pick or a conflict; the printed table says where the fit and the pinned table differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from detkit.kernels.moe.fp8.choice import FP8_FASTER_SHAPES, MIN_T, MeasuredShape, fp8_choice

IMPL_WGRAD = {"fp8": None, "fp8_wgrad_bf16": "bf16"}  # impl -> wgrad (None: the row's default_wgrad)
TIMINGS = ("eager", "graph")


@dataclass
class ShapeData:
    backend: str
    wgrad: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    ratios: dict[tuple[int, str], float] = field(default_factory=dict)  # (T, timing) -> BF16 / FP8
    failed: list[str] = field(default_factory=list)  # rows that were not timed, with why
    sources: set[str] = field(default_factory=set)

    @property
    def key(self) -> tuple:
        return self.backend, self.wgrad, self.hidden, self.inter, self.experts, self.top_k

    def worst(self) -> tuple[float, str] | None:
        if not self.ratios:
            return None
        (t, timing), r = min(self.ratios.items(), key=lambda kv: kv[1])
        return r, f"T={t} {timing}"

    def verdict(self) -> str:
        if self.failed or any(r < 1.0 for r in self.ratios.values()):
            return "bf16"
        if all((MIN_T, timing) in self.ratios for timing in TIMINGS):
            return "fp8"
        return "undecided"


def load_rows(paths: list[Path]) -> list[tuple[str, dict]]:
    """(source, row) of every report's rows; a file without ``rows`` is refused by name."""
    out = []
    for path in paths:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError(f"{path}: not a detkit report (no 'rows' list)")
        out += [(str(path), row) for row in data["rows"]]
    return out


def collect(rows: list[tuple[str, dict]]) -> dict[tuple, ShapeData]:
    shapes: dict[tuple, ShapeData] = {}
    for source, r in rows:
        if r.get("impl") not in IMPL_WGRAD or r.get("measure") != "fwd_bwd" or r.get("timing") not in TIMINGS:
            continue
        if not r.get("hardware_result") or r.get("T", 0) < MIN_T:
            continue
        wgrad = IMPL_WGRAD[r["impl"]] or r.get("default_wgrad")
        if wgrad is None:
            raise ValueError(f"{source}: row {r.get('name')!r} has no default_wgrad")
        d = ShapeData(r["backend"], wgrad, r["H"], r["I"], r["E"], r["K"])
        d = shapes.setdefault(d.key, d)
        d.sources.add(source)
        if r.get("passed") and r.get("validated") and "speedup_vs_bf16" in r:
            point = (r["T"], r["timing"])  # measured in several runs (a preset and a sweep point): the worst
            d.ratios[point] = min(r["speedup_vs_bf16"], d.ratios.get(point, r["speedup_vs_bf16"]))
        else:
            d.failed.append(f"T={r['T']} {r['timing']}: {r.get('failure') or r.get('skipped') or 'no ratio'}")
    return shapes


def measured(d: ShapeData) -> MeasuredShape:
    worst, where = d.worst()
    return MeasuredShape(d.hidden, d.inter, d.experts, d.top_k, round(worst, 3), where, ", ".join(sorted(d.sources)))


def fit(shapes: dict[tuple, ShapeData]) -> tuple[dict[tuple[str, str], list[MeasuredShape]], list[str]]:
    """(backend, wgrad) -> the minimal fp8 shapes; and the conflicts (a bf16 shape at least as favourable as one)."""
    table: dict[tuple[str, str], list[MeasuredShape]] = {}
    conflicts = []
    groups: dict[tuple[str, str], list[ShapeData]] = {}
    for d in shapes.values():
        groups.setdefault((d.backend, d.wgrad), []).append(d)
    for group, members in sorted(groups.items()):
        fast = [measured(d) for d in members if d.verdict() == "fp8"]
        # m is not minimal when it is at least as favourable as another fp8 shape o
        minimal = [m for m in fast if not any(o is not m and not o.dominated_by(m.hidden, m.inter, m.experts, m.top_k)
                                              for o in fast)]
        table[group] = sorted(minimal, key=lambda m: (m.hidden * m.inter, m.top_k, -m.experts))
        for d in members:
            if d.verdict() != "bf16":
                continue
            for m in fast:
                if not m.dominated_by(d.hidden, d.inter, d.experts, d.top_k):
                    conflicts.append(f"{group}: H={d.hidden}, I={d.inter}, E={d.experts}, K={d.top_k} is bf16 but at "
                                     f"least as favourable as the fp8 shape {m.label()}")
    return table, conflicts


def rows_of(shapes: dict[tuple, ShapeData]) -> list[dict]:
    out = []
    for d in sorted(shapes.values(), key=lambda d: d.key):
        worst = d.worst()
        pick = fp8_choice(d.hidden, d.inter, d.experts, d.top_k, d.backend, d.wgrad).layer
        verdict = d.verdict()
        check = ("UNSAFE" if pick == "fp8" and verdict == "bf16" else
                 "conservative" if pick == "bf16" and verdict == "fp8" else "ok")
        out.append({"backend": d.backend, "wgrad": d.wgrad, "H": d.hidden, "I": d.inter, "E": d.experts,
                    "K": d.top_k, "verdict": verdict, "worst": None if worst is None else round(worst[0], 3),
                    "worst_at": None if worst is None else worst[1], "points": len(d.ratios),
                    "failed": len(d.failed), "pinned_pick": pick, "check": check})
    return out


def pinned_differences(table: dict[tuple[str, str], list[MeasuredShape]]) -> list[str]:
    """Where the fitted minimal shapes differ from the pinned ones, for the (backend, wgrad) the reports cover."""
    out = []
    for group, fitted in table.items():
        pinned = {(m.hidden, m.inter, m.experts, m.top_k) for m in FP8_FASTER_SHAPES.get(group, ())}
        got = {(m.hidden, m.inter, m.experts, m.top_k) for m in fitted}
        if pinned != got:
            out.append(f"{group}: fitted {sorted(got)}, pinned {sorted(pinned)}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="report.json files of `detkit bench moe`")
    parser.add_argument("--json", type=Path, help="also write the shapes, the fit and the checks here")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.reports if not p.is_file()]
    if missing:
        parser.error(f"no such report: {', '.join(missing)}")
    shapes = collect(load_rows(args.reports))
    if not shapes:
        parser.error("no hardware fwd_bwd rows of fp8 or fp8_wgrad_bf16 at T >= "
                     f"{MIN_T} in {', '.join(map(str, args.reports))}")
    table, conflicts = fit(shapes)
    rows = rows_of(shapes)
    from tabulate import tabulate

    print(tabulate(rows, headers="keys"))
    print()
    for group, fitted in table.items():
        print(f"{group}: FP8 from " + ("; ".join(f"{m.label()} (worst {m.worst}x at {m.worst_at})" for m in fitted)
                                       or "no shape"))
    differences = pinned_differences(table)
    print("pinned table: " + ("matches the fit" if not differences else "differs: " + "; ".join(differences)))
    unsafe = [r for r in rows if r["check"] == "UNSAFE"]
    for line in conflicts:
        print(f"conflict: {line}")
    for r in unsafe:
        print(f"UNSAFE: the pinned table picks fp8 at H={r['H']}, I={r['I']}, E={r['E']}, K={r['K']} ({r['backend']}, "
              f"wgrad={r['wgrad']}); measured {r['worst']}x at {r['worst_at']}")
    if args.json:
        args.json.write_text(json.dumps({"min_t": MIN_T, "shapes": rows, "conflicts": conflicts,
                                         "pinned_differences": differences,
                                         "fit": {f"{b} {w}": [asdict(m) for m in ms] for (b, w), ms in table.items()}},
                                        indent=1))
    return 1 if unsafe or conflicts else 0


if __name__ == "__main__":
    sys.exit(main())
