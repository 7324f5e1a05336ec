"""Helpers shared by the mode's Qwen3-MoE tests (tests/test_mode_moe.py, tests/test_mode_moe_fp8.py)."""

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe


def qwen3_30b_a3b_block(device, seed: int) -> "hf_moe.Qwen3MoeSparseMoeBlock":
    """One transformers Qwen3-MoE block at Qwen3-30B-A3B widths (hidden 2048, 128 experts of 768, top-8), BF16,
    every parameter drawn from N(0, 0.02)."""
    config = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                            norm_topk_prob=True)
    torch.manual_seed(seed)
    with torch.device(device):
        block = hf_moe.Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return block


def grouped_mm_on_detkit(monkeypatch) -> None:
    """transformers' "grouped_mm" experts with each grouped GEMM on detkit's grouped kernel, outside the mode: what
    the mode runs when it leaves an experts call to transformers (its ``_grouped_mm`` calls are routed)."""
    from detkit.kernels.grouped import grouped_mm

    def detkit_grouped_mm(a, b, *, offs=None, bias=None, out_dtype=None):
        if bias is not None or out_dtype not in (None, torch.bfloat16):
            raise NotImplementedError("the reference takes no bias and no out_dtype")
        return grouped_mm(a, b, offs)
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", detkit_grouped_mm)
