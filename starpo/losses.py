"""PPO policy loss (decoupled + dual clip), clipped value loss, KL estimators, loss aggregation.

Per-token terms are computed here; `aggregate` reduces them with explicit denominators so that a
mini-batch split into micro-batches sums to exactly the mini-batch loss (the denominators are
counted over the whole mini-batch before the micro-batches run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from starpo.schema import KL_TYPES, LOSS_AGG_MODES  # noqa: F401

# exp() of a log-ratio beyond this overflows in bf16 and is meaningless anyway.
_LOG_RATIO_LIMIT = 20.0
# k3 is unbounded for a far-off reference; the reference clamps it to keep the loss sane.
_LOW_VAR_KL_LIMIT = 10.0


def logprobs_and_entropy(logits: jax.Array, targets: jax.Array):
    """logits f32[...,V], targets int[...] -> (log p(target) f32[...], entropy f32[...])."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return chosen, entropy


def kl_estimate(logp: jax.Array, ref_logp: jax.Array, kind: str) -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of sampled tokens.

    kl (k1): logp - ref; abs: |logp - ref|; mse (k2): (logp - ref)^2 / 2;
    low_var_kl (k3): exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10] (non-negative,
    unbiased, lower variance than k1); as verl's, its log-ratio is clamped to [-20, 20] first,
    so that `exp` cannot overflow (an inf there makes the clamped value's gradient NaN).
    """
    diff = logp - ref_logp
    if kind == "kl":
        return diff
    if kind == "abs":
        return jnp.abs(diff)
    if kind == "mse":
        return 0.5 * diff * diff
    if kind == "low_var_kl":
        d = jnp.clip(-diff, -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
        return jnp.clip(jnp.exp(d) - d - 1.0, -_LOW_VAR_KL_LIMIT, _LOW_VAR_KL_LIMIT)
    raise ValueError(f"unknown KL type {kind!r} (one of {KL_TYPES})")


def policy_loss_terms(logp, old_logp, advantages, clip_low: float, clip_high: float,
                      clip_c: float):
    """Per-token PPO loss with decoupled clipping and dual clip.

    All inputs f32[...]. ratio = exp(logp - old_logp);
      L = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
    and for A < 0 additionally L = min(L, -A * clip_c) (dual clip: a token whose ratio has
    exploded cannot dominate the update with a huge negative advantage).
    Returns (loss, clipped, clipped_lower, log_ratio), all f32[...]: `clipped` marks tokens where
    the clipped term was chosen (pg_clipfrac), `clipped_lower` tokens where the dual clip bound
    (pg_clipfrac_lower).
    """
    log_ratio = jnp.clip(logp - old_logp, -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = jnp.maximum(unclipped, clipped)
    dual = -advantages * clip_c
    negative = advantages < 0
    loss_dual = jnp.where(negative, jnp.minimum(loss, dual), loss)
    return (loss_dual, (clipped > unclipped).astype(jnp.float32),
            (negative & (loss > dual)).astype(jnp.float32), log_ratio)


def value_loss_terms(values, old_values, returns, cliprange: float):
    """Per-token clipped value loss 0.5 * max((v - R)^2, (clip(v, old +- c) - R)^2).

    Returns (loss, clipped) f32[...]; `clipped` marks tokens where the clipped term was larger
    (vf_clipfrac).
    """
    clipped_values = old_values + jnp.clip(values - old_values, -cliprange, cliprange)
    plain = (values - returns) ** 2
    clip = (clipped_values - returns) ** 2
    return 0.5 * jnp.maximum(plain, clip), (clip > plain).astype(jnp.float32)


def denominators(mask: jax.Array):
    """(token count, sequence count) of a mini-batch mask bool[B,T], each at least 1.

    Sequences without any model token do not count as sequences.
    """
    tokens = mask.sum()
    seqs = mask.any(axis=1).sum()
    return jnp.maximum(tokens, 1).astype(jnp.float32), jnp.maximum(seqs, 1).astype(jnp.float32)


def aggregate(x: jax.Array, mask: jax.Array, mode: str, num_tokens, num_seqs,
              segments=None, num_segments: int = 0) -> jax.Array:
    """Reduce per-token x f32[b,T] over mask bool[b,T] with mini-batch denominators.

    token-mean:          sum of all tokens / num_tokens
    seq-mean-token-sum:  sum over rows of (row sum) / num_seqs
    seq-mean-token-mean: sum over rows of (row mean) / num_seqs
    seq-mean-token-sum-norm: seq-mean-token-sum / T, the row's length (Dr.GRPO's loss; verl's
                         normaliser, the token tensor's width, where no constant is given)
    Summing this over the micro-batches of a mini-batch gives the mini-batch value.
    segments: int[b,T], the sequence (of `num_segments`) each token belongs to where a row
    holds several (`update.pack_rows`); None: each row is one.
    """
    masked = jnp.where(mask, x, 0.0)
    if mode == "token-mean":
        return masked.sum() / num_tokens
    if mode == "seq-mean-token-sum":
        return masked.sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / num_seqs / x.shape[-1]
    if mode == "seq-mean-token-mean":
        if segments is None:
            row = masked.sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1)
        else:
            def by_seq(v):
                return jax.ops.segment_sum(v.ravel(), segments.ravel(), num_segments)

            row = by_seq(masked) / jnp.maximum(by_seq(mask.astype(masked.dtype)), 1)
        return row.sum() / num_seqs
    raise ValueError(f"unknown loss_agg_mode {mode!r} (one of {LOSS_AGG_MODES})")
