"""Pure-JAX environments of the reference: Bandit, FrozenLake, Sokoban, Countdown, 2048, Sudoku.

`make(name, **options)` returns an env object holding only static settings (a frozen,
hashable dataclass: close over it or pass it as a jit static argument). Every env offers

    state = env.reset(key)                                   # level generation on device
    state, reward, done, info = env.step(key, state, action) # info: success,
                                                             # action_is_effective, action_is_valid
    env.is_done(state), env.name_to_action(state, index)     # jittable
    env.to_text(state) -> str, env.from_text(text) -> state  # host side, the reference's text

with the reference's 1-based action ids (anything else is a no-op that counts as ineffective;
Countdown's and Sudoku's actions are text: `text_actions = True`, `step` takes the answer's bytes),
and plain-Python metadata for the text layer: `name`, `action_names`, `instruction`, `legend`,
`symbols` (render code -> text; grid envs also have `render_codes(state)`), `budgets` (the
reference's actions per turn and per episode) and `text(per_turn, per_traj)`, its states as
pieces for the dialogue (`envs.text.EnvText`). Batch with `jax.vmap` outside the env.
"""

from envs import bandit, countdown, frozenlake, game2048, sokoban, solvers, sudoku
from envs.bandit import Bandit, BanditState
from envs.countdown import Countdown, CountdownState
from envs.frozenlake import FrozenLake, FrozenLakeState, shortest_path_length
from envs.game2048 import Game2048, Game2048State
from envs.sokoban import Sokoban, SokobanState, solve
from envs.sudoku import Sudoku, SudokuState
from envs.solvers import has_solver, next_moves, optimal_moves, solver_success

# name -> (class, defaults), as each env module declares them (its VARIANTS): a new env is its
# module, named here once. Options given to `make` override the defaults.
_MODULES = (bandit, frozenlake, sokoban, countdown, game2048, sudoku)
_REGISTRY = {name: entry for module in _MODULES for name, entry in module.VARIANTS.items()}
NAMES = tuple(_REGISTRY)


def make(name, **options):
    """The env called `name` (one of NAMES) with `options` overriding its defaults.

    Raises ValueError for an unknown name or option, or for settings the env cannot honour.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown env {name!r}; known: {', '.join(NAMES)}")
    cls, defaults = _REGISTRY[name]
    allowed = [f for f in cls.__dataclass_fields__ if f != "name"]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for {name}; allowed: {', '.join(allowed)}")
    return cls(name=name, **{**defaults, **options})


__all__ = [
    "NAMES",
    "Bandit",
    "BanditState",
    "Countdown",
    "CountdownState",
    "FrozenLake",
    "FrozenLakeState",
    "Game2048",
    "Game2048State",
    "Sokoban",
    "SokobanState",
    "Sudoku",
    "SudokuState",
    "bandit",
    "countdown",
    "frozenlake",
    "game2048",
    "has_solver",
    "make",
    "next_moves",
    "optimal_moves",
    "shortest_path_length",
    "sokoban",
    "solve",
    "solver_success",
    "solvers",
    "sudoku",
]
