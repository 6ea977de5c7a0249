"""Move accuracy of a trained FrozenLake policy, turn by turn: where is its most likely answer an
optimal move? What `launch/eval.py`'s success does not show: which turns, distances to the goal
and cases the policy gets wrong. (Training is launch/sft.py or launch/train.py; this only scores.)

    python -m experiments.lake_moves --run=runs/frozenlake_tiny_sft
    python -m experiments.lake_moves --run=runs/frozenlake_tiny --levels=1024 --eps=0

Levels come from the validation stream (seeds 0..levels-1). A scripted player plays them through
the run's own dialogue (`rollout.make_scripted_rollout`): each turn the solver's move
(`envs.solvers.next_moves`) or, with probability --eps, a uniform random one, so that states off
the solver's path are scored too. At each reply the policy's answer is the most likely of the
action answers (`Left</answer>`, ...: one token each, as a tiny model's tokenizer makes them,
after the prompt's `<answer>`; a run that thinks first is refused), right if it is in the
optimal set (`envs.solvers.optimal_moves`: every move one step closer to the goal). Printed: move
accuracy per turn, by shortest distance to the goal, where the goal is diagonal and a hole next
to the player blocks one of the two ways towards it (a grid-blind policy gets these right half
the time) and elsewhere. Non-slippery lakes only. The last line is JSON.

Run from the repository root: `python -m` puts it on the import path.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import envs
from envs import frozenlake, solvers
from starpo import model as model_lib
from starpo import experiment, rollout, run_config, scripted

DELTAS = ((0, -1), (1, 0), (0, 1), (-1, 0))  # row/col offset of Left, Down, Right, Up (the env's)


def hole_blocks_diagonal(grid, pos) -> bool:
    """The goal is diagonal from `pos` (a different row and column) and exactly one of the two
    moves towards it lands in a hole."""
    goal = np.argwhere(grid == frozenlake.GOAL)[0]
    dr, dc = int(np.sign(goal[0] - pos[0])), int(np.sign(goal[1] - pos[1]))
    if dr == 0 or dc == 0:
        return False
    return bool(grid[pos[0] + dr, pos[1]] == frozenlake.HOLE) != bool(
        grid[pos[0], pos[1] + dc] == frozenlake.HOLE)


def play_levels(config, tokenizer, levels: int, eps: float, seed: int):
    """The scripted episodes: (traj, {grid [L,n,n], and per turn pos [L,M,2], optimal [L,M,4],
    distance [L,M] (-1: no such turn), case [L,M], move [L,M]})."""
    env = run_config.make_env(config, config.env.name)
    if not isinstance(env, envs.FrozenLake) or env.is_slippery:
        raise ValueError(f"{config.env.name} with these options is not a non-slippery FrozenLake")
    spec = run_config.rollout_spec(config)
    if spec.thinking:
        raise ValueError("the run thinks before it answers (rollout.enable_think): its first "
                         "reply token is not the answer")
    n, M = env.size, spec.max_turn
    (state,), _ = rollout.mixed_initial_states(((env, levels),), jax.random.key(0), 0,
                                               rollout.VALIDATION, 1)
    grids, starts = np.asarray(state.grid), np.asarray(state.pos)
    cells = jnp.asarray(np.stack(np.divmod(np.arange(n * n), n), 1).astype(np.int32))

    def per_cell(grid):  # [n*n, 4] optimal moves and [n*n] distance with the player on each cell
        goal = jnp.argwhere(grid == frozenlake.GOAL, size=1)[0].astype(jnp.int32)

        def one(pos):
            return (solvers.optimal_moves(env, envs.FrozenLakeState(grid=grid, pos=pos)),
                    envs.shortest_path_length(grid, pos, goal))

        return jax.vmap(one)(cells)

    optimal_at, distance_at = map(np.asarray, jax.jit(jax.vmap(per_cell))(jnp.asarray(grids)))
    rng = np.random.default_rng(seed)
    out = {"pos": np.zeros((levels, M, 2), int), "optimal": np.zeros((levels, M, 4), bool),
           "distance": np.full((levels, M), -1), "case": np.zeros((levels, M), bool),
           "move": np.full((levels, M), -1), "grid": grids}
    replies = []
    for b in range(levels):
        pos, rs = tuple(int(x) for x in starts[b]), []
        for k in range(M):
            cell = pos[0] * n + pos[1]
            opt = optimal_at[b, cell]
            if not opt.any():  # a cut-off start (never generated) ends the scoring
                break
            move = (int(rng.integers(4)) if rng.random() < eps else int(np.argmax(opt)))
            out["pos"][b, k], out["optimal"][b, k], out["move"][b, k] = pos, opt, move
            out["distance"][b, k] = distance_at[b, cell]
            out["case"][b, k] = hole_blocks_diagonal(grids[b], pos)
            rs.append(env.action_names[move] + "</answer>")
            pos = tuple(int(x) for x in np.clip(np.add(pos, DELTAS[move]), 0, n - 1))
            if grids[b][pos] != frozenlake.FROZEN:  # a hole or the goal ends the episode
                break
        replies.append(rs)
    play, _ = rollout.make_scripted_rollout(env, tokenizer, spec)
    ids, lens, stops = scripted.script_replies(tokenizer, replies, M, spec.max_new_tokens)
    traj, _, _ = play(state, jnp.asarray(ids), jnp.asarray(lens), jnp.asarray(stops),
                      jax.random.key(1))
    return traj, out


def answer_tokens(env, tokenizer) -> np.ndarray:
    ids = [tokenizer.encode(name + "</answer>") for name in env.action_names]
    if any(len(i) != 1 for i in ids):
        raise ValueError("the answers are not single tokens of this tokenizer (a tiny model's "
                         "are): scoring reads the first reply token")
    return np.array([i[0] for i in ids])


def score(config, policy, levels: int = 512, eps: float = 0.3, seed: int = 0) -> dict:
    """Move accuracy of `policy` on scripted levels (module docstring); "moves" holds the
    arrays it is computed from (per turn right, live, the policy's choice; the dialogue's
    tokens and turn_end; play_levels' arrays)."""
    env = run_config.make_env(config, config.env.name)
    answers = answer_tokens(env, policy.tokenizer)
    traj, moves = play_levels(config, policy.tokenizer, levels, eps, seed)
    cfg = policy.cfg

    @jax.jit
    def choices(params, tokens, length, turn_end):
        valid = jnp.arange(tokens.shape[1])[None] < length[:, None]
        h, _ = model_lib.hidden_states(params, cfg, tokens, valid)
        h = jnp.take_along_axis(h, jnp.maximum(turn_end - 1, 0)[..., None], axis=1)
        logits = model_lib.head_logits(params, cfg, h).astype(jnp.float32)
        return jnp.argmax(logits[..., answers], -1)  # [L, M]: the policy's answer per turn

    choice = np.asarray(choices(policy.params, traj.tokens, traj.length, traj.turn_end))
    live = (moves["distance"] > 0) & (np.asarray(traj.turn_end) >= 0)
    right = np.take_along_axis(moves["optimal"], choice[..., None], -1)[..., 0] & live
    moves.update(right=right, live=live, choice=choice, tokens=np.asarray(traj.tokens),
                 turn_end=np.asarray(traj.turn_end))

    def acc(mask):
        return round(float(right[mask].sum() / mask.sum()), 3) if mask.any() else None

    M = live.shape[1]
    return {"levels": levels, "eps": eps, "moves": moves,
            "accuracy": acc(live),
            "by_turn": [acc(live & (np.arange(M) == k)) for k in range(M)],
            "by_distance": {int(d): acc(live & (moves["distance"] == d))
                            for d in sorted(set(moves["distance"][live].tolist()))},
            "hole_blocks_diagonal": acc(live & moves["case"]),
            "elsewhere": acc(live & ~moves["case"]),
            "hole_blocks_diagonal_share": round(float((live & moves["case"]).sum()
                                                      / live.sum()), 3)}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--run", required=True, help="a FrozenLake run's workdir or checkpoint")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--levels", type=int, default=512)
    p.add_argument("--eps", type=float, default=0.3, help="share of random scripted moves")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        config, policy, _ = experiment.load_run(a.run, a.step)
        r = score(config, policy, a.levels, a.eps, a.seed)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    r.pop("moves")
    print(f"{policy.source}: move accuracy {r['accuracy']} on {a.levels} levels (eps {a.eps}); "
          f"per turn {r['by_turn']}")
    print("by shortest distance to the goal:", r["by_distance"])
    print(f"where a hole blocks one way to a diagonal goal: {r['hole_blocks_diagonal']} "
          f"({r['hole_blocks_diagonal_share']:.1%} of moves); elsewhere: {r['elsewhere']}")
    print(json.dumps(dict(run=a.run, source=policy.source, **r)))


if __name__ == "__main__":
    main()
