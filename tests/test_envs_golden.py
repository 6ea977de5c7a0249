"""The envs against the reference's recorded episodes (tests/env_fixtures, see its README)."""

import functools
import json
import pathlib

import jax
import numpy as np
import pytest

import envs

FIXTURES = pathlib.Path(__file__).parent / "env_fixtures"


def _load(name):
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))


SOKOBAN = _load("sokoban_golden.json")
FROZEN_LAKE = _load("frozen_lake_golden.json")
BANDIT = _load("bandit_golden.json")
PROMPTS = _load("prompts_prefix.json")


@functools.lru_cache(maxsize=None)
def _jitted_step(env):
    return jax.jit(env.step)


def _sokoban_env(config):
    name = "SimpleSokoban" if config["dim_x"] == 6 else "LargerSokoban"
    return envs.make(
        name,
        dim_x=config["dim_x"],
        dim_y=config["dim_y"],
        num_boxes=config["num_boxes"],
        max_steps=config["max_steps"],
    )


@pytest.mark.parametrize("case", SOKOBAN["cases"], ids=lambda c: c["name"])
def test_sokoban_replays_golden_trace(case):
    env = _sokoban_env(case["config"])
    state = env.from_text(case["initial_text"])
    assert env.to_text(state) == case["initial_text"]
    assert list(np.asarray(state.player)) == case["initial_player"]
    step = _jitted_step(env)
    key = jax.random.key(0)
    for t, rec in enumerate(case["steps"], 1):
        state, reward, done, info = step(key, state, rec["action"])
        where = f"{case['name']} step {t}"
        assert float(reward) == pytest.approx(rec["reward"], abs=1e-6), where
        assert bool(done) == rec["done"], where
        assert bool(info["success"]) == rec["success"], where
        assert bool(info["action_is_effective"]) == rec["action_is_effective"], where
        assert env.to_text(state) == rec["text"], where
        assert list(np.asarray(state.player)) == rec["player"], where
        assert int(env._boxes_on_target(state)) == rec["boxes_on_target"], where


def test_solver_finds_the_reference_solution_lengths():
    """The reference's recorded `solution` episodes are its BFS-optimal plans."""
    solutions = [c for c in SOKOBAN["cases"] if c["name"].endswith("_solution")]
    assert len(solutions) == 4
    for case in solutions:
        env = _sokoban_env(case["config"])
        state = env.from_text(case["initial_text"])
        assert envs.solve(state) == len(case["steps"]), case["name"]


@pytest.mark.parametrize("case", FROZEN_LAKE["cases"], ids=lambda c: c["name"])
def test_frozen_lake_replays_golden_trace(case):
    size = len(case["map"])
    env = envs.make("FrozenLake", size=size, is_slippery=case["is_slippery"])
    state = env.from_map(case["map"])
    assert env.to_text(state) == case["initial_text"]
    assert env.from_text(case["initial_text"]).pos.tolist() == case["initial_pos"]
    step = _jitted_step(env)
    key = jax.random.key(0)  # every recorded case is deterministic (not slippery)
    for t, rec in enumerate(case["steps"], 1):
        state, reward, done, info = step(key, state, rec["action"])
        where = f"{case['name']} step {t}"
        assert float(reward) == pytest.approx(rec["reward"], abs=1e-6), where
        assert bool(done) == rec["done"], where
        assert bool(info["success"]) == rec["success"], where
        assert bool(info["action_is_effective"]) == rec["action_is_effective"], where
        assert env.to_text(state) == rec["text"], where
        assert state.pos.tolist() == rec["pos"], where


def test_frozen_lake_matches_gymnasium_slippery_transition_table():
    """Every (state, action, slip) of the classic map lands where gymnasium's table says."""
    table = FROZEN_LAKE["slippery_transition_table"]
    env = envs.make("FrozenLake", size=4, is_slippery=True)
    base = env.from_map(table["map"])
    cases = []
    for s, per_action in table["P"].items():
        for action, outcomes in per_action.items():
            # Outcomes are listed for gymnasium directions (a-1)-1, a-1, (a-1)+1: slips -1, 0, +1.
            for slip, (prob, s_next, reward, terminated) in zip((-1, 0, 1), outcomes):
                assert prob == pytest.approx(1 / 3)
                cases.append((int(s), int(action), slip, s_next, reward, terminated))
    s, a, slip, s_next, reward, terminated = map(np.array, zip(*cases))
    states = base.replace(
        grid=np.broadcast_to(np.asarray(base.grid), (len(s), 4, 4)),
        pos=np.stack([s // 4, s % 4], axis=1).astype(np.int32),
    )
    moved, rew, done, _ = jax.jit(jax.vmap(env.move))(states, a, slip)
    pos = np.asarray(moved.pos)
    np.testing.assert_array_equal(pos[:, 0] * 4 + pos[:, 1], s_next)
    # gymnasium lists terminal cells (holes, goal) as absorbing: same cell, reward 0.
    np.testing.assert_allclose(np.asarray(rew), reward, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(done), terminated)


@pytest.mark.parametrize("case", BANDIT["cases"], ids=lambda c: f"{c['tag']}-{c['seed']}")
def test_bandit_matches_golden_outcomes(case):
    env = envs.make(case["tag"])
    assert env.action_names == (case["config"]["lo_arm_name"], case["config"]["hi_arm_name"])
    # The arm order is the only state: load it from the recorded prompt.
    state = env.from_text(case["initial_text"])
    assert env.to_text(state) == case["initial_text"]
    for action, rec in case["steps"].items():
        arm = case["action_lookup"][action]
        assert env.action_names[int(env.arm_order(state)[int(action) - 1])] == arm
        assert int(env.name_to_action(state, env.action_names.index(arm))) == int(action)
        high = arm == env.high_arm
        # The payout is random; replay it by searching keys for the recorded outcome.
        for i in range(64):
            new, reward, done, info = env.step(jax.random.key(i), state, int(action))
            if float(reward) == pytest.approx(rec["reward"], abs=1e-6):
                break
        else:
            pytest.fail(f"no key reproduces reward {rec['reward']} for {arm}")
        assert bool(done) == rec["done"]
        assert bool(info["success"]) == rec["success"] == high
        assert bool(info["action_is_effective"]) == rec["action_is_effective"]
        assert env.to_text(new) == rec["text"]


def test_text_metadata_rebuilds_reference_prompt_prefix():
    """instruction + legend + action names give the reference's first-message prefix exactly."""
    for tag, expected in PROMPTS["prefix_env_instruction"].items():
        env = envs.make(tag)
        if not env.instruction:  # Bandit: the reference sends no instruction, legend or actions
            assert expected == "" and env.legend == ""
            continue
        prefix = (
            f"{env.instruction}\nThe meaning of each symbol in the state is:\n{env.legend}\n"
            f"Your available actions are:\n{', '.join(env.action_names)}\n"
            'You can make up to 10 actions, separated by the action separator " || "\n'
        )
        assert prefix == expected, tag
    vocab = envs.make("SokobanDifferentGridVocab")
    assert vocab.legend == (
        "W: wall, .: empty, G: target, C: box on target, B: box, A: player, @: player on target"
    )
    assert vocab.instruction == envs.make("SimpleSokoban").instruction


def test_symbol_tables_render_every_code():
    """render_codes + symbols reproduce to_text, for both Sokoban vocabularies."""
    text = SOKOBAN["cases"][3]["initial_text"]  # has a player on a target
    for name in ("SimpleSokoban", "SokobanDifferentGridVocab"):
        env = envs.make(name, dim_x=8, dim_y=8, num_boxes=2)
        translated = text.translate(str.maketrans("".join(envs.sokoban.SYMBOLS), "".join(env.symbols)))
        state = env.from_text(translated)
        codes = np.asarray(env.render_codes(state))
        assert "\n".join("".join(env.symbols[c] for c in row) for row in codes) == translated
        assert env.to_text(state) == translated
    assert envs.make("SokobanDifferentGridVocab").symbols == ("W", ".", "G", "C", "B", "A", "@")
    assert envs.make("FrozenLake").symbols == ("_", "O", "G", "P", "X", "√")
