"""Deterministic block-scaled FP8 (E4M3) MoE expert MLP (SwiGLU) for Hopper, forward and backward: the layer, its
autograd Function, the quantized-weight cache, the quantization-risk monitor and the pure-torch reference of the
recipe. The public API of the MoE FP8 layer is importable from here.

The same layer, routing and conventions as kernels/moe/layer.py (w1 [E, H, 2I] gate/up interleaved, w2 [E, I, H], 128-row
expert segments from kernels/moe/routing.py); the four data GEMMs run on FP8 operands with the SM90 recipe
(kernels/moe/fp8/quant.py): activations in 1x128 blocks along the reduced dim, weights in 128x128 blocks, power-of-two
FP32 scales, and the accumulator promoted to FP32 every 128 K (kernels/moe/fp8/kernels.py).

Stages (P = padded expert-sorted rows):
    quant   x [T, H] -> x_q, x_s (1x128 along H); dout likewise in the backward   (fp8_quant_rowwise)
    up      gu [P, 2I] bf16 = x_q[gather] @ W1q[e]; epilogue: h = silu(g) * u -> h [P, I] bf16 and
            h_q / h_s = quantize_rowwise(h) (1x128 along I, the down-projection's K): fused when the tile
            is 256 interleaved columns wide, else a row-wise pass over the stored h (the same bits)
    down    y [P, H] bf16 = h_q @ W2q[e] (FP32 accumulation, rounded once)
    combine out = bf16(sum_k s_k y_k) in FP32            (the BF16 layer's moe_combine)
    dgrad   dh = s * (dout_q[gather] @ W2q[e]^T) fp32; dg, du from the saved gu -> dgu [P, 2I] bf16 and,
            fused, dgu_q / dgu_s = quantize_rowwise(dgu) (1x128 along 2I, dX's K), and the dscore partials:
            (dout_q[gather] @ W2q[e]^T) * h summed in fixed groups of 16 columns (fp8_dscore_partials)
    dx      dx_route [P, H] bf16 = dgu_q @ W1q[e]^T, then the ascending-k gather-sum in FP32 (the BF16 layer's)
    wgrad   wgrad="fp8" (default): x[gather], dgu, h and dy = s * dout[gather] quantized 128x1 down the rows
            (moe_fp8_quant_colwise, transposed to K-major), then the weight gradient per expert with promotion
            every 128 rows (the Gluon kernel on sm_90, moe_fp8_wgrad_kernel elsewhere);
            wgrad="bf16": the BF16 layer's moe_wgrad_w1(x, dgu), moe_wgrad_w2(h, dout)
            (docs/moe_fp8.md: which is the default and why)
    dscore  the partials summed per route in a fixed order (the BF16 layer's moe_dscores_from_partials); y is not kept
The fused quantizations read the BF16 values that are stored beside them, so h_q == quantize_rowwise(h)
and dgu_q == quantize_rowwise(dgu) bit for bit (tested): one definition, one reference.

``Fp8WeightCache`` keeps the quantized weights keyed on (data_ptr, _version, shape, stride, dtype, device): an
in-place optimizer step bumps _version and so invalidates the entry. For CUDA graphs it also hands out static slots,
re-quantized in place by ``refresh()`` after an update.

Determinism: no split-K, no atomics, each output tile owned by one program, K blocks in ascending
order, configs pinned per backend (no autotune). Batch invariance (forward, per token): quantization
is per row, rows are never reduced together, and nothing depends on T or the routing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from detkit.kernels.moe.fp8.quant import (
    QBLOCK, Fp8Weight, dequantize_rowwise, quant_risk_rowwise, quant_risk_weight, quantize_colwise_ref,
    quantize_rowwise, quantize_rowwise_ref, quantize_weight, quantize_weight_ref,
)
from detkit.kernels.moe.checks import (
    check_dout, check_main_grads, check_moe_fp8_inputs, check_stage_range, check_wgrad_mode,
)
from detkit.kernels.moe.common import FP8_LAYER_STAGES, MoeGrads, fp8_stage_name, layer_stage_names
from detkit.kernels.moe.configs import DEFAULT_WGRAD, OTHER_WGRAD, WGRAD_MODES
from detkit.kernels.moe.fp8.configs import (
    FP8_STAGES, FP8_WGRAD_CONFIGS, MOE_FP8_CONFIG_TABLE_VERSION, MOE_FP8_CONFIGS, QUANT_COLWISE_CONFIGS, WGRAD_CONFIGS,
    select_moe_fp8_config,
)
from detkit.kernels.moe.fp8.kernels import moe_fp8_grouped_gemm_kernel
from detkit.kernels.moe.fp8.launch import (
    moe_fp8_dgrad, moe_fp8_dgrad_dswiglu, moe_fp8_down, moe_fp8_dx_route, moe_fp8_quant_colwise, moe_fp8_up_gemm,
    moe_fp8_up_swiglu, moe_fp8_wgrad, moe_fp8_wgrads, quantized_h,
)
from detkit.kernels.moe.launch import (
    launch_checked_routing, moe_combine, moe_dscores_from_partials, moe_gather_sum, moe_wgrad_w1, moe_wgrad_w2,
)
from detkit.kernels.moe.operands import check_gate_up
from detkit.kernels.moe.routing import MoeRouting, sync_checks_enabled

__all__ = [
    # the layer
    "WEIGHT_CACHE", "Fp8WeightCache", "MoeFp8Saved", "MoeMlpFp8Function", "moe_fp8_risk", "moe_mlp_fp8",
    "moe_mlp_fp8_bwd", "moe_mlp_fp8_fwd", "moe_mlp_fp8_ref",
    # its stages, configs and names (launch.py, configs.py, ../common.py)
    "DEFAULT_WGRAD", "FP8_LAYER_STAGES", "FP8_STAGES", "FP8_WGRAD_CONFIGS", "MOE_FP8_CONFIGS",
    "MOE_FP8_CONFIG_TABLE_VERSION", "OTHER_WGRAD", "QUANT_COLWISE_CONFIGS", "WGRAD_CONFIGS", "WGRAD_MODES",
    "fp8_stage_name", "moe_fp8_dgrad", "moe_fp8_dgrad_dswiglu", "moe_fp8_down", "moe_fp8_dx_route",
    "moe_fp8_grouped_gemm_kernel", "moe_fp8_quant_colwise", "moe_fp8_up_swiglu", "moe_fp8_wgrad", "moe_fp8_wgrads",
    "select_moe_fp8_config",
]


def _shares_memory(w: torch.Tensor, src: torch.Tensor) -> bool:
    return w.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()


@dataclass
class _Slot:
    source: torch.Tensor  # the tensor the slot is keyed on (a reference: its memory cannot be reused meanwhile)
    version: int  # source._version when fw was quantized
    fw: Fp8Weight
    weight: torch.Tensor | None  # the tensor quantized when it shares the source's memory (None: a copy, not kept)
    split: bool
    static: bool = False  # a captured CUDA graph reads fw's buffers: re-quantized in place, never evicted


class Fp8WeightCache:
    """Quantized weights, one slot per weight, valid for the weight's (data_ptr, _version, shape, stride, dtype,
    device). ``get(w, source=p)`` keys the slot on ``p`` instead (and on w's shape): the tensor ``w`` was made from on
    this call, a view or a converted copy of ``p`` (a fresh copy has a new address every call). An in-place update
    through autograd-visible ops (optimizer.step, ``w.add_`` under no_grad, ``load_state_dict``) bumps ``_version``:
    the next lookup misses and re-quantizes into the same slot (so stale versions never pile up); least recently
    used slots beyond ``capacity`` are dropped (size it to 2 x the MoE layers of a model). Writes through ``w.data``
    bypass the version counter: call ``clear()`` after those. Inference tensors have no version counter: they are
    quantized on every lookup. A slot holds a reference to its tensor, so its memory (and data_ptr) cannot be reused
    by another tensor.

    CUDA graphs: ``get_for_graph`` hands a graph being captured a slot's buffers (the weights quantized outside the
    graph) and marks the slot static. A replay reads those buffers as they are, so after a weight update call
    ``refresh()`` before replaying: it re-quantizes every stale static slot in place (same addresses). A lookup that
    misses on a static slot re-quantizes it in place too. ``clear()`` drops static slots as well: graphs captured on
    them must not be replayed afterwards."""

    def __init__(self, capacity: int = 128):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int; got {capacity!r}")
        self.capacity = capacity
        self._slots: OrderedDict[tuple, _Slot] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _key(w: torch.Tensor, src: torch.Tensor, split: bool) -> tuple:
        return (src.data_ptr(), tuple(src.shape), tuple(src.stride()), src.dtype, str(src.device), tuple(w.shape),
                tuple(w.stride()), split)

    def get(self, w: torch.Tensor, source: torch.Tensor | None = None, gate_up: str = "interleaved") -> Fp8Weight:
        """w's Fp8Weight (``gate_up="split"``: w1 held as split gate/up halves, quantized in the interleaved order)."""
        src = w if source is None else source
        split = gate_up == "split"
        if src.is_inference():
            self.misses += 1
            with torch.no_grad():
                return quantize_weight(w.detach(), split)
        key = self._key(w, src, split)
        slot = self._slots.get(key)
        if slot is not None and slot.version == src._version:
            self._slots.move_to_end(key)
            self.hits += 1
            return slot.fw
        self.misses += 1
        static = slot is not None and slot.static
        with torch.no_grad():
            fw = quantize_weight(w.detach(), split, out=slot.fw if static else None)
        # A static slot keeps the view refresh() re-quantizes from, even when this lookup came through a copy.
        view = w if _shares_memory(w, src) else (slot.weight if static else None)
        self._slots[key] = _Slot(src, src._version, fw, view, split, static)
        self._slots.move_to_end(key)
        evictable = [k for k, v in self._slots.items() if not v.static]
        while len(self._slots) > self.capacity and evictable:
            del self._slots[evictable.pop(0)]
        return fw

    def get_for_graph(self, w: torch.Tensor, source: torch.Tensor | None = None,
                      gate_up: str = "interleaved") -> Fp8Weight:
        """The slot's buffers, for a CUDA graph being captured to read instead of quantizing in the graph: the slot
        must hold the current version of the weights (quantized outside the graph, e.g. by a warm-up call), and w
        must share its source's memory (``refresh`` re-quantizes from it). Marks the slot static. Raises, naming
        what is missing, otherwise."""
        src = w if source is None else source
        split = gate_up == "split"
        if src.is_inference():
            raise ValueError(f"static FP8 weights need a weight with a version counter; the {tuple(src.shape)} source "
                             "is an inference tensor (made under torch.inference_mode)")
        if not _shares_memory(w, src):
            raise ValueError(f"static FP8 weights need w {tuple(w.shape)} to be a view of its source "
                             f"{tuple(src.shape)} (a copy would go stale unseen)")
        slot = self._slots.get(self._key(w, src, split))
        if slot is None or slot.version != src._version:
            state = "not quantized" if slot is None else "quantized at an older version"
            raise RuntimeError(f"the FP8 weights of a {tuple(src.shape)} weight are {state}: run the block once "
                               "outside the graph (a warm-up call) before capturing it")
        slot.static, slot.weight = True, w
        self.hits += 1
        return slot.fw

    def stale(self) -> int:
        """How many static slots (read by captured graphs) hold an older version than their weights."""
        return sum(1 for v in self._slots.values() if v.static and v.version != v.source._version)

    def refresh(self) -> int:
        """Re-quantize every stale static slot in place (its buffers keep their addresses, so captured graphs read
        the new weights) and drop the other stale slots; returns how many were re-quantized. Call after a weight
        update and before replaying a graph captured on static slots."""
        refreshed = 0
        for key, slot in list(self._slots.items()):
            if slot.version == slot.source._version:
                continue
            if not slot.static:
                del self._slots[key]
                continue
            with torch.no_grad():
                quantize_weight(slot.weight.detach(), slot.split, out=slot.fw)
            slot.version = slot.source._version
            refreshed += 1
        return refreshed

    def clear(self) -> None:
        self._slots.clear()

    def __len__(self) -> int:
        return len(self._slots)


WEIGHT_CACHE = Fp8WeightCache()


def check_weight_cache(weight_cache) -> None:
    if weight_cache is not None and not isinstance(weight_cache, Fp8WeightCache):
        raise TypeError(f"weight_cache must be an Fp8WeightCache or None; got {type(weight_cache).__name__}")


@dataclass
class MoeFp8Saved:
    """What the backward needs: gu, h bf16 (h for dW2; the dscores come from the dgrad's accumulator and gu, so y is
    not kept); the FP8 weights used."""

    backend: str
    routing: MoeRouting
    x: torch.Tensor  # [T, H] bf16 (the BF16 dW1)
    w1: torch.Tensor
    w2: torch.Tensor
    w1f: Fp8Weight
    w2f: Fp8Weight
    scores: torch.Tensor  # [T, K]
    gu: torch.Tensor  # [P, 2I] bf16 interleaved
    h: torch.Tensor  # [P, I] bf16
    h_q: torch.Tensor  # [P, I] e4m3 and its scales [P, I/128]: the down-projection's operand (audits)
    h_s: torch.Tensor
    gate_up: str = "interleaved"  # w1's column layout


def _names(x: torch.Tensor, w1: torch.Tensor, k: int) -> Mapping[str, str]:
    return layer_stage_names(x, w1, k, FP8_LAYER_STAGES, "fp8")


def moe_mlp_fp8_fwd(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                    scores: torch.Tensor, *, stage_range=None,
                    weight_cache: Fp8WeightCache | None = WEIGHT_CACHE,
                    gate_up: str = "interleaved") -> tuple[torch.Tensor, MoeFp8Saved]:
    """out [T, H] bf16 and the saved state for ``moe_mlp_fp8_bwd``. Inputs as ``kernels.moe.moe_mlp_fwd``
    (BF16 x and weights, w1's columns in the ``gate_up`` layout), with H and I multiples of 128.
    ``weight_cache=None`` quantizes the weights on every call."""
    check_stage_range(stage_range)
    check_weight_cache(weight_cache)
    check_gate_up(gate_up)
    backend = check_moe_fp8_inputs(x, w1, w2, topk_ids, scores)
    rng = stage_range or (lambda name: nullcontext())
    names = _names(x, w1, topk_ids.shape[1])
    with rng(names["routing"]):
        pending = launch_checked_routing(x, w1, topk_ids, scores)
    with rng(names["weights"]):
        split = gate_up == "split"
        w1f = weight_cache.get(w1, gate_up=gate_up) if weight_cache is not None else quantize_weight(w1, split)
        w2f = weight_cache.get(w2) if weight_cache is not None else quantize_weight(w2)
    with rng(names["quant_x"]):
        x_q, x_s = quantize_rowwise(x)
    with rng(names["up_swiglu"]):  # over the largest P, gated on the device
        gu, h, h_q, h_s = moe_fp8_up_gemm(x_q, x_s, w1f, pending.bound, backend)
    routing = pending.bound  # every stage runs over the bound, gated on the device: no host read
    if sync_checks_enabled():  # the validating mode: one host read refuses a bad batch, then the exact P
        with rng(names["routing"]):
            routing = pending.finish()  # the up GEMM computed nothing from a refused batch
            p = routing.padded_rows
            gu, h = gu[:p], h[:p]
            h_q, h_s = (None, None) if h_q is None else (h_q[:p], h_s[:p])
    with rng(names["up_swiglu"]):
        h_q, h_s = quantized_h(h, h_q, h_s, routing)
    with rng(names["down"]):
        y = moe_fp8_down(h_q, h_s, w2f, routing, backend)
    with rng(names["combine"]):
        out = moe_combine(y, routing, scores, backend)
    return out, MoeFp8Saved(backend, routing, x, w1, w2, w1f, w2f, scores, gu, h, h_q, h_s, gate_up)


def moe_mlp_fp8_bwd(dout: torch.Tensor, saved: MoeFp8Saved, *, main_grads=None, stage_range=None,
                    wgrad: str = DEFAULT_WGRAD) -> MoeGrads:
    """Gradients of ``moe_mlp_fp8_fwd`` for dout [T, H] bf16: dX through FP8 data GEMMs, dW1/dW2 by the
    ``wgrad`` mode ("fp8", the default: 128x1 column-wise FP8 operands; "bf16": the BF16 layer's kernel) as BF16 or
    FP32 accumulation into ``main_grads``, dscores = (dout_q[t] @ W2q[e]^T) . h from the dgrad's accumulator."""
    if not isinstance(saved, MoeFp8Saved):
        raise TypeError(f"saved must be the MoeFp8Saved of moe_mlp_fp8_fwd; got {type(saved).__name__}")
    check_wgrad_mode(wgrad)
    check_stage_range(stage_range)
    check_dout(dout, saved.x)
    check_main_grads(main_grads, saved.w1, saved.w2)
    rng = stage_range or (lambda name: nullcontext())
    names = _names(saved.x, saved.w1, saved.routing.top_k)
    backend, routing = saved.backend, saved.routing
    with rng(names["quant_dout"]):
        dout_q, dout_s = quantize_rowwise(dout)
    with rng(names["dgrad_dswiglu"]):
        dgu, dgu_q, dgu_s, ds_part = moe_fp8_dgrad(dout_q, dout_s, saved.w2f, saved.gu, routing, backend, h=saved.h)
    with rng(names["dx"]):
        dx = moe_gather_sum(moe_fp8_dx_route(dgu_q, dgu_s, saved.w1f, routing, backend), routing, backend)
    with rng(names["wgrad"]):
        if wgrad == "fp8":
            dw1, dw2 = moe_fp8_wgrads(saved.x, saved.h, dgu, dout, routing, backend, main_grads,
                                      gate_up=saved.gate_up, like=(saved.w1, saved.w2))
        else:
            mg1, mg2 = main_grads if main_grads is not None else (None, None)
            dw1 = moe_wgrad_w1(saved.x, dgu, routing, backend, mg1, config=WGRAD_CONFIGS[backend],
                               gate_up=saved.gate_up, like=saved.w1)
            dw2 = moe_wgrad_w2(saved.h, dout, routing, backend, mg2, config=WGRAD_CONFIGS[backend], like=saved.w2)
    with rng(names["dscores"]):
        ds = moe_dscores_from_partials(ds_part, routing, backend).to(saved.scores.dtype)
    return MoeGrads(dx, dw1, dw2, ds)


class MoeMlpFp8Function(torch.autograd.Function):
    """autograd wrapper: (x, w1, w2, topk_ids, scores, main_grad_w1, main_grad_w2, weight_cache, wgrad, gate_up) ->
    out."""

    @staticmethod
    def forward(ctx, x, w1, w2, topk_ids, scores, main_grad_w1=None, main_grad_w2=None, weight_cache=WEIGHT_CACHE,
                wgrad=DEFAULT_WGRAD, gate_up="interleaved"):
        main_grads = None if main_grad_w1 is None and main_grad_w2 is None else (main_grad_w1, main_grad_w2)
        check_main_grads(main_grads, w1, w2)
        check_wgrad_mode(wgrad)
        check_weight_cache(weight_cache)
        ctx.wgrad = wgrad
        out, saved = moe_mlp_fp8_fwd(x, w1, w2, topk_ids, scores, weight_cache=weight_cache, gate_up=gate_up)
        ctx.saved = saved
        ctx.main_grads = main_grads
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = moe_mlp_fp8_bwd(dout, ctx.saved, main_grads=ctx.main_grads, wgrad=ctx.wgrad)
        ctx.saved = None
        return grads.dx, grads.dw1, grads.dw2, None, grads.dscores, None, None, None, None, None


def moe_mlp_fp8(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, scores: torch.Tensor,
                main_grads: tuple[torch.Tensor, torch.Tensor] | None = None,
                weight_cache: Fp8WeightCache | None = WEIGHT_CACHE, wgrad: str = DEFAULT_WGRAD, *,
                gate_up: str = "interleaved") -> torch.Tensor:
    """Differentiable deterministic FP8 MoE expert MLP (the BF16 path's API, ``kernels.moe.moe_mlp``, ``gate_up``
    included: split halves are quantized in the interleaved order, the same bits as on an interleaved copy);
    ``wgrad`` picks the weight-gradient GEMMs: "fp8" (default: it passes the precision gate and is faster,
    docs/moe_fp8.md) or "bf16"."""
    check_gate_up(gate_up)
    check_main_grads(main_grads, w1, w2)
    check_weight_cache(weight_cache)
    check_wgrad_mode(wgrad)
    mg1, mg2 = main_grads if main_grads is not None else (None, None)
    return MoeMlpFp8Function.apply(x, w1, w2, topk_ids, scores, mg1, mg2, weight_cache, wgrad, gate_up)


def moe_fp8_risk(saved: MoeFp8Saved, dout: torch.Tensor | None = None) -> dict[str, dict]:
    """The quantization-risk statistics (detkit.kernels.moe.fp8.quant.quant_risk) of every quantized tensor of a run:
    x, w1, w2, h (valid rows) and, with ``dout``, dout and dgu."""
    valid = (saved.routing.sorted_route >= 0).nonzero().squeeze(1)
    risk = {"x": quant_risk_rowwise(saved.x), "w1": quant_risk_weight(saved.w1), "w2": quant_risk_weight(saved.w2),
            "h": quant_risk_rowwise(saved.h[valid])}
    if dout is not None:
        dout_q, dout_s = quantize_rowwise(dout)
        dgu = moe_fp8_dgrad_dswiglu(dout_q, dout_s, saved.w2f, saved.gu, saved.routing, saved.backend)[0]
        risk["dout"] = quant_risk_rowwise(dout)
        risk["dgu"] = quant_risk_rowwise(dgu[valid])
    return risk


def _colwise_dequantized(v: torch.Tensor) -> torch.Tensor:
    """v [n, N] quantized in 128x1 blocks down its columns (rows zero-padded to a multiple of 128, as an
    expert's segment is), dequantized: [n, N] fp32."""
    pad = -v.shape[0] % QBLOCK
    q, s = quantize_colwise_ref(torch.cat([v.float(), v.new_zeros(pad, v.shape[1], dtype=torch.float32)]))
    return dequantize_rowwise(q, s).t()[:v.shape[0]]


def moe_mlp_fp8_ref(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                    scores: torch.Tensor, dout: torch.Tensor | None = None,
                    wgrad: str = DEFAULT_WGRAD) -> dict[str, torch.Tensor]:
    """The FP8 recipe in plain torch: the same quantizers (references), every GEMM and activation in FP64
    on the dequantized operands, BF16 roundings where the kernels round (gu, h, y, out, dgu, dx_route, dx, dW), and
    h / dgu quantized from their BF16 values. It differs from the kernels only by FP32 accumulation and
    the activation's exp, which can move a BF16 rounding (and then an E4M3 one) by one unit."""
    check_wgrad_mode(wgrad)
    f64, bf16 = torch.float64, torch.bfloat16
    xq, xs = quantize_rowwise_ref(x)
    x_d = dequantize_rowwise(xq, xs).to(f64)
    w1_d = quantize_weight_ref(w1).dequantize().to(f64)
    w2_d = quantize_weight_ref(w2).dequantize().to(f64)
    t_count, k_count = topk_ids.shape
    hidden = x.shape[1]
    out = torch.zeros(t_count, hidden, dtype=f64, device=x.device)
    ys, saved = torch.zeros(t_count, k_count, hidden, dtype=f64, device=x.device), {}
    for e in range(w1.shape[0]):
        tok, kk = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = (x_d[tok] @ w1_d[e]).to(bf16)
        g, u = gu[:, 0::2].to(f64), gu[:, 1::2].to(f64)
        h = (torch.nn.functional.silu(g) * u).to(bf16)
        hq, hs = quantize_rowwise_ref(h)
        ys[tok, kk] = (dequantize_rowwise(hq, hs).to(f64) @ w2_d[e]).to(bf16).to(f64)  # y rounded, as the down GEMM
        saved[e] = (tok, kk, gu, h)
    s64 = scores.to(f64)
    for k in range(k_count):  # ascending k, as the combine
        out += s64[:, k, None] * ys[:, k]
    result = {"out": out.to(bf16)}
    if dout is None:
        return result
    dq, ds_ = quantize_rowwise_ref(dout)
    dout_d = dequantize_rowwise(dq, ds_).to(f64)
    dx = torch.zeros(t_count, hidden, dtype=f64, device=x.device)
    dw1 = torch.zeros(w1.shape, dtype=f64, device=x.device)
    dw2 = torch.zeros(w2.shape, dtype=f64, device=x.device)
    dscores = torch.zeros(t_count, k_count, dtype=f64, device=x.device)  # 0 for masked routes
    for e, (tok, kk, gu, h) in saved.items():
        s = s64[tok, kk][:, None]
        dh_raw = dout_d[tok] @ w2_d[e].t()
        dscores[tok, kk] = (dh_raw * h.to(f64)).sum(1)  # (dout_q @ W2q^T) . h, as the dgrad's fused partials
        dh = s * dh_raw
        g, u = gu[:, 0::2].to(f64), gu[:, 1::2].to(f64)
        sig = torch.sigmoid(g)
        dgu = torch.stack((dh * u * sig * (1 + g * (1 - sig)), dh * g * sig), dim=2).flatten(1).to(bf16)
        gq, gs = quantize_rowwise_ref(dgu)
        dx.index_add_(0, tok, (dequantize_rowwise(gq, gs).to(f64) @ w1_d[e].t()).to(bf16).to(f64))  # dx_route rounded
        if wgrad == "fp8":  # every operand 128x1 along the expert's rows; dy = s * dout in FP32
            dy = scores.float()[tok, kk][:, None] * dout[tok].float()
            dw1[e] = _colwise_dequantized(x[tok]).to(f64).t() @ _colwise_dequantized(dgu).to(f64)
            dw2[e] = _colwise_dequantized(h).to(f64).t() @ _colwise_dequantized(dy).to(f64)
        else:
            dw1[e] = x[tok].to(f64).t() @ dgu.to(f64)
            dw2[e] = h.to(f64).t() @ (s.float() * dout[tok].float()).to(bf16).to(f64)
    result.update({"dx": dx.to(bf16), "dw1": dw1.to(bf16), "dw2": dw2.to(bf16), "dscores": dscores.to(scores.dtype)})
    return result
