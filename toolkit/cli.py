"""The ``detkit`` command: ``detkit env``, ``detkit audit``, ``detkit bench <NAME>`` (toolkit.benches).

Every subcommand shares --device/--preset/--seed/--out/--json and exits non-zero when a check fails.
``--device cpu`` selects the Triton interpreter (TRITON_INTERPRET=1, set here before any kernel is
imported); its results are labelled as not being hardware results everywhere they appear.

``detkit audit --suite auto`` picks the suites that fit the host (``toolkit.harness.select_suites``);
in one process, ``--suite all`` and any suite list naming tp-cp or invariance also start the ranks
those suites need on this host.

Mistakes on the command line are found before any work and reported as one line with exit status 2:
for ``detkit audit`` an unknown suite first (``--suite`` is eager), then a device that is not there
and an unwritable --out (as they are parsed), an unknown preset, a bad timeout knob, a suite list the
host cannot run, a suite's missing dependency (``toolkit.preflight``, ``toolkit.harness``); counts
below 1 for the benchmarks. Other failures are one line with exit status 1. ``--debug`` (or
DETKIT_LOG_LEVEL=DEBUG) shows the traceback instead. Once an audit has started, its report is written
however it ends: PASSED, FAILED (failed checks; a suite that raised, after which the next suite
runs) or INCOMPLETE (SIGINT/SIGTERM: exit 128 + the signal). Output formats and folders:
docs/reports.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import click
from tabulate import tabulate

from detkit.toolkit import benches
from detkit.toolkit.preflight import DEVICES, UsageError, check_device, check_out_dir, click_check
from detkit.toolkit.provenance import config_tables


def _select_device(device: str) -> None:
    if device == "cpu":
        # Triton decides interpreter vs compiler when a kernel is defined: set it before importing kernels.
        if "detkit.kernels.det_gemm.launch" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise click.UsageError("--device cpu needs TRITON_INTERPRET=1 before detkit kernels are imported")
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        raise click.UsageError("TRITON_INTERPRET=1 is set but --device cuda was asked for; unset it for cuda_sm90")


def _default_out(command: str) -> Path:
    return Path("results") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"


def _debug_requested(args: list[str]) -> bool:
    return "--debug" in args or os.environ.get("DETKIT_LOG_LEVEL", "").strip().upper() == "DEBUG"


def _set_debug(ctx, param, value) -> None:
    if value:  # detkit's own loggers only: libraries stay at their level
        logging.getLogger("detkit").setLevel(logging.DEBUG)


def shared_options(fn):
    """Flags every run subcommand takes. --device and --out are checked as they are parsed, before
    any work: a device that is not there and a results folder that cannot be written are refused."""
    options = [
        click.option("--device", type=click.Choice(DEVICES), default=lambda: os.environ.get("DETKIT_DEVICE", "cuda"),
                     show_default="cuda (env DETKIT_DEVICE)", callback=click_check(check_device),
                     help="cuda: compiled Triton on Hopper; cpu: Triton interpreter (not a hardware result)."),
        click.option("--preset", default=None, help="Shape preset (default: qwen3-8b-tp2 on cuda, tiny on cpu)."),
        click.option("--seed", type=int, default=1234, show_default=True),
        click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
                     callback=click_check(check_out_dir, default=Path("results")),
                     help="Results folder (default: results/<command>-<timestamp>)."),
        click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout."),
        click.option("--debug", is_flag=True, expose_value=False, callback=_set_debug,
                     help="Show the traceback of a failure (also DETKIT_LOG_LEVEL=DEBUG)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _command_name(group: click.Group, args: list[str]) -> str:
    """'detkit audit', 'detkit bench gemm': the command words at the front of ``args``."""
    words, cmd = ["detkit"], group
    for arg in args:
        if not isinstance(cmd, click.Group) or arg.startswith("-") or arg not in cmd.commands:
            break
        cmd = cmd.commands[arg]
        words.append(arg)
    return " ".join(words)


class _Detkit(click.Group):
    """The top-level handler: a usage mistake is one line on stderr and exit status 2 (click's own
    errors, UsageError, ValueError and TypeError); any other exception one line and status 1; with
    --debug or DETKIT_LOG_LEVEL=DEBUG the traceback is shown instead."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        argv = list(sys.argv[1:] if args is None else args)
        name = _command_name(self, argv)
        try:
            code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
            code = code if isinstance(code, int) else 0
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()
            code = exc.exit_code
        except click.UsageError as exc:
            click.echo(f"{name}: error: {exc.format_message()} (see '{name} --help')", err=True)
            code = exc.exit_code
        except click.ClickException as exc:
            click.echo(f"{name}: error: {exc.format_message()}", err=True)
            code = exc.exit_code
        except click.Abort:
            click.echo(f"{name}: aborted", err=True)
            code = 130
        except (ValueError, TypeError) as exc:
            if _debug_requested(argv):
                raise
            click.echo(f"{name}: error: {exc}", err=True)
            code = 2
        except Exception as exc:  # noqa: BLE001 -- one line unless debugging
            if _debug_requested(argv):
                raise
            click.echo(f"{name}: failed: {type(exc).__name__}: {exc} (--debug or DETKIT_LOG_LEVEL=DEBUG shows "
                       "the traceback)", err=True)
            code = 1
        if standalone_mode:
            sys.exit(code)
        return code


@click.group(cls=_Detkit)
@click.option("-v", "--verbose", is_flag=True, help="Log progress to stderr.")
@click.option("--debug", is_flag=True, help="Show the traceback of a failure (also DETKIT_LOG_LEVEL=DEBUG).")
def main(verbose: bool, debug: bool) -> None:
    """detkit: deterministic GEMMs and TP/CP reductions for Hopper, with audits and benchmarks."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if debug or _debug_requested([]):
        logging.getLogger("detkit").setLevel(logging.DEBUG)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def env(as_json: bool) -> None:
    """Versions, GPUs, topology, host, Slurm and knobs; every field degrades to 'not available'."""
    from detkit.toolkit.env import capture_env, format_env_table

    captured = capture_env()
    click.echo(json.dumps(captured, indent=2, default=str) if as_json else format_env_table(captured))


def _world_size_from_env() -> int:
    """The number of ranks this process was launched among (1 outside torchrun/srun)."""
    from detkit.toolkit.dist import launched_as_ranks

    if not launched_as_ranks():
        return 1
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun's take precedence (toolkit.launch)
        return int(os.environ["WORLD_SIZE"])
    return int(os.environ["SLURM_STEP_NUM_TASKS"])


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _bind_local_gpu(device: str, world_size: int) -> None:
    """Under torchrun/srun on CUDA, make this rank's GPU current before anything touches CUDA, so the
    backend probe does not open a context on GPU 0 from every rank (toolkit.launch binds it again)."""
    if device != "cuda" or world_size < 2:
        return
    import torch

    from detkit.toolkit.launch import LaunchError, RankEnv

    try:
        local_rank = RankEnv.from_environ().local_rank
    except LaunchError:
        return  # setup_distributed reports it, before any work
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        torch.cuda.set_device(local_rank)


class _Progress:
    """A progress bar over the plug-ins of a run on stderr, showing the latest row; rank 0 only and
    only when stderr is a terminal (logs and CI output stay clean)."""

    def __init__(self, plugins: int, enabled: bool):
        self._bar = None
        self.rows = self.failed = 0
        self.plugin = ""
        if enabled and plugins:
            self._bar = click.progressbar(length=plugins, label="audit", file=sys.stderr, show_pos=True,
                                          item_show_func=lambda item: item)
            self._bar.__enter__()
        self._started = False

    def on_plugin(self, name: str) -> None:
        if self._bar is not None and self._started:
            self._bar.update(1)
        self._started, self.plugin = True, name
        self._show()

    def on_row(self, row) -> None:
        self.rows += 1
        self.failed += not row.passed
        self._show()

    def _show(self) -> None:
        if self._bar is not None:
            self._bar.update(0, f"{self.plugin}: {self.rows} rows, {self.failed} failed")

    def close(self) -> None:
        if self._bar is not None:
            if self._started:
                self._bar.update(1)
            self._bar.__exit__(None, None, None)
            self._bar = None


def _failure_summary(failed: list) -> list[str]:
    """Lines for stderr: failed rows per (suite, check), then the first few rows in full."""
    counts: dict[tuple[str, str], int] = {}
    for row in failed:
        counts[(row.suite, row.check)] = counts.get((row.suite, row.check), 0) + 1
    lines = [f"FAILED: {len(failed)} row(s) in {len(counts)} check(s): "
             + ", ".join(f"{suite}/{check} x{n}" for (suite, check), n in counts.items())]
    for row in failed[:20]:
        lines.append(f"FAILED {row.check}: {row.name} {json.dumps(row.details, default=str)[:400]}")
    if len(failed) > 20:
        lines.append(f"... {len(failed) - 20} more failed rows in rows.jsonl")
    return lines


class Interrupted(BaseException):
    """SIGINT or SIGTERM during an audit's work (``_signals_end_the_run``): the run writes what it has,
    marked INCOMPLETE, and exits with 128 + the signal's number."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def _signals_end_the_run(enabled: bool):
    """While the block runs, SIGINT and SIGTERM raise ``Interrupted`` in the main thread (SIGTERM would
    otherwise end the process with nothing written); the previous handlers come back after it."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _check_suite_names(ctx, param, value):
    """--suite is eager: an unknown name is the first thing refused, before the device or --out."""
    from detkit.toolkit import harness

    if not ctx.resilient_parsing:
        try:
            harness.check_suite_names(value)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    return value


@main.command()
@click.option("--suite", "suites", multiple=True, default=("gemm",), show_default=True, is_eager=True,
              callback=_check_suite_names,
              help="Suite or plug-in name; repeat for several. 'auto': the suites that fit this host "
                   "(no GPU: refused unless --device cpu; 1 GPU: gemm; >=2 GPUs: gemm, plus tp-cp when "
                   "launched as >1 ranks). 'all': every suite. In one process the multi-rank suites (tp-cp, "
                   "invariance), named or through 'all', run on ranks it starts on this host (cpu: 4 gloo ranks "
                   "on loopback; cuda: with >= 2 GPUs; with fewer, 'all' skips them with the reason and a "
                   "named one is refused).")
@click.option("--no-progress", "no_progress", is_flag=True,
              help="No progress bar (there is one on stderr only when it is a terminal, on rank 0).")
@shared_options
def audit(suites, no_progress, device, preset, seed, out_dir, as_json) -> None:
    """Run audit suites and write rows.jsonl, report.json, report.md (and plots) to --out.

    The report is written however the run ends: PASSED, FAILED (a check failed, a suite raised, an
    import in a suite failed; the next suite still runs) or INCOMPLETE (SIGINT or SIGTERM, a rank that
    stopped answering), with the reason (docs/reports.md)."""
    from detkit.toolkit import dist as tp_cp_dist
    from detkit.toolkit import harness
    from detkit.toolkit.launch import local_rank_runs
    from detkit.toolkit.preflight import check_preset
    from detkit.toolkit.presets import GEMM_PRESETS

    # Every check before any work: suite names, device and --out (option callbacks), preset, timeout,
    # the suites' fit to this host, their dependencies.
    check_preset(preset, GEMM_PRESETS)
    try:
        tp_cp_dist.timeout_s()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    world_size = _world_size_from_env()
    gpus = _gpu_count() if device == "cuda" else 0
    rank_runs = local_rank_runs(device, gpus) if world_size == 1 else []
    try:  # an unfit host fails here, before any work
        selection = harness.select_suites(suites, device=device, gpu_count=gpus, world_size=world_size,
                                          local_ranks=max((r.nproc for r in rank_runs), default=0))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    missing = harness.missing_dependencies([*selection.suites, *selection.launched])
    if missing:
        raise click.UsageError("; ".join(missing))
    _select_device(device)
    names = selection.suites
    _bind_local_gpu(device, world_size)
    ctx = harness.resolve_context(device, preset, seed, out_dir)
    out = out_dir or _default_out("audit")
    # Launched as ranks by torchrun/srun: start the process group and the TP/CP groups (None
    # otherwise); rank 0 merges the rows and writes the report (docs/tp_cp.md).
    session = tp_cp_dist.setup_distributed(ctx, out)
    out = tp_cp_dist.out_dir(session, out)
    reporting = tp_cp_dist.writes_report(session)
    meta = harness.base_meta(ctx, "audit", shlex.join(sys.argv))
    meta["suites"] = [*names, *selection.launched]
    if not harness.uses_preset(meta["suites"]):  # e.g. the model audit: its model is in model.json, no shape preset
        meta.pop("preset")
    meta["suite_selection"] = selection.as_meta()
    env = harness.env_meta(ctx.device) if reporting else {}  # captured before the work, on the reporting rank
    if ctx.interpreted and reporting:
        click.secho(harness.INTERPRETER_BANNER, fg="yellow", err=True)
    for skipped in selection.skipped:
        if reporting:
            click.secho(f"skipped {skipped}", fg="yellow", err=True)
    modules = harness.suite_modules(names)
    bar = _Progress(len(modules), enabled=sys.stderr.isatty() and reporting and not no_progress)
    progress = {"plugin": "", "rows": 0, "started": 0}
    finished: list = []  # every row written so far: what an interrupted or failed run reports

    def on_plugin(name: str) -> None:
        progress.update(plugin=name, rows=0, started=progress["started"] + 1)
        tp_cp_dist.note_stage(session, f"{name}: starting")
        bar.on_plugin(name)

    def on_row(row) -> None:
        finished.append(row)
        progress["rows"] += 1
        tp_cp_dist.note_stage(session, f'{progress["plugin"]}: {progress["rows"]} rows done, last "{row.name}"')
        bar.on_row(row)

    def not_run() -> list[str]:
        plugins = [m.rsplit(".", 1)[-1] for m in modules[progress["started"]:]]
        return [*plugins, *(s for s in selection.launched if not ranks_ran)]

    writer = harness.RowWriter(tp_cp_dist.rows_path(session, out))  # one rows file per rank
    tp_cp_dist.arm_stall_exit(session, out, {**meta, **env})  # a rank that stops answering ends the run
    timings: dict[str, float] = {}
    launch_lines: list[str] = []
    ranks_ran = False
    try:
        with _signals_end_the_run(enabled=session is None):
            try:
                try:
                    rows = harness.run_plugins(names, ctx, writer, on_row=on_row, on_plugin=on_plugin,
                                               keep_going=session is None, timings=timings) if names else []
                finally:
                    bar.close()
                rows, dist_meta = tp_cp_dist.merge_rows(session, rows, out)  # rank 0 gets every rank's rows
            except Exception as exc:
                writer.close()
                if session is None:
                    raise
                # A rank stopped answering (or failed): name it (one line), merge what finished into an
                # INCOMPLETE report.
                tp_cp_dist.end_incomplete(session, exc, out, {**meta, **env})
                raise SystemExit(1) from None
            if selection.launched:  # the multi-rank suites, on ranks started here; their rows join this report
                started = time.monotonic()
                results = tp_cp_dist.run_on_local_ranks(rank_runs, list(selection.launched), ctx, out,
                                                        echo=lambda line: click.echo(line, err=True))
                ranks_ran = True
                timings[f"ranks ({', '.join(selection.launched)})"] = round(time.monotonic() - started, 1)
                launched_meta, launch_rows, launch_lines = tp_cp_dist.rank_run_meta(results, ctx.backend)
                for row in [*(row for res in results for row in res.rows), *launch_rows]:
                    writer.write(row)
                    rows.append(row)
                dist_meta = {**launched_meta, **dist_meta}
                dist_meta["covered"] = launched_meta["covered"]
                dist_meta["not_covered"] = launched_meta["not_covered"]
    except Interrupted as exc:  # one process only: under ranks the handlers are not installed
        writer.close()
        where = f" in {progress['plugin']} after {progress['rows']} of its rows" if progress["plugin"] else ""
        if selection.launched and not ranks_ran and progress["started"] == len(modules):
            where = f" while the ranks of {', '.join(selection.launched)} ran"
        reason = (f"interrupted by {exc}{where}; {len(finished)} rows finished"
                  + (f"; not run: {', '.join(not_run())}" if not_run() else ""))
        md = _write_audit_report(out, meta, env, finished, timings, selection, status="INCOMPLETE", reason=reason,
                                 not_covered=[f"INCOMPLETE: {reason}"])
        click.echo(f"detkit audit: INCOMPLETE: {reason}; report: {md}", err=True)
        raise SystemExit(128 + exc.signum) from None
    except Exception as exc:  # one process: outside a plug-in (starting the ranks, merging); the report first
        writer.close()
        reason = f"{type(exc).__name__}: {exc}" + (f"; not run: {', '.join(not_run())}" if not_run() else "")
        md = _write_audit_report(out, meta, env, finished, timings, selection, status="FAILED", reason=reason)
        click.echo(f"detkit audit: FAILED report: {md}", err=True)
        raise
    writer.close()
    meta.update(dist_meta)
    failed = [r for r in rows if not r.passed]
    if reporting:  # only rank 0 (or a single process) writes
        md_path = _write_audit_report(out, meta, env, rows, timings, selection)
        if as_json:
            click.echo((out / "report.json").read_text())
        else:
            click.echo(tabulate(harness.summarize(rows), headers="keys", tablefmt="simple"))
            click.echo(f"report: {md_path} ({meta['status']})")
    ok = tp_cp_dist.finish(session, bool(rows) and not failed)  # all ranks agree; group destroyed
    if not ok:
        for line in launch_lines:
            click.echo(f"FAILED {line}", err=True)
        if not rows:
            click.echo("FAILED: no rows were produced", err=True)
        elif failed:
            for line in _failure_summary(failed):
                click.echo(line, err=True)
        else:
            click.echo("FAILED: another rank reported failed rows (see the merged report on rank 0)", err=True)
        raise SystemExit(1)


def _write_audit_report(out: Path, meta: dict, env: dict, rows: list, timings: dict, selection, *,
                        status: str | None = None, reason: str | None = None,
                        not_covered: list[str] | None = None) -> Path:
    """report.json and report.md of an audit, however it ended: the config tables of the kernel modules
    loaded by then (and by the ranks it started), the environment, the seconds per plug-in, the suites
    skipped; ``status``/``reason`` for a run that stopped (else they follow from the rows). Returns
    report.md's path."""
    from detkit.toolkit import harness

    tables = config_tables()  # the kernel modules the suites loaded (base_meta saw only det_gemm)
    for table in meta.get("config_tables", []):  # those of the ranks started here, each once
        if table not in tables:
            tables.append(table)
    meta["config_tables"] = tables
    meta.update(env)  # the full capture replaces the summary a rank run's meta carries under "env"
    meta["suite_seconds"] = dict(timings)
    listed = [*(not_covered or []), *meta.get("not_covered", []), *(f"suite {s}" for s in selection.skipped)]
    if listed:
        meta["not_covered"] = listed
    if status is not None:
        meta["status"], meta["status_reason"] = status, reason
    _, md_path = harness.write_report(out, meta, rows)
    return md_path


@main.group()
def bench() -> None:
    """Benchmarks against their baselines in the same run (ratios, medians with p20/p80)."""


def _prepare_bench_device(device: str, ranks: bool) -> None:
    """Before a benchmark imports a kernel: the interpreter for --device cpu; under ranks, this rank's GPU."""
    _select_device(device)
    if ranks:
        _bind_local_gpu(device, _world_size_from_env())


benches.add_commands(bench, prepare=_prepare_bench_device)  # every plug-in of benches.PLUGINS
