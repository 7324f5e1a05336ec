"""Seeded BF16 inputs. Drawn on the CPU from one generator, then moved, so every device and every
process sees the same bits for the same (seed, shape); det_gemm's operands above HOST_DRAW_MAX_ELEMENTS are drawn
on their CUDA device (seeded: the same bits on the same kind of device). One place builds each GEMM op's operands,
so every det_gemm audit, the fresh-process worker and the benchmark draw the same bits."""

from __future__ import annotations

from dataclasses import dataclass

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


# Operands with more elements than this are drawn on their device (seeded: the same bits in every process on the
# same kind of device); smaller ones on the CPU (the same bits on every device), unless a case asks for device draws
# (GemmCase.device_draws: the zoo preset and the benchmark, whose hundreds of cases would each spend up to seconds
# drawing on the CPU). The Qwen3-8B TP=2 preset's operands stay below it.
HOST_DRAW_MAX_ELEMENTS = 2**27


def draw(shape: tuple[int, int], seed: int, device: torch.device, scale: float = 1.0,
         host_max: int = HOST_DRAW_MAX_ELEMENTS) -> torch.Tensor:
    """Seeded standard-normal BF16 values times ``scale``: ``bf16_randn``, or on a CUDA device when larger
    than ``host_max`` elements."""
    if shape[0] * shape[1] <= host_max or torch.device(device).type != "cuda":
        return bf16_randn(shape, seed, device, scale=scale)
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float32, device=device) * scale).to(torch.bfloat16)


def weight(k: int, n: int, seed: int, layout: str, device: torch.device,
           host_max: int = HOST_DRAW_MAX_ELEMENTS) -> torch.Tensor:
    """``weight_kn`` (b [K, N], contiguous or nn.Linear's weight.t()), drawn as ``draw`` does."""
    if k * n <= host_max or torch.device(device).type != "cuda":
        return weight_kn(k, n, seed, layout, device)
    if layout == "kn":
        return draw((k, n), seed, device, scale=k**-0.5, host_max=host_max)
    if layout == "linear":
        return draw((n, k), seed, device, scale=k**-0.5, host_max=host_max).t()
    raise ValueError(f"layout {layout!r} is not supported; supported: {LAYOUTS}")


@dataclass(frozen=True)
class GemmCase:
    op: str  # fwd | da | db
    m: int
    n: int
    k: int
    layout: str  # kn | linear: how the weight b [K, N] is stored (fwd and dA)
    seed: int
    device_draws: bool = False  # draw every operand on a CUDA device (see HOST_DRAW_MAX_ELEMENTS)

    @property
    def name(self) -> str:
        from detkit.kernels.det_gemm.launch import case_name  # kernels load when a case runs, not with the CLI

        suffix = f" b={self.layout}" if self.op != "db" else ""
        return case_name(self.op, self.m, self.n, self.k) + suffix


def operands(case: GemmCase, device: torch.device, m_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two operands of ``case``: (a, b) for fwd, (dc, b) for dA, (a, dc) for dB.

    The M-sized operand is drawn at ``m_rows`` (default case.m) rows; smaller M values are cut from
    it by the batch-invariance audit, so a row's values do not depend on M.
    """
    rows = case.m if m_rows is None else m_rows
    host_max = 0 if case.device_draws else HOST_DRAW_MAX_ELEMENTS
    if case.op == "fwd":
        return (draw((rows, case.k), case.seed, device, host_max=host_max),
                weight(case.k, case.n, case.seed + 1, case.layout, device, host_max=host_max))
    if case.op == "da":
        return (draw((rows, case.n), case.seed + 2, device, host_max=host_max),
                weight(case.k, case.n, case.seed + 1, case.layout, device, host_max=host_max))
    if case.op == "db":
        return (draw((rows, case.k), case.seed, device, host_max=host_max),
                draw((rows, case.n), case.seed + 2, device, scale=case.m**-0.5, host_max=host_max))
    raise ValueError(f"op {case.op!r} is not supported; supported: fwd, da, db")
