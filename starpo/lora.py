"""LoRA: low-rank adapters on the dense projections, the base weights frozen.

A model config with `lora_rank` r > 0 gives each projection named in `lora_targets` two more
weights beside its kernel W [in..., out...]: A [in..., r] (`<name>_lora_a`) and
B [r, out...] (`<name>_lora_b`), and the projection computes

    y = x W + (alpha / r) (x A) B

(`model._projection`). B starts at zero, so a model with fresh adapters gives exactly its base
model's numbers; A starts as PEFT's does (uniform in +-1/sqrt(fan_in)). The adapters are stored
in float32 and carry the same logical axes as their kernel's input or output side plus "lora"
(replicated), so they shard like the weights they adapt.

Training with adapters: the *trainable* part of a parameter tree is its adapters (and a critic's
value head); the rest is frozen. Gradients are taken with respect to the trainable part alone
(`value_and_grad`), the optimizer holds moments for it alone (`apply_updates`), and a jitted
program donates it alone (the frozen base weights go in undonated and come back as the same
buffers, so the actor, its critic copy and the KL reference share one copy of them). A tree
without adapters is trainable as a whole: every function here is then the identity on it, so
full fine-tuning runs exactly as before.

Sampling merges the adapters into the weights once per rollout chunk (`merge`): the decode
loop then runs the plain model, as fast as without LoRA, and the merged copy takes the place of
the decode-dtype copy of the weights the sampler makes anyway. Export merges the same way.

Config keys (RAGEN's `lora.rank`, `lora.alpha`, `lora.target_modules`): `model.lora.rank`
(0: off), `model.lora.alpha`, `model.lora.target_modules` ("all-linear" or a comma list of
q, k, v, o, gate, up, down, or their Hugging Face names q_proj ... down_proj; "embed" /
"embed_tokens" adapts the token lookup (the input side) and "lm_head" the output head, tied to
the lookup's table or not, as PEFT's targets of those names do; "all-linear" leaves both out, as
PEFT's does). Merging adapters of a tied model's table gives an untied one (the head and the
lookup then differ).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

LINEAR = ("q", "k", "v", "o", "gate", "up", "down")  # what "all-linear" adapts
TARGETS = LINEAR + ("embed", "lm_head")
HF_NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate",
            "up_proj": "up", "down_proj": "down", "embed_tokens": "embed"}
TOP = ("embed", "lm_head")  # targets outside the layers: adapters at the tree's top
SUFFIXES = ("_lora_a", "_lora_b")
# where each target lives in a layer's params, and how many of its kernel's leading axes
# (after the stacked layer axis) are inputs
_WHERE = {"q": ("attn", 1), "k": ("attn", 1), "v": ("attn", 1), "o": ("attn", 2),
          "gate": ("mlp", 1), "up": ("mlp", 1), "down": ("mlp", 1), "embed": ("", 1),
          "lm_head": ("", 1)}


def parse_targets(spec) -> tuple[str, ...]:
    """The projections named by `spec` ("all-linear", "q,v", "q_proj,v_proj" or a sequence of
    names), in `TARGETS` order. ValueError (one line) for an unknown or empty list."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [str(n).strip() for n in names if str(n).strip()]
    out = set()
    for n in names:
        if n == "all-linear":
            out.update(LINEAR)
            continue
        name = HF_NAMES.get(n, n)
        if name not in TARGETS:
            raise ValueError(f"model.lora.target_modules: unknown module {n!r}; known: "
                             f"all-linear or {', '.join(TARGETS)} (or {', '.join(HF_NAMES)})")
        out.add(name)
    if not out:
        raise ValueError("model.lora.target_modules is empty; use all-linear or a list of "
                         f"{', '.join(TARGETS)}")
    return tuple(t for t in TARGETS if t in out)


def check(rank, alpha, targets) -> tuple[str, ...]:
    """The parsed targets; ValueError (one line) for a rank that is not an integer >= 0 (0 turns
    LoRA off, as RAGEN's lora.rank), alpha <= 0 or bad targets (checked whatever the rank)."""
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"model.lora.rank must be an integer >= 0 (0 = off), got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise ValueError(f"model.lora.alpha must be > 0, got {alpha!r}")
    return parse_targets(targets)


# ----------------------------------------------------------------------------- trees
def _is_adapter_key(key) -> bool:
    return isinstance(key, str) and key.endswith(SUFFIXES)


def has_adapters(tree) -> bool:
    """Whether a parameter tree (nested dicts) holds LoRA adapters."""
    if not isinstance(tree, dict):
        return False
    return any(_is_adapter_key(k) or has_adapters(v) for k, v in tree.items())


def _partition(tree, top: bool):
    """(trainable, frozen) sub-dicts of a tree known to hold adapters."""
    train, frozen = {}, {}
    for k, v in tree.items():
        if _is_adapter_key(k) or (top and k == "value_head"):
            train[k] = v
        elif isinstance(v, dict):
            t, f = _partition(v, False)
            if t:
                train[k] = t
            if f:
                frozen[k] = f
        else:
            frozen[k] = v
    return train, frozen


def split(tree):
    """(trainable, frozen) of a parameter tree (or any tree of the same structure, e.g. its
    shardings): with adapters, the adapters and the value head vs the rest (each a nested
    dict holding only its own leaves); without, (tree, {}). None gives (None, None)."""
    if tree is None:
        return None, None
    if not has_adapters(tree):
        return tree, {}
    return _partition(tree, True)


def join(a, b):
    """The union of two nested dicts with disjoint leaves (`split`'s inverse)."""
    if a is None or not b:
        return a
    if not a:
        return b
    out = dict(a)
    for k, v in b.items():
        out[k] = join(out[k], v) if k in out else v
    return out


def value_and_grad(fn, has_aux: bool = False):
    """`jax.value_and_grad(fn)` for fn(params, *args), the gradient taken with respect to the
    trainable part of params only (a tree like `split(params)[0]`)."""
    def run(params, *args):
        train, frozen = split(params)
        return jax.value_and_grad(lambda t, *a: fn(join(t, frozen), *a), has_aux=has_aux)(
            train, *args)
    return run


def apply_updates(tx, params, opt_state, grads):
    """One optax step on the trainable part of `params` (`grads` and `opt_state` over that
    part): (new params, new optimizer state); the frozen part comes back unchanged."""
    import optax

    train, frozen = split(params)
    updates, opt_state = tx.update(grads, opt_state, train)
    return join(optax.apply_updates(train, updates), frozen), opt_state


# ----------------------------------------------------------------------------- adapters
def adapter_shapes(cfg) -> dict:
    """{target: (A shape, B shape)} of one layer's adapters (without the stacked layer axis)."""
    D, F, H, K, E = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                     cfg.head_dim)
    r = cfg.lora_rank
    shapes = {"q": ((D,), (H, E)), "k": ((D,), (K, E)), "v": ((D,), (K, E)),
              "o": ((H, E), (D,)), "gate": ((D,), (F,)), "up": ((D,), (F,)),
              "down": ((F,), (D,)), "embed": ((cfg.vocab_size,), (D,)),
              "lm_head": ((D,), (cfg.vocab_size,))}
    return {t: (shapes[t][0] + (r,), (r,) + shapes[t][1]) for t in cfg.lora_targets}


def num_adapter_params(cfg) -> int:
    """The adapters' weights in all layers (0 without LoRA)."""
    if not cfg.lora_rank:
        return 0
    return sum((1 if t in TOP else cfg.num_layers) * (math.prod(a) + math.prod(b))
               for t, (a, b) in adapter_shapes(cfg).items())


def attach(cfg, params, rank: int, alpha: float, targets, key, base_dtype=None):
    """(cfg with LoRA, params with fresh adapters) for a base model. A [L, in..., r] is drawn
    uniform in +-1/sqrt(fan_in) (PEFT's kaiming-uniform with a = sqrt(5)), B is zero; both
    float32. `base_dtype`: the frozen weights are stored in it (None: as loaded)."""
    targets = check(rank, alpha, targets)
    if not rank:
        raise ValueError("model.lora.rank 0 means no adapters to attach")
    cfg = cfg.replace(lora_rank=int(rank), lora_alpha=float(alpha), lora_targets=targets)
    if base_dtype is not None:
        params = jax.tree_util.tree_map(lambda p: p.astype(jnp.dtype(base_dtype)), params)
    layers = {k: dict(v) for k, v in params["layers"].items()}
    L = cfg.num_layers
    top = {}
    for i, (t, (a_shape, b_shape)) in enumerate(adapter_shapes(cfg).items()):
        k = jax.random.fold_in(key, i)
        if t in TOP:  # the lookup's A is N(0, 1) (PEFT's random factor of an Embedding)
            top[f"{t}_lora_a"] = (jax.random.normal(k, a_shape) if t == "embed" else
                                  jax.random.uniform(k, a_shape, jnp.float32, -1.0, 1.0)
                                  / math.sqrt(a_shape[0]))
            top[f"{t}_lora_b"] = jnp.zeros(b_shape, jnp.float32)
            continue
        where, n_in = _WHERE[t]
        bound = 1.0 / math.sqrt(math.prod(a_shape[:n_in]))
        a = jax.random.uniform(k, (L,) + a_shape, jnp.float32, -bound, bound)
        layers[where][f"{t}_lora_a"] = {"kernel": a}
        layers[where][f"{t}_lora_b"] = {"kernel": jnp.zeros((L,) + b_shape, jnp.float32)}
    return cfg, {**params, **top, "layers": layers}


def delta(cfg, target: str, a, b):
    """The adapter's change to its kernel, (alpha / r) A B [in..., out...], float32."""
    n_in = _WHERE[target][1]
    lead = a.ndim - n_in - 1  # a stacked layer axis, if any
    spec_a = "l" * lead + "ij"[:n_in] + "r"
    out = "mn"[:b.ndim - lead - 1]
    spec_b = "l" * lead + "r" + out
    spec = f"{spec_a},{spec_b}->{'l' * lead}{'ij'[:n_in]}{out}"
    prod = jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    return prod * (cfg.lora_alpha / cfg.lora_rank)


def merged_config(cfg):
    """The config of `merge`'s model: no LoRA, and untied where the adapters touch a tied
    table's lookup or head (one table can't take two deltas). Without LoRA: `cfg`."""
    if not cfg.lora_rank:
        return cfg
    untie = cfg.tie_embeddings and any(t in TOP for t in cfg.lora_targets)
    return cfg.replace(lora_rank=0, lora_targets=(),
                       tie_embeddings=cfg.tie_embeddings and not untie)


def merge(cfg, params, dtype=None):
    """(cfg without LoRA, params with each adapter folded into its kernel, W + (alpha/r) A B,
    computed in float32 and stored in `dtype` (None: the kernel's dtype); adapters removed).
    Adapters of a tied model's lookup or head give an untied model (`merged_config`). Without
    LoRA: (cfg, params) unchanged."""
    if not cfg.lora_rank:
        return cfg, params
    plain = merged_config(cfg)
    top = [t for t in cfg.lora_targets if t in TOP]
    layers = {k: dict(v) for k, v in params["layers"].items()}
    params = dict(params)
    if cfg.tie_embeddings and not plain.tie_embeddings:  # the head gets its own table copy
        params["lm_head"] = {"kernel": params["embed"]["embedding"].T}
    for t in top:
        a, b = params.pop(f"{t}_lora_a"), params.pop(f"{t}_lora_b")
        holder, name = ("embed", "embedding") if t == "embed" else ("lm_head", "kernel")
        w = params[holder][name]
        merged = w.astype(jnp.float32) + delta(cfg, t, a, b)
        params[holder] = {**params[holder], name: merged.astype(dtype or w.dtype)}
    for t in cfg.lora_targets:
        if t in TOP:
            continue
        where, _ = _WHERE[t]
        a = layers[where].pop(f"{t}_lora_a")["kernel"]
        b = layers[where].pop(f"{t}_lora_b")["kernel"]
        base = layers[where][t]
        w = base["kernel"]
        merged = (w.astype(jnp.float32) + delta(cfg, t, a, b)).astype(dtype or w.dtype)
        layers[where][t] = {**base, "kernel": merged}
    return plain, {**params, "layers": layers}
