"""The batch-invariant mode's grouped GEMM route: ``aten::_grouped_mm`` on detkit.kernels.grouped.

transformers' "grouped_mm" experts implementation (Mixtral, gpt-oss, DeepSeek-V3, every experts class that
dispatches through its ExpertsInterface) sorts the routes by expert and calls ``torch.nn.functional.grouped_mm`` /
``torch._grouped_mm`` (x [S, K], W [E, K, N] or ``W.transpose(-2, -1)``, offs [E] int32 cumulative counts). torch's
grouped GEMM picks its tiling from the group sizes, so a token's expert output changes with the batch. The forms and
where they come from (torch's derivative of ``_grouped_mm``, which reaches this route too: it sits below autograd):

    a [M, K], b [G, K, N], offs      -> detkit grouped_mm     forward; grad_input (grad @ b.transpose)
    a [P, R], b [R, Q],    offs      -> detkit grouped_wgrad  grad of a 3-D b (grad.T @ x per group, offsets along R)
    a [G, M, K], b [G, K, N], no offs -> det_gemm per group   (a batched matmul; mode_gemm's bmm route)

Every decision depends on the call's signature alone (dtypes, devices, shapes, strides, which optional arguments
are given), never on the offsets' values, so it is made once per signature (``mode_gemm``'s plans) and the offsets
are never read on the host (a CUDA graph can capture the route; invalid offsets give NaN on the GPU: see
kernels/grouped/launch.py). Refused, counted (or raised under strict): a bias (the kernels add none; transformers
adds its bias after the call), an out_dtype other than BF16, other dtypes, devices detkit does not run on, 3-D x
2-D, offsets that are not a 1-D int32 tensor of one per group on the operands' device, or missing where the form
needs them.
"""

from __future__ import annotations

import torch

from detkit.kernels.grouped.launch import grouped_mm as kernel_grouped_mm
from detkit.kernels.grouped.launch import grouped_wgrad as kernel_grouped_wgrad
from detkit.mode import gemm as mode_gemm
from detkit.mode import state as mode_state

OP = "_grouped_mm"
MM = "detkit.grouped_mm"
WGRAD = "detkit.grouped_wgrad"
_STATE = mode_state.STATE


def _offs_reason(offs, groups: int, device: torch.device) -> str | None:
    if offs is None:
        return "offs is None (the 2-D forms need offsets)"
    if offs.dtype != torch.int32:
        return f"offs dtype {str(offs.dtype).removeprefix('torch.')} (supported: int32)"
    if offs.dim() != 1 or offs.shape[0] != groups or groups < 1:
        return f"offs shape {tuple(offs.shape)} (supported: [{groups}], one offset per group)"
    if offs.stride(0) != 1 and groups > 1:
        return f"offs stride {offs.stride(0)} (supported: contiguous)"
    if offs.device != device:
        return f"offs on {offs.device}, operands on {device}"
    return None


def _operands_reason(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """BF16 operands on one device detkit runs on, non-negative strides (the kernels index in 64 bits)."""
    if a.dtype is not torch.bfloat16 or b.dtype is not torch.bfloat16:
        return mode_gemm._dtype_reason((a, b))
    if a.device != b.device:
        return f"operands on several devices {sorted({str(a.device), str(b.device)})}"
    reason = mode_gemm.device_reason(a.device)
    if reason is not None:
        return reason
    if any(s < 0 for t in (a, b) for s in t.stride()):
        return "negative strides"
    return None


def _kernel_plan(kernel, counted):
    def plan(a, b, offs):
        out = kernel(a, b, offs)
        with _STATE.lock:
            _STATE.routed[counted] += 1
        return out
    return plan


def _bmm_plan(a: torch.Tensor, b: torch.Tensor):
    """3-D x 3-D without offsets: mode_gemm's batched route (one det_gemm per group), under this op's name."""
    def plan(a, b, offs):
        return mode_gemm.bmm(a, b, op=OP)
    return plan


def _plan(a, b, offs, bias, out_dtype):
    if bias is not None:
        return mode_gemm.refusal_plan(OP, "bias (detkit's grouped GEMM adds none)")
    if out_dtype is not None and out_dtype is not torch.bfloat16:
        return mode_gemm.refusal_plan(OP, f"out_dtype {str(out_dtype).removeprefix('torch.')} (supported: bfloat16)")
    reason = _operands_reason(a, b)
    if reason is not None:
        return mode_gemm.refusal_plan(OP, reason)
    form = (a.dim(), b.dim())
    if form == (2, 3):
        if a.shape[1] != b.shape[1]:
            return mode_gemm.refusal_plan(OP, f"a {tuple(a.shape)} and b {tuple(b.shape)} do not share K")
        reason = _offs_reason(offs, b.shape[0], a.device)
        return mode_gemm.refusal_plan(OP, reason) if reason else _kernel_plan(kernel_grouped_mm, (OP, MM))
    if form == (2, 2):
        if a.shape[1] != b.shape[0]:
            return mode_gemm.refusal_plan(OP, f"a {tuple(a.shape)} and b {tuple(b.shape)} do not share the reduced dim")
        groups = offs.shape[0] if offs is not None and offs.dim() == 1 else -1
        reason = _offs_reason(offs, groups, a.device)
        return mode_gemm.refusal_plan(OP, reason) if reason else _kernel_plan(kernel_grouped_wgrad, (OP, WGRAD))
    if form == (3, 3):
        if offs is not None:
            return mode_gemm.refusal_plan(OP, "3-D x 3-D with offs")
        return _bmm_plan(a, b)
    return mode_gemm.refusal_plan(OP, f"{form[0]}-D x {form[1]}-D operands (supported: 2-D x 3-D and 2-D x 2-D with "
                                      "offs, 3-D x 3-D without)")


def _signature(t):
    return None if t is None else (t.dtype, t.device, t.shape, t.stride())


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``torch._grouped_mm(a, b, offs, bias, out_dtype)`` on detkit's kernels, or None (counted, or raised under
    strict) when the call is not routed. One plan per signature."""
    key = (OP, _signature(a), _signature(b), _signature(offs), bias is None, out_dtype)
    plan = mode_gemm._PLANS.get(key)
    if plan is None:
        plan = mode_gemm._remember(key, _plan(a, b, offs, bias, out_dtype))
    return plan(a, b, offs)
