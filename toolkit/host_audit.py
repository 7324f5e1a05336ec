"""The audit ``docker compose run audit`` runs: one ``detkit audit`` of the default suites on this host.

The suites are ``--suite`` / DETKIT_SUITE (space- or comma-separated; default ``all``: every suite,
with the ranks tp-cp and invariance need started on this host: 4 ranks with >= 4 GPUs, one TP group
and one CP group of 2 ranks with 2-3 GPUs, skipped with the reason on 1 GPU; 4 gloo ranks on the
loopback with ``--device cpu``). The device is ``--device`` / DETKIT_DEVICE (default cuda;
compose.cpu.yaml sets cpu: the Triton interpreter, not a hardware result). The run writes its
report folder under ``--out/host-audit-<timestamp>/<device>``; its path and status are printed at
the end, and the exit status is the audit's.

Every check before any work, as one line with exit status 2: unknown suite names first (the
subject of the command), then a cuda run on a host where torch sees no GPU. SIGINT and SIGTERM are
passed on to the audit, which writes its report marked INCOMPLETE before it ends. ``--dry-run``
prints the command only.

    python -m detkit.toolkit.host_audit --out /results [--device cpu|cuda] [--suite NAME ...] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SUITES = ("all",)


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]


def _suite_args(suites: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(arg for s in suites for arg in ("--suite", s))


def plan(gpus: int, out: Path, device: str = "cuda", suites: tuple[str, ...] = ()) -> Step:
    """The one ``detkit audit`` run for this host (``gpus`` CUDA GPUs, or ``device="cpu"``), writing to
    ``out/<device>``. Raises ValueError for an unknown suite or device, RuntimeError for cuda without a GPU."""
    from detkit.toolkit.harness import check_suite_names

    suites = suites or DEFAULT_SUITES
    check_suite_names(suites)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device {device!r} is not supported; supported: cuda, cpu")
    if device == "cuda" and gpus < 1:
        raise RuntimeError("no CUDA GPU is visible: the host audit needs a Hopper GPU "
                           "(for the interpreter audits without a GPU: DETKIT_DEVICE=cpu, or docker compose -f "
                           "compose.yaml -f compose.cpu.yaml run --rm audit)")
    return Step(device, (sys.executable, "-m", "detkit", "audit", "--device", device, *_suite_args(suites),
                         "--no-progress", "--out", str(out / device)))


def run(step: Step, env: dict[str, str]) -> int:
    """Run ``step`` in its own process group, passing SIGINT and SIGTERM on to it (once each) and waiting
    for it to write its report: a Ctrl-C at the terminal, or ``docker stop``, reaches this process (in a
    container, PID 1) and not the audit."""
    proc = subprocess.Popen(step.argv, env=env, process_group=0)

    def forward(signum, frame):
        if proc.poll() is None:
            print(f"host audit: {signal.Signals(signum).name}: passed on to the audit, which writes its report",
                  file=sys.stderr, flush=True)
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def report_line(report_dir: Path, code: int) -> str:
    """``<report.md> (<status>)``, the status read from report.json; says so when no report was written."""
    md = report_dir / "report.md"
    try:
        status = json.loads((report_dir / "report.json").read_text())["meta"].get("status") or "no status"
    except (OSError, ValueError, KeyError):
        return f"{md}: not written (exit status {code}; see the output above)"
    return f"{md} ({status})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--gpus", type=int, default=None, help="GPU count (default: torch.cuda.device_count())")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=os.environ.get("DETKIT_DEVICE") or "cuda",
                        help="cuda (default, env DETKIT_DEVICE) or cpu: the Triton-interpreter audits")
    parser.add_argument("--suite", action="append", default=None,
                        help="suite names (default: env DETKIT_SUITE, else all)")
    args = parser.parse_args(argv)
    suites = tuple(args.suite or os.environ.get("DETKIT_SUITE", "").replace(",", " ").split())
    gpus = args.gpus
    if gpus is None and args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    out = args.out / f"host-audit-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        step = plan(gpus or 0, out, args.device, suites)
    except (RuntimeError, ValueError) as exc:
        print(f"host audit: error: {exc}", file=sys.stderr)
        return 2
    print(f"[{step.name}] {' '.join(step.argv)}", flush=True)
    if args.dry_run:
        return 0
    env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
    started = time.monotonic()
    code = run(step, env)
    # The audit's processes (its ranks too) were all waited for: their CPU time is the run's cost on an idle
    # machine, whatever else shared the cores.
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"\nhost audit: {time.monotonic() - started:.0f} s, {used.ru_utime + used.ru_stime:.0f} s of CPU (user + "
          f"system, every process of the audit)", flush=True)
    print(f"host audit: report: {report_line(out / step.name, code)}", flush=True)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's 128 + N


if __name__ == "__main__":
    raise SystemExit(main())
