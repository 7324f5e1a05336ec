"""The one harness every audit suite plugs into.

A plug-in is a module with ``NAME`` (str), ``DESCRIPTION`` (str) and ``run(ctx) -> Iterable[Row]``.
The harness runs plug-ins in order, appends each row to ``rows.jsonl`` as soon as it exists
(flushed and fsynced, so a killed run keeps every finished case) and, at the end, writes
``report.json`` and ``report.md`` atomically (temp file + rename), plus the PNG plots the rows
support (``drift_hist.png`` from contract rows). Formats: docs/reports.md. The benchmarks' runner
(``toolkit.benches``) writes the same files through the same pieces.

Suite selection (``select_suites``): names are suites (``SUITES``), plug-in names, or the selectors
``auto`` (the suites that fit this host) and ``all`` (every suite that can run in this launch). The
multi-rank suites (``MULTI_RANK_SUITES``), named or through ``all``, run on ranks the caller starts on
this host when the process was not launched as ranks. Unknown names, a named multi-rank suite this
host cannot start ranks for, and a suite whose Python dependency is missing (``SUITE_NEEDS``) fail
before any work, naming the value and what is supported.

A plug-in that raises does not end the run in one process (``run_plugins(keep_going=True)``): its
error becomes a failed row (check ``suite_error``, or ``missing_dependency`` when an import failed)
and the next plug-in runs, so the report says what ran and why the run failed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from detkit.toolkit.nvtx_ranges import nvtx_range
from detkit.toolkit.provenance import config_tables, source_state
from detkit.toolkit.records import INTERPRETER_BANNER, Row, RowWriter, atomic_write_text, summarize
from detkit.toolkit.reports import render_audit_markdown, write_audit_plots

__all__ = ["INTERPRETER_BANNER", "Row", "RowWriter", "RunContext", "atomic_write_text", "base_meta", "env_meta",
           "resolve_context", "run_plugins", "run_status", "select_suites", "summarize", "write_report"]

log = logging.getLogger(__name__)

# Suite name -> plug-in modules, in run order. A plug-in's own NAME is also accepted as a suite.
SUITES: dict[str, tuple[str, ...]] = {
    "gemm": ("detkit.audits.gemm_batch_invariance", "detkit.audits.gemm_determinism", "detkit.audits.gemm_contract"),
    "tp-cp": ("detkit.audits.tp_cp",), "tp-cp-refs": ("detkit.audits.tp_cp_refs",),  # docs/tp_cp.md
    "invariance": ("detkit.audits.invariance",),  # docs/invariance.md
    "moe": ("detkit.audits.moe",),  # docs/moe.md
    "moe-fp8": ("detkit.audits.moe_fp8",),  # docs/moe_fp8.md
    "model": ("detkit.audits.model",),  # docs/mode.md
    "model-parallel": ("detkit.audits.model_parallel",),  # docs/mode_parallel.md (starts its own ranks)
    "attention": ("detkit.audits.attention",),  # docs/attention.md
}
# The plug-ins whose cases come from the shape preset (--preset): a report names the preset only when one ran.
PRESET_MODULES = (*SUITES["gemm"], "detkit.audits.tp_cp", "detkit.audits.tp_cp_refs")
# Suites that need several ranks (torchrun/srun); every other suite runs in one process.
MULTI_RANK_SUITES = ("tp-cp", "invariance")
SELECTORS = ("auto", "all")
# Plug-in module -> (import name, how to install it) of the optional dependencies it cannot run without
# (pyproject.toml's extras); checked before any work.
SUITE_NEEDS: dict[str, tuple[tuple[str, str], ...]] = {
    "detkit.audits.model": (("transformers", "pip install 'detkit[models]'"),),
}


def launch_hint(suite: str) -> str:
    return (f"torchrun --nproc-per-node 2 --standalone -m detkit audit --suite {suite} "
            "(2 GPUs: one TP or CP group, DETKIT_TPCP_WORLD; 4 ranks: the full TP=2 x CP=2 layout; docs/tp_cp.md)")


@dataclass(frozen=True)
class RunContext:
    """What a plug-in runs with. ``preset``: the shape preset (a benchmark with presets of its own gets the
    names given on the command line in ``presets``, joined here). ``rounds``: a benchmark's timing rounds."""

    device: torch.device
    backend: str
    preset: str
    seed: int = 1234
    out_dir: Path | None = None
    rounds: int | None = None
    presets: tuple[str, ...] = ()

    @property
    def interpreted(self) -> bool:
        return self.backend == "triton_interpreter"


def resolve_device(device: str) -> tuple[torch.device, str]:
    """(device, backend) for ``device``, the backend decided by the kernel's own check (fails closed)."""
    from detkit.kernels.backend import resolve_backend
    from detkit.kernels.det_gemm.launch import det_gemm_kernel

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA GPU; "
                           "use --device cpu for the Triton interpreter (not a hardware result)")
    return dev, resolve_backend(det_gemm_kernel, {"device": torch.empty(0, device=dev)})


def resolve_context(device: str, preset: str | None, seed: int, out_dir: Path | None,
                    rounds: int | None = None) -> RunContext:
    """The context of a run at a GEMM shape preset (default: the backend's); unknown presets fail closed."""
    from detkit.toolkit.presets import GEMM_PRESETS, default_gemm_preset

    dev, backend = resolve_device(device)
    preset = preset or default_gemm_preset(backend)
    if preset not in GEMM_PRESETS:
        raise ValueError(f"preset {preset!r} is not supported; supported: {sorted(GEMM_PRESETS)}")
    return RunContext(device=dev, backend=backend, preset=preset, seed=seed, out_dir=out_dir, rounds=rounds)


def known_suite_names() -> list[str]:
    """Every name ``--suite`` accepts: selectors, suites and plug-in names."""
    plugins = {m.rsplit(".", 1)[-1] for ms in SUITES.values() for m in ms}
    return [*SELECTORS, *sorted(set(SUITES) | plugins)]


def plugin_modules(suite: str) -> tuple[str, ...]:
    if suite in SUITES:
        return SUITES[suite]
    for modules in SUITES.values():
        for module in modules:
            if module.rsplit(".", 1)[-1] == suite:
                return (module,)
    raise ValueError(f"suite {suite!r} is not known; known: {known_suite_names()}")


@dataclass(frozen=True)
class SuiteSelection:
    """What ``--suite`` resolved to on this host, and why (recorded in the report's meta)."""

    requested: tuple[str, ...]
    suites: tuple[str, ...]  # suite or plug-in names run in this process, run order, no duplicates
    reasons: tuple[str, ...]
    skipped: tuple[str, ...]  # "<suite>: <why>", for the report's not-covered list
    launched: tuple[str, ...] = ()  # multi-rank suites to run on ranks this process starts itself

    def as_meta(self) -> dict:
        return {"requested": list(self.requested), "resolved": list(self.suites), "reasons": list(self.reasons),
                "skipped": list(self.skipped), "launched_on_local_ranks": list(self.launched)}


def select_suites(requested: Iterable[str], *, device: str, gpu_count: int, world_size: int,
                  local_ranks: int = 0) -> SuiteSelection:
    """Resolve ``--suite`` names for this host before any work.

    ``auto``: no GPU -> refused unless ``device == "cpu"`` (then gemm under the Triton interpreter);
    one GPU -> gemm; two or more -> gemm, plus tp-cp when launched as more than one rank. On the
    CPU, tp-cp joins gemm when launched as ranks (gloo). ``all``: every single-process suite, plus
    the ``MULTI_RANK_SUITES``: in this launch when it has more than one rank, else on
    ``local_ranks`` ranks that the caller starts itself on this host (``launched``; 0: it cannot,
    e.g. fewer than 2 GPUs, and they are skipped with the reason). A multi-rank suite named
    explicitly (``tp-cp``, ``invariance`` or their plug-ins) is started on those ranks the same way;
    where none can be started it is refused, since in one process it could only fail its ``launch``
    check. Raises ValueError naming the value and the supported ones.
    """
    requested = tuple(requested) or ("auto",)
    check_suite_names(requested)
    multi = world_size > 1
    suites: list[str] = []
    reasons: list[str] = []
    skipped: list[str] = []
    launched: list[str] = []
    ranks_note = f"launched as {world_size} ranks" if multi else "one process (not launched as ranks)"
    backend = "gloo on loopback" if device == "cpu" else "NCCL"
    for name in requested:
        if name == "auto":
            if device == "cpu":
                suites.append("gemm")
                reasons.append("auto: --device cpu -> gemm under the Triton interpreter (not a hardware result)")
                if multi:
                    suites.append("tp-cp")
                    reasons.append(f"auto: {ranks_note} -> tp-cp on gloo (not a hardware result)")
            elif gpu_count < 1:
                raise ValueError(
                    "--suite auto: torch sees no CUDA GPU on this host; run the gemm suite under the Triton "
                    "interpreter with --device cpu (not a hardware result), or run on a Hopper GPU host")
            else:
                suites.append("gemm")
                reasons.append(f"auto: {gpu_count} GPU(s) -> gemm")
                if gpu_count >= 2 and multi:
                    suites.append("tp-cp")
                    reasons.append(f"auto: {gpu_count} GPUs, {ranks_note} -> tp-cp")
                elif gpu_count >= 2:
                    skipped.append(f"tp-cp: {gpu_count} GPUs but {ranks_note}; run {launch_hint('auto')}")
                else:
                    skipped.append("tp-cp: needs at least 2 GPUs of one host (or 4 ranks over 2 nodes)")
        elif name == "all":
            single = [s for s in SUITES if s not in MULTI_RANK_SUITES]
            suites += single
            reasons.append(f"all: every single-process suite ({', '.join(single)})")
            for s in MULTI_RANK_SUITES:
                if multi:
                    suites.append(s)
                    reasons.append(f"all: {ranks_note} -> {s}")
                elif local_ranks >= 2:
                    launched.append(s)
                    reasons.append(f"all: {s} on {local_ranks} ranks started on this host ({backend})")
                elif device == "cuda":
                    skipped.append(f"{s}: needs at least 2 GPUs of one host to start its ranks ({gpu_count} "
                                   f"visible), or a launch as ranks: {launch_hint(s)}")
                else:
                    skipped.append(f"{s}: needs more than one rank ({ranks_note}); run {launch_hint(s)}")
        elif is_multi_rank(name) and not multi:
            if local_ranks < 2:
                where = (f"at least 2 GPUs of one host to start them ({gpu_count} visible)" if device == "cuda"
                         else "ranks this caller cannot start")
                raise ValueError(f"--suite {name} needs several ranks: {where}; run {launch_hint(name)}")
            launched.append(name)
            reasons.append(f"{name}: on {local_ranks} ranks started on this host ({backend})")
        else:
            suites.append(name)
    suites = list(dict.fromkeys(suites))
    launched = [s for s in dict.fromkeys(launched) if s not in suites]
    skipped = [s for s in dict.fromkeys(skipped) if s.split(":", 1)[0] not in suites + launched]
    return SuiteSelection(requested, tuple(suites), tuple(reasons), tuple(skipped), tuple(launched))


def check_suite_names(requested: Iterable[str]) -> None:
    """Every name is a selector, a suite or a plug-in; raises ValueError listing the known ones."""
    unknown = [n for n in requested if n not in SELECTORS and not _is_known(n)]
    if unknown:
        raise ValueError(f"suite(s) {unknown} not known; known: {known_suite_names()}")


def is_multi_rank(name: str) -> bool:
    """Whether ``name`` (a suite or plug-in) is one of the multi-rank suites or their plug-ins."""
    ranked = set(suite_modules(MULTI_RANK_SUITES))
    return name not in SELECTORS and set(plugin_modules(name)) <= ranked


def missing_dependencies(suites: Iterable[str]) -> list[str]:
    """One line per Python package a plug-in of ``suites`` needs and this environment lacks (``SUITE_NEEDS``),
    found without importing it."""
    missing = []
    for module in suite_modules(suites):
        for package, install in SUITE_NEEDS.get(module, ()):
            if importlib.util.find_spec(package) is None:
                suite = module.rsplit(".", 1)[-1]
                missing.append(f"the {suite} suite needs {package}, which is not installed ({install})")
    return missing


def _is_known(name: str) -> bool:
    try:
        plugin_modules(name)
    except ValueError:
        return False
    return True


def suite_modules(suites: Iterable[str]) -> list[str]:
    """The plug-in modules of ``suites``, in run order, each once."""
    return list(dict.fromkeys(m for suite in suites for m in plugin_modules(suite)))


def uses_preset(suites: Iterable[str]) -> bool:
    """Whether any plug-in of ``suites`` takes its cases from the shape preset."""
    return any(m in PRESET_MODULES for m in suite_modules(suites))


def run_plugins(suites: Iterable[str], ctx: RunContext, writer: RowWriter,
                on_row: Callable[[Row], None] | None = None,
                on_plugin: Callable[[str], None] | None = None,
                keep_going: bool = False, timings: dict[str, float] | None = None) -> list[Row]:
    """Run every plug-in of ``suites``; ``on_plugin(NAME)`` before each, ``on_row(row)`` after each
    row is written (the CLI's progress bar). ``keep_going``: a plug-in that raises an Exception gives
    one failed row (``error_row``) and the next plug-in runs (one process; under ranks an error must
    end the run, since the other ranks wait in its collectives). ``timings`` gets each plug-in's
    seconds, by NAME."""
    rows: list[Row] = []
    for module_name in suite_modules(suites):
        name = module_name.rsplit(".", 1)[-1]
        started, produced, announced = time.monotonic(), 0, False
        try:
            plugin = importlib.import_module(module_name)
            name = plugin.NAME
            log.info("running %s on %s (%s preset)", name, ctx.backend, ctx.preset)
            if on_plugin is not None:
                on_plugin(name)
            announced = True
            with nvtx_range(f"audit {name}"):
                for row in plugin.run(ctx):
                    writer.write(row)
                    rows.append(row)
                    produced += 1
                    if on_row is not None:
                        on_row(row)
        except Exception as exc:
            if not keep_going:
                raise
            row = error_row(name, ctx.backend, exc, produced)
            log.error("%s: %s", name, row.details["error"])
            if on_plugin is not None and not announced:  # its import failed: it started all the same
                on_plugin(name)
            writer.write(row)
            rows.append(row)
            if on_row is not None:
                on_row(row)
        finally:
            if timings is not None:
                timings[name] = round(time.monotonic() - started, 1)
    return rows


def error_row(suite: str, backend: str, exc: BaseException, rows_before: int) -> Row:
    """The failed row of a plug-in that raised: check ``missing_dependency`` when the error is (or was
    raised from) a failed import, else ``suite_error``; the error, its cause and the traceback's last
    frames in the details."""
    cause = exc if isinstance(exc, ImportError) else exc.__cause__
    missing = cause.name if isinstance(cause, ImportError) else None
    error = f"{type(exc).__name__}: {exc}"
    if cause is not None and cause is not exc:
        error += f" (from {type(cause).__name__}: {cause})"
    check = "missing_dependency" if isinstance(cause, ImportError) else "suite_error"
    frames = traceback.format_exception(exc)
    return Row(suite, check, f"{suite} raised", False, backend, {
        "error": error, "missing_module": missing, "rows_before": rows_before,
        "traceback": "".join(frames)[-2000:]})


ERROR_CHECKS = ("suite_error", "missing_dependency")  # the checks of error_row
STATUSES = ("PASSED", "FAILED", "INCOMPLETE")


def run_status(rows: list[Row]) -> tuple[str, str | None]:
    """(status, reason) of a run that ended on its own: PASSED (rows, none failed), or FAILED with one
    line saying why (the plug-ins that raised, then the failed checks, or no rows at all)."""
    if not rows:
        return "FAILED", "no rows were produced"
    failed = [r for r in rows if not r.passed]
    if not failed:
        return "PASSED", None
    reasons = []
    for r in failed:
        if r.check == "missing_dependency":
            module = r.details.get("missing_module")
            reasons.append(f"{r.suite}: missing dependency{f' {module!r}' if module else ''}: {r.details.get('error')}")
        elif r.check == "suite_error":
            reasons.append(f"{r.suite}: {r.details.get('error')}")
    checks = [r for r in failed if r.check not in ERROR_CHECKS]
    if checks:
        counts: dict[str, int] = {}
        for r in checks:
            counts[f"{r.suite}/{r.check}"] = counts.get(f"{r.suite}/{r.check}", 0) + 1
        reasons.append(f"{len(checks)} failed row(s) in {len(counts)} check(s): "
                       + ", ".join(f"{k} x{n}" for k, n in counts.items()))
    return "FAILED", "; ".join(reasons)


def write_report(out_dir: Path, meta: dict, rows: list[Row]) -> tuple[Path, Path]:
    """Plots first (the markdown links them), then report.json and report.md, each atomically.

    ``meta["status"]`` (``STATUSES``) and ``meta["status_reason"]`` are set from the rows (``run_status``)
    unless the caller set the status already (INCOMPLETE: the run was stopped; its reason is the caller's)."""
    if meta.get("status") not in STATUSES:
        meta["status"], meta["status_reason"] = run_status(rows)
    meta.setdefault("status_reason", None)
    meta["plots"] = [p.name for p in write_audit_plots(out_dir, rows)]
    report = {"meta": meta, "summary": summarize(rows), "rows": [r.as_dict() for r in rows]}
    json_path, md_path = out_dir / "report.json", out_dir / "report.md"
    atomic_write_text(json_path, json.dumps(report, indent=2, default=str) + "\n")
    atomic_write_text(md_path, render_audit_markdown(meta, rows))
    return json_path, md_path


def base_meta(ctx: RunContext, command: str, command_line: str) -> dict:
    """The run's identity, taken at report time: command, date, backend, preset, seed, the config tables of
    the kernel modules that were loaded and the source files checked against git (``toolkit.provenance``)."""
    device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    return {
        "command": command,
        "command_line": command_line,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "backend": ctx.backend,
        "hardware_result": not ctx.interpreted,
        "preset": ctx.preset,
        "device_name": device_name,
        "seed": ctx.seed,
        **({"rounds": ctx.rounds} if ctx.rounds is not None else {}),
        "config_tables": config_tables(),
        "source": source_state(),
    }


def env_meta(device: torch.device) -> dict:
    """The environment capture for a report's meta: ``env`` (full ``toolkit.env.capture_env``, in
    report.json) and ``env_summary`` (the flat fields report.md shows)."""
    from detkit.toolkit.env import capture_env, env_summary

    captured = capture_env(probe_cuda=device.type == "cuda")
    return {"env": captured, "env_summary": env_summary(captured)}
