#!/usr/bin/env bash
# FP32 "ieee" det_gemm's Gluon FMA-dot variant ("fma", kernels/det_gemm/fma.py) on one H100 or H200, from a checkout
# root, in about 200 s:
#   1. fma-warm: compile every launch of the bench in parallel processes (Triton's cache, TRITON_CACHE_DIR);
#   2. fma-tests: the variant's GPU tests (every candidate's bits = the pinned Triton FP32 tile's at partial tiles,
#      fwd / dA / dB on both weight layouts, the twin store; rows at M = 1..33 = the table's pick at that M), in 4
#      processes where pytest-xdist is installed;
#   3. fma-bench: fwd and dA at K 4096 x N 151936 (an lm_head) and 4096 x 4096, M 64, 256, 1024, 4096, nn.Linear's
#      weight, "ieee" products against torch.matmul at "highest": the pinned tile, torch.matmul and every
#      configs.fma_candidates tile, each candidate's bits compared with the pinned tile's, eager and GPU time.
#
#   OUT=/path bash tools/gpu/fp32_fma.sh           # DRY_RUN=1: print the steps and their limits only
#
# Everything lands under $OUT: versions.txt, steps.txt (exit status per step), <step>.log, and fma/rows.jsonl (one row
# per case, the candidates in it) with fma/summary.md (ratios to torch.matmul against the 1.2x target, the fastest
# candidate per case marked). The run goes on after a failed step and exits non-zero if any failed; $OUT.tgz holds
# what finished.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the results folder}"

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure
plan_only_if_dry_run

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/results/triton-cache}
BENCH=(--device cuda --out "$OUT/fma" --ops fwd da --kn "4096,151936" "4096,4096" --m 64 256 1024 4096
       --layouts linear --precision ieee --fma --rounds 2)

# The tests compile about 60 kernels (each candidate per op, weight layout and M class): spread over 4 processes
# where pytest-xdist is installed.
XDIST=()
if python -c "import xdist" 2>/dev/null; then XDIST=(-n "${FMA_TEST_WORKERS:-4}"); fi

step fma-warm "${FMA_WARM_LIMIT:-60}" python -m tools.fp32_gemm_bench "${BENCH[@]}" \
  --warm "${FMA_WARM_WORKERS:-14}" --warm-only
step fma-tests "${FMA_TESTS_LIMIT:-150}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra \
  "${XDIST[@]}" -m gpu tests/test_det_gemm_fma.py
step fma-bench "${FMA_BENCH_LIMIT:-150}" python -m tools.fp32_gemm_bench "${BENCH[@]}"
echo "== $(date -u +%H:%M:%S) finished (failed=$failed)"
exit "$failed"
