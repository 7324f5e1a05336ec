"""A compiled-kernel stand-in for launch-plan tests on the CPU (kernels/backend.py PlannedKernel, DirectLaunch,
RawLaunch): ``Compiling(jit_fn)`` has a real Triton ``JITFunction``'s parameters and specializes each launch with
Triton's own binder, as ``JITFunction.run`` does. Its first launch of a specialization "compiles" it: a handle whose
launcher is Triton's ``CudaLauncher`` with a recording C entry point. Every launch, Triton's or a plan's, reaches that
entry point, so a test can ask of each one which binary it ran (the handle's ``function``) and compare its argument
list with the one Triton's own launcher builds for the same call."""

from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import torch
from triton.backends.nvidia import driver  # imports without a GPU (a launcher is compiled per kernel, not here)

from detkit.kernels import backend


class Recorder:
    """Stands in for the launcher's C entry point (a callable without a closure, as a C function is)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, *args):
        self.calls.append(args)


def jit_twin(kernel):
    """A Triton ``JITFunction`` of ``kernel``'s Python function and specialization lists: under the interpreter the
    detkit kernels are ``InterpretedFunction``s, which have no parameter modes."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    options = {k: v for k, v in getattr(kernel, "kwargs", {}).items()
               if k in ("do_not_specialize", "do_not_specialize_on_alignment")}
    return JITFunction(kernel.fn, **options)


class Compiling:
    """``kernel[grid](*args, **options)`` as ``JITFunction.run`` does it, with compiling replaced by a handle whose
    launcher records: binds and specializes with Triton's binder, keys the cache as Triton does (the
    specialization's and the options' strings), "compiles" a new specialization and launches through the handle's
    ``run`` with no hooks. ``specs[function]``: the specialization each handle was compiled for."""

    STREAM = 77

    def __init__(self, kernel):
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.runtime.jit import create_function_from_signature

        self.jit = jit_twin(kernel)
        self.arg_names, self.fn, self.params = self.jit.arg_names, self.jit.fn, self.jit.params
        self.binder = create_function_from_signature(self.jit.signature, self.jit.params, CUDABackend)
        self.entry = Recorder()
        self.cache: dict[str, SimpleNamespace] = {}
        self.specs: dict[int, str] = {}

    def key(self, args, options) -> str:
        """Triton's kernel-cache key of a call (jit.py compute_cache_key, less the callables' hashing)."""
        _, specialization, opts = self.binder(*args, **options)
        return str(specialization) + str(opts)

    def __getitem__(self, grid):
        def launch(*args, **options):
            bound, specialization, opts = self.binder(*args, **options)
            key = str(specialization) + str(opts)
            compiled = self.cache.get(key)
            if compiled is None:
                signature = dict(zip(self.arg_names, (s[0] for s in specialization)))
                compiled = self.cache[key] = self._compiled(signature, 1000 + len(self.cache))
                self.specs[compiled.function] = key
            gx, gy, gz = backend.grid_3d(grid)
            compiled.run(gx, gy, gz, self.STREAM, compiled.function, compiled.packed_metadata, None, None, None,
                         *bound.values())
            return compiled
        return launch

    def _compiled(self, signature: dict, function: int):
        launcher = driver.CudaLauncher.__new__(driver.CudaLauncher)
        launcher.launch = self.entry
        launcher.num_ctas, launcher.launch_cooperative_grid, launcher.launch_pdl = 1, False, False
        launcher.global_scratch_size = launcher.profile_scratch_size = 0
        launcher.global_scratch_align = launcher.profile_scratch_align = 1
        meta = namedtuple("Meta", "tensordesc_meta")([])
        return SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=meta, run=launcher,
                               function=function, packed_metadata=(function, 4), launch_metadata=lambda *a: None)

    def tritons_launch(self, grid, args, options) -> tuple:
        """The entry-point arguments Triton's own launch gives this call (pointers as addresses), recorded and then
        removed from the record."""
        self[grid](*args, **options)
        return addresses(self.entry.calls.pop())


def addresses(call: tuple) -> tuple:
    """An entry-point call with tensors as their data pointers (what the launcher reads of them)."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in call)


def check_last_launch(kernel: Compiling, grid, args, options) -> int:
    """Assert that the last recorded launch ran the binary Triton compiles for this call and got the argument list
    Triton's own launcher builds for it; returns that binary's ``function``."""
    got = addresses(kernel.entry.calls[-1])
    key = kernel.key(args, options)
    assert kernel.specs[got[4]] == key, f"ran the binary of {kernel.specs[got[4]]}, the call's is {key}"
    want = kernel.tritons_launch(grid, args, options)
    assert got == want, [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
    return got[4]
