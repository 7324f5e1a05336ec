#!/usr/bin/env bash
# Call 1 of reports/2026-12-08-*-s39 (one H100 or H200), the paged decode with each key tile's table entries read one
# tile ahead (AttnConfigs.paged_prefetch_pages), issue #50 part 5:
# - tests: the paged attention tests on the GPU (prefetch paths included), into $OUT/tests.log;
# - decompose + ncu: tools/gpu/paged_decode_decompose.sh (the pinned paged paths and the prefetch ones beside the
#   padded contiguous step, CUDA graphs, cold L2; Nsight Compute on pages of 16 with and without prefetch);
# - warm + sweep: tools.attention_decode_sweep over the pinned D=128 tile with paged_num_stages 0/4 x prefetch 0/1
#   (decode, prefill and paged decode shapes beside SDPA flash), into $OUT/decode_sweep.{json,md}.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
grid=(--grid split_tiers=2048:256/16384:512/1024 --grid block_m=64 --grid block_n=64 --grid num_warps=4
  --grid num_stages=3 --grid split_heads_below=0 --grid split_grid_below=264 --grid 'paged_num_stages=0,4'
  --grid 'paged_prefetch_pages=0,1')
step tests 120 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra --junitxml "$OUT/tests.xml" \
  tests/test_attention_paged.py tests/test_attention_host_values.py
OUT=$OUT/decomp NCU_PATHS="paged16 paged16_prefetch" NCU_LIMIT_S=40 DECOMPOSE_LIMIT_S=160 \
  bash tools/gpu/paged_decode_decompose.sh || failed=1
step warm 80 python -m tools.attention_decode_sweep warm --head-dims 128 "${grid[@]}" --workers "$(( $(nproc) - 1 ))"
step sweep 150 python -m tools.attention_decode_sweep sweep --device cuda --head-dims 128 "${grid[@]}" --out "$OUT" \
  --budget-s 120 --finalists 0
exit "$failed"
