"""Grouped-query attention (`Attention`) and the three ways a chunk attends: over its own
keys, over a cache it was written into, or over a cache and itself."""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from starpo.model.dense import _norm, _projection
from starpo.model.masks import _local_masks
from starpo.model.ops import (
    attention_block, causal_attention, cudnn_refusal, decode_kernel, gpu_capability, kernels,
    mixed_einsum)
from starpo.model.spec import ModelConfig, _MASK_VALUE, apply_rope, rope_inv_freq


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions, chunk_mask, cache_valid, kv, window=None, write=None,
                 local=None, is_local=None):
        """Attention of a chunk over the cache (read only) and over itself.

        x [B,T,D]; positions [B,T]; chunk_mask [B,T,T] (causal, valid keys, inside the context
        window if any); cache_valid [B,S] (or [B,T,S] per query under a context window) and
        kv = (k, v) [B,K,S,E] of the cache, or None; window: the `TurnWindow` or None (read
        by the cacheless causal path, whose kernels build their masks themselves). Returns
        (out [B,T,D], (k, v) of the chunk [B,T,K,E]) -- the caller writes those into the cache
        in one scatter, so the cache is never copied layer by layer.

        write = (rows, slots [B,T], visible [B,T,S] bool), per-layer buffers (`split_cache`): this
        layer's own cache buffers are updated first -- in place, as nothing reads the old ones
        -- and the chunk attends over the cache alone, slots `visible` to each query. Returns
        (out, the updated (k, v) buffers).

        local: a sliding-window model's masks for its local layers (`_layer_inputs`), and
        is_local whether this layer is one (a traced bool under the scan over layers, a Python
        bool in the loop over split layers); None for a model without sliding layers.
        """
        cfg = self.cfg
        H, K, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = _projection(x, (H, E), ("embed", "heads", "head_dim"), "q", cfg, cfg.qkv_bias)
        k = _projection(x, (K, E), ("embed", "kv_heads", "head_dim"), "k", cfg, cfg.qkv_bias)
        v = _projection(x, (K, E), ("embed", "kv_heads", "head_dim"), "v", cfg, cfg.qkv_bias)
        if cfg.qk_norm:  # each head's query and key normalised over its E dims, then rotated
            q = _norm(cfg, "q_norm", "head_dim")(q)
            k = _norm(cfg, "k_norm", "head_dim")(k)
        B, T = x.shape[:2]

        def rotate(x):
            out = apply_rope(x, positions, rope_inv_freq(cfg))
            if is_local is None:
                return out
            return jnp.where(is_local, apply_rope(x, positions, rope_inv_freq(cfg, True)), out)

        q = rotate(q).reshape(B, T, K, H // K, E) / math.sqrt(cfg.query_scale or E)
        k = rotate(k)
        if is_local is not None:  # a local layer's masks in place of the global ones
            window, chunk_mask, cache_valid, write = _local_masks(
                local, is_local, window, chunk_mask, cache_valid, write)
        if kv is not None:  # what the cache will hold (e.g. bfloat16)
            k, v = k.astype(kv[0].dtype), v.astype(kv[1].dtype)
        else:  # the attention products run in the compute dtype too (float32 accumulation)
            k, v = k.astype(cfg.dtype), v.astype(cfg.dtype)

        def out_proj(out):
            return _projection(out, cfg.hidden_size, ("heads", "head_dim", "embed"), "o", cfg,
                               in_axes=(-2, -1))

        if write is not None:
            out, new_kv = _attend_written_cache(q, k, v, kv, write, decode_kernel(cfg))
            return out_proj(out), new_kv
        if kv is None:  # the training forward: causal over the sequence's valid tokens
            # the last query sees every valid key
            out = _attend_causal(q, k, v, chunk_mask[:, -1], kernels(cfg), window)
        else:
            out = _attend_cache_and_chunk(q, k, v, kv, chunk_mask, cache_valid)
        return out_proj(out), (k, v)


# The three ways a chunk attends. q [B,T,K,G,E] (scaled, rotated); k, v [B,T,K,E] of the chunk;
# a cache (ck, cv) [B,K,S,E]. Each returns the attention output [B,T,H,E] (H = K*G).
_BATCH_BK = ((0, 1), (0, 1))  # dot_general batch dims (b, k) of [B,K,...] operands
# Query tokens per block of attention over a cache (a chunk appended to it): the scores of one
# block, [B,H,S,block] floats, are all that exists at once, not [B,H,S,T] for the whole chunk
# (a 256-token prompt over a 3584-slot cache: 13 GB for 128 rows of Qwen2.5-0.5B, 0.8 GB in
# blocks of 16). Each block reads the cache once more; a turn's decode reads it once a token.
CACHE_QUERY_BLOCK = 16


def _by_query_blocks(attend, q, *per_query):
    """attend(q [B,Q,K,G,E], *per_query [B,Q,...]) -> [B,Q,H,E], run on blocks of
    `CACHE_QUERY_BLOCK` query tokens in turn (a `lax.map`) and joined: the same numbers as on
    all T at once, since each query's softmax is its own. Padding queries (T up to a multiple
    of `block`) see nothing in per-query masks padded with False; their rows are dropped."""
    B, T = q.shape[:2]
    block = CACHE_QUERY_BLOCK  # read when traced (a test sets it)
    if T <= block:
        return attend(q, *per_query)
    n = -(-T // block)

    def blocks(x):  # [B,T,...] -> [n,B,block,...]
        x = jnp.pad(x, [(0, 0), (0, n * block - T)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(B, n, block, *x.shape[2:]), 1, 0)

    out = jax.lax.map(lambda xs: attend(*xs), tuple(blocks(x) for x in (q, *per_query)))
    return jnp.moveaxis(out, 0, 1).reshape(B, n * block, *out.shape[3:])[:, :T]


def _queries_by_kv_head(q, dtype):
    """[B,T,K,G,E] -> [B,K,T*G,E]: the queries of each kv head as the rows of one matmul."""
    B, T, K, G, E = q.shape
    return jnp.moveaxis(q, 1, 2).reshape(B, K, T * G, E).astype(dtype)


def _heads_out(out, T, G):
    """[B,K,T*G,E] -> [B,T,H,E]."""
    B, K, _, E = out.shape
    return jnp.moveaxis(out.reshape(B, K, T, G, E), 2, 1).reshape(B, T, K * G, E)


def _attend_written_cache(q, k, v, kv, write, decode="xla"):
    """Layer by layer (`split_cache`): write the chunk's k, v into this layer's cache buffers
    (in place: nothing reads the old ones), then attend over the cache alone, slots `visible`
    to each query. -> (out, the updated (ck, cv)). decode="pallas": one query a row (a decode
    step) attends in one fused GPU kernel where it runs (`decode_attention.runs`); "pallas_tpu"
    in the TPU's (`tpu_attention.decode_runs`)."""
    rows, slots, visible = write
    ck = kv[0].at[rows, :, slots].set(k, mode="drop")
    cv = kv[1].at[rows, :, slots].set(v, mode="drop")
    if decode == "pallas":
        from starpo import decode_attention

        if decode_attention.runs(q.shape, ck.shape[2]):
            return decode_attention.attend(q, ck, cv, visible), (ck, cv)
    if decode == "pallas_tpu":
        from starpo import tpu_attention

        if tpu_attention.decode_runs(q.shape, ck.shape[2]):
            return tpu_attention.decode(q, ck, cv, visible), (ck, cv)

    def attend(q, visible):  # a block of queries [B,Q,K,G,E], visible [B,Q,S]
        T, G = q.shape[1], q.shape[3]
        qc = _queries_by_kv_head(q, ck.dtype)
        s_cache = jax.lax.dot_general(ck, qc, (((3,), (3,)), _BATCH_BK),
                                      preferred_element_type=jnp.float32)  # [B,K,S,T*G]
        visible = jnp.repeat(jnp.swapaxes(visible, 1, 2), G, axis=2)  # [B,S,T*G]
        s_cache = jnp.where(visible[:, None], s_cache, _MASK_VALUE)
        p_cache = jnp.swapaxes(jax.nn.softmax(s_cache, axis=2), 2, 3).astype(cv.dtype)
        out = jax.lax.dot_general(p_cache, cv, (((3,), (2,)), _BATCH_BK),
                                  preferred_element_type=jnp.float32)  # [B,K,T*G,E]
        return _heads_out(out, T, G)

    return _by_query_blocks(attend, q, visible), (ck, cv)


def _attend_causal(q, k, v, valid, kernel="cpu", window=None):
    """The training forward: causal attention over the sequence's valid keys (valid [B,T]),
    by `kernel` ("cpu", "xla", "cudnn" or "splash", see `ATTENTION`); window: a `TurnWindow`
    or None."""
    if kernel == "splash":
        from starpo import tpu_attention

        as_segments = (window is not None and window.segments and window.size == 1
                       and not window.sliding)
        if tpu_attention.causal_fallback(q.shape[1], window is not None and not as_segments
                                         ) is None:
            return tpu_attention.causal(q, k, v, valid,
                                        segments=window.turns if as_segments else None)
        kernel = "xla"
    if kernel != "cpu":
        return _attend_dot_product(q, k, v, valid, kernel, window)
    T, G = q.shape[1], q.shape[3]
    qh = _queries_by_kv_head(q, k.dtype)
    out = causal_attention(qh, jnp.moveaxis(k, 1, 2), jnp.moveaxis(v, 1, 2), valid, G,
                           attention_block(T), window)  # [B,K,T*G,E]
    return _heads_out(out, T, G)


def _attend_dot_product(q, k, v, valid, kernel, window=None):
    """`jax.nn.dot_product_attention` (GQA: query head k*G+g reads kv head k, as here).

    Each query sees the valid keys at or before it and always itself, so that a padding query
    has a key (an all-masked row's flash softmax is NaN, which would reach the valid rows'
    gradients through 0 * NaN; its output is not used). "xla" recomputes its [B,H,T,S] scores
    in the backward pass instead of keeping them; cuDNN keeps only per-row softmax statistics
    (a boolean mask is an additive [B,1,T,S] bias there). Where cuDNN would refuse the shapes
    or dtype one way or the other (`cudnn_refusal`), "xla" runs instead."""
    B, T, K, G, E = q.shape
    qh = q.reshape(B, T, K * G, E).astype(k.dtype)

    def attend(q, k, v, valid, window, implementation):
        t = jnp.arange(T, dtype=jnp.int32)
        seen = valid[:, None, :]
        if window is not None:
            seen = seen & window.visible(slice(None), slice(None))
        mask = (seen | (t[:, None] == t[None, :]))[:, None]  # [B,1,T,S]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=1.0, is_causal=True,
                                            implementation=implementation)

    if kernel == "cudnn" and cudnn_refusal(str(k.dtype), E, gpu_capability(), T) is None:
        return attend(qh, k, v, valid, window, "cudnn")
    # the mask too is made inside: only q, k, v, valid (and the window) are kept for the
    # backward
    return jax.checkpoint(functools.partial(attend, implementation="xla"))(qh, k, v, valid,
                                                                           window)


def _attend_cache_and_chunk(q, k, v, kv, chunk_mask, cache_valid):
    """One softmax over [cache slots, chunk] without concatenating the cache. Both products
    keep (b, k) as leading batch dims and the cache as the big operand in its stored layout: no
    per-step transpose or copy of the cache (which used to cost more than the whole model).
    cache_valid: [B,S] slots every query sees, or [B,T,S] per query (a context window).
    A long chunk (a prompt) runs in blocks of `CACHE_QUERY_BLOCK` queries."""
    if cache_valid.ndim == 2:
        return _by_query_blocks(
            lambda q, m: _attend_cache_and_chunk_block(q, k, v, kv, m, cache_valid),
            q, chunk_mask)
    return _by_query_blocks(
        lambda q, m, c: _attend_cache_and_chunk_block(q, k, v, kv, m, c), q, chunk_mask,
        cache_valid)


def _attend_cache_and_chunk_block(q, k, v, kv, chunk_mask, cache_valid):
    """`_attend_cache_and_chunk` of T queries q [B,T,K,G,E] over the cache and the chunk's
    keys k, v [B,C,K,E]: chunk_mask [B,T,C], cache_valid [B,S] or [B,T,S]."""
    B, T, K, G, E = q.shape
    s = jnp.where(chunk_mask[:, None, None],
                  mixed_einsum("btkge,bske->bkgts", q.astype(k.dtype), k), _MASK_VALUE)
    ck, cv = kv
    # cache scores [B,K,S,T*G]: the cache [S,E] times the queries transposed
    s_cache = jax.lax.dot_general(ck, _queries_by_kv_head(q, ck.dtype), (((3,), (3,)), _BATCH_BK),
                                  preferred_element_type=jnp.float32)
    if cache_valid.ndim == 2:
        seen = cache_valid[:, None, :, None]
    else:  # per query: [B,T,S] -> [B,1,S,T*G] (query row t*G + g)
        seen = jnp.repeat(jnp.swapaxes(cache_valid, 1, 2), G, axis=2)[:, None]
    s_cache = jnp.where(seen, s_cache, _MASK_VALUE)

    def per_query(stat):  # [B,K,G,T] chunk statistic -> [B,K,T*G]
        return jnp.swapaxes(stat, 2, 3).reshape(B, K, T * G)

    def per_head(stat):  # [B,K,T*G] -> [B,K,G,T,1]
        return jnp.swapaxes(stat.reshape(B, K, T, G), 2, 3)[..., None]

    top = jnp.maximum(s_cache.max(2), per_query(s.max(-1)))  # [B,K,T*G]
    e_cache = jnp.exp(s_cache - top[:, :, None])
    e = jnp.exp(s - per_head(top))
    norm = e_cache.sum(2) + per_query(e.sum(-1))
    # probabilities [B,K,T*G,S] (small) times the cache [S,E]: a plain matmul
    p_cache = jnp.swapaxes(e_cache / norm[:, :, None], 2, 3).astype(cv.dtype)
    out = jax.lax.dot_general(p_cache, cv, (((3,), (2,)), _BATCH_BK),
                              preferred_element_type=jnp.float32)  # [B,K,T*G,E]
    out = jnp.moveaxis(out.reshape(B, K, T, G, E), 2, 1)
    p = e / per_head(norm)
    out = out + mixed_einsum("bkgts,bske->btkge", p.astype(v.dtype), v)
    return out.reshape(B, T, K * G, E)
