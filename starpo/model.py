"""The decoder of the Llama, Qwen2, Qwen3 and Gemma 3 families in Flax, with a functional KV
cache and an optional value head.

One module covers SmolLM2, Llama 3.x, Qwen2.5, Qwen3 and Gemma 3: RMSNorm, rotary embeddings
(theta from the checkpoint, Llama-3 or linear frequency scaling where configured),
grouped-query attention, a gated MLP, tied or untied output head, and the switches a family
sets (`starpo/families.py`): q/k/v bias (Qwen2); an RMSNorm over each head's query and key
before the rotary embedding (Qwen3, Gemma 3); and Gemma 3's own: norms that scale by (1 + w),
norms after attention and after the MLP too, a tanh-GELU gate, embeddings times sqrt(width),
a query scale of its own, and sliding-window layers (`local_layers`) that attend to the last
`sliding_window` positions only, with a rotary base of their own. A sliding window is the same
mask as a context window over turns (`window_mask`) with rotary positions in place of turns,
so every attention kernel and cache path applies it as it applies a `TurnWindow`.

One driver, `hidden_states`, runs every forward (training forward, cache append, decode step):
it computes the chunk's geometry (rotary positions, masks, cache write slots, context window)
once and runs `Block` over the layers, as a scan over the stacked weights `layers` [L,...] (a
30-layer model compiles like a 1-layer one) or as a loop over per-layer buffers cut once for
decoding (`split_layers`, `split_cache`), with the same numbers.

Einsum letters: B batch, T query tokens, S key slots, D model width, H query heads,
K kv heads, G query heads per kv head (H = K*G), E head dim, F MLP width, V vocab.

The cache is an explicit argument that goes in and comes back out (no mutable collections).
Each row writes its chunk of tokens at its own slot offset `end[b]`; rotary positions count only
real tokens, so left padding, right padding and per-row appends all give the same numbers as the
unpadded row alone.

A context window (`TurnWindow`, off unless given) restricts what each token attends to by the
turn of the dialogue it belongs to: the prompt prefix and the last `size` turns (the current one
included). It is an attention mask over the same slots and the same rotary positions, applied
alike by the training forward, the cache append and the decode step, so a token's log-prob in
training is the one it was sampled with.

Every weight names its logical axes (`embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `vocab`,
stacked under `layers`); `starpo/sharding.py` maps them onto a device mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.ad_checkpoint import checkpoint_name

from starpo.families import FAMILIES
from starpo.precision import backend as target_backend
from starpo.schema import ATTENTION, DECODE_ATTENTION  # noqa: F401 (the choices of model.*)
from starpo.schema import REMAT_POLICIES as _REMAT_NAMES
from starpo.sharding import constrain, tree_shardings

# A finite "minus infinity": a padding query with no visible key gets a uniform (finite)
# attention row instead of NaN, which would otherwise poison gradients through `where`.
_MASK_VALUE = -1e30
# `ModelConfig.remat_policy` -> the jax.checkpoint policy of a rematerialised layer
REMAT_POLICIES = {"full": None,
                  "save_dense": jax.checkpoint_policies.save_only_these_names("dense")}
assert tuple(REMAT_POLICIES) == _REMAT_NAMES
# the residual stream's logical axes: rows split over the mesh's batch axes, width whole
ACTIVATION_AXES = ("batch", "length", "act_embed")
# `ModelConfig.attention` (its choices `schema.ATTENTION`): the kernels of the training forward (and a first prefill) and of
# every dense layer. "cpu": attention in causal query blocks with a written-out backward
# (`causal_attention`) and dense layers as 2-D matmuls with a written-out backward (`_matmul`),
# both tuned for XLA:CPU. "xla": `jax.nn.dot_product_attention`'s XLA implementation, its
# [T,S] scores recomputed in the backward pass (`jax.checkpoint`), and plain `dot_general`
# dense layers. "cudnn": the same with cuDNN's fused flash attention (NVIDIA GPUs, bfloat16 or
# float16). "splash": JAX's splash attention, a Pallas TPU kernel (`tpu_attention.causal`),
# with "xla"'s dense layers; XLA's attention where its static shapes do not suit it
# (`tpu_attention.causal_fallback`: a context window, under 128 tokens). "auto": "cpu" on
# CPU; on an NVIDIA GPU "cudnn" where it takes the shapes and dtype, else "xla"; "splash" on a
# TPU. All give the same numbers to float rounding (tests/test_model.py, test_tpu_attention.py).
# `ModelConfig.decode_attention` (`schema.DECODE_ATTENTION`), a decode step's attention: XLA's
# ops, or one fused kernel a layer: "pallas" the GPU's
# (starpo/decode_attention.py, Triton), "pallas_tpu" the TPU's (`tpu_attention.decode`,
# Mosaic); each interpreted off its platform (tests). "auto": "pallas_tpu" on a TPU, else
# "xla". The kernels' modules are imported only where used: Pallas loads late.
# `ModelConfig.activation`: the MLP gate's (SwiGLU's SiLU; Gemma's tanh-approximate GELU)
ACTIVATIONS = {"silu": nn.silu, "gelu_tanh": functools.partial(nn.gelu, approximate=True)}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static architecture description (hashable: usable as a jit static argument)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    # Llama-3 style scaling as (factor, low_freq_factor, high_freq_factor, original_max_position).
    rope_scaling: tuple[float, float, float, int] | None = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head's query and key before rotary (Qwen3)
    family: str = "llama"  # the checkpoints' family (starpo/families.py): names them on export
    # Gemma 3's switches: norms scale by (1 + w); norms after attention and after the MLP too;
    # the MLP's gate activation (silu | gelu_tanh); embeddings times sqrt(hidden_size); scores
    # scaled by query_scale ** -0.5 (0: head_dim ** -0.5)
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    query_scale: float = 0.0
    # sliding-window layers: each token of layer i in `local_layers` attends to the keys of the
    # last `sliding_window` positions (itself included), rotated with base `local_rope_theta`
    # and no scaling; the other layers see everything, rotated with `rope_theta` (and scaling)
    sliding_window: int = 0
    local_layers: tuple[int, ...] = ()
    local_rope_theta: float = 10000.0
    rope_linear: float = 1.0  # linear rope scaling of the global layers: positions / factor
    max_position_embeddings: int = 8192
    value_head: bool = False
    dtype: str = "float32"  # compute dtype of matmuls; norms, softmax and logits stay float32
    param_dtype: str = "float32"
    remat: bool = False  # rematerialise each layer in the backward pass (memory for compute)
    # what a rematerialised layer keeps from its forward pass: "full" only its input (the whole
    # layer runs again in the backward pass); "save_dense" also the outputs of its dense matmuls
    # (q, k, v, o, gate, up, down: ~5k floats per token per layer for SmolLM2), so only norms,
    # rotary, attention and activations run again
    remat_policy: str = "full"
    attention: str = "auto"  # the kernels (see ATTENTION): auto | cpu | xla | cudnn | splash
    # a decode step's attention over the cache (see DECODE_ATTENTION)
    decode_attention: str = "auto"
    # LoRA adapters (`starpo/lora.py`): rank (0: none), alpha and the projections adapted
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy={self.remat_policy!r}; known: "
                             f"{', '.join(REMAT_POLICIES)}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r}; known: {', '.join(ATTENTION)}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention={self.decode_attention!r}; known: "
                             f"{', '.join(DECODE_ATTENTION)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}; known: {', '.join(ACTIVATIONS)}")
        if bool(self.sliding_window) != bool(self.local_layers) or not all(
                0 <= i < self.num_layers for i in self.local_layers):
            raise ValueError(f"sliding_window={self.sliding_window} with local layers "
                             f"{self.local_layers} of {self.num_layers}")
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}; known: {', '.join(FAMILIES)}")
        if self.lora_rank < 0 or (self.lora_rank and not self.lora_targets):
            raise ValueError(f"lora_rank={self.lora_rank} with targets {self.lora_targets}")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @property
    def num_params(self) -> int:
        d, f, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + (4 if self.sandwich_norms else 2) * d
        if self.qkv_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        head = 0 if self.tie_embeddings else d * v
        return v * d + L * per_layer + d + head


@struct.dataclass
class KVCache:
    """Per-layer keys and values plus per-row bookkeeping.

    k, v:  [L, B, K, S, E]   slot s of row b holds the key/value written there (kv heads before
                             slots: attention reads each layer's [B,K,S,E] slice as it is)
    valid: [B, S] bool        slot holds a real (non-padding) token
    end:   [B] int32          next slot to write in each row
    pos:   [B] int32          rotary position of the next real token (= real tokens so far)
    turn:  [B,S] int32 | None the dialogue turn of each slot's token (`TurnWindow`; PREFIX_TURN
                             for the prompt prefix); None when no context window is used
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    end: jax.Array
    pos: jax.Array
    turn: jax.Array | None = None

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None,
               turns: bool = False, split: bool = False) -> KVCache:
    """An empty cache for `batch` rows of up to `max_len` slots (turns=True: with the per-slot
    turn ids a `TurnWindow` needs, PREFIX_TURN until written; split=True: k and v as tuples
    of per-layer [B,K,S,E] buffers, as `split_cache` makes them, from the start)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    kv_axes = ("layers", "batch", "kv_heads", "length", "head_dim")

    def buffers():
        if split:
            return tuple(constrain(jnp.zeros(shape[1:], dtype), kv_axes[1:])
                         for _ in range(cfg.num_layers))
        return constrain(jnp.zeros(shape, dtype), kv_axes)

    return KVCache(
        k=buffers(),
        v=buffers(),
        valid=constrain(jnp.zeros((batch, max_len), bool), ("batch", "length")),
        end=constrain(jnp.zeros((batch,), jnp.int32), ("batch",)),
        pos=constrain(jnp.zeros((batch,), jnp.int32), ("batch",)),
        turn=(constrain(jnp.full((batch, max_len), PREFIX_TURN, jnp.int32), ("batch", "length"))
              if turns else None),
    )


# ----------------------------------------------------------------------------- context window
PREFIX_TURN = -1  # the turn id of the prompt prefix (system prompt, instruction): always seen


@struct.dataclass
class TurnWindow:
    """A context window over dialogue turns: a token of turn q attends only to the prompt
    prefix (turn id < 0, PREFIX_TURN) and to tokens of turns q-size+1 .. q (causally, as ever).
    size=1 is the current turn alone. turns [B,T] int32: the turn of each token of the chunk
    being run (a chunk is one turn in the sampler; a whole dialogue in the training forward).
    With a cache, the cache's `turn` ids give the slots' turns.

    A sliding-window layer's window rides along (the cacheless forward's kernels take one
    window): with `sliding` > 0 and `local` true, a key must also lie within the last
    `sliding` rotary `positions` [B,T] of the query; turns may then be None (no window over
    turns). `local` is a layer's flag: a Python bool, or traced under the scan over layers."""

    turns: jax.Array | None
    size: int = struct.field(pytree_node=False)
    # the turns are disjoint segments with no prefix among them (rows packed into shared
    # sequences, `update.pack_rows`): with size 1 a token sees its own segment alone, which a
    # TPU's splash attention takes as segment ids
    segments: bool = struct.field(pytree_node=False, default=False)
    positions: jax.Array | None = None
    sliding: int = struct.field(pytree_node=False, default=0)
    local: Any = None

    def visible(self, queries: slice, keys: slice) -> jax.Array:
        """bool [B,Tq,Tk]: whether each of tokens `keys` is inside the window of each of tokens
        `queries` (slices of the chunk)."""
        inside = True
        if self.turns is not None:
            inside = window_mask(self.turns[:, queries], self.turns[:, keys], self.size)
        if self.sliding:
            near = window_mask(self.positions[:, queries], self.positions[:, keys], self.sliding)
            inside = inside & (near | jnp.logical_not(self.local))
        return inside


def window_mask(query_turns, key_turns, size: int):
    """bool [B,T,S]: key s is inside query t's window (query_turns [B,T], key_turns [B,S])."""
    k = key_turns[:, None, :]
    return (k < 0) | (k > query_turns[:, :, None] - size)


# ----------------------------------------------------------------------------- rotary embedding
def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies [E/2], with Llama-3 or linear scaling applied when the config has
    it; local=True: a sliding-window layer's (its own base, unscaled)."""
    e = cfg.head_dim
    if local:
        return 1.0 / (cfg.local_rope_theta ** (np.arange(0, e, 2, dtype=np.float64) / e))
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, e, 2, dtype=np.float64) / e)) / cfg.rope_linear
    if cfg.rope_scaling is not None:
        factor, low_ff, high_ff, old_ctx = cfg.rope_scaling
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = old_ctx / low_ff, old_ctx / high_ff
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x [B, T, N, E] by positions [B, T] (the half-split layout of HF checkpoints)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, E/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------- layers
def _partitioned(init, axes):
    return nn.with_logical_partitioning(init, axes)


class RMSNorm(nn.Module):
    eps: float
    param_dtype: Any = jnp.float32
    axis: str = "embed"  # the logical axis of the normalised (last) dimension
    plus_one: bool = False  # scale by (1 + w), w starting at zero (Gemma's)

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = self.param("scale", _partitioned(init, (self.axis,)), (x.shape[-1],),
                           self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (scale.astype(jnp.float32) + float(self.plus_one))).astype(x.dtype)


def _norm(cfg: ModelConfig, name: str, axis: str = "embed") -> RMSNorm:
    return RMSNorm(cfg.rms_norm_eps, axis=axis, plus_one=cfg.norm_plus_one, name=name)


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


def _dense(features, axes, name, cfg, use_bias=False, in_axes=-1, init_scale=1.0):
    init = nn.initializers.variance_scaling(init_scale, "fan_in", "truncated_normal")
    return nn.DenseGeneral(
        features, axis=in_axes, use_bias=use_bias, name=name,
        dot_general=_dot_f32 if kernels(cfg) == "cpu" else _dot_f32_xla,
        dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
        kernel_init=_partitioned(init, axes),
        bias_init=_partitioned(nn.initializers.zeros, axes[-len(np.atleast_1d(features)):]),
    )


def _projection(x, features, axes, name, cfg, use_bias=False, in_axes=-1):
    """A dense projection of x (a `_dense` named `name`), plus its LoRA adapter's
    (alpha / r) (x A) B where `cfg.lora_targets` names it (`starpo/lora.py`; float32 A and B,
    B zero at init)."""
    y = _dense(features, axes, name, cfg, use_bias, in_axes)(x)
    if not cfg.lora_rank or name not in cfg.lora_targets:
        return y
    n_in = len(np.atleast_1d(in_axes))

    def adapter(features, axes, suffix, init, in_axes):
        return nn.DenseGeneral(
            features, axis=in_axes, use_bias=False, name=f"{name}{suffix}",
            dot_general=_dot_f32 if kernels(cfg) == "cpu" else _dot_f32_xla,
            dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.float32,
            kernel_init=_partitioned(init, axes))

    a_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")
    h = adapter(cfg.lora_rank, axes[:n_in] + ("lora",), "_lora_a", a_init, in_axes)(x)
    b = adapter(features, ("lora",) + axes[n_in:], "_lora_b", nn.initializers.zeros, -1)(h)
    return y + b * (cfg.lora_alpha / cfg.lora_rank)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions, chunk_mask, cache_valid, kv, window=None, write=None,
                 local=None, is_local=None):
        """Attention of a chunk over the cache (read only) and over itself.

        x [B,T,D]; positions [B,T]; chunk_mask [B,T,T] (causal, valid keys, inside the context
        window if any); cache_valid [B,S] (or [B,T,S] per query under a context window) and
        kv = (k, v) [B,K,S,E] of the cache, or None; window: the `TurnWindow` or None (read
        by the cacheless causal path, whose kernels build their masks themselves). Returns
        (out [B,T,D], (k, v) of the chunk [B,T,K,E]) -- the caller writes those into the cache
        in one scatter, so the cache is never copied layer by layer.

        write = (rows, slots [B,T], visible [B,T,S] bool), per-layer buffers (`split_cache`): this
        layer's own cache buffers are updated first -- in place, as nothing reads the old ones
        -- and the chunk attends over the cache alone, slots `visible` to each query. Returns
        (out, the updated (k, v) buffers).

        local: a sliding-window model's masks for its local layers (`_layer_inputs`), and
        is_local whether this layer is one (a traced bool under the scan over layers, a Python
        bool in the loop over split layers); None for a model without sliding layers.
        """
        cfg = self.cfg
        H, K, E = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q = _projection(x, (H, E), ("embed", "heads", "head_dim"), "q", cfg, cfg.qkv_bias)
        k = _projection(x, (K, E), ("embed", "kv_heads", "head_dim"), "k", cfg, cfg.qkv_bias)
        v = _projection(x, (K, E), ("embed", "kv_heads", "head_dim"), "v", cfg, cfg.qkv_bias)
        if cfg.qk_norm:  # each head's query and key normalised over its E dims, then rotated
            q = _norm(cfg, "q_norm", "head_dim")(q)
            k = _norm(cfg, "k_norm", "head_dim")(k)
        B, T = x.shape[:2]

        def rotate(x):
            out = apply_rope(x, positions, rope_inv_freq(cfg))
            if is_local is None:
                return out
            return jnp.where(is_local, apply_rope(x, positions, rope_inv_freq(cfg, True)), out)

        q = rotate(q).reshape(B, T, K, H // K, E) / math.sqrt(cfg.query_scale or E)
        k = rotate(k)
        if is_local is not None:  # a local layer's masks in place of the global ones
            window, chunk_mask, cache_valid, write = _local_masks(
                local, is_local, window, chunk_mask, cache_valid, write)
        if kv is not None:  # what the cache will hold (e.g. bfloat16)
            k, v = k.astype(kv[0].dtype), v.astype(kv[1].dtype)
        else:  # the attention products run in the compute dtype too (float32 accumulation)
            k, v = k.astype(cfg.dtype), v.astype(cfg.dtype)

        def out_proj(out):
            return _projection(out, cfg.hidden_size, ("heads", "head_dim", "embed"), "o", cfg,
                               in_axes=(-2, -1))

        if write is not None:
            out, new_kv = _attend_written_cache(q, k, v, kv, write, decode_kernel(cfg))
            return out_proj(out), new_kv
        if kv is None:  # the training forward: causal over the sequence's valid tokens
            # the last query sees every valid key
            out = _attend_causal(q, k, v, chunk_mask[:, -1], kernels(cfg), window)
        else:
            out = _attend_cache_and_chunk(q, k, v, kv, chunk_mask, cache_valid)
        return out_proj(out), (k, v)


# The three ways a chunk attends. q [B,T,K,G,E] (scaled, rotated); k, v [B,T,K,E] of the chunk;
# a cache (ck, cv) [B,K,S,E]. Each returns the attention output [B,T,H,E] (H = K*G).
_BATCH_BK = ((0, 1), (0, 1))  # dot_general batch dims (b, k) of [B,K,...] operands
# Query tokens per block of attention over a cache (a chunk appended to it): the scores of one
# block, [B,H,S,block] floats, are all that exists at once, not [B,H,S,T] for the whole chunk
# (a 256-token prompt over a 3584-slot cache: 13 GB for 128 rows of Qwen2.5-0.5B, 0.8 GB in
# blocks of 16). Each block reads the cache once more; a turn's decode reads it once a token.
CACHE_QUERY_BLOCK = 16


def _by_query_blocks(attend, q, *per_query):
    """attend(q [B,Q,K,G,E], *per_query [B,Q,...]) -> [B,Q,H,E], run on blocks of
    `CACHE_QUERY_BLOCK` query tokens in turn (a `lax.map`) and joined: the same numbers as on
    all T at once, since each query's softmax is its own. Padding queries (T up to a multiple of `block`) see
    nothing in per-query masks padded with False; their rows are dropped."""
    B, T = q.shape[:2]
    block = CACHE_QUERY_BLOCK  # read when traced (a test sets it)
    if T <= block:
        return attend(q, *per_query)
    n = -(-T // block)

    def blocks(x):  # [B,T,...] -> [n,B,block,...]
        x = jnp.pad(x, [(0, 0), (0, n * block - T)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(B, n, block, *x.shape[2:]), 1, 0)

    out = jax.lax.map(lambda xs: attend(*xs), tuple(blocks(x) for x in (q, *per_query)))
    return jnp.moveaxis(out, 0, 1).reshape(B, n * block, *out.shape[3:])[:, :T]


def _queries_by_kv_head(q, dtype):
    """[B,T,K,G,E] -> [B,K,T*G,E]: the queries of each kv head as the rows of one matmul."""
    B, T, K, G, E = q.shape
    return jnp.moveaxis(q, 1, 2).reshape(B, K, T * G, E).astype(dtype)


def _heads_out(out, T, G):
    """[B,K,T*G,E] -> [B,T,H,E]."""
    B, K, _, E = out.shape
    return jnp.moveaxis(out.reshape(B, K, T, G, E), 2, 1).reshape(B, T, K * G, E)


def _attend_written_cache(q, k, v, kv, write, decode="xla"):
    """Layer by layer (`split_cache`): write the chunk's k, v into this layer's cache buffers
    (in place: nothing reads the old ones), then attend over the cache alone, slots `visible`
    to each query. -> (out, the updated (ck, cv)). decode="pallas": one query a row (a decode
    step) attends in one fused GPU kernel where it runs (`decode_attention.runs`); "pallas_tpu"
    in the TPU's (`tpu_attention.decode_runs`)."""
    rows, slots, visible = write
    ck = kv[0].at[rows, :, slots].set(k, mode="drop")
    cv = kv[1].at[rows, :, slots].set(v, mode="drop")
    if decode == "pallas":
        from starpo import decode_attention

        if decode_attention.runs(q.shape, ck.shape[2]):
            return decode_attention.attend(q, ck, cv, visible), (ck, cv)
    if decode == "pallas_tpu":
        from starpo import tpu_attention

        if tpu_attention.decode_runs(q.shape, ck.shape[2]):
            return tpu_attention.decode(q, ck, cv, visible), (ck, cv)

    def attend(q, visible):  # a block of queries [B,Q,K,G,E], visible [B,Q,S]
        T, G = q.shape[1], q.shape[3]
        qc = _queries_by_kv_head(q, ck.dtype)
        s_cache = jax.lax.dot_general(ck, qc, (((3,), (3,)), _BATCH_BK),
                                      preferred_element_type=jnp.float32)  # [B,K,S,T*G]
        visible = jnp.repeat(jnp.swapaxes(visible, 1, 2), G, axis=2)  # [B,S,T*G]
        s_cache = jnp.where(visible[:, None], s_cache, _MASK_VALUE)
        p_cache = jnp.swapaxes(jax.nn.softmax(s_cache, axis=2), 2, 3).astype(cv.dtype)
        out = jax.lax.dot_general(p_cache, cv, (((3,), (2,)), _BATCH_BK),
                                  preferred_element_type=jnp.float32)  # [B,K,T*G,E]
        return _heads_out(out, T, G)

    return _by_query_blocks(attend, q, visible), (ck, cv)


def _attend_causal(q, k, v, valid, kernel="cpu", window=None):
    """The training forward: causal attention over the sequence's valid keys (valid [B,T]),
    by `kernel` ("cpu", "xla", "cudnn" or "splash", see `ATTENTION`); window: a `TurnWindow`
    or None."""
    if kernel == "splash":
        from starpo import tpu_attention

        as_segments = (window is not None and window.segments and window.size == 1
                       and not window.sliding)
        if tpu_attention.causal_fallback(q.shape[1], window is not None and not as_segments
                                         ) is None:
            return tpu_attention.causal(q, k, v, valid,
                                        segments=window.turns if as_segments else None)
        kernel = "xla"
    if kernel != "cpu":
        return _attend_dot_product(q, k, v, valid, kernel, window)
    T, G = q.shape[1], q.shape[3]
    qh = _queries_by_kv_head(q, k.dtype)
    out = causal_attention(qh, jnp.moveaxis(k, 1, 2), jnp.moveaxis(v, 1, 2), valid, G,
                           attention_block(T), window)  # [B,K,T*G,E]
    return _heads_out(out, T, G)


def _attend_dot_product(q, k, v, valid, kernel, window=None):
    """`jax.nn.dot_product_attention` (GQA: query head k*G+g reads kv head k, as here).

    Each query sees the valid keys at or before it and always itself, so that a padding query
    has a key (an all-masked row's flash softmax is NaN, which would reach the valid rows'
    gradients through 0 * NaN; its output is not used). "xla" recomputes its [B,H,T,S] scores
    in the backward pass instead of keeping them; cuDNN keeps only per-row softmax statistics
    (a boolean mask is an additive [B,1,T,S] bias there). Where cuDNN would refuse the shapes
    or dtype one way or the other (`cudnn_refusal`), "xla" runs instead."""
    B, T, K, G, E = q.shape
    qh = q.reshape(B, T, K * G, E).astype(k.dtype)

    def attend(q, k, v, valid, window, implementation):
        t = jnp.arange(T, dtype=jnp.int32)
        seen = valid[:, None, :]
        if window is not None:
            seen = seen & window.visible(slice(None), slice(None))
        mask = (seen | (t[:, None] == t[None, :]))[:, None]  # [B,1,T,S]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=1.0, is_causal=True,
                                            implementation=implementation)

    if kernel == "cudnn" and cudnn_refusal(str(k.dtype), E, gpu_capability(), T) is None:
        return attend(qh, k, v, valid, window, "cudnn")
    # the mask too is made inside: only q, k, v, valid (and the window) are kept for the
    # backward
    return jax.checkpoint(functools.partial(attend, implementation="xla"))(qh, k, v, valid,
                                                                           window)


def _attend_cache_and_chunk(q, k, v, kv, chunk_mask, cache_valid):
    """One softmax over [cache slots, chunk] without concatenating the cache. Both products
    keep (b, k) as leading batch dims and the cache as the big operand in its stored layout: no
    per-step transpose or copy of the cache (which used to cost more than the whole model).
    cache_valid: [B,S] slots every query sees, or [B,T,S] per query (a context window).
    A long chunk (a prompt) runs in blocks of `CACHE_QUERY_BLOCK` queries."""
    if cache_valid.ndim == 2:
        return _by_query_blocks(
            lambda q, m: _attend_cache_and_chunk_block(q, k, v, kv, m, cache_valid),
            q, chunk_mask)
    return _by_query_blocks(
        lambda q, m, c: _attend_cache_and_chunk_block(q, k, v, kv, m, c), q, chunk_mask,
        cache_valid)


def _attend_cache_and_chunk_block(q, k, v, kv, chunk_mask, cache_valid):
    """`_attend_cache_and_chunk` of T queries q [B,T,K,G,E] over the cache and the chunk's
    keys k, v [B,C,K,E]: chunk_mask [B,T,C], cache_valid [B,S] or [B,T,S]."""
    B, T, K, G, E = q.shape
    s = jnp.where(chunk_mask[:, None, None],
                  mixed_einsum("btkge,bske->bkgts", q.astype(k.dtype), k), _MASK_VALUE)
    ck, cv = kv
    # cache scores [B,K,S,T*G]: the cache [S,E] times the queries transposed
    s_cache = jax.lax.dot_general(ck, _queries_by_kv_head(q, ck.dtype), (((3,), (3,)), _BATCH_BK),
                                  preferred_element_type=jnp.float32)
    if cache_valid.ndim == 2:
        seen = cache_valid[:, None, :, None]
    else:  # per query: [B,T,S] -> [B,1,S,T*G] (query row t*G + g)
        seen = jnp.repeat(jnp.swapaxes(cache_valid, 1, 2), G, axis=2)[:, None]
    s_cache = jnp.where(seen, s_cache, _MASK_VALUE)

    def per_query(stat):  # [B,K,G,T] chunk statistic -> [B,K,T*G]
        return jnp.swapaxes(stat, 2, 3).reshape(B, K, T * G)

    def per_head(stat):  # [B,K,T*G] -> [B,K,G,T,1]
        return jnp.swapaxes(stat.reshape(B, K, T, G), 2, 3)[..., None]

    top = jnp.maximum(s_cache.max(2), per_query(s.max(-1)))  # [B,K,T*G]
    e_cache = jnp.exp(s_cache - top[:, :, None])
    e = jnp.exp(s - per_head(top))
    norm = e_cache.sum(2) + per_query(e.sum(-1))
    # probabilities [B,K,T*G,S] (small) times the cache [S,E]: a plain matmul
    p_cache = jnp.swapaxes(e_cache / norm[:, :, None], 2, 3).astype(cv.dtype)
    out = jax.lax.dot_general(p_cache, cv, (((3,), (2,)), _BATCH_BK),
                              preferred_element_type=jnp.float32)  # [B,K,T*G,E]
    out = jnp.moveaxis(out.reshape(B, K, T, G, E), 2, 1)
    p = e / per_head(norm)
    out = out + mixed_einsum("bkgts,bske->btkge", p.astype(v.dtype), v)
    return out.reshape(B, T, K * G, E)


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        gate = _projection(x, cfg.intermediate_size, ("embed", "mlp"), "gate", cfg)
        up = _projection(x, cfg.intermediate_size, ("embed", "mlp"), "up", cfg)
        act = ACTIVATIONS[cfg.activation]
        return _projection(act(gate) * up, cfg.hidden_size, ("mlp", "embed"), "down", cfg)


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, kv, shared, is_local=None):
        cfg = self.cfg
        positions, chunk_mask, cache_valid, window, local, *write = shared
        h, kv = Attention(cfg, name="attn")(
            _norm(cfg, "attn_norm")(x), positions, chunk_mask, cache_valid, kv, window,
            *(write or [None]), local=local, is_local=is_local)
        if cfg.sandwich_norms:
            h = _norm(cfg, "attn_post_norm")(h)
        x = x + h
        h = MLP(cfg, name="mlp")(_norm(cfg, "mlp_norm")(x))
        if cfg.sandwich_norms:
            h = _norm(cfg, "mlp_post_norm")(h)
        return constrain(x + h, ACTIVATION_AXES), kv


def row_positions(valid) -> jax.Array:
    """Rotary positions int32[B,T] of a row's tokens: the real tokens before each (padding
    takes its predecessor's)."""
    return jnp.maximum(jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1, 0)


def _layer_inputs(valid, cache: KVCache | None, fresh: bool = False,
                  window: TurnWindow | None = None, split: bool = False, positions=None,
                  sliding: int = 0):
    """The geometry of a chunk (valid [B,T] bool), as every layer gets it: (shared, kv, write_at).

    shared = (positions, chunk_mask, cache_valid, window, local[, write]) goes to each `Block`
    alike (see `Attention`): rotary positions [B,T] counting real tokens only, the causal chunk
    mask [B,T,T] over valid keys, the cache slots seen, and with `sliding` (a sliding window of
    that many positions) the local layers' versions of those masks (`local`, else None).
    kv = the cache's (k, v) the layers read (stacked, or per-layer tuples when `split`), None
    without a cache or when `fresh`. write_at = (rows, slots) [B,T] where the chunk's tokens go
    in the cache (padding out of range: dropped), None without one. positions: the rotary
    positions [B,T] given (no cache)."""
    shared, kv, write_at = _global_inputs(valid, cache, fresh, window, split, positions)
    local = None
    if sliding:
        local = _sliding_inputs(shared, cache, fresh, split, write_at, sliding)
    return (*shared[:4], local, *shared[4:]), kv, write_at


def _global_inputs(valid, cache, fresh, window, split, positions):
    B, T = valid.shape
    t = jnp.arange(T, dtype=jnp.int32)
    chunk_mask = valid[:, None, :] & (t[None, :, None] >= t[None, None, :])  # [B,T,T]
    if positions is not None:
        if cache is not None:
            raise ValueError("rotary positions are given only to a forward without a cache")
        return (positions.astype(jnp.int32), chunk_mask, None, window), None, None
    positions = row_positions(valid)
    if cache is None:
        return (positions, chunk_mask, None, window), None, None
    positions = positions + cache.pos[:, None]
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    slots = jnp.where(valid, cache.end[:, None] + t[None, :], cache.max_len)
    kv, cache_valid = (cache.k, cache.v), cache.valid
    if split and not fresh:
        # each layer writes its own buffers first, then attends over the slots visible to a
        # query: those that held a token already or get a valid chunk token t' <= t, inside
        # t's window (the slots' turns once the chunk's are written)
        col = jnp.arange(cache.max_len, dtype=jnp.int32)[None, :] - cache.end[:, None]  # [B,S]
        in_chunk = (col >= 0) & (col < T) & jnp.take_along_axis(valid, jnp.clip(col, 0, T - 1),
                                                               axis=1)
        visible = cache_valid[:, None, :] | (in_chunk[:, None, :]
                                             & (col[:, None, :] <= t[None, :, None]))
        if window is not None:
            visible = visible & window_mask(window.turns,
                                            _written_turns(cache, rows, slots, window),
                                            window.size)
        write = (rows, slots, visible)
        return (positions, chunk_mask, cache_valid, window, write), kv, (rows, slots)
    if fresh:  # an empty cache: the chunk attends causally to itself alone
        return (positions, chunk_mask, None, window), None, (rows, slots)
    if window is not None:  # (the causal kernels of the cacheless path mask for themselves)
        chunk_mask = chunk_mask & window_mask(window.turns, window.turns, window.size)
        cache_valid = cache_valid[:, None, :] & window_mask(window.turns, _cache_turns(cache),
                                                            window.size)
    return (positions, chunk_mask, cache_valid, window), kv, (rows, slots)


def _sliding_inputs(shared, cache, fresh, split, write_at, size):
    """The local layers' masks: keys of the last `size` rotary positions, the query's own
    included. A slot's position is the count of valid slots before it (slots are written in
    order, and a valid slot is never overwritten)."""
    positions, chunk_mask, cache_valid, window, *write = shared
    local = dict(window=None, chunk_mask=None, cache_valid=None, visible=None)
    if cache is None or fresh:  # the causal kernels' window: any over turns, and this one
        local["window"] = (TurnWindow(None, 0) if window is None else window).replace(
            positions=positions, sliding=size)
        return local
    slot_pos = jnp.cumsum(cache.valid, axis=1, dtype=jnp.int32) - 1  # [B,S] (valid slots)
    if split:
        rows, slots = write_at
        written = slot_pos.at[rows, slots].set(positions, mode="drop")
        local["visible"] = write[0][2] & window_mask(positions, written, size)
        return local
    local["chunk_mask"] = chunk_mask & window_mask(positions, positions, size)
    seen = cache_valid[:, None, :] if cache_valid.ndim == 2 else cache_valid  # [B,T,S]
    local["cache_valid"] = seen & window_mask(positions, slot_pos, size)
    return local


def _local_masks(local, is_local, window, chunk_mask, cache_valid, write):
    """A layer's (window, chunk_mask, cache_valid, write): the local versions where is_local
    (a Python bool: chosen here; traced: selected elementwise)."""
    def pick(a, b):
        if isinstance(is_local, bool):
            return a if is_local else b
        return jnp.where(is_local, a, b)

    if local["window"] is not None:  # the sliding criterion applies where local
        window = local["window"].replace(local=is_local)
    if local["chunk_mask"] is not None:
        chunk_mask = pick(local["chunk_mask"], chunk_mask)
        if not isinstance(is_local, bool) or is_local:
            cache_valid = pick(local["cache_valid"], jnp.broadcast_to(
                cache_valid[:, None, :] if cache_valid.ndim == 2 else cache_valid,
                local["cache_valid"].shape))
    if local["visible"] is not None:
        rows, slots, visible = write
        write = (rows, slots, pick(local["visible"], visible))
    return window, chunk_mask, cache_valid, write


def _advance(cache: KVCache, valid, rows, slots, k, v, window=None) -> KVCache:
    """The cache after writing a chunk: new k/v buffers, valid slots, `end` and `pos` (and the
    slots' turns under a context window)."""
    t = jnp.arange(valid.shape[1], dtype=jnp.int32)
    last = jnp.max(jnp.where(valid, t[None, :], -1), axis=1)
    return KVCache(
        k=k, v=v, valid=cache.valid.at[rows, slots].set(True, mode="drop"),
        end=jnp.where(last >= 0, cache.end + last + 1, cache.end).astype(jnp.int32),
        pos=cache.pos + valid.sum(axis=1, dtype=jnp.int32),
        turn=_written_turns(cache, rows, slots, window))


def _cache_turns(cache: KVCache):
    if cache.turn is None:
        raise ValueError("a TurnWindow over a cache needs the cache's turn ids "
                         "(init_cache(..., turns=True))")
    return cache.turn


def _written_turns(cache: KVCache, rows, slots, window):
    """The cache's slot turns with the chunk's written (unchanged without a window)."""
    if window is None:
        return cache.turn
    return _cache_turns(cache).at[rows, slots].set(window.turns, mode="drop")


class Transformer(nn.Module):
    """The decoder's parameters and its two ends (embedding, final norm, heads). The forward is
    `hidden_states`; the module declares the layers as one `nn.scan` of `Block` (each weight
    stacked [L,...] under `layers`, logical axis "layers" first), which `init_all` runs once."""

    cfg: ModelConfig

    def setup(self):
        cfg = self.cfg
        # the residual stream stays float32 whatever the matmul dtype
        self.embed = nn.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=jnp.float32,
            param_dtype=jnp.dtype(cfg.param_dtype),
            embedding_init=_partitioned(nn.initializers.normal(0.02), ("vocab", "embed")))
        V, D, r = cfg.vocab_size, cfg.hidden_size, cfg.lora_rank
        if self._adapted("embed"):  # LoRA on the token lookup (the input side only)
            self.embed_lora_a = self.param(
                "embed_lora_a", _partitioned(nn.initializers.normal(1.0), ("vocab", "lora")),
                (V, r), jnp.float32)
            self.embed_lora_b = self.param(
                "embed_lora_b", _partitioned(nn.initializers.zeros, ("lora", "embed")),
                (r, D), jnp.float32)
        if self._adapted("lm_head"):  # LoRA on the output head (tied or not)
            self.lm_head_lora_a = self.param(
                "lm_head_lora_a", _partitioned(
                    nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform"),
                    ("embed", "lora")), (D, r), jnp.float32)
            self.lm_head_lora_b = self.param(
                "lm_head_lora_b", _partitioned(nn.initializers.zeros, ("lora", "vocab")),
                (r, V), jnp.float32)
        self.layers = nn.scan(
            Block, variable_axes={"params": 0}, split_rngs={"params": True},
            in_axes=(0, nn.broadcast), length=cfg.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(cfg)
        self.final_norm = RMSNorm(cfg.rms_norm_eps, plus_one=cfg.norm_plus_one)
        if not cfg.tie_embeddings:
            self.lm_head = _dense(cfg.vocab_size, ("embed", "vocab"), "lm_head", cfg)
        if cfg.value_head:
            self.value_head = nn.Dense(
                1, dtype=jnp.float32, param_dtype=jnp.dtype(cfg.param_dtype),
                kernel_init=_partitioned(nn.initializers.zeros, ("embed", None)),
                bias_init=_partitioned(nn.initializers.zeros, (None,)))

    def embed_tokens(self, tokens):
        """tokens [B,T] -> float32 embeddings [B,T,D], rows on the mesh's batch axes.

        The lookup reads the whole table (gathered on a mesh, as FSDP gathers every weight
        where it is used): a gather from a table split over vocabulary and width cannot yield
        rows split over the batch without the compiler replicating everything."""
        table = constrain(self.embed.embedding, (None, None))
        x = jnp.take(table, tokens, axis=0).astype(jnp.float32)
        if self.cfg.embed_scale:  # Gemma's: the table's rows times sqrt(width)
            x = x * jnp.float32(math.sqrt(self.cfg.hidden_size))
        if self._adapted("embed"):  # + (alpha / r) A[tokens] B
            a = jnp.take(constrain(self.embed_lora_a, (None, None)), tokens, axis=0)
            x = x + self._lora_scale() * jnp.dot(a, self.embed_lora_b,
                                                 precision=jax.lax.Precision.HIGHEST)
        return constrain(x, ACTIVATION_AXES)

    def _adapted(self, target: str) -> bool:
        return bool(self.cfg.lora_rank) and target in self.cfg.lora_targets

    def _lora_scale(self) -> float:
        return self.cfg.lora_alpha / self.cfg.lora_rank

    def final_hidden(self, x):
        return self.final_norm(x)

    def logits(self, hidden):
        """hidden [...,D] -> float32 logits [...,V]."""
        if self.cfg.tie_embeddings:
            dt = jnp.dtype(self.cfg.dtype)
            table = self.embed.embedding.astype(dt)  # [V,D]
            rows = hidden.reshape(-1, hidden.shape[-1]).astype(dt)
            if kernels(self.cfg) == "cpu":
                out = _matmul(rows, table, 1)
            else:
                out = _dot_f32_xla(rows, table, (((1,), (1,)), ((), ())))
            out = out.reshape(*hidden.shape[:-1], table.shape[0])
        else:
            out = self.lm_head(hidden)
        if self._adapted("lm_head"):  # + (alpha / r) (h A) B, never the [D,V] delta
            low = jnp.dot(hidden.astype(jnp.float32), self.lm_head_lora_a,
                          precision=jax.lax.Precision.HIGHEST)
            out = out + self._lora_scale() * jnp.dot(low, self.lm_head_lora_b,
                                                     precision=jax.lax.Precision.HIGHEST)
        return out.astype(jnp.float32)

    def values(self, hidden):
        """hidden [...,D] -> float32 scalar values [...] (the critic's head)."""
        return self.value_head(hidden.astype(jnp.float32))[..., 0]

    def init_all(self, tokens, valid):
        """Touch every parameter (used only by `init`)."""
        shared, _, _ = _layer_inputs(valid, None)
        x, _ = self.layers(self.embed_tokens(tokens), None, shared)
        hidden = self.final_norm(x)
        out = self.logits(hidden)
        if self.cfg.value_head:
            out = out.sum() + self.values(hidden).sum()
        return out


# ----------------------------------------------------------------------------- functional API
def _init_boxed(cfg: ModelConfig, key: jax.Array):
    tokens = jnp.zeros((1, 1), jnp.int32)
    return Transformer(cfg).init(key, tokens, tokens > -1, method=Transformer.init_all)["params"]


def _per_config(build):
    """`build(cfg)`, made once per config and context mesh (tracing the whole model's init
    costs ~0.1 s, and a run, its tests and its sharding ask for the same config's shapes many
    times); each call gets fresh containers over the shared immutable leaves."""
    made = functools.lru_cache(maxsize=64)(lambda cfg, mesh: build(cfg))

    @functools.wraps(build)
    def get(cfg: ModelConfig):
        return jax.tree_util.tree_map(lambda x: x, made(cfg, jax.sharding.get_abstract_mesh()))

    return get


@functools.lru_cache(maxsize=64)
def _init_fn(cfg: ModelConfig):
    return jax.jit(lambda k: nn.meta.unbox(_init_boxed(cfg, k)))


def init_params(cfg: ModelConfig, key: jax.Array):
    """Random parameters for `cfg`: a nested dict of arrays."""
    return _init_fn(cfg)(key)


@_per_config
def abstract_params(cfg: ModelConfig):
    """Shapes and dtypes of the parameters (jax.ShapeDtypeStruct leaves), nothing allocated."""
    return jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))


@_per_config
def logical_axes(cfg: ModelConfig):
    """A pytree like the params whose leaves are PartitionSpecs of logical axis names."""
    return nn.get_partition_spec(jax.eval_shape(lambda k: _init_boxed(cfg, k), jax.random.key(0)))


def param_shardings(cfg: ModelConfig, mesh):
    """NamedShardings of the parameters on `mesh`: `sharding.RULES` over `logical_axes`."""
    return tree_shardings(logical_axes(cfg), abstract_params(cfg), mesh)


def forward(params, cfg: ModelConfig, tokens, valid, cache: KVCache | None = None):
    """Logits [B,T,V] (float32) and the updated cache."""
    hidden, cache = hidden_states(params, cfg, tokens, valid, cache)
    return head_logits(params, cfg, hidden), cache


def hidden_states(params, cfg: ModelConfig, tokens, valid, cache: KVCache | None = None,
                  fresh: bool = False, window: TurnWindow | None = None, positions=None):
    """tokens [B,T] int, valid [B,T] bool -> (final-norm hidden states [B,T,D], new cache or
    None); the heads are applied separately (`head_logits`, `head_values`). The one forward:
    the training forward, a cache append and a decode step all run here.

    Without a cache the chunk attends causally to its own valid tokens (training forward).
    With a cache the chunk also attends to every valid cache slot, and its valid tokens are
    written at slots `cache.end[b] + t`; the returned cache has `end` just past the row's
    last valid token (so right padding is overwritten by the next call) and `pos` advanced
    by the number of valid tokens. Rows with no valid token are left bit for bit as they
    were; valid tokens that would land past the cache's end are dropped (callers check
    room first, see `sampler`).

    fresh=True promises that the cache holds nothing yet (a first prefill): the chunk then
    attends causally to itself alone, as without a cache (`causal_attention`, skipping
    the empty slots), and its keys/values are written as usual (stacked or split buffers).

    window: a `TurnWindow` (the chunk's turns) or None (everything causal is seen). With a
    cache its slots' turns are read from and written into `cache.turn`.

    positions: int [B,T], each token's rotary position, for a forward without a cache whose
    rows are not one sequence each (`update.packed_hidden`: a group's shared prompt and its
    replies, each reply placed after the prompt); default: the valid tokens before it.

    Stacked params and cache ([L,...]) run as one scan over the layers, so any depth compiles
    like one layer; with `split_layers` params or a `split_cache` cache the layers run as a
    loop over per-layer buffers (see "split buffers" below). The numbers are the same.
    """
    valid = valid.astype(bool)
    split = is_split(params["layers"]) or (cache is not None and is_split(cache.k))
    stacked_cache = cache is not None and not is_split(cache.k)
    if split:
        params = split_layers(params)
        cache = None if cache is None else split_cache(cache)
    shared, kv, write_at = _layer_inputs(valid, cache, fresh, window, split, positions,
                                         cfg.sliding_window)
    heads = {"params": _heads_only(params)}
    model = Transformer(cfg)
    x = model.apply(heads, tokens, method=Transformer.embed_tokens)
    x, (k, v) = _run_layers(cfg, params["layers"], x, kv, shared)
    hidden = model.apply(heads, x, method=Transformer.final_hidden)
    if cache is None:
        return hidden, None
    rows, slots = write_at
    if not split:
        # One scatter per buffer writes every layer's new keys/values in place (the cache is
        # donated by the sampler); padding goes to an out-of-range slot and is dropped.
        k = cache.k.at[:, rows, :, slots].set(jnp.moveaxis(k, 0, 2), mode="drop")
        v = cache.v.at[:, rows, :, slots].set(jnp.moveaxis(v, 0, 2), mode="drop")
    elif fresh:  # the layers returned the chunk's keys/values: each into its layer's buffer
        k = tuple(b.at[rows, :, slots].set(x, mode="drop") for b, x in zip(cache.k, k))
        v = tuple(b.at[rows, :, slots].set(x, mode="drop") for b, x in zip(cache.v, v))
    new_cache = _advance(cache, valid, rows, slots, k, v, window)
    return hidden, stack_cache(new_cache) if stacked_cache else new_cache


def _run_layers(cfg: ModelConfig, layers, x, kv, shared):
    """`Block` over every layer: x [B,T,D] -> (x, (k, v)).

    Stacked params `layers` [L,...] (with the stacked cache (k, v) [L,...], or None) run as one
    `lax.scan`; the (k, v) returned are the chunk's [L,B,T,K,E]. Per-layer params (a tuple,
    `split_layers`) run as a Python loop, layer i reading the cache buffers (k[i], v[i]); the
    (k, v) returned are tuples of what each layer returns (its updated buffers, see
    `Attention`). Under `cfg.remat` each layer is rematerialised in the backward pass."""
    def block(layer, x, kv, shared, is_local):
        return Block(cfg).apply({"params": layer}, x, kv, shared, is_local)

    if cfg.remat:
        block = jax.checkpoint(block, prevent_cse=False, policy=REMAT_POLICIES[cfg.remat_policy])
    local = [i in cfg.local_layers for i in range(cfg.num_layers)]
    if not is_split(layers):
        def step(x, layer_kv):
            layer, kv, is_local = layer_kv
            return block(layer, x, kv, shared, is_local)
        flags = jnp.asarray(local) if cfg.local_layers else None
        return jax.lax.scan(step, x, (layers, kv, flags))
    ks, vs = [], []
    for i, layer in enumerate(layers):
        x, (k, v) = block(layer, x, None if kv is None else (kv[0][i], kv[1][i]), shared,
                          local[i] if cfg.local_layers else None)
        ks.append(k)
        vs.append(v)
    return x, (tuple(ks), tuple(vs))


def head_logits(params, cfg: ModelConfig, hidden):
    return Transformer(cfg).apply({"params": _heads_only(params)}, hidden,
                                  method=Transformer.logits)


def head_values(params, cfg: ModelConfig, hidden):
    return Transformer(cfg).apply({"params": _heads_only(params)}, hidden,
                                  method=Transformer.values)


# ----------------------------------------------------------------------------- split buffers
# Decoding one token per row is bound by memory traffic. Under the layer scan every step
# dynamic-slices each layer's weights and [B,K,S,E] cache block out of the stacked arrays,
# and on CPU each such slice is a real copy (the matmul libraries need a plain buffer): about
# as much traffic again as the attention itself. Split once per sampler call into per-layer
# arrays (weights and cache), then each decode step reads every buffer in place and writes
# its new keys/values into the layer's own buffer.
def is_split(x) -> bool:
    return isinstance(x, (tuple, list))


def _heads_only(params):
    """The parameters the heads and the embedding use (the layers are not touched)."""
    return {name: p for name, p in params.items() if name != "layers"}


def split_layers(params):
    """Params whose stacked `layers` subtree [L,...] becomes a tuple of L per-layer subtrees
    (a copy of the layer weights: do it once, outside a decode loop)."""
    layers = params["layers"]
    if is_split(layers):
        return params
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]
    return {**params, "layers": tuple(jax.tree_util.tree_map(lambda p, i=i: p[i], layers)
                                      for i in range(n))}


def split_cache(cache: KVCache) -> KVCache:
    """The cache with k and v as tuples of per-layer [B,K,S,E] arrays (see `stack_cache`)."""
    if is_split(cache.k):
        return cache
    n = cache.k.shape[0]
    return cache.replace(k=tuple(cache.k[i] for i in range(n)),
                         v=tuple(cache.v[i] for i in range(n)))


def stack_cache(cache: KVCache) -> KVCache:
    """Inverse of `split_cache`: k and v as stacked [L,B,K,S,E] arrays."""
    if not is_split(cache.k):
        return cache
    return cache.replace(k=jnp.stack(cache.k), v=jnp.stack(cache.v))
