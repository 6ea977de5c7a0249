"""LoRA (starpo/lora.py): fresh adapters change nothing, merging equals the adapter path, only
adapters train (the base stays the very same buffers), checkpoints hold the adapters and resume
exactly, export merges, the memory plan counts it, bad settings fail in one line, and a tiny
model learns the Bandit through adapters alone. One built experiment is shared by the module."""

import functools
import json
import math
import os
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import bandit
from starpo import checkpoint, config_check, experiment, lora, memory, metrics, run_config
from starpo import training, weights
from starpo import model as model_lib
from starpo import update as update_lib
from tests.test_training import comparable, val_series, with_changes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = lambda *a: None  # noqa: E731


def leaves_by_path(tree) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def random_adapters(params, seed=3, scale=0.1):
    """The tree with every adapter leaf drawn at random (fresh B is zero: nothing to see)."""
    def one(path, x):
        name = jax.tree_util.keystr(path)
        if any(s in name for s in lora.SUFFIXES):
            k = jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()) % 2**31)
            return jax.random.normal(k, x.shape, jnp.float32) * scale
        return x
    return jax.tree_util.tree_map_with_path(one, params)


# ----------------------------------------------------------------------------- the model
@pytest.fixture(scope="module")
def base():
    """An untied random model with q/k/v bias (the Qwen2 layout), every projection adapted."""
    m = weights.load_model("random:layers=2,hidden=32,heads=4,kv_heads=2,head_dim=8,mlp=48,"
                           "vocab=384,qkv_bias=1,tie=0")
    tokens = (jnp.arange(14).reshape(2, 7) * 29) % 384
    return m, tokens, jnp.arange(14).reshape(2, 7) < jnp.array([[7], [5]])


def test_fresh_adapters_give_the_base_models_logits_exactly(base):
    m, tokens, valid = base
    cfg, params = lora.attach(m.cfg, m.params, 4, 8.0, "all-linear", jax.random.key(0))
    assert cfg.lora_targets == lora.LINEAR
    # the adapters' tree is the model's own declaration of them (shapes, dtypes, sharding axes)
    abstract = model_lib.abstract_params(cfg)
    assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure(params)
    for (path, a), x in zip(jax.tree_util.tree_leaves_with_path(abstract),
                            jax.tree_util.tree_leaves(params)):
        assert a.shape == x.shape, path
    want, _ = model_lib.forward(m.params, m.cfg, tokens, valid)
    got, _ = model_lib.forward(params, cfg, tokens, valid)
    # bit for bit on the CPU; a GPU picks its matmul kernels per program, so the adapted
    # program's sums run in another order (measured on an H100: at most 1.5e-6 apart)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert lora.num_adapter_params(cfg) == sum(
        x.size for x in jax.tree_util.tree_leaves(lora.split(params)[0]))


def test_merged_weights_equal_the_adapter_forward_and_a_numpy_delta(base):
    m, tokens, valid = base
    cfg, params = lora.attach(m.cfg, m.params, 4, 8.0, "q_proj,o,down", jax.random.key(0))
    params = random_adapters(params)
    plain, merged = lora.merge(cfg, params)
    assert plain.lora_rank == 0 and not lora.has_adapters(merged)
    layers = params["layers"]
    for name, where in (("q", "attn"), ("o", "attn"), ("down", "mlp")):
        a = np.asarray(layers[where][f"{name}_lora_a"]["kernel"], np.float64)
        b = np.asarray(layers[where][f"{name}_lora_b"]["kernel"], np.float64)
        w = np.asarray(layers[where][name]["kernel"], np.float64)
        for layer in range(cfg.num_layers):  # W + alpha/r A B, one layer at a time
            ab = (a[layer].reshape(-1, 4) @ b[layer].reshape(4, -1)).reshape(w.shape[1:])
            np.testing.assert_allclose(np.asarray(merged["layers"][where][name]["kernel"])[layer],
                                       w[layer] + 2.0 * ab, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(merged["layers"]["mlp"]["up"]["kernel"]),
                                  np.asarray(layers["mlp"]["up"]["kernel"]))
    adapted, _ = model_lib.forward(params, cfg, tokens, valid)
    folded, _ = model_lib.forward(merged, plain, tokens, valid)
    base_logits, _ = model_lib.forward(m.params, m.cfg, tokens, valid)
    assert float(jnp.abs(adapted - base_logits).max()) > 0.1  # the adapters do something
    np.testing.assert_allclose(np.asarray(folded), np.asarray(adapted), atol=2e-5)


def test_gradients_reach_only_the_adapters_and_the_value_head(base):
    m, tokens, valid = base
    cfg, params = lora.attach(m.cfg.replace(value_head=True), m.params, 4, 8.0, "all-linear",
                              jax.random.key(0))
    params = {**params, "value_head": {"kernel": jnp.ones((32, 1)), "bias": jnp.zeros((1,))}}
    params = random_adapters(params)

    def loss(p):
        hidden, _ = model_lib.hidden_states(p, cfg, tokens, valid)
        return (model_lib.head_logits(p, cfg, hidden).mean()
                + model_lib.head_values(p, cfg, hidden).mean())

    value, grads = lora.value_and_grad(loss)(params)
    names = set(leaves_by_path(grads))
    assert names and all(lora.SUFFIXES[0] in n or lora.SUFFIXES[1] in n or "value_head" in n
                         for n in names), names
    assert any("value_head" in n for n in names) and any("_lora_a" in n for n in names)
    # the same numbers as the full gradient's adapter entries
    full = leaves_by_path(jax.grad(loss)(params))
    for name, g in leaves_by_path(grads).items():
        np.testing.assert_allclose(np.asarray(g), np.asarray(full[name]), rtol=1e-5, atol=1e-7)
    # the same program on the CPU; on a GPU two programs' sums in another order (H100: 1.1e-6)
    assert math.isclose(float(value), float(loss(params)),
                        rel_tol=1e-6 if jax.default_backend() == "cpu" else 1e-5)
    # without adapters everything trains, as before
    train, frozen = lora.split(m.params)
    assert train is m.params and frozen == {}


# ----------------------------------------------------------------------------- a LoRA run
@pytest.fixture(scope="module")
def lora_run():
    config = bandit.get_config("tiny+lora")
    return config, experiment.build(config)


@pytest.fixture(scope="module")
def lora_trained(lora_run, tmp_path_factory):
    config, exp = lora_run
    workdir = str(tmp_path_factory.mktemp("lora") / "run")
    training.train(config, workdir, progress=False, experiment=exp, log=QUIET)
    return workdir


def test_a_lora_step_trains_the_adapters_and_shares_the_frozen_base(lora_run):
    config, exp = lora_run
    assert exp.policy.cfg.lora_rank == 64 and "lm_head" in exp.policy.cfg.lora_targets
    state = experiment.initial_train_state(exp)
    _, frozen = lora.split(exp.policy.params)
    before = {k: np.asarray(x) for k, x in leaves_by_path(frozen).items()}
    # one buffer of the base serves the policy, the actor's state and a critic copy's
    assert state.critic_params is None  # the tiny Bandit runs GRPO: the critic built aside
    critic_cfg, critic = experiment.critic_params_from(
        with_changes(config, algorithm__adv_estimator="gae"), exp.policy)
    assert critic_cfg.value_head and critic_cfg.lora_rank == 64
    assert set(lora.split(critic)[0]) == set(lora.split(exp.policy.params)[0]) | {"value_head"}
    state_frozen = leaves_by_path(lora.split(state.actor_params)[1])
    critic_frozen = leaves_by_path(lora.split(critic)[1])
    for name, x in leaves_by_path(frozen).items():
        assert state_frozen[name] is x and critic_frozen[name] is x, name
    # AdamW keeps moments for what trains only
    moments = sum(x.size for x in jax.tree_util.tree_leaves(state.actor_opt_state))
    trainable = sum(x.size for x in jax.tree_util.tree_leaves(lora.split(exp.policy.params)[0]))
    assert trainable < moments <= 2 * trainable + 16
    adapters_before = {k: np.asarray(x) for k, x in
                       leaves_by_path(lora.split(state.actor_params)[0]).items()}
    norms = []
    for step in range(3):  # the first batch may have no reward spread (no gradient)
        state, scalars = training.train_step(exp, state, step, step * 8)
        norms.append(scalars["actor/grad_norm"])
    after = leaves_by_path(state.actor_params)
    for name, x in leaves_by_path(lora.split(state.actor_params)[1]).items():
        assert x is state_frozen[name] and not x.is_deleted(), name  # never donated
        np.testing.assert_array_equal(np.asarray(x), before[name])
    changed = [n for n, x in adapters_before.items() if not np.array_equal(x, after[n])]
    assert max(norms) > 0 and any("_lora_b" in n for n in changed), (norms, changed)


def test_a_tiny_model_learns_the_bandit_through_adapters(lora_trained):
    series = val_series(lora_trained, "val/Bandit/success")
    print("val/Bandit/success by step (LoRA):", series)
    assert series[0][0] == 0 and series[0][1] < 0.7, series  # untrained: no preference yet
    assert series[-1][1] >= 0.9, series


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_exactly(lora_run, tmp_path):
    config, exp = lora_run
    config = with_changes(config, trainer__total_steps=4, trainer__save_freq=3,
                          val__test_freq=2)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    training.train(config, straight, progress=False, experiment=exp, log=QUIET)
    training.train(config, resumed, progress=False, experiment=exp, log=QUIET, stop_after=2)
    training.train(config, resumed, progress=False, experiment=exp, log=QUIET)
    a = comparable(metrics.read_jsonl(os.path.join(straight, "metrics.jsonl")))
    b = comparable(metrics.read_jsonl(os.path.join(resumed, "metrics.jsonl")))
    assert [r["step"] for r in a] == [0, 1, 2, 3, 4] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert math.isclose(ra[k], rb[k], rel_tol=1e-5, abs_tol=1e-6) or (
                math.isnan(ra[k]) and math.isnan(rb[k])), (ra["step"], k, ra[k], rb[k])
    saved = checkpoint.load_params(os.path.join(resumed, "checkpoints"), 4)
    names = set(leaves_by_path(saved))
    assert names == set(leaves_by_path(lora.split(exp.policy.params)[0])), names
    # bit-equal on a CPU; XLA:GPU need not sum in the same order run to run (atomics), so
    # there a float tolerance: on an H100 the resumed adapters were at most 3.8e-6 from the
    # straight run's (every logged metric within 1e-5)
    same = (np.testing.assert_array_equal if jax.default_backend() == "cpu" else
            functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=2e-5))
    jax.tree_util.tree_map(same, saved, checkpoint.load_params(
        os.path.join(straight, "checkpoints"), 4))


def test_export_merges_the_adapters_and_eval_reads_the_adapter_checkpoint(lora_trained, tmp_path):
    out = str(tmp_path / "hf")
    p = subprocess.run([sys.executable, "launch/export.py", f"--checkpoint={lora_trained}",
                        f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    _, policy, _ = experiment.load_run(lora_trained)
    assert policy.cfg.lora_rank == 64 and policy.cfg.tie_embeddings
    loaded = weights.load_model(out)
    assert loaded.cfg.lora_rank == 0 and not lora.has_adapters(loaded.params)
    assert not loaded.cfg.tie_embeddings  # the adapted head is no longer the lookup's table
    tokens = jnp.asarray([policy.tokenizer.encode("<answer>Dragon</answer>")], jnp.int32)
    valid = jnp.ones(tokens.shape, bool)
    want, _ = model_lib.forward(policy.params, policy.cfg, tokens, valid)
    got, _ = model_lib.forward(loaded.params, loaded.cfg, tokens, valid)
    assert float(jnp.abs(want).max()) > 1.0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)

    p = subprocess.run([sys.executable, "launch/eval.py", f"--checkpoint={lora_trained}",
                        "--groups=32", "--temperature=0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["results"]["Bandit"]["success"] >= 0.9


# ----------------------------------------------------------------------------- plan and input
def test_the_memory_plan_counts_a_shared_bfloat16_base_and_float32_adapters():
    config = bandit.get_config("lora")
    cfg = model_lib.ModelConfig(vocab_size=1000, hidden_size=64, num_layers=3, num_heads=4,
                                num_kv_heads=2, head_dim=16, intermediate_size=128)
    full = {p.name: dict(p.parts) for p in memory.plan(
        run_config.read(bandit.get_config()), cfg, update_dtype="bfloat16")}["update"]
    adapted = {p.name: dict(p.parts) for p in memory.plan(
        run_config.read(config), cfg, update_dtype="bfloat16")}["update"]
    # by hand: rank 64 on q k v o gate up down of 3 layers
    D, F, q, kv = 64, 128, 64, 32
    per_layer = 64 * ((D + q) + 2 * (D + kv) + (q + D) + 2 * (D + F) + (F + D))
    n = 3 * per_layer
    assert adapted["frozen base weights (shared)"] == cfg.num_params * 2
    assert adapted["actor adapters + AdamW moments"] == 3 * n * 4
    assert adapted["critic adapters + moments"] == 3 * n * 4
    assert adapted["gradient accumulators"] == 2 * n * 4
    assert full["gradient accumulators"] == 2 * cfg.num_params * 4
    assert "frozen base weights (shared)" not in full


@pytest.mark.parametrize("change,message", [
    (dict(model__lora__rank=-1), "model.lora.rank must be >= 0"),
    (dict(model__lora__alpha=0.0), "model.lora.alpha must be > 0"),
    (dict(model__lora__target_modules="q,attn"),
     "model.lora.target_modules: unknown module 'attn'"),
])
def test_bad_lora_settings_fail_in_one_line(change, message):
    config = with_changes(bandit.get_config("tiny"), **change)
    with pytest.raises(run_config.ConfigError) as e:
        config_check.check(config)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_the_cli_refuses_a_bad_rank_before_any_work(tmp_path):
    workdir = str(tmp_path / "run")
    p = subprocess.run([sys.executable, "launch/train.py", "--config=configs/bandit.py:tiny",
                        "--config.model.lora.rank=-2", f"--workdir={workdir}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert p.stderr.strip().splitlines()[-1].startswith("error: model.lora.rank"), p.stderr
    assert not os.path.exists(workdir)


def test_state_split_and_join_round_trip(lora_run):
    _, exp = lora_run
    state = jax.eval_shape(lambda: experiment.initial_train_state(exp))
    trainable, frozen = update_lib.split_state(state)
    assert not lora.has_adapters(frozen[0]) and lora.has_adapters(trainable.actor_params)
    assert jax.tree_util.tree_structure(update_lib.join_state(trainable, frozen)) == \
        jax.tree_util.tree_structure(state)
