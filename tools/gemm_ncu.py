"""Nsight Compute evidence for the det_gemm vs cuBLAS gaps: per case and implementation, one profiled call
with the clocks left alone, and a table of what bounds each kernel (duration, SM and memory throughput
against peak, achieved occupancy, waves per SM, registers, grid).

    python -m tools.gemm_ncu --out results/ncu                        # the default cases, both impls
    python -m tools.gemm_ncu --out results/ncu --case fwd:512:6144:4096:linear --case da:8192:6144:4096:kn
    python -m tools.gemm_ncu --out results/ncu --case fwd:512:6144:4096:linear --config 128,128,64,8,8,6,ws

Run from a checkout's root (each profiled process runs ``python -m tools.gemm_ncu --run ...`` there).

Each (case, impl) is its own process under
``ncu --clock-control none --nvtx --nvtx-include 'detkit@<row name> | ncu <impl>/' --section ...``:
the process warms the call up outside the range (Triton compile, cuBLAS heuristics), then makes it once
inside it, so ncu profiles exactly that call's kernels (cuBLAS may launch more than one). Operands are
the benchmark's (bench/gemm.py), so rows join the bench report on the case name. Compile-only evidence
(SASS, registers) is tools/gemm_sass.py; this is the hardware-counter side.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

from detkit.bench.gemm import BenchCase
from detkit.bench.gemm import operands as bench_operands

IMPLS = ("detkit", "cublas")
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy")
# Rows where det_gemm trailed cuBLASLt no-split-K most on the H200, and one row that meets it.
DEFAULT_CASES = (
    "fwd:256:4096:6144:linear", "fwd:512:6144:4096:linear", "da:256:6144:4096:linear",
    "da:8192:6144:4096:kn", "fwd:4096:6144:4096:linear",
)
# report column -> ncu raw metric
METRICS = {
    "sm_throughput_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "memory_throughput_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_throughput_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_throughput_pct": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "tensor_pipe_active_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "waves_per_sm": "launch__waves_per_multiprocessor",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
}
DURATION = "gpu__time_duration.sum"
# ncu's duration units, both spellings: "nsecond", "usecond", ... and "ns", "us", ... (the H200 host's ncu).
TO_US = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6, "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
WARMUP_CALLS = 3


def parse_case(text: str) -> BenchCase:
    """``op:M:N:K:layout`` -> BenchCase; refuses anything else, naming what is supported."""
    from detkit.kernels.det_gemm.launch import OPS
    from detkit.toolkit.fixtures import LAYOUTS

    parts = text.split(":")
    if len(parts) != 5:
        raise ValueError(f"case {text!r}: expected op:M:N:K:layout, e.g. fwd:512:6144:4096:linear")
    op, m, n, k, layout = parts
    if op not in OPS:
        raise ValueError(f"case {text!r}: op {op!r} is not supported; supported: {OPS}")
    if layout not in LAYOUTS or (op == "db" and layout != "kn"):
        raise ValueError(f"case {text!r}: layout {layout!r} is not supported; supported: {LAYOUTS} (dB: kn)")
    try:
        dims = [int(v) for v in (m, n, k)]
    except ValueError:
        raise ValueError(f"case {text!r}: M, N, K must be integers") from None
    if min(dims) < 1:
        raise ValueError(f"case {text!r}: M, N, K must be >= 1")
    return BenchCase(op, *dims, layout)


def parse_config(spec: str):
    """``BM,BN,BK,G,warps,stages[,variant]`` -> GemmConfig (a det_gemm config to profile beside the table's pick)."""
    from detkit.kernels.det_gemm.launch import GemmConfig

    parts = spec.split(",")
    try:
        return GemmConfig(*(int(v) for v in parts[:6]), *parts[6:7])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config {spec!r}: expected BM,BN,BK,G,warps,stages[,variant] ({exc})") from None


def range_name(case: BenchCase, impl: str) -> str:
    return f"{case.name} | ncu {impl}"


def run_once(case: BenchCase, impl: str, device: str) -> None:
    """The profiled process: warm the call up, then make it once inside its NVTX range."""
    import torch

    from detkit.kernels.det_gemm.launch import LAUNCHERS
    from detkit.toolkit.nvtx_ranges import nvtx_range

    config = parse_config(impl.removeprefix("config=")) if impl.startswith("config=") else None
    if impl not in IMPLS and config is None:
        raise ValueError(f"impl {impl!r} is not supported; supported: {IMPLS} or config=BM,BN,BK,G,warps,stages[,variant]")
    dev = torch.device(device)
    x, y, baseline = bench_operands(case, dev)
    if config is not None:
        call = lambda: LAUNCHERS[case.op](x, y, config=config)  # noqa: E731
    else:
        call = (lambda: LAUNCHERS[case.op](x, y)) if impl == "detkit" else baseline
    for _ in range(WARMUP_CALLS):
        call()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    with nvtx_range(range_name(case, impl)):
        call()
    if dev.type == "cuda":
        torch.cuda.synchronize()


def parse_ncu_csv(text: str) -> list[dict]:
    """ncu ``--csv --page raw``: a header row, a units row, then one row per profiled kernel. Returns one dict
    per kernel with the report columns that are present (duration in µs); ncu's own log lines before the
    header (``==PROF==``) are skipped."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    if len(lines) < 2:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    out = []
    for values in data:
        row = {"kernel": values[col["Kernel Name"]] if "Kernel Name" in col else ""}
        if DURATION in col:
            unit = units[col[DURATION]]
            if unit not in TO_US:
                raise ValueError(f"ncu duration unit {unit!r} is not known; known: {sorted(TO_US)}")
            row["duration_us"] = float(values[col[DURATION]].replace(",", "")) * TO_US[unit]
        for key, metric in METRICS.items():
            if metric in col and values[col[metric]] not in ("", "n/a"):
                row[key] = float(values[col[metric]].replace(",", ""))
        out.append(row)
    return out


def find_ncu(explicit: str | None) -> str:
    found = explicit or shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), None)
    if not found:
        raise FileNotFoundError("ncu (Nsight Compute) not found on PATH or under /opt/nvidia/nsight-compute; "
                                "pass --ncu PATH")
    return found


def profile(cases: list[BenchCase], out: Path, ncu: str, timeout_s: int, configs: tuple[str, ...] = ()) -> list[dict]:
    """One ncu process per (case, impl); raw CSV kept beside the parsed rows. ``configs``: det_gemm configs
    profiled beside the table's pick (impl ``config=<spec>``)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in cases:
        for impl in IMPLS + tuple(f"config={c}" for c in configs):
            cmd = [ncu, "--clock-control", "none", "--nvtx", "--nvtx-include", f"detkit@{range_name(case, impl)}/",
                   *[arg for s in SECTIONS for arg in ("--section", s)], "--csv", "--page", "raw",
                   sys.executable, "-m", "tools.gemm_ncu", "--run", f"{case.op}:{case.m}:{case.n}:{case.k}:{case.layout}",
                   "--impl", impl]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            stem = f"{case.op}_M{case.m}_N{case.n}_K{case.k}_{case.layout}_{impl.replace('=', '_').replace(',', '-')}"
            (out / f"{stem}.csv").write_text(proc.stdout)
            (out / f"{stem}.err").write_text(proc.stderr)
            kernels = parse_ncu_csv(proc.stdout) if proc.returncode == 0 else []
            base = {"name": case.name, "op": case.op, "M": case.m, "N": case.n, "K": case.k, "layout": case.layout,
                    "impl": impl, "ncu_rc": proc.returncode, "kernels": len(kernels)}
            if not kernels:
                rows.append({**base, "error": (proc.stderr or proc.stdout)[-400:]})
            rows.extend({**base, **k} for k in kernels)
    return rows


def markdown(rows: list[dict]) -> str:
    """A Markdown table of the rows: floats to 4 significant digits, missing cells empty."""
    from tabulate import tabulate

    cols = ("name", "impl", "kernel", "duration_us", *METRICS, "error")
    return tabulate([[r.get(c) for c in cols] for r in rows], headers=list(cols), tablefmt="github",
                    floatfmt=".4g", missingval="") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gemm_ncu", description=__doc__.split("\n")[0])
    parser.add_argument("--case", action="append", help="op:M:N:K:layout (repeatable; default: the worst rows)")
    parser.add_argument("--out", type=Path, help="results folder (profile mode)")
    parser.add_argument("--ncu", help="the ncu binary (default: PATH, then /opt/nvidia/nsight-compute/*/ncu)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per profiled process")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # the profiled process: one case
    parser.add_argument("--config", action="append", default=[],
                        help="BM,BN,BK,G,warps,stages[,variant]: also profile this det_gemm config (repeatable)")
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        run_once(parse_case(args.run), args.impl or "detkit", args.device)
        return 0
    if args.out is None:
        parser.error("--out is required")
    cases = [parse_case(c) for c in (args.case or DEFAULT_CASES)]  # all refused before any profiling
    for spec in args.config:
        parse_config(spec)
    rows = profile(cases, args.out, find_ncu(args.ncu), args.timeout, tuple(args.config))
    with open(args.out / "rows.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    table = markdown(rows)
    (args.out / "report.md").write_text("# det_gemm vs cuBLAS under Nsight Compute (--clock-control none)\n\n" + table)
    print(table)
    return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
