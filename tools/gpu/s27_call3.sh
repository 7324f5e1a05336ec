#!/usr/bin/env bash
# Session call 3 (one H100/H200): the paged decode against the contiguous decode (bench attention), DeepSeek-V3's row
# of the family matrix (MLA on the kernel), then the model bench of every family at 2 layers (tools/gpu/model_speed.sh,
# default mode on flash SDPA (memory-efficient where flash cannot) / transformers' eager attention), into $OUT/speed.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step paged-bench 100 python -m detkit bench attention --device cuda --modes paged_decode --out "$OUT/paged-bench"
step deepseek-matrix 110 env DETKIT_MODEL_CONFIG=deepseek-v3 python -m detkit audit --device cuda --suite model \
  --out "$OUT/deepseek-matrix"
step speed 420 env OUT="$OUT/speed" ARCHIVE="$OUT/speed.tgz" LAYERS=2 RUN_LIMIT=80 \
  FAMILIES="deepseek-v3 qwen3 llama3 gemma3 gpt-oss qwen3-moe mixtral mistral gemma2 glm4-moe qwen2.5 phi3 olmo2" \
  bash tools/gpu/model_speed.sh
exit "$failed"
