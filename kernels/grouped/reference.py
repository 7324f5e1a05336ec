"""Pure-torch references of the grouped GEMM family, what every test and audit compares the kernels to.

``*_ref``: the exact products accumulated in FP64 (or FP32) and left unrounded, for the contract's error bound.
``*_sequential``: the interpreter's semantics, bit for bit: each output element the exact BF16 products added one
at a time in FP32 in ascending order of the reduced index, then rounded once to BF16 (nearest-even). Both read the
offsets on the host (they are references, not a route).
"""

from __future__ import annotations

import torch


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = [int(v) for v in offs.tolist()]
    return list(zip([0] + ends[:-1], ends))


def grouped_mm_ref(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype = torch.float64):
    """``a [M, K]``, ``b [G, K, N]``, ``offs [G]``: rows ``offs[g-1]:offs[g]`` times ``b[g]``, unrounded in ``dtype``;
    rows past ``offs[-1]`` are 0 (as the kernel writes them)."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=dtype, device=a.device)
    for g, (s, e) in enumerate(_bounds(offs)):
        out[s:e] = a[s:e].to(dtype) @ b[g].to(dtype)
    return out


def grouped_wgrad_ref(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype = torch.float64):
    """``a [P, R]``, ``b [R, Q]``, ``offs [G]`` along R: ``[G, P, Q]`` with ``out[g] = a[:, s:e] @ b[s:e]``,
    unrounded in ``dtype`` (0 for an empty group)."""
    out = torch.zeros(offs.shape[0], a.shape[0], b.shape[1], dtype=dtype, device=a.device)
    for g, (s, e) in enumerate(_bounds(offs)):
        out[g] = a[:, s:e].to(dtype) @ b[s:e].to(dtype)
    return out


def _sequential(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, L] @ b [L, N]``: one FP32 add per exact product, ascending in L, rounded once to BF16."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    a32, b32 = a.float(), b.float()
    for i in range(a.shape[1]):
        acc = acc + a32[:, i:i + 1] * b32[i:i + 1, :]  # BF16 x BF16 is exact in FP32; separate ops: no FMA
    return acc.to(torch.bfloat16)


def grouped_mm_sequential(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``grouped_mm_ref``'s product with the interpreter's rounding (module docstring), in BF16."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.bfloat16, device=a.device)
    for g, (s, e) in enumerate(_bounds(offs)):
        out[s:e] = _sequential(a[s:e], b[g])
    return out


def grouped_wgrad_sequential(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``grouped_wgrad_ref``'s product with the interpreter's rounding, in BF16: each group's rows ascending."""
    out = torch.zeros(offs.shape[0], a.shape[0], b.shape[1], dtype=torch.bfloat16, device=a.device)
    for g, (s, e) in enumerate(_bounds(offs)):
        out[g] = _sequential(a[:, s:e], b[s:e])
    return out


def clamped_swiglu_ref(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gates.py's forward in torch: x [R, 2I] (interleaved gate/up) -> [R, I] in x's dtype, FP32 math, one rounding."""
    gate, up = x[:, ::2].float(), x[:, 1::2].float()
    g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
    return ((u + 1) * (g * torch.sigmoid(alpha * g))).to(x.dtype)


def clamped_swiglu_bwd_ref(x: torch.Tensor, dout: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gates.py's backward in torch: dx [R, 2I] (interleaved dgate/dup) in x's dtype, FP32 math, one rounding each."""
    gate, up, d = x[:, ::2].float(), x[:, 1::2].float(), dout.float()
    g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
    s = torch.sigmoid(alpha * g)
    dgate = torch.where(gate <= limit, d * (u + 1) * s * (1 + alpha * g * (1 - s)), 0.0)
    dup = torch.where((up >= -limit) & (up <= limit), d * (g * s), 0.0)
    return torch.stack((dgate, dup), dim=-1).reshape(x.shape).to(x.dtype)


def route_combine_ref(y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """combine.py's combine (``weights`` None: the gather's backward, unscaled) in torch: FP32, ascending k, each
    product and sum rounded on its own, one BF16 rounding."""
    rows = y[inverse.long()].float()  # [T, K, H]
    w = None if weights is None else weights.float()
    total = rows[:, 0] if w is None else w[:, :1] * rows[:, 0]
    for k in range(1, rows.shape[1]):
        total = total + (rows[:, k] if w is None else w[:, k:k + 1] * rows[:, k])
    return total.to(y.dtype)


def route_sum_ref(d: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """combine.py's ``route_sum`` in torch."""
    return route_combine_ref(d, inverse, None)


def route_combine_bwd_ref(dout: torch.Tensor, y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """combine.py's combine backward in torch: dy [S, H] (bf16(w * dout) at each route's sorted row) and dw [T, K]
    (FP64 sums of the FP32 products, rounded to FP32, then to the weights' dtype: a yardstick, not the kernel's
    order)."""
    idx = inverse.long()
    d = dout.float()
    dy = torch.empty_like(y)
    dy[idx.reshape(-1)] = (weights.float()[:, :, None] * d[:, None, :]).to(y.dtype).reshape(-1, y.shape[1])
    dw = (d[:, None, :].double() * y[idx].double()).sum(-1).float()
    return dy, dw.to(weights.dtype)
