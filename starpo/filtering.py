"""Rollout filters: keep the groups whose in-group reward std is highest (or lowest).

Groups with identical rewards carry no learning signal for group-relative methods and little for
PPO. Two strategies (RAGEN's `rollout_filter_strategy`):

top_k  StarPO-S (paper v1): keep round(rollout_filter_ratio * groups) groups by std. The kept
       groups are gathered into a batch of static size `kept_groups(...) * group_size`, so the
       forward passes and updates that follow really do less work.
top_p  RAGEN-2's SNR-adaptive filter: keep the highest-std groups until their share of the std
       mass reaches p (`top_p_groups`). How many groups that is depends on the rewards, but shapes
       must not: the batch keeps all rows (the static maximum, `static_groups`) and the dropped
       rows get a zero loss mask, so they add nothing to losses, token counts or statistics. This
       saves no compute; it changes what is learned from.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

FILTER_TYPES = ("std", "std_rev")  # RAGEN-2 calls these `largest` / `smallest`
# RAGEN-2's filter_loss_scaling: advantages times 1, the kept share of groups, or its root
FILTER_LOSS_SCALINGS = ("none", "linear", "sqrt")
FILTER_STRATEGIES = ("top_k", "top_p")
TOP_P_PROB_MODES = ("linear", "softmax")
# what DAPO's dynamic sampling compares inside a group (`training.play_batch`)
FILTER_GROUPS_METRICS = ("score", "success")
# RAGEN-2's test for a zero-variance group (rollout_filter_include_zero=False drops those)
ZERO_STD = 1e-10


def kept_groups(num_groups: int, ratio: float) -> int:
    """round(ratio * num_groups) (halves round up), at least 1 and at most num_groups."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"rollout_filter_ratio must be in (0, 1], got {ratio}")
    return min(num_groups, max(1, int(math.floor(ratio * num_groups + 0.5))))


def static_groups(num_groups: int, ratio: float, strategy: str) -> int:
    """Groups in the update's batch: `kept_groups` for top_k, every group for top_p (whose
    dropped groups are masked, not removed)."""
    return num_groups if strategy == "top_p" else kept_groups(num_groups, ratio)


def in_group_std(score: jax.Array, group_size: int) -> jax.Array:
    """Unbiased std f32[G] of each group's scores; score f32[B] laid out as G x group_size.

    Scores are sorted inside each group first so the std does not depend on the order of the
    rows (equal groups tie exactly, and the tie rule below decides). A group of one has std 0.
    """
    groups = jnp.sort(score.reshape(-1, group_size), axis=1)  # [G, group_size]
    mean = groups.mean(axis=1, keepdims=True)
    var = ((groups - mean) ** 2).sum(axis=1) / max(group_size - 1, 1)
    return jnp.sqrt(var)


def zero_std_count(std: jax.Array) -> jax.Array:
    """RAGEN-2's `rollout/filter_zero_count`: the groups whose std is (float) zero, as f32."""
    return (jnp.abs(std) <= ZERO_STD).sum().astype(jnp.float32)


def nonzero_std_groups(score, group_size: int) -> np.ndarray:
    """bool[G] on the host: the groups DAPO's dynamic sampling keeps (verl's filter_groups):
    those whose scores are not all equal (in_group_std > 0), and every group of one episode
    (verl keeps a prompt with a single response). Each group's minimum is subtracted first, so
    a group of equal scores has std exactly 0 whatever its float rounding."""
    groups = np.asarray(score, np.float32).reshape(-1, group_size)
    if group_size == 1:
        return np.ones(groups.shape[0], bool)
    return np.asarray(in_group_std(groups - groups.min(axis=1, keepdims=True), group_size)
                      .reshape(-1)) > 0


def fill_groups(kept: list, num_groups: int) -> list[tuple[int, int]]:
    """DAPO's dynamic sampling: the (batch, group) pairs that fill a batch of num_groups groups.

    kept: one bool[G] per rollout batch played, in order (`nonzero_std_groups`). The kept
    groups come first, in (batch, group) order, up to num_groups; if fewer were found, the
    dropped groups of the last batch fill the rest, in group order (there are always enough:
    the shortfall is at most that batch's dropped groups)."""
    chosen = [(b, int(g)) for b, k in enumerate(kept) for g in np.flatnonzero(k)][:num_groups]
    short = num_groups - len(chosen)
    if short > 0:
        last = len(kept) - 1
        chosen += [(last, int(g)) for g in np.flatnonzero(~np.asarray(kept[last]))[:short]]
    return chosen


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


def filter_rows(score: jax.Array, group_size: int, ratio: float, filter_type: str,
                rank_by: jax.Array | None = None):
    """Choose the rows to train on.

    score: f32[B] trajectory rewards, B = G * group_size in group layout; rank_by: f32[B] the
    scores whose in-group std ranks the groups (default `score`; the metrics stay on `score`).
    Returns (rows int32[K * group_size] in increasing order, metrics) with K = kept_groups(G,
    ratio). Metrics: `rollout/in_group_std` (mean over all groups), `rollout/chosen_in_group_std`
    (mean over kept groups), `rollout/kept_groups`, `rollout/batch_std` (unbiased std of the
    whole batch's rewards: the spread to watch when every group is a single episode) and
    RAGEN-2's `rollout/filter_kept_ratio` (K / G) and `rollout/filter_zero_count` (the groups
    whose ranking scores are all equal: no GRPO advantage, kept or not; every group of one).
    """
    B = score.shape[0]
    if B % group_size:
        raise ValueError(f"batch {B} is not a multiple of group_size {group_size}")
    G = B // group_size
    K = kept_groups(G, ratio)
    std = in_group_std(score, group_size)
    rank = std if rank_by is None else in_group_std(rank_by, group_size)
    if K == G:  # nothing to drop: skip the gather entirely
        groups = jnp.arange(G, dtype=jnp.int32)
    else:
        groups = select_groups(rank, K, filter_type)
    rows = (groups[:, None] * group_size + jnp.arange(group_size)[None, :]).reshape(-1)
    metrics = {
        "rollout/in_group_std": std.mean(),
        "rollout/chosen_in_group_std": std[groups].mean(),
        "rollout/kept_groups": jnp.float32(K),
        "rollout/batch_std": jnp.std(score, ddof=1) if B > 1 else jnp.float32(0.0),
        "rollout/filter_kept_ratio": jnp.float32(K / G),
        "rollout/filter_zero_count": zero_std_count(rank),
    }
    return rows.astype(jnp.int32), metrics


def top_p_groups(std: jax.Array, top_p: float, filter_type: str, prob_mode: str = "linear",
                 include_zero: bool = True, eps: float = 0.01) -> jax.Array:
    """bool[G]: the groups RAGEN-2's top-p filter keeps, given each group's std f32[G].

    Candidates are all groups, or with `include_zero` off those with std > 1e-10. With
    top_p >= 1 every candidate is kept. Otherwise candidates are ranked by std (largest first
    for `std`, smallest first for `std_rev`; ties to the lower group index) and
      linear:  threshold = top_p * (sum of candidate stds) - eps; walk down the ranking adding
               stds while the running sum is below the threshold and the std is positive. If the
               sum reaches the threshold the walked prefix is kept, else nothing (RAGEN-2 then
               skips the step): an all-zero-std batch keeps nothing.
      softmax: p = softmax(+-std) over candidates; keep the shortest ranked prefix whose
               probability mass reaches top_p (at most every candidate).
    """
    if filter_type not in FILTER_TYPES:
        raise ValueError(f"unknown rollout_filter_type {filter_type!r} (one of {FILTER_TYPES})")
    if prob_mode not in TOP_P_PROB_MODES:
        raise ValueError(f"unknown rollout_filter_top_p_prob_mode {prob_mode!r}")
    std = jnp.where(jnp.isnan(std), 0.0, std)
    cand = jnp.ones(std.shape, bool) if include_zero else jnp.abs(std) > ZERO_STD
    if top_p >= 1.0:
        return cand
    sign = 1.0 if filter_type == "std" else -1.0
    order = jnp.argsort(jnp.where(cand, -sign * std, jnp.inf), stable=True)
    ranked_cand = cand[order]
    if prob_mode == "softmax":
        logits = jnp.where(cand, sign * std, -jnp.inf)
        probs = jax.nn.softmax(logits)[order]
        # equal probabilities are ranked by group index (the std ranking is the same order)
        before = jnp.cumsum(probs) - probs
        ranked = ranked_cand & (before < top_p)
    else:
        s = jnp.where(ranked_cand, std[order], 0.0)
        threshold = top_p * s.sum() - eps
        before = jnp.cumsum(s) - s
        walk = ranked_cand & (before < threshold) & (s > 0)
        walk = jnp.cumsum(~walk) == 0  # the loop stops at the first failed test
        reached = jnp.where(walk, s, 0.0).sum() >= threshold
        ranked = walk & reached
    return jnp.zeros(std.shape, bool).at[order].set(ranked)


def top_p_rows(score: jax.Array, group_size: int, top_p: float, filter_type: str,
               prob_mode: str = "linear", include_zero: bool = True, eps: float = 0.01,
               rank_by: jax.Array | None = None):
    """The top-p filter over rows: (keep bool[B], metrics); B = G * group_size in group layout;
    rank_by: the scores whose in-group std chooses the groups (default `score`; the metrics
    stay on `score`).

    Every row stays in the batch; `keep` marks the rows of kept groups (the update zeroes the
    loss mask of the others). Metrics: `rollout/in_group_std`, `rollout/chosen_in_group_std`
    (0 when nothing is kept), `rollout/kept_groups` (the dynamic count), `rollout/batch_std`,
    and RAGEN-2's `rollout/filter_kept_ratio` (kept / all groups) and
    `rollout/filter_zero_count` (groups with zero std).
    """
    B = score.shape[0]
    if B % group_size:
        raise ValueError(f"batch {B} is not a multiple of group_size {group_size}")
    G = B // group_size
    std = in_group_std(score, group_size)
    rank = std if rank_by is None else in_group_std(rank_by, group_size)
    kept = top_p_groups(rank, top_p, filter_type, prob_mode, include_zero, eps)
    n = kept.sum().astype(jnp.float32)
    metrics = {
        "rollout/in_group_std": std.mean(),
        "rollout/chosen_in_group_std": jnp.where(kept, std, 0.0).sum() / jnp.maximum(n, 1.0),
        "rollout/kept_groups": n,
        "rollout/batch_std": jnp.std(score, ddof=1) if B > 1 else jnp.float32(0.0),
        "rollout/filter_kept_ratio": n / G,
        "rollout/filter_zero_count": zero_std_count(rank),
    }
    return jnp.repeat(kept, group_size), metrics
