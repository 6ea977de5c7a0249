"""Rollouts whose replies are given (teacher-forced: tests, launch/play.py) or a policy's own."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from starpo import scripted
from starpo.rollout.episode import _play_episodes
from starpo.rollout.layout import Policy, _setup, context_length
from starpo.rollout.spec import RolloutSpec


# ------------------------------------------------------------------------------ scripted rollouts
def make_scripted_rollout(env, tokenizer, spec: RolloutSpec = RolloutSpec(), *, tag: int = 0):
    """The same episode loop with given replies instead of a model (tests, launch/play.py);
    the sampling settings of `spec` do not apply.

    Returns (play, tables) where jitted `play(env_state [B], reply_ids [B,M,N], reply_len [B,M],
    reply_stop [B,M], key)` -> (Trajectory, metrics, final env state); build the reply arrays
    with `scripted.script_replies`. group_id is the row index. Cached: the same settings share
    one compiled program.
    """
    play, tables = _scripted((env,), (tag,), tokenizer, _dialogue_only(spec))

    def play_one(env_state, reply_ids, reply_len, reply_stop, key):
        traj, metrics, final = play((env_state,), reply_ids, reply_len, reply_stop, key)
        return traj, metrics, final[0]

    return play_one, tables[0]


def make_mixed_scripted_rollout(env_list, tokenizer, spec: RolloutSpec = RolloutSpec()):
    """`make_scripted_rollout` of a batch that mixes env variants (`env_list`, a tuple of envs;
    env i's rows carry tag i), as `make_mixed_rollout` plays it.

    Returns (play, tables per env) where jitted `play(env_states, reply_ids [B,M,N], reply_len
    [B,M], reply_stop [B,M], key)` takes a tuple with one state [B_i] per env (rows env by
    env) and returns (Trajectory, metrics, tuple of final env states).
    """
    return _scripted(tuple(env_list), tuple(range(len(env_list))), tokenizer,
                     _dialogue_only(spec))


def _dialogue_only(spec: RolloutSpec) -> RolloutSpec:
    """The spec with its sampling settings at their defaults (one cache entry per dialogue)."""
    return RolloutSpec(spec.max_turn, spec.max_new_tokens, spec.max_context, spec.thinking,
                       spec.max_actions_per_turn, spec.max_actions_per_traj,
                       spec.length_in_prompt)


def make_policy_rollout(env_list, tokenizer, spec: RolloutSpec, policy: Policy):
    """The episode loop of a batch of `env_list`'s variants (env i's rows carry tag i) played
    by a policy over `scripted.ScriptState` (given or computed replies, no model): jitted
    `play(env_states, key)` -> (Trajectory, metrics, tuple of final env states); group_id is
    the row index. `demos` plays a solver's moves this way."""
    setup = _setup(tuple(env_list), tuple(range(len(env_list))), tokenizer, spec)

    def play(env_states, key):
        B = sum(jax.tree_util.tree_leaves(s)[0].shape[0] for s in env_states)
        return _play_episodes(setup, policy, scripted.empty_state(B, context_length(setup)),
                              env_states, jnp.arange(B, dtype=jnp.int32), key)

    return jax.jit(play)


@functools.lru_cache(maxsize=8)
def _scripted(envs, tags, tokenizer, spec: RolloutSpec):
    setup = _setup(envs, tags, tokenizer, spec)

    def play(env_states, reply_ids, reply_len, reply_stop, key):
        B = reply_ids.shape[0]
        policy = Policy(*scripted.script_policy(reply_ids, reply_len, reply_stop))
        return _play_episodes(setup, policy, scripted.empty_state(B, context_length(setup)),
                             env_states, jnp.arange(B, dtype=jnp.int32), key)

    return jax.jit(play), setup.tables
