"""`tiny:` and `random:` models: random weights of a spec or a published shape."""

from __future__ import annotations

from starpo import families
from starpo.model import ModelConfig
from starpo.weights.tensors import LoadError


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
