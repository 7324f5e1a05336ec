"""The composed Qwen3 MLP (kernels/parallel/mlp.py) forward and backward per TP/CP config and reduction mode,
against a cuBLAS + NCCL PyTorch baseline of the same math, same run, interleaved.

Launch (``toolkit.dist.setup_distributed`` builds the TP/CP groups; docs/invariance.md)::

    python -m detkit bench mlp --out DIR                                    # 1 GPU: TP1CP1
    DETKIT_TPCP_WORLD=0,1 torchrun --nproc-per-node 2 --standalone -m detkit bench mlp --out DIR  # + TP2CP1
    DETKIT_TPCP_WORLD=0,2 torchrun --nproc-per-node 2 --standalone -m detkit bench mlp --out DIR  # + TP1CP2
    torchrun --nproc-per-node 4 --standalone -m detkit bench mlp --out DIR  # all four configs

Configs: those whose groups the world holds (1 process: TP1CP1; world 0,1: TP1CP1, TP2CP1; world 0,2:
TP1CP1, TP1CP2; 4 ranks: all four), each run by every rank at once on its own shards (a degree-1
axis is computed redundantly, as the invariance audit does). Implementations per config:

- ``detkit bf16`` / ``detkit fp32_invariant``: ``DetQwen3MLP`` (``DetMlpFunction``) in that mode;
- ``torch bf16`` (the baseline): ``TorchQwen3MLP`` below -- the same math on the same shards and
  weight layout with ``torch.matmul`` GEMMs (cuBLAS on CUDA), torch's SwiGLU (``F.silu(g) * u``
  and the ops autograd runs for it, ``aten.silu_backward``) and ``torch.distributed.all_reduce``
  (BF16, in place) on the same TP and CP process groups.

Validated before timing, on every rank, against the FP64 MLP of the same global BF16 inputs
(``mlp_ref_fp64``) cut to the rank's local region: each detkit output (y, dX, dW_gate, dW_up, dW_down)
within the MLP contract (``mlp_bounds``); the baseline within ``BASELINE_REL_L2`` relative L2 error
of FP64 (a wiring check: torch rounds SwiGLU twice, so the contract is reported for it, not
required). The verdicts of all ranks are gathered before any timing; a config that failed on any
rank is not timed, and the run exits non-zero.

Timing: one step = ``y = mlp(x)``, ``y.backward(dy)`` through autograd, gradients reset to None
before it; forward, backward and total of the same step from three marks (CUDA events on the
current stream on CUDA; ``time.perf_counter`` on the CPU, where it is wall time of the Triton
interpreter, NOT a hardware result). One sample = ``iters`` back-to-back steps after a barrier of
the world, divided by ``iters`` (``toolkit.timing.phase_samples_ms``, whose phases are the spans
between a call's marks); each sample is the maximum over the ranks (a parallel step ends
when the slowest rank does). Rounds alternate the order of the implementations; warm-up steps are
excluded; no L2 flush (the operands of one step exceed H200's 50 MiB L2 at every GPU shape:
weights alone are >= 144 MiB per rank). Not ``do_bench`` (it picks its repetition count per
process, so ranks would issue different numbers of collectives) nor CUDA graphs (capturing NCCL
collectives in them is not verified). Reported: median, p20 and p80 over the rounds. Every row's name is also its NVTX range (around its validation,
``validate``, and each of its samples, ``time``, with ``fwd`` / ``bwd`` ranges inside each step).

Formulas (per rank, local shapes M_loc = M / CP, I_loc = I / TP):
    FLOPs forward  = 6 * M_loc * H * I_loc   (Gate|Up 4*M_loc*H*I_loc, Down 2*M_loc*I_loc*H)
    FLOPs backward = 12 * M_loc * H * I_loc  (dHidden 2, dX 4, dW_gate_up 4, dW_down 2)
    TFLOP/s = FLOPs / median time (CUDA only)
    invariant_vs_default_<phase> = detkit fp32_invariant median / detkit bf16 median (same config, M)
    default_vs_baseline_<phase>  = detkit bf16 median / torch bf16 median (same config, M)
Targets (reported, not asserted): invariant_vs_default_total <= 1.15, default_vs_baseline_total <= 1.10.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING

import click
import torch
import torch.nn.functional as F

from detkit.toolkit.layout import AxisGroup, TpCpLayout, layout_for_preset
from detkit.toolkit.nvtx_ranges import format_range_name, nvtx_range
from detkit.toolkit.reports import markdown_table
from detkit.toolkit.timing import Timing, phase_samples_ms

if TYPE_CHECKING:
    from detkit.kernels.parallel.mlp import MlpPlan

NAME = "mlp"
DESCRIPTION = "The Qwen3 MLP fwd+bwd per TP/CP config and mode vs torch.matmul + all_reduce (1, 2 or 4 ranks)."
RANKS = "ranks"
OPTIONS = (
    click.option("--tokens", "m_values", multiple=True, type=int,
                 help="Global tokens M = B*S (default 4096 and 16384; 12 on cpu)."),
    click.option("--seq-len", type=int, default=None, help="Tokens per sequence S; B = M / S (default 4096; 6 on cpu)."),
    click.option("--iters", type=int, default=None, help="Back-to-back steps per sample (default 5; 1 on cpu)."),
    click.option("--warmup", type=int, default=None, help="Untimed steps per implementation (default 3; 0 on cpu)."),
)
# kernels.invariant's modes, and audits.invariance's (tp, cp) configs: named here so that importing this
# plug-in imports no kernel (the CLI builds its options before --device selects the interpreter);
# tests/test_bench_mlp.py checks them against their sources.
BF16, FP32_INVARIANT = "bf16", "fp32_invariant"
MODES = (BF16, FP32_INVARIANT)
CONFIGS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (tp, cp)
TOKENS = (4096, 16384)  # global M = B*S on CUDA
SEQ_LEN = 4096
TINY_TOKENS = (12,)  # the tiny preset's B=2, S=6
TINY_SEQ_LEN = 6
TENSORS = ("y", "dx", "dw_gate", "dw_up", "dw_down")
PHASES = ("fwd", "bwd", "total")
TORCH, DETKIT = "torch", "detkit"
IMPLS = ((TORCH, BF16), (DETKIT, BF16), (DETKIT, FP32_INVARIANT))  # (impl, mode)
# Baseline wiring check: BF16 results a few roundings away from FP64 have relative L2 errors near
# 2^-8; a wrong weight, shard or missing reduction gives O(1).
BASELINE_REL_L2 = 2.0**-5
TARGET_INVARIANT_VS_DEFAULT = 1.15
TARGET_DEFAULT_VS_BASELINE = 1.10
INTERPRETER_LABEL = ("triton_interpreter: wall clock of CPU emulation at tiny shapes (detkit interpreted, torch "
                     "native); NOT a hardware result, ratios say nothing about GPU speed")


def row_name(config: str, impl: str, mode: str, m: int, h: int, i: int) -> str:
    """Row name and NVTX range: ``mlp TP2CP1 detkit fp32_invariant [M=4096, H=4096, I=12288] fwd+bwd``."""
    return format_range_name(f"mlp {config} {impl} {mode}", {"M": m, "H": h, "I": i}, "fwd+bwd")


def config_label(tp: int, cp: int) -> str:
    return f"TP{tp}CP{cp}"


def default_rounds(interpreted: bool) -> int:
    return 3 if interpreted else 10


@dataclass(frozen=True)
class MlpCase:
    name: str
    m: int
    seq_len: int
    tp: int
    cp: int
    impl: str
    mode: str
    iters: int
    warmup: int


def held_configs(preset: str, environ=None) -> list[tuple[int, int]]:
    """(tp, cp) of every config whose groups this launch's world holds, from the environment alone: one
    process holds TP1CP1; ranks hold the groups their layout world (DETKIT_TPCP_WORLD) holds."""
    from detkit.toolkit.dist import launched_as_ranks, world_from_env
    from detkit.toolkit.launch import RankEnv

    env = os.environ if environ is None else environ
    if not launched_as_ranks(env):
        return [(1, 1)]
    layout = layout_for_preset(preset, world_from_env(RankEnv.from_environ(env).world_size, env))
    tp, cp = bool(layout.groups_present("tp")), bool(layout.groups_present("cp"))
    return [(t, c) for t, c in CONFIGS if (t == 1 or tp) and (c == 1 or cp)]


def cases(ctx, m_values=(), seq_len: int | None = None, iters: int | None = None, warmup: int | None = None,
          environ=None) -> list[MlpCase]:
    """One case per (M, config held by this launch, implementation), checked before any work."""
    if iters is not None and iters < 1:
        raise ValueError(f"--iters must be >= 1; got {iters}")
    if warmup is not None and warmup < 0:
        raise ValueError(f"--warmup must be >= 0; got {warmup}")
    model = layout_for_preset(ctx.preset)
    h, i = model.model.hidden_size, model.model.intermediate_size
    iters = iters or (1 if ctx.interpreted else 5)
    warmup = warmup if warmup is not None else (0 if ctx.interpreted else 3)
    configs = held_configs(ctx.preset, environ)
    return [MlpCase(row_name(config_label(tp, cp), impl, mode, m, h, i), m, s, tp, cp, impl, mode, iters, warmup)
            for m, s in shapes(ctx.interpreted, tuple(m_values) or None, seq_len) for tp, cp in configs
            for impl, mode in IMPLS]


def flops(phase: str, m_loc: int, h: int, i_loc: int) -> float:
    per = {"fwd": 6.0, "bwd": 12.0, "total": 18.0}[phase]
    return per * m_loc * h * i_loc


def layout_for_tokens(model_layout: TpCpLayout, m: int, seq_len: int) -> TpCpLayout:
    """The layout of ``m`` global tokens in sequences of ``seq_len`` (B = m / seq_len), same model and world."""
    if m < 1 or seq_len < 1 or m % seq_len:
        raise ValueError(f"tokens M={m} is not a whole number of sequences of S={seq_len}; supported: M = B*S "
                         "with B >= 1 (--tokens, --seq-len)")
    return TpCpLayout(model_layout.model, m // seq_len, seq_len, model_layout.world)


def shapes(interpreted: bool, m_values=None, seq_len: int | None = None) -> list[tuple[int, int]]:
    """(M, S) pairs to run, checked before any work."""
    s = seq_len or (TINY_SEQ_LEN if interpreted else SEQ_LEN)
    out = [(m, s) for m in (m_values or (TINY_TOKENS if interpreted else TOKENS))]
    for m, s in out:
        if m < 1 or s < 2 or s % 2 or m % s:
            raise ValueError(f"tokens M={m}, seq_len S={s}: M must be B*S with B >= 1 and S even (CP splits S "
                             "in two)")
    return out


# ---------------------------------------------------------------------------------------------
# Session: toolkit.dist's TP/CP groups when launched as ranks, None in one process (TP1CP1)
# ---------------------------------------------------------------------------------------------
def start(ctx, out: Path | None = None):
    """The DistSession (every TP/CP group of the world) when started as ranks, else None. Refuses a
    world that cannot hold the layout, and NVLink multicast on CUDA, before any work."""
    from detkit.bench.comm import NVLS_ENV
    from detkit.toolkit import dist as tp_cp_dist

    if ctx.device.type == "cuda" and tp_cp_dist.launched_as_ranks():
        nvls = os.environ.get(NVLS_ENV)
        if nvls not in (None, "0"):
            raise ValueError(f"{NVLS_ENV}={nvls!r}; NVLink multicast must stay off on these hosts: set it to 0")
        os.environ[NVLS_ENV] = "0"  # NCCL reads it when the communicator is created, after this
    session = tp_cp_dist.setup_distributed(ctx, out)
    if session is not None and session.layout is None:
        tp_cp_dist.finish(session, False)
        raise ValueError(f"bench mlp: {session.layout_error}")
    return session


def finish(session, passed: bool) -> bool:
    """Every rank's verdict combined; destroys the process group (one process: ``passed``)."""
    from detkit.toolkit import dist as tp_cp_dist

    return tp_cp_dist.finish(session, passed)


def configs(session) -> list[tuple[int, int]]:
    """(tp, cp) of every config whose groups the session's world holds (TP1CP1 only in one process)."""
    if session is None:
        return [(1, 1)]
    groups = session.groups
    return [(tp, cp) for tp, cp in CONFIGS if (tp == 1 or groups.tp is not None) and (cp == 1 or groups.cp is not None)]


# ---------------------------------------------------------------------------------------------
# The baseline: the same math in plain torch, on the same shards and groups
# ---------------------------------------------------------------------------------------------
def torch_mlp_fwd(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, plan: MlpPlan):
    """``(y [M_loc, H], saved)``: torch.matmul, F.silu, a BF16 all_reduce over the TP group at TP=2."""
    from detkit.kernels.parallel.swiglu import gate_up_views

    gu = torch.matmul(x, w_gate_up.t())  # [M_loc, 2*I_loc], columns [gate I_t | up I_t] per held shard
    gate, up = gate_up_views(gu, plan.tp_shards)
    h = (F.silu(gate) * up).view(plan.m_loc, plan.i_loc)  # natural intermediate order
    y = torch.matmul(h, w_down.t())
    if plan.tp == 2:
        torch.distributed.all_reduce(y, group=plan.tp_group.group)
    return y, (x, w_gate_up, w_down, gu, h)


def torch_mlp_bwd(dy: torch.Tensor, saved: tuple, plan: MlpPlan):
    """``(dx, dW_gate_up, dW_down)``: the ops autograd runs for ``F.silu(g) * u``, written into one Gate|Up
    gradient buffer; BF16 all_reduces over the TP group (dX) and the CP group (both dW)."""
    import torch.distributed as dist

    from detkit.kernels.parallel.swiglu import gate_up_views

    x, w_gate_up, w_down, gu, h = saved
    dh = torch.matmul(dy, w_down).view(plan.m_loc * plan.tp_shards, plan.layout.i_local)
    gate, up = gate_up_views(gu, plan.tp_shards)
    dgu = torch.empty_like(gu)
    d_gate, d_up = gate_up_views(dgu, plan.tp_shards)
    torch.mul(dh, F.silu(gate), out=d_up)
    torch.ops.aten.silu_backward.grad_input(dh * up, gate, grad_input=d_gate)
    dx = torch.matmul(dgu, w_gate_up)
    if plan.tp == 2:
        dist.all_reduce(dx, group=plan.tp_group.group)
    dw_gate_up = torch.matmul(dgu.t(), x)
    dw_down = torch.matmul(dy.t(), h)
    if plan.cp == 2:
        dist.all_reduce(dw_gate_up, group=plan.cp_group.group)
        dist.all_reduce(dw_down, group=plan.cp_group.group)
    return dx, dw_gate_up, dw_down


class TorchMlpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, plan):
        y, saved = torch_mlp_fwd(x, w_gate_up, w_down, plan)
        ctx.plan = plan
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, dy):
        return (*torch_mlp_bwd(dy, ctx.saved_tensors, ctx.plan), None)


class TorchQwen3MLP(torch.nn.Module):
    """``DetQwen3MLP``'s parameters and plan, computed by ``TorchMlpFunction``."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, plan: MlpPlan):
        super().__init__()
        self.plan = plan
        self.w_gate_up = torch.nn.Parameter(w_gate_up)
        self.w_down = torch.nn.Parameter(w_down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TorchMlpFunction.apply(x, self.w_gate_up, self.w_down, self.plan)


# ---------------------------------------------------------------------------------------------
# One (M, config, impl) case on this rank
# ---------------------------------------------------------------------------------------------
@dataclass
class Built:
    """One implementation of one config, built on this rank: its module and its token shards."""

    name: str
    config: str
    impl: str
    mode: str
    plan: MlpPlan
    module: torch.nn.Module
    x: torch.Tensor  # [M_loc, H] leaf, requires grad
    dy: torch.Tensor  # [M_loc, H]

    def step(self, mark: Callable[[], None]) -> torch.Tensor:
        """One autograd forward + backward; ``mark`` before, between and after."""
        self.x.grad = None
        for p in self.module.parameters():
            p.grad = None
        mark()
        with nvtx_range("fwd"):
            y = self.module(self.x)
        mark()
        with nvtx_range("bwd"):
            y.backward(self.dy)
        mark()
        return y

    def outputs(self) -> dict[str, torch.Tensor]:
        from detkit.kernels.parallel.mlp import split_gate_up

        y = self.step(lambda: None)
        dw_gate, dw_up = split_gate_up(self.module.w_gate_up.grad, self.plan)
        return {"y": y.detach(), "dx": self.x.grad, "dw_gate": dw_gate, "dw_up": dw_up,
                "dw_down": self.module.w_down.grad}


def plan_for(session, layout: TpCpLayout, tp: int, cp: int, mode: str) -> MlpPlan:
    """This rank's plan; the session's process groups re-attached to ``layout`` (same model and world)."""
    from detkit.kernels.parallel.mlp import MlpPlan

    if session is None:
        return MlpPlan(layout, mode=mode)
    my_cp, my_tp = layout.coords(session.layout_rank)
    groups = {axis: (AxisGroup(layout, axis, g.ranks, g.group) if g is not None else None)
              for axis, g in (("tp", session.groups.tp), ("cp", session.groups.cp))}
    return MlpPlan(layout, tp, cp, my_tp if tp == 2 else 0, my_cp if cp == 2 else 0,
                   groups["tp"] if tp == 2 else None, groups["cp"] if cp == 2 else None, mode)


def build_cases(session, layout: TpCpLayout, tensors: dict[str, torch.Tensor], tp: int, cp: int) -> list[Built]:
    """The three implementations of one config on this rank, sharing its weight and token shards."""
    from detkit.kernels.parallel.mlp import DetQwen3MLP, shard_tokens, shard_weights

    h, i = layout.model.hidden_size, layout.model.intermediate_size
    cases = []
    for impl, mode in IMPLS:
        plan = plan_for(session, layout, tp, cp, mode)
        w_gate_up, w_down = shard_weights(tensors["w_gate"], tensors["w_up"], tensors["w_down"], plan)
        module = (TorchQwen3MLP if impl == TORCH else DetQwen3MLP)(w_gate_up, w_down, plan)
        cases.append(Built(row_name(plan.label, impl, mode, layout.m, h, i), plan.label, impl, mode, plan, module,
                          shard_tokens(tensors["x"], plan).detach().clone().requires_grad_(True),
                          shard_tokens(tensors["d_out"], plan)))
    return cases


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def local_region(tensor: str, t: torch.Tensor, plan: MlpPlan) -> torch.Tensor:
    """The part of a global tensor (reference, bound) that ``plan``'s rank computes."""
    layout = plan.layout
    if tensor in ("y", "dx"):  # [M, H]: the rank's CP rows
        return t.index_select(0, layout.global_rows(plan.cp_rank, t.device)) if plan.cp == 2 else t
    if tensor in ("dw_gate", "dw_up"):  # [I, H]: the rank's TP rows
        return t[layout.i_shard(plan.tp_rank)] if plan.tp == 2 else t
    return t[:, layout.i_shard(plan.tp_rank)] if plan.tp == 2 else t  # dw_down [H, I]


def validate(case: Built, ref: dict[str, torch.Tensor], bounds: dict[str, torch.Tensor]) -> dict:
    """One step of ``case`` against the FP64 reference cut to its region: the contract per tensor
    (required for detkit, reported for torch) and the relative L2 error (required <= BASELINE_REL_L2
    for torch)."""
    from detkit.toolkit.contract import check_bound, rel_l2

    with nvtx_range(case.name), nvtx_range("validate"):
        out = case.outputs()
    contract, rel = {}, {}
    for tensor in TENSORS:
        want = local_region(tensor, ref[tensor], case.plan)
        contract[tensor] = check_bound(out[tensor], want, local_region(tensor, bounds[tensor], case.plan))
        rel[tensor] = rel_l2(out[tensor], want)
    contract_passed = all(r.passed for r in contract.values())
    passed = contract_passed if case.impl == DETKIT else all(v <= BASELINE_REL_L2 for v in rel.values())
    return {
        "passed": passed,
        "validation": ("detkit: every output within the MLP contract (mlp_bounds) of FP64" if case.impl == DETKIT
                       else f"torch: relative L2 vs FP64 <= {BASELINE_REL_L2} for every output (contract reported)"),
        "contract_passed": contract_passed,
        "contract_worst_ratio": max(r.worst_ratio for r in contract.values()),
        "contract_violations": sum(r.violations for r in contract.values()),
        **{f"contract_worst_ratio_{t}": contract[t].worst_ratio for t in TENSORS},
        "rel_l2_max": max(rel.values()),
        **{f"rel_l2_{t}": rel[t] for t in TENSORS},
    }


def _gather(session, obj):
    """Every rank's ``obj`` in rank order (harness side, counted apart from the timed work)."""
    if session is None:
        return [obj]
    import torch.distributed as dist

    out = [None] * session.world_size
    dist.all_gather_object(out, obj)
    session.harness_collectives["all_gather_object/world"] += 1
    return out


def combine_validation(per_rank: list[dict], layout_ranks: list[int]) -> dict:
    """One case's verdict over all ranks: passed on every rank, worst ratios / errors over ranks."""
    first = per_rank[0]
    out = {"validated": all(v["passed"] for v in per_rank), "validation": first["validation"],
           "contract_passed": all(v["contract_passed"] for v in per_rank),
           "contract_violations": sum(v["contract_violations"] for v in per_rank)}
    for key in first:
        if key.startswith(("contract_worst_ratio", "rel_l2")):
            out[key] = max(v[key] for v in per_rank)
    out["validated_layout_ranks"] = [r for r, v in zip(layout_ranks, per_rank) if v["passed"]]
    return out


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def _barrier(session) -> None:
    if session is not None:
        import torch.distributed as dist

        dist.barrier()


def time_cases(session, cases: list[Built], device: torch.device, rounds: int, iters: int,
               warmup: int) -> dict[str, dict[str, Timing]]:
    """Interleaved rounds (order alternating) of every case; per sample the slowest rank's time. A sample
    (toolkit.timing.phase_samples_ms): ``iters`` back-to-back steps after a barrier of the world, fwd and bwd
    between the step's marks, each divided by ``iters``; total = fwd + bwd."""
    samples = phase_samples_ms({case.name: case.step for case in cases}, device, rounds, phases=2, passes=iters,
                               warmup=warmup, range_names={case.name: (case.name, "time") for case in cases},
                               before_sample=lambda: _barrier(session), alternate=True)
    local = torch.tensor([[[s[0] for s in samples[case.name]], [s[1] for s in samples[case.name]],
                           [s[0] + s[1] for s in samples[case.name]]] for case in cases],
                         dtype=torch.float64).reshape(len(cases), len(PHASES), rounds)  # [case, phase, round]
    if session is not None:  # one collective for all samples, after timing
        import torch.distributed as dist

        slowest = local.to(device) if session.pg_backend == "nccl" else local
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        local = slowest.cpu()
        session.harness_collectives["all_reduce/world"] += 1
    return {case.name: {phase: Timing.from_samples_ms(local[c, p].tolist()) for p, phase in enumerate(PHASES)}
            for c, case in enumerate(cases)}


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------
def _timing_fields(t: dict[str, Timing] | None) -> dict:
    out = {}
    for phase in PHASES:
        for f in ("median_us", "p20_us", "p80_us"):
            out[f"{phase}_{f}"] = getattr(t[phase], f) if t else None
    out["samples"] = t["total"].samples if t else 0
    return out


# Row (impl, mode) -> (ratio prefix, the (impl, mode) it is divided by, target of the total).
RATIOS = {
    (DETKIT, FP32_INVARIANT): ("invariant_vs_default", (DETKIT, BF16), TARGET_INVARIANT_VS_DEFAULT),
    (DETKIT, BF16): ("default_vs_baseline", (TORCH, BF16), TARGET_DEFAULT_VS_BASELINE),
}


def _ratios(rows: list[dict]) -> None:
    """invariant_vs_default_* on fp32_invariant rows, default_vs_baseline_* on detkit bf16 rows, from the
    medians of the same config and M (in place; None where a row or its timing is missing)."""
    by_key = {(r["M"], r["config"], r["impl"], r["mode"]): r for r in rows}
    for r in rows:
        r.update({f"{prefix}_{phase}": None for prefix, _, _ in RATIOS.values() for phase in PHASES})
        r.update(target=None, within_target=None)
        if (r["impl"], r["mode"]) not in RATIOS:
            continue
        prefix, (impl, mode), target = RATIOS[(r["impl"], r["mode"])]
        base = by_key.get((r["M"], r["config"], impl, mode))
        if base is None or r["total_median_us"] is None or base["total_median_us"] is None:
            continue
        for phase in PHASES:
            r[f"{prefix}_{phase}"] = r[f"{phase}_median_us"] / base[f"{phase}_median_us"]
        r["target"] = f"{prefix}_total <= {target}"
        r["within_target"] = r[f"{prefix}_total"] <= target


def run_shape(session, ctx, model_layout: TpCpLayout, m: int, seq_len: int, rounds: int, iters: int,
              warmup: int) -> list[dict]:
    """Validate every (config, impl) at M = m, then time each config's three implementations interleaved."""
    from detkit.kernels.parallel.mlp import mlp_bounds, mlp_ref_fp64
    from detkit.toolkit.shard_refs import make_fixtures

    layout = layout_for_tokens(model_layout, m, seq_len)
    h, i = layout.model.hidden_size, layout.model.intermediate_size
    device = session.device if session is not None else ctx.device
    fx = {n: t for n, t in make_fixtures(layout, ctx.seed, device, "randn").tensors.items()
          if n in ("x", "w_gate", "w_up", "w_down", "d_out")}  # the MLP's own; hidden / d_gate / d_up are not used
    layout_ranks = [0] if session is None else list(layout.world)
    with nvtx_range(f"reference [M={m}, H={h}, I={i}] fp64"):
        args = [fx[n] for n in ("x", "w_gate", "w_up", "w_down", "d_out")]
        ref = mlp_ref_fp64(*args)
        bounds = mlp_bounds(*args, ref)
    all_cases, checks = [], {}
    for tp, cp in configs(session):
        cases = build_cases(session, layout, fx, tp, cp)
        for case in cases:
            checks[case.name] = validate(case, ref, bounds)
        all_cases.append(cases)
    del ref, bounds, fx
    # Every rank's verdicts before any timing: all ranks then time (or skip) the same configs.
    gathered = _gather(session, checks)
    combined = {name: combine_validation([g[name] for g in gathered], layout_ranks) for name in checks}
    rows = []
    for cases in all_cases:
        ok = all(combined[c.name]["validated"] for c in cases)
        timings = time_cases(session, cases, device, rounds, iters, warmup) if ok else {}
        for c in cases:
            t = timings.get(c.name)
            plan = c.plan
            row = {
                "name": c.name, "config": c.config, "tp": plan.tp, "cp": plan.cp, "impl": c.impl, "mode": c.mode,
                "M": layout.m, "B": layout.batch, "S": layout.seq_len, "M_local": plan.m_loc, "H": h, "I": i,
                "I_local": plan.i_loc, "world_size": 1 if session is None else session.world_size,
                "layout_ranks": layout_ranks, "pg_backend": None if session is None else session.pg_backend,
                "backend": ctx.backend, "hardware_result": not ctx.interpreted,
                "clock": "wall clock (perf_counter), Triton interpreter" if ctx.interpreted
                else "CUDA events on the current stream",
                "rounds": rounds, "iters": iters, "warmup": warmup, "timed": ok,
                **combined[c.name], **_timing_fields(t),
            }
            for phase in PHASES:
                row[f"{phase}_tflops_per_rank"] = (
                    flops(phase, plan.m_loc, h, plan.i_loc) / (t[phase].median_us * 1e-6) / 1e12
                    if t and not ctx.interpreted else None)
            row["passed"] = bool(row["validated"])
            if not row["passed"]:
                row["failure"] = (f"validation failed before timing (not timed): {row['validation']}; worst contract "
                                  f"ratio {row['contract_worst_ratio']:.3g}, relative L2 {row['rel_l2_max']:.3g}, "
                                  f"valid on layout ranks {row['validated_layout_ranks']}")
            elif not ok:
                row["failure"] = "not timed: another implementation of its config failed validation"
            rows.append(row)
    _ratios(rows)
    return rows


def run(ctx, cases: list[MlpCase], session, **options) -> Iterator[dict]:
    """Per M: validate every held (config, impl) on every rank, then time each config interleaved."""
    model_layout = session.layout if session is not None else layout_for_preset(ctx.preset)
    held = configs(session)
    planned = list(dict.fromkeys((c.tp, c.cp) for c in cases))
    if planned != held:
        raise RuntimeError(f"the launch's environment gave configs {planned} but the process group holds {held}")
    for (m, seq_len), group in groupby(cases, key=lambda c: (c.m, c.seq_len)):
        group = list(group)
        rows = {r["name"]: r for r in run_shape(session, ctx, model_layout, m, seq_len, ctx.rounds,
                                                  group[0].iters, group[0].warmup)}
        yield from (rows[c.name] for c in group)


def describe(ctx, cases, rows, session) -> dict:
    from detkit.kernels.parallel.invariant import INVARIANT_CONFIG_TABLE_VERSION

    model_layout = session.layout if session is not None else layout_for_preset(ctx.preset)
    held = [config_label(tp, cp) for tp, cp in configs(session)]
    missing = [config_label(tp, cp) for tp, cp in CONFIGS if config_label(tp, cp) not in held]
    not_covered = []
    if missing:
        not_covered.append(f"configs {missing}: their TP/CP groups are not held by this world "
                           f"({'one process' if session is None else list(session.layout.world)})")
    if session is None or len(session.hosts) <= 1:
        not_covered.append("inter-node groups: one host (in the 2x2 layout the CP groups span nodes)")
    if ctx.interpreted:
        not_covered.append("GPU speed: " + INTERPRETER_LABEL)
    meta = {
        "model": model_layout.model.label,
        "world_size": 1 if session is None else session.world_size,
        "world": "one process" if session is None else list(session.layout.world),
        "pg_backend": None if session is None else session.pg_backend,
        "hosts": ["this host"] if session is None else session.hosts,
        "configs": held, "modes": list(MODES),
        "invariant_config_table_version": INVARIANT_CONFIG_TABLE_VERSION,
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE") if ctx.device.type == "cuda" else None,
        "baseline": "torch.matmul (cuBLAS on CUDA) + F.silu / aten.silu_backward + torch.distributed.all_reduce "
                    "(BF16, in place) on the same TP/CP groups and shards",
        "validation": f"detkit: within mlp_bounds of the FP64 MLP (every rank, every output); torch: relative L2 "
                      f"<= {BASELINE_REL_L2} vs FP64; all ranks agree before timing",
        "timing": ("one step = autograd forward + backward, grads reset; fwd/bwd/total from marks in the same "
                   "step (CUDA events / perf_counter); sample = iters steps after a world barrier / iters, max over "
                   "ranks; median, p20, p80 over rounds; order alternates; warm-up excluded; no L2 flush"),
        "formulas": "FLOPs per rank fwd 6*M_loc*H*I_loc, bwd 12*M_loc*H*I_loc; TFLOP/s = FLOPs / median",
        "targets": (f"invariant_vs_default_total <= {TARGET_INVARIANT_VS_DEFAULT}, default_vs_baseline_total <= "
                    f"{TARGET_DEFAULT_VS_BASELINE} (reported, not asserted)"),
        "not_covered": not_covered,
    }
    if ctx.interpreted:
        meta["note"] = INTERPRETER_LABEL
    if session is not None:
        meta["rank_map"] = session.rank_records
    return meta


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------
def target_summary(rows: list[dict]) -> list[dict]:
    """Per (M, config): the two total-time ratios beside their targets."""
    out = []
    for (m, config) in dict.fromkeys((r["M"], r["config"]) for r in rows):
        sel = {(r["impl"], r["mode"]): r for r in rows if r["M"] == m and r["config"] == config}
        inv = sel.get((DETKIT, FP32_INVARIANT), {}).get("invariant_vs_default_total")
        dflt = sel.get((DETKIT, BF16), {}).get("default_vs_baseline_total")
        out.append({"M": m, "config": config,
                    "invariant_vs_default": inv, f"<= {TARGET_INVARIANT_VS_DEFAULT}":
                        None if inv is None else inv <= TARGET_INVARIANT_VS_DEFAULT,
                    "default_vs_baseline": dflt, f"<= {TARGET_DEFAULT_VS_BASELINE}":
                        None if dflt is None else dflt <= TARGET_DEFAULT_VS_BASELINE})
    return out


def plots(out_dir: Path, rows: list[dict]) -> list[Path]:
    """Time per step vs M per (config, impl, mode): hardware runs with timed rows only."""
    timed = [r for r in rows if r["timed"]]
    if not timed or not all(r["hardware_result"] for r in timed):
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from detkit.toolkit.reports import save_figure, style_log2_axes

    styles = {IMPLS[0]: ("--", "s"), IMPLS[1]: ("-", "o"), IMPLS[2]: (":", "^")}  # colour = config
    colours = {config_label(tp, cp): f"C{n}" for n, (tp, cp) in enumerate(CONFIGS)}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config, impl, mode in dict.fromkeys((r["config"], r["impl"], r["mode"]) for r in timed):
        sel = sorted((r for r in timed if (r["config"], r["impl"], r["mode"]) == (config, impl, mode)),
                     key=lambda r: r["M"])
        linestyle, marker = styles[(impl, mode)]
        ax.plot([r["M"] for r in sel], [r["total_median_us"] / 1e3 for r in sel], color=colours[config],
                linestyle=linestyle, marker=marker, label=f"{config} {impl} {mode}")
    style_log2_axes(ax, "Qwen3 MLP forward + backward per rank", "tokens M = B*S", "time per step (ms)")
    path = Path(out_dir) / "mlp_time.png"
    save_figure(fig, path)
    plt.close(fig)
    return [path]


def summarize(rows: list[dict], meta: dict) -> str:
    lines = [f"- {key}: {meta[key]}" for key in ("model", "world_size", "world", "pg_backend", "configs", "modes",
                                                 "invariant_config_table_version", "baseline", "validation", "timing",
                                                 "formulas", "targets") if meta.get(key) is not None]
    cols = ["config", "impl", "mode", "M", "M_local", "validated", "contract_worst_ratio", "fwd_median_us",
            "bwd_median_us", "total_median_us", "total_p20_us", "total_p80_us", "invariant_vs_default_total",
            "default_vs_baseline_total", "total_tflops_per_rank"]
    lines += ["", "## Per (config, implementation, mode)", "", markdown_table(rows, cols), "",
              "## Targets (total time; reported, not asserted)", "",
              markdown_table(target_summary(rows), list(target_summary(rows)[0]) if rows else ()), ""]
    return "\n".join(lines)
