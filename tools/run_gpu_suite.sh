#!/usr/bin/env bash
# One call on a Hopper host: environment, GPU tests, the gemm audit suite at the Qwen3-8B TP=2 shapes,
# the config sweep, the gemm benchmark, and the MoE tests, audit and benchmark. Each step has its own
# time limit and the run goes on after a failure. Results land in $OUT (default results/gpu-<time>)
# and in the archive $ARCHIVE (default $OUT.tgz).
# Usage (from a checkout's root): bash tools/run_gpu_suite.sh [tests|audit|tune|bench|ncu|tma|gemmws|moe|moews|moetune|moesweep|fp8|all]...
#   TUNE_ARGS, BENCH_ARGS, NCU_ARGS, MOE_BENCH_ARGS, MOE_TUNE_ARGS, MOE_SWEEP_ARGS, FP8_BENCH_ARGS: extra
#   arguments of those steps, split on spaces (e.g. TUNE_ARGS="--ops db --m 16 64 128 256 512" for the dB small-M
#   sweep; MOE_SWEEP_ARGS="--quick --tokens 1024 --tokens 8192": detkit bench moe-sweep's flags).
set -uo pipefail
OUT=${OUT:-results/gpu-$(date +%Y%m%d-%H%M%S)}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
mkdir -p "$OUT"
steps=("${@:-all}")
# shellcheck source=tools/gpu_steps.sh
source "$(dirname "$0")/gpu_steps.sh"
read -ra TUNE_ARGS <<< "${TUNE_ARGS:-}"
read -ra BENCH_ARGS <<< "${BENCH_ARGS:-}"
read -ra NCU_ARGS <<< "${NCU_ARGS:-}"
read -ra MOE_BENCH_ARGS <<< "${MOE_BENCH_ARGS:-}"
read -ra MOE_TUNE_ARGS <<< "${MOE_TUNE_ARGS:-}"
read -ra MOE_SWEEP_ARGS <<< "${MOE_SWEEP_ARGS:---quick}"
read -ra FP8_BENCH_ARGS <<< "${FP8_BENCH_ARGS:---preset reference --preset reference-16k}"
gpu_pytest=(env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra)

python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "(detkit not pip-installed; using PYTHONPATH)"
python -m detkit env --json > "$OUT/env.json" 2> "$OUT/env.err"
python -m detkit env | head -40
if want tests; then
  step pytest-gemm "${TESTS_LIMIT:-240}" "${gpu_pytest[@]}" tests/test_det_gemm.py tests/test_contract.py
fi
if want tma; then
  step pytest-tma "${TMA_LIMIT:-120}" "${gpu_pytest[@]}" tests/test_det_gemm_tma.py
fi
if want gemmws; then  # det_gemm's Gluon variant: its GPU tests (bits vs the TMA kernel), then its tiles swept
  step pytest-gemm-ws "${GEMM_WS_TESTS_LIMIT:-180}" "${gpu_pytest[@]}" tests/test_det_gemm_ws.py
  step tune-ws "${TUNE_LIMIT:-300}" python -m tools.gemm_tune --variants ws --m 256 512 1024 4096 \
    --out "$OUT/tune-ws.json"
fi
if want audit; then
  step audit-gemm "${AUDIT_LIMIT:-420}" python -m detkit audit --device cuda --suite gemm --out "$OUT/audit"
fi
if want tune; then
  step tune "${TUNE_LIMIT:-300}" python -m tools.gemm_tune --out "$OUT/tune.json" "${TUNE_ARGS[@]}"
fi
if want bench; then
  step bench-gemm "${BENCH_LIMIT:-240}" python -m detkit bench gemm --device cuda --out "$OUT/bench" "${BENCH_ARGS[@]}"
fi
if want ncu; then  # Nsight Compute on the worst det_gemm rows vs cuBLAS (tools/gemm_ncu.py)
  step ncu "${NCU_LIMIT:-420}" python -m tools.gemm_ncu --out "$OUT/ncu" "${NCU_ARGS[@]}"
fi
if want moe; then
  step pytest-moe "${MOE_TESTS_LIMIT:-180}" "${gpu_pytest[@]}" tests/test_moe.py tests/test_moe_routing.py
  step audit-moe "${MOE_AUDIT_LIMIT:-180}" python -m detkit audit --device cuda --suite moe --out "$OUT/audit-moe"
  step bench-moe "${MOE_BENCH_LIMIT:-240}" python -m detkit bench moe --device cuda --out "$OUT/bench-moe" "${MOE_BENCH_ARGS[@]}"
fi
if want moews; then  # the BF16 Gluon kernels (kernels/moe/ws.py): bits vs the Triton tiles, then the wgrad sweep
  step pytest-moe-ws "${MOE_WS_TESTS_LIMIT:-180}" "${gpu_pytest[@]}" tests/test_moe_ws.py
  step moe-tune-wgrad "${MOE_TUNE_LIMIT:-300}" python -m tools.moe_tune --device cuda --stages wgrad_w1 wgrad_w2 \
    --out "$OUT/moe-tune-wgrad"
fi
if want moetune; then
  step moe-tune "${MOE_TUNE_LIMIT:-300}" python -m tools.moe_tune --device cuda --out "$OUT/moe-tune" "${MOE_TUNE_ARGS[@]}"
fi
if want moesweep; then
  step moe-sweep "${MOE_SWEEP_LIMIT:-300}" python -m detkit bench moe-sweep --device cuda --out "$OUT/moe-sweep" \
    "${MOE_SWEEP_ARGS[@]}"
fi
if want fp8; then
  step pytest-fp8 "${FP8_TESTS_LIMIT:-180}" "${gpu_pytest[@]}" tests/test_fp8_quant.py tests/test_moe_fp8.py
  step audit-moe-fp8 "${FP8_AUDIT_LIMIT:-180}" python -m detkit audit --device cuda --suite moe-fp8 --out "$OUT/audit-moe-fp8"
  step bench-moe-fp8 "${FP8_BENCH_LIMIT:-300}" python -m detkit bench moe --device cuda --impl fp8_warm \
    --impl fp8_wgrad_bf16 --out "$OUT/bench-moe-fp8" "${FP8_BENCH_ARGS[@]}"
fi
stamp finished
pack
