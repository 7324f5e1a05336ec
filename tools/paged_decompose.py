"""Where the paged decode step's time over the contiguous one goes (issue #50 part 5): the decode step on paths that add
one difference at a time, timed side by side, and one call of each for Nsight Compute.

    python -m tools.paged_decompose --out results/paged --case 1x1024 --case 1x8192   # CUDA-graph time, cold L2
    python -m tools.paged_decompose --ncu-run paged16                                 # the process ncu profiles

The paths, Qwen3-8B heads (32 query, 8 KV, head dim 128) unless told otherwise:
- ``padded``: the padded contiguous cache [B, Hkv, S, D], no bounds read (every sequence has S keys);
- ``padded_kv_end``: the same with per-sequence ends (one bounds load before the keys);
- ``varlen``: the packed cache [B * S, Hkv, D] with cu_seqlens (the bounds, and the paged storage's row stride of
  Hkv * D, no block table);
- ``paged256``, ``paged16``: the paged cache [P, page_size, Hkv, D], pages in a random order (the block table);
- ``paged256_prefetch``, ``paged16_prefetch``: the paged paths with each key tile's table entries read one tile
  ahead (``AttnConfigs.paged_prefetch_pages``, speed only);
- ``flash``: SDPA's flash backend on the padded cache.
Every detkit path gives the padded path's bits (checked on each run). The timing is ``detkit bench attention``'s: CUDA
graphs over as many input sets as twice the L2 holds, so no call finds its operands cached. The profiled process warms
its path up at B1 1k and B1 8k, then makes one call of each inside the NVTX range ``ncu`` (domain detkit).
tools/gpu/paged_decode_decompose.sh runs both on a GPU host.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import torch

PATHS = ("padded", "padded_kv_end", "varlen", "paged256", "paged16", "paged256_prefetch", "paged16_prefetch", "flash")
DETKIT_PATHS = tuple(p for p in PATHS if p != "flash")
DEFAULT_CASES = ((1, 1024), (1, 8192), (8, 8192), (1, 32768))
NCU_CASES = ((1, 1024), (1, 8192))
QWEN3_8B_HEADS = (32, 8, 128)  # query heads, KV heads, head dim


def path_calls(batch: int, keys: int, device: torch.device, sets: int,
               heads: tuple[int, int, int] = QWEN3_8B_HEADS) -> dict[str, list]:
    """path -> one decode-step call per input set, each on its own operands and capturable in a CUDA graph (the
    checks that read the host run here, once)."""
    from detkit.bench.attention import BenchCase, make_inputs, paged_call, sdpa_call, sdpa_gqa_mode
    from detkit.kernels.attention import attention
    from detkit.kernels.attention.configs import select_configs
    from detkit.kernels.attention.kernels import attention_fwd_kernel
    from detkit.kernels.attention.launch import Sequences, attention_fwd_launch
    from detkit.kernels.backend import resolve_backend_of_devices

    heads_q, heads_kv, dim = heads
    base = BenchCase("decode", batch, 1, keys, heads_q, heads_kv, dim, seed=7)
    scale = 1.0 / math.sqrt(dim)
    calls: dict[str, list] = {p: [] for p in PATHS}
    kv_end = torch.full((batch,), keys, dtype=torch.int32, device=device)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
    seqs = Sequences(True, batch, 1, keys, cu_q, cu_q * keys)
    inputs = make_inputs(base, device, sets=sets)
    gqa = sdpa_gqa_mode(base, inputs[0])  # "native" where the flash backend takes enable_gqa, as the bench picks
    for inp in inputs:
        q, k, v = inp["q"], inp["k"], inp["v"]
        k_packed, v_packed = (t.transpose(1, 2).reshape(batch * keys, heads_kv, dim).contiguous() for t in (k, v))
        calls["padded"].append(lambda q=q, k=k, v=v: attention(q, k, v))
        calls["padded_kv_end"].append(lambda q=q, k=k, v=v: attention(q, k, v, kv_end=kv_end))
        calls["varlen"].append(lambda q=q[:, :, 0], k=k_packed, v=v_packed:
                               attention_fwd_launch(q, k, v, seqs, scale, None)[0])
        calls["flash"].append(sdpa_call(base, inp, gqa))
    prefetch = dataclasses.replace(select_configs(resolve_backend_of_devices(attention_fwd_kernel, {"q": device}),
                                                  dim), paged_prefetch_pages=True)
    for page in (256, 16):
        case = BenchCase("paged_decode", batch, 1, keys, heads_q, heads_kv, dim, seed=7, page_size=page)
        paged_inputs = make_inputs(case, device, sets=sets)
        calls[f"paged{page}"] = [paged_call(case, inp) for inp in paged_inputs]
        calls[f"paged{page}_prefetch"] = [paged_call(case, inp, configs=prefetch) for inp in paged_inputs]
    return calls


def same_bits(calls: dict[str, list], batch: int, heads: tuple[int, int, int] = QWEN3_8B_HEADS) -> dict[str, bool]:
    """Whether each detkit path's first call gives the padded path's bits."""
    heads_q, _, dim = heads
    outs = {p: calls[p][0]().reshape(batch, heads_q, dim) for p in DETKIT_PATHS}
    return {p: bool(torch.equal(outs[p], outs["padded"])) for p in DETKIT_PATHS}


def decompose(cases, device: torch.device, rounds: int = 5, heads: tuple[int, int, int] = QWEN3_8B_HEADS,
              sets: int | None = None) -> list[dict]:
    """One row per (batch, keys): each path's median time per call (µs, p20 and p80 beside it), its ratio to the
    padded path's, and whether it gave the padded path's bits. ``sets``: input sets per path (default: the bench's,
    twice the L2 over the per-call bytes)."""
    from detkit.bench.attention import BenchCase, _graph_sets
    from detkit.toolkit.timing import time_graphs

    rows = []
    for batch, keys in cases:
        n = sets or _graph_sets(BenchCase("decode", batch, 1, keys, *heads))
        calls = path_calls(batch, keys, device, n, heads)
        bits = same_bits(calls, batch, heads)
        fns = {p: (lambda cs=cs: [c() for c in cs]) for p, cs in calls.items()}
        t = time_graphs(fns, device, calls_per_fn=n, rounds=rounds, replays=10)
        rows.append({"batch": batch, "keys": keys, "sets": n, "same_bits_as_padded": bits,
                     **{f"{p}_us": t[p].median_us for p in PATHS}, **{f"{p}_p20_us": t[p].p20_us for p in PATHS},
                     **{f"{p}_p80_us": t[p].p80_us for p in PATHS},
                     **{f"{p}_over_padded": t[p].median_us / t["padded"].median_us for p in PATHS}})
        del calls, fns
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def profiled_run(path: str, device: torch.device, cases=NCU_CASES,
                 heads: tuple[int, int, int] = QWEN3_8B_HEADS) -> None:
    """The process ncu profiles: ``path`` warmed up at each case, then one call of each inside the range ``ncu``."""
    from detkit.toolkit.nvtx_ranges import nvtx_range

    calls = [path_calls(batch, keys, device, 1, heads)[path][0] for batch, keys in cases]
    for call in calls:
        for _ in range(3):
            call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    with nvtx_range("ncu"):
        for call in calls:
            call()
        if device.type == "cuda":
            torch.cuda.synchronize()


def parse_case(text: str) -> tuple[int, int]:
    """``BxK`` (batch x keys) -> (B, K); refuses anything else."""
    try:
        batch, keys = (int(v) for v in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"case {text!r}: expected BATCHxKEYS, e.g. 1x8192") from None
    if batch < 1 or keys < 1:
        raise argparse.ArgumentTypeError(f"case {text!r}: batch and keys must be >= 1")
    return batch, keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.paged_decompose", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="results folder: decompose.json")
    parser.add_argument("--case", action="append", type=parse_case, help="BATCHxKEYS (repeatable; default: "
                        + ", ".join(f"{b}x{k}" for b, k in DEFAULT_CASES) + ")")
    parser.add_argument("--ncu-run", choices=PATHS, help="be the profiled process of this path")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.ncu_run:
        profiled_run(args.ncu_run, device)
        return 0
    if args.out is None:
        parser.error("--out is required (or --ncu-run PATH)")
    rows = decompose(args.case or DEFAULT_CASES, device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decompose.json").write_text(json.dumps({"paths": PATHS, "rows": rows}, indent=1))
    for row in rows:
        print(json.dumps(row))
    return 0 if all(all(r["same_bits_as_padded"].values()) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
