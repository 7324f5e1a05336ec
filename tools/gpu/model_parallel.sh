#!/usr/bin/env bash
# detkit mode across processes on one GPU (docs/mode_parallel.md), one call of about 5 minutes:
# 1. the one-process parallel routes (TP=1 segmented rowwise forward / colwise dX, DP=1 segmented dW; the DP
#    embedding, MoE router and experts) against the ranks' FP32 shard sums, at tiny widths (the CPU tests on cuda)
#    and at Qwen3-8B MLP widths (M 1, 129, 4096); the index_sum kernel against its reference;
# 2. the TP and DP code paths at world size 1 on NCCL -- parallelize_module on a mesh of one rank + prepare (its
#    Linears on their local tensors, counted as "linear (tp, one rank)"), prepare with a DP group of one, DDP --
#    against the plain model under detkit mode (Qwen3 8B widths, 2 layers, 4 x 512 tokens, forward+backward):
#    log-probs and gradients bitwise, median step time within 1.05x (world1.json: median, p20, p80 of each path over
#    10 interleaved rounds of 3 steps, and the ratios);
# 3. the model-parallel audit on the GPUs visible (one GPU: every job is a coverage row saying it needs two; two or
#    more: the TP=2 / DP=2 jobs on NCCL).
# Each step has a time limit; the run goes on after a failure and exits non-zero if any step failed. Everything
# lands under $OUT: versions.txt, steps.txt, <step>.log, world1.json, audit/ (report.md, report.json, rows.jsonl).
# Usage: OUT=/path/to/results bash tools/gpu/model_parallel.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the results folder}"

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

step routes "${ROUTES_LIMIT:-150}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra \
  tests/test_mode_parallel.py tests/test_index_sum.py -k "one_process or outside_the_mode or rmsnorm or index_sum or embedding"
step world1 "${WORLD1_LIMIT:-240}" env DETKIT_TEST_DEVICE=cuda DETKIT_MODEL_PARALLEL_OUT="$OUT/world1.json" \
  python -m pytest -q -p no:cacheprovider -ra tests/test_mode_parallel.py -k world1
step audit "${AUDIT_LIMIT:-300}" python -m detkit audit --device cuda --suite model-parallel --no-progress \
  --out "$OUT/audit"
echo "== $(date -u +%H:%M:%S) finished (failed=$failed)"
exit "$failed"
