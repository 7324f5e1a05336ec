"""FP32 det_gemm against torch.matmul at the same FP32 matmul precision: GPU time (CUDA-graph replay) and eager time
(back-to-back calls between CUDA events), at lm_head shapes (K 4096, N 151936 and 128256) and K = N = 4096 by
default, M 1 to 4096, on nn.Linear weights (``weight.t()``) or contiguous [K, N] weights (``--layouts``), with the
timing protocol of ``detkit bench gemm`` (toolkit/timing.py's ``time_graphs`` and ``time_back_to_back``: medians with
p20/p80 and the SM clock, implementations interleaved round by round). Operands smaller than a few L2s are rotated
through copies (bench/gemm.py's rotation sets), so consecutive calls do not find the weight cached; an lm_head's
weight (2.5 GB) is one set.

Validated before it is timed: the first and last rows against the FP64 oracle within the FP32 contract bound, and
row 0's bits equal to the smallest M's (M = 1 by default: batch invariance). Candidates, each timed beside the table's pick and
torch.matmul (eager and GPU time) after its output is compared bit for bit with the pick's:
- ``--candidates``: at M <= 16 ("ieee" fwd and dA) the small-M kernel's candidates
  (``configs.gemv_candidates``: every variant, other tiles and pipeline depths; the first is the table's pick, timed
  as "detkit") and, for reference, the tile kernel's former M <= 16 pick (16x64x32) and its FMA dot on a tile of the
  band's rows;
- ``--fma``: at M > 16 ("ieee"), the Gluon FMA-dot kernel's tiles (``configs.fma_candidates``, variant "fma";
  sm_90 only);
- ``--config``: tiles given on the command line, at every case (``BM,BN,BK,GROUP_M,WARPS,STAGES[,VARIANT]``).

    python -m tools.fp32_gemm_bench --device cuda --out DIR [--precision ieee tf32] [--ops fwd da db]
        [--kn 4096,151936 ...] [--m 1 16 ...] [--layouts linear kn] [--candidates] [--fma]
        [--config 128,128,32,8,8,3 ...] [--rounds 3] [--warm 12 [--warm-only]]

``--warm N`` compiles every launch of the run in N processes first (Triton's on-disk cache, TRITON_CACHE_DIR), at
small sizes of the same specialization (the reduced dim at its real size); ``--warm-only`` stops there.

Writes DIR/rows.jsonl (one row per (op, K, N, layout, M, precision): the table's pick, torch.matmul and the
candidates), streamed as they are measured, and DIR/summary.md (detkit / torch.matmul per row, eager and GPU time, the
1.2x target; the candidates per row, the fastest marked). Exit status 1 if a validation or a candidate's bits failed.
On the CPU (Triton interpreter) the timings are wall-clock plumbing checks, never speed results.

Formulas: ratio = time / torch.matmul's time in the same run (> 1: slower); TFLOP/s = 2 M N K / GPU time; weight
GB/s = 4 K N / GPU time (the stream an M <= 16 call is bound by).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

TARGET = 1.2  # detkit / torch.matmul, eager and GPU time, at the same precision setting
DEFAULT_KN = ("4096,151936", "4096,128256", "4096,4096")
DEFAULT_M = (1, 16, 64, 128, 256, 1024, 4096)
CHECK_ROWS = 4  # rows validated against the FP64 oracle at each end of the output
SAMPLE_GPU_S = 3e-3  # calls per eager sample / graph: about this much estimated GPU time (1 to 32 calls)
EAGER_SAMPLES_PER_ROUND = 3  # eager samples per implementation and round on CUDA (one on the interpreter)
SMALL_M = 16  # --candidates: the small-M kernel's rows


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


def weight(n: int, k: int, layout: str, gen, device):
    """The weight as det_gemm's b [K, N]: nn.Linear's [N, K] transposed (``linear``) or a contiguous [K, N] (``kn``)."""
    import torch

    if layout == "linear":
        return (torch.randn((n, k), generator=gen, device=device) * k**-0.5).t()
    return torch.randn((k, n), generator=gen, device=device) * k**-0.5


def operands(op: str, m: int, n: int, k: int, device, layout: str = "linear"):
    """Seeded FP32 operands drawn on the device: (x, y) of det_gemm_<op>."""
    import torch

    gen = torch.Generator(device=device).manual_seed(7)
    if op == "db":
        return torch.randn((m, k), generator=gen, device=device), torch.randn((m, n), generator=gen, device=device)
    w = weight(n, k, layout, gen, device)
    return torch.randn((m, k if op == "fwd" else n), generator=gen, device=device), w


def output_cols(op: str, n: int, k: int) -> int:
    return k if op == "da" else n


def table_pick(op: str, m: int, n: int, k: int, precision: str):
    """The FP32 (or TF32) table's pick at the real sizes (FP32 picks are pointer or small-M kernels: no TMA rule)."""
    import torch

    from detkit.kernels.det_gemm.configs import select_config

    rows, cols = {"fwd": (m, n), "da": (m, k), "db": (k, n)}[op]
    return select_config(op, m, cols=cols, rows=rows, dtype=torch.float32, precision=precision)


def candidate_configs(op: str, m: int, n: int, k: int, precision: str, small_m: bool, extra, fma: bool = False) -> list:
    """The configs timed beside the table's pick at one case, the pick left out."""
    from detkit.kernels.det_gemm.configs import GemmConfig, fma_candidates, gemv_band, gemv_candidates

    out = []
    if small_m and precision == "ieee" and op != "db" and m <= SMALL_M:
        band = gemv_band(m)
        # the tile kernel's former M <= 16 pick, and its FMA dot on a tile of the band's rows (tl.dot takes M >= 1)
        out += [*gemv_candidates(m, output_cols(op, n, k), op), GemmConfig(16, 64, 32, 1, 4, 4),
                GemmConfig(band, 128, 32, 1, 4, 4)]
    if fma and precision == "ieee" and m > SMALL_M:
        out += fma_candidates()
    out += list(extra)
    pick = table_pick(op, m, n, k, precision)
    return [c for c in dict.fromkeys(out) if c != pick]


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


def time_impls(passes: dict, device, calls: int, rounds: int) -> dict:
    """{impl: {"eager": Timing, "graph": Timing | None, "graph_error": str?}} of ``passes`` (each one call per rotation
    set, ``calls`` calls in all): eager samples of back-to-back passes started on an idle GPU between CUDA events
    (``time_back_to_back``) and CUDA-graph replays (``time_graphs``), implementations interleaved round by round."""
    from detkit.toolkit.timing import time_back_to_back, time_graphs

    names = {name: name for name in passes}
    eager = time_back_to_back(passes, device, rounds, calls_per_fn=calls,
                              samples_per_round=EAGER_SAMPLES_PER_ROUND if device.type == "cuda" else 1,
                              range_names=names)
    errors: dict[str, str] = {}
    graph = time_graphs(passes, device, calls_per_fn=calls, rounds=rounds, replays=2 if calls == 1 else 3,
                        range_names=names, errors=errors)
    out = {name: {"eager": eager[name], "graph": graph.get(name)} for name in passes}
    for name, why in errors.items():
        out[name]["graph_error"] = why
    return out


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def timing_fields(t: dict) -> dict:
    """The flat fields of one implementation's timings: ``{eager,graph}_{median,p20,p80}_us``, SM clocks, errors."""
    out = {}
    for timing in ("eager", "graph"):
        if t.get(timing) is not None:
            out[f"{timing}_median_us"] = t[timing].median_us
            out[f"{timing}_p20_us"] = t[timing].p20_us
            out[f"{timing}_p80_us"] = t[timing].p80_us
            out[f"{timing}_sm_clock_mhz"] = t[timing].sm_clock_mhz
    if "graph_error" in t:
        out["graph_error"] = t["graph_error"]
    return out


# ---- warm: compile every launch of a run in parallel processes ------------------------------------------------
def _size_class(v: int) -> int:
    """Triton's specialization class of an integer argument: 1, a multiple of 16, or neither (0)."""
    return 1 if v == 1 else 16 if v % 16 == 0 else 0


def _small(v: int) -> int:
    """A small size of ``v``'s class."""
    return {1: 1, 16: 16, 0: 17}[_size_class(v)]


def warm_specs(args) -> list[tuple]:
    """(op, m, n, k, layout, precision, config fields) of every kernel the run compiles: its launches, one per
    specialization (the config, the weight layout, each size's class, and the reduced dim's class and evenness in
    BLOCK_K, which the launch's constexprs and Triton's integer specialization see)."""
    extra = [parse_config(text) for text in args.config]
    specs = {}
    for precision in args.precision:
        for op in args.ops:
            for kn in args.kn:
                k, n = map(int, kn.split(","))
                reduced = {"fwd": k, "da": n}.get(op)
                for layout in (args.layouts if op != "db" else ("kn",)):
                    for m in sorted(set(args.m)):
                        configs = [table_pick(op, m, n, k, precision),
                                   *candidate_configs(op, m, n, k, precision, args.candidates, extra, args.fma)]
                        for c in configs:
                            red = m if reduced is None else reduced
                            key = (op, layout, precision, c, _size_class(m),
                                   _size_class(n if op != "da" else k), _size_class(red), red % c.block_k == 0)
                            specs.setdefault(key, (op, m, n, k, layout, precision, tuple(vars(c).values())))
    return list(specs.values())


def _warm_worker(specs: list) -> None:
    import torch

    from detkit.kernels.det_gemm.configs import GemmConfig
    from detkit.kernels.det_gemm.launch import LAUNCHERS

    device = torch.device("cuda")
    failures = 0
    for op, m, n, k, layout, precision, fields in specs:
        config = GemmConfig(*fields)
        # the reduced dim at its real size (the even-L flag and the loop), the others small of the same class
        if op == "fwd":
            x, y = operands(op, m, _small(n), k, device, layout)
        elif op == "da":
            x, y = operands(op, m, n, _small(k), device, layout)
        else:
            x, y = operands(op, m, _small(n), _small(k), device, layout)
        try:
            LAUNCHERS[op](x, y, config=config, precision=precision)
        except Exception as exc:  # noqa: BLE001 - one config that fails to compile must not stop the others
            failures += 1
            print(f"warm: {op} {layout} M={m} {config.label()}: {type(exc).__name__}: {first_line(exc)}", flush=True)
    torch.cuda.synchronize()
    if failures:
        raise SystemExit(1)


def warm(args) -> int:
    specs = warm_specs(args)
    workers = max(1, min(args.warm, len(specs)))
    start = time.time()
    procs = []
    for i in range(workers):
        proc = subprocess.Popen([sys.executable, "-m", "tools.fp32_gemm_bench", "--warm-worker", "--out", args.out],
                                stdin=subprocess.PIPE, text=True, env=os.environ.copy())
        proc.stdin.write(json.dumps(specs[i::workers]))
        proc.stdin.close()
        procs.append(proc)
    codes = [p.wait() for p in procs]
    print(f"fp32_gemm_bench warm: {len(specs)} launches in {workers} processes, {time.time() - start:.0f} s, exit "
          f"codes {codes}", flush=True)
    return max(codes)


# ---- the run --------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ops", nargs="+", default=["fwd"], choices=["fwd", "da", "db"])
    parser.add_argument("--kn", nargs="+", default=list(DEFAULT_KN), metavar="K,N")
    parser.add_argument("--m", nargs="+", type=int, default=list(DEFAULT_M))
    parser.add_argument("--layouts", nargs="+", default=["linear"], choices=["linear", "kn"],
                        help="the weight as nn.Linear's weight.t() (linear) or a contiguous [K, N] (kn); dB has none")
    parser.add_argument("--precision", nargs="+", default=["ieee", "tf32"], choices=["ieee", "tf32"],
                        help="torch's FP32 matmul precision for the baseline (set_float32_matmul_precision "
                             "'highest' / 'high') and det_gemm's products")
    parser.add_argument("--candidates", action="store_true",
                        help="at M <= 16 (ieee fwd, dA): the small-M kernel's candidates and the tile references")
    parser.add_argument("--fma", action="store_true",
                        help="at M > 16 (ieee): the Gluon FMA-dot kernel's tiles (configs.fma_candidates; sm_90)")
    parser.add_argument("--config", nargs="*", default=[],
                        help="candidate tiles BM,BN,BK,GROUP_M,WARPS,STAGES[,VARIANT] at every case")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", type=int, default=0, metavar="N", help="compile every launch in N processes first")
    parser.add_argument("--warm-only", action="store_true", help="with --warm: compile, then stop")
    parser.add_argument("--warm-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel import
    if args.warm_worker:
        _warm_worker([tuple(s) for s in json.loads(sys.stdin.read())])
        return 0
    for text in args.config:  # refuse a bad tile before any work
        parse_config(text)
    if args.warm:
        if args.device != "cuda":
            parser.error("--warm compiles for the GPU: it needs --device cuda")
        if warm(args):
            return 1
        if args.warm_only:
            return 0
    elif args.warm_only:
        parser.error("--warm-only needs --warm N")
    return run(args)


def run(args) -> int:
    import torch

    from detkit.bench.gemm import _rotation_sets, baseline_call, public_op  # torch.matmul on det_gemm's views
    from detkit.kernels.det_gemm.launch import LAUNCHERS
    from detkit.kernels.det_gemm.names import case_name
    from detkit.mode.gemm import fp32_products
    from detkit.toolkit.contract import compare_bits

    extra = [parse_config(text) for text in args.config]  # after the interpreter switch: it imports the kernels
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter)"
    meta = {"gpu": gpu, "torch": torch.__version__, "backend": "cuda_sm90" if cuda else "triton_interpreter",
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
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
                    for layout in (args.layouts if op != "db" else ("kn",)):
                        # One draw at the largest M; each M takes its first rows (views), so row 0 is the same row
                        # in every call and its bits can be compared with the smallest M's.
                        x_all, y_all = operands(op, max(args.m), n, k, device, layout)
                        first_row = None
                        for m in sorted(args.m):
                            x, y = (x_all[:m], y_all[:m]) if op == "db" else (x_all[:m], y_all)
                            launch = LAUNCHERS[op]
                            c, record = launch(x, y, precision=precision)
                            ok, worst = validate(op, x, y, c, precision)
                            invariant = None
                            if op != "db":
                                if first_row is None:
                                    first_row = c[:1].clone()
                                invariant = compare_bits(c[:1], first_row).equal
                            failed |= not ok or invariant is False
                            cands = candidate_configs(op, m, n, k, precision, args.candidates, extra, args.fma)
                            bits, errors = {}, {}
                            for config in cands:
                                try:
                                    got, _ = launch(x, y, precision=precision, config=config)
                                except Exception as exc:  # noqa: BLE001 - reported in its row; the others still run
                                    errors[config.label()] = f"{type(exc).__name__}: {first_line(exc)}"
                                    failed = True
                                    continue
                                bits[config.label()] = compare_bits(got, c).equal
                                failed |= not bits[config.label()]
                                del got
                            cands = [config for config in cands if config.label() not in errors]
                            fn = public_op(op)  # det_gemm_fwd / da / db, as a user calls them
                            # the timed call is the public op ("tf32" dA / dB may run as a forward product): its
                            # bits against the launcher's validated result
                            public_bits = compare_bits(fn(x, y, precision), c).equal
                            failed |= not public_bits
                            del c
                            sets = _rotation_sets(x, y) if cuda else [(x, y)]
                            per_set = {"detkit": [lambda a=a, b=b: fn(a, b, precision) for a, b in sets],
                                       "torch": [baseline_call(op, a, b) for a, b in sets]}
                            for config in cands:
                                per_set[config.label()] = [
                                    lambda a=a, b=b, config=config: launch(a, b, precision=precision, config=config)
                                    for a, b in sets]
                            target = max(1, min(32, math.ceil(SAMPLE_GPU_S / est_call_s(m, n, k, precision))))
                            reps = -(-target // len(sets)) if cuda else 1  # the interpreter's calls: plumbing only
                            passes = {name: (lambda calls=calls: [call() for _ in range(reps) for call in calls])
                                      for name, calls in per_set.items()}
                            timed = time_impls(passes, device, reps * len(sets), args.rounds)
                            name = case_name(op, m, n, k, f"fp32 {precision}")
                            row = {**meta, "name": name, "op": op, "m": m, "n": n, "k": k, "layout": layout,
                                   "precision": precision, "config": record.config.label(), "valid": ok,
                                   "worst_ratio_to_bound": worst, "row0_bits_as_m1": invariant,
                                   "public_bits_as_launch": public_bits,
                                   "calls_per_sample": reps * len(sets), "rotation_sets": len(sets)}
                            for impl in ("detkit", "torch"):
                                row.update({f"{impl}_{key}": v for key, v in timing_fields(timed[impl]).items()})
                            for timing in ("eager", "graph"):
                                d, b = row.get(f"detkit_{timing}_median_us"), row.get(f"torch_{timing}_median_us")
                                row[f"{timing}_ratio"] = d / b if d and b else None
                            graph_us = row.get("detkit_graph_median_us")
                            row["tflops_detkit_graph"] = 2.0 * m * n * k / graph_us / 1e6 if graph_us else None
                            row["weight_gbs_detkit_graph"] = 4.0 * k * n / graph_us / 1e3 if graph_us else None
                            if cands or errors:
                                row["candidates"] = {label: {"error": why} for label, why in errors.items()}
                                for config in cands:
                                    fields = timing_fields(timed[config.label()])
                                    for timing in ("eager", "graph"):
                                        b = row.get(f"torch_{timing}_median_us")
                                        v = fields.get(f"{timing}_median_us")
                                        fields[f"{timing}_ratio"] = v / b if v and b else None
                                    row["candidates"][config.label()] = {"bits_as_pick": bits[config.label()],
                                                                         **fields}
                            rows.append(row)
                            sink.write(json.dumps(row) + "\n")
                            sink.flush()
                            (out_dir / "summary.md").write_text(summary(rows, meta))  # a run cut short keeps its rows
                            print(f"{name} {layout}: valid={ok} invariant={invariant} eager "
                                  f"{row['eager_ratio'] or float('nan'):.3f}x graph {row['graph_ratio'] or float('nan'):.3f}x "
                                  f"({record.config.label()}){fastest_note(row)}", flush=True)
                            del x, y, passes, per_set, sets, timed
                            if cuda:
                                torch.cuda.empty_cache()
                        del x_all, y_all
    torch.set_float32_matmul_precision(saved)
    (out_dir / "summary.md").write_text(summary(rows, meta))
    return 1 if failed else 0


def fastest(row: dict, timing: str = "graph") -> tuple[str, float] | None:
    """(label, median us) of the fastest of the table's pick and the candidates in ``timing``."""
    times = {row["config"]: row.get(f"detkit_{timing}_median_us")}
    times.update({label: c.get(f"{timing}_median_us") for label, c in row.get("candidates", {}).items()})
    times = {k: v for k, v in times.items() if isinstance(v, float)}
    return min(times.items(), key=lambda kv: kv[1]) if times else None


def fastest_note(row: dict) -> str:
    best = fastest(row)
    if not row.get("candidates") or best is None:
        return ""
    torch_us = row.get("torch_graph_median_us")
    ratio = f" ({best[1] / torch_us:.3f}x)" if torch_us else ""
    return f"; fastest in GPU time {best[0]}{ratio}"


def summary(rows: list[dict], meta: dict) -> str:
    lines = [f"# FP32 det_gemm vs torch.matmul ({meta['gpu']}, torch {meta['torch']}, {meta['backend']})", "",
             f"Target: detkit / torch.matmul <= {TARGET} in eager and GPU time at the same precision setting.", "",
             "| op | K | N | layout | M | precision | config | valid | row 0 = M 1 | eager detkit / torch (us) "
             "| eager ratio | graph detkit / torch (us) | graph ratio | detkit TFLOP/s | weight GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio_cell(v):
        return "-" if v is None else (f"{v:.3f}" if v <= TARGET else f"**{v:.3f}**")

    for r in rows:
        def us(impl, timing):
            v = r.get(f"{impl}_{timing}_median_us")
            return "-" if v is None else f"{v:.1f}"

        lines.append(f"| {r['op']} | {r['k']} | {r['n']} | {r['layout']} | {r['m']} | {r['precision']} | {r['config']} "
                     f"| {r['valid']} | {r['row0_bits_as_m1']} | {us('detkit', 'eager')} / {us('torch', 'eager')} "
                     f"| {ratio_cell(r.get('eager_ratio'))} | {us('detkit', 'graph')} / {us('torch', 'graph')} "
                     f"| {ratio_cell(r.get('graph_ratio'))} | {r['tflops_detkit_graph'] or 0:.1f} "
                     f"| {r['weight_gbs_detkit_graph'] or 0:.0f} |")
    for timing in ("eager", "graph"):
        ratios = [r[f"{timing}_ratio"] for r in rows if r.get(f"{timing}_ratio")]
        if ratios:
            within = sum(v <= TARGET for v in ratios)
            lines.append(f"\n{timing}: within {TARGET}x on {within} of {len(ratios)} rows; worst {max(ratios):.3f}x")
    cands = [r for r in rows if r.get("candidates")]
    if cands:
        lines += ["", "## Candidates (median us, p20-p80; ratio to torch.matmul; the table's pick first)", "",
                  "| op | K | N | layout | M | config | bits = pick | eager us | eager ratio | graph us | graph ratio |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in cands:
            best = fastest(r)
            entries = [(r["config"], True, {key.removeprefix("detkit_"): v for key, v in r.items()
                                            if key.startswith("detkit_")} | {"eager_ratio": r.get("eager_ratio"),
                                                                             "graph_ratio": r.get("graph_ratio")})]
            entries += [(label, c.get("bits_as_pick", c.get("error")), c) for label, c in r["candidates"].items()]
            for label, same, c in entries:
                def span(timing, c=c):
                    v = c.get(f"{timing}_median_us")
                    return "-" if v is None else (f"{v:.1f} ({c[f'{timing}_p20_us']:.1f}-"
                                                  f"{c[f'{timing}_p80_us']:.1f})")
                mark = " (fastest)" if best and label == best[0] else ""
                lines.append(f"| {r['op']} | {r['k']} | {r['n']} | {r['layout']} | {r['m']} | {label}{mark} | {same} "
                             f"| {span('eager')} | {ratio_cell(c.get('eager_ratio'))} | {span('graph')} "
                             f"| {ratio_cell(c.get('graph_ratio'))} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
