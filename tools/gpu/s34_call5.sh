#!/usr/bin/env bash
# Call 5 of reports/2026-12-07-*-s34 (one H100 or H200): the "tf32" dA (M >= 1024) and dB as forward products
# (kernels/det_gemm/launch.py), in step limits that fit one device call:
# - the FP32 kernel GPU tests (the forward products against the direct kernels' bits among them) into $OUT/tests.log;
# - `tools/gpu/fp32_gemm.sh bench`'s backward cases at "tf32": dA and dB of the lm_heads, M 1-4096, into
#   $OUT/bench-bwd.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step bench-bwd 90 python -m tools.fp32_gemm_bench --device cuda --layouts linear --precision tf32 \
  --out "$OUT/bench-bwd" --ops da db --kn 4096,151936 4096,128256 --m 1 128 1024 4096
XDIST=()
if python -c "import xdist" 2>/dev/null; then XDIST=(-n 4); fi
step tests 170 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra "${XDIST[@]}" \
  tests/test_det_gemm_fp32.py
exit "$failed"
