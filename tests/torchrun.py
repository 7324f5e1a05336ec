"""Start processes as ranks under torchrun, the way the distributed tests do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from detkit.toolkit.nvtx_ranges import build_injection_library, injection_env

REPO = Path(__file__).resolve().parents[1]


def rank_env(device: str, **extra: str) -> dict[str, str]:
    """This environment for ranks: gloo + interpreter on cpu (one thread each: the ranks share the
    cores), NCCL with multicast off on cuda; collective timeouts set so a hang fails the test."""
    env = {k: v for k, v in os.environ.items() if k not in ("NVTX_INJECTION64_PATH", "DETKIT_NVTX_LOG")}
    env.update(DETKIT_DIST_TIMEOUT_S="100" if device == "cpu" else "600", NCCL_NVLS_ENABLE="0", **extra)
    if device == "cpu":
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def run_ranks(target: list[str], nproc: int, device: str, timeout: float, nvtx_log: Path | None = None,
              env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node <nproc> <target...>`` from the repository root; with ``nvtx_log`` the NVTX
    injection library logs every rank's ranges there."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *target]
    env = rank_env(device, **(env_extra or {}))
    if nvtx_log is not None:
        env.update(injection_env(build_injection_library(nvtx_log.parent / "lib"), nvtx_log))
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def run_two_ranks(args: list[str], device: str, nvtx_log: Path | None, timeout: float,
                  env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m detkit <args>`` on 2 ranks."""
    return run_ranks(["-m", "detkit", *args], 2, device, timeout, nvtx_log, env_extra)
