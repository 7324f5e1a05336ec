"""The MoE kernels' pinned config tables (no autotune: a deterministic path has one tile per stage and backend) and
their selection. Bump a table's version whenever one of its entries changes; reports record the versions that ran.

BF16 (kernels/moe.py) and FP8 (kernels/moe_fp8.py) each have a table per backend. The grouped GEMMs' BLOCK_M must
divide SEGMENT_ALIGN, so no tile straddles two experts. On the Triton interpreter every config gives the same bits
(sequential accumulation), so its tables are chosen for emulation speed only: few large programs, since the
interpreter's cost is per operation. The sm_90 entries are compile-checked offline (tests/test_moe*.py: wgmma,
shared memory, no spills) and were the fastest bit-equal candidates of H200 sweeps (tools/moe_tune.py) at the
reference shape and at Qwen3-30B-A3B; every candidate of a stage gives the same bits, so a pick changes speed only.
"""

from __future__ import annotations

from detkit.kernels.backend import CUDA_SM90, TRITON_INTERPRETER
from detkit.kernels.det_gemm import GemmConfig
from detkit.kernels.fp8_quant import QBLOCK
from detkit.kernels.moe_routing import SEGMENT_ALIGN

# ---------------------------------------------------------------------------------------------
# BF16
# ---------------------------------------------------------------------------------------------
MOE_CONFIG_TABLE_VERSION = "2026-12-01.7"
STAGES = ("up", "down", "dgrad", "dx", "wgrad", "combine", "dscore")

MOE_CONFIGS: dict[str, dict[str, GemmConfig]] = {
    CUDA_SM90: {
        # The Triton kernel with the weight tile by TMA: 3 stages take 96 KiB of shared memory, so two programs share
        # an SM and one's epilogue overlaps the other's loads. BLOCK_N interleaved gate/up columns -> 64 columns of h.
        "up": GemmConfig(128, 128, 64, 1, 8, 3, "tma"),
        # down, dgrad and dX: the warp-specialized Gluon kernels (kernels/moe_ws.py), whose TMA-store epilogue runs
        # while the next tile's MMAs do. down's 128x256 tile halves the A reloads per output column; 3 stages fit
        # beside its 64 KiB BF16 store buffer (208 KiB).
        "down": GemmConfig(128, 256, 64, 1, 8, 3, "ws"),
        "dgrad": GemmConfig(128, 128, 64, 1, 8, 4, "ws"),  # BLOCK_N columns of dh (2x of dgu)
        # dX keeps the 128x128 tile with 4 stages: down's 128x256 tile is slower there on the H200.
        "dx": GemmConfig(128, 128, 64, 1, 8, 4, "ws"),
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

# ---------------------------------------------------------------------------------------------
# FP8. block_k is the K step of one MMA; it must divide QBLOCK. up: a BLOCK_N = 2 * QBLOCK tile quantizes h in its
# epilogue (one 1x128 block per row), a narrower one leaves it to the row-wise pass over the stored h (the same
# values). dgrad: BLOCK_N = QBLOCK / 2 or QBLOCK columns of dh, so a tile's dgu (2 * BLOCK_N) is one or two 1x128
# blocks per row.
# ---------------------------------------------------------------------------------------------
MOE_FP8_CONFIG_TABLE_VERSION = "2026-11-30.14"
FP8_STAGES = ("up", "down", "dgrad", "dx")

MOE_FP8_CONFIGS: dict[str, dict[str, GemmConfig]] = {
    CUDA_SM90: {
        # Every sm_90 stage runs on the Gluon kernels (kernels/moe_fp8_ws.py, kernels/moe_fp8_ws_gather.py): block kb
        # is promoted while block kb+1's MMAs run, the grid is persistent and the epilogue leaves by TMA store.
        # up: gathered A rows by a 4-warp cp.async producer, two consumer warpgroups; 128 interleaved columns (64 of
        # h): this tile plus the row-wise pass that quantizes h is faster than the 256-column tile that fuses it.
        "up": GemmConfig(128, 128, 128, 1, 8, 4, "ws"),
        # down and dX: 128x128 with two consumer warpgroups; 5 stages of 32 KiB fit beside the BF16 store buffer.
        "down": GemmConfig(128, 128, 128, 1, 8, 5, "ws"),
        # dgrad + dSwiGLU + 1x128 quantization: 128 columns of dh (two dgu scale blocks per row, half the A reloads
        # of 64); dgu and dgu_q leave through shared memory and TMA stores (96 KiB of buffers), so 4 stages.
        "dgrad": GemmConfig(128, QBLOCK, 128, 1, 8, 4, "ws"),
        "dx": GemmConfig(128, 128, 128, 1, 8, 5, "ws"),
    },
    TRITON_INTERPRETER: {
        "up": GemmConfig(128, 2 * QBLOCK, 128, 1, 4, 1),
        "down": GemmConfig(128, 128, 128, 1, 4, 1),
        "dgrad": GemmConfig(128, QBLOCK // 2, 128, 1, 4, 1),
        "dx": GemmConfig(128, 128, 128, 1, 4, 1),
    },
}

# The FP8 layer's weight gradients in wgrad="bf16" mode run on the BF16 wgrad kernel (kernels/moe_kernels.py): the
# BF16 table's tile on the GPU (None); on the interpreter one large tile per expert (the bits do not depend on the
# tile there: sequential accumulation over the expert's rows) keeps CPU runs short.
WGRAD_CONFIGS: dict[str, GemmConfig | None] = {CUDA_SM90: None, TRITON_INTERPRETER: GemmConfig(128, 256, 32, 1, 4, 1)}

# The FP8 weight gradient (wgrad="fp8"): BLOCK_M x BLOCK_N of dW per program, STEP_K rows per dot.
FP8_WGRAD_CONFIGS: dict[str, GemmConfig] = {
    # The Gluon kernel with each K block's scale rows staged in shared memory by TMA beside its operand tiles (the
    # column-wise scales are stored [P/128, columns]: read per column from global memory they are strided loads at
    # every promotion); 128x128, 8 warps, 5 stages.
    CUDA_SM90: GemmConfig(128, 128, 128, 1, 8, 5, "ws"),
    TRITON_INTERPRETER: GemmConfig(128, 256, 128, 1, 4, 1),
}

# The column-wise quantizer's tile: block_m = QBLOCK rows (one scale block) x block_n columns, num_warps
# (block_k, group_m, num_stages unused: no K loop). 64 columns on 2 warps: wider tiles and more warps are slower on
# the H200.
QUANT_COLWISE_CONFIGS: dict[str, GemmConfig] = {
    CUDA_SM90: GemmConfig(QBLOCK, 64, 16, 1, 2, 1),
    TRITON_INTERPRETER: GemmConfig(QBLOCK, 256, 16, 1, 4, 1),
}

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


def select_moe_fp8_config(stage: str, backend: str) -> GemmConfig:
    return pinned_stage_config(MOE_FP8_CONFIGS, stage, backend, what="FP8 MoE")


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
