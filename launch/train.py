"""Train an LLM agent with StarPO: `python launch/train.py --config=configs/frozenlake.py:cpu`.

  --config=FILE[:variant]       a config file (configs/*.py), variants after a colon
  --config.rollout.temperature=0.7   override any config field (typos and wrong types fail)
  --workdir=DIR                 where the run lives (default runs/<config>[_<variant>]); an
                                existing run there is resumed

Prints one summary line per step, below a progress bar on a terminal (redirected to a file or
a pipe, no bar: the lines alone, each flushed as it is printed, so `grep -c '^step' log` counts
the steps); writes checkpoints, metrics.jsonl and TensorBoard logs into the workdir (see
starpo/harness.py). Ctrl-C or SIGTERM finishes the current step, saves a checkpoint and exits
with status 75; the same command resumes.

On several hosts (a TPU pod slice, a SLURM or MPI job) run the same command on every host;
`jax.distributed.initialize()` joins them (`--config.mesh.distributed=auto|on|off`; JAX detects
the processes, or `--config.mesh.coordinator_address=HOST:PORT --config.mesh.num_processes=N
--config.mesh.process_id=I` name them) and the mesh (`--config.mesh.data/fsdp/tensor`) spans
every host's devices. Process 0 alone prints and writes logs and metrics; every process writes
its shards of each checkpoint.
"""

if not __package__:  # run as a file from a checkout: launch/_checkout.py puts its root first
    import _checkout  # noqa: F401

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch import common  # noqa: E402

CONFIG = common.define_config("Config file, e.g. configs/frozenlake.py:cpu.")
flags.DEFINE_string("workdir", None, "Run directory (default runs/<config>[_<variant>]).")
flags.DEFINE_bool("progress", True, "Show a progress bar on a terminal (stderr); "
                  "redirected output has the step lines alone.")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["config"].present:
        raise ValueError("--config is required, e.g. --config=configs/frozenlake.py:cpu")
    from starpo import training

    spec = config_flags.get_config_filename(FLAGS["config"])
    workdir = common.workdir_of(FLAGS.workdir, spec)
    common.note_accelerator(spec)
    common.run_job(CONFIG.value, workdir,
                   lambda: training.train(CONFIG.value, workdir, progress=FLAGS.progress))


def cli():
    """The `starpo-train` command (pyproject.toml)."""
    common.run(main, config_flag=CONFIG, check_config=True)  # every value, before any work


if __name__ == "__main__":
    cli()
