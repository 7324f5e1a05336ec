"""``detkit bench moe``: the deterministic MoE expert MLP (kernels/moe.py) against a PyTorch baseline; with
``--fp8``, the FP8 path (kernels/moe_fp8.py) against the BF16 detkit path (bench/moe_fp8.py).

    detkit bench moe --device cuda                                  # every GPU preset
    detkit bench moe --device cuda --preset reference --fp8 --out DIR
    detkit bench moe --device cpu                                   # Triton interpreter: plumbing only

Per preset: validate, then time. Validation runs forward + backward twice (bitwise equal) and
compares every tensor with the baseline (relative L2 <= VALIDATE_REL_L2; both are BF16 pipelines,
so they differ by a few BF16 roundings). Timing is interleaved (toolkit.timing: CUDA events, L2
flushed, warm-up excluded, median with p20/p80) for the whole layer forward and forward+backward,
routing metadata included; then each detkit stage on its own. Formulas and the baseline:
bench/moe_common.py. A preset that fails validation is not timed: each of its rows fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import groupby

import click
import torch

from detkit.bench import moe_fp8
from detkit.bench.moe_common import (
    DATASHEET_BF16_TFLOPS, INTERPRETER_LABEL, VALIDATE_REL_L2, BenchCase, layer_tensors, make_inputs, pick_baseline,
    rel_l2_fp32, run_baseline, stage_row_name, time_stages, timing_fields, torch_moe_fwd, with_range,
)
from detkit.toolkit.presets import MOE_GPU_PRESETS, MOE_PRESETS, MoePreset
from detkit.toolkit.reports import markdown_table

NAME = "moe"
DESCRIPTION = "The MoE expert MLP vs PyTorch (BF16); with --fp8, the FP8 path vs the BF16 detkit path."
RANKS = "single"
OPTIONS = (
    click.option("--fp8", is_flag=True, help="The FP8 path vs the BF16 detkit path side by side, with the "
                                             "crossover sweep over T (docs/moe_fp8.md)."),
    click.option("--no-stages", is_flag=True, help="Skip the per-stage timings."),
    click.option("--no-fp64", is_flag=True, help="--fp8: gate against the BF16 path only (no FP64 oracle)."),
    click.option("--no-crossover", is_flag=True, help="--fp8: skip the crossover sweep."),
)
PRESETS = tuple(MOE_PRESETS)  # the names --preset accepts
# Each detkit stage alone: name -> FLOPs per T*K*H*I (what to tune first).
STAGES = {"routing": 0.0, "up_swiglu": 4.0, "down": 2.0, "combine": 0.0, "dgrad_dswiglu": 2.0, "dx_route": 4.0,
          "dx_gather_sum": 0.0, "wgrad_w1": 4.0, "wgrad_w2": 2.0, "dscores": 0.0}
LAYER_MEASURES = ("fwd", "fwd_bwd")


def cases(ctx, fp8: bool = False, no_stages: bool = False, no_fp64: bool = False,
          no_crossover: bool = False) -> list[BenchCase]:
    if fp8:
        return moe_fp8.cases(ctx, stages=not no_stages, crossover=not no_crossover)
    if no_fp64 or no_crossover:
        raise ValueError("--no-fp64 and --no-crossover apply to --fp8 only")
    out = []
    for name in ctx.presets or (("tiny",) if ctx.interpreted else MOE_GPU_PRESETS):
        p = MOE_PRESETS[name]
        measures = [*LAYER_MEASURES, *(() if no_stages else (f"stage {s}" for s in STAGES))]
        out += [BenchCase(stage_row_name(p.label, m[6:]) if m.startswith("stage ") else f"{p.label} {m}",
                          name, name, m, p.t) for m in measures]
    return out


def run(ctx, cases: list[BenchCase], fp8: bool = False, no_stages: bool = False, no_fp64: bool = False,
        no_crossover: bool = False) -> Iterator[dict]:
    if fp8:
        yield from moe_fp8.run(ctx, cases, fp64=not no_fp64)
        return
    baseline_choice = pick_baseline(ctx.device)
    for preset, group in groupby(cases, key=lambda c: c.group):
        yield from bench_preset(MOE_PRESETS[preset], list(group), ctx, baseline_choice)


def bench_preset(p: MoePreset, group: list[BenchCase], ctx, baseline_choice: tuple[bool, str]) -> Iterator[dict]:
    """Validate ``p``, then time its layer and stage cases; one row per case."""
    from detkit.kernels.moe import (
        MOE_CONFIG_TABLE_VERSION, moe_combine, moe_dgrad_dswiglu_dscore, moe_down, moe_dscores_from_partials,
        moe_dx_route, moe_gather_sum, moe_mlp_bwd, moe_mlp_fwd, moe_up_swiglu, moe_wgrad_w1, moe_wgrad_w2,
    )
    from detkit.kernels.moe_routing import build_routing
    from detkit.toolkit.contract import compare_bits
    from detkit.toolkit.nvtx_ranges import nvtx_range
    from detkit.toolkit.timing import time_interleaved

    device, interpreted, rounds = ctx.device, ctx.interpreted, ctx.rounds
    inp = make_inputs(p, device, ctx.seed)
    x, w1, w2, ids, scores, dout = (inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout"))
    grouped, baseline = baseline_choice
    state = {"grouped": grouped}  # the validation below may still fall back to the loop

    def det_fwd():
        return moe_mlp_fwd(x, w1, w2, ids, scores, stage_range=nvtx_range)

    def det_fwd_bwd():
        out, saved = det_fwd()
        return layer_tensors(out, moe_mlp_bwd(dout, saved, stage_range=nvtx_range))

    def base_fwd():
        return torch_moe_fwd(x, w1, w2, ids, scores, state["grouped"])

    def base_fwd_bwd():
        leaves = {n: inp[n].detach().requires_grad_() for n in ("x", "w1", "w2", "scores")}
        out = torch_moe_fwd(leaves["x"], leaves["w1"], leaves["w2"], ids, leaves["scores"], state["grouped"])
        out.backward(dout)
        return {"out": out.detach(), "dx": leaves["x"].grad, "dw1": leaves["w1"].grad, "dw2": leaves["w2"].grad,
                "dscores": leaves["scores"].grad}

    with nvtx_range(f"validate {p.label}"):
        first, second = det_fwd_bwd(), det_fwd_bwd()
        base, baseline = run_baseline(base_fwd_bwd, state, baseline)
    repeat_equal = all(compare_bits(first[n], second[n]).equal for n in first)
    rel = {f"rel_l2_vs_baseline_{n}": rel_l2_fp32(first[n], base[n]) for n in first}
    valid = repeat_equal and all(v <= VALIDATE_REL_L2 for v in rel.values())
    routing = build_routing(ids, scores, p.e)
    counts = torch.tensor(routing.counts)
    common = {"preset": p.name, "T": p.t, "H": p.h, "I": p.i, "E": p.e, "K": p.k, "baseline": baseline,
              "config_table_version": MOE_CONFIG_TABLE_VERSION, "backend": ctx.backend,
              "hardware_result": not interpreted, "validated": valid, "repeat_bitwise_equal": repeat_equal, **rel,
              "padded_rows": routing.padded_rows, "routed_rows": int(counts.sum()),
              "expert_rows_min": int(counts.min()), "expert_rows_max": int(counts.max())}
    if interpreted:
        common["note"] = INTERPRETER_LABEL
    del first, second, base
    if not valid:
        failure = (f"validation failed, not timed: repeat bitwise equal {repeat_equal}, worst relative L2 vs the "
                   f"baseline {max(rel.values()):.3g} (limit {VALIDATE_REL_L2:.3g})")
        for case in group:
            yield {**common, "name": case.name, "measure": case.measure, "passed": False, "failure": failure}
        return

    layer = {"fwd": {"detkit": det_fwd, baseline: base_fwd}, "fwd_bwd": {"detkit": det_fwd_bwd, baseline: base_fwd_bwd}}
    for case in (c for c in group if c.measure in LAYER_MEASURES):
        named = {impl: with_range(f"{case.name} | {impl}", fn) for impl, fn in layer[case.measure].items()}
        flops = p.flops(case.measure)
        row = {**common, "name": case.name, "measure": case.measure, "flops": flops, "passed": True}
        with nvtx_range(case.name):
            timings = time_interleaved(named, device, rounds=rounds)
        for impl, t in timings.items():
            key = "detkit" if impl == "detkit" else "baseline"
            row.update(timing_fields(key, t, flops, not interpreted))
            if not interpreted:
                row[f"{key}_mfu"] = row[f"{key}_tflops"] / DATASHEET_BF16_TFLOPS
        row["ratio_vs_baseline"] = row["detkit_median_us"] / row["baseline_median_us"]
        yield row

    stage_cases = [c for c in group if c.measure.startswith("stage ")]
    if not stage_cases:
        return
    # Each stage's inputs are the layer's own intermediates on the same inputs.
    out, saved = moe_mlp_fwd(x, w1, w2, ids, scores)
    b = saved.backend
    y = moe_down(saved.h, w2, routing, b)  # not saved by the layer (dscores are fused into dgrad)
    dgu, ds_part = moe_dgrad_dswiglu_dscore(dout, w2, saved.gu, saved.h, routing, b)
    dxr = moe_dx_route(dgu, w1, routing, b)
    fns = {
        "routing": lambda: build_routing(ids, scores, p.e),
        "up_swiglu": lambda: moe_up_swiglu(x, w1, routing, b),
        "down": lambda: moe_down(saved.h, w2, routing, b),
        "combine": lambda: moe_combine(y, routing, scores, b),
        "dgrad_dswiglu": lambda: moe_dgrad_dswiglu_dscore(dout, w2, saved.gu, saved.h, routing, b),
        "dx_route": lambda: moe_dx_route(dgu, w1, routing, b),
        "dx_gather_sum": lambda: moe_gather_sum(dxr, routing, b),
        "wgrad_w1": lambda: moe_wgrad_w1(x, dgu, routing, b),
        "wgrad_w2": lambda: moe_wgrad_w2(saved.h, dout, routing, b),
        "dscores": lambda: moe_dscores_from_partials(ds_part, routing, b),
    }
    wanted = [c.measure[6:] for c in stage_cases]
    timed = time_stages(p, p.label, {s: (fns[s], STAGES[s]) for s in wanted}, device, rounds, "detkit")
    for case in stage_cases:
        fields, flops = timed[case.measure[6:]]
        row = {**common, "name": case.name, "measure": case.measure, "flops": flops, **fields, "passed": True}
        if "detkit_tflops" in row:  # hardware, and a stage with FLOPs
            row["detkit_mfu"] = row["detkit_tflops"] / DATASHEET_BF16_TFLOPS
        yield row


def describe(ctx, cases, rows, session) -> dict:
    fp8 = bool(cases) and "] fp8" in cases[0].name
    meta = {"datasheet_bf16_tflops": DATASHEET_BF16_TFLOPS,
            "flops_formula": "fwd 6*T*K*H*I; fwd+bwd 18*T*K*H*I (bench/moe_common.py)",
            "presets": list(dict.fromkeys(c.preset for c in cases))}
    if fp8:
        meta.update(moe_fp8.describe())
    if ctx.interpreted:
        meta["note"] = INTERPRETER_LABEL
    return meta


def derive(rows: list[dict], meta: dict) -> dict:
    if meta.get("options", {}).get("fp8"):
        return moe_fp8.derive(rows, meta)
    return {}


def summarize(rows: list[dict], meta: dict) -> str:
    if meta.get("options", {}).get("fp8"):
        return moe_fp8.summarize(rows, meta)
    cols = ("name", "baseline", "detkit_median_us", "detkit_p20_us", "detkit_p80_us", "baseline_median_us",
            "ratio_vs_baseline", "detkit_tflops", "detkit_mfu", "baseline_tflops", "detkit_sm_clock_mhz", "validated")
    return "\n".join(["## BF16 MoE layer and its stages vs PyTorch (same run, interleaved)", "",
                      markdown_table(rows, cols), ""])
