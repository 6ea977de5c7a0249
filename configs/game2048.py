"""2048 (multi-turn, one slide a turn): `configs/game2048.py[:cpu|:gpu|:tiny]`.

RAGEN-2's 2048 (config/_9_2048.yaml, config/envs.yaml tag game_2048): a 4x4 board, one of
Up / Right / Down / Left a turn; a move that merges pays 0.1 * log2(merged sum + 1), every
other move 0 (envs/game2048.py). The base config is the reference's agent proxy: 800 turns of
one action, 700 actions an episode, 256 new tokens a turn, 8192 tokens of context (its
max_model_len; the reference's max_context_window 5 is inert under its context_window_mode
`full`, as here). Such episodes do not fit a small machine: the variants shorten them.

- cpu: the embedded SmolLM2-135M on a 2-core laptop, 8 turns (a smoke-sized run; not yet
  measured).
- gpu: SmolLM2-135M on one GPU (configs/common.py `gpu`), 32 turns of at most 64 new tokens,
  the last 5 turns in context (RAGEN-2's window), with the SFT warm start on the greedy
  solver's moves (envs/game2048.py `greedy_move`).
- tiny: a random-init tiny model, for tests and CPU demos of the plumbing.
"""

from configs import common

# envs.make("Game2048", **OPTIONS): board size, the probability that a spawn is a 2, the
# reference's log reward and its raw score of a move that changes nothing
OPTIONS = dict(size=4, two_prob=0.9, use_log_reward=True, invalid_act_score=-0.1)


def get_config(arg=None):
    v = common.variant(arg, ("cpu", "gpu", "tiny"))
    c = common.base("Game2048", OPTIONS)
    # the reference's agent_proxy for 2048: up to 800 turns of one action, 700 actions
    c.rollout.update(dict(max_turn=800, max_actions_per_turn=1, max_actions_per_traj=700,
                          response_length=256, max_context=8192))
    c.val.tags = "Game2048"
    if v == "cpu":
        common.cpu(c)
        # an observation is ~110 tokens of SmolLM2's tokenizer: 8 turns of up to 48 new
        # tokens fit 2048
        c.rollout.update(dict(max_turn=8, max_context=2048, response_length=48))
    elif v == "gpu":
        common.gpu(c)
        c.rollout.update(dict(max_turn=32, max_context=8192, response_length=64,
                              context_window_mode="limited", max_context_window=5))
    elif v == "tiny":
        common.tiny(c)
        # the action budget as short as the episode: each "You have N actions left" line is
        # one of the tiny tokenizer's whole tokens (700 would not fit its vocabulary)
        c.rollout.update(dict(max_turn=3, max_actions_per_traj=3, env_groups=8, group_size=4,
                              response_length=16, max_context=1024))
        c.val.update(dict(tags="Game2048", test_freq=5))
        c.trainer.update(dict(total_steps=20, save_freq=10))
    common.apply_presets(c, arg)
    c.lock()
    return c
