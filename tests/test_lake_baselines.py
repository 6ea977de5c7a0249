"""experiments/lake_baselines.py's exact success figures against independent references."""

import jax
import jax.numpy as jnp
import numpy as np

import envs
from configs.frozenlake import OPTIONS
from experiments import lake_baselines
from starpo import rollout


def test_non_slippery_solver_success_is_the_share_of_levels_within_reach():
    """Without slips the solver walks a shortest path: its exact success is the share of levels
    whose shortest hole-free path takes at most `moves` moves (envs.shortest_path_length, a
    BFS); the optimum equals it, and the best constant move is the best of the four."""
    levels, moves = 32, 3
    got = lake_baselines.exact_success(levels, moves, slippery=False)
    env = envs.make("FrozenLake", **{**OPTIONS, "is_slippery": False})
    states, _ = rollout.initial_states(env, jax.random.key(0), jnp.int32(0), rollout.VALIDATION,
                                       levels, 1)
    lengths = [int(env.shortest_path(jax.tree_util.tree_map(lambda x: x[i], states)))
               for i in range(levels)]
    want = np.mean([0 < n <= moves for n in lengths])
    assert got["solver"] == got["optimum"] == round(float(want), 4)
    assert got["best constant move"] == max(got[f"constant {a}"] for a in env.action_names)
    assert got["best constant move"] < got["solver"]


def test_slippery_figures_are_ordered_and_below_the_non_slippery_ones():
    slip = lake_baselines.exact_success(16, 3, slippery=True)
    assert slip["optimum"] >= slip["solver"] >= slip["best constant move"] > 0
    assert slip["solver"] < lake_baselines.exact_success(16, 3, slippery=False)["solver"]


def test_the_slippery_solver_on_the_non_slippery_lake_is_its_moves_played_there():
    """The row a model trained on the paper's lake is read against on RAGEN-2's: the slippery
    env's solver asked for a move at each cell, the move played by the non-slippery env's own
    step (one outcome a level, no slips), success counted."""
    from envs import solvers

    levels, moves = 32, 5
    got = lake_baselines.exact_success(levels, moves, slippery=False)["slippery lake's solver"]
    slippery = envs.make("FrozenLake", **{**OPTIONS, "is_slippery": True})
    plain = envs.make("FrozenLake", **{**OPTIONS, "is_slippery": False})
    states, _ = rollout.initial_states(plain, jax.random.key(0), jnp.int32(0), rollout.VALIDATION,
                                       levels, 1)
    plan = jax.jit(lambda s: solvers.next_moves(slippery, s, 1))
    step = jax.jit(plain.step)
    wins = 0
    for i in range(levels):
        s = jax.tree_util.tree_map(lambda x: x[i], states)
        for _ in range(moves):
            names, n = plan(s)
            if int(n) == 0:
                break
            action = plain.action_names.index(solvers.move_names(slippery)[int(names[0])]) + 1
            s, _, done, info = step(jax.random.key(0), s, action)
            if bool(info["success"]) or bool(done):
                wins += bool(info["success"])
                break
    assert got == round(wins / levels, 4)
    assert got < lake_baselines.exact_success(levels, moves, slippery=False)["solver"]


def test_the_budget_optimum_equals_a_search_over_every_move_sequence():
    """budget_optimum against a plain recursion: at each turn every sequence of 1..per_turn
    moves is tried, its expectation taken over every slip of every move (a hole or the goal
    ends it), the next turn from where it leaves the player. With one move a turn it is
    `success`'s optimum; without slips, the share of levels whose shortest path fits the
    budget."""
    import functools
    import itertools

    from envs import frozenlake

    env = envs.make("FrozenLake", **{**OPTIONS, "is_slippery": True})
    states, _ = rollout.initial_states(env, jax.random.key(0), jnp.int32(0), rollout.VALIDATION,
                                       6, 1)
    turns, per_turn, per_episode = 3, 3, 5
    for grid, start in zip(np.asarray(states.grid), np.asarray(states.pos)):
        n = grid.shape[0]

        def moved(cell, a):
            dr, dc = np.asarray(frozenlake._DELTAS)[a % 4]
            return min(max(cell[0] + dr, 0), n - 1), min(max(cell[1] + dc, 0), n - 1)

        @functools.cache
        def best(cell, t, k):
            if grid[cell] == frozenlake.GOAL:
                return 1.0
            if grid[cell] == frozenlake.HOLE or t == 0 or k == 0:
                return 0.0

            def play(cell, seq):
                if grid[cell] != frozenlake.FROZEN:
                    return float(grid[cell] == frozenlake.GOAL)
                if not seq:
                    return best(cell, t - 1, k - used)
                return sum(play(moved(cell, seq[0] + s), seq[1:]) for s in (-1, 0, 1)) / 3

            out = 0.0
            for used in range(1, min(per_turn, k) + 1):
                for seq in itertools.product(range(4), repeat=used):
                    out = max(out, play(cell, seq))
            return out

        cell = (int(start[0]), int(start[1]))
        want = best(cell, turns, per_episode)
        got = lake_baselines.budget_optimum(grid, start, turns, per_turn, per_episode)
        assert abs(got - want) < 1e-12, (got, want)
        assert abs(lake_baselines.budget_optimum(grid, start, 4, 1, 10)
                   - lake_baselines.success(grid, start, 4, None)) < 1e-12
        assert got >= lake_baselines.success(grid, start, turns, None) - 1e-12
    plain = lake_baselines.exact_success(32, 2, slippery=False, per_turn=3, per_episode=5)
    env = envs.make("FrozenLake", **{**OPTIONS, "is_slippery": False})
    states, _ = rollout.initial_states(env, jax.random.key(0), jnp.int32(0), rollout.VALIDATION,
                                       32, 1)
    lengths = [int(env.shortest_path(jax.tree_util.tree_map(lambda x: x[i], states)))
               for i in range(32)]
    assert plain["budget optimum"] == round(float(np.mean([0 < m <= 5 for m in lengths])), 4)


def test_a_bad_flag_is_one_line_before_any_work():
    """--moves=-1 once recursed 1,807 lines deep, --levels=0 printed a table of NaNs: each
    count is at least 1, and a bad value is one line `error: ...`, exit status 2
    (`starpo.cli.run`, as every command line of the repository)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-m", "experiments.lake_baselines", "--moves=-1"],
                       cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: flag --moves=-1: -1 is not a positive integer"], p.stderr
