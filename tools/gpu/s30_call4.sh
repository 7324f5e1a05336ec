#!/usr/bin/env bash
# Call 4 of reports/2026-12-06-h100-s30 (one H100 or H200): FP32 det_gemm at M <= 16 on the small-M kernel: its GPU
# tests (the tile path's bits) and its candidates against torch.matmul (tools/gpu/fp32_gemm.sh gemv), into $OUT/fp32.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step fp32 400 env OUT="$OUT/fp32" bash tools/gpu/fp32_gemm.sh gemv
exit "$failed"
