"""TP/CP reduction operators: a det_gemm joined to (at most) one BF16 all-reduce, both sides returned.

Math (local shapes of the Qwen3-8B TP=2, CP=2 layout, ``kernels.layout``):

    row_parallel_fwd(hidden_local [M_l, I/2], w_local [I/2, H], tp_group)
        partial = det_gemm_fwd(hidden_local, w_local)             [M_l, H]   Down forward
        output  = all_reduce_SUM(partial) over the TP group        [M_l, H]
    column_parallel_dx(d_proj_local [M_l, I/2], w_local [H, I/2], tp_group)
        partial = det_gemm_da(d_proj_local, w_local)              [M_l, H]   Gate/Up dX
        dx      = all_reduce_SUM(partial) over the TP group
    replicated_dw(a_local, dc_local, grad_group)                                dW, CP group
        local   = det_gemm_db(a_local, dc_local)   x [M_l, H], dProj [M_l, I/2] -> [H, I/2]  Gate/Up
                                                   hidden [M_l, I/2], dOut [M_l, H] -> [I/2, H]  Down
        reduced = all_reduce_SUM(local) over the CP group (same TP lane)
    row_parallel_dhidden(d_out_local [M_l, H], w_local [I/2, H])
        d_hidden = det_gemm_da(d_out_local, w_local)              [M_l, I/2] no collective

Determinism: each local GEMM is a det_gemm (fixed reduction order, no split-K, no atomics). The
all-reduce is synchronous, in place on a copy of the partial that the GEMM epilogue writes beside it
(det_gemm ``twin_out``: no copy kernel before the collective; the partial is returned untouched),
in BF16 over a group of exactly two ranks: the sum of two BF16 operands is formed once in FP32 and
rounded once to BF16, so it equals ``(p0.float() + p1.float()).bfloat16()`` whatever NCCL's
algorithm or protocol (the version-1 oracle, docs/tp_cp.md). Groups of more than two are refused.

Failing closed: every check runs before any work and raises TypeError / ValueError /
NotImplementedError / RuntimeError naming the value received and what is supported: dtype,
2-D shape, the configured local shapes, devices and kernel backend (``kernels.backend``), an
uninitialised process group, a group that is not a ``kernels.layout.AxisGroup`` built by the
launcher (``toolkit.dist.build_groups``), of the wrong axis, size or membership for this rank, and
the process-group backend: NCCL for CUDA tensors (``cuda_sm90``), gloo only for CPU tensors under
the Triton interpreter (``triton_interpreter``, not a hardware result). Operators never create,
infer or look up groups.

Modes (``mode=``, per call; ``kernels.invariant``): ``"bf16"`` (default) is the version-1 contract
above. ``"fp32_invariant"`` keeps the partial in FP32 (det_gemm ``out_dtype=float32`` with the pinned
invariant config), all-reduces it in FP32 (two operands: one rounding, order-free) and rounds the
result to BF16 once; the returned partial is then FP32. Its TP=1 / CP=1 counterparts
(``kernels.invariant.tp1_*`` / ``cp1_db``) give the same bits (docs/invariance.md). Unknown modes
raise ``ValueError`` before any work.

Every call is counted (``operator_calls()``, ``collective_counts()``), so an audit can prove that
``row_parallel_dhidden`` issues no collective and each reducing operator exactly one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from detkit.kernels.backend import CUDA_SM90, TRITON_INTERPRETER, check_bf16_matrix, resolve_backend
from detkit.kernels.det_gemm.launch import GemmLaunch, det_gemm_da_launch, det_gemm_db_launch, det_gemm_fwd_launch, det_gemm_kernel
from detkit.kernels.parallel.invariant import DEFAULT_MODE, FP32_INVARIANT, check_mode, collective_dtype, gemm_kwargs
from detkit.kernels.parallel.layout import AxisGroup, TpCpLayout

COLLECTIVE_DTYPE = torch.bfloat16
# Kernel backend -> the only process-group backend accepted with it.
PG_BACKEND_FOR = {CUDA_SM90: "nccl", TRITON_INTERPRETER: "gloo"}
GROUP_SIZE = 2

_CALLS: Counter[str] = Counter()
_COLLECTIVES: Counter[tuple[str, str, str]] = Counter()


def operator_calls() -> dict[str, int]:
    """Completed calls per operator since the last reset."""
    return dict(_CALLS)


def collective_counts() -> dict[str, int]:
    """Collectives issued, keyed ``"<operator>/<collective>/<axis>"``, since the last reset."""
    return {"/".join(key): n for key, n in _COLLECTIVES.items()}


def reset_counts() -> None:
    _CALLS.clear()
    _COLLECTIVES.clear()


@dataclass(frozen=True)
class ParallelLaunch:
    """What ran: for report rows beside the tensors."""

    op: str
    backend: str  # kernel backend: cuda_sm90 | triton_interpreter
    pg_backend: str | None  # nccl | gloo; None without a collective
    collective: str | None  # "all_reduce" | None
    axis: str | None
    group_ranks: tuple[int, ...] | None  # layout ranks, group-rank order
    collective_dtype: str | None
    gemm: GemmLaunch

    @property
    def name(self) -> str:
        where = f" {self.axis.upper()}{list(self.group_ranks)}" if self.axis else ""
        return f"{self.op} {self.gemm.name.split(' ', 1)[1]}{where}"


# ---------------------------------------------------------------------------------------------
# Checks (all before any work)
# ---------------------------------------------------------------------------------------------
def check_collective_backend(kernel_backend: str, pg_backend: str) -> None:
    """Refuse a process-group backend that does not belong with the kernel backend."""
    want = PG_BACKEND_FOR.get(kernel_backend)
    if want is None:
        raise NotImplementedError(
            f"kernel backend {kernel_backend!r} is not supported; supported: {tuple(PG_BACKEND_FOR)}")
    if pg_backend != want:
        if kernel_backend == CUDA_SM90:
            raise NotImplementedError(
                f"process-group backend {pg_backend!r} with CUDA tensors ({CUDA_SM90}); supported: 'nccl' "
                "(NCCL is required for CUDA tensors)"
            )
        raise NotImplementedError(
            f"process-group backend {pg_backend!r} with CPU tensors ({TRITON_INTERPRETER}); supported: 'gloo' "
            "(gloo is accepted only with the Triton interpreter; not a hardware result)"
        )


def _check_initialised(op: str) -> None:
    if not dist.is_available():
        raise RuntimeError(f"{op}: this torch build has no torch.distributed; supported: a build with NCCL or gloo")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{op}: the default process group is not initialised; start the ranks with torchrun or srun and "
            "call toolkit.dist.setup_distributed (or torch.distributed.init_process_group) first"
        )


def _check_group(op: str, group: AxisGroup, axis: str) -> tuple[object, int]:
    """Return (torch process group, this process's layout rank) or raise."""
    if not isinstance(group, AxisGroup):
        raise TypeError(
            f"{op}: group is a {type(group).__name__}; supported: kernels.layout.AxisGroup built by "
            "detkit.toolkit.dist.build_groups or toolkit.dist.attach_group (it carries the layout the group and "
            "shapes are checked against)"
        )
    if group.axis != axis:
        raise ValueError(
            f"{op}: got a {group.axis.upper()} group {list(group.ranks)}; supported: a {axis.upper()} group")
    layout = group.layout
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(
            f"{op}: the default process group has {world} ranks but the layout's world {layout.world} has "
            f"{layout.world_size}"
        )
    rank = dist.get_rank()
    me = layout.layout_rank_of_process(rank)
    expected = layout.group_of(axis, me)
    if group.ranks != expected:
        raise ValueError(
            f"{op}: process rank {rank} (layout rank {me}) got {axis.upper()} group {list(group.ranks)}; its "
            f"{axis.upper()} group in the layout is {list(expected)}"
        )
    pg = group.group
    if pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{op}: the {group.label} handle holds no process group this rank belongs to (got {pg!r})")
    size = dist.get_world_size(pg)
    if size != GROUP_SIZE:
        raise ValueError(
            f"{op}: the {group.label} process group has {size} ranks; supported: {GROUP_SIZE} (the version-1 "
            "oracle covers two-operand sums only)"
        )
    pg_ranks = tuple(dist.get_process_group_ranks(pg))
    if pg_ranks != group.process_ranks:
        raise ValueError(
            f"{op}: the process group holds process ranks {list(pg_ranks)} but the {group.label} handle says "
            f"{list(group.process_ranks)}"
        )
    return pg, me


def _check_shapes(op: str, layout: TpCpLayout, tensors: dict[str, torch.Tensor],
                  expected: dict[str, tuple[int, int]]) -> None:
    for name, t in tensors.items():
        if tuple(t.shape) != expected[name]:
            want = ", ".join(f"{n} {expected[n]}" for n in tensors)
            raise ValueError(
                f"{op}: {name} has shape {tuple(t.shape)}; the configured local shapes for "
                f"{layout.model.name} B={layout.batch} S={layout.seq_len} are {want}"
            )


def _check_backend(op: str, tensors: dict[str, torch.Tensor], pg) -> tuple[str, str]:
    backend = resolve_backend(det_gemm_kernel, tensors)
    pg_backend = str(dist.get_backend(pg))
    check_collective_backend(backend, pg_backend)
    if backend == CUDA_SM90:
        device = next(iter(tensors.values())).device
        current = torch.cuda.current_device()
        if device.index != current:
            raise ValueError(
                f"{op}: tensors are on {device} but the current CUDA device is cuda:{current}; NCCL runs on the "
                "current device: call torch.cuda.set_device(local_rank) (toolkit.launch does)"
            )
    return backend, pg_backend


def _check_bf16(tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        check_bf16_matrix(name, t)


def _twin(rows: int, cols: int, mode: str, like: torch.Tensor) -> torch.Tensor:
    """The buffer the GEMM epilogue writes a second copy of the partial into (det_gemm ``twin_out``);
    the collective then runs in place on it and the partial stays untouched, with no copy kernel."""
    return torch.empty((rows, cols), dtype=collective_dtype(mode), device=like.device)


def _reduce(op: str, twin: torch.Tensor, pg, axis: str, mode: str = DEFAULT_MODE) -> torch.Tensor:
    """All-reduce ``twin`` (the epilogue's copy of the partial) in place in its own dtype (BF16 in v1,
    FP32 in fp32_invariant mode), then round to BF16 once (a no-op for a BF16 sum)."""
    _COLLECTIVES[(op, "all_reduce", axis)] += 1
    dist.all_reduce(twin, op=dist.ReduceOp.SUM, group=pg, async_op=False)
    return twin.to(torch.bfloat16) if mode == FP32_INVARIANT else twin


# ---------------------------------------------------------------------------------------------
# Operators
# ---------------------------------------------------------------------------------------------
def row_parallel_fwd_launch(hidden_local: torch.Tensor, w_local: torch.Tensor, tp_group: AxisGroup, *,
                            mode: str = DEFAULT_MODE):
    """Down forward: ``(partial, output, ParallelLaunch)``; see the module doc."""
    op = "row_parallel_fwd"
    check_mode(mode)
    tensors = {"hidden_local": hidden_local, "w_local": w_local}  # [M_l, I/2], [I/2, H]
    _check_bf16(tensors)
    _check_initialised(op)
    pg, _ = _check_group(op, tp_group, "tp")
    layout = tp_group.layout
    shapes = layout.local_shapes()
    _check_shapes(op, layout, tensors, {"hidden_local": shapes["hidden"], "w_local": shapes["w_down"]})
    backend, pg_backend = _check_backend(op, tensors, pg)
    twin = _twin(hidden_local.shape[0], w_local.shape[1], mode, hidden_local)
    partial, gemm = det_gemm_fwd_launch(hidden_local, w_local, twin_out=twin, **gemm_kwargs("fwd", layout, mode))
    output = _reduce(op, twin, pg, "tp", mode)
    _CALLS[op] += 1
    return partial, output, ParallelLaunch(op, backend, pg_backend, "all_reduce", "tp", tp_group.ranks,
                                           str(collective_dtype(mode)), gemm)


def column_parallel_dx_launch(d_proj_local: torch.Tensor, w_local: torch.Tensor, tp_group: AxisGroup, *,
                              mode: str = DEFAULT_MODE):
    """Gate/Up dX: ``(partial, dx, ParallelLaunch)``; see the module doc."""
    op = "column_parallel_dx"
    check_mode(mode)
    tensors = {"d_proj_local": d_proj_local, "w_local": w_local}  # [M_l, I/2], [H, I/2]
    _check_bf16(tensors)
    _check_initialised(op)
    pg, _ = _check_group(op, tp_group, "tp")
    layout = tp_group.layout
    shapes = layout.local_shapes()
    _check_shapes(op, layout, tensors, {"d_proj_local": shapes["d_gate"], "w_local": shapes["w_gate"]})
    backend, pg_backend = _check_backend(op, tensors, pg)
    twin = _twin(d_proj_local.shape[0], w_local.shape[0], mode, d_proj_local)
    partial, gemm = det_gemm_da_launch(d_proj_local, w_local, twin_out=twin, **gemm_kwargs("da", layout, mode))
    dx = _reduce(op, twin, pg, "tp", mode)
    _CALLS[op] += 1
    return partial, dx, ParallelLaunch(op, backend, pg_backend, "all_reduce", "tp", tp_group.ranks,
                                       str(collective_dtype(mode)), gemm)


def replicated_dw_launch(a_local: torch.Tensor, dc_local: torch.Tensor, grad_group: AxisGroup, *,
                         mode: str = DEFAULT_MODE):
    """dW of Gate/Up (a = x, dc = dProj) or Down (a = hidden, dc = dOut), summed over the CP group:
    ``(local, reduced, ParallelLaunch)``; see the module doc."""
    op = "replicated_dw"
    check_mode(mode)
    tensors = {"a_local": a_local, "dc_local": dc_local}
    _check_bf16(tensors)
    _check_initialised(op)
    pg, _ = _check_group(op, grad_group, "cp")  # version 1: the gradient group is the CP group
    layout = grad_group.layout
    shapes = layout.local_shapes()
    pairs = {"gate_up": {"a_local": shapes["x"], "dc_local": shapes["d_gate"]},
             "down": {"a_local": shapes["hidden"], "dc_local": shapes["d_out"]}}
    got = (tuple(a_local.shape), tuple(dc_local.shape))
    if got not in {(p["a_local"], p["dc_local"]) for p in pairs.values()}:
        raise ValueError(
            f"{op}: a_local {got[0]}, dc_local {got[1]} are not configured local shapes for "
            f"{layout.model.name} B={layout.batch} S={layout.seq_len}; supported: Gate/Up (x, dProj) = "
            f"{pairs['gate_up']['a_local']}, {pairs['gate_up']['dc_local']} or Down (hidden, dOut) = "
            f"{pairs['down']['a_local']}, {pairs['down']['dc_local']}"
        )
    backend, pg_backend = _check_backend(op, tensors, pg)
    twin = _twin(a_local.shape[1], dc_local.shape[1], mode, a_local)
    local, gemm = det_gemm_db_launch(a_local, dc_local, twin_out=twin, **gemm_kwargs("db", layout, mode))
    reduced = _reduce(op, twin, pg, "cp", mode)
    _CALLS[op] += 1
    return local, reduced, ParallelLaunch(op, backend, pg_backend, "all_reduce", "cp", grad_group.ranks,
                                          str(collective_dtype(mode)), gemm)


def row_parallel_dhidden_launch(d_out_local: torch.Tensor, w_local: torch.Tensor, *,
                                layout: TpCpLayout | None = None, mode: str = DEFAULT_MODE):
    """Down dHidden, TP-sharded, no collective: ``(d_hidden, ParallelLaunch)``.

    Each element reduces over the full H on one rank, so the shard is final. With ``layout`` the
    local shapes are checked against it; without, only det_gemm's own checks apply. fp32_invariant
    mode pins the invariant config (so the bits do not depend on M) and needs ``layout``."""
    op = "row_parallel_dhidden"
    check_mode(mode)
    if mode == FP32_INVARIANT and layout is None:
        raise ValueError(f"{op}: mode {mode!r} needs layout= (the pinned config follows the layout's shard width)")
    tensors = {"d_out_local": d_out_local, "w_local": w_local}  # [M_l, H], [I/2, H]
    _check_bf16(tensors)
    if layout is not None:
        if not isinstance(layout, TpCpLayout):
            raise TypeError(f"{op}: layout is a {type(layout).__name__}; supported: kernels.layout.TpCpLayout or None")
        shapes = layout.local_shapes()
        _check_shapes(op, layout, tensors, {"d_out_local": shapes["d_out"], "w_local": shapes["w_down"]})
    kwargs = gemm_kwargs("da", layout, mode) if mode == FP32_INVARIANT else {}
    kwargs.pop("out_dtype", None)  # no reduction follows: BF16 out, rounded once in the kernel
    d_hidden, gemm = det_gemm_da_launch(d_out_local, w_local, **kwargs)
    _CALLS[op] += 1
    return d_hidden, ParallelLaunch(op, gemm.backend, None, None, None, None, None, gemm)


def row_parallel_fwd(hidden_local: torch.Tensor, w_local: torch.Tensor, tp_group: AxisGroup, *,
                     mode: str = DEFAULT_MODE):
    """Down forward: ``(partial, output)`` with ``output`` the TP all-reduce SUM of ``partial``."""
    return row_parallel_fwd_launch(hidden_local, w_local, tp_group, mode=mode)[:2]


def column_parallel_dx(d_proj_local: torch.Tensor, w_local: torch.Tensor, tp_group: AxisGroup, *,
                       mode: str = DEFAULT_MODE):
    """Gate/Up dX: ``(partial, dx)`` with ``dx`` the TP all-reduce SUM of ``partial``."""
    return column_parallel_dx_launch(d_proj_local, w_local, tp_group, mode=mode)[:2]


def replicated_dw(a_local: torch.Tensor, dc_local: torch.Tensor, grad_group: AxisGroup, *,
                  mode: str = DEFAULT_MODE):
    """dW: ``(local, reduced)`` with ``reduced`` the CP all-reduce SUM of ``local``."""
    return replicated_dw_launch(a_local, dc_local, grad_group, mode=mode)[:2]


def row_parallel_dhidden(d_out_local: torch.Tensor, w_local: torch.Tensor, *,
                         layout: TpCpLayout | None = None, mode: str = DEFAULT_MODE) -> torch.Tensor:
    """Down dHidden ``[M_l, I/2]``, no collective (stays TP-sharded)."""
    return row_parallel_dhidden_launch(d_out_local, w_local, layout=layout, mode=mode)[0]
