"""The BF16 MoE stages' launch wrappers: check, allocate, launch (kernels/moe/kernels.py for Triton, kernels/moe/ws.py
for the Gluon "ws" kernels), the table's pick per stage (kernels/moe/configs.py) with its fallback to the same tile on
another load path when the pick's kernel cannot address an operand (the same bits), and the routing launch with
its 32-bit offset check. Each wrapper takes the backend the layer resolved (``check_moe_inputs``) and an optional
explicit config, which is never swapped. The FP8 layer uses the combine, gather-sum, dscore and BF16 weight-gradient
wrappers too."""

from __future__ import annotations

from dataclasses import replace

import torch
import triton

from detkit.kernels.backend import MAX_INT32_OFFSET, TRITON_INTERPRETER, PlannedKernel
from detkit.kernels.det_gemm.launch import GemmConfig, interpreter_step_k
from detkit.kernels.moe.common import DS_CHUNK, EPI_DSWIGLU, EPI_PLAIN, EPI_SWIGLU
from detkit.kernels.moe.configs import check_grouped_config, check_moe_variant, grouped_order, select_moe_config
from detkit.kernels.moe.kernels import (
    moe_combine_kernel, moe_dscore_sum_kernel, moe_grouped_gemm_kernel, moe_grouped_gemm_tma_kernel,
    moe_scale_rows_kernel, moe_split_copy_kernel, moe_wgrad_kernel,
)
from detkit.kernels.moe.operands import (
    check_gate_up, weight_descriptor, weight_storage, ws_weight_rows, ws_wgrad_addresses,
)
from detkit.kernels.moe.routing import SEGMENT_ALIGN, MoeRouting, PendingRouting, launch_routing, max_padded_rows
from detkit.kernels.moe.ws import launch_moe_ws, launch_moe_ws_gather, launch_moe_ws_wgrad


def _backend_flags(backend: str, config: GemmConfig) -> dict:
    interpreted = backend == TRITON_INTERPRETER
    return {"STEP_K": interpreter_step_k(config) if interpreted else config.block_k, "INTERPRETED": interpreted}


def _ws_addresses(config: GemmConfig, b: torch.Tensor) -> bool:
    """Whether the ws kernels can take the ``[E, L, C]`` weight view ``b`` with ``config``'s tile: its storage
    flattens into TMA rows and the tile divides L x C."""
    return ws_weight_rows(b) is not None and b.shape[1] % config.block_k == 0 and b.shape[2] % config.block_n == 0


def triton_tile(config: GemmConfig) -> GemmConfig:
    """The Triton tile of a "ws" config (the same tile, so the same bits): the TMA kernel on at most 8 warps, the
    MMA warpgroups of a 12-warp tile (whose 4 extra warps run its epilogue). Other configs are their own."""
    if config.variant != "ws":
        return config
    return replace(config, variant="tma", num_warps=min(config.num_warps, 8))


def table_moe_config(stage: str, backend: str, b: torch.Tensor, split: str | None = None) -> GemmConfig:
    """The table's pick for a grouped ``stage``, in the tile order for ``b``'s expert slab (``grouped_order``); when
    the pick's kernel cannot address the weight view ``b``, the same tile one load path down: "ws" -> its
    ``triton_tile`` (see _ws_addresses), "tma" -> "ptr" (TMA cannot address it). The variant and the order change
    the load path and the tiles' schedule only (same K order per output, same epilogue, so the same bits): an
    explicit config is never swapped. ``split`` ("c" or "l"): b's C or L dim holds gate/up pairs as split halves, which the
    "ws" kernels do not read and "tma" reads along C only (``_split_variant_reason``)."""
    config = select_moe_config(stage, backend)
    group_m = grouped_order(stage, backend, b.shape[1] * b.shape[2] * b.element_size())
    if group_m != config.group_m:
        config = replace(config, group_m=group_m)
    if config.variant == "ws" and (split is not None or not _ws_addresses(config, b)):
        config = triton_tile(config)
    if config.variant == "tma" and (weight_storage(b) is None or split == "l"):
        config = replace(config, variant="ptr")
    return config


def _split_variant_reason(config: GemmConfig, split: str | None) -> str | None:
    if split is None or config.variant == "ptr" or (config.variant == "tma" and split == "c"):
        return None
    where = "the output columns (up)" if split == "c" else "the reduced dim (dX)"
    supported = ("ptr", "tma") if split == "c" else ("ptr",)
    return (f"variant {config.variant!r} cannot read split gate/up halves along {where}; supported there: "
            f"{supported}")


_moe_grouped_gemm_tma_kernel_planned = PlannedKernel(moe_grouped_gemm_tma_kernel)
_moe_grouped_gemm_kernel_planned = PlannedKernel(moe_grouped_gemm_kernel)


def _grouped(op_id: int, stage: str, a: torch.Tensor, gather: bool, b: torch.Tensor, c: torch.Tensor,
             aux: torch.Tensor | None, routing: MoeRouting, n_cols: int, reduced: int, epilogue: int,
             backend: str, config: GemmConfig | None,
             dscore: tuple[torch.Tensor, torch.Tensor] | None = None, split: str | None = None) -> None:
    """b is a [E, L, C] view (strides kept); ``dscore = (h, ds_part)`` (dgrad only) adds the partials; ``split``
    ("c" or "l"): b's C or L dim holds gate/up pairs as split halves, read as interleaved pairs."""
    config = config or table_moe_config(stage, backend, b, split)
    reason = _split_variant_reason(config, split)
    if reason is not None:
        raise ValueError(f"{stage}: {reason}")
    if config.variant == "ws":  # the Gluon kernels (kernels/moe/ws.py): sm_90
        if gather or epilogue != EPI_PLAIN:
            launch_moe_ws_gather(op_id, stage, config, epilogue, a, b, c, aux, routing, dscore, backend, gather)
        else:
            launch_moe_ws(op_id, stage, config, a, b, c, routing, backend)
        return
    check_grouped_config(stage, config)
    if dscore is not None and config.block_n % DS_CHUNK:
        raise ValueError(f"{stage}: the fused dscore partials need BLOCK_N a multiple of {DS_CHUNK}; "
                         f"got {config.block_n}")
    p = routing.padded_rows
    if p == 0:
        return
    aux_t = aux if aux is not None else c
    h_t, ds_t = dscore if dscore is not None else (c, c)
    fused = {"DSCORE": dscore is not None, "DS_CHUNK": DS_CHUNK}
    grid = (triton.cdiv(p, config.block_m) * triton.cdiv(n_cols, config.block_n),)
    flags = _backend_flags(backend, config)
    if config.variant == "tma":
        if split and config.block_n % 2:
            raise ValueError(f"{stage}: split gate/up halves need an even BLOCK_N; got {config.block_n}")
        b_desc, k_major = weight_descriptor(b, config.block_n // 2 if split else config.block_n, flags["STEP_K"])
        _moe_grouped_gemm_tma_kernel_planned[grid](
            a, routing.gather_token, b_desc, c, aux_t, h_t, ds_t,
            routing.sorted_route, routing.row_score, routing.tile_expert, routing.gate,
            p, n_cols, reduced,
            a.stride(0), a.stride(1),
            c.stride(0), c.stride(1),
            aux_t.stride(0), aux_t.stride(1),
            op_id,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SEGMENT=SEGMENT_ALIGN,
            GATHER_A=gather, EPILOGUE=epilogue, B_K_MAJOR=k_major, num_warps=config.num_warps,
            num_stages=config.num_stages, B_SPLIT_HALVES=split == "c", GROUP_M=config.group_m, **flags, **fused,
        )
        return
    _moe_grouped_gemm_kernel_planned[grid](
        a, routing.gather_token, b, c, aux_t, h_t, ds_t,
        routing.sorted_route, routing.row_score, routing.tile_expert, routing.gate,
        p, n_cols, reduced,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2), _half_stride(b, split),
        c.stride(0), c.stride(1),
        aux_t.stride(0), aux_t.stride(1),
        op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SEGMENT=SEGMENT_ALIGN,
        GATHER_A=gather, EPILOGUE=epilogue, num_warps=config.num_warps, num_stages=config.num_stages,
        B_SPLIT={None: 0, "l": 1, "c": 2}[split], GROUP_M=config.group_m, **flags, **fused,
    )


def _half_stride(b: torch.Tensor, split: str | None) -> int:
    """The offset of a pair's second half along b's split dim ("l": 1, "c": 2): I of its indices on (0 unsplit)."""
    if split is None:
        return 0
    dim = 1 if split == "l" else 2
    return b.shape[dim] // 2 * b.stride(dim)


def moe_up_swiglu(x: torch.Tensor, w1: torch.Tensor, routing: MoeRouting, backend: str,
                  config: GemmConfig | None = None, gate_up: str = "interleaved") -> tuple[torch.Tensor, torch.Tensor]:
    """gu [P, 2I] = x[gather] @ W1[e] (BF16, interleaved whatever w1's ``gate_up`` layout) and h [P, I] = silu(g) * u
    (BF16)."""
    check_gate_up(gate_up)
    split = "c" if gate_up == "split" else None
    config = config or table_moe_config("up", backend, w1, split)
    if config.block_n % 2:
        raise ValueError(f"up: BLOCK_N {config.block_n} must be even (gate/up pairs)")
    two_i = w1.shape[2]
    gu = torch.empty((routing.padded_rows, two_i), dtype=torch.bfloat16, device=x.device)
    h = torch.empty((routing.padded_rows, two_i // 2), dtype=torch.bfloat16, device=x.device)
    _grouped(0, "up", x, True, w1, gu, h, routing, two_i, x.shape[1], EPI_SWIGLU, backend, config, split=split)
    return gu, h


def moe_down(h: torch.Tensor, w2: torch.Tensor, routing: MoeRouting, backend: str,
             config: GemmConfig | None = None) -> torch.Tensor:
    """y [P, H] bf16 = h @ W2[e]: the FP32 accumulator rounded once (the combine sums the routes in FP32)."""
    y = torch.empty((routing.padded_rows, w2.shape[2]), dtype=torch.bfloat16, device=h.device)
    _grouped(1, "down", h, False, w2, y, None, routing, w2.shape[2], w2.shape[1], EPI_PLAIN, backend, config)
    return y


def _dgrad(dout: torch.Tensor, w2: torch.Tensor, gu: torch.Tensor, routing: MoeRouting, backend: str,
           config: GemmConfig | None, dscore: tuple[torch.Tensor, torch.Tensor] | None,
           sorted_dout: torch.Tensor | None) -> torch.Tensor:
    if sorted_dout is not None and (sorted_dout.shape[0] < routing.padded_rows
                                    or sorted_dout.shape[1:] != dout.shape[1:] or sorted_dout.dtype != dout.dtype):
        raise ValueError(f"sorted_dout must be dout's rows in expert order, [>= {routing.padded_rows}, "
                         f"{dout.shape[1]}] {dout.dtype} (moe_scale_rows' copy); got {sorted_dout.dtype} "
                         f"{tuple(sorted_dout.shape)}")
    dgu = torch.empty_like(gu)
    w2_t = w2.transpose(1, 2)  # [E, H, I] view
    a, gather = (dout, True) if sorted_dout is None else (sorted_dout, False)
    _grouped(2, "dgrad", a, gather, w2_t, dgu, gu, routing, w2.shape[1], w2.shape[2], EPI_DSWIGLU,
             backend, config, dscore)
    return dgu


def moe_dgrad_dswiglu(dout: torch.Tensor, w2: torch.Tensor, gu: torch.Tensor, routing: MoeRouting,
                      backend: str, config: GemmConfig | None = None,
                      sorted_dout: torch.Tensor | None = None) -> torch.Tensor:
    """dgu [P, 2I] (BF16, interleaved): dSwiGLU of dh = s * (dout[gather] @ W2[e].T), fused. ``sorted_dout``: those
    rows already in expert order (``moe_scale_rows(..., sorted_copy=True)``), read in place of the gather (the same
    values, so the same bits)."""
    return _dgrad(dout, w2, gu, routing, backend, config, None, sorted_dout)


def moe_dgrad_dswiglu_dscore(dout: torch.Tensor, w2: torch.Tensor, gu: torch.Tensor, h: torch.Tensor,
                             routing: MoeRouting, backend: str, config: GemmConfig | None = None,
                             sorted_dout: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_dgrad_dswiglu`` (the same dgu bits) plus, from the same accumulator, the dscore partials
    ds_part [P, cdiv(I, 64)] FP32: ds_part[p, c] = sum over chunk c's columns j of (dout[t] @ W2[e].T)[j] *
    h[p, j], with h [P, I] the forward's saved activation. dout . y_k needs no y: y = h @ W2[e]."""
    if not h.is_contiguous() or tuple(h.shape) != (gu.shape[0], gu.shape[1] // 2) or h.dtype != torch.bfloat16:
        raise ValueError(f"h must be the forward's contiguous bf16 [P, I] = {(gu.shape[0], gu.shape[1] // 2)}; "
                         f"got {h.dtype} {tuple(h.shape)}, contiguous={h.is_contiguous()}")
    ds_part = torch.empty((gu.shape[0], triton.cdiv(h.shape[1], DS_CHUNK)), dtype=torch.float32, device=gu.device)
    return _dgrad(dout, w2, gu, routing, backend, config, (h, ds_part), sorted_dout), ds_part


def moe_dx_route(dgu: torch.Tensor, w1: torch.Tensor, routing: MoeRouting, backend: str,
                 config: GemmConfig | None = None, gate_up: str = "interleaved") -> torch.Tensor:
    """dx_route [P, H] bf16 = dgu @ W1[e].T: the FP32 accumulator rounded once (the gather-sum sums in FP32); the
    reduction runs over the interleaved columns whatever w1's ``gate_up`` layout (the same bits)."""
    check_gate_up(gate_up)
    dxr = torch.empty((routing.padded_rows, w1.shape[1]), dtype=torch.bfloat16, device=dgu.device)
    _grouped(3, "dx", dgu, False, w1.transpose(1, 2), dxr, None, routing, w1.shape[1], w1.shape[2],
             EPI_PLAIN, backend, config, split="l" if gate_up == "split" else None)
    return dxr


_moe_combine_kernel_planned = PlannedKernel(moe_combine_kernel)


def _combine(op_id: int, src: torch.Tensor, routing: MoeRouting, scores: torch.Tensor | None,
             backend: str, config: GemmConfig | None) -> torch.Tensor:
    config = config or select_moe_config("combine", backend)
    t_count, k_count, n = routing.num_tokens, routing.top_k, src.shape[1]
    out = torch.empty((t_count, n), dtype=torch.bfloat16, device=src.device)
    sc = scores if scores is not None else routing.route_row  # unused when unscaled
    grid = (triton.cdiv(t_count, config.block_m) * triton.cdiv(n, config.block_n),)
    _moe_combine_kernel_planned[grid](
        src, routing.route_row, sc, routing.gate, out, t_count, n, k_count,
        src.stride(0), src.stride(1), routing.route_row.stride(0), routing.route_row.stride(1),
        sc.stride(0), sc.stride(1), out.stride(0), out.stride(1), op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, SCALED=scores is not None,
        INTERPRETED=backend == TRITON_INTERPRETER, num_warps=config.num_warps,
    )
    return out


def moe_combine(y: torch.Tensor, routing: MoeRouting, scores: torch.Tensor, backend: str,
                config: GemmConfig | None = None) -> torch.Tensor:
    """out [T, H] = bf16(sum over k ascending of scores[t, k] * y[route_row[t, k]]) (FP32 sum of the BF16 y)."""
    return _combine(0, y, routing, scores, backend, config)


def moe_gather_sum(dx_route: torch.Tensor, routing: MoeRouting, backend: str,
                   config: GemmConfig | None = None) -> torch.Tensor:
    """dx [T, H] = bf16(sum over k ascending of dx_route[route_row[t, k]]) (FP32 sum)."""
    return _combine(1, dx_route, routing, None, backend, config)


def _ws_wgrad_takes(config: GemmConfig, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the ws weight gradient can run ``config`` on these operands: addressable, the tile dividing dW."""
    _, r, c = out.shape
    return ws_wgrad_addresses(a, b, out) and r % config.block_m == 0 and c % config.block_n == 0


_moe_wgrad_kernel_planned = PlannedKernel(moe_wgrad_kernel)


def _wgrad(op_id: int, a: torch.Tensor, gather_a: bool, b: torch.Tensor, routing: MoeRouting,
           out: torch.Tensor, accumulate: bool, backend: str, config: GemmConfig | None,
           split_cols: bool = False) -> None:
    """dW = A^T B over each expert's rows into ``out`` [E, R, C] (any strides); ``split_cols``: out's C dim holds
    gate/up pairs as split halves (B's columns are interleaved)."""
    if config is None:
        config = select_moe_config("wgrad", backend)
        if config.variant == "ws" and not (split_cols or gather_a or out.is_contiguous()) and _ws_wgrad_takes(
                config, b, a, out.transpose(1, 2)):
            # dW stored transposed (e.g. down_proj's [E, H, I] under w2's [E, I, H] view): dW^T = B^T A, the same
            # products summed over the same rows in the same order, on the ws kernel.
            launch_moe_ws_wgrad(op_id, config, b, False, a, out.transpose(1, 2), accumulate, routing, backend)
            return
        if config.variant == "ws" and (split_cols or not _ws_wgrad_takes(config, a, b, out)):
            config = replace(config, variant="ptr")  # the same tile and K order on the Triton kernel: the same bits
    if config.variant == "ws":  # the Gluon kernel (kernels/moe/ws.py): sm_90
        if split_cols:
            raise ValueError("wgrad: variant 'ws' cannot store split gate/up halves; supported there: ('ptr',)")
        launch_moe_ws_wgrad(op_id, config, a, gather_a, b, out, accumulate, routing, backend)
        return
    check_moe_variant("wgrad", config)
    experts, r, c = out.shape
    grid = (experts * triton.cdiv(r, config.block_m) * triton.cdiv(c, config.block_n),)
    _moe_wgrad_kernel_planned[grid](
        a, b, routing.gather_token, routing.row_score, out,
        routing.expert_offsets, routing.expert_counts, routing.gate,
        r, c, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), out.stride(2), c // 2 * out.stride(2) if split_cols else 0, op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GATHER_A=gather_a, ACCUMULATE=accumulate, SPLIT_C=split_cols, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages, **_backend_flags(backend, config),
    )


_moe_scale_rows_kernel_planned = PlannedKernel(moe_scale_rows_kernel)
SCALE_ROWS_PAD_ROWS = 128  # one segment's rows per padding program of moe_scale_rows_kernel


def moe_scale_rows(dout: torch.Tensor, routing: MoeRouting, backend: str, config: GemmConfig | None = None,
                   sorted_copy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """dy [P, H] bf16 = bf16(row_score[p] * dout[gather_token[p]]), padding rows +0: dW2's B operand in
    expert-sorted order. Forming it here, not on load inside the dW2 K loop, keeps that loop a plain
    load-to-shared-memory GEMM; the product and its one rounding are the same. ``sorted_copy``: also the rows
    dout[gather_token[p]] themselves (padding rows +0), in the same pass: returns (dy, that copy), which the dgrad
    GEMM reads by TMA instead of gathering them."""
    config = config or select_moe_config("combine", backend)
    rows, cols = routing.padded_rows, dout.shape[1]
    dy = torch.empty((rows, cols), dtype=torch.bfloat16, device=dout.device)
    copy = torch.empty((rows, cols), dtype=dout.dtype, device=dout.device) if sorted_copy else dy
    t_count, route_row = routing.num_tokens, routing.route_row
    token_programs = triton.cdiv(t_count, config.block_m) * triton.cdiv(cols, config.block_n)
    grid = (token_programs + triton.cdiv(rows, SCALE_ROWS_PAD_ROWS),)
    _moe_scale_rows_kernel_planned[grid](
        dout, route_row, routing.row_score, routing.sorted_route, routing.gate, dy, copy, t_count, cols,
        routing.top_k, rows, dout.stride(0), dout.stride(1), route_row.stride(0), route_row.stride(1),
        dy.stride(0), dy.stride(1), copy.stride(0), copy.stride(1), token_programs,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, PAD_ROWS=SCALE_ROWS_PAD_ROWS, COPY=sorted_copy,
        INTERPRETED=backend == TRITON_INTERPRETER, num_warps=config.num_warps,
    )
    return (dy, copy) if sorted_copy else dy


def weight_grad_buffer(shape: tuple[int, ...], like: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A BF16 weight gradient with ``like``'s strides when it is dense (torch.empty_like's preserve_format: the weight it
    belongs to, so autograd keeps it as .grad without a layout copy), else contiguous."""
    if like is not None and tuple(like.shape) == tuple(shape):
        return torch.empty_like(like, dtype=torch.bfloat16, device=device)
    return torch.empty(shape, dtype=torch.bfloat16, device=device)


def moe_wgrad_w1(x: torch.Tensor, dgu: torch.Tensor, routing: MoeRouting, backend: str,
                 main_grad: torch.Tensor | None = None, config: GemmConfig | None = None,
                 gate_up: str = "interleaved", like: torch.Tensor | None = None) -> torch.Tensor | None:
    """dW1[e] [H, 2I] = x[gather]^T @ dgu over e's rows (BF16), or main_grad += it in FP32 (returns None); its columns
    in w1's ``gate_up`` layout. A new dW1 is contiguous when interleaved (autograd converts it to w1's layout where
    they differ); of split columns it takes the strides of ``like`` (w1) when dense, so autograd keeps it as is:
    the table's kernel computes it interleaved into a scratch copied into place by ``moe_split_copy_kernel`` when it
    is the ws kernel (which does not store split halves), else the Triton kernel stores the halves directly."""
    check_gate_up(gate_up)
    experts = routing.num_experts
    shape = (experts, x.shape[1], dgu.shape[1])
    split = gate_up == "split"
    out = main_grad if main_grad is not None else weight_grad_buffer(shape, like if split else None, x.device)
    chosen = config or select_moe_config("wgrad", backend)
    if split and main_grad is None and chosen.variant == "ws":
        scratch = torch.empty(shape, dtype=torch.bfloat16, device=x.device)
        if _ws_wgrad_takes(chosen, x, dgu, scratch):
            _wgrad(0, x, True, dgu, routing, scratch, False, backend, chosen)
            split_copy(scratch, out, backend)
            return out
    _wgrad(0, x, True, dgu, routing, out, main_grad is not None, backend, config, split_cols=split)
    return None if main_grad is not None else out


_moe_split_copy_kernel_planned = PlannedKernel(moe_split_copy_kernel)


def split_copy(src: torch.Tensor, dst: torch.Tensor, backend: str) -> None:
    """dst [E, R, C] (split gate/up columns, any strides) = src (interleaved columns), exactly."""
    experts, r, c = src.shape
    block_r, block_c = (64, 64) if backend == TRITON_INTERPRETER else (64, 128)
    grid = (experts * triton.cdiv(r, block_r) * triton.cdiv(c, block_c),)
    _moe_split_copy_kernel_planned[grid](src, dst, r, c, *src.stride(), *dst.stride(), c // 2 * dst.stride(2),
                                         BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)


def moe_wgrad_w2(h: torch.Tensor, dout: torch.Tensor, routing: MoeRouting, backend: str,
                 main_grad: torch.Tensor | None = None, config: GemmConfig | None = None,
                 like: torch.Tensor | None = None, dy: torch.Tensor | None = None) -> torch.Tensor | None:
    """dW2[e] [I, H] = h^T @ dy over e's rows (BF16), or main_grad += it in FP32, with
    dy = bf16(s * dout[gather]) formed once per expert-sorted row by ``moe_scale_rows`` (``dy``: already formed);
    a new dW2 with the strides of ``like`` (w2) when dense."""
    if dy is not None and (tuple(dy.shape) != (routing.padded_rows, dout.shape[1]) or dy.dtype != torch.bfloat16):
        raise ValueError(f"dy must be moe_scale_rows' bf16 [{routing.padded_rows}, {dout.shape[1]}]; got {dy.dtype} "
                         f"{tuple(dy.shape)}")
    experts = routing.num_experts
    out = main_grad if main_grad is not None else weight_grad_buffer(
        (experts, h.shape[1], dout.shape[1]), like, h.device)
    if dy is None:
        dy = moe_scale_rows(dout, routing, backend)
    _wgrad(1, h, False, dy, routing, out, main_grad is not None, backend, config)
    return None if main_grad is not None else out


_moe_dscore_sum_kernel_planned = PlannedKernel(moe_dscore_sum_kernel)


def moe_dscores_from_partials(ds_part: torch.Tensor, routing: MoeRouting, backend: str,
                              config: GemmConfig | None = None) -> torch.Tensor:
    """ds [T, K] FP32 = sum_c ds_part[route_row[t, k], c] (0 for masked routes): the BF16 layer's dscores."""
    config = config or select_moe_config("dscore", backend)
    t_count, k_count = routing.num_tokens, routing.top_k
    ds = torch.empty((t_count, k_count), dtype=torch.float32, device=ds_part.device)
    n_chunks = ds_part.shape[1]
    _moe_dscore_sum_kernel_planned[(triton.cdiv(t_count, config.block_m),)](
        ds_part, routing.route_row, routing.gate, ds, t_count, k_count, n_chunks,
        routing.route_row.stride(0), routing.route_row.stride(1), ds.stride(0), ds.stride(1),
        BLOCK_M=config.block_m, NCH_POW2=triton.next_power_of_2(n_chunks), num_warps=config.num_warps,
    )
    return ds


def launch_checked_routing(x: torch.Tensor, w1: torch.Tensor, topk_ids: torch.Tensor,
                           scores: torch.Tensor) -> PendingRouting:
    """``launch_routing``, refusing first a batch whose padded intermediates could overflow 32-bit
    offsets (at the largest P its routing can have: the up GEMM may run over that bound)."""
    rows = max_padded_rows(topk_ids.numel(), w1.shape[0])
    widest = max(w1.shape[2], x.shape[1])
    if rows * widest > MAX_INT32_OFFSET:
        raise ValueError(f"up to {rows} padded rows x {widest} columns of intermediates exceed 32-bit "
                         "kernel offsets; split the batch")
    return launch_routing(topk_ids, scores, w1.shape[0])


def checked_routing(x: torch.Tensor, w1: torch.Tensor, topk_ids: torch.Tensor, scores: torch.Tensor) -> MoeRouting:
    """The routing metadata (``launch_checked_routing`` and its one host read)."""
    return launch_checked_routing(x, w1, topk_ids, scores).finish()
