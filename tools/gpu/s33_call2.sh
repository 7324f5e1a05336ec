#!/usr/bin/env bash
# Call 2 of reports/2026-12-07-*-s33 (one H100 or H200), in step limits that fit one device call:
# - gpt-oss and Mixtral experts at T = 8192 against transformers' grouped_mm, with the top GPU kernels of one
#   forward+backward per impl (tools/experts_bench.py --profile), into $OUT/experts.json;
# - grad_weight's TMA tile candidates at gpt-oss-20b widths, T = 8192, against torch._grouped_mm (CUDA-graph time;
#   every candidate's bits compared with the pinned tile's), into $OUT/wgrad.json;
# - the model bench at 8 layers for Qwen3 and Llama-3 widths (issue #48 part 5's second depth), into $OUT/<family>-L8.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step experts 200 python -m tools.experts_bench --device cuda --family gpt_oss --family mixtral --tokens 8192 \
  --rounds 3 --profile --json "$OUT/experts.json"
step wgrad 150 python -m tools.grouped_mm_bench --device cuda --model gpt-oss-20b --tokens 8192 --ops up_wgrad \
  --configs --variants tma --impls torch detkit --timings graph --rounds 2 --json "$OUT/wgrad.json"
step qwen3-L8 120 python -m detkit bench model --device cuda --preset qwen3-8b --layers 8 --out "$OUT/qwen3-L8"
step llama3-L8 120 python -m detkit bench model --device cuda --preset llama3-8b --layers 8 --out "$OUT/llama3-L8"
exit "$failed"
