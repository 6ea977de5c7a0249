"""The Trajectory: one row per episode, the contract between the rollout and the update.

A row is the whole multi-turn dialogue of one episode as the sampler saw it, left-aligned in a
buffer of fixed length T: positions [0, length) are real tokens (system prompt, observations,
the model's replies), positions [length, T) are padding. The tokens the update trains on are
exactly the sampled tokens (no re-rendering); `loss_mask` marks them.

Rows are laid out as `env_groups x group_size`: rows g*group_size ... (g+1)*group_size - 1
share one initial state (same seed) and one `group_id`. The StarPO-S filter relies on that layout
(it gathers whole groups with static shapes); reward normalisation and GRPO use `group_id`.

Turns: the k-th turn (k = 0 .. max_turn-1) is the observation shown before the k-th reply plus the
reply. `turn_end[b, k]` is the position of the k-th reply's last model token, or -1 if the episode
ended before turn k. Turns that happened come first (turn_end >= 0 for k < number of turns).
Rewards live per turn (`turn_reward`, the sum of the env rewards of that turn's executed actions)
and per episode (`penalty`, the sum of the per-turn format penalties, <= 0). The trajectory reward
is `sum(turn_reward) + penalty`; the update places it on the tokens (see `advantages.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Trajectory:
    """A batch of B episodes in a context of T tokens with at most M = max_turn turns.

    tokens:          int32[B,T]  token ids; padding after `length` (any id, never attended)
    loss_mask:       bool[B,T]   True on tokens the model wrote (its replies); False on the
                                 prompt, observations, reward text and padding
    turn_index:      int32[B,T]  turn k of each token (observation k and reply k carry k;
                                 the system prompt/instruction belong to turn 0), -1 on padding
    sample_logprobs: f32[B,T]    log-prob of tokens[b,t] under the distribution the sampler drew
                                 it from (tempered), on the token it belongs to; 0 off loss_mask
    turn_end:        int32[B,M]  position of turn k's last model token, -1 if turn k did not happen
    turn_reward:     f32[B,M]    env reward of turn k (sum over its executed actions), 0 if absent
    penalty:         f32[B]      total format penalty of the episode (<= 0)
    success:         bool[B]     the env reported success
    num_actions:     int32[B]    valid actions executed in the episode
    group_id:        int32[B]    rows sharing an initial state share an id (any int32 values)
    tag:             int32[B]    environment tag id (e.g. Bandit=0, BanditTest=1): the grouping of
                                 `inductive` reward normalisation
    length:          int32[B]    number of real tokens; valid = arange(T) < length
    state_hash:      int32[B,M]  `rollout.anchor_hash` of the state turn k acted on (before its
                                 actions), 0 if turn k did not happen; GiGPO's anchor states.
                                 None when a trajectory was not made by the rollout
    prefix_length:   int32[B]    tokens of the prompt prefix (system prompt and instruction,
                                 turn_index 0 but seen by every turn under a context window,
                                 `window_turns`); None when not made by the rollout
    """

    tokens: jax.Array
    loss_mask: jax.Array
    turn_index: jax.Array
    sample_logprobs: jax.Array
    turn_end: jax.Array
    turn_reward: jax.Array
    penalty: jax.Array
    success: jax.Array
    num_actions: jax.Array
    group_id: jax.Array
    tag: jax.Array
    length: jax.Array
    state_hash: jax.Array | None = None
    prefix_length: jax.Array | None = None

    @property
    def valid(self) -> jax.Array:
        """bool[B,T]: real (non-padding) tokens."""
        return jnp.arange(self.tokens.shape[1])[None, :] < self.length[:, None]

    @property
    def score(self) -> jax.Array:
        """f32[B]: the trajectory reward, sum of turn rewards plus penalty."""
        return self.turn_reward.sum(axis=1) + self.penalty

    def window_turns(self) -> jax.Array:
        """int32[B,T]: each token's turn for a context window (`model.TurnWindow`): turn_index,
        with the prompt prefix at model.PREFIX_TURN (-1, always seen) -- what the sampler's
        cache recorded for the same slots."""
        if self.prefix_length is None:
            raise ValueError("a context window needs Trajectory.prefix_length (the rollout's)")
        prefix = jnp.arange(self.tokens.shape[1])[None, :] < self.prefix_length[:, None]
        return jnp.where(prefix, -1, self.turn_index)

    def take(self, rows: jax.Array) -> "Trajectory":
        """The rows `rows` (int[N]) of every field, in that order."""
        return jax.tree_util.tree_map(lambda x: jnp.take(x, rows, axis=0), self)

    def truncate(self, T: int) -> "Trajectory":
        """The first T positions of every [B,T] field (itself if T covers them all). Only
        padding may be cut: T must be at least `length.max()` (turn_end positions are then all
        < T)."""
        if T >= self.tokens.shape[1]:
            return self

        def cut(x):
            return x[:, :T]
        return self.replace(tokens=cut(self.tokens), loss_mask=cut(self.loss_mask),
                            turn_index=cut(self.turn_index),
                            sample_logprobs=cut(self.sample_logprobs))


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's finaliser on uint32: every input bit moves about half the output bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _as_words(x: jax.Array) -> jax.Array:
    """uint32[B,n]: the values of a leaf [B,...] as 32-bit words (floats by their bits)."""
    x = x.reshape(x.shape[0], -1)
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = jax.lax.bitcast_convert_type(x.astype(jnp.float32) + 0.0, jnp.uint32)  # -0 -> +0
    else:
        x = jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)
    return x


def state_hash(state, salt: int = 0) -> jax.Array:
    """int32[B]: a hash of each row of an env state pytree (leaves [B,...]).

    Each word is mixed with its position (leaf and index) before a wrapping sum, and the sum is
    mixed again, so equal states hash equally and a changed cell, a moved value or a swap of two
    cells changes the hash. Distinct states collide with probability about 2^-32 per pair: GiGPO
    then merges two step groups of one prompt group (a slightly wrong baseline, never a mix of
    prompt groups, since group_id is part of its key). `salt` separates env variants.
    """
    h = None
    for i, leaf in enumerate(jax.tree_util.tree_leaves(state)):
        words = _as_words(jnp.asarray(leaf))
        position = np.arange(words.shape[1], dtype=np.uint64) * 0x9E3779B9 + (i + 1) * 0x632BE5AB
        mixed = _fmix32(words ^ jnp.asarray((position + salt) % 2**32, jnp.uint32)[None, :])
        leaf_h = _fmix32(mixed.sum(axis=1, dtype=jnp.uint32) + jnp.uint32(words.shape[1]))
        h = leaf_h if h is None else _fmix32(h * jnp.uint32(31) + leaf_h)
    return jax.lax.bitcast_convert_type(h, jnp.int32)


def trimmed_length(max_length: int, context: int, bucket: int) -> int:
    """The context to train on: the longest row rounded up to a multiple of `bucket`, at most
    `context` (`bucket` <= 0: the whole context). Rounding bounds the distinct shapes, so a run
    compiles its update at most context / bucket times however its lengths vary."""
    if bucket <= 0:
        return context
    return int(min(context, max(bucket, -(-max_length // bucket) * bucket)))


# A context compiled late has cost at most this many whole updates of padding first (below).
REUSE_PATIENCE = 16


class UpdateContexts:
    """The context each batch's update trains on: its own (`trimmed_length`'s bucket) or a
    larger one the run has already compiled, whichever the run has paid less for so far.

    A new context costs a compile (10-17 s for SmolLM2's update on an H100, against 0.3-0.7 s
    an update: docs/results.md, "Sokoban"), while a larger compiled one serves the batch at
    once at the price of its padding: 1 - own / larger of an update. So a batch runs on the
    smallest compiled context that holds it, and its own context compiles when the padding
    spent on it reaches `patience` whole updates (rent or buy, with a compile priced at
    `patience` updates); a batch longer than every compiled context compiles its own at once.
    Padding changes nothing but float rounding (the update masks it). The choices depend on
    the batches' lengths alone, so every process chooses alike, and a resumed run too (its
    state is in the checkpoint: `state_dict`). One call per update, in order."""

    def __init__(self, bucket: int, patience: float = REUSE_PATIENCE, state: dict | None = None):
        self.bucket, self.patience = bucket, patience
        state = state or {}
        self.compiled = set(int(c) for c in state.get("compiled", ()))
        self.padding = {int(c): float(x) for c, x in state.get("padding", {}).items()}

    def __call__(self, max_length: int, context: int) -> int:
        own = trimmed_length(max_length, context, self.bucket)
        larger = [c for c in self.compiled if own < c <= context]
        if own in self.compiled or not larger:
            self.compiled.add(own)
            return own
        serving = min(larger)
        self.padding[own] = self.padding.get(own, 0.0) + 1.0 - own / serving
        if self.padding[own] < self.patience:
            return serving
        del self.padding[own]
        self.compiled.add(own)
        return own

    def state_dict(self) -> dict:
        return {"compiled": sorted(self.compiled),
                "padding": {str(c): x for c, x in sorted(self.padding.items())}}


def check_trajectory(traj: Trajectory, group_size: int) -> None:
    """Host-side check of the contract (for rollout tests and debugging; not jittable).

    Raises ValueError naming the first violated rule.
    """
    t = jax.tree_util.tree_map(np.asarray, traj)
    B, T = t.tokens.shape
    M = t.turn_end.shape[1]
    rows = {"loss_mask": (B, T), "turn_index": (B, T), "sample_logprobs": (B, T),
            "turn_end": (B, M), "turn_reward": (B, M), "penalty": (B,), "success": (B,),
            "num_actions": (B,), "group_id": (B,), "tag": (B,), "length": (B,)}
    if t.state_hash is not None:
        rows["state_hash"] = (B, M)
    if t.prefix_length is not None:
        rows["prefix_length"] = (B,)
    for name, shape in rows.items():
        if getattr(t, name).shape != shape:
            raise ValueError(f"{name} has shape {getattr(t, name).shape}, expected {shape}")
    if B % group_size:
        raise ValueError(f"batch {B} is not a multiple of group_size {group_size}")
    groups = t.group_id.reshape(B // group_size, group_size)
    if (groups != groups[:, :1]).any():
        raise ValueError("rows of one group (env_groups x group_size layout) differ in group_id")
    if ((t.length < 0) | (t.length > T)).any():
        raise ValueError("length outside [0, T]")
    valid = np.arange(T)[None, :] < t.length[:, None]
    if (t.loss_mask & ~valid).any():
        raise ValueError("loss_mask set on padding")
    happened = t.turn_end >= 0
    if (happened[:, 1:] & ~happened[:, :-1]).any():
        raise ValueError("turn_end: a turn happened after a missing one")
    if (t.turn_end >= T).any():
        raise ValueError("turn_end beyond the context")
    b, k = np.nonzero(happened)
    e = t.turn_end[b, k]
    if not t.loss_mask[b, e].all():
        raise ValueError("turn_end does not point at a model token")
    if (t.turn_index[b, e] != k).any():
        raise ValueError("turn_index at turn_end differs from the turn")
    if ((e + 1 < T) & t.loss_mask[b, np.minimum(e + 1, T - 1)]
            & (t.turn_index[b, np.minimum(e + 1, T - 1)] == k)).any():
        raise ValueError("turn_end is not the last model token of its turn")
    if (t.turn_reward[~happened] != 0).any():
        raise ValueError("turn_reward non-zero on a turn that did not happen")
    last = np.where(happened.any(1), t.turn_end.max(1), -1)
    after_last = np.arange(T)[None, :] > last[:, None]
    if (t.loss_mask & after_last).any():
        raise ValueError("model tokens after the last turn_end")
