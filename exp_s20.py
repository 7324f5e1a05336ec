"""s20 call 2: the FP8 dgrad with its epilogue's inputs prefetched by TMA into the store buffers during the K loop:
PREFETCH 0 (global loads after the K loop, as before), 1 (gu), 2 (gu and h). The dgrad alone with and without the
dscore partials, and the FP8 layer forward+backward (which runs the dgrad with them). Bits of every variant against
PREFETCH 0 over the real P rows (rows past it, up to the bound's largest P, are never written), repeated; times
interleaved."""
import functools, json, sys
from pathlib import Path
import torch
from bench.moe_common import make_inputs
from detkit.toolkit.presets import MOE_PRESETS
from detkit.toolkit.timing import time_interleaved
import detkit.kernels.moe_fp8_launch as fl
from detkit.kernels.fp8_quant import quantize_rowwise, quantize_weight
from detkit.kernels.moe import moe_mlp_fwd
from detkit.kernels.moe_fp8 import moe_mlp_fp8_bwd, moe_mlp_fp8_fwd
from detkit.kernels.moe_fp8_launch import moe_fp8_dgrad

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
gather0 = fl.launch_fp8_ws_gather
REPEATS = 10
VARIANTS = (0, 1, 2)


def with_prefetch(prefetch, fn):
    def run(*a, **k):
        fl.launch_fp8_ws_gather = functools.partial(gather0, prefetch=prefetch)
        try:
            return fn(*a, **k)
        finally:
            fl.launch_fp8_ws_gather = gather0
    return run


def bits(ts, rows):
    return [t[:rows].contiguous().view(torch.uint8).clone() for t in ts if t is not None]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


res = {}
for preset in ("reference", "qwen3-30b-a3b"):
    p = MOE_PRESETS[preset]
    inp = make_inputs(p, dev, 1234)
    x, w1, w2, ids, scores, dout = (inp[n] for n in ("x", "w1", "w2", "topk_ids", "scores", "dout"))
    _, saved = moe_mlp_fwd(x, w1, w2, ids, scores)
    r, b = saved.routing, saved.backend
    rows = int(r.gate[0].item())
    dout_q, dout_s = quantize_rowwise(dout)
    w2f = quantize_weight(w2)
    row = {"real_rows": rows, "bound_rows": r.padded_rows}
    fns = {}
    for ds in (False, True):
        h = saved.h if ds else None
        call = functools.partial(moe_fp8_dgrad, dout_q, dout_s, w2f, saved.gu, r, b, h=h)
        base = bits(with_prefetch(0, call)(), rows)
        for v in VARIANTS:
            run = with_prefetch(v, call)
            row[f"dgrad_ds{int(ds)}_prefetch{v}_repeat_equal_to_0"] = all(same(base, bits(run(), rows))
                                                                         for _ in range(REPEATS))
            fns[f"dgrad_ds{int(ds)}_prefetch{v}"] = run
    # The FP8 layer, forward + backward (weights quantized per call, as in `detkit bench moe`).
    def layer():
        o, sv = moe_mlp_fp8_fwd(x, w1, w2, ids, scores)
        return moe_mlp_fp8_bwd(dout, sv)
    g0 = with_prefetch(0, layer)()
    for v in VARIANTS:
        run = with_prefetch(v, layer)
        g = run()
        row[f"layer_prefetch{v}_grads_equal_to_0"] = all(torch.equal(getattr(g, n), getattr(g0, n))
                                                         for n in ("dx", "dw1", "dw2", "dscores"))
        fns[f"layer_fwd_bwd_prefetch{v}"] = run
    t = time_interleaved(fns, dev, rounds=5)
    row.update({k: {"median_us": v.median_us, "p20_us": v.p20_us, "p80_us": v.p80_us, "sm_clock_mhz": v.sm_clock_mhz}
                for k, v in t.items()})
    res[preset] = row
    print(preset, json.dumps(row, indent=1), flush=True)
(out / "exp.json").write_text(json.dumps(res, indent=1))
