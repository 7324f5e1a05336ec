"""A batch-invariant row mean: the mean over the last dim (RMSNorm's variance, ``x.pow(2).mean(-1, keepdim=True)``),
what detkit mode routes ``aten::mean.dim`` to (detkit.mode.reductions).

Why this one: torch's CUDA reduction picks its thread-block shape from the number of outputs as well
as the row length (``setReduceConfig``: block height grows with the row count up to 16, the block
width shrinks to match, and few outputs may split a row across blocks), so the order in which a
row's elements are added -- and its bits -- change between a decode step of one token (one row per
sequence) and the trainer's forward over thousands of rows. torch's CUDA softmax and log_softmax over
the last dim run one row per block or warp with a launch shape chosen from the row length alone,
so they are batch-invariant and the mode leaves them on torch (docs/mode.md).

Math (``row_mean_kernel``): each program owns ``BLOCK_R`` rows; for every row it adds the FP32 values
of ``BLOCK_H``-wide column chunks into a ``[BLOCK_R, BLOCK_H]`` FP32 accumulator in ascending chunk
order (column j of the accumulator holds columns j, j + BLOCK_H, ... in that order), then sums the
accumulator's columns as a balanced binary tree over their indices (``pairwise_row_sum``: pairs (2i, 2i+1)
first) and divides by ``H``; BF16 results are rounded once, to nearest-even. ``BLOCK_H`` is a function of
``H`` alone, so a row's operations do not depend on how many rows there are or where it sits:
batch-invariant and run-to-run deterministic. Every step of the tree adds two numbers, and FP addition is
commutative, so the sum does not depend on the layout Triton gives the accumulator (which follows the
loaded dtype and the warps): the interpreter, the GPU and the fused RMSNorm (``rms_norm``, whose
accumulator holds squares of BF16 inputs) add the same numbers in the same order. On the GPU ``BLOCK_R``
is 1; under the interpreter it is 16 to keep CPU runs short.

Rows need not view as one row dim: with ``lead`` the kernel addresses row r through up to three leading (size, stride)
dims (``lead_dims``), e.g. RMSNorm over a [B, H, S, D] transpose of a [B, S, H, D] projection (Gemma-3's q/k norms).
Only where each row starts changes; its additions are the same, so its bits equal those of the same row in a
contiguous tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detkit.kernels.backend import TRITON_INTERPRETER, DirectLaunch, resolve_backend_of_devices
from detkit.kernels.det_gemm.launch import fp32_to_bf16_rtne

MAX_BLOCK_H = 1024
DTYPES = (torch.float32, torch.bfloat16)


def block_h(h: int) -> int:
    """The column chunk for rows of ``h`` elements (a function of h only)."""
    return min(MAX_BLOCK_H, triton.next_power_of_2(h))


@triton.jit
def pairwise_row_sum(acc, LOG2_N: tl.constexpr):
    """[R, N] -> [R] (N = 2**LOG2_N): each row's sum as a balanced binary tree over its column indices, (2i, 2i+1)
    added first, then the pairs' sums pairwise, and so on. Each step adds two numbers, so no step's result depends on
    which thread holds which operand."""
    for _ in tl.static_range(LOG2_N):
        acc = tl.sum(tl.reshape(acc, (acc.shape[0], acc.shape[1] // 2, 2)), axis=2)
    return tl.reshape(acc, (acc.shape[0],))


@triton.jit
def row_mean_kernel(x_ptr, out_ptr, R, H, stride_xr, D1, D2, stride_x1, stride_x2, BLOCK_R: tl.constexpr,
                    BLOCK_H: tl.constexpr, LOG2_BLOCK_H: tl.constexpr, OUT_BF16: tl.constexpr,
                    INTERPRETED: tl.constexpr, THREE_STRIDES: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_mask = rows < R
    if THREE_STRIDES:
        # Leading dims [R / (D1 * D2), D1, D2] with strides (stride_xr, stride_x1, stride_x2) that do not view as
        # one row dim (e.g. a [B, H, S, D] transpose of [B, S, H, D]): row r's address from its three indices. Only
        # where a row starts moves; its additions are the same.
        r64 = rows.to(tl.int64)
        row_offs = (r64 // (D1 * D2)) * stride_xr + ((r64 // D2) % D1) * stride_x1 + (r64 % D2) * stride_x2
    else:
        row_offs = rows.to(tl.int64) * stride_xr
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)  # [BLOCK_H]
        offs = row_offs[:, None] + cols[None, :]  # [BLOCK_R, BLOCK_H]
        x = tl.load(x_ptr + offs, mask=row_mask[:, None] & (cols < H)[None, :], other=0.0)
        acc += x.to(tl.float32)
    mean = pairwise_row_sum(acc, LOG2_BLOCK_H) / H  # [BLOCK_R]
    if OUT_BF16:
        if INTERPRETED:
            out = fp32_to_bf16_rtne(mean)
        else:
            out = mean.to(tl.bfloat16)
    else:
        out = mean
    tl.store(out_ptr + rows, out, mask=row_mask)


MAX_PLANS = 1024  # launch plans remembered; past it the table starts over
_PLANS: dict[tuple, object] = {}


def row_mean_launcher(rows: int, h: int, stride_r: int, dtype: torch.dtype, device: torch.device,
                      out_shape: tuple[int, ...], lead: tuple[tuple[int, int], ...] | None = None):
    """The launch of ``row_mean_kernel`` for one signature: ``launch(x) -> out``, where x's data holds ``rows`` rows
    of ``h`` contiguous elements ``stride_r`` apart (a tensor of any rank: the kernel reads its data pointer) and
    ``out`` is a new contiguous tensor of ``out_shape`` (``rows`` elements). ``lead``: instead of one row stride, up to
    three (size, stride) leading dims whose product is ``rows`` (``lead_dims``: dims that do not view as one).
    Checked by the caller."""
    backend = resolve_backend_of_devices(row_mean_kernel, {"x": device})
    interpreted = backend == TRITON_INTERPRETER
    block_r = 16 if interpreted else 1
    grid = (triton.cdiv(rows, block_r),)
    if lead is None:
        strides = dict(stride_xr=stride_r, D1=1, D2=1, stride_x1=0, stride_x2=0)
    else:
        if not 1 <= len(lead) <= 3 or _prod(size for size, _ in lead) != rows:
            raise ValueError(f"lead must be 1 to 3 (size, stride) dims of {rows} rows in all; got {lead!r}")
        (_, s0), (d1, s1), (d2, s2) = ((1, 0),) * (3 - len(lead)) + tuple(lead)
        strides = dict(stride_xr=s0, D1=d1, D2=d2, stride_x1=s1, stride_x2=s2)
    chunk = block_h(h)
    values = dict(R=rows, H=h, **strides, BLOCK_R=block_r, BLOCK_H=chunk, LOG2_BLOCK_H=chunk.bit_length() - 1,
                  OUT_BF16=dtype == torch.bfloat16, INTERPRETED=interpreted, THREE_STRIDES=lead is not None)
    if interpreted:
        def launch(x):
            out = torch.empty(out_shape, dtype=dtype, device=device)
            row_mean_kernel[grid](x, out, **values, num_warps=4)
            return out
        return launch
    # Triton specializes a pointer on its 16-byte alignment: one compiled launch for each (the output, new from
    # the caching allocator, is always aligned; the integers are fixed by the signature).
    names = list(row_mean_kernel.arg_names)
    template = [values.get(name) for name in names]
    i_x, i_out = names.index("x_ptr"), names.index("out_ptr")
    aligned, misaligned = (DirectLaunch(row_mean_kernel, grid, {"num_warps": 4}, device) for _ in range(2))

    def launch(x):
        out = torch.empty(out_shape, dtype=dtype, device=device)
        args = template.copy()
        args[i_x], args[i_out] = x, out
        (misaligned if x.data_ptr() & 15 else aligned)(args)
        return out
    return launch


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def lead_dims(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The leading dims (all but the last) of a tensor as few (size, stride) groups as address its rows in order:
    size-1 dims dropped, neighbours merged where one stride steps over the other's extent (what ``view`` needs).
    One group: the rows view as one row dim."""
    groups: list[list[int]] = []
    for size, step in zip(shape[:-1], stride[:-1]):
        if size == 1:
            continue
        if groups and groups[-1][1] == size * step:
            groups[-1] = [groups[-1][0] * size, step]
        else:
            groups.append([size, step])
    return tuple((size, step) for size, step in groups) or ((1, 0),)


def _row_mean_plan(x: torch.Tensor):
    if x.dtype not in DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; supported: {DTYPES}")
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] < 1 or x.stride(1) != 1:
        raise ValueError(f"x must be a non-empty [R, H] tensor with a contiguous last dim; got shape "
                         f"{tuple(x.shape)}, strides {x.stride()}")
    rows, h = x.shape
    return row_mean_launcher(rows, h, x.stride(0), x.dtype, x.device, (rows,))


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean of each row of ``x`` [R, H] (last dim contiguous) -> [R], in x's dtype. The checks run once per
    signature (dtype, device, shape, strides)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    key = (x.dtype, x.device, x.shape, x.stride())
    launch = _PLANS.get(key)
    if launch is None:
        launch = _remember(key, _row_mean_plan(x))
    return launch(x)


def _remember(key: tuple, launch):
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = launch
    return launch
