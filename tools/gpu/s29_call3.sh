#!/usr/bin/env bash
# Call 3 of reports/2026-12-06-h100-s29 (one H100 or H200): the split grid's combine pass on 16-row programs with four
# splits prefetched -- the decode sweep's pinned entry (grouped split grid) and its ungrouped twin, bits and
# CUDA-graph time against SDPA flash, into $OUT/dsweep; the attention route's host time per decode call with its
# checks cached per signature (tools/attention_host.py, torch's SDPA in the same run) into $OUT/attention-host.json;
# the model bench's long-cache decode at Qwen3-8B widths, 4 layers, into $OUT/speed; the MoE table 2026-12-06.1
# (grouped tile order for slabs of 32 MiB or more, dX on 128x256) in transformers' experts classes at Mixtral-8x7B and
# DeepSeek-V3 widths against their grouped_mm (tools/experts_bench.py) into $OUT/experts.json; a profile of the TP
# path at world size 1 against the plain model (tools/world1_profile.py) into $OUT/world1-profile.md; det_gemm's
# raw-launch GPU tests.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh
begin_run
step dsweep 110 python -m tools.attention_decode_sweep sweep --device cuda --head-dims 128 --out "$OUT/dsweep" \
  --budget-s 75 --limit 2 --finalists 0
step host 90 python -m tools.attention_host --device cuda --model --json "$OUT/attention-host.json"
step speed 130 env OUT="$OUT/speed" ARCHIVE="$OUT/speed.tgz" FAMILIES=qwen3 LAYERS=4 RUN_LIMIT=110 \
  DECODE_AT="1x32768 8x32768" bash tools/gpu/model_speed.sh
step experts 150 python -m tools.experts_bench --device cuda --family mixtral --family deepseek_v3 \
  --json "$OUT/experts.json"
step world1-profile 100 python -m tools.world1_profile --out "$OUT/world1-profile.md"
step raw-launch-tests 45 env DETKIT_TEST_DEVICE=cuda python -m pytest -q -ra -p no:cacheprovider \
  --junitxml "$OUT/pytest-raw-launch.xml" tests/test_raw_launch.py
exit "$failed"
