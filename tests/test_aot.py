"""A run's programs compiled for TPU topologies on this CPU (`starpo/aot.py`, `launch/plan.py
--topology`). The compiles need libtpu (`requirements-tpu.txt`; CI's TPU step): those tests are
marked `tpu` and skip where it is absent. The topology names, the platform override and the
message without libtpu are checked everywhere."""

import importlib.util
import os
import subprocess
import sys

import jax
import pytest

from starpo import aot, families, model as model_lib, precision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not installed "
                                  "(pip install -r requirements-tpu.txt)")


# ----------------------------------------------------------------------------- everywhere
@pytest.mark.parametrize("name, parsed", [
    ("v5e:2x2", ("v5e", (2, 2))), ("v4:2x2x4", ("v4", (2, 2, 4))),
    (" v6e:16x16 ", ("v6e", (16, 16))), ("v5p:2x2x2", ("v5p", (2, 2, 2)))])
def test_a_topology_name_is_a_generation_and_its_chips(name, parsed):
    assert aot.parse(name) == parsed


@pytest.mark.parametrize("name, words", [
    ("v5e-4", "GENERATION:CHIPS"), ("v3:2x2", "generations: v4, v5e"),
    ("v5e:2x2x2", "v5e slices are NxN"), ("v4:2x2", "v4 slices are NxNxN"),
    ("v5e:0x2", "NxN")])
def test_a_bad_topology_name_is_one_line(name, words):
    with pytest.raises(aot.TopologyError) as e:
        aot.parse(name)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_hosts_hold_four_chips_where_the_slice_has_them():
    assert aot.host_bounds((1, 1)) == (1, 1, 1)
    assert aot.host_bounds((2, 1)) == (2, 1, 1)
    assert aot.host_bounds((16, 16)) == (2, 2, 1)
    assert aot.host_bounds((4, 4, 8)) == (2, 2, 1)


def test_without_libtpu_the_error_names_the_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "libtpu" else real(name, *a))
    with pytest.raises(aot.TopologyError, match="pip install -r requirements-tpu.txt"):
        aot.topology("v5e:2x2")


def test_the_target_platform_decides_dtypes_and_kernels():
    """Under `precision.target("tpu")` the choices are a TPU's on this CPU: bfloat16 in every
    phase with model.dtype=auto, splash attention and the TPU decode kernel for `auto`, and back
    after."""
    from configs import bandit
    from tests.test_training import with_changes

    config = with_changes(bandit.get_config("tiny"), model__dtype="auto")
    cfg = model_lib.ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, head_dim=16, intermediate_size=64)
    with precision.target("tpu"):
        assert precision.backend() == "tpu"
        assert set(precision.phase_dtypes(config).values()) == {"bfloat16"}
        assert model_lib.kernels(cfg) == "splash"
        assert model_lib.decode_kernel(cfg) == "pallas_tpu"
    assert precision.backend() == jax.default_backend()
    if jax.default_backend() == "cpu":
        assert model_lib.kernels(cfg) == "cpu"


def test_a_program_xla_refuses_for_want_of_hbm_is_a_row_that_does_not_fit():
    """XLA's RESOURCE_EXHAUSTED (libtpu 0.0.42's words for Qwen2.5-3B's update on a v5e-8)
    becomes a row that does not fit, with XLA's figure, in the table and the kept JSON; any
    other compile error is not one."""
    from benchmarks import tpu_compile

    said = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
            "temporaries (19.57G) exceeds available HBM (15.75G).")
    what, need = aot.out_of_hbm(RuntimeError(said))
    assert need == int(19.57 * 2 ** 30) and "15.75GiB" in what
    assert aot.out_of_hbm(RuntimeError("INVALID_ARGUMENT: mismatched shapes")) is None
    row = aot.Compiled("update", "update", 12.0, need, 5 * 2 ** 30, 16 * 2 ** 30, None, None,
                       refused=what)
    assert not row.fits
    topo = aot.Topology("v5e:2x4", "v5e", (2, 4), tuple(range(8)), 2)
    assert "> 19.57 (XLA: HLO temporaries need 19.57GiB" in aot.table([row], topo)
    kept = {"row": "r", "model": "m", "topology": "v5e:2x4", "programs": [aot.as_json(row)]}
    assert kept["programs"][0]["xla_refused"] == what
    assert "does not fit (HLO temporaries need 19.57GiB" in tpu_compile.table([kept])


# ----------------------------------------------------------------------------- with libtpu
@pytest.fixture(scope="module")
def compiled_tiny():
    """The tiny FrozenLake run with a critic, a validation set of its own size and an SFT
    phase, compiled for a v5e 2x2 slice (4 chips, one host): every program kind."""
    from configs import frozenlake
    from tests.test_training import with_changes

    config = with_changes(frozenlake.get_config("tiny"), rollout__env_groups=8,
                          val__env_groups=4, sft__steps=2, sft__env_groups=4,
                          algorithm__adv_estimator="gae", algorithm__ppo_mini_batch_size=8,
                          algorithm__micro_batch_size=8, trainer__fast_compile=True)
    tok = aot.config_tokenizer(config)
    # every weight's dims multiples of 128 (a TPU pads an array's last dim to 128 lanes and
    # the one before to 8 sublanes: so nothing but the norms is padded here)
    cfg = model_lib.ModelConfig(vocab_size=-(-tok.vocab_size // 128) * 128, hidden_size=128,
                                num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128,
                                intermediate_size=256)
    topo = aot.topology("v5e:2x2")
    return config, cfg, topo, aot.compile_run(config, cfg, tok, topo)


@pytest.mark.tpu
@needs_libtpu
def test_every_program_of_a_run_compiles_for_a_v5e_slice(compiled_tiny):
    config, cfg, topo, rows = compiled_tiny
    assert [r.phase for r in rows] == ["rollout", "validation FrozenLake", "update", "sft"]
    assert len(topo.devices) == 4 and topo.devices[0].device_kind == "TPU v5 lite"
    assert all(r.fits and r.hbm_bytes == 16 * 2 ** 30 for r in rows)
    assert all(r.plan_bytes > 0 and r.bytes > 0 for r in rows)
    table = aot.table(rows, topo)
    assert table.count("\n") == 1 + len(rows) and "| sft |" in table


@pytest.mark.tpu
@needs_libtpu
def test_the_weights_are_split_over_the_slices_chips(compiled_tiny):
    """The update's arguments per chip: the TrainState (float32 weights, two AdamW moments, the
    critic's copy with its value head and moments) split four ways over fsdp, as counted by
    hand from the parameter count, plus the trajectory's rows (a quarter each)."""
    config, cfg, topo, rows = compiled_tiny
    update = next(r for r in rows if r.phase == "update")
    arguments = dict(update.parts)["arguments"]
    actor = cfg.num_params * 4  # float32 master weights
    critic = (cfg.num_params + cfg.hidden_size + 1) * 4  # + the value head
    by_hand = 3 * (actor + critic) / 4
    # the trajectory and the counters are small beside the state; some small weights
    # (norms, biases) are not split: the bound allows for both
    assert by_hand <= arguments <= 1.25 * by_hand, (arguments, by_hand)


@pytest.mark.tpu
@needs_libtpu
def test_a_pod_topology_compiles_over_its_hosts():
    """A v5e 4x4 slice is 16 chips on 4 hosts: one process's description of the whole slice;
    a program over all of them (fsdp 16) compiles, each chip holding a 16th of the weights."""
    import jax.numpy as jnp

    topo = aot.topology("v5e:4x4")
    assert len(topo.devices) == 16 and topo.processes == 4
    from starpo import sharding

    mesh = sharding.make_mesh(1, -1, 1, devices=topo.devices)
    w = jax.ShapeDtypeStruct((1024, 512), jnp.float32,
                             sharding=sharding.batch_sharding(mesh, 1024, 2))
    with jax.set_mesh(mesh):
        c = jax.jit(lambda w: (w * 2).sum()).lower(w).compile()
    assert dict(aot.chip_parts(c))["arguments"] == 1024 * 512 * 4 // 16


@pytest.mark.tpu
@needs_libtpu
def test_a_gemma3_run_with_sliding_window_layers_compiles_for_a_tpu(compiled_tiny):
    """Gemma 3's switches and a sliding-window layer beside a global one: every program of
    the tiny run compiles for one v5e chip (its splash attention gives way to XLA's there)."""
    config, cfg, _, _ = compiled_tiny
    fields = families.family("gemma3").fields()
    gemma = cfg.replace(**fields, sliding_window=16, local_layers=(0,), query_scale=64.0)
    rows = aot.compile_run(config, gemma, aot.config_tokenizer(config), aot.topology("v5e:1x1"))
    assert [r.phase for r in rows] == ["rollout", "validation FrozenLake", "update", "sft"]
    assert all(r.fits and r.bytes > 0 for r in rows)


def _one_v5e_chip():
    """A 1 x 1 x 1 mesh over one v5e chip's compile-only device."""
    from starpo import sharding

    return sharding.make_mesh(1, 1, 1, devices=aot.topology("v5e:1x1").devices)


@pytest.mark.tpu
@needs_libtpu
def test_a_chips_figure_is_the_peak_of_live_buffers_not_the_sum_of_temporaries():
    """Decode-like steps over a 128 MiB cache [layers, rows, slots, width], each layer's slice
    rewritten and read, on one v5e chip. Counted by hand, its live buffers are the arguments
    (the cache, 8 MiB of weights, the rows' state) and at most two working copies of the cache
    (XLA lays the carried cache out anew). `chip_bytes` is that peak plus the code; the
    arguments + temporaries sum would overcount it (libtpu 0.0.42: temporaries 384 MiB, a 392
    MiB peak, 136 MiB of arguments)."""
    import jax.numpy as jnp
    from starpo import sharding

    mesh = _one_v5e_chip()
    L, B, S, D = 4, 16, 1024, 1024

    def steps(w, cache, x):
        def step(carry, t):
            def layer(x, lw):
                w, kv = lw
                h = jnp.tanh(x @ w)
                kv = jax.lax.dynamic_update_slice(kv, h[:, None, :], (0, t, 0))
                p = jax.nn.softmax(jnp.einsum("bd,bsd->bs", h, kv))
                return h + jnp.einsum("bs,bsd->bd", p, kv), kv
            x, cache = jax.lax.scan(layer, carry[1], (w, carry[0]))
            return (cache, x), x.sum()
        return jax.lax.scan(step, (cache, x), jnp.arange(16))[1]

    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                 sharding=sharding.batch_sharding(mesh, shape[0], len(shape)))
            for shape in ((L, D, D), (L, B, S, D), (B, D))]
    with jax.set_mesh(mesh):
        c = jax.jit(steps).lower(*args).compile()
    parts, mib = dict(aot.chip_parts(c)), 2 ** 20
    cache = L * B * S * D * 2
    assert parts["arguments"] == cache + L * D * D * 2 + B * D * 2
    assert parts["arguments"] <= parts["peak"] <= parts["arguments"] + 2 * cache + 8 * mib
    assert aot.chip_bytes(c) == parts["peak"] + parts["code"]


def _plan(*args):
    # this process holds libtpu's lock file already: the command may load it beside it
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    return subprocess.run([sys.executable, "launch/plan.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.tpu
@needs_libtpu
@pytest.mark.parametrize("args, words", [
    (["--topology=v5e-4"], "unknown TPU topology 'v5e-4'"),
    (["--topology=v5e:2x2", "--config.mesh.data=3"], "mesh: 4 devices are not divisible"),
    (["--topology=v5e:2x2", "--devices=4"], "leave out --devices"),
])
def test_plan_topology_bad_input_is_one_line_before_any_compile(args, words):
    p = _plan("--config=configs/bandit.py:tiny", "--models=smollm2-135m", *args)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert p.returncode == 2 and len(errors) == 1 and words in errors[0], p.stderr
    assert "compiling" not in p.stderr and "Traceback" not in p.stderr


@pytest.mark.tpu
@needs_libtpu
def test_the_tpu_attention_kernels_compile_for_a_v5e_slice():
    """Splash attention (forward and both backward kernels) and the decode kernel compile for
    v5e chips under shard_map on data 2 x tensor 2, at Qwen2.5-0.5B's head shape (14 query
    heads on 2 kv heads, head dim 64) in bfloat16, each a Mosaic custom call; each chip holds a
    quarter of the queries (rows over data, kv heads with their query heads over tensor)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from starpo import sharding, tpu_attention

    topo = aot.topology("v5e:2x2")
    mesh = sharding.make_mesh(2, 1, 2, devices=topo.devices)
    B, T, K, G, E, S = 8, 1000, 2, 7, 64, 1024

    def struct(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    q = struct((B, T, K, G, E), jnp.bfloat16, P("data", None, "tensor"))
    kv = struct((B, T, K, E), jnp.bfloat16, P("data", None, "tensor"))
    valid = struct((B, T), jnp.bool_, P("data"))
    cq = struct((B, 1, K, G, E), jnp.float32, P("data", None, "tensor"))
    cache = struct((B, K, S, E), jnp.bfloat16, P("data", "tensor"))
    seen = struct((B, 1, S), jnp.bool_, P("data"))

    def loss(q, k, v, valid):
        return model_lib._attend_causal(q, k, v, valid, "splash").astype(jnp.float32).sum()

    with precision.target("tpu"), jax.set_mesh(mesh):
        train = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, valid).compile()
        step = jax.jit(tpu_attention.decode).lower(cq, cache, cache, seen).compile()
    assert train.as_text().count("tpu_custom_call") == 3  # forward, dq, dkv
    assert step.as_text().count("tpu_custom_call") == 1
    chip_q = B * T * K * G * E * 2 // 4
    assert dict(aot.chip_parts(train))["arguments"] >= chip_q
    assert dict(aot.chip_parts(train))["arguments"] < 2 * chip_q  # not the whole of q


@pytest.mark.tpu
@needs_libtpu
@pytest.mark.parametrize("kv_heads, head_dim", [(3, 64), (2, 64), (2, 128), (5, 128)])
def test_the_plans_tpu_tile_padding_is_the_compiled_cache_buffers(kv_heads, head_dim, tmp_path):
    """The KV cache as the rollout writes it (`model._attend_written_cache`: a step's keys into
    every row's slot, then attention over the cache) in a scan of decode steps, compiled for a
    v5e chip: its largest buffer, from XLA's memory-usage report, is a layer stack's keys
    padded by exactly `memory.kv_tile_padding` (SmolLM2's 3 kv heads of 64: 2.7x)."""
    import re
    import jax.numpy as jnp
    from starpo import memory

    mesh = _one_v5e_chip()
    L, B, S, G = 2, 128, 512, 3

    def steps(cache, q, k):
        def step(cache, t):
            def layer(x, kv):
                rows, slots = jnp.arange(B)[:, None], jnp.full((B, 1), t)
                visible = jnp.broadcast_to(jnp.arange(S) <= t, (B, 1, S))
                out, kv = model_lib._attend_written_cache(q, k, k, kv, (rows, slots, visible))
                return x + out.sum(), kv
            return jax.lax.scan(layer, 0.0, cache)[::-1]
        return jax.lax.scan(step, cache, jnp.arange(8))[1]

    K, E = kv_heads, head_dim
    cache = jax.ShapeDtypeStruct((L, B, K, S, E), jnp.bfloat16)
    args = ((cache, cache), jax.ShapeDtypeStruct((B, 1, K, G, E), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, 1, K, E), jnp.bfloat16))
    with jax.set_mesh(mesh):
        jax.jit(steps).lower(*args).compile({"xla_dump_to": str(tmp_path)})
    report = next(tmp_path.glob("*memory-usage-report.txt")).read_text()
    hbm = report.split("Memory Space")[1]  # the default memory space's buffers
    largest = max(float(m) for m in re.findall(r";\s+([\d.]+)MiB;", hbm)) * 2 ** 20
    values = L * B * K * S * E * 2
    assert largest == pytest.approx(values * memory.kv_tile_padding(K, E, "tpu"), rel=1e-3)
    assert memory.kv_tile_padding(K, E, "cpu") == 1.0


@pytest.mark.tpu
@needs_libtpu
def test_xla_refusing_a_program_too_large_for_a_chip_is_read():
    """A [65536, 65536] float32 product that must exist whole (16 GiB) on one v5e chip: XLA
    refuses it, and `out_of_hbm` reads how much it needed."""
    import jax.numpy as jnp
    from starpo import sharding

    mesh = _one_v5e_chip()
    x = jax.ShapeDtypeStruct((65536, 128), jnp.float32,
                             sharding=sharding.batch_sharding(mesh, 65536, 2))
    with jax.set_mesh(mesh), pytest.raises(jax.errors.JaxRuntimeError) as caught:
        jax.jit(lambda x: jnp.sort(x @ x.T, axis=0)[:8]).lower(x).compile()
    what, need = aot.out_of_hbm(caught.value)
    assert need >= 16 * 2 ** 30, (what, need)
