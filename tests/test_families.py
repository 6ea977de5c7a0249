"""Each model family against transformers' own implementation of it.

For each family a tiny model is made by transformers from the family's own config class at
random init and saved with `save_pretrained`; loaded here it gives transformers' logits to
float32 rounding over a padded batch, over a prompt then 16 cached decode steps, and in greedy
generation token for token. A GGUF of the same model, written as llama.cpp lays its
architecture out, gives the same logits. The published shapes (`families.SHAPES`) have the
parameter counts transformers reports for their configs. torch and accelerate are not runtime
dependencies: without them these tests skip (CI's cross-check step runs them).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starpo import families, sampler, weights
from starpo import model as M
from tests.test_weights import write_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

# tiny shapes, each with what sets its family apart (Qwen3: a head dim that is not
# hidden / heads, q/k norms; Qwen2: biases, untied head; Llama: Llama-3 rope scaling)
TINY = {
    "llama": dict(cls="LlamaConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=48, rope_theta=10000.0,
                  rms_norm_eps=1e-5, tie_word_embeddings=True,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2": dict(cls="Qwen2Config", hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, intermediate_size=64, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=False),
    "qwen3": dict(cls="Qwen3Config", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=48, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True),
    # six layers: five sliding-window ones (a window of 4 positions, so that the prompt and the
    # decode steps run past it) and a global one, with linear rope scaling and a query scale
    # that is not the head dim's
    "gemma3": dict(cls="Gemma3TextConfig", hidden_size=32, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=48, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   sliding_window=4, query_pre_attn_scalar=12,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0}}),
}
# a GGUF holds what llama.cpp's converter writes: Gemma 3's query scale is the head dim's
GGUF_CHANGES = {"llama": dict(rope_scaling=None), "gemma3": dict(query_pre_attn_scalar=16)}
# Gemma's HF names of its norms -> the names `write_gguf` turns into llama.cpp's
GEMMA_GGUF_NAMES = {"pre_feedforward_layernorm": "post_attention_layernorm",
                    "post_attention_layernorm": "post_attention_norm",
                    "post_feedforward_layernorm": "post_ffw_norm"}
# random models' greedy replies often repeat one token: a seed whose reply varies
SEEDS = {"gemma3": 2}
PROMPT = "<|im_start|>user\nTurn 1: State: _P_G<|im_end|>\n<|im_start|>assistant\n"


def hf_model(name, vocab, seed=0, **changes):
    """transformers' model of family `name` at random init, its weights spread (so logits
    differ by more than rounding) with norms scaling by about one."""
    spec = dict(TINY[name], **changes)
    config = getattr(transformers, spec.pop("cls"))(vocab_size=vocab, max_position_embeddings=256,
                                                    **spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return spread(model, name, config.hidden_size)


def spread(model, name, width):
    """`model` with random weights of family `name`'s scale, in place."""
    switches = families.family(name).fields()
    one = 0.0 if switches.get("norm_plus_one") else 1.0  # (1 + w) norms
    # embeddings scaled up by sqrt(width) start that much smaller (else the residual stream is
    # the token's own embedding, and a tied head repeats it)
    embed = width ** -0.5 if switches.get("embed_scale") else 1.0
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = torch.randn_like(p)
            p.copy_(one + 0.2 * noise if "norm" in pname else
                    embed * noise if "embed" in pname else 0.3 * noise)
    return model


@pytest.fixture(scope="module", params=list(TINY))
def pair(request, tiny_tokenizer, tmp_path_factory):
    """(transformers' model, ours loaded from its save_pretrained directory, the directory)."""
    name = request.param
    ref = hf_model(name, tiny_tokenizer.vocab_size, seed=SEEDS.get(name, 0))
    folder = str(tmp_path_factory.mktemp(name))
    ref.save_pretrained(folder)
    tiny_tokenizer.save(folder)
    ours = weights.load_model(folder)
    assert ours.cfg.family == name
    return ref, ours, folder


def ref_logits(ref, ids, mask):
    """transformers' logits [B,T,V] of left-padded rows, positions counting real tokens."""
    ids, mask = torch.tensor(np.asarray(ids)), torch.tensor(np.asarray(mask, np.int64))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return ref(input_ids=ids, attention_mask=mask, position_ids=positions).logits.numpy()


def padded_batch(tok):
    ids = tok.encode(PROMPT)
    rows = [[tok.pad_id] * 5 + ids[:-5], ids]
    mask = [[0] * 5 + [1] * (len(ids) - 5), [1] * len(ids)]
    return np.asarray(rows, np.int32), np.asarray(mask, bool)


def test_forward_over_a_padded_batch(pair, tiny_tokenizer):
    ref, ours, _ = pair
    ids, mask = padded_batch(tiny_tokenizer)
    want = ref_logits(ref, ids, mask)
    for kernel in ("cpu", "xla"):  # the CPU's blockwise attention and XLA's
        got, _ = M.forward(ours.params, ours.cfg.replace(attention=kernel), jnp.asarray(ids),
                           jnp.asarray(mask))
        np.testing.assert_allclose(np.asarray(got)[mask], want[mask], atol=2e-4, rtol=2e-4)
    assert np.abs(want[mask]).max() > 1.0  # logits far from zero: the comparison has teeth


def test_prompt_then_16_cached_decode_steps(pair, tiny_tokenizer):
    ref, ours, _ = pair
    ids, mask = padded_batch(tiny_tokenizer)
    follow = np.random.default_rng(1).integers(3, tiny_tokenizer.vocab_size, (2, 16))
    cache = M.init_cache(ours.cfg, 2, ids.shape[1] + 16)
    step = jax.jit(lambda p, t, v, c: M.forward(p, ours.cfg, t, v, c))
    _, cache = step(ours.params, jnp.asarray(ids), jnp.asarray(mask), cache)
    got = []
    for i in range(16):
        logits, cache = step(ours.params, jnp.asarray(follow[:, i:i + 1], jnp.int32),
                             jnp.ones((2, 1), bool), cache)
        got.append(np.asarray(logits[:, 0]))
    full = ref_logits(ref, np.concatenate([ids, follow], 1),
                      np.concatenate([mask, np.ones((2, 16), bool)], 1))
    np.testing.assert_allclose(np.stack(got, 1), full[:, ids.shape[1]:], atol=2e-4, rtol=2e-4)


def test_greedy_generation_token_for_token(pair, tiny_tokenizer):
    ref, ours, _ = pair
    ids = tiny_tokenizer.encode(PROMPT)
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=24,
                                           pad_token_id=tiny_tokenizer.pad_id)
    config.eos_token_id = None  # no EOS on either side: 24 tokens each
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=int),
                           generation_config=config)
    want = out[0, len(ids):].tolist()
    assert len(want) == 24 and len(set(want)) > 3  # not one token repeated
    s = sampler.Sampler(ours.cfg, 24, (), tiny_tokenizer.pad_id)
    prompt = jnp.asarray([ids], jnp.int32)
    _, turn = jax.jit(s.generate, static_argnums=(5,))(
        ours.params, prompt, prompt >= 0, jax.random.key(0), 0.0, len(ids) + 24)
    assert np.asarray(turn.tokens[0, :int(turn.length[0])]).tolist() == want


def test_gguf_of_the_same_model_gives_its_logits(pair, tiny_tokenizer, tmp_path):
    ref, ours, _ = pair
    fam = families.family(ours.cfg.family)
    changes = GGUF_CHANGES.get(fam.name, {})
    if changes:  # what the GGUF cannot hold (Llama-3 scaling is refused: test_weights)
        ref = hf_model(fam.name, tiny_tokenizer.vocab_size, SEEDS.get(fam.name, 0), **changes)
    tensors = {}
    for k, v in ref.state_dict().items():
        if ref.config.tie_word_embeddings and k == "lm_head.weight":
            continue
        if fam.gguf_norms_plus_one and k.endswith("norm.weight"):
            v = v + 1  # as llama.cpp's converter writes a (1 + w) norm
        for hf, name in GEMMA_GGUF_NAMES.items() if fam.name == "gemma3" else ():
            if hf in k:
                k = k.replace(hf, name)
                break
        tensors[k] = v.numpy()
    cfg = ours.cfg
    c = dict(layers=cfg.num_layers, vocab=cfg.vocab_size, hidden=cfg.hidden_size,
             mlp=cfg.intermediate_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
             head_dim=cfg.head_dim, theta=cfg.rope_theta, eps=cfg.rms_norm_eps,
             window=cfg.sliding_window, linear=cfg.rope_linear if cfg.rope_linear != 1 else 0)
    write_gguf(tmp_path / "m.gguf", fam.gguf_architecture, c, tensors, tiny_tokenizer)
    m = weights.load_model(str(tmp_path / "m.gguf"))
    assert m.cfg.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)  # stored as float32
    want = cfg.replace(max_position_embeddings=256, rope_scaling=None,
                       rms_norm_eps=m.cfg.rms_norm_eps)
    if fam.name == "gemma3":
        want = want.replace(query_scale=float(cfg.head_dim))
    assert m.cfg == want
    ids, mask = padded_batch(tiny_tokenizer)
    got, _ = M.forward(m.params, m.cfg, jnp.asarray(ids), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got)[mask], ref_logits(ref, ids, mask)[mask],
                               atol=2e-4, rtol=2e-4)


def test_export_loads_in_transformers_with_the_same_logits(pair, tiny_tokenizer, tmp_path):
    ref, ours, _ = pair
    params = jax.tree.map(lambda x: x * 1.01, ours.params)  # "trained": no longer the source
    weights.save_hf_dir(str(tmp_path / "out"), ours.cfg, params, tiny_tokenizer)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"),
                                                             dtype=torch.float32).eval()
    assert type(back) is type(ref)
    ids, mask = padded_batch(tiny_tokenizer)
    got, _ = M.forward(params, ours.cfg, jnp.asarray(ids), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got)[mask], ref_logits(back, ids, mask)[mask],
                               atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("name", list(families.SHAPES))
def test_published_shapes_have_transformers_parameter_counts(name):
    shape = families.SHAPES[name]
    cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
           "gemma3": "Gemma3TextConfig"}[shape.family]
    extra = {"head_dim": shape.head_dim} if shape.family in ("qwen3", "gemma3") else {}
    config = getattr(transformers, cls)(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.mlp, tie_word_embeddings=shape.tied, **extra)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    want = sum(p.numel() for p in model.parameters())  # a tied head counted once
    cfg = weights.random_config(weights._parse_tiny(f"random:{name}", weights.RANDOM_DEFAULTS))
    assert cfg == M.ModelConfig(**shape.fields())
    assert cfg.num_params == want
    assert sum(x.size for x in jax.tree.leaves(M.abstract_params(cfg))) == want


def test_a_multimodal_gemma3_checkpoints_language_model_loads(tiny_tokenizer, tmp_path):
    # Gemma 3 from 4B up is published as Gemma3ForConditionalGeneration: its language model
    # loads (its tensors under the language model's prefix), the vision tower is left out
    spec = dict(TINY["gemma3"])
    text = getattr(transformers, spec.pop("cls"))(vocab_size=tiny_tokenizer.vocab_size,
                                                  max_position_embeddings=256, **spec)
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4)
    torch.manual_seed(SEEDS["gemma3"])
    ref = spread(transformers.Gemma3ForConditionalGeneration(config).eval(), "gemma3",
                 text.hidden_size)
    ref.save_pretrained(str(tmp_path))
    tiny_tokenizer.save(str(tmp_path))
    ours = weights.load_model(str(tmp_path))
    assert ours.cfg.family == "gemma3" and ours.cfg.local_layers == (0, 1, 2, 3, 4)
    ids, mask = padded_batch(tiny_tokenizer)
    got, _ = M.forward(ours.params, ours.cfg, jnp.asarray(ids), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got)[mask], ref_logits(ref, ids, mask)[mask],
                               atol=2e-4, rtol=2e-4)
