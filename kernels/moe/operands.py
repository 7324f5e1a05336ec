"""How the MoE grouped GEMMs address their weight operands: w1's gate/up column layout (interleaved, or split halves
read in place as interleaved pairs),  the ``[E, L, C]`` weight view's storage as a rank-3 TMA
descriptor (variant "tma"), as the 2-D TMA rows the Gluon kernels read (variant "ws"), and whether the ws weight
gradient can take its operands. A view the descriptors cannot address makes the table's pick fall back to the
same tile one load path down (kernels/moe/launch.py), which gives the same bits."""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from detkit.kernels.backend import ensure_cuda_context

# w1's [E, H, 2I] columns: "interleaved" (2j = gate_j, 2j+1 = up_j; the layer's own layout) or "split" ([gate (I) |
# up (I)], as transformers' gate_up_proj and nn.Linear stacks hold them), read in place as interleaved pairs.
GATE_UP_LAYOUTS = ("interleaved", "split")


def check_gate_up(gate_up: str) -> None:
    if gate_up not in GATE_UP_LAYOUTS:
        raise ValueError(f"gate_up {gate_up!r} is not supported; supported: {GATE_UP_LAYOUTS}")


def weight_storage(b: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """The storage view TMA would describe for the ``[E, L, C]`` weight view ``b`` and whether it is
    K-major (``[E, C, L]``), or None when TMA cannot address it."""
    if b.stride(2) == 1:
        store, k_major = b, False
    elif b.stride(1) == 1:
        store, k_major = b.transpose(1, 2), True
    else:
        return None
    item = b.element_size()
    if any(st * item % 16 for st in store.stride()[:2]) or b.data_ptr() % 16:
        return None
    return store, k_major


def ws_weight_rows(b: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """The 2-D ``[E*L, C]`` (K-major: ``[E*C, L]``) view of the ``[E, L, C]`` weight view ``b``'s storage that the
    "ws" kernel (kernels/moe/ws.py) describes by TMA, and whether it is K-major; None when TMA cannot address the
    storage or its expert dim does not flatten into rows without a copy."""
    found = weight_storage(b)
    if found is None:
        return None
    store, k_major = found
    if store.stride(0) != store.shape[1] * store.stride(1):
        return None
    return store.reshape(-1, store.shape[2]), k_major


def weight_descriptor(b: torch.Tensor, block_n: int, step_k: int) -> tuple[TensorDescriptor, bool]:
    """A rank-3 TMA descriptor over the storage of the ``[E, L, C]`` weight view ``b`` and whether that
    storage is K-major (``[E, C, L]``); refuses, naming the layout, what TMA cannot address."""
    found = weight_storage(b)
    if found is None:
        raise ValueError(
            f"variant 'tma' cannot describe the weight (shape {tuple(b.shape)}, strides {b.stride()}, "
            f"data_ptr % 16 = {b.data_ptr() % 16}): TMA needs its last or middle dim with stride 1, the other "
            f"strides multiples of {16 // b.element_size()} elements and a 16-byte-aligned base; use a 'ptr' config")
    store, k_major = found
    if b.is_cuda:  # the launch encodes the descriptor; autograd's backward thread may have no context yet
        ensure_cuda_context(b.device)
    box = [1, block_n, step_k] if k_major else [1, step_k, block_n]
    return TensorDescriptor(store, list(store.shape), list(store.stride()), box), k_major


def ws_wgrad_addresses(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the ws weight gradient can take A and B (row-major with 16-byte aligned rows: TMA, cp.async) and
    write ``out`` (contiguous)."""
    return out.is_contiguous() and all(
        t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0 for t in (a, b))
