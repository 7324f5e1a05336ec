"""Deterministic, batch-invariant SwiGLU forward and backward as Triton elementwise kernels.

Math (BF16 in, FP32 math, one BF16 rounding per output; ``g`` gate, ``u`` up, ``dh`` dHidden)::

    s   = 1 / (1 + exp(-g))            sigmoid
    h   = (g * s) * u                  swiglu_fwd  -> h  [R, C]
    dU  = dh * (g * s)                 swiglu_bwd  -> dU [R, C]
    dG  = (dh * u) * (s + (g * s) * (1 - s))            -> dG [R, C]

each line evaluated in FP32 in exactly the order written (no FMA contraction is relied on:
every product and sum is its own rounded op in the reference, see ``swiglu_fwd_ref``).

Determinism and batch invariance: one program per [BLOCK_R, BLOCK_C] tile, every output element
a function of its own three inputs only; no reduction, no atomics. The bits of an element do not
depend on R, C, the tile or its position (elementwise), on any backend.

Shapes: 2-D strided views ``[R, C]`` (R, C >= 1). The Qwen3 MLP keeps Gate and Up in one buffer
``[M, 2*I_l]`` per TP shard (``kernels.mlp``); ``gate_up_views`` cuts the two strided views from it
without a copy, and the backward writes dG and dU straight into the matching halves of one buffer,
so Gate/Up dX and dW each stay one GEMM.

Contract (docs/invariance.md, "SwiGLU contract"): against the FP64 SwiGLU of the same BF16
inputs, ``|out - out*| <= swiglu_*_bound``, a first-order bound with a factor 2 for second-order
terms, allowing exp with a rounded argument (relative error (2 + 1.5|g|) u32, the GPU's
ex2.approx path), a 2-ulp division and one u32 per other op. It is not compared bitwise with a
torch reference: torch's exp (SLEEF on the CPU, libdevice on the GPU) and Triton's exp (numpy on
the interpreter, ex2.approx on sm_90) are different functions, so equal FP32 formulas need not give
equal bits. On the interpreter the tests also report the BF16 ULP distance to the same-order FP32
torch reference (observed <= 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from detkit.kernels.backend import TRITON_INTERPRETER, check_bf16_matrix, resolve_backend
from detkit.kernels.bounds import ETA_BF16, U_BF16, U_FP32
from detkit.kernels.det_gemm.launch import fp32_to_bf16_rtne


@dataclass(frozen=True)
class SwigluConfig:
    block_r: int
    block_c: int
    num_warps: int


# Pinned (no autotune). Elementwise: the config changes the speed only, never the bits.
SWIGLU_CONFIG = SwigluConfig(block_r=16, block_c=128, num_warps=4)


def case_name(op: str, r: int, c: int) -> str:
    return f"swiglu_{op} [R={r}, C={c}] bf16"


def _launch_metadata(grid, metadata, args):
    op = "bwd" if args["BACKWARD"] else "fwd"
    return {"name": case_name(op, args["R"], args["C"])}


@triton.jit(launch_metadata=_launch_metadata)
def swiglu_kernel(
    g_ptr, u_ptr, dh_ptr, out0_ptr, out1_ptr,
    R, C,
    stride_gr, stride_gc, stride_ur, stride_uc, stride_dr, stride_dc,
    stride_o0r, stride_o0c, stride_o1r, stride_o1c,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BACKWARD: tl.constexpr, INTERPRETED: tl.constexpr,
):
    pid_r = tl.program_id(axis=0)
    pid_c = tl.program_id(axis=1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r < R)[:, None] & (offs_c < C)[None, :]
    # [BLOCK_R, BLOCK_C] tiles
    g = tl.load(g_ptr + offs_r[:, None] * stride_gr + offs_c[None, :] * stride_gc, mask=mask, other=0.0)
    u = tl.load(u_ptr + offs_r[:, None] * stride_ur + offs_c[None, :] * stride_uc, mask=mask, other=0.0)
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    silu = g * s
    if BACKWARD:
        dh = tl.load(dh_ptr + offs_r[:, None] * stride_dr + offs_c[None, :] * stride_dc, mask=mask, other=0.0)
        dh = dh.to(tl.float32)
        d_up = dh * silu
        d_gate = (dh * u) * (s + silu * (1.0 - s))
        o0 = d_gate
        o1 = d_up
    else:
        o0 = silu * u
        o1 = o0
    o0_ptrs = out0_ptr + offs_r[:, None] * stride_o0r + offs_c[None, :] * stride_o0c
    o1_ptrs = out1_ptr + offs_r[:, None] * stride_o1r + offs_c[None, :] * stride_o1c
    if INTERPRETED:  # the interpreter's FP32 -> BF16 cast truncates; round to nearest-even
        tl.store(o0_ptrs, fp32_to_bf16_rtne(o0), mask=mask)
        if BACKWARD:
            tl.store(o1_ptrs, fp32_to_bf16_rtne(o1), mask=mask)
    else:
        tl.store(o0_ptrs, o0.to(tl.bfloat16), mask=mask)
        if BACKWARD:
            tl.store(o1_ptrs, o1.to(tl.bfloat16), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launch wrappers: check, allocate, launch.
# ---------------------------------------------------------------------------------------------
def _check_same_shape(tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    for name, t in tensors.items():
        check_bf16_matrix(name, t)
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"swiglu needs equal shapes; got {shapes}")
    return next(iter(shapes.values()))


def _check_out(name: str, out: torch.Tensor, shape: tuple[int, int], device: torch.device) -> None:
    check_bf16_matrix(name, out)
    if tuple(out.shape) != shape or out.device != device:
        raise ValueError(f"{name} is {tuple(out.shape)} on {out.device}; expected {shape} on {device}")


def _grid(r: int, c: int):
    return (triton.cdiv(r, SWIGLU_CONFIG.block_r), triton.cdiv(c, SWIGLU_CONFIG.block_c))


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``h = silu(gate) * up`` in BF16; ``gate``, ``up`` ``[R, C]`` (any strides). ``out`` (optional,
    ``[R, C]`` BF16, any strides) receives the result."""
    r, c = _check_same_shape({"gate": gate, "up": up})
    backend = resolve_backend(swiglu_kernel, {"gate": gate, "up": up})
    if out is None:
        out = torch.empty((r, c), dtype=torch.bfloat16, device=gate.device)
    _check_out("out", out, (r, c), gate.device)
    swiglu_kernel[_grid(r, c)](
        gate, up, gate, out, out, r, c,
        gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), 0, 0,
        out.stride(0), out.stride(1), out.stride(0), out.stride(1),
        BLOCK_R=SWIGLU_CONFIG.block_r, BLOCK_C=SWIGLU_CONFIG.block_c, BACKWARD=False,
        INTERPRETED=backend == TRITON_INTERPRETER, num_warps=SWIGLU_CONFIG.num_warps,
    )
    return out


def swiglu_bwd(d_hidden: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, d_gate: torch.Tensor | None = None,
               d_up: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dG, dU)`` of ``h = silu(gate) * up`` given ``dH``, all ``[R, C]`` BF16 (any strides).
    ``d_gate`` / ``d_up`` (optional) receive the results, e.g. the two halves of one Gate/Up buffer."""
    r, c = _check_same_shape({"d_hidden": d_hidden, "gate": gate, "up": up})
    backend = resolve_backend(swiglu_kernel, {"d_hidden": d_hidden, "gate": gate, "up": up})
    if d_gate is None:
        d_gate = torch.empty((r, c), dtype=torch.bfloat16, device=gate.device)
    if d_up is None:
        d_up = torch.empty((r, c), dtype=torch.bfloat16, device=gate.device)
    _check_out("d_gate", d_gate, (r, c), gate.device)
    _check_out("d_up", d_up, (r, c), gate.device)
    swiglu_kernel[_grid(r, c)](
        gate, up, d_hidden, d_gate, d_up, r, c,
        gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), d_hidden.stride(0), d_hidden.stride(1),
        d_gate.stride(0), d_gate.stride(1), d_up.stride(0), d_up.stride(1),
        BLOCK_R=SWIGLU_CONFIG.block_r, BLOCK_C=SWIGLU_CONFIG.block_c, BACKWARD=True,
        INTERPRETED=backend == TRITON_INTERPRETER, num_warps=SWIGLU_CONFIG.num_warps,
    )
    return d_gate, d_up


def gate_up_views(gate_up: torch.Tensor, shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and Up views ``[M*shards, I_l]`` of a Gate/Up buffer ``[M, shards*2*I_l]`` whose columns are
    ``[gate I_0 | up I_0 | gate I_1 | up I_1 ...]`` (TP-shard-major; ``shards`` = TP shards held by this
    rank: 1 at TP=2, 2 at TP=1). No copy. The hidden ``[M*shards, I_l]`` of these views, contiguous, is
    ``[M, shards*I_l]`` with columns in natural intermediate order."""
    if gate_up.dim() != 2 or not gate_up.is_contiguous():
        raise ValueError(f"gate_up must be a contiguous 2-D buffer; got shape {tuple(gate_up.shape)}, "
                         f"strides {gate_up.stride()}")
    m, width = gate_up.shape
    if shards < 1 or width % (2 * shards):
        raise ValueError(f"gate_up width {width} is not {shards} shard(s) of [gate | up]")
    i_l = width // (2 * shards)
    pairs = gate_up.view(m * shards, 2, i_l)
    return pairs[:, 0, :], pairs[:, 1, :]


# ---------------------------------------------------------------------------------------------
# Pure-torch references and the contract bound
# ---------------------------------------------------------------------------------------------
def swiglu_fwd_ref(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The kernel's formula in ``dtype``, same op order, unrounded (FP64: the oracle)."""
    g, u = gate.to(dtype), up.to(dtype)
    s = 1.0 / (1.0 + torch.exp(-g))
    return (g * s) * u


def swiglu_bwd_ref(d_hidden: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g, u, dh = gate.to(dtype), up.to(dtype), d_hidden.to(dtype)
    s = 1.0 / (1.0 + torch.exp(-g))
    silu = g * s
    return (dh * u) * (s + silu * (1.0 - s)), dh * silu


def _exp_err(g_abs: torch.Tensor) -> torch.Tensor:
    """Relative error of FP32 exp(-g): the argument's rounding (|g| log2(e) u32 < 1.5|g| u32) plus 2 ulp."""
    return (2.0 + 1.5 * g_abs) * U_FP32


def _tiny(*mags: torch.Tensor) -> torch.Tensor:
    """Absolute slack for exp overflow / FP32 subnormal intermediates (|g| > 88): every true value there
    is below 2**-120 times the magnitudes involved."""
    return 2.0**-120 * (1.0 + sum(mags)) + ETA_BF16


def swiglu_fwd_bound(h_star: torch.Tensor, g_abs: torch.Tensor, u_abs: torch.Tensor) -> torch.Tensor:
    """Bound on ``|h - h*|`` (FP64 tensors: exact result, |g|, |u|). Relative FP32 error of s is
    exp_err + u (add) + 2u (div); silu +u, h +u: exp_err + 5u; then one BF16 rounding. x2 for
    second-order terms."""
    rel = 2.0 * (_exp_err(g_abs) + 5 * U_FP32)
    return U_BF16 * h_star.abs() + (1.0 + U_BF16) * rel * h_star.abs() + _tiny(g_abs, u_abs)


def swiglu_bwd_bound(dg_star: torch.Tensor, du_star: torch.Tensor, dh_abs: torch.Tensor, g: torch.Tensor,
                     u_abs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on ``|dG - dG*|`` and ``|dU - dU*|``; ``g`` signed (FP64), the others magnitudes. First
    order in the per-op errors, propagated through the formula in the kernel's order, x2."""
    g_abs = g.abs()
    s = torch.sigmoid(g)
    t = 1.0 - s
    ls = g_abs * s  # |silu|
    e_s = (_exp_err(g_abs) + 3 * U_FP32) * s  # abs error of s
    e_ls = (_exp_err(g_abs) + 4 * U_FP32) * ls  # abs error of silu
    e_t = e_s + U_FP32 * t
    e_lst = ls * e_t + t * e_ls + U_FP32 * ls * t  # silu * (1 - s)
    dsilu_abs = s + ls * t
    e_dsilu = e_s + e_lst + U_FP32 * dsilu_abs
    dhu = dh_abs * u_abs
    e_dg = 2.0 * (dhu * e_dsilu + 2 * U_FP32 * dhu * dsilu_abs)
    e_du = 2.0 * (dh_abs * e_ls + U_FP32 * dh_abs * ls)
    tiny = _tiny(g_abs, u_abs, dh_abs)
    return (U_BF16 * dg_star.abs() + (1.0 + U_BF16) * e_dg + tiny,
            U_BF16 * du_star.abs() + (1.0 + U_BF16) * e_du + tiny)
