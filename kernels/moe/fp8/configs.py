"""The FP8 MoE layer's pinned config tables and their selection (no autotune). Bump the version whenever an entry
changes; reports record the versions that ran. What the entries must satisfy and how they were chosen:
kernels/moe/configs.py, whose stage checks and selection helper these tables share.
"""

from __future__ import annotations

from detkit.kernels.backend import CUDA_SM90, TRITON_INTERPRETER
from detkit.kernels.det_gemm.launch import GemmConfig
from detkit.kernels.moe.fp8.quant import QBLOCK
from detkit.kernels.moe.configs import pinned_stage_config

# ---------------------------------------------------------------------------------------------
# FP8. block_k is the K step of one MMA; it must divide QBLOCK. up: a BLOCK_N = 2 * QBLOCK tile quantizes h in its
# epilogue (one 1x128 block per row), a narrower one leaves it to the row-wise pass over the stored h (the same
# values). dgrad: BLOCK_N = QBLOCK / 2 or QBLOCK columns of dh, so a tile's dgu (2 * BLOCK_N) is one or two 1x128
# blocks per row.
# ---------------------------------------------------------------------------------------------
MOE_FP8_CONFIG_TABLE_VERSION = "2026-12-02.1"
FP8_STAGES = ("up", "down", "dgrad", "dx")

MOE_FP8_CONFIGS: dict[str, dict[str, GemmConfig]] = {
    CUDA_SM90: {
        # Every sm_90 stage runs on the Gluon kernels (kernels/moe/fp8/ws.py, kernels/moe/fp8/ws_gather.py): block kb
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

# The FP8 layer's weight gradients in wgrad="bf16" mode run on the BF16 wgrad kernel (kernels/moe/kernels.py): the
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
# (block_k, group_m, num_stages unused: no K loop). sm_90: the Gluon kernel (kernels/moe/fp8/colwise_sm90.py), 32
# columns per warp.
QUANT_COLWISE_CONFIGS: dict[str, GemmConfig] = {
    CUDA_SM90: GemmConfig(QBLOCK, 128, 16, 1, 4, 1, "ws"),
    TRITON_INTERPRETER: GemmConfig(QBLOCK, 256, 16, 1, 4, 1),
}


def select_moe_fp8_config(stage: str, backend: str) -> GemmConfig:
    return pinned_stage_config(MOE_FP8_CONFIGS, stage, backend, what="FP8 MoE")
