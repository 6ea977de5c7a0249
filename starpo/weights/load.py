"""The entry point: `load_model(spec)` for any model name, file or directory."""

from __future__ import annotations

import dataclasses
import math
import os

import jax

from starpo import families
from starpo import model as model_lib
from starpo.model import ModelConfig
from starpo.tokenizer import Tokenizer
from starpo.weights.embedded import EMBEDDED, converted_dir
from starpo.weights.gguf_files import load_gguf
from starpo.weights.hf_dirs import load_hf_dir
from starpo.weights.tensors import LoadError
from starpo.weights.tiny import (
    RANDOM_DEFAULTS, _STAND_IN_VOCAB, _parse_tiny, _tiny_fields, random_config, tiny_config)


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
