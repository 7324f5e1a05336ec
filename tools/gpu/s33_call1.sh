#!/usr/bin/env bash
# Call 1 of reports/2026-12-07-*-s33 (one H100 or H200), in step limits that fit one device call:
# - GPU tests of this tree's new kernels against their references: the mask -> key windows kernels
#   (kernels/attention/masks.py) with the attention variants' window and mask tests, gpt-oss's gate and the grouped
#   path's route combine (kernels/grouped/gates.py, combine.py), into $OUT/tests.log;
# - the model bench at 2 layers for the two sliding-window families (Mistral first, Gemma-3 last), whose decode steps
#   read a mask on every layer, into $OUT/<family>-L2;
# - gpt-oss experts at T = 8192 against transformers' grouped_mm (the grouped path with the fused gate and combine),
#   with the top GPU kernels of one forward+backward per impl, into $OUT/experts.json.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step tests 60 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra --junitxml "$OUT/tests.xml" \
  tests/test_attention_masks.py tests/test_grouped_gates.py tests/test_grouped_combine.py \
  tests/test_attention_variants.py -k "not test_attention_variants or mask or window or sliding"
step mistral 70 python -m detkit bench model --device cuda --preset mistral-7b --layers 2 --out "$OUT/mistral-L2"
step experts 90 python -m tools.experts_bench --device cuda --family gpt_oss --tokens 8192 --rounds 2 --profile \
  --json "$OUT/experts.json"
step gemma3 70 python -m detkit bench model --device cuda --preset gemma3-12b --layers 2 --out "$OUT/gemma3-L2"
exit "$failed"
