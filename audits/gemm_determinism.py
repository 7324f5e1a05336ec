"""Determinism of all three det_gemm ops: identical bits over repetitions and in a fresh process;
dB unchanged by appended zero rows (its reduction order over M is fixed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict

import torch

from detkit.audits.gemm_common import launch
from detkit.toolkit.contract import compare_bits, digest
from detkit.toolkit.fixtures import GemmCase, operands
from detkit.toolkit.harness import Row, RunContext
from detkit.toolkit.nvtx_ranges import nvtx_range
from detkit.toolkit.presets import GEMM_PRESETS

NAME = "gemm_determinism"
DESCRIPTION = "fwd/dA/dB: same bits over repetitions and in a fresh process; dB ignores zero rows"
OPS = ("fwd", "da", "db")
ZERO_ROWS = 61
FRESH_PROCESS_TIMEOUT_S = 1800


def _cases(ctx: RunContext) -> list[GemmCase]:
    preset = GEMM_PRESETS[ctx.preset]
    ms = preset.determinism_m
    layouts = {"fwd": preset.layouts, "da": preset.layouts, "db": ("kn",)}
    return [GemmCase(op, m, n, k, layout, ctx.seed, preset.device_draws)
            for op in OPS for k, n in (preset.determinism_kn or preset.kn_shapes) for m in ms for layout in layouts[op]]


def case_digest(case: GemmCase, device: torch.device) -> str:
    return digest(launch(case.op, *operands(case, device))[0])


def _fresh_process_digests(cases: list[GemmCase], device: torch.device) -> dict[str, str]:
    """Compute every case's digest in a new Python process (same environment)."""
    payload = json.dumps({"device": str(device), "cases": [asdict(c) for c in cases]})
    proc = subprocess.run([sys.executable, "-m", "detkit.audits.gemm_determinism"], input=payload,
                          capture_output=True, text=True, timeout=FRESH_PROCESS_TIMEOUT_S, env=os.environ.copy())
    if proc.returncode != 0:
        raise RuntimeError(f"fresh-process worker failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(ctx: RunContext) -> Iterator[Row]:
    preset = GEMM_PRESETS[ctx.preset]
    cases = _cases(ctx)
    local: dict[str, str] = {}
    for case in cases:
        x, y = operands(case, ctx.device)
        with nvtx_range(f"repetitions {case.name}"):
            outs = [launch(case.op, x, y)[0] for _ in range(preset.repetitions)]
        local[case.name] = digest(outs[0])
        results = [compare_bits(o, outs[0]) for o in outs[1:]]
        worst = max(results, key=lambda r: r.mismatches)
        yield Row(suite=NAME, check="repetitions", name=f"repetitions {case.name}",
                  passed=all(r.equal for r in results), backend=ctx.backend,
                  details={"repetitions": preset.repetitions, "digest": local[case.name], **worst.as_row()})
        if case.op == "db":
            zx = torch.cat([x, torch.zeros(ZERO_ROWS, x.shape[1], dtype=x.dtype, device=x.device)])
            zy = torch.cat([y, torch.zeros(ZERO_ROWS, y.shape[1], dtype=y.dtype, device=y.device)])
            with nvtx_range(f"zero_rows {case.name}"):
                padded = launch("db", zx, zy)[0]
            result = compare_bits(padded, outs[0])
            yield Row(suite=NAME, check="db_zero_rows", name=f"db_zero_rows {case.name}", passed=result.equal,
                      backend=ctx.backend, details={"zero_rows": ZERO_ROWS, **result.as_row()})
    with nvtx_range("fresh_process gemm"):
        fresh = _fresh_process_digests(cases, ctx.device)
    for case in cases:
        same = fresh.get(case.name) == local[case.name]
        yield Row(suite=NAME, check="fresh_process", name=f"fresh_process {case.name}", passed=same,
                  backend=ctx.backend, details={"digest": local[case.name], "fresh_digest": fresh.get(case.name)})


def _worker() -> None:
    request = json.loads(sys.stdin.read())
    device = torch.device(request["device"])
    digests = {}
    for fields in request["cases"]:
        case = GemmCase(**fields)
        digests[case.name] = case_digest(case, device)
    print(json.dumps(digests))


if __name__ == "__main__":
    _worker()
