"""StarPO-S group filter against a slow Python selection."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starpo import filtering as F

filter_rows = functools.partial(
    jax.jit, static_argnums=(1, 2, 3),
    compiler_options={"xla_backend_optimization_level": 0})(F.filter_rows)


def ref_filter(score, group_size, ratio, kind):
    """Rows to keep: sort groups by std (largest first for `std`), ties by lower index."""
    groups = np.asarray(score, np.float64).reshape(-1, group_size)
    G = len(groups)
    stds = [g.std(ddof=1) if group_size > 1 else 0.0 for g in groups]
    keep = min(G, max(1, int(ratio * G)))  # RAGEN: topk(int(ratio * groups)), RAGEN-2: >= 1
    sign = -1 if kind == "std" else 1
    order = sorted(range(G), key=lambda g: (sign * stds[g], g))
    chosen = sorted(order[:keep])
    rows = [g * group_size + j for g in chosen for j in range(group_size)]
    return rows, float(np.mean(stds)), float(np.mean([stds[g] for g in chosen]))


@pytest.mark.parametrize("ratio,groups,want", [
    (0.25, 8, 2), (0.5, 8, 4), (1.0, 8, 8), (0.25, 2, 1), (0.25, 6, 1), (0.3, 5, 1),
    (0.01, 4, 1), (0.75, 2, 1), (0.7, 10, 7), (0.29, 100, 28)])
def test_kept_groups_rounds_down_as_ragen(ratio, groups, want):
    """RAGEN's int(ratio * groups) in float64 (0.29 * 100 is 28.999...: 28), at least 1."""
    assert F.kept_groups(groups, ratio) == want


def test_kept_groups_rejects_bad_ratio():
    with pytest.raises(ValueError):
        F.kept_groups(4, 0.0)
    with pytest.raises(ValueError):
        F.kept_groups(4, 1.5)


@pytest.mark.parametrize("kind", F.FILTER_TYPES)
def test_ties_go_to_the_lower_group_index(kind):
    # groups 1, 3 and 4 hold the same rewards in different orders: equal std, exactly
    score = np.array([[0.0, 0.0, 0.0, 0.0],
                      [1.0, 0.0, 0.0, 0.3],
                      [1.0, 1.0, 0.0, 0.0],
                      [0.3, 0.0, 1.0, 0.0],
                      [0.0, 0.3, 0.0, 1.0],
                      [0.1, 0.1, 0.1, 0.1]], np.float32).reshape(-1)
    for ratio in (2 / 6, 3 / 6):  # each ratio is a separate compile: two are enough
        rows, metrics = filter_rows(jnp.asarray(score), 4, ratio, kind)
        want_rows, in_std, chosen_std = ref_filter(score, 4, ratio, kind)
        assert np.asarray(rows).tolist() == want_rows, (ratio, kind)
        assert float(metrics["rollout/in_group_std"]) == pytest.approx(in_std, rel=1e-5)
        assert float(metrics["rollout/chosen_in_group_std"]) == pytest.approx(chosen_std,
                                                                              rel=1e-5, abs=1e-7)
        # groups 0 and 5 score alike throughout: no GRPO advantage there, kept or not
        assert float(metrics["rollout/filter_zero_count"]) == 2
    # spelled out once: the top 2 by std are group 2 (std 0.577) then group 1 (the first of the
    # tied 1/3/4); the bottom 2 are groups 0 and 5 (std 0)
    rows, _ = filter_rows(jnp.asarray(score), 4, 2 / 6, kind)
    want_groups = [1, 2] if kind == "std" else [0, 5]
    assert np.asarray(rows).tolist() == [g * 4 + j for g in want_groups for j in range(4)]


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_match_reference(seed):
    rng = np.random.default_rng(seed)
    score = rng.choice([0.0, 1.0, -0.1, 10.9], size=24).astype(np.float32)
    for kind in F.FILTER_TYPES:
        rows, metrics = filter_rows(jnp.asarray(score), 4, 3 / 6, kind)
        want_rows, in_std, chosen_std = ref_filter(score, 4, 3 / 6, kind)
        assert np.asarray(rows).tolist() == want_rows
        assert float(metrics["rollout/kept_groups"]) == 3
        assert float(metrics["rollout/chosen_in_group_std"]) == pytest.approx(chosen_std,
                                                                              rel=1e-5, abs=1e-7)


def test_ratio_one_keeps_everything_in_order():
    score = jnp.asarray(np.random.default_rng(9).normal(size=24), jnp.float32)
    rows, metrics = filter_rows(score, 4, 1.0, "std")
    assert np.asarray(rows).tolist() == list(range(24))
    assert float(metrics["rollout/chosen_in_group_std"]) == pytest.approx(
        float(metrics["rollout/in_group_std"]))


def test_single_episode_groups_keep_everything_and_report_the_batch_spread():
    score = np.random.default_rng(3).normal(size=12).astype(np.float32)
    rows, metrics = filter_rows(jnp.asarray(score), 1, 1.0, "std")
    assert np.asarray(rows).tolist() == list(range(12))
    assert float(metrics["rollout/in_group_std"]) == 0.0  # a group of one has no spread
    assert float(metrics["rollout/filter_zero_count"]) == 12
    want = np.sqrt(((score - score.mean()) ** 2).sum() / 11)  # the unbiased batch std
    assert float(metrics["rollout/batch_std"]) == pytest.approx(want, rel=1e-5)


def test_nan_group_is_least_wanted_and_std_is_order_free():
    score = np.zeros((6, 4), np.float32)
    score[:, 0] = [1.0, np.nan, 0.5, 0.0, 0.2, 2.0]  # group 1: NaN, never kept first
    rows, _ = filter_rows(jnp.asarray(score.reshape(-1)), 4, 3 / 6, "std")
    assert np.asarray(rows).tolist() == [g * 4 + j for g in (0, 2, 5) for j in range(4)]
    std = F.in_group_std(jnp.asarray([0.1, 0.7, 0.3, 0.7, 0.3, 0.1], jnp.float32), 3)
    assert float(std[0]) == float(std[1])


def test_batch_must_be_whole_groups():
    with pytest.raises(ValueError, match="group_size"):
        F.filter_rows(jnp.zeros(10), 4, 0.5, "std")
    with pytest.raises(ValueError, match="rollout_filter_type"):
        F.select_groups(jnp.zeros(3), 1, "max")
