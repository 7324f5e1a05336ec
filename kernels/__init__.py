"""detkit's kernels, one sub-package per family: ``det_gemm`` (dense GEMMs), ``attention``, ``moe`` (BF16 and FP8),
``parallel`` (TP/CP operators, the invariant mode, the composed MLP, SwiGLU), ``reductions`` (row reductions); and the
plumbing they share: ``backend`` (backend resolution, launch plans, input checks) and ``bounds`` (the contract's error
bounds). Kernels never import the harness (toolkit, audits, bench) or detkit mode. Importing this package loads no
family: importing a kernel module fixes Triton's interpreter-or-compiler choice (docs/architecture.md).
"""
