#!/usr/bin/env bash
# Call 1 of reports/2026-12-07-*-s37 (one H100 or H200), the attention table 2026-12-07.2: where the paged decode's
# time over the contiguous decode goes at batch 1 (issue #50 part 5).
# - decompose: CUDA-graph time of the decode step, cache cold in L2 as `detkit bench attention` times it, Qwen3-8B
#   heads, B1 1k / B1 8k / B8 8k / B1 32k, for paths that add one difference at a time: the padded contiguous cache
#   (no bounds read), the same with kv_end (a bounds read), the packed varlen cache [Tk, Hkv, D] (cu_seqlens and
#   the paged storage's row stride, no table), the paged cache with pages of 256 and of 16 (the table), and SDPA
#   flash; each detkit path's bits against the padded path's; into $OUT/decompose.json;
# - ncu: Nsight Compute (clocks left alone, caches flushed per kernel) on one call of each path at B1 1k and B1 8k,
#   one process per path: duration, DRAM bytes and throughput, occupancy and the warp stall reasons of every kernel,
#   raw CSV per path under $OUT/ncu.
# Environment (defaults: everything above): DECOMPOSE_CASES ("1x1024 1x8192": batch x keys), NCU_PATHS (paths to
# profile), DECOMPOSE_LIMIT_S and NCU_LIMIT_S (each step's time limit).
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
mkdir -p "$OUT/ncu"
cat > "$OUT/paths.py" <<'PY'
"""The decode paths this call compares, on one case's inputs (imported by both steps)."""
import math
import os

import torch

from bench.attention import BenchCase, make_inputs, paged_call, sdpa_call
from detkit.kernels.attention import attention
from detkit.kernels.attention.launch import Sequences, attention_fwd_launch

PATHS = ("padded", "padded_kv_end", "varlen", "paged256", "paged16", "flash")
CASES = tuple(tuple(int(v) for v in c.split("x")) for c in
              os.environ.get("DECOMPOSE_CASES", "1x1024 1x8192 8x8192 1x32768").split())  # batch x keys


def path_calls(batch: int, keys: int, dev: torch.device, sets: int) -> dict:
    """path -> one call per input set (each a capturable decode step on its own operands)."""
    base = BenchCase("decode", batch, 1, keys, 32, 8, 128, seed=7)
    inputs = make_inputs(base, dev, sets=sets)
    scale = 1.0 / math.sqrt(128)
    calls = {p: [] for p in PATHS}
    for inp in inputs:
        q, k, v = inp["q"], inp["k"], inp["v"]
        kv_end = torch.full((batch,), keys, dtype=torch.int32, device=dev)
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        cu_k = cu_q * keys
        packed = [t.transpose(1, 2).reshape(batch * keys, 8, 128).contiguous() for t in (k, v)]
        seqs = Sequences(True, batch, 1, keys, cu_q, cu_k)
        calls["padded"].append(lambda q=q, k=k, v=v: attention(q, k, v))
        calls["padded_kv_end"].append(lambda q=q, k=k, v=v, e=kv_end: attention(q, k, v, kv_end=e))
        calls["varlen"].append(lambda q=q[:, :, 0], k=packed[0], v=packed[1], s=seqs:
                               attention_fwd_launch(q, k, v, s, scale, None)[0])
        calls["flash"].append(sdpa_call(base, inp, "native"))
    del inputs
    for page in (256, 16):
        case = BenchCase("paged_decode", batch, 1, keys, 32, 8, 128, seed=7, page_size=page)
        calls[f"paged{page}"] = [paged_call(case, inp) for inp in make_inputs(case, dev, sets=sets)]
    return calls
PY
step decompose "${DECOMPOSE_LIMIT_S:-240}" python - "$OUT" <<'PY'
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from paths import CASES, PATHS, path_calls
from bench.attention import BenchCase, _graph_sets
from detkit.toolkit.timing import time_graphs
dev = torch.device("cuda")
rows = []
for batch, keys in CASES:
    n = _graph_sets(BenchCase("decode", batch, 1, keys, 32, 8, 128))
    calls = path_calls(batch, keys, dev, n)
    outs = {p: c[0]().reshape(batch, 32, 128).float() for p, c in calls.items()}
    same = {p: bool(torch.equal(o, outs["padded"])) for p, o in outs.items() if p != "flash"}
    fns = {p: (lambda cs=cs: [c() for c in cs]) for p, cs in calls.items()}
    t = time_graphs(fns, dev, calls_per_fn=n, rounds=5, replays=10)
    row = {"batch": batch, "keys": keys, "sets": n, "same_bits_as_padded": same,
           **{f"{p}_us": t[p].median_us for p in PATHS}, **{f"{p}_p20_us": t[p].p20_us for p in PATHS},
           **{f"{p}_p80_us": t[p].p80_us for p in PATHS},
           **{f"{p}_over_padded": t[p].median_us / t["padded"].median_us for p in PATHS}}
    print(json.dumps(row), flush=True)
    rows.append(row)
    del calls, outs, fns
    torch.cuda.empty_cache()
json.dump({"paths": PATHS, "rows": rows}, open(f"{sys.argv[1]}/decompose.json", "w"), indent=1)
PY
cat > "$OUT/ncu_one.py" <<'PY'
"""One path, profiled: warm up at B1 1k and B1 8k, then one call of each inside the NVTX range 'ncu'."""
import sys
sys.path.insert(0, sys.argv[1])
import torch
from paths import path_calls
from detkit.toolkit.nvtx_ranges import nvtx_range
dev = torch.device("cuda")
calls = [path_calls(1, keys, dev, 1)[sys.argv[2]][0] for keys in (1024, 8192)]
for c in calls:
    for _ in range(3):
        c()
torch.cuda.synchronize()
with nvtx_range("ncu"):
    for c in calls:
        c()
    torch.cuda.synchronize()
PY
ncu_bin=$(command -v ncu || find /opt/nvidia/nsight-compute -maxdepth 2 -name ncu -type f 2>/dev/null | sort | head -1 || true)
cat > "$OUT/ncu_all.sh" <<'SH'
# ncu_all.sh NCU OUT: one ncu process per path.
for path in ${NCU_PATHS:-padded padded_kv_end varlen paged256 paged16 flash}; do
  "$1" --clock-control none --nvtx --nvtx-include 'detkit@ncu/' --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats --section Occupancy \
    --csv --page raw python "$2/ncu_one.py" "$2" "$path" > "$2/ncu/$path.csv" 2> "$2/ncu/$path.err" \
    || echo "ncu $path rc=$?"
done
SH
if [[ -n $ncu_bin ]]; then
  step ncu "${NCU_LIMIT_S:-200}" bash "$OUT/ncu_all.sh" "$ncu_bin" "$OUT"
else
  echo "ncu not found" | tee "$OUT/ncu/missing.txt"
fi
exit "$failed"
