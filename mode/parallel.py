"""detkit mode across processes: the Linear layers of a tensor- or data-parallel model, and under data parallelism
every other weight gradient of a Qwen3 / Qwen3-MoE model, on reductions whose bits do not depend on the split
(docs/mode_parallel.md).

Why a plan is needed on both sides. At TP=1 a row-parallel layer (o_proj, down_proj) reduces over its whole input
dim K in one FP32 accumulation; at TP=2 each rank holds K/2 and the partials are summed by a collective. Those
are different roundings, so no single-process model equals a TP=2 model by accident. ``fp32_invariant``
(kernels/parallel/invariant.py, docs/invariance.md) makes them equal: the TP ranks keep their partials in FP32,
all-reduce them in FP32 (two operands: one rounding, order-free) and round to BF16 once; the one-process side runs
the same GEMM with det_gemm's ``seg_len`` = K / tp, so each segment is accumulated from zero exactly as a rank
accumulates its shard (same pinned config, same order) and the segments are added in ascending order: the same
single rounding. The one-process trainer must therefore know which layers a TP plan shards and into how many
pieces: ``prepare(model, plan, tp_size=...)`` tells it, from the very plan the ranks were sharded with.

Which reductions a plan has (``ParallelPlan.reductions``):
- ``rowwise`` Linear (``RowwiseParallel``): the forward output, a sum over K -> FP32 partials, FP32 all-reduce, one
  BF16 rounding (one-process side: ``seg_len`` K / tp in the forward GEMM). Its dX (a slice of K) and dW need none.
- ``colwise`` Linear (``ColwiseParallel``): the forward needs none (each rank owns output columns; with
  ``output_layouts=Replicate()``, e.g. a vocab-parallel lm_head, the all-gather that follows only moves bits); the
  input gradient dX = dY_local @ W_local is a sum over the N shards -> the same FP32 all-reduce in the backward
  (one-process side: ``seg_len`` N / tp in the dX GEMM).
- data parallelism (``dp_group`` / ``dp_size``): every prepared Linear's weight gradient is a sum over the batch rows.
  Each DP rank keeps its dW as an FP32 partial (not rounded) and ``reduce_gradients`` sums the partials in rank order
  (two ranks: one FP32 all-reduce; more: an all-gather and ascending adds from zero), then rounds once; the
  one-process side (``dp_size`` = the number of DP shards) runs the dW GEMM with ``seg_len`` = the rows of one shard,
  each shard's rows zero-padded to a BLOCK_K multiple so a segment boundary falls on a loop step (zero rows add
  exact zeros, as the masked rows of a shard's own GEMM do).
- RMSNorm weights (transformers' Qwen3 classes, ``NormRoute``): the weight gradient is a sum over rows; q_norm /
  k_norm beside a colwise q_proj / k_proj sum over (token, head) rows whose heads TP splits, so each rank's FP32 row
  sum over its heads is all-reduced in FP32 (one process: rows cut per head shard); under DP every such norm keeps
  an FP32 partial per rank like the Linears. The sums run on det_gemm_db of ones (a fixed-order row sum).
- the rest of a model's DP gradients, each an FP32 partial per rank summed by ``reduce_gradients`` in rank order,
  and on the one-process side the same per-shard sums added in shard order: an nn.Embedding (``EmbeddingRoute``:
  each id's gradient rows summed in ascending position from zero, ``kernels.reductions.index_sum``; padding_idx's
  rows skipped), a Qwen3-MoE router (a ``LinearRoute`` with no TP style: its linear on the pinned GEMMs, the rest as
  the mode's router) and a Qwen3-MoE block's experts (``ExpertsRoute``: detkit's BF16 MoE layer with FP32
  ``main_grads`` from zero; the one-process side runs the layer once per DP shard of the tokens into one pair of
  buffers). ``ParallelPlan.covered`` names every parameter whose gradient the routes form.
Every GEMM of a prepared layer runs with one pinned config per op (``kernels.parallel.invariant.invariant_config``),
the same at every world size and every M, so the parts no reduction touches (column slices, row slices) have the
same bits on both sides too.

What the mode refuses, by name, with a one-line error in ``prepare`` (before any collective): plan styles other
than colwise / rowwise Linear (SequenceParallel, PrepareModuleInput/Output, transformers' ``colwise_rep``,
``local_*``, ``replicated_with_grad_allreduce``, ...), a rowwise style whose input is not Shard(-1) or whose output
is not Replicate (sequence parallelism's reduce-scatter), a colwise style whose input is not Replicate, a style on
a module that is not an nn.Linear (a vocab-parallel Embedding's partial sum turns a -0.0 weight into +0.0), a
pattern that matches nothing, shard widths the pinned configs cannot segment, meshes of more than one axis, DTensor
weights the plan does not name, placements that contradict the plan, a process-group backend that does not belong
with the kernel backend (gloo only with CPU tensors under the interpreter, NCCL with CUDA tensors), and a prepared
weight shared with another module (its gradient would miss the other use); under DP an nn.Embedding with
``max_norm`` (an in-place renorm of the rows each rank looks up), ``scale_grad_by_freq`` (counts a rank sees only
part of) or ``sparse`` gradients, and a router or experts weight that is a DTensor. At run time (before the layer's
collective): inputs of another dtype or placement; on the one-process DP side a row or token count not divisible by
``dp_size``; MoE experts under the mode's ``moe_experts="fp8"`` where the FP8 layer would run (where the shape's FP8
choice gives the BF16 layer, that layer runs, counted as the mode counts it) or in a call detkit's BF16 MoE layer
does not run.

A prepared layer routes only while the mode is entered; outside it the layer runs nn.Linear's own forward (the
DTensor path on the ranks, plain torch in one process). At world size 1 no reduction is split: a plan's Linear with
DTensor weights (a mesh of one rank) runs the mode's aten route on its local tensors (``LocalRoute``: the plain
model's ops, none through DTensor's per-op dispatch); plain weights are left as they are. Under the mode torch's
TP hooks of a prepared layer stand aside (``_StyleHookGate``: for these layouts they only wrap and unwrap the local
tensors), at every TP size except a gathering colwise layer's output hook. Count: ``linear (tp
rowwise)`` / ``linear (tp colwise)`` / ``linear (dp)`` / ``linear (pinned)``, ``linear (tp, one rank)``, ``rmsnorm
weight grad``, ``embedding (dp)`` and ``moe experts (dp)`` -> the route, in ``mode_counters()`` (a MoE router and
experts also under the mode's own MoE counters). Eager only: a torch.compile'd model runs these routes as graph
breaks at best (not tested).
"""

from __future__ import annotations

import fnmatch
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from detkit.kernels.backend import resolve_backend
from detkit.kernels.det_gemm.launch import (
    GemmConfig, det_gemm_da_launch, det_gemm_db_launch, det_gemm_fwd_launch, det_gemm_kernel,
)
from detkit.kernels.parallel.invariant import INVARIANT_CONFIG_TABLE, invariant_config
from detkit.kernels.parallel.operators import check_collective_backend
from detkit.mode import state as mode_state

ROWWISE, COLWISE = "rowwise", "colwise"
STYLES = (ROWWISE, COLWISE)
ROUTE_ATTR = "_detkit_parallel_route"
FP32 = torch.float32
BF16 = torch.bfloat16


class ParallelPlanError(ValueError):
    """A plan, model or call the mode cannot make parallelism-invariant (raised before any collective)."""


# ---------------------------------------------------------------------------------------------
# Plan styles: parallelize_module's ParallelStyle objects and transformers' strings
# ---------------------------------------------------------------------------------------------
def _placement_name(p) -> str:
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(p, Replicate):
        return "Replicate"
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    return type(p).__name__


def _layouts(value) -> tuple[str, ...]:
    values = value if isinstance(value, (tuple, list)) else (value,)
    return tuple(_placement_name(p) for p in values)


def style_of(pattern: str, style) -> tuple[str, bool]:
    """``(style, gathers_output)`` for one plan entry, or ``ParallelPlanError`` naming what the mode refuses."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(style, str):
        if style in STYLES:
            return style, False
        raise ParallelPlanError(
            f"plan entry {pattern!r}: style {style!r} is not supported by detkit mode; supported: 'colwise', "
            "'rowwise' (or ColwiseParallel / RowwiseParallel with their default layouts)")
    if type(style) is RowwiseParallel:
        got_in, got_out = _layouts(style.input_layouts), _layouts(style.output_layouts)
        if got_in not in (("Shard(-1)",),) or got_out != ("Replicate",):
            raise ParallelPlanError(
                f"plan entry {pattern!r}: RowwiseParallel(input_layouts={got_in}, output_layouts={got_out}) is not "
                "supported; supported: input Shard(-1), output Replicate (the FP32 all-reduce; sequence "
                "parallelism's reduce-scatter has no invariant route)")
        return ROWWISE, False
    if type(style) is ColwiseParallel:
        got_in, got_out = _layouts(style.input_layouts), _layouts(style.output_layouts)
        if got_in != ("Replicate",) or got_out not in (("Shard(-1)",), ("Replicate",)):
            raise ParallelPlanError(
                f"plan entry {pattern!r}: ColwiseParallel(input_layouts={got_in}, output_layouts={got_out}) is not "
                "supported; supported: input Replicate, output Shard(-1) or Replicate (an all-gather)")
        return COLWISE, got_out == ("Replicate",)
    raise ParallelPlanError(
        f"plan entry {pattern!r}: {type(style).__name__} is not supported by detkit mode; supported: "
        "ColwiseParallel, RowwiseParallel, 'colwise', 'rowwise'")


def _matches(plan: dict, name: str) -> list[str]:
    # parallelize_module matches each dot-separated atom with fnmatch; a whole-name fnmatch is the same for the
    # plans it accepts ("layers.*.mlp.down_proj") since '*' there never needs to span a dot.
    return [p for p in plan if len(p.split(".")) == len(name.split(".")) and all(
        fnmatch.fnmatch(n, a) for n, a in zip(name.split("."), p.split(".")))]


# ---------------------------------------------------------------------------------------------
# The route of one prepared Linear
# ---------------------------------------------------------------------------------------------
def _pinned(op: str, width: int) -> GemmConfig:
    """The pinned config of ``op``: the invariant table's first config whose BLOCK_K divides ``width`` (the segment
    width of a segmented reduction); unsegmented reductions take the table's first config."""
    return invariant_config(op, width) if width else INVARIANT_CONFIG_TABLE[op][0]


@dataclass
class LinearRoute:
    """How one prepared nn.Linear computes: its TP style and size, the TP group on the ranks (None on the one-process
    side), the DP size and group, the pinned configs; ``pending`` holds the FP32 weight-gradient partial of a DP
    rank until ``reduce_gradients``."""

    name: str
    style: str | None  # rowwise | colwise | None (not TP-sharded)
    tp_size: int
    tp_group: object | None
    dp_size: int
    dp_group: object | None
    gathers_output: bool
    configs: dict[str, GemmConfig]
    pending: torch.Tensor | None = field(default=None, repr=False)

    @property
    def counter(self) -> tuple[str, str]:
        op = f"linear (tp {self.style})" if self.style and self.tp_size > 1 else (
            "linear (dp)" if self.dp_size > 1 else "linear (pinned)")
        where = "ranks" if (self.tp_group or self.dp_group) is not None else "one process, segmented"
        return op, f"det_gemm pinned, FP32 partials ({where})"

    def partials(self) -> list[tuple[str, torch.Tensor]]:
        """(parameter attribute, this rank's FP32 partial) pairs for ``reduce_gradients``."""
        return [("weight", self.pending)]

    def reductions(self) -> list[str]:
        out = []
        if self.style == ROWWISE and self.tp_size > 1:
            out.append("forward: FP32 all-reduce over TP" if self.tp_group is not None else
                       f"forward: seg_len K/{self.tp_size}")
        if self.style == COLWISE and self.tp_size > 1:
            out.append("backward dX: FP32 all-reduce over TP" if self.tp_group is not None else
                       f"backward dX: seg_len N/{self.tp_size}")
            if self.gathers_output:
                out.append("forward: all-gather of the output (exact)")
        if self.dp_size > 1:
            out.append("backward dW: FP32 partials, rank-order sum over DP" if self.dp_group is not None else
                       f"backward dW: seg_len rows/{self.dp_size}")
        return out

    # The three GEMMs on local 2-D tensors: x [M, K_l], w [N_l, K_l], dy [M, N_l].
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        cfg = self.configs["fwd"]
        if self.style == ROWWISE and self.tp_size > 1:
            if self.tp_group is not None:
                partial = det_gemm_fwd_launch(x, w.t(), config=cfg, out_dtype=FP32)[0]
                return _ordered_sum(partial, self.tp_group).to(BF16)
            return det_gemm_fwd_launch(x, w.t(), config=cfg, seg_len=x.shape[1] // self.tp_size)[0]
        return det_gemm_fwd_launch(x, w.t(), config=cfg)[0]

    def grad_input(self, dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        cfg = self.configs["da"]
        if self.style == COLWISE and self.tp_size > 1:
            if self.tp_group is not None:
                partial = det_gemm_da_launch(dy, w.t(), config=cfg, out_dtype=FP32)[0]
                return _ordered_sum(partial, self.tp_group).to(BF16)
            return det_gemm_da_launch(dy, w.t(), config=cfg, seg_len=dy.shape[1] // self.tp_size)[0]
        return det_gemm_da_launch(dy, w.t(), config=cfg)[0]

    def grad_weight(self, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor | None:
        """dW [N_l, K_l] = dy.T @ x (a sum over the rows). A DP rank keeps it as an FP32 partial for
        ``reduce_gradients`` and hands autograd nothing."""
        cfg = self.configs["db"]
        if self.dp_size > 1 and self.dp_group is not None:
            if self.pending is not None:
                raise ParallelPlanError(
                    f"{self.name}: a second backward before reduce_gradients(); the invariant DP reduction sums one "
                    "FP32 partial per rank (accumulating micro-batches would change the order DP=1 uses)")
            self.pending = det_gemm_db_launch(dy, x, config=cfg, out_dtype=FP32)[0]
            return None
        if self.dp_size > 1:
            rows = x.shape[0]
            if rows % self.dp_size:
                raise ParallelPlanError(
                    f"{self.name}: {rows} rows do not split into dp_size={self.dp_size} equal shards; the one-process "
                    "side segments dW at the DP ranks' row boundaries (equal shards, rank order)")
            block = cfg.block_k
            per = rows // self.dp_size
            pad = -(-per // block) * block
            return det_gemm_db_launch(_shard_padded(dy, self.dp_size, pad), _shard_padded(x, self.dp_size, pad),
                                      config=cfg, seg_len=pad)[0]
        return det_gemm_db_launch(dy, x, config=cfg)[0]


def _shard_padded(t: torch.Tensor, shards: int, pad: int) -> torch.Tensor:
    """Rows of ``t`` [M, C] cut into ``shards`` equal shards, each zero-padded to ``pad`` rows (a view when no pad)."""
    per = t.shape[0] // shards
    if per == pad:
        return t
    out = t.new_zeros((shards * pad, t.shape[1]))
    for s in range(shards):
        out[s * pad:s * pad + per] = t[s * per:(s + 1) * per]
    return out


def _ordered_sum(partial: torch.Tensor, group) -> torch.Tensor:
    """The FP32 sum of every rank's ``partial`` in rank order from zero: what the one-process segmented kernel forms.
    Two ranks: one all-reduce (fl32(p0 + p1) whatever the algorithm; a det_gemm FP32 accumulation is never -0.0, so
    0 + p0 = p0 exactly). More ranks: an all-gather and ascending adds (an all-reduce of more than two operands
    may add in any order)."""
    size = dist.get_world_size(group)
    if size == 2:
        out = partial.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out
    parts = [torch.empty_like(partial) for _ in range(size)]
    dist.all_gather(parts, partial.contiguous(), group=group)
    out = torch.zeros_like(partial)
    for p in parts:
        out += p
    return out


class _InvariantLinear(torch.autograd.Function):
    """y = x @ w.T on the route's GEMMs; backward on the route's dX and dW (dW may go to the DP partial instead)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, route: LinearRoute) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.route = route
        return route.forward(x, w)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        route = ctx.route
        dx = route.grad_input(dy, w) if ctx.needs_input_grad[0] else None
        dw = route.grad_weight(x, dy) if ctx.needs_input_grad[1] else None
        return dx, dw, None


# ---------------------------------------------------------------------------------------------
# RMSNorm weights: the one reduction a norm has is its weight gradient, a sum over rows
# ---------------------------------------------------------------------------------------------
# transformers' Qwen3 RMSNorm classes (their forward is re-stated in ``_norm_forward``, op for op).
NORM_CLASSES = ("Qwen3RMSNorm", "Qwen3MoeRMSNorm")


@dataclass
class NormRoute:
    """The weight gradient of one RMSNorm, sum over rows of ``grad * normed``, in a fixed order. ``head_shards`` > 1
    for q_norm / k_norm next to colwise q_proj / k_proj: their rows are (token, head) and TP splits the heads, so the
    sum is cut per head shard (on the ranks: the rank's heads, then the TP sum; in one process: each shard's rows
    gathered in the rank's order). DP cuts it per DP shard of the tokens. Each block is one det_gemm_db
    (``ones[R, 1].T @ rows[R, D]``: exact products, one FP32 accumulation in row order, pinned config); blocks
    are added in FP32 in rank order from zero (TP inside, DP outside), as the ranks' collectives add them."""

    name: str
    head_shards: int
    tp_group: object | None
    dp_size: int
    dp_group: object | None
    config: GemmConfig
    pending: torch.Tensor | None = field(default=None, repr=False)

    @property
    def counter(self) -> tuple[str, str]:
        where = "ranks" if (self.tp_group or self.dp_group) is not None else "one process, segmented"
        return "rmsnorm weight grad", f"det_gemm_db fixed order, FP32 partials ({where})"

    def partials(self) -> list[tuple[str, torch.Tensor]]:
        return [("weight", self.pending)]

    def reductions(self) -> list[str]:
        out = []
        if self.head_shards > 1:
            out.append("backward dW: FP32 all-reduce over TP (heads)" if self.tp_group is not None else
                       f"backward dW: rows cut into {self.head_shards} head shards")
        if self.dp_size > 1:
            out.append("backward dW: FP32 partials, rank-order sum over DP" if self.dp_group is not None else
                       f"backward dW: seg rows/{self.dp_size}")
        return out

    def _block(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.reshape(-1, rows.shape[-1])
        ones = rows.new_ones((rows.shape[0], 1))
        return det_gemm_db_launch(ones, rows, config=self.config, out_dtype=FP32)[0][0]

    def grad_weight(self, prod: torch.Tensor) -> torch.Tensor | None:
        """``prod`` = grad * normed in BF16 (what torch's mul backward forms before its sum), [B, S, (H,) D]."""
        tokens = prod.reshape(-1, *prod.shape[2:]) if prod.dim() > 2 else prod
        if self.tp_group is not None or self.dp_group is not None:
            total = self._block(tokens)
            if self.tp_group is not None:
                total = _ordered_sum(total, self.tp_group)
            if self.dp_group is not None:
                if self.pending is not None:
                    raise ParallelPlanError(f"{self.name}: a second backward before reduce_gradients()")
                self.pending = total
                return None
            return total.to(prod.dtype)
        if tokens.shape[0] % self.dp_size:
            raise ParallelPlanError(f"{self.name}: {tokens.shape[0]} tokens do not split into dp_size={self.dp_size} "
                                    "equal shards")
        total = torch.zeros(prod.shape[-1], dtype=FP32, device=prod.device)
        for shard in tokens.chunk(self.dp_size, 0):
            part = torch.zeros_like(total)
            if self.head_shards > 1:
                for heads in shard.chunk(self.head_shards, 1):
                    part += self._block(heads)
            else:
                part += self._block(shard)
            total += part
        return total.to(prod.dtype)


class _InvariantScale(torch.autograd.Function):
    """``weight * normed`` (RMSNorm's last op); backward: d normed = grad * weight as torch forms it, d weight on the
    route's fixed order."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, normed: torch.Tensor, route: NormRoute) -> torch.Tensor:
        ctx.save_for_backward(weight, normed)
        ctx.route = route
        return weight * normed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight, normed = ctx.saved_tensors
        d_normed = grad * weight if ctx.needs_input_grad[1] else None
        d_weight = ctx.route.grad_weight(grad * normed) if ctx.needs_input_grad[0] else None
        return d_weight, d_normed, None


def _norm_forward(module, hidden_states):
    route: NormRoute = getattr(module, ROUTE_ATTR)
    if not mode_state.active():
        return type(module).forward(module, hidden_states)
    # transformers' Qwen3RMSNorm.forward, op for op, with the last product on the route
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + module.variance_epsilon)
    mode_state.routed(*route.counter)
    return _InvariantScale.apply(module.weight, hidden_states.to(input_dtype), route)


# ---------------------------------------------------------------------------------------------
# Data parallelism beyond the Linears: the embedding, and a Qwen3-MoE block's router and experts
# ---------------------------------------------------------------------------------------------
def _dp_where(dp_group) -> str:
    return "ranks" if dp_group is not None else "one process, per shard"


def _dp_rows(name: str, rows: int, dp_size: int, what: str = "rows") -> int:
    """The rows of one DP shard on the one-process side (equal shards, rank order), or the one-line refusal."""
    if rows % dp_size:
        raise ParallelPlanError(f"{name}: {rows} {what} do not split into dp_size={dp_size} equal shards; the "
                                "one-process side reduces at the DP ranks' row boundaries (equal shards, rank order)")
    return rows // dp_size


@dataclass
class EmbeddingRoute:
    """The weight gradient of one nn.Embedding under DP: each id's gradient rows summed in ascending position from
    zero in FP32 (``kernels.reductions.index_sum``), the padding_idx's rows skipped (torch keeps its gradient zero).
    A DP rank keeps the sum over its rows as its FP32 partial; the one-process side sums each DP shard's rows into one
    FP32 buffer shard by shard, ((0 + p0) + p1) + ..., which is what the ranks' ordered sum forms; one rounding."""

    name: str
    dp_size: int
    dp_group: object | None
    padding_idx: int | None
    pending: torch.Tensor | None = field(default=None, repr=False)
    tp_group = None  # replicated over TP (a plan entry on an Embedding is refused)

    @property
    def counter(self) -> tuple[str, str]:
        return "embedding (dp)", f"index_sum fixed order, FP32 partials ({_dp_where(self.dp_group)})"

    def partials(self) -> list[tuple[str, torch.Tensor]]:
        return [("weight", self.pending)]

    def reductions(self) -> list[str]:
        return ["backward dW: FP32 partials, rank-order sum over DP" if self.dp_group is not None else
                f"backward dW: index sums per shard of rows/{self.dp_size}, added in shard order"]

    def grad_weight(self, ids: torch.Tensor, dy: torch.Tensor, shape: torch.Size, dtype) -> torch.Tensor | None:
        from detkit.kernels.reductions import index_sum

        rows = dy.reshape(-1, dy.shape[-1])
        rows = rows if rows.stride(1) == 1 else rows.contiguous()  # an exact copy; the kernel reads rows
        flat = ids.reshape(-1)
        total = torch.zeros(shape, dtype=FP32, device=dy.device)
        # check_ids=False: the embedding forward refused ids outside [0, V) already
        if self.dp_group is not None:
            if self.pending is not None:
                raise ParallelPlanError(f"{self.name}: a second backward before reduce_gradients(); the invariant DP "
                                        "reduction sums one FP32 partial per rank")
            self.pending = index_sum(rows, flat, total, skip=self.padding_idx, check_ids=False)
            return None
        per = _dp_rows(self.name, rows.shape[0], self.dp_size, "tokens")
        for s in range(self.dp_size):
            index_sum(rows[s * per:(s + 1) * per], flat[s * per:(s + 1) * per], total, skip=self.padding_idx,
                      check_ids=False)
        return total.to(dtype)


class _InvariantEmbedding(torch.autograd.Function):
    """weight[ids] (a gather: torch's own forward, the same bits); backward: the route's fixed-order index sum."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, route: EmbeddingRoute) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.route, ctx.shape, ctx.dtype = route, weight.shape, weight.dtype
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (ids,) = ctx.saved_tensors
        dw = ctx.route.grad_weight(ids, dy, ctx.shape, ctx.dtype) if ctx.needs_input_grad[1] else None
        return None, dw, None


def _embedding_forward(module: torch.nn.Embedding, ids):
    route: EmbeddingRoute = getattr(module, ROUTE_ATTR)
    if not mode_state.active():
        return torch.nn.Embedding.forward(module, ids)
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise ParallelPlanError(f"{route.name}: ids of {getattr(ids, 'dtype', type(ids).__name__)}; the DP embedding "
                                "route takes int32 / int64 ids (before any collective)")
    mode_state.routed(*route.counter)
    return _InvariantEmbedding.apply(ids, module.weight, route)


def _router_forward(module, hidden_states):
    """transformers' Qwen3MoeTopKRouter forward as the mode runs it (detkit.mode.moe.router_forward: the same ops,
    the top-k normalisation in a fixed order), with its linear on the route's DP GEMMs."""
    from detkit.mode import moe as mode_moe

    route: LinearRoute = getattr(module, ROUTE_ATTR)
    if not mode_state.active():
        return type(module).forward(module, hidden_states)
    hidden_states = hidden_states.reshape(-1, module.hidden_dim)
    _check_input(route, hidden_states)
    router_logits = _InvariantLinear.apply(hidden_states, module.weight, route)  # [T, E]
    router_probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    top, ids = torch.topk(router_probs, module.top_k, dim=-1)  # [T, K]
    if module.norm_topk_prob:
        top = top / mode_moe.fixed_order_sum(top)
    mode_state.routed(*route.counter)
    mode_state.routed(mode_moe.ROUTER_OP, mode_moe.ROUTER_KERNEL)
    return router_logits, top.to(router_logits.dtype), ids


@dataclass
class ExpertsRoute:
    """A Qwen3-MoE block's experts under DP on detkit's BF16 MoE layer (``kernels.moe.layer``), whose dW1 / dW2 reduce
    each expert's routed rows in ascending order from zero and, given ``main_grads``, add that FP32 sum into them
    once (an expert without rows leaves them untouched). A DP rank passes zeros and keeps them as its FP32 partials;
    the one-process side runs the layer once per DP shard of the tokens (a token's outputs, dX and dscores do not
    depend on the other tokens of the call) with one pair of FP32 buffers, so the shards' sums are added in shard
    order, ((0 + p0) + p1) + ...: the ranks' ordered sum. One rounding to BF16."""

    name: str
    dp_size: int
    dp_group: object | None
    pending: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    tp_group = None  # replicated over TP (no expert parallelism)

    @property
    def counter(self) -> tuple[str, str]:
        return "moe experts (dp)", f"detkit.moe_mlp, FP32 dW partials ({_dp_where(self.dp_group)})"

    def partials(self) -> list[tuple[str, torch.Tensor]]:
        return [("gate_up_proj", self.pending[0]), ("down_proj", self.pending[1])]

    def reductions(self) -> list[str]:
        return ["backward dW1, dW2: FP32 partials, rank-order sum over DP" if self.dp_group is not None else
                f"backward dW1, dW2: the layer per shard of tokens/{self.dp_size}, FP32 sums added in shard order"]

    def shards(self, tokens: int) -> list[slice]:
        if self.dp_group is not None:
            return [slice(0, tokens)]
        per = _dp_rows(self.name, tokens, self.dp_size, "tokens")
        return [slice(s * per, (s + 1) * per) for s in range(self.dp_size)]


class _InvariantExperts(torch.autograd.Function):
    """The MoE layer (moe_mlp_fwd / moe_mlp_bwd, gate_up "split") once per shard; dW1 / dW2 into FP32 buffers in the
    parameters' own layouts (gate_up_proj [E, 2I, H], down_proj [E, H, I], seen through w1 / w2's transposes)."""

    @staticmethod
    def forward(ctx, x, w1, w2, ids, scores, route: ExpertsRoute):
        from detkit.kernels.moe.layer import moe_mlp_fwd

        ctx.route = route
        ctx.shapes = (w1.transpose(1, 2).shape, w2.transpose(1, 2).shape)  # gate_up_proj's, down_proj's
        ctx.shards = route.shards(x.shape[0])
        outs, ctx.saved = [], []
        for s in ctx.shards:
            out, saved = moe_mlp_fwd(x[s], w1, w2, ids[s], scores[s], gate_up="split")
            outs.append(out)
            ctx.saved.append(saved)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def backward(ctx, dout):
        from detkit.kernels.moe.layer import moe_mlp_bwd

        route = ctx.route
        g1 = torch.zeros(ctx.shapes[0], dtype=FP32, device=dout.device)  # [E, 2I, H]
        g2 = torch.zeros(ctx.shapes[1], dtype=FP32, device=dout.device)  # [E, H, I]
        dx, ds = [], []
        for s, saved in zip(ctx.shards, ctx.saved):
            grads = moe_mlp_bwd(dout[s], saved, main_grads=(g1.transpose(1, 2), g2.transpose(1, 2)))
            dx.append(grads.dx)
            ds.append(grads.dscores)
        ctx.saved = None
        dx = dx[0] if len(dx) == 1 else torch.cat(dx)
        ds = ds[0] if len(ds) == 1 else torch.cat(ds)
        if route.dp_group is not None:
            if route.pending is not None:
                raise ParallelPlanError(f"{route.name}: a second backward before reduce_gradients(); the invariant DP "
                                        "reduction sums one FP32 partial per rank")
            route.pending = (g1, g2)
            return dx, None, None, None, ds, None
        return dx, g1.to(BF16).transpose(1, 2), g2.to(BF16).transpose(1, 2), None, ds, None


def _experts_forward(module, hidden_states, top_k_index, top_k_weights):
    from detkit.mode import experts as mode_experts
    from detkit.mode import moe as mode_moe

    route: ExpertsRoute = getattr(module, ROUTE_ATTR)
    if not mode_state.active():
        return type(module).forward(module, hidden_states, top_k_index, top_k_weights)
    kernel = _dp_experts_kernel(route, module, hidden_states, top_k_index, top_k_weights)
    reason = (mode_experts.unsupported_reason(module, hidden_states, top_k_index, top_k_weights, "bf16")
              or mode_experts.layout_reason(module)
              or (f"{type(module).__name__}.is_transposed = True (the DP route reads [E, 2I, H] / [E, H, I])"
                  if getattr(module, "is_transposed", False) else None))
    if reason is not None:
        raise ParallelPlanError(f"{route.name}: {reason}; the DP experts route needs what detkit's MoE layer runs "
                                "(before any collective)")
    if hidden_states.shape[0] == 0:
        raise ParallelPlanError(f"{route.name}: no tokens; the DP experts route needs at least one token per shard")
    ids = mode_moe.route_ids(top_k_index, module.num_experts)
    out = _InvariantExperts.apply(hidden_states, module.gate_up_proj.transpose(1, 2),
                                  module.down_proj.transpose(1, 2), ids, top_k_weights, route)
    mode_state.routed(*route.counter)
    mode_state.routed(mode_moe.EXPERTS_OP, kernel)
    return out


def _dp_experts_kernel(route, module, hidden_states, top_k_index, top_k_weights) -> str:
    """The counted kernel of a DP experts call: the BF16 layer, which the invariant reduction of the experts' weight
    gradients runs on. Under ``moe_experts="fp8"`` only where the mode itself would run the BF16 layer (the shape's
    FP8 choice, kernels/moe/fp8/choice.py, with ``fp8_shapes="faster"``): the same layer and bits, counted as the
    mode counts them; anywhere the FP8 layer would run, refused by name (before any collective)."""
    from detkit.mode import experts as mode_experts
    from detkit.mode import moe as mode_moe

    experts = mode_state.moe_experts()
    if experts == "bf16":
        return mode_moe.EXPERTS_KERNEL
    why = mode_experts.unsupported_reason(module, hidden_states, top_k_index, top_k_weights, "fp8")
    if why is None and mode_state.fp8_shapes() != "faster":
        why = f"fp8_shapes={mode_state.fp8_shapes()!r} runs the FP8 layer at every shape"
    if why is None:
        choice = mode_moe.fp8_choice(module, hidden_states, top_k_index)
        if choice.layer == "bf16":
            return mode_moe.fp8_as_bf16_kernel(module, hidden_states, top_k_index, choice.reason)
        why = f"the FP8 layer runs at this shape ({choice.reason})"
    raise ParallelPlanError(f"{route.name}: moe_experts={experts!r} under DP: {why}; the invariant DP reduction of "
                            "the experts' weight gradients runs on the BF16 layer (supported: 'bf16', or 'fp8' where "
                            "the mode runs the BF16 layer)")


EMBEDDING_REFUSALS = (("max_norm", None, "renormalises the rows a batch looks up in place, so each DP rank's "
                       "weights would differ"),
                      ("scale_grad_by_freq", False, "scales by the id counts of the batch, which a DP rank sees only "
                       "part of"),
                      ("sparse", False, "sparse gradients have no FP32 partial"))
EXPERTS_CLASSES = ("Qwen3MoeExperts",)
ROUTER_CLASSES = ("Qwen3MoeTopKRouter",)


def _check_input(route: LinearRoute, x: torch.Tensor) -> None:
    if x.dtype is not BF16:
        raise ParallelPlanError(f"{route.name}: input dtype {x.dtype}; the parallel route needs bfloat16 (before any "
                                "collective)")


def _local_operands(route: LinearRoute | LocalRoute, module: torch.nn.Linear, x):
    """The local tensors of a TP layer's input, weight and bias, and the weights' mesh. The input is what torch's TP
    input hook hands the module: a DTensor in the style's layout (Replicate for colwise, Shard(-1) for rowwise);
    anything else is refused by name (before any collective). ``to_local`` keeps autograd: the weight's gradient
    reaches the DTensor parameter through its backward."""
    from torch.distributed.tensor import DTensor

    want = "Replicate" if route.style == COLWISE else "Shard(-1)"
    got = _layouts(x.placements) if isinstance(x, DTensor) else ("a plain tensor",)
    if got not in ((want,),) and not (route.style == ROWWISE and got == (f"Shard({x.ndim - 1})",)):
        raise ParallelPlanError(f"{route.name}: {route.style} input is {got}; the route needs {want} (before any "
                                "collective)")
    return (x.to_local(), *_local_weights(module), module.weight.device_mesh)


def _local_weights(module: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A TP layer's weight and bias as local tensors (``to_local`` keeps autograd to the DTensor parameters)."""
    from torch.distributed.tensor import DTensor

    b = module.bias
    return module.weight.to_local(), b.to_local() if isinstance(b, DTensor) else b


def _output(route: LinearRoute | LocalRoute, y: torch.Tensor, mesh):
    """The local output as the DTensor torch's TP output hook expects (it redistributes to the style's output layout
    and hands the next module its local tensor)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(y, mesh, [Replicate()] if route.style == ROWWISE else [Shard(-1)], run_check=False)


def _routed_forward(module: torch.nn.Linear, x):
    route: LinearRoute = getattr(module, ROUTE_ATTR)
    if not mode_state.active():
        return torch.nn.Linear.forward(module, x)
    from torch.distributed.tensor import DTensor

    w, b = module.weight, module.bias
    sharded = isinstance(w, DTensor)
    if sharded and not isinstance(x, DTensor):  # torch's TP hooks stood aside (_StyleHookGate): x is the local input
        (w, b), sharded = _local_weights(module), False
    elif sharded:
        x, w, b, mesh = _local_operands(route, module, x)
    _check_input(route, x)
    lead = x.shape[:-1]
    y = _InvariantLinear.apply(x.reshape(-1, x.shape[-1]), w, route)
    y = y.view(*lead, y.shape[-1])
    if b is not None:
        y = y + b  # after the one rounding, as addmm's route does (elementwise: no order)
    mode_state.routed(*route.counter)
    return _output(route, y, mesh) if sharded else y


# ---------------------------------------------------------------------------------------------
# World size 1: a plan's Linear on a TP mesh of one rank
# ---------------------------------------------------------------------------------------------
LOCAL_OP = "linear (tp, one rank)"
LOCAL_KERNEL = "the mode's aten route on the local tensors"
LOCAL_REDUCTION = "none at world size 1 (the local tensors on the mode's aten route)"


@dataclass
class LocalRoute:
    """A plan's Linear whose weight is a DTensor on a TP mesh of one rank, with no DP split. Nothing is split, so no
    reduction needs the invariant route: the unsharded model's kernels give the TP=1 bits. But ``F.linear`` on DTensor
    weights would run every op of the layer, forward and backward, through DTensor's per-op dispatch (host time per
    op the plain model does not spend). So the layer runs ``F.linear`` on its local tensors instead:
    the same aten ops on the same tensors as the plain model (the mode's mm / addmm route, its configs), inside
    torch's TP hooks, which still wrap the input and unwrap the output as they do for any TP size."""

    name: str
    style: str
    tp_group = None  # no collective: nothing for reduce_gradients
    dp_group = None
    pending = None
    counter = (LOCAL_OP, LOCAL_KERNEL)

    def reductions(self) -> list[str]:
        return [LOCAL_REDUCTION]


def _local_forward(module: torch.nn.Linear, x):
    route: LocalRoute = getattr(module, ROUTE_ATTR)
    if not mode_state.active():
        return torch.nn.Linear.forward(module, x)
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor):  # torch's TP hooks stood aside (_StyleHookGate): local in, local out
        y = torch.nn.functional.linear(x, *_local_weights(module))
        mode_state.routed(*route.counter)
        return y
    x, w, b, mesh = _local_operands(route, module, x)
    y = torch.nn.functional.linear(x, w, b)
    mode_state.routed(*route.counter)
    return _output(route, y, mesh)


# ---------------------------------------------------------------------------------------------
# torch's TP hooks of a prepared layer
# ---------------------------------------------------------------------------------------------
class _StyleHookGate:
    """One of the two hooks ``parallelize_module`` put on a prepared Linear (``distribute_module``'s forward pre-hook
    over the style's ``_prepare_input_fn``, its forward hook over ``_prepare_output_fn``), standing aside while the
    mode is entered. For the layouts it is installed on, the pair is an identity on the data: the pre-hook wraps the
    local input as a DTensor (Replicate for colwise, Shard(-1) for rowwise; no collective), the route unwraps it, and
    the output hook unwraps the route's DTensor in the layout it already has. Each wrap and unwrap is an autograd node
    with DTensor's host bookkeeping, forward and backward (about 0.25 ms per layer and step on a CPU host), so under
    the mode the route takes the local tensor and returns one. Outside the mode, and for a DTensor input or output,
    the hook runs as torch installed it."""

    def __init__(self, hook, kind: str):
        from torch.distributed.tensor import DTensor

        self.hook, self.kind, self.dtensor = hook, kind, DTensor  # the class kept: __call__ runs twice a layer

    def __call__(self, module, *args):
        if mode_state.active():
            value = args[-1] if self.kind == "output" else (args[0][0] if args[0] else None)
            if value is not None and not isinstance(value, self.dtensor):
                return None  # inputs / outputs as they are
        return self.hook(module, *args)


def _style_hook_ids(module: torch.nn.Module, style_cls) -> tuple[list[int], list[int]]:
    """The ids of the forward pre-hooks and forward hooks ``distribute_module`` installed for ``style_cls`` on
    ``module``: the hooks whose closure holds a ``functools.partial`` over the style's own ``_prepare_input_fn`` /
    ``_prepare_output_fn`` (identity checks on the functions, not names)."""
    import functools

    def over(hook, fn) -> bool:
        cells = getattr(hook, "__closure__", None) or ()
        return any(isinstance(c.cell_contents, functools.partial) and c.cell_contents.func is fn for c in cells)

    pre = [i for i, h in module._forward_pre_hooks.items() if over(h, style_cls._prepare_input_fn)]
    post = [i for i, h in module._forward_hooks.items() if over(h, style_cls._prepare_output_fn)]
    return pre, post


def _gate_style_hooks(module: torch.nn.Module, style: str) -> None:
    """Put ``_StyleHookGate`` around the style's hook pair of a prepared Linear; nothing changes unless exactly one of
    each is found (the layer then keeps torch's hooks, whose DTensor input the route takes as well)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    pre, post = _style_hook_ids(module, ColwiseParallel if style == COLWISE else RowwiseParallel)
    if len(pre) != 1 or len(post) != 1:
        return
    for hooks, ids, kind in ((module._forward_pre_hooks, pre, "input"), (module._forward_hooks, post, "output")):
        if not isinstance(hooks[ids[0]], _StyleHookGate):
            hooks[ids[0]] = _StyleHookGate(hooks[ids[0]], kind)


# ---------------------------------------------------------------------------------------------
# prepare / reduce_gradients
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParallelPlan:
    """What ``prepare`` set up: per prepared Linear its style and the reductions it uses."""

    tp_size: int
    dp_size: int
    on_ranks: bool  # True on TP / DP ranks, False on the one-process (segmented) side
    layers: dict[str, tuple[str | None, tuple[str, ...]]]  # name -> (style, reductions)
    # The parameters whose gradients the routes form (on a DP rank: ``reduce_gradients``' invariant sum); at world
    # size 1 none (no reduction is split: autograd forms them as in the plain model)
    covered: tuple[str, ...] = ()

    def reductions(self) -> dict[str, list[str]]:
        return {name: list(r) for name, (_, r) in self.layers.items() if r}

    def routed(self) -> list[str]:
        """The layers on the parallel route (at world size 1 none: they keep the mode's aten route)."""
        return [n for n, (_, r) in self.layers.items() if not any(x.startswith("none at world size 1") for x in r)]

    def local(self) -> list[str]:
        """The layers with DTensor weights on a TP mesh of one rank: the mode's aten route on their local tensors."""
        return [n for n, (_, r) in self.layers.items() if LOCAL_REDUCTION in r]


def _group_backend_check(name: str, w_local: torch.Tensor, group) -> None:
    backend = resolve_backend(det_gemm_kernel, {f"{name}.weight": w_local})
    try:
        check_collective_backend(backend, str(dist.get_backend(group)))
    except NotImplementedError as exc:
        raise ParallelPlanError(f"{name}: {exc}") from None


def prepare(model: torch.nn.Module, plan: dict | None = None, *, tp_size: int | None = None, dp_size: int = 1,
            dp_group=None) -> ParallelPlan:
    """Put ``model``'s Linear layers on the parallel routes (while the mode is entered); returns the plan summary.

    - TP ranks: call after ``parallelize_module(model, mesh, plan)`` with the same ``plan``; the TP size and group
      come from the weights' DTensor meshes (``tp_size`` may be given as a check).
    - The one-process side (a TP=1 trainer matching TP ranks): ``plan`` and ``tp_size``; plain weights. Row-parallel
      forwards and column-parallel dX then use ``seg_len`` = the shard width.
    - DP ranks: ``dp_group`` (its size is the DP size); every Linear keeps its dW as an FP32 partial for
      ``reduce_gradients(model)``. The one-process side: ``dp_size`` = the DP shard count of the global batch, in
      rank order.
    Every Linear of the model is prepared (pinned configs) when DP is on; with TP only, the plan's Linears. At world
    size 1 (tp 1, dp 1) no reduction is split, so the layers keep the mode's aten route: on their local tensors where
    their weights are DTensors (``LocalRoute``), untouched where they are plain.
    Refusals: see the module docstring; all raise ``ParallelPlanError`` before any collective."""
    from torch.distributed.tensor import DTensor

    plan = dict(plan or {})
    styles = {p: style_of(p, s) for p, s in plan.items()}
    if dp_group is not None:
        if not dist.is_initialized():
            raise ParallelPlanError("dp_group given but the default process group is not initialised")
        group_size = dist.get_world_size(dp_group)
        if dp_size not in (1, group_size):
            raise ParallelPlanError(f"dp_size={dp_size} but dp_group has {group_size} ranks")
        dp_size = group_size
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ParallelPlanError(f"dp_size must be a positive int; got {dp_size!r}")
    modules = dict(model.named_modules())
    matched: dict[str, str] = {}
    for pattern in plan:
        names = [n for n in modules if _matches({pattern: None}, n)]
        if not names:
            raise ParallelPlanError(f"plan entry {pattern!r} matches no module of {type(model).__name__}")
        for n in names:
            if type(modules[n]) is not torch.nn.Linear:
                raise ParallelPlanError(
                    f"plan entry {pattern!r}: {n} is a {type(modules[n]).__name__}; detkit mode makes only nn.Linear "
                    "reductions invariant (a vocab-parallel Embedding's partial sum turns a -0.0 weight into +0.0)")
            if n in matched:
                raise ParallelPlanError(f"{n} matches plan entries {matched[n]!r} and {pattern!r}")
            matched[n] = pattern
    # Weights shared between modules (tied embeddings): a prepared weight's gradient would miss the other use.
    owners: dict[int, list[str]] = {}
    for n, m in modules.items():
        for pn, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{n}.{pn}" if n else pn)
    sharded_names = {n for n, m in modules.items() if isinstance(m, torch.nn.Linear) and isinstance(m.weight, DTensor)}
    unplanned = sorted(sharded_names - set(matched))
    if unplanned:
        raise ParallelPlanError(f"{unplanned[0]} has DTensor weights but no entry in the plan; detkit mode routes "
                                "only the plan's colwise / rowwise Linears")
    on_tp_ranks = bool(sharded_names)
    tp_group, size = None, 1
    if on_tp_ranks:
        meshes = {id(modules[n].weight.device_mesh): modules[n].weight.device_mesh for n in sharded_names}
        if len(meshes) != 1:
            raise ParallelPlanError("the plan's weights live on more than one device mesh; supported: one TP mesh")
        mesh = next(iter(meshes.values()))
        if mesh.ndim != 1:
            raise ParallelPlanError(f"the TP weights' mesh has {mesh.ndim} axes {mesh.mesh_dim_names}; supported: a 1-D "
                                    "TP mesh (shard with mesh['tp'])")
        tp_group, size = mesh.get_group(), mesh.size()
        if tp_size not in (None, size):
            raise ParallelPlanError(f"tp_size={tp_size} but the TP mesh has {size} ranks")
    elif plan:
        if tp_size is None:
            raise ParallelPlanError("plan given with plain (not DTensor) weights: pass tp_size, the TP size the ranks "
                                    "use, so the one-process side segments at their shard boundaries")
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ParallelPlanError(f"tp_size must be a positive int; got {tp_size!r}")
        size = tp_size
    targets = {n: matched.get(n) for n, m in modules.items() if type(m) is torch.nn.Linear and (
        n in matched or dp_size > 1)}
    routes: dict[str, LinearRoute] = {}
    local: dict[str, LocalRoute] = {}
    idle: dict[str, tuple[str | None, tuple[str, ...]]] = {}
    for n, pattern in targets.items():
        m = modules[n]
        style, gathers = styles[pattern] if pattern is not None else (None, False)
        shared = owners[id(m.weight)]
        if len(shared) > 1:
            raise ParallelPlanError(f"{n}.weight is shared with {[s for s in shared if s != n + '.weight']}; a "
                                    "prepared Linear needs its own weight (untie it)")
        w = m.weight
        if isinstance(w, DTensor):
            want = {ROWWISE: "Shard(1)", COLWISE: "Shard(0)"}[style]
            got = _layouts(w.placements)
            if got != (want,):
                raise ParallelPlanError(f"{n}.weight has placements {got}; the plan's {style} needs ({want},)")
            n_out, k_in = w.shape
            w_local = w.to_local()
            if w_local.shape[0] * (size if style == COLWISE else 1) != n_out or \
                    w_local.shape[1] * (size if style == ROWWISE else 1) != k_in:
                raise ParallelPlanError(f"{n}.weight {tuple(w.shape)} is sharded unevenly ({tuple(w_local.shape)} "
                                        f"on this rank); supported: even shards")
            _group_backend_check(n, w_local, tp_group)
        else:
            n_out, k_in = w.shape
            if style is not None and size > 1:
                dim, width = (k_in, "K") if style == ROWWISE else (n_out, "N")
                if dim % size:
                    raise ParallelPlanError(f"{n}: {width}={dim} does not split into tp_size={size} even shards")
        if dp_group is not None:
            _group_backend_check(n, w.to_local() if isinstance(w, DTensor) else w, dp_group)
        if size == 1 and dp_size == 1:
            # World size 1: no reduction is split, so nothing to make invariant; the layer keeps the mode's aten route
            # (the same kernels and configs as the unsharded model: the same bits and speed), on its local tensors
            # where its weights are DTensors (LocalRoute: no per-op DTensor dispatch).
            if isinstance(w, DTensor):
                local[n] = LocalRoute(n, style)
                idle[n] = (style, (LOCAL_REDUCTION,))
            else:
                idle[n] = (style, ("none at world size 1 (the mode's aten route)",))
            continue
        seg_k = k_in // size if style == ROWWISE and size > 1 else 0
        seg_n = n_out // size if style == COLWISE and size > 1 else 0
        try:
            configs = {"fwd": _pinned("fwd", seg_k), "da": _pinned("da", seg_n), "db": _pinned("db", 0)}
        except ValueError as exc:
            raise ParallelPlanError(f"{n}: {exc}") from None
        routes[n] = LinearRoute(n, style, size if style else 1, tp_group if style else None, dp_size, dp_group,
                                gathers, configs)
    dp_routes: dict[str, object] = {}  # name -> EmbeddingRoute | LinearRoute (a MoE router) | ExpertsRoute
    for n, m in modules.items():
        if dp_size == 1:
            break
        cls = type(m).__name__
        if type(m) is torch.nn.Embedding:
            for attr, supported, why in EMBEDDING_REFUSALS:
                if getattr(m, attr) != supported:
                    raise ParallelPlanError(f"{n}: nn.Embedding({attr}={getattr(m, attr)!r}) under DP: {why}; "
                                            f"supported: {attr}={supported!r}")
            weights = {"weight": m.weight}
        elif cls in ROUTER_CLASSES or cls in EXPERTS_CLASSES:
            weights = {"weight": m.weight} if cls in ROUTER_CLASSES else {
                "gate_up_proj": m.gate_up_proj, "down_proj": m.down_proj}
        else:
            continue
        for attr, w in weights.items():
            shared = owners[id(w)]
            if len(shared) > 1:
                raise ParallelPlanError(f"{n}.{attr} is shared with {[x for x in shared if x != f'{n}.{attr}']}; a "
                                        "prepared parameter needs its own tensor (untie it)")
            if isinstance(w, DTensor):
                raise ParallelPlanError(f"{n}.{attr} is a DTensor {_layouts(w.placements)}; the DP route of a "
                                        f"{cls} takes a plain (replicated) weight")
            if dp_group is not None:
                _group_backend_check(f"{n}.{attr}", w, dp_group)
        if type(m) is torch.nn.Embedding:
            dp_routes[n] = EmbeddingRoute(n, dp_size, dp_group, m.padding_idx)
        elif cls in ROUTER_CLASSES:
            dp_routes[n] = LinearRoute(n, None, 1, None, dp_size, dp_group, False,
                                       {"fwd": _pinned("fwd", 0), "da": _pinned("da", 0), "db": _pinned("db", 0)})
        else:
            dp_routes[n] = ExpertsRoute(n, dp_size, dp_group)
    norm_routes: dict[str, NormRoute] = {}
    for n, m in modules.items():
        if type(m).__name__ not in NORM_CLASSES:
            continue
        parent, _, leaf = n.rpartition(".")
        sibling = f"{leaf[0]}_proj"
        proj = routes.get(f"{parent}.{sibling}" if parent else sibling) if leaf in ("q_norm", "k_norm") else None
        heads = proj.tp_size if proj is not None and proj.style == COLWISE else 1
        if heads == 1 and dp_size == 1:
            continue  # a replicated norm on replicated rows: TP ranks compute TP=1's sum as it is
        if len(owners[id(m.weight)]) > 1 or m.weight.dim() != 1 or isinstance(m.weight, DTensor):
            raise ParallelPlanError(f"{n}.weight: a prepared RMSNorm needs its own plain 1-D weight")
        norm_routes[n] = NormRoute(n, heads, proj.tp_group if heads > 1 else None, dp_size, dp_group,
                                   _pinned("db", 0))
    for n, route in routes.items():
        m = modules[n]
        setattr(m, ROUTE_ATTR, route)
        m.forward = types.MethodType(_routed_forward, m)
        if on_tp_ranks and route.style is not None and not route.gathers_output:
            _gate_style_hooks(m, route.style)  # a gathering colwise layer's output hook all-gathers: it stays
    for n, route in local.items():
        m = modules[n]
        setattr(m, ROUTE_ATTR, route)
        m.forward = types.MethodType(_local_forward, m)
        _gate_style_hooks(m, route.style)
    for n, route in norm_routes.items():
        m = modules[n]
        setattr(m, ROUTE_ATTR, route)
        m.forward = types.MethodType(_norm_forward, m)
        idle.pop(n, None)
    kinds = {EmbeddingRoute: ("embedding", _embedding_forward), LinearRoute: ("moe router", _router_forward),
             ExpertsRoute: ("moe experts", _experts_forward)}
    for n, route in dp_routes.items():
        m = modules[n]
        setattr(m, ROUTE_ATTR, route)
        m.forward = types.MethodType(kinds[type(route)][1], m)
    every = {**routes, **norm_routes, **dp_routes}
    covered = tuple(f"{n}.{attr}" if n else attr for n, r in every.items()
                    for attr in (("gate_up_proj", "down_proj") if isinstance(r, ExpertsRoute) else ("weight",)))
    return ParallelPlan(size, dp_size, on_tp_ranks or dp_group is not None,
                        {**idle, **{n: (r.style, tuple(r.reductions())) for n, r in routes.items()},
                         **{n: ("rmsnorm", tuple(r.reductions())) for n, r in norm_routes.items()},
                         **{n: (kinds[type(r)][0], tuple(r.reductions())) for n, r in dp_routes.items()}},
                        covered)


def routes(model: torch.nn.Module) -> dict[str, "LinearRoute | NormRoute"]:
    return {n: getattr(m, ROUTE_ATTR) for n, m in model.named_modules() if hasattr(m, ROUTE_ATTR)}


@torch.no_grad()
def reduce_gradients(model: torch.nn.Module, *, average: bool = False) -> dict[str, str]:
    """The invariant DP gradient reduction of a ``prepare(..., dp_group=...)`` model, after its backward: each
    route's FP32 partials (Linear and RMSNorm weights, the embedding, a MoE router and experts) summed in rank order
    (``_ordered_sum``), rounded to the parameter's dtype once, written as its ``.grad``. Every other parameter with a
    gradient (biases, classes no route covers) is summed the same way from its BF16 gradient: deterministic, but not
    equal to DP=1 (autograd rounded each rank's sum to BF16 first, and DP=1 sums all rows in torch's order); under
    FSDP2 those are left to FSDP2's own reduce-scatter.
    ``average=True`` divides the FP32 sum by the DP size before the rounding, as DDP and FSDP2 do; only for a
    power-of-two DP size, where the division is exact (the bits are then DP=1's sum halved, quartered, ...).
    Returns ``{parameter: "invariant" | "fp32 sum of bf16 grads" | "fsdp2 reduce-scatter"}``."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Replicate

    prepared = routes(model)
    missing = [n for n, r in prepared.items() if r.dp_group is not None and r.pending is None]
    groups = {id(r.dp_group): r.dp_group for r in prepared.values() if r.dp_group is not None}
    if not groups:
        raise ParallelPlanError("reduce_gradients: no Linear was prepared with a dp_group")
    if len(groups) != 1:
        raise ParallelPlanError("reduce_gradients: prepared Linears carry different dp_groups")
    if missing and len(missing) != len(prepared):
        raise ParallelPlanError(f"reduce_gradients: {missing[0]} has no gradient partial (no backward through it)")
    group = next(iter(groups.values()))
    size = dist.get_world_size(group)
    if average and size & (size - 1):
        raise ParallelPlanError(f"reduce_gradients(average=True) with {size} DP ranks: dividing by a size that is not a "
                                "power of two rounds, so the bits would no longer be DP=1's; use average=False")
    scale = 1.0 / size if average else 1.0
    kinds: dict[str, str] = {}
    covered = set()
    for n, r in prepared.items():
        module = model.get_submodule(n)
        attrs = ("gate_up_proj", "down_proj") if isinstance(r, ExpertsRoute) else ("weight",)
        covered.update(id(getattr(module, a)) for a in attrs)
        if r.pending is None:
            continue
        for attr, partial in r.partials():
            w = getattr(module, attr)
            if w.grad is not None:
                raise ParallelPlanError(f"reduce_gradients: {n}.{attr} already has a .grad (accumulated outside the "
                                        "route)")
        for attr, partial in r.partials():
            w = getattr(module, attr)
            reduced = (_ordered_sum(partial, group) * scale).to(w.dtype)
            if not isinstance(w, DTensor):
                w.grad = reduced
            elif r.tp_group is not None:  # the partial is this TP rank's shard's gradient
                w.grad = DTensor.from_local(reduced, w.device_mesh, w.placements, run_check=False)
            else:  # FSDP2: the forward saw the unsharded weight; this rank keeps its shard (a local cut, no collective)
                mesh = w.device_mesh
                w.grad = DTensor.from_local(reduced, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(
                    mesh, w.placements)
            kinds[f"{n}.{attr}"] = "invariant"
        r.pending = None
    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    for pn, p in model.named_parameters():
        if id(p) in covered or p.grad is None:
            continue
        if fsdp:  # FSDP2 reduce-scattered these itself (the unsharded BF16 gradients, averaged)
            kinds[pn] = "fsdp2 reduce-scatter"
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        g.copy_((_ordered_sum(g.float(), group) * scale).to(g.dtype))
        kinds[pn] = "fp32 sum of bf16 grads"
    return kinds
