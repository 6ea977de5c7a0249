"""Context-window modes (rollout.context_window_mode): a turn sees the prompt prefix and the last
k turns only, as an attention mask over the kept KV cache (`model.TurnWindow`).

Two checks. The mask means what it says: every path of the model (training forward with each
kernel, layer by layer, cache append, decode) gives each token the logits of a NumPy forward in
which every layer's query sees exactly the prefix and the window's turns up to it; for one turn
(single_turn) that is a forward over the explicitly built context -- the prefix plus the
current turn -- at the tokens' own positions. With k >= 2 kept turns it is not: their cached
keys and values were computed when they were current, with their own windows (evicted, not
re-prefilled). And the update trains on what was sampled: for each mode, the update's
recomputed log-probs of a rollout's sampled tokens equal the sampler's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from starpo import run_config
from starpo import model as M
from starpo import rollout, update, weights
from starpo.trajectory import check_trajectory
from tests import numpy_reference
from tests.conftest import QWEN_LIKE, hf_config_json, random_hf_tensors

# one row: a prefix of 3 tokens (turn -1) then turns 0..3 of 4 tokens; the second row the same
# turns with 2 padding tokens at the end
PREFIX, TURN_LEN, TURNS = 3, 4, 4
TURN_OF = np.array([-1] * PREFIX + [k for k in range(TURNS) for _ in range(TURN_LEN)])
T = len(TURN_OF)


def _seen(turns, t, size):
    """The positions token t attends to: the prefix and turns >= turn(t) - size + 1, up to t
    (size 0: everything up to t)."""
    return [s for s in range(t + 1) if size == 0 or turns[s] < 0 or turns[s] > turns[t] - size]


def _masked_reference(tensors, ids, turns, size):
    """Logits [T,V] of a NumPy forward whose every layer attends by `_seen` (the eviction)."""
    visible = np.zeros((len(ids), len(ids)), bool)
    for t in range(len(ids)):
        visible[t, _seen(turns, t, size)] = True
    return numpy_reference.forward(tensors, QWEN_LIKE, ids, visible=visible)


def _refill_reference(tensors, ids, turns, size):
    """Logits [T,V]: token t's from a NumPy forward over the explicit context `_seen` alone (a
    re-prefilled prompt), each token at its own position."""
    out = []
    for t in range(len(ids)):
        keep = _seen(turns, t, size)
        out.append(numpy_reference.forward(tensors, QWEN_LIKE, ids[keep], positions=keep)[-1])
    return np.stack(out)


@pytest.fixture(scope="module")
def model():
    tensors = random_hf_tensors(QWEN_LIKE, 0)
    cfg = weights.config_from_hf(hf_config_json(QWEN_LIKE))
    params = weights.params_from_tensors(cfg, tensors.get, "test", gguf=False)
    ids = np.random.default_rng(2).integers(0, QWEN_LIKE["vocab"], (2, T))
    valid = np.ones((2, T), bool)
    valid[1, -2:] = False
    return tensors, cfg, params, ids, valid


@functools.partial(jax.jit, static_argnums=(0, 4))
def _paths(cfg, params, ids, valid, window):
    """Logits [B,T,V] of every path: the training forward (cpu and xla kernels, stacked and
    layer by layer) and, with a cache, prefix + turn-by-turn appends and token-by-token decodes."""
    B = ids.shape[0]
    turns = jnp.broadcast_to(jnp.asarray(TURN_OF, jnp.int32), (B, T))
    win = lambda sl: None if window == 0 else M.TurnWindow(turns[:, sl], window)  # noqa: E731
    head = lambda p, h: M.head_logits(params, cfg, h)  # noqa: E731
    out = {}
    for kernel in ("cpu", "xla"):
        c = cfg.replace(attention=kernel)
        h, _ = M.hidden_states(params, c, ids, valid, window=win(slice(None)))
        out[kernel] = head(params, h)
    h, _ = M.hidden_states(M.split_layers(params), cfg, ids, valid, window=win(slice(None)))
    out["layerwise"] = head(params, h)
    # the sampler's way: the prefix fresh, each turn's first half appended as a chunk (stacked
    # cache), the rest decoded one token at a time (per-layer buffers)
    cache = M.init_cache(cfg, B, 32, turns=window > 0)
    pieces = [slice(0, PREFIX)]
    for k in range(TURNS):
        a = PREFIX + k * TURN_LEN
        pieces += [slice(a, a + 2)] + [slice(i, i + 1) for i in range(a + 2, a + TURN_LEN)]
    got = []
    for i, sl in enumerate(pieces):
        split = sl.stop - sl.start == 1
        p = M.split_layers(params) if split else params
        h, cache = M.hidden_states(p, cfg, ids[:, sl], valid[:, sl],
                                   M.split_cache(cache) if split else cache, fresh=i == 0,
                                   window=win(sl))
        cache = M.stack_cache(cache)
        got.append(head(params, h))
    out["cache"] = jnp.concatenate(got, axis=1)
    return out


@pytest.mark.parametrize("size", [1, 2])
def test_window_logits_equal_a_forward_over_the_explicit_context(model, size):
    tensors, cfg, params, ids, valid = model
    paths = _paths(cfg, params, jnp.asarray(ids), jnp.asarray(valid), size)
    full = M.forward(params, cfg, jnp.asarray(ids), jnp.asarray(valid))[0]
    for b in range(2):
        n = int(valid[b].sum())
        want = _masked_reference(tensors, ids[b, :n], TURN_OF[:n], size)
        for name, logits in paths.items():
            np.testing.assert_allclose(np.asarray(logits[b, :n]), want, atol=2e-4, rtol=2e-4,
                                       err_msg=f"{name} row {b}")
        # the window changed the tokens of turns past it, and only those
        late = TURN_OF[:n] >= size
        gap = np.abs(np.asarray(full[b, :n]) - want).max(-1)
        assert (gap[late] > 1e-2).all() and (gap[~late] < 2e-4).all(), gap
        # one turn is a re-prefilled prompt of the prefix and the turn; with more, the kept
        # turns' keys carry what they saw when they were current (three layers: it shows)
        refill = _refill_reference(tensors, ids[b, :n], TURN_OF[:n], size)
        differ = np.abs(refill - want).max(-1) > 1e-2
        if size == 1:
            np.testing.assert_allclose(want, refill, atol=2e-4, rtol=2e-4)
        else:
            assert differ[TURN_OF[:n] >= size].all() and not differ[TURN_OF[:n] < size].any()


def test_window_mask_in_the_backward_pass(model):
    # the cpu kernel's written-out backward and the xla one's autodiff agree under a window
    _, cfg, params, ids, valid = model
    turns = jnp.broadcast_to(jnp.asarray(TURN_OF, jnp.int32), ids.shape)

    def loss(p, kernel):
        h, _ = M.hidden_states(p, cfg.replace(attention=kernel), jnp.asarray(ids),
                               jnp.asarray(valid), window=M.TurnWindow(turns, 2))
        # padding queries differ by kernel by design (nothing reads them): valid ones only
        return jnp.where(jnp.asarray(valid)[..., None], M.head_logits(p, cfg, h) ** 2, 0).mean()

    g_cpu, g_xla = (jax.jit(jax.grad(loss), static_argnums=1)(params, k) for k in ("cpu", "xla"))
    for a, b in zip(jax.tree_util.tree_leaves(g_cpu), jax.tree_util.tree_leaves(g_xla)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------ rollout -> update
GROUPS, GROUP_SIZE, MAX_TURN, N_TOKENS = 2, 2, 3, 8


TINY = "tiny:layers=1,hidden=32,heads=2,kv_heads=1,head_dim=16,mlp=64"


@pytest.fixture(scope="module")
def tiny():
    # Qwen3's per-head q/k norms on: the newest family's forward in sampler and update alike
    m = weights.load_model(TINY + ",qk_norm=1")
    assert m.cfg.family == "qwen3"
    return m, m.params


@pytest.fixture(scope="module")
def tiny_gemma():
    # Gemma 3's switches, a sliding-window layer of 8 positions and a global one
    m = weights.load_model(TINY.replace("layers=1", "layers=2") + ",family=gemma3,window=8,"
                           "pattern=2")
    assert m.cfg.local_layers == (0,)
    return m, m.params


@pytest.mark.parametrize("window", ["full", 2, 1],
                         ids=["full_and_sliding", "limited2_and_sliding", "single_turn"])
def test_update_logprobs_equal_the_samplers(tiny, tiny_gemma, window):
    # Gemma 3's sliding-window layer (its last 8 tokens) under no context window (its global
    # layer sees the whole dialogue) and composed with one of 2 turns; Qwen3's under 1 turn
    m, params = tiny_gemma if window != 1 else tiny
    window = 0 if window == "full" else window
    spec = rollout.RolloutSpec(max_turn=MAX_TURN, max_new_tokens=N_TOKENS, max_context=1024,
                               context_window=window)
    r = rollout.make_rollout(envs.make("FrozenLake"), m.tokenizer, m.cfg, spec,
                             env_groups=GROUPS, group_size=GROUP_SIZE,
                             compiler_options={"xla_backend_optimization_level": 0})
    traj, metrics = jax.device_get(r.run(params, jax.random.key(1), jnp.int32(0),
                                         jnp.float32(1.0), jnp.int32(rollout.TRAIN)))
    check_trajectory(traj, GROUP_SIZE)
    assert (metrics["num_turns"] == MAX_TURN).any()  # turns beyond the window happened
    # the prefix is what every row starts with: the tokens before turn 0's observation
    assert (traj.turn_index[np.arange(4), traj.prefix_length] == 0).all()
    algo = run_config.AlgoConfig(adv_estimator="grpo", group_size=GROUP_SIZE,
                             rollout_filter_ratio=1.0, micro_batch_size=2,
                             ppo_mini_batch_size=4, context_window=window)
    state = update.init_train_state(algo, params)
    batch, logged = jax.jit(update.make_prepare(algo, m.cfg))(state, traj)
    mask = traj.loss_mask
    np.testing.assert_allclose(np.asarray(batch.old_logprobs)[mask], traj.sample_logprobs[mask],
                               atol=1e-5)
    # the logged mismatch is that gap: its largest size and k3 KL(sampler || trainer) per token
    gap = (np.asarray(batch.old_logprobs)[mask] - traj.sample_logprobs[mask]).astype(np.float64)
    assert float(logged["actor/sampler_logprob_max_abs_gap"]) == np.abs(gap).max()
    np.testing.assert_allclose(float(logged["actor/sampler_kl"]),
                               np.mean(np.exp(gap) - gap - 1), rtol=1e-3, atol=1e-12)
    # the loss's own forward sees the same context: no ratio away from 1 before any update
    _, _, stats = jax.jit(update.make_grad_fn(algo, m.cfg))(params, None, batch)
    assert abs(float(stats["actor/ppo_kl"])) < 1e-6
    # and the window matters: the whole-dialogue forward gives turns past it other log-probs
    if window:
        full, _ = update.token_logprobs(params, m.cfg, traj.tokens, traj.valid)
        late = mask & (traj.turn_index >= window)
        assert late.any() and np.abs(np.asarray(full)[late]
                                     - traj.sample_logprobs[late]).max() > 1e-2
