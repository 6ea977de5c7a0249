"""On-device level generation against the reference generators' statistics.

The reference's numbers (tests/env_fixtures/generator_stats.json): FrozenLake 4x4 mean shortest
start->goal path 2.78 with 21% of goals next to the start; Sokoban mean optimal solution length
3.98 (SimpleSokoban) and 5.88 (LargerSokoban), none unsolvable.
"""

import json
import pathlib

import jax
import numpy as np
import pytest

import envs
from envs import frozenlake, sokoban
from tests.test_envs_shared import BATCH, compiled

STATS = json.loads((pathlib.Path(__file__).parent / "env_fixtures" / "generator_stats.json").read_text())


def _numpy(tree):
    return jax.tree.map(np.asarray, tree)


def _level(states, i):
    return jax.tree.map(lambda x: x[i], states)


# ------------------------------------------------------------------ FrozenLake


def test_frozen_lake_maps_match_reference_statistics():
    ref = STATS["frozen_lake"]["size4_p0.8"]
    c = compiled(envs.make("FrozenLake"))
    paths, holes = [], []
    for seed in range(4):
        states = c.reset_seed(300 + seed)
        path = np.asarray(c.vmapped("shortest_path")(states))
        grid, pos = _numpy((states.grid, states.pos))
        rows = np.arange(BATCH)
        assert np.all((grid == frozenlake.GOAL).sum(axis=(1, 2)) == 1)
        assert np.all(grid[rows, pos[:, 0], pos[:, 1]] == frozenlake.FROZEN)  # start is ice
        assert np.all(path >= 1)  # start != goal, and a hole-free path exists
        paths.append(path)
        holes.append((grid == frozenlake.HOLE).sum(axis=(1, 2)))
    paths, holes = np.concatenate(paths), np.concatenate(holes)
    n = len(paths)
    ref_hist = {int(k): v for k, v in ref["shortest_path_len_hist"].items()}
    ref_adjacent = ref_hist[1] / ref["n"]  # 0.2124
    # Tolerances: about 4 standard errors of the two samples together.
    assert abs(paths.mean() - ref["shortest_path_len_mean"]) < 0.12
    assert abs(np.mean(paths == 1) - ref_adjacent) < 4 * np.sqrt(2 * ref_adjacent * (1 - ref_adjacent) / n)
    assert abs(holes.mean() - ref["holes_mean"]) < 0.12


def test_frozen_lake_generation_is_deterministic_and_batch_independent():
    c = compiled(envs.make("FrozenLake"))
    keys = jax.random.split(jax.random.key(7), BATCH)
    a = _numpy(c.reset(keys))
    b = _numpy(c.reset(keys))
    rolled = _numpy(c.reset(jax.numpy.roll(keys, 5, axis=0)))  # each key's level moves with it
    for field in ("grid", "pos"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        np.testing.assert_array_equal(np.roll(getattr(a, field), 5, axis=0), getattr(rolled, field))
    # keys really vary the levels (small 4x4 maps do repeat now and then)
    assert len({(g.tobytes(), p.tobytes()) for g, p in zip(a.grid, a.pos)}) > BATCH * 0.8


# ------------------------------------------------------------------ Sokoban


def _check_level_structure(env, states):
    """Invariants of every generated level, vectorised over the batch."""
    room, boxes, player = _numpy((states.room, states.boxes, states.player))
    rows = np.arange(len(room))
    border = np.ones(room.shape[1:], bool)
    border[1:-1, 1:-1] = False
    assert np.all(room[:, border] == sokoban.WALL)
    assert np.all(boxes.sum(axis=(1, 2)) == env.num_boxes)
    assert np.all((room == sokoban.TARGET).sum(axis=(1, 2)) == env.num_boxes)
    assert not np.any(boxes & (room == sokoban.WALL))
    assert np.all(room[rows, player[:, 0], player[:, 1]] != sokoban.WALL)
    assert not np.any(boxes[rows, player[:, 0], player[:, 1]])
    # none starts solved; the reference even leaves every target empty at the start
    assert not np.any(boxes & (room == sokoban.TARGET))
    # the deterministic fallback level never shows up in practice
    fb_room, fb_boxes, _ = sokoban._fallback_layout(env.dim_x, env.dim_y, env.num_boxes)
    assert not np.any(np.all(room == fb_room, axis=(1, 2)) & np.all(boxes == fb_boxes, axis=(1, 2)))
    return room


@pytest.mark.parametrize(
    "name, stats_key, solved",
    [
        ("SimpleSokoban", "SimpleSokoban_6x6_1box_sd300", 400),
        ("LargerSokoban", "LargerSokoban_8x8_2box_sd10", 200),
    ],
)
def test_sokoban_levels_are_solvable_and_match_reference_difficulty(name, stats_key, solved):
    ref = STATS["sokoban"][stats_key]
    c = compiled(envs.make(name))
    states = c.reset_seed(500)
    room = _check_level_structure(c.env, states)
    # Optimal solution lengths by breadth-first search on the first `solved` levels.
    host = _numpy(states)
    lengths = np.array([sokoban.solve(_level(host, i)) for i in range(solved)])
    assert np.all(lengths >= 1), "every level must be solvable and not start solved"
    # The task's acceptance band is +-25%; the generator was tuned to well inside it.
    assert abs(lengths.mean() / ref["optimal_solution_length_mean"] - 1) < 0.25, lengths.mean()
    ref_mean_floor = ref["non_wall_cells_mean"]
    assert abs((room != sokoban.WALL).sum(axis=(1, 2)).mean() / ref_mean_floor - 1) < 0.15


def test_sokoban_generation_is_deterministic_and_batch_independent():
    c = compiled(envs.make("SimpleSokoban"))
    keys = jax.random.split(jax.random.key(9), BATCH)
    a = _numpy(c.reset(keys))
    b = _numpy(c.reset(keys))
    rolled = _numpy(c.reset(jax.numpy.roll(keys, 3, axis=0)))
    for field in ("room", "boxes", "player"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        np.testing.assert_array_equal(np.roll(getattr(a, field), 3, axis=0), getattr(rolled, field))
    # keys really vary the levels (6x6 rooms are small: a few repeat)
    levels = {(r.tobytes(), x.tobytes(), p.tobytes()) for r, x, p in zip(a.room, a.boxes, a.player)}
    assert len(levels) > BATCH * 0.8


def test_vocab_variant_renders_generated_levels_in_its_symbols():
    simple = envs.make("SimpleSokoban")
    vocab = envs.make("SokobanDifferentGridVocab")
    host = _numpy(compiled(simple).reset_seed(11))
    table = str.maketrans("".join(sokoban.SYMBOLS), "".join(sokoban.VOCAB_SYMBOLS))
    for i in range(20):
        level = _level(host, i)
        text = vocab.to_text(level)
        assert text == simple.to_text(level).translate(table)
        assert set(text) <= set(vocab.symbols) | {"\n"}
        back = vocab.from_text(text)
        np.testing.assert_array_equal(np.asarray(back.room), level.room)
        np.testing.assert_array_equal(np.asarray(back.boxes), level.boxes)


@pytest.mark.parametrize("dims", [(6, 6, 1), (8, 8, 2), (4, 5, 2), (5, 4, 2), (7, 10, 5)])
def test_fallback_level_is_solvable_and_not_solved(dims):
    room, boxes, player = sokoban._fallback_layout(*dims)
    state = sokoban.SokobanState(room=room, boxes=boxes, player=np.array(player), steps=np.int32(0))
    assert sokoban.solve(state) >= dims[2]  # at least one push per box
