#!/usr/bin/env bash
# Session call 3 (one H100/H200): fixed-size split-KV attention on hardware (its GPU tests: both grids bitwise,
# decode = prefill = chunked across 512-key splits, the FP64 bounds; the mode's attention tests), the attention bench
# against SDPA flash (prefill, decode, fwd+bwd), then the experts route's tests after their mending and its bench.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step attention-tests 210 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra -p no:cacheprovider -k "not offline" \
  tests/test_attention_split_kv.py tests/test_attention.py tests/test_attention_variants.py \
  tests/test_mode_attention.py tests/test_mode_attention_variants.py
pack
step attention-bench 130 python -m detkit bench attention --device cuda --modes prefill,decode,fwd_bwd \
  --out "$OUT/attention-bench"
pack
step experts-tests 100 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra -p no:cacheprovider \
  tests/test_mode_experts.py
pack
step experts-bench 120 python -m tools.experts_bench --device cuda --json "$OUT/experts.json"
pack
exit "$failed"
