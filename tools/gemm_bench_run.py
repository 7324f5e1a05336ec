"""Run the ``detkit bench gemm`` plug-in (bench/gemm.py) from a checkout: through the benchmarks' runner
(``detkit.toolkit.benches``) where this checkout has it, else through the small runner below, which writes the
same files (rows.jsonl as rows come, then report.json and report.md, plots beside them).

    python -m tools.gemm_bench_run --device cuda --out results/bench-gemm [bench gemm's options]
    python -m tools.gemm_bench_run --device cuda --out results/bench-gemm --report-only [the same options]

Stopped by SIGINT (a time limit), it writes the report of the rows measured so far and exits 1.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import click


def _runner():
    """toolkit.benches when it runs bench gemm, else None."""
    try:
        from detkit.toolkit import benches
    except ImportError:
        return None
    return benches if "detkit.bench.gemm" in getattr(benches, "PLUGINS", ()) else None


def _run_here(device, preset, seed, out_dir, rounds, report_only, options) -> int:
    from detkit.bench import gemm
    from detkit.toolkit import harness

    @dataclass(frozen=True)
    class Context(harness.RunContext):
        rounds: int | None = None

    base = harness.resolve_context(device, preset, seed, out_dir)
    ctx = Context(base.device, base.backend, base.preset, base.seed, base.out_dir, rounds=rounds)
    meta = {**harness.base_meta(ctx, "bench gemm", shlex.join(sys.argv)), "options": options}
    if report_only:  # the report of rows an earlier (possibly stopped) run wrote
        rows = [json.loads(line) for line in (out_dir / "rows.jsonl").read_text().splitlines() if line.strip()]
        meta["report_only"] = True
    else:
        selected = gemm.cases(ctx, **options)
        meta.update(cases=len(selected), **harness.env_meta(ctx.device))
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = []
        try:
            with open(out_dir / "rows.jsonl", "w", encoding="utf-8") as f:
                for row in gemm.run(ctx, selected, **options):
                    rows.append(row)
                    f.write(json.dumps(row, default=str) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                    print(("passed " if row["passed"] else "FAILED ") + row["name"], file=sys.stderr, flush=True)
        except KeyboardInterrupt:  # stopped at a time limit: report what was measured
            meta["interrupted_after_rows"] = len(rows)
    meta["derived"] = gemm.derive(rows, meta)
    meta["plots"] = [p.name for p in gemm.plots(out_dir, rows)]
    harness.atomic_write_text(out_dir / "report.json", json.dumps({"meta": meta, "rows": rows}, indent=2,
                                                                   default=str) + "\n")
    head = ["# detkit bench gemm", ""] + [f"- {k}: {v}" for k, v in meta.items() if not isinstance(v, (dict, list))]
    harness.atomic_write_text(out_dir / "report.md", "\n".join(head) + "\n\n" + gemm.summarize(rows, meta) + "\n")
    complete = "interrupted_after_rows" not in meta
    return 0 if rows and complete and all(r["passed"] for r in rows) else 1


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if _runner() is not None:  # the project's own runner: the very command `detkit bench gemm`
        from detkit.toolkit.cli import main as cli_main

        return cli_main(["bench", "gemm", *args], prog_name="detkit")
    device = next((a.split("=", 1)[1] for a in args if a.startswith("--device=")), None)
    if "--device" in args[:-1]:
        device = args[args.index("--device") + 1]
    if device == "cpu":  # Triton picks interpreter or compiler when a kernel is defined: before the import
        os.environ["TRITON_INTERPRET"] = "1"
    from detkit.bench import gemm

    def command(device, preset, seed, out_dir, rounds, report_only, **options):
        raise SystemExit(_run_here(device, preset, seed, out_dir, rounds, report_only, options))

    for option in reversed((
        click.option("--device", type=click.Choice(("cuda", "cpu")), default="cuda", show_default=True),
        click.option("--preset", default=None),
        click.option("--seed", type=int, default=1234, show_default=True),
        click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True),
        click.option("--rounds", type=int, default=None),
        click.option("--report-only", is_flag=True, help="Only render the report of --out's rows.jsonl."),
        *gemm.OPTIONS,
    )):
        command = option(command)
    return click.command(name="gemm_bench_run", help=__doc__.splitlines()[0])(command)(args=args)


if __name__ == "__main__":
    main()
