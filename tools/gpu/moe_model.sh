#!/usr/bin/env bash
# transformers' Qwen3-MoE under the batch-invariant mode on one H200, in about 6 minutes (limits 150 s + 150 s + 85 s):
# 1. the model audit on the Qwen3-30B-A3B widths, 2 layers, BF16: batch invariance, padding, trainer vs rollout,
#    KV-cache decode vs trainer, backward repeat with the router aux loss, default-mode drift, routed ops;
# 2. the model bench on the same model: speed ratios of the model and of one MoE block vs transformers' own block;
# 3. the MoE-block tests on cuda (tests/test_mode_moe.py: the block against an FP64 oracle, a tiny model's log-probs
#    alone vs in a batch, state dict, router logits and aux loss, masked routes, strict, torch.compile; the
#    gpu-marked ones at Qwen3-30B-A3B widths: the router's choice alone vs in 4096 tokens, a block's tokens alone vs
#    in 2048 and its backward run to run) and the model audit's MoE tests.
# Each step has a time limit; the run goes on after a failure and exits non-zero if any step failed. Everything
# lands under $OUT: versions.txt, steps.txt, <step>.log, pytest-moe-model.xml, model-audit/ (report.md,
# report.json, rows.jsonl, model.md, model.json), model-bench/ (report.md, report.json, rows.jsonl).
# Usage: OUT=/path/to/results bash tools/gpu/moe_model.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${OUT:?set OUT to the results folder}"

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

step model-audit-moe "${MOE_MODEL_AUDIT_LIMIT:-150}" env DETKIT_MODEL_CONFIG=qwen3-moe-30b-a3b \
  python -m detkit audit --device cuda --suite model --no-progress --out "$OUT/model-audit"
step model-bench-moe "${MOE_MODEL_BENCH_LIMIT:-150}" env DETKIT_MODEL_CONFIG=qwen3-moe-30b-a3b \
  python -m detkit bench model --device cuda --out "$OUT/model-bench"
step pytest-moe-model "${MOE_MODEL_TESTS_LIMIT:-85}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra \
  -p no:cacheprovider --junitxml "$OUT/pytest-moe-model.xml" tests/test_mode_moe.py tests/test_model_audit.py -k "moe and not fp8"
echo "== $(date -u +%H:%M:%S) finished (failed=$failed)"
exit "$failed"
