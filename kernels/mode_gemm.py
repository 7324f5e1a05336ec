"""The batch-invariant mode's GEMM routing: aten mm / addmm / bmm / baddbmm on det_gemm.

Which det_gemm op runs is read from the operands' layout, as autograd hands them over:

    mm(a [M,K], b [K,N])
      a a transposed view (stride(0) == 1)   -> det_gemm_db(a.t(), b)   grad_weight: grad_out.t() @ x
      b a transposed view (stride(0) == 1)   -> det_gemm_fwd(a, b)      forward: x @ weight.t()
      otherwise                              -> det_gemm_da(a, b.t())   grad_input: grad_out @ weight

The three ops are one kernel over strided views with one fixed reduction order; the route only picks
the config table tuned for that layout, so no route can change a result's bits, and a layer's route
does not depend on the batch (the layout of a forward or backward GEMM does not). A row of fwd / dA
keeps its bits whatever M is (det_gemm's batch invariance); dB reduces over M in a fixed order.

addmm(input, a, b, beta, alpha) = det_gemm(a, b) rounded to BF16, then ``+ input`` in BF16 (beta 1)
or nothing (beta 0); alpha must be 1. Other beta / alpha are refused by name (counted, or raised
under strict), never approximated. bmm / baddbmm: one det_gemm per batch element (each element's
bits are those of its own mm, so they do not depend on the batch count or position).

Everything else on these ops -- another dtype, a device det_gemm does not run on, CPU tensors
without the Triton interpreter -- runs on torch's kernel and is counted with the reason
(``mode_state``). Empty operands are exact without a GEMM (a sum of no terms is 0) and are counted
as routed to "exact (empty)". So are products whose reduced dim K is 1, in any dtype (a rotary
embedding's inv_freq @ positions in FP32 is one): each output element is one product rounded once, with no
order to fix, and runs as an elementwise multiply counted as routed to "exact (K=1)". The functions here run below autograd (aten CPU/CUDA kernels) and
inside the compiled-graph ops (``mode_compile``); they never see requires_grad.
"""

from __future__ import annotations

import functools

import torch

from detkit.kernels import mode_state
from detkit.kernels.backend import MAX_INT32_OFFSET, kernel_is_interpreted

EMPTY = "exact (empty)"
K1 = "exact (K=1)"
ROUTES = ("det_gemm_fwd", "det_gemm_da", "det_gemm_db")


@functools.lru_cache(maxsize=None)
def device_reason(device: torch.device) -> str | None:
    """None when det_gemm runs on ``device``; else why not (the backend check of kernels.backend, as a
    reason instead of an exception, so the caller can count it)."""
    from detkit.kernels.det_gemm import det_gemm_kernel

    interpreted = kernel_is_interpreted(det_gemm_kernel)
    if device.type == "cpu":
        return None if interpreted else "device cpu: detkit runs CPU tensors only under TRITON_INTERPRET=1"
    if device.type == "cuda":
        if interpreted:
            return "device cuda under TRITON_INTERPRET=1 (the interpreter is for CPU tensors)"
        capability = torch.cuda.get_device_capability(device)
        if capability != (9, 0):
            return f"device {device} is sm_{capability[0]}{capability[1]}; detkit supports sm_90"
        return None
    return f"device type {device.type}"


def _dtype_reason(tensors) -> str:
    return "dtype " + "/".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors}))


def operands_reason(*tensors: torch.Tensor) -> str | None:
    """None when det_gemm can take these operands (BF16, one supported device, 32-bit offsets). Runs on every
    GEMM in the mode: one pass, no allocation."""
    device = tensors[0].device
    for t in tensors:
        if t.dtype is not torch.bfloat16:
            return _dtype_reason(tensors)
        if t.device != device:
            return f"operands on several devices {sorted({str(x.device) for x in tensors})}"
    reason = device_reason(device)
    if reason is not None:
        return reason
    for t in tensors:
        furthest = 0
        for size, stride in zip(t.shape, t.stride()):
            if stride < 0:
                return "negative strides"
            furthest += (size - 1) * stride
        if furthest > MAX_INT32_OFFSET:
            return "element offsets beyond 2**31 (32-bit kernel indexing)"
    return None


def _is_transposed(t: torch.Tensor) -> bool:
    """A column-major matrix view (``x.t()`` of a row-major x): its rows are contiguous in memory's other dim."""
    return t.stride(0) == 1 and t.stride(1) != 1 and t.shape[0] > 1


def route_of(a: torch.Tensor, b: torch.Tensor) -> str:
    """The det_gemm op for ``a @ b`` (2-D views), from the layout: see the module docstring."""
    if _is_transposed(a):
        return "det_gemm_db"
    if _is_transposed(b):
        return "det_gemm_fwd"
    return "det_gemm_da"


def run_route(route: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` [M, N] in BF16 on det_gemm through ``route`` (no copies: views only)."""
    from detkit.kernels.det_gemm import det_gemm_da, det_gemm_db, det_gemm_fwd

    if route == "det_gemm_fwd":
        return det_gemm_fwd(a, b)
    if route == "det_gemm_da":
        return det_gemm_da(a, b.t())
    if route == "det_gemm_db":
        return det_gemm_db(a.t(), b)
    raise ValueError(f"route {route!r} is not supported; supported: {ROUTES}")


def scalars_reason(beta, alpha) -> str | None:
    if alpha != 1 or beta not in (0, 1):
        return f"beta={beta}, alpha={alpha} (supported: alpha 1, beta 0 or 1)"
    return None


def _empty(*tensors: torch.Tensor) -> bool:
    return any(t.numel() == 0 for t in tensors)


# ---------------------------------------------------------------------------------------------
# The computations, shared by the eager aten overrides and the compiled-graph ops. Each returns
# None when it did not route (the caller runs torch's kernel), after counting why.
# ---------------------------------------------------------------------------------------------
def _k1_product(a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor | None:
    """``a @ b`` when the reduced dim is 1 (2-D or batched, one dtype and device): the elementwise product, which
    is what any GEMM computes there (one product per element, rounded once)."""
    if a.shape[-1] != 1 or a.dtype != b.dtype or a.device != b.device or _empty(a, b):
        return None
    mode_state.routed(op, K1)
    return a * b


def _gemm(a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor:
    """``a @ b`` of operands the mode takes (checked by the caller) on det_gemm, counted."""
    if _empty(a, b):
        mode_state.routed(op, EMPTY)
        return a.new_zeros((a.shape[0], b.shape[1]))
    route = route_of(a, b)
    out = run_route(route, a, b)
    mode_state.routed(op, route)
    return out


def mm(a: torch.Tensor, b: torch.Tensor, op: str = "mm") -> torch.Tensor | None:
    exact = _k1_product(a, b, op)
    if exact is not None:
        return exact
    reason = operands_reason(a, b)
    if reason is not None:
        mode_state.not_routed(op, reason)
        return None
    return _gemm(a, b, op)


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta=1, alpha=1,
          op: str = "addmm") -> torch.Tensor | None:
    reason = operands_reason(bias, a, b) or scalars_reason(beta, alpha)
    if reason is not None:
        mode_state.not_routed(op, reason)
        return None
    out = _gemm(a, b, op)
    if beta == 1:
        out = out + bias  # one BF16 rounding of (gemm + bias), elementwise: no batch dependence
    return out


def bmm(a: torch.Tensor, b: torch.Tensor, op: str = "bmm") -> torch.Tensor | None:
    exact = _k1_product(a, b, op)
    if exact is not None:
        return exact
    reason = operands_reason(a, b)
    if reason is not None:
        mode_state.not_routed(op, reason)
        return None
    batch, m, n = a.shape[0], a.shape[1], b.shape[2]
    if _empty(a, b):
        mode_state.routed(op, EMPTY)
        return a.new_zeros((batch, m, n))
    route = route_of(a[0], b[0])  # one layout for every element: the batch stride is shared
    out = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    for i in range(batch):
        out[i] = run_route(route, a[i], b[i])
    mode_state.routed(op, route, calls=1)
    return out


def baddbmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta=1, alpha=1,
            op: str = "baddbmm") -> torch.Tensor | None:
    reason = operands_reason(bias, a, b) or scalars_reason(beta, alpha)
    if reason is not None:
        mode_state.not_routed(op, reason)
        return None
    out = bmm(a, b, op=op)
    if beta == 1:
        out = out + bias
    return out
