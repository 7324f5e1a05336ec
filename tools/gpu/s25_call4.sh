#!/usr/bin/env bash
# s25 call 4: the distributed mode's one-GPU checks (tools/gpu/model_parallel.sh: the one-process routes on cuda, the
# TP and DP paths at world size 1 against the plain model, bits and speed), the attention variants against their
# baselines (detkit bench attention --variants), and FP32 det_gemm against torch.matmul at an lm_head shape.
# Usage: OUT=DIR bash tools/gpu/s25_call4.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devwheels/*.whl
export PYTHONPATH=/tmp/site
ROOT=$OUT/call4
ROUTES_LIMIT=120 WORLD1_LIMIT=150 AUDIT_LIMIT=60 OUT=$ROOT/model-parallel bash tools/gpu/model_parallel.sh
source tools/gpu_steps.sh
OUT=$ROOT/rest
begin_run
step attention-bench 110 python -m detkit bench attention --device cuda --variants plain,window,softcap,sinks \
  --modes prefill,decode,fwd_bwd --out "$OUT/attention-bench"
step fp32-bench 100 python -m tools.fp32_gemm_bench --device cuda --out "$OUT/fp32-bench" --ops fwd \
  --kn 4096,151936 --m 1 128 4096 --precision ieee tf32 --rounds 2
echo "finished failed=$failed"
