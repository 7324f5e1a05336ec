"""Repeatability of the FP8 weight gradient's Gluon kernel (variant "ws", scales staged in shared memory) against the
pinned Triton tile: each config run many times in both output modes (BF16 dW, and main_grad += dW in FP32 from a
random and from a zero main_grad), every run compared bit for bit with the Triton kernel's, mismatches counted with
their largest difference. Run from the repository root on the GPU:
    python reports/2026-11-30-h200-s9/wgrad_repeat.py [repeats] [out.json]
"""

import json
import sys

import torch

from kernels.det_gemm import GemmConfig
from tests.moe_helpers import FP8_TRITON_TILES
from tests.test_moe_fp8_ws import _operands
from toolkit.contract import compare_bits

WS = [GemmConfig(128, 128, 128, 1, 8, 4, "ws"), GemmConfig(128, 128, 128, 1, 8, 5, "ws"),
      GemmConfig(128, 64, 128, 1, 8, 6, "ws")]


def main(repeats: int, out_path: str | None) -> None:
    dev = torch.device("cuda")
    pinned = FP8_TRITON_TILES["wgrad"]  # the Triton TMA tile, table .11's
    rows = []
    for shape in [(300, 512, 384, 5, 2), (2048, 1024, 768, 16, 4)]:  # the GPU test's shapes
        runs, _, _ = _operands(dev, *shape, seed=11)
        for stage in ("wgrad_w1", "wgrad_w2"):
            run = runs[stage]
            ref = run(pinned)
            bases = {"random": torch.randn(ref.shape, generator=torch.Generator().manual_seed(2)).to(dev),
                     "zero": torch.zeros(ref.shape, device=dev)}
            refs = {}
            for name, base in bases.items():
                refs[name] = base.clone()
                run(pinned, refs[name])
            for config in WS:
                for mode in ("bf16", "random", "zero"):
                    bad, worst, first = 0, 0.0, None
                    for _ in range(repeats):
                        if mode == "bf16":
                            out, want = run(config), ref
                        else:
                            out = bases[mode].clone()
                            run(config, out)
                            want = refs[mode]
                        cmp = compare_bits(out, want)
                        if not cmp.equal:
                            bad += 1
                            worst = max(worst, float((out.float() - want.float()).abs().max()))
                            first = first or (cmp.mismatches, cmp.first_mismatch)
                    rows.append({"shape": shape, "stage": stage, "config": config.label(), "mode": mode,
                                 "runs": repeats, "runs_with_mismatch": bad, "max_abs_diff": worst,
                                 "first": str(first)})
                    print(json.dumps(rows[-1]), flush=True)
        del runs
        torch.cuda.empty_cache()
    if out_path:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10, sys.argv[2] if len(sys.argv) > 2 else None)
