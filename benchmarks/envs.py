"""Env throughput: jitted, vmapped resets and steps per second, beside the Python reference.

    python -m benchmarks.envs              # batch 1, 64 and 4096 for every variant, plus the
                                           # Python reference envs (gymnasium, gym_sokoban)
    python -m benchmarks.envs --batch=4096 # one batch size, JAX envs only

The last line printed is one JSON object. With --batch it is keyed by env name with
`steps_per_s` and `resets_per_s`; otherwise it holds every batch size, the Python reference
figures and the speed-ups at the largest batch.

What is timed. Resets: one jitted vmapped `reset` per call (level generation included), the
call's keys already on device. Steps: a jitted `lax.scan` of `--scan` vmapped steps per call
(random valid actions, per-step keys split on device), the way an on-device rollout runs them;
`steps_per_s_per_call` is one jitted call per step instead, i.e. Python dispatch in the loop.
Each figure is env transitions (or new levels) per second over all envs of the batch: the
median call, compile and warm-up excluded, `block_until_ready` before the clock stops (the
median because on a shared machine a few calls stall for reasons unrelated to the env).

The Python reference does the same work one env at a time: gymnasium's FrozenLakeEnv built
on a fresh `generate_random_map` per reset (as RAGEN's FrozenLake does; gymnasium's generator
fixes start and goal in the corners, RAGEN's draws them) and `step` per action; gym_sokoban's
room generator per reset (it searches to depth 300; RAGEN's LargerSokoban passes 10) and
`SokobanEnv.step` with the text render RAGEN uses; timed as total throughput of the loop. Both
are optional: a missing package is reported and skipped. Countdown's reference is the same
rules in plain Python (a level per reset, the reference's `compute_reward` with `eval` per
step); its JAX steps evaluate random 32-byte answers (the env is done after the first, and
every later step still runs the evaluator, so the figure is the evaluator's throughput).
2048's reference is the reference's own rules in plain Python (`bench_python_2048`: two spawns
per reset; per step the reference's `_compress_and_merge` slide, a spawn and the end test over
all four directions, the log reward); JAX steps take random directions, and a finished board
still costs a full step. Sudoku's reference is the same rules in plain Python
(`bench_python_sudoku`: a level per reset drawn as `sudoku.generate` draws it; per step the
reference's six regexes with `re`, the range, initial-cell and conflict checks, the placement
and its reward, the solved test); both take random placements `R,C,N` (some in the
`place N at row R col C` form, a few unparsable), and a solved level still costs a full step.

Run from the repository root: `python -m` puts it on the import path.
"""

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import envs
from envs import countdown, game2048, sudoku

ALL_BATCHES = (1, 64, 4096)
ANSWER_WIDTH = 32  # bytes of a Countdown answer in the step timing


def _timed(fn, min_seconds, min_calls=5):
    """Median seconds per call of fn(), after one untimed warm-up call. The median, not the
    mean: on a shared machine a few calls stall, and they say nothing about the env."""
    fn()
    times, start = [], time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def bench_jax(name, batch, scan, min_seconds):
    """{"resets_per_s", "steps_per_s", "steps_per_s_per_call"} of env `name` at `batch`."""
    env = envs.make(name)
    reset = jax.jit(jax.vmap(env.reset))
    step = jax.jit(jax.vmap(env.step))

    def rollout(keys, state, actions):  # actions: int32[scan, batch] (text: [scan, batch, W])
        def one(state, xs):
            step_keys, action = xs
            state, reward, done, _ = jax.vmap(env.step)(step_keys, state, action)
            return state, reward

        step_keys = jax.vmap(lambda k: jax.random.split(k, batch))(jax.random.split(keys, scan))
        return jax.lax.scan(one, state, (step_keys, actions))

    rollout = jax.jit(rollout)
    key_sets = [jax.random.split(jax.random.key(i), batch) for i in range(4)]
    rng = np.random.default_rng(0)
    if getattr(env, "text_actions", False):  # answers as bytes [scan, batch, W]
        answers = (_placements(rng, 256, env.size) if isinstance(env, sudoku.Sudoku)
                   else _answers(rng, 256))
        pool = np.stack([countdown.answer_bytes(a, ANSWER_WIDTH) for a in answers])
        action_sets = [jnp.asarray(pool[rng.integers(0, len(pool), (scan, batch))]) for _ in range(4)]
    else:
        action_sets = [jnp.asarray(rng.integers(1, env.num_actions + 1, (scan, batch)), jnp.int32)
                       for _ in range(4)]
    first_actions = [a[0] for a in action_sets]
    state = reset(key_sets[0])
    counter = [0]

    def do_reset():
        counter[0] += 1
        jax.block_until_ready(reset(key_sets[counter[0] % 4]))

    def do_rollout():
        counter[0] += 1
        i = counter[0] % 4
        jax.block_until_ready(rollout(jax.random.key(i), state, action_sets[i]))

    def do_step():
        counter[0] += 1
        i = counter[0] % 4
        jax.block_until_ready(step(key_sets[i], state, first_actions[i]))

    return {
        "resets_per_s": batch / _timed(do_reset, min_seconds),
        "steps_per_s": batch * scan / _timed(do_rollout, min_seconds),
        "steps_per_s_per_call": batch / _timed(do_step, min_seconds),
    }


# ------------------------------------------------------------------ Python references


def bench_gymnasium_frozen_lake(min_seconds):
    try:
        from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv, generate_random_map
    except ImportError:
        return None
    seed = [0]

    def fresh_env():
        seed[0] += 1
        env = FrozenLakeEnv(desc=generate_random_map(size=4, p=0.8, seed=seed[0]), is_slippery=True)
        env.reset(seed=seed[0])
        return env

    env = fresh_env()
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 4, 10000).tolist()
    i = [0]

    def one_step():
        i[0] += 1
        env.step(actions[i[0] % 10000])

    return {
        "impl": "gymnasium FrozenLakeEnv (4x4, slippery); reset = generate_random_map + new env + reset",
        "resets_per_s": 1 / _timed_loop(fresh_env, min_seconds),
        "steps_per_s": 1 / _timed_loop(one_step, min_seconds),
    }


def _answers(rng, n):
    """n Countdown-style answers: 3-4 two-digit numbers joined by random operators."""
    out = []
    for _ in range(n):
        nums = rng.integers(1, 100, int(rng.integers(3, 5)))
        ops = rng.choice(list("+-*/"), len(nums) - 1)
        out.append(" ".join([str(nums[0])] + [f"{o} {v}" for o, v in zip(ops, nums[1:])]))
    return out


def _placements(rng, n, size=sudoku.SIZE):
    """n Sudoku answers: random placements on a size x size grid, most `R,C,N`, one in 8
    `place N at row R col C`, one in 16 unparsable."""
    out = []
    for _ in range(n):
        r, c, d = rng.integers(1, size + 1, 3)
        kind = rng.integers(0, 16)
        out.append("no idea" if kind == 0 else f"place {d} at row {r} col {c}" if kind < 3
                   else f"{r},{c},{d}")
    return out


def bench_python_countdown(min_seconds):
    """The same rules in plain Python, one env at a time: a level per reset (count, numbers,
    signs until the signed sum is >= 1, as envs/countdown.py draws them) and the reference's
    `compute_reward` (regex format check, `eval`) per step, on answers that use the level's
    numbers."""
    import random

    r = random.Random(0)

    def new_level():
        nums = [r.randint(1, 99) for _ in range(r.randint(3, 4))]
        for _ in range(countdown.SIGN_TRIES):
            t = sum(x if r.random() < 0.5 else -x for x in nums)
            if t >= 1:
                return nums, t
        return nums, sum(nums)

    # answers over the level's own numbers, so that every step passes the format check and
    # reaches `eval` (the JAX evaluator does the same work whatever the answer)
    level = new_level()
    rng = np.random.default_rng(1)
    answers = []
    for _ in range(256):
        nums = rng.permutation(level[0])
        ops = rng.choice(list("+-*/"), len(nums) - 1)
        answers.append(" ".join([str(nums[0])] + [f"{o} {v}" for o, v in zip(ops, nums[1:])]))
    i = [0]

    def one_step():
        i[0] += 1
        countdown.reference_reward(answers[i[0] % 256], *level)

    return {
        "impl": "plain Python: random level per reset, the reference's compute_reward per step",
        "resets_per_s": 1 / _timed_loop(new_level, min_seconds),
        "steps_per_s": 1 / _timed_loop(one_step, min_seconds),
    }


def bench_python_2048(min_seconds):
    """The same rules in plain Python/NumPy, one env at a time: the reference's
    `_compress_and_merge` (envs/game2048.py `reference_move`), its spawn and its end test."""
    rng = np.random.default_rng(0)

    def spawn(grid):
        empties = list(zip(*np.where(grid == 0)))
        if empties:
            r, c = empties[rng.integers(0, len(empties))]
            grid[r, c] = 2 if rng.random() < 0.9 else 4

    def new_level():
        grid = np.zeros((4, 4), np.int64)
        spawn(grid)
        spawn(grid)
        return grid

    state = [new_level()]
    actions = rng.integers(0, 4, 10000).tolist()
    i = [0]

    def one_step():
        i[0] += 1
        grid, gain, moved = game2048.reference_move(state[0], actions[i[0] % 10000])
        if moved:
            spawn(grid)
            _ = 0.1 * np.log2(gain + 1.0) if gain > 0 else 0.0
            over = not (grid == 0).any() and not any(
                game2048.reference_move(grid, d)[2] for d in range(4))
            state[0] = new_level() if over else grid

    return {
        "impl": "plain Python/NumPy: the reference's slide and merge loop, spawn and end test",
        "resets_per_s": 1 / _timed_loop(new_level, min_seconds),
        "steps_per_s": 1 / _timed_loop(one_step, min_seconds),
    }


def bench_python_sudoku(min_seconds, blanks=sudoku.BLANKS["easy"]):
    """The same rules in plain Python, one env at a time: a level per reset (a base grid's
    digits relabelled, bands, stacks, rows and columns permuted, maybe transposed, then
    `blanks` cells blanked) and per step the reference's `SudokuEnv.step`: its regexes
    (`sudoku.reference_parse`), checks, placement, reward and solved test."""
    import random

    r = random.Random(0)
    base = sudoku._base(sudoku.SIZE).tolist()

    def lines():
        bands = r.sample(range(3), 3)
        return [3 * b + i for b in bands for i in r.sample(range(3), 3)]

    def new_level():
        digits = [0] + r.sample(range(1, 10), 9)
        rows, cols = lines(), lines()
        grid = [[digits[base[i][j]] for j in cols] for i in rows]
        if r.random() < 0.5:
            grid = [list(col) for col in zip(*grid)]
        puzzle = [row[:] for row in grid]
        for k in r.sample(range(81), blanks):
            puzzle[k // 9][k % 9] = 0
        return {"puzzle": puzzle, "grid": [row[:] for row in puzzle], "solution": grid}

    def fits(grid, i, j, num):
        b = [grid[i // 3 * 3 + k // 3][j // 3 * 3 + k % 3] for k in range(9)]
        return num not in grid[i] and num not in [row[j] for row in grid] and num not in b

    def step(state, answer):
        matched, num, row, col = sudoku.reference_parse(answer)
        if not matched or not (1 <= row <= 9 and 1 <= col <= 9 and 1 <= num <= 9):
            return -0.1
        i, j = row - 1, col - 1
        if state["puzzle"][i][j] != 0 or not fits(state["grid"], i, j, num):
            return -0.1
        state["grid"][i][j] = num
        reward = 1.0 if num == state["solution"][i][j] else 0.5
        grid = state["grid"]
        boxes = [[grid[b // 3 * 3 + k // 3][b % 3 * 3 + k % 3] for k in range(9)]
                 for b in range(9)]
        if all(all(row) for row in grid) and all(
                len(set(u)) == 9 for u in grid + [list(c) for c in zip(*grid)] + boxes):
            reward += 10.0
        return reward

    answers = _placements(np.random.default_rng(1), 256)
    state, i = [new_level()], [0]

    def one_step():
        i[0] += 1
        step(state[0], answers[i[0] % 256])

    return {
        "impl": "plain Python: a level per reset, the reference's regexes, checks and reward per step",
        "resets_per_s": 1 / _timed_loop(new_level, min_seconds),
        "steps_per_s": 1 / _timed_loop(one_step, min_seconds),
    }


def _timed_loop(fn, min_seconds):
    """Mean seconds per call of a Python callable. The mean here: the reference's calls vary by
    themselves (a Sokoban search takes 1 ms or 1 s), and throughput is what a user gets."""
    fn()
    calls, start = 0, time.perf_counter()
    while calls < 10 or time.perf_counter() - start < min_seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def _import_gym_sokoban():
    """gym_sokoban's env and generator, or None. gym_sokoban 0.0.6 imports pkg_resources,
    which new setuptools no longer ship: give it a minimal stand-in (file lookup only)."""
    if importlib.util.find_spec("gym_sokoban") is None:
        return None
    if "pkg_resources" not in sys.modules and importlib.util.find_spec("pkg_resources") is None:
        shim = types.ModuleType("pkg_resources")

        def resource_filename(package, path):
            spec = importlib.util.find_spec(package)
            base = spec.submodule_search_locations[0] if spec.submodule_search_locations else os.path.dirname(spec.origin)
            return os.path.join(base, path)

        shim.resource_filename = resource_filename
        sys.modules["pkg_resources"] = shim
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from gym_sokoban.envs.room_utils import generate_room
            from gym_sokoban.envs.sokoban_env import SokobanEnv
        except Exception as err:  # an optional comparison: report why it is skipped
            print(f"gym_sokoban unusable: {err!r}", file=sys.stderr)
            return None
    return SokobanEnv, generate_room


def bench_gym_sokoban(dim, num_boxes, min_seconds):
    imported = _import_gym_sokoban()
    if imported is None:
        return None
    SokobanEnv, generate_room = imported
    symbols = "#_O√XPS"

    class TextSokoban(SokobanEnv):
        """gym_sokoban with RAGEN's text observation instead of an RGB image."""

        def render(self, mode=None, close=None, scale=1):
            room = np.where((self.room_state == 5) & (self.room_fixed == 2), 6, self.room_state)
            return "\n".join("".join(symbols[c] for c in row) for row in room.tolist())

    def new_level():
        # Like RAGEN: a failed generation is retried with another seed.
        while True:
            try:
                return generate_room(dim=dim, num_steps=int(1.7 * sum(dim)), num_boxes=num_boxes)
            except (RuntimeError, RuntimeWarning):
                continue

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while True:  # the constructor generates a level too, and may fail the same way
            try:
                env = TextSokoban(dim_room=dim, num_boxes=num_boxes, max_steps=10**9)
                break
            except (RuntimeError, RuntimeWarning):
                continue
        rng = np.random.default_rng(0)
        actions = rng.integers(1, 5, 10000).tolist()
        i = [0]

        def one_step():  # SokobanEnv.step renders through self.render: the text above
            i[0] += 1
            env.step(actions[i[0] % 10000])

        return {
            "impl": f"gym_sokoban {dim[0]}x{dim[1]}, {num_boxes} box(es); reset = generate_room "
            "(DFS depth 300); step = SokobanEnv.step + text render",
            "resets_per_s": 1 / _timed_loop(new_level, min_seconds),
            "steps_per_s": 1 / _timed_loop(one_step, min_seconds),
        }


# ------------------------------------------------------------------ main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, help="one batch size, JAX envs only")
    parser.add_argument("--all", action="store_true", help="batch 1, 64, 4096 and the Python references (default)")
    parser.add_argument("--envs", default=",".join(envs.NAMES), help="comma-separated env names")
    parser.add_argument("--scan", type=int, default=16, help="steps per jitted call in the step timing")
    parser.add_argument("--seconds", type=float, default=1.0, help="minimum timed seconds per figure")
    args = parser.parse_args()
    names = [n for n in args.envs.split(",") if n]
    device = f"{jax.devices()[0].platform} ({jax.device_count()} device, {os.cpu_count()} cpu cores, {platform.processor() or platform.machine()})"
    print(f"device: {device}", file=sys.stderr)

    if args.batch is not None and not args.all:
        result = {}
        for name in names:
            r = bench_jax(name, args.batch, args.scan, args.seconds)
            print(f"{name:28s} batch {args.batch:5d}: {r['steps_per_s']:14,.0f} steps/s  {r['resets_per_s']:12,.0f} resets/s", file=sys.stderr)
            result[name] = {"steps_per_s": r["steps_per_s"], "resets_per_s": r["resets_per_s"]}
        print(json.dumps(result))
        return

    jax_results = {}
    for name in names:
        jax_results[name] = {}
        for batch in ALL_BATCHES:
            r = bench_jax(name, batch, args.scan, args.seconds)
            jax_results[name][str(batch)] = r
            print(
                f"{name:28s} batch {batch:5d}: {r['steps_per_s']:14,.0f} steps/s "
                f"({r['steps_per_s_per_call']:12,.0f} one call per step)  {r['resets_per_s']:12,.0f} resets/s",
                file=sys.stderr,
            )

    python = {}
    references = {
        "FrozenLake": lambda: bench_gymnasium_frozen_lake(args.seconds * 2),
        "SimpleSokoban": lambda: bench_gym_sokoban((6, 6), 1, args.seconds * 2),
        "LargerSokoban": lambda: bench_gym_sokoban((8, 8), 2, args.seconds * 4),
        "Countdown": lambda: bench_python_countdown(args.seconds * 2),
        "Game2048": lambda: bench_python_2048(args.seconds * 2),
        "SimpleSudoku": lambda: bench_python_sudoku(args.seconds * 2),
    }
    for name, run in references.items():
        if name not in names:
            continue
        r = run()
        if r is None:
            print(f"{name}: Python reference not installed, skipped", file=sys.stderr)
            continue
        python[name] = r
        print(f"{name:28s} Python     : {r['steps_per_s']:14,.0f} steps/s  {r['resets_per_s']:12,.0f} resets/s  [{r['impl']}]", file=sys.stderr)

    largest = str(ALL_BATCHES[-1])
    speedup = {
        name: {
            "steps": jax_results[name][largest]["steps_per_s"] / ref["steps_per_s"],
            "resets": jax_results[name][largest]["resets_per_s"] / ref["resets_per_s"],
        }
        for name, ref in python.items()
    }
    for name, s in speedup.items():
        print(f"{name:28s} speed-up at batch {largest}: steps x{s['steps']:,.0f}, resets x{s['resets']:,.0f}", file=sys.stderr)
    print(json.dumps({"device": device, "jax": jax_results, "python_reference": python, f"speedup_at_batch_{largest}": speedup}))


if __name__ == "__main__":
    main()
