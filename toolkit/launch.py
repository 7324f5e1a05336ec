"""Rank discovery, layout check and process-group start-up under srun and torchrun.

detkit's TP/CP layout needs ``rank = node * tasks_per_node + local_rank``: the TP
pair of a node holds consecutive ranks and the CP pairs cross nodes. Slurm gives that only with
block distribution (``srun --distribution=block``); torchrun gives it by construction. Nothing
here repairs a wrong mapping: every check raises with the values it saw and what it needs.

Reusable pieces (``detkit audit --suite tp-cp`` starts ranks through them):

- :class:`RankEnv` -- ``RankEnv.from_environ()`` reads torchrun's ``RANK``/``WORLD_SIZE``/
  ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``GROUP_RANK`` or Slurm's ``SLURM_PROCID``/
  ``SLURM_STEP_NUM_TASKS``/``SLURM_LOCALID``/``SLURM_NODEID``/``SLURM_STEP_NUM_NODES``/
  ``SLURM_STEP_TASKS_PER_NODE``; ``check_layout()`` enforces the block mapping.
- :func:`init_process_group` -- gloo on ``cpu``, NCCL on ``cuda`` (after
  ``torch.cuda.set_device(local_rank)``), with a timeout.
- :func:`all_reduce_check` -- an exact all-reduce sanity check.

Command line (one process per rank; rank 0 writes ``rank_map.json``)::

    python -m detkit.toolkit.launch check --out DIR [--device cpu|cuda] [--timeout S]
                                   [--expect-nodes N] [--expect-tasks-per-node T]

Exit status: 0 when every check passed, 2 for a wrong environment or layout (nothing was
started), 1 for a failure after start-up (rendezvous timeout, collective mismatch).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("detkit.launch")

DEVICES = ("cpu", "cuda")
BACKEND_FOR_DEVICE = {"cpu": "gloo", "cuda": "nccl"}
DEFAULT_TIMEOUT_S = 300.0

# torchrun (torch.distributed.run) exports all of these to every worker.
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
# srun exports these to every task of a step; the batch script itself has SLURM_PROCID=0 etc.
# but no SLURM_STEP_NUM_TASKS, which is how a rank started outside srun is told apart.
_SLURM_VARS = (
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_STEP_NUM_NODES",
    "SLURM_STEP_TASKS_PER_NODE",
)


class LaunchError(ValueError):
    """The process environment does not describe a usable rank (nothing was started)."""


class RankLayoutError(LaunchError):
    """The ranks are not laid out as ``rank = node * tasks_per_node + local_rank``."""


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's compressed task counts: ``"2(x2)"`` -> [2, 2], ``"3,1"`` -> [3, 1]."""
    counts: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise LaunchError(
                f"cannot parse tasks-per-node value {value!r}: expected Slurm's form "
                "such as '2(x2)' or '3,1'"
            )
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _int_var(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits among the ranks of a job (uniform tasks per node).

    ``node_rank`` is the index of this process's node within the step (torchrun's group rank);
    ``local_world_size`` is the number of ranks on every node.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    source: str  # "torchrun" or "slurm": which variables it was read from

    def __post_init__(self) -> None:
        if self.source not in ("torchrun", "slurm"):
            raise LaunchError(f"source={self.source!r}; supported: 'torchrun', 'slurm'")
        if self.world_size < 1 or self.local_world_size < 1 or self.num_nodes < 1:
            raise LaunchError(
                f"sizes must be >= 1: world_size={self.world_size}, "
                f"local_world_size={self.local_world_size}, num_nodes={self.num_nodes}"
            )
        for name, value, bound in (
            ("rank", self.rank, self.world_size),
            ("local_rank", self.local_rank, self.local_world_size),
            ("node_rank", self.node_rank, self.num_nodes),
        ):
            if not 0 <= value < bound:
                raise LaunchError(f"{name}={value} is outside [0, {bound}) ({self.source})")
        if self.world_size != self.num_nodes * self.local_world_size:
            raise LaunchError(
                f"world_size={self.world_size} != num_nodes={self.num_nodes} x "
                f"local_world_size={self.local_world_size} ({self.source}): detkit needs the "
                "same number of ranks on every node"
            )

    @property
    def expected_rank(self) -> int:
        """The rank that block placement gives this process."""
        return self.node_rank * self.local_world_size + self.local_rank

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RankEnv:
        """Read the rank from torchrun's variables, else from an srun step's.

        torchrun's take precedence (torchrun started under srun sets both; its workers are the
        ranks). A partial set of either kind is an error naming the missing variables.
        """
        env = os.environ if environ is None else environ
        present = [v for v in _TORCHRUN_VARS if v in env]
        if present:
            missing = [v for v in _TORCHRUN_VARS if v not in env]
            if missing:
                raise LaunchError(
                    f"torchrun-style variables are incomplete: {', '.join(present)} set but "
                    f"{', '.join(missing)} missing; start the ranks with torchrun (which sets "
                    "all of them) or under srun without RANK in the environment"
                )
            world = _int_var(env, "WORLD_SIZE")
            local_world = _int_var(env, "LOCAL_WORLD_SIZE")
            if world % local_world:
                raise LaunchError(
                    f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}"
                )
            return cls(
                rank=_int_var(env, "RANK"),
                world_size=world,
                local_rank=_int_var(env, "LOCAL_RANK"),
                local_world_size=local_world,
                node_rank=_int_var(env, "GROUP_RANK"),
                num_nodes=world // local_world,
                source="torchrun",
            )
        if "SLURM_PROCID" in env:
            missing = [v for v in _SLURM_VARS if v not in env]
            if missing:
                raise LaunchError(
                    f"Slurm variables {', '.join(missing)} are missing: this process was not "
                    "started by srun (the batch script itself is not a rank); launch one task "
                    "per GPU with 'srun --distribution=block'"
                )
            per_node = parse_tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
            if len(set(per_node)) != 1:
                raise LaunchError(
                    f"SLURM_STEP_TASKS_PER_NODE={env['SLURM_STEP_TASKS_PER_NODE']!r}: uneven "
                    "tasks per node; detkit needs the same number on every node "
                    "(use --ntasks-per-node)"
                )
            num_nodes = _int_var(env, "SLURM_STEP_NUM_NODES")
            if len(per_node) != num_nodes:
                raise LaunchError(
                    f"SLURM_STEP_TASKS_PER_NODE={env['SLURM_STEP_TASKS_PER_NODE']!r} lists "
                    f"{len(per_node)} node(s) but SLURM_STEP_NUM_NODES={num_nodes}"
                )
            return cls(
                rank=_int_var(env, "SLURM_PROCID"),
                world_size=_int_var(env, "SLURM_STEP_NUM_TASKS"),
                local_rank=_int_var(env, "SLURM_LOCALID"),
                local_world_size=per_node[0],
                node_rank=_int_var(env, "SLURM_NODEID"),
                num_nodes=num_nodes,
                source="slurm",
            )
        raise LaunchError(
            "no rank environment: neither torchrun's RANK/WORLD_SIZE/LOCAL_RANK/... nor an srun "
            "step's SLURM_PROCID/... is set; start ranks with torchrun or srun"
        )

    def check_layout(
        self, expect_nodes: int | None = None, expect_tasks_per_node: int | None = None
    ) -> None:
        """Raise :class:`RankLayoutError` unless rank == node * tasks_per_node + local_rank.

        ``expect_nodes`` / ``expect_tasks_per_node``, when given, must match the step's shape.
        """
        problems = []
        if expect_nodes is not None and self.num_nodes != expect_nodes:
            problems.append(f"{self.num_nodes} node(s), expected {expect_nodes}")
        if expect_tasks_per_node is not None and self.local_world_size != expect_tasks_per_node:
            problems.append(
                f"{self.local_world_size} rank(s) per node, expected {expect_tasks_per_node}"
            )
        if self.rank != self.expected_rank:
            problems.append(
                f"rank {self.rank} is local rank {self.local_rank} on node {self.node_rank}, so "
                f"block placement expects rank {self.expected_rank} "
                f"(= node {self.node_rank} * {self.local_world_size} + local {self.local_rank}); "
                "launch with 'srun --distribution=block' (not cyclic/plane/arbitrary)"
            )
        if problems:
            raise RankLayoutError(
                f"rank layout refused ({self.source}, rank {self.rank}): " + "; ".join(problems)
            )


def check_slurm_distribution(environ: Mapping[str, str] | None = None) -> None:
    """Refuse an srun step whose task distribution is not block across nodes.

    srun exports ``SLURM_DISTRIBUTION`` to its tasks; only the first (node-level) field
    decides rank placement, so ``block`` and ``block:cyclic`` are fine, ``cyclic`` is not.
    """
    env = os.environ if environ is None else environ
    dist = env.get("SLURM_DISTRIBUTION")
    if dist is None or "SLURM_PROCID" not in env:
        return
    if dist.split(":", 1)[0] != "block":
        raise RankLayoutError(
            f"SLURM_DISTRIBUTION={dist!r}: detkit's TP/CP layout needs block placement of "
            "ranks on nodes (rank = node * tasks_per_node + local_rank); launch with "
            "'srun --distribution=block'"
        )


def _as_timedelta(timeout: float | _dt.timedelta) -> _dt.timedelta:
    td = timeout if isinstance(timeout, _dt.timedelta) else _dt.timedelta(seconds=timeout)
    if td.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {td.total_seconds()} s")
    return td


def init_process_group(
    rank_env: RankEnv, device: str, timeout: float | _dt.timedelta = DEFAULT_TIMEOUT_S
) -> str:
    """Start the default process group for ``rank_env``; return the backend name.

    ``device="cpu"`` uses gloo; ``device="cuda"`` needs every GPU of the node visible
    (``torch.cuda.device_count() >= local_world_size``), sets the current device to
    ``local_rank`` and uses NCCL. Rendezvous is ``env://`` (``MASTER_ADDR``/``MASTER_PORT``).
    An already started group is accepted only if it has the same rank, size and backend.
    """
    if device not in DEVICES:
        raise ValueError(f"device={device!r}; supported: {', '.join(DEVICES)}")
    backend = BACKEND_FOR_DEVICE[device]
    td = _as_timedelta(timeout)

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        have = (dist.get_rank(), dist.get_world_size(), dist.get_backend())
        if have != (rank_env.rank, rank_env.world_size, backend):
            raise RuntimeError(
                f"a process group is already initialised as (rank, size, backend)={have}, "
                f"not {(rank_env.rank, rank_env.world_size, backend)}"
            )
        return backend
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise LaunchError(
            f"{' and '.join(missing)} not set: env:// rendezvous needs the first node's "
            "address and a free port (slurm/2x2.sh and torchrun set them)"
        )
    kwargs: dict[str, Any] = {}
    if device == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device=cuda but torch.cuda.is_available() is False "
                f"(CUDA_VISIBLE_DEVICES={visible}, torch {torch.__version__})"
            )
        count = torch.cuda.device_count()
        if count < rank_env.local_world_size:
            raise RuntimeError(
                f"{count} GPU(s) visible to local rank {rank_env.local_rank} "
                f"(CUDA_VISIBLE_DEVICES={visible}) but {rank_env.local_world_size} ranks share "
                "this node: detkit expects every GPU of the node visible to every rank "
                "(do not bind one GPU per task with --gpus-per-task or --gpu-bind)"
            )
        if not dist.is_nccl_available():
            raise RuntimeError("device=cuda but this torch build has no NCCL backend")
        torch.cuda.set_device(rank_env.local_rank)
        kwargs["device_id"] = torch.device("cuda", rank_env.local_rank)
    elif not dist.is_gloo_available():
        raise RuntimeError("device=cpu but this torch build has no gloo backend")
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank_env.rank,
        world_size=rank_env.world_size,
        timeout=td,
        **kwargs,
    )
    return backend


def all_reduce_check(rank_env: RankEnv, device: str) -> list[float]:
    """All-reduce [rank + 1, 1] with SUM and require exactly [W(W+1)/2, W].

    Small integers are exact in fp32, so any other value is a broken collective.
    """
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", rank_env.local_rank) if device == "cuda" else torch.device("cpu")
    t = torch.tensor([rank_env.rank + 1.0, 1.0], dtype=torch.float32, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    got = t.cpu().tolist()
    w = rank_env.world_size
    want = [w * (w + 1) / 2.0, float(w)]
    if got != want:
        raise RuntimeError(f"all_reduce sanity check: got {got}, expected {want} (world {w})")
    return got


def _rank_record(rank_env: RankEnv, device: str, backend: str) -> dict[str, Any]:
    import torch

    rec: dict[str, Any] = asdict(rank_env)
    rec.update(
        hostname=socket.gethostname(),
        pid=os.getpid(),
        device=device,
        backend=backend,
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        master_addr=os.environ.get("MASTER_ADDR"),
        master_port=os.environ.get("MASTER_PORT"),
        slurm_job_id=os.environ.get("SLURM_JOB_ID"),
        slurm_step_id=os.environ.get("SLURM_STEP_ID"),
        torch_version=torch.__version__,
    )
    if device == "cuda":
        rec["cuda_device"] = torch.cuda.current_device()
        rec["gpu_name"] = torch.cuda.get_device_name(rank_env.local_rank)
    return rec


def build_rank_map(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge per-rank records into the job's rank map; refuse an inconsistent layout.

    Every rank must appear once, all ranks of a node id must share one hostname, and every
    node must hold local ranks 0..T-1. Two node ids on one hostname (torchrun "nodes" on one
    machine) are allowed but recorded as ``inter_node: false``: such a run covers no
    inter-node group.
    """
    if not records:
        raise RankLayoutError("no rank records to merge")
    world = records[0]["world_size"]
    ranks = sorted(r["rank"] for r in records)
    if ranks != list(range(world)):
        raise RankLayoutError(f"rank records {ranks} do not cover 0..{world - 1} exactly once")
    nodes: dict[int, dict[str, Any]] = {}
    for rec in sorted(records, key=lambda r: r["rank"]):
        node = nodes.setdefault(
            rec["node_rank"], {"node_rank": rec["node_rank"], "hostnames": set(), "ranks": []}
        )
        node["hostnames"].add(rec["hostname"])
        node["ranks"].append(rec["rank"])
    problems = []
    for nid, node in sorted(nodes.items()):
        if len(node["hostnames"]) != 1:
            problems.append(f"node {nid} spans hosts {sorted(node['hostnames'])}")
        locals_ = sorted(r["local_rank"] for r in records if r["node_rank"] == nid)
        if locals_ != list(range(len(locals_))):
            problems.append(f"node {nid} has local ranks {locals_}")
    if problems:
        raise RankLayoutError("inconsistent rank map: " + "; ".join(problems))
    node_list = [
        {"node_rank": nid, "hostname": next(iter(n["hostnames"])), "ranks": n["ranks"]}
        for nid, n in sorted(nodes.items())
    ]
    hosts = {n["hostname"] for n in node_list}
    first = records[0]
    return {
        "layout": "rank = node_rank * local_world_size + local_rank",
        "world_size": world,
        "num_nodes": first["num_nodes"],
        "local_world_size": first["local_world_size"],
        "source": first["source"],
        "device": first["device"],
        "backend": first["backend"],
        "distinct_hosts": len(hosts),
        "inter_node": len(hosts) > 1,
        "nodes": node_list,
        "ranks": sorted(records, key=lambda r: r["rank"]),
    }


def _merge_rank_map(out_dir: Path, gathered: list[dict[str, Any]]) -> str:
    """Rank 0: write OUT/rank_map.json; return "" or why the map is refused."""
    ranks_dir = out_dir / "ranks"
    unseen = [r["rank"] for r in gathered if not (ranks_dir / f"rank-{r['rank']}.json").is_file()]
    if unseen:
        return (
            f"rank 0 cannot see {ranks_dir}/rank-R.json for ranks {unseen}: the results folder "
            "must be on storage shared by all nodes"
        )
    try:
        rank_map = build_rank_map(gathered)
    except RankLayoutError as exc:
        return str(exc)
    (out_dir / "rank_map.json").write_text(json.dumps(rank_map, indent=2) + "\n")
    return ""


def run_check(
    out_dir: Path,
    device: str,
    timeout: float = DEFAULT_TIMEOUT_S,
    expect_nodes: int | None = None,
    expect_tasks_per_node: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> RankEnv:
    """The per-rank check behind ``python -m detkit.toolkit.launch check``.

    Layout checks run before anything is started. Each rank then writes
    ``OUT/ranks/rank-R.json``; rank 0 merges the gathered records into ``OUT/rank_map.json``
    and requires every per-rank file to be visible (the results folder must be shared).
    """
    if device not in DEVICES:
        raise LaunchError(f"device={device!r}; supported: {', '.join(DEVICES)}")
    rank_env = RankEnv.from_environ(environ)
    rank_env.check_layout(expect_nodes, expect_tasks_per_node)
    if rank_env.source == "slurm":
        check_slurm_distribution(environ)

    import torch.distributed as dist

    backend = init_process_group(rank_env, device, timeout)
    try:
        all_reduce_check(rank_env, device)
        record = _rank_record(rank_env, device, backend)
        ranks_dir = out_dir / "ranks"
        ranks_dir.mkdir(parents=True, exist_ok=True)
        (ranks_dir / f"rank-{rank_env.rank}.json").write_text(json.dumps(record, indent=2) + "\n")
        gathered: list[Any] = [None] * rank_env.world_size
        dist.all_gather_object(gathered, record)  # also a barrier: every file is written
        verdict = [""]
        if rank_env.rank == 0:
            verdict[0] = _merge_rank_map(out_dir, gathered)
        # Rank 0's verdict goes to every rank, so all of them fail together instead of the
        # others waiting for a timeout.
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            raise RuntimeError(f"rank map refused by rank 0: {verdict[0]}")
    finally:
        dist.destroy_process_group()
    return rank_env


# ----------------------------------------------------------------------------- ranks started here
@dataclass(frozen=True)
class RankRun:
    """One job of ``nproc`` ranks started on this host, holding the layout ranks ``world``."""

    label: str
    nproc: int
    world: str  # DETKIT_TPCP_WORLD


def local_rank_runs(device: str, gpu_count: int) -> list[RankRun]:
    """The rank jobs this host can start for the multi-rank suites: 4 gloo ranks on loopback on the
    CPU; on CUDA 4 ranks with >= 4 GPUs, one TP group and one CP group (2 ranks each) with 2-3 GPUs,
    none with fewer."""
    if device == "cpu" or gpu_count >= 4:
        return [RankRun("4-rank", 4, "0,1,2,3")]
    if gpu_count >= 2:
        return [RankRun("tp-group", 2, "0,1"), RankRun("cp-group", 2, "0,2")]
    return []


class LocalRanks:
    """``nproc`` processes started as the ranks of one job on this host, the way torchrun starts
    its workers: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, and a rendezvous
    store that this process hosts on 127.0.0.1 (TORCHELASTIC_USE_AGENT_STORE=True: every rank is a
    client), so the store outlives any one rank. Each rank's stdout and stderr go to
    ``log_dir/rank-R.log``."""

    def __init__(self, target: list[str], nproc: int, env: Mapping[str, str], log_dir: Path,
                 timeout_s: float = DEFAULT_TIMEOUT_S, cwd: Path | None = None):
        import subprocess

        import torch.distributed as dist

        if nproc < 1:
            raise ValueError(f"nproc={nproc}; need >= 1")
        self.nproc, self.timeout_s, self.log_dir = nproc, float(timeout_s), Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=_as_timedelta(timeout_s))
        base = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
        base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self._store.port), WORLD_SIZE=str(nproc),
                    LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", TORCHELASTIC_USE_AGENT_STORE="True")
        self.killed: list[int] = []
        self.procs = []
        self.logs = [self.log_dir / f"rank-{rank}.log" for rank in range(nproc)]
        try:
            for rank in range(nproc):
                with open(self.logs[rank], "wb") as log:
                    self.procs.append(subprocess.Popen(
                        [sys.executable, *target], env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=cwd))
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait(self, stalled: Any = None, poll_s: float = 0.2) -> list[int]:
        """Wait for every rank; return the exit codes (negative: killed by that signal).

        Once a rank has failed, the others get the collective timeout plus 30 s to end, then are
        killed. ``stalled()`` (optional) returns the ranks the survivors named as not answering;
        they are killed as soon as every other rank has ended."""
        import time

        deadline = None
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                return codes
            now = time.monotonic()
            if deadline is None and any(c not in (None, 0) for c in codes):
                deadline = now + self.timeout_s + 30
            silent = set(stalled() if stalled is not None and deadline is not None else ())
            others_done = all(c is not None for r, c in enumerate(codes) if r not in silent)
            if (silent and others_done) or (deadline is not None and now > deadline):
                self.kill()
            time.sleep(poll_s)

    def kill(self) -> None:
        """SIGKILL every rank still running (it also ends a stopped one)."""
        for rank, proc in enumerate(self.procs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                self.killed.append(rank)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m detkit.toolkit.launch", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check", help="check rank layout, start the process group, write rank map"
    )
    check.add_argument(
        "--out", type=Path, required=True, help="results folder (shared by all nodes)"
    )
    check.add_argument(
        "--device",
        choices=DEVICES,
        default=os.environ.get("DETKIT_DEVICE", "cuda"),
        help="cpu: gloo; cuda: NCCL on GPU local_rank (default: $DETKIT_DEVICE or cuda)",
    )
    check.add_argument(
        "--timeout",
        type=float,
        default=os.environ.get("DETKIT_DIST_TIMEOUT_S", str(DEFAULT_TIMEOUT_S)),
        help="seconds for rendezvous and collectives (default: $DETKIT_DIST_TIMEOUT_S or 300)",
    )
    check.add_argument("--expect-nodes", type=int, default=None)
    check.add_argument("--expect-tasks-per-node", type=int, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    who = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "?"))
    try:
        rank_env = run_check(
            args.out, args.device, args.timeout, args.expect_nodes, args.expect_tasks_per_node
        )
    except LaunchError as exc:
        print(f"detkit launch check: rank {who}: REFUSED: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:  # noqa: BLE001 -- report any start-up failure as one clear line
        print(
            f"detkit launch check: rank {who}: FAILED: {type(exc).__name__}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    log.info(
        "rank check passed: rank %d/%d node %d local %d on %s (%s)",
        rank_env.rank, rank_env.world_size, rank_env.node_rank, rank_env.local_rank,
        socket.gethostname(), rank_env.source,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
