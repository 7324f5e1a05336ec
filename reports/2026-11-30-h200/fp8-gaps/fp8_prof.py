"""Kernel-level attribution of one FP8 fwd_bwd (reference shape) with torch.profiler."""
import sys, torch
from torch.profiler import profile, ProfilerActivity
from bench.moe import make_inputs, PRESETS
from kernels.moe_fp8 import moe_mlp_fp8_bwd, moe_mlp_fp8_fwd
from kernels.moe import moe_mlp_fwd, moe_mlp_bwd
dev = torch.device("cuda")
p = PRESETS[sys.argv[1] if len(sys.argv) > 1 else "reference"]
inp = make_inputs(p, dev)
x, w1, w2, ids, sc, dout = (inp[k] for k in ("x", "w1", "w2", "topk_ids", "scores", "dout"))
def f8():
    out, saved = moe_mlp_fp8_fwd(x, w1, w2, ids, sc, weight_cache=None)
    return moe_mlp_fp8_bwd(dout, saved, wgrad="bf16")
for _ in range(3): f8()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    for _ in range(3): f8()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
ev = sorted([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA], key=lambda e: e.time_range.start)
busy = sum(e.time_range.end - e.time_range.start for e in ev)
span = ev[-1].time_range.end - ev[0].time_range.start
print(f"kernels {len(ev)}; busy {busy/3:.0f} us per iter; span {span/3:.0f} us per iter")
def b16():
    out, saved = moe_mlp_fwd(x, w1, w2, ids, sc)
    return moe_mlp_bwd(dout, saved)
for _ in range(3): b16()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3): b16()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
ev = sorted([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA], key=lambda e: e.time_range.start)
busy = sum(e.time_range.end - e.time_range.start for e in ev)
span = ev[-1].time_range.end - ev[0].time_range.start
print(f"BF16 kernels {len(ev)}; busy {busy/3:.0f} us per iter; span {span/3:.0f} us per iter")
