"""The levels a batch plays (each env's initial states from a seed and a stream), and a batch
played chunk by chunk and joined in row order."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp


# ------------------------------------------------------------------------------ levels
@functools.partial(jax.jit, static_argnames=("env", "env_groups", "group_size"))
def initial_states(env, key, seed, stream, env_groups, group_size):
    """One reset per group (key from stream and seed + group index), repeated group_size times.
    Returns (env state [env_groups * group_size], group_id: each row's group seed). One
    program: op by op, a generator's reset (Sokoban's) would compile hundreds of small ones."""
    group_seed = jnp.asarray(seed, jnp.int32) + jnp.arange(env_groups, dtype=jnp.int32)
    base = jax.random.fold_in(key, stream)
    keys = jax.vmap(lambda s: jax.random.fold_in(base, s))(group_seed)
    states = jax.vmap(env.reset)(keys)
    rep = lambda x: jnp.repeat(x, group_size, axis=0)  # noqa: E731
    return jax.tree_util.tree_map(rep, states), rep(group_seed)


def mixed_initial_states(mix, key, seed, stream, group_size):
    """Initial states of a mixed batch, mix = ((env, groups), ...): (a tuple with one state
    [groups_i * group_size] per env, group_id [B]). Group g of env i resets as in
    `initial_states` from seed + (groups of the envs before i) + g, so every group of the
    batch has its own seed (its group id) and a batch of G groups uses seeds seed .. seed+G-1,
    as a single-env batch does."""
    states, group_ids, before = [], [], 0
    for env, groups in mix:
        s, g = initial_states(env, key, jnp.asarray(seed, jnp.int32) + before, stream, groups,
                              group_size)
        states.append(s)
        group_ids.append(g)
        before += groups
    return tuple(states), jnp.concatenate(group_ids)


# ------------------------------------------------------------------------------ chunks
def play_in_chunks(run_from: Callable, rows: int, chunk: int, group_size: int,
                   join: Callable | None = None) -> Callable:
    """`run_from(params, key, env_state [chunk], group_id [chunk], temperature)` (a program
    of `chunk` rows of one env) as a function of the same arguments over `rows` rows: the rows
    are played `chunk` at a time, in order, and the chunks' (Trajectory, metrics) joined row
    by row (`join`, a list -> one; default `concat_rows`), so a chunk's KV cache is all that
    is resident at once. `chunk` is whole groups (a multiple of group_size) dividing `rows`;
    0 or `rows`: `run_from` itself. Chunk i samples with key `fold_in(key, i)`: the numbers
    then depend on the chunk size only through the sampling stream (one chunk: `key` itself,
    exactly as one call of `run_from`)."""
    chunk = chunk_size(rows, chunk, group_size)
    if chunk == rows:
        return run_from
    join = join or concat_rows

    def play_from(params, key, env_state, group_id, temperature):
        parts = [run_from(params, jax.random.fold_in(key, i),
                          *_take_rows((env_state, group_id), i * chunk, chunk), temperature)
                 for i in range(rows // chunk)]
        return join(parts)

    return play_from


def chunk_size(rows: int, batch_size: int, group_size: int) -> int:
    """Episodes per chunk of a `batch_size` setting (0 = all `rows`), checked to be whole
    groups of `group_size` dividing `rows`; raises ValueError otherwise."""
    chunk = batch_size or rows
    if chunk < 1 or chunk % group_size or rows % chunk:
        raise ValueError(f"batch_size {batch_size} is not whole groups of {group_size} "
                         f"episodes dividing the {rows} episodes (0 = all at once)")
    return chunk


@functools.partial(jax.jit, static_argnums=2)
def _take_rows(tree, start, n: int):
    return jax.tree_util.tree_map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, n), tree)


def concat_rows(parts):
    """One pytree of [sum B_i, ...] arrays from a list of pytrees of [B_i, ...] arrays."""
    return jax.tree_util.tree_map(lambda *x: jnp.concatenate(x), *parts)
