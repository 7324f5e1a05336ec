"""Config sweep for the pinned table: time candidate configs per (op, shape, M) on the GPU and check each
gives the same bits as the current table's pick. Not autotuning: a human reads the output and pins
entries in kernels/det_gemm.py (bumping CONFIG_TABLE_VERSION); the audits then re-check them.

    python -m bench.gemm_tune --out results/tune.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.gemm import BenchCase, operands
from kernels.det_gemm import LAUNCHERS, GemmConfig
from toolkit.contract import compare_bits
from toolkit.timing import time_interleaved

LARGE = [GemmConfig(*c) for c in [
    (128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (128, 256, 64, 16, 8, 4), (256, 128, 64, 8, 8, 3),
    (256, 128, 64, 8, 8, 4), (128, 128, 64, 8, 8, 4), (128, 128, 64, 8, 4, 4), (128, 128, 128, 8, 8, 3),
]]
SMALL = [GemmConfig(*c) for c in [
    (16, 64, 128, 1, 4, 4), (16, 32, 128, 1, 4, 4), (16, 16, 256, 1, 4, 4), (16, 32, 256, 1, 4, 4),
    (16, 32, 128, 1, 4, 6), (16, 64, 128, 1, 4, 6), (16, 16, 128, 1, 4, 8), (16, 64, 64, 1, 4, 6),
    (32, 32, 128, 1, 4, 6), (32, 64, 128, 1, 4, 4), (64, 32, 128, 1, 4, 4), (64, 64, 64, 1, 4, 4),
    (64, 64, 128, 1, 4, 4), (64, 128, 64, 8, 4, 4),
]]


def candidates(rows_out: int) -> list[GemmConfig]:
    if rows_out <= 64:
        return SMALL
    if rows_out <= 1024:
        return SMALL[-6:] + LARGE
    return LARGE


def sweep(ops, ms, shapes, layouts, rounds: int) -> list[dict]:
    device = torch.device("cuda")
    rows = []
    for op in ops:
        for k, n in shapes:
            for layout in (layouts if op != "db" else ("kn",)):
                for m in ms:
                    case = BenchCase(op, m, n, k, layout)
                    x, y, _ = operands(case, device)
                    ref, ref_launch = LAUNCHERS[op](x, y)
                    rows_out = m if op != "db" else k
                    fns, same = {}, {}
                    for cfg in candidates(rows_out):
                        try:
                            out = LAUNCHERS[op](x, y, config=cfg)[0]
                        except Exception as exc:  # a config that does not compile is reported, not fatal
                            rows.append({"name": case.name, "config": cfg.label(), "error": repr(exc)[:300]})
                            continue
                        same[cfg.label()] = compare_bits(out, ref).as_row()
                        fns[cfg.label()] = (lambda c=cfg: LAUNCHERS[op](x, y, config=c))
                    timings = time_interleaved(fns, device, rounds=rounds, rep_ms=20)
                    flops = 2.0 * m * n * k
                    for label, t in timings.items():
                        rows.append({"name": case.name, "op": op, "M": m, "N": n, "K": k, "layout": layout,
                                     "config": label, "table_config": ref_launch.config.label(),
                                     "median_us": t.median_us, "p20_us": t.p20_us, "p80_us": t.p80_us,
                                     "tflops": flops / (t.median_us * 1e-6) / 1e12,
                                     "bits_equal_table": same[label]["equal"],
                                     "mismatches": same[label]["mismatches"]})
                    best = min((r for r in rows if r.get("name") == case.name and "median_us" in r),
                               key=lambda r: r["median_us"])
                    print(f"{case.name}: best {best['config']} {best['median_us']:.1f}us "
                          f"{best['tflops']:.0f} TFLOP/s (table {ref_launch.config.label()})", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", nargs="+", default=["fwd", "da", "db"])
    parser.add_argument("--m", nargs="+", type=int, default=[16, 128, 1024, 4096, 16384])
    parser.add_argument("--layouts", nargs="+", default=["linear", "kn"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    start = time.time()
    rows = sweep(args.ops, args.m, ((4096, 6144), (6144, 4096)), args.layouts, args.rounds)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "seconds": time.time() - start, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
