"""starpo.checkpoint: round trips, retention, interrupted and corrupted checkpoints, errors."""

import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from starpo import run_config
from starpo import update
from starpo.checkpoint import Checkpointer, CheckpointError, load_params, read_meta
from tests import fake_devices


def grpo_state(seed=0):
    """A TrainState as GRPO has it (critic fields None), after two AdamW updates so that the
    moments are not zeros; f32 and bf16 leaves."""
    rng = np.random.default_rng(seed)
    params = {"dense": {"kernel": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
                        "bias": jnp.asarray(rng.standard_normal(3), jnp.bfloat16)},
              "embed": jnp.asarray(rng.standard_normal((5, 4)), jnp.float32)}
    algo = run_config.AlgoConfig(adv_estimator="grpo")
    state = update.init_train_state(algo, params)
    opt = update.make_optimizer(1e-2, algo)
    opt_state = state.actor_opt_state
    for _ in range(2):
        grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.1, params)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return state.replace(step=jnp.int32(7), actor_steps=jnp.int32(2), actor_params=params,
                         actor_opt_state=opt_state)


def assert_bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert isinstance(y, jax.Array)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def target_of(state):
    return jax.eval_shape(lambda s: s, state)


def test_round_trip_bitwise_with_none_fields(tmp_path):
    state = grpo_state()
    assert state.critic_params is None and state.critic_opt_state is None
    ckpt = Checkpointer(str(tmp_path / "checkpoints"))
    ckpt.save(7, state, {"step": 7})
    restored, meta = ckpt.restore(None, target_of(state))
    assert isinstance(restored, update.TrainState)
    assert restored.critic_params is None and restored.critic_opt_state is None
    assert_bitwise_equal(state, restored)
    assert meta == {"step": 7}
    # concrete arrays as the target work too
    assert_bitwise_equal(state, ckpt.restore(7, state)[0])
    ckpt.close()


def test_typed_keys_and_target_dtypes(tmp_path):
    tree = {"key": jax.random.key(3), "x": jnp.arange(6, dtype=jnp.float32), "n": None}
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, tree, {})
    restored, _ = ckpt.restore(1, target_of(tree))
    assert jax.dtypes.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    assert np.array_equal(jax.random.key_data(restored["key"]), jax.random.key_data(tree["key"]))
    assert restored["n"] is None
    # the target's dtype wins
    as_bf16 = dict(target_of(tree), x=jax.ShapeDtypeStruct((6,), jnp.bfloat16))
    assert ckpt.restore(1, as_bf16)[0]["x"].dtype == jnp.bfloat16


def test_keep_latest_and_meta(tmp_path):
    d = str(tmp_path / "checkpoints")
    ckpt = Checkpointer(d, keep=2)
    assert ckpt.steps() == [] and ckpt.latest_step() is None
    state = grpo_state()
    for step in (5, 10, 15):
        ckpt.save(step, state, {"step": step, "loss": np.float32(0.25), "seeds": np.arange(3),
                                "config": {"lr": 1e-6, "name": "x"}})
    assert ckpt.steps() == [10, 15] and ckpt.latest_step() == 15
    assert sorted(os.listdir(d)) == ["10", "15"]
    expected = {"step": 10, "loss": 0.25, "seeds": [0, 1, 2], "config": {"lr": 1e-6, "name": "x"}}
    assert ckpt.restore(10, target_of(state))[1] == expected
    assert read_meta(d, 10) == expected and read_meta(d)["step"] == 15
    with pytest.raises(CheckpointError, match="not after the latest"):
        ckpt.save(15, state, {})
    with pytest.raises(CheckpointError, match="meta is not JSON"):
        ckpt.save(20, state, {"bad": object()})
    with pytest.raises(CheckpointError, match="no complete checkpoint for step 5"):
        ckpt.restore(5, target_of(state))
    ckpt.close()
    # a new Checkpointer (a resumed run) sees the same steps
    assert Checkpointer(d, keep=2).steps() == [10, 15]


def test_load_params_reads_one_field(tmp_path):
    state = grpo_state()
    d = str(tmp_path)
    ckpt = Checkpointer(d)
    ckpt.save(7, state, {})
    assert_bitwise_equal(state.actor_params, load_params(d))
    assert_bitwise_equal(state.actor_params, load_params(d, 7, target_of(state.actor_params)))
    assert load_params(d, field="critic_params") is None  # saved as None (GRPO)
    with pytest.raises(CheckpointError, match="has no field 'critic'"):
        load_params(d, field="critic")


def test_interrupted_writes_are_ignored_then_removed(tmp_path):
    d = str(tmp_path / "checkpoints")
    state = grpo_state()
    ckpt = Checkpointer(d, keep=2)
    ckpt.save(1, state, {"step": 1})
    # what interrupted orbax writes leave behind (a step is renamed into place when complete)
    os.makedirs(os.path.join(d, "2.orbax-checkpoint-tmp-1700000000", "state"))
    os.makedirs(os.path.join(d, "3.orbax-checkpoint-tmp-1700000001", "meta"))
    with open(os.path.join(d, "3.orbax-checkpoint-tmp-1700000001", "_CHECKPOINT_METADATA"),
              "w") as f:
        f.write("{}")
    assert ckpt.steps() == [1] and ckpt.latest_step() == 1
    assert ckpt.restore(None, target_of(state))[1] == {"step": 1}
    ckpt.close()

    resumed = Checkpointer(d, keep=2)  # a writable Checkpointer has orbax clear them away
    assert resumed.steps() == [1]
    resumed.save(3, state, {"step": 3})
    assert sorted(os.listdir(d)) == ["1", "3"]
    resumed.save(4, state, {"step": 4})
    assert resumed.steps() == [3, 4]


def damage_state():
    """A state with one array large enough to be stored in its own data file (OCDBT keeps
    small arrays inline in its B-tree nodes, which carry checksums)."""
    big = np.random.default_rng(1).standard_normal((64, 64))
    return {"train": grpo_state(), "big": jnp.asarray(big, jnp.float32)}


def _largest_array_file(step_dir):
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state"))
             for f in fs if os.sep + "d" + os.sep in os.path.join(r, f)]
    return max(files, key=os.path.getsize)


def _truncate(step_dir):
    path = _largest_array_file(step_dir)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _garble(step_dir, path=None):  # same size, raw float bytes: only the fingerprint can tell
    path = path or _largest_array_file(step_dir)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)


def _delete_array_file(step_dir):
    os.remove(_largest_array_file(step_dir))


def _delete_tree_metadata(step_dir):
    os.remove(os.path.join(step_dir, "state", "_METADATA"))


def _garble_tree_node(step_dir):  # OCDBT's B-tree nodes carry a crc32c
    (name,) = os.listdir(os.path.join(step_dir, "state", "d"))
    _garble(step_dir, os.path.join(step_dir, "state", "d", name))


def _garble_checks(step_dir):
    with open(os.path.join(step_dir, "checks", "metadata"), "w") as f:
        f.write("{not json")


def _garble_meta(step_dir):  # still valid JSON: only the checksum can tell
    path = os.path.join(step_dir, "meta", "metadata")
    text = open(path).read()
    assert '"step": 2' in text
    with open(path, "w") as f:
        f.write(text.replace('"step": 2', '"step": 3'))


@pytest.mark.parametrize("damage, message", [
    (_truncate, "reading the state failed"), (_garble, "do not match their fingerprint"),
    (_delete_array_file, "reading the state failed"),
    (_delete_tree_metadata, "does not match the target"),
    (_garble_tree_node, "DATA_LOSS"),
    (_garble_checks, "reading the state failed"), (_garble_meta, "meta does not match"),
])
def test_corrupted_checkpoint_is_one_line_error(tmp_path, damage, message):
    d = str(tmp_path)
    state = damage_state()
    ckpt = Checkpointer(d)
    ckpt.save(1, state, {"step": 1})
    ckpt.save(2, state, {"step": 2})
    damage(os.path.join(d, "2"))
    # a damaged complete step is reported, not skipped for an older one
    assert ckpt.latest_step() == 2
    with pytest.raises(CheckpointError) as e:
        ckpt.restore(None, target_of(state))
    text = str(e.value)
    assert "\n" not in text and os.path.join(d, "2") in text and message in text
    assert_bitwise_equal(state, ckpt.restore(1, target_of(state))[0])


def test_structure_mismatch_is_one_line_error(tmp_path):
    state = grpo_state()
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, state, {})
    wrong_shape = state.replace(actor_params=dict(state.actor_params, embed=jnp.zeros((6, 4))))
    with pytest.raises(CheckpointError, match=r"embed has shape \(5, 4\), the target wants "
                                              r"\(6, 4\)"):
        ckpt.restore(1, target_of(wrong_shape))
    with_critic = state.replace(critic_params={"w": jnp.zeros(2)})
    with pytest.raises(CheckpointError, match="it has no critic_params/w"):
        ckpt.restore(1, target_of(with_critic))


def test_unwritable_or_missing_directory(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="is not writable") as e:
        Checkpointer(str(blocker / "checkpoints"))
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_meta(str(tmp_path / "nothing"))
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_params(str(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(CheckpointError, match="is not writable"):
            Checkpointer(str(d / "checkpoints"))
    finally:
        d.chmod(0o700)


def test_restore_onto_another_sharding(tmp_path):
    """Saved from one device, restored sharded over 8 (fake CPU devices need a fresh process)."""
    state = grpo_state()
    Checkpointer(str(tmp_path)).save(1, state, {})
    expected = np.asarray(state.actor_params["embed"])
    np.save(tmp_path / "expected.npy", expected)
    script = textwrap.dedent(f"""
        import jax, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from starpo.checkpoint import load_params
        assert jax.device_count() == 8
        mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
        target = {{"embed": jax.ShapeDtypeStruct((5, 4), np.float32,
                                                 sharding=NamedSharding(mesh, P(None, "b")))}}
        target["dense"] = {{
            "kernel": jax.ShapeDtypeStruct((4, 3), np.float32,
                                           sharding=NamedSharding(mesh, P("b", None))),
            "bias": jax.ShapeDtypeStruct((3,), jax.numpy.bfloat16,
                                         sharding=NamedSharding(mesh, P()))}}
        params = load_params({str(tmp_path)!r}, target=target)
        embed = params["embed"]
        assert embed.sharding == target["embed"].sharding, embed.sharding
        assert len(embed.addressable_shards) == 8
        assert np.array_equal(np.asarray(embed), np.load({str(tmp_path / "expected.npy")!r}))
        print("ok")
    """)
    out = fake_devices.run(["-c", script], timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
