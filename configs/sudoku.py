"""Sudoku (multi-turn, text placements): `configs/sudoku.py[:cpu|:gpu|:tiny]`.

RAGEN-2's Sudoku (config/_8_sudoku.yaml, config/envs.yaml tag SimpleSudoku): a 9x9 puzzle with
32 blanks; each answer piece places a number (`place 5 at row 2 col 3`, `2,3,5`, ...); a
placement of the solution's digit pays 1, another valid digit 0.5, an invalid answer -0.1, a
solved grid +10 (envs/sudoku.py). The base config is the reference's agent proxy (base.yaml):
5 turns of up to 2 actions, 20 actions an episode, 150 new tokens a turn. MediumSudoku (40
blanks, 30 actions) is `--config.env.name=MediumSudoku --config.val.tags=MediumSudoku`.

- cpu: the embedded SmolLM2-135M on a 2-core laptop, 3 turns (a smoke-sized run; not yet
  measured).
- gpu: SmolLM2-135M on one GPU (configs/common.py `gpu`), the reference's 5 turns, with the
  SFT warm start on the jittable solver's placements (envs/sudoku.py `solve`: propagation and
  search; one placement a demonstration reply, starpo/demos.py).
- tiny: a random-init tiny model on the reference's 4x4 grid (`Sudoku4x4`, grid_size 4, 6
  blanks), 3 turns of one placement; its tokenizer has the 64 answers `R,C,N</answer>` as whole
  tokens (a vocabulary of 512). RL alone learns the answer format; `--config.sft.steps=300
  --config.sft.lr=3e-3 --config.sft.env_groups=64` learns placements (docs/envs_sudoku_2048.md).
"""

from configs import common

# envs.make("SimpleSudoku", **OPTIONS): blanks, the env's step budget, the agent's action
# budget, the reference's rewards, the grid's side (9; 4 is the reference's grid_size 4)
OPTIONS = dict(blanks=32, max_steps=81, max_actions=20, correct_placement_score=1.0,
               invalid_action_score=-0.1, completion_bonus=10.0, size=9)


def get_config(arg=None):
    v = common.variant(arg, ("cpu", "gpu", "tiny"))
    c = common.base("SimpleSudoku", OPTIONS)
    # the reference's agent_proxy for Sudoku: 5 turns of up to 2 actions, 20 actions
    c.rollout.update(dict(max_turn=5, max_actions_per_turn=2, max_actions_per_traj=20,
                          response_length=150, max_context=8192))
    c.val.tags = "SimpleSudoku"
    if v == "cpu":
        common.cpu(c)
        # an observation is ~500 tokens of SmolLM2's tokenizer: 3 turns of up to 64 new tokens
        c.rollout.update(dict(max_turn=3, max_context=4096, response_length=64))
    elif v == "gpu":
        common.gpu(c)
        c.rollout.update(dict(max_turn=5, max_context=8192, response_length=150))
    elif v == "tiny":
        common.tiny(c)
        # The reference's env at grid_size 4 (tag Sudoku4x4: 2x2 boxes, numbers 1-4, its easy
        # 6 blanks of 16): with at most 10 empty cells the reference's text lists each empty
        # cell's valid numbers, so a placement can be read off the observation. On the 9x9
        # levels (32 blanks, no such list until 10 are left) a random-init tiny model learned
        # nothing measurable (docs/envs_sudoku_2048.md).
        c.env.name = "Sudoku4x4"
        c.env.options = dict(size=4, blanks=6, max_steps=16, max_actions=6,
                             correct_placement_score=1.0, invalid_action_score=-0.1,
                             completion_bonus=10.0)
        # one placement a turn, one token a reply: the tokenizer holds the 64 answers
        # `R,C,N</answer>` whole (starpo/dialogue.py `template_strings`)
        c.rollout.update(dict(max_turn=3, max_actions_per_turn=1, max_actions_per_traj=3,
                              env_groups=128, group_size=1, response_length=1, max_context=512))
        c.model.path = c.model.path.replace("vocab=128", "vocab=512")
        c.val.update(dict(tags="", env_groups=128, test_freq=10))
        # as the tiny FrozenLake (configs/frozenlake.py): one episode on each of 128 levels,
        # rewards normalised over the batch, a cosine decay of the learning rate
        c.algorithm.update(dict(rollout_filter_ratio=1.0, reward_norm_grouping="batch",
                                reward_norm_method="mean_std", ppo_mini_batch_size=32,
                                micro_batch_size=32, lr_decay_steps=400, min_lr_ratio=0.1))
        c.trainer.update(dict(total_steps=100, save_freq=50))
    common.apply_presets(c, arg)
    c.lock()
    return c
