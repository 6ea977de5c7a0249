"""A training run: config -> model, rollouts, update -> the rollout/update loop with validation,
logging and checkpoints. `launch/train.py` is a thin command line around `train`.

One iteration (a "step") is

    levels (seed counter) -> rollout (jitted, on device) -> update (jitted: filter, old
    log-probs, advantages, k PPO updates) -> metrics (one host transfer) -> log / checkpoint

Determinism: every random number comes from the config's seed and the step number (rollout key
= fold_in(seed, step), training levels = seeds step * env_groups + g), so a run resumed from
a checkpoint at step s continues exactly as an uninterrupted one would. DAPO's dynamic sampling
(`algorithm.filter_groups_enable`) may play several batches a step: the seed counter then
advances by every batch played and is kept in the checkpoint.
Everything of a run lives in its workdir:

    <workdir>/config.json      the run's config (a resumed run must match it)
    <workdir>/checkpoints/     orbax checkpoints (params, optimiser states, step, seed counter)
    <workdir>/metrics.jsonl    one flat JSON object per logged step
    <workdir>/tb/              TensorBoard event files (scalars and sample dialogues)
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import envs
from starpo import checkpoint as ckpt_lib
from starpo import collapse as collapse_lib
from starpo import config_check
from starpo import dialogue
from starpo import evaluate
from starpo import memory
from starpo import filtering
from starpo import lora
from starpo import metrics as metrics_lib
from starpo import model as model_lib
from starpo import rollout as rollout_lib
from starpo import sharding
from starpo import update as update_lib
from starpo import weights
from starpo.precision import phase_dtypes
from starpo.trajectory import trimmed_length

FAST_COMPILE = {"xla_backend_optimization_level": 0}
# Fields a resumed run may change; any other difference means "this is a different run".
# A checkpoint restores onto any mesh, so the mesh may change too; the length the update's
# context is cut to changes only padding; decode windows, the remat policy and the attention
# kernels change only how the same numbers are computed; the validation chunk size changes
# only the memory and the validation's sampling stream (its levels stay; training is
# untouched). rollout.batch_size changes the training samples' stream, so a run resumed with
# another one is another run.
RESUMABLE_CHANGES = ("trainer.total_steps", "trainer.save_freq", "trainer.keep_checkpoints",
                     "trainer.log_samples", "trainer.stop_on_collapse", "val.test_freq",
                     "trainer.rollout_filter_empty_stop_steps", "algorithm.logit_chunk_size",
                     "val.before_train", "trainer.context_bucket", "rollout.decode_windows",
                     "model.remat_policy", "model.attention", "mesh.data", "mesh.fsdp",
                     "mesh.tensor", "mesh.distributed", "mesh.coordinator_address",
                     "mesh.num_processes", "mesh.process_id", "mesh.init_timeout_s",
                     "val.batch_size", "trainer.memory_check", "trainer.collapse_mi_freq",
                     "trainer.collapse_mi_samples", "trainer.collapse_mi_micro_batch",
                     "trainer.collapse_mi_warn", "mesh.heartbeat_timeout_s", "sft.test_freq",
                     "trainer.collapse_mi_multi_turn",
                     "sft.save_freq")
# Keys added after runs were saved: a run saved without one had the default.
ADDED_KEYS = {"env.mix": "", "algorithm.lr_decay_steps": 0, "algorithm.min_lr_ratio": 0.0,
              "rollout.batch_size": 0, "val.batch_size": 0, "trainer.memory_check": True,
              "model.attention": "auto", "mesh.coordinator_address": "",
              "mesh.num_processes": 0, "mesh.process_id": -1, "mesh.init_timeout_s": 300,
              "sft.steps": 0, "sft.env_groups": 32, "sft.lr": 1e-5, "sft.warmup_steps": 0,
              "sft.actions_per_turn": 0, "sft.test_freq": 10, "sft.save_freq": 10,
              "model.init_from": "",
              "rollout.context_window_mode": "full", "rollout.max_context_window": -1,
              "trainer.collapse_mi_freq": 0, "trainer.collapse_mi_samples": 64,
              "trainer.collapse_mi_micro_batch": 16, "trainer.collapse_mi_warn": 0.01,
              "mesh.heartbeat_timeout_s": 60, "algorithm.filter_groups_metric": "score",
              "algorithm.filter_loss_scaling": "none",
              "trainer.rollout_filter_empty_stop_steps": 0,
              "trainer.collapse_mi_multi_turn": False,
              # GiGPO's episode statistics ran over episodes before; a resumed GiGPO run
              # takes verl-agent's (over steps) from here on
              "algorithm.gigpo_episode_over_steps": True}


# ----------------------------------------------------------------------------- config
def enable_compilation_cache(directory: str | None = None) -> None:
    """Keep compiled programs on disk (JAX's persistent cache): a restarted or resumed run skips
    the minute of compiling a 135M model's rollout and update. JAX's own environment variables
    (JAX_COMPILATION_CACHE_DIR, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS), where set, win."""
    directory = (directory or os.environ.get("JAX_COMPILATION_CACHE_DIR")
                 or os.path.join(weights.cache_dir(), "jax"))
    jax.config.update("jax_compilation_cache_dir", directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)


def context_window(config) -> int:
    """The rollout's context window in turns (0 = the whole dialogue), from
    rollout.context_window_mode and rollout.max_context_window (runs saved before they existed
    had the whole dialogue)."""
    r = config.rollout
    return config_check.context_window(r.get("context_window_mode", "full"),
                                       r.get("max_context_window", -1))


def algo_config(config) -> update_lib.AlgoConfig:
    """The update's knobs: `config.algorithm` plus group size, temperature, reply budget and
    context window of the rollout."""
    return update_lib.AlgoConfig(**config.algorithm.to_dict(),
                                  group_size=config.rollout.group_size,
                                  temperature=config.rollout.temperature,
                                  response_length=config.rollout.response_length,
                                  context_window=context_window(config))


def rollout_spec(config) -> rollout_lib.RolloutSpec:
    r = config.rollout
    return rollout_lib.RolloutSpec(
        max_turn=r.max_turn, max_new_tokens=r.response_length, max_context=r.max_context,
        thinking=r.enable_think, top_k=r.top_k, top_p=r.top_p,
        max_actions_per_turn=r.max_actions_per_turn or None,
        max_actions_per_traj=r.max_actions_per_traj or None,
        prefill_dtype=phase_dtypes(config)["prefill"], decode_windows=r.get("decode_windows", 1),
        context_window=context_window(config))


def env_mix(config) -> tuple[tuple[str, int], ...]:
    """((tag, groups), ...): the env variants of a training batch and their group counts.

    `env.mix` = "SimpleSokoban:6,LargerSokoban:2" (counts summing to rollout.env_groups), or
    "" for all rollout.env_groups groups of env.name. Raises ValueError naming the problem."""
    text = config.env.get("mix", "")  # runs saved before the knob existed have none
    groups = config.rollout.env_groups
    if not text.strip():
        return ((config.env.name, groups),)
    tags, counts = [], []
    for item in text.split(","):
        tag, _, count = (x.strip() for x in item.partition(":"))
        if not tag or not count.isdigit() or int(count) < 1:
            raise ValueError(f"env.mix {text!r}: {item.strip()!r} is not TAG:GROUPS with "
                             f"GROUPS >= 1 (e.g. 'SimpleSokoban:6,LargerSokoban:2')")
        tags.append(tag)
        counts.append(int(count))
    try:
        tags = evaluate.parse_tags(",".join(tags), config.env.name)
    except ValueError as e:
        raise ValueError(f"env.mix {text!r}: {e}") from None
    if sum(counts) != groups:
        raise ValueError(f"env.mix {text!r}: the group counts sum to {sum(counts)}, "
                         f"rollout.env_groups is {groups}")
    return tuple(zip(tags, counts))


def make_env(config, tag: str):
    """The env of `tag`: the training env gets the config's options, other tags defaults."""
    options = config.env.options.to_dict() if tag == config.env.name else {}
    return envs.make(tag, **options)


def tiny_tokenizer_args(config) -> tuple[list[str], dict]:
    """(corpus, Tokenizer.tiny options) of a `tiny` model's in-process tokenizer: a compact BPE
    learned from the run's own dialogue text (every env it plays), with the long fixed template
    texts as whole tokens and whole answers such as `Left</answer>` as single tokens, so that a
    random-init model writes a valid answer with probability ~ actions / vocabulary per turn
    (with the 384-token byte-level default it is ~1e-4 and RL from scratch never starts)."""
    r = config.rollout
    settings = dict(max_turn=r.max_turn, max_new_tokens=r.response_length,
                    thinking=r.enable_think, max_actions_per_turn=r.max_actions_per_turn or None,
                    max_actions_per_traj=r.max_actions_per_traj or None)
    corpus, added = [], []
    tags = evaluate.parse_tags(config.val.tags, config.env.name) + (config.env.name,)
    for tag in tags + tuple(t for t, _ in env_mix(config) if t not in tags):
        env = make_env(config, tag)
        corpus += dialogue.dialogue_corpus(env, **settings)
        added += [t for t in dialogue.template_strings(env, **settings) if t not in added]
    return corpus, dict(split="none", alphabet="corpus", builtin_corpus=False,
                        added_tokens=tuple(added))


def model_dtype(config) -> str:
    """The model config's own dtype (the decode one; see `phase_dtypes`)."""
    return phase_dtypes(config)["decode"]


def lora_settings(config) -> dict | None:
    """model.lora as `lora.attach`'s keywords, or None where it is off (rank 0, or a run saved
    before the key existed)."""
    c = config.model.get("lora")
    if c is None or not c.rank:
        return None
    return dict(rank=c.rank, alpha=c.alpha, targets=c.target_modules)


def with_adapters(config, model: weights.LoadedModel, salt: int = 0) -> weights.LoadedModel:
    """`model` with fresh LoRA adapters where model.lora is on (drawn from the seed and `salt`),
    its base weights stored in the update's dtype; else `model` itself."""
    settings = lora_settings(config)
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
    kwargs = dict(dtype=model_dtype(config), remat=m.remat,
                  remat_policy=m.get("remat_policy", "full"), attention=m.get("attention", "auto"))
    if m.path == "tiny" or m.path.startswith("tiny:"):
        kwargs["tiny_corpus"], kwargs["tiny_tokenizer"] = tiny_tokenizer_args(config)
    policy = with_adapters(config, weights.load_model(m.path, **kwargs))
    if init_from and m.get("init_from", ""):
        workdir, step = init_source(config)
        params = load_actor(os.path.join(workdir, "checkpoints"), step, policy.params)
        policy = dataclasses.replace(policy, params=params, source=f"{workdir}@{step}")
    return policy


def init_source(config) -> tuple[str, int]:
    """(workdir, step) of `model.init_from`: a saved run of the same model.path (and, for a
    tiny model, the same dialogue: its tokenizer is learned from it). ValueError otherwise."""
    path = config.model.init_from
    try:
        workdir = find_run(path)
    except FileNotFoundError as e:
        raise ValueError(f"model.init_from: {e}") from None
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
        saved = config_from_json(f.read())
    if saved.model.path != config.model.path:
        raise ValueError(f"model.init_from {path} holds a run of model {saved.model.path!r}, "
                         f"this config's model.path is {config.model.path!r}")
    if config.model.path.startswith("tiny") and tiny_tokenizer_args(saved) != tiny_tokenizer_args(
            config):
        raise ValueError(f"model.init_from {path}: a tiny model's tokenizer comes from its "
                         f"run's dialogue, and that run's differs from this one's")
    base = os.path.basename(os.path.normpath(path))
    step = int(base) if base.isdigit() else None
    if step is None:
        reader = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
        step = reader.latest_step()
        reader.close()
    if step is None:
        raise ValueError(f"model.init_from {path}: the run has no complete checkpoint")
    return workdir, step


def critic_params_from(config, actor: weights.LoadedModel):
    """(critic cfg, params): a value-head copy of the actor (the reference), or model.critic_path."""
    if config.model.critic_path:
        c = weights.load_model(config.model.critic_path, dtype=phase_dtypes(config)["update"],
                               remat=config.model.remat, value_head=True,
                               remat_policy=config.model.get("remat_policy", "full"),
                               attention=config.model.get("attention", "auto"))
        if c.cfg.vocab_size != actor.cfg.vocab_size:
            raise ValueError(f"critic {config.model.critic_path} has vocabulary {c.cfg.vocab_size}, "
                             f"the actor {actor.cfg.vocab_size}")
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

    config: object
    algo: update_lib.AlgoConfig
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


def build(config, policy: weights.LoadedModel | None = None) -> Experiment:
    """Model, envs, the training rollout, the update and the validation sets of a config."""
    config_check.check(config)
    algo = algo_config(config)
    r = config.rollout
    mix = env_mix(config)
    env = make_env(config, config.env.name)
    tags = evaluate.parse_tags(config.val.tags, config.env.name)
    mesh = sharding.mesh_from_config(config.mesh)
    policy = policy or load_policy(config)
    model_lib.check_kernels(policy.cfg.replace(dtype=phase_dtypes(config)["update"]))
    # weights go straight to their shards (each device receives only its slice)
    policy = dataclasses.replace(policy, params=sharding.put(
        policy.params, model_lib.param_shardings(policy.cfg, mesh)))
    options = FAST_COMPILE if config.trainer.fast_compile else None
    spec = rollout_spec(config)
    train_env, ro, initial_states, run_chunk, run_rollout = _training_rollout(
        config, policy, spec, mix, mesh, options)
    critic_cfg, critic_params = critic_params_from(config, policy) if algo.uses_critic else (
        None, None)
    state_shardings = update_lib.state_shardings(algo, mesh, policy.cfg, critic_cfg)
    update_cfg = policy.cfg.replace(dtype=phase_dtypes(config)["update"])
    update = update_lib.make_update(algo, update_cfg, critic_cfg, compiler_options=options,
                                     state_shardings=state_shardings, mesh=mesh)
    # a fresh state is created in place on the mesh: Adam moments born sharded like weights
    init_state = update_lib.make_init(algo, state_shardings)

    val_sets = {}
    v = config.val
    val_chunk = batch_size(v)
    for tag in tags:
        venv = make_env(config, tag)
        # a validation chunk of the training env and size plays on the training's program
        same = venv == train_env and val_chunk == batch_size(r)
        val_sets[tag] = evaluate.make_eval_set(
            tag, venv, policy.tokenizer, policy.cfg, env_groups=v.env_groups,
            group_size=v.group_size, spec=spec, compiler_options=options,
            rollout=ro if same else None, run_from=run_chunk if same else None,
            batch_size=val_chunk)
    return Experiment(config, algo, policy, critic_cfg, env, mix, ro, run_rollout, initial_states,
                      update, val_sets, options, critic_params, mesh, state_shardings,
                      init_state, run_chunk)


def batch_size(part) -> int:
    """Episodes played at once of `config.rollout` or `config.val`: its `batch_size`, 0 (or a
    run saved before the key existed) meaning all env_groups x group_size (checked)."""
    return rollout_lib.chunk_size(part.env_groups * part.group_size, part.get("batch_size", 0),
                                  part.group_size)


def _training_rollout(config, policy, spec, mix, mesh, options):
    """The training batch's rollout, played `rollout.batch_size` episodes at a time:
    (the env of a one-env batch or None, Rollout of one chunk, jitted (key, seed) -> the
    batch's levels, jitted program of one chunk, (params, key, env_state, group_id,
    temperature) -> the batch's (Trajectory, metrics))."""
    r = config.rollout
    B, chunk = r.env_groups * r.group_size, batch_size(r)
    # Levels are generated and episodes played where their rows live: every [B,...] output
    # (env states, trajectory, per-episode metrics) is split over the mesh's batch axes, and
    # nothing is fed from the host but seeds and keys.
    rows, chunk_rows = sharding.batch_sharding(mesh, B), sharding.batch_sharding(mesh, chunk)
    train_envs = tuple((make_env(config, tag), groups) for tag, groups in mix)
    if len(mix) == 1:
        train_env = train_envs[0][0]
        ro = rollout_lib.make_rollout(train_env, policy.tokenizer, policy.cfg, spec,
                                      env_groups=chunk // r.group_size, group_size=r.group_size)
        initial_states = jax.jit(
            lambda key, seed: rollout_lib.initial_states(train_env, key, seed, rollout_lib.TRAIN,
                                                         r.env_groups, r.group_size),
            out_shardings=(rows, rows))
    else:  # played at once (config_check): no validation set shares a mixed batch's program
        train_env = None
        ro = rollout_lib.make_mixed_rollout(train_envs, policy.tokenizer, policy.cfg, spec,
                                            group_size=r.group_size)
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
    abstract = jax.eval_shape(lambda: initial_train_state(exp))
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
        exp.state_shardings)


def step_keys(seed: int, step: int):
    """(rollout key, mini-batch order key) of a step: from the seed and the step alone."""
    k = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.fold_in(k, 0), jax.random.fold_in(k, 1)


def val_key(seed: int):
    return jax.random.fold_in(jax.random.key(seed), 2**31 - 1)


# ----------------------------------------------------------------------------- one step
def validate(exp: Experiment, params, writer=None, step: int = 0) -> dict[str, float]:
    """Play every validation set at `val.temperature`; scalars named val/<tag>/<name>."""
    out = {}
    t0 = time.perf_counter()
    for tag, vs in exp.val_sets.items():
        traj, m = vs.play(params, val_key(exp.config.seed), exp.config.val.temperature)
        for name, value in evaluate.summarize(traj, m, vs.group_size).items():
            out[f"val/{tag}/{name}"] = value
        if writer is not None:
            for row in range(min(exp.config.trainer.log_samples, traj.tokens.shape[0])):
                writer.text(step, f"val/{tag}/dialogue_{row}",
                            evaluate.dialogue(exp.policy.tokenizer, traj, row))
    out["timing/val"] = time.perf_counter() - t0
    return out


def _gather_rows(parts, rows):
    """Rows `rows` of the row-wise concatenation of a list of pytrees of [B_i, ...] arrays."""
    return jax.tree_util.tree_map(lambda x: jnp.take(x, rows, axis=0),
                                  rollout_lib.concat_rows(parts))


_gather_rows_jit = jax.jit(_gather_rows)


def play_batch(exp: Experiment, params, key, seed_counter: int):
    """The training batch: ((traj, metrics), the seed counter after it, scalars).

    One rollout batch of levels seed_counter ..; with `algorithm.filter_groups_enable` (DAPO's
    dynamic sampling) more batches (next levels, key folded from `key`) until env_groups groups
    whose `algorithm.filter_groups_metric` differs (or of one episode) are found or
    filter_groups_max_num_gen_batches were played, the batch then filled as
    `filtering.fill_groups` says (same shapes whatever was found)."""
    c, algo = exp.config, exp.algo
    G, gs = c.rollout.env_groups, c.rollout.group_size
    played, kept = [], []
    while True:
        k = key if not played else jax.random.fold_in(jax.random.fold_in(key, 2**20), len(played))
        env_state, group_id = exp.initial_states(jax.random.key(c.seed), jnp.int32(seed_counter))
        seed_counter += G
        played.append(exp.run_rollout(params, k, env_state, group_id,
                                      jnp.float32(c.rollout.temperature)))
        if not algo.filter_groups_enable:
            return played[0], seed_counter, {}
        traj = played[-1][0]
        metric = traj.score if algo.filter_groups_metric == "score" else traj.success
        kept.append(filtering.nonzero_std_groups(sharding.to_host(metric), gs))
        found = int(sum(ks.sum() for ks in kept))
        if found >= G or len(played) >= algo.filter_groups_max_num_gen_batches:
            break
    chosen = filtering.fill_groups(kept, G)
    rows = np.concatenate([(b * G + g) * gs + np.arange(gs) for b, g in chosen]).astype(np.int32)
    used = max(b for b, _ in chosen) + 1
    batch = jax.device_put(_gather_rows_jit(played[:used], jnp.asarray(rows)),
                           sharding.batch_sharding(exp.mesh, G * gs))
    return batch, seed_counter, {"rollout/num_gen_batches": float(len(played)),
                                 "rollout/filter_groups_kept": float(min(found, G))}


def train_step(exp: Experiment, state, step: int, seed_counter: int | None = None,
               template=None, peaks: bool = False):
    """One rollout -> update iteration. Returns (state, scalars); scalars["env/seed_counter"]
    is the level seed counter after it (by default the step's batch starts at
    step * env_groups, as it does unless dynamic sampling played more batches).
    template: a `collapse.TemplateCollapse` (trainer.collapse_mi_freq > 0): on its steps the
    batch's collapse/ scalars, scored with the params that sampled it, before the update.
    peaks: also memory/rollout_peak_gb and memory/update_peak_gb, the device's measured peak
    so far after each (read where the step waits for them anyway; none on CPU)."""
    c = exp.config
    t0 = time.perf_counter()
    k_roll, k_update = step_keys(c.seed, step)
    if seed_counter is None:
        seed_counter = step * c.rollout.env_groups
    (traj, m), seed_counter, dyn = play_batch(exp, state.actor_params, k_roll, seed_counter)
    traj = jax.block_until_ready(traj)
    t1 = time.perf_counter()
    t_roll = t1 - t0
    measured = {"rollout": memory.device_peak()} if peaks else {}
    lengths = sharding.to_host(traj.length)  # [B]: the one host transfer before the update
    trained = trimmed_length(int(lengths.max()), traj.tokens.shape[1], c.trainer.context_bucket)
    diagnostic = {}
    if template is not None and template.due(step + 1):  # the update donates the params
        diagnostic = template(state.actor_params, traj, c.seed, step + 1)
        diagnostic["timing/collapse"] = time.perf_counter() - t1
        t1 = time.perf_counter()
    # a KL term's reference is the policy the RL phase started from (the model, `init_from`'s
    # or the SFT phase's weights): exp.policy's, which a resumed run rebuilds as they were
    ref = exp.policy.params if exp.algo.uses_reference else None
    state, um = exp.update(state, traj.truncate(trained), k_update, ref)
    um = sharding.to_host(um)
    t2 = time.perf_counter()
    if peaks:
        measured["update"] = memory.device_peak()
    out = {k: float(v) for k, v in um.items()}
    out.update({f"memory/{name}_peak_gb": peak / memory.GB
                for name, peak in measured.items() if peak is not None})
    out.update(diagnostic)
    for name, value in evaluate.summarize_mix(traj, m, exp.mix, c.rollout.group_size).items():
        out[f"train/{name}"] = value
    generated = sum(out[f"train/{tag}/generated_tokens"] for tag, _ in exp.mix)
    # real tokens through the update's forward+backward passes: k mini-batches of `mini` of the
    # N kept rows (the old-log-prob forward is in the time, not in the count)
    # the filter's own count (at least one group), not a second copy of its formula
    kept = filtering.static_groups(c.rollout.env_groups, exp.algo.rollout_filter_ratio,
                                   exp.algo.rollout_filter_strategy)
    N = kept * c.rollout.group_size
    mini, k = update_lib.num_updates(exp.algo, N)
    kept_tokens = float(lengths.sum()) * N / traj.tokens.shape[0]
    out.update({
        "timing/rollout": t_roll, "timing/update": t2 - t1, "timing/step": t2 - t0,
        "perf/rollout_tokens_per_s": generated / t_roll,
        "perf/update_tokens_per_s": kept_tokens * k * mini / N / (t2 - t1),
        "perf/update_context": float(trained),
        "env/seed_counter": float(seed_counter), **dyn,
    })
    return state, out


# ----------------------------------------------------------------------------- the run
class Stopped(Exception):
    """The run stopped early on SIGTERM / Ctrl-C (to any one of its processes) after saving a
    checkpoint at `.step`; the message is one line. `launch/train.py` exits with status
    `sharding.EXIT_STOPPED` (75)."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


class _Stop:
    """SIGTERM / Ctrl-C: finish the current step, checkpoint, exit. A second Ctrl-C aborts."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. a test runner thread)
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              "(Ctrl-C again to abort without saving)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def config_json(config) -> str:
    return config.to_json_best_effort(sort_keys=True)


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resumable(saved_json: str, config) -> None:
    """A workdir's saved config must equal this one except for RESUMABLE_CHANGES."""
    saved = {**ADDED_KEYS, **_flat(json.loads(saved_json))}
    now = _flat(json.loads(config_json(config)))
    for key in sorted(set(saved) | set(now)):
        if key in RESUMABLE_CHANGES:
            continue
        if saved.get(key, "<absent>") != now.get(key, "<absent>"):
            raise ValueError(f"the workdir holds a run with {key}={saved.get(key, '<absent>')!r}, "
                             f"this config has {now.get(key, '<absent>')!r}; use a new --workdir "
                             f"(changeable on resume: {', '.join(RESUMABLE_CHANGES)})")


def check_workdir(workdir: str, config) -> bool:
    """Whether `workdir` holds a run to resume, checking that it has this config and that the
    workdir can be created or written. Reads only: nothing is created or written here."""
    path = os.path.join(workdir, "config.json")
    resuming = os.path.isfile(path)
    if resuming:
        with open(path, encoding="utf-8") as f:
            check_resumable(f.read(), config)
    existing = os.path.abspath(workdir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"workdir {workdir} is not writable ({existing} is not a writable "
                         f"directory)")
    return resuming


def write_config(workdir: str, config) -> None:
    path = os.path.join(workdir, "config.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(config_json(config))
    os.replace(path + ".tmp", path)


def train(config, workdir: str, *, progress: bool = True, stop_after: int | None = None,
          experiment: Experiment | None = None, log=metrics_lib.say) -> dict:
    """Run (or resume) the training run of `config` in `workdir`.

    stop_after: end after this many steps of this call, as an interruption would (checkpoint
    saved), to test resuming. experiment: a `build(config)` to reuse (tests share compiled
    programs between runs; it must come from an equal config). Returns the last logged scalars.
    """
    # a bad value, model, env or workdir fails before anything is written
    config_check.check(config)
    resuming = check_workdir(workdir, config)
    t_build = time.perf_counter()
    exp = experiment or build(config)
    # a run that cannot fit stops here, before any step
    planned = {p.name: p.total for p in memory_plan(exp, log)}
    phase = None
    if config.sft.steps > 0:  # its demonstrations' replies must fit, before anything is written
        from starpo import sft

        phase = sft.build(config, exp)
        check_workdir(os.path.join(workdir, "sft"), config)
    os.makedirs(workdir, exist_ok=True)
    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                 keep=config.trainer.keep_checkpoints)
    with jax.set_mesh(exp.mesh):  # programs trace with the mesh's activation shardings
        if phase is not None and ckpt.latest_step() is None:
            try:
                params = sft.run(config, os.path.join(workdir, "sft"), exp, phase,
                                 progress=progress, log=log, stop_after=stop_after)
            except Stopped:  # SIGTERM during SFT: its checkpoint is saved; RL has not begun
                ckpt.close()
                raise
            if params is None:  # stopped after stop_after steps: the same call resumes it
                ckpt.close()
                return {}
            exp = with_actor(exp, params)
            t_build = time.perf_counter()
        elif phase is not None and exp.algo.uses_reference:  # RL resumes: its KL reference
            sft_ckpt = os.path.join(workdir, "sft", "checkpoints")  # is where SFT ended
            exp = with_actor(exp, sharding.put(
                load_actor(sft_ckpt, None, exp.policy.params),
                model_lib.param_shardings(exp.policy.cfg, exp.mesh)))
        return _run(config, workdir, exp, ckpt, resuming, t_build, progress, stop_after, log,
                    planned)


def with_actor(exp: Experiment, params) -> Experiment:
    """`exp` starting from the actor weights `params` (an SFT phase's): the critic, where it is
    a copy of the actor, copies these too."""
    policy = dataclasses.replace(exp.policy, params=params, source=f"{exp.policy.source}+sft")
    critic = exp.critic_params
    if exp.algo.uses_critic and not exp.config.model.critic_path:
        critic = sharding.put(critic_params_from(exp.config, policy)[1],
                              exp.state_shardings.critic_params)
    return dataclasses.replace(exp, policy=policy, critic_params=critic)


def memory_plan(exp: Experiment, log=metrics_lib.say) -> list:
    """Print the estimated peak memory of each phase beside the device's capacity; raise
    `memory.MemoryPlanError` where one cannot fit (`trainer.memory_check`; else a warning)."""
    c = exp.config
    dtypes = phase_dtypes(c)
    phases = memory.plan(c, exp.policy.cfg, mesh_shape=tuple(exp.mesh.shape.values()),
                         prompt_tokens=memory.prompt_tokens(exp.rollout),
                         decode_dtype=dtypes["decode"], update_dtype=dtypes["update"],
                         contexts=(exp.rollout.context, max(
                             [vs.rollout.context for vs in exp.val_sets.values()] or [0])),
                         attention=model_lib.kernels(exp.policy.cfg.replace(
                             dtype=dtypes["update"])))
    capacity, where = memory.device_capacity()
    if jax.process_index() == 0:
        log(memory.describe(phases, capacity, where))
    try:
        memory.check(phases, capacity, where)
    except memory.MemoryPlanError as e:
        if c.trainer.get("memory_check", True):
            raise
        if jax.process_index() == 0:
            log(f"warning: {e} (trainer.memory_check=False: going on)")
    return phases


def log_start(exp: Experiment, build_s: float, log) -> None:
    """The run's first lines: what was built, on which devices and mesh."""
    c = exp.config
    batch_envs = (",".join(f"{t}:{g}" for t, g in exp.mix) if len(exp.mix) > 1
                  else exp.mix[0][0])
    cfg = exp.policy.cfg
    adapters = (f", LoRA rank {cfg.lora_rank}: {lora.num_adapter_params(cfg) / 1e6:.2f}M "
                f"adapter weights train" if cfg.lora_rank else "")
    log(f"built in {build_s:.1f} s: {exp.policy.source} "
        f"({cfg.num_params / 1e6:.1f}M params{adapters}), env {batch_envs}, "
        f"{c.rollout.env_groups}x{c.rollout.group_size} episodes per step, "
        f"{jax.devices()[0].platform} x{jax.device_count()} (mesh data x fsdp x tensor = "
        f"{' x '.join(str(n) for n in exp.mesh.shape.values())}); "
        f"the first step and validation compile (slow)")
    unsplit = sharding.describe(model_lib.logical_axes(exp.policy.cfg),
                                model_lib.abstract_params(exp.policy.cfg), exp.mesh)
    if unsplit:
        log(f"sharding: {len(unsplit)} weight dims stay replicated or partly split (sizes not "
            f"divisible by the mesh), e.g. {unsplit[0]}")


def _measured_peaks(scalars: dict, planned: dict, say) -> None:
    """A line per phase for the device's measured peaks in `scalars` (memory/<phase>_peak_gb),
    beside the plan's estimate: what a GPU run calibrates the plan with."""
    for phase in ("validation", "rollout", "update"):
        peak = scalars.get(f"memory/{phase}_peak_gb")
        if peak is not None:
            say(memory.describe_peak(phase, peak * memory.GB, planned.get(phase)))


def _run(config, workdir, exp, ckpt, resuming, t_build, progress, stop_after, log,
         planned=None) -> dict:
    # On several hosts every process runs the same steps (and writes its shards of each
    # checkpoint); the first one alone prints and writes the config, metrics and samples.
    lead = jax.process_index() == 0
    if not lead:
        log, progress = (lambda *a, **k: None), False
    if not resuming and lead:
        write_config(workdir, config)
    start, detector = 0, metrics_lib.CollapseDetector(window=config.trainer.collapse_window)
    if resuming and ckpt.latest_step() is not None:
        state, meta = ckpt.restore(None, update_lib.split_state(state_target(exp))[0])
        state = update_lib.join_state(state, frozen_params(exp))
        start = int(meta["step"])
        counter = int(meta.get("env_seed_counter", start * config.rollout.env_groups))
        detector.load_state_dict(meta["collapse_detector"])
        log(f"resuming {workdir} from step {start}")
    else:
        state, counter = initial_train_state(exp), 0
    # a resumed run drops what an interrupted one logged after its checkpoint
    writer = (metrics_lib.MetricsWriter(workdir, resume_step=start if start else -1) if lead
              else metrics_lib.NullWriter())
    log_start(exp, time.perf_counter() - t_build, log)
    total, last = config.trainer.total_steps, {}
    v = config.val
    std_name = metrics_lib.reward_std_name(config.rollout.group_size)
    keys = metrics_lib.summary_keys(config.rollout.group_size)
    planned = planned or {}
    # the device's measured peak after each phase's first run in this process (a host call
    # where the loop waits anyway; nothing on CPU, whose backend reports no peak)
    unmeasured = {"validation", "train"}

    def validated(params, n, say):
        scalars = validate(exp, params, writer, n)
        if "validation" in unmeasured:
            unmeasured.discard("validation")
            peak = memory.device_peak()
            if peak is not None:
                scalars["memory/validation_peak_gb"] = peak / memory.GB
                _measured_peaks(scalars, planned, say)
        return scalars

    def save(step):  # a LoRA run's checkpoint holds what trains, not its frozen base
        ckpt.save(step, update_lib.split_state(state)[0], {
            "step": step, "env_seed_counter": counter, "seed": config.seed,
            "config": json.loads(config_json(config)),
            "collapse_detector": detector.state_dict()})

    with _Stop() as stop:
        if start == 0 and v.before_train:
            last = validated(state.actor_params, 0, log)
            writer.write(0, last)
            log(metrics_lib.summary_line(0, total, last, keys))
        bar = metrics_lib.Progress(start, total, "train", show=progress, log=log)
        done_here, n, stoppers, empty = 0, start, [], 0
        template = template_collapse(config, exp)
        if template is None and config.trainer.get("collapse_mi_freq", 0) > 0:
            log("note: trainer.collapse_mi_freq: the template-collapse diagnostic runs only "
                "with rollout.context_window_mode=full (as RAGEN-2's): off for this run")
        empty_limit = config.trainer.get("rollout_filter_empty_stop_steps", 0)
        for step in bar:
            first = "train" in unmeasured
            unmeasured.discard("train")
            state, scalars = train_step(exp, state, step, counter, template, peaks=first)
            say = bar.write  # each line its own: above a drawn bar, never onto its line
            if first:
                _measured_peaks(scalars, planned, say)
            counter = int(scalars["env/seed_counter"])
            n = step + 1
            collapse = detector.update(scalars.get(std_name, float("nan")),
                                       scalars.get("actor/entropy", float("nan")))
            scalars["warning/echo_trap"] = float(collapse)
            if "collapse/mi_estimate" in scalars:  # RAGEN-2's diagnostic ran this step
                scalars["warning/template_collapse"] = float(
                    collapse_lib.warns(scalars, config.trainer.collapse_mi_warn))
            # RAGEN-2: a filter that kept no group (the batch made no update) several steps in
            # a row stops the run
            empty = empty + 1 if scalars.get("rollout/kept_groups", 1.0) == 0 else 0
            scalars["rollout/consecutive_empty_after_filter_steps"] = float(empty)
            if v.test_freq > 0 and n % v.test_freq == 0:
                scalars.update(validated(state.actor_params, n, say))
            writer.write(n, scalars)
            last = scalars
            say(metrics_lib.summary_line(n, total, scalars, keys))
            if collapse:
                say(f"warning: step {n}: reward std and entropy both fell sharply (Echo Trap); "
                    "consider a lower lr, the StarPO-S filter or a critic")
            if scalars.get("warning/template_collapse"):
                say(f"warning: step {n}: template collapse: the first reply hardly depends on "
                    f"the prompt (MI estimate {scalars['collapse/mi_estimate']:.4f} nats per "
                    f"token < trainer.collapse_mi_warn {config.trainer.collapse_mi_warn}, "
                    f"retrieval {scalars['collapse/retrieval_accuracy']:.2f} vs chance "
                    f"{scalars['collapse/retrieval_chance_level']:.2f})")
            if 0 < empty_limit <= empty:
                say(f"warning: step {n}: the rollout filter kept no group {empty} steps in a "
                    f"row (trainer.rollout_filter_empty_stop_steps={empty_limit}): stopping")
            done_here += 1
            # every process stops at the same step (each saves its shards of that checkpoint,
            # orbax waits for all), whichever of them got the signal
            stoppers = sharding.processes_flagging(stop.requested)
            end = (n == total or bool(stoppers)
                   or (stop_after is not None and done_here >= stop_after)
                   or (collapse and config.trainer.stop_on_collapse)
                   or 0 < empty_limit <= empty)
            if end or (config.trainer.save_freq > 0 and n % config.trainer.save_freq == 0):
                save(n)
            if end:
                break
        bar.close()
    writer.close()
    ckpt.close()
    raise_if_stopped(stoppers, n, total)
    return last


def raise_if_stopped(stoppers: list, n: int, total: int, what: str = "step") -> None:
    """`Stopped` when processes `stoppers` asked to stop (SIGTERM / Ctrl-C) before the last
    step: every process saved the checkpoint of `what` n."""
    if stoppers and n < total:
        who = (f" (on process {', '.join(map(str, stoppers))})" if jax.process_count() > 1
               else "")
        raise Stopped(n, f"stopped on request{who}: checkpoint saved at {what} {n} of {total}; "
                         f"the same command resumes the run")


def template_collapse(config, exp: Experiment):
    """RAGEN-2's template-collapse diagnostic of a run (starpo/collapse.py), or None when
    `trainer.collapse_mi_freq` is 0 (nothing built, nothing run). It scores with the update's
    model (dtype, logit chunks, temperature) in micro-batches of `collapse_mi_micro_batch`."""
    t = config.trainer  # the run's (its knobs may differ from those `exp` was built with)
    if t.get("collapse_mi_freq", 0) <= 0 or context_window(config):
        return None  # RAGEN-2 computes nothing under a context window either
    return collapse_lib.TemplateCollapse(
        exp.policy.cfg.replace(dtype=phase_dtypes(exp.config)["update"]),
        exp.policy.tokenizer.token_bytes(), freq=t.collapse_mi_freq,
        samples=t.collapse_mi_samples, micro=t.collapse_mi_micro_batch,
        thinking=config.rollout.enable_think, chunk=exp.algo.logit_chunk_size,
        temperature=exp.algo.temperature, compiler_options=exp.compiler_options,
        multi_turn=t.get("collapse_mi_multi_turn", False))


def state_step(state) -> int:
    return int(jax.device_get(state.step))


# ----------------------------------------------------------------------------- finished runs
def config_from_json(text: str):
    """A run's saved config.json back as a locked ConfigDict (lists back to tuples)."""
    import ml_collections

    def tuples(x):
        if isinstance(x, dict):
            return {k: tuples(v) for k, v in x.items()}
        return tuple(tuples(v) for v in x) if isinstance(x, list) else x

    c = ml_collections.ConfigDict(tuples(json.loads(text)))
    c.lock()
    return c


def find_run(path: str) -> str:
    """The workdir of `path`: a workdir, its checkpoints/ folder or one checkpoint in it."""
    p = os.path.abspath(path)
    for _ in range(3):
        if os.path.isfile(os.path.join(p, "config.json")) and os.path.isdir(
                os.path.join(p, "checkpoints")):
            return p
        p = os.path.dirname(p)
    raise FileNotFoundError(f"{path} is not a training workdir (no config.json and checkpoints/)")


def load_run(path: str, step: int | None = None):
    """(config, policy with the checkpoint's actor weights, step) of a saved run.

    `path`: a workdir (its latest checkpoint, or `step`), or a checkpoint folder in it."""
    workdir = find_run(path)
    if step is None and os.path.basename(os.path.normpath(path)).isdigit():
        step = int(os.path.basename(os.path.normpath(path)))
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
        config = config_from_json(f.read())
    # its own checkpoint's weights replace them (a LoRA run's: the adapters, on the same base)
    policy = load_policy(config, init_from=False)
    directory = os.path.join(workdir, "checkpoints")
    if step is None:
        reader = ckpt_lib.Checkpointer(directory, read_only=True)
        step = reader.latest_step()
        reader.close()
        if step is None:
            raise FileNotFoundError(f"{workdir} has no complete checkpoint")
    params = load_actor(directory, step, policy.params)
    policy = dataclasses.replace(policy, params=params, source=f"{workdir}@{step}")
    return config, policy, step
