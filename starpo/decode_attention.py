"""A decode step's attention over the KV cache as one fused GPU kernel (Pallas, lowered by Triton).

What XLA makes of a decode step's attention (one query a row over the cache, `model.
_attend_written_cache`): a matmul for the scores, three kernels for the softmax and a matmul
for the weighted sum, which read the cache twice and write the [B,H,S] scores and
probabilities between them. On an H100 at Qwen2.5-0.5B's shape those took ~23 us a layer
against the ~5 us that reading the layer's cache once takes (docs/results.md, "Speed against
PyTorch"). Here one program per (row, kv head) walks the cache slots in blocks with an online
softmax (FlashAttention's running maximum and sum), reading each filled slot's key and value
once (none past the row's last visible slot) and writing only the output:
`model.decode_attention=pallas` (off by default until timed on a GPU; `benchmarks/sampler.py
--decode_attention`). Off a GPU it runs in Pallas's interpreter (slow, for tests: the same
program's numbers).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_MASK_VALUE = -1e30  # model._MASK_VALUE: a row with no visible slot averages them all alike
_BLOCKS = (128, 64, 32, 16)  # cache slots a loop step reads (a power of 2 that divides S)
# plgpu.dot from jax 0.8 on; jax 0.7's pl.dot
_dot = getattr(plgpu, "dot", None) or pl.dot


def slot_block(slots: int) -> int | None:
    """The cache slots each step of the kernel's loop reads: the largest of `_BLOCKS` that
    divides `slots`, or None where none does (the kernel does not run there)."""
    return next((b for b in _BLOCKS if slots % b == 0), None)


def runs(q_shape, slots: int) -> bool:
    """Whether the kernel takes queries q [B,T,K,G,E] over `slots` cache slots: one query a
    row (a decode step), a power-of-2 head dim of at least 16, and slots a block divides."""
    T, E = q_shape[1], q_shape[-1]
    return T == 1 and E >= 16 and E & (E - 1) == 0 and slot_block(slots) is not None


def _kernel(q_ref, k_ref, v_ref, bias_ref, end_ref, o_ref, *, block):
    """One (row, kv head): q [Gp,E] against the cache k, v [S,E] with bias [S] (0 or the mask
    value), up to slot `end` (the row's last visible slot + 1; beyond it the mask hides every
    slot, so those blocks are not read) -> o [Gp,E] float32."""
    q = q_ref[...]
    rows = q.shape[0]

    def step(i, carry):
        o, top, norm = carry
        here = pl.ds(i * block, block)
        # float32 caches multiply in float32, not TF32 (bfloat16 ones are unaffected)
        s = _dot(q, k_ref[here, :], trans_b=True, allow_tf32=False).astype(jnp.float32)
        s = s + bias_ref[here][None, :]
        new_top = jnp.maximum(top, s.max(axis=1))
        scale = jnp.exp(top - new_top)
        p = jnp.exp(s - new_top[:, None])
        v = v_ref[here, :]
        o = o * scale[:, None] + _dot(p.astype(v.dtype), v, allow_tf32=False).astype(jnp.float32)
        return o, new_top, norm * scale + p.sum(axis=1)

    init = (jnp.zeros((rows, q.shape[1]), jnp.float32),
            jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
    o, _, norm = jax.lax.fori_loop(0, pl.cdiv(end_ref[()], block), step, init)
    o_ref[...] = o / norm[:, None]


@functools.partial(jax.jit, static_argnames=("interpret",))
def attend(q, ck, cv, visible, interpret: bool | None = None):
    """q [B,1,K,G,E] (scaled, rotated) over the cache ck, cv [B,K,S,E], slots visible [B,1,S]
    -> [B,1,K*G,E] float32, as `model._attend_written_cache` for one query a row (`runs`).
    interpret: Pallas's interpreter (None: off a GPU)."""
    B, T, K, G, E = q.shape
    S = ck.shape[2]
    block = slot_block(S)
    if not runs(q.shape, S):
        raise ValueError(f"decode attention kernel: queries {q.shape} over {S} slots: "
                         "one query a row, a power-of-2 head dim >= 16 and slots a multiple of 16")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    # the kv head's G queries as the rows of its matmuls, padded to Triton's 16 at least
    rows = max(16, 1 << (G - 1).bit_length())
    qk = jnp.pad(q[:, 0].astype(ck.dtype), ((0, 0), (0, 0), (0, rows - G), (0, 0)))
    bias = jnp.where(visible[:, 0], 0.0, _MASK_VALUE).astype(jnp.float32)  # [B,S]
    # a row's slots fill from the left: none after its last visible one is read (a row with no
    # visible slot reads them all, as XLA's masked softmax averages them all)
    last = jnp.max(jnp.where(visible[:, 0], jnp.arange(1, S + 1, dtype=jnp.int32), 0), axis=1)
    end = jnp.where(last > 0, last, S)  # [B]
    out = pl.pallas_call(
        functools.partial(_kernel, block=block),
        grid=(B, K),
        in_specs=[pl.BlockSpec((None, None, rows, E), lambda b, k: (b, k, 0, 0)),
                  pl.BlockSpec((None, None, S, E), lambda b, k: (b, k, 0, 0)),
                  pl.BlockSpec((None, None, S, E), lambda b, k: (b, k, 0, 0)),
                  pl.BlockSpec((None, S), lambda b, k: (b, 0)),
                  pl.BlockSpec((None,), lambda b, k: (b,))],
        out_specs=pl.BlockSpec((None, None, rows, E), lambda b, k: (b, k, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, K, rows, E), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="decode_attention",
    )(qk, ck, cv, bias, end)
    return out[:, :, :G].reshape(B, 1, K * G, E)
