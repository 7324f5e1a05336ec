#!/usr/bin/env bash
# Session call 2 (one H100/H200): the family matrix -- with its serving check, not run on a GPU before -- for Qwen3,
# Mistral (sliding window under continuous batching), Gemma-2 (softcap, sliding), gpt-oss (sinks, sliding, grouped
# experts) and Qwen3-MoE into $OUT/families; then DeepSeek-V3's model bench at 2 layers (its attention now reads
# MLA's head dims in place at inference) into $OUT/speed.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step families 400 env OUT="$OUT/families" ARCHIVE="$OUT/families.tgz" FAMILY_LIMIT=90 \
  FAMILIES="qwen3 mistral gemma2 gpt-oss qwen3-moe" bash tools/gpu/model_families.sh
step speed 150 env OUT="$OUT/speed" ARCHIVE="$OUT/speed.tgz" LAYERS=2 RUN_LIMIT=120 FAMILIES="deepseek-v3" \
  bash tools/gpu/model_speed.sh
exit "$failed"
