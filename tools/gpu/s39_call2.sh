#!/usr/bin/env bash
# Call 2 of reports/2026-12-08-*-s39 (one H100 or H200), the eager decode step with transformers' RMSNorm fused in
# detkit mode (issues #48 / #50 part 5):
# - dp-1x32k: tools.decode_profile at Qwen3-8B widths, 4 layers, batch 1, 32k cache: default mode, detkit mode, and
#   detkit mode with transformers' RMSNorm and rotary on their own ops (--unfused);
# - the model bench at 8 layers (tools/gpu/model_speed.sh) for $FAMILIES (default: qwen3 llama3 gemma3), into
#   $OUT/speed.md: prefill, decode eager and under a CUDA graph, forward+backward, generate against default mode.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step dp-1x32k 100 python -m tools.decode_profile --device cuda --preset qwen3-8b --layers 4 --batch 1 \
  --cache-len 32768 --steps 10 --unfused --out "$OUT/dp-1x32k"
FAMILIES=${FAMILIES:-qwen3 llama3 gemma3} LAYERS=8 OUT=$OUT/models bash tools/gpu/model_speed.sh || failed=1
exit "$failed"
