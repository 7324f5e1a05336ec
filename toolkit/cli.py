"""The ``detkit`` command: ``detkit env``, ``detkit audit``, ``detkit bench``.

Every subcommand shares --device/--preset/--seed/--out/--json and exits non-zero when a check fails.
``--device cpu`` selects the Triton interpreter (TRITON_INTERPRET=1, set here before any kernel is
imported); its results are labelled as not being hardware results everywhere they appear.
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

DEVICES = ("cuda", "cpu")


def _select_device(device: str) -> None:
    if device == "cpu":
        # Triton decides interpreter vs compiler when a kernel is defined: set it before importing kernels.
        if "kernels.det_gemm" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
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
    from toolkit.env import capture_env, format_env_table

    captured = capture_env()
    click.echo(json.dumps(captured, indent=2, default=str) if as_json else format_env_table(captured))


@main.command()
@click.option("--suite", "suites", multiple=True, default=("gemm",), show_default=True,
              help="Suite or plug-in name; repeat for several ('all' runs every suite).")
@shared_options
def audit(suites, device, preset, seed, out_dir, as_json) -> None:
    """Run audit suites and write rows.jsonl, report.json and report.md."""
    _select_device(device)
    from toolkit import harness

    names = tuple(harness.SUITES) if "all" in suites else suites
    for name in names:
        harness.plugin_modules(name)  # unknown names fail before any work
    ctx = harness.resolve_context(device, preset, seed, out_dir)
    out = out_dir or _default_out("audit")
    # --- tp-cp hook (issue 4, docs/tp_cp.md): start the process group and the TP/CP groups when
    # launched as ranks by torchrun/srun (None otherwise); rank 0 merges the rows and writes the report.
    from toolkit import dist as tp_cp_dist

    session = tp_cp_dist.setup_distributed(ctx, out)
    out = tp_cp_dist.out_dir(session, out)
    # --- end tp-cp hook
    if ctx.interpreted:
        click.secho(harness.INTERPRETER_BANNER, fg="yellow", err=True)
    writer = harness.RowWriter(tp_cp_dist.rows_path(session, out))  # tp-cp hook: one rows file per rank
    try:
        rows = harness.run_plugins(names, ctx, writer)
    finally:
        writer.close()
    rows, dist_meta = tp_cp_dist.merge_rows(session, rows, out)  # tp-cp hook: rank 0 gets every rank's rows
    meta = harness.base_meta(ctx, "audit", shlex.join(sys.argv))
    meta["suites"] = list(names)
    meta.update(dist_meta)  # tp-cp hook
    failed = [r for r in rows if not r.passed]
    if tp_cp_dist.writes_report(session):  # tp-cp hook: only rank 0 (or a single process) writes
        json_path, md_path = harness.write_report(out, meta, rows)
        if as_json:
            click.echo(json_path.read_text())
        else:
            click.echo(tabulate(harness.summarize(rows), headers="keys", tablefmt="simple"))
            click.echo(f"report: {md_path}")
    ok = tp_cp_dist.finish(session, bool(rows) and not failed)  # tp-cp hook: all ranks agree; group destroyed
    if not ok:
        for row in failed:
            click.echo(f"FAILED {row.check}: {row.name} {json.dumps(row.details, default=str)}", err=True)
        raise SystemExit(1)


@main.group()
def bench() -> None:
    """Benchmarks against their baselines in the same run (ratios, medians with p20/p80)."""


@bench.command("gemm")
@click.option("--ops", multiple=True, type=click.Choice(["fwd", "da", "db"]), default=("fwd", "da", "db"),
              show_default=True)
@click.option("--m", "m_values", multiple=True, type=int, help="M values (default: the issue's sweep; tiny on cpu).")
@click.option("--layouts", multiple=True, type=click.Choice(["kn", "linear"]), default=("kn", "linear"),
              show_default=True)
@click.option("--rounds", type=int, default=5, show_default=True, help="Interleaved timing rounds.")
@shared_options
def bench_gemm(ops, m_values, layouts, rounds, device, preset, seed, out_dir, as_json) -> None:
    """det_gemm fwd/dA/dB vs cuBLAS and cuBLASLt without split-K."""
    _select_device(device)
    from bench import gemm
    from toolkit import harness

    if any(m < 1 for m in m_values):
        raise click.BadParameter(f"M values must be >= 1; got {m_values}", param_hint="--m")
    ctx = harness.resolve_context(device, preset, seed, out_dir)
    if ctx.interpreted:
        click.secho(harness.INTERPRETER_BANNER, fg="yellow", err=True)
    out = out_dir or _default_out("bench")
    selected = gemm.cases(ctx.interpreted, ops=ops, m_values=m_values or None, layouts=layouts)
    rows, meta = gemm.run(ctx.device, ctx.interpreted, selected, rounds=rounds)
    meta = {**harness.base_meta(ctx, "bench gemm", shlex.join(sys.argv)), **meta}
    paths = gemm.write_outputs(out, rows, meta)
    bad = [r for r in rows if not r["contract_passed"]]
    if as_json:
        click.echo(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str))
    else:
        click.echo(paths["markdown"].read_text())
    if bad:
        for row in bad:
            click.echo(f"FAILED contract before timing: {row['name']}", err=True)
        raise SystemExit(1)
