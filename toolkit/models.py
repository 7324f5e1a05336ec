"""The transformers causal LM that the model audit (correctness) and the model bench (speed) build, and what they
share about it: the model presets, where the model comes from, its MoE blocks, default vs detkit mode, and one MoE
block's forward and backward.

The model: transformers' Qwen3 built from a config with random weights in BF16 -- on cuda the Qwen3-8B widths with
2 layers, on cpu a tiny config for the Triton interpreter -- or the model named by ``DETKIT_MODEL_CONFIG``: a preset
name (``MODEL_PRESETS``), a JSON config file, or a checkpoint directory read with local_files_only (nothing is ever
downloaded). ``DETKIT_MODEL_MOE_EXPERTS`` (``bf16``, the default, or ``fp8``) is the mode's ``moe_experts``;
``DETKIT_MODEL_FP8_GRAPH_WEIGHTS`` (``quantize``, the default, or ``static``) its ``fp8_graph_weights``. transformers
is imported when a model is built, not with the CLI.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from pathlib import Path

import torch

CONFIG_ENV = "DETKIT_MODEL_CONFIG"
EXPERTS_ENV = "DETKIT_MODEL_MOE_EXPERTS"  # the mode's moe_experts: bf16 (default) or fp8
GRAPH_WEIGHTS_ENV = "DETKIT_MODEL_FP8_GRAPH_WEIGHTS"  # the mode's fp8_graph_weights: quantize (default) or static
MODES = ("default", "detkit")
# The mode's counter names of the ops a GEMM or a MoE block runs through: one of them on torch in detkit mode means
# the model did not run on detkit's kernels.
GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")
MOE_OPS = ("moe experts (transformers)", "moe router (transformers)")

# Qwen3-8B's widths (hidden 4096, intermediate 12288, 32 query / 8 KV heads of 128, vocab 151936), 2 layers.
QWEN3_8B_WIDTHS = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=40960, tie_word_embeddings=False, hidden_act="silu",
                       attention_bias=False)
# The CPU config (Triton interpreter): the same structure, tiny; head_dim 64 is one the attention kernel supports.
QWEN3_TINY = dict(QWEN3_8B_WIDTHS, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=256, max_position_embeddings=512)
# Qwen3-30B-A3B's widths (hidden 2048, 128 experts of moe_intermediate 768, top-8 normalised, 32 query / 4 KV heads
# of 128, vocab 151936), 2 layers, every layer a sparse MoE block.
QWEN3_MOE_30B_A3B_WIDTHS = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                                num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                                num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                                tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
                                router_aux_loss_coef=0.001)
# The CPU MoE config (Triton interpreter): 8 experts, top-2, 2 layers.
QWEN3_MOE_TINY = dict(QWEN3_MOE_30B_A3B_WIDTHS, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                      vocab_size=256, max_position_embeddings=512)
# The CPU MoE config for FP8 experts (H and I multiples of 128): hidden 128, 4 experts of 128, top-2, 1 layer.
QWEN3_MOE_TINY_128 = dict(QWEN3_MOE_TINY, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                          num_experts=4, num_experts_per_tok=2, num_hidden_layers=1)
# DETKIT_MODEL_CONFIG=<name> (or the model bench's --preset <name>): (model_type, config fields, description).
MODEL_PRESETS = {
    "qwen3-8b": ("qwen3", QWEN3_8B_WIDTHS, "Qwen3 8B widths"),
    "qwen3-tiny": ("qwen3", QWEN3_TINY, "Qwen3 tiny"),
    "qwen3-moe-30b-a3b": ("qwen3_moe", QWEN3_MOE_30B_A3B_WIDTHS, "Qwen3-MoE 30B-A3B widths"),
    "qwen3-moe-tiny": ("qwen3_moe", QWEN3_MOE_TINY, "Qwen3-MoE tiny"),
    "qwen3-moe-tiny-128": ("qwen3_moe", QWEN3_MOE_TINY_128, "Qwen3-MoE tiny, H = I = 128 (FP8-capable)"),
}


def model_source(device: torch.device, spec: str | None = None) -> tuple[object, Path | None, str]:
    """(config, checkpoint dir with weights or None, description) of ``spec`` (a preset name, a JSON config file or a
    checkpoint directory), else of DETKIT_MODEL_CONFIG, else the device's default preset."""
    from transformers import AutoConfig

    spec = spec or os.environ.get(CONFIG_ENV) or ("qwen3-8b" if device.type == "cuda" else "qwen3-tiny")
    if spec in MODEL_PRESETS:
        model_type, fields, description = MODEL_PRESETS[spec]
        return AutoConfig.for_model(model_type, **fields), None, f"{description} ({spec}), random init"
    path = Path(spec)
    if path.is_dir():
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
        return config, path if weights else None, f"{path} ({'weights' if weights else 'config only, random init'})"
    if path.is_file():
        fields = json.loads(path.read_text())
        model_type = fields.pop("model_type", "qwen3")
        return AutoConfig.for_model(model_type, **fields), None, f"{path} (random init)"
    raise ValueError(f"{CONFIG_ENV}={spec!r} is neither a preset ({', '.join(MODEL_PRESETS)}), a JSON config file "
                     "nor a checkpoint directory")


def build_model(device: torch.device, seed: int, spec: str | None = None):
    """The model of ``model_source(device, spec)`` in BF16 on ``device``, SDPA attention, eval mode, and its
    description."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise RuntimeError("the model audit and bench need transformers: pip install 'detkit[models]'") from exc

    config, weights, description = model_source(device, spec)
    torch.manual_seed(seed)
    if weights is not None:
        model = AutoModelForCausalLM.from_pretrained(weights, local_files_only=True, dtype=torch.bfloat16,
                                                     attn_implementation="sdpa").to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval(), description


def moe_blocks(model) -> list:
    """The model's transformers Qwen3-MoE sparse MoE blocks (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]


def is_moe(model) -> bool:
    return bool(getattr(model.config, "num_experts", 0)) and bool(moe_blocks(model))


def moe_meta(model) -> dict | None:
    if not is_moe(model):
        return None
    c = model.config
    return {"experts": c.num_experts, "top_k": c.num_experts_per_tok, "moe_intermediate": c.moe_intermediate_size,
            "norm_topk_prob": c.norm_topk_prob, "moe_blocks": len(moe_blocks(model)),
            "transformers_experts_implementation": getattr(c, "_experts_implementation", None)}


def cache_kwarg(model) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (5.2x); take the name this version's model declares."""
    params = inspect.signature(model.model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _env_choice(env: str, supported: tuple[str, ...]) -> str:
    """The value of ``env`` (default: the first of ``supported``); refused by name before any work when it is not
    one the mode supports."""
    value = os.environ.get(env) or supported[0]
    if value not in supported:
        raise ValueError(f"{env}={value!r} is not supported; supported: {', '.join(supported)}")
    return value


def moe_experts_choice() -> str:
    """The mode's moe_experts for the model audit and bench, from DETKIT_MODEL_MOE_EXPERTS (default "bf16")."""
    from detkit.mode.state import MOE_EXPERTS

    return _env_choice(EXPERTS_ENV, MOE_EXPERTS)


def fp8_graph_weights_choice() -> str:
    """The mode's fp8_graph_weights for the model audit and bench, from DETKIT_MODEL_FP8_GRAPH_WEIGHTS (default
    "quantize")."""
    from detkit.mode.state import FP8_GRAPH_WEIGHTS

    return _env_choice(GRAPH_WEIGHTS_ENV, FP8_GRAPH_WEIGHTS)


def routing_check(counters: dict, moe: bool, experts: str) -> tuple[bool, dict]:
    """Whether detkit mode ran the model on detkit's kernels, from the mode's counters (``ModeCounters.as_dict()``):
    no GEMM on torch and, for a MoE model, every expert call on detkit's layer of the ``experts`` precision (none on
    torch, none on the other precision's layer, at least one seen); and the details that say so."""
    from detkit.mode.moe import EXPERTS_KERNELS

    gemm_misses = {k: n for k, n in counters["not_routed"].items() if k.split(":", 1)[0] in GEMM_OPS}
    details = {"gemm_not_routed": gemm_misses}
    passed = not gemm_misses
    if moe:
        moe_misses = {k: n for k, n in counters["not_routed"].items() if k.split(":", 1)[0] in MOE_OPS}
        moe_routed = sum(n for k, n in counters["routed"].items() if k.startswith(MOE_OPS[0] + " -> "))
        other_kernels = {f"{MOE_OPS[0]} -> {kernel}" for e, kernel in EXPERTS_KERNELS.items() if e != experts}
        other = {k: n for k, n in counters["routed"].items() if k in other_kernels}
        details.update(moe_not_routed=moe_misses, moe_experts_routed=moe_routed, moe_experts=experts,
                       moe_other_precision=other)
        passed = passed and not moe_misses and moe_routed > 0 and not other
    return passed, details


def mode_context(mode: str, moe_experts: str | None = None, fp8_graph_weights: str | None = None):
    """``batch_invariant_mode(...)`` for "detkit", nothing for "default" (imported when entered: it selects the
    kernels' backend)."""
    if mode == "detkit":
        from detkit.mode.switch import batch_invariant_mode

        return batch_invariant_mode(moe_experts=moe_experts, fp8_graph_weights=fp8_graph_weights)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# One MoE block's forward and backward
# ---------------------------------------------------------------------------------------------
BLOCK_TENSORS = ("out", "dx", "d_router", "d_gate_up_proj", "d_down_proj")


def block_grads(block, x: torch.Tensor, dout: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """One forward and backward of a transformers MoE block ``x`` [B, T, H] in whatever mode is entered: its output
    and the gradients of x, the router weight, gate_up_proj and down_proj as ``.backward()`` leaves them in ``.grad``
    (``BLOCK_TENSORS``; the block's ``.grad`` are cleared before and after), and the ids its router chose."""
    chosen = []
    handle = block.gate.register_forward_hook(lambda m, args, out: chosen.append(out[2]))
    block.zero_grad(set_to_none=True)
    xg = x.detach().requires_grad_(True)
    try:
        with torch.enable_grad():
            out = block(xg)
            out.backward(dout)
    finally:
        handle.remove()
    grads = (xg.grad, block.gate.weight.grad, block.experts.gate_up_proj.grad, block.experts.down_proj.grad)
    block.zero_grad(set_to_none=True)
    return dict(zip(BLOCK_TENSORS, (out.detach(), *grads))), chosen[0]


def moe_block_grads(block, x: torch.Tensor, dout: torch.Tensor, moe_experts: str) -> tuple[dict, torch.Tensor]:
    """``block_grads`` in strict detkit mode with ``moe_experts``."""
    from detkit.mode.switch import batch_invariant_mode

    with batch_invariant_mode(strict=True, moe_experts=moe_experts):
        return block_grads(block, x, dout)
