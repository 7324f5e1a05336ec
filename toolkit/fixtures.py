"""Seeded BF16 inputs. Drawn on the CPU from one generator, then moved, so every device and every
process sees the same bits for the same (seed, shape)."""

from __future__ import annotations

import torch

LAYOUTS = ("kn", "linear")  # b stored [K, N] row-major, or nn.Linear's [N, K] passed as weight.t()


def bf16_randn(shape: tuple[int, ...], seed: int, device: torch.device | str = "cpu",
               scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(torch.bfloat16).to(device)


def weight_kn(k: int, n: int, seed: int, layout: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """A weight in the ``b [K, N]`` convention: contiguous, or the ``.t()`` view of an ``[N, K]`` tensor."""
    if layout == "kn":
        return bf16_randn((k, n), seed, device, scale=k**-0.5)
    if layout == "linear":
        return bf16_randn((n, k), seed, device, scale=k**-0.5).t()
    raise ValueError(f"layout {layout!r} is not supported; supported: {LAYOUTS}")
