"""Small builders the attention kernel tests share: int32 index tensors, cu_seqlens from lengths, and the config
table's entry forced onto each forward path."""

import dataclasses

import torch

from detkit.kernels.attention.configs import select_configs
from tests.conftest import backend_of


def i32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def cu_seqlens(lens, device) -> torch.Tensor:
    """int32 [0, l0, l0 + l1, ...] for sequence lengths ``lens``."""
    return i32([0, *torch.tensor(lens).cumsum(0).tolist()], device)


def forced_paths(device, head_dim: int) -> dict:
    """The table's configs forced onto each forward path: one pass, and the split grid + combine pass."""
    base = select_configs(backend_of(device), head_dim)
    return {"one_pass": dataclasses.replace(base, split_grid_below=0),
            "split_grid": dataclasses.replace(base, split_grid_below=2**62, eager_split_grid_min_keys=0)}
