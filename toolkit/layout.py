"""The shape presets of the TP=2 x CP=2 layout (``--preset``) and the layout names the harness uses.

The layout itself (rank mapping, groups, shard offsets, CP token order, the AxisGroup handle) is data the
operators check against, so it lives with them in kernels/parallel/layout.py; it is re-exported here for the launcher,
the audits and the benchmarks.
"""

from __future__ import annotations

from collections.abc import Sequence

from detkit.kernels.parallel.layout import (  # noqa: F401 (re-exported)
    AXES, CP_SIZE, FULL_WORLD, QWEN3_8B, TINY, TP_SIZE, AxisGroup, ModelDims, TpCpLayout,
)

# Shape preset name (toolkit.presets / --preset) -> (model, batch B, sequence length S).
LAYOUT_PRESETS: dict[str, tuple[ModelDims, int, int]] = {
    "qwen3-8b-tp2": (QWEN3_8B, 2, 4096),  # M_local = 4096
    # Interpreter scale: B = 2 so a CP shard is two row blocks; I/2 = 48 is not a multiple of any
    # BLOCK_N and M_local = 6 is not a power of two.
    "tiny": (TINY, 2, 6),
}


def layout_for_preset(preset: str, world: Sequence[int] = FULL_WORLD) -> TpCpLayout:
    """The layout a shape preset runs at (``--preset``; 'tiny' on the interpreter)."""
    if preset not in LAYOUT_PRESETS:
        raise ValueError(f"preset {preset!r} has no TP/CP layout; supported: {sorted(LAYOUT_PRESETS)}")
    model, batch, seq_len = LAYOUT_PRESETS[preset]
    return TpCpLayout(model, batch, seq_len, tuple(world))
