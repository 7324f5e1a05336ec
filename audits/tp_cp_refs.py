"""TP=2 x CP=2 shard references in one process, without a process group (suite 'tp-cp-refs').

For every rank of the layout: Gate/Up N-shards and Down dHidden shards equal the TP=1, CP=1 det_gemm
bit for bit (they need no reduction); Down forward, Gate/Up dX and dW partials and their version-1
sums are within the contract of the FP64 global oracle, and, on exact fixtures, bitwise equal to it;
the two-operand sum does not depend on operand order; CP shards partition the token rows.
"""

from __future__ import annotations

from collections.abc import Iterator

from detkit.toolkit.harness import Row, RunContext
from detkit.toolkit.layout import layout_for_preset
from detkit.toolkit.nvtx_ranges import nvtx_range
from detkit.toolkit.shard_refs import check_all

NAME = "tp_cp_refs"
DESCRIPTION = "TP/CP shard references vs the TP=1 det_gemm, the v1 reduction oracle and the FP64 oracle"


def run(ctx: RunContext) -> Iterator[Row]:
    layout = layout_for_preset(ctx.preset)
    with nvtx_range(f"tp_cp_refs {layout.model.name} B={layout.batch} S={layout.seq_len}"):
        for chk in check_all(layout, ctx.seed, ctx.device):
            yield Row(suite=NAME, check=chk.check, name=chk.name, passed=chk.passed, backend=ctx.backend,
                      details={"model": layout.model.label, **chk.details})
