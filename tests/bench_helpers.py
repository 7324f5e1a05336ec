"""Helpers shared by the benchmark tests (tests/test_bench_*.py, test_benches.py, test_moe_sweep.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

# The variables that make a process one of several ranks (toolkit.dist.launched_as_ranks), and the layout world.
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "DETKIT_TPCP_WORLD")


def torchrun_env(world_size: int, **extra: str) -> dict[str, str]:
    """Rank 0's environment under ``torchrun --nproc-per-node <world_size>`` (what toolkit.launch reads)."""
    return {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), **extra}


def one_process(monkeypatch) -> None:
    """This test process is not a rank, whatever launched pytest."""
    for var in RANK_VARS:
        monkeypatch.delenv(var, raising=False)


def bench_ctx(presets=(), interpreted: bool = True, preset: str = "tiny") -> SimpleNamespace:
    """The parts of a RunContext that the plug-ins' ``cases`` read."""
    return SimpleNamespace(presets=tuple(presets), interpreted=interpreted, preset=preset)


def read_rows(out: Path) -> list[dict]:
    """The rows a run wrote to ``out/rows.jsonl``, in order."""
    return [json.loads(line) for line in (Path(out) / "rows.jsonl").read_text().splitlines()]
