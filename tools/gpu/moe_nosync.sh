#!/usr/bin/env bash
# The MoE layers without host synchronization on one H200: every MoE GPU test (-m gpu: the Gluon kernels against the
# Triton tiles' bits, the FP8 precision gate, and tests/test_moe_nosync.py's forward+backward of moe_mlp and
# moe_mlp_fp8 captured in a CUDA graph, replayed on new inputs and compared bitwise with eager calls, and a refused
# batch poisoning the sm_90 kernels' outputs); tests/test_moe_nosync.py's other tests on cuda (no device-to-host
# read in the forward or backward, bound vs exact-P bits, poisoning and the error flags, the validating mode); then
# the moe and moe-fp8 audits on cuda (the same bits: all rows must pass). About 3-4 minutes.
#
#   OUT=/path/to/results tools/gpu/moe_nosync.sh
#
# Writes $OUT/pytest-moe-gpu.log (+ .xml), $OUT/pytest-nosync-cuda.log (+ .xml), $OUT/audit-moe/ (rows.jsonl,
# report.json, report.md) with $OUT/audit-moe.log, $OUT/versions.txt and $OUT/steps.txt (each step's exit status:
# 0 passed, 124 stopped at its time limit). Exits non-zero if any step failed.
set -euo pipefail

: "${OUT:?set OUT to the folder for the results}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

step pytest-moe-gpu 120 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra -p no:cacheprovider -m gpu \
  --junitxml "$OUT/pytest-moe-gpu.xml" \
  tests/test_moe_nosync.py tests/test_moe.py tests/test_moe_ws.py tests/test_moe_fp8.py tests/test_moe_fp8_ws.py
step pytest-nosync-cuda 40 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra -p no:cacheprovider -m "not gpu" \
  --junitxml "$OUT/pytest-nosync-cuda.xml" tests/test_moe_nosync.py
step audit-moe 100 python -m detkit audit --device cuda --suite moe --suite moe-fp8 --no-progress --out "$OUT/audit-moe"

exit "$failed"
