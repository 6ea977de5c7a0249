"""Training checkpoints: orbax underneath, integrity checks and one-line errors on top.

    ckpt = Checkpointer("<workdir>/checkpoints", keep=3)
    ckpt.save(step, state, meta)                       # blocking; complete and durable on return
    state, meta = ckpt.restore(None, jax.eval_shape(lambda s: s, state))

Layout of <directory>:

    <step>/state/...          the state pytree (orbax PyTree format, OCDBT)
    <step>/meta/metadata      the meta dict (JSON)
    <step>/CHECKSUMS.json     size and crc32 of every other file of the step; written last

A step is complete when its CHECKSUMS.json exists. Orbax writes a step into
`<step>.orbax-checkpoint-tmp-*` and renames it when done, so an interrupted write never looks
like a step; CHECKSUMS.json is written (after fsyncing every file) once orbax has renamed, so a
crash between the two leaves a step without it, which is ignored and, by the next writable
Checkpointer, removed. The checksums exist because orbax stores raw chunk bytes: a garbled array
file otherwise restores silently with wrong values. Every restore verifies them first (crc32
runs at several GB/s, a small cost next to reading the arrays), so damage to a *complete* step
(a truncated, garbled or deleted file) raises `CheckpointError` naming the step and the file;
it is never skipped in favour of an older step, which would hide lost training.

The state is any pytree of arrays (a `trainer.TrainState`, dicts, optax states); None leaves
and typed PRNG keys (`jax.random.key`) round-trip. Saves are synchronous (no async
checkpointing: nothing is left half-written in a background thread when SIGTERM arrives).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import zlib

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging

CHECKSUMS = "CHECKSUMS.json"
_STEP_NAME = re.compile(r"\d+", re.ASCII)
_ORBAX_TMP_NAME = re.compile(r"\d+\.orbax-checkpoint-tmp-.*", re.ASCII)  # orbax's unfinished write


class CheckpointError(ValueError):
    """A checkpoint could not be written or read; the message is one line naming where and what."""


class _QuietOrbax(logging.Filter):
    """Drops orbax's INFO and WARNING records (per-save chatter, and warnings about situations
    this module handles itself, e.g. read-only managers); its errors still show."""

    def filter(self, record):
        return record.levelno >= logging.ERROR or "/orbax/" not in record.pathname.replace(
            os.sep, "/")


logging.getLogger("absl").addFilter(_QuietOrbax())


def _one_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message (orbax and tensorstore errors run to
    pages of JSON specs), at most 300 characters."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# ----------------------------------------------------------------------------- integrity
def _step_files(step_dir: str):
    """(relative path with '/', full path) of every file of a step but the checksum file."""
    for root, _, files in os.walk(step_dir):
        for name in sorted(files):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, step_dir).replace(os.sep, "/")
            if rel not in (CHECKSUMS, CHECKSUMS + ".tmp"):
                yield rel, full


def _crc32(path: str, sync: bool = False) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
        if sync:
            os.fsync(f.fileno())
    return crc


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _seal(step_dir: str) -> None:
    """Fsync every file and directory of a finalised step (orbax fsyncs array data but not its
    metadata files or the rename), then write CHECKSUMS.json atomically: the step's complete
    marker, durable only after everything it vouches for."""
    sums = {rel: [os.path.getsize(full), _crc32(full, sync=True)]
            for rel, full in _step_files(step_dir)}
    for root, _, _ in os.walk(step_dir):
        _fsync_dir(root)
    tmp = os.path.join(step_dir, CHECKSUMS + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(sums, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, CHECKSUMS))
    _fsync_dir(step_dir)
    _fsync_dir(os.path.dirname(step_dir))


def _verify(step_dir: str, prefix: str = "") -> None:
    """Check the files of a step whose path starts with `prefix` against CHECKSUMS.json."""
    try:
        with open(os.path.join(step_dir, CHECKSUMS), encoding="utf-8") as f:
            sums = json.load(f)
        items = [(rel, int(size), int(crc)) for rel, (size, crc) in sums.items()]
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {step_dir} is corrupt: {CHECKSUMS} is unreadable "
                              f"({_one_line(e)})") from None
    for rel, size, crc in sorted(items):
        if not rel.startswith(prefix):
            continue
        full = os.path.join(step_dir, *rel.split("/"))
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint {step_dir} is corrupt: {rel} is missing")
        if os.path.getsize(full) != size:
            raise CheckpointError(f"checkpoint {step_dir} is corrupt: {rel} has "
                                  f"{os.path.getsize(full)} bytes, {size} were written")
        if _crc32(full) != crc:
            raise CheckpointError(f"checkpoint {step_dir} is corrupt: {rel} does not match its "
                                  f"checksum")


def _complete_steps(directory: str) -> list[int]:
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(n) for n in names if _STEP_NAME.fullmatch(n)
                  and os.path.isfile(os.path.join(directory, n, CHECKSUMS)))


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
        return jax.ShapeDtypeStruct(np.shape(x) if not hasattr(x, "shape") else x.shape, dtype,
                                    sharding=getattr(x, "sharding", None) or default)

    return jax.tree.map(leaf, target)


def _stored_shape(x: jax.ShapeDtypeStruct) -> tuple:
    """Shape on disk: typed PRNG keys are stored as their key data (trailing key dims)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
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
def _lead() -> bool:
    """The process that writes the seal files (every process writes its own array shards)."""
    return jax.process_index() == 0


def _sync(name: str) -> None:
    """A barrier across processes on a multi-host run (nothing on one host)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class Checkpointer:
    """Numbered checkpoints of (state pytree, meta dict) in `directory`, the newest `keep` kept.

    read_only: for readers (eval, export): the directory must exist and is never modified.
    Otherwise the directory is created and checked writable here (a `CheckpointError` before
    training starts, not after the first step), and steps left incomplete by a crash are removed.
    """

    def __init__(self, directory: str, keep: int = 3, *, read_only: bool = False):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = os.path.abspath(directory)
        self.keep = keep
        self.read_only = read_only
        self._saving = False
        if read_only:
            if not os.path.isdir(self.directory):
                raise CheckpointError(f"checkpoint directory {self.directory} does not exist")
        else:
            try:
                os.makedirs(self.directory, exist_ok=True)
                fd, probe = tempfile.mkstemp(prefix=".write_test", dir=self.directory)
                os.close(fd)
                os.remove(probe)
            except OSError as e:
                raise CheckpointError(f"checkpoint directory {self.directory} is not writable: "
                                      f"{e.strerror or e}") from None
            if _lead():
                self._remove_incomplete()
            _sync("starpo_checkpoint_open")
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=False, read_only=read_only, create=False,
            preservation_policy=ocp.checkpoint_managers.LatestN(None),  # `keep` is ours: below
        )
        # PyTreeCheckpointHandler (not Standard) for its partial restore (`load_params`)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})

    def _remove_incomplete(self) -> None:
        """Orbax's temporary directories (a crash mid-write) and step directories without
        CHECKSUMS.json (a crash after orbax's rename, before the seal, or during a deletion).
        Removed before orbax lists steps, so that it never counts or collides with them. (Not
        orbax's own `cleanup_tmp_directories`: it only recognises temporary directories that
        got as far as their metadata file.)"""
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if os.path.isdir(path) and (
                    _ORBAX_TMP_NAME.fullmatch(name) or _STEP_NAME.fullmatch(name)
                    and not os.path.isfile(os.path.join(path, CHECKSUMS))):
                absl_logging.warning("removing incomplete checkpoint %s (an interrupted save)",
                                     path)
                shutil.rmtree(path)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def steps(self) -> list[int]:
        """Complete checkpoints, ascending (read from disk: another process may be writing)."""
        return _complete_steps(self.directory)

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
        complete checkpoints older than the newest `keep`. Blocking: on return the checkpoint is
        complete and on stable storage. `step` must be above every existing step."""
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
            saved = self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)))
            if not saved:
                raise CheckpointError(f"checkpoint {where}: orbax declined to save the step")
            if _lead():  # on several hosts: one writes the seal, after all have written
                _seal(where)
            _sync("starpo_checkpoint_sealed")
        except CheckpointError:
            raise
        except Exception as e:  # orbax / tensorstore / OS errors: disk full, bad leaf types...
            raise CheckpointError(f"checkpoint {where}: saving failed: {_one_line(e)}") from e
        finally:
            self._saving = False
        for old in self.steps()[:-self.keep]:
            # unseal first: a crash mid-deletion leaves an incomplete step, not a corrupt one
            if _lead():
                os.remove(os.path.join(self.step_dir(old), CHECKSUMS))
            _sync("starpo_checkpoint_unsealed")
            self._manager.delete(old)

    def _saved_tree(self, step: int) -> dict:
        """{path: orbax ArrayMetadata (.shape, .dtype)} of a step's state."""
        meta = self._manager.item_metadata(step)["state"]
        return _flat(getattr(meta, "tree", meta))

    def _restore_state(self, step: int, target, partial: bool):
        """(state, meta) restored into `target` (already checked against the files)."""
        where = self.step_dir(step)
        try:
            target = _abstract(target)
            _check_tree(self._saved_tree(step), _flat(target), where, partial)
            out = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                    partial_restore=partial),
                meta=ocp.args.JsonRestore()))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"checkpoint {where}: restoring failed: {_one_line(e)}") from e
        return out["state"], out["meta"]

    def restore(self, step: int | None, target) -> tuple:
        """(state, meta) of checkpoint `step` (None: the latest complete one).

        target: a pytree of the saved structure whose leaves are arrays or jax.ShapeDtypeStruct
        (e.g. `jax.eval_shape` of a fresh state); the state comes back as jax.Arrays with the
        target's dtypes and shardings (a leaf without a sharding: the default device), so a
        checkpoint restores onto a different mesh than it was saved from.
        """
        step = self._resolve(step)
        _verify(self.step_dir(step))
        return self._restore_state(step, target, partial=False)

    def read_meta(self, step: int | None = None) -> dict:
        """The meta dict of a step (None: the latest), without reading the arrays."""
        step = self._resolve(step)
        where = self.step_dir(step)
        _verify(where, prefix="meta/")
        try:
            return self._manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:
            raise CheckpointError(f"checkpoint {where}: reading meta failed: {_one_line(e)}"
                                  ) from e

    def load_field(self, step: int | None, field: str, target=None):
        """One top-level field of the saved state (e.g. "actor_params"), reading only its
        arrays (orbax partial restore). target: that field's structure as in `restore`; None
        builds it from the checkpoint's own metadata (saved shapes and dtypes, plain nested
        dicts / lists, on the default device)."""
        step = self._resolve(step)
        where = self.step_dir(step)
        _verify(where, prefix="state/")
        if target is None:
            try:
                saved = self._manager.item_metadata(step)["state"]
                saved = getattr(saved, "tree", saved)
            except Exception as e:
                raise CheckpointError(f"checkpoint {where}: reading metadata failed: "
                                      f"{_one_line(e)}") from e
            if not isinstance(saved, dict) or field not in saved:
                raise CheckpointError(f"checkpoint {where} has no field {field!r}")
            target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
                                  saved[field])
        state, _ = self._restore_state(step, {field: target}, partial=True)
        return state[field]

    def close(self) -> None:
        self._manager.close()


def read_meta(directory: str, step: int | None = None) -> dict:
    """The meta dict of a checkpoint (None: the latest) in `directory`, arrays untouched."""
    ckpt = Checkpointer(directory, read_only=True)
    try:
        return ckpt.read_meta(step)
    finally:
        ckpt.close()


def load_params(directory: str, step: int | None = None, target=None, *,
                field: str = "actor_params"):
    """The policy parameters (or another top-level `field`) of a checkpoint, for eval and
    export: only that field's arrays are read, not the optimiser states. target: as in
    `Checkpointer.load_field` (None: the saved shapes and dtypes, on the default device)."""
    ckpt = Checkpointer(directory, read_only=True)
    try:
        return ckpt.load_field(step, field, target)
    finally:
        ckpt.close()
