"""Model-parallel audit (suite 'model-parallel'): detkit mode across processes on a transformers model
(mode/parallel.py, docs/mode_parallel.md).

The suite runs in one process and starts its own ranks for each job (torch.multiprocessing, a file rendezvous;
gloo for CPU tensors under the Triton interpreter, NCCL for CUDA tensors, one GPU per rank). Each rank writes its
results to a file; this process computes the one-process reference of the same model and tokens and compares raw
bits. Jobs (``JOBS``):

- ``tp2``: the model sharded with ``parallelize_module`` (``torch_plan``: q/k/v, gate/up colwise, o/down rowwise,
  the lm_head colwise with its output gathered) on a TP group of 2, prepared with the same plan, vs the one-process
  model prepared with ``tp_size=2``: the log-probs of a training forward, every parameter gradient of a
  log-prob-sum backward, and generate() (greedy, KV cache) whose per-step log-probs must equal the trainer's one
  forward over prompt + completion. Default mode's drift (the DTensor path, BF16 all-reduce, vs the one-process
  default forward) beside it, informational.
- ``dp2``: the global batch split over DP=2, each rank prepared with ``dp_group``; each rank's log-probs vs the one-
  process forward of the whole batch (its rows); the reduced gradients (``reduce_gradients``) vs the one-process
  model prepared with ``dp_size=2``, twice (run to run); and what differs without the invariant reduction (each
  rank's BF16 gradients summed as DDP does), informational.
- ``dp2-ddp``, ``dp2-fsdp2``: ``dp2`` under DDP (backward under no_sync, then ``reduce_gradients``) and FSDP2
  (``fully_shard`` per decoder layer and the root, ``reduce_gradients(average=True)``).
- ``tp2dp2`` (4 ranks): both at once on a ("dp", "tp") mesh.

On GPUs the models have the model audit's widths (Qwen3-8B, Qwen3-30B-A3B; 2 layers) and 2 x 512 tokens per rank,
and each rank adds a ``speed`` row (informational): the median train step (forward, backward, the DP reduction)
prepared under detkit mode against the same sharding in default mode.

A parameter whose gradient the mode does not make invariant is reported as such, never failed silently nor passed:
``grad_scope`` says which parameters the invariance covers (TP: every parameter; DP: the parameters the ranks'
``prepare`` routed, ``ParallelPlan.covered``: every Linear and Qwen3 RMSNorm weight, the embedding, a Qwen3-MoE
block's router and experts) and which it does not (DP: any other parameter, e.g. a bias; none on the tiny models).
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from detkit.toolkit.contract import compare_bits
from detkit.toolkit.harness import Row, RunContext

NAME = "model-parallel"
DESCRIPTION = ("detkit mode across processes: TP=2 (parallelize_module) and DP=2 log-probs, generate() and "
               "gradients vs one process, bitwise; default-mode drift")

# Tiny configs for the interpreter: TP=2 needs whole heads per rank (2 query, 2 KV heads: one each); head_dim 64 is one
# detkit's attention kernel supports.
QWEN3_TINY_TP = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                     vocab_size=256, num_hidden_layers=1, rms_norm_eps=1e-6, rope_theta=1e6,
                     max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu", attention_bias=False)
QWEN3_MOE_TINY_TP = dict(QWEN3_TINY_TP, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0)
MODELS = {"qwen3": ("qwen3", QWEN3_TINY_TP), "qwen3-moe": ("qwen3_moe", QWEN3_MOE_TINY_TP)}


def _gpu_models() -> dict:
    """On GPUs the model audit's widths: Qwen3-8B and Qwen3-30B-A3B (2 layers each)."""
    from detkit.toolkit.models import QWEN3_8B_WIDTHS, QWEN3_MOE_30B_A3B_WIDTHS

    return {"qwen3": ("qwen3", QWEN3_8B_WIDTHS), "qwen3-moe": ("qwen3_moe", QWEN3_MOE_30B_A3B_WIDTHS)}


def model_fields(name: str, device: str) -> tuple[str, dict]:
    return _gpu_models()[name] if device == "cuda" and name in ("qwen3", "qwen3-moe") else MODELS[name]


def torch_plan(model_name: str) -> dict:
    """The parallelize_module plan the jobs shard with (FQNs from the causal-LM root)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"model.layers.*.self_attn.q_proj": ColwiseParallel(), "model.layers.*.self_attn.k_proj": ColwiseParallel(),
            "model.layers.*.self_attn.v_proj": ColwiseParallel(), "model.layers.*.self_attn.o_proj": RowwiseParallel(),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    if model_name == "qwen3":  # the MoE experts are not Linears: they stay replicated (no expert parallelism)
        plan.update({"model.layers.*.mlp.gate_proj": ColwiseParallel(), "model.layers.*.mlp.up_proj": ColwiseParallel(),
                     "model.layers.*.mlp.down_proj": RowwiseParallel()})
    return plan


@dataclass(frozen=True)
class Job:
    kind: str  # tp2 | dp2 | dp2-ddp | dp2-fsdp2 | tp2dp2
    model: str  # qwen3 | qwen3-moe
    device: str  # cpu | cuda
    seed: int = 0
    batch: int = 2  # sequences per DP rank
    seq: int = 8  # on cuda: 512 (cpu_or_cuda below)
    prompt: int = 5
    new_tokens: int = 3
    speed_steps: int = 5  # timed train steps per path on cuda (median), after one warm-up

    def __post_init__(self):
        if self.device == "cuda" and self.seq == 8:
            object.__setattr__(self, "seq", 512)
            object.__setattr__(self, "prompt", 64)
            object.__setattr__(self, "new_tokens", 8)

    @property
    def tp(self) -> int:
        return 2 if self.kind in ("tp2", "tp2dp2") else 1

    @property
    def dp(self) -> int:
        return 2 if self.kind.startswith("dp2") or self.kind == "tp2dp2" else 1

    @property
    def wrapper(self) -> str | None:
        """The DP wrapper the job runs under: "ddp" (the backward under no_sync, then ``reduce_gradients``),
        "fsdp2" (``fully_shard`` per decoder layer and the root; FSDP2 reduce-scatters what the route leaves it)."""
        return {"dp2-ddp": "ddp", "dp2-fsdp2": "fsdp2"}.get(self.kind)

    @property
    def world(self) -> int:
        return self.tp * self.dp


def build_model(name: str, device: torch.device, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = model_fields(name, device.type)
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.train()


def tokens(job: Job, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + job.seed)
    vocab = model_fields(job.model, job.device)[1]["vocab_size"]
    return torch.randint(0, vocab, (job.batch * job.dp, job.seq), generator=g).to(device)


def logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """FP32 log-prob of each next token [B, S-1]."""
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: _full(p.grad).detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}


def train_step(model, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A log-prob-sum backward under detkit mode (sum, not mean: the DP shards' gradients then add up to DP=1's
    without a scale)."""
    import detkit

    model.zero_grad(set_to_none=True)
    with detkit.batch_invariant_mode():
        lp = logprobs(model(input_ids=ids).logits, ids)
        (-lp.sum()).backward()
    return lp.detach().cpu()


def generate(model, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy generate() with the KV cache under detkit mode: (sequences, per-step FP32 log-probs of the chosen
    tokens [B, new_tokens])."""
    import detkit

    with detkit.batch_invariant_mode(), torch.inference_mode():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    chosen = out.sequences[:, prompt.shape[1]:]
    lp = torch.stack([torch.log_softmax(l.float(), -1).gather(-1, chosen[:, i:i + 1])[:, 0]
                      for i, l in enumerate(out.logits)], 1)
    return out.sequences.cpu(), lp.cpu()


# ---------------------------------------------------------------------------------------------
# Ranks
# ---------------------------------------------------------------------------------------------
def rank_main(rank: int, job: Job, init_file: str, out_dir: str) -> None:
    """One rank of ``job``: results to ``out_dir/rank<r>.pt``, or the error's last line to ``rank<r>.err``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cpu") if job.device == "cpu" else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl", init_method=f"file://{init_file}",
                            rank=rank, world_size=job.world)
    try:
        torch.save(_run_rank(rank, job, device), Path(out_dir) / f"rank{rank}.pt")
    except BaseException as exc:
        Path(out_dir, f"rank{rank}.err").write_text(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def _run_rank(rank: int, job: Job, device: torch.device) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import detkit
    from detkit.mode import parallel as mode_parallel

    mesh = init_device_mesh(device.type, (job.dp, job.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    ids = tokens(job, device)[dp_rank * job.batch:(dp_rank + 1) * job.batch]
    out: dict = {"rank": rank, "dp_rank": dp_rank}
    plan = torch_plan(job.model) if job.tp > 1 else None

    dp_group = mesh["dp"].get_group() if job.dp > 1 else None

    def sharded():
        model = build_model(job.model, device, job.seed)
        if plan:
            parallelize_module(model, mesh["tp"], plan)
        return model

    def wrapped(model):
        """(the module to call, the module whose parameters hold the gradients)"""
        if job.wrapper == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(model, process_group=dp_group), model
        if job.wrapper == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            return fully_shard(model, mesh=mesh["dp"]), model
        return model, model

    # default mode beside it (informational): the same sharding, torch's kernels and collectives
    model = sharded()
    with torch.no_grad():
        out["default_lp"] = logprobs(model(input_ids=ids).logits, ids).cpu()
    if device.type == "cuda":  # the default path's train step time (no mode), for the speed row
        out["default_ms"] = _step_ms(lambda: _default_step(model, ids), job.speed_steps)
    del model
    if job.dp > 1:  # detkit mode without the invariant reduction: each rank's BF16 gradients summed over DP
        model = sharded()
        call, holder = wrapped(model)
        train_step(call, ids)
        if job.wrapper is None:  # summed by hand, as DDP's all-reduce does (without its 1/world scale)
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad, group=dp_group)
            out["plain_dp_grads"] = _grads(holder)
        else:  # the wrapper's own reduction averages over the ranks: x world (exact, a power of two) to compare sums
            out["plain_dp_grads"] = {n: g * job.dp for n, g in _grads(holder).items()}
        del model, call, holder

    model = sharded()
    summary = mode_parallel.prepare(model, plan, dp_group=dp_group)
    call, holder = wrapped(model)
    out["plan"] = summary

    def step():
        if job.wrapper == "ddp":  # DDP's own all-reduce off: the invariant reduction replaces it
            with call.no_sync():
                return train_step(call, ids)
        return train_step(call, ids)

    # FSDP2 averages the gradients it reduces itself, so the invariant reduction averages too (exact for 2 ranks);
    # the saved gradients are scaled back to sums (x 2, exact) to compare with the one-process sums.
    average = job.wrapper == "fsdp2"

    def reduced_grads():
        return {n: g * job.dp for n, g in _grads(holder).items()} if average else _grads(holder)

    detkit.reset_mode_counters()
    out["lp"] = step()
    if job.dp > 1:
        out["grad_kinds"] = mode_parallel.reduce_gradients(holder, average=average)
    out["grads"] = reduced_grads()
    if job.dp > 1:  # run to run
        step()
        mode_parallel.reduce_gradients(holder, average=average)
        out["grads_again"] = reduced_grads()
    out["counters"] = detkit.mode_counters().as_dict()
    if device.type == "cuda":
        def timed():
            step()
            if job.dp > 1:
                mode_parallel.reduce_gradients(holder, average=average)
        out["detkit_ms"] = _step_ms(timed, job.speed_steps)
    if job.tp > 1:
        seqs, gen_lp = generate(model, ids[:, :job.prompt], job.new_tokens)
        out["gen_sequences"], out["gen_lp"] = seqs, gen_lp
    return out


def _default_step(model, ids) -> None:
    model.zero_grad(set_to_none=True)
    (-logprobs(model(input_ids=ids).logits, ids).sum()).backward()


def _step_ms(fn, steps: int) -> float:
    """Median wall time of ``fn`` (a train step with its collectives) over ``steps`` runs after one warm-up, ms."""
    import statistics
    import time

    fn()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def launch(job: Job, out_dir: Path, timeout_s: float = 600) -> dict[int, dict]:
    """Start ``job.world`` ranks and return each rank's results; raise with the first rank's error line."""
    import torch.multiprocessing as mp

    init = Path(tempfile.mkdtemp(prefix="rdzv-", dir=out_dir)) / "init"
    ctx = mp.get_context("spawn")
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the ranks share the host's cores
    try:
        procs = [ctx.Process(target=rank_main, args=(r, job, str(init), str(out_dir)), daemon=False)
                 for r in range(job.world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
    errors = sorted(out_dir.glob("rank*.err"))
    if errors:
        raise RuntimeError(f"{job.kind} {job.model}: {errors[0].name}: {errors[0].read_text().splitlines()[0]}")
    missing = [r for r in range(job.world) if not (out_dir / f"rank{r}.pt").is_file()]
    if missing:
        raise RuntimeError(f"{job.kind} {job.model}: ranks {missing} wrote no results (exit codes "
                           f"{[p.exitcode for p in procs]})")
    return {r: torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(job.world)}


# ---------------------------------------------------------------------------------------------
# The one-process reference and the comparisons
# ---------------------------------------------------------------------------------------------
def reference(job: Job) -> dict:
    """The one-process side: the same model and tokens, prepared with the ranks' plan as tp_size / dp_size."""
    import detkit
    from detkit.mode import parallel as mode_parallel

    device = torch.device(job.device)
    ids = tokens(job, device)
    out: dict = {}
    model = build_model(job.model, device, job.seed)
    with torch.no_grad():
        out["default_lp"] = logprobs(model(input_ids=ids).logits, ids).cpu()
    if job.dp > 1:
        train_step(model, ids)
        out["plain_grads"] = _grads(model)
    model = build_model(job.model, device, job.seed)
    mode_parallel.prepare(model, torch_plan(job.model) if job.tp > 1 else None, tp_size=job.tp, dp_size=job.dp)
    detkit.reset_mode_counters()
    out["lp"] = train_step(model, ids)
    out["grads"] = _grads(model)
    out["counters"] = detkit.mode_counters().as_dict()
    out["model"] = model
    out["ids"] = ids
    return out


def trainer_lp(model, sequences: torch.Tensor, prompt: int) -> torch.Tensor:
    """The trainer's log-probs of the generated tokens: one training forward over prompt + completion."""
    import detkit

    sequences = sequences.to(next(model.parameters()).device)
    with detkit.batch_invariant_mode():
        lp = logprobs(model(input_ids=sequences).logits, sequences)
    return lp[:, prompt - 1:].detach().cpu()


def _bits(got: torch.Tensor, want: torch.Tensor) -> dict:
    r = compare_bits(got, want)
    return {"equal": r.equal, "mismatches": r.mismatches, "elements": r.elements, "first": r.first_mismatch}


def grad_scope(job: Job, name: str, covered: tuple[str, ...]) -> bool:
    """Whether the mode claims ``name``'s gradient bitwise for ``job`` (see the module docstring): under TP every
    parameter (the prepared Linears and q_norm / k_norm on their routes, the rest replicated on replicated rows);
    under DP the parameters the ranks' ``prepare`` routed (``covered``: ``ParallelPlan.covered``)."""
    if job.dp == 1:
        return True
    return name in covered


def compare(job: Job, ranks: dict[int, dict], ref: dict) -> list[dict]:
    """Result dicts: {check, name, passed, informational, details}."""
    rows = []

    def add(check, name, passed, informational=False, **details):
        rows.append({"check": check, "name": f"{job.kind} {job.model} {name}", "passed": bool(passed),
                     "informational": informational, "details": details})

    for r, res in ranks.items():
        rows_of = slice(res["dp_rank"] * job.batch, (res["dp_rank"] + 1) * job.batch)
        bits = _bits(res["lp"], ref["lp"][rows_of])
        add("logprobs", f"rank {r} training-forward log-probs vs one process", bits["equal"], rank=r, **bits)
        drift = _bits(res["default_lp"], ref["default_lp"][rows_of])
        add("default_drift", f"rank {r} default mode log-probs vs one process", True, True, rank=r,
            max_abs=float((res["default_lp"] - ref["default_lp"][rows_of]).abs().max()), **drift)
        routed_ops = " ".join(res["counters"]["routed"])
        if "detkit_ms" in res:
            add("speed", f"rank {r} train step, detkit mode prepared / default mode (the same sharding)", True, True,
                rank=r, detkit_ms=res["detkit_ms"], default_ms=res["default_ms"],
                ratio=res["detkit_ms"] / res["default_ms"])
        add("routed", f"rank {r} prepared Linears on the parallel route, nothing on torch", "linear (" in routed_ops
            and not res["counters"]["not_routed"], rank=r,
            routed=res["counters"]["routed"], not_routed=res["counters"]["not_routed"])
    r0 = ranks[0]
    routed_params = r0["plan"].covered
    covered, outside = [], {}
    for name, want in ref["grads"].items():
        got = r0["grads"].get(name)
        if got is None:
            add("grads", f"{name} gradient", False, missing=True)
            continue
        bits = _bits(got, want)
        if grad_scope(job, name, routed_params):
            covered.append(name)
            add("grads", f"{name} gradient vs one process", bits["equal"], **bits)
        else:
            outside[name] = bits["mismatches"]
    add("grad_scope", "parameters outside the invariance (reported, not claimed)", True, True,
        covered=len(covered), outside=outside, kinds=r0.get("grad_kinds"))
    if job.dp > 1:
        same = all(torch.equal(r0["grads"][n].view(torch.int16), r0["grads_again"][n].view(torch.int16))
                   for n in covered)
        add("grads_repeat", "reduced gradients, two steps", same)
        plain = {n: _bits(r0["plain_dp_grads"][n], ref["plain_grads"][n])["mismatches"]
                 for n in ref["plain_grads"] if n in r0["plain_dp_grads"]}
        how = f"{job.wrapper}'s own reduction, x {job.dp}" if job.wrapper else "BF16 grads summed, as DDP does"
        add("plain_dp_drift", f"without the invariant reduction ({how}): elements differing from one process", True,
            True, mismatches=plain)
    if job.tp > 1:
        seqs, gen_lp = r0["gen_sequences"], r0["gen_lp"]
        want = trainer_lp(ref["model"], seqs, job.prompt)
        bits = _bits(gen_lp, want)
        add("generate_vs_trainer", f"generate() at TP={job.tp} (KV cache, {job.new_tokens} steps) vs one-process "
            "trainer forward", bits["equal"], **bits)
    return rows


JOBS = (("tp2", "qwen3"), ("dp2", "qwen3"), ("tp2", "qwen3-moe"), ("dp2", "qwen3-moe"), ("dp2-ddp", "qwen3"),
        ("dp2-fsdp2", "qwen3"), ("tp2dp2", "qwen3"))
JOBS_ENV = "DETKIT_MODEL_PARALLEL_JOBS"  # "all" or a subset of JOBS, e.g. "tp2:qwen3,dp2:qwen3"
# Under the interpreter each job costs 30-70 s of CPU, so the default there is the two 2-process Qwen3 jobs (the
# coverage row names the rest; tests/test_mode_parallel_jobs.py runs them); on GPUs every job.
INTERPRETER_DEFAULT_JOBS = (("tp2", "qwen3"), ("dp2", "qwen3"))


def selected_jobs(interpreted: bool = False) -> tuple[tuple[str, str], ...]:
    spec = os.environ.get(JOBS_ENV, "").strip()
    if spec == "all":
        return JOBS
    if not spec:
        return INTERPRETER_DEFAULT_JOBS if interpreted else JOBS
    jobs = tuple(tuple(item.strip().split(":", 1)) for item in spec.split(",") if item.strip())
    unknown = [":".join(j) for j in jobs if j not in JOBS]
    if unknown:
        raise ValueError(f"{JOBS_ENV}: {unknown} not known; known: {[':'.join(j) for j in JOBS]}")
    return jobs


def run(ctx: RunContext) -> Iterator[Row]:
    device = "cpu" if ctx.interpreted else "cuda"
    jobs = selected_jobs(ctx.interpreted)
    yield Row(NAME, "coverage", "jobs of this run", True, ctx.backend, {
        "informational": True, "run": [":".join(j) for j in jobs],
        "not_run": [":".join(j) for j in JOBS if j not in jobs],
        "not_covered": ["DDP / FSDP2 wrappers' own gradient reductions (not invariant: BF16 buckets / reduce-scatter)",
                        "DP gradients of parameters no route covers (reported per job in grad_scope: e.g. biases, "
                        "embeddings other than nn.Embedding, MoE classes other than Qwen3-MoE's)",
                        "DP experts on the FP8 MoE layer (moe_experts='fp8' is refused under DP)",
                        "transformers' tp_plan='auto'", "TP > 2 or DP > 2 on hardware", "groups across nodes"]})
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    out_root = Path(ctx.out_dir) if getattr(ctx, "out_dir", None) else Path(tempfile.mkdtemp(prefix="model-parallel-"))
    for kind, model in jobs:
        job = Job(kind, model, device, seed=ctx.seed)
        meta = {"ranks": job.world, "tp": job.tp, "dp": job.dp, "pg_backend": "gloo" if device == "cpu" else "nccl"}
        if device == "cuda" and gpus < job.world:
            yield Row(NAME, "coverage", f"{kind} {model}: not run", True, ctx.backend,
                      {**meta, "informational": True, "reason": f"needs {job.world} GPUs of one host; {gpus} visible"})
            continue
        out_dir = out_root / "ranks" / f"{kind}-{model}"
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            ranks = launch(job, out_dir)
        except Exception as exc:  # a rank's refusal or failure: one failed row with its first line
            yield Row(NAME, "launch", f"{kind} {model}", False, ctx.backend, {**meta, "error": str(exc)})
            continue
        for r in compare(job, ranks, reference(job)):
            yield Row(NAME, r["check"], r["name"], r["passed"], ctx.backend,
                      {**meta, "informational": r["informational"], **r["details"]})
