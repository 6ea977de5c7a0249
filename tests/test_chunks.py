"""Episodes played in chunks (`rollout.batch_size`, `val.batch_size`): the same levels, rows in
the same order, one compiled program of the chunk's size; with one chunk (0 or the whole batch)
bit for bit what playing the whole batch at once gives, with several chunk i samples from
`fold_in(key, i)`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import frozenlake
from starpo import config_check, evaluate, experiment, rollout, run_config, weights
from tests.test_training import with_changes

TINY = "tiny:layers=1,hidden=32,heads=2,kv_heads=1,head_dim=16,mlp=64"


def leaves_equal(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def tiny():
    return weights.load_model(TINY)


def test_an_eval_set_in_chunks_plays_the_same_levels(tiny):
    import envs
    env = envs.make("FrozenLake")
    spec = rollout.RolloutSpec(max_turn=2, max_new_tokens=6, max_context=2048)
    kw = dict(env_groups=4, group_size=2, spec=spec, compiler_options=experiment.FAST_COMPILE)
    sets = {n: evaluate.make_eval_set("FrozenLake", env, tiny.tokenizer, tiny.cfg, batch_size=n,
                                      **kw) for n in (0, 8, 4)}
    key = jax.random.key(7)
    out = {n: jax.device_get(s.play(tiny.params, key, 1.0)) for n, s in sets.items()}
    # one chunk: what one call over the whole set gives (today's EvalSet), bit for bit
    whole = sets[0]
    assert sets[8].batch_size == whole.batch_size == 8
    today = jax.device_get(whole.run_from(tiny.params, key, whole.env_state, whole.group_id,
                                          jnp.float32(1.0)))
    leaves_equal(out[0], today)
    leaves_equal(out[8], today)
    # two chunks of two groups: each chunk is the 4-row program on its rows, key fold_in(key, i)
    s = sets[4]
    assert s.rollout.sampler is not None and s.group_id.shape == (8,)
    for i in range(2):
        rows = slice(4 * i, 4 * i + 4)
        part = jax.device_get(s.run_from(
            tiny.params, jax.random.fold_in(key, i),
            jax.tree_util.tree_map(lambda x: x[rows], s.env_state), s.group_id[rows],
            jnp.float32(1.0)))
        leaves_equal(jax.tree_util.tree_map(lambda x: x[rows], out[4]), part)
    np.testing.assert_array_equal(out[4][0].group_id, today[0].group_id)
    assert evaluate.summarize(*out[4], 2).keys() == evaluate.summarize(*today, 2).keys()
    with pytest.raises(ValueError, match="batch_size 3"):
        evaluate.make_eval_set("FrozenLake", env, tiny.tokenizer, tiny.cfg, batch_size=3, **kw)


def _config(**changes):
    c = frozenlake.get_config("tiny")
    base = dict(rollout__env_groups=4, rollout__group_size=2, val__env_groups=8,
                algorithm__ppo_mini_batch_size=8, algorithm__micro_batch_size=8,
                trainer__fast_compile=True)
    return with_changes(c, **{**base, **changes})


def test_a_training_batch_in_chunks_is_the_same_batch(tiny):
    # (one chunk of the whole batch is the same call as 0: test_an_eval_set_in_chunks_...)
    exps = {n: experiment.build(_config(rollout__batch_size=n, val__batch_size=n))
            for n in (0, 4)}
    key = jax.random.key(3)
    outs = {}
    for n, exp in exps.items():
        state, group_id = exp.initial_states(jax.random.key(0), jnp.int32(16))
        outs[n] = jax.device_get(exp.run_rollout(exp.policy.params, key, state, group_id,
                                                 jnp.float32(1.0)))
    t0, t4 = outs[0][0], outs[4][0]
    # whole groups in the batch's order, group ids as ever
    np.testing.assert_array_equal(t4.group_id, t0.group_id)
    assert t4.group_id.tolist() == [16, 16, 17, 17, 18, 18, 19, 19]
    exp = exps[4]
    assert exp.rollout.context == t4.tokens.shape[1]
    state, group_id = exp.initial_states(jax.random.key(0), jnp.int32(16))
    part = jax.device_get(exp.run_chunk(exp.policy.params, jax.random.fold_in(key, 1),
                                        jax.tree_util.tree_map(lambda x: x[4:], state),
                                        group_id[4:], jnp.float32(1.0)))
    leaves_equal(jax.tree_util.tree_map(lambda x: x[4:], outs[4]), part)
    # a validation chunk of the training chunk's size plays on the training's program
    vs = exps[4].val_sets["FrozenLake"]
    assert vs.run_from is exps[4].run_chunk and vs.batch_size == 4


@pytest.mark.parametrize("changes, key", [
    (dict(rollout__batch_size=3), "rollout.batch_size"),
    (dict(rollout__batch_size=16), "rollout.batch_size"),
    (dict(val__batch_size=3), "val.batch_size"),
    (dict(rollout__batch_size=4, env__mix="FrozenLake:2,Bandit:2"), "rollout.batch_size"),
])
def test_chunks_must_be_whole_groups_dividing_the_batch(changes, key):
    with pytest.raises(run_config.ConfigError, match=key.replace(".", r"\.")):
        config_check.check(_config(**changes))
