"""Cross-config invariance of the complete Qwen3 MLP (suite 'invariance'): TP1CP1, TP2CP1, TP1CP2 and
TP2CP2 on the same global inputs, in both reduction modes.

Started as ranks (``torchrun --nproc-per-node 4 -m detkit audit --suite invariance``; docs/invariance.md),
after ``toolkit.dist.setup_distributed`` built the TP and CP groups. Every rank draws the same
seeded global fixtures and runs the MLP forward and backward (``kernels.mlp.DetQwen3MLP``) once per
config and mode; the configs with TP=1 or CP=1 are computed redundantly on every rank that needs
them (TP1CP1 everywhere; TP2CP1 on both TP groups, each over all M rows; TP1CP2 on both CP groups,
each over all of I). Each rank then compares, in its own region of every tensor (the rows of its CP
shard when the world holds a CP group, the columns / rows of its TP shard when it holds a TP group),

- ``fp32_invariant``: every pair of configs, raw bits (0 mismatches required), for y, dX, dW_gate,
  dW_up and dW_down;
- ``bf16`` (version 1): the same pairs, reported as drift (max / p99 BF16 ULP and relative
  error), not failed: v1 does not claim parallelism invariance;
- the public operators (``row_parallel_fwd``, ``column_parallel_dx``, ``replicated_dw``) with
  ``mode="fp32_invariant"`` on the TP=2 x CP=2 shards == ``kernels.invariant``'s TP=1 / CP=1
  segmented kernels on the same region (raw bits);
- both modes: every config within the MLP contract of the FP64 global reference (``mlp_bounds``),
  and the all-reduces each config issued (0 / 2 / 2 / 4).

Rank 0 also merges the per-rank drift into one table per (mode, tensor, pair) over the whole global
tensor (each element counted once: y / dX from the tp=0 ranks, dW from the cp=0 ranks) with a
harness-side ``all_gather_object`` of each rank's largest 1 % (exact max and p99).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import torch

from detkit.kernels.parallel import operators as parallel
from detkit.kernels.parallel.invariant import (
    FP32_INVARIANT, INVARIANT_CONFIG_TABLE_VERSION, MODES, cp1_db, layout_config, tp1_da, tp1_fwd,
)
from detkit.kernels.parallel.mlp import DetQwen3MLP, MlpPlan, mlp_bounds, mlp_ref_fp64, shard_tokens, split_gate_up
from detkit.toolkit.contract import bf16_ordinal, check_bound, compare_bits
from detkit.toolkit.dist import DistSession, RankAudit, observe_collectives, session_for_suite
from detkit.toolkit.harness import Row, RunContext
from detkit.toolkit.nvtx_ranges import nvtx_range
from detkit.toolkit.shard_refs import local_inputs, make_fixtures, operand

NAME = "invariance"
DESCRIPTION = "MLP fwd/bwd bits across TP1CP1, TP2CP1, TP1CP2, TP2CP2: fp32_invariant bitwise, bf16 drift"

CONFIGS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (tp, cp)
TENSORS = ("y", "dx", "dw_gate", "dw_up", "dw_down")
TAIL = 0.01  # the top 1 % each rank sends for the merged p99


def config_label(tp: int, cp: int) -> str:
    return f"TP{tp}CP{cp}"


def run(ctx: RunContext) -> Iterator[Row]:
    session, refusal = session_for_suite(NAME, ctx.backend, (
        "'torchrun --nproc-per-node 4 --standalone -m detkit audit --suite invariance' (2 GPUs: "
        "DETKIT_TPCP_WORLD=0,1 for TP1CP1 vs TP2CP1, DETKIT_TPCP_WORLD=0,2 for TP1CP1 vs TP1CP2)"))
    if refusal is not None:
        yield refusal
        return
    yield from InvarianceAudit(ctx, session).run()


class InvarianceAudit(RankAudit):
    def __init__(self, ctx: RunContext, session: DistSession):
        super().__init__(ctx, session)
        self.configs = [(tp, cp) for tp, cp in CONFIGS
                        if (tp == 1 or self.groups.tp is not None) and (cp == 1 or self.groups.cp is not None)]
        self.cut_rows = any(cp == 2 for _, cp in self.configs)
        self.cut_cols = any(tp == 2 for tp, _ in self.configs)

    def row(self, check: str, name: str, passed: bool, /, **details) -> Row:
        base = {"layout_rank": self.me, "cp": self.cp, "tp": self.tp, "pg_backend": self.session.pg_backend}
        return Row(NAME, check, name, bool(passed), self.ctx.backend, {**base, **details})

    def where(self) -> str:
        return f"rank {self.me} (cp{self.cp},tp{self.tp})"

    # ------------------------------------------------------------------------------ regions
    def plan(self, tp: int, cp: int, mode: str) -> MlpPlan:
        return MlpPlan(self.layout, tp, cp, self.tp if tp == 2 else 0, self.cp if cp == 2 else 0,
                       self.groups.tp if tp == 2 else None, self.groups.cp if cp == 2 else None, mode)

    def region(self, name: str, t: torch.Tensor, plan: MlpPlan) -> torch.Tensor:
        """This rank's region of a config's result, in the TP2CP2 frame (see the module doc)."""
        layout = self.layout
        if name in ("y", "dx"):  # [M_loc, H]
            return t.index_select(0, layout.global_rows(self.cp, t.device)) if self.cut_rows and plan.cp == 1 else t
        if name in ("dw_gate", "dw_up"):  # [I_loc, H]
            return t[layout.i_shard(self.tp)] if self.cut_cols and plan.tp == 1 else t
        return t[:, layout.i_shard(self.tp)] if self.cut_cols and plan.tp == 1 else t  # dw_down [H, I_loc]

    def global_region(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The same region cut from a global tensor (the FP64 reference and its bound)."""
        layout = self.layout
        if name in ("y", "dx"):
            return t.index_select(0, layout.global_rows(self.cp, t.device)) if self.cut_rows else t
        if name in ("dw_gate", "dw_up"):
            return t[layout.i_shard(self.tp)] if self.cut_cols else t
        return t[:, layout.i_shard(self.tp)] if self.cut_cols else t

    def owns(self, name: str) -> bool:
        """Whether this rank's region of ``name`` counts in the merged table (each element once)."""
        return (self.tp == 0 or not self.cut_cols) if name in ("y", "dx") else (self.cp == 0 or not self.cut_rows)

    # ------------------------------------------------------------------------------ run
    def run(self) -> Iterator[Row]:
        fx = make_fixtures(self.layout, self.ctx.seed, self.device, "randn")
        t = fx.tensors
        w = (t["w_gate"], t["w_up"], t["w_down"])
        ref = mlp_ref_fp64(t["x"], *w, t["d_out"])
        bounds = mlp_bounds(t["x"], *w, t["d_out"], ref)
        tails: dict[str, list] = {}
        for mode in MODES:
            results = {}
            for tp, cp in self.configs:
                plan = self.plan(tp, cp, mode)
                name = f"mlp {plan.label} {mode} [M={plan.m_loc}, H={self.layout.model.hidden_size}, I={plan.i_loc}] " \
                       f"{self.where()}"
                with observe_collectives() as seen, nvtx_range(name):
                    out = self.mlp(plan, fx)
                results[plan.label] = out
                expected = 2 * (tp - 1) + 2 * (cp - 1)
                yield self.row("collectives", name, dict(seen) == ({"all_reduce": expected} if expected else {}),
                               mode=mode, config=plan.label, observed=dict(seen), expected_all_reduce=expected)
                for tensor in TENSORS:
                    result = check_bound(out[tensor], self.global_region(tensor, ref[tensor]),
                                         self.global_region(tensor, bounds[tensor]))
                    yield self.row("contract", f"{name} {tensor}", result.passed, mode=mode, config=plan.label,
                                   tensor=tensor, **result.as_row())
            for (a, b) in itertools.combinations(results, 2):
                for tensor in TENSORS:
                    x, y = results[a][tensor], results[b][tensor]
                    bits = compare_bits(x, y)
                    drift = pair_drift(x, y)
                    name = f"{tensor} {a} vs {b} {mode} {self.where()}"
                    if mode == FP32_INVARIANT:
                        yield self.row("invariant_bitwise", name, bits.equal, mode=mode, pair=[a, b], tensor=tensor,
                                       mismatched_bytes=mismatched_bytes(x, y), **bits.as_row(), **drift)
                    else:
                        yield self.row("v1_drift", name, not bits.nan_count, mode=mode, pair=[a, b], tensor=tensor,
                                       note="informational: v1 does not claim parallelism invariance",
                                       **bits.as_row(), **drift)
                    if self.owns(tensor):
                        tails[f"{mode}|{tensor}|{a} vs {b}"] = tail_of(x, y, self.global_numel(tensor))
        yield from self.operator_rows(fx)
        table = self.merge_tails(tails)
        if self.session.rank == 0:
            self.session.add_meta(self.coverage(table))

    def operator_rows(self, fx) -> Iterator[Row]:
        """The public v1 operators with ``mode="fp32_invariant"`` on this rank's TP=2 x CP=2 shards ==
        their TP=1 / CP=1 counterparts (``kernels.invariant``) on the same region, bitwise."""
        layout, loc = self.layout, local_inputs(fx, self.me)
        cases = []
        if self.groups.tp is not None:
            tp = self.groups.tp
            cases.append(("row_parallel_fwd", lambda: parallel.row_parallel_fwd(
                loc["hidden"], loc["w_down"], tp, mode=FP32_INVARIANT)[1], lambda: tp1_fwd(
                operand(fx, "hidden", self.cp, None), operand(fx, "w_down", None, None), layout, FP32_INVARIANT)))
            cases.append(("column_parallel_dx", lambda: parallel.column_parallel_dx(
                loc["d_gate"], loc["w_gate"], tp, mode=FP32_INVARIANT)[1], lambda: tp1_da(
                operand(fx, "d_gate", self.cp, None), operand(fx, "w_gate", None, None), layout.i_local, layout,
                FP32_INVARIANT)))
        if self.groups.cp is not None:
            cpg = self.groups.cp
            cases.append(("replicated_dw", lambda: parallel.replicated_dw(
                loc["hidden"], loc["d_out"], cpg, mode=FP32_INVARIANT)[1], lambda: cp1_db(
                operand(fx, "hidden", None, self.tp), operand(fx, "d_out", None, None), layout, FP32_INVARIANT)))
        for op, sharded, unsharded in cases:
            got, want = sharded(), unsharded()
            bits = compare_bits(got, want)
            yield self.row("operator_invariant", f"{op} fp32_invariant vs its TP=1/CP=1 segments {self.where()}",
                           bits.equal, operator=op, mode=FP32_INVARIANT, mismatched_bytes=mismatched_bytes(got, want),
                           **bits.as_row())

    def mlp(self, plan: MlpPlan, fx) -> dict[str, torch.Tensor]:
        t = fx.tensors
        module = DetQwen3MLP.from_global(t["w_gate"], t["w_up"], t["w_down"], plan)
        x = shard_tokens(t["x"], plan).detach().clone().requires_grad_(True)
        y = module(x)
        y.backward(shard_tokens(t["d_out"], plan))
        dw_gate, dw_up = split_gate_up(module.w_gate_up.grad, plan)
        raw = {"y": y.detach(), "dx": x.grad, "dw_gate": dw_gate, "dw_up": dw_up, "dw_down": module.w_down.grad}
        return {k: self.region(k, v, plan).contiguous() for k, v in raw.items()}

    def global_numel(self, tensor: str) -> int:
        h, i, m = self.layout.model.hidden_size, self.layout.model.intermediate_size, self.layout.m
        return m * h if tensor in ("y", "dx") else i * h

    # ------------------------------------------------------------------------------ merged table
    def merge_tails(self, tails: dict[str, dict]) -> list[dict]:
        import torch.distributed as dist

        gathered: list = [None] * self.session.world_size
        dist.all_gather_object(gathered, tails)
        self.session.harness_collectives["all_gather_object/world"] += 1
        table = []
        for key in sorted({k for g in gathered for k in g}):
            mode, tensor, pair = key.split("|")
            parts = [g[key] for g in gathered if key in g]
            n = sum(p["n"] for p in parts)
            entry = {"mode": mode, "tensor": tensor, "pair": pair, "elements": n,
                     "mismatches": sum(p["mismatches"] for p in parts),
                     "mismatched_bytes": sum(p["mismatched_bytes"] for p in parts)}
            for what in ("ulp", "rel"):
                values = torch.cat([torch.as_tensor(p[what], dtype=torch.float64).cpu() for p in parts])
                entry[f"{what}_max"] = float(values.max()) if values.numel() else 0.0
                entry[f"{what}_p99"] = merged_quantile(values, n, 0.99)
            table.append(entry)
        return table

    # ------------------------------------------------------------------------------ meta
    def coverage(self, table: list[dict]) -> dict:
        layout, session = self.layout, self.session
        labels = [config_label(tp, cp) for tp, cp in self.configs]
        missing = [config_label(tp, cp) for tp, cp in CONFIGS if (tp, cp) not in self.configs]
        covered = [
            f"layout {layout.model.label}: B={layout.batch}, S={layout.seq_len}, world {list(layout.world)}",
            f"configs {labels} on the same global inputs; modes {list(MODES)}",
            "complete Qwen3 MLP forward and backward (Gate/Up GEMM, SwiGLU kernels, Down GEMM; dX of Gate and Up "
            "summed locally before one TP reduction) through DetQwen3MLP / torch.autograd",
            "fp32_invariant: every pair of configs bitwise (y, dX, dW_gate, dW_up, dW_down)",
            "fp32_invariant through the public operators (row_parallel_fwd, column_parallel_dx, replicated_dw on the "
            "groups held) == the TP=1 / CP=1 segmented kernels, bitwise",
            "bf16 (v1): drift per pair (max / p99 BF16 ULP and relative error), merged over the global tensors",
            "every config within the MLP contract of the FP64 global reference (mlp_bounds)",
            "all_reduce counts per config observed in torch.distributed",
            f"invariant configs {INVARIANT_CONFIG_TABLE_VERSION}: "
            + ", ".join(f"{op} {layout_config(op, layout).label()}" for op in ("fwd", "da", "db")),
        ]
        not_covered = [
            "the GPU (sm_90) bits: the interpreter adds one product at a time; tensor-core runs need their own "
            "audit" if self.ctx.backend != "cuda_sm90" else "configs beyond the pinned invariant table",
            "TP=4 / CP=4 or larger, uneven shards, DP>1, zigzag CP order",
            "invariance of the bf16 (v1) mode: not claimed, drift reported only",
            "the cost of fp32_invariant (FP32 all-reduce: 2x the bytes): not timed here; `detkit bench mlp` "
            "times it (invariant_vs_default_* in its report)",
        ]
        if missing:
            not_covered.insert(0, f"configs {missing}: their TP/CP groups are not held by world {list(layout.world)}")
        if len(session.hosts) == 1:
            not_covered.insert(0, f"inter-node groups: every rank ran on one host ({session.hosts[0]})")
        if session.pg_backend != "nccl":
            not_covered.insert(0, f"NCCL: process groups are {session.pg_backend} on {self.ctx.backend} (CPU emulation "
                                  "at tiny shapes): not a hardware result")
        if not layout.model.production:
            not_covered.insert(0, f"Qwen3-8B shapes: this run used {layout.model.label}")
        return {"covered": covered, "not_covered": not_covered, "invariance_configs": labels,
                "invariance_modes": list(MODES), "invariance_drift_table": table,
                "harness_collectives": dict(session.harness_collectives)}


# ---------------------------------------------------------------------------------------------
# Pair statistics
# ---------------------------------------------------------------------------------------------
def mismatched_bytes(x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes that differ between the raw representations of ``x`` and ``y``."""
    return int((x.contiguous().view(torch.uint8) != y.contiguous().view(torch.uint8)).sum())


def _ulp_rel(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ulp = (bf16_ordinal(x) - bf16_ordinal(y)).abs().double().reshape(-1)
    x64, y64 = x.double().reshape(-1), y.double().reshape(-1)
    nonzero = y64 != 0
    rel = torch.where(nonzero, (x64 - y64).abs() / y64.abs().clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    return ulp, rel


def pair_drift(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """max / p99 BF16 ULP distance and relative error |x - y| / |y| (y != 0) of two configs' results."""
    ulp, rel = _ulp_rel(x, y)
    return {"ulp_max": float(ulp.max()), "ulp_p99": merged_quantile(ulp, ulp.numel(), 0.99),
            "rel_max": float(rel.max()), "rel_p99": merged_quantile(rel, rel.numel(), 0.99)}


def tail_of(x: torch.Tensor, y: torch.Tensor, global_n: int) -> dict:
    """What a rank sends for the merged table: its element count, mismatches and its largest
    ``ceil(TAIL * global_n) + 1`` ULP and relative errors (enough for the global p99 and max)."""
    ulp, rel = _ulp_rel(x, y)
    k = min(ulp.numel(), math.ceil(TAIL * global_n) + 1)
    return {"n": ulp.numel(), "mismatches": compare_bits(x, y).mismatches, "mismatched_bytes": mismatched_bytes(x, y),
            "ulp": ulp.topk(k).values.cpu(), "rel": rel.topk(k).values.cpu()}


def merged_quantile(top: torch.Tensor, n: int, q: float) -> float:
    """detkit.toolkit.contract's quantile (the round(q*n)-th smallest of n values) from a superset of the
    largest n - round(q*n) + 1 of them."""
    if n == 0:
        return 0.0
    k = max(1, min(n, int(round(q * n))))
    from_top = n - k  # 0-based position from the largest
    ordered = top.sort(descending=True).values
    if from_top >= ordered.numel():
        raise ValueError(f"need the largest {from_top + 1} of {n} values; got {ordered.numel()}")
    return float(ordered[from_top])
