"""The 4-rank TP=2 x CP=2 validation (suite 'tp-cp'): the reduction operators under real groups.

Started as ranks (``torchrun --nproc-per-node 4 -m detkit audit --suite tp-cp`` or srun, see
docs/tp_cp.md), after ``toolkit.dist.setup_distributed`` built the TP and CP groups. Every rank
draws the same seeded global fixtures, cuts its own shards and runs

- forward: Gate/Up ColumnParallel GEMMs (local, both CP shards), Down ``row_parallel_fwd`` on its
  TP group;
- backward: Gate/Up ``column_parallel_dx`` on its TP group, Gate/Up and Down ``replicated_dw`` on
  its CP group, Down ``row_parallel_dhidden`` (local);

and checks, per tensor: the pre-reduce partial against det_gemm on the same operands (bitwise);
the post-reduce tensor against ``(p0.float() + p1.float()).bfloat16()`` of the partials gathered
from the group (bitwise) and against the process-group-free shard reference (bitwise); both
against the FP64 global oracle (contract bound, with max/p95/p99 drift), or bitwise on exact
fixtures; repeatability over N calls; the collectives each call issued, from the operators'
counters and from observing torch.distributed. A harness-only CP all_gather rebuilds the global
sequence with its row offsets checked. Rows are merged on rank 0 (``toolkit.dist.merge_rows``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import torch

from detkit.kernels.parallel import operators as parallel
from detkit.kernels.det_gemm.launch import det_gemm_fwd_launch
from detkit.toolkit.contract import check_bound, compare_bits, drift_stats, gemm_bound, reduced_bound
from detkit.toolkit.dist import DistSession, RankAudit, gather_group, observe_collectives, session_for_suite
from detkit.toolkit.harness import Row, RunContext
from detkit.toolkit.layout import CP_SIZE, AxisGroup
from detkit.toolkit.nvtx_ranges import nvtx_range
from detkit.toolkit.presets import GEMM_PRESETS
from detkit.toolkit.shard_refs import (
    FIXTURE_KINDS, SPECS, Fixtures, ShardedGemm, case_name, local_inputs, local_result, make_fixtures,
    operand, oracle, oracle_is_exact, reduce_v1, reduced_result, unsharded_result,
)

NAME = "tp_cp"
DESCRIPTION = "TP/CP reduction operators on real process groups: bitwise, contract, repeatability, collectives"

NOT_COVERED_V1 = (
    "TP groups across nodes (version 1 keeps TP intra-node)",
    "TP=4 / CP=4 or larger",
    "DP>1 or combined DP x CP gradient groups",
    "uneven shards",
    "bitwise equality across NCCL algorithms for more than two ranks",
    "a complete Qwen3 MLP: hidden and the gradients are independent fixtures (no SwiGLU operator yet)",
    "the dX sum over Gate and Up (four operands; no fixed order is defined in version 1)",
    "load-balanced (zigzag) CP token order: CP shards are contiguous halves of each sequence",
    "parallelism-invariance of reduced tensors (TP=1 vs TP=2 bits): a later mode",
    "NCCL algorithm/protocol sweep: run python -m tools.nccl_sweep (one process per setting)",
)


def run(ctx: RunContext) -> Iterator[Row]:
    session, refusal = session_for_suite(NAME, ctx.backend, (
        "'torchrun --nproc-per-node 4 --standalone -m detkit audit --suite tp-cp' (or "
        "'srun --distribution=block ... detkit audit --suite tp-cp', slurm/2x2.sh); "
        "'--suite tp-cp-refs' checks the shard references in one process"))
    if refusal is not None:
        yield refusal
        return
    yield from TpCpAudit(ctx, session).run()


class TpCpAudit(RankAudit):
    def __init__(self, ctx: RunContext, session: DistSession):
        super().__init__(ctx, session)
        self.reps = GEMM_PRESETS[ctx.preset].repetitions
        self.ran: set[str] = set()

    # ------------------------------------------------------------------------------ rows
    def row(self, check: str, name: str, passed: bool, /, **details) -> Row:
        base = {"layout_rank": self.me, "cp": self.cp, "tp": self.tp, "pg_backend": self.session.pg_backend}
        return Row(NAME, check, name, bool(passed), self.ctx.backend, {**base, **details})

    def bitwise(self, check: str, name: str, got: torch.Tensor, want: torch.Tensor, /, **details) -> Row:
        result = compare_bits(got, want)
        return self.row(check, name, result.equal, **details, **result.as_row())

    def where(self, group: AxisGroup | None) -> str:
        return f"rank {self.me} (cp{self.cp},tp{self.tp})" + (f" {group.label}" if group else "")

    # ------------------------------------------------------------------------------ run
    def run(self) -> Iterator[Row]:
        if self.session.rank == 0:
            yield self.placement_row()
        for kind in FIXTURE_KINDS:
            fx = make_fixtures(self.layout, self.ctx.seed, self.device, kind)
            loc = local_inputs(fx, self.me)
            outs: dict[str, torch.Tensor] = {}
            # forward track
            for proj in ("gate", "up"):
                spec = SPECS[f"{proj}_fwd"]
                x, w = loc["x"], loc[f"w_{proj}"]
                yield from self.local_case(spec, fx, lambda x=x, w=w: det_gemm_fwd_launch(x, w), outs)
            if self.groups.tp is not None:
                tp = self.groups.tp
                yield from self.reduction_case(
                    SPECS["down_fwd"], fx, tp,
                    lambda: parallel.row_parallel_fwd_launch(loc["hidden"], loc["w_down"], tp), outs)
                # backward track
                for proj in ("gate", "up"):
                    d, w = loc[f"d_{proj}"], loc[f"w_{proj}"]
                    yield from self.reduction_case(
                        SPECS[f"{proj}_dx"], fx, tp,
                        lambda d=d, w=w: parallel.column_parallel_dx_launch(d, w, tp), outs)
            if self.groups.cp is not None:
                cpg = self.groups.cp
                for spec_name, a, dc in (("gate_dw", "x", "d_gate"), ("up_dw", "x", "d_up"),
                                         ("down_dw", "hidden", "d_out")):
                    yield from self.reduction_case(
                        SPECS[spec_name], fx, cpg,
                        lambda a=loc[a], dc=loc[dc]: parallel.replicated_dw_launch(a, dc, cpg), outs)
            yield from self.local_case(
                SPECS["down_dhidden"], fx,
                lambda: parallel.row_parallel_dhidden_launch(loc["d_out"], loc["w_down"], layout=self.layout), outs)
            if self.groups.cp is not None:
                yield from self.rebuild_rows(fx, outs)
        self.session.add_meta(self.coverage())

    # ------------------------------------------------------------------------------ cases
    def observed_calls(self, name: str, call: Callable) -> tuple[list, Counter, dict, dict]:
        """Run ``call`` reps times; return (results, observed collectives, operator call and
        collective counter deltas)."""
        calls0, coll0 = parallel.operator_calls(), parallel.collective_counts()
        results = []
        with observe_collectives() as seen, nvtx_range(name):
            for _ in range(self.reps):
                results.append(call())
        calls1, coll1 = parallel.operator_calls(), parallel.collective_counts()
        d_calls = {k: v - calls0.get(k, 0) for k, v in calls1.items() if v != calls0.get(k, 0)}
        d_coll = {k: v - coll0.get(k, 0) for k, v in coll1.items() if v != coll0.get(k, 0)}
        return results, Counter(seen), d_calls, d_coll

    def repeat_row(self, name: str, tensors: dict[str, list[torch.Tensor]]) -> Row:
        worst, per_tensor = None, {}
        for label, outs in tensors.items():
            results = [compare_bits(o, outs[0]) for o in outs[1:]]
            per_tensor[f"{label}_equal"] = all(r.equal for r in results)
            for r in results:
                if worst is None or r.mismatches > worst.mismatches:
                    worst = r
        return self.row("repeatability", name, all(per_tensor.values()), repetitions=self.reps,
                        **per_tensor, **worst.as_row())

    def collectives_row(self, name: str, op: str | None, axis: str | None, seen: Counter,
                        d_calls: dict, d_coll: dict) -> Row:
        expected_coll = {f"{op}/all_reduce/{axis}": self.reps} if axis else {}
        expected_seen = {"all_reduce": self.reps} if axis else {}
        expected_calls = {op: self.reps} if op else {}
        ok = d_coll == expected_coll and dict(seen) == expected_seen and d_calls == expected_calls
        return self.row("collectives", name, ok, operator=op or "det_gemm (no operator)", calls=self.reps,
                        reported=d_coll, observed=dict(seen), expected=expected_coll or "none",
                        operator_calls=d_calls)

    def oracle_rows(self, check: str, name: str, spec: ShardedGemm, fx: Fixtures, c: torch.Tensor,
                    operands: tuple[torch.Tensor, torch.Tensor], bound_fn, prefix: str) -> Row:
        c_star, abs_ab = oracle(spec, *operands)
        if fx.kind == "exact":
            exact = oracle_is_exact(c_star)
            result = compare_bits(c, c_star.to(torch.bfloat16))
            return self.row(f"exact_{check}", name, result.equal and exact, oracle_exact=exact, **result.as_row())
        bound = bound_fn(c_star, abs_ab)
        result = check_bound(c, c_star, bound)
        return self.row(f"contract_{check}", name, result.passed, **result.as_row(),
                        **drift_stats(c, c_star, prefix, bound))

    def local_case(self, spec: ShardedGemm, fx: Fixtures, call: Callable, outs: dict) -> Iterator[Row]:
        name = case_name(spec, self.layout, self.where(None), fx.kind)
        results, seen, d_calls, d_coll = self.observed_calls(name, call)
        out = results[0][0]
        outs[spec.name] = out
        self.ran.add(spec.name)
        yield self.bitwise("tp1_equal", name, out, unsharded_result(spec, fx, self.me), kind=fx.kind,
                           note="TP=1, CP=1 det_gemm cut to this shard: the shard needs no reduction")
        k = spec.reduced_extent(self.layout, local=True)
        yield self.oracle_rows("local", name, spec, fx, out, spec.region_operands(fx, self.me),
                               lambda c_star, abs_ab: gemm_bound(c_star, abs_ab, k), "fp64")
        yield self.repeat_row(name, {"out": [r[0] for r in results]})
        op = "row_parallel_dhidden" if spec.name == "down_dhidden" else None
        yield self.collectives_row(name, op, None, seen, d_calls, d_coll)

    def reduction_case(self, spec: ShardedGemm, fx: Fixtures, group: AxisGroup, call: Callable,
                       outs: dict) -> Iterator[Row]:
        name = case_name(spec, self.layout, self.where(group), fx.kind)
        results, seen, d_calls, d_coll = self.observed_calls(name, call)
        partial, output, launch = results[0]
        outs[spec.name] = output
        self.ran.add(spec.name)
        info = {"kind": fx.kind, "operator": launch.op, "group": list(group.ranks), "pg_backend": launch.pg_backend,
                "collective_dtype": launch.collective_dtype, "config": launch.gemm.config.label()}
        # pre-reduce: the operator's partial is det_gemm of the same local operands
        yield self.bitwise("pre_reduce", name, partial, local_result(spec, fx, self.me)[0], **info)
        # post-reduce: the v1 oracle of the partials the group actually produced (harness all_gather)
        gathered = gather_group(partial, group, self.session)
        mine = compare_bits(gathered[group.ranks.index(self.me)], partial)
        post = compare_bits(output, reduce_v1(*gathered))
        yield self.row("post_reduce", name, post.equal and mine.equal, **info, own_partial_gathered=mine.equal,
                       oracle="(p0.float() + p1.float()).bfloat16(), group-rank order", **post.as_row())
        # the same without any process group: shard references computed here from the fixtures
        reference, _ = reduced_result(spec, fx, self.me)
        yield self.bitwise("group_free_reference", name, output, reference, **info)
        # the FP64 global oracle: partial (pre) and reduced (post)
        k_local = spec.reduced_extent(self.layout, local=True)
        partial_stars = [oracle(spec, *spec.local_operands(fx, r))[0] for r in group.ranks]
        partial_abs_sum = sum(p.abs() for p in partial_stars)
        yield self.oracle_rows("pre", name, spec, fx, partial, spec.local_operands(fx, self.me),
                               lambda c_star, abs_ab: gemm_bound(c_star, abs_ab, k_local), "pre_fp64")
        yield self.oracle_rows("post", name, spec, fx, output, spec.region_operands(fx, self.me),
                               lambda c_star, abs_ab: reduced_bound(c_star, partial_abs_sum, abs_ab, k_local),
                               "post_fp64")
        yield self.repeat_row(name, {"partial": [r[0] for r in results], "reduced": [r[1] for r in results]})
        yield self.collectives_row(name, launch.op, group.axis, seen, d_calls, d_coll)

    # ------------------------------------------------------------------------------ rebuild
    def rebuild_rows(self, fx: Fixtures, outs: dict) -> Iterator[Row]:
        """Harness-only CP all_gather: rebuild global-sequence tensors, offsets checked."""
        layout, cpg = self.layout, self.groups.cp
        name = f"cp_rebuild [M={layout.m}] {self.where(cpg)} {fx.kind}"
        idx = gather_group(layout.global_rows(self.cp, self.device), cpg, self.session)
        member_cps = [layout.coords(r)[0] for r in cpg.ranks]
        per_member = all(torch.equal(idx[i], layout.global_rows(c, self.device)) for i, c in enumerate(member_cps))
        ordered = member_cps == list(range(CP_SIZE))
        rebuilt_idx = layout.unshard_rows(idx) if ordered else None
        offsets_ok = per_member and ordered and torch.equal(rebuilt_idx, torch.arange(layout.m, device=self.device))
        yield self.row("cp_offsets", name, offsets_ok, member_cps=member_cps, rows_match_layout=per_member,
                       kind=fx.kind)
        if not offsets_ok:
            return
        # non-reduced shards: the rebuilt sequence equals the TP=1, CP=1 det_gemm's column shard
        for spec_name in ("gate_fwd", "down_dhidden"):
            spec = SPECS[spec_name]
            rebuilt = layout.unshard_rows(gather_group(outs[spec_name], cpg, self.session))
            full = det_gemm_full(spec, fx)[:, layout.i_shard(self.tp)]
            yield self.bitwise("cp_rebuild", f"{name} {spec_name}", rebuilt, full, kind=fx.kind)
        # TP-reduced Down output: the rebuilt sequence equals the group-free references of both CP shards
        if "down_fwd" in outs:
            spec = SPECS["down_fwd"]
            rebuilt = layout.unshard_rows(gather_group(outs["down_fwd"], cpg, self.session))
            refs = [reduced_result(spec, fx, layout.layout_rank(c, self.tp))[0] for c in range(CP_SIZE)]
            yield self.bitwise("cp_rebuild", f"{name} down_fwd", rebuilt, layout.unshard_rows(refs), kind=fx.kind)
            hidden, w_down = operand(fx, "hidden", None, None), operand(fx, "w_down", None, None)
            c_star, abs_ab = oracle(spec, hidden, w_down)
            partial_abs = sum(oracle(spec, operand(fx, "hidden", None, t), operand(fx, "w_down", None, t))[0].abs()
                              for t in range(layout.tp_size))
            if fx.kind == "exact":
                yield self.bitwise("exact_cp_rebuild", f"{name} down_fwd", rebuilt, c_star.to(torch.bfloat16))
            else:
                bound = reduced_bound(c_star, partial_abs, abs_ab, layout.i_local)
                result = check_bound(rebuilt, c_star, bound)
                yield self.row("contract_cp_rebuild", f"{name} down_fwd", result.passed, **result.as_row(),
                               **drift_stats(rebuilt, c_star, "global_fp64", bound))

    # ------------------------------------------------------------------------------ placement / meta
    def host_of(self, layout_rank: int) -> str:
        rec = self.session.rank_records[self.layout.process_rank(layout_rank)]
        return rec["hostname"]

    def placement_row(self) -> Row:
        tp_groups = [{"group": list(g), "hosts": sorted({self.host_of(r) for r in g})}
                     for g in self.layout.groups_present("tp")]
        cp_groups = [{"group": list(g), "hosts": sorted({self.host_of(r) for r in g})}
                     for g in self.layout.groups_present("cp")]
        tp_cross = [g["group"] for g in tp_groups if len(g["hosts"]) > 1]
        gpus = [(r["hostname"], r["pci_bus_id"]) for r in self.session.rank_records if r.get("pci_bus_id")]
        shared_gpu = len(gpus) != len(set(gpus))
        return self.row("placement", f"placement world {list(self.layout.world)}", not tp_cross and not shared_gpu,
                        tp_groups=tp_groups, cp_groups=cp_groups, tp_groups_across_nodes=tp_cross,
                        ranks_sharing_a_gpu=shared_gpu, hosts=self.session.hosts)

    def coverage(self) -> dict:
        layout, session = self.layout, self.session
        tp_present, cp_present = layout.groups_present("tp"), layout.groups_present("cp")
        covered = [
            f"layout {layout.model.label}: TP=2 x CP=2, rank = cp*2 + tp, world {list(layout.world)}, "
            f"B={layout.batch}, S={layout.seq_len}, M_local={layout.m_local}",
            f"kernel backend {self.ctx.backend}; process groups {session.pg_backend}; collective dtype bfloat16",
            "forward: Gate/Up ColumnParallel GEMMs on every rank (both CP shards), bitwise equal to the TP=1, "
            "CP=1 det_gemm",
            "backward: Down dHidden (row_parallel_dhidden) on every rank, zero collectives observed, bitwise "
            "equal to the TP=1 det_gemm (needs no reduction)",
        ]
        if tp_present:
            covered.append(f"forward: Down row_parallel_fwd (TP all_reduce) on TP groups "
                           f"{[list(g) for g in tp_present]}")
            covered.append(f"backward: Gate/Up column_parallel_dx (TP all_reduce) on TP groups "
                           f"{[list(g) for g in tp_present]}")
        if cp_present:
            covered.append(f"backward: Gate/Up and Down replicated_dw (CP all_reduce) on CP groups "
                           f"{[list(g) for g in cp_present]}")
            covered.append("harness-only CP all_gather rebuilds the global sequence; row offsets checked")
        covered += [
            "bitwise: pre-reduce partial == det_gemm of the same local operands; post-reduce == "
            "(p0.float() + p1.float()).bfloat16() of the gathered partials and == the process-group-free reference",
            "contract: every partial and reduced tensor within gemm_bound / reduced_bound of the FP64 global "
            "oracle (randn fixtures, max/p95/p99 drift recorded); exact fixtures bitwise equal to the FP64 oracle",
            f"repeatability: {self.reps} calls per operator, same bits",
            "collective counts: operator counters == torch.distributed calls observed (1 all_reduce per reducing "
            "call, 0 for dHidden)",
        ]
        for g in tp_present:
            covered.append(f"intra-node TP group {list(g)} on {sorted({self.host_of(r) for r in g})}")
        for g in cp_present:
            hosts = sorted({self.host_of(r) for r in g})
            if len(hosts) > 1:
                covered.append(f"inter-node CP group {list(g)} across hosts {hosts}")
        not_covered = list(NOT_COVERED_V1)
        if len(session.hosts) == 1:
            not_covered.insert(0, f"inter-node groups: every rank ran on one host ({session.hosts[0]}); "
                                  "this run covers no inter-node group")
        else:
            for g in cp_present:
                hosts = sorted({self.host_of(r) for r in g})
                if len(hosts) == 1:
                    not_covered.insert(0, f"CP group {list(g)} ran on one host ({hosts[0]}): not inter-node")
        missing_tp = [list(g) for g in layout.tp_groups if g not in tp_present]
        missing_cp = [list(g) for g in layout.cp_groups if g not in cp_present]
        if missing_tp:
            not_covered.insert(0, f"TP groups {missing_tp} (not held by world {list(layout.world)}): Down forward "
                                  "and Gate/Up dX reductions there")
        if missing_cp:
            not_covered.insert(0, f"CP groups {missing_cp} (not held by world {list(layout.world)}): dW reductions "
                                  "there" + ("" if cp_present else " and the CP rebuild"))
        if session.pg_backend != "nccl":
            not_covered.insert(0, f"NCCL: process groups are {session.pg_backend} and kernels run on "
                                  f"{self.ctx.backend} (CPU emulation at tiny shapes): not a hardware result")
        if not layout.model.production:
            not_covered.insert(0, f"Qwen3-8B shapes: this run used {layout.model.label}")
        return {
            "covered": covered,
            "not_covered": not_covered,
            "tp_cp_layout": layout.describe(),
            "collective_dtype": "torch.bfloat16",
            "repeatability": self.reps,
            "fixture_kinds": list(FIXTURE_KINDS),
            "harness_collectives": dict(session.harness_collectives),
            "specs_run": sorted(self.ran),
        }


def det_gemm_full(spec: ShardedGemm, fx: Fixtures) -> torch.Tensor:
    """TP=1, CP=1 det_gemm of a non-reduced spec over the global operands ([M, I])."""
    from detkit.kernels.det_gemm.launch import LAUNCHERS

    return LAUNCHERS[spec.op](operand(fx, spec.x_name, None, None), operand(fx, spec.y_name, None, None))[0]
