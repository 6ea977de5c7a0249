"""The TPU attention kernels (starpo/tpu_attention.py): splash attention for a whole sequence
and the decode kernel over the cache, in Pallas's interpreter on this CPU against a NumPy loop
and XLA's path; where `auto` picks them and where they give way to XLA. Compiled for a TPU:
tests/test_aot.py (marked tpu)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starpo import model as M
from starpo import precision
from starpo import sampler as S
from starpo import tpu_attention as TA
from tests.test_decode_attention import FakeTok, numpy_attention


def numpy_causal(q, k, v, valid, segments=None):
    """q [B,T,K,G,E] over k, v [B,T,K,E] in float64, one valid query at a time: the softmax
    over the valid keys at or before it (of its own segment, segments [B,T]). Padding
    queries' rows are left 0 (not compared)."""
    B, T, K, G, E = q.shape
    out = np.zeros((B, T, K, G, E))
    for b in range(B):
        for t in np.flatnonzero(valid[b]):
            seen = valid[b, : t + 1]
            if segments is not None:
                seen = seen & (segments[b, : t + 1] == segments[b, t])
            for h in range(K):
                s = k[b, : t + 1, h].astype(np.float64) @ q[b, t, h].astype(np.float64).T
                w = np.where(seen[:, None], np.exp(s - s[seen].max(0)), 0.0)  # [t+1,G]
                out[b, t, h] = (w / w.sum(0)).T @ v[b, : t + 1, h].astype(np.float64)
    return out.reshape(B, T, K * G, E)


def _inputs(B, T, K, G, E, seed=0):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((B, T, K, G, E)) / np.sqrt(E)).astype(np.float32)
    k, v = (rng.standard_normal((B, T, K, E)).astype(np.float32) for _ in range(2))
    t = np.arange(T)
    valid = np.stack([t >= 37,  # left padding
                      t < T - 50,  # right padding
                      (t < 90) | (t >= 140)] + [t >= 0] * (B - 3))  # padding inside a row
    return q, k, v, valid


def test_splash_equals_a_numpy_loop_and_xlas_gradients():
    """GQA (3 query heads a kv head), 200 tokens (padded to 256 inside: two blocks of 128 would
    be 256's own block), left, right and inner padding: splash's valid rows equal a float64
    loop to float32 rounding, and its gradients (a loss on the valid rows) equal those of
    XLA's path (`jax.nn.dot_product_attention`)."""
    q, k, v, valid = _inputs(3, 200, 2, 3, 16)
    got = np.asarray(TA.causal(*map(jnp.asarray, (q, k, v, valid))))
    assert got.shape == (3, 200, 6, 16)
    np.testing.assert_allclose(got[valid], numpy_causal(q, k, v, valid)[valid],
                               rtol=2e-5, atol=2e-5)
    w = np.random.default_rng(1).standard_normal(got.shape).astype(np.float32)
    w = jnp.asarray(w * valid[:, :, None, None])

    def loss(kernel):
        return lambda q, k, v: jnp.sum(M._attend_causal(q, k, v, jnp.asarray(valid), kernel) * w)

    args = tuple(map(jnp.asarray, (q, k, v)))
    want = jax.grad(loss("xla"), argnums=(0, 1, 2))(*args)
    for name, a, b in zip("qkv", jax.grad(loss("splash"), argnums=(0, 1, 2))(*args), want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5,
                                   err_msg=name)


def test_rows_packed_into_one_sequence_run_splash_as_segments():
    """Rows packed into shared sequences (`update.pack_rows`: each token's row as its segment,
    `TurnWindow(rows, 1, segments=True)`) run splash with the rows as segment ids: each valid
    query sees its own row's valid keys alone, as a float64 loop, and the gradients equal
    XLA's path under the same window (its turn mask)."""
    q, k, v, valid = _inputs(3, 130, 1, 2, 16, seed=3)
    t = np.arange(130)
    rows = np.stack([t // 50, np.where(t < 90, 0, 1), np.where(t < 100, 0, 1)]).astype(np.int32)
    window = M.TurnWindow(jnp.asarray(rows), 1, segments=True)
    args = tuple(map(jnp.asarray, (q, k, v)))
    got = np.asarray(M._attend_causal(*args, jnp.asarray(valid), "splash", window))
    np.testing.assert_allclose(got[valid], numpy_causal(q, k, v, valid, rows)[valid],
                               rtol=2e-5, atol=2e-5)
    w = jnp.asarray(np.random.default_rng(2).standard_normal(got.shape).astype(np.float32)
                    * valid[:, :, None, None])

    def loss(kernel):
        return lambda q, k, v: jnp.sum(
            M._attend_causal(q, k, v, jnp.asarray(valid), kernel, window) * w)

    want = jax.grad(loss("xla"), argnums=(0, 1, 2))(*args)
    for name, a, b in zip("qkv", jax.grad(loss("splash"), argnums=(0, 1, 2))(*args), want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5,
                                   err_msg=name)


def test_where_splash_and_the_decode_kernel_run():
    """The static decisions: splash from one 128-token block on and not under a context
    window (XLA's path there, the same numbers as "xla" exactly); the decode kernel for one
    query a row over blocks of 512, 256 or 128 slots, or up to 4096 slots as one block. `auto` picks both on a TPU target only, and
    naming either off a TPU is a one-line error."""
    assert TA.causal_fallback(128) is None and TA.causal_fallback(4096) is None
    assert "fewer than one 128-token block" in TA.causal_fallback(127)
    assert "context window" in TA.causal_fallback(4096, window=True)
    assert TA.decode_runs((8, 1, 2, 7, 64), 384) and TA.decode_runs((8, 1, 2, 7, 80), 128)
    assert TA.decode_runs((8, 1, 2, 7, 64), 320) and TA._block(320) == 320  # one block
    assert TA._block(384) == 128 and TA._block(1024) == 512
    assert not TA.decode_runs((8, 1, 2, 7, 64), 4100)  # too long for one block: XLA's
    assert TA.decode_runs((8, 1, 2, 7, 64), 4224)  # 33 blocks of 128
    assert not TA.decode_runs((8, 3, 2, 7, 64), 384)  # a chunk's append
    with pytest.raises(ValueError, match="one query a row"):
        TA.decode(jnp.zeros((1, 2, 1, 1, 16)), jnp.zeros((1, 1, 64, 16)),
                  jnp.zeros((1, 1, 64, 16)), jnp.ones((1, 2, 64), bool))
    q, k, v, valid = map(jnp.asarray, _inputs(3, 200, 2, 3, 16))
    window = M.TurnWindow(jnp.broadcast_to(jnp.arange(200) // 50, (3, 200)), 2)
    np.testing.assert_array_equal(M._attend_causal(q, k, v, valid, "splash", window),
                                  M._attend_causal(q, k, v, valid, "xla", window))
    cfg = M.ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=16, intermediate_size=64)
    with precision.target("tpu"):
        assert (M.kernels(cfg), M.decode_kernel(cfg)) == ("splash", "pallas_tpu")
        M.check_kernels(cfg.replace(attention="splash", decode_attention="pallas_tpu"))
    assert M.decode_kernel(cfg) == ("pallas_tpu" if jax.default_backend() == "tpu" else "xla")
    if jax.default_backend() != "tpu":
        with pytest.raises(ValueError, match="^model.attention=splash: a TPU kernel"):
            M.check_kernels(cfg.replace(attention="splash"))
        with pytest.raises(ValueError, match="^model.decode_attention=pallas_tpu: a TPU kernel"):
            M.check_kernels(cfg.replace(decode_attention="pallas_tpu"))


@pytest.mark.parametrize("S_", [384, 200], ids=["three-blocks", "one-block"])
def test_decode_kernel_equals_the_numpy_loop(S_):
    """7 query heads a kv head (padded to 8 rows), 384 slots in three 128-slot blocks or 200
    in one: one row filled up to slot 20 (its later blocks are not read), one whose first half
    is masked, one with no visible slot (the mean of every value, as XLA's masked softmax
    gives); float32 to float32 rounding, a bfloat16 cache to bfloat16's."""
    rng = np.random.default_rng(4)
    B, K, G, E = 3, 2, 7, 16
    q = (rng.standard_normal((B, 1, K, G, E)) / np.sqrt(E)).astype(np.float32)
    ck, cv = (rng.standard_normal((B, K, S_, E)).astype(np.float32) for _ in range(2))
    visible = rng.random((B, 1, S_)) < 0.5
    visible[0, 0, 20:] = False
    visible[1, 0, : S_ // 2] = False
    visible[2] = False
    want = numpy_attention(q, ck, cv, visible)
    got = TA.decode(*map(jnp.asarray, (q, ck, cv, visible)))
    assert got.shape == (B, 1, K * G, E) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    q16, ck16, cv16 = (jnp.asarray(x, jnp.bfloat16) for x in (q, ck, cv))
    want16 = numpy_attention(*(np.asarray(x.astype(jnp.float32)) for x in (q16, ck16, cv16)),
                             visible)
    np.testing.assert_allclose(np.asarray(TA.decode(q16, ck16, cv16, jnp.asarray(visible))),
                               want16, rtol=2e-2, atol=2e-2)


def test_the_sampler_and_the_training_forward_with_the_tpu_kernels_equal_xlas():
    """A two-layer model (3 query heads a kv head) with model.attention=splash and
    decode_attention=pallas_tpu: a first prefill of 130 tokens (splash), decode steps over a
    256-slot cache (the decode kernel) and a second turn give the tokens, log-probs and cache
    of XLA's kernels; the training forward's logits and gradients on valid tokens agree too."""
    cfg = M.ModelConfig(vocab_size=64, hidden_size=48, num_layers=2, num_heads=6,
                        num_kv_heads=2, head_dim=16, intermediate_size=64)
    params = M.init_params(cfg, jax.random.key(3))
    rng = np.random.default_rng(1)

    def chunk(lengths, width):
        t = np.zeros((len(lengths), width), np.int32)
        for b, n in enumerate(lengths):
            t[b, :n] = rng.integers(6, cfg.vocab_size, n)
        return jnp.asarray(t), jnp.asarray(np.arange(width)[None] < np.asarray(lengths)[:, None])

    first, second = chunk([130, 100, 129], 130), chunk([3, 5, 2], 5)
    results = []
    for attention, decode in (("xla", "xla"), ("splash", "pallas_tpu")):
        c = cfg.replace(attention=attention, decode_attention=decode)
        smp = S.make_sampler(c, FakeTok, max_new_tokens=6)
        state, t1 = smp.generate(params, *first, jax.random.key(0), 1.0, 256, split=True)
        state, t2 = smp.turn(params, state, *second, jax.random.key(1), 1.0,
                             jnp.asarray([True, False, True]))
        state = state.replace(cache=M.stack_cache(state.cache))
        tokens, valid = first

        def loss(p):
            logits = M.forward(p, c, tokens, valid)[0]
            return jnp.sum(jnp.where(valid, jax.nn.log_softmax(logits)[..., 7], 0.0)), logits

        (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        results.append(jax.tree_util.tree_map(np.asarray, (state, t1, t2, logits[valid],
                                                           grads)))
    assert int(results[0][1].length.max()) > 1
    for xla, tpu in zip(*(jax.tree_util.tree_leaves(r) for r in results)):
        if xla.dtype.kind == "f":
            np.testing.assert_allclose(tpu, xla, rtol=2e-4, atol=2e-5)
        else:
            np.testing.assert_array_equal(tpu, xla)


SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from starpo import model as M, sharding, tpu_attention as TA
from tests.test_tpu_attention import _inputs
q, k, v, valid = map(jnp.asarray, _inputs(4, 130, 2, 3, 16))
cq = q[:, :1]
ck, cv = (jnp.moveaxis(x, 1, 2)[:, :, :128] for x in (k, v))
seen = valid[:, None, :128]
w = jnp.asarray(np.random.default_rng(2).standard_normal((4, 130, 6, 16)), jnp.float32)

def run():
    def loss(q, k, v):
        return jnp.sum(M._attend_causal(q, k, v, valid, "splash") * w * valid[..., None, None])
    return (jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v),
            jax.jit(TA.decode)(cq, ck, cv, seen))

want = run()
mesh = sharding.make_mesh(2, 1, 2)
with jax.set_mesh(mesh):
    got = run()
for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
print("same")
"""


def test_the_kernels_on_a_mesh_equal_them_on_one_device():
    """On 4 devices (data 2 x tensor 2) each kernel runs under shard_map, rows over `data`
    and kv heads (with their query heads) over `tensor`: the loss, its gradients and the
    decode step equal the one-device run's."""
    from tests import fake_devices

    done = fake_devices.run(["-c", SHARDED], n=4, timeout=300)
    assert done.returncode == 0 and "same" in done.stdout, done.stderr[-3000:]
