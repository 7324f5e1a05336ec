"""The MoE kernels' pinned config tables (no autotune: a deterministic path has one tile per stage and backend) and
their selection. Bump a table's version whenever one of its entries changes; reports record the versions that ran.

BF16 (kernels/moe/layer.py) has its table here, FP8 (kernels/moe/fp8/layer.py) in kernels/moe/fp8/configs.py (one module per
table, so a report lists the FP8 table only when the FP8 layer was loaded); each has an entry per backend. The grouped GEMMs' BLOCK_M must
divide SEGMENT_ALIGN, so no tile straddles two experts. On the Triton interpreter every config gives the same bits
(sequential accumulation), so its tables are chosen for emulation speed only: few large programs, since the
interpreter's cost is per operation. The sm_90 entries are compile-checked offline (tests/test_moe*.py: wgmma,
shared memory, no spills) and were the fastest bit-equal candidates of H200 sweeps (tools/moe_tune.py) at the
reference shape and at Qwen3-30B-A3B; every candidate of a stage gives the same bits, so a pick changes speed only.
"""

from __future__ import annotations

from detkit.kernels.backend import CUDA_SM90, TRITON_INTERPRETER
from detkit.kernels.det_gemm.launch import GemmConfig
from detkit.kernels.moe.routing import SEGMENT_ALIGN

# ---------------------------------------------------------------------------------------------
# BF16
# ---------------------------------------------------------------------------------------------
MOE_CONFIG_TABLE_VERSION = "2026-12-06.1"
STAGES = ("up", "down", "dgrad", "dx", "wgrad", "combine", "dscore")

MOE_CONFIGS: dict[str, dict[str, GemmConfig]] = {
    CUDA_SM90: {
        # The Triton kernel with the weight tile by TMA: 3 stages take 96 KiB of shared memory, so two programs share
        # an SM and one's epilogue overlaps the other's loads. BLOCK_N interleaved gate/up columns -> 64 columns of h.
        "up": GemmConfig(128, 128, 64, 1, 8, 3, "tma"),
        # down, dgrad and dX: the warp-specialized Gluon kernels (kernels/moe/ws.py), whose TMA-store epilogue runs
        # while the next tile's MMAs do. down's 128x256 tile halves the A reloads per output column; 3 stages fit
        # beside its 64 KiB BF16 store buffer (208 KiB).
        "down": GemmConfig(128, 256, 64, 1, 8, 3, "ws"),
        # dgrad: BLOCK_N columns of dh (2x of dgu); 12 warps: its epilogue (dSwiGLU, the dscore partials) on a warpgroup
        # of its own, so it overlaps the next tile's MMAs.
        "dgrad": GemmConfig(128, 128, 64, 1, 12, 4, "ws"),
        # dX on down's 128x256 tile: 1.09-1.49x the 128x128 tile's rate on an H100 at Mixtral-8x7B, the reference
        # shape and Qwen3-30B-A3B (same bits: the tile changes no output's K order).
        "dx": GemmConfig(128, 256, 64, 1, 8, 3, "ws"),
        # wgrad (BLOCK_K = routed rows per reduction step): the Gluon kernel on a 128x256 tile, 3 stages + the
        # TMA-store buffer (208 KiB). Operands TMA cannot address, or a dW the tile does not divide, run the same tile
        # in Triton (the same K order, so the same bits).
        "wgrad": GemmConfig(128, 256, 64, 1, 8, 3, "ws"),
        "combine": GemmConfig(16, 256, 16, 1, 4, 1),  # BLOCK_M tokens x BLOCK_N columns
        "dscore": GemmConfig(16, 256, 16, 1, 4, 1),  # moe_dscore_sum_kernel: BLOCK_M tokens (BLOCK_N unused)
    },
    TRITON_INTERPRETER: {
        "up": GemmConfig(128, 128, 32, 1, 4, 1),
        "down": GemmConfig(64, 32, 32, 1, 4, 1),
        "dgrad": GemmConfig(128, 64, 32, 1, 4, 1),
        "dx": GemmConfig(64, 32, 32, 1, 4, 1),
        "wgrad": GemmConfig(32, 64, 32, 1, 4, 1),
        "combine": GemmConfig(32, 64, 16, 1, 4, 1),
        "dscore": GemmConfig(32, 64, 16, 1, 4, 1),
    },
}

# The grouped tile order (kernels/moe/tile_order.py) where one expert's weight slab is larger than the L2 (50 MB on
# an H100 or H200): row-major would stream it from HBM once per row tile; bands of GROUP_M row tiles read each of its
# column tiles once per band. Below the bound the row-major order was as fast or faster (the weight stays in L2).
# Measured at Mixtral-8x7B's slabs (235 MB up / dX, 117 MB down / dgrad: 1.14-1.40x); the bound between the largest
# slab measured faster row-major (19 MB) and those is a choice, not a measurement. Speed only: every order gives the
# same bits.
GROUPED_ORDER_MIN_SLAB_BYTES = 32 * 2**20
GROUPED_ORDER = {CUDA_SM90: {"up": 8, "down": 16, "dgrad": 8, "dx": 8}}


def grouped_order(stage: str, backend: str, slab_bytes: int) -> int:
    """GROUP_M for a grouped ``stage`` whose expert weight slab (one expert's [L, C] view) has ``slab_bytes``: the
    table's band where the slab is at least GROUPED_ORDER_MIN_SLAB_BYTES, else 1 (row-major)."""
    if slab_bytes < GROUPED_ORDER_MIN_SLAB_BYTES:
        return 1
    return GROUPED_ORDER.get(backend, {}).get(stage, 1)


WGRAD_MODES = ("bf16", "fp8")
# The rule: of the weight-gradient modes that pass the precision gate, the faster one. Both pass; the FP8 GEMMs are
# faster in the layer (docs/moe_fp8.md: measured, with the precision each gives).
DEFAULT_WGRAD = "fp8"
OTHER_WGRAD = next(m for m in WGRAD_MODES if m != DEFAULT_WGRAD)  # the mode the bench and the audit run beside it


# ---------------------------------------------------------------------------------------------
# Selection and what a config must be
# ---------------------------------------------------------------------------------------------
def pinned_stage_config(tables: dict[str, dict[str, GemmConfig]], stage: str, backend: str,
                        what: str = "MoE") -> GemmConfig:
    """``tables[backend][stage]``, refusing an unknown stage or backend by name."""
    stages = tuple(next(iter(tables.values())))
    if stage not in stages:
        raise ValueError(f"stage {stage!r} is not supported; supported: {stages}")
    if backend not in tables:
        raise ValueError(f"backend {backend!r} has no {what} configs; supported: {tuple(tables)}")
    return tables[backend][stage]


def select_moe_config(stage: str, backend: str) -> GemmConfig:
    return pinned_stage_config(MOE_CONFIGS, stage, backend)


# The Triton MoE kernels' load paths: weight tiles through pointers or TMA (det_gemm's "tma3" has no MoE kernel).
# Variant "ws" is the Gluon kernels' (sm_90), checked by their launchers.
MOE_VARIANTS = ("ptr", "tma")


def check_moe_variant(stage: str, config: GemmConfig) -> None:
    if config.variant not in MOE_VARIANTS:
        raise ValueError(f"{stage}: variant {config.variant!r} is not supported by the MoE kernels; "
                         f"supported: {MOE_VARIANTS}")


def check_grouped_config(stage: str, config: GemmConfig) -> None:
    """A grouped-GEMM config the MoE kernels can run: a MoE variant, BLOCK_M dividing the segments."""
    check_moe_variant(stage, config)
    if SEGMENT_ALIGN % config.block_m:
        raise ValueError(f"{stage}: BLOCK_M {config.block_m} must divide the segment alignment {SEGMENT_ALIGN}")
