"""The serving case: transformers' continuous batching (``generate_batch`` and its manager, the paged KV cache) read
per request, against the same request run alone and the trainer's forward.

``run_continuous_batching`` serves the prompts (greedy, or sampling at temperature 1 with the engine's seeded
sampler; a fixed number of new tokens, EOS off) and returns, per prompt, the generated tokens and the logits each was
chosen from. The logits are read where transformers reads them: a forward hook on the model keeps each step's logits
(one row per request that gets a token in that step, in the step's order), and a wrapper around the IO class's
``prepare_batch_update`` (what transformers' own update pairs those rows with requests from) names the request of
each row. That pairing needs every forward to be followed by its update: ``cb_config`` turns off asynchronous
batching and CUDA graphs (a graph replay runs no hook). ``arrivals``: request i joins once request i - 1 has produced
``arrivals[i]`` tokens (the manager's API; added from the generation loop between two steps, so the schedule does not
depend on thread timing), so requests arrive while others decode.

``alone_logits`` (``generate`` of one request, DynamicCache) and ``trainer_logits`` (one padded forward over every
prompt + completion, grad on) give the references; ``serving_check`` compares the three and counts the tokens whose
logits differ. ``unsupported`` says why a model cannot be served under the mode (transformers without the pieces
used here), before any work: the model audit's ``serving`` check (audits/model.py) reports that as not run.
Sliding-window layers are served (mode/paged_attention.py anchors each request's keys at its first token).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager

import torch

# Defaults for the checks: small pages and cache (CPU-sized), the index-based cache (no block table), the model's
# attention kept (no switch to flash attention), synchronous steps and no CUDA graphs (see the module docstring).
CB_DEFAULTS = dict(page_size=16, num_blocks=64, max_batch_tokens=64, max_blocks_per_request=0,
                   auto_switch_to_flash=False, use_async_batching=False, use_cuda_graph=False)


def cb_config(**overrides):
    """A ``ContinuousBatchingConfig`` of ``CB_DEFAULTS`` updated with ``overrides`` (a default the installed
    transformers does not have is left out; 5.17 names ``page_size`` ``block_size``; an override it does not have is
    refused by name)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    values = {}
    for name, value in {**CB_DEFAULTS, **overrides}.items():
        target = name if name in fields or name != "page_size" else "block_size"
        if target in fields:
            values[target] = value
        elif name in overrides:
            raise ValueError(f"ContinuousBatchingConfig has no field {name!r} in this transformers; it has: "
                             f"{', '.join(sorted(fields))}")
    return ContinuousBatchingConfig(**values)


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def _missing_pieces(model) -> list[str]:
    """What this module uses of transformers' continuous batching that the installed version (or ``model``) lacks."""
    missing = []
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        return ["transformers.generation.configuration_utils.ContinuousBatchingConfig"]
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    missing += [f"ContinuousBatchingConfig.{name}" for name in ("seed", "use_async_batching", "use_cuda_graph")
                if name not in fields]
    try:
        from transformers.generation.continuous_batching import input_outputs
    except ImportError:
        input_outputs = None
    ios = getattr(input_outputs, "ContinuousBatchingIOs", None)
    if ios is None or not hasattr(ios, "prepare_batch_update"):
        missing.append("continuous_batching.input_outputs.ContinuousBatchingIOs.prepare_batch_update")
    if not hasattr(model, "init_continuous_batching"):
        missing.append(f"{type(model).__name__}.init_continuous_batching")
    return missing


def unsupported(model) -> str | None:
    """Why ``model`` cannot be served through continuous batching under the mode, or None: the installed transformers
    lacks a piece this module uses (named, with the version). What the mode's paged attention refuses on a given step
    (mode/paged_attention.py) is counted, or raised under strict, when it runs."""
    missing = _missing_pieces(model)
    if missing:
        return f"transformers {transformers_version()} has no {', '.join(missing)} (continuous batching pieces used here)"
    return None


def _generation_config(max_new_tokens: int, sample: bool = False):
    """Greedy, or sampling at temperature 1 with no top-k / top-p (so the engine samples from the softmax of the raw
    logits); EOS off, so every request gets ``max_new_tokens``."""
    from transformers import GenerationConfig

    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    return GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, eos_token_id=None,
                            pad_token_id=0, **sampling)


@contextmanager
def record_logits(model, steps: list | None = None, after_update=None):
    """Yields ``rows``: request id -> the logits rows (``[V]``, the model's dtype) it got tokens from, in order.
    ``steps``, if given, gets each forward's query lengths per request (from ``cu_seq_lens_q``); ``after_update``,
    if given, is called after each step's rows are recorded, in the generation loop's thread, before the loop
    schedules its next step."""
    from transformers.generation.continuous_batching import input_outputs

    ios = getattr(input_outputs, "ContinuousBatchingIOs", None)
    if ios is None or not hasattr(ios, "prepare_batch_update"):
        raise NotImplementedError("transformers' continuous batching has no ContinuousBatchingIOs.prepare_batch_update "
                                  "in this version (the logits recorder pairs rows with requests there)")
    rows: dict[str, list[torch.Tensor]] = {}
    pending: list[torch.Tensor] = []
    original = ios.prepare_batch_update

    def hook(_module, _args, kwargs, output):
        logits = output.logits if hasattr(output, "logits") else output[0]
        pending.append(logits.detach()[0].clone())
        if steps is not None and isinstance(kwargs.get("cu_seq_lens_q"), torch.Tensor):
            bounds = kwargs["cu_seq_lens_q"].tolist()
            steps.append([b - a for a, b in zip(bounds, bounds[1:])])

    def prepare_batch_update(self):
        requests, tokens, logprobs = original(self)
        ids = [s.state.request_id for s in requests if s.has_new_token]
        if not pending:
            raise RuntimeError("a batch update with no recorded forward (CUDA graphs or async batching on?)")
        logits = pending.pop(0)
        if logits.shape[0] < len(ids):
            raise RuntimeError(f"{logits.shape[0]} logits rows for {len(ids)} requests with a new token")
        for i, rid in enumerate(ids):
            rows.setdefault(rid, []).append(logits[i])
        if after_update is not None:
            after_update()
        return requests, tokens, logprobs

    handle = model.register_forward_hook(hook, with_kwargs=True)
    ios.prepare_batch_update = prepare_batch_update
    try:
        yield rows
    finally:
        ios.prepare_batch_update = original
        handle.remove()


@contextmanager
def _no_flash_switch(model, config):
    """transformers without ``auto_switch_to_flash`` (5.17) switches an "sdpa" model to flash attention when
    flash-attn is installed, unless its implementation already names the paged one: "paged|sdpa" for the run."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if hasattr(config, "auto_switch_to_flash") or implementation != "sdpa":
        yield
        return
    model.set_attn_implementation("paged|sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(implementation)


def _collect(results, rows) -> list[tuple[list[int], torch.Tensor]]:
    out = []
    for rid, result in results:
        if result is None or getattr(result, "error", None):
            raise RuntimeError(f"request {rid} failed: {None if result is None else result.error}")
        tokens = list(result.generated_tokens)
        got = rows.get(rid, [])
        if len(got) != len(tokens):
            raise RuntimeError(f"request {rid}: {len(got)} logits rows recorded for {len(tokens)} tokens")
        out.append((tokens, torch.stack(got)))
    return out


def _in_prompt_order(outputs: dict, prompts: list[list[int]]) -> list[tuple]:
    """``generate_batch``'s outputs (request id -> result) as (request id, result), one per prompt in order (equal
    prompts take their results in the order given)."""
    by_prompt: dict[tuple, list] = {}
    for rid, result in outputs.items():
        by_prompt.setdefault(tuple(result.prompt_ids), []).append((rid, result))
    return [by_prompt[tuple(p)].pop(0) for p in prompts]


def _fatal_error(manager) -> BaseException | None:
    """The exception that ended the manager's generation thread, if one did (a strict mode's ModeNotRoutedError
    raised in a forward ends up here; the requests only carry its text)."""
    return getattr(getattr(manager, "background_thread_status", None), "fatal_error", None)


def run_continuous_batching(model, prompts: list[list[int]], max_new_tokens: int, config=None,
                            arrivals: list[int] | None = None, timeout_s: float = 1800.0, steps: list | None = None,
                            sample: bool = False):
    """Serves ``prompts`` through transformers' continuous batching; per prompt (tokens, logits ``[N, V]``).
    ``arrivals`` None: ``generate_batch`` (all submitted at once). Otherwise the manager: request 0 first, request i
    once request i - 1 has streamed ``arrivals[i]`` tokens; an exception that ends its generation thread is raised
    here as it was raised there. ``sample``: temperature-1 sampling (seed it with ``config.seed``), else greedy.
    ``steps``: see ``record_logits``."""
    config = config or cb_config()
    gen = _generation_config(max_new_tokens, sample)
    if arrivals is None:
        with record_logits(model, steps) as rows, _no_flash_switch(model, config):
            outputs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=config)
        return _collect(_in_prompt_order(outputs, prompts), rows)
    if len(arrivals) != len(prompts) or arrivals[0] != 0:
        raise ValueError(f"arrivals {arrivals} must give one count per prompt, the first 0")
    added: list[str] = []
    manager = None

    def add_due() -> None:  # request i once request i - 1 has its arrivals[i] tokens (before the next step)
        while len(added) < len(prompts) and (not added or len(rows.get(added[-1], [])) >= arrivals[len(added)]):
            i = len(added)
            added.append(f"r{i}")
            if manager.add_request(prompts[i], request_id=added[-1], max_new_tokens=max_new_tokens,
                                   streaming=True) is None:
                raise RuntimeError(f"continuous batching refused request {added[-1]}")

    with record_logits(model, steps, after_update=add_due) as rows, _no_flash_switch(model, config):
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
        add_due()  # request 0, before the loop starts
        manager.start()
        final, failed = {}, None
        try:
            deadline = time.monotonic() + timeout_s
            while len(final) < len(prompts) and failed is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"continuous batching did not finish in {timeout_s} s")
                result = manager.get_result(timeout=1.0)
                if result is None:
                    if _fatal_error(manager) is not None:
                        break
                    continue
                if result.error:
                    failed = result
                elif len(result.generated_tokens) >= max_new_tokens:
                    final[result.request_id] = result
        finally:
            manager.stop(block=True)  # joins the thread: its fatal error, if any, is recorded by now
    fatal = _fatal_error(manager)
    if fatal is not None:
        raise fatal
    if failed is not None:
        raise RuntimeError(f"request {failed.request_id} failed: {failed.error}")
    return _collect([(rid, final[rid]) for rid in added], rows)


def serve(model, prompts: list[list[int]], max_new_tokens: int, config=None) -> list[list[int]]:
    """``generate_batch`` of ``prompts`` (greedy, every request ``max_new_tokens``), nothing recorded: the call a
    serving user makes, for timing. Per prompt, its generated tokens."""
    config = config or cb_config()
    with _no_flash_switch(model, config):
        outputs = model.generate_batch(prompts, generation_config=_generation_config(max_new_tokens),
                                       continuous_batching_config=config)
    return [list(result.generated_tokens) for _, result in _in_prompt_order(outputs, prompts)]


def alone_logits(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """``generate`` of one request alone (greedy, DynamicCache): (tokens, logits ``[N, V]`` float32 as generate
    returns them)."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=_generation_config(
            max_new_tokens), output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)


def trainer_logits(model, sequences: list[list[int]], prompt_lens: list[int], max_new_tokens: int):
    """The trainer's forward (grad on) over the sequences in one right-padded batch: per sequence the logits
    ``[N, V]`` at the positions that predict its completion."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long, device=model.device)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s, device=model.device)
        mask[i, :len(s)] = 1
    with torch.enable_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return [logits[i, n - 1:n - 1 + max_new_tokens].detach() for i, n in enumerate(prompt_lens)]


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """Tokens (rows) whose logits differ in any bit (compared as float32: bf16 -> fp32 is exact)."""
    a, b = a.float(), b.float()
    if a.shape != b.shape:
        return max(a.shape[0], b.shape[0])
    return int((a.view(torch.int32) != b.view(torch.int32)).any(dim=-1).sum())


def serving_check(model, prompts: list[list[int]], max_new_tokens: int, config=None,
                  arrivals: list[int] | None = None) -> dict:
    """Serves ``prompts`` (``run_continuous_batching``) and compares each request with itself alone and with the
    trainer's forward over prompt + completion. Call it inside ``batch_invariant_mode()`` for the mode's verdict
    (outside it, the numbers are the default path's drift). Returns the counts: ``tokens_differ_alone`` (requests
    whose tokens differ from alone), ``logits_differ_alone`` / ``logits_differ_trainer`` (generated tokens whose
    logits differ in any bit), ``tokens`` (generated tokens in all)."""
    served = run_continuous_batching(model, prompts, max_new_tokens, config, arrivals)
    alone = [alone_logits(model, p, max_new_tokens) for p in prompts]
    trained = trainer_logits(model, [p + t for p, (t, _) in zip(prompts, served)], [len(p) for p in prompts],
                             max_new_tokens)
    return {
        "requests": len(prompts),
        "tokens": sum(len(t) for t, _ in served),
        "tokens_differ_alone": sum(t != ta for (t, _), (ta, _) in zip(served, alone)),
        "logits_differ_alone": sum(_differ(lg, la) for (_, lg), (_, la) in zip(served, alone)),
        "logits_differ_trainer": sum(_differ(lg, lt) for (_, lg), lt in zip(served, trained)),
    }
