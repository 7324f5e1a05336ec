"""Launcher-side distributed set-up for the TP/CP audits: process group, TP and CP groups, row merge.

The operators in ``kernels.parallel`` never create, infer or look up a group: the launcher builds
them here, once, and hands each operator an ``AxisGroup`` (the torch group with its layout attached).

``detkit audit`` calls, around ``harness.run_plugins`` (see docs/tp_cp.md, "CLI hook")::

    session = dist.setup_distributed(ctx, out)   # None unless started as >1 ranks by torchrun/srun
    out = dist.out_dir(session, out)             # rank 0's results folder, agreed by every rank
    writer = harness.RowWriter(dist.rows_path(session, out))
    rows = harness.run_plugins(...)
    rows, dist_meta = dist.merge_rows(session, rows, out)   # rank 0: every rank's rows
    ... meta.update(dist_meta); write the report only if dist.writes_report(session) ...
    ok = dist.finish(session, ok)                # every rank agrees on pass/fail; group destroyed

Start-up goes through ``toolkit.launch`` (rank discovery, the block-layout check, gloo on cpu,
NCCL on cuda after ``set_device(local_rank)``). Every collective has a timeout
(``DETKIT_DIST_TIMEOUT_S``, default 300 s) so a missing rank fails the run instead of hanging it.

Knobs:
- ``DETKIT_DIST_TIMEOUT_S``: seconds for rendezvous and every collective (default 300).
- ``DETKIT_TPCP_WORLD``: the layout ranks the processes hold, comma-separated (default: 0,1,2,3 with
  4 ranks, 0,1 with 2 ranks). A 2-GPU host can run one TP group (``0,1``) or one CP group (``0,2``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import os
import socket
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from detkit.toolkit.layout import AXES, FULL_WORLD, AxisGroup, TpCpLayout, layout_for_preset

log = logging.getLogger(__name__)

TIMEOUT_ENV = "DETKIT_DIST_TIMEOUT_S"
WORLD_ENV = "DETKIT_TPCP_WORLD"
DEFAULT_WORLDS = {4: FULL_WORLD, 2: (0, 1)}

# torch.distributed entry points that move data between ranks; observe_collectives counts them.
COLLECTIVE_FUNCTIONS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "all_to_all",
    "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
)


@dataclass(frozen=True)
class Groups:
    """Every TP/CP group of the layout's world (all ranks built them, in the same order), and this
    process's own TP and CP handle (None when its group is not held by the world)."""

    layout: TpCpLayout
    handles: dict[tuple[str, tuple[int, ...]], AxisGroup]
    tp: AxisGroup | None
    cp: AxisGroup | None

    def membership(self) -> dict[str, list[list[int]]]:
        return {axis: [list(ranks) for (a, ranks) in self.handles if a == axis] for axis in AXES}


@dataclass
class DistSession:
    """One process's view of a multi-rank run (runtime state, hence not frozen)."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    source: str  # torchrun | slurm
    pg_backend: str  # gloo | nccl
    device: torch.device
    timeout_s: float
    layout: TpCpLayout | None
    layout_error: str | None  # why there is no layout (the tp-cp suite reports it)
    groups: Groups | None
    rank_records: list[dict[str, Any]]
    out_dir: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # filled by plug-ins, rank 0's is reported
    harness_collectives: Counter[str] = field(default_factory=Counter)

    @property
    def layout_rank(self) -> int | None:
        return None if self.layout is None else self.layout.layout_rank_of_process(self.rank)

    @property
    def hosts(self) -> list[str]:
        return sorted({r["hostname"] for r in self.rank_records})


_SESSION: DistSession | None = None


def current_session() -> DistSession | None:
    """The session ``setup_distributed`` started in this process (None in a single-process run)."""
    return _SESSION


class RankAudit:
    """Base of the multi-rank audits: this rank's place in the layout, its groups and device."""

    def __init__(self, ctx, session: DistSession):
        self.ctx, self.session = ctx, session
        self.layout = session.layout
        self.me = session.layout_rank
        self.cp, self.tp = self.layout.coords(self.me)
        self.groups = session.groups
        self.device = session.device


def session_for_suite(suite: str, backend: str, how_to_run: str):
    """The running DistSession for a multi-rank suite, or (None, the failed 'launch' row it yields)
    when the process was not started as ranks or the world does not hold the layout."""
    from detkit.toolkit.harness import Row

    session = current_session()
    if session is None:
        return None, Row(suite, "launch", f"{suite} launch", False, backend, {
            "reason": f"not started as ranks: the {suite} suite needs the TP/CP process groups. Run {how_to_run}"})
    if session.layout is None:
        return None, Row(suite, "launch", f"{suite} layout", False, backend,
                         {"reason": session.layout_error, "world_size": session.world_size})
    return session, None


def launched_as_ranks(environ: Mapping[str, str] | None = None) -> bool:
    """True when torchrun or an srun step started this process as one of several ranks."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["WORLD_SIZE"]) > 1
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        return int(env["SLURM_STEP_NUM_TASKS"]) > 1
    return False


def timeout_s(environ: Mapping[str, str] | None = None) -> float:
    from detkit.toolkit.launch import DEFAULT_TIMEOUT_S

    env = os.environ if environ is None else environ
    raw = env.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}; supported: a positive number of seconds")
    return value


def world_from_env(world_size: int, environ: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """The layout ranks held by the processes, from ``DETKIT_TPCP_WORLD`` or the world size."""
    env = os.environ if environ is None else environ
    raw = env.get(WORLD_ENV, "").strip()
    if raw:
        try:
            world = tuple(int(v) for v in raw.split(","))
        except ValueError:
            raise ValueError(f"{WORLD_ENV}={raw!r}; expected comma-separated layout ranks such as 0,1,2,3") from None
    elif world_size in DEFAULT_WORLDS:
        world = DEFAULT_WORLDS[world_size]
    else:
        raise ValueError(
            f"{world_size} ranks cannot hold the TP=2 x CP=2 layout; supported: 4 ranks (the full layout) "
            f"or 2 ranks holding one TP group (0,1) or one CP group (0,2) ({WORLD_ENV})"
        )
    if len(world) != world_size:
        raise ValueError(f"{WORLD_ENV}={raw!r} names {len(world)} layout ranks but {world_size} processes run")
    return world


def build_groups(layout: TpCpLayout, timeout: float) -> Groups:
    """Create every TP group, then every CP group, of ``layout``'s world. Collective: every rank
    must call it, in the same order (``torch.distributed.new_group`` requires it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("build_groups needs the default process group; call setup_distributed first")
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"{dist.get_world_size()} ranks run but the layout's world {layout.world} has {layout.world_size}")
    me = layout.layout_rank_of_process(dist.get_rank())
    td = _dt.timedelta(seconds=timeout)
    handles: dict[tuple[str, tuple[int, ...]], AxisGroup] = {}
    mine: dict[str, AxisGroup | None] = {axis: None for axis in AXES}
    for axis in AXES:
        for ranks in layout.groups_present(axis):
            pg = dist.new_group(ranks=list(layout.process_ranks_of(ranks)), timeout=td)
            handle = AxisGroup(layout, axis, ranks, pg)
            handles[(axis, ranks)] = handle
            if me in ranks:
                mine[axis] = handle
    return Groups(layout, handles, mine["tp"], mine["cp"])


def attach_group(pg, axis: str, layout: TpCpLayout) -> AxisGroup:
    """Wrap a process group built elsewhere; refuse it unless it is exactly one ``axis`` group of
    ``layout`` (process ranks mapped through ``layout.world``)."""
    import torch.distributed as dist

    if pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"attach_group: this process is not a member of the group ({pg!r})")
    process_ranks = dist.get_process_group_ranks(pg)
    if any(p >= layout.world_size for p in process_ranks):
        raise ValueError(f"attach_group: process ranks {process_ranks} exceed the layout's world {layout.world}")
    return AxisGroup(layout, axis, tuple(layout.world[p] for p in process_ranks), pg)


def _gpu_record(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"gpu": None, "gpu_uuid": None, "pci_bus_id": None}
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    bus = None
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    uuid = getattr(props, "uuid", None)
    return {"gpu": props.name, "cuda_device": index, "gpu_uuid": str(uuid) if uuid is not None else None,
            "pci_bus_id": bus}


def setup_distributed(ctx, out: Path | None = None,
                      environ: Mapping[str, str] | None = None) -> DistSession | None:
    """Start the process group and the TP/CP groups when launched as ranks; else return None.

    ``ctx`` is the harness RunContext (device decides gloo or NCCL; preset decides the layout).
    Rank-layout problems raise ``toolkit.launch.LaunchError`` before anything starts. A world
    that cannot hold the layout still starts (other suites can run); the tp-cp suite then reports
    ``layout_error``.
    """
    global _SESSION
    env = os.environ if environ is None else environ
    if not launched_as_ranks(env):
        return None
    import torch.distributed as dist

    from detkit.toolkit.launch import RankEnv, check_slurm_distribution, init_process_group

    rank_env = RankEnv.from_environ(env)
    rank_env.check_layout()
    if rank_env.source == "slurm":
        check_slurm_distribution(env)
    timeout = timeout_s(env)
    pg_backend = init_process_group(rank_env, ctx.device.type, timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if ctx.device.type == "cuda" else ctx.device

    layout, layout_error = None, None
    try:
        layout = layout_for_preset(ctx.preset, world_from_env(rank_env.world_size, env))
    except ValueError as exc:
        layout_error = str(exc)
    groups = build_groups(layout, timeout) if layout is not None else None

    record = {
        "rank": rank_env.rank, "layout_rank": None, "cp": None, "tp": None,
        "hostname": socket.gethostname(), "node_rank": rank_env.node_rank, "local_rank": rank_env.local_rank,
        "pid": os.getpid(), "device": str(device), "pg_backend": pg_backend, **_gpu_record(device),
    }
    if layout is not None:
        me = layout.layout_rank_of_process(rank_env.rank)
        record.update(layout_rank=me, cp=layout.coords(me)[0], tp=layout.coords(me)[1])
    records: list[Any] = [None] * rank_env.world_size
    dist.all_gather_object(records, record)
    agreed = [str(out) if out is not None else None]
    dist.broadcast_object_list(agreed, src=0)  # ranks may disagree on a timestamped default folder

    _SESSION = DistSession(
        rank=rank_env.rank, world_size=rank_env.world_size, local_rank=rank_env.local_rank,
        node_rank=rank_env.node_rank, source=rank_env.source, pg_backend=pg_backend, device=device,
        timeout_s=timeout, layout=layout, layout_error=layout_error, groups=groups,
        rank_records=sorted(records, key=lambda r: r["rank"]),
        out_dir=Path(agreed[0]) if agreed[0] is not None else None,
    )
    log.info("rank %d/%d started (%s, %s)", rank_env.rank, rank_env.world_size, pg_backend, rank_env.source)
    return _SESSION


def out_dir(session: DistSession | None, out: Path) -> Path:
    """Rank 0's results folder (every rank writes its rows file there)."""
    return session.out_dir if session is not None and session.out_dir is not None else out


def rows_path(session: DistSession | None, out: Path) -> Path:
    """Where this process appends its rows: ``rows.jsonl``, or ``ranks/rows-rank<R>.jsonl`` per rank
    (rank 0 writes the merged ``rows.jsonl`` in ``merge_rows``)."""
    if session is None:
        return out / "rows.jsonl"
    return out / "ranks" / f"rows-rank{session.rank}.jsonl"


def writes_report(session: DistSession | None) -> bool:
    return session is None or session.rank == 0


def gather_group(t: torch.Tensor, group: AxisGroup, session: DistSession | None = None) -> list[torch.Tensor]:
    """Harness-side all_gather of ``t`` over ``group``, in group-rank order (the operand order of
    the version-1 oracle). Counted apart from operator collectives."""
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in group.ranks]
    dist.all_gather(out, t.contiguous(), group=group.group)
    if session is not None:
        session.harness_collectives[f"all_gather/{group.axis}"] += 1
    return out


def _capture_env_summary(device: torch.device) -> dict[str, Any]:
    from detkit.toolkit.env import capture_env, env_summary

    captured = capture_env(probe_cuda=device.type == "cuda")
    return {"env": env_summary(captured), "topology": captured.get("topology"),
            "nvlink": captured.get("nvlink")}


def _versions(pg_backend: str) -> dict[str, Any]:
    versions: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": None}
    if pg_backend == "nccl":
        nccl = torch.cuda.nccl.version()
        versions["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return versions


def merge_rows(session: DistSession | None, rows: list, out: Path | None = None) -> tuple[list, dict[str, Any]]:
    """Gather every rank's rows to rank 0. Rank 0 gets (all rows in rank order, each tagged with
    ``details['rank']``, plus the run's distributed meta) and writes ``out/rows.jsonl``; other ranks
    get (their own rows, {})."""
    if session is None:
        return rows, {}
    import torch.distributed as dist

    from detkit.toolkit.harness import Row, RowWriter

    payload = [r.as_dict() for r in rows]
    gathered: list[Any] = [None] * session.world_size
    dist.all_gather_object(gathered, payload)
    if session.rank != 0:
        return rows, {}
    merged = []
    for rank, dicts in enumerate(gathered):
        for d in dicts:
            d["details"].setdefault("rank", rank)
            merged.append(Row(**d))
    if out is not None:
        merged_path = out / "rows.jsonl"
        merged_path.unlink(missing_ok=True)
        writer = RowWriter(merged_path)
        try:
            for row in merged:
                writer.write(row)
        finally:
            writer.close()
    meta: dict[str, Any] = {
        "distributed": {
            "world_size": session.world_size, "source": session.source, "pg_backend": session.pg_backend,
            "timeout_s": session.timeout_s, "hosts": session.hosts, "inter_node": len(session.hosts) > 1,
            "rows_per_rank": [len(d) for d in gathered],
            "versions": _versions(session.pg_backend),
        },
        "rank_map": session.rank_records,
    }
    if session.groups is not None:
        meta["groups"] = session.groups.membership()
    meta.update(_capture_env_summary(session.device))
    meta.update(session.meta)
    return merged, meta


def finish(session: DistSession | None, passed: bool) -> bool:
    """Every rank's verdict combined (all must pass); destroys the process group."""
    global _SESSION
    if session is None:
        return passed
    import torch.distributed as dist

    verdicts: list[Any] = [None] * session.world_size
    try:
        dist.all_gather_object(verdicts, bool(passed))
    finally:
        dist.destroy_process_group()
        _SESSION = None
    return all(verdicts)


@contextlib.contextmanager
def observe_collectives() -> Iterator[Counter[str]]:
    """Count every torch.distributed collective called inside the block, by function name.

    Patches the entry points of ``torch.distributed`` (and its c10d module) for the duration, so
    it sees collectives whether or not the caller reports them; the audit compares this with the
    operators' own counters."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    seen: Counter[str] = Counter()
    saved: list[tuple[Any, str, Any]] = []

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    try:
        for module in (dist, c10d):
            for name in COLLECTIVE_FUNCTIONS:
                fn = getattr(module, name, None)
                if fn is not None:
                    saved.append((module, name, fn))
                    setattr(module, name, counting(name, fn))
        yield seen
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)

