#!/usr/bin/env bash
# Call 5 of reports/2026-12-06-h100-s30 (one H100 or H200): the attention decode sweep over smaller key splits (128 and
# 256 beside the pinned 512, and 1024) at the pinned 64x64 tile, 4 warps, 2 or 3 stages (head_dim 128, Qwen3-8B
# heads), bits and CUDA-graph time beside SDPA flash, the two best also at fwd+bwd, into $OUT/dsweep.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
grid=(--grid "split_n=128,256,512,1024" --grid block_m=64 --grid block_n=64 --grid num_warps=4 --grid "num_stages=2,3"
      --grid split_heads_below=0)
step warm 120 python -m tools.attention_decode_sweep warm --head-dims 128 --workers 12 "${grid[@]}"
step dsweep 240 python -m tools.attention_decode_sweep sweep --device cuda --head-dims 128 --out "$OUT/dsweep" \
  --budget-s 180 --finalists 2 "${grid[@]}"
exit "$failed"
