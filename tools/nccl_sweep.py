"""NCCL algorithm/protocol sweep of the 2-rank BF16 all_reduce SUM: one fresh process pair per setting,
one hash per input, and the version-1 oracle checked on every element.

Why: the TP/CP operators rely on a two-operand BF16 sum being rounded once, so that it equals
``(p0.float() + p1.float()).bfloat16()`` whatever NCCL's algorithm or protocol. This script checks
that claim on the machine at hand. NCCL reads its environment when a communicator is created, so
every setting runs in a fresh ``torchrun --nproc-per-node 2`` job; NVLink multicast stays off
(``NCCL_NVLS_ENABLE=0``) in every setting.

Settings: default; Ring/Simple, Ring/LL, Ring/LL128 (``NCCL_ALGO=Ring`` + ``NCCL_PROTO``); Tree via
``NCCL_ALGO="allreduce:tree"`` (a bare ``Tree`` breaks all_gather: "no algorithm/protocol available").

Inputs: BF16 ``[M, 4096]`` partials drawn on the CPU from a per-input seed (both ranks draw both
partials; rank r contributes partial r): Gaussian at several M, values spread over 2**-40..2**40,
near-cancelling pairs, exact round-to-even ties and signed zeros.

    python -m tools.nccl_sweep [--out DIR] [--quick] [--settings default,tree] [--dry-run]   # checkout root
    python -m tools.nccl_sweep --device cpu --settings default --quick   # gloo plumbing check only

Prints one line per (setting, input): the SHA-256 of the reduced tensor (rank 0; rank 1 must agree)
and whether it equals the v1 oracle, then a table of inputs x settings. Writes ``OUT/sweep.json`` and
per-setting logs. Exit status 0 only when every setting gives the same hash for every input and
every result equals the oracle.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HIDDEN = 4096
SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "ring_simple": {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"},
    "ring_ll": {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"},
    "ring_ll128": {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL128"},
    "tree": {"NCCL_ALGO": "allreduce:tree"},
}
COMMON_ENV = {"NCCL_NVLS_ENABLE": "0", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,ENV,TUNING"}
# Knobs that would change what a setting means; cleared before each setting is applied.
NCCL_KNOBS = ("NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE")
FULL_M = (1, 7, 16, 128, 129, 1024, 4095, 4096, 16384)
QUICK_M = (1, 7, 128, 1024)


def inputs(quick: bool) -> dict[str, dict]:
    """Input name -> recipe; the same names and bits in every process."""
    ms = QUICK_M if quick else FULL_M
    recipes = {f"randn_m{m}": {"kind": "randn", "m": m, "seed": 1000 + i} for i, m in enumerate(ms)}
    recipes["wide_exponent_m1024"] = {"kind": "wide", "m": 1024, "seed": 2001}
    recipes["cancel_m1024"] = {"kind": "cancel", "m": 1024, "seed": 2002}
    recipes["ties_m128"] = {"kind": "ties", "m": 128, "seed": 2003}
    recipes["signed_zeros_m16"] = {"kind": "zeros", "m": 16, "seed": 2004}
    return recipes


def partials(recipe: dict):
    """(p0, p1): BF16 [m, HIDDEN] on the CPU."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(recipe["seed"])
    shape = (recipe["m"], HIDDEN)
    kind = recipe["kind"]
    if kind == "randn":
        p0, p1 = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    elif kind == "wide":
        scale = lambda: torch.exp2(torch.randint(-40, 41, shape, generator=gen).float())  # noqa: E731
        p0 = torch.randn(shape, generator=gen) * scale()
        p1 = torch.randn(shape, generator=gen) * scale()
    elif kind == "cancel":
        p0 = torch.randn(shape, generator=gen)
        p1 = -p0.bfloat16().float() + torch.randn(shape, generator=gen) * 2.0**-12
    elif kind == "ties":
        # 1 + 2**-8 and 1 + 3 * 2**-8 lie halfway between BF16 neighbours: nearest-even must pick
        sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
        odd = torch.randint(0, 2, shape, generator=gen).float()
        p0 = sign * (1.0 + odd * 2.0**-7)
        p1 = sign * torch.full(shape, 2.0**-8)
    elif kind == "zeros":
        choice = torch.randint(0, 2, (2, *shape), generator=gen).bool()
        p0 = torch.where(choice[0], -0.0, 0.0)
        p1 = torch.where(choice[1], -0.0, 0.0)
    else:
        raise ValueError(f"input kind {kind!r} is not supported")
    return p0.bfloat16(), p1.bfloat16()


# ---------------------------------------------------------------------------------------------
# Worker: one rank of one setting
# ---------------------------------------------------------------------------------------------
def worker(out: Path, device_kind: str, quick: bool, timeout_s: float) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    from detkit.toolkit.contract import compare_bits, digest

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 2:
        raise SystemExit(f"nccl_sweep worker needs exactly 2 ranks; got WORLD_SIZE={world}")
    if device_kind == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=timeout_s), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    results = {}
    for name, recipe in inputs(quick).items():
        p = partials(recipe)
        reduced = p[rank].to(device).clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        reduced = reduced.cpu()
        oracle = (p[0].float() + p[1].float()).bfloat16()
        check = compare_bits(reduced, oracle)
        results[name] = {"digest": digest(reduced), "v1_equal": check.equal, "mismatches": check.mismatches,
                         "first_mismatch": check.first_mismatch, "elements": check.elements}
    versions = {"torch": torch.__version__, "backend": dist.get_backend(),
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device_kind == "cuda" else None,
                "device": torch.cuda.get_device_name(device) if device_kind == "cuda" else "cpu"}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"versions": versions, "results": results}, indent=1))
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------
# Driver: one fresh torchrun job per setting
# ---------------------------------------------------------------------------------------------
def setting_env(name: str, device_kind: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in NCCL_KNOBS and k != "TRITON_INTERPRET"}
    env.update(COMMON_ENV)
    env.update(SETTINGS[name])
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    if device_kind == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    return env


def setting_cmd(out: Path, device_kind: str, quick: bool, timeout_s: float) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "tools.nccl_sweep", "--worker", "--out", str(out), "--device", device_kind,
           "--timeout", str(timeout_s)]
    return cmd + (["--quick"] if quick else [])


def drive(args) -> int:
    names = args.settings.split(",") if args.settings else list(SETTINGS)
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        print(f"nccl_sweep: unknown settings {unknown}; supported: {list(SETTINGS)}", file=sys.stderr)
        return 2
    out = args.out or Path("results") / f"nccl-sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.dry_run:
        for name in names:
            knobs = {**COMMON_ENV, **SETTINGS[name]}
            print(f"{name}: {' '.join(f'{k}={v}' for k, v in knobs.items())} "
                  f"{' '.join(setting_cmd(out / name, args.device, args.quick, args.timeout))}")
        print("DRY RUN: nothing launched")
        return 0
    if args.device == "cpu":
        print("nccl_sweep: --device cpu runs gloo: a plumbing check, NOT an NCCL result", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    table: dict[str, dict] = {}
    versions = None
    failures = []
    for name in names:
        sub = out / name
        proc = subprocess.run(setting_cmd(sub, args.device, args.quick, args.timeout),
                              env=setting_env(name, args.device), capture_output=True, text=True,
                              timeout=args.timeout * 2 + 120)
        sub.mkdir(parents=True, exist_ok=True)
        (sub / "log.txt").write_text(proc.stdout + "\n--- stderr\n" + proc.stderr)
        if proc.returncode != 0:
            failures.append(f"{name}: exit {proc.returncode} (log {sub / 'log.txt'})")
            print(f"{name}: FAILED exit {proc.returncode}; see {sub / 'log.txt'}", flush=True)
            continue
        ranks = [json.loads((sub / f"rank{r}.json").read_text()) for r in range(2)]
        versions = ranks[0]["versions"]
        table[name] = {}
        for inp, res in ranks[0]["results"].items():
            same = res["digest"] == ranks[1]["results"][inp]["digest"]
            table[name][inp] = {**res, "ranks_agree": same}
            print(f"{name:12s} {inp:22s} {res['digest']} v1_equal={res['v1_equal']} ranks_agree={same}", flush=True)
    inputs_names = list(inputs(args.quick))
    agree = {inp: len({table[s][inp]["digest"] for s in table}) == 1 for inp in inputs_names} if table else {}
    all_agree = bool(table) and not failures and all(agree.values()) and all(
        table[s][i]["ranks_agree"] for s in table for i in inputs_names)
    all_v1 = bool(table) and all(table[s][i]["v1_equal"] for s in table for i in inputs_names)
    print()
    print(f"{'input':22s} " + " ".join(f"{s:>14s}" for s in table) + "  agree")
    for inp in inputs_names:
        print(f"{inp:22s} " + " ".join(f"{table[s][inp]['digest'][:12]:>14s}" for s in table) + f"  {agree[inp]}")
    summary = {"device": args.device, "settings": {s: {**COMMON_ENV, **SETTINGS[s]} for s in names},
               "versions": versions, "results": table, "inputs_agree": agree, "failures": failures,
               "all_settings_agree": all_agree, "all_equal_v1_oracle": all_v1,
               "note": None if args.device == "cuda" else "gloo plumbing check: NOT an NCCL result"}
    (out / "sweep.json").write_text(json.dumps(summary, indent=1))
    print(f"all settings agree: {all_agree}; all equal the v1 oracle: {all_v1}; summary: {out / 'sweep.json'}")
    return 0 if all_agree and all_v1 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.nccl_sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="results folder (default results/nccl-sweep-<time>)")
    parser.add_argument("--settings", default="", help=f"comma-separated subset of {list(SETTINGS)}")
    parser.add_argument("--quick", action="store_true", help=f"M in {QUICK_M} instead of {FULL_M}")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: NCCL on 2 GPUs; cpu: gloo plumbing check only")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per collective / rendezvous")
    parser.add_argument("--dry-run", action="store_true", help="print each setting's command and knobs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.out, args.device, args.quick, args.timeout)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
