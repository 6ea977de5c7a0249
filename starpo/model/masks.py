"""A chunk's geometry, computed once per forward: rotary positions, masks over the chunk and
the cache, cache write slots, the context and sliding windows."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from starpo.model.kvcache import KVCache, TurnWindow, window_mask


def row_positions(valid) -> jax.Array:
    """Rotary positions int32[B,T] of a row's tokens: the real tokens before each (padding
    takes its predecessor's)."""
    return jnp.maximum(jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1, 0)


def _layer_inputs(valid, cache: KVCache | None, fresh: bool = False,
                  window: TurnWindow | None = None, split: bool = False, positions=None,
                  sliding: int = 0):
    """The geometry of a chunk (valid [B,T] bool), as every layer gets it: (shared, kv, write_at).

    shared = (positions, chunk_mask, cache_valid, window, local[, write]) goes to each `Block`
    alike (see `Attention`): rotary positions [B,T] counting real tokens only, the causal chunk
    mask [B,T,T] over valid keys, the cache slots seen, and with `sliding` (a sliding window of
    that many positions) the local layers' versions of those masks (`local`, else None).
    kv = the cache's (k, v) the layers read (stacked, or per-layer tuples when `split`), None
    without a cache or when `fresh`. write_at = (rows, slots) [B,T] where the chunk's tokens go
    in the cache (padding out of range: dropped), None without one. positions: the rotary
    positions [B,T] given (no cache)."""
    shared, kv, write_at = _global_inputs(valid, cache, fresh, window, split, positions)
    local = None
    if sliding:
        local = _sliding_inputs(shared, cache, fresh, split, write_at, sliding)
    return (*shared[:4], local, *shared[4:]), kv, write_at


def _global_inputs(valid, cache, fresh, window, split, positions):
    B, T = valid.shape
    t = jnp.arange(T, dtype=jnp.int32)
    chunk_mask = valid[:, None, :] & (t[None, :, None] >= t[None, None, :])  # [B,T,T]
    if positions is not None:
        if cache is not None:
            raise ValueError("rotary positions are given only to a forward without a cache")
        return (positions.astype(jnp.int32), chunk_mask, None, window), None, None
    positions = row_positions(valid)
    if cache is None:
        return (positions, chunk_mask, None, window), None, None
    positions = positions + cache.pos[:, None]
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    slots = jnp.where(valid, cache.end[:, None] + t[None, :], cache.max_len)
    kv, cache_valid = (cache.k, cache.v), cache.valid
    if split and not fresh:
        # each layer writes its own buffers first, then attends over the slots visible to a
        # query: those that held a token already or get a valid chunk token t' <= t, inside
        # t's window (the slots' turns once the chunk's are written)
        col = jnp.arange(cache.max_len, dtype=jnp.int32)[None, :] - cache.end[:, None]  # [B,S]
        in_chunk = (col >= 0) & (col < T) & jnp.take_along_axis(valid, jnp.clip(col, 0, T - 1),
                                                               axis=1)
        visible = cache_valid[:, None, :] | (in_chunk[:, None, :]
                                             & (col[:, None, :] <= t[None, :, None]))
        if window is not None:
            visible = visible & window_mask(window.turns,
                                            _written_turns(cache, rows, slots, window),
                                            window.size)
        write = (rows, slots, visible)
        return (positions, chunk_mask, cache_valid, window, write), kv, (rows, slots)
    if fresh:  # an empty cache: the chunk attends causally to itself alone
        return (positions, chunk_mask, None, window), None, (rows, slots)
    if window is not None:  # (the causal kernels of the cacheless path mask for themselves)
        chunk_mask = chunk_mask & window_mask(window.turns, window.turns, window.size)
        cache_valid = cache_valid[:, None, :] & window_mask(window.turns, _cache_turns(cache),
                                                            window.size)
    return (positions, chunk_mask, cache_valid, window), kv, (rows, slots)


def _sliding_inputs(shared, cache, fresh, split, write_at, size):
    """The local layers' masks: keys of the last `size` rotary positions, the query's own
    included. A slot's position is the count of valid slots before it (slots are written in
    order, and a valid slot is never overwritten)."""
    positions, chunk_mask, cache_valid, window, *write = shared
    local = dict(window=None, chunk_mask=None, cache_valid=None, visible=None)
    if cache is None or fresh:  # the causal kernels' window: any over turns, and this one
        local["window"] = (TurnWindow(None, 0) if window is None else window).replace(
            positions=positions, sliding=size)
        return local
    slot_pos = jnp.cumsum(cache.valid, axis=1, dtype=jnp.int32) - 1  # [B,S] (valid slots)
    if split:
        rows, slots = write_at
        written = slot_pos.at[rows, slots].set(positions, mode="drop")
        local["visible"] = write[0][2] & window_mask(positions, written, size)
        return local
    local["chunk_mask"] = chunk_mask & window_mask(positions, positions, size)
    seen = cache_valid[:, None, :] if cache_valid.ndim == 2 else cache_valid  # [B,T,S]
    local["cache_valid"] = seen & window_mask(positions, slot_pos, size)
    return local


def _local_masks(local, is_local, window, chunk_mask, cache_valid, write):
    """A layer's (window, chunk_mask, cache_valid, write): the local versions where is_local
    (a Python bool: chosen here; traced: selected elementwise)."""
    def pick(a, b):
        if isinstance(is_local, bool):
            return a if is_local else b
        return jnp.where(is_local, a, b)

    if local["window"] is not None:  # the sliding criterion applies where local
        window = local["window"].replace(local=is_local)
    if local["chunk_mask"] is not None:
        chunk_mask = pick(local["chunk_mask"], chunk_mask)
        if not isinstance(is_local, bool) or is_local:
            cache_valid = pick(local["cache_valid"], jnp.broadcast_to(
                cache_valid[:, None, :] if cache_valid.ndim == 2 else cache_valid,
                local["cache_valid"].shape))
    if local["visible"] is not None:
        rows, slots, visible = write
        write = (rows, slots, pick(local["visible"], visible))
    return window, chunk_mask, cache_valid, write


def _advance(cache: KVCache, valid, rows, slots, k, v, window=None) -> KVCache:
    """The cache after writing a chunk: new k/v buffers, valid slots, `end` and `pos` (and the
    slots' turns under a context window)."""
    t = jnp.arange(valid.shape[1], dtype=jnp.int32)
    last = jnp.max(jnp.where(valid, t[None, :], -1), axis=1)
    return KVCache(
        k=k, v=v, valid=cache.valid.at[rows, slots].set(True, mode="drop"),
        end=jnp.where(last >= 0, cache.end + last + 1, cache.end).astype(jnp.int32),
        pos=cache.pos + valid.sum(axis=1, dtype=jnp.int32),
        turn=_written_turns(cache, rows, slots, window))


def _cache_turns(cache: KVCache):
    if cache.turn is None:
        raise ValueError("a TurnWindow over a cache needs the cache's turn ids "
                         "(init_cache(..., turns=True))")
    return cache.turn


def _written_turns(cache: KVCache, rows, slots, window):
    """The cache's slot turns with the chunk's written (unchanged without a window)."""
    if window is None:
        return cache.turn
    return _cache_turns(cache).at[rows, slots].set(window.turns, mode="drop")
