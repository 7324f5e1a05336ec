"""Model audit: a transformers causal LM's log-probabilities in default mode and in
``detkit.batch_invariant_mode()`` -- what an RL pipeline needs to be bitwise equal. Correctness only: the model's
speed in both modes is ``detkit bench model`` (bench/model.py).

The model (toolkit/models.py): transformers' Qwen3 built from a config with random weights in BF16 -- on cuda the
Qwen3-8B widths with 2 layers, on cpu a tiny config for the Triton interpreter -- or the model named by
``DETKIT_MODEL_CONFIG``: a preset name (``MODEL_PRESETS``: the dense Qwen3 8B widths and tiny config, and the
Qwen3-MoE ones, Qwen3-30B-A3B widths with 2 layers and a tiny MoE config), a JSON config file, or a checkpoint
directory read with local_files_only (nothing is ever downloaded). ``DETKIT_MODEL_MOE_EXPERTS`` (``bf16``, the
default, or ``fp8``) is the mode's ``moe_experts``: the precision of detkit's layer under a MoE model's experts.
Checks, each run in both modes (detkit mode's rows pass or fail; default mode's rows are the drift table,
informational):

- ``batch_invariance``: a sequence's log-probs alone vs in batches of several sizes at several positions;
- ``padding``: the same with right and left padding (attention masks; left padding with position ids);
- ``trainer_vs_rollout``: a training forward (grad on, micro-batches) vs an inference forward of the batch;
- ``decode_vs_trainer``: prompt prefill then token-by-token greedy decode with transformers' DynamicCache, alone
  and in a batch, vs the trainer's one forward over prompt + generation, per generated token. It fails while
  any attention call of the check ran on torch (e.g. no ``detkit.kernels.attention`` in the tree);
- ``backward_repeat``: every parameter gradient of a cross-entropy backward (plus the router's load-balancing
  loss for a MoE model), bitwise across two runs;
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from detkit.toolkit.contract import compare_bits
from detkit.toolkit.harness import Row, RunContext, atomic_write_text
from detkit.toolkit.models import (
    BLOCK_TENSORS, MODES, build_model, cache_kwarg, fp8_graph_weights_choice, is_moe, mode_context, moe_block_grads,
    moe_blocks, moe_experts_choice, moe_meta, routing_check,
)

NAME = "model"
DESCRIPTION = ("transformers model log-probs, default vs detkit mode: batch invariance, padding, trainer vs rollout, "
               "KV-cache decode vs trainer, backward repeat, drift, routed ops, FP8 experts' precision")
ATTENTION_OPS = ("sdpa", "attention (transformers)")

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


CPU_PLAN = Plan(seq_len=10, batch_sizes=(2, 5), pad=3, train_batch=4, micro_batch=2, prompt_len=5, gen_len=4,
                decode_batch=3, precision_tokens=64)
CUDA_PLAN = Plan(seq_len=256, batch_sizes=(4, 16), pad=37, train_batch=8, micro_batch=2, prompt_len=64, gen_len=24,
                 decode_batch=8)
NOT_COVERED = (
    "attention kernels other than detkit.kernels.attention (torch SDPA backends, split-KV decode kernels) and "
    "transformers' eager attention (its softmax spans the key count)",
    "TP > 1 inside the model (collectives are not rewritten), FP8 / FP16 / FP32 GEMMs (counted)",
    "reductions other than the last-dim mean (softmax / log_softmax are per-row in torch: not overridden)",
    "MoE: transformers' Qwen3-MoE block on detkit's MoE layer; other MoE classes run transformers' experts, their "
    "torch._grouped_mm calls (forward and backward) on detkit's grouped GEMM and their combine / router sums on "
    "torch; FP8 experts only where H and I are multiples of 128 (else counted); expert parallelism "
    "(counted); the router's softmax / top-k stay on torch (row-wise); the load-balancing loss is a batch statistic "
    "(run to run, not batch-invariant); FP8 weight gradients are not batch-invariant (their 128-row scale blocks "
    "span tokens; run to run they repeat)",
    "the first-divergence hooks compare module outputs; differences in ops between modules show as the next module",
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
    row) at sequence positions ``seq``; None for tensors without a batch dim."""
    def select(t):
        if t.dim() < 2 or t.shape[0] not in (batch, 1):
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

    def backward_repeat(self) -> list[Comparison]:
        ids = self.seqs[: self.plan.train_batch]
        moe = is_moe(self.model)
        runs = []
        for _ in range(2):
            self.model.zero_grad(set_to_none=True)
            with torch.enable_grad():
                out = self.model(input_ids=ids, use_cache=False, **({"output_router_logits": True} if moe else {}))
                loss = F.cross_entropy(out.logits[:, :-1].float().reshape(-1, self.vocab), ids[:, 1:].reshape(-1))
                if moe:  # the router's load-balancing loss, as transformers adds it to the loss
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
        what = "cross-entropy + router aux loss" if moe else "cross-entropy"
        cmp = Comparison("backward_repeat", f"every parameter gradient ({what}), batch {len(ids)}, two runs",
                         not differing,
                         elements, mismatches, max_abs, None, None,
                         {"parameters": len(runs[0]), "parameters_differing": len(differing),
                          "first_parameter_differing": differing[0] if differing else None})
        return [cmp]

    def all_checks(self, locate: bool) -> Iterator[Comparison]:
        yield from self.batch_invariance(locate)
        yield from self.padding()
        yield from self.trainer_vs_rollout(locate)
        yield from self.decode_vs_trainer(locate)
        yield from self.backward_repeat()


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
    from detkit.mode.switch import mode_counters

    plan = CPU_PLAN if ctx.device.type == "cpu" else CUDA_PLAN
    experts = moe_experts_choice()  # refused here, before the model is built
    graph_weights = fp8_graph_weights_choice()
    model, description = build_model(ctx.device, ctx.seed)
    audit = Audit(model, ctx.device, plan, ctx.seed, experts, graph_weights)
    meta = {"model": description, "layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size,
            "moe": moe_meta(model), "plan": plan.__dict__, "attention_kernel_present": _attention_kernel_present()}
    if meta["moe"] is not None:
        meta["moe"]["detkit_experts"] = experts
        meta["moe"]["fp8_graph_weights"] = graph_weights
    yield _row(ctx, "model", f"model {description}", True, meta)
    drift: list[dict] = []
    detkit_counters = None
    for mode in MODES:
        start = mode_counters()
        with mode_context(mode, experts, graph_weights):
            for cmp in audit.all_checks(locate=True):
                entry = {"mode": mode, "check": cmp.check, **cmp.details()}
                drift.append(entry)
                if mode == "default":
                    yield _row(ctx, "default_drift", f"default {cmp.check} {cmp.case}", True,
                               {"informational": "torch's kernels; the drift the mode removes", **entry})
                    continue
                passed = cmp.equal
                if cmp.check == "decode_vs_trainer":
                    attention = {k: n for k, n in (mode_counters() - start).not_routed.items() if k[0] in ATTENTION_OPS}
                    if attention:
                        passed = False
                        entry["reason"] = "attention ran on torch's kernels, whose reduction over the keys depends on q_len"
                        entry["attention_not_routed"] = {f"{op}: {reason}": n for (op, reason), n in attention.items()}
                yield _row(ctx, cmp.check, f"detkit {cmp.check} {cmp.case}", passed, entry)
        if mode == "detkit":
            detkit_counters = mode_counters() - start
    counters = detkit_counters.as_dict()
    passed, routing = routing_check(counters, meta["moe"] is not None, experts)
    details = {**counters, **routing}
    precision = None
    yield _row(ctx, "counters", "detkit mode: ops on detkit kernels and on torch", passed, details)
    if meta["moe"] is not None and experts == "fp8":
        precision = moe_precision(audit)
        if "error" in precision:
            yield _row(ctx, "moe_precision", "moe_precision first MoE block: FP8 vs BF16 experts", False, precision)
        for name, st in precision.get("tensors", {}).items():
            yield _row(ctx, "moe_precision", f"moe_precision {name} first MoE block, {precision['tokens']} tokens: "
                       "FP8 vs BF16 experts", st["passed"],
                       {**{k: v for k, v in precision.items() if k != "tensors"}, **st})
    if ctx.out_dir is not None:
        write_model_report(Path(ctx.out_dir), meta, drift, counters, precision)


def write_model_report(out_dir: Path, meta: dict, drift: list[dict], counters: dict,
                       precision: dict | None = None) -> None:
    from tabulate import tabulate

    table = [{k: e.get(k) for k in ("mode", "check", "case", "mismatches", "elements", "max_abs_diff",
                                    "p99_abs_diff", "first_divergence")} for e in drift]
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
