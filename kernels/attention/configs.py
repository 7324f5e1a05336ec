"""The attention family's pinned config table: one set of tiles and one split table per (backend, head_dim), never
a function of the sequence lengths, the batch or the padding; a row's keys per split are a function of its own key
extent alone (the invariance rule in kernels.py rests on both). Bump the version whenever an entry changes; reports
record it."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from detkit.kernels.backend import CUDA_SM90, TRITON_INTERPRETER

HEAD_DIMS = (64, 128, 256)

ATTENTION_CONFIG_TABLE_VERSION = "2026-12-08.1"

# Keys per split of the forward (split-KV), a pinned step function of each row's own key extent e: the keys from the
# sequence's first key (the anchor the key tiles count from) through the row's last visible key (its causal end).
# (largest e, keys per split) per tier, ascending; the last tier's bound None: every longer row. A row's keys are cut
# into splits of its tier's size from the anchor, each split reduced on its own and the splits folded in ascending
# order (kernels.py). e is a function of the row's position alone -- the same in prefill, chunked prefill, decode,
# padded, packed and paged calls, never of q_len, the batch, the padding or the grid -- so a row's bits still depend
# only on its own q and keys. Why tiers: the H100 decode sweep (reports/2026-12-06-h100-s30, call 5) had batch 1 at 1k
# keys at 0.99x flash with 256-key splits (1.37x at 512, 1.93x at 1024) and at 32k keys at 1.03x with 1024-key splits
# (1.57x at 256): no one size serves both. Each split a power of two and a multiple of the tier's before (so a
# larger split's boundaries are boundaries of every smaller one: the split grid's programs cut at the largest); each
# bound a multiple of the next tier's split (a bound falls on a split boundary of the tiers either side). These tiers on
# an H100 (reports/2026-12-06-h100-s31, call 1): every decode case at batch 1, 8, 64 and 1k-32k keys within 1.2x flash
# (worst 1.17x, batch 1 at 32k keys).
SPLIT_TIERS: tuple[tuple[int | None, int], ...] = ((2048, 256), (16384, 512), (None, 1024))
# The interpreter's: 1, 2 and 4 of its 16-key tiles, so CPU tests at a few dozen keys cross both bounds.
INTERPRETER_SPLIT_TIERS: tuple[tuple[int | None, int], ...] = ((32, 16), (64, 32), (None, 64))
# The kernels take up to three tiers (their bounds and splits are constexprs).
MAX_SPLIT_TIERS = 3
# A speed option (bits are the same either way): the forward runs one program per (query tile, split), combined by a
# second pass, when the one-program-per-query-tile grid would have fewer programs than this (two per SM on an H200).
SPLIT_GRID_BELOW = 2 * 132


@dataclass(frozen=True)
class AttnConfig:
    block_m: int  # query rows per tile: HEADS query heads x block_m / HEADS query positions
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for field, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"AttnConfig.{field} must be a positive int; got {value!r}")
        for field in ("block_m", "block_n"):
            value = getattr(self, field)
            if value < 16 or value & (value - 1):
                raise ValueError(f"AttnConfig.{field} must be a power of two >= 16 (one MMA); got {value}")

    def label(self) -> str:
        return f"BM{self.block_m}_BN{self.block_n}_w{self.num_warps}_s{self.num_stages}"


@dataclass(frozen=True)
class AttnConfigs:
    """The three kernels' tiles for one head_dim. fwd: block_m query rows x block_n keys per step. dkdv: a
    program owns block_n keys and steps over block_m query rows. dq: a program owns block_m query rows and
    steps over block_n keys. Only fwd's tile decides the forward bits (and so the invariance); the backward
    tiles decide the gradients' fixed reduction order."""
    fwd: AttnConfig
    dkdv: AttnConfig
    dq: AttnConfig
    # A speed option, off in the table until measured: when the forward grid would have fewer programs than this
    # (a small-batch decode step: B x Hkv programs), each program takes one query head instead of the group's
    # (the group's K/V tiles are then read by G programs, through the L2). A row's arithmetic is unchanged (same
    # tile, same key tiles, same update sequence; rows are independent), so its bits must be too; the sweep checks.
    split_heads_below: int = 0
    # Keys per split by the row's key extent (SPLIT_TIERS): decides the forward's bits, with fwd.block_n.
    split_tiers: tuple[tuple[int | None, int], ...] = SPLIT_TIERS
    # Speed only: below this many forward programs, run the split grid and its combine pass (0: never).
    split_grid_below: int = SPLIT_GRID_BELOW
    # Speed only: outside CUDA-graph capture, the split grid needs at least this many keys. Its second launch and
    # workspace cost host time an eager step spends before the GPU's work is queued (EAGER_SPLIT_GRID_MIN_KEYS);
    # a captured graph pays no host time.
    eager_split_grid_min_keys: int = 0
    # Speed only: the split grid's programs aimed at. A program takes ceil(splits / groups) consecutive launch splits
    # (the call's largest split), groups = max(1, split_grid_programs // the programs one split needs), each row's
    # split partials stored on their own (the same partials, so the same bits). 0: one launch split per program.
    split_grid_programs: int = 0
    # Speed only, the paged forward (K/V read through a block table): its pipeline stages (0: fwd.num_stages) and
    # whether its split grid groups splits as above (False: one split a program). The table's entries are one more
    # level of indirection: at fwd's stages Triton's pipeliner issues a paged program's K/V one key tile ahead, not
    # two (the waits in the offline sm_90 compile's TTGIR).
    paged_num_stages: int = 0
    paged_grouped: bool = False
    # Speed only, the paged forward: read one table entry a page a key tile touches (where a page holds whole tiles
    # or a tile whole pages: a page size that fwd.block_n divides or that divides it) instead of one a key. The same
    # K/V rows either way.
    paged_tile_page: bool = False
    # Speed only, with paged_tile_page: a program reads its first key tile's table entries before the sequence's
    # bounds (cu_seqlens), so the two loads' latencies overlap rather than add. The same entries.
    paged_early_pages: bool = False
    # Speed only, with paged_tile_page: each key tile's table entries read one tile ahead (the first tile's before
    # the loop), so no K/V load waits on a table load of its own step. The same entries. paged_prefetch_pages: in
    # every paged launch; paged_prefetch_below: in paged launches of fewer programs than this (at most a wave, where a
    # program's latency is the step's; with more programs the deeper pipeline's shared memory costs more than it hides).
    paged_prefetch_pages: bool = False
    paged_prefetch_below: int = 0

    def __post_init__(self):
        _check_split_tiers(self.split_tiers, self.fwd.block_n)
        if not isinstance(self.split_grid_below, int) or self.split_grid_below < 0:
            raise ValueError(f"AttnConfigs.split_grid_below must be an int >= 0; got {self.split_grid_below!r}")
        if not isinstance(self.split_grid_programs, int) or self.split_grid_programs < 0:
            raise ValueError(f"AttnConfigs.split_grid_programs must be an int >= 0; got {self.split_grid_programs!r}")
        if not isinstance(self.paged_num_stages, int) or isinstance(self.paged_num_stages, bool) \
                or self.paged_num_stages < 0:
            raise ValueError(f"AttnConfigs.paged_num_stages must be an int >= 0; got {self.paged_num_stages!r}")
        if not isinstance(self.paged_grouped, bool):
            raise ValueError(f"AttnConfigs.paged_grouped must be a bool; got {self.paged_grouped!r}")
        if not isinstance(self.paged_tile_page, bool):
            raise ValueError(f"AttnConfigs.paged_tile_page must be a bool; got {self.paged_tile_page!r}")
        if not isinstance(self.paged_early_pages, bool):
            raise ValueError(f"AttnConfigs.paged_early_pages must be a bool; got {self.paged_early_pages!r}")
        if not isinstance(self.paged_prefetch_pages, bool):
            raise ValueError(f"AttnConfigs.paged_prefetch_pages must be a bool; got {self.paged_prefetch_pages!r}")
        if not isinstance(self.paged_prefetch_below, int) or isinstance(self.paged_prefetch_below, bool) \
                or self.paged_prefetch_below < 0:
            raise ValueError(f"AttnConfigs.paged_prefetch_below must be an int >= 0; got {self.paged_prefetch_below!r}")
        if not isinstance(self.eager_split_grid_min_keys, int) or self.eager_split_grid_min_keys < 0:
            raise ValueError("AttnConfigs.eager_split_grid_min_keys must be an int >= 0; got "
                             f"{self.eager_split_grid_min_keys!r}")

    def label(self) -> str:
        split = f" split<{self.split_heads_below}" if self.split_heads_below else ""
        group = f", programs~{self.split_grid_programs}" if self.split_grid_programs else ""
        paged = (f", paged s{self.paged_stages}{' grouped' if self.paged_grouped else ''}"
                 f"{' tile-page' if self.paged_tile_page else ''}{' early' if self.paged_early_pages else ''}"
                 f"{self._prefetch_label()}")
        return (f"fwd {self.fwd.label()} dkdv {self.dkdv.label()} dq {self.dq.label()}{split} kv-split "
                f"{tiers_label(self.split_tiers)} (grid<{self.split_grid_below}, "
                f"eager keys>={self.eager_split_grid_min_keys}{group}{paged})")

    def _prefetch_label(self) -> str:
        """The table-entry prefetch (which needs paged_tile_page) as the label says it."""
        if not self.paged_tile_page:
            return ""
        if self.paged_prefetch_pages:
            return " prefetch"
        return f" prefetch<{self.paged_prefetch_below}" if self.paged_prefetch_below else ""

    @property
    def paged_stages(self) -> int:
        """The paged forward's pipeline stages: ``paged_num_stages``, or the forward's where that is 0."""
        return self.paged_num_stages or self.fwd.num_stages

    def split_of(self, extent: int) -> int:
        """Keys per split of a row whose key extent (keys from the sequence's first key through its last visible key)
        is ``extent``: its tier's."""
        return split_of(self.split_tiers, extent)

    @property
    def smallest_split(self) -> int:
        """The first tier's split: no row is cut into more splits than ceil(its keys / this) (+1 under a window)."""
        return self.split_tiers[0][1]


def _check_split_tiers(tiers, block_n: int) -> None:
    """Refuse a split table the kernels do not take, in one line naming it and what is supported."""
    supported = (f"supported: 1 to {MAX_SPLIT_TIERS} (largest e, keys per split) pairs, bounds ascending and the last "
                 f"None, each split a power of two >= fwd.block_n ({block_n}) and a multiple of the split before, "
                 "each bound a multiple of the next split")
    if (not isinstance(tiers, tuple) or not 1 <= len(tiers) <= MAX_SPLIT_TIERS
            or not all(isinstance(t, tuple) and len(t) == 2 for t in tiers)):
        raise ValueError(f"AttnConfigs.split_tiers {tiers!r} is not supported; {supported}")
    bounds, splits = [t[0] for t in tiers], [t[1] for t in tiers]
    ok = bounds[-1] is None and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in bounds[:-1])
    ok = ok and all(isinstance(s, int) and not isinstance(s, bool) and s >= block_n and not s & (s - 1)
                    for s in splits)
    ok = ok and all(b > a for a, b in zip(splits, splits[1:]))  # powers of two: each a multiple of the one before
    ok = ok and all(b > a for a, b in zip(bounds[:-2], bounds[1:-1]))
    ok = ok and all(b % s == 0 for b, s in zip(bounds[:-1], splits[1:]))
    if not ok:
        raise ValueError(f"AttnConfigs.split_tiers {tiers!r} is not supported; {supported}")


def split_of(tiers: tuple[tuple[int | None, int], ...], extent: int) -> int:
    """Keys per split of ``tiers`` (``AttnConfigs.split_tiers``) for a row of key extent ``extent``."""
    return next(split for bound, split in tiers if bound is None or extent <= bound)


def tiers_label(tiers: tuple[tuple[int | None, int], ...]) -> str:
    """``2048:256/16384:512/1024``: each tier's largest key extent and split, the last (open-ended) its split alone;
    the form ``parse_tiers`` reads."""
    return "/".join(str(split) if bound is None else f"{bound}:{split}" for bound, split in tiers)


def parse_tiers(text: str) -> tuple[tuple[int | None, int], ...]:
    """``tiers_label``'s form back to a tier table (``512``: one split for every row); a ValueError (one line) for
    text of another form. The table's own rules are checked where it is used (``AttnConfigs``)."""
    parts = text.split("/")
    try:
        tiers = tuple((int(p.split(":")[0]), int(p.split(":")[1])) if ":" in p else (None, int(p)) for p in parts)
    except (ValueError, IndexError):
        tiers = ()
    if not tiers or any(p.count(":") > 1 for p in parts) or ":" in parts[-1] or any(":" not in p for p in parts[:-1]):
        raise ValueError(f"split tiers {text!r} are not supported; supported: BOUND:SPLIT/.../SPLIT, e.g. "
                         "2048:256/16384:512/1024 (the last tier open-ended), or one SPLIT")
    return tiers


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints (``triton.cdiv`` is a JIT function: called on the host it costs ~2 µs, this ~0.05)."""
    return -(-a // b)


def fwd_heads(configs: AttnConfigs, group: int, heads_kv: int, batch: int, seq_q: int) -> int:
    """Query heads per forward tile: the whole group (``heads_per_tile``), or one when ``split_heads_below`` asks
    for more programs."""
    heads = heads_per_tile(group, configs.fwd.block_m)
    if configs.split_heads_below and heads > 1:
        programs = cdiv(seq_q, configs.fwd.block_m // heads) * heads_kv * (group // heads) * batch
        if programs < configs.split_heads_below:
            heads = 1
    return heads


# sm_90: eager decode steps below this many keys run one pass. Through the launch plans the split grid's host time is
# a few µs above the one pass's (H100: 51-53 against 46-48 µs per decode call, reports/2026-12-07-h100-s32 call 2),
# while one pass at batch 1-8 leaves most SMs idle from a few thousand keys on (batch 1 at 8k keys: 4.39x SDPA flash
# eager, 0.93x on the split grid under a graph): below 2048 keys one pass is the shorter GPU time and the step is
# host-bound either way.
EAGER_SPLIT_GRID_MIN_KEYS = 2048
# sm_90: the split grid aims at about one program per SM: a program takes a run of consecutive splits (speed only), so
# a batch-1 step at 32k keys runs 128 programs of two 1024-key splits. The H100 decode sweep
# (reports/2026-12-06-h100-s28) had that step at 1.93x flash with one 512-key split per program (512 programs of 8 key
# tiles) and at 1.01-1.05x with 128 programs of 2048 keys.
SPLIT_GRID_PROGRAMS = 128
# sm_90, D=128: paged launches of fewer programs than one per SM read each key tile's table entries a tile ahead. H100
# (reports/2026-12-08-h100-s39 call 1; ratio to the padded contiguous step, pages of 256 / 16, without -> with):
# B1 1k (8 programs) 1.20 / 1.23 -> 1.07 / 1.11, B1 8k (128) 1.17 / 1.19 -> 1.03 / 1.07; B8 8k (1024) 1.03 / 1.05 ->
# 1.09 / 1.14 and B1 32k (256) 0.94 / 0.94 -> 1.04 / 1.08 are slower with it.
PAGED_PREFETCH_BELOW = 132


# Keyed by backend, then head_dim. The sm_90 entries are the fastest spill-free candidates of the H200 sweep
# (tools/gpu/attention.sh; CUDA-graph time beside SDPA flash, geometric mean over prefill B1 S4096, prefill B8 S1024,
# decode at B1 K32768, B8 K8192, B64 K8192, and fwd+bwd B1 S4096; 0 decode-vs-prefill bit mismatches): the forward
# on 64x64 tiles, 4 warps, 3 stages (twice the programs of 128-row tiles: a decode step is grid-bound); dk/dv on
# 32x128 (D=128) and 64x64 (D=64) query x key tiles, 3 stages; dq on 128x64, 3 stages. D=256 (Gemma-2/3), chosen
# offline (tools/attention_sass.py; not yet timed on a GPU): register pressure halves the key tile. fwd 64x32, 8 warps,
# 2 stages (152 registers, no spill, also with window + softcap + sinks); dq 128x32, 8 warps, 2 stages (no spill);
# dk/dv 32x64, 8 warps, 2 stages: every wgmma candidate spills there (the program holds dk and dv [64, 256] in FP32),
# this one least (176 bytes; 64x32 would run mma.sync). The paged forward keeps the forward's stages and one split a
# program (in the H100 sweep of its stages (3, 5, 6) and grouping no setting was faster at every paged case) and reads
# one table entry a page a key tile touches, the first tile's before the sequence's bounds (each faster than without
# it at every H100 case measured, or within its spread); at D=128 a launch of fewer programs than SMs reads them a
# tile ahead (PAGED_PREFETCH_BELOW; D=64 and 256 not measured). The
# interpreter entries are small so CPU tests at a few dozen keys cross several key tiles, splits and query tiles; its
# split grid runs below 8 programs (a test's decode step), so the default path of a CPU decode step is the split grid
# and that of its prefill the one-pass grid; paged launches below 4 programs prefetch their table entries, so CPU tests
# run both paged paths.
CONFIG_TABLE: dict[str, dict[int, AttnConfigs]] = {
    CUDA_SM90: {
        64: AttnConfigs(fwd=AttnConfig(64, 64, 4, 3), dkdv=AttnConfig(64, 64, 4, 3), dq=AttnConfig(128, 64, 4, 3),
                        eager_split_grid_min_keys=EAGER_SPLIT_GRID_MIN_KEYS, split_grid_programs=SPLIT_GRID_PROGRAMS,
                        paged_tile_page=True, paged_early_pages=True),
        128: AttnConfigs(fwd=AttnConfig(64, 64, 4, 3), dkdv=AttnConfig(32, 128, 8, 3), dq=AttnConfig(128, 64, 8, 3),
                         eager_split_grid_min_keys=EAGER_SPLIT_GRID_MIN_KEYS, split_grid_programs=SPLIT_GRID_PROGRAMS,
                         paged_tile_page=True, paged_early_pages=True, paged_prefetch_below=PAGED_PREFETCH_BELOW),
        256: AttnConfigs(fwd=AttnConfig(64, 32, 8, 2), dkdv=AttnConfig(32, 64, 8, 2), dq=AttnConfig(128, 32, 8, 2),
                         eager_split_grid_min_keys=EAGER_SPLIT_GRID_MIN_KEYS, split_grid_programs=SPLIT_GRID_PROGRAMS,
                         paged_tile_page=True, paged_early_pages=True),
    },
    TRITON_INTERPRETER: {
        d: AttnConfigs(fwd=AttnConfig(16, 16, 4, 1), dkdv=AttnConfig(16, 16, 4, 1), dq=AttnConfig(16, 16, 4, 1),
                       split_tiers=INTERPRETER_SPLIT_TIERS, split_grid_below=8, split_grid_programs=2,
                       paged_tile_page=True, paged_early_pages=True, paged_prefetch_below=4)
        for d in HEAD_DIMS
    },
}


def select_configs(backend: str, head_dim: int) -> AttnConfigs:
    """The pinned tiles for ``head_dim`` on ``backend``: never a function of the sequence lengths or the batch."""
    if backend not in CONFIG_TABLE:
        raise ValueError(f"backend {backend!r} is not supported; supported: {tuple(CONFIG_TABLE)}")
    if head_dim not in CONFIG_TABLE[backend]:
        raise ValueError(f"head_dim {head_dim} is not supported; supported: {HEAD_DIMS}")
    return CONFIG_TABLE[backend][head_dim]


@functools.lru_cache(maxsize=None)
def heads_per_tile(group: int, block_m: int) -> int:
    """Query heads of one KV group packed into a tile's rows: the largest divisor of ``group`` <= block_m. A
    function of the model (group size) and the pinned tile only."""
    return max(h for h in range(1, min(group, block_m) + 1) if group % h == 0)
