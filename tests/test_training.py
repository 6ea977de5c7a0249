"""Proof that training learns, and that a run survives interruption exactly.

The `tiny` configs train a random-init tiny model from scratch (configs/common.py): the Bandit
run must learn to pick the high-risk arm (the FrozenLake one: tests/test_training_frozenlake.py,
its own file so that the test scheduler can run it beside this one). Fixed seeds; the
assertions are on validation numbers. One built Bandit experiment is shared by every run of
this module, so each program compiles once.
"""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import bandit
from starpo import checkpoint, experiment, metrics, monitors, run_config, training, weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def with_changes(config, **changes):
    """A copy of a locked config with dotted-key changes (only resumable keys in resume tests)."""
    c = config.copy_and_resolve_references()
    c.unlock()
    for key, value in changes.items():
        node = c
        *path, last = key.split("__")
        for p in path:
            node = node[p]
        node[last] = value
    c.lock()
    return c


def val_series(workdir, name):
    rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    return [(r["step"], r[name]) for r in rows if name in r]


@pytest.fixture(scope="module")
def bandit_run():
    config = bandit.get_config("tiny")
    return config, experiment.build(config)


@pytest.fixture(scope="module")
def bandit_trained(bandit_run, tmp_path_factory):
    config, exp = bandit_run
    workdir = str(tmp_path_factory.mktemp("bandit") / "run")
    training.train(config, workdir, progress=False, experiment=exp, log=lambda *a: None)
    return workdir


def test_bandit_learns_the_high_risk_arm(bandit_trained):
    series = val_series(bandit_trained, "val/Bandit/success")
    print("val/Bandit/success by step:", series)
    (first_step, first), (last_step, last) = series[0], series[-1]
    assert first_step == 0 and last_step == bandit.get_config("tiny").trainer.total_steps
    assert first < 0.7, series  # an untrained model does not already prefer the high-risk arm
    assert last >= 0.9, series


def comparable(rows):
    """Metrics rows without wall-clock figures and without the device's measured memory peaks
    (logged where the backend keeps them, e.g. a GPU, at each process's first step: a resumed
    run's first step is another step than the uninterrupted run's)."""
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/", "memory/"))}
            for r in rows]


def test_an_offloaded_state_trains_the_same_and_is_off_the_device_while_sampling(tmp_path,
                                                                               monkeypatch):
    """trainer.offload_state: both AdamW moments and the critic sit in the host's pinned memory
    during every rollout and validation and are back on the device for every update, the
    actor's weights never move; the run's metrics and final weights equal the run without."""
    from starpo import update as update_lib

    config = with_changes(bandit.get_config("tiny"), algorithm__adv_estimator="gae",
                          trainer__total_steps=2, val__test_freq=1, trainer__fast_compile=True)
    real, moves = update_lib.offload, []

    def spy(state, kind, adapters=False):
        out = real(state, kind, adapters)
        moved = (out.actor_opt_state, out.critic_params, out.critic_opt_state)
        moves.append((kind, {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(moved)},
                      {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(
                          out.actor_params)}))
        return out

    monkeypatch.setattr(update_lib, "offload", spy)
    runs = {}
    for offload in (False, True):
        runs[offload] = str(tmp_path / str(offload))
        training.train(with_changes(config, trainer__offload_state=offload), runs[offload],
                       progress=False, log=lambda *a: None)
    # validations before steps 1 and after steps 1, 2; the two steps' rollouts: out and back
    assert [kind for kind, _, _ in moves] == [update_lib.HOST, update_lib.DEVICE] * 5
    assert all(moved == {kind} and actor == {update_lib.DEVICE} for kind, moved, actor in moves)
    a, b = (comparable(metrics.read_jsonl(os.path.join(runs[o], "metrics.jsonl")))
            for o in (False, True))
    assert a == b
    jax.tree_util.tree_map(np.testing.assert_array_equal,
                           *(checkpoint.load_params(os.path.join(runs[o], "checkpoints"), 2)
                             for o in (False, True)))


def test_a_plan_too_big_for_the_device_offloads_then_drops_decode_windows_to_fit(monkeypatch):
    """training.fit_memory: with a device capacity between the plan with the state offloaded
    and the plan without, the run offloads (and says so); between that and the plan with one
    decode window as well, it also plays with one window (its rollouts rebuilt so); above all,
    or below all, it keeps the config's settings; a CPU never does (its host memory is the
    device's)."""
    from starpo import harness, memory

    # a validation of 4,096 episodes at once: its cache outweighs the update (built, not run)
    config = with_changes(bandit.get_config("tiny"), algorithm__adv_estimator="gae",
                          val__env_groups=4096, rollout__decode_windows=2)
    exp = experiment.build(run_config.read(config))

    def worst(offload, windows):
        run = dataclasses.replace(
            exp.run, trainer=dataclasses.replace(exp.run.trainer, offload_state=offload),
            rollout=dataclasses.replace(exp.run.rollout, decode_windows=windows))
        return max(p.total for p in harness.plan_phases(dataclasses.replace(exp, run=run)))

    kept, offloaded, one_window = worst(False, 2), worst(True, 2), worst(True, 1)
    # the critic and the moments leave the sampling phases; one window holds the cache once
    assert one_window < offloaded < kept
    monkeypatch.setattr(training, "offload_frees", lambda device: True)
    for capacity, offload, windows in (((kept + offloaded) / 2, True, 2),
                                       ((offloaded + one_window) / 2, True, 1),
                                       (kept * 2, False, 2), (one_window / 2, False, 2)):
        monkeypatch.setattr(memory, "device_capacity", lambda c=capacity: (c, "device"))
        said = []
        out = training.fit_memory(exp, said.append)
        assert out.run.trainer.offload_state is offload
        assert out.run.rollout.decode_windows == windows == out.rollout.sampler.decode_windows
        assert (out is exp) is (not offload)
        assert bool(said) is offload
        if offload:
            assert said[0].startswith("note: the validation plans ")
            assert ("rollout.decode_windows=1" in said[0]) is (windows == 1)
    monkeypatch.undo()
    device = jax.devices()[0]  # a CPU's host memory is its own memory: never offloaded to
    assert training.offload_frees(device) is (device.platform != "cpu")


def test_resumed_run_equals_uninterrupted_run(bandit_run, tmp_path):
    config, exp = bandit_run
    config = with_changes(config, trainer__total_steps=4, trainer__save_freq=3,
                          val__test_freq=2)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    quiet = lambda *a: None  # noqa: E731
    training.train(config, straight, progress=False, experiment=exp, log=quiet)
    training.train(config, resumed, progress=False, experiment=exp, log=quiet, stop_after=2)
    assert checkpoint.Checkpointer(os.path.join(resumed, "checkpoints")).steps() == [2]
    said = []
    training.train(config, resumed, progress=False, experiment=exp, log=said.append)
    assert any("resuming" in s and "step 2" in s for s in said), said
    a = comparable(metrics.read_jsonl(os.path.join(straight, "metrics.jsonl")))
    b = comparable(metrics.read_jsonl(os.path.join(resumed, "metrics.jsonl")))
    assert [r["step"] for r in a] == [0, 1, 2, 3, 4] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert math.isclose(ra[k], rb[k], rel_tol=1e-5, abs_tol=1e-6) or (
                math.isnan(ra[k]) and math.isnan(rb[k])), (ra["step"], k, ra[k], rb[k])
    # the final weights agree too
    pa = checkpoint.load_params(os.path.join(straight, "checkpoints"), 4)
    pb = checkpoint.load_params(os.path.join(resumed, "checkpoints"), 4)
    jax.tree_util.tree_map(np.testing.assert_array_equal, pa, pb)
    # the update's contexts go into the checkpoint (trimming off here: the whole context)
    with open(os.path.join(resumed, "checkpoints", "4", "meta", "metadata")) as f:
        assert json.load(f)["update_contexts"] == {"compiled": [exp.rollout.context],
                                                   "padding": {}}

    # a damaged checkpoint stops the run with one line, and nothing is changed
    shutil.copytree(resumed, str(tmp_path / "damaged"))
    damaged = str(tmp_path / "damaged")
    latest = os.path.join(damaged, "checkpoints", "4")
    victim = max((os.path.join(d, f) for d, _, fs in os.walk(latest) for f in fs),
                 key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        f.write(b"\xff" * 16)
    before = open(os.path.join(damaged, "metrics.jsonl")).read()
    longer = with_changes(config, trainer__total_steps=6)
    with pytest.raises(checkpoint.CheckpointError) as e:
        training.train(longer, damaged, progress=False, experiment=exp, log=quiet)
    assert "\n" not in str(e.value) and "4" in str(e.value)
    assert open(os.path.join(damaged, "metrics.jsonl")).read() == before


def test_export_and_eval_of_a_trained_run(bandit_trained, tmp_path):
    # export: a Hugging Face directory whose weights are the checkpoint's actor weights
    out = str(tmp_path / "hf")
    p = subprocess.run([sys.executable, "launch/export.py", f"--checkpoint={bandit_trained}",
                        f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    config, policy, step = experiment.load_run(bandit_trained)
    loaded = weights.load_model(out)
    assert loaded.cfg.vocab_size == policy.cfg.vocab_size
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.params, policy.params)
    assert loaded.tokenizer.encode("Dragon</answer>") == policy.tokenizer.encode("Dragon</answer>")

    # eval: a table and a JSON line; the trained policy picks the high-risk arm
    p = subprocess.run([sys.executable, "launch/eval.py", f"--checkpoint={bandit_trained}",
                        "--groups=64", "--temperature=0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["step"] == step and result["groups"] == 64
    assert result["results"]["Bandit"]["success"] >= 0.9
    assert "Bandit" in p.stdout and "success" in p.stdout  # the table


def test_template_collapse_metrics_are_logged_on_ragen2s_steps(bandit_run, tmp_path):
    """trainer.collapse_mi_freq=2: collapse/ scalars on steps 1 and 2 (RAGEN-2: the first step,
    then every freq-th), not on step 3; the default (0) builds nothing. A Bandit level's prompt
    differs only in the arm order (two prompts), so the chance level lies between 1/N and 1.
    With a threshold no MI estimate reaches, the warning fires on every step whose prompts
    differ, and its line is printed."""
    config, exp = bandit_run
    assert training.template_collapse(run_config.read(config), exp) is None
    config = with_changes(config, trainer__total_steps=3, trainer__collapse_mi_freq=2,
                          trainer__collapse_mi_samples=16, trainer__collapse_mi_warn=100.0,
                          val__before_train=False, val__test_freq=0)
    said = []
    training.train(config, str(tmp_path / "run"), progress=False, experiment=exp,
                   log=said.append)
    rows = metrics.read_jsonl(os.path.join(str(tmp_path / "run"), "metrics.jsonl"))
    logged = [r["step"] for r in rows if "collapse/mi_estimate" in r]
    assert logged == [1, 2], logged
    B, N = config.rollout.env_groups * config.rollout.group_size, config.rollout.env_groups
    for r in rows[:2]:
        print({k: round(v, 5) for k, v in r.items() if k.startswith("collapse/")})
        assert r["collapse/first_turn_num_total"] == B == r["collapse/first_turn_num_valid"]
        assert r["collapse/num_samples"] == 16
        assert r["collapse/mi_upper_bound"] == pytest.approx(math.log(N))
        assert r["collapse/mi_estimate"] <= math.log(N)
        assert 1 / N <= r["collapse/retrieval_chance_level"] <= 1
        assert 0 <= r["collapse/retrieval_accuracy"] <= 1
        assert r["collapse/conditional_entropy_est"] > 0 and r["timing/collapse"] > 0
        assert r["warning/template_collapse"] == float(r["collapse/retrieval_chance_level"] < 1)
    assert "warning/template_collapse" not in rows[2]
    warned = [s for s in said if "template collapse" in s]
    assert len(warned) == sum(r["warning/template_collapse"] for r in rows[:2]) > 0, said
    # the EMA of the marginals' std across diagnostic steps (RAGEN-2's decay 0.9), kept in the
    # checkpoint: a run stopped after step 1 and resumed logs step 2's as the straight run does
    std = [r["collapse/marginal_std"] for r in rows[:2]]
    assert rows[1]["collapse/marginal_std_ema"] == pytest.approx(0.9 * std[0] + 0.1 * std[1])
    resumed = str(tmp_path / "resumed")
    for stop_after in (1, None):
        training.train(config, resumed, progress=False, experiment=exp, log=said.append,
                       stop_after=stop_after)
    again = metrics.read_jsonl(os.path.join(resumed, "metrics.jsonl"))
    assert again[1]["collapse/marginal_std_ema"] == pytest.approx(
        rows[1]["collapse/marginal_std_ema"], rel=1e-6)


def test_gradient_analysis_is_logged_on_ragen2s_steps(bandit_run, tmp_path):
    """trainer.gradient_analysis_every=2: RAGEN-2's gradient norms on steps 1 and 3 (1, then
    every 2nd after it), not on 2; the default (0) builds nothing. The `all` bucket holds every
    kept row, the buckets split them, and only the loss terms the config has are measured."""
    config, exp = bandit_run
    assert training.gradient_analysis(run_config.read(config), exp) is None
    config = with_changes(config, trainer__total_steps=3, trainer__gradient_analysis_every=2,
                          trainer__gradient_analysis_num_buckets=2, val__before_train=False,
                          val__test_freq=0)
    training.train(config, str(tmp_path / "run"), progress=False, experiment=exp,
                   log=lambda *a: None)
    rows = metrics.read_jsonl(os.path.join(str(tmp_path / "run"), "metrics.jsonl"))
    assert [r["step"] for r in rows if "grad_norm/all/task" in r] == [1, 3]
    kept = config.rollout.env_groups * config.rollout.group_size
    for r in (rows[0], rows[2]):
        assert r["grad_norm/all/sample_count"] == kept and r["timing/gradient_analysis"] > 0
        buckets = [k for k in r if k.startswith("grad_norm/bucket_") and
                   k.endswith("/sample_count")]
        assert sum(r[k] for k in buckets) == kept and len(buckets) <= 2
        # the tiny Bandit has no entropy bonus and no KL loss: the task term alone
        assert r["actor/grad_norm/task"] == r["grad_norm/all/task"] >= 0
        assert not any(k.endswith(("/entropy", "/kl")) for k in r if k.startswith("grad_norm/"))
    # step 1's groups all scored alike (no GRPO advantage, no task gradient); step 3's did not
    assert rows[0]["rollout/in_group_std"] < 1e-6 and rows[0]["grad_norm/all/task"] < 1e-6
    assert rows[2]["rollout/in_group_std"] > 0 and rows[2]["grad_norm/all/task"] > 1e-3


def test_redirected_output_has_each_step_and_warning_on_a_line_of_its_own(
        bandit_run, tmp_path, capfd, monkeypatch):
    """A run asked for its progress bar (the launchers' default) whose stdout and stderr are
    not terminals (pytest's capture, as `> log 2>&1`) writes no carriage-return frames: every
    step's line, the Echo Trap warning's too, begins a line (`grep '^step' log` counts them)."""
    config, exp = bandit_run
    config = with_changes(config, trainer__total_steps=3, val__test_freq=0)
    monkeypatch.setattr(monitors.EchoTrapDetector, "update", lambda self, std, entropy: True)
    capfd.readouterr()
    training.train(config, str(tmp_path / "run"), progress=True, experiment=exp)
    out, err = capfd.readouterr()
    assert "\r" not in out + err, (out, err)
    lines = out.splitlines()
    assert [s.split(" |")[0] for s in lines if s.startswith("step ")] == [
        f"step {n}/3" for n in range(4)], out
    warned = [s.split(": ")[:2] for s in lines if "Echo Trap" in s]
    assert warned == [["warning", f"step {n}"] for n in (1, 2, 3)], out


def test_a_run_stops_when_the_filter_keeps_nothing_steps_in_a_row(bandit_run, tmp_path, capfd,
                                                                   monkeypatch):
    """RAGEN-2's rollout_filter_empty_stop_steps: steps whose filter kept no group (stood in
    for by the step's scalars) count up, a step that kept one resets the count, and the run
    stops, with a checkpoint and a one-line warning, at the limit."""
    config, exp = bandit_run
    config = with_changes(config, trainer__total_steps=8, val__test_freq=0,
                          val__before_train=False, trainer__rollout_filter_empty_stop_steps=3)
    kept = iter([0, 0, 1, 0, 0, 0, 0, 0])
    real_step = training.train_step

    def step(*args, **kwargs):
        state, scalars = real_step(*args, **kwargs)
        return state, {**scalars, "rollout/kept_groups": float(next(kept))}

    monkeypatch.setattr(training, "train_step", step)
    workdir = str(tmp_path / "run")
    training.train(config, workdir, progress=False, experiment=exp)
    out, _ = capfd.readouterr()
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    streak = [r["rollout/consecutive_empty_after_filter_steps"] for r in rows
              if "rollout/consecutive_empty_after_filter_steps" in r]
    assert streak == [1, 2, 0, 1, 2, 3], streak  # stopped at step 6 of 8
    assert "kept no group 3 steps in a row" in out and "step 6/8" in out
    reader = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    assert reader.latest_step() == 6
    reader.close()


def test_ragen2s_reward_std_and_low_success_stops(bandit_run, tmp_path, capfd, monkeypatch):
    """trainer.reward_std_stop_steps=2: the base is the first 2 steps' mean in-group std
    (0.5), then 2 trained steps in a row below 0.05 stop the run (a step whose filter kept
    nothing does not count); trainer.low_success_stop_validations=2: two validations in a row
    below 1% success stop it. Each stop logs its early_stopped/ scalar, warns and saves."""
    config, exp = bandit_run
    stds = iter([0.5, 0.5, 0.01, 0.3, 0.0, 0.01, 0.01, 0.5, 0.5, 0.5])
    kept = iter([1, 1, 1, 1, 0, 1, 1, 1, 1, 1])
    real_step = training.train_step

    def step(*args, **kwargs):
        state, scalars = real_step(*args, **kwargs)
        return state, {**scalars, "rollout/in_group_std": next(stds),
                       "rollout/kept_groups": float(next(kept))}

    monkeypatch.setattr(training, "train_step", step)
    runs = {}
    for name, changes in (("std", dict(trainer__reward_std_stop_steps=2, val__test_freq=0)),
                          ("success", dict(trainer__low_success_stop_validations=2,
                                           val__test_freq=1))):
        success = iter([0.0, 0.5, 0.0, 0.0, 0.5, 0.5])
        monkeypatch.setattr(training._Loop, "_validate",
                            lambda self, n, say, s=success: {"val/Bandit/success": next(s)})
        workdir = str(tmp_path / name)
        training.train(with_changes(config, trainer__total_steps=9, val__before_train=False,
                                    **changes), workdir, progress=False, experiment=exp)
        rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
        reader = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
        runs[name] = (rows[-1]["step"], reader.latest_step(), [k for k in rows[-1]
                                                                 if k.startswith("early")])
        reader.close()
        stds, kept = iter([0.5] * 9), iter([1] * 9)  # the second run: its std never falls
    assert runs["std"] == (7, 7, ["early_stopped/reward_variance_collapse"]), runs
    assert runs["success"] == (4, 4, ["early_stopped/low_validation_success"]), runs
    out, _ = capfd.readouterr()
    assert "below a tenth of its first 2 steps' mean (0.5) 2 steps in a row" in out, out
    assert "below 1% 2 validations in a row on val/Bandit/success" in out, out


def test_measured_device_peaks_are_logged_beside_the_plan_once_per_phase(bandit_run, tmp_path,
                                                                         monkeypatch):
    """Where the backend reports a peak (not XLA:CPU: nothing is logged there), the first
    validation and the first step log the device's peak so far after each phase beside its
    plan, as a line and as memory/<phase>_peak_gb, once each, and with the first of them the
    peak once the state was built, before any phase (a fake allocator here)."""
    from starpo import memory

    if jax.default_backend() == "cpu":
        assert memory.device_peak() is None  # XLA:CPU reports no allocator stats
    config, exp = bandit_run
    config = with_changes(config, trainer__total_steps=2, val__test_freq=1)
    peaks = iter([0.5e9, 1e9, 2e9, 3e9])  # set-up, validation, the first rollout and update
    monkeypatch.setattr(memory, "device_peak", lambda: next(peaks))
    said = []
    training.train(config, str(tmp_path / "run"), progress=False, experiment=exp,
                   log=said.append)
    lines = [s for s in said if s.startswith("memory measured:")]
    phases = ["setup", "validation", "rollout", "update"]
    assert [line.split()[2] for line in lines] == phases, said
    assert "peak so far 2.00 GB (plan: ~" in lines[2]
    rows = metrics.read_jsonl(os.path.join(str(tmp_path / "run"), "metrics.jsonl"))
    logged = {k: (r["step"], v) for r in rows for k, v in r.items() if k.startswith("memory/")}
    assert logged == {"memory/setup_peak_gb": (0, 0.5), "memory/validation_peak_gb": (0, 1.0),
                      "memory/rollout_peak_gb": (1, 2.0), "memory/update_peak_gb": (1, 3.0)}, logged


def test_a_kl_loss_is_measured_against_the_starting_policy(tmp_path):
    """algorithm.use_kl_loss (vanilla StarPO's KL term): the first batch is scored by the very
    policy that is the reference, so its actor/ref_kl is 0 up to float rounding, and once the
    policy has moved it is > 0; a run stopped after step 2 and resumed keeps the starting policy
    as its reference (not the resumed weights): the same KL numbers as one straight run."""
    config = with_changes(bandit.get_config("tiny"), algorithm__use_kl_loss=True,
                          algorithm__kl_loss_coef=0.01, algorithm__kl_loss_type="low_var_kl",
                          trainer__total_steps=3, trainer__save_freq=2,
                          val__before_train=False, val__test_freq=0)
    exp = experiment.build(config)
    quiet = lambda *a: None  # noqa: E731
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    training.train(config, straight, progress=False, experiment=exp, log=quiet)
    training.train(config, resumed, progress=False, experiment=exp, log=quiet, stop_after=2)
    training.train(config, resumed, progress=False, experiment=exp, log=quiet)
    kl = {w: [(r["step"], r["actor/ref_kl"], r["actor/kl_loss"])
              for r in metrics.read_jsonl(os.path.join(w, "metrics.jsonl"))]
          for w in (straight, resumed)}
    (s1, ref1, _), _, (s3, ref3, loss3) = kl[straight]
    assert (s1, s3) == (1, 3) and abs(ref1) < 1e-6 and ref3 > 1e-5 and loss3 > 1e-5, kl
    for a, b in zip(kl[straight], kl[resumed], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-8), kl
