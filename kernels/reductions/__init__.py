"""Reductions: batch-invariant row reductions in a fixed order (the row mean RMSNorm's variance uses).

Inside: ``row_mean`` (the kernel, its launch plans and wrapper), ``reference`` (the pure-torch reference).
"""

from detkit.kernels.reductions.reference import row_mean_ref
from detkit.kernels.reductions.row_mean import row_mean, row_mean_launcher

__all__ = ["row_mean", "row_mean_launcher", "row_mean_ref"]
