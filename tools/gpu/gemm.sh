#!/usr/bin/env bash
# det_gemm on one H200, from a checkout root without installing (PYTHONPATH=$PWD): the GPU tests of the det_gemm
# files, the gemm audit at the qwen3-8b-tp2 and zoo presets, the benchmark's host/eager/GPU-time rows at the
# Qwen3-8B TP=2 shapes, the zoo's GPU times and a sweep of candidate tiles for the zoo's narrow outputs.
#
#   OUT=/path tools/gpu/gemm.sh tests   # <= 7 min: pytest (DETKIT_TEST_DEVICE=cuda) of the det_gemm test files
#   OUT=/path tools/gpu/gemm.sh bench   # <= 5.5 min: zoo GPU times, Qwen3-8B TP=2 host/eager + no-split-K
#   OUT=/path tools/gpu/gemm.sh audit   # <= 9.5 min: gemm audit, the qwen3-8b-tp2 and zoo presets at once
#   OUT=/path tools/gpu/gemm.sh sweep   # <= 6 min: candidate tiles at the zoo's missed (op, K, N), fwd, dA and dB
#   OUT=/path tools/gpu/gemm.sh all     # tests, bench and audit in turn
#
# Each step writes under $OUT/<step>/: a log per command, env.json, steps.txt (exit status and seconds per
# command). A command past its time limit is stopped (SIGINT, then SIGKILL) and keeps what it wrote: benchmark
# rows stream to rows.jsonl, and `detkit bench gemm` (SIGINT) writes the report of the rows it measured.
# Kernels compile into TRITON_CACHE_DIR (default results/triton-cache, kept between calls on the same machine),
# filled by parallel processes (tools.gemm_warm) before the long runs.
set -euo pipefail

STEP=${1:?usage: OUT=DIR tools/gpu/gemm.sh tests|bench|audit|sweep|all}
: "${OUT:?set OUT to the results folder}"
export PYTHONPATH=${PYTHONPATH:-$PWD} NCCL_NVLS_ENABLE=0
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/results/triton-cache}
unset TRITON_INTERPRET
PY=${PYTHON:-python}
WORKERS=${WORKERS:-12}
ZOO_M=(1 16 128 256 1024 4096 16384)
status=0

# run NAME LIMIT_S CMD...: a command with a time limit, its log, its status line; the step goes on after a failure.
run() {
  local name=$1 limit=$2 rc=0 t0=$SECONDS
  shift 2
  echo "== $(date -u +%H:%M:%S) $name (limit ${limit}s): $*"
  timeout --signal=INT --kill-after=20 "$limit" "$@" > "$DIR/$name.log" 2>&1 || rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$DIR/steps.txt"
  tail -4 "$DIR/$name.log"
  if [ "$rc" -ne 0 ]; then status=1; fi
}

# left TOTAL_S LIMIT_S: LIMIT_S, or what is left of TOTAL_S since the step began (10 s at least).
left() { local rest=$(($1 - (SECONDS - STEP_T0))); echo $((rest < $2 ? (rest > 10 ? rest : 10) : $2)); }

begin() {
  DIR="$OUT/$1"
  STEP_T0=$SECONDS
  mkdir -p "$DIR"
  "$PY" -m detkit env --json > "$DIR/env.json" 2> "$DIR/env.err" || true
  git rev-parse HEAD > "$DIR/commit.txt" 2>/dev/null || echo "${DETKIT_GIT_COMMIT:-unknown}" > "$DIR/commit.txt"
}

step_tests() {
  begin tests
  # Four pytest processes at once: the tests are compile-bound, and each process compiles its own kernels.
  local pids=() names=() files=(
    "det_gemm tests/test_det_gemm.py tests/test_raw_launch.py"
    "det_gemm_tma tests/test_det_gemm_tma.py"
    "det_gemm_ws tests/test_det_gemm_ws.py"
    "bench_audits tests/test_bench_gemm.py tests/test_audits.py"
  )
  for entry in "${files[@]}"; do
    read -r name paths <<< "$entry"
    # shellcheck disable=SC2086  # paths is a list of files
    (run "pytest_$name" 420 env DETKIT_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -ra --maxfail=25 \
        -k "not gemm_suite_passes_on_hopper" $paths) &
    pids+=($!)
    names+=("$name")
  done
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || true; done
  grep -q "rc=[^0]" "$DIR/steps.txt" && status=1
  return 0
}

step_bench() {
  begin bench
  local margs=()
  for m in "${ZOO_M[@]}"; do margs+=(--m "$m"); done
  # Compile the zoo's table picks in parallel processes first.
  run warm_zoo 90 "$PY" -m tools.gemm_warm --workers "$WORKERS" --zoo --m "${ZOO_M[@]}" 64 512
  # The zoo: every shape, all three ops, GPU time (CUDA-graph replay) against cuBLAS.
  run bench_zoo "$(left 330 170)" "$PY" -m detkit bench gemm --device cuda --out "$DIR/zoo" --zoo "${margs[@]}" \
      --rounds 3
  # Qwen3-8B TP=2 (every linear layer): host and eager time against torch.matmul, GPU time against cuBLASLt
  # without split-K (its worker times both by graph replay).
  run bench_tp2 "$(left 330 110)" "$PY" -m detkit bench gemm --device cuda --out "$DIR/tp2" --zoo \
      --layers "Qwen3-8B tp2" "${margs[@]}" --m 64 --m 512 --timings host --timings eager --nosplitk --rounds 3
  grep -q "rc=[^0]" "$DIR/steps.txt" && status=1
  return 0
}

step_audit() {
  begin audit
  (run warm_default 90 "$PY" -m tools.gemm_warm --workers 6 --preset qwen3-8b-tp2) &
  (run warm_zoo 90 "$PY" -m tools.gemm_warm --workers 6 --preset zoo) &
  wait || true
  # The two presets at once (correctness runs, not timings).
  (run audit_qwen3_8b_tp2 "$(left 560 520)" "$PY" -m detkit audit --device cuda --suite gemm \
      --out "$DIR/qwen3-8b-tp2") &
  (run audit_zoo "$(left 560 520)" "$PY" -m detkit audit --device cuda --suite gemm --preset zoo --out "$DIR/zoo") &
  wait || true
  grep -q "rc=[^0]" "$DIR/steps.txt" && status=1
  return 0
}

# candidates NAME LIMIT_S OPS KN_LIST M_LIST CONFIG_LIST: tools.gemm_candidates at those (op, K, N, M).
candidates() {
  local name=$1 limit=$2 args=()
  read -ra ops <<< "$3"; read -ra kns <<< "$4"; read -ra ms <<< "$5"; read -ra cfgs <<< "$6"
  for kn in "${kns[@]}"; do args+=(--kn "$kn"); done
  for c in "${cfgs[@]}"; do args+=(--config "$c"); done
  run "$name" "$limit" "$PY" -m tools.gemm_candidates --out "$DIR/$name" --ops "${ops[@]}" "${args[@]}" \
      --m "${ms[@]}" --rounds 3
}

step_sweep() {
  local warm_only=0
  [ "${SWEEP_WARM_ONLY:-0}" = 1 ] && warm_only=1
  if [ "$warm_only" = 1 ]; then begin sweep_warm; else begin sweep; fi
  # Tiles for small M (weight-streaming) and for large M (compute), big to small; the table's own are among them.
  local small="16,32,128,1,4,6 16,64,128,1,4,6 64,16,128,1,4,6,tma 64,32,128,1,4,5,tma 64,64,128,1,4,6,tma
64,128,64,8,4,6,tma 64,128,64,8,4,8,tma 128,32,128,1,4,5,tma 128,128,64,8,8,6,tma 64,192,64,8,4,6,tma3
128,256,64,8,8,3,ws"
  local large="64,16,128,1,4,6,tma 64,32,128,1,4,5,tma 64,64,128,1,4,6,tma 64,128,64,8,4,6,tma
128,128,64,8,8,6,tma 256,128,64,8,8,4,tma 128,192,64,8,8,4,tma3 128,256,64,8,8,3,ws 128,128,64,8,8,4,ws
128,128,64,8,8,5,ws 128,128,32,8,4,4"
  small=${small//$'\n'/ }; large=${large//$'\n'/ }
  local narrow_fwd="4096,128 4096,256 4096,512 4096,1024 4096,1536 4096,2048 8192,128 8192,1024 8192,3584 2048,512"
  local narrow_da="512,4096 1024,4096 1536,4096 2048,4096 1024,8192 8192,128"
  local narrow_db="4096,128 4096,512 512,4096 4096,1536 1536,4096 5120,1024 1024,5120 2048,512"
  if [ "$warm_only" = 1 ]; then  # compile the candidates in parallel processes (another step may run)
    read -ra all_small <<< "$small"; read -ra all_large <<< "$large"
    local warm=()
    for c in "${all_small[@]}" "${all_large[@]}"; do warm+=(--config "$c"); done
    run warm 200 "$PY" -m tools.gemm_warm --workers "$WORKERS" --zoo --layouts linear --m 1 16 128 1024 4096 \
        "${warm[@]}"
    return 0
  fi
  candidates fwd_small "$(left 330 60)" fwd "$narrow_fwd" "1 16 64 128 256" "$small"
  candidates fwd_large "$(left 330 70)" fwd "$narrow_fwd" "512 1024 2048 4096 16384" "$large"
  candidates da_small "$(left 330 40)" da "$narrow_da" "1 16 64 128 256" "$small"
  candidates da_large "$(left 330 50)" da "$narrow_da" "512 1024 2048 4096 16384" "$large"
  candidates db_all "$(left 330 50)" db "$narrow_db" "128 256 1024 4096 16384" "$large"
  candidates lm_head "$(left 330 40)" "fwd da" "4096,151936 8192,128256" "1 16 128 256 1024" "$small"
  grep -q "rc=[^0]" "$DIR/steps.txt" && status=1
  return 0
}

case "$STEP" in
  tests) step_tests ;;
  bench) step_bench ;;
  audit) step_audit ;;
  sweep) step_sweep ;;
  all) step_tests; step_bench; step_audit ;;
  *) echo "unknown step $STEP; steps: tests bench audit sweep all" >&2; exit 2 ;;
esac
exit "$status"
