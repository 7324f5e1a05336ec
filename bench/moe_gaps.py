"""Where one MoE forward+backward leaves the GPU idle, waiting on the host.

The 2026-11-29 sweep (reports/2026-11-29-h200-table7/moe-bf16/sweep) timed fwd_bwd at 11.58 ms at the
reference shape while one profiled call's kernels summed to 9.9 ms. This profiles one warm ``moe_mlp_fwd`` + ``moe_mlp_bwd`` call (torch.profiler, CPU and CUDA activities,
host and device clocks aligned by Kineto) and reports:

- ``window_us``: from the host entering the call to the last kernel's end (what an event pair around the
  call measures); ``busy_us``: the union of the kernels' GPU intervals; ``idle_us`` = window - busy;
- every gap longer than ``--min-gap-us`` (the host lead before the first kernel included), with the
  kernels on either side and the stage whose host range launched the next kernel;
- per stage: the host time of its range and the GPU time of its kernels.

The profiler slows the host path (CUPTI callbacks per launch), so two numbers are taken without it:
``event_us`` (median of CUDA-event-timed calls: what the sweep's timing sees, less its L2 flush) and each
stage's host time by ``time.perf_counter`` (``host_us_unprofiled``; the routing stage includes its one
device-to-host read, so its GPU wait). The profile is the second of two (the first pays CUPTI's set-up).

    python -m detkit.bench.moe_gaps --preset reference --preset qwen3-30b-a3b --tokens 8192 --out DIR

A CUDA device is required (the interpreter has no device timeline).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from contextlib import contextmanager
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from detkit.toolkit.timing import SmClock, Timing


@dataclass(frozen=True)
class Span:
    name: str
    start_us: float
    end_us: float


def union_us(spans: Sequence[Span]) -> float:
    """Length of the union of the spans' intervals."""
    total, reach = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.start_us):
        if s.end_us <= reach:
            continue
        total += s.end_us - max(s.start_us, reach)
        reach = s.end_us
    return total


def idle_gaps(call_start_us: float, kernels: Sequence[Span], min_gap_us: float) -> list[dict]:
    """Gaps in which no kernel runs, from ``call_start_us`` to the last kernel's end, longer than
    ``min_gap_us``; each with the kernel before it (None for the host lead) and after it."""
    gaps, reach, before = [], call_start_us, None
    for k in sorted(kernels, key=lambda s: s.start_us):
        if k.start_us - reach > min_gap_us:
            gaps.append({"gap_us": k.start_us - reach, "at_us": reach - call_start_us,
                         "after": before, "before": k.name})
        if k.end_us > reach:
            reach, before = k.end_us, k.name
    return gaps


def stage_of(t_us: float, stages: Sequence[Span]) -> str | None:
    """The innermost stage span containing ``t_us``."""
    inside = [s for s in stages if s.start_us <= t_us <= s.end_us]
    return min(inside, key=lambda s: s.end_us - s.start_us).name if inside else None


def profile_call(fn, stage_names: Sequence[str], device: torch.device, min_gap_us: float) -> dict:
    """One profiled call of ``fn(stage_range)`` (warm): window, busy, idle, the gaps, per-stage times."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("moe_gaps_call"):
            fn(record_function)
        torch.cuda.synchronize(device)
    kernels, host, device_ranges, call = [], [], [], None
    for ev in prof.events():
        span = Span(ev.name, float(ev.time_range.start), float(ev.time_range.end))
        if ev.device_type == DeviceType.CUDA:
            (device_ranges if ev.is_user_annotation else kernels).append(span)
        elif ev.name == "moe_gaps_call":
            call = span
        elif ev.name in stage_names:
            host.append(span)
    if call is None or not kernels:
        raise RuntimeError("the profile holds no call range or no CUDA kernels; is this a CUDA device?")
    kernels = [k for k in kernels if k.start_us >= call.start_us]
    window = max(k.end_us for k in kernels) - call.start_us
    busy = union_us(kernels)
    gaps = idle_gaps(call.start_us, kernels, min_gap_us)
    stage_spans = [s for s in device_ranges if s.name in stage_names]
    for g in gaps:  # the stage whose range holds the kernel after the gap (it launched past the gap)
        g["stage"] = stage_of(call.start_us + g["at_us"] + g["gap_us"], stage_spans)
    kernel_stage = [stage_of(k.start_us, stage_spans) for k in kernels]
    stages = []
    for name in stage_names:
        d = [k for k, st in zip(kernels, kernel_stage) if st == name]
        stages.append({"stage": name, "host_us": sum(s.end_us - s.start_us for s in host if s.name == name),
                       "gpu_us": sum(k.end_us - k.start_us for k in d), "kernels": len(d)})
    return {"window_us": window, "busy_us": busy, "idle_us": window - busy, "idle_share": (window - busy) / window,
            "host_lead_us": min(k.start_us for k in kernels) - call.start_us,
            "kernel_sum_us": sum(k.end_us - k.start_us for k in kernels), "kernels": len(kernels),
            "gaps": sorted(gaps, key=lambda g: -g["gap_us"]), "stages": stages}


def unprofiled(call, device: torch.device, reps: int = 10) -> dict:
    """Event-timed calls (median, p20, p80 in us) and one call's per-stage host time, no profiler."""
    host: dict[str, float] = {}

    @contextmanager
    def host_range(name):
        start = time.perf_counter()
        yield
        host[name] = host.get(name, 0.0) + (time.perf_counter() - start) * 1e6

    torch.cuda.synchronize(device)
    call(host_range)
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(None)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    t = Timing.from_samples_ms(samples)
    return {"event_us": t.median_us, "event_p20_us": t.p20_us, "event_p80_us": t.p80_us,
            "host_us_unprofiled": host}


FLUSH_BYTES = 256 * 2**20  # the L2 flush between timed calls, as triton.testing.do_bench does it


def split_at(kernels: Sequence[Span], is_marker) -> list[list[Span]]:
    """The kernels between consecutive marker kernels (the markers dropped), in start order."""
    groups: list[list[Span]] = []
    for k in sorted(kernels, key=lambda s: s.start_us):
        if is_marker(k):
            groups.append([])
        elif groups:
            groups[-1].append(k)
    return [g for g in groups if g]


def sustained_calls(fn, device: torch.device, calls: int) -> dict:
    """``calls`` calls back to back as the sweep times them (L2 flush, call; no host sync between), one
    profile: per call the window from its first kernel's start to its last kernel's end (the flush
    excluded), the kernels' busy time and the idle rest; each kernel's median duration; and the SM clock,
    power and clock-event reasons NVML reports every 10 ms while the calls run (toolkit.timing.SmClock)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    nvml = SmClock(device, period_s=0.01)
    if nvml.handle is None:
        raise RuntimeError("detkit.bench.moe_gaps --sustained reads the clocks through NVML (nvidia-ml-py); "
                           "NVML could not be initialised for this device")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)
    torch.cuda.synchronize(device)
    samples: list[tuple[float, float, int]] = []  # (SM clock, power, reasons) every 10 ms while the calls run
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with nvml.sampling(samples, nvml.read_state):
            for _ in range(calls):
                torch.cuda._sleep(1)  # a marker kernel (ATen's spin_kernel) that starts each call's group
                flush.zero_()
                fn(None)
            torch.cuda.synchronize(device)
    clocks = [c for c, _, _ in samples]
    clock = {"sm_clock_mhz_median": statistics.median(clocks), "sm_clock_mhz_min": min(clocks),
             "power_w_max": max(w for _, w, _ in samples), "clock_reasons": sorted({hex(r) for _, _, r in samples})}
    kernels = [Span(ev.name, float(ev.time_range.start), float(ev.time_range.end))
               for ev in prof.events() if ev.device_type == DeviceType.CUDA and not ev.is_user_annotation]
    # Each group: the flush, then the call's kernels; the first call pays the profiler's set-up.
    per_call = [g[1:] for g in split_at(kernels, lambda k: "spin_kernel" in k.name)[1:]]
    if not per_call:
        raise RuntimeError(f"no call between marker kernels in the profile; kernel names seen: "
                           f"{sorted({k.name[:60] for k in kernels})[:20]}")
    windows = [max(k.end_us for k in g) - min(k.start_us for k in g) for g in per_call]
    busy = [union_us(g) for g in per_call]
    durations: dict[str, list[float]] = {}
    for g in per_call:
        for k in g:
            durations.setdefault(k.name, []).append(k.end_us - k.start_us)
    med = statistics.median
    return {"calls": len(per_call), "window_us_median": med(windows), "busy_us_median": med(busy),
            "idle_us_median": med([w - b for w, b in zip(windows, busy)]), **clock,
            "kernel_us_median": {name: med(d) for name, d in durations.items()}}


def run(presets: Sequence[str], tokens: Sequence[int], device: torch.device, min_gap_us: float,
        warmups: int = 3, sustained: int = 0) -> list[dict]:
    from detkit.bench.moe import PRESETS, make_inputs
    from detkit.kernels.moe import layer_stage_names, moe_mlp_bwd, moe_mlp_fwd

    rows = []
    for name in presets:
        for t in tokens:
            p = dataclasses.replace(PRESETS[name], t=t)
            inp = make_inputs(p, device, seed=0)
            x, w1, w2, ids, scores, dout = (inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout"))
            names = layer_stage_names(x, w1, p.k)

            def call(stage_range):
                out, saved = moe_mlp_fwd(x, w1, w2, ids, scores, stage_range=stage_range)
                return out, moe_mlp_bwd(dout, saved, stage_range=stage_range)

            for _ in range(warmups):  # compile, allocator
                call(None)
            plain = unprofiled(call, device)
            profile_call(call, list(names.values()), device, min_gap_us)  # pays CUPTI's set-up
            row = {"preset": name, "T": t, "label": p.label, **plain,
                   **profile_call(call, list(names.values()), device, min_gap_us)}
            if sustained:
                row["sustained"] = sustained_calls(call, device, sustained)
                s = row["sustained"]
                print(f"{p.label}: {s['calls']} sustained calls: window {s['window_us_median']:.0f} us, busy "
                      f"{s['busy_us_median']:.0f}, idle {s['idle_us_median']:.0f}; SM clock {s['sm_clock_mhz_median']} MHz "
                      f"({s['clock_reasons']})", flush=True)
            rows.append(row)
            print(f"{p.label}: event-timed {row['event_us']:.0f} us (p20 {row['event_p20_us']:.0f}, p80 "
                  f"{row['event_p80_us']:.0f}); kernels busy {row['busy_us']:.0f} us; profiled window "
                  f"{row['window_us']:.0f}, idle {row['idle_us']:.0f} ({row['idle_share']:.1%}), host lead "
                  f"{row['host_lead_us']:.0f}", flush=True)
            for g in row["gaps"][:8]:
                print(f"  gap {g['gap_us']:7.1f} us at {g['at_us']:8.1f}: {g['after']} -> {g['before']} "
                      f"[{g['stage']}]", flush=True)
            for s in row["stages"]:
                print(f"  stage {s['stage']}: host {row['host_us_unprofiled'].get(s['stage'], float('nan')):.0f} us "
                      f"unprofiled ({s['host_us']:.0f} profiled), gpu {s['gpu_us']:.0f} us ({s['kernels']} kernels)",
                      flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", help="detkit.bench.moe preset (repeatable; default: reference)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[8192])
    parser.add_argument("--min-gap-us", type=float, default=5.0)
    parser.add_argument("--sustained", type=int, default=0, metavar="N",
                        help="also profile N back-to-back calls as the sweep times them (0: skip)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from detkit.bench.moe import PRESETS

    presets = args.preset or ["reference"]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        raise SystemExit(f"unknown preset(s) {unknown}; supported: {sorted(PRESETS)}")
    if not torch.cuda.is_available():
        raise SystemExit("detkit.bench.moe_gaps needs a CUDA device: the interpreter has no device timeline")
    rows = run(presets, args.tokens, torch.device("cuda"), args.min_gap_us, sustained=args.sustained)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gaps.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                    "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
