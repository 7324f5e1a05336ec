"""The tp-cp suites through the CLI: the 4-rank report (torchrun, gloo, interpreter, tiny layout), the
2-rank CP-only world, the single-process refs suite and the refusal of tp-cp outside a rank launch;
plus the launcher-side helpers of toolkit/dist.py that need no process group."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.torchrun import run_ranks
from detkit.toolkit.dist import launched_as_ranks, rows_path, timeout_s, world_from_env, writes_report

REPO = Path(__file__).resolve().parents[1]
CPU_TIMEOUT_S = 240

CHECKS_4_RANKS = {
    "placement", "tp1_equal", "contract_local", "repeatability", "collectives", "pre_reduce", "post_reduce",
    "group_free_reference", "contract_pre", "contract_post", "cp_offsets", "cp_rebuild", "contract_cp_rebuild",
    "exact_local", "exact_pre", "exact_post", "exact_cp_rebuild",
}


def audit_under_torchrun(out: Path, nproc: int, device: str, timeout: float, **env) -> subprocess.CompletedProcess:
    return run_ranks(["-m", "detkit", "audit", "--device", device, "--suite", "tp-cp", "--out", str(out)],
                     nproc, device, timeout, env_extra=env)


def _load(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def _rows(report: dict, check: str | None = None) -> list[dict]:
    return [r for r in report["rows"] if check is None or r["check"] == check]


# ------------------------------------------------------------------------------ 4 ranks, CPU
@pytest.fixture(scope="module")
def four_rank_report(tmp_path_factory):
    from tests.test_container_build import skip_where_the_main_job_runs

    skip_where_the_main_job_runs("starts these 4 ranks and checks their report with check_4_rank_tp_cp")
    out = tmp_path_factory.mktemp("tp_cp_4")
    proc = audit_under_torchrun(out, 4, "cpu", CPU_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, _load(out), proc


def check_4_rank_tp_cp(out: Path, report: dict, timeout_s: float) -> None:
    """The tp-cp suite's rows and meta in the report folder ``out`` of a 4-rank gloo run on the CPU: its own launch
    here, or the ranks the README main job's --suite all starts (with the invariance suite beside it)."""
    rows = [r for r in report["rows"] if r["suite"] == "tp_cp"]
    assert rows and all(r["passed"] for r in report["rows"])
    assert {r["details"]["rank"] for r in rows} == {0, 1, 2, 3}
    assert {r["check"] for r in rows} == CHECKS_4_RANKS
    # The merged report: every rank's rows, each rank's own file beside it.
    assert report["meta"]["distributed"]["rows_per_rank"] == [
        sum(r["details"]["rank"] == k for r in report["rows"]) for k in range(4)]
    merged = (out / "rows.jsonl").read_text().splitlines()
    assert len(merged) == len(report["rows"])
    for rank in range(4):
        assert (out / "ranks" / f"rows-rank{rank}.jsonl").is_file()
    # Both tracks on every group.
    names = {(r["check"], r["name"].split(" [")[0], r["details"]["rank"]) for r in rows}
    specs = ("gate_fwd", "up_fwd", "down_fwd", "gate_dx", "up_dx", "gate_dw", "up_dw", "down_dw", "down_dhidden")
    for rank in range(4):
        for spec in specs:
            assert ("repeatability", spec, rank) in names, (spec, rank)
    groups = {tuple(r["details"]["group"]) for r in rows if r["check"] == "post_reduce"}
    assert groups == {(0, 1), (2, 3), (0, 2), (1, 3)}
    meta = report["meta"]
    assert meta["groups"] == {"tp": [[0, 1], [2, 3]], "cp": [[0, 2], [1, 3]]}
    assert sorted(meta["specs_run"]) == sorted(specs)
    # Collective counts: the forward of gate / up and down's dhidden reduce nothing.
    reps = meta["repeatability"]
    for row in (r for r in rows if r["check"] == "collectives"):
        spec = row["name"].split(" [")[0]
        d = row["details"]
        if spec in ("gate_fwd", "up_fwd", "down_dhidden"):
            assert d["observed"] == {} and d["reported"] == {}, row
        else:
            assert d["observed"] == {"all_reduce": reps}, row
            assert list(d["reported"].values()) == [reps], row
    # Meta.
    assert meta["backend"] == "triton_interpreter" and meta["hardware_result"] is False
    assert meta["collective_dtype"] == "torch.bfloat16"
    dist_meta = meta["distributed"]
    assert dist_meta["pg_backend"] == "gloo" and dist_meta["world_size"] == 4
    assert dist_meta["timeout_s"] == timeout_s and dist_meta["inter_node"] is False
    assert [r["rank"] for r in meta["rank_map"]] == [0, 1, 2, 3]
    assert [(r["cp"], r["tp"]) for r in meta["rank_map"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["hostname"] for r in meta["rank_map"])
    assert "topology" in meta and "env" in meta
    assert meta["tp_cp_layout"]["model"].startswith("tiny (TEST-ONLY")
    not_covered = " | ".join(meta["not_covered"])
    assert "covers no inter-node group" in not_covered
    assert "not a hardware result" in not_covered and "Qwen3-8B shapes: this run used tiny" in not_covered
    assert "TP groups across nodes" in not_covered
    covered = " | ".join(meta["covered"])
    assert "TP groups [[0, 1], [2, 3]]" in covered and "CP groups [[0, 2], [1, 3]]" in covered
    md = (out / "report.md").read_text()
    assert "## COVERED" in md and "## NOT COVERED" in md and "NOT a hardware result" in md
    # Drift statistics before and after the reduction.
    pre = [r for r in rows if r["check"] == "contract_pre"]
    post = [r for r in rows if r["check"] == "contract_post"]
    assert len(pre) == len(post) == 24
    for row in pre:
        assert {"pre_fp64_abs_max", "pre_fp64_abs_p95", "pre_fp64_abs_p99", "pre_fp64_ulp_max"} <= set(row["details"])
        assert row["details"]["worst_ratio"] <= 1.0
    for row in post:
        assert {"post_fp64_abs_max", "post_fp64_abs_p95", "post_fp64_abs_p99"} <= set(row["details"])


def test_4_rank_tp_cp_report(four_rank_report):
    out, report, proc = four_rank_report
    check_4_rank_tp_cp(out, report, timeout_s=100.0)
    assert report["meta"]["distributed"]["versions"]["torch"] == torch.__version__
    assert "report:" in proc.stdout  # only rank 0 prints the summary
    assert proc.stdout.count("report:") == 1


# ------------------------------------------------------------------------------ 2 ranks holding one CP group
def test_2_rank_cp_world_reports_what_it_did_not_cover(tmp_path):
    proc = audit_under_torchrun(tmp_path, 2, "cpu", CPU_TIMEOUT_S, DETKIT_TPCP_WORLD="0,2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = _load(tmp_path)
    assert all(r["passed"] for r in report["rows"])
    assert {tuple(r["details"]["group"]) for r in _rows(report, "post_reduce")} == {(0, 2)}
    assert {r["details"]["layout_rank"] for r in report["rows"]} == {0, 2}
    assert not [r for r in report["rows"] if r["name"].startswith(("down_fwd", "gate_dx", "up_dx"))]
    not_covered = " | ".join(report["meta"]["not_covered"])
    assert "TP groups [[0, 1], [2, 3]] (not held by world [0, 2])" in not_covered
    assert "CP groups [[1, 3]]" in not_covered


# ------------------------------------------------------------------------------ one process
def test_the_tp_cp_plugin_run_outside_ranks_yields_its_failed_launch_row():
    """What a caller that runs the plug-in itself, in one process, gets: the suite's own refusal. (`detkit audit`
    never gets here: a suite list naming tp-cp starts its ranks, or is refused before any work.)"""
    import torch

    from detkit.toolkit.harness import RowWriter, RunContext, run_plugins

    ctx = RunContext(device=torch.device("cpu"), backend="triton_interpreter", preset="tiny")
    rows = run_plugins(["tp-cp"], ctx, RowWriter(None))
    assert [(r.suite, r.check, r.passed) for r in rows] == [("tp_cp", "launch", False)]
    assert "not started as ranks" in rows[0].details["reason"]
    assert "torchrun --nproc-per-node 4" in rows[0].details["reason"]


# ------------------------------------------------------------------------------ helpers without a group
@pytest.mark.parametrize(("environ", "expected"), [
    ({}, False),
    ({"RANK": "0", "WORLD_SIZE": "1"}, False),
    ({"RANK": "0", "WORLD_SIZE": "4"}, True),
    ({"SLURM_PROCID": "0"}, False),  # the batch script itself is not a rank
    ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4"}, True),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, False),
])
def test_launched_as_ranks(environ, expected):
    assert launched_as_ranks(environ) is expected


def test_world_from_env():
    assert world_from_env(4, {}) == (0, 1, 2, 3)
    assert world_from_env(2, {}) == (0, 1)
    assert world_from_env(2, {"DETKIT_TPCP_WORLD": "0,2"}) == (0, 2)
    with pytest.raises(ValueError, match="3 ranks cannot hold the TP=2 x CP=2 layout"):
        world_from_env(3, {})
    with pytest.raises(ValueError, match="names 2 layout ranks but 4 processes run"):
        world_from_env(4, {"DETKIT_TPCP_WORLD": "0,1"})
    with pytest.raises(ValueError, match="expected comma-separated layout ranks"):
        world_from_env(2, {"DETKIT_TPCP_WORLD": "a,b"})


def test_timeout_knob():
    assert timeout_s({"DETKIT_DIST_TIMEOUT_S": "42"}) == 42.0
    with pytest.raises(ValueError, match="supported: a positive number of seconds"):
        timeout_s({"DETKIT_DIST_TIMEOUT_S": "0"})
    with pytest.raises(ValueError, match="is not a number of seconds"):
        timeout_s({"DETKIT_DIST_TIMEOUT_S": "soon"})


def test_single_process_paths():
    assert rows_path(None, Path("out")) == Path("out/rows.jsonl") and writes_report(None)


# ------------------------------------------------------------------------------ 2 GPUs, NCCL, Qwen3-8B shapes
def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


GPU_TIMEOUT_S = 900


@pytest.mark.multigpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs of one host with NCCL")
@pytest.mark.parametrize(("world", "missing"), [("0,1", "CP groups [[0, 2], [1, 3]]"),
                                                 ("0,2", "TP groups [[0, 1], [2, 3]]")])
def test_nccl_2_gpu_suite_qwen3_shapes(tmp_path, world, missing):
    proc = audit_under_torchrun(tmp_path, 2, "cuda", GPU_TIMEOUT_S, DETKIT_TPCP_WORLD=world)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = _load(tmp_path)
    assert all(r["passed"] for r in report["rows"])
    meta = report["meta"]
    assert meta["backend"] == "cuda_sm90" and meta["distributed"]["pg_backend"] == "nccl"
    assert meta["distributed"]["versions"]["nccl"]
    assert meta["tp_cp_layout"]["model"].startswith("qwen3-8b")
    assert all(r["pci_bus_id"] for r in meta["rank_map"])
    assert missing in " | ".join(meta["not_covered"])


# ------------------------------------------------------------------------------ ranks started by audit --suite all
def test_all_in_one_process_runs_tp_cp_and_invariance_on_4_local_gloo_ranks(tmp_path, monkeypatch):
    """The main job's command on a host without GPU: the single-process suites are replaced here (they have
    their own tests); tp-cp and invariance run for real on the 4 ranks the audit starts itself."""
    from tests.test_container_build import skip_where_the_main_job_runs

    skip_where_the_main_job_runs("starts these 4 ranks and checks their rows")
    from click.testing import CliRunner

    from detkit.toolkit import cli, harness
    from detkit.toolkit.harness import Row

    single = Row("gemm_contract", "bound", "stand-in single-process row", True, "triton_interpreter", {})
    def run_single(names, ctx, writer, on_row=None, on_plugin=None, **kwargs):
        writer.write(single)
        return [single]

    monkeypatch.setattr(harness, "run_plugins", run_single)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "DETKIT_TPCP_WORLD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DETKIT_DIST_TIMEOUT_S", "100")
    result = CliRunner().invoke(cli.main, ["audit", "--device", "cpu", "--suite", "all", "--out", str(tmp_path)],
                                catch_exceptions=False)
    logs = "".join(p.read_text()[-2000:] for p in sorted((tmp_path / "ranks-4-rank" / "logs").glob("*.log")))
    assert result.exit_code == 0, result.output + logs
    assert "starting tp-cp, invariance on 4 ranks of this host" in result.stderr
    report = _load(tmp_path)
    meta = report["meta"]
    assert meta["suite_selection"]["launched_on_local_ranks"] == ["tp-cp", "invariance"]
    assert not [s for s in meta["not_covered"] if s.startswith("suite ")]  # nothing skipped
    ranked = [r for r in report["rows"] if r["suite"] in ("tp_cp", "invariance")]
    assert {r["suite"] for r in ranked} == {"tp_cp", "invariance"}
    assert {r["details"]["rank"] for r in ranked} == {0, 1, 2, 3}
    assert all(r["passed"] for r in report["rows"]) and report["rows"][0]["name"] == single.name
    assert {r["check"] for r in ranked if r["suite"] == "tp_cp"} == CHECKS_4_RANKS
    assert meta["distributed"]["world_size"] == 4 and meta["distributed"]["pg_backend"] == "gloo"
    assert meta["groups"] == {"tp": [[0, 1], [2, 3]], "cp": [[0, 2], [1, 3]]}
    [run] = meta["rank_runs"]
    assert run["status"] == "PASSED" and run["exit_codes"] == [0, 0, 0, 0] and run["rows"] == len(ranked)
    assert meta["status"] == "PASSED" and meta["suite_seconds"]["ranks (tp-cp, invariance)"] > 0
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == len(report["rows"])


def test_suites_of_one_launch_keep_each_others_coverage_lines():
    """The README main job starts tp-cp and invariance in one launch: the second suite's meta must add its coverage
    lines to the first's (each line once), not replace them; other keys are set."""
    from detkit.toolkit.dist import DistSession

    session = DistSession(0, 4, 0, 0, "torchrun", "gloo", torch.device("cpu"), 100.0, None, None, None, [])
    session.add_meta({"covered": ["tp a", "shared"], "not_covered": ["tp x"], "specs_run": ["gate_fwd"]})
    session.add_meta({"covered": ["inv b", "shared"], "not_covered": ["inv y", "tp x"], "specs_run": ["other"]})
    assert session.meta == {"covered": ["tp a", "shared", "inv b"], "not_covered": ["tp x", "inv y"],
                            "specs_run": ["other"]}
