"""Deterministic, batch-invariant causal attention for Hopper: forward (prefill, chunked prefill, KV-cache
decode, packed variable-length sequences) and backward (dq, dk, dv), BF16 in, FP32 online softmax, BF16 out.

Math, per query row (a query head h, a query i) with visible keys j:
    z_j = scale * (q . k_j)        o = sum_j softmax(z)_j v_j        lse = log2 sum_j 2^(z_j log2 e)
computed as FlashAttention does: key tiles streamed through an FP32 running max m, running sum l and
accumulator acc, exp2 with scale * log2(e) folded into one multiplier, P rounded to BF16 for the P @ V MMA,
o = acc / l rounded once to BF16. The backward recomputes P from the saved lse.

Split-KV: each row's key tiles are grouped into splits counted from the sequence's first key like the tiles, of a
size set by the row's own key extent e (the keys from the sequence's first key through the row's causal end, its
last visible key): a pinned step function (configs.SPLIT_TIERS, constexprs SPLIT_E0/E1 and SPLIT_N0/N1/N2). Each
split's (m, l, acc) starts from the start state (m = -inf, l = 0, acc = 0) and walks its tiles in ascending order;
a row's splits are folded in ascending order (``_fold``) into the (m, l, acc) that gives o and lse. Either one
program per query tile walks all its tiles, each row folding its split as it ends (prefill, and any grid large
enough), or one program per (query tile, run of splits) stores each row's partials and
``attention_fwd_combine_kernel`` folds them (a small grid: decode at small batch spreads over the GPU). Both run
the same partial code and the same fold on the same FP32 values, so their bits are the same.

Variants (constexpr flags; without them the arithmetic is the plain kernel's, bit for bit):
- WINDOWED: a sliding window, query at position p sees keys (p - window, p] (key positions, so decode and prefill
  agree). Key tiles before every row's window are skipped (``_key_tiles`` says why no row's bits can change), the
  window's edge tiles are masked as the diagonal's are. The tiles stay anchored at the sequence's first key, which
  may lie before k's first row (a negative kv_start: a sliding-window cache dropped it).
- SOFTCAP: z = c * tanh(scale q.k / c) (Gemma-2): tanh(q.k * scale / c) times c * log2(e); the backward multiplies
  dS by 1 - tanh^2.
- HAS_SINKS: a per-head logit s joined to every row's denominator (gpt-oss): one more online-softmax update after
  the key tiles, with p = 2^(s log2(e) - m) and no value; lse includes it, so the backward kernels are unchanged
  (the sink's gradient, -sum p_sink * delta, is taken in torch by the launcher).

Layout (as transformers passes it): q [B, Hq, Sq, D], k and v [B, Hkv, Skv, D], Hq a multiple of Hkv (GQA),
D in {64, 128, 256}, the last dim contiguous, BF16. Causal, aligned bottom-right: query i sits at key position
kv_end - Sq + i (kv_end defaults to Skv), so a KV-cache decode (Sq = 1) and a chunked prefill (Sq new queries
after a cache) are the same call as a prefill. Sequence b sees keys [kv_start[b], kv_end[b]); keys before
kv_start (left padding) and after the query's own position are not visible. Packed sequences
(``attention_varlen``) are the same kernels with per-sequence offsets (kv_start 0, or the sequence's own anchor
under a window; kv_end the sequence's key count).

Head dims narrower than the tile (forward only): q and k of head dim DIM_QK, v and o of head dim DIM_V, both <=
HEAD_DIM (MLA: DeepSeek-V3's 192 and 128 on the 256 tiles; Phi-3-mini's 96 on the 128 tiles). The forward loads
their columns masked (``_cols``): the other columns load as exact zeros, the values a copy zero-padded to HEAD_DIM
holds, so every MMA, max, sum and fold runs on the padded path's operands and gives its bits; o (and the split
grid's partials) are stored in their DIM_V columns. With DIM_QK = DIM_V = HEAD_DIM the masks are the rows' alone:
the code is the native path's. The backward kernels run on zero-padded copies (launch.mixed_head_dims). Paged
(below): v_cache rows then have their own strides when DIM_V differs from DIM_QK.

Paged KV (PAGED, forward only; ``attention_paged``): the queries packed as varlen's, the keys and values in a page
storage [P, PAGE_SIZE, Hkv, D] (transformers' paged cache and flash's layout), key n of sequence b at row
n % PAGE_SIZE of page block_table[b, n // PAGE_SIZE]. Only the K/V row addresses change (gathered per key row, any
page size): the tiles, splits and update sequence are the contiguous path's, so the bits equal varlen's on the same
keys gathered. Keys past the sequence's end read no table entry; the page ids the sequence needs are checked on the
host. ``AttnConfigs.paged_tile_page`` (TILE_PAGES; tiles counted from key 0): where a page holds whole key tiles (a
page size that is a multiple of BLOCK_N) a tile reads one table entry, and where a tile holds whole pages (a page
size that divides BLOCK_N) one entry a page, instead of one a key: the same rows. ``paged_early_pages``
(EARLY_PAGES): a program reads its first tile's entries before its sequence's bounds, so the two loads overlap.
``paged_prefetch_pages`` (PREFETCH_PAGES, with TILE_PAGES): each key tile's entries are read one tile ahead, so a
tile's K/V loads wait on no table load of their own step. The same entries, rows and bits on every path.

GQA: one program owns one KV head and packs the query heads of its group into the M dimension of its tile
(rows = HEADS heads x BLOCK_M / HEADS query positions), so each K/V tile is loaded once for the whole group
and a decode step (one query per head) still feeds the tensor cores.

THE INVARIANCE RULE. A query's output depends only on its own q and on K, V of its visible keys, reduced over
fixed-size key tiles (BLOCK_N keys) in splits whose size is a pinned function of the row's own key extent e (keys
from the sequence's first key through its causal end), both counted from the sequence's first valid key (kv_start),
each split in ascending tile order and the splits folded in ascending order, with the same update sequence in every
path — whatever q_len, chunk boundaries, batch size, batch position, padding or grid. It holds by construction:
- One kernel and one config per head_dim (BLOCK_M, BLOCK_N, num_warps, num_stages, instruction path) for
  every call: the config never depends on Sq, Skv, B or padding (``CONFIG_TABLE``, pinned, no autotune).
- Key tiles start at the sequence's first valid key, so the same logical keys sit in the same lanes of the
  same tiles whatever the padding; a row's MMA results depend on its own row only.
- Masking selects -inf into the raw scores (before the shared arithmetic), so a masked tile and a fully
  visible tile run the same update code on the same values; keys past the sequence's end are loaded as exact
  zeros. A row whose tile is entirely masked (it shares the program with later queries) sees p = exp2(-inf) = 0
  and alpha = 1 exactly (selected, not computed), so the extra tile changes none of its bits.
- e is the row's position from its sequence's anchor plus one: the same in every path, whatever else the call
  holds, so its split size is too. Rows of one tile may have different split sizes: each row ends its split at
  its own boundaries; a row whose split does not end at a tile keeps its state (selected, not computed).
- A split's partial depends only on the row and the split's keys: it starts from the start state at the split's
  first tile (tiles skipped before a row's window leave the start state exactly, as above). The fold skips a split
  that holds none of a row's keys (m = -inf) and takes the first one that does as it is (selected), so which
  splits a program walks (set by the other rows it holds, or by the grid) changes no row's bits, and a row that
  sees one split gets that split's partial exactly. The fold's adds are explicit FMAs: no compiler may contract
  them differently in the two kernels.
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

import triton
import triton.language as tl

from detkit.kernels.attention.names import launch_metadata_of
from detkit.kernels.det_gemm.kernels import mac_step, to_bf16

LOG2E = 1.4426950408889634

# Triton specialises integer arguments equal to 1 or divisible by 16 and pointers on 16-byte alignment; these
# would make a decode step (Sq = 1, B = 1; lse's head stride is Sq) run a different binary from a prefill. Not
# specialising them keeps one binary per (config, head_dim, heads per tile, layout flags) for every q_len, batch,
# cache length and head count (the other strides are multiples of head_dim).
_NOT_SPECIALIZED = ["batch", "heads_q", "heads_kv", "seq_q", "seq_k", "stride_lb", "stride_lh", "kv_start_ptr",
                    "kv_end_ptr", "window"]
# The forward's split grid: how many splits a launch covers and the partials' row count vary with the call too.
_NOT_SPECIALIZED_FWD = _NOT_SPECIALIZED + ["split_slots", "ws_rows"]
# The split grid's splits per program and their key tiles: a speed choice per launch (launch.py split_group and
# launch_split).
_NOT_SPECIALIZED_SPLIT = _NOT_SPECIALIZED_FWD + ["split_group", "split_tiles"]
# PAGED: the table is a slice of the caller's (its row stride is the table's width; its start need not be aligned).
_NOT_SPECIALIZED_PAGED = _NOT_SPECIALIZED_SPLIT + ["block_table_ptr", "stride_tb"]

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
def _sequence(b, kv_start_ptr, kv_end_ptr, seq_q, seq_k, window,
              VARLEN: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_KV_END: tl.constexpr, WINDOWED: tl.constexpr):
    """(q_begin, q_len, k_begin, k_first, k_end, bad) of sequence ``b``: its queries are rows q_begin.. of q, its
    keys rows k_begin.. of k; it sees keys [k_first, k_end) of its own and query i sits at k_end - q_len + i.
    Padded layout: kv_start_ptr / kv_end_ptr are the int32 [B] bounds (or unused); varlen: they are cu_seqlens_q
    and cu_seqlens_k (checked on the host). ``bad``: bounds that do not make sense (outputs NaN, no keys read).
    WINDOWED: k_first may be negative (a sliding-window cache dropped the sequence's first keys; the key tiles stay
    anchored at the sequence's first key) as long as no query's window reaches a dropped key. Varlen with
    HAS_KV_START (anchored packed sequences, launch.py): sequence b's kv_start sits at cu_seqlens_k[-1 - b], the
    anchors stored just before cu_seqlens_k in reverse order (no extra pointer); checked on the host."""
    if VARLEN:
        q_begin = tl.load(kv_start_ptr + b)
        q_len = tl.load(kv_start_ptr + b + 1) - q_begin
        k_begin = tl.load(kv_end_ptr + b)
        k_end = tl.load(kv_end_ptr + b + 1) - k_begin
        if HAS_KV_START:
            k_first = tl.load(kv_end_ptr - 1 - b)
        else:
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
        if WINDOWED:
            dropped_visible = (k_first < 0) & (k_end - q_len - window + 1 < 0)
            bad = dropped_visible | (k_first > k_end) | (k_end > seq_k)
        else:
            bad = (k_first < 0) | (k_first > k_end) | (k_end > seq_k)
        k_first = tl.where(bad, 0, k_first)
        k_end = tl.where(bad, 0, k_end)
    return q_begin, q_len, k_begin, k_first, k_end, bad


@triton.jit
def _tanh(x):
    """tanh(x) = sign(x) (1 - e) / (1 + e) with e = 2^(-2 log2(e) |x|): exp2 (ex2.approx on the GPU) and IEEE FP32
    ops, one formula on both backends. Its absolute error is derived in docs/attention.md (softcap)."""
    e = tl.math.exp2(tl.abs(x) * -2.8853900817779268)  # -2 log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _logits(qk, tanh_scale, SOFTCAP: tl.constexpr):
    """The logits in the units the kernels multiply by ``qk_scale``: q.k itself, or with a softcap c,
    tanh(q.k * scale / c) (qk_scale is then c * log2(e), so qk * qk_scale = c tanh(scale q.k / c) log2(e))."""
    if SOFTCAP:
        qk = _tanh(qk * tanh_scale)
    return qk


@triton.jit
def _key_tiles(k_first, k_end, q_len, q_lo, last_q, window, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
    """The key tiles [k_first + t * BLOCK_N, ...) a query tile with rows q_lo..last_q walks: t in [t_lo, n_tiles);
    tiles in [n_win, n_full) are visible to every row in full (no mask), the others are masked. Without a window
    t_lo = n_win = 0. With one, the tiles before t_lo lie before every row's window and are skipped: for each row
    they are fully masked and come before its first visible key, so walking them would leave its state at the
    start values exactly (m = -inf, l = +0, acc = +0: p = exp2(-inf) = +0, alpha selected as 1 since m does not
    change, +0 * 1 + (+-0) = +0). A row's bits therefore depend on the tiles holding its visible keys only, and
    those tiles are the same (anchored at k_first) in every path; which leading masked tiles a program skips can
    not change any row's bits."""
    n_tiles = tl.cdiv(tl.maximum(k_end - q_len + last_q + 1 - k_first, 0), BLOCK_N)
    n_full = tl.maximum(k_end - q_len + q_lo + 1 - k_first, 0) // BLOCK_N
    if WINDOWED:
        lo_first = k_end - q_len + q_lo - window + 1  # the lowest key any row of the tile sees
        lo_last = k_end - q_len + last_q - window + 1  # from here on every row of the tile sees every key
        t_lo = tl.maximum(lo_first - k_first, 0) // BLOCK_N
        n_win = tl.cdiv(tl.maximum(lo_last - k_first, 0), BLOCK_N)
    else:
        t_lo = 0
        n_win = 0
    return t_lo, n_win, n_full, n_tiles


@triton.jit
def _visible(kj, key_ok, pos, window, WINDOWED: tl.constexpr):
    """[rows, keys] visibility: causal (key <= the row's position), inside the sequence, inside the window."""
    visible = (kj[None, :] <= pos[:, None]) & key_ok[None, :]
    if WINDOWED:
        visible = visible & (kj[None, :] > (pos - window)[:, None])
    return visible


@triton.jit
def _key_ok(kj, k_end, WINDOWED: tl.constexpr):
    """Keys that exist in the tensor: below the sequence's end, and (WINDOWED, the anchor may be negative) >= 0."""
    if WINDOWED:
        ok = (kj < k_end) & (kj >= 0)
    else:
        ok = kj < k_end
    return ok


@triton.jit
def _page_rows(table_row_ptr, kj, key_ok, PAGE_SIZE: tl.constexpr):
    """(page [BLOCK_N] int64, row [BLOCK_N]) of keys kj in a paged storage: page table_row[kj // PAGE_SIZE], row
    kj % PAGE_SIZE. Keys past the sequence's end (masked) read no table entry and get page 0 (their K/V loads are
    masked too). 64-bit pages: a cache may exceed 2**31 elements; within a page 32 bits (checked on the host)."""
    page = tl.load(table_row_ptr + kj // PAGE_SIZE, mask=key_ok, other=0)
    return page.to(tl.int64), kj % PAGE_SIZE


@triton.jit
def _tile_entries(table_row_ptr, first_key, k_end, early, is_first, in_range, PAGE_SIZE: tl.constexpr,
                  TILE_PAGES: tl.constexpr):
    """The table entries of the key tile starting at ``first_key`` (a multiple of BLOCK_N) where pages hold whole
    tiles (TILE_PAGES 1: one entry, the tile lies in one page) or tiles whole pages (TILE_PAGES > 1: one a page):
    not one a key. Pages past the sequence's end, and every page of a tile not ``in_range`` (a prefetch past the
    program's last tile), read no entry (0; their keys' loads are masked). ``is_first``: the tile's entries are
    ``early`` (``_first_tile_pages``), read nothing here."""
    if TILE_PAGES == 1:
        entry = tl.load(table_row_ptr + first_key // PAGE_SIZE, mask=in_range & (is_first == 0), other=0)
        return tl.where(is_first, early, entry)
    else:
        offs_p = tl.arange(0, TILE_PAGES)
        entries = tl.load(table_row_ptr + first_key // PAGE_SIZE + offs_p,
                          mask=(first_key + offs_p * PAGE_SIZE < k_end) & in_range & (is_first == 0), other=0)
        return tl.where(is_first, early, entries)


@triton.jit
def _entry_rows(entries, first_key, offs_n, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                TILE_PAGES: tl.constexpr):
    """``_page_rows`` of the key tile starting at ``first_key`` from its entries (``_tile_entries``)."""
    if TILE_PAGES == 1:
        return entries.to(tl.int64), first_key % PAGE_SIZE + offs_n
    else:
        page = tl.reshape(tl.broadcast_to(entries[:, None], [TILE_PAGES, PAGE_SIZE]), [BLOCK_N]).to(tl.int64)
        return page, offs_n % PAGE_SIZE


@triton.jit
def _first_tile_pages(table_row_ptr, first_key, seq_k, width, PAGE_SIZE: tl.constexpr, TILE_PAGES: tl.constexpr):
    """The table entries of the key tile a program most likely walks first, read before the sequence's bounds are
    known (the program's own first key when no window moves it): ``_tile_entries``', for the tile starting at
    ``first_key``, where that key lies below ``seq_k`` (every sequence's most keys) and in the table's row of
    ``width`` entries; entries past the sequence's end are read but never used (their keys' loads are masked)."""
    if TILE_PAGES == 1:
        index = first_key // PAGE_SIZE
        return tl.load(table_row_ptr + index, mask=(first_key < seq_k) & (index < width), other=0)
    else:
        index = first_key // PAGE_SIZE + tl.arange(0, TILE_PAGES)
        return tl.load(table_row_ptr + index, mask=(first_key < seq_k) & (index < width), other=0)


@triton.jit
def _cols(rows_ok, offs_d, DIM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The load / store mask of a [rows, HEAD_DIM] tile over rows of DIM <= HEAD_DIM columns (a head dim the kernels
    run on a wider tile: MLA's, Phi-3-mini's): the rows' mask alone when DIM is the tile's (the native path's code,
    unchanged), else the first DIM columns too. Loads give exact zeros in the other columns, the values a
    zero-padded copy holds there, so every MMA sees the padded path's operands."""
    if DIM == HEAD_DIM:
        mask = rows_ok[:, None]
    else:
        mask = rows_ok[:, None] & (offs_d[None, :] < DIM)
    return mask


@triton.jit
def _split_keys(e, SPLIT_E0: tl.constexpr, SPLIT_E1: tl.constexpr, SPLIT_N0: tl.constexpr, SPLIT_N1: tl.constexpr,
                SPLIT_N2: tl.constexpr):
    """Keys per split of rows of key extent e (configs.split_tiers): SPLIT_N0 up to SPLIT_E0 keys, SPLIT_N1 up to
    SPLIT_E1, SPLIT_N2 beyond (a table of fewer tiers repeats its last split)."""
    return tl.where(e <= SPLIT_E0, SPLIT_N0, tl.where(e <= SPLIT_E1, SPLIT_N1, SPLIT_N2))


@triton.jit
def _row_splits(pos, k_first, window, WINDOWED: tl.constexpr, SPLIT_E0: tl.constexpr, SPLIT_E1: tl.constexpr,
                SPLIT_N0: tl.constexpr, SPLIT_N1: tl.constexpr, SPLIT_N2: tl.constexpr):
    """(keys per split, first split, split count) of rows at key positions pos: their key extent e = pos - k_first + 1
    (keys from the sequence's first key through the row's causal end) sets the split size; splits are counted from
    k_first. The first split holds the row's first visible key (0 without a window), the count runs through the
    split holding pos (0 for a row before the sequence's first key). The split grid stores split s of a row in its
    slot s - first and the combine pass reads its count: the same function of the row in both."""
    e = pos - k_first + 1
    split = _split_keys(e, SPLIT_E0, SPLIT_E1, SPLIT_N0, SPLIT_N1, SPLIT_N2)
    if WINDOWED:
        first = tl.maximum(pos - window + 1 - k_first, 0) // split
    else:
        first = tl.zeros_like(e)
    count = tl.where(e > 0, (tl.maximum(e, 1) - 1) // split - first + 1, 0)
    return split, first, count


@triton.jit
def _fold(m_all, l_all, acc_all, m_s, l_s, acc_s):
    """Fold one split's partial (m_s, l_s, acc_s) into the splits folded so far (m_all, l_all, acc_all), the same
    code in every path. A split that holds none of a row's keys (m_s = -inf) leaves the row as it was; the first
    split that holds some is taken as it is (selected, not computed), so a row that sees one split gets exactly that
    split's partial. Otherwise both sides are rescaled to the larger max (a factor selected as exactly 1 where the
    max does not move) and added, with explicit FMAs so that no compiler contracts them differently in the one-pass
    kernel and the combine kernel."""
    m_new = tl.maximum(m_all, m_s)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.where(m_new == m_all, 1.0, tl.math.exp2(m_all - m_ref))
    beta = tl.where(m_new == m_s, 1.0, tl.math.exp2(m_s - m_ref))
    l_sum = tl.fma(l_all, alpha, l_s * beta)
    acc_sum = tl.fma(acc_all, alpha[:, None], acc_s * beta[:, None])
    empty = m_s == float("-inf")
    first = m_all == float("-inf")
    l_out = tl.where(empty, l_all, tl.where(first, l_s, l_sum))
    acc_out = tl.where(empty[:, None], acc_all, tl.where(first[:, None], acc_s, acc_sum))
    m_out = tl.where(empty, m_all, m_new)
    return m_out, l_out, acc_out


@triton.jit
def _tile_rows(pid_h, pid_m, heads_q, heads_kv, q_begin, q_len, HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
               VARLEN: tl.constexpr):
    """The rows of a forward tile (HEADS query heads of one KV group x BLOCK_M / HEADS query positions): (kv_head,
    head [BLOCK_M], qi [BLOCK_M], row_ok [BLOCK_M], tok [BLOCK_M])."""
    BQ: tl.constexpr = BLOCK_M // HEADS
    group = heads_q // heads_kv
    chunks = group // HEADS
    kv_head = pid_h // chunks
    offs_r = tl.arange(0, BLOCK_M)
    h_loc = offs_r // BQ
    qi = pid_m * BQ + offs_r % BQ
    row_ok = (h_loc < HEADS) & (qi < q_len)
    head = kv_head * group + (pid_h % chunks) * HEADS + h_loc
    return kv_head, head, qi, row_ok, _token(q_begin, qi, VARLEN)


@triton.jit
def _finish(m_i, l_i, acc, bad, head, qi, tok, row_ok, b64, q_begin, o_ptr, lse_ptr, sinks_ptr,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
            HEAD_DIM: tl.constexpr, DIM_V: tl.constexpr, HAS_SINKS: tl.constexpr, INTERPRETED: tl.constexpr):
    """From a row's folded (m, l, acc): the sink, o = acc / l (BF16) and lse = m + log2(l), stored (o's first DIM_V
    columns: o is [.., DIM_V]). The same code after the one-pass kernel and after the combine kernel."""
    if HAS_SINKS:
        # The sink joins the denominator after every split, the same step in every path (a row's bits still depend
        # on its visible keys and its head's sink only): one more online-softmax update with p = 2^(s - m) and no
        # value.
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.where(m_fin == m_i, 1.0, tl.math.exp2(m_i - m_fin))
        l_i = l_i * alpha + tl.math.exp2(sink - m_fin)
        acc = acc * alpha[:, None]
        m_i = m_fin
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]  # rows that see no key: 0
    out = tl.where(bad, float("nan"), out)
    # lse in log2 units; +inf for rows that see no key, so the backward's exp2(s - lse) is 0 there.
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("inf"))
    lse = tl.where(bad, float("nan"), lse)
    offs_d = tl.arange(0, HEAD_DIM)
    o_rows = o_ptr + b64 * stride_ob + head * stride_oh + tok * stride_os
    tl.store(o_rows[:, None] + offs_d[None, :], to_bf16(out, INTERPRETED), mask=_cols(row_ok, offs_d, DIM_V, HEAD_DIM))
    tl.store(lse_ptr + b64 * stride_lb + head * stride_lh + q_begin + qi, lse, mask=row_ok)


@triton.jit(launch_metadata=launch_metadata_of("fwd", 4), do_not_specialize=_NOT_SPECIALIZED_PAGED)
def attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    kv_start_ptr, kv_end_ptr,  # int32 [B] (padded) or cu_seqlens_q / cu_seqlens_k (varlen, paged)
    block_table_ptr,  # PAGED: int32 [B, max_pages], rows contiguous
    ws_m_ptr, ws_l_ptr, ws_acc_ptr,  # SPLIT_GRID: fp32 partials [split_slots, rows] (acc: [split_slots, rows, DIM_V])
    stride_qb, stride_qh, stride_qs,  # q [B, Hq, Sq, D] (varlen: [Tq, Hq, D], stride_qb unused)
    stride_kb, stride_kh, stride_ks,  # k [B, Hkv, Skv, D]; PAGED: pages [P, PAGE_SIZE, Hkv, D] (stride_kb: a page's)
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,  # lse [B, Hq, Sq] fp32 (varlen: [Hq, Tq]); a row's lse offset is its partials' row
    stride_tb,  # PAGED: the block table's row stride
    batch, heads_q, heads_kv, seq_q, seq_k,  # varlen: seq_q / seq_k are max_seqlen_q / max_seqlen_k
    qk_scale,  # scale * log2(e); SOFTCAP: softcap * log2(e)
    window,  # WINDOWED: query at position p sees keys (p - window, p]
    tanh_scale,  # SOFTCAP: scale / softcap
    sinks_ptr,  # HAS_SINKS: [Hq] per-head sink logits (natural units), joined to every row's softmax denominator
    split_slots, ws_rows,  # SPLIT_GRID: the partials' slots per row (its most splits); their rows (lse.numel())
    split_group,  # SPLIT_GRID: consecutive launch splits per program (each row's partials stored on their own)
    split_tiles,  # SPLIT_GRID: key tiles per launch split, the largest split any row of the launch can have
    HEAD_DIM: tl.constexpr,  # the tiles' head dim (configs.HEAD_DIMS)
    DIM_QK: tl.constexpr, DIM_V: tl.constexpr,  # q/k's and v's (and o's) head dims, <= HEAD_DIM; masked loads
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
    VARLEN: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_KV_END: tl.constexpr, INTERPRETED: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    SPLIT_E0: tl.constexpr, SPLIT_E1: tl.constexpr,  # the split tiers' bounds on the key extent (configs.split_tiers)
    SPLIT_N0: tl.constexpr, SPLIT_N1: tl.constexpr, SPLIT_N2: tl.constexpr,  # and their keys per split
    SPLIT_GRID: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,  # PAGED (with VARLEN): K/V read through the block table
    TILE_PAGES: tl.constexpr,  # PAGED: 0, or each key tile lies in this many whole pages (launch.py)
    EARLY_PAGES: tl.constexpr,  # TILE_PAGES: the first tile's entries read before the sequence's bounds
    PREFETCH_PAGES: tl.constexpr,  # TILE_PAGES: each tile's entries read one tile ahead, before its K/V loads
):
    """One query tile over its key tiles, each row's split size set by its own key extent (``_row_splits``). One pass
    (SPLIT_GRID off): every tile of the query tile in ascending order, each row folding its split as it ends, then o
    and lse. Split grid: ``split_group`` consecutive launch splits (``split_tiles`` key tiles each, the largest split
    any row of the launch has, so every row's split lies in one program) per program (the grid's first axis runs
    heads fastest, then groups of splits), each row's split partial stored on its own as it ends, in the row's own
    slot, for ``attention_fwd_combine_kernel`` to fold: how many splits a program takes changes no partial, so no
    bit. PAGED: the same, with each key tile's K/V rows gathered through the block table."""
    BQ: tl.constexpr = BLOCK_M // HEADS  # query positions per tile
    # Grid (heads x splits, query tiles, sequences), heads fastest: the latest (longest) query tiles of every head
    # start first, so the short ones fill the tail of the causal triangle.
    b = tl.program_id(2)
    head_programs = heads_kv * ((heads_q // heads_kv) // HEADS)
    pid_h = tl.program_id(0) % head_programs
    slot = tl.program_id(0) // head_programs
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    if EARLY_PAGES:
        # Issued before the sequence's bounds so that its latency overlaps theirs: without a window a program's first
        # tile is its first launch split's (split grid) or key 0's (one pass).
        early_tile = slot * split_group * split_tiles if SPLIT_GRID else 0
        early = _first_tile_pages(block_table_ptr + b.to(tl.int64) * stride_tb, early_tile * BLOCK_N, seq_k,
                                  stride_tb, PAGE_SIZE, TILE_PAGES)
    else:
        early_tile = -1
        early = 0
    q_begin, q_len, k_begin, k_first, k_end, bad = _sequence(b, kv_start_ptr, kv_end_ptr, seq_q, seq_k, window,
                                                             VARLEN, HAS_KV_START, HAS_KV_END, WINDOWED)
    q_lo = pid_m * BQ
    if q_lo >= q_len:
        return

    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    kv_head, head, qi, row_ok, tok = _tile_rows(pid_h, pid_m, heads_q, heads_kv, q_begin, q_len, HEADS, BLOCK_M,
                                                VARLEN)
    pos = k_end - q_len + qi  # each row's own key position
    # Each row's split: its keys, its first split holding a visible key and its split count (``_row_splits``).
    split_keys, split_first, split_count = _row_splits(pos, k_first, window, WINDOWED, SPLIT_E0, SPLIT_E1, SPLIT_N0,
                                                       SPLIT_N1, SPLIT_N2)
    row_tiles = split_keys // BLOCK_N  # key tiles per split, a power of two
    # The tile's smallest split, its first position's (e grows with the position, each tier's split a multiple of
    # the smaller ones'): no row's split ends at a tile where this one's does not.
    min_tiles = _split_keys(k_end - q_len + q_lo - k_first + 1, SPLIT_E0, SPLIT_E1, SPLIT_N0, SPLIT_N1,
                            SPLIT_N2) // BLOCK_N
    b64 = b.to(tl.int64)
    q_rows = q_ptr + b64 * stride_qb + head * stride_qh + tok * stride_qs
    # [BLOCK_M, HEAD_DIM]
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=_cols(row_ok, offs_d, DIM_QK, HEAD_DIM), other=0.0)
    if PAGED:  # a key's page comes from the table: no per-sequence base
        k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
        v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
        table_row = block_table_ptr + b64 * stride_tb
    else:
        k_base = k_ptr + b64 * stride_kb + kv_head.to(tl.int64) * stride_kh + k_begin.to(tl.int64) * stride_ks
        v_base = v_ptr + b64 * stride_vb + kv_head.to(tl.int64) * stride_vh + k_begin.to(tl.int64) * stride_vs

    # Key tiles [k_first + t * BLOCK_N, ...): tiles 0..n_full-1 are visible to every row of this tile in full,
    # tiles n_full..n_tiles-1 reach the diagonal (or the sequence's end) and are masked. A row's split s holds tiles
    # s * row_tiles ..., so splits, like tiles, are counted from the sequence's first key.
    last_q = tl.minimum(q_lo + BQ, q_len) - 1
    t_lo, n_win, n_full, n_tiles = _key_tiles(k_first, k_end, q_len, q_lo, last_q, window, BLOCK_N, WINDOWED)
    if SPLIT_GRID:
        # This program's tiles: launch splits slot * split_group ... (+ split_group - 1), counted from the one holding
        # the tile's first visible key (none past the last tile). A launch split's edges are split edges of every row.
        s_lo = t_lo // split_tiles
        s_first = (s_lo + slot * split_group) * split_tiles
        t_begin = tl.maximum(s_first, t_lo)
        t_end = tl.minimum(s_first + split_group * split_tiles, n_tiles)
    else:
        t_begin = t_lo
        t_end = n_tiles

    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)  # the splits folded so far
    l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_all = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # the current split, from the start state
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if PREFETCH_PAGES:  # the first tile's entries; each step then reads the next tile's before its own K/V
        next_entries = _tile_entries(table_row, t_begin * BLOCK_N, k_end, early, t_begin == early_tile,
                                     t_begin < t_end, PAGE_SIZE, TILE_PAGES)
    for t in range(t_begin, t_end):
        kj = k_first + t * BLOCK_N + offs_n  # key index within the sequence
        key_ok = _key_ok(kj, k_end, WINDOWED)
        # [BLOCK_N, HEAD_DIM]
        if PAGED:
            if TILE_PAGES == 0:
                page, page_row = _page_rows(table_row, kj, key_ok, PAGE_SIZE)
            else:
                if PREFETCH_PAGES:
                    entries = next_entries
                    next_entries = _tile_entries(table_row, (t + 1) * BLOCK_N, k_end, early, False, t + 1 < t_end,
                                                 PAGE_SIZE, TILE_PAGES)
                else:
                    entries = _tile_entries(table_row, t * BLOCK_N, k_end, early, t == early_tile, True, PAGE_SIZE,
                                            TILE_PAGES)
                page, page_row = _entry_rows(entries, t * BLOCK_N, offs_n, BLOCK_N, PAGE_SIZE, TILE_PAGES)
            kv_off = page * stride_kb + page_row * stride_ks
            k = tl.load(k_base + kv_off[:, None] + offs_d[None, :], mask=_cols(key_ok, offs_d, DIM_QK, HEAD_DIM),
                        other=0.0)
        else:
            k = tl.load(k_base + kj[:, None] * stride_ks + offs_d[None, :],
                        mask=_cols(key_ok, offs_d, DIM_QK, HEAD_DIM), other=0.0)
        qk = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), HEAD_DIM, INTERPRETED)
        qk = _logits(qk, tanh_scale, SOFTCAP)
        if (t >= n_full) | (t < n_win):
            qk = tl.where(_visible(kj, key_ok, pos, window, WINDOWED), qk, float("-inf"))
        # The shared update: the same code for every tile, masked or not.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk * qk_scale - m_ref[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.where(m_new == m_i, 1.0, tl.math.exp2(m_i - m_ref))
        l_i = l_i * alpha + tl.sum(p, 1)
        # [BLOCK_N, HEAD_DIM]
        if PAGED:
            if DIM_V == DIM_QK:
                v_off = kv_off  # v_cache has k_cache's strides (checked on the host): one offset a key
            else:
                v_off = page * stride_vb + page_row * stride_vs  # MLA: v_cache rows are narrower than k_cache's
            v = tl.load(v_base + v_off[:, None] + offs_d[None, :], mask=_cols(key_ok, offs_d, DIM_V, HEAD_DIM),
                        other=0.0)
        else:
            v = tl.load(v_base + kj[:, None] * stride_vs + offs_d[None, :],
                        mask=_cols(key_ok, offs_d, DIM_V, HEAD_DIM), other=0.0)
        acc = acc * alpha[:, None]
        acc = _dot(to_bf16(p, INTERPRETED), v, acc, BLOCK_N, INTERPRETED)
        m_i = m_new
        if (((t + 1) & (min_tiles - 1)) == 0) | (t + 1 == t_end):
            # Some row's split may end here (a scalar check: the smallest split's edge, or the program's last tile).
            # The rows whose split ends -- at its own edge, or at the program's last tile -- fold it (one pass) or
            # store its partial as it is in their own slot (split grid: the combine folds exactly these values), and
            # start the next from the start state; the others keep their state (selected, not computed).
            ends = (((t + 1) & (row_tiles - 1)) == 0) | (t + 1 == t_end)
            if SPLIT_GRID:
                # Splits before a row's window or past its position hold none of its keys: not stored (the combine
                # reads the row's split_count slots).
                slot_r = t // row_tiles - split_first
                keep = row_ok & ends & (slot_r >= 0) & (slot_r < split_count) & (slot_r < split_slots)
                _store_partial(ws_m_ptr, ws_l_ptr, ws_acc_ptr, slot_r, ws_rows, b64, head, qi, q_begin, keep, offs_d,
                               stride_lb, stride_lh, m_i, l_i, acc, HEAD_DIM, DIM_V)
            else:
                m_f, l_f, acc_f = _fold(m_all, l_all, acc_all, m_i, l_i, acc)
                m_all = tl.where(ends, m_f, m_all)
                l_all = tl.where(ends, l_f, l_all)
                acc_all = tl.where(ends[:, None], acc_f, acc_all)
            m_i = tl.where(ends, float("-inf"), m_i)
            l_i = tl.where(ends, 0.0, l_i)
            acc = tl.where(ends[:, None], 0.0, acc)

    if not SPLIT_GRID:
        _finish(m_all, l_all, acc_all, bad, head, qi, tok, row_ok, b64, q_begin, o_ptr, lse_ptr, sinks_ptr,
                stride_ob, stride_oh, stride_os, stride_lb, stride_lh, HEAD_DIM, DIM_V, HAS_SINKS, INTERPRETED)


@triton.jit
def _store_partial(ws_m_ptr, ws_l_ptr, ws_acc_ptr, slot, ws_rows, b64, head, qi, q_begin, row_ok, offs_d,
                   stride_lb, stride_lh, m_i, l_i, acc, HEAD_DIM: tl.constexpr, DIM_V: tl.constexpr):
    """One split's partial (m, l and acc's DIM_V columns) of the rows ``row_ok`` into the split grid's workspace at
    their ``slot`` (each row's own): m, l [split_slots, rows], acc [split_slots, rows, DIM_V] (FP32)."""
    ws_row = slot * ws_rows.to(tl.int64) + b64 * stride_lb + head * stride_lh + q_begin + qi
    tl.store(ws_m_ptr + ws_row, m_i, mask=row_ok)
    tl.store(ws_l_ptr + ws_row, l_i, mask=row_ok)
    tl.store(ws_acc_ptr + ws_row[:, None] * DIM_V + offs_d[None, :], acc, mask=_cols(row_ok, offs_d, DIM_V, HEAD_DIM))


@triton.jit
def _partial(slot, split_count, ws_rows, row, row_ok, offs_d, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
             HEAD_DIM: tl.constexpr, DIM_V: tl.constexpr):
    """The rows' stored partials (m, l, acc) in ``slot``; a slot past a row's ``split_count`` (or a row not ok) reads
    as empty: m = -inf, l = 0, acc = 0."""
    ok = row_ok & (slot < split_count)
    ws_row = slot * ws_rows.to(tl.int64) + row
    m_s = tl.load(ws_m_ptr + ws_row, mask=ok, other=float("-inf"))
    l_s = tl.load(ws_l_ptr + ws_row, mask=ok, other=0.0)
    acc_s = tl.load(ws_acc_ptr + ws_row[:, None] * DIM_V + offs_d[None, :], mask=_cols(ok, offs_d, DIM_V, HEAD_DIM),
                    other=0.0)
    return m_s, l_s, acc_s


@triton.jit(launch_metadata=launch_metadata_of("fwd_combine", 0), do_not_specialize=_NOT_SPECIALIZED_FWD)
def attention_fwd_combine_kernel(
    o_ptr, lse_ptr, kv_start_ptr, kv_end_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, sinks_ptr,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    batch, heads_q, heads_kv, seq_q, seq_k, window, split_slots, ws_rows,
    HEAD_DIM: tl.constexpr, DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, HEADS: tl.constexpr,
    VARLEN: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_KV_END: tl.constexpr, INTERPRETED: tl.constexpr,
    WINDOWED: tl.constexpr, HAS_SINKS: tl.constexpr,
    SPLIT_E0: tl.constexpr, SPLIT_E1: tl.constexpr, SPLIT_N0: tl.constexpr, SPLIT_N1: tl.constexpr,
    SPLIT_N2: tl.constexpr,
):
    """The split grid's second pass: the partials of each row's own splits (slots 0 .. its split count - 1,
    ``_row_splits``: rows of one program may have different split sizes and counts) folded in ascending order
    (``_fold``, as the one-pass kernel folds them), then o and lse (``_finish``). A program takes BLOCK_M rows laid
    out as a forward tile's (HEADS query heads x BLOCK_M / HEADS positions; its own BLOCK_M: rows are independent, so
    a row's bits do not depend on the tile) and loads four splits' partials before folding them, so a decode step's
    32 splits wait for memory 8 times rather than 32. A slot past a row's count is loaded as empty (m = -inf), which
    ``_fold`` leaves out."""
    BQ: tl.constexpr = BLOCK_M // HEADS
    b = tl.program_id(2)
    pid_h = tl.program_id(0)
    pid_m = tl.program_id(1)
    q_begin, q_len, _, k_first, k_end, bad = _sequence(b, kv_start_ptr, kv_end_ptr, seq_q, seq_k, window,
                                                       VARLEN, HAS_KV_START, HAS_KV_END, WINDOWED)
    if pid_m * BQ >= q_len:
        return
    offs_d = tl.arange(0, HEAD_DIM)
    _, head, qi, row_ok, tok = _tile_rows(pid_h, pid_m, heads_q, heads_kv, q_begin, q_len, HEADS, BLOCK_M,
                                          VARLEN)
    _, _, split_count = _row_splits(k_end - q_len + qi, k_first, window, WINDOWED, SPLIT_E0, SPLIT_E1, SPLIT_N0,
                                    SPLIT_N1, SPLIT_N2)
    # The forward stored no more than split_slots (the host's bound); the loop runs to the program's longest row.
    split_count = tl.where(row_ok, tl.minimum(split_count, split_slots), 0)
    b64 = b.to(tl.int64)
    row = b64 * stride_lb + head * stride_lh + q_begin + qi
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_all = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for first in range(0, tl.max(split_count, 0), 4):
        # Four loads issued before the first fold needs one (straight-line code: no wait carried between them).
        m_0, l_0, acc_0 = _partial(first, split_count, ws_rows, row, row_ok, offs_d, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
                                   HEAD_DIM, DIM_V)
        m_1, l_1, acc_1 = _partial(first + 1, split_count, ws_rows, row, row_ok, offs_d, ws_m_ptr, ws_l_ptr,
                                   ws_acc_ptr, HEAD_DIM, DIM_V)
        m_2, l_2, acc_2 = _partial(first + 2, split_count, ws_rows, row, row_ok, offs_d, ws_m_ptr, ws_l_ptr,
                                   ws_acc_ptr, HEAD_DIM, DIM_V)
        m_3, l_3, acc_3 = _partial(first + 3, split_count, ws_rows, row, row_ok, offs_d, ws_m_ptr, ws_l_ptr,
                                   ws_acc_ptr, HEAD_DIM, DIM_V)
        m_all, l_all, acc_all = _fold(m_all, l_all, acc_all, m_0, l_0, acc_0)
        m_all, l_all, acc_all = _fold(m_all, l_all, acc_all, m_1, l_1, acc_1)
        m_all, l_all, acc_all = _fold(m_all, l_all, acc_all, m_2, l_2, acc_2)
        m_all, l_all, acc_all = _fold(m_all, l_all, acc_all, m_3, l_3, acc_3)
    _finish(m_all, l_all, acc_all, bad, head, qi, tok, row_ok, b64, q_begin, o_ptr, lse_ptr, sinks_ptr,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh, HEAD_DIM, DIM_V, HAS_SINKS, INTERPRETED)


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


@triton.jit(launch_metadata=launch_metadata_of("bwd_dkdv", 8), do_not_specialize=_NOT_SPECIALIZED)
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
    qk_scale, scale, window, tanh_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
    VARLEN: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_KV_END: tl.constexpr, INTERPRETED: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """dk and dv of BLOCK_N keys of one KV head: query tiles in ascending order, the group's query heads summed
    inside each tile's MMA (head chunks in ascending order); no atomics."""
    BQ: tl.constexpr = BLOCK_M // HEADS
    b = tl.program_id(2)
    kv_head = tl.program_id(0)  # grid (KV heads, key tiles, sequences): the first key tiles (most queries) first
    pid_n = tl.program_id(1)
    group = heads_q // heads_kv
    chunks = group // HEADS
    q_begin, q_len, k_begin, k_first, k_end, bad = _sequence(b, kv_start_ptr, kv_end_ptr, seq_q, seq_k, window,
                                                             VARLEN, HAS_KV_START, HAS_KV_END, WINDOWED)
    if WINDOWED:
        # A negative anchor (keys dropped by a sliding-window cache): the first program takes the tile holding key 0.
        t0 = tl.maximum(-k_first, 0) // BLOCK_N
    else:
        t0 = 0
    n_lo = k_first + (t0 + pid_n) * BLOCK_N
    if n_lo >= k_end:
        return

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kj = n_lo + tl.arange(0, BLOCK_N)
    key_ok = _key_ok(kj, k_end, WINDOWED)
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
    if WINDOWED:
        # The last query that sees one of these keys sits at n_lo + BLOCK_N - 1 + window - 1; tiles whose last
        # query sits at n_lo + window or later have rows whose window starts past n_lo (masked from win_from on).
        reach = n_lo + BLOCK_N + window - 2 - shift
        n_qt = tl.minimum(n_qt, tl.where(reach < 0, 0, reach // BQ + 1))
        win_from = tl.maximum(n_lo + window - shift - BQ + 1, 0) // BQ
    else:
        win_from = n_qt
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
            qk_t = _logits(qk_t, tanh_scale, SOFTCAP)
            p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :])  # [BLOCK_N, BLOCK_M]
            if (t < full_from) | (t >= win_from):
                visible = (kj[:, None] <= (shift + qi)[None, :]) & key_ok[:, None]
                if WINDOWED:
                    visible = visible & (kj[:, None] > (shift + qi - window)[None, :])
                p_t = tl.where(visible, p_t, 0.0)
            dv = _dot(to_bf16(p_t, INTERPRETED), do, dv, BLOCK_M, INTERPRETED)
            dp_t = _dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), HEAD_DIM, INTERPRETED)
            ds_t = p_t * (dp_t - delta[None, :])
            if SOFTCAP:  # through the cap: d tanh(x) / dx = 1 - tanh(x)^2 (qk_t holds tanh)
                ds_t = ds_t * (1.0 - qk_t * qk_t)
            dk = _dot(to_bf16(ds_t, INTERPRETED), q, dk, BLOCK_M, INTERPRETED)
    dk = dk * scale
    dk = tl.where(bad, float("nan"), dk)
    dv = tl.where(bad, float("nan"), dv)
    out = b64 * stride_dkb + kv_head.to(tl.int64) * stride_dkh + k_begin.to(tl.int64) * stride_dks
    offs = kj[:, None] * stride_dks + offs_d[None, :]
    tl.store(dk_ptr + out + offs, to_bf16(dk, INTERPRETED), mask=key_ok[:, None])
    tl.store(dv_ptr + out + offs, to_bf16(dv, INTERPRETED), mask=key_ok[:, None])


@triton.jit(launch_metadata=launch_metadata_of("bwd_dq", 6), do_not_specialize=_NOT_SPECIALIZED)
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
    qk_scale, scale, window, tanh_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
    VARLEN: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_KV_END: tl.constexpr, INTERPRETED: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
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
    q_begin, q_len, k_begin, k_first, k_end, bad = _sequence(b, kv_start_ptr, kv_end_ptr, seq_q, seq_k, window,
                                                             VARLEN, HAS_KV_START, HAS_KV_END, WINDOWED)
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
    t_lo, n_win, n_full, n_tiles = _key_tiles(k_first, k_end, q_len, q_lo, last_q, window, BLOCK_N, WINDOWED)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for t in range(t_lo, n_tiles):
        kj = k_first + t * BLOCK_N + offs_n
        key_ok = _key_ok(kj, k_end, WINDOWED)
        # [BLOCK_N, HEAD_DIM]
        k = tl.load(k_base + kj[:, None] * stride_ks + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_base + kj[:, None] * stride_vs + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        qk = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), HEAD_DIM, INTERPRETED)
        qk = _logits(qk, tanh_scale, SOFTCAP)
        p = tl.math.exp2(qk * qk_scale - lse[:, None])  # [BLOCK_M, BLOCK_N]
        if (t >= n_full) | (t < n_win):
            p = tl.where(_visible(kj, key_ok, pos, window, WINDOWED), p, 0.0)
        dp = _dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), HEAD_DIM, INTERPRETED)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - qk * qk)
        dq = _dot(to_bf16(ds, INTERPRETED), k, dq, BLOCK_N, INTERPRETED)
    dq = dq * scale
    dq = tl.where(bad, float("nan"), dq)
    dq_rows = dq_ptr + b64 * stride_dqb + head * stride_dqh + tok * stride_dqs
    tl.store(dq_rows[:, None] + offs_d[None, :], to_bf16(dq, INTERPRETED), mask=row_ok[:, None])

