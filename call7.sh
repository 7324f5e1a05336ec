#!/bin/bash
# s24 call 7: the FP8 up GEMM alone at decode sizes (Qwen3-30B-A3B widths, 128 experts, top-8, T = 8, 64, 512, and
# T = 8192 for reference) over the routing's bound, as the forward runs it: the pinned Gluon ws tile against Triton
# tiles (bits compared on the rows below P), median µs per call.
set -x
O=$OUT/call7; mkdir -p $O
nvidia-smi > $O/gpu.txt
python - > $O/up-decode.log 2>&1 <<'PY'
import json, os, torch
from detkit.kernels.det_gemm import GemmConfig
from detkit.kernels.fp8_quant import quantize_rowwise, quantize_weight
from detkit.kernels.moe_fp8_launch import moe_fp8_up_gemm
from detkit.kernels.moe_routing import launch_routing
from detkit.toolkit.contract import compare_bits
from detkit.toolkit.timing import time_interleaved

device = torch.device("cuda")
H, I, E, K = 2048, 768, 128, 8
gen = torch.Generator().manual_seed(0)
w1f = quantize_weight((torch.randn(E, H, 2 * I, generator=gen) * 0.02).to(device=device, dtype=torch.bfloat16))
configs = {"pinned ws 128x128x128 s4": None,
           "ws 64x128x128 w4 s6": GemmConfig(64, 128, 128, 1, 4, 6, "ws"),
           "tma 64x128x128 w4 s4": GemmConfig(64, 128, 128, 1, 4, 4, "tma"),
           "tma 64x128x128 w4 s3": GemmConfig(64, 128, 128, 1, 4, 3, "tma"),
           "tma 128x128x128 w8 s4": GemmConfig(128, 128, 128, 1, 8, 4, "tma"),
           "tma 64x256x128 w8 s3 (h quantized in the tile)": GemmConfig(64, 256, 128, 1, 8, 3, "tma"),
           "ptr 64x256x128 w8 s3 (h quantized in the tile)": GemmConfig(64, 256, 128, 1, 8, 3)}
rows = []
for t in (8, 64, 512, 8192):
    x = torch.randn(t, H, generator=gen).to(device=device, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)]).to(device=device, dtype=torch.int32)
    scores = torch.rand(t, K, generator=gen).to(device)
    pending = launch_routing(ids, scores, E)
    bound = pending.bound
    p = pending.finish().padded_rows
    x_q, x_s = quantize_rowwise(x)
    fns, ref = {}, None
    for name, cfg in configs.items():
        try:
            gu, h, _, _ = moe_fp8_up_gemm(x_q, x_s, w1f, bound, "cuda_sm90", config=cfg)
        except Exception as exc:
            rows.append({"T": t, "config": name, "error": repr(exc)[:300]}); print(t, name, repr(exc)[:200]); continue
        if ref is None:
            ref = (gu[:p].clone(), h[:p].clone())
        same = compare_bits(gu[:p], ref[0]).equal and compare_bits(h[:p], ref[1]).equal
        fns[name] = (lambda cfg=cfg: moe_fp8_up_gemm(x_q, x_s, w1f, bound, "cuda_sm90", config=cfg))
        rows.append({"T": t, "config": name, "bits_equal_pinned": same})
    timed = time_interleaved(fns, device, rounds=3, rep_ms=30)
    for r in rows:
        if r["T"] == t and r["config"] in timed:
            tm = timed[r["config"]]
            r.update(median_us=tm.median_us, p20_us=tm.p20_us, p80_us=tm.p80_us, sm_clock_mhz=tm.sm_clock_mhz)
            print(r, flush=True)
json.dump({"meta": {"commit": os.environ.get("DETKIT_GIT_COMMIT"), "H": H, "I": I, "E": E, "K": K}, "rows": rows},
          open(os.environ["OUT"] + "/call7/up-decode.json", "w"), indent=1)
PY
cd $OUT && tar czf call7.tgz call7
