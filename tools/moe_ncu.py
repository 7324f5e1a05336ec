"""Nsight Compute evidence for the MoE layer's kernels: one forward+backward call of the BF16 or FP8 layer profiled
kernel by kernel (clocks left alone), with what bounds each one: duration, SM / tensor-pipe / DRAM / L2 throughput
against peak, registers, and the warps' top stall reasons (cycles per issued instruction; averaged over every warp of
the kernel, producer and epilogue warps included).

    python -m tools.moe_ncu --preset reference --impl bf16 --impl fp8 --out results/ncu

Each (preset, impl) is its own process under ``ncu --nvtx-include 'detkit@moe ncu <impl>/'``: the process warms the
layer up (compiles, caches) outside the range and makes one call inside it. The raw CSV is kept beside the table.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

from detkit.toolkit.presets import MOE_PRESETS
from detkit.toolkit.reports import markdown_table
from tools.gemm_ncu import find_ncu, parse_ncu_csv

IMPLS = ("bf16", "fp8")
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats", "ComputeWorkloadAnalysis",
            "MemoryWorkloadAnalysis")
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"
WARMUP_CALLS = 3


def range_name(preset: str, impl: str) -> str:
    return f"moe ncu {impl} {preset}"


def run_once(preset: str, impl: str) -> None:
    """The profiled process: the layer's fwd+bwd warmed up, then once inside its NVTX range."""
    import torch

    from detkit.bench.moe_common import make_inputs
    from detkit.toolkit.nvtx_ranges import nvtx_range
    from tools.moe_kernels_profile import layer_call

    call = layer_call(impl, make_inputs(MOE_PRESETS[preset], torch.device("cuda"), seed=1234))
    for _ in range(WARMUP_CALLS):
        call()
    torch.cuda.synchronize()
    with nvtx_range(range_name(preset, impl)):
        call()
    torch.cuda.synchronize()


def stalls(csv_text: str, top: int = 5) -> list[dict[str, float]]:
    """Per profiled kernel (in order), its ``top`` largest stall reasons: reason -> cycles per issued instruction."""
    lines = [line for line in csv_text.splitlines() if line.startswith('"')]
    if len(lines) < 3:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    header, data = rows[0], rows[2:]
    cols = [(i, h[len(STALL_PREFIX):-len(STALL_SUFFIX)]) for i, h in enumerate(header)
            if h.startswith(STALL_PREFIX) and h.endswith(STALL_SUFFIX) and "not_issued" not in h]
    out = []
    for values in data:
        found = {name: float(values[i].replace(",", "")) for i, name in cols if values[i] not in ("", "n/a")}
        out.append(dict(sorted(found.items(), key=lambda kv: -kv[1])[:top]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.moe_ncu", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", action="append", default=[], choices=sorted(MOE_PRESETS))
    ap.add_argument("--impl", action="append", default=[], choices=IMPLS)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ncu", help="the ncu binary (default: PATH, then /opt/nvidia/nsight-compute/*/ncu)")
    ap.add_argument("--timeout", type=int, default=400, help="seconds per profiled process")
    ap.add_argument("--run", nargs=2, metavar=("PRESET", "IMPL"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run:
        run_once(*args.run)
        return 0
    if not args.out or not args.preset or not args.impl:
        ap.error("--out, --preset and --impl are required")
    ncu = find_ncu(args.ncu)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in args.preset:
        for impl in args.impl:
            cmd = [ncu, "--clock-control", "none", "--nvtx", "--nvtx-include", f"detkit@{range_name(preset, impl)}/",
                   *[a for s in SECTIONS for a in ("--section", s)], "--csv", "--page", "raw",
                   sys.executable, "-m", "tools.moe_ncu", "--run", preset, impl]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            (args.out / f"{preset}_{impl}.csv").write_text(proc.stdout)
            (args.out / f"{preset}_{impl}.err").write_text(proc.stderr)
            kernels = parse_ncu_csv(proc.stdout) if proc.returncode == 0 else []
            if not kernels:
                rows.append({"preset": preset, "impl": impl, "error": (proc.stderr or proc.stdout)[-400:]})
            for k, st in zip(kernels, stalls(proc.stdout) or [{}] * len(kernels)):
                rows.append({"preset": preset, "impl": impl, **k,
                             "top_stalls": ", ".join(f"{n} {v:.2f}" for n, v in st.items())})
    (args.out / "ncu.json").write_text(json.dumps(rows, indent=1))
    cols = ("preset", "impl", "kernel", "duration_us", "sm_throughput_pct", "tensor_pipe_active_pct",
            "dram_throughput_pct", "l2_throughput_pct", "registers", "top_stalls", "error")
    table = markdown_table(rows, cols)
    (args.out / "ncu.md").write_text(table + "\n")
    print(table)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
