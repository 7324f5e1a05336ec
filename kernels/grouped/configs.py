"""The grouped GEMM family's pinned config table (no autotune on a deterministic path).

One config per (op, backend, layout), never picked from M or the group sizes: a row's K steps (``block_k`` wide,
each one ``tl.dot`` on the GPU) are then the same whatever tokens share its group, which is the batch invariance the
family promises. ``block_m`` / ``block_n`` only decide which program owns a row; the tile's other rows never enter a
row's accumulator. The weight gradient (``wgrad``) reduces each group's rows in steps of ``block_k`` rows from the
group's first row: its order is a function of the group's row count alone.

``variant`` is how a config loads its operands: "ptr" (pointer loads, any strides; cp.async on sm_90) or "tma"
(host TMA descriptors over each operand's storage order: 16-byte-aligned base and outer strides, one unit-stride
dim). Both run the same K steps, so a config's bits do not depend on its variant. ``layout`` (``LAYOUTS``) names the
storage order of the kernel's A and B, so a variant can be pinned where it was measured faster: transformers'
forward passes ``W.transpose(-2, -1)`` ("nt"), its grad_input ``W`` ("nn"), its grad_weight ``grad.T`` and ``x``
("tn"). Where a "tma" pick cannot address the call's operands, the call runs the same tile as "ptr" (same bits),
decided on the host when the launch plan is built (kernels/grouped/launch.py).

Under the interpreter every config gives the same bits (exact products added one at a time, det_gemm's
``mac_step``); the tiles are small there because the interpreter materialises ``[BLOCK_M, BLOCK_K, BLOCK_N]``
products per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from detkit.kernels.backend import CUDA_SM90, TRITON_INTERPRETER

GROUPED_CONFIG_TABLE_VERSION = 3
OPS = ("mm", "wgrad")
VARIANTS = ("ptr", "tma")
TMA_MAX_BOX = 256  # elements per dim of one TMA box
# The storage order of the kernel's A and B, one letter each: "n" (the last dim contiguous), "t" (the dim before
# it: a transposed view) or "s" (neither: strided). mm: A [M, K], B [G, K, N]; wgrad: A [P, R], B [R, Q].
ORDERS = ("n", "t", "s")
LAYOUTS = tuple(a + b for a in ORDERS for b in ORDERS)
ANY_LAYOUT = "*"  # a table entry for the layouts an op has no entry of its own for


@dataclass(frozen=True)
class GroupedConfig:
    block_m: int  # rows of one group per program (mm); rows of the [P, Q] output per program (wgrad)
    block_n: int  # output columns per program
    block_k: int  # reduced elements per step: K (mm) or the group's rows (wgrad)
    num_warps: int
    num_stages: int
    group_m: int = 8  # row tiles per band of the program order (L2 reuse; mm only): never the math
    variant: str = "ptr"  # "ptr": pointer loads; "tma": TMA descriptors (module docstring)

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16; got {value}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant {self.variant!r} is not supported; supported: {VARIANTS}")
        if self.variant == "tma" and max(self.block_m, self.block_n, self.block_k) > TMA_MAX_BOX:
            raise ValueError(f"variant 'tma' loads boxes of at most {TMA_MAX_BOX} elements a dim; got block_m "
                             f"{self.block_m}, block_n {self.block_n}, block_k {self.block_k}")

    def label(self) -> str:
        """``128x256x64_w8_s3_g8_ptr``: the config in a report row."""
        return (f"{self.block_m}x{self.block_n}x{self.block_k}_w{self.num_warps}_s{self.num_stages}_g{self.group_m}"
                f"_{self.variant}")


# sm_90: the fastest candidates of reports/2026-12-06-h100-s26/call1 (tools/grouped_mm_bench.py --configs, H100;
# every candidate gave the pinned one's bits: a K step of wgmma accumulates k16 chunks into the same FP32 accumulator
# whatever block_k), pointer loads, except where TMA was measured faster (reports/2026-12-06-h100-s31, call 2:
# Mixtral-8x7B widths, T 2048 and 8192, CUDA-graph time against torch._grouped_mm, every candidate the pointer
# config's bits): a K-contiguous weight ("nt": transformers' forward, and grad_input on [E, K, N] weights) 0.86-1.06x
# on TMA against 1.20-1.42x on pointers, and grad_weight ("tn") on TMA's 128x256x64 tile 1.31x / 1.02x against 1.67x /
# 1.59x. Measured at Mixtral's widths only.
_MM_SM90 = GroupedConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
_MM_SM90_TMA = GroupedConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, variant="tma")
_WGRAD_SM90 = GroupedConfig(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=4)
_WGRAD_SM90_TMA = GroupedConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, variant="tma")
_INTERPRETER = GroupedConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=1)

CONFIG_TABLE: dict[tuple[str, str, str], GroupedConfig] = {
    ("mm", CUDA_SM90, "nt"): _MM_SM90_TMA,  # forward: x @ W.transpose(-2, -1) (transformers' layout)
    ("mm", CUDA_SM90, "nn"): _MM_SM90,  # grad_input: grad @ W; a forward on [E, K, N] weights
    ("mm", CUDA_SM90, ANY_LAYOUT): _MM_SM90,
    ("wgrad", CUDA_SM90, "tn"): _WGRAD_SM90_TMA,  # grad_weight: grad.T @ x
    ("wgrad", CUDA_SM90, ANY_LAYOUT): _WGRAD_SM90,
    ("mm", TRITON_INTERPRETER, ANY_LAYOUT): _INTERPRETER,
    ("wgrad", TRITON_INTERPRETER, ANY_LAYOUT): _INTERPRETER,
}


def select_config(op: str, backend: str, layout: str = ANY_LAYOUT) -> GroupedConfig:
    """The pinned config of ``op`` on ``backend`` for operands in ``layout`` (``LAYOUTS``): the layout's own entry,
    else the op's entry for every other layout. A function of neither M nor the groups."""
    if layout not in LAYOUTS and layout != ANY_LAYOUT:
        raise ValueError(f"layout {layout!r} is not supported; supported: {LAYOUTS} or {ANY_LAYOUT!r}")
    config = CONFIG_TABLE.get((op, backend, layout)) or CONFIG_TABLE.get((op, backend, ANY_LAYOUT))
    if config is None:
        raise NotImplementedError(f"no grouped GEMM config for op {op!r} on backend {backend!r}; "
                                  f"table: {sorted({key[:2] for key in CONFIG_TABLE})}")
    return config
