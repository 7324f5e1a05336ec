"""The numerical contract for det_gemm: every element within the derived bound of an FP64 oracle
from the same BF16 inputs; drift statistics against FP64 and FP32 oracles recorded beside it."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from audits.gemm_common import GemmCase, launch, operands
from kernels.det_gemm import REFERENCES
from toolkit.contract import check_bound, drift_stats, gemm_bound
from toolkit.fixtures import LAYOUTS
from toolkit.harness import Row, RunContext
from toolkit.nvtx_ranges import nvtx_range
from toolkit.presets import GEMM_PRESETS

NAME = "gemm_contract"
DESCRIPTION = "fwd/dA/dB within the derived per-element bound of an FP64 oracle"
OPS = ("fwd", "da", "db")


def reduced_extent(case: GemmCase) -> int:
    return {"fwd": case.k, "da": case.n, "db": case.m}[case.op]


def oracle(op: str, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c*, |A| @ |B|) in FP64 from the same BF16 operands."""
    ref = REFERENCES[op]
    return ref(x, y, torch.float64), ref(x.abs(), y.abs(), torch.float64)


def run(ctx: RunContext) -> Iterator[Row]:
    preset = GEMM_PRESETS[ctx.preset]
    for op in OPS:
        for k, n in preset.kn_shapes:
            for m in preset.m_values:
                for layout in (LAYOUTS if op != "db" else ("kn",)):
                    case = GemmCase(op, m, n, k, layout, ctx.seed)
                    x, y = operands(case, ctx.device)
                    with nvtx_range(f"contract {case.name}"):
                        c, info = launch(op, x, y)
                    c_star, abs_ab = oracle(op, x, y)
                    result = check_bound(c, c_star, gemm_bound(c_star, abs_ab, reduced_extent(case)))
                    stats = {**drift_stats(c, c_star, "fp64"), **drift_stats(c, REFERENCES[op](x, y), "fp32")}
                    yield Row(suite=NAME, check="bound", name=f"contract {case.name}", passed=result.passed,
                              backend=ctx.backend, details={"config": info.config.label(), **result.as_row(), **stats})
