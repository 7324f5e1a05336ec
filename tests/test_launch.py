"""toolkit/launch.py: rank discovery, the block-layout check and a real 4-rank gloo start-up.

The multi-process test starts two torchrun agents ("nodes" 0 and 1) of two workers each on
this machine, so the ranks get torchrun's real environment and rendezvous over loopback.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from detkit.toolkit.launch import (
    LaunchError,
    RankEnv,
    RankLayoutError,
    build_rank_map,
    check_slurm_distribution,
    init_process_group,
    parse_tasks_per_node,
)

REPO = Path(__file__).resolve().parents[1]


def torchrun_env(rank: int, local_rank: int, node: int, world: int = 4, per_node: int = 2):
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(node),
    }


def srun_env(procid: int, localid: int, nodeid: int, tasks_per_node: str = "2(x2)", **extra):
    env = {
        "SLURM_PROCID": str(procid), "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid), "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
    }
    env.update(extra)
    return env


@pytest.mark.parametrize(
    ("value", "expected"),
    [("2(x2)", [2, 2]), ("4", [4]), ("3,1", [3, 1]), ("2(x3),1", [2, 2, 2, 1])],
)
def test_parse_tasks_per_node(value, expected):
    assert parse_tasks_per_node(value) == expected


@pytest.mark.parametrize("value", ["", "2x2", "2(2)", "a", "2,,2"])
def test_parse_tasks_per_node_refuses_garbage(value):
    with pytest.raises(LaunchError, match="cannot parse tasks-per-node"):
        parse_tasks_per_node(value)


def test_from_torchrun_environment():
    env = RankEnv.from_environ(torchrun_env(rank=3, local_rank=1, node=1))
    assert env == RankEnv(
        rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1, num_nodes=2,
        source="torchrun",
    )
    assert env.expected_rank == 3


def test_from_srun_environment():
    env = RankEnv.from_environ(srun_env(procid=2, localid=0, nodeid=1))
    assert env == RankEnv(
        rank=2, world_size=4, local_rank=0, local_world_size=2, node_rank=1, num_nodes=2,
        source="slurm",
    )


def test_torchrun_variables_win_over_slurm():
    # torchrun started under srun: its workers are the ranks, not the srun tasks.
    env = {**srun_env(procid=0, localid=0, nodeid=0), **torchrun_env(3, 1, 1)}
    assert RankEnv.from_environ(env).source == "torchrun"


def test_no_rank_environment_is_refused():
    with pytest.raises(LaunchError, match="no rank environment"):
        RankEnv.from_environ({"PATH": "/usr/bin"})


def test_partial_torchrun_environment_names_the_missing_variables():
    with pytest.raises(LaunchError, match="LOCAL_WORLD_SIZE, GROUP_RANK missing"):
        RankEnv.from_environ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"})


def test_batch_step_is_not_a_rank():
    # The batch script has SLURM_PROCID=0 but no step variables: running the check there
    # (without srun) would make a lone "rank 0" wait for three ranks that never come.
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    with pytest.raises(LaunchError, match="not started by srun"):
        RankEnv.from_environ(batch)


def test_non_integer_is_refused():
    with pytest.raises(LaunchError, match=r"SLURM_LOCALID='x' is not an integer"):
        RankEnv.from_environ(srun_env(procid=0, localid=0, nodeid=0, SLURM_LOCALID="x"))


def test_uneven_tasks_per_node_is_refused():
    env = srun_env(procid=0, localid=0, nodeid=0, tasks_per_node="3,1")
    with pytest.raises(LaunchError, match="uneven tasks per node"):
        RankEnv.from_environ(env)


def test_tasks_per_node_must_list_every_node():
    env = srun_env(procid=0, localid=0, nodeid=0, tasks_per_node="2(x3)")
    with pytest.raises(LaunchError, match="lists 3 node"):
        RankEnv.from_environ(env)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"local_rank": 2}, r"local_rank=2 is outside \[0, 2\)"),
        ({"rank": 4}, r"rank=4 is outside \[0, 4\)"),
        ({"node_rank": -1}, r"node_rank=-1 is outside \[0, 2\)"),
        ({"world_size": 6}, "world_size=6 != num_nodes=2 x local_world_size=2"),
        ({"source": "mpirun"}, "source='mpirun'"),
    ],
)
def test_rank_env_validates_its_fields(fields, message):
    base = dict(rank=0, world_size=4, local_rank=0, local_world_size=2, node_rank=0,
                num_nodes=2, source="slurm")
    with pytest.raises(LaunchError, match=message):
        RankEnv(**{**base, **fields})


@pytest.mark.parametrize("rank", range(4))
def test_block_layout_passes_for_every_rank(rank):
    node, local = divmod(rank, 2)
    RankEnv.from_environ(srun_env(rank, local, node)).check_layout(2, 2)


@pytest.mark.parametrize(
    ("procid", "localid", "nodeid", "expected"),
    # srun --distribution=cyclic puts ranks 0,2 on node 0 and 1,3 on node 1.
    [(1, 0, 1, 2), (2, 1, 0, 1)],
)
def test_cyclic_placement_is_refused(procid, localid, nodeid, expected):
    env = RankEnv.from_environ(srun_env(procid, localid, nodeid))
    with pytest.raises(RankLayoutError) as info:
        env.check_layout(2, 2)
    msg = str(info.value)
    assert f"rank {procid} is local rank {localid} on node {nodeid}" in msg
    assert f"block placement expects rank {expected}" in msg
    assert "srun --distribution=block" in msg


def test_wrong_shape_is_refused_with_both_counts():
    env = RankEnv.from_environ(torchrun_env(rank=1, local_rank=1, node=0, world=4, per_node=4))
    with pytest.raises(RankLayoutError) as info:
        env.check_layout(expect_nodes=2, expect_tasks_per_node=2)
    assert "1 node(s), expected 2" in str(info.value)
    assert "4 rank(s) per node, expected 2" in str(info.value)


@pytest.mark.parametrize("dist", ["block", "block:cyclic", "block:block:fcyclic"])
def test_block_distribution_is_accepted(dist):
    check_slurm_distribution(srun_env(0, 0, 0, SLURM_DISTRIBUTION=dist))


@pytest.mark.parametrize("dist", ["cyclic", "cyclic:block", "plane=2", "arbitrary"])
def test_other_distributions_are_refused(dist):
    with pytest.raises(RankLayoutError, match=f"SLURM_DISTRIBUTION='{dist}'"):
        check_slurm_distribution(srun_env(0, 0, 0, SLURM_DISTRIBUTION=dist))


def test_distribution_outside_a_step_is_ignored():
    check_slurm_distribution({"SLURM_DISTRIBUTION": "cyclic"})


def _records(hosts=("a", "a", "b", "b")):
    return [
        {"rank": r, "world_size": 4, "local_rank": r % 2, "local_world_size": 2,
         "node_rank": r // 2, "num_nodes": 2, "source": "slurm", "device": "cpu",
         "backend": "gloo", "hostname": hosts[r]}
        for r in range(4)
    ]


def test_rank_map_groups_ranks_by_node():
    rank_map = build_rank_map(list(reversed(_records())))
    assert rank_map["nodes"] == [
        {"node_rank": 0, "hostname": "a", "ranks": [0, 1]},
        {"node_rank": 1, "hostname": "b", "ranks": [2, 3]},
    ]
    assert rank_map["inter_node"] is True and rank_map["distinct_hosts"] == 2
    assert [r["rank"] for r in rank_map["ranks"]] == [0, 1, 2, 3]


def test_rank_map_marks_single_host_runs():
    rank_map = build_rank_map(_records(hosts=("h",) * 4))
    assert rank_map["inter_node"] is False and rank_map["distinct_hosts"] == 1


def test_rank_map_refuses_a_node_on_two_hosts():
    with pytest.raises(RankLayoutError, match=r"node 0 spans hosts \['a', 'c'\]"):
        build_rank_map(_records(hosts=("a", "c", "b", "b")))


def test_rank_map_refuses_missing_ranks():
    with pytest.raises(RankLayoutError, match=r"rank records \[0, 1, 2\] do not cover 0..3"):
        build_rank_map(_records()[:3])


def test_rank_map_refuses_duplicate_local_ranks():
    recs = _records()
    recs[1]["local_rank"] = 0
    with pytest.raises(RankLayoutError, match=r"node 0 has local ranks \[0, 0\]"):
        build_rank_map(recs)


def test_init_refuses_unknown_device():
    env = RankEnv.from_environ(torchrun_env(0, 0, 0))
    with pytest.raises(ValueError, match="device='tpu'"):
        init_process_group(env, "tpu", 10)


def test_init_refuses_non_positive_timeout():
    env = RankEnv.from_environ(torchrun_env(0, 0, 0))
    with pytest.raises(ValueError, match="timeout must be positive"):
        init_process_group(env, "cpu", dt.timedelta(seconds=0))


def test_init_needs_rendezvous_address(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    env = RankEnv.from_environ(torchrun_env(0, 0, 0))
    with pytest.raises(LaunchError, match="MASTER_ADDR not set"):
        init_process_group(env, "cpu", 10)


def test_init_cuda_without_cuda_fails_closed(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here; this checks the refusal on a CPU-only host")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    env = RankEnv.from_environ(torchrun_env(0, 0, 0))
    with pytest.raises(RuntimeError, match=r"device=cuda but torch.cuda.is_available\(\) is False"):
        init_process_group(env, "cuda", 10)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "DETKIT_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def test_check_command_refuses_a_bad_layout_with_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "detkit.toolkit.launch", "check", "--out", str(tmp_path),
         "--device", "cpu", "--expect-nodes", "2", "--expect-tasks-per-node", "2"],
        env=_clean_env(**srun_env(procid=1, localid=0, nodeid=1)),
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "rank 1: REFUSED: rank layout refused (slurm, rank 1)" in proc.stderr
    assert "block placement expects rank 2" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
def test_four_gloo_ranks_under_two_torchrun_agents(tmp_path):
    port = str(_free_port())
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
             f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
             "-m", "detkit.toolkit.launch", "check", "--out", str(tmp_path), "--device", "cpu",
             "--timeout", "60", "--expect-nodes", "2", "--expect-tasks-per-node", "2"],
            cwd=REPO, env=_clean_env(OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [a.communicate(timeout=150)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)

    rank_map = json.loads((tmp_path / "rank_map.json").read_text())
    host = socket.gethostname()
    assert rank_map["nodes"] == [
        {"node_rank": 0, "hostname": host, "ranks": [0, 1]},
        {"node_rank": 1, "hostname": host, "ranks": [2, 3]},
    ]
    # Both "nodes" are this machine: the map must say no inter-node group was covered.
    assert (rank_map["inter_node"], rank_map["distinct_hosts"]) == (False, 1)
    assert (rank_map["source"], rank_map["backend"], rank_map["world_size"]) == (
        "torchrun", "gloo", 4
    )
    pids = {r["pid"] for r in rank_map["ranks"]}
    assert len(pids) == 4
    for r in rank_map["ranks"]:
        assert (r["node_rank"], r["local_rank"]) == divmod(r["rank"], 2)
        on_disk = json.loads((tmp_path / "ranks" / f"rank-{r['rank']}.json").read_text())
        assert on_disk == r


# ------------------------------------------------------------------------------ ranks started on this host
def test_local_rank_runs_fit_the_host():
    from detkit.toolkit.launch import RankRun, local_rank_runs

    assert local_rank_runs("cpu", 0) == [RankRun("4-rank", 4, "0,1,2,3")]
    assert local_rank_runs("cuda", 8) == [RankRun("4-rank", 4, "0,1,2,3")]
    assert local_rank_runs("cuda", 2) == local_rank_runs("cuda", 3) == [
        RankRun("tp-group", 2, "0,1"), RankRun("cp-group", 2, "0,2")]
    assert local_rank_runs("cuda", 1) == []


def test_local_ranks_get_torchrun_variables_and_an_outside_store(tmp_path):
    from detkit.toolkit.launch import LocalRanks

    script = ("import os, json; print(json.dumps({k: os.environ.get(k) for k in ('RANK', 'WORLD_SIZE', "
              "'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'MASTER_ADDR', 'TORCHELASTIC_USE_AGENT_STORE', "
              "'SLURM_PROCID')}))")
    ranks = LocalRanks(["-c", script], 3, {**os.environ, "SLURM_PROCID": "5"}, tmp_path / "logs", 30)
    assert ranks.wait() == [0, 0, 0] and ranks.killed == []
    seen = [json.loads(log.read_text()) for log in ranks.logs]
    assert [s["RANK"] for s in seen] == ["0", "1", "2"] == [s["LOCAL_RANK"] for s in seen]
    assert {(s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"], s["GROUP_RANK"], s["MASTER_ADDR"],
             s["TORCHELASTIC_USE_AGENT_STORE"], s["SLURM_PROCID"]) for s in seen} == {
        ("3", "3", "0", "127.0.0.1", "True", None)}


def test_local_ranks_kill_the_ones_named_stalled_once_the_others_ended(tmp_path):
    from detkit.toolkit.launch import LocalRanks

    ranks = LocalRanks(["-c", "import os, sys, time; r = int(os.environ['RANK']); time.sleep(600 if r == 1 else 0); "
                        "sys.exit(1)"], 3, dict(os.environ), tmp_path / "logs", 600)
    started = time.monotonic()
    codes = ranks.wait(stalled=lambda: [1], poll_s=0.05)
    assert codes[0] == codes[2] == 1 and codes[1] == -9 and ranks.killed == [1]
    assert time.monotonic() - started < 60
