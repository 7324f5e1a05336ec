#!/usr/bin/env bash
# s25 call 3: the container issue's GPU-host run without the image (no Docker engine on that host): the default suite
# list through `python -m detkit audit --suite all`, the same suites `docker compose run audit` runs; then
# `detkit bench model` (the model speed rows that left the model audit). Usage: OUT=DIR bash tools/gpu/s25_call3.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devwheels/*.whl
export PYTHONPATH=/tmp/site
source tools/gpu_steps.sh
OUT=$OUT/call3
begin_run
export TRITON_CACHE_DIR=/tmp/triton-cache
# SIGINT at the limit: an interrupted audit still writes its report, marked INCOMPLETE.
stamp "audit-all"
timeout -s INT --kill-after=20 "${AUDIT_ALL_LIMIT:-400}" python -m detkit audit --device cuda --suite all --no-progress \
  --out "$OUT/audit-all" > "$OUT/audit-all.log" 2>&1
echo "audit-all rc=$?" | tee -a "$OUT/steps.txt"
tail -15 "$OUT/audit-all.log"
step bench-model "${BENCH_MODEL_LIMIT:-150}" python -m detkit bench model --device cuda --out "$OUT/bench-model"
echo "finished failed=$failed"
