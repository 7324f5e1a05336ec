"""Deterministic BF16 Mixture-of-Experts expert MLP (SwiGLU) for Hopper: forward and backward.

Math, for token t routed to experts e_k with scores s_k (k = 0..K-1, masked routes skipped):
    gu_k  = x[t] @ W1[e_k]                       W1 [E, H, 2I], gate/up columns interleaved
    h_k   = silu(g_k) * u_k                      g_k = gu_k[0::2], u_k = gu_k[1::2]
    y_k   = bf16( h_k @ W2[e_k] )                W2 [E, I, H]; FP32 accumulation, one BF16 rounding
    out[t] = bf16( sum_{k ascending} s_k * y_k ) FP32 sum, one BF16 rounding
Backward, with dy_k = s_k * dout[t]:
    dh_k = s_k * (dout[t] @ W2[e_k].T)  -> dg_k = dh_k * u_k * silu'(g_k), du_k = dh_k * silu(g_k)
    dx[t] = bf16( sum_{k ascending} dx_k ),  dx_k = bf16( dgu_k @ W1[e_k].T )   FP32 sum, one BF16 rounding
    dW1[e] = sum over e's rows (ascending) x[t]^T dgu_k,  dW2[e] = sum h_k^T bf16(s_k * dout[t])
    dscores[t, k] = dout[t] . y_k = (dout[t] @ W2[e_k].T) . h_k     (the second form is computed)

Weight convention (the ``b [K, N]`` convention of det_gemm, one matrix per expert):
    W1 [E, H, 2I], column 2j = gate_j and column 2j+1 = up_j (interleaved, so a gate/up pair always
    lands in one output tile and SwiGLU runs in the up-projection's epilogue). ``interleave_gate_up``
    and ``deinterleave_gate_up`` convert from/to the usual split-half [gate; up] layout.
    W2 [E, I, H].
    Any non-negative strides are accepted: nn.Linear-style stacks ``fc1 [E, 2I, H]`` and
    ``fc2 [E, H, I]`` are passed as ``interleave_gate_up(fc1, dim=1).transpose(1, 2)`` and
    ``fc2.transpose(1, 2)`` (views; no copy at call time).

Stages and tile ownership (kernels/moe_routing.py builds the expert-sorted, 128-padded rows):
    up     moe_grouped_gemm_kernel: one program per (128-row expert tile slice, N tile of 2I); reads
           x through the gather index (never materialised in expert order); stores gu [P, 2I] and
           h [P, I] in BF16 (SwiGLU epilogue). Queued before the routing's host read, over the
           largest P the routing can have; each grouped GEMM program first reads the routing's gate
           (P and the validation counts) and does nothing past P or for a refused batch.
    down   the same kernel: y [P, H] = h @ W2[e], the FP32 accumulator rounded once to ROUTE_DTYPE (BF16).
    combine moe_combine_kernel: one program per (token block, H tile); ascending k; one rounding.
    dgrad  the same grouped kernel with the dSwiGLU epilogue: dh = s * (dout[t] @ W2[e].T) in FP32,
           then dg/du from the saved gu; stores dgu [P, 2I] BF16; and, fused, the dscore partials
           ds_part[p, c] = sum over the 64 columns j of chunk c of (dout[t] @ W2[e].T)[j] * h[p, j] (FP32).
    dx     grouped kernel dgu @ W1[e].T -> [P, H] ROUTE_DTYPE, then the combine kernel unscaled (ascending
           k gather-sum over the token's routes, one rounding).
    dW     moe_wgrad_kernel: one program per (expert, dW tile); reduces the expert's rows in
           ascending padded-row order; optional FP32 accumulation into a caller's main_grad. (Variant
           "ws": kernels/moe_ws.py moe_ws_wgrad_kernel, the same order on a persistent Gluon kernel.)
    dscore moe_dscore_sum_kernel: one program per token block; per route k, the row's I/64 partials
           summed (fixed tree). y [P, H] is not kept for the backward: it is read once by the combine.
           (The FP8 layer computes its dscores the same way, from its FP8 dgrad's accumulator.)

Determinism rests on the det_gemm rules: no split-K, no atomics, one program owns each output
tile and reduces all of its reduced dimension in a fixed ascending order that depends on the
shapes alone (H or I for the grouped GEMMs, K for the combines, the expert's row count for dW).
Batch invariance (forward, per token): a token's rows are never reduced with other tokens' rows,
and the pinned tile configs below do not depend on T or on the routing.

On the Triton interpreter (CPU), like det_gemm: exact FP32 products added one at a time in
ascending order (``tl.dot`` on BF16 is broken there), and FP32 -> BF16 rounding in integer
arithmetic (``fp32_to_bf16_rtne``; the interpreter's cast truncates). Interpreter bits differ
from tensor-core bits; each backend is audited on its own (audits/moe.py).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from detkit.kernels.backend import (
    CUDA_SM90, MAX_INT32_OFFSET, TRITON_INTERPRETER, check_bf16_matrix, ensure_cuda_context, resolve_backend,
)
from detkit.kernels.det_gemm import GemmConfig, device_sms, fp32_to_bf16_rtne, interpreter_step_k
from detkit.kernels.moe_routing import (
    SEGMENT_ALIGN, MoeRouting, PendingRouting, check_topk_args, launch_routing, max_padded_rows,
)

# ---------------------------------------------------------------------------------------------
# Pinned config tables (no autotune). Bump the version whenever an entry changes.
# The grouped GEMMs' BLOCK_M must divide SEGMENT_ALIGN so no tile straddles two experts.
# On the interpreter every config gives the same bits (sequential accumulation); its table is
# chosen for emulation speed only.
# ---------------------------------------------------------------------------------------------
MOE_CONFIG_TABLE_VERSION = "2026-12-01.7"

# The dtype y (down) and dx_route (dX) leave their GEMMs in: the FP32 accumulator rounded once to BF16 (table .6,
# as the FP8 layer since its table .14 and as an eager BF16 model rounds them); the combine and the gather-sum still
# sum the K routes in FP32 and round once more. Half the bytes of FP32 to write and to read back (805 MB each at the
# reference shape). torch.float32 (tables up to .5) is the unrounded form, kept selectable for A/B runs
# (bench.moe_ab's route variant); its FP32 store buffer does not fit beside down's 128x256 3-stage ring (table .7),
# which the ws launcher refuses by name: give down a 128x128 tile with it.
ROUTE_DTYPE = torch.bfloat16
ROUTE_DTYPES = (torch.bfloat16, torch.float32)

STAGES = ("up", "down", "dgrad", "dx", "wgrad", "combine", "dscore")

MOE_CONFIGS: dict[str, dict[str, GemmConfig]] = {
    CUDA_SM90: {
        # H200 sweep (bench/moe_tune.py, reports/2026-11-29-h200-moe2/): the TMA weight tile wins every
        # grouped stage at both presets swept (3 stages = 96 KiB of shared memory: two programs per SM).
        "up": GemmConfig(128, 128, 64, 1, 8, 3, "tma"),  # BLOCK_N interleaved gate/up columns -> 64 of h
        # down, dgrad and dX: the warp-specialized Gluon kernels (kernels/moe_ws.py); H200 sweeps 2026-11-30
        # (reports/2026-11-30-h200-s7): down 1052 -> 958 us, dX 1977 -> 1903 us, dgrad 1442 -> 1296 us at the
        # reference shape, every output bit-equal to the Triton tiles.
        # down since table .7: 128x256 on 3 stages beside the BF16 y tile's 64 KiB buffer (208 KiB); H200 2026-12-01
        # (reports/2026-12-01-h200-s12): the layer 0.990x (reference) / 0.985x (Qwen3-30B-A3B T=16384) the time of
        # table .6 in one process, same bits; dX on it was slower (1872 vs 1798 us), so dX keeps 128x128.
        "down": GemmConfig(128, 256, 64, 1, 8, 3, "ws"),
        "dgrad": GemmConfig(128, 128, 64, 1, 8, 4, "ws"),  # BLOCK_N columns of dh (2x of dgu)
        "dx": GemmConfig(128, 128, 64, 1, 8, 4, "ws"),
        # wgrad (BLOCK_K = routed rows per reduction step): the Gluon kernel on a 128x256 tile, 3 stages + the
        # TMA-store buffer (208 KiB). H200 2026-12-01 (reports/2026-12-01-h200): dW1 2332 -> 1720 us, dW2 1112 ->
        # 1095 us at the reference shape, the layer 0.926x the time of table .4 in one process (bench.moe_ab),
        # every output bit-equal. Operands TMA cannot address, or a dW the tile does not divide, run the same tile in
        # Triton (same bits).
        "wgrad": GemmConfig(128, 256, 64, 1, 8, 3, "ws"),
        "combine": GemmConfig(16, 256, 16, 1, 4, 1),  # BLOCK_M tokens x BLOCK_N columns
        "dscore": GemmConfig(16, 256, 16, 1, 4, 1),  # moe_dscore_sum_kernel: BLOCK_M tokens (BLOCK_N unused)
    },
    TRITON_INTERPRETER: {
        "up": GemmConfig(128, 128, 32, 1, 4, 1),  # few large programs: the interpreter's cost is per op
        "down": GemmConfig(64, 32, 32, 1, 4, 1),
        "dgrad": GemmConfig(128, 64, 32, 1, 4, 1),
        "dx": GemmConfig(64, 32, 32, 1, 4, 1),
        "wgrad": GemmConfig(32, 64, 32, 1, 4, 1),
        "combine": GemmConfig(32, 64, 16, 1, 4, 1),
        "dscore": GemmConfig(32, 64, 16, 1, 4, 1),
    },
}

EPI_PLAIN, EPI_SWIGLU, EPI_DSWIGLU = 0, 1, 2  # EPI_PLAIN: the accumulator as C's dtype
DS_CHUNK = 64  # dh columns per dscore partial (fixed: the partials do not depend on the dgrad tile)
_GROUPED_OPS = ("moe_up_swiglu", "moe_down", "moe_dgrad_dswiglu", "moe_dx_route")
_WGRAD_OPS = ("moe_wgrad_w1", "moe_wgrad_w2")
_COMBINE_OPS = ("moe_combine", "moe_dx_gather_sum")


def stage_name(op: str, precision: str = "bf16", **dims: int) -> str:
    """The one name shared by a launch, its NVTX range and its report row."""
    return f"{op} [" + ", ".join(f"{k}={v}" for k, v in dims.items()) + f"] {precision}"


def pinned_stage_config(tables: dict[str, dict[str, GemmConfig]], stage: str, backend: str,
                        what: str = "MoE") -> GemmConfig:
    """``tables[backend][stage]``, refusing an unknown stage or backend by name."""
    stages = tuple(next(iter(tables.values())))
    if stage not in stages:
        raise ValueError(f"stage {stage!r} is not supported; supported: {stages}")
    if backend not in tables:
        raise ValueError(f"backend {backend!r} has no {what} configs; supported: {tuple(tables)}")
    return tables[backend][stage]


def select_moe_config(stage: str, backend: str) -> GemmConfig:
    return pinned_stage_config(MOE_CONFIGS, stage, backend)


def grouped_launch_name(grid, metadata, args):
    op = _GROUPED_OPS[args["op_id"]]
    p, c, l = args["P"], args["C"], args["L"]
    return {"name": stage_name(op, P=p, N=c, K=l), "flops": 2.0 * p * c * l}


def wgrad_launch_name(grid, metadata, args):
    return {"name": stage_name(_WGRAD_OPS[args["op_id"]], R=args["R"], C=args["C"])}


def _scale_meta(grid, metadata, args):
    return {"name": stage_name("moe_scale_rows", P=args["P"], N=args["N"])}


def _combine_meta(grid, metadata, args):
    return {"name": stage_name(_COMBINE_OPS[args["op_id"]], T=args["T"], N=args["N"], K=args["K"])}


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def to_bf16(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        y = fp32_to_bf16_rtne(x)
    else:
        y = x.to(tl.bfloat16)
    return y


@triton.jit
def mma_step(acc, a, b, STEP_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc [M, N] += a [M, STEP_K] @ b [STEP_K, N] with FP32 accumulation, ascending over STEP_K.

    Interpreted: exact products added one at a time (cumsum is sequential there), as det_gemm does."""
    if INTERPRETED:
        offs = tl.arange(0, STEP_K)
        prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]  # [M, STEP_K, N]
        prod = tl.where((offs == 0)[None, :, None], prod + acc[:, None, :], prod)
        acc = tl.sum(tl.where((offs == STEP_K - 1)[None, :, None], tl.cumsum(prod, axis=1), 0.0), axis=1)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _sigmoid(g):
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def tile_is_live(gate_ptr, C, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """False for a tile at or past the routing's P, and for every tile of a batch the routing checks
    refused (gate: P, then the validation counts). A GEMM queued before the host has read the counts
    runs over the largest possible P; these tiles do nothing, not even a store."""
    pid_m = tl.program_id(axis=0) // tl.cdiv(C, BLOCK_N)
    refused = tl.load(gate_ptr + 1) + tl.load(gate_ptr + 2) + tl.load(gate_ptr + 3)
    return (pid_m * BLOCK_M < tl.load(gate_ptr)) & (refused == 0)


@triton.jit
def grouped_tile(C, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEGMENT: tl.constexpr,
                 tile_expert_ptr, route_ptr, a_rows_ptr, GATHER_A: tl.constexpr):
    """This program's tile of a grouped GEMM over expert-sorted rows: ``(pid_n, expert, offs_m,
    offs_n, row_ok, col_ok, a_rows)``. Consecutive programs share the A tile (L2 reuse); a tile
    belongs to one expert because BLOCK_M divides SEGMENT; padding rows are ``row_ok`` False."""
    pid = tl.program_id(axis=0)
    num_pid_n = tl.cdiv(C, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    expert = tl.load(tile_expert_ptr + (pid_m * BLOCK_M) // SEGMENT)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # always < P: BLOCK_M divides SEGMENT
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = tl.load(route_ptr + offs_m) >= 0  # padding rows read nothing and stay zero
    col_ok = offs_n < C
    if GATHER_A:
        a_rows = tl.load(a_rows_ptr + offs_m)  # token row of each expert-sorted row
    else:
        a_rows = offs_m
    return pid_n, expert, offs_m, offs_n, row_ok, col_ok, a_rows


@triton.jit
def store_c_tile(c_ptr, acc, offs_m, offs_n, col_ok, stride_cm, stride_cc, INTERPRETED: tl.constexpr):
    """Epilogue 0 (y of the down-projection, the per-route dX): the FP32 tile rounded once to BF16 when C is BF16
    (ROUTE_DTYPE; the FP8 layer's), else as is."""
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cc  # [BLOCK_M, BLOCK_N]
    if c_ptr.dtype.element_ty == tl.bfloat16:
        acc = to_bf16(acc, INTERPRETED)
    tl.store(c_ptrs, acc, mask=(offs_m[:, None] >= 0) & col_ok[None, :])


@triton.jit
def swiglu_epilogue(acc, c_ptr, h_ptr, offs_m, offs_n, col_ok, pid_n, C, stride_cm, stride_cc, stride_hm, stride_hc,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    """Epilogue 1: gu rounded to BF16 (saved for the backward), h = silu(g) * u from those BF16
    values in FP32, rounded once and stored. Returns ``(h, offs_h, h_ok)`` for a fused consumer."""
    gu = to_bf16(acc, INTERPRETED)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cc  # [BLOCK_M, BLOCK_N]
    tl.store(c_ptrs, gu, mask=(offs_m[:, None] >= 0) & col_ok[None, :])
    g, u = tl.split(tl.reshape(gu.to(tl.float32), (BLOCK_M, BLOCK_N // 2, 2)))  # [BLOCK_M, BLOCK_N/2] each
    h = to_bf16((g * _sigmoid(g)) * u, INTERPRETED)
    offs_h = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    h_ok = (offs_m[:, None] >= 0) & (offs_h < C // 2)[None, :]
    tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_h[None, :] * stride_hc, h, mask=h_ok)
    return h, offs_h, h_ok


@triton.jit
def dswiglu_epilogue(acc, score_ptr, gu_ptr, c_ptr, offs_m, pid_n, C, stride_gm, stride_gc, stride_cm, stride_cc,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    """Epilogue 2: dh = s * acc in FP32, then dg, du from the saved gu, rounded once to BF16 and
    stored interleaved. Returns ``(dgu, offs_j, j_ok)`` for a fused consumer."""
    score = tl.load(score_ptr + offs_m)  # [BLOCK_M] FP32, 0 on padding rows
    dh = acc * score[:, None]
    offs_j = pid_n * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
    j_ok = (offs_m[:, None] >= 0) & (offs_j < 2 * C)[None, :]
    gu_ptrs = gu_ptr + offs_m[:, None] * stride_gm + offs_j[None, :] * stride_gc  # [BLOCK_M, 2*BLOCK_N]
    gu = tl.load(gu_ptrs, mask=j_ok, other=0.0).to(tl.float32)
    g, u = tl.split(tl.reshape(gu, (BLOCK_M, BLOCK_N, 2)))
    s = _sigmoid(g)
    silu = g * s
    # The operation order of kernels/swiglu.py, so the dense and MoE paths share one formula.
    dg = (dh * u) * (s + silu * (1.0 - s))
    du = dh * silu
    dgu = to_bf16(tl.reshape(tl.join(dg, du), (BLOCK_M, 2 * BLOCK_N)), INTERPRETED)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_j[None, :] * stride_cc, dgu, mask=j_ok)
    return dgu, offs_j, j_ok


@triton.jit
def dscore_partials(acc, h_ptr, ds_ptr, offs_m, pid_n, C, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DS_CHUNK: tl.constexpr):
    """ds_part[p, c] = sum over the DS_CHUNK columns j of chunk c of acc[p, j] * h[p, j] in FP32 (acc: the
    unscaled dout @ W2[e].T of the dgrad tile; h: the saved BF16 activation [P, C]; ds_part [P, cdiv(C,
    DS_CHUNK)]; both contiguous). Chunks of a fixed width, so the partials do not depend on BLOCK_N."""
    NCH: tl.constexpr = BLOCK_N // DS_CHUNK
    offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = offs_m[:, None] >= 0
    h = tl.load(h_ptr + offs_m[:, None] * C + offs_j[None, :], mask=rows_ok & (offs_j < C)[None, :], other=0.0)
    part = tl.sum(tl.reshape(acc * h.to(tl.float32), (BLOCK_M, NCH, DS_CHUNK)), axis=2)  # [BLOCK_M, NCH]
    offs_c = pid_n * NCH + tl.arange(0, NCH)
    n_chunks = tl.cdiv(C, DS_CHUNK)
    tl.store(ds_ptr + offs_m[:, None] * n_chunks + offs_c[None, :], part, mask=rows_ok & (offs_c < n_chunks)[None, :])


@triton.jit
def grouped_epilogue(acc, c_ptr, aux_ptr, score_ptr, h_ptr, ds_ptr, offs_m, offs_n, col_ok, pid_n, C, stride_cm,
                     stride_cc, stride_xm, stride_xc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     EPILOGUE: tl.constexpr, DSCORE: tl.constexpr, DS_CHUNK: tl.constexpr, INTERPRETED: tl.constexpr):
    """The BF16 grouped kernels' epilogue (both load paths share it); DSCORE (dgrad only): the dscore
    partials from the same accumulator."""
    if EPILOGUE == 0:  # C's dtype (y of the down-projection, the per-route dX)
        store_c_tile(c_ptr, acc, offs_m, offs_n, col_ok, stride_cm, stride_cc, INTERPRETED)
    elif EPILOGUE == 1:  # SwiGLU: gu and h in BF16
        swiglu_epilogue(acc, c_ptr, aux_ptr, offs_m, offs_n, col_ok, pid_n, C, stride_cm, stride_cc, stride_xm,
                        stride_xc, BLOCK_M, BLOCK_N, INTERPRETED)
    else:  # dSwiGLU: dgu interleaved, BF16
        if DSCORE:  # first: its h tile and products are dead before the dSwiGLU loads gu (no spills on sm_90)
            dscore_partials(acc, h_ptr, ds_ptr, offs_m, pid_n, C, BLOCK_M, BLOCK_N, DS_CHUNK)
        dswiglu_epilogue(acc, score_ptr, aux_ptr, c_ptr, offs_m, pid_n, C, stride_xm, stride_xc, stride_cm,
                         stride_cc, BLOCK_M, BLOCK_N, INTERPRETED)


@triton.jit(launch_metadata=grouped_launch_name)
def moe_grouped_gemm_kernel(
    a_ptr, a_rows_ptr, b_ptr, c_ptr, aux_ptr, h_ptr, ds_ptr,  # h, ds: the dscore partials (DSCORE)
    route_ptr, score_ptr, tile_expert_ptr, gate_ptr,
    P, C, L,  # C[p, :] = A[row(p), :L] @ B[expert(p)][:L, :C]; P padded rows of the grid (multiple of SEGMENT)
    stride_am, stride_al,
    stride_be, stride_bl, stride_bc,
    stride_cm, stride_cc,
    stride_xm, stride_xc,  # aux: h out [P, C/2] (SWIGLU) or gu in [P, 2C] (DSWIGLU)
    op_id,  # names the launch only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEP_K: tl.constexpr,
    SEGMENT: tl.constexpr, GATHER_A: tl.constexpr, EPILOGUE: tl.constexpr, INTERPRETED: tl.constexpr,
    DSCORE: tl.constexpr, DS_CHUNK: tl.constexpr,
):
    if tile_is_live(gate_ptr, C, BLOCK_N, BLOCK_M):
        pid_n, expert, offs_m, offs_n, row_ok, col_ok, a_rows = grouped_tile(
            C, BLOCK_M, BLOCK_N, SEGMENT, tile_expert_ptr, route_ptr, a_rows_ptr, GATHER_A)
        offs_k = tl.arange(0, STEP_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_al  # [BLOCK_M, STEP_K]
        # [STEP_K, BLOCK_N]
        b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bl + offs_n[None, :] * stride_bc

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if tl.sum(row_ok.to(tl.int32), axis=0) > 0:  # a block of padding only does no work
            for k0 in range(0, L, BLOCK_K):
                for kk in tl.static_range(0, BLOCK_K, STEP_K):
                    k_ok = (k0 + kk + offs_k) < L
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, STEP_K]
                    b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [STEP_K, BLOCK_N]
                    acc = mma_step(acc, a, b, STEP_K, INTERPRETED)
                    a_ptrs += STEP_K * stride_al
                    b_ptrs += STEP_K * stride_bl

        grouped_epilogue(acc, c_ptr, aux_ptr, score_ptr, h_ptr, ds_ptr, offs_m, offs_n, col_ok, pid_n, C, stride_cm,
                         stride_cc, stride_xm, stride_xc, BLOCK_M, BLOCK_N, EPILOGUE, DSCORE, DS_CHUNK, INTERPRETED)


@triton.jit(launch_metadata=grouped_launch_name)
def moe_grouped_gemm_tma_kernel(
    a_ptr, a_rows_ptr, b_desc, c_ptr, aux_ptr, h_ptr, ds_ptr,
    route_ptr, score_ptr, tile_expert_ptr, gate_ptr,
    P, C, L,  # as moe_grouped_gemm_kernel; B through a rank-3 TMA descriptor over the weight's storage
    stride_am, stride_al,
    stride_cm, stride_cc,
    stride_xm, stride_xc,
    op_id,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEP_K: tl.constexpr,
    SEGMENT: tl.constexpr, GATHER_A: tl.constexpr, EPILOGUE: tl.constexpr, INTERPRETED: tl.constexpr,
    B_K_MAJOR: tl.constexpr,  # storage [E, C, L] (e.g. W2[e].T for dgrad): box [1, BLOCK_N, STEP_K]
    DSCORE: tl.constexpr, DS_CHUNK: tl.constexpr,
):
    """moe_grouped_gemm_kernel with the expert's weight tile loaded by TMA (zero fill past the
    expert's own extents, so no other expert's rows leak in): the same tiles, the same ascending K
    steps and epilogues; the gathered activation rows stay pointer loads."""
    if tile_is_live(gate_ptr, C, BLOCK_N, BLOCK_M):
        pid_n, expert, offs_m, offs_n, row_ok, col_ok, a_rows = grouped_tile(
            C, BLOCK_M, BLOCK_N, SEGMENT, tile_expert_ptr, route_ptr, a_rows_ptr, GATHER_A)
        off_n = pid_n * BLOCK_N
        offs_k = tl.arange(0, STEP_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_al  # [BLOCK_M, STEP_K]

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if tl.sum(row_ok.to(tl.int32), axis=0) > 0:  # a block of padding only does no work
            for k0 in range(0, L, BLOCK_K):
                for kk in tl.static_range(0, BLOCK_K, STEP_K):
                    k = k0 + kk
                    k_ok = (k + offs_k) < L
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, STEP_K]
                    if B_K_MAJOR:
                        b = tl.trans(b_desc.load([expert, off_n, k]).reshape(BLOCK_N, STEP_K))  # [STEP_K, BLOCK_N]
                    else:
                        b = b_desc.load([expert, k, off_n]).reshape(STEP_K, BLOCK_N)
                    acc = mma_step(acc, a, b, STEP_K, INTERPRETED)
                    a_ptrs += STEP_K * stride_al

        grouped_epilogue(acc, c_ptr, aux_ptr, score_ptr, h_ptr, ds_ptr, offs_m, offs_n, col_ok, pid_n, C, stride_cm,
                         stride_cc, stride_xm, stride_xc, BLOCK_M, BLOCK_N, EPILOGUE, DSCORE, DS_CHUNK, INTERPRETED)


@triton.jit(launch_metadata=wgrad_launch_name)
def moe_wgrad_kernel(
    a_ptr, b_ptr, rows_ptr, score_ptr, dw_ptr,
    offsets_ptr, counts_ptr,
    R, C,  # dW[e] [R, C] = sum over e's rows p (ascending) of A[arow(p), :R]^T B[brow(p), :C]
    stride_am, stride_ar,
    stride_bm, stride_bc,
    stride_we, stride_wr, stride_wc,
    op_id,  # names the launch only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STEP_K: tl.constexpr,
    GATHER_A: tl.constexpr, ACCUMULATE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    num_pid_r = tl.cdiv(R, BLOCK_M)
    num_pid_c = tl.cdiv(C, BLOCK_N)
    expert = pid // (num_pid_r * num_pid_c)
    rem = pid % (num_pid_r * num_pid_c)
    pid_r = rem // num_pid_c
    pid_c = rem % num_pid_c
    start = tl.load(offsets_ptr + expert)
    count = tl.load(counts_ptr + expert)

    offs_r = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = pid_c * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, STEP_K)
    r_ok = offs_r < R
    c_ok = offs_c < C
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, count, BLOCK_K):  # the expert's rows, ascending: a function of count alone
        for kk in tl.static_range(0, BLOCK_K, STEP_K):
            p_ok = (k0 + kk + offs_k) < count
            p = start + k0 + kk + offs_k
            if GATHER_A:
                a_rows = tl.load(rows_ptr + p, mask=p_ok, other=0)
            else:
                a_rows = p
            a_ptrs = a_ptr + a_rows[None, :] * stride_am + offs_r[:, None] * stride_ar  # [BLOCK_M, STEP_K]
            a = tl.load(a_ptrs, mask=r_ok[:, None] & p_ok[None, :], other=0.0)
            b_ptrs = b_ptr + p[:, None] * stride_bm + offs_c[None, :] * stride_bc  # [STEP_K, BLOCK_N]
            b = tl.load(b_ptrs, mask=p_ok[:, None] & c_ok[None, :], other=0.0)
            acc = mma_step(acc, a, b, STEP_K, INTERPRETED)

    w_ptrs = dw_ptr + expert * stride_we + offs_r[:, None] * stride_wr + offs_c[None, :] * stride_wc
    w_mask = r_ok[:, None] & c_ok[None, :]
    if ACCUMULATE:  # main_grad += dW in FP32; an expert without rows leaves it untouched
        w_mask = w_mask & (count > 0)
        tl.store(w_ptrs, tl.load(w_ptrs, mask=w_mask, other=0.0) + acc, mask=w_mask)
    else:
        tl.store(w_ptrs, to_bf16(acc, INTERPRETED), mask=w_mask)


@triton.jit(launch_metadata=_scale_meta)
def moe_scale_rows_kernel(
    src_ptr, rows_ptr, score_ptr, route_ptr, out_ptr,
    P, N,  # out[p, :N] = bf16(score[p] * src[rows[p], :N]), one rounding of the FP32 product; padding rows 0
    stride_sm, stride_sn, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // num_pid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < P
    mask = m_ok[:, None] & (offs_n < N)[None, :]
    rows = tl.load(rows_ptr + offs_m, mask=m_ok, other=0)
    s = tl.load(score_ptr + offs_m, mask=m_ok, other=0.0)
    # A padding row reads nothing and is +0 exactly (not 0 * the row of token 0, which may hold an Inf): a weight
    # gradient that reads whole row blocks (kernels/moe_ws.py) then adds only zeros for it.
    routed = tl.load(route_ptr + offs_m, mask=m_ok, other=-1) >= 0
    x = tl.load(src_ptr + rows[:, None] * stride_sm + offs_n[None, :] * stride_sn, mask=mask & routed[:, None],
                other=0.0)
    y = to_bf16(x.to(tl.float32) * s[:, None], INTERPRETED)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, y, mask=mask)


@triton.jit(launch_metadata=_combine_meta)
def moe_combine_kernel(
    src_ptr, route_row_ptr, score_ptr, out_ptr,
    T, N, K,  # out[t, :N] = bf16(sum_{k ascending, route valid} w[t, k] * src[route_row[t, k], :N])
    stride_sm, stride_sn, stride_rt, stride_rk, stride_st, stride_sk, stride_ot, stride_on,
    op_id,  # names the launch only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr, INTERPRETED: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_t = pid // num_pid_n
    pid_n = pid % num_pid_n
    offs_t = pid_t * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = offs_t < T
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K):
        rows = tl.load(route_row_ptr + offs_t * stride_rt + k * stride_rk, mask=t_ok, other=-1)
        ok = rows >= 0
        # [BLOCK_M, BLOCK_N]: BF16 rows (ROUTE_DTYPE FP32: FP32 rows), exact in FP32
        v = tl.load(src_ptr + rows[:, None] * stride_sm + offs_n[None, :] * stride_sn,
                    mask=ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        if SCALED:
            w = tl.load(score_ptr + offs_t * stride_st + k * stride_sk, mask=ok, other=0.0).to(tl.float32)
            v = w[:, None] * v
        acc = tl.where(ok[:, None], acc + v, acc)  # a masked route contributes nothing, not even +0
    out_ptrs = out_ptr + offs_t[:, None] * stride_ot + offs_n[None, :] * stride_on
    tl.store(out_ptrs, to_bf16(acc, INTERPRETED), mask=t_ok[:, None] & n_ok[None, :])


@triton.jit
def moe_dscore_sum_kernel(
    part_ptr, route_row_ptr, ds_ptr,
    T, K, NCH,  # ds[t, k] = sum_c part[route_row[t, k], c] (FP32, a fixed tree over NCH), 0 when masked
    stride_rt, stride_rk, stride_st, stride_sk,
    BLOCK_M: tl.constexpr, NCH_POW2: tl.constexpr,
):
    pid_t = tl.program_id(axis=0)
    offs_t = pid_t * BLOCK_M + tl.arange(0, BLOCK_M)
    t_ok = offs_t < T
    offs_c = tl.arange(0, NCH_POW2)
    for k in range(0, K):
        rows = tl.load(route_row_ptr + offs_t * stride_rt + k * stride_rk, mask=t_ok, other=-1)
        part = tl.load(part_ptr + rows[:, None] * NCH + offs_c[None, :],
                       mask=(rows >= 0)[:, None] & (offs_c < NCH)[None, :], other=0.0)  # [BLOCK_M, NCH_POW2]
        tl.store(ds_ptr + offs_t * stride_st + k * stride_sk, tl.sum(part, axis=1), mask=t_ok)


# ---------------------------------------------------------------------------------------------
# Input checks (all before any work)
# ---------------------------------------------------------------------------------------------
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
    return resolve_backend(moe_grouped_gemm_kernel, {"x": x, "w1": w1, "w2": w2, "topk_ids": topk_ids,
                                                     "scores": scores})


def check_main_grads(main_grads, w1: torch.Tensor, w2: torch.Tensor) -> None:
    if main_grads is None:
        return
    if not isinstance(main_grads, (tuple, list)) or len(main_grads) != 2:
        raise TypeError(f"main_grads must be a pair (main_grad_w1, main_grad_w2) or None; got {type(main_grads).__name__}")
    for name, g, w in (("main_grad_w1", main_grads[0], w1), ("main_grad_w2", main_grads[1], w2)):
        if not isinstance(g, torch.Tensor) or g.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor; got {getattr(g, 'dtype', type(g).__name__)}")
        if g.shape != w.shape or g.device != w.device:
            raise ValueError(f"{name} must match its weight's shape {tuple(w.shape)} on {w.device}; "
                             f"got {tuple(g.shape)} on {g.device}")
        if any(s < 0 for s in g.stride()):
            raise ValueError(f"{name} has negative strides {g.stride()}")


# ---------------------------------------------------------------------------------------------
# Launch wrappers: check, allocate, launch.
# ---------------------------------------------------------------------------------------------
def _backend_flags(backend: str, config: GemmConfig) -> dict:
    interpreted = backend == TRITON_INTERPRETER
    return {"STEP_K": interpreter_step_k(config) if interpreted else config.block_k, "INTERPRETED": interpreted}


MOE_VARIANTS = ("ptr", "tma")  # det_gemm's "tma3" has no MoE kernel; "ws" (Gluon, sm_90): _check_ws


def check_moe_variant(stage: str, config: GemmConfig) -> None:
    if config.variant not in MOE_VARIANTS:
        raise ValueError(f"{stage}: variant {config.variant!r} is not supported by the MoE kernels; "
                         f"supported: {MOE_VARIANTS}")


def check_grouped_config(stage: str, config: GemmConfig) -> None:
    """A grouped-GEMM config the MoE kernels can run: a MoE variant, BLOCK_M dividing the segments."""
    check_moe_variant(stage, config)
    if SEGMENT_ALIGN % config.block_m:
        raise ValueError(f"{stage}: BLOCK_M {config.block_m} must divide the segment alignment {SEGMENT_ALIGN}")


def _weight_storage(b: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """The storage view TMA would describe for the ``[E, L, C]`` weight view ``b`` and whether it is
    K-major (``[E, C, L]``), or None when TMA cannot address it."""
    if b.stride(2) == 1:
        store, k_major = b, False
    elif b.stride(1) == 1:
        store, k_major = b.transpose(1, 2), True
    else:
        return None
    item = b.element_size()
    if any(st * item % 16 for st in store.stride()[:2]) or b.data_ptr() % 16:
        return None
    return store, k_major


def ws_weight_rows(b: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """The 2-D ``[E*L, C]`` (K-major: ``[E*C, L]``) view of the ``[E, L, C]`` weight view ``b``'s storage that the
    "ws" kernel (kernels/moe_ws.py) describes by TMA, and whether it is K-major; None when TMA cannot address the
    storage or its expert dim does not flatten into rows without a copy."""
    found = _weight_storage(b)
    if found is None:
        return None
    store, k_major = found
    if store.stride(0) != store.shape[1] * store.stride(1):
        return None
    return store.reshape(-1, store.shape[2]), k_major


def weight_descriptor(b: torch.Tensor, block_n: int, step_k: int) -> tuple[TensorDescriptor, bool]:
    """A rank-3 TMA descriptor over the storage of the ``[E, L, C]`` weight view ``b`` and whether that
    storage is K-major (``[E, C, L]``); refuses, naming the layout, what TMA cannot address."""
    found = _weight_storage(b)
    if found is None:
        raise ValueError(
            f"variant 'tma' cannot describe the weight (shape {tuple(b.shape)}, strides {b.stride()}, "
            f"data_ptr % 16 = {b.data_ptr() % 16}): TMA needs its last or middle dim with stride 1, the other "
            f"strides multiples of {16 // b.element_size()} elements and a 16-byte-aligned base; use a 'ptr' config")
    store, k_major = found
    if b.is_cuda:  # the launch encodes the descriptor; autograd's backward thread may have no context yet
        ensure_cuda_context(b.device)
    box = [1, block_n, step_k] if k_major else [1, step_k, block_n]
    return TensorDescriptor(store, list(store.shape), list(store.stride()), box), k_major


def _check_ws(stage: str, config: GemmConfig, backend: str) -> None:
    """Variant "ws" (kernels/moe_ws.py): Gluon kernels for sm_90, down and dX (expert-sorted A, FP32 or BF16 out), up and
    dgrad (gathered A, their epilogues), the weight gradients."""
    if backend != CUDA_SM90:
        raise ValueError(f"{stage}: variant 'ws' is a Gluon kernel for sm_90 and has no {backend!r} path; use a "
                         "'ptr' or 'tma' config there")


def _ws_addresses(config: GemmConfig, b: torch.Tensor) -> bool:
    """Whether the ws kernels can take the ``[E, L, C]`` weight view ``b`` with ``config``'s tile: its storage
    flattens into TMA rows and the tile divides L x C."""
    return ws_weight_rows(b) is not None and b.shape[1] % config.block_k == 0 and b.shape[2] % config.block_n == 0


def table_moe_config(stage: str, backend: str, b: torch.Tensor) -> GemmConfig:
    """The table's pick for a grouped ``stage``; when the pick's kernel cannot address the weight view ``b``, the
    same tile one load path down: "ws" -> "tma" (see _ws_addresses), "tma" -> "ptr" (TMA cannot address it). The
    variant changes the load path only (same K order per output, same epilogue, so the same bits): an explicit
    config is never swapped."""
    config = select_moe_config(stage, backend)
    if config.variant == "ws" and not _ws_addresses(config, b):
        config = replace(config, variant="tma")
    if config.variant == "tma" and _weight_storage(b) is None:
        config = replace(config, variant="ptr")
    return config


def _grouped(op_id: int, stage: str, a: torch.Tensor, gather: bool, b: torch.Tensor, c: torch.Tensor,
             aux: torch.Tensor | None, routing: MoeRouting, n_cols: int, reduced: int, epilogue: int,
             backend: str, config: GemmConfig | None,
             dscore: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """b is a [E, L, C] view (strides kept); ``dscore = (h, ds_part)`` (dgrad only) adds the partials."""
    config = config or table_moe_config(stage, backend, b)
    if config.variant == "ws":  # the Gluon kernels (kernels/moe_ws.py): sm_90
        _check_ws(stage, config, backend)
        if routing.padded_rows:
            from detkit.kernels.moe_ws import launch_moe_ws, launch_moe_ws_gather  # kernels.moe_ws imports this module

            ensure_cuda_context(a.device)  # the descriptors encode on this thread, as TMA's do
            if gather:
                launch_moe_ws_gather(op_id, stage, config, epilogue, a, b, c, aux, routing, dscore,
                                     device_sms(a.device))
            else:
                launch_moe_ws(op_id, stage, config, a, b, c, routing, device_sms(a.device))
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
        b_desc, k_major = weight_descriptor(b, config.block_n, flags["STEP_K"])
        moe_grouped_gemm_tma_kernel[grid](
            a, routing.gather_token, b_desc, c, aux_t, h_t, ds_t,
            routing.sorted_route, routing.row_score, routing.tile_expert, routing.gate,
            p, n_cols, reduced,
            a.stride(0), a.stride(1),
            c.stride(0), c.stride(1),
            aux_t.stride(0), aux_t.stride(1),
            op_id,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SEGMENT=SEGMENT_ALIGN,
            GATHER_A=gather, EPILOGUE=epilogue, B_K_MAJOR=k_major, num_warps=config.num_warps,
            num_stages=config.num_stages, **flags, **fused,
        )
        return
    moe_grouped_gemm_kernel[grid](
        a, routing.gather_token, b, c, aux_t, h_t, ds_t,
        routing.sorted_route, routing.row_score, routing.tile_expert, routing.gate,
        p, n_cols, reduced,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1),
        aux_t.stride(0), aux_t.stride(1),
        op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SEGMENT=SEGMENT_ALIGN,
        GATHER_A=gather, EPILOGUE=epilogue, num_warps=config.num_warps, num_stages=config.num_stages,
        **flags, **fused,
    )


def moe_up_swiglu(x: torch.Tensor, w1: torch.Tensor, routing: MoeRouting, backend: str,
                  config: GemmConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gu [P, 2I] = x[gather] @ W1[e] (BF16, interleaved) and h [P, I] = silu(g) * u (BF16)."""
    config = config or table_moe_config("up", backend, w1)
    if config.block_n % 2:
        raise ValueError(f"up: BLOCK_N {config.block_n} must be even (gate/up pairs)")
    two_i = w1.shape[2]
    gu = torch.empty((routing.padded_rows, two_i), dtype=torch.bfloat16, device=x.device)
    h = torch.empty((routing.padded_rows, two_i // 2), dtype=torch.bfloat16, device=x.device)
    _grouped(0, "up", x, True, w1, gu, h, routing, two_i, x.shape[1], EPI_SWIGLU, backend, config)
    return gu, h


def route_dtype() -> torch.dtype:
    """ROUTE_DTYPE, refused by name when set to a dtype the grouped kernels do not write."""
    if ROUTE_DTYPE not in ROUTE_DTYPES:
        raise ValueError(f"detkit.kernels.moe.ROUTE_DTYPE is {ROUTE_DTYPE}; supported: {ROUTE_DTYPES}")
    return ROUTE_DTYPE


def moe_down(h: torch.Tensor, w2: torch.Tensor, routing: MoeRouting, backend: str,
             config: GemmConfig | None = None) -> torch.Tensor:
    """y [P, H] = h @ W2[e]: the FP32 accumulator in ROUTE_DTYPE (BF16: rounded once; the combine sums in FP32)."""
    y = torch.empty((routing.padded_rows, w2.shape[2]), dtype=route_dtype(), device=h.device)
    _grouped(1, "down", h, False, w2, y, None, routing, w2.shape[2], w2.shape[1], EPI_PLAIN, backend, config)
    return y


def _dgrad(dout: torch.Tensor, w2: torch.Tensor, gu: torch.Tensor, routing: MoeRouting, backend: str,
           config: GemmConfig | None, dscore: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    dgu = torch.empty_like(gu)
    w2_t = w2.transpose(1, 2)  # [E, H, I] view
    _grouped(2, "dgrad", dout, True, w2_t, dgu, gu, routing, w2.shape[1], w2.shape[2], EPI_DSWIGLU,
             backend, config, dscore)
    return dgu


def moe_dgrad_dswiglu(dout: torch.Tensor, w2: torch.Tensor, gu: torch.Tensor, routing: MoeRouting,
                      backend: str, config: GemmConfig | None = None) -> torch.Tensor:
    """dgu [P, 2I] (BF16, interleaved): dSwiGLU of dh = s * (dout[gather] @ W2[e].T), fused."""
    return _dgrad(dout, w2, gu, routing, backend, config, None)


def moe_dgrad_dswiglu_dscore(dout: torch.Tensor, w2: torch.Tensor, gu: torch.Tensor, h: torch.Tensor,
                             routing: MoeRouting, backend: str,
                             config: GemmConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_dgrad_dswiglu`` (the same dgu bits) plus, from the same accumulator, the dscore partials
    ds_part [P, cdiv(I, 64)] FP32: ds_part[p, c] = sum over chunk c's columns j of (dout[t] @ W2[e].T)[j] *
    h[p, j], with h [P, I] the forward's saved activation. dout . y_k needs no y: y = h @ W2[e]."""
    if not h.is_contiguous() or tuple(h.shape) != (gu.shape[0], gu.shape[1] // 2) or h.dtype != torch.bfloat16:
        raise ValueError(f"h must be the forward's contiguous bf16 [P, I] = {(gu.shape[0], gu.shape[1] // 2)}; "
                         f"got {h.dtype} {tuple(h.shape)}, contiguous={h.is_contiguous()}")
    ds_part = torch.empty((gu.shape[0], triton.cdiv(h.shape[1], DS_CHUNK)), dtype=torch.float32, device=gu.device)
    return _dgrad(dout, w2, gu, routing, backend, config, (h, ds_part)), ds_part


def moe_dx_route(dgu: torch.Tensor, w1: torch.Tensor, routing: MoeRouting, backend: str,
                 config: GemmConfig | None = None) -> torch.Tensor:
    """dx_route [P, H] = dgu @ W1[e].T: the FP32 accumulator in ROUTE_DTYPE (the gather-sum sums in FP32)."""
    dxr = torch.empty((routing.padded_rows, w1.shape[1]), dtype=route_dtype(), device=dgu.device)
    _grouped(3, "dx", dgu, False, w1.transpose(1, 2), dxr, None, routing, w1.shape[1], w1.shape[2],
             EPI_PLAIN, backend, config)
    return dxr


def _combine(op_id: int, src: torch.Tensor, routing: MoeRouting, scores: torch.Tensor | None,
             backend: str, config: GemmConfig | None) -> torch.Tensor:
    config = config or select_moe_config("combine", backend)
    t_count, k_count, n = routing.num_tokens, routing.top_k, src.shape[1]
    out = torch.empty((t_count, n), dtype=torch.bfloat16, device=src.device)
    sc = scores if scores is not None else routing.route_row  # unused when unscaled
    grid = (triton.cdiv(t_count, config.block_m) * triton.cdiv(n, config.block_n),)
    moe_combine_kernel[grid](
        src, routing.route_row, sc, out, t_count, n, k_count,
        src.stride(0), src.stride(1), routing.route_row.stride(0), routing.route_row.stride(1),
        sc.stride(0), sc.stride(1), out.stride(0), out.stride(1), op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, SCALED=scores is not None,
        INTERPRETED=backend == TRITON_INTERPRETER, num_warps=config.num_warps,
    )
    return out


def moe_combine(y: torch.Tensor, routing: MoeRouting, scores: torch.Tensor, backend: str,
                config: GemmConfig | None = None) -> torch.Tensor:
    """out [T, H] = bf16(sum over k ascending of scores[t, k] * y[route_row[t, k]]) (FP32 sum; y FP32 or BF16)."""
    return _combine(0, y, routing, scores, backend, config)


def moe_gather_sum(dx_route: torch.Tensor, routing: MoeRouting, backend: str,
                   config: GemmConfig | None = None) -> torch.Tensor:
    """dx [T, H] = bf16(sum over k ascending of dx_route[route_row[t, k]]) (FP32 sum)."""
    return _combine(1, dx_route, routing, None, backend, config)


def ws_wgrad_addresses(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the ws weight gradient can take A and B (row-major with 16-byte aligned rows: TMA, cp.async) and
    write ``out`` (contiguous)."""
    return out.is_contiguous() and all(
        t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0 for t in (a, b))


def _ws_wgrad_takes(config: GemmConfig, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the ws weight gradient can run ``config`` on these operands: addressable, the tile dividing dW."""
    _, r, c = out.shape
    return ws_wgrad_addresses(a, b, out) and r % config.block_m == 0 and c % config.block_n == 0


def _wgrad(op_id: int, a: torch.Tensor, gather_a: bool, b: torch.Tensor, routing: MoeRouting,
           out: torch.Tensor, accumulate: bool, backend: str, config: GemmConfig | None) -> None:
    if config is None:
        config = select_moe_config("wgrad", backend)
        if config.variant == "ws" and not _ws_wgrad_takes(config, a, b, out):
            config = replace(config, variant="ptr")  # the same tile and K order on the Triton kernel: the same bits
    if config.variant == "ws":  # the Gluon kernel (kernels/moe_ws.py): sm_90
        _check_ws("wgrad", config, backend)
        from detkit.kernels.moe_ws import launch_moe_ws_wgrad  # kernels.moe_ws imports this module

        ensure_cuda_context(a.device)  # the descriptors encode on this thread, as TMA's do
        launch_moe_ws_wgrad(op_id, config, a, gather_a, b, out, accumulate, routing, device_sms(a.device))
        return
    check_moe_variant("wgrad", config)
    experts, r, c = out.shape
    grid = (experts * triton.cdiv(r, config.block_m) * triton.cdiv(c, config.block_n),)
    moe_wgrad_kernel[grid](
        a, b, routing.gather_token, routing.row_score, out,
        routing.expert_offsets, routing.expert_counts,
        r, c, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), out.stride(2), op_id,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GATHER_A=gather_a, ACCUMULATE=accumulate,
        num_warps=config.num_warps, num_stages=config.num_stages, **_backend_flags(backend, config),
    )


def moe_scale_rows(dout: torch.Tensor, routing: MoeRouting, backend: str,
                   config: GemmConfig | None = None) -> torch.Tensor:
    """dy [P, H] bf16 = bf16(row_score[p] * dout[gather_token[p]]), padding rows +0: dW2's B operand in
    expert-sorted order. Forming it here, not on load inside the dW2 K loop, keeps that loop a plain
    load-to-shared-memory GEMM; the product and its one rounding are the same."""
    config = config or select_moe_config("combine", backend)
    rows, cols = routing.padded_rows, dout.shape[1]
    dy = torch.empty((rows, cols), dtype=torch.bfloat16, device=dout.device)
    grid = (triton.cdiv(rows, config.block_m) * triton.cdiv(cols, config.block_n),)
    moe_scale_rows_kernel[grid](
        dout, routing.gather_token, routing.row_score, routing.sorted_route, dy, rows, cols,
        dout.stride(0), dout.stride(1), dy.stride(0), dy.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, INTERPRETED=backend == TRITON_INTERPRETER,
        num_warps=config.num_warps,
    )
    return dy


def moe_wgrad_w1(x: torch.Tensor, dgu: torch.Tensor, routing: MoeRouting, backend: str,
                 main_grad: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor | None:
    """dW1[e] [H, 2I] = x[gather]^T @ dgu over e's rows (BF16), or main_grad += it in FP32 (returns None)."""
    experts = routing.num_experts
    out = main_grad if main_grad is not None else torch.empty(
        (experts, x.shape[1], dgu.shape[1]), dtype=torch.bfloat16, device=x.device)
    _wgrad(0, x, True, dgu, routing, out, main_grad is not None, backend, config)
    return None if main_grad is not None else out


def moe_wgrad_w2(h: torch.Tensor, dout: torch.Tensor, routing: MoeRouting, backend: str,
                 main_grad: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor | None:
    """dW2[e] [I, H] = h^T @ dy over e's rows (BF16), or main_grad += it in FP32, with
    dy = bf16(s * dout[gather]) formed once per expert-sorted row by ``moe_scale_rows``."""
    experts = routing.num_experts
    out = main_grad if main_grad is not None else torch.empty(
        (experts, h.shape[1], dout.shape[1]), dtype=torch.bfloat16, device=h.device)
    dy = moe_scale_rows(dout, routing, backend)
    _wgrad(1, h, False, dy, routing, out, main_grad is not None, backend, config)
    return None if main_grad is not None else out


def moe_dscores_from_partials(ds_part: torch.Tensor, routing: MoeRouting, backend: str,
                              config: GemmConfig | None = None) -> torch.Tensor:
    """ds [T, K] FP32 = sum_c ds_part[route_row[t, k], c] (0 for masked routes): the BF16 layer's dscores."""
    config = config or select_moe_config("dscore", backend)
    t_count, k_count = routing.num_tokens, routing.top_k
    ds = torch.empty((t_count, k_count), dtype=torch.float32, device=ds_part.device)
    n_chunks = ds_part.shape[1]
    moe_dscore_sum_kernel[(triton.cdiv(t_count, config.block_m),)](
        ds_part, routing.route_row, ds, t_count, k_count, n_chunks,
        routing.route_row.stride(0), routing.route_row.stride(1), ds.stride(0), ds.stride(1),
        BLOCK_M=config.block_m, NCH_POW2=triton.next_power_of_2(n_chunks), num_warps=config.num_warps,
    )
    return ds


# ---------------------------------------------------------------------------------------------
# Whole-layer forward / backward and the autograd Function
# ---------------------------------------------------------------------------------------------
@dataclass
class MoeSaved:
    """What the backward needs: gu, h in BF16 (y is not kept: dscores come from h, fused into dgrad)."""

    backend: str
    routing: MoeRouting
    x: torch.Tensor  # [T, H]
    w1: torch.Tensor  # [E, H, 2I]
    w2: torch.Tensor  # [E, I, H]
    scores: torch.Tensor  # [T, K]
    gu: torch.Tensor  # [P, 2I] interleaved pre-activations
    h: torch.Tensor  # [P, I]


@dataclass
class MoeGrads:
    dx: torch.Tensor  # [T, H] bf16
    dw1: torch.Tensor | None  # [E, H, 2I] bf16; None when accumulated into main_grad
    dw2: torch.Tensor | None  # [E, I, H] bf16; None when accumulated into main_grad
    dscores: torch.Tensor  # [T, K], scores' dtype


LAYER_STAGES = ("routing", "up_swiglu", "down", "combine", "dgrad_dswiglu", "dx", "wgrad", "dscores")


def layer_stage_names(x: torch.Tensor, w1: torch.Tensor, k: int, stages=LAYER_STAGES,
                      precision: str = "bf16") -> dict[str, str]:
    """Stage -> the NVTX range / row name of that stage of one layer call."""
    t, h = x.shape
    e, _, two_i = w1.shape
    dims = {"T": t, "H": h, "I": two_i // 2, "E": e, "K": k}
    return {stage: stage_name(f"moe_{stage}", precision, **dims) for stage in stages}


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


def check_dout(dout: torch.Tensor, x: torch.Tensor) -> None:
    check_bf16_matrix("dout", dout)
    if tuple(dout.shape) != tuple(x.shape) or dout.device != x.device:
        raise ValueError(f"dout must be {tuple(x.shape)} on {x.device}; got {tuple(dout.shape)} on {dout.device}")


def moe_mlp_fwd(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                scores: torch.Tensor, *, stage_range=None) -> tuple[torch.Tensor, MoeSaved]:
    """out [T, H] bf16 and the saved state for ``moe_mlp_bwd``.

    x [T, H] bf16; w1 [E, H, 2I] bf16 interleaved; w2 [E, I, H] bf16; topk_ids [T, K] int32 (-1 masked);
    scores [T, K] float32 or bf16. ``stage_range(name)`` (e.g. an NVTX range) wraps each stage.
    """
    backend = check_moe_inputs(x, w1, w2, topk_ids, scores)
    rng = stage_range or (lambda name: nullcontext())
    names = layer_stage_names(x, w1, topk_ids.shape[1])
    with rng(names["routing"]):
        pending = launch_checked_routing(x, w1, topk_ids, scores)
    with rng(names["up_swiglu"]):  # queued before the counts are read: over the largest P, gated on the device
        gu, h = moe_up_swiglu(x, w1, pending.bound, backend)
    with rng(names["routing"]):
        routing = pending.finish()  # refuses a bad batch; the up GEMM computed nothing from it
        gu, h = gu[:routing.padded_rows], h[:routing.padded_rows]
    with rng(names["down"]):
        y = moe_down(h, w2, routing, backend)
    with rng(names["combine"]):
        out = moe_combine(y, routing, scores, backend)
    return out, MoeSaved(backend, routing, x, w1, w2, scores, gu, h)


def moe_mlp_bwd(dout: torch.Tensor, saved: MoeSaved, *, main_grads=None, stage_range=None) -> MoeGrads:
    """Gradients of ``moe_mlp_fwd`` for dout [T, H] bf16. With ``main_grads = (g1, g2)`` (FP32, the
    weights' shapes) dW1/dW2 are added into them in FP32 and returned as None."""
    check_dout(dout, saved.x)
    check_main_grads(main_grads, saved.w1, saved.w2)
    rng = stage_range or (lambda name: nullcontext())
    names = layer_stage_names(saved.x, saved.w1, saved.routing.top_k)
    backend, routing = saved.backend, saved.routing
    with rng(names["dgrad_dswiglu"]):
        dgu, ds_part = moe_dgrad_dswiglu_dscore(dout, saved.w2, saved.gu, saved.h, routing, backend)
    with rng(names["dx"]):
        dx = moe_gather_sum(moe_dx_route(dgu, saved.w1, routing, backend), routing, backend)
    with rng(names["wgrad"]):
        mg1, mg2 = main_grads if main_grads is not None else (None, None)
        dw1 = moe_wgrad_w1(saved.x, dgu, routing, backend, mg1)
        dw2 = moe_wgrad_w2(saved.h, dout, routing, backend, mg2)
    with rng(names["dscores"]):
        ds = moe_dscores_from_partials(ds_part, routing, backend).to(saved.scores.dtype)
    return MoeGrads(dx, dw1, dw2, ds)


class MoeMlpFunction(torch.autograd.Function):
    """autograd wrapper: (x, w1, w2, topk_ids, scores, main_grad_w1, main_grad_w2) -> out."""

    @staticmethod
    def forward(ctx, x, w1, w2, topk_ids, scores, main_grad_w1=None, main_grad_w2=None):
        main_grads = None if main_grad_w1 is None and main_grad_w2 is None else (main_grad_w1, main_grad_w2)
        check_main_grads(main_grads, w1, w2)
        out, saved = moe_mlp_fwd(x, w1, w2, topk_ids, scores)
        ctx.saved = saved
        ctx.main_grads = main_grads
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = moe_mlp_bwd(dout, ctx.saved, main_grads=ctx.main_grads)  # any strides, no copy
        ctx.saved = None
        return grads.dx, grads.dw1, grads.dw2, None, grads.dscores, None, None


def moe_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, scores: torch.Tensor,
            main_grads: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Differentiable deterministic MoE expert MLP. With ``main_grads`` the weight gradients are
    accumulated into those FP32 buffers (Megatron's gradient-accumulation fusion) and w1.grad /
    w2.grad stay None."""
    mg1, mg2 = main_grads if main_grads is not None else (None, None)
    return MoeMlpFunction.apply(x, w1, w2, topk_ids, scores, mg1, mg2)


# ---------------------------------------------------------------------------------------------
# Layout converters and pure-torch references
# ---------------------------------------------------------------------------------------------
def interleave_gate_up(w: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Split-half [gate (I); up (I)] along ``dim`` -> interleaved (gate_0, up_0, gate_1, up_1, ...). Copies."""
    d = dim % w.dim()
    if w.shape[d] % 2:
        raise ValueError(f"dim {dim} of shape {tuple(w.shape)} must be even (gate and up halves)")
    gate, up = w.chunk(2, dim=d)
    return torch.stack((gate, up), dim=d + 1).flatten(d, d + 1)


def deinterleave_gate_up(w: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Interleaved -> split-half [gate; up] along ``dim`` (the inverse of ``interleave_gate_up``). Copies."""
    d = dim % w.dim()
    if w.shape[d] % 2:
        raise ValueError(f"dim {dim} of shape {tuple(w.shape)} must be even (gate/up pairs)")
    pairs = w.unflatten(d, (w.shape[d] // 2, 2))
    return torch.cat((pairs.select(d + 1, 0), pairs.select(d + 1, 1)), dim=d)


def moe_mlp_ref(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, scores: torch.Tensor,
                dout: torch.Tensor | None = None, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """The layer in plain torch, every op in ``dtype`` (float64: the oracle; bfloat16: a PyTorch gold
    whose intermediates round to BF16 as an eager model would). Per-expert matmuls, autograd for the
    backward. Returns out and, with ``dout``, dx, dw1, dw2, dscores (all in ``dtype``)."""
    xr = x.detach().to(dtype).requires_grad_(dout is not None)
    w1r = w1.detach().to(dtype).requires_grad_(dout is not None)
    w2r = w2.detach().to(dtype).requires_grad_(dout is not None)
    sr = scores.detach().to(dtype).requires_grad_(dout is not None)
    t_count, k_count = topk_ids.shape
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    ys = {}
    for e in range(w1.shape[0]):
        tok, kk = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = xr[tok] @ w1r[e]
        h = torch.nn.functional.silu(gu[:, 0::2]) * gu[:, 1::2]
        ys[e] = (tok, kk, h @ w2r[e])
    for k in range(k_count):  # ascending k, like the kernel
        for e, (tok, kk, y) in ys.items():
            sel = kk == k
            if sel.any():
                out = out.index_add(0, tok[sel], sr[tok[sel], k, None] * y[sel])
    result = {"out": out.detach()}
    if dout is not None:
        out.backward(dout.to(dtype))
        result.update({name: t.grad if t.grad is not None else torch.zeros_like(t)
                       for name, t in (("dx", xr), ("dw1", w1r), ("dw2", w2r), ("dscores", sr))})
    return result
