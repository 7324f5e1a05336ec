"""The ``detkit audit`` command: suite selection (auto/all/unknown), progress, failure summary, the
report's content (env, distributed meta, failed rows, drift plot), and that a killed audit keeps
every finished row readable. Kernel work is avoided where the CLI wiring is what is tested (the
plug-in runner is replaced); the kill test runs the real contract audit under the interpreter."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from detkit.toolkit import cli, harness
from detkit.toolkit.harness import MULTI_RANK_SUITES, SUITES, Row, select_suites
from detkit.toolkit.reports import DRIFT_PLOT, MAX_FAILED_ROWS_MD, render_audit_markdown

REPO = Path(__file__).resolve().parents[1]
ROW_FIELDS = {"suite", "check", "name", "passed", "backend", "details"}
SINGLE = tuple(s for s in SUITES if s not in MULTI_RANK_SUITES)  # gemm, tp-cp-refs, and later suites


# ------------------------------------------------------------------------------ suite selection
@pytest.mark.parametrize(("requested", "device", "gpus", "world", "local", "suites", "skipped", "launched"), [
    (("auto",), "cpu", 0, 1, 4, ("gemm",), (), ()),
    (("auto",), "cpu", 0, 4, 0, ("gemm", "tp-cp"), (), ()),
    (("auto",), "cuda", 1, 1, 0, ("gemm",), ("tp-cp",), ()),
    (("auto",), "cuda", 2, 1, 2, ("gemm",), ("tp-cp",), ()),
    (("auto",), "cuda", 2, 2, 0, ("gemm", "tp-cp"), (), ()),
    (("all",), "cpu", 0, 1, 0, SINGLE, MULTI_RANK_SUITES, ()),  # a caller that cannot start ranks
    (("all",), "cpu", 0, 1, 4, SINGLE, (), MULTI_RANK_SUITES),  # detkit audit: 4 gloo ranks on loopback
    (("all",), "cuda", 1, 1, 0, SINGLE, MULTI_RANK_SUITES, ()),  # one GPU: skipped with the reason
    (("all",), "cuda", 2, 1, 2, SINGLE, (), MULTI_RANK_SUITES),
    (("all",), "cuda", 2, 2, 0, SINGLE + MULTI_RANK_SUITES, (), ()),
    (("gemm_contract", "tp-cp"), "cpu", 0, 1, 4, ("gemm_contract",), (), ("tp-cp",)),  # named: its ranks started
    (("invariance", "tp_cp"), "cuda", 2, 1, 2, (), (), ("invariance", "tp_cp")),  # a plug-in name too
    (("tp-cp", "gemm"), "cpu", 0, 4, 0, ("tp-cp", "gemm"), (), ()),  # launched as ranks: in this launch
    (("auto", "gemm", "tp-cp-refs"), "cuda", 1, 1, 0, ("gemm", "tp-cp-refs"), ("tp-cp",), ()),
])
def test_select_suites(requested, device, gpus, world, local, suites, skipped, launched):
    sel = select_suites(requested, device=device, gpu_count=gpus, world_size=world, local_ranks=local)
    assert sel.suites == suites
    assert tuple(s.split(":", 1)[0] for s in sel.skipped) == skipped
    assert sel.launched == launched
    assert sel.reasons or not set(requested) & {"auto", "all"}


def test_all_on_one_gpu_names_why_the_multi_rank_suites_are_skipped():
    sel = select_suites(["all"], device="cuda", gpu_count=1, world_size=1, local_ranks=0)
    assert sel.skipped[0].startswith("tp-cp: needs at least 2 GPUs of one host to start its ranks (1 visible)")


def test_all_never_fails_in_one_process():
    sel = select_suites(["all"], device="cpu", gpu_count=0, world_size=1)
    assert {"gemm", "tp-cp-refs"} <= set(sel.suites) and not set(sel.suites) & set(MULTI_RANK_SUITES)
    assert "tp-cp" in MULTI_RANK_SUITES and "torchrun --nproc-per-node 2" in sel.skipped[0]
    assert sel.launched == ()


def test_auto_refuses_a_host_without_gpu_unless_cpu():
    with pytest.raises(ValueError, match="no CUDA GPU.*--device cpu"):
        select_suites(["auto"], device="cuda", gpu_count=0, world_size=1)
    assert "interpreter" in select_suites(["auto"], device="cpu", gpu_count=0, world_size=1).reasons[0]


def test_unknown_suite_lists_known_names():
    with pytest.raises(ValueError, match=r"\['bogus'\] not known; known: \['auto', 'all', 'attention', 'gemm'"):
        select_suites(["gemm", "bogus"], device="cpu", gpu_count=0, world_size=1)


# ------------------------------------------------------------------------------ CLI wiring
def _invoke(args, monkeypatch, rows=None, calls=None):
    """Run ``detkit audit`` in-process with the plug-in runner replaced by ``rows``."""
    def fake_run_plugins(names, ctx, writer, on_row=None, on_plugin=None, **kwargs):
        if calls is not None:
            calls.append(tuple(names))
        for row in rows or []:
            on_plugin and on_plugin(row.suite)
            writer.write(row)
            on_row and on_row(row)
        return list(rows or [])

    monkeypatch.setattr(harness, "run_plugins", fake_run_plugins)
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    return CliRunner().invoke(cli.main, ["audit", *args], catch_exceptions=False)


def test_an_audit_report_names_the_tables_its_suites_loaded(tmp_path, monkeypatch):
    """The tables are read after the suites ran: a suite that imports the MoE layers puts their tables in the
    report, though the backend check before the work loads only det_gemm's."""
    import sys

    for name in [m for m in sys.modules if m.startswith("detkit.kernels.moe.layer")]:
        monkeypatch.delitem(sys.modules, name)

    def loads_moe(names, ctx, writer, on_row=None, on_plugin=None, **kwargs):
        from detkit.kernels.moe.configs import MOE_CONFIG_TABLE_VERSION  # noqa: F401 (what a MoE suite imports)

        return []

    monkeypatch.setattr(harness, "run_plugins", loads_moe)
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    CliRunner().invoke(cli.main, ["audit", "--device", "cpu", "--suite", "moe", "--out", str(tmp_path)],
                       catch_exceptions=False)
    tables = {t["name"] for t in json.loads((tmp_path / "report.json").read_text())["meta"]["config_tables"]}
    assert {"det_gemm", "moe_bf16"} <= tables, tables


def _row(passed=True, check="bound", name="contract det_gemm_fwd [M=1, N=56, K=40] bf16 b=kn", **details):
    return Row("gemm_contract", check, name, passed, "triton_interpreter", details)


def test_unknown_suite_fails_before_any_work(tmp_path, monkeypatch):
    calls = []
    result = _invoke(["--device", "cpu", "--suite", "nope", "--out", str(tmp_path / "o")], monkeypatch, calls=calls)
    assert result.exit_code == 2 and "known: ['auto', 'all'" in result.output
    assert calls == [] and not (tmp_path / "o").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: auto would not refuse")
def test_auto_without_gpu_is_refused_before_any_work(tmp_path, monkeypatch):
    calls = []
    result = _invoke(["--device", "cuda", "--suite", "auto", "--out", str(tmp_path / "o")], monkeypatch,
                     calls=calls)
    assert result.exit_code == 2 and "--device cpu" in result.output and calls == []


def _rank_result(tmp_path, rows, status="COMPLETE", codes=(0, 0, 0, 0), incomplete=None):
    from detkit.toolkit.dist import RankRunResult

    meta = {"distributed": {"world_size": 4}, "rank_map": [{"rank": r} for r in range(4)],
            "covered": ["TP groups [[0, 1], [2, 3]]"], "not_covered": ["inter-node groups"], "status": status}
    if incomplete:
        meta["incomplete"] = incomplete
    report = {"meta": meta, "rows": [r.as_dict() for r in rows]}
    return RankRunResult("4-rank", 4, "0,1,2,3", tmp_path / "ranks-4-rank", list(codes), [], report, rows, 1.0)


def test_all_in_one_process_starts_the_multi_rank_suites_and_merges_them(tmp_path, monkeypatch):
    from detkit.toolkit import dist

    calls, started = [], []
    ranked = [Row("tp_cp", "post_reduce", f"down_fwd [{r}]", True, "triton_interpreter", {"rank": r})
              for r in range(4)]

    def fake_ranks(runs, suites, ctx, out, echo=None):
        started.append(([(r.label, r.nproc, r.world) for r in runs], list(suites), ctx.device.type))
        return [_rank_result(out, ranked)]

    monkeypatch.setattr(dist, "run_on_local_ranks", fake_ranks)
    result = _invoke(["--device", "cpu", "--suite", "all", "--out", str(tmp_path)], monkeypatch, rows=[_row()],
                     calls=calls)
    assert result.exit_code == 0, result.output
    assert calls == [SINGLE]
    assert started == [([("4-rank", 4, "0,1,2,3")], list(MULTI_RANK_SUITES), "cpu")]
    report = json.loads((tmp_path / "report.json").read_text())
    meta = report["meta"]
    assert meta["suite_selection"]["launched_on_local_ranks"] == list(MULTI_RANK_SUITES)
    assert meta["suites"] == [*SINGLE, *MULTI_RANK_SUITES]
    assert [r["name"] for r in report["rows"]] == [_row().name, *(r.name for r in ranked)]
    assert meta["distributed"] == {"world_size": 4} and len(meta["rank_map"]) == 4
    assert "inter-node groups" in meta["not_covered"] and meta["rank_runs"][0]["status"] == "COMPLETE"
    assert not any(s.startswith("suite tp-cp") for s in meta["not_covered"])
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 5


def test_all_reports_an_incomplete_rank_run_as_failed(tmp_path, monkeypatch):
    from detkit.toolkit import dist

    why = "rank 2 (pid 7 on h) stopped answering in stage 'tp_cp: 4 rows done'"
    done = [Row("tp_cp", "post_reduce", "x", True, "triton_interpreter", {"rank": 0})]
    monkeypatch.setattr(dist, "run_on_local_ranks", lambda runs, suites, ctx, out, echo=None: [
        _rank_result(out, done, "INCOMPLETE", (1, 1, -9, 1), {"reason": why, "silent_ranks": [2]})])
    result = _invoke(["--device", "cpu", "--suite", "all", "--out", str(tmp_path)], monkeypatch, rows=[_row()])
    assert result.exit_code == 1
    assert f"FAILED ranks 4-rank: INCOMPLETE: {why}" in result.stderr
    meta = json.loads((tmp_path / "report.json").read_text())["meta"]
    assert meta["status"] == "INCOMPLETE" and meta["incomplete"]["silent_ranks"] == [2]
    assert (tmp_path / "report.md").read_text().startswith(f"# INCOMPLETE report: ranks 4-rank: {why}")
    assert meta["status_reason"] == f"ranks 4-rank: {why}"


def test_failed_rows_exit_nonzero_with_a_summary(tmp_path, monkeypatch):
    rows = [_row(), _row(False, worst_ratio=3.0), _row(False, check="repetitions", name="rep x")]
    result = _invoke(["--device", "cpu", "--suite", "gemm", "--out", str(tmp_path)], monkeypatch, rows=rows)
    assert result.exit_code == 1
    assert "FAILED: 2 row(s) in 2 check(s): gemm_contract/bound x1, gemm_contract/repetitions x1" in result.stderr
    assert "FAILED repetitions: rep x" in result.stderr
    meta = json.loads((tmp_path / "report.json").read_text())["meta"]
    why = "2 failed row(s) in 2 check(s): gemm_contract/bound x1, gemm_contract/repetitions x1"
    assert (meta["status"], meta["status_reason"]) == ("FAILED", why)
    assert f"\n**FAILED**: {why}\n" in (tmp_path / "report.md").read_text()
    assert result.stdout.rstrip().endswith(f"report: {tmp_path / 'report.md'} (FAILED)")


# ------------------------------------------------------------------------------ how a run ends: the report is written
def _plugin(monkeypatch, name: str, run) -> str:
    """A plug-in module ``detkit_test_plugins.<name>`` registered as suite ``name``."""
    import types

    module = types.ModuleType(f"detkit_test_plugins.{name}")
    module.NAME, module.DESCRIPTION, module.run = name, f"test plug-in {name}", run
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(SUITES, name, (module.__name__,))
    return name


def _ok_rows(ctx):
    yield Row("ok", "fine", "ok row", True, ctx.backend, {})


def _audit(args, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    return CliRunner().invoke(cli.main, ["audit", *args], catch_exceptions=False)


def test_a_suite_that_raises_fails_the_run_and_the_next_suite_still_runs(tmp_path, monkeypatch):
    def broken(ctx):
        yield Row("boom", "fine", "boom row", True, ctx.backend, {})
        raise RuntimeError("the fixture broke")

    _plugin(monkeypatch, "boom", broken)
    _plugin(monkeypatch, "ok", _ok_rows)
    result = _audit(["--device", "cpu", "--suite", "boom", "--suite", "ok", "--out", str(tmp_path)], monkeypatch)
    assert result.exit_code == 1
    assert "FAILED: 1 row(s) in 1 check(s): boom/suite_error x1" in result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    meta, rows = report["meta"], report["rows"]
    assert (meta["status"], meta["status_reason"]) == ("FAILED", "boom: RuntimeError: the fixture broke")
    assert [(r["suite"], r["check"], r["passed"]) for r in rows] == [
        ("boom", "fine", True), ("boom", "suite_error", False), ("ok", "fine", True)]
    error = rows[1]["details"]
    assert error["rows_before"] == 1 and error["missing_module"] is None
    assert "RuntimeError: the fixture broke" in error["traceback"]
    assert [json.loads(line)["check"] for line in (tmp_path / "rows.jsonl").read_text().splitlines()] == [
        "fine", "suite_error", "fine"]
    assert set(meta["suite_seconds"]) == {"boom", "ok"}
    md = (tmp_path / "report.md").read_text()
    assert "\n**FAILED**: boom: RuntimeError: the fixture broke\n" in md and "| boom    | suite_error |" in md


def test_a_dependency_missing_at_run_time_is_named_in_the_report(tmp_path, monkeypatch):
    def needs_a_package(ctx):
        try:
            import detkit_no_such_package  # noqa: F401
        except ImportError as exc:
            raise RuntimeError("this suite needs detkit_no_such_package") from exc
        yield  # pragma: no cover

    _plugin(monkeypatch, "needy", needs_a_package)
    _plugin(monkeypatch, "ok", _ok_rows)
    result = _audit(["--device", "cpu", "--suite", "needy", "--suite", "ok", "--out", str(tmp_path)], monkeypatch)
    assert result.exit_code == 1
    report = json.loads((tmp_path / "report.json").read_text())
    [row] = [r for r in report["rows"] if not r["passed"]]
    assert (row["check"], row["details"]["missing_module"]) == ("missing_dependency", "detkit_no_such_package")
    assert report["meta"]["status"] == "FAILED"
    assert report["meta"]["status_reason"] == (
        "needy: missing dependency 'detkit_no_such_package': RuntimeError: this suite needs detkit_no_such_package "
        "(from ModuleNotFoundError: No module named 'detkit_no_such_package')")
    assert [r["suite"] for r in report["rows"] if r["passed"]] == ["ok"]


def test_a_failure_outside_the_suites_still_writes_the_report(tmp_path, monkeypatch):
    from detkit.toolkit import dist

    def no_ranks(runs, suites, ctx, out, echo=None):
        raise OSError("cannot start the ranks")

    monkeypatch.setattr(dist, "run_on_local_ranks", no_ranks)
    _plugin(monkeypatch, "ok", _ok_rows)
    result = _audit(["--device", "cpu", "--suite", "ok", "--suite", "tp-cp", "--out", str(tmp_path)], monkeypatch)
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-2:] == [
        f"detkit audit: FAILED report: {tmp_path / 'report.md'}",
        "detkit audit: failed: OSError: cannot start the ranks (--debug or DETKIT_LOG_LEVEL=DEBUG shows the traceback)"]
    meta = json.loads((tmp_path / "report.json").read_text())["meta"]
    assert (meta["status"], meta["status_reason"]) == ("FAILED", "OSError: cannot start the ranks; not run: tp-cp")
    assert [r["suite"] for r in json.loads((tmp_path / "report.json").read_text())["rows"]] == ["ok"]


def test_a_named_multi_rank_suite_starts_its_ranks_as_all_does(tmp_path, monkeypatch):
    from detkit.toolkit import dist

    started = []
    ranked = [Row("tp_cp", "post_reduce", f"down_fwd [{r}]", True, "triton_interpreter", {"rank": r}) for r in range(4)]

    def fake_ranks(runs, suites, ctx, out, echo=None):
        started.append(([(r.label, r.nproc) for r in runs], list(suites)))
        return [_rank_result(out, ranked)]

    monkeypatch.setattr(dist, "run_on_local_ranks", fake_ranks)
    calls = []
    result = _invoke(["--device", "cpu", "--suite", "tp-cp", "--suite", "gemm_contract", "--out", str(tmp_path)],
                     monkeypatch, rows=[_row()], calls=calls)
    assert result.exit_code == 0, result.output
    assert calls == [("gemm_contract",)] and started == [([("4-rank", 4)], ["tp-cp"])]
    meta = json.loads((tmp_path / "report.json").read_text())["meta"]
    assert meta["status"] == "PASSED" and meta["suites"] == ["gemm_contract", "tp-cp"]


def test_select_suites_refuses_a_named_multi_rank_suite_it_cannot_start_ranks_for():
    for name in ("tp-cp", "invariance", "tp_cp"):
        with pytest.raises(ValueError, match=rf"--suite {name} needs several ranks: at least 2 GPUs of one host to "
                                             r"start them \(1 visible\); run torchrun --nproc-per-node 2"):
            select_suites([name], device="cuda", gpu_count=1, world_size=1, local_ranks=0)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_audit_writes_an_incomplete_report(tmp_path, sig):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    env.update(OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "detkit", "audit", "--device", "cpu", "--suite", "gemm_contract",
                             "--suite", "tp-cp-refs", "--out", str(out)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rows_file = out / "rows.jsonl"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if rows_file.is_file() and rows_file.read_bytes().count(b"\n") >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the audit ended before it could be stopped: {proc.stderr.read()[-2000:]}"
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    meta, rows = report["meta"], report["rows"]
    name = signal.Signals(sig).name
    assert meta["status"] == "INCOMPLETE"
    assert re.fullmatch(rf"interrupted by {name} in gemm_contract after (\d+) of its rows; \1 rows finished; "
                        r"not run: tp_cp_refs", meta["status_reason"]), meta["status_reason"]
    assert rows == [json.loads(line) for line in rows_file.read_text().splitlines()] and len(rows) >= 2
    assert meta["not_covered"][0] == f"INCOMPLETE: {meta['status_reason']}"
    assert (out / "report.md").read_text().startswith(f"# INCOMPLETE report: interrupted by {name}")
    assert f"detkit audit: INCOMPLETE: {meta['status_reason']}; report: {out / 'report.md'}" in stderr


def test_no_rows_is_a_failure(tmp_path, monkeypatch):
    result = _invoke(["--device", "cpu", "--suite", "gemm", "--out", str(tmp_path)], monkeypatch, rows=[])
    assert result.exit_code == 1 and "no rows were produced" in result.stderr


def test_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(cli.click, "progressbar", lambda *a, **k: made.append(k))
    result = _invoke(["--device", "cpu", "--suite", "gemm", "--out", str(tmp_path)], monkeypatch, rows=[_row()])
    assert result.exit_code == 0 and made == []  # CliRunner's stderr is not a terminal


def test_progress_bar_counts_plugins_and_rows(monkeypatch):
    class Bar:
        def __init__(self, **kwargs):
            self.kwargs, self.steps, self.items, self.closed = kwargs, 0, [], False

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.closed = True

        def update(self, n, item=None):
            self.steps += n
            self.items.append(item)

    bars = []
    monkeypatch.setattr(cli.click, "progressbar", lambda **k: bars.append(Bar(**k)) or bars[-1])
    progress = cli._Progress(2, enabled=True)
    progress.on_plugin("gemm_contract")
    progress.on_row(_row())
    progress.on_row(_row(False))
    progress.on_plugin("gemm_determinism")
    progress.close()
    bar = bars[0]
    assert bar.kwargs["length"] == 2 and bar.kwargs["file"] is sys.stderr
    assert bar.steps == 2 and bar.closed
    shown = [i for i in bar.items if i]
    assert "gemm_contract: 2 rows, 1 failed" in shown and shown[-1].startswith("gemm_determinism")
    assert cli._Progress(2, enabled=False)._bar is None


def test_report_carries_env_and_writes_the_drift_plot(tmp_path, monkeypatch):
    hist = {"ulp": {"0": 90, "1": 10}, "rel": {"0": 5, "<=0.01": 95}}
    rows = [_row(fp64_ulp_max=1.0, fp64_rel_max=0.01, worst_ratio=0.5, fp64_hist=hist)]
    result = _invoke(["--device", "cpu", "--suite", "gemm_contract", "--out", str(tmp_path)], monkeypatch, rows=rows)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    meta = report["meta"]
    assert set(meta["env"]) >= {"detkit", "python", "packages", "gpus", "host", "env_knobs"}  # the full capture
    assert meta["env_summary"]["torch"] == torch.__version__
    assert meta["plots"] == [DRIFT_PLOT]
    # Provenance: the tables of the kernel modules loaded (the backend check loads det_gemm) and the sources.
    from detkit.kernels.det_gemm.launch import CONFIG_TABLE_VERSION

    assert {"name": "det_gemm", "version": CONFIG_TABLE_VERSION, "module": "detkit.kernels.det_gemm.configs"} in \
        meta["config_tables"] and "config_table_version" not in meta
    assert meta["source"]["digest"].startswith("sha256:")
    assert meta["source"]["status"] in ("clean", "dirty", "unverified", "unknown")
    png = (tmp_path / DRIFT_PLOT).read_bytes()
    assert png.startswith(b"\x89PNG")
    md = (tmp_path / "report.md").read_text()
    assert "## Environment" in md and "NOT a hardware result" in md and f"![{DRIFT_PLOT}]({DRIFT_PLOT})" in md
    assert "| det_gemm_fwd |" in md  # the drift table per op
    # rel and ULP are defined over references outside their bound of zero; the elements left out are counted.
    header = next(line for line in md.splitlines() if line.startswith("| op "))
    assert "near_zero" in [cell.strip() for cell in header.split("|")]
    assert "(|c*| > bound)" in md and "near_zero counts the elements left out" in md
    assert f"- config tables: det_gemm {CONFIG_TABLE_VERSION}" in md and "- source: " in md
    lines = (tmp_path / "rows.jsonl").read_text().splitlines()
    assert [json.loads(line)["name"] for line in lines] == [r.name for r in rows]


def test_rows_file_is_truncated_when_a_folder_is_reused(tmp_path, monkeypatch):
    args = ["--device", "cpu", "--suite", "gemm", "--out", str(tmp_path)]
    _invoke(args, monkeypatch, rows=[_row(), _row()])
    _invoke(args, monkeypatch, rows=[_row()])
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 1


# ------------------------------------------------------------------------------ report.md rendering
def test_markdown_shows_distributed_meta_and_failed_rows_only():
    meta = {
        "command": "audit", "backend": "cuda_sm90", "date": "d", "preset": "qwen3-8b-tp2",
        "env_summary": {"gpu_name": "NVIDIA H200", "torch": "2.11.0"},
        "distributed": {"world_size": 4, "source": "slurm", "pg_backend": "nccl", "hosts": ["a", "b"],
                        "inter_node": True, "rows_per_rank": [3, 3, 3, 3], "versions": {"nccl": "2.28.9"}},
        "rank_map": [{"rank": r, "layout_rank": r, "cp": r // 2, "tp": r % 2, "hostname": "ab"[r // 2],
                      "pci_bus_id": f"0000:{r}"} for r in range(4)],
        "groups": {"tp": [[0, 1], [2, 3]], "cp": [[0, 2], [1, 3]]},
        "covered": ["TP groups"], "not_covered": ["TP=4"],
    }
    rows = [Row("tp_cp", "post_reduce", f"down_fwd case {i}", i % 2 == 0, "cuda_sm90", {"rank": i % 4})
            for i in range(2 * MAX_FAILED_ROWS_MD + 6)]
    md = render_audit_markdown(meta, rows)
    assert md.count("**FAILED**") == 1 and "**PASSED**" not in md
    assert "## Distributed run" in md and "- world_size: 4" in md and "nccl 2.28.9" in md
    assert "- TP: [[0, 1], [2, 3]]" in md and "- CP: [[0, 2], [1, 3]]" in md
    assert "### Rank map" in md and "| 0000:3" in md
    assert "## COVERED" in md and "## NOT COVERED" in md
    assert "down_fwd case 1 " in md and "down_fwd case 0 " not in md  # passed rows stay in JSON only
    assert f"... {MAX_FAILED_ROWS_MD + 3 - MAX_FAILED_ROWS_MD} more failed rows" in md
    assert "NVIDIA H200" in md


# ------------------------------------------------------------------------------ killed audit
def test_killed_audit_keeps_every_finished_row(tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "detkit", "audit", "--device", "cpu", "--suite", "gemm_contract",
                             "--out", str(out)], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    rows_file = out / "rows.jsonl"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if rows_file.is_file() and rows_file.read_bytes().count(b"\n") >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the audit ended before it could be killed: {proc.stderr.read()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    text = rows_file.read_text()
    assert text.endswith("\n"), "a row was cut short"
    rows = [json.loads(line) for line in text.splitlines()]
    assert len(rows) >= 3
    for row in rows:
        assert set(row) == ROW_FIELDS and row["suite"] == "gemm_contract" and row["passed"] is True
        assert {"worst_ratio", "fp64_ulp_max", "fp64_hist"} <= set(row["details"])
    report = out / "report.json"
    if report.exists():  # written atomically or not at all
        assert json.loads(report.read_text())["rows"]


@pytest.mark.parametrize("suites, named", [
    (["gemm"], True), (["gemm_contract"], True), (["tp-cp"], True), (["model", "gemm"], True),
    (["model"], False), (["moe", "moe-fp8", "attention"], False), (["invariance"], False),
])
def test_a_report_names_the_shape_preset_only_when_a_suite_uses_it(suites, named):
    # The plug-ins that read ctx.preset, found in their sources: the reports of the others would name a preset
    # nothing ran at.
    readers = {m for m in harness.suite_modules(list(SUITES))
               if "ctx.preset" in Path(__import__(m, fromlist=["_"]).__file__).read_text()}
    assert readers == set(harness.PRESET_MODULES)
    assert harness.uses_preset(suites) is named
