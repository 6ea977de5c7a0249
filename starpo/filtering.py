"""StarPO-S rollout filter: keep the groups whose in-group reward std is highest (or lowest).

Groups with identical rewards carry no learning signal for group-relative methods and little for
PPO; the paper keeps the top 25-50% of groups by reward std against the "Echo Trap" collapse.
The kept groups are gathered into a batch of static size `kept_groups(...) * group_size`, so the
forward passes and updates that follow really do less work.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

FILTER_TYPES = ("std", "std_rev")


def kept_groups(num_groups: int, ratio: float) -> int:
    """round(ratio * num_groups) (halves round up), at least 1 and at most num_groups."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"rollout_filter_ratio must be in (0, 1], got {ratio}")
    return min(num_groups, max(1, int(math.floor(ratio * num_groups + 0.5))))


def in_group_std(score: jax.Array, group_size: int) -> jax.Array:
    """Unbiased std f32[G] of each group's scores; score f32[B] laid out as G x group_size.

    Scores are sorted inside each group first so the std does not depend on the order of the
    rows (equal groups tie exactly, and the tie rule below decides). A group of one has std 0.
    """
    groups = jnp.sort(score.reshape(-1, group_size), axis=1)  # [G, group_size]
    mean = groups.mean(axis=1, keepdims=True)
    var = ((groups - mean) ** 2).sum(axis=1) / max(group_size - 1, 1)
    return jnp.sqrt(var)


def select_groups(std: jax.Array, num_kept: int, filter_type: str) -> jax.Array:
    """Indices int32[num_kept] of the kept groups, in increasing order.

    `std` keeps the largest stds, `std_rev` the smallest. Ties go to the lower group index (a
    stable sort), so the choice is deterministic. NaN stds sort as the least wanted.
    """
    if filter_type not in FILTER_TYPES:
        raise ValueError(f"unknown rollout_filter_type {filter_type!r} (one of {FILTER_TYPES})")
    nan = jnp.isnan(std)
    priority = jnp.where(nan, jnp.inf, -std if filter_type == "std" else std)
    order = jnp.argsort(priority, stable=True)
    return jnp.sort(order[:num_kept]).astype(jnp.int32)


def filter_rows(score: jax.Array, group_size: int, ratio: float, filter_type: str):
    """Choose the rows to train on.

    score: f32[B] trajectory rewards, B = G * group_size in group layout.
    Returns (rows int32[K * group_size] in increasing order, metrics) with K = kept_groups(G,
    ratio). Metrics: `rollout/in_group_std` (mean over all groups), `rollout/chosen_in_group_std`
    (mean over kept groups), `rollout/kept_groups`, and `rollout/batch_std` (unbiased std of the
    whole batch's rewards: the spread to watch when every group is a single episode).
    """
    B = score.shape[0]
    if B % group_size:
        raise ValueError(f"batch {B} is not a multiple of group_size {group_size}")
    G = B // group_size
    K = kept_groups(G, ratio)
    std = in_group_std(score, group_size)
    if K == G:  # nothing to drop: skip the gather entirely
        groups = jnp.arange(G, dtype=jnp.int32)
    else:
        groups = select_groups(std, K, filter_type)
    rows = (groups[:, None] * group_size + jnp.arange(group_size)[None, :]).reshape(-1)
    metrics = {
        "rollout/in_group_std": std.mean(),
        "rollout/chosen_in_group_std": std[groups].mean(),
        "rollout/kept_groups": jnp.float32(K),
        "rollout/batch_std": jnp.std(score, ddof=1) if B > 1 else jnp.float32(0.0),
    }
    return rows.astype(jnp.int32), metrics
