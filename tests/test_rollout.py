"""A full rollout of a tiny random model: one compiled program, no host transfer, one trace."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from starpo import dialogue, rollout, weights
from starpo.trajectory import check_trajectory

GROUPS, GROUP_SIZE, TURNS, N_TOKENS, CONTEXT = 8, 8, 3, 12, 768


@pytest.fixture(scope="module")
def setup():
    m = weights.load_model("tiny:layers=1,hidden=32,heads=2,kv_heads=1,head_dim=16,mlp=64")
    env = envs.make("FrozenLake")
    spec = rollout.RolloutSpec(max_turn=TURNS, max_new_tokens=N_TOKENS, max_context=CONTEXT)
    r = rollout.make_rollout(env, m.tokenizer, m.cfg, spec, env_groups=GROUPS,
                             group_size=GROUP_SIZE)
    traces = []
    inner = r.play

    def counted(*args):
        traces.append(1)
        return inner(*args)

    run = jax.jit(counted)
    args = (m.params, jax.random.key(1), jnp.int32(0), jnp.float32(1.0), jnp.int32(rollout.TRAIN))
    first = jax.block_until_ready(run(*args))
    args2 = jax.device_put((m.params, jax.random.key(2), jnp.int32(GROUPS), jnp.float32(1.0),
                            jnp.int32(rollout.TRAIN)))
    with jax.transfer_guard("disallow"):
        second = jax.block_until_ready(run(*args2))
    return m, env, r, first, second, traces


def test_traces_once_and_runs_without_host_transfer(setup):
    *_, traces = setup
    assert len(traces) == 1


def test_trajectory_contract(setup):
    m, env, r, first, second, _ = setup
    for traj, metrics in (first, second):
        check_trajectory(traj, GROUP_SIZE)
        t = jax.device_get(traj)
        assert t.tokens.shape == (GROUPS * GROUP_SIZE, CONTEXT)
        # every row played at least one turn; the log-probs live exactly on the model's tokens
        assert (t.turn_end[:, 0] >= 0).all()
        assert (t.sample_logprobs[~t.loss_mask] == 0).all()
        assert (t.sample_logprobs[t.loss_mask] < 0).all()
        mt = jax.device_get(metrics)
        assert (mt["num_turns"] >= 1).all() and (mt["num_turns"] <= TURNS).all()
        assert (mt["response_length"] == t.loss_mask.sum(1)).all()
        # a random model rarely writes a valid answer: every turn without one is penalised
        np.testing.assert_allclose(t.penalty, rollout.FORMAT_PENALTY * mt["format_errors"], atol=1e-6)
        assert (t.num_actions <= mt["num_valid_actions"]).all()


def test_dialogue_decodes_to_the_observations(setup):
    m, env, r, first, _, _ = setup
    traj, _ = first
    tok = m.tokenizer
    t = jax.device_get(traj)
    b = 0
    text = tok.decode(t.tokens[b, :t.length[b]].tolist())
    assert text.startswith(tok.apply_chat_template(
        [{"role": "system", "content": dialogue.SYSTEM_PROMPT},
         {"role": "user", "content": r.text.prefix + "\nTurn 1:\nState:\n"}],
        add_generation_prompt=False).split("\nTurn 1:\nState:\n")[0])
    turns = int((t.turn_end[b] >= 0).sum())
    for k in range(1, turns):
        assert f"\nTurn {k + 1}:\nState:\n" in text
    # the model's tokens are contiguous runs, one per turn, each ending at turn_end
    mask = t.loss_mask[b]
    ends = [i for i in range(len(mask) - 1) if mask[i] and not mask[i + 1]]
    if mask[-1]:
        ends.append(len(mask) - 1)
    assert ends == [int(e) for e in t.turn_end[b] if e >= 0]


def test_groups_share_initial_states_and_seeds_advance(setup):
    m, env, r, first, second, _ = setup
    g1 = np.asarray(first[0].group_id)
    g2 = np.asarray(second[0].group_id)
    assert len(set(g1) & set(g2)) == 0
    # one initial state per group: the first observation (up to the first model token) is
    # the same within a group and differs between most groups
    t = jax.device_get(first[0])
    prompts = [t.tokens[b, :int(np.argmax(t.loss_mask[b]))].tobytes() for b in range(len(g1))]
    for g in range(GROUPS):
        assert len(set(prompts[g * GROUP_SIZE:(g + 1) * GROUP_SIZE])) == 1
    assert len(set(prompts)) > GROUPS // 2
    # validation levels come from another seed stream
    init = jax.jit(lambda stream: rollout.initial_states(env, jax.random.key(0), 0, stream,
                                                         GROUPS, 1)[0])
    train, val = (jax.device_get(init(jnp.int32(s))) for s in (rollout.TRAIN, rollout.VALIDATION))
    same = (train.grid == val.grid).all(axis=(1, 2)) & (train.pos == val.pos).all(axis=1)
    assert same.sum() < GROUPS // 2


def test_context_overflow_ends_cleanly(setup):
    # CONTEXT holds two turns of this setup, not three: every episode stops, marked truncated,
    # with a valid trajectory (checked above) that fits the context.
    _, _, _, (traj, metrics), _, _ = setup
    t, mt = jax.device_get((traj, metrics))
    assert mt["truncated"].all()
    assert (mt["num_turns"] == 2).all() and (t.turn_end[:, 2] == -1).all()
    assert (t.length <= CONTEXT).all() and (mt["context_used"] == t.length).all()


def test_single_turn_groups_share_their_prompt_and_play_as_without():
    """The Bandit (one turn) in groups of 4: each group's prompt runs through the model once
    (`Rollout.share`); the episodes equal those of every row appending its own prompt."""
    m = weights.load_model("tiny:layers=1,hidden=32,heads=2,kv_heads=1,head_dim=16,mlp=64")
    spec = rollout.RolloutSpec(max_turn=1, max_new_tokens=6, max_context=640)
    out = []
    for share_groups in (True, False):
        r = rollout.make_rollout(envs.make("Bandit"), m.tokenizer, m.cfg, spec, env_groups=3,
                                 group_size=4, share_groups=share_groups)
        assert r.share == (4 if share_groups else 1)
        out.append(jax.device_get(r.run(m.params, jax.random.key(1), jnp.int32(0),
                                        jnp.float32(1.0), jnp.int32(rollout.TRAIN))))
    tokens = out[0][0].tokens
    assert len({tuple(t) for t in tokens[:4]}) > 1  # a group's rows sample apart
    for shared, each in zip(*(jax.tree_util.tree_leaves(o) for o in out)):
        if each.dtype.kind == "f":
            np.testing.assert_allclose(shared, each, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(shared, each)
    # a multi-turn rollout's later turns differ per row: nothing is shared there
    multi = rollout.make_rollout(envs.make("Bandit"), m.tokenizer, m.cfg,
                                 dataclasses.replace(spec, max_turn=2), env_groups=3,
                                 group_size=4)
    assert multi.share == 1
