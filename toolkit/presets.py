"""Shape presets the suites run at. GEMM: ``qwen3-8b-tp2`` is the production preset; ``tiny`` is for the
Triton interpreter on the CPU and is labelled as such in every report. MoE expert MLP (the MoE
benchmarks): ``reference`` and the MoE models' layers at T = 8192 tokens; ``tiny`` and ``tiny-fp8`` for
the interpreter."""

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

    def __post_init__(self):
        if not self.kn_shapes or not self.m_values:
            raise ValueError(f"preset {self.name!r} needs shapes and M values")
        if any(m < 1 for m in self.m_values) or self.chunk < 1 or self.repetitions < 2:
            raise ValueError(f"preset {self.name!r}: M values and chunk must be >= 1, repetitions >= 2")

    @property
    def m_max(self) -> int:
        return max(self.m_values)


GEMM_PRESETS = {
    # Qwen3-8B TP=2 local shapes: Gate/Up (K=4096, N=6144) and Down (K=6144, N=4096).
    "qwen3-8b-tp2": GemmPreset("qwen3-8b-tp2", ((4096, 6144), (6144, 4096)),
                               (1, 7, 16, 128, 129, 1024, 4095, 4096, 16384), chunk=1000, repetitions=5,
                               determinism_m=(1, 129, 4096, 16384)),
    # Interpreter scale: both orientations (N > K and K > N), reduced extents below BLOCK_K and not
    # multiples of 16, so masked tails are exercised; the largest M (1025) lands in the large-M entries of the
    # tables, as 4095 did, at a quarter of the interpreted cost (CI time).
    "tiny": GemmPreset("tiny", ((40, 56), (56, 40)), (1, 7, 128, 129, 1025), chunk=300, repetitions=3,
                       determinism_m=(1, 129)),
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
}
MOE_GPU_PRESETS = ("reference", "qwen3-30b-a3b", "qwen3-235b-a22b", "olmoe", "mixtral-8x7b")
