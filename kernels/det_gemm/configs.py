"""det_gemm's pinned config table (no autotune) and its selection, with the Hopper resource arithmetic the
table's one-wave rule rests on: a config's operand ring, CTAs per SM and output tiles. Bump CONFIG_TABLE_VERSION
whenever an entry changes; reports record it. Every config the table can pick gives the same bits (same K order);
the cross-config audit checks that on every backend. The kernels: kernels/det_gemm/kernels.py; the launch:
kernels/det_gemm/launch.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

from detkit.kernels.backend import CUDA_SM90
from detkit.kernels.det_gemm.names import OPS

# ---------------------------------------------------------------------------------------------
# Pinned config table. Bump the version whenever an entry changes; reports record it.
# ---------------------------------------------------------------------------------------------
CONFIG_TABLE_VERSION = "2026-12-01.15"
# The FP32 operands' table (CONFIG_TABLE_FP32 below), versioned on its own so the BF16 version keeps naming the
# BF16 entries its reports measured.
FP32_CONFIG_TABLE_VERSION = "2026-12-07.1"

# The interpreter's [BLOCK_M, STEP_K, BLOCK_N] product block must stay within Triton's 2**20 elements.
INTERPRETER_MAX_BLOCK_NUMEL = 2**20


def interpreter_step_k(config: "GemmConfig") -> int:
    step = config.block_k
    while config.block_m * step * config.block_n > INTERPRETER_MAX_BLOCK_NUMEL:
        step //= 2
    return step


# The small-M FP32 kernel's variants (kernels/det_gemm/gemv.py), one per way of loading the operands.
GEMV_VARIANTS = ("gemv_row", "gemv_vec", "gemv_tile")
VARIANTS = ("ptr", "tma", "tma3", "ws", "fma", *GEMV_VARIANTS)
# A TMA box has at most 256 elements per dim (cuTensorMapEncodeTiled's boxDim limit).
TMA_MAX_BOX = 256

# The "fma" variant's register tile (kernels/det_gemm/fma.py): a thread's share of the output tile (rows x cols) by
# its element count (block_m x block_n / threads); lanes 4 x 8 per warp. A thread reads rows + cols operand values
# from shared memory per k for rows x cols FMAs, and an SM's shared memory delivers at most 32 values (128 bytes) per
# clock, so the FP32 FMA peak (128 per clock per SM) needs rows x cols / (rows + cols) >= 4: 8x8 meets it exactly,
# 8x16 with room (5.3), 8x4 and 4x4 reach 2/3 and 1/2 of it. 8x16 is the most the registers hold (255 per thread,
# no spills on the sm_90 compiles).
FMA_LANES = (4, 8)
FMA_MICRO = {128: (8, 16), 64: (8, 8), 32: (8, 4), 16: (4, 4)}
# sm_90's shared memory per block (opt-in), less 1 KiB for the mbarriers and alignment.
FMA_SHARED_BYTES = 227 * 1024 - 1024


def fma_micro_tile(block_m: int, block_n: int, num_warps: int) -> tuple[int, int, int]:
    """(rows, cols, warps along M) of an "fma" tile: each thread owns rows x cols outputs (FMA_MICRO), the warps
    tile the block as warps_m x (num_warps / warps_m) with FMA_LANES lanes each. Refuses, naming the values, a tile
    that this does not cover exactly."""
    threads = 32 * num_warps
    elems = block_m * block_n // threads
    if block_m * block_n % threads or elems not in FMA_MICRO:
        raise ValueError(f"variant 'fma' needs block_m x block_n / (32 x num_warps) in {sorted(FMA_MICRO)} (a thread's "
                         f"8x16, 8x8, 8x4 or 4x4 outputs); got {block_m}x{block_n} on {num_warps} warps")
    rows, cols = FMA_MICRO[elems]
    lanes_m, lanes_n = FMA_LANES
    warps_m, warps_n = block_m // (rows * lanes_m), block_n // (cols * lanes_n)
    if warps_m * rows * lanes_m != block_m or warps_n * cols * lanes_n != block_n or warps_m * warps_n != num_warps:
        raise ValueError(f"variant 'fma' cannot tile {block_m}x{block_n} with {rows}x{cols} per thread, {lanes_m}x"
                         f"{lanes_n} lanes per warp and {num_warps} warps; supported: block_m a multiple of "
                         f"{rows * lanes_m} and block_n of {cols * lanes_n} that use every warp")
    return rows, cols, warps_m


def fma_ring_bytes(config: "GemmConfig") -> int:
    """Shared memory of an "fma" config's operand ring: num_stages FP32 A and B tiles."""
    return config.num_stages * (config.block_m + config.block_n) * config.block_k * 4


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # output rows per tile
    block_n: int  # output cols per tile
    block_k: int  # reduced elements per loop iteration
    group_m: int  # tile rows per L2 swizzle group
    num_warps: int
    num_stages: int
    # "ptr": det_gemm_kernel (pointer loads, cp.async). "tma": det_gemm_tma_kernel (TMA descriptors over
    # each operand in its storage order). "tma3": det_gemm_tma3_kernel, the TMA kernel with block_n made of
    # three power-of-two sub-tiles (e.g. 192). "ws": kernels/det_gemm/ws.py (Gluon, sm_90 only), persistent and
    # warp-specialized: one TMA producer warp, num_warps / 4 consumer warpgroups (each block_m / (num_warps / 4)
    # rows of the tile), num_stages ring slots. "gemv_row" / "gemv_vec" / "gemv_tile": det_gemm_gemv_kernel
    # (kernels/det_gemm/gemv.py; FP32 "ieee" operands only), explicit FMA chains, its loads per k row, per 4 k's or per
    # tile; num_stages > 1 pipelines its loop's loads through shared memory. "fma": kernels/det_gemm/fma.py (Gluon,
    # sm_90 only; FP32 "ieee" operands only), the FMA dot on register micro-tiles (fma_micro_tile), TMA into a
    # num_stages ring.
    # Same per-element math; the cross-config audit checks the bits.
    variant: str = "ptr"

    def __post_init__(self):
        for field, value in vars(self).items():
            if field == "variant":
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GemmConfig.{field} must be a positive int; got {value!r}")
        if self.block_k % 16:
            raise ValueError(f"block_k must be a multiple of 16 (one tensor-core k-step); got {self.block_k}")
        if self.variant not in VARIANTS:
            raise ValueError(f"GemmConfig.variant {self.variant!r} is not supported; supported: {VARIANTS}")
        if self.variant == "tma3" and self.block_n % 3:
            raise ValueError(f"variant 'tma3' needs block_n three sub-tiles wide (a multiple of 3); got {self.block_n}")
        # (block_m 64 with 8 warps: two warpgroups taking 64-row tiles in turn, the MoE FP8 gathered kernel's ping-pong;
        # 12 warps: the BF16 MoE dgrad's two MMA warpgroups and an epilogue warpgroup)
        if self.variant == "ws" and (self.num_warps not in (4, 8, 12) or self.block_m % 64):
            raise ValueError(f"variant 'ws' needs 4, 8 or 12 warps and block_m a multiple of 64 rows; got "
                             f"num_warps {self.num_warps}, block_m {self.block_m}")
        if self.variant in ("tma", "tma3", "ws", "fma"):
            for field, value in (("block_m", self.block_m), ("block_n", self.box_n), ("block_k", self.block_k)):
                if value > TMA_MAX_BOX or value & (value - 1):
                    what = "block_n / 3" if field == "block_n" and self.variant == "tma3" else field
                    raise ValueError(f"variant {self.variant!r} needs {what} a power of two <= {TMA_MAX_BOX} "
                                     f"(one TMA box dim); got {value}")
        if self.variant == "tma3" and self.box_n < 16:
            raise ValueError(f"variant 'tma3' needs block_n / 3 >= 16 (one MMA's N); got {self.box_n}")
        if self.variant == "fma":
            fma_micro_tile(self.block_m, self.block_n, self.num_warps)
            if fma_ring_bytes(self) > FMA_SHARED_BYTES:
                raise ValueError(f"variant 'fma' needs {fma_ring_bytes(self)} bytes of shared memory for "
                                 f"{self.num_stages} stages of {self.block_m}x{self.block_k} and {self.block_k}x"
                                 f"{self.block_n} FP32 tiles; sm_90 has {FMA_SHARED_BYTES} for them: use fewer stages")
        if self.variant in GEMV_VARIANTS:
            for field, value in (("block_m", self.block_m), ("block_n", self.block_n), ("block_k", self.block_k)):
                if value & (value - 1):
                    raise ValueError(f"variant {self.variant!r} needs {field} a power of two (a Triton block); got "
                                     f"{value}")

    @property
    def box_n(self) -> int:
        """Columns of one B load: the whole tile, or one of the three sub-tiles of a "tma3" config."""
        return self.block_n // 3 if self.variant == "tma3" else self.block_n

    def label(self) -> str:
        label = (f"BM{self.block_m}_BN{self.block_n}_BK{self.block_k}_G{self.group_m}"
                 f"_w{self.num_warps}_s{self.num_stages}")
        return label if self.variant == "ptr" else f"{label}_{self.variant}"


# Hopper SXM (H100, H200): SMs, shared memory per SM, and the shared memory the driver reserves per resident CTA.
HOPPER_SMS = 132
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024
# A kernel's shared memory beyond its operand ring: the mbarriers (the sm_90 compiles of the table's TMA
# configs use 32-48 bytes, the three-sub-tile "tma3" tiles 96-144; the pointer kernel none).
SMEM_BARRIER_SLACK = 256


def operand_ring_bytes(config: GemmConfig) -> int:
    """Shared memory of the operand ring (num_stages x one BF16 A tile and one B tile): what the sm_90 compiles
    of the table's configs allocate, to within the mbarriers (tests/test_det_gemm_tma.py checks it offline)."""
    return config.num_stages * (config.block_m * config.block_k + config.block_k * config.block_n) * 2


def ctas_per_sm(config: GemmConfig) -> int:
    """How many CTAs of ``config`` one Hopper SM holds at once, as shared memory allows (registers allow no
    fewer for the configs of the OneWave entries: their sm_90 compiles use 58-155 per thread)."""
    return max(1, SMEM_PER_SM // (operand_ring_bytes(config) + SMEM_BARRIER_SLACK + SMEM_RESERVED_PER_CTA))


def output_tiles(config: GemmConfig, rows: int, cols: int) -> int:
    """CTAs of the (non-persistent) grid: one per output tile."""
    return triton.cdiv(rows, config.block_m) * triton.cdiv(cols, config.block_n)


@dataclass(frozen=True)
class OneWave:
    """One M bucket's tile configs in order of preference: the first whose whole grid is resident at once
    (output tiles <= SMs x CTAs per SM: no second, partly idle wave), or the first if none is. At small and
    mid M the grid is a few hundred tiles at most, so which config fills the 132 SMs in one wave decides;
    that depends on the output width as well as M. Every config gives the same bits (same K order; checked
    by the cross-config audit), so the choice cannot change a result."""
    configs: tuple[GemmConfig, ...]
    # None: as many CTAs per SM as shared memory allows. 1 at the smallest M, where the weight stream is the
    # work and CTAs sharing an SM share its bandwidth.
    max_ctas_per_sm: int | None = None
    # The pick when no config's grid fits one wave (None: the first): an lm_head's output is many waves of any tile,
    # where a large tile reads the activations the fewest times (a FewestWaves entry: its pick).
    many: "GemmConfig | FewestWaves | None" = None

    def __post_init__(self):
        if not self.configs or not all(isinstance(c, GemmConfig) for c in self.configs):
            raise ValueError(f"OneWave needs one or more GemmConfig; got {self.configs!r}")
        if all(c.variant == "tma3" for c in self.configs):
            raise ValueError("OneWave needs a config that is not 'tma3' (the pick for operands TMA cannot "
                             f"address); got {[c.label() for c in self.configs]}")
        if self.max_ctas_per_sm is not None and (not isinstance(self.max_ctas_per_sm, int) or self.max_ctas_per_sm < 1):
            raise ValueError(f"OneWave.max_ctas_per_sm must be a positive int or None; got {self.max_ctas_per_sm!r}")
        if self.many is not None and not isinstance(self.many, FewestWaves) and (
                not isinstance(self.many, GemmConfig) or self.many.variant == "tma3"):
            raise ValueError(f"OneWave.many must be a GemmConfig with a pointer twin (not 'tma3'), a FewestWaves or "
                             f"None; got {self.many!r}")

    def choices(self, tma3: bool = True) -> tuple[GemmConfig, ...]:
        """The configs in order; ``tma3=False``: those with a pointer twin only (an operand TMA cannot address)."""
        return tuple(c for c in self.configs if tma3 or c.variant != "tma3")

    def every_config(self) -> tuple[GemmConfig, ...]:
        many = () if self.many is None else entry_configs(self.many)
        return tuple(dict.fromkeys(self.configs + many))

    def pick(self, rows: int, cols: int, sms: int, tma3: bool = True) -> GemmConfig:
        configs = self.choices(tma3)
        for config in configs:
            per_sm = ctas_per_sm(config)
            if self.max_ctas_per_sm is not None:
                per_sm = min(per_sm, self.max_ctas_per_sm)
            if output_tiles(config, rows, cols) <= sms * per_sm:
                return config
        if self.many is None:
            return configs[0]
        return self.many.pick(rows, cols, sms, tma3) if isinstance(self.many, FewestWaves) else self.many


@dataclass(frozen=True)
class FewestWaves:
    """Large outputs: the config whose grid costs least, counted as waves x tile area / the tile's measured rate
    (its throughput per output element relative to the widest tile's, where both run full waves), ties to the
    first. A grid of 192 128x256 tiles is two waves on 132 SMs, the second three-quarters idle; 384 128x128 tiles
    are three full ones. A narrow output (N = 128: one 128x256 tile per 128 rows, half of it padding) takes small
    tiles that still fill the SMs. Every config gives the same bits (same K order; the cross-config audit)."""

    rated: tuple[tuple[GemmConfig, float], ...]  # (config, rate), rate in (0, 1]

    def __post_init__(self):
        if not self.rated or not all(isinstance(c, GemmConfig) and isinstance(r, (int, float)) and 0 < r <= 1
                                     for c, r in self.rated):
            raise ValueError(f"FewestWaves needs (GemmConfig, rate in (0, 1]) pairs; got {self.rated!r}")
        if all(c.variant == "tma3" for c, _ in self.rated):
            raise ValueError("FewestWaves needs a config that is not 'tma3' (the pick for operands TMA cannot address)")

    @property
    def configs(self) -> tuple[GemmConfig, ...]:
        return tuple(c for c, _ in self.rated)

    def every_config(self) -> tuple[GemmConfig, ...]:
        return self.configs

    def choices(self, tma3: bool = True) -> tuple[GemmConfig, ...]:
        return tuple(c for c in self.configs if tma3 or c.variant != "tma3")

    def cost(self, config: GemmConfig, rate: float, rows: int, cols: int, sms: int) -> float:
        per_sm = ctas_per_sm(config)
        waves = -(-output_tiles(config, rows, cols) // (sms * per_sm))
        return waves * per_sm * config.block_m * config.block_n / rate

    def pick(self, rows: int, cols: int, sms: int, tma3: bool = True) -> GemmConfig:
        best = None
        for config, rate in self.rated:
            if not tma3 and config.variant == "tma3":
                continue
            cost = self.cost(config, rate, rows, cols, sms)
            if best is None or cost < best[0]:
                best = (cost, config)
        return best[1]


@dataclass(frozen=True)
class ByWidth:
    """An M bucket's entry chosen by the output's width: the first ``(max_cols, entry)`` with cols <= max_cols,
    else ``wide``. Narrow outputs (an attention's k and v projections: N = 128-1024) have few tiles per row of the
    grid, so they take narrower tiles than wide ones at the same M."""

    narrow: tuple[tuple[int, "GemmConfig | OneWave"], ...]
    wide: "GemmConfig | OneWave"

    def __post_init__(self):
        widths = [w for w, _ in self.narrow]
        if not self.narrow or widths != sorted(set(widths)) or not all(
                isinstance(e, (GemmConfig, OneWave)) for _, e in self.narrow) or not isinstance(self.wide,
                                                                                                (GemmConfig, OneWave)):
            raise ValueError(f"ByWidth needs increasing (max_cols, GemmConfig | OneWave) pairs and a wide entry; got "
                             f"{self.narrow!r}, {self.wide!r}")

    def entry(self, cols: int | None):
        if cols is not None:
            for max_cols, entry in self.narrow:
                if cols <= max_cols:
                    return entry
        return self.wide

    def every_config(self) -> tuple[GemmConfig, ...]:
        entries = [e for _, e in self.narrow] + [self.wide]
        return tuple(dict.fromkeys(c for e in entries for c in entry_configs(e)))


# (largest M the entry serves, config or OneWave); M is the batch dimension for all three ops (dB's reduced
# dimension: dB is not batch-invariant by nature, so picking its tile by M costs no property). Every entry was
# timed against the other candidates on an H200 (tools' tune sweeps; every candidate gave the table pick's bits),
# and the cross-config audit checks the bits of every config the table can pick.
#
# Shared memory decides residency (ctas_per_sm); the comment beside each tile gives its ring and CTAs per SM.
_SMALL_64 = GemmConfig(64, 64, 128, 1, 4, 6, "tma")  # 192 KiB ring: 1 CTA per SM
_SMALL_128 = GemmConfig(64, 128, 64, 8, 4, 6, "tma")  # 144 KiB: 1 CTA per SM
_SMALL_128_2 = GemmConfig(64, 128, 64, 8, 4, 4, "tma")  # 96 KiB: 2 CTAs per SM, for grids that need two per SM
# Where one CTA per SM streams all of K in one wave, the deepest ring that still fits keeps the most bytes in
# flight at the same residency: 64x128 on 8 stages measured 9-14% ahead of 6 stages at M 129-256, 128x128 on 6
# stages 3-9% ahead of 4 at M 257-1024.
_SMALL_128_DEEP = GemmConfig(64, 128, 64, 8, 4, 8, "tma")  # 192 KiB: 1 CTA per SM
_MID = GemmConfig(128, 128, 64, 8, 8, 6, "tma")  # 192 KiB: 1 CTA per SM
# At M 65-128 a 4096-wide output is 128 tiles of 128x32: one wave on 132 SMs with every CTA streaming the whole of
# K (5-11% ahead of 64x64 tiles).
_NARROW_128 = GemmConfig(128, 32, 128, 1, 4, 5, "tma")  # 200 KiB: 1 CTA per SM
_MID_TALL = GemmConfig(256, 128, 64, 8, 8, 4, "tma")  # 192 KiB: 1 CTA per SM, half the tiles of _MID
# Three 64-column sub-tiles ("tma3"): a 6144-wide output is 32 tile columns of 192, so M 256 (64-row tiles) and
# M 512 (128-row tiles) are 128 tiles, one wave on 132 SMs, where 128-wide tiles need 192 (fwd 489-500 against
# 459-483 TFLOP/s at M 256, 551-569 against 536-549 at M 512). Where the 128-wide tiles fit one wave first (a
# 4096-wide output) the OneWave rule picks them, and they win.
_SMALL_192 = GemmConfig(64, 192, 64, 8, 4, 6, "tma3")  # 192 KiB: 1 CTA per SM
_MID_192 = GemmConfig(128, 192, 64, 8, 8, 4, "tma3")  # 160 KiB: 1 CTA per SM
# The warp-specialized Gluon kernel (kernels/det_gemm/ws.py) on a 128x256 tile, 3 stages, its epilogue through a
# shared tile buffer and TMA stores (208 KiB; with 4 stages the buffer no longer fits and the register epilogue
# runs at half the speed): the producer warp keeps the ring full across tile boundaries of the persistent grid,
# which is what large grids need (fwd and dA 1-6% ahead of the best Triton tile at M 2048-16384; dB 16-29% at
# M 128-1024, 1-11% above). Where Gluon cannot run it (not sm_90, seg_len segments) the same tile runs in Triton,
# "tma" or "ptr" (kernels/det_gemm/launch.py _table_pick): the same K order, so the same bits.
_WS_WIDE = GemmConfig(128, 256, 64, 8, 8, 3, "ws")
# M <= 32: the weight stream is the work. The narrow tile while its tiles fit the SMs once at one CTA per SM (CTAs
# sharing an SM share its bandwidth), else the wide one: within 2% of the best candidate per M (worst case 9%).
_TINY = OneWave((GemmConfig(16, 32, 128, 1, 4, 6), GemmConfig(16, 64, 128, 1, 4, 6)), max_ctas_per_sm=1)
_SMALL_32 = OneWave((GemmConfig(64, 32, 128, 1, 4, 4), GemmConfig(64, 64, 128, 1, 4, 4)), max_ctas_per_sm=1)
# Narrow outputs (k/v projections, N 128-2048): 16 columns per tile give the most CTAs streaming the weight at M <= 256
# (fwd and dA 10-40% ahead of the wide-output picks at N <= 512, M 1-256).
_NARROW_16 = GemmConfig(64, 16, 128, 1, 4, 6, "tma")  # 120 KiB: 1 CTA per SM
# The warp-specialized kernel on a 128x128 tile: the large-M tile where 128x256 tiles leave the last wave partly idle
# (N 512-1536 at M 2048-16384: 1.00-1.05x cuBLAS against 1.24-1.71x).
_WS_128 = GemmConfig(128, 128, 64, 8, 8, 5, "ws")  # 160 KiB ring and its store buffer: 1 CTA per SM
# M > 256 (dB: its reduced M > 64): the cheapest grid in waves x tile area / rate. The rates are each tile's speed
# relative to 128x256's at full waves, fitted to the H200 sweep of every candidate at the zoo's narrow outputs (fwd and
# dA M 512-16384, dB M 128-16384; 123 cases): the rule's pick is within 1.005x of the best candidate (geometric mean),
# 1.09x at worst. 128x128's rate below 128x256's keeps the wide tile on grids of many waves, where the zoo measured it
# 3-15% ahead.
_LARGE = FewestWaves(((_WS_WIDE, 1.0), (_MID_192, 0.8), (_WS_128, 0.9), (_SMALL_128, 0.5), (_SMALL_64, 0.3),
                      (_NARROW_16, 0.1)))
# M <= 256 by output width (fwd and dA alike): the fastest candidate of the sweep per width class and M bucket. Wide
# outputs keep the one-wave rule; an output no tile fits in one wave (an lm_head) takes a large tile.
_BY_WIDTH = (
    (16, ByWidth(((512, _NARROW_16), (1024, _SMALL_64)), _TINY)),
    (32, ByWidth(((512, _NARROW_16),), _SMALL_32)),
    (64, ByWidth(((2048, _NARROW_16),), OneWave((_SMALL_64, _SMALL_128, _SMALL_128_2)))),
    (128, ByWidth(((1024, _NARROW_16), (2048, _SMALL_64)),
                  OneWave((_NARROW_128, _SMALL_128_DEEP, _SMALL_128_2), many=_MID))),
    (256, ByWidth(((512, _NARROW_16), (1536, _SMALL_64), (2048, _NARROW_128)),
                  OneWave((_SMALL_128_DEEP, _SMALL_192, _SMALL_128_2), many=_LARGE))),
)
CONFIG_TABLE: dict[str, tuple[tuple[int, GemmConfig | OneWave | ByWidth | FewestWaves], ...]] = {
    "fwd": (*_BY_WIDTH, (2**31, _LARGE)),
    "da": (*_BY_WIDTH, (2**31, _LARGE)),
    "db": (
        # M <= 64: a short reduction into a large [K, N] output, where small pointer tiles with a short BLOCK_K
        # keep many CTAs busy: 1.09-1.54x faster than the wide tile at every M swept on both shapes.
        (64, GemmConfig(128, 128, 32, 8, 4, 4)),
        (2**31, _LARGE),
    ),
}

# FP32 operands (``CONFIG_TABLE_FP32``): the same kernels with FP32 tiles, which are twice a BF16 tile's bytes, so
# BLOCK_K 32 and 3-4 stages (a 128x128x32 ring of 3 stages is 96 KiB). "ieee" products are FP32 fused multiply-adds
# on the CUDA cores (Triton's FMA dot), where a tile's rate is set by its FMAs per loaded element, not by TMA or
# warp specialization: pointer loads, no "ws" (its Gluon kernel takes BF16 only) and no one-wave rule (its
# residency arithmetic counts BF16 bytes). Chosen from the BF16 table's shapes, not yet swept on a GPU
# (tools/gpu/fp32_gemm.sh times them against torch.matmul). Every config gives the same bits: the same ascending
# K order, one accumulator (the GPU tests check it across the table's configs).
_FP32_SMALL = GemmConfig(64, 64, 32, 8, 4, 3)
_FP32_MID = GemmConfig(64, 128, 32, 8, 8, 3)  # 8 warps: 4 spill on the sm_90 compile (tools.gemm_sass)
_FP32_LARGE = GemmConfig(128, 128, 32, 8, 8, 3)
# M <= 16 (fwd and dA): each output the fused multiply-add chain in ascending k that the tile configs' FMA dot runs,
# so every entry's bits are theirs (a row at M = 1 has its bits at M = 17). Per M band (the batch rounded up to a power
# of two: 1, 2, 4, 8, 16) and output width (lm_heads' wide outputs; up to GEMV_NARROW_COLS: projections, a router, an
# lm_head's dA, 4096 wide), the fastest candidate of an H100 run on nn.Linear's K-major weight
# (reports/2026-12-06-h100-s30, call 4, `tools/gpu/fp32_gemm.sh gemv`): mostly det_gemm_gemv_kernel
# (kernels/det_gemm/gemv.py): "gemv_tile" (one [BLOCK_N, BLOCK_K] weight tile a step, split into columns in
# registers) at 1-4 rows, "gemv_vec" (16-byte loads along K) at 16 rows and on narrow outputs; at 8 rows (and the dA
# of 16) the pointer tile kernel's FMA dot on a tile of the band's rows (tl.dot takes any M for "ieee" FP32). The
# wide dA was not measured: it takes the wide fwd entries. Narrow outputs at small M stay latency-bound: each output
# is one chain of K dependent FMAs (no split over K, whose sums would differ from the tile path's).
GEMV_NARROW_COLS = 32768
GEMV_BANDS = (1, 2, 4, 8, 16)  # block_m of the M <= 16 entries: the batch rounded up to a power of two


def _tile_wide(rows: int) -> GemmConfig:  # 128 columns, one per thread of 4 warps
    return GemmConfig(rows, 128, 32, 1, 4, 1, "gemv_tile")


def _tile_narrow(rows: int) -> GemmConfig:  # 32 columns on one warp, 4-deep pipelined loads
    return GemmConfig(rows, 32, 64, 1, 1, 4, "gemv_tile")


def _vec(rows: int, cols: int, k: int, warps: int, stages: int) -> GemmConfig:
    return GemmConfig(rows, cols, k, 1, warps, stages, "gemv_vec")


def _dot(rows: int, cols: int) -> GemmConfig:
    return GemmConfig(rows, cols, 32, 1, 4, 4)  # the pointer tile kernel's FMA dot on the band's rows


# (wide, narrow) per band
_FP32_SMALL_M = {
    "fwd": {1: (_tile_wide(1), _tile_narrow(1)), 2: (_tile_wide(2), _tile_narrow(2)),
            4: (_tile_wide(4), _vec(4, 16, 64, 1, 4)), 8: (_dot(8, 128), _vec(8, 16, 64, 1, 4)),
            16: (_vec(16, 64, 64, 2, 1), _vec(16, 16, 64, 1, 4))},
    "da": {1: (_tile_wide(1), _tile_narrow(1)), 2: (_tile_wide(2), _tile_narrow(2)),
           4: (_tile_wide(4), _tile_narrow(4)), 8: (_dot(8, 128), _dot(8, 128)),
           16: (_vec(16, 64, 64, 2, 1), _dot(16, 64))},
}


def _small_m_entries(op: str) -> tuple:
    return tuple((rows, ByWidth(((GEMV_NARROW_COLS, narrow),), wide))
                 for rows, (wide, narrow) in _FP32_SMALL_M[op].items())


def gemv_band(rows: int) -> int:
    """The block_m of the M <= 16 entry that serves ``rows`` (the batch rounded up to a power of two)."""
    if not isinstance(rows, int) or not 1 <= rows <= GEMV_BANDS[-1]:
        raise ValueError(f"rows must be an int in 1..{GEMV_BANDS[-1]} (the small-M kernel's bands); got {rows!r}")
    return 1 << (rows - 1).bit_length()


def gemv_candidates(rows: int, cols: int, op: str = "fwd") -> tuple[GemmConfig, ...]:
    """The small-M configs a GPU run times at batch ``rows`` (1-16) and output width ``cols``: the table's pick of
    ``op`` first, then each variant of the small-M kernel at a tile of the width class ("gemv_row", "gemv_vec",
    "gemv_tile"), other tiles, warps and pipeline depths, and the FMA dot on the band's rows. Every one gives the
    pick's bits (the same FMA chain)."""
    bm = gemv_band(rows)
    wide, narrow = _FP32_SMALL_M[op][bm]
    pick = narrow if cols <= GEMV_NARROW_COLS else wide
    if cols <= GEMV_NARROW_COLS:
        base = _vec(bm, 32, 64, 1, 4)
        others = (replace(base, num_stages=8), replace(base, block_n=64, num_warps=2), replace(base, block_n=16),
                  replace(base, variant="gemv_tile", block_k=64 if bm <= 4 else 16), _dot(bm, 128))
    else:
        base = _vec(bm, 128, 32, 4, 1)
        others = (replace(base, num_stages=3), replace(base, block_n=64, block_k=64, num_warps=2),
                  *((replace(base, block_n=256),) if bm <= 8 else ()),
                  replace(base, variant="gemv_tile", block_k=32 if bm <= 4 else 16), _dot(bm, 128))
    return tuple(dict.fromkeys((pick, replace(base, variant="gemv_row"), base, *others)))


# fwd at M > 16 on the Gluon FMA kernel (kernels/det_gemm/fma.py: the same FMA chains, so the same bits), the fastest
# "fma" candidate of an H100 run per M band and width (reports/2026-12-07-h100-s34, call 4; nn.Linear's weight, GPU
# time against torch.matmul at "highest"): lm_heads 4096 x 151936 / 128256 at 17-64 rows on 64-row tiles 1.09-1.10x
# / 1.29-1.31x (128-row tiles 1.83x / 2.38x), at 65-128 on 8 warps 1.11x / 1.22x (4 warps 1.22x / 1.26x), above on 4
# warps 1.22-1.24x. Narrow outputs (4096 x 4096) stay on 128x64 tiles: 3.8x at M 64, 1.37x at 256, where few
# programs each walk all of K (no split-K). dA keeps the Triton tiles (1.15-1.20x at M >= 256; the FMA kernel no
# faster).
_FMA_SMALL = GemmConfig(64, 128, 32, 8, 4, 3, "fma")  # 8x8 outputs a thread on 64-row tiles
_FMA_WIDE = GemmConfig(128, 128, 32, 8, 4, 3, "fma")  # 8x16 outputs a thread, two CTAs per SM
_FMA_WIDE_8W = GemmConfig(128, 128, 32, 8, 8, 3, "fma")  # 8x8 outputs a thread
_FMA_NARROW = GemmConfig(128, 64, 32, 8, 8, 4, "fma")  # 8x4 outputs a thread: twice the programs on narrow outputs
CONFIG_TABLE_FP32: dict[str, tuple[tuple[int, GemmConfig | ByWidth], ...]] = {
    "fwd": (*_small_m_entries("fwd"), (64, ByWidth(((GEMV_NARROW_COLS, _FMA_NARROW),), _FMA_SMALL)),
            (128, ByWidth(((GEMV_NARROW_COLS, _FMA_NARROW),), _FMA_WIDE_8W)),
            (256, ByWidth(((GEMV_NARROW_COLS, _FMA_NARROW),), _FMA_WIDE)), (2**31, _FMA_WIDE)),
    "da": (*_small_m_entries("da"), (64, _FP32_SMALL), (256, _FP32_MID), (2**31, _FP32_LARGE)),
    # dB: a [K, N] output at any M; M is its reduced dim
    "db": ((2**31, _FP32_LARGE),),
}
# FP32 operands with "tf32" products: every tile 64 rows or more, so every launch runs the same warpgroup MMA
# (wgmma, m64 x k8 per instruction; the sm_90 compiles show HGMMA for these tiles). A 16-row tile would run
# mma.sync (HMMA) instead, whose per-instruction sums of 8 products need not round as wgmma's do: a row at M <= 16
# could then differ from the same row at M = 17. At small M the weight stream is the work, so 64-row tiles cost
# little there. Above 64 rows the TMA tiles, the fastest candidates of an H100 run (reports/2026-12-07-h100-s34,
# call 4; same bits as the pointer tiles): fwd 128x256x32 w8 0.98-1.09x torch.matmul on the lm_head at 256-4096
# rows and 1.02-1.03x on 4096 x 4096 at 1024-4096 (pointer tiles 1.40-1.94x); dA 64x64x32 w4 s4 3.6x at 128 rows
# (pointer 8.2x): dA and dB read an operand whose reduced dim is strided, which wgmma's TF32 form cannot take, so
# Triton transposes it through shared memory on every step. From TF32_DA_TRANSPOSED_MIN_ROWS /
# TF32_DB_TRANSPOSED_MIN_ROWS rows, det_gemm_da / det_gemm_db run them as forward products instead (launch.py).
_TF32_SMALL = GemmConfig(64, 64, 32, 8, 4, 3)
_TF32_FWD_MID = GemmConfig(128, 256, 32, 8, 8, 4, "tma")
_TF32_FWD_LARGE = GemmConfig(128, 256, 32, 8, 8, 3, "tma")
_TF32_DA_MID = GemmConfig(64, 64, 32, 8, 4, 4, "tma")
CONFIG_TABLE_TF32: dict[str, tuple[tuple[int, GemmConfig], ...]] = {
    "fwd": ((64, _TF32_SMALL), (256, _TF32_FWD_MID), (2**31, _TF32_FWD_LARGE)),
    "da": ((64, _TF32_SMALL), (256, _TF32_DA_MID), (2**31, _FP32_LARGE)),
    "db": ((2**31, _FP32_LARGE),),
}
# FP16 operands take the BF16 table: the same bytes per element and the same tensor-core rate; its "ws" picks run as
# their TMA twins (the Gluon kernel takes BF16 only), the same tile and K order.
TABLES = {torch.bfloat16: CONFIG_TABLE, torch.float16: CONFIG_TABLE, torch.float32: CONFIG_TABLE_FP32}


def config_table(dtype: torch.dtype = torch.bfloat16, precision: str | None = None) -> dict:
    """The pinned table of ``dtype`` operands (BF16, FP16 or FP32; FP32 with ``precision`` "tf32": the TF32 table)."""
    table = TABLES.get(dtype)
    if table is None:
        raise TypeError(f"det_gemm has no config table for {dtype}; supported: torch.bfloat16, torch.float16, "
                        "torch.float32")
    return CONFIG_TABLE_TF32 if dtype == torch.float32 and precision == "tf32" else table


def entry_configs(entry) -> tuple[GemmConfig, ...]:
    """The configs one table entry can pick."""
    return (entry,) if isinstance(entry, GemmConfig) else entry.every_config()


def select_config(op: str, m: int, *, cols: int | None = None, rows: int | None = None, sms: int = HOPPER_SMS,
                  tma3: bool = True, dtype: torch.dtype = torch.bfloat16, precision: str | None = None) -> GemmConfig:
    """The pinned config for ``op`` at batch size ``m`` (fwd/dA: output rows; dB: the reduced dim); ``cols``,
    ``rows``: the output's width and height (rows defaults to ``m``; dB's output rows are its K) for the entries that
    depend on them, on ``sms`` SMs (cols None: an entry's first choice); ``tma3=False``: the pick among configs that
    have a pointer twin; ``dtype``, ``precision``: the operands' and FP32's products (the FP32 and TF32 tables). Both
    weight layouts take the same pick."""
    table = config_table(dtype, precision)
    if op not in table:
        raise ValueError(f"op {op!r} is not supported; supported: {OPS}")
    for max_m, entry in table[op]:
        if m <= max_m:
            if isinstance(entry, ByWidth):
                entry = entry.entry(cols)
            if isinstance(entry, GemmConfig):
                return entry
            if cols is None:
                return entry.choices(tma3)[0]
            return entry.pick(m if rows is None else rows, cols, sms, tma3)
    raise ValueError(f"M={m} exceeds the config table for {op!r}")


def all_configs(op: str, backend: str = CUDA_SM90, dtype: torch.dtype = torch.bfloat16,
                precision: str | None = None) -> list[GemmConfig]:
    """Every distinct config the ``dtype`` (and FP32 ``precision``) table can pick for ``op`` on ``backend`` (the
    cross-config audit runs them all); off sm_90 a "ws" pick runs as its Triton twin (``ws_twin``)."""
    table = config_table(dtype, precision)
    if op not in table:
        raise ValueError(f"op {op!r} is not supported; supported: {OPS}")
    configs = (c for _, e in table[op] for c in entry_configs(e))
    gluon = backend == CUDA_SM90 and dtype == torch.bfloat16
    configs = (c if backend == CUDA_SM90 else fma_twin(c) for c in configs)
    return list(dict.fromkeys(c if gluon else ws_twin(c) for c in configs))


def ws_twin(config: GemmConfig) -> GemmConfig:
    """A "ws" config as the TMA kernel with the same tile (the same K order, so the same bits); others as they are."""
    return replace(config, variant="tma") if config.variant == "ws" else config


def fma_twin(config: GemmConfig) -> GemmConfig:
    """An "fma" config as the pointer kernel with the same tile (its FMA dot runs the same chain per output, so the
    same bits): what runs where the Gluon kernel cannot. Others as they are."""
    return replace(config, variant="ptr") if config.variant == "fma" else config


def fma_candidates() -> tuple[GemmConfig, ...]:
    """The "fma" tiles a GPU run times at M >= 17 (tools/gpu/fp32_fma.sh); three are pinned (fwd, above). Each
    sm_90 compile (tools/gemm_sass.py --variants fma) issues at least 4 FFMA per shared-memory load and spills nothing,
    on every operand layout det_gemm gives it: 8x16 outputs per thread (21 FFMA per LDS.128) on 128x128 and 4 warps
    (two CTAs per SM) and on 128x256 and 8 warps (one); 8x8 (16 FFMA per LDS.128) on 128x128 and 8 warps, 3 and 4
    stages; 8x4 on 128x64 and 8 warps (at most 128 registers: two CTAs per SM)."""
    return (GemmConfig(128, 128, 32, 8, 4, 3, "fma"), GemmConfig(128, 256, 32, 8, 8, 3, "fma"),
            GemmConfig(128, 128, 32, 8, 8, 3, "fma"), GemmConfig(128, 128, 32, 8, 8, 4, "fma"),
            GemmConfig(128, 64, 32, 8, 8, 4, "fma"),
            # 64-row tiles for 17-256 rows, where a 128-row tile computes padding
            GemmConfig(64, 128, 32, 8, 4, 3, "fma"), GemmConfig(64, 128, 32, 8, 2, 4, "fma"),
            GemmConfig(64, 256, 32, 8, 4, 3, "fma"), GemmConfig(64, 64, 32, 8, 2, 4, "fma"))


def device_sms(device: torch.device) -> int:
    """SMs of a CUDA device; the Hopper count under the interpreter (its pick only decides speed)."""
    if device.type != "cuda":
        return HOPPER_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
