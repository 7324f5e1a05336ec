"""s20 call 1: the FP8 dgrad with its epilogue's gu and h prefetched by TMA into the store buffers (PREFETCH) against
the global loads after the K loop; the FP8 wgrad's scale-read proxy fence in the consumers (0), in the producer (1),
absent (2). Bits of every variant against the current one, repeated; times interleaved."""
import functools, json, sys
from pathlib import Path
import torch
from bench.moe_common import make_inputs
from detkit.toolkit.presets import MOE_PRESETS
from detkit.toolkit.timing import time_interleaved
import detkit.kernels.moe_fp8_launch as fl
from detkit.kernels.fp8_quant import quantize_rowwise, quantize_weight
from detkit.kernels.moe import moe_mlp_fwd
from detkit.kernels.moe_fp8_launch import moe_fp8_dgrad, moe_fp8_quant_colwise, moe_fp8_wgrad
from detkit.kernels.moe_routing import build_routing

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
gather0, wgrad0 = fl.launch_fp8_ws_gather, fl.launch_fp8_wgrad_ws
REPEATS = 20


def with_launchers(prefetch=True, fence=0):
    def wrap(fn):
        def run(*a, **k):
            fl.launch_fp8_ws_gather = functools.partial(gather0, prefetch=prefetch)
            fl.launch_fp8_wgrad_ws = functools.partial(wgrad0, scale_fence=fence)
            try:
                return fn(*a, **k)
            finally:
                fl.launch_fp8_ws_gather, fl.launch_fp8_wgrad_ws = gather0, wgrad0
        return run
    return wrap


def bits(ts):
    return [t.contiguous().view(torch.uint8).clone() for t in ts if t is not None]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


res = {}
for preset in ("reference", "qwen3-30b-a3b"):
    p = MOE_PRESETS[preset]
    inp = make_inputs(p, dev, 1234)
    x, w1, w2, ids, scores, dout = (inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout"))
    r = build_routing(ids, scores, p.e)
    _, saved = moe_mlp_fwd(x, w1, w2, ids, scores)
    b = saved.backend
    dout_q, dout_s = quantize_rowwise(dout)
    w2f = quantize_weight(w2)
    row = {}
    fns = {}
    for ds in (False, True):
        h = saved.h if ds else None
        ref = bits(moe_fp8_dgrad(dout_q, dout_s, w2f, saved.gu, r, b, h=h))  # PREFETCH (the default)
        old = with_launchers(prefetch=False)(lambda: moe_fp8_dgrad(dout_q, dout_s, w2f, saved.gu, r, b, h=h))
        row[f"dgrad_ds{int(ds)}_prefetch_vs_global_equal"] = same(ref, bits(old()))
        row[f"dgrad_ds{int(ds)}_prefetch_repeat_equal"] = all(
            same(ref, bits(moe_fp8_dgrad(dout_q, dout_s, w2f, saved.gu, r, b, h=h))) for _ in range(REPEATS))
        fns[f"dgrad_ds{int(ds)}_prefetch"] = functools.partial(moe_fp8_dgrad, dout_q, dout_s, w2f, saved.gu, r, b, h=h)
        fns[f"dgrad_ds{int(ds)}_global"] = old
    # The dW2-shaped weight gradient, BF16 out and into main_grad (FP32, where the race showed).
    hq, hs = moe_fp8_quant_colwise(saved.h, r, b, gather=False, scale=False)
    yq, ys = moe_fp8_quant_colwise(dout, r, b, gather=True, scale=True)
    base_bf16 = bits([moe_fp8_wgrad(hq, hs, yq, ys, r, b)])
    mg0 = torch.randn((p.e, hq.shape[0], yq.shape[0]), device=dev)
    def into_mg(fence):
        mg = mg0.clone()
        with_launchers(fence=fence)(moe_fp8_wgrad)(hq, hs, yq, ys, r, b, main_grad=mg)
        return mg
    base_mg = bits([into_mg(0)])
    for fence in (0, 1, 2):
        row[f"wgrad_fence{fence}_bf16_repeat_equal"] = all(
            same(base_bf16, bits([with_launchers(fence=fence)(moe_fp8_wgrad)(hq, hs, yq, ys, r, b)]))
            for _ in range(REPEATS))
        row[f"wgrad_fence{fence}_main_grad_repeat_equal"] = all(same(base_mg, bits([into_mg(fence)]))
                                                              for _ in range(REPEATS))
        fns[f"wgrad_fence{fence}"] = functools.partial(with_launchers(fence=fence)(moe_fp8_wgrad), hq, hs, yq, ys, r, b)
    t = time_interleaved(fns, dev, rounds=5)
    row.update({k: {"median_us": v.median_us, "p20_us": v.p20_us, "p80_us": v.p80_us, "sm_clock_mhz": v.sm_clock_mhz}
                for k, v in t.items()})
    res[preset] = row
    print(preset, json.dumps(row, indent=1), flush=True)
(out / "exp.json").write_text(json.dumps(res, indent=1))
