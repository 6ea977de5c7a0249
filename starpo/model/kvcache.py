"""The functional KV cache (`KVCache`) and the context window over turns (`TurnWindow`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from starpo.model.spec import ModelConfig
from starpo.sharding import constrain


@struct.dataclass
class KVCache:
    """Per-layer keys and values plus per-row bookkeeping.

    k, v:  [L, B, K, S, E]   slot s of row b holds the key/value written there (kv heads before
                             slots: attention reads each layer's [B,K,S,E] slice as it is)
    valid: [B, S] bool        slot holds a real (non-padding) token
    end:   [B] int32          next slot to write in each row
    pos:   [B] int32          rotary position of the next real token (= real tokens so far)
    turn:  [B,S] int32 | None the dialogue turn of each slot's token (`TurnWindow`; PREFIX_TURN
                             for the prompt prefix); None when no context window is used
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    end: jax.Array
    pos: jax.Array
    turn: jax.Array | None = None

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None,
               turns: bool = False, split: bool = False) -> KVCache:
    """An empty cache for `batch` rows of up to `max_len` slots (turns=True: with the per-slot
    turn ids a `TurnWindow` needs, PREFIX_TURN until written; split=True: k and v as tuples
    of per-layer [B,K,S,E] buffers, as `split_cache` makes them, from the start)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    kv_axes = ("layers", "batch", "kv_heads", "length", "head_dim")

    def buffers():
        if split:
            return tuple(constrain(jnp.zeros(shape[1:], dtype), kv_axes[1:])
                         for _ in range(cfg.num_layers))
        return constrain(jnp.zeros(shape, dtype), kv_axes)

    return KVCache(
        k=buffers(),
        v=buffers(),
        valid=constrain(jnp.zeros((batch, max_len), bool), ("batch", "length")),
        end=constrain(jnp.zeros((batch,), jnp.int32), ("batch",)),
        pos=constrain(jnp.zeros((batch,), jnp.int32), ("batch",)),
        turn=(constrain(jnp.full((batch, max_len), PREFIX_TURN, jnp.int32), ("batch", "length"))
              if turns else None),
    )


# ----------------------------------------------------------------------------- context window
PREFIX_TURN = -1  # the turn id of the prompt prefix (system prompt, instruction): always seen


@struct.dataclass
class TurnWindow:
    """A context window over dialogue turns: a token of turn q attends only to the prompt
    prefix (turn id < 0, PREFIX_TURN) and to tokens of turns q-size+1 .. q (causally, as ever).
    size=1 is the current turn alone. turns [B,T] int32: the turn of each token of the chunk
    being run (a chunk is one turn in the sampler; a whole dialogue in the training forward).
    With a cache, the cache's `turn` ids give the slots' turns.

    A sliding-window layer's window rides along (the cacheless forward's kernels take one
    window): with `sliding` > 0 and `local` true, a key must also lie within the last
    `sliding` rotary `positions` [B,T] of the query; turns may then be None (no window over
    turns). `local` is a layer's flag: a Python bool, or traced under the scan over layers."""

    turns: jax.Array | None
    size: int = struct.field(pytree_node=False)
    # the turns are disjoint segments with no prefix among them (rows packed into shared
    # sequences, `update.pack_rows`): with size 1 a token sees its own segment alone, which a
    # TPU's splash attention takes as segment ids
    segments: bool = struct.field(pytree_node=False, default=False)
    positions: jax.Array | None = None
    sliding: int = struct.field(pytree_node=False, default=0)
    local: Any = None

    def visible(self, queries: slice, keys: slice) -> jax.Array:
        """bool [B,Tq,Tk]: whether each of tokens `keys` is inside the window of each of tokens
        `queries` (slices of the chunk)."""
        inside = True
        if self.turns is not None:
            inside = window_mask(self.turns[:, queries], self.turns[:, keys], self.size)
        if self.sliding:
            near = window_mask(self.positions[:, queries], self.positions[:, keys], self.sliding)
            inside = inside & (near | jnp.logical_not(self.local))
        return inside


def window_mask(query_turns, key_turns, size: int):
    """bool [B,T,S]: key s is inside query t's window (query_turns [B,T], key_turns [B,S])."""
    k = key_turns[:, None, :]
    return (k < 0) | (k > query_turns[:, :, None] - size)
