#!/usr/bin/env bash
# One call on a host with two NVLink-connected Hopper GPUs: the 2-rank NCCL runs of the TP/CP
# operators (one TP group, one CP group), the invariance pairs, bench comm, bench mlp, the NCCL
# algorithm sweep and the multigpu tests. Each step has its own time limit and the run goes on
# after a failure, so one call shows every outcome. Results land in $OUT (default results/x2-<time>).
# Usage (from a checkout's root): bash tools/run_x2_suite.sh [tpcp|inv|comm|mlp|sweep|pytest|all]...
set -uo pipefail
OUT=${OUT:-results/x2-$(date +%Y%m%d-%H%M%S)}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
mkdir -p "$OUT"
steps=("${@:-all}")
# shellcheck source=tools/gpu_steps.sh
source "$(dirname "$0")/gpu_steps.sh"
# Extra arguments, split on spaces: MLP_ARGS="--tokens 4096", SWEEP_ARGS="--quick".
read -ra MLP_ARGS <<< "${MLP_ARGS:-}"
read -ra SWEEP_ARGS <<< "${SWEEP_ARGS:-}"
two_ranks=(torchrun --nproc-per-node 2 --standalone -m detkit)

python -m detkit env --json > "$OUT/env.json" 2> "$OUT/env.err"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
if want tpcp; then
  step tpcp-tp-group "${TPCP_LIMIT:-120}" env DETKIT_TPCP_WORLD=0,1 "${two_ranks[@]}" audit --suite tp-cp --out "$OUT/tp-group"
  step tpcp-cp-group "${TPCP_LIMIT:-120}" env DETKIT_TPCP_WORLD=0,2 "${two_ranks[@]}" audit --suite tp-cp --out "$OUT/cp-group"
fi
if want inv; then
  step inv-tp "${INV_LIMIT:-150}" env DETKIT_TPCP_WORLD=0,1 "${two_ranks[@]}" audit --suite invariance --out "$OUT/inv-tp"
  step inv-cp "${INV_LIMIT:-150}" env DETKIT_TPCP_WORLD=0,2 "${two_ranks[@]}" audit --suite invariance --out "$OUT/inv-cp"
fi
if want comm; then
  step comm "${COMM_LIMIT:-90}" "${two_ranks[@]}" bench comm --out "$OUT/comm"
fi
if want mlp; then
  step mlp-tp "${MLP_LIMIT:-150}" env DETKIT_TPCP_WORLD=0,1 "${two_ranks[@]}" bench mlp --out "$OUT/mlp-tp" "${MLP_ARGS[@]}"
  step mlp-cp "${MLP_LIMIT:-150}" env DETKIT_TPCP_WORLD=0,2 "${two_ranks[@]}" bench mlp --out "$OUT/mlp-cp" "${MLP_ARGS[@]}"
fi
if want sweep; then
  step nccl-sweep "${SWEEP_LIMIT:-200}" python -m tools.nccl_sweep --out "$OUT/nccl-sweep" "${SWEEP_ARGS[@]}"
fi
if want pytest; then
  step pytest-multigpu "${PYTEST_LIMIT:-300}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider \
    -m multigpu -ra tests/test_parallel.py tests/test_tp_cp_suite.py tests/test_invariance.py \
    tests/test_bench_comm.py tests/test_bench_mlp.py
fi
stamp finished
pack
