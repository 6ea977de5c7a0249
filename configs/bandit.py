"""Bi-Arm Bandit (single turn): `configs/bandit.py[:cpu|:tiny]`.

The agent is told two arm names (Phoenix, Dragon) and must pick one; the high-risk arm (Dragon)
pays more on average. Validation also runs on BanditTest (Trader / Librarian), the reference's
generalisation probe.
"""

from configs import common


def get_config(arg=None):
    v = common.variant(arg, ("cpu", "tiny"))
    c = common.base("Bandit")
    c.rollout.max_turn = 1
    c.val.tags = "Bandit,BanditTest"
    if v == "cpu":
        common.cpu(c)
        c.rollout.max_turn = 1
    elif v == "tiny":
        common.tiny(c)
        c.rollout.update(dict(max_turn=1, env_groups=8, group_size=8))
        c.val.update(dict(tags="Bandit", test_freq=5))
        c.algorithm.update(dict(actor_lr=1e-2, ppo_mini_batch_size=64, micro_batch_size=64,
                                entropy_coeff=0.0))
        c.trainer.update(dict(total_steps=20, save_freq=10))
    c.lock()
    return c
