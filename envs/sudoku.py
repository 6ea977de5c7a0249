"""RAGEN-2's Sudoku, first part: the level generator on device and a solver (host).

Not an env yet (no `reset`/`step`, not registered): docs/envs_sudoku_2048.md lists what the
reference's env does and what is left.

The reference (`ragen/env/sudoku/utils.py`, `generate_sudoku_puzzle`) fills a 9x9 grid by
backtracking with shuffled digits, then blanks int(81 * 0.4) = 32 (`easy`) or 40 (`medium`)
cells drawn at random, without checking that the solution is unique (its rewards allow for
that: a valid placement that is not the generated solution's digit pays half). `generate`
draws the solution from the key by the symmetries of a base grid (a digit relabelling, the
three bands and the three stacks permuted, the rows inside each band and the columns inside
each stack permuted, a transpose): every such grid is a valid Sudoku, but only the ~1.2e12
grids of one symmetry class are reached, not all 6.7e21. The blanks are then `blanks` cells
drawn uniformly, as the reference; uniqueness is not enforced either (`count_solutions`
measures it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SIZE, BOX = 9, 3
BLANKS = {"easy": int(SIZE * SIZE * 0.4), "medium": int(SIZE * SIZE * 0.5),
          "hard": int(SIZE * SIZE * 0.6)}  # the reference's cells_to_remove
_BASE = np.array([[(BOX * (r % BOX) + r // BOX + c) % SIZE + 1 for c in range(SIZE)]
                  for r in range(SIZE)], np.int32)


def check_blanks(blanks) -> None:
    """One-line ValueError unless 0 <= blanks <= 81 (an int)."""
    if not isinstance(blanks, (int, np.integer)) or isinstance(blanks, bool) \
            or not 0 <= blanks <= SIZE * SIZE:
        raise ValueError(f"Sudoku blanks must be an int in [0, {SIZE * SIZE}], got {blanks!r}")


def _line_order(key):
    """int32[9]: a permutation of 9 lines that keeps groups of 3 together (bands or stacks
    permuted, and the lines inside each)."""
    k_outer, k_inner = jax.random.split(key)
    outer = jax.random.permutation(k_outer, BOX)
    inner = jax.vmap(lambda k: jax.random.permutation(k, BOX))(jax.random.split(k_inner, BOX))
    return (outer[:, None] * BOX + inner).reshape(-1).astype(jnp.int32)


def generate(key, blanks: int):
    """(puzzle int32[9, 9] with 0 for a blank, solution int32[9, 9]). Jittable; `blanks` is
    static."""
    check_blanks(blanks)
    k_digits, k_rows, k_cols, k_t, k_blank = jax.random.split(key, 5)
    digits = jnp.concatenate([jnp.zeros(1, jnp.int32),
                              jax.random.permutation(k_digits, SIZE).astype(jnp.int32) + 1])
    grid = digits[jnp.asarray(_BASE)]
    grid = grid[_line_order(k_rows)][:, _line_order(k_cols)]
    grid = jnp.where(jax.random.bernoulli(k_t), grid.T, grid)
    order = jnp.argsort(jax.random.uniform(k_blank, (SIZE * SIZE,)))
    blank = jnp.zeros(SIZE * SIZE, bool).at[order[:blanks]].set(True).reshape(SIZE, SIZE)
    return jnp.where(blank, 0, grid).astype(jnp.int32), grid.astype(jnp.int32)


def is_valid_solution(grid) -> bool:
    """Host: every row, column and box of int[9, 9] holds 1..9 once."""
    g = np.asarray(grid)
    want = set(range(1, SIZE + 1))
    boxes = [g[r:r + BOX, c:c + BOX].reshape(-1) for r in range(0, SIZE, BOX)
             for c in range(0, SIZE, BOX)]
    return all(set(x.tolist()) == want for x in [*g, *g.T, *boxes])


def _candidates(g, r, c):
    b = g[r // BOX * BOX:r // BOX * BOX + BOX, c // BOX * BOX:c // BOX * BOX + BOX]
    return set(range(1, SIZE + 1)) - set(g[r].tolist()) - set(g[:, c].tolist()) \
        - set(b.reshape(-1).tolist())


def count_solutions(puzzle, limit: int = 2) -> tuple[int, np.ndarray | None]:
    """Host solver: (number of solutions up to `limit`, the first one found or None).
    Constraint propagation (cells with one candidate are filled until none is left) and
    depth-first search on the cell with the fewest candidates."""
    found = []

    def search(g):
        g = g.copy()
        while True:  # propagate naked singles
            empties = list(zip(*np.nonzero(g == 0)))
            if not empties:
                found.append(g)
                return
            best, best_c = None, None
            progress = False
            for r, c in empties:
                cand = _candidates(g, r, c)
                if not cand:
                    return
                if len(cand) == 1:
                    g[r, c] = cand.pop()
                    progress = True
                elif best is None or len(cand) < len(best_c):
                    best, best_c = (r, c), cand
            if not progress:
                break
        for d in sorted(best_c):
            if len(found) >= limit:
                return
            h = g.copy()
            h[best] = d
            search(h)

    search(np.asarray(puzzle, np.int32))
    return len(found), (found[0] if found else None)
