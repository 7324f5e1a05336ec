"""Host copies of the small integer tensors the attention's checks and grids read (cumulative lengths, anchors,
positions), remembered per tensor so that the layers of one model step read each of them once.

Why: reading a CUDA tensor's values on the host waits until every kernel queued before it has run, so the host stops
queueing the next layer's work. transformers' continuous batching hands every layer of a step the same length
tensors; read at every layer, each layer's attention drained the GPU four or five times.

When a remembered value is trusted: while its tensor object is alive (a weak reference: a new tensor at a reused id
misses), its version counter is unchanged (torch bumps it on every in-place write through any view: ``copy_``, slice
assignment, ``fill_``), and its data pointer, shape, strides and storage offset are the same. Not seen: writes that
bypass the version counter (through ``.data``, a NumPy or DLPack view, a kernel of another library); a caller that
writes lengths that way calls ``forget()`` after each write, or runs inside ``read_every_time()``. Inference tensors
keep no version counter, so they are read every time (as are tensors under ``torch.compile``'s tracing).
``TensorMemo`` is that rule for any value derived from a tensor: the launch's block-table check and sdpa's mask
check remember their verdicts with it too.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

import torch

CAPACITY = 64  # tensors remembered; a model step uses a handful (q and k lengths per layer type, positions)
_MISSING = object()


_every_time = 0  # read_every_time() depth: process-wide, as transformers' generation thread must see it too


def _identity(t: torch.Tensor) -> tuple | None:
    """What must be unchanged for a remembered value to hold, or None where it cannot be trusted at all."""
    if _every_time or t.is_inference() or torch.compiler.is_compiling():
        return None
    try:
        version = t._version
    except RuntimeError:  # a tensor kind without a version counter
        return None
    return version, t.data_ptr(), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device


class TensorMemo:
    """Values derived from tensors, each kept while its tensor is alive and unwritten (the module docstring), under a
    caller's ``key`` (e.g. what the value was checked against)."""

    def __init__(self, capacity: int = CAPACITY):
        self._capacity = capacity
        self._entries: OrderedDict[int, tuple[weakref.ref, tuple, Hashable, object]] = OrderedDict()
        self._lock = threading.Lock()  # transformers' continuous batching runs its steps on a thread of its own

    def get(self, t: torch.Tensor, key: Hashable = None, default=None):
        identity = _identity(t)
        if identity is None:
            return default
        with self._lock:
            entry = self._entries.get(id(t))
        if entry is None:
            return default
        ref, known, known_key, value = entry
        if ref() is not t or known != identity or known_key != key:
            return default
        return value

    def put(self, t: torch.Tensor, value, key: Hashable = None) -> None:
        identity = _identity(t)
        if identity is None:
            return
        with self._lock:
            self._entries[id(t)] = (weakref.ref(t), identity, key, value)
            self._entries.move_to_end(id(t))
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_VALUES = TensorMemo()
_reads = 0  # host reads of device values made by host_values (each one a wait for the GPU)


def host_values(*tensors: torch.Tensor) -> tuple[list[int], ...]:
    """Each tensor's values, flattened, as Python ints: the remembered ones as they are, the rest in one host read
    per device (one wait), then remembered."""
    global _reads
    values = [_VALUES.get(t, default=_MISSING) for t in tensors]
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if v is _MISSING:
            by_device.setdefault(tensors[i].device, []).append(i)
    for missing in by_device.values():  # one read a device
        flat = [tensors[i].reshape(-1) for i in missing]
        read = (flat[0] if len(flat) == 1 else torch.cat([f.to(torch.int64) for f in flat])).tolist()
        _reads += 1
        start = 0
        for i, f in zip(missing, flat):
            values[i] = read[start:start + f.numel()]
            start += f.numel()
            _VALUES.put(tensors[i], values[i])
    return tuple(list(v) for v in values)


def remember_values(t: torch.Tensor, values: list[int]) -> torch.Tensor:
    """Note ``values`` (known on the host) as ``t``'s, for a tensor just built from them; returns ``t``."""
    _VALUES.put(t, list(values))
    return t


def host_reads() -> int:
    """How many host reads ``host_values`` has made in this process (tests and benchmarks count waits with it)."""
    return _reads


def forget() -> None:
    """Drop every remembered value (after writing length tensors in a way torch's version counter does not see)."""
    _VALUES.clear()


@contextmanager
def read_every_time() -> Iterator[None]:
    """Within (in every thread): nothing is remembered or reused, every check reads the device (length tensors
    written behind torch's version counter; ``tools.serving_speed`` measures what the memo saves against it)."""
    global _every_time
    _every_time += 1
    try:
        yield
    finally:
        _every_time -= 1
