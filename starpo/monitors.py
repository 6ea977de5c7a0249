"""What the RL loop watches after each step, each one `Monitor`: the paper's Echo Trap warning,
RAGEN-2's template-collapse warning and its three early stops (a filter that kept nothing, the
reward std's fall, low validation success).

    for m in monitors(run.trainer, run.batch.group_size):
        lines, stop = m.observe(n, scalars)   # adds its scalars; warning lines; stop the run?
    meta[m.key] = m.state_dict()               # into each checkpoint, back on resume

A monitor reads the step's scalars (the validation's too, on a step that validated), adds its
own (`warning/...`, `early_stopped/...`), and says what to print and whether the run stops
there. The loop (`training._Loop`) runs them in order and prints their lines after the step's
summary line; adding one is its class here and a line in `monitors`.
"""

from __future__ import annotations

import collections
import math
from typing import Protocol

import numpy as np

from starpo import collapse as collapse_lib
from starpo.metrics import reward_std_name


class Monitor(Protocol):
    key: str  # its checkpoint meta key

    def observe(self, n: int, scalars: dict) -> tuple[list[str], bool]:
        """Add this monitor's scalars for step `n`; (warning lines, whether the run stops)."""

    def state_dict(self): ...

    def load_state_dict(self, d) -> None: ...


class EchoTrapDetector:
    """The paper's 'Echo Trap' early warning: reward std (rollout/in_group_std, or the batch's
    with one episode per group: `reward_std_name`) and policy entropy (actor/entropy) both fall
    sharply relative to their recent history.

    `update` is True when, with at least `min_history` (capped at `window`) earlier values
    recorded, both current values are below `drop` x the median of the previous `window` values.
    The median, not the mean: one unusually spread batch in the window would lift a mean enough
    to flag the next ordinary one. The warning marks the fall; once the low values fill the
    window it goes quiet again. Non-finite values (a metric missing this step) are not recorded
    and never warn.
    """

    def __init__(self, window: int = 10, drop: float = 0.5, min_history: int = 5):
        if window < 1 or min_history < 1:
            raise ValueError(f"window and min_history must be >= 1, got {window}, {min_history}")
        # a short window (a config knob) caps the default min_history rather than failing
        self.window, self.drop, self.min_history = window, drop, min(min_history, window)
        self._std = collections.deque(maxlen=window)
        self._entropy = collections.deque(maxlen=window)

    def update(self, reward_std: float, entropy: float) -> bool:
        reward_std, entropy = float(reward_std), float(entropy)
        if not (math.isfinite(reward_std) and math.isfinite(entropy)):
            return False
        fire = (len(self._std) >= self.min_history
                and reward_std < self.drop * float(np.median(self._std))
                and entropy < self.drop * float(np.median(self._entropy)))
        self._std.append(reward_std)
        self._entropy.append(entropy)
        return fire

    def state_dict(self) -> dict:
        """The recorded history (JSON-able: goes into checkpoint meta)."""
        return {"reward_std": list(self._std), "entropy": list(self._entropy)}

    def load_state_dict(self, d: dict) -> None:
        self._std.clear()
        self._std.extend(float(x) for x in d["reward_std"])
        self._entropy.clear()
        self._entropy.extend(float(x) for x in d["entropy"])


class RewardStdStop:
    """RAGEN-2's reward-variance early stop (`agent_trainer.py`; on there, `trainer.
    reward_std_stop_steps` here): its base is the mean in-group reward std of the first `steps`
    steps whose filter kept a group; after those, `steps` such steps in a row all below `ratio`
    x the base stop the run. A scale-free test, so the std's normalisation (n or n - 1) does not
    matter; with groups of one episode the std is 0 throughout and it never stops (RAGEN-2's is
    NaN, and never stops either)."""

    def __init__(self, steps: int = 10, ratio: float = 0.1):
        self.steps, self.ratio = steps, ratio
        self.first: list[float] = []
        self.recent = collections.deque(maxlen=max(steps, 1))

    @property
    def base(self) -> float | None:
        return sum(self.first) / len(self.first) if len(self.first) == self.steps else None

    def update(self, std: float) -> bool:
        """Record one step's in-group reward std (steps whose filter kept nothing are not
        passed); True when the run should stop."""
        if self.steps <= 0:
            return False
        if self.base is None:
            self.first.append(float(std))
            return False
        self.recent.append(float(std))
        return (len(self.recent) == self.steps
                and all(v < self.ratio * self.base for v in self.recent))

    def state_dict(self) -> dict:
        return {"first": list(self.first), "recent": list(self.recent)}

    def load_state_dict(self, d: dict | None) -> None:
        d = d or {}
        self.first = [float(x) for x in d.get("first", [])]
        self.recent.clear()
        self.recent.extend(float(x) for x in d.get("recent", []))


class LowSuccessStop:
    """RAGEN-2's low-validation-success early stop (`agent_trainer.py`; on there, `trainer.
    low_success_stop_validations` here): a validated tag whose success is below `threshold`
    (1%) at `validations` validations in a row stops the run (the one before training does not
    count, as RAGEN-2's runs outside its loop)."""

    def __init__(self, validations: int = 5, threshold: float = 0.01):
        self.validations, self.threshold = validations, threshold
        self.low: dict[str, int] = {}

    def update(self, scalars: dict) -> list[str]:
        """Count a validation's `val/<tag>/success` scalars; the tags that stop the run."""
        if self.validations <= 0:
            return []
        for name, value in scalars.items():
            if name.startswith("val/") and name.endswith("/success"):
                self.low[name] = self.low.get(name, 0) + 1 if value < self.threshold else 0
        return self.stopping()

    def stopping(self) -> list[str]:
        """The success scalars that have been low for `validations` validations in a row."""
        return [name for name, n in self.low.items() if 0 < self.validations <= n]

    def state_dict(self) -> dict:
        return dict(self.low)

    def load_state_dict(self, d: dict | None) -> None:
        self.low = {k: int(v) for k, v in (d or {}).items()}


# ----------------------------------------------------------------------------- the monitors
class EchoTrap:
    """The Echo Trap warning (`EchoTrapDetector`), `warning/echo_trap`; it stops the run under
    `trainer.stop_on_collapse`."""

    key = "collapse_detector"

    def __init__(self, window: int, stop: bool, group_size: int):
        self.detector, self.stop = EchoTrapDetector(window=window), stop
        self.std_name = reward_std_name(group_size)

    def observe(self, n, scalars):
        fired = self.detector.update(scalars.get(self.std_name, float("nan")),
                                     scalars.get("actor/entropy", float("nan")))
        scalars["warning/echo_trap"] = float(fired)
        lines = [f"warning: step {n}: reward std and entropy both fell sharply (Echo Trap); "
                 "consider a lower lr, the StarPO-S filter or a critic"] if fired else []
        return lines, bool(fired and self.stop)

    def state_dict(self):
        return self.detector.state_dict()

    def load_state_dict(self, d):
        if d is not None:
            self.detector.load_state_dict(d)


class TemplateCollapseWarning:
    """RAGEN-2's template-collapse diagnostic's warning, `warning/template_collapse`, on the
    steps it ran: its MI estimate below `trainer.collapse_mi_warn` (`collapse.warns`)."""

    key = ""  # nothing to keep (the diagnostic's own state is `training`'s)

    def __init__(self, threshold: float):
        self.threshold = threshold

    def observe(self, n, scalars):
        if "collapse/mi_estimate" not in scalars:  # the diagnostic did not run this step
            return [], False
        warn = collapse_lib.warns(scalars, self.threshold)
        scalars["warning/template_collapse"] = float(warn)
        if not warn:
            return [], False
        return [f"warning: step {n}: template collapse: the first reply hardly depends on "
                f"the prompt (MI estimate {scalars['collapse/mi_estimate']:.4f} nats per "
                f"token < trainer.collapse_mi_warn {self.threshold}, "
                f"retrieval {scalars['collapse/retrieval_accuracy']:.2f} vs chance "
                f"{scalars['collapse/retrieval_chance_level']:.2f})"], False

    def state_dict(self):
        return None

    def load_state_dict(self, d):
        pass


class EmptyFilterStop:
    """RAGEN-2's stop after `steps` steps in a row whose rollout filter kept no group (the batch
    made no update): `rollout/consecutive_empty_after_filter_steps`; 0 = never."""

    key = "empty_filter_steps"

    def __init__(self, steps: int):
        self.steps, self.empty = steps, 0

    def observe(self, n, scalars):
        self.empty = self.empty + 1 if scalars.get("rollout/kept_groups", 1.0) == 0 else 0
        scalars["rollout/consecutive_empty_after_filter_steps"] = float(self.empty)
        if not 0 < self.steps <= self.empty:
            return [], False
        return [f"warning: step {n}: the rollout filter kept no group {self.empty} steps in a "
                f"row (trainer.rollout_filter_empty_stop_steps={self.steps}): stopping"], True

    def state_dict(self):
        return self.empty

    def load_state_dict(self, d):
        self.empty = int(d or 0)  # a checkpoint saved before it kept the count: 0


class _Stop:
    """A monitor around one of RAGEN-2's stop counters (`self.stop`, whose state is its own):
    where `fires(scalars)`, its `scalar` = 1 and `line(n)` printed, and the run stops."""

    scalar = ""

    def observe(self, n, scalars):
        if not self.fires(scalars):
            return [], False
        scalars[self.scalar] = 1.0
        return [self.line(n)], True

    def state_dict(self):
        return self.stop.state_dict()

    def load_state_dict(self, d):
        self.stop.load_state_dict(d)


class RewardStdCollapse(_Stop):
    """RAGEN-2's reward-variance stop (`RewardStdStop`) over the steps whose filter kept a
    group."""

    key, scalar = "reward_std_stop", "early_stopped/reward_variance_collapse"

    def __init__(self, steps: int):
        self.stop = RewardStdStop(steps)

    def fires(self, scalars) -> bool:
        return (not scalars.get("rollout/consecutive_empty_after_filter_steps")
                and "rollout/in_group_std" in scalars
                and self.stop.update(scalars["rollout/in_group_std"]))

    def line(self, n) -> str:
        k = self.stop.steps
        return (f"warning: step {n}: the in-group reward std stayed below a tenth of its first "
                f"{k} steps' mean ({self.stop.base:.4g}) {k} steps in a row "
                f"(trainer.reward_std_stop_steps={k}): stopping")


class LowValidationSuccess(_Stop):
    """RAGEN-2's low-validation-success stop (`LowSuccessStop`) on the steps that validated."""

    key, scalar = "low_success_stop", "early_stopped/low_validation_success"

    def __init__(self, validations: int):
        self.stop = LowSuccessStop(validations)

    def fires(self, scalars) -> bool:
        return any(k.startswith("val/") for k in scalars) and bool(self.stop.update(scalars))

    def line(self, n) -> str:
        k = self.stop.validations
        return (f"warning: step {n}: validation success below 1% {k} validations in a row on "
                f"{', '.join(self.stop.stopping())} "
                f"(trainer.low_success_stop_validations={k}): stopping")


def monitors(trainer, group_size: int) -> list[Monitor]:
    """A run's monitors (`trainer.*` knobs, a `schema.Trainer`), in the order they run and print."""
    return [EchoTrap(trainer.collapse_window, trainer.stop_on_collapse, group_size),
            TemplateCollapseWarning(trainer.collapse_mi_warn),
            EmptyFilterStop(trainer.rollout_filter_empty_stop_steps),
            RewardStdCollapse(trainer.reward_std_stop_steps),
            LowValidationSuccess(trainer.low_success_stop_validations)]
