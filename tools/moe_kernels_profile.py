"""Where the MoE layer's GPU time goes inside a real forward+backward call: every kernel of the call by name (count,
total µs per call), the call's GPU busy time against its wall time, for the BF16 and FP8 layers at MoE presets.

`detkit bench moe` times each stage alone on the layer's intermediates (its "stage" rows); this profiles the layer as
a caller runs it (the layer's own kernels and torch's: fills, copies), so the stages' sum can be checked against the
call and the idle time between kernels seen.

    python -m tools.moe_kernels_profile --preset reference --impl bf16 --impl fp8 --out results/profile
    python -m tools.moe_kernels_profile --shape 8192,3072,1536,128,2 --impl bf16 --impl fp8 --out results/profile

``--shape T,H,I,E,K`` profiles a shape that is not a preset (a sweep point of ``detkit bench moe --sweep``).

Per (preset, impl): ``--warmup`` calls, then ``--calls`` calls under torch.profiler (CUDA activity). Kernel time per
call = the sum of the kernel's device durations / calls; busy = all kernels' sum / calls; wall = the profiled span
(first kernel start to last kernel end) / calls. Writes profile.json and profile.md under --out; GPU only.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from detkit.toolkit.reports import markdown_table

IMPLS = ("bf16", "fp8", "fp8_warm")


def layer_call(impl: str, inp: dict):
    """The fwd+bwd callable of ``impl`` on ``inp`` (the bench's own)."""
    from detkit.bench import moe_fp8
    from detkit.kernels.moe.layer import moe_mlp_bwd, moe_mlp_fwd
    from detkit.kernels.moe.fp8.layer import Fp8WeightCache

    if impl == "bf16":
        args = [inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores")]

        def fwd_bwd():
            out, saved = moe_mlp_fwd(*args)
            return out, moe_mlp_bwd(inp["dout"], saved)
        return fwd_bwd
    cache = Fp8WeightCache() if impl == "fp8_warm" else None
    return moe_fp8.layer_fns(inp, weight_cache=cache)["fwd_bwd"]


def profile(fn, calls: int, warmup: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return summarize([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA], calls)


def summarize(kernels: list[tuple[str, float, float]], calls: int) -> dict:
    """(name, start µs, end µs) of every kernel of ``calls`` calls -> per name launches and µs per call (largest
    first), the kernels' summed time per call (busy) and the first start to the last end per call (wall)."""
    if not kernels or calls < 1:
        raise ValueError(f"no kernels to summarize ({len(kernels)} kernels over {calls} calls)")
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, start, end in kernels:
        per_name[name][0] += 1
        per_name[name][1] += end - start
    wall = max(k[2] for k in kernels) - min(k[1] for k in kernels)
    rows = sorted(({"kernel": k, "launches_per_call": v[0] / calls, "us_per_call": v[1] / calls}
                   for k, v in per_name.items()), key=lambda r: -r["us_per_call"])
    return {"calls": calls, "busy_us_per_call": sum(v[1] for v in per_name.values()) / calls,
            "wall_us_per_call": wall / calls, "kernels": rows}


def parse_shape(text: str):
    """``T,H,I,E,K`` -> the bench's sweep point of that shape (named as the sweep's rows are); refuses anything but
    five positive integers with K <= E that the kernels' 32-bit offsets cover."""
    from detkit.bench.moe import sweep_point
    from detkit.bench.moe_common import offsets_reason

    parts = text.split(",")
    if len(parts) != 5 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--shape takes T,H,I,E,K (five positive integers); got {text!r}")
    t, h, i, e, k = (int(p) for p in parts)
    if k > e:
        raise argparse.ArgumentTypeError(f"--shape: K {k} routes per token need at least K experts; got E {e}")
    point = sweep_point(h, i, e, k, t)
    reason = offsets_reason(point)
    if reason:
        raise argparse.ArgumentTypeError(f"--shape: {reason}")
    return point


def main(argv=None) -> int:
    from detkit.bench.moe_common import make_inputs
    from detkit.toolkit.presets import MOE_PRESETS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", action="append", choices=sorted(MOE_PRESETS), default=[])
    ap.add_argument("--shape", action="append", type=parse_shape, default=[], metavar="T,H,I,E,K")
    ap.add_argument("--impl", action="append", choices=IMPLS, required=True)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not args.preset and not args.shape:
        ap.error("name at least one --preset or --shape")
    if args.calls < 1 or args.warmup < 0:
        ap.error(f"--calls must be >= 1 and --warmup >= 0; got {args.calls} and {args.warmup}")
    if not torch.cuda.is_available():
        raise SystemExit("moe_kernels_profile: needs a CUDA device (it profiles GPU kernels); none is available")
    args.out.mkdir(parents=True, exist_ok=True)
    results, lines = [], []
    for p in [MOE_PRESETS[name] for name in args.preset] + args.shape:
        name = p.name
        inp = make_inputs(p, torch.device("cuda"), seed=1234)
        for impl in args.impl:
            r = {"preset": name, "impl": impl, **profile(layer_call(impl, inp), args.calls, args.warmup)}
            results.append(r)
            lines += [f"## {name} ({p.label}), {impl}: busy {r['busy_us_per_call']:.0f} µs, "
                      f"wall {r['wall_us_per_call']:.0f} µs per call", "",
                      markdown_table(r["kernels"], ("kernel", "launches_per_call", "us_per_call")), ""]
    (args.out / "profile.json").write_text(json.dumps(results, indent=1))
    (args.out / "profile.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
