#!/usr/bin/env bash
# Call 2 of reports/2026-12-07-*-s35 (one H100 or H200):
# - `detkit bench attention`, every mode (prefill, decode, fwd+bwd against SDPA flash; the paged decode against the
#   contiguous one), into $OUT/attn-bench (ATTN_BENCH=0 leaves it out);
# - where the paged decode's time at batch 1 goes: CUDA-graph time of one decode step at Qwen3-8B heads on the padded
#   path (attention), the varlen path over the same keys packed (attention_varlen), and the paged path with pages of
#   16 and 256 (attention_paged's kernel), each on the split grid, at B1 1k / B1 8k / B8 1k, into $OUT/paged-probe.json;
# - the mode's own host time per routed op with the real kernels (tools/mode_overhead --device cuda), at a decode
#   step's rows, into $OUT/mode-overhead.json (MODE_OVERHEAD=0 leaves it out).
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
[[ ${ATTN_BENCH:-1} == 0 ]] || step attn-bench 170 python -m detkit bench attention --device cuda \
  --modes prefill,decode,fwd_bwd,paged_decode --out "$OUT/attn-bench"
step paged-probe 120 python - "$OUT/paged-probe.json" <<'PY'
import json, sys
import torch
from bench.attention import BenchCase, make_inputs, paged_call
from detkit.kernels.attention import attention
from detkit.kernels.attention.launch import Sequences, attention_fwd_launch, check_varlen
from detkit.kernels.attention.configs import select_configs
from detkit.toolkit.timing import time_graphs
dev = torch.device("cuda")
cfg = select_configs("cuda_sm90", 128)
rows = []
for batch, keys in ((1, 1024), (1, 8192), (8, 1024)):
    fns, outs = {}, {}
    for name, page in (("padded", None), ("varlen", None), ("paged16", 16), ("paged256", 256)):
        case = BenchCase("paged_decode" if page else "decode", batch, 1, keys, 32, 8, 128, seed=7, page_size=page)
        sets = make_inputs(case, dev, sets=4)
        calls = []
        for inp in sets:
            if page:
                calls.append(paged_call(case, inp))
            elif name == "padded":
                calls.append(lambda inp=inp: attention(inp["q"], inp["k"], inp["v"]))
            else:
                q = inp["q"][:, :, 0].contiguous()
                k = inp["k"].transpose(1, 2).reshape(batch * keys, 8, 128)
                v = inp["v"].transpose(1, 2).reshape(batch * keys, 8, 128)
                cu_q = torch.arange(batch + 1, dtype=torch.int32, device=dev)
                cu_k = cu_q * keys
                check_varlen(q, k, v, cu_q, cu_k, 1, keys)  # its host checks once, outside the graph
                seqs = Sequences(True, batch, 1, keys, cu_q, cu_k, None)
                calls.append(lambda q=q, k=k, v=v, s=seqs: attention_fwd_launch(q, k, v, s, 128 ** -0.5)[0])
        outs[name] = calls[0]().reshape(batch, 32, 128).float()
        fns[name] = lambda calls=calls: [c() for c in calls]
    ref = outs["padded"]
    same = {n: bool(torch.equal(o, ref)) for n, o in outs.items()}
    t = time_graphs(fns, dev, calls_per_fn=4, rounds=5, replays=10)
    row = {"batch": batch, "keys": keys, "same_bits_as_padded": same,
           **{f"{n}_us": t[n].median_us for n in fns}, **{f"{n}_p20_us": t[n].p20_us for n in fns},
           **{f"{n}_p80_us": t[n].p80_us for n in fns}}
    print(json.dumps(row), flush=True)
    rows.append(row)
json.dump({"configs": cfg.label(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
PY
[[ ${MODE_OVERHEAD:-1} == 0 ]] || step mode-overhead 90 python -m tools.mode_overhead --device cuda --m 8 \
  --json "$OUT/mode-overhead.json"
exit "$failed"
