"""The MoE layer's host time per call and where it goes. At small T the layer is host-bound in eager use (its
Python queues the work slower than the GPU runs it: `detkit bench moe` shows eager against CUDA-graph time), so
this times the Python of a call until its work is queued, counts what it launches, and profiles the host path.

    python -m tools.moe_host --device cuda                  # BF16 layer at T=2048, H=2048, I=768, E=8, K=2
    python -m tools.moe_host --device cuda --fp8 --profile  # the FP8 layer, with a cProfile (top by own time)
    python -m tools.moe_host                                # CPU: every Triton launch a no-op (the Python alone)
    python -m tools.moe_host --device cuda --block --shape 8 2048 768 128 8 --profile
                                                            # transformers' Qwen3-MoE block under the mode, inference

Measures: ``fwd`` (the layer's forward with autograd recording) and ``fwd_bwd`` (forward, then
``torch.autograd.grad`` of x, w1, w2: nothing accumulates between calls); with ``--block``, ``infer``: transformers'
Qwen3-MoE sparse MoE block (bench/moe_hf.py) under ``batch_invariant_mode()`` (``--fp8``: FP8 experts) in
``torch.no_grad()``, as a rollout engine calls it, with the router's own routing; on CUDA with ``--profile`` also
torch.profiler's table of host-side ops by self CPU time. A measure's host time (toolkit.timing.host_samples_ms):
batches of ``--calls`` back-to-back calls with no synchronisation inside a batch (the queue drained between batches;
at these sizes the GPU keeps up), the per-call mean of each batch, median, p20/p80 and range over ``--rounds``
batches. Launches per
call: on CUDA the GPU kernels of one call in torch.profiler (the layer's and torch's own: copies, fills); on the CPU
the Triton launches counted by the no-op stand-in, by kernel name. CPU tensors' torch ops cost less than CUDA ones,
so CPU times are the Python's order of magnitude, not the GPU host's.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys
from collections import Counter
from collections.abc import Callable

import torch
from tabulate import tabulate

MEASURES = ("fwd", "fwd_bwd")
BLOCK_MEASURES = ("infer",)
CUDA_SHAPE = (2048, 2048, 768, 8, 2)  # T, H, I, E, K: host-bound in eager use on an H200 (bench moe --sweep)
CPU_SHAPE = (256, 256, 128, 8, 2)


@contextlib.contextmanager
def noop_launches(counts: Counter):
    """Every ``kernel[grid](...)`` of a Triton (or interpreted) kernel counted by name and not run, for the
    duration: outputs stay as allocated."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def getitem(kernel, grid):
        name = getattr(kernel.fn, "__name__", type(kernel).__name__)

        def launch(*args, **kwargs):
            counts[name] += 1
        return launch

    saved = [(cls, cls.__getitem__) for cls in (JITFunction, InterpretedFunction)]
    for cls, _ in saved:
        cls.__getitem__ = getitem
    try:
        yield counts
    finally:
        for cls, original in saved:
            cls.__getitem__ = original


def layer_call(measure: str, fp8: bool, shape: tuple[int, ...], device: torch.device) -> Callable[[], object]:
    """One call of the BF16 (or FP8) layer on the bench's inputs at ``shape`` = (T, H, I, E, K)."""
    from detkit.bench.moe_common import make_inputs
    from detkit.toolkit.presets import MoePreset

    inp = make_inputs(MoePreset("host", *shape), device)
    if fp8:
        from detkit.kernels.moe.fp8.layer import moe_mlp_fp8 as layer
    else:
        from detkit.kernels.moe.layer import moe_mlp as layer
    leaves = [inp[name].requires_grad_() for name in ("x", "w1", "w2")]
    ids, scores, dout = inp["topk_ids"], inp["scores"], inp["dout"]
    if measure == "fwd":
        return lambda: layer(*leaves, ids, scores)
    return lambda: torch.autograd.grad(layer(*leaves, ids, scores), leaves, dout)


@contextlib.contextmanager
def block_call(fp8: bool, shape: tuple[int, ...], device: torch.device):
    """Yields one inference call of transformers' Qwen3-MoE block at ``shape`` = (T, H, I, E, K), with the mode
    entered once around all of them (as a rollout engine enters it; entering registers the mode's overrides)."""
    import detkit
    from detkit.bench import moe_hf
    from detkit.toolkit.presets import MoePreset

    block = moe_hf.build_block(MoePreset("host", *shape), device, seed=0)
    x = torch.randn(1, shape[0], shape[1], device=device).to(torch.bfloat16)

    def call():
        with torch.no_grad():
            return block(x)
    # fp8_shapes="all": the FP8 layer at any shape (the mode's default gives shapes where it is slower to BF16)
    with detkit.batch_invariant_mode(moe_experts="fp8" if fp8 else "bf16", fp8_shapes="all"):
        yield call


def host_op_table(fn: Callable[[], object], calls: int, top: int) -> str:
    """torch.profiler's host-side ops of ``calls`` calls, by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def cuda_kernels_per_call(fn: Callable[[], object]) -> Counter:
    """The GPU kernels one call launches, by name (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return Counter({e.key: e.count for e in prof.key_averages() if e.device_type.name == "CUDA"})


def profile_text(fn: Callable[[], object], calls: int, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def measure_all(device: torch.device, fp8: bool, shape: tuple[int, ...], calls: int, rounds: int,
                profile: bool, top: int, block: bool = False) -> dict:
    cuda = device.type == "cuda"
    results = {"device": str(device), "layer": ("block " if block else "") + ("fp8" if fp8 else "bf16"),
               "shape": dict(zip("THIEK", shape)), "calls": calls, "rounds": rounds, "measures": {}, "profiles": {}}
    counts: Counter = Counter()
    with contextlib.nullcontext() if cuda else noop_launches(counts):
        for measure in BLOCK_MEASURES if block else MEASURES:
            with block_call(fp8, shape, device) if block else \
                    contextlib.nullcontext(layer_call(measure, fp8, shape, device)) as fn:
                _measure_one(results, measure, fn, device, counts, calls, rounds, profile, top)
    return results


def _measure_one(results: dict, measure: str, fn: Callable[[], object], device: torch.device, counts: Counter,
                 calls: int, rounds: int, profile: bool, top: int) -> None:
    """One measure's host time, launches and (``profile``) profiles into ``results``."""
    from detkit.toolkit.timing import Timing, host_samples_ms

    cuda = device.type == "cuda"
    # Bursts of back-to-back calls, one sample per burst (its mean per call), 3 untimed calls first (compilation,
    # caches). A call launches tens of kernels: a burst behind a GPU sleep could fill the launch queue, so bursts
    # start on an idle GPU, which keeps up at these sizes.
    samples_ms = host_samples_ms({measure: fn}, device, rounds, calls, per_call=False, warmup=3,
                                 gpu_sleep_s=0.0)[measure]
    spread = Timing.from_samples_ms(samples_ms)
    if cuda:
        launches = cuda_kernels_per_call(fn)
    else:
        counts.clear()
        fn()
        launches = Counter(counts)
    results["measures"][measure] = {
        "host_us_median": spread.median_us, "host_us_p20": spread.p20_us, "host_us_p80": spread.p80_us,
        "host_us_min": min(samples_ms) * 1e3, "host_us_max": max(samples_ms) * 1e3, "launches": sum(launches.values()),
        "by_kernel": dict(launches)}
    if profile:
        results["profiles"][measure] = profile_text(fn, calls, top)
        if cuda:
            results["profiles"][f"{measure} host ops"] = host_op_table(fn, calls, top)


def render(results: dict) -> str:
    shape = ", ".join(f"{k}={v}" for k, v in results["shape"].items())
    kind = "real kernels, host time until queued" if results["device"].startswith("cuda") else \
        "CPU, every Triton launch a no-op (Python and CPU torch ops only)"
    lines = [f"MoE {results['layer']} layer host time per call [{shape}] on {results['device']} ({kind}); "
             f"median (min-max) of {results['rounds']} batches of {results['calls']} calls"]
    rows = [[m, f"{r['host_us_median']:.0f} ({r['host_us_min']:.0f}-{r['host_us_max']:.0f})", r["launches"]]
            for m, r in results["measures"].items()]
    lines.append(tabulate(rows, headers=["measure", "host µs per call", "launches per call"], tablefmt="github"))
    for m, r in results["measures"].items():
        lines.append(f"\n{m} launches: " + ", ".join(f"{k} {v}" for k, v in sorted(r["by_kernel"].items())))
    for m, text in results["profiles"].items():
        what = "torch.profiler, host-side ops by self CPU time" if m.endswith(" host ops") else "cProfile, by own time"
        lines.append(f"\n## {m}: {what} ({results['calls']} calls)\n{text}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--fp8", action="store_true", help="the FP8 layer (kernels/moe/fp8/layer.py) instead of BF16")
    parser.add_argument("--block", action="store_true",
                        help="transformers' Qwen3-MoE block under the mode (inference) instead of the layer")
    parser.add_argument("--shape", type=int, nargs=5, metavar=("T", "H", "I", "E", "K"),
                        help=f"default {CUDA_SHAPE} on cuda, {CPU_SHAPE} on cpu")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="a cProfile of --calls calls per measure")
    parser.add_argument("--top", type=int, default=30, help="cProfile rows")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        parser.error(f"--calls and --rounds must be >= 1; got {args.calls}, {args.rounds}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if device.type == "cpu":  # detkit's kernels take CPU tensors under the interpreter (read when they are defined)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    shape = tuple(args.shape) if args.shape else (CUDA_SHAPE if device.type == "cuda" else CPU_SHAPE)
    results = measure_all(device, args.fp8, shape, args.calls, args.rounds, args.profile, args.top, args.block)
    print(render(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
