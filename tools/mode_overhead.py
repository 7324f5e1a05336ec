"""Host time of the batch-invariant mode's own per-call path: for each op the mode routes, microseconds per call of
torch's op outside the mode, of the detkit calls the mode makes for it (called directly), and of the op inside the
mode; ``mode - direct`` is what the mode itself adds (the override's dispatch, the routing checks, the counters).

    python -m tools.mode_overhead                    # CPU BF16, the detkit kernels replaced by stand-ins
    python -m tools.mode_overhead --profile          # + cProfile of a tiny transformers Qwen3 decode step in the mode
    python -m tools.mode_overhead --device cuda      # CUDA BF16 with the real det_gemm (host time until queued)

On the CPU the kernels run under the Triton interpreter, whose cost would hide the mode's; the stand-ins
(``standin_kernels``) replace det_gemm_fwd/da/db and the attention kernel with a ``torch.empty`` of the right shape
and the row mean's Triton launch with nothing, so ``direct`` is the stand-in's own cost (for the row mean: its
wrapper's) and ``mode - direct`` the mode's. On CUDA the real
kernels run; a call's time is the Python time until its launch is queued (no synchronisation inside the timed
calls, the queue drained between batches, the GPU work small enough to keep up). Timing (toolkit.timing.time_host):
batches of ``--calls`` calls per variant, interleaved over ``--rounds`` rounds (the mode entered for its variants
only), median of the per-call means of the batches; on the CPU by default in this thread's CPU time (others' load on
a shared machine does not count), with torch on one thread.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.util
import io
import json
import os
import pstats
import sys
import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class Case:
    """One routed op: ``torch_call`` (the aten op; inside the mode it is the routed call) and ``direct_call`` (the
    detkit calls the mode makes for it, called directly)."""

    name: str
    shape: str
    torch_call: Callable[[], object]
    direct_call: Callable[[], object]


# ---------------------------------------------------------------------------------------------
# Stand-ins for the kernels (CPU)
# ---------------------------------------------------------------------------------------------
def _fake_fwd(a, b, precision=None):  # det_gemm_fwd's signature
    return a.new_empty((a.shape[0], b.shape[1]))


def _fake_da(dc, b, precision=None):
    return dc.new_empty((dc.shape[0], b.shape[0]))


def _fake_db(a, dc, precision=None):
    return a.new_empty((a.shape[1], dc.shape[1]))


def _fake_kernel(kernel):
    """A copy of the Triton kernel ``kernel`` (still its class for backend checks) whose launch (``kernel[grid](...)``)
    does nothing: the output stays as allocated."""
    import copy

    class Fake(type(kernel)):
        def __getitem__(self, grid):
            return _no_launch

    fake = copy.copy(kernel)
    fake.__class__ = Fake
    return fake


def _no_launch(*args, **kwargs):
    return None


def _fake_attention(q, k, v, *, scale=None, kv_start=None, kv_end=None, window=None, softcap=None, sinks=None,
                    configs=None):  # attention()'s signature
    b, h, s, d = q.shape
    return q.new_empty((b, s, h, d)).transpose(1, 2)  # [B, Hq, Sq, D] stored [B, Sq, Hq, D], as the kernel's


STANDINS = {"det_gemm_fwd": _fake_fwd, "det_gemm_da": _fake_da, "det_gemm_db": _fake_db,
            "row_mean_kernel": _fake_kernel, "rms_norm_kernel": _fake_kernel, "rope_kernel": _fake_kernel,
            "attention": _fake_attention}
# Modules whose attributes of those names are the kernels the mode calls (where a module binds them).
STANDIN_MODULES = ("detkit.kernels.det_gemm.launch", "detkit.kernels.reductions.row_mean",
                   "detkit.kernels.reductions.rms_norm", "detkit.kernels.rotary.rope", "detkit.kernels.attention.sdpa",
                   "detkit.mode.gemm",
                   "detkit.mode.aten", "detkit.mode.compile")


@contextlib.contextmanager
def standin_kernels():
    """det_gemm_fwd/da/db and the attention kernel replaced by ``torch.empty`` of the right shape and the row mean's
    launch by nothing, in every module that holds them, for the duration."""

    saved = []
    for module_name in STANDIN_MODULES:
        module = importlib.import_module(module_name)
        for name, fake in STANDINS.items():
            if name in vars(module):
                original = vars(module)[name]
                saved.append((module, name, original))
                setattr(module, name, fake(original) if name.endswith("_kernel") else fake)
    try:
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------
def build_cases(device, m: int, k: int, n: int, batch: int, with_transformers: bool) -> list[Case]:
    """The routed ops at ``[m, k] @ [k, n]`` (a Linear's forward and its two backward GEMMs), a bmm of ``batch``
    elements, RMSNorm's FP32 row mean, SDPA, and with transformers its attention for one decode query and a Llama
    RMSNorm module's forward under no_grad over [m, k] (torch: its eight ops; the mode: the fused kernel) and its
    ``apply_rotary_pos_emb`` on one decode query (torch: ten ops; the mode: the fused kernel)."""
    import torch
    import torch.nn.functional as F

    from detkit.kernels import reductions
    from detkit.kernels.det_gemm import launch as dg

    # The module: the package re-exports its function ``sdpa`` under the same name.
    attention_sdpa = importlib.import_module("detkit.kernels.attention.sdpa")

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device).to(dtype)

    x, weight, bias, grad = randn(m, k), randn(n, k), randn(n), randn(m, n)
    m_db = max(m, 16)  # grad_weight reduces over M: at M = 1 it is a product over one element (the exact K=1 route)
    x_db, grad_db = randn(m_db, k), randn(m_db, n)
    wt = weight.t()  # the Linear's [K, N] view: the forward's second operand
    ba, bb = randn(batch, m, 64), randn(batch, 64, m)
    rms = randn(m, k, dtype=torch.float32)
    q, kv = randn(1, 8, 1, 64), randn(1, 4, 32, 64)
    # Each lambda looks its kernel up at call time, so the stand-ins reach the direct calls too.
    cases = [
        Case("mm fwd (Linear)", f"[{m},{k}]@[{n},{k}].t()", lambda: torch.mm(x, wt), lambda: dg.det_gemm_fwd(x, wt)),
        Case("addmm fwd (Linear+bias)", f"[{m},{k}]@[{n},{k}].t()+[{n}]", lambda: torch.addmm(bias, x, wt),
             lambda: dg.det_gemm_fwd(x, wt) + bias),
        Case("mm dA (grad_input)", f"[{m},{n}]@[{n},{k}]", lambda: torch.mm(grad, weight),
             lambda: dg.det_gemm_da(grad, weight.t())),
        Case("mm dB (grad_weight)", f"[{m_db},{n}].t()@[{m_db},{k}]", lambda: torch.mm(grad_db.t(), x_db),
             lambda: dg.det_gemm_db(grad_db, x_db)),
        Case("bmm", f"[{batch},{m},64]@[{batch},64,{m}]", lambda: torch.bmm(ba, bb),
             lambda: [dg.det_gemm_da(ba[i], bb[i].t()) for i in range(batch)]),
        Case("mean.dim (RMSNorm, fp32)", f"[{m},{k}].mean(-1)", lambda: rms.mean(-1, keepdim=True),
             lambda: reductions.row_mean(rms)),
        Case("sdpa (decode)", "q [1,8,1,64], kv [1,4,32,64]",
             lambda: F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True),
             lambda: attention_sdpa.sdpa(q, kv, kv, enable_gqa=True)),
    ]
    if with_transformers:
        from transformers.modeling_utils import AttentionInterface
        from transformers.models.llama import modeling_llama
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        from detkit.kernels.reductions import rms_norm as fused_norm

        class _Module(torch.nn.Module):  # what transformers' attention functions read of the layer
            is_causal = True
            num_key_value_groups = 2

        module = _Module()
        cases.append(Case("attention (transformers, decode)", "q [1,8,1,64], kv [1,4,32,64]",
                          lambda: AttentionInterface._global_mapping["sdpa"](module, q, kv, kv, None, scaling=0.125),
                          lambda: attention_sdpa.hf_attention_forward(module, q, kv, kv, None, scaling=0.125)))
        norm, hidden = LlamaRMSNorm(k, eps=1e-6).to(device=device, dtype=torch.bfloat16), randn(m, k)

        def norm_forward():
            with torch.no_grad():
                return norm(hidden)
        cases.append(Case("RMSNorm (transformers, no grad)", f"[{m},{k}]", norm_forward,
                          lambda: fused_norm.rms_norm(hidden, norm.weight, norm.variance_epsilon)))
        from detkit.kernels import rotary

        rq, rk, rc = randn(1, 1, 32, 128).transpose(1, 2), randn(1, 1, 8, 128).transpose(1, 2), randn(1, 1, 128)
        rope_direct = rotary.rope_launcher(rq, rk, rc, rc, rotary.output_strides(rq, rk, rc,
                                                                                  rotary.apply_rotary_pos_emb_ref))

        def rope_call():  # looked up at call time, as the attention forward does: the mode's route inside it
            with torch.no_grad():
                return modeling_llama.apply_rotary_pos_emb(rq, rk, rc, rc)
        cases.append(Case("rotary (transformers, no grad)", "q [1,32,1,128], k [1,8,1,128]", rope_call,
                          lambda: rope_direct(rq, rk, rc, rc)))
    return cases


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
VARIANTS = ("torch", "direct", "mode")


def measure(cases: list[Case], calls: int, rounds: int, device, clock=time.perf_counter, warmup: int = 3) -> list[dict]:
    """Median µs per call of each case's torch op outside the mode, its direct detkit calls, and the op in the mode
    (strict, so a call the mode does not route raises), interleaved round by round (toolkit.timing.time_host: bursts
    of ``calls`` calls, one sample per burst, ``warmup`` bursts untimed). A case whose call raises gets its error in
    its row and is not timed further."""
    import detkit
    from detkit.toolkit.timing import time_host

    fns, contexts = {}, {}
    for c in cases:
        fns.update({(c.name, "torch"): c.torch_call, (c.name, "direct"): c.direct_call, (c.name, "mode"): c.torch_call})
        contexts[(c.name, "mode")] = lambda: detkit.batch_invariant_mode(strict=True)
    errors: dict = {}
    # Hundreds of launches per burst would fill the launch queue behind a GPU sleep: bursts start on an idle GPU,
    # whose work at these sizes keeps up with the host.
    timings = time_host(fns, device, rounds, calls, per_call=False, warmup=warmup * calls, clock=clock,
                        gpu_sleep_s=0.0, contexts=contexts, errors=errors)
    rows = []
    for c in cases:
        failed = [(v, errors[(c.name, v)]) for v in VARIANTS if (c.name, v) in errors]
        if failed:
            rows.append({"op": c.name, "shape": c.shape, "error": "; ".join(f"{v}: {e}" for v, e in failed)})
            continue
        med = {v: timings[(c.name, v)].median_us for v in VARIANTS}
        rows.append({"op": c.name, "shape": c.shape, "torch_us": med["torch"], "direct_us": med["direct"],
                     "mode_us": med["mode"], "mode_minus_direct_us": med["mode"] - med["direct"]})
    return rows


# ---------------------------------------------------------------------------------------------
# Profile of a transformers decode step
# ---------------------------------------------------------------------------------------------
def tiny_qwen3(device, layers: int = 4):
    """A random-init transformers Qwen3 of hidden 256 in BF16, SDPA attention."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


def profile_decode(device, steps: int, top: int, layers: int, clock=time.perf_counter) -> str:
    """``steps`` decode steps (one token, KV cache) of ``tiny_qwen3`` in the mode: the time per step
    (toolkit.timing.time_back_to_back; ``clock`` on the CPU), then under cProfile the host time per step
    (toolkit.timing.time_host, ``clock``), the totals per step and the functions with the most own time."""
    import torch
    from transformers import DynamicCache

    import detkit
    from detkit.toolkit.timing import time_back_to_back, time_host

    model = tiny_qwen3(device, layers)
    ids = torch.randint(0, 1024, (1, 8), device=device)
    with torch.no_grad(), detkit.batch_invariant_mode():
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)
        token = ids[:, -1:]
        # Warm-up of 3 steps (plans, caches, first-call imports), then one sample of ``steps`` steps back to back.
        step = {"step": lambda: model(token, past_key_values=cache, use_cache=True)}
        step_us = time_back_to_back(step, device, rounds=1, passes=steps, warmup=3, clock=clock)["step"].median_us
        detkit.reset_mode_counters()
        profiler = cProfile.Profile()
        # One burst of ``steps`` steps with the profiler on around it only (a Profile is its own context: enabled
        # on entry, disabled on exit), none untimed: the counters and the statistics are of exactly these steps.
        profiled_us = time_host(step, device, rounds=1, calls=steps, per_call=False, warmup=0, clock=clock,
                                gpu_sleep_s=0.0, contexts={"step": lambda: profiler})["step"].median_us
        counters = detkit.mode_counters().as_dict()
    stats = pstats.Stats(profiler)
    out = io.StringIO()
    routed = sum(counters["routed"].values()) // steps
    out.write(f"decode step of a {layers}-layer Qwen3 (hidden 256) in the mode, stand-in kernels: "
              f"{stats.total_calls / steps:.0f} Python function calls and {routed} routed ops per step; "
              f"{step_us:.0f} us per step ({profiled_us:.0f} us under cProfile)\n")
    out.write(f"routed per step: { {k: v // steps for k, v in counters['routed'].items()} }\n")
    stats.stream = out
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.mode_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--m", type=int, default=1, help="rows of the Linear's input (1: a decode step)")
    parser.add_argument("--k", type=int, default=None, help="Linear in-features (default 256 CPU, 4096 CUDA)")
    parser.add_argument("--n", type=int, default=None, help="Linear out-features (default 256 CPU, 4096 CUDA)")
    parser.add_argument("--batch", type=int, default=4, help="bmm elements")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed batch")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--clock", choices=["thread", "wall"], default=None,
                        help="thread: this thread's CPU time (default on the CPU: robust to a shared machine; torch "
                             "runs one thread); wall: elapsed time (default on CUDA)")
    parser.add_argument("--profile", action="store_true", help="also cProfile a tiny Qwen3 decode step in the mode")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--profile-top", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", metavar="PATH", help="also write the rows (and the profile text) as JSON")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any detkit kernel import: the CPU backend
    elif os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("--device cuda needs TRITON_INTERPRET unset")

    import torch
    from tabulate import tabulate

    device = torch.device(args.device)
    clock_name = args.clock or ("thread" if device.type == "cpu" else "wall")
    clock = time.thread_time if clock_name == "thread" else time.perf_counter
    if device.type == "cpu":
        torch.set_num_threads(1)  # every variant's work on this thread, which the thread clock sees
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible")
    k = args.k or (256 if device.type == "cpu" else 4096)
    n = args.n or (256 if device.type == "cpu" else 4096)
    with_transformers = importlib.util.find_spec("transformers") is not None
    cases = build_cases(device, args.m, k, n, args.batch, with_transformers)
    stand_in = device.type == "cpu"
    with standin_kernels() if stand_in else contextlib.nullcontext():
        rows = measure(cases, args.calls, args.rounds, device, clock)
        profile = (profile_decode(device, args.profile_steps, args.profile_top, args.layers, clock)
                   if args.profile else None)
    kernels = "stand-in kernels (torch.empty)" if stand_in else "real kernels (host time until queued)"
    title = (f"batch-invariant mode, host time per call on {device.type.upper()} BF16, {kernels}; torch "
             f"{torch.__version__}; {clock_name} clock, median of {args.rounds} rounds x {args.calls} calls")
    print(title)
    print(tabulate(rows, headers={"op": "op", "shape": "shape", "torch_us": "torch (us)",
                                  "direct_us": "detkit direct (us)", "mode_us": "in mode (us)",
                                  "mode_minus_direct_us": "mode - direct (us)", "error": "error"},
                   tablefmt="github", floatfmt=".1f"))
    if profile:
        print()
        print(profile)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"title": title, "device": args.device, "rows": rows, "profile": profile}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
