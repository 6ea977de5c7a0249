"""The update's state and its optimizers: `TrainState`, AdamW with its schedule, a fresh
state, where each part lives on a mesh, moving what sampling does not read off the accelerator,
and `jit_state_fn` (donate the trainable part alone; a LoRA base passes through)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from starpo import lora
from starpo import model as model_lib
from starpo import sharding
from starpo.model import ModelConfig
from starpo.algo import AlgoConfig


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
