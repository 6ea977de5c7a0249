"""Evaluate a policy on fixed held-out levels, per env variant: a table and a JSON line.

  python launch/eval.py --checkpoint=runs/frozenlake_cpu
  python launch/eval.py --config=configs/sokoban.py:cpu --tags=SimpleSokoban,LargerSokoban
  python launch/eval.py --checkpoint=runs/bandit_tiny --tags=Bandit,BanditTest --groups=512
  python launch/eval.py --checkpoint=runs/rl --against=runs/sft --groups=256 --group_size=4

--checkpoint: a training workdir (latest checkpoint, or --step) or one of its checkpoints; its
config is used unless --config is given. Without --checkpoint the config's initial model is
evaluated (e.g. the untrained SmolLM2). Levels come from the validation stream, seeds
0..groups-1, the same for every run and checkpoint. The last line is one JSON object:
{"model", "step", ..., "results": {tag: {success, score, action_is_valid, ...}}}; --out=FILE
also writes it to FILE (complete or not at all: launch/reproduce.py reads these).

--against: a second checkpoint of the same model, played on the same levels with the same
sampling keys and the same compiled programs (both sets of weights on the device). Beside its
own table it prints, per env, the paired difference of success (--checkpoint minus --against):
the mean over levels of each level's difference, with the standard error of that mean. Levels
and keys are shared, so that difference is less noisy than the two successes' own standard
errors suggest. The JSON line gains "against" (its model, step and results) and "paired".
"""

import json
import os
import sys
import time

if not __package__:  # run as a file from a checkout: launch/_checkout.py puts its root first
    import _checkout  # noqa: F401

from absl import flags  # noqa: E402

from launch import common  # noqa: E402

CONFIG = common.define_config("Config file (default: the run's).")
flags.DEFINE_string("checkpoint", None, "Training workdir or checkpoint (omit: untrained model).")
flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
flags.DEFINE_string("tags", None, "Comma-separated env variants (default: the config's val.tags).")
flags.DEFINE_integer("groups", None, "Levels per variant (default: the config's val.env_groups).",
                     lower_bound=1)
flags.DEFINE_integer("group_size", None, "Episodes per level (default: val.group_size).",
                     lower_bound=1)
flags.DEFINE_float("temperature", None, "Sampling temperature (default: val.temperature; 0 = greedy).",
                   lower_bound=0.0)
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_integer("batch_size", None, "Episodes played at once (default: val.batch_size, or "
                     "when that is 0 and the set is larger than the config's validation set, "
                     "that set's size: the memory the config was planned for).", lower_bound=0)
flags.DEFINE_string("against", None, "A second training workdir or checkpoint of the same model, "
                    "played on the same levels and keys: prints the paired difference.")
flags.DEFINE_integer("against_step", None, "Its checkpoint step (default: its latest).")
flags.DEFINE_string("out", None, "Also write the JSON line to this file.")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.against_step is not None and not FLAGS.against:
        raise ValueError("--against_step needs --against")
    import jax

    from starpo import (config_check, evaluate, experiment, harness, rollout, run_config,
                        sharding)

    if FLAGS.out:  # an unwritable place fails now, not after the evaluation
        folder = os.path.dirname(os.path.abspath(FLAGS.out))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--out {FLAGS.out}: {e.strerror}") from None
        if os.path.isdir(FLAGS.out):
            raise ValueError(f"--out {FLAGS.out} is a directory; give a file's path")
        try:  # root passes os.access everywhere: a file made and removed is the real test
            os.close(os.open(FLAGS.out + ".tmp", os.O_WRONLY | os.O_CREAT))
            os.remove(FLAGS.out + ".tmp")
        except OSError as e:
            raise ValueError(f"--out {FLAGS.out}: {folder} is not writable ({e.strerror})"
                             ) from None
    harness.enable_compilation_cache()
    if FLAGS.checkpoint:
        saved, policy, step = experiment.load_run(FLAGS.checkpoint, FLAGS.step)
        config = CONFIG.value if FLAGS["config"].present else saved
    elif FLAGS["config"].present:
        config = CONFIG.value
        config_check.check(config)
        policy, step = None, None  # loaded once the flags are checked
    else:
        raise ValueError("give --checkpoint (a training workdir) and/or --config")
    other = other_step = None
    if FLAGS.against:
        try:
            _, other, other_step = experiment.load_run(FLAGS.against, FLAGS.against_step)
        except (OSError, ValueError) as e:
            raise ValueError(f"--against: {e}") from None
    v = config.val
    tags = evaluate.parse_tags(FLAGS.tags if FLAGS.tags is not None else v.tags, config.env.name)
    groups, size = FLAGS.groups or v.env_groups, FLAGS.group_size or v.group_size
    temperature = v.temperature if FLAGS.temperature is None else FLAGS.temperature
    batch_size = v.batch_size  # episodes played at once (0 = all), as in validation
    if not batch_size and groups * size > v.env_groups * v.group_size:
        batch_size = v.env_groups * v.group_size  # a larger set in chunks of the planned size
    if FLAGS.batch_size is not None:
        batch_size = FLAGS.batch_size
    try:
        rollout.chunk_size(groups * size, batch_size, size)
    except ValueError as e:
        where = "--" if FLAGS.batch_size is not None else "val."
        raise ValueError(f"{where}{e} (--groups / --group_size change the set, --batch_size "
                         f"the chunk)") from None
    policy = policy or experiment.load_policy(config)
    if other is not None:
        evaluate.check_comparable(policy, other)
    # on the run's mesh, as its validation: the same programs, which JAX's persistent cache
    # then holds from the run's own validations (where the shapes agree)
    run = run_config.read(config)
    mesh = sharding.make_mesh(*run.mesh)
    policy = experiment.on_mesh(policy, mesh)
    if other is not None:
        other = experiment.on_mesh(other, mesh)
    sets = experiment.eval_sets(run, policy, mesh, tags, env_groups=groups, group_size=size,
                                batch_size=batch_size)
    results, against, paired = {}, {}, {}
    for tag, es in sets.items():
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            traj, m = es.play(policy.params, jax.random.key(FLAGS.seed), temperature)
        results[tag] = evaluate.summarize(traj, m, size)
        # the seconds include compiling, where the persistent cache does not hold the program
        print(f"{tag}: {groups} levels x {size} at temperature {temperature}: "
              f"success {results[tag]['success']:.3f} (standard error "
              f"{results[tag]['success_stderr']:.3f}) in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
        if other is not None:  # the same program, levels and key: only the weights differ
            with jax.set_mesh(mesh):
                traj_b, m_b = es.play(other.params, jax.random.key(FLAGS.seed), temperature)
            against[tag] = evaluate.summarize(traj_b, m_b, size)
            paired[tag] = evaluate.paired(traj.success, traj_b.success, size)
    print(f"\n{policy.source}\n" + evaluate.format_table(results))
    record = {"model": policy.source, "step": step, "temperature": temperature,
              "groups": groups, "group_size": size, "results": results}
    if other is not None:
        print(f"\n{other.source}\n" + evaluate.format_table(against))
        print(f"\n{policy.source} minus {other.source}, level by level:")
        for tag, d in paired.items():
            print(f"{tag}: success {d['success_diff']:+.3f} (standard error "
                  f"{d['success_diff_stderr']:.3f}); more successes on {d['levels_better']} "
                  f"of {groups} levels, fewer on {d['levels_worse']}")
        record.update(against={"model": other.source, "step": other_step, "results": against},
                      paired=paired)
    line = json.dumps(record)
    print(line)
    if FLAGS.out:  # written whole, then renamed: a reader never sees half a file
        with open(FLAGS.out + ".tmp", "w", encoding="utf-8") as f:
            f.write(line + "\n")
        os.replace(FLAGS.out + ".tmp", FLAGS.out)


def cli():
    """The `starpo-eval` command (pyproject.toml)."""
    common.run(main, config_flag=CONFIG)


if __name__ == "__main__":
    cli()
