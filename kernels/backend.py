"""Which backend a detkit kernel runs on, decided from the tensors and Triton's own mode, and how a compiled
kernel is launched there.

Two backends exist and every result names the one it ran on:
- ``cuda_sm90``: compiled Triton on a Hopper GPU (compute capability 9.0).
- ``triton_interpreter``: CPU tensors under ``TRITON_INTERPRET=1`` (used by CI).

Anything else raises before any work is done; there is no silent fallback.

``DirectLaunch`` is the host side of a launch whose arguments a caller has already worked out once (a
launch plan): its first call is Triton's own ``kernel[grid](...)``, which compiles (or loads) the kernel and
returns the compiled handle; every later call hands the argument list straight to that handle's launcher,
skipping Triton's per-call argument binding, specialization key and cache lookup. ``PlannedKernel`` keys such
plans on what Triton specializes on, so that a call's pointers, integers, floats and grid change per call while the
compiled binary stays the one Triton would pick.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import threading
from typing import NamedTuple

import torch
import triton

from detkit.kernels import interpreter

CUDA_SM90 = "cuda_sm90"
TRITON_INTERPRETER = "triton_interpreter"
BACKENDS = (CUDA_SM90, TRITON_INTERPRETER)

# Offsets inside most kernels are 32-bit; check_bf16_matrix refuses tensors whose furthest element is beyond
# them unless the caller's kernel computes 64-bit offsets (max_offset=None).
MAX_INT32_OFFSET = 2**31 - 1

# Every kernel module imports this one: under the interpreter, before any kernel runs, skip the interpreter's redundant
# work (kernels/interpreter.py; the same results, about half the interpreter time).
if triton.knobs.runtime.interpret:
    interpreter.install()


def kernel_is_interpreted(jit_fn) -> bool:
    """True when Triton built ``jit_fn`` for its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(jit_fn, _interpreted_function())


@functools.cache
def _interpreted_function() -> type:
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction


def resolve_backend(jit_fn, tensors: dict[str, torch.Tensor]) -> str:
    """Return the backend ``jit_fn`` will run ``tensors`` on, or raise naming what is unsupported."""
    device = None
    for t in tensors.values():
        if device is None:
            device = t.device
        elif t.device != device:
            break
    else:
        if device is not None:
            return _backend_of_device(jit_fn, device)
    return resolve_backend_of_devices(jit_fn, {name: t.device for name, t in tensors.items()})


def resolve_backend_of_devices(jit_fn, devices: dict[str, torch.device]) -> str:
    """``resolve_backend`` from the tensors' devices alone (what a launch plan keeps of them)."""
    values = iter(devices.values())
    device = next(values, None)
    if device is None or any(other != device for other in values):
        raise ValueError(f"all tensors must be on one device; got {devices}")
    return _backend_of_device(jit_fn, device)


def _backend_of_device(jit_fn, device: torch.device) -> str:
    interpreted = kernel_is_interpreted(jit_fn)
    if device.index is None:  # the current CUDA device, which may change: not cached
        return _backend_of.__wrapped__(device, interpreted)
    return _backend_of(device, interpreted)


@functools.lru_cache(maxsize=64)
def _backend_of(device: torch.device, interpreted: bool) -> str:
    """The backend of one device (cached per device: torch's ``device.type`` alone costs a microsecond a read)."""
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
    """One compiled kernel's launches with given launch options on one CUDA device.

    The caller passes the kernel's full argument list in its parameter order (constexprs included, as Triton's
    binder would bind them) and guarantees that every call of this object specializes the same way (same
    dtypes, pointer alignments, integer values' 1 / multiple-of-16 / 32- or 64-bit classes, descriptor block shapes)
    and that only the arguments at ``dynamic`` (positions) change between calls: a launch plan keyed on the call's
    signature does. The grid is fixed (``grid``) or passed per call (1 to 3 dims). The first call is Triton's
    ``kernel[grid](...)`` (with real descriptors); it returns the compiled kernel. Later calls pass
    ``HostDescriptor``s for descriptor arguments and run on the device's current stream:
    - with no launch hook set, straight into the launcher's C entry point (``RawLaunch``), the arguments expanded
      as Triton's launcher expands them, pointers passed as addresses, scalars as their values and each
      descriptor's encoded CUtensorMap cached per base address;
    - with a hook set (profilers), through the compiled kernel's launcher with the hook, as Triton does."""

    __slots__ = ("kernel", "grid", "options", "index", "dynamic", "compiled", "run", "function", "packed", "raw")

    def __init__(self, kernel, grid: tuple[int, ...], options: dict, device: torch.device,
                 dynamic: tuple[int, ...] | None = None):
        self.kernel, self.grid, self.options, self.dynamic = kernel, grid_3d(grid), options, dynamic
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.compiled = self.run = self.function = self.packed = self.raw = None

    @property
    def ready(self) -> bool:
        """Whether the kernel is compiled (later calls launch directly)."""
        return self.run is not None

    def __call__(self, args: list, grid: tuple[int, int, int] | None = None) -> None:
        """Launch with ``args``; ``grid`` (x, y, z) for this call, None for the plan's own."""
        if grid is None:
            grid = self.grid
        if _current_device() != self.index:
            with torch.cuda.device(self.index):
                return self._launch(args, grid)
        return self._launch(args, grid)

    def _launch(self, args: list, grid: tuple[int, int, int]) -> None:
        if self.run is None:
            compiled = self.kernel[grid](*args, **self.options)
            self.function, self.packed = compiled.function, compiled.packed_metadata
            self.compiled, self.run = compiled, compiled.run
            self.raw = RawLaunch.of(compiled, grid, args, self.dynamic)
            return
        stream = _raw_stream(self.index)
        enter = _RUNTIME_KNOBS.launch_enter_hook
        if getattr(enter, "calls", True):  # a hook is set: name the launch for it, as Triton does
            metadata = self.compiled.launch_metadata(grid, stream, *args)
            self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed, metadata, enter,
                     _RUNTIME_KNOBS.launch_exit_hook, *args)
        elif self.raw is not None:
            self.raw(args, stream, grid)
        else:
            self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed, None, None, None, *args)


def grid_3d(grid) -> tuple[int, int, int]:
    """A launch grid of 1 to 3 ints as (x, y, z); a ValueError names anything else."""
    if type(grid) is tuple and len(grid) == 3:  # the launchers' own grids: checked without a generator
        x, y, z = grid
        if type(x) is int and type(y) is int and type(z) is int and x >= 0 and y >= 0 and z >= 0:
            return grid
    elif isinstance(grid, (tuple, list)) and 1 <= len(grid) <= 3 and all(
            isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in grid):
        return (*grid, *(1,) * (3 - len(grid)))
    raise ValueError(f"a launch grid is 1 to 3 non-negative ints; got {grid!r}")


# Launch plans kept per PlannedKernel (one per call signature: dtypes, alignments, integer classes, constexprs,
# options); emptied when full.
MAX_PLANS = 256

# How Triton specializes a parameter (triton/runtime/jit.py, Triton 3.6): a constexpr on its value; otherwise, unless
# listed in ``do_not_specialize``, an int equal to 1 becomes a constant, and unless also listed in
# ``do_not_specialize_on_alignment`` an int on whether it is a multiple of 16 and a pointer on its 16-byte alignment.
CONSTEXPR, SPECIALIZED, NOT_ON_ALIGNMENT, NOT_SPECIALIZED = range(4)


def parameter_modes(kernel) -> tuple[int, ...]:
    """Each parameter's specialization mode (``CONSTEXPR`` ... ``NOT_SPECIALIZED``) of a Triton ``JITFunction``.
    A non-constexpr parameter with a type annotation (which Triton specializes by its annotation, not its value) is
    refused: no detkit kernel has one, and a plan keyed on the value could pick another binary than Triton."""
    modes = []
    for param in kernel.params:
        if param.is_constexpr:
            modes.append(CONSTEXPR)
        elif param.annotation:
            raise NotImplementedError(
                f"{kernel.fn.__name__}: parameter {param.name!r} is annotated {param.annotation!r}; a planned launch "
                "supports constexpr annotations only (unannotated runtime parameters)")
        elif param.do_not_specialize:
            modes.append(NOT_SPECIALIZED)
        elif param.do_not_specialize_on_alignment:
            modes.append(NOT_ON_ALIGNMENT)
        else:
            modes.append(SPECIALIZED)
    return tuple(modes)


class PlannedKernel:
    """``planned[grid](*args, **kwargs)`` does what ``kernel[grid](*args, **kwargs)`` does, with the same arguments,
    through a ``DirectLaunch`` per call signature on a GPU (Triton's own launch under the interpreter);
    ``planned.launch(grid, args, options)`` the same with every parameter passed in order (no binding).

    The signature is what Triton specializes on (``parameter_modes``, ``signature_of``): each constexpr's value,
    each integer's class (a constant 1, a multiple of 16, 32- or 64-bit; fewer classes where the kernel does not
    specialize it), a float's or bool's type, each tensor's dtype (and 16-byte alignment where specialized), each TMA
    descriptor's type, dtype, block shape, layout and padding; besides the launch options and the current device.
    Per call, and never part of the signature: the grid (1 to 3 dims), the tensors, the descriptors (a descriptor's
    base, shape and strides encoded per call, cached per base address by ``RawLaunch``) and the scalars' values."""

    __slots__ = ("kernel", "names", "defaults", "plans", "keyers", "interpreted", "modes")

    def __init__(self, kernel):
        self.kernel = kernel
        self.names = tuple(kernel.arg_names)
        self.defaults = {p.name: p.default for p in inspect.signature(kernel.fn).parameters.values()
                         if p.default is not inspect.Parameter.empty}
        self.plans: dict = {}
        self.keyers: dict = {}
        self.interpreted = kernel_is_interpreted(kernel)
        self.modes = () if self.interpreted else parameter_modes(kernel)

    def __getitem__(self, grid):
        if self.interpreted:
            return self.kernel[grid]
        return functools.partial(self._bind, grid_3d(grid))

    def _bind(self, grid, *args, **kwargs):
        names = self.names
        values = list(args)
        for name in names[len(args):]:
            if name in kwargs:
                values.append(kwargs.pop(name))
            elif name in self.defaults:
                values.append(self.defaults[name])
            else:
                raise TypeError(f"{self.kernel.fn.__name__}: missing argument {name!r}")
        self._launch(grid, values, kwargs)

    def launch(self, grid, args: list, options: dict) -> None:
        """``kernel[grid](*args, **options)`` with ``args`` every parameter in order (constexprs included) and
        ``options`` launch options only (num_warps, num_stages, ...)."""
        if self.interpreted:
            self.kernel[grid](*args, **options)
            return
        if len(args) != len(self.names):
            raise TypeError(f"{self.kernel.fn.__name__}: launch takes all {len(self.names)} parameters in order; got "
                            f"{len(args)} arguments")
        self._launch(grid_3d(grid), args, options)

    def signature(self, values) -> tuple:
        """The plan key of an argument list (every parameter in order), less the device and options: the arguments'
        types, then what Triton specializes on of each (``signature_of``'s classes), computed by a function generated
        once per tuple of argument types (``key_function``): no per-argument Python call."""
        kinds = tuple(map(type, values))
        keyer = self.keyers.get(kinds)
        if keyer is None:
            if len(self.keyers) >= MAX_PLANS:
                self.keyers.clear()
            keyer = self.keyers[kinds] = key_function(kinds, self.modes)
        return kinds, *keyer(values)

    def _launch(self, grid, values, options):
        index = _current_device()
        key = (index, *sorted(options.items()), *self.signature(values))
        plan = self.plans.get(key)
        if plan is None:
            if len(self.plans) >= MAX_PLANS:
                self.plans.clear()
            dynamic = tuple(i for i, (v, m) in enumerate(zip(values, self.modes)) if per_call(v, m))
            plan = self.plans[key] = DirectLaunch(self.kernel, grid, options, torch.device("cuda", index), dynamic)
        plan(values, grid)


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


# An integer's class as Triton 3.6 types it (native_specialize_impl): 32-bit, else unsigned 64-bit from 2**63, else
# 64-bit; "D" marks a multiple of 16 where the parameter is specialized on it. ONE: the constant 1.
ONE = "1"
_INT_CLASSES = {(width, divisible): width + ("D" if divisible else "") for width in ("i32", "i64", "u64")
                for divisible in (False, True)}


def _int_class(value: int) -> str:
    if -0x80000000 <= value < 0x80000000:
        return "i32"
    return "u64" if value >= 0x8000000000000000 else "i64"


def signature_of(value, mode: int = SPECIALIZED):
    """What of one argument a plan is keyed on: exactly what Triton 3.6 specializes on for a parameter of ``mode``
    (``parameter_modes``). A constexpr stands for its value (True == 1 == 1.0 as keys: other types carry their type);
    an int for its class (``ONE``, or "i32" / "i64" / "u64" with "D" when a multiple of 16 matters); a bool or a
    float for its type only; a tensor for its dtype, and its 16-byte alignment where specialized; a TMA descriptor
    for its type, dtype, block shape, layout and padding."""
    kind = type(value)
    if mode == CONSTEXPR:
        return value if kind is int else (kind, value)
    if kind is int:
        if mode == NOT_SPECIALIZED:
            return _int_class(value)
        if value == 1:
            return ONE
        return _INT_CLASSES[_int_class(value), mode == SPECIALIZED and value & 15 == 0]
    if kind is torch.Tensor or isinstance(value, torch.Tensor):
        if mode == SPECIALIZED:
            return value.dtype, value.data_ptr() & 15 == 0
        return value.dtype
    if kind is float:
        return "fp32"
    if kind is bool:
        return "u1"
    if isinstance(value, _DESCRIPTOR_TYPES):
        return kind, value.base.dtype, tuple(value.block_shape), getattr(value, "layout", None), value.padding
    return kind, value


# An int's class as one small int (the key function's form of ``signature_of``'s): 1 the constant 1 (where specialized),
# + 2 a multiple of 16 (where specialized on it), + 4 outside 32 bits, + 8 unsigned 64-bit.
_INT_CODE = {
    SPECIALIZED: "((x := a[{i}]) == 1) + 2 * (x & 15 == 0) + 4 * (not -0x80000000 <= x < 0x80000000) "
                 "+ 8 * (x >= 0x8000000000000000)",
    NOT_ON_ALIGNMENT: "((x := a[{i}]) == 1) + 4 * (not -0x80000000 <= x < 0x80000000) + 8 * (x >= 0x8000000000000000)",
    NOT_SPECIALIZED: "4 * (not -0x80000000 <= (x := a[{i}]) < 0x80000000) + 8 * (x >= 0x8000000000000000)",
}


def key_function(kinds: tuple[type, ...], modes: tuple[int, ...]):
    """A function of an argument list whose arguments have the types ``kinds`` that returns what a plan is keyed on
    besides those types: ``signature_of`` of each argument, in one generated expression (types known, so no
    dispatch per argument): a constexpr's value; an int's class code (``_INT_CODE``); a tensor's dtype and, where
    specialized, its 16-byte alignment; nothing for a float, a bool or None (their type says all); a TMA
    descriptor's and any other object's ``signature_of``."""
    parts = []
    for i, (kind, mode) in enumerate(zip(kinds, modes)):
        if mode == CONSTEXPR:
            parts.append(f"a[{i}]")
        elif kind is int:
            parts.append(_INT_CODE[mode].format(i=i))
        elif kind in (float, bool, type(None)):
            continue
        elif issubclass(kind, torch.Tensor):
            parts.append(f"a[{i}].dtype")
            if mode == SPECIALIZED:
                parts.append(f"a[{i}].data_ptr() & 15 == 0")
        else:
            parts.append(f"signature_of(a[{i}], {mode})")
    namespace = {"signature_of": signature_of}
    exec(f"def key(a):\n    return ({', '.join(parts)}{',' if parts else ''})\n", namespace)
    return namespace["key"]


def per_call(value, mode: int) -> bool:
    """Whether a plan takes this argument per call (a tensor, a descriptor, a scalar that is a launcher argument)
    rather than from its signature (a constexpr, the constant 1, None, any other object keyed on its value)."""
    if mode == CONSTEXPR:
        return False
    kind = type(value)
    if kind is int:
        return mode == NOT_SPECIALIZED or value != 1
    return kind in (float, bool) or isinstance(value, (torch.Tensor, *_DESCRIPTOR_TYPES))


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
    the encoded CUtensorMap, its shape and its strides), and per call the grid, the stream and the ``dynamic``
    arguments filled in: a pointer as its address, a scalar (an integer or float the launcher takes) as its value, a
    descriptor as the CUtensorMap encoded for its base address (cached: the encoding depends on nothing else, the
    plan fixing shape, strides and block). A constexpr (an integer Triton specialized to 1 among them) is a
    placeholder the launcher skips. ``of`` returns None where this Triton's launcher is not the one this mirrors
    (then the caller keeps Triton's launcher)."""

    __slots__ = ("entry", "encode", "template", "pointers", "scalars", "descriptors")

    def __init__(self, entry, encode, template: list, pointers: tuple, descriptors: tuple, scalars: tuple = ()):
        self.entry, self.encode, self.template = entry, encode, template
        self.pointers, self.scalars, self.descriptors = pointers, scalars, descriptors

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
        grid = grid_3d(grid)
        template = [*grid, 0, compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                    None, None, compiled.packed_metadata, None, None, None]
        pointers, scalars, descriptors, desc_index = [], [], [], 0
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
            elif index not in dynamic or sig == "constexpr":
                template.append(arg)  # fixed by the plan's key, or a constexpr the launcher skips
            elif is_pointer[index]:
                pointers.append((index, len(template)))
                template.append(None)  # filled per call: the template keeps no caller's tensor alive
            elif sig in _SCALAR_TYPES:
                scalars.append((index, len(template)))
                template.append(None)
            else:
                return None  # a per-call argument of a kind this does not mirror
        return cls(entry, encode, template, tuple(pointers), tuple(descriptors), tuple(scalars))

    def __call__(self, args: list, stream: int, grid: tuple[int, int, int] | None = None) -> None:
        out = self.template.copy()
        if grid is not None:
            out[0], out[1], out[2] = grid
        out[_STREAM_AT] = stream
        for index, at in self.pointers:
            out[at] = args[index].data_ptr()
        for index, at in self.scalars:
            out[at] = args[index]
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


# The scalar types a compiled kernel's signature gives its launcher (Triton 3.6's ty_to_cpp): passed per call as
# Python ints, floats or bools.
_SCALAR_TYPES = frozenset(("i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64", "fp16", "bf16", "fp32",
                           "f32", "fp64"))


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
