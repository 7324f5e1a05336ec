#!/usr/bin/env bash
# Session call 1 (one H100/H200): the D=256 softcap attention rows against torch's eager formulation with the FP64
# oracle deciding, and detkit's grouped GEMMs against torch._grouped_mm at MoE shapes.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step softcap-bench 200 python -m detkit bench attention --device cuda --variants softcap \
  --modes prefill,decode,fwd_bwd --out "$OUT/softcap-bench"
step grouped-bench 360 python -m tools.grouped_mm_bench --device cuda --configs --json "$OUT/grouped.json"
pack
exit "$failed"
