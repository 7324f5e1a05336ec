"""The attention forward's host time per decode step and where it goes. An eager decode step under
``batch_invariant_mode()`` is host-bound when the attention call's Python queues its work slower than the GPU runs it;
this times that Python until the work is queued, profiles it, and (CUDA) sets it beside the eager and GPU time.

    python -m tools.attention_host                          # CPU: every Triton launch a no-op (the Python alone)
    python -m tools.attention_host --profile                # + a cProfile of the mode's route per case
    python -m tools.attention_host --device cuda --json out.json   # real kernels on a Hopper GPU
    python -m tools.attention_host --model                  # + a tiny transformers Qwen3 decode step in the mode

Cases: one decode query per sequence at Qwen3-8B's attention (32 query heads, 8 KV heads, head dim 128), batch 1
and 8, 1024 and 32768 keys. Measures per case:
- ``sdpa``: ``F.scaled_dot_product_attention`` inside ``batch_invariant_mode()`` (the mode's SDPA route: checks,
  the kernels' launches), the config table's grid (one pass below ``EAGER_SPLIT_GRID_MIN_KEYS``, else the split grid);
- ``hf``: transformers' "sdpa" attention function inside ``batch_invariant_mode()`` (the mode's transformers route,
  as a model's attention layer calls it: no mask, a decode step without padding), when transformers is installed;
- ``one_pass`` / ``split``: the forward launcher (``attention_fwd_launch``) on the same call with each grid forced,
  through the launch plans; on CUDA also ``one_pass triton`` / ``split triton``: the same calls through Triton's own
  ``kernel[grid]`` (``plans=False``), the host path before launch plans;
- CUDA: ``torch``: torch's own SDPA outside the mode (its own backend choice), the baseline.
Host time (toolkit.timing.time_host): bursts of ``--calls`` back-to-back calls queued behind a GPU sleep (no call waits
for the GPU, no synchronisation inside a burst), one sample per burst (its mean per call), median with p20/p80 over
``--rounds`` bursts. CUDA adds eager time (time_back_to_back: what an eager user feels, the larger of host and GPU
time) and GPU time (time_graphs: CUDA-graph replays, operands L2-warm at 1k keys). On the CPU every Triton launch is a
no-op counted by kernel name, the sm_90 config table stands in for the interpreter's (so the route picks the GPU's
grid), and times are this thread's CPU time: the Python's order of magnitude, not the GPU host's (CPU torch ops cost
less than CUDA ones); plans and Triton's launch do not differ there (both are the no-op).
``--model``: the host time of one decode step (one token, batch 1) of a random-init transformers Qwen3 (``--layers``
layers at Qwen3-8B's attention widths, a small MLP and vocabulary) inside ``batch_invariant_mode()`` under
``torch.no_grad()``, its DynamicCache growing by a token per step as in generation (so each step's attention has a new
key length, and the layers of one step share it); same timing; on the CPU every Triton launch (GEMMs included) a
no-op, so the time is the mode's Python and CPU torch ops.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys
import time
from collections import Counter

BATCHES = (1, 8)
KEYS = (1024, 32768)
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128  # Qwen3-8B


def decode_inputs(batch: int, keys: int, device):
    """q [B, Hq, 1, D], k and v [B, Hkv, keys, D] in BF16 (CPU: uninitialised, never read by no-op launches)."""
    import torch

    def make(*shape):
        if device.type == "cpu":
            return torch.empty(shape, dtype=torch.bfloat16)
        return torch.randn(shape, device=device, dtype=torch.bfloat16)
    return make(batch, HEADS_Q, 1, HEAD_DIM), make(batch, HEADS_KV, keys, HEAD_DIM), make(batch, HEADS_KV, keys,
                                                                                           HEAD_DIM)


@contextlib.contextmanager
def gpu_table():
    """The interpreter's attention config table replaced by sm_90's for the duration (CPU, no-op launches: the tiles
    only set the grids and the split choice); the launch statics cached under it forgotten on both ends."""
    from detkit.kernels.attention import launch
    from detkit.kernels.attention.configs import CONFIG_TABLE
    from detkit.kernels.backend import CUDA_SM90, TRITON_INTERPRETER

    saved = dict(CONFIG_TABLE[TRITON_INTERPRETER])
    CONFIG_TABLE[TRITON_INTERPRETER].update(CONFIG_TABLE[CUDA_SM90])
    launch.clear_launch_plans()
    try:
        yield
    finally:
        CONFIG_TABLE[TRITON_INTERPRETER].update(saved)
        launch.clear_launch_plans()


def case_calls(batch: int, keys: int, device) -> tuple[dict, dict]:
    """(calls by measure name, the contexts they run in) for one case."""
    import dataclasses

    import torch
    import torch.nn.functional as F

    import detkit
    from detkit.kernels.attention.configs import select_configs
    from detkit.kernels.attention.launch import Sequences, attention_fwd_launch
    from detkit.kernels.backend import CUDA_SM90

    q, k, v = decode_inputs(batch, keys, device)
    base = select_configs(CUDA_SM90, HEAD_DIM)
    grids = {"one_pass": dataclasses.replace(base, split_grid_below=0),
             "split": dataclasses.replace(base, split_grid_below=2**62, eager_split_grid_min_keys=0)}
    seqs = Sequences(False, batch, 1, keys, None, None)
    scale = HEAD_DIM ** -0.5
    calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
    contexts = {"sdpa": lambda: detkit.batch_invariant_mode(strict=True)}
    for name, cfg in grids.items():
        calls[name] = lambda cfg=cfg: attention_fwd_launch(q, k, v, seqs, scale, cfg)
        if device.type == "cuda":
            calls[f"{name} triton"] = lambda cfg=cfg: attention_fwd_launch(q, k, v, seqs, scale, cfg, plans=False)
    layer_call = transformers_attention(q, k, v, scale)
    if layer_call is not None:
        calls["hf"] = layer_call
        contexts["hf"] = contexts["sdpa"]
    if device.type == "cuda":  # torch's own op: the mode, once entered, replaces F.scaled_dot_product_attention
        calls["torch"] = lambda: torch._C._nn.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return calls, contexts


def transformers_attention(q, k, v, scale: float):
    """A call of transformers' "sdpa" attention function as a decode layer makes it (looked up at call time: inside
    the mode, the mode's route), or None without transformers."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return None
    import torch
    from transformers.modeling_utils import AttentionInterface

    class Layer(torch.nn.Module):  # what transformers' attention functions read of the layer
        is_causal = True
        num_key_value_groups = HEADS_Q // HEADS_KV

    layer = Layer()
    return lambda: AttentionInterface._global_mapping["sdpa"](layer, q, k, v, None, scaling=scale, dropout=0.0)


def model_step(device, layers: int):
    """(one decode step of a tiny transformers Qwen3 at Qwen3-8B's attention widths, its context): the prompt's
    prefill runs here, under the mode; each call decodes one more token onto the growing cache."""
    import torch
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    import detkit

    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=HEADS_Q, num_key_value_heads=HEADS_KV, head_dim=HEAD_DIM,
                         vocab_size=1024, max_position_embeddings=1 << 16)
    config._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()
    cache = DynamicCache(config=model.config)
    token = torch.zeros((1, 1), dtype=torch.long, device=device)
    with torch.no_grad(), detkit.batch_invariant_mode():
        model(torch.zeros((1, 16), dtype=torch.long, device=device), past_key_values=cache, use_cache=True)

    def step():
        with torch.no_grad():
            return model(token, past_key_values=cache, use_cache=True)
    return step, detkit.batch_invariant_mode


def profile_text(fn, calls: int, top: int, context) -> str:
    profiler = cProfile.Profile()
    with context():
        fn()
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def measure_case(batch: int, keys: int, device, calls: int, rounds: int, profile: int, top: int,
                 counts: Counter) -> dict:
    from detkit.toolkit.timing import time_back_to_back, time_graphs, time_host

    cuda = device.type == "cuda"
    fns, contexts = case_calls(batch, keys, device)
    clock = time.perf_counter if cuda else time.thread_time
    host = time_host(fns, device, rounds, calls, per_call=False, warmup=3, clock=clock, contexts=contexts)
    row = {"batch": batch, "keys": keys, "measures": {}}
    for name, t in host.items():
        row["measures"][name] = {"host_us": t.median_us, "host_p20_us": t.p20_us, "host_p80_us": t.p80_us}
    if cuda:
        eager = time_back_to_back(fns, device, rounds, passes=calls, contexts=contexts)
        graphs = time_graphs({n: fns[n] for n in ("one_pass", "split", "torch")}, device, calls_per_fn=1,
                             rounds=rounds)
        for name, t in eager.items():
            row["measures"][name].update(eager_us=t.median_us, eager_p20_us=t.p20_us, eager_p80_us=t.p80_us)
        for name, t in graphs.items():
            row["measures"][name].update(gpu_us=t.median_us, gpu_p20_us=t.p20_us, gpu_p80_us=t.p80_us)
    else:
        for name, fn in fns.items():
            counts.clear()
            with contexts.get(name, contextlib.nullcontext)():
                fn()
            row["measures"][name]["launches"] = dict(counts)
    if profile:
        row["profile"] = profile_text(fns["sdpa"], profile, top, contexts["sdpa"])
    return row


def measure_model(device, calls: int, rounds: int, layers: int) -> dict:
    """Host time per decode step of ``model_step``'s model, and the mode's counters of one step."""
    import detkit
    from detkit.toolkit.timing import time_host

    step, context = model_step(device, layers)
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    t = time_host({"step": step}, device, rounds, calls, per_call=False, warmup=3, clock=clock,
                  contexts={"step": context})["step"]
    before = detkit.mode_counters()
    with context():
        step()
    counts = (detkit.mode_counters() - before).as_dict()
    return {"layers": layers, "host_us": t.median_us, "host_p20_us": t.p20_us, "host_p80_us": t.p80_us,
            "counters": counts}


def measure_all(device, calls: int, rounds: int, profile: int, top: int, model_layers: int = 0) -> dict:
    """Every case; ``profile``: calls of the route to profile per case (0: none); ``model_layers``: the decode step of
    a Qwen3 of that many layers too (0: none)."""
    import torch

    from tools.moe_host import noop_launches

    results = {"device": str(device), "heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM, "calls": calls,
               "rounds": rounds, "profile_calls": profile, "cases": []}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    counts: Counter = Counter()
    cpu = device.type == "cpu"
    with noop_launches(counts) if cpu else contextlib.nullcontext(), gpu_table() if cpu else contextlib.nullcontext():
        for batch in BATCHES:
            for keys in KEYS:
                results["cases"].append(measure_case(batch, keys, device, calls, rounds, profile, top, counts))
        if model_layers:
            results["model"] = measure_model(device, calls, rounds, model_layers)
    return results


def render(results: dict) -> str:
    from tabulate import tabulate

    cuda = results["device"].startswith("cuda")
    kind = (f"{results.get('gpu', 'CUDA')}: real kernels, host time until queued" if cuda else
            "CPU, every Triton launch a no-op (Python and CPU torch ops only; this thread's CPU time)")
    lines = [(f"attention forward host time per decode call (Hq={results['heads_q']}, Hkv={results['heads_kv']}, "
              f"D={results['head_dim']}) on {results['device']} ({kind}); median [p20-p80] of {results['rounds']} "
              f"bursts of {results['calls']} calls")]
    rows = []
    for case in results["cases"]:
        for name, m in case["measures"].items():
            row = [case["batch"], case["keys"], name,
                   f"{m['host_us']:.1f} [{m['host_p20_us']:.1f}-{m['host_p80_us']:.1f}]"]
            if cuda:
                row += [f"{m['eager_us']:.1f}" if "eager_us" in m else "",
                        f"{m['gpu_us']:.1f}" if "gpu_us" in m else ""]
            else:
                row.append(", ".join(f"{k} {v}" for k, v in sorted(m.get("launches", {}).items())))
            rows.append(row)
    headers = ["B", "keys", "measure", "host µs"] + (["eager µs", "GPU µs (graph)"] if cuda else ["launches"])
    lines.append(tabulate(rows, headers=headers, tablefmt="github"))
    if "model" in results:
        m = results["model"]
        lines.append(f"\ndecode step of a {m['layers']}-layer transformers Qwen3 (Hq={results['heads_q']}, "
                     f"Hkv={results['heads_kv']}, D={results['head_dim']}; batch 1, a growing DynamicCache) in the "
                     f"mode: host {m['host_us']:.1f} [{m['host_p20_us']:.1f}-{m['host_p80_us']:.1f}] µs per step; "
                     f"one step's counters {m['counters']}")
    for case in results["cases"]:
        if "profile" in case:
            lines.append(f"\n## sdpa B={case['batch']} keys={case['keys']}: cProfile, by own time "
                         f"({results['profile_calls']} calls)\n{case['profile']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile", action="store_true", help="a cProfile of the route per case")
    parser.add_argument("--profile-calls", type=int, default=200, help="calls per cProfile")
    parser.add_argument("--top", type=int, default=25, help="cProfile rows")
    parser.add_argument("--model", action="store_true", help="also a tiny transformers Qwen3's decode step")
    parser.add_argument("--layers", type=int, default=4, help="layers of --model's Qwen3")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1 or args.profile_calls < 1 or args.layers < 1:
        parser.error(f"--calls, --rounds, --profile-calls and --layers must be >= 1; got {args.calls}, {args.rounds}, "
                     f"{args.profile_calls}, {args.layers}")
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if device.type == "cpu":  # detkit's kernels take CPU tensors under the interpreter (read when they are defined)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    results = measure_all(device, args.calls, args.rounds, args.profile_calls if args.profile else 0, args.top,
                          args.layers if args.model else 0)
    print(render(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
