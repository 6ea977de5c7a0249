"""Jitted batched generation: prefill a batch of prompts, then decode in a `lax.while_loop`.

One compiled program per (batch, prompt length, cache length, new-token budget): the loop runs on
device until every row has written an end-of-sequence token or its budget, so no Python runs
per token. Sampling uses a temperature (0 = greedy); the log-prob of every sampled token under the
distribution actually sampled from is returned with it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from starpo import model as model_lib
from starpo.model import KVCache, ModelConfig


@struct.dataclass
class Generation:
    """tokens [B,N] int32 (pad after the end), logprobs [B,N] f32, length [B] int32, cache."""

    tokens: jax.Array
    logprobs: jax.Array
    length: jax.Array
    cache: KVCache


def sample_next(logits, key, temperature):
    """Draw one token per row from logits [B,V]; returns (token [B], its log-prob [B]).

    temperature == 0 is greedy (log-prob under the untempered distribution).
    """
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    token = jnp.where(greedy, jnp.argmax(logits, axis=-1), jax.random.categorical(key, scaled))
    return token.astype(jnp.int32), jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "cache_len", "eos_ids",
                                             "pad_id"))
def generate(params, prompt, prompt_valid, key, temperature, *, cfg: ModelConfig,
             max_new_tokens: int, cache_len: int, eos_ids: tuple[int, ...], pad_id: int):
    """Continue each prompt row; prompt [B,P] int32, prompt_valid [B,P] bool (left or right pad).

    Rows stop after writing a token in `eos_ids` (kept in the output and counted in `length`)
    or after `max_new_tokens` tokens.
    """
    B, P = prompt.shape
    if P + max_new_tokens > cache_len:
        raise ValueError(f"prompt length {P} + {max_new_tokens} new tokens exceed cache {cache_len}")
    cache = model_lib.init_cache(cfg, B, cache_len)
    hidden, cache = model_lib.hidden_states(params, cfg, prompt, prompt_valid, cache)
    last = jnp.max(jnp.where(prompt_valid, jnp.arange(P)[None, :], 0), axis=1)
    logits = model_lib.head_logits(params, cfg, hidden[jnp.arange(B), last])  # [B,V]
    eos = jnp.asarray(eos_ids, jnp.int32)

    def cond(carry):
        step, done = carry[0], carry[4]
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        step, key, logits, cache, done, tokens, logprobs = carry
        key, sub = jax.random.split(key)
        token, logp = sample_next(logits, sub, temperature)
        token = jnp.where(done, pad_id, token)
        tokens = tokens.at[:, step].set(token)
        logprobs = logprobs.at[:, step].set(jnp.where(done, 0.0, logp))
        live = ~done
        done = done | jnp.isin(token, eos)
        hidden, cache = model_lib.hidden_states(params, cfg, token[:, None], live[:, None], cache)
        logits = model_lib.head_logits(params, cfg, hidden[:, 0])
        return step + 1, key, logits, cache, done, tokens, logprobs

    init = (jnp.int32(0), key, logits, cache, jnp.zeros((B,), bool),
            jnp.full((B, max_new_tokens), pad_id, jnp.int32),
            jnp.zeros((B, max_new_tokens), jnp.float32))
    step, _, _, cache, done, tokens, logprobs = jax.lax.while_loop(cond, body, init)
    n = jnp.arange(max_new_tokens)[None, :]
    is_eos = jnp.isin(tokens, eos) & (n < step)
    first_eos = jnp.min(jnp.where(is_eos, n, max_new_tokens), axis=1)
    length = jnp.minimum(first_eos + 1, step).astype(jnp.int32)
    return Generation(tokens, logprobs, length, cache)
