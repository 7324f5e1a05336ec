"""Rotary position embeddings: transformers' ``apply_rotary_pos_emb`` as one fused kernel with its bits.

Inside: ``rope`` (the kernel, its checks and launch), ``reference`` (the pure-torch reference).
"""

from detkit.kernels.rotary.reference import apply_rotary_pos_emb_ref
from detkit.kernels.rotary.rope import output_strides, rope_kernel, rope_launcher, rope_reason

__all__ = ["apply_rotary_pos_emb_ref", "output_strides", "rope_kernel", "rope_launcher", "rope_reason"]
