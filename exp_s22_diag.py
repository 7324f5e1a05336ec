"""One-off H200 diagnosis (session 22): where the Gluon column-wise quantizer's codes or scales differ from the
Triton kernel's on the bits test's special inputs. Usage: python exp_s22_diag.py"""

import torch

from detkit.kernels.moe_fp8 import moe_fp8_quant_colwise
from tests.test_moe_fp8_ws import COLWISE_TRITON, COLWISE_WS, _colwise_sources

x, r = _colwise_sources(torch.device("cuda"))
for gather, scale in ((True, False), (False, False), (True, True)):
    src = x if gather else x.repeat(-(-r.padded_rows // x.shape[0]), 1)[: r.padded_rows]
    got = moe_fp8_quant_colwise(src, r, "cuda_sm90", gather=gather, scale=scale, config=COLWISE_WS)
    ref = moe_fp8_quant_colwise(src, r, "cuda_sm90", gather=gather, scale=scale, config=COLWISE_TRITON)
    dq = (got[0].view(torch.uint8) != ref[0].view(torch.uint8)).nonzero()
    ds = (got[1].view(torch.int32) != ref[1].view(torch.int32)).nonzero()
    print(gather, scale, "code mismatches", dq.shape[0], "scale mismatches", ds.shape[0])
    for n, p in dq[:8].tolist():
        print("  q", n, p, hex(got[0].view(torch.uint8)[n, p].item()), hex(ref[0].view(torch.uint8)[n, p].item()),
              "src", (src[r.gather_token[p]] if gather else src[p])[n].item(), "scale", got[1][n, p // 128].item(),
              ref[1][n, p // 128].item())
    for n, b in ds[:8].tolist():
        print("  s", n, b, got[1][n, b].item(), ref[1][n, b].item())
