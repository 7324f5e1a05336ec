"""Pure-torch references of the reductions family."""

from __future__ import annotations

import torch


def row_mean_ref(x: torch.Tensor) -> torch.Tensor:
    """FP64 mean of each row (the reference for tests)."""
    return x.double().mean(dim=-1)
