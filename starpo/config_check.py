"""Every value of a run's config checked before any work, each failure one line naming the key.

    config_check.check(config)   # raises ConfigError("rollout.top_p must be in (0, 1], got 1.5")

Types are already enforced when overrides are parsed (configs are locked ml_collections); each
knob's own range or choice is its rule in `schema`; this adds the env registry's names and the
values that must agree with each other (batch, mini-batch and
micro-batch sizes after the StarPO-S filter, the rollout's and validation's chunks of whole
groups, env options, env mixes and tags, the model spec).
What only the model can tell (a prompt longer than `rollout.max_context`, a mesh the devices
cannot form) fails when the run is built, still before its workdir is written.
"""

from __future__ import annotations

import dataclasses

import envs
from starpo import demos, evaluate, lora, model, run_config, schema, sharding, weights
from starpo import update as update_lib
from starpo.precision import phase_dtypes
from starpo.schema import ConfigError


def _get(config, key):
    node = config
    for part in key.split("."):
        node = node[part]
    return node


def _guard(key, fn, *args):
    """fn(*args), its ValueError reworded as a ConfigError naming `key`."""
    try:
        return fn(*args)
    except ValueError as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        named = isinstance(e, ConfigError) or message.startswith(key)
        raise ConfigError(message if named else f"{key}: {message}") from None


def check(config) -> None:
    """Raise ConfigError (one line, naming the key) for the first value the run cannot use."""
    schema.check(lambda key: _get(config, key))  # each knob's own rule
    schema.check_value("env.name", schema.one_of(*envs.NAMES), config.env.name)
    r = config.rollout
    if r.response_length >= r.max_context:  # the first turn's prompt shares the context
        raise ConfigError(f"rollout.response_length {r.response_length} must be below "
                          f"rollout.max_context {r.max_context}: a turn's reply and the "
                          f"dialogue before it share the context")
    _guard("mesh", sharding.check_cluster, config.mesh.coordinator_address,
           config.mesh.num_processes, config.mesh.process_id, config.mesh.init_timeout_s,
           config.mesh.heartbeat_timeout_s)
    _check_model(config)
    _guard("env.options", lambda: envs.make(config.env.name, **config.env.options.to_dict()))
    _guard("env.mix", run_config.env_mix, config)
    _guard("val.tags", evaluate.parse_tags, config.val.tags, config.env.name)
    _guard("val.tags", distinct_val_envs, config)
    _check_chunks(config)
    run_config.context_window(config)
    algo = _guard("algorithm", run_config.algo_config, config)
    _check_batches(config, algo)
    if config.sft.steps > 0:
        _guard("sft", check_sft, config, envs.make(config.env.name,
                                                    **config.env.options.to_dict()))


def distinct_val_envs(config) -> None:
    """ValueError where two validation sets would play the same env under different names.

    The training env's tag plays the config's `env.options`, other tags their registered
    defaults (`run_config.make_env`). So `env.options` can turn the training env into another
    registered variant: training the FrozenLake config with `env.options.is_slippery=False` and
    validating on "FrozenLake,FrozenLakeNonSlippery" would report RAGEN-2's non-slippery lake
    twice, once under the paper's name."""
    tags = evaluate.parse_tags(config.val.tags, config.env.name)
    played = [(t, run_config.make_env(config, t)) for t in tags]
    for i, (a, ea) in enumerate(played):
        for b, eb in played[i + 1:]:
            if type(ea) is type(eb) and dataclasses.replace(ea, name="") == dataclasses.replace(
                    eb, name=""):
                train, other = (a, b) if a == config.env.name else (b, a)
                own = envs.make(train)
                changed = {k: v for k, v in config.env.options.to_dict().items()
                           if getattr(own, k, v) != v}
                given = [f"env.options.{k}={v}" for k, v in changed.items()]
                flags = " ".join(f"--config.{o}" for o in given)
                back = " ".join(f"--config.env.options.{k}={getattr(own, k)}" for k in changed)
                raise ValueError(
                    f"{a} and {b} would play the same env: the training env {train} has "
                    f"{' '.join(given) or 'its options'}, as {other}; train {other} under its "
                    f"own name (--config.env.name={other} {flags}) or give {train} its own "
                    f"options ({back})")


def _check_model(config) -> None:
    """model.path, its attention kernels, LoRA, init_from and critic_path."""
    _guard("model.path", weights.model_kind, config.model.path)
    if config.model.attention == "cudnn":  # the model's head dim: `experiment.build`
        refused = model.cudnn_refusal(phase_dtypes(config)["update"], None, model.gpu_capability())
        if refused:
            raise ConfigError(f"model.attention=cudnn: cuDNN's flash attention {refused}; "
                              f"use model.attention=auto")
    lc = config.model.lora  # checked even while off (rank 0)
    _guard("model.lora", lora.check, lc.rank, lc.alpha, lc.target_modules)
    if config.model.init_from:
        _guard("model.init_from", run_config.init_source, config)
    if config.model.critic_path:
        _guard("model.critic_path", weights.model_kind, config.model.critic_path)


def check_sft(config, env) -> None:
    """ValueError (one line) where an SFT phase of `config` cannot run: a batch mixing env
    variants, an env without a solver, an sft.actions_per_turn whose reply table is too large,
    micro-batches not dividing the step's levels."""
    s = config.sft
    if config.env.mix:
        raise ValueError("sft: demonstrations play one env variant; drop env.mix")
    demos.check_solvable(env)
    # a demonstration reply table too large for sft.actions_per_turn (before any work)
    demos.moves_per_turn(env, run_config.rollout_spec(config), s.actions_per_turn)
    micro = min(config.algorithm.micro_batch_size, s.env_groups)
    if s.env_groups % micro:
        raise ValueError(f"sft.env_groups {s.env_groups} is not a multiple of "
                         f"algorithm.micro_batch_size {micro}")


def _check_chunks(config) -> None:
    """rollout.batch_size and val.batch_size are whole groups dividing their episodes; a batch
    that mixes env variants is played at once."""
    for part in ("rollout", "val"):
        _guard(f"{part}.batch_size", run_config.batch_size, config[part])
    r = config.rollout
    mixed = len(run_config.env_mix(config)) > 1
    if mixed and config.algorithm.filter_groups_enable:
        raise ConfigError("algorithm.filter_groups_enable: dynamic sampling keeps one env's "
                          "groups in any order; a batch that mixes env variants (env.mix) can't")
    if mixed and run_config.batch_size(r) != r.env_groups * r.group_size:
        raise ConfigError(f"rollout.batch_size {r.batch_size}: a batch that mixes env variants "
                          f"(env.mix) is played at once; use 0")


def _check_batches(config, algo) -> None:
    """The update's batch sizes divide as it needs: the kept rows into mini-batches, those into
    micro-batches (`update.num_updates` and the update's micro-batch split)."""
    r = config.rollout
    kept = algo.static_groups(r.env_groups)
    rows = kept * r.group_size
    mini, _ = update_lib.num_updates(algo, rows)
    # the old-log-prob forward runs over all kept rows, each optimizer update over a mini-batch
    if rows % min(algo.micro_batch_size, rows) or mini % min(algo.micro_batch_size, mini):
        raise ConfigError(
            f"algorithm.micro_batch_size {algo.micro_batch_size} does not divide the update's "
            f"batch: the filter keeps {kept} of {r.env_groups} groups x {r.group_size} = {rows} "
            f"rows in mini-batches of {mini}; use a micro_batch_size dividing both")
