"""Deterministic, batch-invariant causal attention for Hopper: forward (prefill, chunked prefill, KV-cache
decode, packed variable-length sequences) and backward (dq, dk, dv), BF16 in, FP32 online softmax, BF16 out.

Math, per query row (a query head h, a query i) with visible keys j:
    z_j = scale * (q . k_j)        o = sum_j softmax(z)_j v_j        lse = log2 sum_j 2^(z_j log2 e)
computed as FlashAttention does: key tiles streamed through an FP32 running max m, running sum l and
accumulator acc, exp2 with scale * log2(e) folded into one multiplier, P rounded to BF16 for the P @ V MMA,
o = acc / l rounded once to BF16. The backward recomputes P from the saved lse.

Layout (as transformers passes it): q [B, Hq, Sq, D], k and v [B, Hkv, Skv, D], Hq a multiple of Hkv (GQA),
D in {64, 128}, the last dim contiguous, BF16. Causal, aligned bottom-right: query i sits at key position
kv_end - Sq + i (kv_end defaults to Skv), so a KV-cache decode (Sq = 1) and a chunked prefill (Sq new queries
after a cache) are the same call as a prefill. Sequence b sees keys [kv_start[b], kv_end[b]); keys before
kv_start (left padding) and after the query's own position are not visible. Packed sequences
(``attention_varlen``) are the same kernels with per-sequence offsets (kv_start 0, kv_end the sequence's
key count).

GQA: one program owns one KV head and packs the query heads of its group into the M dimension of its tile
(rows = HEADS heads x BLOCK_M / HEADS query positions), so each K/V tile is loaded once for the whole group
and a decode step (one query per head) still feeds the tensor cores.

THE INVARIANCE RULE. A query's output depends only on its own q and on K, V of its visible keys, reduced over
fixed-size key tiles (BLOCK_N keys) in ascending order from the sequence's first valid key (kv_start), with
the same online-softmax update sequence in every path — whatever q_len, chunk boundaries, batch size,
batch position or padding. No split-KV. It holds by construction:
- One kernel and one config per head_dim (BLOCK_M, BLOCK_N, num_warps, num_stages, instruction path) for
  every call: the config never depends on Sq, Skv, B or padding (``CONFIG_TABLE``, pinned, no autotune).
- Key tiles start at the sequence's first valid key, so the same logical keys sit in the same lanes of the
  same tiles whatever the padding; a row's MMA results depend on its own row only.
- Masking selects -inf into the raw scores (before the shared arithmetic), so a masked tile and a fully
  visible tile run the same update code on the same values; keys past the sequence's end are loaded as exact
  zeros. A row whose tile is entirely masked (it shares the program with later queries) sees p = exp2(-inf) = 0
  and alpha = 1 exactly (selected, not computed), so the extra tile changes none of its bits.
Backward: no atomics. dk, dv: one program per (sequence, KV head, key tile) loops over the query tiles in
ascending order and sums the query heads of the group inside each tile's MMA, head chunks in ascending
order; dq: one program per query tile loops over key tiles in ascending order from kv_start. Every gradient
is reduced in an order fixed by the shapes.

Sequence bounds that do not make sense (kv_start < 0, kv_start > kv_end, kv_end > Skv) are checked in the
kernel, without a host sync: that sequence's outputs (and gradients) are NaN and nothing out of bounds is
read. Varlen cu_seqlens are read on the host and refused with a message.

On the Triton interpreter (CPU) ``tl.dot`` on BF16 is wrong and its FP32 dot is numpy's matmul, whose
summation order depends on the tile shape, so every dot there adds exact products one at a time in ascending
order (``det_gemm.mac_step``), and FP32 -> BF16 rounds in integer arithmetic (the interpreter's cast
truncates). Interpreter bits differ from tensor-core bits; each backend is audited on its own.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from detkit.kernels.backend import CUDA_SM90, MAX_INT32_OFFSET, TRITON_INTERPRETER, ensure_cuda_context, resolve_backend
from detkit.kernels.det_gemm_kernels import mac_step, to_bf16

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)

# ---------------------------------------------------------------------------------------------
# Pinned config table. Bump the version whenever an entry changes; reports record it.
# ---------------------------------------------------------------------------------------------
ATTENTION_CONFIG_TABLE_VERSION = "2026-12-01.2"


@dataclass(frozen=True)
class AttnConfig:
    block_m: int  # query rows per tile: HEADS query heads x block_m / HEADS query positions
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for field, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"AttnConfig.{field} must be a positive int; got {value!r}")
        for field in ("block_m", "block_n"):
            value = getattr(self, field)
            if value < 16 or value & (value - 1):
                raise ValueError(f"AttnConfig.{field} must be a power of two >= 16 (one MMA); got {value}")

    def label(self) -> str:
        return f"BM{self.block_m}_BN{self.block_n}_w{self.num_warps}_s{self.num_stages}"


@dataclass(frozen=True)
class AttnConfigs:
    """The three kernels' tiles for one head_dim. fwd: block_m query rows x block_n keys per step. dkdv: a
    program owns block_n keys and steps over block_m query rows. dq: a program owns block_m query rows and
    steps over block_n keys. Only fwd's tile decides the forward bits (and so the invariance); the backward
    tiles decide the gradients' fixed reduction order."""
    fwd: AttnConfig
    dkdv: AttnConfig
    dq: AttnConfig
    # A speed option, off in the table until measured: when the forward grid would have fewer programs than this
    # (a small-batch decode step: B x Hkv programs), each program takes one query head instead of the group's
    # (the group's K/V tiles are then read by G programs, through the L2). A row's arithmetic is unchanged (same
    # tile, same key tiles, same update sequence; rows are independent), so its bits must be too; the sweep checks.
    split_heads_below: int = 0

    def label(self) -> str:
        split = f" split<{self.split_heads_below}" if self.split_heads_below else ""
        return f"fwd {self.fwd.label()} dkdv {self.dkdv.label()} dq {self.dq.label()}{split}"


def fwd_heads(configs: AttnConfigs, group: int, heads_kv: int, batch: int, seq_q: int) -> int:
    """Query heads per forward tile: the whole group (``heads_per_tile``), or one when ``split_heads_below`` asks
    for more programs."""
    heads = heads_per_tile(group, configs.fwd.block_m)
    if configs.split_heads_below and heads > 1:
        programs = triton.cdiv(seq_q, configs.fwd.block_m // heads) * heads_kv * (group // heads) * batch
        if programs < configs.split_heads_below:
            heads = 1
    return heads


# Keyed by backend, then head_dim. The sm_90 entries are the fastest spill-free candidates of the H200 sweep
# (tools/gpu/attention.sh; CUDA-graph time beside SDPA flash, geometric mean over prefill B1 S4096, prefill B8 S1024,
# decode at B1 K32768, B8 K8192, B64 K8192, and fwd+bwd B1 S4096; 0 decode-vs-prefill bit mismatches): the forward
# on 64x64 tiles, 4 warps, 3 stages (twice the programs of 128-row tiles: a decode step is grid-bound); dk/dv on
# 32x128 (D=128) and 64x64 (D=64) query x key tiles, 3 stages; dq on 128x64, 3 stages. The interpreter entries are
# small so CPU tests at a few dozen keys cross several key tiles and query tiles.
CONFIG_TABLE: dict[str, dict[int, AttnConfigs]] = {
    CUDA_SM90: {
        64: AttnConfigs(fwd=AttnConfig(64, 64, 4, 3), dkdv=AttnConfig(64, 64, 4, 3), dq=AttnConfig(128, 64, 4, 3)),
        128: AttnConfigs(fwd=AttnConfig(64, 64, 4, 3), dkdv=AttnConfig(32, 128, 8, 3), dq=AttnConfig(128, 64, 8, 3)),
    },
    TRITON_INTERPRETER: {
        64: AttnConfigs(fwd=AttnConfig(16, 16, 4, 1), dkdv=AttnConfig(16, 16, 4, 1), dq=AttnConfig(16, 16, 4, 1)),
        128: AttnConfigs(fwd=AttnConfig(16, 16, 4, 1), dkdv=AttnConfig(16, 16, 4, 1), dq=AttnConfig(16, 16, 4, 1)),
    },
}


def select_configs(backend: str, head_dim: int) -> AttnConfigs:
    """The pinned tiles for ``head_dim`` on ``backend``: never a function of the sequence lengths or the batch."""
    if backend not in CONFIG_TABLE:
        raise ValueError(f"backend {backend!r} is not supported; supported: {tuple(CONFIG_TABLE)}")
    if head_dim not in CONFIG_TABLE[backend]:
        raise ValueError(f"head_dim {head_dim} is not supported; supported: {HEAD_DIMS}")
    return CONFIG_TABLE[backend][head_dim]


@functools.lru_cache(maxsize=None)
def heads_per_tile(group: int, block_m: int) -> int:
    """Query heads of one KV group packed into a tile's rows: the largest divisor of ``group`` <= block_m. A
    function of the model (group size) and the pinned tile only."""
    return max(h for h in range(1, min(group, block_m) + 1) if group % h == 0)


def case_name(op: str, batch: int, heads_q: int, heads_kv: int, seq_q: int, seq_k: int, head_dim: int) -> str:
    """The one name shared by a launch (launch_metadata), its NVTX range and its report row."""
    dims = f"B={batch}, Hq={heads_q}, Hkv={heads_kv}, Sq={seq_q}, Skv={seq_k}, D={head_dim}"
    return f"detkit_attention_{op} [{dims}] bf16"


def causal_pairs(seq_q: int, seq_k: int) -> int:
    """Visible (query, key) pairs of one head of one sequence without padding (queries the last seq_q keys)."""
    before = max(seq_k - seq_q, 0) * seq_q
    q = min(seq_q, seq_k)
    return before + q * (q + 1) // 2


def _metadata(op: str, flops_per_pair: int):
    def launch_metadata(grid, metadata, args):
        d = args["HEAD_DIM"]
        name = case_name(op, args["batch"], args["heads_q"], args["heads_kv"], args["seq_q"], args["seq_k"], d)
        pairs = causal_pairs(args["seq_q"], args["seq_k"])
        return {"name": name, "flops": float(flops_per_pair * d * pairs * args["batch"] * args["heads_q"])}
    return launch_metadata


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
# Triton specialises integer arguments equal to 1 or divisible by 16 and pointers on 16-byte alignment; these
# would make a decode step (Sq = 1, B = 1; lse's head stride is Sq) run a different binary from a prefill. Not
# specialising them keeps one binary per (config, head_dim, heads per tile, layout flags) for every q_len, batch,
# cache length and head count (the other strides are multiples of head_dim).
_NOT_SPECIALIZED = ["batch", "heads_q", "heads_kv", "seq_q", "seq_k", "stride_lb", "stride_lh", "kv_start_ptr",
                    "kv_end_ptr"]

@triton.jit
def _dot(a, b, acc, K: tl.constexpr, INTERPRETED: tl.constexpr):
    """``acc + a @ b`` (a [M, K], b [K, N]): one tl.dot on the GPU; in the interpreter exact products added in
    ascending k order (det_gemm.mac_step)."""
    return mac_step(acc, a, b, tl.arange(0, K), K, INTERPRETED)


@triton.jit
def _token(q_begin, qi, VARLEN: tl.constexpr):
    """Each row's query index in q's token dim: within a sequence (32-bit offsets, checked on the host), or in a
    packed tensor (64-bit: the packing may exceed 2**31 elements)."""
    if VARLEN:
        tok = (q_begin + qi).to(tl.int64)
    else:
        tok = q_begin + qi
    return tok


@triton.jit
def _sequence(b, kv_start_ptr, kv_end_ptr, seq_q, seq_k,
              VARLEN: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_KV_END: tl.constexpr):
    """(q_begin, q_len, k_begin, k_first, k_end, bad) of sequence ``b``: its queries are rows q_begin.. of q, its
    keys rows k_begin.. of k; it sees keys [k_first, k_end) of its own and query i sits at k_end - q_len + i.
    Padded layout: kv_start_ptr / kv_end_ptr are the int32 [B] bounds (or unused); varlen: they are cu_seqlens_q
    and cu_seqlens_k (checked on the host). ``bad``: bounds that do not make sense (outputs NaN, no keys read)."""
    if VARLEN:
        q_begin = tl.load(kv_start_ptr + b)
        q_len = tl.load(kv_start_ptr + b + 1) - q_begin
        k_begin = tl.load(kv_end_ptr + b)
        k_end = tl.load(kv_end_ptr + b + 1) - k_begin
        k_first = 0
        bad = False
    else:
        q_begin = 0
        q_len = seq_q
        k_begin = 0
        if HAS_KV_START:
            k_first = tl.load(kv_start_ptr + b)
        else:
            k_first = 0
        if HAS_KV_END:
            k_end = tl.load(kv_end_ptr + b)
        else:
            k_end = seq_k
        bad = (k_first < 0) | (k_first > k_end) | (k_end > seq_k)
        k_first = tl.where(bad, 0, k_first)
        k_end = tl.where(bad, 0, k_end)
    return q_begin, q_len, k_begin, k_first, k_end, bad


@triton.jit(launch_metadata=_metadata("fwd", 4), do_not_specialize=_NOT_SPECIALIZED)
def attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    kv_start_ptr, kv_end_ptr,  # int32 [B] (padded) or cu_seqlens_q / cu_seqlens_k (varlen)
    stride_qb, stride_qh, stride_qs,  # q [B, Hq, Sq, D] (varlen: [Tq, Hq, D], stride_qb unused)
    stride_kb, stride_kh, stride_ks,  # k [B, Hkv, Skv, D]
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,  # lse [B, Hq, Sq] fp32 (varlen: [Hq, Tq])
    batch, heads_q, heads_kv, seq_q, seq_k,  # varlen: seq_q / seq_k are max_seqlen_q / max_seqlen_k
    qk_scale,  # scale * log2(e)
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
    VARLEN: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_KV_END: tl.constexpr, INTERPRETED: tl.constexpr,
):
    BQ: tl.constexpr = BLOCK_M // HEADS  # query positions per tile
    # Grid (heads, query tiles, sequences), heads fastest: the latest (longest) query tiles of every head start
    # first, so the short ones fill the tail of the causal triangle.
    b = tl.program_id(2)
    pid_h = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    group = heads_q // heads_kv
    chunks = group // HEADS
    kv_head = pid_h // chunks
    head0 = kv_head * group + (pid_h % chunks) * HEADS
    q_begin, q_len, k_begin, k_first, k_end, bad = _sequence(b, kv_start_ptr, kv_end_ptr, seq_q, seq_k,
                                                             VARLEN, HAS_KV_START, HAS_KV_END)
    q_lo = pid_m * BQ
    if q_lo >= q_len:
        return

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    h_loc = offs_r // BQ
    qi = q_lo + offs_r % BQ
    row_ok = (h_loc < HEADS) & (qi < q_len)
    head = head0 + h_loc
    pos = k_end - q_len + qi  # each row's own key position
    b64 = b.to(tl.int64)
    tok = _token(q_begin, qi, VARLEN)
    q_rows = q_ptr + b64 * stride_qb + head * stride_qh + tok * stride_qs
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    k_base = k_ptr + b64 * stride_kb + kv_head.to(tl.int64) * stride_kh + k_begin.to(tl.int64) * stride_ks
    v_base = v_ptr + b64 * stride_vb + kv_head.to(tl.int64) * stride_vh + k_begin.to(tl.int64) * stride_vs

    # Key tiles [k_first + t * BLOCK_N, ...): tiles 0..n_full-1 are visible to every row of this tile in full,
    # tiles n_full..n_tiles-1 reach the diagonal (or the sequence's end) and are masked.
    last_q = tl.minimum(q_lo + BQ, q_len) - 1
    n_tiles = tl.cdiv(tl.maximum(k_end - q_len + last_q + 1 - k_first, 0), BLOCK_N)
    n_full = tl.maximum(k_end - q_len + q_lo + 1 - k_first, 0) // BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for t in range(0, n_tiles):
        kj = k_first + t * BLOCK_N + offs_n  # key index within the sequence
        key_ok = kj < k_end
        # [BLOCK_N, HEAD_DIM]
        k = tl.load(k_base + kj[:, None] * stride_ks + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        qk = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), HEAD_DIM, INTERPRETED)
        if t >= n_full:
            visible = (kj[None, :] <= pos[:, None]) & key_ok[None, :]
            qk = tl.where(visible, qk, float("-inf"))
        # The shared update: the same code for every tile, masked or not.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk * qk_scale - m_ref[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.where(m_new == m_i, 1.0, tl.math.exp2(m_i - m_ref))
        l_i = l_i * alpha + tl.sum(p, 1)
        # [BLOCK_N, HEAD_DIM]
        v = tl.load(v_base + kj[:, None] * stride_vs + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None]
        acc = _dot(to_bf16(p, INTERPRETED), v, acc, BLOCK_N, INTERPRETED)
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]  # rows that see no key: 0
    out = tl.where(bad, float("nan"), out)
    # lse in log2 units; +inf for rows that see no key, so the backward's exp2(s - lse) is 0 there.
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("inf"))
    lse = tl.where(bad, float("nan"), lse)
    o_rows = o_ptr + b64 * stride_ob + head * stride_oh + tok * stride_os
    tl.store(o_rows[:, None] + offs_d[None, :], to_bf16(out, INTERPRETED), mask=row_ok[:, None])
    tl.store(lse_ptr + b64 * stride_lb + head * stride_lh + q_begin + qi, lse, mask=row_ok)


@triton.jit
def attention_bwd_delta_kernel(
    o_ptr, do_ptr, delta_ptr,
    stride_ob, stride_oh, stride_os,
    stride_db, stride_dh, stride_ds,
    stride_lb, stride_lh,
    rows,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    """delta = rowsum(o * do) in FP32 (o the BF16 forward output), one row per (sequence, query head, query)."""
    b = tl.program_id(2).to(tl.int64)
    h = tl.program_id(1)
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)  # rows may be a packed tensor's tokens
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs < rows
    o = tl.load(o_ptr + b * stride_ob + h * stride_oh + offs[:, None] * stride_os + offs_d[None, :],
                mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + b * stride_db + h * stride_dh + offs[:, None] * stride_ds + offs_d[None, :],
                 mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + b * stride_lb + h * stride_lh + offs, tl.sum(o * do, 1), mask=ok)


@triton.jit(launch_metadata=_metadata("bwd_dkdv", 8), do_not_specialize=_NOT_SPECIALIZED)
def attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    kv_start_ptr, kv_end_ptr,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_db, stride_dh, stride_ds,  # do, laid out as q
    stride_lb, stride_lh,  # lse and delta
    stride_dkb, stride_dkh, stride_dks,  # dk and dv [B, Hkv, Skv, D]
    batch, heads_q, heads_kv, seq_q, seq_k,
    qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
    VARLEN: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_KV_END: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """dk and dv of BLOCK_N keys of one KV head: query tiles in ascending order, the group's query heads summed
    inside each tile's MMA (head chunks in ascending order); no atomics."""
    BQ: tl.constexpr = BLOCK_M // HEADS
    b = tl.program_id(2)
    kv_head = tl.program_id(0)  # grid (KV heads, key tiles, sequences): the first key tiles (most queries) first
    pid_n = tl.program_id(1)
    group = heads_q // heads_kv
    chunks = group // HEADS
    q_begin, q_len, k_begin, k_first, k_end, bad = _sequence(b, kv_start_ptr, kv_end_ptr, seq_q, seq_k,
                                                             VARLEN, HAS_KV_START, HAS_KV_END)
    n_lo = k_first + pid_n * BLOCK_N
    if n_lo >= k_end:
        return

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kj = n_lo + tl.arange(0, BLOCK_N)
    key_ok = kj < k_end
    b64 = b.to(tl.int64)
    k_base = k_ptr + b64 * stride_kb + kv_head.to(tl.int64) * stride_kh + k_begin.to(tl.int64) * stride_ks
    v_base = v_ptr + b64 * stride_vb + kv_head.to(tl.int64) * stride_vh + k_begin.to(tl.int64) * stride_vs
    # [BLOCK_N, HEAD_DIM], resident for the whole program
    k = tl.load(k_base + kj[:, None] * stride_ks + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(v_base + kj[:, None] * stride_vs + offs_d[None, :], mask=key_ok[:, None], other=0.0)

    shift = k_end - q_len  # query i sits at key position shift + i
    # Query tiles before t_first see none of these keys; from full_from on, every row sees all of them.
    t_first = tl.maximum(n_lo - shift, 0) // BQ
    full_from = tl.cdiv(tl.maximum(n_lo + BLOCK_N - 1 - shift, 0), BQ)
    n_qt = tl.cdiv(q_len, BQ)
    h_loc = offs_r // BQ
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for c in range(0, chunks):
        head = kv_head * group + c * HEADS + h_loc
        for t in range(t_first, n_qt):
            qi = t * BQ + offs_r % BQ
            row_ok = (h_loc < HEADS) & (qi < q_len)
            tok = _token(q_begin, qi, VARLEN)
            q_off = b64 * stride_qb + head * stride_qh + tok * stride_qs
            do_off = b64 * stride_db + head * stride_dh + tok * stride_ds
            l_off = b64 * stride_lb + head * stride_lh + q_begin + qi
            # [BLOCK_M, HEAD_DIM]
            q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptr + do_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + l_off, mask=row_ok, other=float("inf"))
            delta = tl.load(delta_ptr + l_off, mask=row_ok, other=0.0)
            qk_t = _dot(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), HEAD_DIM, INTERPRETED)
            p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :])  # [BLOCK_N, BLOCK_M]
            if t < full_from:
                visible = (kj[:, None] <= (shift + qi)[None, :]) & key_ok[:, None]
                p_t = tl.where(visible, p_t, 0.0)
            dv = _dot(to_bf16(p_t, INTERPRETED), do, dv, BLOCK_M, INTERPRETED)
            dp_t = _dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), HEAD_DIM, INTERPRETED)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = _dot(to_bf16(ds_t, INTERPRETED), q, dk, BLOCK_M, INTERPRETED)
    dk = dk * scale
    dk = tl.where(bad, float("nan"), dk)
    dv = tl.where(bad, float("nan"), dv)
    out = b64 * stride_dkb + kv_head.to(tl.int64) * stride_dkh + k_begin.to(tl.int64) * stride_dks
    offs = kj[:, None] * stride_dks + offs_d[None, :]
    tl.store(dk_ptr + out + offs, to_bf16(dk, INTERPRETED), mask=key_ok[:, None])
    tl.store(dv_ptr + out + offs, to_bf16(dv, INTERPRETED), mask=key_ok[:, None])


@triton.jit(launch_metadata=_metadata("bwd_dq", 6), do_not_specialize=_NOT_SPECIALIZED)
def attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    kv_start_ptr, kv_end_ptr,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_db, stride_dh, stride_ds,
    stride_lb, stride_lh,
    stride_dqb, stride_dqh, stride_dqs,
    batch, heads_q, heads_kv, seq_q, seq_k,
    qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
    VARLEN: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_KV_END: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """dq of one query tile (HEADS heads x BLOCK_M / HEADS queries): key tiles in ascending order from kv_start."""
    BQ: tl.constexpr = BLOCK_M // HEADS
    b = tl.program_id(2)
    pid_h = tl.program_id(0)  # grid (heads, query tiles, sequences) as the forward's
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    group = heads_q // heads_kv
    chunks = group // HEADS
    kv_head = pid_h // chunks
    head0 = kv_head * group + (pid_h % chunks) * HEADS
    q_begin, q_len, k_begin, k_first, k_end, bad = _sequence(b, kv_start_ptr, kv_end_ptr, seq_q, seq_k,
                                                             VARLEN, HAS_KV_START, HAS_KV_END)
    q_lo = pid_m * BQ
    if q_lo >= q_len:
        return

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    h_loc = offs_r // BQ
    qi = q_lo + offs_r % BQ
    row_ok = (h_loc < HEADS) & (qi < q_len)
    head = head0 + h_loc
    pos = k_end - q_len + qi
    b64 = b.to(tl.int64)
    tok = _token(q_begin, qi, VARLEN)
    q_off = b64 * stride_qb + head * stride_qh + tok * stride_qs
    do_off = b64 * stride_db + head * stride_dh + tok * stride_ds
    l_off = b64 * stride_lb + head * stride_lh + q_begin + qi
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    do = tl.load(do_ptr + do_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + l_off, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_ptr + l_off, mask=row_ok, other=0.0)
    k_base = k_ptr + b64 * stride_kb + kv_head.to(tl.int64) * stride_kh + k_begin.to(tl.int64) * stride_ks
    v_base = v_ptr + b64 * stride_vb + kv_head.to(tl.int64) * stride_vh + k_begin.to(tl.int64) * stride_vs

    last_q = tl.minimum(q_lo + BQ, q_len) - 1
    n_tiles = tl.cdiv(tl.maximum(k_end - q_len + last_q + 1 - k_first, 0), BLOCK_N)
    n_full = tl.maximum(k_end - q_len + q_lo + 1 - k_first, 0) // BLOCK_N
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for t in range(0, n_tiles):
        kj = k_first + t * BLOCK_N + offs_n
        key_ok = kj < k_end
        # [BLOCK_N, HEAD_DIM]
        k = tl.load(k_base + kj[:, None] * stride_ks + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_base + kj[:, None] * stride_vs + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        qk = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), HEAD_DIM, INTERPRETED)
        p = tl.math.exp2(qk * qk_scale - lse[:, None])  # [BLOCK_M, BLOCK_N]
        if t >= n_full:
            visible = (kj[None, :] <= pos[:, None]) & key_ok[None, :]
            p = tl.where(visible, p, 0.0)
        dp = _dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), HEAD_DIM, INTERPRETED)
        ds = p * (dp - delta[:, None])
        dq = _dot(to_bf16(ds, INTERPRETED), k, dq, BLOCK_N, INTERPRETED)
    dq = dq * scale
    dq = tl.where(bad, float("nan"), dq)
    dq_rows = dq_ptr + b64 * stride_dqb + head * stride_dqh + tok * stride_dqs
    tl.store(dq_rows[:, None] + offs_d[None, :], to_bf16(dq, INTERPRETED), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------
# Launch wrappers: check, allocate, launch.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sequences:
    """How the rows of q and k form sequences. Padded: q [B, Hq, Sq, D], k/v [B, Hkv, Skv, D] and per-sequence
    bounds kv_start / kv_end (int32 [B] or None). Varlen: q [Tq, Hq, D], k/v [Tk, Hkv, D] and cu_seqlens."""
    varlen: bool
    batch: int
    seq_q: int  # Sq, or max_seqlen_q
    seq_k: int  # Skv, or max_seqlen_k
    bound0: torch.Tensor | None  # kv_start, or cu_seqlens_q
    bound1: torch.Tensor | None  # kv_end, or cu_seqlens_k

    @property
    def padding(self) -> bool:
        """Keys outside every sequence's [kv_start, kv_end) may exist (their gradients must be zero-filled)."""
        return not self.varlen and (self.bound0 is not None or self.bound1 is not None)


@dataclass(frozen=True)
class AttentionLaunch:
    """What ran: the backend, the tiles and the launch's name."""
    backend: str
    configs: AttnConfigs
    name: str


def _scale_of(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale {scale!r} is not supported; supported: a finite float > 0, or None (1/sqrt(head_dim))")
    return float(scale)


def _check_tensor(name: str, t, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: torch.bfloat16")
    shape, strides = tuple(t.shape), t.stride()  # read once: this runs on every decode step's host path
    if len(shape) != dim:
        raise ValueError(f"{name} must be {dim}-D; got shape {shape}")
    if 0 in shape:
        raise ValueError(f"{name} has an empty dimension (shape {shape}); supported: every dim >= 1")
    if strides[-1] != 1:
        raise ValueError(f"{name} has stride {strides[-1]} on its head dim (shape {shape}, strides {strides}); "
                         "supported: a contiguous head dim (stride 1)")
    if min(strides) < 0:
        raise ValueError(f"{name} has negative strides {strides}; supported: non-negative strides")
    # The kernels offset whole sequences in 64 bits and index within one in 32 bits.
    furthest = sum((size - 1) * stride for size, stride in zip(shape[1:], strides[1:]))
    if furthest > MAX_INT32_OFFSET:
        raise ValueError(f"{name} (shape {shape}, strides {strides}) spans element offset {furthest} within one "
                         "sequence; supported: below 2**31 (32-bit indexing within a sequence)")


def _check_bounds_tensor(name: str, t, batch: int, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None; got {type(t).__name__}")
    if t.dtype != torch.int32 or tuple(t.shape) != (batch,) or t.device != device:
        raise ValueError(f"{name} must be an int32 tensor of shape ({batch},) on {device}; got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; got strides {t.stride()}")


def check_padded(q, k, v, kv_start=None, kv_end=None) -> tuple[int, int, int, int, int, int]:
    """Refuse what the padded layout does not support; returns (B, Hq, Hkv, Sq, Skv, D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 4)
    batch, heads_q, seq_q, head_dim = q.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported; supported: {HEAD_DIMS}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape [B, Hkv, Skv, D]")
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}: need k [B, Hkv, Skv, D] with q's "
                         "B and D")
    heads_kv, seq_k = k.shape[1], k.shape[2]
    if heads_q % heads_kv:
        raise ValueError(f"query heads {heads_q} are not a multiple of key/value heads {heads_kv} (GQA needs "
                         "Hq % Hkv == 0)")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    _check_bounds_tensor("kv_start", kv_start, batch, q.device)
    _check_bounds_tensor("kv_end", kv_end, batch, q.device)
    return batch, heads_q, heads_kv, seq_q, seq_k, head_dim


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple[int, int, int, int]:
    """Refuse what the packed layout does not support; reads cu_seqlens on the host (one sync). Returns
    (n sequences, Hq, Hkv, D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 3)
    total_q, heads_q, head_dim = q.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported; supported: {HEAD_DIMS}")
    if k.shape != v.shape or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [Tk, Hkv, D] with q's D {head_dim}")
    total_k, heads_kv = k.shape[0], k.shape[1]
    if heads_q % heads_kv:
        raise ValueError(f"query heads {heads_q} are not a multiple of key/value heads {heads_kv} (GQA needs "
                         "Hq % Hkv == 0)")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    lens = {}
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, total_q), ("cu_seqlens_k", cu_seqlens_k, total_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(cu).__name__}")
        if (cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2 or cu.device != q.device
                or not cu.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous int32 tensor [n + 1] (n >= 1) on {q.device}; got "
                             f"{cu.dtype} {tuple(cu.shape)} on {cu.device}")
        values = cu.tolist()
        steps = [b - a for a, b in zip(values, values[1:])]
        if values[0] != 0 or min(steps) < 0 or values[-1] != total:
            raise ValueError(f"{name} must start at 0, never decrease and end at the packed length {total}; got "
                             f"{values[:8]}{'...' if len(values) > 8 else ''}")
        lens[name] = steps
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q ({cu_seqlens_q.numel()}) and cu_seqlens_k ({cu_seqlens_k.numel()}) must "
                         "describe the same number of sequences")
    for name, value, need in (("max_seqlen_q", max_seqlen_q, max(lens["cu_seqlens_q"])),
                              ("max_seqlen_k", max_seqlen_k, max(lens["cu_seqlens_k"]))):
        if isinstance(value, bool) or not isinstance(value, int) or value < max(need, 1):
            raise ValueError(f"{name} {value!r} is not supported; supported: an int >= the longest sequence "
                             f"({need}) and >= 1")
    return cu_seqlens_q.numel() - 1, heads_q, heads_kv, head_dim


def _strides3(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, sequence) strides of a [B, H, S, D] tensor, or (0, head, token) of a [T, H, D] one."""
    if varlen:
        return 0, t.stride(1), t.stride(0)
    return t.stride(0), t.stride(1), t.stride(2)


def _lse_strides(seqs: Sequences, heads_q: int, rows: int) -> tuple[int, int]:
    return (0, rows) if seqs.varlen else (heads_q * rows, rows)


def _flags(seqs: Sequences, interpreted: bool) -> dict:
    return {"VARLEN": seqs.varlen, "HAS_KV_START": seqs.bound0 is not None and not seqs.varlen,
            "HAS_KV_END": seqs.bound1 is not None and not seqs.varlen, "INTERPRETED": interpreted}


def _bound_args(seqs: Sequences, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dummy = q  # never read: HAS_KV_START / HAS_KV_END are off
    return (seqs.bound0 if seqs.bound0 is not None else dummy, seqs.bound1 if seqs.bound1 is not None else dummy)


def attention_fwd_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: Sequences, scale: float,
                         configs: AttnConfigs | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionLaunch]:
    """Run the forward on checked inputs: (o, lse, launch). o has q's logical shape, stored [B, Sq, Hq, D] (or
    [Tq, Hq, D]) so transformers' [B, Sq, Hq, D] output is a free transpose; lse [B, Hq, Sq] (or [Hq, Tq]) FP32."""
    backend = resolve_backend(attention_fwd_kernel, {"q": q, "k": k, "v": v})
    configs = configs or select_configs(backend, q.shape[-1])
    cfg = configs.fwd
    interpreted = backend == TRITON_INTERPRETER
    head_dim = q.shape[-1]
    heads_q, heads_kv = q.shape[1], k.shape[1]  # [B, H, S, D] and [T, H, D] alike
    group = heads_q // heads_kv
    heads = fwd_heads(configs, group, heads_kv, seqs.batch, seqs.seq_q)
    if seqs.varlen:
        rows = q.shape[0]
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty((heads_q, rows), dtype=torch.float32, device=q.device)
    else:
        rows = q.shape[2]
        o = torch.empty((seqs.batch, rows, heads_q, head_dim), dtype=q.dtype, device=q.device).transpose(1, 2)
        lse = torch.empty((seqs.batch, heads_q, rows), dtype=torch.float32, device=q.device)
    if not interpreted:
        ensure_cuda_context(q.device)
    grid = (heads_kv * (group // heads), triton.cdiv(seqs.seq_q, cfg.block_m // heads), seqs.batch)
    attention_fwd_kernel[grid](
        q, k, v, o, lse, *_bound_args(seqs, q),
        *_strides3(q, seqs.varlen), *_strides3(k, seqs.varlen), *_strides3(v, seqs.varlen), *_strides3(o, seqs.varlen),
        *_lse_strides(seqs, heads_q, rows),
        seqs.batch, heads_q, heads_kv, seqs.seq_q, seqs.seq_k,
        scale * LOG2E,
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEADS=heads, **_flags(seqs, interpreted),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    name = case_name("fwd", seqs.batch, heads_q, heads_kv, seqs.seq_q, seqs.seq_k, head_dim)
    return o, lse, AttentionLaunch(backend, configs, name)


DELTA_BLOCK = 64


def attention_bwd_launch(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                         lse: torch.Tensor, seqs: Sequences, scale: float, configs: AttnConfigs | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for the saved forward (o, lse). Keys outside every sequence's window get exact zeros."""
    backend = resolve_backend(attention_fwd_kernel, {"q": q, "k": k, "v": v, "do": do})
    configs = configs or select_configs(backend, q.shape[-1])
    interpreted = backend == TRITON_INTERPRETER
    if do.stride(-1) != 1:  # autograd may hand an expanded gradient (e.g. of a sum): the kernels index D densely
        do = do.contiguous()
    head_dim = q.shape[-1]
    heads_q, heads_kv = q.shape[1], k.shape[1]
    group = heads_q // heads_kv
    rows = q.shape[0] if seqs.varlen else q.shape[2]
    batch = 1 if seqs.varlen else seqs.batch
    if not interpreted:
        ensure_cuda_context(q.device)
    delta = torch.empty_like(lse)
    attention_bwd_delta_kernel[(triton.cdiv(rows, DELTA_BLOCK), heads_q, batch)](
        o, do, delta, *_strides3(o, seqs.varlen), *_strides3(do, seqs.varlen), *_lse_strides(seqs, heads_q, rows),
        rows, HEAD_DIM=head_dim, BLOCK=DELTA_BLOCK,
    )
    dq = torch.empty_like(q)
    alloc = torch.zeros_like if seqs.padding else torch.empty_like
    dk = alloc(k)
    dv = alloc(dk)  # dk's strides: the kernel stores both through one set
    flags = _flags(seqs, interpreted)
    common = (*_strides3(q, seqs.varlen), *_strides3(k, seqs.varlen), *_strides3(v, seqs.varlen),
              *_strides3(do, seqs.varlen), *_lse_strides(seqs, heads_q, rows))
    sizes = (seqs.batch, heads_q, heads_kv, seqs.seq_q, seqs.seq_k, scale * LOG2E, scale)
    cfg = configs.dkdv
    heads = heads_per_tile(group, cfg.block_m)
    attention_bwd_dkdv_kernel[(heads_kv, triton.cdiv(seqs.seq_k, cfg.block_n), seqs.batch)](
        q, k, v, do, lse, delta, dk, dv, *_bound_args(seqs, q), *common, *_strides3(dk, seqs.varlen), *sizes,
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEADS=heads, **flags,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    cfg = configs.dq
    heads = heads_per_tile(group, cfg.block_m)
    attention_bwd_dq_kernel[(heads_kv * (group // heads), triton.cdiv(seqs.seq_q, cfg.block_m // heads), seqs.batch)](
        q, k, v, do, lse, delta, dq, *_bound_args(seqs, q), *common, *_strides3(dq, seqs.varlen), *sizes,
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEADS=heads, **flags,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dq, dk, dv


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seqs: Sequences, scale: float, configs: AttnConfigs | None):
        o, lse, _ = attention_fwd_launch(q, k, v, seqs, scale, configs)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.seqs, ctx.scale, ctx.configs = seqs, scale, configs
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_bwd_launch(do, q, k, v, o, lse, ctx.seqs, ctx.scale, ctx.configs)
        return dq, dk, dv, None, None, None


def _run(q, k, v, seqs: Sequences, scale: float, configs: AttnConfigs | None) -> torch.Tensor:
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _AttentionFunction.apply(q, k, v, seqs, scale, configs)
    return attention_fwd_launch(q, k, v, seqs, scale, configs)[0]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
              kv_start: torch.Tensor | None = None, kv_end: torch.Tensor | None = None,
              configs: AttnConfigs | None = None) -> torch.Tensor:
    """Causal GQA attention: q [B, Hq, Sq, D], k, v [B, Hkv, Skv, D] (BF16, head dim contiguous) -> [B, Hq, Sq, D]
    (stored [B, Sq, Hq, D]). Query i sits at key position kv_end - Sq + i (kv_end = Skv when None) and sees keys
    kv_start..its own position (kv_start int32 [B], the first valid key: left padding; None = 0). ``kv_end``
    (int32 [B], one past each sequence's last key: a static cache's filled length) is an extension; queries of
    padded positions give finite values nobody should read. Autograd gives dq, dk, dv (no atomics). ``configs``:
    tiles other than the pinned table's (tests and sweeps)."""
    batch, _, _, seq_q, seq_k, head_dim = check_padded(q, k, v, kv_start, kv_end)
    seqs = Sequences(False, batch, seq_q, seq_k, kv_start, kv_end)
    return _run(q, k, v, seqs, _scale_of(scale, head_dim), configs)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, scale: float | None = None,
                     configs: AttnConfigs | None = None) -> torch.Tensor:
    """Packed sequences: q [Tq, Hq, D], k, v [Tk, Hkv, D]; sequence n is rows cu_seqlens_q[n]..cu_seqlens_q[n+1] of
    q and cu_seqlens_k[n]..cu_seqlens_k[n+1] of k, its queries the last of its keys (causal, bottom-right). The
    same bits per token as the padded layout. cu_seqlens are read on the host (checked; one sync)."""
    n, _, _, head_dim = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    seqs = Sequences(True, n, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k)
    return _run(q, k, v, seqs, _scale_of(scale, head_dim), configs)


SUPPORTED_BACKENDS = (CUDA_SM90, TRITON_INTERPRETER)


# The references, the FP64 contract and the SDPA / transformers adapters live beside this module; they are part
# of its public face (resolved on first use, so neither imports the other at load time).
_REEXPORTS = {
    "attention_ref": "detkit.kernels.attention_ref", "attention_varlen_ref": "detkit.kernels.attention_ref",
    "attention_oracle": "detkit.kernels.attention_ref", "attention_fwd_bound": "detkit.kernels.attention_ref",
    "attention_bwd_bound": "detkit.kernels.attention_ref",
    "sdpa_unsupported_reason": "detkit.kernels.attention_sdpa", "sdpa": "detkit.kernels.attention_sdpa",
    "hf_attention_forward": "detkit.kernels.attention_sdpa",
}


def __getattr__(name: str):
    if name in _REEXPORTS:
        import importlib

        return getattr(importlib.import_module(_REEXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
