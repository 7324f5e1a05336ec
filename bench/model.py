"""``detkit bench model``: a transformers model's speed in ``detkit.batch_invariant_mode()`` against default mode,
the same model in the same run, interleaved. Its bits are the model audit's (``detkit audit --suite model``).

The model (toolkit/models.py): ``--preset`` (one of ``MODEL_PRESETS``), else ``DETKIT_MODEL_CONFIG`` (a preset, a
JSON config or a checkpoint directory), else Qwen3 with the 8B widths and 2 layers on cuda and a tiny Qwen3 on the
interpreter; random init unless a checkpoint has weights. ``DETKIT_MODEL_MOE_EXPERTS`` and
``DETKIT_MODEL_FP8_GRAPH_WEIGHTS`` are the mode's ``moe_experts`` and ``fp8_graph_weights``.

Cases, one row each, named ``speed <case> detkit / default``:
- ``prefill``: an inference forward of ``plan.prefill`` (batch, tokens), no cache;
- ``decode_eager``: one decode step (a token per sequence) on a DynamicCache holding ``plan.decode`` (batch, cache
  length) positions per sequence (``ModelBench.filled_cache``); every call appends a token;
- ``decode_cuda_graph``: the same step on caches of its own, captured in a CUDA graph and replayed (a replay
  recomputes the captured step). On the CPU there are no graphs: eager wall time, and a step that reads device data
  on the host, which a capture refuses, is refused so;
- ``forward_backward``: a training forward and a cross-entropy backward of ``plan.train`` (batch, tokens);
- ``generate``: ``model.generate`` greedy over ``plan.generate`` (batch, prompt tokens, new tokens), every sequence
  made to run all its new tokens (no end token): a prefill and the eager decode steps, as a user's call runs them;
- a Qwen3-MoE model also times its first MoE block alone, detkit's layer vs transformers' own block (the experts
  implementation the model was built with), at the token counts of the three cases: ``moe_block_prefill``,
  ``moe_block_decode``, ``moe_block_forward_backward``.

``--decode-at BxL`` (repeatable) times the two decode cases at each (batch B, cache length L) given instead of
``plan.decode``, each point its own rows: named ``speed <case> BxL detkit / default``, except a point equal to
``plan.decode``, whose rows keep the plain names that tools/claims.py reads; ``batch`` and ``cache_len`` say the point.
A point is refused before any model is built unless B >= 1, L >= 1 and L plus the steps a case takes on one cache
(``decode_calls``) stays within the model's ``max_position_embeddings``.

Default mode's attention is the fastest a user would otherwise run: flash SDPA (memory-efficient SDPA where flash
cannot take the call) for "sdpa" models, transformers' eager attention for models without an SDPA path
(``BASELINE_ATTENTION``; each row says which).

Timing (toolkit.timing): per case, the default-mode and the detkit-mode calls interleaved over ``--rounds`` rounds
(default 2), each mode entered around its own calls, warm-up excluded. The eager cases by ``time_back_to_back``
(each sample one call between CUDA events, ``plan.reps`` samples per round; the weights are far larger than the L2,
so no flush), the captured step by ``time_graphs`` (``plan.graph_replays`` replays per round). Fields: default_ms and
detkit_ms (medians) with their p20/p80; ratio = detkit_ms / default_ms; target (TARGETS) and meets_target, none on
the interpreter (CPU emulation says nothing about GPU speed).

A row fails when its calls could not be made (e.g. the capture failed: ``failure`` says why) or when its detkit-mode
calls ran a GEMM on torch, or for a MoE model an expert call off detkit's layer of the chosen precision (the mode's
counters over the case: then the time is not detkit's).
"""

from __future__ import annotations

import contextlib
import gc
import re
import statistics
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import click
import torch
import torch.nn.functional as F

from detkit.toolkit.models import MODEL_PRESETS, MODES

NAME = "model"
DESCRIPTION = ("transformers model speed, detkit mode / default mode: prefill, decode step (eager, CUDA graph), "
               "forward+backward, generate(); a Qwen3-MoE model's block vs transformers' own")
RANKS = "single"
OPTIONS = (
    click.option("--layers", type=int, default=None,
                 help="Decoder layers of a random-init model (the preset's layer pattern repeated; default: the "
                      "preset's, 2 at real widths)."),
    click.option("--decode-at", "decode_at", multiple=True, metavar="BxL",
                 help="Time the decode cases at batch B on a cache of L tokens, e.g. 8x32768; repeatable, each point "
                      "its own rows (default: the plan's one point, 8x1024 on cuda)."),
)
PRESETS = tuple(MODEL_PRESETS)
MODEL_CASES = ("prefill", "decode_eager", "decode_cuda_graph", "forward_backward", "generate")
DECODE_CASES = ("decode_eager", "decode_cuda_graph")  # timed at each --decode-at point
BLOCK_CASES = ("moe_block_prefill", "moe_block_decode", "moe_block_forward_backward")
# Speed targets (detkit time / default time) of the model cases; the block cases compare with transformers' block
# and carry none.
TARGETS = {"prefill": 1.05, "decode_eager": 1.15, "decode_cuda_graph": 1.05, "forward_backward": 1.05,
           "generate": 1.10}
DEFAULT_ROUNDS = 2


@dataclass(frozen=True)
class SpeedPlan:
    """Sizes of one bench run."""

    prefill: tuple[int, int]  # (batch, tokens)
    decode: tuple[int, int]  # (batch, cache length)
    train: tuple[int, int]  # (batch, tokens) of the forward+backward
    reps: int  # samples per round of prefill, the decode step and the blocks
    train_reps: int  # samples per round of the forward+backward (each is several forwards' time)
    graph_replays: int  # timed replays per round of the captured decode step
    generate: tuple[int, int, int]  # (batch, prompt tokens, new tokens) of a generate() call


CUDA_PLAN = SpeedPlan(prefill=(4, 512), decode=(8, 1024), train=(4, 512), reps=10, train_reps=5, graph_replays=10,
                      generate=(8, 128, 32))
# The interpreter emulates every kernel on the CPU: tiny sizes, one sample, the plumbing only.
CPU_PLAN = SpeedPlan(prefill=(2, 8), decode=(2, 8), train=(2, 8), reps=1, train_reps=1, graph_replays=1,
                     generate=(2, 4, 2))


def row_name(label: str) -> str:
    """A row's name from its label: the case, and for a decode point other than the plan's, the point."""
    return f"speed {label} detkit / default"


def label_of(row: dict) -> str:
    """The label in a row's name (``row_name``): its case, with the decode point where the name carries one."""
    return row["name"].removeprefix("speed ").removesuffix(" detkit / default")


def case_label(case: str, point: tuple[int, int] | None, plan: SpeedPlan) -> str:
    """``case`` itself at the plan's decode point (the row names the claims read), else ``<case> BxL``."""
    if point is None or point == plan.decode:
        return case
    return f"{case} {point[0]}x{point[1]}"


def plan_of(ctx) -> SpeedPlan:
    return CPU_PLAN if ctx.interpreted else CUDA_PLAN


def default_rounds(interpreted: bool) -> int:
    """Interleaved rounds unless --rounds says otherwise: one on the interpreter (plumbing, not speed)."""
    return 1 if interpreted else DEFAULT_ROUNDS


def rounds_of(ctx) -> int:
    return ctx.rounds or default_rounds(ctx.interpreted)


def decode_calls(plan: SpeedPlan, rounds: int) -> int:
    """Decode steps a case runs on one cache, each appending a token: the eager case's warm-up call and its samples
    (the captured case runs fewer: a warm-up call and the capture on CUDA, a call a round on the CPU)."""
    return 1 + rounds * plan.reps


def decode_points(decode_at: tuple[str, ...], plan: SpeedPlan) -> list[tuple[int, int]]:
    """The (batch, cache length) points of the decode cases: ``--decode-at``'s in order, else ``plan.decode``. A
    value that is not BxL with B, L >= 1, or a point given twice (two rows of one name), is refused by name."""
    if not decode_at:
        return [plan.decode]
    points: list[tuple[int, int]] = []
    for text in decode_at:
        match = re.fullmatch(r"([0-9]+)x([0-9]+)", text)
        if match is None or int(match[1]) < 1 or int(match[2]) < 1:
            raise ValueError(f"--decode-at {text!r} is not supported; supported: BxL, batch B >= 1 and cache length "
                             f"L >= 1, e.g. 8x32768")
        point = (int(match[1]), int(match[2]))
        if point in points:
            raise ValueError(f"--decode-at {text} is given twice; supported: each point once")
        points.append(point)
    return points


def check_positions(points: list[tuple[int, int]], calls: int, max_positions: int | None) -> None:
    """Refuse a point whose cache and the ``calls`` steps appended to it pass the model's max_position_embeddings
    (a model config without one sets no bound)."""
    for batch, length in points:
        if max_positions is not None and length + calls > max_positions:
            raise ValueError(f"--decode-at {batch}x{length}: a {length}-token cache and the {calls} decode steps "
                             f"timed on it pass the model's max_position_embeddings {max_positions}; supported: "
                             f"L <= {max_positions - calls}")


def _spec(ctx) -> str | None:
    """The model --preset names (at most one), else None: DETKIT_MODEL_CONFIG or the device's default."""
    if len(ctx.presets) > 1:
        raise ValueError(f"bench model times one model; got --preset {list(ctx.presets)}")
    return ctx.presets[0] if ctx.presets else None


def cases(ctx, layers: int | None = None, decode_at: tuple[str, ...] = (), **_) -> list[str]:
    """The labels of the rows to measure (``case_label``): the model cases, the decode cases once per decode point, and
    the block cases when the model's config has experts; the model's source, the mode's choices and the decode points
    are checked here, before any work (the config is read, no model built)."""
    from detkit.toolkit.models import fp8_graph_weights_choice, model_source, moe_experts_choice

    spec = _spec(ctx)
    plan = plan_of(ctx)
    points = decode_points(decode_at, plan)
    moe_experts_choice()
    fp8_graph_weights_choice()
    try:
        config, _, _ = model_source(ctx.device, spec, layers)
    except ImportError as exc:
        raise ValueError(f"the model bench needs transformers ({exc}): pip install 'detkit[models]'") from None
    check_positions(points, decode_calls(plan, rounds_of(ctx)), getattr(config, "max_position_embeddings", None))
    labels = [label for case in MODEL_CASES
              for label in ([case_label(case, p, plan) for p in points] if case in DECODE_CASES else [case])]
    # The block cases time transformers' Qwen3-MoE block against detkit's MoE layer (toolkit.models.moe_blocks).
    return [*labels, *(BLOCK_CASES if config.model_type == "qwen3_moe" else ())]


# ---------------------------------------------------------------------------------------------
# The timed calls
# ---------------------------------------------------------------------------------------------
# Default mode's attention, by the implementation the model was built with: SDPA's flash kernel where the model runs
# "sdpa", its memory-efficient kernel only where flash cannot take the call (a mask tensor: sliding windows, a step
# captured in a CUDA graph, for which transformers builds the mask; MLA's value head dim), cuDNN and math attention
# off (left to itself, torch may pick cuDNN attention for a one-query decode and rebuild its plan for every new cache
# length: tens of ms a step, not what a user would run); transformers' eager attention where the model has no SDPA
# path and runs "detkit" (Gemma-2's softcap, gpt-oss's sinks), as transformers would run it by default.
BASELINE_ATTENTION = {"sdpa": "sdpa (flash, else memory-efficient)", "detkit": "eager (transformers')"}


@contextlib.contextmanager
def baseline_attention(model):
    """Default mode around a bench call: the baseline attention of ``BASELINE_ATTENTION``, the model's own restored
    after; an implementation the bench has no baseline for is refused by name."""
    implementation = model.config._attn_implementation
    if implementation == "sdpa":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION], set_priority=True):
            yield
    elif implementation == "detkit":
        model.set_attn_implementation("eager")
        try:
            yield
        finally:
            model.set_attn_implementation("detkit")
    else:
        raise ValueError(f"attn_implementation {implementation!r} has no default-mode baseline; supported: "
                         f"{', '.join(BASELINE_ATTENTION)}")


class ModelBench:
    """One model and its inputs; ``measure(case)`` is one row."""

    def __init__(self, ctx, model, description: str, moe_experts: str, fp8_graph_weights: str):
        from detkit.toolkit.models import cache_kwarg, is_moe

        self.ctx, self.model, self.description = ctx, model, description
        self.device, self.plan, self.rounds = ctx.device, plan_of(ctx), rounds_of(ctx)
        self.moe_experts, self.fp8_graph_weights = moe_experts, fp8_graph_weights
        self.moe = is_moe(model)
        self.cache_kwarg = cache_kwarg(model)
        self.vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(ctx.seed)

        def ids(batch: int, tokens: int) -> torch.Tensor:
            return torch.randint(3, self.vocab, (batch, tokens), generator=gen).to(self.device)

        self.prefill_ids, self.train_ids = ids(*self.plan.prefill), ids(*self.plan.train)
        self.generate_ids = ids(*self.plan.generate[:2])
        self._kv_shapes: list[tuple[torch.Size, torch.Size, torch.dtype]] | None = None

    def decode_tokens(self, batch: int) -> torch.Tensor:  # [batch, 1]: the token each decode step feeds
        gen = torch.Generator().manual_seed(self.ctx.seed + 7)
        return torch.randint(3, self.vocab, (batch, 1), generator=gen).to(self.device)

    def contexts(self) -> dict[str, Callable]:
        """Each mode's context, entered by the timing around that mode's calls: detkit mode, or default mode on the
        baseline attention (``baseline_attention``)."""
        from detkit.toolkit.models import mode_context

        return {mode: (lambda mode=mode: mode_context(mode, self.moe_experts, self.fp8_graph_weights)
                       if mode != "default" else baseline_attention(self.model)) for mode in MODES}

    def prefill(self) -> None:
        with torch.inference_mode():
            self.model(input_ids=self.prefill_ids, use_cache=False)

    def forward_backward(self) -> None:
        self.model.zero_grad(set_to_none=True)
        logits = self.model(input_ids=self.train_ids, use_cache=False).logits
        F.cross_entropy(logits[:, :-1].float().reshape(-1, self.vocab), self.train_ids[:, 1:].reshape(-1)).backward()

    def generate(self) -> None:
        new = self.plan.generate[2]
        with torch.inference_mode():
            # No end token and min = max new tokens: every call runs the same number of steps in both modes.
            self.model.generate(input_ids=self.generate_ids, attention_mask=torch.ones_like(self.generate_ids),
                                max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                                pad_token_id=0)

    def kv_shapes(self) -> list[tuple[torch.Size, torch.Size, torch.dtype]]:
        """Per layer, the (heads, head dim) of its cached keys and of its values and their dtype, read off a
        DynamicCache after a one-token forward outside the mode (the model decides them: GQA heads, MLA's head dims),
        on whatever SDPA kernel torch picks (the shapes do not depend on it) or, for a model built with "detkit", the
        baseline's eager attention. A cache layer other than transformers' full or sliding-window DynamicCache layer
        is refused by name: its state is not only keys and values."""
        if self._kv_shapes is None:
            from transformers import DynamicCache
            from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

            probe = DynamicCache(config=self.model.config)
            sdpa = self.model.config._attn_implementation == "sdpa"
            with contextlib.nullcontext() if sdpa else baseline_attention(self.model), torch.inference_mode():
                self.model(input_ids=self.decode_tokens(1), **{self.cache_kwarg: probe, "use_cache": True})
            shapes = []
            for idx, layer in enumerate(probe.layers):
                if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
                    raise NotImplementedError(f"cache layer {idx} is a {type(layer).__name__}; the decode cases fill "
                                              f"only DynamicLayer and DynamicSlidingWindowLayer")
                shapes.append((layer.keys.shape[1::2], layer.values.shape[1::2], layer.keys.dtype))
            self._kv_shapes = shapes
        return self._kv_shapes

    def filled_cache(self, batch: int, length: int):
        """A DynamicCache (the model's config: full and sliding-window layers) holding ``length`` positions of
        ``batch`` sequences at every layer: seeded random keys and values ([batch, heads, length, head dim], N(0, 1) in
        the cache's dtype) written through the cache's own ``update``, as a prefill's attention writes them. The same
        values for either mode, built without a ``length``-token prefill per mode; a decode step on it does a real
        step's work: each full layer's attention reads ``length`` cached keys, a sliding-window layer its window's
        (the layer keeps those), and the next position is ``length``."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        gen = torch.Generator(device=self.device).manual_seed(self.ctx.seed + 13)
        with torch.inference_mode():
            for idx, ((k_heads, k_dim), (v_heads, v_dim), dtype) in enumerate(self.kv_shapes()):
                keys = torch.randn((batch, k_heads, length, k_dim), generator=gen, device=self.device, dtype=dtype)
                values = torch.randn((batch, v_heads, length, v_dim), generator=gen, device=self.device, dtype=dtype)
                cache.update(keys, values, idx)
                del keys, values  # the cache holds its own copy: one layer's pair in flight at a time
        return cache

    def decode_steps(self, point: tuple[int, int]) -> dict[str, Callable[[], object]]:
        """Per mode, a decode step at ``point`` (batch, cache length) on a cache of its own (``filled_cache``)."""
        batch, length = point
        tokens = self.decode_tokens(batch)

        def step_on(cache) -> Callable[[], object]:
            kw = {self.cache_kwarg: cache, "use_cache": True}

            def step():
                with torch.inference_mode():
                    return self.model(input_ids=tokens, **kw)
            return step
        return {mode: step_on(self.filled_cache(batch, length)) for mode in MODES}

    def block_calls(self, case: str) -> dict[str, Callable[[], None]]:
        """The first MoE block alone at ``case``'s token count, the same call in both modes."""
        from detkit.toolkit.models import moe_blocks

        block = moe_blocks(self.model)[0]
        tokens = {"moe_block_prefill": self.plan.prefill[0] * self.plan.prefill[1],
                  "moe_block_decode": self.plan.decode[0],
                  "moe_block_forward_backward": self.plan.train[0] * self.plan.train[1]}[case]
        gen = torch.Generator().manual_seed(self.ctx.seed + 11)
        x = torch.randn(1, tokens, self.model.config.hidden_size, generator=gen).to(self.device, torch.bfloat16)
        if case != "moe_block_forward_backward":
            def forward():
                with torch.inference_mode():
                    block(x)
            return {mode: forward for mode in MODES}

        def forward_backward():
            xg = x.detach().requires_grad_(True)
            block(xg).backward(x)
            block.zero_grad(set_to_none=True)
        return {mode: forward_backward for mode in MODES}

    def timed(self, case: str, point: tuple[int, int]) -> tuple[dict, dict[str, str]]:
        """The Timings of ``case`` (a decode case at ``point``) per mode and the modes whose calls could not be timed
        (one line each)."""
        from detkit.toolkit.timing import time_back_to_back, time_graphs

        contexts, errors = self.contexts(), {}
        names = {mode: f"{row_name(case_label(case, point, self.plan))} | {mode}" for mode in MODES}
        if case == "decode_cuda_graph":
            steps = self.decode_steps(point)
            timings = time_graphs(steps, self.device, calls_per_fn=1, rounds=self.rounds,
                                  replays=self.plan.graph_replays, range_names=names, contexts=contexts, errors=errors)
            return timings, errors
        if case == "decode_eager":
            fns = self.decode_steps(point)
        elif case in BLOCK_CASES:
            fns = self.block_calls(case)
        else:
            fns = {mode: getattr(self, case) for mode in MODES}
        reps = self.plan.train_reps if case.endswith("forward_backward") or case == "generate" else self.plan.reps
        timings = time_back_to_back(fns, self.device, self.rounds, samples_per_round=reps, contexts=contexts,
                                    range_names=names)
        self.model.zero_grad(set_to_none=True)
        return timings, errors

    def measure(self, case: str, point: tuple[int, int] | None = None) -> dict:
        """One row: both modes' times, the ratio, and whether detkit mode ran on detkit's kernels throughout; a decode
        case at ``point`` (batch, cache length; default ``plan.decode``)."""
        from detkit.mode.switch import mode_counters
        from detkit.toolkit.models import moe_blocks, routing_check

        point = point or self.plan.decode
        label = case_label(case, point if case in DECODE_CASES else None, self.plan)
        row = {"name": row_name(label), "case": case, "model": self.description, "moe_experts": self.moe_experts,
               "fp8_graph_weights": self.fp8_graph_weights, "backend": self.ctx.backend,
               "hardware_result": not self.ctx.interpreted, "rounds": self.rounds,
               "timing": "graph" if case == "decode_cuda_graph" else "eager",
               "default_attention": BASELINE_ATTENTION[self.model.config._attn_implementation]}
        row.update(self.shape(case, point))
        if case in BLOCK_CASES and not moe_blocks(self.model):
            return {**row, "passed": False, "failure": "the model has no transformers Qwen3-MoE block to time"}
        before = mode_counters()
        try:
            timings, errors = self.timed(case, point)
        except (RuntimeError, ValueError, NotImplementedError) as exc:  # e.g. out of memory: a failed row, not a crash
            from detkit.toolkit.timing import call_refusal

            self.model.zero_grad(set_to_none=True)
            return {**row, "passed": False, "failure": call_refusal(exc)}
        routed, routing = routing_check((mode_counters() - before).as_dict(), self.moe, self.moe_experts)
        row["detkit_mode_routing"] = routing
        for mode, t in timings.items():
            row.update({f"{mode}_ms": t.median_us / 1e3, f"{mode}_p20_ms": t.p20_us / 1e3,
                        f"{mode}_p80_ms": t.p80_us / 1e3, f"{mode}_samples": t.samples,
                        f"{mode}_sm_clock_mhz": t.sm_clock_mhz})
        if errors:
            failure = "; ".join(f"{mode}: {error}" for mode, error in errors.items())
            return {**row, "passed": False, "failure": failure}
        row["ratio"] = row["detkit_ms"] / row["default_ms"]
        target = TARGETS.get(case)
        row.update(target=target, meets_target=None if target is None or self.ctx.interpreted else
                   row["ratio"] <= target)
        if case in BLOCK_CASES:
            experts = getattr(self.model.config, "_experts_implementation", None)
            row.update(baseline=f"transformers' block ({experts})", detkit_experts=self.moe_experts)
        if not routed:
            return {**row, "passed": False, "failure": f"detkit mode ran off detkit's kernels, so its time is not "
                                                        f"detkit's: {routing}"}
        return {**row, "passed": True}

    def shape(self, case: str, point: tuple[int, int]) -> dict:
        p = self.plan
        if case in ("prefill", "moe_block_prefill"):
            return {"batch": p.prefill[0], "tokens": p.prefill[0] * p.prefill[1], "seq_len": p.prefill[1]}
        if case in ("forward_backward", "moe_block_forward_backward"):
            return {"batch": p.train[0], "tokens": p.train[0] * p.train[1], "seq_len": p.train[1]}
        if case == "generate":
            return {"batch": p.generate[0], "seq_len": p.generate[1], "new_tokens": p.generate[2]}
        if case == "moe_block_decode":  # the block alone at the plan's decode batch
            return {"batch": p.decode[0], "tokens": p.decode[0], "cache_len": p.decode[1]}
        return {"batch": point[0], "tokens": point[0], "cache_len": point[1]}


# ---------------------------------------------------------------------------------------------
# The plug-in
# ---------------------------------------------------------------------------------------------
def run(ctx, cases: list[str], layers: int | None = None, decode_at: tuple[str, ...] = (), **_) -> Iterator[dict]:
    """Build the model once, then one row per label of ``cases`` as soon as it is measured."""
    from detkit.toolkit.models import build_model, fp8_graph_weights_choice, moe_experts_choice

    plan = plan_of(ctx)
    decode = {case_label(case, p, plan): (case, p) for case in DECODE_CASES for p in decode_points(decode_at, plan)}
    model, description = build_model(ctx.device, ctx.seed, _spec(ctx), layers)
    bench = ModelBench(ctx, model, description, moe_experts_choice(), fp8_graph_weights_choice())
    for label in cases:
        yield bench.measure(*decode.get(label, (label, None)))
        if ctx.device.type == "cuda":
            gc.collect()  # a failed case's frames may still hold its caches
            torch.cuda.empty_cache()  # each case's graphs and caches are gone: give the next its memory


def describe(ctx, cases: list[str], rows: list[dict], session=None) -> dict:
    """The plan and targets, for report.json's meta."""
    return {"plan": asdict(plan_of(ctx)), "targets": TARGETS, "model": rows[0]["model"] if rows else None}


def derive(rows: list[dict], meta: dict) -> dict:
    """The target verdicts over the model cases (hardware runs only)."""
    judged = [r for r in rows if r.get("meets_target") is not None]
    return {"met": sum(r["meets_target"] for r in judged), "judged": len(judged),
            "ratios": {label_of(r): r.get("ratio") for r in rows}}


def summarize(rows: list[dict], meta: dict) -> str:
    from tabulate import tabulate

    lines = []
    if not meta.get("hardware_result", True) or any(not r.get("hardware_result", True) for r in rows):
        lines += ["Interpreter run: every time is CPU emulation at tiny shapes, not a hardware result; no targets "
                  "are judged.", ""]
    if rows:
        lines += [f"Model: {rows[0]['model']}; detkit mode's MoE experts {rows[0]['moe_experts']}, FP8 graph weights "
                  f"{rows[0]['fp8_graph_weights']}.", ""]
    judged = [r for r in rows if r.get("meets_target") is not None]
    if judged:
        met = sum(r["meets_target"] for r in judged)
        lines += [f"Targets (detkit / default): met by {met} of {len(judged)}; median ratio "
                  f"{statistics.median(r['ratio'] for r in judged):.3f}", ""]
    cols = ("case", "timing", "batch", "cache_len", "default_ms", "default_p20_ms", "default_p80_ms", "detkit_ms",
            "detkit_p20_ms", "detkit_p80_ms", "ratio", "target", "meets_target", "passed")
    table = [{c: label_of(r) if c == "case" else r.get(c) for c in cols} for r in rows]
    lines += ["## Speed (median ms; ratio = detkit / default)", "",
              tabulate(table, headers="keys", tablefmt="github", floatfmt=".4g"), ""]
    failed = [r for r in rows if not r["passed"]]
    if failed:
        lines += ["## Failed", ""] + [f"- {r['name']}: {r.get('failure')}" for r in failed] + [""]
    return "\n".join(lines)


def merge_speed_reports(out_dir, parts) -> None:
    """speed.md / speed.json over several bench runs (tools/gpu/model_speed.sh runs one model and depth per process):
    one line per run, the ratio of each case (detkit / default, medians) with its verdict, a failed row's reason. A
    part without a report.json (its run stopped early) is listed as not finished."""
    import json
    from pathlib import Path

    from tabulate import tabulate

    from detkit.toolkit.records import atomic_write_text

    table, failures = [], []
    for part in map(Path, parts):
        path = part / "report.json"
        if not path.is_file():
            table.append({"run": part.name, "model": f"no {path.name} (the run did not finish)"})
            continue
        rows = json.loads(path.read_text())["rows"]
        line = {"run": part.name, "model": rows[0]["model"] if rows else None}
        for r in rows:
            label = label_of(r)
            if not r.get("passed"):
                line[label] = "failed"
                failures.append(f"- {part.name} {label}: {r.get('failure')}")
                continue
            verdict = "" if r.get("meets_target") is None else (" ok" if r["meets_target"] else " MISS")
            line[label] = f"{r['ratio']:.3f}{verdict}"
        table.append(line)
    lines = ["# Model speed: detkit mode / default mode (median ratio; ok / MISS against the case's target)", "",
              f"- targets: {TARGETS}", "", tabulate(table, headers="keys", tablefmt="github"), "",
              "## Failed rows", "", *(failures or ["- none"])]
    out_dir = Path(out_dir)
    atomic_write_text(out_dir / "speed.md", "\n".join(lines) + "\n")
    atomic_write_text(out_dir / "speed.json", json.dumps({"targets": TARGETS, "runs": table}, indent=2) + "\n")
