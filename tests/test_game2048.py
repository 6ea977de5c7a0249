"""2048 against RAGEN-2's text, rules and rewards (tests/env_fixtures/game2048_golden.json), the
slide-and-merge rules against a NumPy loop of the reference's `_compress_and_merge` on random
boards, the generator, the greedy solver and the bad options."""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from envs import game2048, solvers
from envs import text as env_text
from starpo import rollout, scripted

GOLDEN = json.loads((pathlib.Path(__file__).parent / "env_fixtures" / "game2048_golden.json")
                    .read_text(encoding="utf-8"))
TILE = np.vectorize(game2048.tile)


@functools.lru_cache(maxsize=None)
def _env():
    return envs.make("Game2048")


@functools.lru_cache(maxsize=None)
def _batched_step():
    env = _env()
    return jax.jit(jax.vmap(env.step))


@functools.lru_cache(maxsize=None)
def _batched_moves():
    return jax.jit(jax.vmap(game2048.all_moves))


def _exponents(board):
    b = np.asarray(board)
    return np.where(b > 0, np.log2(np.maximum(b, 1)), 0).astype(np.int32)


def _state(board, score=0):
    return game2048.Game2048State(grid=jnp.asarray(_exponents(board)),
                                  score=jnp.asarray(score, jnp.int32))


def _stack(states):
    return jax.tree_util.tree_map(lambda *x: np.stack(x), *states)


# ------------------------------------------------------------------ the reference's text
def test_text_is_the_reference():
    env = _env()
    assert env.instruction == GOLDEN["env_instruction"]
    etext = env_text.make_text(env)
    names = [GOLDEN["action_lookup"][str(i)] for i in range(4)]
    assert list(env.action_names) == names
    assert etext.prefix == (GOLDEN["env_instruction"] + "\nYour available actions are:\n"
                            + ", ".join(names) + f"\nYou can make up to "
                            f"{GOLDEN['max_actions_per_traj']} actions, separated by the action "
                            "separator \" || \"\n")
    assert (etext.max_actions_per_turn, etext.max_actions_per_traj) == (
        GOLDEN["agent_proxy"]["max_actions_per_turn"], GOLDEN["max_actions_per_traj"])
    for c in GOLDEN["cases"]:
        state = _state(c["board"], c["score"])
        assert env.to_text(state) == c["text"]
        env_text.check_render(etext, env, state)
        back = env.from_text(c["text"])
        assert np.array_equal(np.asarray(back.grid), np.asarray(state.grid))
        assert int(back.score) == c["score"]
    # the largest tile and score the text can show render too
    big = game2048.Game2048State(grid=jnp.arange(1, 17, dtype=jnp.int32).reshape(4, 4),
                                 score=jnp.asarray(10 ** env.score_digits - 1, jnp.int32))
    env_text.check_render(etext, env, big)


def test_rewards_and_infos_of_recorded_moves():
    env = _env()
    cases = GOLDEN["cases"]
    ids = {n: i + 1 for i, n in enumerate(env.action_names)}
    states = _stack([_state(c["board"], c["score"]) for c in cases])
    actions = np.array([ids[c["action"]] for c in cases], np.int32)
    keys = jax.random.split(jax.random.key(0), len(cases))
    new, reward, done, info = _batched_step()(keys, states, actions)
    for i, c in enumerate(cases):
        where = f"{c['action']} on {c['board']}"
        assert float(reward[i]) == pytest.approx(c["reward"], abs=1e-6), where
        assert bool(info["action_is_valid"][i]) == c["action_is_valid"], where
        assert bool(info["action_is_effective"][i]) == c["action_is_effective"], where
        assert int(new.score[i]) == c["score_after"], where
        got = TILE(np.asarray(new.grid[i]))
        slid = np.asarray(c["after_slide"])
        if c["action_is_valid"]:  # the slide, then one 2 or 4 on a cell the slide left empty
            diff = np.argwhere(got != slid)
            assert len(diff) == 1 and slid[tuple(diff[0])] == 0, where
            assert got[tuple(diff[0])] in (2, 4), where
        else:
            assert np.array_equal(got, slid), where
        # the end and the success follow the reference's rule on the reference's own board
        # (a move that changes nothing never ends the reference's game, even on a finished
        # board; here a finished board is done whatever the action: docs/envs_sudoku_2048.md)
        ref_after = _state(c["board_after"])
        assert bool(env.is_done(ref_after)) == c["done"] or not c["action_is_valid"], where
        assert bool(done[i]) == bool(env.is_done(jax.tree_util.tree_map(lambda x: x[i], new)))
        assert c["success"] == (c["done"] and max(map(max, c["board_after"])) >= 2048), where
        if c["action_is_valid"] and np.array_equal(got, np.asarray(c["board_after"])):  # same spawn
            assert bool(done[i]) == c["done"] and bool(info["success"][i]) == c["success"], where


def test_finished_games_absorb_and_unknown_ids_do_nothing():
    env = _env()
    over = _state([[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [4, 2, 4, 2]], 7)
    live = _state([[2, 2, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    states = _stack([over, over, live, live])
    actions = np.array([1, 4, 0, 5], np.int32)
    new, reward, done, info = _batched_step()(jax.random.split(jax.random.key(1), 4), states,
                                               actions)
    assert np.array_equal(np.asarray(new.grid), np.asarray(states.grid))
    assert np.all(np.asarray(reward) == 0)
    assert list(np.asarray(done)) == [True, True, False, False]
    assert not np.any(np.asarray(info["action_is_valid"]))
    assert not np.any(np.asarray(info["success"]))
    # without the log transform a board-preserving move pays the raw invalid score
    raw = envs.make("Game2048", use_log_reward=False)
    _, r, _, _ = raw.step(jax.random.key(0), live, 1)  # Up: nothing moves
    assert float(r) == pytest.approx(-0.1)
    _, r, _, _ = raw.step(jax.random.key(0), live, 4)  # Left: 2 + 2 merge
    assert float(r) == pytest.approx(4.0)


# ------------------------------------------------------------------ the rules vs NumPy
@pytest.mark.parametrize("line,want,gain", [
    ([2, 2, 2, 2], [4, 4, 0, 0], 8),
    ([2, 2, 4, 0], [4, 4, 0, 0], 4),
    ([4, 4, 4, 0], [8, 4, 0, 0], 8),
    ([2, 0, 2, 2], [4, 2, 0, 0], 4),
    ([0, 0, 0, 2], [2, 0, 0, 0], 0),
    ([4, 2, 2, 4], [4, 4, 4, 0], 4),
    ([8, 8, 16, 16], [16, 32, 0, 0], 48),
])
def test_classic_merges(line, want, gain):
    rows, g = game2048.slide_left(jnp.asarray(_exponents([line])))
    assert list(TILE(np.asarray(rows[0]))) == want
    assert int(g[0]) == gain


def test_moves_match_a_numpy_loop_of_the_reference_on_random_boards():
    rng = np.random.default_rng(0)
    n = 600
    # few distinct small tiles and many blanks, so that lines merge and slide a lot
    exps = np.where(rng.random((n, 4, 4)) < 0.35, 0, rng.integers(1, 4, (n, 4, 4)))
    exps[: n // 3] = rng.integers(0, 12, (n // 3, 4, 4))  # and some wide-ranging boards
    grids, gains, moved = _batched_moves()(jnp.asarray(exps, jnp.int32))
    grids, gains, moved = np.asarray(grids), np.asarray(gains), np.asarray(moved)
    for b in range(n):
        for d in range(4):
            want, gain, did = game2048.reference_move(TILE(exps[b]), d)
            assert np.array_equal(TILE(grids[b, d]), want), (exps[b].tolist(), d)
            assert gains[b, d] == gain and moved[b, d] == did, (exps[b].tolist(), d)


# ------------------------------------------------------------------ the generator
def test_reset_spawns_two_tiles_as_the_reference():
    env = _env()
    n = 4096
    states = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.key(3), n))
    grid = np.asarray(states.grid)
    assert np.all((grid > 0).sum(axis=(1, 2)) == 2)
    assert set(np.unique(grid)) <= {0, 1, 2}
    assert np.all(np.asarray(states.score) == 0)
    frac4 = (grid == 2).sum() / (2 * n)  # reference: 0.1 (0.098 over 2000 of its resets)
    assert abs(frac4 - (1 - GOLDEN["two_prob"])) < 0.02
    assert abs(GOLDEN["start_tiles"]["fraction_of_4s"] - frac4) < 0.03
    assert GOLDEN["start_tiles"]["tiles_per_reset"] == [2]
    per_cell = (grid > 0).mean(axis=0)  # uniform: 2 / 16 per cell
    assert np.all(np.abs(per_cell - 2 / 16) < 0.03), per_cell


def test_spawn_fills_only_empty_cells_uniformly():
    grid = jnp.asarray(_exponents([[2, 0, 2, 0], [2, 2, 2, 2], [0, 2, 2, 2], [2, 2, 2, 2]]))
    out = jax.jit(jax.vmap(lambda k: game2048.spawn(k, grid, 0.9)))(
        jax.random.split(jax.random.key(5), 3000))
    changed = np.asarray(out) != np.asarray(grid)[None]
    assert np.all(changed.sum(axis=(1, 2)) == 1)
    counts = changed.sum(axis=0)[np.asarray(grid) == 0]
    assert counts.sum() == 3000 and np.all(np.abs(counts / 3000 - 1 / 3) < 0.04), counts
    full = jnp.ones((4, 4), jnp.int32)
    assert np.array_equal(np.asarray(game2048.spawn(jax.random.key(0), full, 0.9)), np.ones((4, 4)))


# ------------------------------------------------------------------ dialogue
def _reference_message(text, max_tokens=100):
    prefix = env_text.make_text(_env()).prefix
    return (prefix + "\nTurn 1:\n" + "State:\n" + text
            + "\nYou have 700 actions left. Always output: <think> [Your thoughts] </think> "
            "<answer> [your answer] </answer> with no extra text. Strictly follow this format. "
            f"Max response length: {max_tokens} words (tokens).\n")


def test_dialogue_text_and_rewards(tiny_tokenizer):
    """The scripted rollout (launch/play.py's path): the first message over the reference's
    prefix and render, the reward of the move, the format penalty where no name parsed."""
    tok, env = tiny_tokenizer, _env()
    board = GOLDEN["cases"][0]
    replies = [  # (reply after the <think> prime, turn reward, penalty, actions)
        ("merge</think><answer>Left</answer>", board["reward"] if board["action"] == "Left"
         else None, 0.0, 1),
        ("x</think><answer>Jump</answer>", 0.0, -0.1, 0),
    ]
    left = [c for c in GOLDEN["cases"] if c["board"] == board["board"] and c["action"] == "Left"]
    replies[0] = (replies[0][0], left[0]["reward"], 0.0, 1)
    spec = rollout.RolloutSpec(max_turn=1, max_new_tokens=32, max_context=1024, length_prompt=100)
    play, _ = rollout.make_scripted_rollout(env, tok, spec)
    states = _stack([_state(board["board"], board["score"])] * len(replies))
    ids, lens, stops = scripted.script_replies(tok, [[r[0]] for r in replies], 1, 32)
    traj, metrics, _ = play(states, ids, lens, stops, jax.random.key(0))
    for b, (reply, reward, penalty, acts) in enumerate(replies):
        msgs = [{"role": "system", "content": "You're a helpful assistant. "},
                {"role": "user", "content": _reference_message(board["text"])}]
        want = tok.apply_chat_template(msgs, add_generation_prompt=True) + "<think>" + reply
        n = int(traj.length[b])
        assert tok.decode(np.asarray(traj.tokens[b, :n]).tolist()) == want, reply
        assert float(traj.turn_reward[b, 0]) == pytest.approx(reward, abs=1e-5), reply
        assert float(traj.penalty[b]) == pytest.approx(penalty, abs=1e-6), reply
        assert int(traj.num_actions[b]) == acts


# ------------------------------------------------------------------ the solver
def test_greedy_solver_takes_the_biggest_merge_and_never_wastes_a_move():
    env = _env()
    assert solvers.has_solver(env)
    # Left and Right merge 2+2 and 8+8 (20); Up/Down merge nothing: the first of Right, Left
    s = _state([[2, 2, 8, 8], [0, 0, 0, 0], [0, 0, 0, 0], [4, 0, 0, 0]])
    names, n = solvers.next_moves(env, s, 2)
    assert int(n) == 1 and env.action_names[int(names[0])] == "Right"
    over = _state([[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [4, 2, 4, 2]])
    assert int(solvers.next_moves(env, over, 1)[1]) == 0
    assert float(solvers.solver_success(env, over)) == 0.0

    @jax.jit
    def play(key):
        def body(carry, k):
            state, invalid = carry
            names, m = solvers.next_moves(env, state, 1)
            action = env.name_to_action(state, names[0])
            new, _, done, info = env.step(k, state, action)
            return (new, invalid + ((m > 0) & ~info["action_is_valid"])), None
        k0, k1 = jax.random.split(key)
        (state, invalid), _ = jax.lax.scan(body, (env.reset(k0), 0), jax.random.split(k1, 200))
        return state, invalid

    state, invalid = jax.vmap(play)(jax.random.split(jax.random.key(7), 16))
    assert int(jnp.sum(invalid)) == 0
    assert float(np.mean(np.asarray(state.score))) > 500  # well above random play


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("options,words", [
    (dict(size=5), "size"), (dict(size=1), "size"), (dict(size=4.0), "size"),
    (dict(two_prob=1.5), "two_prob"), (dict(two_prob="x"), "two_prob"),
    (dict(use_log_reward="yes"), "use_log_reward"), (dict(invalid_act_score=None), "invalid_act_score"),
    (dict(blanks=3), "unknown option"),
])
def test_bad_options_are_one_line_errors(options, words):
    with pytest.raises(ValueError, match=words) as err:
        envs.make("Game2048", **options)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text", [
    "Row 1: [2, 0, 0, 0]",
    "Row 1: [2, 0, 0]\nRow 2: [0, 0, 0, 0]\nRow 3: [0, 0, 0, 0]\nRow 4: [0, 0, 0, 0]",
    "Row 1: [3, 0, 0, 0]\nRow 2: [0, 0, 0, 0]\nRow 3: [0, 0, 0, 0]\nRow 4: [0, 0, 0, 0]",
    "Row 1: [1, 0, 0, 0]\nRow 2: [0, 0, 0, 0]\nRow 3: [0, 0, 0, 0]\nRow 4: [0, 0, 0, 0]",
    "Row 1: [262144, 0, 0, 0]\nRow 2: [0, 0, 0, 0]\nRow 3: [0, 0, 0, 0]\nRow 4: [0, 0, 0, 0]",
])
def test_bad_level_texts_are_errors(text):
    with pytest.raises(ValueError):
        _env().from_text(text)
