"""Fill Triton's on-disk kernel cache for a det_gemm benchmark or audit before it runs, compiling in parallel
processes: a zoo run otherwise spends minutes compiling one kernel after another.

    python -m tools.gemm_warm --workers 8 --zoo --m 1 16 128 256 1024 4096 16384    # what bench gemm --zoo runs
    python -m tools.gemm_warm --workers 8 --preset zoo                                # what audit --preset zoo runs

A compiled kernel depends on the config and on the launch's specialization, not on the sizes: each integer
argument's class (1, a multiple of 16, or neither), pointer alignment and descriptor block shapes. So every distinct
(op, config, weight layout, size classes) of the selection is launched once at tiny sizes of the same classes, with
the config the table picks at the real sizes (or every config the table can pick, for an audit's cross-config
check). Needs a CUDA device; the cache is TRITON_CACHE_DIR (default ~/.triton/cache), shared by the later run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch


def size_class(v: int) -> int:
    """A small size with ``v``'s specialization class (1; a multiple of 16; 16-byte rows (8 BF16); neither)."""
    return 1 if v == 1 else 16 if v % 16 == 0 else 24 if v % 8 == 0 else 7


def spec(op: str, m: int, n: int, k: int, layout: str, config) -> tuple:
    return (op, size_class(m), size_class(n), size_class(k), layout, json.dumps(config.__dict__))


def table_pick(op: str, m: int, n: int, k: int):
    """The table's pick at the real sizes for TMA-addressable operands (16-byte-aligned rows) on 132 SMs."""
    from detkit.kernels.det_gemm.launch import HOPPER_SMS, select_config

    rows, cols = {"fwd": (m, n), "da": (m, k), "db": (k, n)}[op]
    return select_config(op, m, cols=cols, rows=rows, sms=HOPPER_SMS)


def bench_specs(ops, kn_shapes, m_values, layouts, extra_configs=()) -> set:
    """The table's picks (and ``extra_configs``: a tuning sweep's candidates) at every case of a selection."""
    out = set()
    for op in ops:
        for k, n in kn_shapes:
            for m in m_values:
                for layout in (layouts if op != "db" else ("kn",)):
                    out |= {spec(op, m, n, k, layout, c) for c in (table_pick(op, m, n, k), *extra_configs)}
    return out


def preset_specs(name: str) -> set:
    """An audit preset's launches: the table picks at its M values (and the padded and zero-row variants' sizes)
    and every config the table can pick at the cross-config rows."""
    from detkit.kernels.det_gemm.launch import all_configs
    from detkit.toolkit.presets import GEMM_PRESETS

    preset = GEMM_PRESETS[name]
    # The M values, the zero-padded (+37 rows) and zero-row (+61) batches, and the chunks of the largest.
    ms = (set(preset.m_values) | {m + 37 for m in preset.m_values} | {m + 61 for m in preset.determinism_m}
          | {preset.chunk, preset.m_max % preset.chunk or preset.chunk})
    out = bench_specs(("fwd", "da", "db"), preset.kn_shapes, sorted(ms), preset.layouts)
    rows = preset.config_m or preset.m_max
    for op in ("fwd", "da"):
        for k, n in preset.kn_shapes:
            for layout in preset.layouts:
                out |= {spec(op, rows, n, k, layout, c) for c in all_configs(op)}
    return out


def _warm(specs: list) -> None:
    from detkit.kernels.det_gemm.launch import LAUNCHERS, GemmConfig
    from detkit.toolkit.fixtures import bf16_randn, weight_kn

    device = torch.device("cuda")
    for op, m, n, k, layout, config in specs:
        config = GemmConfig(**json.loads(config))
        if op == "fwd":
            x, y = bf16_randn((m, k), 1, device), weight_kn(k, n, 2, layout, device)
        elif op == "da":
            x, y = bf16_randn((m, n), 1, device), weight_kn(k, n, 2, layout, device)
        else:
            x, y = bf16_randn((m, k), 1, device), bf16_randn((m, n), 2, device)
        LAUNCHERS[op](x, y, config=config)
    torch.cuda.synchronize()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gemm_warm", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--preset", help="an audit preset (toolkit/presets.py GEMM_PRESETS)")
    parser.add_argument("--zoo", action="store_true", help="the zoo's shapes (as bench gemm --zoo)")
    parser.add_argument("--kn", action="append", default=[], metavar="K,N")
    parser.add_argument("--m", nargs="+", type=int, default=[])
    parser.add_argument("--ops", nargs="+", default=["fwd", "da", "db"], choices=["fwd", "da", "db"])
    parser.add_argument("--layouts", nargs="+", default=None, choices=["kn", "linear"])
    parser.add_argument("--config", action="append", default=[], metavar="BM,BN,BK,G,WARPS,STAGES[,VARIANT]",
                        help="also these configs at every case (tools.gemm_candidates' candidates)")
    parser.add_argument("--narrow", action="store_true", help="with --zoo: only its outputs of N <= 1024")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _warm([tuple(s) for s in json.loads(sys.stdin.read())])
        return 0
    specs = set()
    if args.preset:
        specs |= preset_specs(args.preset)
    if args.zoo or args.kn:
        from detkit.toolkit.presets import ZOO_M_VALUES, zoo_shapes

        from tools.gemm_candidates import parse_config

        kn = ([(s.k, s.n) for s in zoo_shapes() if s.narrow or not args.narrow] if args.zoo
              else [tuple(int(v) for v in s.split(",")) for s in args.kn])
        layouts = tuple(args.layouts or (("linear",) if args.zoo else ("kn", "linear")))
        specs |= bench_specs(args.ops, kn, args.m or ZOO_M_VALUES, layouts, [parse_config(c) for c in args.config])
    if not specs:
        parser.error("nothing to warm: give --preset, --zoo or --kn")
    todo = sorted(specs)
    workers = max(1, min(args.workers, len(todo)))
    start = time.time()
    procs = []
    for i in range(workers):
        proc = subprocess.Popen([sys.executable, "-m", "tools.gemm_warm", "--worker"], stdin=subprocess.PIPE,
                                text=True, env=os.environ.copy())
        proc.stdin.write(json.dumps(todo[i::workers]))
        proc.stdin.close()
        procs.append(proc)
    codes = [p.wait() for p in procs]
    print(f"gemm_warm: {len(todo)} launches in {workers} processes, {time.time() - start:.0f} s, exit codes {codes}",
          file=sys.stderr)
    return max(codes)


if __name__ == "__main__":
    raise SystemExit(main())
