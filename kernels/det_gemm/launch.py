"""Deterministic, batch-invariant GEMMs for Hopper: forward, dA and dB, on BF16, FP16 or FP32 operands.

Math (BF16 in, FP32 accumulation, one BF16 rounding at the end; FP16 the same with one FP16 rounding; FP32 in: FP32
products at ``precision``, "ieee" or "tf32", FP32 accumulation and output -- see "FP32 operands" below):
    det_gemm_fwd(a [M,K], b [K,N]) = a @ b        reduces over K
    det_gemm_da(dc [M,N], b [K,N]) = dc @ b.T     reduces over N
    det_gemm_db(a [M,K], dc [M,N]) = a.T @ dc     reduces over M

All three are one kernel, ``det_gemm_kernel``, computing ``C[R,C] = A[R,L] @ B[L,C]`` over strided
views, so the transposes cost no copy (an nn.Linear weight ``[N,K]`` is passed as ``weight.t()``). The exception:
"tf32" dA and dB of enough rows run as forward products with one small copy (``TF32_DA_TRANSPOSED_MIN_ROWS``).

Determinism rests on three rules, audited by ``audits/gemm_*``:
- No split-K and no atomics: one program owns one output tile and reduces all of L itself.
- The reduction runs over L in ascending order in steps of ``STEP_K`` elements, each step one
  ``tl.dot`` into the same FP32 accumulator. The order is a function of L alone — never of the row
  count R, the grid, or the tile config — so a row's bits do not depend on the batch it sits in
  (batch invariance for fwd and dA) and appending zero rows to dB adds exact zeros.
- Configs come from the pinned table in kernels/det_gemm/configs.py (no autotune): by M, and in the small- and
  mid-M buckets by whether the grid fits one wave on the device (``OneWave``). Every config must give the same
  bits; the cross-config audit checks that on every backend.

Segmented reduction: with ``seg_len`` set, L is cut into contiguous segments; each is accumulated
from zero in FP32 and the segment sums are added in ascending order. A TP/CP shard boundary can then
coincide with a segment boundary, so a later parallelism-invariant mode can reproduce a sharded sum
bit for bit. ``seg_len=None`` (one segment) is the default.

On the Triton interpreter (CPU) ``tl.dot`` on BF16 operands is wrong and its FP32 dot is numpy's
matmul, whose summation order depends on the tile shape. There the kernel instead adds one exact
BF16 product per reduced element to the FP32 accumulator, in ascending order: the
contract's semantics (exact products, FP32 accumulation, one BF16 rounding) with an order that
depends on L alone (one FP32 rounding per product, strictly sequential). The interpreter's FP32 to
BF16 cast truncates, so the final rounding there is done in integer arithmetic (nearest-even). Interpreter bits differ from tensor-core bits; each backend is audited on its own.

FP32 operands: on the GPU each K step is ``tl.dot(..., input_precision=precision)`` ("ieee": FP32 fused multiply-adds
on the CUDA cores; "tf32": tensor cores on TF32 operands); in the interpreter each product is rounded to FP32 (both
operands first rounded to TF32 for "tf32") and added one at a time in ascending order, as above. The precision is
the caller's (never a global), part of the plan's key and of the launch's name. The FP32 table is
``CONFIG_TABLE_FP32``; FP16 operands take the BF16 table, its "ws" picks as their TMA twins.

Three kernels share that tile math (``tile_of_program``, ``segment_boundary``, ``accumulate``, ``mac_step``, ``store_tile``),
all in kernels/det_gemm/kernels.py:
- ``det_gemm_kernel`` (``GemmConfig.variant == "ptr"``) loads through pointers
  (cp.async on sm_90).
- ``det_gemm_tma_kernel`` (``variant == "tma"``) loads each operand with a host-side TMA descriptor
  over its storage order (a K-major B, e.g. ``weight.t()``, as ``[N, K]`` boxes transposed before
  ``tl.dot``) and zero-fills out-of-bounds boxes as the masked loads do. TMA needs a unit stride on one
  dim, the other stride and the base 16-byte aligned; any other operand is refused with an error
  naming it, never handed to the pointer kernel behind the caller's back.
- ``det_gemm_tma3_kernel`` (``variant == "tma3"``): the TMA kernel with a tile three power-of-two
  sub-tiles wide (e.g. 192 columns), one accumulator per sub-tile. The table offers it in OneWave entries
  only, beside tiles with a pointer twin: when an operand is not TMA-addressable the entry picks among
  those instead (same bits).

``det_gemm_fma_kernel`` (``variant == "fma"``; kernels/det_gemm/fma.py, Gluon, sm_90 only): FP32 "ieee" operands on
the FMA dot with register micro-tiles of its choosing, TMA into a shared-memory ring; the same chain per output, so
the same bits. A table pick of "fma" runs as the pointer kernel with the same tile where Gluon cannot (not sm_90,
seg_len segments) or an operand is not TMA-addressable; an "fma" config passed by the caller is refused there.

FP32 "ieee" at M <= 16 runs ``det_gemm_gemv_kernel`` (kernels/det_gemm/gemv.py; variants "gemv_row", "gemv_vec",
"gemv_tile"): pointer loads over the same strides, explicit fused multiply-adds computing each output as the chain the
FMA dot computes (ascending k from +0.0), so the same bits as every tile config; other operand kinds with a "gemv_*"
config are refused by name.

Shapes: any M, N, K >= 1 below 2**30 (element offsets are 64-bit: an lm_head's logits may hold more than
2**31 - 1 elements); any non-negative strides ("ptr").

Host path: a call's signature (op, options, and each tensor's type, shape, strides, dtype, layout, device and
base alignment) keys a launch plan, built once and kept in a bounded LRU: the signature checks, the table's pick,
the variant, the grid and the static launch arguments. Per call: one cache lookup, the checks that depend on the
tensors themselves (storage), the output's allocation and the launch, straight into the compiled kernel's
launcher after the plan's first launch (kernels/backend.py DirectLaunch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from detkit.kernels.backend import (
    CUDA_SM90, TRITON_INTERPRETER, DirectLaunch, check_bf16_matrix, check_bf16_signature, check_layout,
    check_storage, ensure_thread_cuda_context, host_descriptor, resolve_backend_of_devices,
)
from detkit.kernels.det_gemm.configs import (  # noqa: F401 (the table and its arithmetic, re-exported)
    CONFIG_TABLE, CONFIG_TABLE_FP32, CONFIG_TABLE_VERSION, FP32_CONFIG_TABLE_VERSION, HOPPER_SMS, INTERPRETER_MAX_BLOCK_NUMEL, SMEM_BARRIER_SLACK, SMEM_PER_SM,
    SMEM_RESERVED_PER_CTA, TMA_MAX_BOX, ByWidth, FewestWaves, GEMV_VARIANTS, VARIANTS, GemmConfig, OneWave, all_configs, config_table, ctas_per_sm, device_sms,
    entry_configs, fma_micro_tile, fma_twin, interpreter_step_k, operand_ring_bytes, output_tiles, select_config, ws_twin,
)
from detkit.kernels.det_gemm.kernels import (  # noqa: F401 (the kernels and their tile math, re-exported)
    accumulate, det_gemm_kernel, det_gemm_tma3_kernel, det_gemm_tma_kernel, fp32_to_bf16_rtne, mac_step,
    segment_boundary, store_tile, tile_of_program, tma_tile,
)
from detkit.kernels.det_gemm.reference import det_gemm_da_ref, det_gemm_db_ref, det_gemm_fwd_ref  # noqa: F401
from detkit.kernels.det_gemm.fma import det_gemm_fma_kernel, fma_descriptor, fma_options
from detkit.kernels.det_gemm.gemv import det_gemm_gemv_kernel
from detkit.kernels.det_gemm.ws import consumers, det_gemm_ws_kernel, max_regs, ws_descriptor, ws_tma_store
from detkit.kernels.det_gemm.names import KINDS, _OP_IDS, OPS, _launch_metadata, _layer_dims, case_name  # noqa: F401 (re-exported)

# ---------------------------------------------------------------------------------------------
# Launch: a plan per call signature, checked and derived once; per call the tensor checks and the launch.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmLaunch:
    """What ran: the backend and the config, for every result row."""

    op: str
    backend: str
    config: GemmConfig
    name: str


def _launch_record(op: str, backend: str, config: GemmConfig, rows: int, cols: int, reduced: int,
                   precision: str = "bf16") -> GemmLaunch:
    """What a launch ran, named in the layer's (M, N, K) from the kernel's (rows, cols, reduced) and the operands'
    kind (``precision``: the kernels' PRECISION)."""
    m, n, k = _layer_dims(_OP_IDS[op], rows, cols, reduced)
    return GemmLaunch(op=op, backend=backend, config=config, name=case_name(op, m, n, k, KINDS[precision]))


# Launch plans kept, least recently used dropped first: a model's layer shapes times the batch sizes it runs at.
MAX_PLANS = 4096
# Every dim must be below this: tile indices, TMA box coordinates and TMA shapes are 32-bit (element offsets
# are 64-bit: an operand or the output may hold more than 2**31 - 1 elements).
MAX_DIM = 2**30
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Operand dtypes: BF16 and FP16 (exact products, FP32 accumulation, an output of their own dtype or FP32) and FP32
# (FP32 products at ``precision``, FP32 accumulation and output). Both operands share one dtype.
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# FP32 products: "ieee" (IEEE FP32, the default) or "tf32" (TF32 operands on the tensor cores: what torch's
# ``set_float32_matmul_precision("high")`` lets torch.matmul do; the caller chooses, det_gemm reads no global).
PRECISIONS = ("ieee", "tf32")

# The caller's operand names per op, and whether the kernel's A [R, L] / B [L, C] view reads each transposed.
_OPERAND_NAMES = {"fwd": ("a", "b"), "da": ("dc", "b"), "db": ("a", "dc")}
_TRANSPOSED = {"fwd": (False, False), "da": (False, True), "db": (True, False)}
# (x dim, y dim, what) of the dimension the two operands share.
_SHARED_DIM = {"fwd": (1, 0, "det_gemm_fwd needs a [M,K], b [K,N]"),
               "da": (1, 1, "det_gemm_da needs dc [M,N], b [K,N]"),
               "db": (0, 0, "det_gemm_db needs a [M,K], dc [M,N]")}


class _Operand(NamedTuple):
    """What a launch plan knows of one tensor: its signature, never the tensor (a plan outlives its calls)."""

    name: str
    cls: type
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    layout: torch.layout
    device: torch.device
    misalign: int  # data_ptr % 16

    def view(self, transposed: bool) -> tuple[tuple[int, int], tuple[int, int]]:
        """(shape, strides) of the kernel's view: the tensor or its transpose."""
        return (self.shape[::-1], self.stride[::-1]) if transposed else (tuple(self.shape), tuple(self.stride))


def _check_operand(t: _Operand) -> int:
    """check_bf16_matrix on a signature, without the 32-bit offset limit (the kernels index in 64 bits) but with
    MAX_DIM; returns the elements the view spans from its storage offset."""
    if not issubclass(t.cls, torch.Tensor):
        raise TypeError(f"{t.name} must be a torch.Tensor; got {t.cls.__name__}")
    check_layout(t.name, t.layout)
    span = check_bf16_signature(t.name, t.shape, t.stride, t.dtype, max_offset=None, dtypes=IN_DTYPES)
    if max(t.shape) >= MAX_DIM:
        raise ValueError(f"{t.name} has shape {tuple(t.shape)}; supported: every dim below 2**30 (32-bit tile "
                         "indices and TMA coordinates)")
    return span


def _check_options(config, seg_len, out_dtype, precision=None) -> None:
    """The launch options' types, checked per call before the plan lookup (they are part of its key)."""
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a GemmConfig or None (the table's pick); got {type(config).__name__} "
                        f"{config!r}")
    if seg_len is not None and (not isinstance(seg_len, int) or seg_len < 1):
        raise ValueError(f"seg_len must be a positive int or None; got {seg_len!r}")
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype {out_dtype} is not supported; supported: torch.bfloat16 (BF16 operands), "
                        "torch.float16 (FP16 operands), torch.float32")
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not supported; supported: None, "
                         f"{', '.join(map(repr, PRECISIONS))}")


_HALF_KINDS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _operand_kind(x: "_Operand", y: "_Operand", out_dtype, precision) -> tuple[torch.dtype, str]:
    """(output dtype, the kernels' PRECISION) of a call: BF16 / FP16 operands -> "bf16" / "fp16" (their products are
    exact in FP32; a precision is refused), an output of their dtype (None) or FP32; FP32 operands -> ``precision``
    (None: "ieee"), FP32 out."""
    if x.dtype != y.dtype:
        raise TypeError(f"{x.name} has dtype {x.dtype} and {y.name} {y.dtype}; supported: both of one dtype "
                        "(torch.bfloat16, torch.float16 or torch.float32)")
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not supported; supported: None, "
                         f"{', '.join(map(repr, PRECISIONS))}")
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype {out_dtype} is not supported; supported: torch.bfloat16 (BF16 operands), "
                        "torch.float16 (FP16 operands), torch.float32")
    half = _HALF_KINDS.get(x.dtype)
    if half is not None:
        if precision is not None:
            raise ValueError(f"precision {precision!r} applies to FP32 operands; {half.upper()} products are exact in "
                             f"FP32 (supported for {half.upper()}: None)")
        if out_dtype not in (None, x.dtype, torch.float32):
            raise TypeError(f"out_dtype {out_dtype} is not supported with {x.dtype} operands; supported: {x.dtype}, "
                            "torch.float32")
        return (x.dtype if out_dtype is None else out_dtype), half
    if out_dtype not in (None, torch.float32):
        raise TypeError(f"out_dtype {out_dtype} with FP32 operands is not supported; supported: torch.float32 (FP32 "
                        "operands give an FP32 output, never rounded further)")
    return torch.float32, ("ieee" if precision is None else precision)


def _check_seg_len(seg_len: int | None, reduced: int, config: GemmConfig) -> int:
    if seg_len is None:
        return reduced
    if not isinstance(seg_len, int) or seg_len < 1:
        raise ValueError(f"seg_len must be a positive int or None; got {seg_len!r}")
    if seg_len % config.block_k:
        raise ValueError(
            f"seg_len {seg_len} is not a multiple of the config's BLOCK_K {config.block_k}; "
            "segment boundaries must fall on loop iterations"
        )
    return seg_len


def _is_contiguous(shape, stride) -> bool:
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def _check_twin(twin: _Operand | None, rows: int, cols: int, out_dtype: torch.dtype, device: torch.device) -> None:
    if twin is None:
        return
    if not issubclass(twin.cls, torch.Tensor):
        raise TypeError(f"twin_out must be a torch.Tensor or None; got {twin.cls.__name__}")
    check_layout("twin_out", twin.layout)
    contiguous = _is_contiguous(twin.shape, twin.stride)
    if tuple(twin.shape) != (rows, cols) or twin.dtype != out_dtype or twin.device != device or not contiguous:
        raise ValueError(
            f"twin_out must be a contiguous {out_dtype} tensor of shape {(rows, cols)} on {device} (the output's "
            f"twin); got {twin.dtype} {tuple(twin.shape)} on {twin.device}, contiguous={contiguous}"
        )


def _tma_layout(shape, stride, item: int, misalign: int, block: tuple[int, int]):
    """``(transposed, shape, strides, box)`` of a TMA descriptor over a view [rows, cols] (``shape``,
    ``stride``; elements of ``item`` bytes, base ``misalign`` bytes past a 16-byte boundary) in its storage order
    ([cols, rows] with ``block`` reversed when transposed), or None when TMA cannot address it: no unit-stride
    dim, a non-16-byte-aligned base or outer stride."""
    (rows, cols), (stride_r, stride_c) = shape, stride
    if stride_c == 1:
        transposed, shape, strides, box = False, [rows, cols], [stride_r, 1], [block[0], block[1]]
    elif stride_r == 1:
        transposed, shape, strides, box = True, [cols, rows], [stride_c, 1], [block[1], block[0]]
    else:
        return None
    if strides[0] * item % 16 or misalign:
        return None
    return transposed, shape, strides, box


def _descriptor_layout(name: str, shape, stride, item: int, misalign: int, view_shape, view_stride,
                       block: tuple[int, int], variant: str):
    """_tma_layout of an operand's view, or a refusal naming the operand (its own shape and strides)."""
    layout = _tma_layout(view_shape, view_stride, item, misalign, block)
    if layout is None:
        raise ValueError(
            f"variant {variant!r} cannot describe {name} (shape {tuple(shape)}, strides {tuple(stride)}, "
            f"data_ptr % 16 = {misalign}): TMA needs one dim with stride 1, the other stride a "
            f"multiple of {16 // item} elements (16 bytes) and a 16-byte-aligned base; use a 'ptr' config "
            "for this operand"
        )
    return layout


def tma_descriptor(name: str, tensor: torch.Tensor, view: torch.Tensor, block: tuple[int, int],
                   variant: str = "tma"):
    """A TMA descriptor over ``view`` and whether its storage order is transposed; refuses, naming the
    operand, what TMA cannot address."""
    transposed, shape, strides, box = _descriptor_layout(
        name, tensor.shape, tensor.stride(), tensor.element_size(), tensor.data_ptr() % 16, view.shape, view.stride(),
        block, variant)
    if variant == "ws":  # Gluon's descriptor carries the shared-memory layout of its box
        return ws_descriptor(tensor, shape, strides, box), transposed
    return TensorDescriptor(tensor, shape, strides, box), transposed


def _table_pick(op: str, m: int, rows: int, cols: int, views, device: torch.device, backend: str,
                segmented: bool, dtype: torch.dtype = torch.bfloat16, precision: str | None = None) -> GemmConfig:
    """The table's pick for ``op`` at batch size ``m``, output ``rows`` x ``cols`` on ``device``'s SMs. A "ws" pick runs
    as its TMA twin where the Gluon kernel cannot (``backend`` not sm_90, or ``segmented``: seg_len segments). When
    an operand is not TMA-addressable (``views``: (view shape, view strides, misalign) of A and B), a "tma3" pick
    gives way to the entry's pick among its other tiles, and a "tma" or "ws" pick runs as the pointer kernel with the
    same tile. Neither the tile, the layout nor the variant changes the bits (same K order; every pick swept on the
    H200 and checked by the cross-config audit), so this choice cannot change a result. ``dtype``: the operands'
    (FP32 operands take the FP32 table)."""
    item = dtype.itemsize

    def addressable(config: GemmConfig) -> bool:
        blocks = ((config.block_m, config.block_k), (config.block_k, config.box_n))
        return all(_tma_layout(shape, stride, item, misalign, blk) is not None
                   for (shape, stride, misalign), blk in zip(views, blocks))

    sms = device_sms(device)
    config = select_config(op, m, cols=cols, rows=rows, sms=sms, dtype=dtype, precision=precision)
    if config.variant == "tma3" and not addressable(config):  # a 3 x power-of-two tile has no pointer twin
        config = select_config(op, m, cols=cols, rows=rows, sms=sms, tma3=False, dtype=dtype, precision=precision)
    if backend != CUDA_SM90 or segmented or dtype != torch.bfloat16:  # the Gluon kernel takes BF16 only
        config = ws_twin(config)
    if backend != CUDA_SM90 or segmented or precision != "ieee":  # the "fma" Gluon kernel: FP32 "ieee", one segment
        config = fma_twin(config)
    if config.variant in ("tma", "ws", "fma") and not addressable(config):
        config = replace(config, variant="ptr")
    return config


class _Plan(NamedTuple):
    """A launch plan: what a call with this signature ran (``record``) and its launch (``launch(x, y, twin_out) ->
    output``: the per-call tensor checks, the output, the launch)."""

    record: GemmLaunch
    launch: object


@functools.lru_cache(maxsize=MAX_PLANS)
def _plan(key: tuple) -> _Plan:
    """The launch plan of a call signature (``_lookup``'s key): every check that depends on the signature alone,
    the config pick, the kernel variant, the grid and the static launch arguments, worked out once."""
    op, config, seg_len, out_dtype, precision = key[:5]
    names = _OPERAND_NAMES[op]
    x, y = _Operand(names[0], *key[5:12]), _Operand(names[1], *key[12:19])
    twin = None if key[19] is None else _Operand("twin_out", *key[19])
    return _build_plan(op, x, y, config, seg_len, out_dtype, twin, precision)


def _lookup(op: str, x, y, config, seg_len, out_dtype, twin_out, precision=None) -> _Plan:
    """The plan for this call: one cache lookup keyed on everything a plan depends on (op, options -- the FP32
    products' precision among them --, and each tensor's type, shape, strides, dtype, layout, device and base
    alignment; the alignment decides TMA and Triton's pointer specialization)."""
    try:
        key = (op, config, seg_len, out_dtype, precision,
               x.__class__, x.shape, x.stride(), x.dtype, x.layout, x.device, x.data_ptr() & 15,
               y.__class__, y.shape, y.stride(), y.dtype, y.layout, y.device, y.data_ptr() & 15,
               None if twin_out is None else (twin_out.__class__, twin_out.shape, twin_out.stride(), twin_out.dtype,
                                              twin_out.layout, twin_out.device, twin_out.data_ptr() & 15))
    except Exception as exc:  # not tensors, or tensors without strides or data pointers (e.g. sparse)
        _refuse_unkeyable(op, x, y, twin_out, exc)
    return _plan(key)


def _refuse_unkeyable(op: str, x, y, twin_out, exc: Exception):
    """The refusal for arguments a plan key cannot be taken from, naming the argument."""
    for name, t in zip(_OPERAND_NAMES[op], (x, y)):
        check_bf16_matrix(name, t, max_offset=None)
    if twin_out is not None:
        if not isinstance(twin_out, torch.Tensor):
            raise TypeError(f"twin_out must be a torch.Tensor or None; got {type(twin_out).__name__}")
        check_layout("twin_out", twin_out.layout)
    raise exc


def clear_launch_plans() -> None:
    """Forget every launch plan (they are rebuilt on the next calls): for tests that change the device's SMs."""
    _plan.cache_clear()


def launch_plans_info():
    """(hits, misses, maxsize, currsize) of the launch-plan cache."""
    return _plan.cache_info()


def _build_plan(op: str, x: _Operand, y: _Operand, config: GemmConfig | None, seg_len: int | None,
                out_dtype: torch.dtype | None, twin: _Operand | None, precision: str | None = None) -> _Plan:
    """Check, pick, derive: the old per-call work of a launch, done once per signature, in the same order."""
    x_span, y_span = _check_operand(x), _check_operand(y)
    out_dtype, kind = _operand_kind(x, y, out_dtype, precision)
    x_dim, y_dim, what = _SHARED_DIM[op]
    if x.shape[x_dim] != y.shape[y_dim]:
        raise ValueError(
            f"{what}: {x.name}.shape[{x_dim}]={x.shape[x_dim]} != {y.name}.shape[{y_dim}]={y.shape[y_dim]} "
            f"({x.name} {tuple(x.shape)}, {y.name} {tuple(y.shape)})"
        )
    backend = resolve_backend_of_devices(det_gemm_kernel, {x.name: x.device, y.name: y.device})
    a_t, b_t = _TRANSPOSED[op]
    (a_shape, a_stride), (b_shape, b_stride) = x.view(a_t), y.view(b_t)
    rows, reduced = a_shape
    cols = b_shape[1]
    device = x.device
    _check_twin(twin, rows, cols, out_dtype, device)
    if config is None:
        views = ((a_shape, a_stride, x.misalign), (b_shape, b_stride, y.misalign))
        config = _table_pick(op, reduced if op == "db" else rows, rows, cols, views, device, backend,
                             segmented=seg_len is not None and seg_len != reduced, dtype=x.dtype, precision=kind)
    elif not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a GemmConfig or None (the table's pick); got {type(config).__name__} "
                        f"{config!r}")
    if config.variant == "ws" and kind != "bf16":
        raise ValueError(f"variant 'ws' (the Gluon kernel) takes BF16 operands only; got {x.dtype}: use a 'ptr', "
                         "'tma' or 'tma3' config for FP16 and FP32 operands")
    if config.variant == "fma" and kind != "ieee":
        raise ValueError(f"variant 'fma' (the Gluon FMA-dot kernel) takes FP32 operands with precision 'ieee' only; got "
                         f"{x.dtype}" + (f", precision {kind!r}" if kind == "tf32" else "")
                         + ": use a 'ptr', 'tma' or 'tma3' config")
    if config.variant in GEMV_VARIANTS and kind != "ieee":
        raise ValueError(f"variant {config.variant!r} (explicit FP32 fused multiply-adds) takes FP32 operands with "
                         f"precision 'ieee' only; got {x.dtype}" + (f", precision {kind!r}" if kind == "tf32" else "")
                         + ": use a 'ptr', 'tma' or 'tma3' config")
    seg = _check_seg_len(seg_len, reduced, config)
    interpreted = backend == TRITON_INTERPRETER
    step_k = interpreter_step_k(config) if interpreted else config.block_k
    tiles = triton.cdiv(rows, config.block_m) * triton.cdiv(cols, config.block_n)
    out_bytes = out_dtype.itemsize
    geometry = _Geometry(op, x, y, a_t, b_t, a_shape, a_stride, b_shape, b_stride, rows, cols, reduced, x_span, y_span,
                         None if twin is None else rows * cols, out_dtype, out_bytes, device)
    if config.variant == "ws":
        if backend != CUDA_SM90:
            raise ValueError(f"variant 'ws' is a Gluon kernel for sm_90 and has no {backend!r} path; use a 'ptr', "
                             "'tma' or 'tma3' config there")
        if seg != reduced:
            raise ValueError("variant 'ws' keeps one FP32 accumulator (no seg_len segments); use a 'tma' config for "
                             "segmented calls")
        if config.block_m % (16 * config.num_warps):
            raise ValueError(f"det_gemm: variant 'ws' gives each consumer warpgroup (4 warps) 64 rows of a tile: "
                             f"block_m {16 * config.num_warps} per {config.num_warps} warps; got block_m "
                             f"{config.block_m}")
        launch = _ws_launch(geometry, config, twin is not None, min(tiles, device_sms(device)))
    elif config.variant == "fma":
        if backend != CUDA_SM90:
            raise ValueError(f"variant 'fma' is a Gluon kernel for sm_90 and has no {backend!r} path; use a 'ptr' "
                             "config with the same tile there (the same bits)")
        if seg != reduced:
            raise ValueError("variant 'fma' keeps one FP32 accumulator (no seg_len segments); use a 'ptr' config for "
                             "segmented calls")
        launch = _fma_launch(geometry, config, twin is not None, tiles)
    else:
        constexprs = dict(
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, STEP_K=step_k,
            GROUP_M=config.group_m, INTERPRETED=interpreted, SEGMENTED=seg != reduced,
            OUT_FP32=out_dtype == torch.float32, TWIN=twin is not None, PRECISION=kind,
            OUT_FP16=out_dtype == torch.float16,
        )
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        static = dict(R=rows, C=cols, L=reduced, stride_cr=cols, stride_cc=1, seg_len=seg, op_id=_OP_IDS[op])
        b_k_major = b_stride[0] == 1 and b_stride[1] != 1
        if config.variant in ("tma", "tma3"):
            launch = _tma_launch(geometry, config, step_k, interpreted, static, constexprs, options, (tiles,))
        elif config.variant in GEMV_VARIANTS:
            static.update(stride_ar=a_stride[0], stride_al=a_stride[1], stride_bl=b_stride[0], stride_bc=b_stride[1])
            gemv = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                        NUM_STAGES=config.num_stages, INTERPRETED=interpreted, SEGMENTED=seg != reduced,
                        TWIN=twin is not None, LOADS=config.variant.removeprefix("gemv_"), B_K_MAJOR=b_k_major,
                        EVEN_L=reduced % config.block_k == 0, PRECISION=kind)
            launch = _ptr_launch(geometry, interpreted, static, gemv, options, (tiles,), det_gemm_gemv_kernel)
        else:
            static.update(stride_ar=a_stride[0], stride_al=a_stride[1], stride_bl=b_stride[0], stride_bc=b_stride[1])
            constexprs["B_K_MAJOR"] = b_k_major
            launch = _ptr_launch(geometry, interpreted, static, constexprs, options, (tiles,))
    return _Plan(_launch_record(op, backend, config, rows, cols, reduced, kind), launch)


class _Geometry(NamedTuple):
    """A plan's operands, the kernel's views of them and the output, for the launch closures."""

    op: str
    x: _Operand
    y: _Operand
    a_t: bool  # the kernel's A reads x transposed
    b_t: bool
    a_shape: tuple[int, int]
    a_stride: tuple[int, int]
    b_shape: tuple[int, int]
    b_stride: tuple[int, int]
    rows: int
    cols: int
    reduced: int
    x_span: int  # elements each view spans from its storage offset (the storage check)
    y_span: int
    twin_span: int | None
    out_dtype: torch.dtype
    out_bytes: int
    device: torch.device


def _storage_check(g: _Geometry):
    """The per-call storage check of a plan's operands (and twin): one comparison each, the message only on
    failure."""
    x_name, y_name, x_span, y_span, twin_span = g.x.name, g.y.name, g.x_span, g.y_span, g.twin_span
    item = g.x.dtype.itemsize  # both operands share one dtype
    x_need, y_need = item * x_span, item * y_span

    def check(x, y, twin):
        if x.untyped_storage().nbytes() < item * x.storage_offset() + x_need:
            check_storage(x_name, x, x_span)
        if y.untyped_storage().nbytes() < item * y.storage_offset() + y_need:
            check_storage(y_name, y, y_span)
        if twin is not None:
            check_storage("twin_out", twin, twin_span)

    return check


def _arg_list(kernel, values: dict, dynamic: tuple[str, ...]) -> tuple[list, tuple[int, ...]]:
    """The kernel's arguments in its parameter order, as Triton's binder binds them (constexprs included): the
    plan's ``values``, with a None slot for each per-call argument in ``dynamic``; and those slots' positions."""
    names = list(kernel.arg_names)
    unknown = set(values) - set(names) | set(dynamic) - set(names)
    missing = [n for n in names if n not in values and n not in dynamic]
    if unknown or missing or set(values) & set(dynamic):
        raise RuntimeError(f"{kernel.fn.__name__}: a launch plan's arguments do not match the kernel's parameters "
                           f"(unknown {sorted(unknown)}, missing {missing})")
    return [values.get(name) for name in names], tuple(names.index(n) for n in dynamic)


def _ptr_launch(g: _Geometry, interpreted: bool, static: dict, constexprs: dict, options: dict, grid,
                kernel=det_gemm_kernel):
    """det_gemm_kernel (or det_gemm_gemv_kernel, the same arguments but its constexprs): pointer loads over the
    caller's strides."""
    check, out_shape, out_dtype, device = _storage_check(g), (g.rows, g.cols), g.out_dtype, g.device
    a_t, b_t = g.a_t, g.b_t
    template, (i_a, i_b, i_c, i_twin) = _arg_list(kernel, {**static, **constexprs},
                                                  ("a_ptr", "b_ptr", "c_ptr", "twin_ptr"))
    if interpreted:
        def launch(x, y, twin):
            check(x, y, twin)
            c = torch.empty(out_shape, dtype=out_dtype, device=device)
            args = template.copy()
            args[i_a], args[i_b] = x.t() if a_t else x, y.t() if b_t else y
            args[i_c], args[i_twin] = c, c if twin is None else twin
            kernel[grid](*args, **options)
            return c
        return launch
    # Triton reads a tensor argument's data pointer (and dtype) only: the caller's tensors stand for their views.
    direct = DirectLaunch(kernel, grid, options, device, dynamic=(i_a, i_b, i_c, i_twin))

    def launch(x, y, twin):
        check(x, y, twin)
        c = torch.empty(out_shape, dtype=out_dtype, device=device)
        args = template.copy()
        args[i_a], args[i_b], args[i_c], args[i_twin] = x, y, c, c if twin is None else twin
        direct(args)
        return c
    return launch


def _tma_launch(g: _Geometry, config: GemmConfig, step_k: int, interpreted: bool, static: dict, constexprs: dict,
                options: dict, grid):
    """det_gemm_tma_kernel / det_gemm_tma3_kernel: TMA descriptors over each operand in its storage order."""
    a_m_major, a_shape, a_strides, a_box = _descriptor_layout(g.x.name, g.x.shape, g.x.stride, g.x.dtype.itemsize,
                                                              g.x.misalign,
                                                              g.a_shape, g.a_stride, (config.block_m, step_k),
                                                              config.variant)
    b_k_major, b_shape, b_strides, b_box = _descriptor_layout(g.y.name, g.y.shape, g.y.stride, g.y.dtype.itemsize,
                                                              g.y.misalign,
                                                              g.b_shape, g.b_stride, (step_k, config.box_n),
                                                              config.variant)
    kernel = det_gemm_tma_kernel if config.variant == "tma" else det_gemm_tma3_kernel
    constexprs = {**constexprs, "A_M_MAJOR": a_m_major, "B_K_MAJOR": b_k_major}
    check, out_shape, out_dtype, device = _storage_check(g), (g.rows, g.cols), g.out_dtype, g.device
    template, (i_a, i_b, i_c, i_twin) = _arg_list(kernel, {**static, **constexprs},
                                                  ("a_desc", "b_desc", "c_ptr", "twin_ptr"))
    if interpreted:
        def launch(x, y, twin):
            check(x, y, twin)
            c = torch.empty(out_shape, dtype=out_dtype, device=device)
            args = template.copy()
            args[i_a] = TensorDescriptor(x, a_shape, a_strides, a_box)
            args[i_b] = TensorDescriptor(y, b_shape, b_strides, b_box)
            args[i_c], args[i_twin] = c, c if twin is None else twin
            kernel[grid](*args, **options)
            return c
        return launch
    direct = DirectLaunch(kernel, grid, options, device, dynamic=(i_a, i_b, i_c, i_twin))

    def launch(x, y, twin):
        check(x, y, twin)
        ensure_thread_cuda_context(device)
        if direct.ready:  # the launcher encodes each descriptor from base, shape and strides
            a_desc, b_desc = host_descriptor(x, a_shape, a_strides), host_descriptor(y, b_shape, b_strides)
        else:  # the first launch specializes on real descriptors (their block shapes)
            a_desc = TensorDescriptor(x, a_shape, a_strides, a_box)
            b_desc = TensorDescriptor(y, b_shape, b_strides, b_box)
        c = torch.empty(out_shape, dtype=out_dtype, device=device)
        args = template.copy()
        args[i_a], args[i_b], args[i_c], args[i_twin] = a_desc, b_desc, c, c if twin is None else twin
        direct(args)
        return c
    return launch


# Scratch tensors the ws kernel's unused store descriptors point at when its epilogue stores from registers, one
# per (device, box, dtype), kept with their descriptors (the kernel never touches them).
_WS_SCRATCH: dict = {}


def _ws_scratch_descriptor(device: torch.device, box: list[int], dtype: torch.dtype):
    key = (device, tuple(box), dtype)
    if key not in _WS_SCRATCH:
        scratch = torch.empty(box, dtype=dtype, device=device)
        _WS_SCRATCH[key] = (scratch, ws_descriptor(scratch, list(scratch.shape), list(scratch.stride()), box))
    return _WS_SCRATCH[key][1]


def _ws_launch(g: _Geometry, config: GemmConfig, twin_on: bool, programs: int):
    """The warp-specialized Gluon kernel: one persistent program per SM (at most one per tile)."""
    a_m_major, a_shape, a_strides, a_box = _descriptor_layout(
        g.x.name, g.x.shape, g.x.stride, 2, g.x.misalign, g.a_shape, g.a_stride, (config.block_m, config.block_k), "ws")
    b_k_major, b_shape, b_strides, b_box = _descriptor_layout(
        g.y.name, g.y.shape, g.y.stride, 2, g.y.misalign, g.b_shape, g.b_stride, (config.block_k, config.block_n), "ws")
    rows, cols, out_dtype, device = g.rows, g.cols, g.out_dtype, g.device
    # The epilogue by TMA store when C's rows are 16-byte aligned and its tile buffer fits beside the ring; else
    # from registers (the same values either way). Without it the kernel still takes descriptors: ones over a
    # tile-sized scratch.
    box = [config.block_m // consumers(config.num_warps), config.block_n]
    tma_store = ws_tma_store(config.block_m, config.block_n, config.block_k, config.num_stages, cols, g.out_bytes)
    scratch = None if tma_store else _ws_scratch_descriptor(device, box, out_dtype)
    c_shape, c_strides = [rows, cols], [cols, 1]
    static = dict(R=rows, C=cols, L=g.reduced, stride_cr=cols, stride_cc=1, op_id=_OP_IDS[g.op],
                  BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                  STAGES=config.num_stages, OUT_FP32=out_dtype == torch.float32, TWIN=twin_on,
                  A_M_MAJOR=a_m_major, B_K_MAJOR=b_k_major, CONSUMERS=consumers(config.num_warps), TMA_STORE=tma_store)
    # num_warps: the default partition (one consumer warpgroup); maxnreg: the register cap the roles share.
    options = dict(num_warps=4, maxnreg=max_regs(config.num_warps))
    template, (i_a, i_b, i_c, i_twin, i_cd, i_td) = _arg_list(
        det_gemm_ws_kernel, static, ("a_desc", "b_desc", "c_ptr", "twin_ptr", "c_desc", "twin_desc"))
    direct = DirectLaunch(det_gemm_ws_kernel, (programs,), options, device,
                          dynamic=(i_a, i_b, i_c, i_twin, i_cd, i_td))
    check = _storage_check(g)

    def launch(x, y, twin):
        check(x, y, twin)
        ensure_thread_cuda_context(device)
        c = torch.empty((rows, cols), dtype=out_dtype, device=device)
        store = c if twin is None else twin
        if direct.ready:  # the launcher encodes each descriptor from base, shape and strides
            a_desc, b_desc = host_descriptor(x, a_shape, a_strides), host_descriptor(y, b_shape, b_strides)
            if scratch is None:
                c_desc, twin_desc = host_descriptor(c, c_shape, c_strides), host_descriptor(store, c_shape, c_strides)
        else:  # the first launch specializes on real descriptors (block shapes and shared layouts)
            a_desc, b_desc = ws_descriptor(x, a_shape, a_strides, a_box), ws_descriptor(y, b_shape, b_strides, b_box)
            if scratch is None:
                c_desc = ws_descriptor(c, c_shape, c_strides, box)
                twin_desc = ws_descriptor(store, c_shape, c_strides, box)
        if scratch is not None:
            c_desc = twin_desc = scratch
        args = template.copy()
        args[i_a], args[i_b], args[i_c], args[i_twin] = a_desc, b_desc, c, store
        args[i_cd], args[i_td] = c_desc, twin_desc
        direct(args)
        return c
    return launch


def _fma_launch(g: _Geometry, config: GemmConfig, twin_on: bool, tiles: int):
    """The Gluon FMA-dot kernel (kernels/det_gemm/fma.py): TMA descriptors over each FP32 operand in its storage
    order, one program per output tile."""
    a_m_major, a_shape, a_strides, a_box = _descriptor_layout(
        g.x.name, g.x.shape, g.x.stride, 4, g.x.misalign, g.a_shape, g.a_stride, (config.block_m, config.block_k), "fma")
    b_k_major, b_shape, b_strides, b_box = _descriptor_layout(
        g.y.name, g.y.shape, g.y.stride, 4, g.y.misalign, g.b_shape, g.b_stride, (config.block_k, config.block_n), "fma")
    micro_m, micro_n, warps_m = fma_micro_tile(config.block_m, config.block_n, config.num_warps)
    rows, cols, device = g.rows, g.cols, g.device
    static = dict(R=rows, C=cols, L=g.reduced, stride_cr=cols, stride_cc=1, op_id=_OP_IDS[g.op],
                  BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                  STAGES=config.num_stages, MICRO_M=micro_m, MICRO_N=micro_n, WARPS_M=warps_m, TWIN=twin_on,
                  A_M_MAJOR=a_m_major, B_K_MAJOR=b_k_major, PRECISION="ieee")
    template, (i_a, i_b, i_c, i_twin) = _arg_list(det_gemm_fma_kernel, static, ("a_desc", "b_desc", "c_ptr", "twin_ptr"))
    direct = DirectLaunch(det_gemm_fma_kernel, (tiles,), fma_options(config.num_warps), device,
                          dynamic=(i_a, i_b, i_c, i_twin))
    check = _storage_check(g)

    def launch(x, y, twin):
        check(x, y, twin)
        ensure_thread_cuda_context(device)
        if direct.ready:  # the launcher encodes each descriptor from base, shape and strides
            a_desc, b_desc = host_descriptor(x, a_shape, a_strides), host_descriptor(y, b_shape, b_strides)
        else:  # the first launch specializes on real descriptors (block shapes and shared layouts)
            a_desc = fma_descriptor(x, a_shape, a_strides, a_box)
            b_desc = fma_descriptor(y, b_shape, b_strides, b_box)
        c = torch.empty((rows, cols), dtype=torch.float32, device=device)
        args = template.copy()
        args[i_a], args[i_b], args[i_c], args[i_twin] = a_desc, b_desc, c, c if twin is None else twin
        direct(args)
        return c
    return launch


def _launch(op: str, x, y, config, seg_len, out_dtype, twin_out, precision=None):
    _check_options(config, seg_len, out_dtype, precision)
    plan = _lookup(op, x, y, config, seg_len, out_dtype, twin_out, precision)
    return plan.launch(x, y, twin_out), plan.record


def det_gemm_fwd_launch(a: torch.Tensor, b: torch.Tensor, *, config: GemmConfig | None = None,
                        seg_len: int | None = None, out_dtype: torch.dtype | None = None,
                        twin_out: torch.Tensor | None = None, precision: str | None = None):
    """``a [M,K] @ b [K,N]`` -> (``[M,N]``, GemmLaunch). ``b`` may be ``weight.t()``. ``config``: a GemmConfig
    (None: the table's pick); ``seg_len``: FP32 segments of the reduction; ``out_dtype``: BF16 operands' output
    (None: BF16; FP32 operands give FP32); ``twin_out``: a second output that gets the same bits; ``precision``:
    FP32 operands' products, "ieee" (None) or "tf32"."""
    return _launch("fwd", a, b, config, seg_len, out_dtype, twin_out, precision)


def det_gemm_da_launch(dc: torch.Tensor, b: torch.Tensor, *, config: GemmConfig | None = None,
                       seg_len: int | None = None, out_dtype: torch.dtype | None = None,
                       twin_out: torch.Tensor | None = None, precision: str | None = None):
    """``dc [M,N] @ b[K,N].T`` -> (``[M,K]``, GemmLaunch)."""
    return _launch("da", dc, b, config, seg_len, out_dtype, twin_out, precision)


def det_gemm_db_launch(a: torch.Tensor, dc: torch.Tensor, *, config: GemmConfig | None = None,
                       seg_len: int | None = None, out_dtype: torch.dtype | None = None,
                       twin_out: torch.Tensor | None = None, precision: str | None = None):
    """``a[M,K].T @ dc [M,N]`` -> (``[K,N]``, GemmLaunch); reduces over M."""
    return _launch("db", a, dc, config, seg_len, out_dtype, twin_out, precision)


# The plain calls: BF16 operands -> BF16 output (one rounding); FP32 operands -> FP32 output, products at
# ``precision`` ("ieee" when None, "tf32" on request). A precision that is not a str of PRECISIONS is refused when
# the plan is built (it is part of the plan's key).
def det_gemm_fwd(a: torch.Tensor, b: torch.Tensor, precision: str | None = None) -> torch.Tensor:
    """``a [M,K] @ b [K,N] -> [M,N]`` (BF16 or FP32, as the operands), deterministic and batch-invariant."""
    return _lookup("fwd", a, b, None, None, None, None, precision).launch(a, b, None)


def det_gemm_da(dc: torch.Tensor, b: torch.Tensor, precision: str | None = None) -> torch.Tensor:
    """``dc [M,N] @ b.T -> [M,K]`` (the input gradient), deterministic and batch-invariant."""
    if (precision == "tf32" and _fp32_pair(dc, b) and dc.shape[1] == b.shape[1]
            and dc.shape[0] >= TF32_DA_TRANSPOSED_MIN_ROWS):
        return det_gemm_fwd(b, dc.t(), "tf32").t().contiguous()
    return _lookup("da", dc, b, None, None, None, None, precision).launch(dc, b, None)


def det_gemm_db(a: torch.Tensor, dc: torch.Tensor, precision: str | None = None) -> torch.Tensor:
    """``a.T @ dc -> [K,N]`` (the weight gradient), deterministic, fixed order over M."""
    if (precision == "tf32" and _fp32_pair(a, dc) and a.shape[0] == dc.shape[0]
            and a.shape[0] >= TF32_DB_TRANSPOSED_MIN_ROWS):
        return det_gemm_fwd(a.t(), dc.t().contiguous().t(), "tf32")
    return _lookup("db", a, dc, None, None, None, None, precision).launch(a, dc, None)


# "tf32" dA and dB as forward products. wgmma's TF32 form reads K-major operands only, and Triton transposes an
# operand whose reduced dim is strided through shared memory on every K step: 4-5x torch.matmul on dA and dB, whose
# reduced dims are (dA over N of nn.Linear's weight [N, K]; dB over M of both operands). As a forward product the
# strided operand is the MMA's A, which Triton feeds from registers: dA as (b @ dc.T).T, the [K, M] product copied
# to [M, K] (a copy of the small output), at M >= 1024 where that product's grid fills the GPU; dB as a.T @ dc with dc
# copied to its transpose (K-major as B), at M >= 128 (at M = 1 the direct kernel was faster). The same products in
# the same K steps: the GPU gave the direct kernels' bits, and the tests compare the two forms. At the lm_head 4096 x
# 151936 (reports/2026-12-07-h100-s34, call 6, one run) dA took 3.2x torch.matmul at M 1024 against the direct
# kernel's 5.1x, dB 1.7-1.8x against 4.7-5.4x at M 128-4096. The launchers (det_gemm_*_launch: a config, segments
# or a twin) keep the direct kernels.
TF32_DA_TRANSPOSED_MIN_ROWS = 1024
TF32_DB_TRANSPOSED_MIN_ROWS = 128


def _fp32_pair(x, y) -> bool:
    """Two non-empty 2-D FP32 tensors of one device: the operands the "tf32" forward-product forms take (anything else
    goes to the direct kernels, which refuse it by name)."""
    return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype == torch.float32
            and x.dim() == y.dim() == 2 and x.numel() > 0 and y.numel() > 0 and x.device == y.device
            and x.layout == y.layout == torch.strided)


LAUNCHERS = {"fwd": det_gemm_fwd_launch, "da": det_gemm_da_launch, "db": det_gemm_db_launch}
REFERENCES = {"fwd": det_gemm_fwd_ref, "da": det_gemm_da_ref, "db": det_gemm_db_ref}
SUPPORTED_BACKENDS = (CUDA_SM90, TRITON_INTERPRETER)
