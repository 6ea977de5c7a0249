"""Proof that the tiny FrozenLake run learns to read the map and reach the goal.

`configs/frozenlake.py:tiny`: a random-init 82k-parameter model on a non-slippery 3x3 lake,
thinking off, one episode on each of 128 levels per step with a batch-normalised reward. On
this lake the best grid-blind move sequence scores 0.36 (docs/results.md), so validation success of
0.7 or more on 128 held-out levels (standard error ~0.04) means the model reads where the
player, the goal and the holes are.
"""

import os

import pytest

from configs import frozenlake
from starpo import metrics, training
from tests.test_training import val_series, with_changes

STEPS = 120  # of the config's 150 (the learning rate schedule does not depend on total_steps)


@pytest.mark.learning
def test_frozenlake_learns_to_reach_the_goal(tmp_path):
    """Validation success (128 held-out levels, temperature 0.5, every 10 steps) rises from ~0
    to >= 0.7 within 120 steps (~3 min on 2 cores), and stays near it.

    Config seed 0. XLA's summation order depends on the processor's vector width and the
    thread count, and the run amplifies such differences, so the same seed draws a different
    curve on another CPU (docs/results.md: 0.82 at step 120 on one, 0.77 on another, 0.8 reached only
    near step 150 there). The bar sits below every measured curve at step 120 by more than the
    evaluation's noise and far above what a grid-blind policy can score.
    """
    config = with_changes(frozenlake.get_config("tiny"), trainer__total_steps=STEPS)
    workdir = str(tmp_path / "run")
    training.train(config, workdir, progress=False, log=lambda *a: None)
    series = val_series(workdir, "val/FrozenLake/success")
    print("val/FrozenLake/success by step:", series)
    assert series[0][0] == 0 and series[0][1] < 0.05, series
    assert series[-1][0] == STEPS, series
    assert max(x for _, x in series) >= 0.7, series
    assert series[-1][1] >= 0.65, series  # not a passing spike
    valid = val_series(workdir, "val/FrozenLake/action_is_valid")
    assert valid[0][1] < 0.2 and valid[-1][1] >= 0.9, valid
    rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    # the documented names are there
    for name in ("train/FrozenLake/success", "train/FrozenLake/pass@1", "actor/entropy",
                 "actor/pg_loss", "rollout/batch_std", "timing/rollout",
                 "perf/rollout_tokens_per_s", "warning/echo_trap",
                 "val/FrozenLake/action_is_valid"):
        assert any(name in r for r in rows), name
