"""Device meshes and the one table that maps logical axes onto them.

The mesh has three axes, sized by the config (`mesh.data`, `mesh.fsdp`, `mesh.tensor`; -1 = all
devices the others leave):

    data    batch rows (episodes) only; weights are replicated across it
    fsdp    batch rows too, and weights / optimiser states are split along their model width
            (`embed`) across it: ZeRO-3 style, each layer's weights are gathered when used
    tensor  attention heads, MLP width and vocabulary split across it (Megatron style)

The model names the logical axes of every weight (`model.logical_axes`) and of its activations
(`constrain` calls); `RULES` below is the only place they meet mesh axes. A dimension that a
rule would shard but whose size does not divide the mesh axes is sharded over the longest
prefix of those axes that divides it, else replicated: e.g. Qwen2.5-0.5B's 14 query heads and 2
kv heads on `tensor=4` are replicated (its MLP width 4864 and vocabulary are still split), and a
micro-batch of 4 rows on data x fsdp = 2 x 4 is split over `data` only. `describe` lists every
such case so a run can print it.

Under a mesh context (`jax.set_mesh(mesh)`, which `training` enters) `constrain` pins
activations (batch rows on data x fsdp); without one, or on a single device, it does nothing, so
the same code runs unchanged on a laptop.

Multi-host (TPU pod slices, SLURM / GPU clusters): `initialize_distributed` calls
`jax.distributed.initialize()` when the environment says several processes take part or the
config names them (`mesh.coordinator_address`, `mesh.num_processes`, `mesh.process_id`). Every
process runs the same program over the global mesh; nothing is fed from the host: levels are
generated on device from seeds inside the jitted rollout, so each device produces exactly its own
rows. `to_host` brings (small) results back to every process. Faults: `processes_flagging`
lets every process stop at the same step when any one got SIGTERM (training's loop), and
`Liveness` stops all of them with a one-line error when one dies or hangs.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axes (a tuple shards over their product, in order; None replicates)
RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),  # episodes / rows of every batch
    ("embed", "fsdp"),  # model width of weights: FSDP
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("lora", None),  # the rank of LoRA adapters (small: replicated)
    ("layers", None),
    ("length", None),  # tokens of a sequence / cache slots
    ("act_embed", None),  # model width of activations (the residual stream is not split)
)
_RULES = dict(RULES)


# ----------------------------------------------------------------------------- meshes
def mesh_shape(data: int = 1, fsdp: int = -1, tensor: int = 1,
               num_devices: int | None = None) -> tuple[int, int, int]:
    """(data, fsdp, tensor) with one -1 resolved to the devices the others leave."""
    n = jax.device_count() if num_devices is None else num_devices
    sizes = [int(data), int(fsdp), int(tensor)]
    free = [i for i, s in enumerate(sizes) if s == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got data={data}, fsdp={fsdp}, "
                         f"tensor={tensor}")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh: axis sizes must be >= 1 or -1, got data={data}, fsdp={fsdp}, "
                         f"tensor={tensor}")
    fixed = math.prod(s for s in sizes if s != -1)
    if free:
        if n % fixed:
            raise ValueError(f"mesh: {n} devices are not divisible by the fixed axes' "
                             f"product {fixed} (data={data}, fsdp={fsdp}, tensor={tensor})")
        sizes[free[0]] = n // fixed
    if math.prod(sizes) != n:
        raise ValueError(f"mesh: data x fsdp x tensor = {sizes[0]} x {sizes[1]} x {sizes[2]} = "
                         f"{math.prod(sizes)} devices, but {n} are available")
    return tuple(sizes)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh over `devices` (default: all, every host's).

    Axes are `Auto`: the compiler propagates shardings from the inputs, the outputs and the
    `constrain` hints (no sharding-in-types)."""
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(data, fsdp, tensor, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def mesh_from_config(mesh_config) -> Mesh:
    """The mesh of a config's `mesh` section (data, fsdp, tensor)."""
    return make_mesh(mesh_config.data, mesh_config.fsdp, mesh_config.tensor)


# ----------------------------------------------------------------------------- logical -> mesh
def _axis_sizes(mesh) -> dict[str, int]:
    return dict(mesh.shape)


def _rule_axes(name) -> tuple[str, ...]:
    """The mesh axes the rules give a logical axis (None: unnamed, replicated)."""
    if name is None:
        return ()
    if name not in _RULES:
        raise KeyError(f"no sharding rule for logical axis {name!r} (rules: {list(_RULES)})")
    axes = _RULES[name]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def spec(logical, shape, mesh) -> P:
    """PartitionSpec of an array of `shape` whose dims have logical names `logical`.

    A rule's mesh axes that are already used by an earlier dim, or have size 1, are skipped;
    of the rest the longest prefix whose size divides the dim is used (else replicated).
    """
    sizes = _axis_sizes(mesh)
    used, out = set(), []
    for name, dim in zip(tuple(logical), shape):
        axes = tuple(a for a in _rule_axes(name) if a in sizes and sizes[a] > 1 and a not in used)
        while axes and dim % math.prod(sizes[a] for a in axes):
            axes = axes[:-1]
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _wanted(logical, mesh) -> list[tuple[str, int]]:
    """(logical name, mesh size) of dims a rule would split, ignoring divisibility."""
    sizes = _axis_sizes(mesh)
    return [(name, math.prod(sizes.get(a, 1) for a in _rule_axes(name)))
            for name in tuple(logical)]


def _is_spec(x) -> bool:
    return isinstance(x, P)


def tree_shardings(logical_tree, abstract_tree, mesh):
    """NamedShardings for a pytree of arrays, given a matching tree of logical PartitionSpecs
    (e.g. `model.logical_axes(cfg)` with `model.abstract_params(cfg)`)."""
    return jax.tree_util.tree_map(
        lambda names, x: NamedSharding(mesh, spec(names, x.shape, mesh)),
        logical_tree, abstract_tree, is_leaf=_is_spec)


def describe(logical_tree, abstract_tree, mesh) -> list[str]:
    """One line per weight dim that its rule would shard but that stays (partly) replicated
    because its size does not divide the mesh axes."""
    lines = []

    def one(path, names, x):
        got = spec(names, x.shape, mesh)
        sizes = _axis_sizes(mesh)
        for d, ((name, want), dim) in enumerate(zip(_wanted(names, mesh), x.shape)):
            have = got[d] if d < len(got) else None
            have = () if have is None else (have,) if isinstance(have, str) else have
            n = math.prod(sizes[a] for a in have)
            if want > 1 and n < want:
                where = jax.tree_util.keystr(path, simple=True, separator=".")
                lines.append(f"{where}: {name}={dim} is not divisible by {want} devices "
                             f"({'replicated' if n == 1 else f'split {n} ways'})")

    jax.tree_util.tree_map_with_path(one, logical_tree, abstract_tree, is_leaf=_is_spec)
    return lines


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh, rows: int, ndim: int = 1) -> NamedSharding:
    """Rows of a [rows, ...] array on data x fsdp (or the prefix of them that divides rows)."""
    return NamedSharding(mesh, spec(("batch",) + (None,) * (ndim - 1), (rows,) + (1,) * (ndim - 1),
                                    mesh))


def batch_shardings(tree, mesh):
    """Per-leaf batch shardings of a pytree of [B, ...] arrays (scalars replicated)."""
    def one(x):
        if not np.shape(x):
            return replicated(mesh)
        return batch_sharding(mesh, np.shape(x)[0], len(np.shape(x)))
    return jax.tree_util.tree_map(one, tree)


def optimizer_shardings(tx, abstract_opt_state, param_sharding_tree, mesh):
    """Shardings of an optax state: moments like their parameters, counters replicated."""
    import optax

    return optax.tree_map_params(
        tx, lambda _, s: s, abstract_opt_state, param_sharding_tree,
        transform_non_params=lambda _: replicated(mesh),
        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


# ----------------------------------------------------------------------------- placing data
def put(tree, shardings):
    """Arrays (numpy or jax) placed with the given shardings. Each device receives only its
    slice, built from the host copy by index (also on a multi-host mesh, where every process
    holds the same full host copy, e.g. weights read from disk)."""
    def one(x, s):
        if isinstance(x, jax.Array) and getattr(x, "is_fully_addressable", True):
            return jax.device_put(x, s)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])
    return jax.tree_util.tree_map(one, tree, shardings)


def constrain(x, logical):
    """Pin an activation's sharding by logical axis names (a no-op without a mesh context or
    on one device). Use inside jitted code."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, spec(logical, x.shape, mesh))


def to_host(tree):
    """numpy copies of (small) arrays on every process, gathered across hosts when needed.

    Only arrays spread over several processes are gathered: `process_allgather` would
    concatenate every process's copy of one that each process holds whole (a numpy array, an
    array on one local device), e.g. doubling a sum over its rows on 2 processes."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    spread = [i for i, x in enumerate(leaves)
              if isinstance(x, jax.Array) and not x.is_fully_addressable]
    out = [None if i in spread else jax.device_get(x) for i, x in enumerate(leaves)]
    if spread:
        gathered = multihost_utils.process_allgather([leaves[i] for i in spread], tiled=True)
        for i, x in zip(spread, gathered):
            out[i] = x
    return jax.tree_util.tree_unflatten(treedef, out)


# ----------------------------------------------------------------------------- multi-host
# Environment variables by which a cluster launcher announces several processes; with any of
# them `jax.distributed.initialize()` finds the coordinator, process count and id itself.
# JAX has no public probe for its own detection: `jax._src.clusters` is private, and its
# Cloud TPU check queries the VM's metadata server over the network (a mere import on a
# laptop would wait on it), so "auto" looks at these variables only (no I/O).
_CLUSTER_HINTS = (
    ("JAX_COORDINATOR_ADDRESS", None),  # explicit (with JAX_NUM_PROCESSES, JAX_PROCESS_ID)
    ("TPU_WORKER_HOSTNAMES", ","),  # Cloud TPU pod slice: one name per host
    ("MEGASCALE_COORDINATOR_ADDRESS", None),  # multi-slice TPU
    ("SLURM_NTASKS", "int"),  # SLURM: srun with several tasks
    ("OMPI_COMM_WORLD_SIZE", "int"),  # Open MPI (mpirun)
)


def multi_process_environment(environ=None) -> bool:
    """Whether the environment announces a multi-process launch."""
    environ = os.environ if environ is None else environ
    for name, kind in _CLUSTER_HINTS:
        value = environ.get(name, "").strip()
        if not value:
            continue
        if kind == ",":
            if len([h for h in value.split(",") if h.strip()]) > 1:
                return True
        elif kind == "int":
            if value.isdigit() and int(value) > 1:
                return True
        else:
            return True
    return False


def explicit_cluster(coordinator_address: str = "", num_processes: int = 0,
                     process_id: int = -1) -> bool:
    """Whether the config names the processes itself (`mesh.coordinator_address`,
    `mesh.num_processes`, `mesh.process_id`; "", 0 and -1 leave them to JAX's detection)."""
    return bool(coordinator_address) or num_processes != 0 or process_id != -1


def check_cluster(coordinator_address: str = "", num_processes: int = 0,
                  process_id: int = -1, init_timeout_s: int = 300,
                  heartbeat_timeout_s: int = 60) -> None:
    """Raise ValueError (one line, naming the key) for a process layout that cannot work."""
    if num_processes < 0 or (num_processes == 0) != (process_id == -1):
        raise ValueError(f"mesh.num_processes and mesh.process_id are set together (>= 1 and "
                         f"0 .. num_processes - 1) or neither (0 and -1), got "
                         f"{num_processes} and {process_id}")
    if num_processes and not 0 <= process_id < num_processes:
        raise ValueError(f"mesh.process_id must be in [0, {num_processes - 1}] "
                         f"(mesh.num_processes={num_processes}), got {process_id}")
    if coordinator_address:
        host, sep, port = coordinator_address.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"mesh.coordinator_address must be HOST:PORT, got "
                             f"{coordinator_address!r}")
    if init_timeout_s < 1:
        raise ValueError(f"mesh.init_timeout_s must be >= 1, got {init_timeout_s}")
    if heartbeat_timeout_s < 2:
        raise ValueError(f"mesh.heartbeat_timeout_s must be >= 2, got {heartbeat_timeout_s}")


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Return once a TCP connection to `address` (HOST:PORT) opens; raise ValueError (one line)
    if none does within `timeout_s`. A process other than the coordinator checks this first:
    jax.distributed.initialize aborts the whole process (no Python exception) when the
    coordinator stays unreachable."""
    import socket

    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ValueError(f"mesh.coordinator_address {address} is unreachable after "
                                 f"{timeout_s:g} s ({e.strerror or e})") from None
        time.sleep(0.25)


def initialize_distributed(mode: str = "auto", environ=None, *, coordinator_address: str = "",
                           num_processes: int = 0, process_id: int = -1,
                           init_timeout_s: int = 300, heartbeat_timeout_s: int = 60) -> bool:
    """Call `jax.distributed.initialize()` when launched as several processes.

    mode: "auto" (when the process layout is given, or `multi_process_environment()`), "on"
    (always), "off" (never). The layout left unset ("", 0, -1) is JAX's to detect (TPU pod
    slices, SLURM, Open MPI, GKE). CPU devices talk across processes through gloo, the
    default of `jax_cpu_collectives_implementation` in every supported jax. Must run before
    anything touches a device. Returns whether it initialised; a bad layout or an unreachable
    coordinator raises ValueError (one line). Then `Liveness` watches the other processes
    (`heartbeat_timeout_s`); JAX's own heartbeat check, which aborts the process with a page
    of native log, gets twice as long (plus 10 s) as a backstop."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"mesh.distributed must be auto, on or off, got {mode!r}")
    check_cluster(coordinator_address, num_processes, process_id, init_timeout_s,
                  heartbeat_timeout_s)
    explicit = explicit_cluster(coordinator_address, num_processes, process_id)
    if mode == "off" or (mode == "auto" and not explicit
                         and not multi_process_environment(environ)):
        return False
    if coordinator_address and process_id > 0:
        wait_for_coordinator(coordinator_address, init_timeout_s)
    try:
        jax.distributed.initialize(coordinator_address=coordinator_address or None,
                                   num_processes=num_processes or None,
                                   process_id=None if process_id < 0 else process_id,
                                   initialization_timeout=int(init_timeout_s),
                                   heartbeat_timeout_seconds=int(2 * heartbeat_timeout_s + 10))
    except ValueError as e:  # JAX found no cluster to detect what was left unset from
        if explicit:
            raise
        raise ValueError(f"mesh.distributed={mode}: JAX detected no cluster here ("
                         f"{str(e).strip().splitlines()[0]}); name it with "
                         f"mesh.coordinator_address=HOST:PORT, mesh.num_processes and "
                         f"mesh.process_id, or use mesh.distributed=auto") from None
    if jax.process_count() > 1:
        warm_up_collectives()
        Liveness.start(heartbeat_timeout_s)
    return True


def warm_up_collectives() -> None:
    """One reduction over every device of every process and one all-gather across processes,
    right after joining, while the processes are in step. On CPU, gloo sets up each group of
    devices at its first collective and gives the others a fixed 30 s to arrive (jaxlib 0.7
    and 0.10): processes that compile the first training step at different speeds (a busy
    machine) missed it, seen here. A group set up once is reused by later programs, however
    long a process then waits (measured: 45 s). Covers the group of all devices (a pure-FSDP
    or pure-data mesh) and `processes_flagging`'s; other sub-groups still set up on first use."""
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("all",))
    ones = jax.make_array_from_callback((devices.size,), NamedSharding(mesh, P("all")),
                                        lambda index: np.ones(devices.size, np.int32)[index])
    total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))(ones)
    if int(np.asarray(total.addressable_data(0))) != devices.size:
        raise ValueError(f"a reduction over the {devices.size} devices of "
                         f"{jax.process_count()} processes gave a wrong result")
    processes_flagging(False)



# ----------------------------------------------------------------------------- faults
EXIT_STOPPED = 75  # stopped on SIGTERM / Ctrl-C after saving a checkpoint (EX_TEMPFAIL: rerun)
EXIT_PEER_LOST = 3  # another process of the run died, hung or failed


class Liveness:
    """Every process of a multi-process run watches the others, so that one lost process stops
    all of them with a one-line error instead of leaving them waiting in a collective.

    A daemon thread writes a counter under `starpo/alive/<id>` in JAX's coordination key-value
    store every `timeout_s / 10` seconds and reads everyone's. A process whose counter has not
    moved for `timeout_s` (SIGKILL, a crash, a hang outside Python's reach) or that says it
    failed makes each other process print `error: ...` naming it and exit with EXIT_PEER_LOST
    (os._exit: the main thread may be stuck in a collective that will never complete). A
    process that ends its run cleanly says so (`finish`) and is no longer watched.

    Why not JAX's own heartbeats: when they lapse the runtime aborts the process with a page of
    native log (SIGABRT), and jaxlib's hook for a custom callback fails to convert its status
    (std::bad_cast, seen in jaxlib 0.7.1 and 0.10.2). They remain the backstop. Not covered:
    process 0 itself dying takes the coordination service with it; the others then abort
    within about a second with JAX's native "Terminating process because the JAX distributed
    service detected fatal errors" (exit status 134)."""

    _current: Liveness | None = None
    PREFIX = "starpo/alive/"

    def __init__(self, client, me: int, count: int, timeout_s: float):
        self.client, self.me, self.count, self.timeout_s = client, me, count, float(timeout_s)
        self.state = "running"  # -> "done" | "failed" | "left" (stopped by the watch)
        self.exit_code = 1
        self._beat = 0

    @classmethod
    def start(cls, timeout_s: float) -> Liveness:
        import threading

        from jax._src import distributed  # the client of jax.distributed.initialize

        watch = cls(distributed.global_state.client, jax.process_index(), jax.process_count(),
                    timeout_s)
        watch._publish()
        threading.Thread(target=watch._loop, name="starpo-liveness", daemon=True).start()
        cls._current = watch
        return watch

    @classmethod
    def finish(cls, ok: bool = True, exit_code: int = 1) -> None:
        """This process is done (ok) or failed (exit_code: the status it will exit with):
        the others stop watching it, or stop too."""
        watch = cls._current
        if watch is not None and watch.state == "running":
            watch.state, watch.exit_code = ("done" if ok else "failed"), exit_code
            watch._publish()

    @classmethod
    def verdict(cls) -> None:
        """After a runtime error, which may be a collective that lost its peer (gloo fails at
        once with "Connection reset by peer", not naming the process): give the watch time to
        name a lost process (it then exits with EXIT_PEER_LOST); return if none is lost."""
        watch = cls._current
        if watch is not None and watch.state == "running":
            time.sleep(watch.timeout_s * 1.3)

    def _publish(self) -> None:
        self._beat += 1
        value = str(self._beat) if self.state == "running" else self.state
        self.client.key_value_set(f"{self.PREFIX}{self.me}", value, allow_overwrite=True)

    def _exit(self, message: str | None, code: int) -> None:
        import sys

        if self.state == "running":  # tell the others this one is leaving
            self.state = "left"
            with contextlib.suppress(Exception):  # the service may be gone too
                self._publish()
        if message:
            print(f"error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)

    def _loop(self) -> None:
        period = self.timeout_s / 10
        seen = {p: (None, time.monotonic()) for p in range(self.count) if p != self.me}
        while True:
            time.sleep(period)
            try:
                self._publish()
                values = dict(self.client.key_value_dir_get(self.PREFIX))
            except Exception as e:  # the coordination service (process 0) is gone
                if self.state == "done":  # shut down at the end of a finished run
                    return
                if self.state == "running":
                    self._exit(f"lost the coordination service on process 0 ({e}); stopping "
                               f"process {self.me} too", EXIT_PEER_LOST)
                self._exit(None, self.exit_code)
            now = time.monotonic()
            for p, (last, since) in list(seen.items()):
                value = values.get(f"{self.PREFIX}{p}", values.get(str(p)))
                if value == "done":
                    del seen[p]
                elif value in ("failed", "left"):
                    if self.state == "running":
                        why = ("failed (its own output says why)" if value == "failed" else
                               "stopped after losing another process")
                        self._exit(f"process {p} of {self.count} {why}; stopping process "
                                   f"{self.me} too", EXIT_PEER_LOST)
                    del seen[p]
                elif value != last:
                    seen[p] = (value, now)
                elif now - since > self.timeout_s:
                    if self.state == "running":
                        self._exit(f"process {p} of {self.count} is lost: no sign of life for "
                                   f"{now - since:.0f} s (mesh.heartbeat_timeout_s="
                                   f"{self.timeout_s:g}; killed, crashed or hung); stopping "
                                   f"process {self.me} too", EXIT_PEER_LOST)
                    del seen[p]
            if self.state == "failed" and not seen:  # the others have gone: do not wait on
                self._exit(None, self.exit_code)    # JAX's shutdown barrier for them


def processes_flagging(flag: bool) -> list[int]:
    """The ids of the processes whose `flag` is set, the same list on every process (an
    all-gather: every process must call this at the same point). One process: no collective."""
    if jax.process_count() == 1:
        return [0] if flag else []
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.asarray([int(bool(flag))], np.int32))
    return [int(p) for p in np.flatnonzero(np.asarray(flags).reshape(-1))]
