#!/usr/bin/env bash
# detkit attention decode sweep (issue #50) on one H100 or H200 (sm_90), one call under 5 minutes (step limits sum
# to 265 s by default; about 3-4 minutes expected):
#   warm   compile every forward binary the sweep launches (each candidate tile and split size on the one-pass and
#          split grids, one or all heads of a group per tile, contiguous and paged; the pinned backward), in parallel
#          processes sharing one Triton cache (a compile is single-threaded; the sweep then finds them cached)
#   sweep  python -m tools.attention_decode_sweep: every candidate's decode-vs-prefill bits, then CUDA-graph times
#          beside SDPA flash (interleaved) at decode B1/B8/B64 x 1k/8k/32k keys, prefill B1 S4096 and B8 S1024 and
#          the paged decode (pages of 16) at B1/B8 x 8k/32k keys; the finalists at fwd+bwd B1 S4096. It starts no new
#          chunk of 16 candidates past its budget (SWEEP_LIMIT - 30 s) and rewrites its report after every chunk, so
#          a run cut short keeps what finished (candidates run in a fixed shuffled order: a partial run samples the
#          whole grid).
# Everything lands in $OUT (versions.txt, steps.txt, <step>.log, decode_sweep.json, decode_sweep.md) and $OUT.tgz
# after every step. Each step has its own limit; the run goes on after a failed step and exits non-zero if any failed.
# Usage: OUT=<dir> bash tools/gpu/attention_decode_sweep.sh [warm|sweep|all]...   DRY_RUN=1 prints the plan.
# HEAD_DIMS (default 128) picks the head dims. 64 has as many candidates and warm launches as 128 (288 and 433), 256
# half as many (144 and 217): run each as a call of its own (HEAD_DIMS=64 or HEAD_DIMS=256).
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the results folder}"

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

if [[ ${DRY_RUN:-0} == 1 ]]; then
  step() { stamp "$1 (limit $2 s): ${*:3}"; }
  record_versions() { :; }
  begin_run() { mkdir -p "$OUT"; }
fi
steps=("${@:-all}")
begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}  # shared by the steps: compiles once
read -r -a head_dims <<< "${HEAD_DIMS:-128}"
sweep_limit=${SWEEP_LIMIT:-165}

if want warm; then
  step warm "${WARM_LIMIT:-100}" python -m tools.attention_decode_sweep warm --head-dims "${head_dims[@]}" \
    --workers "${WARM_WORKERS:-$(( $(nproc) - 1 ))}"
fi
if want sweep; then
  step sweep "$sweep_limit" python -m tools.attention_decode_sweep sweep --device cuda --head-dims "${head_dims[@]}" \
    --out "$OUT" --budget-s "$(( sweep_limit - 30 ))"
fi
echo "== $(date -u +%H:%M:%S) finished (failed=$failed)"
exit "$failed"
