"""Where the host spends one MoE forward+backward call: time per Python-level step, no profiler.

bench/moe_gaps.py found the GPU idle for the host path to the first GEMM (routing 342-499 µs, the
up stage 118-168 µs before its GEMM is queued). This attributes that host time: it wraps, for the
duration of the measurement only, every Triton launch (``JITFunction.run``, keyed by kernel), the
device-to-host read (``Tensor.tolist``), ``torch.empty`` and detkit's input checks, TMA descriptor
construction and config lookup, and accumulates ``time.perf_counter`` per key over many warm calls
(each started on an idle GPU, as the benchmark does). Times are inclusive (a check that calls
``resolve_backend`` includes it). The wrappers cost ~1 µs per call each; the totals are reported
beside the unwrapped call time so that cost is visible.

It also measures Triton's launch floor on this host: an empty kernel with 2 and with 24 arguments.

    python -m detkit.bench.moe_host --preset reference --preset qwen3-30b-a3b --tokens 8192 --out DIR

A CUDA device is required.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import torch
import triton
import triton.language as tl
from tabulate import tabulate


@triton.jit
def _empty2(a, b):
    pass


@triton.jit
def _empty24(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11,
             n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, C0: tl.constexpr, C1: tl.constexpr):
    pass


def launch_floor_us(reps: int = 2000) -> dict:
    """Host µs per launch of an empty kernel with 2 and with 24 arguments (12 tensors, 12 ints)."""
    t = [torch.empty(16, device="cuda") for _ in range(12)]
    ints = list(range(1, 13))
    cases = {"2 args": lambda: _empty2[(1,)](t[0], t[1]),
             "24 args": lambda: _empty24[(1,)](*t, *ints, C0=4, C1=8)}
    out = {}
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        out[name] = (time.perf_counter() - start) / reps * 1e6
        torch.cuda.synchronize()
    return out


class HostClock:
    """Accumulates inclusive perf_counter time per key while ``patched()`` is active."""

    def __init__(self):
        self.total = defaultdict(float)
        self.count = defaultdict(int)

    def wrap(self, key_of, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = key_of(args)
                self.total[key] += time.perf_counter() - start
                self.count[key] += 1
        return timed

    @contextmanager
    def patched(self):
        import detkit.kernels.moe as moe
        import detkit.kernels.moe_routing as routing
        from triton.runtime.jit import JITFunction

        named = lambda name: (lambda args: name)  # noqa: E731
        targets = [
            (JITFunction, "run", lambda args: f"launch {args[0].fn.__name__}"),
            (torch.Tensor, "tolist", named("Tensor.tolist (device-to-host read)")),
            (torch, "empty", named("torch.empty")),
            (moe, "check_moe_inputs", named("check_moe_inputs")),
            (moe, "weight_descriptor", named("weight_descriptor (TMA)")),
            (moe, "table_moe_config", named("table_moe_config")),
            (routing, "check_topk_args", named("check_topk_args")),
            (routing, "resolve_backend", named("resolve_backend (routing)")),
        ]
        with ExitStack() as stack:
            for owner, attr, key_of in targets:
                stack.enter_context(mock.patch.object(owner, attr, self.wrap(key_of, getattr(owner, attr))))
            yield self


def measure(preset: str, tokens: int, calls: int) -> dict:
    from detkit.bench.moe import PRESETS, make_inputs  # the benchmark's own inputs (uniform routing, seeded)
    from detkit.kernels.moe import moe_mlp_bwd, moe_mlp_fwd

    d = make_inputs(dataclasses.replace(PRESETS[preset], t=tokens), torch.device("cuda"))

    def call():
        out, saved = moe_mlp_fwd(d["x"], d["w1"], d["w2"], d["topk_ids"], d["scores"])
        moe_mlp_bwd(d["dout"], saved)

    def host_us_per_call() -> list[float]:  # each call started on an idle GPU, as the event timing does
        out = []
        for _ in range(calls):
            torch.cuda.synchronize()
            start = time.perf_counter()
            call()
            out.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
        return out

    for _ in range(5):
        call()
    plain = host_us_per_call()
    clock = HostClock()
    with clock.patched():
        wrapped = host_us_per_call()
    per_call = {k: {"us": clock.total[k] / calls * 1e6, "count": clock.count[k] / calls} for k in clock.total}
    return {"preset": preset, "T": tokens, "calls": calls, "host_call_us_plain": statistics.median(plain),
            "host_call_us_wrapped": statistics.median(wrapped), "per_call": per_call}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", default=None)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("detkit.bench.moe_host needs a CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "launch_floor_us": launch_floor_us(), "rows": []}
    print("launch floor (host µs per empty-kernel launch):", result["launch_floor_us"])
    from detkit.bench.moe import PRESETS

    unknown = [p for p in args.preset or [] if p not in PRESETS]
    if unknown:
        raise SystemExit(f"unknown preset(s) {unknown}; supported: {sorted(PRESETS)}")
    for preset in args.preset or ["reference"]:
        for tokens in args.tokens:
            row = measure(preset, tokens, args.calls)
            result["rows"].append(row)
            print(f"\n{preset} T={tokens}: host per call {row['host_call_us_plain']:.0f} µs plain, "
                  f"{row['host_call_us_wrapped']:.0f} µs wrapped")
            table = sorted(row["per_call"].items(), key=lambda kv: -kv[1]["us"])
            print(tabulate([(k, f"{v['us']:.1f}", f"{v['count']:.0f}") for k, v in table],
                           headers=["step", "µs per call", "calls per call"]))
    (args.out / "host.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
