"""One-off H200 experiment (session 22): moe_fp8_quant_to_routes' token rows per program, against the row-wise
quantizer it replaces, at two presets (event-timed µs, interleaved). Usage: python exp_s22c.py OUT_DIR"""

import json
import statistics
import sys
from pathlib import Path

import torch

import detkit.kernels.moe_fp8_launch as launch
from detkit.bench.moe_common import MoePreset, make_inputs
from detkit.kernels.fp8_quant import quantize_rowwise
from detkit.kernels.moe_routing import build_routing

SHAPES = {"reference": (8192, 3072, 1536, 8, 8), "qwen3-30b-a3b": (8192, 2048, 768, 128, 8)}


def timed(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset, (t, h, i, e, k) in SHAPES.items():
        inp = make_inputs(MoePreset(preset, t, h, i, e, k), torch.device("cuda"), seed=1)
        r = build_routing(inp["topk_ids"], inp["scores"], e)

        def routes(bm):
            launch.QUANT_TO_ROUTES_BLOCK_M["cuda_sm90"] = bm
            return launch.moe_fp8_quant_to_routes(inp["x"], r, "cuda_sm90")
        fns = {f"to_routes_bm{bm}": (lambda bm=bm: routes(bm)) for bm in (8, 16, 32, 64)}
        fns["rowwise"] = lambda: quantize_rowwise(inp["x"])
        ref = routes(32)
        same = {n: all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(f(), ref))
                for n, f in fns.items() if n != "rowwise"}
        times = {n: [] for n in fns}
        for _ in range(3):
            for f in fns.values():
                f()
        for _ in range(15):
            for n, f in fns.items():
                times[n].append(timed(f))
        row = {"preset": preset, "same_bits_as_bm32": same}
        for n, ts in times.items():
            q = statistics.quantiles(ts, n=5)
            row[n] = {"median_us": round(statistics.median(ts), 1), "p20": round(q[0], 1), "p80": round(q[3], 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    launch.QUANT_TO_ROUTES_BLOCK_M["cuda_sm90"] = 32
    (out / "to_routes.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
