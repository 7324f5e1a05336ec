#!/usr/bin/env bash
# Call 1 of reports/2026-12-06-h100-s31 (one H100 or H200), in step limits that fit one device call:
# - key splits sized by each row's own key extent (attention table 2026-12-06.4): the attention GPU tests (split-KV
#   across the tier bounds, paged, the pinned tiles) into $OUT/attn-tests.log; the decode sweep over the pinned tiers,
#   a step to 1024-key splits from 8k keys and one 512-key split for every row (the former table) at the pinned 64x64
#   tile, bits and CUDA-graph time beside SDPA flash, into $OUT/dsweep;
# - FP32 det_gemm's Gluon FMA variant: its candidates beside the pinned tile and torch.matmul, each one's bits compared
#   with the pinned tile's (tools/gpu/fp32_fma.sh's warm and bench steps; its GPU tests left for a later call), into
#   $OUT/fma.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
grid=(--grid "split_tiers=2048:256/16384:512/1024,2048:256/8192:512/1024,512" --grid block_m=64 --grid block_n=64
      --grid num_warps=4 --grid num_stages=3 --grid split_heads_below=0)
step warm 80 python -m tools.attention_decode_sweep warm --head-dims 128 --workers 14 "${grid[@]}"
step attn-tests 130 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra -p no:cacheprovider -m gpu \
  --junitxml "$OUT/attn-tests.xml" tests/test_attention_split_kv.py tests/test_attention_paged.py tests/test_attention.py
step dsweep 110 python -m tools.attention_decode_sweep sweep --device cuda --head-dims 128 --out "$OUT/dsweep" \
  --budget-s 85 --finalists 1 "${grid[@]}"
fma=(--device cuda --out "$OUT/fma" --ops fwd da --kn "4096,151936" "4096,4096" --m 64 256 1024 4096 --layouts linear
     --precision ieee --fma --rounds 2)
step fma-warm 60 python -m tools.fp32_gemm_bench "${fma[@]}" --warm 14 --warm-only
step fma-bench 100 python -m tools.fp32_gemm_bench "${fma[@]}"
exit "$failed"
