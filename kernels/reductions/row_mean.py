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
order, then sums the accumulator's columns (one fixed tree for a given ``BLOCK_H``) and divides by
``H``; BF16 results are rounded once, to nearest-even. ``BLOCK_H`` is a function of ``H`` alone and
``BLOCK_R`` is a constant, so a row's operations do not depend on how many rows there are or where
it sits: batch-invariant and run-to-run deterministic. On the GPU ``BLOCK_R`` is 1 (no row ever
shares a program, so no layout question about which row slot it lands in); under the interpreter it
is 16 (numpy sums each row of the tile on its own) to keep CPU runs short.
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
def row_mean_kernel(x_ptr, out_ptr, R, H, stride_xr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                    OUT_BF16: tl.constexpr, INTERPRETED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_mask = rows < R
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)  # [BLOCK_H]
        offs = rows[:, None].to(tl.int64) * stride_xr + cols[None, :]  # [BLOCK_R, BLOCK_H]
        x = tl.load(x_ptr + offs, mask=row_mask[:, None] & (cols < H)[None, :], other=0.0)
        acc += x.to(tl.float32)
    mean = tl.sum(acc, axis=1) / H  # [BLOCK_R]
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


def row_mean_launcher(rows: int, h: int, stride_r: int, dtype: torch.dtype, device: torch.device, out_shape: tuple[int, ...]):
    """The launch of ``row_mean_kernel`` for one signature: ``launch(x) -> out``, where x's data holds ``rows`` rows
    of ``h`` contiguous elements ``stride_r`` apart (a tensor of any rank: the kernel reads its data pointer) and
    ``out`` is a new contiguous tensor of ``out_shape`` (``rows`` elements). Checked by the caller."""
    backend = resolve_backend_of_devices(row_mean_kernel, {"x": device})
    interpreted = backend == TRITON_INTERPRETER
    block_r = 16 if interpreted else 1
    grid = (triton.cdiv(rows, block_r),)
    values = dict(R=rows, H=h, stride_xr=stride_r, BLOCK_R=block_r, BLOCK_H=block_h(h),
                  OUT_BF16=dtype == torch.bfloat16, INTERPRETED=interpreted)
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
