"""RAGEN-2's Sudoku (`ragen/env/sudoku/`, tags SimpleSudoku / MediumSudoku) as a pure-JAX env.

Levels: `generate(key, blanks)` (below). The reference (`generate_sudoku_puzzle`) fills a 9x9
grid by backtracking with shuffled digits, then blanks int(81 * 0.4) = 32 (`easy`) or 40
(`medium`) cells drawn at random, without checking that the solution is unique (its rewards
allow for that: a valid placement that is not the generated solution's digit pays half).
`generate` draws the solution from the key by the symmetries of a base grid (a digit
relabelling, the three bands and the three stacks permuted, the rows inside each band and the
columns inside each stack permuted, a transpose): every such grid is a valid Sudoku, but only
the ~1.2e12 grids of one symmetry class are reached, not all 6.7e21. The blanks are then
`blanks` cells drawn uniformly, as the reference; uniqueness is not enforced either
(`count_solutions` measures it).

Actions are text (`text_actions = True`, as Countdown): `step` takes the answer piece's bytes
(int32[L], PAD after), lower-cases and strips it and matches the reference's six regexes on
device (`parse_action`), the first that matches anywhere wins:
`place N at row R col C`, `place N at (R,C)`, `place N at R,C`, `N at R,C`, `(R,C,N)`, `R,C,N`
(`\\s+` / `\\s*` between the parts as the reference's patterns). The three numbers are
(number, row, col) when the answer contains `place` or `at` anywhere, else (row, col, number).
Rules and rewards are the reference's `SudokuEnv.step`: -0.1 for an unparsable answer, a row,
column or number outside 1..9, an initial cell, or a number already in the cell's row, column
or box; otherwise the number is placed (also over an earlier placement) and pays 1.0 if it is
the generated solution's digit, else 0.5; +10 when the grid is then complete and valid. Every
step counts; done when solved or when a valid placement reaches `max_steps` steps (81).

The text is the reference's `with_feedback` render (`to_text` on host; pieces on device in
`_text` below): the banner, the grid (`[N]` initial, ` N ` placed, ` . ` empty), the legend,
the last action's feedback, the valid numbers of each empty cell once at most 10 are left,
`Progress:` and `Steps:`. Deviations: an unparsable answer is echoed as its first ECHO bytes,
non-ASCII bytes as `?`; numbers of more than 9 digits saturate at 999999999; `\\d` and `\\s`
are ASCII (Python's also match other Unicode digits and spaces).

`size=4` is the reference's env at `grid_size=4` (2x2 boxes, numbers 1-4, the same text and
rules; tag `Sudoku4x4`, which the reference's envs.yaml does not have, with its own
instruction `INSTRUCTION_4X4`). The reference's grid_size 16 is not built.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs import text as env_text
from envs import text_actions
from envs.text_actions import PAD, answer_bytes  # noqa: F401 (the env's own names)

SIZE, BOX = 9, 3  # the reference's tags' grid (config grid_size 9)
SIZES = (4, 9)  # grid sizes built (the reference's SudokuEnvConfig also allows 16)


def blank_counts(size: int = SIZE) -> dict:
    """The reference's cells_to_remove of a size x size grid: 40% / 50% / 60% of the cells."""
    return {"easy": int(size * size * 0.4), "medium": int(size * size * 0.5),
            "hard": int(size * size * 0.6)}


BLANKS = blank_counts(SIZE)


def box_of(size: int) -> int:
    """The box side of a size x size grid (the reference's int(sqrt(grid_size)))."""
    return {4: 2, 9: 3}[size]


def check_size(size) -> None:
    """One-line ValueError unless size is a built grid size (4 or 9)."""
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size not in SIZES:
        raise ValueError(f"Sudoku size must be one of {', '.join(map(str, SIZES))}, got {size!r}")


def check_blanks(blanks, size: int = SIZE) -> None:
    """One-line ValueError unless 0 <= blanks <= size * size (an int)."""
    if not isinstance(blanks, (int, np.integer)) or isinstance(blanks, bool) \
            or not 0 <= blanks <= size * size:
        raise ValueError(f"Sudoku blanks must be an int in [0, {size * size}] for a {size}x{size} "
                         f"grid, got {blanks!r}")


def _base(size: int) -> np.ndarray:
    """A valid size x size grid: row r is 1..size shifted by box * (r % box) + r // box."""
    b = box_of(size)
    return np.array([[(b * (r % b) + r // b + c) % size + 1 for c in range(size)]
                     for r in range(size)], np.int32)


def _line_order(key, box: int):
    """int32[box * box]: a permutation of the lines that keeps groups of `box` together (bands
    or stacks permuted, and the lines inside each)."""
    k_outer, k_inner = jax.random.split(key)
    outer = jax.random.permutation(k_outer, box)
    inner = jax.vmap(lambda k: jax.random.permutation(k, box))(jax.random.split(k_inner, box))
    return (outer[:, None] * box + inner).reshape(-1).astype(jnp.int32)


def generate(key, blanks: int, size: int = SIZE):
    """(puzzle int32[size, size] with 0 for a blank, solution int32[size, size]). Jittable;
    `blanks` may be traced (one program for every blank count)."""
    check_size(size)
    if not isinstance(blanks, jax.Array):
        check_blanks(blanks, size)
    box = box_of(size)
    k_digits, k_rows, k_cols, k_t, k_blank = jax.random.split(key, 5)
    digits = jnp.concatenate([jnp.zeros(1, jnp.int32),
                              jax.random.permutation(k_digits, size).astype(jnp.int32) + 1])
    grid = digits[jnp.asarray(_base(size))]
    grid = grid[_line_order(k_rows, box)][:, _line_order(k_cols, box)]
    grid = jnp.where(jax.random.bernoulli(k_t), grid.T, grid)
    order = jnp.argsort(jax.random.uniform(k_blank, (size * size,)))
    # the first `blanks` cells of the random order: those whose rank in it is below blanks
    blank = (jnp.argsort(order) < blanks).reshape(size, size)
    return jnp.where(blank, 0, grid).astype(jnp.int32), grid.astype(jnp.int32)


def is_valid_solution(grid) -> bool:
    """Host: every row, column and box of a size x size grid holds 1..size once."""
    g = np.asarray(grid)
    size = g.shape[0]
    b = box_of(size)
    want = set(range(1, size + 1))
    boxes = [g[r:r + b, c:c + b].reshape(-1) for r in range(0, size, b)
             for c in range(0, size, b)]
    return all(set(x.tolist()) == want for x in [*g, *g.T, *boxes])


def _candidates(g, r, c):
    size = g.shape[0]
    b = box_of(size)
    bx = g[r // b * b:r // b * b + b, c // b * b:c // b * b + b]
    return set(range(1, size + 1)) - set(g[r].tolist()) - set(g[:, c].tolist()) \
        - set(bx.reshape(-1).tolist())


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


# ------------------------------------------------------------ the jittable solver
@functools.lru_cache(maxsize=None)
def _units(size: int):
    """(units int32[3 * size, size]: the cell indices (row-major) of the rows, columns and boxes;
    cell_units int32[size * size, 3]: each cell's three units)."""
    B = box_of(size)
    units = np.array([[r * size + c for c in range(size)] for r in range(size)]
                     + [[r * size + c for r in range(size)] for c in range(size)]
                     + [[(b // B * B + i // B) * size + b % B * B + i % B
                         for i in range(size)] for b in range(size)], np.int32)
    cell_units = np.array([[r, size + c, 2 * size + r // B * B + c // B]
                           for r in range(size) for c in range(size)], np.int32)
    return units, cell_units


def _side(g) -> int:
    """The grid size of a flat grid of size * size cells."""
    return {16: 4, 81: 9}[g.shape[0]]


SOLVE_GUESSES = 2048  # most guesses of `solve`'s search (generated levels need none or few)


def _fits(g):
    """(cand bool[81, 9]: digit d + 1 fits empty cell i, has bool[27, 9]: unit u holds d + 1,
    ok bool[]: no unit repeats a digit) of a flat grid int32[81] (shapes of 9x9; a 4x4 grid's
    are [16, 4], [12, 4])."""
    size = _side(g)
    units, cell_units = _units(size)
    onehot = g[:, None] == jnp.arange(1, size + 1)
    per_unit = jnp.sum(onehot[units], axis=1)  # [27, 9]
    has = per_unit > 0
    used = jnp.any(has[cell_units], axis=1)  # [81, 9]
    return ~used & (g == 0)[:, None], has, jnp.all(per_unit <= 1)


def propagate(g):
    """Constraint propagation on a flat grid int32[81] (0 empty): naked singles (a cell with
    one candidate) and hidden singles (a digit with one place left in a row, column or box),
    filled together each round until a round fills nothing. Returns (grid, ok): ok False on
    a contradiction (a repeated digit, an empty cell without candidates, a unit with nowhere
    left for a digit it lacks, a cell forced to two digits). Jittable."""
    units, cell_units = _units(_side(g))

    def body(carry):
        g, _, _ = carry
        cand, has, ok = _fits(g)
        places = jnp.sum(cand[units], axis=1)  # [27, 9]: cells of unit u that can take d
        ok &= jnp.all((g != 0) | jnp.any(cand, axis=1)) & jnp.all(has | (places > 0))
        naked = cand & (jnp.sum(cand, axis=1) == 1)[:, None]
        hidden = cand & jnp.any((places == 1)[cell_units], axis=1)
        forced = naked | hidden
        ok &= jnp.all(jnp.sum(forced, axis=1) <= 1)
        fill = jnp.any(forced, axis=1) & ok
        g = jnp.where(fill, jnp.argmax(forced, axis=1) + 1, g).astype(jnp.int32)
        return g, ok, jnp.any(fill)

    g, ok, _ = jax.lax.while_loop(lambda c: c[1] & c[2], body,
                                  (g.astype(jnp.int32), jnp.array(True), jnp.array(True)))
    return g, ok & _fits(g)[2]


def solve(grid):
    """A completion of `grid` int32[S, S] (0 empty; S 9 or 4) by propagation and depth-first
    search: (solution int32[S, S], ok bool[]). Each node is propagated (`propagate`); a node left
    open branches on its empty cell with the fewest candidates, digits in increasing order
    (the search of `count_solutions`, on device: an explicit stack of at most S * S nodes, each
    deeper by at least one filled cell). ok False where the grid has no completion, or none
    was found within SOLVE_GUESSES guesses (solution: the grid). Jittable and vmappable."""
    size = grid.shape[0]
    n = size * size
    flat = jnp.asarray(grid, jnp.int32).reshape(n)

    def branch(g):  # (cell with the fewest candidates, its candidates) of an open node
        cand = _fits(g)[0]
        count = jnp.where(g == 0, jnp.sum(cand, axis=1), size + 1)
        cell = jnp.argmin(count)
        return cell, cand[cell]

    g0, ok0 = propagate(flat)
    full0 = ok0 & jnp.all(g0 != 0)
    cell0, mask0 = branch(g0)
    stack = (jnp.zeros((n, n), jnp.int32).at[0].set(g0), jnp.zeros(n, jnp.int32).at[0].set(cell0),
             jnp.zeros((n, size), bool).at[0].set(mask0))
    top0 = jnp.where(ok0 & ~full0, 0, -1)

    def more(c):
        top, found, guesses = c[1], c[2], c[3]
        return (top >= 0) & ~found & (guesses < SOLVE_GUESSES)

    def step(c):
        (grids, cells, masks), top, found, guesses, best = c
        mask = masks[top]
        empty = ~jnp.any(mask)
        d = jnp.argmax(mask)  # the smallest untried digit - 1
        masks = masks.at[top, d].set(False)
        g, ok = propagate(grids[top].at[cells[top]].set(d + 1))
        ok &= ~empty
        full = ok & jnp.all(g != 0)
        push = ok & ~full & (top + 1 < n)
        cell, cmask = branch(g)
        nxt = jnp.minimum(top + 1, n - 1)
        grids = jnp.where(push, grids.at[nxt].set(g), grids)
        cells = jnp.where(push, cells.at[nxt].set(cell), cells)
        masks = jnp.where(push, masks.at[nxt].set(cmask), masks)
        top = jnp.where(empty, top - 1, jnp.where(push, top + 1, top))
        return ((grids, cells, masks), top, full, guesses + ~empty, jnp.where(full, g, best))

    _, _, found, _, best = jax.lax.while_loop(
        more, step, (stack, top0, full0, jnp.zeros((), jnp.int32), jnp.where(full0, g0, flat)))
    return best.reshape(size, size), found


def next_placements(grid, max_moves: int):
    """(cells int32[max_moves] (flat 0-based), digits int32[max_moves] (1..S), n int32[]): up
    to `max_moves` placements of a completion of `grid` found by `solve`, the empty cells
    with the fewest candidates first (a naked single before a cell that needed the search;
    ties in reading order); n = 0 where `solve` finds none. Jittable."""
    solution, ok = solve(grid)
    flat = jnp.asarray(grid, jnp.int32).reshape(-1)
    count = jnp.sum(_fits(flat)[0], axis=1)
    order = jnp.argsort(jnp.where(flat == 0, count, grid.shape[0] + 1), stable=True)[:max_moves]
    n = jnp.where(ok, jnp.minimum(jnp.sum(flat == 0), max_moves), 0).astype(jnp.int32)
    return order.astype(jnp.int32), solution.reshape(-1)[order], n


# ======================================================================= the env
# The reference's env_instruction (config/envs.yaml, SimpleSudoku / MediumSudoku: a YAML block,
# so it ends with a newline).
INSTRUCTION = (
    "You are solving a Sudoku puzzle. Fill in the grid so that every row, column, and 3x3 box "
    "contains the numbers 1-9 without repetition.\n"
    "Initial cells are shown in [brackets] and cannot be modified. Empty cells are shown as "
    "dots (.).\n"
    "Place numbers one at a time using the format: <answer>place 5 at row 2 col 3</answer> or "
    "<answer>2,3,5</answer>\n"
    "The environment will provide feedback on valid/invalid moves and show conflicts if any "
    "occur.\n"
)
# A 4x4 grid (`size=4`, the reference's SudokuEnvConfig grid_size 4) has no tag in the reference's
# envs.yaml, so no instruction of its own: this one is the 9x9 tags' with the grid's numbers.
INSTRUCTION_4X4 = (
    "You are solving a Sudoku puzzle. Fill in the grid so that every row, column, and 2x2 box "
    "contains the numbers 1-4 without repetition.\n"
    "Initial cells are shown in [brackets] and cannot be modified. Empty cells are shown as "
    "dots (.).\n"
    "Place numbers one at a time using the format: <answer>place 3 at row 2 col 1</answer> or "
    "<answer>2,1,3</answer>\n"
    "The environment will provide feedback on valid/invalid moves and show conflicts if any "
    "occur.\n"
)
ECHO = 64  # bytes of an unparsable answer the feedback echoes
SAT = 999_999_999  # digit runs saturate here
BANNER = "=" * 50
LEGEND = "Legend: [N]=initial cell, N=user-placed, *N*=conflict, .=empty"
EXPECTED = "Expected format: 'place 5 at row 2 col 3' or '2,3,5'"
# feedback kinds
FB_NONE, FB_FORMAT, FB_ROW, FB_COL, FB_NUM, FB_INITIAL, FB_CONFLICT, FB_CORRECT, FB_VALID = range(9)

# the reference's patterns as tokens: a literal, "+" (\s+), "*" (\s*), "d" ((\d+), a group)
_PATTERNS = (
    ("place", "+", "d", "+", "at", "+", "row", "+", "d", "+", "col", "+", "d"),
    ("place", "+", "d", "+", "at", "+", "(", "d", ",", "*", "d", ")"),
    ("place", "+", "d", "+", "at", "+", "d", ",", "*", "d"),
    ("d", "+", "at", "+", "d", ",", "*", "d"),
    ("(", "d", ",", "*", "d", ",", "*", "d", ")"),
    ("d", ",", "*", "d", ",", "*", "d"),
)


@struct.dataclass
class SudokuState:
    puzzle: jax.Array  # int32[S, S] (S the env's size, 9 or 4): the initial grid (0 blank)
    solution: jax.Array  # int32[S, S]: the generated solution
    grid: jax.Array  # int32[S, S]: the current grid
    steps: jax.Array  # int32[]: steps taken (valid or not)
    done: jax.Array  # bool[]
    solved: jax.Array  # bool[]
    fb: jax.Array  # int32[]: the last step's feedback kind (FB_*)
    fb_num: jax.Array  # int32[]: its number (or the out-of-range value)
    fb_row: jax.Array  # int32[]: its 1-based row
    fb_col: jax.Array  # int32[]: its 1-based column
    echo: jax.Array  # int32[ECHO]: an unparsable answer's bytes (lower-cased, stripped), PAD after


def _isspace(x):
    return (x == 32) | ((x >= 9) & (x <= 13)) | ((x >= 0x1C) & (x <= 0x1F))


def _isdigit(x):
    return (x >= 48) & (x <= 57)


def parse_action(action):
    """The reference's `parse_action` on bytes int32[L] (PAD after): lower-case and strip,
    then the six patterns in order, each at its leftmost match.

    Returns (x: the stripped lower-cased bytes int32[L], PAD after; matched bool[];
    num, row, col int32[]: 1-based, as written (saturated at SAT), before the range checks)."""
    x = jnp.asarray(action, jnp.int32)
    L = x.shape[0]
    pos = jnp.arange(L)
    x = jnp.where((x >= 65) & (x <= 90), x + 32, x)
    core = (x != PAD) & ~_isspace(x)
    first = jnp.min(jnp.where(core, pos, L))
    last = jnp.max(jnp.where(core, pos, -1))
    x = jnp.where(pos <= last - first, x[jnp.clip(pos + first, 0, L - 1)], PAD)

    digit = _isdigit(x)
    ws_end = jax.lax.cummin(jnp.where(_isspace(x), L, pos), reverse=True)
    dig_end = jax.lax.cummin(jnp.where(digit, L, pos), reverse=True)

    def run(v, b):  # value of the digit run so far, saturating
        d = b - 48
        nv = jnp.where(_isdigit(b), jnp.where(v > SAT // 10 - 1, SAT, jnp.minimum(v * 10 + d, SAT)), 0)
        return nv, nv
    _, pre = jax.lax.scan(run, jnp.zeros((), jnp.int32), x)

    words = {}

    def starts(word):  # bool[L]: `word` starts at each position (static shifts, no gather)
        if word not in words:
            m = jnp.ones((L,), bool)
            for i, ch in enumerate(word.encode()):
                m &= jnp.concatenate([x[i:], jnp.full((min(i, L),), PAD, x.dtype)])[:L] == ch
            words[word] = m
        return words[word]

    def at(a, p, fill):  # a[p], `fill` past the end; p is None at the start (every position)
        return a if p is None else jnp.where(p < L, a[jnp.clip(p, 0, L - 1)], fill)

    # Each pattern is matched from every start position at once: p holds where each candidate
    # match has got to. A run of spaces or digits is taken whole (its end from ws_end /
    # dig_end), a `+` or a digit run needs one character at least (its end past p).
    found = jnp.zeros((), bool)
    groups = jnp.zeros((3,), jnp.int32)
    for pattern in _PATTERNS:
        p = None
        ok = jnp.ones((L,), bool)
        vals = []
        for tok in pattern:
            here = pos if p is None else p
            if tok in "+*":
                e = at(ws_end, p, L)
                if tok == "+":
                    ok &= e > here
                p = e
            elif tok == "d":
                e = at(dig_end, p, L)
                ok &= e > here
                vals.append(pre[jnp.clip(e - 1, 0, L - 1)])
                p = e
            else:
                ok &= at(starts(tok), p, False)
                p = here + len(tok)
        hit = jnp.argmax(ok)
        g = jnp.stack([v[hit] for v in vals])
        take = ~found & ok.any()
        groups = jnp.where(take, g, groups)
        found = found | ok.any()

    def contains(word):
        return starts(word).any()
    named = contains("place") | contains("at")
    num = jnp.where(named, groups[0], groups[2])
    row = jnp.where(named, groups[1], groups[0])
    col = jnp.where(named, groups[2], groups[1])
    return x, found, num, row, col


def _box(grid, r, c):
    """int32[S]: the box of 0-based cell (r, c) of a grid int32[S, S]."""
    b = box_of(grid.shape[0])
    return jax.lax.dynamic_slice(grid, (r // b * b, c // b * b), (b, b)).reshape(-1)


def conflicts(grid, r, c, num):
    """bool[3]: num is already in 0-based cell (r, c)'s row, column, box."""
    return jnp.stack([jnp.any(grid[r] == num), jnp.any(grid[:, c] == num),
                      jnp.any(_box(grid, r, c) == num)])


def valid_numbers(grid, r, c):
    """bool[S]: which of 1..S fit the empty 0-based cell (r, c) (none if it is filled)."""
    d = jnp.arange(1, grid.shape[0] + 1)
    seen = jnp.concatenate([grid[r], grid[:, c], _box(grid, r, c)])
    return ~jnp.any(seen[None] == d[:, None], axis=1) & (grid[r, c] == 0)


def is_solved_grid(grid):
    """bool[]: every cell filled and every row, column and box holds 1..S once."""
    size = grid.shape[0]
    b = box_of(size)
    d = jnp.arange(1, size + 1)
    boxes = grid.reshape(b, b, b, b).transpose(0, 2, 1, 3).reshape(size, size)
    units = jnp.concatenate([grid, grid.T, boxes])  # [27, 9]
    return jnp.all(jnp.any(units[:, :, None] == d[None, None], axis=1))


@dataclasses.dataclass(frozen=True)
class Sudoku(text_actions.TextActionEnv):
    """Static settings (hashable: usable as a jit static argument).

    blanks: cells blanked per level (the reference's 32 easy, 40 medium); max_steps: the
    env's step budget (81); max_actions: the agent's actions an episode (the reference's
    max_actions_per_traj: 20 SimpleSudoku, 30 MediumSudoku); the rewards are the reference's
    correct_placement_score (a valid non-solution digit pays half), invalid_action_score and
    completion_bonus; size: the grid's side, 9 (the reference's tags) or 4 (its grid_size 4:
    2x2 boxes, numbers 1-4; easy blanks int(16 * 0.4) = 6)."""

    name: str = "SimpleSudoku"
    blanks: int = BLANKS["easy"]
    max_steps: int = 81
    max_actions: int = 20
    correct_placement_score: float = 1.0
    invalid_action_score: float = -0.1
    completion_bonus: float = 10.0
    size: int = SIZE

    @property
    def instruction(self):
        return INSTRUCTION if self.size == SIZE else INSTRUCTION_4X4

    @property
    def move_names(self):
        """The answers the solver writes (envs/solvers.py `next_moves`): placement (r, c, n),
        all 1-based, is move ((r - 1) * S + c - 1) * S + n - 1, `r,c,n` in the reference's
        format (729 of them on the 9x9 grid, 64 on the 4x4)."""
        return _move_names(self.size)

    def __post_init__(self):
        check_size(self.size)
        check_blanks(self.blanks, self.size)
        for f in ("max_steps", "max_actions"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not 1 <= v <= 9999:
                raise ValueError(f"Sudoku {f} must be an int in [1, 9999], got {v!r}")
        for f in ("correct_placement_score", "invalid_action_score", "completion_bonus"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ValueError(f"Sudoku {f} must be a number, got {v!r}")

    @property
    def budgets(self):
        """The reference's (actions a turn, actions an episode): base.yaml's 2, envs.yaml's."""
        return (2, self.max_actions)

    # ----------------------------------------------------------- dynamics
    def text(self, max_actions_per_turn: int, max_actions_per_traj: int):
        """How its states read, as pieces (`envs.text.EnvText`), with these budgets."""
        return _text(self, max_actions_per_turn, max_actions_per_traj)

    def reset(self, key):
        puzzle, solution = generate(key, self.blanks, self.size)
        z = jnp.zeros((), jnp.int32)
        return SudokuState(puzzle=puzzle, solution=solution, grid=puzzle, steps=z,
                           done=jnp.zeros((), bool), solved=jnp.zeros((), bool), fb=z,
                           fb_num=z, fb_row=z, fb_col=z, echo=jnp.full((ECHO,), PAD, jnp.int32))

    def step(self, key, state, action):
        """Play the answer `action` (int32[L] bytes, PAD after). key: unused.

        Returns (state, reward f32[], done bool[], info) with info bools `success` (solved),
        `action_is_effective` and `action_is_valid` (a placement was made)."""
        del key
        x, found, num, row, col = parse_action(action)
        L = x.shape[0]
        echo = jnp.full((ECHO,), PAD, jnp.int32)
        k = min(L, ECHO)
        echo = echo.at[:k].set(x[:k])
        S = self.size
        in_row = (row >= 1) & (row <= S)
        in_col = (col >= 1) & (col <= S)
        in_num = (num >= 1) & (num <= S)
        r, c = jnp.clip(row - 1, 0, S - 1), jnp.clip(col - 1, 0, S - 1)
        initial = state.puzzle[r, c] != 0
        clash = jnp.any(conflicts(state.grid, r, c, num))
        fb = jnp.where(~found, FB_FORMAT, jnp.where(~in_row, FB_ROW, jnp.where(
            ~in_col, FB_COL, jnp.where(~in_num, FB_NUM, jnp.where(
                initial, FB_INITIAL, jnp.where(clash, FB_CONFLICT, FB_VALID))))))
        place = fb == FB_VALID
        right = num == state.solution[r, c]
        fb = jnp.where(place & right, FB_CORRECT, fb)
        grid = jnp.where(place, state.grid.at[r, c].set(num), state.grid)
        solved = place & is_solved_grid(grid)
        steps = state.steps + 1
        done = solved | (place & (steps >= self.max_steps))
        reward = jnp.where(place, jnp.where(right, self.correct_placement_score,
                                            self.correct_placement_score * 0.5),
                           self.invalid_action_score) + jnp.where(solved, self.completion_bonus, 0.0)
        live = ~state.done
        new = state.replace(grid=grid, steps=steps, done=done, solved=solved, fb=fb,
                            fb_num=num, fb_row=row, fb_col=col,
                            echo=jnp.where(fb == FB_FORMAT, echo, state.echo))
        new = jax.tree_util.tree_map(lambda a, b: jnp.where(live, a, b), new, state)
        reward = jnp.where(live, reward, 0.0).astype(jnp.float32)
        info = {"success": live & solved, "action_is_effective": live & place,
                "action_is_valid": live & place}
        return new, reward, new.done, info

    def is_done(self, state):
        return state.done

    # ----------------------------------------------------------- host text
    def to_text(self, state):
        """The reference's `render()` (render_format `with_feedback`), host side."""
        grid, puzzle = np.asarray(state.grid), np.asarray(state.puzzle)
        S, B = self.size, box_of(self.size)
        lines = []
        for i in range(S):
            if i > 0 and i % B == 0:
                lines.append("-" * (S * 3 + B - 1))
            s = ""
            for j in range(S):
                if j > 0 and j % B == 0:
                    s += "| "
                v = int(grid[i, j])
                s += " . " if v == 0 else (f"[{v}]" if puzzle[i, j] != 0 else f" {v} ")
            lines.append(s.rstrip())
        out = [BANNER, "SUDOKU PUZZLE", BANNER, "\n".join(lines), "", LEGEND]
        fb = self.feedback(state)
        if fb:
            out += ["", fb]
        empties = list(zip(*np.nonzero(grid == 0)))
        if empties and len(empties) <= 10:
            out += ["", "💡 VALID NUMBERS FOR EMPTY CELLS:"]
            for r, c in empties:
                valid = _host_valid(grid, r, c)
                if valid:
                    out.append(f"  - ({r + 1},{c + 1}): {valid}")
        filled, initial = int(np.count_nonzero(grid)), int(np.count_nonzero(puzzle))
        out += ["", f"Progress: {filled}/{S * S} cells filled ({initial} initial, "
                    f"{filled - initial} placed)", f"Steps: {int(state.steps)}/{self.max_steps}"]
        return "\n".join(out)

    def feedback(self, state) -> str:
        """The reference's `last_action_feedback` of the state (host)."""
        fb, num = int(state.fb), int(state.fb_num)
        row, col = int(state.fb_row), int(state.fb_col)
        grid = np.asarray(state.grid)
        if fb == FB_NONE:
            return ""
        if fb == FB_FORMAT:
            echo = "".join(chr(b) if b < 128 else "?" for b in np.asarray(state.echo) if b != PAD)
            return (f"❌ Invalid action format: Could not parse action: '{echo}'. {EXPECTED}")
        if fb in (FB_ROW, FB_COL, FB_NUM):
            what, v = {FB_ROW: ("Row", row), FB_COL: ("Column", col), FB_NUM: ("Number", num)}[fb]
            return f"❌ Invalid action format: {what} {v} is out of range (1-{self.size})"
        if fb == FB_INITIAL:
            return f"❌ Cannot modify initial cell at ({row},{col})"
        if fb == FB_CONFLICT:
            r, c, B = row - 1, col - 1, box_of(self.size)
            br, bc = r // B, c // B
            parts = []
            if num in grid[r]:
                parts.append(f"row {row}")
            if num in grid[:, c]:
                parts.append(f"column {col}")
            if num in grid[br * B:br * B + B, bc * B:bc * B + B]:
                parts.append(f"box ({br + 1},{bc + 1})")
            text = f"❌ Invalid placement: {num} conflicts with {', '.join(parts)}"
            valid = _host_valid(grid, r, c)
            if valid:
                text += f"\n   Valid numbers for ({row},{col}): {valid}"
            return text
        text = (f"✓ Correct! Placed {num} at ({row},{col})" if fb == FB_CORRECT
                else f"⚠ Placed {num} at ({row},{col}) - Valid but not optimal")
        if bool(state.solved):
            text += "\n🎉 Congratulations! Puzzle solved!"
        return text

    def from_text(self, text):
        """A level (nothing placed) from the reference's grid lines: the nine (size) rows of
        `[N]` (initial) and ` . ` (empty) cells, `|` and dash lines ignored. The solution is the
        host solver's first (ValueError if the grid has none)."""
        S = self.size
        rows = [ln for ln in text.splitlines()
                if re.fullmatch(r"\s*(\[\d\]|\.|\|)(\s*(\[\d\]|\.|\|))*\s*", ln)]
        cells = [re.findall(r"\[(\d)\]|(\.)", ln) for ln in rows]
        if len(cells) != S or any(len(r) != S for r in cells):
            raise ValueError(f"Sudoku text needs {S} grid lines of {S} cells `[N]` or `.`")
        puzzle = np.array([[int(d) if d else 0 for d, _ in r] for r in cells], np.int32)
        if puzzle.max() > S:
            raise ValueError(f"Sudoku clue {puzzle.max()} is out of range (1-{S})")
        for r, c in zip(*np.nonzero(puzzle)):
            rest = puzzle.copy()
            rest[r, c] = 0
            if puzzle[r, c] not in _host_valid(rest, r, c):
                raise ValueError(f"Sudoku clue {puzzle[r, c]} at ({r + 1},{c + 1}) repeats in "
                                 f"its row, column or box")
        n, solution = count_solutions(puzzle, limit=1)
        if n == 0:
            raise ValueError("Sudoku grid has no solution")
        z = jnp.zeros((), jnp.int32)
        return SudokuState(puzzle=jnp.asarray(puzzle), solution=jnp.asarray(solution, jnp.int32),
                           grid=jnp.asarray(puzzle), steps=z, done=jnp.zeros((), bool),
                           solved=jnp.zeros((), bool), fb=z, fb_num=z, fb_row=z, fb_col=z,
                           echo=jnp.full((ECHO,), PAD, jnp.int32))


@functools.lru_cache(maxsize=None)
def _move_names(size: int) -> tuple:
    s = range(1, size + 1)
    return tuple(f"{r},{c},{n}" for r in s for c in s for n in s)


def _host_valid(grid, r, c) -> list:
    """The reference's sorted(get_valid_numbers(grid, r, c)) as a list (host)."""
    if grid[r, c] != 0:
        return []
    S = grid.shape[0]
    B = box_of(S)
    b = grid[r // B * B:r // B * B + B, c // B * B:c // B * B + B]
    used = set(grid[r].tolist()) | set(grid[:, c].tolist()) | set(b.reshape(-1).tolist())
    return sorted(set(range(1, S + 1)) - used)


_REFERENCE_PATTERNS = (r"place\s+(\d+)\s+at\s+row\s+(\d+)\s+col\s+(\d+)",
                       r"place\s+(\d+)\s+at\s+\((\d+),\s*(\d+)\)",
                       r"place\s+(\d+)\s+at\s+(\d+),\s*(\d+)", r"(\d+)\s+at\s+(\d+),\s*(\d+)",
                       r"\((\d+),\s*(\d+),\s*(\d+)\)", r"(\d+),\s*(\d+),\s*(\d+)")


def reference_parse(action: str):
    """Host: the reference's `SudokuEnv.parse_action` (ragen/env/sudoku/env.py), its matching
    part, with Python's `re`: (matched, num, row, col) before the range checks."""
    action = action.strip().lower()
    for pattern in _REFERENCE_PATTERNS:
        m = re.search(pattern, action)
        if m:
            if "place" in action or "at" in action:
                num, row, col = map(int, m.groups())
            else:
                row, col, num = map(int, m.groups())
            return True, num, row, col
    return False, None, None, None


# envs.make(name): RAGEN-2's Sudoku (tags SimpleSudoku / MediumSudoku), 32 or 40 blanks (its
# easy / medium), 81 env steps, 20 or 30 actions an episode. Sudoku4x4 is the reference's env
# at grid_size 4 (no tag of its own there): its easy blanks (6 of 16 cells), one env step a
# cell (the reference config's "one per cell") and 10 actions an episode (ours).
VARIANTS = {
    "SimpleSudoku": (Sudoku, dict(blanks=BLANKS["easy"], max_steps=81, max_actions=20)),
    "MediumSudoku": (Sudoku, dict(blanks=BLANKS["medium"], max_steps=81, max_actions=30)),
    "Sudoku4x4": (Sudoku, dict(size=4, blanks=blank_counts(4)["easy"], max_steps=16,
                               max_actions=10)),
}


# ----------------------------------------------------------------------------- text
def _text(env, max_actions_per_turn, max_actions_per_traj) -> env_text.EnvText:
    """The reference's `with_feedback` render as pieces: the banner, each cell as one piece
    (`[N]`, ` N `, ` . `, the row's last cell right-stripped), `| ` and the band lines, the
    legend, the last action's feedback (its frames, digit pieces, an unparsable answer's bytes
    one piece each), the valid numbers of the empty cells once at most 10 are left, and the
    progress and step lines."""
    S, BOX = env.size, box_of(env.size)
    names, pieces = {}, []

    def add(key, text):
        names[key] = len(pieces)
        pieces.append(text)
        return names[key]

    def cell_text(code, last):  # code 0 empty, 1..S placed, S+1..2S initial
        t = " . " if code == 0 else (f"[{code - S}]" if code > S else f" {code} ")
        return t.rstrip() if last else t

    CELL = len(pieces)
    for last in (False, True):
        for code in range(2 * S + 1):
            add(("cell", last, code), cell_text(code, last))
    DIGIT = len(pieces)
    for d in range(10):
        add(("digit", d), str(d))
    BYTE = len(pieces)
    for b in range(128):
        add(("byte", b), chr(b))
    QMARK = names[("byte", ord("?"))]
    bad = "\n\n❌ Invalid action format: "
    frames = dict(
        head=f"{BANNER}\nSUDOKU PUZZLE\n{BANNER}\n", bar="| ", nl="\n",
        dash="\n" + "-" * (S * 3 + BOX - 1) + "\n", legend="\n\n" + LEGEND,
        fmt=bad + "Could not parse action: '", fmt_end="'. " + EXPECTED,
        row_range=bad + "Row ", col_range=bad + "Column ", num_range=bad + "Number ",
        range_end=f" is out of range (1-{S})", initial="\n\n❌ Cannot modify initial cell at (",
        comma=",", close=")", conflict="\n\n❌ Invalid placement: ", with_=" conflicts with ",
        row_w="row ", col_w="column ", col_w2=", column ", box_w="box (", box_w2=", box (",
        valid_for="\n   Valid numbers for (", list_open="): [", sep=", ", list_close="]",
        correct="\n\n✓ Correct! Placed ", placed="\n\n⚠ Placed ", at=" at (",
        not_optimal=") - Valid but not optimal", solved="\n🎉 Congratulations! Puzzle solved!",
        valid_head="\n\n💡 VALID NUMBERS FOR EMPTY CELLS:", line="\n  - (",
        progress="\n\nProgress: ", of=f"/{S * S} cells filled (", initial_w=" initial, ",
        placed_w=" placed)\nSteps: ", max_steps=f"/{env.max_steps}")
    P = {k: add(k, v) for k, v in frames.items()}
    long_ids = {i for i, t in enumerate(pieces) if len(t) > 8}
    # the grid's frame: banner, bars and line breaks, with a slot (-1) for each cell's piece
    grid_frame, cell_slots = [P["head"]], []
    for i in range(S):
        if i:
            grid_frame.append(P["dash"] if i % BOX == 0 else P["nl"])
        for j in range(S):
            if j and j % BOX == 0:
                grid_frame.append(P["bar"])
            cell_slots.append(len(grid_frame))
            grid_frame.append(-1)
    grid_frame, cell_slots = np.asarray(grid_frame, np.int32), np.asarray(cell_slots)
    SD = 5  # digits of the step count (saturates past 99999)

    def num(v, k):  # piece ids [k]: v's digits right-aligned, -1 before
        v = jnp.clip(v, 0, 10 ** k - 1)
        pw = env_text.powers_of_ten(k)
        keep = (v >= pw) | (jnp.arange(k) == k - 1)
        return jnp.where(keep, DIGIT + (v // pw) % 10, -1)

    def d(v):
        return jnp.reshape(DIGIT + jnp.clip(v, 0, 9), (1,))

    def ids(*items):
        return jnp.concatenate([jnp.reshape(jnp.asarray(i, jnp.int32), (-1,)) for i in items])

    def when(cond, arr):
        return jnp.where(cond, arr, -1)

    def number_list(valid):  # bool[9] -> ids [18]: "1, 5, 9"
        before = jnp.cumsum(valid) - valid > 0
        sep = jnp.where(valid & before, P["sep"], -1)
        digit = jnp.where(valid, DIGIT + jnp.arange(1, S + 1), -1)
        return jnp.stack([sep, digit], axis=1).reshape(-1)

    def feedback(state):
        fb, n, r, c = state.fb, state.fb_num, state.fb_row, state.fb_col
        r0, c0 = jnp.clip(r - 1, 0, S - 1), jnp.clip(c - 1, 0, S - 1)
        echo = jnp.where(state.echo < 0, -1, jnp.where(state.echo < 128, BYTE + state.echo, QMARK))
        cr, cc, cb = conflicts(state.grid, r0, c0, n)
        valid = valid_numbers(state.grid, r0, c0)
        range_v = jnp.where(fb == FB_ROW, r, jnp.where(fb == FB_COL, c, n))
        range_p = jnp.where(fb == FB_ROW, P["row_range"],
                            jnp.where(fb == FB_COL, P["col_range"], P["num_range"]))
        solved = when(state.solved, P["solved"])
        where = (d(n), P["at"], d(r), P["comma"], d(c))
        alts = {
            FB_FORMAT: ids(P["fmt"], echo, P["fmt_end"]),
            FB_ROW: ids(range_p, num(range_v, 9), P["range_end"]),
            FB_INITIAL: ids(P["initial"], d(r), P["comma"], d(c), P["close"]),
            FB_CONFLICT: ids(
                P["conflict"], d(n), P["with_"], when(cr, ids(P["row_w"], d(r))),
                when(cc, ids(jnp.where(cr, P["col_w2"], P["col_w"]), d(c))),
                when(cb, ids(jnp.where(cr | cc, P["box_w2"], P["box_w"]), d(r0 // BOX + 1),
                             P["comma"], d(c0 // BOX + 1), P["close"])),
                when(valid.any(), ids(P["valid_for"], d(r), P["comma"], d(c), P["list_open"],
                                      number_list(valid), P["list_close"]))),
            FB_CORRECT: ids(P["correct"], *where, P["close"], solved),
            FB_VALID: ids(P["placed"], *where, P["not_optimal"], solved),
        }
        width = max(a.shape[0] for a in alts.values())
        out = jnp.full((width,), -1, jnp.int32)
        for kind, alt in alts.items():
            pad = jnp.pad(alt, (0, width - alt.shape[0]), constant_values=-1)
            hit = fb == kind
            if kind == FB_ROW:  # the three out-of-range messages share a layout
                hit |= (fb == FB_COL) | (fb == FB_NUM)
            out = jnp.where(hit, pad, out)
        return out

    def render(state):
        grid, puzzle = state.grid, state.puzzle
        code = jnp.where(puzzle != 0, grid + S, grid)  # [9, 9]
        # the grid's pieces at once: the fixed frame (banner, bars, line breaks) with the 81
        # cells' pieces written into their slots
        cells = CELL + (2 * S + 1) * (jnp.arange(S) == S - 1) + code
        parts = [jnp.asarray(grid_frame).at[cell_slots].set(cells.reshape(-1)),
                 ids(P["legend"]), feedback(state)]
        empty = grid == 0
        E = jnp.sum(empty)
        k = jnp.arange(10)
        order = jnp.argsort(~empty.reshape(-1), stable=True)[:10]
        rr, cc = order // S, order % S
        valid = jax.vmap(valid_numbers, in_axes=(None, 0, 0))(grid, rr, cc)
        show = (k < E) & valid.any(axis=1)
        lines = jax.vmap(lambda r, c, v: ids(P["line"], d(r + 1), P["comma"], d(c + 1),
                                             P["list_open"], number_list(v),
                                             P["list_close"]))(rr, cc, valid)
        lines = jnp.where(show[:, None], lines, -1).reshape(-1)
        parts.append(when((E >= 1) & (E <= 10), ids(P["valid_head"], lines)))
        filled = jnp.sum(grid != 0)
        initial = jnp.sum(puzzle != 0)
        parts += [ids(P["progress"]), num(filled, 2), ids(P["of"]), num(initial, 2),
                  ids(P["initial_w"]), num(filled - initial, 2), ids(P["placed_w"]),
                  num(state.steps, SD), ids(P["max_steps"])]
        return jnp.concatenate(parts).astype(jnp.int32)

    shape = jax.eval_shape(render, jax.eval_shape(env.reset, jax.random.key(0)))
    # slots that can show a piece longer than 8 characters at once: the banner, the two band
    # lines, the legend, the feedback's frames (at most 4: a conflict in a row and a column
    # with its valid numbers), the valid-numbers header and the progress frames (4)
    prefix = env_text.prefix_text(env, max_actions_per_traj)
    return env_text.EnvText(tuple(pieces), shape.shape[0], render, prefix, (),
                            max_actions_per_turn, max_actions_per_traj,
                            ((tuple(sorted(long_ids)), 13),))
