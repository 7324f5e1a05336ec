"""Benchmark of the deterministic MoE expert MLP (kernels/moe.py) against a PyTorch baseline.

    python -m detkit.bench.moe --device cuda --preset reference --preset qwen3-30b-a3b
    python -m detkit.bench.moe --device cpu --preset tiny          # Triton interpreter: plumbing only

Per preset: validate, then time. Validation runs forward + backward twice (bitwise equal) and
compares every tensor with the baseline (relative L2 <= VALIDATE_REL_L2; both are BF16 pipelines,
so they differ by a few BF16 roundings). Timing is interleaved (toolkit.timing: CUDA events, L2
flushed, warm-up excluded, median with p20/p80) for the whole layer forward and forward+backward,
routing metadata included; then each detkit stage on its own.

Baseline: ``torch._grouped_mm`` over the expert-sorted, materialised input when it runs forward and
backward on the device (probed on a small case first), otherwise a per-expert matmul loop; the row
records which and why. Both use autograd for the backward.

Formulas (T tokens, K routes each, hidden H, expert intermediate I):
    FLOPs forward          F = 6 * T * K * H * I      (up 4*T*K*H*I, down 2*T*K*H*I)
    FLOPs forward+backward 18 * T * K * H * I         (each GEMM once more for dgrad and wgrad)
    TFLOP/s = FLOPs / median time;  MFU = TFLOP/s / 989 (H100/H200 datasheet dense BF16)
Padding rows (each expert's segment rounded up to 128) and masked routes are not counted.
On the CPU every number is wall time of the Triton interpreter: rows say so and carry no MFU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

DATASHEET_BF16_TFLOPS = 989.0
VALIDATE_REL_L2 = 2.0**-5
INTERPRETER_LABEL = "triton_interpreter: CPU emulation at tiny shapes; NOT a hardware result (no MFU)"


@dataclass(frozen=True)
class MoePreset:
    name: str
    t: int  # tokens
    h: int  # hidden
    i: int  # expert intermediate
    e: int  # experts
    k: int  # routes per token

    @property
    def flops_fwd(self) -> float:
        return 6.0 * self.t * self.k * self.h * self.i

    @property
    def flops_fwd_bwd(self) -> float:
        return 18.0 * self.t * self.k * self.h * self.i

    @property
    def label(self) -> str:
        return f"moe_mlp [T={self.t}, H={self.h}, I={self.i}, E={self.e}, K={self.k}] bf16"


PRESETS = {
    "reference": MoePreset("reference", 8192, 3072, 1536, 8, 8),
    "qwen3-30b-a3b": MoePreset("qwen3-30b-a3b", 8192, 2048, 768, 128, 8),
    "qwen3-235b-a22b": MoePreset("qwen3-235b-a22b", 8192, 4096, 1536, 128, 8),
    "olmoe": MoePreset("olmoe", 8192, 2048, 1024, 64, 8),
    "mixtral-8x7b": MoePreset("mixtral-8x7b", 8192, 4096, 14336, 8, 2),
    "tiny": MoePreset("tiny", 64, 32, 48, 4, 2),  # interpreter scale
    # FP8 (bench/moe_fp8.py): the second target T, and an interpreter shape with H, I multiples of 128
    "reference-16k": MoePreset("reference-16k", 16384, 3072, 1536, 8, 8),
    "tiny-fp8": MoePreset("tiny-fp8", 64, 128, 128, 3, 2),
}
GPU_PRESETS = ("reference", "qwen3-30b-a3b", "qwen3-235b-a22b", "olmoe", "mixtral-8x7b")


def make_inputs(p: MoePreset, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Uniform top-k routing (balanced in expectation), softmax-normalised scores, scaled weights."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, device=device) * scale).to(torch.bfloat16)

    logits = torch.randn(p.t, p.e, generator=gen, device=device)
    top = torch.topk(logits, p.k, dim=1)
    return {
        "x": randn(p.t, p.h), "w1": randn(p.e, p.h, 2 * p.i, scale=p.h**-0.5),
        "w2": randn(p.e, p.i, p.h, scale=p.i**-0.5), "topk_ids": top.indices.to(torch.int32),
        "scores": torch.softmax(top.values, dim=1), "dout": randn(p.t, p.h),
    }


# ---------------------------------------------------------------------------------------------
# Baselines (plain autograd)
# ---------------------------------------------------------------------------------------------
def _sorted_routes(topk_ids: torch.Tensor, num_experts: int):
    flat = topk_ids.reshape(-1).long()
    valid = flat >= 0
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.sort(key, stable=True).indices[: int(valid.sum())]
    counts = torch.bincount(key[order], minlength=num_experts)
    return order, counts


def torch_moe_fwd(x, w1, w2, topk_ids, scores, grouped: bool) -> torch.Tensor:
    """out[t] = sum_k s[t,k] * (silu(g) * u)(x[t] @ W1[e]) @ W2[e], interleaved gate/up."""
    k = topk_ids.shape[1]
    order, counts = _sorted_routes(topk_ids, w1.shape[0])
    tok = order // k
    xs = x[tok]  # materialised in expert order
    if grouped:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gu = torch._grouped_mm(xs, w1, offs=offs)
        h = torch.nn.functional.silu(gu[:, 0::2]) * gu[:, 1::2]
        y = torch._grouped_mm(h, w2, offs=offs)
    else:
        parts, start = [], 0
        for e, c in enumerate(counts.tolist()):
            if c:
                gu = xs[start:start + c] @ w1[e]
                parts.append((torch.nn.functional.silu(gu[:, 0::2]) * gu[:, 1::2]) @ w2[e])
            start += c
        y = torch.cat(parts) if parts else xs.new_zeros(0, x.shape[1])
    weighted = y * scores.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add(0, tok, weighted)


def pick_baseline(device: torch.device) -> tuple[bool, str]:
    """(use torch._grouped_mm, why): probe forward and backward on a small case on ``device``."""
    if not hasattr(torch, "_grouped_mm"):
        return False, "per_expert_loop (torch._grouped_mm absent)"
    probe = make_inputs(MoePreset("probe", 64, 64, 64, 4, 2), device)
    try:
        leaves = [probe[n].detach().requires_grad_() for n in ("x", "w1", "w2")]
        out = torch_moe_fwd(*leaves, probe["topk_ids"], probe["scores"], grouped=True)
        out.backward(probe["dout"])
        loop = torch_moe_fwd(probe["x"], probe["w1"], probe["w2"], probe["topk_ids"], probe["scores"], grouped=False)
        if not torch.allclose(out.detach().float(), loop.float(), rtol=2**-6, atol=2**-6):
            return False, "per_expert_loop (torch._grouped_mm disagreed with the loop on the probe)"
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return False, f"per_expert_loop (torch._grouped_mm failed on {device.type}: {str(exc).splitlines()[0][:160]})"
    return True, "torch._grouped_mm"


# ---------------------------------------------------------------------------------------------
# One preset: validate, then time
# ---------------------------------------------------------------------------------------------
def layer_tensors(out: torch.Tensor, grads) -> dict[str, torch.Tensor]:
    """out and the backward's gradients (a MoeGrads) by name."""
    return {"out": out, "dx": grads.dx, "dw1": grads.dw1, "dw2": grads.dw2, "dscores": grads.dscores}


def timing_fields(key: str, t, flops: float = 0.0, hardware: bool = False) -> dict[str, float]:
    """A timing's statistics as ``key``_median_us, ...; with ``hardware`` and FLOPs, also
    ``key``_tflops = FLOPs / median time."""
    fields = {f"{key}_{f}": v for f, v in vars(t).items()}
    if hardware and flops:
        fields[f"{key}_tflops"] = flops / (t.median_us * 1e-6) / 1e12
    return fields


def time_stages(p: MoePreset, label: str, stage_fns: dict[str, tuple[Callable[[], object], float]],
                device: torch.device, rounds: int, key: str, common: dict,
                extra: dict | None = None) -> list[tuple[str, dict]]:
    """Each stage alone, interleaved, with half the rounds: (stage, row), the row being ``common``, the
    stage's name and FLOPs (stage_fns: name -> (fn, FLOPs per T*K*H*I)), ``extra``, and its timing under
    ``key``."""
    from detkit.toolkit.nvtx_ranges import nvtx_range
    from detkit.toolkit.timing import time_interleaved

    named = {s: with_range(f"{label} stage {s}", fn, nvtx_range) for s, (fn, _) in stage_fns.items()}
    timings = time_interleaved(named, device, rounds=max(1, rounds // 2))
    out = []
    for s, t in timings.items():
        flops = stage_fns[s][1] * p.t * p.k * p.h * p.i
        hardware = device.type != "cpu"
        out.append((s, {**common, "name": f"{label} stage {s}", "measure": f"stage {s}", "flops": flops,
                        **(extra or {}), **timing_fields(key, t, flops, hardware)}))
    return out


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """toolkit.contract.rel_l2 with FP32 norms: the benchmark's tensors at the model presets are too large to copy
    to FP64 beside the layer on the GPU."""
    from detkit.toolkit.contract import rel_l2

    return rel_l2(a, b, dtype=torch.float32)


def run_baseline(fn: Callable[[], dict], state: dict, baseline: str) -> tuple[dict, str]:
    """``(fn(), baseline label)``; when ``torch._grouped_mm`` (``state["grouped"]``) fails at this shape,
    ``fn`` runs once more on the per-expert loop and the label says why."""
    try:
        return fn(), baseline
    except (RuntimeError, NotImplementedError) as exc:
        if not state["grouped"]:
            raise
        state["grouped"] = False
        return fn(), f"per_expert_loop (torch._grouped_mm failed at this shape: {str(exc).splitlines()[0][:160]})"


def bench_preset(p: MoePreset, device: torch.device, rounds: int, seed: int = 0, stages: bool = True) -> list[dict]:
    from detkit.kernels.moe import (
        MOE_CONFIG_TABLE_VERSION, moe_combine, moe_dgrad_dswiglu_dscore, moe_down, moe_dscores_from_partials,
        moe_dx_route, moe_gather_sum, moe_mlp_bwd, moe_mlp_fwd, moe_up_swiglu, moe_wgrad_w1, moe_wgrad_w2,
    )
    from detkit.kernels.moe_routing import build_routing
    from detkit.toolkit.contract import compare_bits
    from detkit.toolkit.nvtx_ranges import nvtx_range
    from detkit.toolkit.timing import time_interleaved

    interpreted = device.type == "cpu"
    inp = make_inputs(p, device, seed)
    x, w1, w2, ids, scores, dout = (inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout"))
    grouped, baseline = pick_baseline(device)
    state = {"grouped": grouped}  # the validation below may still fall back to the loop

    def det_fwd():
        return moe_mlp_fwd(x, w1, w2, ids, scores, stage_range=nvtx_range)

    def det_fwd_bwd():
        out, saved = det_fwd()
        return layer_tensors(out, moe_mlp_bwd(dout, saved, stage_range=nvtx_range))

    def base_fwd():
        return torch_moe_fwd(x, w1, w2, ids, scores, state["grouped"])

    def base_fwd_bwd():
        leaves = {n: inp[n].detach().requires_grad_() for n in ("x", "w1", "w2", "scores")}
        out = torch_moe_fwd(leaves["x"], leaves["w1"], leaves["w2"], ids, leaves["scores"], state["grouped"])
        out.backward(dout)
        return {"out": out.detach(), "dx": leaves["x"].grad, "dw1": leaves["w1"].grad, "dw2": leaves["w2"].grad,
                "dscores": leaves["scores"].grad}

    with nvtx_range(f"validate {p.label}"):
        first, second = det_fwd_bwd(), det_fwd_bwd()
        base, baseline = run_baseline(base_fwd_bwd, state, baseline)
    common = {"preset": p.name, "T": p.t, "H": p.h, "I": p.i, "E": p.e, "K": p.k, "baseline": baseline,
              "config_table_version": MOE_CONFIG_TABLE_VERSION,
              "backend": "triton_interpreter" if interpreted else "cuda_sm90",
              "hardware_result": not interpreted}
    if interpreted:
        common["note"] = INTERPRETER_LABEL

    # Validated above, before any timing.
    repeat_equal = all(compare_bits(first[n], second[n]).equal for n in first)
    rel = {f"rel_l2_vs_baseline_{n}": _rel_l2(first[n], base[n]) for n in first}
    valid = repeat_equal and all(v <= VALIDATE_REL_L2 for v in rel.values())
    routing = build_routing(ids, scores, p.e)
    counts = torch.tensor(routing.counts)
    common.update({"validated": valid, "repeat_bitwise_equal": repeat_equal, **rel,
                   "padded_rows": routing.padded_rows, "routed_rows": int(counts.sum()),
                   "expert_rows_min": int(counts.min()), "expert_rows_max": int(counts.max())})
    del first, second, base
    rows = []
    if not valid:
        return [{**common, "name": p.label, "measure": "validation_failed"}]

    cases = {"fwd": (p.flops_fwd, {"detkit": det_fwd, baseline: base_fwd}),
             "fwd_bwd": (p.flops_fwd_bwd, {"detkit": det_fwd_bwd, baseline: base_fwd_bwd})}
    for measure, (flops, fns) in cases.items():
        named = {impl: with_range(f"{p.label} {measure} | {impl}", fn, nvtx_range) for impl, fn in fns.items()}
        timings = time_interleaved(named, device, rounds=rounds)
        row = {**common, "name": f"{p.label} {measure}", "measure": measure, "flops": flops}
        for impl, t in timings.items():
            key = "detkit" if impl == "detkit" else "baseline"
            row.update(timing_fields(key, t, flops, not interpreted))
            if not interpreted:
                row[f"{key}_mfu"] = row[f"{key}_tflops"] / DATASHEET_BF16_TFLOPS
        row["ratio_vs_baseline"] = row["detkit_median_us"] / row["baseline_median_us"]
        rows.append(row)

    if not stages:
        return rows
    # Each detkit stage alone (what to tune first), on the same inputs.
    out, saved = moe_mlp_fwd(x, w1, w2, ids, scores)
    b = saved.backend
    y = moe_down(saved.h, w2, routing, b)  # not saved by the layer (dscores are fused into dgrad)
    dgu, ds_part = moe_dgrad_dswiglu_dscore(dout, w2, saved.gu, saved.h, routing, b)
    dxr = moe_dx_route(dgu, w1, routing, b)
    stages = {
        "routing": (lambda: build_routing(ids, scores, p.e), 0.0),
        "up_swiglu": (lambda: moe_up_swiglu(x, w1, routing, b), 4.0),
        "down": (lambda: moe_down(saved.h, w2, routing, b), 2.0),
        "combine": (lambda: moe_combine(y, routing, scores, b), 0.0),
        "dgrad_dswiglu": (lambda: moe_dgrad_dswiglu_dscore(dout, w2, saved.gu, saved.h, routing, b), 2.0),
        "dx_route": (lambda: moe_dx_route(dgu, w1, routing, b), 4.0),
        "dx_gather_sum": (lambda: moe_gather_sum(dxr, routing, b), 0.0),
        "wgrad_w1": (lambda: moe_wgrad_w1(x, dgu, routing, b), 4.0),
        "wgrad_w2": (lambda: moe_wgrad_w2(saved.h, dout, routing, b), 2.0),
        "dscores": (lambda: moe_dscores_from_partials(ds_part, routing, b), 0.0),
    }
    for s, row in time_stages(p, p.label, stages, device, rounds, "detkit", common):
        if "detkit_tflops" in row:  # hardware, and a stage with FLOPs
            row["detkit_mfu"] = row["detkit_tflops"] / DATASHEET_BF16_TFLOPS
        rows.append(row)
    return rows


def with_range(name: str, fn: Callable[[], object], rng) -> Callable[[], object]:
    """``fn`` called inside the range ``rng(name)`` (an NVTX range: a profile names each timed call)."""
    def run():
        with rng(name):
            return fn()
    return run


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(device: torch.device, presets: list[str], rounds: int = 5, seed: int = 0,
        stages: bool = True) -> tuple[list[dict], dict]:
    """Validate and time every preset on ``device``; returns (rows, meta)."""
    from detkit.kernels.backend import resolve_backend
    from detkit.kernels.moe import moe_grouped_gemm_kernel

    backend = resolve_backend(moe_grouped_gemm_kernel, {"device": torch.empty(0, device=device)})
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        raise ValueError(f"preset(s) {unknown} not known; known: {sorted(PRESETS)}")
    meta = {
        "command_line": shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "backend": backend,
        "hardware_result": backend != "triton_interpreter",
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": __import__("triton").__version__, "commit": _git_commit(),
        "datasheet_bf16_tflops": DATASHEET_BF16_TFLOPS, "flops_formula": "fwd 6*T*K*H*I; fwd+bwd 18*T*K*H*I",
    }
    if backend == "triton_interpreter":
        meta["note"] = INTERPRETER_LABEL
    rows = []
    for name in presets:
        rows += bench_preset(PRESETS[name], device, rounds, seed, stages)
    return rows, meta


def _markdown(rows: list[dict], meta: dict) -> str:
    lines = ["# detkit bench moe", ""]
    if not meta["hardware_result"]:
        lines += [f"> **{INTERPRETER_LABEL}**", ""]
    lines += [f"- {k}: {meta[k]}" for k in ("date", "backend", "device_name", "torch", "triton", "commit")] + [""]
    cols = ("name", "baseline", "detkit_median_us", "baseline_median_us", "ratio_vs_baseline", "detkit_tflops",
            "detkit_mfu", "baseline_tflops", "validated")
    lines += markdown_table(rows, cols)
    return "\n".join(lines) + "\n"


def markdown_table(rows, cols) -> list[str]:
    """A Markdown table of ``cols``, one line per row: floats to 4 significant digits, missing cells empty."""
    from tabulate import tabulate

    return tabulate([[r.get(c) for c in cols] for r in rows], headers=list(cols), tablefmt="github",
                    floatfmt=".4g", missingval="").splitlines()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m detkit.bench.moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS),
                        help="repeat for several (default: every GPU preset on cuda, tiny on cpu)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="folder for rows.json and report.md")
    parser.add_argument("--json", action="store_true", help="print rows and meta as JSON")
    parser.add_argument("--no-stages", action="store_true", help="skip the per-stage timings")
    parser.add_argument("--fp8", action="store_true",
                        help="FP8 path vs the BF16 detkit path side by side, plus the crossover sweep (bench/moe_fp8.py)")
    parser.add_argument("--no-fp64", action="store_true", help="--fp8: gate against the BF16 path only (no FP64 oracle)")
    parser.add_argument("--no-crossover", action="store_true", help="--fp8: skip the crossover sweep over T")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        import os

        if "detkit.kernels.moe" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--device cpu needs TRITON_INTERPRET=1 before the kernels are imported")
        os.environ["TRITON_INTERPRET"] = "1"  # the kernels are imported after this (CPU = interpreter)
    elif not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA GPU; use --device cpu (interpreter, not hardware)")
    if args.fp8:
        return _main_fp8(args)
    presets = args.preset or (["tiny"] if args.device == "cpu" else list(GPU_PRESETS))
    rows, meta = run(torch.device(args.device), presets, rounds=args.rounds, seed=args.seed,
                     stages=not args.no_stages)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "rows.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str) + "\n")
        (args.out / "report.md").write_text(_markdown(rows, meta))
    print(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str) if args.json else _markdown(rows, meta))
    return 0 if all(r.get("validated") for r in rows) else 1


def _main_fp8(args) -> int:
    from detkit.bench import moe_fp8

    device = torch.device(args.device)
    presets = args.preset or (list(moe_fp8.CPU_PRESETS) if args.device == "cpu" else
                              [*moe_fp8.TARGET_PRESETS, *(p for p in GPU_PRESETS if p in moe_fp8.fp8_presets())])
    rows, meta = moe_fp8.run(device, presets, rounds=args.rounds, seed=args.seed, stages=not args.no_stages,
                             fp64=not args.no_fp64, crossover_tokens=() if args.no_crossover else None)
    meta.update({"command_line": shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "hardware_result": args.device != "cpu", "torch": torch.__version__,
                 "triton": __import__("triton").__version__, "commit": _git_commit(),
                 "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"})
    if args.device == "cpu":
        meta["note"] = INTERPRETER_LABEL
    if args.out is not None:
        moe_fp8.write(args.out, rows, meta)
    head = "# detkit bench moe --fp8\n\n" + ("" if meta["hardware_result"] else f"> **{INTERPRETER_LABEL}**\n\n")
    print(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str) if args.json
          else head + moe_fp8.markdown(rows, meta))
    return 0 if all(r.get("validated") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
