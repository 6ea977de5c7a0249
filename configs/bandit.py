"""Bi-Arm Bandit (single turn): `configs/bandit.py[:cpu|:gpu|:tiny]`.

The agent is told two arm names (Phoenix, Dragon) and must pick one; the high-risk arm (Dragon)
pays more on average. Validation also runs on BanditTest (Trader / Librarian), the reference's
generalisation probe.

- cpu: the embedded SmolLM2-135M on a 2-core laptop, the README's first command (its measured
  curves, per seed, are in docs/results.md). The untrained model rarely answers in the required
  format at temperature 1 and prefers Phoenix; it learns the format and, through the StarPO-S
  filter below, the high-risk arm.
- gpu: SmolLM2-135M on one GPU (configs/common.py `gpu`) without the warm start (the Bandit
  has no solver; SmolLM2 learns its format and the arm by RL alone on the cpu variant).
- tiny: a random-init tiny model that learns to pick Dragon in ~20 steps (a learning test).
"""

from configs import common

# envs.make("Bandit", **OPTIONS): the low-risk and the high-risk arm's names
OPTIONS = dict(low_arm="Phoenix", high_arm="Dragon")


def get_config(arg=None):
    v = common.variant(arg, ("cpu", "gpu", "tiny"))
    c = common.base("Bandit", OPTIONS)
    c.rollout.max_turn = 1
    c.rollout.decode_windows = 1  # one turn: the reply follows the prompt, nothing to skip
    c.val.tags = "Bandit,BanditTest"
    if v == "cpu":
        common.cpu(c)
        # One short turn: the prompt and answer fit in 384 tokens; a valid reply after the
        # `<answer>` priming is ~4 tokens, so 24 new tokens only cut rambling short.
        # Plain Dr. GRPO advantages (score minus group mean, no division by the group's std):
        # with std-normalised groups of 4, one Dragon pick that paid 0 next to three Phoenix
        # 0.1s gets -1.5 and one that paid 1.0 gets +1.5, so the risky arm's expected
        # advantage is negative although it pays more (0.25 vs 0.1).
        # Exploration is the bottleneck: the untrained model names Dragon as its first answer
        # token ~5% of the time at temperature 1 (Phoenix 30-50%), and 4 x 8 episodes per step
        # drew no Dragon at all in 3 steps (one run, the earlier config). 8 x 8 episodes and the
        # StarPO-S filter keeping the top quarter of groups by reward std (2 of 8) train on the
        # groups where a Dragon pick paid 1.0 (std ~0.3, against <= 0.1 for groups that differ
        # only in format or hold a Dragon that paid 0), the same 16 rows per update as 4 x 8
        # with half kept; the rollout doubles.
        c.rollout.update(dict(max_turn=1, max_context=384, env_groups=8, group_size=8,
                              response_length=24))
        c.algorithm.update(dict(norm_adv_by_std_in_grpo=False, rollout_filter_ratio=0.25))
    elif v == "gpu":
        common.gpu(c)
        # one turn, as cpu (its prompt and answer fit 384 tokens); no solver: no SFT
        c.rollout.update(dict(max_turn=1, max_context=384, response_length=24))
        c.sft.steps = 0
    elif v == "tiny":
        common.tiny(c)
        c.rollout.update(dict(max_turn=1, env_groups=8, group_size=8))
        c.val.update(dict(tags="Bandit", test_freq=5))
        # Dr. GRPO, as in cpu: with std-normalised groups the learned preference for the
        # high-risk arm was unstable (docs/results.md, "Why the configs' settings")
        c.algorithm.norm_adv_by_std_in_grpo = False
        c.algorithm.update(dict(actor_lr=1e-2, ppo_mini_batch_size=64, micro_batch_size=64,
                                entropy_coeff=0.0))
        c.trainer.update(dict(total_steps=20, save_freq=10))
    common.apply_presets(c, arg)
    c.lock()
    return c
