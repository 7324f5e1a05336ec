#!/usr/bin/env bash
# Session call 2 (one H100/H200): the attention decode sweep at D=128 (tools/gpu/attention_decode_sweep.sh: split size,
# forward tiles, grids) into $OUT/dsweep; the TP and DP code paths at world size 1 against the plain model (the TP
# path's Linears now on their local tensors) into $OUT/world1.json; the family matrix -- with its serving check, not run
# on a GPU before -- for Qwen3 and Mistral (sliding window under continuous batching) into $OUT/families.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step dsweep 280 env OUT="$OUT/dsweep" ARCHIVE="$OUT/dsweep.tgz" bash tools/gpu/attention_decode_sweep.sh
step world1 150 env DETKIT_TEST_DEVICE=cuda DETKIT_MODEL_PARALLEL_OUT="$OUT/world1.json" \
  python -m pytest -q -p no:cacheprovider -ra tests/test_mode_parallel.py -k world1
step families 150 env OUT="$OUT/families" ARCHIVE="$OUT/families.tgz" FAMILY_LIMIT=70 FAMILIES="qwen3 mistral" \
  bash tools/gpu/model_families.sh
exit "$failed"
