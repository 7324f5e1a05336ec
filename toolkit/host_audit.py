"""The single-host audit that fits the GPUs present: ``docker compose run audit`` runs this.

1 GPU: the det_gemm audit suite. 2 or 3 GPUs: also the TP/CP operators on real NCCL, one 2-rank
run holding a TP group (ranks 0,1: Down forward and Gate/Up dX) and one holding a CP group (ranks
0,2: the dW reduction). 4 or more: the full 4-rank TP=2 x CP=2 layout on one host. Every run writes
its own report folder under --out; the paths are printed at the end and the exit code is non-zero
when any run failed. ``--dry-run`` prints the plan only.

    python -m detkit.toolkit.host_audit --out /results [--dry-run]
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


def plan(gpus: int, out: Path) -> list[Step]:
    """The runs for a host with ``gpus`` CUDA GPUs, each writing to its own folder under ``out``."""
    if gpus < 1:
        raise RuntimeError("no CUDA GPU is visible: the host audit needs a Hopper GPU "
                           "(for the interpreter audits without a GPU: detkit audit --device cpu)")
    steps = [Step("gemm", (sys.executable, "-m", "detkit", "audit", "--suite", "gemm", "--out", str(out / "gemm")))]
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
    args = parser.parse_args(argv)
    gpus = args.gpus
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    out = args.out / f"host-audit-{time.strftime('%Y%m%d-%H%M%S')}"
    steps = plan(gpus, out)
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
