"""Print a config's memory plan for model shapes and device counts, without loading anything.

  python launch/plan.py --config=configs/frozenlake.py
  python launch/plan.py --config=configs/sokoban.py --models=qwen2.5-3b --devices=1,8,32
  python launch/plan.py --config=configs/frozenlake.py:cpu --backend=cpu

For each model shape and number of devices (FSDP over all of them) it prints the estimated peak
per device of the rollout, the validation and the update (`starpo/memory.py`) and whether the
largest fits 24 and 80 GB (or would, as a run on an accelerator then makes it: with the
optimizer state and the critic in host memory while the actor samples, `trainer.offload_state`,
then also with one decode window, `rollout.decode_windows=1`: `training.fit_memory`), as a
Markdown table, then one JSON line. `--backend` is the platform
the plan is for, as `model.dtype=auto` and `model.attention=auto` would run there: "gpu" (the
default) multiplies and caches in bfloat16 and trains with cuDNN's flash attention where it
takes the model's heads; "tpu" in bfloat16 with XLA's attention; "cpu" in float32 with the
blockwise CPU attention (`--dtype` overrides the dtype). The prompt prefix and each observation
are taken as `--prompt_tokens` long (an upper value: with the SmolLM2 tokenizer FrozenLake's are
156 and 115 tokens), which also sizes the cache to what an episode reaches.

With `--topology` (a TPU slice, e.g. v5e:2x2, v4:2x2x2, v5e:16x16; needs libtpu:
`pip install -r requirements-tpu.txt`) it compiles instead every program the run executes for
that slice, on this machine, with no TPU (`starpo/aot.py`): the run's mesh over the slice's
chips (its hosts' processes included), each model of `--models` at its shape with the config's
tokenizer. A row a program: compile seconds, XLA's bytes per chip, the memory plan's figure,
the chip's HBM and the TPU cost model's estimate of one call (the compiler's, never a measured
time). It exits with a one-line error where a program does not fit in 90% of a chip's HBM.
"""

import contextlib
import dataclasses
import json
import sys

if not __package__:  # run as a file from a checkout: launch/_checkout.py puts its root first
    import _checkout  # noqa: F401

from absl import flags  # noqa: E402

from launch import common  # noqa: E402

CONFIG = common.define_config("Config file, e.g. configs/frozenlake.py.")
flags.DEFINE_list("models", "smollm2-135m,qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-3b",
                  "Model shapes (the names in starpo/families.py SHAPES).")
flags.DEFINE_list("devices", "1,8", "Device counts (FSDP over all of them).")
flags.DEFINE_enum("backend", "gpu", ["gpu", "tpu", "cpu"],
                  "The platform planned for (its dtypes and attention kernels).")
flags.DEFINE_enum("dtype", "auto", ["auto", "bfloat16", "float32"],
                  "Decode and update matmul dtype; auto: the backend's (float32 on cpu).")
flags.DEFINE_integer("prompt_tokens", 256, "Tokens of the first prompt chunk.", lower_bound=1)
flags.DEFINE_string("topology", None, "A TPU slice to compile every program for (e.g. "
                    "v5e:2x2): replaces --devices and --backend (needs libtpu).")
FLAGS = flags.FLAGS

def model_config(name: str):
    """The ModelConfig of a published model's shape (`starpo.families.SHAPES`)."""
    from starpo import families
    from starpo.model import ModelConfig

    return ModelConfig(**families.shape(name).fields())


def kernels(backend: str, cfg, dtype: str) -> str:
    """The update's attention kernels that `model.attention=auto` picks on `backend` (as
    `model.kernels` does on the device it runs on; a GPU taken as Ampere or later)."""
    if backend == "cpu":
        return "cpu"
    cudnn = (dtype in ("bfloat16", "float16") and cfg.head_dim % 8 == 0
             and cfg.head_dim <= 128)
    if backend == "tpu":
        return "splash"
    return "cudnn" if backend == "gpu" and cudnn else "xla"


def _key(label: str) -> str:
    """A JSON key of an offloading label: "offloading, 1 window" -> "offloading_1_window"."""
    return label.replace(", ", "_").replace(" ", "_")


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["config"].present:
        raise ValueError("--config is required, e.g. --config=configs/frozenlake.py")
    from starpo import memory, precision, run_config

    if not FLAGS.models or not FLAGS.devices:
        raise ValueError("--models and --devices each need at least one value")
    try:
        devices = [int(d) for d in FLAGS.devices]
    except ValueError:
        raise ValueError(f"--devices must be whole numbers, got {','.join(FLAGS.devices)}"
                         ) from None
    if any(d < 1 for d in devices):
        raise ValueError(f"--devices must be >= 1, got {FLAGS.devices}")
    cfgs = {name: model_config(name) for name in FLAGS.models}  # every name checked first
    if FLAGS.topology is not None:
        return compile_for_topology(cfgs)
    r = CONFIG.value.rollout
    # what an episode can reach (the run sizes its cache so): the prefix and every turn's
    # observation taken as --prompt_tokens long, plus the replies, in multiples of 64 slots
    P = FLAGS.prompt_tokens
    dtype = FLAGS.dtype if FLAGS.dtype != "auto" else (
        "float32" if FLAGS.backend == "cpu" else "bfloat16")
    context = min(r.max_context, -(-(P + r.max_turn * (P + r.response_length)) // 64) * 64)
    run = run_config.read(CONFIG.value)
    # what a run on an accelerator tries where its plan does not fit (training.fit_memory)
    offload_runs = []
    if not run.trainer.offload_state and FLAGS.backend != "cpu":
        off = dataclasses.replace(run, trainer=dataclasses.replace(run.trainer,
                                                                   offload_state=True))
        offload_runs.append((off, "offloading"))
        if run.rollout.decode_windows > 1:
            offload_runs.append((dataclasses.replace(off, rollout=dataclasses.replace(
                off.rollout, decode_windows=1)), "offloading, 1 window"))
    rows, out = [], []
    # a TPU's choices made as on one (the cache's tile padding, memory.kv_tile_padding)
    target = precision.target("tpu") if FLAGS.backend == "tpu" else contextlib.nullcontext()
    with target:
        for name, cfg in cfgs.items():
            for n in devices:
                def gb_of(r):  # r's phases (GB per device) on n devices
                    return memory.total_gb(memory.plan(
                        r, cfg, mesh_shape=(1, n, 1), prompt_tokens=P, decode_dtype=dtype,
                        update_dtype=dtype, contexts=(context, context),
                        attention=kernels(FLAGS.backend, cfg, dtype),
                        # an H100 / H200's (memory.matmul_workspace)
                        workspace=memory.HOPPER_WORKSPACE if FLAGS.backend == "gpu" else 0.0))

                gb = gb_of(run)
                peak = max(gb.values())
                # what a run on an accelerator tries where it does not fit (training.fit_memory):
                # the state in host memory while sampling, then also one decode window
                alts = [(label, gb_of(r)) for r, label in offload_runs]
                tried = [(max(g.values()), label) for label, g in alts] if peak > 24 else []

                def fit(cap):
                    if peak <= cap:
                        return "yes"
                    return next((f"yes, {label} ({p:.1f})" for p, label in tried if p <= cap), "no")

                fits = " / ".join(fit(cap) for cap in (24, 80))
                sampling = "".join(f"; {label}: {g['rollout']:.1f}" for label, g in alts)
                rows.append(f"| {name} | {n} | {gb['rollout']:.1f}{sampling} "
                            f"| {gb['validation']:.1f} | {gb['update']:.1f} | {fits} |")
                out.append({"model": name, "params": cfg.num_params, "devices": n, **gb,
                            **{f"rollout_{_key(label)}": g["rollout"] for label, g in alts},
                            **{f"peak_{_key(label)}": p for p, label in tried}})
    print("| model | devices | rollout GB (and with the state offloaded) | validation GB | "
          "update GB | fits 24 / 80 GB |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(json.dumps(out))


def compile_for_topology(cfgs: dict) -> None:
    """--topology: every program of the run compiled for the slice, a table a model shape."""
    import jax

    from starpo import aot

    if FLAGS["devices"].present or FLAGS["backend"].present:
        raise ValueError("--topology names the chips and the platform: leave out --devices "
                         "and --backend")
    topo = aot.topology(FLAGS.topology)  # a bad name or no libtpu: one line, before any work
    config = CONFIG.value
    if FLAGS.dtype != "auto":
        config.model.dtype = FLAGS.dtype
    from starpo import sharding

    m = config.mesh
    sharding.mesh_shape(m.data, m.fsdp, m.tensor, len(topo.devices))  # divides the chips?
    tokenizer = aot.config_tokenizer(config)
    out, too_big = [], []
    for name, cfg in cfgs.items():
        cfg = cfg.replace(vocab_size=max(cfg.vocab_size, tokenizer.vocab_size))
        rows = aot.compile_run(config, cfg, tokenizer, topo, log=lambda line: print(
            line, file=sys.stderr, flush=True))
        print(f"{name} on {topo.name} (jax {jax.__version__}, libtpu {aot.libtpu_version()}):")
        print(aot.table(rows, topo))
        out += [{"model": name, "topology": topo.name, **aot.as_json(r)} for r in rows]
        too_big += [(name, r) for r in rows if not r.fits]
    print(json.dumps(out))
    if too_big:
        name, r = too_big[0]
        if r.refused:
            raise ValueError(f"{name} on {topo.name}: the {r.phase} program does not fit a "
                             f"chip: XLA refuses it ({r.refused})")
        raise ValueError(f"{name} on {topo.name}: the {r.phase} program needs "
                         f"{r.bytes / aot.GIB:.2f} GiB per chip, over 90% of the chip's "
                         f"{r.hbm_bytes / aot.GIB:.0f} GiB HBM")


def cli():
    """The `starpo-plan` command (pyproject.toml)."""
    common.run(main, config_flag=CONFIG, check_config=True)


if __name__ == "__main__":
    cli()
