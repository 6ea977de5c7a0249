"""Counter-hash random numbers for the level generators.

A generator draws one uint32 seed from its PRNG key (`jax.random.bits`) and derives every other
random number as the hash of (seed, stream, counter). Two reasons:
  * speed: threefry per number costs more than the generators' real work on CPU, while a hash
    is a few integer ops that fuse into the surrounding loop;
  * compile time: each jax.random call adds seconds of XLA compilation on CPU
    (jax.random.randint the most), and a generator needs hundreds of small draws.
The hash is integer arithmetic, so the same key gives the same level on every machine.

Why the generators are written over per-env scalars: batching is a vmap outside the env, which
puts the batch on the major axis of every array. XLA on CPU is fast for work on per-env scalars
(contiguous [B] vectors) and slow for small per-env vectors indexed element by element (strided
access, and fusions that recompute whole chains). So the sequential parts are scans over
scalars, and cell masks are bits in uint32 words (see envs/bitrows.py).
"""

import jax.numpy as jnp


def hash32(x):
    """uint32 -> uint32, well mixed (Wellons' lowbias32)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def stream_key(seed, salt):
    """uint32 key of the independent random stream `salt` (a small int) of a uint32 seed."""
    return hash32(seed ^ jnp.uint32((salt * 0x85EBCA6B) & 0xFFFFFFFF))


def draw(stream, counter):
    """uint32 random word number `counter` (int array, any shape) of a stream key."""
    return hash32(stream + jnp.asarray(counter).astype(jnp.uint32) * jnp.uint32(0x9E3779B9))


def to_uniform(bits):
    """float32 uniform in [0, 1) from uint32 random bits (their top 24 bits)."""
    return (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def uniform_int(u, n):
    """int32 uniform on [0, n) from uniforms u in [0, 1); n an int or int array >= 1."""
    return jnp.minimum(jnp.floor(u * n).astype(jnp.int32), jnp.asarray(n) - 1)
