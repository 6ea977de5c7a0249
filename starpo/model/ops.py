"""The kernels under the layers: mixed-precision matmuls with written-out backwards, the
choice of attention kernels, and blockwise causal attention for XLA:CPU."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from starpo.model.spec import ModelConfig, _MASK_VALUE
from starpo.precision import backend as target_backend


# ----------------------------------------------------------------------------- mixed precision
# Matmuls take `cfg.dtype` inputs but always accumulate and return float32: on CPUs and
# accelerators bfloat16 inputs with float32 accumulation are the fast path, while pure bfloat16
# arithmetic is both slower on CPU and less exact. Left to autodiff, the backward of such a
# matmul multiplies the float32 cotangent with the bfloat16 operands, which promotes both to
# float32 and runs at float32 speed (on this project's CPU half the bfloat16 rate: the weight
# and input gradients cost ~2.7x the forward). `_mixed` gives the backward the forward's
# precision: the cotangent is rounded to the input dtype, and each gradient is a product of
# input-dtype operands accumulated in float32 and rounded to its operand's dtype -- what mixed
# precision (e.g. PyTorch autocast) does. With float32 inputs it is plain autodiff.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mixed(product, a, b):
    return product(a, b, jnp.float32)


def _mixed_fwd(product, a, b):
    return product(a, b, jnp.float32), (a, b)


def _mixed_bwd(product, res, g):
    a, b = res
    _, vjp = jax.vjp(lambda x, y: product(x, y, a.dtype), a, b)
    return vjp(g.astype(a.dtype))


_mixed.defvjp(_mixed_fwd, _mixed_bwd)


def _float32_product(product, a, b):
    """product(a, b) in float32; low-precision inputs of one dtype get mixed-precision grads."""
    if a.dtype == jnp.float32 or a.dtype != b.dtype:
        return product(a, b, jnp.float32)
    return _mixed(product, a, b)


def mixed_einsum(spec: str, a, b):
    """einsum(spec, a, b) of same-dtype inputs, accumulated and returned in float32."""
    return _float32_product(functools.partial(_einsum_product, spec), a, b)


def _einsum_product(spec, a, b, out_dtype):
    return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)


def _dot_product(dimension_numbers, a, b, out_dtype):
    return jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x, w, w_contract: int):
    """x [N,K] times w ([K,F] if w_contract == 0, [F,K] if 1) -> [N,F] float32.

    The backward pass is written out as two plain 2-D products (dx = g w^T, dw = x^T g) that
    contract the row axis of both operands in place. Left to autodiff (dot_general's
    transpose rule, then XLA:CPU's layout assignment), the weight gradient came out as an
    explicit transpose of the activation or cotangent, written by a loop that misses the cache
    on every element: ~14 of the 52 s of SmolLM2's 8 x 512-token update on 2 cores. Inputs of
    one low-precision dtype get mixed-precision gradients (see `_mixed`)."""
    return jax.lax.dot_general(x, w, (((1,), (w_contract,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _matmul_fwd(x, w, w_contract):
    return _matmul(x, w, w_contract), (x, w)


def _matmul_bwd(w_contract, res, g):
    x, w = res
    g = g.astype(x.dtype)
    dot = functools.partial(jax.lax.dot_general, preferred_element_type=jnp.float32)
    dx = dot(g, w, (((1,), (1 - w_contract,)), ((), ())))  # [N,K]
    if w_contract == 0:
        dw = dot(x, g, (((0,), (0,)), ((), ())))  # [K,F]
    else:
        dw = dot(g, x, (((0,), (0,)), ((), ())))  # [F,K]
    return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _dot_f32_xla(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """The dense layers' dot_general on GPU/TPU: one `dot_general` accumulating and returning
    float32, mixed-precision grads (`_float32_product`). The output is named "dense" for the
    "save_dense" remat policy."""
    del precision, preferred_element_type
    out = _float32_product(functools.partial(_dot_product, dimension_numbers), lhs, rhs)
    return checkpoint_name(out, "dense")


def _dot_f32(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """The dense layers' dot_general on CPU: as `_dot_f32_xla`, but contracting the trailing
    axes of the input with the leading axes of the kernel (every dense layer here) runs as one
    2-D `_matmul` (whose written-out backward XLA:CPU lays out without transposes)."""
    (lc, rc), (lb, rb) = dimension_numbers
    lc = [d % lhs.ndim for d in lc]
    n = len(lc)
    plain = (not lb and not rb and list(rc) == list(range(n))
             and lc == list(range(lhs.ndim - n, lhs.ndim)) and lhs.dtype == rhs.dtype)
    if plain:
        lead, feat = lhs.shape[:lhs.ndim - n], rhs.shape[n:]
        k = math.prod(rhs.shape[:n])
        out = _matmul(lhs.reshape(-1, k), rhs.reshape(k, -1), 0).reshape(*lead, *feat)
        return checkpoint_name(out, "dense")
    return _dot_f32_xla(lhs, rhs, dimension_numbers)


def kernels(cfg: ModelConfig) -> str:
    """What `cfg.attention` stands for on the target backend: "cpu", "xla", "cudnn" or
    "splash"."""
    if cfg.attention != "auto":
        return cfg.attention
    backend = target_backend()
    if backend == "cpu":
        return "cpu"
    if backend == "tpu":
        return "splash"
    refused = cudnn_refusal(cfg.dtype, cfg.head_dim, gpu_capability())
    return "cudnn" if backend == "gpu" and refused is None else "xla"


def decode_kernel(cfg: ModelConfig) -> str:
    """What `cfg.decode_attention` stands for on the target backend: "xla", "pallas" or
    "pallas_tpu" (each kernel still gives way to XLA where a step's shapes do not suit it)."""
    if cfg.decode_attention != "auto":
        return cfg.decode_attention
    return "pallas_tpu" if target_backend() == "tpu" else "xla"


def gpu_capability() -> tuple[int, int] | None:
    """The default device's CUDA compute capability (major, minor); None off NVIDIA GPUs."""
    device = jax.devices()[0]
    text = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def cudnn_refusal(dtype: str, head_dim: int | None, capability: tuple[int, int] | None,
                  length: int | None = None) -> str | None:
    """Why cuDNN's fused flash attention cannot run this model's causal attention both ways
    (forward and backward), or None where it can. The rules of JAX's own checks
    (`jax._src.cudnn.fused_attention_stablehlo`: `check_layout`, `check_is_flash_attention`)
    for bfloat16/float16 inputs and the boolean mask `_attend_dot_product` gives (cuDNN takes it
    as an additive bias): a GPU of compute capability 8.0 or later; a head dim that is a multiple
    of 8, at most 128 (256 from Hopper, 9.0, on); and, where a gradient is taken with a bias, an
    even sequence length. The forward alone takes odd lengths, but whether a backward follows is
    unknown when the forward is traced (under `jax.grad` of a scanned layer the backward's check
    runs later, outside any `try`), so an odd `length` is refused too. `length` None: judge
    the model alone (what `kernels` can know before any shape); `head_dim` None: the machine
    and dtype alone (what the config check knows before the model is loaded)."""
    if capability is None:
        return "needs an NVIDIA GPU (the default backend is %s)" % jax.default_backend()
    if capability < (8, 0):
        return "needs compute capability 8.0 or later, this GPU has %d.%d" % capability
    if dtype not in ("bfloat16", "float16"):
        return f"takes bfloat16 or float16 inputs, the model computes in {dtype}"
    largest = 256 if capability >= (9, 0) else 128
    if head_dim is not None and (head_dim % 8 or head_dim > largest):
        return (f"needs a head dim that is a multiple of 8 up to {largest}, the model's is "
                f"{head_dim}")
    if length is not None and length % 2:
        return f"takes gradients only at even sequence lengths, got {length}"
    return None


def check_kernels(cfg: ModelConfig) -> None:
    """ValueError (one line) where `cfg.attention` names kernels this machine cannot run for
    this model: "cudnn" off an NVIDIA GPU, on one older than Ampere, or with inputs or a head dim
    cuDNN refuses; "splash" or decode_attention "pallas_tpu" off a TPU. ("auto" picks what
    runs; an odd sequence length under "cudnn" uses "xla".)"""
    if cfg.attention == "cudnn":
        refused = cudnn_refusal(cfg.dtype, cfg.head_dim, gpu_capability())
        if refused:
            raise ValueError(f"model.attention=cudnn: cuDNN's flash attention {refused}; "
                             f"use model.attention=auto")
    for knob, value, kernel in (("attention", cfg.attention, "splash"),
                                ("decode_attention", cfg.decode_attention, "pallas_tpu")):
        if value == kernel and target_backend() != "tpu":
            raise ValueError(f"model.{knob}={kernel}: a TPU kernel (Pallas, Mosaic), the "
                             f"backend is {target_backend()}; use model.{knob}=auto")


# Causal self-attention of a whole sequence (the training forward), block by block.

def attention_block(T: int) -> int:
    """Query tokens per block of `causal_attention`: 64, or more for long sequences so that
    there are at most 16 blocks (each block is its own unrolled products)."""
    return 64 * max(1, -(-T // (64 * 16)))


def _attention_blocks(T: int, block: int) -> tuple[tuple[int, int], ...]:
    """Query blocks [start, stop) of at most `block` tokens covering 0..T."""
    return tuple((a, min(a + block, T)) for a in range(0, T, block))


def _causal_scores(q, k, valid, start, stop, G, window=None):
    """Masked scores of query tokens [start, stop) against keys [0, stop):
    [B,K,(stop-start)*G,stop]. window: a `TurnWindow` that also masks keys outside each
    query's window, or None."""
    s = jax.lax.dot_general(q[:, :, start * G:stop * G], k[:, :, :stop],
                            (((3,), (3,)), ((0, 1), (0, 1))), preferred_element_type=jnp.float32)
    t = jnp.arange(start, stop, dtype=jnp.int32)
    keys = jnp.arange(stop, dtype=jnp.int32)
    causal = jnp.repeat(t[:, None] >= keys[None, :], G, axis=0)  # [(stop-start)*G, stop]
    mask = causal[None] & valid[:, None, :stop]  # [B, rows, stop]
    if window is not None:
        inside = window.visible(slice(start, stop), slice(0, stop))  # [B,stop-start,stop]
        mask = mask & jnp.repeat(inside, G, axis=1)
    return jnp.where(mask[:, None], s, _MASK_VALUE)


def causal_attention(q, k, v, valid, G: int, block: int, window=None):
    """Softmax attention of each token over the valid tokens at or before it.

    q [B,K,T*G,E] (query head g of kv head k at row t*G + g, already scaled), k and v
    [B,K,T,E], valid [B,T] bool -> [B,K,T*G,E] float32.

    Query block i only multiplies keys of blocks 0..i: the products and the softmax passes skip
    the upper triangle (with 128-token blocks, 10/16 of the work at 512 tokens). The backward is
    written out (dP = dO V^T, dS = P (dP - rowsum(dO O)), dQ = dS K, dK = dS^T Q, dV = P^T dO)
    with every product keeping (batch, kv head) leading and contracting in place: autodiff of
    the einsum version made XLA:CPU transpose the [B,K,G,T,T] scores and the query layouts.
    A padding query (no visible key) gets a uniform row over its block's keys; nothing reads it.
    window: a `TurnWindow` (keys outside a query's window are masked too) or None.
    """
    return _block_attention(q, k, v, valid, window, G, block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _block_attention(q, k, v, valid, window, G, block):
    return _causal_attention_fwd(q, k, v, valid, window, G, block)[0]


def _causal_attention_fwd(q, k, v, valid, window, G, block):
    T = k.shape[2]
    outs, probs = [], []
    for start, stop in _attention_blocks(T, block):
        p = jax.nn.softmax(_causal_scores(q, k, valid, start, stop, G, window), axis=-1)
        p = p.astype(v.dtype)
        outs.append(jax.lax.dot_general(p, v[:, :, :stop], (((3,), (2,)), ((0, 1), (0, 1))),
                                        preferred_element_type=jnp.float32))
        probs.append(p)
    out = jnp.concatenate(outs, axis=2)
    return out, (q, k, v, out, tuple(probs))


def _causal_attention_bwd(G, block, res, g):
    q, k, v, out, probs = res
    T = k.shape[2]
    dot = functools.partial(jax.lax.dot_general, preferred_element_type=jnp.float32)
    bat = ((0, 1), (0, 1))
    delta = jnp.sum(g * out, axis=-1, keepdims=True)  # [B,K,T*G,1]
    g = g.astype(v.dtype)
    dq, dk, dv = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for (start, stop), p in zip(_attention_blocks(T, block), probs):
        rows = slice(start * G, stop * G)
        gb = g[:, :, rows]
        dp = dot(gb, v[:, :, :stop], (((3,), (3,)), bat))  # [B,K,rows,stop]
        ds = (p.astype(jnp.float32) * (dp - delta[:, :, rows])).astype(q.dtype)
        dq.append(dot(ds, k[:, :, :stop], (((3,), (2,)), bat)))  # [B,K,rows,E]
        dk = dk.at[:, :, :stop].add(dot(ds, q[:, :, rows], (((2,), (2,)), bat)))
        dv = dv.at[:, :, :stop].add(dot(p, gb, (((2,), (2,)), bat)))
    dq = jnp.concatenate(dq, axis=2)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_block_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)
