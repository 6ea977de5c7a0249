"""Countdown (single turn): `configs/countdown.py[:cpu|:gpu|:tiny]`.

RAGEN-2's Countdown (config/_4_countdown.yaml): the agent sees a target and 3-4 numbers and
answers with one arithmetic expression using each number once; exact answers pay 1, answers
that use the right numbers but miss pay 0.1 (envs/countdown.py). One turn, one action.

- cpu: the embedded SmolLM2-135M on a 2-core laptop (a smoke-sized run; not yet measured).
- gpu: SmolLM2-135M on one GPU (configs/common.py `gpu`) without the warm start: the solver is
  host-side Python (envs/countdown.py `solve`), not a jittable one, so there are no
  demonstrations (sft.steps = 0).
- tiny: a random-init tiny model, for tests and CPU demos of the plumbing (it cannot learn
  arithmetic; it can learn to write the numbers, which pays 0.1).
"""

from configs import common

# envs.make("Countdown", **OPTIONS): how many numbers a level has, their range, the rewards
OPTIONS = dict(min_count=3, max_count=4, min_number=1, max_number=99, score=1.0,
               format_score=0.1)


def get_config(arg=None):
    v = common.variant(arg, ("cpu", "gpu", "tiny"))
    c = common.base("Countdown", OPTIONS)
    # the reference's agent_proxy for Countdown: one turn of one action
    c.rollout.update(dict(max_turn=1, max_actions_per_turn=1, max_actions_per_traj=1))
    c.rollout.decode_windows = 1  # one turn: the reply follows the prompt, nothing to skip
    c.val.tags = "Countdown"
    if v == "cpu":
        common.cpu(c)
        # One turn: the prompt and an answer such as `44 + 19 + 35</answer>` fit in 384
        # tokens; 32 new tokens after the `<answer>` priming hold any 4-number expression.
        c.rollout.update(dict(max_turn=1, max_context=384, response_length=32))
    elif v == "gpu":
        common.gpu(c)
        c.rollout.update(dict(max_turn=1, max_context=512, response_length=64))
        c.sft.steps = 0  # no jittable solver: no demonstrations
    elif v == "tiny":
        common.tiny(c)
        # an answer is several tokens of a tiny tokenizer (digits, operators, `</answer>`)
        c.rollout.update(dict(max_turn=1, env_groups=8, group_size=4, response_length=16))
        c.val.update(dict(tags="Countdown", test_freq=5))
        c.trainer.update(dict(total_steps=20, save_freq=10))
    common.apply_presets(c, arg)
    c.lock()
    return c
