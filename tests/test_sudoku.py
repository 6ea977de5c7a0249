"""Sudoku (envs/sudoku.py) against RAGEN-2's own env (tests/env_fixtures/sudoku_golden.json):
its text and rewards step by step, the six answer formats against its regexes (malformed
answers included), the dialogue of a scripted rollout, launch/play.py; the on-device generator
against the rules and the reference's blank counts, the host solver, bad options."""

import functools
import json
import pathlib
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from envs import sudoku
from envs import text as env_text
from starpo import rollout, sampler, scripted

GOLDEN = json.loads((pathlib.Path(__file__).parent / "env_fixtures" / "sudoku_golden.json")
                    .read_text(encoding="utf-8"))
WIDTH = 96  # answer bytes in the env-level tests


@functools.partial(jax.jit, static_argnums=0)
def _generate(n, blanks, seed):
    keys = jax.random.split(jax.random.key(seed), n)
    return jax.vmap(lambda k: sudoku.generate(k, blanks))(keys)


def _batch(n, blanks, seed=0):
    """n levels of `blanks` blanks from the key `seed` (one compiled program per n)."""
    puzzle, solution = _generate(n, jnp.int32(blanks), jnp.uint32(seed))
    return np.asarray(puzzle), np.asarray(solution)


def test_the_reference_blank_counts():
    # generate_sudoku_puzzle's cells_to_remove for a 9x9 and a 4x4 grid
    assert sudoku.BLANKS == {"easy": 32, "medium": 40, "hard": 48}
    assert sudoku.blank_counts(4) == {"easy": 6, "medium": 8, "hard": 9}
    assert envs.make("Sudoku4x4").blanks == 6


def test_4x4_levels_the_solver_and_its_moves():
    """The 4x4 grid (the reference's grid_size 4): generated levels are valid grids with the
    blanks asked for; the jittable solver completes each, the host search's very one where
    that is unique; the solver's moves (`R,C,N` of 64 answers) played through `step` solve
    every level, each paying 1 or 0.5, the last with the completion bonus."""
    env = envs.make("Sudoku4x4")
    assert len(env.move_names) == 64 and env.move_names[:2] == ("1,1,1", "1,1,2")
    names = jnp.asarray(np.array([list(sudoku.answer_bytes(m + "     ")) for m in env.move_names]))

    @jax.jit
    def play(key):
        state = env.reset(key)
        found, ok = sudoku.solve(state.puzzle)

        def turn(state, _):
            moves, n = envs.next_moves(env, state, 1)
            state, reward, done, info = env.step(None, state, names[moves[0]])
            return state, (n, reward, info["action_is_valid"])

        final, per_step = jax.lax.scan(turn, state, None, length=7)
        return state.puzzle, state.solution, found, ok, final.solved, per_step

    puzzle, solution, found, ok, solved, (n, reward, valid) = jax.device_get(
        jax.vmap(play)(jax.random.split(jax.random.key(4), 32)))
    assert len({s.tobytes() for s in solution}) > 8
    for p, s, f in zip(puzzle, solution, found):
        assert p.shape == (4, 4) and sudoku.is_valid_solution(s) and (p == 0).sum() == 6
        assert np.array_equal(p[p != 0], s[p != 0]) and _brute_force_check(p, f)
        count, host = sudoku.count_solutions(p, limit=2)
        if count == 1:
            assert np.array_equal(f, host)
    assert ok.all() and solved.all()
    assert (n[:, :6] == 1).all() and (n[:, 6] == 0).all() and valid[:, :6].all()
    assert np.isin(reward[:, :5], [1.0, 0.5]).all() and np.isin(reward[:, 5], [11.0, 10.5]).all()


@pytest.mark.parametrize("blanks", [0, 32, 40, 81])
def test_levels_are_valid_grids_with_the_blanks_asked_for(blanks):
    puzzle, solution = _batch(128, blanks)
    for p, s in zip(puzzle, solution):
        assert sudoku.is_valid_solution(s)
        assert (p == 0).sum() == blanks
        assert np.array_equal(p[p != 0], s[p != 0])
    # the key decides the level: 128 different solutions, blanks spread over every cell
    assert len({s.tobytes() for s in solution}) == 128
    if 0 < blanks < 81:
        per_cell = (puzzle == 0).mean(axis=0)
        assert per_cell.min() > 0 and per_cell.max() < 1


def test_the_solver_solves_generated_puzzles():
    puzzle, solution = _batch(24, sudoku.BLANKS["easy"], seed=1)
    unique = 0
    for p, s in zip(puzzle, solution):
        n, found = sudoku.count_solutions(p, limit=2)
        assert n >= 1 and sudoku.is_valid_solution(found)
        assert np.array_equal(found[p != 0], p[p != 0])
        unique += n == 1
        if n == 1:
            assert np.array_equal(found, s)
    # 32 random blanks almost always leave one solution (not enforced, as in the reference)
    assert unique >= 20


def test_count_solutions_sees_several_and_none():
    _, solution = _batch(1, 0, seed=2)
    grid = solution[0].copy()
    assert sudoku.count_solutions(grid) == (1, pytest.approx(grid))
    # no clues: many solutions
    empty = np.zeros((9, 9), np.int32)
    assert sudoku.count_solutions(empty, limit=2)[0] == 2
    bad = grid.copy()
    bad[0, 0], bad[0, 1] = 0, grid[0, 0]  # (0, 1)'s new digit repeats in its column
    assert sudoku.count_solutions(bad)[0] == 0


# ------------------------------------------------------------------ the jittable solver
# Puzzles that need the search (Inkala's "hardest", Golden Nugget, a third): propagation of
# singles alone stalls on them (asserted below).
HARD = ("800000000003600000070090200050007000000045700000100030001000068008500010090000400",
        "000000039000001005003050800008090006070002000100400000009080050020000600400700000",
        "100007090030020008009600500005300900010080002600004000300000010040000007007000300")


def _grids(texts):
    return np.array([[int(ch) for ch in t] for t in texts], np.int32).reshape(-1, 9, 9)


@functools.lru_cache(maxsize=None)
def _solve():
    return jax.jit(jax.vmap(sudoku.solve))


def _brute_force_check(puzzle, found):
    """A completion: every row, column and box holds 1..9 once, the clues kept."""
    return sudoku.is_valid_solution(found) and np.array_equal(found[puzzle != 0],
                                                              puzzle[puzzle != 0])


@pytest.mark.parametrize("blanks", [32, 40, 64, 81])
def test_the_jittable_solver_completes_every_generated_puzzle(blanks):
    """On device: a completion of every generated level; against the host search
    (`count_solutions`, at the reference's 32 and 40 blanks: with more it is slow), the very
    one where the host finds it unique."""
    puzzle, _ = _batch(32, blanks, seed=blanks)
    found, ok = jax.device_get(_solve()(puzzle))
    assert ok.all()
    unique = 0
    for p, f in zip(puzzle, found):
        assert _brute_force_check(p, f)
        n, host = sudoku.count_solutions(p, limit=2) if blanks <= 40 else (2, None)
        if n == 1:
            assert np.array_equal(f, host)
            unique += 1
    assert unique >= {32: 20, 40: 8}.get(blanks, 0)  # not enforced, as in the reference


def test_the_jittable_solver_searches_where_singles_stall():
    puzzles = _grids(HARD)
    found, ok = jax.device_get(_solve()(puzzles))
    stalled, _ = jax.device_get(jax.vmap(lambda g: sudoku.propagate(g.reshape(-1)))(puzzles))
    for p, f, s, k in zip(puzzles, found, stalled, ok):
        assert (s == 0).sum() > 30  # singles alone leave most blanks
        n, host = sudoku.count_solutions(p, limit=2)
        assert n == 1 and k and np.array_equal(f, host)


def test_propagation_fills_only_the_unique_solution_digits():
    puzzle, _ = _batch(32, 48, seed=5)
    filled, ok = jax.device_get(jax.vmap(lambda g: sudoku.propagate(g.reshape(-1)))(puzzle))
    for p, g, k in zip(puzzle, filled, ok):
        n, host = sudoku.count_solutions(p, limit=2)
        g = g.reshape(9, 9)
        assert k and np.array_equal(g[p != 0], p[p != 0])
        if n == 1:
            assert np.array_equal(g[g != 0], host[g != 0])


def test_the_jittable_solver_sees_grids_without_completion():
    """A wrong digit in a blank of a hard puzzle (one its row, column and box allow) leaves
    no completion (the host search says so): the solver says ok False and keeps the grid."""
    rng = random.Random(0)
    bad = []
    for p in _grids(HARD):
        _, solution = sudoku.count_solutions(p, limit=1)
        got = 0
        while got < 3:
            r, c = rng.randrange(9), rng.randrange(9)
            fits = [d for d in sudoku._host_valid(p, r, c) if d != solution[r, c]]
            if not fits:
                continue
            q = p.copy()
            q[r, c] = rng.choice(fits)
            if sudoku.count_solutions(q, limit=1)[0] == 0:
                bad.append(q)
                got += 1
    _, full = _batch(1, 0, seed=2)
    clash = full[0].copy()
    clash[0, 0], clash[0, 1] = 0, clash[0, 0]  # a repeated digit: no search at all
    bad = np.stack(bad + [clash])
    assert len(bad) == 10
    found, ok = jax.device_get(_solve()(bad))
    assert not ok.any() and np.array_equal(found, bad)


def test_the_solver_plays_levels_to_the_end():
    """The solver's moves (`envs.next_moves`, one a step, as `R,C,N` answers) played through
    `step`: every step a placement paying 1 (the level's own solution digit) or 0.5 (another
    completion), the last with the completion bonus; `solver_success` 1 all along."""
    env = envs.make("SimpleSudoku", blanks=12)
    names = np.array([list(sudoku.answer_bytes(m + "     ")) for m in env.move_names])

    @jax.jit
    def play(key):
        state = env.reset(key)

        def turn(state, _):
            moves, n = envs.next_moves(env, state, 1)
            success = envs.solver_success(env, state)
            state, reward, done, info = env.step(None, state, jnp.asarray(names)[moves[0]])
            return state, (n, success, reward, info["action_is_valid"])

        return jax.lax.scan(turn, state, None, length=13)

    final, (n, success, reward, valid) = jax.device_get(
        jax.vmap(play)(jax.random.split(jax.random.key(7), 16)))
    assert final.solved.all() and (final.steps == 12).all()
    assert (n[:, :12] == 1).all() and (n[:, 12] == 0).all()
    assert valid[:, :12].all() and (success[:, :12] == 1).all()
    assert np.isin(reward[:, :11], [1.0, 0.5]).all()
    assert np.isin(reward[:, 11], [11.0, 10.5]).all() and (reward[:, 12] == 0).all()


def test_sudoku_demonstration_replies_hold_one_placement():
    """729 placements: two a reply would be a table of 729 + 729 ** 2 rows; the default takes
    one, an explicit two is a one-line error naming the knob."""
    from starpo import demos

    env = envs.make("SimpleSudoku")
    spec = rollout.RolloutSpec(max_turn=5, max_new_tokens=24, max_context=8192)
    assert demos.moves_per_turn(env, spec) == 1
    assert demos.moves_per_turn(envs.make("SimpleSokoban"), spec) == 5  # 1,364 rows: as before
    with pytest.raises(ValueError, match="sft.actions_per_turn=2") as err:
        demos.moves_per_turn(env, spec, 2)
    assert "\n" not in str(err.value)


def test_sudoku_demonstrations_place_valid_digits(tiny_tokenizer):
    """The SFT path: each demonstration reply is one `R,C,N` answer, replayed here on the
    level's grid (NumPy): an empty cell, a digit its row, column and box allow; levels of 4
    blanks are solved in their 4 turns, the solver's weight 1 on every level."""
    from starpo import demos

    env = envs.make("SimpleSudoku", blanks=4)
    spec = rollout.RolloutSpec(max_turn=5, max_new_tokens=24, max_context=8192, thinking=False)
    play = demos.make_demo_rollout(env, tiny_tokenizer, spec)
    states, _ = rollout.initial_states(env, jax.random.key(0), 0, rollout.TRAIN, 8, 1)
    traj, _, weight = jax.device_get(play(states, jax.random.key(1)))
    assert (weight == 1).all() and traj.success.all()
    for row in range(8):
        grid = np.asarray(states.puzzle[row]).copy()
        tokens, mask = np.asarray(traj.tokens[row]), np.asarray(traj.loss_mask[row])
        turn = np.asarray(traj.turn_index[row])
        texts = [tiny_tokenizer.decode(tokens[mask & (turn == k)].tolist())
                 for k in range(5) if (mask & (turn == k)).any()]
        assert len(texts) == 4, texts
        for t in texts:
            r, c, d = map(int, re.fullmatch(r"(\d),(\d),(\d)</answer>", t).groups())
            assert grid[r - 1, c - 1] == 0 and d in sudoku._host_valid(grid, r - 1, c - 1)
            grid[r - 1, c - 1] = d
        assert sudoku.is_valid_solution(grid)


@pytest.mark.parametrize("blanks", [-1, 82, 3.0, True, "32"])
def test_bad_blank_counts_are_one_line_errors(blanks):
    with pytest.raises(ValueError, match="blanks") as err:
        sudoku.generate(jax.random.key(0), blanks)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ against the reference
_reference_parse = sudoku.reference_parse  # the reference's regexes, with Python's `re`


@functools.lru_cache(maxsize=None)
def _parse():
    return jax.jit(jax.vmap(sudoku.parse_action))


def _case_state(env, case):
    puzzle = jnp.asarray(case["puzzle"], jnp.int32)
    return _compiled(env)[3](jax.random.key(0)).replace(
        puzzle=puzzle, grid=puzzle, solution=jnp.asarray(case["solution"], jnp.int32))


def _case_env(case):
    if case["size"] == 4:  # the reference's grid_size 4: our tag Sudoku4x4 (its blank count
        # only draws levels; a case's level is its own), one env and compiled step for all
        return envs.make("Sudoku4x4", max_steps=case["max_steps"])
    return envs.make("SimpleSudoku" if case["difficulty"] == "easy" else "MediumSudoku",
                     max_steps=case["max_steps"])


@functools.lru_cache(maxsize=None)
def _compiled(env):
    """(text, jitted render, jitted step, jitted reset) of an env, shared by the cases that
    use it (run op by op, a reset compiles a hundred programs)."""
    etext = env_text.make_text(env)
    return etext, jax.jit(etext.render), jax.jit(env.step), jax.jit(env.reset)


def test_the_fixture_covers_every_feedback_and_format():
    actions = [s["action"] for c in GOLDEN["cases"] for s in c["steps"]]
    texts = "\n".join(s["text"] for c in GOLDEN["cases"] for s in c["steps"])
    for needle in ("Could not parse action", "Row 0 is out of range", "Column 10 is out",
                   "Number 0 is out", "Number 12 is out", "Cannot modify initial cell",
                   "conflicts with row", ", column", ", box (", "Valid numbers for (",
                   "✓ Correct!", "Valid but not optimal", "🎉 Congratulations!",
                   "💡 VALID NUMBERS FOR EMPTY CELLS:"):
        assert needle in texts, needle
    for fmt in (r"place \d at row \d col \d", r"place \d at \(\d,\d\)", r"place \d at \d,\d",
                r"^\d at \d, \d", r"^\(\d, \d, \d\)", r"^\d,\d,\d"):
        assert any(re.search(fmt, a) for a in actions), fmt


@pytest.mark.parametrize("index", range(len(GOLDEN["cases"])))
def test_text_and_rewards_are_the_reference(index):
    """Each recorded episode replayed: the text (on host and as device pieces), the reward,
    done and the info flags after every step."""
    case = GOLDEN["cases"][index]
    env = _case_env(case)
    etext, render, step, _ = _compiled(env)
    state = _case_state(env, case)
    assert env.to_text(state) == case["text"]
    env_text.check_render(etext, env, state)
    long_slots = set(etext.limits[0][0])
    for rec in case["steps"]:
        state, reward, done, info = step(jax.random.key(0), state,
                                         sudoku.answer_bytes(rec["action"], WIDTH))
        assert env.to_text(state) == rec["text"], rec["action"]
        ids = np.asarray(render(state))
        assert "".join(etext.pieces[i] for i in ids if i >= 0) == rec["text"], rec["action"]
        assert sum(int(i) in long_slots for i in ids) <= etext.limits[0][1]
        assert float(reward) == pytest.approx(rec["reward"], abs=1e-6), rec["action"]
        assert bool(done) == rec["done"] and bool(env.is_done(state)) == rec["done"]
        assert bool(info["success"]) == rec["success"]
        assert bool(info["action_is_valid"]) == rec["action_is_valid"]
        assert bool(info["action_is_effective"]) == rec["action_is_effective"]
    # a finished episode absorbs further answers
    if case["steps"][-1]["done"]:
        after, reward, done, info = step(jax.random.key(0), state, sudoku.answer_bytes("1,1,1", WIDTH))
        assert float(reward) == 0 and bool(done) and not bool(info["action_is_valid"])
        assert env.to_text(after) == env.to_text(state)


def test_answer_formats_match_the_reference_regexes():
    cases = ["place 5 at row 2 col 3", "Place 5 AT (2,3)", "place 5 at 2,3", "5 at 2,3",
             "(2,3,5)", "2,3,5", " 2, 3,  5 ", "place  5\tat\nrow 2 col 3", "PLACE 5 AT (2, 3)",
             "(2,3 ,5)", "2 ,3,5", "cat 1,2,3", "12,3,4", "x12,3,4,5", "007,1,2", "1,2",
             "place 5 at row 2 col", "place 5 at row 2, col 3", "place five at row 2 col 3",
             "place 5 at (2,3", "hello", "", "(1,2,3) and 4,5,6", "rowcol 1,2,3",
             "place 10 at row 0 col 12", "12345678901,2,3", "place 5 at row 2 col 3 || 1,1,1"]
    rng = random.Random(0)
    alphabet = list("0123456789 ,()\tx") + ["place", "at", "row", "col", " at ", "PLACE "]
    cases += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14))) for _ in range(300)]
    x = np.stack([sudoku.answer_bytes(c[:WIDTH], WIDTH) for c in cases])
    _, found, num, row, col = _parse()(x)
    for i, c in enumerate(cases):
        want = _reference_parse(c)
        got = (bool(found[i]),) + ((int(num[i]), int(row[i]), int(col[i])) if found[i] else
                                   (None,) * 3)
        if want[0]:  # digit runs saturate at 999999999 (a documented deviation)
            want = (True,) + tuple(min(v, sudoku.SAT) for v in want[1:])
        assert got == want, c


def test_malformed_and_out_of_range_answers_pay_the_penalty_and_change_nothing():
    case = GOLDEN["cases"][0]
    env = _case_env(case)
    state = _case_state(env, case)
    etext, _, step, _ = _compiled(env)
    for answer in ("", "hello", "1,2", "place 5 at row 10 col 1", "0,1,1", "1,1,10",
                   "99999999999,1,1", "place 5 at row 2, col 3"):
        new, reward, done, info = step(jax.random.key(0), state, sudoku.answer_bytes(answer, WIDTH))
        assert float(reward) == pytest.approx(-0.1) and not bool(done), answer
        assert not bool(info["action_is_valid"]) and not bool(info["action_is_effective"])
        assert np.array_equal(np.asarray(new.grid), np.asarray(state.grid))
        assert int(new.steps) == 1
    # the echo of an unparsable answer: lower-cased, stripped, its first ECHO bytes, non-ASCII
    # bytes as `?` (deviations: the reference echoes it whole, as Unicode)
    long = "  Hello " + "x" * 100 + "  "
    new, *_ = step(jax.random.key(0), state, sudoku.answer_bytes(long, 128))
    assert f"Could not parse action: 'hello {'x' * (sudoku.ECHO - 6)}'." in env.to_text(new)
    new, *_ = step(jax.random.key(0), state, sudoku.answer_bytes("é?", WIDTH))
    assert "Could not parse action: '???'." in env.to_text(new)
    env_text.check_render(etext, env, new)
    # saturated out-of-range numbers
    new, *_ = step(jax.random.key(0), state, sudoku.answer_bytes("12345678901,1,1", WIDTH))
    assert "Row 999999999 is out of range (1-9)" in env.to_text(new)


# ------------------------------------------------------------------ the dialogue
def _reference_message(text, env):
    return (env.instruction + "\nTurn 1:\nState:\n" + text
            + f"\nYou have {env.max_actions} actions left. Always output: <think> [Your thoughts] "
            "</think> <answer> [your answer] </answer> with no extra text. Strictly follow this "
            "format. ")


def test_dialogue_rewards_and_actions(tiny_tokenizer):
    """The scripted rollout (launch/play.py's path): two actions a turn (the reference's
    budget), each piece of the answer an action, the turn reward their sum, the format penalty
    only where nothing parsed."""
    tok = tiny_tokenizer
    case = GOLDEN["cases"][0]
    env = _case_env(case)
    state = _case_state(env, case)
    steps = case["steps"]
    # the fixture's first two answers in one reply, as the model would write them
    rows = [[f"ok</think><answer>{steps[0]['action']} || {steps[1]['action']}</answer>"],
            ["no answer"]]
    spec = rollout.RolloutSpec(max_turn=1, max_new_tokens=48, max_context=8192, length_prompt=100)
    play, _ = rollout.make_scripted_rollout(env, tok, spec)
    batch = jax.tree_util.tree_map(lambda x: np.stack([x, x]), state)
    ids, lens, stops = scripted.script_replies(tok, rows, 1, 48)
    traj, metrics, final = play(batch, ids, lens, stops, jax.random.key(0))
    text = tok.decode(np.asarray(traj.tokens[0, :int(traj.length[0])]).tolist())
    assert _reference_message(case["text"], env) in text
    assert float(traj.turn_reward[0, 0]) == pytest.approx(
        steps[0]["reward"] + steps[1]["reward"], abs=1e-5)
    assert float(traj.penalty[0]) == 0 and int(traj.num_actions[0]) == 2
    assert env.to_text(jax.tree_util.tree_map(lambda x: x[0], final)) == steps[1]["text"]
    assert float(traj.turn_reward[1, 0]) == 0 and float(traj.penalty[1]) == pytest.approx(-0.1)
    assert int(traj.num_actions[1]) == 0


def test_two_turn_dialogue(tiny_tokenizer):
    """Two turns of two placements each (the fixture's case 1, steps 0-3): the second
    observation is the reference's text after the first two steps, each turn's reward the sum
    of its steps', the final state the reference's after four."""
    case = GOLDEN["cases"][1]
    env = _case_env(case)
    state = _case_state(env, case)
    steps = case["steps"]
    reply = "ok</think><answer>{} || {}</answer>"
    rows = [[reply.format(steps[0]["action"], steps[1]["action"]),
             reply.format(steps[2]["action"], steps[3]["action"])]]
    spec = rollout.RolloutSpec(max_turn=2, max_new_tokens=96, max_context=8192, length_prompt=100)
    play, _ = rollout.make_scripted_rollout(env, tiny_tokenizer, spec)
    batch = jax.tree_util.tree_map(lambda x: x[None], state)
    ids, lens, stops = scripted.script_replies(tiny_tokenizer, rows, 2, 96)
    assert (stops == sampler.STOP_STRING).all()  # both replies whole
    traj, _, final = play(batch, ids, lens, stops, jax.random.key(0))
    text = tiny_tokenizer.decode(np.asarray(traj.tokens[0, :int(traj.length[0])]).tolist())
    assert steps[1]["text"] in text and steps[3]["text"] not in text
    assert np.allclose(np.asarray(traj.turn_reward[0, :2]),
                       [steps[0]["reward"] + steps[1]["reward"],
                        steps[2]["reward"] + steps[3]["reward"]], atol=1e-5)
    assert int(traj.num_actions[0]) == 4 and float(traj.penalty[0]) == 0
    assert env.to_text(jax.tree_util.tree_map(lambda x: x[0], final)) == steps[3]["text"]


def test_play_seed_zero(tiny_tokenizer):
    """launch/play.py's path (`--env=SimpleSudoku --seed=0`): the level of seed 0 and a correct
    placement from its solution, paying 1."""
    from launch import play

    env = envs.make("SimpleSudoku")
    state = play.initial_state(env, None, 0)
    puzzle, solution = np.asarray(state.puzzle), np.asarray(state.solution)
    r, c = [(int(a), int(b)) for a, b in zip(*np.nonzero(puzzle == 0))][0]
    spec = rollout.RolloutSpec(max_turn=1, max_new_tokens=48, max_context=8192, length_prompt=100)
    text, result = play.play_scripted(
        env, tiny_tokenizer, state,
        [f"ok</think><answer>place {solution[r, c]} at row {r + 1} col {c + 1}</answer>"], spec)
    assert env.to_text(state) in text
    assert result["turn_rewards"] == [1.0] and result["penalty"] == 0
    # the level text read back
    assert np.array_equal(np.asarray(env.from_text(env.to_text(state)).puzzle), puzzle)


@pytest.mark.parametrize("options", [dict(blanks=82), dict(blanks="32"), dict(max_steps=0),
                                     dict(max_actions=True), dict(completion_bonus="10"),
                                     dict(difficulty="easy"), dict(size=16), dict(size="4"),
                                     dict(size=4)])  # the last: 32 blanks of 16 cells
def test_bad_env_options_are_one_line_errors(options):
    with pytest.raises(ValueError) as err:
        envs.make("SimpleSudoku", **options)
    assert "\n" not in str(err.value)


def test_a_4x4_grid_holds_at_most_16_blanks():
    with pytest.raises(ValueError, match=r"blanks must be an int in \[0, 16\]"):
        envs.make("Sudoku4x4", blanks=17)


def test_bad_level_text_raises():
    env = envs.make("SimpleSudoku")
    for text in ("", "[1] . .", "\n".join(["[1][1] .  .  .  .  .  .  ."] * 9)):
        with pytest.raises(ValueError):
            env.from_text(text)
    # a 4x4 level reads back from its text; a 9x9 one, or a clue past 4, does not
    case = next(c for c in GOLDEN["cases"] if c["size"] == 4)
    small = _case_env(case)
    assert np.array_equal(np.asarray(small.from_text(case["text"]).puzzle), case["puzzle"])
    for text in (GOLDEN["cases"][0]["text"], case["text"].replace("[1]", "[5]", 1)):
        with pytest.raises(ValueError):
            small.from_text(text)
