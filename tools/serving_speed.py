"""transformers' continuous batching (``generate_batch``, eager steps) timed in default mode and in detkit mode, and
in detkit mode with the length tensors read on the host at every attention call (``host_values.read_every_time``):
what remembering them per step saves a serving user.

    python -m tools.serving_speed --out results/serving                  # Qwen3-8B widths, 4 layers, on cuda
    python -m tools.serving_speed --device cpu --preset qwen3-tiny --layers 1 --requests 2 --prompt-len 4 \\
        --new-tokens 2                                                   # the plumbing, on the interpreter

Each sample is one ``generate_batch`` call (``toolkit.serving.serve``: greedy, every request its ``--new-tokens``,
the same steps in every mode) of ``--requests`` prompts whose lengths spread over [prompt_len / 2, prompt_len];
the modes interleaved over ``--rounds`` rounds (``toolkit.timing.time_back_to_back``). Default mode runs the
model's "sdpa" attention as continuous batching calls it (flash SDPA where it takes the call, else memory-efficient:
``bench.model.baseline_attention``). Per mode: the median call time with p20/p80, the forward steps per call and,
in detkit mode, the host reads of the length tensors per call. Writes ``serving_speed.json`` under ``--out``. On the
interpreter the times are CPU emulation: plumbing, not speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import torch

MODES = ("default", "detkit", "detkit_read_every_call")


def prompts_of(requests: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``requests`` prompts, lengths spread evenly over [prompt_len // 2, prompt_len] (at least 1 token)."""
    gen = torch.Generator().manual_seed(seed)
    low = max(prompt_len // 2, 1)
    lengths = [low + (prompt_len - low) * i // max(requests - 1, 1) for i in range(requests)]
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def mode_contexts(model) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    from detkit.bench.model import baseline_attention
    from detkit.kernels.attention.host_values import read_every_time
    from detkit.toolkit.models import mode_context

    @contextlib.contextmanager
    def detkit_reading_every_call():
        with mode_context("detkit"), read_every_time():
            yield

    return {"default": lambda: baseline_attention(model), "detkit": lambda: mode_context("detkit"),
            "detkit_read_every_call": detkit_reading_every_call}


def measure(model, prompts: list[list[int]], new_tokens: int, config, device: torch.device, rounds: int,
            samples: int) -> dict:
    """Per mode: the timing, forward steps per call and host reads of the lengths per call."""
    from detkit.kernels.attention.host_values import host_reads
    from detkit.toolkit.serving import serve
    from detkit.toolkit.timing import time_back_to_back

    counts = {mode: {"calls": 0, "steps": 0, "host_reads": 0} for mode in MODES}
    steps = [0]  # forward calls: one a step
    hook = model.register_forward_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))

    def call(mode: str):
        def run():
            steps[0], reads = 0, host_reads()
            serve(model, prompts, new_tokens, config)
            c = counts[mode]
            c["calls"] += 1
            c["steps"] += steps[0]
            c["host_reads"] += host_reads() - reads
        return run

    try:
        timings = time_back_to_back({mode: call(mode) for mode in MODES}, device, rounds, samples_per_round=samples,
                                    contexts=mode_contexts(model),
                                    range_names={mode: f"serving | {mode}" for mode in MODES})
    finally:
        hook.remove()
    rows = {}
    for mode, t in timings.items():
        c = counts[mode]
        rows[mode] = {"median_ms": t.median_us / 1e3, "p20_ms": t.p20_us / 1e3, "p80_ms": t.p80_us / 1e3,
                      "samples": t.samples, "steps_per_call": c["steps"] / c["calls"],
                      "host_reads_per_call": c["host_reads"] / c["calls"]}
    for mode in MODES[1:]:
        rows[mode]["ratio_to_default"] = rows[mode]["median_ms"] / rows["default"]["median_ms"]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.serving_speed", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--preset", default="qwen3-8b", help="a toolkit.models preset (default qwen3-8b)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2, help="calls per mode per round")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    for name in ("layers", "requests", "prompt_len", "new_tokens", "page_size", "max_batch_tokens", "rounds",
                 "samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} is not supported; supported: >= 1")
    from detkit.toolkit.models import build_model
    from detkit.toolkit.serving import cb_config, transformers_version, unsupported

    device = torch.device(args.device)
    model, description = build_model(device, 0, args.preset, args.layers)
    reason = unsupported(model)
    if reason is not None:
        raise SystemExit(f"continuous batching is not available: {reason}")
    prompts = prompts_of(args.requests, args.prompt_len, model.config.vocab_size, seed=1)
    tokens = sum(len(p) + args.new_tokens for p in prompts)
    pages = -(-tokens // args.page_size) + len(prompts)  # every request's last page partly used
    config = cb_config(page_size=args.page_size, num_blocks=pages, max_batch_tokens=args.max_batch_tokens)
    rows = measure(model, prompts, args.new_tokens, config, device, args.rounds, args.samples)
    result = {"model": description, "layers": args.layers, "requests": args.requests,
              "prompt_lens": [len(p) for p in prompts], "new_tokens": args.new_tokens, "page_size": args.page_size,
              "num_blocks": pages, "max_batch_tokens": args.max_batch_tokens, "rounds": args.rounds,
              "samples_per_round": args.samples, "transformers": transformers_version(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
              "hardware_result": device.type == "cuda", "modes": rows}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serving_speed.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
