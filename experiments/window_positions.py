"""Does the context window's position gap change a policy's log-probs? (issue 37, item 4)

    python -m experiments.window_positions --run=runs/frozenlake_tiny --window=1 --levels=128

Under `context_window_mode=limited` / `single_turn` the KV cache is kept and evicted turns are
masked out, so the kept tokens keep their rotary positions: a gap stands where the evicted turns
were. RAGEN-2 re-renders the prompt instead, so the same kept tokens sit at contiguous positions.
This plays the run's validation levels with a window of --window turns (the sampler's own
log-probs, gap and all), then scores each reply of a turn that lost earlier turns again in a
forward over exactly the tokens that turn could see (prefix and kept turns), renumbered from 0.
It prints the per-token difference of the two log-probs (mean |diff|, largest |diff|, and the k3
KL estimate per token), and as a control the same comparison for turns that lost nothing (there
the two sequences are equal, so the difference is float rounding).
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from starpo import cli, experiment, rollout, run_config
from starpo import update as update_lib

flags.DEFINE_string("run", None, "A training workdir (its latest checkpoint).", required=True)
flags.DEFINE_integer("window", 1, "Turns a reply sees besides the prompt prefix (>= 1).",
                     lower_bound=1)
flags.DEFINE_integer("levels", 128, "Validation levels played, one episode each.",
                     lower_bound=1)
flags.DEFINE_float("temperature", 1.0, "Sampling temperature.", lower_bound=0.0)
FLAGS = flags.FLAGS


def gap_sets(traj, window: int):
    """Per row, per turn q that has a reply: (positions the reply's tokens sit at, positions the
    turn could see: the prefix and turns q-window+1 .. q up to the reply's end, in order, and
    whether any turn was evicted before q)."""
    model_tokens, turns = np.asarray(traj.loss_mask), np.asarray(traj.turn_index)
    prefix, length = np.asarray(traj.prefix_length), np.asarray(traj.length)
    out = []
    for b in range(model_tokens.shape[0]):
        turn = turns[b]
        for q in range(turn.max() + 1):
            reply = np.flatnonzero(model_tokens[b] & (turn == q)
                                   & (np.arange(len(turn)) < length[b]))
            if reply.size == 0:
                continue
            end = reply[-1] + 1
            idx = np.arange(end)
            seen = (idx < prefix[b]) | ((turn[:end] > q - window) & (turn[:end] <= q)
                                        & (idx >= prefix[b]))
            out.append((b, reply, np.flatnonzero(seen), q >= window and q > 0))
    return out


def main(argv):
    del argv
    config, policy, step = experiment.load_run(FLAGS.run)
    cfg, params = policy.cfg, policy.params
    spec = dataclasses.replace(run_config.rollout_spec(config), context_window=FLAGS.window)
    env = run_config.make_env(config, config.env.name)
    ro = rollout.make_rollout(env, policy.tokenizer, cfg, spec, env_groups=FLAGS.levels,
                              group_size=1)
    traj, _ = jax.device_get(ro.run(params, jax.random.key(0), jnp.int32(0),
                                    jnp.float32(FLAGS.temperature),
                                    jnp.int32(rollout.VALIDATION)))
    sets = gap_sets(traj, FLAGS.window)
    L = max(len(s) for _, _, s, _ in sets)
    rows = np.zeros((len(sets), L), np.int32)
    valid = np.zeros((len(sets), L), bool)
    for i, (b, _, seen, _) in enumerate(sets):
        rows[i, :len(seen)] = np.asarray(traj.tokens)[b, seen]
        valid[i, :len(seen)] = True
    logp, _ = jax.jit(lambda t, v: update_lib.token_logprobs(
        params, cfg, t, v, 0, FLAGS.temperature))(jnp.asarray(rows), jnp.asarray(valid))
    logp = np.asarray(logp, np.float64)
    sampled = np.asarray(traj.sample_logprobs, np.float64)
    diffs = {True: [], False: []}
    for i, (b, reply, seen, evicted) in enumerate(sets):
        where = np.searchsorted(seen, reply)  # the reply's places in the renumbered sequence
        diffs[evicted] += list(logp[i, where] - sampled[b, reply])
    out = {"run": FLAGS.run, "step": step, "model": policy.source,
           "window": FLAGS.window, "levels": FLAGS.levels, "temperature": FLAGS.temperature}
    for evicted, name in ((True, "turns with evicted turns"), (False, "control: nothing evicted")):
        d = np.asarray(diffs[evicted])
        out[name] = None if d.size == 0 else {
            "reply_tokens": int(d.size), "mean_abs_diff": float(np.abs(d).mean()),
            "max_abs_diff": float(np.abs(d).max()),
            "k3_kl_per_token": float(np.mean(np.expm1(d) - d))}
        print(f"{name}: {out[name]}")
    print(json.dumps(out))


if __name__ == "__main__":
    cli.run(main)  # a bad flag or run: one line `error: ...`
