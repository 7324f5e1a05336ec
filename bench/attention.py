"""detkit attention against PyTorch SDPA's flash backend, in one run, at Qwen3-8B attention shapes (32 query heads on
8 KV heads, head_dim 128). A bench plug-in (BENCH_PROTOCOL): ``detkit bench attention``.

Modes, each case one row (its name is the launch's name and the NVTX range of its detkit calls; the SDPA calls run
in ``sdpa_flash <name>`` ranges):
- ``prefill``: causal forward, S in {1k, 4k, 16k} at batch 1 and 8;
- ``decode``: one query per sequence against a KV cache of {1k, 8k, 32k} keys at batch {1, 8, 64} (the same
  cache tensors for both; SDPA gets ``is_causal=False`` and no mask, which for one query is the causal answer);
- ``fwd_bwd``: forward and backward (torch.autograd.grad of q, k, v) at S in {4k, 16k}, batch 1;
- ``paged_decode`` (not in the default ``--modes``): decode's grid with the cache in pages of 16 keys (and batch 8 at
  8k keys in transformers' default pages of 256), the pages shuffled, through ``attention_paged``'s kernel against
  detkit's own contiguous decode (``attention``) on the same keys: the baseline is detkit, the target the paged
  path's overhead. The paged call's checks (one host sync, refused under capture) run once outside the timed call;
  ``host_checked_us`` is the host time of the whole checked call. Validated bit for bit against the contiguous call.

Validated, then timed: each case first compares detkit's output with SDPA's (all finite, max |diff| below
``VALIDATION_ATOL``, or -- against torch's eager formulation, whose BF16 scores are themselves off -- detkit's error
against the FP64 oracle no larger than the baseline's; the audit, not this, checks the bits and the FP64 bound); a
row's ``passed`` is that validation. ``fwd_grid`` / ``fwd_grid_eager``: the forward grid a CUDA graph and an eager
call run (docs/attention.md). Timings (toolkit.timing): eager (``do_bench``: L2 flushed, one call between CUDA
events; a call whose host path exceeds the flush shows its host latency) and CUDA-graph replay (operand sets rotated
so a call never finds them in L2), both interleaved with the baseline in rounds: median, p20, p80. Host time per
call (``time_host``): Python time until the call's work is queued, each call timed alone in bursts of ``HOST_CALLS``
queued behind a GPU sleep, interleaved with the baseline in the same rounds: median, p20, p80. The SDPA backend that
ran is recorded from the profiler's kernel names.

Formulas: visible (query, key) pairs P = B * Hq * sum over queries of the keys each sees;
    FLOPs fwd = 4 * D * P;  FLOPs fwd+bwd = 3.5 * FLOPs fwd (2.5x for the backward, FlashAttention's convention;
    detkit's atomic-free backward does 3.5x, recomputing QK^T and dP once more for dq);
    decode bytes = K + V = 2 * 2 * B * Hkv * Skv * D (+ q and o, negligible);
    ratio = detkit time / SDPA time (the graph time is the kernel time the targets are stated on).
Targets on the H200 (reported, not asserted): prefill <= 1.10, decode <= 1.20, fwd+bwd <= 1.20; paged decode
<= 1.10 of the contiguous decode.

Variants (``--variants``, default ``plain``): ``window`` (Mistral-7B heads, a 1024-key sliding window) against SDPA
with the sliding-window boolean mask (flash takes no mask: torch picks its backend, recorded; for decode a mask of
the last ``window`` keys), ``softcap`` (Gemma-2-9B heads, head_dim 256, softcap 50, with a 4096-key window) and
``sinks`` (gpt-oss-20b heads, 64 on 8 of 64, a 128-key window) against the best torch path that has them: the eager
formulation transformers' Gemma-2 and gpt-oss use (matmul, tanh or the sink column, FP32 softmax, matmul; window as
a mask), since SDPA supports neither. The row's ``baseline`` says which. Their FLOPs count the causal pairs (the
window's skipped keys included), so TFLOP/s compare like with like between the two columns only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import click
import torch
import torch.nn.functional as F

from detkit.toolkit.nvtx_ranges import nvtx_range
from detkit.toolkit.timing import Timing, time_graphs, time_host, time_interleaved

NAME = "attention"
DESCRIPTION = "attention prefill / decode / fwd+bwd vs SDPA flash at Qwen3-8B shapes (eager, CUDA graph, host time)"
MODES = ("prefill", "decode", "fwd_bwd", "paged_decode")
DEFAULT_MODES = ("prefill", "decode", "fwd_bwd")
VARIANTS = ("plain", "window", "softcap", "sinks")
# (heads_q, heads_kv, head_dim, window, softcap, sinks) per variant on the GPU; the interpreter uses (4, 2, 64).
VARIANT_SPECS = {"plain": (32, 8, 128, None, None, False), "window": (32, 8, 128, 1024, None, False),
                 "softcap": (16, 8, 256, 4096, 50.0, False), "sinks": (64, 8, 64, 128, None, True)}
TARGETS = {"prefill": 1.10, "decode": 1.20, "fwd_bwd": 1.20, "paged_decode": 1.10}
PAGE_SIZE = 16  # paged_decode's pages: the most pages per key tile (transformers' default, 256, on one case)
HF_PAGE_SIZE = 256
VALIDATION_ATOL = 2.0**-6
HOST_CALLS = 10  # host-timed calls per burst, one burst per round
L2_BYTES = 60 * 2**20  # H200
MAX_GRAPH_SETS = 32
OPTIONS = (
    click.option("--modes", default=",".join(DEFAULT_MODES), show_default=True,
                 help="Comma-separated modes: prefill, decode, fwd_bwd, paged_decode (paged vs contiguous decode)."),
    click.option("--quick", is_flag=True, help="One case per mode (the smallest), e.g. to check the plumbing."),
    click.option("--variants", default="plain", show_default=True,
                 help="Comma-separated: plain, window, softcap, sinks (see the module docstring for baselines)."),
)
RANKS = "single"
INTERPRETER_LABEL = ("triton_interpreter: wall clock of CPU emulation at tiny shapes against torch's CPU SDPA; NOT a "
                     "hardware result, ratios say nothing about GPU speed")


@dataclass(frozen=True)
class BenchCase:
    mode: str  # prefill | decode | fwd_bwd
    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    seed: int = 1234
    variant: str = "plain"
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    page_size: int | None = None  # paged_decode: keys per page

    @property
    def name(self) -> str:
        from detkit.kernels.attention.names import case_name  # kernels load when a benchmark runs, not with the CLI

        op = "fwd_bwd" if self.mode == "fwd_bwd" else "fwd"  # a decode step is the forward kernel at Sq = 1
        name = case_name(op, self.batch, self.heads_q, self.heads_kv, self.seq_q, self.seq_k, self.head_dim)
        if self.page_size:
            name = f"{name} paged{self.page_size}"
        return name if self.variant == "plain" else f"{name} {self.variant_label}"

    @property
    def variant_label(self) -> str:
        parts = [f"window={self.window}" if self.window else "", f"softcap={self.softcap:g}" if self.softcap else "",
                 "sinks" if self.sinks else ""]
        return " ".join(p for p in parts if p) or "plain"

    @property
    def baseline(self) -> str:
        if self.mode == "paged_decode":
            return "detkit_contiguous"
        if self.variant == "plain":
            return "sdpa_flash"
        return "sdpa_mask" if self.variant == "window" else "torch_eager"

    @property
    def flops(self) -> float:
        from detkit.kernels.attention.names import causal_pairs

        fwd = 4.0 * self.head_dim * causal_pairs(self.seq_q, self.seq_k) * self.batch * self.heads_q
        return 3.5 * fwd if self.mode == "fwd_bwd" else fwd

    @property
    def kv_bytes(self) -> int:
        return 2 * 2 * self.batch * self.heads_kv * self.seq_k * self.head_dim


def _grid(interpreted: bool) -> dict[str, list[tuple[int, int, int]]]:
    """(batch, seq_q, seq_k) per mode."""
    if interpreted:
        return {"prefill": [(1, 24, 24), (2, 24, 24)], "decode": [(1, 1, 40), (2, 1, 40)], "fwd_bwd": [(1, 24, 24)],
                "paged_decode": [(1, 1, 40), (2, 1, 40)]}
    decode = [(b, 1, s) for s in (1024, 8192, 32768) for b in (1, 8, 64)]
    return {
        "prefill": [(b, s, s) for s in (1024, 4096, 16384) for b in (1, 8)],
        "decode": decode,
        "fwd_bwd": [(1, s, s) for s in (4096, 16384)],
        "paged_decode": decode,
    }


def _variant_grid(interpreted: bool) -> dict[str, list[tuple[int, int, int]]]:
    """(batch, seq_q, seq_k) per mode for the variants: fewer cases than plain's."""
    if interpreted:
        return {"prefill": [(1, 24, 24)], "decode": [(2, 1, 40)], "fwd_bwd": [(1, 24, 24)]}
    return {"prefill": [(1, 4096, 4096), (8, 1024, 1024)], "decode": [(b, 1, 8192) for b in (1, 8, 64)],
            "fwd_bwd": [(1, 4096, 4096)]}


def cases(ctx, modes: str = ",".join(DEFAULT_MODES), quick: bool = False, variants: str = "plain",
          **_) -> list[BenchCase]:
    wanted = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in MODES]
    if not wanted or unknown:
        raise ValueError(f"--modes {modes!r} is not supported; supported: a comma-separated subset of {MODES}")
    kinds = [v.strip() for v in variants.split(",") if v.strip()]
    if not kinds or [v for v in kinds if v not in VARIANTS]:
        raise ValueError(f"--variants {variants!r} is not supported; supported: a comma-separated subset of {VARIANTS}")
    out = []
    for variant in kinds:
        heads_q, heads_kv, head_dim, window, softcap, sinks = VARIANT_SPECS[variant]
        if ctx.interpreted:
            heads_q, heads_kv, head_dim = 4, 2, 64
            window = 7 if window else None
            softcap = 5.0 if softcap else None
        grids = _grid(ctx.interpreted) if variant == "plain" else _variant_grid(ctx.interpreted)
        for mode in wanted:
            if mode not in grids:
                raise ValueError(f"--modes {mode} with --variants {variant} is not supported; supported: {mode} with "
                                 "the plain variant")
            grid = grids[mode]
            paged = [PAGE_SIZE] if mode == "paged_decode" else [None]
            for batch, seq_q, seq_k in (grid[:1] if quick else grid):
                for page_size in paged:
                    out.append(BenchCase(mode, batch, seq_q, seq_k, heads_q, heads_kv, head_dim, seed=ctx.seed,
                                         variant=variant, window=window, softcap=softcap, sinks=sinks,
                                         page_size=page_size))
            if mode == "paged_decode" and not quick and not ctx.interpreted:
                out.append(BenchCase(mode, 8, 1, 8192, heads_q, heads_kv, head_dim, seed=ctx.seed,
                                     page_size=HF_PAGE_SIZE))
    return out


# ---------------------------------------------------------------------------------------------
# The two implementations
# ---------------------------------------------------------------------------------------------
def _randn(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)


def make_inputs(case: BenchCase, device: torch.device, sets: int = 1) -> list[dict[str, torch.Tensor]]:
    """``sets`` independent operand sets (the CUDA-graph timing rotates them past the L2), drawn on the device
    (gigabytes at the decode shapes; the bench needs no cross-device bits)."""
    gen = torch.Generator(device=device).manual_seed(case.seed)
    grad = case.mode == "fwd_bwd"
    q_shape = (case.batch, case.heads_q, case.seq_q, case.head_dim)
    kv_shape = (case.batch, case.heads_kv, case.seq_k, case.head_dim)
    out = []
    for _ in range(sets):
        entry = {"q": _randn(q_shape, gen, device).requires_grad_(grad),
                 "k": _randn(kv_shape, gen, device).requires_grad_(grad),
                 "v": _randn(kv_shape, gen, device).requires_grad_(grad)}
        if grad:
            entry["do"] = _randn(q_shape, gen, device)
        if case.sinks:
            entry["sinks"] = torch.linspace(-2.0, 3.0, case.heads_q, device=device).to(torch.bfloat16)
        if case.page_size:
            entry.update(paged_cache(entry["q"], entry["k"], entry["v"], case.page_size, gen))
        out.append(entry)
    return out


def paged_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_size: int, gen: torch.Generator) -> dict:
    """The decode step's cache in pages: k, v [B, Hkv, S, D] cut into pages of ``page_size`` keys, scattered over a
    storage [B * pages, page_size, Hkv, D] in a random order; q [B, Hq, 1, D] packed as [B, Hq, D] (a view)."""
    batch, heads_kv, seq_k, head_dim = k.shape
    pages = -(-seq_k // page_size)
    perm = torch.randperm(batch * pages, generator=gen, device=k.device)
    out = {}
    for name, t in (("k_cache", k), ("v_cache", v)):
        padded = torch.nn.functional.pad(t, (0, 0, 0, pages * page_size - seq_k))
        storage = torch.empty((batch * pages, page_size, heads_kv, head_dim), dtype=t.dtype, device=t.device)
        storage[perm] = padded.view(batch, heads_kv, pages, page_size, head_dim).permute(0, 2, 3, 1, 4).reshape(
            batch * pages, page_size, heads_kv, head_dim)
        out[name] = storage
    out["block_table"] = perm.view(batch, pages).to(torch.int32)
    out["cu_q"] = torch.arange(batch + 1, dtype=torch.int32, device=k.device)
    out["cu_k"] = out["cu_q"] * seq_k
    out["q_packed"] = q[:, :, 0]
    return out


def _variant_kwargs(case: BenchCase, inp: dict) -> dict:
    kw = {}
    if case.window:
        kw["window"] = case.window
    if case.softcap:
        kw["softcap"] = case.softcap
    if case.sinks:
        kw["sinks"] = inp["sinks"]
    return kw


def _window_mask(case: BenchCase, device: torch.device) -> torch.Tensor | None:
    """The sliding-window causal mask [Sq, Skv] (queries the last Sq keys), or None without a window."""
    if not case.window:
        return None
    pos = case.seq_k - case.seq_q + torch.arange(case.seq_q, device=device)
    j = torch.arange(case.seq_k, device=device)
    return (j[None, :] <= pos[:, None]) & (j[None, :] > pos[:, None] - case.window)


def eager_call(case: BenchCase, inp: dict) -> Callable[[], object]:
    """transformers' eager formulation (Gemma-2, gpt-oss): K/V repeated per head (outside the timed call), scores
    by matmul, softcap, the window as an additive mask, the sink column, FP32 softmax, matmul. Dense [B, Hq, Sq,
    Skv] scores: the memory-bound baseline those models run without detkit."""
    q, k, v = inp["q"], inp["k"], inp["v"]
    rep = case.heads_q // case.heads_kv
    k, v = (t.detach().repeat_interleave(rep, 1).requires_grad_(t.requires_grad) for t in (k, v))
    scale = 1.0 / math.sqrt(case.head_dim)
    mask = _window_mask(case, q.device)
    bias = None if mask is None else torch.zeros(mask.shape, device=q.device).masked_fill(~mask, float("-inf"))

    def forward():
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        if case.softcap:
            s = torch.tanh(s / case.softcap) * case.softcap
        s = s.float() if bias is None else s.float() + bias
        if case.sinks:
            sink = inp["sinks"].float().reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)
            p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
        else:
            p = torch.softmax(s, -1)
        return torch.matmul(p.to(v.dtype), v)

    if case.mode == "fwd_bwd":
        return lambda: torch.autograd.grad(forward(), (q, k, v), inp["do"])
    return forward


def _sdpa_context(device: torch.device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION) if device.type == "cuda" else sdpa_kernel(SDPBackend.MATH)


def paged_call(case: BenchCase, inp: dict, checked: bool = False, configs=None) -> Callable[[], object]:
    """The paged decode step: its kernel on inputs checked once here (``checked`` False: what a CUDA graph can
    capture), or the whole ``attention_paged`` call, checks (one host sync) included."""
    from detkit.kernels.attention import attention_paged
    from detkit.kernels.attention.launch import attention_fwd_launch, check_paged

    args = (inp["q_packed"], inp["k_cache"], inp["v_cache"], inp["block_table"], inp["cu_q"], inp["cu_k"], 1,
            case.seq_k)
    if checked:
        return lambda: attention_paged(*args, configs=configs)
    seqs = check_paged(*args)
    scale = 1.0 / math.sqrt(case.head_dim)
    return lambda: attention_fwd_launch(args[0], args[1], args[2], seqs, scale, configs)[0]


def detkit_call(case: BenchCase, inp: dict, configs=None) -> Callable[[], object]:
    from detkit.kernels.attention import attention

    if case.mode == "paged_decode":
        return paged_call(case, inp, configs=configs)
    q, k, v = inp["q"], inp["k"], inp["v"]
    kw = _variant_kwargs(case, inp)
    if case.mode == "fwd_bwd":
        def step():
            o = attention(q, k, v, configs=configs, **kw)
            return torch.autograd.grad(o, (q, k, v), inp["do"])
        return step
    return lambda: attention(q, k, v, configs=configs, **kw)


def sdpa_call(case: BenchCase, inp: dict, gqa: str) -> Callable[[], object]:
    """SDPA on the same tensors: ``gqa`` "native" (enable_gqa=True) or "expanded" (K/V repeated per query head
    beforehand, outside the timed call, when the backend refuses enable_gqa)."""
    if case.baseline == "torch_eager":
        return eager_call(case, inp)
    if case.baseline == "detkit_contiguous":
        from detkit.kernels.attention import attention

        return lambda: attention(inp["q"], inp["k"], inp["v"])
    q, k, v = inp["q"], inp["k"], inp["v"]
    if gqa == "expanded":
        rep = case.heads_q // case.heads_kv
        k, v = (t.detach().repeat_interleave(rep, 1).requires_grad_(t.requires_grad) for t in (k, v))
    kwargs = {"is_causal": case.mode != "decode", "enable_gqa": gqa == "native" and case.heads_q != case.heads_kv}
    device = q.device
    mask = _window_mask(case, device)
    if mask is not None:  # a sliding window: SDPA with its boolean mask, backend chosen by torch
        kwargs = {"attn_mask": mask, "enable_gqa": kwargs["enable_gqa"]}

        def masked():
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        if case.mode == "fwd_bwd":
            return lambda: torch.autograd.grad(masked(), (q, k, v), inp["do"])
        return masked

    if case.mode == "fwd_bwd":
        def step():
            with _sdpa_context(device):
                o = F.scaled_dot_product_attention(q, k, v, **kwargs)
            return torch.autograd.grad(o, (q, k, v), inp["do"])
        return step

    def call():
        with _sdpa_context(device):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return call


def _first_output(result) -> torch.Tensor:
    return result if isinstance(result, torch.Tensor) else result[0]


def sdpa_gqa_mode(case: BenchCase, inp: dict) -> str:
    """'native' when the flash backend runs enable_gqa on these shapes, else 'expanded'."""
    if case.baseline == "torch_eager":
        return "expanded"
    if case.baseline == "detkit_contiguous":
        return "n/a"
    try:
        sdpa_call(case, inp, "native")()
        return "native"
    except RuntimeError:
        return "expanded"


def kernel_names(fn: Callable[[], object], device: torch.device) -> list[str]:
    """The GPU kernels one call of ``fn`` launches (profiler), to record which SDPA backend ran."""
    if device.type != "cuda":
        return ["cpu"]
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(dict.fromkeys(n[:80] for n in names))


def _graph_sets(case: BenchCase) -> int:
    per_call = case.kv_bytes + 2 * 2 * case.batch * case.heads_q * case.seq_q * case.head_dim
    return max(1, min(MAX_GRAPH_SETS, math.ceil(2 * L2_BYTES / per_call)))


def _oracle_errors(case: BenchCase, inp: dict, a: torch.Tensor, b: torch.Tensor) -> dict:
    """Max |error| of detkit's and the baseline's first output (o, or dq for fwd_bwd) against the FP64 oracle, on
    the first sequence of the batch (the oracle's dense FP64 scores bound its memory)."""
    from detkit.kernels.attention.reference import attention_oracle

    one = {k: (t[:1] if k in ("q", "k", "v", "do") else t).detach() for k, t in inp.items()
           if isinstance(t, torch.Tensor)}
    kw = _variant_kwargs(case, one)
    with torch.no_grad():
        oracle = attention_oracle(one["q"], one["k"], one["v"], do=one["do"] if case.mode == "fwd_bwd" else None, **kw)
    want = oracle["dq" if case.mode == "fwd_bwd" else "o"]
    del oracle
    return {"max_abs_err_vs_fp64_detkit": float((a[:1].double() - want).abs().max()),
            "max_abs_err_vs_fp64_baseline": float((b[:1].double() - want).abs().max())}


def validate(case: BenchCase, ours, theirs, inp: dict | None = None) -> dict:
    """Finite, and within ``VALIDATION_ATOL`` of the baseline; against torch's eager formulation (BF16 scores and
    probabilities: not an accurate baseline), a larger difference still validates when detkit's error against the
    FP64 oracle is no larger than the baseline's (both recorded)."""
    a, b = _first_output(ours).float(), _first_output(theirs).float()
    if case.mode == "paged_decode":  # [B, Hq, D] against the contiguous [B, Hq, 1, D]: the same bits
        a = a.reshape(b.shape)
    diff = float((a - b).abs().max())
    finite = bool(torch.isfinite(a).all())
    row = {"validated": finite and diff <= VALIDATION_ATOL, "max_abs_diff_vs_sdpa": diff, "finite": finite}
    if case.mode == "paged_decode":
        from detkit.toolkit.contract import compare_bits

        bits = compare_bits(_first_output(ours).reshape(b.shape), _first_output(theirs))
        row.update(bits_equal_baseline=bits.equal, validated=finite and bits.equal)
    if finite and not row["validated"] and case.baseline == "torch_eager" and inp is not None:
        row.update(_oracle_errors(case, inp, a, b))
        row["validated"] = row["max_abs_err_vs_fp64_detkit"] <= row["max_abs_err_vs_fp64_baseline"]
    return row


def _timing(prefix: str, t: Timing | None) -> dict:
    if t is None:
        return {f"{prefix}_us": None}
    return {f"{prefix}_us": t.median_us, f"{prefix}_p20_us": t.p20_us, f"{prefix}_p80_us": t.p80_us,
            f"{prefix}_sm_clock_mhz": t.sm_clock_mhz}


def _ranged(fn: Callable[[], object], label: str) -> Callable[[], object]:
    def call():
        with nvtx_range(label):
            return fn()
    return call


def measure(ctx, case: BenchCase, rounds: int, configs=None) -> dict:
    """One case: validate, then eager, CUDA-graph and host timings of detkit and SDPA, interleaved."""
    device = ctx.device
    sets = _graph_sets(case) if device.type == "cuda" else 1
    inputs = make_inputs(case, device, sets)
    gqa = sdpa_gqa_mode(case, inputs[0])
    ours, theirs = detkit_call(case, inputs[0], configs), sdpa_call(case, inputs[0], gqa)
    with nvtx_range(case.name):
        row = validate(case, ours(), theirs(), inputs[0])
    row.update(sdpa_gqa=gqa, sdpa_kernels=kernel_names(theirs, device), graph_sets=sets)
    if not row["validated"]:
        return row
    names = {"detkit": case.name, "sdpa": f"{case.baseline} {case.name}"}
    eager = time_interleaved({"detkit": _ranged(ours, names["detkit"]), "sdpa": _ranged(theirs, names["sdpa"])},
                             device, rounds=rounds)
    row.update(_timing("detkit_eager", eager["detkit"]), **_timing("sdpa_eager", eager["sdpa"]))
    try:
        ours_all = [detkit_call(case, inp, configs) for inp in inputs]
        theirs_all = [sdpa_call(case, inp, gqa) for inp in inputs]
        graph = time_graphs({"detkit": lambda: [f() for f in ours_all], "sdpa": lambda: [f() for f in theirs_all]},
                            device, calls_per_fn=sets, rounds=rounds, range_names=names)
        row.update(_timing("detkit_graph", graph["detkit"]), **_timing("sdpa_graph", graph["sdpa"]))
    except RuntimeError as exc:  # a capture failure is reported, not hidden
        row.update(_timing("detkit_graph", None), **_timing("sdpa_graph", None), graph_error=str(exc)[:300])
    # Host time matters for short calls: a few samples suffice for long ones; the interpreter's calls are seconds of
    # emulation. The validation and the eager timing have warmed both calls: no warm-up of its own.
    slow = (row.get("sdpa_eager_us") or 0) > 2000
    calls = 1 if device.type != "cuda" else 2 if slow else HOST_CALLS
    host_fns = {"detkit": ours, "sdpa": theirs}
    if case.mode == "paged_decode":
        host_fns["checked"] = paged_call(case, inputs[0], checked=True, configs=configs)
        host_fns["checked"]()  # warm: its checks' torch ops
        names["checked"] = f"{case.name} checked"
    host = time_host(host_fns, device, rounds, calls, warmup=0, range_names=names)
    for impl, t in host.items():
        row.update({f"host_{impl}_us": t.median_us, f"host_{impl}_p20_us": t.p20_us, f"host_{impl}_p80_us": t.p80_us})
    return row


def fwd_grid(case: BenchCase, configs, capturing: bool = True) -> str:
    """Which forward grid the case runs under a CUDA graph (``capturing``) or eagerly: "split" (one program per query
    tile and key split, then the combine pass: small-batch decode) or "one_pass" (docs/attention.md, split-KV); both
    give the same bits."""
    from detkit.kernels.attention.launch import Sequences, uses_split_grid

    seqs = Sequences(False, case.batch, case.seq_q, case.seq_k, None, None, case.window)
    return "split" if uses_split_grid(configs, seqs, case.heads_q, case.heads_kv, capturing) else "one_pass"


def run(ctx, cases: list[BenchCase], **options) -> Iterator[dict]:
    from detkit.kernels.attention.configs import ATTENTION_CONFIG_TABLE_VERSION, select_configs

    rounds = options.get("rounds") or getattr(ctx, "rounds", None) or 3
    for case in cases:
        table = select_configs(ctx.backend, case.head_dim)
        row = {"name": case.name, **asdict(case), "configs": table.label(), "config_table": ATTENTION_CONFIG_TABLE_VERSION,
               "fwd_grid": fwd_grid(case, table), "fwd_grid_eager": fwd_grid(case, table, capturing=False),
               "target": TARGETS[case.mode], "baseline": case.baseline}
        try:
            row.update(measure(ctx, case, rounds))
        except (RuntimeError, ValueError, NotImplementedError) as exc:  # e.g. out of memory: a failed row, not a crash
            row.update(validated=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
        for kind in ("eager", "graph"):
            ours, theirs = row.get(f"detkit_{kind}_us"), row.get(f"sdpa_{kind}_us")
            row[f"ratio_{kind}"] = ours / theirs if ours and theirs else None
        gpu_us = row.get("detkit_graph_us") or row.get("detkit_eager_us")
        sdpa_us = row.get("sdpa_graph_us") or row.get("sdpa_eager_us")
        row["detkit_tflops"] = case.flops / gpu_us / 1e6 if gpu_us else None
        row["sdpa_tflops"] = case.flops / sdpa_us / 1e6 if sdpa_us else None
        if case.mode in ("decode", "paged_decode"):
            row["detkit_kv_gbps"] = case.kv_bytes / gpu_us / 1e3 if gpu_us else None
            row["sdpa_kv_gbps"] = case.kv_bytes / sdpa_us / 1e3 if sdpa_us else None
        ratio = row.get("ratio_graph") or row.get("ratio_eager")
        row["meets_target"] = None if ratio is None or ctx.interpreted else ratio <= TARGETS[case.mode]
        row["passed"] = bool(row["validated"])
        if ctx.interpreted:
            row["label"] = INTERPRETER_LABEL
        yield row


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def target_lines(rows: list[dict]) -> list[str]:
    lines = []
    for mode in MODES:
        sel = [r for r in rows if r["mode"] == mode and r.get("variant", "plain") == "plain"
               and (r.get("ratio_graph") or r.get("ratio_eager"))]
        if not sel:
            continue
        ratios = [r.get("ratio_graph") or r.get("ratio_eager") for r in sel]
        worst = max(ratios)
        met = sum(x <= TARGETS[mode] for x in ratios)
        verdict = "met" if worst <= TARGETS[mode] else f"missed by {100 * (worst / TARGETS[mode] - 1):.1f}% at worst"
        against = "detkit's contiguous decode" if mode == "paged_decode" else "SDPA flash"
        lines.append(f"- {mode}: {met}/{len(sel)} cases <= {TARGETS[mode]:.2f}x {against} (graph time); worst "
                     f"{worst:.3f}x, median {statistics.median(ratios):.3f}x: {verdict}")
    return lines


def summarize(rows: list[dict], meta: dict) -> str:
    from tabulate import tabulate

    text = ""
    if meta.get("backend") == "triton_interpreter" or any(r.get("label") for r in rows):
        text += f"**{INTERPRETER_LABEL}**\n\n"
    cols = ("B", "Sq", "Skv", "grid", "detkit graph us", "SDPA graph us", "ratio graph", "ratio eager", "host us detkit",
            "host us SDPA", "detkit TFLOP/s", "SDPA TFLOP/s", "valid")
    for variant in VARIANTS:
        for mode in MODES:
            sel = [r for r in rows if r["mode"] == mode and r.get("variant", "plain") == variant]
            if not sel:
                continue
            table = [(r["batch"], r["seq_q"], r["seq_k"], r.get("fwd_grid"), r.get("detkit_graph_us"), r.get("sdpa_graph_us"),
                      r.get("ratio_graph"), r.get("ratio_eager"), r.get("host_detkit_us"), r.get("host_sdpa_us"),
                      r.get("detkit_tflops"), r.get("sdpa_tflops"), r["validated"]) for r in sel]
            if mode == "paged_decode":
                text += (f"## {mode} (target <= {TARGETS[mode]:.2f}x; baseline detkit_contiguous, detkit's own "
                         "contiguous decode: the 'SDPA' columns)\n\n")
            elif variant == "plain":
                text += f"## {mode} (target <= {TARGETS[mode]:.2f}x)\n\n"
            else:
                first = sel[0]
                text += (f"## {mode}, {variant}: Hq={first['heads_q']} Hkv={first['heads_kv']} D={first['head_dim']} "
                         f"{first['name'].split('] bf16 ')[-1]} (baseline {first['baseline']}: the 'SDPA' columns)\n\n")
            text += tabulate(table, headers=cols, tablefmt="github", floatfmt=".3f") + "\n\n"
            if mode == "paged_decode":
                text += "Host us of the whole checked call (one sync): " + ", ".join(
                    f"{r['name'].split('] ')[0]}]: {r.get('host_checked_us') or 0:.0f}" for r in sel) + "\n\n"
            kernels = sorted({k for r in sel for k in r.get("sdpa_kernels", [])})
            gqa = sorted({r.get("sdpa_gqa") for r in sel})
            text += f"Baseline ran: {', '.join(kernels) or 'n/a'} (GQA: {', '.join(str(g) for g in gqa)})\n\n"
    lines = [] if meta.get("backend") == "triton_interpreter" else target_lines(rows)
    if lines:
        text += "## Targets (reported, not asserted)\n\n" + "\n".join(lines) + "\n"
    return text


# ---------------------------------------------------------------------------------------------
# Compile-only evidence (no GPU): the sm_90 build of a kernel and tile
# ---------------------------------------------------------------------------------------------
