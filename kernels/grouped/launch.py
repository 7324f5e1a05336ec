"""Deterministic, batch-invariant grouped GEMMs (BF16 in, FP32 accumulation, one BF16 rounding), the two forms
torch._grouped_mm takes with offsets and that an MoE block's experts and their backward call:

    grouped_mm(a [M, K], b [G, K, N], offs [G]) -> [M, N]
        rows offs[g-1]:offs[g] of a times b[g] (group 0 starts at row 0); rows past offs[G-1] are written 0.
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

from detkit.kernels.backend import (
    TRITON_INTERPRETER, DirectLaunch, check_layout, check_storage, resolve_backend_of_devices,
)
from detkit.kernels.grouped.configs import GroupedConfig, select_config
from detkit.kernels.grouped.kernels import grouped_mm_kernel, grouped_wgrad_kernel

MAX_DIM = 2**30  # row / tile arithmetic in the kernels is 32-bit (element offsets are 64-bit)


def _check_operand(name: str, t: torch.Tensor, ndim: int) -> int:
    """The signature checks of one operand (once per plan); returns the elements the view spans from its storage
    offset, for the per-call storage check."""
    check_layout(name, t.layout)
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: torch.bfloat16")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D; got shape {tuple(t.shape)}")
    if any(s < 0 for s in t.stride()):
        raise ValueError(f"{name} has negative strides {t.stride()}; supported: non-negative strides")
    if t.numel() and max(t.shape) >= MAX_DIM:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; supported: every dim below 2**30")
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1 if t.numel() else 0


def _check_offs(offs, groups: int, device: torch.device) -> None:
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


# ---------------------------------------------------------------------------------------------
# Launch plans: everything but the tensors themselves is a function of the call's signature (dtypes, devices, shapes,
# strides, 16-byte alignment of each pointer, the config), so it is checked and worked out once per signature; per
# call: the storage checks, the CPU offsets' host check, the output's allocation and the launch (on the GPU straight
# into the compiled kernel's launcher, kernels/backend.py DirectLaunch; Triton specializes on exactly what the key
# holds: integer values and pointer alignment).
# ---------------------------------------------------------------------------------------------
MAX_PLANS = 1024  # signatures remembered; past it the table starts over (each MoE batch size is a signature)
_PLANS: dict[tuple, object] = {}


def _key(op: str, a, b, offs, config) -> tuple:
    for name, t in (("a", a), ("b", b), ("offs", offs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if config is not None and not isinstance(config, GroupedConfig):
        raise TypeError(f"config must be a GroupedConfig or None (the table's pick); got {type(config).__name__}")
    return (op, config, a.dtype, b.dtype, offs.dtype, a.device, b.device, offs.device, a.layout, b.layout,
            offs.layout, a.shape, b.shape, offs.shape, a.stride(), b.stride(), offs.stride(),
            a.data_ptr() % 16 == 0, b.data_ptr() % 16 == 0, offs.data_ptr() % 16 == 0)


def _launcher(kernel, grid: tuple[int], values: dict, config: GroupedConfig, backend: str, device: torch.device,
              tensors: tuple[str, ...]):
    """``launch(*tensors)``: ``kernel`` over ``grid`` with ``values`` and the tensors bound to the names in
    ``tensors``."""
    if backend == TRITON_INTERPRETER:
        def launch(*args):
            kernel[grid](**dict(zip(tensors, args)), **values, num_warps=config.num_warps)
        return launch
    names = list(kernel.arg_names)
    template = [values.get(name) for name in names]
    at = [names.index(name) for name in tensors]
    direct = DirectLaunch(kernel, grid, {"num_warps": config.num_warps, "num_stages": config.num_stages}, device)

    def launch(*args):
        full = template.copy()
        for i, t in zip(at, args):
            full[i] = t
        direct(full)
    return launch


def _plan(op: str, a, b, offs, config):
    span_a = _check_operand("a", a, 2)
    span_b = _check_operand("b", b, 3 if op == "mm" else 2)
    if op == "mm":
        (m, k), (groups, kb, n) = a.shape, b.shape
        if kb != k:
            raise ValueError(f"a [M, K] and b [G, K, N] must share K; got a {tuple(a.shape)}, b {tuple(b.shape)}")
        total, what, out_shape = m, "rows of a", (m, n)
    else:
        (p, r), (rb, q) = a.shape, b.shape
        if rb != r:
            raise ValueError(f"a [P, R] and b [R, Q] must share R; got a {tuple(a.shape)}, b {tuple(b.shape)}")
        groups = offs.shape[0] if offs.dim() == 1 else -1
        total, what, out_shape = r, "reduced rows", (groups, p, q)
    _check_offs(offs, groups, a.device)
    kernel = grouped_mm_kernel if op == "mm" else grouped_wgrad_kernel
    device = a.device
    backend = resolve_backend_of_devices(kernel, {"a": a.device, "b": b.device, "offs": offs.device})
    cfg = config if config is not None else select_config(op, backend)
    host_offsets = offs.device.type == "cpu"
    interpreted = backend == TRITON_INTERPRETER
    g_pow2 = triton.next_power_of_2(groups + 1)
    if 0 in out_shape:
        launch = None
    elif op == "mm":
        tiles = triton.cdiv(m, cfg.block_m) + groups + 1  # any grouping's row tiles: a group adds at most one partial
        values = dict(M=m, N=n, K=k, G=groups, stride_am=a.stride(0), stride_ak=a.stride(1), stride_bg=b.stride(0),
                      stride_bk=b.stride(1), stride_bn=b.stride(2), stride_cm=n, stride_cn=1, TILES=tiles,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                      G_POW2=g_pow2, B_K_MAJOR=b.stride(1) == 1 and b.stride(2) != 1, INTERPRETED=interpreted)
        launch = _launcher(kernel, (tiles * triton.cdiv(n, cfg.block_n),), values, cfg, backend, device,
                           ("a_ptr", "b_ptr", "c_ptr", "offs_ptr"))
    else:
        values = dict(P=p, Q=q, R=r, G=groups, stride_ap=a.stride(0), stride_ar=a.stride(1), stride_br=b.stride(0),
                      stride_bq=b.stride(1), stride_cg=p * q, stride_cp=q, stride_cq=1, BLOCK_M=cfg.block_m,
                      BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, G_POW2=g_pow2, INTERPRETED=interpreted)
        launch = _launcher(kernel, (triton.cdiv(p, cfg.block_m) * triton.cdiv(q, cfg.block_n) * groups,), values, cfg,
                           backend, device, ("a_ptr", "b_ptr", "c_ptr", "offs_ptr"))

    def run(a, b, offs):
        check_storage("a", a, span_a)
        check_storage("b", b, span_b)
        if host_offsets:
            check_offsets(offs, total, what)
        out = torch.empty(out_shape, dtype=torch.bfloat16, device=device)
        if launch is not None:
            launch(a, b, out, offs)
        return out
    return run


def _lookup(op: str, a, b, offs, config):
    key = _key(op, a, b, offs, config)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _plan(op, a, b, offs, config)
    return plan


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *,
               config: GroupedConfig | None = None) -> torch.Tensor:
    """``a [M, K]`` (any strides), ``b [G, K, N]`` (any strides), ``offs [G]`` int32 -> ``[M, N]`` BF16, contiguous:
    each group's rows times its matrix (module docstring). ``config``: the table's pick when None."""
    return _lookup("mm", a, b, offs, config)(a, b, offs)


def grouped_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *,
                  config: GroupedConfig | None = None) -> torch.Tensor:
    """``a [P, R]``, ``b [R, Q]`` (any strides), ``offs [G]`` int32 along R -> ``[G, P, Q]`` BF16, contiguous: each
    group's rows reduced in ascending order (module docstring). ``config``: the table's pick when None."""
    return _lookup("wgrad", a, b, offs, config)(a, b, offs)
