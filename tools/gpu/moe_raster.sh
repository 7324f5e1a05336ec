#!/usr/bin/env bash
# The grouped tile order (GROUP_M, kernels/moe/tile_order.py) of the MoE grouped GEMMs on one H100: tools/moe_tune.py
# times each stage's pinned tile in bands of 4, 8 and 16 row tiles beside the pinned one (GROUP_M 1, row-major), and
# checks each has the pinned bits -- BF16 up, down, dgrad, dX at Mixtral-8x7B (where row-major re-reads each expert's
# W1 once per row tile), the reference shape and Qwen3-30B-A3B, with dX's 128x256 ws tile at GROUP_M 1 and 8; then
# the FP8 stages at Mixtral-8x7B and the reference shape. Under 5 minutes (compiles dominate; each stage's rows land
# in its rows.jsonl as it finishes, so a step stopped at its limit keeps what it timed).
#
#   OUT=/path/to/results tools/gpu/moe_raster.sh   (ARCHIVE=... puts the refreshed .tgz elsewhere than $OUT.tgz)
#
# Writes $OUT/bf16/ and $OUT/fp8/ (rows.jsonl, and once complete rows.json and report.md) with $OUT/bf16.log and
# $OUT/fp8.log, $OUT/versions.txt and $OUT/steps.txt (each step's exit status: 0 done, 124 stopped at its time
# limit). Exits non-zero if any step failed.
set -euo pipefail

: "${OUT:?set OUT to the folder for the results}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

group_ms=(4 8 16)
# dX's 128x256 warp-specialized tile (faster than the pinned 128x128 at Mixtral-8x7B) in both orders; up and dgrad
# refuse it by name (shared memory), down's pick is this tile.
dx_wide=(--config BM128_BN256_BK64_G1_w8_s3_ws --config BM128_BN256_BK64_G8_w8_s3_ws)

step bf16 "${MOE_RASTER_BF16_LIMIT:-170}" python -m tools.moe_tune --device cuda \
  --preset mixtral-8x7b reference qwen3-30b-a3b --stages up down dgrad dx \
  --group-m "${group_ms[@]}" "${dx_wide[@]}" --rounds 2 --out "$OUT/bf16"
step fp8 "${MOE_RASTER_FP8_LIMIT:-110}" python -m tools.moe_tune --device cuda \
  --preset mixtral-8x7b reference --stages fp8_up fp8_down fp8_dgrad fp8_dx \
  --group-m "${group_ms[@]}" --rounds 2 --out "$OUT/fp8"

exit "$failed"
