"""The model families, each in one row: what its checkpoints are called and how it differs.

A family's row (`Family`) says how its files name it (the Hugging Face architecture and model
type, llama.cpp's GGUF architecture), whether llama.cpp's converter interleaved its Q/K rows,
and the architectural switches it sets on `ModelConfig` (q/k/v bias, per-head q/k norms). The
model, the loaders, export and the memory plan read these switches, never the family's name.

    family  HF architecture     GGUF    Q/K rows permuted  q/k/v bias  q/k norm
    llama   LlamaForCausalLM    llama   yes                no (*)      no
    qwen2   Qwen2ForCausalLM    qwen2   no                 yes         no
    qwen3   Qwen3ForCausalLM    qwen3   no                 no (*)      yes

(*) unless the checkpoint's config.json sets `attention_bias`.

`SHAPES` holds the published shapes of the models a user would bring, by name: the memory plan
(`launch/plan.py --models=...`) and the weight-free `random:NAME` models are built from them.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    hf_architecture: str  # config.json's "architectures"[0]
    model_type: str  # config.json's "model_type"
    gguf_architecture: str  # a GGUF file's general.architecture
    gguf_permutes_qk: bool  # llama.cpp's converter interleaved Q/K rows for its rotary layout
    qkv_bias: bool  # the q, k and v projections carry a bias
    qk_norm: bool  # an RMSNorm over each head's query and key, before the rotary embedding


FAMILIES = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM", "llama", "llama", True, qkv_bias=False, qk_norm=False),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", "qwen2", False, qkv_bias=True, qk_norm=False),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", "qwen3", False, qkv_bias=False, qk_norm=True),
)}
BY_HF_ARCHITECTURE = {f.hf_architecture: f for f in FAMILIES.values()}
BY_GGUF_ARCHITECTURE = {f.gguf_architecture: f for f in FAMILIES.values()}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r} is not supported "
                         f"(supported: {', '.join(FAMILIES)})")
    return FAMILIES[name]


@dataclasses.dataclass(frozen=True)
class Shape:
    """A published model's shape, as its config.json gives it."""

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    tied: bool
    theta: float
    eps: float
    max_positions: int

    def fields(self) -> dict:
        """The ModelConfig fields of the shape."""
        f = family(self.family)
        return dict(family=f.name, vocab_size=self.vocab, hidden_size=self.hidden,
                    num_layers=self.layers, num_heads=self.heads, num_kv_heads=self.kv_heads,
                    head_dim=self.head_dim, intermediate_size=self.mlp, rope_theta=self.theta,
                    rms_norm_eps=self.eps, tie_embeddings=self.tied, qkv_bias=f.qkv_bias,
                    qk_norm=f.qk_norm, max_position_embeddings=self.max_positions)


SHAPES = {
    "smollm2-135m": Shape("llama", 30, 576, 9, 3, 64, 1536, 49152, True, 1e5, 1e-5, 8192),
    "qwen2.5-0.5b": Shape("qwen2", 24, 896, 14, 2, 64, 4864, 151936, True, 1e6, 1e-6, 32768),
    "qwen2.5-1.5b": Shape("qwen2", 28, 1536, 12, 2, 128, 8960, 151936, True, 1e6, 1e-6, 32768),
    "qwen2.5-3b": Shape("qwen2", 36, 2048, 16, 2, 128, 11008, 151936, True, 1e6, 1e-6, 32768),
    "qwen2.5-7b": Shape("qwen2", 28, 3584, 28, 4, 128, 18944, 152064, False, 1e6, 1e-6, 32768),
    "qwen3-0.6b": Shape("qwen3", 28, 1024, 16, 8, 128, 3072, 151936, True, 1e6, 1e-6, 40960),
    "qwen3-1.7b": Shape("qwen3", 28, 2048, 16, 8, 128, 6144, 151936, True, 1e6, 1e-6, 40960),
    "qwen3-4b": Shape("qwen3", 36, 2560, 32, 8, 128, 9728, 151936, True, 1e6, 1e-6, 40960),
    "qwen3-8b": Shape("qwen3", 36, 4096, 32, 8, 128, 12288, 151936, False, 1e6, 1e-6, 40960),
}


def shape(name: str) -> Shape:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    return SHAPES[name]
