"""The MoE layers' precision comparisons that the MoE audits and benchmarks share: the tensors of one forward and
backward (``GRAD_NAMES``) and the FP8 precision gate: for every one of them, cosine >= GATE_MIN_COSINE and relative
RMSE < GATE_MAX_REL_RMSE against the FP64 oracle (kernels.moe.moe_mlp_ref) and, when given, against the BF16 detkit
path (docs/moe_fp8.md)."""

from __future__ import annotations

import torch

from detkit.toolkit.contract import cosine, rel_l2

GRAD_NAMES = ("out", "dx", "dw1", "dw2", "dscores")
# The FP8 precision gate, for out, dX, dscores, dW1, dW2 against FP64 and against the BF16 path.
GATE_MIN_COSINE = 0.997
GATE_MAX_REL_RMSE = 0.076


def precision_stats(got: dict, inp: dict, bf16_path: dict | None = None,
                    oracle: dict | None = None) -> dict[str, dict[str, float]]:
    """Per tensor: cosine and relative RMSE against the FP64 oracle (computed unless given) and (when given)
    the BF16 detkit path."""
    if oracle is None:
        from detkit.kernels.moe.layer import moe_mlp_ref  # kernels load when a check runs, not with the CLI

        args = (inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"], inp["dout"])
        oracle = moe_mlp_ref(*args, dtype=torch.float64)
    stats = {}
    for name in GRAD_NAMES:
        st = {"cosine_fp64": cosine(got[name], oracle[name]), "rel_rmse_fp64": rel_l2(got[name], oracle[name])}
        if bf16_path is not None:
            st.update({"cosine_bf16_path": cosine(got[name], bf16_path[name]),
                       "rel_rmse_bf16_path": rel_l2(got[name], bf16_path[name]),
                       "bf16_path_rel_rmse_fp64": rel_l2(bf16_path[name], oracle[name])})
        stats[name] = st
    return stats


def gate_passed(st: dict) -> bool:
    """Whether one tensor's ``precision_stats`` pass the FP8 gate against every reference they hold."""
    keys = [k for k in ("fp64", "bf16_path") if f"cosine_{k}" in st]
    return all(st[f"cosine_{k}"] >= GATE_MIN_COSINE and st[f"rel_rmse_{k}"] < GATE_MAX_REL_RMSE for k in keys)
