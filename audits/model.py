"""Model audit: a transformers causal LM's log-probabilities in default mode and in
``detkit.batch_invariant_mode()`` -- what an RL pipeline needs to be bitwise equal. Correctness only: the model's
speed in both modes is ``detkit bench model`` (bench/model.py).

The model (toolkit/models.py): transformers' Qwen3 built from a config with random weights in BF16 -- on cuda the
Qwen3-8B widths with 2 layers, on cpu a tiny config for the Triton interpreter -- or the model named by
``DETKIT_MODEL_CONFIG``: a preset name (``MODEL_PRESETS``: per family real widths with 2 layers and a tiny config,
e.g. ``qwen3-8b`` / ``qwen3-tiny``, ``qwen3-moe-30b-a3b`` / ``qwen3-moe-tiny``), a JSON config file, or a checkpoint
directory read with local_files_only (nothing is ever downloaded) -- or several: ``families`` (every family of
``FAMILIES``: Llama-3, Qwen2.5, Qwen3, Qwen3-MoE, Mistral, Gemma-2, Gemma-3, Phi-3, OLMo-2, gpt-oss, DeepSeek-V3,
Mixtral, GLM-4-MoE; real widths with 2 layers on cuda, tiny on cpu), a family name, or a comma-separated list of
presets and families: the family matrix, every model's rows named ``<preset>: ...`` and a family x check table in
``model.md`` / ``model.json``. ``DETKIT_MODEL_MOE_EXPERTS`` (``bf16``, the
default, or ``fp8``) is the mode's ``moe_experts``: the precision of detkit's layer under a MoE model's experts.
Checks, each run in both modes (detkit mode's rows pass or fail; default mode's rows are the drift table,
informational):

- ``batch_invariance``: a sequence's log-probs alone vs in batches of several sizes at several positions;
- ``padding``: the same with right and left padding (attention masks; left padding with position ids);
- ``trainer_vs_rollout``: a training forward (grad on, micro-batches) vs an inference forward of the batch;
- ``decode_vs_trainer``: prompt prefill then token-by-token greedy decode with transformers' DynamicCache, alone
  and in a batch, vs the trainer's one forward over prompt + generation, per generated token. It fails while
  any attention call of the check ran on torch (e.g. no ``detkit.kernels.attention`` in the tree);
- ``generate``: ``model.generate()`` sampling (temperature 1, seeded) from a left-padded batch of prompts of
  different lengths with ``output_logits=True``, vs the trainer's forward over prompt + completion (right padding,
  grad on, micro-batches): the completion tokens' log-probs;
- ``routing`` (a MoE model): every routing decision of that generate call (each token's top-k expert ids at every
  MoE layer, from forward pre-hooks on the experts modules) vs the trainer's forward, counted;
- ``serving``: the same prompts served by transformers' continuous batching (toolkit/serving.py: the manager, the
  paged KV cache), request i arriving once request i - 1 has sampled a token or more (``Plan.arrivals``), at most
  ``Plan.step_tokens`` tokens a step (prefills split into chunks, sharing steps with decodes), sampling at
  temperature 1 with the engine's seeded sampler; each request's sampled tokens' log-probs (from the logits the
  engine computed, read by a forward hook) vs the trainer's forward over prompt + completion (right padding, grad
  on, micro-batches). Not run -- a failed row saying why -- for a transformers without the continuous-batching
  pieces used (named, with its version); sliding-window layers run (their requests anchored at their first token);
- ``backward_repeat``: every parameter gradient of a cross-entropy backward (plus the router's load-balancing
  loss where transformers adds one), bitwise across two runs;
- ``strict``: detkit mode's checks each run first under ``batch_invariant_mode(strict=True)``; the row fails naming
  every refusal (a refused check runs again without strict, so its comparison is still reported);
- when a detkit-mode comparison differs, forward hooks on every module name the first module whose outputs
  differ (``first_divergence``);
- ``counters``: which ops ran on detkit kernels and which on torch, with the reasons (a GEMM or a MoE block
  on torch, or a MoE block on the other precision's layer, fails the row);
- ``moe_precision`` (a MoE model with FP8 experts): the first MoE block's output and gradients (x, router,
  gate_up_proj, down_proj) in detkit mode with FP8 experts against detkit mode with BF16 experts, the same
  tokens and routing: the FP8 layer's precision gate (cosine and relative RMSE, toolkit/moe_gate.py).
Log-probs are compared as FP32 bits (``toolkit.contract.compare_bits``). Besides the rows, ``model.md`` and
``model.json`` in the output folder hold the drift table, the counters and the FP8 precision.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from detkit.toolkit.contract import compare_bits
from detkit.toolkit.harness import Row, RunContext, atomic_write_text
from detkit.toolkit.models import (
    ALL_FAMILIES, BLOCK_TENSORS, CONFIG_ENV, FAMILIES, MODEL_PRESETS, MODES, build_model, cache_kwarg, experts_modules,
    family_of, fp8_graph_weights_choice, mode_context, model_specs, moe_block_grads, moe_blocks,
    moe_experts_choice, moe_meta, routing_check,
)

NAME = "model"
DESCRIPTION = ("transformers model log-probs, default vs detkit mode: batch invariance, padding, trainer vs rollout, "
               "KV-cache decode vs trainer, generate and continuous batching vs trainer, backward repeat, drift, routed "
               "ops, FP8 experts' precision")
ATTENTION_OPS = ("sdpa", "attention (transformers)", "attention (transformers continuous batching)")
# Checks whose rollout decodes with a KV cache: they fail while attention ran on torch, whose reduction over the keys
# depends on the query count (bits equal on one host say nothing of another's).
DECODE_CHECKS = ("decode_vs_trainer", "generate", "routing", "serving")
log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Plan:
    """Sizes of one audit run."""

    seq_len: int  # tokens per sequence (batch invariance, trainer vs rollout, backward)
    batch_sizes: tuple[int, ...]
    pad: int  # padding tokens of the padded sequence
    train_batch: int
    micro_batch: int  # the trainer's micro-batch size
    prompt_len: int
    gen_len: int
    decode_batch: int
    precision_tokens: int = 2048  # tokens through one MoE block for the FP8-vs-BF16 precision check
    page_size: int = 16  # the serving check's KV-cache pages (tokens)

    def prompt_lens(self) -> list[int]:
        """The generate check's prompt lengths, one per sequence of the decode batch: from prompt_len down to about
        half of it (at least 2), so the left-padded batch has different lengths."""
        b, p = self.decode_batch, self.prompt_len
        return [max(2, p - (i * (p // 2)) // max(b - 1, 1)) for i in range(b)]

    def arrivals(self) -> list[int]:
        """The serving check's schedule: request i joins once request i - 1 has sampled ``arrivals()[i]`` tokens
        (1, 2, 3, 1, ... below gen_len), so every request after the first prefills while another decodes."""
        cycle = max(1, min(3, self.gen_len - 1))
        return [0] + [1 + (i - 1) % cycle for i in range(1, self.decode_batch)]

    def step_tokens(self) -> int:
        """The serving check's tokens per step (max_batch_tokens): one fewer than the longest prompt, so that prompt
        is prefilled in two chunks and a prompt arriving beside a decode may be split."""
        return max(2, self.prompt_len - 1)


# The interpreter's single-model plan: every case (a batch, both paddings, trainer micro-batches, decode steps,
# prompts of two lengths, two requests sharing a serving step) at the fewest tokens, since CI runs it in the README's
# main job on two cores.
CPU_PLAN = Plan(seq_len=6, batch_sizes=(3,), pad=2, train_batch=2, micro_batch=1, prompt_len=3, gen_len=2,
                decode_batch=2, precision_tokens=64, page_size=4)
CUDA_PLAN = Plan(seq_len=256, batch_sizes=(4, 16), pad=37, train_batch=8, micro_batch=2, prompt_len=64, gen_len=24,
                 decode_batch=8)
# The family matrix (several models in one run): on the interpreter the smallest plan that still has every case (a
# batch, both paddings, micro-batches, decode steps, prompts of two lengths); on cuda the single-model plan with
# fewer sequences and decode steps, sized for 13 models in about 8 minutes on one GPU (not measured yet).
MATRIX_CPU_PLAN = Plan(seq_len=5, batch_sizes=(2,), pad=2, train_batch=2, micro_batch=1, prompt_len=3, gen_len=2,
                       decode_batch=2, precision_tokens=64, page_size=4)
MATRIX_CUDA_PLAN = Plan(seq_len=256, batch_sizes=(8,), pad=37, train_batch=4, micro_batch=2, prompt_len=64,
                        gen_len=16, decode_batch=4)
NOT_COVERED = (
    "attention kernels other than detkit.kernels.attention (torch SDPA backends, split-KV decode kernels) and "
    "transformers' eager attention (its softmax spans the key count)",
    "tensor and data parallelism (one process here: `--suite model-parallel` runs the TP and DP paths across ranks), "
    "FP8 GEMMs outside the MoE experts (torch._scaled_mm is neither routed nor counted); FP16 and FP32 GEMMs run on "
    "det_gemm",
    "reductions other than the last-dim mean (softmax / log_softmax are per-row in torch: not overridden)",
    "MoE: transformers' Qwen3-MoE block on detkit's MoE layer; other MoE classes run transformers' experts, their "
    "torch._grouped_mm calls (forward and backward) on detkit's grouped GEMM and their combine / router sums on "
    "torch; FP8 experts only where H and I are multiples of 128 (else counted); expert parallelism "
    "(counted); the router's softmax / top-k stay on torch (row-wise); the load-balancing loss is a batch statistic "
    "(run to run, not batch-invariant); FP8 weight gradients are not batch-invariant (their 128-row scale blocks "
    "span tokens; run to run they repeat)",
    "the first-divergence hooks compare module outputs; differences in ops between modules show as the next module "
    "(the serving check has none)",
    "continuous batching (serving): transformers' block-table decode path, CUDA graphs and asynchronous batching "
    "(the check turns them off to pair each step's logits with its requests), prefix sharing "
    "(tests/test_mode_continuous_batching.py has it, the audit's random prompts share no pages)",
)


# ---------------------------------------------------------------------------------------------
# Log-probs
# ---------------------------------------------------------------------------------------------
def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B, S-1] FP32 log-probability of token t+1 under the logits at t."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None])[..., 0]


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def forward_logits(model, ids, mask=None, position_ids=None, grad=False) -> torch.Tensor:
    with (torch.enable_grad() if grad else torch.inference_mode()):
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
    return out.logits.detach() if grad else out.logits


# ---------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------
@dataclass
class Comparison:
    check: str
    case: str
    equal: bool
    elements: int
    mismatches: int
    max_abs: float
    p99_abs: float | None
    first_mismatch: tuple[int, ...] | None
    extra: dict

    def details(self) -> dict:
        return {"case": self.case, "elements": self.elements, "mismatches": self.mismatches,
                "max_abs_diff": self.max_abs, "p99_abs_diff": self.p99_abs,
                "first_mismatch": self.first_mismatch, **self.extra}


QUANTILE_MAX = 2**24  # torch.quantile's input limit; larger differences are sampled at a fixed stride


def _p99(diff: torch.Tensor) -> float:
    flat = diff.reshape(-1).float()
    if flat.numel() == 0:
        return 0.0
    if flat.numel() > QUANTILE_MAX:
        flat = flat[:: -(-flat.numel() // QUANTILE_MAX)]
    return float(torch.quantile(flat, 0.99))


def compare(check: str, case: str, got: torch.Tensor, want: torch.Tensor, **extra) -> Comparison:
    bits = compare_bits(got.contiguous(), want.contiguous())
    diff = (got.double() - want.double()).abs()
    return Comparison(check, case, bits.equal, bits.elements, bits.mismatches,
                      float(diff.max()) if diff.numel() else 0.0, _p99(diff), bits.first_mismatch, extra)


class Recorder:
    """Forward hooks on every module: the first tensor of each call's output, cut by ``select``, in call order."""

    def __init__(self, model, select: Callable[[torch.Tensor], torch.Tensor | None], call: int | None = None):
        self.records: list[tuple[str, torch.Tensor]] = []
        self.select, self.call, self.calls = select, call, -1
        self.handles = [model.register_forward_pre_hook(self._count)]
        for name, module in model.named_modules():
            if name and not isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                self.handles.append(module.register_forward_hook(self._hook(name)))

    def _count(self, module, args):
        self.calls += 1

    def _hook(self, name):
        def hook(module, args, output):
            if self.call is not None and self.calls != self.call:
                return
            tensor = _first_tensor(output)
            if tensor is not None:
                cut = self.select(tensor)
                if cut is not None:
                    self.records.append((name, cut.detach().clone()))
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor)), None)
    for key in ("logits", "last_hidden_state"):
        if getattr(output, key, None) is not None:
            return getattr(output, key)
    return None


def first_divergence(model, run_a: Callable[[], None], select_a, run_b: Callable[[], None], select_b,
                     call_a: int | None = None, call_b: int | None = None) -> dict:
    """Run both, recording every module's output; the first module (in call order) whose outputs differ."""
    recorders = []
    for run, select, call in ((run_a, select_a, call_a), (run_b, select_b, call_b)):
        rec = Recorder(model, select, call)
        try:
            run()
        finally:
            rec.close()
        recorders.append(rec.records)
    a, b = recorders
    for (name_a, ta), (name_b, tb) in zip(a, b):
        if name_a != name_b:
            return {"first_divergence": None, "note": f"call order differs at {name_a} / {name_b}"}
        if ta.shape != tb.shape or ta.dtype != tb.dtype or not compare_bits(ta, tb).equal:
            return {"first_divergence": name_a, "modules_compared": len(a)}
    return {"first_divergence": None, "modules_compared": min(len(a), len(b)),
            "note": "every module output equal (the difference is after the model, or in ops outside modules)"}


def _batch_select(index: int, batch: int, seq: slice | int = slice(None)):
    """Cut row ``index`` of a batch of ``batch`` (a tensor broadcast over the batch, leading dim 1: its only
    row) at sequence positions ``seq``; None for tensors without a batch dim or too short a second dim for ``seq``
    (a module's output in another layout: DeepSeek-V3's MLA projections at a decode step)."""
    def select(t):
        if t.dim() < 2 or t.shape[0] not in (batch, 1):
            return None
        if isinstance(seq, int) and not -t.shape[1] <= seq < t.shape[1]:
            return None
        return t[index if t.shape[0] == batch else 0, seq]
    return select


# ---------------------------------------------------------------------------------------------
# The checks (each returns Comparisons; ``mode`` decides only the context)
# ---------------------------------------------------------------------------------------------
class Audit:
    def __init__(self, model, device: torch.device, plan: Plan, seed: int, moe_experts: str = "bf16",
                 fp8_graph_weights: str = "quantize"):
        self.model, self.device, self.plan = model, device, plan
        self.moe_experts, self.fp8_graph_weights, self.seed = moe_experts, fp8_graph_weights, seed
        self.vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(seed)
        self.seqs = torch.randint(3, self.vocab, (max(max(plan.batch_sizes), plan.train_batch) + 1, plan.seq_len),
                                  generator=gen).to(device)
        self.prompts = torch.randint(3, self.vocab, (plan.decode_batch, plan.prompt_len), generator=gen).to(device)
        self.cache_kwarg = cache_kwarg(model)

    def lp(self, ids, mask=None, position_ids=None, grad=False):
        return token_logprobs(forward_logits(self.model, ids, mask, position_ids, grad), ids)

    def batch_invariance(self, locate: bool) -> list[Comparison]:
        seq = self.seqs[:1]
        alone = self.lp(seq)
        out = []
        for bs in self.plan.batch_sizes:
            for pos in sorted({0, bs // 2, bs - 1}):
                others = self.seqs[1:bs]
                batch = torch.cat([others[:pos], seq, others[pos:]])
                got = self.lp(batch)[pos:pos + 1]
                cmp = compare("batch_invariance", f"batch {bs} position {pos}", got, alone)
                if locate and not cmp.equal:
                    cmp.extra.update(first_divergence(
                        self.model, lambda: self.lp(seq), _batch_select(0, 1), lambda: self.lp(batch),
                        _batch_select(pos, bs)))
                out.append(cmp)
        return out

    def padding(self) -> list[Comparison]:
        n, pad = self.plan.seq_len, self.plan.pad
        short = self.seqs[:1, : n - pad]
        alone = self.lp(short)
        others = self.seqs[1:3]
        out = []
        for side in ("right", "left"):
            pad_ids = torch.zeros(1, pad, dtype=short.dtype, device=self.device)
            row = torch.cat([short, pad_ids], 1) if side == "right" else torch.cat([pad_ids, short], 1)
            ids = torch.cat([row, others])
            mask = torch.ones_like(ids)
            if side == "right":
                mask[0, n - pad:] = 0
            else:
                mask[0, :pad] = 0
            position_ids = positions_from_mask(mask)
            lp = self.lp(ids, mask, position_ids)[:1]
            got = lp[:, : n - pad - 1] if side == "right" else lp[:, pad:]
            out.append(compare("padding", f"{side} padding {pad} of {n} tokens, batch 3", got, alone))
        return out

    def trainer_vs_rollout(self, locate: bool) -> list[Comparison]:
        ids = self.seqs[: self.plan.train_batch]
        rollout = self.lp(ids)
        self.model.train()
        try:
            trainer = torch.cat([self.lp(part, grad=True) for part in torch.split(ids, self.plan.micro_batch)])
        finally:
            self.model.eval()
        cmp = compare("trainer_vs_rollout", f"batch {len(ids)}: inference forward vs training forward (grad on, "
                      f"micro-batches of {self.plan.micro_batch})", trainer, rollout)
        if locate and not cmp.equal:
            row = cmp.first_mismatch[0]
            part, idx = divmod(row, self.plan.micro_batch)
            micro = torch.split(ids, self.plan.micro_batch)[part]
            cmp.extra.update(first_divergence(self.model, lambda: self.lp(ids), _batch_select(row, len(ids)),
                                              lambda: self.lp(micro, grad=True), _batch_select(idx, len(micro))))
        return [cmp]

    def rollout(self, prompts) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy prefill + decode with a DynamicCache: (generated tokens [B, G], their log-probs [B, G])."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        tokens, lps = [], []
        with torch.inference_mode():
            logits = self.model(input_ids=prompts, use_cache=True, **{self.cache_kwarg: cache}).logits[:, -1]
            for step in range(self.plan.gen_len):
                logp = torch.log_softmax(logits.float(), dim=-1)
                nxt = logp.argmax(-1)
                tokens.append(nxt)
                lps.append(logp.gather(-1, nxt[:, None])[:, 0])
                if step + 1 < self.plan.gen_len:
                    logits = self.model(input_ids=nxt[:, None], use_cache=True,
                                        **{self.cache_kwarg: cache}).logits[:, -1]
        return torch.stack(tokens, 1), torch.stack(lps, 1)

    def decode_vs_trainer(self, locate: bool) -> list[Comparison]:
        p, g = self.plan.prompt_len, self.plan.gen_len
        alone_tokens, alone_lp = self.rollout(self.prompts[:1])
        batch_tokens, batch_lp = self.rollout(self.prompts)
        seqs = torch.cat([torch.cat([self.prompts, batch_tokens], 1), torch.cat([self.prompts[:1], alone_tokens], 1)])
        self.model.train()
        try:
            trainer = self.lp(seqs, grad=True)[:, p - 1: p - 1 + g]
        finally:
            self.model.eval()
        out = []
        for case, got, rows in (("alone", alone_lp, slice(len(seqs) - 1, None)), ("batch", batch_lp, slice(0, -1))):
            cmp = compare("decode_vs_trainer", f"{case}: prefill {p} + {g} decode steps (DynamicCache) vs one "
                          f"training forward over {p + g} tokens", got, trainer[rows])
            if locate and not cmp.equal and case == "alone":
                step = cmp.first_mismatch[1]
                prompts, seq = self.prompts[:1], seqs[-1:]

                def run_rollout():
                    self.rollout(prompts)

                cmp.extra.update(first_divergence(
                    self.model, run_rollout, _batch_select(0, 1, p - 1 if step == 0 else 0),
                    lambda: self.lp(seq, grad=True), _batch_select(0, 1, p - 1 + step), call_a=step, call_b=0))
                cmp.extra["located_step"] = step
            out.append(cmp)
        return out

    def generate(self) -> list[Comparison]:
        """``model.generate()`` sampling (temperature 1, no top-k / top-p, seeded) from a left-padded batch of prompts
        of different lengths, ``output_logits=True``; then the trainer's forward (grad on, micro-batches of
        ``plan.micro_batch``, not the rollout's batch) over each prompt + completion, right-padded. The completion
        tokens' log-probs (log_softmax in FP32 of generate's raw logits) against the trainer's; for a MoE model also
        every routing decision (each token's top-k expert ids at every MoE layer) of the rollout's forwards against
        the trainer's. min_new_tokens = max_new_tokens, so no sequence stops early (EOS is masked for the sampler
        only: the raw logits are compared)."""
        lens, g = self.plan.prompt_lens(), self.plan.gen_len
        batch, width = len(lens), max(lens)
        ids = torch.zeros(batch, width, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for b, n in enumerate(lens):
            ids[b, width - n:] = self.prompts[b, :n]
            mask[b, width - n:] = 1
        routing = RoutingRecorder(self.model)
        try:
            torch.manual_seed(self.seed + 29)  # the sampler's draws (every device's generator)
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                          top_k=0, top_p=1.0, max_new_tokens=g, min_new_tokens=g, pad_token_id=0,
                                          output_logits=True, return_dict_in_generate=True)
            rollout_routes = routing.take()
            completion = out.sequences[:, width:]  # [B, g]
            if completion.shape[1] != g or len(out.logits) != g:
                raise RuntimeError(f"generate returned {completion.shape[1]} tokens and {len(out.logits)} logits for "
                                   f"max_new_tokens = min_new_tokens = {g}")
            logp = torch.log_softmax(torch.stack(out.logits, 1).float(), dim=-1)  # [B, g, V]
            rollout = logp.gather(-1, completion[..., None])[..., 0]
            trainer = self.trainer_completion(lens, completion)
            trainer_routes = routing.take()
        finally:
            routing.close()
        length = width + g
        case = (f"generate (sampling, temperature 1) from {batch} left-padded prompts of {min(lens)}-{max(lens)} "
                f"tokens + {g} tokens vs the trainer's forward (right padding, grad on, micro-batches of "
                f"{self.plan.micro_batch})")
        out_cmps = [compare("generate", case, rollout, trainer, tokens=int(completion.numel()))]
        if routing.names:
            out_cmps.append(routing_comparison(routing.names, rollout_routes, trainer_routes, lens, width, g,
                                               self.plan.micro_batch, length))
        return out_cmps

    def trainer_completion(self, lens: list[int], completion: torch.Tensor) -> torch.Tensor:
        """The trainer's log-probs ``[B, g]`` of each completion (``completion [B, g]``) after its prompt (the first
        ``lens[b]`` tokens of ``self.prompts[b]``): one forward per micro-batch of ``plan.micro_batch`` sequences
        (not the rollout's batch), right-padded, grad on, training mode."""
        g = completion.shape[1]
        seqs = torch.zeros(len(lens), max(lens) + g, dtype=torch.long, device=self.device)
        tmask = torch.zeros_like(seqs)
        for b, n in enumerate(lens):
            seqs[b, :n], seqs[b, n:n + g] = self.prompts[b, :n], completion[b]
            tmask[b, :n + g] = 1
        self.model.train()
        try:
            micro = self.plan.micro_batch
            parts = [self.lp(s, m, positions_from_mask(m), grad=True)
                     for s, m in zip(torch.split(seqs, micro), torch.split(tmask, micro))]
        finally:
            self.model.eval()
        trainer_lp = torch.cat(parts)
        return torch.stack([trainer_lp[b, n - 1: n - 1 + g] for b, n in enumerate(lens)])

    def serving(self) -> list[Comparison]:
        """The generate check's prompts served by transformers' continuous batching (toolkit/serving.py): request i
        joins once request i - 1 has sampled ``plan.arrivals()[i]`` tokens, at most ``plan.step_tokens()`` tokens a
        step, pages of ``plan.page_size``; sampling at temperature 1 (no top-k / top-p) by the engine's seeded
        sampler, EOS off. The log-probs of each request's sampled tokens (log_softmax in FP32 of the logits the
        engine sampled from, read by a forward hook and paired with requests where transformers pairs them) against
        the trainer's forward over prompt + completion (``trainer_completion``). A model ``serving.unsupported``
        names a reason for is not run: one failed comparison carrying ``not_run``. transformers' own failure is a
        failed comparison carrying ``error``; a strict mode's refusal in the engine's thread is raised as such."""
        from detkit.mode.state import ModeNotRoutedError
        from detkit.toolkit import serving

        lens, g = self.plan.prompt_lens(), self.plan.gen_len
        arrivals, page, step_tokens = self.plan.arrivals(), self.plan.page_size, self.plan.step_tokens()
        case = (f"continuous batching (sampling, temperature 1): {len(lens)} requests of {min(lens)}-{max(lens)} "
                f"prompt tokens + {g}, request i arriving once request i - 1 has {arrivals[1:]} tokens, <= "
                f"{step_tokens} tokens a step, pages of {page} vs the trainer's forward (right padding, grad on, "
                f"micro-batches of {self.plan.micro_batch})")
        extra = {"transformers": serving.transformers_version(), "requests": len(lens), "arrivals": arrivals,
                 "max_batch_tokens": step_tokens, "page_size": page}
        reason = serving.unsupported(self.model)
        if reason is not None:
            return [Comparison("serving", case, False, 0, 0, 0.0, None, None, {**extra, "not_run": reason})]
        prompts = [self.prompts[b, :n].tolist() for b, n in enumerate(lens)]
        pages = len(lens) * -(-(max(lens) + g) // page)  # every request's pages at once, the worst case
        config = serving.cb_config(page_size=page, num_blocks=max(serving.CB_DEFAULTS["num_blocks"], pages + 1),
                                   max_batch_tokens=step_tokens, seed=self.seed + 31)
        steps: list[list[int]] = []
        try:
            served = serving.run_continuous_batching(self.model, prompts, g, config, arrivals, steps=steps,
                                                     sample=True)
        except ModeNotRoutedError:
            raise
        except Exception as exc:  # transformers' engine failed on this model: the row says how
            log.exception("serving: transformers' continuous batching failed")
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            return [Comparison("serving", case, False, 0, 0, 0.0, None, None, {**extra, "error": error})]
        completion = torch.tensor([tokens for tokens, _ in served], dtype=torch.long, device=self.device)  # [B, g]
        logits = torch.stack([rows for _, rows in served])  # [B, g, V], the model's dtype
        logp = torch.log_softmax(logits.float(), dim=-1)
        rollout = logp.gather(-1, completion[..., None])[..., 0]
        trainer = self.trainer_completion(lens, completion)
        extra.update(steps=len(steps), shared_steps=sum(1 for q in steps if len(q) > 1),
                     tokens=int(completion.numel()))
        return [compare("serving", case, rollout, trainer, **extra)]

    def backward_repeat(self) -> list[Comparison]:
        ids = self.seqs[: self.plan.train_batch]
        # The router's load-balancing loss where transformers adds one (Qwen3-MoE, Mixtral, gpt-oss).
        aux = bool(experts_modules(self.model)) and hasattr(self.model.config, "router_aux_loss_coef")
        runs = []
        for _ in range(2):
            self.model.zero_grad(set_to_none=True)
            with torch.enable_grad():
                out = self.model(input_ids=ids, use_cache=False, **({"output_router_logits": True} if aux else {}))
                loss = F.cross_entropy(out.logits[:, :-1].float().reshape(-1, self.vocab), ids[:, 1:].reshape(-1))
                if aux:  # as transformers adds it to the loss
                    loss = loss + self.model.config.router_aux_loss_coef * out.aux_loss
                loss.backward()
            runs.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None})
        self.model.zero_grad(set_to_none=True)
        differing, mismatches, elements, max_abs = [], 0, 0, 0.0
        for name, grad in runs[0].items():
            bits = compare_bits(grad, runs[1][name])
            elements += bits.elements
            if not bits.equal:
                differing.append(name)
                mismatches += bits.mismatches
                max_abs = max(max_abs, float((grad.double() - runs[1][name].double()).abs().max()))
        what = "cross-entropy + router aux loss" if aux else "cross-entropy"
        cmp = Comparison("backward_repeat", f"every parameter gradient ({what}), batch {len(ids)}, two runs",
                         not differing,
                         elements, mismatches, max_abs, None, None,
                         {"parameters": len(runs[0]), "parameters_differing": len(differing),
                          "first_parameter_differing": differing[0] if differing else None})
        return [cmp]

    def all_checks(self, locate: bool, strict: bool = False) -> Iterator[Comparison]:
        """Every check; with ``strict`` each runs under ``batch_invariant_mode(strict=True)`` first, and a check the
        mode refuses runs again without strict (its comparison still reported), the refusals kept in
        ``self.refusals`` (check -> the error's message) for the ``strict`` row."""
        self.refusals: dict[str, str] = {}
        checks = (("batch_invariance", lambda: self.batch_invariance(locate)), ("padding", self.padding),
                  ("trainer_vs_rollout", lambda: self.trainer_vs_rollout(locate)),
                  ("decode_vs_trainer", lambda: self.decode_vs_trainer(locate)), ("generate", self.generate),
                  ("serving", self.serving), ("backward_repeat", self.backward_repeat))
        for name, check in checks:
            if strict:
                from detkit.mode.state import ModeNotRoutedError
                from detkit.mode.switch import batch_invariant_mode

                try:
                    with batch_invariant_mode(strict=True):
                        results = check()
                except ModeNotRoutedError as exc:
                    self.refusals[name] = str(exc)
                    results = check()
            else:
                results = check()
            yield from results


class RoutingRecorder:
    """Forward pre-hooks on every MoE experts module: the routing each call receives (the first integer tensor of
    its arguments, ``top_k_index`` [T, K] in every transformers MoE family), per module, in call order."""

    def __init__(self, model):
        self.names = list(experts_modules(model))
        self.calls: dict[str, list[torch.Tensor]] = {n: [] for n in self.names}
        self.handles = [module.register_forward_pre_hook(self._hook(name), with_kwargs=True)
                        for name, module in experts_modules(model).items()]

    def _hook(self, name):
        def hook(module, args, kwargs):
            ids = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)
                        and not t.is_floating_point() and t.dim() == 2), None)
            if ids is not None:
                self.calls[name].append(ids.detach().clone())
        return hook

    def take(self) -> dict[str, list[torch.Tensor]]:
        calls, self.calls = self.calls, {n: [] for n in self.names}
        return calls

    def close(self):
        for h in self.handles:
            h.remove()


def routing_comparison(names, rollout: dict, trainer: dict, lens: list[int], width: int, g: int, micro: int,
                       length: int) -> Comparison:
    """Each real token's top-k expert ids at every MoE layer: the rollout's (generate's prefill over the left-padded
    prompts, [B * width] routes, then one call per decode step, [B]) against the trainer's (one call per
    micro-batch, [micro * length] routes, right-padded). The last completion token is never fed to the rollout, so
    each sequence has prompt + g - 1 decisions per layer. A decision differs when any of its K ids does."""
    decisions = mismatches = 0
    first = None
    for layer, name in enumerate(names):
        got, want = rollout[name], trainer[name]
        if len(got) != g or not want:
            raise RuntimeError(f"{name}: {len(got)} routing calls in generate (want {g}: prefill + {g - 1} decode "
                               f"steps) and {len(want)} in the trainer's forward")
        k = got[0].shape[-1]
        prefill = got[0].view(len(lens), width, k)
        steps = torch.stack([c.view(len(lens), k) for c in got[1:]], 1) if g > 1 else prefill[:, :0]
        trained = torch.cat([c.view(-1, length, k) for c in want])
        for b, n in enumerate(lens):
            ours = torch.cat([prefill[b, width - n:], steps[b]])  # [n + g - 1, K]
            theirs = trained[b, : n + g - 1]
            differ = (ours != theirs).any(-1)
            decisions += differ.numel()
            mismatches += int(differ.sum())
            if first is None and differ.any():
                first = (layer, b, int(differ.nonzero()[0, 0]))
    return Comparison("routing", f"each token's top-k expert ids at {len(names)} MoE layer(s): generate's forwards vs "
                      "the trainer's", mismatches == 0 and decisions > 0, decisions, mismatches, None, None,
                      first, {"moe_layers": names, "decisions": decisions, "decisions_differing": mismatches})


# ---------------------------------------------------------------------------------------------
# FP8 experts: precision against BF16 experts
# ---------------------------------------------------------------------------------------------
def moe_precision(audit: Audit) -> dict:
    """The first MoE block, the same tokens and output gradient in detkit mode with FP8 and with BF16 experts
    (the router is the same in both, so is the routing): per tensor, cosine and relative RMSE of FP8 against BF16,
    and whether they pass the FP8 layer's precision gate. A block the FP8 layer refuses is an error entry."""
    from detkit.mode.state import ModeNotRoutedError
    from detkit.toolkit.contract import cosine, rel_l2
    from detkit.toolkit.moe_gate import GATE_MAX_REL_RMSE, GATE_MIN_COSINE

    block = moe_blocks(audit.model)[0]
    gen = torch.Generator().manual_seed(audit.seed + 17)
    shape = (1, audit.plan.precision_tokens, audit.model.config.hidden_size)
    x = torch.randn(shape, generator=gen).to(device=audit.device, dtype=torch.bfloat16)
    dout = torch.randn(shape, generator=gen).to(device=audit.device, dtype=torch.bfloat16)
    try:
        bf16, ids_bf16 = moe_block_grads(block, x, dout, "bf16")
        fp8, ids_fp8 = moe_block_grads(block, x, dout, "fp8")
    except ModeNotRoutedError as exc:
        return {"error": str(exc)}
    same_routing = torch.equal(ids_bf16, ids_fp8)
    stats = {}
    for name in BLOCK_TENSORS:
        cos, rel = cosine(fp8[name], bf16[name]), rel_l2(fp8[name], bf16[name])
        stats[name] = {"cosine_vs_bf16_experts": cos, "rel_rmse_vs_bf16_experts": rel,
                       "passed": same_routing and cos >= GATE_MIN_COSINE and rel < GATE_MAX_REL_RMSE}
    return {"tokens": shape[1], "same_routing": same_routing, "min_cosine": GATE_MIN_COSINE,
            "max_rel_rmse": GATE_MAX_REL_RMSE, "tensors": stats}


# ---------------------------------------------------------------------------------------------
# The plug-in
# ---------------------------------------------------------------------------------------------
def _row(ctx: RunContext, check: str, name: str, passed: bool, details: dict) -> Row:
    return Row(suite=NAME, check=check, name=name, passed=passed, backend=ctx.backend, details=details)


def _attention_kernel_present() -> bool:
    from detkit.mode.attention import attention_module

    return attention_module() is not None


def run(ctx: RunContext) -> Iterator[Row]:
    """One model (DETKIT_MODEL_CONFIG names one, or the default) with its rows named as always, or the family
    matrix (``families`` or a comma-separated list): every model's rows, named ``<preset>: ...``, and the family x
    check table in model.md / model.json."""
    experts = moe_experts_choice()  # refused here, before the model is built
    graph_weights = fp8_graph_weights_choice()
    specs = model_specs(ctx.device)  # an unknown name in a list is refused here too
    if not is_matrix(os.environ.get(CONFIG_ENV)):
        plan = CPU_PLAN if ctx.device.type == "cpu" else CUDA_PLAN
        spec = specs[0] if specs[0] in MODEL_PRESETS else None  # a file or directory: model_source reads the env
        result = yield from audit_one(ctx, spec, plan, experts, graph_weights)
        if ctx.out_dir is not None:
            write_model_report(Path(ctx.out_dir), result["meta"], result["drift"], result["counters"],
                               result["precision"])
        return
    plan = MATRIX_CPU_PLAN if ctx.device.type == "cpu" else MATRIX_CUDA_PLAN
    results = []
    for spec in specs:
        start = time.perf_counter()
        try:
            result = yield from audit_one(ctx, spec, plan, experts, graph_weights, prefix=f"{spec}: ")
        except Exception as exc:  # a model that cannot be built or run: its failed row, then the next model
            log.exception("model %s", spec)
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            yield _row(ctx, "model", f"{spec}: model could not be audited", False, {"spec": spec, "error": error})
            result = {"spec": spec, "error": error}
        result["spec"], result["family"] = spec, family_of(spec)
        result["seconds"] = round(time.perf_counter() - start, 1)  # the model's build and both modes' checks
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()  # the next model's widths differ: give the last one's cached blocks back
        results.append(result)
        if ctx.out_dir is not None:  # after every model, so a run stopped at its time limit keeps what finished
            write_matrix_report(Path(ctx.out_dir), results, plan, ctx.backend)


def is_matrix(value: str | None) -> bool:
    """A DETKIT_MODEL_CONFIG value that runs the family matrix: ``families``, a family name or a comma-separated
    list (a preset name, a JSON file or a directory alone runs one model, its rows named as always)."""
    names = [n.strip() for n in (value or "").split(",") if n.strip()]
    return "," in (value or "") or any(n == ALL_FAMILIES or n in FAMILIES for n in names)


def audit_one(ctx: RunContext, spec: str | None, plan: Plan, experts: str, graph_weights: str, prefix: str = ""):
    """One model's rows (each name prefixed with ``prefix``); returns its meta, drift, counters, precision and the
    strict run's refusals."""
    from detkit.mode.switch import mode_counters

    model, description = build_model(ctx.device, ctx.seed, spec)
    audit = Audit(model, ctx.device, plan, ctx.seed, experts, graph_weights)
    gaps = list(MODEL_PRESETS[spec].gaps) if spec in MODEL_PRESETS else []
    meta = {"model": description, "layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size,
            "attn_implementation": model.config._attn_implementation, "moe": moe_meta(model),
            "moe_layers": list(experts_modules(model)), "plan": plan.__dict__,
            "attention_kernel_present": _attention_kernel_present(), "gaps": gaps}
    if meta["moe"] is not None:
        meta["moe"]["detkit_experts"] = experts
        meta["moe"]["fp8_graph_weights"] = graph_weights
    yield _row(ctx, "model", f"{prefix}model {description}", True, meta)
    drift: list[dict] = []
    detkit_counters = None
    for mode in MODES:
        start = mode_counters()
        with mode_context(mode, experts, graph_weights):
            for cmp in audit.all_checks(locate=True, strict=mode == "detkit"):
                entry = {"mode": mode, "check": cmp.check, **cmp.details()}
                drift.append(entry)
                if mode == "default":
                    yield _row(ctx, "default_drift", f"{prefix}default {cmp.check} {cmp.case}", True,
                               {"informational": "torch's kernels; the drift the mode removes", **entry})
                    continue
                passed = cmp.equal
                if cmp.check in DECODE_CHECKS and "not_run" not in entry:
                    attention = {k: n for k, n in (mode_counters() - start).not_routed.items() if k[0] in ATTENTION_OPS}
                    if attention:
                        passed = False
                        entry["reason"] = "attention ran on torch's kernels, whose reduction over the keys depends on q_len"
                        entry["attention_not_routed"] = {f"{op}: {reason}": n for (op, reason), n in attention.items()}
                entry["passed"] = passed
                yield _row(ctx, cmp.check, f"{prefix}detkit {cmp.check} {cmp.case}", passed, entry)
        if mode == "detkit":
            detkit_counters = mode_counters() - start
            refusals = dict(audit.refusals)
            strict = {"mode": "detkit", "check": "strict", "refusals": refusals, "passed": not refusals,
                      "case": "every check under batch_invariant_mode(strict=True)"}
            drift.append(strict)
            yield _row(ctx, "strict", f"{prefix}detkit strict: every check under batch_invariant_mode(strict=True), "
                       "nothing refused", not refusals, strict)
    counters = detkit_counters.as_dict()
    passed, routing = routing_check(counters, meta["moe"] is not None, experts)
    details = {**counters, **routing}
    precision = None
    yield _row(ctx, "counters", f"{prefix}detkit mode: ops on detkit kernels and on torch", passed, details)
    if meta["moe"] is not None and experts == "fp8":
        precision = moe_precision(audit)
        if "error" in precision:
            yield _row(ctx, "moe_precision", f"{prefix}moe_precision first MoE block: FP8 vs BF16 experts", False,
                       precision)
        for name, st in precision.get("tensors", {}).items():
            yield _row(ctx, "moe_precision", f"{prefix}moe_precision {name} first MoE block, {precision['tokens']} "
                       "tokens: FP8 vs BF16 experts", st["passed"],
                       {**{k: v for k, v in precision.items() if k != "tensors"}, **st})
    del audit, model
    return {"meta": meta, "drift": drift, "counters": counters, "counters_passed": passed, "routing_check": routing,
            "precision": precision}


# The family matrix's columns: the detkit-mode checks, in the order they run.
MATRIX_CHECKS = ("strict", "batch_invariance", "padding", "trainer_vs_rollout", "decode_vs_trainer", "generate",
                 "routing", "serving", "backward_repeat", "counters")


def _short(text: str, limit: int = 110) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def matrix_cell(result: dict, check: str) -> str:
    """pass / FAIL with the first reason / "n/a" (no MoE layer for routing) / "not run: ..." (serving) / "error" for
    one family x check; generate, routing and serving carry the differing count beside default mode's."""
    if "error" in result:
        return "error"
    if check == "counters":
        if result["counters_passed"]:
            return "pass"
        misses = {**result["routing_check"].get("gemm_not_routed", {}), **result["routing_check"].get(
            "moe_not_routed", {})}
        return "FAIL: " + _short(next(iter(misses), "no MoE block on detkit's layer"))
    entries = [e for e in result["drift"] if e["check"] == check]
    ours = [e for e in entries if e["mode"] == "detkit"]
    if not ours:
        return "n/a"
    if check == "strict":
        refusals = ours[0]["refusals"]
        if not refusals:
            return "pass"
        first = next(iter(refusals.values())).split("cannot run on a detkit kernel: ", 1)[-1]
        return f"FAIL ({len(refusals)} check(s) refused): " + _short(first)
    failed = [e for e in ours if not e["passed"]]
    verdict = "pass" if not failed else "FAIL"
    if check == "serving" and ours[0].get("not_run"):
        return "not run: " + _short(ours[0]["not_run"])
    if check == "serving" and ours[0].get("error"):
        return "FAIL: " + _short(ours[0]["error"])
    if check in ("generate", "routing", "serving"):
        theirs = [e for e in entries if e["mode"] == "default"]
        what = "decisions" if check == "routing" else "log-probs"

        def count(es):
            error = next((e["error"] for e in es if e.get("error")), None)
            return ("error: " + _short(error, 60)) if error else \
                f"{sum(e['mismatches'] for e in es)}/{sum(e['elements'] for e in es)}"

        reason = next((e["reason"] for e in failed if e.get("reason")), None)
        return (f"{verdict}: {count(ours)} {what} differ (default mode: {count(theirs)})"
                + (f"; {_short(reason)}" if reason else ""))
    if not failed:
        return "pass"
    e = failed[0]
    if e.get("reason"):
        return "FAIL: " + _short(e["reason"])
    return f"FAIL: {e['mismatches']}/{e['elements']} differ" + (
        f", first at {e['first_divergence']}" if e.get("first_divergence") else "")


def merge_matrix_reports(out_dir: Path, parts: list[Path]) -> None:
    """One family matrix from the model.json of several matrix runs (tools/gpu/model_families.sh runs a family per
    process); a part without one (its run stopped before a model finished) is listed as such."""
    results, plan, backend = [], None, "cuda_sm90"
    for part in parts:
        path = part / "model.json"
        if not path.is_file():
            results.append({"spec": part.name, "family": part.name, "error": f"no {path} (the run did not finish)"})
            continue
        data = json.loads(path.read_text())
        results += data["models"]
        plan, backend = data.get("plan", plan), data.get("backend", backend)
    write_matrix_report(out_dir, results, plan, backend)


def write_matrix_report(out_dir: Path, results: list[dict], plan: Plan | dict | None, backend: str) -> None:
    """model.md / model.json of a family matrix: the family x check table, what each family misses and why, then
    every model's ops on torch."""
    from tabulate import tabulate

    table = [{"family": r["family"], "preset": r["spec"], **{c: matrix_cell(r, c) for c in MATRIX_CHECKS},
              "seconds": r.get("seconds")} for r in results]
    where = ("CPU, Triton interpreter (not a hardware result)" if backend == "triton_interpreter" else backend)
    plan = plan.__dict__ if isinstance(plan, Plan) else plan
    lines = ["# Model audit: family matrix (detkit mode; default mode's counts beside generate, routing and serving)",
             "",
             f"- backend: {where}", f"- plan: {plan}", "",
             tabulate(table, headers="keys", tablefmt="github"), "", "## Missing, with the reason", ""]
    missing = [f"- {r['spec']}: {gap}" for r in results for gap in r.get("meta", {}).get("gaps", [])]
    missing += [f"- {r['spec']}: could not be audited: {r['error']}" for r in results if "error" in r]
    lines += missing or ["- none"]
    lines += ["", "## Ops on torch in detkit mode (op: reason: calls)", ""]
    for r in results:
        if "error" in r:
            continue
        lines += [f"- {r['spec']}: " + ("none" if not r["counters"]["not_routed"] else "; ".join(
            f"{k}: {n}" for k, n in r["counters"]["not_routed"].items()))]
    lines += ["", "## Not covered", ""] + [f"- {item}" for item in NOT_COVERED]
    atomic_write_text(out_dir / "model.md", "\n".join(lines) + "\n")
    atomic_write_text(out_dir / "model.json", json.dumps({"backend": backend, "plan": plan, "matrix": table,
                                                          "models": results}, indent=2, default=str) + "\n")


def write_model_report(out_dir: Path, meta: dict, drift: list[dict], counters: dict,
                       precision: dict | None = None) -> None:
    from tabulate import tabulate

    table = [{**{k: e.get(k) for k in ("mode", "check", "case", "mismatches", "elements", "max_abs_diff",
                                       "p99_abs_diff", "first_divergence")},
              "note": _short(e.get("not_run") or e.get("error") or e.get("reason") or "", 80)} for e in drift]
    lines = ["# Model audit: default vs detkit mode", "", f"- model: {meta['model']}",
             f"- detkit.kernels.attention present: {meta['attention_kernel_present']}",
             *([f"- MoE: {meta['moe']}"] if meta.get("moe") else []), "",
             "## Drift (FP32 log-prob bits; max / p99 |difference|: log-probs, or gradients for backward_repeat)",
             "",
             tabulate(table, headers="keys", tablefmt="github", floatfmt=".3g"), "",
             "## Ops in detkit mode", "", "On detkit kernels (op -> kernel: calls):", ""]
    lines += [f"- {k}: {n}" for k, n in counters["routed"].items()] or ["- none"]
    lines += ["", "On torch (op: reason: calls):", ""]
    lines += [f"- {k}: {n}" for k, n in counters["not_routed"].items()] or ["- none"]
    if precision is not None:
        lines += ["", "## MoE precision: FP8 vs BF16 experts (first MoE block, detkit mode)", ""]
        if "error" in precision:
            lines += [f"- error: {precision['error']}"]
        else:
            lines += [f"{precision['tokens']} tokens, same routing: {precision['same_routing']}; gate: cosine >= "
                      f"{precision['min_cosine']}, relative RMSE < {precision['max_rel_rmse']}", "",
                      tabulate([{"tensor": n, **st} for n, st in precision["tensors"].items()], headers="keys",
                               tablefmt="github", floatfmt=".4g")]
    lines += ["", "## Not covered", ""] + [f"- {item}" for item in NOT_COVERED]
    atomic_write_text(out_dir / "model.md", "\n".join(lines) + "\n")
    atomic_write_text(out_dir / "model.json", json.dumps({"meta": meta, "drift": drift, "counters": counters,
                                                           "moe_precision": precision},
                                                          indent=2, default=str) + "\n")
