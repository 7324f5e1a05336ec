#!/usr/bin/env bash
# The batch-invariant mode on one H200, in one call of about 5 minutes: the model audit at the Qwen3-8B widths
# (2 layers; batch invariance, padding, trainer vs rollout, KV-cache decode vs trainer, backward repeat, the
# default-mode drift table, routed ops), the model bench on the same model (the speed ratios prefill / decode eager /
# decode CUDA graph / forward+backward), then the mode's GPU tests (eager, torch.compile, CUDA-graph capture,
# attention wiring, the audit's and the bench's own tests). Each step has a time limit; the run goes on after a
# failure and exits non-zero if any step failed. Everything lands under $OUT: versions.txt, steps.txt, <step>.log,
# model-audit/ (report.md, report.json, rows.jsonl, model.md, model.json), model-bench/ (report.md, report.json,
# rows.jsonl).
# Usage: OUT=/path/to/results bash tools/gpu/mode.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the results folder}"

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

step model-audit "${MODEL_AUDIT_LIMIT:-200}" python -m detkit audit --device cuda --suite model --no-progress \
  --out "$OUT/model-audit"
step model-bench "${MODEL_BENCH_LIMIT:-150}" python -m detkit bench model --device cuda --out "$OUT/model-bench"
step pytest-mode "${MODE_TESTS_LIMIT:-150}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra \
  tests/test_mode.py tests/test_mode_compile.py tests/test_mode_attention.py tests/test_model_audit.py \
  tests/test_bench_model.py tests/test_timing.py
echo "== $(date -u +%H:%M:%S) finished (failed=$failed)"
exit "$failed"
