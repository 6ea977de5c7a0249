"""The losses and their gradients on one mini-batch: the clipped policy loss with the entropy
bonus and KL loss, the clipped value loss, accumulated over micro-batches (`make_grad_fn`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from starpo import lora, losses, packing
from starpo.model import ModelConfig
from starpo.algo import AlgoConfig
from starpo.update.forward import (Batch, batch_window, micro_size, micro_split, token_logprobs,
                                   token_values)
from starpo.update.packed import pack_rows, share_micro


def actor_loss(algo: AlgoConfig, actor_cfg: ModelConfig, params, m: Batch, num_tokens,
                num_seqs, share: int = 1, component: str = "total"):
    """(loss, stats) of the clipped policy loss with the entropy bonus (and KL loss) on one
    micro-batch; `num_tokens` / `num_seqs` count the whole mini-batch; `share`: its rows'
    groups packed once (`loss_share`). component: the loss is one of its terms alone, `task`
    (the policy loss), `entropy` (-entropy_coeff x the entropy) or `kl` (kl_loss_coef x the KL
    loss): RAGEN-2's gradient analysis (starpo/gradients.py)."""
    logp, entropy = token_logprobs(params, actor_cfg, m.tokens, m.valid,
                                   algo.logit_chunk_size, algo.temperature,
                                   batch_window(algo, m), m.positions, share, m.rotary)
    pg, clipped, lower, log_ratio = losses.policy_loss_terms(
        logp, m.old_logprobs, m.advantages, algo.clip_ratio_low, algo.clip_ratio_high,
        algo.clip_ratio_c)

    def agg(x):
        return losses.aggregate(x, m.loss_mask, algo.loss_agg_mode, num_tokens, num_seqs,
                                m.turns if m.segments else None, m.segments)

    def token_mean(x):  # diagnostics are token means over the mini-batch whatever the mode
        return jnp.where(m.loss_mask, x, 0.0).sum() / num_tokens

    pg_loss, entropy_loss = agg(pg), agg(entropy)
    loss = pg_loss - algo.entropy_coeff * entropy_loss
    stats = {"actor/pg_loss": pg_loss, "actor/pg_clipfrac": token_mean(clipped),
             "actor/pg_clipfrac_lower": token_mean(lower),
             "actor/ppo_kl": token_mean(-log_ratio), "actor/entropy": token_mean(entropy)}
    terms = {"task": pg_loss, "entropy": -algo.entropy_coeff * entropy_loss}
    if algo.use_kl_loss:
        kl_loss = agg(losses.kl_estimate(logp, m.ref_logprobs, algo.kl_loss_type))
        loss = loss + algo.kl_loss_coef * kl_loss
        stats["actor/kl_loss"] = kl_loss
        terms["kl"] = algo.kl_loss_coef * kl_loss
    stats["actor/loss"] = loss
    return (loss if component == "total" else terms[component]), stats


def critic_loss(algo: AlgoConfig, critic_cfg: ModelConfig, params, m: Batch, num_tokens,
                 num_seqs):
    """(loss, stats) of the clipped value loss on one micro-batch."""
    values = token_values(params, critic_cfg, m.tokens, m.valid, batch_window(algo, m),
                          m.rotary)
    vf, clipped = losses.value_loss_terms(values, m.old_values, m.returns,
                                          algo.cliprange_value)
    loss = losses.aggregate(vf, m.loss_mask, algo.loss_agg_mode, num_tokens, num_seqs,
                            m.turns if m.segments else None, m.segments)
    clipfrac = jnp.where(m.loss_mask, clipped, 0.0).sum() / num_tokens
    return loss, {"critic/vf_loss": loss, "critic/vf_clipfrac": clipfrac}


def make_grad_fn(algo: AlgoConfig, actor_cfg: ModelConfig, critic_cfg: ModelConfig | None = None):
    """grads(actor_params, critic_params, mb: Batch, share=1) -> (actor_grads, critic_grads |
    None, metrics) for one mini-batch (critic_params / critic_grads are None without a critic).

    The mini-batch runs in micro-batches of `micro_batch_size` rows whose gradients are summed;
    loss denominators are counted over the whole mini-batch first, so the sum is exactly the
    mini-batch gradient. share > 1 (`loss_share`): the actor's forward packs each group of
    `share` rows' prompt once, in micro-batches of whole groups (`share_micro`); the critic's
    keeps its micro-batches.
    """
    if algo.uses_critic and critic_cfg is None:
        raise ValueError(f"adv_estimator={algo.adv_estimator} needs critic_cfg")

    actor_names = ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                   "actor/ppo_kl", "actor/entropy", "actor/loss") + (
        ("actor/kl_loss",) if algo.use_kl_loss else ())
    critic_names = ("critic/vf_loss", "critic/vf_clipfrac")

    # gradients of the trainable parameters only (all of them without LoRA)
    actor_vg = lora.value_and_grad(functools.partial(actor_loss, algo, actor_cfg), has_aux=True)
    critic_vg = lora.value_and_grad(functools.partial(critic_loss, algo, critic_cfg),
                                    has_aux=True)

    def zeros(params, names):
        """The accumulator's start: zero grads and zero sum-form stats (built from known
        structure rather than by tracing the model once more)."""
        return (jax.tree_util.tree_map(jnp.zeros_like, lora.split(params)[0]),
                {name: jnp.zeros((), jnp.float32) for name in names})

    def grads(actor_params, critic_params, mb: Batch, share: int = 1):
        num_tokens, num_seqs = losses.denominators(mb.loss_mask)
        rows = mb.tokens.shape[0]
        micro = micro_size(algo, rows)
        actor_micro = share_micro(micro, share, rows) if share > 1 else micro
        # the critic alongside the actor in one scan where their micro-batches are the same
        critic_with_actor = algo.uses_critic and actor_micro == micro

        def add_micro(acc, m, actor=True, critic=critic_with_actor):
            """Add one micro-batch's grads and (sum-form) metrics to the accumulator."""
            out = {}
            if actor:
                (_, stats), g = actor_vg(actor_params, m, num_tokens, num_seqs, share)
                out["actor"] = (g, stats)
            if critic:
                (_, stats), g = critic_vg(critic_params, m, num_tokens, num_seqs)
                out["critic"] = (g, stats)
            return jax.tree_util.tree_map(jnp.add, acc, out), None

        start = {"actor": zeros(actor_params, actor_names)}
        if critic_with_actor:
            start["critic"] = zeros(critic_params, critic_names)
        if packing.packs_rows(algo, mb.positions, share):  # packed micro-batches; the empty skipped
            packed, bins = pack_rows(algo, mb)
            seqs = packing.packed_micro(micro)

            def add_packed(acc, xs):
                i, m = xs
                return jax.lax.cond(i * seqs < bins, lambda a: add_micro(a, m)[0],
                                    lambda a: a, acc), None

            steps = jnp.arange(rows // seqs, dtype=jnp.int32)
            total, _ = jax.lax.scan(add_packed, start, (steps, micro_split(packed, seqs)))
        else:
            total, _ = jax.lax.scan(add_micro, start, micro_split(mb, actor_micro))
        if algo.uses_critic and not critic_with_actor:  # its own micro-batches
            critic_only = functools.partial(add_micro, actor=False, critic=True)
            start = {"critic": zeros(critic_params, critic_names)}
            total.update(jax.lax.scan(critic_only, start, micro_split(mb, micro))[0])
        actor_g, metrics = total["actor"]
        metrics = dict(metrics)
        critic_g = None
        if algo.uses_critic:
            critic_g, critic_stats = total["critic"]
            metrics.update(critic_stats)
        return actor_g, critic_g, metrics

    return grads
