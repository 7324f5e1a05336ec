#!/usr/bin/env bash
# Call 1 of reports/2026-12-07-*-s34 (one H100 or H200), in step limits that fit one device call:
# - GPU tests of gpt-oss's gate (contiguous pair loads and stores since s33) and the four attention variants tests
#   that s33's step limit cut, into $OUT/tests.log;
# - gpt-oss experts at T = 8192 against transformers' grouped_mm with the kernel profile (the gate's backward time),
#   into $OUT/experts.json;
# - grad_weight's TMA tile candidates at gpt-oss-20b widths, T = 8192, against torch._grouped_mm (CUDA-graph time;
#   every candidate's bits compared with the pinned tile's), into $OUT/wgrad.json;
# - the model bench at 8 layers for Llama-3 and Gemma-3 widths (issue #48 part 5's second depth), into
#   $OUT/<family>-L8 (the last is cut first if the call runs out of time).
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step tests 70 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra --junitxml "$OUT/tests.xml" \
  tests/test_grouped_gates.py tests/test_attention_variants.py -k "test_grouped_gates or head_dim_256_with_softcap \
or gpu_window_matches or do_not_cover or varlen_with_softcap"
step experts 90 python -m tools.experts_bench --device cuda --family gpt_oss --tokens 8192 --rounds 2 --profile \
  --json "$OUT/experts.json"
step wgrad 120 python -m tools.grouped_mm_bench --device cuda --model gpt-oss-20b --tokens 8192 --ops up_wgrad \
  --configs --variants tma --impls torch detkit --timings graph --rounds 2 --json "$OUT/wgrad.json"
for preset in llama3-8b gemma3-12b; do
  step "${preset%%-*}-L8" 100 python -m detkit bench model --device cuda --preset "$preset" --layers 8 \
    --out "$OUT/${preset%%-*}-L8"
done
exit "$failed"
