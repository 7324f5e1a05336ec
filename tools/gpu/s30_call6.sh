#!/usr/bin/env bash
# Call 6 of reports/2026-12-06-h100-s30 (one H100 or H200): the FP8 experts' layer choice by shape on the GPU (its GPU
# test) into $OUT/fp8-choice.log; FP32 det_gemm's re-pinned M <= 16 table against torch.matmul at the lm_head
# (fwd and dA, K 4096 x N 151936, nn.Linear's layout, M 1-16) into $OUT/fp32-pins.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step fp8-choice 100 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra -m gpu \
  tests/test_mode_moe_fp8.py -k "pick_the_layer"
step fp32-pins 150 python -m tools.fp32_gemm_bench --device cuda --out "$OUT/fp32-pins" --ops fwd da \
  --kn 4096,151936 --m 1 2 4 8 16 --layouts linear --precision ieee
exit "$failed"
