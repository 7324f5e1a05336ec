"""Pure-torch references for det_gemm (fwd, dA, dB): the exact products accumulated in FP32 or FP64 and left
unrounded, what every test and audit compares the kernels' bits and error bounds to."""

from __future__ import annotations

import torch


def det_gemm_fwd_ref(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``a @ b`` in ``dtype`` (float32 or float64), unrounded."""
    return a.to(dtype) @ b.to(dtype)


def det_gemm_da_ref(dc: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dc.to(dtype) @ b.to(dtype).t()


def det_gemm_db_ref(a: torch.Tensor, dc: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return a.to(dtype).t() @ dc.to(dtype)
