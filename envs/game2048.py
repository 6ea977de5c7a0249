"""RAGEN-2's 2048 as a pure-JAX environment (`ragen/env/game_2048/`, `config/envs.yaml` tag
`game_2048`, `config/_9_2048.yaml`).

A 4x4 board of power-of-two tiles; an action slides every tile Up, Right, Down or Left, equal
neighbours merging once per move (a line [2, 2, 2, 2] slid left becomes [4, 4, 0, 0], and
[2, 2, 4, 0] becomes [4, 4, 0, 0]: pairs form from the side the tiles move to, and a merged
tile does not merge again in the same move). Rules and rewards are the reference's:
- reset: an empty board and two spawned tiles; a spawn picks an empty cell uniformly and puts
  a 2 there with probability `two_prob` (0.9), else a 4;
- a move that changes the board adds the merged tiles' sum to the score, spawns a tile, and
  ends the game when no move can change the board; the episode then succeeds iff the largest
  tile is >= 2048 (only at the end, as the reference sets `success`);
- reward (`use_log_reward`, the reference's default): 0.1 * log2(merged sum + 1) for a move
  that merged, else 0. A move that changes nothing is "invalid" (`action_is_valid` and
  `action_is_effective` False, board unchanged, no spawn) and its raw score is
  `invalid_act_score` (-0.1), which the log transform turns into 0 as in the reference (it
  maps every raw score <= 0 to 0); with use_log_reward=False the raw scores are paid.

Actions: ids 1 Up, 2 Right, 3 Down, 4 Left (the reference's 0-based lookup plus 1, as the
project's other envs; anything else is a no-op that pays nothing and is not valid). The text is
the reference's `render()`: the rows, the valid actions with the reference's 0-based ids
(`0(Up), 2(Down)`), the goal line and the score.

The board holds exponents (0 empty, e for a tile 2 ** e), int32[size, size]. A tile is at most
2 ** (size * size + 1) and the score fits int32 for size <= 4.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs import text as env_text

ACTION_NAMES = ("Up", "Right", "Down", "Left")
# The reference's env_instruction (config/envs.yaml, tag game_2048; a YAML block, so it ends
# with a newline).
INSTRUCTION = (
    "You are playing the 2048 game on a 4x4 grid. Merge equal tiles by sliding Up, Right, Down, "
    "or Left.\nIf a move is invalid (no tiles move), a small penalty is applied. Respond with a "
    "single action.\nExample: <answer>Up</answer>\n"
)
GOAL_LINE = "Goal: Merge same numbers to reach 2048."
WIN_EXPONENT = 11  # 2048


@struct.dataclass
class Game2048State:
    grid: jax.Array  # int32[size, size]: 0 empty, e > 0 a tile 2 ** e
    score: jax.Array  # int32[]: the merged tiles' sum so far (the reference's `score`)


def _compress(line):
    """[..., n] exponents -> the nonzero ones first, in order (a stable partition)."""
    order = jnp.argsort(line == 0, axis=-1, stable=True)
    return jnp.take_along_axis(line, order, axis=-1)


def slide_left(rows):
    """Slide rows int32[..., n] of exponents to the left. -> (rows, gain int32[...]) with gain the
    merged tiles' sum. Pairs form left to right; a merged tile does not merge again."""
    v = _compress(rows)
    n = v.shape[-1]
    merged = []  # merged[i]: v[i] and v[i + 1] merge into v[i] + 1
    prev = jnp.zeros(v.shape[:-1], bool)
    for i in range(n - 1):
        m = ~prev & (v[..., i] != 0) & (v[..., i] == v[..., i + 1])
        merged.append(m)
        prev = m
    merged.append(jnp.zeros(v.shape[:-1], bool))
    merged = jnp.stack(merged, axis=-1)  # [..., n]
    consumed = jnp.concatenate([jnp.zeros_like(merged[..., :1]), merged[..., :-1]], axis=-1)
    out = jnp.where(merged, v + 1, jnp.where(consumed, 0, v))
    gain = jnp.sum(jnp.where(merged, jnp.left_shift(1, v + 1), 0), axis=-1)
    return _compress(out), gain.astype(jnp.int32)


def _oriented(grid, direction):
    """grid turned so that `direction` (0 Up, 1 Right, 2 Down, 3 Left) slides its rows left."""
    return [grid.T, grid[:, ::-1], grid.T[:, ::-1], grid][direction]


def _restored(grid, direction):
    return [grid.T, grid[:, ::-1], grid[:, ::-1].T, grid][direction]


def all_moves(grid):
    """Every direction's result: (grids int32[4, n, n], gains int32[4], moved bool[4]) for
    0 Up, 1 Right, 2 Down, 3 Left (the reference's action lookup order)."""
    turned = jnp.stack([_oriented(grid, d) for d in range(4)])
    slid, gain = slide_left(turned)  # [4, n, n], [4, n]
    grids = jnp.stack([_restored(slid[d], d) for d in range(4)])
    moved = jnp.any(grids != grid[None], axis=(1, 2))
    return grids, jnp.sum(gain, axis=1), moved


def spawn(key, grid, two_prob):
    """A 2 (p = two_prob) or a 4 on an empty cell drawn uniformly (none when the board is
    full), as the reference's `_spawn_tile`."""
    k_cell, k_value = jax.random.split(key)
    empty = (grid == 0).reshape(-1)
    count = jnp.sum(empty)
    pick = jnp.minimum(jnp.floor(jax.random.uniform(k_cell) * count).astype(jnp.int32),
                       jnp.maximum(count - 1, 0))
    rank = jnp.cumsum(empty) - 1  # rank of each empty cell among the empty ones
    cell = empty & (rank == pick)
    value = jnp.where(jax.random.uniform(k_value) < two_prob, 1, 2)
    return jnp.where(cell, value, grid.reshape(-1)).reshape(grid.shape).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Game2048:
    """Static settings (hashable: usable as a jit static argument).

    size: the board is size x size (2..4; the reference's default 4). two_prob: a spawned
    tile is a 2 with this probability, else a 4. use_log_reward / invalid_act_score: the
    reference's reward settings (see the module docstring)."""

    name: str = "Game2048"
    size: int = 4
    two_prob: float = 0.9
    use_log_reward: bool = True
    invalid_act_score: float = -0.1

    action_names = ACTION_NAMES
    instruction = INSTRUCTION
    legend = ""
    symbols = ()
    num_actions = 4
    # the reference's budgets (config/_9_2048.yaml, envs.yaml): one action a turn, 700 in all
    budgets = (1, 700)

    def __post_init__(self):
        if not isinstance(self.size, (int, np.integer)) or isinstance(self.size, bool) \
                or not 2 <= self.size <= 4:
            # the score and the largest tile (2 ** (size * size + 1)) must fit int32
            raise ValueError(f"Game2048 size must be an int in [2, 4], got {self.size!r}")
        if isinstance(self.two_prob, bool) or not isinstance(self.two_prob, (int, float)) \
                or not 0.0 <= self.two_prob <= 1.0:
            raise ValueError(f"Game2048 two_prob must be a number in [0, 1], got {self.two_prob!r}")
        if not isinstance(self.use_log_reward, (bool, np.bool_)):
            raise ValueError(f"Game2048 use_log_reward must be a bool, got {self.use_log_reward!r}")
        if isinstance(self.invalid_act_score, bool) or not isinstance(self.invalid_act_score, (int, float)):
            raise ValueError(f"Game2048 invalid_act_score must be a number, got "
                             f"{self.invalid_act_score!r}")

    @property
    def max_exponent(self) -> int:
        """The largest tile is 2 ** max_exponent (every cell a distinct tile, spawns of 4)."""
        return self.size * self.size + 1

    @property
    def score_digits(self) -> int:
        """Digits of the largest score: each of the size ** 2 cells' tiles (< 2 ** (E + 1)) was
        merged at most E times, each merge adding at most its value."""
        e = self.max_exponent
        return len(str(self.size * self.size * e * 2 ** (e + 1)))

    # ----------------------------------------------------------- dynamics
    def text(self, max_actions_per_turn: int, max_actions_per_traj: int):
        """How its states read, as pieces (`envs.text.EnvText`), with these budgets."""
        return _text(self, max_actions_per_turn, max_actions_per_traj)

    def reset(self, key):
        """An empty board with two spawned tiles, score 0. -> Game2048State."""
        k1, k2 = jax.random.split(key)
        grid = jnp.zeros((self.size, self.size), jnp.int32)
        grid = spawn(k2, spawn(k1, grid, self.two_prob), self.two_prob)
        return Game2048State(grid=grid, score=jnp.zeros((), jnp.int32))

    def step(self, key, state, action):
        """One slide. key: PRNG key of the spawn; action: int (1 Up, 2 Right, 3 Down, 4 Left;
        others are no-ops).

        Returns (state, reward f32[], done bool[], info) with info bools `success` (the game
        ended with a tile >= 2048), `action_is_effective` and `action_is_valid` (both: the board
        changed, as the reference sets them). A finished game absorbs (reward 0, done)."""
        action = jnp.asarray(action, jnp.int32)
        known = (action >= 1) & (action <= 4)
        over = self.is_done(state)
        grids, gains, moved_all = all_moves(state.grid)
        d = jnp.clip(action - 1, 0, 3)
        moved = known & moved_all[d] & ~over
        gain = gains[d]
        grid = jnp.where(moved, spawn(key, grids[d], self.two_prob), state.grid)
        new = Game2048State(grid=grid, score=state.score + jnp.where(moved, gain, 0))
        raw = jnp.where(moved, gain.astype(jnp.float32), jnp.float32(self.invalid_act_score))
        if self.use_log_reward:
            reward = jnp.where(raw > 0, 0.1 * jnp.log2(raw + 1.0), 0.0)
        else:
            reward = raw
        reward = jnp.where(over | ~known, 0.0, reward).astype(jnp.float32)
        done = self.is_done(new)
        info = {
            "success": done & (jnp.max(new.grid) >= WIN_EXPONENT),
            "action_is_effective": moved,
            "action_is_valid": moved,
        }
        return new, reward, done, info

    # ------------------------------------------------------------- helpers
    def is_done(self, state):
        """bool[]: no move changes the board (the reference's `_is_terminal`)."""
        return ~jnp.any(all_moves(state.grid)[2])

    def valid_actions(self, state):
        """bool[4]: which of Up, Right, Down, Left change the board."""
        return all_moves(state.grid)[2]

    def name_to_action(self, state, index):
        """Action id for the name at 0-based `index` of `action_names` (0 if out of range)."""
        del state
        index = jnp.asarray(index, jnp.int32)
        return jnp.where((index >= 0) & (index < 4), index + 1, 0)

    # ----------------------------------------------------------- host text
    def to_text(self, state):
        """The reference's `render()` text of the state (host side)."""
        grid = np.asarray(state.grid)
        lines = ["Current 2048 Grid:"]
        for i, row in enumerate(grid):
            lines.append(f"Row {i + 1}: [" + ", ".join(str(tile(e)) for e in row) + "]")
        valid = [a for a in range(4) if bool(np.asarray(self.valid_actions(state))[a])]
        actions = ", ".join(f"{a}({ACTION_NAMES[a]})" for a in valid) if valid else "None"
        lines += ["", f"Valid Actions: {actions}.", GOAL_LINE,
                  f"Current Score: {int(state.score)}", "What is your next move?"]
        return "\n".join(lines)

    def from_text(self, text):
        """State from the reference's render text, or just its `Row i: [...]` lines (then with
        an optional `Current Score: N` line; score 0 without one). Tiles are 0 or powers of two
        from 2 to 2 ** max_exponent."""
        rows = re.findall(r"^Row (\d+): \[([^\]]*)\]$", text, flags=re.M)
        if [int(r[0]) for r in rows] != list(range(1, self.size + 1)):
            raise ValueError(f"2048 text needs lines `Row 1: [...]` to `Row {self.size}: [...]`, "
                             f"got rows {[int(r[0]) for r in rows]}")
        grid = np.zeros((self.size, self.size), np.int32)
        for i, (_, body) in enumerate(rows):
            cells = [c.strip() for c in body.split(",")]
            if len(cells) != self.size or not all(c.isdigit() for c in cells):
                raise ValueError(f"2048 row {i + 1} must hold {self.size} numbers, got [{body}]")
            for j, c in enumerate(cells):
                v = int(c)
                e = 0 if v == 0 else int(math.log2(v))
                if v != 0 and (v < 2 or 2 ** e != v or e > self.max_exponent):
                    raise ValueError(f"2048 tile {v} at row {i + 1} is not 0 or a power of two "
                                     f"in [2, {2 ** self.max_exponent}]")
                grid[i, j] = e
        m = re.search(r"^Current Score: (\d+)$", text, flags=re.M)
        score = int(m.group(1)) if m else 0
        if score >= 2 ** 31:
            raise ValueError(f"2048 score {score} does not fit int32")
        return Game2048State(grid=jnp.asarray(grid), score=jnp.asarray(score, jnp.int32))


def tile(e) -> int:
    """The tile value of exponent e (0 for an empty cell)."""
    return 0 if int(e) == 0 else 2 ** int(e)


# ----------------------------------------------------------------------- the solver
def greedy_move(grid):
    """int32[]: the greedy one-step lookahead's direction (0 Up, 1 Right, 2 Down, 3 Left) among
    those that change the board: the largest merged sum, then the most empty cells after the
    slide (before the spawn), then the first in the reference's order; 0 when none moves.
    Jittable."""
    grids, gains, moved = all_moves(grid)
    empties = jnp.sum(grids == 0, axis=(1, 2))
    n2 = grid.shape[0] * grid.shape[1]
    # lexicographic (gain, empties) as one int32: gain < 2 ** 27 for size <= 4
    value = gains * (n2 + 1) + empties
    return jnp.argmax(jnp.where(moved, value, -1)).astype(jnp.int32)


# ------------------------------------------------------------- a slow reference, for tests
def reference_move(grid, direction):
    """The reference's `_compress_and_merge` on a board of tile values (NumPy, in place on a
    copy). -> (new board, merged sum, moved)."""
    grid = np.array(grid, dtype=np.int64)
    axis, reverse = {0: (0, False), 1: (1, True), 2: (0, True), 3: (1, False)}[direction]
    size = grid.shape[axis]
    reward, moved_any = 0, False
    for fixed in range(grid.shape[1 - axis]):
        line = grid[:, fixed] if axis == 0 else grid[fixed, :]
        if reverse:
            line = line[::-1]
        vals = line[line != 0].tolist()
        merged, i = [], 0
        while i < len(vals):
            if i + 1 < len(vals) and vals[i] == vals[i + 1]:
                merged.append(vals[i] * 2)
                reward += vals[i] * 2
                i += 2
            else:
                merged.append(vals[i])
                i += 1
        new_line = np.array(merged + [0] * (size - len(merged)), dtype=np.int64)
        if reverse:
            new_line = new_line[::-1]
        before = (grid[:, fixed] if axis == 0 else grid[fixed, :]).copy()
        if axis == 0:
            grid[:, fixed] = new_line
        else:
            grid[fixed, :] = new_line
        moved_any |= not np.array_equal(before, new_line)
    return grid, reward, moved_any


# envs.make(name): RAGEN-2's 2048 (tag game_2048), a 4x4 board, the log reward
VARIANTS = {"Game2048": (Game2048, dict(size=4, two_prob=0.9, use_log_reward=True,
                                        invalid_act_score=-0.1))}


# ----------------------------------------------------------------------------- text
def _text(env, max_actions_per_turn, max_actions_per_traj) -> env_text.EnvText:
    """The reference's `render()`: a header, `Row i: [a, b, c, d]` lines, the valid actions
    (`0(Up), 2(Down)` or `None`), the goal line, the score and the question, as pieces: each
    row's frame, a piece per tile value, per valid action, and per score digit."""
    n, E, D = env.size, env.max_exponent, env.score_digits
    names = ACTION_NAMES
    pieces = (("Current 2048 Grid:\nRow 1: [",)
              + tuple(f"]\nRow {i}: [" for i in range(2, n + 1))
              + (", ", "]\n\nValid Actions: ", "None",
                 ".\n" + GOAL_LINE + "\nCurrent Score: ", "\nWhat is your next move?")
              + tuple(str(tile(e)) for e in range(E + 1))
              + tuple(f"{a}({names[a]})" for a in range(4))
              + tuple(str(d) for d in range(10)))
    SEP, VALID, NONE, MID, END = n, n + 1, n + 2, n + 3, n + 4  # row frames are 0..n-1
    TILE = n + 5
    ACT = TILE + E + 1
    DIGIT = ACT + 4
    width = n + n * (2 * n - 1) + 1 + 7 + 1 + D + 1

    def render(state):
        parts = []
        for i in range(n):
            cells = TILE + state.grid[i].astype(jnp.int32)  # [n]
            row = jnp.stack([cells, jnp.full((n,), SEP)], axis=1).reshape(-1)[:-1]
            parts += [jnp.array([i]), row]
        parts.append(jnp.array([VALID]))
        valid = env.valid_actions(state)  # [4]
        # the valid actions in order, ", " between them, padded after
        count = jnp.sum(valid)
        acts = ACT + jnp.argsort(~valid, stable=True)
        slots = jnp.stack([acts, jnp.full((4,), SEP)], axis=1).reshape(-1)[:-1]  # [7]
        slots = jnp.where(jnp.arange(7) < 2 * count - 1, slots, -1)
        slots = jnp.where(count == 0, jnp.full((7,), -1).at[0].set(NONE), slots)
        parts += [slots, jnp.array([MID])]
        pw = env_text.powers_of_ten(D)
        keep = (state.score >= pw) | (jnp.arange(D) == D - 1)
        parts += [jnp.where(keep, DIGIT + (state.score // pw) % 10, -1), jnp.array([END])]
        return jnp.concatenate(parts).astype(jnp.int32)

    frames = tuple(range(n)) + (VALID, NONE, MID, END)
    prefix = env_text.prefix_text(env, max_actions_per_traj)
    return env_text.EnvText(pieces, width, render, prefix, tuple(env.action_names),
                            max_actions_per_turn, max_actions_per_traj, ((frames, n + 3),))
