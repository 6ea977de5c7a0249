"""What one traced batch of episodes is made of: the envs' text tables and parsers (`_Setup`), the
policy a turn calls, the rows per env, the per-turn records and the loop's carry, and how long a
context an episode can reach."""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs import text as env_text
from starpo import dialogue, parsing
from starpo.rollout.spec import CONTEXT_MULTIPLE, RolloutSpec


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
