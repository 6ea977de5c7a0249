"""The functional API: parameters, `forward` / `hidden_states` (the one driver), the heads,
and per-layer buffers for decoding."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from starpo.model.decoder import Block, Transformer
from starpo.model.kvcache import KVCache, TurnWindow
from starpo.model.masks import _advance, _layer_inputs
from starpo.model.spec import ModelConfig, REMAT_POLICIES
from starpo.sharding import tree_shardings


# ----------------------------------------------------------------------------- functional API
def _init_boxed(cfg: ModelConfig, key: jax.Array):
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Transformer(cfg).init(key, tokens, tokens > -1, method=Transformer.init_all)["params"]


def _per_config(build):
    """`build(cfg)`, made once per config and context mesh (tracing the whole model's init
    costs ~0.1 s, and a run, its tests and its sharding ask for the same config's shapes many
    times); each call gets fresh containers over the shared immutable leaves."""
    made = functools.lru_cache(maxsize=64)(lambda cfg, mesh: build(cfg))

    @functools.wraps(build)
    def get(cfg: ModelConfig):
        return jax.tree_util.tree_map(lambda x: x, made(cfg, jax.sharding.get_abstract_mesh()))

    return get


@functools.lru_cache(maxsize=64)
def _init_fn(cfg: ModelConfig):
    return jax.jit(lambda k: nn.meta.unbox(_init_boxed(cfg, k)))


def init_params(cfg: ModelConfig, key: jax.Array):
    """Random parameters for `cfg`: a nested dict of arrays."""
    return _init_fn(cfg)(key)


@_per_config
def abstract_params(cfg: ModelConfig):
    """Shapes and dtypes of the parameters (jax.ShapeDtypeStruct leaves), nothing allocated."""
    return jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))


@_per_config
def logical_axes(cfg: ModelConfig):
    """A pytree like the params whose leaves are PartitionSpecs of logical axis names."""
    return nn.get_partition_spec(jax.eval_shape(lambda k: _init_boxed(cfg, k), jax.random.key(0)))


def param_shardings(cfg: ModelConfig, mesh):
    """NamedShardings of the parameters on `mesh`: `sharding.RULES` over `logical_axes`."""
    return tree_shardings(logical_axes(cfg), abstract_params(cfg), mesh)


def forward(params, cfg: ModelConfig, tokens, valid, cache: KVCache | None = None):
    """Logits [B,T,V] (float32) and the updated cache."""
    hidden, cache = hidden_states(params, cfg, tokens, valid, cache)
    return head_logits(params, cfg, hidden), cache


def hidden_states(params, cfg: ModelConfig, tokens, valid, cache: KVCache | None = None,
                  fresh: bool = False, window: TurnWindow | None = None, positions=None):
    """tokens [B,T] int, valid [B,T] bool -> (final-norm hidden states [B,T,D], new cache or
    None); the heads are applied separately (`head_logits`, `head_values`). The one forward:
    the training forward, a cache append and a decode step all run here.

    Without a cache the chunk attends causally to its own valid tokens (training forward).
    With a cache the chunk also attends to every valid cache slot, and its valid tokens are
    written at slots `cache.end[b] + t`; the returned cache has `end` just past the row's
    last valid token (so right padding is overwritten by the next call) and `pos` advanced
    by the number of valid tokens. Rows with no valid token are left bit for bit as they
    were; valid tokens that would land past the cache's end are dropped (callers check
    room first, see `sampler`).

    fresh=True promises that the cache holds nothing yet (a first prefill): the chunk then
    attends causally to itself alone, as without a cache (`causal_attention`, skipping
    the empty slots), and its keys/values are written as usual (stacked or split buffers).

    window: a `TurnWindow` (the chunk's turns) or None (everything causal is seen). With a
    cache its slots' turns are read from and written into `cache.turn`.

    positions: int [B,T], each token's rotary position, for a forward without a cache whose
    rows are not one sequence each (`update.packed_hidden`: a group's shared prompt and its
    replies, each reply placed after the prompt); default: the valid tokens before it.

    Stacked params and cache ([L,...]) run as one scan over the layers, so any depth compiles
    like one layer; with `split_layers` params or a `split_cache` cache the layers run as a
    loop over per-layer buffers (see "split buffers" below). The numbers are the same.
    """
    valid = valid.astype(bool)
    split = is_split(params["layers"]) or (cache is not None and is_split(cache.k))
    stacked_cache = cache is not None and not is_split(cache.k)
    if split:
        params = split_layers(params)
        cache = None if cache is None else split_cache(cache)
    shared, kv, write_at = _layer_inputs(valid, cache, fresh, window, split, positions,
                                         cfg.sliding_window)
    heads = {"params": _heads_only(params)}
    model = Transformer(cfg)
    x = model.apply(heads, tokens, method=Transformer.embed_tokens)
    x, (k, v) = _run_layers(cfg, params["layers"], x, kv, shared)
    hidden = model.apply(heads, x, method=Transformer.final_hidden)
    if cache is None:
        return hidden, None
    rows, slots = write_at
    if not split:
        # One scatter per buffer writes every layer's new keys/values in place (the cache is
        # donated by the sampler); padding goes to an out-of-range slot and is dropped.
        k = cache.k.at[:, rows, :, slots].set(jnp.moveaxis(k, 0, 2), mode="drop")
        v = cache.v.at[:, rows, :, slots].set(jnp.moveaxis(v, 0, 2), mode="drop")
    elif fresh:  # the layers returned the chunk's keys/values: each into its layer's buffer
        k = tuple(b.at[rows, :, slots].set(x, mode="drop") for b, x in zip(cache.k, k))
        v = tuple(b.at[rows, :, slots].set(x, mode="drop") for b, x in zip(cache.v, v))
    new_cache = _advance(cache, valid, rows, slots, k, v, window)
    return hidden, stack_cache(new_cache) if stacked_cache else new_cache


def _run_layers(cfg: ModelConfig, layers, x, kv, shared):
    """`Block` over every layer: x [B,T,D] -> (x, (k, v)).

    Stacked params `layers` [L,...] (with the stacked cache (k, v) [L,...], or None) run as one
    `lax.scan`; the (k, v) returned are the chunk's [L,B,T,K,E]. Per-layer params (a tuple,
    `split_layers`) run as a Python loop, layer i reading the cache buffers (k[i], v[i]); the
    (k, v) returned are tuples of what each layer returns (its updated buffers, see
    `Attention`). Under `cfg.remat` each layer is rematerialised in the backward pass."""
    def block(layer, x, kv, shared, is_local):
        return Block(cfg).apply({"params": layer}, x, kv, shared, is_local)

    if cfg.remat:
        block = jax.checkpoint(block, prevent_cse=False, policy=REMAT_POLICIES[cfg.remat_policy])
    local = [i in cfg.local_layers for i in range(cfg.num_layers)]
    if not is_split(layers):
        def step(x, layer_kv):
            layer, kv, is_local = layer_kv
            return block(layer, x, kv, shared, is_local)
        flags = jnp.asarray(local) if cfg.local_layers else None
        return jax.lax.scan(step, x, (layers, kv, flags))
    ks, vs = [], []
    for i, layer in enumerate(layers):
        x, (k, v) = block(layer, x, None if kv is None else (kv[0][i], kv[1][i]), shared,
                          local[i] if cfg.local_layers else None)
        ks.append(k)
        vs.append(v)
    return x, (tuple(ks), tuple(vs))


def head_logits(params, cfg: ModelConfig, hidden):
    return Transformer(cfg).apply({"params": _heads_only(params)}, hidden,
                                  method=Transformer.logits)


def head_values(params, cfg: ModelConfig, hidden):
    return Transformer(cfg).apply({"params": _heads_only(params)}, hidden,
                                  method=Transformer.values)


# ----------------------------------------------------------------------------- split buffers
# Decoding one token per row is bound by memory traffic. Under the layer scan every step
# dynamic-slices each layer's weights and [B,K,S,E] cache block out of the stacked arrays,
# and on CPU each such slice is a real copy (the matmul libraries need a plain buffer): about
# as much traffic again as the attention itself. Split once per sampler call into per-layer
# arrays (weights and cache), then each decode step reads every buffer in place and writes
# its new keys/values into the layer's own buffer.
def is_split(x) -> bool:
    return isinstance(x, (tuple, list))


def _heads_only(params):
    """The parameters the heads and the embedding use (the layers are not touched)."""
    return {name: p for name, p in params.items() if name != "layers"}


def split_layers(params):
    """Params whose stacked `layers` subtree [L,...] becomes a tuple of L per-layer subtrees
    (a copy of the layer weights: do it once, outside a decode loop)."""
    layers = params["layers"]
    if is_split(layers):
        return params
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]
    return {**params, "layers": tuple(jax.tree_util.tree_map(lambda p, i=i: p[i], layers)
                                      for i in range(n))}


def split_cache(cache: KVCache) -> KVCache:
    """The cache with k and v as tuples of per-layer [B,K,S,E] arrays (see `stack_cache`)."""
    if is_split(cache.k):
        return cache
    n = cache.k.shape[0]
    return cache.replace(k=tuple(cache.k[i] for i in range(n)),
                         v=tuple(cache.v[i] for i in range(n)))


def stack_cache(cache: KVCache) -> KVCache:
    """Inverse of `split_cache`: k and v as stacked [L,B,K,S,E] arrays."""
    if not is_split(cache.k):
        return cache
    return cache.replace(k=jnp.stack(cache.k), v=jnp.stack(cache.v))
