"""detkit mode's route for reductions: which ``aten::mean.dim`` calls run on the batch-invariant row mean
(detkit.kernels.reductions) and the launch each signature gets. torch's CUDA softmax and log_softmax over the last
dim run one row per block or warp with a launch shape chosen from the row length alone, so they are batch-invariant
and the mode leaves them on torch (docs/mode.md)."""

from __future__ import annotations

import torch

from detkit.kernels.reductions.row_mean import DTYPES, lead_dims, row_mean_launcher

# Leading dim groups the row mean addresses (row_mean_kernel's THREE_STRIDES): a 4-D tensor's leading dims in any
# order; more groups than that are refused by name.
MAX_LEAD_GROUPS = 3


def last_dim_launcher(x: torch.Tensor, keepdim: bool):
    """``launch(t) -> t.mean(-1, keepdim)`` on ``row_mean_kernel`` for tensors of x's signature, whose
    ``last_dim_reason`` is None (checked by the caller): no views or copies per call, the kernel reads the rows
    through x's own strides -- one row stride when the leading dims view as one row dim, else up to three (e.g. a
    [B, H, S, D] transpose of a [B, S, H, D] tensor). The output is contiguous, as torch's mean allocates it."""
    h = x.shape[-1]
    out_shape = (*x.shape[:-1], 1) if keepdim else tuple(x.shape[:-1])
    rows = x.numel() // h
    lead = lead_dims(tuple(x.shape), x.stride())
    if len(lead) == 1:
        return row_mean_launcher(rows, h, lead[0][1], x.dtype, x.device, out_shape)
    return row_mean_launcher(rows, h, 0, x.dtype, x.device, out_shape, lead=lead)


def last_dim_reason(x: torch.Tensor, dim, keepdim: bool, dtype) -> str | None:
    """None when ``x.mean(dim, keepdim, dtype=dtype)`` is a mean over the last dim that ``row_mean`` runs."""
    if x.dtype not in DTYPES:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if dtype is not None and dtype != x.dtype:
        return f"output dtype {dtype} differs from the input's {x.dtype}"
    dims = [dim] if isinstance(dim, int) else list(dim or [])
    if x.dim() == 0 or [d % x.dim() for d in dims] != [x.dim() - 1]:
        return f"reduces dims {dims} of a {x.dim()}-D tensor (supported: the last dim only)"
    if x.numel() == 0:
        return "empty tensor"
    if x.stride(-1) != 1:
        return "last dim not contiguous"
    groups = len(lead_dims(tuple(x.shape), x.stride()))
    if groups > MAX_LEAD_GROUPS:
        return (f"leading dims {tuple(x.shape[:-1])} with strides {x.stride()[:-1]} form {groups} stride groups "
                f"(supported: up to {MAX_LEAD_GROUPS})")
    return None
