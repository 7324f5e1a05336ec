"""Shape presets the suites run at. GEMM: ``qwen3-8b-tp2`` is the production preset; ``zoo`` covers every
linear layer of the models in ``MODELS`` (``zoo_shapes``); ``tiny`` is for the Triton interpreter on the CPU
and is labelled as such in every report. MoE expert MLP (the MoE benchmarks): ``reference`` and the MoE
models' layers at T = 8192 tokens; ``tiny``, ``tiny-fp8`` and ``tiny-all`` for the interpreter."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GemmPreset:
    name: str
    kn_shapes: tuple[tuple[int, int], ...]  # (K, N) of each local GEMM
    m_values: tuple[int, ...]  # M sweep; the largest is the batch the others are cut from
    chunk: int  # rows per chunk in the chunking check
    repetitions: int  # determinism repetitions
    determinism_m: tuple[int, ...]  # M values the repetition and fresh-process checks run at
    layouts: tuple[str, ...] = ("kn", "linear")  # weight layouts of fwd/dA (toolkit.fixtures.LAYOUTS)
    config_m: int | None = None  # rows the cross-config check runs at (None: the largest M)
    determinism_kn: tuple[tuple[int, int], ...] | None = None  # shapes of the determinism checks (None: kn_shapes)
    # Outputs with more elements are contract-checked on their first and last columns, this many elements in all
    # (the bound is per element; the drift statistics' quantiles over billions of elements cost seconds each).
    contract_max_elements: int | None = None
    device_draws: bool = False  # operands drawn on the GPU (toolkit.fixtures.HOST_DRAW_MAX_ELEMENTS)

    def __post_init__(self):
        if not self.kn_shapes or not self.m_values:
            raise ValueError(f"preset {self.name!r} needs shapes and M values")
        if any(m < 1 for m in self.m_values) or self.chunk < 1 or self.repetitions < 2:
            raise ValueError(f"preset {self.name!r}: M values and chunk must be >= 1, repetitions >= 2")
        if not self.layouts or not set(self.layouts) <= {"kn", "linear"}:
            raise ValueError(f"preset {self.name!r}: layouts {self.layouts!r}; supported: kn, linear")
        if self.config_m is not None and not 1 <= self.config_m <= self.m_max:
            raise ValueError(f"preset {self.name!r}: config_m {self.config_m} must be in [1, {self.m_max}]")

    @property
    def m_max(self) -> int:
        return max(self.m_values)


# ---------------------------------------------------------------------------------------------
# Real models' linear layers: the published configs (config.json on the Hugging Face Hub) as data.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelDims:
    name: str
    hidden: int  # hidden_size
    intermediate: int | None  # intermediate_size of the dense MLP; None: no dense MLP in the zoo (MoE experts)
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int
    vocab: int | None  # vocab_size; None: no lm_head in the zoo
    tps: tuple[int, ...]  # tensor-parallel sizes the zoo takes the model at


MODELS = (
    ModelDims("Qwen3-8B", hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128, vocab=151936,
              tps=(1, 2, 4, 8)),
    ModelDims("Qwen3-32B", hidden=5120, intermediate=25600, heads=64, kv_heads=8, head_dim=128, vocab=151936,
              tps=(8,)),
    ModelDims("Llama-3.1-70B", hidden=8192, intermediate=28672, heads=64, kv_heads=8, head_dim=128, vocab=128256,
              tps=(8,)),
    # The attention projections only: its MLP is the MoE expert suite's.
    ModelDims("Qwen3-30B-A3B", hidden=2048, intermediate=None, heads=32, kv_heads=4, head_dim=128, vocab=None,
              tps=(1,)),
)


def model_layers(model: ModelDims, tp: int) -> list[tuple[str, int, int]]:
    """(layer, K, N) of every linear layer of ``model`` on one of ``tp`` tensor-parallel ranks, sharded as
    Megatron-LM and vLLM shard them: q/k/v/gate/up and the lm_head split N (column-parallel; k/v by KV head,
    replicated when there are fewer KV heads than ranks; the lm_head by vocabulary), o/down split K
    (row-parallel). The lm_head also appears unsharded (``lm_head_full``: log-probs over the whole vocabulary)."""
    if tp < 1 or model.heads % tp or (model.intermediate or tp) % tp or (model.vocab or tp) % tp:
        raise ValueError(f"{model.name} does not split evenly over TP={tp}")
    q = model.heads * model.head_dim // tp
    kv = max(1, model.kv_heads // tp) * model.head_dim
    layers = [("q", model.hidden, q), ("k", model.hidden, kv), ("v", model.hidden, kv), ("o", q, model.hidden)]
    if model.intermediate is not None:
        inter = model.intermediate // tp
        layers += [("gate", model.hidden, inter), ("up", model.hidden, inter), ("down", inter, model.hidden)]
    if model.vocab is not None:
        layers.append(("lm_head", model.hidden, model.vocab // tp))
        if tp > 1:
            layers.append(("lm_head_full", model.hidden, model.vocab))
    return layers


@dataclass(frozen=True)
class ZooShape:
    k: int
    n: int
    layers: tuple[str, ...]  # every "model tpN layer" with this (K, N)

    @property
    def narrow(self) -> bool:
        """An output of at most 1024 columns: few tiles per row of the grid."""
        return self.n <= 1024


def zoo_shapes(models: tuple[ModelDims, ...] = MODELS) -> list[ZooShape]:
    """Every distinct (K, N) of the models' linear layers at their TP sizes, in first-seen order, each with the
    layers that have it."""
    seen: dict[tuple[int, int], list[str]] = {}
    for model in models:
        for tp in model.tps:
            for layer, k, n in model_layers(model, tp):
                seen.setdefault((k, n), []).append(f"{model.name} tp{tp} {layer}")
    return [ZooShape(k, n, tuple(layers)) for (k, n), layers in seen.items()]


# M from a single decode token to a 16384-token prefill chunk.
ZOO_M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


GEMM_PRESETS = {
    # Qwen3-8B TP=2 local shapes: Gate/Up (K=4096, N=6144) and Down (K=6144, N=4096).
    "qwen3-8b-tp2": GemmPreset("qwen3-8b-tp2", ((4096, 6144), (6144, 4096)),
                               (1, 7, 16, 128, 129, 1024, 4095, 4096, 16384), chunk=1000, repetitions=5,
                               determinism_m=(1, 129, 4096, 16384)),
    # Every zoo shape, sized for a few minutes on an H200: nn.Linear weights only, operands drawn on the GPU, M
    # values from one token to 4096, the cross-config check at 1024 rows (a row's bits do not depend on M, so
    # every config the table can pick is compared on the first 1024 rows of the batch), the determinism checks on
    # the shapes below 2**26 weight elements (the lm_heads' outputs would take seconds per digest) and the contract
    # on at most 2**24 elements of each output.
    "zoo": GemmPreset("zoo", tuple((s.k, s.n) for s in zoo_shapes()), (1, 7, 129, 1000, 4096), chunk=1500,
                      repetitions=3, determinism_m=(1, 129, 4096), layouts=("linear",), config_m=1024,
                      determinism_kn=tuple((s.k, s.n) for s in zoo_shapes() if s.k * s.n <= 2**26),
                      contract_max_elements=2**24, device_draws=True),
    # Interpreter scale: both orientations (N > K and K > N), reduced extents below BLOCK_K and not
    # multiples of 16, so masked tails are exercised; the largest M (1025) lands in the large-M entries of the
    # tables, as 4095 did, at a quarter of the interpreted cost (CI time). Every config is compared on the batch's
    # first 129 rows (a partial tile for every BLOCK_M; a row's bits do not depend on M): an eighth of the rows.
    "tiny": GemmPreset("tiny", ((40, 56), (56, 40)), (1, 7, 128, 129, 1025), chunk=300, repetitions=3,
                       determinism_m=(1, 129), config_m=129),
}


def default_gemm_preset(backend: str) -> str:
    return "tiny" if backend == "triton_interpreter" else "qwen3-8b-tp2"


# ---------------------------------------------------------------------------------------------
# MoE expert MLP
# ---------------------------------------------------------------------------------------------
# FLOPs per T*K*H*I (T tokens, K routes each, hidden H, expert intermediate I): forward 6 (up 4, down 2),
# the backward alone 12 (each GEMM once more for dgrad and wgrad), both 18.
MOE_FLOPS_PER_TKHI = {"fwd": 6.0, "bwd": 12.0, "fwd_bwd": 18.0}


@dataclass(frozen=True)
class MoePreset:
    name: str
    t: int  # tokens
    h: int  # hidden
    i: int  # expert intermediate
    e: int  # experts
    k: int  # routes per token

    def flops(self, measure: str) -> float:
        return MOE_FLOPS_PER_TKHI[measure] * self.t * self.k * self.h * self.i

    @property
    def flops_fwd(self) -> float:
        return self.flops("fwd")

    @property
    def flops_fwd_bwd(self) -> float:
        return self.flops("fwd_bwd")

    @property
    def label(self) -> str:
        return f"moe_mlp [T={self.t}, H={self.h}, I={self.i}, E={self.e}, K={self.k}] bf16"


MOE_PRESETS = {
    "reference": MoePreset("reference", 8192, 3072, 1536, 8, 8),
    "qwen3-30b-a3b": MoePreset("qwen3-30b-a3b", 8192, 2048, 768, 128, 8),
    "qwen3-235b-a22b": MoePreset("qwen3-235b-a22b", 8192, 4096, 1536, 128, 8),
    "olmoe": MoePreset("olmoe", 8192, 2048, 1024, 64, 8),
    "mixtral-8x7b": MoePreset("mixtral-8x7b", 8192, 4096, 14336, 8, 2),
    "tiny": MoePreset("tiny", 64, 32, 48, 4, 2),  # interpreter scale
    # The reference shape at the FP8 target's second T, and an interpreter shape with H, I multiples of 128
    # (the FP8 quantization block).
    "reference-16k": MoePreset("reference-16k", 16384, 3072, 1536, 8, 8),
    "tiny-fp8": MoePreset("tiny-fp8", 64, 128, 128, 3, 2),
    # The interpreter's cheapest shape at which every implementation of `bench moe` runs (FP8 included).
    "tiny-all": MoePreset("tiny-all", 32, 128, 128, 2, 2),
}
MOE_GPU_PRESETS = ("reference", "qwen3-30b-a3b", "qwen3-235b-a22b", "olmoe", "mixtral-8x7b")
