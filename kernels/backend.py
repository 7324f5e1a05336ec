"""Which backend a detkit kernel runs on, decided from the tensors and Triton's own mode.

Two backends exist and every result names the one it ran on:
- ``cuda_sm90``: compiled Triton on a Hopper GPU (compute capability 9.0).
- ``triton_interpreter``: CPU tensors under ``TRITON_INTERPRET=1`` (used by CI).

Anything else raises before any work is done; there is no silent fallback.
"""

from __future__ import annotations

import ctypes
import functools

import torch

CUDA_SM90 = "cuda_sm90"
TRITON_INTERPRETER = "triton_interpreter"
BACKENDS = (CUDA_SM90, TRITON_INTERPRETER)

# Offsets inside the kernels are 32-bit; refuse tensors whose furthest element is beyond them.
MAX_INT32_OFFSET = 2**31 - 1


def kernel_is_interpreted(jit_fn) -> bool:
    """True when Triton built ``jit_fn`` for its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(jit_fn, InterpretedFunction)


def resolve_backend(jit_fn, tensors: dict[str, torch.Tensor]) -> str:
    """Return the backend ``jit_fn`` will run ``tensors`` on, or raise naming what is unsupported."""
    devices = {name: t.device for name, t in tensors.items()}
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


def check_bf16_matrix(name: str, t: torch.Tensor) -> None:
    """Refuse anything but a non-empty 2-D bf16 tensor whose offsets fit 32-bit kernel arithmetic."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: torch.bfloat16")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D; got shape {tuple(t.shape)}")
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name} has an empty dimension (shape {tuple(t.shape)}); supported: every dim >= 1")
    if any(s < 0 for s in t.stride()):
        raise ValueError(f"{name} has negative strides {t.stride()}; supported: non-negative strides")
    furthest = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    if furthest > MAX_INT32_OFFSET:
        raise ValueError(
            f"{name} (shape {tuple(t.shape)}, strides {t.stride()}) spans element offset "
            f"{furthest}; supported: offsets below 2**31 (32-bit kernel indexing)"
        )


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


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _cu_check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with CUresult {status}")
