#!/usr/bin/env bash
# Call 1 of reports/2026-12-08-*-s39 (one H100 or H200):
# - tests-fused: the fused RMSNorm and rotary and their mode routes (their bits against transformers' ops under the
#   mode, where torch's rsqrt and the kernel's must agree) and the row mean on the GPU; tests-paged (last): the paged
#   attention (prefetch paths included) and the host values;
# - dp-8x1k: tools.decode_profile at Qwen3-8B widths (8 layers, batch 8, 1k cache), default mode, detkit mode, and
#   detkit mode with transformers' RMSNorm and rotary on their own ops (--unfused);
# - overhead: tools.mode_overhead on CUDA (host time until queued per routed op; a Llama RMSNorm's forward under
#   no_grad: torch's eight ops against the fused route), into $OUT/overhead.json;
# - decompose: tools.paged_decompose as tools/gpu/paged_decode_decompose.sh runs it (the pinned paged paths and,
#   beside them, each key tile's table entries read one tile ahead, AttnConfigs.paged_prefetch_pages), no Nsight
#   Compute step (reports/2026-12-07-h100-s38 has the profile without prefetch).
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}
step tests-fused 80 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra \
  --junitxml "$OUT/tests-fused.xml" tests/test_mode_norms.py tests/test_mode_rotary.py tests/test_mode.py
step dp-8x1k 100 python -m tools.decode_profile --device cuda --preset qwen3-8b --layers 8 --batch 8 \
  --cache-len 1024 --steps 10 --unfused --out "$OUT/dp-8x1k"
step overhead 40 python -m tools.mode_overhead --device cuda --rounds 5 --json "$OUT/overhead.json"
step decompose 150 python -m tools.paged_decompose --out "$OUT/decomp" --case=1x1024 --case=1x8192 --case=8x8192 \
  --case=1x32768
step tests-paged 90 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra \
  --junitxml "$OUT/tests-paged.xml" tests/test_attention_paged.py tests/test_attention_host_values.py
exit "$failed"
