"""The batch-invariant mode's eager path: aten kernel overrides on the CPU and CUDA dispatch keys.

While the mode is entered, a ``torch.library.Library("aten", "IMPL")`` holds Python kernels for
mm, addmm, bmm, baddbmm (routed to det_gemm, ``mode_gemm``) and mean.dim (routed to the invariant
row mean, ``mode_reductions``), plus counting kernels for the other matrix products (mv, addmv,
dot, addbmm) that detkit has no route for, so none of them runs unseen, and ``_grouped_mm`` (which
``torch.nn.functional.grouped_mm`` calls; transformers' "grouped_mm" experts) routed to detkit's grouped GEMM
(``mode_grouped``). The overrides sit below autograd, so autograd records torch's own backward formulas and
their GEMMs reach the same overrides (grad_input and grad_weight are plain mm calls; a grouped GEMM's are
``_grouped_mm`` calls). Overriding composite ops (aten::linear, aten::matmul) instead would break autograd.

Installed on entry and destroyed on exit (``install`` / ``uninstall``) rather than installed once
behind a flag: outside the mode torch's kernels run with no Python in the way, and an entry costs one
registration (about 0.1 ms). When an override does not route a call, it runs torch's kernel
through the op's ``.out`` overload (the same kernel as the functional op, which is not overridden);
``_grouped_mm`` has none, so its unrouted calls redispatch to torch's CompositeExplicitAutograd kernel
(on the CPU the kernel torch runs anyway; on CUDA torch's per-group mm loop, not its CUTLASS kernel, which
the override hides while the mode is entered).
"""

from __future__ import annotations

import warnings

import torch

from detkit.mode import gemm as mode_gemm
from detkit.mode import grouped as mode_grouped
from detkit.mode import reductions as mode_reductions
from detkit.mode import state as mode_state

aten = torch.ops.aten
_PLANS = mode_gemm._PLANS
DISPATCH_KEYS = ("CPU", "CUDA")

_LIBRARY: torch.library.Library | None = None


def _empty_like_out(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A zero-size out= tensor: the ``.out`` kernel resizes it (no warning for an empty out)."""
    return torch.empty(0, dtype=dtype or t.dtype, device=t.device)


# torch's kernels, through the .out overloads (not overridden).
def torch_mm(a, b):
    return aten.mm.out(a, b, out=_empty_like_out(a))


def torch_addmm(bias, a, b, beta=1, alpha=1):
    return aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=_empty_like_out(a))


def torch_bmm(a, b):
    return aten.bmm.out(a, b, out=_empty_like_out(a))


def torch_baddbmm(bias, a, b, beta=1, alpha=1):
    return aten.baddbmm.out(bias, a, b, beta=beta, alpha=alpha, out=_empty_like_out(a))


def torch_mean(x, dim, keepdim=False, dtype=None):
    return aten.mean.out(x, dim, keepdim, dtype=dtype, out=_empty_like_out(x, dtype))


def _mean_plan(x: torch.Tensor, dim, keepdim: bool, dtype, op: str):
    reason = mode_reductions.last_dim_reason(x, dim, keepdim, dtype) or mode_gemm.device_reason(x.device)
    if reason is not None:
        return mode_gemm.refusal_plan(op, reason)
    return mode_state.counted_launch(mode_reductions.last_dim_launcher(x, keepdim), op, "row_mean")


def row_mean_dim(x: torch.Tensor, dim, keepdim: bool = False, dtype=None, op: str = "mean.dim") -> torch.Tensor | None:
    """``x.mean(dim, keepdim)`` over the last dim on ``row_mean``, or None (counted) when not routed. The decision
    is made once per signature (``mode_gemm``'s plans)."""
    key = (op, x.dtype, x.device, x.shape, x.stride(), tuple(dim) if isinstance(dim, list) else dim, keepdim, dtype)
    plan = _PLANS.get(key)
    if plan is None:
        plan = mode_gemm._remember(key, _mean_plan(x, dim, keepdim, dtype, op))
    return plan(x)


# The aten kernels (schemas as aten declares them).
_gemm_mm, _gemm_addmm, _gemm_bmm, _gemm_baddbmm = mode_gemm.mm, mode_gemm.addmm, mode_gemm.bmm, mode_gemm.baddbmm


def _mm(self, mat2):
    out = _gemm_mm(self, mat2)
    return torch_mm(self, mat2) if out is None else out


def _addmm(self, mat1, mat2, *, beta=1, alpha=1):
    out = _gemm_addmm(self, mat1, mat2, beta, alpha)
    return torch_addmm(self, mat1, mat2, beta, alpha) if out is None else out


def _bmm(self, mat2):
    out = _gemm_bmm(self, mat2)
    return torch_bmm(self, mat2) if out is None else out


def _baddbmm(self, batch1, batch2, *, beta=1, alpha=1):
    out = _gemm_baddbmm(self, batch1, batch2, beta, alpha)
    return torch_baddbmm(self, batch1, batch2, beta, alpha) if out is None else out


def _mean_dim(self, dim, keepdim=False, *, dtype=None):
    out = row_mean_dim(self, dim, keepdim, dtype)
    return torch_mean(self, dim, keepdim, dtype) if out is None else out


NO_ROUTE = "no detkit route for this op"


def _mv(self, vec):
    mode_state.not_routed("mv", NO_ROUTE)
    return aten.mv.out(self, vec, out=_empty_like_out(self))


def _addmv(self, mat, vec, *, beta=1, alpha=1):
    mode_state.not_routed("addmv", NO_ROUTE)
    return aten.addmv.out(self, mat, vec, beta=beta, alpha=alpha, out=_empty_like_out(mat))


def _dot(self, tensor):
    mode_state.not_routed("dot", NO_ROUTE)
    return aten.dot.out(self, tensor, out=_empty_like_out(self))


def _addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    mode_state.not_routed("addbmm", NO_ROUTE)
    return aten.addbmm.out(self, batch1, batch2, beta=beta, alpha=alpha, out=_empty_like_out(batch1))


# torch's own _grouped_mm below the override (it has no .out overload): the CompositeExplicitAutograd kernel.
_GROUPED_MM = aten._grouped_mm.default if hasattr(aten, "_grouped_mm") else None
_TORCH_GROUPED_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def torch_grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    return _GROUPED_MM.redispatch(_TORCH_GROUPED_KEYS, a, b, offs, bias, out_dtype)


def _grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
    out = mode_grouped.grouped_mm(self, mat2, offs, bias, out_dtype)
    return torch_grouped_mm(self, mat2, offs, bias, out_dtype) if out is None else out


KERNELS = {
    "mm": _mm, "addmm": _addmm, "bmm": _bmm, "baddbmm": _baddbmm, "mean.dim": _mean_dim,
    "mv": _mv, "addmv": _addmv, "dot": _dot, "addbmm": _addbmm,
}
if _GROUPED_MM is not None:
    KERNELS["_grouped_mm"] = _grouped_mm


def install() -> None:
    global _LIBRARY
    if _LIBRARY is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # torch warns once that an aten kernel is overridden: that is the point here.
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for name, kernel in KERNELS.items():
            for key in DISPATCH_KEYS:
                library.impl(name, kernel, key)
    _LIBRARY = library


def uninstall() -> None:
    global _LIBRARY
    if _LIBRARY is not None:
        _LIBRARY._destroy()
        _LIBRARY = None


def installed() -> bool:
    return _LIBRARY is not None
