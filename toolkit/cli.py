"""The ``detkit`` command: ``detkit env``, ``detkit audit``, ``detkit bench <NAME>`` (toolkit.benches).

Every subcommand shares --device/--preset/--seed/--out/--json and exits non-zero when a check fails.
``--device cpu`` selects the Triton interpreter (TRITON_INTERPRET=1, set here before any kernel is
imported); its results are labelled as not being hardware results everywhere they appear.

``detkit audit --suite auto`` picks the suites that fit the host (``toolkit.harness.select_suites``);
``--suite all`` in one process also starts the ranks that tp-cp and invariance need on this host.

Mistakes on the command line (a device that is not there, an unknown preset or suite, an unwritable
--out, counts below 1) are found before any work (``toolkit.preflight``) and reported as one line
with exit status 2; other failures as one line with exit status 1. ``--debug`` (or
DETKIT_LOG_LEVEL=DEBUG) shows the traceback instead. Output formats and folders: docs/reports.md.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
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


@main.command()
@click.option("--suite", "suites", multiple=True, default=("gemm",), show_default=True,
              help="Suite or plug-in name; repeat for several. 'auto': the suites that fit this host "
                   "(no GPU: refused unless --device cpu; 1 GPU: gemm; >=2 GPUs: gemm, plus tp-cp when "
                   "launched as >1 ranks). 'all': every suite; in one process the multi-rank ones (tp-cp, "
                   "invariance) run on ranks it starts on this host (cpu: 4 gloo ranks on loopback; cuda: "
                   "with >= 2 GPUs, else skipped with the reason).")
@click.option("--no-progress", "no_progress", is_flag=True,
              help="No progress bar (there is one on stderr only when it is a terminal, on rank 0).")
@shared_options
def audit(suites, no_progress, device, preset, seed, out_dir, as_json) -> None:
    """Run audit suites and write rows.jsonl, report.json, report.md (and plots) to --out."""
    from detkit.toolkit import dist as tp_cp_dist
    from detkit.toolkit import harness
    from detkit.toolkit.launch import local_rank_runs
    from detkit.toolkit.preflight import check_preset
    from detkit.toolkit.presets import GEMM_PRESETS

    # Every check before any work: device and --out (option callbacks), preset, timeout, suites.
    check_preset(preset, GEMM_PRESETS)
    try:
        tp_cp_dist.timeout_s()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    world_size = _world_size_from_env()
    gpus = _gpu_count() if device == "cuda" else 0
    rank_runs = local_rank_runs(device, gpus) if world_size == 1 else []
    try:  # unknown names and an unfit host fail here, before any work
        selection = harness.select_suites(suites, device=device, gpu_count=gpus, world_size=world_size,
                                          local_ranks=max((r.nproc for r in rank_runs), default=0))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
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
    bar = _Progress(len(harness.suite_modules(names)), enabled=sys.stderr.isatty() and reporting and not no_progress)
    progress = {"plugin": "", "rows": 0}

    def on_plugin(name: str) -> None:
        progress.update(plugin=name, rows=0)
        tp_cp_dist.note_stage(session, f"{name}: starting")
        bar.on_plugin(name)

    def on_row(row) -> None:
        progress["rows"] += 1
        tp_cp_dist.note_stage(session, f'{progress["plugin"]}: {progress["rows"]} rows done, last "{row.name}"')
        bar.on_row(row)

    writer = harness.RowWriter(tp_cp_dist.rows_path(session, out))  # one rows file per rank
    tp_cp_dist.arm_stall_exit(session, out, {**meta, **env})  # a rank that stops answering ends the run
    try:
        try:
            rows = harness.run_plugins(names, ctx, writer, on_row=on_row, on_plugin=on_plugin) if names else []
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
    launch_lines: list[str] = []
    if selection.launched:  # the multi-rank suites, on ranks started here; their rows join this report
        results = tp_cp_dist.run_on_local_ranks(rank_runs, list(selection.launched), ctx, out,
                                                echo=lambda line: click.echo(line, err=True))
        launched_meta, launch_rows, launch_lines = tp_cp_dist.rank_run_meta(results, ctx.backend)
        for row in [*(row for res in results for row in res.rows), *launch_rows]:
            writer.write(row)
            rows.append(row)
        dist_meta = {**launched_meta, **dist_meta}
        dist_meta["covered"] = launched_meta["covered"]
        dist_meta["not_covered"] = launched_meta["not_covered"]
    writer.close()
    tables = config_tables()  # the kernel modules the suites loaded (base_meta saw only det_gemm)
    meta.update(dist_meta)
    for table in dist_meta.get("config_tables", []):  # and those of the ranks started here, each once
        if table not in tables:
            tables.append(table)
    meta["config_tables"] = tables
    meta.update(env)  # the full capture replaces the summary dist_meta carries under "env"
    if selection.skipped:
        meta["not_covered"] = [*meta.get("not_covered", []), *(f"suite {s}" for s in selection.skipped)]
    failed = [r for r in rows if not r.passed]
    if reporting:  # only rank 0 (or a single process) writes
        json_path, md_path = harness.write_report(out, meta, rows)
        if meta.get("status") == "INCOMPLETE":
            harness.atomic_write_text(md_path, f"{tp_cp_dist.INCOMPLETE_BANNER}: {meta['incomplete'].get('reason')}"
                                               f".\n\n{md_path.read_text()}")
        if as_json:
            click.echo(json_path.read_text())
        else:
            click.echo(tabulate(harness.summarize(rows), headers="keys", tablefmt="simple"))
            click.echo(f"report: {md_path}")
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


@main.group()
def bench() -> None:
    """Benchmarks against their baselines in the same run (ratios, medians with p20/p80)."""


def _prepare_bench_device(device: str, ranks: bool) -> None:
    """Before a benchmark imports a kernel: the interpreter for --device cpu; under ranks, this rank's GPU."""
    _select_device(device)
    if ranks:
        _bind_local_gpu(device, _world_size_from_env())


benches.add_commands(bench, prepare=_prepare_bench_device)  # every plug-in of benches.PLUGINS
