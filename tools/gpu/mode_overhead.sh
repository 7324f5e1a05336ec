#!/usr/bin/env bash
# The batch-invariant mode's host time per call on one H200, about 2 minutes: for each routed op (Linear fwd / dA / dB,
# addmm, bmm, RMSNorm's row mean, SDPA and transformers' attention for a decode query), microseconds per call of
# torch's op outside the mode, of the detkit calls the mode makes (called directly), and of the op inside the mode,
# with the real kernels on CUDA BF16 (Python time until the launch is queued); at M = 1 (a decode step) and M = 16.
# Then a cProfile of a tiny transformers Qwen3 decode step in the mode, and the mode's eager GPU tests (the row
# mean's direct launch on CUDA, the routed GEMMs' bits).
# Everything lands under $OUT: versions.txt, steps.txt, <step>.log, overhead-m1.json, overhead-m16.json.
# Usage: OUT=/path/to/results bash tools/gpu/mode_overhead.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the results folder}"

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

step overhead-m1 "${OVERHEAD_LIMIT:-45}" python -m tools.mode_overhead --device cuda --m 1 --json "$OUT/overhead-m1.json"
step overhead-m16 "${OVERHEAD_LIMIT:-45}" python -m tools.mode_overhead --device cuda --m 16 --rounds 9 \
  --json "$OUT/overhead-m16.json"
step profile "${PROFILE_LIMIT:-30}" python -m tools.mode_overhead --device cuda --rounds 1 --calls 10 --profile \
  --profile-top 40
step pytest-mode "${MODE_TESTS_LIMIT:-60}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra \
  tests/test_mode.py
echo "== $(date -u +%H:%M:%S) finished (failed=$failed)"
exit "$failed"
