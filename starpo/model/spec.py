"""The model's static description (`ModelConfig`), its constants, and rotary embeddings."""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from starpo.families import FAMILIES
from starpo.schema import ATTENTION, DECODE_ATTENTION
from starpo.schema import REMAT_POLICIES as _REMAT_NAMES


# A finite "minus infinity": a padding query with no visible key gets a uniform (finite)
# attention row instead of NaN, which would otherwise poison gradients through `where`.
_MASK_VALUE = -1e30
# `ModelConfig.remat_policy` -> the jax.checkpoint policy of a rematerialised layer
REMAT_POLICIES = {"full": None,
                  "save_dense": jax.checkpoint_policies.save_only_these_names("dense")}
assert tuple(REMAT_POLICIES) == _REMAT_NAMES
# the residual stream's logical axes: rows split over the mesh's batch axes, width whole
ACTIVATION_AXES = ("batch", "length", "act_embed")
# `ModelConfig.attention` (its choices `schema.ATTENTION`): the kernels of the training forward
# (and a first prefill) and of every dense layer. "cpu": attention in causal query blocks with a
# written-out backward (`causal_attention`) and dense layers as 2-D matmuls with a written-out
# backward (`_matmul`), both tuned for XLA:CPU. "xla": `jax.nn.dot_product_attention`'s XLA
# implementation, its [T,S] scores recomputed in the backward pass (`jax.checkpoint`), and plain
# `dot_general` dense layers. "cudnn": the same with cuDNN's fused flash attention (NVIDIA GPUs,
# bfloat16 or float16). "splash": JAX's splash attention, a Pallas TPU kernel
# (`tpu_attention.causal`), with "xla"'s dense layers; XLA's attention where its static shapes do
# not suit it (`tpu_attention.causal_fallback`: a context window, under 128 tokens). "auto": "cpu"
# on CPU; on an NVIDIA GPU "cudnn" where it takes the shapes and dtype, else "xla"; "splash" on a
# TPU. All give the same numbers to float rounding (tests/test_model.py, test_tpu_attention.py).
# `ModelConfig.decode_attention` (`schema.DECODE_ATTENTION`), a decode step's attention: XLA's
# ops, or one fused kernel a layer: "pallas" the GPU's (starpo/decode_attention.py, Triton),
# "pallas_tpu" the TPU's (`tpu_attention.decode`, Mosaic); each interpreted off its platform
# (tests). "auto": "pallas_tpu" on a TPU, else "xla". The kernels' modules are imported only where
# used: Pallas loads late.
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
