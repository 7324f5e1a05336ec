"""The block-scaled FP8 MoE expert MLP (suite 'moe-fp8'): determinism, batch invariance, scaled math,
precision gate, quantization risk.

Checks, each one row:
- ``repetitions`` / ``fresh_process``: forward + backward (out, dX, dW1, dW2, dscores) give the same bits
  on every call and in a new Python process.
- ``batch_invariance``: a token's output bits do not depend on the other tokens (the BF16 suite's variants).
- ``quantizers``: x, dout, w1, w2 quantized by the kernels equal the pure-torch references bit for bit,
  the fused epilogue quantizations equal the standalone quantizer on the stored BF16 h and dgu, and the
  column-wise quantizations of the FP8 weight gradients (x, dgu, h, dy) equal theirs.
- ``stage_bound``: gu, y, dgu, dx_route and the FP8 dW1, dW2 within a derived bound of an FP64 oracle of
  the kernel's own dequantized FP8 operands (block-scaled GEMM with per-128-K promotion,
  docs/moe_fp8.md); out, dx (the BF16 path's combine) and dscores (from the dgrad's accumulator and h, the BF16
  layer's fused-dscore bound with the block-scaled accumulator's) within theirs; padding rows exactly zero.
- ``emulation``: the layer within EMULATION_REL_L2[backend] of ``moe_mlp_fp8_ref`` (the recipe in plain torch),
  with either weight-gradient mode (wgrad "bf16" and "fp8").
- ``precision``: the FP8 precision gate, cosine >= 0.997 and relative RMSE < 7.6% for out, dX, dscores, dW1,
  dW2 against the FP64 oracle and against the BF16 detkit path, for each weight-gradient mode. On a GPU:
  the kernels at the GPU shape.
  On the interpreter: the kernels at the tiny shape are too few values for a stable RMSE (dscores has
  T*K of them), so the gate is evaluated on ``moe_mlp_fp8_ref`` at GATE_SHAPE, which the ``emulation``
  row ties to the kernels; the kernels' own tiny-shape numbers are in the row's details.
- ``quant_risk``: per quantized tensor, log2(row or matrix amax / block amax) p95 and max, and the
  fraction of non-zero values flushed to zero; fails above FLUSH_ALARM or on non-finite values.
- ``split_layout``: the BF16 suite's check (transformers' weight layout read in place, the same bits).
- ``main_grad``, ``weight_cache``, ``edge`` (expert segments of 0/1/127/128/129 rows, one expert, T = 1),
  ``rejects`` (malformed inputs, H or I not a multiple of 128).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch

from detkit.audits.moe import (
    MoeCase, batch_invariance_rows, bits_row, combine_checks, dswiglu_check, edge_cases,
    fresh_process_row, fused_dscore_check, grad_digests, layer_grads, make_inputs, padding_zero, per_expert,
    rejection_cases, rejection_rows, serve_digests, sorted_rows, split_layout_row, stage_rows,
)
from detkit.kernels.moe.fp8.quant import (
    QBLOCK, dequantize_rowwise, quantize_colwise_ref, quantize_rowwise, quantize_rowwise_ref, quantize_weight_ref,
)
from detkit.kernels.moe.layer import moe_mlp_fwd, moe_mlp_bwd, moe_mlp_ref, sync_checks
from detkit.kernels.moe.fp8.layer import (
    DEFAULT_WGRAD, OTHER_WGRAD, Fp8WeightCache, fp8_stage_name, moe_fp8_dgrad, moe_fp8_down, moe_fp8_dx_route,
    moe_fp8_quant_colwise, moe_fp8_risk, moe_fp8_wgrad, moe_mlp_fp8, moe_mlp_fp8_bwd, moe_mlp_fp8_fwd, moe_mlp_fp8_ref,
)
from detkit.toolkit.contract import (
    ETA_BF16, U_BF16, U_FP32, U_FP64, ContractResult, check_bound, compare_bits, gamma, rel_l2,
)
from detkit.toolkit.harness import Row, RunContext
from detkit.toolkit.moe_gate import GATE_MAX_REL_RMSE, GATE_MIN_COSINE, GRAD_NAMES, gate_passed, precision_stats
from detkit.toolkit.nvtx_ranges import nvtx_range

NAME = "moe-fp8"
DESCRIPTION = "FP8 MoE expert MLP fwd+bwd: determinism, batch invariance, block-scaled math, precision gate, risk"

# Kernels vs moe_mlp_fp8_ref, per backend. Both differ only by accumulation order and the activation's exp,
# which can move a BF16 rounding and then an E4M3 rounding (2**-4 relative) of a few elements of h and dgu.
# Interpreter (FP32 accumulation): 2**-8. Hopper: the FP8 wgmma accumulates a 128-K block with about 14
# significant bits (DeepSeek-V3, section 3.3.2), so more of those E4M3 roundings move; measured on an
# H200 (2026-11-29): 0.0019-0.0047 at the audit's GPU shape, 0.0094 for dX at the tests' T=24, hence 2**-6.
# A wrong scale, block or layout is off by powers of two on whole blocks (rel L2 >= 0.1): it fails both.
EMULATION_REL_L2 = {"triton_interpreter": 2.0**-8, "cuda_sm90": 2.0**-6}
# Accumulation inside one 128-K block: FP32 on the interpreter; on Hopper the FP8 wgmma accumulates with
# about 14 significant bits (DeepSeek-V3, section 3.3.2): an allowance of 2**-13 per add, to be measured.
BLOCK_ACC_UNIT = {"triton_interpreter": U_FP32, "cuda_sm90": 2.0**-13}
FLUSH_ALARM = 0.01  # a quantized tensor losing >1% of its non-zero values to zero is a risk, not noise
SHAPES = {  # (T, H, I, E, K)
    "tiny": (48, 128, 128, 4, 2),
    "gpu": (2048, 1024, 768, 16, 4),
}
GATE_SHAPE = (512, 256, 256, 8, 4)  # the interpreter's gate, on the emulation reference (T*K = 2048 dscores)


def audit_shape(ctx: RunContext) -> tuple[int, ...]:
    return SHAPES["tiny" if ctx.interpreted else "gpu"]


def case_name(case: MoeCase) -> str:
    return fp8_stage_name("moe_mlp", T=case.t, H=case.h, I=case.i, E=case.e, K=case.k) + f" routing={case.routing}"


# Inputs: the BF16 suite's make_inputs (imported above), seeded: the same bits on every device and process.
_uncached_fwd = partial(moe_mlp_fp8_fwd, weight_cache=None)  # every call quantizes the weights


def run_layer(inp: dict[str, torch.Tensor], main_grads=None, weight_cache=None,
              wgrad: str = DEFAULT_WGRAD) -> dict[str, torch.Tensor]:
    """Forward and backward through the FP8 autograd Function (no weight cache unless given)."""
    return layer_grads(moe_mlp_fp8, inp, main_grads=main_grads, weight_cache=weight_cache, wgrad=wgrad)


# ---------------------------------------------------------------------------------------------
# The block-scaled GEMM bound and the per-stage checks (docs/moe_fp8.md derives them)
# ---------------------------------------------------------------------------------------------
def block_gemm_error(abs_ab: torch.Tensor, reduced: int, unit: float) -> torch.Tensor:
    """|c - c*| of acc = sum over ascending 128-K blocks of blk * (exact power-of-two scale), kept in FP32:
    each block's accumulation errs by gamma(128, unit) of its |a||b|, the promotion adds one FP32 add per
    block; plus the FP64 oracle's own error. abs_ab = |A_deq| @ |B_deq|."""
    blocks = reduced // QBLOCK
    return (gamma(QBLOCK, unit) + gamma(blocks) * (1 + gamma(QBLOCK, unit)) + gamma(reduced, U_FP64)) * abs_ab


def fp8_stage_checks(inp: dict[str, torch.Tensor]) -> tuple[dict[str, ContractResult], dict]:
    """Every stage against its FP64 oracle from its own (dequantized) inputs; bitwise quantizer checks."""
    x, w1, w2, scores, dout = inp["x"], inp["w1"], inp["w2"], inp["scores"], inp["dout"]
    with sync_checks():  # the exact routing (its counts on the host, P rows): the same bits as the default path
        out, saved = moe_mlp_fp8_fwd(x, w1, w2, inp["topk_ids"], scores, weight_cache=None)
    grads = moe_mlp_fp8_bwd(dout, saved)
    r, backend = saved.routing, saved.backend
    unit = BLOCK_ACC_UNIT[backend]
    x_q, x_s = quantize_rowwise(x)
    d_q, d_s = quantize_rowwise(dout)
    dgu, dgu_q, dgu_s, _ = moe_fp8_dgrad(d_q, d_s, saved.w2f, saved.gu, r, backend)
    dxr = moe_fp8_dx_route(dgu_q, dgu_s, saved.w1f, r, backend)
    y = moe_fp8_down(saved.h_q, saved.h_s, saved.w2f, r, backend)  # the forward's y (same call, same bits): not saved
    f64 = torch.float64
    valid, pad, tok, exp, s_row = sorted_rows(r)
    hidden, inter = x.shape[1], w2.shape[1]

    # Quantizers: kernels vs pure-torch references, bit for bit.
    bits = {}
    for name, (q, s), src in (("x", (x_q, x_s), x), ("dout", (d_q, d_s), dout)):
        qr, sr = quantize_rowwise_ref(src)
        bits[name] = compare_bits(q, qr).equal and compare_bits(s, sr).equal
    for name, fw, w in (("w1", saved.w1f, w1), ("w2", saved.w2f, w2)):
        ref = quantize_weight_ref(w)
        bits[name] = all(compare_bits(a, b).equal for a, b in ((fw.q, ref.q), (fw.q_t, ref.q_t), (fw.scale, ref.scale)))
    hq_ref, hs_ref = quantize_rowwise_ref(saved.h)
    bits["h_fused"] = compare_bits(saved.h_q, hq_ref).equal and compare_bits(saved.h_s, hs_ref).equal
    gq_ref, gs_ref = quantize_rowwise_ref(dgu)
    bits["dgu_fused"] = compare_bits(dgu_q, gq_ref).equal and compare_bits(dgu_s, gs_ref).equal

    w1_d, w2_d = saved.w1f.dequantize().to(f64), saved.w2f.dequantize().to(f64)
    x_d = dequantize_rowwise(x_q, x_s).to(f64)
    d_d = dequantize_rowwise(d_q, d_s).to(f64)
    h_d = dequantize_rowwise(saved.h_q, saved.h_s).to(f64)
    g_d = dequantize_rowwise(dgu_q, dgu_s).to(f64)

    # out and dx: the BF16 path's combine and gather-sum kernels (the BF16 suite's bounds)
    combined = combine_checks(r, scores, dout, out, y, dxr, grads.dx)
    results: dict[str, ContractResult] = {}
    gu_star, gu_ab = per_expert(x_d[tok], lambda e: w1_d[e], exp, w1.shape[2])
    results["gu"] = check_bound(saved.gu[valid], gu_star, U_BF16 * gu_star.abs()
                                + (1 + U_BF16) * block_gemm_error(gu_ab, hidden, unit) + ETA_BF16)
    y_star, y_ab = per_expert(h_d[valid], lambda e: w2_d[e], exp, hidden)
    # y and dx_route are the accumulator rounded once to BF16 (as gu is)
    results["y"] = check_bound(y[valid], y_star, U_BF16 * y_star.abs()
                               + (1 + U_BF16) * block_gemm_error(y_ab, inter, unit) + ETA_BF16)
    results["out"] = combined["out"]
    # dgrad + dSwiGLU from the kernel's gu (the BF16 suite's derivation with the block-scaled e_h)
    dh_raw, dh_ab = per_expert(d_d[tok], lambda e: w2_d[e].t(), exp, inter)
    dh_star = s_row[:, None] * dh_raw
    e_h = s_row.abs()[:, None] * (block_gemm_error(dh_ab, hidden, unit) + gamma(1) * dh_ab)
    results["dgu"] = dswiglu_check(dgu[valid], saved.gu[valid], dh_star, e_h)
    dxr_star, dxr_ab = per_expert(g_d[valid], lambda e: w1_d[e].t(), exp, hidden)
    results["dx_route"] = check_bound(dxr[valid], dxr_star, U_BF16 * dxr_star.abs()
                                      + (1 + U_BF16) * block_gemm_error(dxr_ab, 2 * inter, unit) + ETA_BF16)
    results["dx"] = combined["dx"]
    # dscores: fused into dgrad, from its block-scaled accumulator and h
    results["dscores"] = fused_dscore_check(r, valid, dh_raw, dh_ab, saved.h[valid], hidden, grads.dscores,
                                            scores.dtype, e_acc=block_gemm_error(dh_ab, hidden, unit))

    # FP8 weight gradients (wgrad="fp8"): 128x1 column-wise operands over each expert's padded rows.
    dense = {name: torch.zeros(r.padded_rows, t.shape[1], dtype=torch.float32, device=x.device)
             for name, t in (("x", x), ("dy", dout))}
    dense["x"][valid] = x[tok].float()
    dense["dy"][valid] = r.row_score[valid][:, None] * dout[tok].float()  # one FP32 rounding, as the kernel
    dense["dgu"], dense["h"] = dgu.float(), saved.h.float()  # padding rows are exactly zero (checked below)
    sources = {"x": (x, True, False), "dgu": (dgu, False, False), "h": (saved.h, False, False),
               "dy": (dout, True, True)}  # (source, gathered by token, scaled by the route's score)
    cq, deq = {}, {}
    for name, (src, gather, scale) in sources.items():
        q, s_ = moe_fp8_quant_colwise(src, r, backend, gather=gather, scale=scale)
        qr, sr = quantize_colwise_ref(dense[name])
        bits[f"{name}_colwise"] = compare_bits(q, qr).equal and compare_bits(s_, sr).equal
        cq[name], deq[name] = (q, s_), dequantize_rowwise(q, s_).to(f64)  # [N, P]
    for stage, a, b in (("dw1_fp8", "x", "dgu"), ("dw2_fp8", "h", "dy")):
        got_w = moe_fp8_wgrad(*cq[a], *cq[b], r, backend)
        star = torch.zeros(got_w.shape, dtype=f64, device=x.device)
        bound = torch.zeros_like(star)
        for e, count in enumerate(r.counts):
            if count == 0:
                continue
            lo, n = int(r.expert_offsets[e]), -(-count // QBLOCK) * QBLOCK
            a_e, b_e = deq[a][:, lo:lo + n], deq[b][:, lo:lo + n]
            star[e] = a_e @ b_e.t()
            bound[e] = U_BF16 * star[e].abs() + (1 + U_BF16) * block_gemm_error(a_e.abs() @ b_e.abs().t(), n, unit)
        results[stage] = check_bound(got_w, star, bound + ETA_BF16)

    zero = padding_zero({"gu": saved.gu, "h": saved.h, "h_q": saved.h_q, "y": y, "dgu": dgu, "dgu_q": dgu_q,
                         "dx_route": dxr}, pad)
    return results, {"quantizers_bitwise": bits, "padding_zero": zero}


def bf16_path_layer(inp: dict) -> dict[str, torch.Tensor]:
    out, saved = moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])
    g = moe_mlp_bwd(inp["dout"], saved)
    return {"out": out, "dx": g.dx, "dw1": g.dw1, "dw2": g.dw2, "dscores": g.dscores}


def risk_rows(ctx: RunContext, name: str, risk: dict) -> Iterator[Row]:
    for tensor, st in risk.items():
        finite = all(v == v and abs(v) != float("inf") for v in st.values())
        yield Row(suite=NAME, check="quant_risk", name=f"quant_risk {tensor} {name}",
                  passed=finite and st["flushed_fraction"] <= FLUSH_ALARM, backend=ctx.backend,
                  details={"flush_alarm": FLUSH_ALARM, **st})


# ---------------------------------------------------------------------------------------------
# Fresh-process digests
# ---------------------------------------------------------------------------------------------
def case_digests(case: MoeCase, device: torch.device) -> dict[str, str]:
    return grad_digests(run_layer(make_inputs(case, device)))


def fp8_rejection_cases(inp: dict) -> list[tuple[str, type, dict]]:
    """The BF16 path's rejections (kernels.moe's checks run first), plus the FP8 block constraints."""
    picked = [c for c in rejection_cases(inp) if c[0] in ("duplicate ids", "x float32", "w1 float16", "w1 odd 2I",
                                                          "w2 wrong I", "scores NaN")]
    h, i = inp["x"].shape[1], inp["w2"].shape[1]
    return picked + [
        ("H not a multiple of 128", ValueError, {"x": inp["x"][:, :h - 16], "w1": inp["w1"][:, :h - 16],
                                                 "w2": inp["w2"][:, :, :h - 16]}),
        ("I not a multiple of 128", ValueError, {"w1": inp["w1"][:, :, :2 * (i - 16)], "w2": inp["w2"][:, :i - 16]}),
    ]


def weight_cache_checks(inp: dict) -> dict[str, bool]:
    """A cache hit returns the same FP8 weights; an optimizer step (in place, bumps _version) invalidates."""
    cache = Fp8WeightCache(capacity=4)
    w1 = torch.nn.Parameter(inp["w1"].clone())
    w2 = torch.nn.Parameter(inp["w2"].clone())
    args = (inp["topk_ids"], inp["scores"])
    first = moe_mlp_fp8_fwd(inp["x"], w1, w2, *args, weight_cache=cache)[0]
    again = moe_mlp_fp8_fwd(inp["x"], w1, w2, *args, weight_cache=cache)[0]
    hits_after_repeat, misses_after_repeat = cache.hits, cache.misses
    w1.grad = torch.ones_like(w1)
    w2.grad = torch.zeros_like(w2)
    version = w1._version
    torch.optim.SGD([w1, w2], lr=0.5).step()
    stepped = moe_mlp_fp8_fwd(inp["x"], w1, w2, *args, weight_cache=cache)[0]
    fresh = moe_mlp_fp8_fwd(inp["x"], w1.detach().clone(), w2.detach().clone(), *args, weight_cache=None)[0]
    return {
        "repeat_hits": hits_after_repeat == 2 and misses_after_repeat == 2,
        "repeat_same_bits": compare_bits(first, again).equal,
        "step_bumped_version": w1._version > version,
        "step_missed": cache.misses == 4,  # both weights: SGD steps w2 too (zero grad, still in place)
        "step_replaced_in_place": len(cache) == 2,  # one slot per weight: the stale versions are gone
        "step_equals_fresh_quantization": compare_bits(stepped, fresh).equal,
        "step_changed_output": not compare_bits(stepped, first).equal,
    }


def run(ctx: RunContext) -> Iterator[Row]:
    t, h, i, e, k = audit_shape(ctx)
    main = MoeCase(t, h, i, e, k, "random", ctx.seed)
    inp = make_inputs(main, ctx.device)
    name = case_name(main)

    with nvtx_range(f"repetitions {name}"):
        outs = [run_layer(inp) for _ in range(3)]
    for rep, got in enumerate(outs[1:], start=1):
        yield bits_row(NAME, ctx, "repetitions", f"repetitions {name} #{rep}", got, outs[0])
    with nvtx_range(f"repetitions wgrad={OTHER_WGRAD} {name}"):
        outs_other = [run_layer(inp, wgrad=OTHER_WGRAD) for _ in range(2)]
    yield bits_row(NAME, ctx, "repetitions", f"repetitions wgrad={OTHER_WGRAD} {name}", outs_other[1], outs_other[0])
    yield fresh_process_row(NAME, ctx, "detkit.audits.moe_fp8", main, name, outs[0])

    yield from batch_invariance_rows(NAME, ctx, _uncached_fwd, inp, main, name, outs[0]["out"])

    for case in (main, MoeCase(t, h, i, e, k, "masked", ctx.seed + 1)):
        case_inp = inp if case is main else make_inputs(case, ctx.device)
        with nvtx_range(f"contract {case_name(case)}"):
            results, extra = fp8_stage_checks(case_inp)
        yield Row(suite=NAME, check="quantizers", name=f"quantizers {case_name(case)}",
                  passed=all(extra["quantizers_bitwise"].values()), backend=ctx.backend,
                  details=extra["quantizers_bitwise"])
        yield from stage_rows(NAME, ctx, results, case_name(case))
        yield Row(suite=NAME, check="stage_bound", name=f"padding_zero {case_name(case)}",
                  passed=all(extra["padding_zero"].values()), backend=ctx.backend, details=extra["padding_zero"])
        got = outs[0] if case is main else run_layer(case_inp)
        args = (case_inp["x"], case_inp["w1"], case_inp["w2"], case_inp["topk_ids"], case_inp["scores"],
                case_inp["dout"])
        emu = moe_mlp_fp8_ref(*args)
        for n in GRAD_NAMES:
            rel = rel_l2(got[n], emu[n])
            yield Row(suite=NAME, check="emulation", name=f"emulation {n} {case_name(case)}",
                      passed=rel <= EMULATION_REL_L2[ctx.backend], backend=ctx.backend,
                      details={"rel_l2_vs_fp8_reference": rel, "limit": EMULATION_REL_L2[ctx.backend]})
        if case is main:  # the other mode's weight gradients against the recipe in that mode
            emu_other = moe_mlp_fp8_ref(*args, wgrad=OTHER_WGRAD)
            for n in ("dw1", "dw2"):
                rel = rel_l2(outs_other[0][n], emu_other[n])
                yield Row(suite=NAME, check="emulation", name=f"emulation {n} wgrad={OTHER_WGRAD} {case_name(case)}",
                          passed=rel <= EMULATION_REL_L2[ctx.backend], backend=ctx.backend,
                          details={"rel_l2_vs_fp8_reference": rel, "limit": EMULATION_REL_L2[ctx.backend]})

    # The precision gate (see the module docstring for where it is evaluated on each backend).
    bf16_path = bf16_path_layer(inp)
    oracle = moe_mlp_ref(*[inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout")], dtype=torch.float64)
    if ctx.interpreted:
        gt, gh, gi, ge, gk = GATE_SHAPE
        gate_case = MoeCase(gt, gh, gi, ge, gk, "random", ctx.seed)
        gate_inp = make_inputs(gate_case, torch.device("cpu"))
        gate_args = [gate_inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout")]
        gold = moe_mlp_ref(*gate_args, dtype=torch.bfloat16)
        gate_oracle = moe_mlp_ref(*gate_args, dtype=torch.float64)
        source = f"moe_mlp_fp8_ref at {case_name(gate_case)} vs FP64 and vs the BF16 PyTorch gold"
    for mode, got in ((DEFAULT_WGRAD, outs[0]), (OTHER_WGRAD, outs_other[0])):
        kernel_stats = precision_stats(got, inp, bf16_path, oracle)
        if ctx.interpreted:
            gate_stats = precision_stats(moe_mlp_fp8_ref(*gate_args, wgrad=mode), gate_inp, gold, gate_oracle)
        else:
            gate_stats, source = kernel_stats, f"kernels at {name} vs FP64 and vs the BF16 detkit path"
        for n in GRAD_NAMES:
            yield Row(suite=NAME, check="precision", name=f"precision {n} wgrad={mode} {name}",
                      passed=gate_passed(gate_stats[n]), backend=ctx.backend,
                      details={"source": source, "min_cosine": GATE_MIN_COSINE, "max_rel_rmse": GATE_MAX_REL_RMSE,
                               **gate_stats[n], "kernel_at_audit_shape": kernel_stats[n]})

    _, saved = moe_mlp_fp8_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"], weight_cache=None)
    yield from risk_rows(ctx, name, moe_fp8_risk(saved, inp["dout"]))

    zeros = (torch.zeros(inp["w1"].shape, device=ctx.device), torch.zeros(inp["w2"].shape, device=ctx.device))
    run_layer(inp, main_grads=zeros)
    checks = {"dw1_bf16_of_fp32": compare_bits(zeros[0].to(torch.bfloat16), outs[0]["dw1"]).equal,
              "dw2_bf16_of_fp32": compare_bits(zeros[1].to(torch.bfloat16), outs[0]["dw2"]).equal}
    yield Row(suite=NAME, check="main_grad", name=f"main_grad {name}", passed=all(checks.values()),
              backend=ctx.backend, details=checks)

    # transformers' weight layout read in place (the quantizer reads the split halves in the interleaved order).
    with nvtx_range(f"split_layout {name}"):
        yield split_layout_row(NAME, ctx, moe_mlp_fp8, inp, outs[0], name, weight_cache=None)

    checks = weight_cache_checks(inp)
    yield Row(suite=NAME, check="weight_cache", name=f"weight_cache {name}", passed=all(checks.values()),
              backend=ctx.backend, details=checks)

    for case in edge_cases(t, h, i, e, k, ctx.seed):
        with nvtx_range(f"edge {case_name(case)}"):
            results, extra = fp8_stage_checks(make_inputs(case, ctx.device))
        failed = [s for s, res in results.items() if not res.passed]
        failed += [f"quantizer {q}" for q, ok in extra["quantizers_bitwise"].items() if not ok]
        yield Row(suite=NAME, check="edge", name=f"edge {case_name(case)}",
                  passed=not failed and all(extra["padding_zero"].values()), backend=ctx.backend,
                  details={"failed": failed, "worst_ratio": max(res.worst_ratio for res in results.values()), **extra})

    yield from rejection_rows(NAME, ctx, _uncached_fwd, inp, fp8_rejection_cases(inp))


if __name__ == "__main__":
    serve_digests(case_digests)
