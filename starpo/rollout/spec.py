"""The settings every rollout of a run shares (`RolloutSpec`) and the format penalty."""

from __future__ import annotations

import dataclasses


FORMAT_PENALTY = -0.1
CONTEXT_MULTIPLE = 64  # an episode's reachable length is rounded up to a multiple of this
TRAIN, VALIDATION = 0, 1  # seed streams


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """The settings every rollout of a run shares, plain, mixed or scripted (hashable).

    max_turn: turns per episode; max_new_tokens: reply budget per turn; max_context: at most
    this many tokens per episode (a loose bound: the KV cache and the Trajectory's T are the
    length an episode can reach, prompt prefix + max_turn x (observation chunk +
    max_new_tokens) rounded up to a multiple of 64, where that is shorter; the samples are
    the same either way, see `context_length`); thinking: `<think>` before `<answer>`;
    max_actions_per_turn / max_actions_per_traj: action budgets of every env (None: each env's
    reference budget); length_prompt: the N of the prompt's "Max response length: N words
    (tokens)" (None: max_new_tokens, as the reference). Sampling (model rollouts only): top_k,
    top_p; cache_dtype of the KV cache; prefill_dtype: matmul dtype of appending the prompt
    and the observations (many tokens per row: compute-bound), replies decode in the model's
    dtype (None: that for both); decode_windows: see `sampler.Sampler.decode_windows` (early
    turns attend over the start of the context only); context_window: a turn sees the prompt
    prefix and the last context_window turns only, its own included (0 = the whole dialogue;
    an attention mask, see `model.TurnWindow`; the update must use the same).
    """

    max_turn: int = 5
    max_new_tokens: int = 100
    max_context: int = 2048
    thinking: bool = True
    max_actions_per_turn: int | None = None
    max_actions_per_traj: int | None = None
    length_prompt: int | None = None
    top_k: int = 0
    top_p: float = 1.0
    cache_dtype: object = None
    prefill_dtype: str | None = None
    decode_windows: int = 1
    context_window: int = 0

    @property
    def length_in_prompt(self) -> int:
        return self.length_prompt or self.max_new_tokens
