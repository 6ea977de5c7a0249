"""Write a trained policy as a Hugging Face checkpoint directory that transformers can load.

  python launch/export.py --checkpoint=runs/frozenlake_cpu --out=exported/frozenlake

--checkpoint: a training workdir (its latest checkpoint, or --step) or one of its checkpoints.
Writes model.safetensors (float32), config.json, generation_config.json and the tokenizer files
(chat template included); the directory appears complete or not at all. A LoRA run's adapters
are merged into the weights it writes.
"""

import os

if not __package__:  # run as a file from a checkout: launch/_checkout.py puts its root first
    import _checkout  # noqa: F401

from absl import flags  # noqa: E402

from launch import common  # noqa: E402

flags.DEFINE_string("checkpoint", None, "Training workdir or one of its checkpoints.", required=True)
flags.DEFINE_string("out", None, "Output directory (must not exist).", required=True)
flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    import jax.numpy as jnp

    from starpo import experiment, harness, lora, weights

    if not FLAGS.out.strip():
        raise ValueError("--out is empty; give the folder to write")
    if os.path.exists(FLAGS.out):
        raise ValueError(f"--out {FLAGS.out} already exists")
    harness.check_can_create(FLAGS.out, "--out")  # before the checkpoint is read
    _, policy, step = experiment.load_run(FLAGS.checkpoint, FLAGS.step)
    # a LoRA run's adapters are folded into the weights (W + alpha/r A B, in float32)
    cfg, params = lora.merge(policy.cfg, policy.params, jnp.float32)
    weights.save_hf_dir(FLAGS.out, cfg.replace(value_head=False), params, policy.tokenizer)
    print(f"wrote {FLAGS.out} (step {step}, {policy.cfg.num_params / 1e6:.1f}M params)")


def cli():
    """The `starpo-export` command (pyproject.toml)."""
    common.run(main)


if __name__ == "__main__":
    cli()
