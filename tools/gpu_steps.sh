# shellcheck shell=bash
# Shared by the GPU run scripts (sourced): named steps with their own time limit, a log per step,
# and one archive of $OUT refreshed after every step. Needs OUT and the caller's steps=(...) array.
# shellcheck disable=SC2154  # steps is the caller's
want() { [[ " ${steps[*]} " == *" $1 "* || " ${steps[*]} " == *" all "* ]]; }
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
# The GPU host copies back only a few files, so a run stopped at its time limit still returns what
# finished through this archive.
pack() { tar -czf "${ARCHIVE:-$OUT.tgz}" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
# step NAME LIMIT_S CMD...: run with a time limit (the run goes on after a failure), log to
# $OUT/NAME.log, record the exit status in $OUT/steps.txt.
step() {
  local name=$1 limit=$2 rc; shift 2
  stamp "$name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc" | tee -a "$OUT/steps.txt"
  tail -8 "$OUT/$name.log"
  pack
}
