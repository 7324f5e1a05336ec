#!/usr/bin/env bash
# detkit attention on one H200 (sm_90), one call of about 5 minutes (step limits sum to 470 s, under 8 minutes):
#   warm   compile every attention kernel variant the later steps launch, in parallel processes sharing one
#          Triton cache (compiles are per process and single-threaded; the GPU steps then find them cached)
#   tests  DETKIT_TEST_DEVICE=cuda pytest of tests/test_attention*.py: the CPU tests' tiny shapes on the real
#          kernels, plus the gpu-marked tests at Qwen3-8B shapes (decode/prefill/chunked/padding/varlen bitwise,
#          FP64 bounds, backward repeat, SDPA flash)
#   audit  detkit audit --suite attention --device cuda (every decode token of 2100, chunked prefill, batch,
#          padding, static cache, masks, varlen; fwd+bwd repetitions and fresh process; FP64 bounds)
#   bench  the attention bench plug-in against SDPA flash (prefill, decode, fwd+bwd at Qwen3-8B shapes) and the
#          paged decode against the contiguous one
#   sweep  candidate tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) for fwd, dkdv and dq at head_dim 128 and 64:
#          CUDA-graph times at prefill, decode and fwd+bwd shapes beside SDPA flash, and each fwd candidate's
#          decode-vs-prefill bits, to pin the table from
# Everything lands in $OUT (and $OUT/attention.tgz after every step). Each step has its own time limit; the run
# goes on after a failed step, and the exit status is non-zero if any step failed.
# Usage: OUT=<dir> bash tools/gpu/attention.sh [warm|tests|audit|bench|sweep|all]...   DRY_RUN=1 prints the plan.
set -euo pipefail
OUT=${OUT:-results/attention-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
WORK=$(mktemp -d)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$WORK/triton-cache}
steps=("${@:-all}")
failed=0

want() { [[ " ${steps[*]} " == *" $1 "* || " ${steps[*]} " == *" all "* ]]; }
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
pack() { tar -czf "$OUT/attention.tgz" --exclude attention.tgz -C "$OUT" . 2>/dev/null || true; }
# step NAME LIMIT_S CMD...: run with a time limit, log to $OUT/NAME.log, record the exit status in $OUT/steps.txt.
step() {
  local name=$1 limit=$2 rc=0; shift 2
  stamp "$name (limit ${limit}s): $*"
  if [[ ${DRY_RUN:-0} == 1 ]]; then return 0; fi
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  echo "$name rc=$rc" | tee -a "$OUT/steps.txt"
  tail -12 "$OUT/$name.log" || true
  if [[ $rc != 0 ]]; then failed=1; fi
  pack
}

# ---- the Python each step runs (written here: tools/ holds only this script) ----------------------------------
cat > "$WORK/warm.py" <<'EOF'
"""Worker I of N: launch a share of the kernel variants once at tiny shapes (same specialisation as the real
shapes: lengths, batch and head counts are not specialised, strides are multiples of 16)."""
import sys
import torch
from detkit.kernels.attention import AttnConfigs, attention, attention_varlen
from detkit.kernels.attention.configs import select_configs
from sweep_candidates import CANDIDATES, SPLIT

worker, workers = int(sys.argv[1]), int(sys.argv[2])
dev = torch.device("cuda")
jobs = []
for d in (128, 64):
    pinned = select_configs("cuda_sm90", d)
    for hq, hkv in ((4, 1), (4, 2), (2, 2)):  # groups of 4 (Qwen3-8B), 2 and 1 (tests)
        for flags in ("plain", "start", "end", "start_end", "varlen", "split"):
            jobs.append(("fwd", d, hq, hkv, flags, pinned))
        for flags in ("plain", "start", "varlen"):
            jobs.append(("bwd", d, hq, hkv, flags, pinned))
    for hq, hkv in ((6, 2), (32, 1)):  # the tests' awkward groups (3 heads; more heads than a tile's rows)
        jobs += [("fwd", d, hq, hkv, "start", pinned), ("bwd", d, hq, hkv, "start", pinned)]
    for cfg in CANDIDATES["fwd"][d]:
        jobs.append(("fwd", d, 32, 8, "plain", AttnConfigs(cfg, pinned.dkdv, pinned.dq)))
        jobs.append(("fwd", d, 32, 8, "plain", AttnConfigs(cfg, pinned.dkdv, pinned.dq, SPLIT)))
    for cfg in CANDIDATES["dkdv"][d]:
        jobs.append(("bwd", d, 32, 8, "plain", AttnConfigs(pinned.fwd, cfg, pinned.dq)))
    for cfg in CANDIDATES["dq"][d]:
        jobs.append(("bwd", d, 32, 8, "plain", AttnConfigs(pinned.fwd, pinned.dkdv, cfg)))
for n, (kind, d, hq, hkv, flags, cfgs) in enumerate(jobs):
    if n % workers != worker:
        continue
    grad = kind == "bwd"
    try:
        s, b = (600, 1) if flags == "split" else (48, 2)  # "split": a decode step over 2 key splits (split grid)
        q = torch.randn(b, hq, 1 if flags == "split" else s, d, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        kw = {}
        if "start" in flags:
            kw["kv_start"] = torch.tensor([0, 3], dtype=torch.int32, device=dev)
        if "end" in flags:
            kw["kv_end"] = torch.tensor([s, s - 5], dtype=torch.int32, device=dev)
        leaves = [t.requires_grad_(grad) for t in (q, k, v)]
        if flags == "varlen":
            cu = torch.tensor([0, s, 2 * s], dtype=torch.int32, device=dev)
            packed = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in leaves]
            o = attention_varlen(*packed, cu, cu, s, s, configs=cfgs)
        else:
            o = attention(*leaves, configs=cfgs, **kw)
        if grad:
            o.backward(torch.randn_like(o))
        torch.cuda.synchronize()
    except Exception as exc:  # a candidate that does not build is reported by the sweep; keep warming the rest
        print(f"warm job {n} {kind} D={d} {flags} {cfgs.label()}: {type(exc).__name__}: {str(exc)[:200]}")
print(f"worker {worker}: done")
EOF

cat > "$WORK/sweep_candidates.py" <<'EOF'
"""The tiles the sweep times (spill-free in the offline sm_90 compile unless noted), and the split-heads option's
threshold (one query head per program when the forward grid is smaller: small-batch decode)."""
from detkit.kernels.attention import AttnConfig as C

SPLIT = 2 * 132

CANDIDATES = {
    "fwd": {
        128: [C(128, 64, 8, 2), C(128, 64, 8, 3), C(128, 128, 8, 2), C(128, 128, 8, 3), C(64, 64, 4, 2),
              C(64, 64, 4, 3), C(64, 64, 4, 4), C(64, 128, 4, 2)],  # the last spills 16 bytes
        64: [C(128, 64, 4, 3), C(128, 64, 4, 4), C(128, 128, 8, 2), C(128, 128, 8, 3), C(64, 64, 4, 3),
             C(64, 64, 4, 4), C(128, 64, 8, 3), C(128, 128, 4, 3)],
    },
    "dkdv": {
        128: [C(32, 128, 8, 2), C(32, 128, 8, 3), C(64, 64, 8, 2), C(32, 64, 4, 2)],  # the last two spill a little
        64: [C(64, 128, 8, 2), C(64, 64, 4, 3), C(32, 64, 4, 3), C(64, 128, 8, 3)],
    },
    "dq": {
        128: [C(128, 64, 8, 2), C(64, 64, 4, 2), C(128, 32, 8, 2), C(64, 32, 4, 3), C(128, 64, 8, 3)],
        64: [C(128, 64, 8, 2), C(64, 64, 4, 3), C(128, 128, 8, 2), C(128, 64, 4, 3), C(64, 32, 4, 3)],
    },
}
EOF

cat > "$WORK/sweep.py" <<'EOF'
"""Time every candidate tile beside SDPA flash (CUDA-graph replay, interleaved per shape) and check each fwd
candidate's decode-vs-prefill bits; write sweep.jsonl and sweep.md."""
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch
from tabulate import tabulate

from detkit.bench.attention import BenchCase, _graph_sets, detkit_call, make_inputs, sdpa_call, sdpa_gqa_mode
from detkit.kernels.attention import attention
from detkit.kernels.attention.configs import select_configs
from detkit.toolkit.contract import compare_bits
from detkit.toolkit.timing import time_graphs
from sweep_candidates import CANDIDATES, SPLIT

out = Path(sys.argv[1])
dev = torch.device("cuda")
HEADS, BITS_SEQ, POSITIONS, CHUNK = (32, 8), 1100, (0, 63, 64, 127, 128, 129, 700, 1099), 300
FWD_SHAPES = {"prefill B1 S4096": (1, 4096, 4096), "prefill B8 S1024": (8, 1024, 1024),
              "decode B1 K32768": (1, 1, 32768), "decode B8 K8192": (8, 1, 8192), "decode B64 K8192": (64, 1, 8192)}
BWD_SHAPES = {"fwd_bwd B1 S4096": (1, 4096, 4096)}
rows = []


def emit(row):
    rows.append(row)
    with open(out / "sweep.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def bits_ok(configs, d):
    """The candidate's own invariance: decode and chunked prefill against its prefill, bit for bit."""
    g = torch.Generator(device=dev).manual_seed(5)
    s = BITS_SEQ
    q = torch.randn(2, HEADS[0], s, d, device=dev, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, HEADS[1], s, d, device=dev, generator=g).to(torch.bfloat16) for _ in range(2))
    full = attention(q, k, v, configs=configs)
    bad = 0
    for i in POSITIONS:
        bad += compare_bits(attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], configs=configs),
                            full[:, :, i:i + 1]).mismatches
    parts = [attention(q[:, :, a:a + CHUNK], k[:, :, :a + CHUNK], v[:, :, :a + CHUNK], configs=configs)
             for a in range(0, s, CHUNK)]
    bad += compare_bits(torch.cat(parts, 2), full).mismatches
    return bad


def time_shape(label, mode, shape, d, variants):
    """variants: name -> AttnConfigs. One interleaved CUDA-graph timing of all of them and SDPA at one shape."""
    case = BenchCase(mode, *shape, *HEADS, d)
    sets = _graph_sets(case)
    inputs = make_inputs(case, dev, sets)
    gqa = sdpa_gqa_mode(case, inputs[0])
    fns = {"sdpa": [sdpa_call(case, inp, gqa) for inp in inputs]}
    errors = {}
    for name, cfgs in variants.items():
        try:
            fns[name] = [detkit_call(case, inp, cfgs) for inp in inputs]
            fns[name][0]()
            torch.cuda.synchronize()
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            fns.pop(name, None)
    try:
        times = time_graphs({n: (lambda fl=fl: [f() for f in fl]) for n, fl in fns.items()}, dev,
                            calls_per_fn=sets, rounds=2, replays=5)
    except Exception as exc:
        errors["*"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        times = {}
    del inputs, fns
    torch.cuda.empty_cache()
    return {n: t.median_us for n, t in times.items()}, errors


for d in (128, 64):
    pinned = select_configs("cuda_sm90", d)
    fwd = {c.label(): replace(pinned, fwd=c) for c in CANDIDATES["fwd"][d]}
    fwd.update({f"{c.label()} split<{SPLIT}": replace(pinned, fwd=c, split_heads_below=SPLIT)
                for c in CANDIDATES["fwd"][d]})
    per_shape = {label: time_shape(label, "decode" if shape[1] == 1 else "prefill", shape, d, fwd)
                 for label, shape in FWD_SHAPES.items()}
    for name, cfgs in fwd.items():
        row = {"kernel": "fwd", "head_dim": d, "config": name, "pinned": cfgs == pinned}
        try:
            row["bit_mismatches"] = bits_ok(cfgs, d)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        for label, (times, errors) in per_shape.items():
            row[f"{label} us"] = times.get(name)
            row[f"{label} sdpa us"] = times.get("sdpa")
            if name in errors or "*" in errors:
                row.setdefault("errors", {})[label] = errors.get(name) or errors.get("*")
        emit(row)
    for kernel in ("dkdv", "dq"):
        variants = {c.label(): replace(pinned, **{kernel: c}) for c in CANDIDATES[kernel][d]}
        for label, shape in BWD_SHAPES.items():
            times, errors = time_shape(label, "fwd_bwd", shape, d, variants)
            for name, cfgs in variants.items():
                emit({"kernel": kernel, "head_dim": d, "config": name, "pinned": getattr(cfgs, kernel) == getattr(pinned, kernel),
                      f"{label} us": times.get(name), f"{label} sdpa us": times.get("sdpa"),
                      **({"errors": {label: errors.get(name) or errors.get("*")}} if name in errors or "*" in errors else {})})


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


lines = ["# Attention tile sweep (H200, CUDA-graph time per call; ratio = candidate / SDPA flash)\n"]
for kernel, shapes in (("fwd", FWD_SHAPES), ("dkdv", BWD_SHAPES), ("dq", BWD_SHAPES)):
    for d in (128, 64):
        sel = [r for r in rows if r["kernel"] == kernel and r["head_dim"] == d]
        table = []
        for r in sel:
            ratios = [r.get(f"{s} us") / r[f"{s} sdpa us"] if r.get(f"{s} us") and r.get(f"{s} sdpa us") else None
                      for s in shapes]
            table.append([r["config"] + (" (pinned)" if r["pinned"] else ""), r.get("bit_mismatches", "-"),
                          *[f"{r.get(f'{s} us') or float('nan'):.1f} ({x or float('nan'):.2f}x)" for s, x in zip(shapes, ratios)],
                          geomean(ratios)])
        table.sort(key=lambda t: t[-1] if t[-1] else 1e9)
        lines.append(f"\n## {kernel}, head_dim {d}\n")
        lines.append(tabulate(table, headers=["config", "bit mismatches", *shapes, "geomean ratio"], tablefmt="github",
                              floatfmt=".3f"))
        lines.append("")
(out / "sweep.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF

cat > "$WORK/warm.sh" <<'EOF'
# The workers share TRITON_CACHE_DIR; each compiles its share of the variants. Args: OUT WORKERS.
set -uo pipefail
out=$1 n=$2 pids=() rc=0
for ((i = 0; i < n; i++)); do
  python warm.py "$i" "$n" > "$out/warm-$i.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
cat "$out"/warm-*.log
exit $rc
EOF

stamp "attention on $(hostname); OUT=$OUT; steps: ${steps[*]}"
if [[ ${DRY_RUN:-0} != 1 ]]; then
  python -m detkit env --json > "$OUT/env.json" 2> "$OUT/env.err" || true
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
  git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
fi
export PYTHONPATH=$PYTHONPATH:$WORK
if want warm; then
  # shellcheck disable=SC2016  # $1..$3 are the inner shell's arguments, expanded there
  step warm "${WARM_LIMIT:-60}" bash -c 'cd "$1" && bash warm.sh "$2" "$3"' warm "$WORK" "$OUT" "${WARM_WORKERS:-14}"
fi
if want tests; then
  step tests "${TESTS_LIMIT:-100}" env DETKIT_TEST_DEVICE=cuda python -m pytest -q -p no:cacheprovider -ra \
    -k "not offline" --junitxml="$OUT/pytest.xml" tests/test_attention.py tests/test_attention_bench.py \
    tests/test_attention_split_kv.py tests/test_attention_paged.py
fi
if want audit; then
  step audit "${AUDIT_LIMIT:-110}" python -m detkit audit --suite attention --device cuda --out "$OUT/audit" --no-progress
fi
if want bench; then
  step bench "${BENCH_LIMIT:-100}" python -m detkit bench attention --device cuda --modes prefill,decode,fwd_bwd,paged_decode --out "$OUT/bench"
fi
if want sweep; then
  step sweep "${SWEEP_LIMIT:-100}" python "$WORK/sweep.py" "$OUT"
fi
stamp "finished (failed steps: $failed)"
rm -rf "$WORK"
exit "$failed"
