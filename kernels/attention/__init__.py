"""Attention: deterministic, batch-invariant causal GQA attention for Hopper, forward and backward.

Inside: ``configs`` (the pinned tile table), ``kernels`` (the Triton kernels, their math and the invariance rule),
``names`` (launch names), ``launch`` (checks, launch wrappers, autograd, MLA's value head dim run zero-padded; the
paged-KV forward), ``host_values`` (the host copies of length tensors, read once while unwritten), ``reference``
(pure-torch references and the FP64 bounds), ``sdpa`` (adapters: torch's ``scaled_dot_product_attention`` signature and
transformers' attention-function signature).
"""

from detkit.kernels.attention.configs import HEAD_DIMS, AttnConfig, AttnConfigs
from detkit.kernels.attention.launch import attention, attention_paged, attention_varlen
from detkit.kernels.attention.reference import (
    attention_bwd_bound, attention_fwd_bound, attention_oracle, attention_paged_ref, attention_ref, attention_split_ref,
    attention_varlen_ref, gather_pages,
)
from detkit.kernels.attention.sdpa import (
    hf_attention_forward, sdpa, sdpa_accepted, sdpa_unsupported_reason, tag_mask_anchor,
)

__all__ = ["attention", "attention_varlen", "attention_paged", "attention_ref", "attention_split_ref",
           "attention_varlen_ref", "attention_paged_ref", "gather_pages", "attention_oracle",
           "attention_fwd_bound", "attention_bwd_bound", "sdpa", "sdpa_accepted", "sdpa_unsupported_reason",
           "hf_attention_forward", "tag_mask_anchor",
           "HEAD_DIMS", "AttnConfig", "AttnConfigs"]
