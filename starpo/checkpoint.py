"""Training checkpoints: an orbax CheckpointManager, with value checks and one-line errors.

    ckpt = Checkpointer("<workdir>/checkpoints", keep=3)   # a local path or gs://...
    ckpt.save(step, state, meta)                       # blocking; complete on return
    state, meta = ckpt.restore(None, jax.eval_shape(lambda s: s, state))

Layout of <directory>/<step>/: `state/` (the state pytree: orbax PyTree format, OCDBT, zarr,
zstd), `meta/` (the meta dict, JSON), `checks/` (JSON: a fingerprint of every array of the
state and a crc32 of the meta). Paths go through `etils.epath`, so `gs://` works.

Orbax does the rest: saves are synchronous (no async checkpointing: nothing is left
half-written in a background thread when SIGTERM arrives); a step is written under
`<step>.orbax-checkpoint-tmp-*` and renamed when complete (on GCS: marked by
`commit_success.txt`), so an interrupted write is never listed as a step, and a writable
Checkpointer has orbax remove such leftovers (before its first save); `keep` is orbax's
`max_to_keep`; orbax places the barriers between processes on a multi-host run.

What damage to a complete step is detected, and how (measured with orbax 0.12, defaults:
OCDBT, zarr2, zstd):
- a deleted or truncated array data file, a garbled OCDBT manifest or B-tree node (these
  carry a crc32c; small arrays live inline in the nodes): tensorstore fails the read;
- a garbled array chunk: NOT seen by orbax (chunk bytes carry no checksum, and zstd stores
  incompressible data such as float weights as raw blocks: wrong values, silently). Hence
  `checks/`: at save, a 32-bit position-weighted sum of every array's bits, computed where the
  array lives (one jitted reduction per array, sharded like it); after a restore, the same sum
  of the restored arrays must match. A change of any one element (of up to 32 bits) is always
  caught; no file is read twice;
- a deleted, truncated or garbled `_METADATA`, `meta/` or `checks/`: a JSON or orbax error, a
  tree that no longer matches the target, or a checks mismatch.
Each gives a `CheckpointError` naming the step; a damaged step is never skipped in favour of an
older one, which would hide lost training. Files a restore never reads (the per-process OCDBT
manifest and B-tree nodes once merged, `_sharding`, commit markers) may be damaged unnoticed:
the values are still right. Not covered: a power loss right after a save (orbax fsyncs array
data, not its small metadata files), which then reads as damage.

The state is any pytree of arrays (a `update.TrainState`, dicts, optax states); None leaves
and typed PRNG keys (`jax.random.key`) round-trip.
"""

from __future__ import annotations

import json
import logging
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath


class CheckpointError(ValueError):
    """A checkpoint could not be written or read; the message is one line naming where and what."""


class _QuietOrbax(logging.Filter):
    """Drops orbax's INFO and WARNING records (per-save chatter); its errors still show."""

    def filter(self, record):
        return (record.levelno >= logging.ERROR
                or "/orbax/" not in record.pathname.replace("\\", "/"))


logging.getLogger("absl").addFilter(_QuietOrbax())


def _one_line(e: BaseException) -> str:
    """The first non-empty line of the message of an exception's root cause (orbax wraps
    tensorstore's concise errors in pages of JSON specs), at most 400 characters."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else type(e).__name__
    return text if len(text) <= 400 else text[:397] + "..."


# ----------------------------------------------------------------------------- value checks
def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


@jax.jit
def _fingerprint(x):
    """sum_i bits(x_i) * odd(i) mod 2**32 over the elements' bit patterns: a change of any one
    element always changes it; computed where x lives (a sharded sum)."""
    if _is_key(x):
        x = jax.random.key_data(x)
    if jnp.iscomplexobj(x):
        x = jnp.stack([x.real, x.imag])
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))
    if bits.dtype == jnp.uint64:  # only with jax_enable_x64
        bits = bits ^ (bits >> 32)
    index = jnp.zeros(x.shape, jnp.uint32)
    for d, n in enumerate(x.shape):  # the flat index, without reshaping a sharded array
        index = index * jnp.uint32(n) + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d)
    odd = index * jnp.uint32(0x9E3779B1) | jnp.uint32(1)
    return jnp.sum(bits.astype(jnp.uint32) * odd, dtype=jnp.uint32)


def _fingerprints(flat: dict) -> dict:
    """One process: all dispatched, then fetched. Several: one at a time, since each sum of a
    sharded array is a cross-process collective, and XLA:CPU may run programs dispatched
    together in a different order on each process, where gloo's all-reduces then wait for each
    other for good (2 processes x 2 CPU devices: about 1 save in 5 hung, seen here)."""
    def fetch(s):
        return int(np.asarray(s.addressable_data(0)))

    if jax.process_count() > 1:
        return {path: fetch(_fingerprint(x)) for path, x in flat.items()}
    sums = {path: _fingerprint(x) for path, x in flat.items()}
    return {path: fetch(s) for path, s in sums.items()}


def _crc(meta: dict) -> int:
    return zlib.crc32(json.dumps(meta, sort_keys=True).encode())


# ----------------------------------------------------------------------------- trees
def _path_str(path) -> str:
    """'actor_opt_state/1/0/mu/w': jax key paths in the spelling of orbax's metadata tree
    (attribute and namedtuple fields by name, sequence items by index)."""
    parts = []
    for k in path:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _flat(tree) -> dict:
    return {_path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _abstract(target):
    """Every leaf -> jax.ShapeDtypeStruct with a sharding (the leaf's own, else the default
    device's), so that everything restores as jax.Array (typed keys re-wrapped) rather than as
    the numpy arrays orbax returns for leaves without a sharding."""
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def leaf(x):
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        return jax.ShapeDtypeStruct(x.shape if hasattr(x, "shape") else np.shape(x), dtype,
                                    sharding=getattr(x, "sharding", None) or default)

    return jax.tree.map(leaf, target)


def _stored_shape(x: jax.ShapeDtypeStruct) -> tuple:
    """Shape on disk: typed PRNG keys are stored as their key data (trailing key dims)."""
    if _is_key(x):
        return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype)).shape
    return tuple(x.shape)


def _check_tree(saved: dict, target: dict, where: str, partial: bool) -> None:
    """Same paths and shapes (dtypes may differ: the target's are restored). One-line errors
    instead of orbax's multi-page tree diffs."""

    def some(paths):
        paths = sorted(paths)
        return paths[0] + (f" (and {len(paths) - 1} more)" if len(paths) > 1 else "")

    missing = target.keys() - saved.keys()
    if missing:
        raise CheckpointError(f"checkpoint {where} does not match the target: it has no "
                              f"{some(missing)}")
    extra = saved.keys() - target.keys()
    if extra and not partial:
        raise CheckpointError(f"checkpoint {where} does not match the target: it has "
                              f"{some(extra)}, which the target lacks")
    for path in sorted(target):
        want, have = _stored_shape(target[path]), tuple(saved[path].shape)
        if want != have:
            raise CheckpointError(f"checkpoint {where} does not match the target: {path} has "
                                  f"shape {have}, the target wants {want}")


def _jsonable(meta, where: str) -> dict:
    """A JSON round trip of `meta`, numpy / jax scalars and arrays turned into numbers / lists."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {where}: meta must be a dict, got "
                              f"{type(meta).__name__}")

    def default(x):
        if isinstance(x, (np.ndarray, np.generic, jax.Array)):
            return np.asarray(x).tolist()
        raise TypeError(f"{type(x).__name__} is not JSON-serialisable")

    try:
        return json.loads(json.dumps(meta, default=default))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {where}: meta is not JSON: {e}") from None


# ----------------------------------------------------------------------------- checkpointer
class Checkpointer:
    """Numbered checkpoints of (state pytree, meta dict) in `directory`, the newest `keep` kept.

    read_only: for readers (eval, export): the directory must exist and is never modified.
    Otherwise the directory is created and checked writable here (a `CheckpointError` before
    training starts, not after the first step).
    """

    def __init__(self, directory, keep: int = 3, *, read_only: bool = False):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        # orbax saves only to absolute paths: a relative local one (the default workdir
        # runs/<config>) is taken from the current directory
        self.directory = epath.Path(directory)
        if "://" not in str(directory):
            self.directory = self.directory.absolute()
        self.keep = keep
        self.read_only = read_only
        self._saving = False
        if read_only:
            if not self.directory.is_dir():
                raise CheckpointError(f"checkpoint directory {self.directory} does not exist")
        else:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                probe = self.directory / f".write_test.{jax.process_index()}"
                probe.write_text("")
                probe.unlink()
            except Exception as e:  # OSError locally; gcsfs / tf.io errors on gs://
                raise CheckpointError(f"checkpoint directory {self.directory} is not writable: "
                                      f"{getattr(e, 'strerror', None) or _one_line(e)}") from None
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=False, read_only=read_only, create=False,
            max_to_keep=None if read_only else keep, cleanup_tmp_directories=not read_only)
        # PyTreeCheckpointHandler (not Standard) for its partial restore (`load_params`)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler(),
                           "checks": ocp.JsonCheckpointHandler()})

    def step_dir(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def steps(self) -> list[int]:
        """Complete checkpoints, ascending (read from storage: another process may write)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def _resolve(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        if step is None:
            return steps[-1]
        if int(step) not in steps:
            raise CheckpointError(f"no complete checkpoint for step {step} in {self.directory} "
                                  f"(complete: {', '.join(map(str, steps))})")
        return int(step)

    def save(self, step: int, state, meta: dict) -> None:
        """Write `state` (pytree of arrays; None leaves and typed keys allowed) and `meta` (a
        JSON-able dict; numpy / jax numbers are converted) as checkpoint `step`, then delete
        checkpoints older than the newest `keep`. Blocking: on return the checkpoint is
        complete. `step` must be above every existing step."""
        step = int(step)
        where = self.step_dir(step)
        if self.read_only:
            raise CheckpointError(f"checkpoint {where}: this Checkpointer is read-only")
        if self._saving:  # e.g. a signal handler saving while the main thread is in save()
            raise CheckpointError(f"checkpoint {where}: another save is in progress")
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise CheckpointError(f"checkpoint {where}: step {step} is not after the latest "
                                  f"checkpoint, step {latest}")
        meta = _jsonable(meta, where)
        self._saving = True
        try:
            checks = {"meta": _crc(meta), "state": _fingerprints(_flat(state))}
            saved = self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta),
                checks=ocp.args.JsonSave(checks)))
        except Exception as e:  # orbax / tensorstore / OS errors: disk full, bad leaf types...
            raise CheckpointError(f"checkpoint {where}: saving failed: {_one_line(e)}") from e
        finally:
            self._saving = False
        if not saved:
            raise CheckpointError(f"checkpoint {where}: orbax declined to save the step")

    def _read(self, step: int, what: str, **items) -> dict:
        """Orbax's restore of `items` (and the checks) of a step, errors as one line."""
        try:
            return self._manager.restore(step, args=ocp.args.Composite(
                checks=ocp.args.JsonRestore(), **items))
        except Exception as e:
            raise CheckpointError(f"checkpoint {self.step_dir(step)}: reading {what} failed: "
                                  f"{_one_line(e)}") from e

    def _saved_tree(self, step: int):
        """The state tree of a step as orbax saved it: leaves have .shape and .dtype."""
        try:
            saved = self._manager.item_metadata(step)["state"]
        except Exception as e:
            raise CheckpointError(f"checkpoint {self.step_dir(step)}: reading metadata failed: "
                                  f"{_one_line(e)}") from e
        return getattr(saved, "tree", saved)

    def _restore_state(self, step: int, target, partial: bool, **items):
        """(state restored into `target` and checked against its fingerprints, orbax's
        restore of the other `items` and the checks)."""
        where = self.step_dir(step)
        saved = _flat(self._saved_tree(step))
        target = _abstract(target)
        _check_tree(saved, _flat(target), where, partial)

        def as_saved(path, x):  # read in the saved dtype, cast after the check
            dtype = x.dtype if _is_key(x) else saved[_path_str(path)].dtype
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)

        read_as = jax.tree_util.tree_map_with_path(as_saved, target)
        out = self._read(step, "the state", state=ocp.args.PyTreeRestore(
            read_as, restore_args=ocp.checkpoint_utils.construct_restore_args(read_as),
            partial_restore=partial), **items)
        sums = out["checks"].get("state", {})
        for path, value in _fingerprints(_flat(out["state"])).items():
            if sums.get(path) != value:
                raise CheckpointError(f"checkpoint {where} is damaged: the values of {path} "
                                      f"do not match their fingerprint")
        state = jax.tree.map(lambda x, t: x if x.dtype == t.dtype else x.astype(t.dtype),
                             out["state"], target)
        return state, out

    def _checked_meta(self, step: int, out: dict) -> dict:
        if _crc(out["meta"]) != out["checks"].get("meta"):
            raise CheckpointError(f"checkpoint {self.step_dir(step)} is damaged: its meta does "
                                  f"not match its checksum")
        return out["meta"]

    def restore(self, step: int | None, target) -> tuple:
        """(state, meta) of checkpoint `step` (None: the latest complete one).

        target: a pytree of the saved structure whose leaves are arrays or jax.ShapeDtypeStruct
        (e.g. `jax.eval_shape` of a fresh state); the state comes back as jax.Arrays with the
        target's dtypes and shardings (a leaf without a sharding: the default device), so a
        checkpoint restores onto a different mesh than it was saved from.
        """
        step = self._resolve(step)
        state, out = self._restore_state(step, target, False, meta=ocp.args.JsonRestore())
        return state, self._checked_meta(step, out)

    def read_meta(self, step: int | None = None) -> dict:
        """The meta dict of a step (None: the latest), without reading the arrays."""
        step = self._resolve(step)
        return self._checked_meta(step, self._read(step, "meta", meta=ocp.args.JsonRestore()))

    def load_field(self, step: int | None, field: str, target=None):
        """One top-level field of the saved state (e.g. "actor_params"), reading only its
        arrays (orbax partial restore). target: that field's structure as in `restore`; None
        builds it from the checkpoint's own metadata (saved shapes and dtypes, plain nested
        dicts / lists, on the default device)."""
        step = self._resolve(step)
        if target is None:
            saved = self._saved_tree(step)
            if not isinstance(saved, dict) or field not in saved:
                raise CheckpointError(f"checkpoint {self.step_dir(step)} has no field "
                                      f"{field!r}")
            target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
                                  saved[field])
        state, _ = self._restore_state(step, {field: target}, partial=True)
        return state[field]

    def close(self) -> None:
        self._manager.close()


def read_meta(directory, step: int | None = None) -> dict:
    """The meta dict of a checkpoint (None: the latest) in `directory`, arrays untouched."""
    ckpt = Checkpointer(directory, read_only=True)
    try:
        return ckpt.read_meta(step)
    finally:
        ckpt.close()


def load_params(directory, step: int | None = None, target=None, *,
                field: str = "actor_params"):
    """The policy parameters (or another top-level `field`) of a checkpoint, for eval and
    export: only that field's arrays are read, not the optimiser states. target: as in
    `Checkpointer.load_field` (None: the saved shapes and dtypes, on the default device)."""
    ckpt = Checkpointer(directory, read_only=True)
    try:
        return ckpt.load_field(step, field, target)
    finally:
        ckpt.close()
