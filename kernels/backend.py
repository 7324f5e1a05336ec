"""Which backend a detkit kernel runs on, decided from the tensors and Triton's own mode, and how a compiled
kernel is launched there.

Two backends exist and every result names the one it ran on:
- ``cuda_sm90``: compiled Triton on a Hopper GPU (compute capability 9.0).
- ``triton_interpreter``: CPU tensors under ``TRITON_INTERPRET=1`` (used by CI).

Anything else raises before any work is done; there is no silent fallback.

``DirectLaunch`` is the host side of a launch whose arguments a caller has already worked out once (a
launch plan): its first call is Triton's own ``kernel[grid](...)``, which compiles (or loads) the kernel and
returns the compiled handle; every later call hands the argument list straight to that handle's launcher,
skipping Triton's per-call argument binding, specialization key and cache lookup.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import threading
from typing import NamedTuple

import torch

CUDA_SM90 = "cuda_sm90"
TRITON_INTERPRETER = "triton_interpreter"
BACKENDS = (CUDA_SM90, TRITON_INTERPRETER)

# Offsets inside most kernels are 32-bit; check_bf16_matrix refuses tensors whose furthest element is beyond
# them unless the caller's kernel computes 64-bit offsets (max_offset=None).
MAX_INT32_OFFSET = 2**31 - 1


def kernel_is_interpreted(jit_fn) -> bool:
    """True when Triton built ``jit_fn`` for its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(jit_fn, InterpretedFunction)


def resolve_backend(jit_fn, tensors: dict[str, torch.Tensor]) -> str:
    """Return the backend ``jit_fn`` will run ``tensors`` on, or raise naming what is unsupported."""
    return resolve_backend_of_devices(jit_fn, {name: t.device for name, t in tensors.items()})


def resolve_backend_of_devices(jit_fn, devices: dict[str, torch.device]) -> str:
    """``resolve_backend`` from the tensors' devices alone (what a launch plan keeps of them)."""
    if len(set(devices.values())) != 1:
        raise ValueError(f"all tensors must be on one device; got {devices}")
    device = next(iter(devices.values()))
    interpreted = kernel_is_interpreted(jit_fn)
    if device.type == "cpu":
        if not interpreted:
            raise NotImplementedError(
                "CPU tensors are supported only under the Triton interpreter: set TRITON_INTERPRET=1 "
                "before importing detkit kernels (backend 'triton_interpreter'); "
                "for hardware results use CUDA tensors on a Hopper (sm_90) GPU"
            )
        return TRITON_INTERPRETER
    if device.type == "cuda":
        if interpreted:
            raise NotImplementedError(
                f"got CUDA tensors on {device} but TRITON_INTERPRET=1 is set; the interpreter is for "
                "CPU tensors only. Unset TRITON_INTERPRET for backend 'cuda_sm90'"
            )
        capability = torch.cuda.get_device_capability(device)
        if capability != (9, 0):
            name = torch.cuda.get_device_name(device)
            raise NotImplementedError(
                f"device {device} ({name}) has compute capability {capability[0]}.{capability[1]}; "
                "detkit supports Hopper (9.0: H100/H200) only"
            )
        return CUDA_SM90
    raise NotImplementedError(f"device type {device.type!r} is not supported; supported: cuda (sm_90), cpu (interpreter)")


# ---------------------------------------------------------------------------------------------
# Operand checks
# ---------------------------------------------------------------------------------------------
def check_layout(name: str, layout: torch.layout) -> None:
    """Refuse a non-strided tensor (sparse COO/CSR/..., mkldnn): the kernels read dense strided memory."""
    if layout != torch.strided:
        raise TypeError(f"{name} has layout {layout}; supported: torch.strided (dense tensors)")


def check_bf16_signature(name: str, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
                         max_offset: int | None = MAX_INT32_OFFSET,
                         dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> int:
    """Refuse anything but a non-empty 2-D matrix of one of ``dtypes`` (bf16 unless the kernel takes more) with
    non-negative strides whose furthest element offset is at most ``max_offset`` (None: no limit). Returns the
    elements the view spans from its first element (the storage it needs beyond its storage offset)."""
    if dtype not in dtypes:
        raise TypeError(f"{name} has dtype {dtype}; supported: {', '.join(map(str, dtypes))}")
    if len(shape) != 2:
        raise ValueError(f"{name} must be 2-D; got shape {tuple(shape)}")
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"{name} has an empty dimension (shape {tuple(shape)}); supported: every dim >= 1")
    if any(s < 0 for s in stride):
        raise ValueError(f"{name} has negative strides {tuple(stride)}; supported: non-negative strides")
    furthest = sum((size - 1) * s for size, s in zip(shape, stride))
    if max_offset is not None and furthest > max_offset:
        raise ValueError(
            f"{name} (shape {tuple(shape)}, strides {tuple(stride)}) spans element offset "
            f"{furthest}; supported: offsets below 2**31 (32-bit kernel indexing)"
        )
    return furthest + 1


def check_storage(name: str, t: torch.Tensor, span: int) -> None:
    """Refuse a view that reaches past the end of its storage (e.g. after ``untyped_storage().resize_(0)``): the
    kernel would read or write memory the tensor does not own. ``span``: elements the view covers from its
    storage offset (check_bf16_signature's result)."""
    need = (t.storage_offset() + span) * t.element_size()
    have = t.untyped_storage().nbytes()
    if need > have:
        raise ValueError(
            f"{name} (shape {tuple(t.shape)}, strides {t.stride()}, storage offset {t.storage_offset()}) reaches "
            f"byte {need} of a storage that holds {have} bytes; supported: views inside their storage"
        )


def check_bf16_matrix(name: str, t: torch.Tensor, max_offset: int | None = MAX_INT32_OFFSET) -> None:
    """Refuse anything but a dense, non-empty 2-D bf16 tensor inside its storage whose offsets fit the kernel's
    indexing (``max_offset``; None for kernels with 64-bit offsets)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    check_layout(name, t.layout)
    span = check_bf16_signature(name, tuple(t.shape), t.stride(), t.dtype, max_offset)
    check_storage(name, t, span)


# ---------------------------------------------------------------------------------------------
# Launching a compiled kernel
# ---------------------------------------------------------------------------------------------
def ensure_cuda_context(device: torch.device) -> None:
    """Make ``device``'s primary CUDA context current on this thread if none is.

    Why: Triton (3.6) encodes a host-side TMA descriptor (cuTensorMapEncodeTiled) before its launcher
    binds a context, so on a thread that has not yet made a CUDA runtime call (autograd's backward
    worker) the encode fails with "invalid device context". This does what the launcher would do.
    """
    cuda = _libcuda()
    ctx = ctypes.c_void_p()
    _cu_check(cuda.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value:
        return
    dev = ctypes.c_int()
    index = device.index if device.index is not None else torch.cuda.current_device()
    _cu_check(cuda.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
    _cu_check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _cu_check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


_THREAD = threading.local()


def ensure_thread_cuda_context(device: torch.device) -> None:
    """``ensure_cuda_context`` once per thread: a context made current stays current on its thread."""
    if not getattr(_THREAD, "cuda_context", False):
        ensure_cuda_context(device)
        _THREAD.cuda_context = True


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _cu_check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with CUresult {status}")


class HostDescriptor(NamedTuple):
    """What Triton's launcher reads of a host-side TMA descriptor (``TensorDescriptor``: its base tensor, shape,
    strides and padding); it encodes the CUtensorMap from them at every launch. The block shape and (Gluon) the
    shared layout are part of the compiled kernel, so a launch plan fixes them once with a real descriptor on
    its first launch and passes this per call."""

    base: torch.Tensor
    shape: list[int]
    strides: list[int]
    padding: str = "zero"


def host_descriptor(base: torch.Tensor, shape: list[int], strides: list[int]) -> HostDescriptor:
    """``HostDescriptor(base, shape, strides)`` without the generated ``__new__``'s Python frame (the hot path)."""
    return _new_tuple(HostDescriptor, (base, shape, strides, "zero"))


_new_tuple = tuple.__new__


class DirectLaunch:
    """One compiled kernel's launches with a fixed grid and launch options on one CUDA device.

    The caller passes the kernel's full argument list in its parameter order (constexprs included, as Triton's
    binder would bind them) and guarantees that every call of this object specializes the same way (same
    dtypes, pointer alignments, integer values' 1 / multiple-of-16 classes, descriptor block shapes) and that only
    the arguments at ``dynamic`` (positions) change between calls: a launch plan keyed on the call's signature
    does. The first call is Triton's ``kernel[grid](...)`` (with real descriptors); it returns the compiled
    kernel. Later calls pass ``HostDescriptor``s for descriptor arguments and run on the device's current stream:
    - with no launch hook set, straight into the launcher's C entry point (``RawLaunch``), the arguments expanded
      as Triton's launcher expands them, pointers passed as addresses and each descriptor's encoded CUtensorMap
      cached per base address;
    - with a hook set (profilers), through the compiled kernel's launcher with the hook, as Triton does."""

    __slots__ = ("kernel", "grid", "options", "index", "dynamic", "compiled", "run", "function", "packed", "raw")

    def __init__(self, kernel, grid: tuple[int, ...], options: dict, device: torch.device,
                 dynamic: tuple[int, ...] | None = None):
        self.kernel, self.grid, self.options, self.dynamic = kernel, grid, options, dynamic
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.compiled = self.run = self.function = self.packed = self.raw = None

    @property
    def ready(self) -> bool:
        """Whether the kernel is compiled (later calls launch directly)."""
        return self.run is not None

    def __call__(self, args: list) -> None:
        if _current_device() != self.index:
            with torch.cuda.device(self.index):
                return self._launch(args)
        return self._launch(args)

    def _launch(self, args: list) -> None:
        if self.run is None:
            compiled = self.kernel[self.grid](*args, **self.options)
            self.function, self.packed = compiled.function, compiled.packed_metadata
            self.compiled, self.run = compiled, compiled.run
            self.raw = RawLaunch.of(compiled, self.grid, args, self.dynamic)
            return
        grid = self.grid
        stream = _raw_stream(self.index)
        enter = _RUNTIME_KNOBS.launch_enter_hook
        if getattr(enter, "calls", True):  # a hook is set: name the launch for it, as Triton does
            metadata = self.compiled.launch_metadata(grid, stream, *args)
            self.run(grid[0], 1, 1, stream, self.function, self.packed, metadata, enter,
                     _RUNTIME_KNOBS.launch_exit_hook, *args)
        elif self.raw is not None:
            self.raw(args, stream)
        else:
            self.run(grid[0], 1, 1, stream, self.function, self.packed, None, None, None, *args)


# Launch plans kept per PlannedKernel (one per call signature: shapes of a size bound, grids, configs); emptied when
# full.
MAX_PLANS = 256


class PlannedKernel:
    """``planned[grid](*args, **kwargs)`` does what ``kernel[grid](*args, **kwargs)`` does, with the same arguments,
    through a ``DirectLaunch`` per call signature on a GPU (Triton's own launch under the interpreter).

    The signature is everything Triton specializes on, taken conservatively: every non-tensor argument's value
    (integers, floats, constexprs), each tensor's dtype and 16-byte alignment, each TMA descriptor's type, dtype,
    block shape, layout and padding, the grid, the launch options and the current device. Tensors and descriptors
    are the plan's per-call arguments (a descriptor's base, shape and strides are encoded per call, cached per base
    address by ``RawLaunch``). One-dimensional grids only (the MoE kernels' persistent and tiled grids)."""

    __slots__ = ("kernel", "names", "defaults", "plans", "interpreted")

    def __init__(self, kernel):
        self.kernel = kernel
        self.names = tuple(kernel.arg_names)
        self.defaults = {p.name: p.default for p in inspect.signature(kernel.fn).parameters.values()
                         if p.default is not inspect.Parameter.empty}
        self.plans: dict = {}
        self.interpreted = kernel_is_interpreted(kernel)

    def __getitem__(self, grid):
        if self.interpreted:
            return self.kernel[grid]
        if len(grid) != 1:
            raise ValueError(f"{self.kernel.fn.__name__}: a planned launch takes a one-dimensional grid; got {grid}")
        return functools.partial(self._launch, (grid[0],))

    def _launch(self, grid, *args, **kwargs):
        names = self.names
        values = list(args)
        for name in names[len(args):]:
            if name in kwargs:
                values.append(kwargs.pop(name))
            elif name in self.defaults:
                values.append(self.defaults[name])
            else:
                raise TypeError(f"{self.kernel.fn.__name__}: missing argument {name!r}")
        index = _current_device()
        key = (index, grid, *sorted(kwargs.items()), *map(_signature_of, values))
        plan = self.plans.get(key)
        if plan is None:
            if len(self.plans) >= MAX_PLANS:
                self.plans.clear()
            dynamic = tuple(i for i, v in enumerate(values) if isinstance(v, (torch.Tensor, *_DESCRIPTOR_TYPES)))
            plan = self.plans[key] = DirectLaunch(self.kernel, grid, kwargs, torch.device("cuda", index), dynamic)
        plan(values)


def _descriptor_types() -> tuple[type, ...]:
    types = []
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
        types.append(TensorDescriptor)
    except ImportError:  # pragma: no cover - every supported Triton has it
        pass
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
        types.append(GluonTensorDescriptor)
    except ImportError:  # pragma: no cover - a Triton without Gluon has no Gluon descriptors to pass
        pass
    return tuple(types)


_DESCRIPTOR_TYPES = _descriptor_types()


def _signature_of(value):
    """What of one argument a plan is keyed on (a superset of what Triton specializes on). Integers, the most
    common, stand for themselves; other values carry their type (True == 1 == 1.0 as keys)."""
    kind = type(value)
    if kind is int:
        return value
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, _DESCRIPTOR_TYPES):
        return kind, value.base.dtype, tuple(value.block_shape), getattr(value, "layout", None), value.padding
    return kind, value


# The launcher's leading arguments (Triton 3.6's _BASE_ARGS_FORMAT "iiiKKppOOOOOO"): grid x, y, z, stream, function,
# cooperative grid, PDL, global scratch, profile scratch, packed metadata, launch metadata, enter hook, exit hook.
_BASE_ARGS = 13
_STREAM_AT = 3
# Encoded descriptors kept per descriptor argument (base addresses: a weight's is fixed, an activation's cycles
# through the allocator's few blocks); the cache is emptied when full.
MAX_CACHED_DESCRIPTORS = 64


class RawLaunch:
    """A compiled kernel's launches through its launcher's C entry point, as Triton's own launcher would make them
    with no hooks set, minus its per-call Python: the kernel's arguments expanded once (a host descriptor becomes
    the encoded CUtensorMap, its shape and its strides), and per call only the ``dynamic`` arguments filled in:
    a pointer as its address, a descriptor as the CUtensorMap encoded for its base address (cached: the encoding
    depends on nothing else, the plan fixing shape, strides and block). ``of`` returns None where this Triton's
    launcher is not the one this mirrors (then the caller keeps Triton's launcher)."""

    __slots__ = ("entry", "encode", "template", "pointers", "descriptors")

    def __init__(self, entry, encode, template: list, pointers: tuple, descriptors: tuple):
        self.entry, self.encode, self.template = entry, encode, template
        self.pointers, self.descriptors = pointers, descriptors

    @classmethod
    def of(cls, compiled, grid: tuple[int, ...], args: list, dynamic=None) -> "RawLaunch | None":
        """``dynamic``: the positions that change between calls (None: every pointer and descriptor)."""
        parts = _launcher_parts(compiled)
        if parts is None:
            return None
        entry, encode, launcher = parts
        signature = list(compiled.src.signature.values())
        if len(signature) != len(args):
            return None
        metas = list(getattr(compiled.metadata, "tensordesc_meta", None) or [])
        is_pointer = [isinstance(sig, str) and sig.startswith("*") for sig in signature]
        is_descriptor = [isinstance(sig, str) and sig.startswith("tensordesc") for sig in signature]
        if dynamic is None:
            dynamic = [i for i in range(len(args)) if is_pointer[i] or is_descriptor[i]]
        dynamic = set(dynamic)
        template = [grid[0], 1, 1, 0, compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                    None, None, compiled.packed_metadata, None, None, None]
        pointers, descriptors, desc_index = [], [], 0
        for index, (sig, arg) in enumerate(zip(signature, args)):
            if is_descriptor[index]:
                meta = metas[desc_index] if desc_index < len(metas) else None
                desc_index += 1
                if meta is None:  # not lowered to a CUtensorMap: Triton's own launcher handles it
                    return None
                expanded = encode(arg, meta)  # the encoded map holds no reference to the tensor
                if index in dynamic:
                    descriptors.append((index, len(template), len(expanded), meta, {}))
                template.extend(expanded)
            elif index in dynamic and is_pointer[index]:
                pointers.append((index, len(template)))
                template.append(None)  # filled per call: the template keeps no caller's tensor alive
            elif index in dynamic and sig != "constexpr":
                return None  # a dynamic scalar: not what a launch plan passes
            else:
                template.append(arg)
        return cls(entry, encode, template, tuple(pointers), tuple(descriptors))

    def __call__(self, args: list, stream: int) -> None:
        out = self.template.copy()
        out[_STREAM_AT] = stream
        for index, at in self.pointers:
            out[at] = args[index].data_ptr()
        for index, at, width, meta, cache in self.descriptors:
            desc = args[index]
            key = (desc.base.data_ptr(), *desc.shape, *desc.strides)
            encoded = cache.get(key)
            if encoded is None:
                if len(cache) >= MAX_CACHED_DESCRIPTORS:
                    cache.clear()
                encoded = cache[key] = self.encode(desc, meta)
            out[at:at + width] = encoded
        self.entry(*out)


def _launcher_parts(compiled):
    """(the launcher's C entry point, Triton's descriptor expansion, the launcher) of a compiled kernel, or None
    where its launcher is not Triton 3.6's CudaLauncher with no scratch buffers."""
    try:
        from triton.backends.nvidia.driver import _BASE_ARGS_FORMAT_LEN, CudaLauncher, make_tensordesc_arg
    except ImportError:
        return None
    launcher = compiled.run
    if (_BASE_ARGS_FORMAT_LEN != _BASE_ARGS or not isinstance(launcher, CudaLauncher)
            or launcher.global_scratch_size or launcher.profile_scratch_size or launcher.num_ctas != 1):
        return None
    entry = launcher.launch
    if getattr(entry, "__closure__", None):  # wrap_handle_tensordesc's inner: the C entry is its `launcher`
        cells = dict(zip(entry.__code__.co_freevars, (c.cell_contents for c in entry.__closure__)))
        entry = cells.get("launcher")
    if entry is None or not callable(entry) or hasattr(entry, "__closure__"):  # not a C function
        return None
    return entry, make_tensordesc_arg, launcher


# What Triton's own launch calls for the current device and stream (torch's C entry points; the public
# torch.cuda functions around them cost a Python frame and a Stream object more per call).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or (lambda: torch.cuda.current_device())
_raw_stream = (getattr(torch._C, "_cuda_getCurrentRawStream", None)
               or (lambda index: torch.cuda.current_stream(index).cuda_stream))


try:  # the runtime knobs Triton's own launch reads its launch hooks from
    from triton import knobs as _knobs

    _RUNTIME_KNOBS = _knobs.runtime
except ImportError:  # pragma: no cover - Triton without knobs has no hooks to pass
    _RUNTIME_KNOBS = None
