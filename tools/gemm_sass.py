"""Compile det_gemm for sm_90 without a GPU and count the SASS instructions that matter (HGMMA vs HMMA,
cp.async LDGSTS vs TMA UTMALDG, shared-memory traffic, FP32 FFMA vs FMUL / FADD), registers and shared memory per
layout and kernel variant ("ptr": det_gemm_kernel; "tma": det_gemm_tma_kernel; "tma3": det_gemm_tma3_kernel; "ws":
kernels/det_gemm/ws.py, Gluon; "fma": kernels/det_gemm/fma.py, Gluon, FP32 "ieee").
Compile-only evidence: it says which instructions the kernel uses, not how fast they run.

    python -m tools.gemm_sass [--out DIR] [--variants ptr tma] [--cases fwd_weight_t ...] [--json]   # checkout root
    python -m tools.gemm_sass --variants fma --precision ieee   # every "fma" candidate (configs.fma_candidates)

For FP32 "ieee" rows, ``ffma_per_lds`` is FFMA over shared-memory loads (LDS and LDSM, any width) in the whole
kernel: the main loop holds all of the FFMA and all but a few of the loads, so it is the loop's ratio, which sets
how many issue slots the loads take from the fused multiply-adds.

The compile gets the specialisation a real launch on the Qwen3-8B shapes gets: 16-byte-aligned
pointers, sizes and outer strides divisible by 16, unit inner strides as constants.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, replace

SASS_OP_NAMES = ("HGMMA", "HMMA", "UTMALDG", "UTMASTG", "LDGSTS", "LDSM", "LDS", "STS", "SHFL", "USETMAXREG", "FFMA",
                 "FMUL", "FADD")
SASS_OPS = rf"\b({'|'.join(SASS_OP_NAMES)})[.\w]*"


@dataclass(frozen=True)
class SassCase:
    op: str  # fwd, da, db
    tag: str  # the weight layout, as the caller passes it
    a_m_major: bool  # the kernel's A [R, L] has its row dim contiguous (dB's a.T)
    b_k_major: bool  # the kernel's B [L, C] has its reduced dim contiguous
    rows: int = 4096  # picks the table entry
    cols: int = 6144  # the output's width (the ws epilogue stores by TMA when its rows are 16-byte aligned)

    @property
    def name(self) -> str:
        return f"{self.op}_{self.tag}"


# (op, layout tag, A M-major, B K-major): fwd/dA on both weight layouts, and dB (A = a.T is M-major).
CASES = (
    SassCase("fwd", "weight_t", False, True),  # nn.Linear weight.t(): K-major B
    SassCase("fwd", "weight_kn", False, False),
    SassCase("da", "weight_t", False, False),  # b.t() of weight.t() is the [N, K] weight: N-major for the kernel
    SassCase("da", "weight_kn", False, True),  # [K, N] weight: K-major B for the kernel
    SassCase("db", "a_dc", True, False),
)


def cuobjdump(flag: str, cubin: str) -> str:
    """``cuobjdump flag cubin`` (a file path). Triton's wheel carries cuobjdump; no CUDA toolkit or GPU needed."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return subprocess.run([tool, flag, cubin], capture_output=True, text=True, check=True).stdout


def cuobjdump_bytes(flag: str, cubin: bytes, tmp_dir: str) -> str:
    """``cuobjdump`` on a compiled kernel's ``asm["cubin"]``, through a temporary file in ``tmp_dir``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", dir=tmp_dir) as f:
        f.write(cubin)
        f.flush()
        return cuobjdump(flag, f.name)


def dump_and_count(kernel, out_dir: str, tag: str) -> tuple[str, dict, str]:
    """Write a compiled kernel's cubin, TTGIR and SASS under ``out_dir`` as ``tag``.*; return its SASS, the count of
    each of SASS_OP_NAMES in it, and cuobjdump's resource usage."""
    cubin = os.path.join(out_dir, f"{tag}.cubin")
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    with open(os.path.join(out_dir, f"{tag}.ttgir"), "w") as f:
        f.write(kernel.asm["ttgir"])
    sass = cuobjdump("--dump-sass", cubin)
    with open(os.path.join(out_dir, f"{tag}.sass"), "w") as f:
        f.write(sass)
    counts = dict.fromkeys(SASS_OP_NAMES, 0)
    for m in re.finditer(SASS_OPS, sass):
        counts[m.group(1)] += 1
    return sass, counts, cuobjdump("--dump-resource-usage", cubin)


def registers(resources: str) -> int | None:
    """Registers per thread from cuobjdump's resource usage."""
    usage = re.search(r"REG:(\d+)", resources)
    return int(usage.group(1)) if usage else None


def stack_bytes(resources: str) -> int | None:
    """Per-thread stack from ``--dump-resource-usage`` output: > 0 means register spills."""
    stack = re.search(r"STACK:(\d+)", resources)
    return int(stack.group(1)) if stack else None


def gluon_desc_type(rows: int, cols: int, dtype) -> str:
    """The signature type of a Gluon TMA descriptor argument with box [rows, cols] of ``dtype`` (a gl dtype) and
    its default NVMMA shared layout."""
    from triton.experimental.gluon import language as gl

    name = {"int32": "i32", "int16": "i16"}.get(str(dtype), str(dtype))
    return f"tensordesc<{name}[{rows}, {cols}],{gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)!r}>"


def gluon_sm90_report(fn, types: dict[str, str], consts: dict, maxnreg: int) -> dict:
    """Compile the Gluon kernel ``fn`` for sm_90 offline (Triton's bundled ptxas and cuobjdump, no GPU): arguments
    typed by ``types`` (others i32, assumed multiples of 16), ``consts`` as constexprs, one 4-warp default partition
    and the launch's register cap ``maxnreg``. Returns SASS counts (QGMMA / HGMMA: FP8 / BF16 wgmma; UTMALDG /
    UTMASTG: TMA loads / stores; USETMAXREG; LDGSTS: cp.async; 16-byte global loads and stores; shared-memory loads
    and stores), the stack frame (spills), the PTX's one-in-flight
    wgmma waits, shared bytes, and whether ``ptxas -v`` reports serialized wgmma ("Performance Loss")."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(fn.arg_names)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n] != "constexpr" and not sig[n].startswith("tensordesc") and n != "op_id"}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    # Triton runs ptxas with -v and prints its log when asked: the log of the build itself, not of a second ptxas run.
    log = io.StringIO()
    with triton.knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        triton.knobs.nvidia.dump_ptxas_log = True
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": maxnreg})
    info = log.getvalue()
    with tempfile.TemporaryDirectory() as d:
        sass = cuobjdump_bytes("--dump-sass", k.asm["cubin"], d)
        stack = stack_bytes(cuobjdump_bytes("--dump-resource-usage", k.asm["cubin"], d))
        if "Compiling entry function" not in info:  # a cache hit ran no ptxas: assemble the PTX again for its log
            ptx_file = os.path.join(d, "k.ptx")
            with open(ptx_file, "w") as f:
                f.write(k.asm["ptx"])
            ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
            info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx_file, "-o", os.path.join(d, "k.cubin")],
                                  capture_output=True, text=True).stderr
    count = {key: len(re.findall(rf"\b{op}", sass)) for key, op in (
        ("qgmma", "QGMMA"), ("hgmma", "HGMMA"), ("tma", "UTMALDG"), ("tma_store", "UTMASTG"),
        ("setmaxnreg", "USETMAXREG"), ("ldgsts", "LDGSTS"), ("ldg128", r"LDG\.E\.128"), ("stg128", r"STG\.E\.128"),
        ("shared_ld_st", r"(?:LDS|STS)\b"))}
    return {**count, "stack": stack, "wait1": k.asm["ptx"].count("wgmma.wait_group.sync.aligned 1;"),
            "shared": k.metadata.shared, "serialized": "Performance Loss" in info}


def dot_precisions(ttgir: str) -> list[str]:
    """The input precisions of a TTGIR's ``tt.dot`` ops (the attribute is printed only when not "ieee")."""
    found = (re.search(r"inputPrecision = (\w+)", line) for line in re.findall(r"tt\.dot [^\n]*", ttgir))
    return sorted({m.group(1) if m else "ieee" for m in found})


def _signature(case: SassCase, cfg, segmented: bool = False, out_fp32: bool = False,
               twin: bool = False, precision: str = "bf16") -> tuple[object, dict, dict]:
    """(kernel, signature, constexprs) of one launch of ``case`` with ``cfg``; ``precision``: the kernels'
    PRECISION ("bf16" / "fp16": those operands, an output of their dtype unless ``out_fp32``; "ieee" / "tf32": FP32
    operands and an FP32 output)."""
    from detkit.kernels.det_gemm.launch import det_gemm_kernel, det_gemm_tma3_kernel, det_gemm_tma_kernel

    operand = precision if precision in ("bf16", "fp16") else "fp32"
    out_fp32 = out_fp32 or operand == "fp32"
    consts = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "STEP_K": cfg.block_k,
              "GROUP_M": cfg.group_m, "INTERPRETED": False, "SEGMENTED": segmented, "OUT_FP32": out_fp32,
              "TWIN": twin, "B_K_MAJOR": case.b_k_major, "PRECISION": precision,
              "OUT_FP16": operand == "fp16" and not out_fp32}
    c_type = "*fp32" if out_fp32 else f"*{operand}"
    if cfg.variant == "fma":
        from triton.experimental.gluon import language as gl

        from detkit.kernels.det_gemm.configs import fma_micro_tile
        from detkit.kernels.det_gemm.fma import det_gemm_fma_kernel

        if segmented or precision != "ieee":
            raise ValueError(f"variant 'fma' compiles for FP32 'ieee' operands with one segment; got precision "
                             f"{precision!r}, segmented={segmented}")
        fn = det_gemm_fma_kernel
        a_box = [cfg.block_k, cfg.block_m] if case.a_m_major else [cfg.block_m, cfg.block_k]
        b_box = [cfg.block_n, cfg.block_k] if case.b_k_major else [cfg.block_k, cfg.block_n]
        ptrs = {"a_desc": gluon_desc_type(*a_box, gl.float32), "b_desc": gluon_desc_type(*b_box, gl.float32),
                "c_ptr": "*fp32", "twin_ptr": "*fp32"}
        micro_m, micro_n, warps_m = fma_micro_tile(cfg.block_m, cfg.block_n, cfg.num_warps)
        consts = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m,
                  "STAGES": cfg.num_stages, "MICRO_M": micro_m, "MICRO_N": micro_n, "WARPS_M": warps_m,
                  "TWIN": twin, "A_M_MAJOR": case.a_m_major, "B_K_MAJOR": case.b_k_major, "PRECISION": "ieee",
                  "stride_cc": 1}
    elif cfg.variant == "ws":
        from triton.experimental.gluon import language as gl

        from detkit.kernels.det_gemm.ws import consumers, det_gemm_ws_kernel, operand_layout, ws_tma_store

        if segmented:
            raise ValueError("variant 'ws' has no segmented form")
        fn = det_gemm_ws_kernel
        a_box = [cfg.block_k, cfg.block_m] if case.a_m_major else [cfg.block_m, cfg.block_k]
        b_box = [cfg.block_n, cfg.block_k] if case.b_k_major else [cfg.block_k, cfg.block_n]
        c_box = [cfg.block_m // consumers(cfg.num_warps), cfg.block_n]
        c_desc = gluon_desc_type(*c_box, gl.float32 if out_fp32 else gl.bfloat16)
        ptrs = {"a_desc": f"tensordesc<bf16{a_box},{operand_layout(a_box)!r}>",
                "b_desc": f"tensordesc<bf16{b_box},{operand_layout(b_box)!r}>", "c_ptr": c_type, "twin_ptr": c_type,
                "c_desc": c_desc, "twin_desc": c_desc}
        # The launcher's epilogue choice at the case's output width.
        tma_store = ws_tma_store(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages, case.cols,
                                 4 if out_fp32 else 2)
        consts = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m,
                  "STAGES": cfg.num_stages, "OUT_FP32": out_fp32, "TWIN": twin, "A_M_MAJOR": case.a_m_major,
                  "B_K_MAJOR": case.b_k_major, "CONSUMERS": consumers(cfg.num_warps), "TMA_STORE": tma_store,
                  "stride_cc": 1}
    elif cfg.variant in ("tma", "tma3"):
        fn = det_gemm_tma_kernel if cfg.variant == "tma" else det_gemm_tma3_kernel
        a_box = [cfg.block_k, cfg.block_m] if case.a_m_major else [cfg.block_m, cfg.block_k]
        b_box = [cfg.box_n, cfg.block_k] if case.b_k_major else [cfg.block_k, cfg.box_n]
        ptrs = {"a_desc": f"tensordesc<{operand}{a_box}>", "b_desc": f"tensordesc<{operand}{b_box}>", "c_ptr": c_type,
                "twin_ptr": c_type}
        consts.update(A_M_MAJOR=case.a_m_major, stride_cc=1)
    else:
        fn = det_gemm_kernel
        ptrs = {"a_ptr": f"*{operand}", "b_ptr": f"*{operand}", "c_ptr": c_type, "twin_ptr": c_type}
        # unit strides: A on its contiguous dim, B on its contiguous dim, C row-major
        consts.update({"stride_ar" if case.a_m_major else "stride_al": 1,
                       "stride_bl" if case.b_k_major else "stride_bc": 1, "stride_cc": 1})
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    return fn, sig, consts


def build(case: SassCase, variant: str, out_dir: str, config=None, segmented: bool = False,
          out_fp32: bool = False, twin: bool = False, precision: str = "bf16") -> dict:
    """Compile ``case`` for sm_90 with ``config`` (default: the table's pick) as ``variant`` (and the
    epilogue / segmentation flags of the invariant mode and the TP/CP operators); write
    cubin/ttgir/sass; count."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from detkit.kernels.backend import kernel_is_interpreted
    from detkit.kernels.det_gemm.launch import select_config

    cfg = replace(config or select_config(case.op, case.rows), variant=variant)
    fn, sig, consts = _signature(case, cfg, segmented, out_fp32, twin, precision)
    if kernel_is_interpreted(fn):
        raise RuntimeError("detkit kernels were imported under TRITON_INTERPRET=1; compile in a process without it")
    names = list(fn.arg_names)
    # 16-divisible pointers and sizes (op_id and seg_len excepted), as the specialiser marks a real launch.
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n] != "constexpr" and not sig[n].startswith("tensordesc") and n not in ("op_id", "seg_len")}
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.variant == "ws":  # Gluon: the kernel places its own pipeline; the launch caps registers per thread
        from triton.experimental.gluon._runtime import GluonASTSource

        from detkit.kernels.det_gemm.ws import max_regs

        source, options = GluonASTSource, {"num_warps": 4, "maxnreg": max_regs(cfg.num_warps)}
    elif cfg.variant == "fma":  # Gluon: its own ring; the launch's options
        from triton.experimental.gluon._runtime import GluonASTSource

        from detkit.kernels.det_gemm.fma import fma_options

        source, options = GluonASTSource, fma_options(cfg.num_warps)
    else:
        source = ASTSource
    src = source(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    tag = f"{case.name}_{variant}" if config is None else f"{case.name}_{cfg.label()}"
    tag += "".join(f"_{flag}" for flag, on in (("seg", segmented), ("fp32", out_fp32), ("twin", twin)) if on)
    tag += {"bf16": "", "fp16": "_in_fp16"}.get(precision, f"_in_fp32_{precision}")
    sass, counts, resources = dump_and_count(kernel, out_dir, tag)
    counts["LDS128"] = len(re.findall(r"\bLDS\.128\b", sass))
    shared_loads = counts["LDS"] + counts["LDSM"]
    return {"case": tag, "op": case.op, "layout": case.tag, "variant": variant, "config": cfg.label(),
            "regs": registers(resources), "stack_bytes": stack_bytes(resources),
            "shared_bytes": kernel.metadata.shared, **counts,
            "dot_precisions": dot_precisions(kernel.asm["ttgir"]),
            "ffma_per_lds": counts["FFMA"] / shared_loads if shared_loads else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/sass")
    parser.add_argument("--variants", nargs="+", default=["ptr", "tma"], choices=["ptr", "tma", "fma"],
                        help="fma: every configs.fma_candidates tile (FP32 operands: with --precision ieee)")
    parser.add_argument("--cases", nargs="+", default=[c.name for c in CASES], choices=[c.name for c in CASES])
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "ieee", "tf32"],
                        help="bf16 / fp16: those operands; ieee / tf32: FP32 operands and their products' precision")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target, not the interpreter
    os.makedirs(args.out, exist_ok=True)
    if "fma" in args.variants and args.precision != "ieee":
        parser.error("--variants fma compiles FP32 'ieee' operands: pass --precision ieee")
    from detkit.kernels.det_gemm.configs import fma_candidates

    rows = [build(case, variant, args.out, config=config, precision=args.precision)
            for variant in args.variants for config in (fma_candidates() if variant == "fma" else (None,))
            for case in CASES if case.name in args.cases]
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    if args.json:
        print(json.dumps(rows))
        return
    for r in rows:
        fp32 = "" if r["ffma_per_lds"] is None else (f" FFMA {r['FFMA']} FMUL {r['FMUL']} FADD {r['FADD']} "
                                                      f"FFMA/LDS {r['ffma_per_lds']:.1f} stack {r['stack_bytes']}")
        print(f"{r['case']:22s} {r['config']:32s} REG {r['regs']} smem {r['shared_bytes'] // 1024} KiB "
              f"HGMMA {r['HGMMA']} HMMA {r['HMMA']} UTMALDG {r['UTMALDG']} LDGSTS {r['LDGSTS']} "
              f"LDSM {r['LDSM']} LDS {r['LDS']} STS {r['STS']} SHFL {r['SHFL']}{fp32}", flush=True)


if __name__ == "__main__":
    main()
