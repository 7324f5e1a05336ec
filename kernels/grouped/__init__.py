"""Grouped GEMMs: deterministic, batch-invariant BF16 GEMMs over groups of rows delimited by device offsets (the
forms of torch._grouped_mm an MoE block's experts and their backward call).

Inside: ``configs`` (the pinned config table), ``kernels`` (the Triton kernels), ``names`` (launch names),
``launch`` (checks and launch wrappers, pointer and TMA variants; the math and the determinism claim in its
docstring), ``gates`` (the grouped path's elementwise steps: an expert's bias, gpt-oss's gate), ``combine`` (the
top-k combine and the gather's backward), ``reference`` (the pure-torch references).
"""

from detkit.kernels.grouped.launch import (
    GroupedLaunch, check_offsets, grouped_mm, grouped_mm_launch, grouped_wgrad, grouped_wgrad_launch,
)
from detkit.kernels.grouped.reference import (
    grouped_mm_ref, grouped_mm_sequential, grouped_wgrad_ref, grouped_wgrad_sequential,
)

__all__ = ["grouped_mm", "grouped_wgrad", "grouped_mm_launch", "grouped_wgrad_launch", "GroupedLaunch", "check_offsets",
           "grouped_mm_ref", "grouped_mm_sequential", "grouped_wgrad_ref", "grouped_wgrad_sequential"]
