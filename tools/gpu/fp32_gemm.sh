#!/usr/bin/env bash
# FP32 det_gemm and the mode's FP32 routes on one H100 or H200, from a checkout root. Steps (each under 9 minutes):
#
#   OUT=/path bash tools/gpu/fp32_gemm.sh tests   # the FP32 GPU tests (kernel and mode files, DETKIT_TEST_DEVICE=cuda),
#                                                 # then the BF16 det_gemm and mode GPU tests (the BF16 bits unchanged)
#   OUT=/path bash tools/gpu/fp32_gemm.sh bench   # FP32 det_gemm vs torch.matmul at the same precision setting
#                                                 # ("highest" -> ieee, "high" -> tf32): fwd at K 4096 x N 151936,
#                                                 # 128256, 4096, M 1-4096, GPU time (CUDA graph) and eager time;
#                                                 # dA and dB of the lm_heads
#   OUT=/path bash tools/gpu/fp32_gemm.sh sweep   # candidate FP32 tiles beside the table's pick at the lm_head shapes
#   OUT=/path bash tools/gpu/fp32_gemm.sh gemv    # M <= 16 (sized for < 4 minutes on one H100): compile its kernels
#                                                 # in parallel, the small-M kernel's GPU tests (its bits = the tile
#                                                 # path's at lm_head width, every variant), then every candidate
#                                                 # (configs.gemv_candidates) beside the pick and torch.matmul, "ieee",
#                                                 # both weight layouts: fwd and dA at 4096 x 151936 (M 1-16), fwd at
#                                                 # 5120 x 151936 and 8192 x 128256 (M 1, 16), 4096 x 4096 and the
#                                                 # 7168 x 256 router (M 1-16)
#   OUT=/path bash tools/gpu/fp32_gemm.sh all     # tests, bench, sweep in turn (about 20 minutes)
#
# Everything lands under $OUT: versions.txt, steps.txt (exit status per command), <command>.log, and per timing run
# a folder with rows.jsonl (one row per case) and summary.md (detkit / torch.matmul per row against the 1.2x target;
# with candidates, each one's eager and GPU time, the fastest marked).
# The run goes on after a failed command and exits non-zero if any failed; $OUT.tgz holds what finished.
set -euo pipefail
cd "$(dirname "$0")/../.."
STEP=${1:?usage: OUT=DIR bash tools/gpu/fp32_gemm.sh tests|bench|sweep|gemv|all}
: "${OUT:?set OUT to the results folder}"

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/results/triton-cache}
LM_HEADS=("4096,151936" "4096,128256")
M_ALL=(1 16 64 128 256 1024 4096)

step_tests() {
  step pytest-fp32 "${FP32_TESTS_LIMIT:-300}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra \
    tests/test_det_gemm_fp32.py tests/test_mode_fp32.py
  step pytest-bf16 "${BF16_TESTS_LIMIT:-240}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra \
    tests/test_det_gemm.py tests/test_mode.py
}

step_bench() {
  step bench-fwd "${BENCH_FWD_LIMIT:-320}" python -m tools.fp32_gemm_bench --device cuda --out "$OUT/bench-fwd" \
    --ops fwd --kn "${LM_HEADS[@]}" 4096,4096 --m "${M_ALL[@]}" --precision ieee tf32
  step bench-bwd "${BENCH_BWD_LIMIT:-240}" python -m tools.fp32_gemm_bench --device cuda --out "$OUT/bench-bwd" \
    --ops da db --kn "${LM_HEADS[@]}" --m 1 128 1024 4096 --precision ieee tf32
}

step_sweep() {
  # Small M (the weight stream) and large M (FMA-bound "ieee", tensor-core "tf32") candidates; the table's own among them.
  step sweep-small "${SWEEP_SMALL_LIMIT:-200}" python -m tools.fp32_gemm_bench --device cuda --out "$OUT/sweep-small" \
    --ops fwd --kn "${LM_HEADS[@]}" --m 1 16 64 --precision ieee tf32 --rounds 2 \
    --config 16,32,32,1,4,4 16,64,32,1,4,4 16,128,32,1,4,3 32,64,32,8,4,4 16,64,64,1,4,3 16,64,32,1,4,4,tma
  step sweep-large "${SWEEP_LARGE_LIMIT:-300}" python -m tools.fp32_gemm_bench --device cuda --out "$OUT/sweep-large" \
    --ops fwd --kn "${LM_HEADS[@]}" 4096,4096 --m 256 1024 4096 --precision ieee tf32 --rounds 2 \
    --config 128,128,32,8,8,3 128,128,16,8,8,4 64,128,32,8,8,3 128,64,32,8,4,3 128,128,32,8,8,3,tma \
    128,256,32,8,8,3,tma
}

# M <= 16, "ieee", every small-M candidate: fwd and dA at the 4096 x 151936 lm_head (the GPU tests' shape), then fwd at
# two more lm_heads (M 1, 16) and at 4096 x 4096 and DeepSeek-V3's 7168 x 256 router (M 1-16); both weight layouts.
GEMV_LM=(--ops fwd da --kn "${LM_HEADS[0]}" --m 1 2 4 8 16)
GEMV_LM2=(--ops fwd --kn "5120,151936" "8192,128256" --m 1 16)
GEMV_NARROW=(--ops fwd --kn "4096,4096" "7168,256" --m 1 2 4 8 16)
GEMV_COMMON=(--device cuda --layouts linear kn --precision ieee --candidates --rounds 2)

step_gemv() {
  # The warm's processes fill TRITON_CACHE_DIR with the first bench's kernels, the small-M GPU tests' among them.
  step gemv-warm "${GEMV_WARM_LIMIT:-90}" python -m tools.fp32_gemm_bench "${GEMV_COMMON[@]}" \
    --out "$OUT/gemv-lm" "${GEMV_LM[@]}" --warm "${GEMV_WARM_WORKERS:-14}" --warm-only
  step gemv-tests "${GEMV_TESTS_LIMIT:-120}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra \
    tests/test_det_gemm_fp32.py -k "gpu and (small_m or lm_head)"
  step gemv-bench-lm "${GEMV_BENCH_LIMIT:-120}" python -m tools.fp32_gemm_bench "${GEMV_COMMON[@]}" \
    --out "$OUT/gemv-lm" "${GEMV_LM[@]}"
  step gemv-bench-lm2 "${GEMV_BENCH_LIMIT:-90}" python -m tools.fp32_gemm_bench "${GEMV_COMMON[@]}" \
    --out "$OUT/gemv-lm2" "${GEMV_LM2[@]}" --warm "${GEMV_WARM_WORKERS:-14}"
  step gemv-bench-narrow "${GEMV_BENCH_LIMIT:-120}" python -m tools.fp32_gemm_bench "${GEMV_COMMON[@]}" \
    --out "$OUT/gemv-narrow" "${GEMV_NARROW[@]}" --warm "${GEMV_WARM_WORKERS:-14}"
}

case "$STEP" in
  tests) step_tests ;;
  bench) step_bench ;;
  sweep) step_sweep ;;
  gemv) step_gemv ;;
  all) step_tests; step_bench; step_sweep ;;
  *) echo "unknown step $STEP; steps: tests bench sweep gemv all" >&2; exit 2 ;;
esac
echo "== $(date -u +%H:%M:%S) finished (failed=$failed)"
exit "$failed"
