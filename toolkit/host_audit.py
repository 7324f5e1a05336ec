"""The single-host audit that fits the GPUs present: ``docker compose run audit`` runs this.

1 GPU: the det_gemm audit suite. 2 or 3 GPUs: also the TP/CP operators on real NCCL, one 2-rank
run holding a TP group (ranks 0,1: Down forward and Gate/Up dX) and one holding a CP group (ranks
0,2: the dW reduction). 4 or more: the full 4-rank TP=2 x CP=2 layout on one host. Every run writes
its own report folder under --out; the paths are printed at the end and the exit code is non-zero
when any run failed. ``--dry-run`` prints the plan only.

``--device cpu`` (or DETKIT_DEVICE=cpu, as compose.cpu.yaml sets): one ``detkit audit --device cpu``
run under the Triton interpreter (not a hardware result) of the suites in ``--suite`` / DETKIT_SUITE
(space- or comma-separated; default ``all``, whose multi-rank suites run on 4 gloo ranks that the
audit starts itself). On cuda, DETKIT_SUITE replaces the single-process run's ``gemm``.

    python -m detkit.toolkit.host_audit --out /results [--device cpu|cuda] [--suite NAME ...] [--dry-run]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


def _torchrun(nproc: int) -> tuple[str, ...]:
    return (sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "detkit")


def _suite_args(suites: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(arg for s in suites for arg in ("--suite", s))


def plan(gpus: int, out: Path, device: str = "cuda", suites: tuple[str, ...] = ()) -> list[Step]:
    """The runs for a host with ``gpus`` CUDA GPUs (or for ``device="cpu"``), each writing to its own
    folder under ``out``."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device {device!r} is not supported; supported: cuda, cpu")
    if device == "cpu":
        return [Step("cpu", (sys.executable, "-m", "detkit", "audit", "--device", "cpu",
                             *_suite_args(suites or ("all",)), "--out", str(out / "cpu")))]
    if gpus < 1:
        raise RuntimeError("no CUDA GPU is visible: the host audit needs a Hopper GPU "
                           "(for the interpreter audits without a GPU: DETKIT_DEVICE=cpu, or docker compose -f "
                           "compose.yaml -f compose.cpu.yaml run --rm audit)")
    steps = [Step("gemm", (sys.executable, "-m", "detkit", "audit", "--device", "cuda",
                           *_suite_args(suites or ("gemm",)), "--out", str(out / "gemm")))]
    if gpus >= 4:
        steps.append(Step("tp-cp-4rank", _torchrun(4) + ("audit", "--suite", "tp-cp", "--out", str(out / "tp-cp-4rank"))))
    elif gpus >= 2:
        for label, world in (("tp-group", "0,1"), ("cp-group", "0,2")):
            steps.append(Step(f"tp-cp-{label}", _torchrun(2) + ("audit", "--suite", "tp-cp", "--out",
                                                                   str(out / f"tp-cp-{label}")),
                              (("DETKIT_TPCP_WORLD", world),)))
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--gpus", type=int, default=None, help="GPU count (default: torch.cuda.device_count())")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=os.environ.get("DETKIT_DEVICE") or "cuda",
                        help="cuda (default, env DETKIT_DEVICE) or cpu: the Triton-interpreter audits")
    parser.add_argument("--suite", action="append", default=None,
                        help="suite names (default: env DETKIT_SUITE, else all on cpu, gemm on cuda)")
    args = parser.parse_args(argv)
    suites = tuple(args.suite or os.environ.get("DETKIT_SUITE", "").replace(",", " ").split())
    gpus = args.gpus
    if gpus is None and args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    out = args.out / f"host-audit-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        steps = plan(gpus or 0, out, args.device, suites)
    except (RuntimeError, ValueError) as exc:
        print(f"host audit: error: {exc}", file=sys.stderr)
        return 2
    env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
    failed = []
    for step in steps:
        line = " ".join(f"{k}={v}" for k, v in step.env) + (" " if step.env else "") + " ".join(step.argv)
        print(f"[{step.name}] {line}", flush=True)
        if args.dry_run:
            continue
        if subprocess.run(step.argv, env={**env, **dict(step.env)}).returncode != 0:
            failed.append(step.name)
    if args.dry_run:
        return 0
    print(f"\nreports under {out}:")
    for step in steps:
        print(f"  {step.name}: {out / step.name / 'report.md'}{'  (FAILED)' if step.name in failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
