"""The jitted multi-turn sampler against full forward passes (tiny model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starpo import model as M
from starpo import sampler as S
from starpo import weights
from tests.conftest import LLAMA_LIKE, hf_config_json, random_hf_tensors

EOS, PAD, CTX = 5, 0, 24


class FakeTok:
    eos_ids, pad_id = (EOS,), PAD


@pytest.fixture(scope="module")
def tiny():
    cfg = weights.config_from_hf(hf_config_json(LLAMA_LIKE))
    return cfg, weights.params_from_tensors(cfg, random_hf_tensors(LLAMA_LIKE, 7).get, "t", gguf=False)


@pytest.fixture(scope="module")
def last_logits(tiny):
    """Logits after one unpadded sequence, via a right-padded full forward of width CTX."""
    cfg, params = tiny
    fwd = jax.jit(lambda t, v: M.forward(params, cfg, t, v)[0][0])

    def f(seq):
        t = np.zeros((1, CTX), np.int32)
        t[0, :len(seq)] = seq
        return fwd(jnp.asarray(t), jnp.asarray(np.arange(CTX) < len(seq))[None])[len(seq) - 1]

    return f


def padded(rows, width, left=False):
    t = np.full((len(rows), width), PAD, np.int32)
    v = np.zeros((len(rows), width), bool)
    for b, r in enumerate(rows):
        sl = slice(width - len(r), width) if left else slice(0, len(r))
        t[b, sl], v[b, sl] = r, True
    return jnp.asarray(t), jnp.asarray(v)


def greedy_reference(last_logits, seq, n):
    """Greedy continuation by full forward passes: (tokens, log-probs), stopping at EOS."""
    seq, out, lps = list(seq), [], []
    for _ in range(n):
        logits = last_logits(seq)
        nxt = int(jnp.argmax(logits))
        out.append(nxt)
        lps.append(float(jax.nn.log_softmax(logits)[nxt]))
        seq.append(nxt)
        if nxt == EOS:
            break
    return out, lps


def test_greedy_equals_argmax_of_full_forward(tiny, last_logits):
    cfg, params = tiny
    rng = np.random.default_rng(0)
    rows = [rng.integers(6, cfg.vocab_size, n) for n in (3, 7)]
    smp = S.make_sampler(cfg, FakeTok, max_new_tokens=6)
    state, turn = smp.generate(params, *padded(rows, 7, left=True), jax.random.key(0), 0.0, CTX)
    for b, r in enumerate(rows):
        want, want_lp = greedy_reference(last_logits, r, 6)
        n = int(turn.length[b])
        assert turn.tokens[b, :n].tolist() == want
        np.testing.assert_allclose(turn.logprobs[b, :n], want_lp, atol=1e-4)
        assert int(turn.stop_reason[b]) == (S.EOS if want[-1] == EOS else S.BUDGET)
        # the state holds exactly prompt + sampled tokens, with the loss mask on the latter
        v = np.asarray(state.valid[b])
        assert np.asarray(state.tokens[b])[v].tolist() == list(r) + want
        assert np.asarray(state.generated[b])[v].tolist() == [False] * len(r) + [True] * n
        np.testing.assert_allclose(np.asarray(state.logprobs[b])[v][len(r):], want_lp, atol=1e-4)


def test_keys_reproduce_and_logprobs_are_the_sampling_distribution(tiny, last_logits):
    cfg, params = tiny
    smp = S.make_sampler(cfg, FakeTok, max_new_tokens=5)
    prompt = padded([[9, 9, 9]] * 4, 3)
    a = smp.generate(params, *prompt, jax.random.key(1), 1.0, CTX)[1]
    b = smp.generate(params, *prompt, jax.random.key(1), 1.0, CTX)[1]
    c = smp.generate(params, *prompt, jax.random.key(2), 1.0, CTX)[1]
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    for r in range(4):  # every token's log-prob under a full forward of its own prefix
        toks = a.tokens[r, :int(a.length[r])].tolist()
        for i, tok in enumerate(toks):
            want = jax.nn.log_softmax(last_logits([9, 9, 9] + toks[:i]))[tok]
            np.testing.assert_allclose(a.logprobs[r, i], want, atol=1e-4)


def test_multi_turn_append_equals_running_from_scratch(tiny, last_logits):
    """Turn 1 on prompts, append per-row env chunks of different lengths, turn 2: the same
    tokens and log-probs as greedy decoding of the concatenated text from scratch."""
    cfg, params = tiny
    rng = np.random.default_rng(5)
    smp = S.make_sampler(cfg, FakeTok, max_new_tokens=3)
    prompts = [rng.integers(6, cfg.vocab_size, n) for n in (4, 2)]
    replies = [rng.integers(6, cfg.vocab_size, n) for n in (1, 3)]
    state, t1 = smp.generate(params, *padded(prompts, 4), jax.random.key(0), 0.0, CTX)
    state, t2 = smp.turn(params, state, *padded(replies, 3), jax.random.key(1), 0.0,
                         jnp.ones((2,), bool))
    for b in range(2):
        first = t1.tokens[b, :int(t1.length[b])].tolist()
        assert first == greedy_reference(last_logits, prompts[b], 3)[0]
        history = list(prompts[b]) + first + list(replies[b])
        want, want_lp = greedy_reference(last_logits, history, 3)
        assert t2.tokens[b, :int(t2.length[b])].tolist() == want
        np.testing.assert_allclose(t2.logprobs[b, :len(want)], want_lp, atol=1e-4)
        v = np.asarray(state.valid[b])
        assert np.asarray(state.tokens[b])[v].tolist() == history + want


def test_inactive_rows_stay_untouched_and_full_context_stops(tiny):
    cfg, params = tiny
    smp = S.make_sampler(cfg, FakeTok, max_new_tokens=4)
    state, _ = smp.generate(params, *padded([[7, 8], [7, 8, 9]], 3), jax.random.key(0), 1.0, 8)
    before = jax.tree_util.tree_map(np.asarray, state)
    chunk = padded([[10, 11, 12], [10, 11, 12]], 3)
    state, turn = smp.turn(params, state, *chunk, jax.random.key(3), 1.0,
                           jnp.asarray([False, True]))
    after = jax.tree_util.tree_map(np.asarray, state)
    for leaf_b, leaf_a in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
        np.testing.assert_array_equal(leaf_b[:, 0] if leaf_b.ndim == 5 else leaf_b[0],
                                      leaf_a[:, 0] if leaf_a.ndim == 5 else leaf_a[0])
    assert int(turn.stop_reason[0]) == S.NOT_RUN and int(turn.length[0]) == 0
    # row 1 used 3 + 4 = 7 of 8 slots: its 3-token chunk does not fit, nothing is written
    assert int(turn.stop_reason[1]) == S.CONTEXT_FULL and int(turn.length[1]) == 0
    assert int(after.cache.end[1]) == int(before.cache.end[1]) == 7


def test_decode_windows_change_nothing_but_the_work(tiny):
    """Three turns with decode windows (128 of 256 slots) against the whole cache, each on a
    stacked cache and on per-layer buffers kept for good (`init_state(split=True)`, as the
    rollout plays): the same tokens, log-probs and final state, including a long inactive row
    whose history lies beyond the window its neighbours decode in."""
    cfg, params = tiny
    assert S.window_sizes(256, 4) == (64, 128, 192, 256)
    assert S.window_sizes(100, 3) == (64, 100) and S.window_sizes(24, 4) == (24,)
    rng = np.random.default_rng(9)
    prompts = padded([rng.integers(6, cfg.vocab_size, n) for n in (30, 12, 20)], 30)
    short = padded([[6], [7, 8], [9]], 2)
    results, long_chunk = [], None
    # (split buffers over the whole cache: every rollout test plays them)
    for windows, split in ((1, False), (2, False), (2, True)):
        smp = S.make_sampler(cfg, FakeTok, max_new_tokens=8, decode_windows=windows)
        state, t1 = smp.generate(params, *prompts, jax.random.key(0), 1.0, 256, split=split)
        if long_chunk is None:  # row 0 ends its chunk 3 slots short of the 128 window:
            # its history fits there, its reply does not
            n = 125 - int(state.cache.end[0])
            long_chunk = padded([rng.integers(6, cfg.vocab_size, n), [7], [8, 9]], n)
        state, t2 = smp.turn(params, state, *long_chunk, jax.random.key(1), 1.0,
                             jnp.ones((3,), bool))
        state, t3 = smp.turn(params, state, *short, jax.random.key(2), 1.0,
                             jnp.asarray([False, True, True]))
        assert M.is_split(state.cache.k) == split
        state = state.replace(cache=M.stack_cache(state.cache))
        results.append(jax.tree_util.tree_map(np.asarray, (state, t1, t2, t3)))
    assert int(results[0][2].length[0]) > 3  # row 0's turn 2 reply runs past slot 128
    assert int(results[0][0].cache.end[1:].max()) + 8 <= 128  # turn 3 decodes in 128 slots
    for other in results[1:]:
        for whole, windowed in zip(*(jax.tree_util.tree_leaves(r) for r in (results[0], other))):
            if whole.dtype.kind == "f":
                np.testing.assert_allclose(windowed, whole, rtol=1e-5, atol=1e-6)
            else:
                np.testing.assert_array_equal(windowed, whole)


@pytest.mark.parametrize("windows,split,context_window", [(1, True, 0), (2, False, 1)],
                         ids=["buffers", "windows-stacked-context"])
def test_a_shared_first_turn_equals_every_row_appending(tiny, windows, split, context_window):
    """Blocks of 3 rows with one state and chunk (a group's first turn): `share=3` appends
    once per block and copies the keys and values, the rows then sampling apart. The same
    replies, log-probs and state as every row appending its own copy; then a second turn
    (every row's own chunk) from both states agrees too."""
    cfg, params = tiny
    rng = np.random.default_rng(4)
    smp = S.make_sampler(cfg, FakeTok, max_new_tokens=6, decode_windows=windows,
                         context_window=context_window)
    blocks = [rng.integers(6, cfg.vocab_size, n) for n in (5, 3)]
    chunk = padded([blocks[0]] * 3 + [blocks[1]] * 3, 5)
    later = padded([rng.integers(6, cfg.vocab_size, n) for n in (1, 2, 3, 2, 1, 2)], 3)
    out = []
    for share in (1, 3):
        state = S.init_state(cfg, 6, 128, turns=context_window > 0, split=split)
        # (a hot temperature: this random model's replies are nearly deterministic at 1)
        state, t1 = S.run_turn(smp, params, state, *chunk, jax.random.key(3), jnp.float32(30.0),
                               jnp.ones((6,), bool), None, turn=0, share=share)
        state, t2 = S.run_turn(smp, params, state, *later, jax.random.key(4), jnp.float32(30.0),
                               jnp.ones((6,), bool), None, turn=1)
        if split:
            state = state.replace(cache=M.stack_cache(state.cache))
        out.append(jax.tree_util.tree_map(np.asarray, (state, t1, t2)))
    # the rows of a block sampled apart, and a block's rows carry its own prompt
    assert len({tuple(r) for r in out[0][1].tokens[:3]}) > 1
    for each, shared in zip(*(jax.tree_util.tree_leaves(o) for o in out)):
        if each.dtype.kind == "f":
            np.testing.assert_allclose(shared, each, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(shared, each)
    with pytest.raises(ValueError, match="does not divide"):
        S.run_turn(smp, params, S.init_state(cfg, 6, 128), *chunk, jax.random.key(3),
                   jnp.float32(1.0), jnp.ones((6,), bool), None, share=4)


def test_second_call_does_not_retrace(tiny):
    cfg, params = tiny
    smp = S.make_sampler(cfg, FakeTok, max_new_tokens=3)
    prompt = padded([[6, 7, 8]] * 2, 3)
    smp.generate(params, *prompt, jax.random.key(0), 1.0, CTX)
    size = S.run_turn._cache_size()
    other = padded([[9, 10], [11, 12, 13]], 3)
    smp.generate(params, *other, jax.random.key(5), 0.7, CTX)
    assert S.run_turn._cache_size() == size


def test_top_k_and_top_p_stay_in_the_allowed_set():
    logits = jnp.log(jnp.asarray([[0.05, 0.4, 0.3, 0.15, 0.1]] * 2000))
    keys = jax.random.split(jax.random.key(0), 2)
    tok_k, lp_k = S.sample_next(logits, keys[0], 1.0, top_k=2)
    assert set(np.unique(tok_k)) == {1, 2}
    # renormalised over the top 2: p(1) = 0.4 / 0.7
    np.testing.assert_allclose(np.exp(lp_k[tok_k == 1][0]), 0.4 / 0.7, rtol=1e-5)
    assert abs(float((tok_k == 1).mean()) - 0.4 / 0.7) < 0.05
    # top-p 0.75: the nucleus is {1, 2, 3} (0.4 + 0.3 < 0.75 <= 0.4 + 0.3 + 0.15)
    tok_p, _ = S.sample_next(logits, keys[1], 1.0, top_p=0.75)
    assert set(np.unique(tok_p)) == {1, 2, 3}
    tok_g, _ = S.sample_next(logits, keys[1], 0.0, top_p=0.75)
    assert set(np.unique(tok_g)) == {1}


def test_inverse_cdf_draws_follow_the_distribution():
    """`categorical` against the probabilities themselves: V=600 spans three 256-token blocks
    (the last padded), with mass at both edges of a block and -inf everywhere else."""
    probs = np.zeros(600)
    support = [0, 255, 256, 300, 599]
    probs[support] = [0.1, 0.2, 0.3, 0.15, 0.25]
    n = 20000
    with np.errstate(divide="ignore"):
        logits = jnp.asarray(np.log(np.tile(probs, (n, 1))), jnp.float32)
    tok, lp = S.sample_next(logits, jax.random.key(3), 1.0)
    tok = np.asarray(tok)
    assert set(np.unique(tok)) == set(support)
    freq = np.bincount(tok, minlength=600) / n
    np.testing.assert_allclose(freq[support], probs[support], atol=0.015)  # ~4.5 std errors
    np.testing.assert_allclose(np.asarray(lp), np.log(probs[tok]), rtol=1e-5)
    # all mass on the first or on the last token: rounding never steps onto an empty slot
    edge = np.full((2, 600), -np.inf, np.float32)
    edge[0, 0] = edge[1, 599] = 3.0
    for k in range(20):
        tok_e, lp_e = S.sample_next(jnp.asarray(edge), jax.random.key(k), 1.0)
        assert np.asarray(tok_e).tolist() == [0, 599]
        np.testing.assert_allclose(np.asarray(lp_e), 0.0, atol=1e-6)


def test_stop_string_spanning_tokens(tiny_tokenizer):
    """`</answer>` split over several tokens stops the row right after its last byte."""
    tok = tiny_tokenizer
    table, lengths = S.byte_table(tok.token_bytes())
    pieces = ["<think>", " ok", "</", "ans", "wer", ">", " more"]
    ids = [i for p in pieces for i in tok.encode(p)]
    stop_at = len([i for p in pieces[:6] for i in tok.encode(p)])  # tokens up to '>'
    tail = jnp.zeros((1, 9 + table.shape[1]), jnp.uint8)
    hits = []
    for i in ids:
        n = jnp.asarray([lengths[i]])
        tail = S._push_bytes(tail, jnp.asarray(table[i])[None], n)
        hits.append(bool(S._ends_with_stop(tail, n, (b"</answer>",))[0]))
    assert hits.index(True) == stop_at - 1
    # and inside the sampler: a model forced to emit these ids stops there
    assert tok.decode(ids[:stop_at]).endswith("</answer>")


def test_stop_strings_in_the_loop(tiny_tokenizer):
    """Near-uniform sampling from a random tiny model: every row stops exactly at the first
    occurrence of a stop string in its decoded text (Python's `in` as the reference), and some
    of those occurrences span several tokens."""
    tok = tiny_tokenizer
    cfg = weights.tiny_config(tok.vocab_size, layers=1, hidden=16, heads=2, kv_heads=1,
                              head_dim=8, mlp=16)
    params = M.init_params(cfg, jax.random.key(0))
    stops = tuple(c + " " for c in "aeinorst")  # a space starts a pre-token: always spans
    smp = S.make_sampler(cfg, tok, max_new_tokens=24, stop=stops)
    prompt = padded([tok.encode("Turn 1:")] * 48, 4)
    _, turn = smp.generate(params, *prompt, jax.random.key(0), 5.0, 40,
                           token_bytes=tuple(map(jnp.asarray, S.byte_table(tok.token_bytes()))))
    spanning = 0
    for r in range(48):
        ids = turn.tokens[r, :int(turn.length[r])].tolist()
        text, before = tok.decode(ids), tok.decode(ids[:-1])
        reason = int(turn.stop_reason[r])
        if reason == S.STOP_STRING:
            assert any(x in text for x in stops) and not any(x in before for x in stops), text
            spanning += not any(x in tok.decode(ids[-1:]) for x in stops)
        else:
            assert not any(x in text for x in stops), (reason, text)
    assert (np.asarray(turn.stop_reason) == S.STOP_STRING).sum() >= 5
    assert spanning >= 3
