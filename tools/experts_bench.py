"""transformers' experts classes, each family at a real model's widths: its own "grouped_mm" implementation against
the same module inside ``detkit.batch_invariant_mode()`` (mode/experts.py: the fused MoE layer or the grouped path),
forward and forward+backward; validate, then time; one long-format JSON row per (family, pass, impl).

    python -m tools.experts_bench --device cuda --json OUT/experts.json                 # every family, T = 8192
    python -m tools.experts_bench --device cuda --family gpt_oss --tokens 2048          # one family (repeatable)
    python -m tools.experts_bench --device cpu --family mixtral --tiny --rounds 1       # the plumbing (interpreter)
    python -m tools.experts_bench --device cuda --family gpt_oss --profile              # + where the GPU time goes

A case: the family's experts class (transformers' own, built from its config with ``experts_implementation=
"grouped_mm"``), BF16, weights N(0, 1/fan_in), x [T, H] N(0, 1), the routing a top-K of seeded random logits (every
expert hit about evenly), routing weights softmax of the chosen logits. ``fwd``: the forward with autograd recording;
``fwd_bwd``: plus ``torch.autograd.grad`` of x and every parameter for a seeded dout. ``grouped_mm`` runs outside
the mode, ``detkit`` inside it (entered once around each round, not timed; toolkit.timing.time_interleaved, impls
interleaved round by round, L2 flushed, warm-up excluded; median, p20, p80 and the SM clock). ``path`` is the
experts row of the mode's counters (which detkit path ran). ``speedup`` = grouped_mm / detkit, same run.
Validation before timing: detkit's out and gradients against grouped_mm's, relative L2 at most VALIDATE_REL_L2
each (both are BF16 computations of the same math; a wrong layout or gate is O(1)). A tensor further apart than that
(a bias gradient: an expert's rows summed in BF16 by torch's indexing backward, in FP32 by detkit) passes when
detkit is no further than grouped_mm from an FP32 run of transformers' eager experts (both distances recorded).

``--profile``: after the timing, one forward+backward per impl under torch.profiler (tools/decode_profile.py's
``profile_steps``); its top GPU kernels by time (name, µs, calls) and the GPU total go in the JSON's ``profiles``
(family -> impl -> rows) and are printed.

On the CPU (Triton interpreter) the times are emulation: they prove the plumbing, never a speed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time

import torch

# family -> (H, I, E, K) and the transformers model it is taken from
FAMILIES = {
    "qwen3_moe": ((2048, 768, 128, 8), "Qwen3-30B-A3B"),
    "mixtral": ((4096, 14336, 8, 2), "Mixtral-8x7B"),
    "gpt_oss": ((2880, 2880, 32, 4), "gpt-oss-20b"),
    "deepseek_v3": ((7168, 2048, 64, 8), "DeepSeek-V3 widths, 64 of its 256 experts (one GPU's memory)"),
    "glm4_moe": ((4096, 1408, 128, 8), "GLM-4.5-Air"),
}
# family -> (modeling module, experts class, config class, the config's intermediate and expert-count fields)
EXPERTS_CLASSES = {
    "qwen3_moe": ("modeling_qwen3_moe", "Qwen3MoeExperts", "Qwen3MoeConfig", "moe_intermediate_size", "num_experts"),
    "mixtral": ("modeling_mixtral", "MixtralExperts", "MixtralConfig", "intermediate_size", "num_local_experts"),
    "gpt_oss": ("modeling_gpt_oss", "GptOssExperts", "GptOssConfig", "intermediate_size", "num_local_experts"),
    "deepseek_v3": ("modeling_deepseek_v3", "DeepseekV3Experts", "DeepseekV3Config", "moe_intermediate_size",
                    "n_routed_experts"),
    "glm4_moe": ("modeling_glm4_moe", "Glm4MoeExperts", "Glm4MoeConfig", "moe_intermediate_size", "n_routed_experts"),
}
TINY = (64, 32, 4, 2)
VALIDATE_REL_L2 = 2.0**-6


def build(family: str, widths, device, seed: int = 0):
    import transformers

    h, i, e, k = widths
    if family not in EXPERTS_CLASSES:
        raise ValueError(f"family {family!r} not supported; supported: {', '.join(FAMILIES)}")
    module_name, class_name, config_name, inter_field, experts_field = EXPERTS_CLASSES[family]
    cls = getattr(importlib.import_module(f"transformers.models.{family}.{module_name}"), class_name)
    config = getattr(transformers, config_name)(hidden_size=h, num_experts_per_tok=k,
                                                **{inter_field: i, experts_field: e})
    config._experts_implementation = "grouped_mm"
    with torch.device(device):
        module = cls(config).to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            fan_in = h if ("gate_up" in name or "up_proj" in name) else i
            std = 0.02 if name.endswith("bias") else fan_in**-0.5
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * std)
    return module


def inputs(widths, tokens: int, device, seed: int = 1):
    h, _, e, k = widths
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, h, generator=gen, device=device).to(torch.bfloat16)
    top, ids = torch.randn(tokens, e, generator=gen, device=device).topk(k, dim=-1)
    weights = top.softmax(-1).to(torch.bfloat16)
    dout = (torch.randn(tokens, h, generator=gen, device=device) * 0.1).to(torch.bfloat16)
    return x, ids, weights, dout


def fns(module, x, ids, weights, dout):
    params = [p for _, p in module.named_parameters()]
    leaf = x.detach().requires_grad_(True)

    def fwd():
        return module(leaf, ids, weights)

    def fwd_bwd():
        out = module(leaf, ids, weights)
        return (out, *torch.autograd.grad(out, [leaf, *params], dout))
    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def fp32_reference(module, x, ids, weights, dout) -> tuple[torch.Tensor, ...]:
    """out and the gradients of x and every parameter from an FP32 copy of ``module`` on transformers' own eager
    experts (per-expert matmuls, FP32 accumulation throughout): the yardstick when BF16 runs differ."""
    import copy

    ref = copy.deepcopy(module).float()  # its own config copy too
    ref.config._experts_implementation = "eager"
    calls = fns(ref, x.float(), ids, weights.float(), dout.float())
    out = calls["fwd_bwd"]()
    del ref
    return out


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_family(family: str, widths, tokens: int, device, rounds: int) -> list[dict]:
    import detkit
    from detkit.toolkit.timing import time_interleaved

    module = build(family, widths, device)
    x, ids, weights, dout = inputs(widths, tokens, device)
    calls = fns(module, x, ids, weights, dout)
    theirs = calls["fwd_bwd"]()
    detkit.reset_mode_counters()
    with detkit.batch_invariant_mode():
        ours = calls["fwd_bwd"]()
    counted = detkit.mode_counters().as_dict()
    path = [k for k in counted["routed"] if k.startswith("moe experts")] or list(counted["not_routed"])
    names = ["out", "x", *dict(module.named_parameters())]
    errors = {name: rel_l2(o, t) for name, o, t in zip(names, ours, theirs)}
    far = [n for n, e in errors.items() if not e <= VALIDATE_REL_L2]
    fp32 = {}
    if far:  # decided by an FP32 run of the same math: which side carries the difference
        exact = dict(zip(names, fp32_reference(module, x, ids, weights, dout)))
        fp32 = {n: {"detkit": rel_l2(ours[names.index(n)], exact[n]),
                    "grouped_mm": rel_l2(theirs[names.index(n)], exact[n])} for n in far}
        bad = {n: e for n, e in fp32.items() if not e["detkit"] <= e["grouped_mm"]}
        if bad:
            raise RuntimeError(f"{family}: detkit vs grouped_mm relative L2 above {VALIDATE_REL_L2:.3g} and further "
                               f"from the FP32 run than grouped_mm: {bad}")
    del theirs, ours
    rows = []
    for pass_name, fn in calls.items():
        timed = time_interleaved({"grouped_mm": fn, "detkit": fn}, device, rounds=rounds,
                                 contexts={"detkit": detkit.batch_invariant_mode}, cpu_warmup=False)
        base = timed["grouped_mm"].median_us
        for impl, t in timed.items():
            rows.append(dict(family=family, model=FAMILIES[family][1], h=widths[0], i=widths[1], e=widths[2],
                             k=widths[3], tokens=tokens, pass_=pass_name, impl=impl, median_us=t.median_us,
                             p20_us=t.p20_us, p80_us=t.p80_us, sm_clock_mhz=t.sm_clock_mhz,
                             speedup=base / t.median_us, path=path, max_rel_l2_vs_grouped_mm=max(errors.values()),
                             rel_l2_vs_fp32_where_far=fp32))
    return rows


def kernel_profile(fn, device, context) -> dict:
    """One call of ``fn`` (after one unprofiled warm-up) inside ``context()`` under tools/decode_profile.py's profiler
    pass: the GPU total and the top kernels by GPU time."""
    from tools.decode_profile import profile_steps

    with context():
        fn()
        prof = profile_steps(fn, device, 1)
    return {"gpu_us": prof["gpu_us"], "kernels": prof["top_gpu"]}


def profiles_of(family: str, widths, tokens: int, device) -> dict:
    """``kernel_profile`` of one forward+backward per impl (grouped_mm outside the mode, detkit inside)."""
    import contextlib

    import detkit

    module = build(family, widths, device)
    fn = fns(module, *inputs(widths, tokens, device))["fwd_bwd"]
    return {"grouped_mm": kernel_profile(fn, device, contextlib.nullcontext),
            "detkit": kernel_profile(fn, device, detkit.batch_invariant_mode)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--family", action="append", choices=tuple(FAMILIES), help="default: every family")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help=f"H, I, E, K = {TINY} (the plumbing)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--profile", action="store_true", help="also the top GPU kernels of one forward+backward")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows, profiles = [], {}
    for family in args.family or list(FAMILIES):
        widths = TINY if args.tiny else FAMILIES[family][0]
        for row in run_family(family, widths, args.tokens, device, args.rounds):
            row["pass"] = row.pop("pass_")
            rows.append(row)
            print(f"{row['family']:12} {row['pass']:8} {row['impl']:10} {row['median_us']:10.1f} us  "
                  f"x{row['speedup']:.2f}  {row['path'][0] if row['path'] else ''}")
        if args.profile:
            profiles[family] = profiles_of(family, widths, args.tokens, device)
            for impl, prof in profiles[family].items():
                print(f"{family} {impl}: {prof['gpu_us']:.0f} us of GPU time, fwd+bwd")
                for k in prof["kernels"]:
                    print(f"  {k['gpu_us']:10.1f} us {k['calls']:4.0f}x  {k['kernel'][:120]}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    meta = dict(time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), python=platform.python_version(),
                torch=torch.__version__, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                interpreter=device.type == "cpu")
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, **({"profiles": profiles} if args.profile else {})}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
