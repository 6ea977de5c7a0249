"""A slow, independent NumPy forward pass over Hugging Face-layout tensors.

Written from the Llama/Qwen2 definitions (not from starpo.model): Linear weights are [out, in],
rotary embeddings rotate the two halves of each head, Llama-3 scaling follows its published
formula, and attention repeats each kv head for its group of query heads.
"""

import math

import numpy as np


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def inv_freq(head_dim, theta, scaling=None):
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    if scaling is None:
        return freqs
    factor, low, high, old = scaling
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def rope(x, positions, freqs):
    """x [T, N, E]; positions [T]."""
    ang = positions[:, None] * freqs[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def forward(t, c, ids, positions=None, visible=None):
    """Logits [T, V] of one unpadded sequence. t: HF tensor dict; c: dict of config numbers;
    positions [T]: the tokens' rotary positions (default 0 .. T-1); visible [T, T] bool: the
    keys each query attends to in every layer (default causal: s <= t)."""
    f64 = {k: np.asarray(v, np.float64) for k, v in t.items()}
    x = f64["model.embed_tokens.weight"][np.asarray(ids)]
    T = len(ids)
    H, K, E = c["heads"], c["kv_heads"], c["head_dim"]
    pos = np.arange(T, dtype=np.float64) if positions is None else np.asarray(positions, float)
    freqs = inv_freq(E, c["theta"], c.get("scaling"))
    causal = np.tril(np.ones((T, T), bool)) if visible is None else np.asarray(visible, bool)
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, f64[p + "input_layernorm.weight"], c["eps"])

        def proj(name, n):
            y = h @ f64[p + f"self_attn.{name}_proj.weight"].T
            if p + f"self_attn.{name}_proj.bias" in f64:
                y = y + f64[p + f"self_attn.{name}_proj.bias"]
            return y.reshape(T, n, E)

        q, k = proj("q", H), proj("k", K)
        if p + "self_attn.q_norm.weight" in f64:  # Qwen3: each head normalised before rotary
            q = rms_norm(q, f64[p + "self_attn.q_norm.weight"], c["eps"])
            k = rms_norm(k, f64[p + "self_attn.k_norm.weight"], c["eps"])
        q, k, v = rope(q, pos, freqs), rope(k, pos, freqs), proj("v", K)
        out = np.zeros((T, H, E))
        for head in range(H):
            kv = head // (H // K)
            s = q[:, head] @ k[:, kv].T / math.sqrt(E)
            s = np.where(causal, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(T, H * E) @ f64[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, f64[p + "post_attention_layernorm.weight"], c["eps"])
        g = h @ f64[p + "mlp.gate_proj.weight"].T
        u = h @ f64[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ f64[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, f64["model.norm.weight"], c["eps"])
    head = f64.get("lm_head.weight", f64["model.embed_tokens.weight"])
    return x @ head.T
