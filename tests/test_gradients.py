"""RAGEN-2's gradient analysis (starpo/gradients.py) against slow references: the buckets as
RAGEN-2's `split_into_buckets` builds them (a loop over sorted groups), and each bucket's
component gradient norms from the update's own gradient function, mini-batch by mini-batch,
the entropy term's gradient as the difference of two (the gradient is linear in the terms)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from starpo import gradients
from starpo import update as UP
from tests.test_update import CFG, GRPO, GROUP_SIZE, GROUPS, copy, random_params
from tests.test_update import synthetic_trajectory


def ragen2_buckets(std, count, mode="quantile"):
    """RAGEN-2's split_into_buckets over groups: {name: [group indices]}."""
    G = len(std)
    if mode == "fixed_rv":
        edges = [0, 1, 2, 3, 4, 5]
        out = {}
        for i, low in enumerate(edges):
            high = edges[i + 1] if i + 1 < len(edges) else math.inf
            out[f"bucket_{i + 1}"] = [g for g in range(G) if low <= std[g] < high]
        return out
    nb = min(count, G)
    per, rem = G // nb, G % nb
    order = sorted(range(G), key=lambda g: (std[g], g))
    out, start = {}, 0
    for i in range(nb):
        size = per + (rem if i == nb - 1 else 0)
        out[f"bucket_{i + 1}"] = order[start:start + size]
        start += size
    return out


@pytest.mark.parametrize("count", [1, 2, 3, 6, 9])
def test_quantile_buckets_are_ragen2s(count):
    rng = np.random.default_rng(count)
    std = np.round(rng.random(7), 1)  # ties: lower group first
    kept = np.ones(7, bool)
    got, n = gradients.group_buckets(jnp.asarray(std, jnp.float32), jnp.asarray(kept), count)
    got = np.asarray(got)
    want = ragen2_buckets(list(std), count)
    for name, groups in want.items():
        b = int(name.split("_")[1]) - 1
        assert sorted(np.flatnonzero(got == b).tolist()) == sorted(groups), name
    assert n == count and got.max() == min(count, 7) - 1


def test_buckets_of_the_kept_groups_and_fixed_intervals():
    std = np.array([0.5, 3.2, 0.0, 1.0, 7.0, 2.5], np.float32)
    kept = np.array([True, True, False, True, True, False])
    got, _ = gradients.group_buckets(jnp.asarray(std), jnp.asarray(kept), 2)
    # the 4 kept groups by std: 0 (0.5), 3 (1.0), 1 (3.2), 4 (7.0): two of two
    assert np.asarray(got).tolist() == [0, 1, -1, 0, 1, -1]
    got, n = gradients.group_buckets(jnp.asarray(std), jnp.asarray(np.ones(6, bool)), 2,
                                     "fixed_rv")
    want = ragen2_buckets(list(std), 2, "fixed_rv")
    assert n == 6
    for name, groups in want.items():
        assert np.flatnonzero(np.asarray(got) == int(name[-1]) - 1).tolist() == groups


def test_bucket_gradient_norms_match_the_updates_gradients():
    """All 4 groups kept (8 rows), 3 quantile buckets (1, 1 and 2 groups), mini-batches of 2
    rows: every bucket's task and entropy gradient norms and losses, averaged over its
    mini-batches of rows in row order, equal those of the update's gradient function on the
    same mini-batches."""
    traj = synthetic_trajectory(5)
    algo = GRPO.replace(rollout_filter_ratio=1.0, entropy_coeff=0.05, ppo_mini_batch_size=2,
                        micro_batch_size=1)
    params = random_params(CFG, 0)
    state = UP.init_train_state(algo, copy(params))
    analysis = gradients.GradientAnalysis(algo, CFG, every=1, count=3)
    assert [n for n in range(1, 8) if analysis.due(n)] == list(range(1, 8))
    got = analysis(state, traj)

    score = np.asarray(traj.score, np.float64).reshape(GROUPS, GROUP_SIZE)
    std = [float(np.std(g, ddof=1)) for g in score]
    buckets = {"all": list(range(GROUPS)), **ragen2_buckets(std, 3)}
    assert [len(g) for g in buckets.values()] == [4, 1, 1, 2]
    batch, _ = jax.jit(UP.make_prepare(algo, CFG))(state, traj)
    task_fn = jax.jit(UP.make_grad_fn(algo.replace(entropy_coeff=0.0), CFG))
    total_fn = jax.jit(UP.make_grad_fn(algo, CFG))
    for name, groups in buckets.items():
        rows = [g * GROUP_SIZE + i for g in sorted(groups) for i in range(GROUP_SIZE)]
        norms, losses = {"task": [], "entropy": []}, {"task": [], "entropy": []}
        for c in range(0, len(rows), 2):
            mb = jax.tree_util.tree_map(lambda x: x[np.asarray(rows[c:c + 2])], batch)
            g_task, _, m_task = task_fn(params, None, mb)
            g_total, _, m_total = total_fn(params, None, mb)
            g_entropy = jax.tree_util.tree_map(jnp.subtract, g_total, g_task)
            norms["task"].append(float(optax.global_norm(g_task)))
            norms["entropy"].append(float(optax.global_norm(g_entropy)))
            losses["task"].append(float(m_task["actor/pg_loss"]))
            losses["entropy"].append(float(m_total["actor/loss"] - m_task["actor/loss"]))
        p = f"grad_norm/{name}"
        assert got[f"{p}/sample_count"] == len(rows)
        assert got[f"{p}/sample_pct"] == pytest.approx(len(rows) / 8)
        assert got[f"{p}/reward_std_mean"] == pytest.approx(np.mean([std[g] for g in groups]),
                                                             rel=1e-5)
        for c in ("task", "entropy"):
            assert got[f"{p}/{c}"] == pytest.approx(np.mean(norms[c]), rel=2e-4), (name, c)
            assert got[f"{p}/per_sample/{c}"] == pytest.approx(got[f"{p}/{c}"] / len(rows))
        assert got[f"{p}/loss/policy"] == pytest.approx(np.mean(losses["task"]), rel=1e-4,
                                                        abs=1e-6)
        assert got[f"{p}/loss/entropy"] == pytest.approx(np.mean(losses["entropy"]), rel=1e-3,
                                                         abs=1e-6)
    assert got["actor/grad_norm/task"] == got["grad_norm/all/task"]
    assert "grad_norm/all/kl" not in got  # no KL loss: no KL component
