"""Shape presets the suites run at. ``qwen3-8b-tp2`` is the production preset; ``tiny`` is for the
Triton interpreter on the CPU and is labelled as such in every report."""

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
