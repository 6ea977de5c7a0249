"""A training run: config -> the experiment (model, rollouts, update) -> the rollout/update loop
with validation, logging and checkpoints. `launch/train.py` is a thin command line around `train`.

One iteration (a "step") is

    levels (seed counter) -> rollout (jitted, on device) -> update (jitted: filter, old
    log-probs, advantages, k PPO updates) -> metrics (one host transfer) -> log / checkpoint

Determinism: every random number comes from the config's seed and the step number (rollout key
= fold_in(seed, step), training levels = seeds step * env_groups + g), so a run resumed from
a checkpoint at step s continues exactly as an uninterrupted one would. DAPO's dynamic sampling
(`algorithm.filter_groups_enable`) may play several batches a step: the seed counter then
advances by every batch played and is kept in the checkpoint.
The run lives in its workdir as every phase's does (`harness.py`: config.json, checkpoints/,
metrics.jsonl, tb/); what it builds once is an `experiment.Experiment`, and with
`sft.steps > 0` an SFT phase (`sft.py`) runs first in <workdir>/sft.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from starpo import collapse as collapse_lib
from starpo import config_check
from starpo import evaluate, gradients
from starpo import experiment as experiment_lib
from starpo import filtering, harness, memory
from starpo import metrics as metrics_lib
from starpo import monitors as monitors_lib
from starpo import model as model_lib
from starpo import rollout as rollout_lib
from starpo import run_config, sft, sharding
from starpo import update as update_lib
from starpo.trajectory import UpdateContexts


# ----------------------------------------------------------------------------- one step
def step_keys(seed: int, step: int):
    """(rollout key, mini-batch order key) of a step: from the seed and the step alone."""
    k = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.fold_in(k, 0), jax.random.fold_in(k, 1)


def _gather_rows(parts, rows):
    """Rows `rows` of the row-wise concatenation of a list of pytrees of [B_i, ...] arrays."""
    return jax.tree_util.tree_map(lambda x: jnp.take(x, rows, axis=0),
                                  rollout_lib.concat_rows(parts))


_gather_rows_jit = jax.jit(_gather_rows)


def play_batch(exp: experiment_lib.Experiment, params, key, seed_counter: int):
    """The training batch: ((traj, metrics), the seed counter after it, scalars).

    One rollout batch of levels seed_counter ..; with `algorithm.filter_groups_enable` (DAPO's
    dynamic sampling) more batches (next levels, key folded from `key`) until env_groups groups
    whose `algorithm.filter_groups_metric` differs (or of one episode) are found or
    filter_groups_max_num_gen_batches were played, the batch then filled as
    `filtering.fill_groups` says (same shapes whatever was found)."""
    run, algo = exp.run, exp.algo
    G, gs = run.batch.env_groups, run.batch.group_size
    played, kept = [], []
    while True:
        k = key if not played else jax.random.fold_in(jax.random.fold_in(key, 2**20), len(played))
        env_state, group_id = exp.initial_states(jax.random.key(run.seed),
                                                 jnp.int32(seed_counter))
        seed_counter += G
        played.append(exp.run_rollout(params, k, env_state, group_id,
                                      jnp.float32(run.batch.temperature)))
        if not algo.filter_groups_enable:
            return played[0], seed_counter, {}
        traj = played[-1][0]
        metric = traj.score if algo.filter_groups_metric == "score" else traj.success
        kept.append(filtering.nonzero_std_groups(sharding.to_host(metric), gs))
        found = int(sum(ks.sum() for ks in kept))
        if found >= G or len(played) >= algo.filter_groups_max_num_gen_batches:
            break
    chosen = filtering.fill_groups(kept, G)
    rows = np.concatenate([(b * G + g) * gs + np.arange(gs) for b, g in chosen]).astype(np.int32)
    used = max(b for b, _ in chosen) + 1
    batch = jax.device_put(_gather_rows_jit(played[:used], jnp.asarray(rows)),
                           sharding.batch_sharding(exp.mesh, G * gs))
    return batch, seed_counter, {"rollout/num_gen_batches": float(len(played)),
                                 "rollout/filter_groups_kept": float(min(found, G))}


def train_step(exp: experiment_lib.Experiment, state, step: int, seed_counter: int | None = None,
               template=None, peaks: bool = False, contexts: UpdateContexts | None = None,
               analysis=None):
    """One rollout -> update iteration. Returns (state, scalars); scalars["env/seed_counter"]
    is the level seed counter after it (by default the step's batch starts at
    step * env_groups, as it does unless dynamic sampling played more batches).
    template: a `collapse.TemplateCollapse` (trainer.collapse_mi_freq > 0): on its steps the
    batch's collapse/ scalars, scored with the params that sampled it, before the update.
    peaks: also memory/rollout_peak_gb and memory/update_peak_gb, the device's measured peak
    so far after each (read where the step waits for them anyway; none on CPU).
    contexts: the run's `UpdateContexts` (which context the update trains on, given what the
    run has compiled); None: the batch's own bucket.
    analysis: a `gradients.GradientAnalysis` (trainer.gradient_analysis_every > 0): on its steps
    RAGEN-2's gradient norms of the batch's reward-std buckets, before the update."""
    run = exp.run
    t0 = time.perf_counter()
    k_roll, k_update = step_keys(run.seed, step)
    if seed_counter is None:
        seed_counter = step * run.batch.env_groups
    offload = offloader(exp)
    state = offload(state, update_lib.HOST)  # (trainer.offload_state; else the same state)
    (traj, m), seed_counter, dyn = play_batch(exp, state.actor_params, k_roll, seed_counter)
    traj = jax.block_until_ready(traj)
    t1 = time.perf_counter()
    measured = {"rollout": memory.device_peak()} if peaks else {}
    lengths = sharding.to_host(traj.length)  # [B]: the one host transfer before the update
    if contexts is None:
        contexts = UpdateContexts(run.trainer.context_bucket)
    trained = contexts(int(lengths.max()), traj.tokens.shape[1])
    diagnostic = {}
    t_update = t1
    if template is not None and template.due(step + 1):  # the update donates the params
        diagnostic = template(state.actor_params, traj, run.seed, step + 1)
        diagnostic["timing/collapse"] = time.perf_counter() - t1
        t_update = time.perf_counter()
    # a KL term's reference is the policy the RL phase started from (the model, `init_from`'s
    # or the SFT phase's weights): exp.policy's, which a resumed run rebuilds as they were
    ref = exp.policy.params if exp.algo.uses_reference else None
    if analysis is not None and analysis.due(step + 1):  # before the update donates the state
        t_analysis = time.perf_counter()
        state = offload(state, update_lib.DEVICE)
        diagnostic.update(analysis(state, traj.truncate(trained), ref))
        t_update = time.perf_counter()
        diagnostic["timing/gradient_analysis"] = t_update - t_analysis
    state, um = exp.update(offload(state, update_lib.DEVICE), traj.truncate(trained), k_update,
                           ref)
    um = sharding.to_host(um)
    t2 = time.perf_counter()
    if peaks:
        measured["update"] = memory.device_peak()
    out = {k: float(v) for k, v in um.items()}
    out.update({f"memory/{name}_peak_gb": peak / memory.GB
                for name, peak in measured.items() if peak is not None})
    out.update(diagnostic)
    out.update(_batch_scalars(exp, traj, m, lengths, trained,
                              (t1 - t0, t2 - t_update, t2 - t0)))
    out.update({"env/seed_counter": float(seed_counter), **dyn})
    return state, out


def offload_frees(device) -> bool:
    """Whether moving state to `device`'s host memory frees device memory: an accelerator's."""
    return device.platform != "cpu" and update_lib.can_offload(device)


def fit_memory(exp: experiment_lib.Experiment, log=print,
               capacity: float | None = None) -> experiment_lib.Experiment:
    """`exp`, or where its memory plan does not fit the accelerator, the first of these that
    makes it fit, with a note saying so, instead of stopping: (1) the optimizer state and the
    critic in host memory while the actor samples (`trainer.offload_state`); (2) that and one
    decode window (`rollout.decode_windows=1`: the rollout holds its cache once, not twice;
    early turns then read the whole cache). So the paper's FrozenLake at Qwen2.5-0.5B's shape
    runs on a 24 GB card (26.1 GB planned, 19.8 with 1), and at Qwen2.5-3B's the rollout plans
    38.9 GB on one device with 2 (117.6 without, 55.8 with 1; its update, 110 GB, needs several
    devices; `launch/plan.py`). An explicit offload setting, a CPU (its
    "host memory" is the same memory), a device without host memory or a plan that fits keeps
    `exp`; where neither fits, the plan's own error names the knobs. capacity: bytes a device
    holds, in place of the device's own (`benchmarks.train_step --capacity_gb`: a smaller card
    on a larger one)."""
    run = exp.run
    if capacity is None:
        capacity, where = memory.device_capacity()
    else:
        where = "as asked"
    if run.trainer.offload_state or not capacity or not offload_frees(jax.devices()[0]):
        return exp
    before = max(harness.plan_phases(exp), key=lambda p: p.total)
    if before.total <= capacity:
        return exp
    off = dataclasses.replace(run, trainer=dataclasses.replace(run.trainer, offload_state=True))
    tries = [(off, "trainer.offload_state on, so the optimizer state and the critic wait in "
                   "host memory while the actor samples")]
    if run.rollout.decode_windows > 1:
        tries.append((dataclasses.replace(off, rollout=dataclasses.replace(
            off.rollout, decode_windows=1)), "trainer.offload_state on and "
            "rollout.decode_windows=1, so the optimizer state and the critic wait in host "
            "memory while the actor samples and the rollout holds its cache once"))
    for new, what in tries:
        # the plan reads these settings from the run; the programs are built from it below
        after = max(harness.plan_phases(dataclasses.replace(exp, run=new)),
                    key=lambda p: p.total)
        if after.total <= capacity:
            break
    else:
        return exp
    if jax.process_index() == 0:
        log(f"note: the {before.name} plans {before.total / memory.GB:.1f} GB per device, more "
            f"than the {capacity / memory.GB:.1f} GB there are ({where}): {what} (then "
            f"{after.total / memory.GB:.1f} GB at most, the {after.name})")
    if new.rollout == run.rollout:
        return dataclasses.replace(exp, run=new)
    return experiment_lib.build(new, exp.policy)  # the rollouts with one window


def offloader(exp: experiment_lib.Experiment):
    """(state, memory kind) -> state: `update.offload` under `trainer.offload_state`, else the
    state as it is."""
    if not exp.run.trainer.offload_state:
        return lambda state, kind: state
    adapters = exp.run.model.lora is not None
    return lambda state, kind: update_lib.offload(state, kind, adapters)


def _batch_scalars(exp: experiment_lib.Experiment, traj, metrics, lengths, trained: int,
                   times) -> dict:
    """The batch's train/<tag>/ summaries, its timings (rollout, update, step) and throughput."""
    batch = exp.run.batch
    t_roll, t_update, t_step = times
    out = {f"train/{name}": value for name, value in evaluate.summarize_mix(
        traj, metrics, exp.mix, batch.group_size).items()}
    generated = sum(out[f"train/{tag}/generated_tokens"] for tag, _ in exp.mix)
    # real tokens through the update's forward+backward passes: k mini-batches of `mini` of the
    # N kept rows (the old-log-prob forward is in the time, not in the count)
    # the filter's own count (at least one group), not a second copy of its formula
    kept = exp.algo.static_groups(batch.env_groups)
    N = kept * batch.group_size
    mini, k = update_lib.num_updates(exp.algo, N)
    kept_tokens = float(lengths.sum()) * N / traj.tokens.shape[0]
    out.update({
        "timing/rollout": t_roll, "timing/update": t_update, "timing/step": t_step,
        "perf/rollout_tokens_per_s": generated / t_roll,
        "perf/update_tokens_per_s": kept_tokens * k * mini / N / t_update,
        "perf/update_context": float(trained),
    })
    return out


def template_collapse(run: run_config.RunSpec, exp: experiment_lib.Experiment):
    """RAGEN-2's template-collapse diagnostic of a run (starpo/collapse.py), or None when
    `trainer.collapse_mi_freq` is 0 (nothing built, nothing run). It scores with the update's
    model (dtype, logit chunks, temperature) in micro-batches of `collapse_mi_micro_batch`."""
    t = run.trainer  # the run's (its knobs may differ from those `exp` was built with)
    if t.collapse_mi_freq <= 0 or run.context_window:
        return None  # RAGEN-2 computes nothing under a context window either
    return collapse_lib.TemplateCollapse(
        exp.policy.cfg.replace(dtype=exp.run.model.dtypes["update"]),
        exp.policy.tokenizer.token_bytes(), freq=t.collapse_mi_freq,
        samples=t.collapse_mi_samples, micro=t.collapse_mi_micro_batch,
        thinking=run.rollout.thinking, chunk=exp.algo.logit_chunk_size,
        temperature=exp.algo.temperature, compiler_options=exp.compiler_options,
        multi_turn=t.collapse_mi_multi_turn)



def gradient_analysis(run: run_config.RunSpec, exp: experiment_lib.Experiment):
    """RAGEN-2's gradient analysis of a run (starpo/gradients.py), or None when
    `trainer.gradient_analysis_every` is 0 (nothing built, nothing run)."""
    t = run.trainer
    if t.gradient_analysis_every <= 0:
        return None
    return gradients.GradientAnalysis(
        exp.algo, exp.policy.cfg.replace(dtype=exp.run.model.dtypes["update"]), exp.critic_cfg,
        every=t.gradient_analysis_every, count=t.gradient_analysis_num_buckets,
        mode=t.gradient_analysis_bucket_mode, compiler_options=exp.compiler_options)


# ----------------------------------------------------------------------------- the run
def train(config, workdir: str, *, progress: bool = True, stop_after: int | None = None,
          experiment: experiment_lib.Experiment | None = None, log=metrics_lib.say) -> dict:
    """Run (or resume) the training run of `config` in `workdir`.

    stop_after: end after this many steps of this call, as an interruption would (checkpoint
    saved), to test resuming. experiment: a `experiment.build(config)` to reuse (tests share
    compiled programs between runs; it must come from an equal config). Returns the last logged
    scalars.
    """
    # a bad value, model, env or workdir fails before anything is written
    config_check.check(config)
    resuming = harness.check_workdir(workdir, config)
    run = run_config.read(config)  # the one reading: what follows takes its typed parts
    warmup, total = run.algo.critic_warmup, run.trainer.total_steps
    if run.algo.uses_critic and 0 < total <= warmup and jax.process_index() == 0:
        log(f"note: algorithm.critic_warmup {warmup} >= trainer.total_steps {total}: only "
            f"the critic trains in this run (the actor from step {warmup + 1} on resume)")
    if run.trainer.offload_state and not update_lib.can_offload(jax.devices()[0]):
        raise run_config.ConfigError(
            f"trainer.offload_state: the {jax.devices()[0].platform} device here has no "
            f"{update_lib.HOST} memory to hold the optimizer state; set it to False")
    t_build = time.perf_counter()
    exp = experiment or experiment_lib.build(run)
    # a run that cannot fit stops here, before any step
    exp = fit_memory(exp, log)
    planned = {p.name: p.total for p in harness.memory_plan(exp, log)}
    phase = None
    if run.sft.steps > 0:  # its demonstrations' replies must fit, before anything is written
        phase = sft.build(run, exp)
        harness.check_workdir(os.path.join(workdir, "sft"), config)
    ckpt = harness.open_checkpoints(workdir, run.trainer.keep_checkpoints)
    with jax.set_mesh(exp.mesh):  # programs trace with the mesh's activation shardings
        if phase is not None:
            ran_sft = ckpt.latest_step() is None
            exp = _after_sft(run, workdir, exp, phase, ckpt, progress, log, stop_after)
            if exp is None:  # stopped after stop_after steps: the same call resumes it
                return {}
            if ran_sft:
                t_build = time.perf_counter()
        loop = _Loop(run, workdir, exp, ckpt, log, planned)
        return loop.run(resuming, t_build, progress, stop_after)


def _after_sft(run, workdir, exp, phase, ckpt, progress, log, stop_after):
    """`exp` starting from where the SFT phase in <workdir>/sft ends: the phase is run (or
    resumed) first where RL has no checkpoint yet; a resumed RL run needs its KL reference
    alone from it. None where the phase stopped after `stop_after` steps (checkpoint saved)."""
    if ckpt.latest_step() is None:
        try:
            params = sft.run(run, os.path.join(workdir, "sft"), exp, phase,
                             progress=progress, log=log, stop_after=stop_after)
        except harness.Stopped:  # SIGTERM during SFT: its checkpoint is saved; RL has not begun
            ckpt.close()
            raise
        if params is None:
            ckpt.close()
            return None
        return experiment_lib.with_actor(exp, params)
    if exp.algo.uses_reference:  # RL resumes: its KL reference is where SFT ended
        sft_ckpt = os.path.join(workdir, "sft", "checkpoints")
        return experiment_lib.with_actor(exp, sharding.put(
            experiment_lib.load_actor(sft_ckpt, None, exp.policy.params),
            model_lib.param_shardings(exp.policy.cfg, exp.mesh)))
    return exp


class _Loop:
    """The RL phase's steps in its workdir: resume, validate, step, warn, checkpoint, stop."""

    def __init__(self, run: run_config.RunSpec, workdir, exp, ckpt, log, planned=None):
        self.run_spec, self.workdir, self.exp, self.ckpt = run, workdir, exp, ckpt
        self.trainer = run.trainer
        self.log = log
        self.planned = planned or {}
        # the device's measured peak after each phase's first run in this process (a host call
        # where the loop waits anyway; nothing on CPU, whose backend reports no peak)
        self.unmeasured = {"validation", "train"}
        self.setup_peak = None
        # the Echo Trap warning and RAGEN-2's warnings and stops, in the order they print
        self.monitors = monitors_lib.monitors(run.trainer, run.batch.group_size)
        self.state, self.start, self.counter = None, 0, 0
        self.contexts = UpdateContexts(run.trainer.context_bucket)
        self.writer = None
        self.template, self.template_state = None, None  # the diagnostic and its resumed EMA
        self.analysis = None  # RAGEN-2's gradient analysis (trainer.gradient_analysis_every)

    def run(self, resuming, t_build, progress, stop_after) -> dict:
        """The run from its start or its latest checkpoint; returns the last logged scalars."""
        spec, t = self.run_spec, self.trainer
        self.log, progress = harness.lead_only(self.log, progress)
        if not resuming and jax.process_index() == 0:
            harness.write_config(self.workdir, spec.config)
        self._resume(resuming)
        # the device's peak once the state is built or restored, before any phase: what the
        # first phases' "peak so far" owes to the set-up (a model file read, a checkpoint
        # restored) rather than to themselves (None on CPU)
        jax.block_until_ready(self.state)
        self.setup_peak = memory.device_peak()
        self.writer = harness.metrics_writer(self.workdir, self.start)
        harness.log_start(self.exp, time.perf_counter() - t_build, self.log)
        total, last = t.total_steps, {}
        with harness.Stop() as stop:
            if self.start == 0 and spec.val.before_train:
                last = self._validate(0, self.log)
                self.writer.write(0, last)
                self.log(metrics_lib.summary_line(0, total, last, self._keys()))
            bar = metrics_lib.Progress(self.start, total, "train", show=progress, log=self.log)
            self.template = self._template()
            self.analysis = gradient_analysis(self.run_spec, self.exp)
            done_here, n, stoppers = 0, self.start, []
            for step in bar:
                n, last, warned_stop = self._step(step, self.template, bar.write)
                done_here += 1
                stoppers = harness.asked_to_stop(stop)
                end = (n == total or bool(stoppers) or warned_stop
                       or (stop_after is not None and done_here >= stop_after))
                if end or (t.save_freq > 0 and n % t.save_freq == 0):
                    self._save(n)
                if end:
                    break
            bar.close()
        self.writer.close()
        self.ckpt.close()
        harness.raise_if_stopped(stoppers, n, total)
        return last

    def _keys(self):
        return metrics_lib.summary_keys(self.run_spec.batch.group_size)

    def _measured_peaks(self, scalars, say) -> None:
        """The lines of a phase's first measured peaks, beside their plan; the first of them
        also carry memory/setup_peak_gb (once)."""
        if self.setup_peak is not None:
            scalars["memory/setup_peak_gb"] = self.setup_peak / memory.GB
            self.setup_peak = None
        harness.measured_peaks(scalars, self.planned, say)

    def _resume(self, resuming) -> None:
        """The state, first step, level seed counter, monitors' state and update contexts of
        the latest checkpoint, or fresh ones."""
        exp = self.exp
        if resuming and self.ckpt.latest_step() is not None:
            target = update_lib.split_state(experiment_lib.state_target(exp))[0]
            state, meta = self.ckpt.restore(None, target)
            self.state = update_lib.join_state(state, experiment_lib.frozen_params(exp))
            self.start = int(meta["step"])
            self.counter = int(meta.get("env_seed_counter",
                                        self.start * self.run_spec.batch.env_groups))
            for m in self.monitors:  # a key absent (saved before the monitor was): fresh
                m.load_state_dict(meta.get(m.key))
            self.template_state = meta.get("template_collapse")  # absent: saved before it was
            self.contexts = UpdateContexts(self.trainer.context_bucket,
                                           state=meta.get("update_contexts"))
            self.log(f"resuming {self.workdir} from step {self.start}")
        else:
            self.state, self.counter = experiment_lib.initial_train_state(exp), 0

    def _template(self):
        template = template_collapse(self.run_spec, self.exp)
        if template is None and self.trainer.collapse_mi_freq > 0:
            self.log("note: trainer.collapse_mi_freq: the template-collapse diagnostic runs "
                     "only with rollout.context_window_mode=full (as RAGEN-2's): off for this run")
        if template is not None:
            template.load_state_dict(self.template_state)
        return template

    def _validate(self, n: int, say) -> dict:
        offload = offloader(self.exp)  # (trainer.offload_state) the state off the device meanwhile
        self.state = offload(self.state, update_lib.HOST)
        scalars = experiment_lib.validate(self.exp, self.state.actor_params, self.writer, n)
        self.state = offload(self.state, update_lib.DEVICE)
        if "validation" in self.unmeasured:
            self.unmeasured.discard("validation")
            peak = memory.device_peak()
            if peak is not None:
                scalars["memory/validation_peak_gb"] = peak / memory.GB
                self._measured_peaks(scalars, say)
        return scalars

    def _step(self, step: int, template, say):
        """One step, its validation, metrics and warnings: (steps done, its scalars, whether
        a warning stops the run here)."""
        spec = self.run_spec
        first = "train" in self.unmeasured
        self.unmeasured.discard("train")
        self.state, scalars = train_step(self.exp, self.state, step, self.counter, template,
                                         peaks=first, contexts=self.contexts,
                                         analysis=self.analysis)
        if first:
            self._measured_peaks(scalars, say)
        self.counter = int(scalars["env/seed_counter"])
        n = step + 1
        if spec.val.test_freq > 0 and n % spec.val.test_freq == 0:
            scalars.update(self._validate(n, say))
        lines, stop = [], False
        for m in self.monitors:  # each adds its scalars before they are written
            said, stops = m.observe(n, scalars)
            lines, stop = lines + said, stop or stops
        self.writer.write(n, scalars)
        say(metrics_lib.summary_line(n, spec.trainer.total_steps, scalars, self._keys()))
        for line in lines:
            say(line)
        return n, scalars, stop

    def _save(self, step: int) -> None:  # a LoRA run's checkpoint holds what trains, not its base
        self.ckpt.save(step, update_lib.split_state(self.state)[0], {
            "step": step, "env_seed_counter": self.counter, "seed": self.run_spec.seed,
            "config": json.loads(harness.config_json(self.run_spec.config)),
            "template_collapse": self.template.state_dict() if self.template else None,
            "update_contexts": self.contexts.state_dict(),
            **{m.key: m.state_dict() for m in self.monitors if m.key}})
