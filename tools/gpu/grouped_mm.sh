#!/usr/bin/env bash
# detkit mode's grouped GEMM route (aten::_grouped_mm on kernels/grouped) on one H100 or H200: the family's and the
# route's GPU tests (bounds against FP64 at MoE widths, batch invariance, invalid offsets as NaN, CUDA-graph capture,
# the unrouted fallback, tiny transformers Mixtral and gpt-oss under the mode, compiled graphs, torch's combine and
# router sums at any batch), then tools/grouped_mm_bench.py: detkit's grouped GEMMs against torch._grouped_mm at MoE
# shapes (E 8-128, H 2048-4096, I 768-14336, T*K rows 2048-65536), each op validated then timed, eager and CUDA graph,
# with candidate configs' bits and times. About 6-9 minutes.
#
#   OUT=/path/to/results tools/gpu/grouped_mm.sh   (ARCHIVE=... puts the refreshed .tgz elsewhere than $OUT.tgz)
#
# Writes $OUT/pytest-grouped.log (+ .xml), $OUT/pytest-mode-moe.log (+ .xml), $OUT/bench.log, $OUT/grouped.json
# (one row per case, op and impl), $OUT/versions.txt and $OUT/steps.txt (each step's exit status: 0 passed, 124
# stopped at its time limit). Exits non-zero if any step failed.
set -euo pipefail

: "${OUT:?set OUT to the folder for the results}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

step pytest-grouped "${GROUPED_TESTS_LIMIT:-240}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra \
  -p no:cacheprovider --junitxml "$OUT/pytest-grouped.xml" tests/test_grouped.py tests/test_mode_grouped.py \
  tests/test_mode_compile.py
step pytest-mode-moe "${GROUPED_MOE_TESTS_LIMIT:-150}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra \
  -p no:cacheprovider --junitxml "$OUT/pytest-mode-moe.xml" tests/test_mode_moe.py tests/test_mode_moe_fp8.py \
  -k "not_cover or does_not_cover"
step bench "${GROUPED_BENCH_LIMIT:-420}" python -m tools.grouped_mm_bench --device cuda --configs \
  --json "$OUT/grouped.json"

exit "$failed"
