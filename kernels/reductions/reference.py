"""Pure-torch references of the reductions family."""

from __future__ import annotations

import torch


def row_mean_ref(x: torch.Tensor) -> torch.Tensor:
    """FP64 mean of each row (the reference for tests)."""
    return x.double().mean(dim=-1)


def index_sum_ref(rows: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, skip: int | None = None) -> torch.Tensor:
    """``out`` + the FP32 sum of each id's rows, added in ascending row order from zero (what ``index_sum`` forms),
    a new tensor: for occurrence k = 0, 1, ... of every id at once, that occurrence's rows are added to their ids'
    running sums (no id twice in one step, so each add is one elementwise FP32 add); the sums are then added to
    ``out`` for the ids that occur (other rows of ``out`` unchanged). Ids equal to ``skip`` add nothing."""
    rows32 = rows.float()
    keep = ids != skip if skip is not None else torch.ones_like(ids, dtype=torch.bool)
    sorted_ids, perm = torch.sort(ids, stable=True)
    position = torch.arange(ids.shape[0], device=ids.device)
    first = torch.searchsorted(sorted_ids, sorted_ids, right=False)
    occurrence = torch.empty_like(position)
    occurrence[perm] = position - first  # the k-th row of its id, in ascending row order
    acc = torch.zeros((out.shape[0], rows.shape[1]), dtype=torch.float32, device=rows.device)
    for k in range(int(occurrence.max()) + 1 if ids.numel() else 0):
        sel = (occurrence == k) & keep
        acc[ids[sel]] = acc[ids[sel]] + rows32[sel]
    touched = torch.unique(ids[keep])
    result = out.clone()
    result[touched] = result[touched] + acc[touched]
    return result
