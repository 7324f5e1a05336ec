"""What the fused routes (``norms``, ``rotary``) share. Which functions of transformers' model modules compute what
a detkit copy of them computes: their bytecode (instructions and what they load), line numbers and the docstring
aside; a route takes a class or function only where its code is one of its copies, op for op, so a model whose math
differs keeps its own. Which model modules are new since a route last looked, and the suspension of a route's swaps
(a measurement's baseline)."""

from __future__ import annotations

import contextlib
import dis

import torch

from detkit.mode import state as mode_state


def code_key(fn) -> tuple | None:
    """What ``fn`` computes, as far as its bytecode says: its instructions with their resolved arguments (constants,
    names, variables; not the constant table's order, which a docstring shifts), its arguments and defaults. None for
    anything without Python code, or whose ``torch`` global is not torch."""
    code = getattr(fn, "__code__", None)
    if code is None or getattr(fn, "__globals__", {}).get("torch", torch) is not torch:
        return None
    instructions = tuple((i.opname, i.argrepr) for i in dis.get_instructions(code))
    return instructions, code.co_argcount, code.co_kwonlyargcount, fn.__defaults__


MODEL_MODULES = "transformers.models."


def new_model_modules(scanned: set[str]):
    """(name, module) of each imported transformers model module not in ``scanned`` (added to it). Nothing when no
    module was imported since the last call with ``scanned``:
    the mode's entry pays no walk over sys.modules then."""
    import sys

    count = len(sys.modules)
    if _COUNTS.get(id(scanned)) == count:
        return
    _COUNTS[id(scanned)] = count
    for name, module in list(sys.modules.items()):
        if name.startswith(MODEL_MODULES) and name not in scanned and module is not None:
            scanned.add(name)
            yield name, module


_COUNTS: dict[int, int] = {}  # id of a caller's scanned set -> len(sys.modules) at its last walk


@contextlib.contextmanager
def suspension(saved: dict, install, uninstall):
    """A route's swaps undone while inside (``saved``: what it swapped; ``install`` / ``uninstall``: its own), and
    made again after where they were made and the mode is still entered."""
    swapped = bool(saved)
    uninstall()
    try:
        yield
    finally:
        if swapped and mode_state.active():
            install()
