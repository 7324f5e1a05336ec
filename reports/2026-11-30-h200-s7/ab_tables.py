"""A/B of MoE config tables in one process (the same clocks for all): forward+backward of the BF16 MoE layer with
the grouped stages of MoE table 2026-11-29.2 (Triton TMA tiles), 2026-11-30.3 (down and dX on the Gluon ws kernel)
and 2026-11-30.4 (dgrad too), timed in interleaved rounds (toolkit.timing.time_interleaved), each table's outputs
checked bit-equal to the first's. Run from the repository root on the GPU:
    python reports/2026-11-30-h200-s7/ab_tables.py [rounds]
"""

import dataclasses
import json
import sys

import torch

import kernels.moe as km
from bench.moe import PRESETS
from bench.moe_sweep import make_case_inputs
from kernels.det_gemm import GemmConfig
from toolkit.contract import compare_bits
from toolkit.timing import time_interleaved

TMA = {"down": GemmConfig(128, 128, 64, 1, 8, 3, "tma"), "dgrad": GemmConfig(128, 128, 64, 1, 8, 4, "tma"),
       "dx": GemmConfig(128, 128, 64, 1, 8, 3, "tma")}
WS = GemmConfig(128, 128, 64, 1, 8, 4, "ws")
TABLES = {"2026-11-29.2": TMA, "2026-11-30.3": {**TMA, "down": WS, "dx": WS},
          "2026-11-30.4": {"down": WS, "dgrad": WS, "dx": WS}}


def with_table(stages, fn):
    def run():
        table = km.MOE_CONFIGS["cuda_sm90"]
        kept = dict(table)
        table.update(stages)
        try:
            return fn()
        finally:
            table.clear()
            table.update(kept)
    return run


def main(rounds: int) -> None:
    device = torch.device("cuda")
    out = []
    for name, t in (("reference", 8192), ("qwen3-30b-a3b", 16384)):
        p = dataclasses.replace(PRESETS[name], t=t)
        inp = make_case_inputs(p, "uniform", device, 0)

        def fwd_bwd():
            o, saved = km.moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])
            g = km.moe_mlp_bwd(inp["dout"], saved)
            return (o, g.dx, g.dw1, g.dw2, g.dscores)

        fns = {v: with_table(stages, fwd_bwd) for v, stages in TABLES.items()}
        results = {v: fn() for v, fn in fns.items()}
        first = results["2026-11-29.2"]
        equal = {v: all(compare_bits(a, b).equal for a, b in zip(r, first)) for v, r in results.items()}
        timings = time_interleaved(fns, device, rounds=rounds)
        for v, tm in timings.items():
            row = {"preset": name, "T": t, "table": v, "bits_equal_to_2026-11-29.2": equal[v],
                   **{k: getattr(tm, k) for k in ("median_us", "p20_us", "p80_us", "sm_clock_mhz")}}
            out.append(row)
            print(json.dumps(row))
    print(json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
