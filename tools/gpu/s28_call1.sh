#!/usr/bin/env bash
# Session call 1 (one H100/H200): the BF16 MoE stages' tile sweep at Mixtral-8x7B widths (tools/moe_tune.py: the
# experts route was 0.87x transformers' grouped_mm there), then the family matrix -- with its serving check, not run
# on a GPU before -- for Qwen3, Mistral (sliding window under continuous batching), Gemma-2 (softcap, sliding),
# gpt-oss (sinks, sliding, grouped experts) and Qwen3-MoE, into $OUT/families.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step mixtral-tune 200 python -m tools.moe_tune --device cuda --preset mixtral-8x7b --stages up down dgrad dx \
  --rounds 2 --out "$OUT/mixtral-tune"
step families 380 env OUT="$OUT/families" ARCHIVE="$OUT/families.tgz" FAMILY_LIMIT=90 \
  FAMILIES="qwen3 mistral gemma2 gpt-oss qwen3-moe" bash tools/gpu/model_families.sh
exit "$failed"
