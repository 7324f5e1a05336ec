"""det_gemm fwd/dA/dB against cuBLAS in the same run, interleaved: the ``detkit bench gemm`` plug-in.

Per case (op, M, N, K, weight layout) and implementation (detkit's public det_gemm_fwd/da/db; cuBLAS as
torch.matmul on the same operand views, prepared outside the timed call as a user holds them):
- ``host``: Python time per call until the launch is queued. Each call is timed alone (perf_counter) in bursts
  of HOST_CALLS behind a GPU sleep kernel, so the launch queue is never full and no call waits for the GPU.
- ``eager``: back-to-back calls over rotating operand copies (more bytes than the L2), timed with CUDA events
  around each burst: what an eager user feels, the larger of host time and GPU time per call.
- ``graph``: the same bursts captured in a CUDA graph and replayed: GPU time free of host time (the "GPU time"
  of the targets). Baseline also ``cublaslt_nosplitk``: the same torch.matmul in a worker process started with
  CUBLASLT_WORKSPACE_SIZE=1 (no workspace, so no split-K: batch-invariant rows, the bar for a deterministic
  kernel), which times det_gemm again beside it so each of its ratios comes from one process.
Every timing is toolkit.timing's (``time_host``, ``time_back_to_back``, ``time_graphs``): a median with p20/p80 over
interleaved rounds, warm-up excluded. Before timing, det_gemm's output is validated
against the contract bound of an FP64 oracle (in output blocks, so a zoo lm_head's oracle fits in memory); a row
``passed`` when it is within the bound.

``--zoo`` runs every linear-layer shape of the models in toolkit/presets.py (``MODELS``, ``zoo_shapes``) on
nn.Linear weights, GPU time only by default.

Formulas: FLOPs = 2*M*N*K; TFLOP/s = FLOPs / median GPU time; ratio = detkit time / baseline time (> 1: detkit
slower); MFU = TFLOP/s / ceiling, against the dense-BF16 cuBLAS ceiling measured in this run (8192^3, random data)
and the datasheet dense BF16 peak (989 TFLOP/s). Targets (ratios, detkit / cuBLAS, TARGETS): host <= 1.2 and eager
<= 1.10 on every row; GPU time per (op, shape, layout): median over M >= 1024 <= 1.05, median over M <= 256 <= 1.25,
no row above 1.5.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch

from detkit.toolkit.contract import check_bound, gemm_bound
from detkit.toolkit.fixtures import LAYOUTS
from detkit.toolkit.presets import ZOO_M_VALUES, zoo_shapes
from detkit.toolkit.timing import Timing, measured_ceiling_tflops, time_back_to_back, time_graphs, time_host

NAME = "gemm"
DESCRIPTION = ("det_gemm fwd/dA/dB vs cuBLAS in one run: host us per call, eager and CUDA-graph GPU time "
               "(--zoo: every linear layer of real models)")
RANKS = "single"

OPS = ("fwd", "da", "db")
TIMINGS = ("host", "eager", "graph")
DATASHEET_BF16_TFLOPS = 989.0
M_VALUES = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
KN_SHAPES = ((4096, 6144), (6144, 4096))  # Qwen3-8B TP=2 MLP: gate/up and down
TINY_M_VALUES = (1, 7, 129)
TINY_KN_SHAPES = ((40, 56),)
WORKER_ENV = {"CUBLASLT_WORKSPACE_SIZE": "1"}
BENCH_SEED = 1
DEFAULT_ROUNDS = 5
MAX_DIM = 2**30

# Targets: ratio of detkit's time to cuBLAS's (torch.matmul), per row or as a median over M per (op, shape, layout).
TARGETS = {"host_max": 1.2, "eager_max": 1.10, "large_m": (1024, 1.05), "small_m": (256, 1.25), "graph_max": 1.5}

HOST_CALLS = 16  # calls per host-timing burst at most: far below the launch queue's depth
EAGER_MIN_CALLS = 32  # calls per eager sample at most: passes over the rotating sets until this many
EAGER_SAMPLES_PER_ROUND = 3
BURST_GPU_S = 5e-3  # host and eager bursts: calls for about this much estimated GPU time (2 at least)
GRAPH_MIN_REPLAY_S = 2e-3  # replays per graph sample: enough for about this much GPU time, 3 to 10

OPTIONS = (
    click.option("--ops", multiple=True, type=click.Choice(OPS), default=OPS, show_default=True),
    click.option("--m", "m_values", multiple=True, type=int,
                 help="M values (default: 1..16384; --zoo: 1..16384 in powers of two; tiny on cpu)."),
    click.option("--layouts", multiple=True, type=click.Choice(LAYOUTS),
                 help="fwd/dA weight layouts (default: kn and linear; --zoo: linear, nn.Linear's)."),
    click.option("--kn", "kn_shapes", multiple=True, metavar="K,N",
                 help="(K, N) shapes (default: the Qwen3-8B TP=2 MLP shapes; tiny on cpu)."),
    click.option("--zoo", is_flag=True, help="Every linear-layer shape of the zoo models (toolkit/presets.py)."),
    click.option("--layers", multiple=True, metavar="TEXT",
                 help="--zoo: only the shapes of layers whose name contains TEXT (e.g. 'Qwen3-8B tp2')."),
    click.option("--timings", multiple=True, type=click.Choice(TIMINGS),
                 help="What to time (default: host, eager and graph; --zoo: graph)."),
    click.option("--nosplitk/--no-nosplitk", default=None,
                 help="Also time cuBLASLt without split-K in a worker (default: on; off with --zoo)."),
)


@dataclass(frozen=True)
class BenchCase:
    op: str
    m: int
    n: int
    k: int
    layout: str
    layers: tuple[str, ...] = ()  # --zoo: the model layers with this (K, N)

    @property
    def name(self) -> str:
        from detkit.kernels.det_gemm.names import case_name

        return f"{case_name(self.op, self.m, self.n, self.k)} b={self.layout}"

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def shape(self) -> str:
        return f"K={self.k} N={self.n}"


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------
def _parse_kn(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in str(text).split(","))
    except ValueError:
        raise ValueError(f"--kn {text!r} is not K,N (two integers); e.g. --kn 4096,6144") from None
    if not (1 <= k < MAX_DIM and 1 <= n < MAX_DIM):
        raise ValueError(f"--kn {text!r}: K and N must be in [1, 2**30)")
    return k, n


def resolve_options(zoo: bool = False, timings=(), nosplitk: bool | None = None) -> tuple[tuple[str, ...], bool]:
    """(timings, nosplitk) with their defaults: everything for the Qwen3-8B TP=2 bench, GPU time only for the zoo."""
    timings = tuple(dict.fromkeys(timings)) or (("graph",) if zoo else TIMINGS)
    bad = [t for t in timings if t not in TIMINGS]
    if bad:
        raise ValueError(f"--timings {bad} not supported; supported: {TIMINGS}")
    return timings, (not zoo) if nosplitk is None else bool(nosplitk)


def cases(ctx, ops=OPS, m_values=(), layouts=(), kn_shapes=(), zoo=False, layers=(), timings=(), nosplitk=None,
          **_) -> list[BenchCase]:
    """The case list: the Qwen3-8B TP=2 MLP shapes (tiny ones on the interpreter) or, with ``zoo``, every zoo shape
    (optionally those of ``layers``); every option checked before any work."""
    ops = tuple(dict.fromkeys(ops or OPS))
    if not ops or not set(ops) <= set(OPS):
        raise ValueError(f"--ops {ops} not supported; supported: {OPS}")
    bad_m = [m for m in m_values if not isinstance(m, int) or not 1 <= m < MAX_DIM]
    if bad_m:
        raise ValueError(f"--m {bad_m}: M values must be integers in [1, 2**30)")
    if not set(layouts) <= set(LAYOUTS):
        raise ValueError(f"--layouts {tuple(layouts)} not supported; supported: {LAYOUTS}")
    resolve_options(zoo, timings, nosplitk)
    if layers and not zoo:
        raise ValueError("--layers selects zoo shapes: add --zoo")
    if zoo and kn_shapes:
        raise ValueError("--kn and --zoo both choose the shapes: pass one")
    if zoo and ctx.interpreted:
        raise ValueError("--zoo needs cuda_sm90: the zoo's shapes (up to 16384 x 151936) are far beyond the "
                         "Triton interpreter; use --device cuda")
    if zoo:
        shapes = [s for s in zoo_shapes() if not layers or any(t in layer for t in layers for layer in s.layers)]
        if not shapes:
            raise ValueError(f"--layers {tuple(layers)} matches no zoo layer; layers are named like 'Qwen3-8B tp2 q'")
        ms = tuple(m_values) or ZOO_M_VALUES
        layouts = tuple(layouts) or ("linear",)
        picked = [(s.k, s.n, s.layers) for s in shapes]
    else:
        default_kn = TINY_KN_SHAPES if ctx.interpreted else KN_SHAPES
        picked = [(k, n, ()) for k, n in ([_parse_kn(t) for t in kn_shapes] or default_kn)]
        ms = tuple(m_values) or (TINY_M_VALUES if ctx.interpreted else M_VALUES)
        layouts = tuple(layouts) or LAYOUTS
    # dB has no weight operand: one layout ("kn", activations row-major) covers it.
    return [BenchCase(op, m, n, k, layout, names) for op in ops for k, n, names in picked
            for layout in (layouts if op != "db" else ("kn",)) for m in ms]


# ---------------------------------------------------------------------------------------------
# Operands, validation
# ---------------------------------------------------------------------------------------------
def operands(case: BenchCase, device: torch.device):
    """Seeded operands of det_gemm's launcher for ``case`` (the fixtures the audits draw) and the matching
    torch.matmul baseline call."""
    from detkit.toolkit.fixtures import GemmCase, operands as gemm_operands

    # On the GPU every operand is drawn there: a zoo run has hundreds of cases, each drawing up to 2.5e9 elements.
    x, y = gemm_operands(GemmCase(case.op, case.m, case.n, case.k, case.layout, BENCH_SEED,
                                         device_draws=True), device)
    return x, y, baseline_call(case.op, x, y)


def baseline_call(op: str, x: torch.Tensor, y: torch.Tensor):
    """torch.matmul (cuBLAS on CUDA) on the same views det_gemm reads, the views taken once (as a user holds an
    nn.Linear weight and its transpose)."""
    if op == "fwd":
        return lambda: x @ y
    if op == "da":
        yt = y.t()
        return lambda: x @ yt
    xt = x.t()
    return lambda: xt @ y


def public_op(op: str):
    """detkit's public function for ``op``. Kernel modules are imported when a benchmark runs, not when the CLI
    lists its commands: --device cpu must switch the Triton interpreter on first."""
    from detkit.kernels.det_gemm.launch import det_gemm_da, det_gemm_db, det_gemm_fwd

    return {"fwd": det_gemm_fwd, "da": det_gemm_da, "db": det_gemm_db}[op]


ORACLE_ELEMENTS = 2**26  # FP64 elements per oracle block (of an operand slice or of the output block)
VALIDATE_MAX_ELEMENTS = 2**26  # larger outputs: their first and last rows (fwd, dA) or columns (dB) are checked


def _spans(extent: int, other: int, limit: int) -> list[tuple[int, int]]:
    """[0, extent), or its first and last parts of ``limit`` elements together (``other`` elements per index)."""
    if extent * other <= limit:
        return [(0, extent)]
    width = max(1, limit // (2 * other))
    return [(0, width), (extent - width, extent)]


def validate(op: str, x: torch.Tensor, y: torch.Tensor, c: torch.Tensor) -> tuple[bool, float]:
    """``c`` (det_gemm's output) against the contract bound of the FP64 oracle, computed in output blocks whose
    operand slices and outputs stay within ORACLE_ELEMENTS each; (passed, worst ratio to the bound). An output above
    VALIDATE_MAX_ELEMENTS is checked on its first and last rows (fwd, dA: rows are independent) or columns (dB), where
    the kernel's smallest and largest offsets are."""
    rows, cols = c.shape
    reduced = {"fwd": x.shape[1], "da": x.shape[1], "db": x.shape[0]}[op]
    block = max(16, min(8192, ORACLE_ELEMENTS // reduced))
    row_spans = _spans(rows, cols, VALIDATE_MAX_ELEMENTS) if op != "db" else [(0, rows)]
    col_spans = _spans(cols, rows, VALIDATE_MAX_ELEMENTS) if op == "db" else [(0, cols)]
    from detkit.kernels.det_gemm.launch import REFERENCES

    ref = REFERENCES[op]
    passed, worst = True, 0.0
    for lo, hi in row_spans:
        for clo, chi in col_spans:
            for r0 in range(lo, hi, block):
                for c0 in range(clo, chi, block):
                    r1, c1 = min(hi, r0 + block), min(chi, c0 + block)
                    if op == "fwd":
                        xs, ys = x[r0:r1], y[:, c0:c1]
                    elif op == "da":
                        xs, ys = x[r0:r1], y[c0:c1]
                    else:
                        xs, ys = x[:, r0:r1], y[:, c0:c1]
                    c_star = ref(xs, ys, torch.float64)
                    abs_ab = ref(xs.abs(), ys.abs(), torch.float64)
                    result = check_bound(c[r0:r1, c0:c1], c_star, gemm_bound(c_star, abs_ab, reduced))
                    passed &= bool(result.passed)
                    worst = max(worst, float(result.worst_ratio))
                    del c_star, abs_ab
    return passed, worst


L2_BYTES = 60 * 2**20  # H200; rotation sizes operand sets to exceed it several times over
MAX_SETS = 16


def _rotation_sets(x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the operands (same strides) so consecutive calls miss the L2."""
    per_set = x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
    count = max(1, min(MAX_SETS, -(-3 * L2_BYTES // per_set)))
    sets = [(x, y)]
    for _ in range(count - 1):
        sets.append(tuple(t.t().clone().t() if t.stride(0) == 1 and t.dim() == 2 and t.stride(1) != 1
                          else t.clone() for t in (x, y)))
    return sets


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def estimated_call_s(case: BenchCase) -> float:
    """A rough GPU time per call (600 TFLOP/s, 3 TB/s): how many calls a burst or a replay needs."""
    return case.flops / 600e12 + 2 * (case.m * case.k + case.k * case.n + case.m * case.n) / 3e12


def burst_calls(case: BenchCase, most: int) -> int:
    """Calls per host or eager burst: about BURST_GPU_S of GPU work, 2 to ``most``."""
    return max(2, min(most, math.ceil(BURST_GPU_S / estimated_call_s(case))))


def graph_replays(case: BenchCase, sets: int) -> int:
    """Replays per graph sample: about GRAPH_MIN_REPLAY_S of estimated GPU time (3 to 10)."""
    return max(3, min(10, math.ceil(GRAPH_MIN_REPLAY_S / (estimated_call_s(case) * sets))))


def _stats(prefix: str, t: Timing) -> dict:
    return {f"{prefix}_median_us": t.median_us, f"{prefix}_p20_us": t.p20_us, f"{prefix}_p80_us": t.p80_us,
            f"{prefix}_samples": t.samples, f"{prefix}_sm_clock_mhz": t.sm_clock_mhz}


def time_case(case: BenchCase, device: torch.device, baseline: str, timings: tuple[str, ...], rounds: int,
              x: torch.Tensor, y: torch.Tensor) -> dict:
    """The timings of one case for detkit and ``baseline`` (torch.matmul under this process's cuBLAS settings).
    Keys: graph: ``{impl}_median_us``...; host / eager: ``{impl}_{timing}_median_us``...."""
    cuda = device.type == "cuda"
    sets = _rotation_sets(x, y) if cuda else [(x, y)]
    public = public_op(case.op)
    base_calls = [baseline_call(case.op, a, b) for a, b in sets]
    names = {"detkit": case.name, baseline: f"{case.name} | {baseline}"}
    out = {"rotation_sets": len(sets)}
    if "host" in timings:
        one = base_calls[0]
        fns = {"detkit": lambda: public(x, y), baseline: one}
        # The interpreter's calls take ~0.1 s: one per burst proves the plumbing.
        host = time_host(fns, device, rounds, calls=burst_calls(case, HOST_CALLS) if cuda else 1, range_names=names)
        out.update({k: v for impl, t in host.items() for k, v in _stats(f"{impl}_host", t).items()})
    passes = {"detkit": lambda: [public(a, b) for a, b in sets], baseline: lambda: [call() for call in base_calls]}
    if "eager" in timings:
        # Whole passes over the rotating sets, at least burst_calls calls per sample (interpreter: one pass).
        per_sample = max(1, -(-burst_calls(case, EAGER_MIN_CALLS) // len(sets))) if cuda else 1
        eager = time_back_to_back(passes, device, rounds, calls_per_fn=len(sets), passes=per_sample,
                                  samples_per_round=EAGER_SAMPLES_PER_ROUND if cuda else 1, range_names=names)
        out.update({k: v for impl, t in eager.items() for k, v in _stats(f"{impl}_eager", t).items()})
    if "graph" in timings:
        replays = graph_replays(case, len(sets)) if cuda else 1
        timed = time_graphs(passes, device, calls_per_fn=len(sets), rounds=rounds, replays=replays, range_names=names)
        out["graph_replays"] = replays
        out.update({k: v for impl, t in timed.items() for k, v in _stats(impl, t).items()})
    return out


class NoSplitKWorker:
    """A worker process with CUBLASLT_WORKSPACE_SIZE=1 (cuBLASLt without split-K) that times det_gemm and its
    torch.matmul by CUDA-graph replay, one case per request; the main process waits, so the two never share the
    GPU."""

    def __init__(self):
        env = {**os.environ, **WORKER_ENV}
        self.proc = subprocess.Popen([sys.executable, "-m", "detkit.bench.gemm", "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, bufsize=1)

    def time(self, case: BenchCase, rounds: int) -> dict:
        self.proc.stdin.write(json.dumps({"case": asdict(case), "rounds": rounds}) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"cublaslt_nosplitk worker exited (code {self.proc.poll()}) on {case.name}")
            if line.startswith(WORKER_PREFIX):
                return json.loads(line[len(WORKER_PREFIX):])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


WORKER_PREFIX = "@@gemm-worker "


def _worker() -> None:
    device = torch.device("cuda")
    for line in sys.stdin:
        request = json.loads(line)
        case = BenchCase(**{**request["case"], "layers": tuple(request["case"]["layers"])})
        x, y, _ = operands(case, device)
        row = time_case(case, device, "cublaslt_nosplitk", ("graph",), request["rounds"], x, y)
        del x, y
        torch.cuda.empty_cache()
        print(WORKER_PREFIX + json.dumps(row), flush=True)


# ---------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------
def _rounds(ctx, options: dict) -> int:
    rounds = getattr(ctx, "rounds", None) or options.get("rounds") or default_rounds(ctx.interpreted)
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"--rounds must be a positive int; got {rounds!r}")
    return rounds


def run(ctx, cases: list[BenchCase], **options) -> Iterator[dict]:
    """Validate, then time; one row per case as soon as it is measured."""
    from detkit.kernels.det_gemm.launch import LAUNCHERS as launchers

    device = ctx.device
    timings, nosplitk = resolve_options(options.get("zoo", False), options.get("timings", ()), options.get("nosplitk"))
    rounds = _rounds(ctx, options)
    cuda = device.type == "cuda"
    ceiling = measured_ceiling_tflops(device) if cuda else None
    worker = NoSplitKWorker() if cuda and nosplitk else None
    try:
        for case in cases:
            x, y, _ = operands(case, device)
            c, launch = launchers[case.op](x, y)
            passed, worst = validate(case.op, x, y, c)
            del c
            row = {"name": case.name, "passed": passed, "op": case.op, "M": case.m, "N": case.n, "K": case.k,
                   "layout": case.layout, "layers": list(case.layers), "flops": case.flops,
                   "config": launch.config.label(), "backend": launch.backend, "contract_passed": passed,
                   "contract_worst_ratio": worst, "timings": list(timings)}
            row.update(time_case(case, device, "cublas", timings, rounds, x, y))
            del x, y
            if worker is not None:
                other = worker.time(case, rounds)
                row.update({f"cublaslt_nosplitk_{k}": other[f"cublaslt_nosplitk_{k}"]
                            for k in ("median_us", "p20_us", "p80_us")})
                row["detkit_median_us_worker"] = other["detkit_median_us"]
                row["ratio_vs_cublaslt_nosplitk"] = other["detkit_median_us"] / other["cublaslt_nosplitk_median_us"]
            add_ratios(row, ceiling)
            if cuda:
                torch.cuda.empty_cache()  # zoo shapes differ by orders of magnitude: give each case the memory
            yield row
    finally:
        if worker is not None:
            worker.close()


def add_ratios(row: dict, ceiling: float | None) -> None:
    """Ratios (detkit / cuBLAS) per timing, TFLOP/s and MFU from GPU time."""
    for timing, key in (("host", "_host"), ("eager", "_eager"), ("graph", "")):
        if f"detkit{key}_median_us" in row:
            row[f"ratio_{timing}"] = row[f"detkit{key}_median_us"] / row[f"cublas{key}_median_us"]
    if "detkit_median_us" in row:
        row["ratio_vs_cublas"] = row["ratio_graph"]
        row["detkit_tflops"] = row["flops"] / (row["detkit_median_us"] * 1e-6) / 1e12
        row["cublas_tflops"] = row["flops"] / (row["cublas_median_us"] * 1e-6) / 1e12
        row["mfu_measured"] = row["detkit_tflops"] / ceiling if ceiling else None
        row["mfu_datasheet"] = row["detkit_tflops"] / DATASHEET_BF16_TFLOPS
        row["measured_ceiling_tflops"] = ceiling


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def _group_key(row: dict) -> tuple:
    return row["op"], row["K"], row["N"], row["layout"]


def target_summary(rows: list[dict]) -> list[dict]:
    """GPU-time targets per (op, K, N, layout): median ratio over M >= 1024 and over M <= 256, worst row."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "ratio_graph" in r:
            groups.setdefault(_group_key(r), []).append(r)
    large_m, large_t = TARGETS["large_m"]
    small_m, small_t = TARGETS["small_m"]
    for (op, k, n, layout), sel in groups.items():
        large = [r["ratio_graph"] for r in sel if r["M"] >= large_m]
        small = [r["ratio_graph"] for r in sel if r["M"] <= small_m]
        worst = max(sel, key=lambda r: r["ratio_graph"])
        entry = {"op": op, "K": k, "N": n, "layout": layout,
                 "median_M>=1024": statistics.median(large) if large else None,
                 "median_M<=256": statistics.median(small) if small else None,
                 "worst": worst["ratio_graph"], "worst_M": worst["M"]}
        nosplitk = [r["ratio_vs_cublaslt_nosplitk"] for r in sel if "ratio_vs_cublaslt_nosplitk" in r]
        if nosplitk:
            entry["worst_vs_nosplitk"] = max(nosplitk)
        entry["met"] = bool((not large or entry["median_M>=1024"] <= large_t)
                            and (not small or entry["median_M<=256"] <= small_t)
                            and entry["worst"] <= TARGETS["graph_max"])
        entry["layers"] = ", ".join(sel[0].get("layers") or [])
        out.append(entry)
    return out


def per_row_summary(rows: list[dict], timing: str, target: float) -> dict | None:
    """Rows with a ``timing`` ratio: how many meet ``target``, and the worst."""
    key = f"ratio_{timing}"
    sel = [r for r in rows if key in r]
    if not sel:
        return None
    worst = max(sel, key=lambda r: r[key])
    return {"timing": timing, "target": target, "rows": len(sel), "met": sum(r[key] <= target for r in sel),
            "worst": worst[key], "worst_row": worst["name"]}


def _table(rows: list[dict], cols: list[str]) -> str:
    from tabulate import tabulate

    return tabulate([{c: r.get(c) for c in cols} for r in rows], headers="keys", tablefmt="github", floatfmt=".3f")


def summarize(rows: list[dict], meta: dict) -> str:
    """The markdown body of report.md: targets as ratios, then the rows."""
    lines = []
    if meta.get("backend") == "triton_interpreter" or any(r.get("backend") == "triton_interpreter" for r in rows):
        lines += ["Interpreter run: every timing is CPU emulation, not a hardware result.", ""]
    failed = [r["name"] for r in rows if not r["passed"]]
    lines += [f"Validation (contract bound of the FP64 oracle, before timing): {len(rows) - len(failed)} of "
              f"{len(rows)} rows passed" + (f"; failed: {', '.join(failed[:10])}" if failed else ""), ""]
    lines += ["## Targets (ratio = detkit time / cuBLAS time)", ""]
    for timing, target in (("host", TARGETS["host_max"]), ("eager", TARGETS["eager_max"])):
        s = per_row_summary(rows, timing, target)
        if s:
            state = "met" if s["met"] == s["rows"] else "NOT met"
            lines.append(f"- {timing} <= {target} on every row: {state} (within the target on {s['met']} of "
                         f"{s['rows']} rows; worst {s['worst']:.3f}, {s['worst_row']})")
    summary = target_summary(rows)
    if summary:
        met = sum(s["met"] for s in summary)
        lines.append(f"- GPU time (graph replay) per (op, shape, layout): median over M >= {TARGETS['large_m'][0]} "
                     f"<= {TARGETS['large_m'][1]}, median over M <= {TARGETS['small_m'][0]} <= "
                     f"{TARGETS['small_m'][1]}, no row above {TARGETS['graph_max']}: "
                     f"{'met' if met == len(summary) else 'NOT met'} (met by {met} of {len(summary)})")
        lines += ["", _table(summary, list(summary[0].keys())), ""]
    nosplitk = [r for r in rows if "ratio_vs_cublaslt_nosplitk" in r]
    if nosplitk:
        worst = max(nosplitk, key=lambda r: r["ratio_vs_cublaslt_nosplitk"])
        lines.append(f"- GPU time against cuBLASLt without split-K (one worker process times both): worst "
                     f"{worst['ratio_vs_cublaslt_nosplitk']:.3f} ({worst['name']}); median "
                     f"{statistics.median(r['ratio_vs_cublaslt_nosplitk'] for r in nosplitk):.3f}")
    lines.append("")
    for timing, cols in (
        ("host", ["op", "layout", "M", "N", "K", "detkit_host_median_us", "cublas_host_median_us", "ratio_host"]),
        ("eager", ["op", "layout", "M", "N", "K", "detkit_eager_median_us", "cublas_eager_median_us", "ratio_eager"]),
        ("graph", ["op", "layout", "M", "N", "K", "config", "detkit_median_us", "detkit_p20_us", "detkit_p80_us",
                   "cublas_median_us", "ratio_graph", "ratio_vs_cublaslt_nosplitk", "detkit_tflops", "cublas_tflops",
                   "mfu_measured"]),
    ):
        sel = [r for r in rows if f"ratio_{timing}" in r]
        if sel:
            title = {"host": "Host time per call (us)", "eager": "Eager time per call (us, back-to-back)",
                     "graph": "GPU time per call (us, CUDA-graph replay, L2-cold operands)"}[timing]
            lines += [f"## {title}", "", _table(sel, [c for c in cols if any(c in r for r in sel)]), ""]
    if nosplitk and not any("ratio_graph" in r for r in nosplitk):
        lines += ["## GPU time against cuBLASLt without split-K (us, CUDA-graph replay, worker process)", "",
                  _table(nosplitk, ["op", "layout", "M", "N", "K", "detkit_median_us_worker",
                                    "cublaslt_nosplitk_median_us", "ratio_vs_cublaslt_nosplitk"]), ""]
    return "\n".join(lines)


def derive(rows: list[dict], meta: dict) -> dict:
    """The targets over all rows, for report.json's meta (a claims table reads them there)."""
    graph = target_summary(rows)
    return {
        "host": per_row_summary(rows, "host", TARGETS["host_max"]),
        "eager": per_row_summary(rows, "eager", TARGETS["eager_max"]),
        "graph": {"groups": len(graph), "met": sum(s["met"] for s in graph),
                  "not_met": [f"{s['op']} K={s['K']} N={s['N']} {s['layout']}" for s in graph if not s["met"]]},
        "validated": sum(r["passed"] for r in rows), "rows": len(rows),
    }


def default_rounds(interpreted: bool) -> int:
    """Interleaved rounds unless --rounds says otherwise: one on the interpreter (plumbing, not speed)."""
    return 1 if interpreted else DEFAULT_ROUNDS


def plots(out_dir: Path, rows: list[dict]) -> list[Path]:
    """TFLOP/s over M per (op, shape) panel (at most 12 panels), or for many shapes (the zoo) the GPU-time ratio
    over M per op."""
    sel = [r for r in rows if r.get("detkit_tflops")]
    if not sel:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from detkit.toolkit.reports import save_figure, style_log2_axes

    panels = list(dict.fromkeys((r["op"], r["N"], r["K"]) for r in sel))
    out = Path(out_dir)
    if len(panels) <= 12:
        path = out / "gemm_tflops.png"
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
        for ax, (op, n, k) in zip(axes[0], panels):
            for layout in dict.fromkeys(r["layout"] for r in sel):
                line = sorted((r for r in sel if (r["op"], r["N"], r["K"], r["layout"]) == (op, n, k, layout)),
                              key=lambda r: r["M"])
                if line:
                    ms = [r["M"] for r in line]
                    ax.plot(ms, [r["detkit_tflops"] for r in line], marker="o", label=f"detkit b={layout}")
                    ax.plot(ms, [r["cublas_tflops"] for r in line], linestyle="--", label=f"cuBLAS b={layout}")
            style_log2_axes(ax, f"{op} N={n} K={k}", "M", "TFLOP/s")
    else:
        path = out / "gemm_ratio.png"
        ops = list(dict.fromkeys(r["op"] for r in sel))
        fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 3.8), squeeze=False)
        for ax, op in zip(axes[0], ops):
            line = [r for r in sel if r["op"] == op]
            ax.scatter([r["M"] for r in line], [r["ratio_graph"] for r in line], s=8,
                       c=["tab:red" if r["N"] <= 1024 else "tab:blue" for r in line])
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op}: detkit / cuBLAS GPU time (red: N <= 1024)")
            ax.set_xlabel("M")
            ax.set_ylabel("ratio")
    save_figure(fig, path)
    plt.close(fig)
    return [path]


if __name__ == "__main__":
    if sys.argv[1:] != ["--worker"]:
        raise SystemExit("python -m detkit.bench.gemm --worker is the cuBLASLt no-split-K worker; the benchmark is "
                         "`detkit bench gemm`")
    _worker()
