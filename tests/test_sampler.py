"""The jitted generate loop against step-by-step full forward passes (tiny model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starpo import model as M
from starpo import sampler, weights
from tests.conftest import LLAMA_LIKE, hf_config_json, random_hf_tensors

EOS = 5


@pytest.fixture(scope="module")
def tiny():
    cfg = weights.config_from_hf(hf_config_json(LLAMA_LIKE))
    return cfg, weights.params_from_tensors(cfg, random_hf_tensors(LLAMA_LIKE, 7).get, "t", gguf=False)


def _full_forward(cfg, params):
    """Logits of one right-padded row of fixed width 16 (one compile for every length)."""
    fwd = jax.jit(lambda t, v: M.forward(params, cfg, t, v)[0][0])

    def last_logits(seq):
        t = np.zeros((1, 16), np.int32)
        t[0, :len(seq)] = seq
        return fwd(jnp.asarray(t), jnp.asarray(np.arange(16) < len(seq))[None])[len(seq) - 1]

    return last_logits


def _generate(cfg, params, prompt, valid, key, temperature, n=6):
    return sampler.generate(params, jnp.asarray(prompt), jnp.asarray(valid), key, temperature,
                            cfg=cfg, max_new_tokens=n, cache_len=16, eos_ids=(EOS,), pad_id=0)


def test_greedy_equals_argmax_of_full_forward(tiny):
    cfg, params = tiny
    rng = np.random.default_rng(0)
    rows = [rng.integers(6, cfg.vocab_size, n) for n in (3, 7)]
    prompt = np.zeros((2, 7), np.int32)
    valid = np.zeros((2, 7), bool)
    for b, r in enumerate(rows):  # left padding
        prompt[b, 7 - len(r):], valid[b, 7 - len(r):] = r, True
    out = _generate(cfg, params, prompt, valid, jax.random.key(0), 0.0)
    last_logits = _full_forward(cfg, params)
    for b, r in enumerate(rows):
        seq, want, want_lp = list(r), [], []
        for _ in range(6):
            logits = last_logits(seq)
            nxt = int(jnp.argmax(logits))
            want.append(nxt)
            want_lp.append(float(jax.nn.log_softmax(logits)[nxt]))
            seq.append(nxt)
            if nxt == EOS:
                break
        n = int(out.length[b])
        assert out.tokens[b, :n].tolist() == want
        np.testing.assert_allclose(out.logprobs[b, :n], want_lp, atol=1e-4)


def test_sampling_is_reproducible_and_keyed(tiny):
    cfg, params = tiny
    prompt = np.full((4, 3), 9, np.int32)
    valid = np.ones((4, 3), bool)
    a = _generate(cfg, params, prompt, valid, jax.random.key(1), 1.0)
    b = _generate(cfg, params, prompt, valid, jax.random.key(1), 1.0)
    c = _generate(cfg, params, prompt, valid, jax.random.key(2), 1.0)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    # the reported log-prob is that of the sampled token under the full softmax (temperature 1)
    lp = jax.nn.log_softmax(_full_forward(cfg, params)([9, 9, 9]))
    np.testing.assert_allclose(a.logprobs[:, 0], lp[a.tokens[:, 0]], atol=1e-4)
