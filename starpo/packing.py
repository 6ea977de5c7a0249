"""Where the update puts multi-turn rows when it packs several into one sequence of the
batch's length (`algorithm.pack_rows`): the placement (`row_plan`, first fit in row order), the
moves between rows and sequences (`pack`, `unpack`, `packed_tokens`) and the static choices
around them. Layout alone: the forwards that run on packed sequences are in
starpo/update/packed.py (`packed_forward`, `pack_rows`), each token at its row's own rotary position and seeing its
own row alone, which gives every row its own numbers (tests/test_update.py)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from starpo import model as model_lib
from starpo import precision
from starpo.algo import AlgoConfig


def packs_rows(algo: AlgoConfig, positions, share: int = 1) -> bool:
    """Whether a batch's forwards run its rows packed into shared sequences (`row_plan`):
    multi-turn rows whose head runs at their reply `positions`, under no context window,
    their prompts not already shared (`update.prompt_share`, `update.loss_share`). Static."""
    return (algo.pack_rows and share == 1 and algo.max_turn > 1 and not algo.context_window
            and positions is not None)


class RowPlan(NamedTuple):
    """Where `row_plan` puts each of N rows of T tokens in N sequences of T: row r's tokens
    0..length[r]-1 at flat slot start[r] of the [N,T] sequences, the first `bins` of which are
    used; for each slot, the row and place it holds (`row`, `at`) and whether it holds one."""

    start: jax.Array
    length: jax.Array
    bins: jax.Array
    row: jax.Array
    at: jax.Array
    inside: jax.Array


def row_plan(loss_mask, replies: int) -> RowPlan:
    """Rows placed whole into sequences of their length T, first fit in row order: each row in
    the first sequence where its tokens, and its reply tokens, still fit within T and within
    `replies`, the most a row has (so the head runs at as many positions a sequence as a row);
    a row's tokens through its last reply token (the rest feeds no loss); a row without one
    takes no room. A sequence's rows are in row order. Multi-turn rows are padded to the
    batch's longest, so two or more usually share a sequence; run each token at its own rotary
    position, seeing its own row alone (`update.packed_forward`), they give each row's own
    numbers in `bins` of the N sequences."""
    N, T = loss_mask.shape
    length = jnp.max(jnp.where(loss_mask, jnp.arange(1, T + 1), 0), axis=1).astype(jnp.int32)
    count = jnp.sum(loss_mask, axis=1, dtype=jnp.int32)

    def place(carry, x):
        fill, held = carry  # [N] each: a sequence's tokens and reply tokens so far
        n, c = x
        b = jnp.argmax((fill + n <= T) & ((held + c <= replies) | (held == 0)))
        at = b * T + fill[b]
        return (fill.at[b].add(n), held.at[b].add(c)), jnp.where(n > 0, at, N * T)

    zero = jnp.zeros(N, jnp.int32)
    (fill, _), start = jax.lax.scan(place, (zero, zero), (length, count))
    order = jnp.argsort(start, stable=True)  # the rows by where they start
    slot = jnp.arange(N * T, dtype=jnp.int32).reshape(N, T)
    row = order[jnp.clip(jnp.searchsorted(start[order], slot, side="right") - 1, 0, N - 1)]
    at = slot - start[row]  # the slot's place in its row
    inside = (at >= 0) & (at < length[row])
    return RowPlan(start, length, jnp.sum(fill > 0), row, jnp.clip(at, 0, T - 1), inside)


def pack(x, plan: RowPlan):
    """A per-token array [N,T] of rows in `plan`'s sequences (empty slots: any value)."""
    return None if x is None else x[plan.row, plan.at]


def unpack(y, plan: RowPlan):
    """A per-token array [N,T] of `plan`'s sequences back in rows (0 past a row's length)."""
    N, T = y.shape
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    flat = jnp.clip(plan.start[:, None] + t, 0, N * T - 1)
    return jnp.where(t < plan.length[:, None], y.reshape(-1)[flat], jnp.zeros((), y.dtype))


def packed_tokens(plan: RowPlan, tokens, valid, loss_mask):
    """(tokens, valid, rotary positions, loss mask) of rows in `plan`'s sequences; the empty
    slots hold no valid or loss token."""
    return (jnp.where(plan.inside, pack(tokens, plan), 0), pack(valid, plan) & plan.inside,
            pack(model_lib.row_positions(valid), plan), pack(loss_mask, plan) & plan.inside)


def packed_replies(algo: AlgoConfig, T: int) -> int:
    """Reply tokens a packed sequence holds at most (`row_plan`): a row's
    (`update.head_positions`)."""
    return min(T, algo.max_turn * algo.response_length)


def packed_micro(micro: int) -> int:
    """Sequences per micro-batch of packed rows. On a CPU a quarter of `micro` rows (at least
    1), so that the micro-batches past the used sequences, which are skipped, save more; on an
    accelerator `micro`, as sized for its memory (a quarter would leave its kernels a quarter
    of the tokens each)."""
    return max(1, micro // 4) if precision.backend() == "cpu" else micro
