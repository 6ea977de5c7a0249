"""The Flax decoder against a NumPy reference, and its KV cache against full forward passes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starpo import model as M
from starpo import weights
from tests import numpy_reference
from tests.conftest import LLAMA_LIKE, QWEN_LIKE, hf_config_json, random_hf_tensors


def _load(c, seed=0, **overrides):
    tensors = random_hf_tensors(c, seed)
    cfg = weights.config_from_hf(hf_config_json(c), **overrides)
    return cfg, weights.params_from_tensors(cfg, tensors.get, "test", gguf=False), tensors


@pytest.fixture(scope="module")
def tiny():
    cfg, params, _ = _load(QWEN_LIKE)
    return cfg, params


@pytest.fixture(scope="module")
def fwd(tiny):
    cfg, params = tiny
    return jax.jit(lambda t, v, c: M.forward(params, cfg, t, v, c))


@pytest.mark.parametrize("c", [LLAMA_LIKE, QWEN_LIKE], ids=["llama-tied", "qwen2-bias-scaled"])
def test_flax_matches_numpy_reference(c):
    cfg, params, tensors = _load(c)
    ids = np.random.default_rng(1).integers(0, c["vocab"], 13)
    want = numpy_reference.forward(tensors, c, ids)
    got, _ = M.forward(params, cfg, jnp.asarray(ids)[None], jnp.ones((1, 13), bool))
    np.testing.assert_allclose(np.asarray(got[0]), want, atol=2e-4, rtol=2e-4)


def test_rope_scaling_changes_frequencies():
    cfg = weights.config_from_hf(hf_config_json(QWEN_LIKE))
    plain = M.rope_inv_freq(cfg.replace(rope_scaling=None))
    scaled = M.rope_inv_freq(cfg)
    ref = numpy_reference.inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(scaled, ref, rtol=1e-6)
    assert scaled[-1] == pytest.approx(plain[-1] / 8.0)  # longest wavelength divided by factor
    assert scaled[0] == pytest.approx(plain[0])  # shortest wavelength untouched


def test_cache_decode_equals_full_forward(tiny, fwd):
    cfg, _ = tiny
    ids = jax.random.randint(jax.random.key(0), (2, 12), 0, cfg.vocab_size)
    full, _ = fwd(ids, jnp.ones_like(ids, bool), None)
    cache = M.init_cache(cfg, 2, 16)
    first, cache = fwd(ids[:, :7], jnp.ones((2, 7), bool), cache)
    steps = [first]
    for i in range(7, 12):
        logits, cache = fwd(ids[:, i:i + 1], jnp.ones((2, 1), bool), cache)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=1e-4, rtol=1e-4)
    assert cache.end.tolist() == [12, 12] and cache.pos.tolist() == [12, 12]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_equal_rows_alone(tiny, fwd, side):
    cfg, _ = tiny
    rng = np.random.default_rng(2)
    lengths = [5, 9, 12]
    rows = [rng.integers(0, cfg.vocab_size, n) for n in lengths]
    tokens = np.zeros((3, 12), np.int32)
    valid = np.zeros((3, 12), bool)
    for b, r in enumerate(rows):
        sl = slice(12 - len(r), 12) if side == "left" else slice(0, len(r))
        tokens[b, sl], valid[b, sl] = r, True
    batched, _ = fwd(jnp.asarray(tokens), jnp.asarray(valid), None)
    # the same through the cache, then two decode steps per row
    cache = M.init_cache(cfg, 3, 16)
    cached, cache = fwd(jnp.asarray(tokens), jnp.asarray(valid), cache)
    nxt = rng.integers(0, cfg.vocab_size, (3, 2)).astype(np.int32)
    dec1, cache = fwd(jnp.asarray(nxt[:, :1]), jnp.ones((3, 1), bool), cache)
    dec2, cache = fwd(jnp.asarray(nxt[:, 1:]), jnp.ones((3, 1), bool), cache)
    for b, r in enumerate(rows):
        alone, _ = fwd(jnp.asarray(np.concatenate([r, nxt[b]]))[None], jnp.ones((1, len(r) + 2), bool),
                       None)
        np.testing.assert_allclose(batched[b][valid[b]], alone[0, :len(r)], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(cached[b][valid[b]], alone[0, :len(r)], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(dec1[b, 0], alone[0, len(r)], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(dec2[b, 0], alone[0, len(r) + 1], atol=1e-4, rtol=1e-4)
    assert cache.pos.tolist() == [n + 2 for n in lengths]


def test_append_chunks_at_row_offsets(tiny, fwd):
    """Prompt, then an appended chunk and a decode step per row, each row at its own offset."""
    cfg, _ = tiny
    rng = np.random.default_rng(3)
    prompt_len, chunk_len = [4, 8], [6, 2]
    prompts = [rng.integers(0, cfg.vocab_size, n) for n in prompt_len]
    chunks = [rng.integers(0, cfg.vocab_size, n) for n in chunk_len]
    last = rng.integers(0, cfg.vocab_size, 2)

    def right_padded(seqs, width):
        t = np.zeros((2, width), np.int32)
        v = np.zeros((2, width), bool)
        for b, s in enumerate(seqs):
            t[b, :len(s)], v[b, :len(s)] = s, True
        return jnp.asarray(t), jnp.asarray(v)

    cache = M.init_cache(cfg, 2, 24)
    _, cache = fwd(*right_padded(prompts, 8), cache)
    assert cache.end.tolist() == prompt_len  # right padding is overwritten by the next write
    chunk_logits, cache = fwd(*right_padded(chunks, 6), cache)
    step, cache = fwd(jnp.asarray(last[:, None]), jnp.ones((2, 1), bool), cache)
    for b in range(2):
        seq = np.concatenate([prompts[b], chunks[b], last[b:b + 1]])
        full, _ = fwd(jnp.asarray(seq)[None], jnp.ones((1, len(seq)), bool), None)
        p, c = prompt_len[b], chunk_len[b]
        np.testing.assert_allclose(chunk_logits[b, :c], full[0, p:p + c], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(step[b, 0], full[0, -1], atol=1e-4, rtol=1e-4)


def test_finished_rows_are_untouched(tiny, fwd):
    """A row with no valid tokens keeps its cache bit for bit, even right at the cache's end."""
    cfg, _ = tiny
    ids = jax.random.randint(jax.random.key(4), (2, 6), 0, cfg.vocab_size)
    cache = M.init_cache(cfg, 2, 8)
    _, cache = fwd(ids, jnp.asarray([[True] * 4 + [False] * 2, [True] * 6]), cache)
    assert cache.end.tolist() == [4, 6]
    _, after = fwd(ids[:, :4], jnp.asarray([[True] * 4, [False] * 4]), cache)
    assert after.end.tolist() == [8, 6] and after.pos.tolist() == [8, 6]
    for field in ("k", "v"):
        np.testing.assert_array_equal(getattr(after, field)[:, 1], getattr(cache, field)[:, 1])
    np.testing.assert_array_equal(after.valid[1], cache.valid[1])


def test_every_weight_names_its_logical_axes():
    cfg = weights.config_from_hf(hf_config_json(QWEN_LIKE), value_head=True)
    axes = M.logical_axes(cfg)
    shapes = M.abstract_params(cfg)
    flat_axes = jax.tree_util.tree_leaves_with_path(axes, is_leaf=lambda x: isinstance(
        x, jax.sharding.PartitionSpec))
    assert len(flat_axes) == len(jax.tree_util.tree_leaves(shapes)) == 17
    for path, spec in flat_axes:
        leaf = shapes
        for k in path:
            leaf = leaf[k.key]
        assert len(spec) == leaf.ndim, path
        if "value_head" not in jax.tree_util.keystr(path):
            assert all(a is not None for a in spec), path
        if jax.tree_util.keystr(path).startswith("['layers']"):
            assert spec[0] == "layers"


def test_value_head_and_remat_gradients():
    cfg, params, _ = _load(LLAMA_LIKE)
    cfg = cfg.replace(value_head=True)
    params = dict(params, value_head={"kernel": jnp.ones((cfg.hidden_size, 1)) * 0.1,
                                      "bias": jnp.zeros((1,))})
    ids = jax.random.randint(jax.random.key(5), (2, 6), 0, cfg.vocab_size)

    def loss(p, c):
        h, _ = M.hidden_states(p, c, ids, jnp.ones_like(ids, bool))
        return M.head_values(p, c, h).sum() + M.head_logits(p, c, h).mean()

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    v, g = grad(params, cfg)
    for policy in M.REMAT_POLICIES:
        v_r, g_r = grad(params, cfg.replace(remat=True, remat_policy=policy))
        np.testing.assert_allclose(v, v_r, rtol=1e-6)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g, g_r)
    # what runs again in the backward pass: the whole layer, or all but its dense matmuls
    dots = {name: jax.jit(jax.grad(loss), static_argnums=1).lower(params, c).as_text().count(
        "stablehlo.dot_general") for name, c in (
            ("none", cfg), ("full", cfg.replace(remat=True)),
            ("save_dense", cfg.replace(remat=True, remat_policy="save_dense")))}
    assert dots["none"] < dots["save_dense"] < dots["full"], dots
    assert dots["full"] - dots["save_dense"] > dots["save_dense"] - dots["none"], dots
    h, _ = M.hidden_states(params, cfg, ids, jnp.ones_like(ids, bool))
    assert M.head_values(params, cfg, h).shape == (2, 6)
    assert float(jnp.abs(g["value_head"]["kernel"]).sum()) > 0
    fresh = M.init_params(cfg, jax.random.key(0))
    assert float(jnp.abs(M.head_values(fresh, cfg, h)).max()) == 0.0  # critic starts at zero


def test_config_rejects_bad_heads():
    with pytest.raises(ValueError, match="remat_policy"):
        M.ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                      head_dim=4, intermediate_size=8, remat_policy="dots")
    with pytest.raises(ValueError, match="num_kv_heads"):
        M.ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=3, num_kv_heads=2,
                      head_dim=4, intermediate_size=8)


def test_bfloat16_matmuls_stay_close_to_float32(tiny, fwd):
    """bfloat16 matmul inputs accumulate in float32: logits stay within bf16 rounding."""
    cfg, params = tiny
    ids = jax.random.randint(jax.random.key(6), (2, 9), 0, cfg.vocab_size)
    valid = jnp.ones_like(ids, bool)
    want, _ = fwd(ids, valid, None)
    got, _ = M.forward(params, cfg.replace(dtype="bfloat16"), ids, valid)
    assert got.dtype == jnp.float32
    err = float(jnp.abs(got - want).max())
    assert 0 < err < 0.05 * float(jnp.abs(want).max()), err


def test_bfloat16_gradients_run_in_bfloat16_and_stay_close_to_float32(tiny):
    """Mixed precision's backward: no float32 x float32 matmul is left in the gradient of a
    bfloat16 model (autodiff alone multiplies the float32 cotangent with the bf16 operands,
    i.e. in float32), and the gradients agree with float32 ones to bf16 rounding."""
    cfg, params = tiny
    ids = jax.random.randint(jax.random.key(7), (2, 9), 0, cfg.vocab_size)
    valid = jnp.ones_like(ids, bool)

    def loss(p, c):
        logits, _ = M.forward(p, c, ids, valid)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3] * jnp.arange(9.0))

    bf16 = cfg.replace(dtype="bfloat16")
    grad_bf16 = jax.jit(jax.grad(lambda p: loss(p, bf16)))
    hlo = grad_bf16.lower(params).as_text()
    f32_dots = [ln for ln in hlo.splitlines()
                if "dot_general" in ln and ln.count("tensor<") >= 3
                and all("xf32>" in t for t in ln.split("tensor<")[1:3])]
    assert not f32_dots, f32_dots[:2]
    want = jax.device_get(jax.jit(jax.grad(lambda p: loss(p, cfg)))(params))
    got = grad_bf16(params)
    for path, g in jax.tree_util.tree_flatten_with_path(got)[0]:
        w = want
        for k in path:
            w = w[k.key]
        assert g.dtype == jnp.float32
        g = np.asarray(g)
        scale = float(np.abs(w).max())
        assert float(np.abs(g - w).max()) <= 0.05 * scale + 1e-6, jax.tree_util.keystr(path)


def test_block_causal_attention_equals_plain_attention():
    """The training forward's attention (query blocks that skip keys after them, written-out
    backward) equals softmax attention over visible keys: forward against a NumPy loop, all
    three gradients against autodiff of a dense masked version. 150 tokens in blocks of 64
    (the last one partial), left padding, right padding and a row of padding only."""
    B, K, G, T, E, block = 4, 2, 3, 150, 8, 64
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, K, T * G, E)).astype(np.float32)
    k = rng.normal(size=(B, K, T, E)).astype(np.float32)
    v = rng.normal(size=(B, K, T, E)).astype(np.float32)
    t = np.arange(T)
    valid = np.stack([t < T, t >= 40, t < 97, np.zeros(T, bool)])
    got = np.asarray(jax.jit(M.causal_attention, static_argnums=(4, 5))(q, k, v, valid, G, block))
    assert M._attention_blocks(T, block) == ((0, 64), (64, 128), (128, 150))
    for b in range(3):  # the padding-only row has no visible key: its output is not used
        for h in range(K):
            for row in range(T * G):
                keys = np.flatnonzero(valid[b] & (t <= row // G))
                if not valid[b, row // G] or not len(keys):
                    continue
                s = k[b, h, keys] @ q[b, h, row]
                p = np.exp(s - s.max())
                np.testing.assert_allclose(got[b, h, row], p @ v[b, h, keys] / p.sum(),
                                           atol=2e-5, err_msg=f"row {b} head {h} query {row}")

    mask = jnp.asarray(valid[:, None, :] & (np.repeat(t, G)[:, None] >= t[None, :]))

    def plain(q, k, v):
        s = jnp.where(mask[:, None], jnp.einsum("bkre,bkse->bkrs", q, k), M._MASK_VALUE)
        return jnp.einsum("bkrs,bkse->bkre", jax.nn.softmax(s, -1), v)

    w = rng.normal(size=q.shape).astype(np.float32) * np.repeat(valid, G, 1)[:, None, :, None]
    grads = [jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a) * w), argnums=(0, 1, 2)))(q, k, v)
             for f in (plain, lambda *a: M.causal_attention(*a, valid, G, block))]
    for name, want, have in zip("qkv", *grads):
        np.testing.assert_allclose(have, want, atol=1e-4, err_msg=f"d{name}")


def test_fresh_prefill_equals_attending_over_the_empty_cache(tiny):
    """fresh=True (the first chunk into an empty cache, attended in causal blocks without the
    empty slots) gives the hidden states and the cache of the cache path, and decoding on
    from either cache gives the same logits. 90 tokens: two query blocks; left padding."""
    cfg, params = tiny
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 90)), jnp.int32)
    valid = jnp.asarray(np.arange(90)[None] >= np.array([[0], [23]]))
    out = {}
    for fresh in (False, True):
        h, cache = jax.jit(lambda t, v, c, f=fresh: M.hidden_states(params, cfg, t, v, c, f))(
            tokens, valid, M.init_cache(cfg, 2, 100))
        step, _ = M.forward(params, cfg, tokens[:, :1], jnp.ones((2, 1), bool), cache)
        out[fresh] = (h, cache, step)
    (h0, c0, s0), (h1, c1, s1) = out[False], out[True]
    np.testing.assert_allclose(h1[valid], h0[valid], atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(c1), jax.tree_util.tree_leaves(c0)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(s1, s0, atol=1e-4)


@pytest.mark.parametrize("path", ["stacked", "window", "split"])
def test_cache_attention_in_query_blocks_equals_all_queries_at_once(tiny, monkeypatch, path):
    """A chunk appended to a cache attends in blocks of `CACHE_QUERY_BLOCK` queries (blocks of
    4 here: an 11-token chunk is 3 blocks, the last padded) with the numbers of all its queries
    at once: over the stacked cache (`_attend_cache_and_chunk`), under a context window (per
    query cache masks) and over per-layer buffers (`_attend_written_cache`)."""
    cfg, params = tiny
    rng = np.random.default_rng(5)
    lengths = (5, 6, 11)  # the prefix, turn 0's chunk, turn 1's chunk
    chunks = [jnp.asarray(rng.integers(0, cfg.vocab_size, (2, n)), jnp.int32) for n in lengths]
    valid = [jnp.ones((2, n), bool) for n in lengths]
    valid[2] = valid[2].at[1, 7:].set(False)  # row 1's last chunk is right-padded
    window = path == "window"
    turns = (M.PREFIX_TURN, 0, 1)

    def run(block):
        monkeypatch.setattr(M.attend, "CACHE_QUERY_BLOCK", block)

        @jax.jit  # a new function for each block size: the block is read when it traces
        def append(p, tokens, v, cache, turn):
            w = M.TurnWindow(jnp.full(tokens.shape, turn, jnp.int32), 1) if window else None
            return M.hidden_states(p, cfg, tokens, v, cache, window=w)

        p = M.split_layers(params) if path == "split" else params
        cache = M.init_cache(cfg, 2, 32, turns=window)
        out = []
        for tokens, v, turn in zip(chunks, valid, turns):
            h, cache = append(p, tokens, v, cache, turn)
            out.append(h)
        return out, M.stack_cache(cache)

    (h_all, c_all), (h_blocks, c_blocks) = run(10 ** 6), run(4)
    for a, b, v in zip(h_blocks, h_all, valid):
        np.testing.assert_allclose(a[v], b[v], atol=1e-5, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(c_blocks), jax.tree_util.tree_leaves(c_all)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def _attention_case(cfg, params, choice, tokens, valid, remat=False):
    """Logits and the gradient of a masked log-prob loss with `model.attention=choice`."""
    c = cfg.replace(attention=choice, remat=remat)

    def loss(p):
        logits, _ = M.forward(p, c, tokens, valid)
        logp = jax.nn.log_softmax(logits)
        return jnp.sum(jnp.where(valid, logp[..., 5] * jnp.arange(tokens.shape[1]), 0.0)), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, grads


def test_attention_choices_agree(tiny):
    """`model.attention` picks kernels, not numbers: jax.nn.dot_product_attention ("xla", plain
    dot_general dense layers) gives the CPU kernels' logits and gradients (blockwise causal
    attention and 2-D matmuls with written-out backwards). GQA (6 query heads on 2 kv heads),
    left padding, right padding and padding inside a row; 70 tokens: two query blocks."""
    cfg, params = tiny
    # "auto" asks the backend: the CPU kernels on CPU; on an NVIDIA GPU cuDNN only where it takes
    # the model (this one computes in float32: "xla"); splash on a TPU
    auto = {"cpu": "cpu", "gpu": "xla", "tpu": "splash"}.get(jax.default_backend(), "xla")
    assert M.kernels(cfg) == auto and M.kernels(cfg.replace(attention="xla")) == "xla"
    rng = np.random.default_rng(9)
    T = 70
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, T)), jnp.int32)
    t = np.arange(T)
    valid = jnp.asarray(np.stack([t >= 11, t < 50, (t < 20) | (t >= 33)]))
    want_logits, want_grads = _attention_case(cfg, params, "cpu", tokens, valid)
    for remat in (False, True):
        logits, grads = _attention_case(cfg, params, "xla", tokens, valid, remat)
        np.testing.assert_allclose(logits[valid], want_logits[valid], atol=2e-4, rtol=1e-5)
        for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
            w = want_grads
            for k in path:
                w = w[k.key]
            scale = float(jnp.abs(w).max())
            np.testing.assert_allclose(g, w, atol=1e-5 * scale + 1e-6,
                                       err_msg=jax.tree_util.keystr(path))


def test_xla_attention_keeps_no_scores_for_the_backward(tiny):
    """The "xla" choice recomputes its [T,S] scores in the backward pass (jax.checkpoint):
    no residual with two length-T axes, even without layer rematerialisation."""
    import contextlib
    import io
    import re

    cfg, params = tiny
    T = 56  # no other dimension of the model
    tokens = jnp.zeros((2, T), jnp.int32)

    def saved(choice):
        c = cfg.replace(attention=choice)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(
                lambda p: M.forward(p, c, tokens, tokens >= 0)[0].sum(), params)
        shapes = [s.split(",") for s in re.findall(r"\[([\d,]+)\]", out.getvalue())]
        return [s for s in shapes if s[-1] == str(T) and s[-2] in (str(T), str(T * 3))]

    assert saved("cpu")  # the blockwise backward keeps each block's probabilities
    assert not saved("xla"), saved("xla")


# cuDNN's flash attention both ways, as JAX's checks state it (jax._src.cudnn.
# fused_attention_stablehlo: check_layout, check_is_flash_attention), written out here case by
# case for bfloat16/float16 inputs with a mask (a bias to cuDNN) and a gradient taken:
# (dtype, head dim, capability, length) -> refused?
CUDNN_CASES = [
    ("bfloat16", 64, (9, 0), 128, False),
    ("float16", 128, (8, 0), 2048, False),
    ("bfloat16", 64, (8, 6), 10, False),
    ("bfloat16", 64, (9, 0), 9, True),  # odd length: the backward's check fails (issue 34)
    ("bfloat16", 64, (9, 0), 1, True),
    ("float32", 64, (9, 0), 128, True),  # cuDNN takes half precision only
    ("bfloat16", 64, (7, 5), 128, True),  # Turing: no flash attention
    ("bfloat16", 60, (9, 0), 128, True),  # not a multiple of 8
    ("bfloat16", 256, (9, 0), 128, False),  # Hopper: up to 256
    ("bfloat16", 256, (8, 9), 128, True),  # Ampere / Ada: up to 128
    ("bfloat16", 136, (8, 0), 128, True),
    ("bfloat16", 64, None, 128, True),  # not an NVIDIA GPU
    ("bfloat16", 64, (9, 0), None, False),  # no length: the model alone
    ("bfloat16", None, (9, 0), None, False),  # nor a head dim: the machine and dtype alone
    ("float32", None, (9, 0), None, True),
]


@pytest.mark.parametrize("dtype,head,capability,length,refused", CUDNN_CASES)
def test_cudnn_refusal_follows_jax_checks(dtype, head, capability, length, refused):
    reason = M.cudnn_refusal(dtype, head, capability, length)
    assert (reason is not None) == refused, reason
    if refused:  # a reason that reads as one line after "cuDNN's flash attention"
        assert reason and "\n" not in reason


def test_cudnn_refusal_agrees_with_jax_on_shapes():
    """Where JAX's own shape checks run without a GPU (pre-Hopper head-dim limit, the backward's
    even-length rule with a bias), they raise exactly where `cudnn_refusal` refuses."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    import inspect

    try:
        params = list(inspect.signature(fa.check_is_flash_attention).parameters)
        layout = fa.AttentionLayout.BTNH.value
    except AttributeError:
        pytest.skip("this jax has no check_is_flash_attention")
    if params[:7] != ["query", "key", "value", "layout", "cudnn_version", "has_bias",
                      "is_training"] or jax.default_backend() == "gpu":
        pytest.skip("another signature, or a GPU (then the capability decides: the cases above)")
    for head in (8, 60, 64, 128, 136):
        for length in (8, 9, 10, 128):
            q = jax.ShapeDtypeStruct((2, length, 4, head), jnp.bfloat16)
            try:
                fa.check_is_flash_attention(q, q, q, layout, 90000, True, True)
                jax_refuses = False
            except NotImplementedError:
                jax_refuses = True
            assert jax_refuses == (M.cudnn_refusal("bfloat16", head, (8, 0), length)
                                   is not None), (head, length)


def test_cudnn_attention_is_an_error_where_it_cannot_run(tiny):
    """`model.attention=cudnn` where cuDNN cannot run (off a GPU, float32) is one line at the
    start, not a crash at the first backward."""
    cfg, _ = tiny
    c = cfg.replace(attention="cudnn", dtype="bfloat16")
    if M.gpu_capability() is not None and M.gpu_capability() >= (8, 0):
        M.check_kernels(c)  # takes it
        c = c.replace(dtype="float32")
    with pytest.raises(ValueError, match="^model.attention=cudnn: cuDNN's flash attention"):
        M.check_kernels(c)
    M.check_kernels(c.replace(attention="auto"))  # auto runs anywhere


@pytest.mark.skipif(not M.gpu_capability() or M.gpu_capability() < (8, 0),
                    reason="cuDNN's flash attention needs an NVIDIA GPU of capability 8.0+")
@pytest.mark.parametrize("T", [9, 16])
def test_cudnn_gradients_at_odd_and_even_lengths(tiny, T):
    """On a GPU: bfloat16 gradients under `attention=cudnn` at an odd length (cuDNN's backward
    refuses it: "xla" runs) and an even one (cuDNN runs) equal the "xla" kernels' to bf16
    rounding. Before, an odd length crashed in the backward ('Unsupported sequence length')."""
    cfg, params = tiny
    bf16 = cfg.replace(dtype="bfloat16")
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, T)), jnp.int32)
    valid = jnp.asarray(np.arange(T)[None] >= np.array([[0], [3]]))
    _, want = _attention_case(bf16, params, "xla", tokens, valid)
    _, got = _attention_case(bf16, params, "cudnn", tokens, valid)
    for path, g in jax.tree_util.tree_flatten_with_path(got)[0]:
        w = want
        for k in path:
            w = w[k.key]
        scale = float(jnp.abs(w).max())
        assert float(jnp.abs(g - w).max()) <= 0.05 * scale + 1e-6, jax.tree_util.keystr(path)
