"""DAPO's overlong reward shaping against slow Python references on hand-made episodes."""

import jax.numpy as jnp
import numpy as np
import pytest

from starpo import advantages as A
from starpo import run_config as RC
from starpo import update as UP
from starpo.trajectory import Trajectory


def ref_penalty(L, max_length, buffer_len, factor):
    """The DAPO paper's piecewise definition, one reply at a time."""
    if buffer_len == 0 or L <= max_length - buffer_len:
        return 0.0
    if L <= max_length:
        return (max_length - buffer_len - L) / buffer_len * factor
    return -factor


@pytest.mark.parametrize("buffer_len,factor", [(4, 1.0), (1, 0.5), (10, 2.0), (0, 1.0)])
def test_overlong_penalty_matches_the_papers_definition(buffer_len, factor):
    lengths = np.array([[0, 5, 6, 7], [8, 9, 10, 12]])
    got = np.asarray(A.overlong_penalty(jnp.asarray(lengths), 10, buffer_len, factor))
    want = np.vectorize(lambda L: ref_penalty(L, 10, buffer_len, factor))(lengths)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def episodes():
    """Three episodes of up to 3 turns in T=16: (per turn: observation tokens, reply tokens)."""
    T, M = 16, 3
    plays = [[(2, 3), (1, 4)], [(3, 5)], [(1, 2), (1, 1), (2, 4)]]
    loss_mask = np.zeros((3, T), bool)
    turn_index = np.full((3, T), -1, np.int32)
    turn_end = np.full((3, M), -1, np.int32)
    length = np.zeros(3, np.int32)
    for b, turns in enumerate(plays):
        t = 0
        for k, (obs, reply) in enumerate(turns):
            turn_index[b, t:t + obs + reply] = k
            loss_mask[b, t + obs:t + obs + reply] = True
            t += obs + reply
            turn_end[b, k] = t - 1
        length[b] = t
    traj = Trajectory(
        tokens=jnp.zeros((3, T), jnp.int32), loss_mask=jnp.asarray(loss_mask),
        turn_index=jnp.asarray(turn_index), sample_logprobs=jnp.zeros((3, T)),
        turn_end=jnp.asarray(turn_end), turn_reward=jnp.asarray([[1.0, 0.0, 0], [0.5, 0, 0],
                                                                [0, 0, 1.0]]),
        penalty=jnp.asarray([0.0, -0.1, 0.0]), success=jnp.zeros(3, bool),
        num_actions=jnp.ones(3, jnp.int32), group_id=jnp.zeros(3, jnp.int32),
        tag=jnp.zeros(3, jnp.int32), length=jnp.asarray(length))
    return traj, plays


def test_reply_lengths_count_each_turns_model_tokens():
    traj, plays = episodes()
    got = np.asarray(A.reply_lengths(traj.loss_mask, traj.turn_index, 3))
    want = np.zeros((3, 3), int)
    for b, turns in enumerate(plays):
        for k, (_, reply) in enumerate(turns):
            want[b, k] = reply
    np.testing.assert_array_equal(got, want)


def test_the_score_gains_every_turns_penalty_before_normalisation():
    traj, plays = episodes()
    algo = RC.AlgoConfig(response_length=5, overlong_buffer_len=2, overlong_penalty_factor=0.5)
    score, penalty = UP.shaped_score(algo, traj)
    want = [sum(ref_penalty(r, 5, 2, 0.5) for _, r in turns) for turns in plays]
    np.testing.assert_allclose(np.asarray(penalty), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(score), np.asarray(traj.score) + want, rtol=1e-6)
    off_score, off = UP.shaped_score(RC.AlgoConfig(response_length=5), traj)
    assert off is None and np.array_equal(np.asarray(off_score), np.asarray(traj.score))


def test_a_buffer_longer_than_the_reply_budget_is_an_error():
    with pytest.raises(RC.ConfigError, match="overlong_buffer_len"):
        RC.AlgoConfig(response_length=8, overlong_buffer_len=9)


def test_the_dapo_preset_sets_dapos_settings_on_any_variant():
    from configs import bandit, common, frozenlake
    from starpo import config_check
    for module, arg in [(bandit, "tiny+dapo"), (frozenlake, "dapo"), (frozenlake, "cpu+dapo")]:
        c = module.get_config(arg)
        plain = module.get_config(arg.split("+")[0] or None)
        config_check.check(c)
        a = c.algorithm
        assert (a.adv_estimator, a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == (
            "grpo", 0.2, 0.28, "token-mean")
        assert not a.use_kl_loss and not a.use_kl_in_reward and a.entropy_coeff == 0.0
        assert a.overlong_buffer_len == c.rollout.response_length // 5  # tiny bandit: 1 -> 0
        assert a.overlong_penalty_factor == 1.0 and a.rollout_filter_ratio == 1.0
        assert a.filter_groups_enable and a.filter_groups_max_num_gen_batches == 10
        assert a.filter_groups_metric == "success" and a.clip_ratio_c == 10.0  # verl's recipe
        # nothing outside `algorithm` changes
        assert {k: v for k, v in c.to_dict().items() if k != "algorithm"} == {
            k: v for k, v in plain.to_dict().items() if k != "algorithm"}
    with pytest.raises(ValueError, match="unknown config preset 'dapa'"):
        bandit.get_config("tiny+dapa")
    assert common.variant("cpu+dapo", ("cpu",)) == "cpu"


def test_the_reinforce_preset_plays_one_episode_a_level_against_the_batch():
    """`+reinforce`: as many episodes as the variant's batch, each on a level of its own, GRPO
    on groups of one after the batch's mean / std (REINFORCE with a batch baseline), no filter;
    nothing else changes. Its advantages: tests/test_advantages.py (the `batch` grouping)."""
    from configs import bandit, frozenlake
    from starpo import config_check
    for module, arg in [(frozenlake, "gpu+reinforce"), (bandit, "tiny+reinforce"),
                        (frozenlake, "reinforce"), (frozenlake, "gpu+lora+reinforce")]:
        c = module.get_config(arg)
        plain = module.get_config(arg.replace("+reinforce", "").replace("reinforce", "") or None)
        config_check.check(c)
        r, p = c.rollout, plain.rollout
        assert r.group_size == 1 and r.env_groups == p.env_groups * p.group_size > p.env_groups
        a = c.algorithm
        assert (a.adv_estimator, a.reward_norm_grouping, a.reward_norm_method,
                a.rollout_filter_ratio) == ("grpo", "batch", "mean_std", 1.0)
        changed = {"rollout": ("env_groups", "group_size"),
                   "algorithm": ("adv_estimator", "reward_norm_grouping", "reward_norm_method",
                                 "rollout_filter_ratio")}
        got, want = c.to_dict(), plain.to_dict()
        for section, names in changed.items():
            for name in names:
                del got[section][name], want[section][name]
        assert got == want


def ref_mi(cross, own):
    """RAGEN-2's definition, one reasoning at a time (float64)."""
    n, N = cross.shape
    mi, acc = [], []
    for i in range(n):
        row = [float(x) for x in cross[i]]
        top = max(row)
        marginal = top + np.log(sum(np.exp(x - top) for x in row)) - np.log(N)
        mi.append(row[own[i]] - marginal)
        acc.append(row.index(top) == own[i])
    return np.mean(mi), np.mean(acc)


def test_template_collapse_mi_matches_ragen2s_definition():
    from starpo import collapse
    own = np.array([0, 0, 1, 1, 2, 2])
    informative = np.log(np.array([[.8, .1, .1], [.6, .3, .1], [.2, .7, .1], [.5, .4, .1],
                                   [.1, .1, .8], [.3, .3, .4]]))
    template = np.tile(np.log([[.5, .5, .5]]), (6, 1))  # every prompt scores alike
    for cross in (informative, template):
        m = collapse.mi_metrics(jnp.asarray(cross, jnp.float32), jnp.asarray(own))
        mi, acc = ref_mi(cross, own)
        np.testing.assert_allclose(float(m["collapse/mi_estimate"]), mi, rtol=1e-5, atol=1e-6)
        assert float(m["collapse/retrieval_accuracy"]) == pytest.approx(acc)
        assert float(m["collapse/mi_estimate"]) <= float(m["collapse/mi_upper_bound"]) + 1e-6
    assert abs(float(collapse.mi_metrics(jnp.asarray(template, jnp.float32),
                                         jnp.asarray(own))["collapse/mi_estimate"])) < 1e-6


def test_dynamic_sampling_keeps_groups_of_one_as_verl_does():
    """verl keeps a prompt whose responses differ (std > 0) or that has a single response; the
    tiny FrozenLake config's groups of one were all dropped before."""
    from starpo import filtering

    assert filtering.nonzero_std_groups(np.array([0.0, 1.0, 1.0]), 1).all()
    np.testing.assert_array_equal(
        filtering.nonzero_std_groups(np.array([0.0, 1.0, 0.3, 0.3, 0.1, 0.1 + 1e-3]), 2),
        [True, False, True])


def verl_dynamic_sampling(play, G, gs, max_batches, counter):
    """A slow reading of verl's DAPO trainer loop: play G prompts at a time, keep each prompt's
    responses when np.std of their metric is > 0 or there is one response, append the kept
    ones until G prompts are collected, then cut to G. Where the batch budget runs out first,
    verl stops with an error; starpo fills the rest with the last batch's dropped groups in
    order (`filtering.fill_groups`), which this reference does as well.
    play(counter) -> list of G groups, each a list of gs (row id, metric). Returns (row ids,
    batches played, counter after)."""
    kept, played, dropped = [], 0, []
    while True:
        groups = play(counter)
        counter += G
        played += 1
        dropped = []
        for group in groups:
            values = [m for _, m in group]
            (kept if np.std(values) > 0 or len(values) == 1 else dropped).append(group)
        if len(kept) >= G or played >= max_batches:
            break
    chosen = (kept + dropped)[:G]
    return [r for group in chosen for r, _ in group], played, counter


@pytest.mark.parametrize("metric,max_batches,gs", [
    ("score", 10, 2), ("success", 10, 2), ("score", 2, 2), ("success", 10, 1)])
def test_play_batch_gathers_kept_groups_across_batches_as_verl(metric, max_batches, gs):
    """`training.play_batch` with dynamic sampling, on a stand-in rollout whose scores are a
    function of the level: the rows it trains on, the batches it played and the level counter
    after it, against `verl_dynamic_sampling`. Level L's episodes: all equal when L % 3 == 0;
    equal in success but not in score when L % 3 == 1; different in both otherwise."""
    import types

    import jax

    from starpo import sharding, training

    G, T, M = 4, 3, 2
    B = G * gs

    def episode(level, j):  # (score, success) of episode j of a level
        kind = level % 3
        if kind == 0:
            return 0.5, False
        if kind == 1:
            return 0.1 * j, False
        return float(j % 2), bool(j % 2)

    def rollout(params, key, env_state, group_id, temperature):
        levels = np.repeat(np.asarray(env_state), gs)
        j = np.tile(np.arange(gs), G)
        score = np.array([episode(L, i)[0] for L, i in zip(levels, j)], np.float32)
        success = np.array([episode(L, i)[1] for L, i in zip(levels, j)])
        ids = np.zeros((B, T), np.int32)
        ids[:, 0] = levels * 100 + j  # which episode a row is
        traj = Trajectory(
            tokens=jnp.asarray(ids), loss_mask=jnp.ones((B, T), bool),
            turn_index=jnp.zeros((B, T), jnp.int32), sample_logprobs=jnp.zeros((B, T)),
            turn_end=jnp.zeros((B, M), jnp.int32),
            turn_reward=jnp.asarray(np.stack([score, np.zeros(B, np.float32)], 1)),
            penalty=jnp.zeros(B), success=jnp.asarray(success),
            num_actions=jnp.ones(B, jnp.int32), group_id=jnp.asarray(group_id, jnp.int32),
            tag=jnp.zeros(B, jnp.int32), length=jnp.full(B, T, jnp.int32))
        return traj, {"success": jnp.asarray(success)}  # per row, as the rollout's

    run = types.SimpleNamespace(seed=0, batch=types.SimpleNamespace(
        env_groups=G, group_size=gs, temperature=1.0))
    algo = RC.AlgoConfig(group_size=gs, filter_groups_enable=True, filter_groups_metric=metric,
                         filter_groups_max_num_gen_batches=max_batches)
    exp = types.SimpleNamespace(
        run=run, algo=algo, run_rollout=rollout, mesh=sharding.make_mesh(),
        initial_states=lambda key, counter: (int(counter) + np.arange(G),
                                             np.repeat(np.arange(G), gs)))

    def play(counter):
        return [[(L * 100 + j, episode(L, j)[metric == "success"]) for j in range(gs)]
                for L in range(counter, counter + G)]

    for start in (0, 1, 5):
        (traj, _), counter, scalars = training.play_batch(exp, None, jax.random.key(0), start)
        rows, played, want_counter = verl_dynamic_sampling(play, G, gs, max_batches, start)
        assert np.asarray(traj.tokens)[:, 0].tolist() == rows, (start, rows)
        assert (counter, scalars["rollout/num_gen_batches"]) == (want_counter, played)
