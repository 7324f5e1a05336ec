"""Where one eager decode step of a transformers model spends its time, in detkit mode and in default mode: the step of
``detkit bench model``'s ``decode_eager`` case (the same model, the same filled DynamicCache, the same baseline
attention) run under ``torch.profiler``, so a ratio the bench reports can be taken apart.

    python -m tools.decode_profile --device cuda --preset qwen3-8b --layers 4 --batch 1 --cache-len 32768 --out DIR

Per mode: the step's eager time and its host time until queued (toolkit/timing.py's ``time_back_to_back`` and
``time_host``, the two modes interleaved over ``--steps`` rounds: median, p20, p80), then under the profiler the GPU
time it saw, kernel launches per step, and the top operators by self CPU time and the top GPU kernels by time, per
step. ``--unfused`` adds a third mode, detkit mode with transformers' RMSNorm classes and rotary function on their
own ops (``detkit.mode.norms.suspended``, ``detkit.mode.rotary.suspended``: the fused routes' share of the step).
``DIR/profile.json`` holds every number, ``DIR/profile.md`` the tables. On the CPU (the Triton interpreter) it runs
the plumbing at the model's tiny config: not a hardware result.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TOP = 15


def profile_steps(step, device, steps: int) -> dict:
    """torch.profiler over ``steps`` calls of ``step``: per-call top operators (self CPU µs), top GPU kernels (µs),
    GPU total, launches. tools/experts_bench.py's ``--profile`` calls it too."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    cpu = sorted(((e.key, e.self_cpu_time_total / steps, e.count / steps) for e in events
                  if e.self_cpu_time_total > 0), key=lambda row: -row[1])
    gpu = sorted(((e.key, e.self_device_time_total / steps, e.count / steps) for e in events
                  if e.self_device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda row: -row[1])
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                         "cudaLaunchKernelExC")) / steps
    return {"top_cpu": [{"op": k, "self_cpu_us": t, "calls": c} for k, t, c in cpu[:TOP]],
            "top_gpu": [{"kernel": k, "gpu_us": t, "calls": c} for k, t, c in gpu[:TOP]],
            "gpu_us": sum(t for _, t, _ in gpu), "launches": launches}


UNFUSED = "detkit_unfused"


def profile_decode(device, preset: str, layers: int | None, batch: int, cache_len: int, steps: int, seed: int,
                   unfused: bool = False) -> dict:
    import contextlib

    import torch
    from detkit.mode import norms as mode_norms
    from detkit.mode import rotary as mode_rotary
    from detkit.bench.model import ModelBench
    from detkit.toolkit.harness import RunContext
    from detkit.toolkit.models import build_model, fp8_graph_weights_choice, moe_experts_choice
    from detkit.toolkit.timing import time_back_to_back, time_host

    interpreted = device.type != "cuda"
    ctx = RunContext(device=device, backend="triton_interpreter" if interpreted else "cuda_sm90", preset=preset,
                     seed=seed, rounds=1)
    model, description = build_model(device, seed, preset, layers)
    bench = ModelBench(ctx, model, description, moe_experts_choice(), fp8_graph_weights_choice())
    result = {"model": description, "batch": batch, "cache_len": cache_len, "steps": steps,
              "hardware_result": not interpreted, "device": torch.cuda.get_device_name(device) if not interpreted
              else "cpu (Triton interpreter)", "modes": {}}
    steps_of, contexts = bench.decode_steps((batch, cache_len)), bench.contexts()
    if unfused:
        steps_of[UNFUSED] = bench.decode_steps((batch, cache_len))["detkit"]  # a cache of its own

        @contextlib.contextmanager
        def detkit_unfused():
            with contexts["detkit"](), mode_norms.suspended(), mode_rotary.suspended():
                yield
        contexts[UNFUSED] = detkit_unfused
    # Both modes interleaved, each on its own cache (every step appends a token to it); the eager timing's warm-up
    # call (compiles, launch plans, the allocator's blocks) serves the host timing too.
    wall = time_back_to_back(steps_of, device, rounds=steps, contexts=contexts)
    host = time_host(steps_of, device, rounds=steps, calls=1, warmup=0, contexts=contexts)
    for mode, step in steps_of.items():
        with contexts[mode]():
            prof = profile_steps(step, device, steps)
        result["modes"][mode] = {"wall_us": wall[mode].median_us, "wall_p20_us": wall[mode].p20_us,
                                 "wall_p80_us": wall[mode].p80_us, "host_us": host[mode].median_us,
                                 "host_p20_us": host[mode].p20_us, "host_p80_us": host[mode].p80_us,
                                 "samples": wall[mode].samples, **prof}
    modes = result["modes"]
    if "detkit" in modes and "default" in modes:
        result["wall_ratio"] = modes["detkit"]["wall_us"] / modes["default"]["wall_us"]
    if UNFUSED in modes:
        result["unfused_wall_ratio"] = modes[UNFUSED]["wall_us"] / modes["default"]["wall_us"]
    return result


def markdown(result: dict) -> str:
    from tabulate import tabulate

    lines = [f"# Eager decode step profile: {result['model']}", "",
             f"- device: {result['device']} (hardware result: {result['hardware_result']})",
             f"- batch {result['batch']}, cache {result['cache_len']} keys, {result['steps']} steps per measure",
             f"- wall ratio detkit / default: {result.get('wall_ratio', float('nan')):.3f}"]
    if "unfused_wall_ratio" in result:
        lines.append("- wall ratio detkit with RMSNorm and rotary unfused / default: "
                     f"{result['unfused_wall_ratio']:.3f}")
    lines.append("")
    for mode, m in result["modes"].items():
        lines += [f"## {mode}: wall {m['wall_us']:.0f} µs, host until queued {m['host_us']:.0f} µs, GPU (profiler) "
                  f"{m['gpu_us']:.0f} µs, {m['launches']:.0f} launches per step", "",
                  tabulate([(r["op"], f"{r['self_cpu_us']:.1f}", f"{r['calls']:.1f}") for r in m["top_cpu"]],
                           headers=("operator", "self CPU µs / step", "calls / step"), tablefmt="github"), ""]
        if m["top_gpu"]:
            lines += [tabulate([(r["kernel"][:90], f"{r['gpu_us']:.1f}", f"{r['calls']:.1f}") for r in m["top_gpu"]],
                               headers=("kernel", "GPU µs / step", "calls / step"), tablefmt="github"), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cache-len", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--unfused", action="store_true",
                        help="also time detkit mode with transformers' RMSNorm classes and rotary on their own ops")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    for name in ("batch", "cache_len", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.device == "cpu":
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    result = profile_decode(torch.device(args.device), args.preset, args.layers, args.batch, args.cache_len,
                            args.steps, args.seed, args.unfused)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (args.out / "profile.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
