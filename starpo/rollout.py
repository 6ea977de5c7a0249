"""The StarPO multi-turn rollout on device: text in, env steps, text out, one jitted program.

`make_rollout(env, tokenizer, model_cfg, spec, ...)` returns a `Rollout` whose `run(params, key,
seed, temperature, stream)` plays `env_groups x group_size` episodes of one env variant to the
end and returns a `Trajectory` (starpo/trajectory.py) plus a dict of per-episode metrics; the
`RolloutSpec` holds the settings every rollout of a run shares. The system prompt and the env
prefix (identical in every row) are appended once without a reply; then every turn (one
`lax.fori_loop` iteration, so the sampler and the parser are traced once) is

  observation piece ids -> tokens (gather) -> sampler turn (append + decode, KV cache kept)
  -> reply bytes (per-token byte table) -> parse (the reference's regex, on device)
  -> env steps (vmap, up to max_actions_per_turn, budget, done) -> next observation piece ids

The dialogue's text tables live in starpo/dialogue.py, the answer parser in starpo/parsing.py.

`make_mixed_rollout(((env_a, groups_a), (env_b, groups_b), ...), ...)` plays a batch that
mixes env variants (the reference's env tags with group counts): rows env by env, each with
its own env's prefix, observations, parser, budgets and dynamics (env states: a tuple, each
env vmapped over its static row slice), all decoded as one sampler batch; `Trajectory.tag` is
the env's index. A one-env rollout is the mix of one env.

`make_scripted_rollout(...)` runs the same loop with given (teacher-forced) replies and no
model (starpo/scripted.py): the golden-dialogue tests and launch/play.py use it.

Deliberate differences from the reference (see also dialogue.py and parsing.py):
- the trained tokens are the sampled tokens (no re-rendering of the parsed reply);
- a reply that ended on the end-of-turn token is followed by the rest of the template's
  end-of-message text; any other stop (`</answer>`, budget) by all of it.

An episode ends when the env is done, the action budget is spent, `max_turn` turns have passed,
or the context is full (`truncated`: the observation or the reply did not fit; never an error).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs import text as env_text
from starpo import dialogue, lora, parsing, scripted
from starpo import sampler as sampler_lib
from starpo.trajectory import Trajectory, state_hash

FORMAT_PENALTY = -0.1
CONTEXT_MULTIPLE = 64  # an episode's reachable length is rounded up to a multiple of this
TRAIN, VALIDATION = 0, 1  # seed streams


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """The settings every rollout of a run shares, plain, mixed or scripted (hashable).

    max_turn: turns per episode; max_new_tokens: reply budget per turn; max_context: at most
    this many tokens per episode (a loose bound: the KV cache and the Trajectory's T are the
    length an episode can reach, prompt prefix + max_turn x (observation chunk +
    max_new_tokens) rounded up to a multiple of 64, where that is shorter; the samples are
    the same either way, see `context_length`); thinking: `<think>` before `<answer>`;
    max_actions_per_turn / max_actions_per_traj: action budgets of every env (None: each env's
    reference budget); length_prompt: the N of the prompt's "Max response length: N words
    (tokens)" (None: max_new_tokens, as the reference). Sampling (model rollouts only): top_k,
    top_p; cache_dtype of the KV cache; prefill_dtype: matmul dtype of appending the prompt
    and the observations (many tokens per row: compute-bound), replies decode in the model's
    dtype (None: that for both); decode_windows: see `sampler.Sampler.decode_windows` (early
    turns attend over the start of the context only); context_window: a turn sees the prompt
    prefix and the last context_window turns only, its own included (0 = the whole dialogue;
    an attention mask, see `model.TurnWindow`; the update must use the same).
    """

    max_turn: int = 5
    max_new_tokens: int = 100
    max_context: int = 2048
    thinking: bool = True
    max_actions_per_turn: int | None = None
    max_actions_per_traj: int | None = None
    length_prompt: int | None = None
    top_k: int = 0
    top_p: float = 1.0
    cache_dtype: object = None
    prefill_dtype: str | None = None
    decode_windows: int = 1
    context_window: int = 0

    @property
    def length_in_prompt(self) -> int:
        return self.length_prompt or self.max_new_tokens


# ------------------------------------------------------------------------------ the episode loop
@dataclasses.dataclass(frozen=True)
class _Setup:
    """The host-side tables of a batch's env variants (rows env by env: env i's rows carry
    tag `tags[i]` and use `texts[i]`, `tables[i]`) and the parser's byte table."""

    spec: RolloutSpec
    envs: tuple
    tags: tuple
    texts: tuple  # EnvText per env
    tables: tuple  # DialogueTables per env
    parse_table: tuple  # (bytes [V,W], lengths [V]): `parsing.parse_byte_table`


def _setup(envs, tags, tokenizer, spec: RolloutSpec, vocab_size: int | None = None) -> _Setup:
    texts = tuple(env_text.make_text(e, spec.max_actions_per_turn, spec.max_actions_per_traj)
                  for e in envs)
    tables = tuple(dialogue.build_tables(tokenizer, t, spec.max_turn, spec.length_in_prompt,
                                         spec.thinking) for t in texts)
    return _Setup(spec, tuple(envs), tuple(tags), texts, tables,
                  parsing.parse_byte_table(tokenizer, vocab_size))


class Policy(NamedTuple):
    """What plays the replies of the episode loop, over a policy state that has
    tokens/logprobs/generated [B,S] and `end` [B]."""

    # (state, chunk [B,P], valid [B,P]) -> state: append each row's fixed prompt prefix
    # (left-aligned in the chunk) without replying
    prefill: Callable
    # (state, chunk, valid, key, active [B], k) -> (state, Turn): append turn k's observation
    # and reply (rows not active are untouched)
    turn: Callable
    # True: `turn` also gets the env states (a tuple, one state [B_i] per env variant) and the
    # actions each row has run (int32[B]) as its last arguments, for a policy that reads the
    # level and its budget itself (`demos`: a solver's moves)
    sees_env: bool = False


class _Layout(NamedTuple):
    """The static layout of one traced batch: rows per env and the envs' stacked pieces."""

    setup: _Setup
    sizes: tuple  # rows per env
    pieces: dialogue.Pieces
    offsets: np.ndarray  # env i's piece ids start at offsets[i] in `pieces`

    @property
    def rows(self) -> list[slice]:
        return [slice(int(e - n), int(e)) for e, n in zip(np.cumsum(self.sizes), self.sizes)]

    @property
    def budget(self):
        """[B] each row's action budget."""
        return jnp.asarray(np.repeat([t.max_actions_per_traj for t in self.setup.texts],
                                     self.sizes), jnp.int32)


@struct.dataclass
class TurnRecords:
    """Per row and turn k ([B, max_turn] each; -1 / 0 where turn k did not happen)."""

    start: jax.Array  # int32: first slot of the turn's observation
    end: jax.Array  # int32: last slot of the turn's reply
    reward: jax.Array  # f32: env reward (sum over the executed actions)
    ran: jax.Array  # int32: an action ran
    effective_last: jax.Array  # int32: the last executed action was effective
    n_parsed: jax.Array  # int32: actions parsed from the reply
    n_valid: jax.Array  # int32: ... of them valid
    n_effective: jax.Array  # int32: executed actions that were effective
    state_hash: jax.Array  # int32: hash of the env state the turn acted on (GiGPO's anchor)


@struct.dataclass
class EpisodeCarry:
    """The episode loop's state between turns ([B] arrays unless said)."""

    policy: object  # the policy's state (tokens/logprobs/generated [B,S], end [B])
    env: tuple  # one env state [B_i] per env variant
    alive: jax.Array  # bool: the episode goes on
    num_actions: jax.Array  # int32: actions executed so far
    success: jax.Array  # bool: the env reported success
    penalty: jax.Array  # f32: format penalties so far
    truncated: jax.Array  # bool: the context was full
    reward: jax.Array  # f32: the last turn's reward
    any_ran: jax.Array  # bool: an action ran in the last turn
    last_token: jax.Array  # int32: the last reply's last token
    last_reason: jax.Array  # int32: the last reply's stop reason
    turns: TurnRecords


class _Steps(NamedTuple):
    """A turn's env steps of one env's rows so far ([b] each)."""

    env_state: object
    reward: jax.Array
    done: jax.Array
    executed: jax.Array
    effective_last: jax.Array
    success: jax.Array
    n_effective: jax.Array


class _Acted(NamedTuple):
    """What a turn's reply did, per row ([b] each): actions parsed, valid, and their steps."""

    n_parsed: jax.Array
    n_valid: jax.Array
    steps: _Steps


def _column(n, v):
    return jnp.full((n, 1), v, jnp.int32)


def _observation(b: _Layout, per_env):
    """Piece ids [B,K] of the stacked table from each env's own piece ids [B_i,K_i]."""
    K = max(p.shape[1] for p in per_env)
    return jnp.concatenate([jnp.pad(jnp.where(p > 0, p + off, 0), ((0, 0), (0, K - p.shape[1])))
                            for p, off in zip(per_env, b.offsets)], axis=0)


def _prefixes(setup: _Setup) -> list[np.ndarray]:
    """Each env's system prompt and env prefix: the tokens every one of its rows starts with."""
    return [np.concatenate([t.tokens[i, :t.lengths[i]] for i in (t.ids["start"], t.ids["prefix"])])
            for t in setup.tables]


def _prefix(setup: _Setup, sizes):
    """The system prompt and the env prefix of every row, left-aligned and padded to the
    longest env's: (tokens [B,P], valid [B,P], each env's prefix length)."""
    prefixes = _prefixes(setup)
    P = max(len(p) for p in prefixes)
    prefix = jnp.concatenate([jnp.broadcast_to(jnp.asarray(np.pad(p, (0, P - len(p))), jnp.int32),
                                               (n, P)) for p, n in zip(prefixes, sizes)])
    prefix_valid = jnp.concatenate([jnp.broadcast_to(jnp.arange(P) < len(p), (n, P))
                                    for p, n in zip(prefixes, sizes)])
    return prefix, prefix_valid, [len(p) for p in prefixes]


def _chunk_width(setup: _Setup, prefix_lengths) -> int:
    """Every turn's observation width: the widest env's (checked to fit after its prefix)."""
    widths = [dialogue.chunk_width(e, t) for e, t in zip(setup.texts, setup.tables)]
    for p, w in zip(prefix_lengths, widths):
        if p + w >= setup.spec.max_context:
            raise ValueError(f"max_context {setup.spec.max_context} cannot hold the prompt "
                             f"prefix ({p} tokens) and a first observation ({w})")
    return max(widths)


def context_length(setup: _Setup) -> int:
    """Slots of the KV cache and of the Trajectory (its T): what an episode can reach, the
    longest prompt prefix plus max_turn x (observation chunk + reply budget), rounded up to a
    multiple of CONTEXT_MULTIPLE, where that is below `spec.max_context`; else max_context.
    No episode ever reaches the end of the shorter buffer, so none is truncated that the
    longer one would not truncate, and every turn writes the same tokens into the same slots."""
    spec = setup.spec
    lengths = [len(p) for p in _prefixes(setup)]
    reach = max(lengths) + spec.max_turn * (_chunk_width(setup, lengths) + spec.max_new_tokens)
    return min(spec.max_context, -(-reach // CONTEXT_MULTIPLE) * CONTEXT_MULTIPLE)


def _first_ids(b: _Layout, env_states):
    """Piece ids of the first observation: turn 1's header, state, actions left, reply prime."""
    return _observation(b, [
        jnp.concatenate([_column(n, t.ids["header1"][1]), dialogue.state_pieces(e, t, s),
                         _column(n, t.ids["left"][e.max_actions_per_traj]),
                         _column(n, t.ids["gen"])], axis=1)
        for e, t, s, n in zip(b.setup.texts, b.setup.tables, env_states, b.sizes)])


def _next_ids(b: _Layout, c: EpisodeCarry, k):
    """Piece ids of the observation before turn k (k >= 1): the rest of the last reply's
    message, its reward, turn k+1's header, state and actions left, the reply prime."""
    M = b.setup.spec.max_turn
    is_eos = c.last_reason == sampler_lib.EOS
    per_env = []
    for e, t, s, r, n in zip(b.setup.texts, b.setup.tables, c.env, b.rows, b.sizes):
        ids, budget_e = t.ids, e.max_actions_per_traj
        close = jnp.full((n,), ids["close"], jnp.int32)
        for eos, p in zip(t.eos_ids, t.close_by_eos):
            close = jnp.where(is_eos[r] & (c.last_token[r] == eos), p, close)
        left = jnp.asarray(ids["left"])[jnp.clip(budget_e - c.num_actions[r], 0, budget_e)]
        header = jnp.asarray(ids["header2"])[jnp.minimum(k + 1, M)]  # "Turn k+1"
        per_env.append(jnp.concatenate([
            close[:, None], _column(n, ids["reward"]),
            dialogue.reward_pieces(t, c.reward[r], c.any_ran[r]),
            jnp.broadcast_to(header, (n, 1)).astype(jnp.int32), dialogue.state_pieces(e, t, s),
            left[:, None], _column(n, ids["gen"])], axis=1))
    return _observation(b, per_env)


def _play_actions(env, etext, thinking: bool, env_state, x, happened, budget_left, success,
                  keys) -> _Acted:
    """Parse the replies of one env's rows and run their valid actions (env steps vmapped).

    x [b,L] reply bytes (`parsing.reply_bytes`), happened [b] (a reply was written),
    budget_left [b], success [b] (so far), keys [R',b] with R' >= etext.max_actions_per_turn."""
    R = etext.max_actions_per_turn
    b = x.shape[0]
    if getattr(env, "text_actions", False):
        # Text actions (Countdown): every parsed piece is an action (the reference has no
        # action lookup for such envs); the env steps on the piece's bytes [b,L].
        c, first, last, has, n_parsed = parsing.parse_pieces(x, R, thinking)
        pieces = parsing.piece_bytes(c, first, last, has)  # [b,R,L]
        n_parsed = jnp.where(happened, n_parsed, 0)
        n_valid = n_parsed

        def action_at(state, s):
            return pieces[:, s]
    else:
        name_idx, n_parsed = parsing.parse_bytes(x, etext.action_names, R, thinking)
        n_parsed = jnp.where(happened, n_parsed, 0)
        is_valid = (name_idx >= 0) & happened[:, None]
        n_valid = jnp.sum(is_valid, axis=1).astype(jnp.int32)
        order = jnp.argsort(~is_valid, axis=1, stable=True)
        valid_idx = jnp.take_along_axis(name_idx, order, axis=1)  # valid ones first

        def action_at(state, s):
            return jax.vmap(env.name_to_action)(state, valid_idx[:, s])

    def act(s, a: _Steps) -> _Steps:
        run = happened & (s < n_valid) & (s < budget_left) & ~a.done
        action = action_at(a.env_state, s)
        new, r, d, info = jax.vmap(env.step)(keys[s], a.env_state, action)
        st = jax.tree_util.tree_map(
            lambda n, o: jnp.where(run.reshape(run.shape + (1,) * (n.ndim - 1)), n, o), new,
            a.env_state)
        return _Steps(st, a.reward + jnp.where(run, r, 0.0), a.done | (run & d),
                      a.executed + run, jnp.where(run, info["action_is_effective"],
                                                  a.effective_last),
                      a.success | (run & info["success"]),
                      a.n_effective + (run & info["action_is_effective"]))

    init = _Steps(env_state, jnp.zeros((b,), jnp.float32), jnp.zeros((b,), bool),
                  jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), success,
                  jnp.zeros((b,), jnp.int32))
    return _Acted(n_parsed, n_valid, jax.lax.fori_loop(0, R, act, init))


def _policy_step(b: _Layout, policy: Policy, c: EpisodeCarry, k, chunk, valid, key):
    """Turn k's observation + reply (rows not alive are untouched; skipped if none is).
    Returns (policy state, Turn, each row's end before the turn)."""
    B, N = c.alive.shape[0], b.setup.spec.max_new_tokens

    def go(c):
        env = (c.env, c.num_actions) if policy.sees_env else ()
        return policy.turn(c.policy, chunk, valid, key, c.alive, k, *env)

    def skip(c):
        return c.policy, _no_turn(B, N)

    return (*jax.lax.cond(jnp.any(c.alive), go, skip, c), c.policy.end)


def _no_turn(B: int, N: int) -> sampler_lib.Turn:
    return sampler_lib.Turn(jnp.zeros((B, N), jnp.int32), jnp.zeros((B, N), jnp.float32),
                            jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32))


def anchor_hash(env, env_state, salt: int = 0) -> jax.Array:
    """int32[B]: GiGPO's anchor of each row's env state: a hash of what the observation shows
    (a grid env's `render_codes`, verl-agent's anchor being the observation text), not of its
    bookkeeping, so the same board reached at different steps (Sokoban counts its steps, wall
    bumps included) joins one step group. Envs without a grid hash the whole state."""
    view = jax.vmap(env.render_codes)(env_state) if hasattr(env, "render_codes") else env_state
    return state_hash(view, salt=salt)


def _after_reply(b: _Layout, c: EpisodeCarry, k, key, pstate, turn, end_before) -> EpisodeCarry:
    """Parse turn k's replies, run their actions, record the turn."""
    setup, spec = b.setup, b.setup.spec
    happened = c.alive & (turn.length > 0)
    full_ctx = c.alive & (turn.stop_reason == sampler_lib.CONTEXT_FULL)
    table, tlens = (jnp.asarray(a) for a in setup.parse_table)
    prime = b"<think>" if spec.thinking else b"<answer>"
    x = parsing.reply_bytes(turn.tokens, turn.length, table, tlens, prime)
    budget = b.budget
    budget_left = budget - c.num_actions
    keys = jax.random.split(key, (max(t.max_actions_per_turn for t in setup.texts),
                                  happened.shape[0]))
    per_env = [_play_actions(env, e, spec.thinking, s, x[r], happened[r], budget_left[r],
                             c.success[r], keys[:, r])
               for env, e, s, r in zip(setup.envs, setup.texts, c.env, b.rows)]
    env_state = tuple(p.steps.env_state for p in per_env)
    before = jnp.concatenate([anchor_hash(env, s, salt=i)
                              for i, (env, s) in enumerate(zip(setup.envs, c.env))])
    a = jax.tree_util.tree_map(lambda *v: jnp.concatenate(v), *(
        p._replace(steps=p.steps._replace(env_state=())) for p in per_env))
    s = a.steps
    num_actions = c.num_actions + s.executed
    bad = happened & ((a.n_valid != a.n_parsed) | (a.n_valid == 0))
    ended = c.alive & (s.done | (num_actions >= budget) | (k + 1 >= spec.max_turn) | full_ctx
                       | ~happened)
    record = TurnRecords(
        start=jnp.where(happened, end_before, -1), end=jnp.where(happened, pstate.end - 1, -1),
        reward=jnp.where(happened, s.reward, 0.0), ran=(s.executed > 0).astype(jnp.int32),
        effective_last=s.effective_last.astype(jnp.int32), n_parsed=a.n_parsed,
        n_valid=a.n_valid, n_effective=s.n_effective,
        state_hash=jnp.where(happened, before, 0))
    return EpisodeCarry(
        policy=pstate, env=env_state, alive=c.alive & ~ended, num_actions=num_actions,
        success=s.success, penalty=c.penalty + jnp.where(bad, FORMAT_PENALTY, 0.0),
        truncated=c.truncated | full_ctx, reward=s.reward, any_ran=s.executed > 0,
        last_token=jnp.take_along_axis(turn.tokens, jnp.maximum(turn.length - 1, 0)[:, None],
                                       axis=1)[:, 0],
        last_reason=turn.stop_reason,
        turns=jax.tree_util.tree_map(lambda r, v: r.at[:, k].set(v), c.turns, record))


def _initial_carry(pstate, env_states, B: int, M: int) -> EpisodeCarry:
    zeros_f, zeros_i = jnp.zeros((B, M), jnp.float32), jnp.zeros((B, M), jnp.int32)
    none = jnp.full((B, M), -1, jnp.int32)
    return EpisodeCarry(
        policy=pstate, env=tuple(env_states), alive=jnp.ones((B,), bool),
        num_actions=jnp.zeros((B,), jnp.int32), success=jnp.zeros((B,), bool),
        penalty=jnp.zeros((B,), jnp.float32), truncated=jnp.zeros((B,), bool),
        reward=jnp.zeros((B,), jnp.float32), any_ran=jnp.zeros((B,), bool),
        last_token=jnp.zeros((B,), jnp.int32), last_reason=jnp.zeros((B,), jnp.int32),
        turns=TurnRecords(start=none, end=none, reward=zeros_f, ran=zeros_i,
                          effective_last=zeros_i, n_parsed=zeros_i, n_valid=zeros_i,
                          n_effective=zeros_i, state_hash=zeros_i))


def _results(b: _Layout, c: EpisodeCarry, group_id):
    """(Trajectory, per-episode metrics) of the finished episodes."""
    ps, tr = c.policy, c.turns
    T = ps.tokens.shape[1]
    length = ps.end
    posn = jnp.arange(T)[None]
    valid_tok = posn < length[:, None]
    started = (tr.start >= 0) & (tr.start[:, :1] >= 0)
    starts = jnp.where(started, tr.start, T + 1)
    turn_index = jnp.sum(posn[:, :, None] >= starts[:, None, :], axis=2) - 1
    prefix_length = jnp.where(started[:, 0], starts[:, 0], length)
    turn_index = jnp.where(valid_tok, jnp.maximum(turn_index, 0), -1).astype(jnp.int32)
    loss_mask = ps.generated & valid_tok
    traj = Trajectory(
        tokens=jnp.where(valid_tok, ps.tokens, 0), loss_mask=loss_mask, turn_index=turn_index,
        sample_logprobs=jnp.where(loss_mask, ps.logprobs, 0.0), turn_end=tr.end,
        turn_reward=tr.reward, penalty=c.penalty, success=c.success,
        num_actions=c.num_actions, group_id=group_id.astype(jnp.int32),
        tag=jnp.asarray(np.repeat(b.setup.tags, b.sizes), jnp.int32),
        length=length.astype(jnp.int32), state_hash=tr.state_hash,
        prefix_length=prefix_length.astype(jnp.int32))
    turns = jnp.sum(tr.end >= 0, axis=1)
    per_turn = jnp.maximum(turns, 1).astype(jnp.float32)
    metrics = {
        # the reference's per-episode metrics: per turn, the last executed action's info,
        # averaged over the episode's turns (a turn where nothing ran counts 0)
        "action_is_valid": jnp.sum(tr.ran, axis=1) / per_turn,
        "action_is_effective": jnp.sum(tr.effective_last * tr.ran, axis=1) / per_turn,
        "num_turns": turns.astype(jnp.int32),
        "num_parsed_actions": jnp.sum(tr.n_parsed, axis=1),
        "num_valid_actions": jnp.sum(tr.n_valid, axis=1),
        "num_effective_actions": jnp.sum(tr.n_effective, axis=1),
        "format_errors": jnp.sum((tr.end >= 0) & ((tr.n_valid != tr.n_parsed)
                                                  | (tr.n_valid == 0)), axis=1),
        "truncated": c.truncated,
        "context_used": length.astype(jnp.int32),
        "response_length": jnp.sum(loss_mask, axis=1).astype(jnp.int32),
    }
    return traj, metrics


def _play_episodes(setup: _Setup, policy: Policy, pstate, env_states, group_id, key):
    """Play a batch of episodes of one or several env variants.

    env_states: a tuple with one state [B_i] per env variant (its `setup.texts[i]`,
    `setup.tables[i]`); rows are laid out env by env (B = sum B_i). Every row has its own
    env's prompt prefix, observations, parser, budgets and dynamics; all rows share one policy
    batch (`policy` over its empty state `pstate`).
    Returns (Trajectory, metrics, tuple of final env states)."""
    B, M = group_id.shape[0], setup.spec.max_turn
    sizes = tuple(jax.tree_util.tree_leaves(s)[0].shape[0] for s in env_states)
    if sum(sizes) != B:
        raise ValueError(f"env states of {list(sizes)} rows for a batch of {B} rows")
    b = _Layout(setup, sizes, *dialogue.stack_pieces(setup.tables))
    # The system prompt and the env prefix are the same in every row of an env and in every
    # episode: they are appended once, without a reply (left-aligned, padded to the longest
    # env's). Every turn's observation then has one width C, the widest env's.
    prefix, prefix_valid, prefix_lengths = _prefix(setup, sizes)
    first_ids = _first_ids(b, env_states)
    C = _chunk_width(setup, prefix_lengths)

    def body(k, loop):
        c, key = loop
        key, k_env, k_pol = jax.random.split(key, 3)
        later = _next_ids(b, c, k)
        first = jnp.pad(first_ids, ((0, 0), (0, later.shape[1] - first_ids.shape[1])))
        chunk, valid = dialogue.assemble(b.pieces, jnp.where(k == 0, first, later), C)
        pstate, turn, end_before = _policy_step(b, policy, c, k, chunk, valid, k_pol)
        return _after_reply(b, c, k, k_env, pstate, turn, end_before), key

    # The barrier keeps XLA from constant-folding the prefix's forward pass (constant tokens
    # into an all-zero cache: minutes of compile time for nothing).
    pstate, prefix, prefix_valid = jax.lax.optimization_barrier((pstate, prefix, prefix_valid))
    c = _initial_carry(policy.prefill(pstate, prefix, prefix_valid), env_states, B, M)
    c, _ = jax.lax.fori_loop(0, M, body, (c, key))
    traj, metrics = _results(b, c, group_id)
    return traj, metrics, c.env


# ------------------------------------------------------------------------------ levels
@functools.partial(jax.jit, static_argnames=("env", "env_groups", "group_size"))
def initial_states(env, key, seed, stream, env_groups, group_size):
    """One reset per group (key from stream and seed + group index), repeated group_size times.
    Returns (env state [env_groups * group_size], group_id: each row's group seed). One
    program: op by op, a generator's reset (Sokoban's) would compile hundreds of small ones."""
    group_seed = jnp.asarray(seed, jnp.int32) + jnp.arange(env_groups, dtype=jnp.int32)
    base = jax.random.fold_in(key, stream)
    keys = jax.vmap(lambda s: jax.random.fold_in(base, s))(group_seed)
    states = jax.vmap(env.reset)(keys)
    rep = lambda x: jnp.repeat(x, group_size, axis=0)  # noqa: E731
    return jax.tree_util.tree_map(rep, states), rep(group_seed)


def mixed_initial_states(mix, key, seed, stream, group_size):
    """Initial states of a mixed batch, mix = ((env, groups), ...): (a tuple with one state
    [groups_i * group_size] per env, group_id [B]). Group g of env i resets as in
    `initial_states` from seed + (groups of the envs before i) + g, so every group of the
    batch has its own seed (its group id) and a batch of G groups uses seeds seed .. seed+G-1,
    as a single-env batch does."""
    states, group_ids, before = [], [], 0
    for env, groups in mix:
        s, g = initial_states(env, key, jnp.asarray(seed, jnp.int32) + before, stream, groups,
                              group_size)
        states.append(s)
        group_ids.append(g)
        before += groups
    return tuple(states), jnp.concatenate(group_ids)


# ------------------------------------------------------------------------------ chunks
def play_in_chunks(run_from: Callable, rows: int, chunk: int, group_size: int,
                   join: Callable | None = None) -> Callable:
    """`run_from(params, key, env_state [chunk], group_id [chunk], temperature)` (a program
    of `chunk` rows of one env) as a function of the same arguments over `rows` rows: the rows
    are played `chunk` at a time, in order, and the chunks' (Trajectory, metrics) joined row
    by row (`join`, a list -> one; default `concat_rows`), so a chunk's KV cache is all that
    is resident at once. `chunk` is whole groups (a multiple of group_size) dividing `rows`;
    0 or `rows`: `run_from` itself. Chunk i samples with key `fold_in(key, i)`: the numbers
    then depend on the chunk size only through the sampling stream (one chunk: `key` itself,
    exactly as one call of `run_from`)."""
    chunk = chunk_size(rows, chunk, group_size)
    if chunk == rows:
        return run_from
    join = join or concat_rows

    def play_from(params, key, env_state, group_id, temperature):
        parts = [run_from(params, jax.random.fold_in(key, i),
                          *_take_rows((env_state, group_id), i * chunk, chunk), temperature)
                 for i in range(rows // chunk)]
        return join(parts)

    return play_from


def chunk_size(rows: int, batch_size: int, group_size: int) -> int:
    """Episodes per chunk of a `batch_size` setting (0 = all `rows`), checked to be whole
    groups of `group_size` dividing `rows`; raises ValueError otherwise."""
    chunk = batch_size or rows
    if chunk < 1 or chunk % group_size or rows % chunk:
        raise ValueError(f"batch_size {batch_size} is not whole groups of {group_size} "
                         f"episodes dividing the {rows} episodes (0 = all at once)")
    return chunk


@functools.partial(jax.jit, static_argnums=2)
def _take_rows(tree, start, n: int):
    return jax.tree_util.tree_map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, n), tree)


def concat_rows(parts):
    """One pytree of [sum B_i, ...] arrays from a list of pytrees of [B_i, ...] arrays."""
    return jax.tree_util.tree_map(lambda *x: jnp.concatenate(x), *parts)


# ------------------------------------------------------------------------------ model rollouts
@dataclasses.dataclass(frozen=True)
class Rollout:
    """What `make_rollout` / `make_mixed_rollout` build: the episode functions and the
    host-side tables they close over (one EnvText and DialogueTables per env variant).

    `play` / `play_from` are plain functions: jit them with your own compiler options and
    shardings; `run` / `run_from` are them jitted with the factory's `compiler_options` (on
    first use)."""

    # (params, key, seed, temperature, stream=TRAIN): new levels from seeds (`make_rollout`)
    play: Callable
    # (params, key, env_state, group_id, temperature): given levels; env_state [B], or for a
    # mixed rollout a tuple with one state [B_i] per env
    play_from: Callable
    spec: RolloutSpec
    texts: tuple  # EnvText per env
    env_tables: tuple  # DialogueTables per env
    sampler: sampler_lib.Sampler
    compiler_options: dict | None = None
    context: int = 0  # the Trajectory's T and the cache's slots (`context_length`)
    # > 1: `play_from` takes its rows in blocks of `share` (groups) that start from one level,
    # and appends a block's first prompt once (`sampler.run_turn`'s share); see `make_rollout`
    share: int = 1

    @functools.cached_property
    def run(self) -> Callable:
        return jax.jit(self.play, compiler_options=self.compiler_options)

    @functools.cached_property
    def run_from(self) -> Callable:
        return jax.jit(self.play_from, compiler_options=self.compiler_options)

    @property
    def text(self) -> env_text.EnvText:
        """The EnvText of a one-env rollout."""
        return _only(self.texts)

    @property
    def tables(self) -> dialogue.DialogueTables:
        """The DialogueTables of a one-env rollout."""
        return _only(self.env_tables)


def _only(per_env: tuple):
    if len(per_env) != 1:
        raise ValueError(f"a rollout of {len(per_env)} env variants has one per env "
                         "(Rollout.texts / Rollout.env_tables)")
    return per_env[0]


def make_rollout(env, tokenizer, model_cfg, spec: RolloutSpec = RolloutSpec(), *,
                 env_groups: int, group_size: int, tag: int = 0,
                 compiler_options: dict | None = None, share_groups: bool = True) -> Rollout:
    """A full rollout of `env_groups x group_size` episodes of `env` with the settings `spec`.

    `Rollout.run(params, key, seed, temperature, stream)` -> (Trajectory, metrics):
      key: PRNG key of the sampler and env steps; the reset keys come from a fixed base
      (`jax.random.key(0)`) folded with `stream` (TRAIN=0, VALIDATION=1: disjoint levels) and
      `seed + g` for group g, so pass a counter (e.g. iteration * env_groups) for new levels;
      temperature: traced f32 (0 = greedy).
    metrics: dict of per-episode arrays [B]: action_is_valid, action_is_effective (the
    reference's per-turn averages), num_turns, num_parsed_actions, num_valid_actions,
    num_effective_actions, format_errors, truncated, context_used, response_length.
    Trajectory length T = `Rollout.context` (spec.max_context, or the length an episode can
    reach where that is shorter: `context_length`). `compiler_options` go to `jax.jit` of `run` /
    `run_from` (e.g. {"xla_backend_optimization_level": 0}: faster compiles of tiny models on
    CPU). `Rollout.run_from(params, key, env_state [B], group_id [B], temperature)` plays
    given levels. Every row's Trajectory.tag is `tag`.

    Single-turn episodes (spec.max_turn 1) in groups of more than one: the group's rows share
    one level, so its prompt runs through the model once and its keys and values are copied to
    the group's rows (`Rollout.share` = group_size; the Bandit's cpu batch of 8 x 8: its
    rollout 13.6 -> 7.3 s on a 2-core CPU). `run_from` then expects its rows in whole groups
    of consecutive rows that start from the same env state, as `initial_states` lays them out;
    share_groups=False lifts that (and the saving).
    """
    r = make_mixed_rollout(((env, env_groups),), tokenizer, model_cfg, spec,
                           group_size=group_size, tags=(tag,), compiler_options=compiler_options,
                           share_groups=share_groups)
    mixed_from = r.play_from

    def play_from(params, key, env_state, group_id, temperature):
        return mixed_from(params, key, (env_state,), group_id, temperature)

    return dataclasses.replace(r, play_from=play_from)


def make_mixed_rollout(mix, tokenizer, model_cfg, spec: RolloutSpec = RolloutSpec(), *,
                       group_size: int, tags: tuple | None = None,
                       compiler_options: dict | None = None,
                       merge_adapters: bool = True, share_groups: bool = True) -> Rollout:
    """A rollout of one batch that mixes env variants: mix = ((env, groups), ...).

    Rows are laid out env by env, group by group (`groups_i x group_size` rows of env i); each
    row has its own env's prompt prefix, observations, answer parser, action budgets and
    dynamics, and every row is sampled in one batch by one sampler. Env i's rows carry
    Trajectory.tag `tags[i]` (default i). Otherwise as `make_rollout`:
    `run(params, key, seed, temperature, stream)` resets group g of env i from
    seed + (groups of the envs before i) + g (`mixed_initial_states`);
    `run_from(params, key, env_states, group_id [B], temperature)` takes a tuple with one
    env state [groups_i * group_size] per env.

    A LoRA model's adapters are merged into its weights once per call (`lora.merge`, in the
    decode dtype) and the episodes sample the plain model; merge_adapters=False samples
    through the adapters instead (`benchmarks/rollout.py` times both). share_groups: see
    `make_rollout` (each env's rows are whole groups).
    """
    adapted_cfg = model_cfg
    if merge_adapters:
        model_cfg = lora.merged_config(model_cfg)
    if not mix or any(int(g) < 1 for _, g in mix):
        raise ValueError(f"a rollout needs at least one env and >= 1 group per env, got "
                         f"{[(getattr(e, 'name', e), g) for e, g in mix]}")
    tags = tuple(range(len(mix))) if tags is None else tuple(tags)
    setup = _setup(tuple(e for e, _ in mix), tags, tokenizer, spec, model_cfg.vocab_size)
    smp = sampler_lib.make_sampler(model_cfg, tokenizer, spec.max_new_tokens,
                                   stop=("</answer>",), top_k=spec.top_k, top_p=spec.top_p,
                                   prefill_dtype=spec.prefill_dtype,
                                   decode_windows=spec.decode_windows,
                                   context_window=spec.context_window)
    stop_table = tuple(jnp.asarray(a) for a in sampler_lib.byte_table(
        parsing.padded_token_bytes(tokenizer, model_cfg.vocab_size)))
    T = context_length(setup)
    share = group_size if share_groups and spec.max_turn == 1 else 1

    def play_from(params, key, env_states, group_id, temperature):
        if merge_adapters:
            params = lora.merge(adapted_cfg, params, jnp.dtype(model_cfg.dtype))[1]
        # one row per group where the groups share their prompt (the prefill copies it)
        pstate = sampler_lib.init_state(model_cfg, group_id.shape[0] // share, T,
                                        spec.cache_dtype, turns=spec.context_window > 0,
                                        split=True)
        policy = _model_policy(smp, params, temperature, stop_table, share)
        traj, metrics, _ = _play_episodes(setup, policy, _SamplerView(pstate), env_states,
                                         group_id, key)
        return traj, metrics

    def play(params, key, seed, temperature, stream=TRAIN):
        env_states, group_id = mixed_initial_states(mix, jax.random.key(0), seed, stream,
                                                    group_size)
        return play_from(params, key, env_states, group_id, temperature)

    return Rollout(play, play_from, spec, setup.texts, setup.tables, smp, compiler_options, T,
                   share)


def _model_policy(smp: sampler_lib.Sampler, params, temperature, stop_table,
                  share: int = 1) -> Policy:
    """The sampler as the episode loop's policy (state: `_SamplerView`). share: rows per
    block that play one level (`sampler.run_turn`); only for single-turn episodes, where
    every turn is a first turn."""
    prefill_cfg = smp.cfg.replace(dtype=smp.prefill_dtype or smp.cfg.dtype)

    def turn(ps, chunk, valid, k, active, turn_k):
        st, turn = sampler_lib.run_turn(smp, params, ps.inner, chunk, valid, k,
                                        jnp.float32(temperature), active, stop_table,
                                        turn=turn_k, share=share)
        return _SamplerView(st), turn

    def prefill(ps, chunk, valid):
        if share == 1:
            return _SamplerView(append_without_reply(prefill_cfg, params, ps.inner, chunk,
                                                     valid))
        # the prefix too runs once per group (`ps` holds one row per group), its keys and
        # values copied to the group's rows
        B = chunk.shape[0]
        lead, back = np.arange(0, B, share), np.repeat(np.arange(B // share), share)
        one = append_without_reply(prefill_cfg, params, ps.inner, chunk[lead], valid[lead])
        return _SamplerView(sampler_lib.take_rows(one, back))

    return Policy(prefill, turn)


def append_without_reply(cfg, params, state: sampler_lib.SamplerState, chunk, valid=None):
    """Append chunk [B,P] (valid [B,P], left-aligned; default all) at every row's offset of an
    *empty* sampler state and write its keys/values, without decoding a reply (the prompt
    prefix). The sampler's own append (`sampler.append`), minus its decode loop. Under a
    context window the prefix's slots keep their initial turn, model.PREFIX_TURN (always seen),
    and a prefix attends to itself alone either way."""
    params = jax.tree_util.tree_map(lambda p: p.astype(jnp.dtype(cfg.dtype)), params)
    valid = jnp.ones(chunk.shape, bool) if valid is None else valid
    return sampler_lib.append(params, cfg, state, chunk, valid, fresh=True)[1]


@struct.dataclass
class _SamplerView:
    """SamplerState with the `end` the episode loop reads."""

    inner: sampler_lib.SamplerState

    @property
    def end(self):
        return self.inner.cache.end

    @property
    def tokens(self):
        return self.inner.tokens

    @property
    def logprobs(self):
        return self.inner.logprobs

    @property
    def generated(self):
        return self.inner.generated


# ------------------------------------------------------------------------------ scripted rollouts
def make_scripted_rollout(env, tokenizer, spec: RolloutSpec = RolloutSpec(), *, tag: int = 0):
    """The same episode loop with given replies instead of a model (tests, launch/play.py);
    the sampling settings of `spec` do not apply.

    Returns (play, tables) where jitted `play(env_state [B], reply_ids [B,M,N], reply_len [B,M],
    reply_stop [B,M], key)` -> (Trajectory, metrics, final env state); build the reply arrays
    with `scripted.script_replies`. group_id is the row index. Cached: the same settings share
    one compiled program.
    """
    play, tables = _scripted((env,), (tag,), tokenizer, _dialogue_only(spec))

    def play_one(env_state, reply_ids, reply_len, reply_stop, key):
        traj, metrics, final = play((env_state,), reply_ids, reply_len, reply_stop, key)
        return traj, metrics, final[0]

    return play_one, tables[0]


def make_mixed_scripted_rollout(env_list, tokenizer, spec: RolloutSpec = RolloutSpec()):
    """`make_scripted_rollout` of a batch that mixes env variants (`env_list`, a tuple of envs;
    env i's rows carry tag i), as `make_mixed_rollout` plays it.

    Returns (play, tables per env) where jitted `play(env_states, reply_ids [B,M,N], reply_len
    [B,M], reply_stop [B,M], key)` takes a tuple with one state [B_i] per env (rows env by
    env) and returns (Trajectory, metrics, tuple of final env states).
    """
    return _scripted(tuple(env_list), tuple(range(len(env_list))), tokenizer,
                     _dialogue_only(spec))


def _dialogue_only(spec: RolloutSpec) -> RolloutSpec:
    """The spec with its sampling settings at their defaults (one cache entry per dialogue)."""
    return RolloutSpec(spec.max_turn, spec.max_new_tokens, spec.max_context, spec.thinking,
                       spec.max_actions_per_turn, spec.max_actions_per_traj,
                       spec.length_in_prompt)


def make_policy_rollout(env_list, tokenizer, spec: RolloutSpec, policy: Policy):
    """The episode loop of a batch of `env_list`'s variants (env i's rows carry tag i) played
    by a policy over `scripted.ScriptState` (given or computed replies, no model): jitted
    `play(env_states, key)` -> (Trajectory, metrics, tuple of final env states); group_id is
    the row index. `demos` plays a solver's moves this way."""
    setup = _setup(tuple(env_list), tuple(range(len(env_list))), tokenizer, spec)

    def play(env_states, key):
        B = sum(jax.tree_util.tree_leaves(s)[0].shape[0] for s in env_states)
        return _play_episodes(setup, policy, scripted.empty_state(B, context_length(setup)),
                              env_states, jnp.arange(B, dtype=jnp.int32), key)

    return jax.jit(play)


@functools.lru_cache(maxsize=8)
def _scripted(envs, tags, tokenizer, spec: RolloutSpec):
    setup = _setup(envs, tags, tokenizer, spec)

    def play(env_states, reply_ids, reply_len, reply_stop, key):
        B = reply_ids.shape[0]
        policy = Policy(*scripted.script_policy(reply_ids, reply_len, reply_stop))
        return _play_episodes(setup, policy, scripted.empty_state(B, context_length(setup)),
                             env_states, jnp.arange(B, dtype=jnp.int32), key)

    return jax.jit(play), setup.tables
