"""detkit mode across processes (mode/parallel.py, docs/mode_parallel.md).

One process: the segmented one-process routes against explicit shard sums (det_gemm on the shards, FP32, summed
in rank order, rounded once: what the ranks compute), and every refusal of ``prepare``. Real process groups
(gloo, interpreter; the processes are started here): a TP=2 ``parallelize_module`` model and a DP=2 split of a
tiny Qwen3 against the one-process model prepared with the same plan, bitwise (audits/model_parallel.py's jobs);
and the rank-side refusals, raised before any collective (every collective patched to fail in that process).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from detkit.kernels.det_gemm.launch import det_gemm_da_launch, det_gemm_db_launch, det_gemm_fwd_launch
from detkit.mode import parallel as mode_parallel
from detkit.mode.parallel import ParallelPlanError, prepare
from detkit.toolkit.fixtures import bf16_randn
from tests.conftest import assert_bits_equal, cpu_ranks_only

import detkit


def _linear(k: int, n: int, seed: int, device) -> torch.nn.Linear:
    lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(bf16_randn((n, k), seed, device, scale=k ** -0.5))
    return lin


class _Holder(torch.nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.proj = lin

    def forward(self, x):
        return self.proj(x)


def _shard_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """What the ranks form: FP32 partials added in rank order from zero, one BF16 rounding."""
    total = torch.zeros_like(parts[0])
    for p in parts:
        assert p.dtype == torch.float32
        total += p
    return total.to(torch.bfloat16)


# ------------------------------------------------------------------------------ one process: the math
@pytest.mark.parametrize("m", [1, 7, 33])
def test_rowwise_one_process_forward_is_the_tp2_shard_sum(device, m):
    k, n = 128, 64
    model = _Holder(_linear(k, n, 1, device))
    prepare(model, {"proj": "rowwise"}, tp_size=2)
    x = bf16_randn((m, k), 2, device)
    cfg = mode_parallel.routes(model)["proj"].configs["fwd"]
    w = model.proj.weight
    want = _shard_sum([det_gemm_fwd_launch(x[:, s], w[:, s].t(), config=cfg, out_dtype=torch.float32)[0]
                       for s in (slice(0, k // 2), slice(k // 2, k))])
    with detkit.batch_invariant_mode():
        got = model(x)
    assert_bits_equal(got, want, "rowwise TP=1 segmented forward vs two FP32 shards summed")


@pytest.mark.parametrize("m", [1, 7, 33])
def test_colwise_one_process_dx_is_the_tp2_shard_sum(device, m):
    k, n = 64, 128
    model = _Holder(_linear(k, n, 3, device))
    prepare(model, {"proj": "colwise"}, tp_size=2)
    x = bf16_randn((m, k), 4, device).requires_grad_()
    dy = bf16_randn((m, n), 5, device)
    cfg = mode_parallel.routes(model)["proj"].configs["da"]
    w = model.proj.weight
    want = _shard_sum([det_gemm_da_launch(dy[:, s], w[s].t(), config=cfg, out_dtype=torch.float32)[0]
                       for s in (slice(0, n // 2), slice(n // 2, n))])
    with detkit.batch_invariant_mode():
        model(x).backward(dy)
    assert_bits_equal(x.grad, want, "colwise TP=1 segmented dX vs two FP32 shards summed")


@pytest.mark.parametrize("rows_per_rank", [3, 64])  # 3: each shard zero-padded to BLOCK_K rows; 64: no pad
def test_dp_one_process_dw_is_the_dp2_rank_sum(device, rows_per_rank):
    k, n = 64, 32
    model = _Holder(_linear(k, n, 6, device))
    prepare(model, dp_size=2)
    x = bf16_randn((2 * rows_per_rank, k), 7, device)
    dy = bf16_randn((2 * rows_per_rank, n), 8, device)
    cfg = mode_parallel.routes(model)["proj"].configs["db"]
    want = _shard_sum([det_gemm_db_launch(dy[s], x[s], config=cfg, out_dtype=torch.float32)[0]
                       for s in (slice(0, rows_per_rank), slice(rows_per_rank, 2 * rows_per_rank))])
    with detkit.batch_invariant_mode():
        model(x).backward(dy)
    assert_bits_equal(model.proj.weight.grad, want, "DP=1 segmented dW vs two ranks' FP32 partials summed")


class _Attn(torch.nn.Module):
    """q_proj then q_norm over heads of 64, as Qwen3's attention (a q_norm beside a colwise q_proj)."""

    def __init__(self, device):
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        super().__init__()
        self.q_proj = _linear(64, 128, 13, device)
        self.q_norm = Qwen3RMSNorm(64).to(device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            self.q_norm.weight.copy_(bf16_randn((64,), 14, device))

    def forward(self, x):
        return self.q_norm(self.q_proj(x).view(*x.shape[:-1], -1, 64))


def _ranks_norm_sum(prod: torch.Tensor, dp: int, tp: int) -> torch.Tensor:
    """The ranks' order for prod [T, H, D]: per DP shard of the tokens (outside) and TP shard of the heads (inside)
    one FP32 row sum (det_gemm_db of ones, pinned config); blocks added in FP32 from zero, TP first; one rounding."""
    from detkit.kernels.parallel.invariant import INVARIANT_CONFIG_TABLE

    total = torch.zeros(prod.shape[-1], dtype=torch.float32, device=prod.device)
    for shard in prod.chunk(dp, 0):
        part = torch.zeros_like(total)
        for heads in shard.chunk(tp, 1):
            rows = heads.reshape(-1, prod.shape[-1])
            part += det_gemm_db_launch(rows.new_ones((rows.shape[0], 1)), rows,
                                       config=INVARIANT_CONFIG_TABLE["db"][0], out_dtype=torch.float32)[0][0]
        total += part
    return total.to(torch.bfloat16)


@pytest.mark.parametrize("tp_size,dp_size", [(2, 1), (1, 2), (2, 2)])
def test_rmsnorm_weight_grad_is_the_ranks_block_sum(device, tp_size, dp_size):
    """q_norm's weight gradient in one process, cut as the ranks cut it; its output keeps transformers' bits."""
    model = _Attn(device)
    x = bf16_randn((2, 3, 64), 15, device)
    dy = bf16_randn((2, 3, 2, 64), 16, device)
    prepare(model, {"q_proj": "colwise"} if tp_size > 1 else None, tp_size=tp_size, dp_size=dp_size)
    assert "q_norm" in mode_parallel.routes(model)
    with detkit.batch_invariant_mode():
        qb = model.q_proj(x).view(2, 3, 2, 64)
        want_out = type(model.q_norm).forward(model.q_norm, qb)  # transformers' own forward
        q = qb.float()
        normed = (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + model.q_norm.variance_epsilon)).bfloat16()
        assert_bits_equal(model.q_norm(qb), want_out, "q_norm output on the route vs transformers' own")
        model(x).backward(dy)
    want = _ranks_norm_sum((dy * normed).reshape(6, 2, 64), dp_size, tp_size)
    assert_bits_equal(model.q_norm.weight.grad, want, "q_norm weight grad vs the ranks' block sum")


def test_outside_the_mode_a_prepared_linear_is_torchs(device):
    model = _Holder(_linear(64, 32, 9, device))
    x = bf16_randn((5, 64), 10, device)
    want = torch.nn.functional.linear(x, model.proj.weight)
    prepare(model, {"proj": "rowwise"}, tp_size=2)
    assert_bits_equal(model(x), want, "prepared Linear outside the mode")
    before = detkit.mode_counters()
    with detkit.batch_invariant_mode():
        model(x)
    assert (detkit.mode_counters() - before).routed == {
        ("linear (tp rowwise)", "det_gemm pinned, FP32 partials (one process, segmented)"): 1}


def test_dp_one_process_refuses_rows_that_do_not_split(device):
    model = _Holder(_linear(64, 32, 11, device))
    prepare(model, dp_size=2)
    x = bf16_randn((5, 64), 12, device)
    with detkit.batch_invariant_mode(), pytest.raises(ParallelPlanError, match="5 rows do not split into dp_size=2"):
        model(x).sum().backward()


# ------------------------------------------------------------------------------ one process: DP embedding, MoE
def _spread(t: torch.Tensor, seed: int) -> torch.Tensor:
    """``t`` with each row (last dim) scaled by 2^k, k uniform in [-12, 12] (exact in BF16): FP32 sums of such rows
    round, so a sum in another order or cut at other boundaries shows in the bits (with rows of one magnitude a few
    BF16 terms add exactly in FP32 and any order passes)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-12, 13, (*t.shape[:-1], 1), generator=g).to(t.device)
    return (t.float() * torch.exp2(k.float())).to(t.dtype)


class _Embed(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, device, padding_idx=None, **kwargs):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, padding_idx=padding_idx, device=device, dtype=torch.bfloat16,
                                        **kwargs)
        with torch.no_grad():
            self.embed.weight.copy_(bf16_randn((vocab, dim), 20, device))

    def forward(self, ids):
        return self.embed(ids)


@pytest.mark.parametrize("dp_size,padding_idx", [(2, None), (2, 3), (3, None)])
def test_dp_one_process_embedding_grad_is_the_ranks_index_sum(device, dp_size, padding_idx):
    """The one-process embedding gradient: per DP shard of the tokens each id's rows summed from zero in ascending
    position (the pure-torch reference), the shard sums added in FP32 in rank order, one rounding -- what the ranks'
    partials and their ordered sum form. Ids repeat within and across shards."""
    from detkit.kernels.reductions import index_sum_ref

    vocab, dim, seqs, seq = 5, 48, 2 * dp_size, 12  # about 10 rows per id per shard
    model = _Embed(vocab, dim, device, padding_idx)
    summary = prepare(model, dp_size=dp_size)
    assert summary.covered == ("embed.weight",)
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(0, vocab, (seqs, seq), generator=g).to(device)
    dy = _spread(bf16_randn((seqs, seq, dim), 22, device), 26)
    with detkit.batch_invariant_mode():
        out = model(ids)
        out.backward(dy)
    assert_bits_equal(out, model.embed.weight[ids], "the DP embedding route's forward (a gather)")
    rows, flat = dy.reshape(-1, dim), ids.reshape(-1)
    per = rows.shape[0] // dp_size
    total = torch.zeros((vocab, dim), dtype=torch.float32, device=device)
    for s in range(dp_size):
        total += index_sum_ref(rows[s * per:(s + 1) * per], flat[s * per:(s + 1) * per],
                               torch.zeros_like(total), skip=padding_idx)
    assert_bits_equal(model.embed.weight.grad, total.to(torch.bfloat16), "DP=1 embedding dW vs the ranks' index sums")
    if padding_idx is not None:
        assert not model.embed.weight.grad[padding_idx].any()


def _mirrored(t: torch.Tensor, sign: float) -> torch.Tensor:
    """[2, ...] from t [1, ...]: DP shard 1 = shard 0 times ``sign`` (exact)."""
    return torch.cat([t, t * sign])


def test_dp_one_process_embedding_grad_cancels_where_the_ranks_cancel(device):
    """Shard 1 holds shard 0's ids with the gradient rows negated: each rank's partial is the other's negation, so
    the ranks' sum is +0.0 in every element, bit for bit; the whole batch summed in one order (torch's kind of sum,
    here the reference over all rows) leaves rounding residues. So the test fails for any order but the ranks'."""
    from detkit.kernels.reductions import index_sum_ref

    vocab, dim = 5, 48
    model = _Embed(vocab, dim, device)
    prepare(model, dp_size=2)
    ids = _mirrored(torch.randint(0, vocab, (1, 40), generator=torch.Generator().manual_seed(29)).to(device), 1)
    dy = _mirrored(_spread(bf16_randn((1, 40, dim), 30, device), 31), -1.0)
    with detkit.batch_invariant_mode():
        model(ids).backward(dy)
    assert_bits_equal(model.embed.weight.grad, torch.zeros_like(model.embed.weight), "DP=1 embedding dW (+0.0)")
    whole = index_sum_ref(dy.reshape(-1, dim), ids.reshape(-1), torch.zeros((vocab, dim), device=device))
    assert whole.to(torch.bfloat16).count_nonzero() > 0  # one order over all rows does not cancel


def test_dp_embedding_route_counts_and_refuses_by_name(device):
    model = _Embed(11, 16, device)
    prepare(model, dp_size=2)
    before = detkit.mode_counters()
    with detkit.batch_invariant_mode():
        model(torch.zeros((2, 3), dtype=torch.long, device=device))
    assert (detkit.mode_counters() - before).routed == {
        ("embedding (dp)", "index_sum fixed order, FP32 partials (one process, per shard)"): 1}
    with detkit.batch_invariant_mode(), pytest.raises(ParallelPlanError, match="3 tokens do not split into dp_size=2"):
        model(torch.zeros((1, 3), dtype=torch.long, device=device)).sum().backward()
    for kwargs, pattern in (({"max_norm": 1.0}, r"embed: nn.Embedding\(max_norm=1.0\) under DP"),
                            ({"scale_grad_by_freq": True}, r"scale_grad_by_freq=True\) under DP"),
                            ({"sparse": True}, r"sparse=True\) under DP")):
        refused = _Embed(11, 16, device, **kwargs)
        with pytest.raises(ParallelPlanError, match=pattern) as info:
            prepare(refused, dp_size=2)
        assert "\n" not in str(info.value) and not mode_parallel.routes(refused)
    assert not mode_parallel.routes(_Embed(11, 16, device)) and not prepare(_Embed(11, 16, device)).covered


def _tiny_moe_block(device, hidden: int = 64, inter: int = 32):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=4, num_experts_per_tok=2,
                            norm_topk_prob=True)
    torch.manual_seed(23)
    with torch.device(device):
        block = Qwen3MoeSparseMoeBlock(config).to(torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return block


@pytest.mark.parametrize("mirrored", [False, True])
def test_dp_one_process_moe_router_and_experts_grads_are_the_ranks_sums(device, mirrored):
    """A Qwen3-MoE block prepared with dp_size=2: the router's dW is the two shards' FP32 det_gemm_db partials added
    in rank order; the experts' dW1 / dW2 are the BF16 MoE layer's FP32 sums over each shard's routed rows
    (main_grads from zero, one call per shard as each rank makes it) added in rank order; one rounding each.
    The block's output and input gradient are the two shards' own (a token's rows never mix with another's).
    mirrored: shard 1 = shard 0's tokens with dY negated, so the ranks' sums are +0.0 exactly, while the layer over
    all tokens in one call (one order) leaves residues: the test fails for any order but the ranks'."""
    from detkit.kernels.moe.layer import moe_mlp
    from detkit.mode import moe as mode_moe

    block = _tiny_moe_block(device)
    summary = prepare(block, dp_size=2)
    assert set(summary.covered) == {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}
    tokens = 32  # 2 x 16: about 16 routed rows per expert, 8 per shard
    x = _spread(bf16_randn((2, 16, 64), 24, device), 27)
    dy = _spread(bf16_randn((2, 16, 64), 25, device), 28)
    if mirrored:
        x, dy = _mirrored(x[:1], 1.0), _mirrored(dy[:1], -1.0)
    x.requires_grad_()
    before = detkit.mode_counters()
    with detkit.batch_invariant_mode():
        out = block(x)
        out.backward(dy)
    routed = {op for op, _ in (detkit.mode_counters() - before).routed}
    assert {"moe experts (dp)", "linear (dp)", mode_moe.EXPERTS_OP, mode_moe.ROUTER_OP} <= routed

    # what each rank computes on its 16 tokens: the router's linear on the route's pinned GEMMs, softmax / top-k /
    # fixed-order normalisation as the mode's router, the layer with main_grads from zero
    route = mode_parallel.routes(block)["gate"]
    exp, w = block.experts, block.gate.weight.detach()
    gate_parts, g1s, g2s, outs, dxs = [], [], [], [], []
    for s in (slice(0, tokens // 2), slice(tokens // 2, tokens)):
        xs = x.detach().reshape(tokens, 64)[s].clone().requires_grad_()
        dys = dy.reshape(tokens, 64)[s]
        logits = det_gemm_fwd_launch(xs.detach(), w.t(), config=route.configs["fwd"])[0].requires_grad_()
        top, ids = torch.topk(torch.softmax(logits, -1, dtype=torch.float), 2, dim=-1)
        scores = (top / mode_moe.fixed_order_sum(top)).to(torch.bfloat16)
        g1 = torch.zeros(exp.gate_up_proj.shape, dtype=torch.float32, device=device)
        g2 = torch.zeros(exp.down_proj.shape, dtype=torch.float32, device=device)
        o = moe_mlp(xs, exp.gate_up_proj.detach().transpose(1, 2), exp.down_proj.detach().transpose(1, 2),
                    ids.to(torch.int32), scores, (g1.transpose(1, 2), g2.transpose(1, 2)), gate_up="split")
        o.backward(dys)
        dlogits = logits.grad
        gate_parts.append(det_gemm_db_launch(dlogits, xs.detach(), config=route.configs["db"],
                                             out_dtype=torch.float32)[0])
        dxs.append(xs.grad + det_gemm_da_launch(dlogits, w.t(), config=route.configs["da"])[0])
        outs.append(o.detach())
        g1s.append(g1)
        g2s.append(g2)
    assert_bits_equal(out.detach().reshape(tokens, 64), torch.cat(outs), "the DP experts route's output vs per shard")
    assert_bits_equal(x.grad.reshape(tokens, 64), torch.cat(dxs), "the block's dX vs per shard")
    assert_bits_equal(block.gate.weight.grad, _shard_sum(gate_parts), "DP=1 router dW vs the ranks' FP32 partials")
    assert_bits_equal(exp.gate_up_proj.grad, _shard_sum(g1s), "DP=1 experts dW1 vs the ranks' FP32 sums")
    assert_bits_equal(exp.down_proj.grad, _shard_sum(g2s), "DP=1 experts dW2 vs the ranks' FP32 sums")
    if mirrored:
        for p in (block.gate.weight, exp.gate_up_proj, exp.down_proj):
            assert_bits_equal(p.grad, torch.zeros_like(p), "mirrored shards: the ranks' sum is +0.0")
        # the layer over all 32 tokens in one call: one order over every expert's rows
        xs = x.detach().reshape(tokens, 64).clone().requires_grad_()
        logits = det_gemm_fwd_launch(xs.detach(), w.t(), config=route.configs["fwd"])[0]
        top, ids = torch.topk(torch.softmax(logits, -1, dtype=torch.float), 2, dim=-1)
        g1 = torch.zeros(exp.gate_up_proj.shape, dtype=torch.float32, device=device)
        g2 = torch.zeros(exp.down_proj.shape, dtype=torch.float32, device=device)
        moe_mlp(xs, exp.gate_up_proj.detach().transpose(1, 2), exp.down_proj.detach().transpose(1, 2),
                ids.to(torch.int32), (top / mode_moe.fixed_order_sum(top)).to(torch.bfloat16),
                (g1.transpose(1, 2), g2.transpose(1, 2)), gate_up="split").backward(dy.reshape(tokens, 64))
        assert g1.to(torch.bfloat16).count_nonzero() > 0 and g2.to(torch.bfloat16).count_nonzero() > 0


def test_dp_experts_under_fp8_run_the_bf16_layer_where_the_mode_would_and_refuse_elsewhere(device):
    """moe_experts="fp8" under DP at a shape whose FP8 choice is the BF16 layer (H = I = 128, 4 experts, top-2: far
    below the measured FP8 shapes): the DP route runs the BF16 layer, the same output and gradients bit for bit as
    moe_experts="bf16", counted as the mode counts it; with fp8_shapes="all" (the FP8 layer at every shape) refused
    by name before any work."""
    from detkit.kernels.moe.fp8.choice import fp8_choice

    assert fp8_choice(128, 128, 4, 2, "cuda_sm90").layer == "bf16"
    x0 = _spread(bf16_randn((2, 8, 128), 31, device), 32)
    dy = _spread(bf16_randn((2, 8, 128), 33, device), 34)
    results = {}
    for experts in ("bf16", "fp8"):
        block = _tiny_moe_block(device, hidden=128, inter=128)
        prepare(block, dp_size=2)
        x = x0.clone().requires_grad_()
        before = detkit.mode_counters()
        with detkit.batch_invariant_mode(moe_experts=experts):
            out = block(x)
            out.backward(dy)
        kernels = {k for op, k in (detkit.mode_counters() - before).routed if op == "moe experts (transformers)"}
        results[experts] = (out.detach(), x.grad, *(p.grad for p in block.parameters()), kernels)
    for i, (a, b) in enumerate(zip(results["bf16"][:-1], results["fp8"][:-1])):
        assert_bits_equal(b, a, f"moe_experts='fp8' under DP at a BF16 shape vs 'bf16', tensor {i}")
    assert results["bf16"][-1] == {"detkit.moe_mlp"}
    (fp8_kernel,) = results["fp8"][-1]
    assert fp8_kernel.startswith("detkit.moe_mlp (fp8 -> bf16, FP8 slower at H=128, I=128, E=4, K=2"), fp8_kernel
    block = _tiny_moe_block(device, hidden=128, inter=128)
    prepare(block, dp_size=2)
    with pytest.raises(ParallelPlanError, match=r"^experts: moe_experts='fp8' under DP: fp8_shapes='all' runs the "
                                                r"FP8 layer at every shape; .*\(supported: 'bf16', or 'fp8' where"):
        with detkit.batch_invariant_mode(moe_experts="fp8", fp8_shapes="all"):
            block(x0)


# ------------------------------------------------------------------------------ one process: refusals
def _tiny_qwen3(device, **over):
    from detkit.audits.model_parallel import QWEN3_TINY_TP, build_model, MODELS

    if over:
        MODELS["_test"] = ("qwen3", dict(QWEN3_TINY_TP, **over))
        try:
            return build_model("_test", device, 0)
        finally:
            del MODELS["_test"]
    return build_model("qwen3", device, 0)


def _refusals():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    return [
        ({"model.norm": SequenceParallel()}, {}, "SequenceParallel is not supported"),
        ({"model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))}, {}, r"output_layouts=\('Shard\(1\)',\)"),
        ({"model.layers.*.mlp.up_proj": ColwiseParallel(input_layouts=Shard(1))}, {}, r"input_layouts=\('Shard\(1\)',\)"),
        ({"lm_head": "colwise_rep"}, {}, "style 'colwise_rep' is not supported"),
        ({"model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce"}, {}, "replicated_with_grad_allreduce"),
        ({"model.layers.*.self_attn": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate())}, {},
         "PrepareModuleInput is not supported"),
        ({"model.embed_tokens": RowwiseParallel(input_layouts=Replicate())}, {},
         r"RowwiseParallel\(input_layouts=\('Replicate',\)"),
        ({"model.embed_tokens": "rowwise"}, {}, "model.embed_tokens is a Embedding"),
        ({"model.layers.*.mlp.gate": "colwise"}, {}, "matches no module"),
        ({"model.layers.*.mlp.down_proj": "rowwise"}, {"tp_size": None}, "pass tp_size"),
        ({"model.layers.*.mlp.down_proj": "rowwise"}, {"tp_size": 3}, "K=128 does not split into tp_size=3"),
        ({"model.layers.*.mlp.down_proj": "rowwise"}, {"tp_size": 16}, "not a multiple of any invariant BLOCK_K"),
        ({"model.layers.*.mlp.*_proj": "rowwise", "model.layers.0.mlp.down_proj": "rowwise"}, {"tp_size": 2},
         "matches plan entries"),
    ]


@pytest.mark.parametrize("case", range(13))
def test_prepare_refuses_by_name(device, case):
    plan, kwargs, pattern = _refusals()[case]
    kwargs = {"tp_size": 2, **kwargs}
    model = _tiny_qwen3(device)
    with pytest.raises(ParallelPlanError, match=pattern) as info:
        prepare(model, plan, **kwargs)
    assert "\n" not in str(info.value)
    assert not mode_parallel.routes(model)  # nothing half-prepared


def test_prepare_refuses_a_tied_weight(device):
    model = _tiny_qwen3(device, tie_word_embeddings=True)
    with pytest.raises(ParallelPlanError, match=r"lm_head.weight is shared with \['model.embed_tokens.weight'\]"):
        prepare(model, dp_size=2)


def test_prepare_lists_the_reductions_of_a_plan(device):
    from detkit.audits.model_parallel import torch_plan

    summary = prepare(_tiny_qwen3(device), torch_plan("qwen3"), tp_size=2, dp_size=2)
    red = summary.reductions()
    assert red["model.layers.0.mlp.down_proj"] == ["forward: seg_len K/2", "backward dW: seg_len rows/2"]
    assert red["model.layers.0.self_attn.q_proj"] == ["backward dX: seg_len N/2", "backward dW: seg_len rows/2"]
    assert red["lm_head"] == ["backward dX: seg_len N/2", "forward: all-gather of the output (exact)",
                              "backward dW: seg_len rows/2"]
    assert not summary.on_ranks


# ------------------------------------------------------------------------------ rank-side refusals
def _refusal_rank(rank: int, init_file: str, case: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from detkit.audits.model_parallel import build_model, torch_plan

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        model = build_model("qwen3", torch.device("cpu"), 0)
        if case == "2d_mesh":
            # what TP inside FSDP2 leaves: a weight on a ("dp", "tp") mesh (parallelize_module itself takes 1-D)
            from torch.distributed.tensor import Replicate, Shard, distribute_tensor

            mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
            down = model.get_submodule("model.layers.0.mlp.down_proj")
            down.weight = torch.nn.Parameter(distribute_tensor(down.weight.detach(), mesh, [Replicate(), Shard(1)]))
            plan = {"model.layers.0.mlp.down_proj": RowwiseParallel()}
        else:
            mesh = init_device_mesh("cpu", (1,))
            parallelize_module(model, mesh, torch_plan("qwen3"))
            plan = dict(torch_plan("qwen3"))
            if case == "unplanned":
                del plan["lm_head"]
            elif case == "contradicts":
                plan["model.layers.*.mlp.down_proj"] = ColwiseParallel()

        def forbidden(*a, **k):
            raise AssertionError("a collective ran before the refusal")
        for name in ("all_reduce", "all_gather", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor"):
            setattr(dist, name, forbidden)
        try:
            prepare(model, plan)
            msg = "no refusal"
        except ParallelPlanError as exc:
            msg = str(exc)
        Path(out).write_text(msg)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case,pattern", [
    ("unplanned", "lm_head has DTensor weights but no entry in the plan"),
    ("contradicts", r"down_proj.weight has placements \('Shard\(1\)',\); the plan's colwise needs \(Shard\(0\),\)"),
    ("2d_mesh", "mesh has 2 axes"),
])
def test_rank_side_refusals_come_before_any_collective(tmp_path, case, pattern):
    import re

    import torch.multiprocessing as mp

    out = tmp_path / "msg"
    mp.start_processes(_refusal_rank, args=(str(tmp_path / "init"), case, str(out)), nprocs=1, start_method="spawn")
    msg = out.read_text()
    assert re.search(pattern, msg), msg
    assert "\n" not in msg


def _dp_refusal_rank(rank: int, init_file: str, case: str, out_dir: str) -> None:
    """One of 2 gloo DP ranks: a model the DP routes refuse, every collective patched to fail first."""
    import torch.distributed as dist

    from detkit.audits.model_parallel import build_model

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = build_model("qwen3-moe" if case == "fp8_experts" else "qwen3", torch.device("cpu"), 0)
        if case == "max_norm":
            model.model.embed_tokens.max_norm = 1.0

        def forbidden(*a, **k):
            raise AssertionError("a collective ran before the refusal")
        for name in ("all_reduce", "all_gather", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor"):
            setattr(dist, name, forbidden)
        try:
            prepare(model, dp_group=dist.group.WORLD)
            if case == "fp8_experts":
                with detkit.batch_invariant_mode(moe_experts="fp8"):
                    model(input_ids=torch.zeros((1, 4), dtype=torch.long))
            msg = "no refusal"
        except ParallelPlanError as exc:
            msg = str(exc)
        Path(out_dir, f"rank{rank}").write_text(msg)
    finally:
        dist.destroy_process_group()


@cpu_ranks_only
@pytest.mark.parametrize("case,pattern", [
    ("max_norm", r"^model.embed_tokens: nn.Embedding\(max_norm=1.0\) under DP: renormalises"),
    ("fp8_experts", r"^model.layers.0.mlp.experts: moe_experts='fp8' under DP: FP8 experts need H and I multiples of "
                    r"128; .* \(supported: 'bf16', or 'fp8' where the mode runs the BF16 layer\)$"),
])
def test_dp_rank_refusals_of_the_embedding_and_experts_come_before_any_collective(tmp_path, case, pattern):
    import re

    import torch.multiprocessing as mp

    mp.start_processes(_dp_refusal_rank, args=(str(tmp_path / "init"), case, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    for rank in range(2):
        msg = (tmp_path / f"rank{rank}").read_text()
        assert re.search(pattern, msg), msg
        assert "\n" not in msg


# ------------------------------------------------------------------------------ one GPU (world size 1)
GPU_SPEED_TOLERANCE = 1.05  # the "same speed ±5%": the median time of the parallel path / the plain model's
GPU_ROUNDS = 10  # interleaved rounds (toolkit.timing.time_back_to_back, the order reversed every other round) ...
GPU_STEPS_PER_ROUND = 3  # ... of this many timed steps per path: 30 samples each, median with p20/p80


def _world1_gpu_rank(rank: int, init_file: str, out: str) -> None:
    """One NCCL rank on one GPU: the TP path (parallelize_module on a mesh of 1 + prepare), the DP paths (prepare
    with a DP group of 1; DDP) and the plain model, the same Qwen3 (8B widths, 2 layers), under detkit mode: log-probs
    and gradients bitwise, the TP path's counters, and each path's fwd+bwd step time (median, p20, p80) over
    interleaved rounds against the plain model's."""
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    from detkit.audits.model_parallel import MODELS, _grads, logprobs, torch_plan
    from detkit.toolkit.models import QWEN3_8B_WIDTHS
    from detkit.toolkit.timing import time_back_to_back

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        device = torch.device("cuda", 0)
        MODELS["_gpu"] = ("qwen3", dict(QWEN3_8B_WIDTHS))
        from detkit.audits.model_parallel import build_model

        ids = torch.randint(0, 151936, (4, 512), generator=torch.Generator().manual_seed(0)).to(device)
        plain = build_model("_gpu", device, 0)
        tp = build_model("_gpu", device, 0)
        mesh = init_device_mesh("cuda", (1,))
        parallelize_module(tp, mesh, torch_plan("qwen3"))
        tp_plan = prepare(tp, torch_plan("qwen3"))
        dp = build_model("_gpu", device, 0)
        dp_plan = prepare(dp, dp_group=dist.group.WORLD)
        ddp = DistributedDataParallel(build_model("_gpu", device, 0))
        models = {"plain": plain, "tp_world1": tp, "dp_world1": dp, "ddp_world1": ddp}

        def step(model):
            model.zero_grad(set_to_none=True)
            with detkit.batch_invariant_mode():
                lp = logprobs(model(input_ids=ids).logits, ids)
                (-lp.sum()).backward()
            return lp.detach()

        result = {"routed_tp": tp_plan.routed(), "routed_dp": dp_plan.routed(), "local_tp": tp_plan.local(),
                  "bits": {}, "counters": {}}
        want_lp = step(plain)
        want_grads = _grads(plain)
        for name, model in models.items():
            if name == "plain":
                continue
            before = detkit.mode_counters()
            lp = step(model)
            result["counters"][name] = (detkit.mode_counters() - before).as_dict()
            grads = _grads(model.module if name == "ddp_world1" else model)
            result["bits"][name] = {"logprobs": torch.equal(lp.view(torch.int32), want_lp.view(torch.int32)),
                                    "grads": all(torch.equal(grads[n].view(torch.int16), g.view(torch.int16))
                                                 for n, g in want_grads.items())}
        # interleaved rounds (a drift of the host or clocks hits every path alike), one warm-up step each
        timings = time_back_to_back({name: (lambda m=model: step(m)) for name, model in models.items()}, device,
                                    GPU_ROUNDS, samples_per_round=GPU_STEPS_PER_ROUND, alternate=True)
        result["ms"] = {name: {"median": t.median_us / 1e3, "p20": t.p20_us / 1e3, "p80": t.p80_us / 1e3,
                               "samples": t.samples, "sm_clock_mhz": t.sm_clock_mhz} for name, t in timings.items()}
        plain_ms = result["ms"]["plain"]["median"]
        result["ratio"] = {name: t["median"] / plain_ms for name, t in result["ms"].items() if name != "plain"}
        Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_gpu_world1_tp_and_dp_paths_same_bits_and_speed_as_the_plain_model(tmp_path):
    import json
    import os

    import torch.multiprocessing as mp

    out = tmp_path / "world1.json"
    mp.start_processes(_world1_gpu_rank, args=(str(tmp_path / "init"), str(out)), nprocs=1, start_method="spawn")
    result = json.loads(out.read_text())
    report = os.environ.get("DETKIT_MODEL_PARALLEL_OUT")
    if report:
        Path(report).write_text(json.dumps(result, indent=1))
    assert result["routed_tp"] == [] and result["routed_dp"] == []  # world size 1: no invariant reduction
    assert len(result["local_tp"]) == 2 * 7 + 1  # the TP path's Linears on their local tensors
    local = result["counters"]["tp_world1"]["routed"]
    assert local.get(f"{mode_parallel.LOCAL_OP} -> {mode_parallel.LOCAL_KERNEL}") == 2 * 7 + 1, local
    for name, bits in result["bits"].items():
        assert bits == {"logprobs": True, "grads": True}, (name, bits)
    # DDP's ratio is reported, not asserted: at world size 1 it still copies every gradient bucket through NCCL, a
    # cost of DDP's own, not of a detkit path (the DP path is prepare(dp_group=...), which routes nothing here).
    ratios = {name: result["ratio"][name] for name in ("tp_world1", "dp_world1")}
    assert all(r <= GPU_SPEED_TOLERANCE for r in ratios.values()), (ratios, result["ms"])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rowwise", "colwise", "dp"])
def test_gpu_one_process_segmented_routes_at_8b_widths(kind):
    """The segmented one-process routes on the GPU at Qwen3-8B MLP widths (down_proj / gate_proj shapes, M 1-4096)
    against the ranks' shard sums, as the CPU tests above at tiny widths."""
    device = torch.device("cuda")
    for m in (1, 129, 4096):
        k, n = (12288, 4096) if kind == "rowwise" else (4096, 12288)
        model = _Holder(_linear(k, n, 20, device))
        if kind == "rowwise":
            prepare(model, {"proj": "rowwise"}, tp_size=2)
            cfgs = mode_parallel.routes(model)["proj"].configs
            x = bf16_randn((m, k), 21, device)
            w = model.proj.weight
            want = _shard_sum([det_gemm_fwd_launch(x[:, s], w[:, s].t(), config=cfgs["fwd"], out_dtype=torch.float32)[0]
                               for s in (slice(0, k // 2), slice(k // 2, k))])
            with detkit.batch_invariant_mode():
                got = model(x)
        elif kind == "colwise":
            prepare(model, {"proj": "colwise"}, tp_size=2)
            cfgs = mode_parallel.routes(model)["proj"].configs
            x = bf16_randn((m, k), 22, device).requires_grad_()
            dy = bf16_randn((m, n), 23, device)
            w = model.proj.weight
            want = _shard_sum([det_gemm_da_launch(dy[:, s], w[s].t(), config=cfgs["da"], out_dtype=torch.float32)[0]
                               for s in (slice(0, n // 2), slice(n // 2, n))])
            with detkit.batch_invariant_mode():
                model(x).backward(dy)
            got = x.grad
        else:
            rows = 2 * max(m // 2, 1)
            prepare(model, dp_size=2)
            cfgs = mode_parallel.routes(model)["proj"].configs
            x = bf16_randn((rows, k), 24, device)
            dy = bf16_randn((rows, n), 25, device)
            h = rows // 2
            want = _shard_sum([det_gemm_db_launch(dy[s], x[s], config=cfgs["db"], out_dtype=torch.float32)[0]
                               for s in (slice(0, h), slice(h, rows))])
            with detkit.batch_invariant_mode():
                model(x).backward(dy)
            got = model.proj.weight.grad
        assert_bits_equal(got, want, f"{kind} M={m} one process segmented vs shard sum")


def _world1_cpu_rank(rank: int, init_file: str, out: str) -> None:
    """One gloo rank: the tiny Qwen3 plain and sharded with parallelize_module on a mesh of 1 + prepare, both under the
    mode: the training forward's logits, every parameter gradient, a prefill and 2 KV-cache decode steps; the
    counters of each and the ops that reached DTensor's dispatch."""
    import collections
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from detkit.audits.model_parallel import build_model, torch_plan
    from detkit.toolkit.contract import compare_bits

    class DTensorOps(TorchDispatchMode):
        """Counts the aten ops called with a DTensor argument (what DTensor's per-op dispatch runs)."""

        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs))):
                self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        plain = build_model("qwen3", torch.device("cpu"), 0)
        tp = build_model("qwen3", torch.device("cpu"), 0)
        parallelize_module(tp, init_device_mesh("cpu", (1,)), torch_plan("qwen3"))
        summary = prepare(tp, torch_plan("qwen3"))
        result = {"routed": summary.routed(), "local": summary.local(), "bits": {}, "counters": {}, "dtensor_ops": {}}

        def bits(name, got, want):
            r = compare_bits(got, want)
            result["bits"][name] = [r.mismatches, r.elements]

        def counted(name, fn, model):
            before, seen = detkit.mode_counters(), DTensorOps()
            with detkit.batch_invariant_mode(), seen:
                out = fn(model)
            result["counters"][name] = (detkit.mode_counters() - before).as_dict()
            result["dtensor_ops"][name] = dict(seen.ops)
            return out

        def train(model):
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=ids).logits
            torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).sum().neg().backward()
            return logits.detach()

        def decode(model):  # a prefill of 5 tokens, then 2 steps on the KV cache, greedy
            with torch.inference_mode():
                out = model(input_ids=ids[:, :5], use_cache=True)
                logits = [out.logits]
                for _ in range(2):
                    out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values,
                                use_cache=True)
                    logits.append(out.logits)
            return logits

        for phase, fn in (("train", train), ("decode", decode)):
            want, got = counted(f"plain {phase}", fn, plain), counted(f"tp {phase}", fn, tp)
            for i, (g, w) in enumerate(zip(got, want) if phase == "decode" else [(got, want)]):
                bits(f"{phase} logits {i}", g, w)
        # each DTensor parameter's gradient: a DTensor of its placements
        result["grads_as_params"] = sum(isinstance(p, DTensor) and isinstance(p.grad, DTensor) and
                                        p.grad.placements == p.placements for p in tp.parameters())
        result["dtensor_params"] = sum(isinstance(p, DTensor) for p in tp.parameters())
        result["gated_hooks"] = sum(isinstance(h, mode_parallel._StyleHookGate) for m in tp.modules()
                                    for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()))
        for n, p in plain.named_parameters():
            g = tp.get_parameter(n).grad
            bits(f"grad {n}", g.to_local() if isinstance(g, DTensor) else g, p.grad)
        # outside the mode torch's TP hooks run as installed (DTensor's own path): the plain model's logits too
        seen = DTensorOps()
        with torch.inference_mode(), seen:
            bits("outside the mode logits", tp(input_ids=ids).logits, plain(input_ids=ids).logits)
        result["dtensor_ops"]["tp outside the mode"] = sum(seen.ops.values())
        try:  # a DTensor input in a layout the style does not take: refused by name
            mesh = tp.lm_head.weight.device_mesh
            with detkit.batch_invariant_mode():
                tp.lm_head(DTensor.from_local(torch.zeros((1, 64), dtype=torch.bfloat16), mesh, [Shard(-1)]))
            result["refusal"] = "no refusal"
        except ParallelPlanError as exc:
            result["refusal"] = str(exc)
        Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@cpu_ranks_only
def test_world1_tp_path_runs_the_local_tensors_with_the_plain_models_bits(tmp_path):
    """parallelize_module on a mesh of 1 + prepare: under the mode the plan's Linears run F.linear on their local
    tensors (the mode's aten route, no DTensor dispatch) with torch's TP hooks standing aside; logits, decode and
    gradients as the plain model; outside the mode torch's hooks and DTensor's path as installed."""
    import json

    import torch.multiprocessing as mp

    out = tmp_path / "result.json"
    mp.start_processes(_world1_cpu_rank, args=(str(tmp_path / "init"), str(out)), nprocs=1, start_method="spawn")
    r = json.loads(out.read_text())
    linears = [f"model.layers.0.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert r["routed"] == [] and r["local"] == linears + ["lm_head"], r
    # logits, prefill + 2 decode steps, every parameter, the logits outside the mode
    assert len(r["bits"]) == 1 + 3 + 14 + 1, sorted(r["bits"])
    assert all(m == 0 for m, _ in r["bits"].values()), {k: v for k, v in r["bits"].items() if v[0] != 0}
    assert r["grads_as_params"] == r["dtensor_params"] == 8  # what the user's optimizer expects
    assert r["gated_hooks"] == 2 * 8  # each prepared layer's input and output hook, standing aside under the mode
    key = "linear (tp, one rank) -> the mode's aten route on the local tensors"
    for phase, calls in (("train", 8), ("decode", 3 * 8)):  # one call per Linear per forward
        tp, plain = dict(r["counters"][f"tp {phase}"]["routed"]), r["counters"][f"plain {phase}"]["routed"]
        assert tp.pop(key) == calls, r["counters"]
        assert tp == plain and not r["counters"][f"tp {phase}"]["not_routed"], r["counters"]  # the same aten route
    # DTensor's dispatch sees no GEMM, view or transpose: only autograd's detach of each weight's gradient
    assert r["dtensor_ops"]["tp train"] == {"aten.detach.default": 8}, r["dtensor_ops"]
    assert r["dtensor_ops"]["tp decode"] == {}, r["dtensor_ops"]
    assert r["dtensor_ops"]["tp outside the mode"] > 0  # torch's hooks and DTensor's dispatch ran there
    assert r["refusal"] == "lm_head: colwise input is ('Shard(1)',); the route needs Replicate (before any " \
        "collective)", r["refusal"]


def _hf_tp_plan_rank(rank: int, init_file: str, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.bfloat16)

        def forbidden(*a, **k):
            raise AssertionError("a collective ran before the refusal")
        dist.all_reduce = dist.all_gather = forbidden
        try:
            prepare(model, model.tp_plan)
            msg = "no refusal"
        except ParallelPlanError as exc:
            msg = str(exc)
        if rank == 0:
            Path(out).write_text(msg)
    finally:
        dist.destroy_process_group()


def test_transformers_tp_plan_auto_is_refused_by_name(tmp_path):
    """transformers' own tensor parallelism (tp_plan="auto", its styles, DTensor weights) runs on gloo, but its plan
    has styles the mode cannot make invariant: prepare names the first and prepares nothing."""
    pytest.importorskip("accelerate", reason="transformers' tp_plan needs accelerate")
    import torch.multiprocessing as mp

    from detkit.audits.model_parallel import build_model

    build_model("qwen3", torch.device("cpu"), 0).save_pretrained(tmp_path / "model")
    out = tmp_path / "msg"
    mp.start_processes(_hf_tp_plan_rank, args=(str(tmp_path / "init"), str(tmp_path / "model"), str(out)), nprocs=2,
                       start_method="spawn")
    assert out.read_text().startswith("plan entry 'lm_head': style 'colwise_gather_output' is not supported"), \
        out.read_text()
