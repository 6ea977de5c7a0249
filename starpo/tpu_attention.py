"""Attention kernels for TPUs: Pallas programs lowered by Mosaic.

Two places where XLA's attention costs the most on a TPU get a kernel each, both chosen by
`auto` on a TPU (`model.kernels`, `model.decode_kernel`) where their static shapes allow:

- `causal`: the training forward and a first prefill (attention of a whole sequence over
  itself) through JAX's splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`):
  a flash-attention forward and backward that skip the blocks above the diagonal and keep one
  log-sum-exp a query row, where XLA's path recomputes the [T,T] scores of every head in the
  backward pass. The causal mask is splash's static mask; the row's padding is its segment
  ids (valid tokens 1, padding 0), so a valid query sees the valid keys at or before it and a
  padding query only padding (its output is never read: no valid query sees a padding key).
  The sequence is padded at its end to a multiple of 128 tokens (the kernel's block). Rows
  packed into one sequence (`update.pack_rows`) are segments too: a segment's id a row.
- `decode`: a decode step's attention (one query a row) over the KV cache, in the spirit of
  the GPU kernel (`starpo/decode_attention.py`): a grid of (row, kv head, block of slots), an
  online softmax over the blocks in VMEM scratch, and no block past the row's last visible
  slot read (its index is clamped to the last needed one, which Pallas does not copy again).
  A cache whose slots no 128-multiple block divides (a decode window's) is one block.

Mosaic kernels are not partitioned by XLA: on a mesh each runs under `shard_map` over the
batch axes (and the kv heads where `tensor` splits them), as `sharding.RULES` lays the
arrays out. Off a TPU both run in Pallas's interpreter (slow; the tests' numbers), and what
cannot run a kernel falls back to XLA by `causal_fallback` / `decode_runs`, from static shapes.
What compiling for a TPU (`launch/plan.py --topology`) does not show: these kernels' speed or
their numerics on the hardware.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash, splash_attention_mask as masks)
from jax.sharding import PartitionSpec as P

from starpo import sharding
from starpo.precision import backend as target_backend

BLOCK = 128  # a kernel block's tokens / slots at least (the TPU's 128 lanes)
_BLOCKS = (512, 256, 128)  # the blocks tried, largest first (one that divides the length)
_MASK_VALUE = -1e30  # model._MASK_VALUE: a row with no visible slot averages them all alike
WHOLE_CACHE = 4096  # up to these many slots a cache that no block divides is one block


def _block(length: int) -> int:
    """The largest of `_BLOCKS` that divides `length`, else the whole length (one block)."""
    return next((b for b in _BLOCKS if length % b == 0), length)


def _interpret(interpret: bool | None) -> bool:
    return target_backend() != "tpu" if interpret is None else interpret


def _precision(dtype):
    """The matmul precision the kernels are traced under: the default for 16-bit operands
    (Mosaic refuses a float32 contraction of bfloat16 ones, which a process-wide "highest"
    would ask for: JAX_DEFAULT_MATMUL_PRECISION, as the test suite sets), the process's own
    for float32."""
    if jnp.dtype(dtype).itemsize < 4:
        return jax.default_matmul_precision("default")
    return contextlib.nullcontext()


def _traced_at(precision, fn):
    """fn with its forward and its backward pass both traced under the context `precision()`
    gives (a backward is traced when the gradient is taken, after fn has returned)."""
    @jax.custom_vjp
    def f(*args):
        with precision():
            return fn(*args)

    def forward(*args):
        with precision():
            return jax.vjp(fn, *args)

    def backward(back, g):
        with precision():
            return back(g)

    f.defvjp(forward, backward)
    return f


def _sharded(fn, args, logical, out_logical):
    """fn(*args) under `shard_map` over the mesh in context (arrays laid out by the logical
    axis names `logical`, one tuple an argument; `out_logical` the output's), or fn(*args)
    without a mesh or on one device. Query heads split only where the kv heads do, so each
    shard holds whole GQA groups."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn(*args)
    kv_dim = next(x.shape[names.index("kv_heads")] for x, names in zip(args, logical)
                  if "kv_heads" in names)
    heads = sharding.spec(("kv_heads",), (kv_dim,), mesh)
    heads = heads[0] if len(heads) else None

    def spec(names, shape):
        s = list(sharding.spec(tuple(n if n != "heads" else None for n in names), shape, mesh))
        s += [None] * (len(names) - len(s))
        return P(*[heads if n in ("heads", "kv_heads") else a for n, a in zip(names, s)])

    out_shape = jax.eval_shape(fn, *args).shape
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(n, x.shape) for n, x in
                                                      zip(logical, args)),
                         out_specs=spec(out_logical, out_shape), check_vma=False)(*args)


# ----------------------------------------------------------------------------- splash (causal)
def causal_fallback(length: int, window: bool = False) -> str | None:
    """Why the training forward's attention of `length` tokens runs XLA's path instead of
    splash attention, or None where splash runs: a context window (its per-row turn mask is
    not one splash can take: its masks are static and alike across the batch, its segment ids
    disjoint spans), or a sequence shorter than one block (padding it to 128 tokens would
    cost more than XLA's [T,T] scores save)."""
    if window:
        return "a context window's turn mask differs row by row"
    if length < BLOCK:
        return f"{length} tokens are fewer than one {BLOCK}-token block"
    return None


def causal(q, k, v, valid, segments=None, interpret: bool | None = None):
    """q [B,T,K,G,E] (scaled, rotated), k, v [B,T,K,E], valid [B,T] -> [B,T,K*G,E] in k's
    dtype: each valid query over the valid keys at or before it (as `model._attend_causal`;
    padding queries' rows differ and are not read). segments: int [B,T] >= 0 or None: a
    valid query sees the valid keys of its own segment alone (rows packed into one sequence,
    `model.TurnWindow` with `segments`). interpret: Pallas's interpreter (None: off a TPU)."""
    B, T, K, G, E = q.shape
    Tp = -(-T // BLOCK) * BLOCK
    block = _block(Tp)
    pad = ((0, 0), (0, Tp - T), (0, 0), (0, 0))
    qh = jnp.pad(q.reshape(B, T, K * G, E).astype(k.dtype), pad).transpose(0, 2, 1, 3)
    kh, vh = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (k, v))  # [B,K,Tp,E]
    ids = valid.astype(jnp.int32) if segments is None else jnp.where(valid, segments + 1, 0)
    segments = jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, Tp - T)))
    interpret = _interpret(interpret)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block,
                              block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)

    def local(q, k, v, segments):  # one shard's rows and heads
        # built while tracing: its mask tables are constants of the program
        kernel = splash.make_splash_mha(
            masks.MultiHeadMask([masks.CausalMask((Tp, Tp))] * q.shape[1]),
            block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
        return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s))
                        )(q, k, v, segments)

    def run(qh, kh, vh, segments):
        return _sharded(local, (qh, kh, vh, segments),
                        (("batch", "heads", "length", "head_dim"),
                         ("batch", "kv_heads", "length", "head_dim"),
                         ("batch", "kv_heads", "length", "head_dim"), ("batch", "length")),
                        ("batch", "heads", "length", "head_dim"))

    out = _traced_at(lambda: _precision(k.dtype), run)(qh, kh, vh, segments)
    return out.transpose(0, 2, 1, 3)[:, :T]


# ----------------------------------------------------------------------------- decode
def decode_runs(q_shape, slots: int) -> bool:
    """Whether the decode kernel takes queries q [B,T,K,G,E] over `slots` cache slots: one
    query a row (a decode step), and slots in blocks of a multiple of 128 (the TPU's lanes) or
    at most `WHOLE_CACHE` of them, then read as one block (a block as long as the array's dim
    is one Mosaic takes; no block past a row's end is skipped there)."""
    return q_shape[1] == 1 and (slots % BLOCK == 0 or slots <= WHOLE_CACHE)


def _decode_kernel(end_ref, q_ref, k_ref, v_ref, bias_ref, o_ref, top, norm, acc, *, block):
    """Grid step (row b, kv head, slot block j): q [R,E] against k, v [block,E] with bias
    [1,block] (0 or the mask value); the running maximum, sum and weighted values of the
    online softmax live in scratch across j; blocks from the row's end on are skipped."""
    b, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _():
        top[...] = jnp.full(top.shape, -jnp.inf, jnp.float32)
        norm[...] = jnp.zeros(norm.shape, jnp.float32)
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    @pl.when(j * block < end_ref[b])
    def _():
        s = jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) + bias_ref[...]
        new_top = jnp.maximum(top[...], s.max(axis=1, keepdims=True))
        scale = jnp.exp(top[...] - new_top)
        p = jnp.exp(s - new_top)
        norm[...] = norm[...] * scale + p.sum(axis=1, keepdims=True)
        v = v_ref[...]
        acc[...] = acc[...] * scale + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        top[...] = new_top

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc[...] / norm[...]


def decode(q, ck, cv, visible, interpret: bool | None = None):
    """q [B,1,K,G,E] (scaled, rotated) over the cache ck, cv [B,K,S,E], slots visible [B,1,S]
    -> [B,1,K*G,E] float32, as `model._attend_written_cache` for one query a row
    (`decode_runs`). interpret: Pallas's interpreter (None: off a TPU)."""
    B, T, K, G, E = q.shape
    S = ck.shape[2]
    if not decode_runs(q.shape, S):
        raise ValueError(f"TPU decode attention kernel: queries {q.shape} over {S} slots: "
                         f"one query a row, slots a multiple of {BLOCK} or at most "
                         f"{WHOLE_CACHE}")
    interpret = _interpret(interpret)

    def local(q, ck, cv, visible):
        B, _, K, G, E = q.shape
        S = ck.shape[2]
        block = _block(S)
        rows = -(-G // 8) * 8  # the kv head's G queries as matmul rows: a multiple of 8
        qk = jnp.pad(q[:, 0].astype(ck.dtype), ((0, 0), (0, 0), (0, rows - G), (0, 0)))
        bias = jnp.where(visible[:, 0], 0.0, _MASK_VALUE).astype(jnp.float32)[:, None]  # [B,1,S]
        # a row's slots fill from the left: none after its last visible one is read (a row
        # with no visible slot reads them all, as XLA's masked softmax averages them all)
        last = jnp.max(jnp.where(visible[:, 0], jnp.arange(1, S + 1, dtype=jnp.int32), 0),
                       axis=1)
        end = jnp.where(last > 0, last, S).astype(jnp.int32)  # [B]

        def slots(b, k, j, end):  # past the row's end: the last block again (not copied)
            return b, k, jnp.minimum(j, (end[b] - 1) // block), 0

        def bias_at(b, k, j, end):
            return b, 0, jnp.minimum(j, (end[b] - 1) // block)

        out = pl.pallas_call(
            functools.partial(_decode_kernel, block=block),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(B, K, S // block),
                in_specs=[pl.BlockSpec((None, None, rows, E), lambda b, k, j, end: (b, k, 0, 0)),
                          pl.BlockSpec((None, None, block, E), slots),
                          pl.BlockSpec((None, None, block, E), slots),
                          pl.BlockSpec((None, 1, block), bias_at)],
                out_specs=pl.BlockSpec((None, None, rows, E), lambda b, k, j, end: (b, k, 0, 0)),
                scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32),
                                pltpu.VMEM((rows, 1), jnp.float32),
                                pltpu.VMEM((rows, E), jnp.float32)]),
            out_shape=jax.ShapeDtypeStruct((B, K, rows, E), jnp.float32),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary")),
            interpret=interpret, name="decode_attention_tpu",
        )(end, qk, ck, cv, bias)
        return out[:, :, :G].reshape(B, 1, K * G, E)

    with _precision(ck.dtype):
        return _sharded(local, (q, ck, cv, visible),
                        (("batch", "length", "kv_heads", None, "head_dim"),
                         ("batch", "kv_heads", "length", "head_dim"),
                         ("batch", "kv_heads", "length", "head_dim"), ("batch", None, "length")),
                        ("batch", "length", "heads", "head_dim"))
