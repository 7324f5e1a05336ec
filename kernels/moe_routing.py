"""Routing metadata for the deterministic MoE expert MLP (kernels/moe.py).

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

Everything is pure torch integer arithmetic with deterministic ops (stable sort, cumsum, scatter
to unique indices), so the metadata is identical on every run and device. The padded row count
``P`` is data-dependent; building it costs one device-to-host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SEGMENT_ALIGN = 128  # rows per expert-segment tile; every grouped-GEMM BLOCK_M must divide it
SCORE_DTYPES = (torch.float32, torch.bfloat16)


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
    counts: tuple[int, ...]  # expert_counts on the host (grid sizes and reports)

    @property
    def padded_rows(self) -> int:
        return int(self.gather_token.shape[0])

    @property
    def num_tiles(self) -> int:
        return self.padded_rows // SEGMENT_ALIGN


def check_topk(topk_ids: torch.Tensor, scores: torch.Tensor, num_experts: int) -> None:
    """Refuse malformed routing before any work: dtypes, shapes, id range, duplicate ids per row."""
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


def build_routing(topk_ids: torch.Tensor, scores: torch.Tensor, num_experts: int) -> MoeRouting:
    """The routing metadata of ``topk_ids [T, K]`` / ``scores [T, K]`` over ``num_experts`` experts."""
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
        tile_expert=tile_expert.to(torch.int32), counts=tuple(counts_list),
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
