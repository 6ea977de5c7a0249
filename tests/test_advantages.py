"""Advantage estimators, reward normalisation and reward placement against slow Python loops."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starpo import advantages as A

# One compile per function (discount factors are traced), at XLA's cheapest optimisation level:
# these arrays are tiny and compile time dominates.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
gae = _jit(A.gae)
bi_level_gae = _jit(A.bi_level_gae, static_argnames="turns")
grpo = _jit(A.grpo, static_argnums=3)
normalize_scores = _jit(A.normalize_scores, static_argnums=2)
token_rewards = _jit(A.token_rewards, static_argnums=(4, 5))
masked_whiten = _jit(A.masked_whiten)


# ----------------------------------------------------------------------------- slow references
def ref_gae(rewards, values, mask, gamma, lam):
    """GAE on each row's model tokens alone (environment tokens cut out of the sequence)."""
    adv = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        pos = [t for t in range(rewards.shape[1]) if mask[b, t]]
        last = 0.0
        for i in reversed(range(len(pos))):
            t = pos[i]
            next_value = values[b, pos[i + 1]] if i + 1 < len(pos) else 0.0
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv, np.where(mask, adv + values, 0.0)


def ref_two_level_gae(rewards, values, mask, ends, gamma, lam, high_gamma):
    """Turn-level GAE over each row's turn ends (`ends[b]`, positions in order), then
    token-level GAE over the model's tokens, each end's target its turn-level return (the last
    model token, where it is not an end, bootstraps from 0)."""
    adv = np.zeros_like(rewards)
    ret = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        target = {}
        last = 0.0
        for i in reversed(range(len(ends[b]))):
            e = ends[b][i]
            next_value = values[b, ends[b][i + 1]] if i + 1 < len(ends[b]) else 0.0
            delta = rewards[b, e] + high_gamma * next_value - values[b, e]
            last = delta + high_gamma * lam * last
            target[e] = last + values[b, e]
        pos = [t for t in range(rewards.shape[1]) if mask[b, t]]
        last = 0.0
        for i in reversed(range(len(pos))):
            t = pos[i]
            if t in target:
                last = target[t] - values[b, t]
            else:
                nxt = values[b, pos[i + 1]] if i + 1 < len(pos) else 0.0
                last = rewards[b, t] + gamma * nxt - values[b, t] + gamma * lam * last
            adv[b, t] = last
            ret[b, t] = last + values[b, t]
    return adv, ret


def ref_bi_level(rewards, values, mask, turn_end, gamma, lam, high_gamma):
    """Turn-level GAE over explicit turn ends, then token-level GAE inside each turn."""
    ends = [[int(e) for e in row if e >= 0] for row in turn_end]
    return ref_two_level_gae(rewards, values, mask, ends, gamma, lam, high_gamma)


def ref_group_stats(x, keys):
    """Per-row (mean, unbiased std, size) of the row's group, by explicit grouping."""
    groups = {}
    for i, k in enumerate(keys):
        groups.setdefault(int(k), []).append(i)
    mean, std, n = np.zeros(len(x)), np.zeros(len(x)), np.zeros(len(x), int)
    for members in groups.values():
        vals = np.array([x[i] for i in members], np.float64)
        for i in members:
            mean[i] = vals.mean()
            std[i] = vals.std(ddof=1) if len(vals) > 1 else 0.0
            n[i] = len(vals)
    return mean, std, n


def ref_normalize(score, keys, method):
    mean, std, n = ref_group_stats(score, keys)
    out = np.array(score, np.float64)
    for i in range(len(score)):
        if n[i] == 1 or method == "identity":
            continue
        if method == "mean":
            out[i] = score[i] - mean[i]
        else:
            out[i] = 0.0 if std[i] <= 1e-6 else (score[i] - mean[i]) / (std[i] + 1e-6)
            if method == "asym_clip":
                out[i] = min(max(out[i], -1.0), 3.0)
    return out


# ----------------------------------------------------------------------------- fixtures
def multi_turn_rows(seed, B=6, T=20, M=3):
    """Rows of [prompt | reply 0 | obs | reply 1 | obs | reply 2 | pad] with random lengths;
    returns mask [B,T] and turn_end [B,M] (rows with 1..M turns)."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T), bool)
    turn_end = np.full((B, M), -1, np.int32)
    for b in range(B):
        pos = int(rng.integers(1, 3))
        for k in range(int(rng.integers(1, M + 1))):
            if k:
                pos += int(rng.integers(1, 3))  # observation tokens: a hole in the mask
            n = int(rng.integers(1, 4))
            mask[b, pos:pos + n] = True
            pos += n
            turn_end[b, k] = pos - 1
    return mask, turn_end


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8)])
def test_gae_skips_environment_tokens(gamma, lam):
    mask, _ = multi_turn_rows(0)
    rng = np.random.default_rng(1)
    rewards = np.where(mask, rng.normal(size=mask.shape), 0).astype(np.float32)
    values = rng.normal(size=mask.shape).astype(np.float32)  # garbage off the mask too
    adv, ret = gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma, lam)
    want_adv, want_ret = ref_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(adv, want_adv, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, atol=1e-5)
    # values on environment tokens must not leak into any advantage
    noisy = np.where(mask, values, 100.0).astype(np.float32)
    adv2, _ = gae(jnp.asarray(rewards), jnp.asarray(noisy), jnp.asarray(mask), gamma, lam)
    np.testing.assert_allclose(adv2, adv, atol=1e-5)


def test_bi_level_gae_with_zero_reward_turns():
    mask, turn_end = multi_turn_rows(2, B=8)
    rng = np.random.default_rng(3)
    rewards = np.zeros(mask.shape, np.float32)
    # turn rewards with many zeros (a zero-reward turn is still a turn), plus small per-token
    # rewards elsewhere (as a KL penalty would put there)
    for b, k in zip(*np.nonzero(turn_end >= 0)):
        rewards[b, turn_end[b, k]] = rng.choice([0.0, 0.0, 1.0, -0.5])
    rewards += np.where(mask, rng.normal(scale=0.01, size=mask.shape), 0).astype(np.float32)
    rewards[0, turn_end[0, 0]] = 0.0  # make sure the first turn of row 0 has no reward
    values = rng.normal(size=mask.shape).astype(np.float32)
    args = (0.97, 0.9, 0.8)
    adv, ret = bi_level_gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask),
                              jnp.asarray(turn_end), *args)
    want_adv, want_ret = ref_bi_level(rewards, values, mask, turn_end, *args)
    np.testing.assert_allclose(adv, want_adv, atol=1e-5)
    np.testing.assert_allclose(ret, want_ret, atol=1e-5)
    # the token after a turn end never bootstraps into the previous turn's last token
    e = int(turn_end[0, 0])
    assert float(adv[0, e]) == pytest.approx(float(ret[0, e] - values[0, e]), abs=1e-5)


def ragen_bi_level(rewards, values, mask, gamma, lam, high_gamma):
    """RAGEN's bi-level GAE as its trainer computes it (ragen/trainer/core_algos.py at 20daedc):
    the high level over the tokens whose reward is not 0 (wherever they are), the low level over
    the model's tokens, each such token's target its high-level return (before whitening).
    Where RAGEN's raises IndexError (a last model token whose reward is 0), it bootstraps
    from 0."""
    ends = [[int(t) for t in np.nonzero(row)[0]] for row in rewards]
    return ref_two_level_gae(rewards, values, mask, ends, gamma, lam, high_gamma)[0]


def test_bi_level_gae_with_rewards_as_turns_is_ragens():
    """`algorithm.bi_level_turns=reward`: RAGEN's loop on the same rows (turn rewards with zeros,
    small per-token rewards as a KL penalty puts them, one row with no reward at all)."""
    mask, turn_end = multi_turn_rows(4, B=8)
    rng = np.random.default_rng(5)
    rewards = np.zeros(mask.shape, np.float32)
    for b, k in zip(*np.nonzero(turn_end >= 0)):
        rewards[b, turn_end[b, k]] = rng.choice([0.0, 0.0, 1.0, -0.5])
    rewards[:4] += np.where(mask[:4], rng.normal(scale=0.01, size=mask[:4].shape), 0)
    rewards[5] = 0.0
    rewards = rewards.astype(np.float32)
    values = rng.normal(size=mask.shape).astype(np.float32)
    args = (0.97, 0.9, 0.8)
    adv, ret = bi_level_gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask),
                            jnp.asarray(turn_end), *args, turns="reward")
    np.testing.assert_allclose(adv, ragen_bi_level(rewards, values, mask, *args), atol=1e-5)
    np.testing.assert_allclose(ret, np.where(mask, adv + values, 0), atol=1e-6)


def test_bi_level_turns_by_hand():
    """Two turns, the first of three tokens with values .2 / .3 / .4, a reward of 1 at the end of
    the second, gamma = lam = 1, high_level_gamma = .95: every reply a turn, the first turn's
    target is .95 (advantages .75 / .65 / .55); RAGEN's turns (a final reward alone) make it
    plain GAE, target 1 (.80 / .70 / .60)."""
    mask = np.array([[1, 1, 1, 0, 1, 1]], bool)
    turn_end = np.array([[2, 5]], np.int32)
    rewards = np.array([[0, 0, 0, 0, 0, 1]], np.float32)
    values = np.array([[0.2, 0.3, 0.4, 0.0, 0.5, 0.6]], np.float32)
    every, _ = bi_level_gae(*map(jnp.asarray, (rewards, values, mask, turn_end)), 1.0, 1.0, 0.95)
    ragen, _ = bi_level_gae(*map(jnp.asarray, (rewards, values, mask, turn_end)), 1.0, 1.0, 0.95,
                            turns="reward")
    np.testing.assert_allclose(every[0, :3], [0.75, 0.65, 0.55], atol=1e-6)
    np.testing.assert_allclose(ragen[0, :3], [0.80, 0.70, 0.60], atol=1e-6)
    np.testing.assert_allclose(ragen, gae(*map(jnp.asarray, (rewards, values, mask)), 1.0,
                                          1.0)[0], atol=1e-6)


def test_bi_level_single_turn_reduces_to_gae_with_turn_return():
    """With one turn and gamma_high irrelevant, bi-level equals plain GAE on the same rewards."""
    mask = np.zeros((2, 8), bool)
    mask[:, 2:6] = True
    turn_end = np.array([[5, -1], [5, -1]], np.int32)
    rewards = np.zeros((2, 8), np.float32)
    rewards[:, 5] = [1.0, 0.0]
    values = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    got, _ = bi_level_gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask),
                            jnp.asarray(turn_end), 1.0, 1.0, 0.5)
    want, _ = ref_gae(rewards, values, mask, 1.0, 1.0)
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("by_std", [True, False])
def test_grpo_groups(by_std):
    # groups: 7 (three members), 2 (constant rewards), 5 (a single member), 9 (two members)
    group = np.array([7, 2, 7, 5, 2, 7, 9, 9], np.int32)
    score = np.array([1.0, 0.3, 0.0, 4.0, 0.3, 0.5, -1.0, 2.0], np.float32)
    mask = np.ones((8, 3), bool)
    mask[:, 0] = False
    adv, ret = grpo(jnp.asarray(score), jnp.asarray(group), jnp.asarray(mask), by_std)
    mean, std, n = ref_group_stats(score, group)
    want = np.zeros(8)
    for i in range(8):
        m, s = (0.0, 1.0) if n[i] == 1 else (mean[i], std[i] + 1e-6)
        want[i] = (score[i] - m) / (s if by_std else 1.0)
    np.testing.assert_allclose(adv[:, 1], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(adv[:, 2], want, rtol=1e-5, atol=1e-6)
    assert (np.asarray(adv[:, 0]) == 0).all()
    assert np.asarray(adv)[[1, 4]].max() == 0  # zero-std group: no signal
    assert float(adv[3, 1]) == pytest.approx(4.0)  # single member: its raw score
    np.testing.assert_array_equal(adv, ret)



def test_groups_of_equal_scores_give_exactly_zero_advantage():
    """The paper's group size 16: 16 x -0.1 (every episode penalised once) and 16 x 10.9
    (every episode solved in one push) sum with float32 rounding; a plain mean then leaves
    deviations of 1e-8 / 1e-6 that GRPO's division by std + 1e-6 blew up to advantages of
    0.02 / 0.6. Shuffled, so members are not adjacent."""
    rng = np.random.default_rng(0)
    score = np.concatenate([np.full(16, -0.1), np.full(16, 10.9), np.full(16, 0.7),
                            rng.random(16)]).astype(np.float32)
    group = np.repeat(np.arange(4), 16).astype(np.int32)
    order = rng.permutation(64)
    score, group = score[order], group[order]
    mean, std, _ = A.group_mean_std(jnp.asarray(score), jnp.asarray(group))
    constant = group < 3
    assert (np.asarray(std)[constant] == 0).all()
    np.testing.assert_array_equal(np.asarray(mean)[constant], score[constant])
    adv, _ = grpo(jnp.asarray(score), jnp.asarray(group), jnp.ones((64, 2), bool), True)
    assert (np.asarray(adv)[constant] == 0).all()
    assert (np.abs(np.asarray(adv)[~constant]) > 0.01).all()

@pytest.mark.parametrize("grouping", A.GROUPINGS)
@pytest.mark.parametrize("method", A.NORM_METHODS)
def test_normalisation_modes(grouping, method):
    group_id = np.array([3, 3, 3, 3, 8, 8, 8, 8, 1, 1, 1, 1], np.int32)
    tag = np.array([0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 5], np.int32)  # tag 5: a single row
    score = np.array([1.0, 0.0, 0.0, 10.9, 0.4, 0.4, 0.4, 0.4, -0.1, 2.0, -0.3, 1.0],
                     np.float32)
    key = A.grouping_key(grouping, jnp.asarray(group_id), jnp.asarray(tag))
    got, scale = normalize_scores(jnp.asarray(score), key, method)
    keys = {"state": group_id, "inductive": tag, "batch": np.zeros(12, int)}[grouping]
    want = ref_normalize(score, keys, method)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if method == "asym_clip":
        assert float(got.min()) >= -1.0 and float(got.max()) <= 3.0
    # `scale` maps a reward difference inside a group onto the normalised scale
    _, std, n = ref_group_stats(score, keys)
    want_scale = np.ones(12)
    if method in ("mean_std", "asym_clip"):
        want_scale = np.where(n == 1, 1.0, np.where(std <= 1e-6, 0.0, 1.0 / (std + 1e-6)))
    np.testing.assert_allclose(scale, want_scale, rtol=1e-5)


def test_unknown_modes_raise():
    with pytest.raises(ValueError, match="grouping"):
        A.grouping_key("env", jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="method"):
        A.normalize_scores(jnp.zeros(2), jnp.zeros(2, jnp.int32), "zscore")


@pytest.mark.parametrize("use_turn_scores", [False, True])
def test_token_rewards(use_turn_scores):
    _, turn_end = multi_turn_rows(4, B=5)
    turn_end[4] = -1  # an episode without a model token has nowhere to put a reward
    rng = np.random.default_rng(5)
    turn_reward = np.where(turn_end >= 0, rng.choice([0.0, 1.0, -0.1], turn_end.shape), 0)
    turn_reward = turn_reward.astype(np.float32)
    normalised = rng.normal(size=5).astype(np.float32)
    scale = rng.uniform(0.5, 2, size=5).astype(np.float32)
    got = np.asarray(token_rewards(jnp.asarray(turn_end), jnp.asarray(turn_reward),
                                     jnp.asarray(normalised), jnp.asarray(scale), 20,
                                     use_turn_scores))
    want = np.zeros((5, 20), np.float32)
    for b in range(5):
        ends = [e for e in turn_end[b] if e >= 0]
        if not ends:
            continue
        if use_turn_scores:
            placed = 0.0
            for k, e in enumerate(ends):
                want[b, e] += turn_reward[b, k] * scale[b]
                placed += turn_reward[b, k] * scale[b]
            want[b, ends[-1]] += normalised[b] - placed
        else:
            want[b, ends[-1]] = normalised[b]
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(got[:4].sum(1), normalised[:4], atol=1e-5)
    assert (got[4] == 0).all()


def test_masked_whiten():
    rng = np.random.default_rng(6)
    x = rng.normal(3.0, 2.0, size=(4, 9)).astype(np.float32)
    mask = rng.random((4, 9)) < 0.6
    got = np.asarray(masked_whiten(jnp.asarray(x), jnp.asarray(mask)))
    vals = x[mask].astype(np.float64)
    want = np.where(mask, (x - vals.mean()) / np.sqrt(vals.var(ddof=1) + 1e-8), 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
