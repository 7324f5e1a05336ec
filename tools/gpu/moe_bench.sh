#!/usr/bin/env bash
# `detkit bench moe` on one H200, in about 4 minutes (limits 150 s + 120 s):
# 1. moe: the reference and qwen3-30b-a3b presets, every implementation side by side (BF16 and FP8 detkit layers,
#    torch._grouped_mm, transformers' Qwen3-MoE block default and under the mode), fwd and fwd_bwd, eager and CUDA
#    graph, with the BF16 and FP8 stage breakdowns: the FP8 >= 1.4x (reference) and >= 1.2x (presets) verdicts, the
#    BF16 MFU verdict at the reference shape, what the mode's swap costs on transformers' block;
# 2. moe-sweep: FP8 vs BF16 at both widths (3072x1536, 2048x768), E 8 and 128, K 2 and 8, T 2048/8192/16384 (24
#    points, no presets): the FP8 >= 1.2x verdict at T >= 8192, the crossover T per shape below that, and the BF16 MFU
#    verdict at Qwen3-30B-A3B widths, T=16384 (the E=128, K=8 point).
# Each bench gets SIGINT a little before its step's limit, so a run cut short still writes the report of the rows it
# measured (marked interrupted). Everything lands under $OUT: versions.txt, steps.txt, <step>.log, <step>/ (rows.jsonl,
# report.json, report.md), verdicts.txt. Exits non-zero if any step failed; a FAIL verdict is a result, not a failure.
# Usage: OUT=/path/to/results bash tools/gpu/moe_bench.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${OUT:?set OUT to the results folder}"

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

begin_run  # PYTHONPATH and the run's environment, $OUT, steps.txt, versions.txt

presets_limit=${MOE_BENCH_PRESETS_LIMIT:-150}
sweep_limit=${MOE_BENCH_SWEEP_LIMIT:-120}
step moe "$presets_limit" timeout -s INT $((presets_limit - 15)) \
  python -m detkit bench moe --device cuda --preset reference --preset qwen3-30b-a3b --rounds 3 --out "$OUT/moe"
step moe-sweep "$sweep_limit" timeout -s INT $((sweep_limit - 15)) \
  python -m detkit bench moe --device cuda --sweep --sweep-e 8 --sweep-e 128 --sweep-k 2 --sweep-k 8 --rounds 2 \
  --out "$OUT/moe-sweep"

python - "$OUT" > "$OUT/verdicts.txt" <<'PY' || failed=1
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for step in ("moe", "moe-sweep"):
    path = out / step / "report.json"
    if not path.is_file():
        print(f"{step}: no report.json"); continue
    meta, rows = (lambda d: (d["meta"], d["rows"]))(json.loads(path.read_text()))
    print(f"{step}: {sum(r['passed'] for r in rows)}/{len(rows)} rows passed"
          + (f" (interrupted after {meta['interrupted_after_rows']} rows)" if "interrupted_after_rows" in meta else ""))
    for v in meta.get("derived", {}).get("verdicts", []):
        if v["verdict"] != "NOT RUN":
            print(f"  {v['target']} [{v['timing']}] {v['case']}: {v['value']} -> {v['verdict']}")
    for s in meta.get("derived", {}).get("sweep", []):
        print(f"  crossover H={s['H']} I={s['I']} E={s['E']} K={s['K']} [{s['timing']}]: fit {s['crossover_T_fit']}, "
              f"measured {s['crossover_T_measured']}, FP8 slower at T {s['fp8_slower_at_T']}")
PY
cat "$OUT/verdicts.txt"
pack
echo "== $(date -u +%H:%M:%S) finished (failed=$failed)"
exit "$failed"
