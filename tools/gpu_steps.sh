# shellcheck shell=bash
# Shared by the GPU run scripts (sourced): named steps with their own time limit, a log per step,
# and one archive of $OUT refreshed after every step. Needs OUT (and, for want, the caller's steps=(...) array).
# shellcheck disable=SC2154,SC2034  # steps is the caller's; failed is read by the caller
want() { [[ " ${steps[*]} " == *" $1 "* || " ${steps[*]} " == *" all "* ]]; }
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
# The GPU host copies back only a few files, so a run stopped at its time limit still returns what
# finished through this archive.
pack() { tar -czf "${ARCHIVE:-$OUT.tgz}" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
# step NAME LIMIT_S CMD...: run with a time limit (the run goes on after a failure, also under set -e), log
# to $OUT/NAME.log, record the exit status in $OUT/steps.txt; a failed step sets failed=1.
failed=0
step() {
  local name=$1 limit=$2 rc=0; shift 2
  stamp "$name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  echo "$name rc=$rc" | tee -a "$OUT/steps.txt"
  tail -8 "$OUT/$name.log"
  if [[ $rc -ne 0 ]]; then failed=1; fi
  pack
}
# record_versions: the date, commit, GPU and torch / triton / transformers versions into $OUT/versions.txt (and stdout).
record_versions() {
  {
    date -u +%Y-%m-%dT%H:%M:%SZ
    git rev-parse HEAD 2>/dev/null || echo "no git"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    python - <<'PY'
import torch, triton, transformers
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")
PY
  } > "$OUT/versions.txt" 2>&1 || true
  cat "$OUT/versions.txt"
}
# begin_run: what every GPU run sets up: the checkout on PYTHONPATH, unbuffered Python, NVLink multicast off, kernels
# compiled (not interpreted), $OUT made with a fresh steps.txt, and versions.txt.
begin_run() {
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
  unset TRITON_INTERPRET
  mkdir -p "$OUT"
  : > "$OUT/steps.txt"
  record_versions
}
# plan_only_if_dry_run: with DRY_RUN=1, every later step prints its command and limit instead of running it, and
# begin_run only makes $OUT (for scripts whose usage offers a dry run).
# shellcheck disable=SC2329  # the redefined functions are the sourcing script's to call
plan_only_if_dry_run() {
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    step() { stamp "$1 (limit $2 s): ${*:3}"; }
    record_versions() { :; }
    begin_run() { mkdir -p "$OUT"; }
  fi
}
