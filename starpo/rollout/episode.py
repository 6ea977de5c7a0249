"""The episode loop: observation ids -> tokens -> the policy's reply -> parse -> env steps, one
`lax.fori_loop` over turns, and the `Trajectory` it ends in."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from starpo import dialogue, parsing
from starpo import sampler as sampler_lib
from starpo.rollout.layout import (
    EpisodeCarry, Policy, TurnRecords, _Acted, _Layout, _Setup, _Steps, _chunk_width, _column,
    _observation, _prefix)
from starpo.rollout.spec import FORMAT_PENALTY
from starpo.trajectory import Trajectory, state_hash


def _first_ids(b: _Layout, env_states):
    """Piece ids of the first observation: turn 1's header, state, actions left, reply prime."""
    return _observation(b, [
        jnp.concatenate([_column(n, t.ids["header1"][1]), dialogue.state_pieces(e, t, s),
                         _column(n, t.ids["left"][e.max_actions_per_traj]),
                         _column(n, t.ids["gen"])], axis=1)
        for e, t, s, n in zip(b.setup.texts, b.setup.tables, env_states, b.sizes)])


def _next_ids(b: _Layout, c: EpisodeCarry, k):
    """Piece ids of the observation before turn k (k >= 1): the rest of the last reply's
    message, its reward, turn k+1's header, state and actions left, the reply prime."""
    M = b.setup.spec.max_turn
    is_eos = c.last_reason == sampler_lib.EOS
    per_env = []
    for e, t, s, r, n in zip(b.setup.texts, b.setup.tables, c.env, b.rows, b.sizes):
        ids, budget_e = t.ids, e.max_actions_per_traj
        close = jnp.full((n,), ids["close"], jnp.int32)
        for eos, p in zip(t.eos_ids, t.close_by_eos):
            close = jnp.where(is_eos[r] & (c.last_token[r] == eos), p, close)
        left = jnp.asarray(ids["left"])[jnp.clip(budget_e - c.num_actions[r], 0, budget_e)]
        header = jnp.asarray(ids["header2"])[jnp.minimum(k + 1, M)]  # "Turn k+1"
        per_env.append(jnp.concatenate([
            close[:, None], _column(n, ids["reward"]),
            dialogue.reward_pieces(t, c.reward[r], c.any_ran[r]),
            jnp.broadcast_to(header, (n, 1)).astype(jnp.int32), dialogue.state_pieces(e, t, s),
            left[:, None], _column(n, ids["gen"])], axis=1))
    return _observation(b, per_env)


def _play_actions(env, etext, thinking: bool, env_state, x, happened, budget_left, success,
                  keys) -> _Acted:
    """Parse the replies of one env's rows and run their valid actions (env steps vmapped).

    x [b,L] reply bytes (`parsing.reply_bytes`), happened [b] (a reply was written),
    budget_left [b], success [b] (so far), keys [R',b] with R' >= etext.max_actions_per_turn."""
    R = etext.max_actions_per_turn
    b = x.shape[0]
    if getattr(env, "text_actions", False):
        # Text actions (Countdown): every parsed piece is an action (the reference has no
        # action lookup for such envs); the env steps on the piece's bytes [b,L].
        c, first, last, has, n_parsed = parsing.parse_pieces(x, R, thinking)
        pieces = parsing.piece_bytes(c, first, last, has)  # [b,R,L]
        n_parsed = jnp.where(happened, n_parsed, 0)
        n_valid = n_parsed

        def action_at(state, s):
            return pieces[:, s]
    else:
        name_idx, n_parsed = parsing.parse_bytes(x, etext.action_names, R, thinking)
        n_parsed = jnp.where(happened, n_parsed, 0)
        is_valid = (name_idx >= 0) & happened[:, None]
        n_valid = jnp.sum(is_valid, axis=1).astype(jnp.int32)
        order = jnp.argsort(~is_valid, axis=1, stable=True)
        valid_idx = jnp.take_along_axis(name_idx, order, axis=1)  # valid ones first

        def action_at(state, s):
            return jax.vmap(env.name_to_action)(state, valid_idx[:, s])

    def act(s, a: _Steps) -> _Steps:
        run = happened & (s < n_valid) & (s < budget_left) & ~a.done
        action = action_at(a.env_state, s)
        new, r, d, info = jax.vmap(env.step)(keys[s], a.env_state, action)
        st = jax.tree_util.tree_map(
            lambda n, o: jnp.where(run.reshape(run.shape + (1,) * (n.ndim - 1)), n, o), new,
            a.env_state)
        return _Steps(st, a.reward + jnp.where(run, r, 0.0), a.done | (run & d),
                      a.executed + run, jnp.where(run, info["action_is_effective"],
                                                  a.effective_last),
                      a.success | (run & info["success"]),
                      a.n_effective + (run & info["action_is_effective"]))

    init = _Steps(env_state, jnp.zeros((b,), jnp.float32), jnp.zeros((b,), bool),
                  jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), success,
                  jnp.zeros((b,), jnp.int32))
    return _Acted(n_parsed, n_valid, jax.lax.fori_loop(0, R, act, init))


def _policy_step(b: _Layout, policy: Policy, c: EpisodeCarry, k, chunk, valid, key):
    """Turn k's observation + reply (rows not alive are untouched; skipped if none is).
    Returns (policy state, Turn, each row's end before the turn)."""
    B, N = c.alive.shape[0], b.setup.spec.max_new_tokens

    def go(c):
        env = (c.env, c.num_actions) if policy.sees_env else ()
        return policy.turn(c.policy, chunk, valid, key, c.alive, k, *env)

    def skip(c):
        return c.policy, _no_turn(B, N)

    return (*jax.lax.cond(jnp.any(c.alive), go, skip, c), c.policy.end)


def _no_turn(B: int, N: int) -> sampler_lib.Turn:
    return sampler_lib.Turn(jnp.zeros((B, N), jnp.int32), jnp.zeros((B, N), jnp.float32),
                            jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32))


def anchor_hash(env, env_state, salt: int = 0) -> jax.Array:
    """int32[B]: GiGPO's anchor of each row's env state: a hash of what the observation shows
    (a grid env's `render_codes`, verl-agent's anchor being the observation text), not of its
    bookkeeping, so the same board reached at different steps (Sokoban counts its steps, wall
    bumps included) joins one step group. Envs without a grid hash the whole state."""
    view = jax.vmap(env.render_codes)(env_state) if hasattr(env, "render_codes") else env_state
    return state_hash(view, salt=salt)


def _after_reply(b: _Layout, c: EpisodeCarry, k, key, pstate, turn, end_before) -> EpisodeCarry:
    """Parse turn k's replies, run their actions, record the turn."""
    setup, spec = b.setup, b.setup.spec
    happened = c.alive & (turn.length > 0)
    full_ctx = c.alive & (turn.stop_reason == sampler_lib.CONTEXT_FULL)
    table, tlens = (jnp.asarray(a) for a in setup.parse_table)
    prime = b"<think>" if spec.thinking else b"<answer>"
    x = parsing.reply_bytes(turn.tokens, turn.length, table, tlens, prime)
    budget = b.budget
    budget_left = budget - c.num_actions
    keys = jax.random.split(key, (max(t.max_actions_per_turn for t in setup.texts),
                                  happened.shape[0]))
    per_env = [_play_actions(env, e, spec.thinking, s, x[r], happened[r], budget_left[r],
                             c.success[r], keys[:, r])
               for env, e, s, r in zip(setup.envs, setup.texts, c.env, b.rows)]
    env_state = tuple(p.steps.env_state for p in per_env)
    before = jnp.concatenate([anchor_hash(env, s, salt=i)
                              for i, (env, s) in enumerate(zip(setup.envs, c.env))])
    a = jax.tree_util.tree_map(lambda *v: jnp.concatenate(v), *(
        p._replace(steps=p.steps._replace(env_state=())) for p in per_env))
    s = a.steps
    num_actions = c.num_actions + s.executed
    bad = happened & ((a.n_valid != a.n_parsed) | (a.n_valid == 0))
    ended = c.alive & (s.done | (num_actions >= budget) | (k + 1 >= spec.max_turn) | full_ctx
                       | ~happened)
    record = TurnRecords(
        start=jnp.where(happened, end_before, -1), end=jnp.where(happened, pstate.end - 1, -1),
        reward=jnp.where(happened, s.reward, 0.0), ran=(s.executed > 0).astype(jnp.int32),
        effective_last=s.effective_last.astype(jnp.int32), n_parsed=a.n_parsed,
        n_valid=a.n_valid, n_effective=s.n_effective,
        state_hash=jnp.where(happened, before, 0))
    return EpisodeCarry(
        policy=pstate, env=env_state, alive=c.alive & ~ended, num_actions=num_actions,
        success=s.success, penalty=c.penalty + jnp.where(bad, FORMAT_PENALTY, 0.0),
        truncated=c.truncated | full_ctx, reward=s.reward, any_ran=s.executed > 0,
        last_token=jnp.take_along_axis(turn.tokens, jnp.maximum(turn.length - 1, 0)[:, None],
                                       axis=1)[:, 0],
        last_reason=turn.stop_reason,
        turns=jax.tree_util.tree_map(lambda r, v: r.at[:, k].set(v), c.turns, record))


def _initial_carry(pstate, env_states, B: int, M: int) -> EpisodeCarry:
    zeros_f, zeros_i = jnp.zeros((B, M), jnp.float32), jnp.zeros((B, M), jnp.int32)
    none = jnp.full((B, M), -1, jnp.int32)
    return EpisodeCarry(
        policy=pstate, env=tuple(env_states), alive=jnp.ones((B,), bool),
        num_actions=jnp.zeros((B,), jnp.int32), success=jnp.zeros((B,), bool),
        penalty=jnp.zeros((B,), jnp.float32), truncated=jnp.zeros((B,), bool),
        reward=jnp.zeros((B,), jnp.float32), any_ran=jnp.zeros((B,), bool),
        last_token=jnp.zeros((B,), jnp.int32), last_reason=jnp.zeros((B,), jnp.int32),
        turns=TurnRecords(start=none, end=none, reward=zeros_f, ran=zeros_i,
                          effective_last=zeros_i, n_parsed=zeros_i, n_valid=zeros_i,
                          n_effective=zeros_i, state_hash=zeros_i))


def _results(b: _Layout, c: EpisodeCarry, group_id):
    """(Trajectory, per-episode metrics) of the finished episodes."""
    ps, tr = c.policy, c.turns
    T = ps.tokens.shape[1]
    length = ps.end
    posn = jnp.arange(T)[None]
    valid_tok = posn < length[:, None]
    started = (tr.start >= 0) & (tr.start[:, :1] >= 0)
    starts = jnp.where(started, tr.start, T + 1)
    turn_index = jnp.sum(posn[:, :, None] >= starts[:, None, :], axis=2) - 1
    prefix_length = jnp.where(started[:, 0], starts[:, 0], length)
    turn_index = jnp.where(valid_tok, jnp.maximum(turn_index, 0), -1).astype(jnp.int32)
    loss_mask = ps.generated & valid_tok
    traj = Trajectory(
        tokens=jnp.where(valid_tok, ps.tokens, 0), loss_mask=loss_mask, turn_index=turn_index,
        sample_logprobs=jnp.where(loss_mask, ps.logprobs, 0.0), turn_end=tr.end,
        turn_reward=tr.reward, penalty=c.penalty, success=c.success,
        num_actions=c.num_actions, group_id=group_id.astype(jnp.int32),
        tag=jnp.asarray(np.repeat(b.setup.tags, b.sizes), jnp.int32),
        length=length.astype(jnp.int32), state_hash=tr.state_hash,
        prefix_length=prefix_length.astype(jnp.int32))
    turns = jnp.sum(tr.end >= 0, axis=1)
    per_turn = jnp.maximum(turns, 1).astype(jnp.float32)
    metrics = {
        # the reference's per-episode metrics: per turn, the last executed action's info,
        # averaged over the episode's turns (a turn where nothing ran counts 0)
        "action_is_valid": jnp.sum(tr.ran, axis=1) / per_turn,
        "action_is_effective": jnp.sum(tr.effective_last * tr.ran, axis=1) / per_turn,
        "num_turns": turns.astype(jnp.int32),
        "num_parsed_actions": jnp.sum(tr.n_parsed, axis=1),
        "num_valid_actions": jnp.sum(tr.n_valid, axis=1),
        "num_effective_actions": jnp.sum(tr.n_effective, axis=1),
        "format_errors": jnp.sum((tr.end >= 0) & ((tr.n_valid != tr.n_parsed)
                                                  | (tr.n_valid == 0)), axis=1),
        "truncated": c.truncated,
        "context_used": length.astype(jnp.int32),
        "response_length": jnp.sum(loss_mask, axis=1).astype(jnp.int32),
    }
    return traj, metrics


def _play_episodes(setup: _Setup, policy: Policy, pstate, env_states, group_id, key):
    """Play a batch of episodes of one or several env variants.

    env_states: a tuple with one state [B_i] per env variant (its `setup.texts[i]`,
    `setup.tables[i]`); rows are laid out env by env (B = sum B_i). Every row has its own
    env's prompt prefix, observations, parser, budgets and dynamics; all rows share one policy
    batch (`policy` over its empty state `pstate`).
    Returns (Trajectory, metrics, tuple of final env states)."""
    B, M = group_id.shape[0], setup.spec.max_turn
    sizes = tuple(jax.tree_util.tree_leaves(s)[0].shape[0] for s in env_states)
    if sum(sizes) != B:
        raise ValueError(f"env states of {list(sizes)} rows for a batch of {B} rows")
    b = _Layout(setup, sizes, *dialogue.stack_pieces(setup.tables))
    # The system prompt and the env prefix are the same in every row of an env and in every
    # episode: they are appended once, without a reply (left-aligned, padded to the longest
    # env's). Every turn's observation then has one width C, the widest env's.
    prefix, prefix_valid, prefix_lengths = _prefix(setup, sizes)
    first_ids = _first_ids(b, env_states)
    C = _chunk_width(setup, prefix_lengths)

    def body(k, loop):
        c, key = loop
        key, k_env, k_pol = jax.random.split(key, 3)
        later = _next_ids(b, c, k)
        first = jnp.pad(first_ids, ((0, 0), (0, later.shape[1] - first_ids.shape[1])))
        chunk, valid = dialogue.assemble(b.pieces, jnp.where(k == 0, first, later), C)
        pstate, turn, end_before = _policy_step(b, policy, c, k, chunk, valid, k_pol)
        return _after_reply(b, c, k, k_env, pstate, turn, end_before), key

    # The barrier keeps XLA from constant-folding the prefix's forward pass (constant tokens
    # into an all-zero cache: minutes of compile time for nothing).
    pstate, prefix, prefix_valid = jax.lax.optimization_barrier((pstate, prefix, prefix_valid))
    c = _initial_carry(policy.prefill(pstate, prefix, prefix_valid), env_states, B, M)
    c, _ = jax.lax.fori_loop(0, M, body, (c, key))
    traj, metrics = _results(b, c, group_id)
    return traj, metrics, c.env
