#!/usr/bin/env bash
# Call 2 of reports/2026-12-07-*-s33 (one H100 or H200), in step limits that fit one device call:
# - grad_weight's TMA tile candidates at gpt-oss-20b widths, T = 8192, against torch._grouped_mm (CUDA-graph time;
#   every candidate's bits compared with the pinned tile's), into $OUT/wgrad.json;
# - the model bench at 8 layers (issue #48 part 5's second depth) for Qwen3, Llama-3, Mistral and Gemma-3 widths, into
#   $OUT/<family>-L8 (in that order: the last ones are cut first if the call runs out of time).
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step wgrad 120 python -m tools.grouped_mm_bench --device cuda --model gpt-oss-20b --tokens 8192 --ops up_wgrad \
  --configs --variants tma --impls torch detkit --timings graph --rounds 2 --json "$OUT/wgrad.json"
for preset in qwen3-8b llama3-8b mistral-7b gemma3-12b; do
  step "${preset%%-*}-L8" 100 python -m detkit bench model --device cuda --preset "$preset" --layers 8 \
    --out "$OUT/${preset%%-*}-L8"
done
exit "$failed"
