"""Parallel: the Qwen3-8B TP=2 x CP=2 reduction operators (both sides of each reduction exposed), the opt-in
``fp32_invariant`` mode that makes TP=1 ≡ TP=2 and CP=1 ≡ CP=2, the composed MLP and its SwiGLU kernels.

Inside: ``layout`` (the rank layout and its axis groups), ``operators`` (row/column-parallel and replicated-dW
operators: det_gemm plus one collective), ``invariant`` (the reduction modes), ``swiglu`` (SwiGLU fwd/bwd kernels
and references), ``mlp`` (the composed MLP as an autograd Function).
"""

from detkit.kernels.parallel.operators import (
    column_parallel_dx, replicated_dw, row_parallel_dhidden, row_parallel_fwd,
)

__all__ = ["row_parallel_fwd", "column_parallel_dx", "replicated_dw", "row_parallel_dhidden"]
