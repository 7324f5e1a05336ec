#!/usr/bin/env bash
# Call 3 of reports/2026-12-07-*-s36 (one H100 or H200), the attention table 2026-12-07.1:
# - the paged attention tests on the GPU (with paged_early_pages), into $OUT/tests.log;
# - the paged decode step with the cache cold in L2, as `detkit bench attention` times it (as many input sets as
#   twice the L2 holds): one table entry a key, one a page (the table's), and one a page with the first tile's entries
#   read before the sequence's bounds (paged_early_pages), pages of 16 and 256 keys, the padded contiguous decode
#   beside them, CUDA-graph time at Qwen3-8B heads, B1 1k / B1 8k / B8 8k / B1 32k, each path's bits against the
#   padded path's, into $OUT/early-pages.json.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step tests 150 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra --junitxml "$OUT/tests.xml" \
  tests/test_attention_paged.py
step early-pages 240 python - "$OUT/early-pages.json" <<'PY'
import dataclasses, json, sys
import torch
from bench.attention import BenchCase, _graph_sets, make_inputs, paged_call
from detkit.kernels.attention import attention
from detkit.kernels.attention.configs import select_configs
from detkit.toolkit.timing import time_graphs
dev = torch.device("cuda")
pinned = select_configs("cuda_sm90", 128)
variants = {"per_key": dataclasses.replace(pinned, paged_tile_page=False), "tile_page": pinned,
            "early": dataclasses.replace(pinned, paged_early_pages=True)}
rows = []
for batch, keys in ((1, 1024), (1, 8192), (8, 8192), (1, 32768)):
    fns, outs = {}, {}
    base = BenchCase("decode", batch, 1, keys, 32, 8, 128, seed=7)
    n = _graph_sets(base)
    sets = make_inputs(base, dev, sets=n)
    calls = [lambda inp=inp: attention(inp["q"], inp["k"], inp["v"]) for inp in sets]
    outs["padded"] = calls[0]().reshape(batch, 32, 128).float()
    fns["padded"] = lambda calls=calls: [c() for c in calls]
    for page in (16, 256):
        case = BenchCase("paged_decode", batch, 1, keys, 32, 8, 128, seed=7, page_size=page)
        psets = make_inputs(case, dev, sets=n)
        for vname, cfg in variants.items():
            name = f"paged{page}_{vname}"
            pcalls = [paged_call(case, inp, configs=cfg) for inp in psets]
            outs[name] = pcalls[0]().reshape(batch, 32, 128).float()
            fns[name] = lambda pcalls=pcalls: [c() for c in pcalls]
        del psets
    ref = outs["padded"]
    same = {k: bool(torch.equal(o, ref)) for k, o in outs.items()}
    t = time_graphs(fns, dev, calls_per_fn=n, rounds=5, replays=10)
    row = {"batch": batch, "keys": keys, "sets": n, "same_bits_as_padded": same,
           **{f"{k}_us": t[k].median_us for k in fns}, **{f"{k}_p20_us": t[k].p20_us for k in fns},
           **{f"{k}_p80_us": t[k].p80_us for k in fns}}
    print(json.dumps(row), flush=True)
    rows.append(row)
json.dump({"configs": {k: c.label() for k, c in variants.items()}, "rows": rows}, open(sys.argv[1], "w"), indent=1)
PY
exit "$failed"
