"""RAGEN-2's Countdown as a pure-JAX environment (single turn, deterministic).

The state shows a target and a list of numbers (`Target: 4, nums: [3, 5, 2]`); the answer is an
arithmetic expression that must use every number exactly once and equal the target. Scoring is
the reference's (`ragen/env/countdown/env.py`, TinyZero's rule):
- the multiset of the answer's digit runs (`re.findall(r'\\d+', answer)`, read as ints) must
  equal the numbers, else reward 0;
- the answer is evaluated (Python's `eval`, no builtins): within 1e-5 of the target pays
  `score` (1) and is a success, anything else (wrong value, syntax error, division by zero)
  pays `format_score` (0.1).
Done after one answer; a done env absorbs further answers (reward 0). The observation after the
answer is `Your answer get {reward} points.` with the reward printed as Python prints it (`1`,
`0.1`, `0`).

Actions are text: `step` takes the answer's bytes, int32[L] padded with -1 (the rollout hands
an env with `text_actions = True` the parsed answer piece itself instead of an action id; see
starpo/rollout/). The evaluator runs on device over the bytes (one `lax.scan`) with exact
rational arithmetic in int32; it accepts the integer-literal subset of Python's expressions:
`+ - * /`, unary `+`/`-`, parentheses, spaces, tabs and form feeds (newlines inside
parentheses). Python syntax outside it (`**`, `//`, `%`, float literals, comparisons, bitwise
operators, more than MAX_DEPTH nested parentheses) counts as an evaluation failure, as a syntax
error does in the reference. Exactness: for an expression over numbers x_i used once each,
every unreduced intermediate p/q has |p| + |q| <= prod(x_i + 1) (induction over + - * /), so
`Countdown` refuses settings where (max_number + 1) ** max_count >= 2 ** 31.

Levels are generated on device from the key, solvable by construction: the reference keeps only
dataset instances with a signed-sum solution (`has_solution`: +-n1 +-n2 ... = target), so a
level draws `count` numbers and a sign per number, and the target is the signed sum (the first
of SIGN_TRIES sign draws with a sum >= 1; all plus otherwise). `solve` (host) finds an
expression for any level by search over expression trees.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs import text as env_text
from envs import text_actions
from envs.text_actions import PAD, answer_bytes  # noqa: F401 (the env's own names)

# The reference's env_instruction (config/envs.yaml, tag Countdown).
INSTRUCTION = (
    "You are solving the Countdown puzzle. You should use the num list to create an equation "
    "that equals the target. Example answer format: <think> To find an equation using [3, 5, 2] "
    "to get 4. Let's check 2 + 5 = 7, 7 - 3 = 4. So the answer is 2 + 5 - 3 = 4. </think>"
    "<answer>2 + 5 - 3</answer>"
)
STATE_TEMPLATE = "Target: {target}, nums: {nums}"  # nums as Python prints a list
RESULT_TEMPLATE = "Your answer get {reward} points."
TOLERANCE = 100_000  # correct iff |value - target| < 1 / TOLERANCE (the reference's 1e-5)
MAX_DEPTH = 16  # most nested parentheses the evaluator follows
SIGN_TRIES = 16
_BIG = 10 ** 9  # digit runs saturate here (never a level's number)


def py_number(v: float) -> str:
    """A reward as the reference prints it: its score and format score are Python numbers
    (1, 0.1) and a failed answer the int 0, so whole numbers print without a point."""
    v = float(v)
    return str(int(v)) if v.is_integer() else repr(v)


@struct.dataclass
class CountdownState:
    nums: jax.Array  # int32[max_count]: the numbers, 0 past `count`
    count: jax.Array  # int32[]
    target: jax.Array  # int32[]
    answered: jax.Array  # bool[]
    reward: jax.Array  # float32[]: what the answer scored (0 before)


@dataclasses.dataclass(frozen=True)
class Countdown(text_actions.TextActionEnv):
    """Static settings (hashable: usable as a jit static argument).

    min_count / max_count: how many numbers a level has (uniform); min_number / max_number:
    their range (uniform); score / format_score: the reference's rewards."""

    name: str = "Countdown"
    min_count: int = 3
    max_count: int = 4
    min_number: int = 1
    max_number: int = 99
    score: float = 1.0
    format_score: float = 0.1

    instruction = INSTRUCTION

    def __post_init__(self):
        ints = ("min_count", "max_count", "min_number", "max_number")
        for f in ints:
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise ValueError(f"Countdown {f} must be an int, got {v!r}")
        if self.min_count < 1 or self.max_count < self.min_count:
            raise ValueError(f"Countdown needs 1 <= min_count <= max_count, got min_count="
                             f"{self.min_count}, max_count={self.max_count}")
        if self.min_number < 1 or self.max_number < self.min_number:
            raise ValueError(f"Countdown needs 1 <= min_number <= max_number, got min_number="
                             f"{self.min_number}, max_number={self.max_number}")
        if (self.max_number + 1) ** self.max_count >= 2 ** 31:
            raise ValueError(f"Countdown (max_number + 1) ** max_count must be < 2 ** 31 for exact "
                             f"int32 arithmetic, got {self.max_number + 1} ** {self.max_count}")
        for f in ("score", "format_score"):
            if not isinstance(getattr(self, f), (int, float)) or isinstance(getattr(self, f), bool):
                raise ValueError(f"Countdown {f} must be a number, got {getattr(self, f)!r}")

    @property
    def max_target(self) -> int:
        return self.max_count * self.max_number

    # ----------------------------------------------------------- dynamics
    # the reference's budgets: one answer a turn, one an episode
    budgets = (1, 1)

    def text(self, max_actions_per_turn: int, max_actions_per_traj: int):
        """How its states read, as pieces (`envs.text.EnvText`), with these budgets."""
        return _text(self, max_actions_per_turn, max_actions_per_traj)

    def reset(self, key):
        """A level: numbers, and a target reachable as their signed sum. -> CountdownState."""
        k_count, k_nums, k_signs = jax.random.split(key, 3)
        n = self.max_count
        count = jax.random.randint(k_count, (), self.min_count, self.max_count + 1)
        used = jnp.arange(n) < count
        nums = jax.random.randint(k_nums, (n,), self.min_number, self.max_number + 1)
        nums = jnp.where(used, nums, 0)
        signs = jnp.where(jax.random.bernoulli(k_signs, 0.5, (SIGN_TRIES, n)), -1, 1)
        sums = jnp.sum(signs * nums[None], axis=1)  # [SIGN_TRIES]
        ok = sums >= 1
        target = jnp.where(ok.any(), sums[jnp.argmax(ok)], jnp.sum(nums))
        return CountdownState(nums=nums.astype(jnp.int32), count=count.astype(jnp.int32),
                              target=target.astype(jnp.int32), answered=jnp.zeros((), bool),
                              reward=jnp.zeros((), jnp.float32))

    def step(self, key, state, action):
        """Score the answer `action` (int32[L] bytes, PAD after). key: unused (deterministic).

        Returns (state, reward f32[], done bool[] (always True), info) with info bools
        `success` (the answer equals the target), `action_is_effective` (reward > 0, as the
        reference) and `action_is_valid` (True: every answer is an action)."""
        del key
        fmt, correct = check_answer(action, state.nums, state.count, state.target)
        live = ~state.answered
        pays = jnp.where(fmt, jnp.where(correct, self.score, self.format_score), 0.0)
        reward = jnp.where(live, pays, 0.0).astype(jnp.float32)
        new = state.replace(answered=jnp.ones((), bool),
                            reward=jnp.where(live, reward, state.reward))
        info = {
            "success": new.reward == jnp.float32(self.score),
            "action_is_effective": live & (reward > 0),
            "action_is_valid": jnp.ones((), bool),
        }
        return new, reward, jnp.ones((), bool), info

    def is_done(self, state):
        """bool[]: the answer has been given."""
        return state.answered


    # ----------------------------------------------------------- host text
    def to_text(self, state):
        """The reference's text: `Target: 4, nums: [3, 5, 2]`, then the scored answer."""
        if bool(state.answered):
            return RESULT_TEMPLATE.format(reward=py_number(round(float(state.reward), 6)))
        nums = [int(x) for x in np.asarray(state.nums)[:int(state.count)]]
        return STATE_TEMPLATE.format(target=int(state.target), nums=nums)

    def from_text(self, text):
        """State from the level text `Target: T, nums: [a, b, ...]` (nothing answered)."""
        m = re.fullmatch(r"Target: (\d+), nums: \[(\d+(?:, \d+)*)\]", text)
        if not m:
            raise ValueError(f"not a Countdown level text: {text!r}")
        nums = [int(x) for x in m.group(2).split(", ")]
        if not self.min_count <= len(nums) <= self.max_count:
            raise ValueError(f"{len(nums)} numbers; this Countdown has {self.min_count} to "
                             f"{self.max_count}")
        if any(not self.min_number <= x <= self.max_number for x in nums):
            raise ValueError(f"numbers {nums} outside [{self.min_number}, {self.max_number}]")
        padded = nums + [0] * (self.max_count - len(nums))
        return CountdownState(nums=jnp.asarray(padded, jnp.int32),
                              count=jnp.asarray(len(nums), jnp.int32),
                              target=jnp.asarray(int(m.group(1)), jnp.int32),
                              answered=jnp.zeros((), bool), reward=jnp.zeros((), jnp.float32))


# ----------------------------------------------------------------------- the evaluator
_PLUS, _MINUS, _TIMES, _SLASH, _OPEN, _CLOSE = (ord(c) for c in "+-*/()")
_NONE, _MUL, _DIV = 0, 1, 2  # pending multiplicative operator of a frame


class _Carry(struct.PyTreeNode):
    expect: jax.Array  # bool: an operand comes next
    err: jax.Array  # bool: syntax error, or an unsupported construct
    zdiv: jax.Array  # bool: a division by zero happened
    innum: jax.Array  # bool: inside a digit run
    numv: jax.Array  # int32: the run's value (saturating at _BIG)
    lead0: jax.Array  # bool: the run started with 0
    bad0: jax.Array  # bool: ... and has a nonzero digit after it (Python: SyntaxError)
    runs: jax.Array  # int32[K]: the digit runs' values so far
    nruns: jax.Array  # int32
    depth: jax.Array  # int32: open parentheses
    acc: jax.Array  # int32[D, 2]: per frame the sum of finished terms (p, q)
    sign: jax.Array  # int32[D]: the sign the current term is added with
    term: jax.Array  # int32[D, 2]: the current term's product so far
    mulop: jax.Array  # int32[D]: _NONE (next factor starts the term), _MUL, _DIV
    neg: jax.Array  # bool[D]: odd number of unary minuses before the next factor


def _add(a, b, sign):
    return jnp.stack([a[0] * b[1] + sign * b[0] * a[1], a[1] * b[1]])


def _combine(term, op, f):
    """term `op` f (op _NONE: f itself) as unreduced rationals; -> (value, division by 0)."""
    mul = jnp.stack([term[0] * f[0], term[1] * f[1]])
    div = jnp.stack([term[0] * f[1], term[1] * f[0]])
    out = jnp.where(op == _NONE, f, jnp.where(op == _MUL, mul, div))
    return out, (op == _DIV) & (f[0] == 0)


def _deliver(c: _Carry, f, d):
    """A factor f (p, q) arrives in frame d: apply the frame's unary sign, combine into its
    term; an operator comes next."""
    f = jnp.where(c.neg[d], jnp.stack([-f[0], f[1]]), f)
    term, z = _combine(c.term[d], c.mulop[d], f)
    return c.replace(term=c.term.at[d].set(term), mulop=c.mulop.at[d].set(_NONE),
                     neg=c.neg.at[d].set(False), expect=jnp.zeros((), bool), zdiv=c.zdiv | z)


def _frame_value(c: _Carry, d):
    return _add(c.acc[d], c.term[d], c.sign[d])


def _end_number(c: _Carry, ending):
    """Close the digit run if `ending`: record it for the format check, deliver it as a factor."""
    k = c.runs.shape[0]
    go = ending & c.innum
    delivered = _deliver(c, jnp.stack([c.numv, jnp.ones((), jnp.int32)]), c.depth)
    delivered = delivered.replace(
        err=c.err | c.bad0,
        runs=c.runs.at[jnp.minimum(c.nruns, k - 1)].set(
            jnp.where(c.nruns < k, c.numv, c.runs[k - 1])),
        nruns=c.nruns + 1, innum=jnp.zeros((), bool))
    return jax.tree_util.tree_map(lambda a, b: jnp.where(go, a, b), delivered, c)


def _byte(c: _Carry, b):
    """Read one byte b (PAD: nothing)."""
    is_digit = (b >= ord("0")) & (b <= ord("9"))
    c = _end_number(c, (b != PAD) & ~is_digit)
    d = c.depth
    digit = b - ord("0")
    space = (b == ord(" ")) | (b == ord("\t")) | (b == 0x0C) | ((b == ord("\n")) & (d > 0))

    # a digit: extend the run or start one (a number right after an operand is an error)
    more = jnp.where(c.numv > _BIG // 10, _BIG, c.numv * 10 + digit)
    c_digit = c.replace(
        numv=jnp.where(c.innum, more, digit), lead0=jnp.where(c.innum, c.lead0, digit == 0),
        bad0=jnp.where(c.innum, c.bad0 | (c.lead0 & (digit != 0)), False),
        err=c.err | (~c.innum & ~c.expect), innum=jnp.ones((), bool))
    # + or -: unary before an operand, else finish the term
    is_minus = b == _MINUS
    c_unary = c.replace(neg=c.neg.at[d].set(c.neg[d] ^ is_minus))
    c_binary = c.replace(acc=c.acc.at[d].set(_frame_value(c, d)),
                         sign=c.sign.at[d].set(jnp.where(is_minus, -1, 1)),
                         term=c.term.at[d].set(jnp.array([0, 1], jnp.int32)),
                         mulop=c.mulop.at[d].set(_NONE), expect=jnp.ones((), bool))
    c_addsub = jax.tree_util.tree_map(lambda a, x: jnp.where(c.expect, a, x), c_unary, c_binary)
    # * or /
    c_muldiv = c.replace(mulop=c.mulop.at[d].set(jnp.where(b == _TIMES, _MUL, _DIV)),
                         expect=jnp.ones((), bool), err=c.err | c.expect)
    # ( opens a frame
    D = c.sign.shape[0]
    e = jnp.minimum(d + 1, D - 1)
    c_open = c.replace(depth=e, acc=c.acc.at[e].set(jnp.array([0, 1], jnp.int32)),
                       sign=c.sign.at[e].set(1), term=c.term.at[e].set(jnp.array([0, 1], jnp.int32)),
                       mulop=c.mulop.at[e].set(_NONE), neg=c.neg.at[e].set(False),
                       err=c.err | ~c.expect | (d + 1 >= D))
    # ) closes one: its value is a factor of the frame below
    up = jnp.maximum(d - 1, 0)
    c_close = _deliver(c.replace(depth=up), _frame_value(c, d), up)
    c_close = c_close.replace(err=c.err | c.expect | (d == 0))

    branches = [
        (is_digit, c_digit), ((b == _PLUS) | is_minus, c_addsub),
        ((b == _TIMES) | (b == _SLASH), c_muldiv), (b == _OPEN, c_open), (b == _CLOSE, c_close),
    ]
    out = c.replace(err=c.err | ((b != PAD) & ~space))  # anything else is an error
    for cond, branch in branches:
        out = jax.tree_util.tree_map(lambda a, x, cond=cond: jnp.where(cond, a, x), branch, out)
    return out


def evaluate(x, max_numbers: int):
    """Evaluate the expression x (int32[L] bytes, PAD after) as Python would (supported subset).

    Returns (ok bool[]: it evaluated, without syntax error or division by zero; value int32[2]:
    the unreduced rational (p, q); runs int32[max_numbers + 1]: the digit runs' values in
    order (saturated at 1e9), nruns int32[]: how many runs)."""
    D, K = MAX_DEPTH, max_numbers + 1
    zero = jnp.zeros((), bool)
    frame0 = jnp.tile(jnp.array([[0, 1]], jnp.int32), (D, 1))
    c = _Carry(expect=jnp.ones((), bool), err=zero, zdiv=zero, innum=zero,
               numv=jnp.zeros((), jnp.int32), lead0=zero, bad0=zero,
               runs=jnp.zeros((K,), jnp.int32), nruns=jnp.zeros((), jnp.int32),
               depth=jnp.zeros((), jnp.int32), acc=frame0, sign=jnp.ones((D,), jnp.int32),
               term=frame0, mulop=jnp.zeros((D,), jnp.int32), neg=jnp.zeros((D,), bool))
    c, _ = jax.lax.scan(lambda c, b: (_byte(c, b), None), c, jnp.asarray(x, jnp.int32))
    c = _end_number(c, jnp.ones((), bool))
    ok = ~c.err & ~c.zdiv & ~c.expect & (c.depth == 0)
    return ok, _frame_value(c, 0), c.runs, c.nruns


def check_answer(x, nums, count, target):
    """The reference's two checks of an answer x (int32[L] bytes, PAD after) for a level.

    Returns (format bool[]: its digit runs are the level's numbers, as a multiset;
    correct bool[]: it evaluates to within 1e-5 of the target)."""
    n = nums.shape[0]
    ok, (p, q), runs, nruns = evaluate(x, n)
    big = jnp.int32(_BIG + 1)
    want = jnp.sort(jnp.where(jnp.arange(n + 1) < count, jnp.pad(nums, (0, 1)), big))
    got = jnp.sort(jnp.where(jnp.arange(n + 1) < nruns, runs, big))
    fmt = (nruns == count) & jnp.all(want == got)
    # |p/q - t| < 1e-5: a float screen, then exact in int32 (p - t*q wraps, but is exact once
    # the screen has bounded it by |q|)
    qf = jnp.where(q == 0, 1, q).astype(jnp.float32)
    near = jnp.abs(p.astype(jnp.float32) / qf - target.astype(jnp.float32)) < 1.0
    dist = jnp.abs(p - target * q)
    aq = jnp.abs(q)
    correct = ok & (q != 0) & near & (dist <= (aq - 1) // TOLERANCE)
    return fmt, correct


# ----------------------------------------------------------------------- the reference, on host
def reference_reward(answer: str, nums, target, score=1, format_score=0.1):
    """The reference's `compute_reward` (ragen/env/countdown/env.py), verbatim in logic: for
    tests and the benchmark's plain-Python baseline."""
    try:
        found = [int(n) for n in re.findall(r"\d+", answer)]
        fmt = sorted(found) == sorted(nums)
    except Exception:  # noqa: BLE001 (the reference's bare except)
        fmt = False
    if not fmt:
        return 0
    try:
        result = eval(answer, {"__builtins__": None}, {})  # noqa: S307 (the reference's rule)
        correct = abs(result - target) < 1e-5
    except Exception:  # noqa: BLE001
        correct = False
    return score if correct else format_score


# ----------------------------------------------------------------------- the solver
def solve(nums, target) -> str | None:
    """An expression using every number once that equals `target` (exactly), or None.

    Search over expression trees: repeatedly combine two of the remaining values with + - * /
    (exact fractions; division by zero skipped), memoising the multisets already seen. Signed
    sums are tried first (every generated level has one), so generated levels solve at once."""
    nums = [int(x) for x in nums]
    for signs in itertools.product((1, -1), repeat=len(nums)):
        if sum(s * x for s, x in zip(signs, nums)) == target:
            text = " ".join(f"{'+' if s > 0 else '-'} {x}" for s, x in zip(signs, nums))
            return text[2:] if signs[0] > 0 else text
    seen = set()

    def search(items):  # items: tuple of (Fraction, text)
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        key = tuple(sorted(v for v, _ in items))
        if key in seen:
            return None
        seen.add(key)
        for i, j in itertools.permutations(range(len(items)), 2):
            (a, ta), (b, tb) = items[i], items[j]
            rest = tuple(it for k, it in enumerate(items) if k not in (i, j))
            options = [(a + b, f"({ta} + {tb})"), (a - b, f"({ta} - {tb})"),
                       (a * b, f"({ta} * {tb})")]
            if b != 0:
                options.append((a / b, f"({ta} / {tb})"))
            for v, t in options:
                found = search(rest + ((v, t),))
                if found is not None:
                    return found
        return None

    found = search(tuple((Fraction(x), str(x)) for x in nums))
    if found is not None and found.startswith("(") and len(nums) > 1:
        found = found[1:-1]  # the outermost parentheses (one top-level operation)
    return found


# envs.make(name): RAGEN-2's Countdown, 3 or 4 numbers (its dataset is Countdown-Tasks-3to4),
# one answer
VARIANTS = {"Countdown": (Countdown, dict(min_count=3, max_count=4, min_number=1, max_number=99))}


# ----------------------------------------------------------------------------- text
def _text(env, max_actions_per_turn, max_actions_per_traj) -> env_text.EnvText:
    """`Target: T, nums: [a, b, c]` as digit pieces and labels; after the answer one piece,
    `Your answer get R points.` for each reward the env pays."""
    digits = tuple(str(d) for d in range(10))
    TARGET, NUMS, SEP, CLOSE, RESULT = 10, 11, 12, 13, 14
    rewards = (env.score, env.format_score, 0)
    pieces = digits + ("Target: ", ", nums: [", ", ", "]") + tuple(
        RESULT_TEMPLATE.format(reward=py_number(r)) for r in rewards)
    n = env.max_count
    td, nd = len(str(env.max_target)), len(str(env.max_number))
    width = 1 + td + 1 + n * nd + (n - 1) + 1

    def number(v, k):  # piece ids [k]: v's digits right-aligned, -1 before
        pw = env_text.powers_of_ten(k)
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
    prefix = env_text.prefix_text(env, max_actions_per_traj)
    return env_text.EnvText(pieces, width, render, prefix, (), max_actions_per_turn,
                            max_actions_per_traj, ((long_pieces, 3),))
