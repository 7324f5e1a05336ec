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

Operands are all BF16, all FP16 or all FP32. FP16 operands run as BF16 ones do (exact products, FP32
accumulation, one FP16 rounding; counted as ``mm -> det_gemm_fwd fp16``). FP32 operands run on det_gemm's FP32
path (FP32 products, "ieee" or "tf32" as torch's own CUDA matmul precision setting says at the call, FP32
accumulation and output); the routed counter names it: ``mm -> det_gemm_fwd fp32 ieee``.

addmm(input, a, b, beta, alpha) = det_gemm(a, b) rounded to BF16, then ``+ input`` in BF16 (beta 1)
or nothing (beta 0); alpha must be 1 (FP16 likewise in FP16; FP32: the FP32 product, then ``+ input`` in
FP32). Other beta / alpha are refused by name (counted, or raised under strict), never approximated. bmm / baddbmm: one det_gemm per batch element (each element's
bits are those of its own mm, so they do not depend on the batch count or position).

Everything else on these ops -- another dtype (refused by name: "dtype float64 (det_gemm takes bfloat16,
float16 or float32 operands, one dtype)"), mixed dtypes, a device det_gemm does not run on, CPU tensors
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

from detkit.mode import state as mode_state
from detkit.kernels.backend import MAX_INT32_OFFSET, kernel_is_interpreted
from detkit.kernels.det_gemm.launch import det_gemm_da, det_gemm_db, det_gemm_fwd

EMPTY = "exact (empty)"
K1 = "exact (K=1)"
ROUTES = ("det_gemm_fwd", "det_gemm_da", "det_gemm_db")


@functools.lru_cache(maxsize=None)
def device_reason(device: torch.device) -> str | None:
    """None when det_gemm runs on ``device``; else why not (the backend check of kernels.backend, as a
    reason instead of an exception, so the caller can count it)."""
    from detkit.kernels.det_gemm.launch import det_gemm_kernel

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


GEMM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _dtype_reason(tensors) -> str:
    return ("dtype " + "/".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors}))
            + " (det_gemm takes bfloat16, float16 or float32 operands, one dtype)")


def operands_reason(*tensors: torch.Tensor) -> str | None:
    """None when det_gemm can take these operands (all BF16, FP16 or FP32, one supported device, 32-bit offsets).
    Runs on every GEMM in the mode: one pass, no allocation."""
    device, dtype = tensors[0].device, tensors[0].dtype
    if dtype not in GEMM_DTYPES:
        return _dtype_reason(tensors)
    for t in tensors:
        if t.dtype is not dtype:
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


def _fwd(a: torch.Tensor, b: torch.Tensor, precision: str | None = None) -> torch.Tensor:
    return det_gemm_fwd(a, b, precision)


def _da(a: torch.Tensor, b: torch.Tensor, precision: str | None = None) -> torch.Tensor:
    return det_gemm_da(a, b.t(), precision)


def _db(a: torch.Tensor, b: torch.Tensor, precision: str | None = None) -> torch.Tensor:
    return det_gemm_db(a.t(), b, precision)


_RUNS = {"det_gemm_fwd": _fwd, "det_gemm_da": _da, "det_gemm_db": _db}


def run_route(route: str, a: torch.Tensor, b: torch.Tensor, precision: str | None = None) -> torch.Tensor:
    """``a @ b`` [M, N] on det_gemm through ``route`` (no copies: views only): BF16 operands give BF16, FP32
    operands FP32 with products at ``precision`` (None: "ieee")."""
    run = _RUNS.get(route)
    if run is None:
        raise ValueError(f"route {route!r} is not supported; supported: {ROUTES}")
    return run(a, b, precision)


# FP32 products. torch.matmul on FP32 CUDA tensors uses TF32 tensor cores when torch's CUDA matmul precision says
# "tf32" (``torch.set_float32_matmul_precision("high")`` or "medium", ``torch.backends.cuda.matmul.fp32_precision =
# "tf32"``, ``allow_tf32 = True``), else IEEE FP32. The mode does the same, read per call (the setting may change
# between calls of one signature): "tf32" exactly when torch would use TF32, else "ieee". The precision is part of
# det_gemm's plan key and of the routed counter's name ("det_gemm_fwd fp32 tf32").
FP32_PRECISIONS = ("ieee", "tf32")
_fp32_setting = getattr(torch._C, "_get_fp32_precision_getter", None)


def fp32_products() -> str:
    """"tf32" when torch's own FP32 CUDA matmuls may use TF32 now, else "ieee"."""
    if _fp32_setting is None:  # torch before the per-backend precision API
        return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    setting = _fp32_setting("cuda", "matmul")
    if setting == "none":  # not set for CUDA matmuls: the generic setting
        setting = _fp32_setting("generic", "all")
    return "tf32" if setting == "tf32" else "ieee"


def route_name(route: str, dtype: torch.dtype, precision: str | None = None) -> str:
    """The routed counter's kernel name: the det_gemm op; for FP16 operands "fp16" after it, for FP32 operands "fp32"
    and the products' precision."""
    if dtype == torch.bfloat16:
        return route
    return f"{route} fp16" if dtype == torch.float16 else f"{route} fp32 {precision}"


def scalars_reason(beta, alpha) -> str | None:
    if alpha != 1 or beta not in (0, 1):
        return f"beta={beta}, alpha={alpha} (supported: alpha 1, beta 0 or 1)"
    return None


def _empty(*tensors: torch.Tensor) -> bool:
    return any(t.numel() == 0 for t in tensors)


def _k1(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a @ b`` reduces over one element (2-D or batched, one dtype and device, not empty): the elementwise
    product is what any GEMM computes there (one product per element, rounded once)."""
    return a.shape[-1] == 1 and a.dtype == b.dtype and a.device == b.device and not _empty(a, b)


# ---------------------------------------------------------------------------------------------
# Plans. Every decision above depends on the operands' signature alone -- dtype, device, shape, strides (and
# for addmm / baddbmm whether beta is 1) -- never on their values or addresses. So each op keeps a plan per
# signature: a function ``plan(*operands) -> Tensor | None`` that does only the per-call work (the det_gemm call,
# the count) and returns None (after counting why, or raising under strict) when the call is not routed. The
# strict check stays per call (strict changes with the mode's entries); det_gemm does its own per-signature
# checks once per signature too and its per-tensor checks on every call.
# ---------------------------------------------------------------------------------------------
MAX_PLANS = 4096  # signatures remembered (all ops); past it the table starts over (dynamic shapes)
_PLANS: dict[tuple, object] = {}
_STATE = mode_state.STATE


def _remember(key: tuple, plan):
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def clear_plans() -> None:
    """Forget every routing plan (rebuilt on the next calls)."""
    _PLANS.clear()


def refusal_plan(op: str, reason: str):
    """The plan of a signature the mode does not route: counted with ``reason`` (or raised under strict) per call."""
    def plan(*operands):
        mode_state.not_routed(op, reason)  # counts, or raises under strict: per call
        return None
    return plan


def _k1_plan(op: str):
    counted = (op, K1)

    def plan(a, b):
        out = a * b
        with _STATE.lock:
            _STATE.routed[counted] += 1
        return out
    return plan


def _zeros_plan(op: str, shape: tuple[int, ...]):
    counted = (op, EMPTY)

    def plan(a, b):
        with _STATE.lock:
            _STATE.routed[counted] += 1
        return a.new_zeros(shape)
    return plan


def _counted_plan(op: str, route: str, dtype: torch.dtype, gemm):
    """``gemm(run, a, b, precision)`` counted under the route's name. The route's call is picked once, here (no
    route dispatch per call); it looks det_gemm up at call time. FP32 operands: the products' precision read per
    call (``fp32_products``) and counted under its name."""
    run = _RUNS[route]
    if dtype == torch.float32:
        named = {p: (op, route_name(route, dtype, p)) for p in FP32_PRECISIONS}

        def plan_fp32(a, b):
            precision = fp32_products()
            out = gemm(run, a, b, precision)
            with _STATE.lock:
                _STATE.routed[named[precision]] += 1
            return out
        return plan_fp32
    counted = (op, route_name(route, dtype))

    def plan(a, b):
        out = gemm(run, a, b, None)
        with _STATE.lock:
            _STATE.routed[counted] += 1
        return out
    return plan


def _single(run, a, b, precision):
    return run(a, b) if precision is None else run(a, b, precision)


def _per_batch_element(run, a, b, precision):
    return torch.stack([_single(run, x, y, precision) for x, y in zip(a.unbind(0), b.unbind(0))])


def _gemm_plan(op: str, route: str, dtype: torch.dtype = torch.bfloat16):
    """``a @ b`` of 2-D operands the mode takes on det_gemm through ``route``, counted."""
    return _counted_plan(op, route, dtype, _single)


def _batched_plan(op: str, route: str, dtype: torch.dtype = torch.bfloat16):
    """One det_gemm per batch element through ``route`` (one layout for every element: the batch stride is
    shared), stacked into a new [B, M, N] tensor; counted once per call."""
    return _counted_plan(op, route, dtype, _per_batch_element)


def _with_bias(gemm, beta_one: bool):
    """addmm / baddbmm: the GEMM's BF16 result, then ``+ input`` in BF16 (beta 1; one rounding, elementwise, so no
    batch dependence) or nothing (beta 0)."""
    if not beta_one:
        return lambda bias, a, b: gemm(a, b)

    def plan(bias, a, b):
        out = gemm(a, b)
        return None if out is None else out + bias
    return plan


def _mm_plan(a: torch.Tensor, b: torch.Tensor, op: str):
    if _k1(a, b):
        return _k1_plan(op)
    reason = operands_reason(a, b)
    if reason is not None:
        return refusal_plan(op, reason)
    if _empty(a, b):
        return _zeros_plan(op, (a.shape[0], b.shape[1]))
    return _gemm_plan(op, route_of(a, b), a.dtype)


def _bmm_plan(a: torch.Tensor, b: torch.Tensor, op: str):
    if _k1(a, b):
        return _k1_plan(op)
    reason = operands_reason(a, b)
    if reason is not None:
        return refusal_plan(op, reason)
    if _empty(a, b):
        return _zeros_plan(op, (a.shape[0], a.shape[1], b.shape[2]))
    return _batched_plan(op, route_of(a[0], b[0]), a.dtype)


# ---------------------------------------------------------------------------------------------
# The computations, shared by the eager aten overrides and the compiled-graph ops. Each returns
# None when it did not route (the caller runs torch's kernel), after counting why.
# ---------------------------------------------------------------------------------------------
def mm(a: torch.Tensor, b: torch.Tensor, op: str = "mm") -> torch.Tensor | None:
    key = (op, a.dtype, b.dtype, a.device, b.device, a.shape, b.shape, a.stride(), b.stride())
    plan = _PLANS.get(key)
    if plan is None:
        plan = _remember(key, _mm_plan(a, b, op))
    return plan(a, b)


def bmm(a: torch.Tensor, b: torch.Tensor, op: str = "bmm") -> torch.Tensor | None:
    key = (op, a.dtype, b.dtype, a.device, b.device, a.shape, b.shape, a.stride(), b.stride())
    plan = _PLANS.get(key)
    if plan is None:
        plan = _remember(key, _bmm_plan(a, b, op))
    return plan(a, b)


def _refuse_scalars(op: str, bias, a, b, beta, alpha) -> None:
    """addmm / baddbmm with scalars the mode does not take (never cached: they are rare, and their reason names
    the values as given)."""
    mode_state.not_routed(op, operands_reason(bias, a, b) or scalars_reason(beta, alpha))
    return None


def _biased(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta=1, alpha=1, *, op: str, product_plan):
    """addmm / baddbmm: ``product_plan(a, b, op)``'s product plus ``bias`` (beta 1) or the product alone (beta 0),
    one plan per signature."""
    if alpha != 1 or beta not in (0, 1):
        return _refuse_scalars(op, bias, a, b, beta, alpha)
    beta_one = beta == 1
    key = (op, beta_one, bias.dtype, a.dtype, b.dtype, bias.device, a.device, b.device, bias.shape, a.shape, b.shape,
           bias.stride(), a.stride(), b.stride())
    plan = _PLANS.get(key)
    if plan is None:
        reason = operands_reason(bias, a, b)
        plan = _remember(key, refusal_plan(op, reason) if reason is not None
                         else _with_bias(product_plan(a, b, op), beta_one))
    return plan(bias, a, b)


def _addmm_product_plan(a: torch.Tensor, b: torch.Tensor, op: str):
    return _zeros_plan(op, (a.shape[0], b.shape[1])) if _empty(a, b) else _gemm_plan(op, route_of(a, b), a.dtype)


# addmm(bias, a, b, beta=1, alpha=1) and baddbmm(...): partials, so a routed call costs no extra Python frame.
addmm = functools.partial(_biased, op="addmm", product_plan=_addmm_product_plan)
baddbmm = functools.partial(_biased, op="baddbmm", product_plan=_bmm_plan)
