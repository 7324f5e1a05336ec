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

Variants (``GroupedConfig.variant``): "ptr" (``grouped_mm_kernel`` / ``grouped_wgrad_kernel``, pointer loads) and
"tma" (``grouped_mm_tma_kernel`` / ``grouped_wgrad_tma_kernel``, host TMA descriptors over each operand's storage
order: grouped_mm's A [M, K] row-major, B[g] rank-3 over [G, K, N] or [G, N, K]; grouped_wgrad's A as autograd's
grad.T (storage [R, P]) and B [R, Q] row-major, a group's last, partial step through pointer loads). Same tiles,
same K steps, so the same bits. TMA needs one of an operand's last two dims with stride 1 -- not the dim the offsets
split, since a box's offset along the contiguous dim must be a multiple of 16 bytes and groups start at any row --,
the other strides multiples of 16 bytes, a 16-byte-aligned base and no empty dim (``TMA_ORDERS``, ``tma_problem``): a
"tma" config passed by the caller for operands it cannot address is refused in one line naming the operand; a "tma"
pick of the table (kernels/grouped/configs.py, per op, backend and layout) runs the same tile as "ptr" instead, which
the call's ``GroupedLaunch.route`` says. Both decided on the host when the launch plan is built, before any launch.
The TMA kernels' launch names end in " tma" (kernels/grouped/names.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from detkit.kernels.backend import (
    TRITON_INTERPRETER, DirectLaunch, check_layout, check_storage, ensure_thread_cuda_context, host_descriptor,
    resolve_backend_of_devices,
)
from detkit.kernels.grouped.configs import GroupedConfig, select_config
from detkit.kernels.grouped.kernels import (
    grouped_mm_kernel, grouped_mm_tma_kernel, grouped_wgrad_kernel, grouped_wgrad_tma_kernel,
)
from detkit.kernels.grouped.names import case_name

MAX_DIM = 2**30  # row / tile arithmetic in the kernels is 32-bit (element offsets are 64-bit)
TMA_MAX_STRIDE_BYTES = 2**40  # a TMA descriptor's strides are below 2**40 bytes


@dataclass(frozen=True)
class GroupedLaunch:
    """What a call ran: ``layout`` (``storage_layout``), the config (its ``variant`` names the kernel), the launch
    name (profilers, NVTX ranges and report rows share it) and ``route``: "config" (the caller's), "table" (the
    table's pick as pinned) or "table: ..." (a "tma" pick run as "ptr", and why)."""

    op: str
    backend: str
    layout: str
    config: GroupedConfig
    name: str
    route: str


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


def storage_order(stride: tuple[int, ...]) -> str:
    """"n" when an operand's last dim has stride 1, "t" when the dim before it does (a transposed view: transformers'
    ``W.transpose(-2, -1)``, autograd's ``grad.T``), "s" otherwise."""
    if stride[-1] == 1:
        return "n"
    return "t" if stride[-2] == 1 else "s"


def storage_layout(a: torch.Tensor, b: torch.Tensor) -> str:
    """The table's layout key of a call (kernels/grouped/configs.py LAYOUTS): A's then B's ``storage_order``."""
    return storage_order(a.stride()) + storage_order(b.stride())


# The storage orders the TMA kernels take per (op, operand). A TMA box's offset along the contiguous dim must be a
# multiple of 16 bytes (Triton's descriptor load), and groups start at any row: the dim the offsets split (mm: A's
# rows; wgrad: the reduced rows of A and B) must not be the contiguous one.
TMA_ORDERS = {("mm", "a"): ("n",), ("mm", "b"): ("n", "t"), ("wgrad", "a"): ("t",), ("wgrad", "b"): ("n",)}


def tma_problem(shape: tuple[int, ...], stride: tuple[int, ...], misalign: int, orders: tuple[str, ...]) -> str | None:
    """Why a TMA kernel cannot describe a BF16 view of ``shape`` and ``stride`` whose base is ``misalign`` bytes past
    a 16-byte boundary, taking the storage orders ``orders`` (TMA_ORDERS), or None when it can."""
    if 0 in shape:
        return "an empty dim"
    order = storage_order(stride)
    if order == "s":
        return "neither of its last two dims has stride 1"
    if order not in orders:
        return ("its contiguous dim is the one the offsets split (groups start at any row; a TMA box's offset along "
                "the contiguous dim must be a multiple of 16 bytes)")
    inner = len(stride) - (1 if order == "n" else 2)
    outer = [s for d, s in enumerate(stride) if d != inner]
    if any(s * 2 % 16 for s in outer):
        return "a stride not a multiple of 8 elements (16 bytes)"
    if misalign:
        return "a base not 16-byte aligned"
    if any(s * 2 >= TMA_MAX_STRIDE_BYTES for s in outer):
        return "a stride of 2**40 bytes or more"
    return None


def tma_descriptor_layout(name: str, shape: tuple[int, ...], stride: tuple[int, ...], misalign: int,
                          orders: tuple[str, ...], block: tuple[int, ...]
                          ) -> tuple[bool, list[int], list[int], list[int]]:
    """``(transposed, shape, strides, box)`` of a TMA descriptor over the view (``block``: its box in the view's
    order) in its storage order: the view itself, or with its last two dims swapped when ``transposed``. Refuses in
    one line, naming the operand, what the TMA kernels cannot describe (tma_problem)."""
    problem = tma_problem(shape, stride, misalign, orders)
    if problem is not None:
        raise ValueError(
            f"variant 'tma' cannot describe {name} (shape {tuple(shape)}, strides {tuple(stride)}, data_ptr % 16 = "
            f"{misalign}): {problem}; TMA needs one of the last two dims with stride 1 (not the one the offsets "
            "split), the other strides multiples of 16 bytes, a 16-byte-aligned base and no empty dim: use a 'ptr' "
            "config for these operands")
    shape, stride, block = list(shape), list(stride), list(block)
    transposed = storage_order(stride) == "t"
    if transposed:
        for dims in (shape, stride, block):
            dims[-2], dims[-1] = dims[-1], dims[-2]
    return transposed, shape, stride, block


# ---------------------------------------------------------------------------------------------
# Launch plans: everything but the tensors themselves is a function of the call's signature (dtypes, devices, shapes,
# strides, each operand's base address mod 16, the config), so it is checked and worked out once per signature, the
# variant among it (TMA needs 16-byte-aligned bases); per call: the storage checks, the CPU offsets' host check, the
# output's allocation, the descriptors (TMA) and the launch (on the GPU straight into the compiled kernel's launcher,
# kernels/backend.py DirectLaunch; Triton specializes on what the key holds: integer values, pointer alignment and
# descriptor block shapes).
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
            a.data_ptr() % 16, b.data_ptr() % 16, offs.data_ptr() % 16 == 0)


def _launcher(kernel, grid: tuple[int], values: dict, config: GroupedConfig, backend: str, device: torch.device,
              dynamic: tuple[str, ...], bind):
    """``launch(a, b, out, offs)``: ``kernel`` over ``grid`` with ``values`` and the arguments named in ``dynamic``
    from ``bind(a, b, out, offs, encoded)`` (``encoded``: TMA descriptors may be passed as ``HostDescriptor``s, the
    kernel being compiled for their block shapes)."""
    if backend == TRITON_INTERPRETER:
        def launch(*args):
            kernel[grid](**dict(zip(dynamic, bind(*args, False))), **values, num_warps=config.num_warps)
        return launch
    names = list(kernel.arg_names)
    template = [values.get(name) for name in names]
    at = [names.index(name) for name in dynamic]
    direct = DirectLaunch(kernel, grid, {"num_warps": config.num_warps, "num_stages": config.num_stages}, device)

    def launch(*args):
        full = template.copy()
        for i, t in zip(at, bind(*args, direct.ready)):
            full[i] = t
        direct(full)
    return launch


def _pointers(a, b, out, offs, encoded):
    return a, b, out, offs


def _tma_binder(a_layout, b_layout, device: torch.device, with_pointers: bool):
    """``bind`` for a TMA kernel: descriptors over A's and B's storage (``*_layout``: tma_descriptor_layout's), the
    output and the offsets (``with_pointers``: A and B as pointers too)."""
    (_, a_shape, a_strides, a_box), (_, b_shape, b_strides, b_box) = a_layout, b_layout
    cuda = device.type == "cuda"

    def bind(a, b, out, offs, encoded):
        if cuda:  # the descriptors are encoded on the host: autograd's backward thread may have no context yet
            ensure_thread_cuda_context(device)
        if encoded:  # the launcher encodes each descriptor from base, shape and strides
            a_desc, b_desc = host_descriptor(a, a_shape, a_strides), host_descriptor(b, b_shape, b_strides)
        else:  # the first launch specializes on real descriptors (their block shapes)
            a_desc = TensorDescriptor(a, a_shape, a_strides, a_box)
            b_desc = TensorDescriptor(b, b_shape, b_strides, b_box)
        return (a_desc, b_desc, a, b, out, offs) if with_pointers else (a_desc, b_desc, out, offs)
    return bind


def _table_pick(op: str, backend: str, layout: str, views) -> tuple[GroupedConfig, str]:
    """The table's config for ``op`` on ``backend`` at ``layout``, and its route: a "tma" pick for operands TMA cannot
    describe (``views``: (name, shape, strides, misalign, orders) of A and B) runs the same tile as "ptr" (the same K
    steps: the same bits), the reason in the route."""
    config = select_config(op, backend, layout)
    if config.variant != "tma":
        return config, "table"
    for name, shape, stride, misalign, orders in views:
        problem = tma_problem(shape, stride, misalign, orders)
        if problem is not None:
            return (replace(config, variant="ptr"),
                    f"table: the 'tma' pick runs as 'ptr': {name} (shape {tuple(shape)}, strides {tuple(stride)}, "
                    f"data_ptr % 16 = {misalign}) has {problem}")
    return config, "table"


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
    device = a.device
    backend = resolve_backend_of_devices(grouped_mm_kernel, {"a": a.device, "b": b.device, "offs": offs.device})
    layout = storage_layout(a, b)
    views = tuple((name, tuple(t.shape), t.stride(), t.data_ptr() % 16, TMA_ORDERS[op, name])
                  for name, t in (("a", a), ("b", b)))
    if config is None:
        cfg, route = _table_pick(op, backend, layout, views)
    else:
        cfg, route = config, "config"
    tma = cfg.variant == "tma"
    name = case_name(op, *((m, n, k) if op == "mm" else (p, q, r)), groups, cfg.variant)
    record = GroupedLaunch(op, backend, layout, cfg, name, route)
    host_offsets = offs.device.type == "cpu"
    interpreted = backend == TRITON_INTERPRETER
    g_pow2 = triton.next_power_of_2(groups + 1)
    if 0 in out_shape:
        launch = None
    elif op == "mm":
        tiles = triton.cdiv(m, cfg.block_m) + groups + 1  # any grouping's row tiles: a group adds at most one partial
        grid = (tiles * triton.cdiv(n, cfg.block_n),)
        values = dict(M=m, N=n, K=k, G=groups, stride_cm=n, stride_cn=1, TILES=tiles, BLOCK_M=cfg.block_m,
                      BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, G_POW2=g_pow2,
                      INTERPRETED=interpreted)
        if tma:
            a_layout = tma_descriptor_layout(*views[0], (cfg.block_m, cfg.block_k))
            b_layout = tma_descriptor_layout(*views[1], (1, cfg.block_k, cfg.block_n))
            values.update(B_K_MAJOR=b_layout[0])
            launch = _launcher(grouped_mm_tma_kernel, grid, values, cfg, backend, device,
                               ("a_desc", "b_desc", "c_ptr", "offs_ptr"),
                               _tma_binder(a_layout, b_layout, device, False))
        else:
            values.update(stride_am=a.stride(0), stride_ak=a.stride(1), stride_bg=b.stride(0), stride_bk=b.stride(1),
                          stride_bn=b.stride(2), B_K_MAJOR=b.stride(1) == 1 and b.stride(2) != 1)
            launch = _launcher(grouped_mm_kernel, grid, values, cfg, backend, device,
                               ("a_ptr", "b_ptr", "c_ptr", "offs_ptr"), _pointers)
    else:
        grid = (triton.cdiv(p, cfg.block_m) * triton.cdiv(q, cfg.block_n) * groups,)
        values = dict(P=p, Q=q, R=r, G=groups, stride_ap=a.stride(0), stride_ar=a.stride(1), stride_br=b.stride(0),
                      stride_bq=b.stride(1), stride_cg=p * q, stride_cp=q, stride_cq=1, BLOCK_M=cfg.block_m,
                      BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, G_POW2=g_pow2, INTERPRETED=interpreted)
        if tma:
            a_layout = tma_descriptor_layout(*views[0], (cfg.block_m, cfg.block_k))
            b_layout = tma_descriptor_layout(*views[1], (cfg.block_k, cfg.block_n))
            launch = _launcher(grouped_wgrad_tma_kernel, grid, values, cfg, backend, device,
                               ("a_desc", "b_desc", "a_ptr", "b_ptr", "c_ptr", "offs_ptr"),
                               _tma_binder(a_layout, b_layout, device, True))
        else:
            launch = _launcher(grouped_wgrad_kernel, grid, values, cfg, backend, device,
                               ("a_ptr", "b_ptr", "c_ptr", "offs_ptr"), _pointers)

    def run(a, b, offs):
        check_storage("a", a, span_a)
        check_storage("b", b, span_b)
        if host_offsets:
            check_offsets(offs, total, what)
        out = torch.empty(out_shape, dtype=torch.bfloat16, device=device)
        if launch is not None:
            launch(a, b, out, offs)
        return out, record
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
    return _lookup("mm", a, b, offs, config)(a, b, offs)[0]


def grouped_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *,
                  config: GroupedConfig | None = None) -> torch.Tensor:
    """``a [P, R]``, ``b [R, Q]`` (any strides), ``offs [G]`` int32 along R -> ``[G, P, Q]`` BF16, contiguous: each
    group's rows reduced in ascending order (module docstring). ``config``: the table's pick when None."""
    return _lookup("wgrad", a, b, offs, config)(a, b, offs)[0]


def grouped_mm_launch(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *,
                      config: GroupedConfig | None = None) -> tuple[torch.Tensor, GroupedLaunch]:
    """``grouped_mm`` and what it ran (GroupedLaunch)."""
    return _lookup("mm", a, b, offs, config)(a, b, offs)


def grouped_wgrad_launch(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, *,
                         config: GroupedConfig | None = None) -> tuple[torch.Tensor, GroupedLaunch]:
    """``grouped_wgrad`` and what it ran (GroupedLaunch)."""
    return _lookup("wgrad", a, b, offs, config)(a, b, offs)
