"""Start a detkit CLI command as 2 ranks under torchrun, the way the distributed bench tests do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from toolkit.nvtx_ranges import build_injection_library, injection_env

REPO = Path(__file__).resolve().parents[1]


def run_two_ranks(args: list[str], device: str, nvtx_log: Path | None, timeout: float,
                  env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m toolkit <args>`` on 2 ranks: gloo + interpreter on cpu, NCCL (multicast off) on cuda;
    with ``nvtx_log`` the NVTX injection library logs every rank's ranges there."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "toolkit",
           *args]
    env = {k: v for k, v in os.environ.items() if k not in ("NVTX_INJECTION64_PATH", "DETKIT_NVTX_LOG")}
    env.update(DETKIT_DIST_TIMEOUT_S="100" if device == "cpu" else "600", NCCL_NVLS_ENABLE="0", **(env_extra or {}))
    if device == "cpu":
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    else:
        env.pop("TRITON_INTERPRET", None)
    if nvtx_log is not None:
        env.update(injection_env(build_injection_library(nvtx_log.parent / "lib"), nvtx_log))
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
