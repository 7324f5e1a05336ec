"""The one harness every audit and benchmark suite plugs into.

A plug-in is a module with ``NAME`` (str), ``DESCRIPTION`` (str) and ``run(ctx) -> Iterable[Row]``.
The harness runs plug-ins in order, appends each row to ``rows.jsonl`` as soon as it exists
(flushed and fsynced, so a killed run keeps every finished case) and, at the end, writes
``report.json`` and ``report.md`` atomically (temp file + rename).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tabulate import tabulate

from toolkit.nvtx_ranges import nvtx_range

log = logging.getLogger(__name__)

INTERPRETER_BANNER = (
    "BACKEND triton_interpreter: CPU emulation of the Triton kernels at tiny shapes. "
    "This is NOT a hardware result and says nothing about speed or Hopper tensor-core bits."
)

# Suite name -> plug-in modules, in run order. A plug-in's own NAME is also accepted as a suite.
SUITES: dict[str, tuple[str, ...]] = {
    "gemm": ("audits.gemm_batch_invariance", "audits.gemm_determinism", "audits.gemm_contract"),
    "tp-cp": ("audits.tp_cp",), "tp-cp-refs": ("audits.tp_cp_refs",),  # issue 4 (docs/tp_cp.md)
}


@dataclass
class Row:
    """One checked case. ``name`` is the case's NVTX range name too."""

    suite: str
    check: str
    name: str
    passed: bool
    backend: str
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RunContext:
    device: torch.device
    backend: str
    preset: str
    seed: int = 1234
    out_dir: Path | None = None

    @property
    def interpreted(self) -> bool:
        return self.backend == "triton_interpreter"


def resolve_context(device: str, preset: str | None, seed: int, out_dir: Path | None) -> RunContext:
    """Decide the backend for ``device`` through the kernel's own check (fails closed)."""
    from kernels.backend import resolve_backend
    from kernels.det_gemm import det_gemm_kernel
    from toolkit.presets import GEMM_PRESETS, default_gemm_preset

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA GPU; "
                           "use --device cpu for the Triton-interpreter audits (not a hardware result)")
    backend = resolve_backend(det_gemm_kernel, {"device": torch.empty(0, device=dev)})
    preset = preset or default_gemm_preset(backend)
    if preset not in GEMM_PRESETS:
        raise ValueError(f"preset {preset!r} is not supported; supported: {sorted(GEMM_PRESETS)}")
    return RunContext(device=dev, backend=backend, preset=preset, seed=seed, out_dir=out_dir)


def plugin_modules(suite: str) -> tuple[str, ...]:
    if suite in SUITES:
        return SUITES[suite]
    for modules in SUITES.values():
        for module in modules:
            if module.rsplit(".", 1)[-1] == suite:
                return (module,)
    known = sorted(set(SUITES) | {m.rsplit(".", 1)[-1] for ms in SUITES.values() for m in ms})
    raise ValueError(f"suite {suite!r} is not known; known: {known}")


class RowWriter:
    """Appends rows to a JSONL file, one fsynced line each."""

    def __init__(self, path: Path | None):
        self.path = path
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")

    def write(self, row: Row) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(row.as_dict(), default=str) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def run_plugins(suites: Iterable[str], ctx: RunContext, writer: RowWriter,
                on_row: Callable[[Row], None] | None = None) -> list[Row]:
    rows: list[Row] = []
    modules = [m for suite in suites for m in plugin_modules(suite)]
    for module_name in dict.fromkeys(modules):
        plugin = importlib.import_module(module_name)
        log.info("running %s on %s (%s preset)", plugin.NAME, ctx.backend, ctx.preset)
        with nvtx_range(f"audit {plugin.NAME}"):
            for row in plugin.run(ctx):
                writer.write(row)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return rows


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def summarize(rows: list[Row]) -> list[dict]:
    """One line per (suite, check): counts of passed and failed rows."""
    table: dict[tuple[str, str], dict] = {}
    for row in rows:
        entry = table.setdefault((row.suite, row.check), {"suite": row.suite, "check": row.check,
                                                           "passed": 0, "failed": 0})
        entry["passed" if row.passed else "failed"] += 1
    return list(table.values())


def render_markdown(meta: dict, rows: list[Row]) -> str:
    lines = [f"# detkit {meta['command']} report", ""]
    if meta["backend"] == "triton_interpreter":
        lines += [f"> **{INTERPRETER_BANNER}**", ""]
    lines += [f"- {key}: {meta[key]}" for key in ("date", "backend", "preset", "device_name", "seed",
                                                   "config_table_version", "command_line")]
    failed = [r for r in rows if not r.passed]
    lines += [f"- result: **{'PASS' if rows and not failed else 'FAIL'}** "
              f"({len(rows) - len(failed)} passed, {len(failed)} failed)", "", "## Summary", "",
              tabulate(summarize(rows), headers="keys", tablefmt="github"), ""]
    if failed:
        lines += ["## Failed rows", ""]
        lines += [f"- `{r.check}` {r.name}: {json.dumps(r.details, default=str)}" for r in failed]
        lines.append("")
    for key in ("covered", "not_covered"):
        if meta.get(key):
            lines += [f"## {key.replace('_', ' ').upper()}", ""] + [f"- {item}" for item in meta[key]] + [""]
    lines += ["## Rows", "", tabulate(
        [{"check": r.check, "name": r.name, "passed": r.passed,
          **{k: v for k, v in r.details.items() if not isinstance(v, (dict, list))}} for r in rows],
        headers="keys", tablefmt="github"), ""]
    return "\n".join(lines)


def write_report(out_dir: Path, meta: dict, rows: list[Row]) -> tuple[Path, Path]:
    report = {"meta": meta, "summary": summarize(rows), "rows": [r.as_dict() for r in rows]}
    json_path, md_path = out_dir / "report.json", out_dir / "report.md"
    atomic_write_text(json_path, json.dumps(report, indent=2, default=str) + "\n")
    atomic_write_text(md_path, render_markdown(meta, rows))
    return json_path, md_path


def base_meta(ctx: RunContext, command: str, command_line: str) -> dict:
    from kernels.det_gemm import CONFIG_TABLE_VERSION

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
        "config_table_version": CONFIG_TABLE_VERSION,
    }
