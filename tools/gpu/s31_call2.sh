#!/usr/bin/env bash
# Call 2 of reports/2026-12-06-h100-s31 (one H100 or H200): the grouped GEMM family's TMA variant against its pointer
# kernels and torch._grouped_mm (tools/gpu/grouped_tma.sh: its GPU tests, then the bench at four MoE widths, T 2048 /
# 8192 / 16384, both weight layouts) into $OUT/gtma; the model bench's long-cache decode at Qwen3-8B widths, 4
# layers, on attention table 2026-12-06.4, into $OUT/speed.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step gtma 270 env OUT="$OUT/gtma" GROUPED_TMA_TESTS_LIMIT=90 GROUPED_GPU_TESTS_LIMIT=45 GROUPED_TMA_BENCH_LIMIT=130 \
  bash tools/gpu/grouped_tma.sh
step speed 130 env OUT="$OUT/speed" ARCHIVE="$OUT/speed.tgz" FAMILIES=qwen3 LAYERS=4 RUN_LIMIT=110 \
  DECODE_AT="1x32768 8x32768" bash tools/gpu/model_speed.sh
exit "$failed"
