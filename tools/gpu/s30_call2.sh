#!/usr/bin/env bash
# Call 2 of reports/2026-12-06-h100-s30 (one H100 or H200): the TP and DP code paths at world size 1 against the plain
# model with torch's TP hooks standing aside under the mode, into $OUT/world1.json; the family matrix with its serving
# check for Gemma-2, Mixtral and GLM-4-MoE widths, into $OUT/families.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step world1 150 env DETKIT_TEST_DEVICE=cuda DETKIT_MODEL_PARALLEL_OUT="$OUT/world1.json" \
  python -m pytest -q -p no:cacheprovider -ra tests/test_mode_parallel.py -k world1
step families 260 env OUT="$OUT/families" ARCHIVE="$OUT/families.tgz" FAMILY_LIMIT=80 \
  FAMILIES="gemma2 mixtral glm4-moe" bash tools/gpu/model_families.sh
exit "$failed"
