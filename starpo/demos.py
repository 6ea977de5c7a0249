"""Demonstrations: a solver plays the episode loop in the reference dialogue, token for token as
the policy would write it (the supervised warm start and the paper's SFT baseline: starpo/sft.py).

Each turn the solver (`envs.solvers.next_moves`) reads the current env state on device and
plans up to A moves (A = `actions_per_turn`, at most the turn's action budget). On the slippery
lake, where a move's outcome is random, it plans under the whole budget instead
(`solvers.lake_budget_moves`: the sequence of up to A moves whose success is highest given the
turns and moves left, each later turn planned again from where the player slid). The reply is
the reference's format:

    thinking off (after `<answer>`):  Down || Left</answer>
    thinking on  (after `<think>`):   Plan: Down, Left.</think><answer>Down || Left</answer>

Every move sequence of length 1..A has its reply tokenised once on the host (V^1 + .. + V^A
replies for V action names: 1,365 for Sokoban's 4 names and 5 moves), so a reply is the
tokeniser's own encoding of its text, and the device only picks a row of that table. The
replies run through the same episode loop as the model's (`rollout.make_policy_rollout`), so
the Trajectory is what the sampler would have produced had the model written these replies.

A row whose level the solver cannot solve from the start (solver success 0) is played with a
placeholder reply and gets weight 0: it never trains.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from envs import solvers
from envs import text as env_text
from starpo import rollout as rollout_lib
from starpo import scripted

MAX_REPLIES = 20_000  # rows of a reply table (Sokoban's 5 moves of 4 names: 1,365)


def reply_text(names, thinking: bool) -> str:
    """The demonstration reply that plays the action names `names` (a non-empty sequence)."""
    answer = " || ".join(names)
    if thinking:
        return f"Plan: {', '.join(names)}.</think><answer>{answer}</answer>"
    return f"{answer}</answer>"


def moves_per_turn(env, spec: rollout_lib.RolloutSpec, actions_per_turn: int = 0) -> int:
    """Most moves a demonstration reply plays: `actions_per_turn`, never more than the turn's
    action budget; 0 = the budget, cut to the most whose reply table has at most MAX_REPLIES
    rows (Sudoku's 729 placements: one a reply). An `actions_per_turn` whose table is larger
    is a ValueError."""
    budget = env_text.make_text(env, spec.max_actions_per_turn,
                                spec.max_actions_per_traj).max_actions_per_turn
    moves = min(actions_per_turn or budget, budget)
    V = len(solvers.move_names(env))
    fits = max([1] + [n for n in range(1, moves + 1) if sum(V ** i for i in range(1, n + 1))
                      <= MAX_REPLIES])
    if actions_per_turn and fits < moves:
        raise ValueError(f"sft.actions_per_turn={actions_per_turn}: a reply table of {V} moves "
                         f"to the power {moves} exceeds {MAX_REPLIES} replies; use {fits}")
    return fits


def _replies(env, tokenizer, spec: rollout_lib.RolloutSpec, n: int):
    """Host: (texts, ids [R,N+1], len [R], stop [R]) of the replies of every sequence of n
    moves, name index i of move j weighing V^j (itertools.product varies the last position
    fastest, so each tuple is reversed)."""
    names = solvers.move_names(env)
    texts = [reply_text([names[i] for i in reversed(seq)], spec.thinking)
             for seq in itertools.product(range(len(names)), repeat=n)]
    ids, lens, stops = scripted.script_replies(tokenizer, [[t] for t in texts], 1,
                                               spec.max_new_tokens + 1)
    return texts, ids[:, 0], lens[:, 0], stops[:, 0]


def reply_table(env, tokenizer, spec: rollout_lib.RolloutSpec, moves: int, *,
                fit: bool = False):
    """Host: (ids [R,N], len [R], stop [R], moves) of every move sequence's reply, R = 1 + V +
    .. + V^moves; row 0 a placeholder (the first name alone), then sequences by length
    (`sequence_row`). A reply longer than rollout.response_length (N) tokens is a ValueError;
    with `fit`, the table stops at the longest sequences that fit instead (at least one move)."""
    N = spec.max_new_tokens
    parts = []
    for n in range(1, moves + 1):
        texts, ids, lens, stops = _replies(env, tokenizer, spec, n)
        if lens.max() > N:
            if fit and parts:
                break
            worst = texts[int(np.argmax(lens))]
            raise ValueError(f"a demonstration reply of {int(lens.max())} tokens ({worst!r}) "
                             f"does not fit rollout.response_length={N}; raise it or lower "
                             f"sft.actions_per_turn")
        parts.append((ids[:, :N], lens, stops))
    ids, lens, stops = (np.concatenate([p[i][:1] for p in parts[:1]] + [p[i] for p in parts])
                        for i in range(3))
    return ids, lens, stops, len(parts)


def sequence_row(names, n, V: int):
    """Row of `reply_table` for moves names int32[A] (first n used): 0 when n == 0."""
    A = names.shape[-1]
    j = jnp.arange(A)
    code = jnp.sum(jnp.where(j < n, names * V ** j, 0))
    starts = jnp.asarray([0] + [1 + sum(V ** i for i in range(1, m)) for m in range(1, A + 1)],
                         jnp.int32)
    return jnp.where(n > 0, starts[jnp.clip(n, 0, A)] + code, 0).astype(jnp.int32)


def solver_policy(env_list, tables, moves: tuple, budgets: tuple = (), plans: tuple = ()
                  ) -> rollout_lib.Policy:
    """The episode loop's policy (reads the env states) that writes each row's solver reply;
    `tables[i]` = `reply_table` of env i with `moves[i]` moves. `budgets[i]`: (turns, moves an
    episode) of env i where its replies plan under that budget (the slippery lake:
    `solvers.lake_budget_moves`, from the turn index and the actions each row has run), None
    where they plan from the state alone (`solvers.next_moves`). `plans[i]`: env i's rows'
    `solvers.lake_budget_plan` ([B_i]-batched), made once for the episode by the caller (else
    made again every turn)."""
    budgets = budgets or (None,) * len(env_list)
    plans = plans or (None,) * len(env_list)
    bases = np.cumsum([0] + [t[0].shape[0] for t in tables])[:-1]
    N = max(t[0].shape[1] for t in tables)
    ids = jnp.asarray(np.concatenate([np.pad(t[0], ((0, 0), (0, N - t[0].shape[1])))
                                      for t in tables]))
    lens = jnp.asarray(np.concatenate([t[1] for t in tables]))
    stops = jnp.asarray(np.concatenate([t[2] for t in tables]))

    def turn(state, chunk, valid, key, active, k, env_states, ran):
        del key
        rows, start = [], 0
        for env, s, A, base, budget, plan in zip(env_list, env_states, moves, bases, budgets,
                                                 plans):
            size = jax.tree_util.tree_leaves(s)[0].shape[0]
            if budget is None:
                names, n = jax.vmap(lambda st, env=env, A=A: solvers.next_moves(env, st, A))(s)
            else:
                turns, per_episode = budget
                names, n = jax.vmap(lambda st, used, p, env=env, A=A, T=turns, K=per_episode:
                                    solvers.lake_budget_moves(env, st, T - k, K - used, A, T, K,
                                                              plan=p),
                                    in_axes=(0, 0, None if plan is None else 0))(
                    s, ran[start:start + size], plan)
            start += size
            V = len(solvers.move_names(env))
            rows.append(base + jax.vmap(lambda a, m, V=V: sequence_row(a, m, V))(names, n))
        r = jnp.concatenate(rows)
        return scripted.script_turn(state, chunk, valid, active, ids[r], lens[r], stops[r])

    return rollout_lib.Policy(scripted.prefill, turn, sees_env=True)


def check_solvable(env) -> None:
    """ValueError (one line, naming why) for an env variant without a solver."""
    solvers.require_solver(env)


@functools.lru_cache(maxsize=8)
def make_demo_rollout(env, tokenizer, spec: rollout_lib.RolloutSpec, actions_per_turn: int = 0):
    """Jitted `play(env_state [B], key)` -> (Trajectory, metrics, weight f32[B]): the solver's
    episodes of the levels `env_state` in the dialogue of `spec` (its sampling settings do not
    apply); weight 1 where the solver can solve the level from its start, else 0. Replies play
    up to `actions_per_turn` moves (0: as many as the turn's budget allows and
    rollout.response_length fits)."""
    check_solvable(env)
    *table, moves = reply_table(env, tokenizer, spec, moves_per_turn(env, spec, actions_per_turn),
                                fit=not actions_per_turn)
    budget = None
    if getattr(env, "is_slippery", False):  # the lake: plans under the turns and moves left
        budget = (spec.max_turn, env_text.make_text(env, spec.max_actions_per_turn,
                                                    spec.max_actions_per_traj).max_actions_per_traj)

    @jax.jit
    def run(env_state, key):
        plan = None
        if budget is not None:  # the grid is the episode's: its plan is made once, not a turn
            plan = jax.vmap(lambda g: solvers.lake_budget_plan(env, g, moves, *budget))(
                env_state.grid)
        policy = solver_policy((env,), (table,), (moves,), (budget,), (plan,))
        play = rollout_lib.make_policy_rollout((env,), tokenizer, spec, policy)
        traj, metrics, _ = play((env_state,), key)
        weight = (jax.vmap(lambda s: solvers.solver_success(env, s))(env_state) > 0)
        return traj, metrics, weight.astype(jnp.float32)

    return run

