"""The MoE layers' input checks (both precisions), all on the host before any kernel is queued: types, dtypes, shapes,
strides, 32-bit offsets, storage that covers each view, and the keyword arguments of the public entry points. The
routing's ids and scores are checked by the routing kernels themselves (kernels/moe/routing.py)."""

from __future__ import annotations

import torch

from detkit.kernels.backend import MAX_INT32_OFFSET, check_bf16_matrix, resolve_backend
from detkit.kernels.backend import check_storage
from detkit.kernels.moe.fp8.quant import QBLOCK
from detkit.kernels.moe.configs import WGRAD_MODES
from detkit.kernels.moe.kernels import moe_grouped_gemm_kernel
from detkit.kernels.moe.routing import check_topk_args


def check_storage_covers(name: str, t: torch.Tensor) -> None:
    """Refuses a tensor whose storage does not hold every element its view addresses (e.g. after
    ``t.untyped_storage().resize_(0)``): a kernel would read or write outside the storage. The check and its
    message are det_gemm's (kernels.backend.check_storage)."""
    if t.numel() == 0:
        return
    check_storage(name, t, sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1)


def _check_bf16_3d(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: torch.bfloat16")
    if t.dim() != 3 or min(t.shape) < 1:
        raise ValueError(f"{name} must be 3-D [E, rows, cols] with every dim >= 1; got shape {tuple(t.shape)}")
    if any(s < 0 for s in t.stride()):
        raise ValueError(f"{name} has negative strides {t.stride()}; supported: non-negative strides")
    furthest = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    if furthest > MAX_INT32_OFFSET:
        raise ValueError(f"{name} (shape {tuple(t.shape)}, strides {t.stride()}) spans element offset {furthest}; "
                         "supported: offsets below 2**31 (32-bit kernel indexing)")


def check_moe_inputs(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                     scores: torch.Tensor) -> str:
    """Refuse anything unsupported before any work; return the backend."""
    check_bf16_matrix("x", x)
    _check_bf16_3d("w1", w1)
    _check_bf16_3d("w2", w2)
    t_count, hidden = x.shape
    experts, w1_h, two_i = w1.shape
    if w1_h != hidden:
        raise ValueError(f"w1 must be [E, H, 2I] with H = x.shape[1] = {hidden}; got w1 {tuple(w1.shape)}")
    if two_i % 2:
        raise ValueError(f"w1's last dim 2I = {two_i} must be even (interleaved gate/up pairs)")
    if tuple(w2.shape) != (experts, two_i // 2, hidden):
        raise ValueError(f"w2 must be [E, I, H] = {(experts, two_i // 2, hidden)} to match x {tuple(x.shape)} "
                         f"and w1 {tuple(w1.shape)}; got {tuple(w2.shape)}")
    # The ids and scores themselves are checked by the routing kernels, read back with the routing's one
    # device-to-host read; a GEMM queued before that read computes nothing from a refused batch (the
    # routing gate). Here only what needs no data.
    check_topk_args(topk_ids, scores, experts)
    if topk_ids.shape[0] != t_count:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows but x has T = {t_count} tokens")
    for name, t in (("x", x), ("w1", w1), ("w2", w2), ("topk_ids", topk_ids), ("scores", scores)):
        check_storage_covers(name, t)
    return resolve_backend(moe_grouped_gemm_kernel, {"x": x, "w1": w1, "w2": w2, "topk_ids": topk_ids,
                                                     "scores": scores})


def check_moe_fp8_inputs(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                         scores: torch.Tensor) -> str:
    """The BF16 path's checks, plus the FP8 block: H and I multiples of 128. Returns the backend."""
    backend = check_moe_inputs(x, w1, w2, topk_ids, scores)
    hidden, inter = x.shape[1], w2.shape[1]
    if hidden % QBLOCK or inter % QBLOCK:
        raise ValueError(f"the FP8 path needs H and I multiples of {QBLOCK} (1x128 / 128x128 blocks); "
                         f"got H = {hidden}, I = {inter}")
    return backend


def check_main_grads(main_grads, w1: torch.Tensor, w2: torch.Tensor) -> None:
    """``main_grads``: None, or a pair of FP32 tensors of the weights' shapes on their device (the weights themselves
    are checked by ``check_moe_inputs``)."""
    if main_grads is None:
        return
    if not isinstance(main_grads, (tuple, list)) or len(main_grads) != 2:
        raise TypeError(f"main_grads must be a pair (main_grad_w1, main_grad_w2) or None; got {type(main_grads).__name__}")
    for name, g, w in (("main_grad_w1", main_grads[0], w1), ("main_grad_w2", main_grads[1], w2)):
        if not isinstance(g, torch.Tensor) or g.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor; got {getattr(g, 'dtype', type(g).__name__)}")
        if isinstance(w, torch.Tensor) and (g.shape != w.shape or g.device != w.device):
            raise ValueError(f"{name} must match its weight's shape {tuple(w.shape)} on {w.device}; "
                             f"got {tuple(g.shape)} on {g.device}")
        if any(s < 0 for s in g.stride()):
            raise ValueError(f"{name} has negative strides {g.stride()}")
        check_storage_covers(name, g)


def check_dout(dout: torch.Tensor, x: torch.Tensor) -> None:
    check_bf16_matrix("dout", dout)
    if tuple(dout.shape) != tuple(x.shape) or dout.device != x.device:
        raise ValueError(f"dout must be {tuple(x.shape)} on {x.device}; got {tuple(dout.shape)} on {dout.device}")
    check_storage_covers("dout", dout)


def check_stage_range(stage_range) -> None:
    """``stage_range``: None, or a callable taking a stage's name and returning a context manager (an NVTX range)."""
    if stage_range is not None and not callable(stage_range):
        raise TypeError(f"stage_range must be a callable (stage name -> context manager) or None; got "
                        f"{type(stage_range).__name__}")


def check_wgrad_mode(wgrad: str) -> None:
    if not isinstance(wgrad, str):
        raise TypeError(f"wgrad must be a str, one of {WGRAD_MODES}; got {type(wgrad).__name__}")
    if wgrad not in WGRAD_MODES:
        raise ValueError(f"wgrad {wgrad!r} is not supported; supported: {WGRAD_MODES}")
