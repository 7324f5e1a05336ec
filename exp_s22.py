"""One-off H200 experiment (session 22): the column-wise quantizer, Triton tile against the Gluon kernel, on the
layer's four operands at two presets: bits and event-timed µs, interleaved. Usage: python exp_s22.py OUT_DIR"""

import json
import statistics
import sys
from pathlib import Path

import torch

from detkit.bench.moe_common import MoePreset, make_inputs
from detkit.kernels.det_gemm import GemmConfig
from detkit.kernels.moe_fp8 import moe_fp8_quant_colwise
from detkit.kernels.moe_routing import build_routing
from detkit.toolkit.contract import compare_bits

CONFIGS = {"triton_64x2": GemmConfig(128, 64, 16, 1, 2, 1), "ws_128x4": GemmConfig(128, 128, 16, 1, 4, 1, "ws")}
SHAPES = {"reference": (8192, 3072, 1536, 8, 8), "qwen3-30b-a3b": (8192, 2048, 768, 128, 8),
          "e128k2": (8192, 3072, 1536, 128, 2)}


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
        p = r.padded_rows
        gen = torch.Generator(device="cuda").manual_seed(3)
        dgu = torch.randn((p, 2 * i), device="cuda", generator=gen).to(torch.bfloat16)
        hh = torch.randn((p, i), device="cuda", generator=gen).to(torch.bfloat16)
        jobs = {"x": (inp["x"], True, False), "dgu": (dgu, False, False), "h": (hh, False, False),
                "dy": (inp["dout"], True, True)}
        for job, (src, gather, scale) in jobs.items():
            outs = {name: moe_fp8_quant_colwise(src, r, "cuda_sm90", gather, scale, config=c) for name, c in CONFIGS.items()}
            same = all(compare_bits(a, b).equal for a, b in zip(outs["ws_128x4"], outs["triton_64x2"]))
            times = {name: [] for name in CONFIGS}
            for _ in range(3):
                for name, c in CONFIGS.items():
                    moe_fp8_quant_colwise(src, r, "cuda_sm90", gather, scale, config=c)
            for _ in range(15):
                for name, c in CONFIGS.items():
                    times[name].append(timed(lambda: moe_fp8_quant_colwise(src, r, "cuda_sm90", gather, scale, config=c)))
            elems = p * src.shape[1]
            row = {"preset": preset, "job": job, "P": p, "N": src.shape[1], "bits_equal": same}
            for name, ts in times.items():
                q = statistics.quantiles(ts, n=5)
                med = statistics.median(ts)
                row[name] = {"median_us": round(med, 1), "p20": round(q[0], 1), "p80": round(q[3], 1),
                             "GB_per_s_3B_per_elem": round(3 * elems / med / 1e3, 0)}
            row["speedup"] = round(row["triton_64x2"]["median_us"] / row["ws_128x4"]["median_us"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out / "colwise.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
