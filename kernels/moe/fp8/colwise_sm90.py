"""The FP8 weight gradients' column-wise quantizer as a Gluon kernel for sm_90 (variant "ws" of the quantizer's
config), with its launcher: ``moe_fp8_quant_colwise_sm90_kernel`` computes what moe_fp8_quant_colwise_kernel
(kernels/moe/fp8/kernels.py, the interpreter's path and the reference of its bits) does.

Why a second kernel: the Triton one is instruction-bound on the H200 (about 15 SASS instructions per element), since
its tile is loaded with the columns contiguous and stored with the rows contiguous, and the compiler moves it between
those layouts through shared memory. Here both layouts are written out as linear layouts that give every thread the
same 16 rows x 8 columns and differ only in the order of its registers: loaded as 16-byte vectors along a row (8
BF16 columns), stored as 16-byte vectors down a column (16 E4M3 rows), the change of layout moving no data (7-8
instructions per element). A column's 128-row amax is 15 in-thread maxima and 3 lane shuffles.

The same operations as the Triton kernel, so the same bits: v = src[row] (times the row's FP32 score), the block's
amax as the maximum of |v| (FP32 max, which skips NaN as the Triton reduction does), its power-of-two scale, and
v * (1 / scale) converted by ``cvt.rn.satfinite.e4m3x2.f32`` (the instruction Triton's FP8 conversion compiles to on
sm_90), two rows per instruction. Gluon has no interpreter path: the launcher refuses other backends by name.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from detkit.kernels.backend import PlannedKernel, ensure_cuda_context
from detkit.kernels.moe.fp8.quant import QBLOCK
from detkit.kernels.moe.common import colwise_quant_launch_name
from detkit.kernels.moe.gluon_blocks import check_ws_backend, e4m3_codes, e4m3_pow2_scale

BLOCK_P = gl.constexpr(QBLOCK)  # rows per program: one scale block
THREAD_ROWS = 16  # rows per thread: one 16-byte E4M3 store down a column
THREAD_COLS = 8  # columns per thread: one 16-byte BF16 load along a row
LANE_ROW_GROUPS = QBLOCK // THREAD_ROWS  # lanes down a 128-row block (8)
LANE_COL_GROUPS = 32 // LANE_ROW_GROUPS  # lanes across columns (4)


@gluon.constexpr_function
def _tile_layout(BLOCK_N, WARPS, ROWS_FIRST):
    """A [QBLOCK, BLOCK_N] tile's layout: thread (lane, warp) holds rows 16 * (lane // 4) + [0, 16) of columns
    8 * (lane % 4) + 32 * warp + [0, 8) (and + 32 * WARPS * r for the r-th repeat), its registers ordered column-first
    (ROWS_FIRST False: 8-column vectors) or row-first (16-row vectors). The two orders own the same elements."""
    def powers(n):
        return [1 << i for i in range(n.bit_length() - 1)]

    cols = [[0, c] for c in powers(THREAD_COLS)]
    rows = [[r, 0] for r in powers(THREAD_ROWS)]
    lanes = ([[0, THREAD_COLS * c] for c in powers(LANE_COL_GROUPS)]
             + [[THREAD_ROWS * r, 0] for r in powers(LANE_ROW_GROUPS)])
    span = THREAD_COLS * LANE_COL_GROUPS
    warps = [[0, span * w] for w in powers(WARPS)]
    repeats = [[0, span * WARPS * r] for r in powers(BLOCK_N // (span * WARPS))]
    regs = (rows + cols if ROWS_FIRST else cols + rows) + repeats
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                      shape=[BLOCK_P, BLOCK_N])


@gluon.jit(launch_metadata=colwise_quant_launch_name)
def moe_fp8_quant_colwise_sm90_kernel(
    src_ptr, rows_ptr, route_ptr, score_ptr, gate_ptr, q_ptr, qs_ptr,
    P, N,  # q[n, p] = e4m3(v[p, n] / s[n, p // QBLOCK]), v[p, :] = src[row(p), :] (* score[p]); 0 on padding
    GROUPS,  # GATHER: the block order's groups (the experts), see below
    stride_sm, stride_sn, stride_qn, stride_qp, stride_sn_s, stride_sp_s,
    BLOCK_N: gl.constexpr, GATHER: gl.constexpr, SCALE: gl.constexpr,
):
    load_layout: gl.constexpr = _tile_layout(BLOCK_N, gl.num_warps(), False)
    store_layout: gl.constexpr = _tile_layout(BLOCK_N, gl.num_warps(), True)
    pid = gl.program_id(0)
    num_pid_n = N // BLOCK_N
    visit = pid // num_pid_n
    pid_n = pid % num_pid_n
    live_rows = gl.load(gate_ptr)  # the routing's P: blocks past it are not read by the weight gradients
    if GATHER:
        # The P/128 blocks cut into GROUPS runs of ``run`` blocks, visited side by side (block r of every run, then
        # r + 1): with GROUPS = E each run is about one expert's segment, whose rows ascend by token, so a token's K rows
        # are quantized close together in time and its source row is re-read from L2 rather than DRAM. Any order
        # gives the same bits (each program owns its block); the grid has GROUPS - 1 programs more than blocks.
        num_blocks = live_rows // BLOCK_P
        run = (num_blocks + GROUPS - 1) // GROUPS
        pid_p = (visit % GROUPS) * run + visit // GROUPS
        live = (visit // GROUPS < run) & (pid_p < num_blocks)
    else:
        pid_p = visit
        live = pid_p * BLOCK_P < live_rows
    if live:
        offs_p = pid_p * BLOCK_P + gl.arange(0, BLOCK_P, layout=gl.SliceLayout(1, load_layout))
        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, load_layout))
        row_ok = gl.load(route_ptr + offs_p) >= 0
        if GATHER:
            rows = gl.load(rows_ptr + offs_p)
        else:
            rows = offs_p
        v = gl.load(src_ptr + rows[:, None] * stride_sm + offs_n[None, :] * stride_sn, mask=row_ok[:, None],
                    other=0.0).to(gl.float32)
        if SCALE:  # dy = s * dout[token] in FP32 (one rounding), quantized directly
            v = v * gl.load(score_ptr + offs_p)[:, None]
        scale, inv = e4m3_pow2_scale(gl.max(gl.abs(v), axis=0))
        x = gl.convert_layout(v * inv[None, :], store_layout)  # the same registers, reordered
        q = e4m3_codes(x)  # two rows per conversion
        store_p = pid_p * BLOCK_P + gl.arange(0, BLOCK_P, layout=gl.SliceLayout(1, store_layout))
        store_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
        gl.store(q_ptr + store_n[None, :] * stride_qn + store_p[:, None] * stride_qp, q.to(gl.float8e4nv, bitcast=True))
        gl.store(qs_ptr + offs_n * stride_sn_s + pid_p * stride_sp_s, scale)


_moe_fp8_quant_colwise_sm90_kernel_planned = PlannedKernel(moe_fp8_quant_colwise_sm90_kernel)


def check_colwise_sm90_config(config, n: int) -> None:
    """What the Gluon quantizer's tile needs: whole warps of 32 columns (4 lanes x 8), a power-of-two BLOCK_N that
    divides N (no column mask)."""
    span = THREAD_COLS * LANE_COL_GROUPS * config.num_warps
    if config.block_n % span or config.block_n & (config.block_n - 1):
        raise ValueError(f"quant_colwise: variant 'ws' needs block_n a power of two and a multiple of 32 columns per "
                         f"warp ({span} for {config.num_warps} warps); got {config.block_n}")
    if n % config.block_n:
        raise ValueError(f"quant_colwise: variant 'ws' needs N a multiple of block_n {config.block_n}; got N={n}")


def launch_quant_colwise_sm90(config, src: torch.Tensor, gather_token: torch.Tensor, sorted_route: torch.Tensor,
                              row_score: torch.Tensor, gate: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                              num_blocks: int, gather: bool, scale: bool, backend: str, experts: int = 1) -> None:
    """``num_blocks`` 128-row blocks (the routing's bound; those past its P exit at once) x N / block_n programs;
    gathering, the blocks are visited in ``experts`` runs side by side (``experts - 1`` more programs per column)."""
    p, n = q.shape[1], src.shape[1]
    check_colwise_sm90_config(config, n)
    check_ws_backend("quant_colwise", backend)
    ensure_cuda_context(src.device)
    groups = max(int(experts), 1) if gather else 1
    _moe_fp8_quant_colwise_sm90_kernel_planned[((num_blocks + groups - 1) * (n // config.block_n),)](
        src, gather_token, sorted_route, row_score, gate, q, s, p, n, groups,
        src.stride(0), src.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
        BLOCK_N=config.block_n, GATHER=gather, SCALE=scale, num_warps=config.num_warps,
    )
