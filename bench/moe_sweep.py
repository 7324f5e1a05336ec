"""``detkit bench moe-sweep``: the MoE expert MLP over a token sweep, uniform and skewed routing: forward,
backward alone and both, peak memory, a per-kernel breakdown, a fitted performance model and the MoE
speed targets.

    detkit bench moe-sweep --device cuda --out results/moe_sweep                 # every GPU preset
    detkit bench moe-sweep --device cuda --quick --out results/moe_quick
    detkit bench moe-sweep --device cpu --out /tmp/moe_sweep                     # interpreter: plumbing
    detkit bench moe-sweep --merge results/a --merge results/b --out results/ab  # re-report saved runs

Each case is (preset, T, routing). Per case: validate, then time (bench moe's rules: detkit forward +
backward twice, bitwise equal; every tensor within relative L2 VALIDATE_REL_L2 of the PyTorch
baseline; the baseline's backward-alone calls reproduce its gradients), then time three measures
interleaved with the baseline (toolkit.timing: CUDA events, L2 flushed, warm-up excluded, median with
p20/p80), one row per (measure, implementation):
    fwd       the whole layer forward, routing metadata included
    bwd       the backward alone on saved activations: detkit ``moe_mlp_bwd(dout, saved)``; the
              baseline ``torch.autograd.grad(out, leaves, dout, retain_graph=True)`` on one forward
              graph kept alive (fresh gradient tensors, no ``.grad`` accumulation, like detkit's)
    fwd_bwd   forward then backward
The fwd_bwd rows carry the peak memory of one call per implementation (torch.cuda.max_memory_allocated
after a reset; "delta" is the peak over what was allocated before the call) and, at one T per preset
(PROFILE_T when swept, else the largest T; uniform routing when swept), a torch.profiler breakdown of
one call (``breakdown``): CUDA kernels on a GPU, CPU self time on the CPU.

Routing. uniform: ``moe_common.make_inputs`` (top-k of Gaussian logits, balanced in expectation).
skewed: the same tensors with topk_ids replaced by K distinct experts per token drawn without
replacement from a Zipf law, P(expert of popularity rank r) ~ (r + 1)^-s with s = ZIPF_EXPONENT
(1.0, the classic law; ``--zipf-exponent``), the ranks a seeded permutation of the experts. Drawing
without replacement caps an expert at one route per token, so the hottest expert's rows are at most
T and max/mean at most E/K: at T=8192 and s=1 it is ~13x at Qwen3 (E=128, K=8), ~7x at OLMoE,
~2.5x at Mixtral, and with K = E (the reference shape) every token still routes to every expert:
skewed equals uniform in per-expert rows there and differs only in the order of a token's k slots.

Formulas (T tokens, K routes, hidden H, expert intermediate I, E experts):
    FLOPs fwd 6*T*K*H*I, bwd 12*T*K*H*I, fwd_bwd 18*T*K*H*I (padding rows and masked routes excluded)
    TFLOP/s = FLOPs / median time; mfu_datasheet = TFLOP/s / 989; mfu_measured = TFLOP/s / the cuBLAS
    BF16 8192^3 ceiling measured at the start of this run (toolkit.timing.measured_ceiling_tflops)
    speedup_vs_baseline = baseline median / detkit median (> 1: detkit faster)
Performance model, fitted to the detkit cases of one measure and routing by linear least squares:
    time = F / (989e12 * eta) + a * T*K*max(H, 2I) + b * E*T*K + c
the unknowns (1/eta, a, b, c). Within one preset all three non-constant features grow with T, so
the fit needs at least three presets whose shapes differ; fewer (or fewer than four cases) are
refused with the reason. Targets (TARGETS) are checked on the uniform fwd_bwd detkit rows and
reported; a row fails only when its case fails validation. On the CPU every time is
Triton-interpreter wall time: rows and report say so, no TFLOP/s, MFU or target verdicts are given,
and the fit is only the plumbing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from itertools import groupby
from pathlib import Path

import click
import numpy as np
import torch

from detkit.bench.moe_common import (
    DATASHEET_BF16_TFLOPS, INTERPRETER_LABEL, VALIDATE_REL_L2, BenchCase, make_inputs, offsets_reason, pick_baseline,
    rel_l2_fp32, run_baseline, torch_moe_fwd, with_range,
)
from detkit.toolkit.presets import MOE_GPU_PRESETS as GPU_PRESETS
from detkit.toolkit.presets import MOE_PRESETS, MoePreset
from detkit.toolkit.nvtx_ranges import nvtx_range
from detkit.toolkit.reports import markdown_table

NAME = "moe-sweep"
DESCRIPTION = ("The MoE expert MLP over a token sweep (uniform and skewed routing): fwd, bwd, fwd_bwd, memory, "
               "kernel breakdown, performance model and the MoE speed targets.")
RANKS = "single"
PRESETS = tuple(MOE_PRESETS)
ROUTINGS = ("uniform", "skewed")
ZIPF_EXPONENT = 1.0  # expert popularity ~ 1 / (rank + 1), the classic Zipf law
SWEEP_TOKENS = (1024, 2048, 4096, 8192, 16384)
QUICK_PRESETS = ("reference", "qwen3-30b-a3b")
QUICK_TOKENS = (1024, 8192, 16384)  # T = 8192 and 16384: every target's case
CPU_PRESETS = ("tiny",)
CPU_TOKENS = (16, 64)
MEASURES = ("fwd", "bwd", "fwd_bwd")
IMPLS = ("detkit", "baseline")
PROFILE_T = 8192
TOP_KERNELS = 10
MODEL_PARAMS = ("inv_eta", "a", "b", "c")
RANK_RTOL = 1e-9  # singular values below this fraction of the largest (columns scaled to 1) are zero
NOT_ON_CPU = "not available (cpu)"
OPTIONS = (
    click.option("--tokens", multiple=True, type=int,
                 help=f"T values; repeat (default {SWEEP_TOKENS} on cuda, {QUICK_TOKENS} with --quick, {CPU_TOKENS} "
                      "on cpu)."),
    click.option("--routing", "routings", multiple=True, type=click.Choice(ROUTINGS),
                 help=f"Routing kinds; repeat (default: {', '.join(ROUTINGS)})."),
    click.option("--zipf-exponent", type=float, default=ZIPF_EXPONENT, show_default=True,
                 help="s of the skewed routing's popularity law (rank + 1)^-s."),
    click.option("--quick", is_flag=True,
                 help=f"Short GPU run: presets {', '.join(QUICK_PRESETS)}, T {QUICK_TOKENS} unless --preset/--tokens say."),
    click.option("--no-profile", is_flag=True, help="Skip the torch.profiler breakdown."),
)


@dataclasses.dataclass(frozen=True)
class Target:
    label: str
    preset: str
    t: int
    field: str  # a detkit fwd_bwd uniform row field
    minimum: float


# The MoE layer's speed targets on an H200, forward+backward, deterministic.
TARGETS = (
    Target("MFU (of 989) at the reference shape >= 55%", "reference", 8192, "mfu_datasheet", 0.55),
    Target("MFU (of 989) at Qwen3-30B-A3B, T=16384 >= 40%", "qwen3-30b-a3b", 16384, "mfu_datasheet", 0.40),
    Target("speedup vs PyTorch baseline at the reference shape >= 1.3x", "reference", 8192,
           "speedup_vs_baseline", 1.3),
    Target("speedup vs PyTorch baseline at Qwen3-30B-A3B, T=16384 >= 1.3x", "qwen3-30b-a3b", 16384,
           "speedup_vs_baseline", 1.3),
)


# ---------------------------------------------------------------------------------------------
# Routing and inputs
# ---------------------------------------------------------------------------------------------
def zipf_popularity(num_experts: int, seed: int, exponent: float = ZIPF_EXPONENT) -> torch.Tensor:
    """[E] float64 probabilities summing to 1: expert e has rank perm[e], weight (rank + 1)^-exponent."""
    gen = torch.Generator().manual_seed(seed)
    rank = torch.randperm(num_experts, generator=gen)  # hot experts are not always the low ids
    weight = (rank.double() + 1.0) ** -exponent
    return weight / weight.sum()


def skewed_topk_ids(t: int, num_experts: int, k: int, seed: int, exponent: float = ZIPF_EXPONENT) -> torch.Tensor:
    """[T, K] int32 on the CPU: K distinct experts per token, drawn from ``zipf_popularity`` without
    replacement. Drawn on the CPU so the routing is the same whichever device runs the case."""
    if not 1 <= k <= num_experts:
        raise ValueError(f"skewed routing needs 1 <= K <= E; got K={k}, E={num_experts}")
    if not exponent > 0:
        raise ValueError(f"zipf exponent must be > 0 (0 is uniform routing); got {exponent}")
    popularity = zipf_popularity(num_experts, seed, exponent)
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.multinomial(popularity.expand(t, num_experts), k, replacement=False, generator=gen).to(torch.int32)


def make_case_inputs(p: MoePreset, routing: str, device: torch.device, seed: int,
                     exponent: float = ZIPF_EXPONENT) -> dict[str, torch.Tensor]:
    """moe_common.make_inputs at ``p``; skewed routing swaps in ``skewed_topk_ids`` (scores keep their
    softmax-of-top-k values: they do not depend on which experts were picked)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r} not known; supported: {ROUTINGS}")
    inp = make_inputs(p, device, seed)
    if routing == "skewed":
        inp["topk_ids"] = skewed_topk_ids(p.t, p.e, p.k, seed, exponent).to(device)
    return inp


def routing_stats(topk_ids: torch.Tensor, num_experts: int) -> dict:
    """Routed rows per expert: min, max, mean and imbalance = max / mean (1.0 = perfectly balanced)."""
    ids = topk_ids.reshape(-1).long()
    counts = torch.bincount(ids[ids >= 0], minlength=num_experts).cpu()
    mean = float(counts.sum()) / num_experts
    return {"expert_rows_min": int(counts.min()), "expert_rows_max": int(counts.max()),
            "expert_rows_mean": mean, "imbalance": float(counts.max()) / mean if mean else float("nan")}


# ---------------------------------------------------------------------------------------------
# Selection checks (before any work)
# ---------------------------------------------------------------------------------------------
def check_selection(presets: Sequence[str], tokens: Sequence[int], routings: Sequence[str],
                    zipf_exponent: float = ZIPF_EXPONENT) -> None:
    """Refuse a bad selection with the value and what is supported; nothing has run yet."""
    if not (isinstance(zipf_exponent, (int, float)) and math.isfinite(zipf_exponent) and zipf_exponent > 0):
        raise ValueError(f"zipf exponent {zipf_exponent!r} not supported; it must be a finite number > 0 "
                         "(uniform routing is the 'uniform' kind)")
    if not presets:
        raise ValueError(f"no preset selected; known: {sorted(MOE_PRESETS)}")
    unknown = [p for p in presets if p not in MOE_PRESETS]
    if unknown:
        raise ValueError(f"preset(s) {unknown} not known; known: {sorted(MOE_PRESETS)}")
    if not tokens:
        raise ValueError("no token count (T) selected")
    bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or t < 1]
    if bad:
        raise ValueError(f"token count(s) T={bad} not supported; T must be an int >= 1")
    for what, values in (("preset", presets), ("T", tokens), ("routing", routings)):
        if len(set(values)) != len(values):
            raise ValueError(f"{what} values repeat: {list(values)}; give each once")
    if not routings:
        raise ValueError(f"no routing selected; supported: {ROUTINGS}")
    bad_routing = [r for r in routings if r not in ROUTINGS]
    if bad_routing:
        raise ValueError(f"routing(s) {bad_routing} not known; supported: {ROUTINGS}")
    for name in presets:
        for t in tokens:
            reason = offsets_reason(dataclasses.replace(MOE_PRESETS[name], t=t))
            if reason:
                raise ValueError(f"preset {name!r}: {reason}")


def profile_case(tokens: Sequence[int], routings: Sequence[str]) -> tuple[int, str]:
    """The (T, routing) whose fwd_bwd is profiled, per preset."""
    return (PROFILE_T if PROFILE_T in tokens else max(tokens)), ("uniform" if "uniform" in routings else routings[0])


# ---------------------------------------------------------------------------------------------
# Measurement helpers
# ---------------------------------------------------------------------------------------------
def row_name(p: MoePreset, routing: str, measure: str, impl: str) -> str:
    """Report-row name == NVTX range name of the call it times."""
    return f"{p.label} {routing} {measure} | {impl}"


@contextmanager
def _stage_range(name: str) -> Iterator[None]:
    """NVTX range plus a profiler label: on the CPU the interpreter's kernel time shows up as the
    stage's self time, since no torch op runs inside it."""
    with ExitStack() as stack:
        stack.enter_context(nvtx_range(name))
        stack.enter_context(torch.profiler.record_function(name))
        yield


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(fn: Callable[[], object], device: torch.device) -> dict:
    """Peak bytes allocated during one call, and the peak over what was allocated before it."""
    if device.type != "cuda":
        return {"peak_memory_bytes": NOT_ON_CPU, "peak_memory_delta_bytes": NOT_ON_CPU}
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()  # the result is dropped at once: only the call's own peak counts
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_memory_bytes": int(peak), "peak_memory_delta_bytes": int(peak - before)}


def kernel_breakdown(fn: Callable[[], object], device: torch.device, range_name: str) -> list[dict]:
    """One profiled call: per kernel name, calls, total us and share of the sum. Call it on a warm
    ``fn`` (run_case profiles after timing: compiled, allocator primed).

    CUDA: device kernels (and memcpy/memset), their GPU intervals. CPU: self CPU time of every op and
    range (the stage ranges hold the interpreter's kernel time), so nothing is counted twice."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        with nvtx_range(range_name):
            fn()
        _sync(device)
    return aggregate_events(prof.events(), cuda)


def aggregate_events(events, cuda: bool) -> list[dict]:
    """Profiler events -> one entry per name (calls, total_us, share, rank), largest total first."""
    from torch.autograd import DeviceType

    totals: dict[str, list] = {}
    for ev in events:
        # On the GPU, record_function ranges reappear as CUDA-typed user annotations spanning their
        # kernels: skipped, as torch's own tables do, so no kernel time is counted twice.
        if cuda and (ev.device_type != DeviceType.CUDA or ev.is_user_annotation):
            continue
        if not cuda and ev.device_type != DeviceType.CPU:
            continue
        us = ev.time_range.elapsed_us() if cuda else ev.self_cpu_time_total
        acc = totals.setdefault(ev.name, [0, 0.0])
        acc[0] += 1
        acc[1] += float(us)
    total = sum(v[1] for v in totals.values())
    ranked = sorted(totals.items(), key=lambda kv: (-kv[1][1], kv[0]))
    return [{"kernel": name, "calls": calls, "total_us": us, "share": us / total if total else float("nan"),
             "rank": i + 1, "activity": "cuda" if cuda else "cpu"} for i, (name, (calls, us)) in enumerate(ranked)]


# ---------------------------------------------------------------------------------------------
# Cases and the run
# ---------------------------------------------------------------------------------------------
def cases(ctx, tokens: Sequence[int] = (), routings: Sequence[str] = (), zipf_exponent: float = ZIPF_EXPONENT,
          quick: bool = False, no_profile: bool = False) -> list[BenchCase]:
    """One case per (preset, T, routing, measure, implementation), in run order; the selection is checked
    first (nothing has run)."""
    if quick and ctx.interpreted:
        raise ValueError("--quick is a GPU run (reference and qwen3-30b-a3b shapes); on cpu use the defaults")
    presets = list(ctx.presets or (QUICK_PRESETS if quick else CPU_PRESETS if ctx.interpreted else GPU_PRESETS))
    tokens = list(tokens or (QUICK_TOKENS if quick else CPU_TOKENS if ctx.interpreted else SWEEP_TOKENS))
    routings = list(routings or ROUTINGS)
    check_selection(presets, tokens, routings, zipf_exponent)
    out = []
    for name in presets:
        for t in tokens:
            p = dataclasses.replace(MOE_PRESETS[name], t=t)
            for routing in routings:
                group = f"{name} T={t} {routing}"
                out += [BenchCase(row_name(p, routing, m, impl), group, name, m, t, routing, impl)
                        for m in MEASURES for impl in IMPLS]
    return out


def run(ctx, cases: list[BenchCase], tokens=(), routings=(), zipf_exponent: float = ZIPF_EXPONENT,
        quick: bool = False, no_profile: bool = False) -> Iterator[dict]:
    device = ctx.device
    if device.type == "cuda":
        from detkit.toolkit.timing import CEILING_SHAPE, measured_ceiling_tflops

        n = CEILING_SHAPE
        with nvtx_range(f"ceiling cublas bf16 [M={n}, N={n}, K={n}]"):
            ceiling = measured_ceiling_tflops(device)
    else:
        ceiling = None
    baseline_choice = pick_baseline(device)
    prof_t, prof_routing = profile_case(sorted({c.t for c in cases}), list(dict.fromkeys(c.routing for c in cases)))
    for _, group in groupby(cases, key=lambda c: c.group):
        group = list(group)
        first = group[0]
        p = dataclasses.replace(MOE_PRESETS[first.preset], t=first.t)
        yield from run_case(p, first.routing, group, ctx, baseline_choice,
                            profile=not no_profile and (first.t, first.routing) == (prof_t, prof_routing),
                            ceiling_tflops=ceiling, exponent=zipf_exponent)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # each case starts from the same allocator state


def run_case(p: MoePreset, routing: str, group: list[BenchCase], ctx, baseline_choice: tuple[bool, str],
             profile: bool = False, ceiling_tflops: float | None = None,
             exponent: float = ZIPF_EXPONENT) -> Iterator[dict]:
    """The rows of one (preset at its T, routing) case, one per (measure, implementation) in ``group``."""
    from detkit.kernels.moe.layer import MOE_CONFIG_TABLE_VERSION, moe_mlp_bwd, moe_mlp_fwd
    from detkit.kernels.moe.routing import build_routing
    from detkit.toolkit.contract import compare_bits
    from detkit.toolkit.timing import time_interleaved

    device, interpreted, rounds, seed = ctx.device, ctx.interpreted, ctx.rounds, ctx.seed
    inp = make_case_inputs(p, routing, device, seed, exponent)
    x, w1, w2, ids, scores, dout = (inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout"))
    grouped, baseline = baseline_choice
    state = {"grouped": grouped}
    grad_names = ("x", "w1", "w2", "scores")

    def det_fwd(stage_range=nvtx_range):
        return moe_mlp_fwd(x, w1, w2, ids, scores, stage_range=stage_range)

    def det_fwd_bwd(stage_range=nvtx_range):
        out, saved = det_fwd(stage_range)
        g = moe_mlp_bwd(dout, saved, stage_range=stage_range)
        return {"out": out, "dx": g.dx, "dw1": g.dw1, "dw2": g.dw2, "dscores": g.dscores}

    def base_fwd():
        return torch_moe_fwd(x, w1, w2, ids, scores, state["grouped"])

    def base_graph():
        leaves = {n: inp[n].detach().requires_grad_() for n in grad_names}
        out = torch_moe_fwd(leaves["x"], leaves["w1"], leaves["w2"], ids, leaves["scores"], state["grouped"])
        return out, [leaves[n] for n in grad_names]

    def base_fwd_bwd():
        out, leaves = base_graph()
        out.backward(dout)
        return {"out": out.detach(), **{f"d{n}": leaf.grad for n, leaf in zip(grad_names, leaves)}}

    with nvtx_range(f"validate {p.label} {routing}"):
        first, second = det_fwd_bwd(), det_fwd_bwd()
        base, baseline = run_baseline(base_fwd_bwd, state, baseline)
        # The baseline's timed backward (autograd.grad on a kept graph) is another code path than
        # .backward(): it must give the same gradients. detkit's fwd_bwd already is fwd, then
        # moe_mlp_bwd on the saved state, so its repeat check covers the backward alone.
        base_bwd_grads = torch.autograd.grad(*base_graph(), dout)

    repeat_equal = all(compare_bits(first[n], second[n]).equal for n in first)
    rel = {f"rel_l2_vs_baseline_{n}": rel_l2_fp32(first[n], base[n]) for n in first}
    base_bwd_rel = max(rel_l2_fp32(g, base[f"d{n}"]) for n, g in zip(grad_names, base_bwd_grads))
    valid = (repeat_equal and base_bwd_rel <= VALIDATE_REL_L2
             and all(v <= VALIDATE_REL_L2 for v in rel.values()))
    routing_meta = build_routing(ids, scores, p.e)
    common = {
        "preset": p.name, "T": p.t, "H": p.h, "I": p.i, "E": p.e, "K": p.k, "routing": routing,
        "zipf_exponent": exponent if routing == "skewed" else None, "seed": seed, "baseline": baseline,
        "config_table_version": MOE_CONFIG_TABLE_VERSION, "backend": ctx.backend, "hardware_result": not interpreted,
        "measured_ceiling_tflops": ceiling_tflops, "validated": valid, "repeat_bitwise_equal": repeat_equal,
        "baseline_bwd_only_rel_l2": base_bwd_rel, **rel, "padded_rows": routing_meta.padded_rows,
        **routing_stats(ids, p.e),
    }
    if interpreted:
        common["note"] = INTERPRETER_LABEL
    # Freed before the memory measurement, so each peak starts from the inputs alone.
    del first, second, base, base_bwd_grads
    if not valid:
        failure = (f"validation failed, not timed: repeat bitwise equal {repeat_equal}, worst relative L2 vs the "
                   f"baseline {max([*rel.values(), base_bwd_rel]):.3g} (limit {VALIDATE_REL_L2:.3g})")
        for case in group:
            yield {**common, "name": case.name, "measure": case.measure, "impl": case.impl, "passed": False,
                   "failure": failure}
        return
    memory = {"detkit": peak_memory(det_fwd_bwd, device), "baseline": peak_memory(base_fwd_bwd, device)}

    # Saved activations (detkit) and one kept forward graph (baseline) for the backward alone.
    det_saved = det_fwd()[1]
    base_out, base_leaves = base_graph()

    def det_bwd():
        return moe_mlp_bwd(dout, det_saved, stage_range=nvtx_range)

    def base_bwd():
        return torch.autograd.grad(base_out, base_leaves, dout, retain_graph=True)

    fns = {"fwd": {"detkit": det_fwd, "baseline": base_fwd},
           "bwd": {"detkit": det_bwd, "baseline": base_bwd},
           "fwd_bwd": {"detkit": det_fwd_bwd, "baseline": base_fwd_bwd}}
    for measure, sel in groupby(group, key=lambda c: c.measure):
        names = {c.impl: c.name for c in sel}
        timings = time_interleaved({names[i]: with_range(names[i], fns[measure][i]) for i in names}, device,
                                   rounds=rounds)
        flops = p.flops(measure)
        breakdown = {}
        if profile and measure == "fwd_bwd":  # after timing: compiled, allocator primed
            profiled = {"detkit": lambda: det_fwd_bwd(_stage_range), "baseline": base_fwd_bwd}
            breakdown = {i: kernel_breakdown(profiled[i], device, f"{names[i]} profile") for i in names}
        medians = {i: timings[names[i]].median_us for i in names}
        for impl, name in names.items():
            t = timings[name]
            row = {**common, "name": name, "measure": measure, "impl": impl, "flops": flops, **vars(t), "passed": True}
            if not interpreted:
                tflops = flops / (t.median_us * 1e-6) / 1e12
                row.update({"tflops": tflops, "mfu_datasheet": tflops / DATASHEET_BF16_TFLOPS,
                            "mfu_measured": tflops / ceiling_tflops if ceiling_tflops else None})
            if impl == "detkit" and "baseline" in medians:
                row.update({"ratio_vs_baseline": medians["detkit"] / medians["baseline"],
                            "speedup_vs_baseline": medians["baseline"] / medians["detkit"]})
            if measure == "fwd_bwd":
                row.update(memory[impl])
            if impl in breakdown:
                row["breakdown"] = breakdown[impl]
            yield row


# ---------------------------------------------------------------------------------------------
# Performance model
# ---------------------------------------------------------------------------------------------
def model_features(row: Mapping) -> list[float]:
    """[F / 989e12, T*K*max(H, 2I), E*T*K, 1]: time = feature . (1/eta, a, b, c)."""
    t, h, i, e, k = (row[n] for n in ("T", "H", "I", "E", "K"))
    return [row["flops"] / (DATASHEET_BF16_TFLOPS * 1e12), float(t * k * max(h, 2 * i)), float(e * t * k), 1.0]


def fit_perf_model(cases: Sequence[Mapping]) -> dict:
    """Least-squares fit of time = F/(989e12*eta) + a*T*K*max(H,2I) + b*E*T*K + c.

    ``cases``: mappings with T, H, I, E, K, flops and median_us (name optional). Returns eta, a, b,
    c (seconds per unit of their feature), R^2 and per-case residuals. Refuses fewer cases than
    parameters and cases that cannot tell the parameters apart (rank-deficient features)."""
    n = len(cases)
    if n < len(MODEL_PARAMS):
        raise ValueError(f"the performance model has {len(MODEL_PARAMS)} parameters {MODEL_PARAMS}; "
                         f"got {n} case(s), need at least {len(MODEL_PARAMS)}")
    a_mat = np.array([model_features(c) for c in cases], dtype=np.float64)
    y = np.array([c["median_us"] * 1e-6 for c in cases], dtype=np.float64)
    if not (np.isfinite(a_mat).all() and np.isfinite(y).all() and (y > 0).all()):
        raise ValueError("the performance model needs finite features and positive finite times")
    scale = np.abs(a_mat).max(axis=0)  # columns to unit size, so the rank test is scale-free
    scaled = a_mat / scale
    sv = np.linalg.svd(scaled, compute_uv=False)
    rank = int((sv > RANK_RTOL * sv[0]).sum())
    if rank < len(MODEL_PARAMS):
        shapes = sorted({(c["H"], c["I"], c["E"], c["K"]) for c in cases})
        raise ValueError(f"the performance model is not identifiable from these {n} cases: feature rank {rank} < "
                         f"{len(MODEL_PARAMS)}. Within one shape F, T*K*max(H,2I) and E*T*K all grow with T, so "
                         f"the cases need at least three shapes (H, I, E, K) with different ratios; got {shapes}")
    coef_scaled, *_ = np.linalg.lstsq(scaled, y, rcond=None)
    coef = coef_scaled / scale
    pred = a_mat @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    inv_eta, a, b, c = (float(v) for v in coef)
    return {
        "cases": n, "rank": rank, "inv_eta": inv_eta,
        "eta": 1.0 / inv_eta if inv_eta > 0 else None,  # None: the fit gave no positive GEMM efficiency
        "a_s_per_elem": a, "b_s_per_route_expert": b, "c_s": c,
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else None,
        "exactly_determined": n == len(MODEL_PARAMS),
        "residuals": [{"name": cs.get("name", str(j)), "measured_us": float(y[j] * 1e6),
                       "predicted_us": float(pred[j] * 1e6), "residual_us": float((y[j] - pred[j]) * 1e6),
                       "rel_residual": float((y[j] - pred[j]) / y[j])} for j, cs in enumerate(cases)],
    }


def model_fits(rows: Sequence[Mapping]) -> list[dict]:
    """One fit per (measure fwd_bwd / fwd, routing and all routings) over the validated detkit rows;
    a refused fit carries its reason in ``error``."""
    fits = []
    timed = [r for r in rows if r.get("impl") == "detkit" and r.get("measure") in MEASURES and r.get("validated")]
    routings = list(dict.fromkeys(r["routing"] for r in timed))
    groups = routings + (["all"] if len(routings) > 1 else [])
    for measure in ("fwd_bwd", "fwd"):
        for routing in groups:
            sel = [r for r in timed if r["measure"] == measure and routing in ("all", r["routing"])]
            fit = {"measure": measure, "routing": routing}
            try:
                fit.update(fit_perf_model(sel))
            except ValueError as exc:
                fit["error"] = str(exc)
            fits.append(fit)
    return fits


# ---------------------------------------------------------------------------------------------
# Targets and the report
# ---------------------------------------------------------------------------------------------
def target_verdicts(rows: Sequence[Mapping], hardware_result: bool) -> list[dict]:
    """Each target's value and verdict from the uniform fwd_bwd detkit row at its preset and T."""
    out = []
    for tg in TARGETS:
        entry = {"target": tg.label, "preset": tg.preset, "T": tg.t, "minimum": tg.minimum, "value": None}
        match = [r for r in rows if (r.get("preset"), r.get("T"), r.get("routing")) == (tg.preset, tg.t, "uniform")
                 and r.get("impl") == "detkit" and r.get("measure") == "fwd_bwd"]
        if not hardware_result:
            entry["verdict"] = "not evaluated (interpreter, not a hardware result)"
        elif not match:
            entry["verdict"] = f"NOT RUN ({tg.preset} at T={tg.t}, uniform routing, is not in this sweep)"
        elif not match[0].get("validated"):
            entry["verdict"] = "FAIL (validation failed)"
        else:
            value = match[0].get(tg.field)
            entry["value"] = value
            entry["verdict"] = "PASS" if value is not None and value >= tg.minimum else "FAIL"
        out.append(entry)
    return out


def derive(rows: list[dict], meta: dict) -> dict:
    """The performance-model fits and the target verdicts over every row of the run."""
    return {"fits": model_fits(rows), "targets": target_verdicts(rows, bool(meta.get("hardware_result")))}


def describe(ctx, cases, rows, session) -> dict:
    first = rows[0] if rows else {}
    meta = {"presets": list(dict.fromkeys(c.preset for c in cases)), "tokens": sorted({c.t for c in cases}),
            "routings": list(dict.fromkeys(c.routing for c in cases)), "baseline": first.get("baseline"),
            "measured_ceiling_tflops": first.get("measured_ceiling_tflops") if ctx.device.type == "cuda"
            else "skipped on cpu (interpreter, not a hardware result)",
            "datasheet_bf16_tflops": DATASHEET_BF16_TFLOPS,
            "flops_formula": "fwd 6*T*K*H*I; bwd 12*T*K*H*I; fwd_bwd 18*T*K*H*I"}
    if ctx.interpreted:
        meta["note"] = INTERPRETER_LABEL
    return meta


def _mib(v) -> object:
    return v / 2**20 if isinstance(v, (int, float)) else v


def summarize(rows: list[dict], meta: dict) -> str:
    hw = bool(meta.get("hardware_result"))
    derived = meta.get("derived") or derive(rows, meta)
    lines = [f"- {key}: {meta[key]}" for key in ("presets", "tokens", "routings", "baseline", "measured_ceiling_tflops",
                                                 "datasheet_bf16_tflops", "flops_formula") if key in meta]
    lines += ["", "## Targets (H200, forward+backward, deterministic, uniform routing)", "",
              markdown_table(derived["targets"], ("target", "value", "minimum", "verdict")), ""]
    for measure, title in (("fwd_bwd", "Forward + backward"), ("fwd", "Forward"), ("bwd", "Backward alone")):
        sel = [r for r in rows if r.get("measure") == measure and "median_us" in r]
        if not sel:
            continue
        by = {(r["preset"], r["T"], r["routing"], r["impl"]): r for r in sel}
        table = []
        for (preset, t, routing, impl), r in by.items():
            if impl != "detkit":
                continue
            b = by.get((preset, t, routing, "baseline"), {})
            entry = {"preset": preset, "T": t, "routing": routing, "imbalance": r.get("imbalance"),
                     "detkit_us": r["median_us"], "detkit_p20_us": r["p20_us"], "detkit_p80_us": r["p80_us"],
                     "baseline_us": b.get("median_us"), "speedup": r.get("speedup_vs_baseline")}
            if hw:
                entry.update({"detkit_tflops": r.get("tflops"), "detkit_mfu_989": r.get("mfu_datasheet"),
                              "detkit_mfu_ceiling": r.get("mfu_measured"), "baseline_mfu_989": b.get("mfu_datasheet"),
                              "detkit_sm_clock_MHz": r.get("sm_clock_mhz"), "baseline_sm_clock_MHz": b.get("sm_clock_mhz")})
            if measure == "fwd_bwd":
                entry.update({"detkit_peak_MiB": _mib(r.get("peak_memory_bytes")),
                              "baseline_peak_MiB": _mib(b.get("peak_memory_bytes"))})
            table.append(entry)
        lines += [f"## {title}" + ("" if hw else " (interpreter wall time, not a hardware result)"), "",
                  markdown_table(table, list(table[0]) if table else ()), ""]

    fit_cols = ("measure", "routing", "cases", "eta", "a_s_per_elem", "b_s_per_route_expert", "c_s", "r2", "error")
    lines += ["## Performance model", "",
              "time = F / (989e12 * eta) + a * T*K*max(H, 2I) + b * E*T*K + c, least squares over the validated "
              "detkit cases of each measure and routing.", ""]
    if not hw:
        lines += ["(interpreter wall time: the fit below only proves the plumbing)", ""]
    lines += [markdown_table([{k: f.get(k) for k in fit_cols} for f in derived["fits"]], fit_cols), ""]
    for f in derived["fits"]:
        if "residuals" in f:
            lines += [f"### Residuals: {f['measure']}, routing {f['routing']}", "",
                      markdown_table(f["residuals"], ("name", "measured_us", "predicted_us", "residual_us",
                                                      "rel_residual")), ""]
    profiled = [r for r in rows if r.get("breakdown")]
    if profiled:
        lines += [f"## Per-kernel time, one fwd_bwd (top {TOP_KERNELS} per implementation)", ""]
        for r in profiled:
            sel = r["breakdown"][:TOP_KERNELS]
            what = ("CUDA kernels" if sel and sel[0]["activity"] == "cuda"
                    else "CPU self time, interpreter, not a hardware result")
            lines += [f"### {r['name']} ({what})", "",
                      markdown_table(sel, ("rank", "kernel", "calls", "total_us", "share")), ""]
    return "\n".join(lines)


def plots(out_dir: Path, rows: list[dict]) -> list[Path]:
    """One mfu_vs_T_<preset>.png per preset with timed rows."""
    paths = []
    hw = any(r.get("hardware_result") for r in rows)
    for preset in dict.fromkeys(r["preset"] for r in rows if "median_us" in r):
        path = Path(out_dir) / f"mfu_vs_T_{preset}.png"
        plot_preset(rows, preset, hw, path)
        paths.append(path)
    return paths


def plot_preset(rows: Sequence[Mapping], preset: str, hardware_result: bool, path: Path) -> None:
    """MFU (of 989) vs T for fwd_bwd and fwd: detkit solid, baseline dashed, one marker per routing.
    Interpreter runs plot wall time instead, titled as such."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from detkit.toolkit.reports import save_figure, style_log2_axes

    field, ylabel = ("mfu_datasheet", "MFU (of 989 TFLOP/s)") if hardware_result else ("median_us", "wall time (us)")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    for ax, measure in zip(axes[0], ("fwd_bwd", "fwd")):
        for impl, style in (("detkit", "-"), ("baseline", "--")):
            for routing, marker in zip(ROUTINGS, ("o", "s")):
                sel = sorted((r for r in rows if (r.get("preset"), r.get("measure"), r.get("impl"), r.get("routing"))
                              == (preset, measure, impl, routing) and r.get(field) is not None), key=lambda r: r["T"])
                if sel:
                    ax.plot([r["T"] for r in sel], [r[field] for r in sel], linestyle=style, marker=marker,
                            label=f"{impl} {routing}")
        if hardware_result and measure == "fwd_bwd":
            for tg in TARGETS:
                if tg.preset == preset and tg.field == "mfu_datasheet":
                    ax.axhline(tg.minimum, color="grey", linewidth=0.8, linestyle=":",
                               label=f"target {tg.minimum:.0%} at T={tg.t}")
        style_log2_axes(ax, f"{preset} {measure}", "T (tokens)", ylabel)
    if not hardware_result:
        fig.suptitle("Triton interpreter wall time: NOT a hardware result", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
