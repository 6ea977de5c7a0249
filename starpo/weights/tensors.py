"""The one name/shape table of every parameter (`TABLE`) and the moves between checkpoint
tensors and our parameter tree, both ways."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from starpo import families
from starpo import model as model_lib
from starpo.model import ModelConfig


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


def loaded(cfg: ModelConfig, get, source: str, gguf: bool, tokenizer: Callable, errors):
    """(cfg, params, tokenizer) of a checkpoint: its tensors through the table, then its
    tokenizer (`tokenizer()`), whose `errors` become a LoadError naming `source`."""
    params = params_from_tensors(cfg, get, source, gguf=gguf)
    try:
        tok = tokenizer()
    except errors as e:
        raise LoadError(f"{source}: tokenizer: {e}") from None
    return cfg, params, tok
