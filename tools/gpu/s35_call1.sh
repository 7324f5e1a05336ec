#!/usr/bin/env bash
# Call 1 of reports/2026-12-07-*-s35 (one H100 or H200), in step limits that fit one device call:
# - the paged attention GPU tests and the paged / split-grid bits tests on the GPU (the table's paged stages, and the
#   split grid with runs of splits on paged K/V), into $OUT/tests.log;
# - the decode sweep at D=128 over the paged forward's stages (3, 5, 6) and split grouping (off, on), every other
#   field at the pinned entry: each candidate's bits against its prefill, CUDA-graph time beside SDPA flash, the paged
#   decode at B1 1k and B1/B8 x 8k/32k, into $OUT/sweep/;
# - `detkit bench attention` decode and paged decode (paged against the contiguous decode) with the pinned table,
#   into $OUT/attn-bench.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step tests 120 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra --junitxml "$OUT/tests.xml" \
  tests/test_attention_paged.py
grid=(--grid block_m=64 --grid block_n=64 --grid num_warps=4 --grid num_stages=3 --grid split_heads_below=0
      --grid split_grid_below=264 --grid split_tiers=2048:256/16384:512/1024 --grid "paged_num_stages=3,5,6"
      --grid "paged_grouped=0,1")
mkdir -p "$OUT/sweep"
step warm 100 python -m tools.attention_decode_sweep warm --head-dims 128 --workers 15 "${grid[@]}"
step sweep 200 python -m tools.attention_decode_sweep sweep --device cuda --head-dims 128 --out "$OUT/sweep" \
  --budget-s 170 --finalists 0 "${grid[@]}"
step attn-bench 150 python -m detkit bench attention --device cuda --modes decode,paged_decode \
  --out "$OUT/attn-bench"
exit "$failed"
