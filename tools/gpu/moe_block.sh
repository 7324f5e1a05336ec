#!/usr/bin/env bash
# Where transformers' Qwen3-MoE block spends its time under the mode on one H200 (tools/moe_block_cost.py: the layer on
# its own layout and on transformers' storage, the interleave copy, the mode's experts and router paths, the whole
# block, and the stages on both layouts), then the layer's eager host path at small T (tools/moe_host.py, BF16 and
# FP8, with a cProfile). About 3-4 minutes.
#
#   OUT=/path/to/results tools/gpu/moe_block.sh
#
# Writes $OUT/block-cost.log (+ .json), $OUT/host-bf16.log (+ .json), $OUT/host-fp8.log (+ .json), $OUT/versions.txt
# and $OUT/steps.txt (each step's exit status: 0 passed, 124 stopped at its time limit). Exits non-zero if any step
# failed.
set -euo pipefail

: "${OUT:?set OUT to the folder for the results}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

step block-cost "${MOE_BLOCK_COST_LIMIT:-200}" python -m tools.moe_block_cost --preset reference \
  --preset qwen3-30b-a3b --json "$OUT/block-cost.json"
step host-bf16 "${MOE_HOST_LIMIT:-60}" python -m tools.moe_host --device cuda --profile --json "$OUT/host-bf16.json"
step host-fp8 "${MOE_HOST_LIMIT:-60}" python -m tools.moe_host --device cuda --fp8 --profile \
  --json "$OUT/host-fp8.json"

exit "$failed"
