"""Reductions: batch-invariant reductions in a fixed order (the row mean RMSNorm's variance uses; the index sum an
embedding's weight gradient is, split-invariant across data-parallel shards).

Inside: ``row_mean`` (the kernel, its launch plans and wrapper), ``index_sum`` (the kernel and its wrapper),
``reference`` (the pure-torch references).
"""

from detkit.kernels.reductions.index_sum import index_sum, index_sum_kernel
from detkit.kernels.reductions.reference import index_sum_ref, row_mean_ref
from detkit.kernels.reductions.row_mean import row_mean, row_mean_launcher

__all__ = ["index_sum", "index_sum_kernel", "index_sum_ref", "row_mean", "row_mean_launcher", "row_mean_ref"]
