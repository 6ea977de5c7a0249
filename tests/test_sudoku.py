"""Sudoku's first part (envs/sudoku.py): the on-device generator against the rules and the
reference's blank counts, the host solver, bad options. The env itself is not built yet."""

import jax
import numpy as np
import pytest

from envs import sudoku


def _batch(n, blanks, seed=0):
    gen = jax.jit(jax.vmap(lambda k: sudoku.generate(k, blanks)))
    puzzle, solution = gen(jax.random.split(jax.random.key(seed), n))
    return np.asarray(puzzle), np.asarray(solution)


def test_the_reference_blank_counts():
    # generate_sudoku_puzzle's cells_to_remove for a 9x9 grid
    assert sudoku.BLANKS == {"easy": 32, "medium": 40, "hard": 48}


@pytest.mark.parametrize("blanks", [0, 32, 40, 81])
def test_levels_are_valid_grids_with_the_blanks_asked_for(blanks):
    puzzle, solution = _batch(128, blanks)
    for p, s in zip(puzzle, solution):
        assert sudoku.is_valid_solution(s)
        assert (p == 0).sum() == blanks
        assert np.array_equal(p[p != 0], s[p != 0])
    # the key decides the level: 128 different solutions, blanks spread over every cell
    assert len({s.tobytes() for s in solution}) == 128
    if 0 < blanks < 81:
        per_cell = (puzzle == 0).mean(axis=0)
        assert per_cell.min() > 0 and per_cell.max() < 1


def test_the_solver_solves_generated_puzzles():
    puzzle, solution = _batch(24, sudoku.BLANKS["easy"], seed=1)
    unique = 0
    for p, s in zip(puzzle, solution):
        n, found = sudoku.count_solutions(p, limit=2)
        assert n >= 1 and sudoku.is_valid_solution(found)
        assert np.array_equal(found[p != 0], p[p != 0])
        unique += n == 1
        if n == 1:
            assert np.array_equal(found, s)
    # 32 random blanks almost always leave one solution (not enforced, as in the reference)
    assert unique >= 20


def test_count_solutions_sees_several_and_none():
    _, solution = _batch(1, 0, seed=2)
    grid = solution[0].copy()
    assert sudoku.count_solutions(grid) == (1, pytest.approx(grid))
    # no clues: many solutions
    empty = np.zeros((9, 9), np.int32)
    assert sudoku.count_solutions(empty, limit=2)[0] == 2
    bad = grid.copy()
    bad[0, 0], bad[0, 1] = 0, grid[0, 0]  # (0, 1)'s new digit repeats in its column
    assert sudoku.count_solutions(bad)[0] == 0


@pytest.mark.parametrize("blanks", [-1, 82, 3.0, True, "32"])
def test_bad_blank_counts_are_one_line_errors(blanks):
    with pytest.raises(ValueError, match="blanks") as err:
        sudoku.generate(jax.random.key(0), blanks)
    assert "\n" not in str(err.value)
