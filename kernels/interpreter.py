"""Triton's CPU interpreter without its per-call re-patching of ``triton.language``.

Under ``TRITON_INTERPRET=1`` a kernel launch patches ``triton.language``'s builtins for the interpreter once
(``GridExecutor.__call__`` -> ``_patch_lang``, restored when the launch ends), and then every call of a
``@triton.jit`` helper inside the kernel runs ``_patch_lang`` again (triton 3.6: ``InterpretedFunction.__call__``):
it scans the helper's globals and ``inspect.getmembers`` of ``tl``, ``tl.tensor`` and ``tl.math``. Inside a launch
that pass changes nothing -- the builtins it would wrap are already the launch's wrappers, which ``is_builtin`` no
longer matches, and the attributes it sets are set to the same definitions -- yet it took about a third of an
interpreted split-KV test's wall time (about 37000 calls, half a millisecond each).

``install`` skips that pass for a helper whose ``triton.language`` modules (``tl``, ``tl.core``) are already
patched in the running launch -- by the launch's own pass, or by an earlier helper's (``tl.core``: the standard
library's ``tl.sum``, ``tl.zeros``...), whose changes Triton never restores -- and runs Triton's own pass for any
other call, so the interpreter computes exactly what it computed before. It changes Triton's interpreter only for
the versions in ``SUPPORTED_TRITON`` (the one whose code this mirrors); with any other version it does nothing and
``installed()`` is False.

Two more costs of the same kind, per op rather than per helper, are cut the same way: ``triton.language.tuple``
(every tensor's shape is one) builds its ``tuple_type``, with a formatted name, on construction, though the
interpreter rarely reads it: it is built on first read instead, from the same values (only ``_setitem`` changes
them, and it rebuilds the type itself). The interpreter's ``_get_np_dtype`` builds its 19-entry dtype table on every
call: it is built once. Both give the objects Triton gives. And every integer add, sub and mul checks for overflow
(``binary_op_sanitize_overflow_impl``: casts to int64, the op again, two comparisons, an and) only to hand the result
to ``device_assert``, which without ``debug`` -- the interpreter's options never set it -- discards it: under the
interpreter without ``debug`` only the check's type assertions run; with ``debug``, and for every compile, Triton's
own. Floating-point ``tl.cumsum`` (the GEMMs' ascending-k emulation runs one over every [M, K, N] product) is
numpy's ``cumsum``, a sequential sum in the array's dtype at about 5 ns an element; the same sums are taken slice by
slice along the axis, one vectorized add per step, where the axis is short (``CUMSUM_SLICES_UP_TO``) and the input
and the sums are finite (numpy's own cumsum otherwise: a NaN's sign bit may depend on the loop that made it)."""

from __future__ import annotations

import threading

import triton

SUPPORTED_TRITON = ("3.6.0",)

_state = threading.local()  # launches: [lang-module ids a running launch patched], innermost last
_langs_cache: dict = {}
_original = None  # (interpreter module, its _patch_lang, GridExecutor.__call__) while installed
_replaced: list = []  # (owner, attribute, Triton's value) of the per-op changes, in the order made
CUMSUM_SLICES_UP_TO = 256  # longer axes keep numpy's cumsum (one add per slice costs more there)
_TUPLE_TYPE = "_detkit_tuple_type"  # where a tl.tuple keeps its type once built (None: not yet)


class _NoChanges:
    """The scope of a skipped pass: nothing to restore."""

    @staticmethod
    def restore() -> None:
        return None


_NO_CHANGES = _NoChanges()


def _lang_ids(fn) -> frozenset:
    """The ``triton.language`` modules (``tl``, ``tl.core``) visible in ``fn``'s globals, as Triton's pass finds
    them."""
    ids = _langs_cache.get(fn)
    if ids is None:
        import triton.language as tl

        ids = frozenset(id(v) for v in list(fn.__globals__.values()) if v is tl or v is tl.core)
        _langs_cache[fn] = ids
    return ids


def _launches() -> list:
    launches = getattr(_state, "launches", None)
    if launches is None:
        launches = _state.launches = []
    return launches


def _patch_lang(fn):
    launches = _launches()
    langs = _lang_ids(fn)
    if getattr(_state, "launch_starting", False):  # the launch's own pass: run it, then remember what it patched
        _state.launch_starting = False
        scope = _original[1](fn)
        launches.append(langs)
        return scope
    if launches and langs <= launches[-1]:
        return _NO_CHANGES
    scope = _original[1](fn)
    if launches:  # a helper's pass is never restored (Triton drops its scope): its modules stay patched
        launches[-1] = launches[-1] | langs
    return scope


def _grid_call(self, *args, **kwargs):
    launches = _launches()
    depth = len(launches)
    _state.launch_starting = True
    try:
        return _original[2](self, *args, **kwargs)
    finally:
        _state.launch_starting = False
        del launches[depth:]


def install() -> bool:
    """Skip the interpreter's redundant per-helper pass (see the module docstring); True when installed (an
    idempotent call), False for a Triton version this does not support."""
    global _original
    if _original is not None:
        return True
    if triton.__version__ not in SUPPORTED_TRITON:
        return False
    from triton.runtime import interpreter

    _original = (interpreter, interpreter._patch_lang, interpreter.GridExecutor.__call__)
    interpreter._patch_lang = _patch_lang
    interpreter.GridExecutor.__call__ = _grid_call
    _install_lazy_tuple_types()
    _install_np_dtype_table(interpreter)
    _install_overflow_check(interpreter)
    _install_sliced_cumsum(interpreter)
    return True


def _replace(owner, name: str, value):
    """``owner.name = value``, Triton's value remembered for ``uninstall``; returns Triton's value."""
    original = getattr(owner, name)
    _replaced.append((owner, name, original))
    setattr(owner, name, value)
    return original


def _install_lazy_tuple_types() -> None:
    """``tl.tuple``'s type built on first read (see the module docstring)."""
    from triton.language import core

    cls = core.tuple

    def __init__(self, args, type=None):  # noqa: A002 - Triton's parameter name
        self.values = [i for i in args]
        if isinstance(type, core.tuple_type):
            self.__dict__[_TUPLE_TYPE] = type
        elif type is not None:  # a list of types (ASTFunction.deserialize's template)
            self.__dict__[_TUPLE_TYPE] = core.tuple_type(type)
        else:
            self.__dict__[_TUPLE_TYPE] = None

    def _type(self):
        built = self.__dict__.get(_TUPLE_TYPE)
        if built is None:
            built = self.__dict__[_TUPLE_TYPE] = core._type_for_tuple_values(self.values)
        return built

    def _set_type(self, value):
        self.__dict__[_TUPLE_TYPE] = value

    cls.type = property(_type, _set_type)  # kept by uninstall: Triton's own __init__ sets the type through it
    _replace(cls, "__init__", __init__)


def _install_np_dtype_table(interpreter) -> None:
    """``_get_np_dtype`` on a table built once (see the module docstring); the same results and errors."""
    import numpy as np
    import triton.language as tl

    original = interpreter._get_np_dtype
    table = {ty: original(ty) for ty in (
        tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32,
        tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)}
    pointer = np.dtype(np.uint64)

    def _get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        if isinstance(tt_dtype, tl.block_type):
            if isinstance(tt_dtype.element_ty, tl.pointer_type):
                return pointer
            return table[tt_dtype.element_ty]
        return table[tt_dtype]

    _replace(interpreter, "_get_np_dtype", _get_np_dtype)


def _install_overflow_check(interpreter) -> None:
    """The overflow check's discarded work skipped under the interpreter without ``debug`` (see the module
    docstring)."""
    from triton.language.semantic import TritonSemantic

    original = TritonSemantic.binary_op_sanitize_overflow_impl
    builder_class = interpreter.InterpreterBuilder

    def binary_op_sanitize_overflow_impl(self, lhs, rhs, binary_op):
        options = self.builder.options
        if not isinstance(self.builder, builder_class) or options.debug:
            return original(self, lhs, rhs, binary_op)
        if lhs.type.scalar.int_bitwidth >= 64 or not options.sanitize_overflow:
            return
        assert lhs.type.scalar == rhs.type.scalar
        assert lhs.type.scalar.is_int()

    _replace(TritonSemantic, "binary_op_sanitize_overflow_impl", binary_op_sanitize_overflow_impl)


def _install_sliced_cumsum(interpreter) -> None:
    """Floating-point cumsums along short axes slice by slice (see the module docstring): element k is element k - 1
    plus input k, rounded to the dtype, as numpy's sequential cumsum computes it."""
    import numpy as np

    original = interpreter.ScanOps.cumsum

    def cumsum(self, input):  # noqa: A002 - Triton's parameter name
        data = input.handle.data
        if (data.dtype.kind != "f" or data.ndim == 0 or not 1 < data.shape[self.axis] <= CUMSUM_SLICES_UP_TO
                or not np.isfinite(data).all()):
            return original(self, input)
        out = np.empty_like(data)
        src, dst = np.moveaxis(data, self.axis, 0), np.moveaxis(out, self.axis, 0)
        dst[0] = src[0]
        for k in range(1, src.shape[0]):  # slices k:k+1, so that a 1-D input's steps are arrays too
            np.add(dst[k - 1:k], src[k:k + 1], out=dst[k:k + 1])
        if not np.isfinite(out).all():  # a NaN made here may carry another sign bit than numpy's loop's: its own
            return original(self, input)
        return [self.to_tensor(out, dtype=input.dtype)]

    _replace(interpreter.ScanOps, "cumsum", cumsum)


def uninstall() -> None:
    """Triton's interpreter as it was (tests compare the two)."""
    global _original
    if _original is None:
        return
    interpreter, patch_lang, grid_call = _original
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = grid_call
    while _replaced:  # tl.tuple's type property stays (see _install_lazy_tuple_types)
        owner, name, original = _replaced.pop()
        setattr(owner, name, original)
    _original = None


def installed() -> bool:
    return _original is not None
