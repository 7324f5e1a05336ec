"""The order in which the MoE GEMMs visit their output tiles: the grouped (GROUP_M) order, for L2 reuse.

Tile ``t`` of a grid of ``num_m`` x ``num_n`` tiles is ``(pid_m, pid_n)``. GROUP_M = 1 is row-major with the N
tiles fastest. GROUP_M > 1 walks bands of GROUP_M row tiles: within a band, the band's row tiles for one N tile,
then for the next N tile (the last band has the rows that are left). Why: with N tiles fastest, the ~132-264 tiles in
flight on an H100 cover one or two row tiles of a wide output (up: 2I = 28672 columns at Mixtral-8x7B, 224 tiles
of 128), so each row tile streams the whole expert weight from HBM again; in a band, a weight tile is read by
GROUP_M row tiles while it is in L2. The weight gradients take the same order over each dW[e]'s (row, column)
tiles, expert after expert: a band of dW row tiles shares the slices of the B operand (dgu, dy) in flight.

The order decides which program (or which turn of a persistent program) computes a tile, never a tile's arithmetic,
so every GROUP_M gives the same bits. The bands are over tile indices, not experts: a band may span two experts'
tiles (each tile still belongs to one, BLOCK_M dividing the segment).

One source, three uses: ``grouped_tile_order`` is plain Python over ints (what the tests enumerate), and the same
function compiled by Triton (``tile_order_tl``, the pointer and TMA kernels) and by Gluon (``tile_order_gl``, the
persistent warp-specialized kernels), so the kernels' index math is the tested one."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon


def grouped_tile_order(t, num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile ``t`` (0 <= t < num_m * num_n) in the grouped order; GROUP_M = 1: row-major, N fastest
    (two operations, no band arithmetic)."""
    if GROUP_M == 1:
        pid_m = t // num_n
        pid_n = t % num_n
    else:
        first_m = (t // num_n) // GROUP_M * GROUP_M  # the band's first row tile
        band_rows = min(num_m - first_m, GROUP_M)  # the last band: the row tiles that are left
        in_band = t - first_m * num_n
        pid_m = first_m + in_band % band_rows
        pid_n = in_band // band_rows
    return pid_m, pid_n


tile_order_tl = triton.jit(grouped_tile_order)
tile_order_gl = gluon.jit(grouped_tile_order)
