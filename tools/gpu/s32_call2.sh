#!/usr/bin/env bash
# Call 2 of reports/2026-12-07-h200-s32 (one H100 or H200), in step limits that fit one device call:
# - the model bench per family at 2 layers (tools/gpu/model_speed.sh: prefill, decode eager and captured,
#   forward+backward, generate against default mode on flash SDPA), into $OUT/speed;
# - the grouped GEMM's pinned table (grouped table 3) against torch._grouped_mm at gpt-oss-20b, DeepSeek-V3 (scaled)
#   and Qwen3-30B-A3B widths, T 2048 / 8192, both weight layouts, CUDA-graph time, into $OUT/grouped.json.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step speed 330 env OUT="$OUT/speed" ARCHIVE="$OUT/speed.tgz" FAMILIES="qwen3 llama3 mistral gemma3 gpt-oss" \
  LAYERS=2 RUN_LIMIT=70 bash tools/gpu/model_speed.sh
step grouped 140 python -m tools.grouped_mm_bench --device cuda --model gpt-oss-20b --model deepseek-v3-scaled \
  --model qwen3-30b-a3b --tokens 2048 8192 --weights transposed kn --impls torch detkit --timings graph --rounds 2 \
  --replays 10 --json "$OUT/grouped.json"
exit "$failed"
