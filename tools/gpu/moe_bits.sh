#!/usr/bin/env bash
# The MoE layers on one H200: the GPU-only tests of the BF16 and FP8 layers (-m gpu: the Gluon kernels against the
# Triton tiles' bits for every stage, both weight layouts, main_grad and padding rows; the FP8 precision gate and
# per-stage bounds at GPU shapes; a TMA launch on autograd's backward thread) and the moe / moe-fp8 audits on cuda,
# whose pass counts are compared with the committed reports. The tests that also run on the CPU interpreter are CI's.
# About 4-5 minutes (time limits: 260 s for the tests, 100 s for the audits).
#
#   OUT=/path/to/results tools/gpu/moe_bits.sh
#
# Writes $OUT/pytest-moe.log (+ pytest-moe.xml), $OUT/audit-moe/ (rows.jsonl, report.json, report.md) with
# $OUT/audit-moe.log, $OUT/versions.txt and $OUT/steps.txt (each step's exit status: 0 passed, 124 stopped at its
# time limit).
# Exits non-zero if any step failed.
set -euo pipefail

: "${OUT:?set OUT to the folder for the results}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

step pytest-moe 260 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra -p no:cacheprovider -m gpu \
  --junitxml "$OUT/pytest-moe.xml" \
  tests/test_moe.py tests/test_moe_ws.py tests/test_moe_fp8.py tests/test_moe_fp8_ws.py
step audit-moe 100 python -m detkit audit --device cuda --suite moe --suite moe-fp8 --no-progress --out "$OUT/audit-moe"

exit "$failed"
