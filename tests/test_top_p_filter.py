"""RAGEN-2's top-p (SNR-adaptive), min-p and top-k-abs rollout filters and its ranking metrics
against slow Python loops written from `rollout_filter.py`."""

import jax.numpy as jnp
import numpy as np
import pytest

from starpo import filtering as F


def ref_top_p(std, p, kind, mode="linear", include_zero=True, eps=0.01):
    """Kept group indices (a set), by RAGEN-2's definition, one group at a time."""
    cand = [g for g, s in enumerate(std) if include_zero or abs(s) > 1e-10]
    if p >= 1.0:
        return set(cand)
    sign = 1.0 if kind == "std" else -1.0
    ranked = sorted(cand, key=lambda g: (-sign * std[g], g))  # ties: lower index first
    if mode == "softmax":
        if not cand:
            return set()
        e = {g: np.exp(sign * std[g] - max(sign * std[c] for c in cand)) for g in cand}
        total, mass, kept = sum(e.values()), 0.0, []
        for g in ranked:
            kept.append(g)
            mass += e[g] / total
            if mass >= p:
                break
        return set(kept)
    threshold = p * sum(std[g] for g in cand) - eps
    running, kept = 0.0, []
    for g in ranked:
        if running >= threshold or std[g] <= 0:
            break
        running += std[g]
        kept.append(g)
    return set(kept) if running >= threshold else set()


def kept_set(mask):
    return set(np.flatnonzero(np.asarray(mask)).tolist())


# binary fractions, so float32 sums are exact and the threshold comparisons are the same
STDS = [
    [0.0, 2.0, 1.0, 0.5, 0.5, 0.0],  # ties and zeros
    [0.0, 0.0, 0.0, 0.0],  # all-zero variance: linear keeps nothing (RAGEN-2 skips the step)
    [0.25, 0.25, 0.25, 0.25],  # all tied
    [4.0, 0.125, 0.0, 0.125],  # one group dominates
]


@pytest.mark.parametrize("std", STDS)
@pytest.mark.parametrize("kind", F.FILTER_TYPES)
def test_top_p_groups_match_the_loop(std, kind):
    for p in (0.3, 0.5, 0.9, 1.0):
        for mode in F.TOP_P_PROB_MODES:
            for include_zero in (True, False):
                got = kept_set(F.top_p_groups(jnp.asarray(std, jnp.float32), p, kind, mode,
                                              include_zero, 0.01))
                assert got == ref_top_p(std, p, kind, mode, include_zero), (p, mode, include_zero)


def test_top_p_spelled_out():
    std = jnp.asarray(STDS[0], jnp.float32)
    # threshold 0.5 * 4 - 0.01 = 1.99: group 1 (std 2) alone reaches it
    assert kept_set(F.top_p_groups(std, 0.5, "std")) == {1}
    # 0.9: 3.59 needs 2 + 1 + 0.5 + 0.5 (the two 0.5 ties both)
    assert kept_set(F.top_p_groups(std, 0.9, "std")) == {1, 2, 3, 4}
    assert kept_set(F.top_p_groups(std, 1.0, "std")) == set(range(6))
    assert kept_set(F.top_p_groups(std, 1.0, "std", include_zero=False)) == {1, 2, 3, 4}
    assert kept_set(F.top_p_groups(jnp.zeros(4), 0.9, "std")) == set()
    # eps rejects a batch whose whole std mass is below it
    assert kept_set(F.top_p_groups(jnp.asarray([0.004, 0.0]), 0.9, "std")) == set()


def test_top_p_rows_and_metrics():
    score = np.array([[0, 0, 0, 0], [1, 0, 1, 0], [1, 1, 1, 0], [2, 2, 2, 2],
                      [0, 1, 0, 0]], np.float32)
    std = score.std(axis=1, ddof=1)
    keep, m = F.masked_rows(jnp.asarray(score.reshape(-1)), 4, 0.6, "std")
    want = ref_top_p(std.tolist(), 0.6, "std")
    assert want == {1, 2}  # 0.577 + 0.5 = 1.077 >= 0.6 * 1.577 - 0.01; 0.577 alone is not
    assert np.asarray(keep).tolist() == np.repeat([g in want for g in range(5)], 4).tolist()
    assert float(m["rollout/kept_groups"]) == 2
    assert float(m["rollout/filter_kept_ratio"]) == pytest.approx(0.4)
    assert float(m["rollout/filter_zero_count"]) == 2
    assert float(m["rollout/in_group_std"]) == pytest.approx(std.mean(), rel=1e-5)
    assert float(m["rollout/chosen_in_group_std"]) == pytest.approx(std[[1, 2]].mean(),
                                                                     rel=1e-5)
    # RAGEN-2's other per-group figures, over all groups and the kept ones
    for name, x in (("max", score.max(axis=1)), ("mean", score.mean(axis=1))):
        assert float(m[f"rollout/in_group_{name}"]) == pytest.approx(x.mean())
        assert float(m[f"rollout/chosen_in_group_{name}"]) == pytest.approx(x[[1, 2]].mean())
    assert float(m["rollout/in_group_reward_sum"]) == pytest.approx(score.sum(axis=1).mean())
    assert float(m["rollout/in_group_reward_std"]) == float(m["rollout/in_group_std"])
    assert float(m["rollout/filter_kept_count"]) == 2
    keep, m = F.masked_rows(jnp.zeros(8), 4, 0.9, "std")
    assert not np.asarray(keep).any() and float(m["rollout/chosen_in_group_std"]) == 0


def test_static_groups():
    assert F.static_groups(8, 0.25, "top_k") == 2
    assert F.static_groups(8, 0.25, "top_p") == 8
    assert F.static_groups(8, 0.25, "min_p") == 8
    assert [F.static_groups(8, 0.25, "top_k_abs", c) for c in (0, 3, 8, 20)] == [1, 3, 8, 8]


def ref_min_p(scores, value, kind, include_zero=True):
    """RAGEN-2's min_p, one group at a time: candidates, then a bar from the best (largest) or
    the lowest (smallest) candidate; in float32 as its tensors are (`scores.float()`), with the
    Python-float constants rounded into them."""
    f = np.float32
    scores = [f(x) for x in scores]
    cand = [g for g, x in enumerate(scores) if include_zero or abs(x) > 1e-10]
    if not cand:
        return set()
    if kind == "std":
        bar = f(max(scores[g] for g in cand) * f(value))
        return {g for g in cand if scores[g] >= f(bar - f(1e-10))}
    bar = f(min(scores[g] for g in cand) / f(value + 1e-10))
    return {g for g in cand if scores[g] <= f(bar + f(1e-10))}


@pytest.mark.parametrize("scores", STDS + [[-1.0, 0.5, -0.25, 0.0]])
@pytest.mark.parametrize("kind", F.FILTER_TYPES)
def test_min_p_groups_match_the_loop(scores, kind):
    for value in (0.0, 0.25, 0.5, 0.9, 1.0):
        for include_zero in (True, False):
            got = kept_set(F.min_p_groups(jnp.asarray(scores, jnp.float32), value, kind,
                                          include_zero))
            assert got == ref_min_p(scores, value, kind, include_zero), (value, include_zero)
    # spelled out: half the best std (2.0) keeps 2.0 and 1.0; the smallest side with
    # include_zero off keeps the candidates within 1 / 0.5 = 2x the lowest (0.5): 0.5, 0.5, 1.0
    assert kept_set(F.min_p_groups(jnp.asarray(STDS[0]), 0.5, "std")) == {1, 2}
    assert kept_set(F.min_p_groups(jnp.asarray(STDS[0]), 0.5, "std_rev", False)) == {2, 3, 4}


def ref_scores(score, lengths, group_size, metric):
    """RAGEN-2's selection scores per group: torch-style unbiased std, mean, sum, or mean
    length."""
    groups = np.asarray(score, np.float64).reshape(-1, group_size)
    if metric == "reward_variance":
        return groups.std(axis=1, ddof=1) if group_size > 1 else np.zeros(len(groups))
    if metric == "reward":
        return groups.mean(axis=1)
    if metric == "reward_sum":
        return groups.sum(axis=1)
    return np.asarray(lengths, np.float64).reshape(-1, group_size).mean(axis=1)


@pytest.mark.parametrize("metric", F.FILTER_METRICS)
def test_each_metric_ranks_the_groups_and_top_k_abs_keeps_count_of_them(metric):
    """Six groups of three with distinct rewards and lengths: the group scores of each metric,
    and top-k-abs / top_k keeping the best (or worst) `count` groups by them (RAGEN-2:
    k = min(int(value), groups), at least 1)."""
    rng = np.random.default_rng(3)
    score = rng.normal(size=18).astype(np.float32)
    lengths = rng.integers(5, 50, 18).astype(np.float32)
    want = ref_scores(score, lengths, 3, metric)
    got = F.group_scores(jnp.asarray(score), 3, metric, jnp.asarray(lengths))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    for count, kind in ((2, "std"), (4, "std_rev"), (9, "std"), (0, "std")):
        k = max(1, min(count, 6))
        best = np.argsort(-want if kind == "std" else want, kind="stable")[:k]
        rows, m = F.filter_rows(jnp.asarray(score), 3, 1.0, kind, metric=metric,
                                lengths=jnp.asarray(lengths), strategy="top_k_abs",
                                count=count)
        assert np.asarray(rows).tolist() == [g * 3 + i for g in sorted(best) for i in range(3)]
        assert float(m["rollout/kept_groups"]) == k
        # the logged spreads stay the rewards' std, whatever ranks the groups
        assert float(m["rollout/in_group_std"]) == pytest.approx(
            ref_scores(score, None, 3, "reward_variance").mean(), rel=1e-5)


def test_min_p_rows_rank_by_the_metric():
    score = np.array([[0, 0, 0, 0], [1, 0, 1, 0], [1, 1, 1, 0], [2, 2, 2, 2]], np.float32)
    # by mean reward: 0, 0.5, 0.75, 2; min-p 0.3 of the best keeps 0.75 and 2 (groups 2, 3)
    keep, m = F.masked_rows(jnp.asarray(score.reshape(-1)), 4, 1.0, "std", metric="reward",
                           strategy="min_p", min_p=0.3)
    assert np.asarray(keep).tolist() == np.repeat([False, False, True, True], 4).tolist()
    assert float(m["rollout/kept_groups"]) == 2


def ref_top_k(scores, k, kind, include_zero=True):
    """RAGEN-2's top_k / top_k_abs given its k: the candidates, then the k best of them (at
    least 1, at most all; ties to the lower index), none without a candidate."""
    cand = [g for g, x in enumerate(scores) if include_zero or abs(x) > 1e-10]
    if not cand:
        return set()
    sign = 1.0 if kind == "std" else -1.0
    return set(sorted(cand, key=lambda g: (-sign * scores[g], g))[:max(1, min(k, len(cand)))])


@pytest.mark.parametrize("scores", STDS)
@pytest.mark.parametrize("kind", F.FILTER_TYPES)
def test_top_k_without_zero_score_groups_matches_the_loop(scores, kind):
    """With rollout_filter_include_zero off, top_k and top_k_abs rank the nonzero groups
    alone, so fewer than k may be kept (none in an all-zero batch): the rows are masked."""
    assert F.masks_rows("top_k", include_zero=False) and not F.masks_rows("top_k")
    G = len(scores)
    assert F.static_groups(G, 0.5, "top_k", include_zero=False) == G
    for k in (1, 2, 3, 6):
        got = kept_set(F.top_k_groups(jnp.asarray(scores, jnp.float32), k, kind, False))
        assert got == ref_top_k(scores, k, kind, include_zero=False), k
        assert kept_set(F.top_k_groups(jnp.asarray(scores, jnp.float32), k, kind)) == \
            ref_top_k(scores, k, kind)
    # through the rows: groups of two whose in-group stds are the scores above
    score = np.stack([[0.0, s * np.sqrt(2)] for s in scores]).reshape(-1).astype(np.float32)
    keep, m = F.masked_rows(jnp.asarray(score), 2, 1.0, kind, include_zero=False,
                            strategy="top_k_abs", count=2)
    want = ref_top_k(scores, 2, kind, include_zero=False)
    assert kept_set(np.asarray(keep).reshape(-1, 2).all(axis=1)) == want
    assert float(m["rollout/kept_groups"]) == len(want)
