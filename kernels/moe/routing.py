"""Routing metadata for the deterministic MoE expert MLP (kernels/moe/layer.py).

From the router's top-k choice — ``topk_ids [T, K]`` int32 (``-1`` = masked route) and
``scores [T, K]`` — build the expert-sorted, padded index space the grouped GEMMs run over:

- Routes ``r = t*K + k`` are sorted by expert with a *stable* sort, so inside an expert the rows
  are in ascending (t, k) order: a function of the routing alone.
- Each expert's rows form one segment, padded up to a multiple of ``SEGMENT_ALIGN`` (128) rows, so
  every 128-row tile belongs to exactly one expert. Experts with no tokens get no rows.
- ``gather_token[p]`` is the token row of ``x`` that padded row ``p`` reads: the input is never
  materialised in expert order; the up-projection loads ``x[gather_token[p]]`` directly. Padding
  rows point at token 0 with score 0 and ``sorted_route = -1``; the kernels mask them to zeros.
- ``route_row[t, k]`` is the padded row of route (t, k), ``-1`` when masked: the combine and the
  dX gather-sum read it in ascending k.

``build_routing`` is three Triton launches and one device-to-host read, after the third. Why: the
same metadata built from ~55 small torch ops (``build_routing_torch``, check_topk included), two syncs
and two host-to-device copies costs 1.1-1.8 ms on an H200 (T=8192, K=8, E=8/128) for ~0.15 ms of
kernel time; the rest is per-op launch overhead and host round trips.

1. ``moe_route_hist_kernel``, one program per chunk of ``ROUTE_BLOCK`` routes in flat order: the
   chunk's per-expert histogram and its validation counts (out-of-range ids, duplicate ids in a
   row, non-finite scores) -> ``hist [chunks, E+3]``.
2. ``moe_route_scan_kernel``, one program per block of columns: exclusive prefix of ``hist`` over
   the chunks (each chunk's first rank per expert) and the column totals -> ``meta [E+3]``
   (expert counts, then the three validation counts).
3. ``moe_route_scatter_kernel``, one program per chunk of routes and per block of ``ROW_BLOCK``
   padded rows, over buffers sized for the largest possible P (``max_padded_rows``): every program
   rebuilds the padded segment offsets from the counts (E integers); a route's row is its expert's
   offset + its chunk's prefix + its stable rank inside the chunk (an exclusive cumsum of the chunk's
   one-hot over experts); a padded row's owner is the first expert whose segment ends after it, which
   gives ``tile_expert`` and the padding rows (rows from P to the bound are padding too). Program 0
   writes the ``gate``: P and the validation counts, which every gated kernel reads first, and sets the
   device's sticky error flags (``error_flags``) for a refused batch.
``launch_routing`` queues the kernels and returns (``PendingRouting``) with no host read: the MoE layers run
every stage over its ``bound``, gated on the device (kernels/moe/layer.py). ``finish()`` (``build_routing``, the
validating mode ``sync_checks()``) is one read of ``meta`` (the counts and the validation counts together, on a
side stream that waits for the routing kernels only; no host-to-device copy): it refuses a bad batch with
check_topk's messages (the details are looked up with torch only then) and cuts the outputs at P.

Every step is integer arithmetic with unique store targets (no atomics, no float reduction), so
the metadata is identical on every run and device, and bit-identical to ``build_routing_torch``
(the former pure-torch build, kept as a reference) and to ``build_routing_ref`` (a Python loop).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from detkit.kernels.backend import MAX_INT32_OFFSET, TRITON_INTERPRETER, PlannedKernel, resolve_backend

SEGMENT_ALIGN = 128  # rows per expert-segment tile; every grouped-GEMM BLOCK_M must divide it
SCORE_DTYPES = (torch.float32, torch.bfloat16)
# Tile sizes of the fused build (GPU). The interpreter pays per op, not per lane: it takes all the
# experts in one step and larger blocks. The bits do not depend on them (integer arithmetic).
ROUTE_BLOCK = 256  # routes per program of the histogram and scatter kernels
ROW_BLOCK = 256  # padded rows per program of the scatter kernel
EXPERT_BLOCK = 32  # experts per step of a program's loop over the experts (one-hot [EXPERT_BLOCK, ROUTE_BLOCK])
INTERPRETER_BLOCKS = (1024, 4096)  # (routes, rows) per program under the interpreter
NUM_CHECKS = 3  # hist/meta columns after the experts: out-of-range ids, duplicate ids, non-finite scores


@dataclass(frozen=True)
class MoeRouting:
    """Expert-sorted, 128-padded index space. ``P`` = padded rows, a multiple of SEGMENT_ALIGN."""

    num_tokens: int  # T
    top_k: int  # K
    num_experts: int  # E
    gather_token: torch.Tensor  # [P] int32: token row of x read by padded row p (0 for padding)
    sorted_route: torch.Tensor  # [P] int32: flat route t*K+k of padded row p, -1 for padding
    row_score: torch.Tensor  # [P] float32: the route's score, 0 for padding
    route_row: torch.Tensor  # [T, K] int32: padded row of route (t, k), -1 when masked
    expert_counts: torch.Tensor  # [E] int32: routed rows per expert (unpadded)
    expert_offsets: torch.Tensor  # [E+1] int32: first padded row of each expert segment
    tile_expert: torch.Tensor  # [P // SEGMENT_ALIGN] int32: expert owning each 128-row tile
    gate: torch.Tensor  # [1 + NUM_CHECKS] int32: P, then the validation counts (all 0 once the host has read them)
    counts: tuple[int, ...]  # expert_counts on the host (grid sizes and reports); () before the read

    @property
    def padded_rows(self) -> int:
        return int(self.gather_token.shape[0])

    @property
    def num_tiles(self) -> int:
        return self.padded_rows // SEGMENT_ALIGN

    @property
    def refused(self) -> torch.Tensor:
        """A 0-d bool tensor on the routing's device, True when the routing kernels' checks refused the batch (its
        outputs are NaN). No host read: the caller reads it when it chooses."""
        return self.gate[1:].sum() > 0

    def check(self) -> None:
        """Raises ValueError naming the checks that refused this batch (one device-to-host read of the gate)."""
        raise_refused(self.gate[1:].tolist(), "this batch")


CHECK_NAMES = ("topk id(s) out of range", "row(s) with a duplicate topk id", "non-finite score(s)")


def raise_refused(checks: list[int], what: str) -> None:
    """The one-line refusal of a batch whose validation counts (or error flags) ``checks`` are not all zero."""
    if any(checks):
        found = ", ".join(f"{n} {name}" if what == "this batch" else name
                          for n, name in zip(checks, CHECK_NAMES) if n)
        raise ValueError(f"the MoE routing refused {what}: {found}; its outputs are NaN. Supported: ids -1 (masked) "
                         "or 0..E-1, distinct per row, finite scores (sync_checks() names the first bad entry)")


_ERROR_FLAGS: dict[torch.device, torch.Tensor] = {}  # per device: the sticky error flags


def error_flags(device: torch.device | str) -> torch.Tensor:
    """The device's sticky MoE error flags [NUM_CHECKS] int32 (out-of-range ids, duplicate ids, non-finite scores):
    the routing kernels set a flag for every batch they refuse and never clear it. Allocated on first use (before a
    CUDA graph capture: a warm-up call does it); ``check_moe_errors`` reads and clears them."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _ERROR_FLAGS:
        # A normal tensor even when the first use is under torch.inference_mode() (a rollout): an inference tensor
        # could not be cleared in place by a later check outside it (a training step).
        with torch.inference_mode(False):
            _ERROR_FLAGS[device] = torch.zeros((NUM_CHECKS,), dtype=torch.int32, device=device)
    return _ERROR_FLAGS[device]


def check_moe_errors(device: torch.device | str) -> None:
    """Raises ValueError when a batch routed on ``device`` since the last call was refused (its outputs were NaN);
    clears the flags. One device-to-host read, when the caller chooses (e.g. once per step)."""
    flags = error_flags(device)
    checks = flags.tolist()
    with torch.inference_mode(False):
        flags.zero_()
    raise_refused(checks, "a batch since the last check")


_SYNC_CHECKS = [False]


@contextmanager
def sync_checks(enabled: bool = True):
    """The synchronous validating mode: inside it, the MoE layers read the routing's counts back to the host once per
    forward (as ``PendingRouting.finish``), refuse a bad batch with check_topk's one-line messages before the work
    after the routing, and run over the exact P. Outside it (the default) they never synchronize."""
    previous = _SYNC_CHECKS[0]
    _SYNC_CHECKS[0] = bool(enabled)
    try:
        yield
    finally:
        _SYNC_CHECKS[0] = previous


def sync_checks_enabled() -> bool:
    return _SYNC_CHECKS[0]


def check_topk_args(topk_ids: torch.Tensor, scores: torch.Tensor, num_experts: int) -> None:
    """The checks that need no look at the data: types, dtypes, shapes, device, expert count."""
    if not isinstance(topk_ids, torch.Tensor) or not isinstance(scores, torch.Tensor):
        raise TypeError(f"topk_ids and scores must be torch.Tensors; got {type(topk_ids).__name__}, "
                        f"{type(scores).__name__}")
    if topk_ids.dtype != torch.int32:
        raise TypeError(f"topk_ids has dtype {topk_ids.dtype}; supported: torch.int32")
    if scores.dtype not in SCORE_DTYPES:
        raise TypeError(f"scores has dtype {scores.dtype}; supported: {SCORE_DTYPES}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] < 1 or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be [T, K] with T, K >= 1; got shape {tuple(topk_ids.shape)}")
    if scores.shape != topk_ids.shape:
        raise ValueError(f"scores shape {tuple(scores.shape)} != topk_ids shape {tuple(topk_ids.shape)}")
    if scores.device != topk_ids.device:
        raise ValueError(f"scores on {scores.device}, topk_ids on {topk_ids.device}; they must share a device")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int; got {num_experts!r}")


def check_topk(topk_ids: torch.Tensor, scores: torch.Tensor, num_experts: int) -> None:
    """Refuse malformed routing before any work: dtypes, shapes, id range, duplicate ids per row."""
    check_topk_args(topk_ids, scores, num_experts)
    bad = (topk_ids < -1) | (topk_ids >= num_experts)
    ids = topk_ids.sort(dim=1).values
    dup = (ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)
    # One device-to-host read decides all three checks; the details are looked up only on failure.
    any_bad, any_dup, all_finite = torch.stack([bad.any(), dup.any(), torch.isfinite(scores).all()]).tolist()
    if any_bad:
        t, k = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"topk_ids[{t}, {k}] = {int(topk_ids[t, k])} is out of range; "
                         f"supported: -1 (masked) or 0..{num_experts - 1}")
    if any_dup:
        rows = dup.any(dim=1).nonzero()
        t = int(rows[0, 0])
        raise ValueError(f"topk_ids row {t} routes to expert(s) "
                         f"{sorted(set(int(i) for i in ids[t][1:][dup[t]]))} more than once "
                         f"({topk_ids[t].tolist()}); the ids of one row must be distinct "
                         f"({int(rows.numel())} such row(s))")
    if not all_finite:
        raise ValueError("scores contain NaN or Inf")


# ---------------------------------------------------------------------------------------------
# Fused build: three kernels (module docstring). Masked and invalid routes carry key -1, which
# no expert lane matches, so they are never counted nor given a row.
# ---------------------------------------------------------------------------------------------
@triton.jit
def moe_route_hist_kernel(
    ids_ptr, score_ptr, hist_ptr,
    R, K, E, W,  # routes T*K, top-k, experts, hist row length E + NUM_CHECKS
    stride_it, stride_ik, stride_st, stride_sk,
    BLOCK: tl.constexpr, EXPERT_BLOCK: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    r = pid * BLOCK + tl.arange(0, BLOCK)
    r_ok = r < R
    t = r // K
    k = r % K
    ids = tl.load(ids_ptr + t * stride_it + k * stride_ik, mask=r_ok, other=-1)
    s = tl.load(score_ptr + t * stride_st + k * stride_sk, mask=r_ok, other=0.0).to(tl.float32)
    key = tl.where(r_ok & (ids >= 0) & (ids < E), ids, -1)
    # Validation counts; check_topk looks up the details (with torch) only when one is non-zero.
    bad = r_ok & ((ids < -1) | (ids >= E))
    non_finite = r_ok & ~(tl.abs(s) <= 3.4028234663852886e38)  # NaN fails every comparison
    dup = r < 0  # all False, shaped like r
    for j in range(0, K):  # an earlier route of the same row with the same (non-masked) id
        prev = tl.load(ids_ptr + t * stride_it + j * stride_ik, mask=r_ok & (j < k), other=-1)
        dup = dup | ((j < k) & (prev == ids) & (ids >= 0))
    hist_row = hist_ptr + pid * W
    for e0 in range(0, E, EXPERT_BLOCK):
        e = e0 + tl.arange(0, EXPERT_BLOCK)
        hit = (e[:, None] == key[None, :]).to(tl.int32)  # [EXPERT_BLOCK, BLOCK] one-hot
        tl.store(hist_row + e, tl.sum(hit, axis=1), mask=e < E)
    tl.store(hist_row + E, tl.sum(bad.to(tl.int32), axis=0))
    tl.store(hist_row + E + 1, tl.sum(dup.to(tl.int32), axis=0))
    tl.store(hist_row + E + 2, tl.sum(non_finite.to(tl.int32), axis=0))


@triton.jit
def moe_route_scan_kernel(
    hist_ptr, prefix_ptr, meta_ptr,
    C, W,  # prefix[c, w] = sum_{c' < c} hist[c', w] (ascending c); meta[w] = sum_c hist[c, w]
    BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    w = pid * BLOCK_W + tl.arange(0, BLOCK_W)
    w_ok = w < W
    carry = tl.zeros((BLOCK_W,), dtype=tl.int32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        mask = w_ok[:, None] & (c < C)[None, :]
        offs = c[None, :] * W + w[:, None]  # [BLOCK_W, BLOCK_C]: the scan runs along axis 1
        h = tl.load(hist_ptr + offs, mask=mask, other=0)
        tl.store(prefix_ptr + offs, carry[:, None] + tl.cumsum(h, axis=1) - h, mask=mask)
        carry += tl.sum(h, axis=1)
    tl.store(meta_ptr + w, carry, mask=w_ok)


@triton.jit
def moe_route_scatter_kernel(
    ids_ptr, score_ptr, prefix_ptr, meta_ptr,
    gather_ptr, sorted_route_ptr, row_score_ptr, route_row_ptr, offsets_ptr, tile_expert_ptr, gate_ptr, error_ptr,
    R, K, E, W, C, MAX_ROWS,  # routes, top-k, experts, hist row length, route chunks, rows of the bound buffers
    stride_it, stride_ik, stride_st, stride_sk,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, EXPERT_BLOCK: tl.constexpr, SEGMENT: tl.constexpr,
    NUM_CHECKS: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    # This program owns routes pid*BLOCK + [0, BLOCK) and padded rows pid*ROWS + [0, ROWS); the grid
    # covers the largest possible P, the real P (the padded counts' sum) is found below.
    r = pid * BLOCK + tl.arange(0, BLOCK)
    r_ok = r < R
    p = pid * ROWS + tl.arange(0, ROWS)
    t = r // K
    k = r % K
    ids = tl.load(ids_ptr + t * stride_it + k * stride_ik, mask=r_ok, other=-1)
    valid = r_ok & (ids >= 0) & (ids < E)
    key = tl.where(valid, ids, -1)
    row = tl.zeros((BLOCK,), dtype=tl.int32)  # padded row of route r
    p_expert = tl.zeros((ROWS,), dtype=tl.int32)  # experts whose segment ends at or before row p
    p_start = tl.zeros((ROWS,), dtype=tl.int32)  # first row of row p's expert segment
    end = pid * 0  # padded rows of the experts seen so far
    for e0 in range(0, E, EXPERT_BLOCK):
        e = e0 + tl.arange(0, EXPERT_BLOCK)
        e_ok = e < E
        count = tl.load(meta_ptr + e, mask=e_ok, other=0)
        padded = (count + SEGMENT - 1) // SEGMENT * SEGMENT
        seg_end = end + tl.cumsum(padded, axis=0)
        offset = seg_end - padded  # expert_offsets[e]
        end += tl.sum(padded, axis=0)
        tl.store(offsets_ptr + e, offset, mask=e_ok & (pid == 0))
        # Route rows: expert offset + the chunk's first rank + the stable rank inside the chunk.
        first = tl.load(prefix_ptr + pid * W + e, mask=e_ok & (pid < C), other=0)
        hit = (e[:, None] == key[None, :]).to(tl.int32)  # [EXPERT_BLOCK, BLOCK] one-hot
        rank = tl.cumsum(hit, axis=1) - hit  # earlier routes of the chunk on the same expert
        row += tl.sum(hit * ((offset + first)[:, None] + rank), axis=0)
        # Row owners: row p belongs to the first expert whose segment ends after p.
        done = e_ok[:, None] & (seg_end[:, None] <= p[None, :])
        p_expert += tl.sum(done.to(tl.int32), axis=0)
        p_start = tl.maximum(p_start, tl.max(tl.where(done, seg_end[:, None], 0), axis=0))
    tl.store(offsets_ptr + E, end, mask=pid == 0)
    # The gate the grouped GEMMs read: P, then the validation counts (a GEMM queued before the host has
    # read them does nothing past P or when a count is non-zero).
    g = tl.arange(0, 1 + NUM_CHECKS)
    checks = tl.load(meta_ptr + E - 1 + g, mask=g > 0, other=0)
    tl.store(gate_ptr + g, tl.where(g == 0, end, checks), mask=pid == 0)
    # The sticky error flags (one per check): set, never cleared here, by a refused batch.
    tl.store(error_ptr + g - 1, tl.full((1 + NUM_CHECKS,), 1, tl.int32), mask=(pid == 0) & (g > 0) & (checks > 0))
    p_ok = p < end

    tl.store(sorted_route_ptr + row, r, mask=valid)
    tl.store(gather_ptr + row, t, mask=valid)
    s = tl.load(score_ptr + t * stride_st + k * stride_sk, mask=valid, other=0.0)
    tl.store(row_score_ptr + row, s.to(tl.float32), mask=valid)
    tl.store(route_row_ptr + r, tl.where(valid, row, -1), mask=r_ok)

    # Padding rows (past their expert's count) and the owner of each 128-row tile.
    p_count = tl.load(meta_ptr + p_expert, mask=p_ok, other=0)
    pad = p_ok & (p - p_start >= p_count)
    tl.store(sorted_route_ptr + p, tl.full((ROWS,), -1, tl.int32), mask=pad)
    tl.store(gather_ptr + p, tl.zeros((ROWS,), dtype=tl.int32), mask=pad)
    tl.store(row_score_ptr + p, tl.zeros((ROWS,), dtype=tl.float32), mask=pad)
    tl.store(tile_expert_ptr + p // SEGMENT, p_expert, mask=p_ok & (p % SEGMENT == 0))
    # Rows from P to the bound: padding too (no route, token 0, score 0, tile of expert 0), so that every row of the
    # bound buffers is defined; the gated kernels never read them, the others read padding.
    past = (p >= end) & (p < MAX_ROWS)
    tl.store(sorted_route_ptr + p, tl.full((ROWS,), -1, tl.int32), mask=past)
    tl.store(gather_ptr + p, tl.zeros((ROWS,), dtype=tl.int32), mask=past)
    tl.store(row_score_ptr + p, tl.zeros((ROWS,), dtype=tl.float32), mask=past)
    tl.store(tile_expert_ptr + p // SEGMENT, tl.zeros((ROWS,), dtype=tl.int32), mask=past & (p % SEGMENT == 0))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def build_routing(topk_ids: torch.Tensor, scores: torch.Tensor, num_experts: int) -> MoeRouting:
    """The routing metadata of ``topk_ids [T, K]`` / ``scores [T, K]`` over ``num_experts`` experts:
    three launches and one device-to-host read (module docstring)."""
    return launch_routing(topk_ids, scores, num_experts).finish()


def _build_routing_fused(topk_ids: torch.Tensor, scores: torch.Tensor, num_experts: int,
                         block: int | None = None, rows: int | None = None,
                         expert_block: int | None = None) -> MoeRouting:
    """``build_routing`` with its tile sizes exposed (tests force several chunks and expert steps)."""
    return launch_routing(topk_ids, scores, num_experts, block, rows, expert_block).finish()


def max_padded_rows(routes: int, num_experts: int) -> int:
    """The largest P any routing of ``routes`` routes over ``num_experts`` experts can have: every
    non-empty expert pads at most SEGMENT_ALIGN - 1 rows, and P is a multiple of SEGMENT_ALIGN."""
    return (routes + (SEGMENT_ALIGN - 1) * min(num_experts, routes)) // SEGMENT_ALIGN * SEGMENT_ALIGN


_READ_STREAMS: dict[int, torch.cuda.Stream] = {}  # per device: the stream the counts are copied on


def _read_after(t: torch.Tensor, ready: torch.cuda.Event | None) -> list[int]:
    """``t.tolist()`` once ``ready`` has fired. On CUDA the copy runs on a side stream that waits for
    ``ready`` only, so it does not wait for the work queued on the current stream after ``ready``
    (the up-projection GEMM): the host learns the counts while that GEMM runs."""
    if ready is None:
        return t.tolist()
    if t.device.index not in _READ_STREAMS:
        _READ_STREAMS[t.device.index] = torch.cuda.Stream(t.device)
    stream = _READ_STREAMS[t.device.index]
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        host.copy_(t, non_blocking=True)
    t.record_stream(stream)  # the allocator must not hand t's memory out before the copy has read it
    stream.synchronize()
    return host.tolist()


@dataclass(frozen=True)
class PendingRouting:
    """The routing kernels queued, the counts not yet read.

    ``bound`` is a MoeRouting over buffers sized for the largest possible P (``max_padded_rows``; rows
    past the real P unset, ``counts`` empty). A grouped GEMM may be queued over it before the read: its
    ``gate`` (P and the validation counts, written by the scatter kernel) makes every CTA past the real P,
    and every CTA of a batch the checks refuse, do nothing. ``finish()`` is the one device-to-host read:
    it refuses a bad batch with check_topk's messages and returns the exact routing (views of the same
    buffers, cut at P)."""

    bound: MoeRouting
    meta: torch.Tensor  # [E + NUM_CHECKS] int32: expert counts, then the validation counts
    ready: torch.cuda.Event | None  # recorded after the routing kernels (None on the interpreter)
    topk_ids: torch.Tensor
    scores: torch.Tensor

    def finish(self) -> MoeRouting:
        b = self.bound
        host = _read_after(self.meta, self.ready)  # the build's one device-to-host read
        counts_list, checks = host[:b.num_experts], host[b.num_experts:]
        if any(checks):
            check_topk(self.topk_ids, self.scores, b.num_experts)  # raises with the details
            raise RuntimeError(f"routing kernels flagged {checks} (bad ids, duplicates, non-finite) "
                               "but check_topk found nothing")
        total = sum(-(-c // SEGMENT_ALIGN) for c in counts_list) * SEGMENT_ALIGN
        return replace(b, gather_token=b.gather_token[:total], sorted_route=b.sorted_route[:total],
                       row_score=b.row_score[:total], tile_expert=b.tile_expert[:total // SEGMENT_ALIGN],
                       counts=tuple(counts_list))


_moe_route_hist_kernel_planned = PlannedKernel(moe_route_hist_kernel)
_moe_route_scan_kernel_planned = PlannedKernel(moe_route_scan_kernel)
_moe_route_scatter_kernel_planned = PlannedKernel(moe_route_scatter_kernel)


def launch_routing(topk_ids: torch.Tensor, scores: torch.Tensor, num_experts: int,
                   block: int | None = None, rows: int | None = None,
                   expert_block: int | None = None) -> PendingRouting:
    """Queue the three routing kernels over buffers sized for the largest possible P; no host read
    (``PendingRouting``). Refuses, before any work, what needs no look at the data."""
    check_topk_args(topk_ids, scores, num_experts)
    backend = resolve_backend(moe_route_scatter_kernel, {"topk_ids": topk_ids, "scores": scores})
    interpreted = backend == TRITON_INTERPRETER
    block = block or (INTERPRETER_BLOCKS[0] if interpreted else ROUTE_BLOCK)
    rows = rows or (INTERPRETER_BLOCKS[1] if interpreted else ROW_BLOCK)
    expert_block = expert_block or (_pow2(num_experts) if interpreted else EXPERT_BLOCK)
    expert_block = max(16, min(expert_block, _pow2(num_experts)))
    t_count, k_count = topk_ids.shape
    routes, experts = t_count * k_count, num_experts
    max_rows = max_padded_rows(routes, experts)
    chunks = triton.cdiv(routes, block)
    width = experts + NUM_CHECKS
    # 32-bit index math throughout: refuse what would overflow it, before any work.
    if any(s < 0 for s in topk_ids.stride() + scores.stride()):
        raise ValueError(f"topk_ids/scores have negative strides {topk_ids.stride()}, {scores.stride()}; "
                         "supported: non-negative strides")
    furthest = max((t_count - 1) * x.stride(0) + (k_count - 1) * x.stride(1) for x in (topk_ids, scores))
    if max(max_rows + rows, routes + block, chunks * width, furthest) > MAX_INT32_OFFSET:
        raise ValueError(f"routing of T*K = {routes} routes over E = {experts} experts exceeds 32-bit "
                         "index arithmetic; split the batch")

    device = topk_ids.device
    i32 = dict(dtype=torch.int32, device=device)
    strides = (topk_ids.stride(0), topk_ids.stride(1), scores.stride(0), scores.stride(1))
    hist = torch.empty((chunks, width), **i32)
    prefix = torch.empty((chunks, width), **i32)
    meta = torch.empty((width,), **i32)
    _moe_route_hist_kernel_planned[(chunks,)](
        topk_ids, scores, hist, routes, k_count, experts, width, *strides,
        BLOCK=block, EXPERT_BLOCK=expert_block, num_warps=4,
    )
    scan_w = 32
    _moe_route_scan_kernel_planned[(triton.cdiv(width, scan_w),)](
        hist, prefix, meta, chunks, width, BLOCK_W=scan_w, BLOCK_C=64, num_warps=4,
    )
    gather_token = torch.empty((max_rows,), **i32)
    sorted_route = torch.empty((max_rows,), **i32)
    row_score = torch.empty((max_rows,), dtype=torch.float32, device=device)
    route_row = torch.empty((t_count, k_count), **i32)
    offsets = torch.empty((experts + 1,), **i32)
    tile_expert = torch.empty((max_rows // SEGMENT_ALIGN,), **i32)
    gate = torch.empty((1 + NUM_CHECKS,), **i32)
    _moe_route_scatter_kernel_planned[(max(chunks, triton.cdiv(max_rows, rows)),)](
        topk_ids, scores, prefix, meta,
        gather_token, sorted_route, row_score, route_row, offsets, tile_expert, gate, error_flags(device),
        routes, k_count, experts, width, chunks, max_rows, *strides,
        BLOCK=block, ROWS=rows, EXPERT_BLOCK=expert_block, SEGMENT=SEGMENT_ALIGN, NUM_CHECKS=NUM_CHECKS,
        num_warps=8,
    )
    ready = None
    if not interpreted and not torch.cuda.is_current_stream_capturing():  # finish() cannot run inside a capture
        ready = torch.cuda.Event()
        ready.record()
    bound = MoeRouting(
        num_tokens=t_count, top_k=k_count, num_experts=num_experts,
        gather_token=gather_token, sorted_route=sorted_route, row_score=row_score,
        route_row=route_row, expert_counts=meta[:experts], expert_offsets=offsets,
        tile_expert=tile_expert, gate=gate, counts=(),
    )
    return PendingRouting(bound, meta, ready, topk_ids, scores)


def build_routing_torch(topk_ids: torch.Tensor, scores: torch.Tensor, num_experts: int) -> MoeRouting:
    """The former pure-torch build (~35 ops, several syncs): the same metadata, kept as a reference."""
    check_topk(topk_ids, scores, num_experts)
    device = topk_ids.device
    t_count, k_count = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    valid = flat_ids >= 0
    # Masked routes sort after every expert (key E) and are then dropped.
    keys = torch.where(valid, flat_ids, torch.full_like(flat_ids, num_experts))
    order = torch.sort(keys, stable=True).indices  # ascending expert, then ascending route t*K+k
    # Integer counts (exact); the masked routes are the last bin. The one device-to-host read of
    # the build: every size below (valid routes, padded rows, tiles per expert) follows from it.
    counts_host = torch.bincount(keys, minlength=num_experts + 1).tolist()
    counts_list = counts_host[:num_experts]
    n_valid = sum(counts_list)
    routes = order[:n_valid]
    experts = keys[routes]

    counts = torch.tensor(counts_list, dtype=torch.int64, device=device)
    tiles_list = [-(-c // SEGMENT_ALIGN) for c in counts_list]
    padded = counts.new_tensor(tiles_list) * SEGMENT_ALIGN
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(padded, 0)
    starts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    starts[1:] = torch.cumsum(counts, 0)
    total = sum(tiles_list) * SEGMENT_ALIGN

    # Row of each sorted route: its expert's padded start plus its rank inside the expert.
    rank = torch.arange(n_valid, device=device) - starts[experts]
    rows = offsets[experts] + rank
    sorted_route = torch.full((total,), -1, dtype=torch.int64, device=device)
    sorted_route[rows] = routes  # unique indices: deterministic
    is_row = sorted_route >= 0
    safe_route = torch.where(is_row, sorted_route, torch.zeros_like(sorted_route))
    gather_token = torch.where(is_row, safe_route // k_count, torch.zeros_like(safe_route))
    row_score = torch.where(is_row, scores.reshape(-1).to(torch.float32)[safe_route],
                            torch.zeros(total, dtype=torch.float32, device=device))
    route_row = torch.full((t_count * k_count,), -1, dtype=torch.int64, device=device)
    route_row[routes] = rows
    tile_expert = torch.repeat_interleave(torch.arange(num_experts, device=device), padded // SEGMENT_ALIGN,
                                          output_size=total // SEGMENT_ALIGN)

    return MoeRouting(
        num_tokens=t_count, top_k=k_count, num_experts=num_experts,
        gather_token=gather_token.to(torch.int32), sorted_route=sorted_route.to(torch.int32),
        row_score=row_score, route_row=route_row.reshape(t_count, k_count).to(torch.int32),
        expert_counts=counts.to(torch.int32), expert_offsets=offsets.to(torch.int32),
        tile_expert=tile_expert.to(torch.int32),
        gate=torch.tensor([total] + [0] * NUM_CHECKS, dtype=torch.int32, device=device), counts=tuple(counts_list),
    )


def build_routing_ref(topk_ids: torch.Tensor, scores: torch.Tensor, num_experts: int) -> dict:
    """A loop-based reference of the same metadata (tests): plain Python over experts and routes."""
    t_count, k_count = topk_ids.shape
    ids = topk_ids.tolist()
    sc = scores.float().tolist()
    gather, route, score, tile_expert, counts, offsets = [], [], [], [], [], [0]
    route_row = [[-1] * k_count for _ in range(t_count)]
    for e in range(num_experts):
        mine = [(t, k) for t in range(t_count) for k in range(k_count) if ids[t][k] == e]
        counts.append(len(mine))
        for t, k in mine:
            route_row[t][k] = len(gather)
            gather.append(t)
            route.append(t * k_count + k)
            score.append(sc[t][k])
        pad = -len(mine) % SEGMENT_ALIGN
        gather += [0] * pad
        route += [-1] * pad
        score += [0.0] * pad
        tile_expert += [e] * ((len(mine) + pad) // SEGMENT_ALIGN)
        offsets.append(len(gather))
    return {"gather_token": gather, "sorted_route": route, "row_score": score, "route_row": route_row,
            "expert_counts": counts, "expert_offsets": offsets, "tile_expert": tile_expert}
