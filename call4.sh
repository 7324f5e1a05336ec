#!/bin/bash
# s24 call 4: FP8 experts under CUDA graphs with static weights (batch_invariant_mode(fp8_graph_weights="static")):
# the mode's FP8 GPU tests, then one Qwen3-MoE block at Qwen3-30B-A3B widths (router + experts), T = 8, 64, 512
# tokens, timed as CUDA-graph replays and eagerly: BF16 experts, FP8 quantized in the graph, FP8 static weights.
set -x
O=$OUT/call4; mkdir -p $O
nvidia-smi > $O/gpu.txt
DETKIT_TEST_DEVICE=cuda timeout 200 python -m pytest -q -m gpu tests/test_mode_moe_fp8.py > $O/pytest.log 2>&1
python - > $O/decode.log 2>&1 <<'PY'
import json, os, torch
import detkit
from detkit.toolkit.timing import time_graphs, time_interleaved
from detkit.toolkit.env import capture_env
from tests.mode_moe_helpers import qwen3_30b_a3b_block

device = torch.device("cuda")
block = qwen3_30b_a3b_block(device, seed=0)
modes = {"bf16": dict(moe_experts="bf16"), "fp8_quantize": dict(moe_experts="fp8"),
         "fp8_static": dict(moe_experts="fp8", fp8_graph_weights="static")}
rows = []
for t in (8, 64, 512):
    x = torch.randn(1, t, 2048, device=device).to(torch.bfloat16)
    fns = {name: (lambda: block(x)) for name in modes}
    contexts = {name: (lambda kw=kw: detkit.batch_invariant_mode(strict=True, **kw)) for name, kw in modes.items()}
    with torch.no_grad():
        graph = time_graphs(fns, device, calls_per_fn=1, rounds=5, replays=20, contexts=contexts)
        eager = time_interleaved(fns, device, rounds=3, rep_ms=30, contexts=contexts)
    for name in modes:
        g, e = graph[name], eager[name]
        rows.append({"T": t, "experts": name, "graph_median_us": g.median_us, "graph_p20_us": g.p20_us,
                     "graph_p80_us": g.p80_us, "graph_sm_clock_mhz": g.sm_clock_mhz, "eager_median_us": e.median_us,
                     "eager_p20_us": e.p20_us, "eager_p80_us": e.p80_us})
        print(rows[-1], flush=True)
out = {"meta": {"what": "Qwen3-MoE block (Qwen3-30B-A3B widths: H 2048, 128 experts of 768, top-8, BF16, random "
                        "init) forward under detkit mode, no grad",
                "commit": os.environ.get("DETKIT_GIT_COMMIT"), "env": capture_env()}, "rows": rows}
open(os.environ["OUT"] + "/call4/decode.json", "w").write(json.dumps(out, indent=1, default=str))
PY
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >> $O/gpu.txt
cd $OUT && tar czf call4.tgz call4
