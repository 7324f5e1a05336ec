#!/usr/bin/env bash
# Call 1 of reports/2026-12-06-h100-s29 (one H100 or H200) on the tree that merges the attention launch plans and the
# MoE grouped tile order: the attention forward's host path and the launch plans' GPU tests
# (tools/gpu/attention_host.sh, with the MoE layer's GPU test) into $OUT/host; the grouped tile order's BF16 stage
# times and bits (tools/gpu/moe_raster.sh's BF16 step) into $OUT/raster; the tile order's sm_90 bit tests into
# $OUT/pytest-tile-order.xml.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step host 300 env OUT="$OUT/host" bash tools/gpu/attention_host.sh
step tile-order-tests 70 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra -p no:cacheprovider -m gpu \
  --junitxml "$OUT/pytest-tile-order.xml" tests/test_moe_tile_order.py
step raster 170 python -m tools.moe_tune --device cuda --preset mixtral-8x7b reference qwen3-30b-a3b \
  --stages up down dgrad dx --group-m 4 8 16 \
  --config BM128_BN256_BK64_G1_w8_s3_ws --config BM128_BN256_BK64_G8_w8_s3_ws \
  --rounds 2 --out "$OUT/raster"
exit "$failed"
