#!/usr/bin/env bash
# The ranks that `detkit audit --suite all` starts itself, on NCCL: on a host with 2 GPUs, the tp-cp
# suite as one 2-rank TP group (0,1) and one 2-rank CP group (0,2), started by
# toolkit.dist.run_on_local_ranks (toolkit.launch.LocalRanks: torchrun's variables, a store hosted by
# the parent), then merged as the CLI merges them. Writes everything under $OUT.
#   OUT=/tmp/out bash tools/gpu/local_ranks_nccl.sh
set -euo pipefail
: "${OUT:?set OUT to an empty folder}"
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 DETKIT_DIST_TIMEOUT_S=${DETKIT_DIST_TIMEOUT_S:-300}
unset TRITON_INTERPRET
nvidia-smi -L >"$OUT/gpus.txt" 2>&1 || true
rc=0
timeout 240 python - "$OUT" <<'PY' >"$OUT/run.log" 2>&1 || rc=$?
import json, sys, time
from pathlib import Path

import torch

from detkit.toolkit import dist, harness
from detkit.toolkit.launch import local_rank_runs

out = Path(sys.argv[1]) / "audit"
gpus = torch.cuda.device_count()
runs = local_rank_runs("cuda", gpus)
print(f"{gpus} GPU(s): runs {[(r.label, r.nproc, r.world) for r in runs]}", flush=True)
if not runs:
    sys.exit("needs at least 2 GPUs")
ctx = harness.resolve_context("cuda", None, 1234, out)
started = time.monotonic()
results = dist.run_on_local_ranks(runs, ["tp-cp"], ctx, out, echo=print)
meta, failed_rows, lines = dist.rank_run_meta(results, ctx.backend)
summary = {"seconds": round(time.monotonic() - started, 1), "runs": meta["rank_runs"], "failed": lines,
           "rows": sum(len(r.rows) for r in results),
           "failed_rows": sum(not row.passed for r in results for row in r.rows) + len(failed_rows)}
(out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
print(json.dumps(summary, indent=2, default=str))
sys.exit(1 if lines or summary["failed_rows"] else 0)
PY
echo "exit $rc" | tee "$OUT/exit.txt"
tail -n 40 "$OUT/run.log"
exit "$rc"
