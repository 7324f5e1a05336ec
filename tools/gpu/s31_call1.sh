#!/usr/bin/env bash
# Call 1 of reports/2026-12-06-h100-s31 (one H100 or H200): the grouped GEMM family's TMA variant against its pointer
# kernels and torch._grouped_mm (tools/gpu/grouped_tma.sh: its GPU tests, then the bench at four MoE widths, T 2048 /
# 8192 / 16384, both weight layouts) into $OUT/gtma; `detkit bench moe` (tools/gpu/moe_bench.sh: the presets and the
# FP8 vs BF16 sweep with the MFU fit) into $OUT/moe.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step gtma 290 env OUT="$OUT/gtma" bash tools/gpu/grouped_tma.sh
step moe 290 env OUT="$OUT/moe" bash tools/gpu/moe_bench.sh
exit "$failed"
