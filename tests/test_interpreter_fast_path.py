"""kernels/interpreter.py: Triton's interpreter with its redundant per-helper pass, its eager tuple types, its
per-call dtype table and its discarded overflow checks skipped computes what Triton's own interpreter computes, runs
that pass far fewer times, and leaves other Triton versions alone (CPU, interpreter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

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


@triton.jit
def _int32_mix(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    # int32 adds, subs and muls that overflow: the interpreter wraps them (its overflow check needs debug)
    y = (x * 65537 + 2147483000) - x * 3
    tl.store(out_ptr + offs, y)


def _run_int32_mix():
    x = torch.tensor([0, 1, -1, 7, 2**31 - 1, -2**31, 40000, -40000], dtype=torch.int32)
    out = torch.empty_like(x)
    _int32_mix[(1,)](x, out, BLOCK=8)
    return out


def test_integer_overflow_wraps_as_in_tritons_own_interpreter():
    fast = _run_int32_mix()
    interpreter.uninstall()
    try:
        plain = _run_int32_mix()
    finally:
        assert interpreter.install()
    assert torch.equal(fast, plain), ("int32 add/sub/mul with overflow: the fast path vs Triton's own interpreter",
                                      fast, plain)
    x = np.array([0, 1, -1, 7, 2**31 - 1, -2**31, 40000, -40000], dtype=np.int64)
    wrapped = ((x * 65537 + 2147483000) - x * 3 + 2**31) % 2**32 - 2**31
    assert fast.tolist() == wrapped.tolist()


def test_tuple_types_and_the_dtype_table_equal_tritons():
    from triton.language import core
    from triton.runtime import interpreter as triton_interpreter

    dtypes = (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
              tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8,
              tl.float8e4b15, tl.pointer_type(tl.float32), tl.block_type(tl.bfloat16, [16, 32]),
              tl.block_type(tl.pointer_type(tl.int8), [4]))

    def observed():
        values = [tl.constexpr(2), tl.constexpr(3)]
        lazy = core.tuple(values)
        given = core.tuple(values, core.tuple_type([tl.constexpr(2).type, tl.float32], ["a", "b"]))
        changed = core.tuple(values)
        changed._setitem(1, tl.constexpr(5))
        np_dtypes = [triton_interpreter._get_np_dtype(ty) for ty in dtypes]
        with pytest.raises(KeyError):
            triton_interpreter._get_np_dtype(tl.void)
        return [str(lazy.type), str(given.type), given.type.fields, str(changed.type), np_dtypes]

    fast = observed()
    interpreter.uninstall()
    try:
        plain = observed()
    finally:
        assert interpreter.install()
    assert fast == plain and fast[0] == "[:constexpr_type[2],:constexpr_type[3]]", (fast, plain)


@triton.jit
def _cumsum_kernel(x_ptr, out_ptr, A: tl.constexpr, K: tl.constexpr, B: tl.constexpr):
    offs = (tl.arange(0, A)[:, None, None] * K + tl.arange(0, K)[None, :, None]) * B + tl.arange(0, B)[None, None, :]
    tl.store(out_ptr + offs, tl.cumsum(tl.load(x_ptr + offs), axis=1))


def test_cumsum_gives_tritons_own_bits_finite_or_not():
    """The GEMMs' emulation's cumsum over [A, K, B] (float32 and float64; finite, with infinities, NaNs or both) gives
    Triton's own interpreter's bits; K = 512 keeps Triton's cumsum (past CUMSUM_SLICES_UP_TO)."""
    g = torch.Generator().manual_seed(3)
    inputs = []
    for dtype, (a, k, b) in ((torch.float32, (4, 32, 8)), (torch.float64, (2, 16, 4)), (torch.float32, (1, 512, 2))):
        x = torch.randn(a, k, b, generator=g, dtype=dtype) * torch.tensor([1e-3, 1.0, 1e4], dtype=dtype)[
            torch.randint(0, 3, (a, k, b), generator=g)]
        with_inf, with_nan = x.clone(), x.clone()
        with_inf.view(-1)[::7] = float("inf")
        with_inf.view(-1)[3::11] = float("-inf")
        with_nan.view(-1)[::13] = float("nan")
        mixed = with_inf.clone()  # NaNs made by inf - inf meet input NaNs: which one a sum keeps is the loop's
        mixed.view(-1)[5::29] = float("nan")
        inputs += [x, with_inf, with_nan, mixed]

    def run():
        outs = []
        for x in inputs:
            out = torch.empty_like(x)
            _cumsum_kernel[(1,)](x, out, A=x.shape[0], K=x.shape[1], B=x.shape[2])
            outs.append(out)
        return outs

    fast = run()
    interpreter.uninstall()
    try:
        plain = run()
    finally:
        assert interpreter.install()
    for got, want in zip(fast, plain):
        bits = torch.int32 if got.dtype == torch.float32 else torch.int64
        assert torch.equal(got.view(bits), want.view(bits)), "cumsum: the fast path vs Triton's own interpreter"
