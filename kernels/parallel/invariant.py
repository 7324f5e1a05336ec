"""Reduction modes and the parallelism-invariant reduction tree. No process group here.

Two modes, chosen per operator call (``mode=``); anything else raises ``ValueError``:

- ``"bf16"`` (default, the version-1 contract): each rank's partial is rounded to BF16, the
  all-reduce runs in BF16 over two ranks: ``bf16(fl32(bf16(p0) + bf16(p1)))``. TP=1 / CP=1 is a
  plain det_gemm (one FP32 accumulation, one rounding), so TP=1 and TP=2 bits differ.
- ``"fp32_invariant"``: partials stay FP32 (det_gemm ``out_dtype=float32``), the all-reduce runs in
  FP32 over the two ranks (two operands: one rounding, order-free), and the result is rounded to
  BF16 once. At TP=1 / CP=1 the same tree is computed on one rank: the reduced dim is cut at the
  TP/CP shard boundaries into two contiguous FP32 segments (det_gemm ``seg_len``), and the kernel
  adds them as ``(0 + seg0) + seg1`` = ``fl32(seg0 + seg1)`` -- the same single rounding, because
  each segment's accumulation is the shard kernel's accumulation (same config, same order, same
  operands). Then one BF16 rounding. TP=1 == TP=2 and CP=1 == CP=2 bit for bit.
  Argument and caveats: docs/invariance.md.

Pinned configs: in ``fp32_invariant`` mode every det_gemm runs with ``invariant_config(op, ...)``,
one config per op independent of M (on sm_90 a different tile config can mean a different
wgmma/mma instruction sequence inside a BLOCK_K step, so the shard kernel and the segmented kernel
must use the same one; batch invariance across the config table is audited, not guaranteed).
BLOCK_K must divide the TP shard width (so segment boundaries fall on loop steps); CP shards are
aligned by zero-row padding on the CP=1 side (``cp_shard_major``), since masked rows of the
sharded kernel are exactly zero rows.
"""

from __future__ import annotations

import torch

from detkit.kernels.det_gemm.launch import GemmConfig, det_gemm_da_launch, det_gemm_db_launch, det_gemm_fwd_launch
from detkit.kernels.parallel.layout import CP_SIZE, TP_SIZE, TpCpLayout

BF16 = "bf16"
FP32_INVARIANT = "fp32_invariant"
MODES = (BF16, FP32_INVARIANT)
DEFAULT_MODE = BF16

# Pinned invariant configs per op, largest BLOCK_K first; the first whose BLOCK_K divides the TP shard
# width is used (Qwen3-8B: I/2 = 6144 -> BLOCK_K 64; the tiny test dims: I/2 = 48 -> BLOCK_K 16).
INVARIANT_CONFIG_TABLE: dict[str, tuple[GemmConfig, ...]] = {
    "fwd": (GemmConfig(128, 128, 64, 8, 8, 3), GemmConfig(16, 64, 16, 1, 4, 2)),
    "da": (GemmConfig(128, 128, 64, 8, 8, 3), GemmConfig(16, 64, 16, 1, 4, 2)),
    # Not 128x256: two FP32 accumulators (segment + total) of that tile need > 255 registers and
    # spill (offline sm_90 compile: STACK 144 B, 111 STL/LDL); 128x128 compiles to 186 registers.
    "db": (GemmConfig(128, 128, 64, 8, 8, 4), GemmConfig(16, 64, 16, 1, 4, 2)),
}
INVARIANT_CONFIG_TABLE_VERSION = "2026-11-29.inv2"


def check_mode(mode: str) -> str:
    """Return ``mode`` or raise: fail closed on anything but the two modes."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode {mode!r} is not supported; supported: {MODES} (default {DEFAULT_MODE!r})")
    return mode


def collective_dtype(mode: str) -> torch.dtype:
    return torch.float32 if check_mode(mode) == FP32_INVARIANT else torch.bfloat16


def invariant_config(op: str, shard_width: int) -> GemmConfig:
    """The pinned config of ``op`` in fp32_invariant mode for a layout whose TP shard width (I/2) is
    ``shard_width``. The same on every rank and at TP=1 and TP=2, whatever M is."""
    if op not in INVARIANT_CONFIG_TABLE:
        raise ValueError(f"op {op!r} is not supported; supported: {tuple(INVARIANT_CONFIG_TABLE)}")
    for config in INVARIANT_CONFIG_TABLE[op]:
        if shard_width % config.block_k == 0:
            return config
    raise ValueError(
        f"TP shard width {shard_width} is not a multiple of any invariant BLOCK_K "
        f"{[c.block_k for c in INVARIANT_CONFIG_TABLE[op]]}; fp32_invariant mode needs segment boundaries on "
        "loop steps")


def layout_config(op: str, layout: TpCpLayout) -> GemmConfig:
    return invariant_config(op, layout.i_local)


def gemm_kwargs(op: str, layout: TpCpLayout, mode: str) -> dict:
    """det_gemm keyword arguments of one local GEMM in ``mode`` (v1: the config table, BF16 out)."""
    if check_mode(mode) == BF16:
        return {}
    return {"config": layout_config(op, layout), "out_dtype": torch.float32}


# ---------------------------------------------------------------------------------------------
# CP: shard-major row order (one rank, no all-gather)
# ---------------------------------------------------------------------------------------------
def cp_padded_rows(layout: TpCpLayout, block_k: int) -> int:
    """Rows per CP shard after padding to a multiple of ``block_k`` (a segment boundary on a loop step)."""
    return -(-layout.m_local // block_k) * block_k


def cp_shard_major(t: torch.Tensor, layout: TpCpLayout, block_k: int) -> torch.Tensor:
    """Rows of a global activation ``t [M, C]`` regrouped CP-shard-major (shard 0's rows in local order,
    then shard 1's), each shard zero-padded to ``cp_padded_rows``: a copy ``[CP_SIZE * M_pad, C]``
    whose shard c is one contiguous segment equal to what CP rank c holds, plus zero rows."""
    if t.dim() != 2 or t.shape[0] != layout.m:
        raise ValueError(f"cp_shard_major needs a global [M={layout.m}, C] tensor; got shape {tuple(t.shape)}")
    pad = cp_padded_rows(layout, block_k)
    out = torch.zeros((CP_SIZE * pad, t.shape[1]), dtype=t.dtype, device=t.device)
    for c in range(CP_SIZE):
        out[c * pad:c * pad + layout.m_local] = t.index_select(0, layout.global_rows(c, t.device))
    return out


# ---------------------------------------------------------------------------------------------
# The TP=1 / CP=1 side of each reduction (one rank holds the whole reduced dim)
# ---------------------------------------------------------------------------------------------
def _one_rank_kwargs(op: str, layout: TpCpLayout) -> dict:
    """fp32_invariant on the rank that holds the whole reduced dim: the pinned config, and BF16 out.
    The kernel rounds ``fl32(seg0 + seg1)`` to BF16 once (nearest-even), which is what the other side
    does after its FP32 all-reduce; rounding in the epilogue saves an FP32 write, read and cast pass."""
    return {"config": layout_config(op, layout)}


def tp1_fwd(a: torch.Tensor, b: torch.Tensor, layout: TpCpLayout, mode: str = DEFAULT_MODE) -> torch.Tensor:
    """RowParallel forward at TP=1: ``a [M, I] @ b [I, N]``. fp32_invariant: two FP32 segments of I/2
    (the TP shards), ``fl32(seg0 + seg1)``, one BF16 rounding == TP=2 with an FP32 all-reduce."""
    check_mode(mode)
    if mode == BF16:
        return det_gemm_fwd_launch(a, b)[0]
    _check_width("a", a.shape[1], TP_SIZE * layout.i_local)
    return det_gemm_fwd_launch(a, b, seg_len=layout.i_local, **_one_rank_kwargs("fwd", layout))[0]


def tp1_da(dc: torch.Tensor, b: torch.Tensor, seg_len: int, layout: TpCpLayout,
           mode: str = DEFAULT_MODE) -> torch.Tensor:
    """ColumnParallel dX at TP=1: ``dc [M, N] @ b [K, N].T`` with N cut into TP_SIZE segments of
    ``seg_len`` (I/2 for one projection; 2*I/2 for the fused Gate|Up buffer, see kernels.mlp)."""
    check_mode(mode)
    if mode == BF16:
        return det_gemm_da_launch(dc, b)[0]
    _check_width("dc", dc.shape[1], TP_SIZE * seg_len)
    return det_gemm_da_launch(dc, b, seg_len=seg_len, **_one_rank_kwargs("da", layout))[0]


def cp1_db(a: torch.Tensor, dc: torch.Tensor, layout: TpCpLayout, mode: str = DEFAULT_MODE) -> torch.Tensor:
    """Replicated dW at CP=1: ``a [M, K].T @ dc [M, N]`` over the global token rows. fp32_invariant:
    rows regrouped CP-shard-major and padded (``cp_shard_major``), two FP32 segments (one per CP
    shard), ``fl32(seg0 + seg1)``, one BF16 rounding == CP=2 with an FP32 all-reduce."""
    check_mode(mode)
    if mode == BF16:
        return det_gemm_db_launch(a, dc)[0]
    config = layout_config("db", layout)
    a_cp, dc_cp = cp_shard_major(a, layout, config.block_k), cp_shard_major(dc, layout, config.block_k)
    return det_gemm_db_launch(a_cp, dc_cp, seg_len=cp_padded_rows(layout, config.block_k),
                              **_one_rank_kwargs("db", layout))[0]


def _check_width(name: str, got: int, want: int) -> None:
    if got != want:
        raise ValueError(f"{name} has {got} reduced elements; the TP=1 side of the layout needs {want} "
                         f"({TP_SIZE} shard segments)")
