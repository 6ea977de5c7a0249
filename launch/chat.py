"""Chat with a model from the command line; prints only the reply.

  python launch/chat.py --model=smollm2-135m-instruct --prompt="What is 2+2?" --temperature=0
"""

import sys
import time

if not __package__:  # run as a file from a checkout: launch/_checkout.py puts its root first
    import _checkout  # noqa: F401

from absl import flags  # noqa: E402

from launch import common  # noqa: E402

flags.DEFINE_string("model", "smollm2-135m-instruct", "Model name, HF directory or .gguf file.")
flags.DEFINE_string("prompt", None, "The user message.", required=True)
flags.DEFINE_string("system", None, "Optional system message.")
flags.DEFINE_integer("max_new_tokens", 128, "Most tokens to generate.", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.", lower_bound=0.0)
flags.DEFINE_integer("seed", 0, "PRNG seed for sampling.")
flags.DEFINE_bool("stats", False, "Print load time and tokens/s to stderr.")
FLAGS = flags.FLAGS


def main(_):
    import jax
    import jax.numpy as jnp

    from starpo import sampler, weights

    if not FLAGS.prompt.strip():
        raise ValueError("--prompt is empty; give the user message")
    weights.model_kind(FLAGS.model)  # a bad name or file fails before anything loads
    t0 = time.perf_counter()
    m = weights.load_model(FLAGS.model)
    messages = ([{"role": "system", "content": FLAGS.system}] if FLAGS.system else []) + [
        {"role": "user", "content": FLAGS.prompt}]
    ids = m.tokenizer.encode(m.tokenizer.apply_chat_template(messages))
    limit = m.cfg.max_position_embeddings  # the cache holds prompt and reply
    if len(ids) + FLAGS.max_new_tokens > limit:
        raise ValueError(f"--max_new_tokens {FLAGS.max_new_tokens} and the prompt's {len(ids)} "
                         f"tokens exceed the model's {limit} positions; use at most "
                         f"{max(limit - len(ids), 0)}")
    prompt = jnp.asarray([ids], jnp.int32)
    s = sampler.make_sampler(m.cfg, m.tokenizer, FLAGS.max_new_tokens)
    state = sampler.init_state(m.cfg, 1, len(ids) + FLAGS.max_new_tokens)
    args = (m.params, state, prompt, prompt >= 0, jax.random.key(FLAGS.seed),
            jnp.float32(FLAGS.temperature), jnp.ones((1,), bool), None)
    t1 = time.perf_counter()
    turn = sampler.run_turn.lower(s, *args).compile()
    t2 = time.perf_counter()
    _, out = turn(*args)
    n = int(out.length[0])
    t3 = time.perf_counter()
    print(m.tokenizer.decode(out.tokens[0, :n].tolist(), skip_special_tokens=True).strip())
    if FLAGS.stats:
        print(f"load {t1 - t0:.1f}s, compile {t2 - t1:.1f}s, {n} tokens in {t3 - t2:.2f}s = "
              f"{n / (t3 - t2):.1f} tokens/s (prefill included)", file=sys.stderr)


def cli():
    """The `starpo-chat` command (pyproject.toml)."""
    common.run(main)


if __name__ == "__main__":
    cli()
