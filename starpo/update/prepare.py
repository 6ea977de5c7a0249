"""Before the updates: scores normalised, the rollout filter, the training forward's old log-probs
(values, reference log-probs), rewards onto tokens, advantages and RAGEN-2's scalings, as one
`Batch` and the batch's metrics (`make_prepare`)."""

from __future__ import annotations

import jax.numpy as jnp

from starpo import advantages as adv_lib
from starpo import filtering, losses, packing
from starpo.model import ModelConfig
from starpo.algo import AlgoConfig
from starpo.trajectory import Trajectory
from starpo.update.forward import (Batch, head_positions, masked_stats, micro_map, micro_size,
                                   token_values, turn_window)
from starpo.update.packed import batch_logprobs, packed_forward
from starpo.update.state import TrainState


def _filter(algo: AlgoConfig, traj: Trajectory, normalised, scale, score):
    """The rollout filter: (traj, normalised, scale, score, keep bool[N], metrics) of the rows
    the update runs on. top_k / top_k_abs gather the kept rows (keep is all True); a filter
    that masks (`algo.masks_rows`) keeps every row and marks the kept groups' rows in `keep`.
    Groups are ranked by `rollout_filter_metric` of their normalised scores (the std by
    default), as RAGEN-2 ranks the scores its reward normalisation wrote (they differ from the
    raw scores' under mean_std normalisation over the batch); the logged stds stay the raw
    scores' (the Echo Trap detector watches them)."""
    B = score.shape[0]
    rank = dict(rank_by=normalised, metric=algo.rollout_filter_metric,
                strategy=algo.rollout_filter_strategy,
                lengths=(traj.loss_mask.sum(axis=1) if algo.rollout_filter_metric == "length"
                         else None))
    if algo.masks_rows:
        keep, metrics = filtering.masked_rows(
            score, algo.group_size, algo.rollout_filter_top_p, algo.rollout_filter_type,
            algo.rollout_filter_top_p_prob_mode, algo.rollout_filter_include_zero,
            algo.rollout_filter_selection_eps, min_p=algo.rollout_filter_min_p,
            ratio=algo.rollout_filter_ratio, count=algo.rollout_filter_count, **rank)
        return traj, normalised, scale, score, keep, metrics
    rows, metrics = filtering.filter_rows(score, algo.group_size, algo.rollout_filter_ratio,
                                          algo.rollout_filter_type,
                                          count=algo.rollout_filter_count, **rank)
    if rows.shape[0] < B:
        traj = traj.take(rows)
        normalised, scale, score = normalised[rows], scale[rows], score[rows]
    return traj, normalised, scale, score, jnp.ones(rows.shape, bool), metrics


def _row_stats(x, keep):
    """(mean, max, min) of x f32[N] over the kept rows (the values at row 0 if none is kept)."""
    n = keep.sum()
    mean = jnp.where(keep, x, 0.0).sum() / jnp.maximum(n, 1)
    big = jnp.where(keep, x, -jnp.inf).max()
    small = jnp.where(keep, x, jnp.inf).min()
    return (mean, jnp.where(n > 0, big, x[0]), jnp.where(n > 0, small, x[0]))


def _prepare_metrics(algo, traj, mask, score, rewards, old_logp, ref_logp, values, advantages,
                     returns, keep) -> dict:
    """The batch's scores, rewards, advantages, returns (and values) and the sampler/trainer
    log-prob mismatch (mean, mean and max absolute gap, k3 KL) over the kept rows (`keep`
    bool[N]), as the update logs them."""
    n_tok = jnp.maximum(mask.sum(), 1)
    gap = jnp.where(mask, traj.sample_logprobs - old_logp, 0.0)
    score_mean, score_max, score_min = _row_stats(score, keep)
    metrics = {
        "critic/score/mean": score_mean, "critic/score/max": score_max,
        "critic/score/min": score_min,
        "critic/rewards/mean": _row_stats(rewards.sum(axis=1), keep)[0],
        "actor/sampler_logprob_gap": gap.sum() / n_tok,
        "actor/sampler_logprob_abs_gap": jnp.abs(gap).sum() / n_tok,
        "actor/sampler_logprob_max_abs_gap": jnp.abs(gap).max(),
        # k3 estimate of KL(sampler || trainer) per token over the sampler's own tokens:
        # r - 1 - log r with log r = trainer - sampler, as expm1 (exact near r = 1, where
        # exp(d) - d - 1 in float32 would be rounding noise)
        "actor/sampler_kl": jnp.where(mask, jnp.expm1(-gap) + gap, 0.0).sum() / n_tok,
        "response_length/mean": _row_stats(mask.sum(axis=1).astype(jnp.float32), keep)[0],
    }
    metrics.update(masked_stats("critic/advantages", advantages, mask))
    metrics.update(masked_stats("critic/returns", returns, mask))
    if values is not None:
        metrics.update(masked_stats("critic/values", values, mask))
        ret_mean = metrics["critic/returns/mean"]
        var_ret = jnp.where(mask, (returns - ret_mean) ** 2, 0.0).sum() / n_tok
        err = jnp.where(mask, returns - values, 0.0)
        err_mean = err.sum() / n_tok
        var_err = jnp.where(mask, (err - err_mean) ** 2, 0.0).sum() / n_tok
        metrics["critic/vf_explained_var"] = 1.0 - var_err / (var_ret + 1e-8)
    if algo.uses_reference:
        metrics["actor/ref_kl"] = jnp.where(
            mask, losses.kl_estimate(old_logp, ref_logp, algo.kl_loss_type), 0.0).sum() / n_tok
    return metrics


def shaped_score(algo: AlgoConfig, traj: Trajectory):
    """(score f32[B], overlong penalty f32[B] | None): the trajectory reward plus, when
    overlong shaping is on, the sum of its turns' DAPO overlong penalties."""
    if algo.overlong_buffer_len <= 0:
        return traj.score, None
    lengths = adv_lib.reply_lengths(traj.loss_mask & traj.valid, traj.turn_index,
                                    traj.turn_end.shape[1])
    penalty = adv_lib.overlong_penalty(lengths, algo.response_length, algo.overlong_buffer_len,
                                       algo.overlong_penalty_factor).sum(axis=1)
    return traj.score + penalty, penalty


def _reweight(algo: AlgoConfig, advantages, score, group_id, mask, keep, metrics: dict):
    """RAGEN-2's scalings of the advantages after the estimator, in its order (each off by
    default): under GRPO, `soft_advantage_reweight` (each group's by its reward std over the
    largest kept group's, + 1e-6; logs train/soft_reweight_min / max / mean over the kept
    groups); `filter_loss_scaling` (by the kept share of groups, or its square root); under
    GRPO, `grpo_advantage_length_weight` (each row's by the kept rows' mean reply length over
    its own, + 1e-6). score f32[B]: the rows' summed token rewards (what GRPO compared)."""
    kept = keep & mask.any(axis=1)
    if algo.soft_advantage_reweight and algo.adv_estimator == "grpo":
        _, std, n = adv_lib.group_mean_std(score, group_id)
        std = jnp.where(n <= 1, 1.0, std)  # GRPO's std of a group of one (verl's convention)
        weight = std / (jnp.where(kept, std, -jnp.inf).max() + 1e-6)
        advantages = advantages * weight[:, None]
        # every kept group has group_size rows, so row statistics are the groups'
        metrics.update({"train/soft_reweight_min": jnp.where(kept, weight, jnp.inf).min(),
                        "train/soft_reweight_max": jnp.where(kept, weight, -jnp.inf).max(),
                        "train/soft_reweight_mean": jnp.where(kept, weight, 0.0).sum()
                        / jnp.maximum(kept.sum(), 1)})
    if algo.filter_loss_scaling != "none":  # RAGEN-2: a smaller kept share, smaller steps
        ratio = metrics["rollout/filter_kept_ratio"]
        advantages = advantages * (ratio if algo.filter_loss_scaling == "linear"
                                   else jnp.sqrt(ratio))
    if algo.grpo_advantage_length_weight and algo.adv_estimator == "grpo":
        length = mask.sum(axis=1).astype(jnp.float32)
        mean = jnp.where(kept, length, 0.0).sum() / jnp.maximum(kept.sum(), 1)
        advantages = advantages / ((length + 1e-6) / mean)[:, None]
    return advantages


def _advantages(algo: AlgoConfig, critic_cfg, state, traj: Trajectory, rewards, mask, micro,
                rows, packed: bool = False):
    """(advantages, returns, critic values or None) of the kept rows by `algo.adv_estimator`;
    PPO's (with a critic) whitened over the batch; `packed`: the critic's forward runs the
    rows packed (`packed_forward`)."""
    if algo.adv_estimator == "grpo":
        advantages, returns = adv_lib.grpo(rewards.sum(axis=1), traj.group_id, mask,
                                           algo.norm_adv_by_std_in_grpo)
        return advantages, returns, None
    if algo.adv_estimator == "gigpo":
        advantages, returns = adv_lib.gigpo(
            rewards.sum(axis=1), traj.turn_reward, traj.turn_end, traj.turn_index,
            traj.state_hash, traj.group_id, mask, algo.gamma, algo.gigpo_step_advantage_w,
            algo.gigpo_mode, algo.gigpo_episode_over_steps)
        return advantages, returns, None
    if packed:
        values = packed_forward(lambda t, v, window, rot, _: token_values(
            state.critic_params, critic_cfg, t, v, window, rot), micro,
            packing.packed_replies(algo, mask.shape[1]), mask, *rows)
    else:
        values = micro_map(lambda t, v, *turns: token_values(
            state.critic_params, critic_cfg, t, v, turn_window(algo, *turns)), micro, *rows)
    values = jnp.where(mask, values, 0.0)
    if algo.adv_estimator == "gae":
        advantages, returns = adv_lib.gae(rewards, values, mask, algo.gamma, algo.lam)
    else:
        advantages, returns = adv_lib.bi_level_gae(
            rewards, values, mask, traj.turn_end, algo.gamma, algo.lam, algo.high_level_gamma,
            algo.bi_level_turns)
    # PPO whitens token advantages over the batch (as the reference does)
    return adv_lib.masked_whiten(advantages, mask), returns, values


def make_prepare(algo: AlgoConfig, actor_cfg: ModelConfig, critic_cfg: ModelConfig | None = None):
    """prepare(state, traj, ref_params=None) -> (Batch, metrics): normalise, filter, recompute
    log-probs/values, rewards to tokens, advantages. Pure; jit it or call it inside a jit."""
    if algo.uses_critic and critic_cfg is None:
        raise ValueError(f"adv_estimator={algo.adv_estimator} needs critic_cfg")

    def prepare(state: TrainState, traj: Trajectory, ref_params=None):
        if algo.uses_reference and ref_params is None:
            raise ValueError("use_kl_loss / use_kl_in_reward need ref_params")
        if algo.adv_estimator == "gigpo" and traj.state_hash is None:
            raise ValueError("adv_estimator=gigpo needs Trajectory.state_hash (the rollout's)")
        T = traj.tokens.shape[1]
        score, overlong = shaped_score(algo, traj)
        key = adv_lib.grouping_key(algo.reward_norm_grouping, traj.group_id, traj.tag)
        normalised, scale = adv_lib.normalize_scores(score, key, algo.reward_norm_method)
        traj, normalised, scale, score, keep, metrics = _filter(algo, traj, normalised, scale,
                                                                score)
        if overlong is not None:
            metrics["critic/overlong_penalty/mean"] = overlong.mean()
        N = traj.tokens.shape[0]
        valid = traj.valid
        mask = traj.loss_mask & valid & keep[:, None]
        micro = micro_size(algo, N)
        # each row's tokens with the turns a context window reads (None: no window)
        rows = (traj.tokens, valid) + ((traj.window_turns(),) if algo.context_window else ())
        positions = head_positions(algo, traj.loss_mask & valid)

        def logp_of(params):
            return batch_logprobs(algo, actor_cfg, params, rows, positions, micro)

        old_logp = logp_of(state.actor_params)
        ref_logp = logp_of(ref_params) if algo.uses_reference else None
        rewards = adv_lib.token_rewards(traj.turn_end, traj.turn_reward, normalised, scale, T,
                                        algo.use_turn_scores)
        if algo.use_kl_in_reward:
            kl = losses.kl_estimate(old_logp, ref_logp, algo.kl_penalty)
            rewards = rewards - algo.kl_coef * jnp.where(mask, kl, 0.0)

        advantages, returns, values = _advantages(algo, critic_cfg, state, traj, rewards, mask,
                                                  micro, rows, packing.packs_rows(algo, positions))
        advantages = _reweight(algo, advantages, rewards.sum(axis=1), traj.group_id, mask, keep,
                               metrics)
        if algo.zero_task_advantage:  # RAGEN-2's ablation: no task-driven policy gradient
            advantages = jnp.zeros_like(advantages)

        metrics.update(_prepare_metrics(algo, traj, mask, score, rewards, old_logp, ref_logp,
                                        values, advantages, returns, keep))
        batch = Batch(tokens=traj.tokens, valid=valid, loss_mask=mask, old_logprobs=old_logp,
                      ref_logprobs=ref_logp, old_values=values, advantages=advantages,
                      returns=returns, turns=rows[2] if algo.context_window else None,
                      keep=keep if algo.masks_rows else None,
                      group_std=jnp.repeat(filtering.in_group_std(normalised, algo.group_size),
                                           algo.group_size),
                      positions=positions)
        return batch, metrics

    return prepare
