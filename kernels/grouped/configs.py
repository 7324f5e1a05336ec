"""The grouped GEMM family's pinned config table (no autotune on a deterministic path).

One config per (op, backend), never picked from M or the group sizes: a row's K steps (``block_k`` wide, each one
``tl.dot`` on the GPU) are then the same whatever tokens share its group, which is the batch invariance the family
promises. ``block_m`` / ``block_n`` only decide which program owns a row; the tile's other rows never enter a row's
accumulator. The weight gradient (``wgrad``) reduces each group's rows in steps of ``block_k`` rows from the group's
first row: its order is a function of the group's row count alone.

Under the interpreter every config gives the same bits (exact products added one at a time, det_gemm's
``mac_step``); the tiles are small there because the interpreter materialises ``[BLOCK_M, BLOCK_K, BLOCK_N]``
products per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from detkit.kernels.backend import CUDA_SM90, TRITON_INTERPRETER

GROUPED_CONFIG_TABLE_VERSION = 2
OPS = ("mm", "wgrad")


@dataclass(frozen=True)
class GroupedConfig:
    block_m: int  # rows of one group per program (mm); rows of the [P, Q] output per program (wgrad)
    block_n: int  # output columns per program
    block_k: int  # reduced elements per step: K (mm) or the group's rows (wgrad)
    num_warps: int
    num_stages: int
    group_m: int = 8  # row tiles per band of the program order (L2 reuse; mm only): never the math

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16; got {value}")


# sm_90: pointer loads (any strides), cp.async pipelined by num_stages. The fastest candidates of
# reports/2026-12-06-h100-s26/call1 (tools/grouped_mm_bench.py --configs, H100; every candidate gave the pinned one's
# bits: a K step of wgmma accumulates k16 chunks into the same FP32 accumulator whatever block_k).
CONFIG_TABLE: dict[tuple[str, str], GroupedConfig] = {
    ("mm", CUDA_SM90): GroupedConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
    ("wgrad", CUDA_SM90): GroupedConfig(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=4),
    ("mm", TRITON_INTERPRETER): GroupedConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=1),
    ("wgrad", TRITON_INTERPRETER): GroupedConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=1),
}


def select_config(op: str, backend: str) -> GroupedConfig:
    """The pinned config of ``op`` on ``backend`` (a function of neither M nor the groups)."""
    config = CONFIG_TABLE.get((op, backend))
    if config is None:
        raise NotImplementedError(f"no grouped GEMM config for op {op!r} on backend {backend!r}; "
                                  f"table: {sorted(CONFIG_TABLE)}")
    return config
