#!/usr/bin/env bash
# Call 2 of reports/2026-12-07-*-s36 (one H100 or H200), the attention table 2026-12-07.1 (the paged forward reads one
# table entry a page a key tile touches):
# - the paged attention tests on the GPU, into $OUT/tests.log;
# - one table entry a page (paged_tile_page) against one a key, pages of 16 (four a key tile) and 256 keys: CUDA-graph
#   time of one decode step at Qwen3-8B heads, the padded contiguous path beside it, at B1 1k / B1 8k / B8 8k /
#   B1 32k, each path's bits against the padded path's, into $OUT/tile-page.json;
# - `detkit bench attention` decode and paged decode (paged against the contiguous decode), into $OUT/attn-bench.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step tests 150 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra --junitxml "$OUT/tests.xml" \
  tests/test_attention_paged.py
step tile-page 200 python - "$OUT/tile-page.json" <<'PY'
import dataclasses, json, sys
import torch
from bench.attention import BenchCase, make_inputs, paged_call
from detkit.kernels.attention import attention
from detkit.kernels.attention.configs import select_configs
from detkit.toolkit.timing import time_graphs
dev = torch.device("cuda")
pinned = select_configs("cuda_sm90", 128)
variants = {"per_key": dataclasses.replace(pinned, paged_tile_page=False), "tile_page": pinned}
rows = []
for batch, keys in ((1, 1024), (1, 8192), (8, 8192), (1, 32768)):
    fns, outs = {}, {}
    base = BenchCase("decode", batch, 1, keys, 32, 8, 128, seed=7)
    sets = make_inputs(base, dev, sets=4)
    calls = [lambda inp=inp: attention(inp["q"], inp["k"], inp["v"]) for inp in sets]
    outs["padded"] = calls[0]().reshape(batch, 32, 128).float()
    fns["padded"] = lambda calls=calls: [c() for c in calls]
    for page in (16, 256):
        case = BenchCase("paged_decode", batch, 1, keys, 32, 8, 128, seed=7, page_size=page)
        psets = make_inputs(case, dev, sets=4)
        for vname, cfg in variants.items():
            name = f"paged{page}_{vname}"
            pcalls = [paged_call(case, inp, configs=cfg) for inp in psets]
            outs[name] = pcalls[0]().reshape(batch, 32, 128).float()
            fns[name] = lambda pcalls=pcalls: [c() for c in pcalls]
    ref = outs["padded"]
    same = {n: bool(torch.equal(o, ref)) for n, o in outs.items()}
    t = time_graphs(fns, dev, calls_per_fn=4, rounds=5, replays=10)
    row = {"batch": batch, "keys": keys, "same_bits_as_padded": same,
           **{f"{n}_us": t[n].median_us for n in fns}, **{f"{n}_p20_us": t[n].p20_us for n in fns},
           **{f"{n}_p80_us": t[n].p80_us for n in fns}}
    print(json.dumps(row), flush=True)
    rows.append(row)
json.dump({"configs": {n: c.label() for n, c in variants.items()}, "rows": rows}, open(sys.argv[1], "w"), indent=1)
PY
step attn-bench 170 python -m detkit bench attention --device cuda --modes decode,paged_decode --out "$OUT/attn-bench"
exit "$failed"
