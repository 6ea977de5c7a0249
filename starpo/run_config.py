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
import math
import os

import ml_collections

import envs
from starpo import advantages as adv_lib
from starpo import checkpoint as ckpt_lib
from starpo import cli
from starpo import dialogue, evaluate, filtering, losses
from starpo import rollout as rollout_lib
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


def context_window(config) -> int:
    """The turns a reply sees besides the prompt prefix, its own included (0 = all): the
    `RolloutSpec.context_window` / `AlgoConfig.context_window` of rollout.context_window_mode
    and rollout.max_context_window (-1 under a limited window: every turn, as RAGEN-2 reads
    it; runs saved before the keys existed had the whole dialogue). Raises ConfigError for a
    mode or window it cannot use."""
    mode = config.rollout.get("context_window_mode", "full")
    max_context_window = config.rollout.get("max_context_window", -1)
    if mode not in CONTEXT_WINDOW_MODES:
        raise ConfigError(f"rollout.context_window_mode must be one of "
                          f"{', '.join(CONTEXT_WINDOW_MODES)}, got {mode!r}")
    if mode.startswith("limited") and max_context_window < 1 and max_context_window != -1:
        raise ConfigError(f"rollout.max_context_window must be >= 1, or -1 for every turn, "
                          f"under context_window_mode={mode}, got {max_context_window}")
    if mode.startswith("limited"):
        return max(max_context_window, 0)
    return {"full": 0, "single_turn": 1}[mode]


# ----------------------------------------------------------------------------- the algorithm
ESTIMATORS = ("gae", "bi_level_gae", "grpo", "gigpo")


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
    """Algorithm knobs (hashable). Defaults are the reference's (docs/reference.md section 4)."""

    # advantages
    adv_estimator: str = "gae"  # gae | bi_level_gae | grpo | gigpo
    gamma: float = 1.0
    lam: float = 1.0
    high_level_gamma: float = 0.95  # turn-level discount of bi_level_gae
    norm_adv_by_std_in_grpo: bool = True
    use_turn_scores: bool = False  # per-turn rewards on each turn's last token
    reward_norm_grouping: str = "state"  # state (group_id) | batch | inductive (env tag)
    reward_norm_method: str = "identity"  # identity | mean | mean_std | asym_clip
    # StarPO-S rollout filter; rows are env_groups x group_size
    group_size: int = 16
    rollout_filter_ratio: float = 0.25  # 1.0 keeps every group
    rollout_filter_type: str = "std"  # std (keep highest in-group std) | std_rev (lowest)
    # RAGEN-2: top_k is the ratio filter above; top_p keeps the highest-std groups up to a share
    rollout_filter_strategy: str = "top_k"  # top_k | top_p | top_k_abs | min_p
    rollout_filter_count: int = 1  # RAGEN-2's rollout_filter_value under top_k_abs: groups kept
    rollout_filter_min_p: float = 0.0  # RAGEN-2's rollout_filter_value under min_p; 0 keeps all
    # what ranks the groups: reward_variance (in-group std) | reward | reward_sum | length
    rollout_filter_metric: str = "reward_variance"
    rollout_filter_top_p: float = 1.0  # RAGEN-2's rollout_filter_value under top_p; 1 keeps all
    rollout_filter_top_p_prob_mode: str = "linear"  # linear (std mass) | softmax
    rollout_filter_include_zero: bool = True  # False drops zero-std groups first
    rollout_filter_selection_eps: float = 0.01  # linear: threshold = p * sum(std) - eps
    # RAGEN-2's filter_loss_scaling: advantages times the kept share of groups (linear), its
    # square root (sqrt), or as they are (none)
    filter_loss_scaling: str = "none"
    # RAGEN-2's other advantage scalings and ablation (`update._reweight`), all off
    soft_advantage_reweight: bool = False  # GRPO: each group's by its std / the largest
    # RAGEN-2's batch_adjust_mode: grow a filtered batch by copies to the mini-batch multiple,
    # or delete rows down to it
    batch_adjust_mode: str = "copy"
    grpo_advantage_length_weight: bool = False  # GRPO: each row's by mean length / its own
    zero_task_advantage: bool = False  # every advantage 0 (no task-driven policy gradient)
    # GiGPO (verl-agent): step-level advantages of identical states, discounted by `gamma`
    gigpo_step_advantage_w: float = 1.0
    gigpo_mode: str = "mean_norm"  # mean_norm | mean_std_norm (both levels)
    # the episode level's group mean and std over steps (an episode once per turn it took),
    # verl-agent's default; False: over episodes (the paper's formula)
    gigpo_episode_over_steps: bool = True
    # policy loss
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 3.0  # dual clip for negative advantages
    entropy_coeff: float = 0.001
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "kl"  # kl (k1) | abs | mse (k2) | low_var_kl (k3)
    use_kl_in_reward: bool = False  # subtract kl_coef * KL from every model token's reward
    kl_penalty: str = "kl"  # estimator of the in-reward KL (same choices)
    kl_coef: float = 0.001
    loss_agg_mode: str = "token-mean"  # one of losses.LOSS_AGG_MODES
    # DAPO's overlong reward shaping (verl's reward_model.overlong_buffer.len / .penalty_factor),
    # per turn: a reply of L model tokens with response_length (max new tokens per turn) Lmax
    # loses factor x (L - (Lmax - len)) / len once L > Lmax - len (factor at Lmax); the turns'
    # penalties add to the episode's score before normalisation. len 0 = off
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    # DAPO's dynamic sampling (verl's algorithm.filter_groups.enable / .max_num_gen_batches /
    # .metric): training.py plays more rollout batches until env_groups groups whose episodes
    # differ in `filter_groups_metric` (or of one episode) are found, or max_num_gen_batches
    # batches were played (>= 1). The metric: "score" (rewards and format penalty, before the
    # overlong penalty) or "success" (the env's; DAPO's recipe filters on accuracy, "acc")
    filter_groups_enable: bool = False
    filter_groups_max_num_gen_batches: int = 10
    filter_groups_metric: str = "score"
    # critic
    cliprange_value: float = 0.5
    # optimisation (AdamW; warm-up is linear over optimizer steps)
    actor_lr: float = 1e-6
    critic_lr: float = 1e-5
    warmup_steps: int = 0
    # cosine decay of the learning rate to min_lr_ratio x lr over this many optimizer updates
    # after the warm-up (0 = constant, the reference's default)
    lr_decay_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01  # AdamW's decoupled decay (the reference's optimizer default)
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    grad_clip: float = 1.0  # global-norm clip
    critic_warmup: int = 0  # rollout batches during which only the critic is trained
    ppo_mini_batch_size: int = 32  # rows (episodes) per optimizer update
    micro_batch_size: int = 4  # rows per forward/backward (gradient accumulation)
    ppo_epochs: int = 1
    online_k: int = 0  # optimizer updates per rollout batch; 0 = ppo_epochs * mini-batches
    # mini-batches from a fresh random permutation of the rows each epoch (True), or the rows
    # split in order as verl does (False): whole groups together, so a single-turn group's
    # prompt runs once in the PPO loss too (`update.static_loss_share`); a mini-batch of every
    # row is taken in order either way
    shuffle_mini_batches: bool = True
    # the update's forwards pack multi-turn rows several to a sequence (`packing.row_plan`)
    pack_rows: bool = True
    # tokens per chunk of the log-prob head; 0 = the whole sequence. Float32 logits of 64
    # tokens at a time (recomputed in the backward pass) rather than of whole rows: Qwen2.5-0.5B
    # at 3584 tokens, micro-batches of 4, 0.5 GB instead of 26 GB
    logit_chunk_size: int = 64
    response_length: int = 400  # the rollout's max new tokens per turn (overlong shaping's Lmax)
    # the rollout's turns per episode: a row holds at most max_turn x response_length sampled
    # tokens, where alone the update runs its output head (`update.head_positions`; 0 = at
    # every position)
    max_turn: int = 0
    # the rollout's sampling temperature: the policy being optimised is the tempered one, so the
    # training forward divides logits by it too (as the reference's actor does)
    temperature: float = 1.0
    # the rollout's context window in turns (`RolloutSpec.context_window`, from
    # rollout.context_window_mode / max_context_window): the training forward masks attention
    # the same way, so log-probs are those of the context each token was sampled in; 0 = off
    context_window: int = 0

    def __post_init__(self):
        """Every knob in its range; messages name the config key (`algorithm.x`, `rollout.x`)."""
        choices = {
            "adv_estimator": ESTIMATORS, "reward_norm_grouping": adv_lib.GROUPINGS,
            "reward_norm_method": adv_lib.NORM_METHODS,
            "rollout_filter_type": filtering.FILTER_TYPES, "kl_loss_type": losses.KL_TYPES,
            "rollout_filter_strategy": filtering.FILTER_STRATEGIES,
            "rollout_filter_top_p_prob_mode": filtering.TOP_P_PROB_MODES,
            "rollout_filter_metric": filtering.FILTER_METRICS,
            "batch_adjust_mode": filtering.ADJUST_MODES,
            "gigpo_mode": adv_lib.GIGPO_MODES,
            "kl_penalty": losses.KL_TYPES, "loss_agg_mode": losses.LOSS_AGG_MODES,
            "filter_groups_metric": filtering.FILTER_GROUPS_METRICS,
            "filter_loss_scaling": filtering.FILTER_LOSS_SCALINGS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{_key(name)}={getattr(self, name)!r} is not one of {allowed}")
        check_rules(_RANGES, lambda name: getattr(self, name), _key)
        if self.adv_estimator == "gigpo" and self.group_size < 2:
            raise ConfigError("algorithm.adv_estimator=gigpo compares episodes of one group: it "
                              f"needs rollout.group_size >= 2, got {self.group_size}")
        if self.overlong_buffer_len > self.response_length:
            raise ConfigError(f"algorithm.overlong_buffer_len {self.overlong_buffer_len} is more "
                              f"than rollout.response_length {self.response_length}")
        if self.ppo_mini_batch_size % self.micro_batch_size:
            raise ConfigError(f"algorithm.ppo_mini_batch_size {self.ppo_mini_batch_size} is not a "
                             f"multiple of algorithm.micro_batch_size {self.micro_batch_size}")

    def replace(self, **changes) -> "AlgoConfig":
        return dataclasses.replace(self, **changes)

    def static_groups(self, num_groups: int) -> int:
        """Groups of a rollout of `num_groups` in the update's batch (`filtering.static_groups`:
        the kept ones for top_k / top_k_abs, every one for the masked strategies)."""
        return filtering.static_groups(num_groups, self.rollout_filter_ratio,
                                       self.rollout_filter_strategy, self.rollout_filter_count,
                                       self.rollout_filter_include_zero)

    @property
    def masks_rows(self) -> bool:
        """Whether the rollout filter masks rows rather than gathering the kept ones
        (`filtering.masks_rows`)."""
        return filtering.masks_rows(self.rollout_filter_strategy,
                                    self.rollout_filter_include_zero)

    @property
    def uses_critic(self) -> bool:
        return self.adv_estimator not in ("grpo", "gigpo")

    @property
    def uses_reference(self) -> bool:
        return self.use_kl_loss or self.use_kl_in_reward


def _key(name: str) -> str:
    """The config key of an AlgoConfig field (group size and temperature come from `rollout`)."""
    rollout = ("group_size", "temperature", "response_length", "context_window", "max_turn")
    return f"rollout.{name}" if name in rollout else f"algorithm.{name}"


_COUNT, _SIZE, _RATE = within(0), within(1), within(0, 1)
_BETA = within(0, 1, hi_open=True)
# field -> rule (`check_rules`)
_RANGES = {
    "gamma": _RATE, "lam": _RATE, "high_level_gamma": _RATE,
    "group_size": _SIZE, "context_window": _COUNT, "max_turn": _COUNT,
    "rollout_filter_ratio": within(0, 1, lo_open=True),
    "rollout_filter_top_p": within(0, 1, lo_open=True),
    "rollout_filter_count": _SIZE, "rollout_filter_min_p": _RATE,
    "rollout_filter_selection_eps": _COUNT, "gigpo_step_advantage_w": _COUNT,
    "clip_ratio_low": _COUNT, "clip_ratio_high": _COUNT,
    "clip_ratio_c": within(1, lo_open=True),  # the dual clip bounds a ratio above 1
    "entropy_coeff": _COUNT, "kl_loss_coef": _COUNT, "kl_coef": _COUNT,
    "cliprange_value": within(0, lo_open=True),
    "actor_lr": _COUNT, "critic_lr": _COUNT, "warmup_steps": _COUNT, "lr_decay_steps": _COUNT,
    "min_lr_ratio": _RATE, "weight_decay": _COUNT, "adam_b1": _BETA, "adam_b2": _BETA,
    "grad_clip": within(0, lo_open=True), "critic_warmup": _COUNT,
    "ppo_mini_batch_size": _SIZE, "micro_batch_size": _SIZE, "ppo_epochs": _SIZE,
    "online_k": _COUNT, "logit_chunk_size": _COUNT,
    "overlong_buffer_len": _COUNT, "overlong_penalty_factor": _COUNT, "response_length": _SIZE,
    "filter_groups_max_num_gen_batches": _SIZE,
    # training samples from the tempered policy and divides the logits by it
    "temperature": within(0, lo_open=True, note="greedy 0 is for val.temperature"),
}


def algo_config(config) -> AlgoConfig:
    """The update's knobs: `config.algorithm` plus group size, temperature, reply budget and
    context window of the rollout."""
    return _algo(config, context_window(config))


def _algo(config, window: int) -> AlgoConfig:
    return AlgoConfig(**config.algorithm.to_dict(), group_size=config.rollout.group_size,
                      temperature=config.rollout.temperature,
                      response_length=config.rollout.response_length, context_window=window,
                      max_turn=config.rollout.max_turn)


def sft_algo(config) -> AlgoConfig:
    """The run's algorithm knobs with SFT's learning rate, warm-up and decay (no critic)."""
    return _sft_algo(algo_config(config), config.sft)


def _sft_algo(algo: AlgoConfig, s) -> AlgoConfig:
    return algo.replace(adv_estimator="grpo", actor_lr=float(s.lr),
                        warmup_steps=int(s.warmup_steps),
                        lr_decay_steps=int(s.get("lr_decay_steps", 0)),
                        min_lr_ratio=float(s.get("min_lr_ratio", 0.0)))


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
        prefill_dtype=prefill_dtype, decode_windows=r.get("decode_windows", 1),
        context_window=window)


def batch_size(part) -> int:
    """Episodes played at once of `config.rollout` or `config.val`: its `batch_size`, 0 (or a
    run saved before the key existed) meaning all env_groups x group_size (checked)."""
    return rollout_lib.chunk_size(part.env_groups * part.group_size, part.get("batch_size", 0),
                                  part.group_size)


# ----------------------------------------------------------------------------- the envs
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
    """model.lora as `lora.attach`'s keywords, or None where it is off (rank 0, or a run saved
    before the key existed)."""
    c = config.model.get("lora")
    if c is None or not c.rank:
        return None
    return dict(rank=c.rank, alpha=c.alpha, targets=c.target_modules)


# ----------------------------------------------------------------------------- saved runs
def config_from_json(text: str):
    """A run's saved config.json back as a locked ConfigDict (lists back to tuples)."""

    def tuples(x):
        if isinstance(x, dict):
            return {k: tuples(v) for k, v in x.items()}
        return tuple(tuples(v) for v in x) if isinstance(x, list) else x

    c = ml_collections.ConfigDict(tuples(json.loads(text)))
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
class BatchSpec:
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

    batch: BatchSpec
    tags: tuple
    before_train: bool
    test_freq: int


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    """`config.trainer`: the RL phase's length, checkpoints, logging and warnings."""

    total_steps: int
    save_freq: int
    keep_checkpoints: int
    log_samples: int
    context_bucket: int
    fast_compile: bool
    memory_check: bool
    offload_state: bool  # optimizer moments and critic on the host while the actor samples
    stop_on_collapse: bool
    empty_stop_steps: int  # trainer.rollout_filter_empty_stop_steps (0 = never)
    reward_std_stop_steps: int  # RAGEN-2's reward-variance stop (0 = never)
    low_success_stop_validations: int  # RAGEN-2's low-validation-success stop (0 = never)
    collapse_window: int
    collapse_mi_freq: int  # 0 = the template-collapse diagnostic is off
    collapse_mi_samples: int
    collapse_mi_micro_batch: int
    collapse_mi_warn: float
    collapse_mi_multi_turn: bool
    gradient_analysis_every: int  # RAGEN-2's gradient analysis (0 = off)
    gradient_analysis_num_buckets: int
    gradient_analysis_bucket_mode: str


@dataclasses.dataclass(frozen=True)
class SftSpec:
    """`config.sft`: the SFT phase (steps 0 = none) and its algorithm (`sft_algo`)."""

    steps: int
    env_groups: int
    actions_per_turn: int
    test_freq: int
    save_freq: int
    algo: AlgoConfig
    demo_steps: int  # steps whose demonstrations are played in one call


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
    batch: BatchSpec
    mix: tuple
    context_window: int
    val: ValSpec
    trainer: TrainerSpec
    sft: SftSpec
    model: ModelSpec
    mesh: tuple  # (data, fsdp, tensor)
    envs: dict  # tag -> env of every tag the run plays (`make_env`)


def _batch(part) -> BatchSpec:
    return BatchSpec(part.env_groups, part.group_size, batch_size(part), part.temperature)


def _trainer(t) -> TrainerSpec:
    return TrainerSpec(
        t.total_steps, t.save_freq, t.keep_checkpoints, t.log_samples, t.context_bucket,
        t.fast_compile, t.get("memory_check", True), t.get("offload_state", False),
        t.stop_on_collapse,
        t.get("rollout_filter_empty_stop_steps", 0), t.get("reward_std_stop_steps", 0),
        t.get("low_success_stop_validations", 0), t.collapse_window,
        t.get("collapse_mi_freq", 0), t.collapse_mi_samples, t.collapse_mi_micro_batch,
        t.collapse_mi_warn, t.get("collapse_mi_multi_turn", False),
        t.get("gradient_analysis_every", 0), t.get("gradient_analysis_num_buckets", 6),
        t.get("gradient_analysis_bucket_mode", "quantile"))


def read(config) -> RunSpec:
    """The run of a (checked: `config_check.check`) config as typed, frozen specs: each
    section read once, here."""
    s, m, v, mesh = config.sft, config.model, config.val, config.mesh
    window, dtypes = context_window(config), phase_dtypes(config)
    algo = _algo(config, window)
    sft = SftSpec(s.steps, s.env_groups, s.actions_per_turn, s.test_freq, s.save_freq,
                  _sft_algo(algo, s), s.get("demo_steps", 16))  # (a run saved before the key: 16)
    model = ModelSpec(m.remat, m.get("remat_policy", "full"), m.critic_path,
                      lora_settings(config), dtypes)
    mix, val = env_mix(config), ValSpec(_batch(v), val_tags(config), v.before_train, v.test_freq)
    tags = (config.env.name,) + tuple(t for t, _ in mix) + val.tags
    rollout = _rollout_spec(config.rollout, dtypes["prefill"], window)
    return RunSpec(config, config.seed, algo, rollout, _batch(config.rollout), mix, window, val,
                   _trainer(config.trainer), sft, model, (mesh.data, mesh.fsdp, mesh.tensor),
                   {tag: make_env(config, tag) for tag in tags})
