"""The decoder: `MLP`, `Block` and `Transformer` (the layers as a scan or a loop)."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from starpo.model.attend import Attention
from starpo.model.dense import RMSNorm, _dense, _norm, _partitioned, _projection
from starpo.model.masks import _layer_inputs
from starpo.model.ops import _dot_f32_xla, _matmul, kernels
from starpo.model.spec import ACTIVATIONS, ACTIVATION_AXES, ModelConfig
from starpo.sharding import constrain


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
