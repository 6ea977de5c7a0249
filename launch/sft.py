"""Supervised fine-tuning on solver demonstrations, alone: the paper's SFT baseline
(`launch/train.py` with `--config.sft.steps=N` runs the same phase as RL's warm start).

  python launch/sft.py --config=configs/frozenlake.py:cpu --config.sft.steps=60
  python launch/eval.py --run=runs/frozenlake_cpu_sft     # its success on held-out levels

Takes the same config files and overrides as launch/train.py (the `sft` section: starpo/sft.py);
the run lives in --workdir (default runs/<config>[_<variant>]_sft) like an RL run: config.json,
checkpoints, metrics.jsonl (`sft/loss`, validation `val/<tag>/...`, the solver's own
`val/<tag>/solver_success` and the held-out demonstrations' `val/<tag>/demo_accuracy`),
TensorBoard. Ctrl-C or SIGTERM saves and exits; the same command resumes. Multi-process runs
as launch/train.py.
"""

if not __package__:  # run as a file from a checkout: launch/_checkout.py puts its root first
    import _checkout  # noqa: F401

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch import common  # noqa: E402

CONFIG = common.define_config("Config file, e.g. configs/frozenlake.py:cpu.")
flags.DEFINE_string("workdir", None, "Run directory (default runs/<config>[_<variant>]_sft).")
flags.DEFINE_bool("progress", True, "Show a progress bar on a terminal (stderr); "
                  "redirected output has the step lines alone.")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["config"].present:
        raise ValueError("--config is required, e.g. --config=configs/frozenlake.py:cpu")
    from starpo import sft

    spec = config_flags.get_config_filename(FLAGS["config"])
    workdir = common.workdir_of(FLAGS.workdir, spec, "_sft")
    common.note_accelerator(spec)
    common.run_job(CONFIG.value, workdir,
                   lambda: sft.train_only(CONFIG.value, workdir, progress=FLAGS.progress))


def cli():
    """The `starpo-sft` command (pyproject.toml)."""
    common.run(main, config_flag=CONFIG, check_config=True)  # every value, before any work


if __name__ == "__main__":
    cli()
