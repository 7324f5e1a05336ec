"""det_gemm: deterministic, batch-invariant BF16, FP16 and FP32 GEMMs for Hopper (forward, dA, dB).

Inside: ``configs`` (the pinned config table), ``kernels`` (the Triton kernels and their tile math), ``ws`` (the
warp-specialized Gluon kernel), ``fma`` (the Gluon FP32 "ieee" kernel on register micro-tiles), ``names`` (launch
names shared with NVTX ranges and report rows), ``launch`` (checks, launch plans and the launch wrappers),
``reference`` (the pure-torch references).
"""

from detkit.kernels.det_gemm.launch import (
    det_gemm_da, det_gemm_da_launch, det_gemm_db, det_gemm_db_launch, det_gemm_fwd, det_gemm_fwd_launch,
)
from detkit.kernels.det_gemm.reference import det_gemm_da_ref, det_gemm_db_ref, det_gemm_fwd_ref

__all__ = ["det_gemm_fwd", "det_gemm_da", "det_gemm_db", "det_gemm_fwd_launch", "det_gemm_da_launch",
           "det_gemm_db_launch", "det_gemm_fwd_ref", "det_gemm_da_ref", "det_gemm_db_ref"]
