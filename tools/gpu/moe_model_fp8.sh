#!/usr/bin/env bash
# transformers' Qwen3-MoE under the batch-invariant mode with FP8 experts (moe_experts="fp8") on one H200, in about
# 5 minutes (limits 130 s + 150 s + 50 s):
# 1. the model audit on the Qwen3-30B-A3B widths, 2 layers, experts on detkit's FP8 layer: batch invariance,
#    padding, trainer vs rollout, KV-cache decode vs trainer, backward repeat with the router aux loss, routed ops
#    (every expert call on detkit.moe_mlp_fp8), the first block's output and gradients against BF16 experts (the
#    FP8 precision gate), default-mode drift;
# 2. the model bench on the same model with FP8 experts: speed ratios of the model and of one MoE block vs
#    transformers' own (DETKIT_MODEL_FP8_GRAPH_WEIGHTS passes through: `static` for the captured step on cached
#    weights);
# 3. tests/test_mode_moe_fp8.py on cuda (the route bitwise against a direct moe_mlp_fp8 call, gradients in
#    transformers' layout, log-probs alone vs in a batch, the weight cache's invalidation, refusals; gpu-marked: a
#    captured block reads the weights of each replay, and a Qwen3-30B-A3B-width block's tokens alone vs in 2048,
#    its backward run to run and its precision against BF16 experts), and the model audit's FP8 tests on cuda (the
#    tiny FP8-capable MoE preset through every check; a block the FP8 layer refuses).
# Each step has a time limit; the run goes on after a failure and exits non-zero if any step failed. Everything
# lands under $OUT: versions.txt, steps.txt, <step>.log, pytest-moe-fp8.xml, model-audit-fp8/ (report.md,
# report.json, rows.jsonl, model.md, model.json), model-bench-fp8/ (report.md, report.json, rows.jsonl).
# Usage: OUT=/path/to/results bash tools/gpu/moe_model_fp8.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${OUT:?set OUT to the results folder}"

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

step model-audit-moe-fp8 "${MOE_FP8_MODEL_AUDIT_LIMIT:-130}" env DETKIT_MODEL_CONFIG=qwen3-moe-30b-a3b \
  DETKIT_MODEL_MOE_EXPERTS=fp8 python -m detkit audit --device cuda --suite model --no-progress \
  --out "$OUT/model-audit-fp8"
step model-bench-moe-fp8 "${MOE_FP8_MODEL_BENCH_LIMIT:-150}" env DETKIT_MODEL_CONFIG=qwen3-moe-30b-a3b \
  DETKIT_MODEL_MOE_EXPERTS=fp8 python -m detkit bench model --device cuda --out "$OUT/model-bench-fp8"
step pytest-moe-fp8 "${MOE_FP8_MODEL_TESTS_LIMIT:-50}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra \
  -p no:cacheprovider --junitxml "$OUT/pytest-moe-fp8.xml" tests/test_mode_moe_fp8.py tests/test_model_audit.py -k fp8
echo "== $(date -u +%H:%M:%S) finished (failed=$failed)"
exit "$failed"
