"""The config every env shares: the reference's knobs under the reference's names.

`base(env)` returns the paper-sized run (docs/reference.md section 4) for an accelerator; each
env file (`configs/frozenlake.py`, ...) adjusts it and adds variants picked after a colon:

    python launch/train.py --config=configs/frozenlake.py          # the paper's settings
    python launch/train.py --config=configs/frozenlake.py:cpu      # a 2-core laptop
    python launch/train.py --config=configs/frozenlake.py:tiny     # random-init tiny model, minutes
    python launch/train.py --config=configs/frozenlake.py:cpu --config.rollout.temperature=0.7
    python launch/train.py --config=configs/bandit.py:tiny+dapo    # plus DAPO's settings (dapo())

Configs are locked: an override of a key that does not exist, or with a value of the wrong type,
fails at start. Each knob's default, rule and doc line is in `starpo/schema.py` (the one place a
knob is written); this file holds the variants and presets.
"""

import ml_collections

from starpo import schema


def base(env: str, options: dict) -> ml_collections.ConfigDict:
    """The paper-sized config of env variant `env` with the env's options `options` (every option
    of `envs.make(env)`, stated in the env's config file): every knob of `starpo.schema` at its
    default (docs/knobs.md lists them)."""
    c = ml_collections.ConfigDict(schema.defaults())
    c.env.name = env
    c.env.options = ml_collections.ConfigDict(options)
    return c


# algorithm presets after the variant and a "+" (`tiny+dapo`), or alone
PRESETS = ("dapo", "lora", "reinforce")


def _split(arg: str | None) -> tuple[str, list[str]]:
    """(variant, presets) of the text after the colon."""
    name, *presets = (arg or "").strip().split("+")
    if name in PRESETS:
        return "", [name] + presets
    return name, presets


def variant(arg: str | None, known: tuple[str, ...]) -> str:
    """The variant name after the colon ("" for none), without its `+preset` suffixes; unknown
    names fail clearly."""
    name, presets = _split(arg)
    if name and name not in known:
        raise ValueError(f"unknown config variant {name!r}; known: {', '.join(known)}")
    for preset in presets:
        if preset not in PRESETS:
            raise ValueError(f"unknown config preset {preset!r}; known: {', '.join(PRESETS)}")
    return name


def apply_presets(c: ml_collections.ConfigDict, arg: str | None) -> None:
    """The presets of the variant argument, in order (after the variant's own settings)."""
    for preset in _split(arg)[1]:
        {"dapo": dapo, "lora": lora, "reinforce": reinforce}[preset](c)


def dapo(c: ml_collections.ConfigDict) -> None:
    """DAPO's settings (the paper and verl's recipe/dapo): GRPO advantages (the variant's
    norm_adv_by_std_in_grpo kept), clip-higher (0.2 / 0.28), token-mean loss aggregation, no KL
    term and no entropy bonus, overlong reward shaping with a buffer of a fifth of the reply
    budget (the paper's 4096 of 20480 tokens, factor 1; off under 5 tokens), dynamic sampling
    (filter_groups: up to 10 rollout batches to find groups whose success differs, the recipe's
    `acc` metric), and the recipe's dual clip of 10; the StarPO-S filter is off (every group of
    the filled batch trains)."""
    c.algorithm.update({
        "adv_estimator": "grpo", "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
        "loss_agg_mode": "token-mean", "use_kl_loss": False, "kl_loss_coef": 0.0,
        "use_kl_in_reward": False, "entropy_coeff": 0.0, "rollout_filter_strategy": "top_k",
        "rollout_filter_ratio": 1.0, "overlong_buffer_len": c.rollout.response_length // 5,
        "overlong_penalty_factor": 1.0, "filter_groups_enable": True,
        "filter_groups_max_num_gen_batches": 10, "filter_groups_metric": "success",
        "clip_ratio_c": 10.0})


def reinforce(c: ml_collections.ConfigDict) -> None:
    """One episode on each level, as many levels as the variant's batch has episodes, each
    reward against the batch's mean and std (GRPO on groups of one: REINFORCE with a batch
    baseline, no critic), every row trained (no filter: a group of one has no spread to rank).
    The tiny FrozenLake config's own RL; from a strong SFT warm start there it lifted success
    where StarPO-S's 8 levels x 16 episodes held it (five seeds), and on its slippery lake it
    lifted one as much as each level's own group did (three seeds: docs/results.md,
    "Supervised warm start"); of two 10-step CPU runs from SmolLM2's slippery-lake SFT one
    fell and one held.
    Learning rates, mini-batches and the validation are the variant's."""
    c.rollout.update(dict(env_groups=c.rollout.env_groups * c.rollout.group_size,
                          group_size=1))
    c.algorithm.update(dict(adv_estimator="grpo", reward_norm_grouping="batch",
                            reward_norm_method="mean_std", rollout_filter_ratio=1.0))


def lora(c: ml_collections.ConfigDict) -> None:
    """LoRA on every linear projection at RAGEN's paper setting (rank 64, alpha 64), for actor
    and critic; the base weights are frozen and stored in the update's dtype."""
    c.model.lora.update(dict(rank=64, alpha=64.0, target_modules="all-linear"))
    if c.model.path.startswith("tiny"):
        # a random tiny model's tied output head (std 0.02) caps every logit near +-1.3 while
        # it is frozen (the final norm fixes the hidden state's length): nothing sharp can be
        # learned through the projections alone, so the head is adapted too
        c.model.lora.target_modules = "all-linear,lm_head"


def cpu(c: ml_collections.ConfigDict) -> None:
    """Shrink a paper-sized config for the embedded SmolLM2-135M on a 2-core CPU.

    Why each value: a 135M model decodes and trains only some tens to a hundred and more
    tokens per second on 2 cores (docs/results.md), so the run keeps few episodes (8 groups x 4), short answers
    (thinking off, 40 new tokens, 3 turns) and a context sized to the dialogue; GRPO rather
    than a critic (the critic's forward and backward would double the update); the filter keeps
    half the groups (a quarter of 8 would leave 8 rows); two optimizer updates per batch at the
    reference's LoRA learning rate (10x its full-model one) so that changes show in a few
    steps, not hundreds.
    """
    c.rollout.update(dict(env_groups=8, group_size=4, max_turn=3, response_length=40,
                          max_context=768, enable_think=False))
    c.val.update(dict(env_groups=32, test_freq=5, batch_size=0))
    c.algorithm.update(dict(adv_estimator="grpo", rollout_filter_ratio=0.5,
                            ppo_mini_batch_size=8, micro_batch_size=4, actor_lr=1e-5,
                            critic_lr=1e-4, logit_chunk_size=256))
    c.trainer.update(dict(total_steps=100, save_freq=5))
    # keep the dense matmuls' outputs (0.62 MB per token: 0.6 GB for a 4 x 256 Bandit
    # micro-batch, 1.9 GB at 4 x 768) instead of recomputing them (a faster update: docs/results.md)
    c.model.remat_policy = "save_dense"


def gpu(c: ml_collections.ConfigDict) -> None:
    """The embedded SmolLM2-135M on one GPU of the H100 / H200 class: a supervised warm start on
    the solver's demonstrations (starpo/sft.py), then StarPO-S RL from its weights, one env's
    whole run a few minutes (its timings and results: docs/results.md, "SmolLM2 on a GPU").

    Why each value: the paper's batch (8 groups x 16 episodes of 5 turns) and StarPO-S (a critic,
    the filter keeping a quarter of the groups, decoupled clipping); thinking off and short
    replies, as the solver's demonstrations are answers alone (an untrained SmolLM2 writes no
    valid action, so RL needs the warm start); SFT on thousands of demonstrations (a small model
    needs ~1,000 batches to read the grid); learning rates of the cpu variant (10x the
    reference's full-model ones, so that 100 steps move the policy); the log-prob head in chunks
    (SmolLM2's 49k vocabulary); 256 held-out levels, as the paper. One decode window
    (`rollout.decode_windows`): each window is one more decode loop to compile, while on a GPU a
    decode step is bound by its kernel launches, not by the cache it reads, which is all that
    windows save (docs/results.md).
    """
    c.rollout.update(dict(env_groups=8, group_size=16, max_turn=5, response_length=40,
                          max_context=1024, enable_think=False, batch_size=0, decode_windows=1))
    c.val.update(dict(env_groups=256, group_size=1, test_freq=20, batch_size=128))
    c.algorithm.update(dict(adv_estimator="gae", rollout_filter_ratio=0.25,
                            ppo_mini_batch_size=32, micro_batch_size=16, actor_lr=1e-5,
                            critic_lr=1e-4, logit_chunk_size=256))
    c.sft.update(dict(steps=500, env_groups=32, lr=1e-4, warmup_steps=10, test_freq=100,
                      save_freq=100))
    c.trainer.update(dict(total_steps=100, save_freq=20))


def tiny(c: ml_collections.ConfigDict) -> None:
    """A random-init tiny model (82k parameters) and a 128-token tokenizer learned from the
    env's own dialogue (starpo/run_config.py: whole answers are single tokens), trained from
    scratch in about a second per step on a CPU. Why each value: one reply token per turn
    (an answer is one token); GRPO (no critic to train from scratch); learning rates of a
    small model trained from scratch, not of a pretrained LLM; no filter and no weight decay
    (every group carries signal; nothing to regularise towards); an entropy bonus keeps the
    four moves explored; validation batch = training batch, so one compiled rollout serves both;
    a RoPE base of 100, not 10000: a context of ~200 tokens needs position resolution over a few
    tokens (a supervised probe learns FrozenLake's moves far sooner with it: docs/results.md).
    """
    c.model.update(dict(
        path="tiny:layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,mlp=128,vocab=128,seed=0,"
             "theta=100",
        remat=False, dtype="float32"))  # matmuls this small gain nothing from bfloat16
    c.rollout.update(dict(env_groups=16, group_size=4, max_turn=5, response_length=1,
                          max_context=256, enable_think=False, decode_windows=1))
    c.val.update(dict(env_groups=64, group_size=1, test_freq=10, batch_size=0))
    c.algorithm.update(dict(adv_estimator="grpo", rollout_filter_ratio=1.0,
                            ppo_mini_batch_size=16, micro_batch_size=16, actor_lr=3e-3,
                            critic_lr=3e-3, entropy_coeff=0.02, weight_decay=0.0))
    # the context is already cut to what the episodes use; trimming would only add compiles
    c.trainer.update(dict(total_steps=40, save_freq=20, context_bucket=0))
