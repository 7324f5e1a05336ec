#!/usr/bin/env bash
# Where the paged decode's time over the contiguous decode goes at small batch (issue #50 part 5), on one H100 or
# H200, attention table 2026-12-07.2 (tools/paged_decompose.py says what each path adds):
# - decompose: CUDA-graph time of the decode step on each path (the pinned paged paths and, beside them, with
#   AttnConfigs.paged_prefetch_pages), cache cold in L2 as `detkit bench attention` times it, Qwen3-8B heads, each
#   detkit path's bits against the padded path's, into $OUT/decompose.json;
# - ncu: Nsight Compute (clocks left alone, caches flushed per kernel) on one call of each path at B1 1k and B1 8k,
#   one process per path, raw CSV (durations, DRAM bytes and throughput, occupancy, warp stall reasons of every
#   kernel) in $OUT/ncu-<path>.log.
# Environment: CASES (default "1x1024 1x8192 8x8192 1x32768", batch x keys), NCU_PATHS (default six paths),
# DECOMPOSE_LIMIT_S and NCU_LIMIT_S (each step's time limit).
#   OUT=results/paged bash tools/gpu/paged_decode_decompose.sh
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
read -r -a cases <<< "${CASES:-1x1024 1x8192 8x8192 1x32768}"
read -r -a paths <<< "${NCU_PATHS:-padded varlen paged256 paged16 paged16_prefetch flash}"
step decompose "${DECOMPOSE_LIMIT_S:-240}" python -m tools.paged_decompose --out "$OUT" \
  "${cases[@]/#/--case=}"
ncu_bin=$(command -v ncu || find /opt/nvidia/nsight-compute -maxdepth 2 -name ncu -type f 2>/dev/null | sort | head -1 \
  || true)
ncu_args=(--clock-control none --nvtx --nvtx-include 'detkit@ncu/' --section SpeedOfLight
  --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats --section Occupancy --csv --page raw)
if [[ -z $ncu_bin ]]; then
  echo "ncu not found" | tee "$OUT/ncu-missing.txt"
  exit "$failed"
fi
for path in "${paths[@]}"; do  # the CSV (and ncu's own lines) in $OUT/ncu-<path>.log
  step "ncu-$path" "${NCU_LIMIT_S:-60}" "$ncu_bin" "${ncu_args[@]}" python -m tools.paged_decompose --ncu-run "$path"
done
exit "$failed"
