"""The reduction operators' collectives against a raw torch.distributed all_reduce, same run, interleaved.

``row_parallel_fwd``, ``column_parallel_dx`` and ``replicated_dw`` (kernels/parallel/operators.py) each run a
det_gemm whose epilogue writes the partial twice (det_gemm ``twin_out``) and then
``kernels.parallel._reduce(op, twin, pg, axis)``: a synchronous BF16 all_reduce SUM in place on the
twin over a 2-rank group, so the operator returns the partial untouched without a copy kernel
before its collective. The operators' public API fixes the GEMM shapes to the layout's local
shapes, so the collective is timed through that same ``_reduce`` call on a buffer of any size; the
counters it bumps (``collective_counts()``) prove each timed call took the operator's labelled path.
The copy moved into the GEMM: its cost is measured on its own (``twin_store`` rows below).

What is timed (one sample = ``iters`` back-to-back calls, divided by ``iters``):
- ``raw``: ``dist.all_reduce(buf, SUM, group)`` in place on a pre-allocated ``[M, N]`` BF16 tensor
  of zeros (in-place repetition would overflow a non-zero buffer; NCCL's and gloo's speed does
  not depend on the values).
- ``<operator>``: ``_reduce(<operator>, twin, group, axis)`` on a pre-allocated ``[M, N]`` BF16 twin
  of zeros (as raw, for the same reason). The GEMM is not timed here.
- ``twin_store`` rows (one rank, no collective): each operator's det_gemm at its local Qwen3-8B TP=2
  shape for that M (fwd ``[M, I/2] @ [I/2, H]``, dA ``[M, I/2] @ [H, I/2]^T``, dB ``[M, H]^T @ [M, I/2]``)
  with and without ``twin_out``, interleaved, L2 flushed (``toolkit.timing.time_interleaved``):
  ``twin_cost_ratio`` = with / without, the price of keeping the partial.
Timing (toolkit.timing.back_to_back_samples_ms): CUDA events around the ``iters`` calls after a barrier, on the
current stream; CPU: ``time.perf_counter``. Each sample is the maximum over the ranks (the collective ends when the
slowest rank does). Rounds alternate the order of the implementations (forward, then reversed) so
drift hits all alike; warm-up calls (communicator creation) are excluded. Reported: median with
p20/p80 over the rounds.

Formulas (nccl-tests, doc/PERFORMANCE.md): bytes = M * N * 2 (BF16); algbw = bytes / time;
busbw = algbw * 2 * (n - 1) / n for all_reduce over n ranks (n = 2: busbw = algbw). GB/s = 1e9
bytes/s. ratio_vs_raw = operator median / raw median of the same size in the same run. Target
(reported, not asserted): ratio_vs_raw <= 1.05 at >= 8 MiB.

Validated before timing: every implementation's result equals ``(p0.float() + p1.float()).bfloat16()``
of the partials gathered from the group, bit for bit (version-1 oracle).

Launch: ``torchrun --nproc-per-node 2 --standalone -m detkit bench comm --out DIR`` (NCCL on CUDA,
``NCCL_NVLS_ENABLE=0``; gloo on CPU with ``--device cpu``, tiny sizes, not a hardware result). Rows: one per
(size, implementation), then one ``twin_store`` row per (operator, M); rank 0 writes them.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import click
import torch

from detkit.toolkit.nvtx_ranges import format_range_name, nvtx_range
from detkit.toolkit.reports import markdown_table
from detkit.toolkit.timing import Timing, back_to_back_samples_ms

NAME = "comm"
DESCRIPTION = "The TP/CP operators' all_reduce vs a raw all_reduce of the same bytes (2 ranks, torchrun)."
RANKS = "ranks"
# --m-local / --n-cols: torchrun's argument parser takes '--m' and '--n' after the module for
# abbreviations of its own options and refuses them as ambiguous.
OPTIONS = (
    click.option("--m-local", "--m", "m_values", multiple=True, type=int,
                 help="M_local values of the [M, N] BF16 messages (default 1..16384; tiny on cpu)."),
    click.option("--n-cols", "--n", "n_cols", type=int, default=None, help="N (default 4096; 64 on cpu)."),
    click.option("--iters", type=int, default=None, help="Back-to-back calls per sample (default 20; 2 on cpu)."),
    click.option("--warmup", type=int, default=5, show_default=True, help="Untimed calls per implementation."),
)
GROUP_SIZE = 2
N_HIDDEN = 4096
M_VALUES = (1, 64, 1024, 4096, 8192, 16384)
TINY_M_VALUES = (1, 6, 64)
TINY_N = 64
# operator -> the group axis its collective runs on (kernels/parallel/operators.py)
OPERATORS = {"row_parallel_fwd": "tp", "column_parallel_dx": "tp", "replicated_dw": "cp"}
RAW = "raw"
TARGET_RATIO = 1.05
TARGET_MIN_BYTES = 8 * 2**20
NVLS_ENV = "NCCL_NVLS_ENABLE"
COLLECTIVE, TWIN_STORE = "collective", "twin_store"


def default_rounds(interpreted: bool) -> int:
    return 3 if interpreted else 10


@dataclass(frozen=True)
class CommCase:
    name: str
    kind: str  # COLLECTIVE or TWIN_STORE
    impl: str  # RAW or an operator
    m: int
    n: int
    iters: int
    warmup: int


@dataclass
class CommSession:
    rank: int
    world_size: int
    local_rank: int
    pg_backend: str
    device: torch.device
    group: object  # the 2-rank process group every implementation runs on
    group_ranks: tuple[int, ...]


def bus_factor(n: int) -> float:
    """all_reduce bus bandwidth factor 2(n-1)/n (nccl-tests)."""
    return 2.0 * (n - 1) / n


def row_name(impl: str, m: int, n: int) -> str:
    """Row name and NVTX range: ``row_parallel_fwd all_reduce [M=1024, N=4096] bf16``."""
    return format_range_name(f"{impl} all_reduce", {"M": m, "N": n}, "bf16")


def twin_row_name(operator: str, m: int) -> str:
    """Row name and NVTX range of a twin-store cost row: ``row_parallel_fwd twin_store [M=1024] bf16``."""
    return format_range_name(f"{operator} twin_store", {"M": m}, "bf16")


def check_launch(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a launch that is not 2 torchrun/srun ranks (from the environment alone: nothing started)."""
    from detkit.toolkit.dist import launched_as_ranks
    from detkit.toolkit.launch import RankEnv

    env = os.environ if environ is None else environ
    if not launched_as_ranks(env):
        raise ValueError("bench comm needs 2 ranks: torchrun --nproc-per-node 2 --standalone -m detkit bench comm "
                         "[--device cpu] --out DIR")
    world_size = RankEnv.from_environ(env).world_size
    if world_size != GROUP_SIZE:
        raise ValueError(f"bench comm runs on {world_size} ranks; supported: {GROUP_SIZE} (the operators' TP and "
                         "CP groups have 2 ranks)")


def cases(ctx, m_values=(), n_cols: int | None = None, iters: int | None = None, warmup: int = 5,
          environ: Mapping[str, str] | None = None) -> list[CommCase]:
    """Every (size, implementation) collective row, then every (operator, M) twin-store row."""
    if ctx.presets:
        raise ValueError(f"bench comm takes no --preset (got {list(ctx.presets)}); its sizes are --m-local and "
                         "--n-cols")
    if any(m < 1 for m in m_values) or (n_cols is not None and n_cols < 1):
        raise ValueError(f"M and N must be >= 1; got M {list(m_values)}, N {n_cols}")
    if iters is not None and iters < 1:
        raise ValueError(f"--iters must be >= 1; got {iters}")
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0; got {warmup}")
    check_launch(environ)
    iters = iters or (2 if ctx.interpreted else 20)
    shapes = sizes(ctx.interpreted, tuple(m_values) or None, n_cols)
    out = [CommCase(row_name(impl, m, n), COLLECTIVE, impl, m, n, iters, warmup)
           for m, n in shapes for impl in (RAW, *OPERATORS)]
    return out + [CommCase(twin_row_name(op, m), TWIN_STORE, op, m, n, iters, warmup)
                  for m, n in shapes for op in OPERATORS]


def start(ctx, out: Path | None = None, environ: Mapping[str, str] | None = None) -> CommSession:
    """Start the process group (torchrun/srun ranks) and the 2-rank group; refuse anything else."""
    import torch.distributed as dist

    from detkit.toolkit.dist import timeout_s
    from detkit.toolkit.launch import RankEnv, init_process_group

    env = os.environ if environ is None else environ
    check_launch(env)
    rank_env = RankEnv.from_environ(env)
    device = ctx.device
    if device.type == "cuda":
        nvls = env.get(NVLS_ENV)
        if nvls not in (None, "0"):
            raise ValueError(f"{NVLS_ENV}={nvls!r}; NVLink multicast must stay off on these hosts: set it to 0")
        os.environ[NVLS_ENV] = "0"  # NCCL reads it when the communicator is created, below
    pg_backend = init_process_group(rank_env, device.type, timeout_s(env))
    ranks = tuple(range(GROUP_SIZE))
    group = dist.new_group(ranks=list(ranks))
    dev = torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device
    return CommSession(rank_env.rank, rank_env.world_size, rank_env.local_rank, pg_backend, dev, group, ranks)


def finish(session: CommSession, passed: bool) -> bool:
    """Every rank's verdict combined; destroys the process group."""
    import torch.distributed as dist

    verdicts: list = [None] * session.world_size
    try:
        dist.all_gather_object(verdicts, bool(passed))
    finally:
        dist.destroy_process_group()
    return all(verdicts)


def _partial(m: int, n: int, rank: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * (rank + 1) + m)
    return torch.randn((m, n), generator=g, dtype=torch.float32).to(torch.bfloat16).to(device)


def _sync(session: CommSession) -> None:
    if session.device.type == "cuda":
        torch.cuda.synchronize(session.device)


def _validate(session: CommSession, fns: dict[str, Callable[[], torch.Tensor]], partial: torch.Tensor,
              ) -> dict[str, dict]:
    """Each implementation's result vs the v1 oracle of the gathered partials, bitwise."""
    import torch.distributed as dist

    from detkit.toolkit.contract import compare_bits

    parts = [torch.empty_like(partial) for _ in session.group_ranks]
    dist.all_gather(parts, partial, group=session.group)
    want = (parts[0].float() + parts[1].float()).to(torch.bfloat16)
    out = {}
    for impl, fn in fns.items():
        with nvtx_range("validate"):
            got = fn()
        _sync(session)
        out[impl] = compare_bits(got, want).as_row()
    return out


def time_size(session: CommSession, m: int, n: int, rounds: int, iters: int, warmup: int) -> list[dict]:
    """Validate, then time raw and every operator's collective at [m, n], interleaved; one row each."""
    import torch.distributed as dist

    from detkit.kernels.parallel import operators as parallel

    partial = _partial(m, n, session.rank, session.device)
    raw_buf = torch.zeros_like(partial)
    pg = session.group

    def raw_check() -> torch.Tensor:
        out = partial.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=pg)
        return out

    def raw_timed() -> None:
        dist.all_reduce(raw_buf, op=dist.ReduceOp.SUM, group=pg)

    twin_buf = torch.zeros_like(partial)
    ops = {op: (lambda op=op, axis=axis: parallel._reduce(op, twin_buf, pg, axis)) for op, axis in OPERATORS.items()}
    op_checks = {op: (lambda op=op, axis=axis: parallel._reduce(op, partial.clone(), pg, axis))
                 for op, axis in OPERATORS.items()}
    impls = [RAW, *ops]
    names = {impl: row_name(impl, m, n) for impl in impls}
    checks = {}
    for impl in impls:
        with nvtx_range(names[impl]):
            checks.update(_validate(session, {impl: raw_check if impl == RAW else op_checks[impl]}, partial))
    timed = {RAW: raw_timed, **ops}
    for impl in impls:  # warm-up (communicator creation), excluded, and before counts0: it counts only timed calls
        for _ in range(warmup):
            timed[impl]()
    _sync(session)
    counts0 = parallel.collective_counts()
    # Every sample starts after a barrier of the group, so the ranks run the collective together.
    samples = back_to_back_samples_ms(timed, session.device, rounds, passes=iters, warmup=0,
                                      before_sample=lambda: dist.barrier(group=pg), alternate=True,
                                      range_names={impl: (names[impl], "time") for impl in impls})
    counts1 = parallel.collective_counts()
    # The slowest rank's time per sample: one collective for all samples, after timing.
    local = torch.tensor([samples[i] for i in impls], dtype=torch.float64)
    slowest = local.to(session.device) if session.pg_backend == "nccl" else local
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=pg)
    slowest = slowest.cpu().tolist()
    nbytes = m * n * partial.element_size()
    rows = []
    raw_t = Timing.from_samples_ms(slowest[0])
    for i, impl in enumerate(impls):
        t = Timing.from_samples_ms(slowest[i])
        algbw = nbytes / (t.median_us * 1e-6) / 1e9
        key = None if impl == RAW else f"{impl}/all_reduce/{OPERATORS[impl]}"
        calls = None if key is None else counts1.get(key, 0) - counts0.get(key, 0)
        ratio = t.median_us / raw_t.median_us
        applies = impl != RAW and nbytes >= TARGET_MIN_BYTES
        validated, path_ok = checks[impl]["equal"], True if impl == RAW else calls == rounds * iters
        row = {
            "name": names[impl], "kind": COLLECTIVE, "impl": impl, "axis": OPERATORS.get(impl), "M": m, "N": n,
            "dtype": "bf16",
            "bytes": nbytes, "MiB": nbytes / 2**20, "world_size": session.world_size,
            "group_ranks": list(session.group_ranks), "pg_backend": session.pg_backend,
            "timed": "dist.all_reduce in place (zeros buffer)" if impl == RAW
            else "detkit.kernels.parallel.operators._reduce: all_reduce in place on the GEMM's twin (operator's collective path, "
                 "zeros buffer, no GEMM)",
            "rounds": rounds, "iters": iters, "warmup": warmup,
            "median_us": t.median_us, "p20_us": t.p20_us, "p80_us": t.p80_us, "samples": t.samples,
            "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(session.world_size),
            "raw_median_us": raw_t.median_us, "ratio_vs_raw": ratio, "overhead_pct": (ratio - 1.0) * 100.0,
            "target_applies": applies, "within_target": (ratio <= TARGET_RATIO) if applies else None,
            "validated": validated, "mismatches": checks[impl]["mismatches"],
            "operator_path_calls": calls, "operator_path_ok": path_ok,
            "hardware_result": session.device.type == "cuda", "passed": validated and path_ok,
        }
        if not row["passed"]:
            row["failure"] = (f"bitwise equal to the v1 oracle: {validated} ({checks[impl]['mismatches']} mismatches); "
                              f"operator path calls {calls}, expected {rounds * iters}")
        rows.append(row)
    return rows


def twin_store_cost(session: CommSession, m_values: list[int], rounds: int) -> list[dict]:
    """Each operator's local det_gemm with and without ``twin_out`` (the copy the collective runs on),
    at the layout's local shapes (Qwen3-8B TP=2 on CUDA, the tiny test dims on the interpreter)."""
    from detkit.kernels.det_gemm.launch import det_gemm_da_launch, det_gemm_db_launch, det_gemm_fwd_launch
    from detkit.toolkit.layout import LAYOUT_PRESETS
    from detkit.toolkit.timing import time_interleaved

    interpreted = session.device.type == "cpu"
    model = LAYOUT_PRESETS["tiny" if interpreted else "qwen3-8b-tp2"][0]
    h, i_loc = model.hidden_size, model.intermediate_size // 2
    g = torch.Generator().manual_seed(4099 + session.rank)

    def rand(*shape):
        return torch.randn(shape, generator=g).to(torch.bfloat16).to(session.device)

    rows = []
    for m in m_values:
        # op -> (launch, operands, output shape): the operators' GEMMs (kernels/parallel/operators.py)
        gemms = {"row_parallel_fwd": (det_gemm_fwd_launch, (rand(m, i_loc), rand(i_loc, h)), (m, h)),
                 "column_parallel_dx": (det_gemm_da_launch, (rand(m, i_loc), rand(h, i_loc)), (m, h)),
                 "replicated_dw": (det_gemm_db_launch, (rand(m, h), rand(m, i_loc)), (h, i_loc))}
        for op, (launch, args, shape) in gemms.items():
            twin = torch.empty(shape, dtype=torch.bfloat16, device=session.device)
            with_twin, plain = launch(*args, twin_out=twin)[0], launch(*args)[0]
            same = bool(torch.equal(with_twin.view(torch.int16), plain.view(torch.int16))
                        and torch.equal(twin.view(torch.int16), plain.view(torch.int16)))
            name = twin_row_name(op, m)
            with nvtx_range(name):
                t = time_interleaved({"twin": lambda: launch(*args, twin_out=twin), "plain": lambda: launch(*args)},
                                     session.device, rounds=rounds)
            row = {"name": name, "kind": TWIN_STORE, "operator": op, "M": m, "out_shape": list(shape),
                   "bits_equal": same, "plain_median_us": t["plain"].median_us, "twin_median_us": t["twin"].median_us,
                   "twin_cost_ratio": t["twin"].median_us / t["plain"].median_us, "rank": session.rank,
                   "interpreted": interpreted, "hardware_result": not interpreted, "passed": same}
            if not same:
                row["failure"] = "det_gemm with twin_out gave other bits (output or twin) than without"
            rows.append(row)
    return rows


def sizes(interpreted: bool, m_values=None, n: int | None = None) -> list[tuple[int, int]]:
    ms = m_values or (TINY_M_VALUES if interpreted else M_VALUES)
    return [(m, n or (TINY_N if interpreted else N_HIDDEN)) for m in ms]


def run(ctx, cases: list[CommCase], session: CommSession, **options) -> Iterator[dict]:
    """Each size: validate, then time raw and every operator's collective interleaved; then the twin-store
    cost of every operator's GEMM (one rank, no collective)."""
    from detkit.kernels.parallel import operators as parallel

    if not hasattr(parallel, "_reduce"):
        raise RuntimeError("detkit.kernels.parallel.operators._reduce is gone: bench comm times the operators' collective "
                           "through it; update bench/comm.py with the operators")
    collectives = [c for c in cases if c.kind == COLLECTIVE]
    for (m, n), group in groupby(collectives, key=lambda c: (c.m, c.n)):
        group = list(group)
        rows = {r["impl"]: r for r in time_size(session, m, n, ctx.rounds, group[0].iters, group[0].warmup)}
        yield from (rows[c.impl] for c in group)
    twins = [c for c in cases if c.kind == TWIN_STORE]
    if twins:
        rows = {r["name"]: r for r in twin_store_cost(session, list(dict.fromkeys(c.m for c in twins)),
                                                      rounds=min(ctx.rounds, 3))}
        yield from (rows[c.name] for c in twins)


def describe(ctx, cases, rows, session: CommSession) -> dict:
    return {
        "world_size": session.world_size, "pg_backend": session.pg_backend,
        "nccl_nvls_enable": os.environ.get(NVLS_ENV) if session.pg_backend == "nccl" else None,
        "nccl_version": _nccl_version() if session.pg_backend == "nccl" else None,
        "timed": ("raw: dist.all_reduce in place on a zeros buffer; operators: kernels.parallel._reduce "
                  "(all_reduce in place on the twin the GEMM epilogue wrote, the call each operator makes "
                  "after its GEMM) on a zeros buffer; GEMM not timed; twin_store rows: each operator's GEMM "
                  "with / without twin_out, one rank"),
        "timing": ("per sample: iters back-to-back calls after a barrier / iters; CUDA events on CUDA, "
                   "perf_counter on CPU; max over ranks; median, p20, p80 over rounds; order alternates"),
        "formulas": "bytes = M*N*2; algbw = bytes/time; busbw = algbw*2(n-1)/n (nccl-tests); GB/s = 1e9 B/s",
        "target": f"ratio_vs_raw <= {TARGET_RATIO} at >= {TARGET_MIN_BYTES // 2**20} MiB (reported, not asserted)",
    }


def _nccl_version() -> str | None:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def target_summary(rows: list[dict]) -> list[dict]:
    """Per operator: worst and median ratio to raw over the sizes >= 8 MiB."""
    out = []
    for op in OPERATORS:
        sel = [r for r in rows if r.get("impl") == op and r.get("target_applies")]
        if not sel:
            continue
        ratios = [r["ratio_vs_raw"] for r in sel]
        out.append({"operator": op, "sizes_MiB": [round(r["MiB"], 1) for r in sel],
                    "median_ratio": statistics.median(ratios), "worst_ratio": max(ratios),
                    "target": TARGET_RATIO, "met": max(ratios) <= TARGET_RATIO})
    return out


def plots(out_dir: Path, rows: list[dict]) -> list[Path]:
    """busbw vs message size per implementation (hardware runs only)."""
    collectives = [r for r in rows if r.get("kind") == COLLECTIVE and "busbw_GBps" in r]
    if not collectives or not all(r["hardware_result"] for r in collectives):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from detkit.toolkit.reports import save_figure, style_log2_axes

    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in dict.fromkeys(r["impl"] for r in collectives):
        sel = sorted((r for r in collectives if r["impl"] == impl), key=lambda r: r["bytes"])
        ax.plot([r["MiB"] for r in sel], [r["busbw_GBps"] for r in sel], marker="o",
                linestyle="--" if impl == RAW else "-", label=impl)
    style_log2_axes(ax, "all_reduce: operators' collective vs raw", "message size (MiB, BF16 [M, N])", "busbw (GB/s)")
    path = Path(out_dir) / "comm_busbw.png"
    save_figure(fig, path)
    plt.close(fig)
    return [path]


def summarize(rows: list[dict], meta: dict) -> str:
    lines = [f"- {key}: {meta[key]}" for key in ("world_size", "pg_backend", "nccl_version", "nccl_nvls_enable",
                                                 "timed", "timing", "formulas", "target") if meta.get(key) is not None]
    cols = ["impl", "M", "N", "MiB", "validated", "operator_path_ok", "median_us", "p20_us", "p80_us", "algbw_GBps",
            "busbw_GBps", "ratio_vs_raw", "within_target"]
    lines += ["", "## Operators' collective vs raw all_reduce (same run, interleaved)", "",
              markdown_table([r for r in rows if r.get("kind") == COLLECTIVE], cols), ""]
    twin = [r for r in rows if r.get("kind") == TWIN_STORE]
    if twin:
        cols = ["operator", "M", "out_shape", "bits_equal", "plain_median_us", "twin_median_us", "twin_cost_ratio"]
        lines += [f"## Twin store: each operator's GEMM with / without the copy its collective runs on "
                  f"(rank {twin[0]['rank']}, no collective)", "", markdown_table(twin, cols), ""]
    summary = target_summary(rows)
    if summary:
        lines += [f"## Target: operator collective within {TARGET_RATIO - 1:.0%} of raw all_reduce at >= "
                  f"{TARGET_MIN_BYTES // 2**20} MiB (reported, not asserted)", "",
                  markdown_table(summary, list(summary[0])), ""]
    return "\n".join(lines)
