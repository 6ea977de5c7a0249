"""Env state -> text as pieces, for rendering observations on device.

Tokenisation is not jittable, so the text of a state is described as a sequence of *pieces*
drawn from a fixed, finite list of strings (`EnvText.pieces`): a grid is its cell symbols with a
newline piece between rows; the Bandit's text is one of its few whole prompts/results. The host
tokenises each piece once (starpo/dialogue.py); on device `EnvText.render(state)` gives the piece
ids, and the observation is a gather of their tokens. Decoding the pieces in order gives exactly
`env.to_text(state)` (checked by `check_render`).

Also here: the env's fixed prompt prefix (instruction, legend, action list, budget line) and the
reference's per-env interaction budgets.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from envs import bandit as bandit_lib
from envs import countdown as countdown_lib
from envs import game2048 as game2048_lib

ACTION_SEP = "||"  # the reference's action separator (shown to the model as " || ")


@dataclasses.dataclass(frozen=True)
class EnvText:
    """How one env variant talks.

    pieces:    the strings a state's text is made of (piece ids index this tuple)
    width:     number of piece ids `render` returns (-1 pads)
    render:    jittable state -> int32[width] piece ids
    prefix:    the fixed text before the first turn (instruction, legend, actions, budget line)
    action_names: names an answer is matched against (case-insensitively)
    max_actions_per_turn / max_actions_per_traj: the reference's budgets for this env
    limits:    ((piece ids, most slots showing one of them), ...): pieces a state shows in few
               places (a grid's player, its boxes), for a tight bound on a state's tokens
               (`max_state_tokens`); () = none
    """

    pieces: tuple
    width: int
    render: Callable
    prefix: str
    action_names: tuple
    max_actions_per_turn: int
    max_actions_per_traj: int
    limits: tuple = ()


def max_state_tokens(text: EnvText, lengths) -> int:
    """The most tokens a rendered state can take, given each piece's token count `lengths`:
    each `limits` group fills at most its number of slots (at the longest piece of all), and
    every other slot shows the longest piece outside those groups."""
    lengths = [int(n) for n in lengths]
    limited = {i for ids, _ in text.limits for i in ids}
    capped = min(sum(n for _, n in text.limits), text.width)
    free = max((n for i, n in enumerate(lengths) if i not in limited), default=0)
    return capped * max(lengths) + (text.width - capped) * free


def prefix_text(env, max_actions_per_traj: int) -> str:
    """The reference's first-user-message prefix: instruction + legend + action list + budget."""
    text = env.instruction
    if env.legend:
        text += "\nThe meaning of each symbol in the state is:\n" + env.legend
    # grid envs have an action lookup; the Bandit's prompt is its state; Countdown has no lookup
    if env.instruction and env.action_names:
        text += "\nYour available actions are:\n" + ", ".join(env.action_names)
        text += (f"\nYou can make up to {max_actions_per_traj} actions, separated by the action "
                 f"separator \" {ACTION_SEP} \"\n")
    return text


def _grid_text(env, max_actions_per_turn, max_actions_per_traj) -> EnvText:
    symbols = tuple(env.symbols)
    newline = len(symbols)
    pieces = symbols + ("\n",)

    def render(state):
        codes = env.render_codes(state).astype(jnp.int32)  # [R, C]
        rows = codes.shape[0]
        nl = jnp.full((rows, 1), newline, jnp.int32)
        return jnp.concatenate([codes, nl], axis=1).reshape(-1)[:-1]  # no newline after last row

    codes_shape = _render_shape(env)
    width = codes_shape[0] * (codes_shape[1] + 1) - 1
    return EnvText(pieces, width, render, prefix_text(env, max_actions_per_traj),
                   tuple(env.action_names), max_actions_per_turn, max_actions_per_traj,
                   tuple(env.symbol_limits()))


def _render_shape(env):
    if hasattr(env, "size"):
        return (env.size, env.size)
    return (env.dim_x, env.dim_y)


def _bandit_text(env, max_actions_per_turn, max_actions_per_traj) -> EnvText:
    low, high = env.low_arm, env.high_arm
    pieces = (
        bandit_lib.PROMPT_TEMPLATE.format(name_a=low, name_b=high),   # 0: low arm is action 1
        bandit_lib.PROMPT_TEMPLATE.format(name_a=high, name_b=low),   # 1: high arm is action 1
        bandit_lib.RESULT_TEMPLATE.format(arm=low, reward=bandit_lib.LOW_RISK_REWARD),
        bandit_lib.RESULT_TEMPLATE.format(arm=high, reward=bandit_lib.HIGH_RISK_WIN),
        bandit_lib.RESULT_TEMPLATE.format(arm=high, reward=bandit_lib.HIGH_RISK_LOSS),
    )

    def render(state):
        pulled_high = (state.pulled == 1) == state.high_first
        after = jnp.where(pulled_high, jnp.where(state.reward > 0.5, 3, 4), 2)
        before = state.high_first.astype(jnp.int32)
        return jnp.where(state.pulled > 0, after, before).astype(jnp.int32)[None]

    return EnvText(pieces, 1, render, prefix_text(env, max_actions_per_traj),
                   tuple(env.action_names), max_actions_per_turn, max_actions_per_traj)


def _countdown_text(env, max_actions_per_turn, max_actions_per_traj) -> EnvText:
    """`Target: T, nums: [a, b, c]` as digit pieces and labels; after the answer one piece,
    `Your answer get R points.` for each reward the env pays."""
    digits = tuple(str(d) for d in range(10))
    TARGET, NUMS, SEP, CLOSE, RESULT = 10, 11, 12, 13, 14
    rewards = (env.score, env.format_score, 0)
    pieces = digits + ("Target: ", ", nums: [", ", ", "]") + tuple(
        countdown_lib.RESULT_TEMPLATE.format(reward=countdown_lib.py_number(r)) for r in rewards)
    n = env.max_count
    td, nd = len(str(env.max_target)), len(str(env.max_number))
    width = 1 + td + 1 + n * nd + (n - 1) + 1

    def number(v, k):  # piece ids [k]: v's digits right-aligned, -1 before
        pw = 10 ** jnp.arange(k - 1, -1, -1)
        keep = (v >= pw) | (jnp.arange(k) == k - 1)
        return jnp.where(keep, (v // pw) % 10, -1)

    def render(state):
        used = jnp.arange(n) < state.count
        parts = [jnp.array([TARGET]), number(state.target, td), jnp.array([NUMS])]
        for i in range(n):
            if i:
                parts.append(jnp.where(used[i], SEP, -1)[None])
            parts.append(jnp.where(used[i], number(state.nums[i], nd), -1))
        before = jnp.concatenate(parts + [jnp.array([CLOSE])])
        which = jnp.where(state.reward == jnp.float32(env.score), 0,
                          jnp.where(state.reward == jnp.float32(env.format_score), 1, 2))
        after = jnp.full((width,), -1).at[0].set(RESULT + which)
        return jnp.where(state.answered, after, before).astype(jnp.int32)

    long_pieces = (TARGET, NUMS, CLOSE, RESULT, RESULT + 1, RESULT + 2)
    return EnvText(pieces, width, render, prefix_text(env, max_actions_per_traj), (),
                   max_actions_per_turn, max_actions_per_traj, ((long_pieces, 3),))


def _game2048_text(env, max_actions_per_turn, max_actions_per_traj) -> EnvText:
    """The reference's `render()`: a header, `Row i: [a, b, c, d]` lines, the valid actions
    (`0(Up), 2(Down)` or `None`), the goal line, the score and the question, as pieces: each
    row's frame, a piece per tile value, per valid action, and per score digit."""
    n, E, D = env.size, env.max_exponent, env.score_digits
    names = game2048_lib.ACTION_NAMES
    pieces = (("Current 2048 Grid:\nRow 1: [",)
              + tuple(f"]\nRow {i}: [" for i in range(2, n + 1))
              + (", ", "]\n\nValid Actions: ", "None",
                 ".\n" + game2048_lib.GOAL_LINE + "\nCurrent Score: ", "\nWhat is your next move?")
              + tuple(str(game2048_lib.tile(e)) for e in range(E + 1))
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
        pw = 10 ** jnp.arange(D - 1, -1, -1)
        keep = (state.score >= pw) | (jnp.arange(D) == D - 1)
        parts += [jnp.where(keep, DIGIT + (state.score // pw) % 10, -1), jnp.array([END])]
        return jnp.concatenate(parts).astype(jnp.int32)

    frames = tuple(range(n)) + (VALID, NONE, MID, END)
    return EnvText(pieces, width, render, prefix_text(env, max_actions_per_traj),
                   tuple(env.action_names), max_actions_per_turn, max_actions_per_traj,
                   ((frames, n + 3),))


def make_text(env, max_actions_per_turn: int | None = None,
              max_actions_per_traj: int | None = None) -> EnvText:
    """The EnvText of an env made by `envs.make`. Budgets default to the reference's:
    5 actions per turn and 10 per episode for the grid games, 1 and 1 for the Bandit and
    Countdown, and an env's own `budgets` (per turn, per episode) where it states them."""
    single = isinstance(env, (bandit_lib.Bandit, countdown_lib.Countdown))
    turn0, traj0 = getattr(env, "budgets", None) or ((1, 1) if single else (5, 10))
    per_turn = max_actions_per_turn or turn0
    per_traj = max_actions_per_traj or traj0
    if per_turn < 1 or per_traj < 1:
        raise ValueError(f"action budgets must be >= 1, got {per_turn} per turn, {per_traj} per episode")
    if isinstance(env, countdown_lib.Countdown):
        return _countdown_text(env, per_turn, per_traj)
    if isinstance(env, game2048_lib.Game2048):
        return _game2048_text(env, per_turn, per_traj)
    build = _bandit_text if isinstance(env, bandit_lib.Bandit) else _grid_text
    return build(env, per_turn, per_traj)


def check_render(text: EnvText, env, state) -> None:
    """Host check: the pieces of `state` spell `env.to_text(state)`. Raises ValueError."""
    import numpy as np

    ids = np.asarray(text.render(state))
    got = "".join(text.pieces[i] for i in ids if i >= 0)
    want = env.to_text(state)
    if got != want:
        raise ValueError(f"rendered pieces {got!r} differ from to_text {want!r}")
