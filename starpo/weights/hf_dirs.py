"""Hugging Face directories: config.json read (every field honoured or refused) and written,
safetensors loaded and saved."""

from __future__ import annotations

import glob
import json
import os
import tempfile

import numpy as np

from starpo import families
from starpo.model import ModelConfig
from starpo.tokenizer import Tokenizer
from starpo.weights.tensors import LoadError, loaded, tensors_from_params


# ----------------------------------------------------------------------------- HF directories
# config.json's activation names -> ModelConfig.activation
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _rope_settings(hf: dict, source: str) -> dict:
    """ModelConfig's rope fields from config.json: rope_theta / rope_scaling (transformers 4),
    rope_parameters flat or per layer type (transformers 5), Gemma's rope_local_base_freq."""
    rope = hf.get("rope_parameters") or {}
    full, local = (rope.get("full_attention") or {}, rope.get("sliding_attention") or {}) \
        if "full_attention" in rope or "sliding_attention" in rope else (rope, {})
    if local.get("rope_type") not in (None, "default"):
        raise LoadError(f"{source}: rope scaling of sliding-window layers is not supported")
    scaling = hf.get("rope_scaling") or (full if full.get("rope_type") not in (None, "default")
                                         else None)
    # the nested values first: a family's flat defaults (hf_defaults) only fill gaps
    out = dict(rope_theta=float(full.get("rope_theta", hf.get("rope_theta", 10000.0))),
               local_rope_theta=float(local.get("rope_theta",
                                                hf.get("rope_local_base_freq", 10000.0))))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind not in (None, "default"):
        if kind == "llama3":
            out["rope_scaling"] = (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                                   float(scaling["high_freq_factor"]),
                                   int(scaling["original_max_position_embeddings"]))
        elif kind == "linear":
            out["rope_linear"] = float(scaling["factor"])
        else:
            raise LoadError(f"{source}: rope scaling type {kind!r} is not supported "
                            "(llama3, linear)")
    return out


def _sliding_settings(hf: dict, fam, source: str) -> dict:
    """sliding_window and local_layers from config.json's layer_types (or the older
    sliding_window_pattern: every n-th layer global); a LoadError where the family has none."""
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None and fam.sliding_layers:
        pattern = int(hf.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]
    types = list(types or ())
    if set(types) - {"full_attention", "sliding_attention"} or (types and len(types) != layers):
        raise LoadError(f"{source}: layer_types {sorted(set(types))} of {len(types)} layers "
                        "are not supported")
    local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if (local or hf.get("use_sliding_window")) and not fam.sliding_layers:
        raise LoadError(f"{source}: sliding-window attention is not supported for "
                        f"{fam.hf_architecture}")
    if not local:
        return {}
    return dict(sliding_window=int(hf["sliding_window"]), local_layers=local)


def config_from_hf(hf: dict, source: str = "config.json", **overrides) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict. A setting the model here does not
    compute (an activation, an MLP bias, soft-capping, sliding windows where the family has
    none, a rope scaling type) is a LoadError."""
    arch = (hf.get("architectures") or ["?"])[0]
    fam = families.BY_HF_ARCHITECTURE.get(arch)
    if fam is None:
        raise LoadError(f"{source}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(families.BY_HF_ARCHITECTURE)})")
    if arch == fam.hf_multimodal:  # its language model alone (text_config)
        hf = hf.get("text_config") or {}
    hf = {**dict(fam.hf_defaults), **hf}
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if HF_ACTIVATIONS.get(act) != fam.fields().get("activation", "silu"):
        raise LoadError(f"{source}: activation {act!r} is not supported for {arch}")
    for unsupported in ("mlp_bias", "final_logit_softcapping", "attn_logit_softcapping",
                        "use_bidirectional_attention"):
        if hf.get(unsupported):
            raise LoadError(f"{source}: {unsupported}={hf[unsupported]!r} is not supported")
    try:
        heads = int(hf["num_attention_heads"])
        fields = dict(
            fam.fields(),
            vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            intermediate_size=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            query_scale=float(hf.get("query_pre_attn_scalar") or 0.0),
            **_rope_settings(hf, source), **_sliding_settings(hf, fam, source))
    except KeyError as e:
        raise LoadError(f"{source}: missing field {e.args[0]!r}") from None
    fields["qkv_bias"] = fam.qkv_bias or bool(hf.get("attention_bias", False))
    return ModelConfig(**{**fields, **overrides})


def _safetensors_index(directory: str) -> dict[str, str]:
    """Tensor name -> file, over every *.safetensors file in the directory."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise LoadError(f"{directory}: no *.safetensors files")
    index = {}
    for f in files:
        try:
            with safe_open(f, framework="numpy") as h:
                index.update({k: f for k in h.keys()})
        except Exception as e:  # safetensors raises several types for a damaged header
            raise LoadError(f"{f}: cannot read safetensors file ({e})") from None
    return index


def load_hf_dir(directory: str, **overrides) -> tuple[ModelConfig, dict, Tokenizer]:
    from safetensors import safe_open

    cfg_path = os.path.join(directory, "config.json")
    try:
        hf = json.load(open(cfg_path))
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"{cfg_path}: cannot read ({e})") from None
    cfg = config_from_hf(hf, cfg_path, **overrides)
    index = _safetensors_index(directory)

    arch = hf["architectures"][0]  # (config_from_hf checked it)
    fam = families.BY_HF_ARCHITECTURE[arch]
    prefixes = fam.hf_text_prefixes if arch == fam.hf_multimodal else ()

    def get(name):
        for prefix in prefixes:  # a multimodal checkpoint's language model
            if name.startswith("model.") and prefix + name[len("model."):] in index:
                name = prefix + name[len("model."):]
                break
        if name not in index:
            return None
        try:
            with safe_open(index[name], framework="numpy") as h:
                return np.asarray(h.get_tensor(name), np.float32)
        except Exception as e:
            raise LoadError(f"{index[name]}: cannot read tensor {name} ({e})") from None

    return loaded(cfg, get, directory, False, lambda: Tokenizer.from_hf_dir(directory),
                  (OSError, ValueError))


def hf_config(cfg: ModelConfig, tok: Tokenizer) -> dict:
    """config.json for `cfg`, in its family's names."""
    fam = families.family(cfg.family)
    mismatch = {k: getattr(cfg, k) for k, v in fam.fields().items()
                if k != "qkv_bias" and getattr(cfg, k) != v}
    if (fam.qkv_bias and not cfg.qkv_bias) or mismatch or (cfg.local_layers
                                                           and not fam.sliding_layers):
        raise LoadError(f"a {cfg.family} model with {mismatch or 'these switches'} has no "
                        "Hugging Face architecture to export to")
    act = {v: k for k, v in HF_ACTIVATIONS.items()}[cfg.activation]
    out = {
        "architectures": [fam.hf_architecture], "model_type": fam.model_type,
        "hidden_activation" if cfg.activation != "silu" else "hidden_act": act,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings, "torch_dtype": "float32",
        "eos_token_id": list(tok.eos_ids), "pad_token_id": tok.pad_id,
    }
    if cfg.rope_scaling is not None:
        factor, low, high, old = cfg.rope_scaling
        out["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                               "high_freq_factor": high, "original_max_position_embeddings": old}
    elif cfg.rope_linear != 1.0:
        out["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_linear}
    if cfg.query_scale:  # an int where it is one (transformers types it so)
        q = cfg.query_scale
        out["query_pre_attn_scalar"] = int(q) if q == int(q) else q
    if fam.sliding_layers:
        out["layer_types"] = ["sliding_attention" if i in cfg.local_layers else "full_attention"
                              for i in range(cfg.num_layers)]
        out["sliding_window"] = cfg.sliding_window or None
        out["rope_local_base_freq"] = cfg.local_rope_theta
    if not fam.qkv_bias:  # the families whose bias is a switch (attention_bias)
        out["attention_bias"] = cfg.qkv_bias
    return out


def save_hf_dir(directory: str, cfg: ModelConfig, params: dict, tok: Tokenizer,
                shared: bool = False) -> None:
    """Write a Hugging Face checkpoint directory (float32 safetensors, config, tokenizer).

    Written to a temporary sibling and renamed into place, so `directory` is either complete
    or absent. An existing `directory` is an error, unless `shared` (a cache that processes
    started side by side may each fill: the first complete one stays, the others' copies go).
    """
    from safetensors.numpy import save_file

    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".partial-")
    try:
        save_file(tensors_from_params(cfg, params), os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config(cfg, tok), f, indent=2)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": list(tok.eos_ids), "pad_token_id": tok.pad_id}, f)
        tok.save(tmp)
        complete = lambda: os.path.isfile(os.path.join(directory, "config.json"))  # noqa: E731
        if os.path.isdir(directory) and not (shared and complete()):
            raise LoadError(f"{directory} already exists")
        try:
            os.rename(tmp, directory)
        except OSError:  # another process renamed its copy into place first
            if not (shared and complete()):
                raise LoadError(f"{directory} already exists") from None
    finally:
        if os.path.isdir(tmp):
            import shutil
            shutil.rmtree(tmp)
