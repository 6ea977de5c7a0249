"""Rollouts whose replies a model samples: `Rollout`, `make_rollout`, `make_mixed_rollout`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs import text as env_text
from starpo import dialogue, lora, parsing
from starpo import sampler as sampler_lib
from starpo.rollout.episode import _play_episodes
from starpo.rollout.layout import Policy, _setup, context_length
from starpo.rollout.levels import mixed_initial_states
from starpo.rollout.spec import RolloutSpec, TRAIN


# ------------------------------------------------------------------------------ model rollouts
@dataclasses.dataclass(frozen=True)
class Rollout:
    """What `make_rollout` / `make_mixed_rollout` build: the episode functions and the
    host-side tables they close over (one EnvText and DialogueTables per env variant).

    `play` / `play_from` are plain functions: jit them with your own compiler options and
    shardings; `run` / `run_from` are them jitted with the factory's `compiler_options` (on
    first use)."""

    # (params, key, seed, temperature, stream=TRAIN): new levels from seeds (`make_rollout`)
    play: Callable
    # (params, key, env_state, group_id, temperature): given levels; env_state [B], or for a
    # mixed rollout a tuple with one state [B_i] per env
    play_from: Callable
    spec: RolloutSpec
    texts: tuple  # EnvText per env
    env_tables: tuple  # DialogueTables per env
    sampler: sampler_lib.Sampler
    compiler_options: dict | None = None
    context: int = 0  # the Trajectory's T and the cache's slots (`context_length`)
    # > 1: `play_from` takes its rows in blocks of `share` (groups) that start from one level,
    # and appends a block's first prompt once (`sampler.run_turn`'s share); see `make_rollout`
    share: int = 1

    @functools.cached_property
    def run(self) -> Callable:
        return jax.jit(self.play, compiler_options=self.compiler_options)

    @functools.cached_property
    def run_from(self) -> Callable:
        return jax.jit(self.play_from, compiler_options=self.compiler_options)

    @property
    def text(self) -> env_text.EnvText:
        """The EnvText of a one-env rollout."""
        return _only(self.texts)

    @property
    def tables(self) -> dialogue.DialogueTables:
        """The DialogueTables of a one-env rollout."""
        return _only(self.env_tables)


def _only(per_env: tuple):
    if len(per_env) != 1:
        raise ValueError(f"a rollout of {len(per_env)} env variants has one per env "
                         "(Rollout.texts / Rollout.env_tables)")
    return per_env[0]


def make_rollout(env, tokenizer, model_cfg, spec: RolloutSpec = RolloutSpec(), *,
                 env_groups: int, group_size: int, tag: int = 0,
                 compiler_options: dict | None = None, share_groups: bool = True) -> Rollout:
    """A full rollout of `env_groups x group_size` episodes of `env` with the settings `spec`.

    `Rollout.run(params, key, seed, temperature, stream)` -> (Trajectory, metrics):
      key: PRNG key of the sampler and env steps; the reset keys come from a fixed base
      (`jax.random.key(0)`) folded with `stream` (TRAIN=0, VALIDATION=1: disjoint levels) and
      `seed + g` for group g, so pass a counter (e.g. iteration * env_groups) for new levels;
      temperature: traced f32 (0 = greedy).
    metrics: dict of per-episode arrays [B]: action_is_valid, action_is_effective (the
    reference's per-turn averages), num_turns, num_parsed_actions, num_valid_actions,
    num_effective_actions, format_errors, truncated, context_used, response_length.
    Trajectory length T = `Rollout.context` (spec.max_context, or the length an episode can
    reach where that is shorter: `context_length`). `compiler_options` go to `jax.jit` of `run` /
    `run_from` (e.g. {"xla_backend_optimization_level": 0}: faster compiles of tiny models on
    CPU). `Rollout.run_from(params, key, env_state [B], group_id [B], temperature)` plays
    given levels. Every row's Trajectory.tag is `tag`.

    Single-turn episodes (spec.max_turn 1) in groups of more than one: the group's rows share
    one level, so its prompt runs through the model once and its keys and values are copied to
    the group's rows (`Rollout.share` = group_size; the Bandit's cpu batch of 8 x 8: its
    rollout 13.6 -> 7.3 s on a 2-core CPU). `run_from` then expects its rows in whole groups
    of consecutive rows that start from the same env state, as `initial_states` lays them out;
    share_groups=False lifts that (and the saving).
    """
    r = make_mixed_rollout(((env, env_groups),), tokenizer, model_cfg, spec,
                           group_size=group_size, tags=(tag,), compiler_options=compiler_options,
                           share_groups=share_groups)
    mixed_from = r.play_from

    def play_from(params, key, env_state, group_id, temperature):
        return mixed_from(params, key, (env_state,), group_id, temperature)

    return dataclasses.replace(r, play_from=play_from)


def make_mixed_rollout(mix, tokenizer, model_cfg, spec: RolloutSpec = RolloutSpec(), *,
                       group_size: int, tags: tuple | None = None,
                       compiler_options: dict | None = None,
                       merge_adapters: bool = True, share_groups: bool = True) -> Rollout:
    """A rollout of one batch that mixes env variants: mix = ((env, groups), ...).

    Rows are laid out env by env, group by group (`groups_i x group_size` rows of env i); each
    row has its own env's prompt prefix, observations, answer parser, action budgets and
    dynamics, and every row is sampled in one batch by one sampler. Env i's rows carry
    Trajectory.tag `tags[i]` (default i). Otherwise as `make_rollout`:
    `run(params, key, seed, temperature, stream)` resets group g of env i from
    seed + (groups of the envs before i) + g (`mixed_initial_states`);
    `run_from(params, key, env_states, group_id [B], temperature)` takes a tuple with one
    env state [groups_i * group_size] per env.

    A LoRA model's adapters are merged into its weights once per call (`lora.merge`, in the
    decode dtype) and the episodes sample the plain model; merge_adapters=False samples
    through the adapters instead (`benchmarks/rollout.py` times both). share_groups: see
    `make_rollout` (each env's rows are whole groups).
    """
    adapted_cfg = model_cfg
    if merge_adapters:
        model_cfg = lora.merged_config(model_cfg)
    if not mix or any(int(g) < 1 for _, g in mix):
        raise ValueError(f"a rollout needs at least one env and >= 1 group per env, got "
                         f"{[(getattr(e, 'name', e), g) for e, g in mix]}")
    tags = tuple(range(len(mix))) if tags is None else tuple(tags)
    setup = _setup(tuple(e for e, _ in mix), tags, tokenizer, spec, model_cfg.vocab_size)
    smp = sampler_lib.make_sampler(model_cfg, tokenizer, spec.max_new_tokens,
                                   stop=("</answer>",), top_k=spec.top_k, top_p=spec.top_p,
                                   prefill_dtype=spec.prefill_dtype,
                                   decode_windows=spec.decode_windows,
                                   context_window=spec.context_window)
    stop_table = tuple(jnp.asarray(a) for a in sampler_lib.byte_table(
        parsing.padded_token_bytes(tokenizer, model_cfg.vocab_size)))
    T = context_length(setup)
    share = group_size if share_groups and spec.max_turn == 1 else 1

    def play_from(params, key, env_states, group_id, temperature):
        if merge_adapters:
            params = lora.merge(adapted_cfg, params, jnp.dtype(model_cfg.dtype))[1]
        # one row per group where the groups share their prompt (the prefill copies it)
        pstate = sampler_lib.init_state(model_cfg, group_id.shape[0] // share, T,
                                        spec.cache_dtype, turns=spec.context_window > 0,
                                        split=True)
        policy = _model_policy(smp, params, temperature, stop_table, share)
        traj, metrics, _ = _play_episodes(setup, policy, _SamplerView(pstate), env_states,
                                         group_id, key)
        return traj, metrics

    def play(params, key, seed, temperature, stream=TRAIN):
        env_states, group_id = mixed_initial_states(mix, jax.random.key(0), seed, stream,
                                                    group_size)
        return play_from(params, key, env_states, group_id, temperature)

    return Rollout(play, play_from, spec, setup.texts, setup.tables, smp, compiler_options, T,
                   share)


def _model_policy(smp: sampler_lib.Sampler, params, temperature, stop_table,
                  share: int = 1) -> Policy:
    """The sampler as the episode loop's policy (state: `_SamplerView`). share: rows per
    block that play one level (`sampler.run_turn`); only for single-turn episodes, where
    every turn is a first turn."""
    prefill_cfg = smp.cfg.replace(dtype=smp.prefill_dtype or smp.cfg.dtype)

    def turn(ps, chunk, valid, k, active, turn_k):
        st, turn = sampler_lib.run_turn(smp, params, ps.inner, chunk, valid, k,
                                        jnp.float32(temperature), active, stop_table,
                                        turn=turn_k, share=share)
        return _SamplerView(st), turn

    def prefill(ps, chunk, valid):
        if share == 1:
            return _SamplerView(append_without_reply(prefill_cfg, params, ps.inner, chunk,
                                                     valid))
        # the prefix too runs once per group (`ps` holds one row per group), its keys and
        # values copied to the group's rows
        B = chunk.shape[0]
        lead, back = np.arange(0, B, share), np.repeat(np.arange(B // share), share)
        one = append_without_reply(prefill_cfg, params, ps.inner, chunk[lead], valid[lead])
        return _SamplerView(sampler_lib.take_rows(one, back))

    return Policy(prefill, turn)


def append_without_reply(cfg, params, state: sampler_lib.SamplerState, chunk, valid=None):
    """Append chunk [B,P] (valid [B,P], left-aligned; default all) at every row's offset of an
    *empty* sampler state and write its keys/values, without decoding a reply (the prompt
    prefix). The sampler's own append (`sampler.append`), minus its decode loop. Under a
    context window the prefix's slots keep their initial turn, model.PREFIX_TURN (always seen),
    and a prefix attends to itself alone either way."""
    params = jax.tree_util.tree_map(lambda p: p.astype(jnp.dtype(cfg.dtype)), params)
    valid = jnp.ones(chunk.shape, bool) if valid is None else valid
    return sampler_lib.append(params, cfg, state, chunk, valid, fresh=True)[1]


@struct.dataclass
class _SamplerView:
    """SamplerState with the `end` the episode loop reads."""

    inner: sampler_lib.SamplerState

    @property
    def end(self):
        return self.inner.cache.end

    @property
    def tokens(self):
        return self.inner.tokens

    @property
    def logprobs(self):
        return self.inner.logprobs

    @property
    def generated(self):
        return self.inner.generated
