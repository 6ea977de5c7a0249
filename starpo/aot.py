"""Every program of a run compiled ahead of time for a TPU topology, on this machine (no TPU).

    rows = aot.compile_run(config, cfg, topology="v5e:2x2")   # one `Compiled` a program
    print(aot.table(rows))

libtpu (`requirements-tpu.txt`) compiles for a topology that is only described: the chips, their
hosts and their links, as one process of a pod would see them. The run's mesh is laid over those
devices (processes included), the weights are shapes with their shardings (nothing is loaded or
allocated), and each program a run executes is lowered with the run's own shapes and compiled:
a rollout chunk (prefill, decode and env steps, one program), each validation set's chunk where
it has a program of its own, the update (old log-probs, values, advantages, the PPO and critic
steps: one program) and an SFT step. XLA's memory analysis gives each program's bytes per chip,
set beside the memory plan's figure for the phase and the chip's HBM; the TPU cost model's
`optimal_seconds`, where it gives one, is the compiler's estimate of a step, never a measured
time. What a compile does not show: the speed on hardware, and the numbers a TPU computes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp

from starpo import experiment as experiment_lib
from starpo import harness, lora, precision, rollout as rollout_lib, run_config, sharding
from starpo import model as model_lib
from starpo import sft as sft_lib
from starpo import update as update_lib

GIB = 2 ** 30
INSTALL = "pip install -r requirements-tpu.txt"
# a program fits where it needs at most this share of a chip's HBM: the TPU runtime keeps some
# for itself, and a program's buffers are not packed without gaps
FIT_SHARE = 0.9


@dataclasses.dataclass(frozen=True)
class Generation:
    kind: str  # the device_kind libtpu gives its chips
    hbm_gib: int  # HBM per chip
    megacore: bool  # two TensorCores a chip, one device (v4, v5p)
    dims: int  # the topology's dimensions (2-D torus or 3-D)


# the TPU generations a topology may name: "v5e:2x2" is a v5e slice of 2 x 2 chips
GENERATIONS = {
    "v4": Generation("TPU v4", 32, True, 3),
    "v5e": Generation("TPU v5 lite", 16, False, 2),
    "v5p": Generation("TPU v5", 95, True, 3),
    "v6e": Generation("TPU v6 lite", 32, False, 2),
}


class TopologyError(ValueError):
    """A topology that cannot be compiled for; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # e.g. "v5e:2x2"
    generation: str
    chips: tuple  # chips along each dimension
    devices: tuple  # libtpu's compile-only devices, one a chip
    processes: int  # hosts of the slice (one JAX process each)

    @property
    def hbm_bytes(self) -> int:
        return GENERATIONS[self.generation].hbm_gib * GIB


def parse(name: str) -> tuple[str, tuple[int, ...]]:
    """("v5e", (2, 2)) of "v5e:2x2"; TopologyError naming what is wrong."""
    m = re.fullmatch(r"(v\d[a-z]?):(\d+(?:x\d+)*)", name.strip())
    if not m or m.group(1) not in GENERATIONS:
        raise TopologyError(f"unknown TPU topology {name!r}: write GENERATION:CHIPS, e.g. "
                            f"v5e:2x2 (generations: {', '.join(GENERATIONS)})")
    gen, chips = m.group(1), tuple(int(c) for c in m.group(2).split("x"))
    if len(chips) != GENERATIONS[gen].dims or min(chips) < 1:
        want = "x".join(["N"] * GENERATIONS[gen].dims)
        raise TopologyError(f"TPU topology {name!r}: {gen} slices are {want} chips, "
                            f"e.g. {gen}:{'x'.join(['2'] * GENERATIONS[gen].dims)}")
    return gen, chips


def host_bounds(chips: tuple[int, ...]) -> tuple[int, int, int]:
    """The chips of one host along each dimension: 2 x 2 (four chips a host) where the slice
    has them, fewer in a smaller slice (v5e-1, v5e-2)."""
    c = tuple(chips) + (1,) * (3 - len(chips))
    return (min(c[0], 2), min(c[1], 2), 1)


def libtpu_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return "none"


def check_libtpu() -> None:
    if importlib.util.find_spec("libtpu") is None:
        raise TopologyError(f"compiling for a TPU topology needs libtpu: {INSTALL} "
                            "(jax[tpu] at the suite's jax version)")


def topology(name: str) -> Topology:
    """The compile-only devices of TPU topology `name` (libtpu's description of the slice:
    one device a chip, its host's process index), without any TPU."""
    gen, chips = parse(name)
    check_libtpu()
    from jax.experimental import topologies

    g = GENERATIONS[gen]
    # a full torus wraps around where every dimension is 4 or more (v4-128, v5p-128 and up)
    wrap = (len(chips) == 3 and min(chips) >= 4,) * 3
    try:
        desc = topologies.get_topology_desc(
            topology_name=name.strip(), platform="tpu",
            chip_config_name="megacore" if g.megacore else "default",
            chips_per_host_bounds=host_bounds(chips), wrap=wrap)
    except Exception as e:  # libtpu's own words, on one line
        raise TopologyError(f"libtpu cannot describe TPU topology {name!r}: "
                            f"{str(e).splitlines()[0]}") from None
    devices = tuple(desc.devices)
    return Topology(name.strip(), gen, chips, devices,
                    len({d.process_index for d in devices}))


# ----------------------------------------------------------------------------- the programs
@dataclasses.dataclass(frozen=True)
class Compiled:
    """One program compiled for the topology, with XLA's accounting per chip."""

    phase: str  # rollout, validation <tag>, update, sft
    plan_phase: str  # the memory plan's phase it is set beside
    compile_s: float
    # the phase's bytes per chip: the program's peak of live buffers plus its code
    # (`chip_bytes`), plus what stays resident beside it and is not among its
    # arguments (the sampling phases: the TrainState beyond the actor weights they take)
    bytes: int
    plan_bytes: float
    hbm_bytes: int
    optimal_s: float | None  # the TPU cost model's estimate (None where it gives none)
    flops: float | None
    parts: tuple = ()  # ((what, bytes per chip), ...): XLA's memory analysis and the state
    # XLA's own refusal where the program does not fit at all ("" where it compiled); `bytes`
    # is then what XLA said the temporaries alone need
    refused: str = ""

    @property
    def fits(self) -> bool:
        return not self.refused and self.bytes <= FIT_SHARE * self.hbm_bytes

    @property
    def plan_ratio(self) -> float:
        return self.plan_bytes / self.bytes if self.bytes else float("nan")


# XLA's words where a program's buffers cannot fit a chip's HBM at all (it then compiles nothing)
_OUT_OF_HBM = re.compile(r"RESOURCE_EXHAUSTED: .*?required for (.+?) \(([\d.]+)([KMGT])\) "
                         r"exceeds available HBM \(([\d.]+)([KMGT])\)")
_UNITS = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def out_of_hbm(error: Exception) -> tuple[str, int] | None:
    """(what XLA says does not fit, the bytes it needs) where compiling failed for want of HBM
    (XLA's RESOURCE_EXHAUSTED), else None."""
    m = _OUT_OF_HBM.search(str(error))
    if m is None:
        return None
    what, need, unit, have, have_unit = m.groups()
    return (f"{what} need {need}{unit}iB, the chip has {have}{have_unit}iB",
            int(float(need) * _UNITS[unit]))


def chip_parts(compiled) -> tuple:
    """((what, bytes), ...) of XLA's memory analysis of a compiled program, per chip: its
    arguments, outputs, temporaries and generated code, the outputs that reuse donated
    arguments, and the peak of its buffers live at once (0 where the backend gives none)."""
    m = compiled.memory_analysis()
    return (("arguments", int(m.argument_size_in_bytes)),
            ("outputs", int(m.output_size_in_bytes)),
            ("temporaries", int(m.temp_size_in_bytes)),
            ("code", int(m.generated_code_size_in_bytes)),
            ("aliased", -int(m.alias_size_in_bytes)),
            ("peak", int(getattr(m, "peak_memory_in_bytes", 0) or 0)))


def chip_bytes(compiled) -> int:
    """The bytes a compiled program holds on each chip (`held_bytes` of its `chip_parts`)."""
    return held_bytes(chip_parts(compiled))


def held_bytes(parts) -> int:
    """Of `chip_parts`: the peak of the buffers live at once (arguments and outputs among
    them) plus the code; where the backend reports no peak, the sum of arguments, outputs,
    temporaries and code less the aliased outputs. On a TPU the temporaries are no measure:
    they count more than the buffer heap (`tests/test_aot.py`'s scan over a 128 MiB cache:
    384 MiB of temporaries beside 136 MiB of arguments, a 392 MiB peak)."""
    parts = dict(parts)
    if parts["peak"] > 0:
        return parts["peak"] + parts["code"]
    return sum(b for what, b in parts.items() if what != "peak")


def per_chip(tree) -> int:
    """Bytes per chip of a tree of placed ShapeDtypeStructs (the largest shard of each)."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * x.dtype.itemsize
    return int(total)


def _cost(compiled) -> tuple[float | None, float | None]:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # some backends give none
        return None, None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    seconds = cost.get("optimal_seconds")
    return (float(seconds) if seconds is not None and seconds > 0 else None,
            float(cost["flops"]) if "flops" in cost else None)


def _placed(tree, shardings):
    """ShapeDtypeStructs of `tree`'s leaves with `shardings` (a matching tree or one)."""
    if not isinstance(shardings, jax.sharding.Sharding):
        return jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)


def _rows(tree, rows: int, mesh):
    """`tree` (of [B, ...] leaves) as `rows` rows split over the mesh's batch axes."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((rows,) + x.shape[1:], x.dtype,
                                       sharding=sharding.batch_sharding(mesh, rows, x.ndim)),
        tree)


def abstract_policy(config, cfg: model_lib.ModelConfig, tokenizer, mesh):
    """A `weights.LoadedModel` of `cfg`'s shape for `config` (its dtypes and kernels, LoRA
    adapters where on) whose weights are shapes placed on `mesh`: nothing is allocated."""
    from starpo import weights

    m = config.model
    cfg = cfg.replace(dtype=run_config.model_dtype(config), remat=m.remat,
                      remat_policy=m.remat_policy, attention=m.attention,
                      decode_attention=m.decode_attention)
    params = model_lib.abstract_params(cfg)
    settings = run_config.lora_settings(config)
    if settings is not None:
        holder = {}

        def attach(p):
            holder["cfg"], out = lora.attach(
                cfg, p, **settings, key=jax.random.key(0),
                base_dtype=precision.phase_dtypes(config)["update"])
            return out

        params = jax.eval_shape(attach, params)
        cfg = holder["cfg"]
    params = _placed(params, model_lib.param_shardings(cfg, mesh))
    return weights.LoadedModel(cfg, params, tokenizer, f"shape of {cfg.num_params / 1e6:.0f}M")


def _abstract_critic(config, policy):
    """(critic cfg, its weights as shapes): the actor's value-head copy."""
    holder = {}

    def make(p):
        holder["cfg"], out = experiment_lib.critic_params_from(
            config, dataclasses.replace(policy, params=p))
        return out

    params = jax.eval_shape(make, jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), policy.params))
    return holder["cfg"], params


def compile_run(config, cfg: model_lib.ModelConfig, tokenizer, topo: Topology, *,
                sft: bool = True, log=lambda line: None) -> list[Compiled]:
    """Each program of `config`'s run with a model of `cfg`'s shape (its tokenizer's text
    tables), compiled for `topo`: one `Compiled` a program, in the order a run executes them.
    The backend's choices (dtypes, kernels) are a TPU's. Raises ValueError (one line) where the
    mesh does not divide the chips."""
    with precision.target("tpu"):
        run = run_config.read(config)
        mesh = sharding.make_mesh(*run.mesh, devices=topo.devices)
        policy = abstract_policy(config, cfg, tokenizer, mesh)
        model_lib.check_kernels(policy.cfg.replace(dtype=run.model.dtypes["update"]))
        options = experiment_lib.compiler_options(run)
        algo = run.algo
        rows_out, programs = [], []
        # built off the mesh (their constants live on this host), lowered on it
        _, ro, initial_states, run_chunk, _ = experiment_lib._training_rollout(
            run, policy, mesh, options)
        key, temp = jax.random.key(0), jnp.float32(1.0)
        env_state, group_id = jax.eval_shape(initial_states, key, jnp.int32(0))
        chunk = run.batch.chunk
        chunk_args = (policy.params, key, *_rows((env_state, group_id), chunk, mesh), temp)
        programs.append(("rollout", "rollout", run_chunk, chunk_args))
        # the whole batch's trajectory, as the update receives it
        traj, _ = jax.eval_shape(run_chunk, *chunk_args)
        traj = _rows(traj, run.batch.episodes, mesh)

        val_rollouts = {}
        v = run.val.batch
        for tag in run.val.tags:
            if experiment_lib._plays_on_training_program(run, tag):
                val_rollouts[tag] = ro
                continue  # the rollout's own program
            env = run.envs[tag] if tag in run.envs else run_config.make_env(config, tag)
            vchunk = rollout_lib.chunk_size(v.env_groups * v.group_size, v.chunk,
                                            v.group_size)
            vro = rollout_lib.make_rollout(env, tokenizer, policy.cfg, run.rollout,
                                           env_groups=vchunk // v.group_size,
                                           group_size=v.group_size)
            val_rollouts[tag] = vro
            states = jax.eval_shape(
                lambda k, s, env=env: rollout_lib.initial_states(
                    env, k, s, rollout_lib.VALIDATION, v.env_groups, v.group_size),
                key, jnp.int32(0))
            programs.append((f"validation {tag}", "validation",
                             jax.jit(vro.play_from, compiler_options=options),
                             (policy.params, key, *_rows(states, vchunk, mesh), temp)))

        critic_cfg, critic_params = (_abstract_critic(config, policy) if algo.uses_critic
                                     else (None, None))
        shardings = update_lib.state_shardings(algo, mesh, policy.cfg, critic_cfg)
        update = update_lib.make_update(
            algo, policy.cfg.replace(dtype=run.model.dtypes["update"]), critic_cfg,
            compiler_options=options, state_shardings=shardings, mesh=mesh)
        state = _placed(jax.eval_shape(
            lambda a, c: update_lib.init_train_state(algo, a, c),
            jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                   policy.params), critic_params), shardings)
        update_args = (state, traj, key)
        if algo.uses_reference:
            update_args += (policy.params,)
        programs.append(("update", "update", update, update_args))
        # the sampling phases run with the state resident (but for what
        # `trainer.offload_state` moves to host memory), of which they take the actor
        # weights as an argument
        resident = per_chip(state) - per_chip(state.actor_params)
        if run.trainer.offload_state:
            resident -= per_chip((state.actor_opt_state, state.critic_params,
                                  state.critic_opt_state))
        if sft and run.sft.steps > 0:
            programs.append(_sft_program(run, policy, run.envs[config.env.name], mesh))

        exp = SimpleNamespace(run=run, policy=policy, mesh=mesh, rollout=ro, val_sets={
            tag: SimpleNamespace(rollout=r) for tag, r in val_rollouts.items()})
        planned = {p.name: p.total for p in harness.plan_phases(exp)}
        if any(name == "sft" for name, *_ in programs):
            planned["sft"] = {p.name: p.total for p in harness.plan_phases(
                exp, sft=True)}["SFT update"]
        for name, plan_phase, program, args in programs:
            log(f"compiling {name} for {topo.name} ...")
            t0 = time.perf_counter()
            try:
                with jax.set_mesh(mesh):
                    compiled = program.lower(*args).compile()
            except jax.errors.JaxRuntimeError as e:
                refused = out_of_hbm(e)
                if refused is None:
                    raise
                # XLA compiles nothing: the row says so, and the other programs go on
                rows_out.append(Compiled(name, plan_phase, time.perf_counter() - t0, refused[1],
                                         planned.get(plan_phase, float("nan")), topo.hbm_bytes,
                                         None, None, refused=refused[0]))
                continue
            seconds = time.perf_counter() - t0
            optimal, flops = _cost(compiled)
            parts = chip_parts(compiled)
            held = held_bytes(parts)
            if plan_phase in ("rollout", "validation"):
                parts += (("resident state beyond the actor weights", resident),)
                held += resident
            rows_out.append(Compiled(name, plan_phase, seconds, held,
                                     planned.get(plan_phase, float("nan")),
                                     topo.hbm_bytes, optimal, flops, parts))
        return rows_out


def _sft_program(run, policy, env, mesh):
    """("sft", ...): one SFT step on `sft.env_groups` demonstrations as the solver plays them
    (the rows at the run's whole context, the longest an SFT step trains)."""
    from starpo import demos

    algo = run.sft.algo
    cfg = policy.cfg.replace(dtype=run.model.dtypes["update"])
    shardings = update_lib.state_shardings(algo, mesh, policy.cfg)
    state = _placed(jax.eval_shape(
        lambda a: update_lib.init_train_state(algo, a, None),
        jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                               policy.params)), shardings)
    demo = demos.make_demo_rollout(env, policy.tokenizer, run.rollout, run.sft.actions_per_turn)
    G = run.sft.env_groups

    def step_demos(key):
        env_state, _ = rollout_lib.initial_states(env, key, 0, rollout_lib.TRAIN, G, 1)
        return demo(env_state, key)[0]

    traj = _rows(jax.eval_shape(step_demos, jax.random.key(0)), G, mesh)
    weight = _rows(jax.ShapeDtypeStruct((G,), jnp.float32), G, mesh)
    # where the output head runs: every reply token a row can hold (`update.reply_count` of
    # the longest reply a run allows)
    T = traj.tokens.shape[1]
    replies = run.rollout.max_turn * run.rollout.max_new_tokens
    size = min(T, max(8, 1 << max(replies - 1, 0).bit_length()))
    positions = _rows(jax.ShapeDtypeStruct((G, size), jnp.int32), G, mesh)
    return ("sft", "sft", sft_lib.make_step(algo, cfg), (state, traj, weight, positions))


def as_json(r: Compiled) -> dict:
    return {"program": r.phase, "compile_s": round(r.compile_s, 2),
            "xla_gib_per_chip": round(r.bytes / GIB, 4),
            "plan_gib_per_chip": round(r.plan_bytes / GIB, 4),
            "plan_over_xla": round(r.plan_ratio, 3), "hbm_gib": r.hbm_bytes / GIB,
            "fits": r.fits, "compiler_estimate_s": r.optimal_s, "flops": r.flops,
            "parts_gib": {what: round(b / GIB, 4) for what, b in r.parts},
            **({"xla_refused": r.refused} if r.refused else {})}


def config_tokenizer(config):
    """The tokenizer a run of `config` would load (its text tables set the programs' shapes),
    without the weights: a tiny model's in-process one, a Hugging Face directory's, the
    embedded model's (fetched once, as a run does), a `random:` model's stand-in."""
    from starpo import weights
    from starpo.tokenizer import Tokenizer

    path = config.model.path
    kind = weights.model_kind(path)
    if kind == "tiny":
        corpus, kwargs = run_config.tiny_tokenizer_args(config)
        return weights.load_model(path, tiny_corpus=corpus, tiny_tokenizer=kwargs).tokenizer
    if kind == "embedded":
        return Tokenizer.from_hf_dir(weights.converted_dir(path))
    if kind == "hf":
        return Tokenizer.from_hf_dir(path)
    if kind == "random":
        return Tokenizer.tiny()
    return weights.load_model(path).tokenizer  # a GGUF file: its vocabulary is inside


def table(rows: list[Compiled], topo: Topology) -> str:
    """A Markdown table of `rows`: a line a program."""
    head = (f"| program ({topo.name}: {len(topo.devices)} chips, {topo.processes} "
            f"process{'es' if topo.processes > 1 else ''}) | compile s | XLA GiB per chip | "
            f"plan GiB | plan / XLA | HBM GiB | fits | compiler's estimate s |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        est = f"{r.optimal_s:.3g}" if r.optimal_s is not None else "none"
        xla = f"> {r.bytes / GIB:.2f} (XLA: {r.refused})" if r.refused else f"{r.bytes / GIB:.2f}"
        lines.append(f"| {r.phase} | {r.compile_s:.1f} | {xla} | "
                     f"{r.plan_bytes / GIB:.2f} | {r.plan_ratio:.2f} | {r.hbm_bytes / GIB:.0f} | "
                     f"{'yes' if r.fits else 'NO'} | {est} |")
    return "\n".join(lines)
