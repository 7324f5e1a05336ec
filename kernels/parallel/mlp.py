"""The Qwen3 dense MLP ``y = down(silu(gate(x)) * up(x))`` forward and backward from detkit operators,
at TP in {1, 2} x CP in {1, 2} of the TP=2 x CP=2 layout, as a ``torch.autograd.Function``.

Weights are nn.Linear weights ``[out, in]``. Gate and Up live in one buffer ``w_gate_up
[2*I_loc, H]`` whose rows are TP-shard-major ``[gate I_0; up I_0; gate I_1; up I_1]`` (at TP=2 a rank
holds its own ``[gate I_t; up I_t]``; ``shard_weights`` builds it), so Gate/Up forward, dX and dW
are one GEMM each and the combined dX needs one TP reduction::

    gu  = x @ w_gate_up.T                     det_gemm_fwd  [M_loc, 2*I_loc]  (over H: not sharded)
    h   = swiglu(gate(gu), up(gu))            swiglu_fwd    [M_loc, I_loc]
    y   = sum_TP h @ w_down.T                 det_gemm_fwd + TP reduction      [M_loc, H]
    dh  = dy @ w_down                         det_gemm_da   [M_loc, I_loc]  (over H: not sharded)
    dgu = swiglu_bwd(dh, gate, up)            written into one [M_loc, 2*I_loc] buffer
    dx  = sum_TP dgu @ w_gate_up              det_gemm_da + TP reduction       [M_loc, H]
    dW_gate_up = sum_CP dgu.T @ x             det_gemm_db + CP reduction       [2*I_loc, H]
    dW_down    = sum_CP dy.T @ h              det_gemm_db + CP reduction       [H, I_loc]

Combined Gate+Up dX order: a TP rank reduces over its 2*I/2 columns ``[gate I_t | up I_t]`` in
ascending order in one FP32 accumulator (the Gate and Up contributions are summed locally, before
the one TP reduction). In ``fp32_invariant`` mode that accumulation is one FP32 segment; TP=1 runs the
same columns ``[g0|u0|g1|u1]`` with seg_len = 2*I/2, so it computes ``fl32(P_0 + P_1)`` like the
FP32 all-reduce of TP=2. (Gate and Up as separate segments would need the tree
``(g0+u0)+(g1+u1)``, which det_gemm's left-to-right segment sum cannot form in one launch.)

Reductions per mode (``kernels.invariant``): ``bf16`` -- v1 (BF16 partials, BF16 all-reduce; TP=1 /
CP=1 a plain det_gemm); ``fp32_invariant`` -- FP32 partials, FP32 all-reduce, one BF16 rounding,
TP=1 / CP=1 by shard-aligned FP32 segments: the same bits in all four configs.

Contract: ``mlp_ref_fp64`` is the pure-torch FP64 MLP of the same BF16 inputs; ``mlp_bounds``
propagates the GEMM and SwiGLU bounds through the chain (docs/invariance.md, "MLP contract").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from detkit.kernels.parallel import operators as parallel
from detkit.kernels.backend import check_bf16_matrix
from detkit.kernels.bounds import gemm_bound, reduced_bound
from detkit.kernels.det_gemm.launch import det_gemm_da_launch, det_gemm_db_launch, det_gemm_fwd_launch
from detkit.kernels.parallel.invariant import (
    BF16, DEFAULT_MODE, FP32_INVARIANT, check_mode, cp1_db, gemm_kwargs, layout_config, tp1_da, tp1_fwd,
)
from detkit.kernels.parallel.layout import AxisGroup, TpCpLayout
from detkit.kernels.parallel.swiglu import gate_up_views, swiglu_bwd, swiglu_bwd_bound, swiglu_fwd, swiglu_fwd_bound

DEGREES = (1, 2)


@dataclass(frozen=True)
class MlpPlan:
    """Where one rank sits: TP and CP degrees (1 or 2), its shard coordinates, the groups it reduces
    over (exactly when the degree is 2) and the reduction mode."""

    layout: TpCpLayout
    tp: int = 1
    cp: int = 1
    tp_rank: int = 0
    cp_rank: int = 0
    tp_group: AxisGroup | None = None
    cp_group: AxisGroup | None = None
    mode: str = DEFAULT_MODE

    def __post_init__(self):
        if not isinstance(self.layout, TpCpLayout):
            raise TypeError(f"layout is a {type(self.layout).__name__}; supported: kernels.layout.TpCpLayout")
        check_mode(self.mode)
        for axis in ("tp", "cp"):
            degree, rank, group = getattr(self, axis), getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_group")
            if degree not in DEGREES:
                raise ValueError(f"{axis}={degree!r}; supported: {DEGREES}")
            if rank not in range(degree):
                raise ValueError(f"{axis}_rank={rank!r}; supported: 0..{degree - 1} at {axis.upper()}={degree}")
            if (degree == 2) != (group is not None):
                raise ValueError(f"{axis.upper()}={degree} needs {'a' if degree == 2 else 'no'} {axis}_group; got "
                                 f"{group!r}")
            if group is not None:
                if not isinstance(group, AxisGroup) or group.axis != axis:
                    raise TypeError(f"{axis}_group must be a {axis.upper()} kernels.layout.AxisGroup; got {group!r}")
                if group.layout.model != self.layout.model:
                    raise ValueError(f"{axis}_group's layout has model {group.layout.model}; the plan has "
                                     f"{self.layout.model}")

    @property
    def label(self) -> str:
        return f"TP{self.tp}CP{self.cp}"

    @property
    def m_loc(self) -> int:
        return self.layout.m if self.cp == 1 else self.layout.m_local

    @property
    def i_loc(self) -> int:
        return self.layout.model.intermediate_size // self.tp

    @property
    def tp_shards(self) -> int:
        """Intermediate TP shards this rank holds (2 at TP=1, 1 at TP=2)."""
        return 2 // self.tp

    def shapes(self) -> dict[str, tuple[int, int]]:
        h, m, i = self.layout.model.hidden_size, self.m_loc, self.i_loc
        return {"x": (m, h), "w_gate_up": (2 * i, h), "w_down": (h, i), "dy": (m, h)}


# ---------------------------------------------------------------------------------------------
# Shards of the global tensors for a plan (launcher / test side)
# ---------------------------------------------------------------------------------------------
def shard_weights(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  plan: MlpPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_gate_up [2*I_loc, H], w_down [H, I_loc])`` of this rank from the global nn.Linear weights
    ``w_gate``, ``w_up`` ``[I, H]`` and ``w_down`` ``[H, I]`` (contiguous copies, made once)."""
    layout = plan.layout
    tps = range(2) if plan.tp == 1 else [plan.tp_rank]
    gate_up = torch.cat([torch.cat([w_gate[layout.i_shard(t)], w_up[layout.i_shard(t)]]) for t in tps])
    down = torch.cat([w_down[:, layout.i_shard(t)] for t in tps], dim=1)
    return gate_up.contiguous(), down.contiguous()


def shard_tokens(t: torch.Tensor, plan: MlpPlan) -> torch.Tensor:
    """This rank's rows of a global activation ``[M, *]`` (all rows at CP=1)."""
    return t.contiguous() if plan.cp == 1 else plan.layout.shard_rows(t, plan.cp_rank).contiguous()


def split_gate_up(w: torch.Tensor, plan: MlpPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[2*I_loc, *]`` Gate/Up tensor (weight or its gradient) -> Gate and Up ``[I_loc, *]`` rows in
    natural intermediate order."""
    i_l = plan.layout.i_local
    pairs = w.reshape(plan.tp_shards, 2, i_l, *w.shape[1:])
    return pairs[:, 0].reshape(plan.i_loc, *w.shape[1:]), pairs[:, 1].reshape(plan.i_loc, *w.shape[1:])


# ---------------------------------------------------------------------------------------------
# Forward and backward
# ---------------------------------------------------------------------------------------------
def _check_groups(op: str, plan: MlpPlan, tensors: dict[str, torch.Tensor]) -> dict[str, object]:
    """Before any work: every group of the plan through kernels.parallel's checks (initialised,
    AxisGroup of the right axis, size 2, this rank's group, NCCL for CUDA / gloo for the interpreter),
    and the plan's shard coordinates against this rank's place in the layout. Returns axis -> pg."""
    pgs = {}
    for axis in ("tp", "cp"):
        group = getattr(plan, f"{axis}_group")
        if group is None:
            continue
        parallel._check_initialised(op)
        pg, me = parallel._check_group(op, group, axis)
        cp, tp = group.layout.coords(me)
        if (tp if axis == "tp" else cp) != getattr(plan, f"{axis}_rank"):
            raise ValueError(f"{op}: plan {plan.label} says {axis}_rank={getattr(plan, f'{axis}_rank')} but this "
                             f"process holds layout rank {me} (cp {cp}, tp {tp})")
        parallel._check_backend(op, tensors, pg)
        pgs[axis] = pg
    return pgs


def _reduce(op: str, partial: torch.Tensor, pg, axis: str, mode: str) -> torch.Tensor:
    """One all-reduce over a checked group, in place on ``partial`` (the MLP does not keep it; no copy),
    counted by kernels.parallel's counters."""
    out = parallel._reduce(op, partial, pg, axis, mode)
    parallel._CALLS[op] += 1
    return out


def _check_inputs(plan: MlpPlan, tensors: dict[str, torch.Tensor]) -> None:
    want = plan.shapes()
    for name, t in tensors.items():
        check_bf16_matrix(name, t)
        if tuple(t.shape) != want[name]:
            raise ValueError(f"mlp {plan.label}: {name} has shape {tuple(t.shape)}; the plan's local shapes are "
                             f"{ {n: want[n] for n in tensors} }")


def _local_kwargs(op: str, plan: MlpPlan) -> dict:
    """A GEMM without reduction after it: the pinned config in fp32_invariant mode, BF16 out."""
    return {"config": layout_config(op, plan.layout)} if plan.mode == FP32_INVARIANT else {}


def mlp_fwd(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
            plan: MlpPlan) -> tuple[torch.Tensor, tuple]:
    """``(y [M_loc, H], saved)``; ``saved`` feeds ``mlp_bwd``."""
    tensors = {"x": x, "w_gate_up": w_gate_up, "w_down": w_down}
    _check_inputs(plan, tensors)
    pgs = _check_groups("mlp_fwd", plan, tensors)
    gu, _ = det_gemm_fwd_launch(x, w_gate_up.t(), **_local_kwargs("fwd", plan))
    gate, up = gate_up_views(gu, plan.tp_shards)
    h = swiglu_fwd(gate, up).view(plan.m_loc, plan.i_loc)
    if plan.tp == 1:
        y = tp1_fwd(h, w_down.t(), plan.layout, plan.mode)
    else:
        partial, _ = det_gemm_fwd_launch(h, w_down.t(), **gemm_kwargs("fwd", plan.layout, plan.mode))
        y = _reduce("mlp_down_fwd", partial, pgs["tp"], "tp", plan.mode)
    return y, (x, w_gate_up, w_down, gu, h)


def mlp_bwd(dy: torch.Tensor, saved: tuple, plan: MlpPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [M_loc, H], dW_gate_up [2*I_loc, H], dW_down [H, I_loc])``."""
    x, w_gate_up, w_down, gu, h = saved
    _check_inputs(plan, {"dy": dy})
    pgs = _check_groups("mlp_bwd", plan, {"dy": dy, "x": x})
    layout, mode = plan.layout, plan.mode
    dh, _ = det_gemm_da_launch(dy, w_down.t(), **_local_kwargs("da", plan))
    gate, up = gate_up_views(gu, plan.tp_shards)
    dgu = torch.empty_like(gu)
    d_gate, d_up = gate_up_views(dgu, plan.tp_shards)
    swiglu_bwd(dh.view(plan.m_loc * plan.tp_shards, layout.i_local), gate, up, d_gate=d_gate, d_up=d_up)
    if plan.tp == 1:
        dx = tp1_da(dgu, w_gate_up.t(), 2 * layout.i_local, layout, mode)
    else:
        partial, _ = det_gemm_da_launch(dgu, w_gate_up.t(), **gemm_kwargs("da", layout, mode))
        dx = _reduce("mlp_gate_up_dx", partial, pgs["tp"], "tp", mode)
    if plan.cp == 1:
        dw_gate_up = cp1_db(dgu, x, layout, mode)
        dw_down = cp1_db(dy, h, layout, mode)
    else:
        dw_gate_up = _reduce("mlp_gate_up_dw", det_gemm_db_launch(dgu, x, **gemm_kwargs("db", layout, mode))[0],
                             pgs["cp"], "cp", mode)
        dw_down = _reduce("mlp_down_dw", det_gemm_db_launch(dy, h, **gemm_kwargs("db", layout, mode))[0],
                          pgs["cp"], "cp", mode)
    return dx, dw_gate_up, dw_down


class DetMlpFunction(torch.autograd.Function):
    """``DetMlpFunction.apply(x, w_gate_up, w_down, plan) -> y``; gradients for x and both weights."""

    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, plan):
        y, saved = mlp_fwd(x, w_gate_up, w_down, plan)
        ctx.plan = plan
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, dy):
        dx, dw_gate_up, dw_down = mlp_bwd(dy, ctx.saved_tensors, ctx.plan)
        return dx, dw_gate_up, dw_down, None


class DetQwen3MLP(torch.nn.Module):
    """The Qwen3 MLP of one rank: parameters ``w_gate_up [2*I_loc, H]`` and ``w_down [H, I_loc]``."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, plan: MlpPlan):
        super().__init__()
        self.plan = plan
        self.w_gate_up = torch.nn.Parameter(w_gate_up)
        self.w_down = torch.nn.Parameter(w_down)

    @classmethod
    def from_global(cls, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, plan: MlpPlan):
        return cls(*shard_weights(w_gate, w_up, w_down, plan), plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DetMlpFunction.apply(x, self.w_gate_up, self.w_down, self.plan)


# ---------------------------------------------------------------------------------------------
# FP64 reference and the contract
# ---------------------------------------------------------------------------------------------
SILU_LIP = 1.1  # max |silu'(x)| = 1.0998
SILU_CURV = 0.5  # max |silu''(x)| = 0.5 (at 0)


def _silu(g: torch.Tensor) -> torch.Tensor:
    return g * torch.sigmoid(g)


def mlp_ref_fp64(x, w_gate, w_up, w_down, dy) -> dict[str, torch.Tensor]:
    """Global MLP forward and backward in FP64 from the BF16 inputs (nn.Linear weights)."""
    x, wg, wu, wd, dy = (t.double() for t in (x, w_gate, w_up, w_down, dy))
    g, u = x @ wg.t(), x @ wu.t()
    s = torch.sigmoid(g)
    h = g * s * u
    y = h @ wd.t()
    dh = dy @ wd
    d_gate = dh * u * (s + g * s * (1 - s))
    d_up = dh * g * s
    return {"y": y, "dx": d_gate @ wg + d_up @ wu, "dw_gate": d_gate.t() @ x, "dw_up": d_up.t() @ x,
            "dw_down": dy.t() @ h, "g": g, "u": u, "h": h, "dh": dh, "d_gate": d_gate, "d_up": d_up}


def _reduced(c_mag: torch.Tensor, abs_ab: torch.Tensor, k: int, prop: torch.Tensor) -> torch.Tensor:
    """A GEMM over k terms of perturbed operands, in either mode at TP/CP 1 or 2: reduced_bound with
    |p0*| + |p1*| <= |A||B| and gamma(k) >= gamma(k/2) (covers v1's two roundings and the FP32 path),
    plus the propagated operand error ``prop``."""
    return reduced_bound(c_mag + prop, abs_ab, abs_ab, k) + prop


def mlp_bounds(x, w_gate, w_up, w_down, dy, ref: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Per-element bounds on |out - ref| for y, dx, dw_gate, dw_up, dw_down (global shapes)."""
    ref = ref if ref is not None else mlp_ref_fp64(x, w_gate, w_up, w_down, dy)
    ax, awg, awu, awd, ady = (t.double().abs() for t in (x, w_gate, w_up, w_down, dy))
    hdim, idim, m = x.shape[1], w_gate.shape[0], x.shape[0]
    g, u = ref["g"], ref["u"]
    bg = gemm_bound(g, ax @ awg.t(), hdim)
    bu = gemm_bound(u, ax @ awu.t(), hdim)
    g_ub, u_ub = g.abs() + bg, u.abs() + bu
    silu_ub = _silu(g).abs() + SILU_LIP * bg
    prop_h = SILU_LIP * bg * u_ub + _silu(g).abs() * bu
    dh_ = ref["h"].abs() + prop_h
    db_h = swiglu_fwd_bound(dh_, g_ub, u_ub) + prop_h
    h_ub = ref["h"].abs() + db_h
    prop_y = db_h @ awd.t()
    out = {"y": _reduced(ref["y"].abs(), h_ub @ awd.t(), idim, prop_y)}
    bdh = gemm_bound(ref["dh"], ady @ awd, hdim)
    dh_ub = ref["dh"].abs() + bdh
    prop_dg = SILU_LIP * (bdh * u_ub + dh_ub * bu) + SILU_CURV * dh_ub * u_ub * bg
    prop_du = bdh * silu_ub + dh_ub * SILU_LIP * bg
    own_dg, own_du = swiglu_bwd_bound(ref["d_gate"].abs() + prop_dg, ref["d_up"].abs() + prop_du, dh_ub, g, u_ub)
    e_dg, e_du = own_dg + prop_dg, own_du + prop_du
    dg_ub, du_ub = ref["d_gate"].abs() + e_dg, ref["d_up"].abs() + e_du
    out["dx"] = _reduced(ref["dx"].abs(), dg_ub @ awg + du_ub @ awu, 2 * idim, e_dg @ awg + e_du @ awu)
    out["dw_gate"] = _reduced(ref["dw_gate"].abs(), dg_ub.t() @ ax, m, e_dg.t() @ ax)
    out["dw_up"] = _reduced(ref["dw_up"].abs(), du_ub.t() @ ax, m, e_du.t() @ ax)
    out["dw_down"] = _reduced(ref["dw_down"].abs(), ady.t() @ h_ub, m, ady.t() @ db_h)
    return out


__all__ = [
    "BF16", "FP32_INVARIANT", "MlpPlan", "DetMlpFunction", "DetQwen3MLP", "mlp_fwd", "mlp_bwd", "mlp_ref_fp64",
    "mlp_bounds", "shard_weights", "shard_tokens", "split_gate_up",
]
