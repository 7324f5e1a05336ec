"""The FP8 half of ``detkit bench moe``: the FP8 MoE layer's (kernels/moe/fp8/layer.py) validation, its stage breakdown,
and the crossover model over T.

Validation of an FP8 implementation (bench/moe.py runs it per preset, after the BF16 layer's): its forward + backward
twice, bitwise equal, and the precision gate (toolkit.moe_gate.gate_passed: cosine >= 0.997 and relative RMSE < 7.6%)
for out, dX, dscores, dW1, dW2 against the FP64 oracle (kernels.moe.moe_mlp_ref) and against the BF16 detkit path
when that path passed its own validation. At a sweep point, one run gated against the BF16 path. The
quantization-risk monitor (kernels.moe_fp8.moe_fp8_risk) is attached to the preset's FP8 rows.

Crossover over T, per shape: a linear model time = a + b*T per path by least squares gives
T* = (a_fp8 - a_bf16) / (b_bf16 - b_fp8), and the smallest swept T from which FP8 is faster at every larger swept T
is reported beside it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from detkit.bench.moe_common import layer_tensors
from detkit.toolkit.presets import MoePreset

# Each FP8 stage alone: name -> FLOPs per T*K*H*I.
STAGES = {"quant_weights": 0.0, "quant_x": 0.0, "up_swiglu": 4.0, "down": 2.0, "combine": 0.0, "quant_dout": 0.0,
          "dgrad_dswiglu": 2.0, "dx_route": 4.0, "dx_gather_sum": 0.0, "wgrad_w1_bf16": 4.0, "wgrad_w2_bf16": 2.0,
          "wgrad_fp8_colwise_quant": 0.0, "wgrad_w1_fp8": 4.0, "wgrad_w2_fp8": 2.0, "dscores": 0.0}


def unfit_reason(p: MoePreset) -> str | None:
    """None when the FP8 layer runs at ``p``; else why not (one line)."""
    from detkit.kernels.moe.fp8.quant import QBLOCK

    if p.h % QBLOCK or p.i % QBLOCK:
        return f"H={p.h} and I={p.i} must be multiples of {QBLOCK} (the FP8 quantization block)"
    return None


def rule_fields(p: MoePreset, backend: str, impl: str) -> dict[str, str]:
    """The layer the mode's FP8 experts run at ``p``'s shape (kernels/moe/fp8/choice.py: H, I, E, K, the backend and
    ``impl``'s weight gradients; not T) and why: ``rule_picks`` "fp8" or "bf16". The row times the FP8 layer either
    way: the rows are the evidence the rule is fitted on (tools/fp8_choice_fit.py)."""
    from detkit.kernels.moe.fp8.choice import fp8_choice
    from detkit.kernels.moe.fp8.layer import DEFAULT_WGRAD

    choice = fp8_choice(p.h, p.i, p.e, p.k, backend, "bf16" if impl == "fp8_wgrad_bf16" else DEFAULT_WGRAD)
    return {"rule_picks": choice.layer, "rule_reason": choice.reason}


def fp8_label(p: MoePreset) -> str:
    return p.label.replace("] bf16", "] fp8")


def layer_fns(inp: dict, wgrad: str | None = None, weight_cache=None, stage_range=None) -> dict[str, Callable]:
    """{"fwd", "fwd_bwd"} of the FP8 layer on ``inp``: weights quantized in each call unless ``weight_cache``,
    the weight gradients by ``wgrad`` (None: the layer's default)."""
    from detkit.kernels.moe.fp8.layer import DEFAULT_WGRAD, moe_mlp_fp8_bwd, moe_mlp_fp8_fwd

    args = [inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores")]
    mode = wgrad or DEFAULT_WGRAD

    def fwd():
        return moe_mlp_fp8_fwd(*args, stage_range=stage_range, weight_cache=weight_cache)

    def fwd_bwd():
        out, saved = fwd()
        return out, moe_mlp_fp8_bwd(inp["dout"], saved, stage_range=stage_range, wgrad=mode)

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def check_runs(runs: list[dict], inp: dict, bf16: dict | None, oracle: dict | None) -> dict:
    """Repeat bits (with two runs) and the precision gate of FP8 runs' tensors (layer_tensors): against the FP64
    ``oracle`` and the BF16 path ``bf16`` (each when given; at least one)."""
    from detkit.toolkit.contract import compare_bits
    from detkit.toolkit.moe_gate import gate_passed, precision_stats

    if oracle is None and bf16 is None:
        raise ValueError("the FP8 gate needs the FP64 oracle, the BF16 path or both")
    repeat = all(compare_bits(runs[0][n], runs[1][n]).equal for n in runs[0]) if len(runs) > 1 else None
    stats = (precision_stats(runs[0], inp, bf16, oracle) if oracle is not None
             else precision_stats_bf16_only(runs[0], bf16))
    gate = all(gate_passed(st) for st in stats.values())
    return {"repeat_bitwise_equal": repeat, "gate_passed": gate, "precision": stats,
            "gate_vs": [k for k, v in (("fp64", oracle), ("bf16_path", bf16)) if v is not None],
            "validated": gate and repeat is not False}


def precision_stats_bf16_only(got: dict, bf16: dict) -> dict[str, dict[str, float]]:
    """Cosine and relative RMSE against the BF16 detkit path only."""
    from detkit.toolkit.contract import cosine, rel_l2

    return {n: {"cosine_bf16_path": cosine(got[n], bf16[n]), "rel_rmse_bf16_path": rel_l2(got[n], bf16[n])}
            for n in got}


def run_tensors(fns: dict[str, Callable]) -> dict[str, torch.Tensor]:
    """out, dx, dw1, dw2, dscores of one forward + backward."""
    return layer_tensors(*fns["fwd_bwd"]())


def quant_risk(inp: dict) -> dict:
    from detkit.kernels.moe.fp8.layer import moe_fp8_risk, moe_mlp_fp8_fwd

    _, saved = moe_mlp_fp8_fwd(*[inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores")], weight_cache=None)
    return moe_fp8_risk(saved, inp["dout"])


def stage_fns(p: MoePreset, inp: dict, backend: str) -> dict[str, tuple[Callable[[], object], float]]:
    """Each FP8 stage alone on ``inp``, its operands quantized once (the breakdown: what to tune first):
    name -> (fn, FLOPs per T*K*H*I)."""
    from detkit.kernels.moe.fp8.quant import quantize_rowwise, quantize_weight
    from detkit.kernels.moe.layer import moe_combine, moe_dscores_from_partials, moe_gather_sum, moe_wgrad_w1, moe_wgrad_w2
    from detkit.kernels.moe.fp8.layer import (
        WGRAD_CONFIGS, moe_fp8_dgrad, moe_fp8_down, moe_fp8_dx_route, moe_fp8_quant_colwise, moe_fp8_up_swiglu,
        moe_fp8_wgrad,
    )
    from detkit.kernels.moe.routing import build_routing

    x, w1, w2, ids, scores, dout = (inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout"))
    b = backend
    routing = build_routing(ids, scores, p.e)
    w1f, w2f = quantize_weight(w1), quantize_weight(w2)
    x_q, x_s = quantize_rowwise(x)
    gu, h, h_q, h_s = moe_fp8_up_swiglu(x_q, x_s, w1f, routing, b)
    y = moe_fp8_down(h_q, h_s, w2f, routing, b)
    d_q, d_s = quantize_rowwise(dout)
    dgu, dgu_q, dgu_s, ds_part = moe_fp8_dgrad(d_q, d_s, w2f, gu, routing, b, h=h)
    dxr = moe_fp8_dx_route(dgu_q, dgu_s, w1f, routing, b)
    wcfg = WGRAD_CONFIGS[b]
    colq = [((x,), {"gather": True, "scale": False}), ((dgu,), {"gather": False, "scale": False}),
            ((h,), {"gather": False, "scale": False}), ((dout,), {"gather": True, "scale": True})]
    cq = dict(zip(("x", "dgu", "h", "dy"), (moe_fp8_quant_colwise(*a, routing, b, **kw) for a, kw in colq)))
    fns: dict[str, Callable[[], object]] = {
        "quant_weights": lambda: (quantize_weight(w1), quantize_weight(w2)),
        "quant_x": lambda: quantize_rowwise(x),
        "up_swiglu": lambda: moe_fp8_up_swiglu(x_q, x_s, w1f, routing, b),
        "down": lambda: moe_fp8_down(h_q, h_s, w2f, routing, b),
        "combine": lambda: moe_combine(y, routing, scores, b),
        "quant_dout": lambda: quantize_rowwise(dout),
        "dgrad_dswiglu": lambda: moe_fp8_dgrad(d_q, d_s, w2f, gu, routing, b, h=h),
        "dx_route": lambda: moe_fp8_dx_route(dgu_q, dgu_s, w1f, routing, b),
        "dx_gather_sum": lambda: moe_gather_sum(dxr, routing, b),
        "wgrad_w1_bf16": lambda: moe_wgrad_w1(x, dgu, routing, b, config=wcfg),
        "wgrad_w2_bf16": lambda: moe_wgrad_w2(h, dout, routing, b, config=wcfg),
        "wgrad_fp8_colwise_quant": lambda: [moe_fp8_quant_colwise(*a, routing, b, **kw) for a, kw in colq],
        "wgrad_w1_fp8": lambda: moe_fp8_wgrad(*cq["x"], *cq["dgu"], routing, b),
        "wgrad_w2_fp8": lambda: moe_fp8_wgrad(*cq["h"], *cq["dy"], routing, b),
        "dscores": lambda: moe_dscores_from_partials(ds_part, routing, b),
    }
    return {s: (fns[s], STAGES[s]) for s in STAGES}


# ---------------------------------------------------------------------------------------------
# Crossover: fwd_bwd over T at one shape, and the linear model time = a + b*T
# ---------------------------------------------------------------------------------------------
def fit_line(ts: list[float], times: list[float]) -> tuple[float, float]:
    """Least-squares (a, b) of time = a + b*T."""
    n = len(ts)
    if n < 2 or len(set(ts)) < 2:
        raise ValueError(f"a line needs at least two distinct T; got {ts}")
    mt, my = sum(ts) / n, sum(times) / n
    b = sum((t - mt) * (y - my) for t, y in zip(ts, times)) / sum((t - mt) ** 2 for t in ts)
    return my - b * mt, b


def crossover(points: list[dict], fp8_key: str = "fp8_median_us") -> dict:
    """The fitted and the measured crossover T from validated points (``bf16_median_us`` and ``fp8_key`` per T)."""
    pts = sorted((pt for pt in points if pt["validated"] and fp8_key in pt), key=lambda pt: pt["T"])
    if len(pts) < 2:
        return {"error": f"{len(pts)} validated point(s); the fit needs 2 or more"}
    ts = [float(pt["T"]) for pt in pts]
    a16, b16 = fit_line(ts, [pt["bf16_median_us"] for pt in pts])
    a8, b8 = fit_line(ts, [pt[fp8_key] for pt in pts])
    fitted = (a8 - a16) / (b16 - b8) if b16 > b8 else None  # None: FP8 never pays by the model
    measured = None
    for i in range(len(pts)):
        if all(pt[fp8_key] < pt["bf16_median_us"] for pt in pts[i:]):
            measured = pts[i]["T"]
            break
    return {"bf16_fit_us": {"a": a16, "b_per_token": b16}, "fp8_fit_us": {"a": a8, "b_per_token": b8},
            "crossover_T_fit": fitted, "crossover_T_measured": measured,
            "points": [{k: pt[k] for k in ("T", "bf16_median_us", fp8_key)} for pt in pts]}
