"""Supervised fine-tuning on solver demonstrations: the warm start before RL, and the paper's
SFT baseline.

    python launch/sft.py --config=configs/frozenlake.py:cpu --config.sft.steps=60   # SFT alone
    python launch/train.py --config=...  --config.sft.steps=60   # SFT into <workdir>/sft, then RL

One SFT step: `sft.env_groups` fresh training levels -> the solver plays them in the run's own
dialogue (`demos.make_demo_rollout`, on device) -> one AdamW update (learning rate `sft.lr`,
the algorithm's clipping, betas and weight decay) of the mean negative log-likelihood of the
demonstration's reply tokens (the model's tokens only: prompts and observations are context),
in micro-batches of `algorithm.micro_batch_size` rows. Levels the solver cannot solve from the
start have weight 0.

An SFT phase is a run of its own in its workdir (config.json, checkpoints/, metrics.jsonl, tb/),
so `launch/eval.py` and `launch/chat.py` take it like any run, and an interrupted phase resumes.
Its validation is the RL run's (`val.*`, sampled by the model), every `sft.test_freq` steps,
plus the solver's demonstrations of the same held-out levels scored teacher-forced:
`val/<tag>/demo_nll` per reply token and `val/<tag>/demo_accuracy`, the share of the solver's
replies the model's greedy answer would write exactly (what learning the map shows as, where
the slippery lake's success is mostly luck). Before the first step it also logs
`val/<tag>/solver_success`, the solver's own success on those levels through the same dialogue
(the ceiling SFT is measured against).
When `sft.steps > 0`, `training.train` runs the phase in `<workdir>/sft` first and starts RL
from its weights (the critic, a copy of the actor, from them too); a run whose RL phase has a
checkpoint skips it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
import optax

from starpo import config_check, demos, evaluate
from starpo import experiment as experiment_lib
from starpo import harness, lora, losses
from starpo import metrics as metrics_lib
from starpo import rollout as rollout_lib
from starpo import run_config, sharding
from starpo import update as update_lib
from starpo.trajectory import UpdateContexts, trimmed_length


@functools.lru_cache(maxsize=4)
def make_step(algo: run_config.AlgoConfig, cfg):
    """Jitted `step(state, traj, weight, positions=None)` -> (state, metrics): one AdamW update
    of the mean NLL of the weighted rows' reply tokens, summed over micro-batches. positions:
    `update.reply_positions` of the rows, where the output head runs (it then skips the prompt
    and observation tokens, most of a demonstration); None: everywhere."""
    tx = update_lib.make_optimizer(algo.actor_lr, algo)

    def nll(params, tokens, valid, mask, positions, *turns):
        # under a context window the demonstration is trained in the context the policy sees
        window = update_lib.turn_window(algo, turns[0]) if turns else None
        logp, _ = update_lib.token_logprobs(params, cfg, tokens, valid, algo.logit_chunk_size,
                                            window=window, positions=positions)
        return -jnp.sum(logp * mask)

    def step(state, traj, weight, positions=None):
        B, T = traj.tokens.shape
        valid = jnp.arange(T)[None] < traj.length[:, None]
        mask = traj.loss_mask.astype(jnp.float32) * weight[:, None]
        count = jnp.maximum(mask.sum(), 1.0)
        micro = min(algo.micro_batch_size, B)
        rows = (traj.tokens, valid, mask, positions) + (
            (traj.window_turns(),) if algo.context_window else ())
        parts = update_lib.micro_split(rows, micro)

        def accumulate(carry, xs):
            grads, total = carry
            loss, g = lora.value_and_grad(nll)(state.actor_params, *xs)
            return (jax.tree_util.tree_map(jnp.add, grads, g), total + loss), None

        zeros = jax.tree_util.tree_map(jnp.zeros_like, lora.split(state.actor_params)[0])
        (grads, total), _ = jax.lax.scan(accumulate, (zeros, jnp.float32(0.0)), parts)
        grads = jax.tree_util.tree_map(lambda g: g / count, grads)
        params, opt_state = lora.apply_updates(tx, state.actor_params, state.actor_opt_state,
                                               grads)
        state = state.replace(step=state.step + 1, actor_steps=state.actor_steps + 1,
                              actor_params=params, actor_opt_state=opt_state)
        return state, {"sft/loss": total / count, "sft/grad_norm": optax.global_norm(grads),
                       "sft/tokens": mask.sum(), "sft/rows": weight.sum()}

    return update_lib.jit_state_fn(step)  # donates the state (a LoRA base excepted)


@functools.lru_cache(maxsize=4)
def make_scorer(algo: run_config.AlgoConfig, cfg):
    """Jitted `score(params, traj, weight)` -> f32[4] (sums over the weighted rows): reply
    tokens' NLL, reply tokens, replies the model would write exactly, replies. A reply (one
    turn's model tokens) counts as written exactly when, teacher-forced in the demonstration's
    context, every one of its tokens is the model's most likely token: with one move a reply,
    the share of the solver's moves the model's greedy answer picks."""

    def one(params, turns, tokens, valid, mask, turn, weight, *wturns):
        window = update_lib.turn_window(algo, wturns[0]) if wturns else None

        def head(logits, y):
            logp, _ = losses.logprobs_and_entropy(logits, y)
            return logp, jnp.argmax(logits, axis=-1) == y

        logp, greedy = update_lib.per_token(params, cfg, tokens, valid, head,
                                            algo.logit_chunk_size, window)
        k = jnp.arange(turns)[None, :, None]
        reply = mask[:, None, :] & (turn[:, None, :] == k)  # [b, turns, T]
        played = reply.any(-1)
        exact = played & jnp.all(greedy[:, None, :] | ~reply, axis=-1)
        w = weight[:, None]
        return jnp.stack([-jnp.sum(logp * mask * w), jnp.sum(mask * w),
                          jnp.sum(exact * w), jnp.sum(played * w)])

    def score(params, traj, weight):
        B, T = traj.tokens.shape
        micro = max(d for d in range(1, min(algo.micro_batch_size, B) + 1) if B % d == 0)
        rows = (traj.tokens, traj.valid, traj.loss_mask, traj.turn_index, weight) + (
            (traj.window_turns(),) if algo.context_window else ())
        parts = update_lib.micro_split(rows, micro)
        turns = traj.turn_end.shape[1]
        return jax.lax.map(lambda xs: one(params, turns, *xs), parts).sum(0)

    return jax.jit(score)


@dataclasses.dataclass
class Phase:
    """What an SFT phase builds once (beside the run's Experiment)."""

    algo: run_config.AlgoConfig
    # jitted steps int32[K] -> (traj, metrics, weight), each with a leading [K] axis: the
    # solver's demonstrations of those SFT steps (each on its sft.env_groups levels)
    demos: object
    # K: the steps played at once (`sft.demo_steps`, or the phase's steps if fewer). A step's
    # demonstrations are the same numbers either way (its levels and key are its own), but
    # one call of many rows costs an accelerator little more than one of a step's rows (the
    # solver's episodes are many small kernels: on one H100 a step's demonstrations took
    # 0.11 s of its 0.24 s, docs/results.md). A CPU computes them, and saves nothing (16 lake
    # steps of 32: 13.7 s in one call, 11.9 s a call a step). `timing/demos` is the call's
    # on the first of its steps, ~0 on the others
    demo_steps: int
    step: object
    shardings: object  # the TrainState's shardings
    init: object  # jitted params -> TrainState
    scorer: object  # `make_scorer`: the held-out demonstrations' scores
    val_demos: dict | None = None  # `val_demos`, played at the first validation
    contexts: UpdateContexts | None = None  # the steps' update contexts (`run` sets it)
    played: tuple | None = None  # (first step, `demos` of steps first .. first + K - 1)

    def demos_of(self, step: int):
        """(traj, metrics, weight) of SFT step `step`'s demonstrations: from the call that
        played its K steps (first a multiple of K), made when a step first needs it."""
        K = self.demo_steps
        first = step - step % K
        if self.played is None or self.played[0] != first:
            self.played = (first, self.demos(jnp.arange(first, first + K, dtype=jnp.int32)))
        return _pick(self.played[1], jnp.int32(step - first))


@jax.jit
def _pick(tree, i):
    """Row i of every leaf of `tree`, in one call (not one dispatch a leaf)."""
    return jax.tree_util.tree_map(lambda x: x[i], tree)


def build(spec: run_config.RunSpec, exp) -> Phase:
    """The SFT phase of `spec` (a `run_config.read`) over `exp` (an `experiment.build` of it)."""
    config_check.check_sft(spec.config, exp.env)
    algo = spec.sft.algo
    demo = demos.make_demo_rollout(exp.env, exp.policy.tokenizer, spec.rollout,
                                   spec.sft.actions_per_turn)
    G, env, seed = spec.sft.env_groups, exp.env, spec.seed

    def step_demos(step):  # SFT step `step`'s levels (seeds step * G ..) and demonstrations
        env_state, _ = rollout_lib.initial_states(env, jax.random.key(seed), step * G,
                                                  rollout_lib.TRAIN, G, 1)
        return demo(env_state, jax.random.fold_in(jax.random.key(seed), step))

    cfg = exp.policy.cfg.replace(dtype=spec.model.dtypes["update"])
    shardings = update_lib.state_shardings(algo, exp.mesh, exp.policy.cfg)
    init = update_lib.make_init(algo, shardings)
    return Phase(algo, jax.jit(jax.vmap(step_demos)), max(1, min(spec.sft.demo_steps,
                                                                  spec.sft.steps)),
                 make_step(algo, cfg), shardings, init, make_scorer(algo, cfg))


def val_demos(exp, spec: run_config.RunSpec) -> dict:
    """{tag: (Trajectory, metrics, weight)}: the solver's episodes of each validation set's
    levels through the run's dialogue (tags without a solver are left out)."""
    out = {}
    for tag, vs in exp.val_sets.items():
        try:
            demo = demos.make_demo_rollout(vs.env, exp.policy.tokenizer, spec.rollout,
                                           spec.sft.actions_per_turn)
        except ValueError:
            continue
        out[tag] = demo(vs.env_state, jax.random.key(0))
    return out


def constant_accuracy(traj, weight) -> float:
    """The weighted share of the demonstrations' replies that are their most common reply:
    the `demo_accuracy` of a model that answers that reply every turn, blind to the state."""
    traj, weight = sharding.to_host((traj, weight))
    counts: dict = {}
    for b in range(traj.tokens.shape[0]):
        for k in range(traj.turn_end.shape[1]):
            reply = traj.tokens[b][traj.loss_mask[b] & (traj.turn_index[b] == k)]
            if len(reply):
                key = tuple(reply.tolist())
                counts[key] = counts.get(key, 0.0) + float(weight[b])
    total = sum(counts.values())
    return max(counts.values()) / total if total else 0.0


def demo_validation(phase: Phase, exp, params, *, solver: bool = False) -> dict[str, float]:
    """The held-out demonstrations' scores under `params`, per validation tag with a solver:
    val/<tag>/demo_nll (per reply token) and val/<tag>/demo_accuracy (the share of replies
    the model would write exactly: `make_scorer`); with `solver`, also
    val/<tag>/solver_success, the solver's own success on those levels (SFT's ceiling), and
    val/<tag>/demo_constant, the demo_accuracy of the best state-blind constant reply."""
    if phase.val_demos is None:
        phase.val_demos = val_demos(exp, exp.run)
    out = {}
    for tag, (traj, m, weight) in phase.val_demos.items():
        vs = exp.val_sets[tag]
        if solver:
            out[f"val/{tag}/solver_success"] = evaluate.summarize(traj, m, vs.group_size)[
                "success"]
            out[f"val/{tag}/demo_constant"] = constant_accuracy(traj, weight)
        lengths = sharding.to_host(traj.length)
        trained = trimmed_length(int(lengths.max()), traj.tokens.shape[1],
                                 exp.run.trainer.context_bucket)
        nll, tokens, exact, replies = (float(x) for x in sharding.to_host(
            phase.scorer(params, traj.truncate(trained), weight)))
        out[f"val/{tag}/demo_nll"] = nll / max(tokens, 1.0)
        out[f"val/{tag}/demo_accuracy"] = exact / max(replies, 1.0)
    return out


def train_step(phase: Phase, exp, state, step: int):
    """One SFT step on the levels of seeds step * sft.env_groups ..: (state, scalars)."""
    spec = exp.run
    t0 = time.perf_counter()
    traj, m, weight = phase.demos_of(step)
    lengths = sharding.to_host(traj.length)
    if phase.contexts is None:
        phase.contexts = UpdateContexts(spec.trainer.context_bucket)
    trained = phase.contexts(int(lengths.max()), traj.tokens.shape[1])
    traj = traj.truncate(trained)
    positions = update_lib.reply_positions(traj.loss_mask, update_lib.reply_count(
        traj.loss_mask))
    t1 = time.perf_counter()
    state, um = phase.step(state, traj, weight, positions)
    out = {k: float(v) for k, v in sharding.to_host(um).items()}
    demo_stats = evaluate.summarize(traj, m, 1)
    out.update({"sft/demo_success": demo_stats["success"],
                "sft/demo_response_length": demo_stats["response_length"],
                "timing/demos": t1 - t0, "timing/update": time.perf_counter() - t1,
                "timing/step": time.perf_counter() - t0,
                "perf/update_tokens_per_s": float(lengths.sum()) / (time.perf_counter() - t1)})
    return state, out


def summary_line(n: int, total: int, s: dict) -> str:
    parts = [f"sft {n}/{total}", f"loss {s['sft/loss']:.4f}" if "sft/loss" in s else ""]
    for k, v in s.items():
        if k.startswith("val/") and k.split("/")[-1] in ("success", "action_is_valid",
                                                         "solver_success", "demo_accuracy"):
            parts.append(f"{k} {v:.3f}")
    if "timing/step" in s:
        parts.append(f"{s['timing/step']:.1f} s")
    return " | ".join(p for p in parts if p)


def run(spec: run_config.RunSpec, workdir: str, exp, phase: Phase, *, progress: bool = True,
        log=metrics_lib.say, stop_after: int | None = None):
    """Run (or resume, or find finished) the SFT phase `phase` (a `build(spec, exp)`) in
    `workdir`; returns the trained actor params, or None after `stop_after` steps of this call
    (checkpoint saved). Raises `harness.Stopped` on SIGTERM / Ctrl-C (checkpoint saved)."""
    total, s = spec.sft.steps, spec.sft
    log, progress = harness.lead_only(log, progress)
    resuming = harness.check_workdir(workdir, spec.config)
    ckpt = harness.open_checkpoints(workdir, spec.trainer.keep_checkpoints)
    if not resuming and jax.process_index() == 0:
        harness.write_config(workdir, spec.config)
    state, start, contexts = _resume(phase, exp, ckpt, resuming)
    phase.contexts = UpdateContexts(spec.trainer.context_bucket, state=contexts)
    if start >= total:
        log(f"sft: {workdir} finished ({start} steps)")
        ckpt.close()
        return state.actor_params
    log(f"sft: {total} steps of {s.env_groups} solver demonstrations in {workdir}"
        + (f" (resuming from step {start})" if start else ""))
    writer = harness.metrics_writer(workdir, start)
    with harness.Stop() as stop:
        if start == 0 and spec.val.before_train:
            scalars = {**demo_validation(phase, exp, state.actor_params, solver=True),
                       **experiment_lib.validate(exp, state.actor_params, writer, 0)}
            writer.write(0, scalars)
            log(summary_line(0, total, scalars))
        bar = metrics_lib.Progress(start, total, "sft", show=progress, log=log)
        done_here, n, stoppers = 0, start, []
        for step in bar:
            state, scalars = train_step(phase, exp, state, step)
            n = step + 1
            f = s.test_freq
            if (f > 0 and n % f == 0) or (n == total and f > 0):
                scalars.update(experiment_lib.validate(exp, state.actor_params, writer, n))
                scalars.update(demo_validation(phase, exp, state.actor_params))
            writer.write(n, scalars)
            bar.write(summary_line(n, total, scalars))
            done_here += 1
            stoppers = harness.asked_to_stop(stop)
            end = n == total or bool(stoppers) or (stop_after is not None
                                                   and done_here >= stop_after)
            if end or (s.save_freq > 0 and n % s.save_freq == 0):
                _save(ckpt, spec.config, n, state, phase.contexts)
            if end:
                break
        bar.close()
    writer.close()
    ckpt.close()
    harness.raise_if_stopped(stoppers, n, total, "SFT step")
    return state.actor_params if n >= total else None


def _resume(phase: Phase, exp, ckpt, resuming: bool):
    """(state, first step, `UpdateContexts` state): the phase's latest checkpoint's, or a
    fresh state at step 0."""
    if not (resuming and ckpt.latest_step() is not None):
        return phase.init(exp.policy.params), 0, None
    target = harness.restore_target(jax.eval_shape(lambda: phase.init(exp.policy.params)),
                                    phase.shardings)
    state, meta = ckpt.restore(None, update_lib.split_state(target)[0])
    state = update_lib.join_state(state, (lora.split(exp.policy.params)[1], None))
    return state, int(meta["step"]), meta.get("update_contexts")


def _save(ckpt, config, step: int, state, contexts: UpdateContexts) -> None:
    saved = update_lib.split_state(state)[0]  # a LoRA base is not saved: it is model.path's
    ckpt.save(step, saved, {"step": step, "seed": config.seed, "phase": "sft",
                            "config": json.loads(harness.config_json(config)),
                            "update_contexts": contexts.state_dict()})


def train_only(config, workdir: str, *, progress: bool = True, log=metrics_lib.say):
    """`launch/sft.py`: check, build and run the SFT phase of `config` alone in `workdir`
    (the paper's SFT baseline; evaluate it with launch/eval.py)."""
    config_check.check(config)
    if config.sft.steps <= 0:
        raise run_config.ConfigError("sft.steps must be > 0 for an SFT run, got "
                                     f"{config.sft.steps}")
    harness.check_workdir(workdir, config)
    t0 = time.perf_counter()
    spec = run_config.read(config)
    exp = experiment_lib.build(spec)
    harness.memory_plan(exp, log, sft=True)  # its own phases: no sampled batch, no critic
    phase = build(spec, exp)
    with jax.set_mesh(exp.mesh):
        if jax.process_index() == 0:
            harness.log_start(exp, time.perf_counter() - t0, log)
        return run(spec, workdir, exp, phase, progress=progress, log=log)
