"""Host reads of device data, recorded at the dispatcher: what a CUDA-graph capture refuses and what stalls a CPU
that should run ahead of the GPU.

A call reads device data on the host when it needs a value (``.item()``, ``int(t)``, ``bool(t)``) or an output shape
that depends on the data (``nonzero``, ``masked_select``, ``unique``, ``bincount``), copies a tensor from a device to
the CPU, or waits for the device (``torch.cuda.synchronize``, a stream's or event's ``synchronize``). ``host_reads()``
records each such call while it is active. On the CPU the same ops are recorded although nothing waits: the ops a
capture on the GPU would refuse are found without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops whose result the host must wait for (a value, or an output shape that depends on the data). Under
# torch.inference_mode a value is read as ``aten.item`` (not decomposed to ``_local_scalar_dense`` before the mode
# sees it), so both are listed.
SYNCING_OPS = {aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default, aten.masked_select.default,
               aten.is_nonzero.default, aten.equal.default, aten._unique2.default, aten.unique_consecutive.default,
               aten.unique_dim.default, aten.bincount.default}


class HostReads(TorchDispatchMode):
    """Records every op that reads device data back to the host: the syncing ops above and copies from a device to
    the CPU (``host_reads`` adds the calls that do not dispatch)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING_OPS:
            self.reads.append(str(func))
        elif func in (aten._to_copy.default, aten.copy_.default):
            src = args[1] if func is aten.copy_.default else args[0]
            dst = args[0].device if func is aten.copy_.default else kwargs.get("device") or src.device
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and torch.device(dst).type == "cpu":
                self.reads.append(f"{func} {src.device} -> cpu")
        return func(*args, **kwargs)


@contextmanager
def host_reads() -> Iterator[list[str]]:
    """Yields the list of host reads made inside the block (HostReads, plus Tensor.tolist / numpy and the CUDA
    synchronize calls, patched while the block runs: they do not dispatch)."""
    mode = HostReads()
    patched = [(torch.Tensor, "tolist"), (torch.Tensor, "numpy"), (torch.cuda, "synchronize"),
               (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]

    def recorder(owner, name, original):
        def call(*args, **kwargs):
            mode.reads.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return original(*args, **kwargs)
        return call

    for owner, name, original in saved:
        setattr(owner, name, recorder(owner, name, original))
    try:
        with mode:
            yield mode.reads
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
