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

A rank that stops answering: every rank keeps ``out/ranks/alive-rank<R>.json`` up to date from a
heartbeat thread (a beat counter and the stage it is in: plug-in, rows done, last row). When a
collective fails (timeout, closed connection), ``end_incomplete`` reads those files twice a few
beats apart: a rank whose counter did not move is the one that stopped answering (a stopped or
hung process), a rank that recorded an error ended with it. The lowest surviving rank merges
every finished row from ``ranks/rows-rank*.jsonl`` into a report marked INCOMPLETE, and every
survivor prints one line naming the rank and its stage. Counters, not clocks: nodes need not
agree on the time, only share the results folder (which the rows files need already).

Ranks started here (``run_on_local_ranks``): ``detkit audit --suite all`` in one process starts
the multi-rank suites on ranks of this host (``toolkit.launch.LocalRanks``) and merges their rows
and meta into its own report.

Knobs:
- ``DETKIT_DIST_TIMEOUT_S``: seconds for rendezvous and every collective (default 300).
- ``DETKIT_TPCP_WORLD``: the layout ranks the processes hold, comma-separated (default: 0,1,2,3 with
  4 ranks, 0,1 with 2 ranks). A 2-GPU host can run one TP group (``0,1``) or one CP group (``0,2``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time
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


COVERAGE_KEYS = ("covered", "not_covered")  # meta lists every suite of a launch adds to


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
    watch: RankWatch | None = None  # this rank's heartbeat file (started once the folder is agreed)

    @property
    def layout_rank(self) -> int | None:
        return None if self.layout is None else self.layout.layout_rank_of_process(self.rank)

    @property
    def hosts(self) -> list[str]:
        return sorted({r["hostname"] for r in self.rank_records})

    def add_meta(self, part: dict[str, Any]) -> None:
        """A plug-in's meta into the run's: its ``covered`` / ``not_covered`` lines appended to the other suites' of
        the same launch (each line once), every other key set."""
        for key, value in part.items():
            if key in COVERAGE_KEYS:
                kept = self.meta.setdefault(key, [])
                kept += [line for line in value if line not in kept]
            else:
                self.meta[key] = value


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
    if _SESSION.out_dir is not None:
        _SESSION.watch = RankWatch(_SESSION.out_dir / "ranks", rank_env.rank, heartbeat_s(timeout),
                                   rank_env.world_size, stale_s=timeout / 2).start()
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

    from detkit.toolkit.harness import Row
    from detkit.toolkit.records import write_rows

    payload = [r.as_dict() for r in rows]
    gathered: list[Any] = [None] * session.world_size
    note_stage(session, f"merging the rows of every rank ({len(rows)} rows here)")
    dist.all_gather_object(gathered, payload)
    if session.rank != 0:
        return rows, {}
    merged = []
    for rank, dicts in enumerate(gathered):
        for d in dicts:
            d["details"].setdefault("rank", rank)
            merged.append(Row(**d))
    if out is not None:
        write_rows(out / "rows.jsonl", merged)
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
    note_stage(session, "agreeing on the verdict")
    try:
        dist.all_gather_object(verdicts, bool(passed))
    finally:
        dist.destroy_process_group()
        _SESSION = None
    if session.watch is not None:
        session.watch.end("finished")
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



# ----------------------------------------------------------------------------- a rank that stops answering
ALIVE_FILE = "alive-rank{rank}.json"
INCOMPLETE_FILE = "incomplete.json"  # in out/ranks/: written by the rank that wrote the INCOMPLETE report


def heartbeat_s(timeout: float) -> float:
    """Seconds between beats: 1 s, or a tenth of a shorter collective timeout."""
    return max(0.1, min(1.0, timeout / 10))


def _atomic_json(path: Path, payload: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, default=str)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class RankWatch:
    """This rank's ``alive-rank<R>.json`` and its watch over the other ranks' files.

    A daemon thread advances a beat counter every ``interval`` seconds and writes it with the stage
    the rank is in and its state (running, finished, error, gave-up); a stopped or hung process
    stops beating, a rank that ends says how. The same thread reads the other ranks' files: once
    ``on_stall`` is armed, a rank whose counter has not moved for ``stale_s`` seconds (or that
    recorded an error) makes it call ``on_stall(diagnosis)`` once -- while the main thread may still
    be blocked in a collective that will only time out later."""

    def __init__(self, directory: Path, rank: int, interval: float, world_size: int = 1,
                 stale_s: float | None = None):
        self.directory = Path(directory)
        self.path = self.directory / ALIVE_FILE.format(rank=rank)
        self.rank, self.interval, self.world_size = rank, interval, world_size
        self.stale_s = stale_s
        self.stage, self.state, self.error, self.beat = "starting", "running", None, 0
        self.on_stall = None
        self._claimed = False
        self._seen: dict[int, tuple[Any, float]] = {}  # peer -> (beat, monotonic time it last moved)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"detkit-heartbeat-rank{rank}", daemon=True)

    def start(self) -> RankWatch:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread.start()
        return self

    def set_stage(self, stage: str) -> None:
        with self._lock:
            self.stage = stage
        self._write()

    def end(self, state: str, error: str | None = None) -> None:
        self._stop.set()
        with self._lock:
            self.state, self.error = state, error
        self._write()

    def claim(self) -> bool:
        """True for the first caller only: the one that handles this rank's failure."""
        with self._lock:
            first, self._claimed = not self._claimed, True
        return first

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._write(beat=True)
            if self.on_stall is not None and self.stale_s is not None:
                diagnosis = self._look()
                if diagnosis is not None and self.claim():
                    self.on_stall(diagnosis)
                    return

    def _look(self) -> Diagnosis | None:
        now = time.monotonic()
        silent, failed = {}, {}
        for rank, rec in read_watch(self.directory, self.world_size).items():
            if rank == self.rank:
                continue
            beat = None if rec is None else (rec.get("beat"), rec.get("state"))
            last = self._seen.get(rank)
            if last is None or last[0] != beat:
                self._seen[rank] = (beat, now)
                last = self._seen[rank]
            if rec is not None and rec.get("state") == "error":
                failed[rank] = rec
            elif (rec is None or rec.get("state") == "running") and now - last[1] >= self.stale_s:
                silent[rank] = rec or {}
        if not silent and not failed:
            return None
        return Diagnosis(self.rank, self.stage, silent, failed, self.stale_s)

    def _write(self, beat: bool = False) -> None:
        with self._lock:
            if beat:
                self.beat += 1
            record = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "beat": self.beat,
                      "stage": self.stage, "state": self.state, "error": self.error}
            with contextlib.suppress(OSError):  # a full or vanished folder must not kill the rank
                _atomic_json(self.path, record)


def note_stage(session: DistSession | None, stage: str) -> None:
    """Record what this rank is doing (shown when another rank has to name where it stopped)."""
    if session is not None and session.watch is not None:
        session.watch.set_stage(stage)


def read_watch(directory: Path, world_size: int) -> dict[int, dict[str, Any] | None]:
    """Every rank's last heartbeat record (None: missing or unreadable)."""
    records: dict[int, dict[str, Any] | None] = {}
    for rank in range(world_size):
        try:
            records[rank] = json.loads((Path(directory) / ALIVE_FILE.format(rank=rank)).read_text())
        except (OSError, ValueError):
            records[rank] = None
    return records


@dataclass(frozen=True)
class Diagnosis:
    """Who did not answer, as this rank saw it."""

    me: int
    my_stage: str
    silent: dict[int, dict[str, Any]]  # no beat for a while: stopped, hung, or gone without a word
    failed: dict[int, dict[str, Any]]  # ended with an error it recorded
    looked_s: float  # how long the silent ranks were watched without a beat

    @property
    def peers_at_fault(self) -> bool:
        return bool(self.silent or self.failed)

    def culprits(self) -> str:
        parts = []
        for rank, rec in sorted(self.silent.items()):
            where = f" (pid {rec['pid']} on {rec['host']})" if rec.get("pid") else ""
            stage = rec.get("stage", "unknown: no heartbeat file")
            parts.append(f"rank {rank}{where} stopped answering in stage '{stage}' (no heartbeat for "
                         f"{self.looked_s:.0f} s)")
        for rank, rec in sorted(self.failed.items()):
            parts.append(f"rank {rank} ended with an error in stage '{rec.get('stage')}': {rec.get('error')}")
        return "; ".join(parts)


def diagnose(session: DistSession, directory: Path) -> Diagnosis:
    """After a failed collective: read every rank's heartbeat twice, three beats apart."""
    interval = session.watch.interval if session.watch is not None else heartbeat_s(session.timeout_s)
    first = read_watch(directory, session.world_size)
    time.sleep(3 * interval + 0.2)
    second = read_watch(directory, session.world_size)
    silent, failed = {}, {}
    for rank in range(session.world_size):
        if rank == session.rank:
            continue
        before, now = first.get(rank), second.get(rank)
        if now is None:
            silent[rank] = {}
        elif now.get("state") == "error":
            failed[rank] = now
        elif now.get("state") == "running" and before is not None and now.get("beat") == before.get("beat"):
            silent[rank] = now
    my_stage = session.watch.stage if session.watch is not None else "unknown"
    return Diagnosis(session.rank, my_stage, silent, failed, 3 * interval + 0.2)


def rows_from_rank_files(out: Path, world_size: int) -> tuple[list, list[int]]:
    """Every complete row in ``out/ranks/rows-rank<R>.jsonl``, rank order, each tagged with its
    rank; and the count per rank. A line cut short by a stopped writer is left out."""
    from detkit.toolkit.harness import Row

    rows, counts = [], []
    for rank in range(world_size):
        n = 0
        path = out / "ranks" / f"rows-rank{rank}.jsonl"
        lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
        for line in lines:
            try:
                d = json.loads(line)
                d["details"].setdefault("rank", rank)
                rows.append(Row(**d))
                n += 1
            except (ValueError, TypeError, KeyError):
                continue
        counts.append(n)
    return rows, counts


def write_incomplete_report(session: DistSession, out: Path, meta: dict[str, Any], diagnosis: Diagnosis,
                            error: str) -> Path:
    """Merge every finished row of every rank into ``out/report.json``/``report.md`` marked
    INCOMPLETE (and ``out/rows.jsonl``); return report.md's path."""
    from detkit.toolkit.harness import Row, write_report
    from detkit.toolkit.records import write_rows

    rows, counts = rows_from_rank_files(out, session.world_size)
    what = diagnosis.culprits()
    backend = meta.get("backend", "unknown")
    for rank, rec in sorted({**diagnosis.silent, **diagnosis.failed}.items()):
        how = "ended with an error" if rank in diagnosis.failed else "stopped answering"
        rows.append(Row("distributed", "rank_answered", f"rank {rank} {how}", False, backend, {
            "rank": rank, "stage": rec.get("stage"), "error": rec.get("error"), "pid": rec.get("pid"),
            "host": rec.get("host"), "detected_by_rank": session.rank, "rows_finished": counts[rank]}))
    incomplete = {
        "reason": what, "detected_by_rank": session.rank, "stage_of_detecting_rank": diagnosis.my_stage,
        "silent_ranks": sorted(diagnosis.silent), "failed_ranks": sorted(diagnosis.failed),
        "stages": {str(r): rec.get("stage") for r, rec in {**diagnosis.silent, **diagnosis.failed}.items()},
        "timeout_s": session.timeout_s, "error": error[:500], "rows_per_rank": counts,
    }
    meta = {**meta, "status": "INCOMPLETE", "status_reason": f"{what}. Rows per rank: {counts}",
            "incomplete": incomplete,
            "distributed": {"world_size": session.world_size, "source": session.source,
                            "pg_backend": session.pg_backend, "timeout_s": session.timeout_s,
                            "hosts": session.hosts, "inter_node": len(session.hosts) > 1, "rows_per_rank": counts},
            "rank_map": session.rank_records}
    meta["not_covered"] = [f"INCOMPLETE: {what}; only the rows the ranks finished before that are here",
                           *meta.get("not_covered", [])]
    write_rows(out / "rows.jsonl", rows)
    _, md_path = write_report(out, meta, rows)  # report.md opens with the INCOMPLETE banner and the reason
    _atomic_json(out / "ranks" / INCOMPLETE_FILE, {**incomplete, "report": str(md_path)})
    return md_path


def _wait_for_states(session: DistSession, ranks: list[int], limit_s: float) -> bool:
    """Whether every rank of ``ranks`` left the running state (its line printed) within ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while True:
        records = read_watch(session.watch.directory, session.world_size)
        if all(records.get(r) is not None and records[r].get("state") != "running" for r in ranks):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _wait_for_incomplete_marker(out: Path, limit_s: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + limit_s
    path = out / "ranks" / INCOMPLETE_FILE
    while True:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(path.read_text())
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)


def _destroy_group_quietly(limit_s: float = 5.0) -> None:
    import torch.distributed as dist

    def destroy() -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    thread = threading.Thread(target=destroy, daemon=True)
    thread.start()
    thread.join(limit_s)


def _account(session: DistSession, out: Path, meta: dict[str, Any], diagnosis: Diagnosis, how: str,
             error: str) -> str:
    """Seal this rank's rows file and print its one line, then have the lowest surviving rank write the INCOMPLETE
    report once the other survivors have given up too (their files sealed) while they wait for it (the first rank to
    exit may end them all: torchrun, srun --kill-on-bad-exit), and every survivor wait for the other survivors to have
    printed theirs; return the line."""
    from detkit.toolkit.records import seal_rows

    survivors = [r for r in range(session.world_size) if r not in diagnosis.silent and r not in diagnosis.failed]
    writer = min(survivors)
    md = out / "report.md"
    line = (f"detkit audit: rank {session.rank}: INCOMPLETE: {diagnosis.culprits()}; this rank gave up in stage "
            f"'{diagnosis.my_stage}' ({how}); INCOMPLETE report: {md} (written by rank {writer})")
    # This rank's rows end here (its main thread may still be finishing rows another rank takes no part in): the
    # report merges each survivor's file after that survivor has given up, so it holds the rank's every row.
    seal_rows(rows_path(session, out))
    print(line, file=sys.stderr, flush=True)
    session.watch.end("gave-up", error[:300])  # after the line and the seal: the writer waits for this state
    others = [r for r in survivors if r != session.rank]
    settle_s = (session.watch.stale_s or 0) + 3 * session.watch.interval + 5  # another survivor's stall seen and said
    if session.rank == writer:
        _wait_for_states(session, others, limit_s=settle_s)
        try:
            write_incomplete_report(session, out, meta, diagnosis, error)
        except Exception as exc:  # noqa: BLE001 -- say so, the line is out already
            print(f"detkit audit: rank {session.rank}: the INCOMPLETE report was not written: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    elif _wait_for_incomplete_marker(out, limit_s=30 + 3 * session.watch.interval) is None:
        print(f"detkit audit: rank {session.rank}: rank {writer} did not write the INCOMPLETE report within "
              f"{30 + 3 * session.watch.interval:g} s", file=sys.stderr, flush=True)
    # Every survivor, not only the writer: the other survivors see the stall up to a beat later (more under load),
    # and the first exit may end them all before they have printed their line.
    _wait_for_states(session, others, limit_s=settle_s)
    return line


def arm_stall_exit(session: DistSession | None, out: Path, meta: dict[str, Any]) -> None:
    """From now on, a rank that stops beating for half the collective timeout (or records an error)
    ends this rank without waiting for the timeout: the INCOMPLETE report is written by the lowest
    survivor, this rank prints its one line and exits with status 1."""
    if session is None or session.watch is None:
        return

    def on_stall(diagnosis: Diagnosis) -> None:
        try:
            _account(session, out, meta, diagnosis, "seen by its heartbeat watch",
                     f"no heartbeat from rank(s) {sorted(diagnosis.silent) or sorted(diagnosis.failed)}")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # the main thread may be blocked in a collective until the timeout

    session.watch.on_stall = on_stall


def end_incomplete(session: DistSession, error: BaseException, out: Path, meta: dict[str, Any]) -> str:
    """After a collective failed on this rank (timeout, closed connection): print one line naming
    the rank that stopped answering, have the lowest surviving rank write the INCOMPLETE report, and
    return the line.

    Re-raises ``error`` when no other rank is at fault (this rank's own failure): it records the
    error first, closes its connections so the others fail fast and name it, and waits for their
    report before it lets the process end (torchrun and srun --kill-on-bad-exit end every rank once
    one has ended)."""
    global _SESSION
    watch = session.watch
    if watch is None:
        raise error
    if not watch.claim():  # the heartbeat watch is handling it and will end the process
        time.sleep(session.timeout_s + 60)
        raise error
    _SESSION = None
    diagnosis = diagnose(session, out / "ranks")
    if not diagnosis.peers_at_fault:
        watch.end("error", f"{type(error).__name__}: {str(error)[:300]}")
        _destroy_group_quietly()
        _wait_for_incomplete_marker(out, limit_s=session.timeout_s + 30)
        raise error
    return _account(session, out, meta, diagnosis, f"{type(error).__name__} in a collective",
                    f"{type(error).__name__}: {error}")


def stalled_ranks(out: Path) -> list[int]:
    """The ranks named in ``out/ranks/incomplete.json`` (empty while there is none)."""
    try:
        marker = json.loads((out / "ranks" / INCOMPLETE_FILE).read_text())
    except (OSError, ValueError):
        return []
    return [*marker.get("silent_ranks", []), *marker.get("failed_ranks", [])]


# ----------------------------------------------------------------------------- multi-rank suites started here
@dataclass
class RankRunResult:
    """What one job of ranks started by ``run_on_local_ranks`` left."""

    label: str
    nproc: int
    world: str
    out: Path
    exit_codes: list[int]
    killed: list[int]
    report: dict[str, Any] | None
    rows: list
    seconds: float

    @property
    def incomplete(self) -> dict[str, Any] | None:
        return (self.report or {}).get("meta", {}).get("incomplete")

    def summary(self) -> dict[str, Any]:
        meta = (self.report or {}).get("meta", {})
        return {"label": self.label, "ranks": self.nproc, "world": self.world, "out": str(self.out),
                "exit_codes": self.exit_codes, "killed_ranks": self.killed, "rows": len(self.rows),
                "status": meta.get("status", "COMPLETE" if self.report else "NO REPORT"),
                "seconds": round(self.seconds, 1), "incomplete": self.incomplete}


def run_on_local_ranks(runs, suites: list[str], ctx, out: Path, echo=None) -> list[RankRunResult]:
    """Run ``detkit audit --suite <suites>`` as each job in ``runs`` (``toolkit.launch.RankRun``)
    on ranks of this host, one job after another, each writing its own report under
    ``out/ranks-<label>``; return their rows (tagged with the job's label) and reports."""
    from detkit.toolkit.harness import Row
    from detkit.toolkit.launch import LocalRanks

    timeout = timeout_s()
    results = []
    for run in runs:
        run_out = out / f"ranks-{run.label}"
        argv = ["-m", "detkit", "audit", "--device", ctx.device.type, "--preset", ctx.preset, "--seed",
                str(ctx.seed), "--out", str(run_out), "--no-progress"]
        for suite in suites:
            argv += ["--suite", suite]
        env = {**os.environ, WORLD_ENV: run.world, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
        if ctx.device.type == "cpu":
            # The ranks share the cores; gloo stays on the loopback interface.
            env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=env.get("GLOO_SOCKET_IFNAME", "lo"))
        if echo is not None:
            echo(f"starting {', '.join(suites)} on {run.nproc} ranks of this host ({run.label}, layout ranks "
                 f"{run.world}); per-rank logs: {run_out / 'logs'}")
        started = time.monotonic()
        ranks = LocalRanks(argv, run.nproc, env, run_out / "logs", timeout)
        try:
            codes = ranks.wait(stalled=lambda: stalled_ranks(run_out))
        finally:
            ranks.kill()
        report = None
        with contextlib.suppress(OSError, ValueError):
            report = json.loads((run_out / "report.json").read_text())
        rows = []
        if report is not None:
            for d in report["rows"]:
                d["details"].setdefault("rank_run", run.label)
                rows.append(Row(**d))
        results.append(RankRunResult(run.label, run.nproc, run.world, run_out, codes, list(ranks.killed), report,
                                     rows, time.monotonic() - started))
    return results


_RANK_RUN_META_KEYS = ("distributed", "rank_map", "groups")


def rank_run_meta(results: list[RankRunResult], backend: str) -> tuple[dict[str, Any], list, list[str]]:
    """(meta to merge into the report, failed 'launch' rows, one-line accounts of failed jobs) for
    the jobs ``run_on_local_ranks`` ran. With one job its distributed meta (rank map, groups) and
    suite meta are carried over as if the report were its own; covered / not-covered lists of
    every job are added, prefixed by the job's label when there are several."""
    from detkit.toolkit.harness import Row

    meta: dict[str, Any] = {"rank_runs": [r.summary() for r in results], "covered": [], "not_covered": []}
    failed_rows, lines = [], []
    several = len(results) > 1
    for res in results:
        child = (res.report or {}).get("meta", {})
        prefix = f"[{res.label}] " if several else ""
        meta["covered"] += [prefix + c for c in child.get("covered", [])]
        meta["not_covered"] += [prefix + c for c in child.get("not_covered", [])]
        skip = {"covered", "not_covered", "env", "env_summary", "command", "command_line", "date", "plots",
                "suites", "suite_selection", "status", "incomplete", *(() if not several else _RANK_RUN_META_KEYS)}
        for key, value in child.items():
            if key not in skip:
                meta.setdefault(key, value)
        if res.report is not None and res.incomplete is None:
            continue  # its failed checks, if any, are among its rows
        if res.incomplete is not None:
            why = f"INCOMPLETE: {res.incomplete.get('reason')}"
            meta["status"] = "INCOMPLETE"
            meta.setdefault("status_reason", f"ranks {res.label}: {res.incomplete.get('reason')}")
            meta.setdefault("incomplete", res.incomplete)
        else:
            why = f"no report (exit codes {res.exit_codes}); see {res.out / 'logs'}"
        lines.append(f"ranks {res.label}: {why}")
        failed_rows.append(Row("launch", "ranks", f"{res.label}: {res.nproc} ranks started on this host", False,
                               backend, {"reason": why, **res.summary()}))
    return meta, failed_rows, lines
