"""GGUF files (llama.cpp's layout): metadata to a config, tensors (Q/K rows un-interleaved,
Gemma's norms less their stored 1) to our tree."""

from __future__ import annotations

import os

import numpy as np

from starpo import families
from starpo.model import ModelConfig
from starpo.tokenizer import Tokenizer
from starpo.weights.tensors import LoadError, loaded


# ----------------------------------------------------------------------------- GGUF files
def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleaving: [n_head*E, ...] back to half-split order."""
    e = w.shape[0] // n_head
    return w.reshape(n_head, e // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row interleaving (what its converter writes); used by tests and export."""
    e = w.shape[0] // n_head
    return w.reshape(n_head, 2, e // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_reader(path: str):
    import gguf

    if not os.path.isfile(path):
        raise LoadError(f"{path}: no such model file")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct errors/IndexError on damage
        raise LoadError(f"{path}: cannot read GGUF file ({type(e).__name__}: {e})") from None


def gguf_metadata(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # a field type this gguf version cannot decode: not one we use
            continue
    return out


# llama.cpp's fixed Gemma 3 settings (its GGUF files carry only the window): every sixth layer
# global, local layers rotated with base 10000 unscaled, scores scaled by head_dim ** -0.5 (by
# (width / heads) ** -0.5 for the 62-layer 27B model)
GGUF_GEMMA3_PATTERN, GGUF_GEMMA3_LOCAL_THETA, GGUF_GEMMA3_27B_LAYERS = 6, 10000.0, 62


def config_from_gguf(meta: dict, tensor_names: set[str], source: str, **overrides) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in families.BY_GGUF_ARCHITECTURE:
        raise LoadError(f"{source}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(families.BY_GGUF_ARCHITECTURE)})")
    fam = families.BY_GGUF_ARCHITECTURE[arch]
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in tensor_names or scaling not in ("none", "linear"):
        raise LoadError(f"{source}: rope scaling {scaling!r} in GGUF files is not supported; "
                        "load the Hugging Face checkpoint instead")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if meta.get(f"{arch}.{key}"):
            raise LoadError(f"{source}: {arch}.{key} is not supported")

    def need(key):
        if f"{arch}.{key}" not in meta:
            raise LoadError(f"{source}: metadata {arch}.{key} is missing")
        return meta[f"{arch}.{key}"]

    heads, width = int(need("attention.head_count")), int(need("embedding_length"))
    layers = int(need("block_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", width // heads))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    fields = dict(
        fam.fields(), vocab_size=int(vocab), hidden_size=width, num_layers=layers,
        num_heads=heads, num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim, intermediate_size=int(need("feed_forward_length")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 8192)),
    )
    fields["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names
    if scaling == "linear":
        fields["rope_linear"] = float(need("rope.scaling.factor"))
    if fam.sliding_layers:
        fields.update(
            sliding_window=int(need("attention.sliding_window")),
            local_layers=tuple(i for i in range(layers) if (i + 1) % GGUF_GEMMA3_PATTERN),
            local_rope_theta=GGUF_GEMMA3_LOCAL_THETA,
            query_scale=float(width // heads if layers == GGUF_GEMMA3_27B_LAYERS else head_dim))
    return ModelConfig(**{**fields, **overrides})


def load_gguf(path: str, **overrides):
    """(cfg, params, tokenizer) from a GGUF file, dequantised to float32."""
    import gguf

    reader = _gguf_reader(path)
    meta = gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    cfg = config_from_gguf(meta, set(tensors), path, **overrides)
    fam = families.BY_GGUF_ARCHITECTURE[meta["general.architecture"]]
    permute = fam.gguf_permutes_qk

    def get(name):
        t = tensors.get(name)
        if t is None:
            return None
        try:
            x = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        except Exception as e:
            raise LoadError(f"{path}: cannot decode tensor {name} ({e})") from None
        if fam.gguf_norms_plus_one and name.endswith("norm.weight"):
            x = x - 1.0  # llama.cpp wrote 1 + w for a norm that scales by (1 + w)
        if permute and name.endswith(("attn_q.weight", "attn_q.bias")):
            x = _unpermute_rows(x, cfg.num_heads)
        elif permute and name.endswith(("attn_k.weight", "attn_k.bias")):
            x = _unpermute_rows(x, cfg.num_kv_heads)
        return x

    return loaded(cfg, get, path, True, lambda: Tokenizer.from_gguf_metadata(meta),
                  (KeyError, ValueError))
