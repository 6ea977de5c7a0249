"""Sharding: the rules table, meshes, and sharded runs equal to single-device ones.

The equivalence runs need 8 devices, which XLA only fakes at start-up, so they run once in a
subprocess (`tests/mesh_equivalence.py`) whose results every test here reads.
"""

import json

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from starpo import model as M
from starpo import run_config as RC
from starpo import sharding
from starpo import update as UP
from tests import fake_devices

MESHES = ("8x1x1", "2x4x1", "2x2x2")


def abstract_mesh(data, fsdp, tensor):
    return AbstractMesh((data, fsdp, tensor), sharding.MESH_AXES)


# ----------------------------------------------------------------------------- rules
def test_rules_split_weights_and_rows():
    mesh = abstract_mesh(2, 2, 2)
    assert sharding.spec(("layers", "embed", "mlp"), (3, 64, 128), mesh) == P(None, "fsdp", "tensor")
    assert sharding.spec(("layers", "embed", "heads", "head_dim"), (3, 64, 4, 8), mesh) == P(
        None, "fsdp", "tensor")
    assert sharding.spec(("vocab", "embed"), (96, 64), mesh) == P("tensor", "fsdp")
    assert sharding.spec(("batch", "length"), (8, 100), mesh) == P(("data", "fsdp"))
    assert sharding.spec(("embed", None), (64, 1), mesh) == P("fsdp")
    # size-1 mesh axes are left out; a fully replicated array has an empty spec
    assert sharding.spec(("embed", "mlp"), (64, 128), abstract_mesh(8, 1, 1)) == P()
    assert sharding.spec(("batch",), (8,), abstract_mesh(8, 1, 1)) == P("data")
    with pytest.raises(KeyError, match="no sharding rule for logical axis 'nonsense'"):
        sharding.spec(("nonsense",), (4,), mesh)


def test_sizes_that_do_not_divide_are_replicated_and_reported():
    """Qwen2.5-0.5B: 14 query heads, 2 kv heads, MLP 4864, vocab 151936, width 896."""
    mesh = abstract_mesh(1, 2, 4)
    # heads 14 on tensor=4: replicated; width 896 on fsdp=2 still split
    assert sharding.spec(("layers", "embed", "heads", "head_dim"), (24, 896, 14, 64), mesh) == P(
        None, "fsdp")
    assert sharding.spec(("layers", "embed", "mlp"), (24, 896, 4864), mesh) == P(
        None, "fsdp", "tensor")
    # rows: the longest prefix of (data, fsdp) that divides them
    assert sharding.spec(("batch",), (6,), abstract_mesh(2, 4, 1)) == P("data")
    assert sharding.spec(("batch",), (5,), abstract_mesh(2, 4, 1)) == P()

    qwen = M.ModelConfig(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14,
                         num_kv_heads=2, head_dim=64, intermediate_size=4864, qkv_bias=True)
    lines = sharding.describe(M.logical_axes(qwen), M.abstract_params(qwen), mesh)
    assert lines == [
        "layers.attn.k.bias: kv_heads=2 is not divisible by 4 devices (replicated)",
        "layers.attn.k.kernel: kv_heads=2 is not divisible by 4 devices (replicated)",
        "layers.attn.o.kernel: heads=14 is not divisible by 4 devices (replicated)",
        "layers.attn.q.bias: heads=14 is not divisible by 4 devices (replicated)",
        "layers.attn.q.kernel: heads=14 is not divisible by 4 devices (replicated)",
        "layers.attn.v.bias: kv_heads=2 is not divisible by 4 devices (replicated)",
        "layers.attn.v.kernel: kv_heads=2 is not divisible by 4 devices (replicated)"]
    # on tensor=2 every dim divides: heads 7 per device, kv heads 1
    assert sharding.describe(M.logical_axes(qwen), M.abstract_params(qwen),
                             abstract_mesh(1, 2, 2)) == []


def test_mesh_shapes():
    assert sharding.mesh_shape(1, -1, 1, num_devices=8) == (1, 8, 1)
    assert sharding.mesh_shape(2, -1, 2, num_devices=8) == (2, 2, 2)
    assert sharding.mesh_shape(-1, 1, 1, num_devices=1) == (1, 1, 1)
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        sharding.mesh_shape(-1, -1, 1, num_devices=8)
    with pytest.raises(ValueError, match="8 devices are not divisible by the fixed axes' product 3"):
        sharding.mesh_shape(3, -1, 1, num_devices=8)
    with pytest.raises(ValueError, match="2 x 2 x 1 = 4 devices, but 8 are available"):
        sharding.mesh_shape(2, 2, 1, num_devices=8)
    mesh = sharding.make_mesh()  # this process: one CPU device
    assert dict(mesh.shape) == {"data": 1, "fsdp": jax.device_count(), "tensor": 1}


def test_optimizer_moments_follow_their_weights():
    cfg = M.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, intermediate_size=64)
    mesh = abstract_mesh(1, 2, 2)
    tx = UP.make_optimizer(1e-3, RC.AlgoConfig())
    opt = jax.eval_shape(tx.init, M.abstract_params(cfg))
    out = jax.tree_util.tree_map(lambda s: s.spec, sharding.optimizer_shardings(
        tx, opt, M.param_shardings(cfg, mesh), mesh))
    adam = out[1][0]
    assert adam.mu["layers"]["mlp"]["gate"]["kernel"] == P(None, "fsdp", "tensor")
    assert adam.nu["embed"]["embedding"] == P("tensor", "fsdp")
    assert adam.count == P()


def test_multi_process_launches_are_detected():
    detect = sharding.multi_process_environment
    assert not detect({})
    assert not detect({"SLURM_NTASKS": "1", "TPU_WORKER_HOSTNAMES": "localhost"})
    assert detect({"SLURM_NTASKS": "4"})
    assert detect({"TPU_WORKER_HOSTNAMES": "t1-w-0,t1-w-1"})
    assert detect({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
    assert not sharding.initialize_distributed("auto", environ={})
    assert not sharding.initialize_distributed("off", environ={"SLURM_NTASKS": "4"})
    with pytest.raises(ValueError, match="mesh.distributed must be auto, on or off"):
        sharding.initialize_distributed("yes")


@pytest.mark.parametrize("layout, words", [
    ({"num_processes": 2}, "set together"),
    ({"process_id": 0}, "set together"),
    ({"num_processes": 2, "process_id": 2}, r"process_id must be in \[0, 1\]"),
    ({"num_processes": -1, "process_id": 0}, "set together"),
    ({"coordinator_address": "10.0.0.1"}, "HOST:PORT"),
    ({"coordinator_address": "10.0.0.1:99999"}, "HOST:PORT"),
    ({"heartbeat_timeout_s": 1}, "mesh.heartbeat_timeout_s must be >= 2, got 1"),
])
def test_a_bad_process_layout_is_a_one_line_error_before_any_work(layout, words):
    for mode in ("auto", "on", "off"):  # checked even where it would not be used
        with pytest.raises(ValueError, match=words) as e:
            sharding.initialize_distributed(mode, environ={}, **layout)
        assert "\n" not in str(e.value)


def test_an_unreachable_coordinator_is_a_one_line_error_in_bounded_time():
    import socket
    import time

    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.monotonic()
    with pytest.raises(ValueError, match=f"127.0.0.1:{port} is unreachable after 1 s") as e:
        sharding.initialize_distributed("auto", environ={}, num_processes=2, process_id=1,
                                        coordinator_address=f"127.0.0.1:{port}",
                                        init_timeout_s=1)
    assert time.monotonic() - t < 10 and "\n" not in str(e.value)
    assert not jax.distributed.is_initialized()


# ----------------------------------------------------------------------------- 8 fake devices
@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh") / "results.npz"
    run = fake_devices.run(["-m", "tests.mesh_equivalence", str(out)])
    assert run.returncode == 0, run.stderr[-3000:]
    placements = json.loads(run.stdout.strip().splitlines()[-1])
    return dict(np.load(out)), placements


@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_forward_sampler_and_update_equal_one_device(mesh_runs, mesh):
    results, _ = mesh_runs
    one = lambda name: results[f"single/{name}"]  # noqa: E731
    got = lambda name: results[f"{mesh}/{name}"]  # noqa: E731
    np.testing.assert_allclose(got("logits"), one("logits"), atol=1e-4, rtol=1e-4)
    # the sampler draws the same tokens (same key: random bits do not depend on the sharding)
    for field in ("turn.tokens", "turn.length", "turn.stop_reason"):
        np.testing.assert_array_equal(got(field), one(field))
    np.testing.assert_allclose(got("turn.logprobs"), one("turn.logprobs"), atol=1e-4)
    np.testing.assert_allclose(got("cache.k"), one("cache.k"), atol=1e-4)
    metrics = [k.split("/", 2)[2] for k in results if k.startswith("single/metrics/")]
    assert "actor/pg_loss" in metrics and "critic/vf_loss" in metrics
    for name in metrics:
        np.testing.assert_allclose(got(f"metrics/{name}"), one(f"metrics/{name}"), rtol=1e-4,
                                   atol=1e-5, err_msg=name)
    # after two Adam steps of lr 1e-2 (up to 2e-2 per weight): gradients agree to float
    # rounding, which Adam's normalisation can magnify only on near-zero gradient entries
    for net in ("actor", "critic"):
        np.testing.assert_allclose(got(f"update2.{net}"), one(f"update2.{net}"), atol=1e-3)
        assert np.abs(got(f"update2.{net}") - one(f"update2.{net}")).mean() < 1e-5


def test_weights_and_rows_are_really_sharded(mesh_runs):
    _, placed = mesh_runs
    # pure data parallelism: weights whole on every device, cache rows split
    assert placed["8x1x1/actor_params.layers.mlp.gate.kernel"] == ["P()", [2, 32, 64]]
    assert placed["8x1x1/cache.k"] == "P(None, 'data')"
    # FSDP: the width of every weight (and of its Adam moments) split 4 ways
    assert placed["2x4x1/actor_params.layers.mlp.gate.kernel"] == ["P(None, 'fsdp')", [2, 8, 64]]
    assert placed["2x4x1/actor_opt_state.1.0.mu.layers.mlp.down.kernel"] == [
        "P(None, None, 'fsdp')", [2, 64, 8]]
    assert placed["2x4x1/actor_params.embed.embedding"] == ["P(None, 'fsdp')", [64, 8]]
    assert placed["2x4x1/cache.k"] == "P(None, ('data', 'fsdp'))"
    # FSDP x tensor: heads / MLP / vocab on tensor as well; the cache's kv heads too
    assert placed["2x2x2/actor_params.layers.attn.q.kernel"] == [
        "P(None, 'fsdp', 'tensor')", [2, 16, 2, 8]]
    assert placed["2x2x2/actor_params.embed.embedding"] == ["P('tensor', 'fsdp')", [32, 16]]
    assert placed["2x2x2/critic_params.value_head.kernel"] == ["P('fsdp',)", [16, 1]]
    assert placed["2x2x2/cache.k"] == "P(None, ('data', 'fsdp'), 'tensor')"


def test_checkpoint_from_a_mesh_resumes_on_one_device(mesh_runs):
    """Saved after one update on (2,4,1), restored onto one device, second update there: the
    same weights as the run that stayed on the mesh."""
    results, _ = mesh_runs
    assert results["resumed/devices"].tolist() == [0]
    for net in ("actor", "critic"):
        np.testing.assert_allclose(results[f"resumed/update2.{net}"],
                                   results[f"2x4x1/update2.{net}"], atol=1e-3)
        assert np.abs(results[f"resumed/update2.{net}"]
                      - results[f"2x4x1/update2.{net}"]).mean() < 1e-5


def test_a_run_aborted_at_a_rendezvous_runs_again_once_and_says_so(tmp_path):
    """tests/fake_devices.run: a process that ends with XLA's rendezvous abort runs once more
    and each abort leaves a warning quoting XLA's line; any other failure is returned at once.
    (A stand-in program: it counts its runs in a file and writes XLA's message.)"""
    count = tmp_path / "runs"
    abort = ("import pathlib, sys; p = pathlib.Path(sys.argv[1]); "
             "p.write_text(str(int(p.read_text() or 0) + 1) if p.exists() else '1'); "
             f"sys.stderr.write('F0 rendezvous.cc:1] {fake_devices.ABORTED_AT_RENDEZVOUS} "
             "`all-reduce` of 60 seconds exceeded.\\n'); sys.exit(134)")
    with pytest.warns(UserWarning, match="aborted at a collective's rendezvous") as seen:
        done = fake_devices.run(["-c", abort, str(count)], n=2, timeout=60)
    assert done.returncode == 134 and count.read_text() == "2"
    assert len(seen) == 2 and "`all-reduce` of 60 seconds exceeded" in str(seen[0].message)

    other = tmp_path / "other"
    fail = ("import pathlib, sys; p = pathlib.Path(sys.argv[1]); "
            "p.write_text('1'); sys.exit(3)")
    done = fake_devices.run(["-c", fail, str(other)], n=2, timeout=60)
    assert done.returncode == 3 and other.read_text() == "1"
