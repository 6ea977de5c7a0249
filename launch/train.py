"""Train an LLM agent with StarPO: `python launch/train.py --config=configs/frozenlake.py:cpu`.

  --config=FILE[:variant]       a config file (configs/*.py), variants after a colon
  --config.rollout.temperature=0.7   override any config field (typos and wrong types fail)
  --workdir=DIR                 where the run lives (default runs/<config>[_<variant>]); an
                                existing run there is resumed

Prints a progress bar and one summary line per step; writes checkpoints, metrics.jsonl and
TensorBoard logs into the workdir (see starpo/training.py). Ctrl-C or SIGTERM finishes the
current step, saves a checkpoint and exits with status 75; the same command resumes.

On several hosts (a TPU pod slice, a SLURM or MPI job) run the same command on every host;
`jax.distributed.initialize()` joins them (`--config.mesh.distributed=auto|on|off`; JAX detects
the processes, or `--config.mesh.coordinator_address=HOST:PORT --config.mesh.num_processes=N
--config.mesh.process_id=I` name them) and the mesh (`--config.mesh.data/fsdp/tensor`) spans
every host's devices. Process 0 alone prints and writes logs and metrics; every process writes
its shards of each checkpoint.
"""

import os
import sys

if not __package__:  # run as a file from a checkout: launch/_checkout.py puts its root first
    import _checkout  # noqa: F401

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch import common  # noqa: E402

CONFIG = common.define_config("Config file, e.g. configs/frozenlake.py:cpu.")
flags.DEFINE_string("workdir", None, "Run directory (default runs/<config>[_<variant>]).")
flags.DEFINE_bool("progress", True, "Show a progress bar.")
FLAGS = flags.FLAGS


def default_workdir(spec: str) -> str:
    path, _, variant = spec.partition(":")
    name = os.path.splitext(os.path.basename(path))[0] + (f"_{variant}" if variant else "")
    return os.path.join("runs", name)


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["config"].present:
        raise ValueError("--config is required, e.g. --config=configs/frozenlake.py:cpu")
    import jax

    from starpo import sharding, training

    # on a TPU pod slice or a cluster (several processes): join them before touching devices
    m = CONFIG.value.mesh
    sharding.initialize_distributed(m.distributed, coordinator_address=m.coordinator_address,
                                    num_processes=m.num_processes, process_id=m.process_id,
                                    init_timeout_s=m.init_timeout_s,
                                    heartbeat_timeout_s=m.heartbeat_timeout_s)
    training.enable_compilation_cache()
    workdir = FLAGS.workdir or default_workdir(config_flags.get_config_filename(FLAGS["config"]))
    if jax.process_index() == 0:  # on several processes the first one alone prints
        print(f"workdir: {workdir}  (tensorboard --logdir {workdir})")
    try:
        training.train(CONFIG.value, workdir, progress=FLAGS.progress)
    except training.Stopped as e:
        sharding.Liveness.finish()
        if jax.process_index() == 0:
            print(f"{e}", file=sys.stderr, flush=True)
        sys.exit(sharding.EXIT_STOPPED)
    except BaseException as e:  # the other processes stop now rather than wait for this one
        if isinstance(e, jax.errors.JaxRuntimeError):  # a collective may have lost a process:
            sharding.Liveness.verdict()  # say which (exit status 3) rather than this error
        expected = isinstance(e, (ValueError, FileNotFoundError))  # common.run: status 2
        sharding.Liveness.finish(ok=False, exit_code=2 if expected else 1)
        raise
    sharding.Liveness.finish()


def cli():
    """The `starpo-train` command (pyproject.toml)."""
    common.run(main, config_flag=CONFIG, check_config=True)  # every value, before any work


if __name__ == "__main__":
    cli()
