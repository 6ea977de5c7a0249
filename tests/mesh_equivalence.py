"""Run by tests/test_sharding.py in a subprocess with 8 fake CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.mesh_equivalence OUT.npz

A tiny model's forward pass, one sampler turn and one PPO update (actor + critic) on one device
and on the meshes (data, fsdp, tensor) = (8,1,1), (2,4,1), (2,2,2), each from the same inputs;
then a checkpoint saved from the (2,4,1) run is restored onto one device and continued. Every
result goes into one .npz (prefixed by the run's name) for the test to compare; the placement
of a few weights and of the batch is recorded as strings.
"""

import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from starpo import checkpoint
from starpo import model as M
from starpo import run_config as RC
from starpo import sampler as S
from starpo import sharding
from starpo import update as UP
from tests.test_update import GROUP_SIZE, MAX_TURN, random_params, synthetic_trajectory

FAST = {"xla_backend_optimization_level": 0}
# every sharded dim divides its mesh axes on all three meshes: heads 4 and kv heads 2 on
# tensor <= 2, width 32 on fsdp <= 4, 8 rows on data x fsdp = 8
CFG = M.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, intermediate_size=64)
CRITIC = CFG.replace(value_head=True)
# keep half the groups (a gather of sharded rows), one mini-batch of 4 rows in one micro-batch;
# the rollout's budget (3 turns of 3 tokens) puts the head at the reply tokens and packs the
# rows into shared sequences in the PPO loss (`update.pack_rows`: a gather across shards)
ALGO = RC.AlgoConfig(adv_estimator="gae", group_size=GROUP_SIZE, rollout_filter_ratio=0.5,
                     ppo_mini_batch_size=4, micro_batch_size=4, online_k=1, actor_lr=1e-2,
                     critic_lr=1e-2, max_turn=MAX_TURN, response_length=3)
MESHES = {"8x1x1": (8, 1, 1), "2x4x1": (2, 4, 1), "2x2x2": (2, 2, 2)}
B, T, CTX, CHUNK = 8, 16, 32, 6


def inputs():
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, CFG.vocab_size, (B, T)).astype(np.int32)
    valid = np.arange(T)[None, :] < rng.integers(4, T + 1, B)[:, None]
    chunk = rng.integers(3, CFG.vocab_size, (B, CHUNK)).astype(np.int32)
    chunk_valid = np.arange(CHUNK)[None, :] < rng.integers(1, CHUNK + 1, B)[:, None]
    return tokens, valid, chunk, chunk_valid


def flat(tree):
    return np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])


def spec_string(sharding) -> str:
    """`P(...)` of a sharding's spec on every jax version (jax 0.7's repr says PartitionSpec)."""
    spec = getattr(sharding, "spec", None)
    return "single" if spec is None else "P" + repr(tuple(spec))


def shard_strings(tree, names):
    flat = dict(jax.tree_util.tree_flatten_with_path(tree)[0])
    out = {}
    for path, x in flat.items():
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        if name in names:
            out[name] = [spec_string(x.sharding),
                         list(x.addressable_shards[0].data.shape)]
    return out


WATCH = ("actor_params.layers.mlp.gate.kernel", "actor_params.layers.attn.q.kernel",
         "actor_params.embed.embedding", "actor_opt_state.1.0.mu.layers.mlp.down.kernel",
         "critic_params.value_head.kernel")


def run(name, mesh, results, placements, ckpt_dir=None):
    tokens, valid, chunk, chunk_valid = inputs()
    actor, critic = random_params(CFG, 0), random_params(CRITIC, 1)
    traj = synthetic_trajectory(0)
    if mesh is not None:
        actor = sharding.put(actor, M.param_shardings(CFG, mesh))
        traj = sharding.put(traj, sharding.batch_shardings(traj, mesh))
        tokens, valid = sharding.put((tokens, valid), sharding.batch_shardings((tokens, valid), mesh))
        chunk, chunk_valid = sharding.put((chunk, chunk_valid),
                                          sharding.batch_shardings((chunk, chunk_valid), mesh))
    logits = jax.jit(lambda p, t, v: M.forward(p, CFG, t, v)[0], compiler_options=FAST)(
        actor, tokens, valid)
    results[f"{name}/logits"] = np.asarray(logits)

    smp = S.make_sampler(CFG, type("Tok", (), {"eos_ids": (5,), "pad_id": 0}), max_new_tokens=8)
    state = jax.jit(lambda: S.init_state(CFG, B, CTX), compiler_options=FAST)()
    placements[f"{name}/cache.k"] = spec_string(state.cache.k.sharding)
    state, turn = smp.turn(actor, state, chunk, chunk_valid, jax.random.key(3), 1.0,
                           jnp.ones(B, bool))
    for field in ("tokens", "logprobs", "length", "stop_reason"):
        results[f"{name}/turn.{field}"] = np.asarray(getattr(turn, field))
    results[f"{name}/cache.k"] = np.asarray(state.cache.k)

    shardings = None if mesh is None else UP.state_shardings(ALGO, mesh, CFG, CRITIC)
    init = jax.jit(lambda a, c: UP.init_train_state(ALGO, a, c), out_shardings=shardings)
    tstate = init(actor, critic)
    update = UP.make_update(ALGO, CFG, CRITIC, compiler_options=FAST,
                            state_shardings=shardings, mesh=mesh)
    tstate, metrics = update(tstate, traj, jax.random.key(1))
    placements.update({f"{name}/{k}": v for k, v in shard_strings(tstate, WATCH).items()})
    results.update({f"{name}/metrics/{k}": np.asarray(v) for k, v in metrics.items()})
    if ckpt_dir is not None:
        ckpt = checkpoint.Checkpointer(ckpt_dir)
        ckpt.save(1, tstate, {"step": 1})
        ckpt.close()
    tstate, metrics = update(tstate, traj, jax.random.key(2))
    results[f"{name}/update2.actor"] = flat(tstate.actor_params)
    results[f"{name}/update2.critic"] = flat(tstate.critic_params)
    return update


def resume_on_one_device(ckpt_dir, results):
    """The (2,4,1) checkpoint restored onto the default device, then the second update."""
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(lambda a, c: UP.init_train_state(ALGO, a, c),
                              M.abstract_params(CFG), M.abstract_params(CRITIC))
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), abstract)
    ckpt = checkpoint.Checkpointer(ckpt_dir, read_only=True)
    tstate, _ = ckpt.restore(1, target)
    ckpt.close()
    results["resumed/devices"] = np.asarray(
        sorted({d.id for x in jax.tree_util.tree_leaves(tstate) for d in x.devices()}))
    update = UP.make_update(ALGO, CFG, CRITIC, compiler_options=FAST)
    tstate, _ = update(tstate, synthetic_trajectory(0), jax.random.key(2))
    results["resumed/update2.actor"] = flat(tstate.actor_params)
    results["resumed/update2.critic"] = flat(tstate.critic_params)


def main(out_path):
    assert jax.device_count() == 8, jax.devices()
    results, placements = {}, {}
    run("single", None, results, placements)
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in MESHES.items():
            mesh = sharding.make_mesh(*shape)
            with jax.set_mesh(mesh):
                run(name, mesh, results, placements,
                    ckpt_dir=f"{tmp}/ckpt" if name == "2x4x1" else None)
        resume_on_one_device(f"{tmp}/ckpt", results)
    np.savez(out_path, **results)
    print(json.dumps(placements))


if __name__ == "__main__":
    main(sys.argv[1])
