"""The update's forward passes: a batch's rows (`Batch`), per-token log-probs and entropies
through the output head (in chunks, at the reply positions alone, a single-turn group's prompt
once: `packed_hidden`), critic values, and micro-batching."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from starpo import losses
from starpo import model as model_lib
from starpo import sharding
from starpo.model import ModelConfig
from starpo.algo import AlgoConfig


@struct.dataclass
class Batch:
    """Kept rows, ready for PPO. All [N,T]; N = kept rows. Optional fields are None when unused.

    tokens int32, valid bool, loss_mask bool (model tokens, within valid), old_logprobs f32
    (training forward before the updates), ref_logprobs f32 | None, old_values f32 | None,
    advantages f32, returns f32, turns int32 | None (`Trajectory.window_turns`, under a
    context window), keep bool[N] | None (the rows of the top-p filter's kept groups; None: all).
    """

    tokens: jax.Array
    valid: jax.Array
    loss_mask: jax.Array
    old_logprobs: jax.Array
    ref_logprobs: jax.Array | None
    old_values: jax.Array | None
    advantages: jax.Array
    returns: jax.Array
    turns: jax.Array | None = None
    keep: jax.Array | None = None
    positions: jax.Array | None = None  # int[N,K] `reply_positions`: where the head runs
    # packed rows (`pack_rows`): each token's rotary position in its own row, `turns` its row
    # (of `segments` rows) and each row's tokens see their own row alone
    rotary: jax.Array | None = None
    segments: int = struct.field(pytree_node=False, default=0)
    # f32[N]: the in-group std of each row's group's normalised scores, what the filter ranks
    # by (RAGEN-2's `reward_std`; the gradient analysis buckets by it)
    group_std: jax.Array | None = None


def turn_window(algo: AlgoConfig, turns=None):
    """The `model.TurnWindow` of a batch's rows (turns [N,T]), or None without a window."""
    return model_lib.TurnWindow(turns, algo.context_window) if algo.context_window else None


def batch_window(algo: AlgoConfig, m: Batch):
    """The `model.TurnWindow` a (micro-)batch runs under: its rows' own (`turn_window`), or
    for packed rows (`pack_rows`) one that keeps each row to its own tokens."""
    if m.segments:
        return model_lib.TurnWindow(m.turns, 1, segments=True)
    return turn_window(algo, m.turns)


def _shift_right(x: jax.Array) -> jax.Array:
    """[B,T-1] predictions made at positions 0..T-2 -> [B,T] aligned with the token they
    predict (position 0 has no prediction: 0)."""
    return jnp.pad(x, ((0, 0), (1, 0)))


def token_logprobs(params, cfg: ModelConfig, tokens, valid, chunk: int = 0,
                   temperature: float = 1.0, window=None, positions=None, share: int = 1,
                   rotary=None):
    """Log-prob and entropy f32[B,T] of each token under the model's distribution at
    `temperature` (the one the sampler drew from), aligned with the token; window: the
    rollout's `model.TurnWindow` over the rows, or None; positions, share, rotary: see
    `per_token`.

    With `chunk` > 0 the output head runs over `chunk` positions at a time with its logits
    rematerialised in the backward pass, so f32 logits [B,T,V] never exist at once.
    """
    def head(logits, y):
        if temperature != 1.0:
            logits = logits / temperature
        return losses.logprobs_and_entropy(logits, y)

    return per_token(params, cfg, tokens, valid, head, chunk, window, positions, share, rotary)


def per_token(params, cfg: ModelConfig, tokens, valid, fn, chunk: int = 0, window=None,
              positions=None, share: int = 1, rotary=None):
    """fn(logits [B,n,V], targets int[B,n]) -> a tuple of [B,n] arrays, run on the logits
    that predict each token and aligned with the token (position 0: 0); with `chunk` > 0,
    over `chunk` positions at a time, rematerialised in the backward pass.

    positions: int[B,K] (`reply_positions`): the head runs at those positions alone (a row's
    reply tokens; 0 = none) and every other position's output is 0 (False). The head (the
    vocabulary's logits and their softmax) is then paid for K positions a row, not T: with
    SmolLM2's 49k vocabulary it is ~a fifth of a forward at every position.

    share > 1 (with positions; no window): the rows are single-turn episodes in groups of
    `share` consecutive rows with one prompt, each row's reply contiguous right after it
    (`Rollout.share`'s batches): the prompt runs once per group (`packed_hidden`).

    rotary: int[B,T] each token's rotary position where a row holds several sequences
    (`pack_rows`); None: the valid tokens before it."""
    tokens = sharding.constrain(tokens, ("batch", "length"))
    if share > 1:
        if positions is None or window is not None:
            raise ValueError("a shared prompt needs the reply positions and no context window")
        h = packed_hidden(params, cfg, tokens, valid, positions, share)
    else:
        hidden, _ = model_lib.hidden_states(params, cfg, tokens, valid, window=window,
                                            positions=rotary)
        h = (hidden[:, :-1] if positions is None  # logits at t-1 predict token t
             else jnp.take_along_axis(hidden, jnp.maximum(positions - 1, 0)[..., None], axis=1))
    targets = (tokens[:, 1:] if positions is None
               else jnp.take_along_axis(tokens, positions, axis=1))

    def head(params, h, y):
        return fn(model_lib.head_logits(params, cfg, h), y)

    B, n, D = h.shape
    if chunk <= 0 or chunk >= n:
        out = head(params, h, targets)
    else:
        count = -(-n // chunk)
        pad = count * chunk - n
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(B, count, chunk, D).swapaxes(0, 1)
        y = jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, count, chunk).swapaxes(0, 1)
        one = jax.checkpoint(head)
        out = jax.lax.map(lambda xs: one(params, *xs), (h, y))  # [count,B,chunk] each
        out = tuple(x.swapaxes(0, 1).reshape(B, -1)[:, :n] for x in out)
    if positions is None:
        return tuple(_shift_right(x) for x in out)
    # back to [B,T]: the unused slots (position 0) write to a column past the end, dropped
    T = tokens.shape[1]
    rows = jnp.arange(B)[:, None]
    at = jnp.where(positions > 0, positions, T)
    return tuple(jnp.zeros((B, T + 1), x.dtype).at[rows, at].set(x)[:, :T] for x in out)


def packed_hidden(params, cfg: ModelConfig, tokens, valid, positions, share: int):
    """The hidden states [B,K,D] that predict each row's reply tokens at `positions` [B,K]
    (`reply_positions`), for single-turn rows in groups of `share` consecutive rows that hold
    one prompt, each row's reply (at most K tokens) right after it. Each group is one packed
    sequence: the prompt once, then its rows' replies in blocks of K slots, every reply token
    at its own rotary position and, through a context window of one turn (`model.TurnWindow`:
    the prompt is its prefix, reply i its turn i), seeing the prompt and its own reply alone:
    the same numbers as each row's own forward (tests/test_update.py), for a group's prompt
    plus G replies of tokens instead of G prompts and replies."""
    B, T = tokens.shape
    K, G = positions.shape[1], share
    n = B // G
    lead = jnp.arange(n) * G
    # a group's prompt ends where its replies start (the same slot in every row with one)
    start = jnp.max(positions[:, 0].reshape(n, G), axis=1)  # [n]; 0: no row replied
    Tp = T + (G - 1) * K
    s = jnp.arange(Tp)[None, :]
    in_prompt = s < start[:, None]
    block = jnp.clip((s - start[:, None]) // K, 0, G - 1)
    src_row = jnp.where(in_prompt, lead[:, None], lead[:, None] + block)
    src_slot = jnp.where(in_prompt, s, start[:, None] + (s - start[:, None]) % K)
    inside = (s < start[:, None] + G * K) & (src_slot < T)
    src_slot = jnp.minimum(src_slot, T - 1)
    row_pos = model_lib.row_positions(valid)
    p_tokens = tokens[src_row, src_slot]
    p_valid = valid[src_row, src_slot] & inside
    p_pos = row_pos[src_row, src_slot]
    turns = jnp.where(in_prompt, model_lib.PREFIX_TURN, block).astype(jnp.int32)
    hidden, _ = model_lib.hidden_states(params, cfg, p_tokens, p_valid,
                                        window=model_lib.TurnWindow(turns, 1),
                                        positions=p_pos)  # [n,Tp,D]
    # reply token j of row lead_g + i: predicted at the prompt's last slot (j = 0) or at the
    # slot of its reply token j - 1 in block i
    group = jnp.arange(B) // G
    i = jnp.arange(B) % G
    j = positions - start[group][:, None]  # [B,K]
    at = jnp.where(j <= 0, start[group][:, None] - 1,
                   start[group][:, None] + i[:, None] * K + j - 1)
    return hidden[group[:, None], jnp.clip(at, 0, Tp - 1)]


def reply_count(loss_mask) -> int:
    """The K of `reply_positions` for a batch (host side): its longest row's reply tokens,
    rounded up to a power of two (at least 8) so that a run compiles few distinct Ks."""
    n = int(np.asarray(sharding.to_host(jnp.sum(loss_mask, axis=1))).max(initial=0))
    return max(8, 1 << max(n - 1, 0).bit_length())


def head_positions(algo: AlgoConfig, loss_mask):
    """`reply_positions` of an RL batch's rows (in a trace; T static), or None where the head
    runs everywhere: a row holds at most max_turn x response_length sampled tokens (the
    sampler's budget a turn), so where the context is longer the head skips the rest. No
    extra compile: the bound is the run's, not the batch's."""
    size = algo.max_turn * algo.response_length
    return reply_positions(loss_mask, size) if 0 < size < loss_mask.shape[1] else None


@functools.partial(jax.jit, static_argnums=1)
def reply_positions(loss_mask, size: int):
    """int32[B,size]: each row's reply-token (loss_mask) positions in order, then 0s. A row
    with more than `size` reply tokens raises nothing: pick `size` with `reply_count`."""
    size = min(size, loss_mask.shape[1])
    pick = jax.vmap(lambda m: jnp.nonzero(m, size=size, fill_value=0)[0])
    return pick(loss_mask).astype(jnp.int32)


def token_values(params, cfg: ModelConfig, tokens, valid, window=None, rotary=None):
    """Critic values f32[B,T]: V of the state before each token (hidden state at t-1); the
    critic sees the context the actor saw (window: a `model.TurnWindow` or None; rotary: see
    `per_token`)."""
    tokens = sharding.constrain(tokens, ("batch", "length"))
    hidden, _ = model_lib.hidden_states(params, cfg, tokens, valid, window=window,
                                        positions=rotary)
    return _shift_right(model_lib.head_values(params, cfg, hidden[:, :-1]))


def micro_split(tree, micro: int):
    """[N,...] leaves -> [N/micro, micro, ...]."""
    return jax.tree_util.tree_map(lambda x: x.reshape((-1, micro) + x.shape[1:]), tree)


def micro_map(fn, micro: int, *arrays):
    """fn over micro-batches of the leading axis, results concatenated back to [N,...]."""
    out = jax.lax.map(lambda xs: fn(*xs), micro_split(arrays, micro))
    return jax.tree_util.tree_map(lambda x: x.reshape((-1,) + x.shape[2:]), out)


def masked_stats(prefix: str, x, mask) -> dict:
    n = jnp.maximum(mask.sum(), 1)
    return {f"{prefix}/mean": jnp.where(mask, x, 0.0).sum() / n,
            f"{prefix}/max": jnp.where(mask, x, -jnp.inf).max(),
            f"{prefix}/min": jnp.where(mask, x, jnp.inf).min()}


def micro_size(algo: AlgoConfig, rows: int) -> int:
    micro = min(algo.micro_batch_size, rows)
    if rows % micro:
        raise ValueError(f"{rows} rows are not a multiple of micro_batch_size {micro}")
    return micro
