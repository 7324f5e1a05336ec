"""detkit's grouped GEMMs (kernels/grouped, what detkit mode routes ``torch._grouped_mm`` to) against
``torch._grouped_mm`` at MoE shapes: validate, then time, one long-format row per (case, op, impl).

    python -m tools.grouped_mm_bench --device cuda --json OUT/grouped.json          # the default sweep
    python -m tools.grouped_mm_bench --device cuda --case 8 4096 14336 4096          # E H I ROWS (repeatable)
    python -m tools.grouped_mm_bench --device cuda --configs                          # + candidate configs' bits/time
    python -m tools.grouped_mm_bench --device cuda --model mixtral-8x7b --tokens 2048 8192 --weights transposed kn \
        --configs --variants tma --impls torch detkit --timings graph                # pointer vs TMA, GPU time only
    python -m tools.grouped_mm_bench --device cpu --case 4 64 32 64 --rounds 1       # the plumbing (interpreter)

A case is an MoE layer's expert GEMMs: E experts, hidden H, expert width I, ROWS = T*K routes spread over the experts
by seeded uniform routing (expert-sorted, offsets int32 cumulative, as transformers' "grouped_mm" experts build
them); ``--model NAME --tokens T ...`` names the cases by a model's widths (``MODELS``: E, H, I, K) at T tokens. The
ops, with ``--weights transposed`` (the default: transformers' layout, weights stored [E, N, K] and passed as
``w.transpose(-2, -1)``):
``up`` x [ROWS, H] @ gate_up [E, 2I, H]^T -> [ROWS, 2I]; ``down`` h [ROWS, I] @ down [E, H, I]^T -> [ROWS, H];
``up_dgrad`` dy [ROWS, 2I] @ gate_up [E, 2I, H] -> [ROWS, H] (autograd's grad_input); ``up_wgrad``
dy^T [2I, ROWS] @ x [ROWS, H] -> [E, 2I, H] (autograd's grad_weight, offsets along ROWS). ``--weights kn`` stores
the weights [E, K, N] and passes them as they are (up and down read an N-contiguous B, up_dgrad a K-contiguous one;
up_wgrad does not read the weights and runs once per case). Each row names its ``weights`` and ``layout`` (the
grouped family's table key: A's then B's storage order, kernels/grouped/configs.py).

Impls: ``torch`` (torch._grouped_mm), ``detkit`` (the kernel called directly), ``detkit_mode`` (``torch._grouped_mm``
inside ``detkit.batch_invariant_mode()``: the route's host path included). Validation before timing: detkit's
result within the GEMM contract's bound against FP64 on three groups (first, largest, last non-empty), and a token's
row alone equal bit for bit to its row in the batch (up); torch's result against the same oracle, reported
(relative L2). Timing (toolkit.timing, impls interleaved round by round, warm-up excluded): ``eager_us`` one call
between CUDA events with the L2 flushed before it (``time_interleaved``: do_bench samples, the host path included),
``graph_us`` one call per CUDA-graph replay (``time_graphs``: no host path; eager on the CPU); each a median with
``*_p20_us`` / ``*_p80_us`` and the SM clock it ran at (``--timings`` picks either or both; a column not timed is
None). TFLOP/s = 2 * ROWS * N * K / graph time. ``ratio`` = the impl / torch in the same run, same rounds.
``--impls`` picks among torch, detkit and detkit_mode.

``--configs``: every candidate config of the op (``candidate_configs``: pointer and TMA variants; ``--variants``
and ``--max-candidates`` keep some) is timed as ``config<j>`` beside the pinned one, its bits compared with the
pinned config's (``same_bits_as_pinned``: every candidate must give them); a candidate that raises (e.g. TMA refusing
an operand) is reported in its row (``error``) and fails the run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

OPS = ("up", "down", "up_dgrad", "up_wgrad")
# (E, H, I, ROWS): Mixtral-8x7B (top-2), gpt-oss-20b (E 32, top-4), DeepSeek-V2-Lite-like (E 64, top-6),
# Qwen3-30B-A3B (E 128, top-8), Qwen3-235B-A22B (E 128, H 4096, I 1536, top-8); ROWS = T*K from 2048 to 65536.
SWEEP = [
    (8, 4096, 14336, 4096), (8, 4096, 14336, 16384),
    (32, 2880, 2880, 8192),
    (64, 2048, 1408, 12288),
    (128, 2048, 768, 2048), (128, 2048, 768, 16384), (128, 2048, 768, 65536),
    (128, 4096, 1536, 65536),
]
# --model: (E, H, I, K) of a model's experts; a case at T tokens has ROWS = T * K.
MODELS = {
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "gpt-oss-20b": (32, 2880, 2880, 4),
    "deepseek-v3-scaled": (64, 7168, 2048, 8),  # DeepSeek-V3's widths, 64 of its 256 experts (toolkit/models.py)
    "qwen3-30b-a3b": (128, 2048, 768, 8),
}
WEIGHTS = ("transposed", "kn")
IMPLS = ("torch", "detkit", "detkit_mode")
TIMINGS = ("eager", "graph")


def routing(e: int, rows: int, seed: int, device) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, e, (rows,), generator=gen)
    sizes = torch.bincount(ids, minlength=e).tolist()
    return torch.tensor(sizes).cumsum(0).to(torch.int32).to(device), sizes


def operands(case, device, weights: str = "transposed"):
    from detkit.toolkit.fixtures import bf16_randn

    if weights not in WEIGHTS:
        raise ValueError(f"weights {weights!r} is not supported; supported: {WEIGHTS}")
    e, h, i, rows = case
    offs, sizes = routing(e, rows, 0, device)
    x = bf16_randn((rows, h), 3, device)
    hid = bf16_randn((rows, i), 4, device)
    dy = bf16_randn((rows, 2 * i), 5, device)
    if weights == "transposed":  # transformers: stored [E, N, K], passed as w.transpose(-2, -1)
        gate_up = bf16_randn((e, 2 * i, h), 1, device, scale=h**-0.5)
        down = bf16_randn((e, h, i), 2, device, scale=i**-0.5)
        up_b, down_b, dgrad_b = gate_up.transpose(-2, -1), down.transpose(-2, -1), gate_up
    else:  # stored [E, K, N], passed as they are
        gate_up = bf16_randn((e, h, 2 * i), 1, device, scale=h**-0.5)
        down = bf16_randn((e, i, h), 2, device, scale=i**-0.5)
        up_b, down_b, dgrad_b = gate_up, down, gate_up.transpose(-2, -1)
    # (a, b, N, K) per op, in the layouts transformers and autograd pass; each op's FLOPs are 2 * rows * N * K (for
    # grad_weight, N x K is each expert's output and rows the reduced dim)
    return offs, sizes, {
        "up": (x, up_b, 2 * i, h),
        "down": (hid, down_b, h, i),
        "up_dgrad": (dy, dgrad_b, h, 2 * i),
        "up_wgrad": (dy.t(), x, h, 2 * i),
    }


def detkit_call(a, b, offs, config=None):
    from detkit.kernels.grouped import grouped_mm, grouped_wgrad

    return grouped_wgrad(a, b, offs, config=config) if b.dim() == 2 else grouped_mm(a, b, offs, config=config)


def validate(op, a, b, offs, sizes, k_len, device) -> dict:
    """detkit within the bound on three groups; torch's and detkit's relative L2 there; batch invariance (up). The FP64
    oracle runs on the operands' device (FP64 GEMMs of an expert's rows take seconds on a GPU, minutes on a CPU)."""
    from detkit.kernels.bounds import gemm_bound
    from detkit.kernels.grouped import grouped_mm, grouped_mm_ref, grouped_wgrad_ref
    from detkit.toolkit.contract import check_bound

    ours, theirs = detkit_call(a, b, offs), torch._grouped_mm(a, b, offs=offs)
    nonempty = [g for g, s in enumerate(sizes) if s]
    groups = sorted({nonempty[0], max(nonempty, key=lambda g: sizes[g]), nonempty[-1]})
    ends = offs.tolist()
    passed, worst, err_ours, err_theirs, norm = True, 0.0, 0.0, 0.0, 0.0
    for g in groups:
        s, e = (ends[g - 1] if g else 0), ends[g]
        one = torch.tensor([e - s], dtype=torch.int32)
        if b.dim() == 2:
            ga, gb = a[:, s:e], b[s:e]
            star = grouped_wgrad_ref(ga, gb, one)[0]
            abs_ab = grouped_wgrad_ref(ga.abs(), gb.abs(), one)[0]
            got, their, k = ours[g], theirs[g], e - s
        else:
            ga, gb = a[s:e], b[g:g + 1]
            star = grouped_mm_ref(ga, gb, one)
            abs_ab = grouped_mm_ref(ga.abs(), gb.abs(), one)
            got, their, k = ours[s:e], theirs[s:e], k_len
        result = check_bound(got, star, gemm_bound(star, abs_ab, k))
        passed &= result.passed
        worst = max(worst, float(((got.double() - star).abs() / gemm_bound(star, abs_ab, k)).max()))
        err_ours += float(((got.double() - star) ** 2).sum())
        err_theirs += float(((their.double() - star) ** 2).sum())
        norm += float((star**2).sum())
    out = {"within_bound": bool(passed), "worst_err_over_bound": worst,
           "rel_l2_detkit": (err_ours / norm) ** 0.5, "rel_l2_torch": (err_theirs / norm) ** 0.5}
    if op == "up":
        g = max(range(len(sizes)), key=lambda j: sizes[j])
        row = (ends[g - 1] if g else 0) + sizes[g] // 2
        alone = [0] * len(sizes)
        alone[g] = 1
        single = grouped_mm(a[row:row + 1], b, torch.tensor(alone, dtype=torch.int32).cumsum(0).to(torch.int32)
                            .to(device))
        out["row_alone_equals_batch"] = bool(torch.equal(single.view(torch.int16), ours[row:row + 1].view(torch.int16)))
    return out


GRAPH_REPLAYS = 20  # timed replays per graph and round


def candidate_configs(op, device, variants=("ptr", "tma")):
    """Configs to time beside the pinned one (each must give the pinned one's bits), pointer and TMA loads
    (``variants`` keeps some); small ones on the interpreter, whose [BLOCK_M, BLOCK_K, BLOCK_N] products must stay
    under Triton's tensor limit. The TMA candidates start with the pinned tile's twin."""
    from detkit.kernels.grouped.configs import GroupedConfig

    if device.type != "cuda":
        configs = [GroupedConfig(16, 16, 16, 4, 1), GroupedConfig(32, 16, 32, 4, 1),
                   GroupedConfig(16, 32, 16, 4, 1, variant="tma"), GroupedConfig(32, 16, 32, 4, 1, variant="tma")]
    elif op == "up_wgrad":
        configs = [GroupedConfig(128, 128, 64, 8, 3), GroupedConfig(128, 256, 32, 8, 4),
                   GroupedConfig(256, 128, 32, 8, 4), GroupedConfig(128, 128, 32, 8, 5),
                   GroupedConfig(128, 256, 64, 8, 3),
                   GroupedConfig(128, 128, 32, 8, 4, variant="tma"), GroupedConfig(128, 256, 64, 8, 3, variant="tma"),
                   GroupedConfig(128, 256, 64, 8, 4, variant="tma"), GroupedConfig(256, 128, 64, 8, 3, variant="tma"),
                   GroupedConfig(128, 128, 64, 8, 4, variant="tma"), GroupedConfig(128, 128, 64, 4, 4, variant="tma")]
    else:
        configs = [GroupedConfig(64, 128, 64, 4, 4), GroupedConfig(128, 256, 64, 8, 4),
                   GroupedConfig(256, 128, 64, 8, 3), GroupedConfig(128, 256, 32, 8, 5),
                   GroupedConfig(128, 128, 64, 8, 4),
                   GroupedConfig(128, 256, 64, 8, 3, variant="tma"), GroupedConfig(128, 256, 64, 8, 4, variant="tma"),
                   GroupedConfig(128, 128, 64, 8, 4, variant="tma")]
    return [c for c in configs if c.variant in variants]


def run_case(case, device, rounds: int, configs: bool, *, weights: str = "transposed", ops=OPS, impls=IMPLS,
             timings=TIMINGS, variants=("ptr", "tma"), max_candidates: int | None = None,
             replays: int = GRAPH_REPLAYS, label: dict | None = None) -> list[dict]:
    import detkit
    from detkit.kernels.grouped.launch import storage_layout
    from detkit.toolkit.timing import call_refusal, time_graphs, time_interleaved

    e, h, i, rows = case
    offs, sizes, operand_sets = operands(case, device, weights)
    out = []
    for op in ops:
        a, b, n, k = operand_sets[op]
        flops = 2.0 * rows * n * k
        check = validate(op, a, b, offs, sizes, k if op != "up_wgrad" else None, device)
        every = {"torch": lambda: torch._grouped_mm(a, b, offs=offs), "detkit": lambda: detkit_call(a, b, offs),
                 "detkit_mode": lambda: torch._grouped_mm(a, b, offs=offs)}
        fns = {name: every[name] for name in impls}
        contexts = {"detkit_mode": detkit.batch_invariant_mode}
        candidates = candidate_configs(op, device, variants)[:max_candidates] if configs else []
        bits, errors = {}, {}
        if candidates:
            want = detkit_call(a, b, offs).view(torch.int16)
            for j, cfg in enumerate(candidates):
                try:
                    got = detkit_call(a, b, offs, cfg)
                except Exception as exc:  # noqa: BLE001 - reported in the candidate's row, failing the run
                    errors[f"config{j}"] = call_refusal(exc)
                    continue
                bits[f"config{j}"] = bool(torch.equal(got.view(torch.int16), want))
                fns[f"config{j}"] = (lambda cfg=cfg: detkit_call(a, b, offs, cfg))
        eager = time_interleaved(fns, device, rounds=rounds, contexts=contexts) if "eager" in timings else {}
        # One call per replay: every sweep case's weights alone exceed the L2, so no rotation of operand copies. The
        # mode is entered around detkit_mode's capture (its route is recorded there; replays need nothing). On the
        # CPU time_graphs times the calls eagerly: plumbing, as every interpreter time.
        graph = (time_graphs(fns, device, calls_per_fn=1, rounds=rounds, replays=replays, contexts=contexts)
                 if "graph" in timings else {})
        base = {"case": f"E={e} H={h} I={i} rows={rows}", "op": op, "E": e, "H": h, "I": i, "rows": rows,
                "weights": weights, "layout": storage_layout(a, b), "groups_min": min(sizes),
                "groups_max": max(sizes), **(label or {})}
        first = len(out)
        for name in [*fns, *errors]:
            row = {**base, "impl": name, "validation": check if name == "detkit" else None}
            for kind, times in (("eager", eager), ("graph", graph)):
                t = times.get(name)
                row.update({f"{kind}_us": t and t.median_us, f"{kind}_p20_us": t and t.p20_us,
                            f"{kind}_p80_us": t and t.p80_us,
                            ("sm_clock_mhz" if kind == "eager" else "graph_sm_clock_mhz"): t and t.sm_clock_mhz,
                            f"{kind}_ratio_vs_torch": (t.median_us / times["torch"].median_us
                                                       if t and "torch" in times else None)})
            row["tflops_graph"] = flops / (graph[name].median_us * 1e-6) / 1e12 if name in graph else None
            if name.startswith("config"):
                row["config"] = candidates[int(name[6:])].__dict__
                row["same_bits_as_pinned"] = bits.get(name)
                row["error"] = errors.get(name)
            out.append(row)
        main_times = graph or eager
        print(f"{base['case']:>34} {weights:>10} {op:>9}: " + "  ".join(
            f"{r['impl']} " + (f"{main_times[r['impl']].median_us:.0f}us" if r["impl"] in main_times else "error")
            for r in out[first:])
            + f"  [{'ok' if check['within_bound'] else 'OUT OF BOUND'}"
            + (f", row invariant {check['row_alone_equals_batch']}" if "row_alone_equals_batch" in check else "")
            + "]", flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--case", nargs=4, type=int, action="append", metavar=("E", "H", "I", "ROWS"))
    parser.add_argument("--model", action="append", choices=sorted(MODELS),
                        help="a model's expert widths (repeatable), at each of --tokens")
    parser.add_argument("--tokens", nargs="+", type=int, default=[2048, 8192, 16384],
                        help="tokens T of the --model cases (ROWS = T * K)")
    parser.add_argument("--weights", nargs="+", choices=WEIGHTS, default=["transposed"],
                        help="the weights' storage (module docstring); up_wgrad runs with the first only")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                        help="the impls timed (torch is every ratio's baseline)")
    parser.add_argument("--timings", nargs="+", choices=TIMINGS, default=list(TIMINGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replays", type=int, default=GRAPH_REPLAYS, help="timed graph replays per impl and round")
    parser.add_argument("--configs", action="store_true", help="also time candidate configs and compare their bits")
    parser.add_argument("--variants", nargs="+", choices=("ptr", "tma"), default=["ptr", "tma"],
                        help="the candidate configs' variants (--configs)")
    parser.add_argument("--max-candidates", type=int, default=None,
                        help="the first N candidates of each op (after --variants); each is a compile per model")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if "torch" not in args.impls:
        parser.error("--impls must include torch (every ratio's baseline)")
    device = torch.device(args.device)
    cases = [(tuple(c), {}) for c in args.case or []]
    for model in args.model or []:
        e, h, i, k = MODELS[model]
        cases += [((e, h, i, t * k), {"model": model, "T": t}) for t in args.tokens]
    if not cases:
        cases = [(c, {}) for c in SWEEP]
    rows, failures = [], []
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
            "python": platform.python_version(), "device": (torch.cuda.get_device_name(device)
                                                             if device.type == "cuda" else "cpu (interpreter)"),
            "argv": sys.argv[1:] if argv is None else list(argv)}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    for case, label in cases:
        for j, weights in enumerate(args.weights):
            ops = [op for op in args.ops if j == 0 or op != "up_wgrad"]  # the weight gradient reads no weight
            if not ops:
                continue
            try:
                rows += run_case(case, device, args.rounds, args.configs, weights=weights, ops=ops,
                                 impls=args.impls, timings=args.timings, variants=args.variants,
                                 max_candidates=args.max_candidates, replays=args.replays, label=label)
            except torch.OutOfMemoryError as exc:
                failures.append({"case": case, "weights": weights,
                                 "error": f"out of memory: {str(exc).splitlines()[0]}"})
                torch.cuda.empty_cache()
            if args.json:  # after every case: a run stopped at its time limit keeps what finished
                with open(args.json, "w") as f:
                    json.dump({"meta": meta, "rows": rows, "failures": failures}, f, indent=1)
    bad = [r for r in rows if r["validation"] and (not r["validation"]["within_bound"]
                                                   or r["validation"].get("row_alone_equals_batch") is False)]
    bad += [r for r in rows if r.get("same_bits_as_pinned") is False or r.get("error")]
    print(f"{len(rows)} rows, {len(bad)} failed checks, {len(failures)} cases not run", file=sys.stderr)
    return 1 if bad or failures else 0


if __name__ == "__main__":
    sys.exit(main())
