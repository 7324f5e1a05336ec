#!/usr/bin/env bash
# The grouped GEMM family's TMA variant against its pointer kernels (issue #49 part 5) on one H100 or H200: the TMA
# variant's tests (bits equal to the pointer kernels' and the references' at uneven groups, both weight layouts, the
# refusals, and the gpu-marked ones at MoE widths: TMA bits == pointer bits, CUDA-graph replay, NaN on invalid
# offsets), the family's gpu-marked tests, then tools/grouped_mm_bench.py: torch._grouped_mm, the pinned config
# (pointer loads) and the TMA candidates per op (up, down, up_dgrad; up_wgrad once per case), both weight layouts, at
# T = 2048, 8192, 16384 tokens of Mixtral-8x7B, gpt-oss-20b, DeepSeek-V3 (scaled: 64 experts) and Qwen3-30B-A3B
# widths, each validated against FP64, each candidate's bits compared with the pinned config's, timed by CUDA-graph
# replay (GPU time). About 150-200 s, most of it Triton compiles (the bench's kernels per model: G_POW2 follows E).
#
#   OUT=/path/to/results tools/gpu/grouped_tma.sh   (DRY_RUN=1: print the steps; ARCHIVE=...: the .tgz elsewhere)
#
# Writes $OUT/pytest-grouped-tma.log (+ .xml), $OUT/pytest-grouped-gpu.log (+ .xml), $OUT/bench.log,
# $OUT/grouped-tma.json (one row per case, weights, op and impl; the candidates' configs, bits and errors),
# $OUT/versions.txt and $OUT/steps.txt (each step's exit status: 0 passed, 124 stopped at its time limit). Exits
# non-zero if any step failed.
set -euo pipefail

: "${OUT:?set OUT to the folder for the results}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure
plan_only_if_dry_run

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

step pytest-grouped-tma "${GROUPED_TMA_TESTS_LIMIT:-150}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra \
  -p no:cacheprovider --junitxml "$OUT/pytest-grouped-tma.xml" tests/test_grouped_tma.py
step pytest-grouped-gpu "${GROUPED_GPU_TESTS_LIMIT:-60}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra \
  -p no:cacheprovider -m gpu --junitxml "$OUT/pytest-grouped-gpu.xml" tests/test_grouped.py
# Graph timing only, 2 rounds of 10 replays, the first two TMA candidates of each op (the pinned tile's twin and
# one more; each candidate is a compile per model): the ratios the issue asks about (GPU time) within the budget.
step bench "${GROUPED_TMA_BENCH_LIMIT:-240}" python -m tools.grouped_mm_bench --device cuda \
  --model mixtral-8x7b --model gpt-oss-20b --model deepseek-v3-scaled --model qwen3-30b-a3b \
  --tokens 2048 8192 16384 --weights transposed kn --configs --variants tma --max-candidates 2 \
  --impls torch detkit --timings graph --rounds 2 --replays 10 --json "$OUT/grouped-tma.json"

exit "$failed"
