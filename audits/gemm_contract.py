"""The numerical contract for det_gemm: every element within the derived bound of an FP64 oracle
from the same BF16 inputs; drift statistics against FP64 and FP32 oracles recorded beside it."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from detkit.audits.gemm_common import launch
from detkit.kernels.det_gemm.launch import REFERENCES
from detkit.toolkit.contract import bf16_ordinal, check_bound, drift_stats, gemm_bound
from detkit.toolkit.fixtures import GemmCase, operands
from detkit.toolkit.harness import Row, RunContext
from detkit.toolkit.nvtx_ranges import nvtx_range
from detkit.toolkit.presets import GEMM_PRESETS

NAME = "gemm_contract"
DESCRIPTION = "fwd/dA/dB within the derived per-element bound of an FP64 oracle"
OPS = ("fwd", "da", "db")


def reduced_extent(case: GemmCase) -> int:
    return {"fwd": case.k, "da": case.n, "db": case.m}[case.op]


def oracle(op: str, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c*, |A| @ |B|) in FP64 from the same BF16 operands."""
    ref = REFERENCES[op]
    return ref(x, y, torch.float64), ref(x.abs(), y.abs(), torch.float64)


# Histogram bins of the per-element drift against the FP64 oracle, kept as counts in each row so a
# report can sum them per op (docs/reports.md, drift_hist.png). ULP distance to the oracle rounded
# to BF16: 0 means correctly rounded. Relative error |c - c*| / |c*| over elements with c* != 0.
ULP_BINS = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, None))
REL_EDGES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)


def drift_histogram(c: torch.Tensor, c_star: torch.Tensor, bound: torch.Tensor) -> dict[str, dict[str, int]]:
    """``{"ulp": {bin: count}, "rel": {bin: count}}`` of ``c`` against the FP64 oracle ``c_star``, over the
    elements ``drift_stats`` takes them on: |c*| > bound (near zero they say nothing; its ``near_zero``
    counts the rest)."""
    defined = c_star.abs() > bound
    ulp = (bf16_ordinal(c) - bf16_ordinal(c_star.to(torch.bfloat16))).abs()[defined]
    ulp_hist = {}
    for lo, hi in ULP_BINS:
        label = str(lo) if lo == hi else (f">={lo}" if hi is None else f"{lo}-{hi}")
        sel = ulp >= lo if hi is None else (ulp >= lo) & (ulp <= hi)
        ulp_hist[label] = int(sel.sum())
    rel = (c.double() - c_star).abs()[defined] / c_star.abs()[defined]
    rel_hist = {"0": int((rel == 0).sum())}
    lower = 0.0
    for edge in REL_EDGES:
        rel_hist[f"<={edge:g}"] = int(((rel > lower) & (rel <= edge)).sum())
        lower = edge
    rel_hist[f">{REL_EDGES[-1]:g}"] = int((rel > REL_EDGES[-1]).sum())
    return {"ulp": ulp_hist, "rel": rel_hist}


def checked_columns(rows: int, cols: int, max_elements: int | None) -> list[tuple[int, int]]:
    """The output column ranges the contract checks: all, or with more than ``max_elements`` elements the first and
    the last columns, ``max_elements`` elements together (at least one column each)."""
    if max_elements is None or rows * cols <= max_elements:
        return [(0, cols)]
    width = max(1, max_elements // (2 * rows))
    return [(0, width), (cols - width, cols)]


def column_operands(op: str, x: torch.Tensor, y: torch.Tensor, start: int, stop: int):
    """The operands whose product is columns [start, stop) of the output (fwd: b's columns; dA: b's rows, the
    output's columns being K; dB: dc's columns)."""
    if op == "da":
        return x, y[start:stop]
    return x, y[:, start:stop]


def run(ctx: RunContext) -> Iterator[Row]:
    preset = GEMM_PRESETS[ctx.preset]
    for op in OPS:
        for k, n in preset.kn_shapes:
            for m in preset.m_values:
                for layout in (preset.layouts if op != "db" else ("kn",)):
                    case = GemmCase(op, m, n, k, layout, ctx.seed, preset.device_draws)
                    x, y = operands(case, ctx.device)
                    with nvtx_range(f"contract {case.name}"):
                        c, info = launch(op, x, y)
                    spans = checked_columns(c.shape[0], c.shape[1], preset.contract_max_elements)
                    if len(spans) > 1:
                        c = torch.cat([c[:, a:b] for a, b in spans], dim=1)
                        parts = [column_operands(op, x, y, a, b) for a, b in spans]
                        c_star = torch.cat([REFERENCES[op](*p, torch.float64) for p in parts], dim=1)
                        abs_ab = torch.cat([REFERENCES[op](p[0].abs(), p[1].abs(), torch.float64) for p in parts],
                                           dim=1)
                        c_fp32 = torch.cat([REFERENCES[op](*p) for p in parts], dim=1)
                    else:
                        c_star, abs_ab = oracle(op, x, y)
                        c_fp32 = REFERENCES[op](x, y)
                    bound = gemm_bound(c_star, abs_ab, reduced_extent(case))
                    result = check_bound(c, c_star, bound)
                    stats = {**drift_stats(c, c_star, "fp64", bound), **drift_stats(c, c_fp32, "fp32")}
                    details = {"config": info.config.label(), **result.as_row(), **stats,
                               "fp64_hist": drift_histogram(c, c_star, bound)}
                    if len(spans) > 1:
                        details["checked_columns"] = spans
                    yield Row(suite=NAME, check="bound", name=f"contract {case.name}", passed=result.passed,
                              backend=ctx.backend, details=details)
