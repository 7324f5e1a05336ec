#!/usr/bin/env bash
# One call on a Hopper host: environment, GPU tests, the gemm audit suite at the Qwen3-8B TP=2 shapes,
# the config sweep and the gemm benchmark. Results land in $OUT (default ./results/gpu-<date>).
# Usage: bash bench/run_gpu_suite.sh [audit|tune|bench|all]...
set -euo pipefail
OUT=${OUT:-results/gpu-$(date +%Y%m%d-%H%M%S)}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
mkdir -p "$OUT"
steps=("${@:-all}")
want() { [[ " ${steps[*]} " == *" $1 "* || " ${steps[*]} " == *" all "* ]]; }
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }

python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "(detkit not pip-installed; using PYTHONPATH)"
stamp env; python -m toolkit env --json > "$OUT/env.json"; python -m toolkit env | head -40
if want tests; then
  stamp pytest; DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider tests/test_det_gemm.py tests/test_contract.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -5
fi
if want audit; then
  stamp audit; python -m toolkit audit --device cuda --suite gemm --out "$OUT/audit" 2>&1 | tail -20 || echo "AUDIT FAILED"
fi
if want tune; then
  stamp tune; python -m bench.gemm_tune --out "$OUT/tune.json" ${TUNE_ARGS:-} || echo "TUNE FAILED"
fi
if want bench; then
  stamp bench; python -m toolkit bench gemm --device cuda --out "$OUT/bench" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1 || echo "BENCH FAILED"
  tail -30 "$OUT/bench.log"
fi
stamp done
