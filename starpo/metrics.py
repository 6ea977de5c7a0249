"""Run logs: metrics.jsonl, TensorBoard events, sample texts, the console summary line and
progress (`Progress`: a bar on a terminal, plain lines in a log file). The monitors that read
these scalars (the Echo Trap warning, RAGEN-2's stops) are `starpo/monitors.py`.

    <workdir>/metrics.jsonl                 one JSON object per logged step: {"step": n, name: x}
    <workdir>/tb/                           TensorBoard event files (tensorboardX)
    <workdir>/samples/<name>_<step>.txt     sample texts (dialogues), verbatim

metrics.jsonl is strict JSON: NaN and infinities are written as the strings "nan", "inf" and
"-inf" (JSON has no such numbers, and null would not say which it was); `read_jsonl` turns them
back into floats. Every line ends with a newline when complete, so a line without one is a write
torn by a crash: it is dropped by `read_jsonl`, `truncate_after` and a new `MetricsWriter`.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

import numpy as np

METRICS_FILE = "metrics.jsonl"
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _number(name: str, value) -> float:
    """A Python / numpy / jax scalar (or one-element array) -> float."""
    arr = np.asarray(value)
    if arr.size != 1 or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
        raise ValueError(f"metric {name!r} is not a number: {type(value).__name__} "
                         f"{arr.dtype}{list(arr.shape)}")
    return float(arr.reshape(()))


def _encode(x: float):
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else "inf" if x > 0 else "-inf")


def _decode(record: dict) -> dict:
    return {k: _NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in record.items()}


def _complete_lines(data: bytes) -> list[bytes]:
    """The lines of `data` with their newlines, without a torn (newline-less) last line."""
    return [ln for ln in data.splitlines(keepends=True) if ln.endswith(b"\n")]


def read_jsonl(path: str) -> list[dict]:
    """The records of a metrics.jsonl, non-finite values as floats, a torn last line dropped."""
    with open(path, "rb") as f:
        lines = _complete_lines(f.read())
    out = []
    for i, line in enumerate(lines, 1):
        try:
            out.append(_decode(json.loads(line)))
        except ValueError as e:
            raise ValueError(f"{path}:{i}: not a JSON object: {e}") from None
    return out


def truncate_after(path: str, step: int) -> None:
    """Drop the lines of `path` with a step above `step` (and a torn last line): on resume from
    the checkpoint of `step`, steps logged after it by the interrupted run are logged again.
    Atomic (temporary file + rename); no file, or nothing to drop: nothing happens."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return
    keep = []
    for i, line in enumerate(_complete_lines(data), 1):
        try:
            line_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{i}: not a metrics record: {e}") from None
        if line_step <= step:
            keep.append(line)
    new = b"".join(keep)
    if new == data:
        return
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(new)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _summary_writer_class():
    """tensorboardX.SummaryWriter. tensorboardX imports torch whenever it is installed, only to
    accept torch tensors: seconds of start-up and a second CUDA runtime in a JAX process. So
    torch is hidden from it, unless something imported torch already."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # makes `import torch` raise ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Appends to <workdir>/metrics.jsonl and, with `tensorboard`, to event files in
    <workdir>/tb.

    resume_step: resuming from the checkpoint of this step: `truncate_after` it, and tell
    TensorBoard to discard events of later steps from the earlier event files (`purge_step`).
    The JSONL file is reopened for every write, so a `truncate_after` of it at any time is safe.
    """

    def __init__(self, workdir: str, tensorboard: bool = True, resume_step: int | None = None):
        os.makedirs(workdir, exist_ok=True)
        self.workdir = workdir
        self.path = os.path.join(workdir, METRICS_FILE)
        # not resuming: only a torn last line goes (appending to it would garble two records)
        truncate_after(self.path, math.inf if resume_step is None else resume_step)
        self._tb = None
        if tensorboard:
            self._tb = _summary_writer_class()(logdir=os.path.join(workdir, "tb"), flush_secs=30,
                                     purge_step=None if resume_step is None else resume_step + 1)

    def write(self, step: int, scalars: dict) -> None:
        """One line {"step": step, **scalars} (values: Python / numpy / jax numbers), and one
        TensorBoard scalar each; flushed."""
        if "step" in scalars:
            raise ValueError("'step' is reserved for the step number")
        values = {name: _number(name, v) for name, v in scalars.items()}
        line = json.dumps({"step": int(step), **{k: _encode(v) for k, v in values.items()}},
                          allow_nan=False)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, step)
            self._tb.flush()

    def text(self, step: int, name: str, text: str) -> None:
        """A sample text: verbatim in <workdir>/samples/<name>_<step>.txt (name with every run
        of characters other than letters, digits, '.', '-', '_' as '_'), and as TensorBoard
        text, indented four spaces, which its markdown renders as preformatted (dialogues keep
        their line breaks and tags)."""
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name)
        samples = os.path.join(self.workdir, "samples")
        os.makedirs(samples, exist_ok=True)
        with open(os.path.join(samples, f"{safe}_{step}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
        if self._tb is not None:
            self._tb.add_text(name, "\n".join("    " + ln for ln in text.splitlines()), step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


class NullWriter:
    """A MetricsWriter that writes nothing (the other processes of a multi-host run)."""

    def write(self, step: int, scalars: dict) -> None:
        pass

    def text(self, step: int, name: str, text: str) -> None:
        pass

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------- console
# (label, metric name with '*' for one path component, format); in this order
SUMMARY_KEYS = (
    ("success", "train/*/success", "{:.2f}"),
    ("score", "train/*/score", "{:.2f}"),
    ("val success", "val/*/success", "{:.2f}"),
    ("entropy", "actor/entropy", "{:.2f}"),
    ("reward std", "rollout/in_group_std", "{:.2f}"),
    ("", "timing/step", "{:.1f} s"),
)


def reward_std_name(group_size: int) -> str:
    """The reward spread the console shows and the Echo Trap detector watches: the in-group std,
    or the batch's when every group is one episode (a group of one has no spread)."""
    return "rollout/in_group_std" if group_size > 1 else "rollout/batch_std"


def summary_keys(group_size: int) -> tuple:
    """SUMMARY_KEYS with the reward std of `reward_std_name(group_size)`."""
    name = reward_std_name(group_size)
    return tuple((label, name if label == "reward std" else pattern, fmt)
                 for label, pattern, fmt in SUMMARY_KEYS)


def summary_line(step: int, total_steps: int, scalars: dict, keys=SUMMARY_KEYS) -> str:
    """"step 12/200 | success 0.41 | score 0.35 | entropy 1.20 | reward std 0.31 | 3.1 s".

    Missing metrics are skipped. A pattern matching several names (one validation set per env
    tag) shows each, labelled with its '*' part: "val success[sokoban] 0.50".
    """
    parts = [f"step {step}/{total_steps}"]
    for label, pattern, fmt in keys:
        regex = re.compile(re.escape(pattern).replace(r"\*", "([^/]*)"))
        matches = [(m, name) for name in sorted(scalars) if (m := regex.fullmatch(name))]
        for m, name in matches:
            tag = f"[{m.group(1)}]" if len(matches) > 1 else ""
            value = fmt.format(float(scalars[name]))
            parts.append(f"{label}{tag} {value}" if label else value)
    return " | ".join(parts)


# ----------------------------------------------------------------------------- console
def say(line: str) -> None:
    """A console line on stdout, flushed at once: a log file being followed (`tail -f`) shows
    each step as it ends, and the lines keep their order among stderr's (`> log 2>&1`)."""
    print(line, flush=True)


def is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class Progress:
    """The steps `range(start, total)` of a phase, and the console lines written during them.

    A tqdm bar is drawn on `stream` (stderr) only when `show` and that stream is a terminal;
    `write(line)` then clears it, has `log` print the line, and redraws it below, so a line
    never shares the bar's. Redirected to a file or a pipe no bar is drawn: its carriage-return
    frames would lead every line written after them (`grep '^step' log` would miss the steps).
    There the step lines are the progress, and `write` is `log` alone.
    """

    def __init__(self, start: int, total: int, desc: str, *, show: bool = True, log=say,
                 stream=None):
        from tqdm import tqdm

        self._stream = sys.stderr if stream is None else stream
        self.drawn = bool(show) and is_terminal(self._stream)
        self._log = log
        self._bar = tqdm(range(start, total), initial=start, total=total, desc=desc,
                         unit="step", dynamic_ncols=True, file=self._stream,
                         disable=not self.drawn)

    def __iter__(self):
        return iter(self._bar)

    def write(self, line: str) -> None:
        if not self.drawn:
            self._log(line)
            return
        with self._bar.external_write_mode(file=self._stream):
            self._log(line)

    def close(self) -> None:
        self._bar.close()


# ----------------------------------------------------------------------------- echo trap
