"""Every knob of a run's config, once: its default, its rule, one line of doc, whether a resumed
run may change it, and what a run saved before it existed had.

    c = ml_collections.ConfigDict(schema.defaults())   # configs/common.py: the paper's run
    schema.check(lambda key: ...)                      # every knob's own rule (config_check)
    schema.read(schema.Trainer, config.trainer)        # a section as its typed, frozen spec
    schema.upgrade(saved)                              # a config.json saved before a knob was

A section is a frozen dataclass whose fields are the knobs (`knob(...)`), so the typed spec the
code reads is the schema itself. The defaults are the reference's (docs/reference.md, section
4) at the paper's size; a config file's variants change them. docs/knobs.md is generated from
here (`python -m starpo.schema`; a test keeps it current). Rules that span several knobs
(a mini-batch dividing the filtered batch, ...) are `config_check`'s; those needing the env
registry or the model loader too. This module imports nothing from the package, so that
every other one (and the config files) can take their choices from it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import typing


class ConfigError(ValueError):
    """A config value the run cannot use; the message is one line naming the key."""


# ----------------------------------------------------------------------------- rules
# A rule is (predicate, what the value must be); a value failing it, or of a type it cannot
# test, is "<key> must be <need>, got <value>".
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


def check_value(key: str, rule, value) -> None:
    """ConfigError "<key> must be <need>, got <value>" where `value` fails `rule`."""
    ok, need = rule
    try:
        good = bool(ok(value))
    except TypeError:
        good = False
    if not good:
        raise ConfigError(f"{key} must be {need}, got {value!r}")


COUNT, SIZE, RATE = within(0), within(1), within(0, 1)
POSITIVE = within(0, lo_open=True)
BETA = within(0, 1, hi_open=True)
SHARE = within(0, 1, lo_open=True)
NEVER = within(0, note="0 = never")
OFF = within(0, note="0 = off")
CHUNK = within(0, note="0 = all env_groups x group_size at once")
AXIS = (lambda v: v == -1 or v >= 1, ">= 1 or -1 (all the devices the others leave)")
FINITE = (lambda v: math.isfinite(v), "a finite number")
# training samples from the tempered policy and divides the logits by it
TEMPERATURE = within(0, lo_open=True, note="greedy 0 is for val.temperature")

# ----------------------------------------------------------------------------- choices
# (the modules that implement them import them from here)
ESTIMATORS = ("gae", "bi_level_gae", "grpo", "gigpo")
# bi-level GAE's turns: every reply that happened, or (RAGEN's) each token with a non-zero reward
BI_LEVEL_TURNS = ("every", "reward")
GROUPINGS = ("state", "batch", "inductive")
NORM_METHODS = ("identity", "mean", "mean_std", "asym_clip")
GIGPO_MODES = ("mean_norm", "mean_std_norm")  # verl-agent's `algorithm.gigpo.mode`
FILTER_TYPES = ("std", "std_rev")  # RAGEN-2 calls these `largest` / `smallest`
FILTER_STRATEGIES = ("top_k", "top_p", "top_k_abs", "min_p")
# what ranks the groups (RAGEN-2's rollout_filter_metric): in-group reward std, mean, sum, or
# the mean reply length (model tokens an episode)
FILTER_METRICS = ("reward_variance", "reward", "reward_sum", "length")
TOP_P_PROB_MODES = ("linear", "softmax")
# RAGEN-2's filter_loss_scaling: advantages times 1, the kept share of groups, or its root
FILTER_LOSS_SCALINGS = ("none", "linear", "sqrt")
ADJUST_MODES = ("copy", "delete")  # RAGEN-2's batch_adjust_mode
FILTER_GROUPS_METRICS = ("score", "success")  # what DAPO's dynamic sampling compares
KL_TYPES = ("kl", "abs", "mse", "low_var_kl")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")
BUCKET_MODES = ("quantile", "fixed_rv")  # RAGEN-2's gradient analysis buckets
# the whole dialogue, the last max_context_window turns (RAGEN-2 calls it limited_multi_turn:
# both names are accepted), the current turn
CONTEXT_WINDOW_MODES = ("full", "limited", "limited_multi_turn", "single_turn")
DTYPES = ("auto", "float32", "bfloat16")
REMAT_POLICIES = ("full", "save_dense")
ATTENTION = ("auto", "cpu", "xla", "cudnn", "splash")
DECODE_ATTENTION = ("auto", "xla", "pallas", "pallas_tpu")
DISTRIBUTED = ("auto", "on", "off")

# ----------------------------------------------------------------------------- knobs
_ABSENT = object()  # `before` unset: runs saved without the key cannot be resumed


def knob(default, rule=None, doc="", *, resume=False, before=_ABSENT):
    """One knob: its default, rule, doc line, whether a resumed run may change it, and the value
    a run saved before the key existed had (`upgrade`)."""
    return dataclasses.field(default=default, metadata=dict(
        rule=rule, doc=doc, resume=resume, before=before))


def section(cls, doc=""):
    """A nested section (model.lora, ...), its knobs in `cls`."""
    return dataclasses.field(default_factory=cls, metadata=dict(section=cls, doc=doc))


_frozen = dataclasses.dataclass(frozen=True)


@_frozen
class Lora:
    """LoRA (RAGEN's lora.rank / alpha / target_modules; starpo/lora.py)."""

    rank: int = knob(0, within(0, note="0 = off"),
                     "0 = every weight trains; > 0 trains low-rank adapters, base weights frozen",
                     before=0)
    alpha: float = knob(16.0, POSITIVE, "adapter scale alpha / rank", before=16.0)
    target_modules: str = knob(
        "all-linear", None, "the adapted projections: all-linear, or a comma list of "
        "q,k,v,o,gate,up,down (or q_proj..down_proj), lm_head, embed", before="all-linear")


@_frozen
class Model:
    """The policy's weights and how they are computed."""

    path: str = knob("smollm2-135m-instruct", None,
                     "embedded name, HF directory, .gguf file, tiny:... or random:NAME")
    critic_path: str = knob("", None, "'' = the actor's initial weights plus a zero value head "
                            "(the reference)")
    dtype: str = knob("auto", one_of(*DTYPES),
                      "matmul inputs; auto = bfloat16 on GPU/TPU, on CPU float32 for decoding and "
                      "bfloat16 where the CPU multiplies it natively; master weights float32")
    remat: bool = knob(True, None, "rematerialise layers in the update: memory for ~30% more "
                       "compute")
    remat_policy: str = knob("full", one_of(*REMAT_POLICIES),
                             "full: a layer keeps its input; save_dense: also its dense matmuls' "
                             "outputs (less recompute, more memory)", resume=True, before="full")
    attention: str = knob("auto", one_of(*ATTENTION),
                          "whole-sequence attention and dense kernels (same numbers): auto = cpu "
                          "on CPU, cudnn on NVIDIA GPUs where it takes the model, splash on TPUs",
                          resume=True, before="auto")
    decode_attention: str = knob("auto", one_of(*DECODE_ATTENTION),
                                 "a decode step's attention over the cache (same numbers): auto = "
                                 "pallas_tpu on TPUs, else xla", resume=True, before="xla")
    init_from: str = knob("", None, "a run's workdir or checkpoint of the same model.path: the "
                          "actor starts from its weights (e.g. an SFT run)", before="")
    lora: Lora = section(Lora, "LoRA adapters; a run saved before it trained every weight")


@_frozen
class Mesh:
    """The device mesh (starpo/sharding.py): rows over data x fsdp, weights and optimiser states
    over fsdp (ZeRO-3) and tensor. A checkpoint restores onto any mesh."""

    data: int = knob(1, AXIS, "data-parallel axis", resume=True)
    fsdp: int = knob(-1, AXIS, "fully sharded axis; -1 = the devices the others leave",
                     resume=True)
    tensor: int = knob(1, AXIS, "tensor-parallel axis (heads, MLP, vocabulary)", resume=True)
    distributed: str = knob("auto", one_of(*DISTRIBUTED),
                            "jax.distributed.initialize(): auto = when the keys below or the "
                            "cluster announce several processes", resume=True)
    coordinator_address: str = knob("", None, "HOST:PORT of process 0; '' = JAX detects it",
                                    resume=True, before="")
    num_processes: int = knob(0, within(0, note="0 = JAX detects it"), "processes in the run",
                              resume=True, before=0)
    process_id: int = knob(-1, within(-1, note="-1 = JAX detects it"), "this process's index",
                           resume=True, before=-1)
    init_timeout_s: int = knob(300, SIZE, "seconds to wait for every process to join",
                               resume=True, before=300)
    heartbeat_timeout_s: int = knob(60, within(2),
                                    "a process silent this long stops the others (exit 3)",
                                    resume=True, before=60)


@_frozen
class Env:
    """The training env (checked against the env registry by `config_check`)."""

    name: str = knob("FrozenLake", None, "the training env variant (envs.NAMES)")
    options: dict = dataclasses.field(default_factory=dict, metadata=dict(
        rule=None, doc="envs.make(name, **options): every option of the env, type-checked",
        resume=False, before=_ABSENT, free=True))
    mix: str = knob("", None, "several variants in each batch, TAG:GROUPS,... summing to "
                    "rollout.env_groups; '' = all groups of name", before="")


# Env options added after runs were saved: filled only where the env has the option. Sudoku
# runs before its 4x4 grid played the 9x9 one.
OPTIONS_BEFORE = {"size": 9}


@_frozen
class Rollout:
    """The training batch and how its episodes are played."""

    env_groups: int = knob(8, SIZE, "distinct initial states per batch")
    group_size: int = knob(16, SIZE, "episodes per initial state (a prompt group)")
    max_turn: int = knob(5, SIZE, "turns per episode")
    max_actions_per_turn: int = knob(0, within(0, note="0 = the env's budget"),
                                     "actions per reply (5 grid games, 1 Bandit)")
    max_actions_per_traj: int = knob(0, within(0, note="0 = the env's budget"),
                                     "actions per episode (10 grid games, 1 Bandit)")
    response_length: int = knob(400, SIZE, "new tokens per turn")
    max_context: int = knob(3600, within(16), "tokens per episode (prompt, observations, "
                            "replies)")
    temperature: float = knob(1.0, TEMPERATURE, "sampling temperature (the update's policy is "
                              "the tempered one)")
    top_p: float = knob(1.0, SHARE, "nucleus sampling")
    top_k: int = knob(0, within(0, note="0 = off"), "top-k sampling")
    enable_think: bool = knob(True, None, "prime replies with <think> (else <answer>)")
    context_window_mode: str = knob(
        "full", one_of(*CONTEXT_WINDOW_MODES), "what a reply sees: the whole dialogue; the "
        "prompt and the last max_context_window turns; the prompt and this turn", before="full")
    max_context_window: int = knob(-1, (lambda v: v == -1 or v >= 1, ">= 1 or -1 (unset)"),
                                   "turns seen under limited; -1 = all", before=-1)
    decode_windows: int = knob(4, SIZE, "a turn reads one of this many windows of the context "
                               "(same samples, less work early; 1 = all of it)", resume=True,
                               before=1)
    batch_size: int = knob(0, CHUNK, "episodes played at once, whole groups dividing the batch "
                           "(each chunk samples from its own key)", before=0)


@_frozen
class Val:
    """The held-out validation sets (fixed, disjoint from training)."""

    env_groups: int = knob(256, SIZE, "held-out initial states")
    group_size: int = knob(1, SIZE, "episodes per state")
    temperature: float = knob(0.5, within(0, note="0 = greedy"), "sampling temperature")
    test_freq: int = knob(10, NEVER, "validate every this many steps", resume=True)
    before_train: bool = knob(True, None, "and before the first step", resume=True)
    tags: str = knob("", None, "comma-separated env variants; '' = the training env")
    batch_size: int = knob(128, CHUNK, "episodes played at once (memory and the sampling "
                           "stream only; 128 = the training batch, one compiled rollout)",
                           resume=True, before=0)


@_frozen
class Algorithm:
    """The update's knobs under the reference's names (verl's, RAGEN-2's, verl-agent's)."""

    # advantages
    adv_estimator: str = knob("gae", one_of(*ESTIMATORS), "gae and bi_level_gae train a critic")
    gamma: float = knob(1.0, RATE, "discount (per token under GAE, per turn under GiGPO)")
    lam: float = knob(1.0, RATE, "GAE's lambda")
    high_level_gamma: float = knob(0.95, RATE, "turn-level discount of bi_level_gae")
    bi_level_turns: str = knob("every", one_of(*BI_LEVEL_TURNS), "bi_level_gae's turns: every "
                               "reply, or RAGEN's tokens with a non-zero reward (plain GAE under "
                               "a final reward alone)", before="every")
    norm_adv_by_std_in_grpo: bool = knob(True, None, "GRPO divides by the group's std "
                                         "(False: Dr.GRPO)")
    use_turn_scores: bool = knob(False, None, "per-turn rewards on each turn's last token")
    reward_norm_grouping: str = knob("state", one_of(*GROUPINGS),
                                     "scores normalised per group_id, over the batch, or per "
                                     "env tag")
    reward_norm_method: str = knob("identity", one_of(*NORM_METHODS), "episode score "
                                   "normalisation")
    # the StarPO-S rollout filter and RAGEN-2's
    rollout_filter_ratio: float = knob(0.25, SHARE, "top_k: the share of groups kept (1 keeps "
                                       "all)")
    rollout_filter_type: str = knob("std", one_of(*FILTER_TYPES), "keep the highest (std) or "
                                    "lowest (std_rev) scores")
    rollout_filter_strategy: str = knob("top_k", one_of(*FILTER_STRATEGIES), "how groups are "
                                        "kept (filtering.py)", before="top_k")
    rollout_filter_count: int = knob(1, SIZE, "top_k_abs: groups kept (RAGEN-2's "
                                     "rollout_filter_value)", before=1)
    rollout_filter_min_p: float = knob(0.0, RATE, "min_p: keep groups scoring >= this x the "
                                       "best; 0 keeps all", before=0.0)
    rollout_filter_metric: str = knob("reward_variance", one_of(*FILTER_METRICS),
                                      "what ranks the groups", before="reward_variance")
    rollout_filter_top_p: float = knob(1.0, SHARE, "top_p: keep groups up to this share of the "
                                       "score mass (RAGEN-2 recommends 0.9)", before=1.0)
    rollout_filter_top_p_prob_mode: str = knob("linear", one_of(*TOP_P_PROB_MODES),
                                               "top_p's mass: the scores, or their softmax",
                                               before="linear")
    rollout_filter_include_zero: bool = knob(True, None, "False drops zero-std groups first",
                                             before=True)
    rollout_filter_selection_eps: float = knob(0.01, COUNT, "linear top_p: threshold = p x "
                                               "sum - eps", before=0.01)
    filter_loss_scaling: str = knob("none", one_of(*FILTER_LOSS_SCALINGS),
                                    "advantages x the kept share of groups (linear) or its root",
                                    before="none")
    soft_advantage_reweight: bool = knob(False, None, "GRPO: each group's advantages x its std "
                                         "/ the largest kept", before=False)
    batch_adjust_mode: str = knob("copy", one_of(*ADJUST_MODES), "a filtered batch grows by "
                                  "copies to a mini-batch multiple, or loses rows",
                                  before="copy")
    grpo_advantage_length_weight: bool = knob(False, None, "GRPO: each row's advantages x mean "
                                              "length / its own", before=False)
    zero_task_advantage: bool = knob(False, None, "RAGEN-2's ablation: every advantage 0",
                                     before=False)
    # GiGPO (verl-agent)
    gigpo_step_advantage_w: float = knob(1.0, COUNT, "weight of the step-level advantage of "
                                         "identical env states", before=1.0)
    gigpo_mode: str = knob("mean_norm", one_of(*GIGPO_MODES), "both levels' normalisation",
                           before="mean_norm")
    gigpo_episode_over_steps: bool = knob(True, None, "episode-level statistics over steps "
                                          "(verl-agent's) or, False, over episodes",
                                          before=True)
    # policy loss
    clip_ratio_low: float = knob(0.2, COUNT, "PPO clip below 1")
    clip_ratio_high: float = knob(0.28, COUNT, "PPO clip above 1 (decoupled: clip-higher)")
    clip_ratio_c: float = knob(3.0, within(1, lo_open=True), "dual clip for negative "
                               "advantages")
    entropy_coeff: float = knob(0.001, COUNT, "entropy bonus")
    use_kl_loss: bool = knob(False, None, "a KL term to the initial policy in the loss")
    kl_loss_coef: float = knob(0.0, COUNT, "its weight")
    kl_loss_type: str = knob("kl", one_of(*KL_TYPES), "its estimator: k1, abs, k2, k3")
    use_kl_in_reward: bool = knob(False, None, "subtract kl_coef x KL from every model token's "
                                  "reward")
    kl_penalty: str = knob("kl", one_of(*KL_TYPES), "the in-reward KL's estimator")
    kl_coef: float = knob(0.001, COUNT, "its weight")
    loss_agg_mode: str = knob("token-mean", one_of(*LOSS_AGG_MODES), "how token losses "
                              "average")
    # DAPO
    overlong_buffer_len: int = knob(0, COUNT, "DAPO: a reply within this many tokens of "
                                    "response_length loses up to the factor; 0 = off", before=0)
    overlong_penalty_factor: float = knob(1.0, COUNT, "its largest penalty", before=1.0)
    filter_groups_enable: bool = knob(False, None, "DAPO's dynamic sampling: more batches "
                                      "until env_groups groups differ", before=False)
    filter_groups_max_num_gen_batches: int = knob(10, SIZE, "at most this many batches", before=10)
    filter_groups_metric: str = knob("score", one_of(*FILTER_GROUPS_METRICS),
                                     "what must differ in a group", before="score")
    # critic and optimiser
    cliprange_value: float = knob(0.5, POSITIVE, "the critic's value clip")
    actor_lr: float = knob(1e-6, COUNT, "AdamW")
    critic_lr: float = knob(1e-5, COUNT, "AdamW")
    warmup_steps: int = knob(0, COUNT, "linear warm-up, in optimizer updates")
    lr_decay_steps: int = knob(0, COUNT, "then a cosine decay over this many updates; 0 = "
                               "constant", before=0)
    min_lr_ratio: float = knob(0.0, RATE, "the decay's end, x lr", before=0.0)
    weight_decay: float = knob(0.01, COUNT, "AdamW's decoupled decay")
    adam_b1: float = knob(0.9, BETA, "")
    adam_b2: float = knob(0.999, BETA, "")
    grad_clip: float = knob(1.0, POSITIVE, "global-norm clip")
    critic_warmup: int = knob(0, COUNT, "rollout batches during which only the critic trains")
    ppo_mini_batch_size: int = knob(32, SIZE, "rows (episodes) per optimizer update")
    micro_batch_size: int = knob(4, SIZE, "rows per forward/backward (gradient accumulation)")
    ppo_epochs: int = knob(1, SIZE, "passes over the batch")
    online_k: int = knob(0, COUNT, "optimizer updates per batch; 0 = ppo_epochs x "
                         "mini-batches")
    shuffle_mini_batches: bool = knob(True, None, "a fresh permutation each epoch; False: in "
                                      "order, as verl (docs/differences.md)", before=True)
    pack_rows: bool = knob(True, None, "multi-turn rows several to a sequence in the update "
                           "(same numbers, fewer forwards)", before=True)
    logit_chunk_size: int = knob(64, COUNT, "tokens per chunk of the log-prob head (0 = whole "
                                 "rows), recomputed in the backward", resume=True)


@_frozen
class Sft:
    """Supervised fine-tuning on solver demonstrations before RL (starpo/sft.py)."""

    steps: int = knob(0, within(0, note="0 = no SFT phase"), "SFT steps before RL, in "
                      "<workdir>/sft", before=0)
    env_groups: int = knob(32, SIZE, "levels per step, each played once by the solver",
                           before=32)
    lr: float = knob(1e-5, POSITIVE, "AdamW (the algorithm's clip, betas, decay)", before=1e-5)
    warmup_steps: int = knob(0, COUNT, "linear warm-up", before=0)
    lr_decay_steps: int = knob(0, within(0, note="0 = constant"), "cosine decay after it",
                               before=0)
    min_lr_ratio: float = knob(0.0, RATE, "the decay's end, x lr", before=0.0)
    actions_per_turn: int = knob(0, within(0, note="0 = the turn's action budget"),
                                 "moves per demonstration reply", before=0)
    test_freq: int = knob(10, NEVER, "validate every this many steps and at the end",
                          resume=True, before=10)
    save_freq: int = knob(10, within(0, note="0 = only at the end"), "checkpoint every this "
                          "many steps", resume=True, before=10)
    demo_steps: int = knob(16, SIZE, "steps whose demonstrations the solver plays in one call "
                           "(same numbers)", resume=True, before=16)


@_frozen
class Trainer:
    """The RL phase's length, checkpoints, logging, monitors and memory."""

    total_steps: int = knob(200, COUNT, "rollout -> update iterations", resume=True)
    save_freq: int = knob(10, within(0, note="0 = only at the end"), "checkpoint every this "
                          "many steps, at the end and on SIGTERM", resume=True)
    keep_checkpoints: int = knob(3, SIZE, "", resume=True)
    log_samples: int = knob(1, COUNT, "validation dialogues written as text", resume=True)
    stop_on_collapse: bool = knob(False, None, "stop when the Echo Trap warning fires",
                                  resume=True)
    rollout_filter_empty_stop_steps: int = knob(5, NEVER, "stop after this many steps whose "
                                                "filter kept no group (RAGEN-2's)",
                                                resume=True, before=0)
    reward_std_stop_steps: int = knob(0, NEVER, "RAGEN-2's stop: in-group std below a tenth of "
                                      "its start this many steps (RAGEN-2: 10)", resume=True,
                                      before=0)
    low_success_stop_validations: int = knob(0, NEVER, "RAGEN-2's stop: validation success "
                                             "below 1% this many times (RAGEN-2: 5)",
                                             resume=True, before=0)
    gradient_analysis_every: int = knob(0, OFF, "RAGEN-2's gradient analysis on step 1 and "
                                        "every this many (RAGEN-2: 50)", resume=True, before=0)
    gradient_analysis_num_buckets: int = knob(6, SIZE, "buckets of kept groups by reward std",
                                              resume=True, before=6)
    gradient_analysis_bucket_mode: str = knob("quantile", one_of(*BUCKET_MODES), "",
                                              resume=True, before="quantile")
    collapse_window: int = knob(10, SIZE, "steps of history the Echo Trap detector compares")
    collapse_mi_freq: int = knob(0, OFF, "RAGEN-2's template-collapse diagnostic on step 1 and "
                                 "every this many (RAGEN-2: 5)", resume=True, before=0)
    collapse_mi_samples: int = knob(64, SIZE, "at most this many episodes' reasoning",
                                    resume=True, before=64)
    collapse_mi_micro_batch: int = knob(16, SIZE, "sequences per forward", resume=True,
                                        before=16)
    collapse_mi_multi_turn: bool = knob(True, None, "also RAGEN-2's trajectory-uniform sample",
                                        resume=True, before=False)
    collapse_mi_warn: float = knob(0.01, FINITE, "warn below this many nats per reasoning "
                                   "token", resume=True, before=0.01)
    fast_compile: bool = knob(False, None, "XLA's cheapest optimisation (tiny models compile "
                              "~3x faster)")
    memory_check: bool = knob(True, None, "stop at start where the memory plan exceeds the "
                              "device (False: warn)", resume=True, before=True)
    offload_state: bool = knob(False, None, "AdamW moments and critic in host memory while the "
                               "actor samples (same numbers)", resume=True, before=False)
    context_bucket: int = knob(128, within(0, note="0 = always max_context"),
                               "the update trains on the longest episode rounded up to this",
                               resume=True)


@_frozen
class Config:
    """A whole run (the keys of config.json)."""

    seed: int = knob(0, within(0, 2**31 - 1), "sampling, mini-batch order and training env "
                     "seeds")
    model: Model = section(Model)
    mesh: Mesh = section(Mesh)
    env: Env = section(Env)
    rollout: Rollout = section(Rollout)
    val: Val = section(Val)
    algorithm: Algorithm = section(Algorithm)
    sft: Sft = section(Sft, "a run saved before it had no SFT phase")
    trainer: Trainer = section(Trainer)


# ----------------------------------------------------------------------------- walking it
def knobs(cls=Config, prefix=""):
    """(key, field) of every knob under `cls`, in order ("model.lora.rank", ...)."""
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            yield from knobs(f.metadata["section"], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f


def defaults(cls=Config) -> dict:
    """The nested dict of every default (a free section such as env.options empty)."""
    out = {}
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            out[f.name] = defaults(f.metadata["section"])
        else:
            out[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return out


def check(get) -> None:
    """ConfigError for the first knob whose value `get(key)` fails its rule."""
    for key, f in knobs():
        if f.metadata["rule"] is not None:
            check_value(key, f.metadata["rule"], get(key))


def check_knob(key: str, value) -> None:
    """ConfigError where `value` fails the rule of the knob `key` (e.g. "rollout.top_p")."""
    rule = dict(knobs())[key].metadata["rule"]
    if rule is not None:
        check_value(key, rule, value)


def check_fields(obj, key=lambda name: name) -> None:
    """Each field of the dataclass `obj` against its rule, `key(name)` naming it."""
    for f in dataclasses.fields(obj):
        if f.metadata.get("rule") is not None:
            check_value(key(f.name), f.metadata["rule"], getattr(obj, f.name))


def read(cls, part, **extra):
    """`cls` (a section, or a dataclass extending one) of a config section `part` (a ConfigDict
    or a dict): each knob's value, nested sections read alike; `extra` sets the rest."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in extra:
            continue
        value = part[f.name]
        if "section" in f.metadata:
            value = read(f.metadata["section"], value)
        out[f.name] = value
    return cls(**out, **extra)


def resumable() -> tuple[str, ...]:
    """The keys a resumed run may change (only how or when the same numbers are computed)."""
    return tuple(key for key, f in knobs() if f.metadata["resume"])


def upgrade(saved: dict) -> dict:
    """A config dict saved by an older version, with each key it lacks that has a `before`
    value filled in with that value (the behaviour the run had); keys without one stay absent.
    Env options (`OPTIONS_BEFORE`) are the caller's: it knows the env's options."""
    out = copy.deepcopy(saved)
    for key, f in knobs():
        if f.metadata["before"] is _ABSENT:
            continue
        *path, name = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node.setdefault(name, f.metadata["before"])
    return out


def _type(cls, f) -> str:
    hint = typing.get_type_hints(cls)[f.name]
    return getattr(hint, "__name__", str(hint))


def markdown() -> str:
    """docs/knobs.md: a table per section."""
    lines = ["# Every knob", "",
             "Generated from `starpo/schema.py` (`python -m starpo.schema > docs/knobs.md`; "
             "a test keeps it current). Defaults are the paper's run; a config file's variants "
             "change some. *resume*: a resumed run may change it (it changes how or when the "
             "same numbers are computed, not what is trained). *saved before*: what a run saved "
             "before the key existed had; a key without one must be in a saved config.", ""]

    def table(cls, prefix):
        doc = " ".join((cls.__doc__ or "").split())
        name = prefix.rstrip(".")
        lines.extend([f"## `{name}`" if name else "## The top level", "", doc, "",
                      "| knob | default | must be | resume | saved before | what |",
                      "|---|---|---|---|---|---|"])
        subs = []
        for f in dataclasses.fields(cls):
            if "section" in f.metadata:
                subs.append((f.metadata["section"], f"{prefix}{f.name}."))
                continue
            m = f.metadata
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            need = m["rule"][1] if m["rule"] else _type(cls, f)
            before = "" if m["before"] is _ABSENT else f"`{m['before']!r}`"
            lines.append(f"| `{prefix}{f.name}` | `{default!r}` | {need} | "
                         f"{'yes' if m['resume'] else ''} | {before} | {m['doc']} |")
        lines.append("")
        for sub, p in subs:
            table(sub, p)

    table(Config, "")
    lines.extend(["## env options", "", "Each env's own options, with its defaults, are "
                  "stated in its config file (`configs/<env>.py`) and documented in "
                  "[models_envs.md](models_envs.md). Options added later, filled in a saved run "
                  "where the env has them: " + ", ".join(f"`{k}` = `{v!r}`"
                                                           for k, v in OPTIONS_BEFORE.items())
                  + ".", ""])
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
