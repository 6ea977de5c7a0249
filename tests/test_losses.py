"""PPO losses, KL estimators and loss aggregation against slow per-token Python loops."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starpo import losses as L

_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
policy_loss_terms = _jit(L.policy_loss_terms)
value_loss_terms = _jit(L.value_loss_terms)
kl_estimate = _jit(L.kl_estimate, static_argnums=2)
logprobs_and_entropy = _jit(L.logprobs_and_entropy)


@functools.partial(_jit, static_argnums=2)
def aggregate(x, mask, mode):
    """Aggregate one whole batch, and the same batch as three micro-batches of 2 rows."""
    n_tok, n_seq = L.denominators(mask)
    parts = sum(L.aggregate(x[i:i + 2], mask[i:i + 2], mode, n_tok, n_seq)
                for i in range(0, x.shape[0], 2))
    return L.aggregate(x, mask, mode, n_tok, n_seq), parts


def ref_policy_token(logp, old, adv, lo, hi, c):
    """One token of the decoupled + dual-clip PPO loss, branch by branch."""
    ratio = math.exp(logp - old)
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - lo), 1 + hi)
    loss = max(unclipped, clipped)
    lower = False
    if adv < 0 and loss > -adv * c:
        loss, lower = -adv * c, True
    return loss, clipped > unclipped, lower


def test_policy_loss_on_crafted_ratios():
    # ratios 0.5, 0.79, 1.0, 1.27, 1.29, 2.0, 5.0 with positive and negative advantages
    ratios = np.array([0.5, 0.79, 1.0, 1.27, 1.29, 2.0, 5.0])
    r = np.concatenate([ratios, ratios])
    adv = np.concatenate([np.full(7, 1.5), np.full(7, -0.5)])
    old = np.linspace(-3, -0.5, 14)
    logp = old + np.log(r)
    got = policy_loss_terms(*(jnp.asarray(x, jnp.float32) for x in (logp, old, adv)),
                            0.2, 0.28, 3.0)
    want = [ref_policy_token(*x, 0.2, 0.28, 3.0) for x in zip(logp, old, adv)]
    np.testing.assert_allclose(got[0], [w[0] for w in want], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[1], bool), [w[1] for w in want])
    np.testing.assert_array_equal(np.asarray(got[2], bool), [w[2] for w in want])
    # spelled out: A > 0 is clipped above 1.28 only; A < 0 below 0.8 only; dual clip at ratio > 3
    assert np.asarray(got[1], bool).tolist() == [False] * 4 + [True] * 3 + [True] * 2 + \
        [False] * 5
    assert np.asarray(got[2], bool).tolist() == [False] * 13 + [True]
    assert float(got[0][13]) == pytest.approx(1.5)  # -A * c = 0.5 * 3
    np.testing.assert_allclose(got[3], np.log(r), rtol=1e-5, atol=1e-6)


def test_clip_fractions_from_aggregation():
    logp = np.log(np.array([[1.5, 1.0, 0.5, 4.0]], np.float32))
    adv = np.array([[1.0, 1.0, -1.0, -1.0]], np.float32)
    mask = np.array([[True, True, True, False]])
    _, clipped, lower, _ = policy_loss_terms(logp, np.zeros_like(logp), adv, 0.2, 0.28, 3.0)
    # token 0 (1.5, A>0) and token 2 (0.5, A<0) are clipped; token 3 would be dual-clipped but
    # is masked out
    assert float(aggregate(clipped, mask, "token-mean")[0]) == pytest.approx(2 / 3)
    assert float(aggregate(lower, mask, "token-mean")[0]) == 0.0
    assert float(lower[0, 3]) == 1.0


def test_pg_gradient_on_a_two_token_softmax_policy():
    """A 2-token vocabulary, logits theta: d/dtheta of the loss at ratio 1 is the policy
    gradient -sum_t A_t (onehot(a_t) - softmax(theta)) / N."""
    theta = np.array([0.3, -0.2], np.float32)
    actions = jnp.asarray([0, 1, 1])
    adv = jnp.asarray([1.0, -2.0, 0.5])
    mask = jnp.ones((1, 3), bool)

    def loss(theta, old):
        logp = jax.nn.log_softmax(theta)[actions][None]
        pg, *_ = L.policy_loss_terms(logp, old, adv[None], 0.2, 0.28, 3.0)
        return L.aggregate(pg, mask, "token-mean", *L.denominators(mask))

    old = np.log(np.exp(theta) / np.exp(theta).sum())[np.asarray(actions)][None]
    got = _jit(jax.grad(loss))(theta, old)
    p = np.exp(np.asarray(theta)) / np.exp(np.asarray(theta)).sum()
    want = -sum(float(a) * (np.eye(2)[int(act)] - p) for a, act in zip(adv, actions)) / 3
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_value_loss_and_clipfrac():
    rng = np.random.default_rng(0)
    v, old, ret = (rng.normal(size=20).astype(np.float32) for _ in range(3))
    loss, clipped = value_loss_terms(jnp.asarray(v), jnp.asarray(old), jnp.asarray(ret), 0.5)
    for i in range(20):
        vc = old[i] + min(max(v[i] - old[i], -0.5), 0.5)
        a, b = (v[i] - ret[i]) ** 2, (vc - ret[i]) ** 2
        assert float(loss[i]) == pytest.approx(0.5 * max(a, b), rel=1e-5)
        assert bool(clipped[i]) == (b > a)
    assert 0 < float(clipped.mean()) < 1  # the sample exercises both branches


@pytest.mark.parametrize("kind", L.KL_TYPES)
def test_kl_estimators(kind):
    rng = np.random.default_rng(1)
    logp, ref = rng.normal(-2, 1, size=(2, 16)), rng.normal(-2, 1, size=(2, 16))
    got = np.asarray(kl_estimate(logp, ref, kind))
    d = logp - ref
    want = {"kl": d, "abs": np.abs(d), "mse": 0.5 * d * d,
            "low_var_kl": np.clip(np.exp(-d) + d - 1, -10, 10)}[kind]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if kind != "kl":
        assert (got >= 0).all()


def test_kl_estimators_unbiased_on_samples():
    """k1 and k3 both estimate KL(p || q) when tokens are drawn from p."""
    p = np.array([0.6, 0.3, 0.1])
    q = np.array([0.2, 0.5, 0.3])
    a = np.random.default_rng(4).choice(3, size=50_000, p=p)
    logp, logq = jnp.asarray(np.log(p)[a]), jnp.asarray(np.log(q)[a])
    exact = float((p * np.log(p / q)).sum())
    for kind in ("kl", "low_var_kl"):
        assert float(kl_estimate(logp, logq, kind).mean()) == pytest.approx(exact, rel=0.03)


@pytest.mark.parametrize("mode", L.LOSS_AGG_MODES)
def test_aggregation_modes_and_micro_split(mode):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, 7)).astype(np.float32)
    mask = rng.random((6, 7)) < 0.5
    mask[3] = False  # a row without model tokens is not a sequence
    got, parts = (float(v) for v in aggregate(x, mask, mode))
    rows = [x[b][mask[b]] for b in range(6) if mask[b].any()]
    want = {"token-mean": sum(r.sum() for r in rows) / sum(len(r) for r in rows),
            "seq-mean-token-sum": np.mean([r.sum() for r in rows]),
            "seq-mean-token-mean": np.mean([r.mean() for r in rows]),
            "seq-mean-token-sum-norm": np.mean([r.sum() for r in rows]) / 7}[mode]
    assert got == pytest.approx(float(want), rel=1e-5)
    assert parts == pytest.approx(got, rel=1e-5)


def test_logprobs_and_entropy():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 3, 5)).astype(np.float32) * 3
    targets = rng.integers(0, 5, (2, 3))
    logp, ent = logprobs_and_entropy(logits, targets)
    for b in range(2):
        for t in range(3):
            z = logits[b, t].astype(np.float64)
            lp = z - np.log(np.exp(z - z.max()).sum()) - z.max()
            assert float(logp[b, t]) == pytest.approx(lp[targets[b, t]], rel=1e-5)
            assert float(ent[b, t]) == pytest.approx(-(np.exp(lp) * lp).sum(), rel=1e-5,
                                                     abs=1e-6)


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="KL"):
        L.kl_estimate(jnp.zeros(1), jnp.zeros(1), "k2")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        L.aggregate(jnp.zeros((1, 1)), jnp.ones((1, 1), bool), "sum", 1.0, 1.0)
