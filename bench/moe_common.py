"""What the MoE benchmarks share (``moe`` with its FP8 half ``moe_fp8`` and its transformers block ``moe_hf``,
``moe-sweep``): seeded inputs, the PyTorch baseline, and the timing-row helpers. Their shape presets are
toolkit.presets' MOE_PRESETS.

Baseline: ``torch._grouped_mm`` over the expert-sorted, materialised input when it runs forward and
backward on the device (probed on a small case first), otherwise a per-expert matmul loop; the row
records which and why. Both use autograd for the backward.

Formulas (T tokens, K routes each, hidden H, expert intermediate I):
    FLOPs forward          6 * T * K * H * I      (up 4*T*K*H*I, down 2*T*K*H*I)
    FLOPs backward alone   12 * T * K * H * I     (each GEMM once more for dgrad and wgrad)
    FLOPs forward+backward 18 * T * K * H * I
    TFLOP/s = FLOPs / median time;  MFU = TFLOP/s / 989 (H100/H200 datasheet dense BF16), and for the FP8 layer
    also TFLOP/s / 1979 (dense FP8)
Padding rows (each expert's segment rounded up to 128) and masked routes are not counted.
On the CPU every number is wall time of the Triton interpreter: rows say so and carry no MFU.
Nothing here imports a kernel module at import time (``--device cpu`` selects the interpreter first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from detkit.toolkit.presets import MoePreset

DATASHEET_BF16_TFLOPS = 989.0
DATASHEET_FP8_TFLOPS = 1979.0
# Both paths are BF16 pipelines a few BF16 roundings apart: ~2^-8 relative L2; a wrong route or weight is O(1).
VALIDATE_REL_L2 = 2.0**-5
INTERPRETER_LABEL = "triton_interpreter: CPU emulation at tiny shapes; NOT a hardware result (no MFU)"


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
# The PyTorch baseline (plain autograd)
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


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------
def layer_tensors(out: torch.Tensor, grads) -> dict[str, torch.Tensor]:
    """out and the backward's gradients (a MoeGrads) by name."""
    return {"out": out, "dx": grads.dx, "dw1": grads.dw1, "dw2": grads.dw2, "dscores": grads.dscores}


def timing_fields(t, flops: float = 0.0, hardware: bool = False, fp8: bool = False) -> dict[str, float]:
    """A timing's statistics (median_us, p20_us, p80_us, samples, sm_clock_mhz); on hardware with FLOPs also
    tflops = FLOPs / median time and mfu_bf16_peak = tflops / 989, and with ``fp8`` mfu_fp8_peak = tflops / 1979."""
    fields = dict(vars(t))
    if hardware and flops:
        tflops = flops / (t.median_us * 1e-6) / 1e12
        fields.update(tflops=tflops, mfu_bf16_peak=tflops / DATASHEET_BF16_TFLOPS)
        if fp8:
            fields["mfu_fp8_peak"] = tflops / DATASHEET_FP8_TFLOPS
    return fields


def with_range(name: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` called inside the NVTX range ``name``: a profile names each timed call."""
    from detkit.toolkit.nvtx_ranges import nvtx_range

    def run():
        with nvtx_range(name):
            return fn()
    return run


@dataclass(frozen=True)
class BenchCase:
    """One report row to be: ``name`` is the row's name and its NVTX range; the cases of one ``group`` (a
    preset, or one crossover T) share their inputs and are validated together before any is timed."""

    name: str
    group: str
    preset: str
    measure: str  # "fwd", "bwd", "fwd_bwd", "stage <s>"
    t: int
    routing: str = "uniform"
    impl: str = "detkit"
    timing: str = "eager"  # "eager" (CUDA events around each call) or "graph" (CUDA-graph replays)


def stage_row_name(label: str, stage: str) -> str:
    return f"{label} stage {stage}"


def time_stages(p: MoePreset, label: str, stage_fns: dict[str, tuple[Callable[[], object], float]],
                device: torch.device, rounds: int, fp8: bool = False) -> dict[str, tuple[dict, float]]:
    """Each stage alone, interleaved, with half the rounds (at least one): stage -> (timing_fields, FLOPs), the
    stage's FLOPs being its factor (stage_fns: name -> (fn, FLOPs per T*K*H*I)) times T*K*H*I. Each timed call runs
    in the NVTX range of the stage's row name."""
    from detkit.toolkit.timing import time_interleaved

    named = {s: with_range(stage_row_name(label, s), fn) for s, (fn, _) in stage_fns.items()}
    timings = time_interleaved(named, device, rounds=max(1, rounds // 2), cpu_warmup=device.type == "cuda")
    out = {}
    for s, t in timings.items():
        flops = stage_fns[s][1] * p.t * p.k * p.h * p.i
        out[s] = (timing_fields(t, flops, device.type != "cpu", fp8), flops)
    return out


def offsets_reason(p: MoePreset) -> str | None:
    """None when the kernels' 32-bit offsets cover ``p``; else why not (one line). Padded rows are at most T*K plus
    127 per expert, each max(H, 2I) wide."""
    from detkit.kernels.backend import MAX_INT32_OFFSET
    from detkit.kernels.moe.routing import SEGMENT_ALIGN

    worst = (p.t * p.k + p.e * (SEGMENT_ALIGN - 1)) * max(p.h, 2 * p.i)
    if worst > MAX_INT32_OFFSET:
        return (f"T={p.t} at H={p.h}, I={p.i}, E={p.e}, K={p.k} may need {worst} intermediate elements, beyond the "
                f"kernels' 32-bit offsets ({MAX_INT32_OFFSET}); use a smaller T")
    return None


def rel_l2_fp32(a: torch.Tensor, b: torch.Tensor) -> float:
    """toolkit.contract.rel_l2 with FP32 norms: the benchmark's tensors at the model presets are too large to copy
    to FP64 beside the layer on the GPU."""
    from detkit.toolkit.contract import rel_l2

    return rel_l2(a, b, dtype=torch.float32)
