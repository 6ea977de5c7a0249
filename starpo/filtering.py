"""Rollout filters: keep the groups whose in-group reward std is highest (or lowest).

Groups with identical rewards carry no learning signal for group-relative methods and little for
PPO. Groups are ranked by RAGEN-2's `rollout_filter_metric` (`group_scores`: the in-group std by
default, or the group's mean or summed reward, or its mean reply length), under one of RAGEN-2's
strategies (`rollout_filter_strategy`):

top_k      StarPO-S (paper v1): keep int(rollout_filter_ratio * groups) groups.
top_k_abs  RAGEN-2: keep rollout_filter_count groups (at most all).
           Both gather the kept groups into a batch of static size `static_groups(...) *
           group_size`, so the forward passes and updates that follow really do less work.
top_p      RAGEN-2's SNR-adaptive filter: keep the best-ranked groups until their share of the
           score mass reaches p (`top_p_groups`).
min_p      RAGEN-2: keep the groups scoring at least min_p x the best (`min_p_groups`).
           How many groups these keep depends on the rewards, but shapes must not: the batch
           keeps all rows (the static maximum, `static_groups`) and the dropped rows get a zero
           loss mask, so they add nothing to losses, token counts or statistics. This saves no
           compute; it changes what is learned from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from starpo.schema import (ADJUST_MODES, FILTER_GROUPS_METRICS, FILTER_LOSS_SCALINGS,  # noqa: F401
                           FILTER_METRICS, FILTER_STRATEGIES, FILTER_TYPES, TOP_P_PROB_MODES)

MASKED_STRATEGIES = ("top_p", "min_p")  # a kept count known only on device: rows masked
# RAGEN-2's test for a zero-variance group (rollout_filter_include_zero=False drops those)
ZERO_STD = 1e-10


def kept_groups(num_groups: int, ratio: float) -> int:
    """int(ratio * num_groups), at least 1 and at most num_groups: RAGEN's `topk(int(ratio *
    num_groups))` (the paper's and RAGEN-2's), with RAGEN-2's floor of one group."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"rollout_filter_ratio must be in (0, 1], got {ratio}")
    return min(num_groups, max(1, int(ratio * num_groups)))


def masks_rows(strategy: str, include_zero: bool = True) -> bool:
    """Whether the filter's kept count is known only on device, so that the update keeps every
    row and masks the dropped ones: top_p and min_p, and top_k / top_k_abs once zero-score
    groups are left out (`include_zero` off: fewer than k may remain)."""
    return strategy in MASKED_STRATEGIES or not include_zero


def top_k_count(num_groups: int, ratio: float, strategy: str, count: int = 1) -> int:
    """The k of top_k (`kept_groups`) or top_k_abs (`count`, at least 1, at most every
    group)."""
    if strategy == "top_k_abs":
        return min(num_groups, max(1, count))
    return kept_groups(num_groups, ratio)


def static_groups(num_groups: int, ratio: float, strategy: str, count: int = 1,
                  include_zero: bool = True) -> int:
    """Groups in the update's batch: top_k's or top_k_abs's k (`top_k_count`), or every group
    where the filter masks rows instead (`masks_rows`)."""
    if masks_rows(strategy, include_zero):
        return num_groups
    return top_k_count(num_groups, ratio, strategy, count)


def group_scores(rank_by: jax.Array, group_size: int, metric: str = "reward_variance",
                 lengths: jax.Array | None = None) -> jax.Array:
    """f32[G]: what ranks each group, from the rows' scores rank_by f32[B] (G x group_size):
    their in-group std (`reward_variance`), mean (`reward`) or sum (`reward_sum`), or the mean
    of the rows' reply lengths f32[B] (`length`: RAGEN-2's length filter ranks by it)."""
    if metric not in FILTER_METRICS:
        raise ValueError(f"unknown rollout_filter_metric {metric!r} (one of {FILTER_METRICS})")
    if metric == "reward_variance":
        return in_group_std(rank_by, group_size)
    x = (lengths if metric == "length" else rank_by).astype(jnp.float32).reshape(-1, group_size)
    return x.sum(axis=1) if metric == "reward_sum" else x.mean(axis=1)


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
                rank_by: jax.Array | None = None, metric: str = "reward_variance",
                lengths: jax.Array | None = None, strategy: str = "top_k", count: int = 1):
    """Choose the rows to train on (top_k, or top_k_abs with `count`).

    score: f32[B] trajectory rewards, B = G * group_size in group layout; rank_by: f32[B] the
    scores whose `group_scores` under `metric` rank the groups (default `score`; the metrics
    stay on `score`; lengths f32[B]: the rows' reply lengths, for `length`).
    Returns (rows int32[K * group_size] in increasing order, metrics) with K =
    `top_k_count(G, ratio, strategy, count)`. Metrics: `rollout/in_group_std` (mean over all groups), `rollout/chosen_in_group_std`
    (mean over kept groups), `rollout/kept_groups`, `rollout/batch_std` (unbiased std of the
    whole batch's rewards: the spread to watch when every group is a single episode) and
    RAGEN-2's `rollout/filter_kept_ratio` (K / G) and `rollout/filter_zero_count` (the groups
    whose ranking scores are all equal: no GRPO advantage, kept or not; every group of one).
    """
    B = score.shape[0]
    if B % group_size:
        raise ValueError(f"batch {B} is not a multiple of group_size {group_size}")
    G = B // group_size
    K = top_k_count(G, ratio, strategy, count)
    rank = group_scores(score if rank_by is None else rank_by, group_size, metric, lengths)
    if K == G:  # nothing to drop: skip the gather entirely
        groups = jnp.arange(G, dtype=jnp.int32)
    else:
        groups = select_groups(rank, K, filter_type)
    rows = (groups[:, None] * group_size + jnp.arange(group_size)[None, :]).reshape(-1)
    kept = jnp.zeros(G, bool).at[groups].set(True)
    metrics = {
        "rollout/kept_groups": jnp.float32(K),
        "rollout/batch_std": jnp.std(score, ddof=1) if B > 1 else jnp.float32(0.0),
        "rollout/filter_zero_count": zero_std_count(rank),
        **group_metrics(score, group_size, kept),
    }
    return rows.astype(jnp.int32), metrics


def group_metrics(score: jax.Array, group_size: int, kept: jax.Array) -> dict:
    """RAGEN-2's per-group statistics of the rewards score f32[B], over all groups and over the
    kept ones (kept bool[G]; 0 where none is kept): `rollout/in_group_std` / `_max` / `_mean`
    (and its `in_group_reward_*` copies of the first three, with `_sum`), the `chosen_` ones,
    and `rollout/filter_kept_count` / `_ratio`."""
    groups = score.reshape(-1, group_size)
    n = kept.sum().astype(jnp.float32)
    stats = {"std": in_group_std(score, group_size), "max": groups.max(axis=1),
             "mean": groups.mean(axis=1), "sum": groups.sum(axis=1)}
    out = {"rollout/filter_kept_count": n, "rollout/filter_kept_ratio": n / kept.shape[0]}
    for name, x in stats.items():
        chosen = jnp.where(kept, x, 0.0).sum() / jnp.maximum(n, 1.0)
        out[f"rollout/in_group_reward_{name}"] = x.mean()
        out[f"rollout/chosen_in_group_reward_{name}"] = chosen
        if name != "sum":
            out[f"rollout/in_group_{name}"] = x.mean()
            out[f"rollout/chosen_in_group_{name}"] = chosen
    return out


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


def min_p_groups(scores: jax.Array, min_p: float, filter_type: str,
                 include_zero: bool = True) -> jax.Array:
    """bool[G]: the groups RAGEN-2's min-p filter keeps, given each group's ranking score
    f32[G]: among the candidates (all groups, or with `include_zero` off those scoring above
    1e-10 in absolute value), for `std` (largest) those scoring at least min_p x the best
    candidate's score (less 1e-10), for `std_rev` (smallest) those scoring at most the lowest
    candidate's score / (min_p + 1e-10) (plus 1e-10); none where there is no candidate."""
    if filter_type not in FILTER_TYPES:
        raise ValueError(f"unknown rollout_filter_type {filter_type!r} (one of {FILTER_TYPES})")
    cand = jnp.ones(scores.shape, bool) if include_zero else jnp.abs(scores) > ZERO_STD
    if filter_type == "std":
        best = jnp.where(cand, scores, -jnp.inf).max()
        keep = scores >= best * min_p - ZERO_STD
    else:
        lowest = jnp.where(cand, scores, jnp.inf).min()
        keep = scores <= lowest / (min_p + ZERO_STD) + ZERO_STD
    return cand & keep


def top_k_groups(scores: jax.Array, k: int, filter_type: str, include_zero: bool = True
                 ) -> jax.Array:
    """bool[G]: RAGEN-2's top_k / top_k_abs over candidates (all groups, or with
    `include_zero` off those scoring above 1e-10 in absolute value): the min(k, candidates)
    best-ranked (ties to the lower group index), none where there is no candidate."""
    cand = jnp.ones(scores.shape, bool) if include_zero else jnp.abs(scores) > ZERO_STD
    sign = 1.0 if filter_type == "std" else -1.0
    order = jnp.argsort(jnp.where(cand & ~jnp.isnan(scores), -sign * scores, jnp.inf),
                        stable=True)
    ranked = jnp.arange(scores.shape[0]) < jnp.minimum(k, cand.sum())
    return jnp.zeros(scores.shape, bool).at[order].set(ranked)


def masked_rows(score: jax.Array, group_size: int, top_p: float, filter_type: str,
                prob_mode: str = "linear", include_zero: bool = True, eps: float = 0.01,
                rank_by: jax.Array | None = None, metric: str = "reward_variance",
                lengths: jax.Array | None = None, strategy: str = "top_p", min_p: float = 0.0,
                ratio: float = 1.0, count: int = 1):
    """A filter that masks rows (`masks_rows`: top_p, min_p, or top_k / top_k_abs without
    zero-score groups) over rows: (keep bool[B], metrics); B = G * group_size in group layout;
    rank_by: the scores whose `group_scores` under `metric` choose the groups (default `score`;
    the metrics stay on `score`; lengths: for `length`).

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
    rank = group_scores(score if rank_by is None else rank_by, group_size, metric, lengths)
    if strategy == "min_p":
        kept = min_p_groups(rank, min_p, filter_type, include_zero)
    elif strategy == "top_p":
        kept = top_p_groups(rank, top_p, filter_type, prob_mode, include_zero, eps)
    else:
        kept = top_k_groups(rank, top_k_count(G, ratio, strategy, count), filter_type,
                            include_zero)
    metrics = {
        "rollout/kept_groups": kept.sum().astype(jnp.float32),
        "rollout/batch_std": jnp.std(score, ddof=1) if B > 1 else jnp.float32(0.0),
        "rollout/filter_zero_count": zero_std_count(rank),
        **group_metrics(score, group_size, kept),
    }
    return jnp.repeat(kept, group_size), metrics
