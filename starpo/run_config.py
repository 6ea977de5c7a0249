"""The run's config read once: the ConfigDict turned into the typed things each part takes.

    algo = run_config.algo_config(config)    # update.make_update(algo, ...)
    spec = run_config.rollout_spec(config)   # rollout.make_rollout(env, tok, cfg, spec, ...)

Every module that needs a knob gets it from here (or takes the typed result), so a key is read
in one place, with the defaults of runs saved before it existed. The readers raise
`ConfigError` (or ValueError) naming the key; `config_check.check` runs them all before any
work, so a run never fails here after it started. This module sits low in the package: it
imports the envs, the rollout's spec and the tag parser, never the modules that build or run.
"""

from __future__ import annotations

import dataclasses
import json
import os

import ml_collections

import envs
from starpo import checkpoint as ckpt_lib
from starpo import cli
from starpo import dialogue, evaluate, schema
from starpo.algo import AlgoConfig  # noqa: F401 (the readers' product, as run_config.AlgoConfig)
from starpo import rollout as rollout_lib
from starpo.precision import phase_dtypes


ConfigError = schema.ConfigError


def context_window(config) -> int:
    """The turns a reply sees besides the prompt prefix, its own included (0 = all): the
    `RolloutSpec.context_window` / `AlgoConfig.context_window` of rollout.context_window_mode
    and rollout.max_context_window (-1 under a limited window: every turn, as RAGEN-2 reads
    it; runs saved before the keys existed had the whole dialogue). Raises ConfigError for a
    mode or window it cannot use."""
    mode, max_context_window = config.rollout.context_window_mode, config.rollout.max_context_window
    schema.check_knob("rollout.context_window_mode", mode)
    if mode.startswith("limited") and max_context_window < 1 and max_context_window != -1:
        raise ConfigError(f"rollout.max_context_window must be >= 1, or -1 for every turn, "
                          f"under context_window_mode={mode}, got {max_context_window}")
    if mode.startswith("limited"):
        return max(max_context_window, 0)
    return {"full": 0, "single_turn": 1}[mode]


# ----------------------------------------------------------------------------- the algorithm
# (`AlgoConfig` lives in `starpo.algo`, low in the package, so that the update need not import
# this module)
def algo_config(config) -> AlgoConfig:
    """The update's knobs: `config.algorithm` plus group size, temperature, reply budget and
    context window of the rollout."""
    return _algo(config, context_window(config))


def _algo(config, window: int) -> AlgoConfig:
    r = config.rollout
    return schema.read(AlgoConfig, config.algorithm, group_size=r.group_size,
                       temperature=r.temperature, response_length=r.response_length,
                       context_window=window, max_turn=r.max_turn)


def sft_algo(config) -> AlgoConfig:
    """The run's algorithm knobs with SFT's learning rate, warm-up and decay (no critic)."""
    return _sft_algo(algo_config(config), config.sft)


def _sft_algo(algo: AlgoConfig, s) -> AlgoConfig:
    return algo.replace(adv_estimator="grpo", actor_lr=float(s.lr),
                        warmup_steps=int(s.warmup_steps),
                        lr_decay_steps=int(s.lr_decay_steps), min_lr_ratio=float(s.min_lr_ratio))


# ----------------------------------------------------------------------------- the rollout
def rollout_spec(config) -> rollout_lib.RolloutSpec:
    """The episode's shape and sampling of `config.rollout` (the training and validation
    rollouts' and the solver demonstrations' alike)."""
    return _rollout_spec(config.rollout, phase_dtypes(config)["prefill"], context_window(config))


def _rollout_spec(r, prefill_dtype: str, window: int) -> rollout_lib.RolloutSpec:
    return rollout_lib.RolloutSpec(
        max_turn=r.max_turn, max_new_tokens=r.response_length, max_context=r.max_context,
        thinking=r.enable_think, top_k=r.top_k, top_p=r.top_p,
        max_actions_per_turn=r.max_actions_per_turn or None,
        max_actions_per_traj=r.max_actions_per_traj or None,
        prefill_dtype=prefill_dtype, decode_windows=r.decode_windows,
        context_window=window)


def batch_size(part) -> int:
    """Episodes played at once of `config.rollout` or `config.val`: its `batch_size`, 0 meaning
    all env_groups x group_size (checked)."""
    return rollout_lib.chunk_size(part.env_groups * part.group_size, part.batch_size,
                                  part.group_size)


# ----------------------------------------------------------------------------- the envs
def env_mix(config) -> tuple[tuple[str, int], ...]:
    """((tag, groups), ...): the env variants of a training batch and their group counts.

    `env.mix` = "SimpleSokoban:6,LargerSokoban:2" (counts summing to rollout.env_groups), or
    "" for all rollout.env_groups groups of env.name. Raises ValueError naming the problem."""
    text = config.env.mix
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


def val_tags(config) -> tuple[str, ...]:
    """The validation sets' env tags (`val.tags`; "" = env.name)."""
    return evaluate.parse_tags(config.val.tags, config.env.name)


def make_env(config, tag: str):
    """The env of `tag`: the training env gets the config's options, other tags defaults."""
    options = config.env.options.to_dict() if tag == config.env.name else {}
    return envs.make(tag, **options)


# ----------------------------------------------------------------------------- the model
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
    tags = val_tags(config) + (config.env.name,)
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
    """model.lora as `lora.attach`'s keywords, or None where it is off (rank 0)."""
    c = config.model.lora
    if not c.rank:
        return None
    return dict(rank=c.rank, alpha=c.alpha, targets=c.target_modules)


# ----------------------------------------------------------------------------- saved runs
def upgrade(saved: dict) -> dict:
    """A config dict saved by an older version as this one reads it: each key added since,
    where the schema states what older runs had (`schema.upgrade`), and the env options added
    since that the env has (`schema.OPTIONS_BEFORE`)."""
    out = schema.upgrade(saved)
    env = out.get("env", {})
    if env.get("name") in envs.NAMES and isinstance(env.get("options"), dict):
        has = {f.name for f in dataclasses.fields(envs.make(env["name"]))}
        for option, value in schema.OPTIONS_BEFORE.items():
            if option in has:
                env["options"].setdefault(option, value)
    return out


def config_from_json(text: str):
    """A run's saved config.json back as a locked ConfigDict (lists back to tuples), upgraded
    to today's keys (`upgrade`)."""

    def tuples(x):
        if isinstance(x, dict):
            return {k: tuples(v) for k, v in x.items()}
        return tuple(tuples(v) for v in x) if isinstance(x, list) else x

    c = ml_collections.ConfigDict(tuples(upgrade(json.loads(text))))
    c.lock()
    return c


def saved_config(workdir: str):
    """The config a run in `workdir` was saved with (its config.json)."""
    path = os.path.join(workdir, "config.json")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return config_from_json(text)
    except ValueError as e:  # a broken file (json's errors are ValueErrors)
        raise ValueError(f"{path} is not a run's config ({cli.first_line(e)})") from None


def find_run(path: str) -> str:
    """The workdir of `path`: a workdir, its checkpoints/ folder or one checkpoint in it."""
    p = os.path.abspath(path)
    for _ in range(3):
        if os.path.isfile(os.path.join(p, "config.json")) and os.path.isdir(
                os.path.join(p, "checkpoints")):
            return p
        p = os.path.dirname(p)
    raise FileNotFoundError(f"{path} is not a training workdir (no config.json and checkpoints/)")


def latest_step(workdir: str) -> int | None:
    """The step of the newest complete checkpoint of the run in `workdir` (None: none)."""
    reader = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    step = reader.latest_step()
    reader.close()
    return step


def init_source(config) -> tuple[str, int]:
    """(workdir, step) of `model.init_from`: a saved run of the same model.path (and, for a
    tiny model, the same dialogue: its tokenizer is learned from it). ValueError otherwise."""
    path = config.model.init_from
    try:
        workdir = find_run(path)
    except FileNotFoundError as e:
        raise ValueError(f"model.init_from: {e}") from None
    saved = saved_config(workdir)
    if saved.model.path != config.model.path:
        raise ValueError(f"model.init_from {path} holds a run of model {saved.model.path!r}, "
                         f"this config's model.path is {config.model.path!r}")
    if config.model.path.startswith("tiny") and tiny_tokenizer_args(saved) != tiny_tokenizer_args(
            config):
        raise ValueError(f"model.init_from {path}: a tiny model's tokenizer comes from its "
                         f"run's dialogue, and that run's differs from this one's")
    base = os.path.basename(os.path.normpath(path))
    step = int(base) if base.isdigit() else latest_step(workdir)
    if step is None:
        raise ValueError(f"model.init_from {path}: the run has no complete checkpoint")
    return workdir, step


# ----------------------------------------------------------------------------- the whole run
@dataclasses.dataclass(frozen=True)
class PlaySpec:
    """The episodes a rollout plays per step (`config.rollout`) or per validation (`config.val`)."""

    env_groups: int
    group_size: int
    chunk: int  # episodes played at once (`batch_size`: rollout/val.batch_size, 0 = all)
    temperature: float

    @property
    def episodes(self) -> int:
        return self.env_groups * self.group_size


@dataclasses.dataclass(frozen=True)
class ValSpec:
    """`config.val`: the validation sets, their batch and when they play."""

    batch: PlaySpec
    tags: tuple
    before_train: bool
    test_freq: int


# `config.trainer` as the RL phase reads it: its length, checkpoints, logging and monitors
TrainerSpec = schema.Trainer


@dataclasses.dataclass(frozen=True)
class SftSpec(schema.Sft):
    """`config.sft`: the SFT phase (steps 0 = none) and its algorithm (`sft_algo`)."""

    algo: AlgoConfig | None = None


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """`config.model` as the memory plan and the first lines need it."""

    remat: bool
    remat_policy: str
    critic_path: str
    lora: dict | None  # `lora_settings`
    dtypes: dict  # `phase_dtypes`: the dtype each phase multiplies in


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A whole run's config, read once (`read`); `config` is the ConfigDict itself, kept as
    the artefact a run saves (config.json, checkpoints) and compares on resume."""

    config: object
    seed: int
    algo: AlgoConfig
    rollout: rollout_lib.RolloutSpec
    batch: PlaySpec
    mix: tuple
    context_window: int
    val: ValSpec
    trainer: TrainerSpec
    sft: SftSpec
    model: ModelSpec
    mesh: tuple  # (data, fsdp, tensor)
    envs: dict  # tag -> env of every tag the run plays (`make_env`)


def _batch(part) -> PlaySpec:
    return PlaySpec(part.env_groups, part.group_size, batch_size(part), part.temperature)


def read(config) -> RunSpec:
    """The run of a (checked: `config_check.check`) config as typed, frozen specs: each
    section read once, here."""
    s, m, v, mesh = config.sft, config.model, config.val, config.mesh
    window, dtypes = context_window(config), phase_dtypes(config)
    algo = _algo(config, window)
    sft = schema.read(SftSpec, s, algo=_sft_algo(algo, s))
    model = ModelSpec(m.remat, m.remat_policy, m.critic_path, lora_settings(config), dtypes)
    mix, val = env_mix(config), ValSpec(_batch(v), val_tags(config), v.before_train, v.test_freq)
    tags = (config.env.name,) + tuple(t for t, _ in mix) + val.tags
    rollout = _rollout_spec(config.rollout, dtypes["prefill"], window)
    return RunSpec(config, config.seed, algo, rollout, _batch(config.rollout), mix, window, val,
                   schema.read(TrainerSpec, config.trainer), sft, model,
                   (mesh.data, mesh.fsdp, mesh.tensor), {tag: make_env(config, tag) for tag in tags})
