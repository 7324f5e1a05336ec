#!/usr/bin/env bash
# Call 2 of reports/2026-12-07-*-s34 (one H100 or H200), in step limits that fit one device call: FP32 det_gemm
# candidates beside the table's pick and torch.matmul at the same precision setting (nn.Linear's weight; eager and
# CUDA-graph time; every candidate's bits compared with the pick's), into $OUT/<step>/summary.md and rows.jsonl:
# - fma-fwd: "ieee" forward at 17-256 rows, where the table's 128-row FMA tiles missed (1.8-3.8x at M 64 in call 3),
#   with the 64-row FMA tiles added to configs.fma_candidates; lm_heads 4096 x 151936 / 128256 and 4096 x 4096;
# - fma-da: "ieee" dA at 64-1024 rows on the same candidates (the Triton tiles: 2.3x at M 128);
# - tf32-fwd, tf32-da: "tf32" on TMA tiles beside the pointer tiles the table picks (1.3-2.4x forward, 4-8x dA).
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
BENCH=(python -m tools.fp32_gemm_bench --device cuda --layouts linear --rounds 2)
step fma-fwd 170 "${BENCH[@]}" --out "$OUT/fma-fwd" --ops fwd --kn 4096,151936 4096,128256 4096,4096 \
  --m 32 64 128 256 --precision ieee --fma
step fma-da 110 "${BENCH[@]}" --out "$OUT/fma-da" --ops da --kn 4096,151936 4096,4096 --m 64 128 256 1024 \
  --precision ieee --fma
step tf32-fwd 130 "${BENCH[@]}" --out "$OUT/tf32-fwd" --ops fwd --kn 4096,151936 4096,4096 --m 256 1024 4096 \
  --precision tf32 --config 128,128,32,8,8,3,tma 128,256,32,8,8,3,tma 128,128,32,8,4,4,tma 128,256,32,8,8,4,tma
step tf32-da 110 "${BENCH[@]}" --out "$OUT/tf32-da" --ops da --kn 4096,151936 --m 128 1024 --precision tf32 \
  --config 128,128,32,8,8,3,tma 64,128,32,8,4,3,tma 128,256,32,8,8,3,tma 64,64,32,8,4,4,tma
exit "$failed"
