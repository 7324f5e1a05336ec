"""Launch names of the grouped GEMM family: one string for a launch (Triton's launch_metadata, seen by profilers),
its NVTX range and its report row. The TMA kernels' names end in " tma"; the pointer kernels' carry no suffix."""

from __future__ import annotations


def case_name(op: str, m: int, n: int, k: int, groups: int, variant: str = "ptr") -> str:
    """``grouped_mm [M=…, N=…, K=…, G=…] bf16``: M rows split into G groups, each times its own [K, N] matrix;
    ``grouped_wgrad``: the [G, M, N] per-group products reducing over K rows split into G groups. ``variant``
    "tma" appends `` tma`` (the kernel that loads by TMA descriptors)."""
    return f"grouped_{op} [M={m}, N={n}, K={k}, G={groups}] bf16" + ("" if variant == "ptr" else f" {variant}")


def _mm_launch_metadata(grid, metadata, args):
    m, n, k, g = args["M"], args["N"], args["K"], args["G"]
    return {"name": case_name("mm", m, n, k, g), "flops": 2.0 * m * n * k}


def _wgrad_launch_metadata(grid, metadata, args):
    p, q, r, g = args["P"], args["Q"], args["R"], args["G"]
    return {"name": case_name("wgrad", p, q, r, g), "flops": 2.0 * p * q * r}


def _mm_tma_launch_metadata(grid, metadata, args):
    m, n, k, g = args["M"], args["N"], args["K"], args["G"]
    return {"name": case_name("mm", m, n, k, g, "tma"), "flops": 2.0 * m * n * k}


def _wgrad_tma_launch_metadata(grid, metadata, args):
    p, q, r, g = args["P"], args["Q"], args["R"], args["G"]
    return {"name": case_name("wgrad", p, q, r, g, "tma"), "flops": 2.0 * p * q * r}
