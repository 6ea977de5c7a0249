"""What the envs whose actions are text share (Countdown, Sudoku): `step` takes the answer
piece's bytes (int32[L], PAD after) instead of an action id, and there is no action lookup."""

import numpy as np

PAD = -1  # pads an answer's bytes


class TextActionEnv:
    """Class attributes of an env whose actions are text (mixed into its frozen dataclass):
    no legend, symbols or action names (every parsed answer is an action), `text_actions`,
    and `move_names`, the answers a solver writes (none by default; Sudoku's placements)."""

    legend = ""
    symbols = ()
    action_names = ()  # no action lookup: every parsed answer is an action
    text_actions = True  # step takes the answer's bytes
    num_actions = 0
    move_names = ()

    def name_to_action(self, state, index):
        raise ValueError(f"{type(self).__name__} actions are text: step takes the answer's bytes")


def answer_bytes(text: str, width: int | None = None) -> np.ndarray:
    """Host helper: a string as int32 bytes padded with PAD to `width` (default its length)."""
    raw = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    width = len(raw) if width is None else width
    if len(raw) > width:
        raise ValueError(f"answer of {len(raw)} bytes does not fit width {width}")
    return np.pad(raw, (0, width - len(raw)), constant_values=PAD)
