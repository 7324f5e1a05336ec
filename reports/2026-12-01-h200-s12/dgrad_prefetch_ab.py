"""A/B in one process: the BF16 dgrad Gluon kernel with its epilogue's s and h loads issued before each tile's K
loop (kernels.moe_ws.DGRAD_PREFETCH True) or after it (False). Per preset: bits of dgu and the dscore partials
compared, the dgrad stage and the whole forward+backward timed in interleaved rounds (toolkit.timing).

    git checkout 97783b5   # the flag exists there only: it was removed after this A/B measured it slower
    python reports/2026-12-01-h200-s12/dgrad_prefetch_ab.py ROUNDS OUT.json
"""

import dataclasses
import json
import sys

import torch

import kernels.moe_ws as kws
from bench.moe import DATASHEET_BF16_TFLOPS, PRESETS
from bench.moe_sweep import make_case_inputs
from kernels.moe import moe_dgrad_dswiglu_dscore, moe_mlp_bwd, moe_mlp_fwd
from toolkit.contract import compare_bits
from toolkit.timing import time_interleaved


def flagged(flag: bool, fn):
    def run():
        kept = kws.DGRAD_PREFETCH
        kws.DGRAD_PREFETCH = flag
        try:
            return fn()
        finally:
            kws.DGRAD_PREFETCH = kept
    return run


def main(rounds: int, out_path: str) -> None:
    device = torch.device("cuda")
    rows = []
    for name, t in (("reference", 8192), ("qwen3-30b-a3b", 16384)):
        p = dataclasses.replace(PRESETS[name], t=t)
        inp = make_case_inputs(p, "uniform", device, 0)
        _, saved = moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])

        def dgrad():
            return moe_dgrad_dswiglu_dscore(inp["dout"], saved.w2, saved.gu, saved.h, saved.routing, saved.backend)

        def layer():
            out, s = moe_mlp_fwd(inp["x"], inp["w1"], inp["w2"], inp["topk_ids"], inp["scores"])
            g = moe_mlp_bwd(inp["dout"], s)
            return out, g.dx, g.dw1, g.dw2, g.dscores

        on, off = flagged(True, dgrad)(), flagged(False, dgrad)()
        bits = all(compare_bits(a, b).equal for a, b in zip(on, off))
        layer_bits = all(compare_bits(a, b).equal for a, b in zip(flagged(True, layer)(), flagged(False, layer)()))
        stage = time_interleaved({"prefetch": flagged(True, dgrad), "after": flagged(False, dgrad)}, device, rounds)
        whole = time_interleaved({"prefetch": flagged(True, layer), "after": flagged(False, layer)}, device, rounds)
        for what, tm in (("dgrad", stage), ("fwd_bwd", whole)):
            for variant, timing in tm.items():
                row = {"preset": name, "T": t, "measure": what, "variant": variant, "median_us": timing.median_us,
                       "p20_us": timing.p20_us, "p80_us": timing.p80_us, "sm_clock_mhz": timing.sm_clock_mhz,
                       "ratio_to_after": timing.median_us / tm["after"].median_us,
                       "bits_equal": bits if what == "dgrad" else layer_bits}
                if what == "fwd_bwd":
                    row["mfu_989"] = p.flops_fwd_bwd / (timing.median_us * 1e-6) / 1e12 / DATASHEET_BF16_TFLOPS
                rows.append(row)
                print(json.dumps(row))
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
