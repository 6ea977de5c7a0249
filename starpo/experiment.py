"""What a run builds once from its config: the policy (with LoRA adapters, `init_from`'s
weights), the critic, the training rollout, the update and the validation sets, on the mesh.

    exp = experiment.build(run_config.read(config))   # an `Experiment`: compiled once
    state = experiment.initial_train_state(exp)
    scalars = experiment.validate(exp, state.actor_params)

Both phases start here: RL (`training.py`) steps `exp.run_rollout` and `exp.update`, SFT
(`sft.py`) its demonstrations on `exp.env`; evaluation loads a saved run with `load_run`.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp

from starpo import checkpoint as ckpt_lib
from starpo import config_check, evaluate, harness, lora
from starpo import model as model_lib
from starpo import rollout as rollout_lib
from starpo import run_config, sharding, weights
from starpo import update as update_lib
from starpo.precision import phase_dtypes

FAST_COMPILE = {"xla_backend_optimization_level": 0}


def with_adapters(config, model: weights.LoadedModel, salt: int = 0) -> weights.LoadedModel:
    """`model` with fresh LoRA adapters where model.lora is on (drawn from the seed and `salt`),
    its base weights stored in the update's dtype; else `model` itself."""
    settings = run_config.lora_settings(config)
    if settings is None:
        return model
    key = jax.random.fold_in(jax.random.key(config.seed), 2**30 + salt)
    cfg, params = lora.attach(model.cfg, model.params, **settings, key=key,
                              base_dtype=phase_dtypes(config)["update"])
    return dataclasses.replace(model, cfg=cfg, params=params)


def load_actor(directory: str, step: int | None, params):
    """The actor weights of checkpoint `step` (None: the latest) in `directory`, shaped like
    `params`. A LoRA run's checkpoints hold its adapters alone: the frozen base is `params`'."""
    train, frozen = lora.split(params)
    return lora.join(ckpt_lib.load_params(directory, step, jax.eval_shape(lambda p: p, train)),
                     frozen)


def load_policy(config, init_from: bool = True) -> weights.LoadedModel:
    """The config's model (with LoRA adapters where model.lora is on); with `init_from` and
    `model.init_from` set, with that run's actor weights."""
    m = config.model
    kwargs = dict(dtype=run_config.model_dtype(config), remat=m.remat,
                  remat_policy=m.remat_policy, attention=m.attention,
                  decode_attention=m.decode_attention)
    if m.path == "tiny" or m.path.startswith("tiny:"):
        kwargs["tiny_corpus"], kwargs["tiny_tokenizer"] = run_config.tiny_tokenizer_args(config)
    policy = with_adapters(config, weights.load_model(m.path, **kwargs))
    if init_from and m.init_from:
        workdir, step = run_config.init_source(config)
        params = load_actor(os.path.join(workdir, "checkpoints"), step, policy.params)
        policy = dataclasses.replace(policy, params=params, source=f"{workdir}@{step}")
    return policy


def critic_params_from(config, actor: weights.LoadedModel):
    """(critic cfg, params): a value-head copy of the actor (the reference), or
    model.critic_path."""
    if config.model.critic_path:
        c = weights.load_model(config.model.critic_path, dtype=phase_dtypes(config)["update"],
                               remat=config.model.remat, value_head=True,
                               remat_policy=config.model.remat_policy,
                               attention=config.model.attention)
        if c.cfg.vocab_size != actor.cfg.vocab_size:
            raise ValueError(f"critic {config.model.critic_path} has vocabulary "
                             f"{c.cfg.vocab_size}, the actor {actor.cfg.vocab_size}")
        c = with_adapters(config, c, salt=1)
        return c.cfg, c.params
    cfg = actor.cfg.replace(value_head=True, dtype=phase_dtypes(config)["update"])
    D = cfg.hidden_size
    # own buffers for what trains (the state is donated); a frozen LoRA base is shared
    train, frozen = lora.split(actor.params)
    params = lora.join(jax.tree_util.tree_map(jnp.array, train), frozen)
    params["value_head"] = {"kernel": jnp.zeros((D, 1), jnp.float32),
                            "bias": jnp.zeros((1,), jnp.float32)}
    return cfg, params


# ----------------------------------------------------------------------------- the experiment
@dataclasses.dataclass
class Experiment:
    """Everything a run builds once from its config."""

    run: run_config.RunSpec
    algo: run_config.AlgoConfig
    policy: weights.LoadedModel
    critic_cfg: object
    env: object  # the env called env.name
    mix: tuple  # ((tag, groups), ...): the env variants of a training batch (`env_mix`)
    rollout: rollout_lib.Rollout  # of one chunk of rollout.batch_size episodes
    # run_from(params, key, env_state, group_id, temperature) of the whole batch (played
    # chunk by chunk: `rollout_lib.play_in_chunks`) and jitted (key, seed) ->
    # (env_state, group_id); env_state of a mixed batch: a tuple with one state per env
    run_rollout: object
    initial_states: object
    update: object
    val_sets: dict
    compiler_options: dict | None
    critic_params: object = None  # the critic's initial weights (None without a critic)
    mesh: object = None  # the device mesh everything runs on (trace under jax.set_mesh(mesh))
    state_shardings: object = None  # TrainState of NamedShardings: where the state lives
    init_state: object = None  # jitted (actor, critic params) -> TrainState on the mesh
    run_chunk: object = None  # jitted run_from of one chunk (what run_rollout calls)


def build(run: run_config.RunSpec, policy: weights.LoadedModel | None = None) -> Experiment:
    """Model, envs, the training rollout, the update and the validation sets of a run (a
    `run_config.read`; a ConfigDict is checked and read here)."""
    if not isinstance(run, run_config.RunSpec):
        config_check.check(run)
        run = run_config.read(run)
    algo, update_dtype = run.algo, run.model.dtypes["update"]
    env = run.envs[run.config.env.name]
    mesh = sharding.make_mesh(*run.mesh)
    policy = policy or load_policy(run.config)
    model_lib.check_kernels(policy.cfg.replace(dtype=update_dtype))
    policy = on_mesh(policy, mesh)
    options = compiler_options(run)
    train_env, ro, initial_states, run_chunk, run_rollout = _training_rollout(
        run, policy, mesh, options)
    critic_cfg, critic_params = critic_params_from(run.config, policy) if algo.uses_critic else (
        None, None)
    state_shardings = update_lib.state_shardings(algo, mesh, policy.cfg, critic_cfg)
    update_cfg = policy.cfg.replace(dtype=update_dtype)
    update = update_lib.make_update(algo, update_cfg, critic_cfg, compiler_options=options,
                                     state_shardings=state_shardings, mesh=mesh)
    # a fresh state is created in place on the mesh: Adam moments born sharded like weights
    init_state = update_lib.make_init(algo, state_shardings)

    v = run.val.batch
    val_sets = eval_sets(run, policy, mesh, run.val.tags, env_groups=v.env_groups,
                         group_size=v.group_size, batch_size=v.chunk, training=(ro, run_chunk))
    return Experiment(run, algo, policy, critic_cfg, env, run.mix, ro, run_rollout, initial_states,
                      update, val_sets, options, critic_params, mesh, state_shardings,
                      init_state, run_chunk)


def on_mesh(policy: weights.LoadedModel, mesh) -> weights.LoadedModel:
    """`policy` with its weights on `mesh` as a run places them (each device receives only its
    slice)."""
    return dataclasses.replace(policy, params=sharding.put(
        policy.params, model_lib.param_shardings(policy.cfg, mesh)))


def compiler_options(run: run_config.RunSpec) -> dict | None:
    """The XLA options of a run's programs (`trainer.fast_compile`)."""
    return FAST_COMPILE if run.trainer.fast_compile else None


def eval_sets(run: run_config.RunSpec, policy: weights.LoadedModel, mesh, tags, *,
              env_groups: int, group_size: int, batch_size: int, training=None) -> dict:
    """{tag: EvalSet} of held-out levels played as the run's validation plays them: on `mesh`
    (the levels' rows split over it, `policy` placed by `on_mesh`), with the run's rollout
    settings and compiler options; where the run's validation of a tag plays on the training
    batch's program (`_plays_on_training_program`) and the set has the validation's size, on
    that program too. So `launch/eval.py` of a run's checkpoint traces the programs the run's
    validation compiled, which JAX's persistent cache then serves. training: the run's
    (Rollout, jitted run_chunk), where built already. Play under `jax.set_mesh(mesh)`."""
    v = run.val.batch
    chunk = rollout_lib.chunk_size(env_groups * group_size, batch_size, group_size)
    # a validation chunk of the training env and size plays on the training's program
    shares = {tag for tag in tags if (env_groups, group_size, chunk) == (
        v.env_groups, v.group_size, v.chunk) and _plays_on_training_program(run, tag)}
    if shares and training is None:
        _, ro, _, run_chunk, _ = _training_rollout(run, policy, mesh, compiler_options(run))
        training = (ro, run_chunk)
    out = {}
    for tag in tags:
        same = tag in shares
        env = run.envs[tag] if tag in run.envs else run_config.make_env(run.config, tag)
        out[tag] = evaluate.make_eval_set(
            tag, env, policy.tokenizer, policy.cfg, env_groups=env_groups,
            group_size=group_size, spec=run.rollout,
            compiler_options=compiler_options(run), batch_size=chunk,
            rollout=training[0] if same else None, run_from=training[1] if same else None,
            rows_sharding=sharding.batch_sharding(mesh, env_groups * group_size))
    return out


def _plays_on_training_program(run: run_config.RunSpec, tag: str) -> bool:
    """Validation set `tag` is played by the training batch's compiled rollout: the same env
    (a one-env batch) and the same rows at once."""
    return (len(run.mix) == 1 and tag in run.envs and run.envs[tag] == run.envs[run.mix[0][0]]
            and run.val.batch.chunk == run.batch.chunk)


def _training_rollout(run: run_config.RunSpec, policy, mesh, options):
    """The training batch's rollout, played `rollout.batch_size` episodes at a time:
    (the env of a one-env batch or None, Rollout of one chunk, jitted (key, seed) -> the
    batch's levels, jitted program of one chunk, (params, key, env_state, group_id,
    temperature) -> the batch's (Trajectory, metrics))."""
    r, spec, mix = run.batch, run.rollout, run.mix
    B, chunk = r.episodes, r.chunk
    # A single-turn group's rows share one prompt (`Rollout.share`), unless a validation set
    # of groups too small for it plays on this program (one compile serves both: what a tiny
    # model's run gains more from)
    share_groups = not any(_plays_on_training_program(run, tag)
                           and run.val.batch.group_size % r.group_size
                           for tag in run.val.tags)
    # Levels are generated and episodes played where their rows live: every [B,...] output
    # (env states, trajectory, per-episode metrics) is split over the mesh's batch axes, and
    # nothing is fed from the host but seeds and keys.
    rows, chunk_rows = sharding.batch_sharding(mesh, B), sharding.batch_sharding(mesh, chunk)
    train_envs = tuple((run.envs[tag], groups) for tag, groups in mix)
    if len(mix) == 1:
        train_env = train_envs[0][0]
        ro = rollout_lib.make_rollout(train_env, policy.tokenizer, policy.cfg, spec,
                                      env_groups=chunk // r.group_size, group_size=r.group_size,
                                      share_groups=share_groups)
        initial_states = jax.jit(
            lambda key, seed: rollout_lib.initial_states(train_env, key, seed, rollout_lib.TRAIN,
                                                         r.env_groups, r.group_size),
            out_shardings=(rows, rows))
    else:  # played at once (config_check): no validation set shares a mixed batch's program
        train_env = None
        ro = rollout_lib.make_mixed_rollout(train_envs, policy.tokenizer, policy.cfg, spec,
                                            group_size=r.group_size, share_groups=share_groups)
        env_rows = tuple(sharding.batch_sharding(mesh, g * r.group_size) for _, g in mix)
        initial_states = jax.jit(
            lambda key, seed: rollout_lib.mixed_initial_states(train_envs, key, seed,
                                                               rollout_lib.TRAIN, r.group_size),
            out_shardings=(env_rows, rows))
    run_chunk = jax.jit(ro.play_from, compiler_options=options,
                        out_shardings=(chunk_rows, chunk_rows))
    run_rollout = rollout_lib.play_in_chunks(
        run_chunk, B, chunk, r.group_size,
        join=jax.jit(rollout_lib.concat_rows, out_shardings=(rows, rows)))
    return train_env, ro, initial_states, run_chunk, run_rollout


def initial_train_state(exp: Experiment) -> update_lib.TrainState:
    """A fresh TrainState holding its own copies of the initial weights (the update donates
    its state, and the experiment may start several runs), placed on the mesh."""
    return exp.init_state(exp.policy.params, exp.critic_params)


def frozen_params(exp: Experiment):
    """The frozen (LoRA base) part of the actor's and the critic's weights: what a checkpoint
    does not hold (`update.split_state`'s second half)."""
    return lora.split(exp.policy.params)[1], lora.split(exp.critic_params)[1]


def state_target(exp: Experiment):
    """The TrainState's shapes, dtypes and shardings (what a checkpoint restores into)."""
    return harness.restore_target(jax.eval_shape(lambda: initial_train_state(exp)),
                                  exp.state_shardings)


def with_actor(exp: Experiment, params) -> Experiment:
    """`exp` starting from the actor weights `params` (an SFT phase's): the critic, where it is
    a copy of the actor, copies these too."""
    policy = dataclasses.replace(exp.policy, params=params, source=f"{exp.policy.source}+sft")
    critic = exp.critic_params
    if exp.algo.uses_critic and not exp.run.model.critic_path:
        critic = sharding.put(critic_params_from(exp.run.config, policy)[1],
                              exp.state_shardings.critic_params)
    return dataclasses.replace(exp, policy=policy, critic_params=critic)


def val_key(seed: int):
    """The validations' sampling key: one per run, the same at every validation."""
    return jax.random.fold_in(jax.random.key(seed), 2**31 - 1)


# ----------------------------------------------------------------------------- validation
def validate(exp: Experiment, params, writer=None, step: int = 0) -> dict[str, float]:
    """Play every validation set at `val.temperature`; scalars named val/<tag>/<name>."""
    out = {}
    t0 = time.perf_counter()
    for tag, vs in exp.val_sets.items():
        traj, m = vs.play(params, val_key(exp.run.seed), exp.run.val.batch.temperature)
        for name, value in evaluate.summarize(traj, m, vs.group_size).items():
            out[f"val/{tag}/{name}"] = value
        if writer is not None:
            for row in range(min(exp.run.trainer.log_samples, traj.tokens.shape[0])):
                writer.text(step, f"val/{tag}/dialogue_{row}",
                            evaluate.dialogue(exp.policy.tokenizer, traj, row))
    out["timing/val"] = time.perf_counter() - t0
    return out


# ----------------------------------------------------------------------------- finished runs
def load_run(path: str, step: int | None = None):
    """(config, policy with the checkpoint's actor weights, step) of a saved run.

    `path`: a workdir (its latest checkpoint, or `step`), or a checkpoint folder in it."""
    workdir = run_config.find_run(path)
    if step is None and os.path.basename(os.path.normpath(path)).isdigit():
        step = int(os.path.basename(os.path.normpath(path)))
    config = run_config.saved_config(workdir)
    # its own checkpoint's weights replace them (a LoRA run's: the adapters, on the same base)
    policy = load_policy(config, init_from=False)
    if step is None:
        step = run_config.latest_step(workdir)
        if step is None:
            raise FileNotFoundError(f"{workdir} has no complete checkpoint")
    params = load_actor(os.path.join(workdir, "checkpoints"), step, policy.params)
    policy = dataclasses.replace(policy, params=params, source=f"{workdir}@{step}")
    return config, policy, step
