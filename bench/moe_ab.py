"""In-process A/B of MoE config tables: the BF16 MoE layer's forward+backward under the pinned table and under each
variant (stage overrides of kernels.moe.MOE_CONFIGS), timed in interleaved rounds in one process, so every table sees
the same clocks (under the H200's power cap the same code's time moved by up to 7% between runs, more than most
single-kernel wins), and each variant's outputs compared bit for bit with the pinned table's.

    python -m detkit.bench.moe_ab --device cuda --variant wgrad_ws=wgrad:128,128,64,1,8,4,ws --rounds 30 --out results/ab
    python -m detkit.bench.moe_ab --device cuda --preset reference --tokens 8192 16384 \\
        --variant 'ws_all=wgrad:128,128,64,1,8,4,ws;up:128,128,64,1,8,4,ws' --out results/ab

A variant is NAME=STAGE:CONFIG[;STAGE:CONFIG...], CONFIG as BM,BN,BK,G,warps,stages[,variant] (bench/gemm_ncu.py's
form); ``route:float32`` (or ``route:bfloat16``) in it sets kernels.moe.ROUTE_DTYPE, the dtype y and dx_route leave
their GEMMs in (a different rounding: its bits differ from the pinned table's, and the row says which outputs do;
with float32 give down a tile whose FP32 store buffer fits, e.g. ``route:float32;down:128,128,64,1,8,4,ws``: table .7's
128x256 3-stage tile does not, and its launcher refuses it by name).
Rows: median / p20 / p80 µs of one forward+backward call (toolkit.timing.time_interleaved: L2-flushed do_bench
samples), the median SM clock of its samples, the ratio to the pinned table's median in the same run,
TFLOP/s and MFU against 989 TFLOP/s (FLOPs 18*T*K*H*I), and whether out, dx, dw1, dw2 and dscores have the pinned
table's bits. On the CPU the times are Triton-interpreter wall time (plumbing only, not a hardware result).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from detkit.bench.gemm_ncu import parse_config
from detkit.bench.moe import DATASHEET_BF16_TFLOPS, PRESETS, markdown_table
from detkit.kernels.det_gemm import GemmConfig

PINNED = "pinned"
ROUTE = "route"  # the variant key that sets kernels.moe.ROUTE_DTYPE
ROUTE_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
OUTPUTS = ("out", "dx", "dw1", "dw2", "dscores")
INTERPRETER_NOTE = "CPU, Triton interpreter: wall time of the emulation, not a hardware result"


def parse_variant(spec: str) -> tuple[str, dict[str, GemmConfig | torch.dtype]]:
    """``NAME=STAGE:CONFIG[;STAGE:CONFIG...]`` -> (name, {stage: config, and "route": dtype when given}); refuses a
    malformed spec by name."""
    from detkit.kernels.moe import STAGES

    name, sep, body = spec.partition("=")
    if not sep or not name or not body:
        raise ValueError(f"variant {spec!r}: expected NAME=STAGE:BM,BN,BK,G,warps,stages[,variant][;STAGE:...]")
    if name == PINNED:
        raise ValueError(f"variant {spec!r}: the name {PINNED!r} is the pinned table's")
    stages: dict[str, GemmConfig | torch.dtype] = {}
    for part in body.split(";"):
        stage, sep, config = part.partition(":")
        if not sep or stage not in STAGES + (ROUTE,):
            raise ValueError(f"variant {spec!r}: stage {stage!r} is not a MoE stage; supported: {STAGES + (ROUTE,)}")
        if stage in stages:
            raise ValueError(f"variant {spec!r}: stage {stage!r} given twice")
        if stage == ROUTE and config not in ROUTE_DTYPE_NAMES:
            raise ValueError(f"variant {spec!r}: route dtype {config!r}; supported: {tuple(ROUTE_DTYPE_NAMES)}")
        stages[stage] = ROUTE_DTYPE_NAMES[config] if stage == ROUTE else parse_config(config)
    return name, stages


def with_table(backend: str, stages: dict[str, GemmConfig | torch.dtype],
               fn: Callable[[], tuple]) -> Callable[[], tuple]:
    """``fn`` run with MOE_CONFIGS[backend] overridden by ``stages`` and kernels.moe.ROUTE_DTYPE by ``stages["route"]``
    when given (both restored afterwards, also on an error)."""
    import detkit.kernels.moe as km

    def run():
        table = km.MOE_CONFIGS[backend]
        kept, kept_route = dict(table), km.ROUTE_DTYPE
        table.update({s: c for s, c in stages.items() if s != ROUTE})
        km.ROUTE_DTYPE = stages.get(ROUTE, kept_route)
        try:
            return fn()
        finally:
            table.clear()
            table.update(kept)
            km.ROUTE_DTYPE = kept_route
    return run


def run_ab(presets: list[str], tokens: list[int] | None, variants: dict[str, dict[str, GemmConfig | torch.dtype]],
           device: torch.device, rounds: int, seed: int = 0) -> list[dict]:
    """One row per (preset, T, table): the pinned table and every variant, timed interleaved, bits compared."""
    from detkit.bench.moe_sweep import make_case_inputs
    from detkit.kernels.backend import TRITON_INTERPRETER, resolve_backend
    from detkit.kernels.moe import moe_grouped_gemm_kernel, moe_mlp_bwd, moe_mlp_fwd
    from detkit.toolkit.contract import compare_bits
    from detkit.toolkit.timing import time_interleaved

    # The table the kernels will read (refuses a device they cannot run on, by name, before any work).
    backend = resolve_backend(moe_grouped_gemm_kernel, {"device": torch.empty(0, device=device)})
    hardware = backend != TRITON_INTERPRETER
    rows = []
    for preset in presets:
        for t in tokens or [PRESETS[preset].t]:
            p = dataclasses.replace(PRESETS[preset], t=t)
            inp = make_case_inputs(p, "uniform", device, seed)

            def fwd_bwd():
                out, saved = moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])
                g = moe_mlp_bwd(inp["dout"], saved)
                return out, g.dx, g.dw1, g.dw2, g.dscores

            fns = {PINNED: fwd_bwd, **{name: with_table(backend, stages, fwd_bwd) for name, stages in variants.items()}}
            first = fns[PINNED]()
            bits = {name: [n for n, a, b in zip(OUTPUTS, fn(), first) if not compare_bits(a, b).equal]
                    for name, fn in fns.items()}
            timings = time_interleaved(fns, device, rounds=rounds)
            for name, tm in timings.items():
                row = {"preset": preset, "T": p.t, "H": p.h, "I": p.i, "E": p.e, "K": p.k, "table": name,
                       "overrides": {s: str(c) if s == ROUTE else c.label() for s, c in variants.get(name, {}).items()},
                       "median_us": tm.median_us, "p20_us": tm.p20_us, "p80_us": tm.p80_us,
                       "sm_clock_mhz": tm.sm_clock_mhz,
                       "ratio_to_pinned": tm.median_us / timings[PINNED].median_us,
                       "bits_equal_pinned": not bits[name], "outputs_differing": bits[name]}
                if hardware:
                    row["tflops"] = p.flops_fwd_bwd / (tm.median_us * 1e-6) / 1e12
                    row["mfu_989"] = row["tflops"] / DATASHEET_BF16_TFLOPS
                rows.append(row)
    return rows


def report(rows: list[dict], meta: dict) -> str:
    from detkit.toolkit.reports import env_block

    lines = ["# MoE table A/B (one process, interleaved rounds)", ""]
    if not meta["hardware_result"]:
        lines += [f"> **{INTERPRETER_NOTE}**", ""]
    lines += [f"- {k}: `{v}`" if k == "command_line" else f"- {k}: {v}" for k, v in meta.items()
              if k not in ("env", "env_summary")]
    lines.append("")
    lines += env_block(meta["env_summary"])
    cols = ["preset", "T", "table", "median_us", "p20_us", "p80_us", "sm_clock_mhz", "ratio_to_pinned",
            "bits_equal_pinned", "outputs_differing", "overrides"]
    if meta["hardware_result"]:
        cols[7:7] = ["tflops", "mfu_989"]
    lines += markdown_table(rows, cols)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m detkit.bench.moe_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--preset", nargs="+", default=["reference", "qwen3-30b-a3b"], choices=sorted(PRESETS))
    parser.add_argument("--tokens", nargs="+", type=int, help="T values (default: each preset's own)")
    parser.add_argument("--variant", action="append", required=True, help="NAME=STAGE:CONFIG[;STAGE:CONFIG...]")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA GPU; use --device cpu (interpreter, not hardware)")
    if args.rounds < 1 or any(t < 1 for t in args.tokens or []):
        parser.error(f"--rounds and --tokens must be >= 1; got {args.rounds}, {args.tokens}")
    try:
        variants = dict(parse_variant(v) for v in args.variant)
    except ValueError as exc:
        parser.error(str(exc))
    if len(variants) != len(args.variant):
        parser.error(f"variant names must be distinct; got {args.variant}")
    from detkit.kernels.moe import MOE_CONFIG_TABLE_VERSION
    from detkit.toolkit.harness import atomic_write_text, env_meta

    device = torch.device(args.device)
    start = time.time()
    rows = run_ab(args.preset, args.tokens, variants, device, args.rounds, args.seed)
    meta = {"command_line": " ".join(["python -m detkit.bench.moe_ab", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hardware_result": device.type == "cuda",
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "config_table_version": MOE_CONFIG_TABLE_VERSION, "rounds": args.rounds, "seed": args.seed,
            "seconds": round(time.time() - start, 1), **env_meta(device)}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "rows.json", json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    text = report(rows, meta)
    atomic_write_text(args.out / "report.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
