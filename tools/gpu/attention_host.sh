#!/usr/bin/env bash
# The attention forward's host path on one Hopper GPU (H100 or H200), about 3 minutes (step limits sum to 310 s): per
# decode call at Qwen3-8B's attention (batch 1 and 8, 1k and 32k keys), host time until queued, eager time and GPU
# time of the mode's SDPA route, of the forward launcher on each grid through its launch plans and through Triton's own
# launch (plans=False), and of torch's SDPA (tools/attention_host.py); a cProfile of the route; then the launch plans'
# tests (the attention kernels through the plans against Triton's own launch and the prefill's bits at changing
# lengths, packed, paged and backward; det_gemm's raw launches) and the MoE layer's GPU test (its kernels launch
# through the same PlannedKernel).
# Everything lands under $OUT: versions.txt, steps.txt, <step>.log, attention-host.json, pytest-*.xml.
# Usage: OUT=/path/to/results bash tools/gpu/attention_host.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the results folder}"

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

step host "${HOST_LIMIT:-90}" python -m tools.attention_host --device cuda --json "$OUT/attention-host.json"
step profile "${PROFILE_LIMIT:-40}" python -m tools.attention_host --device cuda --rounds 3 --profile
step pytest-plans "${PLANS_TESTS_LIMIT:-120}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra -p no:cacheprovider \
  --junitxml "$OUT/pytest-plans.xml" tests/test_attention_plans.py tests/test_planned_kernel.py tests/test_raw_launch.py
step pytest-moe "${MOE_TESTS_LIMIT:-60}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra -p no:cacheprovider -m gpu \
  --junitxml "$OUT/pytest-moe.xml" tests/test_moe.py
echo "== $(date -u +%H:%M:%S) finished (failed=$failed)"
exit "$failed"
