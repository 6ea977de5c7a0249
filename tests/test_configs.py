"""The config files and the schema: every config has the schema's knobs, a config.json of every
earlier version still reads and resumes, and every bad value of every key is a one-line `error:`
before any work.

`configs/*.py` take their knobs from `starpo/schema.py` (no JAX); these tests hold the schema to
itself (types, rules, the generated docs) and the env options to the envs' own (names, types,
defaults).
The bad-value table names every key of every config file (a new key without a row fails) and
each value goes through the parse and check `launch/train.py` runs (`common.parse_flags`,
in-process: the same code, ~1 ms a case); a few cases then run the real command end to end.
"""

import ast
import dataclasses
import glob
import importlib
import json
import os
import subprocess
import sys
import typing

import pytest
from absl import flags

import envs
from launch import common
from starpo import config_check, experiment, model, run_config, schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every config file (configs/*.py but the shared `common` and the package file): a new env's
# config is checked here without being listed
FILES = {f"configs/{name}.py": importlib.import_module(f"configs.{name}")
         for name in sorted(os.path.splitext(os.path.basename(p))[0]
                            for p in glob.glob(os.path.join(ROOT, "configs", "*.py")))
         if name not in ("__init__", "common")}
VARIANTS = (None, "cpu", "gpu", "tiny")


def flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def all_configs():
    return [(path, v, module.get_config(v)) for path, module in FILES.items() for v in VARIANTS]


def _imports(path):
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        yield from ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module] if isinstance(node, ast.ImportFrom) else [])


def test_config_files_import_only_ml_collections_and_the_schema():
    """Config files load without JAX: ml_collections, each other and `starpo.schema`, which
    itself imports the standard library alone."""
    for path in glob.glob(os.path.join(ROOT, "configs", "*.py")):
        for name in _imports(path):
            assert name.split(".")[0] in ("ml_collections", "configs") or name in (
                "starpo", "starpo.schema"), (path, name)
    for name in _imports(os.path.join(ROOT, "starpo", "schema.py")):
        assert name.split(".")[0] in sys.stdlib_module_names, name


def test_every_knob_default_has_its_type_and_passes_its_rule():
    for key, f in schema.knobs():
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        rule = f.metadata["rule"]
        assert rule is None or rule[0](default), key
        assert f.metadata["doc"] or key in ("algorithm.adam_b1", "algorithm.adam_b2",
                                            "trainer.keep_checkpoints",
                                            "trainer.gradient_analysis_bucket_mode"), key
        before = f.metadata["before"]
        if before is not schema._ABSENT:
            assert type(before) is type(default), key
    for cls in (schema.Config, schema.Model, schema.Lora, schema.Mesh, schema.Env,
                schema.Rollout, schema.Val, schema.Algorithm, schema.Sft, schema.Trainer):
        for name, hint in typing.get_type_hints(cls).items():
            f = cls.__dataclass_fields__[name]
            if "section" in f.metadata:
                continue
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            assert type(default) is hint, (cls.__name__, name)


def test_every_config_has_the_schemas_keys_and_the_rollout_fields_its_defaults():
    knobs = {key for key, _ in schema.knobs() if key != "env.options"}
    for path, variant, c in all_configs():
        keys = {k for k in flat(c.to_dict()) if not k.startswith("env.options.")}
        assert keys == knobs, (path, variant, keys ^ knobs)
    # AlgoConfig's copies of rollout knobs default to them
    r = schema.Rollout()
    assert (run_config.AlgoConfig.group_size, run_config.AlgoConfig.temperature,
            run_config.AlgoConfig.response_length) == (r.group_size, r.temperature,
                                                       r.response_length)


def test_the_knob_docs_are_generated_from_the_schema():
    with open(os.path.join(ROOT, "docs", "knobs.md"), encoding="utf-8") as f:
        assert f.read() == schema.markdown(), "run: python -m starpo.schema > docs/knobs.md"


# One saved config.json (frozenlake's, its tiny variant where it had one) of each set of keys
# the config files ever had since 2026-11-25, built from the history: `git archive REV configs
# envs` at each commit that changed configs/, `get_config(variant)`, one per key set.
with open(os.path.join(ROOT, "tests", "data", "saved_configs.json"), encoding="utf-8") as _f:
    SAVED = json.load(_f)


def test_configs_saved_by_every_earlier_version_read_check_and_resume():
    from starpo import harness

    assert len(SAVED) >= 30
    for name, saved in SAVED.items():
        text = json.dumps(saved)
        config = run_config.config_from_json(text)
        config_check.check(config)
        run_config.read(config)
        harness.check_resumable(text, config)  # the run resumes with the config it saved
    first = min(SAVED.values(), key=lambda c: len(flat(c)))  # the fewest keys
    assert not {"decode_attention", "lora"} & set(first["model"]) and "sft" not in first
    oldest = run_config.config_from_json(json.dumps(first))
    # what those runs did, before the keys existed
    assert (oldest.model.decode_attention, oldest.sft.steps, oldest.model.lora.rank,
            oldest.trainer.rollout_filter_empty_stop_steps, oldest.trainer.collapse_mi_multi_turn,
            oldest.algorithm.shuffle_mini_batches) == ("xla", 0, 0, 0, False, True)
    # a key with no stated `before` still needs to be in a saved config
    broken = json.loads(json.dumps(SAVED[max(SAVED)]))
    del broken["algorithm"]["gamma"]
    with pytest.raises(ValueError, match="algorithm.gamma"):
        harness.check_resumable(json.dumps(broken), run_config.config_from_json(json.dumps(
            SAVED[max(SAVED)])))


def test_an_added_env_option_is_filled_only_where_the_env_has_it():
    saved = SAVED[max(SAVED)]

    def options(name, given):
        return run_config.upgrade({**saved, "env": {"name": name, "options": given}})[
            "env"]["options"]

    assert options("SimpleSudoku", {}) == {"size": 9}  # its 9x9 grid, before the 4x4 default
    assert options("FrozenLake", {"size": 4}) == {"size": 4}  # a saved option stays
    assert options("Bandit", {}) == {}  # no such option


def test_env_options_are_the_envs_options_with_its_defaults():
    for path, variant, c in all_configs():
        env = envs.make(c.env.name)
        fields = {f.name: getattr(env, f.name) for f in dataclasses.fields(env) if f.name != "name"}
        options = c.env.options.to_dict()
        assert set(options) == set(fields), (path, variant)
        for name, default in fields.items():
            assert type(options[name]) is type(default), (path, variant, name)
        if variant is None:
            assert options == fields, path


def test_every_shipped_config_passes_the_check():
    for path, variant, c in all_configs():
        config_check.check(c)


# key -> bad values (command-line text): each must fail, one line naming the key. A wrong type
# first where the key has one that a string cannot be; then values out of range.
BAD = {
    "seed": ["x", "-1"],
    "model.path": ["no_such_model", "tiny:layers=0", "tiny:heads=3", "tiny:colour=2",
                   "random:tie=2", "random:vocab=100"],
    "model.critic_path": ["/no/such/dir/model.gguf"],
    "model.dtype": ["float64", "1"],
    "model.remat": ["maybe"],
    "model.remat_policy": ["everything"],
    "model.lora.rank": ["-1"],
    "model.lora.alpha": ["0", "-2"],
    "model.lora.target_modules": ["attn", "q,final_norm", ""],
    # cudnn: only an NVIDIA GPU runs it (issue 34: a one-line error, not a backward's crash)
    "model.attention": ["flash"] + ([] if model.gpu_capability() else ["cudnn"]),
    "model.decode_attention": ["triton", "1"],
    "mesh.data": ["x", "0", "-2"],
    "mesh.fsdp": ["x", "0"],
    "mesh.tensor": ["1.5", "0"],
    "mesh.distributed": ["sometimes"],
    "mesh.coordinator_address": ["localhost", "localhost:0", ":1234", "h:port"],
    "mesh.num_processes": ["x", "-1", "2"],  # 2 without a process_id
    "mesh.process_id": ["x", "-2", "0"],  # 0 without num_processes
    "mesh.init_timeout_s": ["x", "0"],
    "mesh.heartbeat_timeout_s": ["x", "1"],
    "env.name": ["Chess"],
    "env.mix": ["Chess:8", "FrozenLake:x", "FrozenLake:1"],
    "env.options.size": ["x", "1", "64"],
    "env.options.p": ["x", "0", "1.5"],
    "env.options.is_slippery": ["maybe"],
    "env.options.num_candidates": ["x", "0"],
    "env.options.dim_x": ["x", "2"],
    "env.options.dim_y": ["x", "2", "16"],
    "env.options.num_boxes": ["x", "0", "20"],
    "env.options.max_steps": ["x", "0"],
    "env.options.min_count": ["x", "0", "-1"],
    "env.options.max_count": ["x", "0", "6"],
    "env.options.min_number": ["x", "0"],
    "env.options.max_number": ["x", "0", "500"],
    "env.options.score": ["x"],
    "env.options.format_score": ["x"],
    "env.options.num_rooms": ["x", "0"],
    "env.options.num_walks": ["x", "0"],
    "env.options.walk_length": ["x", "0"],
    "env.options.symbols": ["x", "('#',)"],
    "env.options.low_arm": [" Phoenix", "Dragon", ""],
    "env.options.high_arm": ["phoenix", " "],
    "env.options.two_prob": ["x", "-0.1", "1.5"],
    "env.options.use_log_reward": ["maybe"],
    "env.options.invalid_act_score": ["x"],
    "env.options.blanks": ["x", "-1", "82"],
    "env.options.max_actions": ["x", "0"],
    "env.options.correct_placement_score": ["x"],
    "env.options.invalid_action_score": ["x"],
    "env.options.completion_bonus": ["x"],
    "rollout.env_groups": ["x", "0"],
    "rollout.group_size": ["x", "0"],
    "rollout.max_turn": ["x", "0"],
    "rollout.max_actions_per_turn": ["x", "-1"],
    "rollout.max_actions_per_traj": ["x", "-1"],
    "rollout.response_length": ["x", "0", "100000"],  # not below rollout.max_context
    "rollout.max_context": ["x", "0"],
    "rollout.temperature": ["x", "0", "-1", "nan", "inf"],
    "rollout.top_p": ["x", "0", "1.5"],
    "rollout.top_k": ["x", "-1"],
    "rollout.enable_think": ["maybe"],
    "rollout.decode_windows": ["x", "0"],
    "rollout.batch_size": ["x", "-1", "3", "100000"],
    "val.env_groups": ["x", "0"],
    "val.group_size": ["x", "0"],
    "val.temperature": ["x", "-0.5", "nan"],
    "val.test_freq": ["x", "-1"],
    "val.before_train": ["maybe"],
    "val.tags": ["Chess", "Bandit,Bandit", ",", "Bandit,"],
    "val.batch_size": ["x", "-1", "3", "100000"],
    "trainer.total_steps": ["x", "-1"],
    "trainer.save_freq": ["x", "-1"],
    "trainer.keep_checkpoints": ["x", "0"],
    "trainer.log_samples": ["x", "-1"],
    "trainer.stop_on_collapse": ["maybe"],
    "trainer.rollout_filter_empty_stop_steps": ["x", "-1"],
    "trainer.reward_std_stop_steps": ["x", "-1"],
    "trainer.low_success_stop_validations": ["x", "-1"],
    "trainer.gradient_analysis_every": ["x", "-1"],
    "trainer.gradient_analysis_num_buckets": ["x", "0"],
    "trainer.gradient_analysis_bucket_mode": ["median"],
    "trainer.collapse_window": ["x", "0"],
    "trainer.collapse_mi_freq": ["x", "-1"],
    "trainer.collapse_mi_samples": ["x", "0"],
    "trainer.collapse_mi_micro_batch": ["x", "0"],
    "trainer.collapse_mi_multi_turn": ["maybe"],
    "trainer.collapse_mi_warn": ["x", "nan", "inf"],
    "trainer.fast_compile": ["maybe"],
    "trainer.memory_check": ["maybe"],
    "trainer.offload_state": ["maybe"],
    "trainer.context_bucket": ["x", "-1"],
    "algorithm.adv_estimator": ["ppo"],
    "algorithm.gamma": ["x", "-0.1", "1.5"],
    "algorithm.lam": ["x", "2"],
    "algorithm.high_level_gamma": ["x", "-1"],
    "algorithm.bi_level_turns": ["ragen", "1"],
    "algorithm.norm_adv_by_std_in_grpo": ["maybe"],
    "algorithm.use_turn_scores": ["maybe"],
    "algorithm.reward_norm_grouping": ["everything"],
    "algorithm.reward_norm_method": ["max"],
    "algorithm.rollout_filter_ratio": ["x", "0", "1.5"],
    "algorithm.rollout_filter_type": ["random"],
    "algorithm.rollout_filter_strategy": ["top_q"],
    "algorithm.rollout_filter_count": ["x", "0", "-1"],
    "algorithm.rollout_filter_min_p": ["x", "-0.1", "1.5"],
    "algorithm.rollout_filter_metric": ["entropy"],
    "algorithm.rollout_filter_top_p": ["x", "0", "1.5", "nan"],
    "algorithm.rollout_filter_top_p_prob_mode": ["exp"],
    "algorithm.rollout_filter_include_zero": ["maybe"],
    "algorithm.rollout_filter_selection_eps": ["x", "-0.01"],
    "algorithm.filter_loss_scaling": ["log"],
    "algorithm.soft_advantage_reweight": ["maybe"],
    "algorithm.batch_adjust_mode": ["trim"],
    "algorithm.grpo_advantage_length_weight": ["maybe"],
    "algorithm.zero_task_advantage": ["maybe"],
    "algorithm.gigpo_step_advantage_w": ["x", "-1"],
    "algorithm.gigpo_mode": ["std_norm"],
    "algorithm.gigpo_episode_over_steps": ["maybe"],
    "algorithm.clip_ratio_low": ["x", "-0.2"],
    "algorithm.clip_ratio_high": ["x", "-0.2"],
    "algorithm.clip_ratio_c": ["x", "1"],
    "algorithm.entropy_coeff": ["x", "-1"],
    "algorithm.use_kl_loss": ["maybe"],
    "algorithm.shuffle_mini_batches": ["sometimes"],
    "algorithm.pack_rows": ["yes"],
    "algorithm.kl_loss_coef": ["x", "-1"],
    "algorithm.kl_loss_type": ["k4"],
    "algorithm.use_kl_in_reward": ["maybe"],
    "algorithm.kl_penalty": ["k4"],
    "algorithm.kl_coef": ["x", "-1"],
    "algorithm.loss_agg_mode": ["token-sum"],
    "algorithm.overlong_buffer_len": ["x", "-1", "100000"],  # more than response_length
    "algorithm.overlong_penalty_factor": ["x", "-1"],
    "algorithm.filter_groups_enable": ["maybe"],
    "algorithm.filter_groups_max_num_gen_batches": ["x", "0", "-1"],
    "algorithm.filter_groups_metric": ["acc"],
    "algorithm.cliprange_value": ["x", "0"],
    "algorithm.actor_lr": ["x", "-1e-6", "nan"],
    "algorithm.critic_lr": ["x", "-1e-5"],
    "algorithm.warmup_steps": ["x", "-1"],
    "algorithm.lr_decay_steps": ["x", "-1"],
    "algorithm.min_lr_ratio": ["x", "2"],
    "algorithm.weight_decay": ["x", "-0.01"],
    "algorithm.adam_b1": ["x", "1"],
    "algorithm.adam_b2": ["x", "-0.1"],
    "algorithm.grad_clip": ["x", "0"],
    "algorithm.critic_warmup": ["x", "-1"],
    "algorithm.ppo_mini_batch_size": ["x", "0", "3"],
    "algorithm.micro_batch_size": ["x", "0", "5"],
    "algorithm.ppo_epochs": ["x", "0"],
    "algorithm.online_k": ["x", "-1"],
    "algorithm.logit_chunk_size": ["x", "-1"],
    "rollout.context_window_mode": ["everything", "1"],
    "rollout.max_context_window": ["x", "0", "-2"],
    "model.init_from": ["/no/such/run"],
    "sft.steps": ["x", "-1"],
    "sft.env_groups": ["x", "0"],
    "sft.lr": ["x", "0", "nan"],
    "sft.warmup_steps": ["x", "-1"],
    "sft.lr_decay_steps": ["x", "-1"],
    "sft.min_lr_ratio": ["x", "-0.1", "1.5"],
    "sft.actions_per_turn": ["x", "-1"],
    "sft.test_freq": ["x", "-1"],
    "sft.save_freq": ["x", "-1"],
    "sft.demo_steps": ["x", "0"],
}
def parse(argv):
    """What `launch/train.py` does with its command line before `main`: -> config or UsageError."""
    fv = flags.FlagValues()
    holder = common.define_config("config", flag_values=fv, sys_argv=argv)
    common.parse_flags(argv, fv, holder, check_config=True)
    return holder.value


def test_the_bad_value_table_names_every_key_of_every_config_file():
    keys = set()
    for _, _, c in all_configs():
        keys |= set(flat(c.to_dict()))
    assert keys - set(BAD) == set(), "keys without bad values to try"
    assert set(BAD) - keys == set(), "rows for keys no config has"


@pytest.mark.parametrize("path", sorted(FILES))
def test_every_bad_value_is_a_one_line_error_naming_the_key(path):
    keys = flat(FILES[path].get_config().to_dict())
    tried, wrong = 0, []
    for key, values in BAD.items():
        if key not in keys:
            continue
        for value in values:
            argv = ["train.py", f"--config={os.path.join(ROOT, path)}", f"--config.{key}={value}"]
            try:
                parse(argv)
                wrong.append((key, value, "accepted"))
                continue
            except common.UsageError as e:
                message = str(e)
            named = key.rsplit(".", 1)[-1]
            if "\n" in message or not (named in message or named.replace("_", " ") in message):
                wrong.append((key, value, message))
            tried += 1
    assert not wrong, "\n".join(map(str, wrong))
    assert tried >= len(keys)
    parse(["train.py", f"--config={os.path.join(ROOT, path)}"])  # the file as it is passes


@pytest.mark.parametrize("argv", [
    ["--config=configs/nosuch.py"],
    ["--config=configs/frozenlake.py:tpu"],
    ["--config=configs/frozenlake.py:tiny", "--config.rollout.max_turn.x=1"],
])
def test_bad_config_files_and_keys_are_one_line_errors(argv):
    with pytest.raises(common.UsageError) as e:
        parse(["train.py", *argv])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("body, words", [
    ('def get_config():\n    raise RuntimeError("boom")\n',
     ["get_config() raised RuntimeError: boom"]),
    ("def get_config():\n    return 5\n", ["get_config() returned int 5, not a ConfigDict"]),
    ("x = 1\n", ["defines no get_config()"]),
])
def test_a_config_file_that_fails_or_returns_no_config_is_one_line(tmp_path, monkeypatch,
                                                                     body, words):
    """A user's own config file: what its get_config() raises or returns, named in one line
    with the file (not a traceback, nor "unknown config key")."""
    # ml_collections loads every config file into one module of this name, reused in a process
    # (a file without get_config() would find the previous file's): fresh here, as in a CLI
    monkeypatch.delitem(sys.modules, "config_config", raising=False)
    path = tmp_path / "mine.py"
    path.write_text(body)
    with pytest.raises(common.UsageError) as e:
        parse(["train.py", f"--config={path}"])
    message = str(e.value)
    assert "\n" not in message and str(path) in message, message
    assert all(w in message for w in words), message


def run_train(*args):
    return subprocess.run([sys.executable, "launch/train.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, words", [
    (["--config=configs/bandit.py:tpu"], ["unknown config variant 'tpu'"]),
    (["--config=configs/no_such.py"], ["configs/no_such.py", "not found"]),
    (["--config=configs/bandit.py:tiny", "--config.rollout.env_groups=abc"],
     ["rollout.env_groups", "abc"]),
    (["--config=configs/bandit.py:tiny", "--config.rollout.env_grups=2"],
     ["unknown config key 'rollout.env_grups'", "env_groups"]),
    (["--config=configs/bandit.py:tiny", "--config.algorithm.micro_batch_size=48"],
     ["micro_batch_size 48"]),
    (["--config=configs/sokoban.py", "--config.env.options.dim_y=16"], ["dim_y", "16"]),
    # found when the run is built (the tokenizer counts the prompt), still before the workdir
    (["--config=configs/frozenlake.py:tiny", "--config.rollout.max_context=40"],
     ["max_context 40 cannot hold the prompt"]),
])
def test_the_command_exits_2_with_one_line_and_leaves_the_workdir_alone(tmp_path, args, words):
    """Half the cases name a workdir that does not exist, half one that holds a file."""
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    workdir = existing if len(args) % 2 else tmp_path / "new"
    p = run_train(*args, f"--workdir={workdir}")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    for w in words:
        assert w in lines[0], lines[0]
    assert not (tmp_path / "new").exists()
    assert sorted(os.listdir(existing)) == ["notes.txt"]


def test_a_limited_context_window_needs_its_size():
    path = os.path.join(ROOT, "configs/frozenlake.py")
    with pytest.raises(common.UsageError, match="max_context_window must be >= 1") as e:
        parse(["train.py", f"--config={path}", "--config.rollout.context_window_mode=limited",
               "--config.rollout.max_context_window=0"])
    assert "\n" not in str(e.value)
    # RAGEN-2's name for the limited window, and its -1 for every turn (the whole dialogue)
    for mode, window, turns in (("full", -1, 0), ("single_turn", -1, 1), ("limited", 3, 3),
                                ("limited_multi_turn", 2, 2), ("limited", -1, 0),
                                ("limited_multi_turn", -1, 0)):
        c = parse(["train.py", f"--config={path}", f"--config.rollout.context_window_mode={mode}",
                   f"--config.rollout.max_context_window={window}"])
        assert run_config.algo_config(c).context_window == turns
        assert run_config.rollout_spec(c).context_window == turns


def test_two_validation_sets_never_play_one_env_under_two_names():
    """env.options apply to the training env's tag only, so they can turn it into another
    registered variant: the FrozenLake config trained with is_slippery=False would validate
    RAGEN-2's non-slippery lake under both names (a GPU run did: both columns equal). That is
    a one-line error naming both fixes; training FrozenLakeNonSlippery under its own name keeps
    the paper's slippery lake in the FrozenLake column."""
    path = os.path.join(ROOT, "configs/frozenlake.py")
    for over, train, other, value in (
            ("--config.env.options.is_slippery=False", "FrozenLake", "FrozenLakeNonSlippery",
             False),
            ("--config.env.name=FrozenLakeNonSlippery", "FrozenLakeNonSlippery", "FrozenLake",
             True)):
        with pytest.raises(common.UsageError) as e:
            parse(["train.py", f"--config={path}:gpu", over])
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("val.tags: ")
        assert f"the training env {train} has env.options.is_slippery={value}, as {other}" in msg
        assert (f"--config.env.name={other} --config.env.options.is_slippery={value}" in msg
                and f"(--config.env.options.is_slippery={not value})" in msg)
    c = parse(["train.py", f"--config={path}:gpu", "--config.env.name=FrozenLakeNonSlippery",
               "--config.env.options.is_slippery=False"])
    assert run_config.make_env(c, "FrozenLake").is_slippery
    assert not run_config.make_env(c, "FrozenLakeNonSlippery").is_slippery


def test_every_variant_passes_the_checks_a_run_makes():
    for path, variant, c in all_configs():
        config_check.check(c)  # raises ConfigError naming the key


@pytest.mark.parametrize("path", sorted(FILES))
def test_every_tiny_variant_builds_its_model_and_tokenizer(path):
    """The tiny model's tokenizer is learned from the run's own dialogue, with its template
    lines as whole tokens: they must fit the tiny vocabulary (a 700-action budget did not)."""

    config = FILES[path].get_config("tiny")
    policy = experiment.load_policy(config)
    assert policy.tokenizer.vocab_size <= policy.cfg.vocab_size
    answer = "<answer>" if config.rollout.enable_think is False else "</think>"
    assert policy.tokenizer.decode(policy.tokenizer.encode(answer)) == answer
