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
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from starpo import advantages as adv_lib
from starpo import filtering, lora, losses, packing
from starpo import model as model_lib
from starpo import sharding
from starpo.model import ModelConfig
from starpo.run_config import AlgoConfig
from starpo.trajectory import Trajectory


# ----------------------------------------------------------------------------- state
@struct.dataclass
class TrainState:
    """Everything the update changes. Critic fields are None without a critic (grpo).

    step:          int32[]  rollout batches consumed (critic warm-up counts these)
    actor_steps:   int32[]  optimizer updates applied to the actor (the lr schedule's clock)
    critic_steps:  int32[]  the same for the critic
    """

    step: jax.Array
    actor_steps: jax.Array
    critic_steps: jax.Array
    actor_params: Any
    actor_opt_state: Any
    critic_params: Any
    critic_opt_state: Any


HOST, DEVICE = "pinned_host", "device"


def offload(state: TrainState, memory_kind: str, adapters: bool = False) -> TrainState:
    """`state` with what the actor's sampling does not read in `memory_kind` (`HOST`: the
    host's pinned memory, off the accelerator; `DEVICE`: back for the update): both AdamW
    moments and the critic's weights (`trainer.offload_state`). adapters: LoRA's, whose critic
    shares the frozen base with the actor, so only the moments move. The actor's weights stay.
    Copies, not new numbers: an update after a round trip is the update without one."""
    def move(tree):
        return jax.tree_util.tree_map(
            lambda x: jax.device_put(x, x.sharding.with_memory_kind(memory_kind)), tree)

    fields = ("actor_opt_state", "critic_opt_state") + (() if adapters else ("critic_params",))
    return state.replace(**{f: move(getattr(state, f)) for f in fields
                            if getattr(state, f) is not None})


def can_offload(device) -> bool:
    """Whether `device` has the host memory `offload` moves to."""
    return HOST in {m.kind for m in device.addressable_memories()}


def lr_schedule(lr: float, warmup_steps: int, decay_steps: int = 0, min_ratio: float = 0.0):
    """Linear warm-up to `lr` over `warmup_steps` optimizer updates (the first one uses
    lr / warmup_steps, not 0), then constant, or with `decay_steps` > 0 a cosine decay to
    `min_ratio * lr` over that many updates (then flat there)."""
    cosine = optax.cosine_decay_schedule(1.0, max(decay_steps, 1), alpha=min_ratio)

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        x = jnp.float32(lr)
        if warmup_steps > 0:
            x = x * jnp.minimum(1.0, (count + 1.0) / warmup_steps)
        if decay_steps > 0:
            x = x * cosine(jnp.maximum(count - warmup_steps, 0.0))
        return x
    return schedule


def algo_lr_schedule(lr: float, algo: "AlgoConfig"):
    return lr_schedule(lr, algo.warmup_steps, algo.lr_decay_steps, algo.min_lr_ratio)


def make_optimizer(lr: float, algo: AlgoConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with the warm-up / decay schedule."""
    return optax.chain(
        optax.clip_by_global_norm(algo.grad_clip),
        optax.adamw(algo_lr_schedule(lr, algo), b1=algo.adam_b1, b2=algo.adam_b2,
                    weight_decay=algo.weight_decay))


def init_train_state(algo: AlgoConfig, actor_params, critic_params=None) -> TrainState:
    """A fresh state. `critic_params` (a model with `value_head=True`) is required by gae and
    bi_level_gae and ignored by grpo. The update donates the state: the arrays passed in here
    are consumed by the first update (copy them first if they are needed afterwards)."""
    if algo.uses_critic and critic_params is None:
        raise ValueError(f"adv_estimator={algo.adv_estimator} needs critic_params")
    critic = critic_params if algo.uses_critic else None
    # three separate buffers: the state is donated, and one buffer cannot be donated twice
    return TrainState(
        step=jnp.zeros((), jnp.int32), actor_steps=jnp.zeros((), jnp.int32),
        critic_steps=jnp.zeros((), jnp.int32),
        actor_params=actor_params,
        actor_opt_state=make_optimizer(algo.actor_lr, algo).init(lora.split(actor_params)[0]),
        critic_params=critic,
        critic_opt_state=None if critic is None else make_optimizer(algo.critic_lr, algo).init(
            lora.split(critic)[0]))


def make_init(algo: AlgoConfig, state_shardings=None):
    """init(actor_params, critic_params=None) -> a fresh TrainState (`init_train_state`), placed
    by `state_shardings`: its trainable parameters fresh copies (the update donates them), its
    frozen ones (a LoRA base) the very buffers passed in."""
    out = None if state_shardings is None else split_state(state_shardings)[0]
    jitted = jax.jit(lambda actor, critic: init_train_state(algo, actor, critic),
                     out_shardings=out)

    def init(actor_params, critic_params=None):
        (a_t, a_f), (c_t, c_f) = lora.split(actor_params), lora.split(critic_params)
        return join_state(jitted(a_t, c_t), (a_f, c_f))
    return init


def split_state(state: TrainState):
    """(the state with only the trainable part of its parameters, their frozen part as
    (actor, critic)): without LoRA (the whole state, ({}, {} or None))."""
    (a_t, a_f), (c_t, c_f) = lora.split(state.actor_params), lora.split(state.critic_params)
    return state.replace(actor_params=a_t, critic_params=c_t), (a_f, c_f)


def join_state(state: TrainState, frozen) -> TrainState:
    """`split_state`'s inverse."""
    return state.replace(actor_params=lora.join(state.actor_params, frozen[0]),
                         critic_params=lora.join(state.critic_params, frozen[1]))


def _on_state(program, state, *args):
    """program(trainable, frozen, *args) called as fn(state, *args) is (`jit_state_fn`)."""
    trainable, frozen = split_state(state)
    new, out = program(trainable, frozen, *args)
    return join_state(new, frozen), out


class _Compiled:
    """A `jit_state_fn`'s compiled program, called as the function is: (state, *args); its
    other attributes (memory_analysis, as_text, ...) are XLA's program's."""

    def __init__(self, compiled):
        self.compiled = compiled

    def __call__(self, state, *args):
        return _on_state(self.compiled, state, *args)

    def __getattr__(self, name):
        return getattr(self.compiled, name)


class _Lowered:
    """A `jit_state_fn`'s lowered program, whose `compile()` is called with the whole state."""

    def __init__(self, lowered):
        self.lowered = lowered

    def compile(self, *args, **kwargs) -> _Compiled:
        return _Compiled(self.lowered.compile(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self.lowered, name)


def jit_state_fn(fn, out_shardings=None, **jit_kwargs):
    """jit(fn) for fn(state, *args) -> (state, out), donating the state's trainable part only:
    frozen weights go in undonated and the result holds the very same buffers (so the actor,
    its critic copy and a KL reference can share one copy of a LoRA base). `out_shardings`:
    (state shardings, out's). The result's `.lower(state, *args).compile()` is the program
    ahead of time, called with the same arguments as the result."""
    def inner(trainable, frozen, *args):
        state, out = fn(join_state(trainable, frozen), *args)
        return split_state(state)[0], out

    if out_shardings is not None:
        out_shardings = (split_state(out_shardings[0])[0], out_shardings[1])
    jitted = jax.jit(inner, donate_argnums=0, out_shardings=out_shardings, **jit_kwargs)

    def call(state, *args):
        return _on_state(jitted, state, *args)

    call.lower = lambda state, *args: _Lowered(jitted.lower(*split_state(state), *args))
    return call


@struct.dataclass
class Batch:
    """Kept rows, ready for PPO. All [N,T]; N = kept rows. Optional fields are None when unused.

    tokens int32, valid bool, loss_mask bool (model tokens, within valid), old_logprobs f32
    (training forward before the updates), ref_logprobs f32 | None, old_values f32 | None,
    advantages f32, returns f32, turns int32 | None (`Trajectory.window_turns`, under a
    context window), keep bool[N] | None (the rows of the top-p filter's kept groups; None: all).
    """

    tokens: jax.Array
    valid: jax.Array
    loss_mask: jax.Array
    old_logprobs: jax.Array
    ref_logprobs: jax.Array | None
    old_values: jax.Array | None
    advantages: jax.Array
    returns: jax.Array
    turns: jax.Array | None = None
    keep: jax.Array | None = None
    positions: jax.Array | None = None  # int[N,K] `reply_positions`: where the head runs
    # packed rows (`pack_rows`): each token's rotary position in its own row, `turns` its row
    # (of `segments` rows) and each row's tokens see their own row alone
    rotary: jax.Array | None = None
    segments: int = struct.field(pytree_node=False, default=0)
    # f32[N]: the in-group std of each row's group's normalised scores, what the filter ranks
    # by (RAGEN-2's `reward_std`; the gradient analysis buckets by it)
    group_std: jax.Array | None = None


def turn_window(algo: AlgoConfig, turns=None):
    """The `model.TurnWindow` of a batch's rows (turns [N,T]), or None without a window."""
    return model_lib.TurnWindow(turns, algo.context_window) if algo.context_window else None


def batch_window(algo: AlgoConfig, m: Batch):
    """The `model.TurnWindow` a (micro-)batch runs under: its rows' own (`turn_window`), or
    for packed rows (`pack_rows`) one that keeps each row to its own tokens."""
    if m.segments:
        return model_lib.TurnWindow(m.turns, 1, segments=True)
    return turn_window(algo, m.turns)


# ----------------------------------------------------------------------------- forward passes
def _shift_right(x: jax.Array) -> jax.Array:
    """[B,T-1] predictions made at positions 0..T-2 -> [B,T] aligned with the token they
    predict (position 0 has no prediction: 0)."""
    return jnp.pad(x, ((0, 0), (1, 0)))


def token_logprobs(params, cfg: ModelConfig, tokens, valid, chunk: int = 0,
                   temperature: float = 1.0, window=None, positions=None, share: int = 1,
                   rotary=None):
    """Log-prob and entropy f32[B,T] of each token under the model's distribution at
    `temperature` (the one the sampler drew from), aligned with the token; window: the
    rollout's `model.TurnWindow` over the rows, or None; positions, share, rotary: see
    `per_token`.

    With `chunk` > 0 the output head runs over `chunk` positions at a time with its logits
    rematerialised in the backward pass, so f32 logits [B,T,V] never exist at once.
    """
    def head(logits, y):
        if temperature != 1.0:
            logits = logits / temperature
        return losses.logprobs_and_entropy(logits, y)

    return per_token(params, cfg, tokens, valid, head, chunk, window, positions, share, rotary)


def per_token(params, cfg: ModelConfig, tokens, valid, fn, chunk: int = 0, window=None,
              positions=None, share: int = 1, rotary=None):
    """fn(logits [B,n,V], targets int[B,n]) -> a tuple of [B,n] arrays, run on the logits
    that predict each token and aligned with the token (position 0: 0); with `chunk` > 0,
    over `chunk` positions at a time, rematerialised in the backward pass.

    positions: int[B,K] (`reply_positions`): the head runs at those positions alone (a row's
    reply tokens; 0 = none) and every other position's output is 0 (False). The head (the
    vocabulary's logits and their softmax) is then paid for K positions a row, not T: with
    SmolLM2's 49k vocabulary it is ~a fifth of a forward at every position.

    share > 1 (with positions; no window): the rows are single-turn episodes in groups of
    `share` consecutive rows with one prompt, each row's reply contiguous right after it
    (`Rollout.share`'s batches): the prompt runs once per group (`packed_hidden`).

    rotary: int[B,T] each token's rotary position where a row holds several sequences
    (`pack_rows`); None: the valid tokens before it."""
    tokens = sharding.constrain(tokens, ("batch", "length"))
    if share > 1:
        if positions is None or window is not None:
            raise ValueError("a shared prompt needs the reply positions and no context window")
        h = packed_hidden(params, cfg, tokens, valid, positions, share)
    else:
        hidden, _ = model_lib.hidden_states(params, cfg, tokens, valid, window=window,
                                            positions=rotary)
        h = (hidden[:, :-1] if positions is None  # logits at t-1 predict token t
             else jnp.take_along_axis(hidden, jnp.maximum(positions - 1, 0)[..., None], axis=1))
    targets = (tokens[:, 1:] if positions is None
               else jnp.take_along_axis(tokens, positions, axis=1))

    def head(params, h, y):
        return fn(model_lib.head_logits(params, cfg, h), y)

    B, n, D = h.shape
    if chunk <= 0 or chunk >= n:
        out = head(params, h, targets)
    else:
        count = -(-n // chunk)
        pad = count * chunk - n
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(B, count, chunk, D).swapaxes(0, 1)
        y = jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, count, chunk).swapaxes(0, 1)
        one = jax.checkpoint(head)
        out = jax.lax.map(lambda xs: one(params, *xs), (h, y))  # [count,B,chunk] each
        out = tuple(x.swapaxes(0, 1).reshape(B, -1)[:, :n] for x in out)
    if positions is None:
        return tuple(_shift_right(x) for x in out)
    # back to [B,T]: the unused slots (position 0) write to a column past the end, dropped
    T = tokens.shape[1]
    rows = jnp.arange(B)[:, None]
    at = jnp.where(positions > 0, positions, T)
    return tuple(jnp.zeros((B, T + 1), x.dtype).at[rows, at].set(x)[:, :T] for x in out)


def packed_hidden(params, cfg: ModelConfig, tokens, valid, positions, share: int):
    """The hidden states [B,K,D] that predict each row's reply tokens at `positions` [B,K]
    (`reply_positions`), for single-turn rows in groups of `share` consecutive rows that hold
    one prompt, each row's reply (at most K tokens) right after it. Each group is one packed
    sequence: the prompt once, then its rows' replies in blocks of K slots, every reply token
    at its own rotary position and, through a context window of one turn (`model.TurnWindow`:
    the prompt is its prefix, reply i its turn i), seeing the prompt and its own reply alone:
    the same numbers as each row's own forward (tests/test_update.py), for a group's prompt
    plus G replies of tokens instead of G prompts and replies."""
    B, T = tokens.shape
    K, G = positions.shape[1], share
    n = B // G
    lead = jnp.arange(n) * G
    # a group's prompt ends where its replies start (the same slot in every row with one)
    start = jnp.max(positions[:, 0].reshape(n, G), axis=1)  # [n]; 0: no row replied
    Tp = T + (G - 1) * K
    s = jnp.arange(Tp)[None, :]
    in_prompt = s < start[:, None]
    block = jnp.clip((s - start[:, None]) // K, 0, G - 1)
    src_row = jnp.where(in_prompt, lead[:, None], lead[:, None] + block)
    src_slot = jnp.where(in_prompt, s, start[:, None] + (s - start[:, None]) % K)
    inside = (s < start[:, None] + G * K) & (src_slot < T)
    src_slot = jnp.minimum(src_slot, T - 1)
    row_pos = model_lib.row_positions(valid)
    p_tokens = tokens[src_row, src_slot]
    p_valid = valid[src_row, src_slot] & inside
    p_pos = row_pos[src_row, src_slot]
    turns = jnp.where(in_prompt, model_lib.PREFIX_TURN, block).astype(jnp.int32)
    hidden, _ = model_lib.hidden_states(params, cfg, p_tokens, p_valid,
                                        window=model_lib.TurnWindow(turns, 1),
                                        positions=p_pos)  # [n,Tp,D]
    # reply token j of row lead_g + i: predicted at the prompt's last slot (j = 0) or at the
    # slot of its reply token j - 1 in block i
    group = jnp.arange(B) // G
    i = jnp.arange(B) % G
    j = positions - start[group][:, None]  # [B,K]
    at = jnp.where(j <= 0, start[group][:, None] - 1,
                   start[group][:, None] + i[:, None] * K + j - 1)
    return hidden[group[:, None], jnp.clip(at, 0, Tp - 1)]


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


def reply_count(loss_mask) -> int:
    """The K of `reply_positions` for a batch (host side): its longest row's reply tokens,
    rounded up to a power of two (at least 8) so that a run compiles few distinct Ks."""
    n = int(np.asarray(sharding.to_host(jnp.sum(loss_mask, axis=1))).max(initial=0))
    return max(8, 1 << max(n - 1, 0).bit_length())


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
    return _micro_map(fn, share_micro(micro, share, N), positions, *rows)


def share_micro(micro: int, share: int, rows: int) -> int:
    """Rows per micro-batch of packed groups of `share` rows, of a batch of `rows` rows: whole
    groups, as many as fit in `micro` rows (at least one) and divide the batch's groups."""
    groups = rows // share
    return share * max(d for d in range(1, max(1, micro // share) + 1) if groups % d == 0)


def head_positions(algo: AlgoConfig, loss_mask):
    """`reply_positions` of an RL batch's rows (in a trace; T static), or None where the head
    runs everywhere: a row holds at most max_turn x response_length sampled tokens (the
    sampler's budget a turn), so where the context is longer the head skips the rest. No
    extra compile: the bound is the run's, not the batch's."""
    size = algo.max_turn * algo.response_length
    return reply_positions(loss_mask, size) if 0 < size < loss_mask.shape[1] else None


@functools.partial(jax.jit, static_argnums=1)
def reply_positions(loss_mask, size: int):
    """int32[B,size]: each row's reply-token (loss_mask) positions in order, then 0s. A row
    with more than `size` reply tokens raises nothing: pick `size` with `reply_count`."""
    size = min(size, loss_mask.shape[1])
    pick = jax.vmap(lambda m: jnp.nonzero(m, size=size, fill_value=0)[0])
    return pick(loss_mask).astype(jnp.int32)


def token_values(params, cfg: ModelConfig, tokens, valid, window=None, rotary=None):
    """Critic values f32[B,T]: V of the state before each token (hidden state at t-1); the
    critic sees the context the actor saw (window: a `model.TurnWindow` or None; rotary: see
    `per_token`)."""
    tokens = sharding.constrain(tokens, ("batch", "length"))
    hidden, _ = model_lib.hidden_states(params, cfg, tokens, valid, window=window,
                                        positions=rotary)
    return _shift_right(model_lib.head_values(params, cfg, hidden[:, :-1]))


def micro_split(tree, micro: int):
    """[N,...] leaves -> [N/micro, micro, ...]."""
    return jax.tree_util.tree_map(lambda x: x.reshape((-1, micro) + x.shape[1:]), tree)


def _micro_map(fn, micro: int, *arrays):
    """fn over micro-batches of the leading axis, results concatenated back to [N,...]."""
    out = jax.lax.map(lambda xs: fn(*xs), micro_split(arrays, micro))
    return jax.tree_util.tree_map(lambda x: x.reshape((-1,) + x.shape[2:]), out)


def _masked_stats(prefix: str, x, mask) -> dict:
    n = jnp.maximum(mask.sum(), 1)
    return {f"{prefix}/mean": jnp.where(mask, x, 0.0).sum() / n,
            f"{prefix}/max": jnp.where(mask, x, -jnp.inf).max(),
            f"{prefix}/min": jnp.where(mask, x, jnp.inf).min()}


def _micro_size(algo: AlgoConfig, rows: int) -> int:
    micro = min(algo.micro_batch_size, rows)
    if rows % micro:
        raise ValueError(f"{rows} rows are not a multiple of micro_batch_size {micro}")
    return micro


# ----------------------------------------------------------------------------- prepare
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
    metrics.update(_masked_stats("critic/advantages", advantages, mask))
    metrics.update(_masked_stats("critic/returns", returns, mask))
    if values is not None:
        metrics.update(_masked_stats("critic/values", values, mask))
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


def _score(algo: AlgoConfig, traj: Trajectory):
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
        values = _micro_map(lambda t, v, *turns: token_values(
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
        score, overlong = _score(algo, traj)
        key = adv_lib.grouping_key(algo.reward_norm_grouping, traj.group_id, traj.tag)
        normalised, scale = adv_lib.normalize_scores(score, key, algo.reward_norm_method)
        traj, normalised, scale, score, keep, metrics = _filter(algo, traj, normalised, scale,
                                                                score)
        if overlong is not None:
            metrics["critic/overlong_penalty/mean"] = overlong.mean()
        N = traj.tokens.shape[0]
        valid = traj.valid
        mask = traj.loss_mask & valid & keep[:, None]
        micro = _micro_size(algo, N)
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


# ----------------------------------------------------------------------------- gradients
def _actor_loss(algo: AlgoConfig, actor_cfg: ModelConfig, params, m: Batch, num_tokens,
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


def _critic_loss(algo: AlgoConfig, critic_cfg: ModelConfig, params, m: Batch, num_tokens,
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
    actor_vg = lora.value_and_grad(functools.partial(_actor_loss, algo, actor_cfg), has_aux=True)
    critic_vg = lora.value_and_grad(functools.partial(_critic_loss, algo, critic_cfg),
                                    has_aux=True)

    def zeros(params, names):
        """The accumulator's start: zero grads and zero sum-form stats (built from known
        structure rather than by tracing the model once more)."""
        return (jax.tree_util.tree_map(jnp.zeros_like, lora.split(params)[0]),
                {name: jnp.zeros((), jnp.float32) for name in names})

    def grads(actor_params, critic_params, mb: Batch, share: int = 1):
        num_tokens, num_seqs = losses.denominators(mb.loss_mask)
        rows = mb.tokens.shape[0]
        micro = _micro_size(algo, rows)
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


# ----------------------------------------------------------------------------- the update
def num_updates(algo: AlgoConfig, rows: int) -> tuple[int, int]:
    """(mini-batch size, k) for `rows` kept rows: k optimizer updates per rollout batch.

    k = online_k when set, else ppo_epochs * (rows // mini-batch size). Mini-batches are drawn
    from a fresh permutation of the rows each epoch (`shuffle_mini_batches`; else the rows in
    order); rows beyond a whole number of mini-batches sit that epoch out.
    """
    mini = min(algo.ppo_mini_batch_size, rows)
    per_epoch = rows // mini
    return mini, (algo.online_k if algo.online_k > 0 else algo.ppo_epochs * per_epoch)


def in_order(algo: AlgoConfig, rows: int) -> bool:
    """Whether the mini-batches of `rows` rows are the rows in order (`minibatch_order`):
    without `shuffle_mini_batches`, or where one mini-batch holds every row, whose order within
    it changes nothing but the float rounding of its micro-batches' sum."""
    return not algo.shuffle_mini_batches or min(algo.ppo_mini_batch_size, rows) == rows


def minibatch_order(algo: AlgoConfig, rows: int, key: jax.Array) -> jax.Array:
    """int32[k, mini]: the rows of each of the k mini-batches, a fresh permutation per epoch
    (or the rows in order every epoch, as verl splits them, where `in_order`)."""
    mini, k = num_updates(algo, rows)
    per_epoch = rows // mini
    epochs = -(-k // per_epoch)
    if not in_order(algo, rows):
        perms = jax.vmap(lambda kk: jax.random.permutation(kk, rows))(
            jax.random.split(key, epochs))
    else:
        perms = jnp.tile(jnp.arange(rows, dtype=jnp.int32), (epochs, 1))
    return perms[:, :per_epoch * mini].reshape(epochs * per_epoch, mini)[:k]


def adjusted_size(kept, groups: int, mini: int, mode: str = "copy"):
    """RAGEN-2's `adjust_batch`: a batch of `kept` rows grows by copies of its own rows to the
    next multiple of lcm(env_groups, ppo_mini_batch_size) (mode "copy"), or loses rows down to
    the multiple below (mode "delete"); its third factor, the GPU count, is 1 here: the mesh
    splits each mini-batch. Python or traced ints."""
    step = math.lcm(groups, mini)
    if mode == "delete":
        return kept // step * step
    return (kept + step - 1) // step * step


def kept_minibatch_order(algo: AlgoConfig, keep: jax.Array, groups: int, key: jax.Array):
    """(order int32[k, mini], real bool[k]): RAGEN-2's mini-batches of a filtered batch in a
    static shape. The n kept rows (`keep` bool[N]) alone form the batch, grown by copies of
    random kept rows to `adjusted_size` n' (copies drawn once, without replacement where n'-n
    <= n, as the reference), or under `batch_adjust_mode="delete"` cut to n' by dropping n-n'
    random kept rows; each epoch takes n' / mini mini-batches of a fresh permutation of those
    n' rows (without `shuffle_mini_batches`: the n' rows in order, the kept rows in row order
    then the copies). k = ppo_epochs x the most mini-batches any n can need; the ones past
    n' / mini in each epoch are not real: the update computes but never applies them (exact
    no-ops)."""
    N = keep.shape[0]
    mini = min(algo.ppo_mini_batch_size, N)
    cap = adjusted_size(N, groups, mini)  # slots of the largest adjusted batch
    slots = cap // mini
    k = algo.online_k if algo.online_k > 0 else algo.ppo_epochs * slots
    n = keep.sum()
    n_adj = jnp.minimum(adjusted_size(n, groups, mini, algo.batch_adjust_mode), cap)
    key, k_perm, k_draw = jax.random.split(key, 3)
    kept_rows = jnp.argsort(~keep, stable=True)  # the kept rows first, in row order
    i = jnp.arange(cap)
    # a random order of the kept rows: the copies are its first n'-n (or n'-n draws with
    # replacement), the deleted rows its first n-n'
    shuffled = kept_rows[jnp.argsort(jnp.where(jnp.arange(N) < n,
                                               jax.random.uniform(k_perm, (N,)), 2.0))]
    if algo.batch_adjust_mode == "delete":
        gone = jnp.zeros(N, bool).at[shuffled].set(jnp.arange(N) < n - n_adj)
        left = jnp.argsort(~(keep & ~gone), stable=True)  # the rest, in row order
        adjusted = left[jnp.clip(i, 0, N - 1)]  # [cap], n_adj real
    else:
        drawn = kept_rows[jax.random.randint(k_draw, (cap,), 0, jnp.maximum(n, 1))]
        copies = jnp.where(n_adj - n <= n, shuffled[jnp.clip(i - n, 0, N - 1)], drawn)
        adjusted = jnp.where(i < n, kept_rows[jnp.clip(i, 0, N - 1)], copies)  # n_adj real

    def epoch(kk):
        if not algo.shuffle_mini_batches:
            return adjusted
        return adjusted[jnp.argsort(jnp.where(i < n_adj, jax.random.uniform(kk, (cap,)), 2.0))]

    epochs = -(-k // slots)
    order = jax.vmap(epoch)(jax.random.split(key, epochs)).reshape(epochs * slots, mini)[:k]
    real = jnp.tile(jnp.arange(slots) < n_adj // mini, epochs)[:k]
    return order.astype(jnp.int32), real


def _apply(tx, params, opt_state, grads, apply):
    """One optimizer step of the trainable parameters, applied only where `apply` (bool[])
    holds; frozen ones come back untouched."""
    train, frozen = lora.split(params)
    updates, new_opt_state = tx.update(grads, opt_state, train)
    new_params = optax.apply_updates(train, updates)
    pick = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(apply, a, b), new, old)
    return lora.join(pick(new_params, train), frozen), pick(new_opt_state, opt_state)


def plain_split(algo: AlgoConfig, rows: int, groups: int) -> bool:
    """Whether the mini-batches of `rows` kept rows, of a rollout of `groups` groups, are those
    rows alone (`minibatch_order`): no top-p mask (the batch holds only kept rows) and no
    copies to grow it (`adjusted_size`); else `kept_minibatch_order`'s plan."""
    mini = min(algo.ppo_mini_batch_size, rows)
    return (not algo.masks_rows
            and adjusted_size(rows, groups, mini) == rows)


def _minibatch_plan(algo: AlgoConfig, batch: Batch, traj: Trajectory, key: jax.Array):
    """(order [k, mini] of row indices, real bool[k]): the mini-batches of one update, those
    past the kept rows (a masking filter, or a batch RAGEN-2 would grow by copies) marked not
    real."""
    rows_in = batch.tokens.shape[0]
    groups = traj.tokens.shape[0] // algo.group_size  # the rollout's, before the filter
    if plain_split(algo, rows_in, groups):
        order = minibatch_order(algo, rows_in, key)  # [k, mini]
        return order, jnp.ones(order.shape[0], bool)
    keep = jnp.ones(rows_in, bool) if batch.keep is None else batch.keep
    return kept_minibatch_order(algo, keep, groups, key)


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
        actor_g, critic_g, m = grads_fn(state.actor_params, state.critic_params, mb,
                                        share)  # a new dict
        some = mb.loss_mask.any() & is_real  # a mini-batch past the kept rows has nothing
        state = _actor_step(actor_tx, actor_lr, state, actor_g, m, train_actor & is_real,
                            train_actor & some)
        if algo.uses_critic:
            state = _critic_step(critic_tx, critic_lr, state, critic_g, m, is_real, some)
        return split_state(state)[0], m

    return one_update


def _actor_step(tx, lr, state: TrainState, grads, m: dict, due, apply_if_ok) -> TrainState:
    """The actor's AdamW step of one mini-batch, taken where `apply_if_ok` and its loss and
    gradients are finite (a non-finite one is counted where `due`); its metrics into `m`."""
    norm = optax.global_norm(grads)
    ok = jnp.isfinite(norm) & jnp.isfinite(m["actor/loss"])
    m["actor/grad_norm"] = norm
    m["actor/lr"] = lr(state.actor_steps)
    m["actor/nonfinite_skipped"] = (due & ~ok).astype(jnp.float32)
    m["actor/online_k"] = (apply_if_ok & ok).astype(jnp.float32)
    apply = apply_if_ok & ok
    params, opt_state = _apply(tx, state.actor_params, state.actor_opt_state, grads, apply)
    return state.replace(actor_params=params, actor_opt_state=opt_state,
                         actor_steps=state.actor_steps + apply)


def _critic_step(tx, lr, state: TrainState, grads, m: dict, is_real, some) -> TrainState:
    """The critic's AdamW step of one mini-batch (as `_actor_step`, with no warm-up)."""
    norm = optax.global_norm(grads)
    ok = jnp.isfinite(norm) & jnp.isfinite(m["critic/vf_loss"])
    m["critic/grad_norm"] = norm
    m["critic/lr"] = lr(state.critic_steps)
    m["critic/nonfinite_skipped"] = (~ok & is_real).astype(jnp.float32)
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
        order, real = _minibatch_plan(algo, batch, traj, key)
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


def state_shardings(algo: AlgoConfig, mesh, actor_cfg: ModelConfig,
                    critic_cfg: ModelConfig | None = None) -> TrainState:
    """Where each part of a TrainState lives on `mesh`: parameters by the sharding rules,
    Adam moments like their parameters, counters replicated."""
    actor = model_lib.param_shardings(actor_cfg, mesh)
    critic = model_lib.param_shardings(critic_cfg, mesh) if algo.uses_critic else None
    abstract = jax.eval_shape(
        lambda a, c: init_train_state(algo, a, c), model_lib.abstract_params(actor_cfg),
        model_lib.abstract_params(critic_cfg) if critic else None)
    opt = lambda lr, params, sh: sharding.optimizer_shardings(  # noqa: E731
        make_optimizer(lr, algo), params, lora.split(sh)[0], mesh)
    rep = sharding.replicated(mesh)
    return TrainState(
        step=rep, actor_steps=rep, critic_steps=rep, actor_params=actor,
        actor_opt_state=opt(algo.actor_lr, abstract.actor_opt_state, actor),
        critic_params=critic,
        critic_opt_state=None if critic is None else opt(algo.critic_lr,
                                                         abstract.critic_opt_state, critic))
