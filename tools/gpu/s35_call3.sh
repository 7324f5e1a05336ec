#!/usr/bin/env bash
# Call 3 of reports/2026-12-07-*-s35 (one H100 or H200):
# - the paged decode probe of call 2 (padded / varlen / paged 16 / paged 256 on the split grid, B1 1k, B1 8k, B8 1k),
#   into $OUT/probe/paged-probe.json;
# - the attention forward's host time per decode step and its cProfile (tools/attention_host, Qwen3-8B heads, and a
#   4-layer transformers Qwen3 decode step in the mode), into $OUT/attn-host.json.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step probe 120 env OUT="$OUT/probe" ATTN_BENCH=0 MODE_OVERHEAD=0 bash tools/gpu/s35_call2.sh
step attn-host 120 python -m tools.attention_host --device cuda --profile --model --json "$OUT/attn-host.json"
exit "$failed"
