#!/usr/bin/env bash
# The per-family layout on one Hopper GPU: every `gpu`-marked test of every kernel family and of detkit mode, one
# step per family so a failure names its room. Each step has a time limit; the run goes on after a failure and exits
# non-zero if any step failed. Everything lands under $OUT: versions.txt, steps.txt, <step>.log.
# Usage: OUT=/path/to/results bash tools/gpu/house.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the results folder}"

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt
gpu_pytest=(env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra -m gpu)
step det_gemm "${GEMM_LIMIT:-150}" "${gpu_pytest[@]}" tests/test_det_gemm.py tests/test_raw_launch.py
step attention "${ATTN_LIMIT:-120}" "${gpu_pytest[@]}" tests/test_attention.py
step moe "${MOE_LIMIT:-200}" "${gpu_pytest[@]}" tests/test_moe.py tests/test_moe_ws.py tests/test_moe_nosync.py \
  tests/test_moe_fp8.py tests/test_moe_fp8_ws.py
step mode "${MODE_LIMIT:-150}" "${gpu_pytest[@]}" tests/test_mode_compile.py tests/test_mode_moe.py \
  tests/test_mode_moe_fp8.py
echo "== $(date -u +%H:%M:%S) finished (failed=$failed)"
exit "$failed"
