"""Rewards to tokens, reward normalisation, and the advantage estimators (GAE, bi-level GAE, GRPO,
GiGPO).

All functions are pure and jittable, with no Python loops over rows, groups or tokens: group
statistics use a [B,B] same-group matrix (B is the episode count, small), GAE is a reverse
`lax.scan` over time that carries the next value/advantage past tokens the model did not write.

Alignment: `values[b,t]` is the critic's estimate of the state just before token t was written
(computed from the hidden state at t-1), the same alignment as `Trajectory.sample_logprobs`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from starpo.schema import GIGPO_MODES, GROUPINGS, NORM_METHODS  # noqa: F401

# Below this in-group std a group counts as constant (its normalised scores are 0), and the
# epsilon added to std before dividing; both as in the reference, which runs in bf16.
STD_EPS = 1e-6
# The asymmetric clip of `asym_clip` normalisation (the reference's clamp): a bad episode can pull
# its tokens down by at most 1 std, a rare good one up by 3.
ASYM_CLIP = (-1.0, 3.0)


# ----------------------------------------------------------------------------- group statistics
def group_mean_std(x: jax.Array, key: jax.Array, weight: jax.Array | None = None):
    """Per-row statistics of the row's group (rows with equal `key`).

    x: f32[B]; key: int[B]. Returns (mean f32[B], unbiased std f32[B], size int32[B]); the std of
    a single-member group is 0. Rows of one group get bit-identical statistics. `weight` int[B]:
    row b counts as that many equal members (the statistics of a list holding x[b] weight[b]
    times; size is then the list's length).

    Sums run over values shifted by the group's first member, so a group of equal values has
    exactly that mean and exactly zero deviations whatever the summation order (a sharded sum
    of 8 x -0.1 is not exactly -0.8, and GRPO's division by std + 1e-6 would turn its 1e-8
    residue into advantages of ~1e-2).
    """
    same = key[:, None] == key[None, :]  # [B,B]
    if weight is None:
        n = same.sum(axis=1)
        w = jnp.ones(x.shape, x.dtype)
    else:
        w = weight.astype(x.dtype)
        n = jnp.where(same, weight[None, :], 0).sum(axis=1)
    shift = x[jnp.argmax(same, axis=1)]  # the first member of each row's group
    mean = shift + jnp.where(same, w[None, :] * (x[None, :] - shift[:, None]), 0.0).sum(
        axis=1) / jnp.maximum(n, 1)
    dev = jnp.where(same, x[None, :] - mean[:, None], 0.0)
    var = (w[None, :] * dev * dev).sum(axis=1) / jnp.maximum(n - 1, 1)
    return mean, jnp.sqrt(var), n.astype(jnp.int32)


def grouping_key(grouping: str, group_id: jax.Array, tag: jax.Array) -> jax.Array:
    """The int[B] key that defines normalisation groups: initial state, env tag, or one batch."""
    if grouping == "state":
        return group_id
    if grouping == "inductive":
        return tag
    if grouping == "batch":
        return jnp.zeros_like(group_id)
    raise ValueError(f"unknown reward normalisation grouping {grouping!r} (one of {GROUPINGS})")


def normalize_scores(score: jax.Array, key: jax.Array, method: str):
    """Normalise trajectory rewards within groups before advantages are computed.

    score: f32[B] trajectory rewards; key: int[B] group key (`grouping_key`).
    Returns (normalised f32[B], scale f32[B]): `scale` is the factor applied to rewards (1/std,
    or 1), used to spread a normalised score over per-turn rewards.

    identity:  unchanged.
    mean:      score - group mean.
    mean_std:  (score - mean) / (std + 1e-6); 0 for a group whose std is <= 1e-6.
    asym_clip: mean_std, then clipped to [-1, 3] (a rare success can stand out up to 3 std,
               failures weigh at most 1 std) - the reference's definition.
    A single-member group has no baseline to compare with and keeps its raw score (so a batch of
    singletons trains as plain REINFORCE, as the reference does).
    """
    if method not in NORM_METHODS:
        raise ValueError(f"unknown reward normalisation method {method!r} (one of {NORM_METHODS})")
    ones = jnp.ones_like(score)
    if method == "identity":
        return score, ones
    mean, std, n = group_mean_std(score, key)
    single = n == 1
    if method == "mean":
        return jnp.where(single, score, score - mean), ones
    constant = std <= STD_EPS
    scale = jnp.where(constant, 0.0, 1.0 / (std + STD_EPS))
    normalised = (score - mean) * scale
    if method == "asym_clip":
        normalised = jnp.clip(normalised, *ASYM_CLIP)
    return jnp.where(single, score, normalised), jnp.where(single, 1.0, scale)


# ----------------------------------------------------------------------------- rewards to tokens
def scatter_turns(turn_end: jax.Array, values: jax.Array, length: int) -> jax.Array:
    """Place values f32[B,M] at positions turn_end int[B,M] of a zero f32[B,length] row.

    Turns with turn_end = -1 are dropped; `where` (not a product) keeps a NaN from leaking into
    other positions.
    """
    hit = turn_end[:, :, None] == jnp.arange(length)[None, None, :]  # [B,M,T]
    return jnp.where(hit, values[:, :, None], 0.0).sum(axis=1)


def token_rewards(turn_end, turn_reward, normalised_score, scale, length: int,
                  use_turn_scores: bool) -> jax.Array:
    """Token-level rewards f32[B,T] from (normalised) episode scores.

    Trajectory mode: the whole normalised score on the last model token (the last turn's end).
    Per-turn mode: turn k's reward times `scale` on turn k's last token, and the rest of the
    normalised score (the penalty, the normalisation shift and any clipping) on the last turn, so
    the token rewards of a row always sum to its normalised score in both modes.
    An episode without any model token has nowhere to carry a reward and gets none.
    turn_end int[B,M], turn_reward f32[B,M], normalised_score f32[B], scale f32[B].
    """
    last = jnp.max(turn_end, axis=1)  # [B]; -1 when no turn happened
    if not use_turn_scores:
        return scatter_turns(last[:, None], normalised_score[:, None], length)
    per_turn = jnp.where(turn_end >= 0, turn_reward * scale[:, None], 0.0)  # [B,M]
    rest = normalised_score - per_turn.sum(axis=1)
    return scatter_turns(turn_end, per_turn, length) + scatter_turns(last[:, None], rest[:, None],
                                                                     length)


def reply_lengths(loss_mask: jax.Array, turn_index: jax.Array, max_turn: int) -> jax.Array:
    """int32[B,M]: model tokens of each turn's reply (loss_mask tokens carrying turn k)."""
    turns = jnp.arange(max_turn)[None, None, :]
    hits = loss_mask[:, :, None] & (turn_index[:, :, None] == turns)  # [B,T,M]
    return hits.sum(axis=1).astype(jnp.int32)


def overlong_penalty(lengths: jax.Array, max_length: int, buffer_len: int,
                     factor: float) -> jax.Array:
    """DAPO's soft overlong punishment of replies of `lengths` (int[...]) tokens, same shape:
    0 up to max_length - buffer_len tokens, then falling linearly to -factor at max_length
    (and -factor beyond). buffer_len 0 is off (all zeros)."""
    if buffer_len <= 0:
        return jnp.zeros(lengths.shape, jnp.float32)
    exceed = lengths.astype(jnp.float32) - (max_length - buffer_len)
    return -factor * jnp.clip(exceed / buffer_len, 0.0, 1.0)


# ----------------------------------------------------------------------------- estimators
def masked_whiten(x: jax.Array, mask: jax.Array, eps: float = 1e-8) -> jax.Array:
    """(x - mean) / sqrt(var + eps) over the masked entries (unbiased var); 0 elsewhere."""
    n = mask.sum()
    mean = jnp.where(mask, x, 0.0).sum() / jnp.maximum(n, 1)
    dev = jnp.where(mask, x - mean, 0.0)
    var = (dev * dev).sum() / jnp.maximum(n - 1, 1)
    return jnp.where(mask, dev * jax.lax.rsqrt(var + eps), 0.0)


def _reverse_gae(rewards, values, mask, gamma, lam, end=None, end_return=None):
    """Reverse scan over axis 1 of [B,N] arrays, skipping unmasked steps.

    At a masked step: delta = r + gamma * V(next masked step) - V, A = delta + gamma*lam*A(next).
    Unmasked steps pass the carry through untouched (they are not decisions of the model).
    Where `end` is set the step is terminal for the token-level recursion and its target is
    `end_return` (bi-level GAE): A = end_return - V.
    """
    B = rewards.shape[0]
    if end is None:
        end = jnp.zeros_like(mask)
        end_return = jnp.zeros_like(rewards)

    def step(carry, x):
        next_value, next_adv = carry
        r, v, m, e, g = x
        adv = jnp.where(e, g - v, r + gamma * next_value - v + gamma * lam * next_adv)
        carry = (jnp.where(m, v, next_value), jnp.where(m, adv, next_adv))
        return carry, jnp.where(m, adv, 0.0)

    zeros = jnp.zeros((B,), rewards.dtype)
    xs = tuple(a.T for a in (rewards, values, mask, end, end_return))  # time-major [N,B]
    _, adv = jax.lax.scan(step, (zeros, zeros), xs, reverse=True)
    return adv.T


def gae(rewards, values, mask, gamma: float, lam: float):
    """Token-level GAE over the model's tokens.

    rewards, values: f32[B,T]; mask: bool[B,T] (loss_mask). The recursion runs over model tokens
    only: an observation between two turns is skipped, so the last token of a turn bootstraps
    from the value of the next turn's first model token and environment tokens never get or pass
    on value. Returns (advantages, returns) f32[B,T], 0 off the mask; returns = A + V.
    """
    adv = _reverse_gae(rewards, values, mask, gamma, lam)
    return adv, jnp.where(mask, adv + values, 0.0)


def bi_level_gae(rewards, values, mask, turn_end, gamma: float, lam: float,
                 high_level_gamma: float, turns: str = "every"):
    """Two-level GAE: turn-level GAE across turns, then token-level GAE inside each turn.

    rewards, values: f32[B,T]; mask: bool[B,T]; turn_end: int[B,M]. A turn ends, under
    `turns="every"`, at each reply's last token (so a turn whose reward is 0 is still a turn);
    under "reward" (RAGEN's reading, `algorithm.bi_level_turns`) at each token whose reward is
    not 0, so with a final reward alone it is plain GAE. Turn k's reward is the token reward at
    its end and its value the value there (as in the reference). High level, over the ends:
      A_k = r_k + hg * V_{k+1} - V_k + hg * lam * A_{k+1},   G_k = A_k + V_k.
    Low level, inside turn k: the end token's target is G_k (A = G_k - V), earlier tokens use
    ordinary GAE with `gamma` (and their own token rewards, e.g. a KL penalty).
    Returns (advantages, returns) f32[B,T], 0 off the mask.
    """
    T = rewards.shape[1]
    if turns == "reward":
        end = rewards != 0  # the high level runs over these tokens alone
        end_return = jnp.where(end, _reverse_gae(rewards, values, end, high_level_gamma, lam)
                               + values, 0.0)
        end = end & mask
    else:
        happened = turn_end >= 0
        at = jnp.maximum(turn_end, 0)
        turn_values = jnp.take_along_axis(values, at, axis=1)  # [B,M]
        turn_rewards = jnp.where(happened, jnp.take_along_axis(rewards, at, axis=1), 0.0)
        turn_adv = _reverse_gae(turn_rewards, turn_values, happened, high_level_gamma, lam)
        end = (turn_end[:, :, None] == jnp.arange(T)[None, None, :]).any(axis=1) & mask  # [B,T]
        end_return = scatter_turns(turn_end, turn_adv + turn_values, T)
    adv = _reverse_gae(rewards, values, mask, gamma, lam, end, end_return)
    return adv, jnp.where(mask, adv + values, 0.0)


def grpo(score, group_id, mask, norm_by_std: bool):
    """GRPO: each row's score against its group, broadcast to the row's model tokens.

    score: f32[B] (trajectory reward after normalisation); group_id: int[B]; mask: bool[B,T].
    A = (score - group mean) / (group std + 1e-6), or without the division when `norm_by_std`
    is off. A group whose rewards are all equal gives 0; a single-member group has no baseline:
    mean 0 and std 1 (the reference's convention), so its advantage is its score.
    Returns (advantages, returns) f32[B,T]; returns = advantages (there is no critic).
    """
    adv = jnp.where(mask, _against_group(score, group_id, None, norm_by_std)[:, None], 0.0)
    return adv, adv


def _against_group(score, group_id, weight, norm_by_std: bool):
    """f32[B]: each score minus its group's mean, divided by std + 1e-6 when `norm_by_std`; a
    group of one member (counted with `weight`, see `group_mean_std`) has mean 0 and std 1."""
    mean, std, n = group_mean_std(score, group_id, weight)
    single = n <= 1
    centred = score - jnp.where(single, 0.0, mean)
    if norm_by_std:
        centred = centred / jnp.where(single, 1.0, std + STD_EPS)
    return centred


# ----------------------------------------------------------------------------- GiGPO
def discounted_turn_returns(turn_rewards: jax.Array, gamma: float) -> jax.Array:
    """G_k = sum_{j >= k} gamma^(j-k) r_j over turns, f32[B,M] from turn rewards f32[B,M] (0 on
    turns that did not happen, which come last and so add nothing)."""
    M = turn_rewards.shape[1]
    k = np.arange(M)
    power = np.where(k[None, :] >= k[:, None], k[None, :] - k[:, None], 0)
    discount = np.where(k[None, :] >= k[:, None], float(gamma) ** power, 0.0)  # [k, j]
    return turn_rewards @ jnp.asarray(discount.T, turn_rewards.dtype)


def segment_mean_std(x: jax.Array, same_as_next: jax.Array):
    """Statistics of runs of consecutive equal keys: x f32[N] sorted by key; same_as_next bool[N]
    (item i+1 has item i's key; the last entry is ignored). Returns per item (mean, unbiased std
    (0 for a run of one), run size). Sums are shifted by the run's first member, so a run of
    equal values has exactly that mean and zero std (see `group_mean_std`)."""
    N = x.shape[0]
    start = jnp.concatenate([jnp.ones((1,), bool), ~same_as_next[:-1]])
    seg = jnp.cumsum(start) - 1  # run index of each item
    first = jax.ops.segment_min(jnp.arange(N), seg, num_segments=N)  # a run's first item
    shift = x[first[seg]]
    n = jax.ops.segment_sum(jnp.ones_like(x), seg, num_segments=N)[seg]
    mean = shift + jax.ops.segment_sum(x - shift, seg, num_segments=N)[seg] / n
    dev = x - mean
    var = jax.ops.segment_sum(dev * dev, seg, num_segments=N)[seg] / jnp.maximum(n - 1, 1)
    return mean, jnp.sqrt(var), n


def step_group_advantages(returns, state_hash, group_id, happened, mode: str):
    """GiGPO's step-level advantages f32[B,M]: turn (b, k) joins the step group of the turns with
    the same group_id and the same anchor-state hash; its discounted return is normalised there.

    mean_norm: G - mean; mean_std_norm: (G - mean) / (std + 1e-6). A turn alone in its step group
    gets 0 (verl-agent's convention: its mean is itself, its std 1); turns that did not happen get
    0. Groups are found by sorting on (happened, group_id, hash), so the cost is a sort of B*M keys,
    not a B*M x B*M comparison.
    """
    B, M = returns.shape
    g = jnp.broadcast_to(group_id[:, None], (B, M)).reshape(-1)
    h, ok, x = state_hash.reshape(-1), happened.reshape(-1), returns.reshape(-1)
    order = jnp.lexsort((h, g, ~ok))  # the last key sorts first: real turns, group, hash
    gs, hs, oks = g[order], h[order], ok[order]
    same = (gs[1:] == gs[:-1]) & (hs[1:] == hs[:-1]) & oks[1:] & oks[:-1]
    same = jnp.concatenate([same, jnp.zeros((1,), bool)])
    mean, std, n = segment_mean_std(x[order], same)
    centred = x[order] - mean
    if mode == "mean_std_norm":
        centred = centred / (jnp.where(n > 1, std, 1.0) + STD_EPS)
    adv = jnp.zeros_like(x).at[order].set(jnp.where(oks, centred, 0.0))
    return adv.reshape(B, M)


def gigpo(score, turn_reward, turn_end, turn_index, state_hash, group_id, mask, gamma: float,
          step_advantage_w: float, mode: str, episode_over_steps: bool = True):
    """GiGPO (verl-agent): episode-level group advantage plus `step_advantage_w` times a
    step-level advantage from groups of identical anchor states, on each turn's tokens.

    score f32[B] the episode scores (after reward normalisation); turn_reward f32[B,M] each
    turn's env reward (0 where the turn did not happen); turn_end int32[B,M]; turn_index
    int32[B,T]; state_hash int32[B,M] (the anchor: the observation turn k acted on);
    group_id int[B]; mask bool[B,T] (loss mask).
    Episode level: each score against its group, divided by std + 1e-6 under mean_std_norm (a
    group of one member: mean 0, std 1). With `episode_over_steps` (verl-agent's default,
    `compute_mean_std_cross_all_data`: every step is a row of its batch, carrying its episode's
    score) the group's mean and std run over steps, an episode counted once per turn it took;
    without, over episodes (the GiGPO paper's formula). Step level: `step_group_advantages` of
    the discounted reward-to-go of the turn rewards (`gamma`), as verl-agent's
    `compute_step_discounted_returns`. Returns (advantages, returns) f32[B,T]; returns =
    advantages (there is no critic).
    """
    if mode not in GIGPO_MODES:
        raise ValueError(f"unknown gigpo mode {mode!r} (one of {GIGPO_MODES})")
    happened = turn_end >= 0
    weight = happened.sum(axis=1) if episode_over_steps else None
    episode = _against_group(score, group_id, weight, mode == "mean_std_norm")
    turn_reward = jnp.where(happened, turn_reward, 0.0)
    step = step_group_advantages(discounted_turn_returns(turn_reward, gamma), state_hash,
                                 group_id, happened, mode)  # [B,M]
    per_token = jnp.take_along_axis(step, jnp.clip(turn_index, 0, step.shape[1] - 1), axis=1)
    adv = jnp.where(mask, episode[:, None] + step_advantage_w * per_token, 0.0)
    return adv, adv
