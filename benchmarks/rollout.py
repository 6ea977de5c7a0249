"""Full multi-turn rollout throughput vs the sampler alone; cost of env + render + parse.

  python -m benchmarks.rollout --model=smollm2-135m-instruct --env=FrozenLake --groups=8 \\
      --group_size=8 --turns=5 --new_tokens=100

Three timings (median of --repeats calls after compiling ahead of time):
- rollout: `make_rollout(...).run` (sampling at temperature 1, thinking on);
- sampler: the same sampler on the same batch, shapes and turn count, fed a fixed observation
  chunk each turn with every row active (no env, no parse, no render);
- scripted: the rollout with teacher-forced replies of `new_tokens` tokens and no model, i.e.
  the env steps, rendering, parsing and bookkeeping alone.
Overhead = scripted time / rollout time (the rollout's non-model work; target < 10%).
With --lora_rank=R the rollout is also timed with fresh LoRA adapters of rank R on every linear
projection (the same samples: fresh adapters change nothing), sampled the two ways
`rollout.make_mixed_rollout` can: merged into the weights once per call (the default) and
through the adapters at every token (`lora_merged_s`, `lora_adapter_s` beside `rollout_s`).
The last line printed is one JSON object.

Run from the repository root: `python -m` puts it on the import path.
"""

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import envs
from starpo import lora, precision, rollout, sampler, scripted, weights


def timed(f, args_of, repeats):
    """(compile seconds, median seconds of `repeats` calls, last output). A jitted `f` is
    compiled ahead of time (no untimed run); anything else is called once first."""
    t = time.perf_counter()
    if hasattr(f, "lower"):
        f = f.lower(*args_of(0)).compile()
        out = None
    else:
        out = jax.block_until_ready(f(*args_of(0)))
    first = time.perf_counter() - t
    times = []
    for i in range(repeats):
        t = time.perf_counter()
        out = jax.block_until_ready(f(*args_of(i + 1)))
        times.append(time.perf_counter() - t)
    return first, statistics.median(times), out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--env", default="FrozenLake")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--new_tokens", type=int, default=100)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode_windows", type=int, default=4, help="as rollout.decode_windows")
    p.add_argument("--lora_rank", type=int, default=0,
                   help="also time the rollout of a LoRA model, merged and through adapters")
    p.add_argument("--parts", default="rollout,sampler,scripted",
                   help="which timings to take (comma-separated), e.g. scripted alone")
    a = p.parse_args()
    parts = set(a.parts.split(","))
    if not parts or parts - {"rollout", "sampler", "scripted"}:
        raise SystemExit(f"error: --parts takes rollout, sampler, scripted; got {a.parts!r}")

    m = weights.load_model(a.model)
    env = envs.make(a.env)
    B = a.groups * a.group_size
    spec = rollout.RolloutSpec(max_turn=a.turns, max_new_tokens=a.new_tokens,
                               max_context=a.context, prefill_dtype=precision.compute_bound_dtype(),
                               decode_windows=a.decode_windows)
    r = rollout.make_rollout(env, m.tokenizer, m.cfg, spec, env_groups=a.groups,
                             group_size=a.group_size)
    temp = jnp.float32(1.0)
    out = {
        "device": jax.devices()[0].device_kind, "model": a.model, "env": a.env, "batch": B,
        "turns": a.turns, "new_tokens": a.new_tokens, "context": a.context,
        "decode_windows": a.decode_windows}
    if "rollout" in parts:
        c_roll, t_roll, (traj, metrics) = timed(
            r.run, lambda i: (m.params, jax.random.key(i), jnp.int32(i * a.groups), temp,
                              jnp.int32(rollout.TRAIN)), a.repeats)
        traj, metrics = jax.device_get((traj, metrics))
        generated = int(traj.loss_mask.sum())
        out.update({
            "rollout_s": t_roll, "rollout_compile_s": c_roll,
            "episodes_per_s": B / t_roll, "generated_tokens_per_s": generated / t_roll,
            "context_tokens_per_s": int(traj.length.sum()) / t_roll,
            "generated_tokens": generated, "mean_turns": float(metrics["num_turns"].mean()),
            "truncated": int(metrics["truncated"].sum())})
        print(f"rollout: compile {c_roll:.1f}s, then {t_roll:.2f}s, {generated} tokens",
              file=sys.stderr, flush=True)
    if "rollout" in parts and a.lora_rank > 0:
        lcfg, lparams = lora.attach(m.cfg, m.params, a.lora_rank, a.lora_rank, "all-linear",
                                    jax.random.key(0))
        for name, merge in (("merged", True), ("adapter", False)):
            lr = rollout.make_mixed_rollout(((env, a.groups),), m.tokenizer, lcfg, spec,
                                            group_size=a.group_size, merge_adapters=merge)
            c, t, (ltraj, _) = timed(lr.run, lambda i: (lparams, jax.random.key(i),
                                                         jnp.int32(i * a.groups), temp,
                                                         jnp.int32(rollout.TRAIN)), a.repeats)
            same = bool(jnp.array_equal(ltraj.tokens, jnp.asarray(traj.tokens)))
            out.update({f"lora_{name}_s": t, f"lora_{name}_compile_s": c,
                        f"lora_{name}_over_rollout": t / t_roll,
                        f"lora_{name}_same_tokens": same})
            print(f"rollout with LoRA rank {a.lora_rank}, {name}: {t:.2f}s (same tokens as "
                  f"the base model: {same})", file=sys.stderr, flush=True)

    # ---- the sampler alone: prefix once, then `turns` turns of a fixed observation chunk
    tables = r.tables
    ids = tables.ids
    prefix = np.concatenate([tables.tokens[i, :tables.lengths[i]] for i in (ids["start"], ids["prefix"])])
    obs = np.concatenate([tables.tokens[i, :tables.lengths[i]]
                          for i in (ids["header1"][1], *([tables.env_offset] * r.text.width),
                                    ids["left"][5], ids["gen"])])
    stop_table = tuple(jnp.asarray(x) for x in sampler.byte_table(m.tokenizer.token_bytes()))
    smp = r.sampler

    @jax.jit
    def sampler_only(params, key):
        st = sampler.init_state(m.cfg, B, a.context)
        pre = jnp.broadcast_to(jnp.asarray(prefix, jnp.int32), (B, len(prefix)))
        st, pre = jax.lax.optimization_barrier((st, pre))
        st = rollout.append_without_reply(m.cfg.replace(dtype=precision.compute_bound_dtype()),
                                          params, st, pre)
        chunk = jnp.broadcast_to(jnp.asarray(obs, jnp.int32), (B, len(obs)))
        total = jnp.zeros((), jnp.int32)
        for k in range(a.turns):
            st, turn = sampler.run_turn(smp, params, st, chunk, jnp.ones(chunk.shape, bool),
                                        jax.random.fold_in(key, k), temp, jnp.ones((B,), bool),
                                        stop_table)
            total += turn.length.sum()
        return total

    if "sampler" in parts:
        c_smp, t_smp, smp_tokens = timed(sampler_only, lambda i: (m.params, jax.random.key(i)),
                                         a.repeats)
        out.update({"sampler_s": t_smp, "sampler_generated_tokens": int(smp_tokens),
                    "sampler_generated_tokens_per_s": int(smp_tokens) / t_smp})
        print(f"sampler: compile {c_smp:.1f}s, then {t_smp:.2f}s, {int(smp_tokens)} tokens",
              file=sys.stderr, flush=True)

    # ---- env + render + parse alone: teacher-forced replies of new_tokens tokens, no model
    play, _ = rollout.make_scripted_rollout(env, m.tokenizer, spec)
    filler = "I think about the map and then decide where to go next. " * 20
    reply = m.tokenizer.decode(m.tokenizer.encode(filler)[:a.new_tokens - 12]) + \
        "</think><answer>Left || Up</answer>"
    rids, rlen, rstop = scripted.script_replies(m.tokenizer, [[reply] * a.turns] * B, a.turns,
                                                a.new_tokens)
    states, _ = jax.jit(lambda: rollout.initial_states(env, jax.random.key(0), 0, 0, a.groups,
                                                       a.group_size))()
    if "scripted" in parts:
        c_scr, t_scr, _ = timed(play, lambda i: (states, rids, rlen, rstop, jax.random.key(i)),
                                a.repeats)
        out["scripted_s"] = t_scr
        print(f"scripted: {t_scr:.3f}s", file=sys.stderr, flush=True)
        if "rollout" in parts:
            out["overhead_fraction"] = t_scr / out["rollout_s"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
