"""The model families, each in one row: what its checkpoints are called and how it differs.

A family's row (`Family`) says how its files name it (the Hugging Face architecture and model
type, llama.cpp's GGUF architecture, tensor names that differ from `weights.TABLE`'s), how
llama.cpp's converter changed its tensors (Q/K rows interleaved, norm weights stored as 1 + w),
and the architectural switches it sets on `ModelConfig`. The model, the loaders, export and the
memory plan read the switches, never the family's name.

    family  HF architecture     GGUF    switches
    llama   LlamaForCausalLM    llama   (none; llama.cpp interleaves its Q/K rows)
    qwen2   Qwen2ForCausalLM    qwen2   q/k/v bias
    qwen3   Qwen3ForCausalLM    qwen3   q/k norms
    gemma3  Gemma3ForCausalLM   gemma3  q/k norms, (1 + w) norms, sandwich norms, tanh-GELU,
                                        scaled embeddings; sliding-window layers from config
            (and the language model of Gemma3ForConditionalGeneration, the 4B-27B checkpoints)

A q/k/v bias is also a switch of config.json (`attention_bias`) for Llama and Qwen3.

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
    gguf_permutes_qk: bool = False  # llama.cpp's converter interleaved Q/K rows (rotary layout)
    gguf_norms_plus_one: bool = False  # llama.cpp stores a (1 + w) norm's weight as 1 + w
    switches: tuple[tuple[str, object], ...] = ()  # the ModelConfig fields the family sets
    hf_names: tuple[tuple[str, str], ...] = ()  # parameter path -> HF name, where it differs
    sliding_layers: bool = False  # config.json may make layers sliding-window ones
    # config.json's values where a checkpoint leaves them out (transformers' defaults for the
    # family's config class: the multimodal Gemma 3 checkpoints' text_config omits most)
    hf_defaults: tuple[tuple[str, object], ...] = ()
    # the multimodal checkpoints whose language model is of this family: their architecture,
    # and the prefixes (newest first) of the language model's tensors in place of "model."
    hf_multimodal: str = ""
    hf_text_prefixes: tuple[str, ...] = ()

    def fields(self) -> dict:
        """The ModelConfig switches of the family (the rest at ModelConfig's defaults)."""
        return {"family": self.name, "qkv_bias": False, "qk_norm": False, **dict(self.switches)}

    @property
    def qkv_bias(self) -> bool:
        return self.fields()["qkv_bias"]


_GEMMA = (("qk_norm", True), ("norm_plus_one", True), ("sandwich_norms", True),
          ("activation", "gelu_tanh"), ("embed_scale", True))
FAMILIES = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM", "llama", "llama", gguf_permutes_qk=True),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", "qwen2", switches=(("qkv_bias", True),)),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", "qwen3", switches=(("qk_norm", True),)),
    # Gemma 3's HF "post_attention_layernorm" is the norm after attention (Llama's is the one
    # before the MLP, which Gemma calls "pre_feedforward_layernorm")
    Family("gemma3", "Gemma3ForCausalLM", "gemma3_text", "gemma3", gguf_norms_plus_one=True,
           switches=_GEMMA, sliding_layers=True,
           hf_names=(("layers/mlp_norm/scale",
                      "model.layers.{i}.pre_feedforward_layernorm.weight"),),
           hf_defaults=(("vocab_size", 262208), ("hidden_size", 2304),
                        ("intermediate_size", 9216), ("num_hidden_layers", 26),
                        ("num_attention_heads", 8), ("num_key_value_heads", 4), ("head_dim", 256),
                        ("hidden_activation", "gelu_pytorch_tanh"),
                        ("max_position_embeddings", 131072), ("rms_norm_eps", 1e-6),
                        ("tie_word_embeddings", True), ("query_pre_attn_scalar", 256),
                        ("sliding_window", 4096), ("rope_theta", 1e6),
                        ("rope_local_base_freq", 10000.0)),
           hf_multimodal="Gemma3ForConditionalGeneration",
           hf_text_prefixes=("model.language_model.", "language_model.model.")),
)}
BY_HF_ARCHITECTURE = {a: f for f in FAMILIES.values()
                      for a in (f.hf_architecture, f.hf_multimodal) if a}
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
    window: int = 0  # sliding-window layers: the window, and every `pattern`-th layer global
    pattern: int = 0
    query_scale: float = 0.0
    linear: float = 1.0  # linear rope scaling of the global layers

    def fields(self) -> dict:
        """The ModelConfig fields of the shape."""
        local = tuple(i for i in range(self.layers) if self.pattern and (i + 1) % self.pattern)
        return dict(family(self.family).fields(), vocab_size=self.vocab, hidden_size=self.hidden,
                    num_layers=self.layers, num_heads=self.heads, num_kv_heads=self.kv_heads,
                    head_dim=self.head_dim, intermediate_size=self.mlp, rope_theta=self.theta,
                    rms_norm_eps=self.eps, tie_embeddings=self.tied,
                    max_position_embeddings=self.max_positions, sliding_window=self.window,
                    local_layers=local, query_scale=self.query_scale, rope_linear=self.linear)


_GEMMA3 = dict(theta=1e6, eps=1e-6, pattern=6, query_scale=256.0)
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
    # Gemma 3's text models (the 4B one's language model, without its vision tower)
    "gemma3-1b": Shape("gemma3", 26, 1152, 4, 1, 256, 6912, 262144, True, max_positions=32768,
                       window=512, **_GEMMA3),
    "gemma3-4b": Shape("gemma3", 34, 2560, 8, 4, 256, 10240, 262208, True, max_positions=131072,
                       window=1024, linear=8.0, **_GEMMA3),
}


def shape(name: str) -> Shape:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    return SHAPES[name]
