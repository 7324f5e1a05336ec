#!/usr/bin/env bash
# transformers' Qwen3-MoE block under the mode on one H200: the split gate/up views' tests on the GPU (the same bits as
# the layer's own layout through the sm_90 kernels and their fallbacks) and the mode's Qwen3-MoE tests; where the
# block spends its time (tools/moe_block_cost.py: the layer on its own layout, on transformers' storage with and
# without a copy, the mode's experts and router paths, the whole block, the stages); `detkit bench moe` for the BF16
# layer and the block (default and under the mode); then the layer's eager host path at small T (tools/moe_host.py,
# BF16 and FP8, with a cProfile). About 6-8 minutes.
#
#   OUT=/path/to/results tools/gpu/moe_block.sh   (ARCHIVE=... puts the refreshed .tgz elsewhere than $OUT.tgz)
#
# Writes $OUT/pytest-split.log (+ .xml), $OUT/pytest-mode-moe.log (+ .xml), $OUT/block-cost.log (+ .json),
# $OUT/bench-block/ (report.json, report.md) with $OUT/bench-block.log, $OUT/host-bf16.log (+ .json), $OUT/host-fp8.log (+ .json), $OUT/versions.txt
# and $OUT/steps.txt (each step's exit status: 0 passed, 124 stopped at its time limit). Exits non-zero if any step
# failed.
set -euo pipefail

: "${OUT:?set OUT to the folder for the results}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

step pytest-split "${MOE_SPLIT_TESTS_LIMIT:-120}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra \
  -p no:cacheprovider --junitxml "$OUT/pytest-split.xml" tests/test_moe.py -k "split or tma or ws or compile"
step pytest-mode-moe "${MOE_MODE_TESTS_LIMIT:-90}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra \
  -p no:cacheprovider --junitxml "$OUT/pytest-mode-moe.xml" tests/test_mode_moe.py
step block-cost "${MOE_BLOCK_COST_LIMIT:-200}" python -m tools.moe_block_cost --preset reference \
  --preset qwen3-30b-a3b --json "$OUT/block-cost.json"
step bench-block "${MOE_BENCH_BLOCK_LIMIT:-150}" python -m detkit bench moe --device cuda --preset reference \
  --preset qwen3-30b-a3b --impl bf16 --impl hf --impl hf_detkit --no-stages --rounds 3 --out "$OUT/bench-block"
step host-bf16 "${MOE_HOST_LIMIT:-60}" python -m tools.moe_host --device cuda --profile --json "$OUT/host-bf16.json"
step host-fp8 "${MOE_HOST_LIMIT:-60}" python -m tools.moe_host --device cuda --fp8 --profile \
  --json "$OUT/host-fp8.json"

exit "$failed"
