"""Offline sm_90 compiles of the attention kernels (no GPU needed): registers, spills, shared memory and the SASS
counts of wgmma, mma.sync and cp.async for a config, as tests/test_attention.py checks the pinned tiles and the
attention sweep screens its candidates.

    python -c "from tools.attention_sass import compile_sm90; ..."   (in a process without TRITON_INTERPRET)
"""

from __future__ import annotations

from tools.gemm_sass import cuobjdump_bytes, stack_bytes

_POINTERS = {"lse_ptr": "*fp32", "delta_ptr": "*fp32", "kv_start_ptr": "*i32", "kv_end_ptr": "*i32",
             "ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32", "ws_acc_ptr": "*fp32", "block_table_ptr": "*i32"}


def compile_sm90(kernel: str, config, head_dim: int, heads: int = 4, varlen: bool = False,
                 kv_start: bool = True, kv_end: bool = False, windowed: bool = False, softcap: bool = False,
                 sinks: bool = False, split_grid: bool = False, split_tiers: tuple | None = None,
                 num_warps: int | None = None, page_size: int | None = None, dim_qk: int | None = None,
                 dim_v: int | None = None, tile_page: bool = False, early_pages: bool = False,
                 prefetch_pages: bool = False) -> dict:
    """Compile one attention kernel ("fwd", "fwd_combine", "dkdv", "dq") with ``config`` for sm_90 with Triton's bundled
    ptxas, without a GPU: registers, stack (spills), shared memory and the SASS counts of wgmma (HGMMA), mma.sync (HMMA)
    and cp.async (LDGSTS). ``split_grid``: the forward's split-grid build (one split per program, partials stored)
    rather than its one-pass build; ``split_tiers``: the split table (the sm_90 table's SPLIT_TIERS); ``num_warps``:
    other than the config's (the combine pass runs launch.COMBINE_WARPS, on launch.combine_rows rows); ``page_size``:
    the forward's paged-KV build (K/V through a block table; varlen queries); ``tile_page``: its build with one table
    entry a page a key tile touches (``AttnConfigs.paged_tile_page``; a page size that block_n divides or that divides
    it), ``early_pages``: with the first tile's entries read early (``AttnConfigs.paged_early_pages``),
    ``prefetch_pages``: each tile's entries read one tile ahead (``AttnConfigs.paged_prefetch_pages``); ``dim_qk`` /
    ``dim_v``: the forward's (and combine pass's) build for head dims narrower than ``head_dim``, read by masked loads
    (MLA's 192 / 128 on 256; None: ``head_dim``, the native build). Run in a process without TRITON_INTERPRET."""
    import re
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import detkit.kernels.attention.kernels as attn
    from detkit.kernels.attention.configs import SPLIT_TIERS
    from detkit.kernels.attention.launch import combine_rows, split_constexprs, tile_pages
    from detkit.kernels.backend import kernel_is_interpreted

    fn = {"fwd": attn.attention_fwd_kernel, "fwd_combine": attn.attention_fwd_combine_kernel,
          "dkdv": attn.attention_bwd_dkdv_kernel, "dq": attn.attention_bwd_dq_kernel}[kernel]
    if kernel_is_interpreted(fn):
        raise RuntimeError("detkit kernels were imported under TRITON_INTERPRET=1; compile in a process without it")
    names = list(fn.arg_names)
    dim_qk, dim_v = dim_qk or head_dim, dim_v or head_dim
    consts = {"HEAD_DIM": head_dim, "DIM_QK": dim_qk, "DIM_V": dim_v, "BLOCK_M": config.block_m,
              "BLOCK_N": config.block_n, "HEADS": heads,
              "INTERPRETED": False, "VARLEN": varlen, "HAS_KV_START": kv_start, "HAS_KV_END": kv_end,
              "WINDOWED": windowed, "SOFTCAP": softcap, "HAS_SINKS": sinks,
              **split_constexprs(split_tiers or SPLIT_TIERS), "SPLIT_GRID": split_grid, "PAGED": page_size is not None,
              "PAGE_SIZE": page_size or 1,
              "TILE_PAGES": tile_pages(tile_page and page_size is not None, config.block_n, page_size or 1)}
    consts["EARLY_PAGES"] = bool(consts["TILE_PAGES"]) and early_pages and not windowed  # as launch._fwd_tail sets it
    consts["PREFETCH_PAGES"] = bool(consts["TILE_PAGES"]) and prefetch_pages
    if kernel == "fwd_combine":  # the combine pass's own rows per program, not the forward tile's
        consts["BLOCK_M"] = combine_rows(heads)
    if page_size is not None:
        consts.update(VARLEN=True, HAS_KV_START=False, HAS_KV_END=False)
    # HAS_SINKS, SPLIT_GRID, PAG*, DIM_QK: the forward only; DIM_V, SPLIT_E*/N*: the forward and the combine pass
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    if (dim_qk, dim_v) != (head_dim, head_dim) and "DIM_V" not in consts:
        raise ValueError(f"the {kernel} kernel has no masked head dims; dim_qk / dim_v are the forward's")
    sig = {n: "constexpr" if n in consts else ("fp32" if n in ("qk_scale", "scale", "tanh_scale") else
                                              _POINTERS.get(n, "*bf16" if n.endswith("_ptr") else "i32"))
           for n in names}
    # What a launch at the real shapes specialises: 16-byte-aligned tensors, strides multiples of 16.
    aligned = [n for n in names if sig[n] not in ("constexpr", "fp32") and n not in attn._NOT_SPECIALIZED_PAGED
               and (n.endswith("_ptr") or n.startswith("stride"))]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps or config.num_warps, "num_stages": config.num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        sass = cuobjdump_bytes("--dump-sass", compiled.asm["cubin"], tmp)
        resources = cuobjdump_bytes("--dump-resource-usage", compiled.asm["cubin"], tmp)
    regs = re.search(r"REG:(\d+)", resources)
    return {"kernel": kernel, "head_dim": head_dim, "config": config.label(),
            "variant": "+".join(n for n, on in (("window", windowed), ("softcap", softcap), ("sinks", sinks),
                                                ("split_grid", split_grid), (f"paged{page_size}", page_size),
                                                ("tile_page", tile_page), ("early_pages", early_pages),
                                                (f"qk{dim_qk}v{dim_v}", (dim_qk, dim_v) != (head_dim, head_dim)))
                                if on),
            "regs": int(regs.group(1)) if regs else None,
            "stack_bytes": stack_bytes(resources), "shared_bytes": compiled.metadata.shared,
            **{op: len(re.findall(rf"\b{op}", sass)) for op in ("HGMMA", "HMMA", "LDGSTS")}}
