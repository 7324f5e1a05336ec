"""Launch names of the attention kernels: one string shared by a launch (``launch_metadata``), its NVTX range and
its report row, and the FLOP count the profiler attaches to it."""

from __future__ import annotations


def case_name(op: str, batch: int, heads_q: int, heads_kv: int, seq_q: int, seq_k: int, head_dim: int) -> str:
    """The one name shared by a launch (launch_metadata), its NVTX range and its report row."""
    dims = f"B={batch}, Hq={heads_q}, Hkv={heads_kv}, Sq={seq_q}, Skv={seq_k}, D={head_dim}"
    return f"detkit_attention_{op} [{dims}] bf16"


def causal_pairs(seq_q: int, seq_k: int) -> int:
    """Visible (query, key) pairs of one head of one sequence without padding (queries the last seq_q keys)."""
    before = max(seq_k - seq_q, 0) * seq_q
    q = min(seq_q, seq_k)
    return before + q * (q + 1) // 2


def launch_metadata_of(op: str, flops_per_pair: int):
    def launch_metadata(grid, metadata, args):
        d = args["HEAD_DIM"]
        name = case_name(op, args["batch"], args["heads_q"], args["heads_kv"], args["seq_q"], args["seq_k"], d)
        pairs = causal_pairs(args["seq_q"], args["seq_k"])
        return {"name": name, "flops": float(flops_per_pair * d * pairs * args["batch"] * args["heads_q"])}
    return launch_metadata

