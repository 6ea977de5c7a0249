"""Synthetic probe: how fast does a tiny model learn FrozenLake's optimal move from one grid, and
how much do earlier grids in the context slow it? (A ~1-4 minute bench on one core, cheaper and
more controlled than supervised training on the real dialogues, which is `launch/sft.py
--config=configs/frozenlake.py:tiny` then `launch/eval.py`: docs/training.md, "Supervised warm start".)

    python -m experiments.probe_grid                       # the current grid alone
    python -m experiments.probe_grid --history=2 --prefix=20   # two earlier grids before it

A sequence is `prefix` random filler tokens, then `history` earlier grids of the same lake with
the player elsewhere, each followed by `suffix` fixed template tokens (as the real dialogue's text
between a grid and the reply: 14 tokens), then the current grid, its template and a query token.
Grids are 3x3 (or --size) with one token per cell and a newline token between rows, so the cell
below the player is `size + 1` tokens on, as in the real dialogue. Levels: 80% frozen, goal and
player at random on reachable cells. The model is trained by cross-entropy on the optimal set
(every move one step closer to the goal: `envs.solvers.optimal_moves`) at the query, a fresh
batch per step; every 100 steps it prints move accuracy on 2048 held-out levels, split into the
case where the goal is diagonal and a hole beside the player blocks one direction towards it
(`hole_blocks_diagonal`) and the rest. The last line is JSON.

Run from the repository root: `python -m` puts it on the import path.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import envs
from envs import solvers
from starpo import cli
from starpo import model as model_lib

# token ids: cells by grid code (0 frozen, 1 hole, 2 goal), the player, newline; then the
# template's tokens (distinct, at most MAX_SUFFIX), the prefix's filler, the query, the answers
FROZEN, PLAYER, NEWLINE, TEMPLATE = 1, 4, 5, 6
MAX_SUFFIX = 32
FILLER = TEMPLATE + MAX_SUFFIX
QUERY = FILLER + 10
ANSWERS = np.arange(QUERY + 1, QUERY + 5)  # Left Down Right Up
VOCAB = 64


def render(grid, pos):
    n = grid.shape[0]
    out = []
    for r in range(n):
        out += [PLAYER if (r, c) == pos else FROZEN + int(grid[r, c]) for c in range(n)]
        out += [NEWLINE] if r < n - 1 else []
    return out


def hole_blocks_diagonal(grid, pos) -> bool:
    """The goal is diagonal from `pos` (a different row and column) and one of the two moves
    towards it lands in a hole: the cases a model that ignores holes gets wrong half the time."""
    goal = np.argwhere(grid == 2)[0]
    dr, dc = int(np.sign(goal[0] - pos[0])), int(np.sign(goal[1] - pos[1]))
    if dr == 0 or dc == 0:
        return False
    return bool(grid[pos[0] + dr, pos[1]] == 1) != bool(grid[pos[0], pos[1] + dc] == 1)


class OptimalMoves:
    """bool[n * n, 4] of a grid (codes 0 frozen, 1 hole, 2 goal, as the env's): the solver's
    optimal moves with the player on each cell (none on holes, the goal and cut-off cells),
    compiled once and remembered per grid (a 3x3 lake has a few thousand)."""

    def __init__(self, n):
        env = envs.make("FrozenLake", size=n, is_slippery=False)
        cells = jnp.asarray(np.stack(np.divmod(np.arange(n * n), n), 1).astype(np.int32))
        self.fn = jax.jit(lambda grid: jax.vmap(lambda pos: solvers.optimal_moves(
            env, envs.FrozenLakeState(grid=grid, pos=pos)))(cells))
        self.cache = {}

    def __call__(self, grid):
        key = grid.tobytes()
        if key not in self.cache:
            self.cache[key] = np.asarray(self.fn(jnp.asarray(grid, jnp.int8)))
        return self.cache[key]


def levels(rng, batch, a, optimal_moves):
    """(tokens [B, T], optimal moves [B, 4] bool, hole-blocks-diagonal case [B] bool)."""
    n, template = a.size, list(range(TEMPLATE, TEMPLATE + a.suffix))
    cells = [(r, c) for r in range(n) for c in range(n)]
    tokens, opt, case = [], [], []
    while len(tokens) < batch:
        grid = (rng.random((n, n)) < 0.2).astype(int)
        goal = cells[rng.integers(len(cells))]
        grid[goal] = 2
        moves = optimal_moves(grid)
        starts = [x for i, x in enumerate(cells) if moves[i].any()]
        if not starts:
            continue
        seq = rng.integers(FILLER, QUERY, a.prefix).tolist()
        for _ in range(a.history):
            seq += render(grid, starts[rng.integers(len(starts))]) + template
        pos = starts[rng.integers(len(starts))]
        tokens.append(seq + render(grid, pos) + template + [QUERY])
        opt.append(moves[pos[0] * n + pos[1]])
        case.append(hole_blocks_diagonal(grid, pos))
    return jnp.asarray(np.array(tokens, np.int32)), jnp.asarray(np.array(opt)), np.array(case)


def main(argv=None):
    p = cli.ArgParser()
    for name, default in dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=128,
                              theta=100, size=3, history=0, prefix=0, suffix=14, seed=0,
                              batch=128, steps=600).items():
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--wd", type=float, default=0.0, help="AdamW weight decay")
    a = p.parse_args(argv)
    if not 0 <= a.suffix <= MAX_SUFFIX:
        p.error(f"--suffix must be in [0, {MAX_SUFFIX}], got {a.suffix}")
    for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "mlp", "theta", "size",
                 "batch", "steps"):
        p.check(getattr(a, name) >= 1, f"--{name} must be >= 1, got {getattr(a, name)}")
    p.check(a.history >= 0 and a.prefix >= 0 and a.lr > 0 and a.wd >= 0,
            "--history and --prefix must be >= 0, --lr > 0 and --wd >= 0")
    cfg = model_lib.ModelConfig(
        vocab_size=VOCAB, hidden_size=a.hidden, num_layers=a.layers, num_heads=a.heads,
        num_kv_heads=a.kv_heads, head_dim=a.head_dim, intermediate_size=a.mlp,
        rope_theta=float(a.theta))
    params = model_lib.init_params(cfg, jax.random.key(a.seed))

    def loss_fn(params, tokens, opt):
        h, _ = model_lib.hidden_states(params, cfg, tokens, jnp.ones(tokens.shape, bool))
        logits = model_lib.head_logits(params, cfg, h[:, -1]).astype(jnp.float32)
        lp = jax.nn.log_softmax(logits, -1)[:, ANSWERS]
        loss = -jax.nn.logsumexp(jnp.where(opt, lp, -1e9), -1)
        right = jnp.take_along_axis(opt, jnp.argmax(lp, -1)[:, None], -1)[:, 0]
        return loss.mean(), right

    tx = optax.adamw(a.lr, weight_decay=a.wd)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, tokens, opt):
        (loss, _), g = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, opt)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    right_fn = jax.jit(lambda params, tokens, opt: loss_fn(params, tokens, opt)[1])
    optimal_moves = OptimalMoves(a.size)
    val_tokens, val_opt, val_case = levels(np.random.default_rng(999), 2048, a, optimal_moves)
    rng, t0, curve = np.random.default_rng(a.seed), time.perf_counter(), []
    print(f"params {cfg.num_params}, sequence {val_tokens.shape[1]} tokens, "
          f"hole-blocks-diagonal share {val_case.mean():.3f}", flush=True)
    for i in range(a.steps + 1):
        if i % 100 == 0 or i == a.steps:
            right = np.asarray(right_fn(params, val_tokens, val_opt))
            row = (i, round(float(right.mean()), 3), round(float(right[val_case].mean()), 3),
                   round(float(right[~val_case].mean()), 3))
            curve.append(row)
            print(f"step {i} move accuracy {row[1]:.3f} hole-blocks-diagonal {row[2]:.3f} "
                  f"elsewhere {row[3]:.3f} {time.perf_counter() - t0:.0f}s", flush=True)
        if i == a.steps:
            break
        tokens, opt, _ = levels(rng, a.batch, a, optimal_moves)
        params, opt_state, _ = train_step(params, opt_state, tokens, opt)
    print(json.dumps(dict(vars(a), curve=curve,
                          curve_columns=["step", "accuracy", "hole_blocks_diagonal", "elsewhere"])))


if __name__ == "__main__":
    main()
