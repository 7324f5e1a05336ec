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
``installed()`` is False."""

from __future__ import annotations

import threading

import triton

SUPPORTED_TRITON = ("3.6.0",)

_state = threading.local()  # launches: [lang-module ids a running launch patched], innermost last
_langs_cache: dict = {}
_original = None  # (interpreter module, its _patch_lang, GridExecutor.__call__) while installed


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
    return True


def uninstall() -> None:
    """Triton's interpreter as it was (tests compare the two)."""
    global _original
    if _original is None:
        return
    interpreter, patch_lang, grid_call = _original
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = grid_call
    _original = None


def installed() -> bool:
    return _original is not None
