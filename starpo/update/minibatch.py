"""The update's mini-batches: how many (Online-k), their rows (a fresh permutation per epoch or
in order), and RAGEN-2's adjusted batch of a filtered one (copies or deletions) in a static
shape."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from starpo.algo import AlgoConfig
from starpo.trajectory import Trajectory

if TYPE_CHECKING:
    from starpo.update.forward import Batch


def num_updates(algo: AlgoConfig, rows: int) -> tuple[int, int]:
    """(mini-batch size, k) for `rows` kept rows: k optimizer updates per rollout batch.

    k = online_k when set, else ppo_epochs * (rows // mini-batch size). Mini-batches are drawn
    from a fresh permutation of the rows each epoch (`shuffle_mini_batches`; else the rows in
    order); rows beyond a whole number of mini-batches sit that epoch out.
    """
    mini = min(algo.ppo_mini_batch_size, rows)
    per_epoch = rows // mini
    return mini, (algo.online_k if algo.online_k > 0 else algo.ppo_epochs * per_epoch)


def in_order(algo: AlgoConfig, rows: int) -> bool:
    """Whether the mini-batches of `rows` rows are the rows in order (`minibatch_order`):
    without `shuffle_mini_batches`, or where one mini-batch holds every row, whose order within
    it changes nothing but the float rounding of its micro-batches' sum."""
    return not algo.shuffle_mini_batches or min(algo.ppo_mini_batch_size, rows) == rows


def minibatch_order(algo: AlgoConfig, rows: int, key: jax.Array) -> jax.Array:
    """int32[k, mini]: the rows of each of the k mini-batches, a fresh permutation per epoch
    (or the rows in order every epoch, as verl splits them, where `in_order`)."""
    mini, k = num_updates(algo, rows)
    per_epoch = rows // mini
    epochs = -(-k // per_epoch)
    if not in_order(algo, rows):
        perms = jax.vmap(lambda kk: jax.random.permutation(kk, rows))(
            jax.random.split(key, epochs))
    else:
        perms = jnp.tile(jnp.arange(rows, dtype=jnp.int32), (epochs, 1))
    return perms[:, :per_epoch * mini].reshape(epochs * per_epoch, mini)[:k]


def adjusted_size(kept, groups: int, mini: int, mode: str = "copy"):
    """RAGEN-2's `adjust_batch`: a batch of `kept` rows grows by copies of its own rows to the
    next multiple of lcm(env_groups, ppo_mini_batch_size) (mode "copy"), or loses rows down to
    the multiple below (mode "delete"); its third factor, the GPU count, is 1 here: the mesh
    splits each mini-batch. Python or traced ints."""
    step = math.lcm(groups, mini)
    if mode == "delete":
        return kept // step * step
    return (kept + step - 1) // step * step


def kept_minibatch_order(algo: AlgoConfig, keep: jax.Array, groups: int, key: jax.Array):
    """(order int32[k, mini], real bool[k]): RAGEN-2's mini-batches of a filtered batch in a
    static shape. The n kept rows (`keep` bool[N]) alone form the batch, grown by copies of
    random kept rows to `adjusted_size` n' (copies drawn once, without replacement where n'-n
    <= n, as the reference), or under `batch_adjust_mode="delete"` cut to n' by dropping n-n'
    random kept rows; each epoch takes n' / mini mini-batches of a fresh permutation of those
    n' rows (without `shuffle_mini_batches`: the n' rows in order, the kept rows in row order
    then the copies). k = ppo_epochs x the most mini-batches any n can need; the ones past
    n' / mini in each epoch are not real: the update computes but never applies them (exact
    no-ops)."""
    N = keep.shape[0]
    mini = min(algo.ppo_mini_batch_size, N)
    cap = adjusted_size(N, groups, mini)  # slots of the largest adjusted batch
    slots = cap // mini
    k = algo.online_k if algo.online_k > 0 else algo.ppo_epochs * slots
    n = keep.sum()
    n_adj = jnp.minimum(adjusted_size(n, groups, mini, algo.batch_adjust_mode), cap)
    key, k_perm, k_draw = jax.random.split(key, 3)
    kept_rows = jnp.argsort(~keep, stable=True)  # the kept rows first, in row order
    i = jnp.arange(cap)
    # a random order of the kept rows: the copies are its first n'-n (or n'-n draws with
    # replacement), the deleted rows its first n-n'
    shuffled = kept_rows[jnp.argsort(jnp.where(jnp.arange(N) < n,
                                               jax.random.uniform(k_perm, (N,)), 2.0))]
    if algo.batch_adjust_mode == "delete":
        gone = jnp.zeros(N, bool).at[shuffled].set(jnp.arange(N) < n - n_adj)
        left = jnp.argsort(~(keep & ~gone), stable=True)  # the rest, in row order
        adjusted = left[jnp.clip(i, 0, N - 1)]  # [cap], n_adj real
    else:
        drawn = kept_rows[jax.random.randint(k_draw, (cap,), 0, jnp.maximum(n, 1))]
        copies = jnp.where(n_adj - n <= n, shuffled[jnp.clip(i - n, 0, N - 1)], drawn)
        adjusted = jnp.where(i < n, kept_rows[jnp.clip(i, 0, N - 1)], copies)  # n_adj real

    def epoch(kk):
        if not algo.shuffle_mini_batches:
            return adjusted
        return adjusted[jnp.argsort(jnp.where(i < n_adj, jax.random.uniform(kk, (cap,)), 2.0))]

    epochs = -(-k // slots)
    order = jax.vmap(epoch)(jax.random.split(key, epochs)).reshape(epochs * slots, mini)[:k]
    real = jnp.tile(jnp.arange(slots) < n_adj // mini, epochs)[:k]
    return order.astype(jnp.int32), real


def plain_split(algo: AlgoConfig, rows: int, groups: int) -> bool:
    """Whether the mini-batches of `rows` kept rows, of a rollout of `groups` groups, are those
    rows alone (`minibatch_order`): no top-p mask (the batch holds only kept rows) and no
    copies to grow it (`adjusted_size`); else `kept_minibatch_order`'s plan."""
    mini = min(algo.ppo_mini_batch_size, rows)
    return (not algo.masks_rows
            and adjusted_size(rows, groups, mini) == rows)


def minibatch_plan(algo: AlgoConfig, batch: Batch, traj: Trajectory, key: jax.Array):
    """(order [k, mini] of row indices, real bool[k]): the mini-batches of one update, those
    past the kept rows (a masking filter, or a batch RAGEN-2 would grow by copies) marked not
    real."""
    rows_in = batch.tokens.shape[0]
    groups = traj.tokens.shape[0] // algo.group_size  # the rollout's, before the filter
    if plain_split(algo, rows_in, groups):
        order = minibatch_order(algo, rows_in, key)  # [k, mini]
        return order, jnp.ones(order.shape[0], bool)
    keep = jnp.ones(rows_in, bool) if batch.keep is None else batch.keep
    return kept_minibatch_order(algo, keep, groups, key)
