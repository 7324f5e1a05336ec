"""The BF16 layer's backward with dgrad reading dout's rows in expert order by TMA (kernels/moe.py SORTED_DOUT, the
copy made in moe_scale_rows' pass) against the gathered rows (cp.async): the layer's forward+backward outputs and
gradients bit for bit, its time interleaved, and the stages alone (dgrad with and without the copy, the scale-rows
pass with and without it). Run from the repository root:

    python reports/2026-12-02-h200-s17/scripts/sorted_dout.py OUT_DIR
"""
import json
import sys
from pathlib import Path

import torch

from detkit.bench.moe_common import make_inputs
from detkit.kernels import moe as moe_layer
from detkit.kernels.backend import CUDA_SM90
from detkit.kernels.moe import moe_dgrad_dswiglu_dscore, moe_mlp, moe_mlp_fwd, moe_scale_rows
from detkit.kernels.moe_routing import build_routing
from detkit.toolkit.presets import MOE_PRESETS, MoePreset
from detkit.toolkit.timing import time_interleaved

out_dir = Path(sys.argv[1])
out_dir.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
rows = []
cases = [MOE_PRESETS["reference"], MOE_PRESETS["qwen3-30b-a3b"], MoePreset("qwen3-30b-a3b-16k", 16384, 2048, 768, 128, 8)]
for p in cases:
    inp = make_inputs(p, dev)
    leaves = {n: inp[n].detach().clone().requires_grad_(True) for n in ("x", "w1", "w2", "scores")}

    def layer(sorted_dout):
        moe_layer.SORTED_DOUT = sorted_dout
        for t in leaves.values():
            t.grad = None
        y = moe_mlp(leaves["x"], leaves["w1"], leaves["w2"], inp["topk_ids"], leaves["scores"])
        y.backward(inp["dout"])
        return [y] + [leaves[n].grad for n in ("x", "w1", "w2", "scores")]

    want = [t.clone() for t in layer(False)]
    got = layer(True)
    bits = all(torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a, b.view(torch.int16)
                           if b.dtype == torch.bfloat16 else b) for a, b in zip(want, got))
    routing = build_routing(inp["topk_ids"], inp["scores"], p.e)
    _, saved = moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])
    gu, h = saved.gu[:routing.padded_rows], saved.h[:routing.padded_rows]
    _, sorted_dout = moe_scale_rows(inp["dout"], routing, CUDA_SM90, sorted_copy=True)
    fns = {
        "layer_gathered": lambda: layer(False), "layer_sorted": lambda: layer(True),
        "dgrad_gathered": lambda: moe_dgrad_dswiglu_dscore(inp["dout"], inp["w2"], gu, h, routing, CUDA_SM90),
        "dgrad_sorted": lambda: moe_dgrad_dswiglu_dscore(inp["dout"], inp["w2"], gu, h, routing, CUDA_SM90,
                                                         sorted_dout=sorted_dout),
        "scale_rows": lambda: moe_scale_rows(inp["dout"], routing, CUDA_SM90),
        "scale_rows_copy": lambda: moe_scale_rows(inp["dout"], routing, CUDA_SM90, sorted_copy=True),
    }
    timings = time_interleaved(fns, dev, rounds=5)
    for name, tm in timings.items():
        row = {"case": p.name, "T": p.t, "H": p.h, "I": p.i, "E": p.e, "K": p.k, "what": name,
               "median_us": tm.median_us, "p20_us": tm.p20_us, "p80_us": tm.p80_us, "sm_clock_mhz": tm.sm_clock_mhz}
        if name.startswith("layer"):
            row["mfu_bf16_989"] = 18 * p.t * p.k * p.h * p.i / (tm.median_us * 1e-6) / 989e12
            row["layer_bits_equal"] = bits
        rows.append(row)
        print(json.dumps(row), flush=True)
    del inp, leaves, saved, routing, sorted_dout, want, got
    torch.cuda.empty_cache()
moe_layer.SORTED_DOUT = True
(out_dir / "sorted_dout.json").write_text(json.dumps(rows, indent=1))
