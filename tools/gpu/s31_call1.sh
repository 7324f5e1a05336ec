#!/usr/bin/env bash
# Call 1 of reports/2026-12-06-h100-s31 (one H100 or H200): the grouped GEMM family's TMA variant against its pointer
# kernels and torch._grouped_mm (tools/gpu/grouped_tma.sh: its GPU tests, then the bench at four MoE widths, T 2048 /
# 8192 / 16384, both weight layouts) into $OUT/gtma; FP32 det_gemm's Gluon FMA variant (tools/gpu/fp32_fma.sh: its GPU
# tests, then its candidates beside the pinned tile and torch.matmul) into $OUT/fma. Step limits keep both within one
# device call.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step gtma 260 env OUT="$OUT/gtma" GROUPED_TMA_TESTS_LIMIT=90 GROUPED_GPU_TESTS_LIMIT=45 GROUPED_TMA_BENCH_LIMIT=120 \
  bash tools/gpu/grouped_tma.sh
step fma 270 env OUT="$OUT/fma" FMA_WARM_LIMIT=60 FMA_TESTS_LIMIT=100 FMA_BENCH_LIMIT=100 bash tools/gpu/fp32_fma.sh
exit "$failed"
