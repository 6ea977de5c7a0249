"""FrozenLake (4x4, slippery, 80% frozen): `configs/frozenlake.py[:cpu|:tiny]`.

- (no variant): the paper's run (8 groups x 16 episodes, 5 turns, 400 tokens per turn, PPO with
  a critic, StarPO-S filter 0.25, decoupled clipping), for an accelerator.
- cpu: the embedded SmolLM2-135M on a 2-core laptop: fewer, shorter episodes, answers without
  thinking, larger learning rates so progress shows within the first steps.
- tiny: a random-init tiny model on a non-slippery lake, thinking off; learns in minutes on CPU
  (the proof-of-learning test runs it).
"""

from configs import common


def get_config(arg=None):
    v = common.variant(arg, ("cpu", "tiny"))
    c = common.base("FrozenLake")
    if v == "cpu":
        common.cpu(c)
    elif v == "tiny":
        common.tiny(c)
        # a 3x3 non-slippery lake: within a CI-sized budget (40 steps) a from-scratch model
        # gets to ~0.3-0.4 success here; 4x4 learns more slowly (see the session notes)
        c.env.options.update(dict(is_slippery=False, size=3))
    c.lock()
    return c
