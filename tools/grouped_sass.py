"""Compile the grouped GEMM family (kernels/grouped) for sm_90 without a GPU and count the SASS instructions that
matter: wgmma (HGMMA) vs mma.sync (HMMA), TMA loads (UTMALDG) vs cp.async (LDGSTS), shared-memory traffic (LDS, STS,
LDSM), registers, the stack frame (spills) and shared memory, per op, layout and variant ("ptr": the pointer kernels;
"tma": the TMA kernels). Compile-only evidence: which instructions the kernels use, not how fast they run.

    python -m tools.grouped_sass [--out DIR] [--variants ptr tma] [--cases mm_nt mm_nn wgrad_tn] [--json]

The compile gets the specialisation a launch at MoE widths gets: 16-byte-aligned pointers, sizes and outer strides
divisible by 16 (the group count and the tile bound not), unit inner strides as constants; the table's sm_90 config
of each (op, layout) with its variant replaced, E = 64 groups.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, replace

from tools.gemm_sass import dump_and_count, registers, stack_bytes


@dataclass(frozen=True)
class GroupedSassCase:
    op: str  # mm, wgrad
    layout: str  # the table's layout key: A's then B's storage order ("n": last dim contiguous, "t": transposed)
    groups: int = 64

    @property
    def name(self) -> str:
        return f"{self.op}_{self.layout}"


# transformers' forward (x @ W.transpose), grad_input (grad @ W) and grad_weight (grad.T @ x).
CASES = (GroupedSassCase("mm", "nt"), GroupedSassCase("mm", "nn"), GroupedSassCase("wgrad", "tn"))


def _signature(case: GroupedSassCase, cfg) -> tuple[object, dict, dict]:
    """(kernel, signature, constexprs) of a launch of ``case`` with ``cfg``."""
    import triton

    from detkit.kernels.grouped.kernels import (
        grouped_mm_kernel, grouped_mm_tma_kernel, grouped_wgrad_kernel, grouped_wgrad_tma_kernel,
    )

    a_t, b_t = case.layout[0] == "t", case.layout[1] == "t"
    if cfg.variant == "tma":
        from detkit.kernels.grouped.launch import TMA_ORDERS

        if case.layout[0] not in TMA_ORDERS[case.op, "a"] or case.layout[1] not in TMA_ORDERS[case.op, "b"]:
            raise ValueError(f"the TMA kernel of {case.op!r} takes no layout {case.layout!r}")
    consts = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
              "G_POW2": triton.next_power_of_2(case.groups + 1), "INTERPRETED": False}
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if case.op == "mm":
        consts["GROUP_M"] = cfg.group_m
        if cfg.variant == "tma":
            fn = grouped_mm_tma_kernel
            types = {"a_desc": f"tensordesc<bf16{[bm, bk]}>",
                     "b_desc": f"tensordesc<bf16{[1, bn, bk] if b_t else [1, bk, bn]}>"}
            consts.update(B_K_MAJOR=b_t, stride_cn=1)
        else:
            if a_t:
                raise ValueError("the pointer kernel's compile cases take a row-major A")
            fn = grouped_mm_kernel
            types = {"a_ptr": "*bf16", "b_ptr": "*bf16"}
            consts.update(B_K_MAJOR=b_t, stride_ak=1, stride_cn=1, **{"stride_bk" if b_t else "stride_bn": 1})
    else:
        types = {"a_ptr": "*bf16", "b_ptr": "*bf16"}
        consts.update({"stride_ap" if a_t else "stride_ar": 1, "stride_br" if b_t else "stride_bq": 1,
                       "stride_cq": 1})
        if cfg.variant == "tma":  # A's storage [R, P], B [R, Q]
            fn = grouped_wgrad_tma_kernel
            types.update({"a_desc": f"tensordesc<bf16{[bk, bm]}>", "b_desc": f"tensordesc<bf16{[bk, bn]}>"})
        else:
            fn = grouped_wgrad_kernel
    types.update(c_ptr="*bf16", offs_ptr="*i32")
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    return fn, sig, consts


def build(case: GroupedSassCase, variant: str, out_dir: str, config=None) -> dict:
    """Compile ``case`` for sm_90 with ``config`` (default: the table's pick for its op and layout) as ``variant``;
    write cubin / ttgir / sass; count."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from detkit.kernels.backend import CUDA_SM90, kernel_is_interpreted
    from detkit.kernels.grouped.configs import select_config

    cfg = replace(config or select_config(case.op, CUDA_SM90, case.layout), variant=variant)
    fn, sig, consts = _signature(case, cfg)
    if kernel_is_interpreted(fn):
        raise RuntimeError("detkit kernels were imported under TRITON_INTERPRET=1; compile in a process without it")
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n] != "constexpr" and not sig[n].startswith("tensordesc") and n not in ("G", "TILES")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    tag = f"{case.name}_{cfg.label()}"
    _, counts, resources = dump_and_count(kernel, out_dir, tag)
    return {"case": tag, "op": case.op, "layout": case.layout, "variant": variant, "config": cfg.label(),
            "regs": registers(resources), "stack_bytes": stack_bytes(resources),
            "shared_bytes": kernel.metadata.shared, **counts}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/grouped_sass")
    parser.add_argument("--variants", nargs="+", default=["ptr", "tma"], choices=["ptr", "tma"])
    parser.add_argument("--cases", nargs="+", default=[c.name for c in CASES], choices=[c.name for c in CASES])
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target, not the interpreter
    os.makedirs(args.out, exist_ok=True)
    rows = [build(case, variant, args.out) for variant in args.variants for case in CASES if case.name in args.cases]
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    if args.json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(f"{r['case']:36s} REG {r['regs']} stack {r['stack_bytes']} smem {r['shared_bytes'] // 1024} KiB "
              f"HGMMA {r['HGMMA']} HMMA {r['HMMA']} UTMALDG {r['UTMALDG']} LDGSTS {r['LDGSTS']} "
              f"LDSM {r['LDSM']} LDS {r['LDS']} STS {r['STS']} SHFL {r['SHFL']}", flush=True)


if __name__ == "__main__":
    main()
