"""Env state -> text as pieces, for rendering observations on device.

Tokenisation is not jittable, so the text of a state is described as a sequence of *pieces*
drawn from a fixed, finite list of strings (`EnvText.pieces`): a grid is its cell symbols with a
newline piece between rows; the Bandit's text is one of its few whole prompts/results. The host
tokenises each piece once (starpo/dialogue.py); on device `EnvText.render(state)` gives the piece
ids, and the observation is a gather of their tokens. Decoding the pieces in order gives exactly
`env.to_text(state)` (checked by `check_render`).

Each env states its own text (`env.text(per_turn, per_traj) -> EnvText`, in its file; a grid env
takes `grid_text`) and its budgets (`env.budgets`: the reference's actions per turn and per
episode). Also here: the env's fixed prompt prefix (instruction, legend, action list, budget
line).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

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


def powers_of_ten(k: int) -> np.ndarray:
    """int32[k]: 10 ** (k-1) .. 10 ** 0 as a constant (`10 ** jnp.arange(k)`, an integer power
    of a traced array, becomes dozens of ops in every program that renders a number)."""
    return (10 ** np.arange(k - 1, -1, -1, dtype=np.int64)).astype(np.int32)


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


def grid_text(env, max_actions_per_turn, max_actions_per_traj) -> EnvText:
    """The text of a grid env (`symbols`, `render_codes`): its cells' symbols, rows joined by
    newlines (FrozenLake, Sokoban)."""
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


def make_text(env, max_actions_per_turn: int | None = None,
              max_actions_per_traj: int | None = None) -> EnvText:
    """The EnvText of an env made by `envs.make` (its own `text`), with its budgets: the
    reference's per turn and per episode (`env.budgets`) unless given."""
    turn0, traj0 = env.budgets
    per_turn = max_actions_per_turn or turn0
    per_traj = max_actions_per_traj or traj0
    if per_turn < 1 or per_traj < 1:
        raise ValueError(f"action budgets must be >= 1, got {per_turn} per turn, {per_traj} per episode")
    return env.text(per_turn, per_traj)


def check_render(text: EnvText, env, state) -> None:
    """Host check: the pieces of `state` spell `env.to_text(state)`. Raises ValueError."""
    import numpy as np

    ids = np.asarray(jax.jit(text.render)(state))  # one program, not one an op
    got = "".join(text.pieces[i] for i in ids if i >= 0)
    want = env.to_text(state)
    if got != want:
        raise ValueError(f"rendered pieces {got!r} differ from to_text {want!r}")
