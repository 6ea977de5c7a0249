"""One training iteration, phase by phase: where does the time go?

  python -m benchmarks.train_step --config=configs/frozenlake.py:cpu
  python -m benchmarks.train_step --config=configs/sokoban.py --config.rollout.env_groups=8

Builds the run of a config (`experiment.build`, any `--config.*` override) and times one
iteration's phases, each compiled ahead of time and then run once on the same data:

  rollout        levels + the jitted multi-turn episode loop (sampling, env, render, parse)
  old_logprobs   the training forward over the kept rows (micro-batched, as the update does)
  values         the critic forward over the kept rows (PPO / GAE only)
  adv_filter     the rest of the update's preparation: reward normalisation, the StarPO-S
                 filter and its gather, rewards to tokens, GAE / GRPO, whitening
                 (= the whole preparation minus the two forwards above)
  ppo_updates    the k mini-batch PPO updates (= the whole update minus its preparation)

The last line printed is one JSON object with seconds per phase, compile seconds, the biggest
phase, token counts and tokens per second of the rollout and of the update.

As a run does, it first fits the plan to the device (`training.fit_memory`: the optimizer state
and the critic in host memory while the actor samples, then one decode window); where that
moves the state, its round trip is one more phase, `offload`. --capacity_gb=24 fits it to a
24 GB card instead of the device's own memory, so an 80 GB GPU measures, as its peaks, what a
24 GB card would hold.

Run from the repository root: `python -m` puts it on the import path.
"""

import json
import sys
import time


from absl import flags
from ml_collections import config_flags

from launch import common

CONFIG = common.define_config("Config file, e.g. configs/frozenlake.py:cpu.")
flags.DEFINE_float("capacity_gb", 0.0, "Fit the run's memory to a device of this many GB "
                   "(0: the device's own).", lower_bound=0.0)
FLAGS = flags.FLAGS


def device_gb(key="peak_bytes_in_use"):
    """One of the device's allocator statistics (`memory.device_stat`: by default its peak bytes
    in use so far), GB; None where it keeps no statistics."""
    from starpo import memory

    value = memory.device_stat(key)
    return None if value is None else round(value / 1e9, 2)


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["config"].present:
        raise ValueError("--config is required, e.g. --config=configs/frozenlake.py:cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import sampler as sampler_bench
    from starpo import evaluate, experiment, filtering, harness, run_config, training
    from starpo import update as UP
    from starpo.trajectory import trimmed_length

    config = CONFIG.value

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t = time.perf_counter()
    exp = experiment.build(config)
    # as a run fits itself to the device (or to --capacity_gb)
    exp = training.fit_memory(exp, log, FLAGS.capacity_gb * 1e9 or None)
    build_s = time.perf_counter() - t
    algo, cfg, r = exp.algo, exp.policy.cfg, config.rollout
    offload = training.offloader(exp)
    compile_s, phase_s = {}, {}
    # per phase: the bytes in use before its program is compiled and the device's peak once it
    # is, before it runs (compiling on a GPU autotunes kernels in scratch buffers of the same
    # device memory: where the peak rose while compiling, by at least that scratch less what
    # was in use), and what XLA's buffer assignment reserves for the program (arguments +
    # outputs + temporaries, less what aliases)
    in_use_before_compile, compiled_peak, xla_gb = {}, {}, {}

    def timed(name, jitted, *args):
        in_use_before_compile[name] = device_gb("bytes_in_use")
        t = time.perf_counter()
        program = jitted.lower(*args).compile()
        compile_s[name] = time.perf_counter() - t
        compiled_peak[name] = device_gb()
        m = program.memory_analysis()
        if m is not None:
            xla_gb[name] = round((m.argument_size_in_bytes + m.output_size_in_bytes
                                  + m.temp_size_in_bytes - m.alias_size_in_bytes) / 1e9, 3)
        t = time.perf_counter()
        out = jax.block_until_ready(program(*args))
        phase_s[name] = time.perf_counter() - t
        log(f"{name}: {phase_s[name]:.2f} s (compile {compile_s[name]:.1f} s)")
        return out

    # the phases' memory plan beside the device's capacity, checked before any work (as a run
    # checks it); measured again at the end, the process's own buffers would count against it
    plan = harness.memory_plan(exp, log=log)
    with jax.set_mesh(exp.mesh):
        state = experiment.initial_train_state(exp)
        t = time.perf_counter()
        state = jax.block_until_ready(offload(state, UP.HOST))  # where fit_memory said so
        offload_s = time.perf_counter() - t
        k_roll, k_update = training.step_keys(config.seed, 0)
        env_state, group_id = exp.initial_states(jax.random.key(config.seed), jnp.int32(0))
        traj, m = timed("rollout", exp.run_rollout, state.actor_params, k_roll, env_state,
                        group_id, jnp.float32(r.temperature))
        summary = evaluate.summarize(traj, m, r.group_size)
        peaks = {"rollout": device_gb()}
        t = time.perf_counter()
        state = jax.block_until_ready(offload(state, UP.DEVICE))
        offload_s += time.perf_counter() - t
        # decode steps the loop took: each turn runs until the batch's longest reply ends
        mask, turn = np.asarray(traj.loss_mask), np.asarray(traj.turn_index)
        steps = sum(int(((turn == t) & mask).sum(axis=1).max()) for t in range(r.max_turn))
        prefix = 0 if traj.prefix_length is None else np.asarray(traj.prefix_length)
        fill = float(np.mean((prefix + np.asarray(traj.length)) / 2))  # slots filled, on average
        bound = sampler_bench.decode_bound(cfg, int(traj.tokens.shape[0]), steps, fill,
                                           cfg.dtype, run_config.rollout_spec(config).cache_dtype
                                           or cfg.dtype)
        # the update trains on the longest episode rounded up (trainer.context_bucket), as runs do
        update_context = trimmed_length(int(traj.length.max()), traj.tokens.shape[1],
                                        config.trainer.context_bucket)
        traj = traj.truncate(update_context)

        rows, _ = filtering.filter_rows(traj.score, algo.group_size, algo.rollout_filter_ratio,
                                        algo.rollout_filter_type)
        kept = traj.take(rows) if rows.shape[0] < traj.tokens.shape[0] else traj
        micro = UP.micro_size(algo, kept.tokens.shape[0])
        # as the update's preparation runs them: the head at the reply tokens, a single-turn
        # group's prompt once
        positions = UP.head_positions(algo, kept.loss_mask & kept.valid)

        def old_logprobs(params, tokens, valid, positions):
            return UP.batch_logprobs(algo, cfg, params, (tokens, valid), positions, micro)

        timed("old_logprobs", jax.jit(old_logprobs), state.actor_params, kept.tokens, kept.valid,
              positions)
        if algo.uses_critic:
            values = lambda p, t, v: UP.micro_map(  # noqa: E731
                lambda a, b: UP.token_values(p, exp.critic_cfg, a, b), micro, t, v)
            timed("values", jax.jit(values), state.critic_params, kept.tokens, kept.valid)
        prepare = jax.jit(UP.make_prepare(algo, cfg, exp.critic_cfg))
        timed("prepare", prepare, state, traj)
        ref = exp.policy.params if algo.uses_reference else None  # as `training.train_step`
        _, update_metrics = timed("update", exp.update, state, traj, k_update, ref)
        peaks["update"] = device_gb()

    forwards = phase_s["old_logprobs"] + phase_s.get("values", 0.0)
    phases = {"rollout": phase_s["rollout"], "old_logprobs": phase_s["old_logprobs"]}
    if "values" in phase_s:
        phases["values"] = phase_s["values"]
    phases["adv_filter"] = max(phase_s["prepare"] - forwards, 0.0)
    phases["ppo_updates"] = max(phase_s["update"] - phase_s["prepare"], 0.0)
    if exp.run.trainer.offload_state:
        phases["offload"] = offload_s
    total = phase_s["rollout"] + phase_s["update"] + phases.get("offload", 0.0)
    mini, k = UP.num_updates(algo, kept.tokens.shape[0])
    trained = int(jax.device_get(kept.valid.sum()))
    result = {
        "config": config_flags.get_config_filename(FLAGS["config"]), "model": exp.policy.source,
        "device": jax.devices()[0].device_kind, "devices": jax.device_count(),
        "episodes": int(traj.tokens.shape[0]), "kept_rows": int(kept.tokens.shape[0]),
        "context": r.max_context, "update_context": update_context, "updates_per_batch": k,
        "generated_tokens": int(summary["generated_tokens"]),
        "trained_tokens_per_pass": trained,
        "phase_s": {n: round(v, 2) for n, v in phases.items()},
        "phase_fraction": {n: round(v / total, 3) for n, v in phases.items()},
        "biggest_phase": max(phases, key=phases.get),
        "iteration_s": round(total, 2),
        "compile_s": {n: round(v, 1) for n, v in compile_s.items()},
        "build_s": round(build_s, 1),
        "rollout_new_tokens_per_s": round(summary["generated_tokens"] / phase_s["rollout"], 1),
        "success": round(summary["success"], 3),
        # the rollout against the memory-bandwidth bound of its decode steps
        "rollout_decode_bound": bound,
        "rollout_fraction_of_bound": (round(bound["bound_s"] / phase_s["rollout"], 3)
                                      if bound["bound_s"] else None),
        # sampler vs trainer over the same tokens (the update's first forward)
        "sampler_trainer": {n.split("/")[-1]: float(update_metrics[n]) for n in (
            "actor/sampler_logprob_abs_gap", "actor/sampler_logprob_max_abs_gap",
            "actor/sampler_kl")},
        # each phase's plan (starpo/memory.py) beside the device's measured peak so far (GB;
        # None on CPU): after the rollout, and after the update (the run's peak); the peak
        # once each program was compiled, before it ran; XLA's reservation for each program
        "memory_gb": {"plan": {p.name: round(p.total / 1e9, 2) for p in plan},
                      "peak_after": peaks, "in_use_before_compile": in_use_before_compile,
                      "peak_after_compile": compiled_peak, "xla_program": xla_gb},
        # what fit_memory chose for the device (or for --capacity_gb)
        "fit": {"capacity_gb": FLAGS.capacity_gb or None,
                "offload_state": exp.run.trainer.offload_state,
                "decode_windows": exp.run.rollout.decode_windows},
        "action_is_valid": round(summary["action_is_valid"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    common.run(main, config_flag=CONFIG)
