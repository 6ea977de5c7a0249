"""Bi-Arm Bandit (single turn): `configs/bandit.py[:cpu|:tiny]`.

The agent is told two arm names (Phoenix, Dragon) and must pick one; the high-risk arm (Dragon)
pays more on average. Validation also runs on BanditTest (Trader / Librarian), the reference's
generalisation probe.

- cpu: the embedded SmolLM2-135M on a 2-core laptop, the README's first command. The untrained
  model answers in the required format ~25% of the time at temperature 1 and nearly always picks
  Phoenix; the format is learned within a few steps (~2 min each), the arm choice more slowly.
- tiny: a random-init tiny model that learns to pick Dragon in ~20 steps (a learning test).
"""

from configs import common


def get_config(arg=None):
    v = common.variant(arg, ("cpu", "tiny"))
    c = common.base("Bandit")
    c.rollout.max_turn = 1
    c.rollout.decode_windows = 1  # one turn: the reply follows the prompt, nothing to skip
    c.val.tags = "Bandit,BanditTest"
    if v == "cpu":
        common.cpu(c)
        # One short turn: the prompt and answer fit in 384 tokens. Groups of 8 with plain
        # Dr. GRPO advantages (score minus group mean, no division by the group's std): with
        # std-normalised groups of 4, one Dragon pick that paid 0 next to three Phoenix 0.1s
        # gets -1.5 and one that paid 1.0 gets +1.5, so the risky arm's expected advantage is
        # negative although it pays more (0.25 vs 0.1); without the division it is positive.
        c.rollout.update(dict(max_turn=1, max_context=384, env_groups=4, group_size=8))
        c.algorithm.norm_adv_by_std_in_grpo = False
    elif v == "tiny":
        common.tiny(c)
        c.rollout.update(dict(max_turn=1, env_groups=8, group_size=8))
        c.val.update(dict(tags="Bandit", test_freq=5))
        # Dr. GRPO, as in cpu: with std-normalised groups the learned preference for the
        # high-risk arm was unstable (1.0 at step 15, 0.55 at 20); without the division the
        # curve is 0.0, 0.38, 0.95, 1.0, 1.0 at steps 0-20
        c.algorithm.norm_adv_by_std_in_grpo = False
        c.algorithm.update(dict(actor_lr=1e-2, ppo_mini_batch_size=64, micro_batch_size=64,
                                entropy_coeff=0.0))
        c.trainer.update(dict(total_steps=20, save_freq=10))
    c.lock()
    return c
