#!/usr/bin/env bash
# Session call 2 (one H100/H200): the experts interface route's GPU tests, its bench per family (transformers'
# grouped_mm experts vs the same module under the mode, T=8192), the Qwen3-MoE block under the mode vs its own.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step experts-tests 200 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra -p no:cacheprovider \
  tests/test_mode_experts.py tests/test_mode_moe.py tests/test_mode_moe_fp8.py tests/test_mode_grouped.py
pack
step experts-bench 230 python -m tools.experts_bench --device cuda --json "$OUT/experts.json"
pack
step moe-block 120 python -m detkit bench moe --device cuda --preset qwen3-30b-a3b --impl hf --impl hf_detkit \
  --out "$OUT/moe-block"
pack
exit "$failed"
