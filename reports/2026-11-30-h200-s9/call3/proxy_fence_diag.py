"""Call 3's diagnosis (run from the repository root of each tree with PYTHONPATH=<tree>):
    python proxy_fence_diag.py <tree name> 10
The FP8 weight gradient's Gluon kernel (variant "ws") at 128x128 and 128x64 against the Triton TMA tile, 10 repeats
per (stage, config, mode), BF16 out and main_grad += dW from zeros, at the GPU test's (2048, 1024, 768, 16, 4). Trees:
    new    commit 9a4cb96 (scale rows staged in shared memory by TMA, read by the consumers, slot handed back after
           they are used)
    old    commit 14bce48 (scales loaded from global memory; 128x128 spills)
    fence  new + fence_async_shared() before the consumer's arrive on the slot's free barrier
    kb1    new with KB_GROUP=1 (one MMA block in flight, not two)
Result (call3/rep.txt): new: 10 of 20 main_grad runs differ at 128x128 (none in BF16 mode, none at 128x64); old,
fence: none; kb1: 2 of 20. The fence went in (commit 058e538)."""
import json
import sys

import torch

from kernels.det_gemm import GemmConfig
from tests.test_moe_fp8_ws import _operands
from toolkit.contract import compare_bits

dev = torch.device("cuda")
tri = GemmConfig(64, 128, 128, 1, 4, 3, "tma")
tag = sys.argv[1]
runs, _, _ = _operands(dev, 2048, 1024, 768, 16, 4, seed=11)
for stage in ("wgrad_w1", "wgrad_w2"):
    run = runs[stage]
    ref = run(tri)
    z = torch.zeros(ref.shape, device=dev)
    run(tri, z)
    for cfg in (GemmConfig(128, 128, 128, 1, 8, 4, "ws"), GemmConfig(128, 64, 128, 1, 8, 6, "ws")):
        for mode in ("bf16", "zero"):
            bad = 0
            for _ in range(int(sys.argv[2])):
                if mode == "bf16":
                    bad += not compare_bits(run(cfg), ref).equal
                else:
                    o = torch.zeros(ref.shape, device=dev)
                    run(cfg, o)
                    bad += not compare_bits(o, z).equal
            print(json.dumps({"tree": tag, "stage": stage, "config": cfg.label(), "mode": mode, "bad": bad,
                              "runs": int(sys.argv[2])}), flush=True)
