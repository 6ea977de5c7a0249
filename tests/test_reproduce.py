"""launch/reproduce.py: the commands of a paper table, resuming, and the printed table.
(A real tiny row end to end takes minutes on a loaded 2-core machine: docs/training.md, not here.)"""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from launch import reproduce

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def cli(*args, cwd=ROOT):
    return subprocess.run([PY, "launch/reproduce.py", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, check=False)


def test_dry_run_lists_the_real_entry_points_with_each_rows_knobs(tmp_path):
    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text("{}")
    p = cli("--table=generalisation", "--columns=Bandit,Bandit-Rev", f"--model_path={model}",
            f"--workdir={tmp_path}/w", "--dry_run")
    assert p.returncode == 0, p.stderr
    w, s = f"{tmp_path}/w", ("--config.algorithm.adv_estimator=gae "
                             "--config.algorithm.rollout_filter_ratio=0.25 "
                             "--config.algorithm.clip_ratio_low=0.2 "
                             "--config.algorithm.clip_ratio_high=0.28")
    assert p.stdout.splitlines() == [
        (f"python launch/train.py --config=configs/bandit.py --workdir={w}/starpo-s_Bandit "
         f"--config.model.path={model} {s} --config.val.tags=Bandit,BanditTest "
         "--config.trainer.total_steps=200"),
        (f"python launch/eval.py --checkpoint={w}/starpo-s_Bandit --tags=Bandit,BanditTest "
         f"--out={w}/starpo-s_Bandit/eval/Bandit+BanditTest.json"),
        (f"python launch/train.py --config=configs/bandit.py --workdir={w}/starpo-s_Bandit_nothink "
         f"--config.model.path={model} {s} --config.rollout.enable_think=False "
         "--config.val.tags=Bandit,BanditTest --config.trainer.total_steps=200"),
        (f"python launch/eval.py --checkpoint={w}/starpo-s_Bandit_nothink "
         f"--tags=Bandit,BanditTest --out={w}/starpo-s_Bandit_nothink/eval/Bandit+BanditTest.json"),
    ]
    assert not os.path.exists(f"{tmp_path}/w")  # a dry run writes nothing

    # the main table: StarPO-S filters to a quarter with a critic and clip-higher, StarPO keeps
    # every group (GRPO, symmetric clip), SFT runs launch/sft.py as many steps as RL trains
    main = reproduce.plan(["main"], "w", variant="tiny", steps=0)
    assert len(main) == 18 and all(not done for _, done in main)
    lines = {c[3].removeprefix("--workdir=w/"): c for c, _ in main if "--workdir=w/" in c[3]}
    assert sorted(lines) == sorted(f"{a}_{e}" for a in ("starpo", "starpo-s", "sft")
                                   for e in ("Bandit", "FrozenLake", "SimpleSokoban"))
    for name, c in lines.items():
        knobs = dict(a[len("--config."):].split("=", 1) for a in c[4:])
        env = name.split("_")[1]
        steps = {"Bandit": "20", "FrozenLake": "150", "SimpleSokoban": "40"}[env]
        assert c[2] == f"--config=configs/{reproduce.CONFIG_FILE[env]}:tiny"
        if name.startswith("sft_"):
            assert c[1].endswith("launch/sft.py") and knobs["sft.steps"] == steps
            assert not any(k.startswith("algorithm.") for k in knobs)
            continue
        assert c[1].endswith("launch/train.py") and knobs["trainer.total_steps"] == steps
        want = (("gae", "0.25", "0.28") if name.startswith("starpo-s_") else ("grpo", "1.0", "0.2"))
        assert (knobs["algorithm.adv_estimator"], knobs["algorithm.rollout_filter_ratio"],
                knobs["algorithm.clip_ratio_high"], knobs["algorithm.clip_ratio_low"]) == (*want,
                                                                                           "0.2")
        assert knobs.get("algorithm.use_kl_loss") == (None if name.startswith("starpo-s_")
                                                      else "True")
    # Table 2 keeps the batch's episodes: tiny FrozenLake's 128 x 1 becomes 32 x 4
    (c, _), _ = reproduce.plan(["responses_per_prompt"], "w", variant="tiny",
                               columns=["FrozenLake"])
    assert "--config.rollout.env_groups=32" in c and "--config.rollout.group_size=4" in c
    # Table 3's 5-action row is the main table's StarPO-S run: trained once for both
    runs = [c[3] for c, _ in reproduce.plan(["main", "actions_per_turn"], "w")
            if not c[1].endswith("eval.py")]
    assert len(runs) == len(set(runs)) == 10


@pytest.mark.parametrize("args, words", [
    (["--table=table9"], "flag --table=table9"),
    (["--table=main", "--model_path=/no/such/model"], "/no/such/model"),
    (["--table=main", "--rows=PPO"], "table main has no row 'PPO'"),
    (["--table=main", "--set=algorithm.nope=1"],
     "run starpo_Bandit: unknown config key 'algorithm.nope'"),
    (["--model_path=tiny"], "--table is required"),
])
def test_bad_input_is_one_line_before_any_work(tmp_path, args, words):
    p = cli(*args, f"--workdir={tmp_path}/w")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert words in lines[0] and not os.path.exists(tmp_path / "w")


def write_eval(workdir, run, tags, success, groups=256, against=None):
    """An evaluation's JSON as launch/eval.py --out writes it; against: (run, its successes,
    the paired differences' standard errors), as with --against."""
    os.makedirs(os.path.join(workdir, run, "eval"), exist_ok=True)
    line = {"model": f"{run}@200", "step": 200, "temperature": 0.5, "groups": groups,
            "group_size": 1, "results": {t: {"success": s} for t, s in zip(tags, success)}}
    if against:
        other, theirs, stderrs = against
        line["against"] = {"model": f"{other}@100", "step": 100,
                           "results": {t: {"success": s} for t, s in zip(tags, theirs)}}
        line["paired"] = {t: {"success_diff": a - b, "success_diff_stderr": e}
                          for t, a, b, e in zip(tags, success, theirs, stderrs)}
    with open(os.path.join(workdir, run, "eval", "+".join(tags) + ".json"), "w") as f:
        json.dump(line, f)


def finish(command):
    """What a launcher's command leaves behind, without running it: an evaluation's JSON
    (success 0.5 on each tag) or a training run's checkpoint at its last step."""
    from starpo import checkpoint

    args = dict(a[2:].split("=", 1) for a in command[2:])
    if command[1].endswith("eval.py"):
        tags = args["tags"].split(",")
        against = args.get("against") and (os.path.basename(args["against"]), [0.5] * len(tags),
                                           [0.0] * len(tags))
        write_eval(os.path.dirname(os.path.dirname(os.path.dirname(args["out"]))),
                   os.path.basename(args["checkpoint"]), tags, [0.5] * len(tags),
                   against=against)
    else:
        steps = int(args.get("config.trainer.total_steps") or args["config.sft.steps"])
        ckpt = checkpoint.Checkpointer(os.path.join(args["workdir"], "checkpoints"))
        ckpt.save(steps, {"w": np.zeros(2, np.float32)}, {"step": steps})
        ckpt.close()
    return types.SimpleNamespace(returncode=0)


def test_the_table_in_the_papers_layout(tmp_path):
    w = str(tmp_path)
    write_eval(w, "starpo-s_FrozenLake", ["FrozenLake"], [0.25])
    write_eval(w, "sft_SimpleSokoban", ["SimpleSokoban"], [0.5])
    write_eval(w, "starpo_SimpleSokoban", ["SimpleSokoban"], [0.03125])
    text = reproduce.format_table("main", w).splitlines()
    cells = {(c["row"], c["column"]): (c["ours"], c["paper"])
             for c in json.loads(text[-1])["cells"]}
    assert cells == {
        ("StarPO", "Bandit"): (None, None), ("StarPO", "FrozenLake"): (None, 20.0),
        ("StarPO", "Sokoban"): (3.12, 10.0), ("StarPO-S", "Bandit"): (None, 100.0),
        ("StarPO-S", "FrozenLake"): (25.0, 21.8), ("StarPO-S", "Sokoban"): (None, 20.3),
        ("SFT", "Bandit"): (None, None), ("SFT", "FrozenLake"): (None, 23.0),
        ("SFT", "Sokoban"): (50.0, 74.6)}
    assert set(text[2]) == {"-", "+"}
    grid = [[x.strip() for x in line.split("|")] for line in text[1:6] if line != text[2]]
    assert grid == [["", "Bandit", "FrozenLake", "Sokoban"],
                    ["StarPO", "pending / —", "pending / ~20", "3.12 / ~10"],
                    ["StarPO-S", "pending / 100", "25.00 / 21.8", "pending / 20.3"],
                    ["SFT", "pending / —", "pending / 23", "50.00 / 74.6"]]
    assert text[0].endswith("(ours on 256 levels at temperature 0.5)")
    assert any(line.startswith("~: the paper's vanilla StarPO") for line in text)
    assert "env variants: Sokoban = our SimpleSokoban" in text

    # Table 4 from one evaluation file of several tags; the paper's names of our variants
    write_eval(w, "starpo-s_SimpleSokoban", ["SimpleSokoban", "SokobanDifferentGridVocab",
                                             "LargerSokoban", "FrozenLake"], [0.5, 0.25, 0.0, 1.0])
    text = reproduce.format_table("generalisation", w, rows=["Sokoban"]).splitlines()
    grid = [[x.strip() for x in line.split("|")] for line in (text[1], text[3])]
    assert grid == [["", "Sokoban", "NewVocab", "LargeSokoban", "FrozenLake"],
                    ["Sokoban", "50.00 / 21.48", "25.00 / 18.75", "0.00 / 2.34", "100.00 / 19.92"]]
    assert ("env variants: LargeSokoban = our LargerSokoban, NewVocab = our "
            "SokobanDifferentGridVocab, Sokoban = our SimpleSokoban") in text


def test_a_reproduction_resumes_where_it_stopped(tmp_path, capsys):
    """Runs whose checkpoint reached the last step and tags already evaluated are skipped; a
    failing command ends it with that command's status."""
    from starpo import checkpoint

    w, ran = str(tmp_path), []

    def runner(command, check):
        ran.append(command)
        return finish(command)

    kw = {"variant": "tiny", "steps": 2, "columns": ["Bandit", "Bandit-Rev"]}
    # the Bandit run, already evaluated on Bandit alone: only Bandit-Rev is left to evaluate
    write_eval(w, "starpo-s_Bandit", ["Bandit"], [1.0])
    ckpt = checkpoint.Checkpointer(os.path.join(w, "starpo-s_Bandit", "checkpoints"))
    ckpt.save(2, {"w": np.zeros(2, np.float32)}, {"step": 2})
    ckpt.close()
    reproduce.reproduce(["generalisation"], w, runner=runner, **kw)
    assert [(os.path.basename(c[1]), c[3]) for c in ran] == [
        ("eval.py", "--tags=BanditTest"),
        ("train.py", f"--workdir={w}/starpo-s_Bandit_nothink"),
        ("eval.py", "--tags=Bandit,BanditTest")]
    ran.clear()
    reproduce.reproduce(["generalisation"], w, runner=runner, **kw)  # all done
    assert ran == []
    assert all(done for _, done in reproduce.plan(["generalisation"], w, **kw))
    # more steps: the runs are not finished any more (the same workdirs resume)
    assert [done for _, done in reproduce.plan(["generalisation"], w, **{**kw, "steps": 3})] == [
        False, True, False, True]
    text = reproduce.format_table("generalisation", w, columns=kw["columns"])
    assert [c["ours"] for c in json.loads(text.splitlines()[-1])["cells"]] == [100.0, 50.0,
                                                                                50.0, 50.0]

    def failing(command, check):
        return types.SimpleNamespace(returncode=75)

    with pytest.raises(SystemExit) as e:
        reproduce.reproduce(["main"], w, runner=failing, variant="tiny", columns=["Bandit"])
    assert e.value.code == 75
    assert "error: train.py exited with status 75" in capsys.readouterr().err


def test_seeds_run_side_by_side_each_in_order(tmp_path, capsys, monkeypatch):
    """--parallel=2 with two seeds: each seed's commands (SFT, its evaluation, RL from it, its
    evaluation) in plan order, the two seeds at once (each first command waits for the other's
    at a barrier, which a one-after-another run never reaches), each process with half of 0.9
    of an accelerator's memory and its output in workdir/logs/; a failing seed stops its own
    commands only, and the reproduction then exits with its status."""
    import threading

    # the share each seed gets when the user set none (a user's own setting is kept)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    w, ran, lock = str(tmp_path), [], threading.Lock()
    barrier = threading.Barrier(2, timeout=20)
    first = set()

    def runner(command, check, env, stdout, stderr, fail_seed=None):
        args = dict(a[2:].split("=", 1) for a in command[2:])
        run = os.path.basename(args.get("workdir") or args["checkpoint"])
        seed = int(run.rsplit("_seed", 1)[1]) if "_seed" in run else 0
        with lock:
            ran.append((seed, command, env["XLA_PYTHON_CLIENT_MEM_FRACTION"], stdout.name))
            wait = seed not in first
            first.add(seed)
        if wait:
            barrier.wait()  # both seeds' first commands at once, or a BrokenBarrierError
        stdout.write(f"output of {run}\n")
        if seed == fail_seed:
            return types.SimpleNamespace(returncode=3)
        return finish(command)

    kw = dict(variant="gpu", rows=["SFT", "SFT then RL"], columns=["FrozenLakeNonSlippery"],
              seeds=(0, 1))
    planned = [c for c, _ in reproduce.plan(["baselines"], w, **kw)]
    reproduce.reproduce(["baselines"], w, runner=runner, parallel=2, **kw)
    for seed in (0, 1):
        mine = [c for s, c, _, _ in ran if s == seed]
        suffix = "_seed1" if seed else ""
        assert [os.path.basename(c[1]) for c in mine] == ["sft.py", "eval.py", "train.py",
                                                          "eval.py"]
        assert mine == [c for c in planned if any(a.endswith(f"_FrozenLakeNonSlippery{suffix}")
                                                   for a in c)]
    assert {fraction for *_, fraction, _ in ran} == {"0.45"}
    assert {os.path.basename(log) for *_, log in ran} == {
        f"{a}_FrozenLakeNonSlippery{s}.{launcher}.log" for a, launcher in (
            ("sft", "sft"), ("sft", "eval"), ("starpo-s", "train"), ("starpo-s", "eval"))
        for s in ("", "_seed1")}
    assert open(os.path.join(w, "logs", "sft_FrozenLakeNonSlippery_seed1.sft.log")).read() == (
        "output of sft_FrozenLakeNonSlippery_seed1\n")
    assert all(done for _, done in reproduce.plan(["baselines"], w, **kw))

    # seed 1 done: seeds 2 and 3 run; seed 3 fails at its first command, so its other
    # commands never run, while seed 2's all do
    ran.clear(), first.clear(), barrier.reset()
    kw["seeds"] = (1, 2, 3)
    with pytest.raises(SystemExit) as e:
        reproduce.reproduce(["baselines"], w, parallel=2, **kw,
                            runner=lambda c, **k: runner(c, fail_seed=3, **k))
    assert e.value.code == 3
    assert [os.path.basename(c[1]) for _, c, _, _ in ran if "_seed3" in " ".join(c)] == [
        "sft.py"]
    assert len([c for _, c, _, _ in ran if "_seed2" in " ".join(c)]) == 4
    assert "error: sft.py exited with status 3" in capsys.readouterr().err


def test_eval_out_must_be_writable(tmp_path):
    """launch/eval.py --out (the files reproduce.py reads) fails before evaluating, not after."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = subprocess.run([PY, "launch/eval.py", "--config=configs/bandit.py:tiny",
                        f"--out={blocker}/eval/x.json"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=False)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: --out {blocker}")


def test_baselines_table_evaluates_the_untrained_model_and_prints_exact_figures(tmp_path):
    """The baselines table: the untrained model is evaluated from its config (no training
    command), SFT and SFT then RL train as in the main table, each lake's column from runs
    trained on that lake (RAGEN-2's non-slippery one under its own name, so that the paper's
    slippery lake keeps "FrozenLake"), every lake run is evaluated on both lakes, and the exact
    rows come from experiments/lake_baselines.py (the variant's turn budget, the evaluation's
    levels) without any run."""
    from experiments import lake_baselines

    w = str(tmp_path / "w")
    commands = [c for c, _ in reproduce.plan(["baselines"], w, variant="gpu", eval_groups=16)]
    untrained = [c for c in commands if "untrained_FrozenLake" in " ".join(c)]
    assert len(untrained) == 1 and untrained[0][1].endswith("eval.py")
    assert untrained[0][2] == "--config=configs/frozenlake.py:gpu"
    assert "--tags=FrozenLake,FrozenLakeNonSlippery" in untrained[0]
    trained = {os.path.basename(c[3]) for c in commands if c[1].endswith(("train.py", "sft.py"))}
    assert trained == {f"{a}_{e}" for a in ("sft", "starpo-s")
                       for e in ("FrozenLake", "FrozenLakeNonSlippery", "SimpleSokoban",
                                 "Bandit")}
    for algo in ("sft", "starpo-s"):
        (run,) = [c for c in commands if c[1].endswith(("train.py", "sft.py"))
                  and c[3].endswith(f"{algo}_FrozenLakeNonSlippery")]
        assert run[2] == "--config=configs/frozenlake.py:gpu"
        assert {"--config.env.name=FrozenLakeNonSlippery",
                "--config.env.options.is_slippery=False"} <= set(run)
        (evaluation,) = [c for c in commands if c[1].endswith("eval.py")
                         and f"--checkpoint={w}/{algo}_FrozenLakeNonSlippery" in c]
        assert "--tags=FrozenLakeNonSlippery,FrozenLake" in evaluation
        (evaluation,) = [c for c in commands if c[1].endswith("eval.py")
                         and f"--checkpoint={w}/{algo}_FrozenLake" in c]
        assert "--tags=FrozenLake,FrozenLakeNonSlippery" in evaluation
    reproduce.check([(c, False) for c in commands])  # every run's config as its launcher reads it
    text = reproduce.format_table("baselines", w, variant="gpu", groups=16)
    cells = {(c["row"], c["column"]): c["ours"] for c in json.loads(text.splitlines()[-1])["cells"]}
    turns = reproduce.base_config("FrozenLake", "gpu").rollout.max_turn
    for slippery, tag in ((True, "FrozenLake"), (False, "FrozenLakeNonSlippery")):
        want = lake_baselines.exact_success(16, turns, slippery, per_turn=5, per_episode=10)
        assert cells["solver (exact)", tag] == round(100 * want["budget optimum"], 2)
        assert cells["solver, one move a turn (exact)", tag] == round(100 * want["solver"], 2)
        assert want["budget optimum"] > want["solver"]
        assert cells["best constant move (exact)", tag] == round(100 * want["best constant move"],
                                                                   2)
    assert cells["untrained", "FrozenLake"] is None  # not evaluated yet: pending
    write_eval(w, "starpo-s_FrozenLakeNonSlippery", ["FrozenLakeNonSlippery", "FrozenLake"],
               [0.875, 0.25])
    write_eval(w, "starpo-s_FrozenLake", ["FrozenLake", "FrozenLakeNonSlippery"], [0.25, 0.125])
    cells = {(c["row"], c["column"]): (c["ours"], c["run"]) for c in json.loads(
        reproduce.format_table("baselines", w, variant="gpu", groups=16).splitlines()[-1])[
            "cells"]}
    assert cells["SFT then RL", "FrozenLakeNonSlippery"] == (87.5, "starpo-s_FrozenLakeNonSlippery")
    assert cells["SFT then RL", "FrozenLake"] == (25.0, "starpo-s_FrozenLake")
    assert cells["untrained", "FrozenLakeNonSlippery"][1] == "untrained_FrozenLake"


def test_seeds_run_apart_and_the_table_gives_their_mean(tmp_path):
    """--seeds: every run once per seed, in a folder of its own with the config's seed set
    (seed 0 keeps the folder without a suffix); a cell is the mean over the seeds evaluated so
    far, with the standard error across them, and the JSON line keeps each seed's figure."""
    w = str(tmp_path)
    commands = [c for c, _ in reproduce.plan(["main"], w, variant="tiny", rows=["StarPO-S"],
                                             columns=["FrozenLake"], seeds=(0, 3))]
    train = [c for c in commands if c[1].endswith("train.py")]
    assert [a for c in train for a in c if a.startswith("--workdir=")] == [
        f"--workdir={w}/starpo-s_FrozenLake", f"--workdir={w}/starpo-s_FrozenLake_seed3"]
    assert "--config.seed=3" in train[1] and not any("seed=" in a for a in train[0])
    untrained = reproduce.eval_command(reproduce.Run("untrained", "Bandit", seed=3), w,
                                       ["Bandit"], 0, "tiny")
    assert "--config.seed=3" in untrained

    write_eval(w, "starpo-s_FrozenLake", ["FrozenLake"], [0.25])
    text = reproduce.format_table("main", w, rows=["StarPO-S"], columns=["FrozenLake"],
                                  seeds=(0, 3)).splitlines()
    (cell,) = json.loads(text[-1])["cells"]
    assert (cell["ours"], cell["seeds"]) == (25.0, {"0": 25.0})  # one seed so far: no spread
    assert text[3].split("|")[1].strip() == "25.00 / 21.8"
    write_eval(w, "starpo-s_FrozenLake_seed3", ["FrozenLake"], [0.375])
    text = reproduce.format_table("main", w, rows=["StarPO-S"], columns=["FrozenLake"],
                                  seeds=(0, 3)).splitlines()
    (cell,) = json.loads(text[-1])["cells"]
    assert (cell["ours"], cell["seeds"]) == (31.25, {"0": 25.0, "3": 37.5})
    # standard error of the mean of 25 and 37.5: sample sd 8.839 / sqrt(2) = 6.25
    assert text[3].split("|")[1].strip() == "31.25 ±6.25 (2 seeds) / 21.8"
    assert "starpo-s_FrozenLake_seed3" in text[-2]

    bad = cli("--table=main", "--seeds=0,-1", "--dry_run", f"--workdir={w}")
    assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1] == (
        "error: --seeds: '-1' is not a non-negative integer")


def test_sft_alone_is_the_warm_start_of_sft_then_rl():
    """Under a variant whose RL runs warm-start with SFT (gpu: 500 SFT steps, then 100 RL
    steps), the SFT row trains the warm start's 500 steps, not the RL run's 100; the paper-sized
    and tiny configs (no warm start) keep the paper's protocol: as many steps as RL."""
    def sft_steps(variant):
        commands = [c for c, _ in reproduce.plan(["baselines"], "w", variant=variant,
                                                 rows=["SFT"], columns=["FrozenLake"])]
        (train,) = [c for c in commands if c[1].endswith("sft.py")]
        return int(next(a for a in train if a.startswith("--config.sft.steps=")).split("=")[1])

    from configs import frozenlake

    gpu = frozenlake.get_config("gpu")
    assert gpu.sft.steps > 0 and gpu.sft.steps != gpu.trainer.total_steps
    assert sft_steps("gpu") == gpu.sft.steps
    assert sft_steps("tiny") == frozenlake.get_config("tiny").trainer.total_steps


def test_rl_rows_start_from_the_sft_row_instead_of_training_it_again(tmp_path):
    """Under a warm-starting variant (gpu) an RL row whose SFT row is in the plan starts from
    that row's weights (`model.init_from`, `sft.steps=0`), after it in the plan: one SFT per env
    and seed, and "SFT then RL" starts exactly where "SFT" ends. The plan's check accepts the
    run it has yet to train. Without the SFT row, with --steps (smoke runs) or without a warm
    start (tiny), each RL run keeps its own."""
    w = str(tmp_path)

    def commands(**kw):
        return [c for c, _ in reproduce.plan(["baselines"], w, columns=["FrozenLake"], **kw)]

    def arg(command, key):
        return next((a.split("=", 1)[1] for a in command if a.startswith(f"--config.{key}=")),
                    None)

    plan = commands(variant="gpu", seeds=(0, 2))
    trains = [c for c in plan if c[1].endswith(("train.py", "sft.py"))]
    names = [os.path.basename(next(a for a in c if a.startswith("--workdir="))) for c in trains]
    assert names == ["sft_FrozenLake", "sft_FrozenLake_seed2", "starpo-s_FrozenLake",
                     "starpo-s_FrozenLake_seed2"]
    for rl, sft_dir in zip(trains[2:], ("sft_FrozenLake", "sft_FrozenLake_seed2")):
        assert arg(rl, "model.init_from") == os.path.join(w, sft_dir)
        assert arg(rl, "sft.steps") == "0"
    reproduce.check([(c, False) for c in plan])  # the SFT runs do not exist yet: accepted
    alone = [c for c in commands(variant="gpu", rows=["SFT then RL"])
             if c[1].endswith("train.py")]
    smoke = [c for c in commands(variant="gpu", steps=2) if c[1].endswith("train.py")]
    tiny = [c for c in commands(variant="tiny") if c[1].endswith("train.py")]
    for c in alone + smoke + tiny:
        assert arg(c, "model.init_from") is None


def test_rl_started_from_the_sft_row_is_evaluated_beside_it_and_the_table_pairs_them(tmp_path):
    """Under a warm-starting variant (gpu) the RL row's evaluation plays its SFT run's
    checkpoint too (`launch/eval.py --against`: the same levels, the same keys), so the
    baselines table's paired row gives each seed's gain over its warm start: signed, with the
    evaluation's standard error for one seed and the spread across seeds for several. An RL
    evaluation made without its SFT run is made again with it; without a warm start (tiny) the
    RL run has no SFT run to play against, and the paired row stays pending."""
    w = str(tmp_path)
    kw = dict(variant="gpu", rows=[reproduce.PAIRED_ROW], columns=["FrozenLakeNonSlippery"])
    plan = [c for c, _ in reproduce.plan(["baselines"], w, **kw)]
    # the paired row alone still trains the SFT run and starts RL from it
    assert [os.path.basename(c[1]) for c in plan] == ["sft.py", "eval.py", "train.py", "eval.py"]
    rl_eval = plan[-1]
    assert f"--checkpoint={w}/starpo-s_FrozenLakeNonSlippery" in rl_eval
    assert f"--against={w}/sft_FrozenLakeNonSlippery" in rl_eval
    assert not any(a.startswith("--against") for a in plan[1])  # SFT's own evaluation
    reproduce.check([(c, False) for c in plan])

    def table(seeds=(0,)):
        text = reproduce.format_table("baselines", w, seeds=seeds, **kw).splitlines()
        (cell,) = json.loads(text[-1])["cells"]
        return text[3].split("|")[1].strip(), cell

    assert table()[0] == "pending / —"
    # an evaluation of the RL run alone (an earlier reproduction's) does not pair it: again
    write_eval(w, "starpo-s_FrozenLakeNonSlippery", ["FrozenLakeNonSlippery", "FrozenLake"],
               [0.875, 0.25])
    assert not reproduce.plan(["baselines"], w, **kw)[-1][1]
    assert table()[0] == "pending / —"
    write_eval(w, "starpo-s_FrozenLakeNonSlippery", ["FrozenLakeNonSlippery", "FrozenLake"],
               [0.875, 0.25], against=("sft_FrozenLakeNonSlippery", [0.8125, 0.3125],
                                       [0.0125, 0.02]))
    assert reproduce.plan(["baselines"], w, **kw)[-1][1]  # done
    text, cell = table()
    assert text == "+6.25 ±1.25 (paired) / —"
    assert (cell["ours"], cell["run"]) == (6.25, "starpo-s_FrozenLakeNonSlippery")
    write_eval(w, "starpo-s_FrozenLakeNonSlippery_seed1", ["FrozenLakeNonSlippery", "FrozenLake"],
               [0.75, 0.25], against=("sft_FrozenLakeNonSlippery_seed1", [0.8125, 0.25],
                                      [0.01, 0.01]))
    text, cell = table(seeds=(0, 1))
    # mean of +6.25 and -6.25, standard error of that mean: sample sd 8.839 / sqrt(2) = 6.25
    assert (text, cell["seeds"]) == ("+0.00 ±6.25 (2 seeds) / —", {"0": 6.25, "1": -6.25})
    full = reproduce.format_table("baselines", w, variant="gpu", seeds=(0, 1))
    assert f"{reproduce.PAIRED_ROW}: points of success the RL run gained" in full
    tiny = [c for c, _ in reproduce.plan(["baselines"], w, variant="tiny", rows=kw["rows"],
                                         columns=kw["columns"])]
    assert [os.path.basename(c[1]) for c in tiny] == ["train.py", "eval.py"]
    assert not any(a.startswith("--against") for c in tiny for a in c)


def test_the_readmes_gpu_rows_are_the_evaluations_kept_in_the_repository():
    """results/smollm2_gpu/ is a reproduction's workdir holding only what its tables read (each
    run's config.json and eval/ JSON, no checkpoints), gathered from the GPU leases:
    `python launch/reproduce.py --table=baselines --variant=gpu --seeds=0,1,2
    --workdir=results/smollm2_gpu --print_only` prints the tables from them, and each figure the
    README's SmolLM2 GPU rows state for both lakes and Sokoban is the one there."""
    rows = ("SFT", "SFT then RL", reproduce.PAIRED_ROW)
    data = reproduce.table_data("baselines", os.path.join(ROOT, "results", "smollm2_gpu"), rows,
                                ("FrozenLake", "FrozenLakeNonSlippery", "Sokoban"), "gpu",
                                seeds=(0, 1, 2))
    got = {(row, column): ours / 100 for row, column, _, ours, *_ in data}
    assert len(got) == 9 and None not in got.values()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read().splitlines()

    def row(start):
        return next(line for line in readme if line.startswith(start))

    lake = row("| SmolLM2-135M on the paper's slippery lake")
    assert f"success **{got['SFT then RL', 'FrozenLake']:.3f}**" in lake
    assert f"SFT steps ({got['SFT', 'FrozenLake']:.3f})" in lake
    assert f"paired {got[rows[2], 'FrozenLake']:+.3f}" in lake
    still = row("| SmolLM2-135M on RAGEN-2's non-slippery lake")
    assert f"success **{got['SFT then RL', 'FrozenLakeNonSlippery']:.3f}**" in still
    assert f"SFT steps ({got['SFT', 'FrozenLakeNonSlippery']:.3f})" in still
    assert f"paired {got[rows[2], 'FrozenLakeNonSlippery']:+.3f}" in still
    sokoban = row("| SmolLM2-135M on SimpleSokoban")
    assert f"success **{got['SFT then RL', 'Sokoban']:.3f}**" in sokoban
    assert f"SFT alone's {got['SFT', 'Sokoban']:.3f}" in sokoban
    assert f"paired {got[rows[2], 'Sokoban']:+.3f}" in sokoban
