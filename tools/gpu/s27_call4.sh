#!/usr/bin/env bash
# Session call 4 (one H100/H200): every family's model bench at 2 layers, and Qwen3 / Gemma-3 / gpt-oss / Qwen3-MoE at
# 8, with default mode on SDPA's flash kernel (memory-efficient where flash cannot take the call: sliding-window
# masks, a captured step's mask, MLA) or transformers' eager attention (tools/gpu/model_speed.sh), into $OUT/speed.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step speed 330 env OUT="$OUT/speed" ARCHIVE="$OUT/speed.tgz" LAYERS=2 RUN_LIMIT=70 \
  FAMILIES="mistral gemma3 deepseek-v3 qwen3 llama3 gpt-oss qwen3-moe mixtral gemma2 glm4-moe qwen2.5 phi3 olmo2" \
  bash tools/gpu/model_speed.sh
step speed-deep 200 env OUT="$OUT/speed-deep" ARCHIVE="$OUT/speed-deep.tgz" LAYERS=8 RUN_LIMIT=70 \
  FAMILIES="qwen3 gemma3 gpt-oss" bash tools/gpu/model_speed.sh
exit "$failed"
