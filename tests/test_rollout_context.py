"""The KV cache and the Trajectory are as long as an episode can get, not `max_context`.

`rollout.context_length`: the prompt prefix plus max_turn x (observation chunk + reply budget),
rounded up to a multiple of 64, where that is shorter than max_context. Any max_context at or
above that length gives the same program and the same numbers bit for bit. A longer buffer would
only hold padding: the same rollout with the old, max_context-long buffer writes the same
tokens and rewards, and nothing past the short buffer's end; its log-probs agree to float32
rounding (attention sums over more masked slots: bit-equal with jax 0.10.2, 1 ulp apart in a few
places with jax 0.7.1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from starpo import rollout

TURNS, N_TOKENS, GROUPS, GROUP_SIZE = 2, 10, 2, 2


@pytest.fixture(scope="module")
def tiny():
    from starpo import weights
    return weights.load_model("tiny:layers=1,hidden=32,heads=2,kv_heads=1,head_dim=16,mlp=64")


def _rollout(m, max_context):
    spec = rollout.RolloutSpec(max_turn=TURNS, max_new_tokens=N_TOKENS, max_context=max_context)
    return rollout.make_rollout(envs.make("FrozenLake"), m.tokenizer, m.cfg, spec,
                                env_groups=GROUPS, group_size=GROUP_SIZE)


def _run(m, max_context):
    r = _rollout(m, max_context)
    out = r.run(m.params, jax.random.key(3), jnp.int32(0), jnp.float32(1.0),
                jnp.int32(rollout.TRAIN))
    return r, jax.device_get(out)


def test_the_buffers_hold_what_an_episode_can_reach_and_nothing_else(tiny, monkeypatch):
    # a max_context two multiples above what an episode reaches (built, not run, to read it):
    # longer would only make the old-buffer run below slower
    big = _rollout(tiny, 4096).context + 2 * rollout.CONTEXT_MULTIPLE
    r, (traj, metrics) = _run(tiny, big)
    T = r.context
    assert T % rollout.CONTEXT_MULTIPLE == 0 and T < big
    assert traj.tokens.shape[1] == T and not metrics["truncated"].any()
    # the reachable length itself as max_context: the same program, the same numbers
    r2, again = _run(tiny, T)
    assert r2.context == T
    for a, b in zip(jax.tree_util.tree_leaves((traj, metrics)), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(a, b)
    # the old buffers, max_context long: the same episodes, padding beyond T
    monkeypatch.setattr(rollout.models, "context_length", lambda setup: setup.spec.max_context)
    r3, (old, old_metrics) = _run(tiny, big)
    assert r3.context == big and old.tokens.shape[1] == big
    for name in ("tokens", "loss_mask", "turn_index", "sample_logprobs"):
        a, b = getattr(traj, name), getattr(old, name)
        if name == "sample_logprobs":
            np.testing.assert_allclose(a, b[:, :T], rtol=1e-6, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b[:, :T], err_msg=name)
        assert not b[:, T:].any() if name != "turn_index" else (b[:, T:] == -1).all(), name
    for name in ("turn_end", "turn_reward", "penalty", "success", "num_actions", "group_id",
                 "length"):
        np.testing.assert_array_equal(getattr(traj, name), getattr(old, name), err_msg=name)
    for name in metrics:
        np.testing.assert_array_equal(metrics[name], old_metrics[name], err_msg=name)
