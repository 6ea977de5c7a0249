"""Every value of a run's config checked before any work, each failure one line naming the key.

    config_check.check(config)   # raises ConfigError("rollout.top_p must be in (0, 1], got 1.5")

Types are already enforced when overrides are parsed (configs are locked ml_collections); this
checks ranges, choices and the values that must agree with each other (batch, mini-batch and
micro-batch sizes after the StarPO-S filter, the rollout's and validation's chunks of whole
groups, env options, env mixes and tags, the model spec).
What only the model can tell (a prompt longer than `rollout.max_context`, a mesh the devices
cannot form) fails when the run is built, still before its workdir is written.
"""

from __future__ import annotations

import math

import envs
from starpo import lora, model, sharding
from starpo.precision import phase_dtypes


class ConfigError(ValueError):
    """A config value the run cannot use; the message is one line naming the key."""


# A rule: (predicate, what the value must be), for `check_rules`.
def within(lo, hi=math.inf, lo_open=False, hi_open=False, note=""):
    """Finite numbers between lo and hi (closed ends unless open)."""
    def ok(v):
        return (math.isfinite(v) and (lo < v if lo_open else lo <= v)
                and (v < hi if hi_open else v <= hi))
    need = (f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}" if hi < math.inf
            else f"{'>' if lo_open else '>='} {lo}")
    return ok, need + (f" ({note})" if note else "")


def one_of(*choices):
    return lambda v: v in choices, f"one of {', '.join(map(str, choices))}"


def check_rules(rules: dict, get, key=lambda name: name) -> None:
    """Raise ConfigError "<key> must be <need>, got <value>" for the first value `get(name)` that
    fails its rule (a value of the wrong type fails too)."""
    for name, (ok, need) in rules.items():
        value = get(name)
        try:
            good = bool(ok(value))
        except TypeError:
            good = False
        if not good:
            raise ConfigError(f"{key(name)} must be {need}, got {value!r}")


# rollout.context_window_mode: the whole dialogue, the last max_context_window turns (RAGEN-2
# calls it limited_multi_turn: both names are accepted), the current
CONTEXT_WINDOW_MODES = ("full", "limited", "limited_multi_turn", "single_turn")


def context_window(mode: str, max_context_window: int) -> int:
    """The turns a reply sees besides the prompt prefix, its own included (0 = all): the
    `RolloutSpec.context_window` / `AlgoConfig.context_window` of rollout.context_window_mode
    and rollout.max_context_window (-1 under a limited window: every turn, as RAGEN-2 reads
    it). Raises ConfigError for a mode or window it cannot use."""
    if mode not in CONTEXT_WINDOW_MODES:
        raise ConfigError(f"rollout.context_window_mode must be one of "
                          f"{', '.join(CONTEXT_WINDOW_MODES)}, got {mode!r}")
    if mode.startswith("limited") and max_context_window < 1 and max_context_window != -1:
        raise ConfigError(f"rollout.max_context_window must be >= 1, or -1 for every turn, "
                          f"under context_window_mode={mode}, got {max_context_window}")
    if mode.startswith("limited"):
        return max(max_context_window, 0)
    return {"full": 0, "single_turn": 1}[mode]


_MESH_AXIS = (lambda v: v == -1 or v >= 1, ">= 1 or -1 (all the devices the others leave)")
# key -> rule. The algorithm's knobs are checked by `update.AlgoConfig` (the same way).
RULES = {
    "seed": within(0, 2**31 - 1),
    "model.dtype": one_of("auto", "float32", "bfloat16"),
    "model.remat_policy": one_of(*model.REMAT_POLICIES),
    "model.attention": one_of(*model.ATTENTION),
    "mesh.data": _MESH_AXIS, "mesh.fsdp": _MESH_AXIS, "mesh.tensor": _MESH_AXIS,
    "mesh.distributed": one_of("auto", "on", "off"),
    "mesh.num_processes": within(0, note="0 = JAX detects it"),
    "mesh.process_id": within(-1, note="-1 = JAX detects it"),
    "mesh.init_timeout_s": within(1),
    "mesh.heartbeat_timeout_s": within(2),
    "env.name": one_of(*envs.NAMES),
    "rollout.env_groups": within(1),
    "rollout.group_size": within(1),
    "rollout.max_turn": within(1),
    "rollout.max_actions_per_turn": within(0, note="0 = the env's budget"),
    "rollout.max_actions_per_traj": within(0, note="0 = the env's budget"),
    "rollout.response_length": within(1),
    "rollout.max_context": within(16),
    # training samples from the tempered policy and divides the logits by it
    "rollout.temperature": within(0, lo_open=True, note="greedy 0 is for val.temperature"),
    "rollout.top_p": within(0, 1, lo_open=True),
    "rollout.top_k": within(0, note="0 = off"),
    "rollout.decode_windows": within(1),
    "rollout.context_window_mode": one_of(*CONTEXT_WINDOW_MODES),
    "rollout.max_context_window": (lambda v: v == -1 or v >= 1, ">= 1 or -1 (unset)"),
    "rollout.batch_size": within(0, note="0 = all env_groups x group_size at once"),
    "val.env_groups": within(1),
    "val.group_size": within(1),
    "val.temperature": within(0, note="0 = greedy"),
    "val.test_freq": within(0, note="0 = never"),
    "val.batch_size": within(0, note="0 = all env_groups x group_size at once"),
    "trainer.total_steps": within(0),
    "trainer.save_freq": within(0, note="0 = only at the end"),
    "trainer.keep_checkpoints": within(1),
    "trainer.log_samples": within(0),
    "trainer.collapse_window": within(1),
    "trainer.rollout_filter_empty_stop_steps": within(0, note="0 = never"),
    "trainer.collapse_mi_freq": within(0, note="0 = off"),
    "trainer.collapse_mi_samples": within(1),
    "trainer.collapse_mi_micro_batch": within(1),
    "trainer.collapse_mi_warn": (lambda v: math.isfinite(v), "a finite number"),
    "trainer.context_bucket": within(0, note="0 = always max_context"),
    "sft.steps": within(0, note="0 = no SFT phase"),
    "sft.env_groups": within(1),
    "sft.lr": within(0, lo_open=True),
    "sft.warmup_steps": within(0),
    "sft.actions_per_turn": within(0, note="0 = the turn's action budget"),
    "sft.test_freq": within(0, note="0 = never"),
    "sft.save_freq": within(0, note="0 = only at the end"),
}


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
    from starpo import evaluate, training, weights  # they import this module

    check_rules(RULES, lambda key: _get(config, key))
    _guard("mesh", sharding.check_cluster, config.mesh.coordinator_address,
           config.mesh.num_processes, config.mesh.process_id, config.mesh.init_timeout_s,
           config.mesh.get("heartbeat_timeout_s", 60))

    _guard("model.path", weights.model_kind, config.model.path)
    if config.model.get("attention", "auto") == "cudnn":  # the model's head dim: `training.build`
        refused = model.cudnn_refusal(phase_dtypes(config)["update"], None, model.gpu_capability())
        if refused:
            raise ConfigError(f"model.attention=cudnn: cuDNN's flash attention {refused}; "
                              f"use model.attention=auto")
    if config.model.get("lora") is not None:  # checked even while off (rank 0)
        lc = config.model.lora
        _guard("model.lora", lora.check, lc.rank, lc.alpha, lc.target_modules)
    if config.model.init_from:
        _guard("model.init_from", training.init_source, config)
    if config.model.critic_path:
        _guard("model.critic_path", weights.model_kind, config.model.critic_path)
    _guard("env.options", lambda: envs.make(config.env.name, **config.env.options.to_dict()))
    _guard("env.mix", training.env_mix, config)
    _guard("val.tags", evaluate.parse_tags, config.val.tags, config.env.name)
    _check_chunks(config)
    context_window(config.rollout.context_window_mode, config.rollout.max_context_window)
    algo = _guard("algorithm", training.algo_config, config)
    _check_batches(config, algo)
    if config.sft.steps > 0:
        from starpo import sft

        _guard("sft", sft.check, config, envs.make(config.env.name,
                                                    **config.env.options.to_dict()))


def _check_chunks(config) -> None:
    """rollout.batch_size and val.batch_size are whole groups dividing their episodes; a batch
    that mixes env variants is played at once."""
    from starpo import training

    for part in ("rollout", "val"):
        _guard(f"{part}.batch_size", training.batch_size, config[part])
    r = config.rollout
    if len(training.env_mix(config)) > 1 and config.algorithm.filter_groups_enable:
        raise ConfigError("algorithm.filter_groups_enable: dynamic sampling keeps one env's "
                          "groups in any order; a batch that mixes env variants (env.mix) can't")
    if len(training.env_mix(config)) > 1 and training.batch_size(r) != r.env_groups * r.group_size:
        raise ConfigError(f"rollout.batch_size {r.batch_size}: a batch that mixes env variants "
                          f"(env.mix) is played at once; use 0")


def _check_batches(config, algo) -> None:
    """The update's batch sizes divide as it needs: the kept rows into mini-batches, those into
    micro-batches (`update.num_updates` and the update's micro-batch split)."""
    from starpo import filtering, update

    r = config.rollout
    kept = filtering.static_groups(r.env_groups, algo.rollout_filter_ratio,
                                   algo.rollout_filter_strategy)
    rows = kept * r.group_size
    mini, _ = update.num_updates(algo, rows)
    # the old-log-prob forward runs over all kept rows, each optimizer update over a mini-batch
    if rows % min(algo.micro_batch_size, rows) or mini % min(algo.micro_batch_size, mini):
        raise ConfigError(
            f"algorithm.micro_batch_size {algo.micro_batch_size} does not divide the update's "
            f"batch: the filter keeps {kept} of {r.env_groups} groups x {r.group_size} = {rows} "
            f"rows in mini-batches of {mini}; use a micro_batch_size dividing both")
