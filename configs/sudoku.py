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
- tiny: a random-init tiny model, for tests and CPU demos of the plumbing; its tokenizer has
  the 729 answers `R,C,N</answer>` as whole tokens (a vocabulary of 1024).
"""

from configs import common

# envs.make("SimpleSudoku", **OPTIONS): blanks, the env's step budget, the agent's action
# budget, the reference's rewards
OPTIONS = dict(blanks=32, max_steps=81, max_actions=20, correct_placement_score=1.0,
               invalid_action_score=-0.1, completion_bonus=10.0)


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
        # the action budget as short as the episode: each "You have N actions left" line is
        # one of the tiny tokenizer's whole tokens
        c.rollout.update(dict(max_turn=2, max_actions_per_traj=4, env_groups=8, group_size=4,
                              response_length=16, max_context=2048))
        # the tokenizer's vocabulary holds the 729 whole answers `R,C,N</answer>` (the solver's
        # moves, starpo/dialogue.py `template_strings`): a random model writes a placement
        c.model.path = c.model.path.replace("vocab=128", "vocab=1024")
        c.val.update(dict(tags="SimpleSudoku", test_freq=5))
        c.trainer.update(dict(total_steps=20, save_freq=10))
    common.apply_presets(c, arg)
    c.lock()
    return c
