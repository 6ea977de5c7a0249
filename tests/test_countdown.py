"""Countdown against RAGEN-2's text and scoring (tests/env_fixtures/countdown_golden.json), the
on-device evaluator against Python's own `eval` on fuzzed answers, the generator and the solver.
"""

import functools
import json
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from envs import countdown
from envs import text as env_text
from starpo import parsing, rollout, scripted

GOLDEN = json.loads((pathlib.Path(__file__).parent / "env_fixtures" / "countdown_golden.json")
                    .read_text(encoding="utf-8"))
WIDTH = 48  # answer bytes in the env-level tests


@functools.lru_cache(maxsize=None)
def _env():
    return envs.make("Countdown")


@functools.lru_cache(maxsize=None)
def _batched_step():
    env = _env()
    return jax.jit(jax.vmap(lambda s, a: env.step(jax.random.key(0), s, a)))


@functools.lru_cache(maxsize=None)
def _batched_check():
    return jax.jit(jax.vmap(countdown.check_answer))


def _stack(states):
    return jax.tree_util.tree_map(lambda *x: np.stack(x), *states)


def _level(i):
    return _env().from_text(GOLDEN["levels"][i]["text"])


# ------------------------------------------------------------------ the reference's text
def test_text_is_the_reference():
    env = _env()
    assert env.instruction == GOLDEN["env_instruction"]
    etext = env_text.make_text(env)
    # no action lookup: the prefix is the instruction alone; one action per turn and episode
    assert etext.prefix == GOLDEN["env_instruction"]
    assert (etext.max_actions_per_turn, etext.max_actions_per_traj) == (
        GOLDEN["agent_proxy"]["max_actions_per_turn"], GOLDEN["max_actions_per_traj"])
    for lv in GOLDEN["levels"]:
        state = env.from_text(lv["text"])
        assert env.to_text(state) == lv["text"] == countdown.STATE_TEMPLATE.format(
            target=lv["target"], nums=lv["nums"])
        env_text.check_render(etext, env, state)
    for r, text in GOLDEN["result_texts"].items():
        done = _level(0).replace(answered=jnp.ones((), bool), reward=jnp.float32(float(r)))
        assert env.to_text(done) == text
        env_text.check_render(etext, env, done)


def test_rewards_of_recorded_answers():
    env = _env()
    cases = GOLDEN["cases"]
    states = _stack([_level(c["level"]) for c in cases])
    actions = np.stack([countdown.answer_bytes(c["answer"], WIDTH) for c in cases])
    new, reward, done, info = _batched_step()(states, actions)
    for i, c in enumerate(cases):
        where = f"{c['answer']!r} on level {c['level']}"
        assert float(reward[i]) == pytest.approx(c["reward"], abs=1e-6), where
        assert bool(done[i]), where
        assert bool(info["success"][i]) == (c["reward"] == GOLDEN["score"]), where
        assert bool(info["action_is_effective"][i]) == (c["reward"] > 0), where
        assert env.to_text(jax.tree_util.tree_map(lambda x: x[i], new)) == \
            GOLDEN["result_texts"][str(c["reward"])], where
    # a done env absorbs: a second answer pays nothing and changes nothing
    again, reward2, done2, info2 = _batched_step()(new, actions)
    assert np.all(np.asarray(reward2) == 0) and np.all(np.asarray(done2))
    assert np.array_equal(np.asarray(again.reward), np.asarray(new.reward))
    assert np.array_equal(np.asarray(info2["success"]), np.asarray(info["success"]))


def _reference_message(level_text, max_tokens=100):
    return (GOLDEN["env_instruction"] + "\nTurn 1:\n" + "State:\n" + level_text
            + "\nYou have 1 actions left. Always output: <think> [Your thoughts] </think> "
            "<answer> [your answer] </answer> with no extra text. Strictly follow this format. "
            f"Max response length: {max_tokens} words (tokens).\n")


def test_dialogue_text_and_rewards(tiny_tokenizer):
    """The scripted rollout (launch/play.py's path): the template over the reference's
    messages (the reference's Countdown config: one turn), the reward of the first piece of
    the answer, and the format penalty only where nothing parsed."""
    tok, env = tiny_tokenizer, _env()
    replies = [  # (reply after the <think> prime, level, turn reward, penalty)
        (" 2 + 5 = 7, 7 - 3 = 4. </think> <answer>2 + 5 - 3</answer>", 0, 1.0, 0.0),
        ("hmm</think><answer> 3 * 5 - 2 </answer>", 0, 0.1, 0.0),
        ("hmm</think><answer>44 + 19 + 35 || 1</answer>", 1, 1.0, 0.0),  # first piece only
        ("hmm</think><answer>2 + 5 - 3 = 4</answer>", 0, 0.0, 0.0),
        ("no answer at all", 2, 0.0, -0.1),
        ("x</think><answer> || </answer>", 3, 0.0, -0.1),
    ]
    spec = rollout.RolloutSpec(max_turn=1, max_new_tokens=96, max_context=2048, length_prompt=100)
    play, _ = rollout.make_scripted_rollout(env, tok, spec)
    states = _stack([_level(r[1]) for r in replies])
    ids, lens, stops = scripted.script_replies(tok, [[r[0]] for r in replies], 1, 96)
    traj, metrics, final = play(states, ids, lens, stops, jax.random.key(0))
    for b, (reply, lv, reward, penalty) in enumerate(replies):
        msgs = [{"role": "system", "content": "You're a helpful assistant. "},
                {"role": "user", "content": _reference_message(GOLDEN["levels"][lv]["text"])}]
        want = tok.apply_chat_template(msgs, add_generation_prompt=True) + "<think>" + reply
        n = int(traj.length[b])
        assert tok.decode(np.asarray(traj.tokens[b, :n]).tolist()) == want, reply
        assert int(metrics["num_turns"][b]) == 1
        assert float(traj.turn_reward[b, 0]) == pytest.approx(reward, abs=1e-6), reply
        assert float(traj.penalty[b]) == pytest.approx(penalty, abs=1e-6), reply
        assert bool(traj.success[b]) == (reward == 1.0)
        assert int(traj.num_actions[b]) == (penalty == 0)


# ------------------------------------------------------------------ the evaluator vs Python
_ALPHABET = list("0123456789") + list("+-*/()") + [" ", " ", " ", "\t", "\n", "\x0c"] + list("x,?$")
_WEIGHTS = np.array([3.0] * 10 + [3.0] * 6 + [4, 4, 4, 0.5, 0.5, 0.3] + [0.3] * 4)


def _tree(rng, nums):
    """A random expression string over nums (shuffled), with random operators, parentheses,
    unary signs and spacing."""
    items = [str(x) for x in rng.permutation(nums)]
    while len(items) > 1:
        i = rng.integers(len(items) - 1)
        op = rng.choice(["+", "-", "*", "/", "**", "//"], p=[0.3, 0.3, 0.17, 0.17, 0.03, 0.03])
        sp = lambda: rng.choice(["", " ", "  ", "\t", "\n"], p=[0.4, 0.45, 0.05, 0.05, 0.05])  # noqa: E731
        merged = items[i] + sp() + op + sp() + items[i + 1]
        if rng.random() < 0.5:
            merged = "(" + sp() + merged + sp() + ")"
        if rng.random() < 0.1:
            merged = rng.choice(["-", "+", "- ", "--"]) + merged
        items[i:i + 2] = [merged]
    return items[0]


def _mutate(rng, s):
    s = list(s)
    for _ in range(rng.integers(1, 3)):
        k = rng.integers(3)
        pos = rng.integers(len(s) + 1)
        ch = rng.choice(_ALPHABET, p=_WEIGHTS / _WEIGHTS.sum())
        if k == 0 and s:
            del s[min(pos, len(s) - 1)]
        elif k == 1:
            s.insert(pos, ch)
        elif s:
            s[min(pos, len(s) - 1)] = ch
    return "".join(s)


def _python_value(s):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return eval(s, {"__builtins__": None}, {})  # noqa: S307
    except Exception:  # noqa: BLE001
        return None


def _fuzz_cases(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        count = int(rng.integers(3, 5))
        nums = [int(x) for x in rng.integers(1, 100, count)]
        if rng.random() < 0.15:
            nums[1] = nums[0]  # repeated numbers
        kind = rng.random()
        if kind < 0.45:
            s = _tree(rng, nums)
        elif kind < 0.8:
            s = _mutate(rng, _tree(rng, nums))
        else:
            s = "".join(rng.choice(_ALPHABET, size=int(rng.integers(1, 20)),
                                   p=_WEIGHTS / _WEIGHTS.sum()))
        s = s.strip(" \t\n\r\x0b\x0c")  # the rollout hands the env stripped pieces
        if not s or len(s.encode()) > WIDTH:
            continue
        v = _python_value(s)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e6 \
                and float(v).is_integer() and v >= 1 and rng.random() < 0.7:
            target = int(v)  # often the answer is right
        else:
            target = int(rng.integers(1, 200))
        out.append((s, nums, target))
    return out


def _device_rewards(cases):
    n_max = 4
    x = np.stack([countdown.answer_bytes(s, WIDTH) for s, _, _ in cases])
    nums = np.array([n + [0] * (n_max - len(n)) for _, n, _ in cases], np.int32)
    count = np.array([len(n) for _, n, _ in cases], np.int32)
    target = np.array([t for _, _, t in cases], np.int32)
    fmt, correct = _batched_check()(x, nums, count, target)
    fmt, correct = np.asarray(fmt), np.asarray(correct)
    return np.where(fmt, np.where(correct, 1.0, 0.1), 0.0)


def _max_depth(s):
    d = m = 0
    for ch in s:
        d += (ch == "(") - (ch == ")")
        m = max(m, d)
    return m


@pytest.mark.filterwarnings("ignore::SyntaxWarning")
def test_evaluator_agrees_with_python_eval_on_fuzzed_answers():
    cases = _fuzz_cases(3000)
    got = _device_rewards(cases)
    outside = 0
    kinds = {0.0: 0, 0.1: 0, 1.0: 0}
    for (s, nums, target), g in zip(cases, got):
        want = countdown.reference_reward(s, nums, target)
        if "**" in s or "//" in s or _max_depth(s) >= countdown.MAX_DEPTH:
            # outside the supported subset: never scored correct (deviation, documented)
            outside += 1
            assert g == (0.1 if want else 0.0), (s, nums, target)
            continue
        assert g == pytest.approx(want), (s, nums, target, want, g)
        kinds[float(want)] += 1
    # the fuzz reaches every outcome often
    assert min(kinds.values()) > 200, kinds
    assert outside < len(cases) // 5


@pytest.mark.filterwarnings("ignore::SyntaxWarning")
def test_evaluator_edge_cases():
    nums, target = [3, 5, 2], 4
    cases = {
        "2+5-3": 1, "--2+5-3": 1, "+2+5-3": 1, "-(-2)+5-3": 1, "(((2)))+5-3": 1,
        "2*(5-3)": 1, "(2\n+5-3)": 1, "2\t+\t5-3": 1, "2+5\n-3": 0.1, "2 + 5 - 3 +": 0.1,
        "2 + 5 - 3)": 0.1, "()+2+5-3": 0.1, "2(5)-3": 0.1, "02+5-3": 0.1, "2+5-03": 0.1,
        "5/(3*2)": 0.1, "2/(5-3)": 0.1, "(2+5-3)/1": 0, "2/(5-5)+3": 0, "2 + 5 - 3 = 4": 0,
        "2 ** 5 - 3": 0.1, "2 + 5 // 3": 0.1, "x2+5-3": 0.1, "2.+5-3": 0.1,
        "2+5-3" + "0" * 30: 0, "9" * 40: 0,
    }
    got = _device_rewards([(s, nums, target) for s in cases])
    for (s, want), g in zip(cases.items(), got):
        assert g == pytest.approx(want), (s, g)
        if "**" not in s and "//" not in s and "." not in s:
            assert countdown.reference_reward(s, nums, target) == pytest.approx(want), s
    # a division by zero with the numbers right is a failed evaluation: 0.1
    assert _device_rewards([("7 / (4 - 4)", [4, 4, 7], 1)])[0] == pytest.approx(0.1)
    assert countdown.reference_reward("7 / (4 - 4)", [4, 4, 7], 1) == 0.1


def test_answer_pieces_are_the_reference_split():
    """`parse_pieces` + `piece_bytes` (the rollout's text actions) vs the reference's regex."""
    rng = np.random.default_rng(1)
    frags = ["2 + 5 - 3", " 7*3 ", "||", " || ", "|", "", "<answer>", "</think>", "x"]
    replies = []
    for _ in range(200):
        ans = "".join(rng.choice(frags, size=int(rng.integers(1, 6))))
        head = rng.choice(["t</think>", "t</think> \n", "t</think>x"])
        replies.append(head + "<answer>" + ans + "</answer>")
    L = 96
    x = np.full((len(replies), L), parsing.PAD, np.int32)
    for i, r in enumerate(replies):
        raw = np.frombuffer(("<think>" + r).encode(), np.uint8)
        x[i, :len(raw)] = raw
    R = 2
    c, f, e, has, count = jax.jit(parsing.parse_pieces, static_argnums=(1, 2))(x, R, True)
    pieces = np.asarray(parsing.piece_bytes(c, f, e, has))
    for i, r in enumerate(replies):
        m = re.search(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", "<think>" + r, re.DOTALL)
        want = []
        if m:
            a = m.group(2)
            for s in ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>"):
                a = a.replace(s, "").strip()
            want = [p.strip() for p in a.split("||") if p.strip()][:R]
        got = [bytes(p[p >= 0].astype(np.uint8)).decode() for p in pieces[i][:int(count[i])]]
        assert got == want, r


# ------------------------------------------------------------------ generator and solver
def test_generated_levels_are_solvable_and_in_range():
    env = _env()
    states = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.key(7), 1024))
    nums, count, target = (np.asarray(a) for a in (states.nums, states.count, states.target))
    assert set(np.unique(count)) == {3, 4}
    used = np.arange(4)[None] < count[:, None]
    assert np.all(nums[used] >= 1) and np.all(nums[used] <= 99) and np.all(nums[~used] == 0)
    assert np.all(target >= 1) and np.all(target <= env.max_target)
    # every level has a signed-sum solution (the reference's has_solution)
    signs = np.array(np.meshgrid(*[[1, -1]] * 4)).reshape(4, -1).T  # [16, 4]
    assert np.all(np.any((nums @ signs.T) == target[:, None], axis=1))
    # the same key gives the same level
    again = jax.jit(env.reset)(jax.random.split(jax.random.key(7), 1024)[5])
    assert int(again.target) == int(target[5]) and np.array_equal(np.asarray(again.nums), nums[5])
    # the solver's answer for generated levels scores 1 on device and in the reference
    picks = range(0, 1024, 32)
    answers = []
    for i in picks:
        level = [int(v) for v in nums[i, :count[i]]]
        a = countdown.solve(level, int(target[i]))
        assert a is not None and countdown.reference_reward(a, level, int(target[i])) == 1
        answers.append(countdown.answer_bytes(a, WIDTH))
    sub = jax.tree_util.tree_map(lambda x: x[np.array(list(picks))], states)
    _, reward, _, info = _batched_step()(sub, np.stack(answers))
    assert np.all(np.asarray(reward) == 1.0) and np.all(np.asarray(info["success"]))


def test_solver_uses_every_operator_and_knows_no_solution():
    for nums, target in (([25, 50, 75, 100], 125), ([4, 6, 8, 2], 24), ([7, 7, 7, 7], 1),
                         ([3, 9, 4], 108), ([6, 4, 3], 8)):
        a = countdown.solve(nums, target)
        assert a is not None and countdown.reference_reward(a, nums, target) == 1, (nums, a)
    assert countdown.solve([1, 1, 1], 100) is None


@pytest.mark.parametrize("options", [
    dict(max_count=0), dict(min_count=0), dict(min_count=-1), dict(min_count=3, max_count=2),
    dict(min_number=0), dict(min_number=-5), dict(max_number=0), dict(max_number=500),
    dict(max_count=6), dict(max_count=2.5), dict(score="1"), dict(numbers=3),
])
def test_bad_options_raise_one_line_value_error(options):
    with pytest.raises(ValueError) as e:
        envs.make("Countdown", **options)
    assert "\n" not in str(e.value)


def test_bad_level_text_raises():
    env = _env()
    for text in ("Target: 4, nums: []", "Target: 4, nums: [3, 5]", "Target: x, nums: [3, 5, 2]",
                 "Target: 4, nums: [3, 5, 200]", "Your answer get 1 points."):
        with pytest.raises(ValueError):
            env.from_text(text)


def test_play_seed_with_the_solvers_answer(tiny_tokenizer):
    """launch/play.py's path (`--env=Countdown --seed=0`): the level of seed 0, the solver's
    answer as the reply, success and reward 1 in the dialogue the model would see."""
    from launch import play

    env = _env()
    state = play.initial_state(env, None, 0)
    level = env.to_text(state)
    m = re.fullmatch(r"Target: (\d+), nums: \[(.*)\]", level)
    answer = countdown.solve([int(v) for v in m.group(2).split(", ")], int(m.group(1)))
    spec = rollout.RolloutSpec(max_turn=1, max_new_tokens=96, max_context=2048, length_prompt=100)
    text, result = play.play_scripted(env, tiny_tokenizer, state,
                                      [f"ok</think><answer>{answer}</answer>"], spec)
    assert _reference_message(level) in text
    assert result["turn_rewards"] == [1.0] and result["success"] and result["penalty"] == 0
