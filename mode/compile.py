"""The batch-invariant mode under torch.compile: detkit's GEMMs and row mean as torch.library custom
ops, and an Inductor post-grad pass that puts a compiled graph's aten ops on them.

Inductor does not call aten kernel overrides (it generates or picks its own kernels), so the eager
overrides of ``mode_aten`` cannot reach a compiled graph. Instead, from the first time the mode is
entered, ``torch._inductor.config.post_grad_custom_pre_pass`` holds ``ModeGraphPass``: in every
graph Inductor compiles (forward and backward), each ``aten.mm`` / ``addmm`` / ``bmm`` /
``mean.dim`` / ``_grouped_mm`` node becomes the matching ``detkit::mode_*`` op. Dynamo keeps custom ops opaque, and
their fake impls give Inductor the shapes. At run time each op asks the mode: entered, it runs the
same routing as eager (``mode_gemm`` / ``mode_reductions``: det_gemm's config chosen from the actual
M of that call, never frozen at trace time; counted); not entered, torch's kernel. So one compiled
graph is right in and out of the mode and never needs a recompile when the mode toggles. A CUDA
graph captured inside the mode replays the kernels chosen at capture.

The pass stays installed after the mode's exit (it is what makes graphs compiled later mode-aware;
the cost outside the mode is one custom-op call per GEMM in graphs compiled after the first entry).
Graphs Dynamo compiled before the first entry would not have the ops: the first install resets
Dynamo's caches when it has compiled anything, so they recompile with the pass. While the mode is
entered, Inductor's own ``batch_invariant`` option (torch >= 2.12; absent options are skipped) pins
the reductions Inductor generates itself (e.g. a fused softmax) for graphs compiled then.

The ops' autograd (for direct use of the ops in eager code) mirrors aten's formulas on the same ops.
"""

from __future__ import annotations

import logging
import math

import torch

from detkit.mode import aten as mode_aten
from detkit.mode import gemm as mode_gemm
from detkit.mode import grouped as mode_grouped
from detkit.mode import state as mode_state

log = logging.getLogger(__name__)
aten = torch.ops.aten
PASS_VERSION = "detkit.mode_compile 2"  # bumped with every change to the rewrite (cached graphs key on it)
_LAYOUT_TAGS = (torch.Tag.needs_exact_strides,) if hasattr(torch.Tag, "needs_exact_strides") else (
    torch.Tag.needs_fixed_stride_order,)
# Inductor options set while the mode is entered (when this torch has them).
INDUCTOR_OPTIONS = {"batch_invariant": True}


# ---------------------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("detkit::mode_mm", mutates_args=(), tags=_LAYOUT_TAGS)
def mode_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = mode_gemm.mm(a, b) if mode_state.active() else None
    return mode_aten.torch_mm(a, b) if out is None else out


@mode_mm.register_fake
def _mode_mm_fake(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


@torch.library.custom_op("detkit::mode_addmm", mutates_args=(), tags=_LAYOUT_TAGS)
def mode_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float) -> torch.Tensor:
    out = mode_gemm.addmm(bias, a, b, beta, alpha) if mode_state.active() else None
    return mode_aten.torch_addmm(bias, a, b, beta, alpha) if out is None else out


@mode_addmm.register_fake
def _mode_addmm_fake(bias, a, b, beta, alpha):
    return a.new_empty((a.shape[0], b.shape[1]))


@torch.library.custom_op("detkit::mode_bmm", mutates_args=(), tags=_LAYOUT_TAGS)
def mode_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = mode_gemm.bmm(a, b) if mode_state.active() else None
    return mode_aten.torch_bmm(a, b) if out is None else out


@mode_bmm.register_fake
def _mode_bmm_fake(a, b):
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


@torch.library.custom_op("detkit::mode_mean_dim", mutates_args=(), tags=_LAYOUT_TAGS)
def mode_mean_dim(x: torch.Tensor, dim: list[int] | None, keepdim: bool, dtype: torch.dtype | None) -> torch.Tensor:
    out = mode_aten.row_mean_dim(x, dim, keepdim, dtype) if mode_state.active() else None
    return mode_aten.torch_mean(x, dim, keepdim, dtype) if out is None else out


@mode_mean_dim.register_fake
def _mode_mean_dim_fake(x, dim, keepdim, dtype):
    return aten.mean.dim(x, dim, keepdim, dtype=dtype)


@torch.library.custom_op("detkit::mode_grouped_mm", mutates_args=(), tags=_LAYOUT_TAGS)
def mode_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None, bias: torch.Tensor | None,
                    out_dtype: torch.dtype | None) -> torch.Tensor:
    if mode_state.active():
        out = mode_grouped.grouped_mm(a, b, offs, bias, out_dtype)
        if out is None:
            out = mode_aten.torch_grouped_mm(a, b, offs, bias, out_dtype)
    else:
        out = aten._grouped_mm.default(a, b, offs, bias, out_dtype)
    # torch's CUDA kernel pads the output's rows to 16 bytes; the fake impl promises a contiguous tensor
    return out if out.is_contiguous() else out.contiguous()


@mode_grouped_mm.register_fake
def _mode_grouped_mm_fake(a, b, offs, bias, out_dtype):
    dtype = out_dtype or a.dtype
    if a.dim() == 2 and b.dim() == 2:
        return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]), dtype=dtype)
    if a.dim() == 2:
        return a.new_empty((a.shape[0], b.shape[-1]), dtype=dtype)
    if b.dim() == 2:
        return a.new_empty((a.shape[1], b.shape[1]), dtype=dtype)
    return a.new_empty((a.shape[0], a.shape[1], b.shape[-1]), dtype=dtype)


# Autograd: aten's formulas, on the same ops (grad_weight keeps the weight's layout, as aten does).
def _save_all(ctx, inputs, output):
    ctx.save_for_backward(*(t for t in inputs if isinstance(t, torch.Tensor)))


def _mat2_grad(a, grad, b):
    """``a.T @ grad`` laid out like ``b`` (a transposed weight view gets a transposed gradient)."""
    if b.stride(0) == 1 and b.stride(1) != 1:
        return mode_mm(grad.mT, a).mT
    return mode_mm(a.mT, grad)


def _mode_mm_backward(ctx, grad):
    a, b = ctx.saved_tensors
    return (mode_mm(grad, b.mT) if ctx.needs_input_grad[0] else None,
            _mat2_grad(a, grad, b) if ctx.needs_input_grad[1] else None)


def _addmm_setup(ctx, inputs, output):
    bias, a, b, beta, alpha = inputs
    ctx.save_for_backward(a, b)
    ctx.bias_shape, ctx.beta, ctx.alpha = bias.shape, beta, alpha


def _mode_addmm_backward(ctx, grad):
    a, b = ctx.saved_tensors
    if ctx.alpha != 1:
        grad_mm = grad * ctx.alpha
    else:
        grad_mm = grad
    grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_bias = grad.sum_to_size(ctx.bias_shape) * ctx.beta if ctx.beta != 1 else grad.sum_to_size(ctx.bias_shape)
    return (grad_bias,
            mode_mm(grad_mm, b.mT) if ctx.needs_input_grad[1] else None,
            _mat2_grad(a, grad_mm, b) if ctx.needs_input_grad[2] else None,
            None, None)


def _mode_bmm_backward(ctx, grad):
    a, b = ctx.saved_tensors
    return (mode_bmm(grad, b.mT) if ctx.needs_input_grad[0] else None,
            mode_bmm(a.mT, grad) if ctx.needs_input_grad[1] else None)


def _mean_setup(ctx, inputs, output):
    x, dim, keepdim, dtype = inputs
    ctx.shape, ctx.in_dtype, ctx.keepdim = x.shape, x.dtype, keepdim
    ctx.dims = sorted({d % x.dim() for d in dim}) if dim else list(range(x.dim()))


def _mode_mean_dim_backward(ctx, grad):
    count = math.prod(ctx.shape[d] for d in ctx.dims)
    if not ctx.keepdim:
        for d in ctx.dims:
            grad = grad.unsqueeze(d)
    return (grad.expand(ctx.shape).to(ctx.in_dtype) / count, None, None, None)


def _grouped_setup(ctx, inputs, output):
    a, b, offs, bias, out_dtype = inputs
    ctx.save_for_backward(a, b, offs)
    ctx.has_bias, ctx.out_dtype = bias is not None, out_dtype


def _mode_grouped_mm_backward(ctx, grad):
    """torch's derivative of _grouped_mm for the forms an experts forward uses (2-D x 3-D with offsets, 3-D x 3-D);
    others are refused, as they are not differentiable through this op."""
    a, b, offs = ctx.saved_tensors
    if ctx.has_bias or ctx.out_dtype is not None or b.dim() != 3:
        raise NotImplementedError(f"detkit::mode_grouped_mm differentiates {a.dim()}-D x {b.dim()}-D with bias "
                                  f"{ctx.has_bias} and out_dtype {ctx.out_dtype}; supported: 2-D x 3-D and 3-D x 3-D, "
                                  "no bias, no out_dtype")
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = mode_grouped_mm(grad, b.transpose(-2, -1), offs if a.dim() == 2 else None, None, None)
    if ctx.needs_input_grad[1]:
        if a.dim() == 2:
            grad_b = mode_grouped_mm(grad.t(), a, offs, None, None).transpose(-2, -1)
        else:
            grad_b = mode_grouped_mm(a.transpose(-2, -1), grad, None, None, None)
    return grad_a, grad_b, None, None, None


mode_mm.register_autograd(_mode_mm_backward, setup_context=_save_all)
mode_grouped_mm.register_autograd(_mode_grouped_mm_backward, setup_context=_grouped_setup)
mode_addmm.register_autograd(_mode_addmm_backward, setup_context=_addmm_setup)
mode_bmm.register_autograd(_mode_bmm_backward, setup_context=_save_all)
mode_mean_dim.register_autograd(_mode_mean_dim_backward, setup_context=_mean_setup)


# ---------------------------------------------------------------------------------------------
# The post-grad pass
# ---------------------------------------------------------------------------------------------
def _mm_args(node):
    return node.args[:2]


def _addmm_args(node):
    bias, a, b = node.args[:3]
    return (bias, a, b, float(node.kwargs.get("beta", 1)), float(node.kwargs.get("alpha", 1)))


def _mean_args(node):
    x, dim = node.args[:2]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return (x, None if dim is None else list(dim), bool(keepdim), node.kwargs.get("dtype"))


def _grouped_args(node):
    names = ("offs", "bias", "out_dtype")
    rest = list(node.args[2:]) + [node.kwargs.get(name) for name in names[len(node.args) - 2:]]
    return (node.args[0], node.args[1], *rest)


REWRITES = {
    aten.mm.default: (torch.ops.detkit.mode_mm.default, _mm_args),
    aten.addmm.default: (torch.ops.detkit.mode_addmm.default, _addmm_args),
    aten.bmm.default: (torch.ops.detkit.mode_bmm.default, _mm_args),
    aten.mean.dim: (torch.ops.detkit.mode_mean_dim.default, _mean_args),
}
if hasattr(aten, "_grouped_mm"):
    REWRITES[aten._grouped_mm.default] = (torch.ops.detkit.mode_grouped_mm.default, _grouped_args)


def rewrite_graph(graph: torch.fx.Graph) -> int:
    """Replace every aten mm / addmm / bmm / mean.dim / _grouped_mm node of ``graph`` with its detkit op; returns
    how many were replaced."""
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in REWRITES:
            continue
        target, args_of = REWRITES[node.target]
        with graph.inserting_before(node):
            new = graph.call_function(target, tuple(args_of(node)))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        replaced += 1
    return replaced


def _custom_graph_pass_base():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


class ModeGraphPass(_custom_graph_pass_base()):
    """The post-grad pass: runs the pass that was installed before it (if any), then ``rewrite_graph``."""

    def __init__(self, previous=None):
        self.previous = previous

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.previous is not None:
            self.previous(graph)
        replaced = rewrite_graph(graph)
        log.debug("detkit mode: %d aten nodes on detkit ops", replaced)

    def uuid(self):
        previous = self.previous.uuid() if hasattr(self.previous, "uuid") else repr(self.previous)
        return (PASS_VERSION, previous)


_SAVED_OPTIONS: dict[str, object] = {}


def pass_installed() -> bool:
    import torch._inductor.config as inductor_config

    return isinstance(inductor_config.post_grad_custom_pre_pass, ModeGraphPass)


def install() -> None:
    """On entry: the pass (once per process; Dynamo's caches reset if it compiled before), and the
    Inductor options for the time the mode is entered."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    if not pass_installed():
        if counters["aot_autograd"].get("total", 0) or counters["stats"].get("unique_graphs", 0):
            import torch._dynamo

            log.info("detkit mode: resetting Dynamo's caches so graphs compiled before the first entry recompile "
                     "with detkit's ops")
            torch._dynamo.reset()
        inductor_config.post_grad_custom_pre_pass = ModeGraphPass(inductor_config.post_grad_custom_pre_pass)
    for name, value in INDUCTOR_OPTIONS.items():
        if hasattr(inductor_config, name):
            _SAVED_OPTIONS[name] = getattr(inductor_config, name)
            setattr(inductor_config, name, value)


def uninstall() -> None:
    import torch._inductor.config as inductor_config

    for name, value in _SAVED_OPTIONS.items():
        setattr(inductor_config, name, value)
    _SAVED_OPTIONS.clear()
