#!/usr/bin/env bash
# Call 1 of reports/2026-12-07-h200-s32 (one H100 or H200), in step limits that fit one device call:
# - FP32 det_gemm's Gluon FMA variant: its GPU tests (every candidate's bits = the pinned Triton FP32 tile's at
#   partial tiles, fwd / dA / dB, M 1..33 across the table's switch), into $OUT/fma-tests.log;
# - one eager decode step of Qwen3-8B widths, 4 layers, batch 1 on a 32768-key cache, in both modes under
#   torch.profiler (tools/decode_profile.py: the bench's 1.25x case taken apart), into $OUT/dprof;
# - transformers' experts classes at four families' widths, T = 8192, their own "grouped_mm" implementation against
#   the same module in detkit mode, forward and forward+backward (tools/experts_bench.py), into $OUT/experts.json
#   (each row printed to experts.log as it is measured).
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
xdist=()
if python -c "import xdist" 2>/dev/null; then xdist=(-n 6); fi
step fma-tests 90 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra "${xdist[@]}" -m gpu \
  --junitxml "$OUT/fma-tests.xml" tests/test_det_gemm_fma.py
step dprof 70 python -m tools.decode_profile --device cuda --preset qwen3-8b --layers 4 --batch 1 --cache-len 32768 \
  --steps 5 --out "$OUT/dprof"
step experts 130 python -m tools.experts_bench --device cuda --family gpt_oss --family qwen3_moe --family mixtral \
  --family deepseek_v3 --tokens 8192 --rounds 3 --json "$OUT/experts.json"
exit "$failed"
