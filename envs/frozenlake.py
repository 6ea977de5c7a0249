"""FrozenLake as a pure-JAX environment with on-device random maps.

Behaviour follows the reference (RAGEN's FrozenLake on top of gymnasium's FrozenLakeEnv):
actions 1 Left, 2 Down, 3 Right, 4 Up; when slippery the realised move is the intended one or
one of its two perpendiculars, each with p = 1/3; moving off the edge stays in place; entering
the goal pays 1.0; holes and the goal absorb (same cell, reward 0, done).

Map generation reproduces the reference's rejection sampler in one shot: `num_candidates`
maps are drawn together and the first valid one is kept (start != goal and a hole-free path
from start to goal). Conditioned on at least one candidate being valid this is exactly the
reference's distribution; the always-valid fallback (open lake, start top-left, goal
bottom-right) only fires when every candidate fails (11% of 4x4 draws are invalid, so all 16
candidates fail with p ~ 4e-16), so reset never loops and never depends on the process.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs import text as env_text
from envs import bitrows, hashrng

# Map cell codes held in the state.
FROZEN, HOLE, GOAL = 0, 1, 2
# Render codes are the map code, plus 3 on the player's cell: 3 player on ice, 4 player in a
# hole, 5 player on the goal. SYMBOLS[code] is the reference's text for it.
SYMBOLS = ("_", "O", "G", "P", "X", "√")
PLAYER = 3  # render code of the player's cell: PLAYER + the cell's own code (P, X or √)
ACTION_NAMES = ("Left", "Down", "Right", "Up")
INSTRUCTION = (
    "You are solving the FrozenLake puzzle. Forbid the whole and go to the target. You may move"
    " to the unintended direction due to the slippery ice. Example answer format: <think>To"
    " forbid the hole and go to the target, I should go left then go up.</think><answer>Left ||"
    " Up</answer>"
)
LEGEND = "P: player, _: empty, O: hole, G: goal, X: player in hole, √: player on goal"

# Row/col offsets of gymnasium's directions LEFT=0, DOWN=1, RIGHT=2, UP=3; the reference's
# action a is gymnasium direction a - 1, and a slip turns it by -1 or +1 (mod 4).
_DELTAS = np.array([[0, -1], [1, 0], [0, 1], [-1, 0]], np.int32)


@struct.dataclass
class FrozenLakeState:
    grid: jax.Array  # int8[size, size]: FROZEN / HOLE / GOAL (the start cell is FROZEN)
    pos: jax.Array  # int32[2]: player (row, col)


def _grow(reach):
    """bool[n, n]: `reach` plus its 4-neighbours (no wrap-around at the edges)."""
    grown = reach
    grown = grown | jnp.pad(reach[1:, :], ((0, 1), (0, 0)))
    grown = grown | jnp.pad(reach[:-1, :], ((1, 0), (0, 0)))
    grown = grown | jnp.pad(reach[:, 1:], ((0, 0), (0, 1)))
    grown = grown | jnp.pad(reach[:, :-1], ((0, 0), (1, 0)))
    return grown


def shortest_path_length(grid, start, goal):
    """Fewest moves from `start` to `goal` avoiding holes, or -1 if there is no such path.

    grid: int[n, n] map codes; start, goal: int32[2]. Returns int32[]. Jittable; vmap it for a
    batch. Breadth-first search as n*n - 1 frontier dilations (the longest possible path).
    """
    n = grid.shape[0]
    passable = grid != HOLE
    reach0 = jnp.zeros((n, n), bool).at[start[0], start[1]].set(True)

    def bfs_step(i, carry):
        reach, dist = carry
        reach = reach | (_grow(reach) & passable)
        hit = reach[goal[0], goal[1]] & (dist < 0)
        return reach, jnp.where(hit, i + 1, dist)

    at_goal = jnp.all(start == goal)
    _, dist = jax.lax.fori_loop(
        0, n * n - 1, bfs_step, (reach0, jnp.where(at_goal, 0, -1).astype(jnp.int32))
    )
    return dist


@dataclasses.dataclass(frozen=True)
class FrozenLake:
    """Static settings of one FrozenLake variant (hashable: usable as a jit static argument).

    size: the lake is size x size. p: probability that a cell is frozen (else a hole).
    is_slippery: slip to a perpendicular direction with p 2/3 in total.
    num_candidates: maps drawn per reset; the first valid one is used.
    """

    name: str = "FrozenLake"
    size: int = 4
    p: float = 0.8
    is_slippery: bool = True
    num_candidates: int = 16

    action_names = ACTION_NAMES
    instruction = INSTRUCTION
    legend = LEGEND
    symbols = SYMBOLS
    num_actions = 4

    def __post_init__(self):
        if not isinstance(self.size, int) or not 2 <= self.size <= 32:
            # Maps are generated as uint32 row bitmasks (envs/bitrows.py): at most 32 columns.
            raise ValueError(f"FrozenLake size must be an int in [2, 32], got {self.size!r}")
        if not 0.0 < float(self.p) <= 1.0:
            raise ValueError(f"FrozenLake p (probability of frozen) must be in (0, 1], got {self.p!r}")
        if not isinstance(self.num_candidates, int) or self.num_candidates < 1:
            raise ValueError(f"num_candidates must be an int >= 1, got {self.num_candidates!r}")

    # ---------------------------------------------------------------- reset
    # the reference's budgets for the grid games: 5 actions a turn, 10 an episode
    budgets = (5, 10)

    def text(self, max_actions_per_turn: int, max_actions_per_traj: int):
        """How its states read, as pieces (`envs.text.EnvText`), with these budgets."""
        return env_text.grid_text(self, max_actions_per_turn, max_actions_per_traj)

    def reset(self, key):
        """Draw a random valid map and put the player on its start cell. -> FrozenLakeState."""
        n, m = self.size, self.num_candidates
        # One threefry draw; the rest is a counter hash of it (fast, and quick to compile).
        stream = hashrng.stream_key(jax.random.bits(key, (), jnp.uint32), 0)
        words = hashrng.draw(stream, jnp.arange(m * (n * n + 4)).reshape(m, n * n + 4))
        frozen = hashrng.to_uniform(words[:, : n * n]).reshape(m, n, n) < self.p  # [m, n, n]
        cells = hashrng.uniform_int(hashrng.to_uniform(words[:, n * n :]), n)  # [m, 4]
        start, goal = cells[:, :2], cells[:, 2:]  # [m, 2] each, uniform over the grid
        # Start and goal overwrite whatever was drawn under them, as in the reference.
        ice = jax.vmap(bitrows.pack_rows)(frozen)  # [m, n] row bitmasks of the ice
        rows = jnp.arange(n)[None, :]
        ice = ice | jnp.where(rows == start[:, :1], bitrows.cell_bit(start[:, 1:]), jnp.uint32(0))
        ice = ice | jnp.where(rows == goal[:, :1], bitrows.cell_bit(goal[:, 1:]), jnp.uint32(0))
        reach = jax.vmap(bitrows.flood, in_axes=(0, 0, 0, None, None))(
            ice, start[:, 0], start[:, 1], n * n - 1, n
        )  # [m, n]
        goal_row = jnp.take_along_axis(reach, goal[:, :1], axis=1)[:, 0]
        reached = ((goal_row >> goal[:, 1].astype(jnp.uint32)) & 1).astype(bool)
        valid = jnp.any(start != goal, axis=1) & reached  # [m]
        first = jnp.argmax(valid)

        grid = jnp.where(bitrows.unpack_rows(ice[first], n), FROZEN, HOLE).astype(jnp.int8)
        grid = grid.at[goal[first, 0], goal[first, 1]].set(GOAL)
        fallback = jnp.full((n, n), FROZEN, jnp.int8).at[n - 1, n - 1].set(GOAL)
        ok = valid[first]
        return FrozenLakeState(
            grid=jnp.where(ok, grid, fallback),
            pos=jnp.where(ok, start[first], jnp.zeros(2, jnp.int32)).astype(jnp.int32),
        )

    # ----------------------------------------------------------------- step
    def step(self, key, state, action):
        """One action. key: PRNG key for the slip; action: int (1..4; others are no-ops).

        Returns (state, reward f32[], done bool[], info) with info bools `success` (player on
        the goal), `action_is_effective` (player cell changed), `action_is_valid` (1 <= a <= 4).
        """
        if self.is_slippery:
            slip = jnp.minimum(jnp.floor(jax.random.uniform(key) * 3).astype(jnp.int32), 2) - 1
        else:
            slip = jnp.zeros((), jnp.int32)
        return self.move(state, action, slip)

    def move(self, state, action, slip):
        """Deterministic step with the slip given: the realised gymnasium direction is
        (action - 1 + slip) mod 4, slip in {-1, 0, 1}. `step` draws the slip; tests and
        replays of recorded moves call this directly."""
        action = jnp.asarray(action, jnp.int32)
        valid = (action >= 1) & (action <= 4)
        absorbed = state.grid[state.pos[0], state.pos[1]] != FROZEN
        direction = jnp.mod(action - 1 + jnp.asarray(slip, jnp.int32), 4)
        target = jnp.clip(state.pos + jnp.asarray(_DELTAS)[direction], 0, self.size - 1)
        pos = jnp.where(valid & ~absorbed, target, state.pos)
        cell = state.grid[pos[0], pos[1]]
        moved = jnp.any(pos != state.pos)
        reward = jnp.where(moved & (cell == GOAL), 1.0, 0.0).astype(jnp.float32)
        info = {
            "success": cell == GOAL,
            "action_is_effective": moved,
            "action_is_valid": valid,
        }
        return state.replace(pos=pos), reward, cell != FROZEN, info

    # ------------------------------------------------------------- helpers
    def is_done(self, state):
        """bool[]: the player is in a hole or on the goal."""
        return state.grid[state.pos[0], state.pos[1]] != FROZEN

    def name_to_action(self, state, index):
        """Action id for the name at 0-based `index` of `action_names` (0 if out of range)."""
        del state  # the action ids of FrozenLake do not depend on the state
        index = jnp.asarray(index, jnp.int32)
        return jnp.where((index >= 0) & (index < 4), index + 1, 0)

    def symbol_limits(self):
        """(render codes, most cells showing one of them): the player's cell (P, X or √)."""
        return ((tuple(PLAYER + code for code in range(3)), 1),)

    def render_codes(self, state):
        """int32[size, size] render codes; `symbols[code]` is the text of each cell."""
        codes = state.grid.astype(jnp.int32)
        r, c = state.pos[0], state.pos[1]
        return codes.at[r, c].add(PLAYER)

    def shortest_path(self, state):
        """int32[]: fewest hole-free moves from the player to the goal (-1: no path)."""
        goal = jnp.argwhere(state.grid == GOAL, size=1, fill_value=0)[0]
        return shortest_path_length(state.grid, state.pos, goal.astype(jnp.int32))

    # ----------------------------------------------------------- host text
    def to_text(self, state):
        """The reference's text of the state: rows joined by newlines (host side)."""
        codes = np.asarray(self.render_codes(state))
        return "\n".join("".join(SYMBOLS[c] for c in row) for row in codes)

    def from_text(self, text):
        """Parse a map in the reference's text (one player: P, X or √; one goal) into a state."""
        rows = text.strip("\n").split("\n")
        if len(rows) != self.size or any(len(r) != self.size for r in rows):
            raise ValueError(
                f"FrozenLake text must be {self.size} rows of {self.size} symbols, got row "
                f"lengths {[len(r) for r in rows]}"
            )
        lookup = {s: i for i, s in enumerate(SYMBOLS)}
        codes = np.zeros((self.size, self.size), np.int32)
        for i, row in enumerate(rows):
            for j, ch in enumerate(row):
                if ch not in lookup:
                    raise ValueError(
                        f"unknown FrozenLake symbol {ch!r} at row {i}, col {j}; known: {SYMBOLS}"
                    )
                codes[i, j] = lookup[ch]
        players = np.argwhere(codes >= 3)
        if len(players) != 1:
            raise ValueError(f"FrozenLake text needs exactly one player (P, X or √), found {len(players)}")
        grid = np.where(codes >= 3, codes - 3, codes)
        if int((grid == GOAL).sum()) != 1:
            raise ValueError(f"FrozenLake text needs exactly one goal (G or √), found {(grid == GOAL).sum()}")
        return FrozenLakeState(
            grid=jnp.asarray(grid, jnp.int8), pos=jnp.asarray(players[0], jnp.int32)
        )

    def from_map(self, rows):
        """State from a gymnasium-style map (`S` start, `F` frozen, `H` hole, `G` goal)."""
        chars = {"S": "P", "F": "_", "H": "O", "G": "G"}
        try:
            text = "\n".join("".join(chars[c] for c in row) for row in rows)
        except KeyError as err:
            raise ValueError(f"unknown FrozenLake map character {err.args[0]!r}; known: SFHG") from None
        return self.from_text(text)


# envs.make(name): the variants of this env and their default options
VARIANTS = {
    "FrozenLake": (FrozenLake, dict(size=4, p=0.8, is_slippery=True)),
    # RAGEN-2's default lake: the same maps, every move goes where it is meant to
    "FrozenLakeNonSlippery": (FrozenLake, dict(size=4, p=0.8, is_slippery=False)),
}
