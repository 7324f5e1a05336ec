"""The FP8 MoE stages' launch wrappers: check, allocate, launch (kernels/moe/fp8/kernels.py for Triton,
kernels/moe_fp8_ws*.py for the Gluon "ws" kernels), with the table's pick per stage (kernels/moe/fp8/configs.py) unless
an explicit config is given. The FP8 layer (kernels/moe/fp8/layer.py) runs these for its four data GEMMs and its FP8
weight gradients; routing, combine, gather-sum and dscores are the BF16 layer's (kernels/moe/launch.py).

Layouts: every FP8 operand is K-major (the reduced dim contiguous), as Hopper's FP8 wgmma requires. A weight is
quantized once into both orientations (``Fp8Weight.q`` [E, R, C] and ``q_t`` [E, C, R], the same FP8 values): the
forward reads W1q_t [E, 2I, H] and W2q_t [E, H, I], the backward W2q [E, I, H] and W1q [E, H, 2I].
"""

from __future__ import annotations

import torch
import triton

from detkit.kernels.backend import TRITON_INTERPRETER, PlannedKernel, ensure_cuda_context
from detkit.kernels.det_gemm.launch import GemmConfig, interpreter_step_k, tma_descriptor
from detkit.kernels.moe.fp8.quant import FP8_DTYPE, QBLOCK, Fp8Weight, quantize_rowwise
from detkit.kernels.moe.common import DS_GROUP, EPI_FP8_DSWIGLU_QUANT, EPI_FP8_SWIGLU, EPI_FP8_SWIGLU_QUANT, EPI_PLAIN
from detkit.kernels.moe.configs import check_grouped_config, check_moe_variant
from detkit.kernels.moe.fp8.colwise_sm90 import launch_quant_colwise_sm90
from detkit.kernels.moe.fp8.configs import FP8_WGRAD_CONFIGS, QUANT_COLWISE_CONFIGS, select_moe_fp8_config
from detkit.kernels.moe.fp8.kernels import (
    moe_fp8_grouped_gemm_kernel, moe_fp8_quant_colwise_kernel, moe_fp8_wgrad_kernel,
)
from detkit.kernels.moe.fp8.ws import launch_fp8_wgrad_ws, launch_fp8_ws
from detkit.kernels.moe.fp8.ws_gather import launch_fp8_ws_gather
from detkit.kernels.moe.gluon_blocks import check_ws_backend
from detkit.kernels.moe.launch import split_copy, weight_grad_buffer
from detkit.kernels.moe.operands import weight_descriptor
from detkit.kernels.moe.routing import SEGMENT_ALIGN, MoeRouting


_moe_fp8_grouped_gemm_kernel_planned = PlannedKernel(moe_fp8_grouped_gemm_kernel)


def _grouped(op_id: int, stage: str, a: torch.Tensor, a_s: torch.Tensor, gather: bool, b: torch.Tensor,
             b_s: torch.Tensor, c: torch.Tensor, aux: torch.Tensor | None, q: torch.Tensor | None,
             q_s: torch.Tensor | None, routing: MoeRouting, epilogue: int, backend: str,
             config: GemmConfig | None, dscore: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """b: [E, C, L] K-major FP8 view; b_s: [E, L/128, C/128] view (strides kept); ``dscore = (h, ds_part)`` (dgrad):
    the dscore partials [P, C / DS_GROUP] are written too, from the forward's h [P, C]."""
    config = config or select_moe_fp8_config(stage, backend)
    if config.variant == "ws":
        _check_ws_stage(stage, config, gather, epilogue)
    else:
        check_grouped_config(stage, config)
    if QBLOCK % config.block_k:
        raise ValueError(f"{stage}: BLOCK_K {config.block_k} must divide the FP8 block {QBLOCK}")
    if QBLOCK % config.block_n and config.block_n != 2 * QBLOCK:  # a tile spans one or two weight-scale blocks
        raise ValueError(f"{stage}: BLOCK_N {config.block_n} must divide the FP8 block {QBLOCK} or be {2 * QBLOCK}")
    want_n = {EPI_FP8_SWIGLU_QUANT: (2 * QBLOCK,), EPI_FP8_DSWIGLU_QUANT: (QBLOCK // 2, QBLOCK)}.get(epilogue)
    if want_n is not None and config.block_n not in want_n:
        raise ValueError(f"{stage}: the fused 1x{QBLOCK} quantization needs BLOCK_N in {want_n}; got {config.block_n}")
    if dscore is not None and config.block_n % 64:
        raise ValueError(f"{stage}: the dscore partials sum 64-column chunks: BLOCK_N must be a multiple of 64; got "
                         f"{config.block_n}")
    p = routing.padded_rows
    if config.variant == "ws":  # the Gluon kernels (kernels/moe_fp8_ws*.py): sm_90
        if gather:
            outputs = ({"gu": c, "h": aux} if epilogue == EPI_FP8_SWIGLU else
                       {"score": routing.row_score, "gu": aux, "dgu": c, "dgu_q": q, "dgu_s": q_s})
            if dscore is not None:
                outputs["h"], outputs["ds_part"] = dscore
            launch_fp8_ws_gather(op_id, stage, config, epilogue, a, a_s, b, b_s, outputs, routing.gather_token,
                                 routing.sorted_route, routing.tile_expert, routing.gate, p, SEGMENT_ALIGN, backend)
        else:
            launch_fp8_ws(op_id, stage, config, a, a_s, b, b_s, c, routing.sorted_route, routing.tile_expert,
                          routing.gate, p, SEGMENT_ALIGN, backend)
        return
    if p == 0:
        return
    n_cols, reduced = b.shape[1], b.shape[2]
    aux_t = aux if aux is not None else c
    q_t = q if q is not None else a
    qs_t = q_s if q_s is not None else a_s
    interpreted = backend == TRITON_INTERPRETER
    step_k = interpreter_step_k(config) if interpreted else config.block_k
    b_arg = b
    if config.variant == "tma":  # FP8 weights are always K-major and 16-byte aligned: TMA can address them
        b_arg, k_major = weight_descriptor(b.transpose(1, 2), config.block_n, step_k)
        if not k_major:
            raise ValueError(f"{stage}: variant 'tma' needs the K-major FP8 weight [E, C, L]; got strides {b.stride()}")
    grid = (triton.cdiv(p, config.block_m) * triton.cdiv(n_cols, config.block_n),)
    _moe_fp8_grouped_gemm_kernel_planned[grid](
        a, a_s, routing.gather_token, b_arg, b_s, c, aux_t, q_t, qs_t,
        routing.sorted_route, routing.row_score, routing.tile_expert, routing.gate,
        *(dscore if dscore is not None else (c, c)),
        p, n_cols, reduced,
        a.stride(0), a.stride(1), a_s.stride(0), a_s.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        b_s.stride(0), b_s.stride(1), b_s.stride(2),
        c.stride(0), c.stride(1),
        aux_t.stride(0), aux_t.stride(1),
        q_t.stride(0), q_t.stride(1), qs_t.stride(0), qs_t.stride(1),
        op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        STEP_K=step_k, QBLOCK=QBLOCK, SEGMENT=SEGMENT_ALIGN, GATHER_A=gather, EPILOGUE=epilogue,
        INTERPRETED=interpreted, B_TMA=config.variant == "tma", GROUP_M=config.group_m, DSCORE=dscore is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def _check_ws_stage(stage: str, config: GemmConfig, gather: bool, epilogue: int) -> None:
    """Variant "ws" (kernels/moe_fp8_ws*.py): the stages the Gluon kernels cover, with 64 rows per consumer
    warpgroup. The launchers check the rest, then the backend (sm_90 only)."""
    if (gather, epilogue) not in ((False, EPI_PLAIN), (True, EPI_FP8_SWIGLU), (True, EPI_FP8_DSWIGLU_QUANT)):
        raise ValueError(f"{stage}: variant 'ws' covers down, dX, the up-projection with h quantized by the row-wise "
                         "pass (BLOCK_N 128), dgrad (BLOCK_N 64 or 128) and the FP8 weight gradient; use a 'ptr' or 'tma' "
                         "config for the fused up tile")
    # Two warpgroups on 128-row tiles (64 rows each), or one on 64-row tiles.
    if config.block_m != 64 * (config.num_warps // 4):
        raise ValueError(f"{stage}: variant 'ws' gives each consumer warpgroup (4 warps) 64 rows: BLOCK_M 64 with 4 "
                         f"warps or 128 with 8; got BLOCK_M {config.block_m}, {config.num_warps} warps")


def moe_fp8_up_swiglu(x_q: torch.Tensor, x_s: torch.Tensor, w1f: Fp8Weight, routing: MoeRouting, backend: str,
                      config: GemmConfig | None = None):
    """gu [P, 2I] bf16 = x_q[gather] @ W1q[e]; h [P, I] bf16 = silu(g) * u; h_q [P, I] e4m3, h_s [P, I/128].

    h_q, h_s = quantize_rowwise(h) either way: fused into the epilogue when the tile is 2 x 128 interleaved
    columns wide (its h is one 1x128 block per row), else by the row-wise quantizer over the stored h."""
    gu, h, h_q, h_s = moe_fp8_up_gemm(x_q, x_s, w1f, routing, backend, config)
    return (gu, h, *quantized_h(h, h_q, h_s, routing))


def moe_fp8_up_gemm(x_q: torch.Tensor, x_s: torch.Tensor, w1f: Fp8Weight, routing: MoeRouting, backend: str,
                    config: GemmConfig | None = None):
    """The up GEMM of ``moe_fp8_up_swiglu`` over ``routing`` (an exact one, or a PendingRouting's bound: the
    kernels then skip every tile past the P on the device): gu, h, and h_q, h_s when the tile quantizes h in its
    epilogue (else None: ``quantized_h``)."""
    config = config or select_moe_fp8_config("up", backend)
    p, two_i = routing.padded_rows, w1f.q.shape[2]
    dev = x_q.device
    gu = torch.empty((p, two_i), dtype=torch.bfloat16, device=dev)
    h = torch.empty((p, two_i // 2), dtype=torch.bfloat16, device=dev)
    h_q = h_s = None
    fused = config.block_n == 2 * QBLOCK
    if fused:
        h_q = torch.empty((p, two_i // 2), dtype=FP8_DTYPE, device=dev)
        h_s = torch.empty((p, two_i // 2 // QBLOCK), dtype=torch.float32, device=dev)
    _grouped(0, "up", x_q, x_s, True, w1f.q_t, w1f.scale, gu, h, h_q, h_s, routing,
             EPI_FP8_SWIGLU_QUANT if fused else EPI_FP8_SWIGLU, backend, config)
    return gu, h, h_q, h_s


def quantized_h(h: torch.Tensor, h_q: torch.Tensor | None, h_s: torch.Tensor | None,
                routing: MoeRouting | None = None):
    """h_q, h_s: the up epilogue's, else the row-wise pass over the stored h (empty at P = 0: the pass refuses an
    empty h); with ``routing``, only its rows below P (the gate, read on the device)."""
    if h_q is not None:
        return h_q, h_s
    if h.shape[0] == 0:
        return (torch.empty(h.shape, dtype=FP8_DTYPE, device=h.device),
                torch.empty((0, h.shape[1] // QBLOCK), dtype=torch.float32, device=h.device))
    return quantize_rowwise(h, None if routing is None else routing.gate)


def moe_fp8_down(h_q: torch.Tensor, h_s: torch.Tensor, w2f: Fp8Weight, routing: MoeRouting, backend: str,
                 config: GemmConfig | None = None) -> torch.Tensor:
    """y [P, H] bf16 = h_q @ W2q[e] (FP32 accumulation, rounded once; the combine sums in FP32 and rounds again:
    half the bytes of an FP32 y to write and to read back)."""
    y = torch.empty((routing.padded_rows, w2f.q.shape[2]), dtype=torch.bfloat16, device=h_q.device)
    _grouped(1, "down", h_q, h_s, False, w2f.q_t, w2f.scale, y, None, None, None, routing, EPI_PLAIN, backend, config)
    return y


def moe_fp8_dgrad(dout_q: torch.Tensor, dout_s: torch.Tensor, w2f: Fp8Weight, gu: torch.Tensor, routing: MoeRouting,
                  backend: str, config: GemmConfig | None = None, h: torch.Tensor | None = None):
    """dgu [P, 2I] bf16: dSwiGLU of dh = s * (dout_q[gather] @ W2q[e]^T); dgu_q e4m3, dgu_s [P, 2I/128]; with the
    forward's ``h`` [P, I], from the same accumulator the dscore partials ds_part [P, I/16] FP32
    (``fp8_dscore_partials``: (dout_q[gather] @ W2q[e]^T) * h in fixed groups of 16 columns), else None."""
    p, two_i = gu.shape
    if h is not None and (h.shape != (p, two_i // 2) or not h.is_contiguous()):
        raise ValueError(f"dgrad: h must be the forward's contiguous [P, I] = [{p}, {two_i // 2}]; got "
                         f"{tuple(h.shape)} with strides {h.stride()}")
    dgu = torch.empty_like(gu)
    dgu_q = torch.empty((p, two_i), dtype=FP8_DTYPE, device=gu.device)
    dgu_s = torch.empty((p, two_i // QBLOCK), dtype=torch.float32, device=gu.device)
    ds_part = None if h is None else torch.empty((p, two_i // 2 // DS_GROUP.value), dtype=torch.float32,
                                                 device=gu.device)
    # B = W2[e]^T [K=H, N=I]: K-major storage is W2q itself [E, I, H]; its scales seen as [E, H/128, I/128].
    _grouped(2, "dgrad", dout_q, dout_s, True, w2f.q, w2f.scale.transpose(1, 2), dgu, gu, dgu_q, dgu_s, routing,
             EPI_FP8_DSWIGLU_QUANT, backend, config, None if h is None else (h, ds_part))
    return dgu, dgu_q, dgu_s, ds_part


def moe_fp8_dgrad_dswiglu(dout_q: torch.Tensor, dout_s: torch.Tensor, w2f: Fp8Weight, gu: torch.Tensor,
                          routing: MoeRouting, backend: str, config: GemmConfig | None = None):
    """``moe_fp8_dgrad`` without the dscore partials: (dgu, dgu_q, dgu_s)."""
    return moe_fp8_dgrad(dout_q, dout_s, w2f, gu, routing, backend, config)[:3]


def moe_fp8_dx_route(dgu_q: torch.Tensor, dgu_s: torch.Tensor, w1f: Fp8Weight, routing: MoeRouting, backend: str,
                     config: GemmConfig | None = None) -> torch.Tensor:
    """dx_route [P, H] bf16 = dgu_q @ W1q[e]^T (FP32 accumulation, rounded once; the gather-sum sums in FP32)."""
    dxr = torch.empty((routing.padded_rows, w1f.q.shape[1]), dtype=torch.bfloat16, device=dgu_q.device)
    _grouped(3, "dx", dgu_q, dgu_s, False, w1f.q, w1f.scale.transpose(1, 2), dxr, None, None, None, routing,
             EPI_PLAIN, backend, config)
    return dxr


_moe_fp8_quant_colwise_kernel_planned = PlannedKernel(moe_fp8_quant_colwise_kernel)


def moe_fp8_quant_colwise(src: torch.Tensor, routing: MoeRouting, backend: str, gather: bool,
                          scale: bool, config: GemmConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-wise (128x1) quantization of the expert-sorted rows v [P, N] (v[p] = src[gather_token[p]] when
    ``gather``, times row_score[p] when ``scale``): q_t [N, P] e4m3 (K-major for a GEMM over the rows),
    scales [N, P/128] (stored [P/128, N]: a 128-row block's scales of consecutive columns are adjacent, as the
    weight gradients read them). A 128-row block never straddles two experts (128-aligned segments)."""
    p, n = routing.padded_rows, src.shape[1]
    q = torch.empty((n, p), dtype=FP8_DTYPE, device=src.device)
    s = torch.empty((p // QBLOCK, n), dtype=torch.float32, device=src.device).t()
    if p == 0:
        return q, s
    config = config or QUANT_COLWISE_CONFIGS[backend]
    if config.block_m != QBLOCK:
        raise ValueError(f"quant_colwise: block_m must be the scale block {QBLOCK} (one scale per column per "
                         f"program); got {config.block_m}")
    if config.variant == "ws":
        launch_quant_colwise_sm90(config, src, routing.gather_token, routing.sorted_route, routing.row_score,
                                  routing.gate, q, s, routing.num_tiles, gather, scale, backend,
                                  experts=routing.num_experts)
        return q, s
    check_moe_variant("quant_colwise", config)
    cols = config.block_n
    _moe_fp8_quant_colwise_kernel_planned[(routing.num_tiles * triton.cdiv(n, cols),)](
        src, routing.gather_token, routing.sorted_route, routing.row_score, routing.gate, q, s, p, n,
        src.stride(0), src.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
        BLOCK_N=cols, QBLOCK=QBLOCK, GATHER=gather, SCALE=scale, INTERPRETED=backend == TRITON_INTERPRETER,
        num_warps=config.num_warps,
    )
    return q, s


_moe_fp8_wgrad_kernel_planned = PlannedKernel(moe_fp8_wgrad_kernel)


def moe_fp8_wgrad(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
                  routing: MoeRouting, backend: str, main_grad: torch.Tensor | None = None,
                  config: GemmConfig | None = None) -> torch.Tensor | None:
    """dW[e] [R, C] = sum over e's rows of A^T B from column-wise FP8 operands a_q [R, P], b_q [C, P]
    (scales [R, P/128], [C, P/128]), per-128-row promotion; BF16, or main_grad += it in FP32 (None)."""
    config = config or FP8_WGRAD_CONFIGS[backend]
    if config.variant == "ws":
        _check_ws_stage("wgrad", config, False, EPI_PLAIN)
    else:
        check_moe_variant("wgrad", config)
    if QBLOCK % config.block_k:
        raise ValueError(f"wgrad: BLOCK_K {config.block_k} must divide the FP8 block {QBLOCK}")
    experts, (r, c) = routing.num_experts, (a_q.shape[0], b_q.shape[0])
    interpreted = backend == TRITON_INTERPRETER
    step_k = interpreter_step_k(config) if interpreted else config.block_k
    if a_q.shape[1] == 0:  # no routed rows (T = 0): dW = 0, and TMA cannot describe an empty operand
        if config.variant == "ws":
            check_ws_backend("wgrad", backend)
        return None if main_grad is not None else torch.zeros((experts, r, c), dtype=torch.bfloat16, device=a_q.device)
    out = main_grad if main_grad is not None else torch.empty((experts, r, c), dtype=torch.bfloat16, device=a_q.device)
    if config.variant == "ws":
        launch_fp8_wgrad_ws(config, a_q, a_s, b_q, b_s, out, main_grad is not None, routing.expert_offsets,
                            routing.expert_counts, routing.gate, experts, backend)
        return None if main_grad is not None else out
    a_arg, b_arg = a_q, b_q
    if config.variant == "tma":  # the column-wise quantizer's [rows, P] outputs; anything else is refused by name
        (a_arg, a_t), (b_arg, b_t) = (tma_descriptor(name, t, t, (blk, step_k)) for name, t, blk in
                                      (("a_q", a_q, config.block_m), ("b_q", b_q, config.block_n)))
        if a_t or b_t:  # the kernel reads [rows, STEP_K] boxes: rows-major storage only
            raise ValueError(f"wgrad: variant 'tma' needs a_q and b_q with unit-stride rows; got strides "
                             f"{a_q.stride()} and {b_q.stride()}; use a 'ptr' config")
        if a_q.is_cuda:
            ensure_cuda_context(a_q.device)
    grid = (experts * triton.cdiv(r, config.block_m) * triton.cdiv(c, config.block_n),)
    _moe_fp8_wgrad_kernel_planned[grid](
        a_arg, a_s, b_arg, b_s, out, routing.expert_offsets, routing.expert_counts, routing.gate, r, c,
        a_q.stride(0), a_q.stride(1), a_s.stride(0), a_s.stride(1),
        b_q.stride(0), b_q.stride(1), b_s.stride(0), b_s.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, STEP_K=step_k, QBLOCK=QBLOCK,
        ACCUMULATE=main_grad is not None, INTERPRETED=interpreted, TMA=config.variant == "tma",
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return None if main_grad is not None else out


def moe_fp8_wgrads(x: torch.Tensor, h: torch.Tensor, dgu: torch.Tensor, dout: torch.Tensor, routing: MoeRouting,
                   backend: str, main_grads=None, gate_up: str = "interleaved",
                   like: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dW1 = x[gather]^T dgu and dW2 = h^T (s * dout[gather]) with every operand quantized 128x1 along the rows; dW1's
    columns in w1's ``gate_up`` layout, and a new dW1 / dW2 in the layout of ``like`` (w1, w2) where that is split
    halves or the transpose of a contiguous one (``_fp8_wgrad_w1``, ``_fp8_wgrad_w2``)."""
    mg1, mg2 = main_grads if main_grads is not None else (None, None)
    xq, xs = moe_fp8_quant_colwise(x, routing, backend, gather=True, scale=False)
    gq, gs = moe_fp8_quant_colwise(dgu, routing, backend, gather=False, scale=False)
    dw1 = _fp8_wgrad_w1(xq, xs, gq, gs, routing, backend, mg1, gate_up == "split", like[0])
    hq, hs = moe_fp8_quant_colwise(h, routing, backend, gather=False, scale=False)
    yq, ys = moe_fp8_quant_colwise(dout, routing, backend, gather=True, scale=True)
    dw2 = _fp8_wgrad_w2(hq, hs, yq, ys, routing, backend, mg2, like[1])
    return dw1, dw2


def _fp8_wgrad_w1(xq, xs, gq, gs, routing: MoeRouting, backend: str, main_grad: torch.Tensor | None, split: bool,
                  like: torch.Tensor | None) -> torch.Tensor | None:
    """dW1 with interleaved columns; split: copied into split halves (``like``'s strides), or, into a main_grad of
    split halves, accumulated from an FP32 scratch of zeros (0 + acc is acc: the same one FP32 add per element)."""
    if not split:
        return moe_fp8_wgrad(xq, xs, gq, gs, routing, backend, main_grad)
    if main_grad is None:
        scratch = moe_fp8_wgrad(xq, xs, gq, gs, routing, backend)
        out = weight_grad_buffer(tuple(scratch.shape), like, scratch.device)
        split_copy(scratch, out, backend)
        return out
    scratch = torch.zeros(main_grad.shape, dtype=torch.float32, device=main_grad.device)
    moe_fp8_wgrad(xq, xs, gq, gs, routing, backend, scratch)
    half = main_grad.shape[2] // 2
    main_grad[..., :half] += scratch[..., 0::2]
    main_grad[..., half:] += scratch[..., 1::2]
    return None


def _fp8_wgrad_w2(hq, hs, yq, ys, routing: MoeRouting, backend: str, main_grad: torch.Tensor | None,
                  like: torch.Tensor | None) -> torch.Tensor | None:
    """dW2; into the transpose of a contiguous layout (w2 = down_proj.transpose(1, 2)) as dW2^T = dy^T h: the same
    products summed over the same rows in the same order, with the operands swapped."""
    target = main_grad if main_grad is not None else like
    if target is not None and not target.is_contiguous() and target.transpose(1, 2).is_contiguous():
        if main_grad is not None:
            moe_fp8_wgrad(yq, ys, hq, hs, routing, backend, main_grad.transpose(1, 2))
            return None
        return moe_fp8_wgrad(yq, ys, hq, hs, routing, backend).transpose(1, 2)
    return moe_fp8_wgrad(hq, hs, yq, ys, routing, backend, main_grad)
