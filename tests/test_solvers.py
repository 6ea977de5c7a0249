"""envs/solvers.py against slow Python/NumPy references: plan lengths, played-out plans, values."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from envs import solvers

# ------------------------------------------------------------------ slow references

LAKE_DELTAS = [(0, -1), (1, 0), (0, 1), (-1, 0)]  # gymnasium LEFT, DOWN, RIGHT, UP


def lake_target(n, r, c, d):
    dr, dc = LAKE_DELTAS[d % 4]
    return min(max(r + dr, 0), n - 1), min(max(c + dc, 0), n - 1)


def lake_bfs(grid, start):
    """Fewest moves from `start` to the goal over non-hole cells (holes and goal absorb), -1."""
    n = len(grid)
    if grid[start[0]][start[1]] == 2:
        return 0
    seen, frontier = {tuple(start)}, collections.deque([(tuple(start), 0)])
    while frontier:
        (r, c), d = frontier.popleft()
        if grid[r][c] != 0:
            continue  # a hole (the goal returned on arrival)
        for a in range(4):
            nxt = lake_target(n, r, c, a)
            if nxt in seen:
                continue
            if grid[nxt[0]][nxt[1]] == 2:
                return d + 1
            seen.add(nxt)
            frontier.append((nxt, d + 1))
    return -1


def lake_transitions(grid):
    """float64[4, N, N]: P[a, s, s'] of the slippery lake (absorbing holes and goal)."""
    n = len(grid)
    P = np.zeros((4, n * n, n * n))
    for r in range(n):
        for c in range(n):
            s = r * n + c
            for a in range(4):
                if grid[r][c] != 0:
                    P[a, s, s] = 1.0
                    continue
                for slip in (-1, 0, 1):
                    tr, tc = lake_target(n, r, c, a + slip)
                    P[a, s, tr * n + tc] += 1 / 3
    return P


def lake_values(grid, policy=None, steps=None):
    """Probability of reaching the goal per cell: maximal (policy None) or under the stationary
    `policy` (int[N] action index), unbounded or within `steps` moves; value iteration from 0."""
    grid = np.asarray(grid)
    P = lake_transitions(grid)
    goal = (grid.reshape(-1) == 2).astype(float)
    v = goal.copy()
    for i in range(steps or 10**6):
        q = P @ v  # [4, N]
        new = q.max(0) if policy is None else q[policy, np.arange(len(v))]
        new = np.where(grid.reshape(-1) == 0, new, goal)
        if steps is None and np.abs(new - v).max() < 1e-13:
            return new
        v = new
    return v


def vmapped(f):
    return jax.jit(jax.vmap(f))


# One unbatched state (env and max_moves static: compiled once per env and plan length).
plan_of = jax.jit(solvers.next_moves, static_argnums=(0, 2))
success_of = jax.jit(solvers.solver_success, static_argnums=0)


def plan_batch(env, states, max_moves):
    """(names, n, success) of a batch of states, in one compiled program."""
    both = vmapped(lambda s: (*solvers.next_moves(env, s, max_moves), solvers.solver_success(env, s)))
    return both(states)


def split(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


def every_cell(states, size):
    """Each state copied with the player on every cell: a batch of len(states) * size**2."""
    cells = np.stack(np.divmod(np.arange(size * size), size), axis=1).astype(np.int32)
    b = states.pos.shape[0]
    grid = jnp.repeat(states.grid, size * size, axis=0)
    pos = jnp.asarray(np.tile(cells, (b, 1)))
    return envs.FrozenLakeState(grid=grid, pos=pos)


# ------------------------------------------------------------------ FrozenLake, not slippery


@pytest.mark.parametrize("size,levels", [(3, 200), (4, 200), (5, 40)])
def test_lake_shortest_plans_match_bfs_and_reach_the_goal(size, levels):
    """From every cell of generated non-slippery lakes (the tiny config is 3x3): n is the BFS
    distance (0 when unreachable, in a hole or on the goal), the first move is the first action
    in name order one step closer, and playing the plan lands on the goal at its last move."""
    env = envs.make("FrozenLake", size=size, is_slippery=False)
    starts = vmapped(env.reset)(jax.random.split(jax.random.key(size), levels))
    states = every_cell(starts, size)
    plan = size * size
    names, n, success = plan_batch(env, states, plan)
    short = vmapped(lambda s: solvers.next_moves(env, s, 2))(states)
    optimal = np.asarray(vmapped(lambda s: solvers.optimal_moves(env, s))(states))

    def play(state, moves):
        def body(s, a):
            s, _, _, info = env.step(jax.random.key(0), s, env.name_to_action(s, a))
            return s, info["success"]

        return jax.lax.scan(body, state, moves)[1]

    reached = vmapped(play)(states, names)
    names, n, success, reached = map(np.asarray, (names, n, success, reached))
    grids, pos = np.asarray(states.grid), np.asarray(states.pos)
    unreachable = 0
    for i in range(len(n)):
        grid, (r, c) = grids[i].tolist(), pos[i]
        d = lake_bfs(grid, (r, c))
        live = grid[r][c] == 0 and d > 0
        unreachable += grid[r][c] == 0 and d < 0
        assert n[i] == (d if live else 0), (grid, r, c, d, n[i])
        assert success[i] == float(d >= 0 and grid[r][c] != 1)
        assert not names[i, n[i]:].any()
        prefix = np.where(np.arange(2) < n[i], names[i, :2], 0)
        np.testing.assert_array_equal(np.asarray(short[0][i]), prefix)
        if live:
            closer = [a for a in range(4) if lake_bfs(grid, lake_target(size, r, c, a)) == d - 1]
            assert names[i, 0] == closer[0] and np.flatnonzero(optimal[i]).tolist() == closer
            assert reached[i, n[i] - 1] and not reached[i, : n[i] - 1].any()
        else:
            assert not optimal[i].any()
    # every start is solvable (the generator's filter); other cells are sometimes cut off
    assert all(n.reshape(levels, -1)[np.arange(levels), np.asarray(starts.pos) @ [size, 1]] > 0)
    assert unreachable > 0


def test_lake_without_a_path_or_done_has_no_plan():
    for slippery in (False, True):
        env = envs.make("FrozenLake", size=4, is_slippery=slippery)
        for text in ("P_O_\n_O_G\nO___\n____", "__O_\n_OXG\nO___\n____", "__O_\n_O_√\nO___\n____"):
            state = env.from_text(text)
            names, n = plan_of(env, state, 4)
            assert int(n) == 0 and not np.asarray(names).any()
            assert float(success_of(env, state)) == (1.0 if "√" in text else 0.0)


# ------------------------------------------------------------------ FrozenLake, slippery


def test_slippery_values_and_policy_are_optimal():
    """Every cell of generated slippery lakes (the paper's 4x4): solver_success equals NumPy's
    maximal reach probability, and the solver's stationary policy (one move, n = 1 iff the value
    is > 0) achieves it: its own exact value is the same."""
    size, levels = 4, 100
    env = envs.make("FrozenLake", size=size, is_slippery=True)
    starts = vmapped(env.reset)(jax.random.split(jax.random.key(10 + size), levels))
    states = every_cell(starts, size)
    names, n, value = plan_batch(env, states, 3)
    cells = size * size
    names, n = np.asarray(names).reshape(levels, cells, 3), np.asarray(n).reshape(levels, cells)
    optimal = np.asarray(vmapped(lambda s: solvers.optimal_moves(env, s))(states)).reshape(
        levels, cells, 4)
    value = np.asarray(value).reshape(levels, cells)
    assert not names[:, :, 1:].any()
    fractional, quick, quickest = 0, [], []
    for i in range(levels):
        grid = np.asarray(starts.grid[i])
        best = lake_values(grid)
        np.testing.assert_allclose(value[i], best, atol=1e-4)
        frozen = grid.reshape(-1) == 0
        np.testing.assert_array_equal(n[i], frozen & (best > 0))
        np.testing.assert_allclose(lake_values(grid, policy=names[i, :, 0]), best, atol=1e-4)
        # optimal_moves: maximal actions only, the solver's move among them, none without a plan
        q = lake_transitions(grid) @ best  # [4, N]
        assert np.all(~optimal[i].T | (q >= q.max(0) - 1e-4))
        assert np.array_equal(optimal[i].any(1), n[i] > 0)
        assert all(optimal[i, c, names[i, c, 0]] for c in np.flatnonzero(n[i]))
        fractional += np.sum((best > 0.01) & (best < 0.99))
        start = int(starts.pos[i, 0]) * size + int(starts.pos[i, 1])
        quick.append(lake_values(grid, policy=names[i, :, 0], steps=10)[start])
        quickest.append(lake_values(grid, steps=10)[start])
    assert fractional > 0  # the checks saw cells where slipping matters
    # The discounted tie-break is fast too: within a trajectory's 10 moves it succeeds nearly
    # as often as the best 10-move policy (0.508 vs 0.510 here; by rank alone 0.395).
    assert np.mean(quick) > 0.9 * np.mean(quickest), (np.mean(quick), np.mean(quickest))


def test_slippery_open_lake_is_solved():
    """A hole-free lake: every action has value 1, so only the rank tie-break makes progress
    (always Left, the first name, would never reach a goal on the right)."""
    env = envs.make("FrozenLake", size=5, is_slippery=True)
    state = env.from_text("P____\n_____\n_____\n_____\n____G")
    states = every_cell(jax.tree.map(lambda x: x[None], state), 5)
    names, n = vmapped(lambda s: solvers.next_moves(env, s, 1))(states)
    policy = np.asarray(names)[:, 0]
    np.testing.assert_allclose(lake_values(np.asarray(state.grid), policy=policy)[:-1], 1.0, atol=1e-6)
    assert np.asarray(n)[:-1].all() and not np.asarray(n)[-1]


def test_slippery_rollouts_succeed_as_often_as_the_value():
    """Monte Carlo through env.step, re-planning with next_moves after every slip: the success
    rate over 2000 episodes of 200 steps per level matches solver_success within 4 sigma (plus
    the exact chance, from NumPy, of still being on the ice after 200 steps)."""
    env = envs.make("FrozenLake", size=4, is_slippery=True)
    starts = vmapped(env.reset)(jax.random.split(jax.random.key(7), 64))
    value = np.asarray(vmapped(lambda s: solvers.solver_success(env, s))(starts))
    pick = np.flatnonzero((value > 0.05) & (value < 0.95))[:4]
    assert len(pick) == 4
    episodes, horizon = 2000, 200
    # The solver's move depends on (map, cell) only: tabulate it per cell for the simulation.
    table = np.asarray(vmapped(lambda s: solvers.next_moves(env, s, 1)[0][0])(
        every_cell(split(starts, pick), 4))).reshape(len(pick), 16)

    def episode(state, moves, key):
        def body(s, k):
            a = moves[s.pos[0] * 4 + s.pos[1]]
            s, _, _, info = env.step(k, s, env.name_to_action(s, a))
            return s, info["success"]

        return jax.lax.scan(body, state, jax.random.split(key, horizon))[1][-1]

    play = jax.jit(jax.vmap(episode, in_axes=(0, None, 0)))
    for j, i in enumerate(pick):
        level = jax.tree.map(lambda x, i=i: jnp.broadcast_to(x[i], (episodes, *x.shape[1:])), starts)
        keys = jax.random.split(jax.random.key(100 + j), episodes)
        won = np.asarray(play(level, jnp.asarray(table[j]), keys))
        grid, start = np.asarray(starts.grid[i]), int(starts.pos[i, 0] * 4 + starts.pos[i, 1])
        within = lake_values(grid, policy=table[j], steps=horizon)[start]
        assert value[i] - within < 0.01
        sigma = np.sqrt(value[i] * (1 - value[i]) / episodes)
        assert abs(won.mean() - value[i]) < 4 * sigma + (value[i] - within), (won.mean(), value[i])


def test_the_budget_plan_attains_the_budget_optimum():
    """The slippery lake under the env's budget (5 turns, up to 5 moves a turn, 10 in all):
    the policy that writes `lake_budget_plan`'s sequence each turn, evaluated exactly here
    (every slip of every move, a hole or the goal ending the sequence, the next turn planned
    from where it leaves the player with the moves left), succeeds exactly as often as
    experiments/lake_baselines.py's `budget_optimum`, an independent dynamic programme, and
    at least as often as one move a turn can; `lake_budget_moves` writes the plan's first
    turn. Also on a budget of 3 turns of up to 3 moves, 4 in all (the moves run out first)."""
    import itertools

    from experiments import lake_baselines

    env = envs.make("FrozenLake", size=4, is_slippery=True)
    starts = vmapped(env.reset)(jax.random.split(jax.random.key(3), 6))
    for turns, per_turn, per_episode in ((5, 5, 10), (3, 3, 4)):
        sequences = [seq for m in range(1, per_turn + 1)
                     for seq in itertools.product(range(4), repeat=m)]
        choice, _ = (np.asarray(x) for x in vmapped(
            lambda g, T=turns, A=per_turn, K=per_episode: solvers.lake_budget_plan(
                env, g, A, T, K))(starts.grid))
        names, n = (np.asarray(x) for x in vmapped(
            lambda s, T=turns, A=per_turn, K=per_episode: solvers.lake_budget_moves(
                env, s, T, K, A, T, K))(starts))
        for i in range(6):
            grid, start = np.asarray(starts.grid[i]), tuple(int(x) for x in starts.pos[i])

            @functools.cache
            def value(cell, t, k, i=i, grid=grid):
                r, c = divmod(cell, 4)
                if grid[r, c] != 0 or t == 0 or k == 0:
                    return float(grid[r, c] == 2)
                moves = sequences[choice[i, t - 1, k, cell]]
                assert len(moves) <= min(per_turn, k)

                def play(r, c, rest):
                    if grid[r, c] != 0:
                        return float(grid[r, c] == 2)
                    if not rest:
                        return value(r * 4 + c, t - 1, k - len(moves))
                    return sum(play(*lake_target(4, r, c, rest[0] + s), rest[1:])
                               for s in (-1, 0, 1)) / 3

                return play(r, c, moves)

            cell = start[0] * 4 + start[1]
            want = lake_baselines.budget_optimum(grid, start, turns, per_turn, per_episode)
            got = value(cell, turns, per_episode)
            assert abs(got - want) < 1e-5, (i, turns, got, want)
            one_a_turn = lake_baselines.success(grid, start, min(turns, per_episode), None)
            assert got >= one_a_turn - 1e-6
            if want > 0:
                first = sequences[choice[i, turns - 1, per_episode, cell]]
                assert tuple(names[i, :n[i]]) == first, (i, names[i], n[i], first)


# ------------------------------------------------------------------ Sokoban


@pytest.mark.parametrize("name,levels", [("SimpleSokoban", 200), ("LargerSokoban", 40)])
def test_sokoban_plans_match_bfs_and_solve(name, levels):
    """n equals envs.sokoban.solve's fewest moves and playing the moves solves the level at
    the last one, on generated levels (one box; two boxes in 8x8 rooms) and on states after 6
    random moves (some unsolvable). SokobanDifferentGridVocab (other symbols) plans alike."""
    env = envs.make(name)
    assert solvers.has_solver(env)
    keys = jax.random.split(jax.random.key(3), levels)
    fresh = vmapped(env.reset)(keys)

    def wander(state, key):
        actions = jax.random.randint(key, (6,), 1, 5)
        return jax.lax.scan(lambda s, a: (env.step(None, s, a)[0], None), state, actions)[0]

    walked = vmapped(wander)(fresh, keys)
    walked = walked.replace(steps=jnp.zeros_like(walked.steps))
    states = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), fresh, walked)
    names, n, success = plan_batch(env, states, env.max_steps)
    success = np.asarray(success)

    def play(state, moves):
        def body(s, a):
            s, _, _, info = env.step(None, s, env.name_to_action(s, a))
            return s, info["success"]

        return jax.lax.scan(body, state, moves)[1]

    solved = np.asarray(vmapped(play)(states, names))
    names, n = np.asarray(names), np.asarray(n)
    host = jax.tree.map(np.asarray, states)
    dead = 0
    for i in range(len(n)):
        best = envs.solve(split(host, i))
        assert n[i] == (0 if best == 0 else max(best, 0)), (env.to_text(split(host, i)), best, n[i])
        assert success[i] == float(best >= 0)
        assert not names[i, n[i]:].any()
        dead += best < 0
        if n[i]:
            assert solved[i, n[i] - 1] and not solved[i, : n[i] - 1].any()
    assert (n[:levels] > 0).all()
    if name == "LargerSokoban":
        return
    assert dead > 0  # the random moves pushed some boxes into dead ends
    vocab = envs.make("SokobanDifferentGridVocab")
    other = vmapped(lambda s: solvers.next_moves(vocab, s, vocab.max_steps))(states)
    np.testing.assert_array_equal(np.asarray(other[0]), names)


def test_sokoban_limits():
    """Steps left and box counts: a plan longer than the steps left does not count as a
    success; a done state, or one with two boxes in a one-box env, has no plan; three boxes, or
    two in a room larger than 10x10, have no solver."""
    env = envs.make("SimpleSokoban")
    state = env.from_text("######\n#P___#\n#__X_#\n#____#\n#___O#\n######")
    names, n = plan_of(env, state, 10)
    assert envs.solve(state) == 7 and int(n) == 7
    np.testing.assert_array_equal(np.asarray(plan_of(env, state, 3)[0]), names[:3])
    for steps, expect in ((93, 1.0), (94, 0.0), (100, 0.0)):
        assert float(success_of(env, state.replace(steps=jnp.int32(steps)))) == expect
    assert int(plan_of(env, state.replace(steps=jnp.int32(100)), 10)[1]) == 0
    two = env.from_text("######\n#P_X_#\n#_X__#\n#___O#\n#___O#\n######")
    assert int(plan_of(env, two, 10)[1]) == 0
    # A non-square room (rows != columns) with a long plan, played through env.step.
    wide = envs.make("SimpleSokoban", dim_x=5, dim_y=8)
    level = wide.from_text("########\n#O_#___#\n#__X__P#\n#__#___#\n########")
    names, n = plan_of(wide, level, 20)
    assert int(n) == envs.solve(level) == 7
    step = jax.jit(wide.step)
    for a in np.asarray(names)[: int(n)]:
        level, _, _, info = step(None, level, wide.name_to_action(level, a))
    assert bool(info["success"])
    assert solvers.has_solver(envs.make("LargerSokoban", dim_x=10, dim_y=10))
    # Two boxes: the DP holds the interior only, so floor on the border means no plan.
    larger = envs.make("LargerSokoban")
    rows = ["########", "#P_X_O_#", "#__X_O_#", "#______#", "#______#", "#______#", "#______#"]
    walled = larger.from_text("\n".join(rows + ["########"]))
    assert envs.solve(walled) == 8 and int(plan_of(larger, walled, 10)[1]) == 8
    open_border = larger.from_text("\n".join(rows + ["###_####"]))
    assert envs.solve(open_border) == 8 and int(plan_of(larger, open_border, 10)[1]) == 0
    for options in ({"num_boxes": 3}, {"dim_x": 12, "dim_y": 12}):
        larger = envs.make("LargerSokoban", **options)
        assert not solvers.has_solver(larger)
        with pytest.raises(ValueError, match="no solver"):
            solvers.next_moves(larger, state, 4)


# ------------------------------------------------------------------ Bandit


@pytest.mark.parametrize("name", ["Bandit", "BanditTest"])
def test_bandit_picks_the_high_risk_arm(name):
    """The high-risk arm (mean 0.25 > 0.1) in either arm order; nothing after the pull."""
    env = envs.make(name)
    assert env.action_names[1] == {"Bandit": "Dragon", "BanditTest": "Librarian"}[name]
    for high_first in (False, True):
        state = env.reset(jax.random.key(0)).replace(high_first=jnp.asarray(high_first))
        names, n = plan_of(env, state, 3)
        assert int(n) == 1 and np.asarray(names).tolist() == [1, 0, 0]
        assert float(success_of(env, state)) == 1.0
        after, _, _, info = env.step(jax.random.key(1), state, env.name_to_action(state, names[0]))
        assert bool(info["success"]) and int(after.pulled) == (1 if high_first else 2)
        assert int(plan_of(env, after, 3)[1]) == 0
        low, _, _, _ = env.step(jax.random.key(1), state, env.name_to_action(state, 0))
        assert float(success_of(env, low)) == 0.0
