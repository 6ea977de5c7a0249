"""The StarPO / StarPO-S update: one rollout batch in, k optimizer updates out, one `jax.jit`.

    update(state, traj, key, ref_params=None) -> (state, metrics)

1. Trajectory rewards (turn rewards + penalty) are normalised within their groups.
2. Rollout filter. top_k (StarPO-S): keep int(ratio * groups) groups by in-group reward std
   (or RAGEN-2's top_k_abs: a count of them), gathered into a smaller static-size batch
   (everything after this runs on the kept rows only). top_p / min_p (RAGEN-2), and top_k
   without zero-score groups: keep a dynamic number of groups; all rows stay, dropped rows are
   masked.
3. The training forward recomputes old log-probs (and critic values, reference log-probs when a
   KL term needs them), micro-batch by micro-batch; the sampler/trainer gap is logged.
4. Rewards go onto tokens; advantages by GAE / bi-level GAE / GRPO / GiGPO.
5. Online-k: k mini-batch updates (`lax.scan`), each accumulating gradients over micro-batches
   (`lax.scan`) and applying AdamW with global-norm clipping to the actor and the critic. An
   update whose loss or gradients are not finite is skipped and counted; one whose mini-batch
   holds no loss token (a masking filter dropped them) is skipped, so AdamW does not step on
   nothing.

The state is donated, except for frozen weights (LoRA's base, `starpo/lora.py`): those pass
through as the same buffers, and gradients, AdamW moments and the clipping norm cover the
trainable part alone. Knob names follow the reference (docs/reference.md section 4).

Rooms, read top to bottom: `state` (TrainState, optimizers), `forward` (the model's passes over
a batch), `packed` (the two packings: a group's prompt once, rows several to a sequence),
`prepare` (steps 1-4), `minibatch` (the mini-batches of step 5), `loss` (losses and gradients
of one mini-batch); this file takes the optimizer steps and makes the one jitted update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from starpo import lora, sharding
from starpo.model import ModelConfig
from starpo.algo import AlgoConfig
from starpo.trajectory import Trajectory
from starpo.update.forward import (  # noqa: F401
    Batch, batch_window, head_positions, masked_stats, micro_map, micro_size, micro_split,
    packed_hidden, per_token, reply_count, reply_positions, token_logprobs, token_values,
    turn_window)
from starpo.update.loss import actor_loss, critic_loss, make_grad_fn  # noqa: F401
from starpo.update.minibatch import (  # noqa: F401
    adjusted_size, in_order, kept_minibatch_order, minibatch_order, minibatch_plan, num_updates,
    plain_split)
from starpo.update.packed import (  # noqa: F401
    batch_logprobs, loss_share, pack_rows, packed_forward, prompt_share, share_micro,
    static_loss_share)
from starpo.update.prepare import make_prepare, shaped_score  # noqa: F401
from starpo.update.state import (  # noqa: F401
    DEVICE, HOST, TrainState, algo_lr_schedule, can_offload, init_train_state, jit_state_fn,
    join_state, lr_schedule, make_init, make_optimizer, offload, split_state, state_shardings)


def _apply(tx, params, opt_state, grads, apply):
    """One optimizer step of the trainable parameters, applied only where `apply` (bool[])
    holds; frozen ones come back untouched."""
    train, frozen = lora.split(params)
    updates, new_opt_state = tx.update(grads, opt_state, train)
    new_params = optax.apply_updates(train, updates)
    pick = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(apply, a, b), new, old)
    return lora.join(pick(new_params, train), frozen), pick(new_opt_state, opt_state)


def _one_update(algo: AlgoConfig, grads_fn, optimizers, batch: Batch, frozen, train_actor,
                share: int = 1):
    """One step of the update's `lax.scan` over mini-batches: (trainable state, (rows,
    is_real)) -> (trainable state, metrics). `optimizers`: the actor's and the critic's
    (AdamW, learning rate schedule); `share`: `loss_share`."""
    (actor_tx, actor_lr), (critic_tx, critic_lr) = optimizers

    def one_update(trainable: TrainState, xs):
        state = join_state(trainable, frozen)
        rows, is_real = xs
        mb = jax.tree_util.tree_map(lambda x: x[rows], batch)
        # During critic warm-up the actor's gradient is still computed but not applied: a
        # `lax.cond` around it would nearly double the compile time for a few early steps.
        actor_g, critic_g, metrics = grads_fn(state.actor_params, state.critic_params, mb,
                                              share)  # a new dict
        some = mb.loss_mask.any() & is_real  # a mini-batch past the kept rows has nothing
        state = _actor_step(actor_tx, actor_lr, state, actor_g, metrics, train_actor & is_real,
                            train_actor & some)
        if algo.uses_critic:
            state = _critic_step(critic_tx, critic_lr, state, critic_g, metrics, is_real, some)
        return split_state(state)[0], metrics

    return one_update


def _actor_step(tx, lr, state: TrainState, grads, metrics: dict, due,
                apply_if_ok) -> TrainState:
    """The actor's AdamW step of one mini-batch, taken where `apply_if_ok` and its loss and
    gradients are finite (a non-finite one is counted where `due`); its metrics added."""
    norm = optax.global_norm(grads)
    ok = jnp.isfinite(norm) & jnp.isfinite(metrics["actor/loss"])
    metrics["actor/grad_norm"] = norm
    metrics["actor/lr"] = lr(state.actor_steps)
    metrics["actor/nonfinite_skipped"] = (due & ~ok).astype(jnp.float32)
    metrics["actor/online_k"] = (apply_if_ok & ok).astype(jnp.float32)
    apply = apply_if_ok & ok
    params, opt_state = _apply(tx, state.actor_params, state.actor_opt_state, grads, apply)
    return state.replace(actor_params=params, actor_opt_state=opt_state,
                         actor_steps=state.actor_steps + apply)


def _critic_step(tx, lr, state: TrainState, grads, metrics: dict, is_real, some) -> TrainState:
    """The critic's AdamW step of one mini-batch (as `_actor_step`, with no warm-up)."""
    norm = optax.global_norm(grads)
    ok = jnp.isfinite(norm) & jnp.isfinite(metrics["critic/vf_loss"])
    metrics["critic/grad_norm"] = norm
    metrics["critic/lr"] = lr(state.critic_steps)
    metrics["critic/nonfinite_skipped"] = (~ok & is_real).astype(jnp.float32)
    params, opt_state = _apply(tx, state.critic_params, state.critic_opt_state, grads, ok & some)
    return state.replace(critic_params=params, critic_opt_state=opt_state,
                         critic_steps=state.critic_steps + (ok & some))


def _over_updates(per_update: dict, real) -> dict:
    """The k updates' metrics as one number each: counts summed, the rest means over the
    mini-batches taken (the no-ops past the kept rows left out)."""
    taken = real.sum()
    out = {}
    for name, values in per_update.items():
        summed = name in ("actor/nonfinite_skipped", "actor/online_k",
                          "critic/nonfinite_skipped")
        out[name] = values.sum() if summed else (
            jnp.where(real, values, 0.0).sum() / jnp.maximum(taken, 1))
    out["trainer/updates_per_batch"] = taken.astype(jnp.float32)
    return out


def make_update(algo: AlgoConfig, actor_cfg: ModelConfig, critic_cfg: ModelConfig | None = None,
                compiler_options: dict | None = None, state_shardings=None, mesh=None):
    """The jitted StarPO update: `update(state, traj, key, ref_params=None) -> (state, metrics)`.

    state: TrainState (donated); traj: Trajectory [B,T] in env_groups x group_size layout;
    key: PRNG key for the mini-batch order; ref_params: frozen reference policy, needed only for
    a KL term. Layer rematerialisation follows `actor_cfg.remat` / `critic_cfg.remat`.
    Metrics (float32 scalars; actor/critic ones are means over the k updates):
      rollout/in_group_std, rollout/chosen_in_group_std, rollout/kept_groups,
      rollout/batch_std, rollout/filter_kept_ratio, rollout/filter_zero_count,
      actor/pg_loss, actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl, actor/entropy,
      actor/loss, actor/kl_loss (use_kl_loss), actor/ref_kl (with a reference), actor/grad_norm,
      actor/lr, actor/sampler_logprob_gap, actor/sampler_logprob_abs_gap,
      actor/sampler_logprob_max_abs_gap, actor/sampler_kl (the rollout's log-probs against the
      update's first forward over the same tokens, kept rows), actor/online_k (optimizer
      updates the actor took from this batch: the mini-batches taken minus skipped, 0 in critic
      warm-up), actor/nonfinite_skipped, trainer/updates_per_batch (the mini-batches taken:
      k, or under top-p those of the kept rows),
      critic/score/{mean,max,min}, critic/rewards/mean, critic/advantages/{mean,max,min},
      critic/returns/{mean,max,min}, response_length/mean, critic/overlong_penalty/mean
      (overlong shaping on; all rows, before the filter), and with a critic:
      critic/values/{mean,max,min}, critic/vf_explained_var, critic/vf_loss,
      critic/vf_clipfrac, critic/grad_norm, critic/lr, critic/nonfinite_skipped.
    `compiler_options` go to `jax.jit` (tests: {"xla_backend_optimization_level": 0}). On a
    mesh, `state_shardings` (a TrainState of NamedShardings, `state_shardings(...)`) fixes
    where the new state lives (the same place as the donated one) and the metrics come back
    replicated; the trajectory keeps the sharding it arrives with (rows over the batch axes).
    """
    prepare = make_prepare(algo, actor_cfg, critic_cfg)
    grads_fn = make_grad_fn(algo, actor_cfg, critic_cfg)
    # (AdamW, its learning rate schedule) of the actor and of the critic
    optimizers = tuple((make_optimizer(lr, algo), algo_lr_schedule(lr, algo))
                       for lr in (algo.actor_lr, algo.critic_lr))

    def update(state: TrainState, traj: Trajectory, key: jax.Array, ref_params=None):
        batch, metrics = prepare(state, traj, ref_params)
        order, real = minibatch_plan(algo, batch, traj, key)
        train_actor = state.step >= algo.critic_warmup if algo.uses_critic else jnp.bool_(True)

        trainable, frozen = split_state(state)  # the loop carries the trainable part alone
        share = loss_share(algo, batch, traj.tokens.shape[0] // algo.group_size)
        one_update = _one_update(algo, grads_fn, optimizers, batch, frozen, train_actor, share)
        trainable, per_update = jax.lax.scan(one_update, trainable, (order, real))
        state = join_state(trainable, frozen)
        metrics.update(_over_updates(per_update, real))
        metrics = {name: jnp.asarray(v, jnp.float32) for name, v in metrics.items()}
        return state.replace(step=state.step + 1), metrics

    out_shardings = None
    if state_shardings is not None:
        out_shardings = (state_shardings, sharding.replicated(mesh))
    return jit_state_fn(update, out_shardings, compiler_options=compiler_options)
