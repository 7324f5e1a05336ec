"""det_gemm's op names: the one name shared by a launch (Triton's launch_metadata, seen by profilers), its
NVTX range and its report row, for every det_gemm kernel (Triton and Gluon)."""

from __future__ import annotations

OPS = ("fwd", "da", "db")
_OP_IDS = {op: i for i, op in enumerate(OPS)}


# The kernels' PRECISION constexpr -> the operands' kind in a launch's name.
KINDS = {"bf16": "bf16", "fp16": "fp16", "ieee": "fp32 ieee", "tf32": "fp32 tf32"}


def case_name(op: str, m: int, n: int, k: int, kind: str = "bf16") -> str:
    """The one name shared by a launch, its NVTX range and its report row; ``kind``: "bf16" / "fp16" (the operands)
    or "fp32 ieee" / "fp32 tf32" (FP32 operands and the products' precision)."""
    return f"det_gemm_{op} [M={m}, N={n}, K={k}] {kind}"


def _layer_dims(op_id: int, rows: int, cols: int, red: int) -> tuple[int, int, int]:
    """Map the kernel's (rows, cols, reduced) back to the layer's (M, N, K)."""
    if op_id == _OP_IDS["fwd"]:
        return rows, cols, red
    if op_id == _OP_IDS["da"]:
        return rows, red, cols
    return red, cols, rows


def _launch_metadata(grid, metadata, args):
    op = OPS[args["op_id"]]
    m, n, k = _layer_dims(args["op_id"], args["R"], args["C"], args["L"])
    return {"name": case_name(op, m, n, k, KINDS[args.get("PRECISION", "bf16")]), "flops": 2.0 * m * n * k}
