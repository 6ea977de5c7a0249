"""Exact success of simple policies on the slippery lake's held-out levels, to read the SFT
figures against (issue 23): the expectation over every slip, not one sampled episode a level.

    python -m experiments.lake_baselines                   # configs/frozenlake.py:cpu, 256 levels
    python -m experiments.lake_baselines --levels=32 --moves=5
    python -m experiments.lake_baselines --moves=5 --noslippery   # RAGEN-2's default lake

Levels are the validation set's (`launch/eval.py --groups=N`: seeds 0..N-1 of the validation
stream). Each policy plays one move a turn for --moves turns (a move slips to either side with
p 1/3 each), except the budget optimum: the ceiling of any policy with the env's budget
(--per_turn moves written each turn, the grid seen once a turn, --per_episode in all; 5 turns:
0.48 on the slippery lake's 256 levels against the one-move-a-turn optimum's 0.28), which the
solver's demonstrations play (starpo/demos.py, `envs.solvers.lake_budget_moves`). Policies:
the --moves optimum (the ceiling of any one-move-a-turn policy), the solver (envs/solvers.py:
the move that maximises the probability of ever reaching the goal), "towards the goal" (along
the larger gap to it, blind to holes), and each constant move (blind to the grid). A sampled
figure on N levels has a standard error of about sqrt(p (1 - p) / N): 0.024 at p = 0.2,
N = 256.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import envs
from configs.frozenlake import OPTIONS
from envs import frozenlake, solvers
from starpo import cli, rollout

flags.DEFINE_integer("levels", 256, "Held-out levels (validation seeds 0..levels-1).",
                     lower_bound=1)
flags.DEFINE_integer("moves", 3, "Moves, one a turn (the cpu config's rollout.max_turn).",
                     lower_bound=1)
flags.DEFINE_bool("slippery", True, "The paper's slippery lake (else every move goes where meant).")
flags.DEFINE_integer("per_turn", 5, "Moves a turn of the budget optimum (the env's budget).",
                     lower_bound=1)
flags.DEFINE_integer("per_episode", 10, "Moves an episode of the budget optimum (the env's).",
                     lower_bound=1)
FLAGS = flags.FLAGS


def success(grid, pos, moves, policy, slippery: bool = True):
    """P(on the goal within `moves` moves) from `pos` under `policy(cell, moves_left)` (an
    action index into action_names; None = the best action at every cell: the optimum)."""
    n = grid.shape[0]
    deltas = np.asarray(frozenlake._DELTAS)
    slips = (-1, 0, 1) if slippery else (0,)

    @functools.cache
    def value(r, c, k):
        if grid[r, c] == frozenlake.GOAL:
            return 1.0
        if grid[r, c] != frozenlake.FROZEN or k == 0:
            return 0.0

        def q(a):  # the realised direction is a + slip, each slip alike, as env.move
            out = 0.0
            for slip in slips:
                dr, dc = deltas[(a + slip) % 4]
                out += value(min(max(r + dr, 0), n - 1), min(max(c + dc, 0), n - 1), k - 1)
            return out / len(slips)

        return max(q(a) for a in range(4)) if policy is None else q(policy((r, c), k))

    return value(int(pos[0]), int(pos[1]), moves)


def budget_optimum(grid, pos, turns: int, per_turn: int, per_episode: int,
                   slippery: bool = True) -> float:
    """P(on the goal) of the best policy under the env's action budget: `turns` turns, each
    an open-loop sequence of 1..`per_turn` moves chosen from the cell the turn starts on (the
    model sees the grid once a turn), at most `per_episode` moves in all. A move slips as in
    `success`; a hole or the goal ends the episode mid-sequence. With per_turn=1 it equals
    `success`'s optimum for min(turns, per_episode) moves.

    Exact: for every sequence s (4 + 16 + ... + 4^per_turn of them) the matrix A_s of the mass
    still on frozen cells after it, row c from cell c, and g_s, the mass that reached the goal
    on the way; then V[t, k] = max_s g_s + A_s V[t - 1, k - |s|] over cells, turn by turn."""
    n = grid.shape[0]
    flat = grid.reshape(-1)
    frozen = (flat == frozenlake.FROZEN).astype(np.float64)
    deltas = np.asarray(frozenlake._DELTAS)
    step = np.zeros((4, n * n, n * n))  # step[a, c, c']: P(c -> c') for move a, from frozen c
    for r in range(n):
        for c in range(n):
            if grid[r, c] != frozenlake.FROZEN:
                continue
            for a in range(4):
                for slip in (-1, 0, 1) if slippery else (0,):
                    dr, dc = deltas[(a + slip) % 4]
                    to = min(max(r + dr, 0), n - 1) * n + min(max(c + dc, 0), n - 1)
                    step[a, r * n + c, to] += 1 / (3 if slippery else 1)
    goal = (flat == frozenlake.GOAL).astype(np.float64)
    live, gain = (np.eye(n * n) * frozen)[None], np.zeros((1, n * n))  # the empty sequence
    mats, gains = [], []
    for _ in range(per_turn):  # sequence s * 4 + a: s, then move a
        moved = np.einsum("scd,ade->sace", live, step).reshape(-1, n * n, n * n)
        gain = np.repeat(gain, 4, axis=0) + moved @ goal
        live = moved * frozen
        mats.append(live)
        gains.append(gain)
    mats, gains = np.concatenate(mats), np.concatenate(gains)
    lengths = np.repeat(np.arange(1, per_turn + 1), [4 ** m for m in range(1, per_turn + 1)])
    behind = np.arange(per_episode + 1)[None, :] - lengths[:, None]  # [S, K+1]: moves left after
    rows = np.arange(len(lengths))[:, None]
    value = np.zeros((per_episode + 1, n * n))  # V[t - 1, k] for k moves left; V[0] = 0
    for _ in range(turns):
        after = (mats @ value.T).transpose(0, 2, 1)[rows, np.clip(behind, 0, None)]
        value = np.where((behind >= 0)[..., None], gains[:, None, :] + after, 0.0).max(axis=0)
    return float(value[per_episode, int(pos[0]) * n + int(pos[1])])


def exact_success(levels: int, moves: int, slippery: bool = True, per_turn: int = 5,
                  per_episode: int = 10) -> dict:
    """{policy: mean exact success} over validation levels 0..levels-1 of the lake (the
    frozenlake configs' OPTIONS, `slippery` or not), one move a turn for `moves` turns:
    "optimum", "solver", "towards the goal", "constant <move>", "best constant move" and, on
    the non-slippery lake, "slippery lake's solver"; and "budget optimum": the best policy
    with up to `per_turn` moves in each of those turns, `per_episode` in all
    (`budget_optimum`; the envs' budget is 5 and 10)."""
    env = envs.make("FrozenLake", **{**OPTIONS, "is_slippery": slippery})
    states, _ = rollout.initial_states(env, jax.random.key(0), jnp.int32(0), rollout.VALIDATION,
                                       levels, 1)
    grids, starts = np.asarray(states.grid), np.asarray(states.pos)
    n = env.size
    cells = jnp.asarray([(r, c) for r in range(n) for c in range(n)], jnp.int32)
    def planner(e):  # the solver's move from every cell of a grid
        return jax.jit(jax.vmap(lambda g, p: solvers.next_moves(
            e, frozenlake.FrozenLakeState(grid=g, pos=p), 1)[0][0], in_axes=(None, 0)))

    plan = planner(env)
    # on the non-slippery lake also the slippery lake's solver (what a model trained on the
    # paper's lake plays there): it steps sideways around holes that cannot be slid into
    plan_slippery = None if slippery else planner(
        envs.make("FrozenLake", **{**OPTIONS, "is_slippery": True}))
    deltas = [tuple(d) for d in np.asarray(frozenlake._DELTAS).tolist()]

    def towards(grid):
        goal = np.argwhere(grid == frozenlake.GOAL)[0]

        def policy(cell, k):
            dr, dc = goal[0] - cell[0], goal[1] - cell[1]
            return deltas.index((int(np.sign(dr)), 0) if abs(dr) >= abs(dc)
                                else (0, int(np.sign(dc))))
        return policy

    rows = {"budget optimum": [], "optimum": [], "solver": [], "towards the goal": []}
    if plan_slippery is not None:
        rows["slippery lake's solver"] = []
    rows.update({f"constant {a}": [] for a in env.action_names})
    for grid, start in zip(grids, starts):
        table = np.asarray(plan(jnp.asarray(grid), cells)).reshape(n, n)
        rows["budget optimum"].append(budget_optimum(grid, start, moves, per_turn, per_episode,
                                                     slippery))
        rows["optimum"].append(success(grid, start, moves, None, slippery))
        rows["solver"].append(success(grid, start, moves, lambda cell, k, t=table: t[cell],
                                      slippery))
        rows["towards the goal"].append(success(grid, start, moves, towards(grid), slippery))
        if plan_slippery is not None:
            other = np.asarray(plan_slippery(jnp.asarray(grid), cells)).reshape(n, n)
            rows["slippery lake's solver"].append(
                success(grid, start, moves, lambda cell, k, t=other: t[cell], slippery))
        for i, a in enumerate(env.action_names):
            rows[f"constant {a}"].append(success(grid, start, moves, lambda cell, k, i=i: i,
                                                 slippery))
    out = {k: round(float(np.mean(v)), 4) for k, v in rows.items()}
    out["best constant move"] = max(out[f"constant {a}"] for a in env.action_names)
    return out


def main(argv):
    del argv
    out = exact_success(FLAGS.levels, FLAGS.moves, FLAGS.slippery, FLAGS.per_turn,
                        FLAGS.per_episode)
    for k, v in out.items():
        print(f"{k:22s} {v:.4f}  ({v / out['solver']:.0%} of the solver)")
    print(json.dumps({"levels": FLAGS.levels, "moves": FLAGS.moves, "slippery": FLAGS.slippery,
                      "per_turn": FLAGS.per_turn, "per_episode": FLAGS.per_episode,
                      "success": out}))


if __name__ == "__main__":
    cli.run(main)  # a bad flag: one line `error: ...`
