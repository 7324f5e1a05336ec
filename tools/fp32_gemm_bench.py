"""FP32 det_gemm against torch.matmul at the same FP32 matmul precision: GPU time (CUDA-graph replay) and eager time
(back-to-back calls between CUDA events), at lm_head shapes (K 4096, N 151936 and 128256) and K = N = 4096, M 1 to
4096, nn.Linear weights (``weight.t()``), with the timing protocol of ``detkit bench gemm`` (toolkit/timing.py's
``time_graphs`` and ``time_back_to_back``: medians with p20/p80 and the SM clock; operands far beyond the L2 at the
lm_head shapes). Validated before it is timed: the first and last rows against the FP64 oracle within the FP32
contract bound, and row 0's bits equal to the M = 1 call's (batch invariance). ``--config`` adds candidate tiles
(GPU time only) for the FP32 table's next version.

    python -m tools.fp32_gemm_bench --device cuda --out DIR [--precision ieee tf32] [--ops fwd da db]
        [--kn 4096,151936 ...] [--m 1 16 ...] [--config 128,128,32,8,8,3 ...] [--rounds 3]

Writes DIR/rows.jsonl (one row per (op, K, N, M, precision, implementation)), streamed as they are measured, and
DIR/summary.md (detkit / torch.matmul per row, eager and GPU time; the 1.2x target). Exit status 1 if a validation
failed. On the CPU (Triton interpreter) the timings are wall-clock plumbing checks, never speed results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

TARGET = 1.2  # detkit / torch.matmul, eager and GPU time, at the same precision setting
DEFAULT_KN = ("4096,151936", "4096,128256", "4096,4096")
DEFAULT_M = (1, 16, 64, 128, 256, 1024, 4096)
CHECK_ROWS = 4  # rows validated against the FP64 oracle at each end of the output
SAMPLE_GPU_S = 3e-3  # calls per eager sample / graph: about this much estimated GPU time (1 to 32 calls)


def est_call_s(m: int, n: int, k: int, precision: str) -> float:
    """A rough GPU time per call (FP32 FMA ~40 TFLOP/s, TF32 ~300, 3 TB/s): how many calls a sample needs."""
    rate = 40e12 if precision == "ieee" else 300e12
    return 2.0 * m * n * k / rate + 4.0 * (m * k + k * n + m * n) / 3e12


def parse_config(text: str):
    from detkit.kernels.det_gemm.configs import GemmConfig

    parts = text.split(",")
    if len(parts) not in (6, 7):
        raise argparse.ArgumentTypeError(f"--config {text!r}: BM,BN,BK,GROUP_M,WARPS,STAGES[,VARIANT]")
    return GemmConfig(*map(int, parts[:6]), *(parts[6:]))


def operands(op: str, m: int, n: int, k: int, device):
    """Seeded FP32 operands drawn on the device: (x, y) of det_gemm_<op>, the weight as nn.Linear's [N, K]."""
    import torch

    gen = torch.Generator(device=device).manual_seed(7)
    w = torch.randn((n, k), generator=gen, device=device) * k**-0.5  # nn.Linear weight [N, K]
    if op == "fwd":
        return torch.randn((m, k), generator=gen, device=device), w.t()
    if op == "da":
        return torch.randn((m, n), generator=gen, device=device), w.t()
    return torch.randn((m, k), generator=gen, device=device), torch.randn((m, n), generator=gen, device=device)


def validate(op: str, x, y, c, precision: str) -> tuple[bool, float]:
    """The first and last CHECK_ROWS output rows (fwd, dA) or columns (dB) within the FP32 bound of the FP64 oracle;
    (passed, worst error / bound)."""
    import torch

    from detkit.toolkit.contract import check_bound, gemm_bound_fp32

    x64, y64 = x.double(), y.double()
    if op == "db":
        cols = sorted(set(range(min(CHECK_ROWS, c.shape[1]))) | set(range(max(0, c.shape[1] - CHECK_ROWS), c.shape[1])))
        star, abs_ab, got, reduced = x64.t() @ y64[:, cols], x64.abs().t() @ y64[:, cols].abs(), c[:, cols], x.shape[0]
    else:
        rows = sorted(set(range(min(CHECK_ROWS, c.shape[0]))) | set(range(max(0, c.shape[0] - CHECK_ROWS), c.shape[0])))
        yy = y64 if op == "fwd" else y64.t()
        star, abs_ab, got = x64[rows] @ yy, x64[rows].abs() @ yy.abs(), c[rows]
        reduced = x.shape[1]
    result = check_bound(got, star, gemm_bound_fp32(star, abs_ab, reduced, precision))
    del star, abs_ab, x64, y64
    if c.is_cuda:
        torch.cuda.empty_cache()
    return result.passed, result.worst_ratio


EAGER_SAMPLES_PER_ROUND = 3  # eager samples per implementation and round on CUDA (one on the interpreter)


def time_pair(fns: dict, device, calls: int, rounds: int) -> dict:
    """{impl: {"eager": Timing, "graph": Timing}}: eager bursts of ``calls`` back-to-back calls started on an idle
    GPU between CUDA events (``time_back_to_back``) and CUDA-graph replays of ``calls`` calls (``time_graphs``),
    implementations interleaved round by round."""
    from detkit.toolkit.timing import time_back_to_back, time_graphs

    bursts = {name: (lambda fn=fn: [fn() for _ in range(calls)]) for name, fn in fns.items()}
    names = {name: name for name in fns}
    eager = time_back_to_back(bursts, device, rounds, calls_per_fn=calls,
                              samples_per_round=EAGER_SAMPLES_PER_ROUND if device.type == "cuda" else 1,
                              range_names=names)
    errors: dict[str, str] = {}
    graph = time_graphs(bursts, device, calls_per_fn=calls, rounds=rounds, replays=2 if calls == 1 else 3,
                        range_names=names, errors=errors)
    out = {name: {"eager": eager[name], "graph": graph.get(name)} for name in fns}
    for name, why in errors.items():
        out[name]["graph_error"] = why
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ops", nargs="+", default=["fwd"], choices=["fwd", "da", "db"])
    parser.add_argument("--kn", nargs="+", default=list(DEFAULT_KN), metavar="K,N")
    parser.add_argument("--m", nargs="+", type=int, default=list(DEFAULT_M))
    parser.add_argument("--precision", nargs="+", default=["ieee", "tf32"], choices=["ieee", "tf32"],
                        help="torch's FP32 matmul precision for the baseline (set_float32_matmul_precision "
                             "'highest' / 'high') and det_gemm's products")
    parser.add_argument("--config", nargs="*", default=[],
                        help="candidate tiles BM,BN,BK,GROUP_M,WARPS,STAGES[,VARIANT], GPU time beside the table's")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel import
    import torch

    from detkit.bench.gemm import baseline_call  # torch.matmul on the views det_gemm reads
    from detkit.kernels.det_gemm.launch import LAUNCHERS
    from detkit.kernels.det_gemm.names import case_name
    from detkit.mode.gemm import fp32_products
    from detkit.toolkit.timing import time_graphs

    configs = [parse_config(text) for text in args.config]  # after the interpreter switch: it imports the kernels
    device = torch.device(args.device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    meta = {"gpu": gpu, "torch": torch.__version__, "backend": "cuda_sm90" if device.type == "cuda" else
            "triton_interpreter", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    rows, failed = [], False
    saved = torch.get_float32_matmul_precision()
    with open(out_dir / "rows.jsonl", "w") as sink:
        for precision in args.precision:
            torch.set_float32_matmul_precision("highest" if precision == "ieee" else "high")
            if fp32_products() != precision:
                raise RuntimeError(f"torch's setting reads as {fp32_products()!r}, not {precision!r}")
            for op in args.ops:
                for kn in args.kn:
                    k, n = map(int, kn.split(","))
                    first_row = None
                    # One draw at the largest M; each M takes its first rows (views), so row 0 is the same row
                    # in every call and its bits can be compared with M = 1's.
                    x_all, y_all = operands(op, max(args.m), n, k, device)
                    for m in sorted(args.m):
                        x, y = (x_all[:m], y_all[:m]) if op == "db" else (x_all[:m], y_all)
                        launch = LAUNCHERS[op]
                        c, record = launch(x, y, precision=precision)
                        ok, worst = validate(op, x, y, c, precision)
                        invariant = None
                        if op != "db":
                            if first_row is None:
                                first_row = c[:1].clone()
                            invariant = bool(torch.equal(c[:1].view(torch.int32), first_row.view(torch.int32)))
                        failed |= not ok or invariant is False
                        del c
                        calls = max(1, min(32, math.ceil(SAMPLE_GPU_S / est_call_s(m, n, k, precision))))
                        calls = calls if device.type == "cuda" else 1  # the interpreter's calls: plumbing only
                        fns = {"detkit": lambda x=x, y=y, op=op: launch(x, y, precision=precision),
                               "torch": baseline_call(op, x, y)}
                        timed = time_pair(fns, device, calls, args.rounds)
                        name = case_name(op, m, n, k, f"fp32 {precision}")
                        row = {**meta, "name": name, "op": op, "m": m, "n": n, "k": k, "precision": precision,
                               "config": record.config.label(), "valid": ok, "worst_ratio_to_bound": worst,
                               "row0_bits_as_m1": invariant, "calls_per_sample": calls}
                        for impl, t in timed.items():
                            for timing in ("eager", "graph"):
                                if t.get(timing) is not None:
                                    row[f"{impl}_{timing}_median_us"] = t[timing].median_us
                                    row[f"{impl}_{timing}_p20_us"] = t[timing].p20_us
                                    row[f"{impl}_{timing}_p80_us"] = t[timing].p80_us
                                    row[f"{impl}_{timing}_sm_clock_mhz"] = t[timing].sm_clock_mhz
                            if "graph_error" in t:
                                row[f"{impl}_graph_error"] = t["graph_error"]
                        for timing in ("eager", "graph"):
                            d, b = row.get(f"detkit_{timing}_median_us"), row.get(f"torch_{timing}_median_us")
                            row[f"{timing}_ratio"] = d / b if d and b else None
                        row["tflops_detkit_graph"] = (2.0 * m * n * k / row["detkit_graph_median_us"] / 1e6
                                                      if row.get("detkit_graph_median_us") else None)
                        candidates = {}
                        for config in configs:
                            cand = {config.label(): lambda x=x, y=y, config=config: launch(
                                x, y, precision=precision, config=config)}
                            errors: dict[str, str] = {}
                            t = time_graphs({name: (lambda fn=fn: [fn() for _ in range(calls)])
                                             for name, fn in cand.items()}, device, calls_per_fn=calls,
                                            rounds=args.rounds, replays=2, errors=errors)
                            for label in cand:
                                candidates[label] = t[label].median_us if label in t else errors.get(label)
                        if candidates:
                            row["candidates_graph_median_us"] = candidates
                        rows.append(row)
                        sink.write(json.dumps(row) + "\n")
                        sink.flush()
                        print(f"{name}: valid={ok} invariant={invariant} eager {row['eager_ratio'] or float('nan'):.3f}x "
                              f"graph {row['graph_ratio'] or float('nan'):.3f}x ({record.config.label()})", flush=True)
                        del x, y, fns, timed
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    del x_all, y_all
    torch.set_float32_matmul_precision(saved)
    (out_dir / "summary.md").write_text(summary(rows, meta))
    return 1 if failed else 0


def summary(rows: list[dict], meta: dict) -> str:
    lines = [f"# FP32 det_gemm vs torch.matmul ({meta['gpu']}, torch {meta['torch']}, {meta['backend']})", "",
             f"Target: detkit / torch.matmul <= {TARGET} in eager and GPU time at the same precision setting.", "",
             "| op | K | N | M | precision | config | valid | row 0 = M 1 | eager detkit / torch (us) | eager ratio "
             "| graph detkit / torch (us) | graph ratio | detkit TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def us(impl, timing):
            v = r.get(f"{impl}_{timing}_median_us")
            return "-" if v is None else f"{v:.1f}"

        def ratio(timing):
            v = r.get(f"{timing}_ratio")
            return "-" if v is None else (f"{v:.3f}" if v <= TARGET else f"**{v:.3f}**")
        lines.append(f"| {r['op']} | {r['k']} | {r['n']} | {r['m']} | {r['precision']} | {r['config']} | {r['valid']} "
                     f"| {r['row0_bits_as_m1']} | {us('detkit', 'eager')} / {us('torch', 'eager')} | {ratio('eager')} "
                     f"| {us('detkit', 'graph')} / {us('torch', 'graph')} | {ratio('graph')} "
                     f"| {r['tflops_detkit_graph'] or 0:.1f} |")
    for timing in ("eager", "graph"):
        ratios = [r[f"{timing}_ratio"] for r in rows if r.get(f"{timing}_ratio")]
        if ratios:
            within = sum(v <= TARGET for v in ratios)
            lines.append(f"\n{timing}: within {TARGET}x on {within} of {len(ratios)} rows; worst {max(ratios):.3f}x")
    cands = [r for r in rows if r.get("candidates_graph_median_us")]
    if cands:
        lines += ["", "## Candidate tiles (GPU time, us)", ""]
        for r in cands:
            best = {k: v for k, v in r["candidates_graph_median_us"].items() if isinstance(v, float)}
            pick = min(best, key=best.get) if best else "-"
            lines.append(f"- {r['name']}: table {r.get('detkit_graph_median_us', float('nan')):.1f}; "
                         + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} ({v})"
                                     for k, v in r["candidates_graph_median_us"].items()) + f"; fastest {pick}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
