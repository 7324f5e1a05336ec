"""Idle gaps between consecutive kernels of FP8 fwd_bwd (reference shape), with the kernels around each."""
import sys, time, torch
from torch.profiler import profile, ProfilerActivity
from bench.moe import make_inputs, PRESETS
from kernels.moe_fp8 import moe_mlp_fp8_bwd, moe_mlp_fp8_fwd
dev = torch.device("cuda")
p = PRESETS["reference"]
inp = make_inputs(p, dev)
x, w1, w2, ids, sc, dout = (inp[k] for k in ("x", "w1", "w2", "topk_ids", "scores", "dout"))
def f8():
    out, saved = moe_mlp_fp8_fwd(x, w1, w2, ids, sc, weight_cache=None)
    return moe_mlp_fp8_bwd(dout, saved, wgrad="bf16")
for _ in range(3): f8()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    for _ in range(2): f8()
    torch.cuda.synchronize()
ev = sorted([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA], key=lambda e: e.time_range.start)
for a, b in zip(ev, ev[1:]):
    gap = b.time_range.start - a.time_range.end
    print(f"{a.name[:40]:40s} {a.time_range.end - a.time_range.start:8.0f}  gap {gap:7.0f} -> {b.name[:40]}")
# Host time of each stage call (GPU idle before it: synchronize first)
from kernels.moe_fp8 import (quantize_rowwise, moe_fp8_up_swiglu, moe_fp8_down, moe_fp8_dgrad_dswiglu, moe_fp8_dx_route)
from kernels.fp8_quant import quantize_weight
from kernels.moe_routing import build_routing
from kernels.moe import moe_combine
out, saved = moe_mlp_fp8_fwd(x, w1, w2, ids, sc, weight_cache=None)
r, b = saved.routing, saved.backend
xq, xs = quantize_rowwise(x)
dq, ds_ = quantize_rowwise(dout)
calls = {"build_routing": lambda: build_routing(ids, sc, p.e), "quantize_weight": lambda: quantize_weight(w1),
         "quantize_rowwise": lambda: quantize_rowwise(x),
         "up": lambda: moe_fp8_up_swiglu(xq, xs, saved.w1f, r, b),
         "down": lambda: moe_fp8_down(saved.h_q, saved.h_s, saved.w2f, r, b),
         "dgrad": lambda: moe_fp8_dgrad_dswiglu(dq, ds_, saved.w2f, saved.gu, r, b),
         "combine": lambda: moe_combine(saved.y, r, sc, b)}
for name, fn in calls.items():
    for _ in range(2): fn()
    ts = []
    for _ in range(5):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); ts.append((time.perf_counter() - t0) * 1e6)
    print(f"host {name}: {sorted(ts)[2]:.0f} us")
