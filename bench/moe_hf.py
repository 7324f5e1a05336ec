"""transformers' Qwen3-MoE sparse MoE block in ``detkit bench moe``: what a model's MoE layer costs as transformers
runs it (``hf``) and inside ``detkit.batch_invariant_mode()`` (``hf_detkit``: the router's fixed-order top-k sum and
the experts on detkit's BF16 MoE layer, mode/moe.py), so the swap's price or gain is measured on one module.

The block (``Qwen3MoeSparseMoeBlock``) is built from a ``Qwen3MoeConfig`` at a preset's H, I, E, K (norm_topk_prob,
SiLU), BF16, random init: router weight N(0, 0.02^2), gate_up_proj N(0, 1/H), down_proj N(0, 1/I); its experts run
``config._experts_implementation`` (``--hf-experts``; default ``grouped_mm``, which a model built by transformers
gets where torch has grouped GEMMs). It runs on the preset's x as [1, T, H]. Both rows time the whole block: router
(linear, softmax, top-k) and experts, routed by its own router (the detkit layers' rows are given the routing).
fwd is the training forward (autograd records); fwd_bwd adds ``torch.autograd.grad`` for x and the three weights.

Validation: the block's out and gradients (x, router weight, gate_up_proj, down_proj) against an FP64 reference of
the block with the top-k ids its own router chose (the choice is discrete and BF16 logits may tie), relative L2 at
most VALIDATE_REL_L2 each.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from detkit.bench.moe_common import VALIDATE_REL_L2, rel_l2_fp32, torch_moe_fwd
from detkit.toolkit.models import BLOCK_TENSORS, block_grads
from detkit.toolkit.presets import MoePreset

EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")
DEFAULT_EXPERTS = "grouped_mm"
ROUTER_STD = 0.02


def unavailable_reason() -> str | None:
    """None when transformers' Qwen3-MoE block can be built here; else why not (one line)."""
    try:
        from transformers.models.qwen3_moe import modeling_qwen3_moe

        modeling_qwen3_moe.Qwen3MoeSparseMoeBlock  # noqa: B018 (present in transformers 5.x)
    except (ImportError, AttributeError) as exc:
        return f"transformers' Qwen3-MoE block is not importable ({exc}); pip install 'detkit[models]'"
    return None


def build_block(p: MoePreset, device: torch.device, seed: int, experts: str = DEFAULT_EXPERTS):
    """The block at ``p``'s widths, BF16, seeded random weights, experts on ``experts``."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if experts not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(f"experts implementation {experts!r} not supported; supported: {EXPERTS_IMPLEMENTATIONS}")
    config = Qwen3MoeConfig(hidden_size=p.h, moe_intermediate_size=p.i, num_experts=p.e, num_experts_per_tok=p.k,
                            norm_topk_prob=True, hidden_act="silu", experts_implementation=experts)
    if getattr(config, "_experts_implementation", None) != experts:  # a transformers that ignores the keyword
        config._experts_implementation = experts
    with torch.device(device):
        block = Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param, std in ((block.gate.weight, ROUTER_STD), (block.experts.gate_up_proj, p.h**-0.5),
                           (block.experts.down_proj, p.i**-0.5)):
            param.copy_(torch.randn(param.shape, generator=gen, device=device) * std)
    return block


def experts_implementation(block) -> str | None:
    return getattr(block.experts.config, "_experts_implementation", None)


def weights(block) -> list[torch.Tensor]:
    return [block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]


def block_fns(block, x: torch.Tensor, dout: torch.Tensor) -> dict[str, Callable[[], object]]:
    """{"fwd", "fwd_bwd"} of ``block`` on x [T, H] (run as [1, T, H]); dout [T, H]."""
    xl = x.detach().reshape(1, *x.shape).requires_grad_(True)
    dl = dout.reshape(1, *dout.shape)
    params = weights(block)

    def fwd():
        return block(xl)

    def fwd_bwd():
        return torch.autograd.grad(block(xl), [xl, *params], dl)

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def block_reference(block, x: torch.Tensor, dout: torch.Tensor, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The block in FP64 with the top-k ``ids`` fixed: out and the gradients (x, router weight, gate_up_proj,
    down_proj). The experts are the PyTorch baseline's per-expert loop (bench/moe_common.py)."""
    from detkit.mode.moe import down_as_w2, gate_up_as_w1

    f64 = torch.float64
    leaves = [t.detach().to(f64).requires_grad_(True) for t in (x, *weights(block))]
    x64, w_gate, gate_up, down = leaves
    probs = torch.softmax(x64 @ w_gate.t(), dim=-1)
    top = probs.gather(1, ids.long())
    if block.gate.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    out = torch_moe_fwd(x64, gate_up_as_w1(gate_up), down_as_w2(down), ids.to(torch.int32), top, grouped=False)
    grads = torch.autograd.grad(out, leaves, dout.to(f64))
    return dict(zip(BLOCK_TENSORS, (out.detach(), *grads)))


def check_block(block, x: torch.Tensor, dout: torch.Tensor) -> dict:
    """One forward + backward against the FP64 reference with the same ids: relative L2 per tensor (FP32 norms)."""
    got, ids = block_grads(block, x[None], dout[None])  # the block takes [B, T, H]
    got = {**got, "out": got["out"][0], "dx": got["dx"][0]}
    want = block_reference(block, x, dout, ids)
    rel = {f"rel_l2_fp64_{n}": rel_l2_fp32(got[n], want[n]) for n in BLOCK_TENSORS}
    return {"validated": all(v <= VALIDATE_REL_L2 for v in rel.values()), "limit": VALIDATE_REL_L2, **rel}


def mode():
    """``detkit.batch_invariant_mode()`` (imported when entered: it selects the kernels' backend)."""
    from detkit.mode.switch import batch_invariant_mode

    return batch_invariant_mode()


def check_block_in_mode(block, x: torch.Tensor, dout: torch.Tensor) -> dict:
    """``check_block`` inside the mode, which must route the block's router and experts (its counters say so): a
    block the mode leaves on transformers' code is not the ``hf_detkit`` implementation."""
    from detkit.mode.switch import mode_counters
    from detkit.mode.moe import EXPERTS_KERNEL, EXPERTS_OP, ROUTER_KERNEL, ROUTER_OP

    before = mode_counters()
    with mode():
        check = check_block(block, x, dout)
    seen = mode_counters() - before
    check.update(mode_counters=seen.as_dict())
    missing = [f"{op} -> {kernel}" for op, kernel in ((EXPERTS_OP, EXPERTS_KERNEL), (ROUTER_OP, ROUTER_KERNEL))
               if not seen.routed.get((op, kernel))]
    if missing:
        check.update(validated=False, failure=f"validation failed, not timed: the mode did not route {missing}; "
                                              f"not routed: {seen.as_dict()['not_routed']}")
    return check
