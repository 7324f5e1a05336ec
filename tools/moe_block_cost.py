"""Where transformers' Qwen3-MoE block spends its time under the mode, beyond the detkit layer's own time.

`detkit bench moe` times the BF16 layer on weights in its own layout (w1 [E, H, 2I], w2 [E, I, H], N-major) and the
block under the mode (``hf_detkit``); this splits the difference between the two, forward and forward+backward,
eager, interleaved in one process at a preset's shape:

    layer            moe_mlp on the layer's layout (the bench's ``bf16`` row)
    layer_linear     moe_mlp on transformers' storage: w1 = the interleaved copy of gate_up_proj (K-major, made
                     once, outside the timing), w2 = down_proj.transpose(1, 2) (a K-major view)
    layer_split      moe_mlp on gate_up_proj.transpose(1, 2) with gate_up="split" and down_proj.transpose(1, 2):
                     transformers' parameters read in place
    interleave       a per-call copy gate_up_proj -> interleaved w1 (kernels/mode_moe.gate_up_as_w1) and,
                     forward+backward, its gradient back to gate_up_proj's layout
    experts          the mode's experts path (mode_moe.experts_forward on the block's experts module), gradients
                     by torch.autograd.grad (as bench moe's hf_detkit row)
    experts_copy     the same on an interleaved copy made per call (the path before gate_up="split")
    experts_accum    ``experts`` through .backward(): gradients accumulated into .grad (set to None before each
                     call), as a training step does
    router           the mode's router (mode_moe.router_forward)
    block            the whole block under batch_invariant_mode() (bench moe's hf_detkit row)

The layer rows use the bench's uniform routing; the block rows its own router's. Also the stages of the layer on
transformers' storage (``bench.moe.bf16_stage_fns``) and the stages that read or write w1, w2 as split views
beside the layer's own. GPU only (CUDA BF16).

    python -m tools.moe_block_cost --preset qwen3-30b-a3b --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import torch
from tabulate import tabulate

ROWS = ("layer", "layer_linear", "layer_split", "interleave", "experts", "experts_copy", "experts_accum", "router",
        "block")


def fwd_bwd(fn, leaves, dout, accumulate: bool = False):
    """fn() -> out; then the gradients of ``leaves`` (autograd.grad, or .backward() into .grad)."""
    if accumulate:
        def run():
            for t in leaves:
                t.grad = None
            fn().backward(dout)
        return run
    return lambda: torch.autograd.grad(fn(), leaves, dout)


def build(preset: str, device: torch.device, seed: int, tokens: int | None = None):
    from detkit.bench import moe_hf
    from detkit.bench.moe_common import make_inputs
    from detkit.mode import moe as mode_moe
    from detkit.kernels.moe.layer import moe_mlp
    from detkit.toolkit.presets import MOE_PRESETS

    p = MOE_PRESETS[preset] if tokens is None else replace(MOE_PRESETS[preset], t=tokens)
    inp = make_inputs(p, device, seed)
    block = moe_hf.build_block(p, device, seed)
    experts = block.experts
    x = inp["x"].requires_grad_()
    ids, scores, dout = inp["topk_ids"], inp["scores"], inp["dout"]
    w1n = inp["w1"].requires_grad_()
    w2n = inp["w2"].requires_grad_()
    w1k = mode_moe.gate_up_as_w1(experts.gate_up_proj.detach()).requires_grad_()  # K-major storage, made once
    w2k = mode_moe.down_as_w2(experts.down_proj.detach()).requires_grad_()  # a K-major view
    gate_up, down = experts.gate_up_proj, experts.down_proj
    ids64, scores_bf16 = ids.long(), scores.to(torch.bfloat16)
    grad_w1 = torch.randn_like(w1k)

    def layer_split():
        return moe_mlp(x, gate_up.transpose(1, 2), down.transpose(1, 2), ids, scores, gate_up="split")

    def experts_copy():
        return moe_mlp(x, mode_moe.gate_up_as_w1(gate_up), down.transpose(1, 2), mode_moe.route_ids(ids64, p.e),
                       scores_bf16)

    fns = {
        "fwd": {
            "layer": lambda: moe_mlp(x, w1n, w2n, ids, scores),
            "layer_linear": lambda: moe_mlp(x, w1k, w2k, ids, scores),
            "layer_split": layer_split,
            "interleave": lambda: mode_moe.gate_up_as_w1(gate_up),
            "experts": lambda: mode_moe.experts_forward(experts, x, ids64, scores_bf16),
            "experts_copy": experts_copy,
            "router": lambda: mode_moe.router_forward(block.gate, x),
        },
        "fwd_bwd": {
            "layer": fwd_bwd(lambda: moe_mlp(x, w1n, w2n, ids, scores), [x, w1n, w2n], dout),
            "layer_linear": fwd_bwd(lambda: moe_mlp(x, w1k, w2k, ids, scores), [x, w1k, w2k], dout),
            "layer_split": fwd_bwd(layer_split, [x, gate_up, down], dout),
            "interleave": lambda: torch.autograd.grad(mode_moe.gate_up_as_w1(gate_up), [gate_up], grad_w1),
            "experts": fwd_bwd(lambda: mode_moe.experts_forward(experts, x, ids64, scores_bf16),
                               [x, gate_up, down], dout),
            "experts_copy": fwd_bwd(experts_copy, [x, gate_up, down], dout),
            "experts_accum": fwd_bwd(lambda: mode_moe.experts_forward(experts, x, ids64, scores_bf16),
                                     [x, gate_up, down], dout, accumulate=True),
        },
    }
    block_fns = moe_hf.block_fns(block, inp["x"], dout)
    for measure in fns:
        fns[measure]["block"] = block_fns[measure]
    stage_inputs = {"layer": inp, "layer_linear": dict(inp, w1=w1k.detach(), w2=w2k.detach()),
                    "split": dict(inp, w1=gate_up.detach().transpose(1, 2), w2=down.detach().transpose(1, 2))}
    return p, fns, stage_inputs


def split_stage_fns(p, inp: dict, backend: str) -> dict:
    """The stages that read or write w1, w2 on split views (gate_up="split", gradients in the weights' layouts)."""
    from detkit.kernels.moe import launch as ml
    from detkit.kernels.moe.layer import moe_mlp_fwd
    from detkit.kernels.moe.routing import build_routing

    x, w1, w2, ids, scores, dout = (inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout"))
    routing = build_routing(ids, scores, p.e)
    _, saved = moe_mlp_fwd(x, w1, w2, ids, scores, gate_up="split")
    dgu = ml.moe_dgrad_dswiglu(dout, w2, saved.gu, routing, backend)
    return {
        "up_swiglu": lambda: ml.moe_up_swiglu(x, w1, routing, backend, gate_up="split"),
        "dx_route": lambda: ml.moe_dx_route(dgu, w1, routing, backend, gate_up="split"),
        "wgrad_w1": lambda: ml.moe_wgrad_w1(x, dgu, routing, backend, gate_up="split", like=w1),
        "wgrad_w2": lambda: ml.moe_wgrad_w2(saved.h, dout, routing, backend, like=w2),
    }


def measure(preset: str, rounds: int, seed: int, tokens: int | None = None) -> dict:
    import detkit
    from detkit.bench.moe import bf16_stage_fns
    from detkit.kernels.backend import CUDA_SM90
    from detkit.toolkit.timing import time_interleaved

    device = torch.device("cuda")
    p, fns, stage_inputs = build(preset, device, seed, tokens)
    out = {"preset": preset, "shape": dict(zip("THIEK", (p.t, p.h, p.i, p.e, p.k))), "rows": {}, "stages": {}}
    with detkit.batch_invariant_mode():
        for name, measure_fns in fns.items():
            timings = time_interleaved(measure_fns, device, rounds=rounds)
            out["rows"][name] = {row: vars(t) for row, t in timings.items()}
    stage_fns = {}
    for layout in ("layer", "layer_linear"):
        for stage, (fn, _) in bf16_stage_fns(p, stage_inputs[layout], CUDA_SM90).items():
            stage_fns[f"{layout} {stage}"] = fn
    for stage, fn in split_stage_fns(p, stage_inputs["split"], CUDA_SM90).items():
        stage_fns[f"split {stage}"] = fn
    timings = time_interleaved(stage_fns, device, rounds=max(1, rounds // 2))
    out["stages"] = {name: vars(t) for name, t in timings.items()}
    return out


def render(result: dict) -> str:
    shape = ", ".join(f"{k}={v}" for k, v in result["shape"].items())
    lines = [f"## {result['preset']} [{shape}]: eager, CUDA events, median (p20-p80) µs"]
    for name, rows in result["rows"].items():
        base = rows["layer"]["median_us"]
        table = [[row, f"{t['median_us']:.0f}", f"{t['p20_us']:.0f}-{t['p80_us']:.0f}", f"{t['median_us'] / base:.2f}"]
                 for row, t in rows.items()]
        lines += [f"\n{name}", tabulate(table, headers=["row", "median", "p20-p80", "/ layer"], tablefmt="github")]
    stages = result["stages"]
    names = list(dict.fromkeys(n.split(" ", 1)[1] for n in stages))
    layouts = ("layer", "layer_linear", "split")
    table = []
    for s in names:
        base = stages[f"layer {s}"]["median_us"]
        cells = [stages.get(f"{lay} {s}") for lay in layouts]
        table.append([s] + [f"{c['median_us']:.0f} ({c['median_us'] / base:.2f})" if c else "" for c in cells])
    lines += ["\nstages, µs (/ the layer's layout): the layer's layout, transformers' storage with an interleaved copy, "
              "split views",
              tabulate(table, headers=["stage", *layouts], tablefmt="github")]
    return "\n".join(lines)


def main(argv=None) -> int:
    from detkit.toolkit.presets import MOE_PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", choices=sorted(MOE_PRESETS), help="repeatable")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tokens", type=int, help="T instead of the preset's (e.g. a prefill's 2048)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("a CUDA device is needed (the block's costs are GPU time)")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1; got {args.rounds}")
    if args.tokens is not None and args.tokens < 1:
        parser.error(f"--tokens must be >= 1; got {args.tokens}")
    results = []
    for preset in args.preset or ["reference", "qwen3-30b-a3b"]:
        results.append(measure(preset, args.rounds, args.seed, args.tokens))
        if args.json:  # after every preset: a run stopped at its time limit keeps what finished
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        print(render(results[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
