#!/usr/bin/env bash
# Call 3 of reports/2026-12-07-*-s34 (one H100 or H200): FP32 table 2026-12-07.1 (64-row FMA tiles at 17-64 rows,
# 8 warps at 65-128; TF32 on TMA tiles), in step limits that fit one device call:
# - the FP32 GPU tests (kernel file: every table pick's bits, batch invariance across the bands) into $OUT/tests.log;
# - `tools/gpu/fp32_gemm.sh bench`'s cases: fwd at the lm_heads and 4096 x 4096, M 1-4096, both precisions; dA and dB
#   of the lm_heads, into $OUT/bench-fwd and $OUT/bench-bwd.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
BENCH=(python -m tools.fp32_gemm_bench --device cuda --layouts linear --precision ieee tf32)
step bench-fwd 150 "${BENCH[@]}" --out "$OUT/bench-fwd" --ops fwd --kn 4096,151936 4096,128256 4096,4096 \
  --m 1 16 64 128 256 1024 4096
step bench-bwd 120 "${BENCH[@]}" --out "$OUT/bench-bwd" --ops da db --kn 4096,151936 4096,128256 --m 1 128 1024 4096
step tests 200 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra tests/test_det_gemm_fp32.py \
  tests/test_mode_fp32.py
exit "$failed"
