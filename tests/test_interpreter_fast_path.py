"""kernels/interpreter.py: Triton's interpreter with its redundant per-helper pass skipped computes what Triton's own
interpreter computes, runs that pass far fewer times, and leaves other Triton versions alone (CPU, interpreter)."""

from __future__ import annotations

import pytest
import torch
import triton

import detkit.kernels.backend  # noqa: F401 - installs the fast path under the interpreter
from detkit.kernels import interpreter
from detkit.kernels.attention import attention
from detkit.kernels.det_gemm import det_gemm_fwd
from tests.conftest import assert_bits_equal

pytestmark = pytest.mark.skipif(not triton.knobs.runtime.interpret, reason="the interpreter's fast path: CPU only")


def _inputs():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 37, 64, generator=g).bfloat16()
    k = torch.randn(2, 2, 37, 64, generator=g).bfloat16()
    v = torch.randn(2, 2, 37, 64, generator=g).bfloat16()
    a = torch.randn(24, 80, generator=g).bfloat16()
    w = torch.randn(48, 80, generator=g).bfloat16()
    return q, k, v, a, w


def _run(counter: list[int]):
    """Attention (forward and a decode step) and a GEMM, counting the interpreter's language passes."""
    from triton.runtime import interpreter as triton_interpreter

    original = interpreter._original[1] if interpreter.installed() else triton_interpreter._patch_lang

    def counting(fn):
        counter[0] += 1
        return original(fn)

    if interpreter.installed():
        saved = interpreter._original
        interpreter._original = (saved[0], counting, saved[2])
    else:
        saved = None
        triton_interpreter._patch_lang = counting
    try:
        q, k, v, a, w = _inputs()
        return [attention(q, k, v), attention(q[:, :, -1:], k, v), det_gemm_fwd(a, w.t())]
    finally:
        if saved is not None:
            interpreter._original = saved
        else:
            triton_interpreter._patch_lang = original


def test_the_fast_path_is_installed_on_the_pinned_triton_and_gives_the_interpreters_bits():
    assert triton.__version__ in interpreter.SUPPORTED_TRITON and interpreter.installed()
    fast_passes, triton_passes = [0], [0]
    fast = _run(fast_passes)
    interpreter.uninstall()
    try:
        assert not interpreter.installed()
        plain = _run(triton_passes)
    finally:
        assert interpreter.install()
    for got, want, what in zip(fast, plain, ("prefill", "decode", "gemm")):
        assert_bits_equal(got, want, f"{what}: the fast path vs Triton's own interpreter")
    # Triton's pass once per launch (and once per helper module set a launch had not patched) instead of once per
    # helper call.
    assert triton_passes[0] > 10 * fast_passes[0] and fast_passes[0] >= 3, (fast_passes, triton_passes)


def test_other_triton_versions_are_left_alone(monkeypatch):
    interpreter.uninstall()
    try:
        monkeypatch.setattr(triton, "__version__", "9.9.9")
        assert interpreter.install() is False and not interpreter.installed()
    finally:
        monkeypatch.undo()
        assert interpreter.install() and interpreter.installed()
