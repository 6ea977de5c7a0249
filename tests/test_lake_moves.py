"""experiments/lake_moves.py (move accuracy of a FrozenLake run) against slow references: a
Python BFS for the labels, a forward pass over each reply's prefix alone for the policy's answer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import frozenlake
from experiments import lake_moves
from starpo import model as model_lib
from starpo import experiment, run_config
from tests.test_solvers import LAKE_DELTAS, lake_bfs, lake_target


def test_move_accuracy_of_a_tiny_policy():
    config = frozenlake.get_config("tiny")
    policy = experiment.load_policy(config)
    r = lake_moves.score(config, policy, levels=12, eps=0.5, seed=3)
    m = r["moves"]
    answers = lake_moves.answer_tokens(run_config.make_env(config, "FrozenLake"), policy.tokenizer)
    n, live = config.env.options.size, m["live"]
    assert live.sum() > 20 and len(set(m["move"][live].tolist())) == 4  # random moves too
    tokens, turn_end = m["tokens"], m["turn_end"]
    rows = list(zip(*np.nonzero(live)))
    # the policy's answer: the model on each reply's prefix alone (the rest of the row blanked)
    T = tokens.shape[1]
    cut = np.array([turn_end[b, k] for b, k in rows])
    prefixes = np.where(np.arange(T)[None] < cut[:, None], tokens[[b for b, _ in rows]], 0)
    logits, _ = jax.jit(lambda p, x, v: model_lib.forward(p, policy.cfg, x, v))(
        policy.params, jnp.asarray(prefixes), jnp.asarray(np.arange(T)[None] < cut[:, None]))
    choices = np.argmax(np.asarray(logits)[np.arange(len(rows)), cut - 1][:, answers], -1)
    right = []
    for (b, k), choice in zip(rows, choices):
        grid, pos = m["grid"][b].tolist(), tuple(m["pos"][b, k])
        d = lake_bfs(grid, pos)
        assert m["distance"][b, k] == d > 0
        closer = [a for a in range(4) if lake_bfs(grid, lake_target(n, *pos, a)) == d - 1]
        assert np.flatnonzero(m["optimal"][b, k]).tolist() == closer
        # the scripted reply is the move played, and the next turn starts where it led
        assert tokens[b, turn_end[b, k]] == answers[m["move"][b, k]]
        if k + 1 < live.shape[1] and live[b, k + 1]:
            dr, dc = LAKE_DELTAS[m["move"][b, k]]
            assert tuple(m["pos"][b, k + 1]) == (min(max(pos[0] + dr, 0), n - 1),
                                                 min(max(pos[1] + dc, 0), n - 1))
        assert choice == m["choice"][b, k]
        right.append(choice in closer)
    assert r["accuracy"] == round(float(np.mean(right)), 3)
    turns = np.nonzero(live)[1]
    assert r["by_turn"][0] == round(float(np.mean([x for x, k in zip(right, turns) if k == 0])), 3)


def test_only_answers_a_first_token_can_score():
    config = frozenlake.get_config("tiny")
    config.unlock()
    config.env.options.is_slippery = True
    with pytest.raises(ValueError, match="not a non-slippery FrozenLake"):
        lake_moves.play_levels(config, None, 4, 0.0, 0)
    config.env.options.is_slippery = False
    config.rollout.enable_think = True
    with pytest.raises(ValueError, match="thinks before it answers"):
        lake_moves.play_levels(config, None, 4, 0.0, 0)
