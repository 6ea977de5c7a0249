"""Loader round trips (safetensors directory, GGUF incl. llama.cpp's Q/K permutation) and errors."""

import json
import os
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from starpo import families
from starpo import model as M
from starpo import weights
from tests import numpy_reference
from tests.conftest import LLAMA_LIKE, QWEN3_LIKE, QWEN_LIKE, hf_config_json, random_hf_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_hf_dir(path, c, tensors, tok):
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_json(c), f)
    tok.save(str(path))
    return str(path)


def llama_cpp_permute(w, n_head):
    """The row interleaving llama.cpp's converter applies to Q and K (its published formula)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"embed_tokens": "token_embd", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def gguf_name(hf_name):
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    name = hf_name.replace("model.layers.", "blk.").replace("model.", "")
    for a, b in GGUF_NAMES.items():
        name = name.replace(a, b)
    return name


def write_gguf(path, arch, c, tensors, tok, quantise=()):
    """A GGUF as llama.cpp would write it: Q/K rows permuted for `llama`, some tensors Q8_0.

    Returns the tensors as the file holds them after dequantisation, in HF layout/order.
    """
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["layers"])
    w.add_vocab_size(c["vocab"])
    w.add_context_length(256)
    w.add_embedding_length(c["hidden"])
    w.add_feed_forward_length(c["mlp"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    if c.get("window"):
        w.add_sliding_window(c["window"])
    if c.get("linear"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c["linear"])
    w.add_rope_freq_base(c["theta"])
    w.add_layer_norm_rms_eps(c["eps"])
    raw = tok.hf.backend_tokenizer
    vocab = raw.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    model = json.loads(raw.to_str())["model"]
    added = {a.content for a in raw.get_added_tokens_decoder().values()}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in added else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_chat_template(tok.hf.chat_template)
    stored = {}
    for name, x in tensors.items():
        if arch == "llama" and "q_proj" in name:
            x = llama_cpp_permute(x, c["heads"])
        elif arch == "llama" and "k_proj" in name:
            x = llama_cpp_permute(x, c["kv_heads"])
        if name in quantise:
            q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name(name), q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            stored[name] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_name(name), x)
            stored[name] = x
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def assert_loaded_matches(m, c, tensors):
    """Logits of the loaded model equal the NumPy reference over the source tensors."""
    ids = np.arange(11) * 7 % c["vocab"]
    want = numpy_reference.forward(tensors, c, ids)
    got, _ = M.forward(m.params, m.cfg, jnp.asarray(ids)[None], jnp.ones((1, 11), bool))
    np.testing.assert_allclose(np.asarray(got[0]), want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("c", [QWEN_LIKE, QWEN3_LIKE], ids=["qwen2", "qwen3"])
def test_hf_dir_round_trip_and_export(tmp_path, tiny_tokenizer, c):
    tensors = random_hf_tensors(c, seed=3)
    m = weights.load_model(write_hf_dir(tmp_path / "src", c, tensors, tiny_tokenizer))
    assert (m.cfg.qkv_bias, m.cfg.qk_norm, m.cfg.tie_embeddings) == (
        c["bias"], c.get("qk_norm", False), c["tied"])
    assert m.cfg.rope_scaling == c["scaling"] and m.cfg.head_dim == c["head_dim"]
    # one tensor checked by hand: q_proj [H*E, D] becomes kernel [D, H, E]
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(m.params["layers"]["attn"]["q"]["kernel"][1],
                                  q.T.reshape(c["hidden"], c["heads"], c["head_dim"]))
    assert_loaded_matches(m, c, tensors)
    weights.save_hf_dir(str(tmp_path / "out"), m.cfg, m.params, m.tokenizer)
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(back) == set(tensors)
    for k in tensors:
        np.testing.assert_array_equal(back[k], tensors[k])
    again = weights.load_model(str(tmp_path / "out"))
    assert again.cfg == m.cfg
    assert again.tokenizer.encode("Turn 1: Up || Left") == m.tokenizer.encode("Turn 1: Up || Left")


@pytest.mark.parametrize("arch,c", [("llama", LLAMA_LIKE), ("qwen2", dict(QWEN_LIKE, scaling=None)),
                                    ("qwen3", QWEN3_LIKE)])
def test_gguf_round_trip(tmp_path, tiny_tokenizer, arch, c):
    tensors = random_hf_tensors(c, seed=4)
    candidates = ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight",
                  "model.layers.1.mlp.down_proj.weight")
    quantise = {n for n in candidates if tensors[n].shape[-1] % 32 == 0}  # Q8_0 blocks of 32
    stored = write_gguf(tmp_path / "m.gguf", arch, c, tensors, tiny_tokenizer, quantise)
    m = weights.load_model(str(tmp_path / "m.gguf"))
    assert m.cfg.qkv_bias == c["bias"] and m.cfg.tie_embeddings == c["tied"]
    assert (m.cfg.family, m.cfg.qk_norm) == (arch, c.get("qk_norm", False))
    # q_proj comes back in checkpoint order (Q8_0 error, where quantised, is ~1e-3)
    src = tensors["model.layers.1.self_attn.q_proj.weight"]
    got = np.asarray(m.params["layers"]["attn"]["q"]["kernel"][1]).reshape(c["hidden"], -1).T
    np.testing.assert_allclose(got, src, atol=5e-3)
    assert (np.abs(got - src).max() > 0) == ("model.layers.1.self_attn.q_proj.weight" in quantise)
    unpermuted = dict(stored)
    if arch == "llama":
        for name in stored:
            if "q_proj" in name or "k_proj" in name:
                unpermuted[name] = tensors[name] if name not in quantise else \
                    weights._unpermute_rows(stored[name], c["heads"] if "q_proj" in name else c["kv_heads"])
    assert_loaded_matches(m, c, unpermuted)
    text = "<|im_start|>user\nTurn 2: go Up || Right, 0.9 points!<|im_end|>"
    assert m.tokenizer.encode(text) == tiny_tokenizer.encode(text)
    assert m.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_permutation_inverse():
    w = np.arange(4 * 8 * 3).reshape(32, 3)
    np.testing.assert_array_equal(weights._unpermute_rows(llama_cpp_permute(w, 4), 4), w)
    assert not np.array_equal(llama_cpp_permute(w, 4), w)


# ----------------------------------------------------------------------------- bad input
def test_shape_mismatch_names_the_tensor(tmp_path, tiny_tokenizer):
    tensors = random_hf_tensors(LLAMA_LIKE)
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    d = write_hf_dir(tmp_path, LLAMA_LIKE, tensors, tiny_tokenizer)
    with pytest.raises(weights.LoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight has "
                                                r"shape \(8, 32\), the config implies \(16, 32\)"):
        weights.load_model(d)


def test_missing_tensor(tmp_path, tiny_tokenizer):
    tensors = random_hf_tensors(LLAMA_LIKE)
    del tensors["model.layers.0.mlp.down_proj.weight"]
    d = write_hf_dir(tmp_path, LLAMA_LIKE, tensors, tiny_tokenizer)
    with pytest.raises(weights.LoadError, match=r"model\.layers\.0\.mlp\.down_proj\.weight is missing"):
        weights.load_model(d)


def test_unknown_architecture(tmp_path, tiny_tokenizer):
    d = write_hf_dir(tmp_path, LLAMA_LIKE, random_hf_tensors(LLAMA_LIKE), tiny_tokenizer)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(weights.LoadError, match="architecture 'GPTNeoXForCausalLM' is not "
                       r"supported \(supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                       r"Gemma3ForCausalLM, Gemma3ForConditionalGeneration\)"):
        weights.load_model(d)


@pytest.mark.parametrize("change,named", [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope scaling type 'yarn'"),
    (dict(hidden_act="gelu"), "activation 'gelu' is not supported for Qwen3ForCausalLM"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "sliding-window"),
    (dict(use_sliding_window=True), "sliding-window"),
    (dict(mlp_bias=True), "mlp_bias")])
def test_a_setting_the_model_does_not_compute_is_an_error(change, named):
    hf = dict(hf_config_json(QWEN3_LIKE), **change)
    with pytest.raises(weights.LoadError, match=named):
        weights.config_from_hf(hf)
    assert weights.config_from_hf(hf_config_json(QWEN3_LIKE)).qk_norm  # unchanged, it loads


def test_corrupt_files(tmp_path, tiny_tokenizer):
    d = write_hf_dir(tmp_path / "hf", LLAMA_LIKE, random_hf_tensors(LLAMA_LIKE), tiny_tokenizer)
    with open(os.path.join(d, "model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(weights.LoadError, match="model.safetensors: cannot read"):
        weights.load_model(d)
    stored = write_gguf(tmp_path / "m.gguf", "llama", LLAMA_LIKE, random_hf_tensors(LLAMA_LIKE),
                        tiny_tokenizer)
    assert stored
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 3])
    with pytest.raises(weights.LoadError, match="cut.gguf"):
        weights.load_model(str(tmp_path / "cut.gguf"))
    with pytest.raises(weights.LoadError, match="no such model file"):
        weights.load_model(str(tmp_path / "absent.gguf"))
    # a file named .gguf that is not one is refused by its first bytes, before any loading
    (tmp_path / "text.gguf").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(weights.LoadError, match="text.gguf: not a GGUF file"):
        weights.model_kind(str(tmp_path / "text.gguf"))


def test_unknown_model_name_and_tiny_options():
    with pytest.raises(weights.LoadError, match="unknown model 'gpt-17'"):
        weights.load_model("gpt-17")
    with pytest.raises(weights.LoadError, match="tiny model option 'depth=3' is not valid"):
        weights.load_model("tiny:depth=3")
    m = weights.load_model("tiny:layers=1,hidden=32,heads=2,kv_heads=1,head_dim=16,mlp=64")
    assert (m.cfg.num_layers, m.cfg.hidden_size, m.cfg.num_heads) == (1, 32, 2)
    assert m.cfg.vocab_size >= m.tokenizer.vocab_size


def test_cli_reports_bad_model_in_one_line(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\x00" * 40)
    run = subprocess.run([sys.executable, "launch/chat.py", f"--model={tmp_path / 'bad.gguf'}",
                          "--prompt=hi"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "bad.gguf" in lines[0], run.stderr


QWEN25_05B = ("random:layers=24,hidden=896,heads=14,kv_heads=2,head_dim=64,mlp=4864,"
              "vocab=151936,qkv_bias=1,tie=1")


def test_random_spec_has_the_exact_shape():
    """`random:` states a real model's shape exactly (no weights, nothing allocated here):
    Qwen2.5-0.5B's 494,032,768 parameters, by formula and by the abstract parameter tree."""
    import math

    assert weights.model_kind(QWEN25_05B) == "random"
    cfg = weights.random_config(weights._parse_tiny(QWEN25_05B, weights.RANDOM_DEFAULTS))
    assert (cfg.vocab_size, cfg.qkv_bias, cfg.tie_embeddings) == (151936, True, True)
    assert cfg.num_params == 494_032_768
    shapes = jax.tree_util.tree_leaves(M.abstract_params(cfg))
    assert sum(math.prod(s.shape) for s in shapes) == 494_032_768
    for bad, why in (("random:tie=2", "0 or 1"), ("random:vocab=100", ">= 384"),
                     ("random:heads=3", "num_kv_heads"), ("random:depth=1", "not valid")):
        with pytest.raises(weights.LoadError, match=why):
            weights.model_kind(bad)


def test_random_spec_loads_untied_with_bias_and_a_stand_in_tokenizer():
    m = weights.load_model("random:layers=1,hidden=32,heads=4,kv_heads=2,head_dim=8,mlp=40,"
                           "vocab=1000,qkv_bias=1,tie=0,theta=500000", dtype="float32")
    assert (m.cfg.vocab_size, m.cfg.rope_theta, m.cfg.tie_embeddings) == (1000, 500000.0, False)
    assert "bias" in m.params["layers"]["attn"]["q"] and "lm_head" in m.params
    assert m.cfg.num_params == sum(x.size for x in jax.tree_util.tree_leaves(m.params))
    ids = m.tokenizer.encode("Hello")
    assert m.tokenizer.decode(ids) == "Hello" and max(ids) < m.cfg.vocab_size


def test_runs_side_by_side_each_converting_the_same_cache_all_succeed(tmp_path, tiny_tokenizer):
    """Seeds started at once on a fresh machine each convert the embedded model into the same
    cache folder (weights.converted_dir): every writer succeeds, the folder ends complete and
    loadable, no partial copy is left, and a later writer leaves the first copy in place.
    Outside a cache (launch/export.py) an existing folder stays an error."""
    import threading

    tensors = random_hf_tensors(QWEN_LIKE, seed=5)
    m = weights.load_model(write_hf_dir(tmp_path / "src", QWEN_LIKE, tensors, tiny_tokenizer))
    out = tmp_path / "cache" / "hf"
    errors, start = [], threading.Barrier(6)

    def convert():
        start.wait()
        try:
            weights.save_hf_dir(str(out), m.cfg, m.params, m.tokenizer, shared=True)
        except Exception as e:  # noqa: BLE001 — collected and asserted on below
            errors.append(e)

    threads = [threading.Thread(target=convert) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(os.listdir(tmp_path / "cache")) == ["hf"]  # no .partial- folder left
    first = os.stat(out / "model.safetensors").st_mtime_ns
    weights.save_hf_dir(str(out), m.cfg, m.params, m.tokenizer, shared=True)
    assert os.stat(out / "model.safetensors").st_mtime_ns == first
    again = weights.load_model(str(out))
    assert again.cfg == m.cfg
    with pytest.raises(weights.LoadError, match="already exists"):
        weights.save_hf_dir(str(out), m.cfg, m.params, m.tokenizer)


def test_a_partial_gemma3_text_config_reads_as_transformers_fills_it():
    # the multimodal checkpoints' text_config gives a few fields; the rest are the config
    # class's defaults, which the family row holds (checked against transformers' own)
    from transformers import Gemma3TextConfig

    defaults = Gemma3TextConfig().to_dict()
    rope = defaults.get("rope_parameters") or {}
    if "full_attention" in rope:  # transformers >= 5 nests them by layer type
        defaults.update(rope_theta=rope["full_attention"]["rope_theta"],
                        rope_local_base_freq=rope["sliding_attention"]["rope_theta"])
    row = dict(families.family("gemma3").hf_defaults)
    assert row == {k: defaults[k] for k in row}
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                           "num_hidden_layers": 34, "model_type": "gemma3_text",
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model"}}
    cfg = weights.config_from_hf(hub)
    assert cfg == M.ModelConfig(**families.shape("gemma3-4b").fields())
