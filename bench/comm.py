"""The reduction operators' collectives against a raw torch.distributed all_reduce, same run, interleaved.

``row_parallel_fwd``, ``column_parallel_dx`` and ``replicated_dw`` (kernels/parallel.py) each run a
det_gemm and then ``kernels.parallel._reduce(op, partial, pg, axis)``: a clone of the partial (the
operator returns the partial untouched) and a synchronous BF16 all_reduce SUM, in place on the
clone, over a 2-rank group. The operators' public API fixes the GEMM shapes to the layout's local
shapes, so the collective is timed through that same ``_reduce`` call on a pre-computed partial of
any size; the counters it bumps (``collective_counts()``) prove each timed call took the operator's
labelled path.

What is timed (one sample = ``iters`` back-to-back calls, divided by ``iters``):
- ``raw``: ``dist.all_reduce(buf, SUM, group)`` in place on a pre-allocated ``[M, N]`` BF16 tensor
  of zeros (in-place repetition would overflow a non-zero buffer; NCCL's and gloo's speed does
  not depend on the values).
- ``<operator>``: ``_reduce(<operator>, partial, group, axis)`` on a seeded ``[M, N]`` BF16 partial:
  clone + all_reduce. The clone is part of what the operator pays for its collective and is timed.
  The GEMM is not timed.
CUDA: CUDA events around the ``iters`` calls after a barrier, on the current stream; CPU:
``time.perf_counter``. Each sample is the maximum over the ranks (the collective ends when the
slowest rank does). Rounds alternate the order of the implementations (forward, then reversed) so
drift hits all alike; warm-up calls (communicator creation) are excluded. Reported: median with
p20/p80 over the rounds.

Formulas (nccl-tests, doc/PERFORMANCE.md): bytes = M * N * 2 (BF16); algbw = bytes / time;
busbw = algbw * 2 * (n - 1) / n for all_reduce over n ranks (n = 2: busbw = algbw). GB/s = 1e9
bytes/s. ratio_vs_raw = operator median / raw median of the same size in the same run. Target
(reported, not asserted): ratio_vs_raw <= 1.05 at >= 8 MiB.

Validated before timing: every implementation's result equals ``(p0.float() + p1.float()).bfloat16()``
of the partials gathered from the group, bit for bit (version-1 oracle).

Launch: ``torchrun --nproc-per-node 2 --standalone -m toolkit bench comm --out DIR`` (NCCL on CUDA,
``NCCL_NVLS_ENABLE=0``; gloo on CPU with ``--device cpu``, tiny sizes, not a hardware result).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.nvtx_ranges import format_range_name, nvtx_range
from toolkit.timing import Timing

NAME = "comm"
GROUP_SIZE = 2
N_HIDDEN = 4096
M_VALUES = (1, 64, 1024, 4096, 8192, 16384)
TINY_M_VALUES = (1, 6, 64)
TINY_N = 64
# operator -> the group axis its collective runs on (kernels/parallel.py)
OPERATORS = {"row_parallel_fwd": "tp", "column_parallel_dx": "tp", "replicated_dw": "cp"}
RAW = "raw"
TARGET_RATIO = 1.05
TARGET_MIN_BYTES = 8 * 2**20
NVLS_ENV = "NCCL_NVLS_ENABLE"


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


def start(device: torch.device, environ=None) -> CommSession:
    """Start the process group (torchrun/srun ranks) and the 2-rank group; refuse anything else."""
    import torch.distributed as dist

    from toolkit.dist import launched_as_ranks, timeout_s
    from toolkit.launch import RankEnv, init_process_group

    env = os.environ if environ is None else environ
    if not launched_as_ranks(env):
        raise RuntimeError(
            "bench comm needs 2 ranks: torchrun --nproc-per-node 2 --standalone -m toolkit bench comm "
            "[--device cpu] --out DIR")
    rank_env = RankEnv.from_environ(env)
    if rank_env.world_size != GROUP_SIZE:
        raise ValueError(f"bench comm runs on {rank_env.world_size} ranks; supported: {GROUP_SIZE} (the "
                         "operators' TP and CP groups have 2 ranks)")
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

    from toolkit.contract import compare_bits

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


def _time_block(session: CommSession, fn: Callable[[], object], iters: int) -> float:
    """Milliseconds per call of ``iters`` back-to-back calls on this rank."""
    import torch.distributed as dist

    dist.barrier(group=session.group)
    if session.device.type == "cuda":
        _sync(session)
        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_ev.record()
        for _ in range(iters):
            fn()
        end_ev.record()
        end_ev.synchronize()
        return start_ev.elapsed_time(end_ev) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def time_size(session: CommSession, m: int, n: int, rounds: int, iters: int, warmup: int) -> list[dict]:
    """Validate, then time raw and every operator's collective at [m, n], interleaved; one row each."""
    import torch.distributed as dist

    from kernels import parallel

    partial = _partial(m, n, session.rank, session.device)
    raw_buf = torch.zeros_like(partial)
    pg = session.group

    def raw_check() -> torch.Tensor:
        out = partial.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=pg)
        return out

    def raw_timed() -> None:
        dist.all_reduce(raw_buf, op=dist.ReduceOp.SUM, group=pg)

    ops = {op: (lambda op=op, axis=axis: parallel._reduce(op, partial, pg, axis)) for op, axis in OPERATORS.items()}
    impls = [RAW, *ops]
    names = {impl: row_name(impl, m, n) for impl in impls}
    checks = {}
    for impl in impls:
        with nvtx_range(names[impl]):
            checks.update(_validate(session, {impl: raw_check if impl == RAW else ops[impl]}, partial))
    timed = {RAW: raw_timed, **ops}
    for impl in impls:  # warm-up, excluded
        for _ in range(warmup):
            timed[impl]()
    _sync(session)
    counts0 = parallel.collective_counts()
    samples: dict[str, list[float]] = {impl: [] for impl in impls}
    for r in range(rounds):
        for impl in (impls if r % 2 == 0 else impls[::-1]):
            with nvtx_range(names[impl]), nvtx_range("time"):
                samples[impl].append(_time_block(session, timed[impl], iters))
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
        rows.append({
            "name": names[impl], "impl": impl, "axis": OPERATORS.get(impl), "M": m, "N": n, "dtype": "bf16",
            "bytes": nbytes, "MiB": nbytes / 2**20, "world_size": session.world_size,
            "group_ranks": list(session.group_ranks), "pg_backend": session.pg_backend,
            "timed": "dist.all_reduce in place (zeros buffer)" if impl == RAW
            else "kernels.parallel._reduce: clone + all_reduce (operator's collective path, no GEMM)",
            "rounds": rounds, "iters": iters, "warmup": warmup,
            "median_us": t.median_us, "p20_us": t.p20_us, "p80_us": t.p80_us, "samples": t.samples,
            "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(session.world_size),
            "raw_median_us": raw_t.median_us, "ratio_vs_raw": ratio, "overhead_pct": (ratio - 1.0) * 100.0,
            "target_applies": applies, "within_target": (ratio <= TARGET_RATIO) if applies else None,
            "validated": checks[impl]["equal"], "mismatches": checks[impl]["mismatches"],
            "operator_path_calls": calls,
            "operator_path_ok": True if impl == RAW else calls == rounds * iters,
        })
    return rows


def sizes(interpreted: bool, m_values=None, n: int | None = None) -> list[tuple[int, int]]:
    ms = m_values or (TINY_M_VALUES if interpreted else M_VALUES)
    return [(m, n or (TINY_N if interpreted else N_HIDDEN)) for m in ms]


def run(session: CommSession, shapes: list[tuple[int, int]], rounds: int, iters: int, warmup: int,
        ) -> tuple[list[dict], dict]:
    from kernels import parallel

    if not hasattr(parallel, "_reduce"):
        raise RuntimeError("kernels.parallel._reduce is gone: bench comm times the operators' collective "
                           "through it; update bench/comm.py with the operators")
    rows = []
    with nvtx_range("bench comm"):
        for m, n in shapes:
            rows += time_size(session, m, n, rounds, iters, warmup)
    meta = {
        "world_size": session.world_size, "pg_backend": session.pg_backend,
        "nccl_nvls_enable": os.environ.get(NVLS_ENV) if session.pg_backend == "nccl" else None,
        "nccl_version": _nccl_version() if session.pg_backend == "nccl" else None,
        "timed": ("raw: dist.all_reduce in place on a zeros buffer; operators: kernels.parallel._reduce "
                  "(clone + all_reduce, the call each operator makes after its GEMM) on a pre-computed "
                  "partial; GEMM not timed"),
        "timing": ("per sample: iters back-to-back calls after a barrier / iters; CUDA events on CUDA, "
                   "perf_counter on CPU; max over ranks; median, p20, p80 over rounds; order alternates"),
        "formulas": "bytes = M*N*2; algbw = bytes/time; busbw = algbw*2(n-1)/n (nccl-tests); GB/s = 1e9 B/s",
        "target": f"ratio_vs_raw <= {TARGET_RATIO} at >= {TARGET_MIN_BYTES // 2**20} MiB (reported, not asserted)",
    }
    return rows, meta


def _nccl_version() -> str | None:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def target_summary(rows: list[dict]) -> list[dict]:
    """Per operator: worst and median ratio to raw over the sizes >= 8 MiB."""
    out = []
    for op in OPERATORS:
        sel = [r for r in rows if r["impl"] == op and r["target_applies"]]
        if not sel:
            continue
        ratios = [r["ratio_vs_raw"] for r in sel]
        out.append({"operator": op, "sizes_MiB": [round(r["MiB"], 1) for r in sel],
                    "median_ratio": statistics.median(ratios), "worst_ratio": max(ratios),
                    "target": TARGET_RATIO, "met": max(ratios) <= TARGET_RATIO})
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from toolkit.reports import save_figure, style_log2_axes

    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in dict.fromkeys(r["impl"] for r in rows):
        sel = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["bytes"])
        ax.plot([r["MiB"] for r in sel], [r["busbw_GBps"] for r in sel], marker="o",
                linestyle="--" if impl == RAW else "-", label=impl)
    style_log2_axes(ax, "all_reduce: operators' collective vs raw", "message size (MiB, BF16 [M, N])", "busbw (GB/s)")
    save_figure(fig, path)
    plt.close(fig)


def write_outputs(out_dir, rows: list[dict], meta: dict) -> dict:
    from tabulate import tabulate

    from toolkit.harness import atomic_write_text
    from toolkit.reports import markdown_report, write_row_files

    paths = write_row_files(out_dir, "comm", rows)
    out = paths["markdown"].parent
    cols = ["impl", "M", "N", "MiB", "validated", "median_us", "p20_us", "p80_us", "algbw_GBps", "busbw_GBps",
            "ratio_vs_raw", "within_target"]
    table = [{c: r.get(c) for c in cols} for r in rows]
    text = markdown_report("detkit bench comm", meta, table)
    summary = target_summary(rows)
    if summary:
        text += ("\n## Target: operator collective within 5% of raw all_reduce at >= 8 MiB (not asserted)\n\n"
                 + tabulate(summary, headers="keys", tablefmt="github", floatfmt=".3f") + "\n")
    if meta.get("backend") != "triton_interpreter":
        plot(rows, out / "comm_busbw.png")
        paths["plot"] = out / "comm_busbw.png"
        text += "\n![busbw](comm_busbw.png)\n"
    atomic_write_text(paths["markdown"], text)
    return paths
