"""The deterministic MoE expert MLP (suite 'moe'): determinism, batch invariance, contract, precision.

Checks, each one row:
- ``repetitions`` / ``fresh_process``: forward + backward (out, dX, dW1, dW2, dscores) give the
  same bits on every call and in a new Python process.
- ``batch_invariance``: a token's output bits do not depend on which other tokens share the batch
  or how they route (alone, subset, permuted, others re-routed, tokens prepended to its experts).
- ``stage_bound``: every stage within its derived per-element bound against an FP64 oracle of that
  stage computed from the stage's own BF16/FP32 inputs (gemm_bound chaining, docs/moe.md);
  padding rows exactly zero; the composed backward equals the stage kernels bit for bit.
- ``end_to_end``: relative L2 error against the FP64 layer oracle from the original inputs, under
  a documented gate (E2E_REL_L2_GATE).
- ``precision``: cosine and relative RMSE against a BF16 PyTorch gold (eager per-expert matmuls),
  and no worse than that gold against FP64 by more than GOLD_SLACK.
- ``main_grad``: FP32 weight-gradient accumulation equals main_grad + the FP32 dW exactly.
- ``split_layout``: the layer on the weights as transformers holds them (gate_up_proj [E, 2I, H], down_proj
  [E, H, I]) passed as views with ``gate_up="split"`` gives the bits of its own layout (dW1 de-interleaved), and
  dW1, dW2 come back with those views' strides (no layout copy in autograd).
- ``edge``: experts with 0/1/127/128/129 tokens, all tokens on one expert, masked routes, T = 1.
- ``rejects``: bad dtypes and shapes raise before any work; bad ids (duplicates, out of range) and
  non-finite scores, found by the routing kernels, raise in the validating mode (``sync_checks``) at the
  routing's one host read, before any result is returned (a GEMM queued before that read is gated off on the
  device). The stage checks run in that mode too (they read the exact routing's counts); every other row runs
  the default path, which reads nothing back (tests/test_moe_nosync.py checks its poisoning of a refused batch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from detkit.kernels.moe.layer import (
    deinterleave_gate_up, moe_dgrad_dswiglu, moe_down, moe_dx_route, moe_gather_sum, moe_mlp, moe_mlp_bwd,
    moe_mlp_fwd, moe_mlp_ref, stage_name,
)
from detkit.kernels.moe.routing import MoeRouting, SEGMENT_ALIGN, sync_checks
from detkit.toolkit.contract import (
    ETA_BF16, U_BF16, U_FP64, ContractResult, check_bound, compare_bits, cosine, digest, gamma, gemm_bound, rel_l2,
)
from detkit.toolkit.fixtures import bf16_randn
from detkit.toolkit.harness import Row, RunContext
from detkit.toolkit.moe_gate import GRAD_NAMES
from detkit.toolkit.nvtx_ranges import nvtx_range

NAME = "moe"
DESCRIPTION = "MoE expert MLP fwd+bwd: determinism, batch invariance, stage contract, precision vs BF16 gold"

# Allowance for evaluating sigmoid/silu and their derivative in FP32 (exp and division are
# approximations on the GPU): the relative error of silu(g), and the absolute error of silu'(g),
# are at most ACT * (1 + |g|) for |g| < 80 (derivation in docs/moe.md; it is ~2**8 below U_BF16).
ACT = 2.0**-16
# End-to-end gate: relative L2 of each tensor against the FP64 layer oracle. Several BF16 roundings
# chain (gu, h, dgu, the outputs); measured values are ~2**-8.5; the gate is 2**-6 (docs/moe.md).
E2E_REL_L2_GATE = 2.0**-6
# Precision vs the BF16 PyTorch gold: cosine at least this, and the kernel's relative RMSE against
# FP64 at most GOLD_SLACK times the gold's own (+ a floor of 2**-12 for near-exact tensors).
GOLD_MIN_COSINE = 0.9995
GOLD_SLACK = 1.25
FRESH_PROCESS_TIMEOUT_S = 1800


@dataclass(frozen=True)
class MoeCase:
    t: int
    h: int
    i: int
    e: int
    k: int
    routing: str  # random | one_expert | masked | counts:<c0>,<c1>,...  (counts: K must be 1)
    seed: int

    @property
    def name(self) -> str:
        return stage_name("moe_mlp", T=self.t, H=self.h, I=self.i, E=self.e, K=self.k) + f" routing={self.routing}"


SHAPES = {  # (T, H, I, E, K)
    "tiny": (64, 32, 48, 4, 2),
    "gpu": (2048, 1024, 768, 16, 4),
}


def audit_shape(ctx: RunContext) -> tuple[int, ...]:
    return SHAPES["tiny" if ctx.interpreted else "gpu"]


def make_ids(case: MoeCase) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed + 11)
    if case.routing.startswith("counts:"):
        counts = [int(c) for c in case.routing.split(":", 1)[1].split(",")]
        if case.k != 1 or len(counts) != case.e or sum(counts) != case.t:
            raise ValueError(f"{case.routing}: needs K = 1, E = {len(counts)} and T = {sum(counts)}")
        ids = torch.repeat_interleave(torch.arange(case.e), torch.tensor(counts))
        return ids[torch.randperm(case.t, generator=gen)].reshape(case.t, 1).to(torch.int32)
    ids = torch.argsort(torch.rand(case.t, case.e, generator=gen), dim=1)[:, :case.k]
    if case.routing == "one_expert":  # every token routes to expert 0 (in a random k slot)
        ids = torch.argsort(torch.rand(case.t, case.e - 1, generator=gen), dim=1)[:, :case.k] + 1
        slot = torch.randint(0, case.k, (case.t,), generator=gen)
        ids[torch.arange(case.t), slot] = 0
    elif case.routing == "masked":
        ids = torch.where(torch.rand(case.t, case.k, generator=gen) < 0.3, -1, ids)
    elif case.routing != "random":
        raise ValueError(f"routing {case.routing!r} is not supported")
    return ids.to(torch.int32)


def make_inputs(case: MoeCase, device: torch.device) -> dict[str, torch.Tensor]:
    """Seeded inputs on the CPU, then moved: the same bits on every device and process."""
    gen = torch.Generator().manual_seed(case.seed + 13)
    raw = torch.rand(case.t, case.k, generator=gen) + 0.05
    return {
        "x": bf16_randn((case.t, case.h), case.seed, device),
        "w1": bf16_randn((case.e, case.h, 2 * case.i), case.seed + 1, device, scale=case.h**-0.5),
        "w2": bf16_randn((case.e, case.i, case.h), case.seed + 2, device, scale=case.i**-0.5),
        "topk_ids": make_ids(case).to(device),
        "scores": (raw / raw.sum(dim=1, keepdim=True)).to(device),
        "dout": bf16_randn((case.t, case.h), case.seed + 3, device),
    }


def layer_grads(layer: Callable[..., torch.Tensor], inp: dict[str, torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
    """Forward and backward through ``layer(x, w1, w2, topk_ids, scores, **kwargs)`` (an MoE autograd
    Function); returns out and every gradient."""
    x = inp["x"].detach().requires_grad_()
    w1 = inp["w1"].detach().requires_grad_()
    w2 = inp["w2"].detach().requires_grad_()
    scores = inp["scores"].detach().requires_grad_()
    out = layer(x, w1, w2, inp["topk_ids"], scores, **kwargs)
    out.backward(inp["dout"])
    return {"out": out.detach(), "dx": x.grad, "dw1": w1.grad, "dw2": w2.grad, "dscores": scores.grad}


def run_layer(inp: dict[str, torch.Tensor], main_grads=None) -> dict[str, torch.Tensor]:
    """Forward and backward through the autograd Function; returns out and every gradient."""
    return layer_grads(moe_mlp, inp, main_grads=main_grads)


def split_layout_row(suite: str, ctx: RunContext, layer: Callable[..., torch.Tensor], inp: dict[str, torch.Tensor],
                     want: dict[str, torch.Tensor], name: str, **kwargs) -> Row:
    """``layer`` on gate_up_proj [E, 2I, H] and down_proj [E, H, I] (the weights of ``inp`` as transformers holds
    them) passed as views with ``gate_up="split"``, against ``want`` (its results on its own layout): every tensor
    bit for bit, dW1 de-interleaved; and dW1, dW2 with the views' strides."""
    gate_up_proj = deinterleave_gate_up(inp["w1"]).transpose(1, 2).contiguous()
    down_proj = inp["w2"].transpose(1, 2).contiguous()
    views = {"w1": gate_up_proj.transpose(1, 2), "w2": down_proj.transpose(1, 2)}
    got = layer_grads(layer, {**inp, **views}, gate_up="split", **kwargs)
    layouts = {f"d{n}_strides": list(got[f"d{n}"].stride()) for n in views}
    in_place = all(got[f"d{n}"].stride() == v.stride() for n, v in views.items())
    row = bits_row(suite, ctx, "split_layout", f"split_layout {name}", got,
                   {**want, "dw1": deinterleave_gate_up(want["dw1"])}, grads_in_the_views_layouts=in_place, **layouts)
    row.passed = row.passed and in_place
    return row


def bits_row(suite: str, ctx: RunContext, check: str, name: str, got: dict, want: dict, **details) -> Row:
    """One row: every tensor of ``want`` equals ``got``'s bit for bit; details of the worst mismatch."""
    results = {k: compare_bits(got[k], want[k]) for k in want}
    worst = max(results.values(), key=lambda r: r.mismatches)
    bad = [k for k, r in results.items() if not r.equal]
    return Row(suite=suite, check=check, name=name, passed=not bad, backend=ctx.backend,
               details={**details, "tensors": list(want), "mismatched_tensors": bad, **worst.as_row()})


# ---------------------------------------------------------------------------------------------
# Stage oracles and bounds (docs/moe.md derives them)
# ---------------------------------------------------------------------------------------------
def fp32_sum_bound(abs_terms: torch.Tensor, n: int) -> torch.Tensor:
    """An n-term FP32 accumulation kept in FP32 (no BF16 rounding), plus the FP64 oracle's own error."""
    return (gamma(n) + gamma(n, U_FP64)) * abs_terms


def rounding_unit(dtype: torch.dtype) -> float:
    """The unit roundoff of a result stored in ``dtype`` after FP32 accumulation: BF16's, or 0 (kept in FP32)."""
    return U_BF16 if dtype == torch.bfloat16 else 0.0


def round_sum_bound(c_star: torch.Tensor, abs_terms: torch.Tensor, n: int, unit: float = U_BF16) -> torch.Tensor:
    """n products/terms summed in FP32 (n roundings at most) and rounded once with ``unit``."""
    return unit * c_star.abs() + (1 + unit) * fp32_sum_bound(abs_terms, n) + ETA_BF16


def row_experts(routing: MoeRouting) -> torch.Tensor:
    """The expert of every expert-sorted row (padding included)."""
    return torch.repeat_interleave(routing.tile_expert.long(), SEGMENT_ALIGN)


def sorted_rows(r: MoeRouting) -> tuple[torch.Tensor, ...]:
    """(valid rows, padding rows, each valid row's token, its expert, its score in FP64) of the
    expert-sorted layout."""
    valid = (r.sorted_route >= 0).nonzero().squeeze(1)
    pad = (r.sorted_route < 0).nonzero().squeeze(1)
    return valid, pad, r.gather_token.long()[valid], row_experts(r)[valid], r.row_score.double()[valid]


def per_expert(a: torch.Tensor, b_of_e: Callable[[int], torch.Tensor], exp: torch.Tensor,
               n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a @ b(e), |a| @ |b(e)|) in FP64 for each row of ``a``, grouped by its expert ``exp[row]``."""
    f64 = torch.float64
    c = torch.zeros(exp.numel(), n_out, dtype=f64, device=a.device)
    ab = torch.zeros_like(c)
    for e in exp.unique().tolist():
        sel = (exp == e).nonzero().squeeze(1)
        b = b_of_e(e).to(f64)
        c[sel] = a[sel].to(f64) @ b
        ab[sel] = a[sel].to(f64).abs() @ b.abs()
    return c, ab


def swiglu_parts(gu: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """From interleaved gate/up rows, in FP64: g, u, sigmoid(g), silu(g) and the activation allowance."""
    f64 = torch.float64
    g, u = gu[:, 0::2].to(f64), gu[:, 1::2].to(f64)
    sig = torch.sigmoid(g)
    return g, u, sig, g * sig, ACT * (1 + g.abs())


def dswiglu_check(dgu: torch.Tensor, gu: torch.Tensor, dh_star: torch.Tensor, e_h: torch.Tensor) -> ContractResult:
    """dgu = bf16(dSwiGLU(gu) * dh) from the kernel's own BF16 gu; dh_star is the FP64 dh and e_h bounds
    the kernel's error in dh (rows: the valid expert-sorted rows)."""
    g, u, sig, silu, act = swiglu_parts(gu)
    dsilu = sig * (1 + g * (1 - sig))
    dg_star = dh_star * u * dsilu
    du_star = dh_star * silu
    dg_bound = U_BF16 * dg_star.abs() + (1 + U_BF16) * (
        e_h * u.abs() * (dsilu.abs() + act) + dh_star.abs() * u.abs() * act) + ETA_BF16
    du_bound = U_BF16 * du_star.abs() + (1 + U_BF16) * (
        e_h * silu.abs() * (1 + act) + dh_star.abs() * silu.abs() * act) + ETA_BF16
    dgu_star = torch.stack((dg_star, du_star), dim=2).flatten(1)
    dgu_bound = torch.stack((dg_bound, du_bound), dim=2).flatten(1)
    return check_bound(dgu, dgu_star, dgu_bound)


def combine_checks(r: MoeRouting, scores: torch.Tensor, dout: torch.Tensor, out: torch.Tensor, y: torch.Tensor,
                   dxr: torch.Tensor, dx: torch.Tensor) -> dict[str, ContractResult]:
    """The token-side reductions from the kernel's own y and dx_route (BF16; the bounds take their dtype's unit):
    out = bf16(sum_k s_k y_k) and dx = bf16(sum_k dx_route_k), ascending k in FP32 with one rounding."""
    f64 = torch.float64
    hidden = dout.shape[1]
    y_tk = torch.zeros(r.num_tokens, r.top_k, hidden, dtype=f64, device=dout.device)
    rr = r.route_row.long()
    m = rr >= 0
    y_tk[m] = y.to(f64)[rr[m]]
    sy = scores.to(f64)[:, :, None] * y_tk
    out_star = sy.sum(1)
    results = {"out": check_bound(out, out_star, round_sum_bound(out_star, sy.abs().sum(1), r.top_k))}
    dxr_tk = torch.zeros_like(y_tk)
    dxr_tk[m] = dxr.to(f64)[rr[m]]
    dx_star = dxr_tk.sum(1)
    results["dx"] = check_bound(dx, dx_star, round_sum_bound(dx_star, dxr_tk.abs().sum(1), r.top_k))
    return results


def fused_dscore_check(r: MoeRouting, valid: torch.Tensor, dh_raw: torch.Tensor, dh_ab: torch.Tensor,
                       h: torch.Tensor, hidden: int, dscores: torch.Tensor, dtype: torch.dtype,
                       e_acc: torch.Tensor | None = None) -> ContractResult:
    """dscores from the dgrad accumulator (kernels.moe.moe_dgrad_dswiglu_dscore, and the FP8 layer's): per valid
    row, ds = sum_j acc_j * h_j in FP32 with acc = dout[t] @ W2[e].T accumulated over H in FP32, so
    |ds - ds*| <= sum_j e_j |h_j| + gamma(I) sum_j (|acc*_j| + e_j) |h_j| with e_j acc's own bound (``e_acc``;
    by default FP32 accumulation's), then one rounding to the scores' dtype. ``dh_raw``/``dh_ab`` [valid rows, I]
    FP64 from the FP64 oracle."""
    f64 = torch.float64
    h64 = h.to(f64)
    e_acc = fp32_sum_bound(dh_ab, hidden) if e_acc is None else e_acc
    star_row = (dh_raw * h64).sum(1)
    terms_row = ((dh_raw.abs() + e_acc) * h64.abs()).sum(1)
    carried_row = (e_acc * h64.abs()).sum(1)
    unit = rounding_unit(dtype)
    bound_row = round_sum_bound(star_row, terms_row, h.shape[1], unit) + (1 + unit) * carried_row
    rr = r.route_row.long()
    m = rr >= 0
    star = torch.zeros(rr.shape, dtype=f64, device=dscores.device)
    bound = torch.full(rr.shape, ETA_BF16, dtype=f64, device=dscores.device)  # a masked route: 0 (as the combine)
    full_star, full_bound = (torch.zeros(r.padded_rows, dtype=f64, device=dscores.device) for _ in range(2))
    full_star[valid], full_bound[valid] = star_row, bound_row
    star[m], bound[m] = full_star[rr[m]], full_bound[rr[m]]
    return check_bound(dscores, star, bound)


def padding_zero(tensors: dict[str, torch.Tensor], pad: torch.Tensor) -> dict[str, bool]:
    """Per tensor: its padding rows are exactly zero."""
    return {name: bool((t[pad].float() == 0).all()) if pad.numel() else True for name, t in tensors.items()}


def stage_checks(inp: dict[str, torch.Tensor]) -> tuple[dict[str, ContractResult], dict]:
    """Every stage against its FP64 oracle from its own inputs. Returns results and bit checks."""
    x, w1, w2, scores, dout = inp["x"], inp["w1"], inp["w2"], inp["scores"], inp["dout"]
    with sync_checks():  # the exact routing (its counts on the host, P rows): the same bits as the default path
        out, saved = moe_mlp_fwd(x, w1, w2, inp["topk_ids"], scores)
    grads = moe_mlp_bwd(dout, saved)
    r = saved.routing
    backend = saved.backend
    y = moe_down(saved.h, w2, r, backend)  # the forward's y (same call, same bits): it is not saved
    dgu = moe_dgrad_dswiglu(dout, w2, saved.gu, r, backend)
    dxr = moe_dx_route(dgu, w1, r, backend)
    f64 = torch.float64
    valid, pad, tok, exp, s_row = sorted_rows(r)
    hidden, inter = x.shape[1], w2.shape[1]
    results: dict[str, ContractResult] = {}
    # combine (out) and the dx gather-sum, from the kernel's y and dx_route
    combined = combine_checks(r, scores, dout, out, y, dxr, grads.dx)

    # up: gu = x[token] @ W1[e] (one BF16 rounding)
    gu_star, gu_ab = per_expert(x[tok], lambda e: w1[e], exp, w1.shape[2])
    results["gu"] = check_bound(saved.gu[valid], gu_star, gemm_bound(gu_star, gu_ab, hidden))
    # SwiGLU from the kernel's own BF16 gu
    _, u, _, silu, act = swiglu_parts(saved.gu[valid])
    h_star = silu * u
    results["h"] = check_bound(saved.h[valid], h_star, U_BF16 * h_star.abs() + (1 + U_BF16) * act * h_star.abs() + ETA_BF16)
    # down: y = h @ W2[e], the FP32 accumulator rounded once to y's dtype (BF16, as gu)
    y_star, y_ab = per_expert(saved.h[valid], lambda e: w2[e], exp, hidden)
    results["y"] = check_bound(y[valid], y_star, round_sum_bound(y_star, y_ab, inter, rounding_unit(y.dtype)))
    results["out"] = combined["out"]
    # dgrad + dSwiGLU: dh = s * (dout[token] @ W2[e].T); e_h bounds its FP32 error
    dh_raw, dh_ab = per_expert(dout[tok], lambda e: w2[e].t(), exp, inter)
    dh_star = s_row[:, None] * dh_raw
    e_h = gamma(hidden + 1) * s_row.abs()[:, None] * dh_ab
    results["dgu"] = dswiglu_check(dgu[valid], saved.gu[valid], dh_star, e_h)
    # dx per route (rounded once, as y), then the ascending-k gather-sum in FP32 with one rounding
    dxr_star, dxr_ab = per_expert(dgu[valid], lambda e: w1[e].t(), exp, hidden)
    results["dx_route"] = check_bound(dxr[valid], dxr_star,
                                      round_sum_bound(dxr_star, dxr_ab, 2 * inter, rounding_unit(dxr.dtype)))
    results["dx"] = combined["dx"]
    # dW1[e] = x[token]^T dgu and dW2[e] = h^T bf16(s * dout[token]) over the expert's rows
    dy = (s_row.float()[:, None] * dout[tok].float()).to(torch.bfloat16)
    dw1_star = torch.zeros(w1.shape, dtype=f64, device=x.device)
    dw1_ab, dw2_star = torch.zeros_like(dw1_star), torch.zeros(w2.shape, dtype=f64, device=x.device)
    dw2_ab = torch.zeros_like(dw2_star)
    count_bound1, count_bound2 = torch.zeros_like(dw1_star), torch.zeros_like(dw2_star)
    for e in range(w1.shape[0]):
        sel = (exp == e).nonzero().squeeze(1)
        xa, ga = x[tok[sel]].to(f64), dgu[valid[sel]].to(f64)
        ha, da = saved.h[valid[sel]].to(f64), dy[sel].to(f64)
        dw1_star[e], dw1_ab[e] = xa.t() @ ga, xa.abs().t() @ ga.abs()
        dw2_star[e], dw2_ab[e] = ha.t() @ da, ha.abs().t() @ da.abs()
        count_bound1[e] = gemm_bound(dw1_star[e], dw1_ab[e], sel.numel())
        count_bound2[e] = gemm_bound(dw2_star[e], dw2_ab[e], sel.numel())
    results["dw1"] = check_bound(grads.dw1, dw1_star, count_bound1)
    results["dw2"] = check_bound(grads.dw2, dw2_star, count_bound2)
    # dscores: fused into dgrad, from its accumulator and the saved h
    results["dscores"] = fused_dscore_check(r, valid, dh_raw, dh_ab, saved.h[valid], hidden, grads.dscores,
                                            scores.dtype)

    zero = padding_zero({"gu": saved.gu, "h": saved.h, "y": y, "dgu": dgu, "dx_route": dxr}, pad)
    composed = compare_bits(grads.dx, moe_gather_sum(dxr, r, backend))
    return results, {"padding_zero": zero, "composed_dx_equal": composed.equal}


def precision_stats(got: dict, inp: dict) -> dict[str, dict[str, float]]:
    """Per tensor: kernel vs FP64, BF16 gold vs FP64, and kernel vs gold (cosine, relative RMSE)."""
    args = (inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"], inp["dout"])
    oracle = moe_mlp_ref(*args, dtype=torch.float64)
    gold = moe_mlp_ref(*args, dtype=torch.bfloat16)
    stats = {}
    for name in GRAD_NAMES:
        stats[name] = {
            "rel_l2_fp64": rel_l2(got[name], oracle[name]),
            "gold_rel_l2_fp64": rel_l2(gold[name], oracle[name]),
            "rel_rmse_vs_gold": rel_l2(got[name], gold[name]),
            "cosine_vs_gold": cosine(got[name], gold[name]),
            "cosine_fp64": cosine(got[name], oracle[name]),
        }
    return stats


# ---------------------------------------------------------------------------------------------
# Batch invariance
# ---------------------------------------------------------------------------------------------
def _subbatch(inp: dict, index: torch.Tensor) -> dict:
    return {k: (v[index] if k in ("x", "topk_ids", "scores", "dout") else v) for k, v in inp.items()}


def invariance_variants(inp: dict, case: MoeCase, seed: int) -> Iterator[tuple[str, dict, torch.Tensor, torch.Tensor]]:
    """(variant, inputs, rows of the variant to compare, the same tokens' rows in the full batch)."""
    t = case.t
    dev = inp["x"].device
    gen = torch.Generator().manual_seed(seed + 99)
    for probe in sorted({0, t // 2, t - 1}):
        idx = torch.tensor([probe], device=dev)
        yield f"alone t={probe}", _subbatch(inp, idx), torch.tensor([0]), idx.cpu()
    half = torch.arange(max(1, t // 2 + 1), device=dev)
    yield "subset", _subbatch(inp, half), torch.arange(half.numel()), half.cpu()
    perm = torch.randperm(t, generator=gen)
    yield "permuted", _subbatch(inp, perm.to(dev)), torch.arange(t), perm
    # Every other token re-routed (ids and scores); probes 0 and t-1 keep theirs.
    other = _subbatch(inp, torch.arange(t, device=dev))
    ids = make_ids(MoeCase(case.t, case.h, case.i, case.e, case.k, "random", seed + 7)).to(dev)
    keep = torch.zeros(t, dtype=torch.bool, device=dev)
    keep[0], keep[t - 1] = True, True
    other["topk_ids"] = torch.where(keep[:, None], inp["topk_ids"], ids)
    other["scores"] = torch.where(keep[:, None], inp["scores"], inp["scores"].flip(0))
    rows = keep.nonzero().squeeze(1).cpu()
    yield "others_rerouted", other, rows, rows
    # Tokens prepended on the same experts as token 0: its row moves deeper into its segments.
    extra = SEGMENT_ALIGN + 3
    pre_ids = inp["topk_ids"][:1].expand(extra, -1)
    x_extra = bf16_randn((extra, case.h), seed + 55, dev)
    grown = {
        **inp,
        "x": torch.cat([x_extra, inp["x"]]), "topk_ids": torch.cat([pre_ids, inp["topk_ids"]]),
        "scores": torch.cat([inp["scores"][:1].expand(extra, -1), inp["scores"]]),
        "dout": torch.cat([inp["dout"][:1].expand(extra, -1), inp["dout"]]),
    }
    yield f"prepended {extra} on token 0's experts", grown, torch.arange(extra, extra + t), torch.arange(t)


# ---------------------------------------------------------------------------------------------
# Fresh-process digests
# ---------------------------------------------------------------------------------------------
def grad_digests(got: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: digest(got[name]) for name in GRAD_NAMES}


def case_digests(case: MoeCase, device: torch.device) -> dict[str, str]:
    return grad_digests(run_layer(make_inputs(case, device)))


def fresh_process_digests(cases: list[MoeCase], device: torch.device,
                          module: str = "detkit.audits.moe") -> dict[str, dict[str, str]]:
    """{case name: digests} from ``python -m module`` (a worker that calls ``serve_digests``)."""
    payload = json.dumps({"device": str(device), "cases": [asdict(c) for c in cases]})
    proc = subprocess.run([sys.executable, "-m", module], input=payload, capture_output=True, text=True,
                          timeout=FRESH_PROCESS_TIMEOUT_S, env=os.environ.copy())
    if proc.returncode != 0:
        raise RuntimeError(f"fresh-process worker failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fresh_process_row(suite: str, ctx: RunContext, module: str, case: MoeCase, name: str,
                      got: dict[str, torch.Tensor]) -> Row:
    """``got``'s digests equal those of the same case run by ``module`` in a new Python process."""
    local = grad_digests(got)
    with nvtx_range(f"fresh_process {suite}"):
        fresh = fresh_process_digests([case], ctx.device, module)[case.name]
    return Row(suite=suite, check="fresh_process", name=f"fresh_process {name}", passed=fresh == local,
               backend=ctx.backend, details={"digests": local, "fresh_digests": fresh})


def serve_digests(digests_of: Callable[[MoeCase, torch.device], dict[str, str]]) -> None:
    """The fresh-process worker: the request's cases on stdin, {case name: digests_of(case)} on stdout."""
    request = json.loads(sys.stdin.read())
    device = torch.device(request["device"])
    result = {}
    for fields in request["cases"]:
        case = MoeCase(**fields)
        result[case.name] = digests_of(case, device)
    print(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# Rejections (before any work)
# ---------------------------------------------------------------------------------------------
def rejection_cases(inp: dict) -> list[tuple[str, type, dict]]:
    dup = inp["topk_ids"].clone()
    dup[min(3, dup.shape[0] - 1), :] = dup[min(3, dup.shape[0] - 1), 0]
    return [
        ("duplicate ids", ValueError, {"topk_ids": dup}),
        ("ids int64", TypeError, {"topk_ids": inp["topk_ids"].long()}),
        ("id out of range", ValueError, {"topk_ids": torch.full_like(inp["topk_ids"], inp["w1"].shape[0])}),
        ("x float32", TypeError, {"x": inp["x"].float()}),
        ("w1 float16", TypeError, {"w1": inp["w1"].half()}),
        ("scores float16", TypeError, {"scores": inp["scores"].half()}),
        ("w1 odd 2I", ValueError, {"w1": inp["w1"][:, :, :-1]}),
        ("w2 wrong I", ValueError, {"w2": inp["w2"][:, :-1]}),
        ("x wrong H", ValueError, {"x": inp["x"][:, :-1]}),
        ("scores wrong shape", ValueError, {"scores": inp["scores"][:, :1]}),
        ("ids rows != T", ValueError, {"topk_ids": inp["topk_ids"][:-1], "scores": inp["scores"][:-1]}),
        ("w1 2-D", ValueError, {"w1": inp["w1"][0]}),
        ("scores NaN", ValueError, {"scores": torch.full_like(inp["scores"], float("nan"))}),
    ]


def edge_cases(t: int, h: int, i: int, e: int, k: int, seed: int) -> list[MoeCase]:
    """Segment sizes around the 128-row alignment, one expert, T = 1."""
    return [
        MoeCase(385, h, i, 5, 1, "counts:0,1,127,128,129", seed + 2),
        MoeCase(t, h, i, e, k, "one_expert", seed + 3),
        MoeCase(1, h, i, e, k, "random", seed + 4),
    ]


# ---------------------------------------------------------------------------------------------
# Rows shared with the FP8 suite (audits/moe_fp8.py)
# ---------------------------------------------------------------------------------------------
Forward = Callable[..., tuple]  # fwd(x, w1, w2, topk_ids, scores) -> (out, saved)


def batch_invariance_rows(suite: str, ctx: RunContext, fwd: Forward, inp: dict, case: MoeCase, name: str,
                          full: torch.Tensor) -> Iterator[Row]:
    """Per invariance variant: the compared tokens' output bits equal theirs in the full batch (``full``)."""
    for variant, sub, rows, full_rows in invariance_variants(inp, case, ctx.seed):
        with nvtx_range(f"batch_invariance {variant} {name}"):
            got = fwd(sub["x"], sub["w1"], sub["w2"], sub["topk_ids"], sub["scores"])[0]
        yield bits_row(suite, ctx, "batch_invariance", f"batch_invariance {variant} {name}",
                       {"out": got[rows.to(got.device)]}, {"out": full[full_rows.to(full.device)]},
                       tokens_compared=int(rows.numel()))


def stage_rows(suite: str, ctx: RunContext, results: dict[str, ContractResult], name: str) -> Iterator[Row]:
    for stage, res in results.items():
        yield Row(suite=suite, check="stage_bound", name=f"stage_bound {stage} {name}", passed=res.passed,
                  backend=ctx.backend, details=res.as_row())


def rejection_rows(suite: str, ctx: RunContext, fwd: Forward, inp: dict,
                   cases: list[tuple[str, type, dict]]) -> Iterator[Row]:
    """Per rejection case: ``fwd`` raises the expected error type before any work."""
    for label, exc_type, change in cases:
        bad = {**inp, **change}
        try:
            with sync_checks():  # the validating mode refuses bad ids and scores; by default they poison the outputs
                fwd(bad["x"], bad["w1"], bad["w2"], bad["topk_ids"], bad["scores"])
            raised, message = None, "no error"
        except (TypeError, ValueError) as exc:
            raised, message = type(exc), str(exc)
        yield Row(suite=suite, check="rejects", name=f"rejects {label}", passed=raised is exc_type,
                  backend=ctx.backend, details={"expected": exc_type.__name__,
                                                "raised": raised.__name__ if raised else None, "message": message})


def run(ctx: RunContext) -> Iterator[Row]:
    t, h, i, e, k = audit_shape(ctx)
    main = MoeCase(t, h, i, e, k, "random", ctx.seed)
    inp = make_inputs(main, ctx.device)

    # Determinism: repetitions, then a fresh process.
    with nvtx_range(f"repetitions {main.name}"):
        outs = [run_layer(inp) for _ in range(3)]
    for rep, got in enumerate(outs[1:], start=1):
        yield bits_row(NAME, ctx, "repetitions", f"repetitions {main.name} #{rep}", got, outs[0])
    yield fresh_process_row(NAME, ctx, "detkit.audits.moe", main, main.name, outs[0])

    # Forward batch invariance per token.
    yield from batch_invariance_rows(NAME, ctx, moe_mlp_fwd, inp, main, main.name, outs[0]["out"])

    # Contract per stage, end-to-end gate and precision vs the BF16 gold.
    for case in (main, MoeCase(t, h, i, e, k, "masked", ctx.seed + 1)):
        case_inp = inp if case is main else make_inputs(case, ctx.device)
        with nvtx_range(f"contract {case.name}"):
            results, extra = stage_checks(case_inp)
        yield from stage_rows(NAME, ctx, results, case.name)
        yield Row(suite=NAME, check="stage_bound", name=f"padding_and_composition {case.name}",
                  passed=all(extra["padding_zero"].values()) and extra["composed_dx_equal"], backend=ctx.backend,
                  details=extra)
        got = outs[0] if case is main else run_layer(case_inp)
        stats = precision_stats(got, case_inp)
        for name, st in stats.items():
            yield Row(suite=NAME, check="end_to_end", name=f"end_to_end {name} {case.name}",
                      passed=st["rel_l2_fp64"] <= E2E_REL_L2_GATE, backend=ctx.backend,
                      details={"gate": E2E_REL_L2_GATE, **st})
            ok = (st["cosine_vs_gold"] >= GOLD_MIN_COSINE
                  and st["rel_l2_fp64"] <= GOLD_SLACK * st["gold_rel_l2_fp64"] + 2.0**-12)
            yield Row(suite=NAME, check="precision", name=f"precision {name} {case.name}", passed=ok,
                      backend=ctx.backend, details={"min_cosine": GOLD_MIN_COSINE, "slack": GOLD_SLACK, **st})

    # main_grad accumulation: FP32 += the kernel's FP32 dW, exactly.
    base = run_layer(inp)
    zeros = (torch.zeros(inp["w1"].shape, device=ctx.device), torch.zeros(inp["w2"].shape, device=ctx.device))
    run_layer(inp, main_grads=zeros)
    start = tuple(torch.randn(z.shape, generator=torch.Generator().manual_seed(5)).to(ctx.device) for z in zeros)
    acc = tuple(s.clone() for s in start)
    run_layer(inp, main_grads=acc)
    checks = {
        "dw1_bf16_of_fp32": compare_bits(zeros[0].to(torch.bfloat16), base["dw1"]).equal,
        "dw2_bf16_of_fp32": compare_bits(zeros[1].to(torch.bfloat16), base["dw2"]).equal,
        "dw1_accumulated": compare_bits(acc[0], start[0] + zeros[0]).equal,
        "dw2_accumulated": compare_bits(acc[1], start[1] + zeros[1]).equal,
    }
    yield Row(suite=NAME, check="main_grad", name=f"main_grad {main.name}", passed=all(checks.values()),
              backend=ctx.backend, details=checks)

    # transformers' weight layout read in place.
    with nvtx_range(f"split_layout {main.name}"):
        yield split_layout_row(NAME, ctx, moe_mlp, inp, outs[0], main.name)

    # Edge cases: segment sizes around the 128-row alignment, one expert, masked routes, T = 1.
    for case in edge_cases(t, h, i, e, k, ctx.seed):
        case_inp = make_inputs(case, ctx.device)
        with nvtx_range(f"edge {case.name}"):
            results, extra = stage_checks(case_inp)
        failed = [s for s, r in results.items() if not r.passed]
        yield Row(suite=NAME, check="edge", name=f"edge {case.name}",
                  passed=not failed and all(extra["padding_zero"].values()), backend=ctx.backend,
                  details={"failed_stages": failed, "worst_ratio": max(r.worst_ratio for r in results.values()),
                           **extra})

    # Rejections before any work.
    yield from rejection_rows(NAME, ctx, moe_mlp_fwd, inp, rejection_cases(inp))


if __name__ == "__main__":
    serve_digests(case_digests)
