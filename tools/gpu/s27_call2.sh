#!/usr/bin/env bash
# Session call 2 (one H100/H200): MLA (value head dim != query/key head dim, zero-padded) and the paged-KV forward on
# hardware -- their GPU tests, the paged decode against the contiguous decode (bench attention), DeepSeek-V3's row of
# the family matrix (MLA now on the kernel), and the model bench for DeepSeek-V3 and Qwen3 at 2 layers.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step tests 170 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra -p no:cacheprovider tests/test_attention_mla.py \
  tests/test_attention_paged.py -k "not offline"
step paged-bench 100 python -m detkit bench attention --device cuda --modes paged_decode --out "$OUT/paged-bench"
step deepseek-matrix 110 env DETKIT_MODEL_CONFIG=deepseek-v3 python -m detkit audit --device cuda --suite model \
  --out "$OUT/deepseek-matrix"
step speed-deepseek 80 python -m detkit bench model --device cuda --preset deepseek-v3-scaled --out "$OUT/deepseek-L2"
exit "$failed"
