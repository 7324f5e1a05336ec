#!/usr/bin/env bash
# Call 5 of reports/2026-12-06-h100-s29 (one H100 or H200): the TP and DP code paths at world size 1 against the plain
# model again (the profile of call 3 found the same device time for the TP path and the plain model), into
# $OUT/world1.json; the family matrix with its serving check for Gemma-3 (sliding windows), gpt-oss (sinks, sliding,
# grouped experts) and Qwen3-MoE, into $OUT/families.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step world1 150 env DETKIT_TEST_DEVICE=cuda DETKIT_MODEL_PARALLEL_OUT="$OUT/world1.json" \
  python -m pytest -q -p no:cacheprovider -ra tests/test_mode_parallel.py -k world1
step families 230 env OUT="$OUT/families" ARCHIVE="$OUT/families.tgz" FAMILY_LIMIT=70 \
  FAMILIES="gemma3 gpt-oss qwen3-moe" bash tools/gpu/model_families.sh
exit "$failed"
