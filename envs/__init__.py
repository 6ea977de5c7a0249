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
`symbols` (render code -> text; grid envs also have `render_codes(state)`). Batch with
`jax.vmap` outside the env.
"""

from envs import bandit, countdown, frozenlake, game2048, sokoban, solvers, sudoku
from envs.bandit import Bandit, BanditState
from envs.countdown import Countdown, CountdownState
from envs.frozenlake import FrozenLake, FrozenLakeState, shortest_path_length
from envs.game2048 import Game2048, Game2048State
from envs.sokoban import Sokoban, SokobanState, solve
from envs.sudoku import Sudoku, SudokuState
from envs.solvers import has_solver, next_moves, optimal_moves, solver_success

# name -> (class, defaults). Options given to `make` override the defaults; generator knobs of
# the Sokoban variants are tuned so their levels match the reference's difficulty.
_REGISTRY = {
    "Bandit": (Bandit, dict(low_arm="Phoenix", high_arm="Dragon")),
    "BanditTest": (Bandit, dict(low_arm="Trader", high_arm="Librarian")),
    "FrozenLake": (FrozenLake, dict(size=4, p=0.8, is_slippery=True)),
    # RAGEN-2's default lake: the same maps, every move goes where it is meant to
    "FrozenLakeNonSlippery": (FrozenLake, dict(size=4, p=0.8, is_slippery=False)),
    "SimpleSokoban": (Sokoban, dict(dim_x=6, dim_y=6, num_boxes=1, max_steps=100)),
    # Short walks, as the reference's search depth of 10 (at most 9 moves). Two boxes then fail
    # reverse play in 56% of rooms (the reference retries too): 32 rooms make the fallback
    # level a 1e-8 event.
    "LargerSokoban": (
        Sokoban,
        dict(dim_x=8, dim_y=8, num_boxes=2, max_steps=100, num_rooms=32, num_walks=32, walk_length=9),
    ),
    "SokobanDifferentGridVocab": (
        Sokoban,
        dict(dim_x=6, dim_y=6, num_boxes=1, max_steps=100, symbols=sokoban.VOCAB_SYMBOLS),
    ),
    # RAGEN-2's Countdown: 3 or 4 numbers (its dataset is Countdown-Tasks-3to4), one answer
    "Countdown": (Countdown, dict(min_count=3, max_count=4, min_number=1, max_number=99)),
    # RAGEN-2's 2048 (tag game_2048): a 4x4 board, the log reward
    "Game2048": (Game2048, dict(size=4, two_prob=0.9, use_log_reward=True, invalid_act_score=-0.1)),
    # RAGEN-2's Sudoku (tags SimpleSudoku / MediumSudoku): 32 or 40 blanks (its easy / medium),
    # 81 env steps, 20 or 30 actions an episode
    "SimpleSudoku": (Sudoku, dict(blanks=sudoku.BLANKS["easy"], max_steps=81, max_actions=20)),
    "MediumSudoku": (Sudoku, dict(blanks=sudoku.BLANKS["medium"], max_steps=81, max_actions=30)),
}
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
