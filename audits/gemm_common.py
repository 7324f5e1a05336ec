"""Inputs and operators shared by the det_gemm audits: one place builds the seeded operands of each
op, so every audit and the fresh-process worker draw the same bits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from detkit.kernels.det_gemm import LAUNCHERS, case_name
from detkit.toolkit.fixtures import bf16_randn, weight_kn


@dataclass(frozen=True)
class GemmCase:
    op: str  # fwd | da | db
    m: int
    n: int
    k: int
    layout: str  # kn | linear: how the weight b [K, N] is stored (fwd and dA)
    seed: int

    @property
    def name(self) -> str:
        suffix = f" b={self.layout}" if self.op != "db" else ""
        return case_name(self.op, self.m, self.n, self.k) + suffix


def operands(case: GemmCase, device: torch.device, m_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two operands of ``case``: (a, b) for fwd, (dc, b) for dA, (a, dc) for dB.

    The M-sized operand is drawn at ``m_rows`` (default case.m) rows; smaller M values are cut from
    it by the batch-invariance audit, so a row's values do not depend on M.
    """
    rows = case.m if m_rows is None else m_rows
    if case.op == "fwd":
        return (bf16_randn((rows, case.k), case.seed, device),
                weight_kn(case.k, case.n, case.seed + 1, case.layout, device))
    if case.op == "da":
        return (bf16_randn((rows, case.n), case.seed + 2, device),
                weight_kn(case.k, case.n, case.seed + 1, case.layout, device))
    if case.op == "db":
        return (bf16_randn((rows, case.k), case.seed, device),
                bf16_randn((rows, case.n), case.seed + 2, device, scale=case.m**-0.5))
    raise ValueError(f"op {case.op!r} is not supported; supported: fwd, da, db")


def launch(op: str, x: torch.Tensor, y: torch.Tensor, **kwargs):
    return LAUNCHERS[op](x, y, **kwargs)
