"""Jittable solvers: the moves of an optimal (best-known) plan, for solver demonstrations.

    names, n = next_moves(env, state, max_moves)   # one unbatched state; vmap for a batch
    has_solver(env), solver_success(env, state)
    optimal_moves(lake, state)                     # FrozenLake: every move an optimal plan may take
    lake_budget_moves(lake, state, turns_left, moves_left, per_turn, turns, per_episode)
                                                   # FrozenLake under an episode's action budget

`names` are indices into `move_names(env)`: `env.action_names` (turn them into action ids with
`env.name_to_action(state, names)`: for Bandit the id depends on the arm order), or for an env
whose actions are text, its `move_names` (the answers its solver writes). `env` is static:
close over it. Every solver re-plans from the state alone, so a plan can be cut anywhere and
resumed from the state it led to.

- FrozenLake, not slippery: the distance-to-goal field (breadth-first over hole-free cells,
  as Bellman-Ford rounds on the grid), then a shortest path along it: up to `max_moves` moves.
- FrozenLake, slippery: the policy that maximises the probability of ever reaching the goal
  (no step limit: the env has none). Value iteration from below (the least fixed point, the
  reachability probability) in float32 until the values stop changing. With no discount,
  "any action of maximal value" is not enough: on a hole-free lake every action has value 1
  and always pressing Left never arrives. Among the actions of maximal value (within a
  relative 1e-5) the policy takes the fastest, the best success discounted by 0.9 per move
  (a tie-break only; on 100 generated 4x4 lakes it lifts the success within a trajectory's
  10-move budget from 0.38 to 0.47, the best 10-move policy having 0.48), then one with a
  successor closest to the goal in the graph of maximal actions (a rank: goal 0, a cell
  k + 1 when one of its maximal actions can slip onto a cell of rank k). Any choice among
  the maximal actions that keeps the goal reachable is an optimal stationary policy (the
  standard argument for maximal reachability); n = 1 iff the cell has a rank (value > 0).
  One move per call: after a slip the next call plans afresh. (On lakes so large that a
  discounted value underflows float32 the rank alone decides.) `lake_budget_moves` plans
  under an episode's turns and moves instead, several moves a turn where that helps: the
  slippery lake's demonstrations (starpo/demos.py).
- Sokoban with one box: dense dynamic programming over (player cell, box cell): the fewest
  moves to put the box on a target by backward Bellman rounds with `step`'s exact walk and push
  rules, followed greedily for up to `max_moves` moves. Two boxes: the same over (player, box,
  box) on the interior cells (36 ** 3 states for LargerSokoban's 8x8 rooms); more boxes have
  no solver (the states grow as cells ** (boxes + 1)).
- Bandit: the high-risk arm (mean 0.25 against 0.1, and the env's success), one move.
- Sudoku: a completion by constraint propagation (naked and hidden singles) and depth-first
  search (`sudoku.solve`), then up to `max_moves` of its placements, the empty cells with the
  fewest candidates first (`sudoku.next_placements`). It solves the grid; it does not read the
  generated solution (a level with several solutions may be completed another way: valid
  placements, paid half, and the same completion bonus). Actions are text, so the moves are
  indices into `move_names(env)` (`R,C,N`, the reference's answer format).
- 2048: a greedy one-step lookahead (`game2048.greedy_move`: the largest merged sum, then the
  most empty cells), one move per call (the spawn is random). Not optimal, and its
  `solver_success` is not a success probability: it is 1 while the game can go on (the policy
  always plays a move that changes the board), so demonstrations keep every unfinished level;
  the greedy policy itself rarely reaches the 2048 tile.

Remaining ties go to the first action in `action_names` order (FrozenLake Left, Down, Right,
Up; Sokoban Up, Down, Left, Right): among the moves one step closer to the goal (slippery
lake: among the fastest maximal actions with the closest-ranked successor).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from envs import bandit, frozenlake, game2048, sokoban, sudoku

# Relative slack under which a slippery-lake action counts as maximal (float32 rounding).
_VALUE_SLACK = 1e-5
# Most (player, boxes) states of the dense Sokoban DP (two boxes: interior cells ** 3; 8x8
# rooms have 36 ** 3 = 46656, 10x10 ones 262144).
_MAX_SOKOBAN_STATES = 300_000
# Per-move discount of the slippery lake's tie-break among maximal-probability actions.
_DISCOUNT = 0.9


def has_solver(env) -> bool:
    """Whether `next_moves` supports `env`: every FrozenLake and Bandit, Sokoban with one box,
    and with two when (interior cells) ** 3 <= _MAX_SOKOBAN_STATES (rooms up to 10x10)."""
    if isinstance(env, sokoban.Sokoban):
        return env.num_boxes == 1 or (
            env.num_boxes == 2 and ((env.dim_x - 2) * (env.dim_y - 2)) ** 3 <= _MAX_SOKOBAN_STATES)
    return isinstance(env, (frozenlake.FrozenLake, bandit.Bandit, game2048.Game2048, sudoku.Sudoku))


def move_names(env) -> tuple:
    """The answers the solver's moves index: `env.action_names`, or for an env whose actions
    are text (`text_actions`) its `move_names` (Sudoku: every placement `R,C,N`)."""
    return tuple(getattr(env, "move_names", ()) if getattr(env, "text_actions", False)
                 else env.action_names)


def require_solver(env):
    """ValueError (one line, naming why) where `has_solver(env)` is False."""
    if not has_solver(env):
        detail = (f"num_boxes={env.num_boxes} in a {env.dim_x}x{env.dim_y} room; Sokoban needs one "
                  f"box, or two with ((dim_x - 2) * (dim_y - 2)) ** 3 <= {_MAX_SOKOBAN_STATES}"
                  if isinstance(env, sokoban.Sokoban) else
                  f"{type(env).__name__} has none (solvers: FrozenLake, Bandit, Sokoban, "
                  f"Game2048, Sudoku)")
        raise ValueError(f"no solver for {getattr(env, 'name', env)!r}: {detail}")


def next_moves(env, state, max_moves: int):
    """(names int32[max_moves], n int32[]): the next moves of `env`'s optimal plan from `state`.

    names index `move_names(env)`, padded with 0 past n; n = 0 when the state is done or has
    no plan (unreachable goal, unsolvable or over-long Sokoban level). Slippery FrozenLake and
    Bandit give at most one move. Jittable and vmappable over `state`.
    """
    if not isinstance(max_moves, int) or max_moves < 1:
        raise ValueError(f"max_moves must be an int >= 1, got {max_moves!r}")
    require_solver(env)
    if isinstance(env, bandit.Bandit):
        names = jnp.zeros(max_moves, jnp.int32).at[0].set(1)  # action_names[1]: the high arm
        return names, (~env.is_done(state)).astype(jnp.int32)
    if isinstance(env, frozenlake.FrozenLake):
        return _lake_moves(env, state, max_moves)
    if isinstance(env, game2048.Game2048):
        names = jnp.zeros(max_moves, jnp.int32).at[0].set(game2048.greedy_move(state.grid))
        return names, (~env.is_done(state)).astype(jnp.int32)
    if isinstance(env, sudoku.Sudoku):
        cells, digits, n = sudoku.next_placements(state.grid, max_moves)
        return cells * env.size + digits - 1, jnp.where(env.is_done(state), 0, n)
    return _sokoban_moves(env, state, max_moves)


def solver_success(env, state):
    """f32[]: the probability that the solver's policy succeeds (the env's info `success`) from
    `state`: 1/0 on deterministic envs (a done state: whether it succeeded); the maximal
    probability of reaching the goal on the slippery lake; for Bandit whether the high-risk arm
    is (or was) pulled, which the solver always does (its payout is still random: mean 0.25).
    Sokoban counts only plans that fit in the steps left (max_steps - steps). 2048: 1 while the
    game can go on (not a probability; see the module docstring). Sudoku: whether the grid has
    a completion the solver finds (a done state: whether it was solved)."""
    require_solver(env)
    if isinstance(env, bandit.Bandit):
        return (~env.is_done(state) | env._pulled_high(state)).astype(jnp.float32)
    if isinstance(env, frozenlake.FrozenLake):
        value, _, _ = _lake_plan(env, state.grid)
        return value[state.pos[0] * env.size + state.pos[1]]
    if isinstance(env, game2048.Game2048):  # not a probability: the greedy policy can move
        return (~env.is_done(state)).astype(jnp.float32)
    if isinstance(env, sudoku.Sudoku):
        return jnp.where(env.is_done(state), state.solved, sudoku.solve(state.grid)[1]).astype(
            jnp.float32)
    dist, start, _ = _sokoban_field(env, state)
    left = env.max_steps - state.steps
    return (dist[start] <= jnp.maximum(left, 0)).astype(jnp.float32)


# ------------------------------------------------------------------ FrozenLake


def _lake_successors(env):
    """int32[N, 4, S] (static): flat cell reached from cell c by action name a and slip s
    (S = 3 slips -1, 0, +1 when slippery, else 1), as `move` realises it (clipped at edges)."""
    n = env.size
    rows, cols = np.divmod(np.arange(n * n), n)
    slips = (-1, 0, 1) if env.is_slippery else (0,)
    out = np.zeros((n * n, 4, len(slips)), np.int32)
    for a in range(4):
        for s, slip in enumerate(slips):
            dr, dc = frozenlake._DELTAS[(a + slip) % 4]
            out[:, a, s] = np.clip(rows + dr, 0, n - 1) * n + np.clip(cols + dc, 0, n - 1)
    return out


def _lake_plan(env, grid):
    """(value f32[N], rank int32[N], allowed bool[N, 4]) of a lake: success probability per
    cell, graph distance to the goal through allowed actions (N + 1: none), and the actions of
    maximal value (all actions when not slippery: value 1 wherever the goal is reachable)."""
    nn = env.size * env.size
    succ = jnp.asarray(_lake_successors(env))
    flat = grid.reshape(-1)
    frozen, goal = flat == frozenlake.FROZEN, flat == frozenlake.GOAL
    unreached = nn + 1

    def rounds(allowed):
        def body(_, rank):
            best = jnp.where(allowed, rank[succ].min(-1), unreached).min(-1)
            return jnp.where(frozen, jnp.minimum(rank, best + 1), rank)

        # A shortest path visits each cell once: N rounds reach every rank.
        return jax.lax.fori_loop(0, nn, body, jnp.where(goal, 0, unreached).astype(jnp.int32))

    if not env.is_slippery:
        rank = rounds(jnp.ones((nn, 4), bool))
        return (rank < unreached).astype(jnp.float32), rank, jnp.ones((nn, 4), bool)

    def q_values(value):
        return value[succ].mean(-1)  # [N, 4]: each slip has p 1/3

    def backup(carry):
        i, value, _ = carry
        new = jnp.where(frozen, q_values(value).max(-1), value)
        return i + 1, new, jnp.any(new != value)

    # Monotone from below in float32 too (rounding is monotone), so it reaches a fixed point;
    # the cap only bounds pathological crawls.
    cap = 200 * nn
    _, value, _ = jax.lax.while_loop(
        lambda c: c[2] & (c[0] < cap), backup, (0, goal.astype(jnp.float32), jnp.array(True))
    )
    q = q_values(value)
    allowed = _near_max(q)
    # Among those, the fastest: the best discounted success (a tie-break only: any choice
    # among the maximal actions that keeps the goal reachable is optimal).
    def discounted(_, w):
        return jnp.where(frozen, jnp.where(allowed, _DISCOUNT * q_values(w), 0).max(-1), w)

    fast = jax.lax.fori_loop(0, 4 * nn + 100, discounted, goal.astype(jnp.float32))
    fastest = allowed & _near_max(jnp.where(allowed, q_values(fast), -1.0))
    return jnp.where(frozen, q.max(-1), value), rounds(allowed), fastest


def _near_max(q):
    """bool[N, 4]: the actions within float32 noise (relative) of each row's maximum."""
    return q >= q.max(-1, keepdims=True) * (1 - _VALUE_SLACK)


def optimal_moves(env, state):
    """bool[4] (by `env.action_names`): the moves of FrozenLake `env` from `state` that an
    optimal plan may take, of which `next_moves` takes the first. Not slippery: every move one
    step closer to the goal along a hole-free path (a label set for supervised move accuracy:
    several are right where the goal is diagonal); slippery: the fastest actions of maximal
    success probability. All False where the state is done or the goal is unreachable."""
    if not isinstance(env, frozenlake.FrozenLake):
        raise TypeError(f"optimal_moves is for FrozenLake, not {getattr(env, 'name', env)!r}")
    _, rank, allowed = _lake_plan(env, state.grid)
    succ = jnp.asarray(_lake_successors(env))
    cell = state.pos[0] * env.size + state.pos[1]
    live = ~env.is_done(state) & (rank[cell] < env.size * env.size + 1)
    if env.is_slippery:
        return live & allowed[cell]
    return live & (rank[succ[cell, :, 0]] == rank[cell] - 1)


def _lake_moves(env, state, max_moves):
    _, rank, allowed = _lake_plan(env, state.grid)
    succ = jnp.asarray(_lake_successors(env))
    unreached = env.size * env.size + 1

    def choose(cell):  # first action (in name order) whose best successor has the lowest rank
        return jnp.argmin(jnp.where(allowed[cell], rank[succ[cell]].min(-1), unreached + 1))

    start = state.pos[0] * env.size + state.pos[1]
    live = ~env.is_done(state) & (rank[start] < unreached)
    if env.is_slippery:
        first = jnp.where(live, choose(start), 0).astype(jnp.int32)
        return jnp.zeros(max_moves, jnp.int32).at[0].set(first), live.astype(jnp.int32)

    def walk(cell, _):
        a = choose(cell).astype(jnp.int32)
        return succ[cell, a, 0], a

    _, names = jax.lax.scan(walk, start, None, length=max_moves)
    n = jnp.where(live, jnp.minimum(rank[start], max_moves), 0).astype(jnp.int32)
    return jnp.where(jnp.arange(max_moves) < n, names, 0), n


def _lake_sequences(env, grid, per_turn: int):
    """(mats f32[S, N, N], gains f32[S, N], lengths int[S] static) of every move sequence of
    1..per_turn moves, by length, then by moves with the first the most significant: row c of
    mats[s] is where the mass starting on cell c still stands, on frozen cells, after s (a hole
    or the goal ends it), gains[s, c] the mass that reached the goal on the way."""
    nn = env.size * env.size
    succ = jnp.asarray(_lake_successors(env))  # [N, 4, slips]
    flat = grid.reshape(-1)
    frozen = (flat == frozenlake.FROZEN).astype(jnp.float32)
    goal = (flat == frozenlake.GOAL).astype(jnp.float32)
    one_hot = jax.nn.one_hot(succ, nn, dtype=jnp.float32).mean(2)  # [N, 4, N]: each slip alike
    step = one_hot.transpose(1, 0, 2)  # [4, N, N]: P(c -> d) under move a
    live, gain = jnp.diag(frozen)[None], jnp.zeros((1, nn), jnp.float32)
    mats, gains = [], []
    for _ in range(per_turn):
        moved = jnp.einsum("scd,ade->sace", live, step).reshape(-1, nn, nn)
        gain = jnp.repeat(gain, 4, axis=0) + moved @ goal
        live = moved * frozen
        mats.append(live)
        gains.append(gain)
    return jnp.concatenate(mats), jnp.concatenate(gains), _sequence_lengths(per_turn)


def _sequence_lengths(per_turn: int) -> np.ndarray:
    """int[S]: each sequence's length in `_lake_sequences`' order (4 ** m of length m)."""
    return np.repeat(np.arange(1, per_turn + 1), [4 ** m for m in range(1, per_turn + 1)])


def lake_budget_plan(env, grid, per_turn: int, turns: int, per_episode: int):
    """(choice int32[turns, K+1, N], value f32[turns, K+1, N]) of a lake under the action
    budget, K = per_episode: with t + 1 turns and k moves left on cell c, the sequence to write
    (an index into `_lake_sequences`' order) and the success it leads to when every later turn
    writes its own best sequence (an exact dynamic programme over open-loop sequences a turn:
    experiments/lake_baselines.py's `budget_optimum` computes the same value independently).
    Ties go to the shortest sequence, then the first in `action_names` order."""
    mats, gains, lengths = _lake_sequences(env, grid, per_turn)
    behind = np.arange(per_episode + 1)[None, :] - lengths[:, None]  # [S, K+1]: moves left after
    fits = jnp.asarray(behind >= 0)[..., None]
    behind = np.clip(behind, 0, per_episode)

    def next_turn(value, _):  # value [K+1, N]: the best success with one turn fewer
        after = jnp.einsum("scd,kd->skc", mats, value)  # [S, K+1, N], k: moves left after s
        after = jnp.take_along_axis(after, jnp.asarray(behind)[..., None], axis=1)
        q = jnp.where(fits, gains[:, None, :] + after, -1.0)  # [S, K+1, N], k: moves left now
        best = q.max(0)
        choice = jnp.argmax(q >= best * (1 - _VALUE_SLACK), axis=0).astype(jnp.int32)
        new = jnp.maximum(best, 0.0)  # no move left: 0
        return new, (choice, new)

    nn = env.size * env.size
    _, (choice, value) = jax.lax.scan(next_turn, jnp.zeros((per_episode + 1, nn), jnp.float32),
                                      None, length=turns)
    return choice, value


def lake_budget_moves(env, state, turns_left, moves_left, per_turn: int, turns: int,
                      per_episode: int, plan=None):
    """(names int32[per_turn], n int32[]): on FrozenLake, the moves to write this turn under
    the env's action budget: of every sequence of 1..min(per_turn, moves_left) moves, the one
    whose success is highest when the turns after it (turns_left - 1 of them, the grid seen at
    the start of each) play their best sequences too, with at most moves_left moves in all
    (`lake_budget_plan`; on the paper's slippery lake with 5 turns of up to 5 moves, 10 in
    all, the best success is 0.48 against 0.28 for one move a turn). `turns` and `per_episode`
    (static) bound turns_left and moves_left; n = 0 when the state is done, nothing is left,
    or no sequence can reach the goal. `plan`: `lake_budget_plan` of the state's grid with the
    same budget, where the caller made it once for the episode (the grid never changes within
    one), else made here."""
    if not isinstance(env, frozenlake.FrozenLake):
        raise TypeError(f"lake_budget_moves is for FrozenLake, not {getattr(env, 'name', env)!r}")
    if plan is None:
        plan = lake_budget_plan(env, state.grid, per_turn, turns, per_episode)
    choice, value = plan
    cell = state.pos[0] * env.size + state.pos[1]
    t = jnp.clip(turns_left - 1, 0, turns - 1)
    k = jnp.clip(moves_left, 0, per_episode)
    pick = choice[t, k, cell]
    lengths = _sequence_lengths(per_turn)
    length = jnp.asarray(lengths)[pick]
    local = pick - jnp.asarray(np.searchsorted(lengths, np.arange(1, per_turn + 1)))[length - 1]
    j = jnp.arange(per_turn)
    names = (local // 4 ** jnp.clip(length - 1 - j, 0, None)) % 4  # the first move leads
    live = ~env.is_done(state) & (turns_left >= 1) & (k >= 1) & (value[t, k, cell] > 0)
    n = jnp.where(live, length, 0).astype(jnp.int32)
    return jnp.where(j < n, names, 0).astype(jnp.int32), n


# ------------------------------------------------------------------ Sokoban


def _sokoban_cells(env):
    """(cells, local, nbr), static: the flat room cells a player or box may stand on (all of
    them for one box; for two the interior, as generated rooms are walled: 36**3 states on
    8x8), each room cell's index among them (M = len(cells): not one), and nbr int32[M + 1, 4],
    the local index of each cell's neighbour per action (M: none; row M is a sink)."""
    h, w = env.dim_x, env.dim_y
    rows, cols = np.divmod(np.arange(h * w), w)
    inner = (rows > 0) & (rows < h - 1) & (cols > 0) & (cols < w - 1)
    cells = np.flatnonzero(inner | (env.num_boxes == 1))
    m = len(cells)
    local = np.full(h * w, m, np.int32)
    local[cells] = np.arange(m)
    nbr = np.full((m + 1, 4), m, np.int32)
    for a, (dr, dc) in enumerate(sokoban._DELTAS):
        r, c = rows[cells] + dr, cols[cells] + dc
        inside = (r >= 0) & (r < h) & (c >= 0) & (c < w)
        nbr[:m][inside, a] = local[(r * w + c)[inside]]
    return cells, local, nbr


def _sokoban_field(env, state):
    """(dist int32[M**(k+1)], start int32[], nxt int32[M**(k+1), 4]) over the states (player,
    box 1, .., box k) of k = num_boxes boxes on M cells (flat, player most significant):
    fewest moves to every box on a target (never: M**(k+1) + 1), the state's own index, and the
    index each action leads to (itself when nothing moves). Boxes are ordered, so each
    arrangement appears k! times. Rounds stop once the state's own distance is final (after r
    rounds every distance <= r is), so only distances below it are exact, all a plan needs. A
    state this cannot hold (another box count; two boxes and floor on the border) never solves.
    """
    k = env.num_boxes
    cells, local, nbr = _sokoban_cells(env)
    m = len(cells)
    never = m ** (k + 1) + 1
    room = state.room.reshape(-1)
    open_ = jnp.append(room[cells] != sokoban.WALL, False)  # index m: off the cells, closed
    target = room[cells] == sokoban.TARGET
    nbr = jnp.asarray(nbr)
    # The player, then each box, as an index on its own axis; actions on the last axis.
    p, *boxes = (jnp.arange(m).reshape([-1 if i == j else 1 for j in range(k + 1)])
                 for i in range(k + 1))
    one = nbr[p]  # [.., 4]: the cell the player walks into per action
    two = nbr[one, jnp.arange(4)]  # and the one beyond, where a box there would go
    hits = [one == b[..., None] for b in boxes]
    hit = functools.reduce(jnp.logical_or, hits)
    beyond_free = functools.reduce(jnp.logical_and, [two != b[..., None] for b in boxes], open_[two])
    push = hit & beyond_free
    moved = (open_[one] & ~hit) | push
    parts = [jnp.where(moved, one, p[..., None])]
    parts += [jnp.where(h & push, two, b[..., None]) for h, b in zip(hits, boxes)]

    def flat(parts):
        return sum(x * m ** (k - i) for i, x in enumerate(parts))

    nxt = jnp.broadcast_to(flat(parts), [m] * (k + 1) + [4]).reshape(-1, 4)
    valid, solved = open_[p], True
    for i, b in enumerate(boxes):
        valid = valid & open_[b] & (b != p)
        for c in boxes[:i]:
            valid = valid & (b != c)
        solved = solved & target[b]
    valid = jnp.broadcast_to(valid, [m] * (k + 1)).reshape(-1)
    solved = valid & jnp.broadcast_to(solved, [m] * (k + 1)).reshape(-1)

    # The state's own index (0 for a state this cannot hold, whose dist stays never).
    local = jnp.asarray(local)
    flat_boxes = state.boxes.reshape(-1)
    here = [local[state.player[0] * env.dim_y + state.player[1]]]
    here += [local[c] for c in jnp.nonzero(flat_boxes, size=k, fill_value=0)[0]]
    ok = jnp.sum(flat_boxes) == k
    if m < room.shape[0]:  # cells outside the DP must be walls
        ok = ok & jnp.all(room[jnp.asarray(np.setdiff1d(np.arange(room.shape[0]), cells))] == sokoban.WALL)
    for x in here:
        ok = ok & (x < m)
    start = jnp.where(ok, flat([jnp.minimum(x, m - 1) for x in here]), 0)
    dist0 = jnp.where(solved & ok, 0, never).astype(jnp.int32)

    def rounds(carry):
        i, dist, _ = carry
        new = jnp.where(valid, jnp.minimum(dist, dist[nxt].min(-1) + 1), dist)
        return i + 1, new, jnp.any(new != dist)

    _, dist, _ = jax.lax.while_loop(
        lambda c: c[2] & (c[1][start] > c[0]), rounds, (0, dist0, jnp.array(True))
    )
    return dist, start, nxt


def _sokoban_moves(env, state, max_moves):
    dist, start, nxt = _sokoban_field(env, state)
    never = len(_sokoban_cells(env)[0]) ** (env.num_boxes + 1) + 1

    def walk(idx, _):  # the first action (Up, Down, Left, Right) one move closer
        a = jnp.argmin(dist[nxt[idx]]).astype(jnp.int32)
        return nxt[idx, a], a

    _, names = jax.lax.scan(walk, start, None, length=max_moves)
    live = ~env.is_done(state) & (dist[start] < never)
    n = jnp.where(live, jnp.minimum(dist[start], max_moves), 0).astype(jnp.int32)
    return jnp.where(jnp.arange(max_moves) < n, names, 0), n
