"""starpo.metrics: JSONL format and resume, TensorBoard events, summary line; the monitors'
detectors (starpo.monitors: Echo Trap, RAGEN-2's stops)."""

import collections
import glob
import io
import json
import math
import os
import struct
import types

import jax.numpy as jnp
import numpy as np
import pytest

from starpo.metrics import (METRICS_FILE, MetricsWriter, Progress, read_jsonl, summary_keys,
                            summary_line, truncate_after)
from starpo.monitors import EchoTrapDetector


def read_events(logdir):
    """Every tensorboard Event in the event files of `logdir` (TFRecord framing: length,
    its crc, payload, its crc)."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            events.append(event_pb2.Event.FromString(data[pos + 12:pos + 12 + length]))
            pos += 12 + length + 4
    return events


def test_jsonl_format(tmp_path):
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    w.write(3, {"a/b": np.float32(0.5), "c": jnp.float32(2.0), "n": 7, "flag": True,
                "arr": np.array([1.25]), "nan": math.nan, "inf": np.inf, "ninf": -np.inf})
    w.close()
    raw = open(tmp_path / METRICS_FILE).read()
    assert raw.endswith("\n") and raw.count("\n") == 1

    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    line = json.loads(raw, parse_constant=no_constants)
    assert line == {"step": 3, "a/b": 0.5, "c": 2.0, "n": 7.0, "flag": 1.0, "arr": 1.25,
                    "nan": "nan", "inf": "inf", "ninf": "-inf"}
    assert all(type(v) is float for k, v in line.items() if k not in ("step", "nan", "inf",
                                                                      "ninf"))
    (rec,) = read_jsonl(str(tmp_path / METRICS_FILE))
    assert math.isnan(rec["nan"]) and rec["inf"] == math.inf and rec["ninf"] == -math.inf


def test_rejects_non_scalars(tmp_path):
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    with pytest.raises(ValueError, match="'v' is not a number"):
        w.write(1, {"v": np.zeros(3)})
    with pytest.raises(ValueError, match="reserved"):
        w.write(1, {"step": 1})
    assert not os.path.exists(tmp_path / METRICS_FILE)  # nothing half-written


def test_append_and_resume_truncate(tmp_path):
    path = str(tmp_path / METRICS_FILE)
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    for step in range(1, 6):
        w.write(step, {"x": step})
    w.close()
    # the crash tore a line in half
    with open(path, "a") as f:
        f.write('{"step": 6, "x"')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5]

    # the run resumes from the checkpoint of step 3: 4, 5 and the torn 6 go
    w = MetricsWriter(str(tmp_path), tensorboard=False, resume_step=3)
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    for step in (4, 5):
        w.write(step, {"x": 10 * step})
    w.close()
    assert [(r["step"], r["x"]) for r in read_jsonl(path)] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]

    # truncate_after after the writer opened (the file is replaced underneath it) still works
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    truncate_after(path, 4)
    w.write(5, {"x": 0})
    w.close()
    assert [(r["step"], r["x"]) for r in read_jsonl(path)][-2:] == [(4, 40.0), (5, 0.0)]
    truncate_after(str(tmp_path / "missing.jsonl"), 0)  # no file: nothing to do


def test_new_writer_drops_torn_line(tmp_path):
    path = str(tmp_path / METRICS_FILE)
    with open(path, "w") as f:
        f.write('{"step": 1, "x": 1.0}\n{"step": 2, "x"')
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    w.write(2, {"x": 2.0})
    w.close()
    assert read_jsonl(path) == [{"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}]


def test_tensorboard_events_and_samples(tmp_path):
    w = MetricsWriter(str(tmp_path))
    w.write(1, {"actor/entropy": 1.5, "rollout/in_group_std": np.float32(0.25)})
    w.write(2, {"actor/entropy": 1.25})
    dialogue = "<|im_start|>user\nmove?<|im_end|>\n<answer>Up</answer>"
    w.text(2, "val/sokoban/dialogue_0", dialogue)
    w.close()
    events = read_events(str(tmp_path / "tb"))
    scalars = [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value
               if v.HasField("simple_value")]
    assert scalars == [(1, "actor/entropy", 1.5), (1, "rollout/in_group_std", 0.25),
                       (2, "actor/entropy", 1.25)]
    texts = [(e.step, v.tag) for e in events for v in e.summary.value
             if not v.HasField("simple_value")]
    assert texts and texts[0][0] == 2 and texts[0][1].startswith("val/sokoban/dialogue_0")
    sample = tmp_path / "samples" / "val_sokoban_dialogue_0_2.txt"
    assert sample.read_text() == dialogue


def test_summary_line():
    scalars = {"train/sokoban/success": 0.414, "train/sokoban/score": 0.35,
               "actor/entropy": np.float32(1.2), "timing/step": 3.14, "actor/loss": 9.0}
    assert summary_line(12, 200, scalars) == (
        "step 12/200 | success 0.41 | score 0.35 | entropy 1.20 | 3.1 s")
    two_vals = {"val/a/success": 0.5, "val/b/success": math.nan}
    assert summary_line(0, 5, two_vals) == (
        "step 0/5 | val success[a] 0.50 | val success[b] nan")
    assert summary_line(1, 5, {"x": 2.0}, keys=(("x", "x", "{:.0f}"),)) == "step 1/5 | x 2"
    spreads = {"rollout/in_group_std": 0.0, "rollout/batch_std": 0.45}
    assert summary_line(3, 5, spreads, summary_keys(4)) == "step 3/5 | reward std 0.00"
    assert summary_line(3, 5, spreads, summary_keys(1)) == "step 3/5 | reward std 0.45"


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stream", [io.StringIO(), Terminal()], ids=["file", "terminal"])
def test_progress_draws_a_bar_on_a_terminal_only(stream):
    """A redirected run's console has its step lines alone (no carriage-return frames for a
    line to follow); on a terminal the bar is drawn and each line still goes to `log` whole."""
    said = []
    bar = Progress(2, 5, "train", log=said.append, stream=stream)
    steps = []
    for step in bar:
        steps.append(step)
        bar.write(f"step {step + 1}/5")
    bar.close()
    assert steps == [2, 3, 4] and said == ["step 3/5", "step 4/5", "step 5/5"]
    drawn = isinstance(stream, Terminal)
    assert bar.drawn == drawn and ("\r" in stream.getvalue()) == drawn
    assert "5/5 [" in stream.getvalue() if drawn else stream.getvalue() == ""
    # --progress=false: no bar even on a terminal
    quiet = Terminal()
    bar = Progress(0, 2, "sft", show=False, log=said.append, stream=quiet)
    assert list(bar) == [0, 1] and not bar.drawn and quiet.getvalue() == ""


def falling_series(n=30, fall_at=20, seed=0):
    """Noisy reward std and entropy that halve, then halve again, from step `fall_at`."""
    rng = np.random.default_rng(seed)
    std = 0.4 + 0.05 * rng.standard_normal(n)
    ent = 1.5 + 0.1 * rng.standard_normal(n)
    std[fall_at:] *= 0.3
    ent[fall_at:] *= 0.3
    return std, ent


def test_collapse_detector_fires_on_a_fall_only():
    std, ent = falling_series()
    det = EchoTrapDetector(window=10, drop=0.5, min_history=5)
    fired = [det.update(s, e) for s, e in zip(std, ent)]
    assert fired[20] and not any(fired[:20])

    # noisy but flat: never (heavy noise, occasional spikes included)
    rng = np.random.default_rng(1)
    det = EchoTrapDetector()
    flat_std = np.abs(0.4 + 0.1 * rng.standard_normal(200))
    flat_std[::17] = 2.0
    flat_ent = 1.5 + 0.15 * rng.standard_normal(200)
    assert not any(det.update(s, e) for s, e in zip(flat_std, flat_ent))

    # only one of the two falling: not the Echo Trap
    det = EchoTrapDetector()
    assert not any(det.update(s, e) for s, e in zip(std, np.full(30, 1.5)))

    # not before min_history values; non-finite values neither warn nor count
    det = EchoTrapDetector(window=10, min_history=5)
    assert [det.update(v, v) for v in (1.0, 1.0, math.nan, 1.0, 1.0, 0.1, 0.1)] == [
        False, False, False, False, False, False, True]
    det = EchoTrapDetector(window=2)  # min_history capped at the window
    assert [det.update(v, v) for v in (1.0, 1.0, 0.1)] == [False, False, True]


def test_collapse_detector_state_dict_round_trip():
    std, ent = falling_series(n=40, fall_at=25, seed=2)
    straight = EchoTrapDetector(window=8)
    expected = [straight.update(s, e) for s, e in zip(std, ent)]
    assert any(expected)

    first = EchoTrapDetector(window=8)
    got = [first.update(s, e) for s, e in zip(std[:22], ent[:22])]
    saved = json.loads(json.dumps(first.state_dict()))  # as it travels in checkpoint meta
    resumed = EchoTrapDetector(window=8)
    resumed.load_state_dict(saved)
    got += [resumed.update(s, e) for s, e in zip(std[22:], ent[22:])]
    assert got == expected


def ragen2_variance_stop(stds):
    """RAGEN-2's reward-variance early stop as its trainer loop reads (`agent_trainer.py`):
    the first 10 values make the base, then a window of the last 10; the step it stops at
    (1-based index into `stds`), or None."""
    first, base, recent = [], None, collections.deque(maxlen=10)
    for i, v in enumerate(stds, 1):
        if len(first) < 10:
            first.append(v)
            if len(first) == 10:
                base = sum(first) / 10
                recent.clear()
        elif base is not None:
            recent.append(v)
            if len(recent) == 10 and all(x < 0.1 * base for x in recent):
                return i
    return None


@pytest.mark.parametrize("seed", range(4))
def test_reward_std_stop_is_ragen2s_and_resumes(seed):
    from starpo.monitors import RewardStdStop
    rng = np.random.default_rng(seed)
    # a healthy start, then a fall to a twentieth with a few spikes above the bar on the way
    stds = list(rng.uniform(0.3, 0.5, 10 + 5 * seed)) + list(rng.uniform(0.0, 0.02, 30))
    spike = 15 + 5 * seed  # 0-based: 5 steps into the fall
    stds[spike] = 0.2  # above a tenth of the base: the next 10 steps must all be low again
    want = ragen2_variance_stop(stds)
    assert want == spike + 1 + 10
    stop = RewardStdStop(10)
    got = next((i for i, v in enumerate(stds, 1) if stop.update(v)), None)
    assert got == want
    # stopped and resumed part-way (the state in checkpoint meta), the same step
    first = RewardStdStop(10)
    assert not any(first.update(v) for v in stds[:17])
    resumed = RewardStdStop(10)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert next(i for i, v in enumerate(stds[17:], 18) if resumed.update(v)) == want
    assert not any(RewardStdStop(0).update(v) for v in stds)  # 0: never
    assert not any(RewardStdStop(10).update(0.0) for _ in range(40))  # groups of one: std 0


def test_low_success_stop_counts_each_tag_in_a_row():
    """RAGEN-2's rule: a tag's validation success below 1% five validations in a row stops;
    one at or above 1% starts its count again; other scalars do not count."""
    from starpo.monitors import LowSuccessStop
    stop = LowSuccessStop(5)
    a, b = "val/FrozenLake/success", "val/Sokoban/success"
    seq = [{a: 0.0, b: 0.5}, {a: 0.005, b: 0.0}, {a: 0.0, b: 0.0}, {a: 0.01, b: 0.0},
           {a: 0.0, b: 0.0, "val/FrozenLake/solver_success": 0.0}, {a: 0.0, b: 0.0}]
    assert [stop.update(v) for v in seq] == [[], [], [], [], [], [b]]
    resumed = LowSuccessStop(5)
    resumed.load_state_dict(json.loads(json.dumps(stop.state_dict())))
    assert resumed.stopping() == [b]
    assert LowSuccessStop(0).update({a: 0.0}) == []


def test_episode_summaries_count_groups_all_passed_and_any_passed():
    """pass@k, pass^k and success's standard error of three groups of four, against counts
    made by hand: group 0 all succeed, group 1 one of four, group 2 none: pass@4 = 2/3,
    pass^4 = 1/3 (so one group of three is mixed, the only one with a GRPO signal); groups of
    one report no pass^1, and their standard error is the episodes' own."""
    from types import SimpleNamespace

    from starpo import evaluate

    success = np.array([1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0], bool)
    n = len(success)
    traj = SimpleNamespace(success=success, turn_reward=success[:, None].astype(np.float32),
                           penalty=np.zeros(n, np.float32), num_actions=np.ones(n))
    per_row = {k: np.zeros(n) for k in ("action_is_valid", "action_is_effective", "num_turns",
                                        "format_errors", "truncated", "response_length",
                                        "context_used")}
    s = evaluate.summarize(traj, per_row, 4)
    assert s["success"] == pytest.approx(5 / 12)
    assert s["pass@4"] == pytest.approx(2 / 3) and s["pass^4"] == pytest.approx(1 / 3)
    # the groups' means 1, 1/4, 0: their unbiased std over sqrt(3 groups)
    assert s["success_stderr"] == pytest.approx(math.sqrt((0.34028 + 0.02778 + 0.17361) / 2 / 3),
                                                rel=1e-4)
    one = evaluate.summarize(traj, per_row, 1)
    assert "pass^1" not in one
    assert one["success_stderr"] == pytest.approx(math.sqrt(5 / 12 * 7 / 12 * 12 / 11 / 12))


def test_a_paired_comparison_differs_level_by_level():
    """Two policies on the same three levels of four episodes, by hand: a succeeds 4, 1, 0
    times, b 2, 1, 1: the levels' differences +1/2, 0, -1/4, mean 1/12 (= 5/12 - 4/12), their
    unbiased std sqrt(((5/12)^2 + (1/12)^2 + (4/12)^2) / 2) over sqrt(3); one level each way.
    A policy against itself differs by exactly 0."""
    from starpo import evaluate

    a = np.array([1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0], bool)
    b = np.array([1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 1, 0], bool)
    d = evaluate.paired(a, b, 4)
    assert d["success_diff"] == pytest.approx(1 / 12)
    assert d["success_diff_stderr"] == pytest.approx(
        math.sqrt((25 + 1 + 16) / 144 / 2) / math.sqrt(3))
    assert (d["levels_better"], d["levels_worse"]) == (1, 1)
    assert evaluate.paired(a, a, 4) == {"success_diff": 0.0, "success_diff_stderr": 0.0,
                                        "levels_better": 0, "levels_worse": 0}


def test_only_the_same_model_with_other_weights_compares():
    """`evaluate.check_comparable`: remat and the attention kernels may differ (they give the
    same numbers); another architecture or tokenizer is a one-line error naming it."""
    import dataclasses

    from starpo import evaluate, model
    from starpo.weights import LoadedModel

    cfg = model.ModelConfig(vocab_size=8, hidden_size=4, num_layers=1, num_heads=2,
                            num_kv_heads=1, head_dim=2, intermediate_size=8)
    tok = types.SimpleNamespace(hf=types.SimpleNamespace(get_vocab=lambda: {"a": 0}),
                                eos_ids=(0,), pad_id=0)
    a = LoadedModel(cfg, {}, tok, "runs/a@2")
    evaluate.check_comparable(a, dataclasses.replace(a, cfg=cfg.replace(
        remat=True, remat_policy="save_dense", attention="xla")))
    with pytest.raises(ValueError) as e:
        evaluate.check_comparable(a, LoadedModel(cfg.replace(rope_theta=100.0), {}, tok, "b"))
    assert str(e.value) == "b is another model than runs/a@2: rope_theta 10000.0 vs 100.0"
    other_tok = types.SimpleNamespace(hf=types.SimpleNamespace(get_vocab=lambda: {"b": 0}),
                                      eos_ids=(0,), pad_id=0)
    with pytest.raises(ValueError, match="^b has another tokenizer than runs/a@2$"):
        evaluate.check_comparable(a, LoadedModel(cfg, {}, other_tok, "b"))


def test_the_monitors_run_in_order_and_resume_their_state():
    """The loop's monitors (`monitors.monitors`): each adds its scalars and lines in order, and
    a monitor restored from its checkpoint state carries on as if never stopped (the empty-filter
    count was not kept in checkpoints before it was a monitor)."""
    from starpo import monitors, schema

    trainer = schema.Trainer(rollout_filter_empty_stop_steps=3, collapse_mi_warn=0.5)
    run = monitors.monitors(trainer, group_size=4)
    assert [m.key for m in run] == ["collapse_detector", "", "empty_filter_steps",
                                    "reward_std_stop", "low_success_stop"]

    def step(ms, n, **scalars):
        lines, stop = [], False
        for m in ms:
            said, stops = m.observe(n, scalars)
            lines, stop = lines + said, stop or stops
        return scalars, lines, stop

    for n in (1, 2):
        scalars, lines, stop = step(run, n, **{"rollout/kept_groups": 0.0})
        assert (scalars["rollout/consecutive_empty_after_filter_steps"], lines, stop) == (
            float(n), [], False)
    saved = {m.key: m.state_dict() for m in run if m.key}
    resumed = monitors.monitors(trainer, group_size=4)
    for m in resumed:
        m.load_state_dict(saved.get(m.key))
    scalars, lines, stop = step(resumed, 3, **{
        "rollout/kept_groups": 0.0, "collapse/mi_estimate": 0.1,
        "collapse/retrieval_chance_level": 0.25, "collapse/retrieval_accuracy": 0.3})
    assert stop and scalars["warning/template_collapse"] == 1.0
    assert [line.split(":")[2].split()[0] for line in lines] == ["template", "the"]
    assert "kept no group 3 steps in a row" in lines[1]
    # a checkpoint saved before the count was kept starts it again
    fresh = monitors.EmptyFilterStop(3)
    fresh.load_state_dict(None)
    assert fresh.empty == 0
