"""kernels/parallel/operators.py: the TP/CP operators on real process groups, their collective counts and every
fail-closed path.

The multi-rank tests start their own ranks: ``torchrun`` runs this file as a script (``worker``), one
process per rank, and each rank runs every check in ``CHECKS`` and writes its verdicts to a JSON file
that the pytest side reads, one test per check. On the CPU: 4 ranks, gloo, the Triton interpreter and
the tiny layout. On 2 GPUs (``multigpu``): NCCL at the Qwen3-8B shapes, once on one TP group
(world 0,1) and once on one CP group (world 0,2).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from detkit.kernels.parallel import operators as parallel
from detkit.kernels.parallel.operators import (
    check_collective_backend, column_parallel_dx, replicated_dw, row_parallel_dhidden, row_parallel_fwd,
)
from detkit.toolkit.contract import compare_bits
from detkit.toolkit.layout import AxisGroup, TpCpLayout, layout_for_preset
from detkit.toolkit.shard_refs import (
    SPECS, Fixtures, LocalInputs, local_inputs, local_result, make_fixtures, oracle, reduced_result,
    unsharded_result,
)

REPO = Path(__file__).resolve().parents[1]
SEED = 1234
CPU_TIMEOUT_S = 240
# tests/conftest.py: cpu (Triton interpreter, the default) or cuda (DETKIT_TEST_DEVICE=cuda)
DEVICE = torch.device(os.environ.get("DETKIT_TEST_DEVICE", "cpu"))


# =============================================================================================
# Worker side: runs under torchrun, one process per rank
# =============================================================================================
class Skip(Exception):
    """The check does not apply to this world (its group is not held)."""


@dataclass
class Ctx:
    layout: TpCpLayout
    groups: object  # toolkit.dist.Groups
    rank: int
    me: int
    device: torch.device
    fx: dict[str, Fixtures]
    loc: dict[str, LocalInputs]

    def tp(self) -> AxisGroup:
        if self.groups.tp is None:
            raise Skip(f"world {self.layout.world} holds no TP group")
        return self.groups.tp

    def cp(self) -> AxisGroup:
        if self.groups.cp is None:
            raise Skip(f"world {self.layout.world} holds no CP group")
        return self.groups.cp


CHECKS: dict[str, Callable[[Ctx], None]] = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """tests/conftest.py's assert_bits_equal for the ranks, which run this file outside pytest: importing conftest
    there would switch the Triton interpreter on for the NCCL ranks too."""
    result = compare_bits(got, want)
    if not result.equal:
        raise AssertionError(f"{what}: {result.mismatches}/{result.elements} elements differ, "
                             f"first at {result.first_mismatch}")


class _LaunchCounter:
    """Counts det_gemm launches made through kernels.parallel (to prove refusals do no work)."""

    NAMES = ("det_gemm_fwd_launch", "det_gemm_da_launch", "det_gemm_db_launch")

    def __enter__(self):
        self.count = 0
        self.saved = {n: getattr(parallel, n) for n in self.NAMES}
        for n, fn in self.saved.items():
            def wrapper(*a, _fn=fn, **k):
                self.count += 1
                return _fn(*a, **k)
            setattr(parallel, n, wrapper)
        return self

    def __exit__(self, *exc):
        for n, fn in self.saved.items():
            setattr(parallel, n, fn)
        return False


def refuses(call: Callable[[], object], exc_type: type[Exception], pattern: str) -> None:
    """``call`` raises ``exc_type`` matching ``pattern`` before any GEMM or collective."""
    from detkit.toolkit.dist import observe_collectives

    collectives_before = parallel.collective_counts()
    with _LaunchCounter() as launches, observe_collectives() as seen:
        try:
            call()
        except exc_type as exc:
            if not re.search(pattern, str(exc)):
                raise AssertionError(f"{exc_type.__name__} message {str(exc)!r} does not match {pattern!r}") from exc
        else:
            raise AssertionError(f"expected {exc_type.__name__} matching {pattern!r}; nothing was raised")
    if launches.count or sum(seen.values()) or parallel.collective_counts() != collectives_before:
        raise AssertionError(f"work was done before refusing: {launches.count} GEMM launches, "
                             f"collectives observed {dict(seen)}")


# ---------------------------------------------------------------------------- groups
@check
def groups_are_the_layouts(ctx: Ctx) -> None:
    import torch.distributed as dist

    from detkit.toolkit.dist import attach_group

    want = {"tp": [list(g) for g in ctx.layout.groups_present("tp")],
            "cp": [list(g) for g in ctx.layout.groups_present("cp")]}
    assert ctx.groups.membership() == want, (ctx.groups.membership(), want)
    for handle in (ctx.groups.tp, ctx.groups.cp):
        if handle is None:
            continue
        assert ctx.me in handle.ranks
        assert tuple(dist.get_process_group_ranks(handle.group)) == handle.process_ranks
        assert attach_group(handle.group, handle.axis, ctx.layout) == handle
    if ctx.groups.cp is not None:
        try:
            attach_group(ctx.groups.cp.group, "tp", ctx.layout)
        except ValueError as exc:
            assert "is not a TP group" in str(exc)
        else:
            raise AssertionError("attach_group accepted a CP group as a TP group")


# ---------------------------------------------------------------------------- operators vs references
@check
def row_parallel_fwd_matches_references(ctx: Ctx) -> None:
    tp = ctx.tp()
    spec = SPECS["down_fwd"]
    for kind, loc in ctx.loc.items():
        partial, output = row_parallel_fwd(loc["hidden"], loc["w_down"], tp)
        bits_equal(partial, local_result(spec, ctx.fx[kind], ctx.me)[0], f"{kind} partial")
        reference, _ = reduced_result(spec, ctx.fx[kind], ctx.me)
        bits_equal(output, reference, f"{kind} output vs group-free reference")
        assert output.data_ptr() != partial.data_ptr(), "output must be a new tensor"
        if kind == "exact":
            c_star, _ = oracle(spec, *spec.region_operands(ctx.fx[kind], ctx.me))
            bits_equal(output, c_star.to(torch.bfloat16), "exact output vs FP64 oracle")


@check
def column_parallel_dx_matches_references(ctx: Ctx) -> None:
    tp = ctx.tp()
    for proj in ("gate", "up"):
        spec = SPECS[f"{proj}_dx"]
        for kind, loc in ctx.loc.items():
            partial, dx = column_parallel_dx(loc[f"d_{proj}"], loc[f"w_{proj}"], tp)
            bits_equal(partial, local_result(spec, ctx.fx[kind], ctx.me)[0], f"{proj} {kind} partial")
            bits_equal(dx, reduced_result(spec, ctx.fx[kind], ctx.me)[0], f"{proj} {kind} dx")
            if kind == "exact":
                c_star, _ = oracle(spec, *spec.region_operands(ctx.fx[kind], ctx.me))
                bits_equal(dx, c_star.to(torch.bfloat16), f"{proj} exact dx vs FP64 oracle")


@check
def replicated_dw_matches_references(ctx: Ctx) -> None:
    cp = ctx.cp()
    for name, a, dc in (("gate_dw", "x", "d_gate"), ("up_dw", "x", "d_up"), ("down_dw", "hidden", "d_out")):
        spec = SPECS[name]
        for kind, loc in ctx.loc.items():
            local, reduced = replicated_dw(loc[a], loc[dc], cp)
            bits_equal(local, local_result(spec, ctx.fx[kind], ctx.me)[0], f"{name} {kind} local")
            bits_equal(reduced, reduced_result(spec, ctx.fx[kind], ctx.me)[0], f"{name} {kind} reduced")
            if kind == "exact":
                c_star, _ = oracle(spec, *spec.region_operands(ctx.fx[kind], ctx.me))
                bits_equal(reduced, c_star.to(torch.bfloat16), f"{name} exact reduced vs FP64 oracle")


@check
def row_parallel_dhidden_needs_no_reduction(ctx: Ctx) -> None:
    spec = SPECS["down_dhidden"]
    for kind, loc in ctx.loc.items():
        d_hidden = row_parallel_dhidden(loc["d_out"], loc["w_down"], layout=ctx.layout)
        bits_equal(d_hidden, row_parallel_dhidden(loc["d_out"], loc["w_down"]), f"{kind} with/without layout")
        bits_equal(d_hidden, unsharded_result(spec, ctx.fx[kind], ctx.me), f"{kind} vs TP=1 det_gemm shard")


@check
def partial_is_returned_untouched(ctx: Ctx) -> None:
    tp = ctx.tp()
    loc = ctx.loc["randn"]
    partial, output = row_parallel_fwd(loc["hidden"], loc["w_down"], tp)
    again, _ = row_parallel_fwd(loc["hidden"], loc["w_down"], tp)
    bits_equal(partial, again, "partial after its all_reduce")
    if compare_bits(partial, output).equal:
        raise AssertionError("the reduced output equals the partial: the all_reduce did not run")


# ---------------------------------------------------------------------------- collective counts
@check
def collective_counts_per_operator(ctx: Ctx) -> None:
    from detkit.toolkit.dist import observe_collectives

    loc = ctx.loc["randn"]
    calls = []
    if ctx.groups.tp is not None:
        calls += [("row_parallel_fwd", "tp", lambda: row_parallel_fwd(loc["hidden"], loc["w_down"], ctx.groups.tp)),
                  ("column_parallel_dx", "tp", lambda: column_parallel_dx(loc["d_gate"], loc["w_gate"], ctx.groups.tp))]
    if ctx.groups.cp is not None:
        calls += [("replicated_dw", "cp", lambda: replicated_dw(loc["x"], loc["d_gate"], ctx.groups.cp))]
    calls += [("row_parallel_dhidden", None, lambda: row_parallel_dhidden(loc["d_out"], loc["w_down"]))]
    for op, axis, call in calls:
        parallel.reset_counts()
        with observe_collectives() as seen:
            call()
        want = {f"{op}/all_reduce/{axis}": 1} if axis else {}
        assert parallel.collective_counts() == want, (op, parallel.collective_counts())
        assert dict(seen) == ({"all_reduce": 1} if axis else {}), (op, dict(seen))
        assert parallel.operator_calls() == {op: 1}, (op, parallel.operator_calls())


@check
def dhidden_runs_with_every_collective_disabled(ctx: Ctx) -> None:
    import torch.distributed as dist

    from detkit.toolkit.dist import COLLECTIVE_FUNCTIONS

    def forbidden(*args, **kwargs):
        raise AssertionError("row_parallel_dhidden called a collective")

    saved = {n: getattr(dist, n) for n in COLLECTIVE_FUNCTIONS if hasattr(dist, n)}
    try:
        for n in saved:
            setattr(dist, n, forbidden)
        loc = ctx.loc["randn"]
        row_parallel_dhidden(loc["d_out"], loc["w_down"], layout=ctx.layout)
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


# ---------------------------------------------------------------------------- fail closed
@check
def refuses_wrong_dtype(ctx: Ctx) -> None:
    loc = ctx.loc["randn"]
    group = ctx.groups.tp or ctx.groups.cp
    refuses(lambda: row_parallel_fwd(loc["hidden"].float(), loc["w_down"], group), TypeError,
            r"hidden_local has dtype torch.float32; supported: torch.bfloat16")
    refuses(lambda: replicated_dw(loc["x"], loc["d_gate"].half(), group), TypeError,
            r"dc_local has dtype torch.float16; supported: torch.bfloat16")
    refuses(lambda: row_parallel_dhidden(loc["d_out"], loc["w_down"].float()), TypeError,
            r"w_local has dtype torch.float32")


@check
def refuses_non_matrix(ctx: Ctx) -> None:
    loc = ctx.loc["randn"]
    group = ctx.groups.tp or ctx.groups.cp
    refuses(lambda: column_parallel_dx(loc["d_gate"][None], loc["w_gate"], group), ValueError,
            r"d_proj_local must be 2-D; got shape \(1, ")
    refuses(lambda: row_parallel_fwd(loc["hidden"], "w", group), TypeError,
            r"w_local must be a torch.Tensor; got str")


@check
def refuses_unconfigured_shapes(ctx: Ctx) -> None:
    loc = ctx.loc["randn"]
    ml, il, h = ctx.layout.m_local, ctx.layout.i_local, ctx.layout.model.hidden_size
    extra = torch.zeros(1, il, dtype=torch.bfloat16, device=ctx.device)
    longer = torch.cat([loc["hidden"], extra])
    if ctx.groups.tp is not None:
        tp = ctx.groups.tp
        refuses(lambda: row_parallel_fwd(longer, loc["w_down"], tp), ValueError,
                rf"hidden_local has shape \({ml + 1}, {il}\); the configured local shapes .* are "
                rf"hidden_local \({ml}, {il}\), w_local \({il}, {h}\)")
        # the full (TP=1) weight is not a local shard
        refuses(lambda: column_parallel_dx(loc["d_gate"], ctx.fx["randn"].weight_kn("w_gate"), tp), ValueError,
                rf"w_local has shape \({h}, {2 * il}\)")
    if ctx.groups.cp is not None:
        cp = ctx.groups.cp
        refuses(lambda: replicated_dw(loc["x"], loc["d_out"], cp), ValueError,
                r"a_local .* dc_local .* are not configured local shapes .* Gate/Up \(x, dProj\)")
        refuses(lambda: replicated_dw(longer, torch.cat([loc["d_out"], loc["d_out"][:1]]), cp), ValueError,
                r"not configured local shapes")
    refuses(lambda: row_parallel_dhidden(loc["d_out"], loc["w_down"][:, :-1], layout=ctx.layout), ValueError,
            rf"w_local has shape \({il}, {h - 1}\)")
    refuses(lambda: row_parallel_dhidden(loc["d_out"], loc["w_down"], layout="tiny"), TypeError,
            r"layout is a str; supported: kernels.layout.TpCpLayout or None")


@check
def refuses_a_raw_process_group(ctx: Ctx) -> None:
    loc = ctx.loc["randn"]
    pg = (ctx.groups.tp or ctx.groups.cp).group
    refuses(lambda: row_parallel_fwd(loc["hidden"], loc["w_down"], pg), TypeError,
            r"group is a \w+; supported: kernels.layout.AxisGroup")
    refuses(lambda: replicated_dw(loc["x"], loc["d_gate"], None), TypeError, r"group is a NoneType")


@check
def refuses_the_wrong_axis(ctx: Ctx) -> None:
    loc = ctx.loc["randn"]
    if ctx.groups.cp is not None:
        cp = ctx.groups.cp
        refuses(lambda: row_parallel_fwd(loc["hidden"], loc["w_down"], cp), ValueError,
                rf"got a CP group \[{cp.ranks[0]}, {cp.ranks[1]}\]; supported: a TP group")
        refuses(lambda: column_parallel_dx(loc["d_gate"], loc["w_gate"], cp), ValueError, r"supported: a TP group")
    if ctx.groups.tp is not None:
        tp = ctx.groups.tp
        refuses(lambda: replicated_dw(loc["x"], loc["d_gate"], tp), ValueError,
                r"got a TP group .*; supported: a CP group")


@check
def refuses_another_ranks_group(ctx: Ctx) -> None:
    loc = ctx.loc["randn"]
    foreign = [h for (axis, ranks), h in ctx.groups.handles.items() if ctx.me not in ranks]
    if not foreign:
        raise Skip(f"world {ctx.layout.world} has no group this rank is outside of")
    for handle in foreign:
        own = ctx.layout.group_of(handle.axis, ctx.me)
        call = (lambda h=handle: row_parallel_fwd(loc["hidden"], loc["w_down"], h)) if handle.axis == "tp" \
            else (lambda h=handle: replicated_dw(loc["x"], loc["d_gate"], h))
        refuses(call, ValueError,
                rf"layout rank {ctx.me}\) got {handle.axis.upper()} group \[{handle.ranks[0]}, {handle.ranks[1]}\]; "
                rf"its {handle.axis.upper()} group in the layout is \[{own[0]}, {own[1]}\]")


@check
def refuses_a_group_of_the_wrong_size(ctx: Ctx) -> None:
    import torch.distributed as dist

    loc = ctx.loc["randn"]
    if ctx.layout.world_size == 2:
        raise Skip("the world group has 2 ranks here")
    tp = ctx.tp()
    wrong = AxisGroup(ctx.layout, "tp", tp.ranks, dist.group.WORLD)
    refuses(lambda: row_parallel_fwd(loc["hidden"], loc["w_down"], wrong), ValueError,
            r"the TP\[\d, \d\] process group has 4 ranks; supported: 2")


@check
def refuses_a_forged_handle(ctx: Ctx) -> None:
    loc = ctx.loc["randn"]
    tp, cp = ctx.tp(), ctx.cp()
    forged = AxisGroup(ctx.layout, "tp", tp.ranks, cp.group)  # right label, CP's process group
    refuses(lambda: row_parallel_fwd(loc["hidden"], loc["w_down"], forged), ValueError,
            rf"the process group holds process ranks \[{cp.process_ranks[0]}, {cp.process_ranks[1]}\] but the "
            rf"TP\[{tp.ranks[0]}, {tp.ranks[1]}\] handle says")


@check
def refuses_a_layout_of_another_world(ctx: Ctx) -> None:
    loc = ctx.loc["randn"]
    if ctx.layout.world_size != 4:
        raise Skip("needs the 4-rank world")
    tp = ctx.tp()
    other = TpCpLayout(ctx.layout.model, ctx.layout.batch, ctx.layout.seq_len, (0, 1))
    handle = AxisGroup(other, "tp", (0, 1), tp.group)
    refuses(lambda: row_parallel_fwd(loc["hidden"], loc["w_down"], handle), ValueError,
            r"the default process group has 4 ranks but the layout's world \(0, 1\) has 2")


@check
def refuses_unsupported_devices(ctx: Ctx) -> None:
    loc = ctx.loc["randn"]
    group = ctx.groups.tp or ctx.groups.cp
    h, w = loc["hidden"], loc["w_down"]
    if group.axis == "tp":
        refuses(lambda: row_parallel_fwd(h.to("meta"), w.to("meta"), group), NotImplementedError,
                r"device type 'meta' is not supported")
        refuses(lambda: row_parallel_fwd(h, w.to("meta"), group), ValueError, r"all tensors must be on one device")
    else:
        refuses(lambda: replicated_dw(loc["x"].to("meta"), loc["d_gate"].to("meta"), group), NotImplementedError,
                r"device type 'meta' is not supported")
    if ctx.device.type == "cuda" and torch.cuda.device_count() > 1 and group.axis == "tp":
        other = (ctx.device.index + 1) % torch.cuda.device_count()
        refuses(lambda: row_parallel_fwd(h.to(other), w.to(other), group), ValueError,
                rf"tensors are on cuda:{other} but the current CUDA device is cuda:{ctx.device.index}")


@check
def refuses_gloo_with_cuda_tensors(ctx: Ctx) -> None:
    """On GPUs: a gloo group carrying CUDA tensors is refused (NCCL is required)."""
    import torch.distributed as dist

    if ctx.device.type != "cuda":
        raise Skip("gloo is the right backend for CPU tensors; the pairing is checked in-process")
    # every rank creates the gloo twins of every present group, in the same order
    twins = {}
    for (axis, ranks), handle in ctx.groups.handles.items():
        twins[(axis, ranks)] = AxisGroup(ctx.layout, axis, ranks,
                                         dist.new_group(list(handle.process_ranks), backend="gloo"))
    loc = ctx.loc["randn"]
    mine = [h for (axis, ranks), h in twins.items() if ctx.me in ranks]
    for handle in mine:
        call = (lambda h=handle: row_parallel_fwd(loc["hidden"], loc["w_down"], h)) if handle.axis == "tp" \
            else (lambda h=handle: replicated_dw(loc["x"], loc["d_gate"], h))
        refuses(call, NotImplementedError, r"process-group backend 'gloo' with CUDA tensors .* supported: 'nccl'")


# ---------------------------------------------------------------------------- worker entry point
def worker(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from detkit.toolkit.dist import build_groups, world_from_env
    from detkit.toolkit.launch import RankEnv, init_process_group

    rank_env = RankEnv.from_environ()
    init_process_group(rank_env, args.device, args.timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    layout = layout_for_preset(args.preset, world_from_env(rank_env.world_size))
    groups = build_groups(layout, args.timeout)
    me = layout.layout_rank_of_process(rank_env.rank)
    fx = {kind: make_fixtures(layout, SEED, device, kind) for kind in ("randn", "exact")}
    ctx = Ctx(layout, groups, rank_env.rank, me, device, fx, {k: local_inputs(f, me) for k, f in fx.items()})
    verdicts = {}
    for name, fn in CHECKS.items():
        try:
            fn(ctx)
            verdicts[name] = {"status": "pass", "message": ""}
        except Skip as exc:
            verdicts[name] = {"status": "skip", "message": str(exc)}
        except Exception:  # noqa: BLE001 -- every failure is reported to the pytest side
            verdicts[name] = {"status": "fail", "message": traceback.format_exc()[-3000:]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank_env.rank}.json").write_text(json.dumps(verdicts, indent=1))
    dist.destroy_process_group()
    return 0


# =============================================================================================
# pytest side
# =============================================================================================
def run_ranks(out: Path, nproc: int, device: str, preset: str, world: str, timeout: float) -> dict[int, dict]:
    from tests import torchrun as tr  # pytest side only: this file is also the ranks' script

    proc = tr.run_ranks([str(Path(__file__).resolve()), "--out", str(out), "--device", device, "--preset", preset,
                         "--timeout", str(timeout / 2)], nproc, device, timeout,
                        env_extra={"DETKIT_TPCP_WORLD": world, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        pytest.fail(f"ranks failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)}


def assert_verdicts(results: dict[int, dict], name: str, allowed_skips: tuple[str, ...] = ()) -> None:
    for rank, verdicts in results.items():
        v = verdicts[name]
        if v["status"] == "skip" and name in allowed_skips:
            continue
        assert v["status"] == "pass", f"rank {rank}: {v['status']}: {v['message']}"


@pytest.fixture(scope="module")
def gloo_4_ranks(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("gloo4"), 4, "cpu", "tiny", "0,1,2,3", CPU_TIMEOUT_S)


@pytest.mark.parametrize("name", list(CHECKS))
def test_4_ranks_gloo_interpreter(gloo_4_ranks, name):
    assert_verdicts(gloo_4_ranks, name, allowed_skips=("refuses_gloo_with_cuda_tensors",))


def test_refuses_an_uninitialised_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this pytest process")
    layout = layout_for_preset("tiny")
    handle = AxisGroup(layout, "tp", (0, 1))
    shapes = layout.local_shapes()
    before = parallel.collective_counts()
    h = torch.zeros(shapes["hidden"], dtype=torch.bfloat16)
    w = torch.zeros(shapes["w_down"], dtype=torch.bfloat16)
    for call in (lambda: row_parallel_fwd(h, w, handle),
                 lambda: column_parallel_dx(torch.zeros(shapes["d_gate"], dtype=torch.bfloat16),
                                            torch.zeros(shapes["w_gate"], dtype=torch.bfloat16), handle),
                 lambda: replicated_dw(torch.zeros(shapes["x"], dtype=torch.bfloat16),
                                       torch.zeros(shapes["d_gate"], dtype=torch.bfloat16),
                                       AxisGroup(layout, "cp", (0, 2)))):
        with pytest.raises(RuntimeError, match="default process group is not initialised; start the ranks"):
            call()
    assert parallel.collective_counts() == before


def test_dhidden_needs_no_process_group():
    layout = layout_for_preset("tiny")
    fx = make_fixtures(layout, SEED, DEVICE)
    loc = local_inputs(fx, 3)
    got = row_parallel_dhidden(loc["d_out"], loc["w_down"], layout=layout)
    bits_equal(got, unsharded_result(SPECS["down_dhidden"], fx, 3), "dhidden vs TP=1 shard")


@pytest.mark.parametrize(("kernel_backend", "pg_backend", "match"), [
    ("cuda_sm90", "gloo", r"'gloo' with CUDA tensors \(cuda_sm90\); supported: 'nccl'"),
    ("cuda_sm90", "mpi", r"'mpi' with CUDA tensors"),
    ("triton_interpreter", "nccl",
     r"'nccl' with CPU tensors \(triton_interpreter\); supported: 'gloo' .*not a hardware"),
])
def test_collective_backend_pairing_is_refused(kernel_backend, pg_backend, match):
    with pytest.raises(NotImplementedError, match=match):
        check_collective_backend(kernel_backend, pg_backend)


@pytest.mark.parametrize(("kernel_backend", "pg_backend"), [("cuda_sm90", "nccl"), ("triton_interpreter", "gloo")])
def test_collective_backend_pairing_is_accepted(kernel_backend, pg_backend):
    check_collective_backend(kernel_backend, pg_backend)


def test_nccl_sweep_plumbing_with_gloo(tmp_path):
    """The sweep driver end to end on 2 gloo ranks (not an NCCL result): fresh job, hashes, oracle."""
    proc = subprocess.run([sys.executable, "-m", "tools.nccl_sweep", "--device", "cpu",
                           "--settings", "default", "--quick", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=CPU_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "sweep.json").read_text())
    assert summary["all_settings_agree"] and summary["all_equal_v1_oracle"]
    assert summary["settings"]["default"]["NCCL_NVLS_ENABLE"] == "0"
    assert set(summary["results"]["default"]) >= {"randn_m1", "ties_m128", "signed_zeros_m16", "cancel_m1024"}
    assert "NOT an NCCL result" in summary["note"]


def test_nccl_sweep_dry_run_lists_every_setting():
    proc = subprocess.run([sys.executable, "-m", "tools.nccl_sweep", "--dry-run"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name, knobs in (("default", ""), ("ring_simple", "NCCL_ALGO=Ring NCCL_PROTO=Simple"),
                        ("ring_ll", "NCCL_PROTO=LL "), ("ring_ll128", "NCCL_PROTO=LL128"),
                        ("tree", "NCCL_ALGO=allreduce:tree")):
        line = next(x for x in lines if x.startswith(f"{name}:"))
        assert "NCCL_NVLS_ENABLE=0" in line and knobs in line and "--nproc-per-node=2" in line
    assert lines[-1] == "DRY RUN: nothing launched"


# ---------------------------------------------------------------------------- 2 GPUs, NCCL
def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


GPU_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def nccl_tp_group(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("nccl_tp"), 2, "cuda", "qwen3-8b-tp2", "0,1", GPU_TIMEOUT_S)


@pytest.fixture(scope="module")
def nccl_cp_group(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("nccl_cp"), 2, "cuda", "qwen3-8b-tp2", "0,2", GPU_TIMEOUT_S)


TP_ONLY_SKIPS = ("replicated_dw_matches_references", "refuses_a_forged_handle", "refuses_another_ranks_group",
                 "refuses_a_group_of_the_wrong_size", "refuses_a_layout_of_another_world")
CP_ONLY_SKIPS = ("row_parallel_fwd_matches_references", "column_parallel_dx_matches_references",
                 "partial_is_returned_untouched", "refuses_a_forged_handle", "refuses_another_ranks_group",
                 "refuses_a_group_of_the_wrong_size", "refuses_a_layout_of_another_world")


@pytest.mark.parametrize("name", list(CHECKS))
@pytest.mark.multigpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs of one host with NCCL")
def test_nccl_one_tp_group_qwen3_shapes(nccl_tp_group, name):
    assert_verdicts(nccl_tp_group, name, allowed_skips=TP_ONLY_SKIPS)


@pytest.mark.parametrize("name", list(CHECKS))
@pytest.mark.multigpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs of one host with NCCL")
def test_nccl_dw_on_a_2_rank_cp_group_qwen3_shapes(nccl_cp_group, name):
    assert_verdicts(nccl_cp_group, name, allowed_skips=CP_ONLY_SKIPS)


@pytest.mark.multigpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs of one host with NCCL")
def test_nccl_algorithm_sweep(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tools.nccl_sweep", "--quick", "--out", str(tmp_path)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=GPU_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "sweep.json").read_text())
    assert summary["all_settings_agree"] and summary["all_equal_v1_oracle"]


if __name__ == "__main__":
    sys.exit(worker())
