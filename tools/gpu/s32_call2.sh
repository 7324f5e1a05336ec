#!/usr/bin/env bash
# Call 2 of reports/2026-12-07-h200-s32 (one H100 or H200), in step limits that fit one device call:
# - transformers' experts classes at four families' widths, T = 8192, their own "grouped_mm" implementation against
#   the same module in detkit mode, forward and forward+backward (tools/experts_bench.py), into $OUT/experts.json;
# - the grouped GEMM's pinned table (grouped table 3) against torch._grouped_mm at gpt-oss-20b, DeepSeek-V3 (scaled)
#   and Qwen3-30B-A3B widths, T 2048 / 8192, both weight layouts, CUDA-graph time, into $OUT/grouped.json;
# - `detkit bench attention` against SDPA flash (prefill, decode, fwd+bwd, paged decode), into $OUT/attn-bench.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step experts 200 python -m tools.experts_bench --device cuda --tokens 8192 --rounds 3 --json "$OUT/experts.json"
step grouped 140 python -m tools.grouped_mm_bench --device cuda --model gpt-oss-20b --model deepseek-v3-scaled \
  --model qwen3-30b-a3b --tokens 2048 8192 --weights transposed kn --impls torch detkit --timings graph --rounds 2 \
  --replays 10 --json "$OUT/grouped.json"
step attn-bench 150 python -m detkit bench attention --device cuda --modes prefill,decode,fwd_bwd,paged_decode \
  --out "$OUT/attn-bench"
exit "$failed"
