"""MoE: a deterministic, batch-invariant Mixture-of-Experts expert MLP (gather, grouped up-projection with SwiGLU,
grouped down-projection, combine), forward and backward, in BF16 and in block-scaled FP8 (``fp8/``).

Inside: ``layer`` (the BF16 layer, its autograd Function and pure-torch reference), ``routing`` (expert-sorted padded
rows built on the device), ``configs`` (the pinned config tables), ``kernels`` / ``triton_blocks`` (Triton kernels),
``ws`` / ``gluon_blocks`` (warp-specialized Gluon kernels for sm_90), ``launch`` (stage launch wrappers), ``operands``
and ``checks`` (weight layouts and fail-closed input checks), ``common`` (names and constants shared with fp8/).
"""

from detkit.kernels.moe.fp8.layer import Fp8WeightCache, moe_mlp_fp8, moe_mlp_fp8_ref
from detkit.kernels.moe.layer import (
    MoeGrads, deinterleave_gate_up, interleave_gate_up, moe_mlp, moe_mlp_bwd, moe_mlp_fwd, moe_mlp_ref,
)

__all__ = ["moe_mlp", "moe_mlp_fwd", "moe_mlp_bwd", "moe_mlp_ref", "MoeGrads", "interleave_gate_up",
           "deinterleave_gate_up", "moe_mlp_fp8", "moe_mlp_fp8_ref", "Fp8WeightCache"]
