#!/usr/bin/env bash
# transformers' Qwen3-MoE block under the mode at small T on one H200, where the model audit's block rows are slower
# than transformers' block: where the GPU time goes at a prefill's T=2048 (tools/moe_block_cost.py --tokens 2048 at
# Qwen3-30B-A3B widths), and the block's host path in inference at decode (T=8) and prefill (T=2048), BF16 and FP8
# experts (tools/moe_host.py --block --profile: host time per call, kernels per call, cProfile, torch.profiler's
# host-side ops). About 3 minutes.
#
#   OUT=/path/to/results tools/gpu/moe_small_t.sh   (ARCHIVE=... puts the refreshed .tgz elsewhere than $OUT.tgz)
#
# Writes $OUT/block-cost-2048.log (+ .json), $OUT/host-block-{bf16,fp8}-t{8,2048}.log (+ .json), $OUT/versions.txt
# and $OUT/steps.txt. Exits non-zero if any step failed.
set -euo pipefail

: "${OUT:?set OUT to the folder for the results}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

step block-cost-2048 "${MOE_SMALL_T_COST_LIMIT:-100}" python -m tools.moe_block_cost --preset qwen3-30b-a3b \
  --tokens 2048 --json "$OUT/block-cost-2048.json"
for t in 8 2048; do
  step "host-block-bf16-t$t" "${MOE_SMALL_T_HOST_LIMIT:-40}" python -m tools.moe_host --device cuda --block \
    --shape "$t" 2048 768 128 8 --profile --json "$OUT/host-block-bf16-t$t.json"
  step "host-block-fp8-t$t" "${MOE_SMALL_T_HOST_LIMIT:-40}" python -m tools.moe_host --device cuda --block --fp8 \
    --shape "$t" 2048 768 128 8 --profile --json "$OUT/host-block-fp8-t$t.json"
done

exit "$failed"
