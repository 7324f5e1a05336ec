"""Deterministic, batch-invariant grouped GEMMs (BF16 in, FP32 accumulation, one BF16 rounding), the two forms
torch._grouped_mm takes with offsets and that an MoE block's experts and their backward call:

    grouped_mm(a [M, K], b [G, K, N], offs [G]) -> [M, N]
        rows offs[g-1]:offs[g] of a times b[g] (offs[-1] = 0 before group 0); rows past offs[G-1] are 0.
        The forward (x @ W[g]) and the input gradient (dy @ W[g].T, b a transposed view).
    grouped_wgrad(a [P, R], b [R, Q], offs [G]) -> [G, P, Q]
        out[g] = a[:, offs[g-1]:offs[g]] @ b[offs[g-1]:offs[g]]: offsets along the reduced dim (the weight
        gradient dy.T @ x per group); an empty group is exact zeros.

Determinism, as det_gemm (kernels/det_gemm/launch.py): no split of a reduction, no atomics, one program per output
tile; a reduction runs in ascending steps of the pinned config's BLOCK_K (kernels/grouped/configs.py), each one
``tl.dot`` into one FP32 accumulator on the GPU, exact products added one at a time under the interpreter. The
config depends on the op and the backend only, so:
- grouped_mm: a row's bits are a function of the row, its group's matrix and K -- not of how many rows its group or
  any other group holds, nor of where the row sits (batch invariance, per token of an MoE block);
- grouped_wgrad: a group's bits are a function of that group's rows, reduced in ascending order from its first row
  (run-to-run deterministic; a sum over a batch is not batch-invariant by nature).

No host read: the offsets stay on the device; the grid is sized for the bound of any grouping (ceil(M / BLOCK_M) +
G + 1 row tiles) and every program finds its group from the offsets itself (programs past the real tiles exit). So
the launches can be captured in a CUDA graph. Offsets on the CPU (the interpreter) are checked on the host, one line
naming the bad value; on the GPU, where that check would be a host read, invalid offsets (decreasing, negative, past
the rows) make every output element NaN -- fail closed, never a partial result.

Shapes: any sizes >= 0 below 2**30, any non-negative strides (pointer loads; a weight given as
``w.transpose(-2, -1)`` is read along its contiguous K). ``offs`` is a 1-D int32 tensor on the operands' device.
"""

from __future__ import annotations

import torch
import triton

from detkit.kernels.backend import TRITON_INTERPRETER, check_layout, check_storage, resolve_backend_of_devices
from detkit.kernels.grouped.configs import GroupedConfig, select_config
from detkit.kernels.grouped.kernels import grouped_mm_kernel, grouped_wgrad_kernel

MAX_DIM = 2**30  # row / tile arithmetic in the kernels is 32-bit (element offsets are 64-bit)


def _check_operand(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    check_layout(name, t.layout)
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: torch.bfloat16")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D; got shape {tuple(t.shape)}")
    if any(s < 0 for s in t.stride()):
        raise ValueError(f"{name} has negative strides {t.stride()}; supported: non-negative strides")
    if t.numel() and max(t.shape) >= MAX_DIM:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; supported: every dim below 2**30")
    if t.numel():
        check_storage(name, t, sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1)


def _check_offs(offs, groups: int, device: torch.device) -> None:
    if not isinstance(offs, torch.Tensor):
        raise TypeError(f"offs must be a torch.Tensor; got {type(offs).__name__}")
    if offs.dtype != torch.int32:
        raise TypeError(f"offs has dtype {offs.dtype}; supported: torch.int32")
    if offs.dim() != 1 or offs.shape[0] != groups:
        raise ValueError(f"offs must be 1-D with one offset per group ({groups}); got shape {tuple(offs.shape)}")
    if groups < 1:
        raise ValueError("offs is empty; supported: at least one group")
    if offs.stride(0) != 1 and groups > 1:
        raise ValueError(f"offs has stride {offs.stride(0)}; supported: contiguous offsets")
    if offs.device != device:
        raise ValueError(f"offs is on {offs.device}, the operands on {device}; supported: one device")


def check_offsets(offs: torch.Tensor, total: int, what: str) -> None:
    """Offsets on the CPU: non-decreasing, within [0, total] (``what`` names the dim they split). A host check, so
    only for CPU tensors (on the GPU the kernels turn invalid offsets into NaN instead of reading them back)."""
    prev = 0
    for g, end in enumerate(offs.tolist()):
        if end < prev or end > total:
            raise ValueError(f"offs[{g}] = {end} after {prev}: offsets must be non-decreasing and within "
                             f"[0, {total}] ({what} {total})")
        prev = end


def _config(op: str, backend: str, config: GroupedConfig | None) -> GroupedConfig:
    if config is None:
        return select_config(op, backend)
    if not isinstance(config, GroupedConfig):
        raise TypeError(f"config must be a GroupedConfig or None (the table's pick); got {type(config).__name__}")
    return config


def _launch_options(config: GroupedConfig, backend: str) -> dict:
    if backend == TRITON_INTERPRETER:
        return {"num_warps": config.num_warps}
    return {"num_warps": config.num_warps, "num_stages": config.num_stages}


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *,
               config: GroupedConfig | None = None) -> torch.Tensor:
    """``a [M, K]`` (any strides), ``b [G, K, N]`` (any strides), ``offs [G]`` int32 -> ``[M, N]`` BF16, contiguous:
    each group's rows times its matrix (module docstring). ``config``: the table's pick when None."""
    _check_operand("a", a, 2)
    _check_operand("b", b, 3)
    m, k = a.shape
    groups, kb, n = b.shape
    if kb != k:
        raise ValueError(f"a [M, K] and b [G, K, N] must share K; got a {tuple(a.shape)}, b {tuple(b.shape)}")
    _check_offs(offs, groups, a.device)
    backend = resolve_backend_of_devices(grouped_mm_kernel, {"a": a.device, "b": b.device, "offs": offs.device})
    if offs.device.type == "cpu":
        check_offsets(offs, m, "rows of a")
    cfg = _config("mm", backend, config)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m == 0 or n == 0:
        return out
    tiles = triton.cdiv(m, cfg.block_m) + groups + 1  # any grouping's row tiles: each group adds at most one partial
    grid = (tiles * triton.cdiv(n, cfg.block_n),)
    b_k_major = b.stride(1) == 1 and b.stride(2) != 1
    grouped_mm_kernel[grid](
        a, b, out, offs, m, n, k, groups,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1), tiles,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        G_POW2=triton.next_power_of_2(groups + 1),
        B_K_MAJOR=b_k_major, INTERPRETED=backend == TRITON_INTERPRETER, **_launch_options(cfg, backend),
    )
    return out


def grouped_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *,
                  config: GroupedConfig | None = None) -> torch.Tensor:
    """``a [P, R]``, ``b [R, Q]`` (any strides), ``offs [G]`` int32 along R -> ``[G, P, Q]`` BF16, contiguous: each
    group's rows reduced in ascending order (module docstring). ``config``: the table's pick when None."""
    _check_operand("a", a, 2)
    _check_operand("b", b, 2)
    p, r = a.shape
    rb, q = b.shape
    if rb != r:
        raise ValueError(f"a [P, R] and b [R, Q] must share R; got a {tuple(a.shape)}, b {tuple(b.shape)}")
    groups = offs.shape[0] if isinstance(offs, torch.Tensor) and offs.dim() == 1 else -1
    _check_offs(offs, groups, a.device)
    backend = resolve_backend_of_devices(grouped_wgrad_kernel, {"a": a.device, "b": b.device, "offs": offs.device})
    if offs.device.type == "cpu":
        check_offsets(offs, r, "reduced rows")
    cfg = _config("wgrad", backend, config)
    out = torch.empty(groups, p, q, dtype=torch.bfloat16, device=a.device)
    if p == 0 or q == 0:
        return out
    grid = (triton.cdiv(p, cfg.block_m) * triton.cdiv(q, cfg.block_n), groups)
    grouped_wgrad_kernel[grid](
        a, b, out, offs, p, q, r, groups,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, G_POW2=triton.next_power_of_2(groups + 1),
        INTERPRETED=backend == TRITON_INTERPRETER, **_launch_options(cfg, backend),
    )
    return out
