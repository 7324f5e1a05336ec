#!/usr/bin/env bash
# The product benchmarks' runner on one H200: `detkit bench moe` at the reference preset (BF16, FP8, torch and
# transformers side by side, with the stages) and `detkit bench moe-sweep --quick` (the reference
# and Qwen3-30B-A3B shapes at T 1024/8192/16384, both routings: every MoE speed target is evaluated). Each run
# writes rows.jsonl, report.json, report.md (and plots) under $OUT/<step>/, its log to $OUT/<step>.log and its
# exit status to $OUT/steps.txt; a failed step does not stop the next. About 3-4 minutes with a cold Triton cache.
# Usage, from a checkout's root: OUT=/path/to/results bash tools/gpu/bench_smoke.sh
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p "$OUT"

# shellcheck source=tools/gpu_steps.sh
source tools/gpu_steps.sh  # step NAME LIMIT_S CMD...: a time limit, a log, steps.txt, failed=1 on failure

python -m detkit env --json > "$OUT/env.json" 2> "$OUT/env.err" || true
step moe 150 python -m detkit bench moe --device cuda --preset reference --rounds 3 --out "$OUT/moe"
step moe-sweep 100 python -m detkit bench moe-sweep --device cuda --quick --rounds 2 --out "$OUT/moe-sweep"
python - "$OUT" <<'PY' || failed=1
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for step in ("moe", "moe-sweep"):
    path = out / step / "report.json"
    if not path.is_file():
        print(f"{step}: no report.json"); continue
    report = json.loads(path.read_text())
    meta, rows = report["meta"], report["rows"]
    print(f"{step}: {sum(r['passed'] for r in rows)}/{len(rows)} rows passed; tables "
          f"{[(t['name'], t['version']) for t in meta['config_tables']]}; source {meta['source'].get('status')}")
    for target in meta.get("derived", {}).get("targets", []):
        print(f"  {target['target']}: {target['value']} -> {target['verdict']}")
    for v in meta.get("derived", {}).get("verdicts", []):
        print(f"  {v['target']} {v['timing']} {v['case']}: {v['value']} -> {v['verdict']}")
PY
exit "$failed"
