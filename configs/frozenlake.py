"""FrozenLake (4x4, slippery, 80% frozen): `configs/frozenlake.py[:cpu|:gpu|:tiny]`.

- (no variant): the paper's run (8 groups x 16 episodes, 5 turns, 400 tokens per turn, PPO with
  a critic, StarPO-S filter 0.25, decoupled clipping), for an accelerator.
- cpu: the embedded SmolLM2-135M on a 2-core laptop: fewer, shorter episodes, answers without
  thinking, after a supervised warm start on the solver's demonstrations (starpo/sft.py):
  untrained, SmolLM2-135M writes no valid action, so RL alone gets no reward signal.
- gpu: SmolLM2-135M on one GPU, SFT warm start then StarPO-S RL (configs/common.py `gpu`),
  validated on the paper's slippery lake and on RAGEN-2's default, the non-slippery 4x4 lake
  (FrozenLakeNonSlippery), where the solver succeeds on every level and a grid-blind policy
  rarely, so reading the map shows.
- tiny: a random-init tiny model on a non-slippery 3x3 lake, thinking off, one episode per level
  with a batch baseline; learns the format, then to read the grid, in minutes on CPU (its
  curves per seed: docs/results.md; the learning test runs 100 steps).
"""

from configs import common

# envs.make("FrozenLake", **OPTIONS): the reference's 4x4 slippery lake, 80% frozen; maps are
# drawn from num_candidates random grids (the first one with a path from start to goal)
OPTIONS = dict(size=4, p=0.8, is_slippery=True, num_candidates=16)


def get_config(arg=None):
    v = common.variant(arg, ("cpu", "gpu", "tiny"))
    c = common.base("FrozenLake", OPTIONS)
    # the paper's lake and RAGEN-2's default one (non-slippery), both held out
    c.val.tags = "FrozenLake,FrozenLakeNonSlippery"
    if v == "cpu":
        common.cpu(c)
        # a warm start that fits 2 cores: it teaches the answer format (every answer valid
        # after it) and only starts on the map; the rates and lengths tried are in
        # docs/results.md, "Supervised warm start"
        c.sft.update(dict(steps=20, env_groups=8, lr=3e-4, warmup_steps=3, test_freq=10,
                          save_freq=10))
        # the slippery lake alone: a second validation set would double the 2-core warm
        # start's validation time (3 validations of ~1 min each)
        c.val.tags = ""
    elif v == "gpu":
        common.gpu(c)
        # the SFT rate decays (cosine, to a tenth, after the warm-up): at a constant rate the
        # slippery lake's success levels off, and a lower rate after that lifted it
        # (docs/results.md, "Supervised warm start")
        c.sft.update(dict(lr_decay_steps=c.sft.steps - c.sft.warmup_steps, min_lr_ratio=0.1))
    elif v == "tiny":
        common.tiny(c)
        # a 3x3 non-slippery lake (4x4 learns more slowly), where reading the grid pays far
        # more than any grid-blind move sequence; the model reads it through RoPE base 100
        # (with 10000 RL found a grid-blind policy). The figures behind every choice here:
        # docs/results.md, "Why the configs' settings"
        c.env.options.update(dict(is_slippery=False, size=3))
        c.val.tags = ""  # its tokenizer is learned from the dialogue of every validated env
        # one episode on each of 128 levels, each reward against the batch's (REINFORCE with a
        # batch baseline): every failure is pushed down, also where a whole group would fail
        # alike and so carry no GRPO signal (GRPO stalled below this); the context is cut to
        # what 5 turns use
        c.rollout.update(dict(env_groups=128, group_size=1, max_context=208))
        c.val.env_groups = 128  # = the training batch: one compiled rollout serves both
        c.algorithm.update(dict(rollout_filter_ratio=1.0, reward_norm_grouping="batch",
                                reward_norm_method="mean_std", ppo_mini_batch_size=32,
                                micro_batch_size=32))
        # the rate decays over the run's 150 x 4 updates: at a constant 3e-3 the policy climbs,
        # then falls back in PPO-KL spikes
        c.algorithm.update(dict(lr_decay_steps=600, min_lr_ratio=0.1))
        c.trainer.total_steps = 150  # ~4 min on one CPU core, compiles included
    common.apply_presets(c, arg)
    c.lock()
    return c
