#!/usr/bin/env bash
# Session call 4 (one H100/H200): after the day's merges -- the attention decode rows with the eager split-grid
# threshold, the experts route's tests, continuous batching and the DP routes' GPU tests, and the model bench
# (Qwen3 8B widths, 2 layers: prefill, decode eager and under a CUDA graph, forward+backward against default mode).
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step decode-bench 80 python -m detkit bench attention --device cuda --modes decode --out "$OUT/decode-bench"
pack
step tests 200 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra -p no:cacheprovider tests/test_mode_experts.py \
  tests/test_mode_continuous_batching.py tests/test_index_sum.py tests/test_attention_split_kv.py \
  -k "not offline and (family_and_layout or continuous or batch or index_sum or default_path or gpu)"
pack
step model-bench 150 python -m detkit bench model --device cuda --out "$OUT/model-bench"
pack
exit "$failed"
