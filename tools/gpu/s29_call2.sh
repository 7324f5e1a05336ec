#!/usr/bin/env bash
# Call 2 of reports/2026-12-06-h100-s29 (one H100 or H200) on the same tree as call 1: the attention decode sweep's
# first 8 candidates at D=128 (the pinned entry on the grouped split grid, then the ungrouped pinned entry, then 6
# more) into $OUT/dsweep; the model bench at Qwen3-8B widths, 4 layers, with the long-cache decode points of issue #50
# part 5 (1x32768, 8x32768), into $OUT/speed.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step dsweep 200 python -m tools.attention_decode_sweep sweep --device cuda --head-dims 128 --out "$OUT/dsweep" \
  --budget-s 150 --limit 8 --finalists 2
step speed 320 env OUT="$OUT/speed" ARCHIVE="$OUT/speed.tgz" FAMILIES=qwen3 LAYERS=4 RUN_LIMIT=250 \
  DECODE_AT="1x32768 8x32768" bash tools/gpu/model_speed.sh
exit "$failed"
