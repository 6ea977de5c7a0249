"""verl's own loss and advantage functions as the oracle (`verl.trainer.ppo.core_algos`, verl
0.9.1, the torch functions RAGEN's trainer calls). Each of ours runs on the same random
tensors (ragged masks, groups of uneven size, advantages of both signs, ratios past the clip
bounds) and must equal verl's to float32 rounding.

Skipped where verl is not installed. CI's cross-check step installs it without its serving
stack: `pip install --no-deps verl==0.9.1` plus `requirements-verl.txt`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

from starpo import advantages as adv_lib  # noqa: E402
from starpo import losses  # noqa: E402

B, T = 12, 40
# verl deprecates compute_policy_loss for a config-driven twin; the function is the same
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _batch(seed: int):
    """Random per-token tensors: log-probs whose ratios reach past the clip bounds and 3,
    advantages of both signs, and a ragged mask (each row's reply starts and ends at its own
    token; one row fully masked, as verl's aggregation leaves it out)."""
    rng = np.random.default_rng(seed)
    old = rng.normal(-2.0, 1.0, (B, T)).astype(np.float32)
    new = (old + rng.normal(0.0, 0.4, (B, T))).astype(np.float32)
    new[:, ::7] += 1.5  # ratios past the dual clip's 3
    advantages = rng.normal(0.0, 1.5, (B, T)).astype(np.float32)
    start = rng.integers(0, T // 2, B)
    end = np.minimum(start + rng.integers(1, T, B), T)
    mask = (np.arange(T)[None] >= start[:, None]) & (np.arange(T)[None] < end[:, None])
    mask[3] = False
    return old, new, advantages, mask


def _t(x):
    return torch.tensor(np.asarray(x))


def _ours_aggregated(terms, mask, mode):
    tokens, seqs = losses.denominators(jnp.asarray(mask))
    return float(losses.aggregate(jnp.asarray(terms), jnp.asarray(mask), mode, tokens, seqs))


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_policy_loss_with_decoupled_and_dual_clip_is_verls(mode, seed):
    """Clip-higher (0.2 / 0.28) and the dual clip (c = 3): the aggregated loss, the clip
    fraction and the dual clip's fraction equal `compute_policy_loss`'s."""
    old, new, advantages, mask = _batch(seed)
    loss, clipped, lower, _ = losses.policy_loss_terms(
        jnp.asarray(new), jnp.asarray(old), jnp.asarray(advantages), 0.2, 0.28, 3.0)
    v_loss, v_clipfrac, v_kl, v_lower = core_algos.compute_policy_loss(
        _t(old), _t(new), _t(advantages), _t(mask.astype(np.float32)), cliprange_low=0.2,
        cliprange_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode)
    np.testing.assert_allclose(_ours_aggregated(loss, mask, mode), float(v_loss), rtol=1e-5)
    m = mask.astype(np.float32)
    assert float((np.asarray(clipped) * m).sum() / m.sum()) == pytest.approx(float(v_clipfrac))
    assert float((np.asarray(lower) * m).sum() / m.sum()) == pytest.approx(float(v_lower))
    assert 0 < float(v_clipfrac) < 1 and float(v_lower) > 0  # both clips were exercised


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_the_aggregation_modes_are_verls(mode):
    """`aggregate` over a whole batch equals `agg_loss` (a fully masked row is no sequence)."""
    _, _, x, mask = _batch(2)
    want = core_algos.agg_loss(_t(x), _t(mask.astype(np.float32)), mode)
    np.testing.assert_allclose(_ours_aggregated(x, mask, mode), float(want), rtol=1e-5)


@pytest.mark.parametrize("kind", losses.KL_TYPES)
def test_each_kl_estimate_and_its_gradient_is_verls(kind):
    """Per token, the KL estimate of each kind and its gradient with respect to the policy's
    log-prob equal `kl_penalty_forward`'s, also where the reference is 30 to 100 nats off
    (k3's log-ratio is clamped to +-20 before `exp`: no overflow, no NaN gradient)."""
    old, new, _, _ = _batch(3)
    new[0, :6] = old[0, :6] + np.array([30.0, -30.0, 90.0, -90.0, 100.0, -100.0])
    ours = jax.vmap(jax.vmap(jax.value_and_grad(
        lambda lp, ref: losses.kl_estimate(lp, ref, kind))))(jnp.asarray(new), jnp.asarray(old))
    logp = _t(new).requires_grad_(True)
    want = core_algos.kl_penalty_forward(logp, _t(old), kind)
    want.sum().backward()
    np.testing.assert_allclose(np.asarray(ours[0]), want.detach().numpy(), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(ours[1]), logp.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert np.isfinite(np.asarray(ours[1])).all()


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_and_its_whitening_are_verls(gamma, lam):
    """Token-level GAE over the model's tokens (unmasked tokens pass the recursion through),
    then whitening over the mask: `compute_gae_advantage_return` (which whitens inside) on
    the masked tokens, and its returns (advantage + value) before whitening."""
    rng = np.random.default_rng(4)
    _, _, _, mask = _batch(4)
    rewards = np.where(rng.random((B, T)) < 0.1, rng.normal(0, 1, (B, T)), 0.0)
    rewards = np.where(mask, rewards, 0.0).astype(np.float32)
    values = rng.normal(0, 1, (B, T)).astype(np.float32)
    adv, returns = adv_lib.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask),
                               gamma, lam)
    whitened = adv_lib.masked_whiten(adv, jnp.asarray(mask))
    v_adv, v_returns = core_algos.compute_gae_advantage_return(
        _t(rewards), _t(values), _t(mask.astype(np.float32)), gamma, lam)
    np.testing.assert_allclose(np.asarray(whitened)[mask], v_adv.numpy()[mask], rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(returns)[mask], v_returns.numpy()[mask], rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_advantages_are_verls(norm_by_std):
    """Each row's score against its group (groups of 1 to 5 rows; a group of one has mean 0
    and std 1; one group of equal scores), with and without the division by the std (GRPO
    and Dr.GRPO): `compute_grpo_outcome_advantage` with the score on the reply's last token."""
    rng = np.random.default_rng(5)
    _, _, _, mask = _batch(5)
    mask[3, 0] = True  # a row with one token
    groups = np.array([0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 3, 4])
    score = rng.normal(0, 1, B).astype(np.float32)
    score[groups == 1] = 0.7  # equal scores: advantage 0
    last = np.where(mask, np.arange(T)[None], -1).max(axis=1)
    token_rewards = np.zeros((B, T), np.float32)
    token_rewards[np.arange(B), last] = score
    adv, _ = adv_lib.grpo(jnp.asarray(score), jnp.asarray(groups), jnp.asarray(mask),
                          norm_by_std)
    v_adv, _ = core_algos.compute_grpo_outcome_advantage(
        _t(token_rewards), _t(mask.astype(np.float32)), groups,
        norm_adv_by_std_in_grpo=norm_by_std)
    np.testing.assert_allclose(np.asarray(adv), v_adv.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_the_clipped_value_loss_is_verls(mode):
    """0.5 x max((v - R)^2, (clip(v, old +- 0.5) - R)^2), aggregated, and the clip fraction:
    `compute_value_loss`."""
    rng = np.random.default_rng(6)
    _, _, _, mask = _batch(6)
    old = rng.normal(0, 1, (B, T)).astype(np.float32)
    new = (old + rng.normal(0, 0.8, (B, T))).astype(np.float32)
    returns = rng.normal(0, 1, (B, T)).astype(np.float32)
    loss, clipped = losses.value_loss_terms(jnp.asarray(new), jnp.asarray(old),
                                            jnp.asarray(returns), 0.5)
    v_loss, v_clipfrac = core_algos.compute_value_loss(
        _t(new), _t(returns), _t(old), _t(mask.astype(np.float32)), 0.5, loss_agg_mode=mode)
    np.testing.assert_allclose(_ours_aggregated(loss, mask, mode), float(v_loss), rtol=1e-5)
    m = mask.astype(np.float32)
    assert float((np.asarray(clipped) * m).sum() / m.sum()) == pytest.approx(float(v_clipfrac))
