"""Config sweep for the pinned table: time candidate configs per (op, shape, M) on the GPU and check each
gives the same bits as the current table's pick. Not autotuning: a human reads the output and pins
entries in kernels/det_gemm/configs.py (bumping CONFIG_TABLE_VERSION); the audits then re-check them.

    python -m tools.gemm_tune --out results/tune.json            # from a checkout's root
    python -m tools.gemm_tune --ops fwd --m 1024 4096 16384 --variants tma --out results/tune-tma.json

The table's pick is always timed beside the candidates (the A/B baseline). A candidate that refuses a
case (a "tma" config on an operand TMA cannot address) or fails to compile is recorded as an error
row, never fatal. Timing (``--timing graphs``, the default): CUDA graphs of back-to-back calls over
rotating operand copies larger than the L2, as ``detkit bench gemm`` does, so Python launch overhead
(larger for "tma" configs, which build host-side descriptors per call) does not enter the numbers;
``--timing do_bench`` times single calls, L2 flushed (launch overhead included).
Formulas: FLOPs = 2*M*N*K; TFLOP/s = FLOPs / median per-call time.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from detkit.bench.gemm import BenchCase, _rotation_sets, operands
from detkit.kernels.det_gemm.launch import LAUNCHERS, VARIANTS, GemmConfig
from detkit.toolkit.contract import compare_bits
from detkit.toolkit.timing import time_graphs, time_interleaved

LARGE = [GemmConfig(*c) for c in [
    (128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (128, 256, 64, 16, 8, 4), (256, 128, 64, 8, 8, 3),
    (256, 128, 64, 8, 8, 4), (128, 128, 64, 8, 8, 4), (128, 128, 64, 8, 4, 4), (128, 128, 128, 8, 8, 3),
]]
# TMA variant (det_gemm_tma_kernel) at the large-M table picks' tile shapes; its case: fwd on weight.t().
LARGE_TMA = [GemmConfig(*c, variant="tma") for c in [
    (128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (128, 256, 64, 16, 8, 4), (256, 128, 64, 8, 8, 3),
    (256, 128, 64, 8, 8, 4), (128, 128, 64, 8, 8, 4),
]]
SMALL = [GemmConfig(*c) for c in [
    (16, 64, 128, 1, 4, 4), (16, 32, 128, 1, 4, 4), (16, 16, 256, 1, 4, 4), (16, 32, 256, 1, 4, 4),
    (16, 32, 128, 1, 4, 6), (16, 64, 128, 1, 4, 6), (16, 16, 128, 1, 4, 8), (16, 64, 64, 1, 4, 6),
    (32, 32, 128, 1, 4, 6), (32, 64, 128, 1, 4, 4), (64, 32, 128, 1, 4, 4), (64, 64, 64, 1, 4, 4),
    (64, 64, 128, 1, 4, 4), (64, 128, 64, 8, 4, 4),
]]

# Mid M (the "<= 1.10x cuBLASLt no-split-K" misses sit at M 128-1024, where one 128x128 tile set leaves
# most of 132 SMs idle or runs 1.5 waves): narrower tiles, pointer and TMA (all compile to wgmma for sm_90).
MID = [GemmConfig(*c) for c in [(128, 64, 64, 8, 4, 4)]]
MID_TMA = [GemmConfig(*c, variant="tma") for c in [
    (64, 64, 128, 1, 4, 4), (64, 128, 64, 8, 4, 4), (128, 64, 64, 8, 4, 4), (64, 256, 64, 8, 8, 3),
]]
# Three power-of-two sub-tiles per tile (det_gemm_tma3_kernel): 192 columns fill 132 SMs where powers of two
# do not (a 6144-wide output: 32 tile columns, so M 256 / 512 at 64 / 128 rows is 128 tiles, one wave, the
# grid cuBLAS runs there, per Nsight Compute). Compiled offline: 122 registers, no spills.
WIDE_TMA3 = [GemmConfig(*c, variant="tma3") for c in [
    (64, 192, 64, 8, 4, 4), (64, 192, 64, 8, 4, 6), (128, 192, 64, 8, 8, 3), (128, 192, 64, 8, 8, 4),
]]
# Deeper rings for the one-wave mid-M tiles (more bytes in flight per CTA where one CTA per SM streams all of K;
# Nsight Compute at fwd M=512 shows the tma3 tile's tensor pipe 66% active against cuBLAS's 79%).
# Compiled offline for sm_90: 131-230 KB of shared memory, no spills.
DEEP_MID = [GemmConfig(*c, variant="tma3") for c in [
    (128, 192, 64, 8, 8, 5), (64, 192, 64, 8, 4, 7), (64, 192, 128, 8, 4, 3), (128, 192, 32, 8, 8, 8),
]] + [GemmConfig(*c, variant="tma") for c in [
    (128, 128, 64, 8, 8, 5), (128, 128, 64, 8, 8, 6), (64, 128, 64, 8, 4, 8), (128, 128, 32, 8, 8, 8),
    (64, 128, 128, 8, 4, 4),
]]
# M = 128 (two 64-row tiles or one 128-row tile): deeper rings and 128-row tiles with narrow N, for the fwd / dA
# rows 1.15-1.20x cuBLASLt no-split-K on 64x64x128 s6 and 64x128x64 s6 tiles.
# Shared memory 192-224 KB.
M128_DEEP = [GemmConfig(*c, variant="tma") for c in [
    (64, 64, 128, 1, 4, 7), (64, 64, 64, 1, 4, 12), (64, 32, 128, 1, 4, 8), (128, 64, 128, 1, 8, 4),
    (128, 64, 64, 1, 8, 8), (128, 32, 128, 1, 4, 5), (64, 128, 64, 1, 4, 7),
]]
# Small M on TMA tiles (the pointer picks at M 32-128 are 1.15-1.80x cuBLASLt no-split-K): the weight stream
# is the work, so narrow N tiles (more CTAs: N/32 = 128-192 of them) and deeper pipelines (more bytes in flight).
SMALL_TMA = [GemmConfig(*c, variant="tma") for c in [
    (64, 32, 128, 1, 4, 4), (64, 32, 128, 1, 4, 6), (64, 32, 256, 1, 4, 4), (64, 64, 128, 1, 4, 6),
    (64, 64, 64, 1, 4, 8), (64, 64, 256, 1, 4, 3), (64, 128, 128, 1, 4, 4), (64, 128, 64, 8, 4, 6),
    (128, 64, 64, 8, 4, 6), (64, 128, 128, 8, 8, 3),
]]

# dB at small M: the [K, N] output is large and the reduction short, so large output tiles with few
# K steps (BLOCK_K down to 16) and shallow pipelines; the epilogue's write of the whole gradient dominates.
DB_SMALL_M = [GemmConfig(*c) for c in [
    (128, 256, 64, 8, 8, 2), (128, 256, 64, 8, 8, 3), (128, 256, 32, 8, 8, 3), (128, 256, 16, 8, 8, 2),
    (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 4, 3), (128, 128, 32, 8, 4, 4), (256, 128, 64, 8, 8, 3),
    (64, 256, 64, 8, 4, 3),
]] + [GemmConfig(*c, variant="tma") for c in [(128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3)]]

# Warp-specialized, persistent (kernels/det_gemm/ws.py, Gluon): one TMA producer warp feeding one or two
# consumer warpgroups (8 warps: each warpgroup its own partition and half of the tile's rows, cuBLAS's
# 384-thread cooperative shape), the ring refilled for the next tile during the epilogue. Compiled offline:
# no spills (168 registers at 8 warps, 255 at 4).
WS = [GemmConfig(*c, variant="ws") for c in [
    (128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (256, 128, 64, 8, 8, 4), (128, 128, 64, 8, 8, 6),
    (128, 128, 64, 8, 4, 4), (64, 128, 64, 8, 4, 6), (64, 256, 64, 8, 4, 4), (128, 64, 64, 8, 4, 6),
]]


def candidates(op: str, m: int, variants=VARIANTS) -> list[GemmConfig]:
    """Configs to time for ``op`` at batch size ``m`` (the table's pick is always timed beside them)."""
    if op == "db":
        out = DB_SMALL_M if m <= 512 else LARGE + LARGE_TMA
    elif m <= 64:
        out = SMALL + SMALL_TMA
    elif m <= 1024:
        out = SMALL[-6:] + MID + LARGE + LARGE_TMA + MID_TMA + SMALL_TMA + WIDE_TMA3 + DEEP_MID
        if m <= 256:
            out = out + M128_DEEP
    else:
        out = LARGE + LARGE_TMA
    if m >= 128:
        out = out + WS
    return [c for c in out if c.variant in variants]


def _time(fns: dict, x, y, op: str, device: torch.device, rounds: int, timing: str) -> dict:
    if timing == "do_bench":
        return time_interleaved({label: (lambda c=cfg: LAUNCHERS[op](x, y, config=c)) for label, cfg in fns.items()},
                                device, rounds=rounds, rep_ms=20)
    sets = _rotation_sets(x, y) if device.type == "cuda" else [(x, y)]
    calls = {label: (lambda c=cfg: [LAUNCHERS[op](a, b, config=c) for a, b in sets]) for label, cfg in fns.items()}
    return time_graphs(calls, device, calls_per_fn=len(sets), rounds=rounds)


def sweep(ops, ms, shapes, layouts, rounds: int, variants=VARIANTS, timing: str = "graphs",
          device: torch.device = torch.device("cuda"), on_case=None) -> list[dict]:
    """Rows per (case, config): timing and bits vs the table's pick, or the error that refused it.
    ``on_case(rows)`` runs after each case (the CLI saves the rows so far: a run stopped by a time limit
    keeps what it measured)."""
    rows = []
    for op in ops:
        for k, n in shapes:
            for layout in (layouts if op != "db" else ("kn",)):
                for m in ms:
                    case = BenchCase(op, m, n, k, layout)
                    ids = {"name": case.name, "op": op, "M": m, "N": n, "K": k, "layout": layout}
                    x, y, _ = operands(case, device)
                    ref, ref_launch = LAUNCHERS[op](x, y)
                    table = ref_launch.config
                    fns, same = {table.label(): table}, {table.label(): compare_bits(ref, ref).as_row()}
                    for cfg in candidates(op, m, variants):
                        if cfg == table:
                            continue
                        try:
                            out = LAUNCHERS[op](x, y, config=cfg)[0]
                        except Exception as exc:  # refused layout or compile failure: recorded, not fatal
                            rows.append({**ids, "config": cfg.label(), "variant": cfg.variant,
                                         "table_config": table.label(), "error": repr(exc)[:300]})
                            print(f"{case.name}: {cfg.label()} error {repr(exc)[:120]}", flush=True)
                            continue
                        same[cfg.label()] = compare_bits(out, ref).as_row()
                        fns[cfg.label()] = cfg
                        del out
                    timings = _time(fns, x, y, op, device, rounds, timing)
                    flops = 2.0 * m * n * k
                    case_rows = [{**ids, "config": label, "variant": fns[label].variant,
                                  "table_config": table.label(), "is_table": label == table.label(), "timing": timing,
                                  "median_us": t.median_us, "p20_us": t.p20_us, "p80_us": t.p80_us,
                                  "tflops": flops / (t.median_us * 1e-6) / 1e12,
                                  "bits_equal_table": same[label]["equal"],
                                  "mismatches": same[label]["mismatches"]} for label, t in timings.items()]
                    rows += case_rows
                    best = min(case_rows, key=lambda r: r["median_us"])
                    pick = next(r for r in case_rows if r["is_table"])
                    differ = [r["config"] for r in case_rows if not r["bits_equal_table"]]
                    print(f"{case.name}: best {best['config']} {best['median_us']:.1f}us {best['tflops']:.0f} "
                          f"TFLOP/s; table {pick['config']} {pick['tflops']:.0f} TFLOP/s; "
                          f"bits differ from table: {differ or 'none'}", flush=True)
                    if on_case is not None:
                        on_case(rows)
    return rows


def ab_summary(rows: list[dict]) -> list[dict]:
    """Per (op, layout, N, K): median TFLOP/s over M of the table's pick and of the best candidate of each
    variant ("ptr", "tma", "tma3"; best = highest median over the M values swept), and tma / table."""
    import statistics

    out = []
    timed = [r for r in rows if "tflops" in r]
    for op, layout, n, k in dict.fromkeys((r["op"], r["layout"], r["N"], r["K"]) for r in timed):
        sel = [r for r in timed if (r["op"], r["layout"], r["N"], r["K"]) == (op, layout, n, k)]
        per_config = {}
        for r in sel:
            per_config.setdefault((r["config"], r["variant"]), []).append(r["tflops"])
        med = {key: statistics.median(v) for key, v in per_config.items()}
        table = statistics.median(r["tflops"] for r in sel if r["is_table"])
        row = {"op": op, "layout": layout, "N": n, "K": k, "Ms": sorted({r["M"] for r in sel}),
               "table_tflops": table}
        for variant in VARIANTS:
            cands = {key: v for key, v in med.items() if key[1] == variant}
            if cands:
                best = max(cands, key=cands.get)
                row[f"best_{variant}"], row[f"best_{variant}_tflops"] = best[0], cands[best]
                row[f"best_{variant}_vs_table"] = cands[best] / table
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", nargs="+", default=["fwd", "da", "db"])
    parser.add_argument("--m", nargs="+", type=int, default=[16, 128, 1024, 4096, 16384])
    parser.add_argument("--layouts", nargs="+", default=["linear", "kn"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                        help="candidate kernel variants (the table's pick is always timed)")
    parser.add_argument("--timing", default="graphs", choices=["graphs", "do_bench"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    start = time.time()

    def save(rows, summary=None):
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "timing": args.timing, "complete": summary is not None,
                       "seconds": time.time() - start, "ab_summary": summary or [], "rows": rows}, f, indent=1)

    rows = sweep(args.ops, args.m, ((4096, 6144), (6144, 4096)), args.layouts, args.rounds,
                 variants=tuple(args.variants), timing=args.timing, on_case=save)
    summary = ab_summary(rows)
    for r in summary:
        print(f"A/B {r['op']} b={r['layout']} N={r['N']} K={r['K']} M={r['Ms']}: table {r['table_tflops']:.0f}; "
              f"best ptr {r.get('best_ptr')} {r.get('best_ptr_tflops', float('nan')):.0f}; "
              f"best tma {r.get('best_tma')} {r.get('best_tma_tflops', float('nan')):.0f} "
              f"(x{r.get('best_tma_vs_table', float('nan')):.3f} vs table); "
              f"best ws {r.get('best_ws')} {r.get('best_ws_tflops', float('nan')):.0f} "
              f"(x{r.get('best_ws_vs_table', float('nan')):.3f} vs table) TFLOP/s, median over M", flush=True)
    save(rows, summary)
    differ = [r for r in rows if r.get("bits_equal_table") is False]
    if differ:  # a candidate that changes bits must never be pinned: make the run fail loudly
        raise SystemExit(f"{len(differ)} (case, config) pairs gave bits different from the table's pick; "
                         f"first: {differ[0]['name']} {differ[0]['config']}")


if __name__ == "__main__":
    main()
