"""Configs and the command lines' handling of bad input: one line `error: ...`, exit status 2,
nothing half-written. (Training itself is tested in test_training.py.)"""

import json
import os
import subprocess
import sys

import pytest

from configs import bandit, frozenlake, sokoban, sudoku
from launch import common
from starpo import harness, precision, run_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_paper_defaults():
    """The variant-less configs carry the reference's settings (docs/reference.md section 4)."""
    c = frozenlake.get_config()
    r, a = c.rollout, c.algorithm
    assert (r.env_groups, r.group_size, r.max_turn, r.response_length, r.max_context) == (
        8, 16, 5, 400, 3600)
    assert (c.val.env_groups, c.val.group_size, c.val.temperature, c.val.test_freq) == (
        256, 1, 0.5, 10)
    assert (a.adv_estimator, a.gamma, a.lam, a.rollout_filter_ratio, a.rollout_filter_type) == (
        "gae", 1.0, 1.0, 0.25, "std")
    assert (a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c, a.entropy_coeff) == (
        0.2, 0.28, 3.0, 0.001)
    assert (a.actor_lr, a.critic_lr, a.ppo_mini_batch_size, a.cliprange_value) == (
        1e-6, 1e-5, 32, 0.5)
    assert not a.use_kl_loss and a.kl_loss_coef == 0.0 and a.loss_agg_mode == "token-mean"
    assert c.trainer.total_steps == 200 and r.temperature == 1.0
    # (every AlgoConfig knob under its own name, with its default: tests/test_configs.py)


def test_phase_dtypes(monkeypatch):
    """"auto" on CPU: float32 decoding; bfloat16 prefill and update only where the CPU
    multiplies bfloat16 natively; on a GPU or TPU bfloat16 in every phase; any other value
    everywhere. (The backend is set here, so the test asks the same on any machine.)"""
    c = frozenlake.get_config("cpu")
    monkeypatch.setattr(precision.jax, "default_backend", lambda: "gpu")
    assert set(precision.phase_dtypes(c).values()) == {"bfloat16"}
    monkeypatch.setattr(precision.jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: True)
    assert precision.phase_dtypes(c) == dict(decode="float32", prefill="bfloat16",
                                            update="bfloat16")
    assert run_config.rollout_spec(c).prefill_dtype == "bfloat16"
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: False)
    assert set(precision.phase_dtypes(c).values()) == {"float32"}
    assert run_config.rollout_spec(c).prefill_dtype == "float32"
    assert run_config.model_dtype(c) == "float32"
    c.unlock()
    c.model.dtype = "bfloat16"
    assert set(precision.phase_dtypes(c).values()) == {"bfloat16"}
    assert set(precision.phase_dtypes(frozenlake.get_config("tiny")).values()) == {"float32"}


def test_cpu_bf16_probe_reads_the_flags():
    zen3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\nbugs\t\t: sysret_ss_attrs\n"
    sapphire = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    assert not precision.cpu_has_fast_bf16(zen3)
    assert precision.cpu_has_fast_bf16(sapphire)
    assert not precision.cpu_has_fast_bf16("")
    assert isinstance(precision.cpu_has_fast_bf16(), bool)  # this machine, whatever it is


def test_resume_accepts_only_harmless_changes():
    c = frozenlake.get_config("tiny")
    saved = harness.config_json(c)
    harness.check_resumable(saved, c)
    longer = frozenlake.get_config("tiny")
    longer.unlock()
    longer.trainer.total_steps = 999
    harness.check_resumable(saved, longer)
    other = frozenlake.get_config("tiny")
    other.unlock()
    other.rollout.temperature = 0.7
    with pytest.raises(ValueError, match="rollout.temperature"):
        harness.check_resumable(saved, other)
    # a saved config reads back equal (tuples survive the JSON round trip)
    s = sokoban.get_config()
    assert harness.config_json(run_config.config_from_json(harness.config_json(s))) == \
        harness.config_json(s)


def with_mix(config, mix):
    c = config.copy_and_resolve_references()
    c.unlock()
    c.env.mix = mix
    c.lock()
    return c


@pytest.mark.parametrize("mix, words", [
    ("Bandit:4,FrozenLake:3", ["sum to 7", "rollout.env_groups is 8"]),
    ("Bandit:4,FrozenLake", ["'FrozenLake' is not TAG:GROUPS"]),
    ("Bandit:0,FrozenLake:8", ["'Bandit:0' is not TAG:GROUPS"]),
    ("Bandit:4,Frozenlake:4", ["unknown env tag 'Frozenlake'"]),
    ("Bandit:4,Bandit:4", ["repeat"]),
])
def test_bad_env_mix_is_one_clear_error(mix, words):
    with pytest.raises(ValueError) as e:
        run_config.env_mix(with_mix(bandit.get_config("tiny"), mix))
    message = str(e.value)
    assert message.startswith(f"env.mix {mix!r}: ") and "\n" not in message
    for w in words:
        assert w in message


def test_env_mix_and_its_tiny_tokenizer():
    c = bandit.get_config("tiny")
    assert run_config.env_mix(c) == (("Bandit", 8),)
    mixed = with_mix(c, " Bandit:6, FrozenLake:2 ")
    assert run_config.env_mix(mixed) == (("Bandit", 6), ("FrozenLake", 2))
    # the tiny tokenizer learns every env's dialogue: the mix's other envs come after the rest
    plain, corpus = (run_config.tiny_tokenizer_args(x)[0] for x in (c, mixed))
    assert corpus[:len(plain)] == plain and "Left</answer>" not in plain
    assert "Left</answer>" in corpus
    # a run saved before the knob existed resumes (it had no mix)
    saved = harness.config_json(c).replace('"mix": "", ', "")
    assert '"mix"' not in saved
    harness.check_resumable(saved, c)


def run_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_missing_model_and_unwritable_workdir(tmp_path):
    """(Bad values of every config key: tests/test_configs.py.)"""
    p = run_cli("launch/train.py", "--config=configs/frozenlake.py:tiny",
                f"--config.model.path={tmp_path}/no_such_model", f"--workdir={tmp_path}/b")
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines == [lines[-1]] and lines[-1].startswith("error: ") and "no_such_model" in lines[-1], p.stderr
    assert not os.path.exists(tmp_path / "b")

    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = run_cli("launch/train.py", "--config=configs/frozenlake.py:tiny",
                f"--workdir={blocker}/run")
    assert p.returncode == 2 and "cannot be written" in p.stderr, p.stderr


def test_a_workdir_is_tried_for_writing_and_its_config_read_before_any_work(tmp_path):
    """check_workdir: an empty name, a folder that cannot be made (a path under a file) and a
    broken config.json are one-line ValueErrors naming the cause; the try leaves nothing."""
    config = bandit.get_config("tiny")
    with pytest.raises(ValueError, match="workdir is empty"):
        harness.check_workdir("", config)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot be written .*file is not a directory"):
        harness.check_workdir(str(tmp_path / "file" / "run"), config)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{bad")
    with pytest.raises(ValueError, match="config.json is not a run's config"):
        harness.check_workdir(str(broken), config)
    assert harness.check_workdir(str(tmp_path / "new" / "run"), config) is False
    assert sorted(os.listdir(tmp_path)) == ["broken", "file"]  # the probe left nothing
    with pytest.raises(ValueError, match="--workdir is empty"):
        common.workdir_of(" ", "configs/bandit.py:tiny")
    assert common.workdir_of(None, "configs/bandit.py:tiny", "_sft") == "runs/bandit_tiny_sft"


def test_eval_and_export_need_a_run(tmp_path):
    p = run_cli("launch/eval.py", f"--checkpoint={tmp_path}")
    assert p.returncode == 2 and "not a training workdir" in p.stderr, p.stderr
    p = run_cli("launch/export.py", f"--checkpoint={tmp_path}", f"--out={tmp_path}/x")
    assert p.returncode == 2 and "not a training workdir" in p.stderr, p.stderr
    # the output places are tried before a checkpoint is read (this one is not even a run)
    (tmp_path / "file").write_text("x")
    p = run_cli("launch/export.py", f"--checkpoint={tmp_path}", f"--out={tmp_path}/file/x")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"error: --out {tmp_path}/file/x cannot be written ({tmp_path}/file is not a "
        f"directory)"], p.stderr
    p = run_cli("launch/eval.py", f"--checkpoint={tmp_path}", f"--out={tmp_path}")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"error: --out {tmp_path} is a directory; give a file's path"], p.stderr
    # eval plays val.batch_size episodes at a time: a set it does not divide is refused
    p = run_cli("launch/eval.py", "--config=configs/bandit.py:tiny", "--config.val.batch_size=8",
                "--groups=3")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: val.batch_size 8 is not whole groups of 1 episodes dividing the 3 episodes "
        "(0 = all at once) (--groups / --group_size change the set, --batch_size the chunk)"
    ], p.stderr


def test_eval_of_a_run_replays_its_validation_programs(tmp_path):
    """launch/eval.py of a run's checkpoint, on the run's validation sets, traces the very
    programs that the run's validation compiled (`experiment.eval_sets`: the run's mesh,
    shardings and compiler options), so JAX's persistent cache serves them and eval compiles
    no rollout of its own (on a GPU a SmolLM2 rollout takes minutes to compile). Bandit's set
    plays on the training batch's program, BanditTest's on one of its own. A second checkpoint
    (--against) plays on the same programs and gets what it gets evaluated alone."""
    cache = tmp_path / "cache"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")

    def rollouts():  # the persistent cache's entries of levels and rollouts
        return {f for f in os.listdir(cache) if f.startswith(("jit_play_from", "jit_initial"))}

    run = ["launch/train.py", "--config=configs/bandit.py:tiny", f"--workdir={tmp_path}/run",
           "--config.trainer.total_steps=2", "--config.trainer.save_freq=1",
           "--config.val.tags=Bandit,BanditTest", "--progress=false"]
    p = subprocess.run([sys.executable, *run], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stderr

    def evaluate(*args):
        p = subprocess.run([sys.executable, "launch/eval.py", f"--checkpoint={tmp_path}/run",
                            *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env=env)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout.strip().splitlines()[-1]), p.stdout

    trained = rollouts()
    assert sum(f.startswith("jit_play_from") for f in trained) == 2, trained
    # step 2 against step 1 (--against): both on the same programs, levels and keys
    both, text = evaluate(f"--against={tmp_path}/run", "--against_step=1")
    assert set(both["results"]) == set(both["paired"]) == {"Bandit", "BanditTest"}
    assert rollouts() == trained
    # each side is what evaluating that checkpoint alone gives
    alone, _ = evaluate("--step=1")
    assert (both["step"], both["against"]["step"], alone["step"]) == (2, 1, 1)
    assert both["against"]["results"] == alone["results"]
    assert both["results"] != both["against"]["results"]
    for tag, d in both["paired"].items():
        diff = both["results"][tag]["success"] - alone["results"][tag]["success"]
        assert abs(d["success_diff"] - diff) < 1e-12, (tag, d, diff)
        assert f"{tag}: success {d['success_diff']:+.3f}" in text


def test_a_run_saved_before_a_key_was_added_still_resumes():
    """A workdir's config.json from before a key existed (env.mix, the lr decay knobs) had
    that key's default: it resumes with the default and refuses another value."""
    import json

    c = bandit.get_config("tiny")
    saved = json.loads(harness.config_json(c))
    del saved["env"]["mix"]
    del saved["algorithm"]["lr_decay_steps"], saved["algorithm"]["min_lr_ratio"]
    harness.check_resumable(json.dumps(saved), c)
    other = c.copy_and_resolve_references()
    other.unlock()
    other.algorithm.lr_decay_steps = 100
    with pytest.raises(ValueError, match="algorithm.lr_decay_steps"):
        harness.check_resumable(json.dumps(saved), other)
    # an env option added to one env (Sudoku's grid size): an older Sudoku run resumes at 9;
    # a run of an env without that option is not given it
    c = sudoku.get_config()
    saved = json.loads(harness.config_json(c))
    del saved["env"]["options"]["size"]
    harness.check_resumable(json.dumps(saved), c)
    c.unlock()
    c.env.options.size = 4
    with pytest.raises(ValueError, match="env.options.size"):
        harness.check_resumable(json.dumps(saved), c)
    c = bandit.get_config("tiny")
    harness.check_resumable(harness.config_json(c), c)


def test_a_gpu_variant_on_a_machine_without_one_says_so_in_one_line(capsys):
    """`...py:gpu` runs on a CPU too (slowly) after a one-line note; other variants say nothing."""
    import jax

    from launch import common

    common.note_accelerator("configs/frozenlake.py:gpu+dapo")
    common.note_accelerator("configs/frozenlake.py:cpu")
    out = capsys.readouterr().out
    if jax.default_backend() == "cpu":
        assert out.count("\n") == 1 and out.startswith("note: configs/frozenlake.py:gpu+dapo")
    else:
        assert out == ""


def test_a_config_json_written_by_an_older_starpo_resumes():
    """tests/saved_runs/frozenlake_cpu_sft_400.json is the config.json of a real SmolLM2 SFT run
    written before several keys existed (LoRA, GiGPO's episode statistics, the filter's metric):
    the same command resumes it, with each missing key at the value the old code ran with."""
    import json

    path = os.path.join(os.path.dirname(__file__), "saved_runs", "frozenlake_cpu_sft_400.json")
    with open(path, encoding="utf-8") as f:
        saved = f.read()
    assert "lora" not in json.loads(saved)["model"]
    c = frozenlake.get_config("cpu")
    c.sft.steps, c.sft.lr, c.sft.test_freq, c.sft.save_freq = 400, 1.5e-4, 25, 5
    harness.check_resumable(saved, c)
    c.model.lora.rank = 8
    with pytest.raises(ValueError, match="model.lora.rank"):
        harness.check_resumable(saved, c)
