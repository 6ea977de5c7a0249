"""The jitted StarPO update on a tiny model: gradients, micro-batching, warm-up, NaN skipping.

Compiles dominate on CPU, so a handful of module-scoped jitted functions with fixed shapes are
shared by all tests, compiled at XLA's cheapest optimisation level.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starpo import model as M
from starpo import packing
from starpo import run_config as RC
from starpo import update as UP
from starpo.trajectory import Trajectory, UpdateContexts, check_trajectory, trimmed_length

FAST = {"xla_backend_optimization_level": 0}
_jit = functools.partial(jax.jit, compiler_options=FAST)

CFG = M.ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=16, intermediate_size=64)
CRITIC = CFG.replace(value_head=True)
GROUPS, GROUP_SIZE, T, MAX_TURN = 4, 2, 20, 3

# GRPO: 2 of 4 groups kept -> 4 rows, one mini-batch of 4 in 2 micro-batches, k = 2 updates,
# sampled at temperature 0.8.
GRPO = RC.AlgoConfig(adv_estimator="grpo", group_size=GROUP_SIZE, rollout_filter_ratio=0.5,
                     ppo_mini_batch_size=4, micro_batch_size=2, online_k=2, entropy_coeff=0.0,
                     loss_agg_mode="seq-mean-token-mean", actor_lr=1e-3, temperature=0.8)
# PPO with a critic: mini-batches of 2 rows in micro-batches of 1, k = 3 updates (more than the
# 2 mini-batches of one epoch), one batch of critic warm-up.
PPO = RC.AlgoConfig(adv_estimator="gae", group_size=GROUP_SIZE, rollout_filter_ratio=0.5,
                    ppo_mini_batch_size=2, micro_batch_size=1, online_k=3, critic_warmup=1,
                    actor_lr=1e-3, critic_lr=1e-2)


def synthetic_trajectory(seed: int) -> Trajectory:
    """Episodes of [prompt | reply | obs | reply | ...] with random lengths, turns and rewards."""
    rng = np.random.default_rng(seed)
    B = GROUPS * GROUP_SIZE
    tokens = rng.integers(3, CFG.vocab_size, (B, T)).astype(np.int32)
    loss_mask = np.zeros((B, T), bool)
    turn_index = np.full((B, T), -1, np.int32)
    turn_end = np.full((B, MAX_TURN), -1, np.int32)
    turn_reward = np.zeros((B, MAX_TURN), np.float32)
    length = np.zeros(B, np.int32)
    for b in range(B):
        pos = int(rng.integers(2, 4))
        turn_index[b, :pos] = 0
        for k in range(int(rng.integers(1, MAX_TURN + 1))):
            if k:
                n = int(rng.integers(1, 3))
                turn_index[b, pos:pos + n] = k
                pos += n
            n = int(rng.integers(1, 4))
            loss_mask[b, pos:pos + n] = True
            turn_index[b, pos:pos + n] = k
            pos += n
            turn_end[b, k] = pos - 1
            turn_reward[b, k] = rng.choice([0.0, 1.0, -0.1])
        length[b] = pos
    return Trajectory(
        tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(loss_mask),
        turn_index=jnp.asarray(turn_index),
        sample_logprobs=jnp.asarray(np.where(loss_mask, -rng.random((B, T)), 0), jnp.float32),
        turn_end=jnp.asarray(turn_end), turn_reward=jnp.asarray(turn_reward),
        penalty=jnp.asarray(rng.choice([0.0, -0.1], B), jnp.float32),
        success=jnp.asarray(rng.random(B) < 0.5),
        num_actions=jnp.asarray(rng.integers(0, 6, B), jnp.int32),
        group_id=jnp.asarray(np.repeat(np.arange(GROUPS) * 11 + 5, GROUP_SIZE), jnp.int32),
        tag=jnp.zeros(B, jnp.int32), length=jnp.asarray(length))


def copy(tree):
    """Fresh buffers: the update donates its state, so fixtures must never be handed over."""
    return jax.tree_util.tree_map(jnp.array, tree)


def assert_trees_close(a, b, **kw):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


def trees_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def random_params(cfg, seed):
    """Random weights with NumPy (M.init_params would cost a compile per config); the value
    head starts at zero as in the model."""
    rng = np.random.default_rng(seed)
    flat, tree = jax.tree_util.tree_flatten_with_path(M.abstract_params(cfg))
    leaves = [np.zeros(s.shape, np.float32) if "value_head" in jax.tree_util.keystr(path)
              else np.ones(s.shape, np.float32) if "scale" in jax.tree_util.keystr(path)
              else rng.normal(0, 0.2, s.shape).astype(np.float32) for path, s in flat]
    return jax.tree_util.tree_unflatten(tree, [jnp.asarray(x) for x in leaves])


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, 0), random_params(CRITIC, 1)


@pytest.fixture(scope="module")
def traj():
    t = synthetic_trajectory(0)
    check_trajectory(t, GROUP_SIZE)
    return t


@pytest.fixture(scope="module")
def grpo_grads():
    return _jit(UP.make_grad_fn(GRPO, CFG))


@pytest.fixture(scope="module")
def grpo_update():
    return UP.make_update(GRPO, CFG, compiler_options=FAST)


@pytest.fixture(scope="module")
def ppo_update():
    return UP.make_update(PPO, CFG, CRITIC, compiler_options=FAST)


@pytest.fixture(scope="module")
def grpo_batch(params, traj):
    """The prepared (filtered, advantaged) batch of the initial policy."""
    state = UP.init_train_state(GRPO, copy(params[0]))
    return _jit(UP.make_prepare(GRPO, CFG))(state, traj)


# ----------------------------------------------------------------------------- contract, config
def test_trajectory_contract_checks(traj):
    turn_end = np.array(traj.turn_end)
    turn_end[0, 0] = 0  # position 0 is the prompt
    with pytest.raises(ValueError, match="model token"):
        check_trajectory(traj.replace(turn_end=turn_end), GROUP_SIZE)
    group_id = np.array(traj.group_id)
    group_id[1] = 99
    with pytest.raises(ValueError, match="group"):
        check_trajectory(traj.replace(group_id=group_id), GROUP_SIZE)
    assert np.asarray(traj.score).tolist() == pytest.approx(
        (np.asarray(traj.turn_reward).sum(1) + np.asarray(traj.penalty)).tolist())


def test_config_validates_names_and_counts_updates():
    with pytest.raises(ValueError, match="adv_estimator"):
        RC.AlgoConfig(adv_estimator="ppo")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        RC.AlgoConfig(loss_agg_mode="mean")
    with pytest.raises(ValueError, match="micro_batch_size"):
        RC.AlgoConfig(ppo_mini_batch_size=6, micro_batch_size=4)
    assert UP.num_updates(RC.AlgoConfig(), 32) == (32, 1)  # the reference: k = 1
    assert UP.num_updates(RC.AlgoConfig(ppo_epochs=2, ppo_mini_batch_size=8), 32) == (8, 8)
    assert UP.num_updates(RC.AlgoConfig(online_k=5, ppo_mini_batch_size=8), 32) == (8, 5)
    assert UP.num_updates(RC.AlgoConfig(ppo_mini_batch_size=64), 16) == (16, 1)
    with pytest.raises(ValueError, match="critic"):
        UP.init_train_state(PPO, {})


# ----------------------------------------------------------------------------- gradients
def test_policy_gradient_equals_hand_derived_on_two_tokens(params, grpo_grads):
    """Two model tokens, ratio 1, no entropy/KL: the loss gradient is -(1/2) sum_t A_t grad
    log pi(a_t | prefix), with log pi read straight off the model's logits (at temperature
    0.8, the policy the sampler used)."""
    actor = params[0]
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(3, CFG.vocab_size, (4, T)), jnp.int32)
    valid = jnp.ones((4, T), bool)
    picked = (5, 6)
    adv = {5: 1.5, 6: -0.7}

    def objective(p):
        """-(1/2) sum_t A_t log pi(a_t | prefix), and the log-probs themselves."""
        logits, _ = M.forward(p, CFG, tokens[:1], valid[:1])
        log_pi = {t: jax.nn.log_softmax(logits[0, t - 1] / 0.8)[tokens[0, t]] for t in picked}
        return -0.5 * sum(adv[t] * log_pi[t] for t in picked), log_pi

    (_, log_pi), want = _jit(jax.value_and_grad(objective, has_aux=True))(actor)
    old = np.zeros((4, T), np.float32)
    advantages = np.zeros((4, T), np.float32)
    mask = np.zeros((4, T), bool)
    for t in picked:
        old[0, t] = float(log_pi[t])
        advantages[0, t] = adv[t]
        mask[0, t] = True
    batch = UP.Batch(tokens=tokens, valid=valid, loss_mask=jnp.asarray(mask),
                     old_logprobs=jnp.asarray(old), ref_logprobs=None, old_values=None,
                     advantages=jnp.asarray(advantages), returns=jnp.asarray(advantages))
    got, critic, metrics = grpo_grads(actor, None, batch)
    assert critic is None
    assert abs(float(metrics["actor/ppo_kl"])) < 1e-6  # ratio 1: old log-probs agree
    assert_trees_close(got, want, rtol=2e-4, atol=1e-7)


def test_micro_batches_give_the_same_gradient(params, grpo_grads, grpo_batch):
    batch, _ = grpo_batch
    # move the old log-probs off the policy so that both clip branches are exercised
    noise = np.random.default_rng(2).normal(0, 0.4, batch.old_logprobs.shape)
    batch = batch.replace(old_logprobs=batch.old_logprobs + noise.astype(np.float32))
    one_by_one = _jit(UP.make_grad_fn(GRPO.replace(micro_batch_size=1, logit_chunk_size=5), CFG))
    g2, _, m2 = grpo_grads(params[0], None, batch)
    g1, _, m1 = one_by_one(params[0], None, batch)
    assert float(m2["actor/pg_clipfrac"]) > 0
    assert_trees_close(g1, g2, rtol=1e-4, atol=1e-7)
    for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy"):
        assert float(m1[name]) == pytest.approx(float(m2[name]), rel=1e-5, abs=1e-7)


# ----------------------------------------------------------------------------- the update
def test_grpo_update_lowers_its_loss(params, traj, grpo_grads, grpo_batch, grpo_update):
    batch, _ = grpo_batch
    before = float(grpo_grads(params[0], None, batch)[2]["actor/loss"])
    state = UP.init_train_state(GRPO, copy(params[0]))
    state, metrics = grpo_update(state, traj, jax.random.key(0))
    after = float(grpo_grads(state.actor_params, None, batch)[2]["actor/loss"])
    assert after < before - 1e-4
    assert float(metrics["actor/online_k"]) == 2 == float(metrics["trainer/updates_per_batch"])
    assert int(state.actor_steps) == 2 and int(state.step) == 1 and state.critic_params is None
    assert float(metrics["rollout/kept_groups"]) == 2
    assert float(metrics["rollout/chosen_in_group_std"]) >= float(
        metrics["rollout/in_group_std"])
    assert float(metrics["actor/grad_norm"]) > 0


def test_critic_warmup_then_actor_updates(params, traj, ppo_update):
    actor0, critic0 = params
    state = UP.init_train_state(PPO, copy(actor0), copy(critic0))
    state, m1 = ppo_update(state, traj, jax.random.key(0))
    assert trees_equal(state.actor_params, actor0)  # warm-up: the actor is untouched
    assert not trees_equal(state.critic_params, critic0)
    assert float(m1["actor/online_k"]) == 0 and int(state.critic_steps) == 3
    state, m2 = ppo_update(state, traj, jax.random.key(1))
    assert not trees_equal(state.actor_params, actor0)
    assert float(m2["actor/online_k"]) == 3 and int(state.actor_steps) == 3
    assert float(m2["critic/vf_loss"]) < float(m1["critic/vf_loss"])  # the critic learned
    assert float(m2["critic/values/mean"]) != 0.0  # zero-initialised head has moved
    assert float(m2["rollout/kept_groups"]) == 2
    expected = {
        "rollout/in_group_std", "rollout/chosen_in_group_std", "rollout/kept_groups",
        "rollout/batch_std", "rollout/filter_kept_ratio", "rollout/filter_zero_count",
        "rollout/filter_kept_count", "rollout/in_group_max", "rollout/in_group_mean",
        "rollout/chosen_in_group_max", "rollout/chosen_in_group_mean",
        *(f"rollout/{c}in_group_reward_{s}" for c in ("", "chosen_")
          for s in ("std", "max", "mean", "sum")),
        "actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl",
        "actor/entropy", "actor/loss", "actor/grad_norm", "actor/lr",
        "actor/sampler_logprob_gap", "actor/sampler_logprob_abs_gap",
        "actor/sampler_logprob_max_abs_gap", "actor/sampler_kl", "actor/online_k",
        "actor/nonfinite_skipped", "trainer/updates_per_batch", "critic/score/mean",
        "critic/score/max", "critic/score/min", "critic/rewards/mean",
        "critic/advantages/mean", "critic/advantages/max", "critic/advantages/min",
        "critic/returns/mean", "critic/returns/max", "critic/returns/min",
        "response_length/mean", "critic/values/mean", "critic/values/max", "critic/values/min",
        "critic/vf_explained_var", "critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm",
        "critic/lr", "critic/nonfinite_skipped"}
    assert set(m2) == expected


@pytest.mark.parametrize("which", ["grpo", "ppo"])
def test_nonfinite_update_is_skipped_and_counted(params, traj, grpo_update, ppo_update, which):
    actor0, critic0 = params
    if which == "grpo":
        # a NaN reward in one episode of every group reaches every advantage through the
        # group statistics, so every gradient
        poisoned = traj.replace(penalty=traj.penalty.at[::GROUP_SIZE].set(jnp.nan))
        state, update, k = UP.init_train_state(GRPO, copy(actor0)), grpo_update, 2
    else:
        # every episode: the critic's returns are per episode, and each mini-batch must see one
        poisoned = traj.replace(penalty=jnp.full_like(traj.penalty, jnp.nan))
        state, update, k = UP.init_train_state(PPO, copy(actor0), copy(critic0)), ppo_update, 3
        state = state.replace(step=jnp.ones((), jnp.int32))  # past the critic warm-up
    state, metrics = update(state, poisoned, jax.random.key(0))
    assert float(metrics["actor/nonfinite_skipped"]) == k
    assert float(metrics["actor/online_k"]) == 0
    assert int(state.actor_steps) == 0
    assert trees_equal(state.actor_params, actor0)
    assert all(np.isfinite(np.asarray(x)).all()
               for x in jax.tree_util.tree_leaves(state.actor_opt_state))
    if which == "ppo":
        assert float(metrics["critic/nonfinite_skipped"]) == k
        assert trees_equal(state.critic_params, critic0)


def test_kl_to_a_reference_in_reward_and_in_loss(params, traj):
    algo = GRPO.replace(use_kl_in_reward=True, kl_penalty="kl", kl_coef=0.1, use_kl_loss=True,
                        kl_loss_type="low_var_kl", kl_loss_coef=0.5)
    actor, ref = params[0], random_params(CFG, 7)
    state = UP.init_train_state(algo, copy(actor))
    batch, metrics = _jit(UP.make_prepare(algo, CFG))(state, traj, ref)
    old, ref_logp = np.asarray(batch.old_logprobs), np.asarray(batch.ref_logprobs)
    mask = np.asarray(batch.loss_mask)
    assert np.abs(old - ref_logp)[mask].min() > 0  # a different model
    # in-reward: every model token pays kl_coef * (log pi - log pi_ref); GRPO sees the sum
    scores = np.asarray(traj.score)
    stds = scores.reshape(GROUPS, GROUP_SIZE).std(1, ddof=1)
    kept = sorted(sorted(range(GROUPS), key=lambda g: (-stds[g], g))[:2])
    rows = np.array([g * GROUP_SIZE + j for g in kept for j in range(GROUP_SIZE)])
    penalised = scores[rows] - 0.1 * np.where(mask, old - ref_logp, 0).sum(1)
    assert float(metrics["critic/rewards/mean"]) == pytest.approx(penalised.mean(), rel=1e-5)
    pairs = penalised.reshape(-1, GROUP_SIZE)
    want_adv = ((pairs - pairs.mean(1, keepdims=True))
                / (pairs.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
    np.testing.assert_allclose(np.asarray(batch.advantages)[mask],
                               np.repeat(want_adv, mask.sum(1)), rtol=1e-4, atol=1e-5)
    # in-loss: k3 aggregated like the policy loss (seq-mean-token-mean), at the current policy
    _, _, m = _jit(UP.make_grad_fn(algo, CFG))(actor, None, batch)
    d = ref_logp - old
    k3 = np.minimum(np.exp(d) - d - 1, 10.0)  # the estimator's clamp
    per_row = [k3[b][mask[b]].mean() for b in range(len(mask)) if mask[b].any()]
    assert float(m["actor/kl_loss"]) == pytest.approx(np.mean(per_row), rel=1e-4)
    assert float(m["actor/loss"]) == pytest.approx(
        float(m["actor/pg_loss"]) + 0.5 * np.mean(per_row), rel=1e-4, abs=1e-6)


def test_single_episode_groups_against_the_batch_are_reinforce(params, traj):
    """group_size 1 with batch mean_std normalisation (configs/frozenlake.py:tiny): every row's
    advantage is its score whitened over the whole batch (unbiased std), on each of its model
    tokens; a failure counts also when no other episode of its level exists to compare with."""
    algo = GRPO.replace(group_size=1, rollout_filter_ratio=1.0, reward_norm_grouping="batch",
                        reward_norm_method="mean_std", ppo_mini_batch_size=8,
                        micro_batch_size=8, online_k=1)
    B = GROUPS * GROUP_SIZE
    single = traj.replace(group_id=jnp.arange(B, dtype=jnp.int32) * 3 + 1)
    state = UP.init_train_state(algo, copy(params[0]))
    batch, metrics = _jit(UP.make_prepare(algo, CFG))(state, single)
    scores = np.asarray(traj.score, np.float64)
    want = (scores - scores.mean()) / (scores.std(ddof=1) + 1e-6)
    mask = np.asarray(batch.loss_mask)
    assert mask.shape[0] == B and mask.any(1).all()  # nothing filtered
    np.testing.assert_allclose(np.asarray(batch.advantages)[mask],
                               np.repeat(want, mask.sum(1)), rtol=1e-4, atol=1e-5)
    assert float(metrics["rollout/batch_std"]) == pytest.approx(scores.std(ddof=1), rel=1e-5)
    assert float(metrics["rollout/in_group_std"]) == 0.0


# ----------------------------------------------------------------------------- trimming
def test_trimmed_length_rounds_up_and_caps():
    assert trimmed_length(515, 1024, 128) == 640
    assert trimmed_length(640, 1024, 128) == 640
    assert trimmed_length(1000, 1024, 128) == 1024  # never past the context
    assert trimmed_length(3, 1024, 128) == 128
    assert trimmed_length(515, 1024, 0) == 1024  # 0: no trimming


def test_reply_positions_list_each_rows_reply_tokens(traj):
    """`reply_positions` against a loop over the rows' loss masks, and `reply_count`'s sizes
    (a power of two, at least 8, at least the longest row's replies) by hand."""
    mask = np.asarray(traj.loss_mask)
    K = UP.reply_count(traj.loss_mask)
    longest = int(mask.sum(1).max())
    assert K == max(8, 1 << (longest - 1).bit_length()) and longest <= K < T
    got = np.asarray(UP.reply_positions(traj.loss_mask, K))
    for b in range(mask.shape[0]):
        at = [t for t in range(T) if mask[b, t]]
        assert got[b].tolist() == at + [0] * (K - len(at))
    assert [UP.reply_count(jnp.zeros((2, 40), bool).at[0, :n].set(True))
            for n in (0, 1, 8, 9, 16, 17)] == [8, 8, 8, 16, 16, 32]


@pytest.mark.parametrize("chunk", [0, 3])
def test_logprobs_at_reply_positions_equal_the_full_heads(params, traj, chunk):
    """The output head run at the reply tokens alone (`positions`) gives each reply token
    the log-prob and entropy of the head run everywhere, and 0 at every other position, with
    and without logit chunks; its gradient through the reply tokens' log-probs is the same."""
    params = params[0]
    valid = jnp.arange(T)[None] < traj.length[:, None]
    mask = traj.loss_mask
    positions = UP.reply_positions(mask, UP.reply_count(mask))

    def run(p, at):
        return UP.token_logprobs(p, CFG, traj.tokens, valid, chunk, positions=at)

    full, part = jax.jit(run)(params, None), jax.jit(run)(params, positions)
    for f, g in zip(full, part):
        np.testing.assert_allclose(np.asarray(g), np.where(mask, f, 0.0), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(full[0] * mask).sum()) > 0  # the masks select something

    def loss(p, at):
        return jnp.sum(run(p, at)[0] * mask)

    want, got = (jax.jit(jax.grad(loss))(params, at) for at in (None, positions))
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)


def single_turn_groups(seed: int, groups: int = 3, size: int = 3, K: int = 4):
    """(tokens, valid, loss_mask) of single-turn rows in groups of `size` sharing a prompt
    (lengths differ by group), each reply of 1..K tokens right after it, then padding."""
    rng = np.random.default_rng(seed)
    B = groups * size
    tokens = rng.integers(3, CFG.vocab_size, (B, T)).astype(np.int32)
    valid, mask = np.zeros((B, T), bool), np.zeros((B, T), bool)
    for g in range(groups):
        p = int(rng.integers(4, T - K))
        prompt = rng.integers(3, CFG.vocab_size, p)
        for r in range(g * size, (g + 1) * size):
            n = K if r == g * size + 1 else int(rng.integers(1, K + 1))
            tokens[r, :p] = prompt
            valid[r, :p + n], mask[r, p:p + n] = True, True
    return jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(mask)


@pytest.mark.parametrize("chunk", [0, 3])
def test_a_groups_shared_prompt_runs_once_with_the_same_logprobs_and_gradient(params, chunk):
    """Single-turn rows in groups of 3 with one prompt (`share=3`, `packed_hidden`): the
    prompt runs once per group, each reply after it in its own block; every reply token's
    log-prob and entropy, and the gradient through them, equal each row's own forward."""
    params = params[0]
    tokens, valid, mask = single_turn_groups(1)
    positions = UP.reply_positions(mask, 4)

    def run(p, share):
        return UP.token_logprobs(p, CFG, tokens, valid, chunk, 0.8, positions=positions,
                                 share=share)

    each, shared = (jax.jit(run, static_argnums=1)(params, s) for s in (1, 3))
    for e, s in zip(each, shared):
        np.testing.assert_allclose(np.asarray(s), np.asarray(e), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(each[0] * mask).sum()) > 0 and not bool((each[0] * ~mask).any())
    weights = jnp.asarray(np.random.default_rng(2).normal(size=mask.shape), jnp.float32)

    def loss(p, share):
        return jnp.sum(run(p, share)[0] * weights * mask)

    want, got = (jax.jit(jax.grad(loss), static_argnums=1)(params, s) for s in (1, 3))
    for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        # (a group's rows' contributions to the prompt's weights are summed in another order)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="reply positions"):
        UP.token_logprobs(params, CFG, tokens, valid, share=3)


def test_update_contexts_reuse_a_compiled_context_until_its_padding_pays_for_a_compile():
    """Figures by hand: buckets of 128 in a 1024-token context, a compile priced at 1 update."""
    choose = UpdateContexts(128, patience=1.0)
    assert choose(890, 1024) == 896  # nothing compiled: its own
    # 640 is served by 896 at 1 - 640/896 = 2/7 of an update's padding a batch
    assert [choose(600, 1024) for _ in range(3)] == [896] * 3  # 2/7, 4/7, 6/7 < 1
    assert choose(700, 1024) == 896  # 768's own account: 1/7
    assert choose(600, 1024) == 640  # 8/7 >= 1: compiled now, served by itself from then on
    assert choose(601, 1024) == 640
    assert choose(500, 1024) == 640  # 512: the smallest compiled context above it, 1/5
    assert choose(1000, 1024) == 1024  # longer than every compiled one: at once
    assert choose(700, 1024) == 896  # 768: 2/7
    state = choose.state_dict()
    assert state == {"compiled": [640, 896, 1024],
                     "padding": {"512": pytest.approx(0.2), "768": pytest.approx(2 / 7)}}
    # a resumed run's (the state through its checkpoint's JSON) chooses as the run would have
    resumed = UpdateContexts(128, patience=1.0, state=json.loads(json.dumps(state)))
    for length, want in ((700, 896), (700, 896), (300, 640), (300, 640), (300, 384),
                         (2000, 1024)):  # 384 on 640: 0.4, 0.8, then 1.2 >= 1
        assert resumed(length, 1024) == choose(length, 1024) == want, length
    assert resumed.state_dict() == choose.state_dict()
    assert choose.state_dict()["compiled"] == [384, 640, 896, 1024]
    # a context above the batch's whole context never serves it; bucket 0: the whole context
    assert UpdateContexts(128, state={"compiled": [896]})(300, 512) == 384
    assert UpdateContexts(0)(5, 1024) == 1024


def test_update_on_the_trimmed_context_equals_the_full_one(params, traj, ppo_update):
    """Cutting the padding off the context changes nothing the update computes (PPO with a
    critic and GAE past warm-up: positions enter the values, the returns and the losses)."""
    actor0, critic0 = params
    n = int(np.asarray(traj.length).max())
    assert n < T
    short = traj.truncate(n)
    assert short.tokens.shape == (GROUPS * GROUP_SIZE, n)
    check_trajectory(short, GROUP_SIZE)
    results = []
    for t in (traj, short):
        state = UP.init_train_state(PPO, copy(actor0), copy(critic0))
        state = state.replace(step=jnp.ones((), jnp.int32))  # past the critic warm-up
        results.append(ppo_update(state, t, jax.random.key(3)))
    (full_state, full_m), (short_state, short_m) = results
    assert float(full_m["actor/online_k"]) == 3
    assert set(full_m) == set(short_m)
    for name in full_m:
        assert float(short_m[name]) == pytest.approx(float(full_m[name]), rel=1e-4, abs=1e-6), name
    assert_trees_close(short_state.actor_params, full_state.actor_params, rtol=1e-4, atol=1e-6)
    assert_trees_close(short_state.critic_params, full_state.critic_params, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("which", ["grpo", "ppo"])
def test_update_with_the_head_at_reply_tokens_equals_the_full_one(params, traj, grpo_update,
                                                                  ppo_update, which):
    """With the rollout's budget known (max_turn x response_length = 9 reply tokens a row, of
    a 20-token context), the update runs its output head at the reply tokens alone
    (`head_positions`): every metric and the new weights are those of the head run everywhere
    (GRPO with the filter's row gather and a temperature; PPO with a critic past warm-up)."""
    actor0, critic0 = params
    algo, full = (GRPO, grpo_update) if which == "grpo" else (PPO, ppo_update)
    budget = algo.replace(max_turn=MAX_TURN, response_length=3)
    assert int(np.asarray(traj.loss_mask).sum(1).max()) <= MAX_TURN * 3 < T
    assert UP.head_positions(budget, traj.loss_mask).shape == (GROUPS * GROUP_SIZE, 9)
    assert UP.head_positions(algo, traj.loss_mask) is None  # no budget: the head everywhere
    part = UP.make_update(budget, CFG, CRITIC if algo.uses_critic else None,
                          compiler_options=FAST)
    results = []
    for update in (full, part):
        state = UP.init_train_state(algo, copy(actor0), copy(critic0) if algo.uses_critic
                                    else None)
        state = state.replace(step=jnp.ones((), jnp.int32))  # past a critic warm-up
        results.append(update(state, traj, jax.random.key(3)))
    (full_state, full_m), (part_state, part_m) = results
    assert set(full_m) == set(part_m)
    for name in full_m:
        assert float(part_m[name]) == pytest.approx(float(full_m[name]), rel=1e-4, abs=1e-6), name
    assert_trees_close(part_state.actor_params, full_state.actor_params, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("order", ["shuffled", "one mini-batch", "in order, one group a step",
                                   "in order, critic"])
def test_a_single_turn_batchs_old_logprobs_run_each_prompt_once(params, monkeypatch, order):
    """Single-turn episodes in groups of 3 (a group's rows share a prompt) through the GRPO
    update, the filter keeping 2 of 3 groups: the old log-probs run each kept group's prompt
    once (`prompt_share` = 3 for micro-batches of 3, 6 and 2 rows: a packed group of 3 holds
    20 + 2 x 4 tokens, 28 <= 2 x 20; 1 for micro-batches of 1 row or a second turn), and where
    its mini-batches are the rows in order so does the PPO loss (`loss_share`: one shuffled
    mini-batch of all 6 rows, in micro-batches of one group; without `shuffle_mini_batches`,
    mini-batches of 3 rows, one group a step; of 6, with a critic, whose loss keeps its
    micro-batches of 2 rows); not two shuffled mini-batches of 3 rows. Every metric and the new
    weights equal those of every row running its own forward."""
    actor0 = params[0]
    tokens, valid, mask = single_turn_groups(3)
    B = tokens.shape[0]
    last = np.asarray(jnp.max(jnp.where(mask, jnp.arange(T), -1), axis=1))
    rng = np.random.default_rng(4)
    traj = Trajectory(
        tokens=tokens, loss_mask=mask, turn_index=jnp.where(valid, 0, -1).astype(jnp.int32),
        sample_logprobs=jnp.where(mask, -jnp.asarray(rng.random((B, T)), jnp.float32), 0.0),
        turn_end=jnp.asarray(last[:, None], jnp.int32),
        turn_reward=jnp.asarray(rng.choice([0.0, 1.0, 0.25], (B, 1)), jnp.float32),
        penalty=jnp.zeros(B, jnp.float32), success=jnp.asarray(rng.random(B) < 0.5),
        num_actions=jnp.ones(B, jnp.int32),
        group_id=jnp.asarray(np.repeat(np.arange(3), 3), jnp.int32),
        tag=jnp.zeros(B, jnp.int32), length=jnp.sum(valid, axis=1).astype(jnp.int32))
    check_trajectory(traj, 3)
    algo = GRPO.replace(group_size=3, rollout_filter_ratio=0.67, ppo_mini_batch_size=6,
                        micro_batch_size=2, max_turn=1, response_length=4,
                        shuffle_mini_batches=order in ("shuffled", "one mini-batch"))
    if order in ("shuffled", "in order, one group a step"):
        algo = algo.replace(ppo_mini_batch_size=3, micro_batch_size=3, online_k=0)
    critic = order == "in order, critic"
    if critic:
        algo = algo.replace(adv_estimator="gae", critic_lr=1e-2)
    assert [UP.prompt_share(algo, T, m) for m in (3, 6, 2, 1)] == [3, 3, 3, 1]
    assert [UP.share_micro(m, 3, 6) for m in (3, 6, 2)] == [3, 6, 3]
    assert [UP.share_micro(m, 8, 40) for m in (20, 40, 4)] == [8, 40, 8]  # 5 groups
    assert UP.prompt_share(algo.replace(max_turn=2), T, 3) == 1
    results, shares, loss_share = [], [], UP.loss_share
    monkeypatch.setattr(UP, "loss_share", lambda *a: shares.append(loss_share(*a)) or shares[-1])
    for share in (True, False):
        if not share:
            monkeypatch.setattr(UP.packed, "prompt_share", lambda *a: 1)
        state = UP.init_train_state(algo, copy(actor0), copy(params[1]) if critic else None)
        update = UP.make_update(algo, CFG, CRITIC if critic else None, compiler_options=FAST)
        results.append(update(state, traj, jax.random.key(3)))
    (shared_state, shared_m), (each_state, each_m) = results
    assert shares == [1 if order == "shuffled" else 3, 1]  # the PPO loss's, packed then not
    assert float(each_m["trainer/updates_per_batch"]) == 2
    assert float(each_m["rollout/kept_groups"]) == 2
    for name in each_m:
        assert float(shared_m[name]) == pytest.approx(float(each_m[name]), rel=1e-4,
                                                      abs=1e-5), name
    # Adam divides each gradient by its own size: an element whose gradient is ~0 moves by
    # float noise (up to 4e-5 here, against steps of lr = 1e-3)
    assert_trees_close(shared_state.actor_params, each_state.actor_params, rtol=1e-4, atol=1e-4)


def test_lr_schedule_warmup_then_cosine_decay():
    """Hand-derived: warm-up (count + 1) / 4 of lr, then lr * (r + (1 - r) (1 + cos(pi t)) / 2)
    with t = (count - 4) / 8, flat at r * lr afterwards; no decay = constant after warm-up."""
    f = UP.lr_schedule(2.0, warmup_steps=4, decay_steps=8, min_ratio=0.25)
    got = [float(f(c)) for c in (0, 3, 4, 6, 8, 12, 20)]
    want = [0.5, 2.0, 2.0, 2.0 * (0.25 + 0.75 * (1 + np.cos(np.pi / 4)) / 2),
            2.0 * (0.25 + 0.75 * 0.5), 0.5, 0.5]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    g = UP.lr_schedule(2.0, warmup_steps=0)
    assert [float(g(c)) for c in (0, 100)] == [2.0, 2.0]
    with pytest.raises(ValueError, match="min_lr_ratio"):
        RC.AlgoConfig(min_lr_ratio=1.5)


# ----------------------------------------------------------------------------- top-p, GiGPO
@pytest.mark.parametrize("strategy,include_zero", [("top_p", True), ("min_p", True),
                                                   ("top_k_abs", True), ("top_k", False)])
def test_top_p_masks_what_the_ratio_filter_drops(params, traj, grpo_batch, strategy,
                                                 include_zero):
    """Top-p (or RAGEN-2's min-p, top-k-abs, or top-k without zero-std groups) set to keep the
    same two groups as the ratio filter: the same rows train, with the same masks and
    advantages; where the filter masks rows the other groups stay in the batch with nothing to
    train on, top-k-abs gathers the two."""
    from starpo import filtering
    std = np.sort(np.asarray(filtering.in_group_std(traj.score, GROUP_SIZE)))[::-1]
    assert std[1] > 0.01 and std[1] > std[2]
    algo = GRPO.replace(rollout_filter_strategy=strategy, rollout_filter_count=2,
                        rollout_filter_include_zero=include_zero,
                        rollout_filter_top_p=float(std[:2].sum() / std.sum()),
                        rollout_filter_min_p=float((std[1] + std[2]) / 2 / std[0]))
    state = UP.init_train_state(algo, copy(params[0]))
    batch, metrics = _jit(UP.make_prepare(algo, CFG))(state, traj)
    want, want_metrics = grpo_batch
    keep = np.asarray(batch.loss_mask).any(axis=1)
    rows = GROUPS * GROUP_SIZE if algo.masks_rows else 4
    assert batch.tokens.shape[0] == rows and keep.sum() == 4
    assert float(metrics["rollout/kept_groups"]) == 2
    assert np.array_equal(np.asarray(batch.tokens)[keep], np.asarray(want.tokens))
    assert np.array_equal(np.asarray(batch.loss_mask)[keep], np.asarray(want.loss_mask))
    np.testing.assert_allclose(np.asarray(batch.advantages)[keep], np.asarray(want.advantages),
                               rtol=1e-6, atol=1e-7)
    assert not np.asarray(batch.advantages)[~keep].any()
    for name in ("critic/score/mean", "critic/advantages/mean", "response_length/mean",
                 "rollout/chosen_in_group_std"):
        assert float(metrics[name]) == pytest.approx(float(want_metrics[name]), rel=1e-5), name


@pytest.mark.parametrize("knobs", [
    dict(soft_advantage_reweight=True), dict(filter_loss_scaling="linear"),
    dict(grpo_advantage_length_weight=True), dict(zero_task_advantage=True),
    dict(soft_advantage_reweight=True, filter_loss_scaling="sqrt",
         grpo_advantage_length_weight=True)])
def test_ragen2s_advantage_scalings(params, traj, grpo_batch, knobs):
    """RAGEN-2's scalings after GRPO's advantages, as its trainer applies them in turn (read
    as a loop over the kept groups and rows): each group's by its score std over the largest
    kept group's + 1e-6; by the kept share of groups (or its root); each row's by the kept rows'
    mean reply length over its own + 1e-6; or zero."""
    from starpo import filtering
    score = np.asarray(traj.score, np.float64).reshape(GROUPS, GROUP_SIZE)
    stds = [float(np.std(g, ddof=1)) for g in score]
    kept = sorted(sorted(range(GROUPS), key=lambda g: (-stds[g], g))[:2])  # ratio 0.5
    rows = [g * GROUP_SIZE + i for g in kept for i in range(GROUP_SIZE)]
    lengths = np.asarray(traj.loss_mask).sum(axis=1)[rows].astype(np.float64)
    factor = np.ones(len(rows))
    if knobs.get("soft_advantage_reweight"):
        largest = max(stds[g] for g in kept)
        factor *= [stds[r // GROUP_SIZE] / (largest + 1e-6) for r in rows]
    share = len(kept) / GROUPS
    factor *= {"none": 1.0, "linear": share, "sqrt": share ** 0.5}[
        knobs.get("filter_loss_scaling", "none")]
    if knobs.get("grpo_advantage_length_weight"):
        factor /= (lengths + 1e-6) / lengths.mean()
    if knobs.get("zero_task_advantage"):
        factor *= 0.0
    algo = GRPO.replace(**knobs)
    state = UP.init_train_state(algo, copy(params[0]))
    batch, metrics = _jit(UP.make_prepare(algo, CFG))(state, traj)
    base, _ = grpo_batch
    assert np.asarray(filtering.in_group_std(traj.score, GROUP_SIZE))[kept].min() > 0
    np.testing.assert_allclose(np.asarray(batch.advantages),
                               np.asarray(base.advantages) * factor[:, None], rtol=1e-5,
                               atol=1e-7)
    if knobs.get("soft_advantage_reweight"):
        weights = [stds[g] / (max(stds[k] for k in kept) + 1e-6) for g in kept]
        for name, want in (("min", min(weights)), ("max", max(weights)),
                           ("mean", np.mean(weights))):
            assert float(metrics[f"train/soft_reweight_{name}"]) == pytest.approx(want, rel=1e-5)


def test_gigpo_prepare_uses_the_state_hashes(params, traj):
    from starpo import advantages as A
    algo = GRPO.replace(adv_estimator="gigpo", rollout_filter_ratio=1.0, gamma=0.9,
                        gigpo_step_advantage_w=0.5)
    hashes = np.asarray(traj.turn_end >= 0, np.int32) * (np.arange(MAX_TURN) % 2 + 1)
    t = traj.replace(state_hash=jnp.asarray(hashes))
    state = UP.init_train_state(algo, copy(params[0]))
    batch, _ = _jit(UP.make_prepare(algo, CFG))(state, t)
    mask = t.loss_mask & t.valid
    rewards = A.token_rewards(t.turn_end, t.turn_reward, t.score, jnp.ones_like(t.score), T,
                              False)
    want, _ = A.gigpo(rewards.sum(axis=1), t.turn_reward, t.turn_end, t.turn_index,
                      t.state_hash, t.group_id, mask, 0.9, 0.5, "mean_norm")
    np.testing.assert_allclose(np.asarray(batch.advantages), np.asarray(want), rtol=1e-6,
                               atol=1e-7)
    with pytest.raises(ValueError, match="state_hash"):
        UP.make_prepare(algo, CFG)(state, traj)


# ----------------------------------------------------------------------------- RAGEN-2's batch
def ragen2_adjusted_batch(kept_rows, groups, mini, mode="copy"):
    """RAGEN-2's agent_trainer after its filter, read as a loop: the batch is the kept rows
    alone; adjust_batch(mode="copy") appends n'-n copies of them (n' the next multiple of
    lcm(env_groups, ppo_mini_batch_size, 1 GPU)), drawn without replacement unless more copies
    than rows are needed; mode="delete" removes the remainder n % step (random rows); verl then
    takes n' / mini mini-batches per epoch. Returns (n', copies (negative: deleted),
    mini-batches an epoch)."""
    n = len(kept_rows)
    step = int(np.lcm(groups, mini))
    remainder = n % step
    n_adj = n if remainder == 0 else (n - remainder if mode == "delete" else n + step - remainder)
    return n_adj, n_adj - n, n_adj // mini


@pytest.mark.parametrize("mode", ["copy", "delete"])
@pytest.mark.parametrize("kept_groups,group_size,mini,epochs", [
    ((1, 4, 6), 4, 8, 2),  # 12 rows -> 16: 4 distinct copies, 2 mini-batches an epoch (or 8)
    ((3,), 2, 8, 1),  # 2 rows -> 8: 6 copies, drawn with replacement (or 0 rows)
    ((0, 1, 2, 3, 4, 5, 6, 7), 4, 8, 1),  # everything kept: no copies, 4 mini-batches
    ((), 4, 8, 2),  # nothing kept: no mini-batch is real
    ((0, 2, 3, 5, 7), 4, 8, 2),  # 20 rows -> 24 (or 16: 4 random rows deleted)
])
def test_kept_minibatch_order_is_ragen2s_adjusted_batch(kept_groups, group_size, mini, epochs,
                                                        mode):
    G = 8
    keep = np.zeros(G * group_size, bool)
    for g in kept_groups:
        keep[g * group_size:(g + 1) * group_size] = True
    kept_rows = np.flatnonzero(keep)
    algo = RC.AlgoConfig(adv_estimator="grpo", group_size=group_size, ppo_mini_batch_size=mini,
                         micro_batch_size=mini, ppo_epochs=epochs, batch_adjust_mode=mode)
    order, real = jax.jit(UP.kept_minibatch_order, static_argnums=(0, 2))(
        algo, jnp.asarray(keep), G, jax.random.key(3))
    order, real = np.asarray(order), np.asarray(real)
    n_adj, copies, per_epoch = ragen2_adjusted_batch(kept_rows, G, mini, mode)
    slots = order.shape[0] // epochs
    assert order.shape == (epochs * slots, mini) and slots * mini >= keep.size
    assert real.tolist() == ([True] * per_epoch + [False] * (slots - per_epoch)) * epochs
    epoch_rows = [np.sort(order[e * slots:e * slots + per_epoch].ravel()) for e in range(epochs)]
    for rows in epoch_rows:  # the same adjusted batch every epoch: kept rows plus the copies
        assert np.array_equal(rows, epoch_rows[0]) and len(rows) == n_adj
        assert set(rows) <= set(kept_rows)
        counts = np.bincount(rows, minlength=keep.size)[kept_rows]
        assert counts.sum() == len(kept_rows) + copies
        if copies >= 0:
            assert (counts >= 1).all()  # every kept row, some twice
        else:
            assert counts.max() <= 1 and (counts == 0).sum() == -copies  # -copies rows gone
        if 0 < copies <= len(kept_rows):
            assert counts.max() <= 2  # without replacement
    if epochs > 1 and per_epoch > 1:  # a fresh permutation each epoch
        assert not np.array_equal(order[:per_epoch], order[slots:slots + per_epoch])


def test_mini_batches_in_order_are_verls_split():
    """Without `shuffle_mini_batches`, verl's `batch.split(mini)`: every epoch the rows in
    order, mini at a time (hand-written); a filtered batch's kept rows in row order, then its
    copies (RAGEN-2's adjusted batch, whose copies come last). Shuffled: a permutation an
    epoch, except one mini-batch of every row (in order: the same mini-batch)."""
    algo = RC.AlgoConfig(adv_estimator="grpo", group_size=4, ppo_mini_batch_size=8,
                         micro_batch_size=8, ppo_epochs=2, shuffle_mini_batches=False)
    order = np.asarray(UP.minibatch_order(algo, 24, jax.random.key(0)))
    assert order.tolist() == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))] * 2
    shuffled = algo.replace(shuffle_mini_batches=True)
    order = np.asarray(UP.minibatch_order(shuffled, 24, jax.random.key(0)))
    assert sorted(order[:3].ravel()) == list(range(24)) and order[:3].ravel().tolist() != list(
        range(24))
    assert np.asarray(UP.minibatch_order(shuffled, 8, jax.random.key(0))).tolist() == [
        list(range(8))] * 2
    keep = np.zeros(32, bool)
    keep[[4, 5, 6, 7, 20, 21, 22, 23, 24, 25, 26, 27]] = True  # groups 1, 5, 6: 12 rows -> 16
    order, real = UP.kept_minibatch_order(algo, jnp.asarray(keep), 8, jax.random.key(3))
    order, real = np.asarray(order), np.asarray(real)
    assert real.tolist() == [True, True, False, False] * 2
    for epoch in (order[:2], order[4:6]):
        assert epoch[0].tolist() == [4, 5, 6, 7, 20, 21, 22, 23]
        assert epoch[1, :4].tolist() == [24, 25, 26, 27]
        assert set(epoch[1, 4:]) <= set(np.flatnonzero(keep))  # 4 copies
    assert np.array_equal(order[:2], order[4:6])


def test_update_trains_on_the_kept_rows_in_fewer_full_minibatches(params, traj):
    """Top-p keeping 2 of 4 groups: the update takes the 2 full mini-batches of 2 kept rows
    that RAGEN-2 takes (not 4 half-masked ones): its weights equal two optimizer steps on
    those mini-batches done by hand, and it counts 2 updates."""
    import optax

    from starpo import filtering
    std = np.sort(np.asarray(filtering.in_group_std(traj.score, GROUP_SIZE)))[::-1]
    p = float(std[:2].sum() / std.sum())
    algo = GRPO.replace(rollout_filter_strategy="top_p", rollout_filter_top_p=p,
                        ppo_mini_batch_size=2, micro_batch_size=1, online_k=0)
    key = jax.random.key(5)
    state = UP.init_train_state(algo, copy(params[0]))
    batch, _ = _jit(UP.make_prepare(algo, CFG))(state, traj)
    order, real = UP.kept_minibatch_order(algo, batch.keep, GROUPS, key)
    assert np.asarray(real).tolist() == [True, True, False, False]
    grad_fn = _jit(UP.make_grad_fn(algo, CFG))
    tx = UP.make_optimizer(algo.actor_lr, algo)

    @jax.jit  # one program, not one compile per leaf and op
    def apply(g, opt, w):
        updates, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, updates), opt

    take = jax.jit(lambda b, rows: jax.tree_util.tree_map(lambda x: x[rows], b))
    want = copy(params[0])
    opt = jax.jit(tx.init)(want)
    for rows in np.asarray(order)[np.asarray(real)]:
        g, _, _ = grad_fn(want, None, take(batch, rows))
        want, opt = apply(g, opt, want)
    new, m = UP.make_update(algo, CFG, compiler_options=FAST)(
        UP.init_train_state(algo, copy(params[0])), traj, key)
    assert float(m["trainer/updates_per_batch"]) == 2 and float(m["actor/online_k"]) == 2
    assert_trees_close(new.actor_params, want, rtol=2e-5, atol=1e-6)
    assert int(new.actor_steps) == 2


def _first_fit(lengths, replies, T, most):
    """A slow reference of `row_plan`'s placement: (sequence, offset) of each row, and the
    sequences used."""
    at, fill, held = [], [], []
    for n, c in zip(lengths, replies):
        if not n:
            at.append(None)
            continue
        b = next((i for i in range(len(fill)) if fill[i] + n <= T and held[i] + c <= most),
                 len(fill))
        if b == len(fill):
            fill.append(0)
            held.append(0)
        at.append((b, fill[b]))
        fill[b] += n
        held[b] += c
    return at, len(fill)


def test_packed_rows_are_whole_rows_in_order_each_at_its_own_positions():
    """`pack_rows` on 12 rows of 20 tokens with 1-6 reply tokens at random places up to
    token 11 (two rows without any), a row's budget 9 (3 turns of 3): each row's tokens
    through its last reply token sit whole at the place first fit gives (a slow loop: the
    first sequence where the tokens stay within 20 and the reply tokens within 9; here some
    rows go back to an earlier sequence), with its own rotary positions (the valid tokens
    before it in its row), its row as its segment and its loss tokens and per-token inputs
    alongside; the slots between rows are empty; bins count the sequences used."""
    rng = np.random.default_rng(7)
    N, budget = 12, RC.AlgoConfig(max_turn=3, response_length=3)
    tokens = rng.integers(3, CFG.vocab_size, (N, T)).astype(np.int32)
    valid = rng.random((N, T)) < 0.9
    loss_mask = np.zeros((N, T), bool)
    for r in range(N):
        if r not in (3, 8):  # no reply token
            last = int(rng.integers(6, 12))
            some = rng.choice(np.arange(1, last), int(rng.integers(0, 6)), replace=False)
            loss_mask[r, some] = True
            loss_mask[r, last] = True
    adv = rng.standard_normal((N, T)).astype(np.float32)
    batch = UP.Batch(tokens=jnp.asarray(tokens), valid=jnp.asarray(valid),
                     loss_mask=jnp.asarray(loss_mask), old_logprobs=jnp.asarray(-adv ** 2),
                     ref_logprobs=None, old_values=None, advantages=jnp.asarray(adv),
                     returns=jnp.asarray(adv * 2), positions=jnp.zeros((N, 9), jnp.int32))
    packed, bins = jax.jit(UP.pack_rows, static_argnums=0)(budget, batch)
    lengths = [int(np.max(np.nonzero(m)[0], initial=-1)) + 1 for m in loss_mask]
    at, want_bins = _first_fit(lengths, loss_mask.sum(1), T, 9)
    assert int(bins) == want_bins == 8 and packed.segments == N  # 10 rows with a reply
    placed = [p[0] for p in at if p is not None]
    assert any(b < max(placed[:i]) for i, b in enumerate(placed) if i)  # not next fit
    got = {k: np.asarray(getattr(packed, k)) for k in (
        "tokens", "valid", "loss_mask", "old_logprobs", "advantages", "returns", "turns",
        "rotary")}
    used = np.zeros((N, T), bool)
    for r, (place, n) in enumerate(zip(at, lengths)):
        if place is None:
            continue
        b, o = place
        s = slice(o, o + n)
        used[b, s] = True
        np.testing.assert_array_equal(got["tokens"][b, s], tokens[r, :n])
        np.testing.assert_array_equal(got["valid"][b, s], valid[r, :n])
        np.testing.assert_array_equal(got["loss_mask"][b, s], loss_mask[r, :n])
        np.testing.assert_array_equal(got["advantages"][b, s], adv[r, :n])
        np.testing.assert_array_equal(got["returns"][b, s], 2 * adv[r, :n])
        assert (got["turns"][b, s] == r).all()
        np.testing.assert_array_equal(got["rotary"][b, s],
                                      np.maximum(np.cumsum(valid[r, :n]) - 1, 0))
    assert not got["valid"][~used].any() and not got["loss_mask"][~used].any()
    assert got["loss_mask"].sum() == loss_mask.sum()
    # the head's positions: each packed loss token, in order
    want = [np.nonzero(m)[0] for m in got["loss_mask"]]
    for p, w in zip(np.asarray(packed.positions), want):
        np.testing.assert_array_equal(p[:len(w)], w)
    # and back: a per-token output of the sequences, in rows (0 past a row's last reply)
    plan = jax.jit(packing.row_plan, static_argnums=1)(batch.loss_mask, 9)
    back = np.asarray(packing.unpack(packing.pack(batch.advantages, plan), plan))
    np.testing.assert_array_equal(back, np.where(np.arange(T) < np.asarray(lengths)[:, None],
                                                 adv, 0))


@pytest.mark.parametrize("which", ["grpo token-mean", "grpo seq-mean-token-mean", "ppo"])
def test_packed_rows_update_equals_one_row_a_sequence(params, traj, which):
    """The update with multi-turn rows packed into shared sequences (`algorithm.pack_rows`,
    the head at the reply tokens: 8 rows of up to 14 tokens and 8 reply tokens in a 20-token
    context, a budget of 3 turns of 5 reply tokens: 6 sequences) against one row a sequence:
    every metric and the new weights are the same, for a token mean, a sequence mean (whose
    row means are summed by segment) and PPO with a critic; the old log-probs and the
    critic's values run packed too (`packed_forward`).
    (Rotary embeddings are relative, so a row's positions shifted as a whole would pass here
    too, to rounding: the positions themselves are checked above.)"""
    actor0, critic0 = params
    algo = (PPO if which == "ppo" else GRPO.replace(loss_agg_mode=which.split()[1]))
    algo = algo.replace(max_turn=MAX_TURN, response_length=5, rollout_filter_ratio=1.0,
                        ppo_mini_batch_size=8, micro_batch_size=2, online_k=2)
    lengths = np.asarray(jnp.max(jnp.where(traj.loss_mask, jnp.arange(1, T + 1), 0), axis=1))
    replies = np.asarray(traj.loss_mask).sum(1)
    assert _first_fit(lengths, replies, T, 15)[1] == 6  # of 8 sequences, micro-batches of 1
    results = []
    for pack in (True, False):
        run = algo.replace(pack_rows=pack)
        state = UP.init_train_state(run, copy(actor0), copy(critic0) if run.uses_critic
                                    else None)
        state = state.replace(step=jnp.ones((), jnp.int32))  # past a critic warm-up
        update = UP.make_update(run, CFG, CRITIC if run.uses_critic else None,
                                compiler_options=FAST)
        results.append(update(state, traj, jax.random.key(3)))
    (packed_state, packed_m), (rows_state, rows_m) = results
    assert set(packed_m) == set(rows_m)
    for name in rows_m:
        assert float(packed_m[name]) == pytest.approx(float(rows_m[name]), rel=1e-4,
                                                      abs=1e-6), name
    assert_trees_close(packed_state.actor_params, rows_state.actor_params, rtol=1e-4,
                       atol=1e-6)
    if algo.uses_critic:
        assert_trees_close(packed_state.critic_params, rows_state.critic_params, rtol=1e-4,
                           atol=1e-6)
