#!/usr/bin/env bash
# The model bench per family (issue: dense and MoE families' speed in detkit mode against default mode): each
# family's real-width preset (toolkit/models.py FAMILIES) at each depth in LAYERS, random init, BF16, one process per
# (family, depth): prefill, decode step eager and under a CUDA graph, forward+backward, generate(); MoE models also
# their first block vs transformers' own. Default mode runs flash SDPA where the model has an SDPA path and
# transformers' default attention where it has none (Gemma-2's softcap, gpt-oss's sinks: the "detkit" implementation
# outside the mode). Then $OUT/speed.md and speed.json: family x depth x case ratios with their verdicts.
# 8 layers of the widest MoE presets (DeepSeek-V3 scaled, GLM-4.5-Air, Mixtral) do not fit one 80 GB card with their
# gradients: DEEP_FAMILIES lists those run at every depth.
# DECODE_AT (space-separated BxL list, default: the bench's one point) times the decode cases at each (batch B, cache
# length L): `bench model --decode-at` per point, each point its own column in speed.md.
# Usage: OUT=/path FAMILIES="llama3 qwen3" LAYERS="2 8" bash tools/gpu/model_speed.sh   (DRY_RUN=1: print the steps)
# Long caches (issue #50 part 5):
#   FAMILIES=qwen3 LAYERS=4 DECODE_AT="1x32768 8x32768" OUT=/path bash tools/gpu/model_speed.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the results folder}"

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh

all_families="llama3 qwen2.5 qwen3 mistral gemma2 gemma3 phi3 olmo2 qwen3-moe gpt-oss mixtral glm4-moe deepseek-v3"
read -r -a families <<< "${FAMILIES:-$all_families}"
read -r -a depths <<< "${LAYERS:-2 8}"
read -r -a points <<< "${DECODE_AT:-}"
decode_at=()
for point in ${points[@]+"${points[@]}"}; do decode_at+=(--decode-at "$point"); done
deep=" ${DEEP_FAMILIES:-llama3 qwen2.5 qwen3 mistral gemma2 gemma3 phi3 olmo2 qwen3-moe gpt-oss} "
runs=()
for family in "${families[@]}"; do
  preset=$(python -c 'import sys; from detkit.toolkit.models import FAMILIES; print(FAMILIES[sys.argv[1]][0])' \
    "$family")
  for layers in "${depths[@]}"; do
    if [[ $layers -gt 2 && $deep != *" $family "* ]]; then continue; fi
    runs+=("$family-L$layers:$preset:$layers")
  done
done
if [[ -n "${DRY_RUN:-}" ]]; then
  for run in "${runs[@]}"; do
    IFS=: read -r name preset layers <<< "$run"
    echo "python -m detkit bench model --device cuda --preset $preset --layers $layers" \
      ${decode_at[@]+"${decode_at[@]}"} "--out $OUT/$name"
  done
  exit 0
fi

begin_run
names=()
for run in "${runs[@]}"; do
  IFS=: read -r name preset layers <<< "$run"
  names+=("$OUT/$name")
  step "$name" "${RUN_LIMIT:-150}" python -m detkit bench model --device cuda --preset "$preset" --layers "$layers" \
    ${decode_at[@]+"${decode_at[@]}"} --out "$OUT/$name"
done
step speed-table 60 python -c 'import sys; from detkit.bench.model import merge_speed_reports
merge_speed_reports(sys.argv[1], sys.argv[2:])' "$OUT" "${names[@]}"
echo "== $(date -u +%H:%M:%S) finished (failed=$failed)"
exit "$failed"
