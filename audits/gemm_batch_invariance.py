"""Batch invariance of det_gemm_fwd and det_gemm_da: a row's output bits do not depend on M, on
where the row sits, on zero-row padding, on chunking, or on which pinned config ran."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from detkit.audits.gemm_common import launch
from detkit.kernels.backend import resolve_backend
from detkit.kernels.det_gemm.launch import all_configs, det_gemm_kernel
from detkit.toolkit.contract import compare_bits
from detkit.toolkit.fixtures import GemmCase, operands
from detkit.toolkit.harness import Row, RunContext
from detkit.toolkit.nvtx_ranges import nvtx_range
from detkit.toolkit.presets import GEMM_PRESETS

NAME = "gemm_batch_invariance"
DESCRIPTION = "fwd/dA rows bitwise equal across M, positions, padding, chunking and configs"
OPS = ("fwd", "da")
PAD_ROWS = 37  # odd, so padding crosses a tile boundary for every BLOCK_M in the table


def _row(ctx: RunContext, check: str, case: GemmCase, got: torch.Tensor, want: torch.Tensor, **details) -> Row:
    name = f"{check} {case.name}"
    result = compare_bits(got, want)
    return Row(suite=NAME, check=check, name=name, passed=result.equal, backend=ctx.backend,
               details={**details, **result.as_row()})


def run(ctx: RunContext) -> Iterator[Row]:
    preset = GEMM_PRESETS[ctx.preset]
    m_max = preset.m_max
    for op in OPS:
        for k, n in preset.kn_shapes:
            for layout in preset.layouts:
                big = GemmCase(op, m_max, n, k, layout, ctx.seed, preset.device_draws)
                x, w = operands(big, ctx.device)
                with nvtx_range(f"reference {big.name}"):
                    out_big, launch_info = launch(op, x, w)
                for m in preset.m_values:
                    case = GemmCase(op, m, n, k, layout, ctx.seed)
                    if m < m_max:
                        with nvtx_range(f"m_sweep {case.name}"):
                            got, info = launch(op, x[:m], w)
                        yield _row(ctx, "m_sweep", case, got, out_big[:m], config=info.config.label(),
                                   reference_m=m_max)
                        # The same rows taken from the end of the batch: position does not matter.
                        with nvtx_range(f"position {case.name}"):
                            got = launch(op, x[m_max - m:], w)[0]
                        yield _row(ctx, "position", case, got, out_big[m_max - m:], rows_from=m_max - m)
                    padded = torch.cat([x[:m], torch.zeros(PAD_ROWS, x.shape[1], dtype=x.dtype, device=x.device)])
                    with nvtx_range(f"zero_padding {case.name}"):
                        got = launch(op, padded, w)[0][:m]
                    yield _row(ctx, "zero_padding", case, got, out_big[:m], pad_rows=PAD_ROWS)
                gen = torch.Generator().manual_seed(ctx.seed + m_max)
                perm = torch.randperm(m_max, generator=gen).to(ctx.device)
                with nvtx_range(f"permutation {big.name}"):
                    got = launch(op, x[perm], w)[0]
                yield _row(ctx, "permutation", big, got, out_big[perm])
                with nvtx_range(f"chunking {big.name}"):
                    got = torch.cat([launch(op, part, w)[0] for part in torch.split(x, preset.chunk)])
                yield _row(ctx, "chunking", big, got, out_big, chunk_rows=preset.chunk)
                # Every config the table can pick, on the first config_m rows of the batch (a row's bits do not
                # depend on M, so the reference is the batch's output).
                rows = preset.config_m or m_max
                cut = GemmCase(op, rows, n, k, layout, ctx.seed)
                for config in all_configs(op, resolve_backend(det_gemm_kernel, {"x": x})):
                    if config == launch_info.config and rows == m_max:
                        continue  # that is the reference itself
                    with nvtx_range(f"config {config.label()} {cut.name}"):
                        got = launch(op, x[:rows], w, config=config)[0]
                    yield _row(ctx, "config", cut, got, out_big[:rows], config=config.label(),
                               reference_config=launch_info.config.label(), reference_m=m_max)
