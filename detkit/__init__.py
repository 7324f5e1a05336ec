"""detkit: deterministic, batch-invariant GEMMs for Hopper, the reductions around them, and the
audits and benchmarks that prove their properties.

The repository keeps one folder per part (kernels/, mode/, toolkit/, audits/, bench/); installed, they
are ``detkit.kernels``, ``detkit.mode``, ``detkit.toolkit``, ``detkit.audits`` and ``detkit.bench``. The public
names below are resolved on first use, not at import: importing a kernel module fixes Triton's
interpreter-or-compiler choice, which ``detkit audit --device cpu`` must make first.
"""

from __future__ import annotations

import importlib
import os

# A source checkout keeps the parts beside this folder (kernels/, toolkit/, ...), the wheel inside
# it: in a checkout, search its root too, so that `PYTHONPATH=<checkout> python -m detkit` runs that
# checkout's code whether or not (and wherever) detkit is installed.
_HERE = os.path.dirname(os.path.abspath(__file__))
_CHECKOUT = os.path.dirname(_HERE)
if not os.path.isdir(os.path.join(_HERE, "kernels")) and os.path.isfile(os.path.join(_CHECKOUT, "kernels", "__init__.py")):
    __path__.append(_CHECKOUT)

__version__ = "0.1.0"

# Public name -> the module that defines it.
_PUBLIC = {
    "det_gemm_fwd": "detkit.kernels.det_gemm",
    "det_gemm_da": "detkit.kernels.det_gemm",
    "det_gemm_db": "detkit.kernels.det_gemm",
    "row_parallel_fwd": "detkit.kernels.parallel",
    "column_parallel_dx": "detkit.kernels.parallel",
    "replicated_dw": "detkit.kernels.parallel",
    "row_parallel_dhidden": "detkit.kernels.parallel",
    "moe_mlp": "detkit.kernels.moe",
    "moe_mlp_fp8": "detkit.kernels.moe",
    "batch_invariant_mode": "detkit.mode",
    "enable_batch_invariant_mode": "detkit.mode",
    "disable_batch_invariant_mode": "detkit.mode",
    "is_batch_invariant_mode_enabled": "detkit.mode",
    "mode_counters": "detkit.mode",
    "refresh_fp8_weights": "detkit.mode",
    "reset_mode_counters": "detkit.mode",
    "ModeNotRoutedError": "detkit.mode",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'detkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
