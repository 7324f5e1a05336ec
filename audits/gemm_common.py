"""The launch the det_gemm audits share; their seeded operands are toolkit.fixtures' ``GemmCase`` / ``operands``."""

from __future__ import annotations

import torch

from detkit.kernels.det_gemm.launch import LAUNCHERS


def launch(op: str, x: torch.Tensor, y: torch.Tensor, **kwargs):
    return LAUNCHERS[op](x, y, **kwargs)
