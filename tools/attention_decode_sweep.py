"""Decode sweep of the attention forward (kernels/attention; issue #50): candidate forward tiles, key-split sizes and
split-grid / split-heads thresholds, timed beside SDPA flash at decode, prefill and paged-decode shapes, with each
candidate's decode-vs-prefill bits. Not autotuning: a person reads the table and pins an entry in
kernels/attention/configs.py. New split tiers or a new fwd.block_n change the forward's bits (a table version bump);
num_warps, num_stages, split_heads_below and split_grid_below are speed only.

    python -m tools.attention_decode_sweep warm --workers 15 --head-dims 128        # Triton's cache, in parallel
    python -m tools.attention_decode_sweep sweep --device cuda --head-dims 128 --out DIR --budget-s 150
    python -m tools.attention_decode_sweep sweep ... --grid split_tiers=512,2048:256/16384:512/1024 --grid num_warps=4
    python -m tools.attention_decode_sweep sweep --device cpu --tiny --out DIR      # interpreter plumbing only

tools/gpu/attention_decode_sweep.sh runs both on one H100 or H200.

Candidates (``candidates``): the pinned table's entry first, then every combination of the grid (``gpu_grid``) in a
fixed pseudo-random order (a run its budget stops has sampled the whole grid), passed to the launch functions as
``configs=`` (no table is changed); the backward tiles and the eager threshold stay pinned. A candidate that does
not build or launch gets an error (its bits check's; it is then not timed), one that fails a case (validation,
capture) an error in that case's cell; never a crash.

Per candidate:
- bits (``bits_check``): a batch of sequences at the case heads (GPU: 2 sequences past the grid's largest tier bound
  by one of its largest splits, and past two of those splits, plus 300 keys: 17708 keys at the pinned tiers); the
  candidate's prefill, then decode steps at its tile and split boundaries, at each tier bound (the last key extent of
  a tier and the first of the next) and the last position, a paged decode
  step (pages of 16) at the last position, and (GPU) a chunked prefill of 300-query chunks, each against the
  prefill's rows, bit for bit (raw bits, toolkit.contract). The eager threshold is lifted
  (eager_split_grid_min_keys=0) so each step runs the grid a CUDA graph runs. A candidate counts only with 0
  mismatches. ``same_bits_as_pinned``: its prefill's bits equal the pinned table's (else pinning it is a table
  version bump).
- times: CUDA-graph replay time per call (toolkit.timing.time_graphs: operand sets rotated past the L2, median with
  p20/p80), interleaved in the same rounds with SDPA flash on the same tensors: decode B1/B8/B64 x 1k/8k/32k keys,
  prefill B1 S4096 and B8 S1024, and the paged decode (attention_paged's kernel, the cache in shuffled pages of 16)
  at B1 1k and B1/B8 x 8k/32k keys against SDPA flash on the contiguous cache. Every output is first validated
  against SDPA's (finite, max |diff| <= bench.attention.VALIDATION_ATOL). Candidates run in chunks of ``CHUNK``,
  each chunk with its own SDPA samples in its rounds: a chunk's graphs hold their outputs and split-grid workspaces.
- ratio = candidate time / SDPA time of the same rounds; ``geomean_ratio`` over the decode, prefill and paged cases;
  ``worst_decode_ratio`` over the nine decode cases (target: each <= 1.2), ``worst_prefill_ratio`` (<= 1.1),
  ``worst_paged_ratio``.
Finalists: the ``--finalists`` best candidates and the pinned one are also timed at fwd+bwd B1 S4096 (the forward's
tile is part of a training step; target <= 1.2).
Best: the lowest worst decode ratio among candidates whose bits are equal, whose every case was timed and whose
prefill ratios are all <= 1.1 (ties: the geometric mean); its fwd+bwd ratio is reported beside it.

Writes decode_sweep.json (meta, the best per head dim, one entry per candidate with its bits and every case's times
and ratio) and decode_sweep.md (the pick, the finalists, every candidate's ratios, the errors) after every chunk.
Exits 1 when a candidate's decode differs from its prefill (the invariance broken) or the pinned entry fails.

On the CPU (``--device cpu --tiny``) the kernels run in the Triton interpreter at tiny shapes against torch's CPU
SDPA: the timings are wall clock of CPU emulation (no CUDA graphs) and say nothing about GPU speed; the bits are the
interpreter's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from detkit.bench.attention import (
    TARGETS,
    VALIDATION_ATOL,
    BenchCase,
    _graph_sets,
    detkit_call,
    make_inputs,
    paged_cache,
    sdpa_call,
    sdpa_gqa_mode,
)
from detkit.toolkit.contract import compare_bits
from detkit.toolkit.reports import markdown_table
from detkit.toolkit.timing import call_refusal, time_graphs

if TYPE_CHECKING:  # the kernels load when a sweep runs (after the caller chose the interpreter or the compiler)
    from detkit.kernels.attention import AttnConfigs

CHUNK = 16  # candidates per interleaved timing (plus SDPA): bounds the memory the captured graphs hold
FINALISTS = 6
BIG = 1 << 30  # a threshold no grid reaches: forces the split grid / one head per tile in ``warm``
INTERPRETER_LABEL = ("triton_interpreter: wall clock of CPU emulation at tiny shapes against torch's CPU SDPA (no "
                     "CUDA graphs); NOT a hardware result, ratios say nothing about GPU speed")


@dataclass(frozen=True)
class Shapes:
    """The cases (batch, keys) of each mode at (heads_q, heads_kv), and the bits check's sequence."""
    heads: tuple[int, int]
    decode: tuple[tuple[int, int], ...]  # (batch, keys), one query per sequence
    prefill: tuple[tuple[int, int], ...]  # (batch, seq)
    paged: tuple[tuple[int, int], ...]  # (batch, keys)
    fwd_bwd: tuple[tuple[int, int], ...]  # (batch, seq): finalists only
    page_size: int
    bits_batch: int
    bits_splits: int  # the bits check's sequence: this many of the largest splits, plus bits_extra keys
    bits_extra: int
    bits_bounds: bool  # and at least one largest split past the largest tier bound (plus bits_extra)
    chunk: int  # the bits check's chunked prefill: chunks of this many queries (0: none)


# Qwen3-8B attention heads (32 query heads on 8 KV heads); the decode grid.
GPU_SHAPES = Shapes(heads=(32, 8), decode=tuple((b, k) for k in (1024, 8192, 32768) for b in (1, 8, 64)),
                    prefill=((1, 4096), (8, 1024)), paged=((1, 1024), *((b, k) for k in (8192, 32768) for b in (1, 8))),
                    fwd_bwd=((1, 4096),), page_size=16, bits_batch=2, bits_splits=2, bits_extra=300, bits_bounds=True,
                    chunk=300)
# One group of 4 (Qwen3-8B's group size), keys across several of the interpreter's 16-key tiles and splits; as few
# and as short as that allows (each interpreted call takes a fraction of a second); no chunked prefill.
TINY_SHAPES = Shapes(heads=(4, 1), decode=((1, 24), (2, 40)), prefill=((1, 24),), paged=((2, 40),),
                     fwd_bwd=((1, 16),), page_size=16, bits_batch=1, bits_splits=1, bits_extra=5, bits_bounds=False,
                     chunk=0)


@dataclass(frozen=True)
class Grid:
    """The values swept; a candidate is one of each (``candidates``)."""
    split_tiers: tuple[tuple[tuple[int | None, int], ...], ...]  # AttnConfigs.split_tiers tables
    block_m: tuple[int, ...]
    block_n: tuple[int, ...]
    num_warps: tuple[int, ...]
    num_stages: tuple[int, ...]
    split_heads_below: tuple[int, ...]
    split_grid_below: tuple[int, ...]
    # The paged forward's stages (0: the forward's), split grouping and one table entry a key tile (0 / 1): speed
    # only, paged cases alone.
    paged_num_stages: tuple[int, ...] = (0,)
    paged_grouped: tuple[int, ...] = (0,)
    paged_tile_page: tuple[int, ...] = (0,)
    paged_prefetch_pages: tuple[int, ...] = (0,)  # each tile's table entries a tile ahead (0 / 1), with tile_page
    # Time the pinned entry with one split a program beside it (where the table groups the split grid's splits).
    ungrouped: bool = False


# ``--grid FIELD=V,V``: the sm_90 grid's values replaced field by field (e.g. only the split tiers swept, the rest at
# the pinned tile); set by ``main`` and handed to the warm workers on their command line.
GRID_OVERRIDES: dict[str, tuple] = {}


def parse_grid_override(text: str) -> tuple[str, tuple]:
    """``FIELD=V,V`` -> (field, values), or a one-line error naming the text and the fields. Integer values, but
    ``split_tiers``: tables as ``configs.tiers_label`` writes them (``2048:256/16384:512/1024``; ``512`` is one split
    for every row)."""
    from detkit.kernels.attention.configs import parse_tiers

    fields = [f for f in Grid.__dataclass_fields__ if f != "ungrouped"]
    name, _, values = text.partition("=")
    try:
        parsed = tuple((parse_tiers if name == "split_tiers" else int)(v) for v in values.split(","))
    except ValueError:
        parsed = ()
    if name not in fields or not parsed:
        raise argparse.ArgumentTypeError(f"--grid {text!r} is not supported; supported: FIELD=V[,V...] with integer "
                                         "values (split_tiers: BOUND:SPLIT/.../SPLIT tables), FIELD one of "
                                         f"{fields}")
    return name, parsed


def grid_override_text(field: str, values: tuple) -> str:
    """``parse_grid_override``'s text for (field, values)."""
    from detkit.kernels.attention.configs import tiers_label

    return f"{field}={','.join(tiers_label(v) if field == 'split_tiers' else str(v) for v in values)}"


def gpu_grid(head_dim: int, sms: int, pinned: AttnConfigs) -> Grid:
    grid = _gpu_grid(head_dim, sms, pinned)
    return replace(grid, **GRID_OVERRIDES) if GRID_OVERRIDES else grid


def _gpu_grid(head_dim: int, sms: int, pinned: AttnConfigs) -> Grid:
    """sm_90. Split tiers: the pinned table and two neighbours (the step to 1024 keys from 8k keys; 2048-key splits
    past 16k keys). BLOCK_M 128 packs a group of 4 query heads x 32 positions (heads_per_tile); not at head_dim 256,
    whose [128, 256] FP32 accumulator alone is 256 registers a thread at 4 warps. BLOCK_N 32/64 at head_dim 256 (the pinned
    64x32 tile and its neighbour: register pressure). split_heads_below: off, or two programs per SM (264 on 132
    SMs); split_grid_below: the pinned threshold, or four programs per SM (which puts batch-64 decode, 512 programs
    at Qwen3-8B heads, on the split grid)."""
    wide = head_dim <= 128
    grid_below = tuple(dict.fromkeys((pinned.split_grid_below, 4 * sms)))  # one value where they agree
    return Grid(split_tiers=(pinned.split_tiers, ((2048, 256), (8192, 512), (None, 1024)),
                             ((4096, 256), (16384, 512), (None, 2048))), block_m=(64, 128) if wide else (64,),
                block_n=(64, 128) if wide else (32, 64), num_warps=(4, 8), num_stages=(2, 3, 4),
                split_heads_below=(0, 2 * sms), split_grid_below=grid_below,
                paged_num_stages=(pinned.paged_num_stages,), paged_grouped=(int(pinned.paged_grouped),),
                paged_tile_page=(int(pinned.paged_tile_page),),
                paged_prefetch_pages=(int(pinned.paged_prefetch_pages),), ungrouped=True)


def tiny_grid(pinned: AttnConfigs) -> Grid:
    """The interpreter: its 16-row tiles, one key tile a split for every row and its split tiers, and split heads
    off or on (a decode step of a test's size has fewer than 8 programs)."""
    return Grid(split_tiers=(((None, 16),), pinned.split_tiers), block_m=(16,), block_n=(16,), num_warps=(4,),
                num_stages=(1,),
                split_heads_below=(0, 8), split_grid_below=(pinned.split_grid_below,),
                paged_num_stages=(pinned.paged_num_stages,), paged_grouped=(int(pinned.paged_grouped),),
                paged_tile_page=(int(pinned.paged_tile_page),),
                paged_prefetch_pages=(int(pinned.paged_prefetch_pages),))


@dataclass(frozen=True)
class Candidate:
    head_dim: int
    configs: AttnConfigs
    pinned: bool = False

    @property
    def label(self) -> str:
        from detkit.kernels.attention.configs import tiers_label

        c = self.configs
        group = f" programs~{c.split_grid_programs}" if c.split_grid_programs else ""
        paged = (f" paged s{c.paged_stages}{'g' if c.paged_grouped else ''}{'t' if c.paged_tile_page else ''}"
                 f"{'e' if c.paged_early_pages else ''}{'p' if c.paged_prefetch_pages else ''}")
        return (f"{c.fwd.label()} split{tiers_label(c.split_tiers)} heads<{c.split_heads_below} "
                f"grid<{c.split_grid_below}{group}{paged}")

    def as_row(self) -> dict:
        from detkit.kernels.attention.configs import tiers_label

        c = self.configs
        return {"head_dim": self.head_dim, "candidate": self.label, "pinned": self.pinned, "fwd": asdict(c.fwd),
                "split_tiers": tiers_label(c.split_tiers), "split_heads_below": c.split_heads_below,
                "split_grid_below": c.split_grid_below, "split_grid_programs": c.split_grid_programs,
                "eager_split_grid_min_keys": c.eager_split_grid_min_keys, "paged_num_stages": c.paged_num_stages,
                "paged_grouped": c.paged_grouped, "paged_tile_page": c.paged_tile_page,
                "paged_early_pages": c.paged_early_pages, "paged_prefetch_pages": c.paged_prefetch_pages}


def candidates(head_dim: int, backend: str, grid: Grid, spread: bool = False) -> list[Candidate]:
    """The pinned entry, the pinned entry with one split a program (``grid.ungrouped``, where the table groups
    splits: the grouping's effect measured first), then every combination of ``grid`` (the pinned one once) with the pinned backward tiles
    and grouping: in the grid's order, or (``spread``) in a fixed pseudo-random order, so that a sweep its budget
    stops has sampled the whole grid rather than its first split size."""
    from detkit.kernels.attention import AttnConfig
    from detkit.kernels.attention.configs import select_configs

    pinned = select_configs(backend, head_dim)
    rest = []
    for split, bm, bn, warps, stages, heads, below, paged_stages, paged_grouped, tile_page, prefetch in (
            itertools.product(grid.split_tiers, grid.block_m, grid.block_n, grid.num_warps, grid.num_stages,
                              grid.split_heads_below, grid.split_grid_below, grid.paged_num_stages, grid.paged_grouped,
                              grid.paged_tile_page, grid.paged_prefetch_pages)):
        cfg = replace(pinned, fwd=AttnConfig(bm, bn, warps, stages), split_tiers=split, split_heads_below=heads,
                      split_grid_below=below, paged_num_stages=paged_stages, paged_grouped=bool(paged_grouped),
                      paged_tile_page=bool(tile_page), paged_prefetch_pages=bool(prefetch))
        if cfg != pinned:
            rest.append(Candidate(head_dim, cfg))
    if spread:
        random.Random(0).shuffle(rest)
    ungrouped = ([Candidate(head_dim, replace(pinned, split_grid_programs=0))]
                 if grid.ungrouped and pinned.split_grid_programs else [])
    return [Candidate(head_dim, pinned, pinned=True), *ungrouped, *rest]


@dataclass(frozen=True)
class Case:
    label: str
    kind: str  # decode | prefill | paged | fwd_bwd
    bench: BenchCase  # what runs (inputs, detkit's call)
    baseline: BenchCase  # SDPA's call on the same tensors (paged: the contiguous decode)


def cases(shapes: Shapes, head_dim: int, kinds=("decode", "prefill", "paged")) -> list[Case]:
    hq, hkv = shapes.heads
    out = []
    for kind in kinds:
        for batch, n in getattr(shapes, kind):
            if kind == "decode":
                c = BenchCase("decode", batch, 1, n, hq, hkv, head_dim)
                out.append(Case(f"decode B{batch} K{n}", kind, c, c))
            elif kind == "paged":
                c = BenchCase("paged_decode", batch, 1, n, hq, hkv, head_dim, page_size=shapes.page_size)
                out.append(Case(f"paged B{batch} K{n}", kind, c, replace(c, mode="decode", page_size=None)))
            else:
                c = BenchCase("fwd_bwd" if kind == "fwd_bwd" else "prefill", batch, n, n, hq, hkv, head_dim)
                out.append(Case(f"{kind} B{batch} S{n}", kind, c, c))
    return out


# ---------------------------------------------------------------------------------------------
# Bits
# ---------------------------------------------------------------------------------------------
def bits_keys(shapes: Shapes, grid: Grid) -> int:
    """Past ``bits_splits`` of the grid's largest splits and (``bits_bounds``) one of them past its largest tier bound,
    so that rows of every tier are checked, not a multiple of a tile."""
    largest = max(split for tiers in grid.split_tiers for _, split in tiers)
    bounds = [bound for tiers in grid.split_tiers for bound, _ in tiers if bound is not None]
    past_bounds = max(bounds, default=0) + largest if shapes.bits_bounds else 0
    return max(shapes.bits_splits * largest, past_bounds) + shapes.bits_extra


def bits_inputs(shapes: Shapes, head_dim: int, keys: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(5)
    hq, hkv = shapes.heads
    q = torch.randn(shapes.bits_batch, hq, keys, head_dim, device=device, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(shapes.bits_batch, hkv, keys, head_dim, device=device, generator=g).to(torch.bfloat16)
            for _ in range(2))
    return q, k, v


def bits_positions(configs, keys: int) -> list[int]:
    """Decode positions (a step at position i sees keys 0..i, its key extent i + 1): the first key, the end of the
    first key tile, the ends of each tier's first two splits (one key either side), each tier bound's last row and
    the next tier's first, and the last key."""
    n = configs.fwd.block_n
    want = {0, n - 1, n, keys - 1}
    for bound, s in configs.split_tiers:
        want |= {s - 1, s, s + 1, 2 * s - 1, 2 * s}
        if bound is not None:
            want |= {bound - 1, bound}
    return sorted(i for i in want if 0 <= i < keys)


def bits_check(candidate: Candidate, inputs, pinned_full: torch.Tensor | None, shapes: Shapes
               ) -> tuple[dict, torch.Tensor]:
    """(row, prefill output): the candidate's decode steps, paged decode step and chunked prefill against its own
    prefill, bit for bit; ``same_bits_as_pinned`` when ``pinned_full`` (the pinned entry's prefill) is given."""
    from detkit.kernels.attention import attention, attention_paged
    from detkit.kernels.attention.launch import Sequences, uses_split_grid

    cfg = replace(candidate.configs, eager_split_grid_min_keys=0)  # eager steps on the grid a CUDA graph runs
    q, k, v = inputs
    batch, hq, keys, _ = q.shape
    hkv = k.shape[1]
    full = attention(q, k, v, configs=cfg)
    mismatches, elements, first, grids = 0, 0, None, set()

    def tally(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        nonlocal mismatches, elements, first
        r = compare_bits(got, want)
        mismatches += r.mismatches
        elements += r.elements
        if first is None and not r.equal:
            first = f"{what}: {r.mismatches}/{r.elements} differ, first at {r.first_mismatch}"

    def grid_of(seqs) -> str:
        return "split" if uses_split_grid(cfg, seqs, hq, hkv, capturing=False) else "one_pass"

    for i in bits_positions(cfg, keys):
        tally(f"decode at {i}", attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], configs=cfg),
              full[:, :, i:i + 1])
        grids.add(grid_of(Sequences(False, batch, 1, i + 1, None, None)))
    g = torch.Generator(device=q.device).manual_seed(6)
    paged = paged_cache(q[:, :, -1:], k, v, shapes.page_size, g)
    got = attention_paged(paged["q_packed"], paged["k_cache"], paged["v_cache"], paged["block_table"],
                          paged["cu_q"], paged["cu_k"], 1, keys, configs=cfg)
    tally(f"paged decode at {keys - 1}", got, full[:, :, -1])
    checks = [f"decode at {bits_positions(cfg, keys)}", f"paged decode at {keys - 1}"]
    if shapes.chunk:
        c = shapes.chunk
        parts = [attention(q[:, :, a:a + c], k[:, :, :a + c], v[:, :, :a + c], configs=cfg) for a in range(0, keys, c)]
        tally(f"chunked prefill ({c})", torch.cat(parts, 2), full)
        checks.append(f"chunked prefill of {c}")
    row = {"bits_ok": mismatches == 0, "bit_mismatches": mismatches, "bit_elements": elements,
           "decode_grids": sorted(grids), "bits_keys": keys, "bits_checks": checks}
    if first:
        row["first_mismatch"] = first
    if pinned_full is not None:
        row["same_bits_as_pinned"] = compare_bits(full, pinned_full).equal
    return row, full


# ---------------------------------------------------------------------------------------------
# Times
# ---------------------------------------------------------------------------------------------
def _first(result) -> torch.Tensor:
    return result if isinstance(result, torch.Tensor) else result[0]


def _invalid(out, ref: torch.Tensor) -> str | None:
    """Why a candidate's output does not validate against SDPA's (None: it does)."""
    a, b = _first(out).detach().float(), _first(ref).detach().float()
    a = a.reshape(b.shape)  # paged: [B, Hq, D] against [B, Hq, 1, D]
    if not bool(torch.isfinite(a).all()):
        return "invalid: non-finite output"
    diff = float((a - b).abs().max())
    return None if diff <= VALIDATION_ATOL else f"invalid: max |diff| vs SDPA {diff:.3g} > {VALIDATION_ATOL:.3g}"


def time_case(case: Case, chunk: list[Candidate], device: torch.device, rounds: int, replays: int
              ) -> tuple[dict, dict]:
    """({candidate label: cell}, the case's run info) for one case: each candidate validated, then all of them and
    SDPA in one interleaved CUDA-graph timing. A cell holds the times and ratio, or ``error``; a case that fails as a
    whole (its inputs do not fit, SDPA refuses) gives every candidate its error."""
    info = {"mode": case.bench.mode, "batch": case.bench.batch, "seq_q": case.bench.seq_q,
            "seq_k": case.bench.seq_k, "page_size": case.bench.page_size,
            "graph_sets": _graph_sets(case.bench) if device.type == "cuda" else 1}
    try:
        cells = _time_case(case, chunk, device, rounds, replays, info)
    except Exception as exc:  # noqa: BLE001 - reported in every cell of the case
        cells = {c.label: {"error": f"case failed: {call_refusal(exc)}"} for c in chunk}
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the case's inputs and graphs are gone: the next case's may need the memory
    return cells, info


def _time_case(case: Case, chunk: list[Candidate], device: torch.device, rounds: int, replays: int,
               info: dict) -> dict:
    sets = info["graph_sets"]
    inputs = make_inputs(case.bench, device, sets)
    gqa = info["sdpa_gqa"] = sdpa_gqa_mode(case.baseline, inputs[0])
    sdpa_calls = [sdpa_call(case.baseline, inp, gqa) for inp in inputs]
    ref = sdpa_calls[0]()
    fns = {"sdpa": lambda: [f() for f in sdpa_calls]}
    errors: dict[str, str] = {}
    for cand in chunk:
        try:
            calls = [detkit_call(case.bench, inp, cand.configs) for inp in inputs]
            why = _invalid(calls[0](), ref)
        except Exception as exc:  # noqa: BLE001 - a candidate that does not build or launch is a row, not a crash
            why = call_refusal(exc)
        if why:
            errors[cand.label] = why
        else:
            fns[cand.label] = lambda calls=calls: [f() for f in calls]
    del ref
    try:
        times = time_graphs(fns, device, calls_per_fn=sets, rounds=rounds, replays=replays, errors=errors)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: every candidate of the chunk gets the error
        times, why = {}, call_refusal(exc)
        errors.update({c.label: why for c in chunk if c.label not in errors})
    base = times.get("sdpa")
    out = {}
    for cand in chunk:
        t = times.get(cand.label)
        if t is None or base is None:
            out[cand.label] = {"error": errors.get(cand.label) or errors.get("sdpa") or "not timed"}
            continue
        out[cand.label] = {"us": round(t.median_us, 2), "p20_us": round(t.p20_us, 2), "p80_us": round(t.p80_us, 2),
                           "sdpa_us": round(base.median_us, 2), "sdpa_p20_us": round(base.p20_us, 2),
                           "sdpa_p80_us": round(base.p80_us, 2), "ratio": round(t.median_us / base.median_us, 4),
                           "sm_clock_mhz": t.sm_clock_mhz}
    return out


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------
def summarize(row: dict, case_list: list[Case]) -> dict:
    """The candidate's ratios per kind: geometric mean over the decode, prefill and paged cases, the worst of each
    kind; ``complete``: every one of those cases timed."""
    ratio = {c.label: row["cases"].get(c.label, {}).get("ratio") for c in case_list}
    kinds = {c.label: c.kind for c in case_list}
    main = [r for lbl, r in ratio.items() if kinds[lbl] != "fwd_bwd"]
    timed = [r for r in main if r is not None]
    out = {"complete": len(timed) == len(main),
           "geomean_ratio": statistics.geometric_mean(timed) if timed else None}
    for kind in ("decode", "prefill", "paged", "fwd_bwd"):
        got = [r for lbl, r in ratio.items() if kinds[lbl] == kind and r is not None]
        out[f"worst_{kind}_ratio"] = max(got) if got else None
    out["eligible"] = bool(row.get("bits_ok") and out["complete"]
                           and out["worst_prefill_ratio"] <= TARGETS["prefill"])
    return out


def _order(row: dict) -> tuple:
    return (not row.get("eligible"), row.get("worst_decode_ratio") or math.inf, row.get("geomean_ratio") or math.inf)


def best(rows: list[dict]) -> dict | None:
    """The eligible row with the lowest worst decode ratio (ties: the geometric mean), or None."""
    eligible = [r for r in rows if r.get("eligible")]
    return min(eligible, key=_order) if eligible else None


_KIND_SHORT = {"decode": "d", "prefill": "pre", "paged": "pg", "fwd_bwd": "fb"}


def _short(label: str) -> str:
    """A case's column name: "decode B1 K1024" -> "d B1 K1k"."""
    kind, batch, n = label.split()
    size = int(n[1:])
    return f"{_KIND_SHORT[kind]} {batch} {n[0]}{f'{size // 1024}k' if size % 1024 == 0 else size}"


def report(meta: dict, rows: list[dict], case_list: list[Case]) -> str:
    lines = ["# Attention decode sweep (issue #50)", ""]
    if meta.get("backend") == "triton_interpreter":
        lines += [f"**{INTERPRETER_LABEL}**", ""]
    lines += [f"- {k}: {meta[k]}" for k in ("device", "sms", "backend", "heads", "head_dims", "candidates",
                                             "candidates_timed", "rounds", "replays", "config_table", "commit",
                                             "date", "seconds", "stopped") if k in meta]
    lines += ["", ("ratio = candidate / SDPA flash, CUDA-graph time per call, median of interleaved rounds (the JSON "
                   "has p20/p80 and the SM clock); bits: the candidate's decode steps, paged decode step and chunked "
                   "prefill against its prefill, raw bits; same bits as pinned: no means pinning it bumps the table "
                   f"version. Targets: decode <= {TARGETS['decode']}, prefill <= {TARGETS['prefill']}, fwd+bwd <= "
                   f"{TARGETS['fwd_bwd']}."), ""]
    cols = [c.label for c in case_list if c.kind != "fwd_bwd"]
    for d in sorted({r["head_dim"] for r in rows}):
        sel = sorted((r for r in rows if r["head_dim"] == d), key=_order)
        pick = best(sel)
        pinned = next((r for r in sel if r["pinned"]), None)
        title = f"### Best worst-decode ratio with equal bits and prefill <= {TARGETS['prefill']}"
        lines += [f"## head_dim {d}", "", title, ""]
        for name, r in (("best", pick), ("pinned", pinned)):
            if r is None:
                lines.append(f"- {name}: none" + (" qualifies" if name == "best" else ""))
                continue
            decode = [c for c in case_list if c.kind == "decode"]
            worst = max(decode, key=lambda c: r["cases"].get(c.label, {}).get("ratio") or 0)
            fb = r.get("worst_fwd_bwd_ratio")
            lines.append(f"- {name}: `{r['candidate']}`: worst decode {_f(r.get('worst_decode_ratio'))} "
                         f"({worst.label}), worst prefill {_f(r.get('worst_prefill_ratio'))}, worst paged "
                         f"{_f(r.get('worst_paged_ratio'))}, geomean {_f(r.get('geomean_ratio'))}, fwd+bwd "
                         f"{_f(fb) if fb else 'not timed'}, bits "
                         f"{'equal' if r.get('bits_ok') else 'NOT equal'}, same bits as pinned: "
                         f"{_yes(r.get('same_bits_as_pinned'))}")
        fin = [r for r in sel if r.get("worst_fwd_bwd_ratio") is not None]
        if fin:
            lines += ["", "### Finalists at fwd+bwd", "", markdown_table(
                [{"candidate": r["candidate"], "worst decode": r["worst_decode_ratio"],
                  "worst prefill": r["worst_prefill_ratio"], "fwd+bwd": r["worst_fwd_bwd_ratio"]} for r in fin],
                ["candidate", "worst decode", "worst prefill", "fwd+bwd"])]
        table = []
        for r in sel:
            bits = ("ok" if r.get("bits_ok") else "error" if "bits_error" in r
                    else f"DIFFER ({r.get('bit_mismatches')})")
            cells = {"candidate": r["candidate"] + (" (pinned)" if r["pinned"] else ""), "bits": bits,
                     "as pinned": _yes(r.get("same_bits_as_pinned")), "eligible": _why_not(r)}
            for lbl in cols:
                cell = r["cases"].get(lbl, {})
                cells[_short(lbl)] = _f(cell["ratio"]) if "ratio" in cell else ("err" if "error" in cell else "")
            cells.update({k: _f(r.get(f"{k.replace(' ', '_')}_ratio")) for k in
                          ("geomean", "worst decode", "worst prefill", "worst paged")})
            table.append(cells)
        lines += ["", f"### All candidates ({len(sel)}; eligible first, by worst decode ratio)", "",
                  markdown_table(table, ["candidate", "bits", "as pinned", "eligible", *[_short(c) for c in cols],
                                         "geomean", "worst decode", "worst prefill", "worst paged"]), ""]
        errs = [(r["candidate"], lbl, cell["error"]) for r in sel for lbl, cell in r["cases"].items()
                if "error" in cell]
        errs += [(r["candidate"], "bits", r["bits_error"]) for r in sel if "bits_error" in r]
        if errs:
            lines += [f"### Errors ({len(errs)})", ""] + [f"- `{c}` {lbl}: {e}" for c, lbl, e in errs[:60]]
            lines += [f"- ... {len(errs) - 60} more in the JSON" if len(errs) > 60 else "", ""]
    return "\n".join(lines) + "\n"


def _why_not(row: dict) -> str:
    """"yes", or why the row cannot be the best."""
    if row.get("eligible"):
        return "yes"
    if not row.get("bits_ok"):
        return "no: bits"
    if not row.get("complete"):
        return "no: untimed case"
    return f"no: prefill > {TARGETS['prefill']}"


def _f(x) -> str:
    return "" if x is None else f"{x:.3f}"


def _yes(x) -> str:
    return "" if x is None else ("yes" if x else "no")


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------
def _setup(tiny: bool, head_dim: int, backend: str, device: torch.device) -> tuple[Shapes, Grid, list[Candidate]]:
    from detkit.kernels.attention.configs import select_configs

    pinned = select_configs(backend, head_dim)
    if tiny:
        grid = tiny_grid(pinned)
    else:
        grid = gpu_grid(head_dim, torch.cuda.get_device_properties(device).multi_processor_count, pinned)
    return (TINY_SHAPES if tiny else GPU_SHAPES), grid, candidates(head_dim, backend, grid, spread=not tiny)


def sweep(head_dims: list[int], device: torch.device, tiny: bool, out: Path, rounds: int = 2, replays: int = 5,
          budget_s: float | None = None, finalists: int = FINALISTS, limit: int | None = None) -> dict:
    """Run the sweep, rewriting ``out``/decode_sweep.json and .md after every chunk (a stopped run keeps what
    finished). Returns the JSON's content."""
    from detkit.kernels.attention.configs import ATTENTION_CONFIG_TABLE_VERSION
    from detkit.toolkit.provenance import source_state

    start = time.monotonic()
    backend = "triton_interpreter" if device.type == "cpu" else "cuda_sm90"
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "backend": backend,
            "sms": torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None,
            "head_dims": head_dims, "rounds": rounds, "replays": replays, "chunk": CHUNK,
            "config_table": ATTENTION_CONFIG_TABLE_VERSION, "commit": source_state().get("git_commit"),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "targets": TARGETS, "cases": {}}
    if backend == "triton_interpreter":
        meta["label"] = INTERPRETER_LABEL
    rows: list[dict] = []
    all_cases: list[Case] = []
    stopped = None
    total = 0

    def write() -> dict:
        meta.update(seconds=round(time.monotonic() - start, 1), candidates=total,
                    candidates_timed=len(rows), stopped=stopped)
        doc = {"meta": meta, "best": {str(d): (best([r for r in rows if r["head_dim"] == d]) or {}).get("candidate")
                                      for d in head_dims}, "candidates": rows}
        (out / "decode_sweep.json").write_text(json.dumps(doc, default=str) + "\n")
        (out / "decode_sweep.md").write_text(report(meta, rows, all_cases))
        return doc

    for d in head_dims:
        shapes, grid, cands = _setup(tiny, d, backend, device)
        cands = cands[:limit] if limit else cands
        total += len(cands)
        meta["heads"] = shapes.heads
        meta.setdefault("grid", {})[str(d)] = asdict(grid)
        case_list = cases(shapes, d)
        all_cases = case_list + cases(shapes, d, ("fwd_bwd",))
        inputs = bits_inputs(shapes, d, bits_keys(shapes, grid), device)
        pinned_full = None
        by_label = {}
        for n in range(0, len(cands), CHUNK):
            if budget_s is not None and time.monotonic() - start > budget_s:
                stopped = (f"time budget {budget_s:.0f} s reached at head_dim {d}: {n} of its {len(cands)} "
                           "candidates run" + ("; head dims after it not run" if d != head_dims[-1] else ""))
                break
            chunk = cands[n:n + CHUNK]
            for cand in chunk:
                row = {**cand.as_row(), "cases": {}}
                try:
                    bits, full = bits_check(cand, inputs, pinned_full, shapes)
                    row.update(bits)
                    if cand.pinned:
                        pinned_full = full
                        row["same_bits_as_pinned"] = True
                except Exception as exc:  # noqa: BLE001 - reported in the row
                    row.update(bits_ok=False, bits_error=call_refusal(exc))
                rows.append(row)
                by_label[cand.label] = row
            # A candidate whose bits check raised (it does not build or launch) is not timed: each case would only
            # rebuild it to fail again.
            live = [c for c in chunk if "bits_error" not in by_label[c.label]]
            for case in case_list if live else []:
                cells, meta["cases"].setdefault(str(d), {})[case.label] = time_case(case, live, device, rounds,
                                                                                    replays)
                for label, cell in cells.items():
                    by_label[label]["cases"][case.label] = cell
            for cand in chunk:
                by_label[cand.label].update(summarize(by_label[cand.label], all_cases))
            write()
            print(f"head_dim {d}: {min(n + CHUNK, len(cands))}/{len(cands)} candidates, "
                  f"{time.monotonic() - start:.0f} s", flush=True)
        # Finalists: the best timed ones with equal bits, eligible first (and the pinned entry), at fwd+bwd.
        sel = sorted((r for r in rows if r["head_dim"] == d), key=_order)
        picks = [r for r in sel if r.get("bits_ok") and r.get("complete")][:finalists]
        picks += [r for r in sel if r["pinned"] and r not in picks]
        chosen = [c for c in cands if c.label in {r["candidate"] for r in picks}]
        for case in cases(shapes, d, ("fwd_bwd",)) if chosen and finalists else []:
            cells, meta["cases"].setdefault(str(d), {})[case.label] = time_case(case, chosen, device, rounds, replays)
            for label, cell in cells.items():
                by_label[label]["cases"][case.label] = cell
        for r in picks:
            r.update(summarize(r, all_cases))
        del inputs, pinned_full
        write()
        if stopped:
            break
    return write()


# ---------------------------------------------------------------------------------------------
# Warm: every binary the sweep launches, compiled in parallel processes sharing Triton's cache
# ---------------------------------------------------------------------------------------------
WARM_PATHS = ("one_pass_h4", "one_pass_h1", "split_h4", "split_h1", "paged_split_h4", "paged_split_h1")


def warm_jobs(head_dims: list[int], tiny: bool = False, sms: int = 132) -> list[tuple[int, int, str]]:
    """(head_dim, candidate index, path) for every forward tile and split of the sweep, in the sweep's order (the
    thresholds only choose among these binaries: the first candidate with each tile and split stands for the
    others), and (head_dim, -1, "fwd_bwd") for the backward's pinned tiles."""
    from detkit.kernels.attention.configs import select_configs

    backend = "triton_interpreter" if tiny else "cuda_sm90"
    jobs = []
    for d in head_dims:
        pinned = select_configs(backend, d)
        grid = tiny_grid(pinned) if tiny else gpu_grid(d, sms, pinned)
        seen = set()
        for i, cand in enumerate(candidates(d, backend, grid, spread=not tiny)):
            key = (cand.configs.fwd, cand.configs.split_tiers, cand.configs.paged_num_stages)
            if key not in seen:
                seen.add(key)
                jobs += [(d, i, path) for path in WARM_PATHS]
        jobs.append((d, -1, "fwd_bwd"))
    return jobs


def warm_one(job: tuple[int, int, str], device: torch.device, tiny: bool = False, sms: int = 132) -> None:
    """One launch at a small shape with the real shapes' specialisation (lengths, batch and head counts are not
    specialised; strides are multiples of 16), on the path ``job`` names, forced by the speed-only thresholds."""
    from detkit.kernels.attention import attention, attention_paged
    from detkit.kernels.attention.configs import select_configs

    d, index, path = job
    backend = "triton_interpreter" if tiny else "cuda_sm90"
    pinned = select_configs(backend, d)
    if index < 0:
        cfg = pinned
    else:
        grid = tiny_grid(pinned) if tiny else gpu_grid(d, sms, pinned)
        cfg = candidates(d, backend, grid, spread=not tiny)[index].configs
    heads = BIG if path.endswith("h1") else 0
    grid_below = BIG if "split" in path else 0
    cfg = replace(cfg, split_heads_below=heads, split_grid_below=grid_below, eager_split_grid_min_keys=0)
    keys = 2 * cfg.split_tiers[-1][1] + 5  # past two of the largest splits: more than one split a step
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 4, 1, d, device=device, generator=g).to(torch.bfloat16)  # a group of 4, as Qwen3-8B's
    k, v = (torch.randn(1, 1, keys, d, device=device, generator=g).to(torch.bfloat16) for _ in range(2))
    if path == "fwd_bwd":
        leaves = [t.requires_grad_() for t in (torch.randn(1, 4, 24, d, device=device, generator=g).bfloat16(),
                                               k[:, :, :24].clone(), v[:, :, :24].clone())]
        attention(*leaves, configs=cfg).sum().backward()
    elif path.startswith("paged"):
        p = paged_cache(q, k, v, 16, g)
        attention_paged(p["q_packed"], p["k_cache"], p["v_cache"], p["block_table"], p["cu_q"], p["cu_k"], 1, keys,
                        configs=cfg)
    else:
        attention(q, k, v, configs=cfg)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_worker(jobs: list, tiny: bool, sms: int) -> int:
    device = torch.device("cpu" if tiny else "cuda")
    for job in jobs:
        try:
            warm_one(tuple(job), device, tiny, sms)
        except Exception as exc:  # noqa: BLE001 - the sweep reports a candidate that does not build
            print(f"warm {tuple(job)}: {call_refusal(exc)}", flush=True)
    return 0


def warm(head_dims: list[int], workers: int, tiny: bool = False) -> int:
    sms = 132 if tiny else torch.cuda.get_device_properties(0).multi_processor_count
    jobs = warm_jobs(head_dims, tiny, sms)
    workers = max(1, min(workers, len(jobs)))
    start = time.time()
    procs = []
    for i in range(workers):
        cmd = [sys.executable, "-m", "tools.attention_decode_sweep", "warm", "--worker", "--sms", str(sms)]
        cmd += [a for f, v in GRID_OVERRIDES.items() for a in ("--grid", grid_override_text(f, v))]
        proc = subprocess.Popen(cmd + (["--tiny"] if tiny else []), stdin=subprocess.PIPE, text=True,
                                env=os.environ.copy())
        proc.stdin.write(json.dumps(jobs[i::workers]))
        proc.stdin.close()
        procs.append(proc)
    codes = [p.wait() for p in procs]
    print(f"attention_decode_sweep warm: {len(jobs)} launches in {workers} processes, {time.time() - start:.0f} s, "
          f"exit codes {codes}", flush=True)
    return max(codes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.attention_decode_sweep",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("warm", help="compile every binary the sweep launches, in parallel processes")
    s = sub.add_parser("sweep", help="bits and CUDA-graph times of every candidate beside SDPA flash")
    for p in (w, s):
        p.add_argument("--head-dims", type=int, nargs="+", default=None, choices=(64, 128, 256),
                       help="default: 128 (--tiny: 64, the interpreter's cheapest)")
        p.add_argument("--tiny", action="store_true", help="the interpreter's tiles and tiny shapes (CPU)")
        p.add_argument("--grid", type=parse_grid_override, action="append", default=[], metavar="FIELD=V,V",
                       help="replace one field of the sm_90 grid (repeatable), e.g. "
                       "split_tiers=512,2048:256/16384:512/1024")
    w.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    w.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    w.add_argument("--sms", type=int, default=132, help=argparse.SUPPRESS)
    s.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("--replays", type=int, default=5, help="timed replays per graph and round")
    s.add_argument("--budget-s", type=float, default=None,
                   help="start no chunk of candidates after this many seconds (the report says so)")
    s.add_argument("--finalists", type=int, default=FINALISTS, help="best candidates also timed at fwd+bwd (0: none)")
    s.add_argument("--limit", type=int, default=None, help="only the first N candidates per head_dim (pinned first)")
    args = parser.parse_args(argv)
    args.head_dims = args.head_dims or ([64] if args.tiny else [128])
    GRID_OVERRIDES.update(dict(args.grid))
    if args.command == "warm":
        if args.worker:
            return _warm_worker(json.loads(sys.stdin.read()), args.tiny, args.sms)
        if not args.tiny and not torch.cuda.is_available():
            parser.error("warm compiles for the GPU and torch sees no CUDA GPU (--tiny: the interpreter's plumbing)")
        return warm(args.head_dims, args.workers, args.tiny)
    if min(args.rounds, args.replays) < 1 or args.finalists < 0 or (args.limit is not None and args.limit < 1):
        parser.error(f"--rounds and --replays must be >= 1, --finalists >= 0, --limit >= 1; got {args.rounds}, "
                     f"{args.replays}, {args.finalists}, {args.limit}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA GPU; use --device cpu --tiny (interpreter, not hardware)")
    if args.device == "cpu" and not args.tiny:
        parser.error("--device cpu runs the Triton interpreter: only at the --tiny shapes")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu needs TRITON_INTERPRET=1 (the kernels run in the Triton interpreter)")
    if args.tiny and args.device == "cuda":
        parser.error("--tiny runs the interpreter's tiles: only with --device cpu")
    doc = sweep(args.head_dims, torch.device(args.device), args.tiny, args.out, args.rounds, args.replays,
                args.budget_s, args.finalists, args.limit)
    print((args.out / "decode_sweep.md").read_text())
    # Failed checks: a candidate whose decode differs from its prefill (the invariance broken), or a pinned entry that
    # does not run. A candidate that does not build is a finding of the sweep, not a failure.
    broken = [r["candidate"] for r in doc["candidates"] if r.get("bit_mismatches")]
    pinned_bad = [r["candidate"] for r in doc["candidates"] if r["pinned"] and not r.get("bits_ok")]
    for what, names in (("bits differ", broken), ("pinned entry failed", pinned_bad)):
        if names:
            print(f"attention_decode_sweep: {what}: {', '.join(names)}", file=sys.stderr)
    return 1 if broken or pinned_bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
