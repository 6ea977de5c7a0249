"""The update's two packings, each the same numbers in fewer forwards: a single-turn group's
prompt run once for its rows (`prompt_share`, `loss_share`), and multi-turn rows several to a
sequence (`pack_rows`, `packed_forward`: `packing.row_plan`); `batch_logprobs` picks between
them for the old and reference log-probs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from starpo import model as model_lib
from starpo import packing
from starpo.model import ModelConfig
from starpo.algo import AlgoConfig
from starpo.update.forward import (Batch, micro_map, micro_split, reply_positions,
                                   token_logprobs, turn_window)
from starpo.update.minibatch import in_order, plain_split


def pack_rows(algo: AlgoConfig, mb: "Batch") -> tuple["Batch", jax.Array]:
    """(packed, bins): a mini-batch's rows in `packing.row_plan`'s sequences, each token with
    its row as its segment (`Batch.turns`) and its rotary position in its row, the head's
    positions those of the packed reply tokens."""
    replies = packing.packed_replies(algo, mb.tokens.shape[1])
    plan = packing.row_plan(mb.loss_mask, replies)
    tokens, valid, rotary, loss_mask = packing.packed_tokens(plan, mb.tokens, mb.valid,
                                                             mb.loss_mask)
    packed = Batch(tokens=tokens, valid=valid, loss_mask=loss_mask,
                   old_logprobs=packing.pack(mb.old_logprobs, plan),
                   ref_logprobs=packing.pack(mb.ref_logprobs, plan),
                   old_values=packing.pack(mb.old_values, plan),
                   advantages=packing.pack(mb.advantages, plan),
                   returns=packing.pack(mb.returns, plan), turns=plan.row, keep=None,
                   positions=reply_positions(loss_mask, replies), rotary=rotary,
                   segments=mb.tokens.shape[0])
    return packed, plan.bins


def packed_forward(fn, micro: int, replies: int, loss_mask, tokens, valid):
    """fn(tokens, valid, window, rotary, reply_mask) -> [b,T] per-token outputs, run on rows
    packed into shared sequences (`packing.row_plan` of `loss_mask`, `replies`) in
    micro-batches of `packing.packed_micro(micro)` sequences, those past the used ones skipped,
    and returned [N,T] in rows (0 past a row's last reply token): the old and reference
    log-probs and the critic's values of multi-turn rows."""
    plan = packing.row_plan(loss_mask, replies)
    micro = packing.packed_micro(micro)
    p_tokens, p_valid, rotary, p_mask = packing.packed_tokens(plan, tokens, valid, loss_mask)

    def one(xs):
        i, t, v, seg, rot, m = xs

        def run():
            return fn(t, v, model_lib.TurnWindow(seg, 1, segments=True), rot, m)

        out = jax.eval_shape(run)
        return jax.lax.cond(i * micro < plan.bins, run,
                            lambda: jnp.zeros(out.shape, out.dtype))

    steps = jnp.arange(tokens.shape[0] // micro, dtype=jnp.int32)
    out = jax.lax.map(one, (steps,) + micro_split((p_tokens, p_valid, plan.row, rotary, p_mask),
                                                  micro))
    return packing.unpack(out.reshape(tokens.shape[0], -1), plan)


def prompt_share(algo: AlgoConfig, context: int, micro: int) -> int:
    """Rows per packed sequence (`packed_hidden`) of the old and reference log-probs: a group's
    size where its rows are single-turn episodes of one prompt (in order, no context window,
    the head at the reply positions) and micro-batches of whole groups hold no more tokens
    than those of `micro` rows (`share_micro`), else 1. The PPO loss packs them too where its
    mini-batches hold whole groups (`loss_share`); of shuffled rows, each row runs its own
    forward."""
    G, K = algo.group_size, algo.response_length
    ok = (algo.max_turn == 1 and G > 1 and not algo.context_window and 0 < K < context
          and (micro % G == 0 or context + (G - 1) * K <= micro * context))
    return G if ok else 1


def loss_share(algo: AlgoConfig, batch: "Batch", groups: int) -> int:
    """Rows per packed sequence in the PPO loss's forward (`prompt_share`) for a prepared
    `batch` of a rollout of `groups` groups (`static_loss_share`; 1 where the head runs at
    every position). Static."""
    if batch.positions is None:
        return 1
    return static_loss_share(algo, batch.tokens.shape[0], groups, batch.tokens.shape[1])


def static_loss_share(algo: AlgoConfig, rows: int, groups: int, context: int) -> int:
    """`prompt_share` of the PPO loss for `rows` kept rows of `context` tokens, of a rollout of
    `groups` groups, where its mini-batches are those rows in order (`plain_split`, `in_order`)
    and each holds whole groups; else 1."""
    mini = min(algo.ppo_mini_batch_size, rows)
    if (not plain_split(algo, rows, groups) or not in_order(algo, rows)
            or mini % algo.group_size or mini % min(algo.micro_batch_size, mini)):
        return 1
    return prompt_share(algo, context, min(algo.micro_batch_size, mini))


def batch_logprobs(algo: AlgoConfig, cfg: ModelConfig, params, rows, positions, micro: int):
    """Log-probs [N,T] of a batch's rows = (tokens, valid[, window turns]) with the head at
    `positions` (`head_positions`, or None), in micro-batches of `micro` rows, a single-turn
    group's prompt packed once where `prompt_share` allows: the update's old and reference
    log-probs (and what `benchmarks/train_step.py` times)."""
    N, T = rows[0].shape
    share = prompt_share(algo, T, micro) if positions is not None else 1
    if packing.packs_rows(algo, positions, share):
        reply = jnp.zeros((N, T + 1), bool).at[jnp.arange(N)[:, None],
                                                jnp.where(positions > 0, positions, T)].set(True)
        size = packing.packed_replies(algo, T)
        return packed_forward(lambda t, v, window, rot, m: token_logprobs(
            params, cfg, t, v, algo.logit_chunk_size, algo.temperature, window,
            reply_positions(m, size), 1, rot)[0], micro, size, reply[:, :T], *rows)
    fn = lambda p, t, v, *turns: token_logprobs(  # noqa: E731
        params, cfg, t, v, algo.logit_chunk_size, algo.temperature, turn_window(algo, *turns),
        p, share)[0]
    return micro_map(fn, share_micro(micro, share, N), positions, *rows)


def share_micro(micro: int, share: int, rows: int) -> int:
    """Rows per micro-batch of packed groups of `share` rows, of a batch of `rows` rows: whole
    groups, as many as fit in `micro` rows (at least one) and divide the batch's groups."""
    groups = rows // share
    return share * max(d for d in range(1, max(1, micro // share) + 1) if groups % d == 0)
