"""``detkit bench moe``: the MoE expert MLP side by side in one run, per preset: the BF16 detkit layer
(kernels/moe/layer.py), the FP8 detkit layer (kernels/moe/fp8/layer.py, default weight gradients), torch._grouped_mm and
transformers' Qwen3-MoE block as transformers runs it and inside ``detkit.batch_invariant_mode()`` (bench/moe_hf.py),
forward and forward+backward, each eager and as a CUDA-graph replay, as ratios against the BF16 layer of the same run;
with ``--sweep``, FP8 against BF16 over E, K, T at two widths with the crossover T per shape.

    detkit bench moe --device cuda                                  # every GPU preset, all implementations
    detkit bench moe --device cuda --preset reference --out DIR
    detkit bench moe --device cuda --sweep --sweep-t 8192 --sweep-e 8 # a reduced sweep (no presets unless named)
    detkit bench moe --device cpu                                   # Triton interpreter: plumbing only

Implementations (``--impl``, repeatable; ``bf16`` always runs, it is the ratios' denominator):
    bf16            the detkit BF16 layer, moe_mlp_fwd / moe_mlp_bwd, routing metadata included
    fp8             the detkit FP8 layer, weights quantized in the call, the default weight gradients
    fp8_warm        as fp8 with the weight cache warm (later micro-batches of a step)      (not by default)
    fp8_wgrad_bf16  as fp8 with the BF16 weight gradients (the A/B behind the default)     (not by default)
    grouped_mm      the PyTorch baseline: torch._grouped_mm over the expert-sorted input, autograd backward
                    (bench/moe_common.py; a per-expert loop where _grouped_mm does not run, the rows say why)
    hf, hf_detkit   transformers' Qwen3MoeSparseMoeBlock (router + experts), default and under the mode
The detkit layers and the baseline are given the preset's routing; the block routes with its own router.

Per preset: validate every implementation, then time it; an implementation that fails validation is not timed and
each of its rows fails (the others still run). Validation: the BF16 layer twice, bitwise equal, and within relative L2
VALIDATE_REL_L2 of the FP64 oracle (kernels.moe.moe_mlp_ref) for out, dX, dW1, dW2, dscores; the FP8 layers twice,
bitwise equal, and the precision gate (bench/moe_fp8.py); fp8_warm with fp8's bits; the baseline within
VALIDATE_REL_L2 of the oracle; the blocks within VALIDATE_REL_L2 of an FP64 block with their own routes, and
hf_detkit's router and experts routed by the mode (its counters; bench/moe_hf.py). Timing (toolkit.timing), interleaved across implementations:
    eager   calls back to back between CUDA events, L2 flushed before each (what an eager user sees, host path
            included when it is longer than the GPU's work), median with p20/p80
    graph   the call captured in a CUDA graph and replayed GRAPH_REPLAYS times per round (GPU time, no host path;
            no L2 flush: the presets' operands exceed the 60 MB L2). The detkit layers read nothing back, so a
            failed capture fails their row; the baseline and the blocks are timed where they capture, and a row
            whose capture failed says so with the one-line reason
then, unless --no-stages, each BF16 and FP8 stage on its own (eager). With --sweep: at each point (widths
SWEEP_WIDTHS, E in SWEEP_EXPERTS, K in SWEEP_TOPK, T in SWEEP_TOKENS, K <= E; the ``--sweep-*`` flags select a
subset) bf16 and fp8 fwd_bwd, eager and graph, the FP8 layer gated against the BF16 one; per shape (H, I, E, K) and
timing the crossover T over the points (bench/moe_fp8.crossover).

Formulas (T tokens, K routes, hidden H, expert intermediate I): FLOPs fwd 6*T*K*H*I, fwd_bwd 18*T*K*H*I (padding
rows and masked routes excluded; the blocks' router, 2*T*H*E forward, not counted). TFLOP/s = FLOPs / median time;
mfu_bf16_peak = TFLOP/s / 989 and, for the FP8 layers, mfu_fp8_peak = TFLOP/s / 1979 (H100/H200 datasheet dense).
speedup_vs_bf16 = BF16 layer median / this median, same measure and timing, same run (> 1: faster than the BF16
layer); hf_detkit also speedup_vs_hf = hf median / hf_detkit median (> 1: the mode's block is faster). The FP8 rows'
rule_picks (and rule_reason): the layer the mode's FP8 experts run at the row's shape by kernels/moe/fp8/choice.py
("fp8", or "bf16" where FP8 was measured slower); the row times the FP8 layer either way.
Targets (TARGETS) are verdicts in the report, never assertions, and only on hardware: on the CPU every time is
Triton-interpreter wall time, the graph timing is a stand-in (no CUDA graphs: a call that reads device data on the
host is refused as a capture would refuse it, toolkit.host_reads), and no TFLOP/s, MFU or verdict is given.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import groupby

import click
import torch

from detkit.bench import moe_fp8, moe_hf
from detkit.bench.moe_common import (
    DATASHEET_BF16_TFLOPS, DATASHEET_FP8_TFLOPS, INTERPRETER_LABEL, VALIDATE_REL_L2, BenchCase, layer_tensors,
    make_inputs, offsets_reason, pick_baseline, rel_l2_fp32, run_baseline, stage_row_name, time_stages, timing_fields,
    torch_moe_fwd, with_range,
)
from detkit.toolkit.presets import MOE_GPU_PRESETS, MOE_PRESETS, MoePreset
from detkit.toolkit.reports import markdown_table

NAME = "moe"
DESCRIPTION = ("The MoE layer side by side: detkit BF16 and FP8, torch._grouped_mm, transformers' Qwen3-MoE block "
               "(default and under the mode); eager and CUDA graph; --sweep: FP8 vs BF16 over E, K, T.")
RANKS = "single"
PRESETS = tuple(MOE_PRESETS)  # the names --preset accepts

FP8_IMPLS = ("fp8", "fp8_warm", "fp8_wgrad_bf16")
HF_IMPLS = ("hf", "hf_detkit")
IMPLS = ("bf16", *FP8_IMPLS, "grouped_mm", *HF_IMPLS)
DEFAULT_IMPLS = ("bf16", "fp8", "grouped_mm", *HF_IMPLS)
CAPTURE_REQUIRED = ("bf16", *FP8_IMPLS)  # no host read in detkit's layers: a failed capture is a failure
MEASURES = ("fwd", "fwd_bwd")
TIMINGS = ("eager", "graph")
GRAPH_REPLAYS = 10
CPU_PRESETS = ("tiny-all",)
SWEEP_WIDTHS = ((3072, 1536), (2048, 768))  # (H, I): the reference shape's and Qwen3-30B-A3B's
SWEEP_EXPERTS = (8, 32, 64, 128)
SWEEP_TOPK = (2, 4, 8)
SWEEP_TOKENS = (2048, 8192, 16384)
CPU_SWEEP = {"widths": ((128, 128),), "experts": (2,), "topk": (2,), "tokens": (16, 32)}  # interpreter plumbing
SWEEP_PREFIX = "sweep"
# Each BF16 stage alone: name -> FLOPs per T*K*H*I.
STAGES = {"routing": 0.0, "up_swiglu": 4.0, "down": 2.0, "combine": 0.0, "dgrad_dswiglu": 2.0, "dx_route": 4.0,
          "dx_gather_sum": 0.0, "wgrad_w1": 4.0, "wgrad_w2": 2.0, "dscores": 0.0}

OPTIONS = (
    click.option("--impl", "impls", multiple=True, type=click.Choice(IMPLS),
                 help=f"Implementations to run; repeat (default: {', '.join(DEFAULT_IMPLS)}; bf16 always runs, and fp8 "
                      "with either FP8 variant)."),
    click.option("--measure", "measures", multiple=True, type=click.Choice(MEASURES),
                 help="fwd and/or fwd_bwd; repeat (default both). Sweep points are fwd_bwd."),
    click.option("--no-stages", is_flag=True, help="Skip the per-stage timings (BF16 and FP8)."),
    click.option("--hf-experts", type=click.Choice(moe_hf.EXPERTS_IMPLEMENTATIONS), default=moe_hf.DEFAULT_EXPERTS,
                 show_default=True, help="transformers' experts implementation for the hf rows."),
    click.option("--sweep", is_flag=True, help="FP8 vs BF16 over E, K, T at two widths, with the crossover T per "
                                               "shape (the default presets are then skipped unless --preset)."),
    click.option("--sweep-width", "sweep_widths", multiple=True,
                 help="HxI widths of the sweep, e.g. 2048x768; repeat (default 3072x1536 and 2048x768)."),
    click.option("--sweep-e", "sweep_experts", multiple=True, type=int,
                 help=f"E values; repeat (default {SWEEP_EXPERTS})."),
    click.option("--sweep-k", "sweep_topk", multiple=True, type=int, help=f"K values; repeat (default {SWEEP_TOPK})."),
    click.option("--sweep-t", "sweep_tokens", multiple=True, type=int,
                 help=f"T values; repeat (default {SWEEP_TOKENS})."),
)


# ---------------------------------------------------------------------------------------------
# Targets: verdicts on hardware rows, never assertions
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    key: str
    label: str
    field: str  # of the fwd_bwd row of ``impl``
    impl: str
    minimum: float


REFERENCE_SHAPE = (8192, 3072, 1536, 8, 8)  # (T, H, I, E, K)
QWEN3_30B_16K_SHAPE = (16384, 2048, 768, 128, 8)
TARGETS = (
    Target("fp8_reference", "FP8 fwd_bwd >= 1.4x BF16 at the reference shape (T=8192, H=3072, I=1536, E=8, K=8)",
           "speedup_vs_bf16", "fp8", 1.4),
    Target("fp8_presets", "FP8 fwd_bwd >= 1.2x BF16 at every GPU preset with H, I multiples of 128",
           "speedup_vs_bf16", "fp8", 1.2),
    Target("fp8_sweep", "FP8 fwd_bwd >= 1.2x BF16 at every sweep point with T >= 8192", "speedup_vs_bf16", "fp8", 1.2),
    Target("bf16_mfu_reference", "BF16 fwd_bwd MFU (of 989) >= 60% at the reference shape", "mfu_bf16_peak", "bf16",
           0.60),
    Target("bf16_mfu_qwen3_30b_a3b_16k", "BF16 fwd_bwd MFU (of 989) >= 50% at Qwen3-30B-A3B widths, T=16384",
           "mfu_bf16_peak", "bf16", 0.50),
)
SWEEP_TARGET_MIN_T = 8192


# ---------------------------------------------------------------------------------------------
# Selection (checked before any work)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    impls: tuple[str, ...]
    measures: tuple[str, ...]
    presets: tuple[str, ...]
    points: tuple[MoePreset, ...]
    stages: bool
    hf_experts: str


def shape_label(p: MoePreset) -> str:
    return f"moe [T={p.t}, H={p.h}, I={p.i}, E={p.e}, K={p.k}]"


def case_name(p: MoePreset, measure: str, timing: str, impl: str, sweep: bool = False) -> str:
    """The row's name and the NVTX range of its timed calls."""
    return f"{SWEEP_PREFIX + ' ' if sweep else ''}{shape_label(p)} {measure} {timing} | {impl}"


def sweep_point(h: int, i: int, e: int, k: int, t: int) -> MoePreset:
    return MoePreset(f"{SWEEP_PREFIX}-H{h}-I{i}-E{e}-K{k}-T{t}", t, h, i, e, k)


_POINT = re.compile(rf"{SWEEP_PREFIX}-H(\d+)-I(\d+)-E(\d+)-K(\d+)-T(\d+)")


def preset_of(group: str) -> tuple[MoePreset, bool]:
    """(the preset, is a sweep point) of a case group."""
    if group in MOE_PRESETS:
        return MOE_PRESETS[group], False
    h, i, e, k, t = (int(v) for v in _POINT.fullmatch(group).groups())
    return sweep_point(h, i, e, k, t), True


def _width(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not m:
        raise ValueError(f"--sweep-width {text!r} not understood; write HxI, e.g. 2048x768")
    return int(m.group(1)), int(m.group(2))


def _unique(what: str, values) -> None:
    if len(set(values)) != len(values):
        raise ValueError(f"{what} values repeat: {list(values)}; give each once")


def make_plan(ctx, impls=(), measures=(), no_stages=False, hf_experts=moe_hf.DEFAULT_EXPERTS, sweep=False,
              sweep_widths=(), sweep_experts=(), sweep_topk=(), sweep_tokens=()) -> Plan:
    """The run's implementations, measures, presets and sweep points; a bad selection raises ValueError."""
    for what, values in (("--impl", impls), ("--measure", measures)):
        _unique(what, values)
    bad = [v for v in impls if v not in IMPLS]
    if bad:
        raise ValueError(f"implementation(s) {bad} not known; supported: {IMPLS}")
    chosen = {"bf16", *(impls or DEFAULT_IMPLS)}
    if chosen & set(FP8_IMPLS):
        chosen.add("fp8")  # the FP8 variants are checked against its bits and gate
    chosen = tuple(v for v in IMPLS if v in chosen)
    measures = tuple(m for m in MEASURES if m in (measures or MEASURES))
    if hf_experts not in moe_hf.EXPERTS_IMPLEMENTATIONS:
        raise ValueError(f"--hf-experts {hf_experts!r} not supported; supported: {moe_hf.EXPERTS_IMPLEMENTATIONS}")
    given = [f for f, v in (("--sweep-width", sweep_widths), ("--sweep-e", sweep_experts), ("--sweep-k", sweep_topk),
                            ("--sweep-t", sweep_tokens)) if v]
    if given and not sweep:
        raise ValueError(f"{', '.join(given)}: sweep point selection, only with --sweep")
    points: list[MoePreset] = []
    if sweep:
        cpu = CPU_SWEEP if ctx.interpreted else None
        widths = tuple(_width(w) for w in sweep_widths) or (cpu["widths"] if cpu else SWEEP_WIDTHS)
        experts = tuple(sweep_experts) or (cpu["experts"] if cpu else SWEEP_EXPERTS)
        topk = tuple(sweep_topk) or (cpu["topk"] if cpu else SWEEP_TOPK)
        tokens = tuple(sweep_tokens) or (cpu["tokens"] if cpu else SWEEP_TOKENS)
        for what, values in (("--sweep-width", widths), ("--sweep-e", experts), ("--sweep-k", topk),
                             ("--sweep-t", tokens)):
            _unique(what, values)
            if any(isinstance(v, int) and v < 1 for v in values):
                raise ValueError(f"{what} values must be >= 1; got {list(values)}")
        for h, i in widths:
            reason = moe_fp8.unfit_reason(MoePreset("width", 1, h, i, 1, 1))
            if reason:
                raise ValueError(f"--sweep-width {h}x{i}: {reason}")
        for h, i in widths:
            for e in experts:
                for k in topk:
                    if k > e:
                        continue  # K distinct experts per token need K <= E
                    points += [sweep_point(h, i, e, k, t) for t in sorted(tokens)]
        if not points:
            raise ValueError(f"no sweep point has K <= E (E {list(experts)}, K {list(topk)})")
        bad = [r for r in map(offsets_reason, points) if r]
        if bad:
            raise ValueError(f"sweep point {bad[0]}")
    presets = tuple(ctx.presets) or (() if sweep else (CPU_PRESETS if ctx.interpreted else MOE_GPU_PRESETS))
    return Plan(chosen, measures, presets, tuple(points), not no_stages, hf_experts)


def cases(ctx, **options) -> list[BenchCase]:
    """One case per (preset, measure, timing, implementation), then the presets' stages, then the sweep points'
    fwd_bwd of bf16 and fp8 (eager and graph)."""
    plan = make_plan(ctx, **options)
    out = []
    for name in plan.presets:
        p = MOE_PRESETS[name]
        out += [BenchCase(case_name(p, m, tm, impl), name, name, m, p.t, impl=impl, timing=tm)
                for m in plan.measures for tm in TIMINGS for impl in plan.impls]
        if plan.stages:
            out += [BenchCase(stage_row_name(p.label, s), name, name, f"stage {s}", p.t, impl="bf16") for s in STAGES]
            if "fp8" in plan.impls and moe_fp8.unfit_reason(p) is None:
                label = moe_fp8.fp8_label(p)
                out += [BenchCase(stage_row_name(label, s), name, name, f"stage {s}", p.t, impl="fp8")
                        for s in moe_fp8.STAGES]
    for p in plan.points:
        out += [BenchCase(case_name(p, "fwd_bwd", tm, impl, sweep=True), p.name, p.name, "fwd_bwd", p.t, impl=impl,
                          timing=tm) for tm in TIMINGS for impl in ("bf16", "fp8")]
    return out


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
def run(ctx, cases: list[BenchCase], **options) -> Iterator[dict]:
    plan = make_plan(ctx, **options)
    baseline = pick_baseline(ctx.device) if "grouped_mm" in plan.impls else None
    for group, members in groupby(cases, key=lambda c: c.group):
        p, sweep = preset_of(group)
        yield from bench_group(p, sweep, list(members), ctx, plan, baseline)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()  # each preset's graphs and references go before the next one's


def skip_reason(p: MoePreset, impl: str) -> str | None:
    if impl in FP8_IMPLS:
        return moe_fp8.unfit_reason(p)
    if impl in HF_IMPLS:
        return moe_hf.unavailable_reason()
    return None


def implementations(p: MoePreset, inp: dict, impls: list[str], ctx, plan: Plan, baseline: tuple[bool, str] | None):
    """impl -> {"fwd": fn, "fwd_bwd": fn} on ``inp``, and the state the validation needs (the blocks, the
    baseline's choice)."""
    from detkit.kernels.moe.layer import moe_mlp_bwd, moe_mlp_fwd
    from detkit.kernels.moe.fp8.layer import Fp8WeightCache
    from detkit.toolkit.nvtx_ranges import nvtx_range

    x, w1, w2, ids, scores, dout = (inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout"))
    fns: dict[str, dict[str, Callable[[], object]]] = {}
    state: dict = {}

    def det_fwd():
        return moe_mlp_fwd(x, w1, w2, ids, scores, stage_range=nvtx_range)

    def det_fwd_bwd():
        out, saved = det_fwd()
        return out, moe_mlp_bwd(dout, saved, stage_range=nvtx_range)

    fns["bf16"] = {"fwd": det_fwd, "fwd_bwd": det_fwd_bwd}
    if "fp8" in impls:
        fns["fp8"] = moe_fp8.layer_fns(inp, stage_range=nvtx_range)
    if "fp8_warm" in impls:
        state["cache"] = Fp8WeightCache()
        fns["fp8_warm"] = moe_fp8.layer_fns(inp, weight_cache=state["cache"], stage_range=nvtx_range)
    if "fp8_wgrad_bf16" in impls:
        fns["fp8_wgrad_bf16"] = moe_fp8.layer_fns(inp, wgrad="bf16", stage_range=nvtx_range)
    if "grouped_mm" in impls:
        grouped, state["baseline"] = baseline
        state["grouped"] = grouped  # the validation may still fall back to the loop at this shape

        def base_fwd():
            return torch_moe_fwd(x, w1, w2, ids, scores, state["grouped"])

        def base_fwd_bwd():
            leaves = [t.detach().requires_grad_() for t in (x, w1, w2, scores)]
            out = torch_moe_fwd(leaves[0], leaves[1], leaves[2], ids, leaves[3], state["grouped"])
            return out, torch.autograd.grad(out, leaves, dout)

        fns["grouped_mm"] = {"fwd": base_fwd, "fwd_bwd": base_fwd_bwd}
    if any(i in HF_IMPLS for i in impls):
        state["block"] = moe_hf.build_block(p, ctx.device, ctx.seed + 1, plan.hf_experts)
        block_fns = moe_hf.block_fns(state["block"], x, dout)
        for impl in HF_IMPLS:
            if impl in impls:
                fns[impl] = block_fns
    return fns, state


def _bf16_check(runs: list[dict], oracle: dict | None) -> dict:
    from detkit.toolkit.contract import compare_bits

    finite = all(bool(torch.isfinite(t).all()) for t in runs[0].values())
    out = {"finite": finite}
    if len(runs) > 1:
        out["repeat_bitwise_equal"] = all(compare_bits(runs[0][n], runs[1][n]).equal for n in runs[0])
    if oracle is not None:
        out.update({f"rel_l2_fp64_{n}": rel_l2_fp32(runs[0][n], oracle[n]) for n in runs[0]})
        out["limit"] = VALIDATE_REL_L2
    ok = finite and out.get("repeat_bitwise_equal", True) and all(
        v <= VALIDATE_REL_L2 for k, v in out.items() if k.startswith("rel_l2_"))
    return {"validated": ok, **out}


def validate(p: MoePreset, sweep: bool, inp: dict, fns: dict, state: dict) -> dict[str, dict]:
    """impl -> {"validated": bool, ...details}. A preset: everything against the FP64 oracle (module docstring). A
    sweep point: the BF16 layer once (finite; it is the reference) and the FP8 layer gated against it."""
    from detkit.kernels.moe.layer import moe_mlp_ref
    from detkit.toolkit.contract import compare_bits

    checks: dict[str, dict] = {}
    oracle = None if sweep else moe_mlp_ref(*(inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout")),
                                            dtype=torch.float64)
    bf16_runs = [layer_tensors(*fns["bf16"]["fwd_bwd"]()) for _ in range(1 if sweep else 2)]
    checks["bf16"] = _bf16_check(bf16_runs, oracle)
    bf16 = bf16_runs[0] if checks["bf16"]["validated"] else None
    del bf16_runs[1:]
    fp8_first = None
    for impl in ("fp8", "fp8_wgrad_bf16"):
        if impl in fns:
            if oracle is None and bf16 is None:
                checks[impl] = {"validated": False, "failure": "no reference: the BF16 layer failed its validation"}
                continue
            runs = [layer_tensors(*fns[impl]["fwd_bwd"]()) for _ in range(1 if sweep else 2)]
            checks[impl] = moe_fp8.check_runs(runs, inp, bf16, oracle)
            if impl == "fp8":
                fp8_first = runs[0]
    if "fp8_warm" in fns:
        fns["fp8_warm"]["fwd_bwd"]()  # fills the cache
        warm = layer_tensors(*fns["fp8_warm"]["fwd_bwd"]())
        same = fp8_first is not None and all(compare_bits(warm[n], fp8_first[n]).equal for n in warm)
        checks["fp8_warm"] = {"validated": same and checks["fp8"]["validated"], "bitwise_equal_to_fp8": same,
                              "weight_cache_hits": state["cache"].hits}
    if "fp8" in fns and not sweep:
        checks["fp8"]["quant_risk"] = moe_fp8.quant_risk(inp)
    if "grouped_mm" in fns:
        def base_run():
            out, grads = fns["grouped_mm"]["fwd_bwd"]()
            return dict(zip(("out", "dx", "dw1", "dw2", "dscores"), (out.detach(), *grads)))

        base, state["baseline"] = run_baseline(base_run, state, state["baseline"])
        checks["grouped_mm"] = _bf16_check([base], oracle)
    if "block" in state:
        checks["hf"] = moe_hf.check_block(state["block"], inp["x"], inp["dout"])
        checks["hf_detkit"] = moe_hf.check_block_in_mode(state["block"], inp["x"], inp["dout"])
    return checks


def _failure(impl: str, check: dict) -> str:
    if "failure" in check:
        return check["failure"]
    detail = {k: v for k, v in check.items() if k not in ("validated", "precision", "quant_risk")}
    return f"validation failed, not timed: {impl} {json.dumps(detail, default=str)[:400]}"


def routing_fields(ids: torch.Tensor, num_experts: int) -> dict:
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts).cpu()
    return {"routed_rows": int(counts.sum()), "expert_rows_min": int(counts.min()),
            "expert_rows_max": int(counts.max())}


def bench_group(p: MoePreset, sweep: bool, group: list[BenchCase], ctx, plan: Plan,
                baseline: tuple[bool, str] | None) -> Iterator[dict]:
    """Validate the group's implementations at ``p``, then time its cases; one row per case."""
    from detkit.kernels.moe.layer import MOE_CONFIG_TABLE_VERSION
    from detkit.toolkit.nvtx_ranges import nvtx_range

    device, interpreted = ctx.device, ctx.interpreted
    layer_cases = [c for c in group if not c.measure.startswith("stage ")]
    wanted = list(dict.fromkeys(c.impl for c in layer_cases))
    skipped = {i: r for i in wanted if (r := skip_reason(p, i)) is not None}
    runnable = [i for i in wanted if i not in skipped]
    inp = make_inputs(p, device, ctx.seed)
    fns, state = implementations(p, inp, runnable, ctx, plan, baseline)
    with nvtx_range(f"validate {shape_label(p)}"):
        checks = validate(p, sweep, inp, fns, state)
    common = {"preset": p.name, "sweep": sweep, "T": p.t, "H": p.h, "I": p.i, "E": p.e, "K": p.k,
              "backend": ctx.backend, "hardware_result": not interpreted,
              "config_table_version": MOE_CONFIG_TABLE_VERSION,
              **routing_fields(inp["topk_ids"], p.e)}
    if interpreted:
        common["note"] = INTERPRETER_LABEL
    if any(i in FP8_IMPLS for i in runnable):
        from detkit.kernels.moe.fp8.choice import FP8_CHOICE_TABLE_VERSION
        from detkit.kernels.moe.fp8.layer import DEFAULT_WGRAD, MOE_FP8_CONFIG_TABLE_VERSION

        common.update(fp8_config_table_version=MOE_FP8_CONFIG_TABLE_VERSION, default_wgrad=DEFAULT_WGRAD,
                      fp8_choice_table_version=FP8_CHOICE_TABLE_VERSION)

    def impl_fields(impl: str) -> dict:
        fields = {"impl": impl, "scope": "block (router + experts)" if impl in HF_IMPLS else "layer (given routes)"}
        if impl in HF_IMPLS:
            fields["mode"] = "detkit.batch_invariant_mode()" if impl == "hf_detkit" else "default"
        if impl == "grouped_mm":
            fields["baseline"] = state["baseline"]
        if impl in HF_IMPLS and "block" in state:
            fields["hf_experts_implementation"] = moe_hf.experts_implementation(state["block"])
        if impl in FP8_IMPLS and impl not in skipped:
            fields.update(moe_fp8.rule_fields(p, ctx.backend, impl))
        if impl in checks:
            fields.update(validated=checks[impl]["validated"], validation=checks[impl])
        return fields

    for (measure, timing), members in groupby(layer_cases, key=lambda c: (c.measure, c.timing)):
        members = list(members)
        timed = [c for c in members if c.impl in runnable and checks[c.impl]["validated"]]
        contexts = {c.name: moe_hf.mode for c in timed if c.impl == "hf_detkit"}
        errors: dict[str, str] = {}
        with nvtx_range(f"{shape_label(p)} {measure} {timing}"):
            if timing == "eager":
                from detkit.toolkit.timing import time_interleaved

                timings = time_interleaved({c.name: with_range(c.name, fns[c.impl][measure]) for c in timed}, device,
                                           rounds=ctx.rounds, contexts=contexts, cpu_warmup=not interpreted)
            else:
                from detkit.toolkit.timing import time_graphs

                timings = time_graphs({c.name: fns[c.impl][measure] for c in timed}, device, calls_per_fn=1,
                                      rounds=ctx.rounds, replays=GRAPH_REPLAYS,
                                      range_names={c.name: c.name for c in timed}, contexts=contexts, errors=errors)
        rows = {}
        for c in members:
            row = {**common, "name": c.name, "measure": measure, "timing": timing, "flops": p.flops(measure),
                   **impl_fields(c.impl), "passed": True}
            if c.impl in skipped:
                row["skipped"] = skipped[c.impl]
            elif not checks[c.impl]["validated"]:
                row.update(passed=False, failure=_failure(c.impl, checks[c.impl]))
            elif c.name in errors:
                row["graph_error"] = errors[c.name]
                if c.impl in CAPTURE_REQUIRED:
                    row.update(passed=False, failure=f"{c.impl} must capture (no host reads): {errors[c.name]}")
            else:
                row.update(timing_fields(timings[c.name], row["flops"], not interpreted, c.impl in FP8_IMPLS))
                if timing == "graph":
                    row["graph_replays"] = GRAPH_REPLAYS
            rows[c.impl] = row
        add_ratios(rows)
        yield from rows.values()

    stage_cases = [c for c in group if c.measure.startswith("stage ")]
    if stage_cases:
        yield from stage_rows(p, stage_cases, inp, ctx, checks, common)


def add_ratios(rows: dict[str, dict]) -> None:
    """speedup_vs_bf16 (and speedup_vs_hf for hf_detkit) on the rows of one (preset, measure, timing), in place."""
    bf16 = rows.get("bf16", {}).get("median_us")
    hf = rows.get("hf", {}).get("median_us")
    for impl, row in rows.items():
        if "median_us" not in row:
            continue
        if bf16 is not None and impl != "bf16":
            row.update(bf16_median_us=bf16, speedup_vs_bf16=bf16 / row["median_us"])
        if impl == "hf_detkit" and hf is not None:
            row.update(hf_median_us=hf, speedup_vs_hf=hf / row["median_us"])


def bf16_stage_fns(p: MoePreset, inp: dict, backend: str) -> dict[str, tuple[Callable[[], object], float]]:
    """Each BF16 stage alone on the layer's own intermediates, split as the layer's backward splits them (dgrad with
    the pass that forms dW2's dy and dout's expert-ordered copy; dW2 on that dy): name -> (fn, FLOPs per T*K*H*I)."""
    from detkit.kernels.moe.layer import (
        moe_combine, moe_dgrad_dswiglu_dscore, moe_down, moe_dscores_from_partials, moe_dx_route, moe_gather_sum,
        moe_mlp_fwd, moe_scale_rows, moe_up_swiglu, moe_wgrad_w1, moe_wgrad_w2,
    )
    from detkit.kernels.moe.routing import build_routing

    x, w1, w2, ids, scores, dout = (inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout"))
    routing = build_routing(ids, scores, p.e)
    _, saved = moe_mlp_fwd(x, w1, w2, ids, scores)
    b = backend
    y = moe_down(saved.h, w2, routing, b)  # not saved by the layer (dscores are fused into dgrad)
    dy, sorted_dout = moe_scale_rows(dout, routing, b, sorted_copy=True)
    dgu, ds_part = moe_dgrad_dswiglu_dscore(dout, w2, saved.gu, saved.h, routing, b, sorted_dout=sorted_dout)
    dxr = moe_dx_route(dgu, w1, routing, b)

    def dgrad():
        dy_again, copy = moe_scale_rows(dout, routing, b, sorted_copy=True)
        return moe_dgrad_dswiglu_dscore(dout, w2, saved.gu, saved.h, routing, b, sorted_dout=copy), dy_again

    fns = {
        "routing": lambda: build_routing(ids, scores, p.e),
        "up_swiglu": lambda: moe_up_swiglu(x, w1, routing, b),
        "down": lambda: moe_down(saved.h, w2, routing, b),
        "combine": lambda: moe_combine(y, routing, scores, b),
        "dgrad_dswiglu": dgrad,
        "dx_route": lambda: moe_dx_route(dgu, w1, routing, b),
        "dx_gather_sum": lambda: moe_gather_sum(dxr, routing, b),
        "wgrad_w1": lambda: moe_wgrad_w1(x, dgu, routing, b),
        "wgrad_w2": lambda: moe_wgrad_w2(saved.h, dout, routing, b, dy=dy),
        "dscores": lambda: moe_dscores_from_partials(ds_part, routing, b),
    }
    return {s: (fns[s], STAGES[s]) for s in STAGES}


def stage_rows(p: MoePreset, stage_cases: list[BenchCase], inp: dict, ctx, checks: dict,
               common: dict) -> Iterator[dict]:
    """Each BF16 / FP8 stage alone (eager), on the implementation's validated inputs."""
    for impl, members in groupby(stage_cases, key=lambda c: c.impl):
        members = list(members)
        fp8 = impl == "fp8"
        if not checks.get(impl, {}).get("validated"):
            for c in members:
                yield {**common, "name": c.name, "measure": c.measure, "timing": "eager", "impl": impl,
                       "passed": False, "failure": f"{impl} failed its validation: its stages are not timed"}
            continue
        all_fns = moe_fp8.stage_fns(p, inp, ctx.backend) if fp8 else bf16_stage_fns(p, inp, ctx.backend)
        label = moe_fp8.fp8_label(p) if fp8 else p.label
        wanted = [c.measure[6:] for c in members]
        timed = time_stages(p, label, {s: all_fns[s] for s in wanted}, ctx.device, ctx.rounds, fp8)
        for c in members:
            fields, flops = timed[c.measure[6:]]
            yield {**common, "name": c.name, "measure": c.measure, "timing": "eager", "impl": impl, "flops": flops,
                   **fields, "passed": True}


# ---------------------------------------------------------------------------------------------
# Results over all rows: the sweep's crossover and the verdicts
# ---------------------------------------------------------------------------------------------
def _shape(r: dict) -> tuple[int, ...]:
    return tuple(r[k] for k in ("T", "H", "I", "E", "K"))


def sweep_summary(rows: list[dict]) -> list[dict]:
    """Per sweep shape (H, I, E, K) and timing: FP8/BF16 per T and the crossover T (bench/moe_fp8.crossover)."""
    by: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        if r.get("sweep") and r.get("measure") == "fwd_bwd" and r.get("impl") in ("bf16", "fp8"):
            by.setdefault((r["H"], r["I"], r["E"], r["K"], r["timing"]), {}).setdefault(r["T"], {})[r["impl"]] = r
    out = []
    for (h, i, e, k, timing), per_t in by.items():
        points = []
        for t, pair in sorted(per_t.items()):
            b, f = pair.get("bf16", {}), pair.get("fp8", {})
            point = {"T": t, "validated": bool(b.get("validated") and f.get("validated"))}
            if "median_us" in b and "median_us" in f:
                point.update(bf16_median_us=b["median_us"], fp8_median_us=f["median_us"],
                             speedup_fp8=b["median_us"] / f["median_us"])
            points.append(point)
        fit = moe_fp8.crossover(points, "fp8_median_us")
        below = [pt for pt in points if pt["T"] < SWEEP_TARGET_MIN_T and "speedup_fp8" in pt]
        rule = next((pair["fp8"]["rule_picks"] for pair in per_t.values() if "rule_picks" in pair.get("fp8", {})),
                    None)
        out.append({"H": h, "I": i, "E": e, "K": k, "timing": timing, "rule_picks": rule,
                    "crossover_T_fit": fit.get("crossover_T_fit"),
                    "crossover_T_measured": fit.get("crossover_T_measured"),
                    "fp8_slower_at_T": [pt["T"] for pt in points if pt.get("speedup_fp8", 2.0) < 1.0],
                    "fp8_slower_below_8192": any(pt["speedup_fp8"] < 1.0 for pt in below),
                    "points": points, "fit": {k2: v for k2, v in fit.items() if k2 != "points"}})
    return out


def verdicts(rows: list[dict]) -> list[dict]:
    """One entry per (target, timing, case): value, minimum and PASS / FAIL / NOT RUN, from the fwd_bwd rows."""
    fwd_bwd = [r for r in rows if r.get("measure") == "fwd_bwd" and r.get("timing") in TIMINGS]

    def judge(target: Target, timing: str, case: str, sel: list[dict]) -> dict:
        entry = {"target": target.key, "label": target.label, "timing": timing, "case": case,
                 "minimum": target.minimum, "value": None}
        picked = [r for r in sel if r["impl"] == target.impl and r["timing"] == timing]
        if not picked:
            entry["verdict"] = "NOT RUN"
            return entry
        r = picked[0]
        entry["row"] = r["name"]
        if not r.get("passed") or not r.get("validated"):
            entry["verdict"] = f"FAIL (row failed: {str(r.get('failure') or r.get('skipped'))[:160]})"
        elif target.field not in r:
            why = r.get("graph_error") or r.get("skipped") or "no value"
            entry["verdict"] = f"NOT MEASURED ({str(why)[:160]})"
        else:
            entry["value"] = r[target.field]
            entry["verdict"] = "PASS" if r[target.field] >= target.minimum else "FAIL"
        return entry

    def at(shape: tuple[int, ...]) -> list[dict]:
        exact = [r for r in fwd_bwd if _shape(r) == shape]
        return [r for r in exact if not r["sweep"]] or exact  # a preset's row before a sweep point's

    out = []
    by_key = {t.key: t for t in TARGETS}
    for timing in TIMINGS:
        out.append(judge(by_key["fp8_reference"], timing, "reference shape", at(REFERENCE_SHAPE)))
        for name in MOE_GPU_PRESETS:
            p = MOE_PRESETS[name]
            if p.h % 128 == 0 and p.i % 128 == 0:
                out.append(judge(by_key["fp8_presets"], timing, f"preset {name}",
                                 [r for r in fwd_bwd if r.get("preset") == name]))
        points = sorted({(r["H"], r["I"], r["E"], r["K"], r["T"]) for r in fwd_bwd
                         if r["sweep"] and r["T"] >= SWEEP_TARGET_MIN_T})
        for h, i, e, k, t in points:
            out.append(judge(by_key["fp8_sweep"], timing, f"sweep H={h} I={i} E={e} K={k} T={t}",
                             [r for r in fwd_bwd if r["sweep"] and _shape(r) == (t, h, i, e, k)]))
        if not points:
            out.append(judge(by_key["fp8_sweep"], timing, "sweep (T >= 8192)", []))
        out.append(judge(by_key["bf16_mfu_reference"], timing, "reference shape", at(REFERENCE_SHAPE)))
        out.append(judge(by_key["bf16_mfu_qwen3_30b_a3b_16k"], timing, "Qwen3-30B-A3B, T=16384",
                         at(QWEN3_30B_16K_SHAPE)))
    return out


def derive(rows: list[dict], meta: dict) -> dict:
    """The sweep's crossover per shape and, on hardware only, the targets' verdicts."""
    derived: dict = {"sweep": sweep_summary(rows)}
    if meta.get("hardware_result"):
        derived["verdicts"] = verdicts(rows)
    else:
        derived["note"] = "interpreter wall time: no verdicts; the crossover fit is plumbing"
    return derived


def describe(ctx, cases, rows, session) -> dict:
    impls = list(dict.fromkeys(c.impl for c in cases if not c.measure.startswith("stage ")))
    meta = {"datasheet_bf16_tflops": DATASHEET_BF16_TFLOPS, "datasheet_fp8_tflops": DATASHEET_FP8_TFLOPS,
            "flops_formula": "fwd 6*T*K*H*I; fwd_bwd 18*T*K*H*I (bench/moe_common.py); the blocks' router not counted",
            "ratio_formula": "speedup_vs_bf16 = BF16 layer median / this median (same measure, timing and run)",
            "presets": list(dict.fromkeys(c.preset for c in cases if not c.preset.startswith(SWEEP_PREFIX))),
            "sweep_points": len({c.preset for c in cases if c.preset.startswith(SWEEP_PREFIX)}),
            "impls": impls, "graph_replays": GRAPH_REPLAYS, "targets": [t.label for t in TARGETS]}
    hf_rows = [r for r in rows if r.get("hf_experts_implementation")]
    if hf_rows:
        meta["hf_experts_implementation"] = hf_rows[0]["hf_experts_implementation"]
    if ctx.interpreted:
        meta["note"] = (INTERPRETER_LABEL + "; graph rows: no CUDA graphs on the cpu, the calls run eagerly and one "
                        "that reads device data on the host is refused as a capture would refuse it")
    return meta


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------
def _note(r: dict) -> str | None:
    return r.get("failure") or r.get("graph_error") or r.get("skipped")


def summarize(rows: list[dict], meta: dict) -> str:
    hw = bool(meta.get("hardware_result"))
    derived = meta.get("derived") or derive(rows, meta)
    lines = [f"- {k}: {meta[k]}" for k in ("impls", "presets", "sweep_points", "hf_experts_implementation",
                                          "flops_formula", "ratio_formula") if k in meta]
    lines.append("")
    if hw:
        lines += ["## Targets (forward+backward; verdicts, not assertions)", "",
                  markdown_table(derived.get("verdicts") or [], ("target", "timing", "case", "value", "minimum",
                                                                 "verdict")), ""]
    else:
        lines += ["## Targets", "", "Not evaluated: interpreter wall time is not a hardware result.", ""]
    layer = [r for r in rows if not r["measure"].startswith("stage ") and not r.get("sweep")]
    cols = ("preset", "measure", "timing", "impl", "median_us", "p20_us", "p80_us", "speedup_vs_bf16", "speedup_vs_hf",
            "rule_picks", "tflops", "mfu_bf16_peak", "mfu_fp8_peak", "sm_clock_mhz", "validated", "note")
    if layer:
        lines += ["## Side by side (speedup_vs_bf16 > 1: faster than the BF16 layer; same run)", "",
                  markdown_table([{**r, "note": _note(r)} for r in layer], cols), ""]
    swap = [r for r in layer if r.get("impl") == "hf_detkit" and "speedup_vs_hf" in r]
    if swap:
        lines += ["## transformers' block: the mode vs default (speedup_vs_hf > 1: the swap is faster)", "",
                  markdown_table(swap, ("preset", "measure", "timing", "hf_median_us", "median_us", "speedup_vs_hf")),
                  ""]
    sweep = [r for r in rows if r.get("sweep")]
    if sweep:
        lines += ["## Sweep: FP8 vs BF16, fwd_bwd", "",
                  markdown_table([{**r, "note": _note(r)} for r in sweep if r["impl"] == "fp8" or "median_us" not in r],
                                 ("T", "H", "I", "E", "K", "timing", "impl", "bf16_median_us", "median_us",
                                  "speedup_vs_bf16", "rule_picks", "mfu_fp8_peak", "validated", "note")), "",
                  "### Crossover per shape (time = a + b*T per path; measured: smallest T from which FP8 wins)", "",
                  markdown_table(derived.get("sweep") or [], ("H", "I", "E", "K", "timing", "rule_picks",
                                                              "crossover_T_fit", "crossover_T_measured",
                                                              "fp8_slower_at_T")), ""]
    stages = [r for r in rows if r["measure"].startswith("stage ")]
    if stages:
        lines += ["## Stages alone (eager)", "",
                  markdown_table([{**r, "note": _note(r)} for r in stages],
                                 ("name", "median_us", "p20_us", "p80_us", "tflops", "mfu_bf16_peak", "mfu_fp8_peak",
                                  "sm_clock_mhz", "note")), ""]
    gates = [r for r in layer if r.get("impl") == "fp8" and r.get("measure") == "fwd_bwd" and r.get("timing") == "eager"
             and "validation" in r]
    if gates:
        lines += ["## FP8 precision gate (cosine >= 0.997, relative RMSE < 7.6%) and quantization risk", ""]
        for r in gates:
            v = r["validation"]
            lines.append(f"- {r['preset']}: gate passed {v.get('gate_passed')} (vs {', '.join(v.get('gate_vs', []))}), "
                         f"repeat bitwise {v.get('repeat_bitwise_equal')}")
            for n, st in v.get("precision", {}).items():
                lines.append(f"  - {n}: " + ", ".join(f"{k} {x:.5g}" for k, x in st.items()))
            for n, st in v.get("quant_risk", {}).items():
                lines.append(f"  - risk {n}: " + ", ".join(f"{k} {x:.4g}" for k, x in st.items()))
        lines.append("")
    return "\n".join(lines)
