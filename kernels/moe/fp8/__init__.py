"""The FP8 MoE expert MLP: the BF16 layer's stages with E4M3 operands and power-of-two block scales (1x128 rows,
128x128 weights), FP32 accumulation.

Inside: ``layer`` (the layer, the weight cache, autograd Function, reference and quantization-risk report),
``quant`` (the quantizers and their references), ``configs``, ``kernels`` (Triton), ``ws`` / ``ws_gather`` /
``colwise_sm90`` (Gluon kernels for sm_90), ``launch`` (stage launch wrappers).
"""

from detkit.kernels.moe.fp8.layer import Fp8WeightCache, moe_fp8_risk, moe_mlp_fp8, moe_mlp_fp8_ref

__all__ = ["moe_mlp_fp8", "moe_mlp_fp8_ref", "moe_fp8_risk", "Fp8WeightCache"]
