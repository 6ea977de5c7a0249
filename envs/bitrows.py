"""Grids as row bitmasks: row i of a grid is a uint32 word whose bit j is cell (i, j).

Flood fills and cell tests become a few word operations per row, all on per-env scalars, which
is what XLA on CPU runs fast under an outer vmap (see envs/hashrng.py). Grids up to 32 columns.
"""

import jax
import jax.numpy as jnp


def pack_rows(cells):
    """uint32[h] row bitmasks of bool[h, w] cells."""
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(cells.shape[1], dtype=jnp.uint32))
    return jnp.sum(jnp.where(cells, weights, jnp.uint32(0)), axis=1, dtype=jnp.uint32)


def unpack_rows(rows, width):
    """bool[h, width] cells of uint32[h] row bitmasks."""
    cols = jnp.arange(width, dtype=jnp.uint32)
    return ((rows[:, None] >> cols[None, :]) & 1).astype(bool)


def cell_bit(col):
    """uint32 word with only bit `col` set (col int32, any shape)."""
    return jnp.left_shift(jnp.uint32(1), jnp.asarray(col).astype(jnp.uint32))


def flood(passable, row, col, rounds, width):
    """uint32[h] row bitmasks of the cells reachable from (row, col) in at most `rounds` moves
    through `passable` cells (uint32[h] row bitmasks of a grid `width` columns wide)."""
    h = passable.shape[0]
    inside = jnp.uint32((1 << width) - 1)  # a left shift must not leave the grid
    passable = tuple(passable[k] & inside for k in range(h))
    start = cell_bit(col)
    reach = tuple(jnp.where(row == k, start, jnp.uint32(0)) for k in range(h))

    def grow(_, r):
        zero = jnp.zeros_like(r[0])
        below, above = r[1:] + (zero,), (zero,) + r[:-1]
        return tuple(
            r[k] | (((r[k] << 1) | (r[k] >> 1) | below[k] | above[k]) & passable[k]) for k in range(h)
        )

    return jnp.stack(jax.lax.fori_loop(0, rounds, grow, reach))
