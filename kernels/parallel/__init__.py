"""Parallel: the Qwen3-8B TP=2 x CP=2 reduction operators (both sides of each reduction exposed), the opt-in
``fp32_invariant`` mode that makes TP=1 ≡ TP=2 and CP=1 ≡ CP=2, the composed MLP and its SwiGLU kernels.

Inside: ``layout`` (the rank layout and its axis groups: pure torch), ``operators`` (row/column-parallel and
replicated-dW operators: det_gemm plus one collective), ``invariant`` (the reduction modes), ``swiglu`` (SwiGLU
fwd/bwd kernels and references), ``mlp`` (the composed MLP as an autograd Function).

The operators are resolved on first use: the CLI imports ``layout`` to check a launch before choosing Triton's
interpreter or compiler, and importing this package must not define a kernel yet.
"""

import importlib

__all__ = ["row_parallel_fwd", "column_parallel_dx", "replicated_dw", "row_parallel_dhidden"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("detkit.kernels.parallel.operators"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
