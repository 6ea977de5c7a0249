"""The fused decode-attention kernel (starpo/decode_attention.py) against a NumPy loop and, in
the sampler, against XLA's decode step. Off a GPU the kernel runs in Pallas's interpreter (the
same program); on an NVIDIA GPU the same tests run the compiled Triton kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starpo import decode_attention as DA
from starpo import model as M
from starpo import sampler as S


def numpy_attention(q, ck, cv, visible):
    """q [B,1,K,G,E] over ck, cv [B,K,S,E], visible [B,1,S], one (row, head) at a time, in
    float64: each query's softmax over its visible slots (none visible: the mean of every
    slot's value, as XLA's masked softmax gives)."""
    B, _, K, G, E = q.shape
    out = np.zeros((B, K, G, E))
    for b in range(B):
        for k in range(K):
            for g in range(G):
                s = ck[b, k].astype(np.float64) @ q[b, 0, k, g].astype(np.float64)
                seen = visible[b, 0]
                w = np.where(seen, np.exp(s - s[seen].max()), 0.0) if seen.any() else 1.0 + 0 * s
                out[b, k, g] = (w / w.sum()) @ cv[b, k].astype(np.float64)
    return out.reshape(B, 1, K * G, E)


@pytest.mark.parametrize("K,G,E,S,dtype", [(2, 7, 64, 96, "float32"), (3, 3, 16, 128, "float32"),
                                           (2, 7, 64, 256, "bfloat16")],
                         ids=["qwen-heads", "smollm2-heads", "bf16-cache"])
def test_kernel_equals_the_numpy_loop(K, G, E, S, dtype):
    """Random queries and cache, each slot visible with probability 1/2: one row filled only
    up to slot 20, one whose first half is masked (the online softmax's masked blocks must not
    leak into a later block's sum), one with none: float32 to float32 rounding, a bfloat16
    cache to bfloat16's."""
    rng = np.random.default_rng(S)
    B = 3
    q = (rng.standard_normal((B, 1, K, G, E)) / np.sqrt(E)).astype(np.float32)
    ck, cv = (rng.standard_normal((B, K, S, E)).astype(np.float32) for _ in range(2))
    visible = rng.random((B, 1, S)) < 0.5
    visible[0, 0, 20:] = False  # slots filled up to 20: the later blocks are not read
    visible[1, 0, : S // 2] = False  # the first blocks masked, then visible ones
    visible[2] = False
    if dtype == "bfloat16":  # the reference reads the cache as the kernel does
        q, ck, cv = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
                     for x in (q, ck, cv))
    got = DA.attend(jnp.asarray(q), jnp.asarray(ck, dtype), jnp.asarray(cv, dtype),
                    jnp.asarray(visible))
    assert got.shape == (B, 1, K * G, E) and got.dtype == jnp.float32
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, ck, cv, visible),
                               rtol=tol, atol=tol)


def test_where_the_kernel_runs():
    """One query a row, a power-of-2 head dim of 16 or more, slots a multiple of 16 (the
    largest block of 128, 64, 32, 16 that divides them); elsewhere XLA's path."""
    assert DA.runs((4, 1, 2, 7, 64), 512) and DA.slot_block(512) == 128
    assert DA.slot_block(96) == 32 and DA.slot_block(80) == 16 and DA.slot_block(100) is None
    assert not DA.runs((4, 2, 2, 7, 64), 512)  # two queries a row: a prompt's append
    assert not DA.runs((4, 1, 2, 7, 8), 512) and not DA.runs((4, 1, 2, 7, 48), 512)
    assert not DA.runs((4, 1, 2, 7, 64), 100)
    with pytest.raises(ValueError, match="one query a row"):
        DA.attend(jnp.zeros((1, 2, 1, 1, 16)), jnp.zeros((1, 1, 16, 16)),
                  jnp.zeros((1, 1, 16, 16)), jnp.ones((1, 2, 16), bool))
    with pytest.raises(ValueError, match="decode_attention='triton'"):
        M.ModelConfig(vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=8, intermediate_size=8, decode_attention="triton")


@pytest.mark.parametrize("B,K,G,E,S,dtype", [(128, 2, 7, 64, 512, "bfloat16"),
                                             (4, 3, 3, 64, 96, "bfloat16"),
                                             (2, 2, 3, 16, 48, "float32")],
                         ids=["qwen2.5-0.5b", "smollm2", "float32"])
def test_the_kernel_lowers_to_one_triton_call_for_a_gpu(B, K, G, E, S, dtype):
    """Lowered for CUDA on any machine (`jax.export`, no GPU needed): Pallas's Triton lowering
    takes the kernel at Qwen2.5-0.5B's and SmolLM2's head shapes (it refuses, for one, arrays
    whose sizes are not powers of 2: the queries are padded to 16 rows for that), and the
    decode attention is one Triton call."""
    from jax import export

    def f(q, ck, cv, visible):
        return DA.attend(q, ck, cv, visible, interpret=False)

    shapes = [((B, 1, K, G, E), dtype), ((B, K, S, E), dtype), ((B, K, S, E), dtype),
              ((B, 1, S), bool)]
    triton = "__gpu$xla.gpu.triton"
    lowered = export.export(jax.jit(f), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(
        *(jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes))
    assert lowered.mlir_module().count(f"@{triton}") == 1
    assert lowered.out_avals[0].shape == (B, 1, K * G, E)


class FakeTok:
    eos_ids, pad_id = (5,), 0


def test_the_sampler_with_the_kernel_equals_xlas_decode_step():
    """Two turns of a model with 16-wide heads (3 query heads a kv head) on per-layer cache
    buffers, as the rollout plays: the same tokens, the same log-probs and cache to float32
    rounding, with the decode steps' attention in the kernel or in XLA's ops; a row stops
    early and another starts its second turn inactive."""
    cfg = M.ModelConfig(vocab_size=64, hidden_size=48, num_layers=2, num_heads=6,
                        num_kv_heads=2, head_dim=16, intermediate_size=64)
    params = M.init_params(cfg, jax.random.key(3))
    rng = np.random.default_rng(1)

    def chunk(lengths, width):
        t = np.zeros((len(lengths), width), np.int32)
        for b, n in enumerate(lengths):
            t[b, :n] = rng.integers(6, cfg.vocab_size, n)
        return jnp.asarray(t), jnp.asarray(np.arange(width)[None] < np.asarray(lengths)[:, None])

    first, second = chunk([9, 4, 7], 9), chunk([3, 5, 2], 5)
    results = []
    for kind in ("xla", "pallas"):
        smp = S.make_sampler(cfg.replace(decode_attention=kind), FakeTok, max_new_tokens=6)
        state, t1 = smp.generate(params, *first, jax.random.key(0), 1.0, 64, split=True)
        state, t2 = smp.turn(params, state, *second, jax.random.key(1), 1.0,
                             jnp.asarray([True, False, True]))
        state = state.replace(cache=M.stack_cache(state.cache))
        results.append(jax.tree_util.tree_map(np.asarray, (state, t1, t2)))
    assert int(results[0][1].length.max()) > 1  # the turns decode several tokens
    for xla, fused in zip(*(jax.tree_util.tree_leaves(r) for r in results)):
        if xla.dtype.kind == "f":
            np.testing.assert_allclose(fused, xla, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(fused, xla)


def test_the_config_knob_reaches_the_model():
    """`model.decode_attention` in a run's config is the loaded policy's, and a run saved
    before the knob existed reads as XLA's ops (its `before` in the schema; "auto" is XLA's off
    a TPU)."""
    import json

    from configs import bandit
    from starpo import experiment, harness, run_config

    config = bandit.get_config("tiny")
    assert experiment.load_policy(config).cfg.decode_attention == "auto"
    config.unlock()
    config.model.decode_attention = "pallas"
    assert experiment.load_policy(config).cfg.decode_attention == "pallas"
    saved = json.loads(harness.config_json(bandit.get_config("tiny")))
    del saved["model"]["decode_attention"]
    old = run_config.config_from_json(json.dumps(saved))
    assert experiment.load_policy(old).cfg.decode_attention == "xla"
    assert "model.decode_attention" in harness.RESUMABLE_CHANGES
