"""toolkit/benches.py, the benchmarks' runner, with a stand-in plug-in (no kernel work): the files it writes
(rows.jsonl line by line as rows come, report.json, report.md, plots), the exit status, every refusal before
any work, --json, --merge, the ranks hooks, the plug-in checks, and that building the CLI imports no kernel."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import click
import pytest
from click.testing import CliRunner

from detkit.toolkit import benches
from tests.bench_helpers import one_process, read_rows

REPO = Path(__file__).resolve().parents[1]


def standin(name: str = "standin", fail_at: int | None = None, rows_override=None, ranks: bool = False,
            finish_ok: bool | None = None, raise_at: int | None = None,
            interrupt_at: int | None = None) -> ModuleType:
    """A plug-in whose rows record how many rows the runner had written to rows.jsonl before each was made."""
    mod = ModuleType(f"detkit_test_{name}")
    mod.NAME, mod.DESCRIPTION, mod.RANKS = name, "A stand-in benchmark.", "ranks" if ranks else "single"
    mod.OPTIONS = (click.option("--cases", "n", type=int, default=3, show_default=True),)
    mod.PRESETS = ("p1", "p2")
    mod.calls = []

    def cases(ctx, n):
        if n < 0:
            raise ValueError(f"--cases must be >= 0; got {n}")
        mod.calls.append("cases")
        return [f"{name} case {i} [{ctx.preset}]" for i in range(n)]

    def run(ctx, cases, n, **session):
        mod.calls.append(("run", tuple(session)))
        rows_file = ctx.out_dir / "rows.jsonl"
        for i, case in enumerate(cases):
            if i == raise_at:
                raise RuntimeError("boom")
            if i == interrupt_at:
                raise KeyboardInterrupt  # what SIGINT (a time limit) raises in the running benchmark
            on_disk = len(rows_file.read_text().splitlines()) if rows_file.exists() else None
            row = {"name": case, "passed": i != fail_at, "rows_on_disk": on_disk, "rounds": ctx.rounds,
                   "preset": ctx.preset}
            if i == fail_at:
                row["failure"] = f"case {i} was told to fail"
            yield rows_override(row) if rows_override else row

    def summarize(rows, meta):
        return f"## {name} body\n\ntotal {meta['derived']['total']}\n"

    def derive(rows, meta):
        return {"total": sum(r["rows_on_disk"] or 0 for r in rows)}

    def plots(out_dir, rows):
        path = Path(out_dir) / f"{name}.png"
        path.write_bytes(b"\x89PNG\r\n\x1a\n")
        return [path]

    def start(ctx, out):
        mod.calls.append("start")
        return {"session": out}

    def finish(session, ok):
        mod.calls.append(("finish", ok))
        return ok if finish_ok is None else finish_ok

    mod.cases, mod.run, mod.summarize, mod.derive, mod.plots = cases, run, summarize, derive, plots
    if ranks:
        mod.start, mod.finish = start, finish
    return mod


@pytest.fixture
def invoke(monkeypatch):
    """Run ``detkit bench <name>`` for a stand-in plug-in in-process; returns (result, prepare calls)."""
    one_process(monkeypatch)

    def run(mod: ModuleType, args: list[str]):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        prepared = []
        group = click.Group("bench")
        benches.add_commands(group, prepare=lambda device, ranks: prepared.append((device, ranks)),
                             plugins=[mod.__name__])
        result = CliRunner().invoke(group, [mod.NAME, *args], catch_exceptions=False)
        return result, prepared

    return run


def test_rows_report_and_plots(invoke, tmp_path):
    mod = standin()
    result, prepared = invoke(mod, ["--device", "cpu", "--preset", "p2", "--rounds", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert prepared == [("cpu", False)]
    rows = read_rows(tmp_path)
    assert [r["name"] for r in rows] == [f"standin case {i} [p2]" for i in range(3)]
    assert [r["rows_on_disk"] for r in rows] == [0, 1, 2]  # each row on disk before the next was made
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["rows"] == rows and all(r["rounds"] == 2 for r in rows)
    meta = report["meta"]
    assert (meta["command"], meta["bench"], meta["preset"], meta["rounds"], meta["options"], meta["cases"]) == (
        "bench standin", "standin", "p2", 2, {"n": 3}, 3)
    assert meta["derived"] == {"total": 3} and meta["plots"] == ["standin.png"]
    assert meta["backend"] == "triton_interpreter" and meta["hardware_result"] is False
    assert any(t["name"] == "det_gemm" for t in meta["config_tables"])  # resolving the backend loads det_gemm
    assert meta["source"]["digest"].startswith("sha256:") and "env" in meta and "env_summary" in meta
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# detkit bench standin report") and "**PASS**: 3 row(s) passed, 0 failed" in md
    assert "NOT a hardware result" in md and "## standin body" in md and "total 3" in md
    assert "![standin.png](standin.png)" in md and "- config tables: det_gemm" in md and "## Environment" in md
    assert result.stdout.startswith(md)  # report.md on stdout


def test_a_failed_row_fails_the_run_with_its_reason(invoke, tmp_path):
    result, _ = invoke(standin(fail_at=1), ["--device", "cpu", "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert "FAILED: 1 of 3 row(s)" in result.stderr
    assert "FAILED standin case 1 [default]: case 1 was told to fail" in result.stderr
    assert "**FAIL**: 2 row(s) passed, 1 failed" in (tmp_path / "report.md").read_text()
    assert len(read_rows(tmp_path)) == 3


def test_an_interrupted_run_reports_the_rows_it_measured_and_fails(invoke, tmp_path):
    result, _ = invoke(standin(interrupt_at=2), ["--device", "cpu", "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert "FAILED: interrupted after 2 of 3 case(s); the report holds those" in result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["name"] for r in report["rows"]] == [r["name"] for r in read_rows(tmp_path)] and len(report["rows"]) == 2
    assert report["meta"]["interrupted_after_rows"] == 2
    assert "**FAIL**: 2 row(s) passed, 0 failed; INTERRUPTED after 2 of 3 case(s)" in (tmp_path / "report.md").read_text()


def test_no_rows_is_a_failure(invoke, tmp_path):
    result, _ = invoke(standin(), ["--device", "cpu", "--cases", "0", "--out", str(tmp_path)])
    assert result.exit_code == 1 and "FAILED: no rows were produced" in result.stderr


@pytest.mark.parametrize("args, message, prepared", [
    (["--cases", "-1"], "--cases must be >= 0; got -1", True),
    (["--rounds", "0"], "--rounds must be >= 1; got 0", False),
    (["--preset", "nope"], "preset(s) ['nope'] not known to bench standin; known: ['p1', 'p2']", True),
    (["--preset", "p1", "--preset", "p1"], "--preset values repeat: ['p1', 'p1']", True),
])
def test_refusals_before_any_work(invoke, tmp_path, args, message, prepared):
    mod = standin()
    result, prep = invoke(mod, ["--device", "cpu", "--out", str(tmp_path / "o"), *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "o").exists() and "run" not in [c if isinstance(c, str) else c[0] for c in mod.calls]
    assert bool(prep) == prepared  # --rounds is refused before the device is even selected


def test_json_prints_report_json(invoke, tmp_path):
    result, _ = invoke(standin(), ["--device", "cpu", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout) == json.loads((tmp_path / "report.json").read_text())


def test_a_row_without_name_or_passed_is_a_plugin_bug(invoke, tmp_path):
    mod = standin(rows_override=lambda row: {**row, "passed": "yes"})
    with pytest.raises(TypeError, match="without a str 'name' and a bool 'passed'"):
        invoke(mod, ["--device", "cpu", "--out", str(tmp_path)])


def test_ranks_hooks_frame_the_run(invoke, tmp_path):
    mod = standin(ranks=True)
    result, prepared = invoke(mod, ["--device", "cpu", "--out", str(tmp_path)])
    assert result.exit_code == 0 and prepared == [("cpu", True)]
    assert mod.calls == ["cases", "start", ("run", ("session",)), ("finish", True)]
    # Another rank failing makes this one fail too, though its own rows passed.
    mod = standin(ranks=True, finish_ok=False)
    result, _ = invoke(mod, ["--device", "cpu", "--out", str(tmp_path / "b")])
    assert result.exit_code == 1 and "another rank reported failed rows" in result.stderr
    # finish runs (and ends the process group) even when run raises; the finished rows stay on disk.
    mod = standin(ranks=True, raise_at=2)
    with pytest.raises(RuntimeError, match="boom"):
        invoke(mod, ["--device", "cpu", "--out", str(tmp_path / "c")])
    assert mod.calls[-1] == ("finish", False) and len(read_rows(tmp_path / "c")) == 2


def test_merge_reports_runs_together_and_refuses_what_does_not_fit(invoke, tmp_path):
    mod = standin()
    for preset in ("p1", "p2"):
        assert invoke(mod, ["--device", "cpu", "--preset", preset, "--out", str(tmp_path / preset)])[0].exit_code == 0
    result, prepared = invoke(mod, ["--merge", str(tmp_path / "p1"), "--merge", str(tmp_path / "p2"),
                                    "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert prepared == []  # nothing measured, no device
    report = json.loads((tmp_path / "m" / "report.json").read_text())
    assert [r["name"] for r in report["rows"]] == [f"standin case {i} [{p}]" for p in ("p1", "p2") for i in range(3)]
    assert [s["dir"] for s in report["meta"]["merged_from"]] == [str(tmp_path / "p1"), str(tmp_path / "p2")]
    assert read_rows(tmp_path / "m") == report["rows"]
    assert report["meta"]["derived"] == {"total": 6} and "merged from" in (tmp_path / "m" / "report.md").read_text()
    for args, message in (
            (["--merge", str(tmp_path / "p1"), "--merge", str(tmp_path / "p1")], "appears in more than one merged run"),
            (["--merge", str(tmp_path / "p1"), "--preset", "p1"], "it takes only --out and --json, not ['presets']"),
            (["--merge", str(tmp_path / "nope")], "report.json not found")):
        result, _ = invoke(mod, [*args, "--out", str(tmp_path / "x")])
        assert result.exit_code == 2 and message in result.output, result.output
    other = standin("other")
    result, _ = invoke(other, ["--merge", str(tmp_path / "p1"), "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "is a report of 'bench standin', not of 'bench other'" in result.output
    assert not (tmp_path / "x").exists()


def test_plugin_checks(monkeypatch):
    broken = ModuleType("detkit_test_broken")
    broken.NAME = "broken"
    monkeypatch.setitem(sys.modules, broken.__name__, broken)
    with pytest.raises(TypeError, match=r"lacks \['DESCRIPTION', 'OPTIONS', 'cases', 'run', 'summarize'\]"):
        benches.load_plugin(broken.__name__)
    ranks = standin("ranks")
    ranks.RANKS = "ranks"
    monkeypatch.setitem(sys.modules, ranks.__name__, ranks)
    with pytest.raises(TypeError, match=r"lacks \['start', 'finish'\]"):
        benches.load_plugin(ranks.__name__)
    clash = standin("clash")
    clash.OPTIONS = (click.option("--rounds", type=int),)
    monkeypatch.setitem(sys.modules, clash.__name__, clash)
    with pytest.raises(TypeError, match=r"redefine the runner's shared options \['rounds'\]"):
        benches.make_command(clash.__name__, prepare=lambda device, ranks: None)


def test_the_product_plugins_load_and_building_the_cli_imports_no_kernel():
    """`--device cpu` must select the interpreter before any Triton kernel is defined, so the CLI (which imports
    every plug-in for its options) imports no kernel module: nothing that imports triton, no audit, no tool. The
    kernels' pure-torch modules (the layout and its family's lazy face, the error bounds) may load."""
    names = [benches.load_plugin(m).NAME for m in benches.PLUGINS]
    assert len(set(names)) == len(names) and {"gemm", "comm", "mlp", "moe", "moe-sweep"} <= set(names)
    script = ("import sys, detkit.toolkit.cli\n"
              "pure = ('detkit.kernels', 'detkit.kernels.bounds', 'detkit.kernels.parallel',\n"
              "        'detkit.kernels.parallel.layout')\n"
              "print([m for m in sys.modules if m.startswith(('detkit.kernels', 'detkit.audits', 'tools', 'triton'))\n"
              "       and m not in pure])")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_no_package_module_imports_the_tools():
    """tools/ holds tuning and profiling scripts run from a checkout; the installed package must not need them."""
    pattern = re.compile(r"^\s*(from\s+tools[.\s]|import\s+tools\b)", re.M)
    offenders = [str(p.relative_to(REPO)) for part in ("kernels", "mode", "toolkit", "audits", "bench", "detkit")
                 for p in (REPO / part).rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
    assert pattern.search("from tools.gemm_sass import build\n") and pattern.search("import tools.moe_tune as mt\n")
