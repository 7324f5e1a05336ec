"""The transformers causal LM that the model audit (correctness) and the model bench (speed) build, and what they
share about it: the model presets, where the model comes from, its MoE blocks, default vs detkit mode, and one MoE
block's forward and backward.

The model: transformers' Qwen3 built from a config with random weights in BF16 -- on cuda the Qwen3-8B widths with
2 layers, on cpu a tiny config for the Triton interpreter -- or the model named by ``DETKIT_MODEL_CONFIG``: a preset
name (``MODEL_PRESETS``: per family of ``FAMILIES`` real widths with 2 layers and a tiny config, each with the
attention implementation it is built with and what detkit does not cover in it yet), a JSON config file, or a
checkpoint directory read with local_files_only (nothing is ever downloaded); for the audit also ``families``, a
family name or a list (``model_specs``). ``DETKIT_MODEL_MOE_EXPERTS`` (``bf16``, the default, or ``fp8``) is the
mode's ``moe_experts`` (``fp8`` with ``fp8_shapes="all"``: the audit and the bench run the FP8 layer at every width,
also where the mode's default gives a shape to the BF16 layer, which the ``bf16`` runs cover);
``DETKIT_MODEL_FP8_GRAPH_WEIGHTS`` (``quantize``, the default, or ``static``) its ``fp8_graph_weights``. transformers
is imported when a model is built, not with the CLI.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from dataclasses import dataclass
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
# ---------------------------------------------------------------------------------------------
# The families of the model audit's matrix: real widths with 2 layers (cuda) and a tiny config (cpu, interpreter)
# ---------------------------------------------------------------------------------------------
# Tiny configs share these: head_dim 64 (one the attention kernel supports) unless the family's own is wider, and
# token ids the tiny vocab holds (some configs' defaults, e.g. Phi-3's pad 32000, are past a vocab of 256).
TINY_COMMON = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                   vocab_size=256, num_hidden_layers=2, max_position_embeddings=512, tie_word_embeddings=False,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Windows: the real models' windows (Mistral-7B-v0.1 4096, Gemma-2 4096, Gemma-3 1024, gpt-oss 128) are past the
# audit's sequences except gpt-oss's, so the presets take 128 on cuda (256-token sequences cross it) and 4 on cpu
# (the decode steps run past it): the window is exercised, its width is not the model's.
GPU_WINDOW, TINY_WINDOW = 128, 4
MIXED_LAYERS = ["sliding_attention", "full_attention"]
# Llama-3-8B: hidden 4096, intermediate 14336, 32 query / 8 KV heads of 128, vocab 128256, rope theta 500000.
LLAMA3_8B_WIDTHS = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=128, vocab_size=128256, num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=500000.0,
                        max_position_embeddings=8192, tie_word_embeddings=False)
# Qwen2.5-7B: hidden 3584, intermediate 18944, 28 query / 4 KV heads of 128, q/k/v with biases, vocab 152064.
QWEN25_7B_WIDTHS = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                        head_dim=128, vocab_size=152064, num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=1e6,
                        max_position_embeddings=32768, tie_word_embeddings=False, use_sliding_window=False)
# Mistral-7B-v0.1: hidden 4096, intermediate 14336, 32 query / 8 KV heads of 128, vocab 32000, every layer sliding.
MISTRAL_7B_WIDTHS = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, vocab_size=32000, num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=32768, tie_word_embeddings=False, sliding_window=GPU_WINDOW)
# Gemma-2-9B: hidden 3584, intermediate 14336, 16 query / 8 KV heads of 256, vocab 256000, attention logits capped
# at 50 and final logits at 30, sliding and global layers alternating. transformers' Gemma-2 has no sdpa path (it
# does not cap): attn_implementation="detkit".
GEMMA2_9B_WIDTHS = dict(hidden_size=3584, intermediate_size=14336, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=256, vocab_size=256000, num_hidden_layers=2, query_pre_attn_scalar=256,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=GPU_WINDOW,
                        layer_types=MIXED_LAYERS, max_position_embeddings=8192)
# Gemma-3-12B (text): hidden 3840, intermediate 15360, 16 query / 8 KV heads of 256, q/k norms, vocab 262208, a
# sliding layer then a global one (the model has 5 sliding per global).
GEMMA3_12B_WIDTHS = dict(hidden_size=3840, intermediate_size=15360, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=256, vocab_size=262208, num_hidden_layers=2, query_pre_attn_scalar=256,
                         sliding_window=GPU_WINDOW, layer_types=MIXED_LAYERS, max_position_embeddings=32768)
# Phi-3-medium (128k's widths, no rope scaling): hidden 5120, intermediate 17920, 40 query / 10 KV heads of 128
# (fused qkv_proj and gate_up_proj), vocab 32064. Phi-3-mini's head dim, 96, is not one the attention kernel has.
PHI3_MEDIUM_WIDTHS = dict(hidden_size=5120, intermediate_size=17920, num_attention_heads=40, num_key_value_heads=10,
                          vocab_size=32064, num_hidden_layers=2, rms_norm_eps=1e-5, max_position_embeddings=4096,
                          tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# OLMo-2-7B: hidden 4096, intermediate 11008, 32 heads of 128 (no GQA), q/k norms over the whole projection, the
# norms after attention and MLP, vocab 100352.
OLMO2_7B_WIDTHS = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                       vocab_size=100352, num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=500000.0,
                       max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=1, bos_token_id=None,
                       eos_token_id=2)
# gpt-oss-20b: hidden 2880, 64 query / 8 KV heads of 64 with sinks, a 128-token window on every other layer, 32
# experts of 2880 (clamped SwiGLU with biases), top-4, vocab 201088. No sdpa path (sinks): "detkit".
GPT_OSS_20B_WIDTHS = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                          head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
                          num_hidden_layers=2, sliding_window=128, layer_types=MIXED_LAYERS,
                          max_position_embeddings=131072, tie_word_embeddings=False, pad_token_id=0,
                          eos_token_id=2, router_aux_loss_coef=0.9)
# DeepSeek-V3, scaled to one GPU: its widths (hidden 7168, MLA with q rank 1536, kv rank 512, 128 heads of qk
# 128 + 64 rope and v 128, experts of 2048, top-8 in 4 of 8 groups, one shared expert, an FP32 router with a
# score-correction bias, vocab 129280), 2 layers (a dense one, first_k_dense_replace 1, then a MoE one), and 64
# routed experts instead of 256.
DEEPSEEK_V3_SCALED = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=64,
                          n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True,
                          routed_scaling_factor=2.5, first_k_dense_replace=1, num_attention_heads=128,
                          num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                          qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, num_hidden_layers=2,
                          rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Mixtral-8x7B: hidden 4096, 8 experts of 14336, top-2, 32 query / 8 KV heads of 128, vocab 32000.
MIXTRAL_8X7B_WIDTHS = dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                           num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=32768,
                           tie_word_embeddings=False, sliding_window=None, router_aux_loss_coef=0.02)
# GLM-4.5-Air (GLM-4-MoE): hidden 4096, 96 query / 8 KV heads of 128 with q/k/v biases and half-rotary, 128
# experts of 1408, top-8, one shared expert, sigmoid router with a correction bias, vocab 151552; 2 layers (a dense
# one, first_k_dense_replace 1, then a MoE one).
GLM4_MOE_AIR_WIDTHS = dict(hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                           n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
                           norm_topk_prob=True, routed_scaling_factor=1.0, first_k_dense_replace=1,
                           num_attention_heads=96, num_key_value_heads=8, head_dim=128, partial_rotary_factor=0.5,
                           attention_bias=True, use_qk_norm=False, vocab_size=151552, num_hidden_layers=2,
                           rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)

TINY_MOE = dict(TINY_COMMON, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts_per_tok=2)


@dataclass(frozen=True)
class ModelPreset:
    """A model the audit and bench can build: transformers' ``model_type`` with ``fields`` (random init, BF16), the
    attention implementation it is built with ("sdpa", or "detkit" for a model without transformers' sdpa path),
    and what detkit does not cover in it yet (``gaps``: reported with the results, never hiding them)."""

    model_type: str
    fields: dict
    description: str
    attn_implementation: str = "sdpa"
    gaps: tuple[str, ...] = ()

    def __post_init__(self):
        if self.attn_implementation not in ("sdpa", "detkit"):
            raise ValueError(f"attn_implementation {self.attn_implementation!r}; supported: 'sdpa', 'detkit'")


# DETKIT_MODEL_CONFIG=<name> (or the model bench's --preset <name>).
MODEL_PRESETS = {
    "qwen3-8b": ModelPreset("qwen3", QWEN3_8B_WIDTHS, "Qwen3 8B widths"),
    "qwen3-tiny": ModelPreset("qwen3", QWEN3_TINY, "Qwen3 tiny"),
    "qwen3-moe-30b-a3b": ModelPreset("qwen3_moe", QWEN3_MOE_30B_A3B_WIDTHS, "Qwen3-MoE 30B-A3B widths"),
    "qwen3-moe-tiny": ModelPreset("qwen3_moe", QWEN3_MOE_TINY, "Qwen3-MoE tiny"),
    "qwen3-moe-tiny-128": ModelPreset("qwen3_moe", QWEN3_MOE_TINY_128, "Qwen3-MoE tiny, H = I = 128 (FP8-capable)"),
    "llama3-8b": ModelPreset("llama", LLAMA3_8B_WIDTHS, "Llama-3 8B widths"),
    "llama3-tiny": ModelPreset("llama", dict(TINY_COMMON, rope_theta=500000.0), "Llama-3 tiny"),
    "qwen2.5-7b": ModelPreset("qwen2", QWEN25_7B_WIDTHS, "Qwen2.5 7B widths (q/k/v biases)"),
    "qwen2.5-tiny": ModelPreset("qwen2", dict(TINY_COMMON, use_sliding_window=False), "Qwen2.5 tiny (q/k/v biases)"),
    "mistral-7b": ModelPreset("mistral", MISTRAL_7B_WIDTHS, f"Mistral-7B-v0.1 widths, sliding window {GPU_WINDOW}"),
    "mistral-tiny": ModelPreset("mistral", dict(TINY_COMMON, sliding_window=TINY_WINDOW),
                                f"Mistral tiny, sliding window {TINY_WINDOW}"),
    "gemma2-9b": ModelPreset("gemma2", GEMMA2_9B_WIDTHS, f"Gemma-2 9B widths, softcaps, window {GPU_WINDOW} / global",
                             "detkit"),
    "gemma2-tiny": ModelPreset("gemma2", dict(TINY_COMMON, head_dim=256, query_pre_attn_scalar=256,
                                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                              sliding_window=TINY_WINDOW, layer_types=MIXED_LAYERS),
                               f"Gemma-2 tiny, head dim 256, softcaps, window {TINY_WINDOW} / global", "detkit"),
    "gemma3-12b": ModelPreset("gemma3_text", GEMMA3_12B_WIDTHS, f"Gemma-3 12B widths, window {GPU_WINDOW} / global"),
    "gemma3-tiny": ModelPreset("gemma3_text", dict(TINY_COMMON, head_dim=256, query_pre_attn_scalar=256,
                                                   sliding_window=TINY_WINDOW, layer_types=MIXED_LAYERS),
                               f"Gemma-3 tiny, head dim 256, window {TINY_WINDOW} / global"),
    "phi3-medium": ModelPreset("phi3", PHI3_MEDIUM_WIDTHS, "Phi-3-medium widths (fused qkv and gate_up)"),
    "phi3-tiny": ModelPreset("phi3", {k: v for k, v in TINY_COMMON.items() if k != "head_dim"},
                             "Phi-3 tiny (fused qkv and gate_up)"),
    "olmo2-7b": ModelPreset("olmo2", OLMO2_7B_WIDTHS, "OLMo-2 7B widths"),
    "olmo2-tiny": ModelPreset("olmo2", {k: v for k, v in TINY_COMMON.items() if k != "head_dim"}, "OLMo-2 tiny"),
    "gpt-oss-20b": ModelPreset("gpt_oss", GPT_OSS_20B_WIDTHS, "gpt-oss-20b widths (sinks, window 128 / global, "
                               "32 experts, top-4)", "detkit"),
    "gpt-oss-tiny": ModelPreset("gpt_oss", dict(TINY_COMMON, hidden_size=64, intermediate_size=64,
                                                num_local_experts=4, num_experts_per_tok=2, sliding_window=TINY_WINDOW,
                                                layer_types=MIXED_LAYERS, router_aux_loss_coef=0.9,
                                                max_position_embeddings=131072),
                                f"gpt-oss tiny (sinks, window {TINY_WINDOW} / global, 4 experts, top-2)", "detkit"),
    "deepseek-v3-scaled": ModelPreset("deepseek_v3", DEEPSEEK_V3_SCALED, "DeepSeek-V3 widths, 64 routed experts "
                                      "(scaled from 256), a dense and a MoE layer"),
    "deepseek-v3-tiny": ModelPreset("deepseek_v3", dict(TINY_MOE, n_routed_experts=8, n_shared_experts=1, n_group=2,
                                                        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                                                        first_k_dense_replace=1, num_key_value_heads=2,
                                                        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32,
                                                        qk_rope_head_dim=32, v_head_dim=32,
                                                        head_dim=32),  # head_dim: the rope dim, as V3 sets it
                                    "DeepSeek-V3 tiny (MLA qk 64 / v 32, 8 experts in 2 groups, top-2, a dense and "
                                    "a MoE layer)"),
    "mixtral-8x7b": ModelPreset("mixtral", MIXTRAL_8X7B_WIDTHS, "Mixtral-8x7B widths"),
    "mixtral-tiny": ModelPreset("mixtral", dict(TINY_MOE, num_local_experts=4, sliding_window=None,
                                                router_aux_loss_coef=0.02), "Mixtral tiny (4 experts, top-2)"),
    "glm4-moe-air": ModelPreset("glm4_moe", GLM4_MOE_AIR_WIDTHS, "GLM-4.5-Air widths (GLM-4-MoE), a dense and a MoE "
                                "layer"),
    "glm4-moe-tiny": ModelPreset("glm4_moe", dict(TINY_MOE, n_routed_experts=8, n_shared_experts=1, n_group=1,
                                                  topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                                                  first_k_dense_replace=1, partial_rotary_factor=0.5,
                                                  attention_bias=True, use_qk_norm=False),
                                 "GLM-4-MoE tiny (8 experts, top-2, a dense and a MoE layer)"),
}
# The model audit's family matrix (DETKIT_MODEL_CONFIG=families): family -> (real widths, 2 layers: cuda; tiny: cpu).
FAMILIES = {
    "llama3": ("llama3-8b", "llama3-tiny"),
    "qwen2.5": ("qwen2.5-7b", "qwen2.5-tiny"),
    "qwen3": ("qwen3-8b", "qwen3-tiny"),
    "qwen3-moe": ("qwen3-moe-30b-a3b", "qwen3-moe-tiny"),
    "mistral": ("mistral-7b", "mistral-tiny"),
    "gemma2": ("gemma2-9b", "gemma2-tiny"),
    "gemma3": ("gemma3-12b", "gemma3-tiny"),
    "phi3": ("phi3-medium", "phi3-tiny"),
    "olmo2": ("olmo2-7b", "olmo2-tiny"),
    "gpt-oss": ("gpt-oss-20b", "gpt-oss-tiny"),
    "deepseek-v3": ("deepseek-v3-scaled", "deepseek-v3-tiny"),
    "mixtral": ("mixtral-8x7b", "mixtral-tiny"),
    "glm4-moe": ("glm4-moe-air", "glm4-moe-tiny"),
}
ALL_FAMILIES = "families"  # DETKIT_MODEL_CONFIG=families: every family at the device's size


def model_specs(device: torch.device, value: str | None = None) -> list[str]:
    """The models a DETKIT_MODEL_CONFIG value names, refused before any work when one is unknown: ``families``
    (every family: real widths on cuda, tiny on cpu), a comma-separated list of presets and family names (a family
    at the device's size), or one preset / JSON file / checkpoint directory (``model_source`` reads it)."""
    value = value if value is not None else os.environ.get(CONFIG_ENV)
    if not value:
        return ["qwen3-8b" if device.type == "cuda" else "qwen3-tiny"]
    names = [n.strip() for n in value.split(",") if n.strip()]
    size = 0 if device.type == "cuda" else 1
    if len(names) == 1 and names[0] != ALL_FAMILIES:
        return [FAMILIES[names[0]][size] if names[0] in FAMILIES else names[0]]
    specs = []
    for name in names:
        if name == ALL_FAMILIES:
            specs += [pair[size] for pair in FAMILIES.values()]
        elif name in FAMILIES:
            specs.append(FAMILIES[name][size])
        elif name in MODEL_PRESETS:
            specs.append(name)
        else:
            raise ValueError(f"{CONFIG_ENV}: {name!r} is neither a preset ({', '.join(MODEL_PRESETS)}), a family "
                             f"({', '.join(FAMILIES)}) nor {ALL_FAMILIES!r}")
    return list(dict.fromkeys(specs))


def family_of(spec: str) -> str:
    """The family a preset belongs to (its name for anything else)."""
    return next((f for f, pair in FAMILIES.items() if spec in pair), spec)


def with_layers(config, layers: int):
    """``config`` with ``layers`` decoder layers: a family's attention pattern (``layer_types``: sliding / full
    attention) repeated, not re-chosen, so 8 layers of a 2-layer Gemma preset are its pattern four times; layer
    choices given by index stay as they are (DeepSeek-V3 / GLM-4-MoE's ``first_k_dense_replace`` leading dense
    layers, then MoE layers)."""
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise ValueError(f"layers {layers!r} is not supported; supported: an int >= 1")
    pattern = getattr(config, "layer_types", None)
    config.num_hidden_layers = layers
    if pattern:
        config.layer_types = [pattern[i % len(pattern)] for i in range(layers)]
    return config


def model_source(device: torch.device, spec: str | None = None,
                 layers: int | None = None) -> tuple[object, Path | None, str]:
    """(config, checkpoint dir with weights or None, description) of ``spec`` (a preset name, a JSON config file or a
    checkpoint directory), else of DETKIT_MODEL_CONFIG, else the device's default preset; ``layers`` overrides a
    random-init model's layer count (``with_layers``)."""
    if layers is not None:
        config, weights, description = model_source(device, spec)
        if weights is not None:
            raise ValueError(f"layers {layers} with a checkpoint's weights ({weights}) is not supported; supported: "
                             "a preset or a config file (random init)")
        return with_layers(config, layers), None, f"{description}, {layers} layers"
    from transformers import AutoConfig

    spec = spec or os.environ.get(CONFIG_ENV) or ("qwen3-8b" if device.type == "cuda" else "qwen3-tiny")
    if spec in MODEL_PRESETS:
        preset = MODEL_PRESETS[spec]
        config = AutoConfig.for_model(preset.model_type, **preset.fields)
        return config, None, f"{preset.description} ({spec}), random init"
    path = Path(spec)
    if path.is_dir():
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
        return config, path if weights else None, f"{path} ({'weights' if weights else 'config only, random init'})"
    if path.is_file():
        fields = json.loads(path.read_text())
        model_type = fields.pop("model_type", "qwen3")
        return AutoConfig.for_model(model_type, **fields), None, f"{path} (random init)"
    raise ValueError(f"{CONFIG_ENV}={spec!r} is neither a preset ({', '.join(MODEL_PRESETS)}), a family or "
                     f"{ALL_FAMILIES!r} (the audit's matrix: {', '.join(FAMILIES)}), a JSON config file nor a "
                     "checkpoint directory")


def attn_implementation(config, spec: str | None = None) -> str:
    """The attention implementation a model is built with: its preset's; else "sdpa" where transformers' model class
    has an sdpa path, "detkit" where it has none (Gemma-2's softcap, gpt-oss's sinks)."""
    if spec in MODEL_PRESETS:
        return MODEL_PRESETS[spec].attn_implementation
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "sdpa" if model_class is None or getattr(model_class, "_supports_sdpa", True) else "detkit"


def build_model(device: torch.device, seed: int, spec: str | None = None, layers: int | None = None):
    """The model of ``model_source(device, spec, layers)`` in BF16 on ``device``, eval mode, and its description;
    attention by ``attn_implementation`` (model.config._attn_implementation says which)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise RuntimeError("the model audit and bench need transformers: pip install 'detkit[models]'") from exc

    config, weights, description = model_source(device, spec, layers)
    attn = attn_implementation(config, spec or os.environ.get(CONFIG_ENV))
    if attn == "detkit":
        from detkit.mode.attention import register_transformers_attention

        register_transformers_attention()
    torch.manual_seed(seed)
    if weights is not None:
        model = AutoModelForCausalLM.from_pretrained(weights, local_files_only=True, dtype=torch.bfloat16,
                                                     attn_implementation=attn).to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn)
    return model.eval(), description


def experts_modules(model) -> dict[str, torch.nn.Module]:
    """name -> a MoE layer's experts module (transformers calls it ``experts(hidden [T, H], top_k_index [T, K],
    top_k_weights)`` in every MoE family: Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3, GLM-4-MoE); empty when dense."""
    return {name: m for name, m in model.named_modules() if type(m).__name__.endswith("Experts")}


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


def _fp8_shapes(moe_experts: str | None) -> str | None:
    """What the audit and the bench ask for FP8 experts: the FP8 layer at every shape it takes (they measure that
    layer; where it is slower the mode's default runs the BF16 layer, which their bf16 runs measure)."""
    return "all" if moe_experts == "fp8" else None


def mode_context(mode: str, moe_experts: str | None = None, fp8_graph_weights: str | None = None):
    """``batch_invariant_mode(...)`` for "detkit", nothing for "default" (imported when entered: it selects the
    kernels' backend)."""
    if mode == "detkit":
        from detkit.mode.switch import batch_invariant_mode

        return batch_invariant_mode(moe_experts=moe_experts, fp8_graph_weights=fp8_graph_weights,
                                    fp8_shapes=_fp8_shapes(moe_experts))
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
    """``block_grads`` in strict detkit mode with ``moe_experts`` ("fp8": the FP8 layer at any width)."""
    from detkit.mode.switch import batch_invariant_mode

    with batch_invariant_mode(strict=True, moe_experts=moe_experts, fp8_shapes=_fp8_shapes(moe_experts)):
        return block_grads(block, x, dout)
