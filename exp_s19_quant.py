"""s19 call 7: the E4M3 conversion as the bare cvt.rn.satfinite (kernels/fp8_quant.py) against the clamped one
(exp_s19_fp8_quant_old.py: kernels/fp8_quant.py before the change) on the weight and row-wise quantizers, interleaved
in one process, bits compared. Usage: python exp_s19_quant.py OUT"""
import json, sys
from pathlib import Path
import torch
import exp_s19_fp8_quant_old as old
from bench.moe_common import make_inputs
from detkit.kernels import fp8_quant as new
from detkit.toolkit.presets import MOE_PRESETS
from detkit.toolkit.timing import time_interleaved

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
res = {}
for preset in ("reference", "qwen3-30b-a3b"):
    inp = make_inputs(MOE_PRESETS[preset], dev, 1234)
    fns = {"weight_new": lambda: new.quantize_weight(inp["w1"]), "weight_old": lambda: old.quantize_weight(inp["w1"]),
           "rowwise_new": lambda: new.quantize_rowwise(inp["x"]), "rowwise_old": lambda: old.quantize_rowwise(inp["x"])}
    a, b = new.quantize_weight(inp["w1"]), old.quantize_weight(inp["w1"])
    c, d = new.quantize_rowwise(inp["x"]), old.quantize_rowwise(inp["x"])
    same = {"weight": all(torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x, y.view(torch.uint8) if y.dtype != torch.float32 else y)
                          for x, y in ((a.q, b.q), (a.q_t, b.q_t), (a.scale, b.scale))),
            "rowwise": torch.equal(c[0].view(torch.uint8), d[0].view(torch.uint8)) and torch.equal(c[1], d[1])}
    t = time_interleaved(fns, dev, rounds=3)
    res[preset] = {"bits_equal": same, **{k: {"median_us": v.median_us, "p20_us": v.p20_us, "p80_us": v.p80_us,
                                              "sm_clock_mhz": v.sm_clock_mhz} for k, v in t.items()}}
    print(preset, json.dumps(res[preset]), flush=True)
(out / "quant.json").write_text(json.dumps(res, indent=1))
