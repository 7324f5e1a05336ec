"""Time candidate det_gemm tiles, given as arguments, against the table's pick and cuBLAS at chosen shapes: the
evidence for pinning a config table entry (the zoo's narrow outputs, N <= 1024, first).

    python -m tools.gemm_candidates --out DIR --ops fwd --kn 4096,1024 --kn 4096,128 --m 1 16 128 \\
        --config 16,16,128,1,4,6 --config 64,64,128,1,4,6,tma

A config is BM,BN,BK,GROUP_M,warps,stages[,variant] (variant ptr, tma, tma3 or ws; default ptr). Per (op, K, N, M)
every candidate, the table's pick and torch.matmul (cuBLAS) are timed in one interleaved CUDA-graph measurement over
rotating L2-cold operand copies (bench/gemm.py's), on nn.Linear weights; each candidate's output is compared bit for
bit with the table pick's (every config must give the same bits). A candidate the kernel refuses is a row with its
error. Writes candidates.jsonl and candidates.md under --out. Needs a CUDA device (sm_90).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

VARIANTS = ("ptr", "tma", "tma3", "ws")


def parse_config(text: str):
    """``BM,BN,BK,G,warps,stages[,variant]`` -> GemmConfig; a bad one raises ValueError naming it."""
    from detkit.kernels.det_gemm.launch import GemmConfig

    parts = text.split(",")
    if len(parts) not in (6, 7):
        raise ValueError(f"--config {text!r}: expected BM,BN,BK,GROUP_M,warps,stages[,variant]")
    try:
        numbers = [int(p) for p in parts[:6]]
    except ValueError:
        raise ValueError(f"--config {text!r}: the first six fields must be integers") from None
    return GemmConfig(*numbers, parts[6] if len(parts) == 7 else "ptr")


def sweep(ops, kn_shapes, m_values, configs, rounds: int, layout: str = "linear",
          device: torch.device = torch.device("cuda")):
    """Rows as each (op, K, N, M) is measured: one per timed config (the table's pick included), one per refusal."""
    from detkit.bench.gemm import BenchCase, _rotation_sets, baseline_call, operands
    from detkit.kernels.det_gemm.launch import LAUNCHERS
    from detkit.toolkit.contract import compare_bits
    from detkit.toolkit.timing import time_graphs

    for op in ops:
        for k, n in kn_shapes:
            for m in m_values:
                case = BenchCase(op, m, n, k, layout if op != "db" else "kn")
                x, y, _ = operands(case, device)
                want, table = LAUNCHERS[op](x, y)
                sets = _rotation_sets(x, y)
                fns = {"table": lambda: [LAUNCHERS[op](a, b) for a, b in sets]}
                base_calls = [baseline_call(op, a, b) for a, b in sets]
                fns["cublas"] = lambda: [call() for call in base_calls]
                info = {}
                for config in configs:
                    label = config.label()
                    try:
                        got = LAUNCHERS[op](x, y, config=config)[0]
                    except Exception as exc:  # noqa: BLE001 - refused, or failed to compile: recorded as its row
                        info[label] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                        continue
                    info[label] = {"bits_equal_table": compare_bits(got, want).equal}
                    fns[label] = (lambda cfg: lambda: [LAUNCHERS[op](a, b, config=cfg) for a, b in sets])(config)
                timed = time_graphs(fns, device, calls_per_fn=len(sets), rounds=rounds, replays=5)
                base = timed["cublas"].median_us
                for label, t in timed.items():
                    if label == "cublas":
                        continue
                    yield ({"op": op, "K": k, "N": n, "M": m, "layout": case.layout, "name": case.name,
                                 "config": table.config.label() if label == "table" else label,
                                 "is_table": label == "table", "median_us": t.median_us, "p20_us": t.p20_us,
                                 "p80_us": t.p80_us, "cublas_median_us": base, "ratio_vs_cublas": t.median_us / base,
                                 "ratio_vs_table": t.median_us / timed["table"].median_us,
                                 "sm_clock_mhz": t.sm_clock_mhz, **info.get(label, {})})
                for label, v in info.items():
                    if "error" in v:
                        yield {"op": op, "K": k, "N": n, "M": m, "name": case.name, "config": label, **v}
                del x, y, want
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                print(f"{case.name}: table {table.config.label()} {timed['table'].median_us:.1f} us, "
                      f"cuBLAS {base:.1f} us", file=sys.stderr, flush=True)


def summary(rows: list[dict]) -> str:
    """Per (op, K, N, M): the table's ratio to cuBLAS and the fastest bit-equal candidate's."""
    from tabulate import tabulate

    out = []
    keys = list(dict.fromkeys((r["op"], r["K"], r["N"], r["M"]) for r in rows))
    for key in keys:
        sel = [r for r in rows if (r["op"], r["K"], r["N"], r["M"]) == key and "median_us" in r]
        table = next(r for r in sel if r["is_table"])
        ok = [r for r in sel if not r["is_table"] and r.get("bits_equal_table")]
        best = min(ok, key=lambda r: r["median_us"]) if ok else None
        out.append({"op": key[0], "K": key[1], "N": key[2], "M": key[3], "table": table["config"],
                    "table_vs_cublas": table["ratio_vs_cublas"],
                    "best": best["config"] if best else None,
                    "best_vs_cublas": best["ratio_vs_cublas"] if best else None,
                    "best_vs_table": best["ratio_vs_table"] if best else None,
                    "bits_differ": [r["config"] for r in sel if r.get("bits_equal_table") is False]})
    geo = {}
    for r in rows:
        if "median_us" in r and not r["is_table"] and r.get("bits_equal_table"):
            geo.setdefault(r["config"], []).append(r["ratio_vs_table"])
    ranking = sorted(({"config": c, "cases": len(v), "geomean_vs_table": statistics.geometric_mean(v)}
                      for c, v in geo.items()), key=lambda e: e["geomean_vs_table"])
    return ("# det_gemm candidate tiles\n\nRatios are times (< 1: faster). Every candidate must give the table "
            "pick's bits; `bits_differ` lists any that did not.\n\n"
            + tabulate(out, headers="keys", tablefmt="github", floatfmt=".3f")
            + "\n\n## Candidates over all cases (geometric mean of time / table pick's time)\n\n"
            + tabulate(ranking, headers="keys", tablefmt="github", floatfmt=".3f") + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gemm_candidates", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ops", nargs="+", default=["fwd"], choices=["fwd", "da", "db"])
    parser.add_argument("--kn", action="append", required=True, metavar="K,N")
    parser.add_argument("--m", nargs="+", type=int, required=True)
    parser.add_argument("--config", action="append", required=True, metavar="BM,BN,BK,G,WARPS,STAGES[,VARIANT]")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        configs = [parse_config(c) for c in args.config]
        kn = [tuple(int(v) for v in s.split(",")) for s in args.kn]
    except ValueError as exc:
        parser.error(str(exc))
    if any(len(s) != 2 for s in kn) or any(m < 1 for m in args.m) or args.rounds < 1:
        parser.error("--kn takes K,N; --m and --rounds must be >= 1")
    if not torch.cuda.is_available():
        parser.error("tools.gemm_candidates times on a CUDA device (sm_90)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    try:  # rows as they come; stopped early (SIGINT), the summary covers those measured
        with open(args.out / "candidates.jsonl", "w") as f:
            for row in sweep(args.ops, kn, args.m, configs, args.rounds):
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
    except KeyboardInterrupt:
        print(f"gemm_candidates: stopped after {len(rows)} rows", file=sys.stderr)
    if rows:
        (args.out / "candidates.md").write_text(summary(rows))
    return 1 if any(r.get("bits_equal_table") is False for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
