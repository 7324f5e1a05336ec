#!/usr/bin/env bash
# detkit attention variants (issue #48 part 1: sliding windows, softcap, sinks, head_dim 256) on one H100/H200
# (sm_90), one call of about 6-8 minutes (step limits sum to 540 s, under the 10-minute call limit):
#   sass   offline sm_90 compiles of every pinned tile with and without the variant flags (registers, spills,
#          shared memory, wgmma count): no GPU needed, recorded beside the GPU results
#   tests  DETKIT_TEST_DEVICE=cuda pytest: the variant tests (tiny shapes on the real kernels, and the gpu-marked
#          ones at Mistral-7B, Gemma-2-9B (head_dim 256) and gpt-oss-20b heads: decode, sliding-window cache,
#          chunked prefill, batch and padding bitwise, FP64 bounds fwd+bwd, SDPA with a sliding mask), the tiny
#          Mistral / Gemma-2 / gpt-oss rollout-vs-trainer tests, tests/test_attention_mla.py (MLA's value head dim
#          zero-padded; gpu-marked at DeepSeek-V3's qk 192 / v 128) and tests/test_attention.py (the plain variant's
#          bits and bounds, unchanged)
#   audit  detkit audit --suite attention --device cuda (now with the variant_* checks for every head_dim)
#   bench  detkit bench attention --variants plain,window,softcap,sinks: plain and window against SDPA (flash for
#          plain; a sliding mask for window: torch picks the backend), softcap (Gemma-2 heads) and sinks (gpt-oss
#          heads) against transformers' eager formulation, the best torch path with them (SDPA has neither); the
#          baseline is named in every row and in the report
# Everything lands in $OUT (versions.txt, steps.txt, <step>.log, audit/, bench/, sass-<head_dim>.jsonl) and $OUT.tgz after
# every step. Each step has its own limit; the run goes on after a failed step and exits non-zero if any failed.
# Usage: OUT=<dir> bash tools/gpu/attention_variants.sh [sass|tests|audit|bench|all]...   DRY_RUN=1 prints the plan.
# On a fresh machine the compiles dominate: if one call is too short, run "sass tests" and "audit bench" as two.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the results folder}"

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

plan_only_if_dry_run
steps=("${@:-all}")
begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)/triton-cache}  # shared by the steps: compiles once

SASS_PY='
import json, sys
from tools.attention_sass import compile_sm90
from detkit.kernels.attention.configs import CONFIG_TABLE
d = int(sys.argv[1])
cfgs = CONFIG_TABLE["cuda_sm90"][d]
for kernel in ("fwd", "dkdv", "dq"):
    for on in (False, True):
        print(json.dumps(compile_sm90(kernel, getattr(cfgs, kernel), d, windowed=on, softcap=on, sinks=on)), flush=True)
'
# One process per head_dim (a compile is single-threaded).
if want sass; then
  step sass "${SASS_LIMIT:-100}" env -u TRITON_INTERPRET bash -c \
    "for d in 64 128 256; do python -c '$SASS_PY' \$d > '$OUT/sass-'\$d'.jsonl' & done; wait"
fi
if want tests; then
  step tests "${TESTS_LIMIT:-220}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra \
    -k "not offline" --junitxml="$OUT/pytest.xml" tests/test_attention_variants.py tests/test_attention_mla.py \
    tests/test_mode_attention_variants.py tests/test_attention.py
fi
if want audit; then
  step audit "${AUDIT_LIMIT:-130}" python -m detkit audit --suite attention --device cuda --out "$OUT/audit" \
    --no-progress
fi
if want bench; then
  step bench "${BENCH_LIMIT:-120}" python -m detkit bench attention --device cuda \
    --variants plain,window,softcap,sinks --modes prefill,decode,fwd_bwd --out "$OUT/bench"
fi
echo "== $(date -u +%H:%M:%S) finished (failed=$failed)"
exit "$failed"
