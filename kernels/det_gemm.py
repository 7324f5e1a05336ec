"""Deterministic, batch-invariant BF16 GEMMs for Hopper: forward, dA and dB.

Math (BF16 in, FP32 accumulation, one BF16 rounding at the end):
    det_gemm_fwd(a [M,K], b [K,N]) = a @ b        reduces over K
    det_gemm_da(dc [M,N], b [K,N]) = dc @ b.T     reduces over N
    det_gemm_db(a [M,K], dc [M,N]) = a.T @ dc     reduces over M

All three are one kernel, ``det_gemm_kernel``, computing ``C[R,C] = A[R,L] @ B[L,C]`` over strided
views, so the transposes cost no copy (an nn.Linear weight ``[N,K]`` is passed as ``weight.t()``).

Determinism rests on three rules, audited by ``audits/gemm_*``:
- No split-K and no atomics: one program owns one output tile and reduces all of L itself.
- The reduction runs over L in ascending order in steps of ``STEP_K`` elements, each step one
  ``tl.dot`` into the same FP32 accumulator. The order is a function of L alone — never of the row
  count R, the grid, or the tile config — so a row's bits do not depend on the batch it sits in
  (batch invariance for fwd and dA) and appending zero rows to dB adds exact zeros.
- Configs come from the pinned table below (no autotune): by M, and in the small- and mid-M buckets by
  whether the grid fits one wave on the device (``OneWave``). Every config must give the same bits; the
  cross-config audit checks that on every backend.

Segmented reduction: with ``seg_len`` set, L is cut into contiguous segments; each is accumulated
from zero in FP32 and the segment sums are added in ascending order. A TP/CP shard boundary can then
coincide with a segment boundary, so a later parallelism-invariant mode can reproduce a sharded sum
bit for bit. ``seg_len=None`` (one segment) is the default.

On the Triton interpreter (CPU) ``tl.dot`` on BF16 operands is wrong and its FP32 dot is numpy's
matmul, whose summation order depends on the tile shape. There the kernel instead adds one exact
BF16 product per reduced element to the FP32 accumulator, in ascending order: the
contract's semantics (exact products, FP32 accumulation, one BF16 rounding) with an order that
depends on L alone (one FP32 rounding per product, strictly sequential). The interpreter's FP32 to
BF16 cast truncates, so the final rounding there is done in integer arithmetic (nearest-even). Interpreter bits differ from tensor-core bits; each backend is audited on its own.

Three kernels share that tile math (``tile_of_program``, ``segment_boundary``, ``accumulate``, ``mac_step``, ``store_tile``):
- ``det_gemm_kernel`` (``GemmConfig.variant == "ptr"``) loads through pointers
  (cp.async on sm_90).
- ``det_gemm_tma_kernel`` (``variant == "tma"``) loads each operand with a host-side TMA descriptor
  over its storage order (a K-major B, e.g. ``weight.t()``, as ``[N, K]`` boxes transposed before
  ``tl.dot``) and zero-fills out-of-bounds boxes as the masked loads do. TMA needs a unit stride on one
  dim, the other stride and the base 16-byte aligned; any other operand is refused with an error
  naming it, never handed to the pointer kernel behind the caller's back.
- ``det_gemm_tma3_kernel`` (``variant == "tma3"``): the TMA kernel with a tile three power-of-two
  sub-tiles wide (e.g. 192 columns), one accumulator per sub-tile. The table offers it in OneWave entries
  only, beside tiles with a pointer twin: when an operand is not TMA-addressable the entry picks among
  those instead (same bits).

Shapes: any M, N, K >= 1 below 2**30 (element offsets are 64-bit: an lm_head's logits may hold more than
2**31 - 1 elements); any non-negative strides ("ptr").

Host path: a call's signature (op, options, and each tensor's type, shape, strides, dtype, layout, device and
base alignment) keys a launch plan, built once and kept in a bounded LRU: the signature checks, the table's pick,
the variant, the grid and the static launch arguments. Per call: one cache lookup, the checks that depend on the
tensors themselves (storage), the output's allocation and the launch, straight into the compiled kernel's
launcher after the plan's first launch (kernels/backend.py DirectLaunch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from detkit.kernels.backend import (
    CUDA_SM90, TRITON_INTERPRETER, DirectLaunch, check_bf16_matrix, check_bf16_signature, check_layout,
    check_storage, ensure_thread_cuda_context, host_descriptor, resolve_backend_of_devices,
)
from detkit.kernels.det_gemm_ws import consumers, det_gemm_ws_kernel, max_regs, ws_descriptor, ws_tma_store
from detkit.kernels.gemm_names import _OP_IDS, OPS, _launch_metadata, _layer_dims, case_name  # noqa: F401 (re-exported)

# ---------------------------------------------------------------------------------------------
# Pinned config table. Bump the version whenever an entry changes; reports record it.
# ---------------------------------------------------------------------------------------------
CONFIG_TABLE_VERSION = "2026-12-01.14"

# The interpreter's [BLOCK_M, STEP_K, BLOCK_N] product block must stay within Triton's 2**20 elements.
INTERPRETER_MAX_BLOCK_NUMEL = 2**20


def interpreter_step_k(config: "GemmConfig") -> int:
    step = config.block_k
    while config.block_m * step * config.block_n > INTERPRETER_MAX_BLOCK_NUMEL:
        step //= 2
    return step


VARIANTS = ("ptr", "tma", "tma3", "ws")
# A TMA box has at most 256 elements per dim (cuTensorMapEncodeTiled's boxDim limit).
TMA_MAX_BOX = 256


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
    # three power-of-two sub-tiles (e.g. 192). "ws": kernels/det_gemm_ws.py (Gluon, sm_90 only), persistent and
    # warp-specialized: one TMA producer warp, num_warps / 4 consumer warpgroups (each block_m / (num_warps / 4)
    # rows of the tile), num_stages ring slots.
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
        # (block_m 64 with 8 warps: two warpgroups taking 64-row tiles in turn, the MoE FP8 gathered kernel's ping-pong)
        if self.variant == "ws" and (self.num_warps not in (4, 8) or self.block_m % 64):
            raise ValueError(f"variant 'ws' needs 4 or 8 consumer warps and block_m a multiple of 64 rows; got "
                             f"num_warps {self.num_warps}, block_m {self.block_m}")
        if self.variant in ("tma", "tma3", "ws"):
            for field, value in (("block_m", self.block_m), ("block_n", self.box_n), ("block_k", self.block_k)):
                if value > TMA_MAX_BOX or value & (value - 1):
                    what = "block_n / 3" if field == "block_n" and self.variant == "tma3" else field
                    raise ValueError(f"variant {self.variant!r} needs {what} a power of two <= {TMA_MAX_BOX} "
                                     f"(one TMA box dim); got {value}")
        if self.variant == "tma3" and self.box_n < 16:
            raise ValueError(f"variant 'tma3' needs block_n / 3 >= 16 (one MMA's N); got {self.box_n}")

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

    def __post_init__(self):
        if not self.configs or not all(isinstance(c, GemmConfig) for c in self.configs):
            raise ValueError(f"OneWave needs one or more GemmConfig; got {self.configs!r}")
        if all(c.variant == "tma3" for c in self.configs):
            raise ValueError("OneWave needs a config that is not 'tma3' (the pick for operands TMA cannot "
                             f"address); got {[c.label() for c in self.configs]}")
        if self.max_ctas_per_sm is not None and (not isinstance(self.max_ctas_per_sm, int) or self.max_ctas_per_sm < 1):
            raise ValueError(f"OneWave.max_ctas_per_sm must be a positive int or None; got {self.max_ctas_per_sm!r}")

    def choices(self, tma3: bool = True) -> tuple[GemmConfig, ...]:
        """The configs in order; ``tma3=False``: those with a pointer twin only (an operand TMA cannot address)."""
        return tuple(c for c in self.configs if tma3 or c.variant != "tma3")

    def pick(self, rows: int, cols: int, sms: int, tma3: bool = True) -> GemmConfig:
        configs = self.choices(tma3)
        for config in configs:
            per_sm = ctas_per_sm(config)
            if self.max_ctas_per_sm is not None:
                per_sm = min(per_sm, self.max_ctas_per_sm)
            if output_tiles(config, rows, cols) <= sms * per_sm:
                return config
        return configs[0]


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
# The warp-specialized Gluon kernel (kernels/det_gemm_ws.py) on a 128x256 tile, 3 stages, its epilogue through a
# shared tile buffer and TMA stores (208 KiB; with 4 stages the buffer no longer fits and the register epilogue
# runs at half the speed): the producer warp keeps the ring full across tile boundaries of the persistent grid,
# which is what large grids need (fwd and dA 1-6% ahead of the best Triton tile at M 2048-16384; dB 16-29% at
# M 128-1024, 1-11% above). Where Gluon cannot run it (not sm_90, seg_len segments) the same tile runs in Triton,
# "tma" or "ptr" (_table_pick): the same K order, so the same bits.
_WS_WIDE = GemmConfig(128, 256, 64, 8, 8, 3, "ws")
# M <= 32: the weight stream is the work. The narrow tile while its tiles fit the SMs once at one CTA per SM (CTAs
# sharing an SM share its bandwidth), else the wide one: within 2% of the best candidate per M (worst case 9%).
_TINY = OneWave((GemmConfig(16, 32, 128, 1, 4, 6), GemmConfig(16, 64, 128, 1, 4, 6)), max_ctas_per_sm=1)
_SMALL_32 = OneWave((GemmConfig(64, 32, 128, 1, 4, 4), GemmConfig(64, 64, 128, 1, 4, 4)), max_ctas_per_sm=1)
CONFIG_TABLE: dict[str, tuple[tuple[int, GemmConfig | OneWave], ...]] = {
    "fwd": (
        (16, _TINY),
        (32, _SMALL_32),
        # M 33-1024: TMA tiles, the first whose grid is one wave (OneWave): within 1% of the best candidate per
        # M (worst case 6%) over both Qwen3-8B TP=2 shapes and both weight layouts; a fixed tile per M bucket
        # was 1-9% off (worst 20%), because the best tile depends on the output width.
        (64, OneWave((_SMALL_64, _SMALL_128, _SMALL_128_2))),
        (128, OneWave((_NARROW_128, _SMALL_128_DEEP, _SMALL_128_2))),
        (256, OneWave((_SMALL_128_DEEP, _SMALL_192, _SMALL_128_2))),
        (1024, OneWave((_MID, _MID_192, _MID_TALL))),
        (2**31, _WS_WIDE),
    ),
    "da": (
        (16, _TINY),  # as fwd
        (32, _SMALL_32),
        (64, OneWave((_SMALL_64, _SMALL_128, _SMALL_128_2))),
        (128, OneWave((_NARROW_128, _SMALL_128_DEEP, _SMALL_128_2))),
        (256, OneWave((_SMALL_128_DEEP, _SMALL_192, _SMALL_128_2))),
        # M 257-1024 without the 192-wide tile: at M 512 it was 3% ahead on one weight layout and 3% behind on
        # the other.
        (1024, OneWave((_MID, _MID_TALL))),
        (2**31, _WS_WIDE),
    ),
    "db": (
        # M <= 64: a short reduction into a large [K, N] output, where small pointer tiles with a short BLOCK_K
        # keep many CTAs busy: 1.09-1.54x faster than the wide tile at every M swept on both shapes.
        (64, GemmConfig(128, 128, 32, 8, 4, 4)),
        (2**31, _WS_WIDE),
    ),
}


def entry_configs(entry: GemmConfig | OneWave) -> tuple[GemmConfig, ...]:
    """The configs one table entry can pick."""
    return entry.configs if isinstance(entry, OneWave) else (entry,)


def select_config(op: str, m: int, *, cols: int | None = None, sms: int = HOPPER_SMS,
                  tma3: bool = True) -> GemmConfig:
    """The pinned config for ``op`` at batch size ``m`` (fwd/dA: output rows; dB: the reduced dim); ``cols``:
    the output's width, for a OneWave entry on ``sms`` SMs (None: the entry's first choice); ``tma3=False``:
    a OneWave entry picks among its configs that have a pointer twin. Both weight layouts take the same pick."""
    if op not in CONFIG_TABLE:
        raise ValueError(f"op {op!r} is not supported; supported: {OPS}")
    for max_m, entry in CONFIG_TABLE[op]:
        if m <= max_m:
            if isinstance(entry, OneWave):
                return entry.choices(tma3)[0] if cols is None else entry.pick(m, cols, sms, tma3)
            return entry
    raise ValueError(f"M={m} exceeds the config table for {op!r}")


def all_configs(op: str, backend: str = CUDA_SM90) -> list[GemmConfig]:
    """Every distinct config the tables can pick for ``op`` on ``backend`` (the cross-config audit runs them
    all); off sm_90 a "ws" pick runs as its Triton twin (``ws_twin``)."""
    if op not in CONFIG_TABLE:
        raise ValueError(f"op {op!r} is not supported; supported: {OPS}")
    configs = (c for _, e in CONFIG_TABLE[op] for c in entry_configs(e))
    return list(dict.fromkeys(c if backend == CUDA_SM90 else ws_twin(c) for c in configs))


def ws_twin(config: GemmConfig) -> GemmConfig:
    """A "ws" config as the TMA kernel with the same tile (the same K order, so the same bits); others as they are."""
    return replace(config, variant="tma") if config.variant == "ws" else config


def device_sms(device: torch.device) -> int:
    """SMs of a CUDA device; the Hopper count under the interpreter (its pick only decides speed)."""
    if device.type != "cuda":
        return HOPPER_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------
@triton.jit
def fp32_to_bf16_rtne(x):
    """Round FP32 to BF16, nearest-even, in integer arithmetic. The interpreter's own cast truncates;
    on the GPU this equals cvt.rn.bf16.f32 for every non-NaN input (NaN stays a quiet NaN)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (((bits >> 16) & 1) + 0x7FFF)
    out = (bits >> 16).to(tl.uint16)
    out = tl.where(x != x, 0x7FC0, out).to(tl.uint16)
    return out.to(tl.bfloat16, bitcast=True)


@triton.jit
def tile_of_program(R, C, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program's output tile. Grouped tile order for L2 reuse: it changes which
    program owns a tile, never the tile's math."""
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(R, BLOCK_M)
    num_pid_n = tl.cdiv(C, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def mac_step(acc, a, b, offs_k, STEP_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """``acc + a @ b`` for one reduction step (a [BLOCK_M, STEP_K], b [STEP_K, BLOCK_N]): one tl.dot on
    the GPU. In the interpreter, exact BF16 products added one at a time in ascending order (cumsum is
    sequential there); numpy's matmul would pick its order from the tile shape."""
    if INTERPRETED:
        prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]  # [BLOCK_M, STEP_K, BLOCK_N]
        first = (offs_k == 0)[None, :, None]
        last = (offs_k == STEP_K - 1)[None, :, None]
        prod = tl.where(first, prod + acc[:, None, :], prod)
        out = tl.sum(tl.where(last, tl.cumsum(prod, axis=1), 0.0), axis=1)
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def segment_boundary(acc, seg_acc, k0, seg_len, SEGMENTED: tl.constexpr):
    """At the start of each FP32 segment after the first, the finished segment joins the total
    (ascending order) and the next one starts from zero."""
    if SEGMENTED:
        if (k0 % seg_len == 0) and (k0 > 0):
            acc += seg_acc
            seg_acc = tl.zeros_like(seg_acc)
    return acc, seg_acc


@triton.jit
def accumulate(acc, seg_acc, a, b, offs_k, STEP_K: tl.constexpr, INTERPRETED: tl.constexpr,
               SEGMENTED: tl.constexpr):
    """One K step into the running segment (segmented) or the total."""
    if SEGMENTED:
        seg_acc = mac_step(seg_acc, a, b, offs_k, STEP_K, INTERPRETED)
    else:
        acc = mac_step(acc, a, b, offs_k, STEP_K, INTERPRETED)
    return acc, seg_acc


@triton.jit
def store_tile(c_ptr, twin_ptr, acc, offs_am, offs_bn, R, C, stride_cr, stride_cc,
               INTERPRETED: tl.constexpr, OUT_FP32: tl.constexpr, TWIN: tl.constexpr):
    """The epilogue: FP32 as is, or one BF16 rounding (nearest-even) of the FP32 accumulator. With
    TWIN the same bits also go to ``twin_ptr`` (same shape and strides): the TP/CP operators reduce
    that copy in place and keep the partial, without a separate copy kernel before the collective."""
    # 64-bit offsets: the output may hold more than 2**31 - 1 elements (an lm_head's logits at M 16384)
    c_offs = offs_am.to(tl.int64)[:, None] * stride_cr + offs_bn.to(tl.int64)[None, :] * stride_cc  # [BLOCK_M, BLOCK_N]
    c_mask = (offs_am < R)[:, None] & (offs_bn < C)[None, :]
    if OUT_FP32:
        out = acc
    elif INTERPRETED:
        out = fp32_to_bf16_rtne(acc)
    else:
        out = acc.to(tl.bfloat16)
    tl.store(c_ptr + c_offs, out, mask=c_mask)
    if TWIN:
        tl.store(twin_ptr + c_offs, out, mask=c_mask)


@triton.jit(launch_metadata=_launch_metadata)
def det_gemm_kernel(
    a_ptr, b_ptr, c_ptr, twin_ptr,
    R, C, L,  # C[R, C] = A[R, L] @ B[L, C]
    stride_ar, stride_al,
    stride_bl, stride_bc,
    stride_cr, stride_cc,
    seg_len,  # reduced elements per FP32 segment (== L for one segment); multiple of BLOCK_K
    op_id,  # 0 fwd, 1 dA, 2 dB: names the launch only (a runtime arg, so the three share one binary)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STEP_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRETED: tl.constexpr, SEGMENTED: tl.constexpr, OUT_FP32: tl.constexpr, TWIN: tl.constexpr,
    B_K_MAJOR: tl.constexpr,  # B's reduced dim is contiguous (e.g. fwd on nn.Linear's weight.t())
):
    pid_m, pid_n = tile_of_program(R, C, BLOCK_M, BLOCK_N, GROUP_M)
    offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_bn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, STEP_K)
    # 64-bit element offsets (an operand may hold more than 2**31 - 1 elements); masks stay 32-bit.
    rows64, cols64, ks64 = offs_am.to(tl.int64), offs_bn.to(tl.int64), offs_k.to(tl.int64)
    a_ptrs = a_ptr + rows64[:, None] * stride_ar + ks64[None, :] * stride_al  # [BLOCK_M, STEP_K]
    if B_K_MAJOR:
        # Load B in its storage order and transpose in registers: the MMA sees the same [STEP_K, BLOCK_N]
        # operand, but the copy runs along contiguous memory and wgmma reads B K-major from shared memory.
        b_ptrs = b_ptr + cols64[:, None] * stride_bc + ks64[None, :] * stride_bl  # [BLOCK_N, STEP_K]
    else:
        b_ptrs = b_ptr + ks64[:, None] * stride_bl + cols64[None, :] * stride_bc  # [STEP_K, BLOCK_N]
    a_step = tl.cast(stride_al, tl.int64) * STEP_K
    b_step = tl.cast(stride_bl, tl.int64) * STEP_K
    row_ok = offs_am < R
    col_ok = offs_bn < C

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    seg_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        acc, seg_acc = segment_boundary(acc, seg_acc, k0, seg_len, SEGMENTED)
        for kk in tl.static_range(0, BLOCK_K, STEP_K):
            k_ok = (k0 + kk + offs_k) < L
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, STEP_K]
            if B_K_MAJOR:
                b = tl.trans(tl.load(b_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0))  # [STEP_K, BLOCK_N]
            else:
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [STEP_K, BLOCK_N]
            a_ptrs += a_step
            b_ptrs += b_step
            acc, seg_acc = accumulate(acc, seg_acc, a, b, offs_k, STEP_K, INTERPRETED, SEGMENTED)
    if SEGMENTED:
        acc += seg_acc
    store_tile(c_ptr, twin_ptr, acc, offs_am, offs_bn, R, C, stride_cr, stride_cc, INTERPRETED, OUT_FP32, TWIN)


@triton.jit
def tma_tile(desc, row, col, TRANSPOSED: tl.constexpr):
    """The tile at (row, col) of an operand's logical view, from a TMA descriptor over its storage: the
    view itself, or its transpose (storage [cols, rows]: dB's a.T, or a K-major B such as nn.Linear's
    weight.t(), which wgmma then reads from shared memory as its K-major operand: no shuffle)."""
    if TRANSPOSED:
        tile = tl.trans(desc.load([col, row]))
    else:
        tile = desc.load([row, col])
    return tile


@triton.jit(launch_metadata=_launch_metadata)
def det_gemm_tma_kernel(
    a_desc, b_desc, c_ptr, twin_ptr,  # TMA descriptors over A and B in their storage order (see A_M_MAJOR, B_K_MAJOR)
    R, C, L,  # C[R, C] = A[R, L] @ B[L, C]
    stride_cr, stride_cc,
    seg_len,  # reduced elements per FP32 segment (== L for one segment); multiple of BLOCK_K
    op_id,  # 0 fwd, 1 dA, 2 dB: names the launch only
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STEP_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRETED: tl.constexpr, SEGMENTED: tl.constexpr, OUT_FP32: tl.constexpr, TWIN: tl.constexpr,
    A_M_MAJOR: tl.constexpr,  # A stored as [L, R] (its row dim contiguous, e.g. dB's a.T): box [STEP_K, BLOCK_M]
    B_K_MAJOR: tl.constexpr,  # B stored as [C, L] (e.g. fwd on nn.Linear's weight.t()): box [BLOCK_N, STEP_K]
):
    """det_gemm_kernel's tile math with TMA loads: the same tile order, K order, steps and epilogue.
    TMA fills out-of-bounds box elements with zeros, as the pointer kernel's masked loads do."""
    pid_m, pid_n = tile_of_program(R, C, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_k = tl.arange(0, STEP_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    seg_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        acc, seg_acc = segment_boundary(acc, seg_acc, k0, seg_len, SEGMENTED)
        for kk in tl.static_range(0, BLOCK_K, STEP_K):
            k = k0 + kk
            a = tma_tile(a_desc, off_m, k, A_M_MAJOR)  # [BLOCK_M, STEP_K]
            b = tma_tile(b_desc, k, off_n, B_K_MAJOR)  # [STEP_K, BLOCK_N]
            acc, seg_acc = accumulate(acc, seg_acc, a, b, offs_k, STEP_K, INTERPRETED, SEGMENTED)
    if SEGMENTED:
        acc += seg_acc
    offs_am = off_m + tl.arange(0, BLOCK_M)
    offs_bn = off_n + tl.arange(0, BLOCK_N)
    store_tile(c_ptr, twin_ptr, acc, offs_am, offs_bn, R, C, stride_cr, stride_cc, INTERPRETED, OUT_FP32, TWIN)


@triton.jit(launch_metadata=_launch_metadata)
def det_gemm_tma3_kernel(
    a_desc, b_desc, c_ptr, twin_ptr,  # as det_gemm_tma_kernel; b_desc's box is one sub-tile, BLOCK_N / 3 wide
    R, C, L,
    stride_cr, stride_cc,
    seg_len,
    op_id,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STEP_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRETED: tl.constexpr, SEGMENTED: tl.constexpr, OUT_FP32: tl.constexpr, TWIN: tl.constexpr,
    A_M_MAJOR: tl.constexpr, B_K_MAJOR: tl.constexpr,
):
    """det_gemm_tma_kernel with a tile three power-of-two sub-tiles wide (BLOCK_N = 3 x SUB_N, e.g. 192):
    a width Triton's power-of-two blocks cannot hold in one tensor, which fills 132 SMs where powers of two
    do not (a 6144-wide output is 32 tile columns of 192, against 48 of 128 or 24 of 256). Each K step loads
    A once and feeds three MMAs, one per sub-tile accumulator; every output element still sums its K in the
    same ascending steps, so the bits equal every other config's (checked as for any config)."""
    SUB_N: tl.constexpr = BLOCK_N // 3
    pid_m, pid_n = tile_of_program(R, C, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_k = tl.arange(0, STEP_K)

    acc0 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    seg0 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    seg1 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    seg2 = tl.zeros((BLOCK_M, SUB_N), dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        acc0, seg0 = segment_boundary(acc0, seg0, k0, seg_len, SEGMENTED)
        acc1, seg1 = segment_boundary(acc1, seg1, k0, seg_len, SEGMENTED)
        acc2, seg2 = segment_boundary(acc2, seg2, k0, seg_len, SEGMENTED)
        for kk in tl.static_range(0, BLOCK_K, STEP_K):
            k = k0 + kk
            a = tma_tile(a_desc, off_m, k, A_M_MAJOR)  # one A tile feeds the three sub-tiles' MMAs
            b = tma_tile(b_desc, k, off_n, B_K_MAJOR)  # [STEP_K, SUB_N]
            acc0, seg0 = accumulate(acc0, seg0, a, b, offs_k, STEP_K, INTERPRETED, SEGMENTED)
            b = tma_tile(b_desc, k, off_n + SUB_N, B_K_MAJOR)
            acc1, seg1 = accumulate(acc1, seg1, a, b, offs_k, STEP_K, INTERPRETED, SEGMENTED)
            b = tma_tile(b_desc, k, off_n + 2 * SUB_N, B_K_MAJOR)
            acc2, seg2 = accumulate(acc2, seg2, a, b, offs_k, STEP_K, INTERPRETED, SEGMENTED)
    if SEGMENTED:
        acc0 += seg0
        acc1 += seg1
        acc2 += seg2
    offs_am = off_m + tl.arange(0, BLOCK_M)
    offs_bn = off_n + tl.arange(0, SUB_N)  # the first sub-tile's columns; the others are SUB_N further each
    store_tile(c_ptr, twin_ptr, acc0, offs_am, offs_bn, R, C, stride_cr, stride_cc, INTERPRETED, OUT_FP32, TWIN)
    offs_bn += SUB_N
    store_tile(c_ptr, twin_ptr, acc1, offs_am, offs_bn, R, C, stride_cr, stride_cc, INTERPRETED, OUT_FP32, TWIN)
    offs_bn += SUB_N
    store_tile(c_ptr, twin_ptr, acc2, offs_am, offs_bn, R, C, stride_cr, stride_cc, INTERPRETED, OUT_FP32, TWIN)


# ---------------------------------------------------------------------------------------------
# Launch: a plan per call signature, checked and derived once; per call the tensor checks and the launch.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmLaunch:
    """What ran: the backend and the config, for every result row."""

    op: str
    backend: str
    config: GemmConfig
    name: str


def _launch_record(op: str, backend: str, config: GemmConfig, rows: int, cols: int, reduced: int) -> GemmLaunch:
    """What a launch ran, named in the layer's (M, N, K) from the kernel's (rows, cols, reduced)."""
    m, n, k = _layer_dims(_OP_IDS[op], rows, cols, reduced)
    return GemmLaunch(op=op, backend=backend, config=config, name=case_name(op, m, n, k))


# Launch plans kept, least recently used dropped first: a model's layer shapes times the batch sizes it runs at.
MAX_PLANS = 4096
# Every dim must be below this: tile indices, TMA box coordinates and TMA shapes are 32-bit (element offsets
# are 64-bit: an operand or the output may hold more than 2**31 - 1 elements).
MAX_DIM = 2**30
OUT_DTYPES = (torch.bfloat16, torch.float32)

# The caller's operand names per op, and whether the kernel's A [R, L] / B [L, C] view reads each transposed.
_OPERAND_NAMES = {"fwd": ("a", "b"), "da": ("dc", "b"), "db": ("a", "dc")}
_TRANSPOSED = {"fwd": (False, False), "da": (False, True), "db": (True, False)}
# (x dim, y dim, what) of the dimension the two operands share.
_SHARED_DIM = {"fwd": (1, 0, "det_gemm_fwd needs a [M,K], b [K,N]"),
               "da": (1, 1, "det_gemm_da needs dc [M,N], b [K,N]"),
               "db": (0, 0, "det_gemm_db needs a [M,K], dc [M,N]")}


class _Operand(NamedTuple):
    """What a launch plan knows of one tensor: its signature, never the tensor (a plan outlives its calls)."""

    name: str
    cls: type
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    layout: torch.layout
    device: torch.device
    misalign: int  # data_ptr % 16

    def view(self, transposed: bool) -> tuple[tuple[int, int], tuple[int, int]]:
        """(shape, strides) of the kernel's view: the tensor or its transpose."""
        return (self.shape[::-1], self.stride[::-1]) if transposed else (tuple(self.shape), tuple(self.stride))


def _check_operand(t: _Operand) -> int:
    """check_bf16_matrix on a signature, without the 32-bit offset limit (the kernels index in 64 bits) but with
    MAX_DIM; returns the elements the view spans from its storage offset."""
    if not issubclass(t.cls, torch.Tensor):
        raise TypeError(f"{t.name} must be a torch.Tensor; got {t.cls.__name__}")
    check_layout(t.name, t.layout)
    span = check_bf16_signature(t.name, t.shape, t.stride, t.dtype, max_offset=None)
    if max(t.shape) >= MAX_DIM:
        raise ValueError(f"{t.name} has shape {tuple(t.shape)}; supported: every dim below 2**30 (32-bit tile "
                         "indices and TMA coordinates)")
    return span


def _check_options(config, seg_len, out_dtype) -> None:
    """The launch options' types, checked per call before the plan lookup (they are part of its key)."""
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a GemmConfig or None (the table's pick); got {type(config).__name__} "
                        f"{config!r}")
    if seg_len is not None and (not isinstance(seg_len, int) or seg_len < 1):
        raise ValueError(f"seg_len must be a positive int or None; got {seg_len!r}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype {out_dtype} is not supported; supported: torch.bfloat16, torch.float32")


def _check_seg_len(seg_len: int | None, reduced: int, config: GemmConfig) -> int:
    if seg_len is None:
        return reduced
    if not isinstance(seg_len, int) or seg_len < 1:
        raise ValueError(f"seg_len must be a positive int or None; got {seg_len!r}")
    if seg_len % config.block_k:
        raise ValueError(
            f"seg_len {seg_len} is not a multiple of the config's BLOCK_K {config.block_k}; "
            "segment boundaries must fall on loop iterations"
        )
    return seg_len


def _is_contiguous(shape, stride) -> bool:
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def _check_twin(twin: _Operand | None, rows: int, cols: int, out_dtype: torch.dtype, device: torch.device) -> None:
    if twin is None:
        return
    if not issubclass(twin.cls, torch.Tensor):
        raise TypeError(f"twin_out must be a torch.Tensor or None; got {twin.cls.__name__}")
    check_layout("twin_out", twin.layout)
    contiguous = _is_contiguous(twin.shape, twin.stride)
    if tuple(twin.shape) != (rows, cols) or twin.dtype != out_dtype or twin.device != device or not contiguous:
        raise ValueError(
            f"twin_out must be a contiguous {out_dtype} tensor of shape {(rows, cols)} on {device} (the output's "
            f"twin); got {twin.dtype} {tuple(twin.shape)} on {twin.device}, contiguous={contiguous}"
        )


def _tma_layout(shape, stride, item: int, misalign: int, block: tuple[int, int]):
    """``(transposed, shape, strides, box)`` of a TMA descriptor over a view [rows, cols] (``shape``,
    ``stride``; elements of ``item`` bytes, base ``misalign`` bytes past a 16-byte boundary) in its storage order
    ([cols, rows] with ``block`` reversed when transposed), or None when TMA cannot address it: no unit-stride
    dim, a non-16-byte-aligned base or outer stride."""
    (rows, cols), (stride_r, stride_c) = shape, stride
    if stride_c == 1:
        transposed, shape, strides, box = False, [rows, cols], [stride_r, 1], [block[0], block[1]]
    elif stride_r == 1:
        transposed, shape, strides, box = True, [cols, rows], [stride_c, 1], [block[1], block[0]]
    else:
        return None
    if strides[0] * item % 16 or misalign:
        return None
    return transposed, shape, strides, box


def _descriptor_layout(name: str, shape, stride, item: int, misalign: int, view_shape, view_stride,
                       block: tuple[int, int], variant: str):
    """_tma_layout of an operand's view, or a refusal naming the operand (its own shape and strides)."""
    layout = _tma_layout(view_shape, view_stride, item, misalign, block)
    if layout is None:
        raise ValueError(
            f"variant {variant!r} cannot describe {name} (shape {tuple(shape)}, strides {tuple(stride)}, "
            f"data_ptr % 16 = {misalign}): TMA needs one dim with stride 1, the other stride a "
            f"multiple of {16 // item} elements (16 bytes) and a 16-byte-aligned base; use a 'ptr' config "
            "for this operand"
        )
    return layout


def tma_descriptor(name: str, tensor: torch.Tensor, view: torch.Tensor, block: tuple[int, int],
                   variant: str = "tma"):
    """A TMA descriptor over ``view`` and whether its storage order is transposed; refuses, naming the
    operand, what TMA cannot address."""
    transposed, shape, strides, box = _descriptor_layout(
        name, tensor.shape, tensor.stride(), tensor.element_size(), tensor.data_ptr() % 16, view.shape, view.stride(),
        block, variant)
    if variant == "ws":  # Gluon's descriptor carries the shared-memory layout of its box
        return ws_descriptor(tensor, shape, strides, box), transposed
    return TensorDescriptor(tensor, shape, strides, box), transposed


def _table_pick(op: str, m: int, cols: int, views, device: torch.device, backend: str, segmented: bool) -> GemmConfig:
    """The table's pick for ``op`` at batch size ``m``, output width ``cols`` on ``device``'s SMs. A "ws" pick runs
    as its TMA twin where the Gluon kernel cannot (``backend`` not sm_90, or ``segmented``: seg_len segments). When
    an operand is not TMA-addressable (``views``: (view shape, view strides, misalign) of A and B), a "tma3" pick
    gives way to the entry's pick among its other tiles, and a "tma" or "ws" pick runs as the pointer kernel with the
    same tile. Neither the tile, the layout nor the variant changes the bits (same K order; every pick swept on the
    H200 and checked by the cross-config audit), so this choice cannot change a result."""
    def addressable(config: GemmConfig) -> bool:
        blocks = ((config.block_m, config.block_k), (config.block_k, config.box_n))
        return all(_tma_layout(shape, stride, 2, misalign, blk) is not None
                   for (shape, stride, misalign), blk in zip(views, blocks))

    sms = device_sms(device)
    config = select_config(op, m, cols=cols, sms=sms)
    if backend != CUDA_SM90 or segmented:
        config = ws_twin(config)
    if config.variant == "tma3" and not addressable(config):  # a 3 x power-of-two tile has no pointer twin
        config = select_config(op, m, cols=cols, sms=sms, tma3=False)
    if config.variant in ("tma", "ws") and not addressable(config):
        config = replace(config, variant="ptr")
    return config


class _Plan(NamedTuple):
    """A launch plan: what a call with this signature ran (``record``) and its launch (``launch(x, y, twin_out) ->
    output``: the per-call tensor checks, the output, the launch)."""

    record: GemmLaunch
    launch: object


@functools.lru_cache(maxsize=MAX_PLANS)
def _plan(key: tuple) -> _Plan:
    """The launch plan of a call signature (``_lookup``'s key): every check that depends on the signature alone,
    the config pick, the kernel variant, the grid and the static launch arguments, worked out once."""
    op, config, seg_len, out_dtype = key[:4]
    names = _OPERAND_NAMES[op]
    x, y = _Operand(names[0], *key[4:11]), _Operand(names[1], *key[11:18])
    twin = None if key[18] is None else _Operand("twin_out", *key[18])
    return _build_plan(op, x, y, config, seg_len, out_dtype, twin)


def _lookup(op: str, x, y, config, seg_len, out_dtype, twin_out) -> _Plan:
    """The plan for this call: one cache lookup keyed on everything a plan depends on (op, options, and each
    tensor's type, shape, strides, dtype, layout, device and base alignment; the alignment decides TMA and
    Triton's pointer specialization)."""
    try:
        key = (op, config, seg_len, out_dtype,
               x.__class__, x.shape, x.stride(), x.dtype, x.layout, x.device, x.data_ptr() & 15,
               y.__class__, y.shape, y.stride(), y.dtype, y.layout, y.device, y.data_ptr() & 15,
               None if twin_out is None else (twin_out.__class__, twin_out.shape, twin_out.stride(), twin_out.dtype,
                                              twin_out.layout, twin_out.device, twin_out.data_ptr() & 15))
    except Exception as exc:  # not tensors, or tensors without strides or data pointers (e.g. sparse)
        _refuse_unkeyable(op, x, y, twin_out, exc)
    return _plan(key)


def _refuse_unkeyable(op: str, x, y, twin_out, exc: Exception):
    """The refusal for arguments a plan key cannot be taken from, naming the argument."""
    for name, t in zip(_OPERAND_NAMES[op], (x, y)):
        check_bf16_matrix(name, t, max_offset=None)
    if twin_out is not None:
        if not isinstance(twin_out, torch.Tensor):
            raise TypeError(f"twin_out must be a torch.Tensor or None; got {type(twin_out).__name__}")
        check_layout("twin_out", twin_out.layout)
    raise exc


def clear_launch_plans() -> None:
    """Forget every launch plan (they are rebuilt on the next calls): for tests that change the device's SMs."""
    _plan.cache_clear()


def launch_plans_info():
    """(hits, misses, maxsize, currsize) of the launch-plan cache."""
    return _plan.cache_info()


def _build_plan(op: str, x: _Operand, y: _Operand, config: GemmConfig | None, seg_len: int | None,
                out_dtype: torch.dtype, twin: _Operand | None) -> _Plan:
    """Check, pick, derive: the old per-call work of a launch, done once per signature, in the same order."""
    x_span, y_span = _check_operand(x), _check_operand(y)
    x_dim, y_dim, what = _SHARED_DIM[op]
    if x.shape[x_dim] != y.shape[y_dim]:
        raise ValueError(
            f"{what}: {x.name}.shape[{x_dim}]={x.shape[x_dim]} != {y.name}.shape[{y_dim}]={y.shape[y_dim]} "
            f"({x.name} {tuple(x.shape)}, {y.name} {tuple(y.shape)})"
        )
    backend = resolve_backend_of_devices(det_gemm_kernel, {x.name: x.device, y.name: y.device})
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype {out_dtype} is not supported; supported: torch.bfloat16, torch.float32")
    a_t, b_t = _TRANSPOSED[op]
    (a_shape, a_stride), (b_shape, b_stride) = x.view(a_t), y.view(b_t)
    rows, reduced = a_shape
    cols = b_shape[1]
    device = x.device
    _check_twin(twin, rows, cols, out_dtype, device)
    if config is None:
        views = ((a_shape, a_stride, x.misalign), (b_shape, b_stride, y.misalign))
        config = _table_pick(op, reduced if op == "db" else rows, cols, views, device, backend,
                             segmented=seg_len is not None and seg_len != reduced)
    elif not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a GemmConfig or None (the table's pick); got {type(config).__name__} "
                        f"{config!r}")
    seg = _check_seg_len(seg_len, reduced, config)
    interpreted = backend == TRITON_INTERPRETER
    step_k = interpreter_step_k(config) if interpreted else config.block_k
    tiles = triton.cdiv(rows, config.block_m) * triton.cdiv(cols, config.block_n)
    out_bytes = out_dtype.itemsize
    geometry = _Geometry(op, x, y, a_t, b_t, a_shape, a_stride, b_shape, b_stride, rows, cols, reduced, x_span, y_span,
                         None if twin is None else rows * cols, out_dtype, out_bytes, device)
    if config.variant == "ws":
        if backend != CUDA_SM90:
            raise ValueError(f"variant 'ws' is a Gluon kernel for sm_90 and has no {backend!r} path; use a 'ptr', "
                             "'tma' or 'tma3' config there")
        if seg != reduced:
            raise ValueError("variant 'ws' keeps one FP32 accumulator (no seg_len segments); use a 'tma' config for "
                             "segmented calls")
        if config.block_m % (16 * config.num_warps):
            raise ValueError(f"det_gemm: variant 'ws' gives each consumer warpgroup (4 warps) 64 rows of a tile: "
                             f"block_m {16 * config.num_warps} per {config.num_warps} warps; got block_m "
                             f"{config.block_m}")
        launch = _ws_launch(geometry, config, twin is not None, min(tiles, device_sms(device)))
    else:
        constexprs = dict(
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, STEP_K=step_k,
            GROUP_M=config.group_m, INTERPRETED=interpreted, SEGMENTED=seg != reduced,
            OUT_FP32=out_dtype == torch.float32, TWIN=twin is not None,
        )
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        static = dict(R=rows, C=cols, L=reduced, stride_cr=cols, stride_cc=1, seg_len=seg, op_id=_OP_IDS[op])
        if config.variant in ("tma", "tma3"):
            launch = _tma_launch(geometry, config, step_k, interpreted, static, constexprs, options, (tiles,))
        else:
            static.update(stride_ar=a_stride[0], stride_al=a_stride[1], stride_bl=b_stride[0], stride_bc=b_stride[1])
            constexprs["B_K_MAJOR"] = b_stride[0] == 1 and b_stride[1] != 1
            launch = _ptr_launch(geometry, interpreted, static, constexprs, options, (tiles,))
    return _Plan(_launch_record(op, backend, config, rows, cols, reduced), launch)


class _Geometry(NamedTuple):
    """A plan's operands, the kernel's views of them and the output, for the launch closures."""

    op: str
    x: _Operand
    y: _Operand
    a_t: bool  # the kernel's A reads x transposed
    b_t: bool
    a_shape: tuple[int, int]
    a_stride: tuple[int, int]
    b_shape: tuple[int, int]
    b_stride: tuple[int, int]
    rows: int
    cols: int
    reduced: int
    x_span: int  # elements each view spans from its storage offset (the storage check)
    y_span: int
    twin_span: int | None
    out_dtype: torch.dtype
    out_bytes: int
    device: torch.device


def _storage_check(g: _Geometry):
    """The per-call storage check of a plan's operands (and twin): one comparison each, the message only on
    failure."""
    x_name, y_name, x_span, y_span, twin_span = g.x.name, g.y.name, g.x_span, g.y_span, g.twin_span
    x_need, y_need = 2 * x_span, 2 * y_span

    def check(x, y, twin):
        if x.untyped_storage().nbytes() < 2 * x.storage_offset() + x_need:
            check_storage(x_name, x, x_span)
        if y.untyped_storage().nbytes() < 2 * y.storage_offset() + y_need:
            check_storage(y_name, y, y_span)
        if twin is not None:
            check_storage("twin_out", twin, twin_span)

    return check


def _arg_list(kernel, values: dict, dynamic: tuple[str, ...]) -> tuple[list, tuple[int, ...]]:
    """The kernel's arguments in its parameter order, as Triton's binder binds them (constexprs included): the
    plan's ``values``, with a None slot for each per-call argument in ``dynamic``; and those slots' positions."""
    names = list(kernel.arg_names)
    unknown = set(values) - set(names) | set(dynamic) - set(names)
    missing = [n for n in names if n not in values and n not in dynamic]
    if unknown or missing or set(values) & set(dynamic):
        raise RuntimeError(f"{kernel.fn.__name__}: a launch plan's arguments do not match the kernel's parameters "
                           f"(unknown {sorted(unknown)}, missing {missing})")
    return [values.get(name) for name in names], tuple(names.index(n) for n in dynamic)


def _ptr_launch(g: _Geometry, interpreted: bool, static: dict, constexprs: dict, options: dict, grid):
    """det_gemm_kernel: pointer loads over the caller's strides."""
    check, out_shape, out_dtype, device = _storage_check(g), (g.rows, g.cols), g.out_dtype, g.device
    a_t, b_t = g.a_t, g.b_t
    template, (i_a, i_b, i_c, i_twin) = _arg_list(det_gemm_kernel, {**static, **constexprs},
                                                  ("a_ptr", "b_ptr", "c_ptr", "twin_ptr"))
    if interpreted:
        def launch(x, y, twin):
            check(x, y, twin)
            c = torch.empty(out_shape, dtype=out_dtype, device=device)
            args = template.copy()
            args[i_a], args[i_b] = x.t() if a_t else x, y.t() if b_t else y
            args[i_c], args[i_twin] = c, c if twin is None else twin
            det_gemm_kernel[grid](*args, **options)
            return c
        return launch
    # Triton reads a tensor argument's data pointer (and dtype) only: the caller's tensors stand for their views.
    direct = DirectLaunch(det_gemm_kernel, grid, options, device)

    def launch(x, y, twin):
        check(x, y, twin)
        c = torch.empty(out_shape, dtype=out_dtype, device=device)
        args = template.copy()
        args[i_a], args[i_b], args[i_c], args[i_twin] = x, y, c, c if twin is None else twin
        direct(args)
        return c
    return launch


def _tma_launch(g: _Geometry, config: GemmConfig, step_k: int, interpreted: bool, static: dict, constexprs: dict,
                options: dict, grid):
    """det_gemm_tma_kernel / det_gemm_tma3_kernel: TMA descriptors over each operand in its storage order."""
    a_m_major, a_shape, a_strides, a_box = _descriptor_layout(g.x.name, g.x.shape, g.x.stride, 2, g.x.misalign,
                                                              g.a_shape, g.a_stride, (config.block_m, step_k),
                                                              config.variant)
    b_k_major, b_shape, b_strides, b_box = _descriptor_layout(g.y.name, g.y.shape, g.y.stride, 2, g.y.misalign,
                                                              g.b_shape, g.b_stride, (step_k, config.box_n),
                                                              config.variant)
    kernel = det_gemm_tma_kernel if config.variant == "tma" else det_gemm_tma3_kernel
    constexprs = {**constexprs, "A_M_MAJOR": a_m_major, "B_K_MAJOR": b_k_major}
    check, out_shape, out_dtype, device = _storage_check(g), (g.rows, g.cols), g.out_dtype, g.device
    template, (i_a, i_b, i_c, i_twin) = _arg_list(kernel, {**static, **constexprs},
                                                  ("a_desc", "b_desc", "c_ptr", "twin_ptr"))
    if interpreted:
        def launch(x, y, twin):
            check(x, y, twin)
            c = torch.empty(out_shape, dtype=out_dtype, device=device)
            args = template.copy()
            args[i_a] = TensorDescriptor(x, a_shape, a_strides, a_box)
            args[i_b] = TensorDescriptor(y, b_shape, b_strides, b_box)
            args[i_c], args[i_twin] = c, c if twin is None else twin
            kernel[grid](*args, **options)
            return c
        return launch
    direct = DirectLaunch(kernel, grid, options, device)

    def launch(x, y, twin):
        check(x, y, twin)
        ensure_thread_cuda_context(device)
        if direct.ready:  # the launcher encodes each descriptor from base, shape and strides
            a_desc, b_desc = host_descriptor(x, a_shape, a_strides), host_descriptor(y, b_shape, b_strides)
        else:  # the first launch specializes on real descriptors (their block shapes)
            a_desc = TensorDescriptor(x, a_shape, a_strides, a_box)
            b_desc = TensorDescriptor(y, b_shape, b_strides, b_box)
        c = torch.empty(out_shape, dtype=out_dtype, device=device)
        args = template.copy()
        args[i_a], args[i_b], args[i_c], args[i_twin] = a_desc, b_desc, c, c if twin is None else twin
        direct(args)
        return c
    return launch


# Scratch tensors the ws kernel's unused store descriptors point at when its epilogue stores from registers, one
# per (device, box, dtype), kept with their descriptors (the kernel never touches them).
_WS_SCRATCH: dict = {}


def _ws_scratch_descriptor(device: torch.device, box: list[int], dtype: torch.dtype):
    key = (device, tuple(box), dtype)
    if key not in _WS_SCRATCH:
        scratch = torch.empty(box, dtype=dtype, device=device)
        _WS_SCRATCH[key] = (scratch, ws_descriptor(scratch, list(scratch.shape), list(scratch.stride()), box))
    return _WS_SCRATCH[key][1]


def _ws_launch(g: _Geometry, config: GemmConfig, twin_on: bool, programs: int):
    """The warp-specialized Gluon kernel: one persistent program per SM (at most one per tile)."""
    a_m_major, a_shape, a_strides, a_box = _descriptor_layout(
        g.x.name, g.x.shape, g.x.stride, 2, g.x.misalign, g.a_shape, g.a_stride, (config.block_m, config.block_k), "ws")
    b_k_major, b_shape, b_strides, b_box = _descriptor_layout(
        g.y.name, g.y.shape, g.y.stride, 2, g.y.misalign, g.b_shape, g.b_stride, (config.block_k, config.block_n), "ws")
    rows, cols, out_dtype, device = g.rows, g.cols, g.out_dtype, g.device
    # The epilogue by TMA store when C's rows are 16-byte aligned and its tile buffer fits beside the ring; else
    # from registers (the same values either way). Without it the kernel still takes descriptors: ones over a
    # tile-sized scratch.
    box = [config.block_m // consumers(config.num_warps), config.block_n]
    tma_store = ws_tma_store(config.block_m, config.block_n, config.block_k, config.num_stages, cols, g.out_bytes)
    scratch = None if tma_store else _ws_scratch_descriptor(device, box, out_dtype)
    c_shape, c_strides = [rows, cols], [cols, 1]
    static = dict(R=rows, C=cols, L=g.reduced, stride_cr=cols, stride_cc=1, op_id=_OP_IDS[g.op],
                  BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                  STAGES=config.num_stages, OUT_FP32=out_dtype == torch.float32, TWIN=twin_on,
                  A_M_MAJOR=a_m_major, B_K_MAJOR=b_k_major, CONSUMERS=consumers(config.num_warps), TMA_STORE=tma_store)
    # num_warps: the default partition (one consumer warpgroup); maxnreg: the register cap the roles share.
    options = dict(num_warps=4, maxnreg=max_regs(config.num_warps))
    template, (i_a, i_b, i_c, i_twin, i_cd, i_td) = _arg_list(
        det_gemm_ws_kernel, static, ("a_desc", "b_desc", "c_ptr", "twin_ptr", "c_desc", "twin_desc"))
    direct = DirectLaunch(det_gemm_ws_kernel, (programs,), options, device)
    check = _storage_check(g)

    def launch(x, y, twin):
        check(x, y, twin)
        ensure_thread_cuda_context(device)
        c = torch.empty((rows, cols), dtype=out_dtype, device=device)
        store = c if twin is None else twin
        if direct.ready:  # the launcher encodes each descriptor from base, shape and strides
            a_desc, b_desc = host_descriptor(x, a_shape, a_strides), host_descriptor(y, b_shape, b_strides)
            if scratch is None:
                c_desc, twin_desc = host_descriptor(c, c_shape, c_strides), host_descriptor(store, c_shape, c_strides)
        else:  # the first launch specializes on real descriptors (block shapes and shared layouts)
            a_desc, b_desc = ws_descriptor(x, a_shape, a_strides, a_box), ws_descriptor(y, b_shape, b_strides, b_box)
            if scratch is None:
                c_desc = ws_descriptor(c, c_shape, c_strides, box)
                twin_desc = ws_descriptor(store, c_shape, c_strides, box)
        if scratch is not None:
            c_desc = twin_desc = scratch
        args = template.copy()
        args[i_a], args[i_b], args[i_c], args[i_twin] = a_desc, b_desc, c, store
        args[i_cd], args[i_td] = c_desc, twin_desc
        direct(args)
        return c
    return launch


def _launch(op: str, x, y, config, seg_len, out_dtype, twin_out):
    _check_options(config, seg_len, out_dtype)
    plan = _lookup(op, x, y, config, seg_len, out_dtype, twin_out)
    return plan.launch(x, y, twin_out), plan.record


def det_gemm_fwd_launch(a: torch.Tensor, b: torch.Tensor, *, config: GemmConfig | None = None,
                        seg_len: int | None = None, out_dtype: torch.dtype = torch.bfloat16,
                        twin_out: torch.Tensor | None = None):
    """``a [M,K] @ b [K,N]`` -> (``[M,N]``, GemmLaunch). ``b`` may be ``weight.t()``. ``config``: a GemmConfig
    (None: the table's pick); ``seg_len``: FP32 segments of the reduction; ``twin_out``: a second output that gets
    the same bits."""
    return _launch("fwd", a, b, config, seg_len, out_dtype, twin_out)


def det_gemm_da_launch(dc: torch.Tensor, b: torch.Tensor, *, config: GemmConfig | None = None,
                       seg_len: int | None = None, out_dtype: torch.dtype = torch.bfloat16,
                       twin_out: torch.Tensor | None = None):
    """``dc [M,N] @ b[K,N].T`` -> (``[M,K]``, GemmLaunch)."""
    return _launch("da", dc, b, config, seg_len, out_dtype, twin_out)


def det_gemm_db_launch(a: torch.Tensor, dc: torch.Tensor, *, config: GemmConfig | None = None,
                       seg_len: int | None = None, out_dtype: torch.dtype = torch.bfloat16,
                       twin_out: torch.Tensor | None = None):
    """``a[M,K].T @ dc [M,N]`` -> (``[K,N]``, GemmLaunch); reduces over M."""
    return _launch("db", a, dc, config, seg_len, out_dtype, twin_out)


_BF16 = torch.bfloat16


def det_gemm_fwd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M,K] @ b [K,N] -> [M,N]`` in BF16, deterministic and batch-invariant."""
    return _lookup("fwd", a, b, None, None, _BF16, None).launch(a, b, None)


def det_gemm_da(dc: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``dc [M,N] @ b.T -> [M,K]`` in BF16 (the input gradient), deterministic and batch-invariant."""
    return _lookup("da", dc, b, None, None, _BF16, None).launch(dc, b, None)


def det_gemm_db(a: torch.Tensor, dc: torch.Tensor) -> torch.Tensor:
    """``a.T @ dc -> [K,N]`` in BF16 (the weight gradient), deterministic, fixed order over M."""
    return _lookup("db", a, dc, None, None, _BF16, None).launch(a, dc, None)


# ---------------------------------------------------------------------------------------------
# Pure-torch references (FP32 accumulation, one BF16 rounding): what tests and audits compare to.
# ---------------------------------------------------------------------------------------------
def det_gemm_fwd_ref(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``a @ b`` in ``dtype`` (float32 or float64), unrounded."""
    return a.to(dtype) @ b.to(dtype)


def det_gemm_da_ref(dc: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dc.to(dtype) @ b.to(dtype).t()


def det_gemm_db_ref(a: torch.Tensor, dc: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return a.to(dtype).t() @ dc.to(dtype)


LAUNCHERS = {"fwd": det_gemm_fwd_launch, "da": det_gemm_da_launch, "db": det_gemm_db_launch}
REFERENCES = {"fwd": det_gemm_fwd_ref, "da": det_gemm_da_ref, "db": det_gemm_db_ref}
SUPPORTED_BACKENDS = (CUDA_SM90, TRITON_INTERPRETER)
