"""The product benchmarks' runner and their ``detkit bench <NAME>`` subcommands.

A benchmark plug-in is a module (``PLUGINS``) with:

    NAME: str                  the subcommand
    DESCRIPTION: str           its help line
    OPTIONS: tuple             click.option decorators for its own flags
    RANKS: str                 "single", or "ranks" (launched under torchrun/srun)
    cases(ctx, **options) -> list          checks every option (ValueError, one line) before any work
    run(ctx, cases, **options) -> Iterator[dict]   validate, then time; one row per case as measured,
                                           each with "name" (its NVTX range) and "passed" (bool)
    summarize(rows, meta) -> str           the markdown body of report.md

and optionally ``plots(out_dir, rows) -> list[Path]``. With RANKS = "ranks": ``start(ctx, out) -> session``
(after ``cases``, before any measurement), ``run`` called with ``session=`` too, and ``finish(session, ok)
-> bool`` (every rank's verdict combined; called even when ``run`` raised). Further optional hooks:
``describe(ctx, cases, rows, session) -> dict`` (what the rows alone do not say, into meta);
``derive(rows, meta) -> dict`` (results over all rows, e.g. targets and fits: ``meta["derived"]``);
``PRESETS`` (its own shape presets: ``--preset`` is repeatable and its names are checked against them;
without it ``--preset`` is one GEMM/layout preset); ``default_rounds(interpreted) -> int`` (default 5).

The runner adds the shared flags (--device --preset --seed --out --json --rounds, and --merge to
re-report earlier runs' rows together), checks them and the plug-in's options before any work
(a refusal is a one-line usage error, exit 2), then writes what audits write: ``rows.jsonl`` (one
fsynced line per row, as yielded), then ``report.json`` (``{"meta", "rows"}``) and ``report.md``
atomically, plots beside them. ``meta`` is ``harness.base_meta`` (config tables that ran, source
state) plus the environment capture. Under ranks only rank 0 writes. The exit status is 1 when any
row failed or none was produced.
"""

from __future__ import annotations

import importlib
import json
import logging
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import click

from detkit.toolkit import harness, preflight
from detkit.toolkit.nvtx_ranges import nvtx_range
from detkit.toolkit.records import INTERPRETER_BANNER, RowWriter, atomic_write_text, write_rows
from detkit.toolkit.reports import render_bench_markdown

log = logging.getLogger(__name__)

# The benchmark plug-ins, in `detkit bench --help` order.
PLUGINS: tuple[str, ...] = (
    "detkit.bench.gemm",
    "detkit.bench.comm",
    "detkit.bench.mlp",
    "detkit.bench.moe",
    "detkit.bench.moe_sweep",
    "detkit.bench.attention",
    "detkit.bench.model",
)
REQUIRED = ("NAME", "DESCRIPTION", "OPTIONS", "cases", "run", "summarize")
RANKS_KINDS = ("single", "ranks")
SHARED = ("device", "presets", "seed", "out_dir", "as_json", "rounds", "merge", "session")
DEFAULT_ROUNDS = 5


def load_plugin(module_name: str) -> ModuleType:
    """Import a plug-in and check it has the protocol's attributes (a missing one is a bug: TypeError)."""
    plugin = importlib.import_module(module_name)
    missing = [a for a in REQUIRED if not hasattr(plugin, a)]
    ranks = getattr(plugin, "RANKS", "single")
    if ranks not in RANKS_KINDS:
        raise TypeError(f"{module_name}: RANKS={ranks!r}; supported: {RANKS_KINDS}")
    if ranks == "ranks":
        missing += [a for a in ("start", "finish") if not hasattr(plugin, a)]
    if missing:
        raise TypeError(f"{module_name} is not a bench plug-in: it lacks {missing}")
    return plugin


def ranks_of(plugin: ModuleType) -> bool:
    return getattr(plugin, "RANKS", "single") == "ranks"


def bench_context(plugin: ModuleType, device: str, presets: Sequence[str], seed: int, out_dir: Path | None,
                  rounds: int | None) -> harness.RunContext:
    """The RunContext of one benchmark run; bad presets or rounds raise ValueError before any work."""
    preflight.check_count("--rounds", rounds)
    presets = tuple(presets)
    own = getattr(plugin, "PRESETS", None)
    if own is not None:
        unknown = [p for p in presets if p not in own]
        if unknown:
            raise ValueError(f"preset(s) {unknown} not known to bench {plugin.NAME}; known: {sorted(own)}")
        if len(set(presets)) != len(presets):
            raise ValueError(f"--preset values repeat: {list(presets)}; give each once")
        dev, backend = harness.resolve_device(device)
        ctx = harness.RunContext(dev, backend, ",".join(presets) or "default", seed, out_dir, presets=presets)
    else:
        if len(presets) > 1:
            raise ValueError(f"bench {plugin.NAME} takes one --preset; got {list(presets)}")
        ctx = harness.resolve_context(device, presets[0] if presets else None, seed, out_dir)
        ctx = harness.RunContext(ctx.device, ctx.backend, ctx.preset, seed, out_dir, presets=presets)
    default = getattr(plugin, "default_rounds", lambda interpreted: DEFAULT_ROUNDS)
    return harness.RunContext(ctx.device, ctx.backend, ctx.preset, ctx.seed, ctx.out_dir,
                              rounds=rounds if rounds is not None else default(ctx.interpreted), presets=ctx.presets)


def check_row(plugin: ModuleType, row: object) -> dict:
    if not (isinstance(row, dict) and isinstance(row.get("name"), str) and isinstance(row.get("passed"), bool)):
        raise TypeError(f"bench {plugin.NAME} yielded a row without a str 'name' and a bool 'passed': {row!r:.300}")
    return row


@dataclass
class BenchRun:
    rows: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    ok: bool = False
    reporting: bool = True
    interrupted: bool = False  # stopped by SIGINT: the report holds the rows measured until then
    json_path: Path | None = None
    md_path: Path | None = None


def _agree(out: Path) -> tuple[Path, bool]:
    """Under a process group: rank 0's results folder for every rank, and whether this rank reports."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return out, True
    agreed = [str(out)]
    dist.broadcast_object_list(agreed, src=0)  # a timestamped default folder may differ between ranks
    return Path(agreed[0]), dist.get_rank() == 0


def run_bench(plugin: ModuleType, ctx: harness.RunContext, cases: list, options: dict, out: Path,
              command_line: str, session: object = None) -> BenchRun:
    """Run a plug-in's cases (its options already checked by ``cases``) and write its report on the
    reporting rank. Under ranks, ``session`` is ``start``'s; ``finish`` ends it and every rank takes part."""
    result = BenchRun()
    passed_locally = False
    try:
        out, result.reporting = _agree(out)
        env = harness.env_meta(ctx.device) if result.reporting else {}  # captured before the work
        if ctx.interpreted and result.reporting:
            click.secho(INTERPRETER_BANNER, fg="yellow", err=True)
        writer = RowWriter(out / "rows.jsonl" if result.reporting else None)
        try:
            with nvtx_range(f"bench {plugin.NAME}"):
                rows = (plugin.run(ctx, cases, session=session, **options) if ranks_of(plugin)
                        else plugin.run(ctx, cases, **options))
                for row in rows:
                    result.rows.append(check_row(plugin, row))
                    writer.write(row)
                    log.info("%s: %s", "passed" if row["passed"] else "FAILED", row["name"])
        except KeyboardInterrupt:  # SIGINT, e.g. a time limit: report the rows measured so far, and fail
            if ranks_of(plugin):
                raise
            result.interrupted = True
        finally:
            writer.close()
        passed_locally = bool(result.rows) and not result.interrupted and all(r["passed"] for r in result.rows)
        if result.reporting:
            meta = harness.base_meta(ctx, f"bench {plugin.NAME}", command_line)
            meta.update(bench=plugin.NAME, options=options, cases=len(cases))
            if result.interrupted:
                meta["interrupted_after_rows"] = len(result.rows)
            if hasattr(plugin, "describe"):
                meta.update(plugin.describe(ctx, cases, result.rows, session))
            meta.update(env)
            result.meta = meta
            result.json_path, result.md_path = write_bench_report(plugin, out, meta, result.rows)
    finally:
        result.ok = plugin.finish(session, passed_locally) if ranks_of(plugin) else passed_locally
    return result


def write_bench_report(plugin: ModuleType, out: Path, meta: dict, rows: list[dict]) -> tuple[Path, Path]:
    """``derive`` into meta, plots, then report.json and report.md, each atomically."""
    if hasattr(plugin, "derive"):
        meta["derived"] = plugin.derive(rows, meta)
    out.mkdir(parents=True, exist_ok=True)
    meta["plots"] = [p.name for p in plugin.plots(out, rows)] if hasattr(plugin, "plots") else []
    json_path, md_path = out / "report.json", out / "report.md"
    atomic_write_text(json_path, json.dumps({"meta": meta, "rows": rows}, indent=2, default=str) + "\n")
    atomic_write_text(md_path, render_bench_markdown(meta, rows, plugin.summarize(rows, meta)))
    return json_path, md_path


# ---------------------------------------------------------------------------------------------
# Re-reporting earlier runs together
# ---------------------------------------------------------------------------------------------
def merge_reports(plugin: ModuleType, dirs: Sequence[Path], command_line: str) -> tuple[list[dict], dict]:
    """The rows and a meta of earlier runs of ``plugin`` (their report.json), for one report over all of
    them. Refuses folders of another bench, interpreter runs beside hardware runs, different config
    tables, and a row name in two runs."""
    command = f"bench {plugin.NAME}"
    sources, rows, seen = [], [], set()
    for d in dirs:
        path = Path(d) / "report.json"
        if not path.is_file():
            raise ValueError(f"{path} not found; --merge takes folders written by detkit {command}")
        data = json.loads(path.read_text())
        meta = data.get("meta", {})
        if meta.get("command") != command:
            raise ValueError(f"{path} is a report of {meta.get('command')!r}, not of {command!r}")
        for row in data["rows"]:
            if row["name"] in seen:
                raise ValueError(f"row {row['name']!r} appears in more than one merged run; merge disjoint runs")
            seen.add(row["name"])
            rows.append(row)
        sources.append((str(d), meta))
    kinds = {bool(m.get("hardware_result")) for _, m in sources}
    if len(kinds) > 1:
        raise ValueError("refusing to merge interpreter runs with hardware runs: "
                         f"{[(d, m.get('backend')) for d, m in sources]}")
    tables = {json.dumps(m.get("config_tables"), sort_keys=True) for _, m in sources}
    if len(tables) > 1:
        raise ValueError("refusing to merge runs of different config tables: "
                         f"{[(d, m.get('config_tables')) for d, m in sources]}")
    first = sources[0][1]
    meta = {"command": command, "command_line": command_line, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "bench": plugin.NAME, "backend": first.get("backend"), "hardware_result": first.get("hardware_result"),
            "device_name": first.get("device_name"), "config_tables": first.get("config_tables"),
            "merged_from": [{"dir": d, "command_line": m.get("command_line"), "date": m.get("date"),
                             "device_name": m.get("device_name"), "source": m.get("source"),
                             **{k: m[k] for k in ("measured_ceiling_tflops", "baseline") if k in m}}
                            for d, m in sources],
            "env_summary": first.get("env_summary")}
    return rows, meta


# ---------------------------------------------------------------------------------------------
# The click commands
# ---------------------------------------------------------------------------------------------
def _shared_options(plugin: ModuleType) -> list[Callable]:
    import os

    own = getattr(plugin, "PRESETS", None)
    preset_help = (f"Shape preset; repeat for several (default: the bench's own; known: {', '.join(own)})."
                   if own is not None else "Shape preset (default: qwen3-8b-tp2 on cuda, tiny on cpu).")
    return [
        click.option("--device", type=click.Choice(preflight.DEVICES),
                     default=lambda: os.environ.get("DETKIT_DEVICE", "cuda"), show_default="cuda (env DETKIT_DEVICE)",
                     help="cuda: compiled Triton on Hopper; cpu: Triton interpreter (not a hardware result)."),
        click.option("--preset", "presets", multiple=True, help=preset_help),
        click.option("--seed", type=int, default=1234, show_default=True),
        click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
                     callback=preflight.click_check(preflight.check_out_dir),
                     help=f"Results folder (default: results/bench-{plugin.NAME}-<timestamp>)."),
        click.option("--json", "as_json", is_flag=True, help="Print report.json on stdout instead of report.md."),
        click.option("--rounds", type=int, default=None,
                     callback=preflight.click_check(preflight.check_count, "--rounds"),
                     help="Interleaved timing rounds (>= 1; default: the bench's)."),
        click.option("--merge", "merge", multiple=True, type=click.Path(path_type=Path, file_okay=False),
                     help="Re-report the rows of earlier runs' folders together (no new measurements); repeat."),
    ]


def _param_names(decorators: Sequence[Callable]) -> list[str]:
    def probe():
        pass

    for option in decorators:
        probe = option(probe)
    return [p.name for p in getattr(probe, "__click_params__", [])]


def make_command(module_name: str, prepare: Callable[[str, bool], None]) -> click.Command:
    """``detkit bench <NAME>`` for one plug-in. ``prepare(device, ranks)`` selects the device before any
    kernel is imported (and binds a rank's GPU)."""
    plugin = load_plugin(module_name)
    clash = set(_param_names(plugin.OPTIONS)) & set(SHARED)
    if clash:
        raise TypeError(f"{module_name}: OPTIONS redefine the runner's shared options {sorted(clash)}")

    def callback(device, presets, seed, out_dir, as_json, rounds, merge, **options):
        command_line = shlex.join(sys.argv)
        out = out_dir or Path("results") / f"bench-{plugin.NAME}-{time.strftime('%Y%m%d-%H%M%S')}"
        if merge:
            _merge_command(plugin, merge, out, as_json, command_line)
        else:
            _run_command(plugin, prepare, device, presets, seed, out, as_json, rounds, options, command_line)

    command = callback
    for option in reversed([*_shared_options(plugin), *plugin.OPTIONS]):
        command = option(command)
    return click.command(plugin.NAME, help=plugin.DESCRIPTION, short_help=plugin.DESCRIPTION)(command)


def add_commands(group: click.Group, prepare: Callable[[str, bool], None], plugins: Sequence[str] = PLUGINS) -> None:
    for module_name in plugins:
        group.add_command(make_command(module_name, prepare))


def _usage(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ValueError as exc:
        raise click.UsageError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


def _run_command(plugin, prepare, device, presets, seed, out, as_json, rounds, options, command_line) -> None:
    _usage(preflight.check_count, "--rounds", rounds)
    _usage(preflight.check_device, device)  # not at parse time: --merge measures nothing and needs no device
    prepare(device, ranks_of(plugin))
    try:
        ctx = bench_context(plugin, device, presets, seed, out, rounds)
    except (ValueError, RuntimeError) as exc:
        raise click.UsageError(str(exc)) from None
    cases = _usage(plugin.cases, ctx, **options)  # every option checked; nothing has run
    session = _usage(plugin.start, ctx, out) if ranks_of(plugin) else None
    result = run_bench(plugin, ctx, cases, options, out, command_line, session)
    if result.reporting:
        _echo(result.json_path, result.md_path, as_json)
    if result.interrupted:
        click.echo(f"FAILED: interrupted after {len(result.rows)} of {len(cases)} case(s); the report holds those",
                   err=True)
        raise SystemExit(1)
    _exit(result.ok, result.rows, result.reporting)


def _merge_command(plugin, dirs, out, as_json, command_line) -> None:
    given = [p.name for p in click.get_current_context().command.params
             if p.name not in ("out_dir", "as_json", "merge")
             and click.get_current_context().get_parameter_source(p.name) != click.core.ParameterSource.DEFAULT]
    if given:
        raise click.UsageError(f"--merge re-reports earlier runs; it takes only --out and --json, not {given}")
    rows, meta = _usage(merge_reports, plugin, dirs, command_line)
    write_rows(out / "rows.jsonl", rows)
    json_path, md_path = write_bench_report(plugin, out, meta, rows)
    _echo(json_path, md_path, as_json)
    _exit(bool(rows) and all(r["passed"] for r in rows), rows, True)


def _echo(json_path: Path, md_path: Path, as_json: bool) -> None:
    click.echo((json_path if as_json else md_path).read_text())


def _exit(ok: bool, rows: list[dict], reporting: bool) -> None:
    if ok:
        return
    if reporting:
        failed = [r for r in rows if not r["passed"]]
        if not rows:
            click.echo("FAILED: no rows were produced", err=True)
        elif not failed:
            click.echo("FAILED: another rank reported failed rows", err=True)
        else:
            click.echo(f"FAILED: {len(failed)} of {len(rows)} row(s)", err=True)
            for row in failed[:20]:
                click.echo(f"FAILED {row['name']}: {row.get('failure', 'passed is false')}", err=True)
            if len(failed) > 20:
                click.echo(f"... {len(failed) - 20} more failed rows in rows.jsonl", err=True)
    raise SystemExit(1)
