"""The vocabulary both MoE precisions share (kernels/moe/layer.py BF16, kernels/moe/fp8/layer.py FP8): the names a launch, its
NVTX range and its report row share; the epilogue codes the grouped GEMM kernels take; the widths the dscore
partials are summed over; and the gradients a layer's backward returns. Host-side only: no kernel code here."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton.language as tl

# ---------------------------------------------------------------------------------------------
# Names: one string per launch, shared by its NVTX range and its report row
# ---------------------------------------------------------------------------------------------


def stage_name(op: str, precision: str = "bf16", **dims: int) -> str:
    """The one name shared by a launch, its NVTX range and its report row."""
    return f"{op} [" + ", ".join(f"{k}={v}" for k, v in dims.items()) + f"] {precision}"


def fp8_stage_name(op: str, **dims: int) -> str:
    """``stage_name`` of an FP8 launch."""
    return stage_name(op, "fp8", **dims)


# The grouped GEMMs' op_id (a launch argument that only names the launch) -> op name.
_GROUPED_OPS = ("moe_up_swiglu", "moe_down", "moe_dgrad_dswiglu", "moe_dx_route")
_FP8_GROUPED_OPS = ("moe_fp8_up_swiglu", "moe_fp8_down", "moe_fp8_dgrad_dswiglu", "moe_fp8_dx_route")
_WGRAD_OPS = ("moe_wgrad_w1", "moe_wgrad_w2")
_COMBINE_OPS = ("moe_combine", "moe_dx_gather_sum")


def grouped_launch_name(grid, metadata, args):
    """Launch name and FLOPs of a BF16 grouped GEMM (Triton or Gluon): C[P, C] over the reduced L."""
    op = _GROUPED_OPS[args["op_id"]]
    p, c, l = args["P"], args["C"], args["L"]
    return {"name": stage_name(op, P=p, N=c, K=l), "flops": 2.0 * p * c * l}


def wgrad_launch_name(grid, metadata, args):
    """Launch name of a BF16 weight-gradient kernel (Triton or Gluon)."""
    return {"name": stage_name(_WGRAD_OPS[args["op_id"]], R=args["R"], C=args["C"])}


def scale_rows_launch_name(grid, metadata, args):
    return {"name": stage_name("moe_scale_rows", P=args["P"], N=args["N"])}


def combine_launch_name(grid, metadata, args):
    return {"name": stage_name(_COMBINE_OPS[args["op_id"]], T=args["T"], N=args["N"], K=args["K"])}


def fp8_grouped_launch_name(grid, metadata, args):
    """Launch name and FLOPs of an FP8 grouped GEMM (Triton or Gluon): C[P, C] over the reduced L."""
    p, c, l = args["P"], args["C"], args["L"]
    return {"name": fp8_stage_name(_FP8_GROUPED_OPS[args["op_id"]], P=p, N=c, K=l), "flops": 2.0 * p * c * l}


def fp8_wgrad_launch_name(grid, metadata, args):
    """Launch name of an FP8 weight-gradient kernel (Triton or Gluon)."""
    return {"name": fp8_stage_name("moe_fp8_wgrad", R=args["R"], C=args["C"])}


def colwise_quant_launch_name(grid, metadata, args):
    return {"name": fp8_stage_name("moe_fp8_quant_colwise", P=args["P"], N=args["N"])}


LAYER_STAGES = ("routing", "up_swiglu", "down", "combine", "dgrad_dswiglu", "dx", "wgrad", "dscores")
FP8_LAYER_STAGES = ("routing", "quant_x", "weights", "up_swiglu", "down", "combine", "quant_dout", "dgrad_dswiglu",
                    "dx", "wgrad", "dscores")


def layer_stage_names(x: torch.Tensor, w1: torch.Tensor, k: int, stages=LAYER_STAGES,
                      precision: str = "bf16") -> Mapping[str, str]:
    """Stage -> the NVTX range / row name of that stage of one layer call (read-only; built once per shape: the
    layer asks for them on every call, and formatting them took ~40-55 µs of host time per call)."""
    t, h = x.shape
    e, _, two_i = w1.shape
    return _stage_names(t, h, two_i // 2, e, k, tuple(stages), precision)


@functools.lru_cache(maxsize=256)
def _stage_names(t: int, h: int, i: int, e: int, k: int, stages: tuple[str, ...], precision: str) -> Mapping[str, str]:
    dims = {"T": t, "H": h, "I": i, "E": e, "K": k}
    return MappingProxyType({stage: stage_name(f"moe_{stage}", precision, **dims) for stage in stages})


# ---------------------------------------------------------------------------------------------
# Epilogue codes: the EPILOGUE constexpr of the grouped GEMM kernels. The two precisions' kernels number their
# epilogues differently, so each code has one name per meaning; the kernels compare against these values.
# ---------------------------------------------------------------------------------------------
# Both precisions: the FP32 accumulator stored in C's dtype, rounded once when that is BF16 (y of the down
# projection, the per-route dX).
EPI_PLAIN = 0
# BF16 kernels (kernels/moe/kernels.py, kernels/moe/ws.py):
EPI_SWIGLU = 1  # gu in BF16 and h = silu(g) * u from those BF16 values, rounded once (up)
EPI_DSWIGLU = 2  # dh = s * acc, then dg, du from the saved gu, dgu in BF16 (dgrad)
# FP8 kernels (kernels/moe/fp8/kernels.py, kernels/moe_fp8_ws*.py):
EPI_FP8_SWIGLU_QUANT = 1  # EPI_SWIGLU's gu and h, and h quantized 1x128 in the epilogue (a 256-column up tile)
EPI_FP8_DSWIGLU_QUANT = 2  # EPI_DSWIGLU's dgu, and dgu quantized 1x128 in the epilogue (dgrad)
EPI_FP8_SWIGLU = 3  # EPI_SWIGLU's gu and h; h is quantized by the row-wise pass (a narrower up tile)

# ---------------------------------------------------------------------------------------------
# The dscore partials: each dgrad tile sums dh_raw * h over fixed groups of columns, so the partials (and the
# dscores summed from them in a fixed order) do not depend on the dgrad tile.
# ---------------------------------------------------------------------------------------------
DS_CHUNK = 64  # BF16: dh columns per partial
# FP8: dh columns per partial. The 16 columns 64c + 8j + 2q + b (j < 8, b < 2) of a 64-column chunk c are the ones
# one thread of the sm_90 FP8 wgmma accumulator holds for its q < 4, so the Gluon epilogue sums them without moving
# data between threads. A constexpr: the Triton and Gluon kernels read it.
DS_GROUP = tl.constexpr(16)


@dataclass
class MoeGrads:
    """The gradients of a MoE layer's backward (both precisions)."""

    dx: torch.Tensor  # [T, H] bf16
    dw1: torch.Tensor | None  # [E, H, 2I] bf16; None when accumulated into main_grad
    dw2: torch.Tensor | None  # [E, I, H] bf16; None when accumulated into main_grad
    dscores: torch.Tensor  # [T, K], scores' dtype
