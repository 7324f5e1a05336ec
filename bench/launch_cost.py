"""What one Triton launch costs the host, step by step, for detkit's own MoE kernels.

bench/moe_host.py found launches of the routing and grouped-GEMM kernels taking 50-100 µs of host time
inside a MoE call, against 15-25 µs for an empty kernel launched in a tight loop. This separates, for a
real launch of ``moe_route_hist_kernel`` and of the up-projection's TMA grouped GEMM:

- ``launch``: the whole ``kernel[grid](...)`` call;
- ``binder``: Triton's argument specialization (``binder(*args, **kwargs)``) alone;
- ``cache_key``: ``compute_cache_key`` on the binder's result;
- ``direct``: ``CompiledKernel.run`` on the cached compiled kernel (what is left when the Python
  launch path is skipped);

each in a tight loop ("hot") and as the first host work after a ``torch.cuda.synchronize`` that waited
on a 2 ms GPU kernel ("after sync"), and the same for a pure-Python check (``check_moe_inputs``) and
``torch.empty`` to tell launch cost from a host that is slow after a wait.

    python -m detkit.bench.launch_cost --out DIR

A CUDA device is required.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tabulate import tabulate


def _sleep_kernel_ms(ms: float) -> None:
    torch.cuda._sleep(int(ms * 1e6 * 1.98))  # cycles at ~1.98 GHz


def timed(fn, reps: int, after_sync: bool) -> float:
    """Median host µs of ``fn()``: back to back, or each first after a sync on a 2 ms GPU wait."""
    out = []
    for _ in range(reps):
        if after_sync:
            _sleep_kernel_ms(2.0)
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def launch_parts(jit_fn, grid, args, kwargs) -> dict:
    """Callables for each part of one launch of ``jit_fn[grid](*args, **kwargs)``."""
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import compute_cache_key

    kernel = jit_fn[grid](*args, **kwargs)  # compiles (or loads) and launches once
    device = driver.active.get_current_device()
    kernel_cache, kernel_key_cache, _target, _backend, binder = jit_fn.device_caches[device]
    full = dict(kwargs, debug=jit_fn.debug or knobs.runtime.debug,
                instrumentation_mode=knobs.compilation.instrumentation_mode)
    bound, spec, options = binder(*args, **full)
    stream = driver.active.get_current_stream(device)
    values = list(bound.values())
    g = tuple(grid) + (1,) * (3 - len(grid))

    def direct():
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None,
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)

    return {
        "launch": lambda: jit_fn[grid](*args, **kwargs),
        "binder": lambda: binder(*args, **full),
        "cache_key": lambda: compute_cache_key(kernel_key_cache, spec, options),
        "direct": direct,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("detkit.bench.launch_cost needs a CUDA device")
    import triton

    import detkit.kernels.moe as moe
    import detkit.kernels.moe_routing as routing
    from detkit.bench.moe import PRESETS, make_inputs

    d = make_inputs(PRESETS["reference"], torch.device("cuda"))
    x, w1, w2, ids, scores = d["x"], d["w1"], d["w2"], d["topk_ids"], d["scores"]
    r = routing.build_routing(ids, scores, w1.shape[0])
    routes, experts = ids.numel(), w1.shape[0]
    chunks = triton.cdiv(routes, routing.ROUTE_BLOCK)
    width = experts + routing.NUM_CHECKS
    hist = torch.empty((chunks, width), dtype=torch.int32, device="cuda")
    hist_call = (routing.moe_route_hist_kernel, (chunks,),
                 (ids, scores, hist, routes, ids.shape[1], experts, width, *ids.stride(), *scores.stride()),
                 dict(BLOCK=routing.ROUTE_BLOCK, EXPERT_BLOCK=routing.EXPERT_BLOCK, num_warps=4))

    # The up GEMM's launch, captured from the library's own call (arguments exactly as it passes them).
    captured = {}
    real = moe.moe_grouped_gemm_tma_kernel

    class Capture:
        def __getitem__(self, grid):
            def launch(*a, **k):
                captured.update(grid=grid, args=a, kwargs=k)
                return real[grid](*a, **k)
            return launch

    moe.moe_grouped_gemm_tma_kernel = Capture()
    try:
        moe.moe_up_swiglu(x, w1, r, "cuda_sm90")
    finally:
        moe.moe_grouped_gemm_tma_kernel = real
    up_call = (real, captured["grid"], captured["args"], captured["kwargs"])

    cases = {}
    launches = {"moe_route_hist_kernel": hist_call, "moe_grouped_gemm_tma_kernel (up)": up_call}
    for name, (fn, grid, a, k) in launches.items():
        for part, call in launch_parts(fn, grid, a, k).items():
            cases[f"{name}: {part}"] = call
    cases["check_moe_inputs"] = lambda: moe.check_moe_inputs(x, w1, w2, ids, scores)
    cases["torch.empty"] = lambda: torch.empty((routes,), dtype=torch.int32, device="cuda")
    cases["weight_descriptor"] = lambda: moe.weight_descriptor(w1, 128, 64)
    cases["table_moe_config"] = lambda: moe.table_moe_config("up", "cuda_sm90", w1)

    rows = []
    for name, call in cases.items():
        rows.append({"step": name, "hot_us": timed(call, args.reps, False),
                     "after_sync_us": timed(call, max(20, args.reps // 5), True)})
    print(tabulate([(r["step"], f"{r['hot_us']:.1f}", f"{r['after_sync_us']:.1f}") for r in rows],
                   headers=["step", "hot µs (median)", "after sync µs (median)"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "launch_cost.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
