"""The ``detkit`` command: ``detkit env``, ``detkit audit``, ``detkit bench <NAME>`` (toolkit.benches).

Every subcommand shares --device/--preset/--seed/--out/--json and exits non-zero when a check fails.
``--device cpu`` selects the Triton interpreter (TRITON_INTERPRET=1, set here before any kernel is
imported); its results are labelled as not being hardware results everywhere they appear.

``detkit audit --suite auto`` picks the suites that fit the host (``toolkit.harness.select_suites``);
suite names are checked before any work. Output formats and folders: docs/reports.md.
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

DEVICES = ("cuda", "cpu")


def _select_device(device: str) -> None:
    if device == "cpu":
        # Triton decides interpreter vs compiler when a kernel is defined: set it before importing kernels.
        if "detkit.kernels.det_gemm" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise click.UsageError("--device cpu needs TRITON_INTERPRET=1 before detkit kernels are imported")
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        raise click.UsageError("TRITON_INTERPRET=1 is set but --device cuda was asked for; unset it for cuda_sm90")


def _default_out(command: str) -> Path:
    return Path("results") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"


def shared_options(fn):
    """Flags every run subcommand takes."""
    options = [
        click.option("--device", type=click.Choice(DEVICES), default=lambda: os.environ.get("DETKIT_DEVICE", "cuda"),
                     show_default="cuda (env DETKIT_DEVICE)",
                     help="cuda: compiled Triton on Hopper; cpu: Triton interpreter (not a hardware result)."),
        click.option("--preset", default=None, help="Shape preset (default: qwen3-8b-tp2 on cuda, tiny on cpu)."),
        click.option("--seed", type=int, default=1234, show_default=True),
        click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
                     help="Results folder (default: results/<command>-<timestamp>)."),
        click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log progress to stderr.")
def main(verbose: bool) -> None:
    """detkit: deterministic GEMMs and TP/CP reductions for Hopper, with audits and benchmarks."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


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
                   "launched as >1 ranks). 'all': every single-process suite, plus tp-cp with >1 ranks.")
@click.option("--no-progress", "no_progress", is_flag=True,
              help="No progress bar (there is one on stderr only when it is a terminal, on rank 0).")
@shared_options
def audit(suites, no_progress, device, preset, seed, out_dir, as_json) -> None:
    """Run audit suites and write rows.jsonl, report.json, report.md (and plots) to --out."""
    from detkit.toolkit import harness

    world_size = _world_size_from_env()
    try:  # unknown names and an unfit host fail here, before any work
        selection = harness.select_suites(suites, device=device, gpu_count=_gpu_count() if device == "cuda" else 0,
                                          world_size=world_size)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    _select_device(device)
    names = selection.suites
    _bind_local_gpu(device, world_size)
    ctx = harness.resolve_context(device, preset, seed, out_dir)
    out = out_dir or _default_out("audit")
    # --- tp-cp hook (issue 4, docs/tp_cp.md): start the process group and the TP/CP groups when
    # launched as ranks by torchrun/srun (None otherwise); rank 0 merges the rows and writes the report.
    from detkit.toolkit import dist as tp_cp_dist

    session = tp_cp_dist.setup_distributed(ctx, out)
    out = tp_cp_dist.out_dir(session, out)
    # --- end tp-cp hook
    reporting = tp_cp_dist.writes_report(session)
    env = harness.env_meta(ctx.device) if reporting else {}  # captured before the work, on the reporting rank
    if ctx.interpreted and reporting:
        click.secho(harness.INTERPRETER_BANNER, fg="yellow", err=True)
    for skipped in selection.skipped:
        if reporting:
            click.secho(f"skipped {skipped}", fg="yellow", err=True)
    bar = _Progress(len(harness.suite_modules(names)), enabled=sys.stderr.isatty() and reporting and not no_progress)
    writer = harness.RowWriter(tp_cp_dist.rows_path(session, out))  # tp-cp hook: one rows file per rank
    try:
        rows = harness.run_plugins(names, ctx, writer, on_row=bar.on_row, on_plugin=bar.on_plugin)
    finally:
        writer.close()
        bar.close()
    rows, dist_meta = tp_cp_dist.merge_rows(session, rows, out)  # tp-cp hook: rank 0 gets every rank's rows
    meta = harness.base_meta(ctx, "audit", shlex.join(sys.argv))
    meta["suites"] = list(names)
    meta["suite_selection"] = selection.as_meta()
    meta.update(dist_meta)  # tp-cp hook
    meta.update(env)  # the full capture replaces the summary dist_meta carries under "env"
    if selection.skipped:
        meta["not_covered"] = [*meta.get("not_covered", []), *(f"suite {s}" for s in selection.skipped)]
    failed = [r for r in rows if not r.passed]
    if reporting:  # tp-cp hook: only rank 0 (or a single process) writes
        json_path, md_path = harness.write_report(out, meta, rows)
        if as_json:
            click.echo(json_path.read_text())
        else:
            click.echo(tabulate(harness.summarize(rows), headers="keys", tablefmt="simple"))
            click.echo(f"report: {md_path}")
    ok = tp_cp_dist.finish(session, bool(rows) and not failed)  # tp-cp hook: all ranks agree; group destroyed
    if not ok:
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
