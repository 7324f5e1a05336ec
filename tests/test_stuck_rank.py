"""A rank that stops answering mid-run: 4 gloo ranks of the CPU tp-cp suite, one of them stopped with
SIGSTOP after it has written a few rows. The other three must end within the collective timeout, each
with one line naming the stopped rank and its stage, and the lowest of them must merge every finished
row (the stopped rank's too) into a report marked INCOMPLETE. The ranks are started the way torchrun
and srun start theirs (toolkit.launch.LocalRanks: RANK/WORLD_SIZE/... and an outside store).

Also the pieces without processes: the heartbeat watch's verdicts and the merge of rows files."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from detkit.toolkit import dist
from detkit.toolkit.launch import LocalRanks
from tests.torchrun import REPO, rank_env

TIMEOUT_S = 20  # small: the survivors give up after half of it without a heartbeat from the stopped rank
STOPPED = 2


def _rows(path: Path) -> int:
    return path.read_text().count("\n") if path.is_file() else 0


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("stuck")
    env = {**rank_env("cpu"), "DETKIT_DIST_TIMEOUT_S": str(TIMEOUT_S)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "DETKIT_TPCP_WORLD"):
        env.pop(var, None)
    ranks = LocalRanks(["-m", "detkit", "audit", "--device", "cpu", "--suite", "tp-cp", "--out", str(out)],
                       4, env, out / "logs", TIMEOUT_S, cwd=REPO)
    stopped_rows = out / "ranks" / f"rows-rank{STOPPED}.jsonl"
    ended: dict[int, float] = {}
    try:
        deadline = time.monotonic() + 240
        while _rows(stopped_rows) < 3:
            codes = [p.poll() for p in ranks.procs]
            assert time.monotonic() < deadline and not any(c is not None for c in codes), (
                f"rank {STOPPED} wrote no 3 rows (exit codes {codes}): "
                + ranks.logs[STOPPED].read_text()[-3000:])
            time.sleep(0.05)
        os.kill(ranks.pids[STOPPED], signal.SIGSTOP)
        stopped_at = time.monotonic()
        rows_when_stopped = _rows(stopped_rows)
        while len(ended) < 3 and time.monotonic() - stopped_at < TIMEOUT_S + 60:
            for rank, proc in enumerate(ranks.procs):
                if rank != STOPPED and rank not in ended and proc.poll() is not None:
                    ended[rank] = time.monotonic() - stopped_at
            time.sleep(0.1)
        still_stopped = ranks.procs[STOPPED].poll() is None
    finally:
        ranks.kill()  # SIGKILL ends the stopped rank too
    codes = {rank: proc.returncode for rank, proc in enumerate(ranks.procs)}
    logs = {rank: log.read_text() for rank, log in enumerate(ranks.logs)}
    return out, ended, codes, logs, rows_when_stopped, still_stopped


def test_survivors_end_within_the_timeout_naming_the_stopped_rank_and_its_stage(stopped_run):
    out, ended, codes, logs, _, still_stopped = stopped_run
    survivors = [r for r in range(4) if r != STOPPED]
    assert sorted(ended) == survivors, f"ended: {ended}; logs: {[logs[r][-1500:] for r in survivors]}"
    assert still_stopped  # nothing but the test's SIGKILL ended the stopped rank
    for rank in survivors:
        assert ended[rank] < TIMEOUT_S, (rank, ended)
        assert codes[rank] == 1, (rank, codes, logs[rank][-2000:])
        lines = [ln for ln in logs[rank].splitlines() if "INCOMPLETE" in ln]
        assert len(lines) == 1, logs[rank][-3000:]
        assert lines[0].startswith(f"detkit audit: rank {rank}: INCOMPLETE: rank {STOPPED} (pid ")
        assert "stopped answering in stage 'tp_cp: " in lines[0] and ' rows done, last "' in lines[0]
        assert f"INCOMPLETE report: {out / 'report.md'} (written by rank 0)" in lines[0]
        assert "Traceback" not in logs[rank], logs[rank][-3000:]


def test_incomplete_report_merges_every_finished_row(stopped_run):
    out, _, _, _, rows_when_stopped, _ = stopped_run
    report = json.loads((out / "report.json").read_text())
    meta = report["meta"]
    assert meta["status"] == "INCOMPLETE"
    incomplete = meta["incomplete"]
    assert incomplete["silent_ranks"] == [STOPPED] and incomplete["failed_ranks"] == []
    assert incomplete["stages"][str(STOPPED)].startswith("tp_cp: ")
    counts = [_rows(out / "ranks" / f"rows-rank{r}.jsonl") for r in range(4)]
    assert incomplete["rows_per_rank"] == counts and counts[STOPPED] >= rows_when_stopped >= 3
    finished = [r for r in report["rows"] if r["suite"] == "tp_cp"]
    assert len(finished) == sum(counts)
    assert {r["details"]["rank"] for r in finished} == {0, 1, 2, 3}
    [marker] = [r for r in report["rows"] if r["suite"] == "distributed"]
    assert (marker["check"], marker["passed"], marker["details"]["rank"]) == ("rank_answered", False, STOPPED)
    assert meta["not_covered"][0].startswith(f"INCOMPLETE: rank {STOPPED} (pid ")
    assert len((out / "rows.jsonl").read_text().splitlines()) == len(report["rows"])
    md = (out / "report.md").read_text()
    assert md.startswith(f"# INCOMPLETE report: rank {STOPPED} (pid ")


# ------------------------------------------------------------------------------ without processes
def _alive(directory: Path, rank: int, beat: int, state: str = "running", stage: str = "s", error=None) -> None:
    (directory / f"alive-rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "pid": 100 + rank, "host": "h", "beat": beat, "stage": stage, "state": state, "error": error}))


def test_watch_names_a_rank_whose_beat_stops_and_one_that_failed(tmp_path):
    watch = dist.RankWatch(tmp_path, 0, interval=0.05, world_size=4, stale_s=0.2)
    for rank in (1, 2, 3):
        _alive(tmp_path, rank, beat=1, stage=f"stage {rank}")
    assert watch._look() is None  # first look: every beat is new
    time.sleep(0.25)
    _alive(tmp_path, 1, beat=2)  # still beating
    _alive(tmp_path, 3, beat=1, state="finished")  # ended normally: not a culprit
    diagnosis = watch._look()
    assert set(diagnosis.silent) == {2} and diagnosis.failed == {}
    assert "rank 2 (pid 102 on h) stopped answering in stage 'stage 2'" in diagnosis.culprits()
    _alive(tmp_path, 1, beat=3, state="error", error="ValueError: bad")
    diagnosis = watch._look()
    assert set(diagnosis.failed) == {1} and "rank 1 ended with an error in stage 's': ValueError: bad" in \
        diagnosis.culprits()


def test_watch_writes_its_beat_stage_and_end(tmp_path):
    watch = dist.RankWatch(tmp_path, 1, interval=0.05, world_size=2).start()
    watch.set_stage("tp_cp: 3 rows done")
    time.sleep(0.3)
    rec = json.loads((tmp_path / "alive-rank1.json").read_text())
    assert rec["beat"] >= 2 and rec["stage"] == "tp_cp: 3 rows done" and rec["state"] == "running"
    watch.end("finished")
    assert json.loads((tmp_path / "alive-rank1.json").read_text())["state"] == "finished"
    assert watch.claim() and not watch.claim()


def test_rows_from_rank_files_skip_a_line_cut_short(tmp_path):
    (tmp_path / "ranks").mkdir()
    row = {"suite": "tp_cp", "check": "c", "name": "n", "passed": True, "backend": "b", "details": {}}
    (tmp_path / "ranks" / "rows-rank0.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row)[:20])
    (tmp_path / "ranks" / "rows-rank1.jsonl").write_text(json.dumps(row) + "\n")
    rows, counts = dist.rows_from_rank_files(tmp_path, 3)
    assert counts == [1, 1, 0] and [r.details["rank"] for r in rows] == [0, 1]


def test_a_sealed_rows_file_takes_no_more_rows(tmp_path):
    """A rank that gives up seals its rows file (from its watch thread) before the INCOMPLETE report is merged: the
    main thread's later rows are dropped, so the file and the report's count for that rank stay equal."""
    from detkit.toolkit.records import RowWriter, seal_rows

    path = tmp_path / "ranks" / "rows-rank0.jsonl"
    writer = RowWriter(path)
    writer.write({"name": "a", "passed": True})
    seal_rows(tmp_path / "ranks" / ".." / "ranks" / "rows-rank0.jsonl")  # the same file by another spelling
    writer.write({"name": "b", "passed": True})
    assert [json.loads(line)["name"] for line in path.read_text().splitlines()] == ["a"]
    seal_rows(tmp_path / "never-opened.jsonl")  # no writer: nothing to do
    writer.close()  # closing a sealed writer is a no-op
