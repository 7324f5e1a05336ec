"""A deterministic, split-invariant index sum: ``out[v] += sum of rows[r] over the r with ids[r] == v``, each id's
rows added in ascending r from zero in FP32 -- an embedding's weight gradient (``embedding_dense_backward``'s
scatter-add of the gradient rows by token id), what detkit mode's data-parallel embedding route uses
(detkit.mode.parallel, docs/mode_parallel.md).

Why this one: torch's embedding backward adds the rows of one id in an order of its own (on CUDA a sort and a
segmented reduction whose partial sums depend on how many rows there are; on the CPU an index_add), in the
weight's dtype, so neither a data-parallel rank's BF16 gradient nor the sum of two ranks' equals the gradient of the
whole batch. Here each id's sum is formed from zero in a fixed order that depends on that id's rows alone and added
to ``out`` once, in FP32: a DP rank's partial (``out`` zeros) is exactly the sum a one-process run forms over the
same shard, and a one-process run that calls this once per shard into one ``out`` adds the shard partials in rank
order, ((0 + p0) + p1) + ..., as the ranks' ordered sum does.

Math (``index_sum_kernel``): the ids are sorted stably (``torch.sort(stable=True)``: equal ids keep ascending
positions) and each position's segment end found (``searchsorted``), on the device, without a host read. Program
(p, c) owns columns [c * BLOCK_D, +BLOCK_D) of the segment that starts at sorted position p (programs whose p is not
a segment start return at once): acc = 0; for i in the segment, ascending: acc += fp32(rows[perm[i]]); then
out[id] = out[id] + acc. One program writes each output tile, no atomics, no split of a segment: run-to-run
deterministic, and an id's bits depend only on its rows, in their order, and on ``out``'s value before the call. Ids
equal to ``skip`` (an Embedding's padding_idx, whose gradient torch keeps zero) add nothing; neither do ids outside
[0, V) (the wrapper refuses them with ``check_ids``; an embedding's forward has refused them already). A sum
starting from +0 is never -0.0, so 0 + p = p exactly.

Shapes: rows [R, D] float32 or bfloat16, last dim contiguous; ids [R] int32 or int64; out [V, D] float32, contiguous.
Cost: one pass over the rows; an id with many rows is one sequential chain per column block (an id repeated n
times costs n dependent loads in its programs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detkit.kernels.backend import TRITON_INTERPRETER, resolve_backend_of_devices

ROW_DTYPES = (torch.float32, torch.bfloat16)
ID_DTYPES = (torch.int32, torch.int64)
# The column block: a function of D alone (every id's additions are elementwise over columns, so it changes no bits).
MAX_BLOCK_D = 1024
INTERPRETER_MAX_BLOCK_D = 64  # keeps CPU runs short; the same bits (columns do not interact)


def block_d(d: int, interpreted: bool) -> int:
    return min(INTERPRETER_MAX_BLOCK_D if interpreted else MAX_BLOCK_D, triton.next_power_of_2(d))


def index_sum_launch_name(grid, kernel, args) -> dict:
    return {"name": f"index_sum [R={args['R']}, D={args['D']}, V={args['V']}]"}


@triton.jit(launch_metadata=index_sum_launch_name)
def index_sum_kernel(rows_ptr, sorted_ids_ptr, perm_ptr, ends_ptr, out_ptr,
                     R, D, V, SKIP, stride_rr, stride_ov,
                     BLOCK_D: tl.constexpr):
    p = tl.program_id(0)  # a sorted position: this program's segment starts here, or it returns
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    col_ok = cols < D
    v = tl.load(sorted_ids_ptr + p).to(tl.int64)
    prev = tl.load(sorted_ids_ptr + tl.maximum(p - 1, 0)).to(tl.int64)
    starts = (p == 0) | (prev != v)
    if starts & (v != SKIP) & (v >= 0) & (v < V):
        end = tl.load(ends_ptr + p).to(tl.int32)  # R < 2**31 (the grid)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i in range(p, end):  # the id's rows in ascending position (a stable sort keeps it)
            r = tl.load(perm_ptr + i).to(tl.int64)
            acc += tl.load(rows_ptr + r * stride_rr + cols, mask=col_ok, other=0.0).to(tl.float32)
        out_ptrs = out_ptr + v * stride_ov + cols  # [BLOCK_D]
        tl.store(out_ptrs, tl.load(out_ptrs, mask=col_ok, other=0.0) + acc, mask=col_ok)


def _check(rows: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, skip) -> None:
    for name, t in (("rows", rows), ("ids", ids), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if rows.dtype not in ROW_DTYPES:
        raise TypeError(f"rows has dtype {rows.dtype}; supported: {ROW_DTYPES}")
    if ids.dtype not in ID_DTYPES:
        raise TypeError(f"ids has dtype {ids.dtype}; supported: {ID_DTYPES}")
    if out.dtype != torch.float32:
        raise TypeError(f"out has dtype {out.dtype}; supported: torch.float32 (the FP32 partial)")
    if rows.dim() != 2 or rows.shape[1] < 1 or rows.stride(1) != 1:
        raise ValueError(f"rows must be [R, D] with a contiguous last dim; got shape {tuple(rows.shape)}, strides "
                         f"{rows.stride()}")
    if ids.dim() != 1 or ids.shape[0] != rows.shape[0]:
        raise ValueError(f"ids must be [R] = [{rows.shape[0]}]; got shape {tuple(ids.shape)}")
    if out.dim() != 2 or out.shape[1] != rows.shape[1] or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [V, {rows.shape[1]}] tensor; got shape {tuple(out.shape)}, "
                         f"strides {out.stride()}")
    if skip is not None and not isinstance(skip, int):
        raise TypeError(f"skip must be an int or None; got {type(skip).__name__}")


def index_sum(rows: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, *, skip: int | None = None,
              check_ids: bool = True) -> torch.Tensor:
    """``out[v] += sum of rows[r] for ids[r] == v`` (each id's rows in ascending r, from zero, FP32), in place;
    returns ``out``. rows [R, D] float32/bfloat16 (last dim contiguous); ids [R] int32/int64; out [V, D] float32,
    contiguous. ``skip``: an id whose rows add nothing (an Embedding's padding_idx). ``check_ids``: refuse ids outside
    [0, V) (one host read); the mode passes False where an embedding forward has refused them already."""
    _check(rows, ids, out, skip)
    backend = resolve_backend_of_devices(index_sum_kernel, {"rows": rows.device, "ids": ids.device,
                                                            "out": out.device})
    count, d = rows.shape
    v_count = out.shape[0]
    if count == 0:
        return out
    if check_ids:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= v_count:
            raise ValueError(f"ids range over [{lo}, {hi}]; supported: [0, V) = [0, {v_count})")
    sorted_ids, perm = torch.sort(ids, stable=True)
    ends = torch.searchsorted(sorted_ids, sorted_ids, right=True).to(torch.int64)
    blk = block_d(d, backend == TRITON_INTERPRETER)
    grid = (count, triton.cdiv(d, blk))
    index_sum_kernel[grid](rows, sorted_ids, perm, ends, out, count, d, v_count, -1 if skip is None else skip,
                           rows.stride(0), out.stride(0), BLOCK_D=blk, num_warps=4)
    return out
