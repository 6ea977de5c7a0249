"""Play one episode through the on-device rollout, with replies from stdin or from a model.

  python launch/play.py --env=SimpleSokoban --level-file=level.txt < replies.txt
  python launch/play.py --env=FrozenLake --seed=3 --model=smollm2-135m-instruct
  python launch/play.py --config=configs/frozenlake.py:cpu --seed=3 --model=runs/x/export

Each stdin line is one assistant reply: the text after the `<think>` priming, with a literal
`\\n` standing for a newline (one line per turn; when they run out the episode stops after
showing the next observation). Prints the dialogue exactly as the model sees it (chat
template and special tokens included), each turn's reward, and as the last line a JSON object
with `turn_rewards`, `penalty`, `success`, `num_actions` and the rollout's per-episode metrics.
"""

import json
import os
import sys

if not __package__:  # run as a file from a checkout: launch/_checkout.py puts its root first
    import _checkout  # noqa: F401

from absl import flags  # noqa: E402

from launch import common  # noqa: E402

flags.DEFINE_string("env", "SimpleSokoban", "Env variant (envs.NAMES).")
CONFIG = common.define_config("Optional config (configs/*.py[:variant]): its env (with options) and "
                              "rollout settings, unless the flags below are given.")
flags.DEFINE_integer("seed", 0, "Level seed (ignored with --level-file).")
flags.DEFINE_string("level-file", None, "Starting state in the env's text form.")
flags.DEFINE_string("model", None, "Let this model play instead of reading replies from stdin.")
flags.DEFINE_string("tokenizer", "smollm2-135m-instruct",
                    "Model whose tokenizer and chat template render the dialogue (stdin replies).")
flags.DEFINE_integer("max_turn", 5, "Most turns.", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 100, "Reply budget per turn in tokens.", lower_bound=1)
flags.DEFINE_integer("max_context", 4096, "Context length in tokens.", lower_bound=16)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature with --model (0 = greedy).",
                   lower_bound=0.0)
flags.DEFINE_bool("thinking", True, "Prime replies with <think> (else <answer>).")
FLAGS = flags.FLAGS


def initial_state(env, level_file, seed):
    """(state, description) from a level file or a seed (training stream)."""
    import jax

    from starpo import rollout

    if level_file:
        if not os.path.isfile(level_file):
            raise FileNotFoundError(f"level file {level_file} not found")
        with open(level_file, encoding="utf-8") as f:
            return env.from_text(f.read())
    states, _ = rollout.initial_states(env, jax.random.key(0), seed, rollout.TRAIN, 1, 1)
    return jax.tree_util.tree_map(lambda x: x[0], states)


def play_scripted(env, tokenizer, state, replies, spec):
    """One episode with the given reply texts (settings: a `rollout.RolloutSpec`).
    -> (dialogue text, result dict)."""
    import jax

    from starpo import rollout, scripted

    if not replies:
        raise ValueError("no replies on stdin (one line per turn)")
    for i, r in enumerate(replies):
        if not tokenizer.encode(r):
            raise ValueError(f"reply {i + 1} is empty")
    if len(replies) > spec.max_turn:
        raise ValueError(f"{len(replies)} replies for at most {spec.max_turn} turns")
    play, _ = rollout.make_scripted_rollout(env, tokenizer, spec)
    ids, lens, stops = scripted.script_replies(tokenizer, [replies], spec.max_turn,
                                               spec.max_new_tokens)
    batched = jax.tree_util.tree_map(lambda x: x[None], state)
    traj, metrics, _ = play(batched, ids, lens, stops, jax.random.key(0))
    return describe(tokenizer, traj, metrics)


def play_model(env, model, state, spec, *, temperature=0.0, seed=0):
    """One episode of `model` (settings: a `rollout.RolloutSpec`). -> (dialogue text, result
    dict)."""
    import jax
    import jax.numpy as jnp

    from starpo import rollout

    r = rollout.make_rollout(env, model.tokenizer, model.cfg, spec, env_groups=1, group_size=1)
    batched = jax.tree_util.tree_map(lambda x: x[None], state)
    traj, metrics = r.run_from(model.params, jax.random.key(seed), batched,
                               jnp.zeros((1,), jnp.int32), jnp.float32(temperature))
    return describe(model.tokenizer, traj, metrics)


def describe(tokenizer, traj, metrics):
    """(dialogue text, result dict) of row 0."""
    import jax
    import numpy as np

    t, m = jax.device_get((traj, metrics))
    n = int(t.length[0])
    text = tokenizer.decode(np.asarray(t.tokens[0, :n]).tolist())
    turns = int((t.turn_end[0] >= 0).sum())
    result = {
        "turn_rewards": [round(float(r), 4) for r in t.turn_reward[0, :turns]],
        "penalty": round(float(t.penalty[0]), 4),
        "success": bool(t.success[0]),
        "num_actions": int(t.num_actions[0]),
        **{k: (v[0].item() if k != "truncated" else bool(v[0])) for k, v in m.items()},
    }
    for k in ("action_is_valid", "action_is_effective"):
        result[k] = round(result[k], 6)
    return text, result


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    import envs
    from starpo import dialogue, rollout, weights

    settings = dict(max_turn=FLAGS.max_turn, max_new_tokens=FLAGS.max_new_tokens,
                    max_context=FLAGS.max_context, thinking=FLAGS.thinking)
    if FLAGS["config"].present:
        from starpo import run_config

        config = CONFIG.value
        env = run_config.make_env(config, config.env.name)
        r = config.rollout
        from_config = dict(max_turn=r.max_turn, max_new_tokens=r.response_length,
                           max_context=r.max_context, thinking=r.enable_think)
        settings.update({k: v for k, v in from_config.items() if not FLAGS[k].present})
    else:
        env = envs.make(FLAGS.env)
    state = initial_state(env, FLAGS["level-file"].value, FLAGS.seed)
    spec = rollout.RolloutSpec(**settings)
    if FLAGS.model:
        model = weights.load_model(FLAGS.model)
        text, result = play_model(env, model, state, spec, temperature=FLAGS.temperature,
                                  seed=FLAGS.seed)
    else:
        replies = [line.rstrip("\r\n").replace("\\n", "\n") for line in sys.stdin]
        tokenizer = weights.load_model(FLAGS.tokenizer).tokenizer
        text, result = play_scripted(env, tokenizer, state, replies, spec)
    print(text)
    print()
    for k, r in enumerate(result["turn_rewards"]):
        print(f"turn {k + 1} reward: {dialogue.short_decimal(r)}")
    print(json.dumps(result))


def cli():
    """The `starpo-play` command (pyproject.toml)."""
    common.run(main, config_flag=CONFIG)


if __name__ == "__main__":
    cli()
