"""Compile det_gemm for sm_90 without a GPU and count the SASS instructions that matter (HGMMA vs HMMA,
cp.async LDGSTS vs TMA UTMALDG, shared-memory traffic), registers and shared memory per layout.
Compile-only evidence: it says which instructions the kernel uses, not how fast they run.

    python -m bench.gemm_sass [--out DIR]
"""
import argparse
import os
import re
import subprocess

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target, not the interpreter
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.det_gemm import det_gemm_kernel, select_config

def _cuobjdump(flag: str, cubin: str) -> str:
    """Triton's wheel carries cuobjdump; no CUDA toolkit or GPU needed."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return subprocess.run([tool, flag, cubin], capture_output=True, text=True, check=True).stdout


def build(op, b_kmajor, rows, tag, stride_b_unit):
    cfg = select_config(op, rows)
    sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "R": "i32", "C": "i32", "L": "i32",
           "stride_ar": "i32", "stride_al": "i32", "stride_bl": "i32", "stride_bc": "i32",
           "stride_cr": "i32", "stride_cc": "i32", "seg_len": "i32", "op_id": "i32",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "STEP_K": "constexpr",
           "GROUP_M": "constexpr", "INTERPRETED": "constexpr", "SEGMENTED": "constexpr", "OUT_FP32": "constexpr",
           "B_K_MAJOR": "constexpr"}
    constexprs = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "STEP_K": cfg.block_k,
                  "GROUP_M": cfg.group_m, "INTERPRETED": False, "SEGMENTED": False, "OUT_FP32": False,
                  "B_K_MAJOR": b_kmajor}
    # unit strides: A row-major (stride_al == 1), B unit stride on the contiguous dim, C row-major
    attrs = {}
    names = list(sig)
    unit = ["stride_al", stride_b_unit, "stride_cc"]
    for n in unit:
        constexprs[n] = 1
        sig[n] = "constexpr"
    for n in ["a_ptr", "b_ptr", "c_ptr"]:
        attrs[(names.index(n),)] = [["tt.divisibility", 16]]
    for n in ["R", "C", "L", "stride_ar", "stride_bl", "stride_bc", "stride_cr"]:
        if sig[n] != "constexpr":
            attrs[(names.index(n),)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=det_gemm_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    open(f"{OUT}/{tag}.cubin", "wb").write(k.asm["cubin"])
    open(f"{OUT}/{tag}.ttgir", "w").write(k.asm["ttgir"])
    sass = _cuobjdump("--dump-sass", f"{OUT}/{tag}.cubin")
    open(f"{OUT}/{tag}.sass", "w").write(sass)
    ops = {}
    for m in re.finditer(SASS_OPS, sass):
        ops[m.group(1)] = ops.get(m.group(1), 0) + 1
    res = _cuobjdump("--dump-resource-usage", f"{OUT}/{tag}.cubin")
    usage = re.search(r"REG:(\d+).*?SHARED:(\d+)", res, re.S)
    print(tag, cfg.label(), "REG", usage.group(1) if usage else "?", "smem", k.metadata.shared, ops, flush=True)

SASS_OPS = r"\b(HGMMA|HMMA|UTMALDG|LDGSTS|LDSM|LDS|STS|SHFL)[.\w]*"
# (op, B has its reduced dim contiguous, rows, tag, the unit-stride B argument)
CASES = [
    ("fwd", True, 4096, "fwd_weight_t", "stride_bl"),   # nn.Linear weight.t(): K-major B
    ("fwd", False, 4096, "fwd_weight_kn", "stride_bc"),
    ("da", False, 4096, "da_weight_t", "stride_bc"),
    ("da", True, 4096, "da_weight_kn", "stride_bl"),
]

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/sass")
    OUT = parser.parse_args().out
    os.makedirs(OUT, exist_ok=True)
    for case in CASES:
        build(*case)
