"""Pure-torch reference of the rotary family: transformers' ``apply_rotary_pos_emb`` (Llama's, which most families
copy), op for op."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb_ref(q, k, cos, sin, unsqueeze_dim=1):
    """(q, k) rotated by (cos, sin) [B, S, D] broadcast over the heads (dim ``unsqueeze_dim``)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
