#!/usr/bin/env bash
# Call 4 of reports/2026-12-07-*-s36 (one H100 or H200), the attention table 2026-12-07.2: `detkit bench attention`,
# every mode (prefill, decode, fwd+bwd against SDPA flash; the paged decode against detkit's contiguous decode), into
# $OUT/attn-bench.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step attn-bench 300 python -m detkit bench attention --device cuda --modes prefill,decode,fwd_bwd,paged_decode \
  --out "$OUT/attn-bench"
exit "$failed"
