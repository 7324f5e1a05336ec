#!/usr/bin/env bash
# Call 1 of reports/2026-12-07-h200-s32 (one H100 or H200), in step limits that fit one device call:
# - FP32 det_gemm's Gluon FMA variant: its GPU tests (every candidate's bits = the pinned Triton FP32 tile's at
#   partial tiles, fwd / dA / dB, M 1..33 across the table's switch), into $OUT/fma-tests.log;
# - the model bench per family at 2 layers (tools/gpu/model_speed.sh: prefill, decode eager and captured,
#   forward+backward, generate against default mode on flash SDPA), into $OUT/speed.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
xdist=()
if python -c "import xdist" 2>/dev/null; then xdist=(-n 6); fi
step fma-tests 120 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra "${xdist[@]}" -m gpu \
  --junitxml "$OUT/fma-tests.xml" tests/test_det_gemm_fma.py
step speed 390 env OUT="$OUT/speed" ARCHIVE="$OUT/speed.tgz" FAMILIES="qwen3 llama3 mistral gemma3 gpt-oss qwen3-moe" \
  LAYERS=2 RUN_LIMIT=75 bash tools/gpu/model_speed.sh
exit "$failed"
