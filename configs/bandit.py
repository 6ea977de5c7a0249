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
        c.rollout.max_turn = 1
        c.val.tags = "Bandit"
    c.lock()
    return c
