"""How big a config's training rollout program is, and which source lines make it big:

    python -m tests.program_size configs/sudoku.py:tiny [--top=25]

Builds the config's experiment, lowers the training batch's rollout (one chunk), counts its
StableHLO ops by the line of Python that emitted them and compiles it once (no persistent
cache), then prints the compile seconds, the op count and the lines with the most ops. Most of
the suite's time is XLA compiling rollouts; a line that emits hundreds of ops is usually a
Python loop over slices or an integer power of a traced array (`10 ** jnp.arange(k)`), and
vectorising it shortens every compile of every program that contains it.
"""

import argparse
import collections
import importlib
import os
import re
import sys
import time


def op_lines(text: str) -> collections.Counter:
    """(file, line) -> ops, from StableHLO text printed with debug info."""
    locs = {}
    for name, rest in re.findall(r"^(#loc\d+) = loc\((.*)\)$", text, re.M):
        m = re.search(r'"([^"]+\.py)":(\d+)', rest)
        locs[name] = (os.path.relpath(m.group(1)), int(m.group(2))) if m else \
            re.findall(r"#loc\d+", rest)

    def resolve(name, depth=0):
        v = locs.get(name)
        if isinstance(v, tuple) or v is None or depth > 8:
            return v
        for inner in v:  # a call site or fused location: its first file location
            found = resolve(inner, depth + 1)
            if isinstance(found, tuple):
                return found
        return None

    counts = collections.Counter()
    for name in re.findall(r"loc\((#loc\d+)\)\s*$", text, re.M):
        where = resolve(name)
        if where is not None and not where[0].endswith("program_size.py"):  # the call itself
            counts[where] += 1
    return counts


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="path[:variant], e.g. configs/bandit.py:tiny")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    import jax
    import jax.numpy as jnp

    from starpo import experiment

    path, _, variant = a.config.partition(":")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    exp = experiment.build(module.get_config(variant or None))
    states, group_id = exp.initial_states(jax.random.key(0), jnp.int32(0))
    chunk = exp.run.batch.chunk
    lowered = exp.run_chunk.lower(exp.policy.params, jax.random.key(1),
                                  *jax.tree_util.tree_map(lambda x: x[:chunk], (states, group_id)),
                                  jnp.float32(1.0))
    counts = op_lines(lowered.as_text(debug_info=True))
    t = time.perf_counter()
    lowered.compile()
    seconds = time.perf_counter() - t
    print(f"{a.config}: rollout of {chunk} episodes, {sum(counts.values())} ops, "
          f"compiled in {seconds:.1f} s")
    for (file, line), n in counts.most_common(a.top):
        print(f"{n:6d}  {file}:{line}")


if __name__ == "__main__":
    sys.exit(main())
