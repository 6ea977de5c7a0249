"""Env state -> text as pieces, for rendering observations on device.

Tokenisation is not jittable, so the text of a state is described as a sequence of *pieces*
drawn from a fixed, finite list of strings (`EnvText.pieces`): a grid is its cell symbols with a
newline piece between rows; the Bandit's text is one of its few whole prompts/results. The host
tokenises each piece once (starpo/dialogue.py); on device `EnvText.render(state)` gives the piece
ids, and the observation is a gather of their tokens. Decoding the pieces in order gives exactly
`env.to_text(state)` (checked by `check_render`).

Also here: the env's fixed prompt prefix (instruction, legend, action list, budget line) and the
reference's per-env interaction budgets.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from envs import bandit as bandit_lib
from envs import countdown as countdown_lib
from envs import game2048 as game2048_lib
from envs import sudoku as sudoku_lib

ACTION_SEP = "||"  # the reference's action separator (shown to the model as " || ")


@dataclasses.dataclass(frozen=True)
class EnvText:
    """How one env variant talks.

    pieces:    the strings a state's text is made of (piece ids index this tuple)
    width:     number of piece ids `render` returns (-1 pads)
    render:    jittable state -> int32[width] piece ids
    prefix:    the fixed text before the first turn (instruction, legend, actions, budget line)
    action_names: names an answer is matched against (case-insensitively)
    max_actions_per_turn / max_actions_per_traj: the reference's budgets for this env
    limits:    ((piece ids, most slots showing one of them), ...): pieces a state shows in few
               places (a grid's player, its boxes), for a tight bound on a state's tokens
               (`max_state_tokens`); () = none
    """

    pieces: tuple
    width: int
    render: Callable
    prefix: str
    action_names: tuple
    max_actions_per_turn: int
    max_actions_per_traj: int
    limits: tuple = ()


def powers_of_ten(k: int) -> np.ndarray:
    """int32[k]: 10 ** (k-1) .. 10 ** 0 as a constant (`10 ** jnp.arange(k)`, an integer power
    of a traced array, becomes dozens of ops in every program that renders a number)."""
    return (10 ** np.arange(k - 1, -1, -1, dtype=np.int64)).astype(np.int32)


def max_state_tokens(text: EnvText, lengths) -> int:
    """The most tokens a rendered state can take, given each piece's token count `lengths`:
    each `limits` group fills at most its number of slots (at the longest piece of all), and
    every other slot shows the longest piece outside those groups."""
    lengths = [int(n) for n in lengths]
    limited = {i for ids, _ in text.limits for i in ids}
    capped = min(sum(n for _, n in text.limits), text.width)
    free = max((n for i, n in enumerate(lengths) if i not in limited), default=0)
    return capped * max(lengths) + (text.width - capped) * free


def prefix_text(env, max_actions_per_traj: int) -> str:
    """The reference's first-user-message prefix: instruction + legend + action list + budget."""
    text = env.instruction
    if env.legend:
        text += "\nThe meaning of each symbol in the state is:\n" + env.legend
    # grid envs have an action lookup; the Bandit's prompt is its state; Countdown has no lookup
    if env.instruction and env.action_names:
        text += "\nYour available actions are:\n" + ", ".join(env.action_names)
        text += (f"\nYou can make up to {max_actions_per_traj} actions, separated by the action "
                 f"separator \" {ACTION_SEP} \"\n")
    return text


def _grid_text(env, max_actions_per_turn, max_actions_per_traj) -> EnvText:
    symbols = tuple(env.symbols)
    newline = len(symbols)
    pieces = symbols + ("\n",)

    def render(state):
        codes = env.render_codes(state).astype(jnp.int32)  # [R, C]
        rows = codes.shape[0]
        nl = jnp.full((rows, 1), newline, jnp.int32)
        return jnp.concatenate([codes, nl], axis=1).reshape(-1)[:-1]  # no newline after last row

    codes_shape = _render_shape(env)
    width = codes_shape[0] * (codes_shape[1] + 1) - 1
    return EnvText(pieces, width, render, prefix_text(env, max_actions_per_traj),
                   tuple(env.action_names), max_actions_per_turn, max_actions_per_traj,
                   tuple(env.symbol_limits()))


def _render_shape(env):
    if hasattr(env, "size"):
        return (env.size, env.size)
    return (env.dim_x, env.dim_y)


def _bandit_text(env, max_actions_per_turn, max_actions_per_traj) -> EnvText:
    low, high = env.low_arm, env.high_arm
    pieces = (
        bandit_lib.PROMPT_TEMPLATE.format(name_a=low, name_b=high),   # 0: low arm is action 1
        bandit_lib.PROMPT_TEMPLATE.format(name_a=high, name_b=low),   # 1: high arm is action 1
        bandit_lib.RESULT_TEMPLATE.format(arm=low, reward=bandit_lib.LOW_RISK_REWARD),
        bandit_lib.RESULT_TEMPLATE.format(arm=high, reward=bandit_lib.HIGH_RISK_WIN),
        bandit_lib.RESULT_TEMPLATE.format(arm=high, reward=bandit_lib.HIGH_RISK_LOSS),
    )

    def render(state):
        pulled_high = (state.pulled == 1) == state.high_first
        after = jnp.where(pulled_high, jnp.where(state.reward > 0.5, 3, 4), 2)
        before = state.high_first.astype(jnp.int32)
        return jnp.where(state.pulled > 0, after, before).astype(jnp.int32)[None]

    return EnvText(pieces, 1, render, prefix_text(env, max_actions_per_traj),
                   tuple(env.action_names), max_actions_per_turn, max_actions_per_traj)


def _countdown_text(env, max_actions_per_turn, max_actions_per_traj) -> EnvText:
    """`Target: T, nums: [a, b, c]` as digit pieces and labels; after the answer one piece,
    `Your answer get R points.` for each reward the env pays."""
    digits = tuple(str(d) for d in range(10))
    TARGET, NUMS, SEP, CLOSE, RESULT = 10, 11, 12, 13, 14
    rewards = (env.score, env.format_score, 0)
    pieces = digits + ("Target: ", ", nums: [", ", ", "]") + tuple(
        countdown_lib.RESULT_TEMPLATE.format(reward=countdown_lib.py_number(r)) for r in rewards)
    n = env.max_count
    td, nd = len(str(env.max_target)), len(str(env.max_number))
    width = 1 + td + 1 + n * nd + (n - 1) + 1

    def number(v, k):  # piece ids [k]: v's digits right-aligned, -1 before
        pw = powers_of_ten(k)
        keep = (v >= pw) | (jnp.arange(k) == k - 1)
        return jnp.where(keep, (v // pw) % 10, -1)

    def render(state):
        used = jnp.arange(n) < state.count
        parts = [jnp.array([TARGET]), number(state.target, td), jnp.array([NUMS])]
        for i in range(n):
            if i:
                parts.append(jnp.where(used[i], SEP, -1)[None])
            parts.append(jnp.where(used[i], number(state.nums[i], nd), -1))
        before = jnp.concatenate(parts + [jnp.array([CLOSE])])
        which = jnp.where(state.reward == jnp.float32(env.score), 0,
                          jnp.where(state.reward == jnp.float32(env.format_score), 1, 2))
        after = jnp.full((width,), -1).at[0].set(RESULT + which)
        return jnp.where(state.answered, after, before).astype(jnp.int32)

    long_pieces = (TARGET, NUMS, CLOSE, RESULT, RESULT + 1, RESULT + 2)
    return EnvText(pieces, width, render, prefix_text(env, max_actions_per_traj), (),
                   max_actions_per_turn, max_actions_per_traj, ((long_pieces, 3),))


def _game2048_text(env, max_actions_per_turn, max_actions_per_traj) -> EnvText:
    """The reference's `render()`: a header, `Row i: [a, b, c, d]` lines, the valid actions
    (`0(Up), 2(Down)` or `None`), the goal line, the score and the question, as pieces: each
    row's frame, a piece per tile value, per valid action, and per score digit."""
    n, E, D = env.size, env.max_exponent, env.score_digits
    names = game2048_lib.ACTION_NAMES
    pieces = (("Current 2048 Grid:\nRow 1: [",)
              + tuple(f"]\nRow {i}: [" for i in range(2, n + 1))
              + (", ", "]\n\nValid Actions: ", "None",
                 ".\n" + game2048_lib.GOAL_LINE + "\nCurrent Score: ", "\nWhat is your next move?")
              + tuple(str(game2048_lib.tile(e)) for e in range(E + 1))
              + tuple(f"{a}({names[a]})" for a in range(4))
              + tuple(str(d) for d in range(10)))
    SEP, VALID, NONE, MID, END = n, n + 1, n + 2, n + 3, n + 4  # row frames are 0..n-1
    TILE = n + 5
    ACT = TILE + E + 1
    DIGIT = ACT + 4
    width = n + n * (2 * n - 1) + 1 + 7 + 1 + D + 1

    def render(state):
        parts = []
        for i in range(n):
            cells = TILE + state.grid[i].astype(jnp.int32)  # [n]
            row = jnp.stack([cells, jnp.full((n,), SEP)], axis=1).reshape(-1)[:-1]
            parts += [jnp.array([i]), row]
        parts.append(jnp.array([VALID]))
        valid = env.valid_actions(state)  # [4]
        # the valid actions in order, ", " between them, padded after
        count = jnp.sum(valid)
        acts = ACT + jnp.argsort(~valid, stable=True)
        slots = jnp.stack([acts, jnp.full((4,), SEP)], axis=1).reshape(-1)[:-1]  # [7]
        slots = jnp.where(jnp.arange(7) < 2 * count - 1, slots, -1)
        slots = jnp.where(count == 0, jnp.full((7,), -1).at[0].set(NONE), slots)
        parts += [slots, jnp.array([MID])]
        pw = powers_of_ten(D)
        keep = (state.score >= pw) | (jnp.arange(D) == D - 1)
        parts += [jnp.where(keep, DIGIT + (state.score // pw) % 10, -1), jnp.array([END])]
        return jnp.concatenate(parts).astype(jnp.int32)

    frames = tuple(range(n)) + (VALID, NONE, MID, END)
    return EnvText(pieces, width, render, prefix_text(env, max_actions_per_traj),
                   tuple(env.action_names), max_actions_per_turn, max_actions_per_traj,
                   ((frames, n + 3),))


def _sudoku_text(env, max_actions_per_turn, max_actions_per_traj) -> EnvText:
    """The reference's `with_feedback` render as pieces: the banner, each cell as one piece
    (`[N]`, ` N `, ` . `, the row's last cell right-stripped), `| ` and the band lines, the
    legend, the last action's feedback (its frames, digit pieces, an unparsable answer's bytes
    one piece each), the valid numbers of the empty cells once at most 10 are left, and the
    progress and step lines."""
    S, BOX = env.size, sudoku_lib.box_of(env.size)
    names, pieces = {}, []

    def add(key, text):
        names[key] = len(pieces)
        pieces.append(text)
        return names[key]

    def cell_text(code, last):  # code 0 empty, 1..S placed, S+1..2S initial
        t = " . " if code == 0 else (f"[{code - S}]" if code > S else f" {code} ")
        return t.rstrip() if last else t

    CELL = len(pieces)
    for last in (False, True):
        for code in range(2 * S + 1):
            add(("cell", last, code), cell_text(code, last))
    DIGIT = len(pieces)
    for d in range(10):
        add(("digit", d), str(d))
    BYTE = len(pieces)
    for b in range(128):
        add(("byte", b), chr(b))
    QMARK = names[("byte", ord("?"))]
    bad = "\n\n❌ Invalid action format: "
    frames = dict(
        head=f"{sudoku_lib.BANNER}\nSUDOKU PUZZLE\n{sudoku_lib.BANNER}\n", bar="| ", nl="\n",
        dash="\n" + "-" * (S * 3 + BOX - 1) + "\n", legend="\n\n" + sudoku_lib.LEGEND,
        fmt=bad + "Could not parse action: '", fmt_end="'. " + sudoku_lib.EXPECTED,
        row_range=bad + "Row ", col_range=bad + "Column ", num_range=bad + "Number ",
        range_end=f" is out of range (1-{S})", initial="\n\n❌ Cannot modify initial cell at (",
        comma=",", close=")", conflict="\n\n❌ Invalid placement: ", with_=" conflicts with ",
        row_w="row ", col_w="column ", col_w2=", column ", box_w="box (", box_w2=", box (",
        valid_for="\n   Valid numbers for (", list_open="): [", sep=", ", list_close="]",
        correct="\n\n✓ Correct! Placed ", placed="\n\n⚠ Placed ", at=" at (",
        not_optimal=") - Valid but not optimal", solved="\n🎉 Congratulations! Puzzle solved!",
        valid_head="\n\n💡 VALID NUMBERS FOR EMPTY CELLS:", line="\n  - (",
        progress="\n\nProgress: ", of=f"/{S * S} cells filled (", initial_w=" initial, ",
        placed_w=" placed)\nSteps: ", max_steps=f"/{env.max_steps}")
    P = {k: add(k, v) for k, v in frames.items()}
    long_ids = {i for i, t in enumerate(pieces) if len(t) > 8}
    # the grid's frame: banner, bars and line breaks, with a slot (-1) for each cell's piece
    grid_frame, cell_slots = [P["head"]], []
    for i in range(S):
        if i:
            grid_frame.append(P["dash"] if i % BOX == 0 else P["nl"])
        for j in range(S):
            if j and j % BOX == 0:
                grid_frame.append(P["bar"])
            cell_slots.append(len(grid_frame))
            grid_frame.append(-1)
    grid_frame, cell_slots = np.asarray(grid_frame, np.int32), np.asarray(cell_slots)
    SD = 5  # digits of the step count (saturates past 99999)

    def num(v, k):  # piece ids [k]: v's digits right-aligned, -1 before
        v = jnp.clip(v, 0, 10 ** k - 1)
        pw = powers_of_ten(k)
        keep = (v >= pw) | (jnp.arange(k) == k - 1)
        return jnp.where(keep, DIGIT + (v // pw) % 10, -1)

    def d(v):
        return jnp.reshape(DIGIT + jnp.clip(v, 0, 9), (1,))

    def ids(*items):
        return jnp.concatenate([jnp.reshape(jnp.asarray(i, jnp.int32), (-1,)) for i in items])

    def when(cond, arr):
        return jnp.where(cond, arr, -1)

    def number_list(valid):  # bool[9] -> ids [18]: "1, 5, 9"
        before = jnp.cumsum(valid) - valid > 0
        sep = jnp.where(valid & before, P["sep"], -1)
        digit = jnp.where(valid, DIGIT + jnp.arange(1, S + 1), -1)
        return jnp.stack([sep, digit], axis=1).reshape(-1)

    def feedback(state):
        fb, n, r, c = state.fb, state.fb_num, state.fb_row, state.fb_col
        r0, c0 = jnp.clip(r - 1, 0, S - 1), jnp.clip(c - 1, 0, S - 1)
        echo = jnp.where(state.echo < 0, -1, jnp.where(state.echo < 128, BYTE + state.echo, QMARK))
        cr, cc, cb = sudoku_lib.conflicts(state.grid, r0, c0, n)
        valid = sudoku_lib.valid_numbers(state.grid, r0, c0)
        range_v = jnp.where(fb == sudoku_lib.FB_ROW, r, jnp.where(fb == sudoku_lib.FB_COL, c, n))
        range_p = jnp.where(fb == sudoku_lib.FB_ROW, P["row_range"],
                            jnp.where(fb == sudoku_lib.FB_COL, P["col_range"], P["num_range"]))
        solved = when(state.solved, P["solved"])
        where = (d(n), P["at"], d(r), P["comma"], d(c))
        alts = {
            sudoku_lib.FB_FORMAT: ids(P["fmt"], echo, P["fmt_end"]),
            sudoku_lib.FB_ROW: ids(range_p, num(range_v, 9), P["range_end"]),
            sudoku_lib.FB_INITIAL: ids(P["initial"], d(r), P["comma"], d(c), P["close"]),
            sudoku_lib.FB_CONFLICT: ids(
                P["conflict"], d(n), P["with_"], when(cr, ids(P["row_w"], d(r))),
                when(cc, ids(jnp.where(cr, P["col_w2"], P["col_w"]), d(c))),
                when(cb, ids(jnp.where(cr | cc, P["box_w2"], P["box_w"]), d(r0 // BOX + 1),
                             P["comma"], d(c0 // BOX + 1), P["close"])),
                when(valid.any(), ids(P["valid_for"], d(r), P["comma"], d(c), P["list_open"],
                                      number_list(valid), P["list_close"]))),
            sudoku_lib.FB_CORRECT: ids(P["correct"], *where, P["close"], solved),
            sudoku_lib.FB_VALID: ids(P["placed"], *where, P["not_optimal"], solved),
        }
        width = max(a.shape[0] for a in alts.values())
        out = jnp.full((width,), -1, jnp.int32)
        for kind, alt in alts.items():
            pad = jnp.pad(alt, (0, width - alt.shape[0]), constant_values=-1)
            hit = fb == kind
            if kind == sudoku_lib.FB_ROW:  # the three out-of-range messages share a layout
                hit |= (fb == sudoku_lib.FB_COL) | (fb == sudoku_lib.FB_NUM)
            out = jnp.where(hit, pad, out)
        return out

    def render(state):
        grid, puzzle = state.grid, state.puzzle
        code = jnp.where(puzzle != 0, grid + S, grid)  # [9, 9]
        # the grid's pieces at once: the fixed frame (banner, bars, line breaks) with the 81
        # cells' pieces written into their slots
        cells = CELL + (2 * S + 1) * (jnp.arange(S) == S - 1) + code
        parts = [jnp.asarray(grid_frame).at[cell_slots].set(cells.reshape(-1)),
                 ids(P["legend"]), feedback(state)]
        empty = grid == 0
        E = jnp.sum(empty)
        k = jnp.arange(10)
        order = jnp.argsort(~empty.reshape(-1), stable=True)[:10]
        rr, cc = order // S, order % S
        valid = jax.vmap(sudoku_lib.valid_numbers, in_axes=(None, 0, 0))(grid, rr, cc)
        show = (k < E) & valid.any(axis=1)
        lines = jax.vmap(lambda r, c, v: ids(P["line"], d(r + 1), P["comma"], d(c + 1),
                                             P["list_open"], number_list(v),
                                             P["list_close"]))(rr, cc, valid)
        lines = jnp.where(show[:, None], lines, -1).reshape(-1)
        parts.append(when((E >= 1) & (E <= 10), ids(P["valid_head"], lines)))
        filled = jnp.sum(grid != 0)
        initial = jnp.sum(puzzle != 0)
        parts += [ids(P["progress"]), num(filled, 2), ids(P["of"]), num(initial, 2),
                  ids(P["initial_w"]), num(filled - initial, 2), ids(P["placed_w"]),
                  num(state.steps, SD), ids(P["max_steps"])]
        return jnp.concatenate(parts).astype(jnp.int32)

    shape = jax.eval_shape(render, jax.eval_shape(env.reset, jax.random.key(0)))
    # slots that can show a piece longer than 8 characters at once: the banner, the two band
    # lines, the legend, the feedback's frames (at most 4: a conflict in a row and a column
    # with its valid numbers), the valid-numbers header and the progress frames (4)
    return EnvText(tuple(pieces), shape.shape[0], render, prefix_text(env, max_actions_per_traj),
                   (), max_actions_per_turn, max_actions_per_traj,
                   ((tuple(sorted(long_ids)), 13),))


def make_text(env, max_actions_per_turn: int | None = None,
              max_actions_per_traj: int | None = None) -> EnvText:
    """The EnvText of an env made by `envs.make`. Budgets default to the reference's:
    5 actions per turn and 10 per episode for the grid games, 1 and 1 for the Bandit and
    Countdown, and an env's own `budgets` (per turn, per episode) where it states them."""
    single = isinstance(env, (bandit_lib.Bandit, countdown_lib.Countdown))
    turn0, traj0 = getattr(env, "budgets", None) or ((1, 1) if single else (5, 10))
    per_turn = max_actions_per_turn or turn0
    per_traj = max_actions_per_traj or traj0
    if per_turn < 1 or per_traj < 1:
        raise ValueError(f"action budgets must be >= 1, got {per_turn} per turn, {per_traj} per episode")
    if isinstance(env, countdown_lib.Countdown):
        return _countdown_text(env, per_turn, per_traj)
    if isinstance(env, game2048_lib.Game2048):
        return _game2048_text(env, per_turn, per_traj)
    if isinstance(env, sudoku_lib.Sudoku):
        return _sudoku_text(env, per_turn, per_traj)
    build = _bandit_text if isinstance(env, bandit_lib.Bandit) else _grid_text
    return build(env, per_turn, per_traj)


def check_render(text: EnvText, env, state) -> None:
    """Host check: the pieces of `state` spell `env.to_text(state)`. Raises ValueError."""
    import numpy as np

    ids = np.asarray(jax.jit(text.render)(state))  # one program, not one an op
    got = "".join(text.pieces[i] for i in ids if i >= 0)
    want = env.to_text(state)
    if got != want:
        raise ValueError(f"rendered pieces {got!r} differ from to_text {want!r}")
