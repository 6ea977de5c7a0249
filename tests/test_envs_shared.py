"""Jitted, vmapped env functions shared by the env test modules (no tests here).

Compiling a Sokoban reset takes seconds on CPU, so every test uses the same compiled functions
at the one batch size BATCH, and each function counts its traces so a test can check that new
data never retraces.
"""

import functools

import jax
import jax.numpy as jnp

BATCH = 1024


class Compiled:
    """jit(vmap(...)) of an env's functions over BATCH envs, with trace counters."""

    def __init__(self, env):
        self.env = env
        self.traces = {"reset": 0, "step": 0}

        def reset(keys):  # [BATCH] keys -> batched state
            self.traces["reset"] += 1
            return jax.vmap(env.reset)(keys)

        def step(keys, states, actions):  # [BATCH] keys, batched state, int32[BATCH]
            self.traces["step"] += 1
            return jax.vmap(env.step)(keys, states, actions)

        self.reset = jax.jit(reset)
        jitted_step = jax.jit(step)
        # Actions as plain int32 whatever the caller built them from: a weakly typed array
        # (jnp.where(mask, 1, 2)) is a different abstract value and would retrace.
        self.step = lambda keys, states, actions: jitted_step(keys, states, jnp.asarray(actions, jnp.int32))

    @functools.cache
    def vmapped(self, method):
        """jit(vmap(env.<method>)) over all arguments, e.g. "move" or "shortest_path"."""
        return jax.jit(jax.vmap(getattr(self.env, method)))

    def reset_seed(self, seed):
        """BATCH fresh states from keys split off jax.random.key(seed)."""
        return self.reset(jax.random.split(jax.random.key(seed), BATCH))


@functools.lru_cache(maxsize=None)
def compiled(env):
    """The shared Compiled for `env` (envs are hashable: equal settings share it)."""
    return Compiled(env)
