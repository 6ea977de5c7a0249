"""A policy-free stand-in for the sampler: replies are given (teacher-forced), not sampled.

`script_replies` tokenises reply texts on the host as the sampler would have cut them;
`script_turn` appends an observation chunk and the turn's given reply with the sampler's fit
rules. `rollout.make_scripted_rollout` plays the episode loop with them (the golden-dialogue
tests, launch/play.py, benchmarks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from starpo import sampler as sampler_lib


@struct.dataclass
class ScriptState:
    """A policy-free stand-in for SamplerState: replies are given, not sampled."""

    tokens: jax.Array  # [B,S]
    logprobs: jax.Array  # [B,S]
    generated: jax.Array  # [B,S]
    end: jax.Array  # [B]


def script_turn(state: ScriptState, chunk, chunk_valid, active, reply, reply_len, reply_stop):
    """Append chunk then the given reply (teacher forcing), with the sampler's fit rules.

    reply [B,N] int32, reply_len [B], reply_stop [B] (the stop reason to report when it fits).
    Returns (state, Turn)."""
    B, S = state.tokens.shape
    C, N = chunk.shape[1], reply.shape[1]
    rows = jnp.arange(B)[:, None]
    span = jnp.max(jnp.where(chunk_valid, jnp.arange(C)[None] + 1, 0), axis=1)
    fits = state.end + span <= S
    live = active & fits & (span > 0) & (state.end + span < S)
    write = chunk_valid & (active & fits)[:, None]
    slots = jnp.where(write, state.end[:, None] + jnp.arange(C)[None], S)
    tokens = state.tokens.at[rows, slots].set(chunk, mode="drop")
    end = jnp.where(active & fits, state.end + span, state.end)
    n = jnp.where(live, jnp.minimum(reply_len, S - end), 0)
    rslots = jnp.where(jnp.arange(N)[None] < n[:, None], end[:, None] + jnp.arange(N)[None], S)
    tokens = tokens.at[rows, rslots].set(reply, mode="drop")
    generated = state.generated.at[rows, rslots].set(True, mode="drop")
    reason = jnp.where(live, jnp.where(n < reply_len, sampler_lib.CONTEXT_FULL, reply_stop),
                       jnp.where(active, sampler_lib.CONTEXT_FULL, sampler_lib.NOT_RUN))
    out = jnp.where(jnp.arange(N)[None] < n[:, None], reply, 0)
    turn = sampler_lib.Turn(out, jnp.zeros(out.shape, jnp.float32), n.astype(jnp.int32),
                            reason.astype(jnp.int32))
    return ScriptState(tokens, state.logprobs, generated, end + n), turn


def script_replies(tokenizer, replies: list[list[str]], max_turn: int, max_new_tokens: int,
                   stop: str = "</answer>"):
    """Host: reply texts [B][<=max_turn] -> (ids [B,M,N], len [B,M], stop [B,M]) numpy arrays.

    A reply is cut after its first `stop` (stop reason STOP_STRING) or end-of-sequence token
    (EOS, kept), else it ends on the budget (BUDGET); at most `max_new_tokens` tokens are kept, like the sampler. Rows with
    fewer replies than turns get empty ones (length 0): the episode ends there (after showing
    the next observation) if it has not ended before."""
    B = len(replies)
    ids = np.zeros((B, max_turn, max_new_tokens), np.int32)
    lens = np.zeros((B, max_turn), np.int32)
    stops = np.full((B, max_turn), sampler_lib.NOT_RUN, np.int32)
    for b, rs in enumerate(replies):
        if len(rs) > max_turn:
            raise ValueError(f"{len(rs)} replies for at most {max_turn} turns")
        for k, r in enumerate(rs):
            cut = r.find(stop) if stop else -1
            stops[b, k] = sampler_lib.BUDGET
            if cut >= 0:
                r = r[:cut + len(stop)]
                stops[b, k] = sampler_lib.STOP_STRING
            t = tokenizer.encode(r)
            eos = [i for i, x in enumerate(t) if x in tokenizer.eos_ids]
            if eos:  # the sampler stops on (and keeps) an end-of-sequence token
                t = t[:eos[0] + 1]
                stops[b, k] = sampler_lib.EOS
            t = t[:max_new_tokens]
            if not t:
                raise ValueError("a scripted reply must have at least one token")
            ids[b, k, :len(t)] = t
            lens[b, k] = len(t)
    return ids, lens, stops



def empty_state(batch: int, max_context: int) -> ScriptState:
    return ScriptState(jnp.zeros((batch, max_context), jnp.int32),
                       jnp.zeros((batch, max_context), jnp.float32),
                       jnp.zeros((batch, max_context), bool), jnp.zeros((batch,), jnp.int32))


def prefill(state: ScriptState, chunk, valid) -> ScriptState:
    """Append each row's prompt prefix chunk [B,P] (valid [B,P], left-aligned) to an empty
    state, without a reply."""
    # a shorter prefix's padding lies past its row's end: later writes replace it
    tokens = jax.lax.dynamic_update_slice(state.tokens, chunk, (0, 0))
    return state.replace(tokens=tokens, end=state.end + jnp.sum(valid, axis=1))


def script_policy(reply_ids, reply_len, reply_stop):
    """(prefill, turn) of the episode loop (`rollout.Policy`) that writes turn k's given reply:
    reply_ids [B,M,N], reply_len [B,M], reply_stop [B,M] from `script_replies`."""
    def turn(state, chunk, valid, key, active, k):
        del key
        take = lambda a: jax.lax.dynamic_index_in_dim(a, k, axis=1, keepdims=False)  # noqa: E731
        return script_turn(state, chunk, valid, active, take(reply_ids), take(reply_len),
                           take(reply_stop))

    return prefill, turn
