"""Norms and dense projections (with their logical axes and the kernels' matmuls)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from starpo.model.ops import _dot_f32, _dot_f32_xla, kernels
from starpo.model.spec import ModelConfig


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
