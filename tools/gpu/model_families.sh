#!/usr/bin/env bash
# The model audit's family matrix at real widths, 2 layers each, on one H100/H200, sized for about 8 minutes: Llama-3 8B,
# Qwen2.5 7B, Qwen3 8B, Qwen3-MoE 30B-A3B, Mistral 7B, Gemma-2 9B, Gemma-3 12B, Phi-3-medium, OLMo-2 7B, gpt-oss-20b,
# DeepSeek-V3 (64 routed experts), Mixtral-8x7B and GLM-4.5-Air widths (toolkit/models.py FAMILIES), random init,
# BF16. Per model, detkit mode's checks under strict (refusals named), batch invariance, padding, trainer vs rollout,
# KV-cache decode vs trainer, generate (sampling, left-padded prompts) vs the trainer's forward, routing decisions
# (MoE), serving (transformers' continuous batching, requests arriving while others decode, sampling) vs the
# trainer's forward, backward repeat, routed ops; default mode's drift beside them. One step per family, each with
# its own time limit, so one family's failure or hang does not stop the rest; the run exits non-zero if any step
# failed. Everything lands under $OUT: versions.txt, steps.txt, <family>.log and <family>/ (report.md, report.json,
# rows.jsonl, model.md and model.json with the family x check table), then $OUT/model.md / model.json merged over all.
# DeepSeek-V3's MLA attention (value head dim 128 != query/key 192) runs on the kernel (masked head-dim loads; its
# trainer's autograd path zero-padded to 256). Steps that fail by design, so the run exits non-zero: DeepSeek-V3, whose
# serving row fails inside transformers (its paged cache's write does not take MLA's keys), and on transformers >= 5.24
# Gemma-2 and gpt-oss, whose serving row fails there too (its continuous batching refuses the "detkit" attention
# implementation name); read the table. On one
# H100 before the serving check (reports/2026-12-06-h100-s26, calls 5 and 6) a family took 11-31 s; if the 13 steps
# do not fit one call, run the families in two calls (FAMILIES=...) with the same OUT: the merged table covers every
# family folder under $OUT.
# Usage: OUT=/path/to/results bash tools/gpu/model_families.sh
#        FAMILIES="gemma2 gpt-oss" OUT=... bash tools/gpu/model_families.sh   (a subset)
#        DRY_RUN=1 OUT=... bash tools/gpu/model_families.sh                  (print the steps, run nothing)
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the results folder}"

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

all_families="llama3 qwen2.5 qwen3 qwen3-moe mistral gemma2 gemma3 phi3 olmo2 gpt-oss deepseek-v3 mixtral glm4-moe"
read -r -a families <<< "${FAMILIES:-$all_families}"
if [[ -n "${DRY_RUN:-}" ]]; then
  for family in "${families[@]}"; do
    echo "DETKIT_MODEL_CONFIG=$family python -m detkit audit --device cuda --suite model --out $OUT/$family"
  done
  exit 0
fi

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

for family in "${families[@]}"; do
  # A family name runs the matrix path (its plan, its table, rows named "<preset>: ...") on that family alone.
  step "$family" "${FAMILY_LIMIT:-100}" env DETKIT_MODEL_CONFIG="$family" python -m detkit audit --device cuda \
    --suite model --no-progress --out "$OUT/$family"
done
# One family x check table over this call's families and any earlier call's folders under $OUT: $OUT/model.md and
# $OUT/model.json; a family without model.json (a step that failed to start or stopped at its limit) is listed as
# not finished.
done_families=()
for family in $all_families; do
  if [[ -d "$OUT/$family" || " ${families[*]} " == *" $family "* ]]; then done_families+=("$family"); fi
done
step matrix 60 python -c 'import sys; from pathlib import Path; from detkit.audits.model import merge_matrix_reports
merge_matrix_reports(Path(sys.argv[1]), [Path(sys.argv[1]) / f for f in sys.argv[2:]])' "$OUT" "${done_families[@]}"
echo "== $(date -u +%H:%M:%S) finished (failed=$failed)"
exit "$failed"
