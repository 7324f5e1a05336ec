#!/usr/bin/env bash
# transformers' continuous batching (generate_batch, eager steps) in default mode, in detkit mode, and in detkit mode
# reading the length tensors at every attention call (tools/serving_speed.py), on one H100 or H200: Qwen3-8B widths,
# 4 layers, 8 requests of 256-512 prompt tokens, 32 new tokens each; then 32 requests. Into $OUT/<run>/.
#   OUT=results/serving bash tools/gpu/serving_speed.sh
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step serving-8x512 "${SERVING_LIMIT_S:-200}" python -m tools.serving_speed --out "$OUT/serving-8x512"
step serving-32x256 "${SERVING_LIMIT_S:-200}" python -m tools.serving_speed --requests 32 --prompt-len 256 \
  --out "$OUT/serving-32x256"
exit "$failed"
