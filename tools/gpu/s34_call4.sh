#!/usr/bin/env bash
# Call 4 of reports/2026-12-07-*-s34 (one H100 or H200), in step limits that fit one device call:
# - tools/tf32_operand_probe.py at the lm_head 4096 x 151936, M 128 / 1024 / 4096: the "tf32" dA and dB as det_gemm
#   runs them against the transposed product whose strided operand is the MMA's A, into $OUT/probe.json;
# - the FP32 GPU tests: the kernel file (the small-M rows test now taking the FMA tile as its 24-row reference) and
#   the FMA kernel's file (every fma candidate's bits, the 64-row ones new), into $OUT/tests.log, $OUT/fma-tests.log.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step probe 150 python -m tools.tf32_operand_probe --device cuda --kn 4096,151936 --m 128 1024 4096 --rounds 3 \
  --json "$OUT/probe.json"
XDIST=()
if python -c "import xdist" 2>/dev/null; then XDIST=(-n 4); fi
step tests 150 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra "${XDIST[@]}" \
  tests/test_det_gemm_fp32.py
step fma-tests 120 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra "${XDIST[@]}" -m gpu \
  tests/test_det_gemm_fma.py
exit "$failed"
