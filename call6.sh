#!/bin/bash
# s24 call 6: where a decode-size forward of one Qwen3-MoE block (Qwen3-30B-A3B widths) spends its GPU time,
# BF16 experts vs FP8 experts with cached weights: every kernel of 10 eager forwards (torch.profiler), µs per call.
set -x
O=$OUT/call6; mkdir -p $O
nvidia-smi > $O/gpu.txt
python - > $O/decode-kernels.log 2>&1 <<'PY'
import json, os, torch
from collections import defaultdict
import detkit
from tests.mode_moe_helpers import qwen3_30b_a3b_block

device = torch.device("cuda")
block = qwen3_30b_a3b_block(device, seed=0)
out = {}
for t in (8, 64):
    x = torch.randn(1, t, 2048, device=device).to(torch.bfloat16)
    for experts in ("bf16", "fp8"):
        with torch.no_grad(), detkit.batch_invariant_mode(strict=True, moe_experts=experts):
            for _ in range(3):
                block(x)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    block(x)
                torch.cuda.synchronize()
        per = defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name][0] += 1
                per[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        rows = sorted(((k, n / 10, us / 10) for k, (n, us) in per.items()), key=lambda r: -r[2])
        out[f"T={t} {experts}"] = rows
        print(f"== T={t} {experts}: {sum(r[2] for r in rows):.1f} µs of kernels per call")
        for k, n, us in rows:
            print(f"  {us:8.1f} µs  x{n:4.1f}  {k[:110]}")
json.dump(out, open(os.environ["OUT"] + "/call6/decode-kernels.json", "w"), indent=1)
PY
cd $OUT && tar czf call6.tgz call6
