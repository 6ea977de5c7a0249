"""What every phase of a run does around its own steps: the workdir, config.json, the first
log lines and the memory plan, the SIGTERM stop, checkpoint resumes and the metrics writer.

    resuming = harness.check_workdir(workdir, config)   # leaves nothing: fails before any work
    with harness.Stop() as stop:                       # SIGTERM / Ctrl-C: finish the step
        stoppers = harness.asked_to_stop(stop)         # every process stops at the same step
    harness.raise_if_stopped(stoppers, n, total)       # `Stopped`: the checkpoint is saved

The RL phase (`training.py`) and the SFT phase (`sft.py`) both run through these names, so a
run of either phase lives in its workdir the same way (and `launch/eval.py`, `launch/chat.py`
take either: `experiment.load_run`):

    <workdir>/config.json      the run's config (a resumed run must match it)
    <workdir>/checkpoints/     orbax checkpoints
    <workdir>/metrics.jsonl    one flat JSON object per logged step
    <workdir>/tb/              TensorBoard event files

On several hosts every process runs the same steps (and writes its shards of each checkpoint);
the first one alone prints and writes the config, metrics and samples (`lead_only`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile

import jax

from starpo import checkpoint as ckpt_lib
from starpo import lora, memory, run_config, schema
from starpo import metrics as metrics_lib
from starpo import model as model_lib
from starpo import sharding, weights
from starpo.cli import first_line

# Keys a resumed run may change (`schema`'s `resume=True`: only how or when the same numbers
# are computed); any other difference means "this is a different run".
RESUMABLE_CHANGES = schema.resumable()


def enable_compilation_cache(directory: str | None = None) -> None:
    """Keep compiled programs on disk (JAX's persistent cache): a restarted or resumed run skips
    the minute of compiling a 135M model's rollout and update. JAX's own environment variables
    (JAX_COMPILATION_CACHE_DIR, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS), where set, win."""
    directory = (directory or os.environ.get("JAX_COMPILATION_CACHE_DIR")
                 or os.path.join(weights.cache_dir(), "jax"))
    jax.config.update("jax_compilation_cache_dir", directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)


# ----------------------------------------------------------------------------- the workdir
def config_json(config) -> str:
    """The config as config.json and every checkpoint hold it (keys sorted)."""
    return config.to_json_best_effort(sort_keys=True)


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resumable(saved_json: str, config) -> None:
    """A workdir's saved config must equal this one except for RESUMABLE_CHANGES. A key added
    since it was saved counts as the value the schema says older runs had
    (`run_config.upgrade`)."""
    now = _flat(json.loads(config_json(config)))
    saved = _flat(run_config.upgrade(json.loads(saved_json)))
    for key in sorted(set(saved) | set(now)):
        if key in RESUMABLE_CHANGES:
            continue
        if saved.get(key, "<absent>") != now.get(key, "<absent>"):
            raise ValueError(f"the workdir holds a run with {key}={saved.get(key, '<absent>')!r}, "
                             f"this config has {now.get(key, '<absent>')!r}; use a new --workdir "
                             f"(changeable on resume: {', '.join(RESUMABLE_CHANGES)})")


def check_workdir(workdir: str, config) -> bool:
    """Whether `workdir` holds a run to resume, checking that it has this config and that the
    workdir can be created or written (`check_can_create`: it leaves nothing behind)."""
    if not workdir or not workdir.strip():
        raise ValueError("workdir is empty")
    path = os.path.join(workdir, "config.json")
    resuming = os.path.isfile(path)
    if resuming:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            json.loads(text)
        except ValueError as e:
            raise ValueError(f"{path} is not a run's config ({first_line(e)}); use another "
                             f"--workdir or remove it") from None
        check_resumable(text, config)
    check_can_create(workdir, "workdir")
    return resuming


def check_can_create(path: str, what: str) -> None:
    """ValueError (one line, `what` naming the flag) where `path` cannot be made or written:
    an empty folder is made and removed in it, or where it is not yet, in its nearest existing
    parent (`os.access` says yes to root on read-only places such as /sys)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(f"{existing} is not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=".starpo-probe-", dir=existing))
    except OSError as e:
        why = f"{e.strerror} in {existing}" if e.strerror else first_line(e)
        raise ValueError(f"{what} {path} cannot be written ({why})") from None


def write_config(workdir: str, config) -> None:
    """<workdir>/config.json, written whole or not at all (a temporary file renamed)."""
    path = os.path.join(workdir, "config.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(config_json(config))
    os.replace(path + ".tmp", path)


def open_checkpoints(workdir: str, keep: int) -> ckpt_lib.Checkpointer:
    """The run's checkpoints/ folder keeping the newest `keep` (`trainer.keep_checkpoints`;
    the workdir created where it is not yet)."""
    os.makedirs(workdir, exist_ok=True)
    return ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=keep)


def lead_only(log, progress: bool):
    """(log, progress) of this process: process 0's own, nothing for the others."""
    if jax.process_index() == 0:
        return log, progress
    return (lambda *a, **k: None), False


def metrics_writer(workdir: str, start: int):
    """The run's metrics.jsonl and TensorBoard writer on process 0 (a resumed run drops what an
    interrupted one logged after its checkpoint at `start`), a writer of nothing elsewhere."""
    if jax.process_index() != 0:
        return metrics_lib.NullWriter()
    return metrics_lib.MetricsWriter(workdir, resume_step=start if start else -1)


def restore_target(abstract, shardings):
    """A state's shapes and dtypes `abstract` placed as `shardings` say: what a checkpoint
    restores into."""
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


# ----------------------------------------------------------------------------- the stop
class Stopped(Exception):
    """The run stopped early on SIGTERM / Ctrl-C (to any one of its processes) after saving a
    checkpoint at `.step`; the message is one line. `launch/train.py` exits with status
    `sharding.EXIT_STOPPED` (75)."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


class Stop:
    """SIGTERM / Ctrl-C: finish the current step, checkpoint, exit. A second Ctrl-C aborts."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. a test runner thread)
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              "(Ctrl-C again to abort without saving)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def asked_to_stop(stop: Stop) -> list:
    """The processes that were asked to stop: every process stops at the same step (each saves
    its shards of that checkpoint, orbax waits for all), whichever of them got the signal."""
    return sharding.processes_flagging(stop.requested)


def raise_if_stopped(stoppers: list, n: int, total: int, what: str = "step") -> None:
    """`Stopped` when processes `stoppers` asked to stop (SIGTERM / Ctrl-C) before the last
    step: every process saved the checkpoint of `what` n."""
    if stoppers and n < total:
        who = (f" (on process {', '.join(map(str, stoppers))})" if jax.process_count() > 1
               else "")
        raise Stopped(n, f"stopped on request{who}: checkpoint saved at {what} {n} of {total}; "
                         f"the same command resumes the run")


# ----------------------------------------------------------------------------- the first lines
# `exp` below is an `experiment.Experiment` (a floor above: this module only reads its fields)
def plan_phases(exp, sft: bool = False) -> list:
    """The memory plan of `exp`'s phases per device (`memory.plan`), not printed or checked.
    sft: those of its SFT phase alone (`launch/sft.py`): validation, and an update of
    `sft.env_groups` demonstrations with SFT's optimizer (no critic, no reference weights);
    no training batch is sampled."""
    run = memory.sft_run(exp.run) if sft else exp.run
    dtypes = run.model.dtypes
    phases = memory.plan(run, exp.policy.cfg, mesh_shape=tuple(exp.mesh.shape.values()),
                         prompt_tokens=memory.prompt_tokens(exp.rollout),
                         decode_dtype=dtypes["decode"], update_dtype=dtypes["update"],
                         contexts=(exp.rollout.context, max(
                             [vs.rollout.context for vs in exp.val_sets.values()] or [0])),
                         attention=model_lib.kernels(exp.policy.cfg.replace(
                             dtype=dtypes["update"])), workspace=memory.matmul_workspace(),
                         shares=(exp.rollout.share, min(
                             [vs.rollout.share for vs in exp.val_sets.values()] or [1])))
    return memory.sft_phases(phases) if sft else phases


def memory_plan(exp, log=metrics_lib.say, sft: bool = False) -> list:
    """Print the estimated peak memory of each phase beside the device's capacity; raise
    `memory.MemoryPlanError` where one cannot fit (`trainer.memory_check`; else a warning).
    sft: the SFT phase's alone (`plan_phases`)."""
    run = exp.run
    phases = plan_phases(exp, sft)
    capacity, where = memory.device_capacity()
    if jax.process_index() == 0:
        log(memory.describe(phases, capacity, where))
    try:
        memory.check(phases, capacity, where)
    except memory.MemoryPlanError as e:
        if run.trainer.memory_check:
            raise
        if jax.process_index() == 0:
            log(f"warning: {e} (trainer.memory_check=False: going on)")
    return phases


def log_start(exp, build_s: float, log) -> None:
    """The run's first lines: what was built, on which devices and mesh."""
    batch = exp.run.batch
    batch_envs = (",".join(f"{t}:{g}" for t, g in exp.mix) if len(exp.mix) > 1
                  else exp.mix[0][0])
    cfg = exp.policy.cfg
    adapters = (f", LoRA rank {cfg.lora_rank}: {lora.num_adapter_params(cfg) / 1e6:.2f}M "
                f"adapter weights train" if cfg.lora_rank else "")
    log(f"built in {build_s:.1f} s: {exp.policy.source} "
        f"({cfg.num_params / 1e6:.1f}M params{adapters}), env {batch_envs}, "
        f"{batch.env_groups}x{batch.group_size} episodes per step, "
        f"{jax.devices()[0].platform} x{jax.device_count()} (mesh data x fsdp x tensor = "
        f"{' x '.join(str(n) for n in exp.mesh.shape.values())}); "
        f"the first step and validation compile (slow)")
    unsplit = sharding.describe(model_lib.logical_axes(exp.policy.cfg),
                                model_lib.abstract_params(exp.policy.cfg), exp.mesh)
    if unsplit:
        log(f"sharding: {len(unsplit)} weight dims stay replicated or partly split (sizes not "
            f"divisible by the mesh), e.g. {unsplit[0]}")


def measured_peaks(scalars: dict, planned: dict, say) -> None:
    """A line per phase for the device's measured peaks in `scalars` (memory/<phase>_peak_gb),
    beside the plan's estimate: what a GPU run calibrates the plan with."""
    for phase in ("setup", "validation", "rollout", "update"):
        peak = scalars.get(f"memory/{phase}_peak_gb")
        if peak is not None:
            say(memory.describe_peak(phase, peak * memory.GB, planned.get(phase),
                                     memory.autotune_scratch()))
