"""Jitted batched sampling with a KV cache that persists across turns.

`make_sampler(cfg, ...)` returns a `Sampler` whose `turn` is one compiled program per shape:
append a chunk of new tokens at each row's own offset (the prompt on the first call, the
environment's reply on later ones), then decode in a `lax.while_loop` until every row has
stopped -- on an end-of-sequence token, on a stop string such as `</answer>` (matched on device
over the bytes of the tokens written this turn), on its token budget, or when its context is
full. No Python runs per token and the history is never prefilled twice.

The state (`SamplerState`) carries the cache and a slot-aligned copy of every token with the
log-prob the sampler drew it with, so a finished episode is exactly the sampled tokens.
Temperature is a traced argument (training and validation temperatures share one compile);
top-k and top-p are static. The returned log-prob of a token is under the distribution actually
sampled from (temperature, top-k, top-p applied and renormalised); with temperature 0 (greedy)
it is the log-prob under the untempered, unfiltered distribution.

A context window (`Sampler.context_window` turns, 0 = off): every call is one dialogue turn
(`turn`); its chunk and reply attend only to the prompt prefix and the last `context_window`
turns (`model.TurnWindow`, the cache keeps each slot's turn), as the update's forward does.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from starpo import model as model_lib
from starpo.model import KVCache, ModelConfig
from starpo.sharding import constrain


@struct.dataclass
class SamplerState:
    """Everything that persists between turns of a batch of dialogues.

    cache:     the model's KV cache (slots [B,S])
    tokens:    [B,S] int32 token in each cache slot (padding where `cache.valid` is False)
    logprobs:  [B,S] f32 sampling log-prob of tokens the model wrote, 0 elsewhere
    generated: [B,S] bool the model wrote this token (the loss mask)
    """

    cache: KVCache
    tokens: jax.Array
    logprobs: jax.Array
    generated: jax.Array

    @property
    def valid(self):
        return self.cache.valid


@struct.dataclass
class Turn:
    """What one call wrote, per row.

    tokens [B,N] int32 (pad after `length`), logprobs [B,N], length [B] int32,
    stop_reason [B] int32: 0 not run (inactive row), 1 end-of-sequence token, 2 stop string,
    3 token budget, 4 context full (the chunk or the reply did not fit).
    """

    tokens: jax.Array
    logprobs: jax.Array
    length: jax.Array
    stop_reason: jax.Array


NOT_RUN, EOS, STOP_STRING, BUDGET, CONTEXT_FULL = 0, 1, 2, 3, 4


def init_state(cfg: ModelConfig, batch: int, max_len: int, cache_dtype=None,
               turns: bool = False, split: bool = False) -> SamplerState:
    """An empty state; turns=True keeps each slot's dialogue turn (a context window);
    split=True keeps the cache as per-layer buffers (`model.split_cache`) for good: a turn
    then decodes on them in place instead of on a per-layer copy of the stacked cache, which
    halves the cache's memory in a rollout (what `rollout` uses; the numbers are the same)."""
    rows = lambda dtype: constrain(jnp.zeros((batch, max_len), dtype), ("batch", "length"))  # noqa: E731
    return SamplerState(
        cache=model_lib.init_cache(cfg, batch, max_len, cache_dtype, turns, split),
        tokens=rows(jnp.int32), logprobs=rows(jnp.float32), generated=rows(bool))


def take_rows(state: SamplerState, rows) -> SamplerState:
    """The state of rows `rows` (int[R], NumPy or traced) of `state`, in that order (a row may
    repeat): its cache slots, bookkeeping and tokens, placed as `init_state` places them."""
    rows = jnp.asarray(rows)
    c = state.cache
    kv_axes = ("batch", "kv_heads", "length", "head_dim")
    if model_lib.is_split(c.k):
        k, v = (tuple(constrain(x[rows], kv_axes) for x in t) for t in (c.k, c.v))
    else:
        k, v = (constrain(t[:, rows], ("layers",) + kv_axes) for t in (c.k, c.v))
    slots = lambda x: None if x is None else constrain(x[rows], ("batch", "length"))  # noqa: E731
    cache = c.replace(k=k, v=v, valid=slots(c.valid), turn=slots(c.turn),
                      end=constrain(c.end[rows], ("batch",)),
                      pos=constrain(c.pos[rows], ("batch",)))
    return SamplerState(cache=cache, tokens=slots(state.tokens), logprobs=slots(state.logprobs),
                        generated=slots(state.generated))


def filter_logits(logits, top_k: int = 0, top_p: float = 1.0):
    """Set logits outside the top-k and outside the top-p nucleus to -inf. logits [B,V] f32.

    top-p keeps the smallest set of most likely tokens whose probability reaches `top_p`
    (the most likely token always stays); tokens tied with the last kept logit stay too.
    """
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        keep = before < top_p
        cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def categorical(key, logits, block: int = 256):
    """One draw per row from softmax(logits [B,V]) by inverting the cumulative distribution.

    Equivalent in distribution to `jax.random.categorical` (which adds Gumbel noise to every
    logit: B*V random numbers and two logarithms each, ~45 ms per decode step at B=64 over a
    49k vocabulary on a CPU core pair). Here a row needs one uniform number: the vocabulary is
    cut into blocks of `block` tokens, the block is picked from the cumulative block masses and
    the token from the cumulative masses inside that block, so the scans stay short.
    Tokens with logit -inf (or mass that underflows to 0) are never drawn.
    Returns (token [B] int32, max logit [B], total mass [B]): log p(token) =
    logits[token] - max - log(total).
    """
    B, V = logits.shape
    top = jnp.max(logits, axis=-1)
    mass = jnp.exp(logits - top[:, None])
    nb = -(-V // block)
    blocks = jnp.pad(mass, ((0, 0), (0, nb * block - V))).reshape(B, nb, block)
    block_mass = jnp.sum(blocks, axis=-1)  # [B, nb]
    upto = jnp.cumsum(block_mass, axis=-1)
    total = upto[:, -1]
    u = jax.random.uniform(key, (B,)) * total
    # the first block whose cumulative mass exceeds u, never past the last one holding mass
    last_block = nb - 1 - jnp.argmax((block_mass > 0)[:, ::-1], axis=-1)
    b = jnp.minimum(jnp.sum(upto <= u[:, None], axis=-1), last_block)
    rows = jnp.arange(B)
    inside = blocks[rows, b]  # [B, block]
    before = jnp.where(b > 0, upto[rows, jnp.maximum(b - 1, 0)], 0.0)
    last_in = block - 1 - jnp.argmax((inside > 0)[:, ::-1], axis=-1)
    i = jnp.minimum(jnp.sum(before[:, None] + jnp.cumsum(inside, axis=-1) <= u[:, None], axis=-1),
                    last_in)
    return (b * block + i).astype(jnp.int32), top, total


def sample_next(logits, key, temperature, top_k: int = 0, top_p: float = 1.0):
    """One token per row from logits [B,V] f32 -> (token [B] int32, log-prob [B] f32).

    temperature <= 0 is greedy (argmax of the raw logits, log-prob under the raw distribution).
    """
    greedy = temperature <= 0
    dist = filter_logits(logits / jnp.where(greedy, 1.0, temperature), top_k, top_p)
    if top_k or top_p < 1.0:  # greedy reports the unfiltered distribution's log-prob
        dist = jnp.where(greedy, logits, dist)
    sampled, top, total = categorical(key, dist)
    token = jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), sampled)
    picked = jnp.take_along_axis(dist, token[:, None], axis=-1)[:, 0]
    return token, picked - top - jnp.log(total)


def byte_table(token_bytes: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(bytes [V,W] uint8 right-aligned, lengths [V] int32) from `Tokenizer.token_bytes()`."""
    width = max(1, max(len(b) for b in token_bytes))
    table = np.zeros((len(token_bytes), width), np.uint8)
    for i, b in enumerate(token_bytes):
        if b:
            table[i, width - len(b):] = np.frombuffer(b, np.uint8)
    return table, np.array([len(b) for b in token_bytes], np.int32)


def _push_bytes(tail, new, n):
    """Append the last n[b] bytes of new[b] ([B,W2], right-aligned) to tail ([B,W]), keeping
    the most recent W bytes right-aligned."""
    W, W2 = tail.shape[1], new.shape[1]
    i = jnp.arange(W)[None, :] + n[:, None]  # index into the virtual tail ++ new[-n:]
    from_new = jnp.take_along_axis(new, jnp.clip(W2 - n[:, None] + i - W, 0, W2 - 1), axis=1)
    from_tail = jnp.take_along_axis(tail, jnp.clip(i, 0, W - 1), axis=1)
    return jnp.where(i >= W, from_new, from_tail)


def _ends_with_stop(tail, n_new, stops: tuple[bytes, ...]):
    """Whether any stop string ends inside the last n_new[b] bytes of tail [B,W]."""
    W = tail.shape[1]
    hit = jnp.zeros(tail.shape[0], bool)
    for s in stops:
        m = len(s)
        # match[:, j]: the m bytes from j on are the stop string, compared one string byte at
        # a time over every window (m slices of the tail, not one slice per window)
        match = jnp.ones((tail.shape[0], W - m + 1), bool)  # [B, W-m+1], end at e = m-1+j
        for k, byte in enumerate(s):
            match &= tail[:, k:k + W - m + 1] == byte
        ends = jnp.arange(m - 1, W)[None, :]
        hit |= jnp.any(match & (ends >= W - n_new[:, None]), axis=1)
    return hit


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Static sampling settings; `turn` and `generate` are jitted on them."""

    cfg: ModelConfig
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int
    stop: tuple[bytes, ...] = ()
    top_k: int = 0
    top_p: float = 1.0
    # matmul dtype of the chunk append (many tokens: compute-bound, where bfloat16 inputs with
    # float32 accumulation are fastest); decoding (one token per row: bandwidth-bound) uses
    # cfg.dtype. None: cfg.dtype for both.
    prefill_dtype: str | None = None
    # a turn (the chunk's append and the decode loop) reads only a window of the cache: the
    # smallest of `decode_windows` evenly spaced cut points (rounded up to 64 slots) that holds
    # every row's history plus its chunk and, for a live row, this turn's reply. One append and
    # one decode loop are compiled per window; 1 = always the whole cache.
    decode_windows: int = 1
    # context window in dialogue turns (`model.TurnWindow`): a turn's tokens see the prompt
    # prefix and the last `context_window` turns, the current one included; 0 = everything
    context_window: int = 0

    def window(self, turns):
        """The `TurnWindow` of tokens of turn(s) `turns` [B,T], or None (no context window)."""
        return model_lib.TurnWindow(turns, self.context_window) if self.context_window else None

    def turn(self, params, state: SamplerState, chunk, chunk_valid, key, temperature, active,
             token_bytes=None):
        """Append chunk [B,C] (valid [B,C]) per row, then decode this turn.

        active [B] bool: inactive rows are left untouched. Active rows need at least one valid
        chunk token (the reply continues from it). A row whose chunk (up to its last valid
        token) plus one reply token does not fit in the remaining context does not decode and
        reports CONTEXT_FULL (its chunk is appended if the chunk itself fits). token_bytes = `byte_table(...)` arrays, needed when `stop` is set.
        Returns (state, Turn). The state argument is donated.
        """
        return run_turn(self, params, state, chunk, chunk_valid, key, jnp.float32(temperature),
                     active, token_bytes)

    def generate(self, params, prompt, prompt_valid, key, temperature, cache_len: int,
                 token_bytes=None, cache_dtype=None, split: bool = False):
        """One turn from an empty state: prompt [B,P] -> (state, Turn) (split: `init_state`'s)."""
        B = prompt.shape[0]
        state = init_state(self.cfg, B, cache_len, cache_dtype, split=split)
        return run_turn(self, params, state, prompt, prompt_valid, key,
                        jnp.float32(temperature), jnp.ones((B,), bool), token_bytes, fresh=True)


def make_sampler(cfg: ModelConfig, tokenizer, max_new_tokens: int, stop=(), top_k: int = 0,
                 top_p: float = 1.0, prefill_dtype: str | None = None,
                 decode_windows: int = 1, context_window: int = 0) -> Sampler:
    """A Sampler for a model and its tokenizer; `stop` strings are matched on decoded bytes."""
    return Sampler(cfg, max_new_tokens, tuple(tokenizer.eos_ids), tokenizer.pad_id,
                   tuple(s.encode("utf-8") for s in stop), int(top_k), float(top_p),
                   prefill_dtype, int(decode_windows), int(context_window))


def window_sizes(max_len: int, n: int) -> tuple[int, ...]:
    """The cache windows of a `decode_windows=n` sampler over `max_len` slots, ascending; the
    last is always `max_len`."""
    if n < 1:
        raise ValueError(f"decode_windows must be >= 1, got {n}")
    ceil = lambda a, b: -(-a // b)  # noqa: E731
    cuts = {min(max_len, ceil(ceil(max_len * i, n), 64) * 64) for i in range(1, n + 1)}
    return tuple(sorted(cuts | {max_len}))


def append(params, cfg: ModelConfig, state: SamplerState, chunk, chunk_valid,
           fresh: bool = False, window=None):
    """Write chunk [B,C] (valid [B,C]) at each row's offset: its tokens into the state's token
    buffer and its keys/values into the cache, without decoding.
    Returns (hidden [B,C,D] of the chunk, new state). `params` already in cfg.dtype.
    fresh=True: the state is known to be empty (its first chunk), so the chunk attends to
    itself alone instead of also over every (empty) cache slot. window: the chunk's
    `model.TurnWindow` or None."""
    B, C = chunk.shape
    # the token buffer may be wider than the cache (a window of it, see `run_turn`)
    slots = jnp.where(chunk_valid, state.cache.end[:, None] + jnp.arange(C)[None, :],
                      state.tokens.shape[1])
    tokens = state.tokens.at[jnp.arange(B)[:, None], slots].set(chunk, mode="drop")
    hidden, cache = model_lib.hidden_states(params, cfg, chunk, chunk_valid, state.cache, fresh,
                                            window)
    return hidden, state.replace(cache=cache, tokens=tokens)


@struct.dataclass
class _Decode:
    """The decode loop's state ([B] per row unless said)."""

    step: jax.Array  # int32 []: reply tokens decoded so far
    key: jax.Array
    logits: jax.Array  # [B,V] of the next token
    cache: KVCache  # the (window of the) cache, one buffer per layer
    live: jax.Array  # bool: still decoding
    reason: jax.Array  # int32: stop reason (NOT_RUN while live)
    length: jax.Array  # int32: reply tokens written
    out_tokens: jax.Array  # [B,N] the reply
    out_logp: jax.Array  # [B,N] its log-probs
    tokens_buf: jax.Array  # [B,S] SamplerState.tokens
    lp_buf: jax.Array  # [B,S] SamplerState.logprobs
    gen_buf: jax.Array  # [B,S] SamplerState.generated
    tail: jax.Array  # [B,W] uint8: the last bytes written, right-aligned (stop strings)


class _Plan(NamedTuple):
    """A turn's chunk and who decodes ([B] per row): what every cache window's program gets."""

    chunk: jax.Array  # [B,C]
    write: jax.Array  # [B,C] chunk tokens that are appended
    span: jax.Array  # slots the chunk occupies
    live: jax.Array  # the row decodes a reply
    reason: jax.Array  # initial stop reason (CONTEXT_FULL for an active row that cannot)
    key: jax.Array
    turn: jax.Array  # int32 []: the dialogue turn (context window)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("fresh", "share"),
                   donate_argnums=2)
def run_turn(s: Sampler, params, state: SamplerState, chunk, chunk_valid, key, temperature,
             active, token_bytes, fresh: bool = False, turn=0, share: int = 1):
    """The jitted program behind `Sampler.turn` (exposed for ahead-of-time `.lower()`).
    fresh=True: `state` is empty (`Sampler.generate`); see `append`. turn: int32 [], the
    dialogue turn of this call's chunk and reply (read under a context window only).
    share > 1: the caller promises that the rows come in blocks of `share` consecutive rows
    with the same state, chunk and `active` (a group's first turn: its episodes start from
    one level); the chunk then runs through the model once per block and its keys, values and
    last logits are copied to the block's rows, which sample their replies apart."""
    cfg, N = s.cfg, s.max_new_tokens
    B, C = chunk.shape
    S = state.cache.max_len
    if share < 1 or B % share:
        raise ValueError(f"share {share} does not divide the batch's {B} rows")
    # Cast the weights once per call rather than on every decode step (no-ops when equal).
    pre_cfg = cfg.replace(dtype=s.prefill_dtype or cfg.dtype)
    pre_params = jax.tree_util.tree_map(lambda p: p.astype(pre_cfg.dtype), params)
    params = jax.tree_util.tree_map(lambda p: p.astype(cfg.dtype), params)

    # ---- append the chunk where it fits
    col = jnp.arange(C)[None, :]
    span = jnp.max(jnp.where(chunk_valid, col + 1, 0), axis=1)  # slots the chunk occupies
    fits = state.cache.end + span <= S
    write = chunk_valid & (active & fits)[:, None]
    # a turn continues from its chunk's last token, so an active row needs a non-empty chunk
    # and room for at least one reply token
    live = active & fits & (span > 0) & (state.cache.end + span < S)
    # Decode layer by layer on per-layer weight and cache buffers, cut once here: under the
    # layer scan each step would copy every layer's weights and cache block out of the stacked
    # arrays (see `model.split_layers`).
    split_params = model_lib.split_layers(params)
    reason = jnp.where(active & ~live, CONTEXT_FULL, NOT_RUN).astype(jnp.int32)
    plan = _Plan(chunk, write, span, live, reason, key, jnp.asarray(turn, jnp.int32))

    windows = window_sizes(S, s.decode_windows)
    # per-layer buffers kept for good and several windows: each window's program returns only
    # the slots this turn wrote, scattered into the buffers here, so no program of the switch
    # writes the whole cache (XLA copies a switch operand that a branch both reads and updates)
    new_slots = C + N if model_lib.is_split(state.cache.k) and len(windows) > 1 else 0

    def turn_in(W):
        return lambda _: _turn_in_window(s, W, pre_cfg, pre_params, split_params, state, plan,
                                         temperature, token_bytes, fresh, new_slots, share)

    if len(windows) == 1:
        c = turn_in(S)(None)
    else:  # every row's chunk, and a live row's whole reply, must fit in the window
        need = jnp.max(jnp.where(live, state.cache.end + span + N,
                                 jnp.where(jnp.any(write, axis=1), state.cache.end + span, 0)))
        c = jax.lax.switch(jnp.sum(jnp.asarray(windows) < need), [turn_in(W) for W in windows],
                           None)
    if new_slots:
        at = state.cache.end[:, None] + jnp.arange(new_slots)[None, :]  # [B,C+N]
        slots = jnp.where(at < c.cache.end[:, None], at, S)  # what was not written: dropped
        rows = jnp.arange(chunk.shape[0])[:, None]

        def put(buffers, blocks):  # blocks [B,K,C+N,E] -> in place into [B,K,S,E]
            return tuple(b.at[rows, :, slots].set(jnp.moveaxis(n, 2, 1), mode="drop")
                         for b, n in zip(buffers, blocks))

        c = c.replace(cache=c.cache.replace(k=put(state.cache.k, c.cache.k),
                                            v=put(state.cache.v, c.cache.v)))
    new_state = SamplerState(cache=c.cache, tokens=c.tokens_buf, logprobs=c.lp_buf,
                             generated=c.gen_buf)
    return new_state, Turn(c.out_tokens, c.out_logp, c.length, c.reason)


def _turn_in_window(s: Sampler, W: int, pre_cfg, pre_params, split_params,
                    state: SamplerState, plan: _Plan, temperature, token_bytes,
                    fresh: bool, new_slots: int = 0, share: int = 1) -> _Decode:
    """The turn on the first W cache slots: the chunk is appended there, attending over those
    slots only, then each layer's window is cut out for the decode loop and written back into
    the stacked buffers once at the end. Returns the final `_Decode` (whole cache), or with
    `new_slots` (per-layer buffers) its cache's k, v as the `new_slots` slots from each row's
    old end on, [B,K,new_slots,E] a layer, for the caller to write. share: see `run_turn`."""
    full = state.cache
    split = model_lib.is_split(full.k)  # per-layer buffers for good (`init_state(split=True)`)
    S, L = full.max_len, len(full.k) if split else full.k.shape[0]
    B, N = plan.chunk.shape[0], s.max_new_tokens

    def cut(x):
        return tuple(b[:, :, :W] for b in x) if split else x[:, :, :, :W]

    win = full if W == S else full.replace(
        k=cut(full.k), v=cut(full.v), valid=full.valid[:, :W],
        turn=None if full.turn is None else full.turn[:, :W])
    # one row of each block of `share` appends; the others copy its state and logits
    lead = np.arange(0, B, share)
    pick = (lambda x: x) if share == 1 else (lambda x: x[lead])  # noqa: E731
    st = state.replace(cache=win)
    hidden, appended = append(pre_params, pre_cfg, st if share == 1 else take_rows(st, lead),
                              pick(plan.chunk), pick(plan.write), fresh,
                              s.window(jnp.full((B // share, plan.chunk.shape[1]), plan.turn,
                                                jnp.int32)))
    last = pick(jnp.maximum(plan.span - 1, 0))
    logits = model_lib.head_logits(pre_params, pre_cfg,
                                   hidden[jnp.arange(B // share), last])  # [B/share,V]
    if share > 1:
        back = np.repeat(np.arange(B // share), share)
        logits, appended = logits[back], take_rows(appended, back)
    w = appended.cache
    tail_width = max([len(x) for x in s.stop] + [1]) + (token_bytes[0].shape[1] if s.stop else 0)
    init = _Decode(step=jnp.int32(0), key=plan.key, logits=logits, live=plan.live,
                   reason=plan.reason, length=jnp.zeros((B,), jnp.int32),
                   out_tokens=jnp.full((B, N), s.pad_id, jnp.int32),
                   out_logp=jnp.zeros((B, N), jnp.float32), tokens_buf=appended.tokens,
                   lp_buf=state.logprobs, gen_buf=state.generated,
                   tail=jnp.zeros((B, tail_width), jnp.uint8),
                   cache=model_lib.split_cache(w))
    c = jax.lax.while_loop(
        lambda c: (c.step < N) & jnp.any(c.live),
        functools.partial(_decode_step, s, split_params, temperature, token_bytes, S, plan.turn),
        init)
    # written back in place: a window is a copy, the whole cache's append wrote in place
    base = appended.cache if W == S else full
    if new_slots:  # the slots this turn wrote, from each row's old end on
        at = jnp.minimum(full.end[:, None] + jnp.arange(new_slots)[None, :], W - 1)
        k, v = ([jnp.take_along_axis(b, at[:, None, :, None], axis=2) for b in x]
                for x in (c.cache.k, c.cache.v))
        k, v = tuple(k), tuple(v)
    elif split:  # one window, the whole cache: the loop decoded on the buffers themselves
        k, v = c.cache.k, c.cache.v
    else:
        k, v = base.k, base.v
        for i in range(L):
            k = jax.lax.dynamic_update_slice(k, c.cache.k[i][None], (i, 0, 0, 0, 0))
            v = jax.lax.dynamic_update_slice(v, c.cache.v[i][None], (i, 0, 0, 0, 0))
    turns = None if base.turn is None else jax.lax.dynamic_update_slice(
        base.turn, c.cache.turn, (0, 0))
    return c.replace(cache=c.cache.replace(k=k, v=v, valid=jax.lax.dynamic_update_slice(
        base.valid, c.cache.valid, (0, 0)), turn=turns))


def _decode_step(s: Sampler, params, temperature, token_bytes, S: int, turn,
                 c: _Decode) -> _Decode:
    """Sample one token per live row, write it and run it through the model (`params`: the
    per-layer weights in the decode dtype; S: the whole cache's slots; turn: the dialogue
    turn, under a context window)."""
    N = s.max_new_tokens
    rows = jnp.arange(c.live.shape[0])
    key, sub = jax.random.split(c.key)
    token, logp = sample_next(c.logits, sub, temperature, s.top_k, s.top_p)
    live = c.live
    token = jnp.where(live, token, s.pad_id)
    logp = jnp.where(live, logp, 0.0)
    out_tokens = c.out_tokens.at[:, c.step].set(token)
    out_logp = c.out_logp.at[:, c.step].set(logp)
    slot = jnp.where(live, c.cache.end, S)
    buf = c.tokens_buf.at[rows, slot].set(token, mode="drop")
    lp_buf = c.lp_buf.at[rows, slot].set(logp, mode="drop")
    gen_buf = c.gen_buf.at[rows, slot].set(True, mode="drop")
    window = s.window(jnp.full(token[:, None].shape, turn, jnp.int32))
    hidden, cache = model_lib.hidden_states(params, s.cfg, token[:, None], live[:, None], c.cache,
                                            window=window)
    logits = model_lib.head_logits(params, s.cfg, hidden[:, 0])

    stopped = jnp.where(jnp.isin(token, jnp.asarray(s.eos_ids, jnp.int32)), EOS, 0)
    tail = c.tail
    if s.stop:
        table, lengths = token_bytes
        n = jnp.where(live, lengths[token], 0)
        tail = _push_bytes(tail, table[token], n)
        stopped = jnp.where((stopped == 0) & _ends_with_stop(tail, n, s.stop),
                            STOP_STRING, stopped)
    stopped = jnp.where((stopped == 0) & (c.step + 1 >= N), BUDGET, stopped)
    stopped = jnp.where((stopped == 0) & (cache.end >= S), CONTEXT_FULL, stopped)
    stopped = jnp.where(live, stopped, 0)
    return _Decode(step=c.step + 1, key=key, logits=logits, cache=cache,
                   live=live & (stopped == 0), reason=jnp.where(stopped > 0, stopped, c.reason),
                   length=c.length + live, out_tokens=out_tokens, out_logp=out_logp,
                   tokens_buf=buf, lp_buf=lp_buf, gen_buf=gen_buf, tail=tail)
