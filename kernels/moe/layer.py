"""Deterministic BF16 Mixture-of-Experts expert MLP (SwiGLU) for Hopper, forward and backward: the layer, its
autograd Function and its pure-torch reference. The public API of the MoE BF16 layer is importable from here.

Math, for token t routed to experts e_k with scores s_k (k = 0..K-1, masked routes skipped):
    gu_k  = x[t] @ W1[e_k]                       W1 [E, H, 2I], gate/up columns interleaved
    h_k   = silu(g_k) * u_k                      g_k = gu_k[0::2], u_k = gu_k[1::2]
    y_k   = bf16( h_k @ W2[e_k] )                W2 [E, I, H]; FP32 accumulation, one BF16 rounding
    out[t] = bf16( sum_{k ascending} s_k * y_k ) FP32 sum, one BF16 rounding
Backward, with dy_k = s_k * dout[t]:
    dh_k = s_k * (dout[t] @ W2[e_k].T)  -> dg_k = dh_k * u_k * silu'(g_k), du_k = dh_k * silu(g_k)
    dx[t] = bf16( sum_{k ascending} dx_k ),  dx_k = bf16( dgu_k @ W1[e_k].T )   FP32 sum, one BF16 rounding
    dW1[e] = sum over e's rows (ascending) x[t]^T dgu_k,  dW2[e] = sum h_k^T bf16(s_k * dout[t])
    dscores[t, k] = dout[t] . y_k = (dout[t] @ W2[e_k].T) . h_k     (the second form is computed)

Weight convention (the ``b [K, N]`` convention of det_gemm, one matrix per expert):
    W1 [E, H, 2I], column 2j = gate_j and column 2j+1 = up_j (interleaved, so a gate/up pair always
    lands in one output tile and SwiGLU runs in the up-projection's epilogue). ``interleave_gate_up``
    and ``deinterleave_gate_up`` convert from/to the usual split-half [gate; up] layout.
    W2 [E, I, H].
    ``gate_up="split"``: W1's columns are [gate (I) | up (I)] instead, read in place as interleaved pairs (the same
    bits: every kernel addresses column 2j + half at j + half * I). Any non-negative strides are accepted: transformers'
    and nn.Linear-style stacks ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` are passed as
    ``gate_up_proj.transpose(1, 2)`` with ``gate_up="split"`` and ``down_proj.transpose(1, 2)`` (views: no copy), and
    dW1, dW2 come back with the weights' strides (autograd keeps them as .grad without a layout copy).

Where the parts live:
    kernels/moe/routing.py   the expert-sorted, 128-padded rows, built on the device (no host read)
    kernels/moe/kernels.py   the Triton kernels (grouped GEMMs with their epilogues, weight gradients, combines)
    kernels/moe/ws.py        the Gluon "ws" kernels for sm_90 (down, dX, up, dgrad, weight gradients)
    kernels/moe/launch.py    the stage launch wrappers;  kernels/moe/configs.py  the pinned config tables
    kernels/moe/checks.py    the input checks;  kernels/moe/common.py  names and codes shared with the FP8 layer

No host synchronization (forward and backward): every stage runs over the routing's bound (the largest P its T*K
routes can have over E experts); the grouped GEMMs skip every tile past the real P on the device (the routing's
gate), the weight gradients read the expert counts and offsets on the device. A batch the routing's checks refuse
(ids out of range, duplicate ids in a row, non-finite scores) is not refused on the host: every GEMM tile skips, out,
dX, dW1, dW2 and the dscores come out NaN, ``MoeRouting.refused`` / ``check()`` and the device's sticky
``error_flags`` / ``check_moe_errors`` say so when the caller reads them. Inside ``sync_checks()`` the forward reads
the counts back once, refuses a bad batch with check_topk's messages and runs over the exact P (the same bits).

Determinism rests on the det_gemm rules: no split-K, no atomics, one program owns each output tile and reduces
all of its reduced dimension in a fixed ascending order that depends on the shapes alone. Batch invariance
(forward, per token): a token's rows are never reduced with other tokens' rows, and the pinned tile configs do not
depend on T or on the routing. y [P, H] is not kept for the backward: the dscores come from the dgrad accumulator
and the saved h.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from detkit.kernels.moe.checks import check_dout, check_main_grads, check_moe_inputs, check_stage_range
from detkit.kernels.moe.common import LAYER_STAGES, MoeGrads, layer_stage_names, stage_name
from detkit.kernels.moe.configs import MOE_CONFIG_TABLE_VERSION, MOE_CONFIGS, STAGES, select_moe_config
from detkit.kernels.moe.kernels import moe_grouped_gemm_kernel, moe_grouped_gemm_tma_kernel
from detkit.kernels.moe.launch import (
    checked_routing, launch_checked_routing, moe_combine, moe_dgrad_dswiglu, moe_dgrad_dswiglu_dscore, moe_down,
    moe_dscores_from_partials, moe_dx_route, moe_gather_sum, moe_scale_rows, moe_up_swiglu, moe_wgrad_w1,
    moe_wgrad_w2, table_moe_config, triton_tile,
)
from detkit.kernels.moe.operands import GATE_UP_LAYOUTS, check_gate_up, weight_descriptor, ws_weight_rows
from detkit.kernels.moe.routing import MoeRouting, check_moe_errors, error_flags, sync_checks, sync_checks_enabled

__all__ = [
    # the layer
    "MoeGrads", "MoeMlpFunction", "MoeSaved", "deinterleave_gate_up", "interleave_gate_up", "moe_mlp", "moe_mlp_bwd",
    "moe_mlp_fwd", "moe_mlp_ref",
    # failing closed without a host read (kernels/moe/routing.py)
    "check_moe_errors", "error_flags", "sync_checks",
    # its stages, configs and names (launch.py, configs.py, common.py)
    "GATE_UP_LAYOUTS", "LAYER_STAGES", "MOE_CONFIGS", "MOE_CONFIG_TABLE_VERSION", "STAGES", "check_moe_inputs", "checked_routing",
    "launch_checked_routing", "layer_stage_names", "moe_combine", "moe_dgrad_dswiglu", "moe_dgrad_dswiglu_dscore",
    "moe_down", "moe_dscores_from_partials", "moe_dx_route", "moe_gather_sum", "moe_grouped_gemm_kernel",
    "moe_grouped_gemm_tma_kernel", "moe_scale_rows", "moe_up_swiglu", "moe_wgrad_w1", "moe_wgrad_w2",
    "select_moe_config", "stage_name", "table_moe_config", "triton_tile", "weight_descriptor", "ws_weight_rows",
]


@dataclass
class MoeSaved:
    """What the backward needs: gu, h in BF16 (y is not kept: dscores come from h, fused into dgrad)."""

    backend: str
    routing: MoeRouting
    x: torch.Tensor  # [T, H]
    w1: torch.Tensor  # [E, H, 2I]
    w2: torch.Tensor  # [E, I, H]
    scores: torch.Tensor  # [T, K]
    gu: torch.Tensor  # [P, 2I] interleaved pre-activations (P: the routing's bound, or the exact P in sync_checks)
    h: torch.Tensor  # [P, I]
    gate_up: str = "interleaved"  # w1's column layout


def moe_mlp_fwd(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                scores: torch.Tensor, *, stage_range=None, gate_up: str = "interleaved") -> tuple[torch.Tensor, MoeSaved]:
    """out [T, H] bf16 and the saved state for ``moe_mlp_bwd``.

    x [T, H] bf16; w1 [E, H, 2I] bf16, columns in the ``gate_up`` layout; w2 [E, I, H] bf16; topk_ids [T, K] int32
    (-1 masked); scores [T, K] float32 or bf16. ``stage_range(name)`` (e.g. an NVTX range) wraps each stage.
    """
    check_stage_range(stage_range)
    check_gate_up(gate_up)
    backend = check_moe_inputs(x, w1, w2, topk_ids, scores)
    rng = stage_range or (lambda name: nullcontext())
    names = layer_stage_names(x, w1, topk_ids.shape[1])
    with rng(names["routing"]):
        pending = launch_checked_routing(x, w1, topk_ids, scores)
    with rng(names["up_swiglu"]):  # over the largest P, gated on the device
        gu, h = moe_up_swiglu(x, w1, pending.bound, backend, gate_up=gate_up)
    routing = pending.bound  # every stage runs over the bound, gated on the device: no host read
    if sync_checks_enabled():  # the validating mode: one host read refuses a bad batch, then the exact P
        with rng(names["routing"]):
            routing = pending.finish()  # the up GEMM computed nothing from a refused batch
            gu, h = gu[:routing.padded_rows], h[:routing.padded_rows]
    with rng(names["down"]):
        y = moe_down(h, w2, routing, backend)
    with rng(names["combine"]):
        out = moe_combine(y, routing, scores, backend)
    return out, MoeSaved(backend, routing, x, w1, w2, scores, gu, h, gate_up)


def moe_mlp_bwd(dout: torch.Tensor, saved: MoeSaved, *, main_grads=None, stage_range=None) -> MoeGrads:
    """Gradients of ``moe_mlp_fwd`` for dout [T, H] bf16. With ``main_grads = (g1, g2)`` (FP32, the
    weights' shapes) dW1/dW2 are added into them in FP32 and returned as None."""
    if not isinstance(saved, MoeSaved):
        raise TypeError(f"saved must be the MoeSaved of moe_mlp_fwd; got {type(saved).__name__}")
    check_stage_range(stage_range)
    check_dout(dout, saved.x)
    check_main_grads(main_grads, saved.w1, saved.w2)
    rng = stage_range or (lambda name: nullcontext())
    names = layer_stage_names(saved.x, saved.w1, saved.routing.top_k)
    backend, routing = saved.backend, saved.routing
    with rng(names["dgrad_dswiglu"]):
        # dW2's dy and dout's rows in expert order, in one pass: dgrad reads the latter by TMA rather than gathering
        # them (docs/moe.md: faster for one more P x H pass and buffer)
        dy, sorted_dout = moe_scale_rows(dout, routing, backend, sorted_copy=True)
        dgu, ds_part = moe_dgrad_dswiglu_dscore(dout, saved.w2, saved.gu, saved.h, routing, backend,
                                                sorted_dout=sorted_dout)
        del sorted_dout
    with rng(names["dx"]):
        dx = moe_gather_sum(moe_dx_route(dgu, saved.w1, routing, backend, gate_up=saved.gate_up), routing, backend)
    with rng(names["wgrad"]):
        mg1, mg2 = main_grads if main_grads is not None else (None, None)
        dw1 = moe_wgrad_w1(saved.x, dgu, routing, backend, mg1, gate_up=saved.gate_up, like=saved.w1)
        dw2 = moe_wgrad_w2(saved.h, dout, routing, backend, mg2, like=saved.w2, dy=dy)
    with rng(names["dscores"]):
        ds = moe_dscores_from_partials(ds_part, routing, backend).to(saved.scores.dtype)
    return MoeGrads(dx, dw1, dw2, ds)


class MoeMlpFunction(torch.autograd.Function):
    """autograd wrapper: (x, w1, w2, topk_ids, scores, main_grad_w1, main_grad_w2, gate_up) -> out."""

    @staticmethod
    def forward(ctx, x, w1, w2, topk_ids, scores, main_grad_w1=None, main_grad_w2=None, gate_up="interleaved"):
        main_grads = None if main_grad_w1 is None and main_grad_w2 is None else (main_grad_w1, main_grad_w2)
        check_main_grads(main_grads, w1, w2)
        out, saved = moe_mlp_fwd(x, w1, w2, topk_ids, scores, gate_up=gate_up)
        ctx.saved = saved
        ctx.main_grads = main_grads
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = moe_mlp_bwd(dout, ctx.saved, main_grads=ctx.main_grads)  # any strides, no copy
        ctx.saved = None
        return grads.dx, grads.dw1, grads.dw2, None, grads.dscores, None, None, None


def moe_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, scores: torch.Tensor,
            main_grads: tuple[torch.Tensor, torch.Tensor] | None = None, *,
            gate_up: str = "interleaved") -> torch.Tensor:
    """Differentiable deterministic MoE expert MLP. With ``main_grads`` the weight gradients are
    accumulated into those FP32 buffers (Megatron's gradient-accumulation fusion) and w1.grad /
    w2.grad stay None. ``gate_up``: w1's column layout, "interleaved" or "split" (read in place; the same bits)."""
    check_gate_up(gate_up)
    check_main_grads(main_grads, w1, w2)
    mg1, mg2 = main_grads if main_grads is not None else (None, None)
    return MoeMlpFunction.apply(x, w1, w2, topk_ids, scores, mg1, mg2, gate_up)


def interleave_gate_up(w: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Split-half [gate (I); up (I)] along ``dim`` -> interleaved (gate_0, up_0, gate_1, up_1, ...). Copies."""
    d = dim % w.dim()
    if w.shape[d] % 2:
        raise ValueError(f"dim {dim} of shape {tuple(w.shape)} must be even (gate and up halves)")
    gate, up = w.chunk(2, dim=d)
    return torch.stack((gate, up), dim=d + 1).flatten(d, d + 1)


def deinterleave_gate_up(w: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Interleaved -> split-half [gate; up] along ``dim`` (the inverse of ``interleave_gate_up``). Copies."""
    d = dim % w.dim()
    if w.shape[d] % 2:
        raise ValueError(f"dim {dim} of shape {tuple(w.shape)} must be even (gate/up pairs)")
    pairs = w.unflatten(d, (w.shape[d] // 2, 2))
    return torch.cat((pairs.select(d + 1, 0), pairs.select(d + 1, 1)), dim=d)


def moe_mlp_ref(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, scores: torch.Tensor,
                dout: torch.Tensor | None = None, dtype: torch.dtype = torch.float64,
                gate_up: str = "interleaved") -> dict[str, torch.Tensor]:
    """The layer in plain torch, every op in ``dtype`` (float64: the oracle; bfloat16: a PyTorch gold
    whose intermediates round to BF16 as an eager model would). Per-expert matmuls, autograd for the
    backward. Returns out and, with ``dout``, dx, dw1, dw2, dscores (all in ``dtype``; dw1 in w1's ``gate_up``
    layout)."""
    check_gate_up(gate_up)
    half = w1.shape[2] // 2
    xr = x.detach().to(dtype).requires_grad_(dout is not None)
    w1r = w1.detach().to(dtype).requires_grad_(dout is not None)
    w2r = w2.detach().to(dtype).requires_grad_(dout is not None)
    sr = scores.detach().to(dtype).requires_grad_(dout is not None)
    t_count, k_count = topk_ids.shape
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    ys = {}
    for e in range(w1.shape[0]):
        tok, kk = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = xr[tok] @ w1r[e]
        gate, up = (gu[:, :half], gu[:, half:]) if gate_up == "split" else (gu[:, 0::2], gu[:, 1::2])
        ys[e] = (tok, kk, (torch.nn.functional.silu(gate) * up) @ w2r[e])
    for k in range(k_count):  # ascending k, like the kernel
        for e, (tok, kk, y) in ys.items():
            sel = kk == k
            if sel.any():
                out = out.index_add(0, tok[sel], sr[tok[sel], k, None] * y[sel])
    result = {"out": out.detach()}
    if dout is not None:
        out.backward(dout.to(dtype))
        result.update({name: t.grad if t.grad is not None else torch.zeros_like(t)
                       for name, t in (("dx", xr), ("dw1", w1r), ("dw2", w2r), ("dscores", sr))})
    return result
